"""One training step on a GPU: img/s and peak memory of ViT-B/16- and ViT-L/14-size CLIPs, as JSON lines.

    python benchmarks/gpu_step.py [--models b16,l14] [--steps 5] [--full] [--dynamic]
    python benchmarks/gpu_step.py --check-on-cpu      (the script's own smoke test: a tiny CLIP, batch 16, CPU)

Models are transformers CLIPModels built in code with random weights (no download): OpenAI's ViT-B/16 and ViT-L/14
shapes, 224 px, text towers stretched to 248 positions (Long-CLIP). Every step is a real `train.step.run_step` on a
global batch of 128 (captions of 20-248 tokens, padded as the loader pads them: the full 248 positions here,
`--dynamic` pads to the longest), bf16 autocast on the towers, AdamW, batches copied from pinned memory. Per
configuration: 2 warm-up steps, then the median of `--steps` timed steps (CUDA-synchronised) and the peak allocated
memory.

The default grid, per model: `infonce`, `hn_clip`, `hn_clip` + `filip` under exact accumulation (micro-batches of 32)
and per-micro-batch accumulation (16 × 8); SDPA against eager attention and `torch.compile` on/off for `infonce`
under exact accumulation; and ViT-L/14 with gradient checkpointing under exact accumulation (the memory target).
`--full` runs every objective × accumulation × attention × compile combination.

Ratios (targets): `hn_clip` step ≤ 1.01 × `infonce`; exact accumulation ≤ 1.4 × per-micro-batch at the same global
batch; ViT-L/14, batch 128, exact accumulation + gradient checkpointing within 80 GB.
Without CUDA it prints one JSON line saying it did not run, and exits 0.
"""

from __future__ import annotations

import argparse
import gc
import itertools
import json
import statistics
import time
from dataclasses import dataclass

import torch
from transformers import CLIPConfig, CLIPModel

from sharpclip.config import LossConfig, TermConfig
from sharpclip.data.schema import Batch
from sharpclip.models.hf import HFDualEncoder, wrap
from sharpclip.train.features import FeatureEncoder, build_objective
from sharpclip.train.optim import build_optimizer
from sharpclip.train.step import run_step
from sharpclip.train.trainer import compile_towers

VOCAB, EOS, CONTEXT, IMAGE = 49408, 49407, 248, 224
SHAPES = {  # OpenAI CLIP: (vision width, layers, heads, patch), (text width, layers, heads), projection
    "b16": ((768, 12, 12, 16), (512, 12, 8), 512),
    "l14": ((1024, 24, 16, 14), (768, 12, 12), 768),
    "tiny": ((64, 2, 4, 32), (64, 2, 4), 64),  # --check-on-cpu only
}
OBJECTIVES = {
    "infonce": {"clip": TermConfig("infonce")},
    "hn_clip": {"hn": TermConfig("hn_clip")},
    "hn_clip+filip": {"hn": TermConfig("hn_clip"), "tok": TermConfig("filip")},
}
ACCUMULATION = {"exact": ("exact", 32), "per_micro_batch": ("per_micro_batch", 16)}  # micro-batch rows at 128


@dataclass(frozen=True)
class Setting:
    model: str
    objective: str
    accumulation: str
    attention: str = "sdpa"
    compiled: bool = False
    checkpointing: bool = False


def build_clip(name: str, attention: str) -> HFDualEncoder:
    (vw, vl, vh, patch), (tw, tl, th), proj = SHAPES[name]
    text = {"vocab_size": VOCAB, "hidden_size": tw, "intermediate_size": 4 * tw, "num_hidden_layers": tl,
            "num_attention_heads": th, "max_position_embeddings": CONTEXT, "eos_token_id": EOS, "bos_token_id": 0,
            "pad_token_id": EOS}  # fmt: skip
    vision = {"image_size": IMAGE, "patch_size": patch, "hidden_size": vw, "intermediate_size": 4 * vw,
              "num_hidden_layers": vl, "num_attention_heads": vh}  # fmt: skip
    config = CLIPConfig(text_config=text, vision_config=vision, projection_dim=proj)
    config._attn_implementation = attention
    config.text_config._attn_implementation = attention
    config.vision_config._attn_implementation = attention
    return wrap(CLIPModel(config))


