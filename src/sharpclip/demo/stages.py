"""The demo's two training stages, each an ordinary `sharpclip train` configuration built by `build_trainer`.

Stage A (the "strong initialisation" HN-CLIP fine-tunes from): a tiny CLIP trained from scratch on SynthDense's
shape + colour coarse captions ("a picture of a red circle, ..."), the recipe the prototype found to work
(shared/reference/synthdense-feasibility.md: shapes-only captions were too weak). It is made once and cached under
`<cache>/demo-init-<key>/`, the key hashing everything that determines it, so a second demo reuses it. Coarse
captions fit in 32 tokens, so stage A trains a 32-position text tower, and stage B stretches it to the dense captions'
152 by Long-CLIP's rule (models.long_context: 20 positions kept and frozen, the rest interpolated), as Long-CLIP
extends CLIP's 77.

Stage B: one fine-tuning run per arm (demo.plan) on the dense captions, from the cached init, with the same seed and
number of steps, the logit scale frozen at 100 unless the arm says otherwise, and the per-epoch validation on a
second SynthDense corpus (another seed's test families), so that the test split is only read at the end.
"""

from __future__ import annotations

import hashlib
import json
import logging
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from sharpclip.config import Config, DataConfig, SynthDenseConfig, load_config, to_yaml
from sharpclip.demo.plan import SCALE, Arm, Profile, term_overrides
from sharpclip.models.base import DualEncoder
from sharpclip.train.logging import log
from sharpclip.train.run_dir import open_run_dir

INIT_VERSION = 1  # bump when stage A's recipe changes, so caches of the old one are not reused


def corpus(p: Profile) -> SynthDenseConfig:
    """The fine-tuning corpus: independent training scenes (the prototype's v1), test families, edits, MMVP pairs."""
    return SynthDenseConfig(
        resolution=p.image_size, train_families=p.train_families, train_family_size=p.train_family_size,
        test_families=p.test_families, pretrain_scenes=0, edits=p.edits, mmvp_pairs=p.mmvp_pairs,
    )  # fmt: skip


def validation_corpus(p: Profile) -> SynthDenseConfig:
    """Held-out families for the convergence curves: the test split of a corpus drawn with another seed."""
    return SynthDenseConfig(
        seed=1, resolution=p.image_size, train_families=0, test_families=p.val_families, pretrain_scenes=0, edits=0,
        mmvp_pairs=0,
    )  # fmt: skip


def pretrain_corpus(p: Profile) -> SynthDenseConfig:
    return SynthDenseConfig(
        resolution=p.image_size, train_families=0, test_families=0, pretrain_scenes=p.pretrain_scenes, edits=0,
        mmvp_pairs=0,
    )  # fmt: skip


def data_config(root: Path, sd: SynthDenseConfig) -> DataConfig:
    return DataConfig(format="synthdense", root=str(root), synthdense=sd)


def _dotted(prefix: str, values: dict) -> list[str]:
    return [f"{prefix}.{k}={v}" for k, v in values.items()]


def _model_overrides(p: Profile) -> list[str]:
    sizes = dict(width=p.width, layers=p.layers, image_size=p.image_size, patch_size=p.patch_size)
    sizes["context_length"] = p.init_context_length
    return ["model.name=tiny-clip", "model.vocabulary=synthdense", *_dotted("model.tiny", sizes)]


