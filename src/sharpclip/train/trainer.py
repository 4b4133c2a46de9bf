"""The training loop, and nothing else: one `Trainer` for every recipe of both papers.

What a recipe changes lives elsewhere: the objective's terms and weights (losses.build_objective), the model's
adapters and freezing (models), the batches (data), the accumulation mode (train.step). The loop draws a batch,
runs the step, skips non-finite steps, clips, steps the optimiser and the schedule, clamps the logit scale, checks
that the weights are still finite, logs, checkpoints, evaluates, and on request records gradient diagnostics.

Before the loop the trainer puts everything that computes on `train.device`: the model and the feature encoder's
frozen towers (batches follow in train.features, the one place that moves them); it turns on activation
checkpointing under `train.grad_checkpointing`, compiles every transformer block under `train.compile`, and on
several processes puts the model under the engine (train.engine: FSDP2, `train.layout`) before building AdamW.

Ranks stay in step: before each step every rank says whether it holds a batch (one all-reduce of the step's agreement;
none on one process), and when one has run out every rank ends the epoch there, with a warning. The budget is
`train.epochs` passes (or `train.max_steps` steps), however many batches skipped samples removed; an epoch with no
batch at all stops the run. Checkpoints hold every rank's loader position and random streams and the world size; a
resume on another number of ranks continues where it stopped for map-style data (train.reshard), else at the next
epoch boundary (`Trainer.resume`). With several ranks, each reseeds its generators with `seed + rank` once the
weights are equal, so ranks draw different dropout noise. A stop signal and rank 0's checkpoint clock ride on the
step's flags (train.stop): every rank finishes its step, saves and stops, or saves, at the same step; each rank beats
after every step, so a rank that hangs ends every rank (train.heartbeat).

Numerical faults are told apart: a step with a non-finite loss or gradient is skipped (bad data, or bf16 overflow);
an update that leaves a weight non-finite stops the run at once, before anything is checkpointed; and when every
step after one update fails and that update blew up the weights (`DIVERGED_GROWTH`), the stop message blames the
update (learning rate), not the samples, and marks a checkpoint holding those weights as diverged (train.checkpoint)
so that a resume starts from the one before it.
"""

from __future__ import annotations

import copy
import functools
import json
import math
import os
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from sharpclip import devices
from sharpclip.config import AUTO, ConfigError, TrainConfig
from sharpclip.data.schema import Batch, Loader
from sharpclip.eval.evaluator import Evaluate
from sharpclip.eval.guards import GUARDS_HOLD
from sharpclip.losses import Objective
from sharpclip.losses.monitors import MATRICES_MONITOR, SATURATED_MONITOR
from sharpclip.models.base import DualEncoder
from sharpclip.train import checkpoint, failures, micro_batch, reshard
from sharpclip.train import resume as resume_policy
from sharpclip.train.compile import compile_blocks, compile_counts, dropout_rate, is_compile_error
from sharpclip.train.diagnostics import gradient_diagnostics
from sharpclip.train.engine import by_name, load_named_optimizer_state, max_abs
from sharpclip.train.features import FeatureEncoder
from sharpclip.train.heartbeat import Heartbeat
from sharpclip.train.log_lines import ProgressLines
from sharpclip.train.logging import RunLogger, log, progress
from sharpclip.train.optim import build_optimizer, build_scheduler, clamp_logit_scale, logit_scale_ceiling, lr_for
from sharpclip.train.parallel import ParallelContext
from sharpclip.train.step import check_batch_split, run_step
from sharpclip.train.stop import RunControl, Stopped, stopped_message

DIVERGED_GROWTH = 10.0  # an update that multiplies the largest |weight| by this much, then only failed steps: diverged
ASYNC_CHECKPOINT_DEVICES = ("cuda",)  # train.async_checkpoint writes in the background on these devices only
FUSED_ADAMW_DEVICES = ("cuda",)  # AdamW's fused kernel on these devices (tests force torch's CPU one too)


class TrainingDiverged(RuntimeError):
    """Too many consecutive steps had a non-finite loss or gradient, or an update made the weights non-finite."""


def largest_weight(params: list[torch.Tensor]) -> float:
    """max |w| over `params` (inf or nan when any weight is), with one device sync."""
    return float(max_abs(params))


@dataclass
class TrainerState:
    step: int = 0  # optimiser steps taken
    epoch: int = 0
    seen: int = 0  # samples seen (global)
    best: float = -math.inf
    bad_steps: int = 0  # consecutive non-finite steps


