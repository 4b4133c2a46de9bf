"""`sharpclip export`: an AutoModel-loadable folder from a checkpoint, checked to 1e-5; vision-only; failures."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoImageProcessor, AutoModel, AutoTokenizer, CLIPModel, CLIPVisionModel

from sharpclip.cli import main
from sharpclip.config import AdapterConfig, ModelConfig
from sharpclip.models import create_model, save_checkpoint
from sharpclip.models import export as export_mod
from sharpclip.models.export import ExportError, export_model
from sharpclip.train import checkpoint
from sharpclip.train.checkpoint import CheckpointError, resolve_source


def _trained_checkpoint(path, method: str = "dora", step: int = 2):
    """A run directory in the trainer's layout: `path/checkpoints/step-00000N/` written by train.checkpoint.save."""
    cfg = ModelConfig(context_length=248, adapter=AdapterConfig(method=method, rank=4))
    model = create_model(cfg)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n or "position_embedding.weight" in n:
                p.add_(0.1 * torch.randn_like(p))
    checkpoint.save(path / "checkpoints", step, lambda d: save_checkpoint(model, d, cfg), {}, {"step": step})
    return model


def test_export_from_a_run_directory_loads_with_automodel_offline(tmp_path, capsys) -> None:
    model = _trained_checkpoint(tmp_path / "run")
    assert main(["export", str(tmp_path / "run"), "--to", str(tmp_path / "hf")]) == 0
    assert "reload max |Δ|" in capsys.readouterr().out
    hf = AutoModel.from_pretrained(tmp_path / "hf", local_files_only=True)
    assert type(hf) is CLIPModel and hf.config.text_config.max_position_embeddings == 248
    tok = AutoTokenizer.from_pretrained(tmp_path / "hf", local_files_only=True)
    assert AutoImageProcessor.from_pretrained(tmp_path / "hf", local_files_only=True) is not None
    ids = tok(["a red square " * 90], truncation=True, return_tensors="pt")["input_ids"]
    assert ids.shape[1] == 248
    with torch.no_grad():
        want = model.eval().encode_text(ids).embedding
        got = torch.nn.functional.normalize(hf.get_text_features(input_ids=ids).pooler_output, dim=-1)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)


def test_vision_only_export_is_a_clip_vision_model(tmp_path) -> None:
    _trained_checkpoint(tmp_path / "run", method="lora")
    report = export_model(tmp_path / "run" / "checkpoints" / "step-000002", tmp_path / "vision", vision_only=True)
    assert max(report.max_abs_diff.values()) <= 1e-5
    assert type(AutoModel.from_pretrained(tmp_path / "vision", local_files_only=True)) is CLIPVisionModel


def test_export_fails_when_the_reload_differs(tmp_path, monkeypatch) -> None:
    real = AutoModel.from_pretrained

    def corrupted(*args, **kwargs):
        model = real(*args, **kwargs)
        with torch.no_grad():
            model.visual_projection.weight[0, 0] += 1e-3  # a uniform scale would vanish in the norm
        return model

    monkeypatch.setattr(export_mod.AutoModel, "from_pretrained", corrupted)
    with pytest.raises(ExportError, match="differs"):
        export_model(create_model(ModelConfig()), tmp_path / "bad")


def test_rope_text_tower_refuses_a_full_export(tmp_path) -> None:
    with pytest.raises(ExportError, match="RoPE"):
        export_model(create_model(ModelConfig(text_encoder="rope")), tmp_path / "x")


def test_export_fails_when_a_stretched_position_row_differs(tmp_path, monkeypatch) -> None:
    real = AutoModel.from_pretrained

    def corrupted(*args, **kwargs):
        model = real(*args, **kwargs)
        with torch.no_grad():  # rows past the kept ones and past a short test caption (not uniform: LayerNorm)
            rows = model.text_model.embeddings.position_embedding.weight[30:]
            rows += 1e-2 * torch.randn(rows.shape, generator=torch.Generator().manual_seed(0))
        return model

    monkeypatch.setattr(export_mod.AutoModel, "from_pretrained", corrupted)
    with pytest.raises(ExportError, match="differs"):
        export_model(create_model(ModelConfig(context_length=248)), tmp_path / "bad")


def test_a_run_exports_its_newest_complete_checkpoint_or_with_best_its_best(tmp_path, capsys) -> None:
    run = tmp_path / "run"
    interrupted = run / "checkpoints" / ".step-000006.tmp"
    save_checkpoint(create_model(ModelConfig()), interrupted, ModelConfig())  # model written, trainer state not yet
    with pytest.raises(CheckpointError, match="complete checkpoints/step-"):
        resolve_source(run)
    _trained_checkpoint(run, "lora", step=2)
    _trained_checkpoint(run, "lora", step=4)
    assert resolve_source(run) == run / "checkpoints" / "step-000004"
    with pytest.raises(CheckpointError, match=r"best\.json"):
        resolve_source(run, best=True)
    checkpoint.mark_best(run / "checkpoints", run / "checkpoints" / "step-000002", 0.5)
    assert resolve_source(run, best=True) == run / "checkpoints" / "step-000002"
    assert main(["export", str(run), "--best", "--to", str(tmp_path / "hf"), "--vision-only"]) == 0
    assert "reload max |Δ|" in capsys.readouterr().out


