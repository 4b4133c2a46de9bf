"""open_clip's published ClipLoss and SigLipLoss, written out again from their definition for the equality tests.

Written independently of sharpclip (which has its own collectives): gathering with gradient is torch's own
`torch.distributed.nn.functional.all_gather`, and SigLIP's neighbour exchange is replaced by that gather, which
hands each rank the same blocks of texts (the exchange is only a cheaper way to move them).

ClipLoss(local_loss, gather_with_grad, rank, world_size):
    gather: with grad, an autograd all-gather; without, a plain one whose own block is replaced by the local
    tensor unless local_loss. local_loss: logits (B, W·B), local rows against gathered columns, labels
    arange(B) + B·rank; else (W·B, W·B) and the text logits are the transpose. Loss ½(CE_image + CE_text).
SigLipLoss(rank, world_size): −Σ log σ(z ⊙ (s·I Tᵀ + b)) / B over the local images against the local texts
    (z = 2I − 1) plus, for every other rank's texts, the same with z = −1 (negatives only).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.nn.functional import all_gather as autograd_all_gather


def gather(x: torch.Tensor, local_loss: bool, with_grad: bool, rank: int, world: int) -> torch.Tensor:
    if with_grad:
        return torch.cat(autograd_all_gather(x))
    parts = [torch.zeros_like(x) for _ in range(world)]
    dist.all_gather(parts, x.detach())
    if not local_loss:
        parts[rank] = x
    return torch.cat(parts)


def clip_logits(img, txt, scale, bias=None, local_loss=False, with_grad=False, rank=0, world=1, margin=None):
    """open_clip's (logits_per_image, logits_per_text); `margin`: a detached matrix added to both (the HN-CLIP
    boost, built by the caller), shaped like logits_per_image."""
    if world == 1:
        per_image, per_text = scale * img @ txt.T, scale * txt @ img.T
    else:
        all_img = gather(img, local_loss, with_grad, rank, world)
        all_txt = gather(txt, local_loss, with_grad, rank, world)
        if local_loss:
            per_image, per_text = scale * img @ all_txt.T, scale * txt @ all_img.T
        else:
            per_image = scale * all_img @ all_txt.T
            per_text = per_image.T
    if margin is not None:
        per_image, per_text = per_image + scale * margin, per_text + scale * margin
    if bias is not None:
        per_image, per_text = per_image + bias, per_text + bias
    return per_image, per_text


def clip_loss(img, txt, scale, bias=None, local_loss=False, with_grad=False, rank=0, world=1, margin=None):
    per_image, per_text = clip_logits(img, txt, scale, bias, local_loss, with_grad, rank, world, margin)
    labels = torch.arange(per_image.shape[0])
    if world > 1 and local_loss:
        labels = labels + per_image.shape[0] * rank
    return (F.cross_entropy(per_image, labels) + F.cross_entropy(per_text, labels)) / 2


def _siglip_block(img, txt, scale, bias, negative_only, gamma=0.0, rows_txt=None):
    logits = scale * img @ txt.T
    if gamma:
        g = (rows_txt @ txt.T).detach()
        if not negative_only:
            g = g * (1 - torch.eye(g.shape[0], dtype=g.dtype))
        logits = logits + scale * gamma * g
    if bias is not None:
        logits = logits + bias
    labels = -torch.ones_like(logits)
    if not negative_only:
        labels = labels + 2 * torch.eye(logits.shape[0], dtype=logits.dtype)
    return -F.logsigmoid(labels * logits).sum() / img.shape[0]


def siglip_loss(img, txt, scale, bias, rank=0, world=1, gamma=0.0):
    """open_clip's SigLipLoss; `gamma`: the HN margin γ·stopgrad(T_local T_blockᵀ) on every block's negatives."""
    loss = _siglip_block(img, txt, scale, bias, False, gamma, txt)
    if world > 1:
        for r, block in enumerate(autograd_all_gather(txt)):
            if r != rank:
                loss = loss + _siglip_block(img, block, scale, bias, True, gamma, txt)
    return loss
