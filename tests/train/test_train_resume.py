"""Resume: it writes into the directory it was given, finds a checkpoint's run two levels up,
applies only what may change (the schedule rebuilt), refuses the rest with saved → new, falls back from a corrupt
newest checkpoint naming the bad file, and never logs a step twice."""

from __future__ import annotations

import json
import logging
import random
import shutil
from dataclasses import fields, is_dataclass
from pathlib import Path

import pytest
import torch
import yaml

from _support.tiny_files import tiny_config, write_generic
from sharpclip.cli import main
from sharpclip.config import Config, ConfigError, load_config
from sharpclip.train import checkpoint
from sharpclip.train.optim import warmup_cosine
from sharpclip.train.resume import APPLIED, REFUSED, classify, flatten, load_resume_config
from sharpclip.train.run import RESUMES, run_train


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return write_generic(tmp_path_factory.mktemp("data"))


@pytest.fixture(scope="module")
def trained(data, tmp_path_factory):
    """A finished 2-step run with checkpoints after steps 1 and 2 (copied by each test before it changes it)."""
    run = tmp_path_factory.mktemp("trained") / "run"
    run_train(tiny_config(data, run, "train.warmup_steps=1"))
    return run


def _copy(run: Path, to: Path) -> Path:
    shutil.copytree(run, to)
    return to


