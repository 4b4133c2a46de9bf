"""The demo's training stages, each an ordinary `sharpclip train` configuration built by `build_trainer`.

The strong initialisation HN-CLIP fine-tunes from is made as CLIP and then Long-CLIP were, in two stages cached
together under `<cache>/demo-init-<key>/` (the key hashes everything that determines either stage, so a second demo
reuses both; a finished stage A survives an interrupted stage A2):

- stage A (`stage_a/`, CLIP's stage): a tiny CLIP from scratch on SynthDense's shape + colour coarse captions ("a
  picture of a red circle, ..."), at a 32-token context (shape-only captions proved too weak an init) (coarse captions
  fit in 25 tokens);
- stage A2 (`stage_a2/`, Long-CLIP's stage): stage A stretched to the dense captions' 152 positions by Long-CLIP's
  rule (models.long_context: 20 positions kept and frozen, the rest interpolated) and trained with InfoNCE on
  dense captions of the same scenes (SynthDense's `pretrain_noisy`). Profile fields set how often each size and
  texture word is drawn at random instead of being the image's (`a2_detail_random_p`: 1 is alt-text that names
  details unreliably, so A2 learns not to trust them; 0 the true captions), how many detail pairs (a scene and its
  near-duplicate in one detail, in one batch) A2 adds (`a2_detail_pairs`, a corpus of their own: stage A never
  reads them) and whether A2's scale is learnt or frozen (`a2_scale`); the task variants (demo.plan.TASKS) differ
  only in these and in `a2_steps`.

Stage B: one fine-tuning run per arm (demo.plan) on the true dense captions, whose size and texture words are the
target task's shift (its test families' near-duplicates differ only there), from the A2 init, with the same seed and
number of steps, in the paper's regime (micro-batches 16 × 8, each its own InfoNCE problem), the logit scale frozen
at `Profile.scale` (100; paper-geometry: its A2's own frozen 500) unless the arm says otherwise, and the per-epoch
validation on a second SynthDense corpus (another seed's test families), so that the test split is only read at the
end. Each validation also records the validation captions' geometry and the saturation of fixed training
micro-batches with and without near-twin pairs (arm_validator).
"""

from __future__ import annotations

import gc
import hashlib
import json
import logging
import math
import threading
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from sharpclip.analysis.dynamics import read_jsonl
from sharpclip.config import Config, DataConfig, SynthDenseConfig, load_config, to_yaml
from sharpclip.data import read_samples
from sharpclip.data.synthdense.corpus import VERSION as generator
from sharpclip.data.synthdense.corpus import identity as corpus_identity
from sharpclip.demo.measure import PROBE_MICRO_BATCHES, along_training, probe_micro_batches, with_measures
from sharpclip.demo.plan import Arm, Profile, term_overrides
from sharpclip.eval.evaluator import Evaluate, retrieval_validator
from sharpclip.models.base import DualEncoder
from sharpclip.models.factory import save_checkpoint
from sharpclip.progress import showing
from sharpclip.train.logging import log
from sharpclip.train.run import build_trainer
from sharpclip.train.run_dir import open_run_dir

INIT_VERSION = 3  # bump when a stage's recipe changes, so caches of the old one are not reused


def corpus(p: Profile) -> SynthDenseConfig:
    """The fine-tuning corpus: training scenes (+ detail pairs), test families, edits, MMVP pairs, zero-shot classes."""
    return SynthDenseConfig(
        resolution=p.image_size, train_families=p.train_families, train_family_size=p.train_family_size,
        train_detail_pairs=p.train_detail_pairs, test_families=p.test_families, test_variants=p.test_variants,
        test_changed_objects=p.test_changed_objects, pretrain_scenes=0, edits=p.edits, mmvp_pairs=p.mmvp_pairs,
        zeroshot_per_class=p.zeroshot_per_class,
    )  # fmt: skip


def validation_corpus(p: Profile) -> SynthDenseConfig:
    """Held-out families for the convergence curves: the test split of a corpus drawn with another seed."""
    return SynthDenseConfig(
        seed=1, resolution=p.image_size, train_families=0, test_families=p.val_families, test_variants=p.test_variants,
        test_changed_objects=p.test_changed_objects, pretrain_scenes=0, edits=0, mmvp_pairs=0,
    )  # fmt: skip


