"""The evaluation suite: named benchmarks → one JSON report, a markdown table and the eval manifest.

    run_suite(model, cfg.eval, cfg.data) -> SuiteResult      (model: a DualEncoder or any eval.embed.Embedder)
    write_report(result, manifest, out_dir)                   -> eval_report.json, eval_report.md, eval_manifest.json

Benchmark names (`DATASETS`): the retrieval formats of sharpclip.data.formats (docci, dci, long_dci, urban1k,
sharegpt4v, karpathy = COCO/Flickr 5-caption, with `coco` and `flickr30k` the same reader under their own roots,
generic, vg), the pair-choice suites (mmvp, winoground, sugarcrepe, aro_relation, aro_attribution), SynthDense
(synthdense: retrieval on its test split; synth_mmvp: its MMVP-style pairs, scored like MMVP-VLM per pattern),
zeroshot (an image folder per class, or a CSV), and "retrieval" (the run's own data.format on data.eval_split).
Other modules add theirs with `register_dataset`.

Bad samples follow each suite's `on_bad_sample` (`eval.data_options.<suite>.on_bad_sample`, default error): under
`skip` a malformed record, an empty caption or a missing / unreadable image (every image is decoded once up front)
leaves its item out, and the report and the manifest say how many were skipped. `run_eval` also refuses a suite
that shares images with the run's training data (or warns, under data.overlap: warn).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

from sharpclip.config import DataConfig, EvalConfig
from sharpclip.data.formats.hf import resolve_hub_folder
from sharpclip.data.schema import BadSample, BadSampleReport
from sharpclip.eval import pair_data, pair_hub, pairs
from sharpclip.eval.embed import CachedEmbedder, Embedder, ModelEmbedder
from sharpclip.eval.manifest import dataset_record
from sharpclip.eval.pair_data import ChoiceSet
from sharpclip.eval.retrieval import RetrievalSet, evaluate_retrieval, from_samples
from sharpclip.eval.zeroshot import PROMPT_SETS, ClassificationSet, evaluate_zeroshot, read_csv, read_image_folder

EvalSet = RetrievalSet | ChoiceSet | ClassificationSet
Reader = Callable[[Path, EvalConfig, "DataConfig | None"], EvalSet]
RETRIEVAL_FORMATS = ("docci", "dci", "long_dci", "urban1k", "sharegpt4v", "karpathy", "generic", "vg")
SUITE_FORMATS = {"coco": "karpathy", "flickr30k": "karpathy"}  # suites reading a format under another name


def _image_problem(source: Any) -> str | None:
    """Why an image cannot be used ("missing file: ..." / "unreadable image: ..."), or None when it decodes."""
    from sharpclip.data.images import ImageLoadError
    from sharpclip.data.images import load_image as load_source
    from sharpclip.eval.embed import ImageRef, load_image

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
    from sharpclip.data.formats import FORMATS

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


def _choice_reader(name: str, read: Callable[..., ChoiceSet], with_report: bool = False) -> Reader:
    """Pair-choice suite `name` under its `on_bad_sample` (eval.data_options.<name>); readers that take a report
    also skip malformed records."""

    def reader(root: Path, cfg: EvalConfig, data: DataConfig | None) -> ChoiceSet:
        policy = cfg.data_options.get(name, {}).get("on_bad_sample", "error")
        report = BadSampleReport(policy, setting=f"eval.data_options.{name}.on_bad_sample")
        return _usable_choices(read(root, report) if with_report else read(root), report)

    return reader


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
    "synthdense": _data_reader("generic", "synthdense"),  # SynthDense is written in the generic format (data.synthetic)
    "synth_mmvp": _choice_reader("synth_mmvp", pair_data.read_synth_mmvp),
    "mmvp": _choice_reader("mmvp", pair_data.read_mmvp),
    "winoground": _choice_reader("winoground", pair_data.read_winoground, with_report=True),
    "sugarcrepe": _choice_reader("sugarcrepe", pair_hub.read_sugarcrepe_any),  # hub parquet or release JSON
    "aro_relation": _choice_reader("aro_relation", lambda root: pair_data.read_aro(root, "relation")),
    "aro_attribution": _choice_reader("aro_attribution", lambda root: pair_data.read_aro(root, "attribution")),
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


def choice_scores(embedder: Embedder, cs: ChoiceSet) -> torch.Tensor:
    """(N, n_texts, n_images): every caption of an item against every image of the same item."""
    flat_images = [ref for item in cs.images for ref in item]
    flat_texts = [t for item in cs.texts for t in item]
    img = embedder.images(flat_images).reshape(len(cs), len(cs.images[0]), -1)
    txt = embedder.texts(flat_texts).reshape(len(cs), len(cs.texts[0]), -1)
    return torch.einsum("ntd,nid->nti", txt.float(), img.float())


def score_choice_set(embedder: Embedder, cs: ChoiceSet) -> dict[str, Any]:
    """The metrics of a pair-choice set, by its kind's scorer in eval/pairs.py."""
    s = choice_scores(embedder, cs)
    if cs.kind == "mmvp":
        qids = cs.extra.get("qids")
        return pairs.mmvp_scores(s, cs.groups, pairs.mmvp_ground_truth(qids) if qids else None)
    if cs.kind == "winoground":
        return pairs.winoground_scores(s)
    if cs.kind == "sugarcrepe":
        return pairs.sugarcrepe_report(pairs.sugarcrepe_scores(s[:, 0, 0], s[:, 1, 0], cs.groups))
    if cs.kind == "aro_relation":
        return pairs.aro_relation_scores(s[:, :, 0], cs.groups)
    if cs.kind == "aro_attribution":
        return pairs.aro_attribution_scores(s[:, :, 0], cs.groups)
    raise ValueError(f"{cs.name}: no scorer for pair-choice kind {cs.kind!r}")


