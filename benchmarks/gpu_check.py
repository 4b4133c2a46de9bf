"""The first thing to run on a GPU machine: compile health, the step benchmark, the GPU tests and the multi-GPU
equality check, every result appended to one JSON-lines file the moment it is measured.

    python benchmarks/gpu_check.py --out gpu_check.jsonl [--budget-s 480]
    python benchmarks/gpu_check.py --dry-run --out dry.jsonl     (every part on the CPU, tiny and cheap: a test run)

Parts, in this order, each in its own process; every JSON line a part prints is appended to `--out` at once, with
`part` and `t_s` (seconds since the start) added, so a run cut short keeps all it measured:

1. `compile`: ViT-L/14 through `Trainer` at bf16, every transformer block compiled (Inductor), exact accumulation,
   20 steps over four caption widths (`gpu_step.py --trainer-run`): one row per step as it ends (the first holds the
   compile time) with the blocks compiled, graphs (and per block), graph breaks, recompiles and recompile-limit hits;
2. `gpu_step`: `gpu_step.py --models l14 --steps 5`: the objectives alone, interleaved whole steps, attention
   kernels, the compiled rows, the grid; its `ratios` after every row (a line only when they changed);
3. `gpu_tests`: `pytest -m gpu` over the test files that mark tests `gpu` (every CUDA-only test; with 2 GPUs or
   more the NCCL equality test among them), a row per test as it ends;
4. `multi_gpu` (2 GPUs or more): `gpu_ranks.py` on one process and under torchrun on 2 GPUs (and on all of them
   when more, if they divide the batch of 128): losses, gradient norms and gradient digests of 1 GPU against W
   GPUs (an `equality` row), img/s in all and per GPU for each count and layout (`speed` rows).

With 2 GPUs or more `multi_gpu` runs first, with at least 40 % of the budget: 1 GPU = W GPUs on the engine is the
row a multi-GPU machine exists to give, and the cold compile can wait.

`--budget-s` (default 480) bounds the whole run: each part may use its share (30/35/20/15 %) of the time left
over the parts still to run (time a part leaves unused goes to the later ones), enforced as its process's timeout;
a part that runs over is killed (`timed_out` in its `end` row), and a part whose share is under 20 s is recorded
as skipped, with the reason. SIGTERM or Ctrl-C stops the running part the same way. The last line of the file (and
of stdout) is a flat summary. The file is appended to, never truncated: one run starts at its `start` row. The
Inductor cache is kept in the working tree (`.cache/inductor`), so a rerun on the same machine reuses compiled
kernels. Without CUDA (and without `--dry-run`) it records that it did not run and exits 0.

`--dry-run` runs every part on the CPU with a tiny CLIP: `compile` with Dynamo's eager backend at fp32, `gpu_step`
for 3 rows, `gpu_tests` on one file (its tests skip without CUDA), `multi_gpu` on 1 and 2 gloo processes.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import queue
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from importlib.metadata import version
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PARTS = {"compile": 0.30, "gpu_step": 0.35, "gpu_tests": 0.20, "multi_gpu": 0.15}  # shares of the time left
MULTI_GPU_FIRST = 0.40  # on 2 GPUs or more multi_gpu runs first, with at least this share of the budget
MIN_PART_S = {False: 20.0, True: 1.0}  # below this share a part is skipped (by --dry-run)
TOLERANCE = {"loss": 1e-4, "grad": 1e-3}  # 1 GPU vs W at fp32, TF32 off: sums in another order, nothing more
PYTEST_ROW = ("PASSED", "FAILED", "ERROR", "SKIPPED", "XFAIL", "XPASS")


class Interrupted(Exception):
    """SIGTERM / SIGINT while a part runs."""


class Check:
    """The run's state: the output file, the time budget and the running child process."""

    def __init__(self, out: Path, budget_s: float, dry_run: bool, gpus: int):
        self.out, self.budget_s, self.dry_run, self.gpus = out, budget_s, dry_run, gpus
        self.start = time.perf_counter()
        self.child: subprocess.Popen | None = None
        cache = ROOT / ".cache" / "inductor"
        cache.mkdir(parents=True, exist_ok=True)
        path = os.pathsep.join(p for p in (str(ROOT / "src"), os.environ.get("PYTHONPATH", "")) if p)
        self.env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(cache), "PYTHONPATH": path,
                    "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1"}  # fmt: skip
        if dry_run:  # one thread per process: several processes share a few CPU cores
            self.env["OMP_NUM_THREADS"] = "1"

    def elapsed(self) -> float:
        return time.perf_counter() - self.start

    def write(self, part: str, row: dict, full: bool = False) -> None:
        """Append one row, on disk before anything else runs; echo it to stdout (shortened unless `full`)."""
        line = json.dumps({"part": part, "t_s": round(self.elapsed(), 1), **row})
        with self.out.open("a", encoding="utf-8") as f:
            f.write(line + "\n")
            f.flush()
            os.fsync(f.fileno())
        print(line if full or len(line) <= 300 else line[:297] + "...", flush=True)

    def launch(
        self, part: str, cmd: list[str], timeout: float, parse: Callable[[str], dict | None]
    ) -> tuple[list[dict], dict]:
        """Run `cmd`, writing each row `parse` makes of a stdout line as it comes; killed (with its children)
        after `timeout` s. Returns (every parsed row, the process's status)."""
        start = time.perf_counter()
        with tempfile.TemporaryFile() as err:
            self.child = subprocess.Popen(cmd, cwd=ROOT, env=self.env, stdout=subprocess.PIPE, stderr=err, text=True,
                                          start_new_session=True)  # fmt: skip
            rows, timed_out = _stream(self.child, start + timeout, parse, lambda row: self.write(part, row))
            self.child.wait()
            err.seek(0)
            stderr = err.read().decode(errors="replace")
        status = {"rc": self.child.returncode, "seconds": round(time.perf_counter() - start, 1)}
        self.child = None
        if timed_out:
            status["timed_out"] = True
        if timed_out or status["rc"]:
            status["stderr_tail"] = stderr[-1500:]
        return rows, status

    def stop_child(self) -> None:
        if self.child is not None and self.child.poll() is None:
            os.killpg(self.child.pid, signal.SIGKILL)  # its own process group: torchrun's workers and pytest's go too


