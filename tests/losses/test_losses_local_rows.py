"""Local loss: every contrastive loss given `rows` computes those query rows against every column and returns
their share, so the shares of disjoint slices covering the batch add up to the loss of the whole matrix, with the
same gradient for every input (fp64, uneven slices)."""

from __future__ import annotations

import pytest
import torch

from _support.tiny_towers import OBJECTIVES, TinyTowers, make_batch, objective
from sharpclip.config import TermConfig
from sharpclip.losses import registry
from sharpclip.losses.objective import Term

SLICES = [slice(0, 3), slice(3, 7), slice(7, 7), slice(7, 10)]  # uneven, one process without rows
VARIANTS = {
    **OBJECTIVES,
    "hn_clip_duplicates": {"t": TermConfig("hn_clip", params={"gamma": 0.5, "duplicate_threshold": 0.6})},
    "hn_clip_reference": {"t": TermConfig("hn_clip", inputs={"reference_text": "teacher"})},
    "sigmoid_plain": {"t": TermConfig("sigmoid")},
}


def _features(seed: int = 3) -> tuple[dict[str, torch.Tensor], list[torch.Tensor]]:
    model = TinyTowers(dropout=0.0)
    feats = {k: v.detach().requires_grad_(v.is_floating_point()) for k, v in model.encode(make_batch(10, seed)).items()}
    feats["teacher"] = torch.nn.functional.normalize(feats["teacher"], dim=-1).detach()
    leaves = [v for v in feats.values() if v.requires_grad]
    scale = torch.tensor(2.5, dtype=torch.float64, requires_grad=True)
    bias = torch.tensor(-1.0, dtype=torch.float64, requires_grad=True)
    return {**feats, "logit_scale": scale, "logit_bias": bias}, [*leaves, scale, bias]


def test_every_registered_loss_takes_rows():
    assert [s.name for s in registry.specs() if registry.ROWS not in s.optional_inputs] == []


@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_the_shares_of_the_rows_add_up_to_the_whole_matrix(monkeypatch, name):
    monkeypatch.setitem(OBJECTIVES, name, VARIANTS[name])
    obj = objective(name)
    feats, leaves = _features()
    whole = obj(feats)["loss"]
    expected = torch.autograd.grad(whole, leaves, allow_unused=True, materialize_grads=True)
    shares = [obj({**feats, registry.ROWS: rows})["loss"] for rows in SLICES]
    total = sum(shares)
    got = torch.autograd.grad(total, leaves, allow_unused=True, materialize_grads=True)
    assert abs(float((total - whole).detach())) < 1e-12
    assert abs(float(shares[0].detach() - whole.detach())) > 1e-6 and float(shares[2].detach()) == 0.0  # rows taken
    for g, e in zip(got, expected, strict=True):
        assert torch.allclose(g, e, atol=1e-12, rtol=0)


def test_a_remapped_rows_input_is_optional_at_call_time():
    """On one process no slice is given: a term whose `rows` the config mapped still computes every row."""
    spec = registry.get("infonce")
    term = Term("t", spec, 1.0, {}, {"image": "image", "text": "text", "logit_scale": "logit_scale",
                                     "rows": "edit_rows"}, remapped=frozenset())  # fmt: skip
    feats, _ = _features()
    assert torch.allclose(term(feats), spec.fn(feats["image"], feats["text"], feats["logit_scale"]))


@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_local_rows_create_nothing_off_the_inputs_device(monkeypatch, name):
    """On the meta device any tensor made without `device=` would meet a meta tensor and raise (forward, backward)."""
    monkeypatch.setitem(OBJECTIVES, name, VARIANTS[name])
    feats, _ = _features()
    meta = {k: v.detach().to("meta").requires_grad_(v.is_floating_point()) for k, v in feats.items()}
    loss = objective(name)({**meta, registry.ROWS: slice(3, 7)})["loss"]
    loss.backward()
    assert loss.device.type == "meta" and any(v.grad is not None for v in meta.values() if v.requires_grad)
