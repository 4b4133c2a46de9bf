"""Export a trained model as a plain transformers folder, and prove the export computes the same embeddings.

`sharpclip export SRC --to DIR` where SRC is a sharpclip checkpoint (models.factory), a run directory (its newest
complete checkpoint under `checkpoints/`, or with `--best` the one `best.json` names: train.checkpoint.resolve_source
picks it) or a transformers folder. The export

1. merges LoRA/DoRA into the weights (peft `merge_and_unload`) and folds a stretched position table with frozen rows
   into one plain table (models.long_context);
2. writes `save_pretrained` weights + config, the tokenizer and the image processor, so that
   `transformers.AutoModel.from_pretrained(DIR)` loads it offline, anywhere, without sharpclip;
3. reloads DIR with `AutoModel` and compares image and text embeddings on fixed inputs: the largest absolute
   difference must be ≤ 1e-5 in float32, else `ExportError` (the folder is left for inspection).

`vision_only=True` writes the vision tower alone as a `CLIPVisionModel` / `SiglipVisionModel` folder (what LLaVA-style
models load) and compares its hidden states and pooled output.

The target DIR must be new or empty: a non-empty one is refused unless `force=True` (`--force`), which empties it
first (only after the model has loaded). Never allowed, even with force: a target inside a run's `checkpoints/`
(it would destroy or shadow a checkpoint), the source itself or a folder holding it, and a file.

A RoPE text tower has no stock transformers class (AutoModel would silently rebuild absolute positions), so a full
export of such a model is refused with an `ExportError`; export its vision tower, or keep the sharpclip checkpoint.
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor
from transformers import AutoModel

from sharpclip.config import ModelConfig
from sharpclip.models import adapters, long_context, rope
from sharpclip.models.factory import CHECKPOINT_CONFIG, create_model, load_checkpoint, save_processors
from sharpclip.models.hf import HFDualEncoder, wrap
from sharpclip.models.preprocessing import model_image_size

TOLERANCE = 1e-5


class ExportError(RuntimeError):
    """The export cannot be written faithfully, or its reload does not reproduce the model's embeddings."""


@dataclass
class ExportReport:
    directory: Path
    max_abs_diff: dict[str, float]  # per compared output (image, text or hidden states / pooled)

    def __str__(self) -> str:
        diffs = ", ".join(f"{k} {v:.2e}" for k, v in self.max_abs_diff.items())
        return f"exported to {self.directory}; reload max |Δ|: {diffs} (tolerance {TOLERANCE:g})"


def check_target(directory: Path, source: Path | None, force: bool) -> None:
    """Raise `ExportError` unless `directory` may receive an export (see the module docstring)."""
    target = directory.expanduser().resolve()
    if target.exists() and not target.is_dir():
        raise ExportError(f"--to {directory}: is a file; give a folder (new or empty) for the export")
    if any(_is_run_checkpoints(part) for part in (target, *target.parents)):
        raise ExportError(
            f"--to {directory}: inside a run's checkpoints/ folder, where an export would overwrite or pose as a "
            "checkpoint; export somewhere else (e.g. RUN/export)"
        )
    if source is not None:
        src = source.expanduser().resolve()
        if target == src or target in src.parents:
            raise ExportError(f"--to {directory}: is (or holds) the source {source}; export into another folder")
    if target.is_dir() and any(target.iterdir()) and not force:
        shown = ", ".join(sorted(p.name for p in target.iterdir())[:5])
        raise ExportError(
            f"--to {directory}: not empty ({shown}); an export beside old files would mix their weights and "
            "config. Choose a new folder, or pass --force to empty it first"
        )


def _is_run_checkpoints(folder: Path) -> bool:
    """A run's checkpoints/ folder: named so, beside the run's config.yaml or holding step-* / best.json."""
    if folder.name != "checkpoints" or not folder.is_dir():
        return False
    run = folder.parent
    return (run / "config.yaml").is_file() or any(folder.glob("step-*")) or (folder / "best.json").is_file()


def _empty(directory: Path) -> None:
    for child in directory.iterdir() if directory.is_dir() else ():
        shutil.rmtree(child) if child.is_dir() and not child.is_symlink() else child.unlink()


def load_for_export(source: str | Path) -> HFDualEncoder:
    """The model at `source` (a sharpclip checkpoint or a transformers folder), as sharpclip loads it."""
    path = Path(source)
    if (path / CHECKPOINT_CONFIG).is_file():
        return load_checkpoint(path)
    return create_model(ModelConfig(name=str(path)))