def _stream(proc: subprocess.Popen, deadline: float, parse, write) -> tuple[list[dict], bool]:
    """Rows from `proc`'s stdout as they come, until it exits (a child it left holding stdout does not count) or
    `deadline` passes (then its process group is killed). Returns (rows, whether the deadline ended it)."""
    lines: queue.Queue = queue.Queue()

    def pump() -> None:
        for line in proc.stdout:
            lines.put(line)
        lines.put(None)

    threading.Thread(target=pump, daemon=True).start()
    rows: list[dict] = []
    while True:
        try:
            line = lines.get(timeout=0.5)
        except queue.Empty:
            line = ""  # nothing for half a second: has it exited, or run out of time?
            if proc.poll() is not None:
                return rows, False
        if line and (row := parse(line)) is not None:
            rows.append(row)
            write(row)
        if time.perf_counter() >= deadline:
            os.killpg(proc.pid, signal.SIGKILL)
            return rows, True


def json_row(line: str) -> dict | None:
    line = line.strip()
    if not line.startswith("{"):
        return None
    try:
        return json.loads(line)
    except json.JSONDecodeError:
        return None


def pytest_row(line: str) -> dict | None:
    """`pytest -v`'s "tests/x.py::name OUTCOME [ 10%]" lines and its closing "== 3 passed in 2s ==" line."""
    words = line.split()
    if len(words) >= 2 and "::" in words[0] and words[1] in PYTEST_ROW:
        return {"test": words[0], "outcome": words[1]}
    if line.startswith("=") and (" passed" in line or " failed" in line or " skipped" in line or " error" in line):
        return {"pytest_summary": line.strip("= \n")}
    return None


# -- the parts -------------------------------------------------------------------------------------------------------
def python(script: str, *args: str) -> list[str]:
    return [sys.executable, f"benchmarks/{script}", *args]


def run_compile(check: Check, timeout: float) -> tuple[list[dict], dict]:
    args = ("--dry-run", "--steps", "2") if check.dry_run else ("--steps", "20")
    return check.launch("compile", python("gpu_step.py", "--trainer-run", *args), timeout, json_row)


def run_gpu_step(check: Check, timeout: float) -> tuple[list[dict], dict]:
    args = ("--dry-run", "--max-rows", "3") if check.dry_run else ("--models", "l14", "--steps", "5")
    last: dict = {}

    def parse(line: str) -> dict | None:  # a `ratios` line only when the ratios changed
        row = json_row(line)
        if row is not None and "ratios" in row:
            if row["ratios"] == last.get("ratios"):
                return None
            last["ratios"] = row["ratios"]
        return row

    return check.launch("gpu_step", python("gpu_step.py", *args), timeout, parse)


