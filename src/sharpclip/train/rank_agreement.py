"""Ranks agree on their configuration before anything is trained.

Under torchrun every rank reads the same words; a scheduler may start each rank with its own (a job array, a
wrapper script per node), and ranks given different settings trained silently with them: rank 1's own `train.lr`
changed the saved weights while config.yaml recorded rank 0's, and a different `train.batch_size` ran one rank out
of batches and hung the others. At start-up every rank takes the sha256 of its resolved configuration, the ranks
exchange the digests, and on any difference every rank ends with one line naming the differing keys.

Compared: every key of the resolved configuration (paths as resolved, `~` expanded), `train.device` included (a
CPU rank beside a CUDA one, or two ranks on one GPU, is no data-parallel run; sharpclip.devices places each rank on
its LOCAL_RANK's GPU), except `PER_RANK`:

- `train.progress`, `eval.progress`: a progress bar on one rank's terminal changes nothing computed;
- `train.output_dir`: compared by what each rank sees, not by its spelling: train.run.check_shared_dir has rank 0
  write a token there that every rank must read back (one shared folder, whatever path each node mounts it at).

Any other path (data.root, ...) must name the same place on every rank, compared after `~` is expanded and the
spelling's noise is removed (os.path.normpath: a trailing `/`, `./`, `a/../`): `~/data` on one rank and `/home/u/data/`
on another agree; a relative path on one rank and an absolute one on another do not (each is read from its own
working folder), and ranks whose home folders differ should be given absolute paths rather than `~`.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from typing import Any

from sharpclip.config import Config, as_place, is_path_key
from sharpclip.train.resume import flatten

PER_RANK = ("train.progress", "eval.progress", "train.output_dir")


class RankConfigMismatch(ValueError):
    """The ranks were started with different configurations (printed as one line on every rank)."""


def compared(cfg: Config) -> dict[str, Any]:
    """The resolved configuration as {dotted key: value}, without the PER_RANK keys; paths by config.as_place."""
    return {
        k: as_place(v) if is_path_key(k) else v
        for k, v in flatten(cfg).items()
        if not any(k == p or k.startswith(p + ".") for p in PER_RANK)
    }


def digest(settings: dict[str, Any]) -> str:
    """sha256 of `settings` in a canonical JSON form (sorted keys)."""
    return hashlib.sha256(json.dumps(settings, sort_keys=True, default=repr).encode()).hexdigest()


def differences(by_rank: list[dict[str, Any]], limit: int = 4) -> str:
    """'train.lr (1e-05 on rank 0, 0.01 on rank 1), ...' for the keys whose values differ between ranks."""
    keys = sorted({k for s in by_rank for k in s if len({repr(t.get(k)) for t in by_rank}) > 1})
    parts = []
    for key in keys[:limit]:
        other = next(r for r, s in enumerate(by_rank) if repr(s.get(key)) != repr(by_rank[0].get(key)))
        parts.append(f"{key} ({by_rank[0].get(key)!r} on rank 0, {by_rank[other].get(key)!r} on rank {other})")
    return ", ".join(parts) + (f" and {len(keys) - limit} more" if len(keys) > limit else "")


def check_same_config(cfg: Config, all_ranks: Callable[[Any], list[Any]]) -> None:
    """Raise RankConfigMismatch on every rank unless every rank's `compared(cfg)` has one digest. `all_ranks`:
    every rank's value in rank order (train.distributed.all_ranks); every rank must call this. The settings
    themselves travel (as JSON) only when the digests differ."""
    settings = compared(cfg)
    digests = all_ranks(digest(settings))
    if len(set(digests)) == 1:
        return
    by_rank = [json.loads(text) for text in all_ranks(json.dumps(settings, sort_keys=True, default=repr))]
    raise RankConfigMismatch(
        f"the ranks were started with different settings: {differences(by_rank)}; start every rank with the same "
        "recipe and overrides"
    )