def load_prompts(spec: str) -> tuple[str, ...]:
    """A named prompt set or a file with one template (containing '{}') per line."""
    if spec in PROMPT_SETS:
        return PROMPT_SETS[spec]
    path = Path(spec)
    if not path.is_file():
        raise ValueError(f"eval.prompts: {spec!r} is neither a prompt set ({', '.join(PROMPT_SETS)}) nor a file")
    return tuple(line.strip() for line in path.read_text().splitlines() if line.strip())


def evaluate_set(embedder: Embedder, es: EvalSet, cfg: EvalConfig) -> dict[str, Any]:
    """The metrics of one eval set, with a `task` key naming the protocol."""
    if isinstance(es, RetrievalSet):
        return {"task": "retrieval", **evaluate_retrieval(embedder, es, cfg.recall_k, cfg.chunk_size)}
    if isinstance(es, ChoiceSet):
        return {"task": es.kind, "items": len(es), **score_choice_set(embedder, es)}
    return {"task": "zeroshot", **evaluate_zeroshot(embedder, es, load_prompts(cfg.prompts), cfg.zeroshot_k)}


@dataclass
class SuiteResult:
    """results: suite name -> metrics; datasets: suite name -> manifest record; embedder: what embedded them."""

    results: dict[str, dict[str, Any]] = field(default_factory=dict)
    datasets: dict[str, dict[str, Any]] = field(default_factory=dict)
    embedder: Any = None


def _eval_images(es: EvalSet) -> list[Any]:
    if isinstance(es, ChoiceSet):
        return [r for item in es.images for r in item]
    return list(es.images)


def as_embedder(model: Any, cfg: EvalConfig) -> Embedder:
    """An Embedder as is; a DualEncoder wrapped with CLIP preprocessing at its image size and its own tokenizer."""
    if isinstance(model, Embedder):
        return model
    from sharpclip.data.transforms import model_transforms
    from sharpclip.devices import resolve_device

    device = resolve_device(cfg.device, "eval.device")
    model.to(device)
    preprocess, tokenizer = model_transforms(model, alpha=cfg.image_alpha)
    return ModelEmbedder(model, preprocess, tokenizer, cfg.batch_size, device, cfg.progress, cfg.jpeg_draft)


