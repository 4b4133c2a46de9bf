"""Every rank takes the same steps, resumes its own position and random streams, and draws its own noise.

Multi-rank cases run 2 gloo processes under torchrun with a 30 s process-group timeout
(`train.dist_timeout_min=0.5`) and a subprocess timeout, so a regression fails instead of hanging. Data are made the
way the field's tools make them: webdataset tar shards with a `sizes.json`, and the generic JSON Lines layout.
"""

from __future__ import annotations

import io
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from PIL import Image
from safetensors.torch import load_file

from _support.tiny_files import write_generic
from sharpclip.cli import main

HERE = Path(__file__).parent
WORKER, TRAINER_WORKER = HERE / "rank_worker.py", HERE / "trainer_worker.py"
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
LIMIT = 300  # seconds for one subprocess: far above a healthy run, far below a hang left to the CI's own timeout
TINY = ["model.name=tiny-clip", "data.num_workers=0", "train.device=cpu", "train.micro_batch_size=4",
        "train.eval_every=0", "train.progress=false", "train.dist_timeout_min=0.5", "train.lr=1e-3",
        "train.warmup_steps=0"]  # fmt: skip


def _jpeg(i: int) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (12, 12), (i * 37 % 256, 90, 160)).save(buf, "JPEG")
    return buf.getvalue()


def write_shards(root: Path, shards: list[int], bad: dict[int, int] | None = None, listed: dict | None = None) -> Path:
    """`train-<s>.tar` shards of `shards[s]` samples (jpg + txt, as webdataset's ShardWriter writes them); the first
    `bad[s]` samples of shard s have no caption; `sizes.json` lists `listed` (default: the true counts)."""
    import tarfile

    root.mkdir(parents=True, exist_ok=True)
    bad = bad or {}
    for s, n in enumerate(shards):
        with tarfile.open(root / f"train-{s:04d}.tar", "w") as tar:
            for j in range(n):
                key = f"s{s}k{j:03d}"
                members = [(f"{key}.jpg", _jpeg(j))]
                if j >= bad.get(s, 0):
                    members.append((f"{key}.txt", f"a small red square number {s} {j}".encode()))
                for name, data in members:
                    info = tarfile.TarInfo(name)
                    info.size = len(data)
                    tar.addfile(info, io.BytesIO(data))
    sizes = {f"train-{s:04d}.tar": n for s, n in enumerate(shards)} | (listed or {})
    (root / "sizes.json").write_text(json.dumps(sizes))
    return root


def _run(cmd: list[str], **env) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, capture_output=True, text=True, env={**ENV, **env}, timeout=LIMIT)


def _steps(run: Path) -> list[dict]:
    return [r for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines()) if "loss" in r]


def _ids(directory: Path, rank: int) -> dict[int, list[str]]:
    """step -> the ids rank `rank` trained on (a replayed step keeps its last record)."""
    lines = (directory / f"rank{rank}.jsonl").read_text().splitlines()
    return {r["step"]: r["ids"] for r in map(json.loads, lines)}


# -- every rank takes the same steps ------------------------------------------------------------------------------
@pytest.mark.slow
def test_a_webdataset_rank_short_of_batches_stops_every_rank_together_with_a_warning(tmp_path):
    """Rank 1 reads shards 1 and 3: four samples of shard 1 have no caption (skipped), and sizes.json overstates
    shard 3 (12 listed, 8 there), so rank 1 fills 3 batches of 4 where 4 are announced. Every rank takes 3 steps an
    epoch; the early end and the unseen samples are warnings in the console and in train.log."""
    data = write_shards(tmp_path / "wds", [8, 8, 8, 8], bad={1: 4}, listed={"train-0003.tar": 12})
    run = tmp_path / "run"
    args = [*TINY, "data.format=webdataset", f"data.root={data}", "data.on_bad_sample=skip", "train.batch_size=8",
            "train.epochs=2", f"train.output_dir={run}"]  # fmt: skip
    proc = _run([*TORCHRUN, str(WORKER), str(tmp_path / "ids"), "train", *args])
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert [r["epoch"] for r in _steps(run)] == [0, 0, 0, 1, 1, 1]
    assert len(_ids(tmp_path / "ids", 0)) == len(_ids(tmp_path / "ids", 1)) == 6
    log = (run / "train.log").read_text()
    assert "epoch 0 ended after 3 of 4 batches: rank 1 ran out, so every rank stopped" in log
    assert "4 samples (11%) are not seen that epoch" in log  # the data layer's warning reaches train.log
    assert "ran out" in proc.stderr  # and the console


