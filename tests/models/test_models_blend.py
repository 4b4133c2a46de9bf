"""WiSE-FT weight blending: exact at both ends, linear in between, LoRA merged first, mismatches refused."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import torch

from _support.finetuned_run import finetuned_run as _finetuned
from _support.finetuned_run import init_checkpoint as _init
from sharpclip.cli import main
from sharpclip.models import create_model
from sharpclip.models.blend import BlendError, WeightBlend, blend_states, check_same_structure
from sharpclip.models.export import fixed_inputs


def _embed(model) -> tuple[torch.Tensor, torch.Tensor]:
    pixels, ids = fixed_inputs(model)
    with torch.no_grad():
        return model.encode_image(pixels).embedding, model.encode_text(ids).embedding


def test_alpha_zero_and_one_reproduce_each_model_exactly(tmp_path: Path) -> None:
    init = _init(tmp_path / "init")
    tuned, cfg = _finetuned(tmp_path / "run", init)
    start = create_model(replace(cfg, name=str(init))).eval()  # what the trainer started from: stretched to 134
    blend = WeightBlend(str(init), tmp_path / "run" / "checkpoints" / "step-000003")
    for got, want in zip(_embed(blend.at(0.0)), _embed(start), strict=True):
        assert torch.equal(got, want)
    for got, want in zip(_embed(blend.at(1.0)), _embed(tuned), strict=True):
        assert torch.equal(got, want)
    assert not torch.equal(_embed(blend.at(0.5))[1], _embed(tuned)[1])


def test_blend_is_linear_in_the_weights(tmp_path: Path) -> None:
    init = _init(tmp_path / "init")
    _finetuned(tmp_path / "run", init)
    blend = WeightBlend(str(init), tmp_path / "run" / "checkpoints" / "step-000003")
    at = {a: {k: v.clone() for k, v in blend.at(a).state_dict().items()} for a in (0.0, 0.3, 1.0)}
    moved = 0
    for key, start in at[0.0].items():
        if start.is_floating_point():
            torch.testing.assert_close(at[0.3][key], 0.7 * start + 0.3 * at[1.0][key], atol=1e-6, rtol=0)
            moved += not torch.equal(start, at[1.0][key])
    assert moved > 10  # the check covered tensors that really differ
    kept = "backbone.text_model.embeddings.position_embedding.kept"  # Long-CLIP's frozen rows: equal in both
    assert torch.equal(at[0.3][kept], at[0.0][kept])


def test_lora_is_merged_before_blending(tmp_path: Path) -> None:
    init = _init(tmp_path / "init")
    tuned, _ = _finetuned(tmp_path / "run", init, adapter="lora")
    blend = WeightBlend(str(init), tmp_path / "run" / "checkpoints" / "step-000003")
    assert not any("lora" in k for k in blend.end)
    for got, want in zip(_embed(blend.at(1.0)), _embed(tuned), strict=True):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=0)


def test_different_structures_are_refused_naming_the_tensors(tmp_path: Path) -> None:
    _finetuned(tmp_path / "run", _init(tmp_path / "init"))
    wide = _init(tmp_path / "wide", width=48)
    with pytest.raises(BlendError, match=r"differ in structure.*\(48"):
        WeightBlend(str(wide), tmp_path / "run" / "checkpoints" / "step-000003")
    with pytest.raises(BlendError, match="only in the fine-tuned model: extra"):
        check_same_structure({"a": torch.zeros(2)}, {"a": torch.zeros(2), "extra": torch.zeros(1)})
    with pytest.raises(BlendError, match="non-floating"):
        blend_states({"ids": torch.arange(3)}, {"ids": torch.arange(3) + 1}, 0.5)


def test_cli_blend_writes_a_loadable_checkpoint_and_refuses_a_non_empty_target(tmp_path: Path, capsys) -> None:
    init = _init(tmp_path / "init")
    _finetuned(tmp_path / "run", init)
    out = tmp_path / "blend"
    assert main(["blend", str(init), str(tmp_path / "run"), "--alpha", "0.5", "--to", str(out)]) == 0
    from sharpclip.models.factory import load_checkpoint

    reloaded = load_checkpoint(out)
    want = WeightBlend(str(init), tmp_path / "run" / "checkpoints" / "step-000003").at(0.5)
    for got, ref in zip(_embed(reloaded), _embed(want), strict=True):
        assert torch.equal(got, ref)
    capsys.readouterr()
    assert main(["blend", str(init), str(tmp_path / "run"), "--alpha", "0.5", "--to", str(out)]) == 2
    assert "not empty" in capsys.readouterr().err and (out / "model.safetensors").is_file()
    assert main(["blend", str(init), str(tmp_path / "run"), "--alpha", "0.25", "--to", str(out), "--force"]) == 0
    (out / "thesis.tex").write_text("years of work")  # --force replaces an earlier blend, never the user's files
    assert main(["blend", str(init), str(tmp_path / "run"), "--alpha", "0.5", "--to", str(out), "--force"]) == 2
    assert "thesis.tex" in capsys.readouterr().err and (out / "thesis.tex").is_file()
    assert main(["blend", str(init), str(tmp_path / "run"), "--alpha", "1.5", "--to", str(tmp_path / "x")]) == 2


def test_force_never_deletes_a_users_file_inside_a_blends_folder(tmp_path: Path) -> None:
    from sharpclip.analysis.wise_ft import BLEND_RECORD, _record, prepare_target

    out = tmp_path / "wise"
    (out / "best_alpha").mkdir(parents=True)
    (out / "best_alpha" / "model.safetensors").write_bytes(b"blend weights")
    (out / "wise_ft.json").write_text("{}")
    _record(out, [])  # as a sweep leaves it
    assert prepare_target(out, force=True) == out and not any(out.iterdir())  # its own output: replaced
    (out / "best_alpha").mkdir()
    (out / "best_alpha" / "model.safetensors").write_bytes(b"blend weights")
    _record(out, [])
    (out / "best_alpha" / "notes.txt").write_text("my notes on this alpha")  # the user's, since
    with pytest.raises(ValueError, match=r"best_alpha/notes\.txt"):
        prepare_target(out, force=True)
    assert (out / "best_alpha" / "notes.txt").read_text() == "my notes on this alpha"
    (out / "best_alpha" / "notes.txt").unlink()
    (out / BLEND_RECORD).write_text('{"written": ["best_alpha", "sharpclip_blend.json"]}')  # an older record
    with pytest.raises(ValueError, match=r"best_alpha/model\.safetensors"):
        prepare_target(out, force=True)