def pretrain_corpus(p: Profile) -> SynthDenseConfig:
    """Stage A's and A2's scenes; A2's `pretrain_noisy` randomises each detail word with `a2_detail_random_p`."""
    return SynthDenseConfig(
        resolution=p.image_size, train_families=0, test_families=0, pretrain_scenes=p.pretrain_scenes, edits=0,
        mmvp_pairs=0, detail_random_p=p.a2_detail_random_p,
    )  # fmt: skip


def a2_corpus(p: Profile) -> SynthDenseConfig:
    """Stage A2's scenes: stage A's, plus `a2_detail_pairs` detail pairs (which stage A must not see: a pair's two
    coarse captions are the same caption)."""
    return replace(pretrain_corpus(p), pretrain_detail_pairs=p.a2_detail_pairs)


def a2_root(p: Profile, home: Path) -> Path:
    """Where A2's corpus lives: stage A's corpus when A2 adds no pairs, else a corpus of its own."""
    return home / ("synthdense-a2" if p.a2_detail_pairs else "synthdense")


def data_config(root: Path, sd: SynthDenseConfig) -> DataConfig:
    return DataConfig(format="synthdense", root=str(root), synthdense=sd)


def _dotted(prefix: str, values: dict) -> list[str]:
    return [f"{prefix}.{k}={v}" for k, v in values.items()]


def _model_overrides(p: Profile) -> list[str]:
    sizes = dict(width=p.width, layers=p.layers, image_size=p.image_size, patch_size=p.patch_size)
    sizes["context_length"] = p.init_context_length
    return ["model.name=tiny-clip", "model.vocabulary=synthdense", *_dotted("model.tiny", sizes)]


