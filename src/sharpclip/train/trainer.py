"""The training loop, and nothing else: one `Trainer` for every recipe of both papers.

What a recipe changes lives elsewhere: the objective's terms and weights (losses.build_objective), the model's
adapters and freezing (models), the batches (data), the accumulation mode (train.step). The loop draws a batch,
runs the step, skips non-finite steps, clips, steps the optimiser and the schedule, clamps the logit scale, logs,
checkpoints, evaluates, and on request records gradient diagnostics.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from sharpclip.config import TrainConfig
from sharpclip.data.schema import Batch
from sharpclip.losses import Objective
from sharpclip.models.base import DualEncoder
from sharpclip.train import checkpoint, distributed
from sharpclip.train.diagnostics import gradient_diagnostics
from sharpclip.train.logging import RunLogger, log, progress
from sharpclip.train.optim import build_optimizer, build_scheduler, clamp_logit_scale
from sharpclip.train.step import DistillEncoder, FeatureEncoder, run_step

Evaluate = Callable[[DualEncoder], dict[str, float]]


class TrainingDiverged(RuntimeError):
    """Too many consecutive steps had a non-finite loss or gradient."""


@dataclass
class TrainerState:
    step: int = 0  # optimiser steps taken
    epoch: int = 0
    seen: int = 0  # samples seen (global)
    best: float = -math.inf
    bad_steps: int = 0  # consecutive non-finite steps


class Trainer:
    """Fits `model` to `objective` over `loader`; `write_model(dir)` saves the model part of a checkpoint.

    The features come from a `FeatureEncoder` over `model` (image-caption data) unless `encoder` is given
    (text-only distillation: `DistillEncoder`). `frozen_text` feeds the `text_frozen` feature (frozen-Ḡ variant).
    """

    def __init__(
        self,
        model: DualEncoder,
        objective: Objective,
        loader: Any,
        cfg: TrainConfig,
        run_dir: Path,
        write_model: Callable[[Path], Any],
        evaluate: Evaluate | None = None,
        frozen_text: DualEncoder | None = None,
        encoder: DistillEncoder | None = None,
    ):
        self.model, self.objective, self.loader, self.cfg = model, objective, loader, cfg
        self.run_dir, self.write_model, self.evaluate = Path(run_dir), write_model, evaluate
        self.ckpt_dir = self.run_dir / "checkpoints"
        self.encoder = encoder or FeatureEncoder(model, objective.feature_keys, frozen_text, self._autocast)
        self.micro = cfg.micro_batch_size
        self.optimizer = build_optimizer(model, cfg.lr, cfg.weight_decay, cfg.module_lr)
        if len(loader) == 0:
            raise ValueError(f"the training data yields no batch of {cfg.batch_size} rows: lower train.batch_size")
        self.total_steps = cfg.max_steps or cfg.epochs * len(loader)
        self.scheduler = build_scheduler(self.optimizer, cfg.warmup_steps, self.total_steps, cfg.min_lr_ratio)
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.state = TrainerState()
        self._resume_rng: dict | None = None  # RNG states to restore once the resumed epoch's iterator exists
        self.is_main = distributed.rank() == 0
        if self.is_main:
            self.run_dir.mkdir(parents=True, exist_ok=True)
        self.logger = RunLogger(self.run_dir, self.is_main, cfg.tensorboard, cfg.wandb)
        if cfg.grad_checkpointing:  # transformers' activation checkpointing of every tower layer
            getattr(model, "hf_model", model).activation_checkpointing_enable({"use_reentrant": False})

    def _autocast(self) -> contextlib.AbstractContextManager:
        if self.cfg.precision != "bf16":
            return contextlib.nullcontext()
        device = next(self.model.parameters()).device.type
        return torch.autocast(device_type=device, dtype=torch.bfloat16)

    # -- the loop ---------------------------------------------------------------------------------------------
    def fit(self) -> TrainerState:
        log.info(
            "training %d steps, objective %r, accumulation %s: %d-row contrastive matrix from micro-batches of %d",
            self.total_steps, self.objective, self.cfg.accumulation, self._matrix_rows(), self.micro,
        )  # fmt: skip
        bar = progress(self.total_steps, self.state.step, self.cfg.progress and self.is_main)
        while self.state.step < self.total_steps:
            self._epoch(bar)
        bar.close()
        self.logger.close()
        report = getattr(self.loader, "report", None)  # data.SampleLoader: samples skipped under on_bad_sample: skip
        if report is not None and report.items:
            log.warning("bad samples over the run: %s", report.summary())
        return self.state

    def _matrix_rows(self) -> int:
        per_rank = self.cfg.batch_size // distributed.world_size()
        return self.cfg.batch_size if self.cfg.accumulation == "exact" else min(self.micro, per_rank)

    def _epoch(self, bar) -> None:
        self.model.train()
        self.loader.set_epoch(self.state.epoch)
        batches = iter(self.loader)
        if self._resume_rng is not None:  # after the iterator drew its seed (see resume)
            checkpoint.set_rng_state(self._resume_rng)
            self._resume_rng = None
        saturated = []  # (saturated, all) contrastive matrices of each step
        for batch in self._steps(batches):
            record = self._train_step(batch)
            if record is None:  # a skipped (non-finite) step: nothing to count, log or save
                continue
            if "matrices_monitor" in record:
                saturated.append((record["saturated_monitor"] * record["matrices_monitor"], record["matrices_monitor"]))
            bar.update(1)
            bar.set_postfix(loss=f"{record['loss']:.4f}", scale=f"{record['logit_scale']:.1f}")
            if self.cfg.checkpoint_every and self.state.step % self.cfg.checkpoint_every == 0:
                self.save()
            checkpoint.fault_point("step", self.state.step)
        self._end_epoch(saturated)

    def _steps(self, batches: Iterable[Batch]) -> Iterable[Batch]:
        for batch in batches:
            if self.state.step >= self.total_steps:
                return
            yield batch

    def _end_epoch(self, saturated: list[tuple[float, float]]) -> None:
        if saturated:  # image-caption objectives: HN-CLIP §2.1's saturation share of this epoch's batches
            share = sum(s for s, _ in saturated) / sum(n for _, n in saturated)
            log.info("epoch %d: %.1f%% of contrastive batches had InfoNCE < 1e-3", self.state.epoch, 100 * share)
            self.logger.step({"step": self.state.step, "epoch": self.state.epoch, "saturated_batches": share})
        self.state.epoch += 1
        metrics = self._evaluate()  # every rank evaluates the same model on the same data: same decision below
        improved = metrics is not None and metrics.get(self.cfg.best_metric, -math.inf) > self.state.best
        if improved:
            self.state.best = metrics[self.cfg.best_metric]
        path = self.save()
        if improved and self.is_main:
            checkpoint.mark_best(self.ckpt_dir, path, self.state.best)

    def _evaluate(self) -> dict[str, float] | None:
        every = self.cfg.eval_every
        if self.evaluate is None or not every or self.state.epoch % every:
            return None
        self.model.eval()
        with torch.no_grad():
            metrics = self.evaluate(self.model)
        self.model.train()
        evals = {f"eval/{k}": v for k, v in metrics.items()}
        self.logger.step({"step": self.state.step, "epoch": self.state.epoch, **evals})
        log.info("eval after epoch %d: %s", self.state.epoch, ", ".join(f"{k} {v:.4f}" for k, v in metrics.items()))
        return metrics

    # -- one step ---------------------------------------------------------------------------------------------
    def _train_step(self, batch: Batch) -> dict[str, float] | None:
        every = self.cfg.diagnostics_every
        if every and self.state.step % every == 0:
            self._diagnose(batch)
        start = time.perf_counter()
        self.optimizer.zero_grad(set_to_none=True)
        result = run_step(self.encoder, self.objective, batch, self.micro, self.cfg.accumulation)
        distributed.average_gradients(self.params)
        max_norm = self.cfg.grad_clip if self.cfg.grad_clip > 0 else math.inf
        grad_norm = float(torch.nn.utils.clip_grad_norm_(self.params, max_norm))
        if not (math.isfinite(result.terms["loss"]) and math.isfinite(grad_norm)):
            self._skip(batch, result.terms["loss"], grad_norm)
            return None
        self.state.bad_steps = 0
        lr = self.optimizer.param_groups[0]["lr"]  # the rate this step used
        self.optimizer.step()
        self.scheduler.step()
        clamp_logit_scale(self.model.logit_scale)
        self.state.step += 1
        self.state.seen += result.rows
        seconds = time.perf_counter() - start
        record = {
            "step": self.state.step,
            "epoch": self.state.epoch,
            **result.terms,
            **{f"{k}_monitor": v for k, v in result.monitor.items()},
            "lr": lr,
            "logit_scale": float(self.model.logit_scale.detach().exp()),
            "grad_norm": grad_norm,
            "samples_per_s": result.rows / seconds,
            "seen": self.state.seen,
        }
        self.logger.step(record)
        return record

    def _skip(self, batch: Batch, loss: float, grad_norm: float) -> None:
        self.optimizer.zero_grad(set_to_none=True)
        self.state.bad_steps += 1
        ids = ", ".join(batch.ids[:8]) + (" ..." if len(batch.ids) > 8 else "")
        log.warning("skipped a step: loss %s, gradient norm %s; samples: %s", loss, grad_norm, ids)
        self.logger.step({"step": self.state.step, "skipped": True, "loss": loss, "grad_norm": grad_norm,
                          "ids": batch.ids})  # fmt: skip
        if self.state.bad_steps >= self.cfg.nan_patience:
            raise TrainingDiverged(
                f"{self.state.bad_steps} consecutive steps had a non-finite loss or gradient (last samples: {ids}); "
                "lower train.lr, use train.precision=fp32, or check these samples with `sharpclip validate-data`"
            )

    def _diagnose(self, batch: Batch) -> None:
        cfg = self.cfg
        record = gradient_diagnostics(self.encoder, batch, self.micro, cfg.diagnostics_gamma, cfg.accumulation)
        self.logger.diagnose({"step": self.state.step, "epoch": self.state.epoch, **record})

    # -- checkpoints ------------------------------------------------------------------------------------------
    def save(self) -> Path:
        """Write a checkpoint of the current step (rank 0), including the loader position and all RNG states."""
        path = self.ckpt_dir / checkpoint.checkpoint_name(self.state.step)
        if self.is_main:
            training_state = {
                "optimizer": self.optimizer.state_dict(),
                "scheduler": self.scheduler.state_dict(),
                "rng": checkpoint.rng_state(),
            }
            trainer_state = {**asdict(self.state), "loader": self.loader.state_dict()}
            path = checkpoint.save(self.ckpt_dir, self.state.step, self.write_model, training_state, trainer_state)
            checkpoint.prune(self.ckpt_dir, self.cfg.keep_last)
        distributed.barrier()
        return path

    def resume(self, path: Path) -> None:
        """Continue exactly from checkpoint `path`: weights, optimiser, schedule, loader position, RNG."""
        from safetensors.torch import load_file

        weights = load_file(str(path / "model.safetensors"))
        self.model.load_state_dict(weights)
        training = checkpoint.load_training_state(path)
        self.optimizer.load_state_dict(training["optimizer"])
        self.scheduler.load_state_dict(training["scheduler"])
        trainer_state = checkpoint.load_trainer_state(path)
        self.loader.load_state_dict(trainer_state.pop("loader"))
        self.state = TrainerState(**trainer_state)
        self._resume_rng = training["rng"]
        log.info("resumed from %s at step %d (epoch %d)", path, self.state.step, self.state.epoch)
