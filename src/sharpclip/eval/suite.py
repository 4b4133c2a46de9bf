"""The evaluation suite: named benchmarks → one report, and the `sharpclip eval` entry point.

    run_suite(model, cfg.eval, cfg.data) -> SuiteResult      (model: a DualEncoder or any eval.embed.Embedder)
    run_eval(cfg)                                             -> eval_report.json, eval_report.md, eval_manifest.json

The benchmarks and their readers are eval.benchmarks', the scoring eval.scoring's, the model's embedder
eval.evaluator's (the one that training's validation and the demo use too), the result and its files eval.report's.
`run_eval` also refuses a suite that shares images with the run's training data (or warns, under data.overlap: warn).
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

from sharpclip.config import DataConfig, EvalConfig, load_config
from sharpclip.data import read_edit_samples, read_samples
from sharpclip.data.overlap import check_overlap, sample_images
from sharpclip.data.schema import log
from sharpclip.devices import configure_tf32, resolve_device
from sharpclip.eval.benchmarks import eval_images, image_files, load_eval_set, suite_root
from sharpclip.eval.embed import CachedEmbedder
from sharpclip.eval.evaluator import as_embedder
from sharpclip.eval.manifest import dataset_record
from sharpclip.eval.report import SuiteResult, check_report_folder, suite_manifest, write_report
from sharpclip.eval.scoring import evaluate_set, set_inputs
from sharpclip.models.factory import create_model


def run_suite(
    model: Any,
    cfg: EvalConfig,
    data: DataConfig | None = None,
    train_images: list[Path] | None = None,
    overlap: str = "error",
    score: bool = True,
) -> SuiteResult:
    """Evaluate every suite of `cfg.suites`; each distinct image and caption is embedded once across suites, all of
    them up front (one `images` and one `texts` call: a sharded embedder's ranks all take part in the same two).

    train_images: the image files the model was trained on; a suite sharing any refuses to run (`overlap: error`,
    before anything is embedded) or is logged (`warn`), naming how many (data.overlap).
    score: False on a rank that only embeds its share for the rank that scores; the result then has no results."""
    sets = {name: load_eval_set(name, cfg, data) for name in cfg.suites}
    if train_images:
        for name, es in sets.items():
            check_overlap(train_images, image_files(es), f"eval suite {name!r}", overlap)
    inner = as_embedder(model, cfg)
    inputs = [set_inputs(es, cfg) for es in sets.values()]
    images = list(dict.fromkeys(ref for refs, _ in inputs for ref in refs))
    texts = list(dict.fromkeys(text for _, captions in inputs for text in captions))
    was_training = getattr(model, "training", False)
    if hasattr(model, "eval"):
        model.eval()
    out = SuiteResult(embedder=inner)
    try:
        if not score:
            inner.images(images)  # this rank's share, sent to the rank that scores
            inner.texts(texts)
            return out
        embedder = CachedEmbedder(inner)
        embedder.fill(images, texts)
        embedder.seal()  # scoring reads the cache only: no rank waits at a gather that the scoring rank alone calls
        for name, es in sets.items():
            skipped = getattr(es, "skipped", [])
            out.results[name] = {**evaluate_set(embedder, es, cfg), "skipped": len(skipped)}
            root = data.root if name == "retrieval" and data is not None else str(suite_root(name, cfg))
            out.datasets[name] = {
                "root": root,
                **dataset_record(es.files, eval_images(es), cfg.hash_images),
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
    return load_config(run_config).data


def training_images(data: DataConfig) -> list[Path]:
    """The image files of the run's training split (and edit pairs), or [] when the config names no training data
    (data.root empty) or it cannot be read here (logged: the overlap check is then not done)."""
    if not data.root:
        return []
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


def run_eval(cfg: Any, model: Any = None) -> list[Path]:
    """Entry point for `sharpclip eval`: build the model (models.create_model) unless given, run the suite, write the
    report, the markdown table and the manifest into eval.output_dir (default <train.output_dir>/eval).

    When the training data is known (the config's data section, or the run that wrote the checkpoint being
    evaluated), every suite is first checked against the images of its training split: shared images refuse the
    run unless data.overlap=warn."""
    out_dir = cfg.eval.output_dir or str(Path(cfg.train.output_dir) / "eval")
    check_report_folder(out_dir)  # a report file there that sharpclip did not write: refused before evaluating
    device = resolve_device(cfg.eval.device, "eval.device")
    configure_tf32(device, cfg.train.tf32)  # before any model runs; the manifest records it
    if model is None:
        model = create_model(cfg.model)
    trained_on = training_data(cfg)
    result = run_suite(model, cfg.eval, cfg.data, training_images(trained_on), trained_on.overlap)
    manifest = suite_manifest(result, model, cfg.eval, cfg.model.name)
    return write_report(result, manifest, out_dir, list(cfg.eval.recall_k))
