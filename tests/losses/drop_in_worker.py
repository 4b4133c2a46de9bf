"""Worker for the gloo tests of losses.drop_in, launched by torchrun on W ranks; every rank holds B rows of one global
batch. For each check it records the largest absolute difference (over ranks) between the drop-in loss and what
it must equal: open_clip's loss written out in the test (_support.open_clip_reference), the margin built by hand
from the global batch, or the loss on one process over the whole batch. Rank 0 writes {check: difference} as JSON.
"""

import json
import sys
from datetime import timedelta
from itertools import product
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch
import torch.distributed as dist
import torch.nn.functional as F

from _support import open_clip_reference as ref
from sharpclip.collectives import exchange_both
from sharpclip.losses.drop_in import EditNegativesLoss, HNClipLoss, SigLipMarginLoss

B, D, GAMMA = 3, 5, 0.5


def unit(rows, seed):
    g = torch.Generator().manual_seed(seed)
    return F.normalize(torch.randn(rows, D, generator=g, dtype=torch.float64), dim=-1)


def leaves(rank, world, bias=None):
    """The global image, text (and frozen reference) features; this rank's rows as leaves, the scale, the bias."""
    img, txt, frozen = unit(B * world, 1), unit(B * world, 2), unit(B * world, 3)
    rows = slice(rank * B, (rank + 1) * B)
    local = [img[rows].clone().requires_grad_(), txt[rows].clone().requires_grad_()]
    scale = [torch.tensor(12.0, dtype=torch.float64, requires_grad=True)]
    extra = [] if bias is None else [torch.tensor(bias, dtype=torch.float64, requires_grad=True)]
    return (img, txt, frozen[rows], frozen), local + scale + extra


def grads(loss, inputs):
    return [loss.detach(), *torch.autograd.grad(loss, inputs)]


def diff(a, b):
    return max(float((x - y).abs().max()) for x, y in zip(a, b, strict=True))


def clip_checks(rank, world):
    out = {}
    for local_loss, with_grad in product([False, True], [False, True]):
        name = f"ll{int(local_loss)}-gg{int(with_grad)}"
        _, inputs = leaves(rank, world, bias=-0.5)
        kw = {"local_loss": local_loss, "gather_with_grad": with_grad, "rank": rank, "world_size": world}
        mine = grads(HNClipLoss(gamma=0.0, cache_labels=True, **kw)(*inputs), inputs)
        theirs = grads(ref.clip_loss(*inputs, local_loss, with_grad, rank, world), inputs)
        out[f"clip/{name}/gamma0"] = diff(mine, theirs)
        out[f"clip/{name}/margin"] = margin_check(rank, world, kw)
        out[f"clip/{name}/open_clip_with_margin"] = hn_against_reference(rank, world, kw)
    return out


def expected_margin(rank, world, texts, local_loss):
    """γ·Ḡ by hand from the global texts: the rank's rows (or all rows) against all texts, own positives zeroed."""
    rows = texts[rank * B : (rank + 1) * B] if local_loss else texts
    offset = rank * B if local_loss else 0
    g = rows @ texts.T
    g[torch.arange(rows.shape[0]), torch.arange(rows.shape[0]) + offset] = 0.0
    return GAMMA * g


def margin_check(rank, world, kw):
    """get_logits at γ > 0 minus open_clip's logits is s·γ·Ḡ, Ḡ built by hand from the global texts."""
    (_, txt, _, _), inputs = leaves(rank, world)
    image, text, scale = inputs
    per_image, per_text = HNClipLoss(gamma=GAMMA, **kw).get_logits(image, text, scale)
    plain = ref.clip_logits(image, text, scale, None, kw["local_loss"], kw["gather_with_grad"], rank, world)
    margin = scale * expected_margin(rank, world, txt, kw["local_loss"])
    return diff([per_image - plain[0], per_text - plain[1]], [margin, margin])


def hn_against_reference(rank, world, kw):
    """At γ > 0: value and gradients equal open_clip's loss with the hand-built Ḡ added as a constant."""
    (_, txt, _, _), inputs = leaves(rank, world)
    mine = grads(HNClipLoss(gamma=GAMMA, **kw)(*inputs), inputs)
    margin = expected_margin(rank, world, txt, kw["local_loss"])
    theirs = grads(ref.clip_loss(*inputs, None, kw["local_loss"], kw["gather_with_grad"], rank, world, margin), inputs)
    return diff(mine, theirs)


def one_process_checks(rank, world):
    """With gradient through the gather, W ranks are one process over the whole batch: the loss (the mean of the
    ranks' under local_loss), each rank's feature gradients / W (every rank's loss reaches them) and the scale's
    gradient (mean over ranks); with a frozen reference too."""
    out = {}
    for local_loss, frozen_ref in product([False, True], [False, True]):
        (img, txt, frozen_local, frozen_all), inputs = leaves(rank, world)
        kw = {"local_loss": local_loss, "gather_with_grad": True, "rank": rank, "world_size": world}
        loss = HNClipLoss(gamma=GAMMA, reference=frozen_local if frozen_ref else None, **kw)(*inputs)
        value, g_img, g_txt, g_scale = grads(loss, inputs)
        got = [mean(value), g_img / world, g_txt / world, mean(g_scale)]
        whole = [
            img.clone().requires_grad_(),
            txt.clone().requires_grad_(),
            inputs[2].detach().clone().requires_grad_(),
        ]
        single = HNClipLoss(gamma=GAMMA, reference=frozen_all if frozen_ref else None)(*whole)
        s_value, s_img, s_txt, s_scale = grads(single, whole)
        rows = slice(rank * B, (rank + 1) * B)
        out[f"clip/one_process/ll{int(local_loss)}-ref{int(frozen_ref)}"] = diff(
            got, [s_value, s_img[rows], s_txt[rows], s_scale]
        )
    return out


