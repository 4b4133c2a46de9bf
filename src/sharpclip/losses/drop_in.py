"""HN-CLIP's loss behind open_clip's loss interface, for the training code people already have.

    from sharpclip.losses.drop_in import HNClipLoss
    loss = HNClipLoss(local_loss=True, gather_with_grad=True, rank=rank, world_size=world, gamma=0.5)
    total = loss(image_features, text_features, logit_scale)      # logit_scale = exp(log s), as open_clip passes it

`HNClipLoss` is open_clip's `ClipLoss` (same constructor, same call, same gathering and labels) with HN-CLIP's
detached caption-similarity margin on the negatives (HN-CLIP eq. 2): at γ = 0 it is ClipLoss, value and gradients.
`SigLipMarginLoss` is open_clip's `SigLipLoss` with the same margin (its neighbour-exchange forms included),
`EditNegativesLoss` CLIP-IN's edit-pair term (CLIP-IN eq. 6) for the edit pairs the caller passes, and
`hf_hn_loss` reads a transformers CLIPModel / SiglipModel forward's outputs.

Across W ranks with B rows each, the margin follows the logits it is added to:

    local_loss False   every rank builds the global (W·B, W·B) logits; Ḡ is the global text-text matrix, zero
                       diagonal (the loss is sharpclip's `hn_clip` on the gathered batch)
    local_loss True    rank r's logits are its B rows against the W·B gathered columns; Ḡ is rank r's texts against
                       the gathered texts, detached, zero at each row's own positive (i, r·B + i)

`gather_with_grad` and the replacement of a rank's own block when gathering without gradient are open_clip's, so
a run that swaps ClipLoss for HNClipLoss changes nothing but the margin.

Placement. The losses layer is pure math, and train.distributed is the trainer's link to torch.distributed; but
code that calls this module has no sharpclip trainer to gather for it, and the losses layer may not import train.
It gathers through `sharpclip.collectives`, the same autograd all-gather (reduce-scatter backward) the trainer's
exact accumulation uses, and computes through the registered losses: `HNClipLoss` is `hn_clip` on the gathered
batch (its `rows` form under local_loss, rescaled to open_clip's per-rank mean; open_clip's local loss without
gathered gradients is `hn_clip_rows` with `detach_columns`). `get_logits` materialises the logits for callers that
read them (open_clip's interface); the loss never goes through it. The sigmoid blocks and
the edit-pair term are sigmoid.py's `pairwise_sigmoid` and edit_negatives.py's `neg_cl_symmetric`.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator

import torch
from torch import Tensor, nn

from sharpclip import collectives
from sharpclip.losses._common import check_hyperparameters, scale_from_log
from sharpclip.losses.edit_negatives import neg_cl_symmetric
from sharpclip.losses.margins import boosted_similarity, hn_clip, hn_clip_rows, margin_block
from sharpclip.losses.sigmoid import pairwise_sigmoid

Reference = Tensor | Callable[[Tensor], Tensor] | None
SIGLIP_DIST_IMPLS = ("bidir", "shift", "reduce", "gather")


def _check_world(world_size: int, rank: int) -> None:
    """The rank and world size the caller passed (open_clip's args) must be the process group's."""
    if world_size > 1 and collectives.process_group_size() != world_size:
        raise ValueError(
            f"world_size={world_size} but the default process group has {collectives.process_group_size()} "
            "process(es): initialise torch.distributed first and pass its rank and world size"
        )
    if not 0 <= rank < world_size:
        raise ValueError(f"rank={rank} is outside world_size={world_size}")


def _reference_rows(reference: Reference, text_features: Tensor, override: Tensor | None) -> Tensor | None:
    """The (B, D) rows Ḡ is built from instead of the current text features, or None (Ḡ from the texts)."""
    ref = override if override is not None else reference(text_features) if callable(reference) else reference
    if ref is not None and ref.shape != text_features.shape:
        raise ValueError(
            f"reference embeddings have shape {tuple(ref.shape)}, the text features {tuple(text_features.shape)}: "
            "pass one reference row per text row of this batch"
        )
    return None if ref is None else ref.detach()


class HNClipLoss(nn.Module):
    """open_clip's ClipLoss with HN-CLIP's margin: ½[CE(s(S + γḠ) + b, y) + CE(s(S + γḠ)ᵀ + b, y)] (eq. 2).

    local_loss, gather_with_grad, cache_labels, rank, world_size: as open_clip's ClipLoss (use_horovod is refused).
    gamma: the margin's weight γ (HN-CLIP's default 0.5; 0 gives ClipLoss exactly).
    reference: where Ḡ's caption similarities come from: None, the current text features (the paper's default);
        a (B, D) tensor of this batch's reference caption embeddings (e.g. a frozen copy of the initial text tower,
        HN-CLIP Table 3c), set before each call; or a callable from the text features to such a tensor.
    """

    def __init__(
        self,
        local_loss: bool = False,
        gather_with_grad: bool = False,
        cache_labels: bool = False,
        rank: int = 0,
        world_size: int = 1,
        use_horovod: bool = False,
        *,
        gamma: float = 0.5,
        reference: Reference = None,
    ):
        super().__init__()
        if use_horovod:
            raise ValueError("HNClipLoss: use_horovod=True is not supported; launch with torchrun (torch.distributed)")
        check_hyperparameters("HNClipLoss", gamma=gamma)  # finite, >= 0: the margin adds to the negatives' logits
        self.local_loss, self.gather_with_grad, self.cache_labels = local_loss, gather_with_grad, cache_labels
        self.rank, self.world_size, self.gamma, self.reference = rank, world_size, float(gamma), reference
        self.prev_num_logits = 0
        self.labels: dict[torch.device, Tensor] = {}

    def get_ground_truth(self, device: torch.device, num_logits: int) -> Tensor:
        """Row i's target column: i, or rank·B + i under local_loss (cached when `cache_labels`)."""
        if self.prev_num_logits == num_logits and device in self.labels:
            return self.labels[device]
        labels = torch.arange(num_logits, device=device, dtype=torch.long)
        if self.world_size > 1 and self.local_loss:
            labels = labels + num_logits * self.rank
        if self.cache_labels:
            self.labels[device], self.prev_num_logits = labels, num_logits
        return labels

    def _gather(self, features: Tensor, keep_own: bool = False) -> Tensor:
        """Every rank's rows, as open_clip gathers them; `keep_own`: the local block is `features` itself (with its
        gradient) under local_loss too, for the rows form to take this rank's rows from."""
        parts = collectives.gather_parts(features, with_grad=self.gather_with_grad)
        if not self.gather_with_grad and (keep_own or not self.local_loss):
            parts[self.rank] = features  # open_clip: the local block keeps its gradient
        return torch.cat(parts)

    def get_logits(
        self,
        image_features: Tensor,
        text_features: Tensor,
        logit_scale: Tensor | float,
        logit_bias: Tensor | None = None,
        reference_text: Tensor | None = None,
    ) -> tuple[Tensor, Tensor]:
        """(logits_per_image, logits_per_text): (N, N) each, or (B, N) under local_loss on W > 1 ranks.

        image_features, text_features: (B, D) L2-normalised, this rank's rows; logit_scale: s itself (exp'd).
        """
        ref = _reference_rows(self.reference, text_features, reference_text)
        if self.world_size == 1:
            sim = self._square(image_features, text_features, ref)
            per_image, per_text = logit_scale * sim, logit_scale * sim.t()
        else:
            _check_world(self.world_size, self.rank)
            all_image, all_text = self._gather(image_features), self._gather(text_features)
            all_ref = None if ref is None else torch.cat(collectives.gather_parts(ref, with_grad=False))
            if self.local_loss:
                per_image, per_text = self._local(image_features, text_features, all_image, all_text, ref, all_ref)
                per_image, per_text = logit_scale * per_image, logit_scale * per_text
            else:
                sim = self._square(all_image, all_text, all_ref)
                per_image, per_text = logit_scale * sim, logit_scale * sim.t()
        if logit_bias is not None:
            per_image, per_text = per_image + logit_bias, per_text + logit_bias
        return per_image, per_text

    def _square(self, image: Tensor, text: Tensor, ref: Tensor | None) -> Tensor:
        """S + γḠ over one square batch (margins.boosted_similarity; plain S at γ = 0)."""
        return image @ text.t() if self.gamma == 0 else boosted_similarity(image, text, self.gamma, ref)[0]

    def _local(
        self,
        image: Tensor,
        text: Tensor,
        all_image: Tensor,
        all_text: Tensor,
        ref: Tensor | None,
        all_ref: Tensor | None,
    ) -> tuple[Tensor, Tensor]:
        """This rank's rows against the gathered columns, both directions, each with the same Ḡ (B, N): Ḡ is
        symmetric, so text t_i against caption t_j is the margin of image i against caption j."""
        per_image, per_text = image @ all_text.t(), text @ all_image.t()
        if self.gamma == 0:
            return per_image, per_text
        rows, columns = (text, all_text) if ref is None else (ref, all_ref)
        margin = self.gamma * margin_block(rows, columns, offset=self.rank * image.shape[0])
        return per_image + margin, per_text + margin

    def forward(
        self,
        image_features: Tensor,
        text_features: Tensor,
        logit_scale: Tensor | float,
        logit_bias: Tensor | None = None,
        output_dict: bool = False,
        reference_text: Tensor | None = None,
    ) -> Tensor | dict[str, Tensor]:
        """The loss (a scalar), or {"contrastive_loss": loss} with `output_dict`, as open_clip's ClipLoss returns.

        reference_text: (B, D) reference rows for this call only (overrides `reference`), e.g. from a model wrapper
        whose output dict carries them.
        """
        # the rows form builds its targets itself; open_clip's label cache is kept as it would be
        self.get_ground_truth(image_features.device, len(image_features) * (1 if self.local_loss else self.world_size))
        loss = self._rows_loss(image_features, text_features, logit_scale, logit_bias, reference_text)
        return {"contrastive_loss": loss} if output_dict else loss

    def _rows_loss(
        self, image: Tensor, text: Tensor, scale: Tensor | float, bias: Tensor | None, reference: Tensor | None
    ) -> Tensor:
        """sharpclip's `hn_clip` over the (gathered) batch: every row without local_loss; under local_loss this
        rank's rows (its `rows` form, a share of the global mean), rescaled to open_clip's per-rank mean."""
        ref = _reference_rows(self.reference, text, reference)
        rows, detach_columns = None, False
        if self.world_size > 1:
            _check_world(self.world_size, self.rank)
            own = len(image)
            # open_clip's local loss without gathered gradients: only this rank's rows carry a gradient, its
            # columns (own block included) none; the rows are taken from the local features
            detach_columns = self.local_loss and not self.gather_with_grad
            image, text = self._gather(image, keep_own=detach_columns), self._gather(text, keep_own=detach_columns)
            ref = None if ref is None else torch.cat(collectives.gather_parts(ref, with_grad=False))
            rows = slice(self.rank * own, (self.rank + 1) * own) if self.local_loss else None
        log_scale = torch.log(torch.as_tensor(scale))  # open_clip passes s itself; the loss takes log s
        if rows is None:
            loss = hn_clip(image, text, log_scale, bias, ref, gamma=self.gamma)
        else:
            loss = hn_clip_rows(image, text, log_scale, bias, ref, rows, self.gamma, None, detach_columns)
        return loss if rows is None else loss * (len(image) / (rows.stop - rows.start))


