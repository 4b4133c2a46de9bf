"""`sharpclip train`: the one place that sees the whole config and wires model, data, objective and trainer.

    run_train(load_config("configs/hnclip_docci.yaml", overrides))
    torchrun --nproc_per_node 2 -m sharpclip train configs/hnclip_docci.yaml   (each rank: batch_size / world)

`train.device` (auto: cuda:<LOCAL_RANK> with CUDA, else cpu) is resolved first: it picks the process group's
backend, the model is moved there before rank 0's weights are broadcast, and the loader pins its batches when it is
a GPU. The resolved devices are logged and recorded at the top of config.yaml.

The model decides the preprocessing: images at its own size and mean/std, captions at its own context length
(data.model_transforms), so a Long-CLIP-stretched tower reads 248 tokens without a second setting to keep in step.
The run directory receives the resolved config (config.yaml), the logs, checkpoints and evaluation results.
"""

from __future__ import annotations

import copy
import logging
import random
from dataclasses import replace
from pathlib import Path

import numpy as np
import torch

from sharpclip import devices
from sharpclip.config import Config, ConfigError, DataConfig, load_config, to_yaml
from sharpclip.models.base import DualEncoder
from sharpclip.train import checkpoint, distributed
from sharpclip.train.logging import log
from sharpclip.train.trainer import Trainer, TrainerState

RESOLVED_CONFIG = "config.yaml"
VALIDATION_KS = (1, 5, 10)


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def _setup_logging(run_dir: Path) -> None:
    if distributed.rank() != 0 or any(getattr(h, "sharpclip", False) for h in log.handlers):
        return
    run_dir.mkdir(parents=True, exist_ok=True)
    for handler in (logging.StreamHandler(), logging.FileHandler(run_dir / "train.log")):
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(message)s", "%H:%M:%S"))
        handler.sharpclip = True  # type: ignore[attr-defined]
        log.addHandler(handler)
    log.setLevel(logging.INFO)


def retrieval_validator(model: DualEncoder, data: DataConfig, split: str):
    """A callback for the trainer: R@1/5/10 both directions on `split`, plus `mean_R@1` (the best-checkpoint key)."""
    from sharpclip.data import read_samples
    from sharpclip.data.transforms import model_transforms
    from sharpclip.eval.embed import ModelEmbedder
    from sharpclip.eval.retrieval import evaluate_retrieval, from_samples

    dataset = from_samples(split, read_samples(data, split))
    preprocess, tokenizer = model_transforms(model)

    def evaluate(model: DualEncoder) -> dict[str, float]:
        embedder = ModelEmbedder(model, preprocess, tokenizer, batch_size=64, progress=False)
        metrics = evaluate_retrieval(embedder, dataset, VALIDATION_KS)
        flat = {f"{d}_R@{k}": metrics[d][f"R@{k}"] for d in ("t2i", "i2t") for k in VALIDATION_KS}
        return {**flat, "mean_R@1": (flat["t2i_R@1"] + flat["i2t_R@1"]) / 2}

    return evaluate


def build_trainer(cfg: Config) -> Trainer:
    """Model, loader, objective, validation and trainer as `cfg` describes (no training yet)."""
    from sharpclip.data import build_loader
    from sharpclip.data.transforms import model_transforms
    from sharpclip.losses import build_objective
    from sharpclip.models.factory import create_model, save_checkpoint

    world, rank = distributed.world_size(), distributed.rank()
    if cfg.train.batch_size % world:
        raise ConfigError(f"train.batch_size ({cfg.train.batch_size}) must be divisible by the {world} processes")
    device = devices.resolve_device(cfg.train.device, "train.device")
    devices.check_precision(cfg.train.precision, device, "train.precision")  # before the model is built
    seed_everything(cfg.train.seed)
    model = create_model(cfg.model).to(device)
    distributed.broadcast_parameters(model)
    objective = build_objective(cfg.loss)
    preprocess, _ = model_transforms(model)
    data = replace(cfg.data, context_length=model.context_length)
    if rank != 0:  # rank 0 reads first: a generated corpus (SynthDense) is written once, not by every rank at once
        distributed.barrier()
    loader = build_loader(
        data, data.train_split, model.tokenizer, batch_size=cfg.train.batch_size // world,
        image_transform=preprocess, rank=rank, world_size=world, seed=cfg.train.seed,
        pin_memory=device.type == "cuda", pad_to_context=model.pads_to_context,
    )  # fmt: skip
    log.info("data: %d loader workers, JPEG draft decoding %s", loader.num_workers, "on" if data.jpeg_draft else "off")
    if rank == 0:
        distributed.barrier()
    evaluate = retrieval_validator(model, data, data.eval_split) if cfg.train.eval_every else None
    frozen = None
    if "text_frozen" in objective.feature_keys:  # HN-CLIP Table 3c: Ḡ from the initial text tower, frozen
        frozen = copy.deepcopy(model).eval().requires_grad_(False)

    def write_model(directory: Path) -> None:
        save_checkpoint(model, directory, cfg.model)

    run_dir = Path(cfg.train.output_dir)
    return Trainer(model, objective, loader, cfg.train, run_dir, write_model, evaluate, frozen)


def run_train(cfg: Config, resume: str | Path | None = None) -> TrainerState:
    """Train as `cfg` says, in `cfg.train.output_dir`; `resume` (a run directory or checkpoint) continues exactly."""
    device = devices.resolve_device(cfg.train.device, "train.device")
    distributed.init_from_env(device)
    run_dir = Path(cfg.train.output_dir)
    _setup_logging(run_dir)
    placement = describe_placement(device)
    if distributed.rank() == 0:
        log.info("%s", placement)
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / RESOLVED_CONFIG).write_text(f"# {placement}\n{to_yaml(cfg)}")
    trainer = build_trainer(cfg)
    if resume is not None:
        trainer.resume(resume_checkpoint(resume))
    try:
        return trainer.fit()
    finally:
        distributed.shutdown()


def describe_placement(device: torch.device) -> str:
    """'world size 2, backend nccl, devices: rank 0 cuda:0 (...), rank 1 cuda:1 (...)' (every rank must call it)."""
    ranks = distributed.all_ranks(devices.describe(device))
    listed = ", ".join(f"rank {r} {d}" for r, d in enumerate(ranks))
    return f"world size {distributed.world_size()}, backend {distributed.backend()}, devices: {listed}"


def resume_checkpoint(path: str | Path) -> Path:
    """A checkpoint folder as is; a run directory's newest complete checkpoint."""
    path = Path(path)
    if (path / checkpoint.TRAINER_STATE).is_file():
        return path
    found = checkpoint.latest(path / "checkpoints")
    if found is None:
        raise FileNotFoundError(f"{path}: no complete checkpoint (neither a checkpoint folder nor a run with any)")
    return found


def load_run_config(run_dir: str | Path, overrides: list[str] | tuple[str, ...] = ()) -> Config:
    """The resolved config a run wrote, with further overrides (for `sharpclip train --resume RUN`)."""
    path = Path(run_dir) / RESOLVED_CONFIG
    if not path.is_file():
        raise ConfigError(f"{run_dir}: no {RESOLVED_CONFIG}; pass the recipe again along with --resume")
    return load_config(path, overrides)