def make_plain(model: HFDualEncoder) -> HFDualEncoder:
    """Merge adapters and fold kept positions in place (the backbone becomes a stock transformers model)."""
    adapters.merge_adapters(model)
    long_context.fold_kept_positions(model.text_model)
    return model


def export_model(
    source: str | Path | HFDualEncoder,
    directory: str | Path,
    vision_only: bool = False,
    force: bool = False,
) -> ExportReport:
    """Write DIR (see the module docstring) and return the reload check; raises ExportError above tolerance.

    source: a model, a sharpclip checkpoint or a transformers folder (a run directory is resolved to one of its
    checkpoints first, by train.checkpoint.resolve_source).
    force: empty a non-empty DIR first (never a checkpoint folder, the source, or a folder holding it).
    The reference embeddings come from the model as loaded (adapters unmerged), so the check covers the merge too.
    """
    directory = Path(directory)
    source_path = None if isinstance(source, HFDualEncoder) else Path(source)
    check_target(directory, source_path, force)
    model = source if isinstance(source, HFDualEncoder) else load_for_export(source)
    model = model.float().eval()
    if not vision_only and rope.is_rope(model.text_model):
        raise ExportError(
            "this model's text tower uses RoPE, which stock transformers cannot rebuild from config.json; "
            "export the vision tower (--vision-only) or use the sharpclip checkpoint with sharpclip.models"
        )
    if vision_only and type(model.hf_model).__name__ == "Siglip2Model":
        raise ExportError("vision-only export supports CLIP and SigLIP (fixed resolution) towers, not SigLIP 2 NaFlex")
    outputs = _vision_outputs if vision_only else _dual_outputs
    pixels, ids = fixed_inputs(model)
    reference = outputs(model, pixels, ids)
    if force:
        _empty(directory)
    make_plain(model)
    if vision_only:
        model.vision_model.save_pretrained(directory)
    else:
        model.hf_model.save_pretrained(directory)
        save_processors(model, directory)
    if vision_only and model.image_processor is not None:
        model.image_processor.save_pretrained(directory)
    reloaded = AutoModel.from_pretrained(directory, local_files_only=True).float().eval()
    got = outputs(reloaded if vision_only else wrap(reloaded), pixels, ids)
    return _check(ExportReport(directory, {k: _maxdiff(reference[k], got[k]) for k in reference}))


@torch.no_grad()
def _dual_outputs(model: HFDualEncoder, pixels: Tensor, ids: Tensor) -> dict[str, Tensor]:
    return {"image": model.encode_image(pixels).embedding, "text": model.encode_text(ids).embedding}


@torch.no_grad()
def _vision_outputs(model: HFDualEncoder | torch.nn.Module, pixels: Tensor, ids: Tensor) -> dict[str, Tensor]:
    vision = model.vision_model if isinstance(model, HFDualEncoder) else model
    out = vision(pixel_values=pixels)
    return {"last_hidden_state": out.last_hidden_state, "pooler_output": out.pooler_output}


def fixed_inputs(model: HFDualEncoder, batch: int = 4, seed: int = 0) -> tuple[Tensor, Tensor]:
    """Deterministic test inputs: standard-normal images (B, 3, S, S) and random captions ending in eos (B, L).

    L is the whole text context (`max_position_embeddings`), so every position row, stretched ones included, shapes
    the compared embeddings: a corrupted row anywhere fails the check.
    """
    gen = torch.Generator().manual_seed(seed)
    size = model_image_size(model)
    pixels = torch.randn(batch, 3, size, size, generator=gen)
    tcfg = model.text_model.config
    ids = torch.randint(0, tcfg.vocab_size - 2, (batch, tcfg.max_position_embeddings), generator=gen)
    if tcfg.eos_token_id is not None and 0 <= tcfg.eos_token_id < tcfg.vocab_size:
        ids[ids == tcfg.eos_token_id] = 0
        ids[:, -1] = tcfg.eos_token_id
    return pixels, ids


def _maxdiff(a: Tensor, b: Tensor) -> float:
    return (a.float() - b.float()).abs().max().item()


def _check(report: ExportReport) -> ExportReport:
    worst = max(report.max_abs_diff.values())
    if not worst <= TOLERANCE:  # also catches NaN
        raise ExportError(f"reloaded export differs from the model: {report}")
    return report