class Trainer:
    """Fits `model` to `objective` over `loader`; `write_model(dir)` saves the model part of a checkpoint.

    The features come from `encoder`, by default the feature table's encoder over `model` for the objective's
    features (train.features); distillation passes one that holds its teacher. `ctx`: the run's parallel context
    (train.parallel; default: this process in the default process group, one process when there is none); on
    several processes the model goes under the engine of `ctx.layout` (train.engine) before the optimiser is built.
    """

    def __init__(
        self,
        model: DualEncoder,
        objective: Objective,
        loader: Loader,
        cfg: TrainConfig,
        run_dir: Path,
        write_model: Callable[[Path], Any],
        evaluate: Evaluate | None = None,
        encoder: FeatureEncoder | None = None,
        ctx: ParallelContext | None = None,
    ):
        self.ctx = ctx if ctx is not None else ParallelContext.from_process_group(cfg.layout)
        self.model, self.objective, self.loader, self.cfg = model, objective, loader, cfg
        self.run_dir, self.write_model, self.evaluate = Path(run_dir), write_model, evaluate
        self.ckpt_dir = self.run_dir / "checkpoints"
        self.device = devices.resolve_device(cfg.device, "train.device")
        devices.check_precision(cfg.precision, self.device, "train.precision")
        if self.device.type == "cuda":
            devices.set_tf32(cfg.tf32)
        self.encoder = encoder or FeatureEncoder(model, objective.feature_keys, precision=cfg.precision)
        if self.encoder.model is not model:
            raise ValueError("the feature encoder must encode the model being trained")
        self.encoder.to(self.device)
        self.micro = cfg.micro_batch_size  # auto: sized on the first batch (train.micro_batch)
        check_batch_split(cfg.batch_size, cfg.micro_batch_size, cfg.accumulation, self.ctx.world, objective.per_sample)
        micro_batch.check_layout(cfg, self.ctx)
        # a plain copy for the gradient diagnostics, which need each rank's own gradients (the engine reduces them)
        self._plain = copy.deepcopy(model) if cfg.diagnostics_every and self.ctx.several else None
        if cfg.grad_checkpointing:  # transformers' activation checkpointing of every tower layer
            getattr(model, "hf_model", model).activation_checkpointing_enable({"use_reentrant": False})
        self._compiling = cfg.compile  # until the first step has run compiled
        if cfg.compile:
            self._check_compile_replay()
            compile_blocks(model, fullgraph=cfg.compile_fullgraph)
        self.engine = self.ctx.shard(model, self.device, cfg.precision, cfg.keep_gathered)  # None on one process
        fused = self.device.type in FUSED_ADAMW_DEVICES  # AdamW in one fused kernel on CUDA, foreach elsewhere
        betas = (cfg.beta1, cfg.beta2)
        self.optimizer = build_optimizer(model, cfg.lr, cfg.weight_decay, cfg.module_lr, betas, cfg.eps, fused=fused)
        if len(loader) == 0:
            raise ValueError(f"the training data yields no batch of {cfg.batch_size} rows: lower train.batch_size")
        self.total_steps = cfg.max_steps or cfg.epochs * len(loader)
        self.scheduler = build_scheduler(
            self.optimizer, cfg.warmup_steps, self.total_steps, cfg.min_lr_ratio, cfg.schedule
        )
        self.params = [p for p in model.parameters() if p.requires_grad]  # sharded ones on several processes
        # stop signals and clock checkpoints, agreed in the step's agreement (train.stop)
        self.control = RunControl(cfg.stop_signals, cfg.checkpoint_every_min, self.ctx.is_main)
        # this rank's progress, for the failure watcher's hang check (train.heartbeat)
        self.heartbeat = Heartbeat(cfg.hang_timeout_min, self.ctx.rank, self.ctx.world)
        self._scale_ceiling = logit_scale_ceiling(model.logit_scale)  # from the model as built, before any resume
        self.state = TrainerState()
        self._resume_rng: dict | None = None  # RNG states to restore once the resumed epoch's iterator exists
        self._resumed_epoch = False  # the next epoch continues a checkpoint's epoch part-way
        self._ran_out: list[int] = []  # the ranks whose loader ended the last epoch early
        self._epoch_open = False  # steps of the current epoch were taken but its end (validation, best) is not done
        self._saturated: list[tuple[float, float]] = []  # (saturated, all) contrastive matrices of this epoch's steps
        self._weights = float(self._max_abs())  # max |w| after the last update
        self._last_update: dict[str, float] = {}  # the last successful update: step, lr, max |w| before and after
        self._data_wait = 0.0  # seconds the current step waited for its batch (progress bar)
        self.is_main = self.ctx.is_main
        self._async_saves = cfg.async_checkpoint and self.device.type in ASYNC_CHECKPOINT_DEVICES
        self._saving: tuple[checkpoint.PendingSave, bool, float] | None = None  # a save still being written
        self._written: int | None = None  # the step of the checkpoint written (or resumed from) last
        if self.ctx.several:  # the weights are equal on every rank by now: from here ranks draw apart
            checkpoint.seed_rngs(cfg.seed + self.ctx.rank)  # dropout, LoRA dropout, the workers' base seeds
        if self.is_main:
            self.run_dir.mkdir(parents=True, exist_ok=True)
        sinks = (cfg.tensorboard, cfg.wandb, cfg.wandb_project, cfg.wandb_name)
        self.logger = RunLogger(self.run_dir, self.is_main, *sinks)

    # -- the loop ---------------------------------------------------------------------------------------------
    def fit(self) -> TrainerState:
        """Train to the budget; on several ranks a failure on any rank ends every rank at once, with one line naming
        the failing rank and its error (train.failures.failures_end_every_rank)."""
        with self.control.signals(), failures.failures_end_every_rank(self.heartbeat):
            state = self._fit()
        if self.control.stopping and not self.finished():  # a stop signal, its step checkpointed (train.stop)
            raise Stopped(stopped_message(state.step, checkpoint.checkpoint_name(state.step), str(self.run_dir)))
        return state

    def _fit(self) -> TrainerState:
        if self.cfg.async_checkpoint and not self._async_saves:
            log.info("train.async_checkpoint: checkpoints are written in the background on CUDA only; on %s each is "
                     "written at once", self.device.type)  # fmt: skip
        log.info("device %s, precision %s%s%s", devices.describe(self.device), self.cfg.precision,
                 ", TF32 matmuls" if self.device.type == "cuda" and torch.backends.cuda.matmul.allow_tf32 else "",
                 ", blocks compiled" if self.cfg.compile else "")  # fmt: skip
        world = self.ctx.world
        log.info(
            "training %s, objective %r, accumulation %s: %d-row contrastive matrix from micro-batches of %s%s%s",
            self._plan(), self.objective, self.cfg.accumulation, self._matrix_rows(), self.micro,
            f", encoded {self.cfg.encode_batch_size} rows a pass" if self.cfg.encode_batch_size else "",
            f" (local loss: each of {world} processes computes its {self.cfg.batch_size // world} rows against all "
            f"{self.cfg.batch_size})" if world > 1 and self.cfg.accumulation == "exact" else "",
        )  # fmt: skip
        bar = progress(self.total_steps, self.state.step, self.cfg.progress and self.is_main)
        # a plain line every train.log_every steps (train.log_lines)
        self.lines = ProgressLines(self.cfg.log_every, self.total_steps, self.state.step, self.state.seen, self.is_main)
        while self._budget_left() and not self.control.stopping:
            self._epoch(bar)
        # resumed from a checkpoint of the last step, written before its epoch's end ran (not when stopping)
        if self._epoch_open and not self.control.stopping:
            with self.heartbeat.busy("epoch end"):
                self._end_epoch()
        with self.heartbeat.busy("save"):  # a checkpoint still being written in the background
            self._finish_saving()
        bar.close()
        if self.cfg.compile:
            self._log_compile("the run")  # recompiles for new shapes since the first step, breaks included
        self.logger.close()
        report = getattr(self.loader, "report", None)  # data.SampleLoader: samples skipped under on_bad_sample: skip
        if report is not None and report.items:
            log.warning("bad samples over the run: %s", report.summary())
        return self.state

    def _plan(self) -> str:
        """'12 steps', or on resume 'steps 9-12 of 12' (epochs: the count announced from the loader's length)."""
        done, total = self.state.step, self.total_steps
        return f"{total} steps" if not done else f"steps {done + 1}-{total} of {total}"

    def _matrix_rows(self) -> int:
        """Rows of each contrastive matrix, at every world size: the global batch (exact) or a micro-batch."""
        return self.cfg.batch_size if self.cfg.accumulation == "exact" else self.micro

    def finished(self) -> bool:
        """Whether the budget (train.epochs or train.max_steps) is spent and the last epoch's end has run: a resumed
        run with nothing left to do."""
        return not self._budget_left() and not self._epoch_open

    def _budget_left(self) -> bool:
        """train.max_steps counts steps; otherwise the budget is train.epochs passes over the data, however many
        steps skipped samples or batches left in each (the schedule's length is only the announced count)."""
        if self.cfg.max_steps:
            return self.state.step < self.total_steps
        return self.state.epoch < self.cfg.epochs

    def _epoch(self, bar) -> None:
        self.model.train()
        self.loader.set_epoch(self.state.epoch)
        announced = len(self.loader)  # before iterating: a sampler's len() counts the batches still to come
        batches = iter(self.loader)
        if self._resume_rng is not None:  # after the iterator drew its seed (see resume)
            checkpoint.set_rng_state(self._resume_rng, self.device)
            self._resume_rng = None
        taken, budget = 0, self.state.step < self.total_steps
        for batch in self._steps(batches):
            taken += 1
            record = self._train_step(batch, self._data_wait)
            if record is None:  # a skipped (non-finite) step: nothing to count, log or save
                continue
            self._epoch_open = True
            if MATRICES_MONITOR in record:
                monitored = (record[SATURATED_MONITOR] * record[MATRICES_MONITOR], record[MATRICES_MONITOR])
                self._saturated.append(monitored)
            bar.update(1)
            bar.set_postfix(
                {
                    "loss": f"{record['loss']:.4f}",
                    "scale": f"{record['logit_scale']:.1f}",
                    "samples/s": f"{record['samples_per_s']:.1f}",
                    "data": f"{self._data_wait:.3f}s",
                }
            )
            self.lines.step(record)
            every = self.cfg.checkpoint_every and self.state.step % self.cfg.checkpoint_every == 0
            self.heartbeat.beat(self.state.step)
            if every or self.control.save_now:  # a stop signal or rank 0's clock (train.stop)
                with self.heartbeat.busy("save"):
                    self.save()
            checkpoint.fault_point("step", self.state.step)
            if self.control.stopping:  # the run ends here; its epoch stays open for the resume
                return
        self._check_epoch_length(taken, announced, budget)
        with self.heartbeat.busy("epoch end"):  # validation and save
            self._end_epoch()

    def _steps(self, batches: Iterator[Batch]) -> Iterator[Batch]:
        """The epoch's batches while the step budget lasts and every rank holds one.

        Each rank asks the others before every step (one all-reduce of the step's agreement, train.parallel.Agreement;
        no collective on one process): when any rank's loader is exhausted early (a batch of only bad samples
        skipped, uneven shards, a shard count that overstates the data), every rank ends the epoch here together,
        rather than pairing one rank's gather with another's barrier and waiting forever. The wait for each batch is
        timed for the progress bar (open_clip's "Data (t)").
        """
        self._ran_out = []
        while self.state.step < self.total_steps:
            start = time.perf_counter()
            batch = next(batches, None)
            self._data_wait = time.perf_counter() - start
            if batch is not None:  # arrived at the agreement (train.heartbeat)
                self.heartbeat.beat(self.state.step, arrived=True)
            ready = self.ctx.agree(batch, requests=self.control.requests())  # with the stop / clock requests
            self.control.agreed(self.ctx.requests)
            if not all(ready):
                self._ran_out = [r for r, has in enumerate(ready) if not has]
                return
            yield batch

    def _check_epoch_length(self, taken: int, announced: int, budget: bool) -> None:
        """Stop on an epoch with no batch at all (every sample bad: otherwise the run would loop over empty epochs);
        warn on one shorter than announced. A resumed epoch starts part-way, so only its emptiness is expected."""
        resumed, self._resumed_epoch = self._resumed_epoch, False
        if resumed or not budget or self.state.step >= self.total_steps:
            return
        report = getattr(self.loader, "report", None)
        bad = ""
        if report is not None and report.items:  # the counts per reason and the first one, on one line
            bad = f"; {report.summary().splitlines()[0].rstrip(':')}, the first {report.items[0]}"
        if not taken:
            raise ValueError(
                f"epoch {self.state.epoch} yielded no training batch of {self.cfg.batch_size} rows{bad}: the data "
                "holds no usable samples under data.on_bad_sample=skip; check it with `sharpclip validate-data`"
            )
        if taken < announced and self.is_main:
            who = "the loader ran out"
            if self.ctx.several:
                ranks = ", ".join(map(str, self._ran_out))
                who = f"rank {ranks} ran out, so every rank stopped; the others' remaining batches go unseen"
            log.warning(
                "epoch %d ended after %d of %d batches: %s (skipped bad samples, uneven shards or shard sizes that "
                "overstate the data)%s", self.state.epoch, taken, announced, who, bad,
            )  # fmt: skip

    def _end_epoch(self) -> None:
        saturated, self._saturated = self._saturated, []
        if saturated:  # image-caption objectives: HN-CLIP §2.1's saturation share of this epoch's batches
            share = sum(s for s, _ in saturated) / sum(n for _, n in saturated)
            log.info("epoch %d: %.1f%% of contrastive batches had InfoNCE < 1e-3", self.state.epoch, 100 * share)
            self.logger.step({"step": self.state.step, "epoch": self.state.epoch, "saturated_batches": share})
        checkpoint.fault_point("validation", self.state.epoch)
        with checkpoint.rng_kept(self.device):  # validation draws nothing from the training's random streams
            metrics = self._evaluate()  # recorded under this epoch's index, as its steps are
        self.state.epoch += 1
        self._epoch_open = False
        # every rank holds rank 0's metrics (train.validation), so every rank decides the same below
        held = metrics is not None and metrics.get(GUARDS_HOLD, 1.0) == 1.0  # train.guards' floors (if any) hold
        improved = held and metrics.get(self.cfg.best_metric, -math.inf) > self.state.best
        if improved:
            self.state.best = metrics[self.cfg.best_metric]
        self.save(best=improved)  # marked best before pruning, so pruning can never delete the new best

    def _evaluate(self) -> dict[str, float] | None:
        every = self.cfg.eval_every
        if self.evaluate is None or not every or (self.state.epoch + 1) % every:
            return None
        self.model.eval()
        try:
            with torch.no_grad():
                metrics = self.evaluate(self.model)
        except (ValueError, RuntimeError) as err:  # e.g. non-finite embeddings: blame a blown-up update if it was one
            if (message := self._diverged_update()) is not None:
                raise TrainingDiverged(message) from err
            raise
        self.model.train()
        evals = {f"eval/{k}": v for k, v in metrics.items()}
        self.logger.step({"step": self.state.step, "epoch": self.state.epoch, **evals})
        shown = ", ".join(f"{k} {v:.4f}" for k, v in metrics.items())
        log.info("eval after epoch %d (counted from 0): %s", self.state.epoch, shown)
        return metrics

    # -- one step ---------------------------------------------------------------------------------------------
    def _train_step(self, batch: Batch, waited: float = 0.0) -> dict[str, float] | None:
        """One optimiser step. The host reads two things, each in one read: the loss terms, monitor and gradient
        norm once the backward is queued (the skip decision needs them), and max |w| with the logit scale after the
        update; nothing in between waits for the device. `waited`: seconds spent waiting for this batch."""
        if micro_batch.is_auto(self.cfg):  # before anything of the first step, as if the size had been given
            self.cfg = micro_batch.fit_to_memory(self.encoder, self.objective, batch, self.cfg, self.ctx,
                                                 self.optimizer)  # fmt: skip
            self.micro = self.cfg.micro_batch_size
        every = self.cfg.diagnostics_every
        if every and self.state.step % every == 0:
            self._diagnose(batch)
        start = time.perf_counter()
        self.optimizer.zero_grad(set_to_none=True)
        step = self._run_step(batch)
        max_norm = self.cfg.grad_clip if self.cfg.grad_clip > 0 else math.inf
        result = step.read(grad_norm=self._clip(max_norm))
        loss, grad_norm = result.terms["loss"], result.extra["grad_norm"]
        if not (math.isfinite(loss) and math.isfinite(grad_norm)):
            self._skip(batch, loss, grad_norm)
            return None
        self.state.bad_steps = 0
        lr = self.optimizer.param_groups[0]["lr"]  # the rate this step used
        self.optimizer.step()
        self.scheduler.step()
        clamp_logit_scale(self.model.logit_scale, self._scale_ceiling)
        scale = self._check_weights(lr, loss, grad_norm)
        self.state.step += 1
        self.state.seen += result.rows
        seconds = time.perf_counter() - start
        record = {
            "step": self.state.step,
            "epoch": self.state.epoch,
            **result.terms,
            **result.monitor,
            "lr": lr,
            "logit_scale": scale,
            "grad_norm": grad_norm,
            "samples_per_s": result.rows / seconds,
            "data_wait_s": waited,
            "seen": self.state.seen,
        }
        self.logger.step(record)
        return record

    def _run_step(self, batch: Batch):
        cfg = self.cfg
        args = (self.encoder, self.objective, batch, self.micro, cfg.accumulation, cfg.encode_batch_size)
        syncs = {"ctx": self.ctx}
        if not self._compiling:
            return run_step(*args, **syncs)
        try:  # torch.compile fails lazily, at the first call of a compiled tower: say what to do
            result = run_step(*args, **syncs)
        except Exception as err:
            if not is_compile_error(err):  # an OOM, an NCCL or a data error keeps its own message
                raise
            reason = (str(err).strip().splitlines() or [""])[0][:300]
            raise RuntimeError(
                f"train.compile: torch.compile could not compile the transformer blocks on {self.device} "
                f"({type(err).__name__}: {reason}); train without it: train.compile=false"
            ) from err
        self._compiling = False
        self._log_compile("the first step")
        return result

    def _log_compile(self, when: str) -> None:
        """train.log: Dynamo's graphs and graph breaks so far (a break splits a block's graph: a warning)."""
        counts = compile_counts()
        say = log.warning if counts["graph_breaks"] else log.info
        say("train.compile after %s: %d graphs, %d graph breaks", when, counts["graphs"], counts["graph_breaks"])

    def _check_compile_replay(self) -> None:
        """Exact accumulation replays each micro-batch's forward with its recorded RNG state; a compiled no-grad
        graph and a compiled training graph need not draw the same dropout masks from it, so the replayed gradient
        would no longer be exact. Refuse that combination rather than train on a silently different objective."""
        share = self.cfg.batch_size // self.ctx.world
        cached = self.cfg.accumulation == "exact" and (self.micro == AUTO or share > self.micro)
        rate = dropout_rate(self.model)
        if cached and rate > 0:
            raise ConfigError(
                f"train.compile: the model has dropout (rate {rate:g}) and train.accumulation=exact replays each "
                "micro-batch's dropout masks, which compiled graphs do not promise to reproduce; set the model's "
                "dropout to 0, train.compile=false, or train.accumulation=per_micro_batch"
            )

    def _clip(self, max_norm: float) -> torch.Tensor:
        """Clip the gradients to the global norm `max_norm` (inf: no clipping); returns the norm, not read. Sharded
        gradients: the engine's global norm in one reduction (train.engine)."""
        if self.engine is not None:
            return self.engine.clip_grad_norm(self.params, max_norm)
        return torch.nn.utils.clip_grad_norm_(self.params, max_norm)

    def _max_abs(self) -> torch.Tensor:
        """max |w| over the trainable parameters, over every rank's shards (a device tensor, not read)."""
        return self.engine.weights_max_abs(self.params) if self.engine is not None else max_abs(self.params)

    def _check_weights(self, lr: float, loss: float, grad_norm: float) -> float:
        """After an update: all weights finite (else stop now, nothing saved); remember how much they grew.
        Returns the logit scale (exp), read with max |w| in one host read."""
        largest = self._max_abs()
        scale = self.model.logit_scale.detach().exp().to(largest)
        before, (after, scale) = self._weights, torch.stack([largest, scale]).tolist()
        step = self.state.step + 1
        if not math.isfinite(after):
            raise TrainingDiverged(
                f"the update of step {step} made the weights non-finite although its loss ({loss:.4g}) and gradient "
                f"norm ({grad_norm:.4g}) were finite: the update diverged (learning rate {lr:.3g}). Lower train.lr or "
                "lengthen train.warmup_steps; nothing after the last checkpoint was saved"
            )
        self._weights = after
        self._last_update = {"step": step, "lr": lr, "before": before, "after": after}
        return scale

    def _skip(self, batch: Batch, loss: float, grad_norm: float) -> None:
        self.optimizer.zero_grad(set_to_none=True)
        self.state.bad_steps += 1
        ids = ", ".join(batch.ids[:8]) + (" ..." if len(batch.ids) > 8 else "")
        log.warning("skipped a step: loss %s, gradient norm %s; samples: %s", loss, grad_norm, ids)
        self.logger.step({"step": self.state.step, "epoch": self.state.epoch, "skipped": True, "loss": loss,
                          "grad_norm": grad_norm,
                          "ids": batch.ids})  # fmt: skip
        if self.state.bad_steps >= self.cfg.nan_patience:
            raise TrainingDiverged(self._diverged_update() or self._bad_steps_message(ids))

    def _diverged_update(self) -> str | None:
        """The stop message when the failures follow an update that blew up the weights (None otherwise)."""
        last = self._last_update
        if not last or last["step"] != self.state.step or not last["after"] > DIVERGED_GROWTH * last["before"]:
            return None
        step = int(last["step"])
        suspect = self.ckpt_dir / checkpoint.checkpoint_name(step)
        if self.is_main and suspect.is_dir():
            checkpoint.mark_diverged(suspect, f"every step after the update of step {step} failed")
        since = (
            f"each of the {self.state.bad_steps} steps since then had a non-finite loss or gradient"
            if self.state.bad_steps
            else "the validation after it failed on non-finite outputs"
        )
        return (
            f"the update of step {step} diverged: it grew the largest |weight| from {last['before']:.3g} to "
            f"{last['after']:.3g} (learning rate {last['lr']:.3g}), and {since}. Lower train.lr or lengthen "
            "train.warmup_steps. Checkpoints holding those weights are marked diverged; a resume uses the one before"
        )

    def _bad_steps_message(self, ids: str) -> str:
        advice = ["check these samples with `sharpclip validate-data`", "lower train.lr"]
        if self.cfg.precision == "bf16":
            advice.insert(1, "use train.precision=fp32")
        return (
            f"{self.state.bad_steps} consecutive steps had a non-finite loss or gradient (last samples: {ids}); "
            + ", ".join(advice[:-1])
            + f" or {advice[-1]}"
        )

    def _diagnose(self, batch: Batch) -> None:
        gamma = self.objective.param_of("hn_clip", "gamma")  # the configured HN-CLIP term's γ (its default without)
        encoder = self.encoder
        if self._plain is not None:  # each rank's own gradients: on a plain copy holding the current weights
            self._plain.load_state_dict(self.engine.full_model_state(everywhere=True))
            encoder = FeatureEncoder(self._plain, ("image", "text"), precision=self.cfg.precision)
        record = gradient_diagnostics(encoder, batch, self.micro, gamma, self.cfg.accumulation, self.ctx)
        self.logger.diagnose({"step": self.state.step, "epoch": self.state.epoch, **record})

    # -- checkpoints ------------------------------------------------------------------------------------------
    def save(self, best: bool = False) -> Path:
        """Write a checkpoint of the current step, including every rank's loader position and RNG states, the world
        size and the per-rank batch; `best`: mark it best (before pruning). The checkpoint just written and the best
        are never pruned. Every rank must call it: the per-rank states and the model are gathered, and every rank
        writes its shards of the optimiser's state (train.checkpoint). With train.async_checkpoint on CUDA the files
        are written in the background and the folder appears complete when the next save (or the run's end) waits for
        it; the path is returned either way."""
        self._finish_saving()
        world = self.ctx.world
        loaders = self.ctx.all_ranks(self.loader.state_dict())  # each rank's position and RNG: no collective on 1
        trainer_state = {**asdict(self.state), "loader": loaders[0], "loaders": loaders, "world_size": world,
                         "rank_batch": self.cfg.batch_size // world, "logs": self._log_sizes() if self.is_main else {},
                         "epoch_open": self._epoch_open, "saturated": self._saturated}  # fmt: skip
        if self._written == self.state.step:  # the epoch's end at a step just checkpointed: record it, not rewrite
            return self._record_epoch_end(trainer_state, best)
        rngs = self.ctx.all_ranks(checkpoint.rng_state(self.device))
        finite = math.isfinite(float(self._max_abs()))  # _check_weights stops earlier; never save such weights
        if self.is_main and not finite:
            raise TrainingDiverged(f"refusing to checkpoint non-finite weights at step {self.state.step}")
        write_model = self.write_model
        if self.engine is not None:  # whole weights gathered once onto rank 0's CPU (a copy: safe to write later)
            write_model = functools.partial(self.write_model, state=self.engine.full_model_state())
        elif self._async_saves:  # written while training goes on: this step's weights, copied
            write_model = functools.partial(self.write_model, state=checkpoint.snapshot(self.model))
        sharded = checkpoint.sharded_state(self.model, self.optimizer, self.scheduler, rngs)
        pending = checkpoint.begin_save(self.ckpt_dir, self.state.step, write_model, sharded, trainer_state,
                                        self.is_main, asynchronous=self._async_saves)  # fmt: skip
        self._saving = (pending, best, self.state.best)
        self._written = self.state.step
        if not self._async_saves:
            return self._finish_saving()
        self.control.saved()  # this step's state is taken: the checkpoint clock starts again now, not at the rename
        return pending.final

    def _record_epoch_end(self, trainer_state: dict, best: bool) -> Path:
        """The checkpoint of this step is complete already (written at the step, or resumed from): its trainer state
        takes the epoch's end in one atomic rename (train.checkpoint.update_trainer_state), then best and pruning."""
        path = self.ckpt_dir / checkpoint.checkpoint_name(self.state.step)
        if self.is_main:
            checkpoint.update_trainer_state(path, trainer_state)
            log.info("checkpoint %s updated with the end of epoch %d", path.name, self.state.epoch - 1)
        return self._completed(path, best, self.state.best)

    def _finish_saving(self) -> Path | None:
        """Complete the save being written (rename, mark it best, prune; every rank); None when there is none."""
        if self._saving is None:
            return None
        (pending, best, metric), self._saving = self._saving, None
        return self._completed(pending.wait(), best, metric)

    def _completed(self, path: Path, best: bool, metric: float) -> Path:
        if self.is_main:
            if best:
                checkpoint.mark_best(self.ckpt_dir, path, metric)
            checkpoint.prune(self.ckpt_dir, self.cfg.keep_last, keep=(path,))
        self.ctx.barrier()
        self.control.saved()  # the checkpoint clock starts again
        return path

    def _log_sizes(self) -> dict[str, int]:
        """Bytes of each JSONL log when a checkpoint is written: a resume cuts the logs back to these."""
        writers = (self.logger.metrics, self.logger.diagnostics)
        return {w.path.name: w.path.stat().st_size for w in writers if w.path.is_file()}

    def resume(self, path: Path, loaded: tuple | None = None) -> None:
        """Continue exactly from checkpoint `path`: weights, optimiser, schedule, each rank's loader position and RNG
        (on another number of ranks too, where it stopped: `train.reshard`).

        `loaded`: `checkpoint.load(path)` already read (and checked). The learning rate then follows this trainer's
        config at the restored step (train.resume documents what may change); the JSONL logs are cut back to what
        they held when the checkpoint was written, so no step is logged twice.
        """
        weights, training, trainer_state = loaded if loaded is not None else checkpoint.load(path)
        if self.engine is not None:
            self.engine.load_full_model_state(weights)
        else:
            self.model.load_state_dict(weights)
        training = self._load_training(path, training, int(trainer_state.get("world_size", 1)))
        ranks, loaders = resume_policy.rank_states(trainer_state, training, self.ctx.rank, self.ctx.world)
        logs = trainer_state.pop("logs", None)
        self._epoch_open = bool(trainer_state.pop("epoch_open", False))  # then fit() owes that epoch its end
        self._saturated = [tuple(pair) for pair in trainer_state.pop("saturated", [])]
        self.state = TrainerState(**trainer_state)
        self._resumed_epoch = True
        self._written = self.state.step  # complete: its epoch's end, if still owed, is recorded in it
        if ranks is not None:  # the same world size: each rank continues its own position and random streams
            self.loader.load_state_dict(ranks[0])
            self._resume_rng = ranks[1]
        else:  # exact, on this world size: train.reshard
            reshard.continue_mid_epoch(self.state, self.cfg, loaders, self.loader, self.ctx.rank, self.ctx.world)
        self._reschedule()
        self._weights = float(self._max_abs())
        if self.is_main:
            self._cut_logs(logs)
            self.logger.resume_at(self.state.step)
        log.info("resumed from %s at step %d (epoch %d); learning rate %.3g: the schedule is rebuilt for %d steps "
                 "and read at step %d", path, self.state.step, self.state.epoch, self.optimizer.param_groups[0]["lr"],
                 self.total_steps, self.state.step)  # fmt: skip

    def _load_training(self, path: Path, training: dict, saved_world: int) -> dict:
        """Optimiser and scheduler from the checkpoint (resharded by DCP onto this run's layout); returns the RNG
        part for `resume_policy.rank_states`. A checkpoint from before the DCP folder (training_state.pt: the whole
        optimiser state, by parameter name or by index) loads onto any layout through the by-name state."""
        if not checkpoint.is_legacy(path):
            rngs = checkpoint.load_sharded(path, self.model, self.optimizer, self.scheduler, saved_world,
                                           self.ctx.world, self.device)  # fmt: skip
            return {"rank_rng": rngs or [None] * self.ctx.world}
        optimizer = by_name(training["optimizer"])
        if self.engine is not None:
            self.engine.load_full_optimizer_state(self.optimizer, optimizer)
        else:
            load_named_optimizer_state(self.model, self.optimizer, optimizer)
        self.scheduler.load_state_dict(training["scheduler"])
        return training

    def _reschedule(self) -> None:
        """Each group's base rate from this config, times this config's schedule at the restored step."""
        groups = self.optimizer.param_groups
        bases = [lr_for(g["names"][0], self.cfg.lr, self.cfg.module_lr) for g in groups]
        factor = self.scheduler.lr_lambdas[0](self.scheduler.last_epoch)
        for group, base in zip(groups, bases, strict=True):
            group["initial_lr"], group["lr"] = base, base * factor
        self.scheduler.base_lrs = bases
        self.scheduler._last_lr = [g["lr"] for g in groups]

    def _cut_logs(self, sizes: dict[str, int] | None) -> None:
        for writer in (self.logger.metrics, self.logger.diagnostics):
            if not writer.path.is_file():
                continue
            if sizes is not None:  # checkpoints record the byte length of each log when they were written
                if writer.path.stat().st_size > sizes.get(writer.path.name, 0):
                    os.truncate(writer.path, sizes.get(writer.path.name, 0))
                continue
            lines = writer.path.read_text().splitlines(keepends=True)  # older checkpoints: keep steps up to ours
            kept = [line for line in lines if json.loads(line).get("step", 0) <= self.state.step]
            if len(kept) != len(lines):
                writer.path.write_text("".join(kept))