class SigLipMarginLoss(nn.Module):
    """open_clip's SigLipLoss with HN-CLIP's margin on the negatives, rank r's B images against every rank's texts:

        L_r = −(1/B) Σ_i Σ_j log σ(z_ij · (s·(S + γḠ)_ij + b)),   z = +1 at each image's own caption, −1 elsewhere

    cache_labels, rank, world_size, dist_impl: as open_clip's SigLipLoss (which does not use cache_labels either).
    Texts of other ranks arrive by neighbour exchange ('bidir', the default, both directions at once; 'shift', one
    direction) or by an all-gather ('gather'; 'reduce', an all-reduce in open_clip, gives the same blocks and runs as
    'gather' here), each with gradient. Ḡ is this rank's texts against each block's texts, detached, zero only at
    the own block's diagonal.
    gamma (0: SigLipLoss exactly), reference: as `HNClipLoss`; reference rows travel with their texts, no gradient.
    """

    def __init__(
        self,
        cache_labels: bool = False,
        rank: int = 0,
        world_size: int = 1,
        dist_impl: str | None = None,
        *,
        gamma: float = 0.5,
        reference: Reference = None,
    ):
        super().__init__()
        self.dist_impl = dist_impl or "bidir"
        if self.dist_impl not in SIGLIP_DIST_IMPLS:
            raise ValueError(f"SigLipMarginLoss: dist_impl={dist_impl!r}; choose one of {', '.join(SIGLIP_DIST_IMPLS)}")
        check_hyperparameters("SigLipMarginLoss", gamma=gamma)
        self.cache_labels, self.rank, self.world_size = cache_labels, rank, world_size
        self.gamma, self.reference = float(gamma), reference

    def _block(
        self,
        image: Tensor,
        text: Tensor,
        ref: Tensor | None,
        rows: tuple[Tensor, Tensor | None],
        scale: Tensor | float,
        bias: Tensor | None,
        own: bool,
    ) -> Tensor:
        """One block's loss: this rank's images (B, D) against one rank's texts (B', D); rows: (texts, reference)
        of this rank's rows, whose similarity to the block's captions is the margin."""
        if self.gamma == 0:
            sim = image @ text.t()
        else:
            offset = 0 if own else None
            sim, _ = boosted_similarity(
                image, text, self.gamma, ref, rows=rows[0], reference_rows=rows[1], offset=offset
            )
        logits = scale * sim
        return pairwise_sigmoid(logits if bias is None else logits + bias, offset=0 if own else None)

    def _blocks(self, tensor: Tensor, with_grad: bool) -> Iterator[Tensor]:
        """Every other rank's block of `tensor`, in open_clip's order for `dist_impl`."""
        w, r = self.world_size, self.rank
        right, left = (r + 1) % w, (r - 1 + w) % w
        if self.dist_impl in ("reduce", "gather"):
            parts = collectives.gather_parts(tensor, with_grad=with_grad)
            yield from (part for i, part in enumerate(parts) if i != r)
            return
        to_right = to_left = tensor
        both, one_more = divmod(w - 1, 2) if self.dist_impl == "bidir" else (0, w - 1)
        for _ in range(both):
            from_right, from_left = collectives.exchange_both(to_left, to_right, left, right, with_grad=with_grad)
            yield from_right
            yield from_left
            to_left, to_right = from_right, from_left
        for _ in range(one_more):
            to_right = collectives.exchange(to_right, send_to=right, recv_from=left, with_grad=with_grad)
            yield to_right

    def forward(
        self,
        image_features: Tensor,
        text_features: Tensor,
        logit_scale: Tensor | float,
        logit_bias: Tensor | None = None,
        output_dict: bool = False,
        reference_text: Tensor | None = None,
    ) -> Tensor | dict[str, Tensor]:
        """This rank's loss, or {"contrastive_loss": loss}. image_features, text_features: (B, D) L2-normalised;
        logit_scale: s itself (exp'd); logit_bias: b, a scalar (SigLIP inits it at −10)."""
        ref = _reference_rows(self.reference, text_features, reference_text)
        rows = (text_features, ref)
        loss = self._block(image_features, text_features, ref, rows, logit_scale, logit_bias, own=True)
        if self.world_size > 1:
            _check_world(self.world_size, self.rank)
            texts = self._blocks(text_features, with_grad=True)
            refs = self._blocks(ref, with_grad=False) if ref is not None else itertools.repeat(None)
            for text, block_ref in zip(texts, refs, strict=False):  # refs repeats None without a reference
                loss = loss + self._block(image_features, text, block_ref, rows, logit_scale, logit_bias, own=False)
        return {"contrastive_loss": loss} if output_dict else loss


