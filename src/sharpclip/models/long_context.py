"""Long-CLIP positional stretching (Zhang et al. 2024, "Long-CLIP", §3.1 "knowledge-preserved stretching").

An absolute-position text tower trained on L positions is stretched to f·L − (f−1)·k positions (f = 4, k = 20:
CLIP 77 → 248, SigLIP 64 → 196):

    new[p]            = old[p]                                            p < k         (kept, frozen in training)
    new[k + f·i + j]  = ((f − j)·old[k + i] + j·old[k + i + 1]) / f       i < L − k − 1, j < f   (interpolated)
    new[k + f·(L−k−1) + j] = old[L−1] + j·(old[L−1] − old[L−2]) / f       j < f         (extrapolated tail)

The first k rows are frozen as Long-CLIP does it, with two tables (`positional_embedding` frozen for p < k and
`positional_embedding_res` trainable for p ≥ k): `KeptPositionEmbedding` holds the kept rows in a buffer and the
full trainable table in `weight`, and reads rows p < k from the buffer, so neither gradients nor weight decay can
move them. The text config records the new length (`max_position_embeddings`) and the kept count
(`sharpclip_keep_positions`), so a saved model is rebuilt with the same table and freezing (`restore_kept_positions`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

KEEP_KEY = "sharpclip_keep_positions"  # text-config attribute: rows read from the frozen buffer


def stretched_length(length: int, keep: int, factor: int) -> int:
    """Positions after the stretch: f·L − (f−1)·k."""
    return factor * length - (factor - 1) * keep


def stretch_positions(old: Tensor, keep: int = 20, factor: int = 4) -> Tensor:
    """Long-CLIP's stretch of a position table (see the module docstring).

    old: (L, D) with L ≥ keep + 2. Returns (f·L − (f−1)·keep, D) in old's dtype.
    """
    length = old.shape[0]
    if length < keep + 2:
        raise ValueError(f"cannot stretch {length} positions keeping {keep}: need at least keep + 2 rows")
    body = old[keep:].float()
    j = torch.arange(factor, dtype=torch.float32, device=old.device)[:, None, None] / factor  # (f, 1, 1)
    inner = (1 - j) * body[None, :-1] + j * body[None, 1:]  # (f, L−k−1, D): j-th fraction between rows i, i+1
    inner = inner.transpose(0, 1).reshape(-1, old.shape[1])  # row k + f·i + j
    tail = body[-1] + j[:, 0] * (body[-1] - body[-2])  # (f, D)
    return torch.cat([old[:keep].float(), inner, tail]).to(old.dtype)


def stretch_factor(length: int, target: int, keep: int) -> int:
    """The integer f with f·length − (f−1)·keep = target; errors name the lengths the rule can reach."""
    f, rem = divmod(target - keep, length - keep)
    if rem or f < 1:
        reachable = ", ".join(str(stretched_length(length, keep, k)) for k in (2, 3, 4, 5))
        raise ValueError(
            f"model.context_length={target}: the Long-CLIP stretch of {length} positions keeping {keep} reaches "
            f"f·{length} − (f−1)·{keep} only ({reachable}, ...); pick one of these or change model.keep_positions"
        )
    return f


class KeptPositionEmbedding(nn.Embedding):
    """A position table whose first `keep` rows come from a frozen buffer; `weight` (L, D) trains as usual.

    State dict: `weight` (L, D) and `kept` (keep, D). `folded()` gives the plain table an HF export writes.
    """

    def __init__(self, weight: Tensor, keep: int) -> None:
        super().__init__(weight.shape[0], weight.shape[1], _weight=weight.detach().clone())
        self.keep = keep
        self.register_buffer("kept", weight[:keep].detach().clone())

    def table(self) -> Tensor:
        """(L, D): the frozen kept rows, then the trainable rows of `weight`."""
        return torch.cat([self.kept, self.weight[self.keep :]])

    def forward(self, position_ids: Tensor) -> Tensor:
        """Look `position_ids` up in `table()`."""
        return F.embedding(position_ids, self.table())

    def folded(self) -> nn.Embedding:
        """A plain `nn.Embedding` holding `table()`, for export."""
        emb = nn.Embedding(self.num_embeddings, self.embedding_dim)
        emb.weight.data.copy_(self.table().detach())
        return emb


def _set_length(text_model: nn.Module, config_owner: nn.Module | None, length: int) -> None:
    """Point the position ids and every config that records the text length at `length`."""
    emb = text_model.embeddings
    emb.position_ids = torch.arange(length, device=emb.position_ids.device)[None]
    configs = [text_model.config] + ([config_owner.config.text_config] if config_owner is not None else [])
    for cfg in configs:
        cfg.max_position_embeddings = length


def stretch_text_positions(text_model: nn.Module, target: int, keep: int = 20, config_owner: nn.Module | None = None):
    """Stretch a CLIP/SigLIP text tower's position table in place to `target` rows and freeze the first `keep`.

    text_model: a transformers `CLIPTextModel` / `SiglipTextModel`; config_owner: the dual model whose
    `config.text_config` must record the new length too (so `save_pretrained` → `from_pretrained` rebuilds it).
    """
    old = text_model.embeddings.position_embedding
    if isinstance(old, KeptPositionEmbedding):
        raise ValueError("this text tower is already stretched; stretch the original table once")
    factor = stretch_factor(old.weight.shape[0], target, keep)
    new = stretch_positions(old.weight.detach(), keep, factor)
    text_model.embeddings.position_embedding = KeptPositionEmbedding(new, keep)
    _set_length(text_model, config_owner, target)
    _set_keep(text_model, config_owner, keep)


def _set_keep(text_model: nn.Module, config_owner: nn.Module | None, keep: int) -> None:
    setattr(text_model.config, KEEP_KEY, keep)
    if config_owner is not None:
        setattr(config_owner.config.text_config, KEEP_KEY, keep)


def restore_kept_positions(text_model: nn.Module) -> None:
    """After loading a saved stretched model: read the first rows from a frozen buffer again (no-op otherwise)."""
    keep = getattr(text_model.config, KEEP_KEY, None)
    emb = getattr(text_model.embeddings, "position_embedding", None)
    if keep and emb is not None and not isinstance(emb, KeptPositionEmbedding):
        text_model.embeddings.position_embedding = KeptPositionEmbedding(emb.weight.detach(), keep)


def fold_kept_positions(text_model: nn.Module) -> None:
    """Replace a `KeptPositionEmbedding` by the plain `nn.Embedding` it computes (for HF export)."""
    emb = getattr(text_model.embeddings, "position_embedding", None)  # a RoPE tower has none
    if isinstance(emb, KeptPositionEmbedding):
        text_model.embeddings.position_embedding = emb.folded().to(emb.weight.device)
