"""Peak memory and time of exact 8 × 16 cached-gradient accumulation against one plain batch of 128, as JSON.

    python benchmarks/accumulation_memory.py [--steps 3] [--tokens]

The model is a small Hugging Face CLIPModel built in code (4+4 layers, width 256, 64 px images, 77 tokens).
Each mode runs in a fresh subprocess: after set-up the kernel's peak-RSS counter is reset (/proc/self/clear_refs),
one training step runs, and the step's memory is the new peak minus the RSS before it. Time is the median of
`--steps` further steps. Both steps use the HN-CLIP loss on the full 128 × 128 matrix: the two modes compute the
same gradients (tested in tests/train), so only their cost differs. Target: memory ≤ 0.35×, time ≤ 1.5×.
`--tokens` also caches the towers' token states (as FILIP's token term does: (B, 64, 256) patches and (B, 77, 256)
caption tokens) and adds a small token term to the loss, which is where a second copy of the cached features shows.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F


def _status(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"{field} not in /proc/self/status (this benchmark needs Linux)")


def _model_and_batch(batch: int):
    from transformers import CLIPConfig, CLIPModel

    torch.manual_seed(0)
    text = {"vocab_size": 1000, "hidden_size": 256, "intermediate_size": 1024, "num_hidden_layers": 4,
            "num_attention_heads": 4, "max_position_embeddings": 77, "eos_token_id": 999}  # fmt: skip
    vision = {"image_size": 64, "patch_size": 8, "hidden_size": 256, "intermediate_size": 1024,
              "num_hidden_layers": 4, "num_attention_heads": 4}  # fmt: skip
    model = CLIPModel(CLIPConfig(text_config=text, vision_config=vision, projection_dim=256))
    ids = torch.randint(0, 998, (batch, 77))
    ids[:, -1] = 999
    return model, {"pixel_values": torch.randn(batch, 3, 64, 64), "input_ids": ids}


def _step(mode: str, model, batch, micro: int, tokens: bool = False) -> None:
    from sharpclip.losses import hn_clip
    from sharpclip.train.accumulate import cached_gradient_step

    def encode(mb):
        image = model.get_image_features(pixel_values=mb["pixel_values"])
        text = model.get_text_features(input_ids=mb["input_ids"])
        out = {"image": F.normalize(image.pooler_output, dim=-1), "text": F.normalize(text.pooler_output, dim=-1)}
        if tokens:
            out["image_tokens"] = F.normalize(image.last_hidden_state[:, 1:], dim=-1)
            out["text_tokens"] = F.normalize(text.last_hidden_state, dim=-1)
        return out

    def loss_fn(f):
        loss = hn_clip(f["image"], f["text"], model.logit_scale)
        if tokens:  # a token term: every token feature receives a gradient, as under FILIP
            loss = loss + 0.1 * (f["image_tokens"].mean(1) * f["text_tokens"].mean(1)).sum(-1).mean()
        return {"loss": loss}

    model.zero_grad(set_to_none=True)
    if mode == "plain":
        loss_fn(encode(batch))["loss"].backward()
    else:
        n = batch["input_ids"].shape[0]
        parts = [{k: v[i : i + micro] for k, v in batch.items()} for i in range(0, n, micro)]
        cached_gradient_step(encode, parts, loss_fn)


def child(mode: str, batch: int, micro: int, steps: int, tokens: bool = False) -> dict[str, float]:
    torch.set_num_threads(2)
    model, data = _model_and_batch(batch)
    Path("/proc/self/clear_refs").write_text("5")  # reset the peak-RSS counter (VmHWM)
    before = _status("VmRSS")
    _step(mode, model, data, micro, tokens)
    peak = _status("VmHWM") - before
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        _step(mode, model, data, micro, tokens)
        times.append(time.perf_counter() - start)
    return {"peak_mib": peak / 2**20, "step_s": statistics.median(times)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--micro", type=int, default=16)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--tokens", action="store_true", help="also cache and train on token states (FILIP-like)")
    parser.add_argument("--child", choices=["plain", "exact"])
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(args.child, args.batch, args.micro, args.steps, args.tokens)))
        return
    results = {}
    for mode in ("plain", "exact"):
        cmd = [sys.executable, __file__, "--child", mode, "--batch", str(args.batch), "--micro", str(args.micro),
               "--steps", str(args.steps)] + (["--tokens"] if args.tokens else [])  # fmt: skip
        results[mode] = json.loads(subprocess.run(cmd, check=True, capture_output=True, text=True).stdout)
    plain, exact = results["plain"], results["exact"]
    print(
        json.dumps(
            {
                "memory_ratio": round(exact["peak_mib"] / plain["peak_mib"], 3),
                "time_ratio": round(exact["step_s"] / plain["step_s"], 3),
                "plain_128": {k: round(v, 3) for k, v in plain.items()},
                f"exact_{args.batch // args.micro}x{args.micro}": {k: round(v, 3) for k, v in exact.items()},
                "tokens": args.tokens,
                "targets": {"memory_ratio": 0.35, "time_ratio": 1.5},
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
