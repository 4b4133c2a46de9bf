"""The one way a model is evaluated: embed with the model's own preprocessing, then the pure metrics.

`sharpclip eval` (eval.suite), the trainer's validation (train.run) and the demo (demo.measure) all embed through
`model_embedder`, so a checkpoint scores the same wherever it is evaluated:

    embedder = model_embedder(model, alpha="drop", batch_size=64)        # models.preprocessing decides the inputs
    evaluate = retrieval_validator(samples, "test")                      # a Trainer's `evaluate`: model -> metrics
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from sharpclip.config import VALIDATION_KS, EvalConfig
from sharpclip.devices import resolve_device, resolve_num_workers
from sharpclip.eval.embed import Embedder, ModelEmbedder
from sharpclip.eval.retrieval import RetrievalSet, embed_retrieval, from_samples, score_retrieval
from sharpclip.models.base import DualEncoder
from sharpclip.models.preprocessing import model_transforms

Evaluate = Callable[[DualEncoder], dict[str, float]]  # what a Trainer calls after an epoch


def model_embedder(
    model: DualEncoder,
    alpha: str = "drop",
    batch_size: int = 64,
    device: str | torch.device | None = None,
    progress: bool = False,
    jpeg_draft: bool = False,
    num_workers: int = 0,
    precision: str = "fp32",
) -> ModelEmbedder:
    """An Embedder over `model` with the preprocessing the model decides (models.preprocessing.model_transforms).

    device: None leaves the model where it is and embeds there (a model being trained is never moved); otherwise the
    model is moved to `device` first. alpha: the transparency policy (data.image_alpha / eval.image_alpha).
    num_workers: image decoding processes; precision: fp32 or bf16 (autocast), as the training run's.
    """
    if device is not None:
        model.to(device)
    preprocess, tokenizer = model_transforms(model, alpha=alpha)
    return ModelEmbedder(model, preprocess, tokenizer, batch_size, device, progress, jpeg_draft, num_workers, precision)


def as_embedder(model: Any, cfg: EvalConfig) -> Embedder:
    """An Embedder as is; a DualEncoder through `model_embedder` with eval's settings, on `eval.device`."""
    if isinstance(model, Embedder):
        return model
    device = resolve_device(cfg.device, "eval.device")
    workers = resolve_num_workers(cfg.num_workers, "eval.num_workers")
    return model_embedder(model, cfg.image_alpha, cfg.batch_size, device, cfg.progress, cfg.jpeg_draft, workers,
                          cfg.precision)  # fmt: skip


def flat_retrieval(metrics: dict[str, Any], ks: Sequence[int]) -> dict[str, float]:
    """`t2i_R@K` / `i2t_R@K` for each K of an evaluate_retrieval report, and their R@1 mean (`mean_R@1`)."""
    flat = {f"{d}_R@{k}": metrics[d][f"R@{k}"] for d in ("t2i", "i2t") for k in ks}
    return {**flat, "mean_R@1": (metrics["t2i"]["R@1"] + metrics["i2t"]["R@1"]) / 2}  # eval.guards.MEAN_R1


def retrieval_validator(
    samples: Sequence[Any] | RetrievalSet,
    name: str,
    alpha: str = "drop",
    ks: Sequence[int] = VALIDATION_KS,
    batch_size: int = 64,
    num_workers: int = 0,
    precision: str = "fp32",
    wrap: Callable[[Embedder], Embedder] | None = None,
    score: bool = True,
) -> Evaluate:
    """A Trainer's `evaluate`: R@K both directions over `samples` (pair samples, or a RetrievalSet named `name`) and
    `mean_R@1`, the best-checkpoint key; embedded where the model is, without progress bars, with `num_workers`
    decoding processes at `precision`. wrap: applied to the embedder (the trainer shards it over ranks); score:
    False on a rank that only embeds its share for the rank that scores (its `evaluate` returns {})."""
    dataset = samples if isinstance(samples, RetrievalSet) else from_samples(name, samples)

    def evaluate(model: DualEncoder) -> dict[str, float]:
        inner = model_embedder(model, alpha, batch_size, num_workers=num_workers, precision=precision)
        image, text = embed_retrieval(wrap(inner) if wrap is not None else inner, dataset)
        if not score:
            return {}
        return flat_retrieval(score_retrieval(image, text, dataset, ks, device=inner.device), ks)

    return evaluate
