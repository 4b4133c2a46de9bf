"""FILIP token-wise late interaction (HN-CLIP §2.3, eq. 3's L_tok; Yao et al. 2021).

For image i with patch tokens x_k and text j with tokens y_r (both L2-normalised, invalid tokens masked):

    s^I_ij = mean_{valid k} max_{valid r} ⟨x_k, y_r⟩     (each patch finds its best word: image→text logits)
    s^T_ij = mean_{valid r} max_{valid k} ⟨x_k, y_r⟩     (each word finds its best patch: text→image logits)
    L_tok  = ½ [CE(s·s^I, y) + CE(s·(s^T)ᵀ, y)]

The two matrices are different reductions of one (B_img, B_txt, P, L) similarity tensor, not transposes. That
tensor is far too large to hold (128 × 128 × 256 × 248 floats ≈ 4 GB), so it is built `chunk_size` images at a
time. Invalid tokens are set to −inf before each max (a zeroed padding token would otherwise win whenever every
real similarity is negative) and excluded from each mean. `Tensor.max(dim)` keeps only indices for its backward,
so no chunk's similarity tensor outlives its iteration.

Local loss (`rows`, losses.registry): the image→text rows of images r need s^I_r: (b, B_txt), those images against
every caption; the text→image rows of captions r need s^T over every image and those captions: (B_img, b). Two
blocks of the similarity tensor, 2·b·B pairs instead of B², so a process of W computes about 2/W of the full cost.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from sharpclip.losses._common import scale_from_log, symmetric_row_cross_entropy
from sharpclip.losses.registry import register


def _masked_mean(values: Tensor, mask: Tensor) -> Tensor:
    return values.masked_fill(~mask, 0.0).sum(dim=-1) / mask.sum(dim=-1).clamp(min=1)


def token_similarities(
    image_tokens: Tensor,
    text_tokens: Tensor,
    image_token_mask: Tensor | None = None,
    text_token_mask: Tensor | None = None,
    chunk_size: int = 8,
) -> tuple[Tensor, Tensor]:
    """The FILIP similarity matrices (s^I, s^T), each (B_img, B_txt).

    image_tokens: (B_img, P, D), text_tokens: (B_txt, L, D), L2-normalised per token.
    *_token_mask: (B, P) / (B, L) bool, True for real tokens; None means all tokens are real.
    """
    b_img, n_patch, _ = image_tokens.shape
    b_txt, n_word, _ = text_tokens.shape
    if b_img == 0 or b_txt == 0:  # a process without rows: empty blocks, still connected to the graph
        empty = (image_tokens.sum() + text_tokens.sum()) * image_tokens.new_zeros(b_img, b_txt)
        return empty, empty
    if image_token_mask is None:
        image_token_mask = torch.ones(b_img, n_patch, dtype=torch.bool, device=image_tokens.device)
    if text_token_mask is None:
        text_token_mask = torch.ones(b_txt, n_word, dtype=torch.bool, device=text_tokens.device)
    image_token_mask, text_token_mask = image_token_mask.bool(), text_token_mask.bool()
    i2t, t2i = [], []
    for start in range(0, b_img, chunk_size):
        patches = image_tokens[start : start + chunk_size]
        patch_mask = image_token_mask[start : start + chunk_size]
        sim = torch.einsum("cpd,tld->ctpl", patches, text_tokens)  # (c, B_txt, P, L)
        # two broadcast masks, not their (c, B_txt, P, L) product: autograd keeps each mask for the backward
        sim.masked_fill_(~text_token_mask[None, :, None, :], float("-inf"))
        sim.masked_fill_(~patch_mask[:, None, :, None], float("-inf"))
        best_word = sim.max(dim=3).values  # (c, B_txt, P)
        best_patch = sim.max(dim=2).values  # (c, B_txt, L)
        i2t.append(_masked_mean(best_word, patch_mask[:, None, :]))
        t2i.append(_masked_mean(best_patch, text_token_mask[None, :, :]))
    return torch.cat(i2t), torch.cat(t2i)


@register("filip")
def filip(
    image_tokens: Tensor,
    text_tokens: Tensor,
    logit_scale: Tensor,
    image_token_mask: Tensor | None = None,
    text_token_mask: Tensor | None = None,
    rows: slice | None = None,
    *,
    chunk_size: int = 8,
) -> Tensor:
    """Token-level late-interaction contrastive loss (FILIP), chunked over images.

    image_tokens: (B, P, D), text_tokens: (B, L, D) L2-normalised per token; masks (B, P) / (B, L), True = real.
    rows: compute these query rows only and return their share of the loss (local loss); None: every row.
    """
    scale = scale_from_log(logit_scale)
    if rows is not None:
        return _filip_rows(image_tokens, text_tokens, scale, image_token_mask, text_token_mask, rows, chunk_size)
    s_img, s_txt = token_similarities(image_tokens, text_tokens, image_token_mask, text_token_mask, chunk_size)
    labels = torch.arange(s_img.shape[0], device=s_img.device)
    # rows of s^I are image queries; rows of (s^T)ᵀ are text queries
    return 0.5 * (F.cross_entropy(scale * s_img, labels) + F.cross_entropy(scale * s_txt.t(), labels))


def _filip_rows(
    image_tokens: Tensor,
    text_tokens: Tensor,
    scale: Tensor,
    image_mask: Tensor | None,
    text_mask: Tensor | None,
    rows: slice,
    chunk_size: int,
) -> Tensor:
    """The share of L_tok held by query rows `rows`: s^I of those images, (s^T)ᵀ of those captions, (b, B) each."""

    def mine(mask: Tensor | None) -> Tensor | None:
        return None if mask is None else mask[rows]

    s_img, _ = token_similarities(image_tokens[rows], text_tokens, mine(image_mask), text_mask, chunk_size)
    _, s_txt = token_similarities(image_tokens, text_tokens[rows], image_mask, mine(text_mask), chunk_size)
    return symmetric_row_cross_entropy(scale * s_img, scale * s_txt.t(), rows)