class EditNegativesLoss(nn.Module):
    """CLIP-IN's symmetric hard-negative term over instruction-edit pairs (CLIP-IN eq. 6), open_clip-style.

    The caller passes the edit pairs' four embeddings, row i of each one pair: source and target image, source and
    target caption. On W ranks every rank gathers every rank's pairs (ranks may hold different numbers) and computes
    the term over all of them, as ClipLoss does without local_loss; gather_with_grad as in ClipLoss.
    """

    def __init__(self, gather_with_grad: bool = False, rank: int = 0, world_size: int = 1):
        super().__init__()
        self.gather_with_grad, self.rank, self.world_size = gather_with_grad, rank, world_size

    def _gather(self, features: Tensor) -> Tensor:
        parts = collectives.gather_parts(features, with_grad=self.gather_with_grad, uneven=True)
        if not self.gather_with_grad:
            parts[self.rank] = features
        return torch.cat(parts)

    def forward(
        self,
        source_image: Tensor,
        target_image: Tensor,
        source_text: Tensor,
        target_text: Tensor,
        logit_scale: Tensor | float,
        output_dict: bool = False,
    ) -> Tensor | dict[str, Tensor]:
        """The term (a scalar), or {"edit_negatives_loss": term}. The four inputs: (E, D) L2-normalised, E ≥ 0 edit
        pairs on this rank; logit_scale: s itself (exp'd)."""
        features = (source_image, target_image, source_text, target_text)
        if self.world_size > 1:
            _check_world(self.world_size, self.rank)
            features = tuple(self._gather(f) for f in features)
        loss = neg_cl_symmetric(*features, torch.as_tensor(logit_scale))
        return {"edit_negatives_loss": loss} if output_dict else loss


