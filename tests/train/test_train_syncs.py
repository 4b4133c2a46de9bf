"""Host reads per optimiser step: on a GPU every `.item()`, `float(t)` or `.tolist()` waits for the queued kernels,
so the step may read values back only at its end. A `TorchDispatchMode` sees every `aten._local_scalar_dense`
(what `.item()`, `float()`, `bool()` and `int()` of a tensor dispatch to) and `Tensor.tolist` is patched; each read
is attributed to the innermost sharpclip, transformers or torch.optim frame, and the set of call sites must be the
allow-list: the trainer's two end-of-step reads, plus AdamW's step counters, which live on the CPU (host-only).
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import sharpclip
from _support.host_reads import ALLOWED, OBJECTIVES, OPTIMISER, HostReads, site_of, sync_trainer
from sharpclip.train.trainer import Trainer, max_abs

WORKER = Path(__file__).with_name("sync_worker.py")


def _trainer(tmp_path, terms, **overrides) -> Trainer:
    return sync_trainer(tmp_path / "run", terms, **overrides)


@pytest.mark.parametrize(
    ("objective", "accumulation"),
    [("hn_clip+filip", "exact"), ("hn_clip+filip", "per_micro_batch"), ("hn_clip, frozen reference", "exact")],
)
def test_a_step_reads_the_device_only_at_its_end(tmp_path, objective, accumulation):
    trainer = _trainer(tmp_path, OBJECTIVES[objective], accumulation=accumulation)
    batches = iter(trainer.loader)
    trainer.model.train()
    trainer._train_step(next(batches))  # the first step builds optimiser state (its own one-off reads)
    with HostReads() as reads:
        record = trainer._train_step(next(batches))
    assert record is not None and record["loss"] > 0
    sites = {site: n for site, n in reads.sites.items() if site[0] != OPTIMISER}
    assert sites == dict.fromkeys(ALLOWED, 1), sites


def test_the_counter_sees_a_mid_step_read(tmp_path, monkeypatch):
    """The detector itself: a `float()` between forward and backward (as the monitor once did) is attributed to the
    sharpclip frame that called it."""
    from sharpclip.losses import objective as objective_module

    diagnose = objective_module.Objective.diagnose
    monkeypatch.setattr(objective_module.Objective, "diagnose",
                        lambda self, f: {k: torch.tensor(float(v)) for k, v in diagnose(self, f).items()})  # fmt: skip
    trainer = _trainer(tmp_path, OBJECTIVES["hn_clip+filip"])
    batches = iter(trainer.loader)
    trainer._train_step(next(batches))
    with HostReads() as reads:
        trainer._train_step(next(batches))
    assert reads.sites[("step.py", "_evaluated")] == 2  # the monitor's two values, read where it is evaluated


def test_reads_are_attributed_by_package_folder_not_by_a_sharpclip_in_the_path(tmp_path):
    """A clone in a folder named `sharpclip` with its venv inside (as the README sets it up): torch's own files lie
    under `.../sharpclip/.venv/...`, and a read made there is not sharpclip's; a file of the package itself is."""
    torch_file = tmp_path / "sharpclip" / ".venv" / "lib" / "python3.12" / "site-packages" / "torch" / "_dynamo"
    torch_file.mkdir(parents=True)
    torch_file = torch_file / "eval_frame.py"
    torch_file.write_text("import torch\n\n\ndef _fn():\n    return torch.ones(1).item()\n")
    namespace: dict = {}
    exec(compile(torch_file.read_text(), str(torch_file), "exec"), namespace)  # its frames carry that file name
    with HostReads() as reads:
        namespace["_fn"]()
    assert ("eval_frame.py", "_fn") not in reads.sites and sum(reads.sites.values()) == 1, reads.sites
    assert site_of(str(torch_file), 5, "_fn") is None
    package = Path(sharpclip.__file__).resolve().parent
    assert site_of(str(package / "train" / "step.py"), 1, "read") == ("step.py", "read")
    assert site_of(str(tmp_path / "sharpclip" / "train" / "step.py"), 1, "read") is None


@pytest.mark.gpu
def test_a_cuda_step_synchronises_only_at_its_end(tmp_path):
    """Under `torch.cuda.set_sync_debug_mode("warn")` a step on the GPU warns exactly for its two reads."""
    import warnings

    trainer = _trainer(tmp_path, OBJECTIVES["hn_clip+filip"], device="cuda")
    batches = [b.pin() if hasattr(b, "pin") else b for b in trainer.loader]
    trainer._train_step(batches[0])
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            trainer._train_step(batches[1])
        finally:
            torch.cuda.set_sync_debug_mode("default")
    syncs = [w for w in caught if "synchroniz" in str(w.message)]
    assert len(syncs) <= len(ALLOWED), [str(w.message) for w in syncs]


@pytest.mark.slow
def test_two_gloo_ranks_read_the_device_only_at_the_end_of_each_step(tmp_path):
    """The same count on 2 gloo ranks (launched by torchrun), on every rank, both accumulation modes, steps 2 to 4:
    the two end-of-step reads and nothing else (no shape exchange: the ranks' rows and caption widths travel in the
    agreement made before each step, `Trainer._steps`, the loop's one read per step, outside the step; no
    `torch.tensor(device=...)` copy), while the ranks' caption widths change from step to step."""
    out = tmp_path / "reads.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", str(WORKER), str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"}, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    ranks = json.loads(out.read_text())
    assert len(ranks) == 2
    expected = {f"{f}:{fn}": 1 for f, fn in ALLOWED}
    for results in ranks:
        for mode, steps in results.items():
            assert len(steps) == 3, mode
            for step in steps:
                assert step["copies"] == {}, (mode, step)
                assert step["sites"] == expected, (mode, step)
        widths = [step["widths"] for step in results["exact"]]
        assert len({tuple(w) for w in widths}) > 1, widths  # some rank's caption width changed between the steps


@pytest.mark.parametrize("bad", [None, float("inf"), float("-inf"), float("nan")])
def test_the_fused_weight_check_equals_the_per_tensor_one(bad):
    """`max_abs` on a GPU is one fused multi-tensor inf-norm; on the CPU, aminmax per tensor. Both forms (the fused
    one forced on the CPU) give the same max |w|, and both see an inf or a nan anywhere."""
    g = torch.Generator().manual_seed(0)
    params = [torch.randn(5, 3, generator=g), torch.randn(7, generator=g), torch.zeros(0), torch.tensor(-9.5)]
    if bad is not None:
        params[1][4] = bad
    fused, per_tensor = max_abs(params, fused=True), max_abs(params, fused=False)
    expected = max(float(p.abs().max()) for p in params if p.numel())
    if bad is None:
        assert float(fused) == float(per_tensor) == expected == 9.5
    else:
        assert not math.isfinite(float(fused)) and not math.isfinite(float(per_tensor))
        assert math.isnan(float(fused)) == math.isnan(float(per_tensor)) == math.isnan(bad)
