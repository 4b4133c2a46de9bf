"""Check a dataset before a run (`sharpclip validate-data`): what would break training or skew an evaluation.

Errors (non-zero exit): malformed records, empty captions, missing files, unreadable images.
Warnings: duplicate captions (false negatives for InfoNCE, zero margins for HN-CLIP), duplicate images (by bytes)
and repeated sample ids (each record stays its own item in evaluation, as in the reference evaluators; a repeated id
pointing at different images usually means two annotation records for what the user thinks is one sample).
Statistics: sample counts, the token-length distribution and the share of captions truncated at 77 (CLIP) and
248 (Long-CLIP) tokens, bos and eos included.
"""

from __future__ import annotations

import hashlib
import json
import re
import statistics
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

from sharpclip.config import DataConfig, SynthDenseConfig, check_typed_overrides, load_config
from sharpclip.data import data_root, read_samples
from sharpclip.data.formats import ultraedit, webdataset
from sharpclip.data.formats.hf import is_save_to_disk, resolve_hub_folder
from sharpclip.data.images import ImageLoadError, image_bytes, load_image
from sharpclip.data.schema import BadSample, BadSampleReport, EditSample, ImageSource, Sample
from sharpclip.progress import bar as progress_bar

CONTEXTS = (77, 248)
SHARDS_SHOWN = 8  # shards named in the summary line (all are in the JSON report)
DETECT = (  # (a file or folder that identifies the format, format), first match wins
    ("manifest.json", "synthdense"),
    ("docci_descriptions.jsonlines", "docci"),
    ("densely_captioned_images", "dci"),
    ("splits.json", "dci"),
    ("dci_long.csv", "long_dci"),
    ("Urban1k", "urban1k"),
    ("caption", "urban1k"),
    ("share-captioner_coco_lcs_sam_1246k_1107.json", "sharegpt4v"),
    ("paragraphs_v1.json", "vg"),
    ("dataset_coco.json", "karpathy"),
    ("dataset_flickr30k.json", "karpathy"),
    ("dataset_flickr8k.json", "karpathy"),
)
DEFAULT_SPLIT = {"urban1k": "test", "long_dci": "test"}


@dataclass
class ValidationReport:
    format: str
    root: str
    split: str
    samples: int = 0
    images: int = 0
    captions: int = 0
    errors: list[str] = field(default_factory=list)  # "where: record id: reason"
    error_counts: dict[str, int] = field(default_factory=dict)
    duplicate_captions: int = 0  # captions whose exact text occurs more than once
    duplicate_caption_examples: list[str] = field(default_factory=list)
    duplicate_images: int = 0  # images whose bytes occur more than once
    repeated_ids: int = 0  # records whose id occurs more than once
    repeated_ids_different_images: int = 0  # ... of which the records of one id name more than one image
    repeated_id_examples: list[str] = field(default_factory=list)
    token_counter: str = ""
    token_lengths: dict[str, float] = field(default_factory=dict)  # min, mean, p50, p90, p99, max
    truncated_share: dict[str, float] = field(default_factory=dict)  # context length -> share of captions over it
    shards: dict[str, int] = field(default_factory=dict)  # webdataset: usable samples per shard

    @property
    def ok(self) -> bool:
        """True when no error was found."""
        return not self.errors

    def to_json(self) -> dict:
        """Every field plus `ok`, JSON-serialisable."""
        return {**asdict(self), "ok": self.ok}

    def summary(self) -> str:
        """Counts, errors by kind, duplicates and token lengths as human-readable lines."""
        lines = [
            f"{self.format} {self.split} at {self.root}: {self.samples} samples, {self.images} images, "
            f"{self.captions} captions"
        ]
        if self.shards:
            shown = ", ".join(f"{Path(u).name} {n}" for u, n in list(self.shards.items())[:SHARDS_SHOWN])
            more = len(self.shards) - SHARDS_SHOWN
            lines.append(f"{len(self.shards)} shards: {shown}" + (f", ... and {more} more (see the JSON report)"
                                                                  if more > 0 else ""))  # fmt: skip
        kinds = ", ".join(f"{n} {k}" for k, n in sorted(self.error_counts.items())) or "none"
        lines.append(f"errors: {kinds}")
        lines += [f"  {e}" for e in self.errors[:20]]
        if len(self.errors) > 20:
            lines.append(f"  ... and {len(self.errors) - 20} more")
        lines.append(f"duplicate captions: {self.duplicate_captions}; duplicate images: {self.duplicate_images}")
        if self.repeated_ids:
            lines.append(
                f"repeated ids: {self.repeated_ids} records share an id ({self.repeated_ids_different_images} of them "
                f"with different images), e.g. {', '.join(self.repeated_id_examples)}; each stays its own item"
            )
        if self.token_lengths:
            t = self.token_lengths
            lines.append(
                f"tokens ({self.token_counter}): min {t['min']:.0f}, mean {t['mean']:.1f}, p50 {t['p50']:.0f}, "
                f"p90 {t['p90']:.0f}, p99 {t['p99']:.0f}, max {t['max']:.0f}"
            )
            lines.append("truncated: " + ", ".join(f"{v:.1%} at {k}" for k, v in self.truncated_share.items()))
        lines.append("OK" if self.ok else f"FAILED: {len(self.errors)} errors")
        return "\n".join(lines)


