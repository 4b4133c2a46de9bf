"""Validation over ranks (train.validation): every rank embeds its share, rank 0 alone scores, and every rank takes
rank 0's metrics, so they all decide the same best checkpoint. Two gloo processes under torchrun, 30 s process-group
timeout and a subprocess timeout, so a regression fails instead of hanging."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from _support.tiny_files import write_generic
from sharpclip.train import validation

WORKER = Path(__file__).with_name("validation_worker.py")
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]


@pytest.mark.slow
def test_rank0_alone_scores_and_every_rank_decides_the_same_best_checkpoint(tmp_path):
    data = write_generic(tmp_path / "data", n=8)
    cmd = [*TORCHRUN, str(WORKER), str(data), str(tmp_path / "run"), str(tmp_path)]
    proc = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"}, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    rank0, rank1 = (json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1))
    # the initial guard evaluation, then per epoch the validation and the guard: each scored once, on rank 0
    assert rank0["scored"] == 1 + 3 * 2 and rank1["scored"] == 0
    assert len(rank0["metrics"]) == 3 and rank0["metrics"] == rank1["metrics"]
    assert {"mean_R@1", "guard/retrieval/mean_R@1", "guard_delta/retrieval/t2i/R@5"} <= rank0["metrics"][0].keys()
    assert rank0["best"] == rank1["best"] and any(rank0["best"])
    assert rank0["final_best"] == rank1["final_best"] == max(m["mean_R@1"] for m in rank0["metrics"])
    # an error rank 0 meets while scoring is raised on every rank, not left to the others' timeout
    assert rank0["raised"] == "text embeddings contain NaN or inf"
    assert rank1["raised"] == "rank 0: text embeddings contain NaN or inf"


def test_one_process_scores_itself_with_no_collective():
    assert validation.scores_here()
    assert validation.from_rank0(lambda: {"mean_R@1": 1.0}) == {"mean_R@1": 1.0}
    assert validation.shard(embedder := object()) is embedder
