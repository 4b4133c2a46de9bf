"""The benchmarks `sharpclip eval` knows: their names, where each is read from, and how (`load_eval_set`).

Benchmark names (`DATASETS`): the retrieval formats of sharpclip.data.formats (docci, dci, long_dci, urban1k,
sharegpt4v, karpathy = COCO/Flickr 5-caption, with `coco` and `flickr30k` the same reader under their own roots,
generic, vg), the pair-choice suites (mmvp, winoground, sugarcrepe, aro_relation, aro_attribution, spec), SynthDense
(synthdense: retrieval on its test split; synth_mmvp: its MMVP-style pairs, scored like MMVP-VLM per pattern),
zeroshot (an image folder per class, or a CSV), and "retrieval" (the run's own data.format on data.eval_split).
Other modules add theirs with `register_dataset`.

Bad samples follow each suite's `on_bad_sample` (`eval.data_options.<suite>.on_bad_sample`, default error): under
`skip` a malformed record, an empty caption or a missing / unreadable image (every image is decoded once up front)
leaves its item out, and the report and the manifest say how many were skipped.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

from sharpclip.config import DataConfig, EvalConfig
from sharpclip.data.formats import FORMATS
from sharpclip.data.formats.hf import resolve_hub_folder
from sharpclip.data.images import ImageLoadError
from sharpclip.data.images import load_image as load_source
from sharpclip.data.schema import BadSample, BadSampleReport
from sharpclip.eval import pair_data, pair_hub, spec_data
from sharpclip.eval.embed import ImageRef, UnreadableImage, load_image
from sharpclip.eval.pair_data import ChoiceSet
from sharpclip.eval.retrieval import RetrievalSet, from_samples
from sharpclip.eval.zeroshot import ClassificationSet, read_csv, read_image_folder

log = logging.getLogger(__name__)
EvalSet = RetrievalSet | ChoiceSet | ClassificationSet
Reader = Callable[[Path, EvalConfig, "DataConfig | None"], EvalSet]
RETRIEVAL_FORMATS = ("docci", "dci", "long_dci", "urban1k", "sharegpt4v", "karpathy", "generic", "vg")
SUITE_FORMATS = {"coco": "karpathy", "flickr30k": "karpathy"}  # suites reading a format under another name


def _image_problem(source: Any) -> str | None:
    """Why an image cannot be used ("missing file: ..." / "unreadable image: ..."), or None when it decodes."""
    try:
        load_image(source) if isinstance(source, ImageRef | str | Path) else load_source(source)
    except FileNotFoundError as err:
        return f"missing file: {err}"
    except ImageLoadError as err:
        return err.reason
    return None


def _usable(samples: list, report: BadSampleReport) -> list:
    """Under `skip`, the samples whose image decodes (the others reported); under `error`, all of them (a bad
    image then raises when it is embedded)."""
    if report.policy != "skip":
        return samples
    kept = []
    for s in samples:
        problem = _image_problem(s.image)
        if problem is None:
            kept.append(s)
        else:
            report.add(BadSample(s.source or str(s.image), s.id, problem))
    return kept


def _retrieval_set(name: str, data_cfg: DataConfig, split: str) -> RetrievalSet:
    report = BadSampleReport(data_cfg.on_bad_sample, setting=f"eval.data_options.{name}.on_bad_sample")
    samples = _usable(FORMATS[data_cfg.format](Path(data_cfg.root), split, data_cfg, report), report)
    es = from_samples(name, samples, report.files)  # the annotation files the reader opened, nothing else
    es.skipped = list(report.items)
    return es


def _usable_choices(cs: ChoiceSet, report: BadSampleReport) -> ChoiceSet:
    """Under `skip`, the items whose every image decodes (the others reported, `cs.skipped`)."""
    if report.policy == "skip":
        keep = []
        for i, refs in enumerate(cs.images):
            problems = [p for p in map(_image_problem, refs) if p is not None]
            if problems:
                report.add(BadSample(cs.name, f"item {i}", problems[0]))
            keep.append(not problems)
        cs = replace(
            cs,
            images=[x for x, k in zip(cs.images, keep, strict=True) if k],
            texts=[x for x, k in zip(cs.texts, keep, strict=True) if k],
            groups=[x for x, k in zip(cs.groups, keep, strict=True) if k],
            extra={key: [x for x, k in zip(v, keep, strict=True) if k] for key, v in cs.extra.items()},
        )
    cs.skipped = list(report.items)
    return cs


def _choice_report(name: str, cfg: EvalConfig) -> BadSampleReport:
    policy = cfg.data_options.get(name, {}).get("on_bad_sample", "error")
    return BadSampleReport(policy, setting=f"eval.data_options.{name}.on_bad_sample")


def _choice_reader(name: str, read: Callable[..., ChoiceSet], with_report: bool = False) -> Reader:
    """Pair-choice suite `name` under its `on_bad_sample` (eval.data_options.<name>); readers that take a report
    also skip malformed records."""

    def reader(root: Path, cfg: EvalConfig, data: DataConfig | None) -> ChoiceSet:
        report = _choice_report(name, cfg)
        return _usable_choices(read(root, report) if with_report else read(root), report)

    return reader


def _spec(root: Path, cfg: EvalConfig, data: DataConfig | None) -> ChoiceSet:
    """SPEC: all six subsets, or those eval.data_options.spec.subsets names (logged, and listed in the report)."""
    report = _choice_report("spec", cfg)
    cs = spec_data.read_spec(root, report, cfg.data_options.get("spec", {}).get("subsets"))
    if len(cs.parts) < len(spec_data.SPEC_SUBSETS):
        total, chosen = len(spec_data.SPEC_SUBSETS), ", ".join(cs.parts)
        log.warning("SPEC: scoring %d of %d subsets (%s, chosen by %s); its means cover these only",
                    len(cs.parts), total, chosen, spec_data.SUBSETS_OPTION)  # fmt: skip
    return _usable_choices(cs, report)


def suite_data_config(name: str, fmt: str, root: Path, cfg: EvalConfig) -> DataConfig:
    """The DataConfig suite `name` reads with: its format and root, eval.split, then eval.data_options[name]."""
    options = {"eval_split": cfg.split, **cfg.data_options.get(name, {})}
    return DataConfig(format=fmt, root=str(root), **options)


def _data_reader(fmt: str, name: str) -> Reader:
    def read(root: Path, cfg: EvalConfig, data: DataConfig | None) -> RetrievalSet:
        data_cfg = suite_data_config(name, SUITE_FORMATS.get(fmt, fmt), root, cfg)
        return _retrieval_set(name, data_cfg, data_cfg.eval_split)

    return read


def _run_data(root: Path, cfg: EvalConfig, data: DataConfig | None) -> RetrievalSet:
    """The run's own data section, every format option included (and eval.data_options.retrieval), on its eval split."""
    if data is None or not data.root:
        raise ValueError("suite 'retrieval' evaluates the run's data (data.format, data.root): set data.root")
    data = replace(data, **cfg.data_options.get("retrieval", {}))
    return _retrieval_set("retrieval", data, data.eval_split)