def hf_hn_loss(
    outputs,
    logit_scale: Tensor,
    logit_bias: Tensor | None = None,
    *,
    gamma: float = 0.5,
    reference_text: Tensor | None = None,
    rank: int = 0,
    world_size: int = 1,
) -> Tensor:
    """L_HN of a transformers CLIPModel forward (HN-CLIP eq. 2), or SigLIP's loss with the margin of a SiglipModel's.

    outputs: the forward's output (CLIPOutput, SiglipOutput): its `image_embeds` and `text_embeds`, (B, D), which
        the model has L2-normalised. logit_scale: the model's `logit_scale` parameter, log s as transformers stores
        it (exp'd here and used as given, as the model's own loss uses it; the Trainer never clamps it).
        logit_bias: SiglipModel's `logit_bias`; given, the loss is the sigmoid one. reference_text: (B, D)
        reference rows for Ḡ (see `HNClipLoss`).
    rank, world_size: several processes (a Trainer's `args.process_index`, `args.world_size`): each rank's rows
        against every rank's gathered columns, with gradient; by default this process's batch alone.
    """
    image, text = outputs.image_embeds, outputs.text_embeds
    scale = scale_from_log(logit_scale)
    if logit_bias is None:
        loss = HNClipLoss(local_loss=True, gather_with_grad=True, rank=rank, world_size=world_size, gamma=gamma)
        return loss(image, text, scale, reference_text=reference_text)
    sigmoid = SigLipMarginLoss(rank=rank, world_size=world_size, gamma=gamma)
    return sigmoid(image, text, scale, logit_bias, reference_text=reference_text)
