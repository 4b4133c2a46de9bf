"""CLIP-IN's symmetric hard-negative loss over instruction-edit pairs (CLIP-IN eqs. 3-6).

An edit sample is (source image Iˢ, target image Iᵗ, source caption Tˢ, target caption Tᵗ). With X the anchors,
Y their positives and Y' the hard negatives of the whole batch (eq. 3):

    NegCL(X; Y, Y') = −(1/N) Σ_i log exp(s⟨x_i,y_i⟩) / [Σ_k exp(s⟨x_i,y_k⟩) + Σ_m exp(s⟨x_i,y'_m⟩)]

so each anchor's softmax runs over 2N columns: the batch's N positives-of-others plus the N edited counterparts.

    L_HN^I = NegCL(Iˢ; Tˢ, Tᵗ) + NegCL(Iᵗ; Tᵗ, Tˢ)      (eq. 4, image → text)
    L_HN^T = NegCL(Tˢ; Iˢ, Iᵗ) + NegCL(Tᵗ; Iᵗ, Iˢ)      (eq. 5, text → image)
    L_HN   = L_HN^I + L_HN^T                             (eq. 6; a sum of four cross-entropies, as in the paper)

The four image-caption products are computed once; the text-anchored terms read them transposed. Given `rows`
(local loss, losses.registry), each of the four terms computes those anchors only, against all 2N columns, so the
image and text anchors need their own (n, N) products: I_r Tᵀ for eq. 4 and T_r Iᵀ for eq. 5.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from sharpclip.losses._common import row_cross_entropy, scale_from_log
from sharpclip.losses.registry import register


def _neg_cl(positives: Tensor, negatives: Tensor, rows: slice | None = None) -> Tensor:
    """Eq. 3 from logits: positives (N, N) anchor-vs-positives, negatives (N, N) anchor-vs-hard-negatives; with
    `rows`, (n, N) each, those anchors' share of the mean."""
    logits = torch.cat([positives, negatives], dim=1)
    if rows is not None:
        return row_cross_entropy(logits, rows, positives.shape[1])
    labels = torch.arange(positives.shape[0], device=positives.device)
    return F.cross_entropy(logits, labels)


@register("edit_negatives")
def edit_negatives(
    source_image: Tensor,
    target_image: Tensor,
    source_text: Tensor,
    target_text: Tensor,
    logit_scale: Tensor,
    rows: slice | None = None,
) -> Tensor:
    """Symmetric image and text hard negatives from instruction-edit pairs (CLIP-IN eq. 6).

    source_image, target_image, source_text, target_text: (N, D) L2-normalised; row i of each is one edit sample.
    rows: compute these edit samples' anchors only and return their share of the loss (local loss); None: all.
    """
    if rows is not None and source_image.shape[0]:  # (no edit pairs anywhere: neg_cl_symmetric's zero)
        return _local_rows(scale_from_log(logit_scale), source_image, target_image, source_text, target_text, rows)
    return neg_cl_symmetric(source_image, target_image, source_text, target_text, scale_from_log(logit_scale))


def neg_cl_symmetric(
    source_image: Tensor, target_image: Tensor, source_text: Tensor, target_text: Tensor, scale: Tensor
) -> Tensor:
    """Eq. 6 with the scale s itself (not its log): the four (N, D) inputs as in `edit_negatives`; scale: scalar."""
    if source_image.shape[0] == 0:  # a batch without edit pairs contributes nothing (not NaN)
        return source_image.sum() * 0.0
    ss = scale * source_image @ source_text.t()  # [i, j] = ⟨Iˢ_i, Tˢ_j⟩
    st = scale * source_image @ target_text.t()
    ts = scale * target_image @ source_text.t()
    tt = scale * target_image @ target_text.t()
    image_to_text = _neg_cl(ss, st) + _neg_cl(tt, ts)
    text_to_image = _neg_cl(ss.t(), ts.t()) + _neg_cl(tt.t(), st.t())
    return image_to_text + text_to_image


def _local_rows(s: Tensor, si: Tensor, ti: Tensor, st: Tensor, tt: Tensor, rows: slice) -> Tensor:
    """Eq. 6's share of anchors `rows`: image anchors against all captions, caption anchors against all images."""
    image_to_text = _neg_cl(s * si[rows] @ st.t(), s * si[rows] @ tt.t(), rows)
    image_to_text = image_to_text + _neg_cl(s * ti[rows] @ tt.t(), s * ti[rows] @ st.t(), rows)
    text_to_image = _neg_cl(s * st[rows] @ si.t(), s * st[rows] @ ti.t(), rows)
    text_to_image = text_to_image + _neg_cl(s * tt[rows] @ ti.t(), s * tt[rows] @ si.t(), rows)
    return image_to_text + text_to_image
