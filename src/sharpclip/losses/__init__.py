"""Loss terms of both papers, each a pure function of embeddings and a scale, registered by name.

| name             | paper                   | module            |
|------------------|-------------------------|-------------------|
| `infonce`        | HN-CLIP eq. 1           | infonce.py        |
| `hn_clip`        | HN-CLIP eq. 2           | margins.py        |
| `filip`          | HN-CLIP §2.3 (FILIP)    | token.py          |
| `edit_negatives` | CLIP-IN eqs. 3-6        | edit_negatives.py |
| `distill_cosine` | CLIP-IN eq. 7           | distill.py        |
| `sigmoid`        | SigLIP (+ HN margin)    | sigmoid.py        |

Diagnostic terms (weight 0, no gradient, logged): the InfoNCE saturation monitor, monitors.py.

For other people's training code, drop_in.py wraps these losses in open_clip's loss interface (HNClipLoss,
SigLipMarginLoss, EditNegativesLoss) and reads Hugging Face CLIPModel / SiglipModel outputs (hf_hn_loss); it
gathers across processes itself, so it is imported on its own: `from sharpclip.losses.drop_in import HNClipLoss`.
"""

from sharpclip.losses import registry
from sharpclip.losses.distill import distill_cosine
from sharpclip.losses.edit_negatives import edit_negatives
from sharpclip.losses.infonce import infonce
from sharpclip.losses.margins import boosted_similarity, hn_clip, margin_matrix
from sharpclip.losses.objective import Objective, Term, build_objective
from sharpclip.losses.sigmoid import sigmoid
from sharpclip.losses.token import filip, token_similarities

__all__ = [
    "Objective",
    "Term",
    "boosted_similarity",
    "build_objective",
    "distill_cosine",
    "edit_negatives",
    "filip",
    "hn_clip",
    "infonce",
    "margin_matrix",
    "registry",
    "sigmoid",
    "token_similarities",
]