def test_export_of_a_model_that_cannot_load_is_a_one_line_error(tmp_path, capsys) -> None:
    (tmp_path / "broken").mkdir()
    (tmp_path / "broken" / "config.json").write_text("{}")  # not a model transformers knows
    assert main(["export", str(tmp_path / "broken"), "--to", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("sharpclip export: ") and err.count("\n") == 1 and "Traceback" not in err
    assert main(["export", str(tmp_path / "nothing"), "--to", str(tmp_path / "out")]) == 1
    assert "neither a sharpclip checkpoint" in capsys.readouterr().err


def test_the_exported_tokenizer_knows_the_stretched_context_and_pads_without_a_warning(tmp_path) -> None:
    """A long-context model whose tokenizer was last called as training calls it (truncated and padded to 77, which
    a fast tokenizer keeps in tokenizer.json): the export reloads with model_max_length 248, no fixed max_length, and
    `processor(text, padding=True)` pads to the longest caption without transformers' warning."""
    import warnings

    from PIL import Image
    from transformers import AutoProcessor

    model = create_model(ModelConfig(context_length=248))
    model.tokenizer(["a photo"], padding="max_length", truncation=True, max_length=77)  # what a batch leaves behind
    save_checkpoint(model, tmp_path / "ckpt", ModelConfig(context_length=248))
    export_model(tmp_path / "ckpt", tmp_path / "out")
    tokenizer = AutoTokenizer.from_pretrained(tmp_path / "out", local_files_only=True)
    assert tokenizer.model_max_length == 248 and "max_length" not in tokenizer.init_kwargs
    processor = AutoProcessor.from_pretrained(tmp_path / "out", local_files_only=True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        batch = processor(text=["a photo", "a photo of a photo"], images=[Image.new("RGB", (32, 32))] * 2,
                          padding=True, return_tensors="pt")  # fmt: skip
    assert not [str(w.message) for w in caught if "max_length" in str(w.message)]
    assert batch["input_ids"].shape[1] < 77  # padded to the longest caption, not to a fixed length
    long = processor(text=["photo " * 300], truncation=True, return_tensors="pt")
    assert long["input_ids"].shape[1] == 248  # truncation stops at the model's own context


def test_an_export_onto_a_full_disk_is_one_line_and_leaves_no_partial_folder(tmp_path, capsys, monkeypatch) -> None:
    """Matrix 6 D2: safetensors reports a full disk as its own SafetensorError (a 20-line traceback before)."""
    from safetensors import SafetensorError

    _trained_checkpoint(tmp_path / "run", method="lora")
    (tmp_path / "notes.txt").write_text("the user's")

    def full(model, directory, vision_only):
        directory.mkdir(parents=True)
        (directory / "config.json").write_text("{}")  # what got written before the disk filled
        raise SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")

    monkeypatch.setattr(export_mod, "_write", full)
    assert main(["export", str(tmp_path / "run"), "--to", str(tmp_path / "exp")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"sharpclip export: cannot write the export to {tmp_path / 'exp'}: no space left on device"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes.txt", "run"]  # no .exp.export-tmp, no exp


def test_an_export_of_a_run_carries_a_model_card_that_loads_back(tmp_path, capsys) -> None:
    import json

    from huggingface_hub import ModelCard

    from sharpclip.config import load_config, to_yaml

    run = tmp_path / "run"
    _trained_checkpoint(run)
    cfg = load_config(None, ["loss.terms:={hn: {loss: hn_clip, params: {gamma: 0.25}}}", "train.seed=3",
                             f"train.output_dir={run}"])  # fmt: skip
    (run / "config.yaml").write_text(to_yaml(cfg))
    (run / "eval" / "step-000002").mkdir(parents=True)
    report = {"docci": {"task": "retrieval", "t2i": {"R@1": 41.5}, "i2t": {"R@1": 43.5}}}
    (run / "eval" / "step-000002" / "eval_report.json").write_text(json.dumps(report))
    manifest = {"model": {"name": "x"}, "datasets": {"docci": {"files": [{"path": "/d/test.json", "sha256": "ab12"}]}}}
    (run / "eval" / "step-000002" / "eval_manifest.json").write_text(json.dumps(manifest))
    args = ["export", str(run), "--to", str(tmp_path / "hf"), "--license", "mit", "--base-model",
            "openai/clip-vit-base-patch16", "--dataset", "google/docci"]  # fmt: skip
    assert main(args) == 0
    card = ModelCard.load(tmp_path / "hf" / "README.md")
    assert card.data.library_name == "transformers" and card.data.pipeline_tag == "zero-shot-image-classification"
    assert card.data.license == "mit" and card.data.base_model == "openai/clip-vit-base-patch16"
    assert card.data.datasets == ["google/docci"] and "hn_clip" in card.data.tags
    results = {r.metric_type: r.metric_value for r in card.data.eval_results}
    assert results == {"T→I R@1": 41.5, "I→T R@1": 43.5, "mean R@1": 42.5}
    assert "| step | `2` |" in card.text and "hn_clip γ=0.25" in card.text and "`ab12`" in card.text
    assert "train.seed=3" in card.text  # the settings that differ from the defaults, as overrides
    record = json.loads((tmp_path / "hf" / "sharpclip_export.json").read_text())
    assert "README.md" in record["files"] and record["provenance"]["step"] == 2
    assert record["provenance"]["objective"] == "hn_clip γ=0.25" and len(record["provenance"]["recipe_sha256"]) == 64
    assert record["provenance"]["license"] == "mit" and record["provenance"]["eval"] == report
