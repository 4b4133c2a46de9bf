"""WebDataset shards, img2dataset's output among them: `.tar` files whose members `<key>.<ext>` form samples.

A sample is the members that share a key: an image (`jpg`, `jpeg`, `png` or `webp`) with a `txt` and/or a `json`.
The caption is `json[data.caption_field]` when the json has it (a list = several captions), else the `txt`;
`json[data.short_caption_field]`, `json[data.group_field]` and `json[data.id_field]` (default: the key) are read as
in the generic format. img2dataset writes `00000.tar` (`000000000.jpg`, `.txt`, `.json`) beside `00000_stats.json`
and `00000.parquet`, which are ignored. The `webdataset` package reads the tar streams and groups members by key.

Shards of a split, first match wins:
- `data.shards` (for the train split): brace patterns such as `train-{000000..000127}.tar`, relative to data.root;
- `data.root` itself when it is a `.tar` file or a brace pattern;
- `<root>/<split>/*.tar`, then `<root>/<split>-*.tar` / `<root>/<split>_*.tar`;
- every `<root>/*.tar` (the train split only: img2dataset's flat output).

Training streams the shards (data.stream); `read` (evaluation, small splits) holds the encoded images in memory.
"""

from __future__ import annotations

import json
import random
import tarfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from sharpclip.config import DataConfig
from sharpclip.data.formats._common import caption_ok
from sharpclip.data.schema import BadSample, BadSampleReport, PairSample
from sharpclip.data.text import is_blank

IMAGE_KEYS = ("jpg", "jpeg", "png", "webp")
SIZES_FILE = "sizes.json"  # {shard file name: samples}, the convention open_clip and webdataset tools read


def _expand(pattern: str, root: Path) -> list[str]:
    from braceexpand import braceexpand  # a dependency of webdataset

    out = []
    for name in braceexpand(pattern):
        path = Path(name).expanduser()
        out.append(str(path if path.is_absolute() else root / path))
    return out


def shard_urls(cfg: DataConfig, split: str) -> list[str]:
    """The split's shard files (see the module docstring), in pattern order; raises naming what was looked for."""
    root = Path(cfg.root).expanduser()
    if split == cfg.train_split and cfg.shards:
        urls = [u for pattern in cfg.shards for u in _expand(pattern, root)]
    elif "{" in cfg.root or root.suffix == ".tar":
        urls = _expand(cfg.root, Path("."))
    elif (root / split).is_dir():
        urls = [str(p) for p in sorted((root / split).glob("*.tar"))]
    else:
        urls = [str(p) for p in sorted(root.glob(f"{split}[-_]*.tar"))]
        if not urls and split == cfg.train_split:
            urls = [str(p) for p in sorted(root.glob("*.tar"))]
    missing = [u for u in urls if not Path(u).is_file()]
    if missing:
        count = f"{len(missing)} of {len(urls)} missing"
        raise FileNotFoundError(f"{missing[0]}: shard not found ({count}); check data.shards and data.root")
    if not urls:
        raise FileNotFoundError(
            f"{root}: no .tar shards for split {split!r} (looked for data.shards, {root}/{split}/*.tar, "
            f"{root}/{split}-*.tar{', ' + str(root) + '/*.tar' if split == cfg.train_split else ''})"
        )
    return urls


def iter_raw(url: str, report: BadSampleReport, skip: int = 0) -> Iterator[dict[str, Any]]:
    """The raw samples of one shard (`{"__key__", ext: bytes, ...}`), after skipping the first `skip` unread.

    A shard that cannot be read to its end (truncated, not a tar) is reported once, as a bad sample of the shard.
    """
    from webdataset.tariterators import group_by_keys, tar_file_expander  # heavy: loads only for tar shards

    try:
        with open(url, "rb") as stream:
            for n, raw in enumerate(group_by_keys(tar_file_expander([{"url": url, "stream": stream}]))):
                if n >= skip:
                    yield raw
    except (OSError, tarfile.TarError, ValueError) as err:
        report.add(BadSample(url, "?", f"unreadable image: the shard is not a readable tar ({err})"))


def _image(raw: dict[str, Any]) -> bytes | None:
    return next((raw[k] for k in IMAGE_KEYS if k in raw), None)