def _train_overrides(
    out: Path, seed: int, steps: int, batch: int, lr: float, progress: bool, micro: int = 0
) -> list[str]:
    # micro 0: one micro-batch per step (per_micro_batch is then exact, without cached accumulation's second pass)
    values = dict(
        output_dir=out, seed=seed, max_steps=steps, epochs=10**6, batch_size=batch, micro_batch_size=micro or batch,
        accumulation="per_micro_batch", lr=lr, warmup_steps=max(1, steps // 20), checkpoint_every=0, keep_last=1,
        progress=progress, stop_signals=[],  # a demo stopped by a signal starts its arm over: no stop checkpoint
    )  # fmt: skip
    return _dotted("train", values)


def _data_overrides(root: Path, sd: SynthDenseConfig) -> list[str]:
    values = {k: v for k, v in asdict(sd).items() if k != "workers"}
    # every stage trains for several epochs on a few thousand small images: decode them once (data.preload)
    return ["data.format=synthdense", f"data.root={root}", "data.preload=true", *_dotted("data.synthdense", values)]


# -- stage A and A2: the initialisation ----------------------------------------------------------------------
def init_config(p: Profile, home: Path, progress: bool) -> Config:
    """Stage A: a tiny CLIP from scratch on shape + colour coarse captions at a 32-token context (CLIP's stage)."""
    overrides = _model_overrides(p) + _data_overrides(home / "synthdense", pretrain_corpus(p))
    overrides += _train_overrides(home / "stage_a" / "run", 0, p.init_steps, p.init_batch_size, p.init_lr, progress)
    overrides += ["data.train_split=coarse_colours", "train.eval_every=0", "train.grad_clip=5.0"]
    return load_config(None, overrides)


def a2_config(p: Profile, home: Path, progress: bool) -> Config:
    """Stage A2 (Long-CLIP's stage): stage A stretched to `context_length` positions, trained with InfoNCE and a
    learnable scale (frozen at `p.a2_scale` when > 0) on `p.a2_split`, dense captions of the same pre-training scenes
    whose detail words are random with probability `p.a2_detail_random_p`."""
    overrides = [f"model.name={home / 'stage_a' / 'model'}", f"model.context_length={p.context_length}"]
    if p.a2_scale > 0:
        overrides += ["model.logit_scale_learnable=false", f"model.logit_scale_init={math.log(p.a2_scale)}"]
    overrides += [*_data_overrides(a2_root(p, home), a2_corpus(p)), f"data.train_split={p.a2_split}"]
    overrides += _train_overrides(home / "stage_a2" / "run", 0, p.a2_steps, p.a2_batch_size, p.a2_lr, progress)
    return load_config(None, [*overrides, "train.eval_every=0", "train.grad_clip=5.0"])


def init_key(p: Profile) -> str:
    """What determines the init (both stages): the recipe version, model sizes, corpus, steps, lr and batch sizes."""
    fields = {k: v for k, v in asdict(p).items() if k.startswith(("init_", "a2_")) or k in _INIT_FIELDS}
    fields = {k: v for k, v in fields.items() if not (k in _LATER_FIELDS and v == _LATER_FIELDS[k])}
    if p.a2_scale > 100:  # the losses cut a frozen scale to 100 before they used it as given: such caches hold inits
        # trained at 100, so they are not reused
        fields["a2_scale_as_given"] = True
    sd = pretrain_corpus(p)
    corpus_id = {"generator": generator, **corpus_identity(sd), "workers": sd.workers}
    blob = json.dumps({"v": INIT_VERSION, **fields, "corpus": corpus_id}, sort_keys=True)
    return hashlib.sha1(blob.encode()).hexdigest()[:12]


_INIT_FIELDS = ("width", "layers", "image_size", "patch_size", "pretrain_scenes", "context_length")
# Profile fields added after INIT_VERSION 3, with the value that reproduces its init: at that value a field stays out
# of the key, so caches made before it existed are still found (as data.synthdense.corpus.LATER_FIELDS does for corpora)
_LATER_FIELDS = {"a2_detail_random_p": 1.0, "a2_scale": 0.0, "a2_detail_pairs": 0}


def init_home(p: Profile, cache: Path) -> Path:
    return cache / f"demo-init-{init_key(p)}"


@dataclass
class Init:
    model_dir: Path  # stage A2's model: what every arm starts from
    seconds: float  # what both stages took when they were made
    reused: bool
    record: dict  # per stage: seconds, steps, final loss and scale; "stage_a_dir"

    @property
    def stage_a_dir(self) -> Path:
        return Path(self.record["stage_a_dir"])


HEARTBEAT_S = 60.0  # a pre-training stage prints where it is this often (the bar does it on a terminal)


class _heartbeat:
    """While a stage trains: a line every `every` seconds with its last logged step and loss (metrics.jsonl), so a
    redirected first demo is not silent for the minutes its init takes; nothing while a bar shows."""

    def __init__(self, name: str, metrics: Path, steps: int, every: float = HEARTBEAT_S):
        self.name, self.metrics, self.steps, self.every = name, metrics, steps, every
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._beat, daemon=True, name=f"demo-heartbeat-{name}")

    def _beat(self) -> None:
        start = time.perf_counter()
        while not self.stop.wait(self.every):
            if showing():
                continue
            last = _last_step(self.metrics) if self.metrics.is_file() else {}
            at = f"step {last['step']}/{self.steps}, loss {last['loss']:.3f}" if "step" in last else "starting"
            print(f"  {self.name}: {at} ({time.perf_counter() - start:.0f} s)", flush=True)

    def __enter__(self) -> None:
        self.thread.start()

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self.thread.join()


def _run_stage(cfg: Config, home: Path, steps: int) -> dict:
    """Train one stage into `home` (config.yaml, run/, model/); its record, written last as `home`/done.json."""
    done = home / "done.json"
    if done.is_file():  # an interrupted demo keeps a finished stage A
        print(f"  {home.name}: kept from an earlier, interrupted demo", flush=True)
        return json.loads(done.read_text())
    start = time.perf_counter()
    home.mkdir(parents=True, exist_ok=True)
    (home / "config.yaml").write_text(to_yaml(cfg))
    print(f"  {home.name}: training {steps} steps of {cfg.train.batch_size} rows (log: {home / 'run'})", flush=True)
    # the cache's own run folder: a stage A interrupted before init.json was written is redone from scratch
    with (
        open_run_dir(home / "run", "overwrite"),
        _file_log(home / "run" / "train.log"),
        _heartbeat(home.name, home / "run" / "metrics.jsonl", steps),
    ):
        trainer = build_trainer(cfg)
        trainer.fit()
    save_checkpoint(trainer.model, home / "model", cfg.model)
    last = _last_step(home / "run" / "metrics.jsonl")
    record = {"seconds": time.perf_counter() - start, "steps": steps, "final_loss": last.get("loss")}
    record["final_scale"] = last.get("logit_scale")
    done.write_text(json.dumps(record, indent=2) + "\n")
    print(f"  {home.name}: done in {record['seconds']:.0f} s, final loss {record['final_loss']:.3f}", flush=True)
    return record