@pytest.mark.slow
def test_a_batch_all_bad_on_one_rank_under_skip_keeps_the_ranks_in_step(tmp_path):
    """Generic data, 8 rows in release order, 2 rows per rank: rank 1's first batch (rows 2, 3) has no readable
    image and is skipped. Rank 1 has one batch an epoch (rows 6, 7), rank 0 two: both take one step an epoch, for
    exactly the 2 epochs asked; rank 0's second batch is not seen (said)."""
    data = write_generic(tmp_path / "data", n=8, splits=("train",))
    for i in (2, 3):
        (data / "images" / f"train-{i}.png").unlink()
    run = tmp_path / "run"
    args = [*TINY, "data.format=generic", f"data.root={data}", "data.on_bad_sample=skip", "data.shuffle=false",
            "train.batch_size=4", "train.micro_batch_size=2", "train.epochs=2", f"train.output_dir={run}"]  # fmt: skip
    proc = _run([*TORCHRUN, str(WORKER), str(tmp_path / "ids"), "train", *args])
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert [r["epoch"] for r in _steps(run)] == [0, 1]
    assert _ids(tmp_path / "ids", 0) == {1: ["train-0", "train-1"], 2: ["train-0", "train-1"]}
    assert _ids(tmp_path / "ids", 1) == {1: ["train-6", "train-7"], 2: ["train-6", "train-7"]}
    assert "rank 1 ran out" in (run / "train.log").read_text()


def test_an_all_bad_stream_under_skip_stops_with_one_line_instead_of_looping(tmp_path, capsys):
    data = write_shards(tmp_path / "wds", [6, 6], bad={0: 6, 1: 6})  # no sample has a caption
    args = [*TINY, "data.format=webdataset", f"data.root={data}", "data.on_bad_sample=skip", "train.batch_size=4",
            "train.epochs=2", f"train.output_dir={tmp_path / 'run'}"]  # fmt: skip
    assert main(["train", *args]) == 2
    err = capsys.readouterr().err
    assert "epoch 0 yielded no training batch of 4 rows; skipped 12 bad samples (12 empty caption), the first" in err
    assert "sharpclip validate-data" in err


def test_a_partly_bad_stream_trains_exactly_the_configured_epochs(tmp_path):
    """2 of 10 samples a shard lack a caption: 4 batches of 4 are there where the shard sizes announce 5. The run
    takes 2 epochs of 4 steps, not 8 + 2 steps over 3 epochs."""
    data = write_shards(tmp_path / "wds", [10, 10], bad={0: 2, 1: 2})
    run = tmp_path / "run"
    args = [*TINY, "data.format=webdataset", f"data.root={data}", "data.on_bad_sample=skip", "train.batch_size=4",
            "train.epochs=2", f"train.output_dir={run}"]  # fmt: skip
    assert main(["train", *args]) == 0
    assert [r["epoch"] for r in _steps(run)] == [0] * 4 + [1] * 4
    assert "epoch 0 ended after 4 of 5 batches: the loader ran out" in (run / "train.log").read_text()


def test_skipped_all_bad_batches_do_not_add_epochs(tmp_path):
    """Generic data, 8 rows, batches of 4 in release order, the first batch all bad: 2 epochs are 2 steps."""
    data = write_generic(tmp_path / "data", n=8, splits=("train",))
    for i in range(4):
        (data / "images" / f"train-{i}.png").unlink()
    run = tmp_path / "run"
    args = [*TINY, "data.format=generic", f"data.root={data}", "data.on_bad_sample=skip", "data.shuffle=false",
            "train.batch_size=4", "train.epochs=2", f"train.output_dir={run}"]  # fmt: skip
    assert main(["train", *args]) == 0
    assert [r["epoch"] for r in _steps(run)] == [0, 1]