def mean(x):
    x = x.detach().clone()
    dist.all_reduce(x)
    return x / dist.get_world_size()


def siglip_checks(rank, world):
    out = {}
    for impl, gamma in product(["bidir", "shift", "gather", "reduce"], [0.0, GAMMA]):
        _, inputs = leaves(rank, world, bias=-3.0)
        loss = SigLipMarginLoss(rank=rank, world_size=world, dist_impl=impl, gamma=gamma)
        mine = grads(loss(*inputs), inputs)
        theirs = grads(ref.siglip_loss(*inputs, rank, world, gamma), inputs)
        out[f"siglip/{impl}/gamma{gamma:g}"] = diff(mine, theirs)
    out["siglip/bidir/frozen_reference"] = siglip_reference_check(rank, world)
    return out


def siglip_reference_check(rank, world):
    """With a frozen reference, each block's margin is this rank's reference rows against that block's reference."""
    (_, txt, frozen_local, frozen_all), inputs = leaves(rank, world, bias=-3.0)
    image, _, scale, bias = inputs
    loss = SigLipMarginLoss(rank=rank, world_size=world, reference=frozen_local)(*inputs)
    total = 0.0
    for r in range(world):
        block = slice(r * B, (r + 1) * B)
        margin = GAMMA * frozen_local @ frozen_all[block].T
        signs = -torch.ones(B, B, dtype=torch.float64)
        if r == rank:
            margin, signs = margin * (1 - torch.eye(B, dtype=torch.float64)), signs + 2 * torch.eye(B)
        logits = scale * (image @ txt[block].T + margin) + bias
        total = total - F.logsigmoid(signs * logits).sum() / B
    return float((loss - total).abs())


def edit_checks(rank, world):
    """Ranks hold different numbers of edit pairs (rank r: r + 1); the term is the one-process term over all."""
    out = {}
    counts = [r + 1 for r in range(world)]
    start, total = sum(counts[:rank]), sum(counts)
    everything = [unit(total, 10 + k) for k in range(4)]
    for with_grad in (False, True):
        local = [e[start : start + counts[rank]].clone().requires_grad_() for e in everything]
        scale = torch.tensor(9.0, dtype=torch.float64, requires_grad=True)
        loss = EditNegativesLoss(gather_with_grad=with_grad, rank=rank, world_size=world)(*local, scale)
        value, *g = grads(loss, [*local, scale])
        whole = [e.clone().requires_grad_() for e in everything]
        s_scale = scale.detach().clone().requires_grad_()
        s_value, *s_g = grads(EditNegativesLoss()(*whole, s_scale), [*whole, s_scale])
        factor = world if with_grad else 1  # with gradient through the gather every rank's loss reaches our rows
        got = [value, *(x / factor for x in g[:4]), g[4]]  # every rank's loss is the global one
        rows = slice(start, start + counts[rank])
        out[f"edit/gg{int(with_grad)}"] = diff(got, [s_value, *(x[rows] for x in s_g[:4]), s_g[4]])
    return out


def exchange_checks(rank, world):
    """The bidirectional exchange's backward sends each gradient back where its tensor came from. In the SigLIP loss
    the two tensors sent are the same until a second round (5 ranks), so it is checked here with distinct ones:
    d/d(sent left) must be the weight of what the left rank received from its right, and vice versa."""
    if world < 3:  # with 2 ranks left is right: open_clip (and the loss) exchange one way only
        return {}
    left, right = (rank - 1) % world, (rank + 1) % world
    to_left, to_right = unit(B, 20 + rank).requires_grad_(), unit(B, 40 + rank).requires_grad_()
    from_right, from_left = exchange_both(to_left, to_right, left, right)
    w_right, w_left = unit(B, 60), unit(B, 61)
    g_left, g_right = torch.autograd.grad(
        (from_right * w_right).sum() + (from_left * w_left).sum(), [to_left, to_right]
    )
    values = diff([from_right, from_left], [unit(B, 20 + right), unit(B, 40 + left)])
    return {"collectives/exchange_both": values + diff([g_left, g_right], [w_right, w_left])}


def main(out_path):
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    rank, world = dist.get_rank(), dist.get_world_size()
    results = {**clip_checks(rank, world), **one_process_checks(rank, world), **siglip_checks(rank, world),
               **edit_checks(rank, world), **exchange_checks(rank, world)}  # fmt: skip
    everyone = [None] * world
    dist.all_gather_object(everyone, results)
    if rank == 0:
        worst = {k: max(r[k] for r in everyone) for k in results}
        Path(out_path).write_text(json.dumps(worst, indent=1))
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
