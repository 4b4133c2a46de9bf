"""A tiny dual encoder with dropout that emits, in float64, every feature of the feature table (train.features)
that a registered loss requires, under the table's names.

It stands in for a real backbone in accumulation and multi-process tests: what matters there is that parameters,
dropout and token masks behave like a real tower's, not what the model computes. Its edit features come from a
second set of pixels and captions rather than from rows of the batch.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from sharpclip.config import LossConfig, TermConfig
from sharpclip.losses import build_objective
from sharpclip.train.features import FEATURES


class TinyTowers(nn.Module):
    def __init__(self, dim: int = 8, pixel_features: int = 5, vocab: int = 30, dropout: float = 0.1, seed: int = 0):
        super().__init__()
        torch.manual_seed(seed)
        self.patch = nn.Linear(pixel_features, dim)
        self.image_proj = nn.Linear(dim, dim)
        self.embed = nn.Embedding(vocab, dim)
        self.text_proj = nn.Linear(dim, dim)
        self.drop = nn.Dropout(dropout)
        self.teacher = nn.Embedding(vocab, dim).requires_grad_(False)  # a frozen "original tower"
        self.logit_scale = nn.Parameter(torch.tensor(math.log(1 / 0.07)))
        self.logit_bias = nn.Parameter(torch.tensor(-1.0))
        self.double()

    def _image(self, pixels: Tensor) -> tuple[Tensor, Tensor]:
        tokens = self.drop(torch.tanh(self.patch(pixels)))  # (B, P, D)
        return F.normalize(self.image_proj(tokens.mean(1)), dim=-1), F.normalize(tokens, dim=-1)

    def _text(self, ids: Tensor, mask: Tensor) -> tuple[Tensor, Tensor]:
        tokens = self.drop(torch.tanh(self.text_proj(self.embed(ids))))  # (B, L, D)
        pooled = (tokens * mask[..., None]).sum(1) / mask.sum(1, keepdim=True)
        return F.normalize(pooled, dim=-1), F.normalize(tokens, dim=-1)

    def encode(self, batch: dict[str, Tensor]) -> dict[str, Tensor]:
        image, image_tokens = self._image(batch["pixels"])
        text, text_tokens = self._text(batch["ids"], batch["mask"])
        teacher = (self.teacher(batch["ids"]) * batch["mask"][..., None]).sum(1)
        features = {
            "image": image,
            "image_tokens": image_tokens,
            "text": text,
            "text_tokens": text_tokens,
            "text_token_mask": batch["mask"],
            "source_image": image,
            "target_image": self._image(batch["edit_pixels"])[0],
            "source_text": text,
            "target_text": self._text(batch["edit_ids"], batch["edit_mask"])[0],
            "teacher": teacher,
            "student": text,
        }
        assert features.keys() <= FEATURES.keys(), features.keys() - FEATURES.keys()  # the table's names only
        return features

    def model_inputs(self) -> dict[str, Tensor]:
        return {"logit_scale": self.logit_scale, "logit_bias": self.logit_bias}


def make_batch(n: int, seed: int = 0, patches: int = 4, pixel_features: int = 5, vocab: int = 30, max_len: int = 7):
    g = torch.Generator().manual_seed(seed)

    def text():
        lengths = torch.randint(2, max_len + 1, (n,), generator=g)
        mask = torch.arange(max_len)[None, :] < lengths[:, None]
        ids = torch.randint(1, vocab, (n, max_len), generator=g) * mask
        return ids, mask

    ids, mask = text()
    edit_ids, edit_mask = text()
    return {
        "pixels": torch.randn(n, patches, pixel_features, generator=g, dtype=torch.float64),
        "ids": ids,
        "mask": mask,
        "edit_pixels": torch.randn(n, patches, pixel_features, generator=g, dtype=torch.float64),
        "edit_ids": edit_ids,
        "edit_mask": edit_mask,
    }


def split_batch(batch: dict[str, Tensor], size: int) -> list[dict[str, Tensor]]:
    """Micro-batches of `size` rows, each trimmed to its own longest caption (so token lengths differ)."""
    n = next(iter(batch.values())).shape[0]
    out = []
    for start in range(0, n, size):
        mb = {k: v[start : start + size] for k, v in batch.items()}
        for ids, mask in (("ids", "mask"), ("edit_ids", "edit_mask")):
            keep = int(mb[mask].sum(1).max())
            mb[ids], mb[mask] = mb[ids][:, :keep], mb[mask][:, :keep]
        out.append(mb)
    return out


# one objective per registered loss, plus the composed recipes of both papers
OBJECTIVES: dict[str, dict[str, TermConfig]] = {
    "infonce": {"t": TermConfig("infonce")},
    "hn_clip": {"t": TermConfig("hn_clip", params={"gamma": 0.5})},
    "filip": {"t": TermConfig("filip", params={"chunk_size": 3})},
    "edit_negatives": {"t": TermConfig("edit_negatives")},
    "distill_cosine": {"t": TermConfig("distill_cosine")},
    "sigmoid": {"t": TermConfig("sigmoid", params={"gamma": 0.5})},
    "hnclip_eq3": {"hn": TermConfig("hn_clip"), "tok": TermConfig("filip", weight=1.0)},
    "clipin_eq8": {
        "short": TermConfig("infonce"),
        "long": TermConfig("infonce", weight=0.1, inputs={"text": "target_text"}),
        "edits": TermConfig("edit_negatives", weight=0.1),
    },
}


def objective(name: str):
    return build_objective(LossConfig(terms=OBJECTIVES[name]), FEATURES)