def _image_files(es: EvalSet) -> list[Path]:
    """The image files an eval set reads (zip members and non-file sources left out), for the overlap check."""
    out = []
    for ref in _eval_images(es):
        if isinstance(ref, str | Path):
            out.append(Path(ref))
        elif getattr(ref, "member", None) is None and isinstance(getattr(ref, "path", None), str):
            out.append(Path(ref.path))
    return out


def run_suite(
    model: Any,
    cfg: EvalConfig,
    data: DataConfig | None = None,
    train_images: list[Path] | None = None,
    overlap: str = "error",
) -> SuiteResult:
    """Evaluate every suite of `cfg.suites`; each distinct image and caption is embedded once across suites.

    train_images: the image files the model was trained on; a suite sharing any refuses to run (`overlap: error`,
    before anything is embedded) or is logged (`warn`), naming how many (data.overlap)."""
    from sharpclip.data.overlap import check_overlap

    sets = {name: load_eval_set(name, cfg, data) for name in cfg.suites}
    if train_images:
        for name, es in sets.items():
            check_overlap(train_images, _image_files(es), f"eval suite {name!r}", overlap)
    inner = as_embedder(model, cfg)
    embedder = CachedEmbedder(inner)
    was_training = getattr(model, "training", False)
    if hasattr(model, "eval"):
        model.eval()
    out = SuiteResult(embedder=inner)
    try:
        for name, es in sets.items():
            skipped = getattr(es, "skipped", [])
            out.results[name] = {**evaluate_set(embedder, es, cfg), "skipped": len(skipped)}
            root = data.root if name == "retrieval" and data is not None else str(suite_root(name, cfg))
            out.datasets[name] = {
                "root": root,
                **dataset_record(es.files, _eval_images(es), cfg.hash_images),
                "skipped": {"count": len(skipped), "samples": [str(b) for b in skipped[:20]]},
            }
    finally:
        if was_training:
            model.train()
    return out


RUN_CONFIG = "config.yaml"  # the resolved config a training run writes (train.run.RESOLVED_CONFIG)


def training_data(cfg: Any) -> DataConfig:
    """The data a model was trained on: the config's own data section when it names a root (a recipe passed to
    `sharpclip eval`), else the `config.yaml` of the run whose checkpoint `model.name` is
    (`RUN/checkpoints/step-N`), else the config's (empty) data section."""
    if cfg.data.root:
        return cfg.data
    model = Path(cfg.model.name).expanduser()
    run_config = model.parent.parent / RUN_CONFIG if model.parent.name == "checkpoints" else None
    if run_config is None or not run_config.is_file():
        return cfg.data
    from sharpclip.config import load_config

    return load_config(run_config).data


def training_images(data: DataConfig) -> list[Path]:
    """The image files of the run's training split (and edit pairs), or [] when the config names no training data
    (data.root empty) or it cannot be read here (logged: the overlap check is then not done)."""
    if not data.root:
        return []
    from sharpclip.data import read_edit_samples, read_samples
    from sharpclip.data.overlap import sample_images
    from sharpclip.data.schema import log

    lenient = replace(data, on_bad_sample="skip")
    try:
        samples = read_samples(lenient, data.train_split)
        if data.edits_format:
            samples += read_edit_samples(lenient)
    except (OSError, ValueError) as err:
        log.warning("eval: the training data (%s at %s) cannot be read, so the suites are not checked for "
                    "overlap with it: %s", data.format, data.root, err)  # fmt: skip
        return []
    return sample_images(samples)


def _fmt(x: Any) -> str:
    return f"{x:.2f}" if isinstance(x, float) else str(x)


