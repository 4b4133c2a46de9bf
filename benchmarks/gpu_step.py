"""One training step on a GPU: img/s and memory of ViT-L/14- and ViT-B/16-size CLIPs, with its own targets, as JSON
lines.

    python benchmarks/gpu_step.py [--models l14,b16] [--steps 5] [--full] [--dynamic]
    python benchmarks/gpu_step.py --trainer-run [--steps 20]   (ViT-L through Trainer, bf16, compile on, exact)
    python benchmarks/gpu_step.py --check-on-cpu      (the script's own smoke test: a tiny CLIP, batch 16, CPU)
    python benchmarks/gpu_step.py --dry-run [--max-rows 3]   (cheaper still: fp32, 77 positions, 64 px, one thread)

Models are transformers CLIPModels built in code, on the device, with random weights (no download): OpenAI's
ViT-L/14 (first) and ViT-B/16 shapes, 224 px, text towers stretched to 248 positions (Long-CLIP). Every step is a
real `train.step.run_step` on a global batch of 128 (captions of 20-248 tokens, padded to the full 248 positions;
`--dynamic` pads to the longest), bf16 autocast on the towers, AdamW, batches copied from pinned memory. Per
setting: 2 warm-up steps, then the median of `--steps` timed steps (CUDA-synchronised), peak allocated and reserved
memory. Dynamo is reset before every compiled setting, and each compiled row reports its compile health: graphs,
graph breaks (`counters["graph_break"]`), recompiles and recompile-limit hits (from Dynamo's own log records).
Rows come in order of importance, so a run cut short keeps the key numbers: per model `objective`, `interleaved`,
`sdpa`, then the compiled rows (`varying`, the compiled grid setting), the grid rows the targets compare, the rest
of the grid, `trainer`; `ratios` is printed again after every row.

The default grid, per model: `infonce`, `hn_clip`, `hn_clip` + `filip` under exact accumulation (micro-batches of 32)
and per-micro-batch accumulation (16); `hn_clip` exact and per-micro-batch at the same micro size (16 and 32) and
per-micro-batch encoding 64 rows a pass (the recipes' `encode_batch_size`); eager attention; compile on; ViT-L with
gradient checkpointing (the memory target). Besides the grid, per model:

- `objective`: the objectives alone (forward + backward on cached features, no towers), timed with CUDA events
  over 50 interleaved repetitions: what `hn_clip` costs over `infonce`, resolvable unlike whole-step ratios;
- `interleaved`: whole `infonce` and `hn_clip` steps alternated, 20 each, medians;
- `varying`: compiled, captions of changing widths and a short last micro-batch: recompiles and graph counts;
- `trainer`: `Trainer._train_step` on in-memory batches (gradient averaging, clipping, the weight check and the
  end-of-step reads included), exact accumulation; `--trainer-run` is this row compiled, one `trainer_step` row
  per step as it ends (the first holds the compile time);
- `sdpa`: which attention kernels ran (profiler kernel names: flash, memory-efficient, cuDNN or math).

Targets: `hn_clip` objective ≤ 1.01 × `infonce` objective in a ViT-L step's time; exact ≤ 1.4 × per-micro-batch at
the same micro size; ViT-L/14, batch 128, exact accumulation + gradient checkpointing within 80 GB; the text tower
on flash attention under bf16. Without CUDA it prints one JSON line saying it did not run, and exits 0.
"""

from __future__ import annotations

import argparse
import gc
import itertools
import json
import logging
import statistics
import tempfile
import time
from dataclasses import dataclass

import torch
import torch._dynamo
from torch._dynamo.utils import counters
from transformers import CLIPConfig, CLIPModel

from sharpclip.config import LossConfig, TermConfig, TrainConfig
from sharpclip.data.schema import Batch
from sharpclip.models.hf import HFDualEncoder, wrap
from sharpclip.train.accumulate import CachedFeatures
from sharpclip.train.features import FeatureEncoder, build_objective
from sharpclip.train.optim import build_optimizer
from sharpclip.train.step import objective_inputs, run_step, split_rows
from sharpclip.train.trainer import Trainer, compile_blocks

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
BACKEND = {"name": "inductor"}  # --check-on-cpu compiles with "eager": the same Dynamo guards, no C++ build
PRECISION = {"name": "bf16"}  # --dry-run: fp32 (a CPU without bf16 units emulates it, several times slower)
ACCUMULATION = {"exact": 32, "per_micro_batch": 16}  # the default grid's micro-batch rows at a batch of 128


