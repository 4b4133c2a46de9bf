"""The demo's qualitative retrieval page (HN-CLIP Fig. 3 / A10): InfoNCE against HN-CLIP on SynthDense's test split,
the captions whose ground-truth rank differs most between the two arms (seed 0, final checkpoints), written by
analysis.compare into `<out>/compare_infonce_hn/` (compare.html with its thumbnails, compare.png, compare.json).

The test split is embedded once per arm (a few hundred images at the demo's size: small beside the arm's training).
"""

from __future__ import annotations

from pathlib import Path

import torch

from sharpclip import owned_files
from sharpclip.analysis.compare import Side, compare_rankings, write_compare
from sharpclip.config import DataConfig, ModelConfig
from sharpclip.data import read_samples
from sharpclip.devices import resolve_device
from sharpclip.eval.evaluator import model_embedder
from sharpclip.eval.retrieval import from_samples
from sharpclip.models.factory import create_model
from sharpclip.train.checkpoint import resolve_source

ARMS = (("infonce", "InfoNCE"), ("hn", "HN-CLIP"))  # (arm name in demo.plan, label on the page)
FOLDER = "compare_infonce_hn"


def check_folder(out: Path) -> None:
    """Refuse (owned_files.NotOurs, one line) a `<out>/compare_infonce_hn` that is a symbolic link or a file: a folder
    sharpclip names is never written through a link; writes nothing."""
    folder = out / FOLDER
    if folder.is_symlink() or (folder.exists() and not folder.is_dir()):
        owned_files.folder(folder, "--out", derived=True)  # raises its one line


def write_qualitative(run_dirs: dict[str, Path], data: DataConfig, out: Path, k: int = 5, n: int = 6) -> list[Path]:
    """The page, figure and numbers when both arms ran (else nothing); returns the files written."""
    if not all(arm in run_dirs for arm, _ in ARMS):
        return []
    dataset = from_samples("SynthDense test", read_samples(data, "test"))
    sides = []
    for arm, label in ARMS:
        model = create_model(ModelConfig(name=str(resolve_source(run_dirs[arm])))).eval()
        embed = model_embedder(model, batch_size=128, device=resolve_device("auto", "eval.device"))
        with torch.no_grad():
            sides.append(Side(label, embed.images(dataset.images), embed.texts(dataset.captions)))
    result = compare_rankings(sides[0], sides[1], dataset.caption_to_image, k, n)
    check_folder(out)
    return write_compare(result, dataset, out / FOLDER)
