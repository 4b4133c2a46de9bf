"""Export targets and model loading: no export over old files unless --force (which empties
first), never into a run's checkpoints/ or onto its source or a file; weights that do not fit their model, and
corrupt safetensors, are errors naming the keys or the file; no message suggests weights_only=False."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file, save_file

from sharpclip.cli import main
from sharpclip.config import ModelConfig
from sharpclip.models import create_model, save_checkpoint
from sharpclip.models.export import ExportError, export_model
from sharpclip.train import checkpoint


@pytest.fixture
def ckpt(tmp_path):
    """A sharpclip checkpoint of the tiny CLIP inside a run directory's checkpoints/."""
    cfg = ModelConfig()
    model = create_model(cfg)
    path = checkpoint.save(tmp_path / "run" / "checkpoints", 1, lambda d: save_checkpoint(model, d, cfg), {}, {})
    (tmp_path / "run" / "config.yaml").write_text("{}\n")
    return path


def test_a_non_empty_target_is_refused_and_force_empties_it_first(ckpt, tmp_path, capsys):
    target = tmp_path / "hf"
    target.mkdir()
    (target / "model-00001-of-00002.safetensors").write_bytes(b"stale shard of an older export")
    assert main(["export", str(ckpt), "--to", str(target)]) == 1
    err = capsys.readouterr().err
    assert "not empty" in err and "--force" in err and err.count("\n") == 1
    assert (target / "model-00001-of-00002.safetensors").is_file()  # left alone
    assert main(["export", str(ckpt), "--to", str(target), "--force"]) == 0
    assert not (target / "model-00001-of-00002.safetensors").exists()
    assert (target / "config.json").is_file()


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
