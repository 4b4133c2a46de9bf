"""Export a trained model as a plain transformers folder, and prove the export computes the same embeddings.

`sharpclip export SRC --to DIR` where SRC is a sharpclip checkpoint (models.factory), a run directory (its newest
complete checkpoint under `checkpoints/`, or with `--best` the one `best.json` names: train.checkpoint.resolve_source
picks it) or a transformers folder. The export

1. merges LoRA/DoRA into the weights (peft `merge_and_unload`) and folds a stretched position table with frozen rows
   into one plain table (models.long_context);
2. writes `save_pretrained` weights + config, the tokenizer and the image processor, so that
   `transformers.AutoModel.from_pretrained(DIR)` loads it offline, anywhere, without sharpclip;
3. reloads the folder with `AutoModel` and compares image and text embeddings on fixed inputs: the largest absolute
   difference must be ≤ 1e-5 in float32, else `ExportError` (the folder is left for inspection, under its
   temporary name).

Everything is written into a temporary sibling folder (`.DIR.export-tmp`), checked there, recorded in
`sharpclip_export.json` (the files written and the check's differences) and only then renamed to DIR, so a killed
export never leaves a folder at DIR that loads without having passed the check.

`vision_only=True` writes the vision tower alone as a `CLIPVisionModel` / `SiglipVisionModel` folder (what LLaVA-style
models load) and compares its hidden states and pooled output.

The target DIR must be new or empty: a non-empty one is refused unless `force=True` (`--force`) and it is an earlier
sharpclip export (it holds `sharpclip_export.json`) holding nothing but the files that export wrote; `--force`
then replaces exactly those files once the new export has passed its check. Anything else in DIR (another run, a
user's files, subfolders) is refused, naming what was found. Never allowed, even with force: a target inside a
run's `checkpoints/` (it would destroy or shadow a checkpoint), the source itself or a folder holding it, a file.

A RoPE text tower has no stock transformers class (AutoModel would silently rebuild absolute positions), so a full
export of such a model is refused with an `ExportError`; export its vision tower, or keep the sharpclip checkpoint.
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError
from torch import Tensor
from transformers import AutoModel

from sharpclip.config import ModelConfig
from sharpclip.models import adapters, long_context, rope
from sharpclip.models.factory import CHECKPOINT_CONFIG, create_model, load_checkpoint, save_processors
from sharpclip.models.hf import HFDualEncoder, wrap
from sharpclip.models.preprocessing import model_image_size

TOLERANCE = 1e-5
EXPORT_RECORD = "sharpclip_export.json"  # written last into every export: the files it holds and the reload check
CARD = "README.md"  # the model card (sharpclip.model_card), what the Hugging Face Hub shows


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
    found = sorted(p.name for p in target.iterdir()) if target.is_dir() else []
    if found and not force:
        hint = "pass --force to replace that earlier export" if earlier_export(target) else "choose a new folder"
        raise ExportError(
            f"--to {directory}: not empty ({_shown(found)}); an export beside old files would mix their weights and "
            f"config: {hint}"
        )
    if found and (extra := _not_exported(target)):
        raise ExportError(
            f"--to {directory}: --force replaces only an earlier sharpclip export ({EXPORT_RECORD} and the files it "
            f"lists), but this folder holds {_shown(extra)}; refusing to delete them: choose a new folder"
        )


def _shown(names: list[str]) -> str:
    return ", ".join(names[:5]) + (f", ... ({len(names)} in all)" if len(names) > 5 else "")


def earlier_export(folder: Path) -> list[str] | None:
    """The files an earlier sharpclip export wrote into `folder` (its record included), or None without a record."""
    try:
        record = json.loads((folder / EXPORT_RECORD).read_text())
        files = [str(f) for f in record["files"]]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    if any(Path(f).name != f or f in ("", ".", "..") for f in files):  # a name that leaves the folder: not an export's
        return None
    return [*files, EXPORT_RECORD]


def _not_exported(folder: Path) -> list[str]:
    """What `folder` holds beyond an earlier export's own files (everything, without a record)."""
    ours = set(earlier_export(folder) or ())
    return sorted(p.name for p in folder.iterdir() if p.name not in ours or p.is_symlink() or not p.is_file())


def _is_run_checkpoints(folder: Path) -> bool:
    """A run's checkpoints/ folder: named so, beside the run's config.yaml or holding step-* / best.json."""
    if folder.name != "checkpoints" or not folder.is_dir():
        return False
    run = folder.parent
    return (run / "config.yaml").is_file() or any(folder.glob("step-*")) or (folder / "best.json").is_file()


def _publish(tmp: Path, directory: Path) -> None:
    """Move the checked export `tmp` to `directory`, replacing an earlier export's own files (check_target made
    sure there is nothing else)."""
    if directory.is_dir():
        for name in earlier_export(directory) or ():
            (directory / name).unlink(missing_ok=True)
        directory.rmdir()  # empty now: the rename below is then atomic
    os.replace(tmp, directory)


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
    card: tuple[str, dict] | None = None,
) -> ExportReport:
    """Write DIR (see the module docstring) and return the reload check; raises ExportError above tolerance.

    source: a model, a sharpclip checkpoint or a transformers folder (a run directory is resolved to one of its
    checkpoints first, by train.checkpoint.resolve_source).
    force: replace an earlier sharpclip export at DIR (never anything else, a checkpoint folder, the source, or a
    folder holding it).
    The reference embeddings come from the model as loaded (adapters unmerged), so the check covers the merge too.
    card: (README.md text, provenance record) from sharpclip.model_card, written into the folder and the record.
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
    make_plain(model)
    tmp = directory.parent / f".{directory.name}.export-tmp"
    shutil.rmtree(tmp, ignore_errors=True)  # a killed export's leftovers (our own temporary name)
    try:
        _write(model, tmp, vision_only)
        reloaded = AutoModel.from_pretrained(tmp, local_files_only=True).float().eval()
        got = outputs(reloaded if vision_only else wrap(reloaded), pixels, ids)
        report = ExportReport(directory, {k: _maxdiff(reference[k], got[k]) for k in reference})
        if not max(report.max_abs_diff.values()) <= TOLERANCE:  # also catches NaN
            raise ExportError(f"reloaded export differs from the model: {report}; left for inspection in {tmp}")
        if card is not None:
            (tmp / CARD).write_text(card[0], encoding="utf-8")
        files = sorted(p.name for p in tmp.iterdir())
        record = {"files": files, "max_abs_diff": report.max_abs_diff, "tolerance": TOLERANCE}
        record.update({"provenance": card[1]} if card is not None else {})
        (tmp / EXPORT_RECORD).write_text(json.dumps(record, indent=2) + "\n")
        _publish(tmp, directory)
    except (OSError, SafetensorError) as err:  # disk full, read-only target: no half-written folder stays behind
        shutil.rmtree(tmp, ignore_errors=True)
        if isinstance(err, OSError):
            raise
        reason = "no space left on device" if "no space left" in str(err).lower() else " ".join(str(err).split())
        raise OSError(f"cannot write the export to {directory}: {reason}") from None  # safetensors' own error type
    return report


def _write(model: HFDualEncoder, directory: Path, vision_only: bool) -> None:
    if vision_only:
        model.vision_model.save_pretrained(directory)
    else:
        model.hf_model.save_pretrained(directory)
        save_processors(model, directory)
    if vision_only and model.image_processor is not None:
        model.image_processor.save_pretrained(directory)


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
