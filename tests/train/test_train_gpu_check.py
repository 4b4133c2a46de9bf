"""benchmarks/gpu_check.py always reports: `--dry-run` runs every part on the CPU (tiny CLIP, 2 gloo processes for
the multi-GPU part) and each writes its JSON lines, compile first and a flat summary last; a spent budget skips
parts with the reason; a part past its time is killed with its children and keeps the rows it wrote; SIGTERM keeps
what was written; the 1-vs-W comparison fails on a gradient that differs."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "gpu_check.py"
sys.path.insert(0, str(ROOT / "benchmarks"))

import gpu_check  # noqa: E402  (a script folder, not a package)

ENV = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")])}


def _rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]


def _run(out: Path, *args: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, str(SCRIPT), "--dry-run", "--out", str(out), *args]
    return subprocess.run(cmd, cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=900)


@pytest.mark.slow
def test_a_dry_run_writes_every_part_compile_first_and_a_flat_summary_last(tmp_path):
    out = tmp_path / "check.jsonl"
    proc = _run(out)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = _rows(out)
    assert rows[0]["kind"] == "start" and rows[-1]["part"] == "summary"
    assert json.loads(proc.stdout.strip().splitlines()[-1]) == rows[-1]  # printed last, in full
    parts = [r["part"] for r in rows[1:-1]]
    # 2 GPUs (--dry-run's gloo ranks): the 1-vs-W check first, with at least 40 % of the budget, then the rest in order
    assert list(dict.fromkeys(parts)) == ["multi_gpu", "compile", "gpu_step", "gpu_tests"]
    begin = next(r for r in rows if r["part"] == "multi_gpu" and r.get("kind") == "begin")
    assert begin["timeout_s"] >= gpu_check.MULTI_GPU_FIRST * rows[0]["budget_s"] - 1
    for part in gpu_check.PARTS:
        end = next(r for r in rows if r["part"] == part and r.get("kind") == "end")
        assert end["rc"] == 0 and not end.get("timed_out"), end
    steps = [r for r in rows if r.get("kind") == "trainer_step"]
    assert [r["step"] for r in steps] == [1, 2, 3, 4]
    for r in steps:  # compile health on every step: eager-backend graphs of the blocks (2 a tower), no limit hit
        assert r["compiled_blocks"] == 4 and r["graphs"] >= 2 and r["recompile_limit_hits"] == 0
        assert r["graph_breaks"] >= 0
    kinds = [r.get("kind") for r in rows if r["part"] == "gpu_step"]
    assert {"objective", "interleaved", "sdpa"} <= set(kinds)
    assert any("ratios" in r for r in rows if r["part"] == "gpu_step")
    assert any(r.get("outcome") == "SKIPPED" for r in rows if r["part"] == "gpu_tests")  # no CUDA here
    equality = next(r for r in rows if r.get("kind") == "equality")
    assert equality["equal"] and equality["worlds"] == [1, 2] and equality["steps"] == 2
    assert equality["loss_rel_diff"] < 1e-4 and equality["grad_digest_rel_diff"] < 1e-3
    speeds = {(r["world"], r["layout"]) for r in rows if r.get("kind") == "speed"}
    assert speeds == {(1, "replicate"), (2, "replicate"), (2, "hybrid"), (2, "shard")}  # img/s per GPU, each layout
    assert not any("grad_dots" in r for r in rows)  # the digest is compared, not written
    summary = rows[-1]
    assert all(not isinstance(v, dict) for v in summary.values())  # flat
    assert summary["compile.status"] == summary["multi_gpu.status"] == "ok" and summary["multi_gpu.equal"] is True
    assert summary["compile.recompile_limit_hits"] == 0 and summary["gpu_step.rows"] == 3
    assert {"multi_gpu.img_per_s_per_gpu@2/replicate", "multi_gpu.img_per_s_per_gpu@2/shard"} <= set(summary)
    assert summary["multi_gpu.faster_layout@2"] in ("hybrid", "replicate")  # the layout question, measured
    assert summary["multi_gpu.hybrid_over_replicate_img_per_s@2"] > 0


def test_a_spent_budget_skips_every_part_with_its_reason(tmp_path):
    out = tmp_path / "check.jsonl"
    out.write_text('{"part": "earlier run"}\n')  # appended to, never truncated
    proc = _run(out, "--budget-s", "0")
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = _rows(out)
    assert rows[0] == {"part": "earlier run"} and rows[1]["kind"] == "start"
    skipped = [r for r in rows if r.get("kind") == "skipped"]
    assert [r["part"] for r in skipped] == ["multi_gpu", "compile", "gpu_step", "gpu_tests"]
    assert all(r["reason"].startswith("budget spent") for r in skipped)
    assert all(rows[-1][f"{p}.status"].startswith("skipped (budget spent") for p in gpu_check.PARTS)


@pytest.mark.skipif(torch.cuda.is_available(), reason="with CUDA the check would run for real")
def test_without_cuda_it_records_that_it_did_not_run(tmp_path):
    out = tmp_path / "check.jsonl"
    cmd = [sys.executable, str(SCRIPT), "--out", str(out)]
    proc = subprocess.run(cmd, cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = _rows(out)
    assert [r["part"] for r in rows] == ["start", "summary"]
    assert rows[-1]["ran"] is False and "no CUDA device" in rows[-1]["reason"]


def test_a_part_past_its_time_is_killed_with_its_children_and_keeps_its_rows(tmp_path):
    out = tmp_path / "check.jsonl"
    check = gpu_check.Check(out, budget_s=60, dry_run=True, gpus=2)
    pid_file = tmp_path / "grandchild.pid"
    child = (
        "import json, subprocess, sys, time\n"
        f"p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)'])\n"
        f"open({str(pid_file)!r}, 'w').write(str(p.pid))\n"
        "print(json.dumps({'kind': 'measured', 'value': 1}), flush=True)\n"
        "print('not json', flush=True)\n"
        "time.sleep(120)\n"
    )
    rows, status = check.launch("demo", [sys.executable, "-c", child], 8.0, gpu_check.json_row)
    assert rows == [{"kind": "measured", "value": 1}]
    assert status["timed_out"] and status["rc"] == -signal.SIGKILL
    written = _rows(out)
    assert [(r["part"], r["kind"], r["value"]) for r in written] == [("demo", "measured", 1)]
    grandchild = int(pid_file.read_text())
    for _ in range(50):  # killed with the group; reaped by init shortly after
        if not _alive(grandchild):
            break
        time.sleep(0.1)
    assert not _alive(grandchild)


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().split()[2]
    except FileNotFoundError:
        return False
    return state != "Z"


@pytest.mark.slow
def test_sigterm_stops_the_running_part_and_keeps_what_it_wrote(tmp_path):
    out = tmp_path / "check.jsonl"
    cmd = [sys.executable, str(SCRIPT), "--dry-run", "--out", str(out), "--parts", "gpu_step,gpu_tests"]
    proc = subprocess.Popen(cmd, cwd=ROOT, env=ENV, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline and proc.poll() is None:
            if out.is_file() and any(r.get("kind") == "objective" for r in _rows(out)):
                break
            time.sleep(0.5)
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=120)
    finally:
        proc.kill()
    assert proc.returncode == 128 + signal.SIGTERM, proc.stderr.read()[-3000:]
    rows = _rows(out)
    assert any(r.get("kind") == "objective" for r in rows)  # measured before the signal: kept
    assert rows[-2] == {**rows[-2], "part": "gpu_step", "kind": "interrupted", "signal": "SIGTERM"}
    assert rows[-1]["part"] == "summary" and rows[-1]["gpu_step.status"] == "interrupted (SIGTERM)"
    assert "gpu_tests.status" not in rows[-1]


def _check_rows(losses: list[float], norms: list[float]) -> list[dict]:
    pairs = enumerate(zip(losses, norms, strict=True))
    return [{"kind": "check_step", "step": k + 1, "loss": loss, "grad_norm": n} for k, (loss, n) in pairs]


def test_the_one_vs_w_comparison_fails_on_a_gradient_that_differs():
    one = (_check_rows([2.0, 1.5], [3.0, 2.0]), [1.0, -2.0, 0.5, 4.0])
    same = gpu_check.equality(one, (_check_rows([2.0, 1.5], [3.0, 2.0]), [1.0, -2.0, 0.5, 4.0]), 2)
    assert same["equal"] and same["loss_rel_diff"] == same["grad_digest_rel_diff"] == 0.0
    off = gpu_check.equality(one, (_check_rows([2.0, 1.5], [3.0, 2.0]), [1.0, -2.0, 0.5, 4.1]), 2)
    assert not off["equal"] and off["grad_digest_rel_diff"] == pytest.approx(0.1 / (1 + 4 + 0.25 + 16) ** 0.5)
    loss = gpu_check.equality(one, (_check_rows([2.0, 1.51], [3.0, 2.0]), one[1]), 2)
    assert not loss["equal"] and loss["loss_rel_diff"] == pytest.approx(0.01 / 1.5)
    cut = gpu_check.equality(one, ([], []), 2)
    assert cut == {"kind": "equality", "worlds": [1, 2], "steps": 0, "equal": False,
                   "reason": "a run ended before its check steps"}  # fmt: skip


def test_pytest_lines_become_rows():
    row = gpu_check.pytest_row
    assert row("tests/a.py::t_x[cpu-1] PASSED  [ 50%]\n") == {"test": "tests/a.py::t_x[cpu-1]", "outcome": "PASSED"}
    assert row("tests/a.py::test_y FAILED [100%]") == {"test": "tests/a.py::test_y", "outcome": "FAILED"}
    assert row("==== 1 failed, 2 passed in 3.1s ====\n") == {"pytest_summary": "1 failed, 2 passed in 3.1s"}
    assert row("collecting ... collected 7 items / 6 deselected / 1 selected") is None
