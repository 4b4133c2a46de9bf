"""Saved-activation bytes per (layer, token, channel) of CLIP towers, measured on this machine, as JSON: the factors
train.memory_plan.ACTIVATION_BYTES estimates activations with.

    python benchmarks/activation_bytes.py [--device cpu]

Randomly initialised CLIPs (4× MLP, SDPA attention, 224 px images in 16 px patches, 77 text positions) of width 256
(4 layers) and 512 (2 layers) run `memory_plan.measure_activations` (a forward and backward of 1 and 2 rows, the bytes
the autograd graph saved per row) at fp32 and under bf16 autocast; each tower's bytes are divided by its layers ×
tokens × width.
"""

from __future__ import annotations

import argparse
import json

import torch
from transformers import CLIPConfig, CLIPModel

from sharpclip.models.hf import wrap
from sharpclip.train import memory_plan as mp

SHAPES = ((256, 4, 4), (512, 8, 2))  # width, heads, layers


def clip(width: int, heads: int, layers: int) -> torch.nn.Module:
    tower = dict(hidden_size=width, intermediate_size=4 * width, num_hidden_layers=layers, num_attention_heads=heads)
    return wrap(CLIPModel(CLIPConfig(text_config={**tower, "max_position_embeddings": 77},
                                     vision_config={**tower, "image_size": 224, "patch_size": 16},
                                     projection_dim=width)))  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    device = torch.device(parser.parse_args().device)
    for width, heads, layers in SHAPES:
        model = clip(width, heads, layers).to(device)
        towers = {t.name: t for t in mp.model_shape(model).towers}
        for precision in ("fp32", "bf16"):
            measured = mp.measure_activations(model, precision, device)
            factor = {k: round(v / (towers[k].layers * towers[k].tokens * towers[k].width), 1)
                      for k, v in measured.items()}  # fmt: skip
            print(json.dumps({"width": width, "layers": layers, "precision": precision, "device": device.type,
                              "bytes_per_row": measured, "bytes_per_layer_token_channel": factor}))  # fmt: skip


if __name__ == "__main__":
    main()
