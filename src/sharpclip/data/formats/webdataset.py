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

A shard is checked from its member headers before it is read (`shard_problem`): one that is not a tar, or that was
cut short (a member's data running past the end of the file, or no end-of-archive blocks after the last member: an
interrupted copy or writer) is one bad sample naming the shard, and none of its samples is read. Under
`data.on_bad_sample: error` that stops the run; under `skip` the shard is skipped and counted.
"""

from __future__ import annotations

import io
import itertools
import json
import os
import random
import tarfile
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from sharpclip.config import DataConfig
from sharpclip.data.files import NotRegularFileError, check_regular
from sharpclip.data.formats._common import caption_ok, field_fix
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
    for url in urls:  # a FIFO or folder named like a shard: refused here, never opened
        if os.path.exists(url) and not os.path.isfile(url):
            check_regular(url)
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

    A shard that is not a complete tar (`shard_problem`), or cannot be read to its end, is reported once, as a bad
    sample of the shard, and yields nothing.
    """
    from webdataset.tariterators import group_by_keys, tar_file_expander  # heavy: loads only for tar shards

    problem = shard_problem(url)
    if problem is not None:
        report.add(BadSample(url, "?", problem))
        return
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


FIRST_SAMPLES = 8  # a shard's samples looked at together before any is judged: all failing alike is a setup error


def _caption_keys(raw: dict[str, Any], cfg: DataConfig) -> list[str] | None:
    """None when the sample has no image, has a `.txt`, has no json (a sample without any caption: a bad sample), or
    its json holds `data.caption_field` (or is unreadable: a per-sample error); else the json's keys: where its
    caption may be instead."""
    if _image(raw) is None or "txt" in raw or "json" not in raw:
        return None
    try:
        meta = json.loads(raw["json"])
    except (UnicodeDecodeError, json.JSONDecodeError):
        return None
    return list(meta) if isinstance(meta, dict) and cfg.caption_field not in meta else None


def check_fields(raws: Iterator[dict[str, Any]], cfg: DataConfig, url: str) -> Iterator[dict[str, Any]]:
    """`raws` unchanged, after one setup error when every one of the shard's first `FIRST_SAMPLES` samples has its
    image and a json but no caption where `data.caption_field` says (no `.txt`, no such json key): the caption sits
    under another key (ShardWriter json `{"text": ...}`), so every sample would fail alike; the error names the
    shard, the json's keys and the key to set, instead of one line per sample (or advice to skip them all)."""
    first = list(itertools.islice(raws, FIRST_SAMPLES))
    keys = [_caption_keys(raw, cfg) for raw in first]
    if first and all(k is not None for k in keys):
        names = list(dict.fromkeys(k for sample in keys for k in sample))
        raise ValueError(
            f"{url}: sample {first[0].get('__key__', '?')} has no .txt and no {cfg.caption_field!r} "
            f"(data.caption_field) in its .json, whose keys are {', '.join(names) or 'none'}: "
            f"{field_fix(names, cfg, ('caption_field',))} (or write a .txt per sample)"
        )
    yield from first
    yield from raws


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


BLOCK = tarfile.BLOCKSIZE  # 512: tar headers and member data are padded to whole blocks
END_OF_ARCHIVE = 2 * BLOCK  # a complete tar ends with two zero blocks after its last member (POSIX ustar)


def _scan(url: str) -> tuple[int, str | None]:
    """(samples, problem) from the shard's member headers only (member data is skipped): the keys with an image
    member, and None or the reason the shard is not a complete tar (see `shard_problem`)."""
    from webdataset.tariterators import base_plus_ext  # heavy: loads only for tar shards

    keys, end, last = set(), 0, ""
    try:
        check_regular(url)
        size = os.path.getsize(url)
        with tarfile.open(url) as tar:  # random-access mode; compressed shards are read through their codec
            compressed = not isinstance(tar.fileobj, io.BufferedReader)  # offsets are then the codec's, not the file's
            for member in tar:
                key, ext = base_plus_ext(member.name)
                if member.isreg() and key is not None and ext.lower() in IMAGE_KEYS:
                    keys.add(key)
                end, last = member.offset_data + member.size, member.name
    except NotRegularFileError as err:
        return 0, f"unreadable shard: {url} is {err.kind}"
    except (tarfile.TarError, EOFError, OSError, zlib.error) as err:
        if last or isinstance(err, EOFError):  # members were read before it broke: a cut (or damaged) tar
            return len(keys), f"truncated shard: unreadable after member {last or '?'} ({err}); copy or write it again"
        detail = str(err).splitlines()[-1].strip(" -")  # tarfile lists every codec it tried: the plain tar's reason
        return 0, f"unreadable shard: not a tar ({detail}); check data.shards and data.root"
    return len(keys), None if compressed or not last else _cut_short(url, size, end, last)


def _cut_short(url: str, size: int, end: int, last: str) -> str | None:
    """The reason an uncompressed tar whose last member `last` ends at byte `end` is incomplete, or None: its data
    runs past the file's `size`, or no zero block follows it (a cut inside the end blocks loses nothing)."""
    if end > size:
        return f"truncated shard: member {last} runs to byte {end:,}, the file ends at {size:,}; copy or write it again"
    with open(url, "rb") as f:  # a regular file (checked by the caller)
        f.seek(-(-end // BLOCK) * BLOCK)
        eoa = f.read(END_OF_ARCHIVE)
    if len(eoa) < BLOCK or eoa.strip(b"\0"):
        return (f"truncated shard: the file ends at byte {size:,}, after member {last}, without a tar's "
                "end-of-archive blocks (an interrupted copy or writer); copy or write it again")  # fmt: skip
    return None


def shard_problem(url: str) -> str | None:
    """None when the shard is a complete tar; else the bad-sample reason naming what is wrong: not a regular file,
    not a tar, a member's data running past the end of the file, or no end-of-archive blocks after the last member
    (what `truncate` or an interrupted copy or writer leaves). Reads the member headers only."""
    return _scan(url)[1]


def count_samples(url: str, report: BadSampleReport | None = None) -> int:
    """Samples (keys with an image member) in one shard: listed, else from the tar's member headers only.

    A shard that is not a complete tar counts 0 (none of its samples is read) and, given `report`, is reported
    there (raising under `data.on_bad_sample: error`)."""
    listed = _listed_count(url)
    if listed is not None:
        return listed
    count, problem = _scan(url)
    if problem is None:
        return count
    if report is not None:
        report.add(BadSample(url, "?", problem))
    return 0


def read(root: Path, split: str, cfg: DataConfig, report: BadSampleReport) -> list[PairSample]:
    """Every sample of the split's shards in shard order, images kept encoded in memory (evaluation-sized splits)."""
    cfg = cfg if cfg.root else DataConfig(**{**vars(cfg), "root": str(root)})
    samples = []
    for url in shard_urls(cfg, split):
        report.read_file(Path(url))
        for raw in check_fields(iter_raw(url, report), cfg, url):
            sample = to_sample(raw, cfg, report, url)
            if sample is not None:
                samples.append(sample)
    return samples
