"""Train/evaluation leakage: how many evaluation images a run also trains on, and the policy when there are some.

Two image files are the same image when they are the same file, or when they have the same file name and the same
bytes (a benchmark's photos copied to another folder: DCI's `photos/` read by Long-DCI, GOAL's lists). Only files
that share a name are compared byte for byte, so the check costs a set intersection plus a few reads; the same
picture saved under another name (COCO's train2014 vs val2017 naming) is not found. Images that are not files
(parquet cells, bytes) are not compared.
"""

from __future__ import annotations

import hashlib
import os
from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from sharpclip.data.files import read_regular
from sharpclip.data.schema import EditSample, log


class OverlapError(ValueError):
    """Training and evaluation share images under `data.overlap: error`."""


@dataclass
class Overlap:
    """`count` evaluation images that are also training images; `examples` a few of their names."""

    count: int = 0
    examples: list[str] = field(default_factory=list)


def sample_images(samples: Iterable[Any]) -> list[Path]:
    """The image files of samples (both halves of an edit), skipping sources that are not paths."""
    out = []
    for s in samples:
        sources = (s.source_image, s.edited_image) if isinstance(s, EditSample) else (getattr(s, "image", None),)
        out += [Path(getattr(src, "path", src)) for src in sources if isinstance(getattr(src, "path", src), str | Path)]
    return out


def _digest(path: Path, cache: dict[Path, str | None]) -> str | None:
    if path not in cache:
        try:
            cache[path] = hashlib.sha1(read_regular(path)).hexdigest()  # a FIFO: None, never a wait
        except OSError:
            cache[path] = None
    return cache[path]


def _same(a: Path, b: Path, cache: dict[Path, str | None]) -> bool:
    if os.path.realpath(a) == os.path.realpath(b):
        return True
    try:
        if a.stat().st_size != b.stat().st_size:
            return False
    except OSError:
        return False
    digest = _digest(a, cache)
    return digest is not None and digest == _digest(b, cache)


def find_overlap(train: Sequence[Path], evaluation: Sequence[Path], examples: int = 5) -> Overlap:
    """How many distinct images of `evaluation` are also in `train` (the module docstring says when two are one)."""
    by_name: dict[str, list[Path]] = defaultdict(list)
    for p in dict.fromkeys(train):
        by_name[p.name].append(p)
    cache: dict[Path, str | None] = {}
    found = Overlap()
    for p in dict.fromkeys(evaluation):
        if any(_same(p, q, cache) for q in by_name.get(p.name, ())):
            found.count += 1
            if len(found.examples) < examples:
                found.examples.append(p.name)
    return found


def check_overlap(train: Sequence[Path], evaluation: Sequence[Path], what: str, policy: str = "error") -> Overlap:
    """Find the overlap of `what` ("validation split 'test'", "eval suite 'long_dci'") with the training images;
    raise `OverlapError` under `error`, log a warning under `warn`."""
    found = find_overlap(train, evaluation)
    if found.count:
        n_eval = len(set(evaluation))
        message = (
            f"{what}: {found.count} of its {n_eval} images are also training images (e.g. "
            f"{', '.join(found.examples)}); its scores would not be held-out scores. Evaluate on a split the run does "
            "not train on, or set data.overlap=warn to go on and report them anyway"
        )
        if policy != "warn":
            raise OverlapError(message)
        log.warning("%s", message)
    return found