def ensure_init(p: Profile, cache: Path, progress: bool = True) -> Init:
    """The cached two-stage init for profile `p` (stage A, then A2 from it), training what the cache lacks."""
    home = init_home(p, cache)
    record_path = home / "init.json"
    if record_path.is_file():
        record = json.loads(record_path.read_text())
        return Init(home / "stage_a2" / "model", record["seconds"], True, record)
    stage_a = _run_stage(init_config(p, home, progress), home / "stage_a", p.init_steps)
    stage_a2 = _run_stage(a2_config(p, home, progress), home / "stage_a2", p.a2_steps)
    record = {"seconds": stage_a["seconds"] + stage_a2["seconds"], "stage_a": stage_a, "stage_a2": stage_a2}
    record["stage_a_dir"] = str(home / "stage_a" / "model")
    record_path.write_text(json.dumps(record, indent=2) + "\n")  # written last: its presence marks a complete init
    return Init(home / "stage_a2" / "model", record["seconds"], False, record)


def _last_step(path: Path) -> dict:
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
    overrides += ["model.logit_scale_learnable=false", f"model.logit_scale_init={math.log(p.scale)}"]
    overrides += [*_data_overrides(data_root, corpus(p)), "data.train_split=train", "data.eval_split=test"]
    overrides += _train_overrides(out, seed, p.steps, p.batch_size, p.lr, progress, p.micro_batch_size)
    overrides.append("train.eval_every=1")
    if arm.name == "infonce":  # Fig. 4 is measured along the InfoNCE trajectory (both losses' gradients, same batch)
        overrides.append(f"train.diagnostics_every={max(1, p.steps // p.diagnostics)}")
    # rows per forward pass (speed only): exact arms encode the whole batch in one pass (nothing cached), the others
    # several micro-batches a pass, each still its own matrix
    exact = "train.accumulation=exact" in arm.overrides
    passes = f"train.micro_batch_size={p.batch_size}" if exact else f"train.encode_batch_size={p.encode_batch_size}"
    return load_config(None, overrides + list(arm.overrides) + [passes] + term_overrides(arm))


def arm_validator(
    data: DataConfig, validation: DataConfig, micro_batch_size: int, log_scale: float | None = None
) -> Evaluate:
    """The arms' per-epoch validation: retrieval on `validation`'s test split (eval.evaluator) and, of the same
    model, those captions' geometry and the saturation of fixed training micro-batches of `data` with and without
    near-twin pairs (demo.measure.along_training; at the model's own scale, or exp(log_scale) when given)."""
    held_out, train = read_samples(validation, "test"), read_samples(data, "train")
    batches = probe_micro_batches([s.group or s.id for s in train], micro_batch_size, PROBE_MICRO_BATCHES)
    rows = sorted({i for kind in batches.values() for b in kind for i in b})  # embed each probed row once
    where = {i: k for k, i in enumerate(rows)}
    local = {kind: [[where[i] for i in b] for b in bs] for kind, bs in batches.items()}
    captions, probe = [s.caption for s in held_out], [train[i] for i in rows]
    extra = along_training(captions, probe, local, validation.image_alpha, log_scale)
    return with_measures(retrieval_validator(held_out, "test", validation.image_alpha), extra)


def run_arm(cfg: Config, validate: Evaluate) -> tuple[DualEncoder, float]:
    """Fine-tune as `cfg` says, calling `validate` (arm_validator) each epoch; the model and the seconds taken."""
    out = Path(cfg.train.output_dir)
    start = time.perf_counter()
    # the demo's own arm folder (<out>/runs/seed<k>/<arm>): a second demo replaces it rather than mixing two runs;
    # a folder there that is not a run directory is refused (run_dir's overwrite policy), never emptied
    with open_run_dir(out, "overwrite"), _file_log(out / "train.log"):
        (out / "config.yaml").write_text(to_yaml(cfg))
        trainer = build_trainer(cfg, evaluate=validate)
        trainer.fit()
    model = trainer.model.eval()
    # the arm's loaders keep persistent worker processes until collected; collect them now, or the next arm's
    # workers fork with them and print "can only test a child process" when the copies are finalised there
    del trainer
    gc.collect()
    return model, time.perf_counter() - start
