"""The embedder runs as a training loader does: image decoding in DataLoader workers, the towers at the training
precision (bf16 autocast), and, over ranks, each item embedded by one rank only (ShardedEmbedder)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image

from sharpclip.eval.embed import ModelEmbedder, ShardedEmbedder
from sharpclip.eval.evaluator import model_embedder
from sharpclip.models import tiny_model


@pytest.fixture
def photos(tmp_path):
    rng = np.random.default_rng(0)
    paths = []
    for i in range(10):
        path = tmp_path / f"{i}.png"
        Image.fromarray(rng.integers(0, 255, (40, 48, 3), dtype=np.uint8)).save(path)
        paths.append(str(path))
    return paths


def test_workers_and_bf16_embed_what_the_in_process_fp32_loop_does(photos):
    model = tiny_model("clip")
    plain = model_embedder(model, batch_size=4)
    fast = model_embedder(model, batch_size=4, num_workers=2, precision="bf16")
    assert fast.num_workers == 2 and fast.precision == "bf16"
    reference, got = plain.images(photos), fast.images(photos)
    assert got.dtype == torch.float32 and got.shape == reference.shape
    assert not torch.equal(got, reference)  # bf16 ran: not bit-identical
    torch.testing.assert_close(got, reference, atol=0.05, rtol=0)
    torch.testing.assert_close(model_embedder(model, batch_size=4, num_workers=2).images(photos), reference)
    captions = ["a red square", "a blue circle left of a star", "a ring"]
    torch.testing.assert_close(fast.texts(captions), plain.texts(captions), atol=0.05, rtol=0)


class Recorder:
    """An Embedder whose embedding of item x is [x, -x]; records what it was asked for."""

    def __init__(self):
        self.seen: list = []

    def images(self, refs):
        self.seen += refs
        return torch.tensor([[float(r), -float(r)] for r in refs]).reshape(len(refs), 2)

    texts = images


def test_each_rank_embeds_its_share_and_receives_everything_in_order():
    items, world = list(range(11)), 3
    inners = [Recorder() for _ in range(world)]
    shards = [inner.images(items[r::world]) for r, inner in enumerate(inners)]  # what every rank computes
    for inner in inners:
        inner.seen.clear()
    for rank in range(world):
        sharded = ShardedEmbedder(
            inners[rank], rank, world, gather=lambda mine, r=rank: [*shards[:r], mine, *shards[r + 1 :]]
        )
        out = sharded.images(items)
        padding = [items[0]] * (4 - len(items[rank::world]))  # 11 items on 3 ranks: 4 passes' worth each
        assert inners[rank].seen == items[rank::world] + padding  # this rank's share (padded)
        assert out.tolist() == [[float(x), -float(x)] for x in items]


@pytest.mark.parametrize("items, seen", [([0], [0]), ([0, 1, 2], [1, 0]), ([0, 1, 2, 3], [1, 3])])
def test_every_rank_embeds_as_many_items_padding_its_share_with_the_first(items, seen):
    """A sharded model gathers its parameters in every forward pass: rank 1 of 2 makes the passes rank 0 makes,
    padding a share one short (none at all, with 1 item) with item 0, whose embedding it drops."""
    inner = Recorder()
    mine = []
    out = ShardedEmbedder(inner, 1, 2, gather=lambda rows: mine.append(rows) or []).images(items)
    assert inner.seen == seen and out.numel() == 0
    assert mine[0].tolist() == [[float(x), -float(x)] for x in items[1::2]]  # the padding's row is not sent


def test_a_rank_that_does_not_score_embeds_its_share_and_gets_nothing_back():
    inner = Recorder()
    out = ShardedEmbedder(inner, 1, 2, gather=lambda mine: []).images([0, 1, 2, 3])  # gathered to rank 0 only
    assert inner.seen == [1, 3] and out.numel() == 0


def test_the_embedder_pins_nothing_on_the_cpu(photos, monkeypatch):
    built = []
    original = torch.utils.data.DataLoader

    def spy(*args, **kwargs):
        built.append(kwargs)
        return original(*args, **kwargs)

    monkeypatch.setattr(torch.utils.data, "DataLoader", spy)
    ModelEmbedder(tiny_model("clip"), lambda im: torch.zeros(3, 32, 32), None, batch_size=4, num_workers=2).images(
        photos
    )
    assert built and built[0]["num_workers"] == 2 and built[0]["pin_memory"] is False
