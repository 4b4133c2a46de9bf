"""Recall@K, ranks and the tie policy (eval/metrics.py): hand-computed cases, ties, several captions per image,
chunked vs a naive full-matrix stable argsort."""

from __future__ import annotations

import pytest
import torch

from sharpclip.eval.metrics import (
    pairs_from_caption_index,
    query_ranks,
    recall_summary,
    retrieval_metrics,
    retrieval_ranks,
)


def _naive_ranks(query: torch.Tensor, gallery: torch.Tensor, positives: torch.Tensor) -> torch.Tensor:
    """Reference written independently: full matrix, stable descending argsort, position of the best positive."""
    order = torch.argsort(query @ gallery.t(), dim=1, descending=True, stable=True)
    position = torch.argsort(order, dim=1)  # position[q, g] = place of g in q's sorted list
    ranks = torch.full((query.shape[0],), 10**9, dtype=torch.long)
    for q, g in positives.tolist():
        ranks[q] = min(int(ranks[q]), int(position[q, g]))
    return ranks


def _unit(n: int, d: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.nn.functional.normalize(torch.randn(n, d, generator=g), dim=1)


def test_hand_computed_ties_both_directions() -> None:
    # One-hot embeddings give exactly representable scores. Texts 0 and 1 are identical, images 0 and 1 identical.
    e = torch.eye(3)
    image = torch.stack([e[0], e[0], e[1]])  # images 0, 1 tie for every text
    text = torch.stack([e[0], e[0], e[1]])  # texts 0, 1 tie for every image
    pos = pairs_from_caption_index([0, 1, 2])
    ranks = retrieval_ranks(text, image, pos, chunk_size=2)
    # text 0 -> image 0: nothing higher, no lower tie: 0. text 1 -> image 1: image 0 ties at a lower index: 1.
    assert ranks.t2i.tolist() == [0, 1, 0]
    # Same rule image->text: image 1's caption 1 ties with caption 0 at a lower index.
    assert ranks.i2t.tolist() == [0, 1, 0]


def test_hand_computed_five_captions_per_image() -> None:
    # 2 images, captions 0-2 of image 0, captions 3-4 of image 1 (COCO-style many captions).
    image = torch.tensor([[1.0, 0.0], [0.0, 1.0]])
    text = torch.tensor([[1.0, 0.0], [0.6, 0.8], [0.0, 1.0], [0.0, 1.0], [0.8, 0.6]])
    pos = pairs_from_caption_index([0, 0, 0, 1, 1])
    ranks = retrieval_ranks(text, image, pos)
    # t2i: caption 1 (0.6 vs 0.8) and caption 2 (0 vs 1) rank their image second; caption 4 (0.6 vs 0.8) too.
    assert ranks.t2i.tolist() == [0, 1, 1, 0, 1]
    # i2t: image 0's best positive is caption 0 (score 1): rank 0. Image 1: captions 2 and 3 both score 1;
    # caption 2 (not its own) has the lower index, so its best positive, caption 3, sits at rank 1.
    assert ranks.i2t.tolist() == [0, 1]
    m = recall_summary(ranks.t2i, ks=(1, 2))
    assert m["R@1"] == pytest.approx(40.0) and m["R@2"] == pytest.approx(100.0)
    assert m["mean_rank"] == pytest.approx(1.6) and m["median_rank"] == pytest.approx(2.0)


def test_hit_if_any_positive_in_top_k() -> None:
    image = torch.tensor([[1.0, 0.0], [0.0, 1.0], [0.6, 0.8]])
    text = torch.tensor([[0.0, 1.0]])
    # The caption is positive for images 0 and 2; image 1 outranks both, image 2 (0.8) beats image 0 (0).
    ranks = query_ranks(text, image, torch.tensor([[0, 0], [0, 2]]))
    assert ranks.tolist() == [1]


@pytest.mark.parametrize("chunk", [1, 7, 64, 1000])
def test_chunked_equals_naive_with_ties_and_many_captions(chunk: int) -> None:
    # Quantised embeddings create many exact ties; 3 captions per image, two duplicated images.
    image = torch.round(_unit(40, 4, 0) * 2) / 2
    image[5] = image[3]
    text = torch.round(_unit(120, 4, 1) * 2) / 2
    pos = pairs_from_caption_index(torch.arange(120) // 3)
    ranks = retrieval_ranks(text, image, pos, chunk_size=chunk)
    assert torch.equal(ranks.t2i, _naive_ranks(text, image, pos))
    assert torch.equal(ranks.i2t, _naive_ranks(image, text, pos.flip(1)))


def _two_pass(text: torch.Tensor, image: torch.Tensor, pos: torch.Tensor, chunk: int) -> tuple:
    """Each direction on its own, queries against the other side's embeddings (the benchmark's two-pass scorer)."""
    return query_ranks(text, image, pos, chunk), query_ranks(image, text, pos.flip(1), chunk)


def test_one_pass_equals_each_direction_on_its_own_with_many_to_many_positives() -> None:
    text, image = _unit(700, 32, 5), _unit(150, 32, 6)
    g = torch.Generator().manual_seed(7)
    extra = torch.stack([torch.randint(0, 700, (300,), generator=g), torch.randint(0, 150, (300,), generator=g)], 1)
    pos = torch.cat([pairs_from_caption_index(torch.arange(700) % 150), extra])  # images' captions far apart
    ranks = retrieval_ranks(text, image, pos, chunk_size=64)
    t2i, i2t = _two_pass(text, image, pos, 64)
    assert torch.equal(ranks.t2i, t2i) and torch.equal(ranks.i2t, i2t)


def test_an_image_whose_probed_best_score_differs_from_the_blocks_is_ranked_again(monkeypatch) -> None:
    """A kernel that rounds the probe otherwise than the full block must not change a rank: the images concerned
    are ranked again on their own. Here the probe is off by far more than rounding, for every third pair."""
    from sharpclip.eval import metrics

    probe = metrics._probe

    def off(text, image, q, g, start, stop):
        values = probe(text, image, q, g, start, stop).clone()
        values[::3] += 1e-3
        return values

    redone = []
    query = metrics.query_ranks
    monkeypatch.setattr(metrics, "_probe", off)
    monkeypatch.setattr(metrics, "query_ranks", lambda q, *a: redone.append(len(q)) or query(q, *a))
    image = torch.round(_unit(40, 4, 0) * 2) / 2
    text = torch.round(_unit(120, 4, 1) * 2) / 2
    pos = pairs_from_caption_index(torch.arange(120) // 3)
    ranks = retrieval_ranks(text, image, pos, chunk_size=16)
    assert redone and 0 < redone[0] < 40  # only the images whose probe was off
    assert torch.equal(ranks.t2i, _naive_ranks(text, image, pos))
    assert torch.equal(ranks.i2t, _naive_ranks(image, text, pos.flip(1)))


@pytest.mark.gpu
def test_one_pass_on_a_gpu_gives_the_naive_ranks_with_ties() -> None:
    image = torch.round(_unit(400, 8, 0) * 2) / 2
    text = torch.round(_unit(1200, 8, 1) * 2) / 2
    pos = pairs_from_caption_index(torch.arange(1200) // 3)
    on_gpu = retrieval_ranks(text, image, pos, chunk_size=128, device="cuda")
    assert torch.equal(on_gpu.t2i, _naive_ranks(text, image, pos))
    assert torch.equal(on_gpu.i2t, _naive_ranks(image, text, pos.flip(1)))


def test_random_matches_naive_every_k() -> None:
    text, image = _unit(300, 16, 2), _unit(300, 16, 3)
    pos = pairs_from_caption_index(torch.arange(300))
    ks = (1, 5, 10, 25, 50, 300)
    got = retrieval_metrics(text, image, pos, ks=ks, chunk_size=37)
    naive = _naive_ranks(text, image, pos)
    for k in ks:
        assert got["t2i"][f"R@{k}"] == pytest.approx(100.0 * float((naive < k).double().mean()))
    assert got["t2i"]["R@300"] == 100.0


def test_perfect_retrieval_and_errors() -> None:
    emb = _unit(10, 8, 4)
    m = retrieval_metrics(emb, emb, pairs_from_caption_index(range(10)), ks=(1,))
    assert m["t2i"]["R@1"] == 100.0 and m["i2t"]["mean_rank"] == 1.0
    with pytest.raises(ValueError, match="no positive"):
        retrieval_ranks(emb, emb, pairs_from_caption_index([0] * 10))
    with pytest.raises(ValueError, match="outside"):
        retrieval_ranks(emb, emb, pairs_from_caption_index([11] * 10))
    bad = emb.clone()
    bad[3, 0] = float("nan")
    with pytest.raises(ValueError, match="NaN"):
        retrieval_ranks(bad, emb, pairs_from_caption_index(range(10)))
    with pytest.raises(ValueError, match=">= 1"):
        recall_summary(torch.zeros(3, dtype=torch.long), ks=(0,))
