"""The code base stays ruff-clean (lint and format), as the house style asks."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("args", [["check"], ["format", "--check"]])
def test_ruff_clean(args):
    ruff = shutil.which("ruff")
    assert ruff, "ruff is a [dev] dependency: pip install -e '.[dev]'"
    proc = subprocess.run([ruff, *args, "src", "tests", "benchmarks"], cwd=ROOT, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-1000:]