def _records(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def _steps(run: Path) -> list[int]:
    return [r["step"] for r in _records(run) if "loss" in r]


def test_resume_writes_into_the_directory_it_was_given(trained, tmp_path):
    moved = _copy(trained, tmp_path / "moved")
    original = sorted(p.name for p in (trained / "checkpoints").iterdir())
    run_train(load_resume_config(moved, [], ["train.max_steps=3"]), resume=moved)
    assert (moved / "checkpoints" / "step-000003").is_dir()
    assert sorted(p.name for p in (trained / "checkpoints").iterdir()) == original  # the original is untouched
    assert load_config(moved / "config.yaml").train.output_dir == str(moved)


def test_resume_from_a_checkpoint_folder_through_the_cli_with_overrides(trained, tmp_path, capsys):
    run = _copy(trained, tmp_path / "run")
    assert main(["train", "--resume", str(run / "checkpoints" / "step-000001"), "train.max_steps=3"]) == 0
    assert "trained 3 steps" in capsys.readouterr().out
    assert _steps(run) == [1, 2, 3]  # steps 2 was redone from step 1: logged once
    assert json.loads((run / RESUMES).read_text().splitlines()[-1])["checkpoint"] == "step-000001"


def test_a_changed_lr_is_applied_on_the_rebuilt_schedule_and_recorded(trained, tmp_path):
    run = _copy(trained, tmp_path / "run")
    run_train(load_resume_config(run, [], ["train.max_steps=4", "train.lr=5e-4"]), resume=run)
    resumed = [r for r in _records(run) if "loss" in r and r["step"] > 2]
    for r in resumed:  # the new rate on the new schedule (warmup 1, 4 steps), at the step that used it
        assert r["lr"] == pytest.approx(5e-4 * warmup_cosine(r["step"] - 1, 1, 4))
    assert load_config(run / "config.yaml").train.lr == 5e-4
    changed = json.loads((run / RESUMES).read_text().splitlines()[-1])["changed"]
    assert changed["train.lr"] == [1e-3, 5e-4] and changed["train.max_steps"] == [2, 4]


@pytest.mark.parametrize(
    "override, shown",
    [("train.batch_size=8", "train.batch_size: 4 → 8"), ("model.tiny.width=64", "model.tiny.width: 32 → 64"),
     ("loss.terms.contrastive.weight=2", "loss.terms.contrastive.weight: 1.0 → 2.0")],
)  # fmt: skip
def test_a_refused_change_lists_saved_and_new_and_changes_nothing(trained, tmp_path, override, shown):
    run = _copy(trained, tmp_path / "run")
    before = (run / "config.yaml").read_text()
    with pytest.raises(ConfigError, match="cannot change on resume") as err:
        run_train(load_resume_config(run, [], [override]), resume=run)
    assert shown in str(err.value)
    assert (run / "config.yaml").read_text() == before and not (run / RESUMES).exists()


def _leaves(node, prefix=""):
    for f in fields(node):
        value = getattr(node, f.name)
        key = f"{prefix}{f.name}"
        yield from _leaves(value, key + ".") if is_dataclass(value) else [key]


def test_every_config_key_is_classified_applied_or_refused():
    keys = list(_leaves(Config())) + [k for k in flatten(load_config(None)) if k.startswith("loss.")]
    unclassified = [k for k in keys if k != "train.output_dir" and classify(k) is None]
    assert not unclassified, f"classify these in sharpclip/train/resume.py (APPLIED or REFUSED): {unclassified}"
    assert classify("train.lr") == "applied" and classify("train.batch_size") == "refused"
    assert classify("data.num_workers") == "applied" and classify("data.root") == "refused"
    assert not set(APPLIED) & set(REFUSED)


def _corrupt(ckpt: Path, which: str) -> Path:
    path = ckpt / which
    if which == checkpoint.TRAINER_STATE:
        path.write_text('{"step": 2, "epo')
    else:
        data = path.read_bytes()
        path.write_bytes(data[: len(data) // 2])
    return path


def _resumed_to_step_3(run: Path, caplog) -> list[str]:
    """Resume `run` to step 3; the warnings it logged."""
    with caplog.at_level(logging.WARNING, logger="sharpclip.train"):
        assert run_train(load_resume_config(run, [], ["train.max_steps=3"]), resume=run).step == 3
    return [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]


@pytest.mark.parametrize(
    "which",
    [
        "model.safetensors",
        checkpoint.TRAINER_STATE,
        f"{checkpoint.STATE}/.metadata",
        f"{checkpoint.STATE}/__0_0.distcp",
    ],
)
def test_a_corrupt_newest_checkpoint_falls_back_to_the_previous_one(trained, tmp_path, caplog, which):
    run = _copy(trained, tmp_path / "run")
    bad = _corrupt(run / "checkpoints" / "step-000002", which)
    warnings = _resumed_to_step_3(run, caplog)
    assert any(str(bad) in w and "falling back" in w for w in warnings), warnings
    assert _steps(run) == [1, 2, 3]  # step 2, logged before the crash-like corruption, is not logged twice


def test_a_named_corrupt_checkpoint_is_an_error_naming_the_file(trained, tmp_path):
    run = _copy(trained, tmp_path / "run")
    bad = _corrupt(run / "checkpoints" / "step-000001", "model.safetensors")
    with pytest.raises(checkpoint.CorruptCheckpoint, match=str(bad)):
        run_train(load_resume_config(run, [], []), resume=run / "checkpoints" / "step-000001")


def test_a_run_written_by_an_older_version_stays_readable_without_its_removed_keys(tmp_path, caplog):
    from sharpclip.train.resume import load_resume_config

    run = tmp_path / "old_run"
    run.mkdir()
    (run / "config.yaml").write_text(
        "# cpu (2 threads)\ndata:\n  image_size: 224\n  context_length: 77\n"
        "train:\n  lr: 0.001\n  diagnostics_gamma: 0.5\n"
    )
    with caplog.at_level("WARNING", logger="sharpclip.config"):
        cfg = load_resume_config(run)
    assert cfg.train.lr == 0.001 and cfg.train.output_dir == str(run)
    ignored = [r.getMessage() for r in caplog.records]
    assert sum("no longer a setting" in m for m in ignored) == 3 and any("data.image_size" in m for m in ignored)
    with pytest.raises(ConfigError, match=r"data\.image_size' is no longer a setting"):  # a recipe still refuses it
        load_config(run / "config.yaml")


def _recipe(data: Path, path: Path, *extra: str) -> Path:
    """The recipe `trained` was started from, without its cadence overrides (keep_last, checkpoint_every, steps)."""
    lines = ["model:", "  name: tiny-clip", "data:", "  format: generic", f"  root: {data}", "  num_workers: 0",
             "train:", "  batch_size: 4", "  micro_batch_size: 4", "  lr: 0.001", "  epochs: 1", "  warmup_steps: 1",
             "  progress: false", *extra]  # fmt: skip
    path.write_text("\n".join(lines) + "\n")
    return path


def test_the_recipe_given_again_on_resume_keeps_the_runs_own_settings(data, trained, tmp_path):
    run = _copy(trained, tmp_path / "run")  # started with train.keep_last=5 train.checkpoint_every=1
    cfg = load_resume_config(run, [str(_recipe(data, tmp_path / "recipe.yaml"))], ["train.max_steps=4"])
    assert cfg.train.keep_last == 5 and cfg.train.checkpoint_every == 1
    run_train(cfg, resume=run)
    names = [p.name for p in checkpoint.all_checkpoints(run / "checkpoints")]
    assert names == [f"step-00000{i}" for i in (1, 2, 3, 4)]  # nothing pruned behind the user's back
    assert set(json.loads((run / RESUMES).read_text().splitlines()[-1])["changed"]) == {"train.max_steps"}


def test_a_recipe_that_lowers_keep_last_needs_the_override(data, trained, tmp_path):
    run = _copy(trained, tmp_path / "run")
    recipe = str(_recipe(data, tmp_path / "recipe.yaml", "  keep_last: 1"))
    with pytest.raises(ConfigError, match=r"train\.keep_last would drop from 5 to 1.*train\.keep_last=1 to confirm"):
        load_resume_config(run, [recipe], ["train.max_steps=3"])
    cfg = load_resume_config(run, [recipe], ["train.max_steps=3", "train.keep_last=1"])
    run_train(cfg, resume=run)
    kept = [p.name for p in checkpoint.all_checkpoints(run / "checkpoints")]
    assert "step-000001" not in kept and "step-000003" in kept  # confirmed: pruned to the newest and the best


def _edit(run: Path, key: str, value) -> None:
    """Change one dotted key of the run's config.yaml by hand."""
    config = yaml.safe_load((run / "config.yaml").read_text())
    *path, last = key.split(".")
    node = config
    for part in path:
        node = node[part]
    assert last in node
    node[last] = value
    (run / "config.yaml").write_text(yaml.safe_dump(config))


def test_hand_edits_of_config_yaml_are_reconciled_against_the_checkpoints_own_config(trained, tmp_path):
    run = _copy(trained, tmp_path / "seed")
    _edit(run, "train.seed", 5)  # a refused key cannot be changed by editing the file
    with pytest.raises(ConfigError, match=r"train\.seed: 0 → 5"):
        run_train(load_resume_config(run, [], ["train.max_steps=3"]), resume=run)
    run = _copy(trained, tmp_path / "width")
    _edit(run, "model.tiny.width", 64)  # one line naming the key, not a state-dict traceback
    with pytest.raises(ConfigError, match=r"model\.tiny\.width: 32 → 64"):
        run_train(load_resume_config(run, [], []), resume=run)
    run = _copy(trained, tmp_path / "lr")
    _edit(run, "train.lr", 0.0005)  # an applied key: used, and recorded like an override
    run_train(load_resume_config(run, [], ["train.max_steps=3"]), resume=run)
    changed = json.loads((run / RESUMES).read_text().splitlines()[-1])["changed"]
    assert changed["train.lr"] == [1e-3, 5e-4]


def test_a_newest_checkpoint_whose_weights_do_not_fit_the_model_falls_back(data, trained, tmp_path, caplog):
    run = _copy(trained, tmp_path / "run")
    other = tmp_path / "other"  # another model's weights copied over the newest checkpoint's
    run_train(tiny_config(data, other, "model.tiny.width=64", "train.max_steps=1"))
    bad = run / "checkpoints" / "step-000002" / "model.safetensors"
    shutil.copy(other / "checkpoints" / "step-000001" / "model.safetensors", bad)
    record = bad.parent / checkpoint.TRAINER_STATE  # as a checkpoint from before its files' record (else: its size)
    record.write_text(json.dumps({k: v for k, v in json.loads(record.read_text()).items() if k != "files"}))
    with caplog.at_level(logging.WARNING, logger="sharpclip.train"):
        assert run_train(load_resume_config(run, [], ["train.max_steps=3"]), resume=run).step == 3
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any(str(bad) in w and "does not fit the model" in w and "falling back" in w for w in warnings), warnings


def _without_speed(records: list[dict]) -> list[dict]:
    return [{k: v for k, v in r.items() if k not in ("samples_per_s", "data_wait_s")} for r in records]


def test_a_kill_after_the_last_checkpoint_before_the_epochs_end_runs_the_final_validation_on_resume(
    data, trained, tmp_path, monkeypatch
):
    run = tmp_path / "run"
    fault = checkpoint.fault_point

    def killed_after_step_2(where, step):  # as SHARPCLIP_FAULT=step:2: after step 2's checkpoint, before validation
        if (where, step) == ("step", 2):
            raise KeyboardInterrupt
        fault(where, step)

    monkeypatch.setattr(checkpoint, "fault_point", killed_after_step_2)
    with pytest.raises(KeyboardInterrupt):
        run_train(tiny_config(data, run, "train.warmup_steps=1"))
    monkeypatch.undo()
    assert not any("eval/" in k for r in _records(run) for k in r)
    state = run_train(load_resume_config(run, [], []), resume=run)
    assert state.step == 2 and state.epoch == 1  # the epoch was ended: validated, best chosen
    assert _without_speed(_records(run)) == _without_speed(_records(trained))  # the uninterrupted run's records
    assert checkpoint.best(run / "checkpoints").name == checkpoint.best(trained / "checkpoints").name


def _dropout_model(tmp_path: Path) -> Path:
    """The tiny CLIP as a sharpclip checkpoint folder with dropout 0.1 in both towers."""
    from sharpclip.config import ModelConfig
    from sharpclip.models import create_model, save_checkpoint

    folder = tmp_path / "dropout-model"
    save_checkpoint(create_model(ModelConfig()), folder, ModelConfig())
    config = json.loads((folder / "config.json").read_text())
    for tower in ("text_config", "vision_config"):
        config[tower].update(attention_dropout=0.1, dropout=0.1)
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def test_a_mid_epoch_resume_with_dropout_is_bit_identical(data, tmp_path):
    from safetensors.torch import load_file

    model = _dropout_model(tmp_path)
    reference = tmp_path / "reference"
    run_train(tiny_config(data, reference, f"model.name={model}", "train.max_steps=0", "train.epochs=2"))
    run = _copy(reference, tmp_path / "run")
    shutil.rmtree(run / "checkpoints" / "step-000004")  # as if killed after step 3 (mid-epoch: 2 steps an epoch)
    run_train(load_resume_config(run, [], []), resume=run / "checkpoints" / "step-000001")
    want = load_file(reference / "checkpoints" / "step-000004" / "model.safetensors")
    got = load_file(run / "checkpoints" / "step-000004" / "model.safetensors")
    assert want.keys() == got.keys() and all(torch.equal(want[k], got[k]) for k in want)
    assert _without_speed(_records(run)) == _without_speed(_records(reference))


def test_tensorboard_drops_the_replayed_steps_on_resume(trained, tmp_path, monkeypatch):
    import sys
    import types

    made = []

    class Writer:  # stands in for torch.utils.tensorboard.SummaryWriter (an optional extra)
        def __init__(self, log_dir, purge_step=None):
            made.append(purge_step)

        def add_scalar(self, *args):
            pass

        def close(self):
            pass

    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", types.SimpleNamespace(SummaryWriter=Writer))
    run = _copy(trained, tmp_path / "run")
    run_train(load_resume_config(run, [], ["train.tensorboard=true", "train.max_steps=3"]), resume=run / "checkpoints"
              / "step-000001")  # fmt: skip
    assert made == [None, 2]  # reopened to purge every event after step 1, which the resume replays


@pytest.fixture(scope="module")
def two_epochs(data, tmp_path_factory):
    """A finished 2-epoch run (2 steps an epoch, a checkpoint at each epoch's end) read by 2 loader workers, as
    `data.num_workers: auto` does: the workers' prefetching runs the sampler ahead of the batches trained."""
    run = tmp_path_factory.mktemp("two_epochs") / "run"
    run_train(tiny_config(data, run, "train.max_steps=0", "train.epochs=2", "train.checkpoint_every=0",
                          "data.num_workers=2"))  # fmt: skip
    return run


def _evals(run: Path) -> list[tuple[int, int]]:
    return [(r["step"], r["epoch"]) for r in _records(run) if "eval/mean_R@1" in r]


def test_a_finished_run_continues_for_more_epochs(two_epochs, tmp_path, capsys):
    run = _copy(two_epochs, tmp_path / "run")
    assert main(["train", "--resume", str(run), "train.epochs=3"]) == 0
    out, err = capsys.readouterr()
    assert "trained 6 steps" in out
    assert "steps 5-6 of 6" in err and "schedule is rebuilt for 6 steps" in err
    trained = [(r["step"], r["epoch"]) for r in _records(run) if "loss" in r]
    assert trained == [(1, 0), (2, 0), (3, 1), (4, 1), (5, 2), (6, 2)]
    assert _evals(run) == [(2, 0), (4, 1), (6, 2)]  # each epoch validated once, none again
    assert (run / "checkpoints" / "step-000006").is_dir()
    assert checkpoint.best(run / "checkpoints").is_dir()  # best kept through the pruning of keep_last
    assert load_config(run / "config.yaml").train.epochs == 3
    for r in _records(run):  # the schedule rebuilt for 6 steps, as if the run had used it from the start
        if "loss" in r and r["step"] > 4:
            assert r["lr"] == pytest.approx(1e-3 * warmup_cosine(r["step"] - 1, 0, 6))


def test_a_finished_run_continues_to_a_raised_max_steps_in_its_next_epoch(two_epochs, tmp_path):
    run = _copy(two_epochs, tmp_path / "run")
    state = run_train(load_resume_config(run, [], ["train.max_steps=5"]), resume=run)
    assert state.step == 5
    assert [(r["step"], r["epoch"]) for r in _records(run) if "loss" in r][-1] == (5, 2)  # no empty epoch 2


@pytest.mark.parametrize("how", [[], ["train.epochs=2"], ["train.max_steps=4"], ["checkpoint"]])
def test_resuming_a_finished_run_with_nothing_to_do_says_so_and_writes_nothing(two_epochs, tmp_path, capsys, how):
    run = _copy(two_epochs, tmp_path / "run")
    target = run / "checkpoints" / "step-000004" if how == ["checkpoint"] else run
    overrides = [] if how == ["checkpoint"] else how
    before = {p.relative_to(run): p.read_bytes() for p in run.rglob("*") if p.is_file()}
    assert main(["train", "--resume", str(target), *overrides]) == 0
    out, err = capsys.readouterr()
    assert out.strip().splitlines() == [
        f"{run} already finished at step 4 (train.{'max_steps=4' if 'max' in str(how) else 'epochs=2'}); raise "
        "train.epochs or train.max_steps to train more"
    ]
    assert "eval after" not in err and "training " not in err
    after = {p.relative_to(run): p.read_bytes() for p in run.rglob("*") if p.is_file()}
    assert after == before  # config.yaml, metrics.jsonl, resumes.jsonl, checkpoints, train.log (matrix 6 A3)


def _killed_at(point: tuple[str, int]):
    fault = checkpoint.fault_point

    def killed(where, step):  # as SHARPCLIP_FAULT=<where>:<step>, in-process: nothing after it runs
        if (where, step) == point:
            raise KeyboardInterrupt
        fault(where, step)

    return killed


@pytest.mark.parametrize("extra", [("train.keep_last=1",), ("train.keep_last=1", "train.eval_every=0")])
def test_an_epoch_end_on_a_checkpoint_step_never_leaves_the_run_without_a_complete_checkpoint(
    data, trained, tmp_path, monkeypatch, extra
):
    """Matrix 6 K1/K2: the epoch end at a step just checkpointed used to write the step again, deleting the complete
    folder first. It now records the epoch's end in that checkpoint by one atomic rename; a kill inside it (with
    or without a best kept by keep_last=1) leaves the step's checkpoint complete, and the resume continues there."""
    run = tmp_path / "run"
    monkeypatch.setattr(checkpoint, "fault_point", _killed_at(("update", 2)))
    with pytest.raises(KeyboardInterrupt):
        run_train(tiny_config(data, run, "train.warmup_steps=1", *extra))
    monkeypatch.undo()
    names = sorted(p.name for p in (run / "checkpoints").iterdir() if p.is_dir())
    assert names == ["step-000002"]  # no temporary copy stranded, step 1 pruned by keep_last=1
    assert checkpoint.load_trainer_state(run / "checkpoints" / "step-000002")["epoch_open"]  # the step's own record
    state = run_train(load_resume_config(run, [], []), resume=run)
    assert state.step == 2 and state.epoch == 1
    weights = checkpoint.load_weights(run / "checkpoints" / "step-000002")
    expected = checkpoint.load_weights(trained / "checkpoints" / "step-000002")
    assert all(torch.equal(weights[k], v) for k, v in expected.items())
    log = (run / "train.log").read_text()
    assert log.count("checkpoint step-000002 written") == 1  # the step is written once, its epoch end recorded
    assert "checkpoint step-000002 updated with the end of epoch 0" in log


def test_a_checkpoint_replacing_an_older_copy_of_its_step_deletes_that_copy_only_once_it_is_in_place(
    trained, tmp_path, monkeypatch
):
    """A step written again after a fallback (the stale copy of an abandoned attempt there) swaps the new folder in:
    a kill between the renames leaves the complete resume point, the next prune removes the set-aside copy."""
    ckpts = _copy(trained, tmp_path / "run") / "checkpoints"
    shutil.copytree(ckpts / "step-000002", ckpts / ".step-000002.tmp")  # a complete new copy, not yet renamed
    monkeypatch.setattr(checkpoint, "fault_point", _killed_at(("swap", 2)))
    with pytest.raises(KeyboardInterrupt):
        checkpoint.swap_in(ckpts / ".step-000002.tmp", ckpts / "step-000002")
    monkeypatch.undo()
    assert checkpoint.latest(ckpts) == ckpts / "step-000001"
    checkpoint.load(ckpts / "step-000001")  # complete
    assert (ckpts / ".step-000002.old" / checkpoint.TRAINER_STATE).is_file()  # set aside, not deleted
    checkpoint.swap_in(ckpts / ".step-000002.tmp", ckpts / "step-000002")
    checkpoint.prune(ckpts, keep_last=5)
    assert sorted(p.name for p in ckpts.iterdir()) == ["best.json", "step-000001", "step-000002"]


def test_no_readable_checkpoint_is_refused_without_advising_a_command_that_deletes_it(trained, tmp_path):
    run = _copy(trained, tmp_path / "run")
    for name in ("step-000001", "step-000002"):
        _corrupt(run / "checkpoints" / name, f"{checkpoint.STATE}/.metadata")
    with pytest.raises(checkpoint.CheckpointError, match="nothing was changed") as refused:
        run_train(load_resume_config(run, [], []), resume=run)
    assert "--overwrite" not in str(refused.value)


def _damage_state(ckpt: Path, how: str) -> str:
    """Matrix 6 C1 (random bytes of the same size), C2 (16 bytes flipped), C3 (the state of another checkpoint)."""
    shard = ckpt / checkpoint.STATE / "__0_0.distcp"
    if how == "random":
        shard.write_bytes(bytes(random.Random(0).randrange(256) for _ in range(shard.stat().st_size)))
    elif how == "flipped":
        raw = bytearray(shard.read_bytes())
        middle = len(raw) // 2
        raw[middle : middle + 16] = bytes(b ^ 0x40 for b in raw[middle : middle + 16])
        shard.write_bytes(bytes(raw))
    else:
        shutil.rmtree(ckpt / checkpoint.STATE)
        shutil.copytree(ckpt.parent / "step-000001" / checkpoint.STATE, ckpt / checkpoint.STATE)
    return f"{checkpoint.STATE}/"


@pytest.mark.parametrize("how", ["random", "flipped", "swapped"])
def test_a_damaged_or_swapped_sharded_state_falls_back_with_a_warning_naming_the_file(trained, tmp_path, caplog, how):
    run = _copy(trained, tmp_path / "run")
    named = _damage_state(run / "checkpoints" / "step-000002", how)
    warnings = _resumed_to_step_3(run, caplog)
    bad = [w for w in warnings if "cannot resume from step-000002" in w and "falling back" in w]
    assert bad and f"step-000002/{named}" in bad[0] and "sha256" in bad[0], warnings
    assert json.loads((run / RESUMES).read_text().splitlines()[-1])["checkpoint"] == "step-000001"


def test_a_checkpoint_of_another_run_is_not_resumed_as_this_ones(trained, tmp_path, caplog):
    run = _copy(trained, tmp_path / "run")
    path = run / "checkpoints" / "step-000002" / checkpoint.TRAINER_STATE
    state = json.loads(path.read_text())
    assert state["run_id"] and len(state["files"]) >= 4  # weights, run config, DCP metadata and shard
    path.write_text(json.dumps({**state, "run_id": "0" * 32}))  # as if copied in from another run
    warnings = _resumed_to_step_3(run, caplog)
    assert any(str(path) in w and "written by another run" in w for w in warnings), warnings
    assert json.loads((run / RESUMES).read_text().splitlines()[-1])["checkpoint"] == "step-000001"


def test_a_symlinked_checkpoint_is_named_at_resume_before_any_step_is_trained(trained, tmp_path, caplog):
    """Matrix 6 C5: a link in place of the newest checkpoint was skipped without a word, two steps were trained,
    then writing that step's checkpoint was refused."""
    run = _copy(trained, tmp_path / "run")
    outside = tmp_path / "elsewhere" / "step-000002"
    shutil.move(run / "checkpoints" / "step-000002", outside.parent.mkdir() or outside)
    (run / "checkpoints" / "step-000002").symlink_to(outside, target_is_directory=True)
    with pytest.raises(checkpoint.CheckpointError, match="step-000002 is a symbolic link"):
        run_train(load_resume_config(run, [], ["train.max_steps=3"]), resume=run)
    assert _steps(run) == [1, 2] and checkpoint.load(outside)  # nothing trained, the target untouched


def test_a_named_checkpoint_that_is_a_symbolic_link_is_refused_and_never_written_through(trained, tmp_path):
    """`--resume RUN/checkpoints/step-N` with step-N a link was read through it (after a warning saying it was not),
    and the end of its open epoch was then recorded in the link's target, the user's folder."""
    run = _copy(trained, tmp_path / "run")
    record = run / "checkpoints" / "step-000002" / checkpoint.TRAINER_STATE
    record.write_text(json.dumps({**json.loads(record.read_text()), "epoch": 0, "epoch_open": True}))  # as a stop
    outside = tmp_path / "elsewhere" / "step-000002"
    shutil.move(run / "checkpoints" / "step-000002", outside.parent.mkdir() or outside)
    (run / "checkpoints" / "step-000002").symlink_to(outside, target_is_directory=True)
    before = {p: p.read_bytes() for p in outside.rglob("*") if p.is_file()}
    with pytest.raises(checkpoint.CheckpointError, match="step-000002: a symbolic link"):
        run_train(load_resume_config(run, [], ["train.max_steps=3"]), resume=run / "checkpoints" / "step-000002")
    assert _steps(run) == [1, 2] and {p: p.read_bytes() for p in outside.rglob("*") if p.is_file()} == before