def _train_overrides(out: Path, seed: int, steps: int, batch: int, lr: float, progress: bool) -> list[str]:
    # one micro-batch per step: per_micro_batch is then exact, without cached accumulation's second forward pass
    values = dict(
        output_dir=out, seed=seed, max_steps=steps, epochs=10**6, batch_size=batch, micro_batch_size=batch,
        accumulation="per_micro_batch", lr=lr, warmup_steps=max(1, steps // 20), checkpoint_every=0, keep_last=1,
        progress=progress,
    )  # fmt: skip
    return _dotted("train", values)


def _data_overrides(root: Path, sd: SynthDenseConfig) -> list[str]:
    values = {k: v for k, v in asdict(sd).items() if k != "workers"}
    return ["data.format=synthdense", f"data.root={root}", *_dotted("data.synthdense", values)]


# -- stage A -----------------------------------------------------------------------------------------------------
def init_config(p: Profile, home: Path, progress: bool) -> Config:
    overrides = _model_overrides(p) + _data_overrides(home / "synthdense", pretrain_corpus(p))
    overrides += _train_overrides(home / "run", 0, p.init_steps, p.init_batch_size, p.init_lr, progress)
    overrides += ["data.train_split=coarse_colours", "train.eval_every=0", "train.grad_clip=5.0"]
    return load_config(None, overrides)


def init_key(p: Profile) -> str:
    """What determines the init: the recipe version, model sizes, corpus, steps, lr and batch size."""
    fields = {k: v for k, v in asdict(p).items() if k.startswith("init_") or k in _INIT_FIELDS}
    blob = json.dumps({"v": INIT_VERSION, **fields, "corpus": asdict(pretrain_corpus(p))}, sort_keys=True)
    return hashlib.sha1(blob.encode()).hexdigest()[:12]


_INIT_FIELDS = ("width", "layers", "image_size", "patch_size", "pretrain_scenes")


@dataclass
class Init:
    model_dir: Path
    seconds: float  # what stage A took when it was made
    reused: bool
    record: dict


def ensure_init(p: Profile, cache: Path, progress: bool = True) -> Init:
    """The cached stage-A checkpoint for profile `p`, training it first when the cache has none."""
    home = cache / f"demo-init-{init_key(p)}"
    record_path = home / "init.json"
    if record_path.is_file():
        record = json.loads(record_path.read_text())
        return Init(home / "model", record["seconds"], True, record)
    from sharpclip.models.factory import save_checkpoint
    from sharpclip.train.run import build_trainer

    start = time.perf_counter()
    cfg = init_config(p, home, progress)
    home.mkdir(parents=True, exist_ok=True)
    (home / "config.yaml").write_text(to_yaml(cfg))
    # the cache's own run folder: a stage A interrupted before init.json was written is redone from scratch
    with open_run_dir(home / "run", "overwrite"), _file_log(home / "run" / "train.log"):
        trainer = build_trainer(cfg)
        trainer.fit()
    save_checkpoint(trainer.model, home / "model", cfg.model)
    last = _last_step(home / "run" / "metrics.jsonl")
    record = {"seconds": time.perf_counter() - start, "steps": p.init_steps, "final_loss": last.get("loss")}
    record["final_scale"] = last.get("logit_scale")
    record_path.write_text(json.dumps(record, indent=2) + "\n")  # written last: its presence marks a complete init
    return Init(home / "model", record["seconds"], False, record)


def _last_step(path: Path) -> dict:
    from sharpclip.analysis.dynamics import read_jsonl

    steps = [r for r in read_jsonl(path) if "loss" in r and not r.get("skipped")]
    return steps[-1] if steps else {}


class _file_log:
    """The trainer's log lines go to `path` while the demo's own progress bar holds the terminal."""

    def __init__(self, path: Path):
        path.parent.mkdir(parents=True, exist_ok=True)
        self.handler = logging.FileHandler(path)
        self.handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(message)s", "%H:%M:%S"))

    def __enter__(self) -> None:
        log.addHandler(self.handler)
        self._level = log.level
        log.setLevel(logging.INFO)
        log.propagate = False

    def __exit__(self, *exc: object) -> None:
        log.removeHandler(self.handler)
        self.handler.close()
        log.setLevel(self._level)
        log.propagate = True


# -- stage B -----------------------------------------------------------------------------------------------------
def arm_config(p: Profile, arm: Arm, init: Path, data_root: Path, out: Path, seed: int, progress: bool) -> Config:
    overrides = [f"model.name={init}", f"model.context_length={p.context_length}"]  # the Long-CLIP stretch
    overrides += ["model.logit_scale_learnable=false", f"model.logit_scale_init={SCALE}"]
    overrides += [*_data_overrides(data_root, corpus(p)), "data.train_split=train", "data.eval_split=test"]
    overrides += [*_train_overrides(out, seed, p.steps, p.batch_size, p.lr, progress), "train.eval_every=1"]
    if arm.name == "infonce":  # Fig. 4 is measured along the InfoNCE trajectory (both losses' gradients, same batch)
        overrides.append(f"train.diagnostics_every={max(1, p.steps // p.diagnostics)}")
    return load_config(None, overrides + list(arm.overrides) + term_overrides(arm))


def run_arm(cfg: Config, validation: DataConfig) -> tuple[DualEncoder, float]:
    """Fine-tune as `cfg` says, validating on `validation`'s test split each epoch; the model and the seconds taken."""
    from sharpclip.train.run import build_trainer, retrieval_validator

    out = Path(cfg.train.output_dir)
    start = time.perf_counter()
    # the demo's own arm folder (<out>/runs/seed<k>/<arm>): a second demo replaces it rather than mixing two runs;
    # a folder there that is not a run directory is refused (run_dir's overwrite policy), never emptied
    with open_run_dir(out, "overwrite"), _file_log(out / "train.log"):
        (out / "config.yaml").write_text(to_yaml(cfg))
        trainer = build_trainer(cfg)
        trainer.evaluate = retrieval_validator(trainer.model, validation, "test")
        trainer.fit()
    return trainer.model.eval(), time.perf_counter() - start
