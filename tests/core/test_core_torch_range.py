"""The declared torch range runs: every name newer than the floor (`torch>=2.4` in pyproject.toml) has a fallback,
and each fallback is exercised here by hiding the newer name.

- `torch.distributed.all_gather_single` / `reduce_scatter_single` (torch 2.13) → `all_gather_into_tensor` /
  `reduce_scatter_tensor`: the autograd gather's forward and backward on a one-process gloo group, with a spy on
  which name ran;
- Dynamo's `recompile_limit` (torch 2.7) → `cache_size_limit`.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

from _support.process_group import one_rank_group
from sharpclip import collectives
from sharpclip.train.compile import raise_recompile_limit

NEW_NAMES = {"all_gather_single": "all_gather_into_tensor", "reduce_scatter_single": "reduce_scatter_tensor"}


@pytest.fixture
def one_process_group():
    with one_rank_group():
        yield


def _spy(monkeypatch, name: str, called: list[str]) -> None:
    original = getattr(dist, name)

    def spy(*args, **kwargs):
        called.append(name)
        return original(*args, **kwargs)

    monkeypatch.setattr(dist, name, spy)


@pytest.mark.parametrize("hide", [False, True])
def test_the_gather_runs_with_and_without_the_torch_2_13_names(one_process_group, monkeypatch, hide):
    called: list[str] = []
    for new, old in NEW_NAMES.items():
        if hide:
            monkeypatch.delattr(dist, new)
            _spy(monkeypatch, old, called)
        elif hasattr(dist, new):
            _spy(monkeypatch, new, called)
        else:
            pytest.skip(f"this torch ({torch.__version__}) has no {new}: the other case covers it")
    x = torch.arange(6.0).reshape(3, 2).requires_grad_()
    (gathered,) = collectives.gather_parts(x, with_grad=True)
    assert torch.equal(gathered, x.detach())
    (gathered * torch.tensor([1.0, 2.0])).sum().backward()  # one rank: the reduce-scatter hands back its block
    assert torch.equal(x.grad, torch.tensor([[1.0, 2.0]] * 3))
    expected = list(NEW_NAMES.values()) if hide else list(NEW_NAMES)
    assert called == expected


@pytest.mark.parametrize(("names", "expected"), [(("recompile_limit", "cache_size_limit"), "recompile_limit"),
                                                 (("cache_size_limit",), "cache_size_limit")])  # fmt: skip
def test_the_recompile_limit_is_raised_under_either_name(names, expected):
    config = SimpleNamespace(**dict.fromkeys(names, 8))
    assert raise_recompile_limit(config, 32) == expected
    assert getattr(config, expected) == 32
    assert raise_recompile_limit(config, 4) == expected and getattr(config, expected) == 32  # never lowered