def _zeroshot(root: Path, cfg: EvalConfig, data: DataConfig | None) -> ClassificationSet:
    return read_csv(root) if root.suffix.lower() == ".csv" else read_image_folder(root, "zeroshot")


DATASETS: dict[str, Reader] = {
    **{fmt: _data_reader(fmt, fmt) for fmt in (*RETRIEVAL_FORMATS, *SUITE_FORMATS)},
    "retrieval": _run_data,
    "synthdense": _data_reader("generic", "synthdense"),  # data.synthdense writes the generic format
    "synth_mmvp": _choice_reader("synth_mmvp", pair_data.read_synth_mmvp),
    "mmvp": _choice_reader("mmvp", pair_data.read_mmvp),
    "winoground": _choice_reader("winoground", pair_data.read_winoground, with_report=True),
    "sugarcrepe": _choice_reader("sugarcrepe", pair_hub.read_sugarcrepe_any),  # hub parquet or release JSON
    "aro_relation": _choice_reader("aro_relation", lambda root: pair_data.read_aro(root, "relation")),
    "aro_attribution": _choice_reader("aro_attribution", lambda root: pair_data.read_aro(root, "attribution")),
    "spec": _spec,  # six subsets (or those chosen), both directions
    "zeroshot": _zeroshot,
}


