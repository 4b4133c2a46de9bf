"""Export targets and model loading: no export over old files unless --force, which replaces only an earlier
export's own files (never another run or a user's files); a killed export leaves nothing at the target; never into
a run's checkpoints/ or onto its source or a file; weights that do not fit their model, and
corrupt safetensors, are errors naming the keys or the file; no message suggests weights_only=False."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from sharpclip.cli import main
from sharpclip.config import ModelConfig
from sharpclip.models import create_model, export, save_checkpoint
from sharpclip.models.export import EXPORT_RECORD, ExportError, export_model
from sharpclip.train import checkpoint


@pytest.fixture
def ckpt(tmp_path):
    """A sharpclip checkpoint of the tiny CLIP inside a run directory's checkpoints/."""
    cfg = ModelConfig()
    model = create_model(cfg)
    path = checkpoint.save(tmp_path / "run" / "checkpoints", 1, lambda d: save_checkpoint(model, d, cfg), {}, {})
    (tmp_path / "run" / "config.yaml").write_text("{}\n")
    return path


def test_a_non_empty_target_is_refused_and_force_replaces_only_an_earlier_export(ckpt, tmp_path, capsys):
    target = tmp_path / "hf"
    export_model(ckpt, target)
    record = json.loads((target / EXPORT_RECORD).read_text())
    assert "config.json" in record["files"] and "model.safetensors" in record["files"]
    (target / "model.safetensors").write_bytes(b"stale weights of an older export")
    capsys.readouterr()
    assert main(["export", str(ckpt), "--to", str(target)]) == 1
    err = capsys.readouterr().err
    assert "not empty" in err and "--force" in err and err.count("\n") == 1
    assert (target / "model.safetensors").read_bytes() == b"stale weights of an older export"  # left alone
    assert main(["export", str(ckpt), "--to", str(target), "--force"]) == 0
    assert (target / "model.safetensors").read_bytes() != b"stale weights of an older export"
    assert sorted(p.name for p in target.iterdir()) == sorted([*record["files"], "README.md", EXPORT_RECORD])  # + card


def _user_folder(folder: Path) -> None:
    (folder / "mydata").mkdir(parents=True)
    (folder / "mydata" / "a.csv").write_text("1,2\n")
    (folder / "thesis.tex").write_text("years of work")


def test_force_refuses_another_run_or_a_folder_of_user_files_and_names_them(ckpt, tmp_path, capsys):
    users = tmp_path / "users"
    _user_folder(users)
    other_run = ckpt.parent.parent  # a run directory: config.yaml, checkpoints/
    for target, shown in ((users, "mydata, thesis.tex"), (other_run, "checkpoints, config.yaml")):
        before = sorted(p.relative_to(target) for p in target.rglob("*"))
        capsys.readouterr()
        assert main(["export", str(_other_ckpt(tmp_path)), "--to", str(target), "--force"]) == 1
        err = capsys.readouterr().err
        assert shown in err and "refusing to delete" in err and "--force" not in err.split("refusing")[1]
        assert sorted(p.relative_to(target) for p in target.rglob("*")) == before
    exported = tmp_path / "hf"
    export_model(ckpt, exported)
    (exported / "notes.txt").write_text("mine")  # an earlier export with a file of the user's in it
    with pytest.raises(ExportError, match=r"notes\.txt"):
        export_model(ckpt, exported, force=True)
    assert (exported / "notes.txt").is_file() and (exported / "config.json").is_file()


def _other_ckpt(tmp_path: Path) -> Path:
    cfg = ModelConfig()
    folder = tmp_path / "elsewhere" / "model"
    if not folder.is_dir():
        save_checkpoint(create_model(cfg), folder, cfg)
    return folder


def test_a_killed_export_leaves_nothing_at_the_target_and_the_next_export_goes_through(ckpt, tmp_path, monkeypatch):
    target = tmp_path / "hf"

    def killed(*args, **kwargs):  # the process dies while the folder is being checked
        raise KeyboardInterrupt

    monkeypatch.setattr(export, "AutoModel", type("Killed", (), {"from_pretrained": staticmethod(killed)}))
    with pytest.raises(KeyboardInterrupt):
        export_model(ckpt, target)
    assert not target.exists()  # nothing that loads without having passed the check
    assert (tmp_path / ".hf.export-tmp" / "config.json").is_file()  # the unchecked write, under its temporary name
    monkeypatch.undo()
    print(export_model(ckpt, target))
    assert (target / EXPORT_RECORD).is_file() and not (tmp_path / ".hf.export-tmp").exists()


