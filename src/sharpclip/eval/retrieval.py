"""Image-text retrieval over any pair dataset: embed in batches, then the pure metrics of eval/metrics.py.

A `RetrievalSet` is the evaluation view of a dataset: distinct images, captions and each caption's image
(CLIP_benchmark's `texts_image_index`), so 1:1 benchmarks (DOCCI, DCI, Long-DCI, Urban-1K, ShareGPT4V-1k) and
5-caption ones (COCO/Flickr) share one code path. `from_pairs` builds it from (image key, image ref, caption) triples,
the shape every data loader's pair samples reduce to.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from sharpclip.eval.embed import Embedder
from sharpclip.eval.metrics import DEFAULT_KS, pairs_from_caption_index, retrieval_metrics


@dataclass
class RetrievalSet:
    """images: (N_img,) refs; captions: (N_txt,); caption_to_image: (N_txt,) index into images."""

    name: str
    images: list[Any]  # ImageRef, path, or any data.schema.ImageSource
    captions: list[str]
    caption_to_image: list[int]
    files: list[Path] = field(default_factory=list)
    skipped: list[Any] = field(default_factory=list)  # data.schema.BadSample left out under on_bad_sample: skip

    def __post_init__(self) -> None:
        if len(self.captions) != len(self.caption_to_image):
            raise ValueError(f"{self.name}: {len(self.captions)} captions but {len(self.caption_to_image)} indices")
        bad = [i for i in self.caption_to_image if not 0 <= i < len(self.images)]
        if bad:
            raise ValueError(f"{self.name}: caption image index {bad[0]} outside [0, {len(self.images)})")


def from_pairs(name: str, pairs: Iterable[tuple[Any, Any, str]], files: Sequence[Path] = ()) -> RetrievalSet:
    """Group (image key, image source, caption) triples by image key, keeping first-seen order."""
    index: dict[Any, int] = {}
    images: list[Any] = []
    captions, owner = [], []
    for key, ref, caption in pairs:
        if key not in index:
            index[key] = len(images)
            images.append(ref)
        captions.append(caption)
        owner.append(index[key])
    if not captions:
        raise ValueError(f"{name}: no image-caption pairs to evaluate")
    return RetrievalSet(name, images, captions, owner, list(files))


def from_samples(name: str, samples: Iterable[Any], files: Sequence[Path] = ()) -> RetrievalSet:
    """From data.schema.PairSample-like objects (`id`, `image`, `caption`, optional `captions`): one gallery image per
    sample, every reference caption of it a positive (COCO/Flickr: 5, grouped by their readers).

    Samples are never merged, whatever their ids: every reference long-caption evaluator scores an N × N matrix with
    a diagonal ground truth, so two records sharing an id (or an image) stay two items, as there. Edit samples have
    no retrieval view and are refused."""
    triples = []
    for i, s in enumerate(samples):
        if not hasattr(s, "caption"):
            raise ValueError(f"{name}: sample {getattr(s, 'id', '?')} is not an image-caption pair (an edit sample?)")
        triples.extend((i, s.image, c) for c in (s.captions or [s.caption]))
    return from_pairs(name, triples, files)


def embed_retrieval(embedder: Embedder, dataset: RetrievalSet) -> tuple[Tensor, Tensor]:
    """(image (N_img, D), text (N_txt, D)) embeddings of a dataset, images first."""
    return embedder.images(dataset.images), embedder.texts(dataset.captions)


def score_retrieval(
    image: Tensor,
    text: Tensor,
    dataset: RetrievalSet,
    ks: Sequence[int] = DEFAULT_KS,
    chunk_size: int = 1024,
    device: str | torch.device | None = None,
) -> dict[str, Any]:
    """{"t2i": {R@K, mean_rank, median_rank}, "i2t": {...}, "images": N, "captions": M} from `embed_retrieval`'s
    embeddings, scored on `device` (default: the embeddings')."""
    positives = pairs_from_caption_index(dataset.caption_to_image)
    metrics = retrieval_metrics(text, image, positives, ks, chunk_size, device)
    return {**metrics, "images": len(dataset.images), "captions": len(dataset.captions)}


def evaluate_retrieval(
    embedder: Embedder, dataset: RetrievalSet, ks: Sequence[int] = DEFAULT_KS, chunk_size: int = 1024
) -> dict[str, Any]:
    """{"t2i": {R@K, mean_rank, median_rank}, "i2t": {...}, "images": N, "captions": M} for one dataset."""
    image, text = embed_retrieval(embedder, dataset)
    device = getattr(embedder, "device", None)  # scored where the model embedded (a GPU scores 20k pairs in ms)
    return score_retrieval(image, text, dataset, ks, chunk_size, device)
