"""A study as a SLURM array (examples/slurm/sweep.sbatch + sweep.yaml): 2 objectives × 2 fractions × 2 seeds, each
array task run as sbatch would run it (stand-in `srun` and `scontrol`, SLURM_ARRAY_TASK_ID set), then the table of
the study and the sample-efficiency figure from the eight run directories. Also: the sweep file's tasks in index
order, and its errors."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from sharpclip.cli import main
from sharpclip.sweep import read_sweep, task

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "slurm" / "sweep.yaml"
SRUN = '#!/bin/bash\n# srun stand-in: one task, the command as is\nwhile [[ "$1" == -* ]]; do shift; done\nexec "$@"\n'


def test_the_sweep_file_maps_each_array_index_to_one_setting(tmp_path, capsys, monkeypatch):
    root, tasks = read_sweep(EXAMPLE)
    assert root == Path("runs/sweep") and len(tasks) == 8
    assert [t.name for t in tasks[:3]] == ["infonce_f0.5_s0", "infonce_f0.5_s1", "infonce_f1.0_s0"]  # seed fastest
    assert task(EXAMPLE, 5).overrides == ("loss.terms:={hn: {loss: hn_clip, params: {gamma: 0.5}}}",
                                          "data.train_fraction=0.5", "train.seed=1",
                                          "train.output_dir=runs/sweep/hn_f0.5_s1")  # fmt: skip
    assert main(["sweep", str(EXAMPLE), "--task", "8"]) == 2
    assert "task 8 of 8: submit with sbatch --array=0-7" in capsys.readouterr().err
    monkeypatch.setenv("SLURM_ARRAY_TASK_ID", "5")
    assert main(["sweep", "--array-task", str(EXAMPLE)]) == 0
    assert capsys.readouterr().out.splitlines()[-1] == "train.output_dir=runs/sweep/hn_f0.5_s1"
    bad = tmp_path / "bad.yaml"
    bad.write_text("root: r\naxes:\n  seed:\n    s/0: [train.seed=0]\n")
    with pytest.raises(ValueError, match=r"seed\.s/0: a value's name is part of a folder name"):
        read_sweep(bad)


@pytest.mark.slow
def test_a_sweep_runs_as_an_array_then_gives_one_table_and_the_figure(tmp_path, capsys):
    sweep = yaml.safe_load(EXAMPLE.read_text())
    sweep["root"] = str(tmp_path / "sweep")
    (tmp_path / "sweep.yaml").write_text(yaml.safe_dump(sweep))
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "srun").write_text(SRUN)
    (bin_dir / "scontrol").write_text('#!/bin/bash\necho "$@" >> "$SCONTROL_LOG"\n')
    for tool in bin_dir.iterdir():
        tool.chmod(0o755)
    env = {**os.environ, "PATH": f"{bin_dir}:{Path(sys.executable).parent}:{os.environ['PATH']}",
           "PYTHONPATH": str(ROOT / "src"), "SLURM_NTASKS": "1", "SLURM_CPUS_PER_TASK": "1",
           "SLURM_SUBMIT_DIR": str(ROOT), "SHARPCLIP_TINY_SYNTHDENSE": str(tmp_path / "data"),
           "SCONTROL_LOG": str(tmp_path / "scontrol.log")}  # fmt: skip
    script = [str(ROOT / "examples" / "slurm" / "sweep.sbatch"), str(tmp_path / "sweep.yaml"),
              str(ROOT / "configs" / "tiny_synthdense.yaml"), "data.num_workers=0"]  # fmt: skip
    for index in [*range(8), 0]:  # task 0 again: a requeued task whose run has finished exits 0
        array = {"SLURM_ARRAY_TASK_ID": str(index), "SLURM_JOB_ID": str(500 + index)}
        done = subprocess.run(["bash", *script], env={**env, **array}, capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stdout[-1500:] + done.stderr[-1500:]
    assert "already finished" in done.stdout and not (tmp_path / "scontrol.log").exists()
    runs = sorted((tmp_path / "sweep").iterdir())
    assert [r.name for r in runs] == sorted(t.name for t in read_sweep(tmp_path / "sweep.yaml")[1])

    models = [w for r in runs for w in ("--model", str(r))]
    assert main(["eval", *models, "--table", str(tmp_path / "table")]) == 0
    import pandas as pd

    long = pd.read_csv(tmp_path / "table" / "eval_long.csv")
    assert set(long["objective"]) == {"infonce", "hn_clip γ=0.5"} and set(long["fraction"]) == {0.5, 1.0}
    grouped = pd.read_csv(tmp_path / "table" / "eval_grouped.csv")
    assert len(grouped) == 4 and grouped["n"].tolist() == [2, 2, 2, 2]  # the seeds pooled, nothing else
    assert main(["analyze", "sample-efficiency", *map(str, runs), "--out", str(tmp_path / "fig")]) == 0
    assert (tmp_path / "fig" / "sample_efficiency.png").is_file()
    assert "| hn_clip γ=0.5 | 50.0 % |" in (tmp_path / "fig" / "sample_efficiency.md").read_text()