def random_batch(rows: int, dynamic: bool, seed: int = 0, pin: bool = True) -> Batch:
    """Pinned random pixels and captions of 20-248 tokens (eos-terminated, eos-padded)."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(20, CONTEXT, (rows,), generator=g)
    width = min(CONTEXT, -(-int(lengths.max() + 1) // 8) * 8) if dynamic else CONTEXT
    positions = torch.arange(width)[None, :]
    ids = torch.randint(1, EOS - 1, (rows, width), generator=g).masked_fill(positions >= lengths[:, None], EOS)
    batch = Batch(
        ids=[f"row-{i}" for i in range(rows)],
        pixel_values=torch.randn(rows, 3, IMAGE, IMAGE, generator=g),
        input_ids=ids,
        attention_mask=(positions <= lengths[:, None]).long(),
        groups=torch.arange(rows),
    )
    return batch.pin_memory() if pin else batch


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure(setting: Setting, steps: int, dynamic: bool, device: torch.device, batch_size: int = 128) -> dict:
    model = build_clip(setting.model, setting.attention).to(device).train()
    if setting.checkpointing:
        model.hf_model.activation_checkpointing_enable({"use_reentrant": False})
    if setting.compiled:
        compile_towers(model)
    objective = build_objective(LossConfig(terms=OBJECTIVES[setting.objective]))
    encoder = FeatureEncoder(model, objective.feature_keys, precision="bf16")
    optimizer = build_optimizer(model, 1e-5, 0.1, {})
    mode, micro = ACCUMULATION[setting.accumulation]
    micro = micro * batch_size // 128
    batch = random_batch(batch_size, dynamic, pin=device.type == "cuda")

    def step() -> float:
        _sync(device)
        start = time.perf_counter()
        optimizer.zero_grad(set_to_none=True)
        run_step(encoder, objective, batch, micro, mode)
        optimizer.step()
        _sync(device)
        return time.perf_counter() - start

    record = {**setting.__dict__, "micro_batch": micro, "batch": batch_size, "text_positions": batch.input_ids.shape[1]}
    try:
        for _ in range(2):  # warm-up: kernels selected, compiled graphs built, allocator grown
            step()
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        seconds = statistics.median(step() for _ in range(steps))
        record.update(step_s=round(seconds, 4), img_per_s=round(batch_size / seconds, 1))
        if device.type == "cuda":
            record["peak_gib"] = round(torch.cuda.max_memory_allocated(device) / 2**30, 2)
    except torch.cuda.OutOfMemoryError:
        record["error"] = "out of memory"
    except Exception as err:  # a failed configuration (e.g. compile) is reported, not fatal to the others
        record["error"] = f"{type(err).__name__}: {str(err).splitlines()[0][:200] if str(err) else ''}"
    return record


def grid(models: list[str], full: bool) -> list[Setting]:
    if full:
        combos = itertools.product(models, OBJECTIVES, ACCUMULATION, ("sdpa", "eager"), (False, True))
        return [Setting(*c) for c in combos]
    out = [Setting(m, o, a) for m in models for o in OBJECTIVES for a in ACCUMULATION]
    out += [Setting(m, "infonce", "exact", attention="eager") for m in models]
    out += [Setting(m, "infonce", "exact", compiled=True) for m in models]
    out += [Setting(m, "infonce", "exact", checkpointing=True) for m in models if m != "b16"]  # L/14: the memory target
    return out


def _time(results: list[dict], **match) -> float | None:
    for r in results:
        if all(r.get(k) == v for k, v in match.items()) and "step_s" in r:
            return r["step_s"]
    return None


def ratios(results: list[dict], models: list[str]) -> dict:
    out: dict = {}
    base = {"attention": "sdpa", "compiled": False, "checkpointing": False}
    for m in models:
        for acc in ACCUMULATION:
            infonce = _time(results, model=m, objective="infonce", accumulation=acc, **base)
            for obj in ("hn_clip", "hn_clip+filip"):
                t = _time(results, model=m, objective=obj, accumulation=acc, **base)
                if infonce and t:
                    out[f"{m}/{acc}/{obj}_over_infonce"] = round(t / infonce, 4)
        exact = _time(results, model=m, objective="hn_clip", accumulation="exact", **base)
        per_micro = _time(results, model=m, objective="hn_clip", accumulation="per_micro_batch", **base)
        if exact and per_micro:
            out[f"{m}/hn_clip/exact_over_per_micro_batch"] = round(exact / per_micro, 4)
        sdpa = _time(results, model=m, objective="infonce", accumulation="exact", **base)
        eager = _time(results, model=m, objective="infonce", accumulation="exact", **{**base, "attention": "eager"})
        compiled = _time(results, model=m, objective="infonce", accumulation="exact", **{**base, "compiled": True})
        if sdpa and eager:
            out[f"{m}/sdpa_over_eager"] = round(sdpa / eager, 4)
        if sdpa and compiled:
            out[f"{m}/compiled_over_eager_mode"] = round(compiled / sdpa, 4)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="b16,l14", help="comma-separated: b16, l14")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--full", action="store_true", help="every objective × accumulation × attention × compile")
    parser.add_argument("--dynamic", action="store_true", help="pad captions to the batch's longest (multiple of 8)")
    parser.add_argument("--check-on-cpu", action="store_true", help="run the default grid on a tiny CLIP on the CPU")
    args = parser.parse_args()
    if args.check_on_cpu:
        device, models, batch_size = torch.device("cpu"), ["tiny"], 16
    elif not torch.cuda.is_available():
        print(json.dumps({"benchmark": "gpu_step", "ran": False, "reason": "no CUDA device (torch.cuda.is_available() "
                          "is False); run it on a GPU machine"}))  # fmt: skip
        return
    else:
        device, models, batch_size = torch.device("cuda", 0), [m for m in args.models.split(",") if m], 128
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = True  # train.tf32's default
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    header = {"benchmark": "gpu_step", "ran": True, "device": name, "torch": torch.__version__, "bf16": True}
    print(json.dumps(header), flush=True)
    results = []
    for setting in grid(models, args.full):
        results.append(measure(setting, args.steps, args.dynamic, device, batch_size))
        print(json.dumps(results[-1]), flush=True)
        gc.collect()  # the previous model and optimizer state, before the next is built
        if device.type == "cuda":
            torch.cuda.empty_cache()
    print(json.dumps({"benchmark": "gpu_step", "ratios": ratios(results, models)}), flush=True)


if __name__ == "__main__":
    main()