def gpu_test_files() -> list[str]:
    """The test files that mark tests `gpu` (collecting only these saves collecting the whole suite)."""
    files = sorted(p for p in (ROOT / "tests").rglob("test_*.py") if "mark.gpu" in p.read_text(encoding="utf-8"))
    return [str(p.relative_to(ROOT)) for p in files]


def run_gpu_tests(check: Check, timeout: float) -> tuple[list[dict], dict]:
    where = ["tests/data/test_data_gpu_feed.py"] if check.dry_run else gpu_test_files()
    cmd = [sys.executable, "-m", "pytest", "-m", "gpu", "-v", "-p", "no:cacheprovider", *where]
    return check.launch("gpu_tests", cmd, timeout, pytest_row)


def run_multi_gpu(check: Check, timeout: float) -> tuple[list[dict], dict]:
    """gpu_ranks.py on 1 process, then on W = 2 (and all GPUs) under torchrun; an `equality` row per W > 1."""
    deadline = time.perf_counter() + timeout
    worlds = sorted({w for w in (1, 2, check.gpus) if 128 % w == 0})
    args = ("--dry-run", "--steps", "2") if check.dry_run else ("--steps", "10")
    runs: dict[int, tuple[list[dict], list[float]]] = {}
    statuses, out = [], []
    for i, world in enumerate(worlds):
        share = (deadline - time.perf_counter()) / (len(worlds) - i)
        launcher = [] if world == 1 else ["-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(world)]
        digest: list[float] = []

        def parse(line: str, digest: list[float] = digest) -> dict | None:  # the digest (2 numbers per tensor) stays
            row = json_row(line)  # in memory for the comparison; the rest is written
            if row is not None and "grad_dots" in row:
                digest += row.pop("grad_norms") + row.pop("grad_dots")
            return row

        rows, status = check.launch("multi_gpu", [sys.executable, *launcher, "benchmarks/gpu_ranks.py", *args], share,
                                    parse)  # fmt: skip
        runs[world], out = (rows, digest), out + rows
        statuses.append(status)
        if world > 1:
            out.append(equality(runs[1], runs[world], world))
            check.write("multi_gpu", out[-1])
    failed = [s for s in statuses if s["rc"] or s.get("timed_out")]
    return out, {**(failed[0] if failed else statuses[-1]), "seconds": round(sum(s["seconds"] for s in statuses), 1)}


def _relative(a: list[float], b: list[float]) -> float:
    """‖a − b‖ / ‖a‖ (inf when the lengths differ or a value is missing)."""
    if len(a) != len(b) or any(x is None for x in (*a, *b)):
        return math.inf
    norm = math.sqrt(sum(x * x for x in a)) or 1.0
    return math.sqrt(sum((x - y) ** 2 for x, y in zip(a, b, strict=True))) / norm


def equality(one: tuple[list[dict], list[float]], many: tuple[list[dict], list[float]], world: int) -> dict:
    """The fp32 `check` steps of 1 process against `world` (rows, gradient digest each): losses, gradient norms and
    the step-1 gradient digest, as relative differences."""
    steps = [[r for r in rows if r.get("kind") == "check_step"] for rows, _ in (one, many)]
    row: dict = {"kind": "equality", "worlds": [1, world], "steps": min(len(s) for s in steps)}
    if not row["steps"] or not one[1] or not many[1]:
        return {**row, "equal": False, "reason": "a run ended before its check steps"}
    pairs = list(zip(*steps, strict=False))
    row["loss_rel_diff"] = max(_relative([a["loss"]], [b["loss"]]) for a, b in pairs)
    row["grad_norm_rel_diff"] = max(_relative([a["grad_norm"]], [b["grad_norm"]]) for a, b in pairs)
    row["grad_digest_rel_diff"] = _relative(one[1], many[1])
    grads = max(row["grad_norm_rel_diff"], row["grad_digest_rel_diff"])
    row["equal"] = row["loss_rel_diff"] <= TOLERANCE["loss"] and grads <= TOLERANCE["grad"]
    return {**row, "tolerance": TOLERANCE}


RUNS = {"compile": run_compile, "gpu_step": run_gpu_step, "gpu_tests": run_gpu_tests, "multi_gpu": run_multi_gpu}


# -- the summary -----------------------------------------------------------------------------------------------------
def _picked(row: dict, keys: tuple[str, ...]) -> dict:
    return {k: row[k] for k in keys if k in row}


def sum_compile(rows: list[dict]) -> dict:
    steps = [r for r in rows if r.get("kind") == "trainer_step"]
    last = next((r for r in rows if r.get("kind") == "trainer"), steps[-1] if steps else {})
    keys = ("img_per_s", "step_s", "peak_allocated_gib", "peak_reserved_gib", "graphs", "graph_breaks", "recompiles",
            "recompile_limit_hits", "error")  # fmt: skip
    return {"steps_done": len(steps), **({"first_step_s": steps[0]["step_s"]} if steps else {}), **_picked(last, keys)}


def sum_gpu_step(rows: list[dict]) -> dict:
    measured = [r for r in rows if "benchmark" not in r]
    out: dict = {"rows": len(measured), "errors": sum("error" in r for r in measured)}
    for r in measured:
        kind = r.get("kind")
        if kind == "objective":
            out |= _picked(r, ("hn_clip_over_infonce_objective",))
        elif kind == "interleaved":
            out |= _picked(r, ("hn_clip_over_infonce_step",))
        elif kind == "sdpa" and "kernels" in r:
            out["attention_kernels"] = sorted(k for k, names in r["kernels"].items() if names)
        elif kind == "varying":
            out |= {f"varying_{k}": v for k, v in _picked(r, ("graphs", "recompile_limit_hits")).items()}
        elif r.get("checkpointing") and "peak_allocated_gib" in r:
            out[f"{r['model']}_checkpointing_peak_allocated_gib"] = r["peak_allocated_gib"]
    ratios = next((r["ratios"] for r in reversed(rows) if "ratios" in r), {})
    return out | {f"ratio.{k}": v for k, v in ratios.items()}


def sum_gpu_tests(rows: list[dict]) -> dict:
    outcomes = [r["outcome"] for r in rows if "outcome" in r]
    out = {o.lower(): outcomes.count(o) for o in PYTEST_ROW if o in outcomes}
    failed = [r["test"] for r in rows if r.get("outcome") in ("FAILED", "ERROR")]
    final = next((r["pytest_summary"] for r in rows if "pytest_summary" in r), None)
    return out | ({"not_passed": failed[:5]} if failed else {}) | ({"pytest": final} if final else {})


def sum_multi_gpu(rows: list[dict]) -> dict:
    checks = [r for r in rows if r.get("kind") == "equality"]
    out: dict = {"equal": bool(checks) and all(r["equal"] for r in checks)}
    for r in checks:
        out |= {f"{k}@{r['worlds'][1]}": r[k] for k in ("loss_rel_diff", "grad_digest_rel_diff") if k in r}
    speeds = {(r["world"], r["layout"]): r for r in rows if r.get("kind") == "speed"}
    for (world, layout), r in speeds.items():
        out[f"img_per_s_per_gpu@{world}{f'/{layout}' if world > 1 else ''}"] = r["img_per_s_per_gpu"]
    return out | layout_choice(speeds)


def layout_choice(speeds: dict[tuple[int, str], dict]) -> dict:
    """`hybrid` against `replicate` on the most GPUs measured (docs/gpus.md's open question): img/s and peak memory
    as ratios, and the faster of the two."""
    worlds = [w for w, layout in speeds if layout == "hybrid" and (w, "replicate") in speeds]
    if not worlds:
        return {}
    world = max(worlds)
    hybrid, replicate = speeds[world, "hybrid"], speeds[world, "replicate"]
    out = {
        f"hybrid_over_replicate_img_per_s@{world}": round(hybrid["img_per_s"] / replicate["img_per_s"], 3),
        f"faster_layout@{world}": "hybrid" if hybrid["img_per_s"] > replicate["img_per_s"] else "replicate",
    }
    if replicate.get("peak_allocated_gib"):
        ratio = hybrid.get("peak_allocated_gib", 0) / replicate["peak_allocated_gib"]
        out[f"hybrid_over_replicate_peak_memory@{world}"] = round(ratio, 3)
    return out


SUMMARIES = {"compile": sum_compile, "gpu_step": sum_gpu_step, "gpu_tests": sum_gpu_tests, "multi_gpu": sum_multi_gpu}


def status_text(status: dict) -> str:
    if status.get("timed_out"):
        return f"timed out after {status['seconds']} s"
    return "ok" if status.get("rc") == 0 else f"exit code {status.get('rc')}"


# -- the run ---------------------------------------------------------------------------------------------------------
def run_parts(check: Check, parts: list[str], summary: dict) -> None:
    """Each part in turn within its share of the time left; rows and summary entries as they come."""
    for i, part in enumerate(parts):
        left = check.budget_s - check.elapsed()
        share = left * PARTS[part] / sum(PARTS[p] for p in parts[i:])
        if part == "multi_gpu" and i == 0:
            share = max(share, left * MULTI_GPU_FIRST)
        if share < MIN_PART_S[check.dry_run]:
            left, share = max(left, 0.0), max(share, 0.0)
            reason = f"budget spent: {left:.0f} s of {check.budget_s:.0f} s left, a share of {share:.0f} s"
            check.write(part, {"kind": "skipped", "reason": reason})
            summary[f"{part}.status"] = f"skipped ({reason})"
            continue
        check.write(part, {"kind": "begin", "timeout_s": round(share, 1)})
        summary[f"{part}.status"] = "running"
        rows, status = RUNS[part](check, share)
        check.write(part, {"kind": "end", **status})
        summary[f"{part}.status"] = status_text(status)
        summary |= {f"{part}.{k}": v for k, v in SUMMARIES[part](rows).items()}


def _machine() -> dict:
    """The GPUs here (torch is imported only for this: --dry-run and the tests of this script skip it)."""
    import torch

    if not torch.cuda.is_available():
        return {"device": "cpu", "gpus": 0, "cuda": torch.version.cuda}
    return {"device": torch.cuda.get_device_name(0), "gpus": torch.cuda.device_count(), "cuda": torch.version.cuda}


def _interrupt(signum: int, frame) -> None:
    raise Interrupted(signal.Signals(signum).name)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=ROOT / "runs" / "gpu_check.jsonl", help="JSON-lines file, appended")
    parser.add_argument("--budget-s", type=float, default=480.0, help="wall-clock budget of all parts together")
    parser.add_argument("--dry-run", action="store_true", help="every part on the CPU, tiny and cheap")
    parser.add_argument("--parts", default=",".join(PARTS), help=f"comma-separated, of: {', '.join(PARTS)}")
    args = parser.parse_args()
    machine = {"device": "cpu", "gpus": 2, "cuda": None} if args.dry_run else _machine()  # --dry-run: 2 gloo ranks
    args.out.parent.mkdir(parents=True, exist_ok=True)
    check = Check(args.out, args.budget_s, args.dry_run, machine["gpus"])
    summary: dict = {"device": machine["device"], "gpus": machine["gpus"], "dry_run": args.dry_run}
    summary["out"] = str(args.out)
    check.write("start", {"kind": "start", **summary, "torch": version("torch"), "cuda": machine["cuda"],
                          "budget_s": args.budget_s, "argv": sys.argv[1:]})  # fmt: skip
    parts = [p for p in PARTS if p in args.parts.split(",")]
    code = 0
    if not machine["gpus"] and not args.dry_run:
        summary["ran"] = False
        summary["reason"] = "no CUDA device (torch.cuda.is_available() is False); run it on a GPU machine"
        parts = []
    if "multi_gpu" in parts and machine["gpus"] < 2:
        reason = f"{machine['gpus']} GPU: NCCL needs one GPU per rank"
        check.write("multi_gpu", {"kind": "skipped", "reason": reason})
        summary["multi_gpu.status"] = "skipped (1 GPU)"
        parts.remove("multi_gpu")
    if "multi_gpu" in parts:  # 2 GPUs or more: the 1-vs-W check first
        parts.insert(0, parts.pop(parts.index("multi_gpu")))
    signal.signal(signal.SIGTERM, _interrupt)
    signal.signal(signal.SIGINT, _interrupt)
    try:
        run_parts(check, parts, summary)
    except Interrupted as sig:
        check.stop_child()
        running = next((k.split(".")[0] for k, v in summary.items() if v == "running"), "start")
        check.write(running, {"kind": "interrupted", "signal": str(sig)})
        summary[f"{running}.status"] = f"interrupted ({sig})"
        code = 128 + signal.Signals[str(sig)].value
    summary["seconds"] = round(check.elapsed(), 1)
    check.write("summary", summary, full=True)
    sys.exit(code)


if __name__ == "__main__":
    main()
