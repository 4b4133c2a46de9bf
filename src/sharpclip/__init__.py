"""sharpclip: fine-tune CLIP-style dual encoders to tell near-duplicate images and captions apart.

Implements HN-CLIP (adaptive similarity margins, token-level term) and CLIP-IN (instruction-edit hard negatives,
long captions, RoPE text tower by distillation) over Hugging Face backbones.
"""

__version__ = "0.1.0"
