"""Check a dataset before a run (`sharpclip validate-data`): what would break training or skew an evaluation.

Errors (non-zero exit): malformed records, empty captions, missing files, unreadable images.
Warnings: duplicate captions (false negatives for InfoNCE, zero margins for HN-CLIP) and duplicate images (by bytes).
Statistics: sample counts, the token-length distribution and the share of captions truncated at 77 (CLIP) and
248 (Long-CLIP) tokens, bos and eos included.
"""

from __future__ import annotations

import hashlib
import re
import statistics
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

from sharpclip.config import DataConfig
from sharpclip.data import data_root, read_samples
from sharpclip.data.images import ImageLoadError, image_bytes, load_image
from sharpclip.data.schema import BadSample, BadSampleReport, EditSample, ImageSource, Sample

CONTEXTS = (77, 248)
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
    token_counter: str = ""
    token_lengths: dict[str, float] = field(default_factory=dict)  # min, mean, p50, p90, p99, max
    truncated_share: dict[str, float] = field(default_factory=dict)  # context length -> share of captions over it

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
        kinds = ", ".join(f"{n} {k}" for k, n in sorted(self.error_counts.items())) or "none"
        lines.append(f"errors: {kinds}")
        lines += [f"  {e}" for e in self.errors[:20]]
        if len(self.errors) > 20:
            lines.append(f"  ... and {len(self.errors) - 20} more")
        lines.append(f"duplicate captions: {self.duplicate_captions}; duplicate images: {self.duplicate_images}")
        if self.token_lengths:
            t = self.token_lengths
            lines.append(
                f"tokens ({self.token_counter}): min {t['min']:.0f}, mean {t['mean']:.1f}, p50 {t['p50']:.0f}, "
                f"p90 {t['p90']:.0f}, p99 {t['p99']:.0f}, max {t['max']:.0f}"
            )
            lines.append("truncated: " + ", ".join(f"{v:.1%} at {k}" for k, v in self.truncated_share.items()))
        lines.append("OK" if self.ok else f"FAILED: {len(self.errors)} errors")
        return "\n".join(lines)


def detect_format(path: Path) -> str:
    """The release format of the folder (or file) at `path`, from its tell-tale files; `generic` otherwise."""
    if path.is_file():
        return "generic"
    for name, fmt in DETECT:
        if (path / name).exists():
            return fmt
    if list(path.glob("*.parquet")) or list(path.glob("data/*.parquet")):
        return "ultraedit"
    return "generic"


def _check_image(
    source: ImageSource, sample: Sample, errors: list[BadSample], max_pixels: int | None = None
) -> bytes | None:
    """The image's bytes (for duplicate detection) after a full decode; None and an error when it fails."""
    try:
        load_image(source, max_pixels)
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
) -> ValidationReport:
    """Read every record of `split`, decode every image, and gather the report (nothing raises per sample)."""
    report = BadSampleReport("skip")
    samples = read_samples(cfg, split, report)
    rep = ValidationReport(cfg.format, str(data_root(cfg)), split, samples=len(samples))
    images, captions = _images_and_captions(samples)
    bad = list(report.items)
    checked = (_check_image(src, s, bad, cfg.max_image_pixels) for src, s in images)
    digests = [hashlib.sha1(b).hexdigest() for b in checked if b is not None]
    rep.images, rep.captions = len(images), len(captions)
    rep.errors = [str(b) for b in bad]
    rep.error_counts = dict(Counter(b.reason.split(":")[0] for b in bad))
    repeated = {t: n for t, n in Counter(captions).items() if n > 1}
    rep.duplicate_captions = sum(repeated.values())
    rep.duplicate_caption_examples = [t[:80] for t in list(repeated)[:5]]
    rep.duplicate_images = sum(n for n in Counter(digests).values() if n > 1)
    counter = count_tokens or approximate_lengths
    rep.token_counter = token_counter or ("tokenizer" if count_tokens else "approximate: words and punctuation")
    rep.token_lengths, rep.truncated_share = _length_stats(counter(captions))
    return rep


def tokenizer_counter(cfg: DataConfig, tokenizer_path: str | None) -> tuple[Callable | None, str]:
    """Exact token counts from a local HF tokenizer folder, SynthDense's word tokenizer, or none (approximate)."""
    from sharpclip.data import default_tokenizer
    from sharpclip.data.transforms import TextTokenizer

    if tokenizer_path:
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(tokenizer_path, local_files_only=True)
        return TextTokenizer(tok, cfg.context_length).lengths, f"tokenizer at {tokenizer_path}"
    if cfg.format == "synthdense":
        return TextTokenizer(default_tokenizer(cfg), cfg.context_length).lengths, "SynthDense word tokenizer"
    return None, ""


def config_for(target: str, overrides: Sequence[str] = (), fmt: str | None = None) -> DataConfig:
    """The data config of a YAML recipe, or one for a data folder/file whose format is detected (or given)."""
    from sharpclip.config import load_config

    path = Path(target)
    if path.suffix in (".yaml", ".yml"):
        cfg = load_config(path, overrides).data
        return cfg if fmt is None else DataConfig(**{**vars(cfg), "format": fmt})
    if not path.exists():
        raise FileNotFoundError(f"{path}: no such config file or data folder")
    cfg = DataConfig(format=fmt or detect_format(path), root=str(path))
    if cfg.format == "synthdense" and (path / "manifest.json").is_file():  # validate the corpus as it was generated
        import json

        from sharpclip.config import SynthDenseConfig

        found = json.loads((path / "manifest.json").read_text(encoding="utf-8")).get("config", {})
        cfg.synthdense = SynthDenseConfig(**found)
    return cfg


def default_split(cfg: DataConfig) -> str:
    """The split `validate-data` checks when none is given: the format's default, else data.train_split."""
    return DEFAULT_SPLIT.get(cfg.format, cfg.train_split)
