"""Training on a fraction of the data (HN-CLIP Fig. 6 / Table A9): seeded subsets that are identical and nested.

HN-CLIP trains GOAL and HN-CLIP on 5, 20, 50 and 100 % of DOCCI and DCI "on identical training subsets" without
saying how they were drawn. sharpclip's rule, which gives the properties such a comparison needs:

1. every sample of the train split gets the key sha256(f"{subset_seed}:{sample id}") (ties, i.e. repeated ids, are
   broken by the id and then the release position);
2. the subset is the first n of the samples ranked by that key, with n = `data.train_count`, or ⌈f·N⌉ (at least 1)
   for `data.train_fraction` f of the N samples;
3. the chosen samples keep their release order (so a subset of 100 % is the full split, row for row).

The selection reads only the sample ids, `subset_seed` and the size: never the objective, the training seed, the
rank or the world size, nor any random-number state. So every objective, seed, world size and resume trains on
the same samples, and as the order does not depend on n, a smaller subset lies inside every larger one (the 5 %
inside the 20 %). A sample is one image with its captions (an edit pair is one sample), so no image is split
across the boundary. `SubsetRecord` is what a run directory records (train_subset.json): the sizes, the seed, the
rule and the sha256 of the chosen ids (sorted, one per line), so that two runs can be checked for the same subset
and a resume refuses a split that changed on disk.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

from sharpclip.data.schema import Sample

RULE = "first n of the train split ranked by sha256(f'{subset_seed}:{id}'); n = train_count or ceil(fraction * N)"


@dataclass(frozen=True)
class SubsetRecord:
    """Which training subset a run read: JSON-ready (`to_json`)."""

    fraction: float  # data.train_fraction as configured (1.0 when train_count chose the size)
    count: int  # data.train_count as configured (0: the fraction chose the size)
    subset_seed: int
    total: int  # samples in the full train split
    selected: int  # samples in the subset
    ids_sha256: str  # sha256 of the selected ids, sorted, joined by newlines
    rule: str = RULE

    def to_json(self) -> dict[str, Any]:
        """The record as a dict (train_subset.json)."""
        return asdict(self)


def _record_problem(data: Any) -> str | None:
    """What makes `data` not a SubsetRecord's JSON, or None."""
    if not isinstance(data, dict):
        return f"expected a JSON object, got {type(data).__name__}"
    types = {"fraction": (int, float), "count": (int,), "subset_seed": (int,), "total": (int,), "selected": (int,),
             "ids_sha256": (str,)}  # fmt: skip
    for key, allowed in types.items():
        if key not in data:
            return f"no {key!r}"
        if isinstance(data[key], bool) or not isinstance(data[key], allowed):
            return f"{key!r} is {data[key]!r}, not a {allowed[0].__name__}"
    if data["total"] < 1 or not 1 <= data["selected"] <= data["total"]:
        return f"'selected' {data['selected']} of 'total' {data['total']} is not a subset of a non-empty split"
    return None


def read_subset_record(path: str | Path) -> SubsetRecord:
    """The SubsetRecord of a run's train_subset.json; ValueError naming the file when it is unreadable, not JSON,
    lacks a key, has a value of the wrong type, or sizes that are no subset (total 0, selected above total)."""
    path = Path(path)
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        reason = err.strerror if isinstance(err, OSError) and err.strerror else " ".join(str(err).split())
        raise ValueError(f"{path}: damaged training-subset record ({reason}); {_ADVICE}") from None
    problem = _record_problem(data)
    if problem is not None:
        raise ValueError(f"{path}: damaged training-subset record ({problem}); {_ADVICE}")
    known = {f.name for f in fields(SubsetRecord)}
    return SubsetRecord(**{k: v for k, v in data.items() if k in known})


_ADVICE = "sharpclip train writes it for data.train_fraction / data.train_count: restore it from a copy of the run"


def subset_key(seed: int, sample_id: str) -> str:
    """The ranking key of one sample: sha256 of "seed:id" (hex)."""
    return hashlib.sha256(f"{seed}:{sample_id}".encode()).hexdigest()


def subset_size(total: int, fraction: float = 1.0, count: int = 0) -> int:
    """n: `count` when > 0 (ValueError above `total`), else ⌈fraction · total⌉, at least 1 (0 for an empty split)."""
    if count > 0:
        if count > total:
            raise ValueError(f"data.train_count {count} is larger than the {total} samples of the train split")
        return count
    if total == 0:
        return 0
    # ⌈f·N⌉ with a tolerance for products such as 0.07 · 100 = 7.000000000000001 in binary floating point
    return max(1, min(total, math.ceil(fraction * total - 1e-9)))


def subset_order(ids: Sequence[str], seed: int) -> list[int]:
    """Positions of `ids` ranked by (subset_key, id, position): a subset of size n is the first n of this list."""
    return sorted(range(len(ids)), key=lambda i: (subset_key(seed, ids[i]), ids[i], i))


def ids_digest(ids: Sequence[str]) -> str:
    """sha256 of the ids sorted and joined by newlines: equal for the same set of samples in any order."""
    return hashlib.sha256("\n".join(sorted(ids)).encode()).hexdigest()


def select_subset(
    samples: Sequence[Sample], fraction: float = 1.0, count: int = 0, seed: int = 0
) -> tuple[list[Sample], SubsetRecord]:
    """The training subset of `samples` (module doc) in release order, and its record."""
    ids = [s.id for s in samples]
    n = subset_size(len(ids), fraction, count)
    chosen = set(subset_order(ids, seed)[:n])
    kept = [s for i, s in enumerate(samples) if i in chosen]
    record = SubsetRecord(fraction, count, seed, len(ids), n, ids_digest([s.id for s in kept]))
    return kept, record
