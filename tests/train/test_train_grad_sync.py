"""The gradient sync's mechanics on a one-rank gloo group (the 2- and 4-rank equality with one process is in
test_train_distributed.py): buckets start inside the last backward, not after it; `no_sync` backwards start none;
a parameter no backward reached is reduced as zero (a SigLIP bias under a CLIP loss); from the second step the
buckets follow the order the gradients arrived in, the unreached parameter last."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from _support.process_group import one_rank_group
from sharpclip.train.distributed import GradSync


class Chain(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.first, self.second, self.third = nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 1)
        self.bias = nn.Parameter(torch.tensor(-10.0))  # never used by the loss below

    def forward(self, x):
        return self.third(torch.tanh(self.second(torch.tanh(self.first(x))))).sum()


@pytest.fixture
def group():
    with one_rank_group():
        yield


def _launched_during_backward(sync: GradSync, model: Chain, x: torch.Tensor) -> int:
    sync.start()
    model(x).backward()
    during = sync._next  # buckets already started while the backward ran
    sync.finish()
    return during


def test_buckets_start_during_the_last_backward_and_follow_the_arrival_order(group):
    model = Chain()
    params = list(model.parameters())  # the bias (the module's own) first, then the layers'
    sync = GradSync(params, bucket_bytes=16)  # about one parameter tensor a bucket
    x = torch.randn(3, 4)
    used = [p for p in params if p is not model.bias]
    expected = torch.autograd.grad(model(x), used)
    assert sync.buckets[-1].params == [model.bias]  # first step: reverse registration order
    _launched_during_backward(sync, model, x)
    model.zero_grad(set_to_none=True)
    during = _launched_during_backward(sync, model, x)
    assert during >= len(sync.buckets) - 1  # every bucket but the unreached bias's started inside the backward
    assert sync.buckets[-1].params == [model.bias]  # rebuilt: arrival order, the unreached parameter last
    assert sync.buckets[0].params[0] is model.third.bias  # the last layer's gradients arrive first
    for p, g in zip(used, expected, strict=True):
        assert torch.equal(p.grad, g)  # one rank: the mean is the gradient itself
    assert torch.equal(model.bias.grad, torch.zeros(()))


def test_no_sync_backwards_start_nothing_and_accumulate(group):
    model = Chain()
    sync = GradSync(list(model.parameters()), bucket_bytes=16)
    x = torch.randn(3, 4)
    sync.start()
    with sync.no_sync():
        model(x).backward()
    assert sync._next == 0
    model(x).backward()
    sync.finish()
    expected = 2 * torch.autograd.grad(model(x), [model.first.weight])[0]
    assert torch.allclose(model.first.weight.grad, expected, atol=1e-6)


def test_backwards_outside_a_step_are_not_reduced(group):
    """The hooks act only between start and finish (the gradient diagnostics run their own backwards)."""
    model = Chain()
    sync = GradSync(list(model.parameters()), bucket_bytes=16)
    model(torch.randn(3, 4)).backward()
    assert all(b.handle is None for b in sync.buckets) and not hasattr(sync, "_next")
