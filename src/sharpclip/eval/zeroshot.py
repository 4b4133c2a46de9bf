"""Zero-shot classification: class names × prompt templates → a text classifier, top-1 / top-5 accuracy.

Follows open_clip's `build_zero_shot_classifier`: for each class, encode every template filled with
the class name, L2-normalise, average, re-normalise, giving W: (D, C); logits = img @ W. A class is in the top K when
its rank, under the same tie policy as retrieval (eval/metrics.py), is < K. Images come from a folder per class
(`root/<class name>/*.jpg`, ImageNet-style) or from a CSV with columns `filepath,label` (label: a class name).
"""

from __future__ import annotations

import csv
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import Tensor

from sharpclip.eval.embed import Embedder
from sharpclip.eval.metrics import query_ranks

IMAGE_SUFFIXES = (".jpg", ".jpeg", ".png", ".bmp", ".webp")
PROMPT_SETS: dict[str, tuple[str, ...]] = {
    "photo": ("a photo of a {}.",),
    "basic": ("a photo of a {}.", "a picture of a {}.", "an image of a {}.", "a close-up photo of a {}."),
}


@dataclass
class ClassificationSet:
    """images: (N,) paths; labels: (N,) class indices into classnames; files: the annotation files read (a CSV; none
    for an image folder, whose images the manifest counts, and hashes only under eval.hash_images)."""

    name: str
    images: list[Path]
    labels: list[int]
    classnames: list[str]
    files: list[Path] = field(default_factory=list)


def read_image_folder(root: str | Path, name: str = "image_folder") -> ClassificationSet:
    """One sub-folder per class, named by the class (underscores read as spaces); classes in sorted order."""
    root = Path(root)
    classes = sorted(p for p in root.iterdir() if p.is_dir()) if root.is_dir() else []
    if not classes:
        raise FileNotFoundError(f"{root}: expected one sub-folder of images per class")
    images, labels = [], []
    for c, folder in enumerate(classes):
        files = sorted(p for p in folder.iterdir() if p.suffix.lower() in IMAGE_SUFFIXES)
        images += files
        labels += [c] * len(files)
    return ClassificationSet(name, images, labels, [p.name.replace("_", " ") for p in classes])


def read_csv(path: str | Path, image_root: str | Path | None = None, name: str = "csv") -> ClassificationSet:
    """CSV with a header containing `filepath` and `label` (a class name); paths relative to `image_root` or the CSV."""
    path = Path(path)
    base = Path(image_root) if image_root else path.parent
    with path.open(newline="") as f:
        rows = list(csv.DictReader(f))
    if not rows or not {"filepath", "label"} <= rows[0].keys():
        raise ValueError(f"{path}: expected a header with 'filepath' and 'label' columns")
    classnames = list(dict.fromkeys(r["label"] for r in rows))
    index = {c: i for i, c in enumerate(classnames)}
    images = [base / r["filepath"] for r in rows]
    return ClassificationSet(name, images, [index[r["label"]] for r in rows], classnames, [path])


def class_prompts(classnames: Sequence[str], templates: Sequence[str]) -> list[str]:
    """Every template filled with every class name, class-major: (C · T,) captions."""
    if not templates or any("{}" not in t for t in templates):
        raise ValueError(f"prompt templates must each contain '{{}}' for the class name; got {list(templates)}")
    return [t.format(c) for c in classnames for t in templates]


def zeroshot_classifier(embedder: Embedder, classnames: Sequence[str], templates: Sequence[str]) -> Tensor:
    """(D, C): per class the mean of its L2-normalised template embeddings, re-normalised."""
    prompts = class_prompts(classnames, templates)
    emb = torch.nn.functional.normalize(embedder.texts(prompts).float(), dim=-1)
    per_class = emb.reshape(len(classnames), len(templates), -1).mean(dim=1)
    return torch.nn.functional.normalize(per_class, dim=-1).t()


def topk_accuracy(image: Tensor, classifier: Tensor, labels: Tensor, ks: Sequence[int] = (1, 5)) -> dict[str, float]:
    """image: (N, D), classifier: (D, C), labels: (N,). Top-K accuracy in percent (tie policy of eval/metrics)."""
    positives = torch.stack([torch.arange(labels.numel()), labels.long()], dim=1)
    ranks = query_ranks(image.float(), classifier.t().float(), positives)
    return {f"top{k}": 100.0 * float((ranks < k).double().mean()) for k in ks}


def evaluate_zeroshot(
    embedder: Embedder, dataset: ClassificationSet, templates: Sequence[str], ks: Sequence[int] = (1, 5)
) -> dict[str, float]:
    """Top-K accuracy of zero-shot classification over one ClassificationSet."""
    classifier = zeroshot_classifier(embedder, dataset.classnames, templates)
    image = embedder.images(dataset.images)
    out = topk_accuracy(image, classifier, torch.tensor(dataset.labels), ks)
    return {**out, "images": len(dataset.images), "classes": len(dataset.classnames)}
