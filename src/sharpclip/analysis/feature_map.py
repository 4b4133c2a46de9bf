"""`sharpclip analyze feature-map IMAGE --text CAPTION`: patch feature maps (CLIP-IN Fig. 3) of one or two models.

For each model: the image as its preprocessing makes it (resize, centre crop: the map is drawn over that crop, and the
crop is outlined on the full image in the first panel), the caption embedded as `eval` embeds it,
the cosine of every patch with the caption by Zhou et al.'s dense features (analysis.dense), upsampled bilinearly to
the image (as MaskCLIP upsamples its logits) and drawn over it, warm = high. The cosine maps are low-contrast and
their range differs between models, so each is min–max normalised for colour and its raw range is printed above it;
the best patch is outlined. Files written into `out`:

    feature_map.png     the image, then one overlay per model, side by side
    feature_map.json    the caption, the dense path, and per model: the (H/p, W/p) cosine grid, its min / max, the
                        best patch (row, column), the crop it covers in the image's pixels (x, y, w, h)
    feature_map.html    a self-contained page: the caption (escaped), the PNG beside it, the numbers as a table
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import numpy as np
import torch
import torch.nn.functional as F
from matplotlib.patches import Rectangle

from sharpclip import owned_files
from sharpclip.analysis.dense import patch_similarity
from sharpclip.analysis.pages import Markup, Page, escape, tag
from sharpclip.config import load_config
from sharpclip.data.images import to_rgb
from sharpclip.eval.embed import load_image
from sharpclip.eval.evaluator import model_embedder
from sharpclip.models.factory import create_model
from sharpclip.models.preprocessing import model_transforms
from sharpclip.train.checkpoint import model_source

STEM = "feature_map"


@dataclass
class FeatureMap:
    """One model's map. view: (S, S, 3) uint8, the image as the model sees it; cos: (H/p, W/p) patch cosines."""

    label: str
    view: np.ndarray
    cos: torch.Tensor
    crop: tuple[float, float, float, float] = (0.0, 0.0, 0.0, 0.0)  # (x, y, w, h) of the view in the image's pixels

    @property
    def best(self) -> tuple[int, int]:
        """(row, column) of the patch most similar to the caption."""
        flat = int(self.cos.argmax())
        return flat // self.cos.shape[1], flat % self.cos.shape[1]

    def upsampled(self) -> np.ndarray:
        """(S, S) cosines, bilinear (align_corners=False) from the patch grid to the view's pixels."""
        size = self.view.shape[:2]
        return F.interpolate(self.cos[None, None], size=size, mode="bilinear", align_corners=False)[0, 0].numpy()


def compute_feature_map(model: Any, label: str, image: Any, caption: str, path: str = "maskclip") -> FeatureMap:
    """`model`'s map of `caption` over `image` (a PIL image), on the model's device, in eval mode (no dropout)."""
    preprocess = model_transforms(model).image
    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    try:
        text = model_embedder(model, progress=False).texts([caption])[0]
        cos = patch_similarity(model, preprocess(image)[None].to(device), text, path)[0].cpu()
    finally:
        model.train(was_training)
    resized = preprocess.resize(to_rgb(image, preprocess.alpha))
    view = np.asarray(preprocess.center_crop(resized))
    return FeatureMap(label, view, cos, crop_box(image.size, resized.size, view.shape[1::-1]))


def crop_box(original: tuple[int, int], resized: tuple[int, int], view: tuple[int, int]) -> tuple[float, ...]:
    """(x, y, w, h) in the original image's pixels of the centre crop `view` (w, h) taken from the image resized to
    `resized` (w, h): what the model saw (data.transforms.ImageTransform.center_crop's rounding)."""
    (w0, h0), (w1, h1), (vw, vh) = original, resized, view
    left, top = (w1 - vw) // 2, (h1 - vh) // 2
    sx, sy = w0 / w1, h0 / h1
    return (left * sx, top * sy, vw * sx, vh * sy)