def _meta(raw: dict[str, Any], where: str, key: str, report: BadSampleReport) -> dict | None:
    if "json" not in raw:
        return {}
    try:
        meta = json.loads(raw["json"])
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        report.add(BadSample(where, key, f"malformed record: {key}.json is not valid JSON ({err})"))
        return None
    if not isinstance(meta, dict):
        report.add(BadSample(where, key, f"malformed record: {key}.json is not a JSON object"))
        return None
    return meta


def _caption(raw: dict[str, Any], meta: dict, cfg: DataConfig, where: str, key: str, report: BadSampleReport):
    caption = meta.get(cfg.caption_field)
    if caption is None and "txt" in raw:
        try:
            caption = raw["txt"].decode("utf-8").strip()
        except UnicodeDecodeError:
            report.add(BadSample(where, key, f"malformed record: {key}.txt is not UTF-8 text"))
            return None
    if caption is None:
        report.add(BadSample(where, key, f"empty caption: no {key}.txt and no '{cfg.caption_field}' in {key}.json"))
        return None
    texts = caption if isinstance(caption, list) else [caption]
    return caption if texts and all(caption_ok(t, where, key, report) for t in texts) else None


def to_sample(raw: dict[str, Any], cfg: DataConfig, report: BadSampleReport, url: str = "") -> PairSample | None:
    """The `PairSample` of one raw sample (image left encoded), or None after reporting what is wrong."""
    key, url = str(raw.get("__key__", "?")), url or str(raw.get("__url__", ""))
    where = f"{url}:{key}"
    image = _image(raw)
    if image is None:
        found = ", ".join(k for k in raw if not k.startswith("__")) or "nothing"
        report.add(BadSample(where, key, f"missing file: no {'/'.join(IMAGE_KEYS)} member for key {key} ({found})"))
        return None
    meta = _meta(raw, where, key, report)
    caption = None if meta is None else _caption(raw, meta, cfg, where, key, report)
    if caption is None:
        return None
    captions = caption if isinstance(caption, list) else None
    short, group = meta.get(cfg.short_caption_field), meta.get(cfg.group_field)
    return PairSample(
        id=str(meta.get(cfg.id_field, key)),
        image=image,
        caption=captions[0] if captions else caption,
        short_caption=short if isinstance(short, str) and not is_blank(short) else None,
        captions=captions,
        group=None if group is None else str(group),
        source=where,
    )


def pick_caption(sample: PairSample, cfg: DataConfig, seed: int, epoch: int) -> str:
    """The caption a stream trains on: the one caption, or (several) the first or one drawn per epoch."""
    if not sample.captions or cfg.caption_choice == "first":
        return sample.caption
    return random.Random(f"{seed}:{epoch}:{sample.source}").choice(sample.captions)


def _listed_count(url: str) -> int | None:
    """The shard's sample count from `sizes.json` or img2dataset's `<shard>_stats.json`, when either is there."""
    path = Path(url)
    sizes = path.parent / SIZES_FILE
    if sizes.is_file():
        listed = json.loads(sizes.read_text(encoding="utf-8")).get(path.name)
        if isinstance(listed, int):
            return listed
    stats = path.with_name(f"{path.stem}_stats.json")
    if stats.is_file():
        listed = json.loads(stats.read_text(encoding="utf-8")).get("successes")
        if isinstance(listed, int):
            return listed
    return None


def count_samples(url: str) -> int:
    """Samples (keys with an image member) in one shard: listed, else from the tar's member headers only."""
    from webdataset.tariterators import base_plus_ext  # heavy: loads only for tar shards

    listed = _listed_count(url)
    if listed is not None:
        return listed
    keys = set()
    with tarfile.open(url) as tar:  # random-access mode: headers are read, member data is skipped
        for member in tar:
            key, ext = base_plus_ext(member.name)
            if member.isreg() and key is not None and ext.lower() in IMAGE_KEYS:
                keys.add(key)
    return len(keys)


def read(root: Path, split: str, cfg: DataConfig, report: BadSampleReport) -> list[PairSample]:
    """Every sample of the split's shards in shard order, images kept encoded in memory (evaluation-sized splits)."""
    cfg = cfg if cfg.root else DataConfig(**{**vars(cfg), "root": str(root)})
    samples = []
    for url in shard_urls(cfg, split):
        report.read_file(Path(url))
        for raw in iter_raw(url, report):
            sample = to_sample(raw, cfg, report, url)
            if sample is not None:
                samples.append(sample)
    return samples
