"""The first thing to run on a GPU machine: the GPU tests, the step's host syncs, the step benchmark and a ViT-L
training run, summarised as one JSON object. About 10 minutes on one H100/H200, no network needed.

    python benchmarks/gpu_check.py [--budget-s 570]

1. `pytest -m gpu -q` (every CUDA-only test, the sync check under `torch.cuda.set_sync_debug_mode` among them);
2. `benchmarks/gpu_step.py --models l14 --steps 5` (objective-only and whole-step timings, memory, SDPA kernels,
   graph counts of compiled settings);
3. `benchmarks/gpu_step.py --trainer-run --steps 20`: ViT-L/14 through `Trainer` at bf16, compile on, exact and
   per-micro-batch accumulation, with `TORCH_LOGS=recompiles` (the recompiles are counted from its log).

Each part runs in its own process with a share of `--budget-s`; a part that runs out of time is reported as such
and the others still run. The Inductor cache is kept inside the working tree (`.cache/inductor`), so a rerun on
the same machine reuses the compiled kernels. Without CUDA it prints one JSON line saying so and exits 0.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
SHARES = {"gpu_tests": 0.25, "gpu_step": 0.45, "trainer_run": 0.30}  # of the time budget


def _run(cmd: list[str], timeout: float, env: dict) -> dict:
    start = time.perf_counter()
    try:
        out = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout, check=False)
        return {"rc": out.returncode, "seconds": round(time.perf_counter() - start, 1), "stdout": out.stdout,
                "stderr": out.stderr}  # fmt: skip
    except subprocess.TimeoutExpired as err:
        text = lambda b: b.decode(errors="replace") if isinstance(b, bytes) else (b or "")  # noqa: E731
        return {"rc": None, "timed_out": True, "seconds": round(timeout, 1), "stdout": text(err.stdout),
                "stderr": text(err.stderr)}  # fmt: skip


def _json_lines(text: str) -> list[dict]:
    rows = []
    for line in text.splitlines():
        line = line.strip()
        if line.startswith("{"):
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError:
                continue
    return rows


def gpu_tests(timeout: float, env: dict) -> dict:
    res = _run([sys.executable, "-m", "pytest", "-m", "gpu", "-q", "-p", "no:cacheprovider", "tests"], timeout, env)
    tail = res["stdout"].strip().splitlines()[-1:] or [""]
    failed = [line for line in res["stdout"].splitlines() if line.startswith(("FAILED", "ERROR"))]
    return {"rc": res["rc"], "seconds": res["seconds"], "summary": tail[0], "failed": failed[:20],
            **({"timed_out": True} if res.get("timed_out") else {})}  # fmt: skip


def gpu_step(timeout: float, env: dict) -> dict:
    res = _run([sys.executable, "benchmarks/gpu_step.py", "--models", "l14", "--steps", "5"], timeout, env)
    rows = _json_lines(res["stdout"])
    ratios = next((r["ratios"] for r in rows if "ratios" in r), None)
    return {"rc": res["rc"], "seconds": res["seconds"], "rows": [r for r in rows if "ratios" not in r],
            "ratios": ratios, **({"timed_out": True} if res.get("timed_out") else {}),
            **({"stderr_tail": res["stderr"][-2000:]} if res["rc"] else {})}  # fmt: skip


def trainer_run(timeout: float, env: dict) -> dict:
    env = {**env, "TORCH_LOGS": "recompiles"}
    res = _run([sys.executable, "benchmarks/gpu_step.py", "--trainer-run", "--steps", "20"], timeout, env)
    recompiles = [line for line in res["stderr"].splitlines() if "Recompiling function" in line]
    return {"rc": res["rc"], "seconds": res["seconds"], "rows": _json_lines(res["stdout"]),
            "recompiles": len(recompiles), "recompile_reasons": recompiles[:10],
            **({"timed_out": True} if res.get("timed_out") else {}),
            **({"stderr_tail": res["stderr"][-2000:]} if res["rc"] else {})}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--budget-s", type=float, default=570.0, help="total wall-clock budget of the three parts")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print(json.dumps({"check": "gpu_check", "ran": False, "reason": "no CUDA device (torch.cuda.is_available() "
                          "is False); run it on a GPU machine"}))  # fmt: skip
        return
    cache = ROOT / ".cache" / "inductor"
    cache.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(cache), "PYTHONPATH": str(ROOT / "src"),
           "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1"}  # fmt: skip
    summary: dict = {"check": "gpu_check", "ran": True, "device": torch.cuda.get_device_name(0),
                     "torch": torch.__version__, "cuda": torch.version.cuda}  # fmt: skip
    start = time.perf_counter()
    for name, part in (("gpu_tests", gpu_tests), ("gpu_step", gpu_step), ("trainer_run", trainer_run)):
        left = args.budget_s - (time.perf_counter() - start)
        summary[name] = part(max(30.0, min(left, SHARES[name] * args.budget_s)), env)
    summary["seconds"] = round(time.perf_counter() - start, 1)
    print(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