def plot_feature_maps(image: Any, maps: list[FeatureMap], caption: str, out: Path) -> Path:
    """The image, then each model's overlay (min–max coloured, best patch outlined); returns the PNG's path."""
    fig, axes = plt.subplots(1, 1 + len(maps), figsize=(3.4 * (1 + len(maps)), 3.9), squeeze=False)
    axes[0, 0].imshow(np.asarray(to_rgb(image)))
    for k, fm in enumerate(maps):  # the square each model saw (the maps cover only that)
        x, y, w, h = fm.crop
        style = {"edgecolor": ("white", "yellow")[k % 2], "linestyle": ("-", "--")[k % 2], "linewidth": 1.6}
        axes[0, 0].add_patch(Rectangle((x - 0.5, y - 0.5), w, h, fill=False, **style))
    same = len({fm.crop for fm in maps}) == 1
    axes[0, 0].set_title("image; outlined: the crop the model" + (" saw" if same else "s saw"), fontsize=9)
    for ax, fm in zip(axes[0, 1:], maps, strict=True):
        up = fm.upsampled()
        lo, hi = float(fm.cos.min()), float(fm.cos.max())
        ax.imshow(fm.view)
        ax.imshow((up - lo) / max(hi - lo, 1e-12), cmap="jet", alpha=0.5, vmin=0.0, vmax=1.0)
        rows, cols = fm.cos.shape
        ph, pw = fm.view.shape[0] / rows, fm.view.shape[1] / cols
        r, c = fm.best
        ax.add_patch(Rectangle((c * pw - 0.5, r * ph - 0.5), pw, ph, fill=False, edgecolor="white", linewidth=1.5))
        ax.set_title(f"{fm.label}\ncos {lo:.3f} … {hi:.3f}", fontsize=9)
    for ax in axes[0]:
        ax.set_xticks([])
        ax.set_yticks([])
    fig.tight_layout(rect=(0, 0, 1, 0.9))  # the caption above the panel titles
    fig.suptitle(f"“{caption}”", fontsize=10, y=0.98)
    png = out / f"{STEM}.png"
    try:
        with owned_files.writing(png, "--out") as tmp:
            fig.savefig(tmp, dpi=120, bbox_inches="tight")
    finally:
        plt.close(fig)
    return png


def _record(fm: FeatureMap) -> dict[str, Any]:
    return {"grid": fm.cos.tolist(), "min": float(fm.cos.min()), "max": float(fm.cos.max()), "best_patch": fm.best,
            "crop_xywh": [round(v, 2) for v in fm.crop]}  # fmt: skip


def write_page(out: Path, caption: str, image_name: str, maps: list[FeatureMap], path: str, png: Path) -> Path:
    """feature_map.html through `pages.Page`: self-contained (the PNG by relative link, no network), text escaped."""
    page = Page(out / f"{STEM}.html", "Patch feature map", flag="--out")
    page.add(tag("p", caption, class_="query"))
    page.paragraph(
        f"Image: {image_name}. Dense features: {path} (Zhou et al.'s value path); colours are each map's cosines "
        "scaled to its own min … max, warm = high; the outlined patch scores highest."
    )
    page.add(Markup(f'<img src="{escape(page.local(png))}" alt="feature maps" style="max-width: 100%">'))
    rows = []
    for fm in maps:
        r = _record(fm)
        (row, col), (h, w) = r["best_patch"], fm.cos.shape
        rows.append([fm.label, f"{r['min']:.4f}", f"{r['max']:.4f}", f"row {row}, column {col} of {h}×{w}"])
    page.add(page.table(["model", "min cosine", "max cosine", "best patch"], rows))
    return page.write()


def load_models(names: list[str]) -> list[tuple[str, Any]]:
    """(label, model) for each name, resolved as `sharpclip eval --model` resolves it (a run directory's newest
    complete checkpoint, a checkpoint, an export or hub folder, a tiny preset); a repeated name is labelled #2."""
    if not 1 <= len(names) <= 2:
        raise ValueError(f"--feature-map draws one or two models side by side: give --model once or twice, not "
                         f"{len(names)} times")  # fmt: skip
    out = []
    for k, name in enumerate(names):
        source, _ = model_source(name)
        model = create_model(load_config(None, [f"model.name={source}"]).model).eval()
        label = "/".join(Path(name).parts[-2:]) if Path(name).exists() else name  # a run's folder and its parent
        out.append((label if name not in names[:k] else f"{label} #{k + 1}", model))
    return out


def run_feature_map(
    models: list[tuple[str, Any]], image_path: str | Path, caption: str, out_dir: str | Path, path: str = "maskclip"
) -> list[Path]:
    """Maps of `caption` over the image at `image_path` for each (label, model): PNG, JSON and HTML in `out_dir`."""
    if not caption.strip():
        raise ValueError("--feature-map needs --text CAPTION: the caption to map over the image")
    if not 1 <= len(models) <= 2:
        raise ValueError(f"--feature-map draws one or two models side by side; got {len(models)}")
    out = Path(out_dir)
    check_outputs(out)
    image = load_image(image_path)
    maps = [compute_feature_map(model, label, image, caption, path) for label, model in models]
    png = plot_feature_maps(image, maps, caption, out)
    numbers = {"caption": caption, "image": str(image_path), "path": path}
    numbers["models"] = {m.label: _record(m) for m in maps}
    js = owned_files.write_text(out / f"{STEM}.json", json.dumps(numbers, indent=2) + "\n", "--out")
    return [png, js, write_page(out, caption, Path(image_path).name, maps, path, png)]


def check_outputs(out: Path) -> None:
    """Refuse (one line) an --out holding a feature_map.png, .json or .html that sharpclip did not write."""
    owned_files.check([out / f"{STEM}.png", out / f"{STEM}.json"], "--out")
    Page(out / f"{STEM}.html", "", flag="--out").claim()