@dataclass(frozen=True)
class Setting:
    model: str
    objective: str
    accumulation: str
    attention: str = "sdpa"
    compiled: bool = False
    checkpointing: bool = False
    micro: int = 0  # micro-batch rows at a batch of 128 (0: ACCUMULATION's)
    encode: int = 0  # per_micro_batch: rows per tower pass (train.encode_batch_size)


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


def build_on(device: torch.device, name: str, attention: str = "sdpa") -> HFDualEncoder:
    """The model initialised on `device` itself (no CPU initialisation and copy)."""
    with torch.device(device):
        return build_clip(name, attention).train()


def memory(device: torch.device) -> dict:
    if device.type != "cuda":
        return {}
    return {"peak_allocated_gib": round(torch.cuda.max_memory_allocated(device) / 2**30, 2),
            "peak_reserved_gib": round(torch.cuda.max_memory_reserved(device) / 2**30, 2)}  # fmt: skip


def graphs() -> int:
    return int(counters["stats"]["unique_graphs"])


class DynamoWatch(logging.Handler):
    """Dynamo's "Recompiling function ..." records (logged once `torch._logging.set_logs(recompiles=True)`) and its
    "hit config.recompile_limit" warnings: after a hit the frame runs eagerly for the rest of the process."""

    def __init__(self):
        super().__init__(logging.DEBUG)
        self.recompiles: list[str] = []
        self.limit_hits: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        lines = [line.strip() for line in record.getMessage().strip().splitlines()]
        if lines[0].startswith("Recompiling function"):  # "... function NAME in FILE:LINE", then guard failures
            self.recompiles.append(f"{lines[0].split()[2]}: {lines[-1].lstrip('- ')}"[:200])
        elif "hit config." in lines[0]:
            self.limit_hits.append(lines[0][:200])

    def install(self) -> None:
        torch._logging.set_logs(recompiles=True)
        logging.getLogger("torch._dynamo").addHandler(self)


WATCH = DynamoWatch()  # installed by main(); counts nothing when only imported
COMPILED = {"blocks": 0}  # transformer blocks compiled by the last compiled setting


def compiled_blocks(model: torch.nn.Module) -> int:
    """How many modules of `model` were compiled in place (`Module.compile`): its transformer blocks."""
    return sum(getattr(m, "_compiled_call_impl", None) is not None for m in model.modules())


def compile_health(reasons: bool = True) -> dict:
    """Graphs, graph breaks, recompiles and recompile-limit hits since the last `fresh_dynamo()` (with the first
    three reasons of each when `reasons`)."""
    breaks = counters["graph_break"]
    blocks = COMPILED["blocks"]  # the compile unit is the transformer block (train.compile.compile_blocks)
    out = {"compiled_blocks": blocks, "graphs": graphs(), "graphs_per_block": round(graphs() / max(blocks, 1), 3),
           "graph_breaks": sum(breaks.values()), "recompiles": len(WATCH.recompiles),
           "recompile_limit_hits": len(WATCH.limit_hits)}  # fmt: skip
    if reasons:
        out |= {"graph_break_reasons": [r.strip().splitlines()[0][:160] for r in list(breaks)[:3]],
                "recompile_reasons": WATCH.recompiles[:3], "recompile_limit_reasons": WATCH.limit_hits[:3]}  # fmt: skip
    return out


def fresh_dynamo() -> None:
    torch._dynamo.reset()
    counters.clear()
    WATCH.recompiles.clear()
    WATCH.limit_hits.clear()


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


def _reported(record: dict, run) -> dict:
    """`run()`'s numbers into `record`; a failed setting (OOM, compile) is reported, not fatal to the others."""
    try:
        record.update(run())
    except torch.cuda.OutOfMemoryError:
        record["error"] = "out of memory"
    except Exception as err:
        record["error"] = f"{type(err).__name__}: {str(err).splitlines()[0][:200] if str(err) else ''}"
    return record


