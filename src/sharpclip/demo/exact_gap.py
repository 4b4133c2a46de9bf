"""Why one exact 128 × 128 InfoNCE matrix trains differently from 8 micro-batches of 16 of the same rows.

The demo's arms (a) and (a') see the same rows and weights; (a) sums eight 16 × 16 InfoNCE problems (HN-CLIP's
effective batch), (a') solves one 128 × 128 problem. On the same batches, at a given model, this measures the two
things that can differ:

- where each row's softmax puts its mass in the 128 × 128 matrix: on the positive, on the 15 negatives of the row's
  own micro-batch (the ones the 16 × 8 objective also sees) and on the 112 negatives of the other micro-batches (the
  ones only exact accumulation adds; for the demo's batches, independent scenes that the init already separates);
- the gradients of the two objectives with respect to every trained parameter: the ratio of their norms and their
  cosine (1: the same update direction, only the length differs).

`compare(model, batches, micro)` returns the means over the batches; `python -m sharpclip.demo.exact_gap` prints them
as JSON for a demo init (and, optionally, an arm's fine-tuned model).
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from sharpclip.config import DataConfig, ModelConfig
from sharpclip.data import build_loader
from sharpclip.demo.plan import DEFAULT_TASK, TASKS, Profile, task_profile
from sharpclip.demo.stages import corpus
from sharpclip.losses.infonce import infonce
from sharpclip.models.factory import create_model
from sharpclip.models.preprocessing import model_transforms


def mass_split(logits: Tensor, micro: int) -> dict[str, float]:
    """Mean softmax mass per row (both directions) on the positive, the row's own micro-batch's negatives and the
    other micro-batches' negatives. logits: (B, B), the positives on the diagonal, micro-batches of `micro`
    consecutive rows (B a multiple of `micro`)."""
    b = logits.shape[0]
    block = torch.arange(b, device=logits.device) // micro
    own = block[:, None] == block[None, :]
    eye = torch.eye(b, dtype=torch.bool, device=logits.device)
    out = {"positive": 0.0, "own_negatives": 0.0, "other_negatives": 0.0}
    for direction in (logits, logits.t()):
        p = direction.float().softmax(dim=1)
        out["positive"] += float(p[eye].mean()) / 2
        out["own_negatives"] += float((p * (own & ~eye)).sum(1).mean()) / 2
        out["other_negatives"] += float((p * ~own).sum(1).mean()) / 2
    return out


def _loss(features: dict[str, Tensor], log_scale: Tensor, micro: int | None) -> Tensor:
    image, text = features["image"], features["text"]
    if micro is None:
        return infonce(image, text, log_scale)
    chunks = range(0, image.shape[0], micro)
    return torch.stack([infonce(image[i : i + micro], text[i : i + micro], log_scale) for i in chunks]).mean()


def _gradient(loss: Tensor, params: list[torch.nn.Parameter]) -> list[Tensor]:
    return list(torch.autograd.grad(loss, params, retain_graph=True, allow_unused=True))


def _dot(a: list[Tensor | None], b: list[Tensor | None]) -> float:
    pairs = zip(a, b, strict=True)
    return sum(float((x.double() * y.double()).sum()) for x, y in pairs if x is not None and y is not None)


def batch_comparison(model: Any, batch: Any, micro: int) -> dict[str, float]:
    """The two objectives on one batch (data.schema.Batch on the model's device): both losses, the softmax mass split
    of the 128 × 128 matrix, the gradient norms' ratio (exact over 16 × 8) and their cosine."""
    params = [p for p in model.parameters() if p.requires_grad]
    features = model(batch.pixel_values, batch.input_ids, batch.attention_mask)
    log_scale = model.logit_scale
    exact, per_micro = _loss(features, log_scale, None), _loss(features, log_scale, micro)
    g_exact, g_micro = _gradient(exact, params), _gradient(per_micro, params)
    ee, mm, em = _dot(g_exact, g_exact), _dot(g_micro, g_micro), _dot(g_exact, g_micro)
    with torch.no_grad():
        logits = log_scale.exp() * features["image"] @ features["text"].t()
    out = {"loss_exact": float(exact.detach()), "loss_micro": float(per_micro.detach()), **mass_split(logits, micro)}
    out["grad_norm_ratio"] = (ee / mm) ** 0.5 if mm > 0 else float("nan")
    out["grad_cosine"] = em / (ee * mm) ** 0.5 if ee > 0 and mm > 0 else float("nan")
    return out


def compare(model: Any, batches: Iterable[Any], micro: int, device: torch.device | str = "cpu") -> dict[str, Any]:
    """Means (and the per-batch values) of batch_comparison over `batches` (moved to `device`, the model's)."""
    rows = [batch_comparison(model, b.to(device), micro) for b in batches]
    means = {k: statistics.fmean(r[k] for r in rows) for k in rows[0]}
    return {"batches": len(rows), "mean": means, "per_batch": rows}


def _batches(
    p: Profile, init: Path, data_root: Path, count: int, batch_size: int, micro: int, seed: int
) -> tuple[Any, list]:
    model = create_model(ModelConfig(name=str(init), context_length=p.context_length))
    with torch.no_grad():
        model.logit_scale.fill_(math.log(p.scale))  # the arms' frozen scale
    data = DataConfig(format="synthdense", root=str(data_root), synthdense=corpus(p))
    preprocessing = model_transforms(model, alpha=data.image_alpha)
    loader = build_loader(data, "train", preprocessing, batch_size=batch_size, seed=seed, train=True)
    batches = []
    for batch in loader:
        batches.append(batch)
        if len(batches) == count:
            break
    return model, batches


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", action="append", required=True, help="a model folder (repeat for several)")
    parser.add_argument("--data", required=True, help="the demo's fine-tuning corpus (<demo out>/synthdense)")
    parser.add_argument("--batches", type=int, default=10)
    parser.add_argument("--batch-size", type=int, default=128)
    parser.add_argument("--micro", type=int, default=16)
    parser.add_argument("--task", default=DEFAULT_TASK, choices=list(TASKS), help="the demo task (its arms' scale)")
    args = parser.parse_args(argv)
    report = {}
    p = task_profile(args.task)
    for folder in args.model:
        model, batches = _batches(p, Path(folder), Path(args.data), args.batches, args.batch_size, args.micro, seed=0)
        model.train()
        report[folder] = compare(model, batches, args.micro)["mean"]
    print(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