# -- resume on W ranks --------------------------------------------------------------------------------------------
@pytest.mark.slow
def test_two_ranks_killed_mid_epoch_resume_to_the_uninterrupted_weights_and_samples(tmp_path):
    """webdataset with the default shuffle buffer (larger than every shard), 4 steps an epoch, a checkpoint every 3
    steps and at each epoch's end, SIGKILL after step 7: the resume from step 6 (mid-epoch 1) trains what each rank
    would have trained."""
    data = write_shards(tmp_path / "wds", [8, 8, 8, 8])
    args = [*TINY, "data.format=webdataset", f"data.root={data}", "train.batch_size=8", "train.epochs=2",
            "train.checkpoint_every=3", "train.keep_last=5"]  # fmt: skip
    ref, run = tmp_path / "ref", tmp_path / "run"
    proc = _run([*TORCHRUN, str(WORKER), str(tmp_path / "ids_ref"), "train", *args, f"train.output_dir={ref}"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    killed = _run([*TORCHRUN, str(WORKER), str(tmp_path / "ids"), "train", *args, f"train.output_dir={run}"],
                  SHARPCLIP_FAULT="step:7")  # fmt: skip
    assert killed.returncode != 0 and not (run / "checkpoints" / "step-000008").exists()
    resumed = _run([*TORCHRUN, str(WORKER), str(tmp_path / "ids"), "train", "--resume", str(run)])
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "step-000006 at step 6 (epoch 1)" in (run / "train.log").read_text()
    for rank in (0, 1):
        assert _ids(tmp_path / "ids", rank) == _ids(tmp_path / "ids_ref", rank), f"rank {rank}"
    assert len({i for ids in _ids(tmp_path / "ids", 0).values() for i in ids}) == 16  # rank 0's shards, each epoch
    final = load_file(run / "checkpoints" / "step-000008" / "model.safetensors")
    expected = load_file(ref / "checkpoints" / "step-000008" / "model.safetensors")
    assert final.keys() == expected.keys()
    for key, value in expected.items():
        assert torch.equal(final[key], value), key
    state = json.loads((run / "checkpoints" / "step-000008" / "trainer_state.json").read_text())
    assert state["world_size"] == 2 and state["rank_batch"] == 4 and len(state["loaders"]) == 2
    assert json.loads((run / "resumes.jsonl").read_text())["world_size"] == 2


@pytest.mark.slow
def test_two_ranks_stopped_mid_epoch_and_relaunched_on_one_train_the_uninterrupted_rows(tmp_path):
    """webdataset with the default shuffle buffer, 2 ranks, 4 steps an epoch: SIGTERM after step 5 (epoch 1), the
    checkpoint of step 6, and the same command relaunched on 1 process. The rest of epoch 1 is read in the saved
    layout (2 reader slots, batches of 4): steps 7-8 train the uninterrupted 2-rank run's global batches, rows in
    order, and the run ends at its weights to 1e-6 (the noise-only attention key biases to 1e-5: see
    test_train_same_rows)."""
    data = write_shards(tmp_path / "wds", [8, 8, 8, 8])
    args = [*TINY, "data.format=webdataset", f"data.root={data}", "train.batch_size=8", "train.epochs=2",
            "train.keep_last=5"]  # fmt: skip
    ref, run = tmp_path / "ref", tmp_path / "run"
    proc = _run([*TORCHRUN, str(WORKER), str(tmp_path / "ids_ref"), "train", *args, f"train.output_dir={ref}"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    command = ["train", *args, f"train.output_dir={run}", "--resume", "auto"]
    stopped = _run([*TORCHRUN, str(WORKER), str(tmp_path / "ids"), *command], SHARPCLIP_SIGNAL="step:5:SIGTERM:0")
    assert stopped.returncode != 0 and sorted(p.name for p in (run / "checkpoints").iterdir())[-1] == "step-000006"
    relaunched = _run([sys.executable, str(WORKER), str(tmp_path / "ids_one"), *command])
    assert relaunched.returncode == 0, relaunched.stderr[-3000:]
    assert "epoch 1 continues after its 2 global batches done" in relaunched.stderr
    assert "the rest of streamed epoch 1 is read as it was saved (2 ranks x 1 workers, batches of 4)" in (
        relaunched.stderr
    )
    uninterrupted = {
        step: ids + _ids(tmp_path / "ids_ref", 1)[step] for step, ids in _ids(tmp_path / "ids_ref", 0).items()
    }
    assert _ids(tmp_path / "ids_one", 0) == {s: uninterrupted[s] for s in (7, 8)}
    final = load_file(run / "checkpoints" / "step-000008" / "model.safetensors")
    expected = load_file(ref / "checkpoints" / "step-000008" / "model.safetensors")
    assert final.keys() == expected.keys()
    for key, value in expected.items():
        bound = 1e-5 if "self_attn.k_proj.bias" in key else 1e-6
        assert (final[key] - value).abs().max().item() <= bound, key


def _trainer_run(tmp_path: Path, name: str, *args: str, procs: int = 2, fault: str | None = None):  # 1 or 2
    launcher = TORCHRUN if procs > 1 else [sys.executable]
    cmd = [*launcher, str(TRAINER_WORKER), str(tmp_path / name), str(tmp_path / f"{name}.safetensors"),
           "checkpoint_every=2", "dropout", *args]  # fmt: skip
    return _run(cmd, **({"SHARPCLIP_FAULT": fault} if fault else {}))


@pytest.mark.slow
def test_dropout_differs_per_rank_and_a_two_rank_resume_with_dropout_is_bit_identical(tmp_path):
    """Attention dropout 0.1, exact accumulation (4 micro-batches replayed per step), 2 ranks: each rank draws its
    own noise (seed + rank), and a SIGKILL mid-epoch then resume restores each rank's own RNG: bit-identical."""
    proc = _trainer_run(tmp_path, "ref", "probe")
    assert proc.returncode == 0, proc.stderr[-3000:]
    ref = load_file(tmp_path / "ref.safetensors")
    assert not torch.equal(ref.pop("probe/rank0"), ref.pop("probe/rank1"))  # the ranks' streams differ
    killed = _trainer_run(tmp_path, "run", fault="step:3")
    assert killed.returncode != 0
    shutil.copytree(tmp_path / "run", tmp_path / "one")  # the same checkpoint, resumed on 1 process below
    resumed = _trainer_run(tmp_path, "run", "resume")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    weights = load_file(tmp_path / "run.safetensors")
    for key, value in ref.items():
        assert torch.equal(weights[key], value), key
    # another world size: the saved epoch continues after its 2 global batches (the loader's position is global)
    one = _trainer_run(tmp_path, "one", "resume", procs=1)
    assert one.returncode == 0, one.stderr[-3000:]
    assert "resumed on 1 ranks, saved on 2 (per-rank batch 16, was 8): epoch 0 continues after its 2 global" in (
        one.stderr
    )
    last = json.loads((tmp_path / "one" / "checkpoints" / "step-000008" / "trainer_state.json").read_text())
    assert (last["step"], last["epoch"], last["world_size"]) == (8, 2, 1)  # epoch 0's last 2 steps, epoch 1's 4


@pytest.mark.slow
def test_an_older_checkpoint_resumes_onto_two_sharded_ranks_to_the_uninterrupted_weights(tmp_path):
    """A checkpoint in the format before the DCP folder (training_state.pt: the whole optimiser state by parameter
    name, every rank's RNG) resumes onto `train.layout=shard` on 2 ranks, loaded by name into each rank's shards:
    SIGKILL after step 3, the step-2 checkpoint rewritten in the older format, the resume ends bit-identical."""
    proc = _trainer_run(tmp_path, "ref", "layout=shard")
    assert proc.returncode == 0, proc.stderr[-3000:]
    killed = _trainer_run(tmp_path, "run", "layout=shard", fault="step:3")
    assert killed.returncode != 0
    _rewrite_in_older_format(tmp_path / "run" / "checkpoints" / "step-000002")
    resumed = _trainer_run(tmp_path, "run", "resume", "layout=shard")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert [r["step"] for r in _steps(tmp_path / "run")] == list(range(1, 9))  # continued from step 2, once each
    ref, weights = load_file(tmp_path / "ref.safetensors"), load_file(tmp_path / "run.safetensors")
    assert weights.keys() == ref.keys()
    for key, value in ref.items():
        assert torch.equal(weights[key], value), key


def _rewrite_in_older_format(path: Path) -> None:
    """`path`'s state/ (DCP) replaced by the training_state.pt the trainer wrote before it: the optimiser state by
    parameter name, gathered whole, the schedule, rank 0's RNG and every rank's."""
    from _support.tiny_run import toy_model, train_config
    from sharpclip.train import checkpoint
    from sharpclip.train.engine import optimizer_state_fqn
    from sharpclip.train.optim import build_optimizer, build_scheduler

    cfg = train_config(str(path))
    model = toy_model(attention_dropout=0.1)
    model.load_state_dict(checkpoint.load_weights(path))
    optimizer = build_optimizer(model, cfg.lr, cfg.weight_decay, cfg.module_lr, fused=False)
    scheduler = build_scheduler(optimizer, cfg.warmup_steps, 8, cfg.min_lr_ratio)
    assert checkpoint.load_sharded(path, model, optimizer, scheduler, 2, world=1) is None  # saved on 2 ranks
    rngs = {"rng": {"ranks": [checkpoint.rng_state(), checkpoint.rng_state()]}}
    checkpoint.read_sharded(rngs, path / checkpoint.STATE)
    ranks = rngs["rng"]["ranks"]
    state = {"optimizer": optimizer_state_fqn(model, optimizer), "scheduler": scheduler.state_dict(),
             "rng": ranks[0], "rank_rng": ranks}  # fmt: skip
    assert set(state["optimizer"]["state"]) and all(isinstance(k, str) for k in state["optimizer"]["state"])
    torch.save(state, path / checkpoint.TRAINING_STATE)
    shutil.rmtree(path / checkpoint.STATE)
    record = path / checkpoint.TRAINER_STATE  # that format recorded no file digests
    record.write_text(json.dumps({k: v for k, v in json.loads(record.read_text()).items() if k != "files"}))
    assert checkpoint.is_legacy(path)


# -- cluster start-up ---------------------------------------------------------------------------------------------
@pytest.mark.slow
def test_ranks_that_see_different_run_directories_are_refused_on_every_rank(tmp_path):
    proc = _run([*TORCHRUN, str(WORKER), str(tmp_path), "check-dir"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    for rank in (0, 1):
        message = (tmp_path / f"rank{rank}.txt").read_text()
        assert "rank 1 does not see the run directory rank 0 writes" in message and "train.output_dir" in message
    assert not list(tmp_path.glob("rank*/.shared-dir-check"))  # rank 0's token is removed