def _parquet_format(files: list[Path]) -> str:
    """`ultraedit` when the first shard has UltraEdit's columns, else `hf` (any hub parquet dataset)."""
    import pyarrow.parquet as pq  # optional dependency (extra [parquet]), needed only for parquet folders

    names = set(pq.read_schema(files[0]).names)
    return "ultraedit" if {*ultraedit.TEXT, *ultraedit.IMAGES} <= names else "hf"


def detect_format(path: Path) -> str:
    """The release format of the folder (or file) at `path`, from its tell-tale files; `generic` otherwise."""
    if path.is_file() or "{" in str(path):  # a file, or a brace pattern of shards
        return {".tar": "webdataset", ".parquet": "hf"}.get(path.suffix, "generic")
    for name, fmt in DETECT:
        if (path / name).exists():
            return fmt
    path = resolve_hub_folder(path)
    if is_save_to_disk(path):
        return "hf"
    if list(path.glob("*.tar")) or list(path.glob("*/*.tar")):  # before parquet: img2dataset writes both
        return "webdataset"
    parquet = sorted(path.glob("*.parquet")) or sorted(path.glob("data/*.parquet")) or sorted(path.glob("*/*.parquet"))
    if parquet:
        return _parquet_format(parquet)
    return "generic"


def _check_image(
    source: ImageSource, sample: Sample, errors: list[BadSample], max_pixels: int | None = None
) -> bytes | None:
    """The image's bytes (for duplicate detection) after a full decode; None and an error when it fails."""
    try:
        load_image(source, max_pixels=max_pixels)
        return image_bytes(source)
    except (ImageLoadError, FileNotFoundError) as err:
        reason = err.reason if isinstance(err, ImageLoadError) else f"missing file: {source}"
        errors.append(BadSample(sample.source or str(source), sample.id, reason))
        return None


def _images_and_captions(samples: Sequence[Sample]) -> tuple[list[tuple[ImageSource, Sample]], list[str]]:
    images, captions = [], []
    for s in samples:
        if isinstance(s, EditSample):
            images += [(s.source_image, s), (s.edited_image, s)]
            captions += [s.source_caption, s.target_caption]
        else:
            images.append((s.image, s))
            captions += s.captions or [s.caption]
    return images, captions


def sample_images(samples: Sequence[Sample]) -> list[tuple[str, str]]:
    """(id, image path) of each record (an edit sample's source image)."""
    pairs = []
    for s in samples:
        source = s.source_image if isinstance(s, EditSample) else s.image
        pairs.append((s.id, str(getattr(source, "path", source))))
    return pairs


def repeated_ids(id_images: Sequence[tuple[str, str]]) -> tuple[int, int, list[str]]:
    """(records whose id repeats, those among them whose id names several images, up to 5 such ids), from each
    record's (id, image) where the image is a path or, for streamed shards, a digest of its bytes."""
    images: dict[str, list[str]] = {}
    for sample_id, image in id_images:
        images.setdefault(sample_id, []).append(image)
    repeated = {i: srcs for i, srcs in images.items() if len(srcs) > 1}
    different = {i: srcs for i, srcs in repeated.items() if len(set(srcs)) > 1}
    examples = [f"{i} ({len(srcs)} records)" for i, srcs in list({**different, **repeated}.items())[:5]]
    return sum(map(len, repeated.values())), sum(map(len, different.values())), examples


def _length_stats(lengths: list[int]) -> tuple[dict[str, float], dict[str, float]]:
    if not lengths:
        return {}, {}
    q = statistics.quantiles(lengths, n=100, method="inclusive") if len(lengths) > 1 else [lengths[0]] * 99
    stats = {
        "min": min(lengths),
        "mean": statistics.fmean(lengths),
        "p50": q[49],
        "p90": q[89],
        "p99": q[98],
        "max": max(lengths),
    }
    return stats, {str(c): sum(n > c for n in lengths) / len(lengths) for c in CONTEXTS}


def approximate_lengths(texts: Sequence[str]) -> list[int]:
    """Token counts without a tokenizer: words, digits and punctuation marks as CLIP splits them, plus bos and eos."""
    return [len(re.findall(r"[^\W\d_]+|\d|[^\w\s]", t.lower())) + 2 for t in texts]