class Rig:
    """A model, its encoder, objective and optimiser on the device, ready to step."""

    def __init__(self, setting: Setting, device: torch.device, batch_size: int):
        if setting.compiled:
            fresh_dynamo()
        self.model = build_on(device, setting.model, setting.attention)
        if setting.checkpointing:
            self.model.hf_model.activation_checkpointing_enable({"use_reentrant": False})
        if setting.compiled:
            COMPILED["blocks"] = compile_blocks(self.model, backend=BACKEND["name"])
        self.objective = build_objective(LossConfig(terms=OBJECTIVES[setting.objective]))
        self.encoder = FeatureEncoder(self.model, self.objective.feature_keys, precision=PRECISION["name"])
        self.optimizer = build_optimizer(self.model, 1e-5, 0.1, {})
        self.micro = (setting.micro or ACCUMULATION[setting.accumulation]) * batch_size // 128
        self.encode = setting.encode * batch_size // 128
        self.setting, self.device = setting, device

    def step(self, batch: Batch, objective=None) -> float:
        _sync(self.device)
        start = time.perf_counter()
        self.optimizer.zero_grad(set_to_none=True)
        run_step(self.encoder, objective or self.objective, batch, self.micro, self.setting.accumulation, self.encode)
        self.optimizer.step()
        _sync(self.device)
        return time.perf_counter() - start


def measure(setting: Setting, steps: int, dynamic: bool, device: torch.device, batch_size: int = 128) -> dict:
    batch = random_batch(batch_size, dynamic, pin=device.type == "cuda")
    record = {**setting.__dict__, "batch": batch_size, "text_positions": batch.input_ids.shape[1]}

    def run() -> dict:
        rig = Rig(setting, device, batch_size)
        for _ in range(2):  # warm-up: kernels selected, compiled graphs built, allocator grown
            rig.step(batch)
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        seconds = statistics.median(rig.step(batch) for _ in range(steps))
        out = {"micro_batch": rig.micro, "step_s": round(seconds, 4), "img_per_s": round(batch_size / seconds, 1)}
        return {**out, **memory(device), **(compile_health() if setting.compiled else {})}

    return _reported(record, run)


def _events(device: torch.device):
    if device.type == "cuda":
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        return start, stop, lambda: (torch.cuda.synchronize(device), start.elapsed_time(stop) / 1000)[1]
    clock: dict = {}

    class Wall:
        def __init__(self, key):
            self.key = key

        def record(self):
            clock[self.key] = time.perf_counter()

    return Wall("a"), Wall("b"), lambda: clock["b"] - clock["a"]


