"""The open_clip-interface losses on 2 and 4 gloo ranks (fp64): at γ = 0 open_clip's ClipLoss and SigLipLoss (every
combination of local_loss and gather_with_grad; SigLIP's bidirectional and one-way neighbour exchange and its
gathers), at γ > 0 the margin of local rows against the gathered texts, and one process over the whole batch."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from itertools import product
from pathlib import Path

import pytest

WORKER = Path(__file__).with_name("drop_in_worker.py")
COMBOS = [f"ll{a}-gg{b}" for a, b in product([0, 1], [0, 1])]
CHECKS = (
    [f"clip/{c}/{what}" for c in COMBOS for what in ("gamma0", "margin", "open_clip_with_margin")]
    + [f"clip/one_process/ll{a}-ref{b}" for a, b in product([0, 1], [0, 1])]
    + [f"siglip/{impl}/gamma{g}" for impl in ("bidir", "shift", "gather", "reduce") for g in ("0", "0.5")]
    + ["siglip/bidir/frozen_reference", "edit/gg0", "edit/gg1"]
)


EXCHANGE = "collectives/exchange_both"  # needs 3 ranks or more: with 2, left is right
CASES = [(2, c) for c in CHECKS] + [(4, c) for c in [*CHECKS, EXCHANGE]]


@pytest.fixture(scope="module")
def launch(tmp_path_factory):
    """{world: {check: largest difference}}, each world size launched once, when a test first needs it."""
    runs: dict[int, dict[str, float]] = {}

    def differences(world: int) -> dict[str, float]:
        if world not in runs:
            runs[world] = _run(world, tmp_path_factory.mktemp(f"drop-in-{world}") / "differences.json")
        return runs[world]

    return differences


def _run(world: int, out: Path) -> dict[str, float]:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(world), str(WORKER)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([*cmd, str(out)], capture_output=True, text=True, env=env, timeout=240)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(out.read_text())


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 4])
def test_every_check_ran(launch, world):
    assert set(launch(world)) == {c for w, c in CASES if w == world}


@pytest.mark.slow
@pytest.mark.parametrize(("world", "check"), CASES)
def test_drop_in_equals_its_reference(launch, world, check):
    found = launch(world)[check]
    assert found <= 1e-10, f"{check} on {world} ranks: largest difference {found:.3g}"
