"""The small CLIP the training benchmarks share: a transformers CLIPModel built in code (no download).

4 + 4 layers of width 256, 64 px images in 8 px patches, 77-token captions; big enough that the towers dominate a
step, small enough to run on two cores.
"""

from __future__ import annotations

import torch
from transformers import CLIPConfig, CLIPModel

from sharpclip.data.schema import Batch
from sharpclip.models.hf import HFDualEncoder, wrap

VOCAB, EOS, CONTEXT, IMAGE = 1000, 999, 77, 64


def small_clip(seed: int = 0) -> HFDualEncoder:
    torch.manual_seed(seed)
    text = {"vocab_size": VOCAB, "hidden_size": 256, "intermediate_size": 1024, "num_hidden_layers": 4,
            "num_attention_heads": 4, "max_position_embeddings": CONTEXT, "eos_token_id": EOS, "bos_token_id": 0,
            "pad_token_id": EOS}  # fmt: skip
    vision = {"image_size": IMAGE, "patch_size": 8, "hidden_size": 256, "intermediate_size": 1024,
              "num_hidden_layers": 4, "num_attention_heads": 4}  # fmt: skip
    return wrap(CLIPModel(CLIPConfig(text_config=text, vision_config=vision, projection_dim=256)))


def random_batch(rows: int, seed: int = 0) -> Batch:
    """Random pixels and captions of random length (eos-terminated, padded with eos as CLIP tokenizers do)."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(20, CONTEXT, (rows,), generator=g)
    positions = torch.arange(CONTEXT)[None, :]
    ids = torch.randint(0, EOS - 1, (rows, CONTEXT), generator=g).masked_fill(positions >= lengths[:, None], EOS)
    return Batch(
        ids=[f"row-{i}" for i in range(rows)],
        pixel_values=torch.randn(rows, 3, IMAGE, IMAGE, generator=g),
        input_ids=ids,
        attention_mask=(positions <= lengths[:, None]).long(),
        groups=torch.arange(rows),
    )
