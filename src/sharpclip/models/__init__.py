"""Dual encoders: the `DualEncoder` protocol, HF CLIP / SigLIP adapters, long context, peft adapters and export.

| module           | what                                                                 | paper                   |
|------------------|----------------------------------------------------------------------|-------------------------|
| base.py          | `DualEncoder`, `Embeddings` (global + token embeddings, masks)       | CLIP; FILIP tokens      |
| hf.py            | adapters over transformers CLIPModel, SiglipModel, Siglip2Model      |                         |
| factory.py       | `create_model(ModelConfig)`, checkpoints (`save_checkpoint`, layout) |                         |
| tiny.py          | tiny presets for tests and the demo                                  |                         |
| preprocessing.py | what the model decides about its inputs (`model_transforms`)         | CLIP preprocessing      |
| tokenizer.py     | offline word tokenizer (`build_word_tokenizer`), token counts        |                         |
| long_context.py  | Long-CLIP stretch, first rows frozen                                 | Long-CLIP §3.1          |
| openai_format.py | OpenAI-format / Long-CLIP state dicts → HF CLIPModel                 |                         |
| open_clip.py     | open_clip folders, epoch_N.pt + shipped configs → HF CLIPModel       |                         |
| rope.py          | RoPE text tower (+ NTK scaling)                                      | CLIP-IN §3.3, TULIP     |
| distill.py       | stage-1 distillation into the RoPE tower                             | CLIP-IN eq. 7           |
| adapters.py      | LoRA / DoRA presets via peft, merge                                  | LoRA eq. 3, DoRA eq. 5  |
| freezing.py      | lock a tower, unlock its last N layers                               |                         |
| export.py        | HF folder export with a reload check                                 |                         |
"""

from sharpclip.models import _notices  # noqa: F401  (first: importing transformers' processors warns)
from sharpclip.models.base import DualEncoder, Embeddings
from sharpclip.models.factory import ModelNotFoundError, create_model, load_checkpoint, save_checkpoint
from sharpclip.models.tiny import tiny_model
from sharpclip.models.tokenizer import build_word_tokenizer

__all__ = [
    "DualEncoder",
    "Embeddings",
    "ModelNotFoundError",
    "build_word_tokenizer",
    "create_model",
    "load_checkpoint",
    "save_checkpoint",
    "tiny_model",
]