def validate(
    cfg: DataConfig,
    split: str,
    count_tokens: Callable[[Sequence[str]], list[int]] | None = None,
    token_counter: str = "",
    progress: bool = False,
) -> ValidationReport:
    """Read every record of `split`, decode every image, and gather the report (nothing raises per sample).

    progress: a bar on stderr over the images decoded (over the shards for a stream)."""
    report = BadSampleReport("skip")
    rep = ValidationReport(cfg.format, str(data_root(cfg)), split)
    if cfg.format == "webdataset":  # streamed shard by shard: images are decoded and dropped, never all held
        rep.images, captions, digests, bad, id_images = _stream_shards(cfg, split, rep, report, progress)
    else:
        samples = read_samples(cfg, split, report)
        rep.samples = len(samples)
        images, captions = _images_and_captions(samples)
        rep.images, bad = len(images), list(report.items)
        bar = progress_bar(images, enabled=progress, desc="decode images", unit="image")
        checked = (_check_image(src, s, bad, cfg.max_image_pixels) for src, s in bar)
        digests = [hashlib.sha1(b).hexdigest() for b in checked if b is not None]
        id_images = sample_images(samples)
    if not rep.samples and not bad:
        bad.append(BadSample(rep.root, "-", f"missing file: no {cfg.format} samples for split {split!r}; "
                                            "check the path, --format and --split"))  # fmt: skip
    rep.captions = len(captions)
    rep.errors = [str(b) for b in bad]
    rep.error_counts = dict(Counter(b.reason.split(":")[0] for b in bad))
    repeated = {t: n for t, n in Counter(captions).items() if n > 1}
    rep.duplicate_captions = sum(repeated.values())
    rep.duplicate_caption_examples = [t[:80] for t in list(repeated)[:5]]
    rep.duplicate_images = sum(n for n in Counter(digests).values() if n > 1)
    rep.repeated_ids, rep.repeated_ids_different_images, rep.repeated_id_examples = repeated_ids(id_images)
    counter = count_tokens or approximate_lengths
    rep.token_counter = token_counter or ("tokenizer" if count_tokens else "approximate: words and punctuation")
    rep.token_lengths, rep.truncated_share = _length_stats(counter(captions))
    return rep


def _stream_shards(cfg: DataConfig, split: str, rep: ValidationReport, report: BadSampleReport, progress: bool):
    """Per shard: samples read, each image decoded and hashed; bad samples are named by shard and key."""
    captions, digests, bad, images, id_images = [], [], [], 0, []
    urls = webdataset.shard_urls(cfg, split)
    bar = progress_bar(urls, enabled=progress, desc="read shards", unit="shard")
    for url in bar:
        count = 0
        for raw in webdataset.check_fields(webdataset.iter_raw(url, report), cfg, url):
            sample = webdataset.to_sample(raw, cfg, report, url)
            if sample is None:
                continue
            count += 1
            images += 1
            captions += sample.captions or [sample.caption]
            data = _check_image(sample.image, sample, bad)
            if data is not None:
                digests.append(hashlib.sha1(data).hexdigest())
                id_images.append((sample.id, digests[-1]))
        rep.shards[url] = count
        bar.set_postfix(samples=images)
    rep.samples = sum(rep.shards.values())
    return images, captions, digests, report.items + bad, id_images


def config_for(target: str, overrides: Sequence[str] = (), fmt: str | None = None) -> DataConfig:
    """The data config of a YAML recipe, or one for a data folder/file whose format is detected (or given)."""
    path = Path(target)
    check_typed_overrides(overrides)
    if path.suffix in (".yaml", ".yml"):
        cfg = load_config(path, overrides).data
        return cfg if fmt is None else DataConfig(**{**vars(cfg), "format": fmt})
    if not path.exists() and "{" not in target:
        raise FileNotFoundError(f"{path}: no such config file or data folder")
    given = {o.split("=", 1)[0].removeprefix("data.") for o in overrides}  # a path's overrides, as a recipe's
    cfg = load_config(None, [f"data.{o.removeprefix('data.')}" for o in overrides]).data
    cfg.root = cfg.root if "root" in given else str(path)
    cfg.format = fmt or (cfg.format if "format" in given else detect_format(path))
    if cfg.format == "synthdense" and (path / "manifest.json").is_file():  # validate the corpus as it was generated
        found = json.loads((path / "manifest.json").read_text(encoding="utf-8")).get("config", {})
        cfg.synthdense = SynthDenseConfig(**found)
    return cfg


def default_split(cfg: DataConfig) -> str:
    """The split `validate-data` checks when none is given: the format's default, else data.train_split."""
    return DEFAULT_SPLIT.get(cfg.format, cfg.train_split)