def register_dataset(name: str, reader: Reader) -> None:
    """Add a benchmark: `reader(root, eval_cfg, data_cfg)` returns a RetrievalSet, ChoiceSet or ClassificationSet."""
    if name in DATASETS:
        raise ValueError(f"eval dataset {name!r} is already registered")
    DATASETS[name] = reader


def suite_root(name: str, cfg: EvalConfig) -> Path:
    """Where suite `name` is read from: eval.roots[name], else <eval.data_root>/<name> if it exists, else data_root."""
    if name in cfg.roots:
        return Path(cfg.roots[name])
    if not cfg.data_root:
        raise ValueError(
            f"eval suite {name!r} has no files to read: eval.data_root is empty and eval.roots.{name} is not set; "
            "pass --data-root DIR (one sub-folder per suite) or set eval.roots"
        )
    base = Path(cfg.data_root)
    return base / name if (base / name).exists() else base


def load_eval_set(name: str, cfg: EvalConfig, data: DataConfig | None = None) -> EvalSet:
    """Read suite `name` from its root (see `suite_root`; "retrieval" reads data.root)."""
    if name not in DATASETS:
        raise ValueError(f"eval suite {name!r} is unknown; choose from {', '.join(sorted(DATASETS))}")
    root = Path(cfg.data_root) if name == "retrieval" else suite_root(name, cfg)  # "retrieval" reads data.root
    root = resolve_hub_folder(root)  # a hub cache folder (datasets--owner--name) reads its newest snapshot
    return DATASETS[name](root, cfg, data)


def eval_images(es: EvalSet) -> list[Any]:
    """Every image ref an eval set reads, flattened (a pair-choice item's images in item order)."""
    if isinstance(es, ChoiceSet):
        return [r for item in es.images for r in item]
    return list(es.images)


def image_files(es: EvalSet) -> list[Path]:
    """The image files an eval set reads (zip members and non-file sources left out), for the overlap check."""
    out = []
    for ref in eval_images(es):
        if isinstance(ref, str | Path):
            out.append(Path(ref))
        elif getattr(ref, "member", None) is None and isinstance(getattr(ref, "path", None), str):
            out.append(Path(ref.path))
    return out


def _name(ref: Any) -> str:
    return ref.describe() if isinstance(ref, ImageRef) else str(ref)


def record_of(es: EvalSet, ref: str) -> str | None:
    """Where the record naming image `ref` is (`count/text2image.json[3]`), when the set keeps it; else None."""
    where = es.extra.get("where") if isinstance(es, ChoiceSet) else None
    if where is None:
        return None
    return next((w for refs, w in zip(es.images, where, strict=True) if any(_name(r) == ref for r in refs)), None)


@contextlib.contextmanager
def naming_the_record(sets: dict[str, EvalSet]) -> Iterator[None]:
    """Around embedding the suites' images under `on_bad_sample: error`: an unreadable image is one line naming the
    record that names it (or its suite) and the setting that skips such samples, not only the file."""
    try:
        yield
    except UnreadableImage as err:
        found = next(((n, record_of(es, err.ref)) for n, es in sets.items() if err.ref in map(_name, eval_images(es))),
                     (None, None))  # fmt: skip
        name, where = found
        place = f"{where}: " if where else f"eval suite {name!r}: " if name else ""
        skip = f"eval.data_options.{name}.on_bad_sample=skip" if name else "on_bad_sample=skip"
        raise FileNotFoundError(f"{place}{err}; fix or remove the record, or set {skip}") from None