def test_a_target_inside_a_runs_checkpoints_is_refused_even_with_force(ckpt, tmp_path):
    before = sorted(p.name for p in ckpt.iterdir())
    for target in (ckpt, ckpt.parent / "export", ckpt.parent):
        with pytest.raises(ExportError, match="checkpoints/"):
            export_model(ckpt, target, force=True)
    assert sorted(p.name for p in ckpt.iterdir()) == before


def test_the_source_a_folder_holding_it_or_a_file_are_refused(ckpt, tmp_path):
    hf = tmp_path / "hf"
    export_model(ckpt, hf)
    with pytest.raises(ExportError, match="is \\(or holds\\) the source"):
        export_model(hf, hf, force=True)
    with pytest.raises(ExportError, match="is \\(or holds\\) the source"):
        export_model(hf, tmp_path, force=True)
    (tmp_path / "file").write_text("x")
    with pytest.raises(ExportError, match="is a file"):
        export_model(ckpt, tmp_path / "file")
    assert (hf / "config.json").is_file()


def _hf_folder(tmp_path, ckpt):
    hf = tmp_path / "hf"
    export_model(ckpt, hf)
    return hf, next(hf.glob("*.safetensors"))


def test_weights_that_do_not_fit_the_model_are_an_error_naming_the_keys(ckpt, tmp_path):
    hf, weights = _hf_folder(tmp_path, ckpt)
    state = load_file(str(weights))
    state["renamed.text_projection.weight"] = state.pop("text_projection.weight")
    save_file(state, str(weights), metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"text_projection\.weight") as err:
        create_model(ModelConfig(name=str(hf)))
    assert "missing keys" in str(err.value) and "unexpected keys" in str(err.value)


def test_a_truncated_safetensors_file_is_an_error_naming_it(ckpt, tmp_path):
    hf, weights = _hf_folder(tmp_path, ckpt)
    weights.write_bytes(weights.read_bytes()[:1000])
    with pytest.raises(ValueError, match=str(weights)):
        create_model(ModelConfig(name=str(hf)))
    own = ckpt / "model.safetensors"
    own.write_bytes(b"\xff" * 64)  # a bad header in a sharpclip checkpoint
    with pytest.raises(ValueError, match=str(own)):
        create_model(ModelConfig(name=str(ckpt)))


def test_an_unsafe_training_state_is_refused_without_suggesting_weights_only_false(ckpt):
    torch.save({"optimizer": torch.nn.Linear(2, 2)}, ckpt / checkpoint.TRAINING_STATE)  # a pickled module
    with pytest.raises(checkpoint.CorruptCheckpoint) as err:
        checkpoint.load_training_state(ckpt)
    assert str(ckpt / checkpoint.TRAINING_STATE) in str(err.value)
    assert "weights_only=False" not in str(err.value) and "weights_only" not in str(err.value)


class _Payload:
    """A pickle that would run code when loaded unsafely."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (Path.touch, (self.marker,))


def test_a_pickle_payload_in_a_transformers_folder_is_refused_in_one_line_without_unsafe_advice(tmp_path, capsys):
    folder = tmp_path / "hf"
    create_model(ModelConfig()).hf_model.save_pretrained(folder)
    (folder / "model.safetensors").unlink()
    marker = tmp_path / "ran"
    torch.save({"weight": _Payload(marker)}, folder / "pytorch_model.bin")
    with pytest.raises(ValueError, match="hold objects other than tensors") as err:
        create_model(ModelConfig(name=str(folder)))
    assert "weights_only" not in str(err.value) and not marker.exists()
    assert main(["eval", "--model", str(folder), "--suite", "retrieval"]) == 2
    out = capsys.readouterr().err
    assert "hold objects other than tensors" in out and "weights_only" not in out and not marker.exists()


def test_force_never_deletes_outside_the_target_by_a_hand_edited_record(ckpt, tmp_path):
    target = tmp_path / "hf"
    export_model(ckpt, target)
    (tmp_path / "thesis.tex").write_text("years of work")
    (tmp_path / "abs.txt").write_text("mine too")
    record = json.loads((target / EXPORT_RECORD).read_text())
    record["files"] += ["../thesis.tex", str(tmp_path / "abs.txt")]  # names that climb out of the export's folder
    (target / EXPORT_RECORD).write_text(json.dumps(record))
    with pytest.raises(ExportError, match="refusing to delete"):
        export_model(ckpt, target, force=True)
    assert (tmp_path / "thesis.tex").read_text() == "years of work" and (tmp_path / "abs.txt").read_text() == "mine too"