def objective_only(model_name: str, device: torch.device, batch_size: int, reps: int = 50) -> dict:
    """Forward + backward of each objective alone on cached (gathered) features of one batch, interleaved."""
    record: dict = {"kind": "objective", "model": model_name, "batch": batch_size, "reps": reps}

    def run() -> dict:
        model = build_on(device, model_name)
        objectives = {name: build_objective(LossConfig(terms=OBJECTIVES[name])) for name in OBJECTIVES}
        keys = set().union(*(o.feature_keys for o in objectives.values()))
        encoder = FeatureEncoder(model, keys, precision=PRECISION["name"])
        batch = encoder.to_device(random_batch(batch_size, False, pin=device.type == "cuda"))
        cache = CachedFeatures(encoder, split_rows(batch, max(1, batch_size // 4)), device)
        times: dict[str, list[float]] = {name: [] for name in objectives}
        start, stop, elapsed = _events(device)
        for rep in range(reps + 2):
            for name, objective in objectives.items():
                leaves = {k: v.detach().requires_grad_(v.requires_grad) for k, v in cache.leaves.items()}
                start.record()
                objective(objective_inputs(encoder, leaves, batch))["loss"].backward()
                stop.record()
                if rep >= 2:
                    times[name].append(elapsed())
        median = {name: statistics.median(t) for name, t in times.items()}
        out = {f"{name}_ms": round(1000 * t, 3) for name, t in median.items()}
        out["hn_clip_over_infonce_objective"] = round(median["hn_clip"] / median["infonce"], 3)
        return out

    return _reported(record, run)


def interleaved(model_name: str, device: torch.device, batch_size: int, steps: int = 20) -> dict:
    """Whole `infonce` and `hn_clip` steps alternated (exact, micro 32), medians of `steps` each."""
    record: dict = {"kind": "interleaved", "model": model_name, "batch": batch_size, "steps": steps}

    def run() -> dict:
        rig = Rig(Setting(model_name, "infonce", "exact"), device, batch_size)
        hn = build_objective(LossConfig(terms=OBJECTIVES["hn_clip"]))
        batch = random_batch(batch_size, False, pin=device.type == "cuda")
        times: dict[str, list[float]] = {"infonce": [], "hn_clip": []}
        for k in range(steps + 2):
            for name, objective in (("infonce", rig.objective), ("hn_clip", hn)):
                t = rig.step(batch, objective)
                if k >= 2:
                    times[name].append(t)
        med = {n: statistics.median(t) for n, t in times.items()}
        return {**{f"{n}_step_s": round(t, 4) for n, t in med.items()},
                "hn_clip_over_infonce_step": round(med["hn_clip"] / med["infonce"], 4)}  # fmt: skip

    return _reported(record, run)


def varying(model_name: str, device: torch.device, batch_size: int, steps: int) -> dict:
    """Compiled towers under changing caption widths and a short last micro-batch: graphs, and steady-state time."""
    record: dict = {"kind": "varying", "model": model_name, "batch": batch_size, "compiled": True}

    def run() -> dict:
        rig = Rig(Setting(model_name, "hn_clip", "exact", compiled=True), device, batch_size)
        batches = [random_batch(batch_size - (k % 3 == 2) * (batch_size // 4 + 2), True, seed=k,
                                pin=device.type == "cuda") for k in range(max(steps, 6))]  # fmt: skip
        first = [rig.step(b) for b in batches[:3]]  # new widths and a short last micro-batch: any recompiles here
        after = graphs()
        timed = [rig.step(b) for b in batches[3:]]
        return {"first_steps_s": [round(t, 3) for t in first], "graphs_after_3": after, **compile_health(),
                "steady_step_s": round(statistics.median(timed), 4),
                "widths": [b.input_ids.shape[1] for b in batches], "rows": [len(b) for b in batches]}  # fmt: skip

    return _reported(record, run)


class MemoryLoader:
    """In-memory batches with the loader contract the trainer uses."""

    def __init__(self, batches: list[Batch]):
        self.batches = batches

    def __len__(self) -> int:
        return len(self.batches)

    def __iter__(self):
        return iter(self.batches)

    def set_epoch(self, epoch: int) -> None:
        pass

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        pass


def trainer_steps(model_name: str, device: torch.device, batch_size: int, steps: int, accumulation: str = "exact",
                  compiled: bool = False, on_step=None) -> dict:  # fmt: skip
    """`Trainer._train_step` (the whole trainer step) on in-memory pinned batches, bf16; `on_step(row)` gets one row
    per step as it ends (its time and, compiled, the compile health so far)."""
    record: dict = {"kind": "trainer", "model": model_name, "batch": batch_size, "accumulation": accumulation,
                    "compiled": compiled, "steps": steps}  # fmt: skip

    def run() -> dict:
        if compiled:
            fresh_dynamo()
        model = build_on(device, model_name)
        if compiled and BACKEND["name"] != "inductor":  # the trainer compiles with inductor; keep the check cheap
            COMPILED["blocks"] = compile_blocks(model, backend=BACKEND["name"])
            compiled_here = True
        else:
            compiled_here = False
        objective = build_objective(LossConfig(terms=OBJECTIVES["hn_clip+filip"]))
        micro = ACCUMULATION[accumulation] * batch_size // 128
        batches = [random_batch(batch_size, True, seed=k, pin=device.type == "cuda") for k in range(4)]
        with tempfile.TemporaryDirectory() as out:
            cfg = TrainConfig(output_dir=out, max_steps=steps + 2, batch_size=batch_size, micro_batch_size=micro,
                              accumulation=accumulation, precision=PRECISION["name"],
                              compile=compiled and not compiled_here,
                              device=str(device),
                              progress=False, eval_every=0, checkpoint_every=0, warmup_steps=1)  # fmt: skip
            trainer = Trainer(model, objective, MemoryLoader(batches), cfg, out, lambda d: None)
            COMPILED["blocks"] = compiled_blocks(model)
            model.train()
            times = []
            for k in range(steps + 2):
                _sync(device)
                start = time.perf_counter()
                trainer._train_step(batches[k % len(batches)])
                _sync(device)
                seconds = time.perf_counter() - start
                if k >= 2:
                    times.append(seconds)
                if on_step is not None:
                    on_step({"kind": "trainer_step", "model": model_name, "step": k + 1, "step_s": round(seconds, 4),
                             **(compile_health(reasons=False) if compiled else {})})  # fmt: skip
                if k == 1 and device.type == "cuda":
                    torch.cuda.reset_peak_memory_stats(device)
            trainer.logger.close()
        seconds = statistics.median(times)
        return {"step_s": round(seconds, 4), "img_per_s": round(batch_size / seconds, 1), **memory(device),
                **(compile_health() if compiled else {})}  # fmt: skip

    return _reported(record, run)


def sdpa_kernels(model_name: str, device: torch.device, batch_size: int) -> dict:
    """The attention kernels one bf16 exact step launches (profiler kernel names)."""
    record: dict = {"kind": "sdpa", "model": model_name}
    if device.type != "cuda":
        return {**record, "skipped": "CPU: no CUDA kernels to name"}

    def run() -> dict:
        rig = Rig(Setting(model_name, "infonce", "exact"), device, batch_size)
        batch = random_batch(batch_size, True, pin=True)
        rig.step(batch)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            rig.step(batch)
        names = {e.key for e in prof.key_averages()}
        found = {kind: sorted(n for n in names if any(w in n.lower() for w in words))[:4]
                 for kind, words in {"flash": ("flash",), "memory_efficient": ("fmha", "efficient"),
                                     "cudnn": ("cudnn",), "math_softmax": ("softmax",)}.items()}  # fmt: skip
        return {"kernels": found}

    return _reported(record, run)


def grid(models: list[str], full: bool) -> list[Setting]:
    """The settings in order of importance (a run cut short loses the last): compiled first, then the rows the
    targets compare (objectives; exact vs per-micro-batch at micro 16 and 32; checkpointing's memory), then the rest."""
    if full:
        combos = itertools.product(models, OBJECTIVES, ACCUMULATION, ("sdpa", "eager"), (False, True))
        return sorted((Setting(*c) for c in combos), key=lambda s: not s.compiled)
    out = []
    for m in models:
        out.append(Setting(m, "infonce", "exact", compiled=True))
        out += [Setting(m, o, a) for o in ("infonce", "hn_clip") for a in ACCUMULATION]
        out += [Setting(m, "hn_clip", "exact", micro=16), Setting(m, "hn_clip", "per_micro_batch", micro=32)]
        if m != "b16":  # L/14: the memory target
            out.append(Setting(m, "infonce", "exact", checkpointing=True))
        out += [Setting(m, "hn_clip+filip", a) for a in ACCUMULATION]
        out += [
            Setting(m, "hn_clip", "per_micro_batch", micro=16, encode=64),
            Setting(m, "infonce", "exact", attention="eager"),
        ]
    return out


def _time(results: list[dict], **match) -> float | None:
    match = {"micro": 0, "encode": 0, **match}
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
        for micro in (16, 32):  # the same micro size: the accumulation mode alone
            exact = _time(results, model=m, objective="hn_clip", accumulation="exact", **base,
                          micro=0 if micro == 32 else micro)  # fmt: skip
            per_micro = _time(results, model=m, objective="hn_clip", accumulation="per_micro_batch", **base,
                              micro=0 if micro == 16 else micro)  # fmt: skip
            if exact and per_micro:
                out[f"{m}/hn_clip/exact_over_per_micro_batch@{micro}"] = round(exact / per_micro, 4)
        encoded = _time(results, model=m, objective="hn_clip", accumulation="per_micro_batch", **base, encode=64)
        per_micro = _time(results, model=m, objective="hn_clip", accumulation="per_micro_batch", **base)
        if encoded and per_micro:
            out[f"{m}/hn_clip/per_micro_encode64_over_per_micro"] = round(encoded / per_micro, 4)
        sdpa = _time(results, model=m, objective="infonce", accumulation="exact", **base)
        eager = _time(results, model=m, objective="infonce", accumulation="exact", **{**base, "attention": "eager"})
        compiled = _time(results, model=m, objective="infonce", accumulation="exact", **{**base, "compiled": True})
        if sdpa and eager:
            out[f"{m}/sdpa_over_eager"] = round(sdpa / eager, 4)
        if sdpa and compiled:
            out[f"{m}/compiled_over_eager_mode"] = round(compiled / sdpa, 4)
    return out


def plan(models: list[str], args: argparse.Namespace, device: torch.device, batch_size: int) -> list:
    """The rows to measure, each a call, in the order they run (most important first: see the module docstring)."""
    cheap = args.check_on_cpu or args.dry_run
    out: list = []
    for m in models:
        out += [
            lambda m=m: objective_only(m, device, batch_size, reps=2 if cheap else 50),
            lambda m=m: interleaved(m, device, batch_size, steps=1 if cheap else 20),
            lambda m=m: sdpa_kernels(m, device, batch_size),
            lambda m=m: varying(m, device, batch_size, args.steps),
        ]
        out += [lambda s=s: measure(s, args.steps, args.dynamic, device, batch_size) for s in grid([m], args.full)]
        out.append(lambda m=m: trainer_steps(m, device, batch_size, args.steps))
    return out


def dry_run_settings() -> None:
    """--dry-run: what --check-on-cpu runs, at fp32, 77 text positions and 64 px on one thread (a CPU emulates bf16,
    and threads fight over a busy machine's cores)."""
    global CONTEXT, IMAGE
    CONTEXT, IMAGE, PRECISION["name"] = 77, 64, "fp32"
    torch.set_num_threads(1)


def emit(record: dict) -> None:
    print(json.dumps(record), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="l14,b16", help="comma-separated: l14, b16 (in this order)")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument(
        "--trainer-run",
        action="store_true",
        help="only: ViT-L through Trainer, bf16, compile on, exact accumulation, --steps steps (a row per step)",
    )
    parser.add_argument("--full", action="store_true", help="every objective × accumulation × attention × compile")
    parser.add_argument("--dynamic", action="store_true", help="pad captions to the batch's longest (multiple of 8)")
    parser.add_argument("--check-on-cpu", action="store_true", help="run the default grid on a tiny CLIP on the CPU")
    parser.add_argument("--dry-run", action="store_true", help="--check-on-cpu at fp32, 77 positions, 64 px")
    parser.add_argument("--max-rows", type=int, default=0, help="stop after this many measured rows (0: all)")
    args = parser.parse_args()
    if args.check_on_cpu or args.dry_run:  # every code path once, quickly: one timed step, eager compile backend
        device, models, batch_size = torch.device("cpu"), ["tiny"], 16
        BACKEND["name"] = "eager"
        args.steps = args.steps if args.trainer_run else 1
        if args.dry_run:
            dry_run_settings()
    elif not torch.cuda.is_available():
        print(json.dumps({"benchmark": "gpu_step", "ran": False, "reason": "no CUDA device (torch.cuda.is_available() "
                          "is False); run it on a GPU machine"}))  # fmt: skip
        return
    else:
        device, models, batch_size = torch.device("cuda", 0), [m for m in args.models.split(",") if m], 128
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = True  # train.tf32's default
    WATCH.install()
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    emit({"benchmark": "gpu_step", "ran": True, "device": name, "torch": torch.__version__,
          "precision": PRECISION["name"], "text_positions": CONTEXT, "image_size": IMAGE})  # fmt: skip
    results = []

    def report(record: dict) -> None:
        results.append(record)
        emit(record)
        gc.collect()  # the previous model and optimizer state, before the next is built
        if device.type == "cuda":
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(device)

    if args.trainer_run:  # exact only: a second accumulation mode costs a second cold compile for little news
        model = models[0] if device.type == "cpu" else "l14"
        report(trainer_steps(model, device, batch_size, args.steps, "exact", compiled=True, on_step=emit))
        return
    for row in plan(models, args, device, batch_size)[: args.max_rows or None]:
        report(row())
        emit({"benchmark": "gpu_step", "ratios": ratios(results, models)})  # after every row: a cut run keeps them


if __name__ == "__main__":
    main()
