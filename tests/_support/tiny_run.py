"""A tiny training set-up without files: the tiny CLIP of models.tiny and an in-memory loader of `Batch`es.

`ToyLoader` mimics data.SampleLoader's contract for the trainer (set_epoch, state_dict / load_state_dict, len,
iteration from the saved position) and shards every global batch across ranks by rows, so that 1 process with
batch B and 2 processes with B/2 each see the same global batches.
"""

from __future__ import annotations

import random

import torch

from sharpclip.config import TrainConfig
from sharpclip.data.schema import Batch
from sharpclip.data.transforms import TextTokenizer
from sharpclip.models.tiny import TINY_WORDS, tiny_model

COLOURS = ["red", "green", "blue", "yellow", "purple", "orange", "white", "black"]
SHAPES = ["square", "circle", "triangle", "star", "hexagon", "diamond", "cross", "ring"]


def caption(i: int) -> str:
    rng = random.Random(i)
    parts = [f"a {rng.choice(['small', 'large'])} {rng.choice(COLOURS)} {rng.choice(SHAPES)}" for _ in range(3)]
    return f"{parts[0]} left of {parts[1]} and {parts[2]} at the top ."


class ToyLoader:
    def __init__(self, tokenizer, n: int = 64, batch_size: int = 16, rank: int = 0, world: int = 1, seed: int = 0,
                 edits: bool = False, deal: int = 1):  # fmt: skip
        self.tokenize = TextTokenizer(tokenizer, 77)
        self.n, self.batch_size, self.rank, self.world, self.seed = n, batch_size, rank, world, seed
        self.edits = edits
        self.deal = deal  # one process holding what `deal` ranks would, in rank order (their batches concatenated)
        g = torch.Generator().manual_seed(seed)
        self.pixels = torch.randn(n, 3, 32, 32, generator=g)
        self.captions = [caption(i) for i in range(n)]
        self.epoch, self.start = 0, 0

    def __len__(self) -> int:
        return self.n // self.batch_size

    def set_epoch(self, epoch: int) -> None:
        if epoch != self.epoch:
            self.epoch, self.start = epoch, 0

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "start": self.start, "batches_done": self.start}  # global batches: any world

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.epoch, self.start = state["epoch"], state["start"]

    def _batch(self, rows: list[int]) -> Batch:
        local = rows[self.rank :: self.world] if self.world > 1 else rows
        local = sorted(local)  # a rank's rows in a fixed order; edit pairs are adjacent (2k, 2k+1)
        if self.world == 1 and self.deal > 1:
            local = [i for r in range(self.deal) for i in sorted(rows[r :: self.deal])]
        ids, mask = self.tokenize([self.captions[i] for i in local])
        batch = Batch(
            ids=[f"toy-{i}" for i in local],
            pixel_values=self.pixels[local],
            input_ids=ids,
            attention_mask=mask,
            groups=torch.tensor([i // 2 for i in local]),
        )
        if self.edits:
            pos = {row: k for k, row in enumerate(local)}
            pairs = [(pos[r], pos[r + 1]) for r in local if r % 2 == 0 and r + 1 in pos]
            batch.edit_source = torch.tensor([p[0] for p in pairs], dtype=torch.long)
            batch.edit_target = torch.tensor([p[1] for p in pairs], dtype=torch.long)
        return batch

    def __iter__(self):
        order = torch.randperm(self.n, generator=torch.Generator().manual_seed(self.seed * 1000 + self.epoch))
        batches = [order[k * self.batch_size : (k + 1) * self.batch_size].tolist() for k in range(len(self))]
        while self.start < len(batches):
            rows = batches[self.start]
            self.start += 1
            yield self._batch(rows)
        self.epoch, self.start = self.epoch + 1, 0


def toy_model(seed: int = 0, attention_dropout: float = 0.0):
    """The tiny CLIP; with attention dropout, every step draws random masks (so RNG handling matters)."""
    model = tiny_model("clip", TINY_WORDS, seed=seed)
    for module in model.modules():
        if isinstance(getattr(module, "dropout", None), float):  # transformers' CLIPAttention keeps a float rate
            module.dropout = attention_dropout
    return model


def train_config(out: str, **overrides) -> TrainConfig:
    base = {"output_dir": out, "epochs": 2, "batch_size": 16, "micro_batch_size": 4, "lr": 1e-3, "warmup_steps": 2,
            "progress": False, "keep_last": 2}  # fmt: skip
    return TrainConfig(**{**base, **overrides})
