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
        assert inners[rank].seen == items[rank::world]  # this rank's share only
        assert out.tolist() == [[float(x), -float(x)] for x in items]


def test_a_rank_with_nothing_to_embed_still_takes_part():
    inner = Recorder()
    shards = [torch.tensor([[0.0, 0.0]]), torch.empty(0)]
    out = ShardedEmbedder(inner, 1, 2, gather=lambda mine: [shards[0], mine]).images([0])
    assert inner.seen == [] and out.tolist() == [[0.0, 0.0]]


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