def markdown_report(results: dict[str, dict[str, Any]], ks: list[int]) -> str:
    """Retrieval rows (T→I and I→T R@K) in one table, every other suite's headline numbers in a second."""
    lines = []
    retrieval = {k: v for k, v in results.items() if v.get("task") == "retrieval"}
    if retrieval:
        cols = [f"T→I R@{k}" for k in ks] + [f"I→T R@{k}" for k in ks]
        lines += ["| suite | " + " | ".join(cols) + " |", "|---" * (len(cols) + 1) + "|"]
        for name, r in retrieval.items():
            vals = [r["t2i"][f"R@{k}"] for k in ks] + [r["i2t"][f"R@{k}"] for k in ks]
            lines.append(f"| {name} | " + " | ".join(_fmt(v) for v in vals) + " |")
        lines.append("")
    others = {k: v for k, v in results.items() if v.get("task") != "retrieval"}
    if others:
        lines += ["| suite | metric | value |", "|---|---|---|"]
        for name, r in others.items():
            for key, value in r.items():
                if isinstance(value, float):
                    lines.append(f"| {name} | {key} | {_fmt(value)} |")
                elif isinstance(value, dict):
                    lines += [f"| {name} | {key}: {k} | {_fmt(v)} |" for k, v in value.items()]
        lines.append("")
    return "\n".join(lines)


def write_report(result: SuiteResult, manifest: dict[str, Any], out_dir: str | Path, ks: list[int]) -> list[Path]:
    """eval_report.json (metrics), eval_report.md (tables) and eval_manifest.json, side by side in `out_dir`."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = [out / "eval_report.json", out / "eval_report.md", out / "eval_manifest.json"]
    paths[0].write_text(json.dumps(result.results, indent=2) + "\n")
    paths[1].write_text(markdown_report(result.results, ks))
    paths[2].write_text(json.dumps(manifest, indent=2, default=str) + "\n")
    return paths


def suite_manifest(result: SuiteResult, model: Any, cfg: EvalConfig, model_name: str = "") -> dict[str, Any]:
    """The eval manifest of a finished suite run (see eval/manifest.py)."""
    from dataclasses import asdict

    from sharpclip.eval.manifest import build_manifest, model_record, preprocessing_record

    emb = result.embedder
    tok = getattr(emb, "tokenizer", None)
    text = {
        "tokenizer": type(getattr(tok, "tokenizer", tok)).__name__ if tok is not None else None,
        "cleaning": getattr(tok, "cleaning", None),
        "context_length": getattr(tok, "context_length", None),
        "captions_embedded": getattr(emb, "num_captions", None),
        "captions_truncated": getattr(emb, "num_truncated", None),
    }
    uses_prompts = any(r.get("task") == "zeroshot" for r in result.results.values())
    prompts = {
        "set": cfg.prompts,
        "templates": list(load_prompts(cfg.prompts)) if uses_prompts else None,
        "mmvp_prefix": pair_data.MMVP_PROMPT,
    }
    is_module = isinstance(model, torch.nn.Module)
    image = preprocessing_record(getattr(emb, "preprocess", None))
    if getattr(emb, "draft_size", None):  # recorded only when used: the pixels are not the full decode's
        image["jpeg_draft"] = f"JPEG decoded at the smallest DCT scale keeping both sides >= {emb.draft_size} px"
    settings = asdict(cfg)
    if getattr(emb, "device", None) is not None:
        settings["device"] = str(emb.device)  # the resolved device, not "auto"
    return build_manifest(
        model=model_record(model, model_name) if is_module else {"name": model_name, "class": type(model).__name__},
        image=image,
        text=text,
        prompts=prompts,
        datasets=result.datasets,
        settings=settings,
    )


def run_eval(cfg: Any, model: Any = None) -> list[Path]:
    """Entry point for `sharpclip eval`: build the model (models.create_model) unless given, run the suite, write the
    report, the markdown table and the manifest into eval.output_dir (default <train.output_dir>/eval).

    When the training data is known (the config's data section, or the run that wrote the checkpoint being
    evaluated), every suite is first checked against the images of its training split: shared images refuse the
    run unless data.overlap=warn."""
    if model is None:
        from sharpclip.models.factory import create_model

        model = create_model(cfg.model)
    trained_on = training_data(cfg)
    result = run_suite(model, cfg.eval, cfg.data, training_images(trained_on), trained_on.overlap)
    manifest = suite_manifest(result, model, cfg.eval, cfg.model.name)
    out_dir = cfg.eval.output_dir or str(Path(cfg.train.output_dir) / "eval")
    return write_report(result, manifest, out_dir, list(cfg.eval.recall_k))
