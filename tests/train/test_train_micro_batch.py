"""`train.micro_batch_size: auto`: the search, its trials leave nothing behind, and the run it sizes trains exactly as
the run given that size by hand. Memory is capped by a hook on the vision tower that raises `torch.OutOfMemoryError`
for a pass of more rows than the cap (as CUDA's allocator does when the activations do not fit)."""

from __future__ import annotations

import logging
import weakref
from pathlib import Path

import pytest
import torch

from _support.tiny_run import ToyLoader, toy_model, train_config
from sharpclip.config import ConfigError, LossConfig, ModelConfig, TermConfig, load_config
from sharpclip.models.factory import save_checkpoint
from sharpclip.train.features import FeatureEncoder, build_objective
from sharpclip.train.micro_batch import Trial, Trials, candidates, fit_to_memory, largest_fitting, trial_batch
from sharpclip.train.parallel import ParallelContext
from sharpclip.train.step import run_step
from sharpclip.train.trainer import Trainer

TERMS = {"hn": TermConfig("hn_clip"), "tok": TermConfig("filip", weight=0.5)}  # the loss holds token similarities
LIGHT = {"contrastive": TermConfig("infonce")}


def cap_rows(model, rows: int, error: type[BaseException] = torch.OutOfMemoryError) -> list[int]:
    """A forward pre-hook on the vision tower: passes of more than `rows` rows raise `error`; returns the sizes of
    every pass, to be read by the test."""
    passes: list[int] = []

    def hook(module, args, kwargs):
        pixels = args[0] if args else kwargs["pixel_values"]
        passes.append(len(pixels))
        if len(pixels) > rows:
            raise error(f"CUDA out of memory (simulated above {rows} rows)")

    model.vision_model.register_forward_pre_hook(hook, with_kwargs=True)
    return passes


def _run(tmp_path: Path, name: str, cap: int | None, terms=LIGHT, **overrides) -> tuple[Trainer, dict]:
    """Two steps of the tiny CLIP (attention dropout: trials must leave the RNG as found) under a memory cap."""
    model = toy_model(attention_dropout=0.1)
    if cap is not None:
        cap_rows(model, cap)
    cfg = train_config(str(tmp_path / name), **{"max_steps": 2, "batch_size": 12, **overrides})
    loader = ToyLoader(model.tokenizer, batch_size=cfg.batch_size)
    trainer = Trainer(model, build_objective(LossConfig(terms=terms)), loader, cfg, tmp_path / name,
                      write_model=lambda d: save_checkpoint(model, d, ModelConfig(name="tiny-clip")))  # fmt: skip
    trainer.fit()
    return trainer, {k: v.detach().clone() for k, v in model.state_dict().items()}


def test_the_search_tries_the_share_halves_on_failure_then_bisects_up():
    sizes = [1, 2, 3, 4, 6, 8, 12, 16, 24, 48]  # the divisors of 48
    trials = largest_fitting(sizes, lambda s: 0 if s <= 20 else None)
    assert [(t.size, t.peak is not None) for t in trials] == [(48, False), (24, False), (12, True), (16, True)]
    assert largest_fitting(sizes, lambda s: 7)[0] == Trial(48, 7)  # the share fits: one trial
    assert all(t.peak is None for t in largest_fitting(sizes, lambda s: None))
    assert [t.size for t in largest_fitting(sizes, lambda s: 0 if s <= 1 else None)] == [48, 24, 12, 6, 3, 1, 2]


def test_the_candidates_respect_the_batch_split_rules():
    exact = train_config("x", batch_size=48, micro_batch_size="auto")
    assert candidates(exact, 1) == [1, 2, 3, 4, 6, 8, 12, 16, 24, 48]
    assert candidates(exact, 2) == [1, 2, 3, 4, 6, 8, 12, 16, 24]  # at most the rank's share
    per_micro = train_config("x", batch_size=48, micro_batch_size=4, accumulation="per_micro_batch",
                             encode_batch_size="auto")  # fmt: skip
    assert candidates(per_micro, 1) == [4, 8, 12, 16, 24, 48]  # multiples of the micro-batch dividing the batch
    assert candidates(per_micro, 2) == [4, 8, 12, 16, 24]


@pytest.mark.slow
@pytest.mark.parametrize("cap", [5, 12])
def test_auto_under_exact_picks_the_cap_and_trains_the_weights_of_that_size_given_by_hand(tmp_path, cap, caplog):
    """Batch 12, the largest micro-batch of at most `cap` rows that divides it: 4 (12, 6 out of memory; 3, then 4
    fit) or 12 (the whole batch in one pass)."""
    expected = {5: 4, 12: 12}[cap]
    with caplog.at_level(logging.INFO, logger="sharpclip"):
        auto, weights = _run(tmp_path, "auto", cap, micro_batch_size="auto")
    assert auto.micro == auto.cfg.micro_batch_size == expected
    assert f"train.micro_batch_size: auto chose {expected} rows a pass (the global batch stays 12)" in caplog.text
    assert "memory is not measured on cpu" in caplog.text
    _, by_hand = _run(tmp_path, "hand", None, micro_batch_size=expected)
    for key, value in by_hand.items():
        assert torch.equal(weights[key], value), key


@pytest.mark.slow
def test_auto_under_per_micro_batch_sizes_the_encode_passes_and_keeps_the_micro_batch(tmp_path, caplog):
    """HN-CLIP and FILIP terms (the loss's token similarities are part of each trial)."""
    sizes = dict(batch_size=16, micro_batch_size=4, accumulation="per_micro_batch", terms=TERMS)
    with caplog.at_level(logging.INFO, logger="sharpclip"):
        auto, weights = _run(tmp_path, "auto", 9, encode_batch_size="auto", **sizes)
    assert (auto.micro, auto.cfg.encode_batch_size) == (4, 8)
    assert "the micro-batch stays 4 rows, each its own contrastive matrix" in caplog.text
    _, by_hand = _run(tmp_path, "hand", None, encode_batch_size=8, **sizes)
    for key, value in by_hand.items():
        assert torch.equal(weights[key], value), key


def test_after_the_search_a_step_has_the_gradient_of_the_size_given_by_hand():
    """Dropout on, memory capped at 5 rows a pass, batch 8: the search (trials 8, 4) picks 4, and the step
    that follows gives the gradients of a fresh model stepping at 4, bit for bit: the trials left weights, buffers,
    gradients and random generators as they found them."""
    grads = []
    for search in (True, False):
        torch.manual_seed(0)
        model = toy_model(attention_dropout=0.1)
        objective = build_objective(LossConfig(terms=LIGHT))
        encoder = FeatureEncoder(model, objective.feature_keys)
        batch = next(iter(ToyLoader(model.tokenizer, batch_size=8)))
        cfg = train_config("x", batch_size=8, micro_batch_size="auto" if search else 4)
        if search:
            passes = cap_rows(model, 5)
            cfg = fit_to_memory(encoder, objective, batch, cfg)
            assert cfg.micro_batch_size == 4 and max(passes) == 8
        run_step(encoder, objective, batch, cfg.micro_batch_size)
        grads.append({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
    assert grads[0].keys() == grads[1].keys()
    for name, grad in grads[1].items():
        assert torch.equal(grads[0][name], grad), name


def test_bf16_trials_under_the_engine_leave_no_gradient_for_the_next_step():
    """FSDP2 with bf16 compute and an fp32 reduction parks a no-sync backward's gradient outside `.grad`
    (`unsharded_accumulated_grad`); a trial step must not leave it for the next reducing backward. The engine on a
    one-rank mesh (the same hooks as on W ranks): after a trial of 8 rows, the step at 4 has the gradients of a fresh
    model's step at 4, bit for bit."""
    from torch.distributed.device_mesh import init_device_mesh

    from _support.process_group import one_rank_group
    from sharpclip.train.engine import Engine

    grads = []
    with one_rank_group():
        for trial in (True, False):
            model = toy_model()
            objective = build_objective(LossConfig(terms=LIGHT))
            encoder = FeatureEncoder(model, objective.feature_keys, precision="bf16")
            mesh = init_device_mesh("cpu", (1, 1), mesh_dim_names=("replicate", "shard"))
            ctx = ParallelContext(engine=Engine(model, mesh, "bf16"))
            batch = next(iter(ToyLoader(model.tokenizer, batch_size=8)))
            cfg = train_config("x", batch_size=8, micro_batch_size="auto", precision="bf16")
            if trial:
                assert Trials(encoder, objective, batch, cfg, ctx).fits(8) == 0
            run_step(encoder, objective, batch, 4, ctx=ctx)
            grads.append({n: p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad.clone()
                          for n, p in model.named_parameters() if p.grad is not None})  # fmt: skip
    assert grads[0].keys() == grads[1].keys() and len(grads[1]) > 10
    for name, grad in grads[1].items():
        assert torch.equal(grads[0][name], grad), name


def test_auto_on_the_command_line_keeps_the_recipes_micro_batch_under_per_micro_batch(caplog):
    with caplog.at_level(logging.INFO, logger="sharpclip.config"):
        cfg = load_config("configs/hnclip_dci.yaml", ["train.micro_batch_size=auto"])
    assert (cfg.train.micro_batch_size, cfg.train.encode_batch_size) == (16, "auto")
    assert "keeps the micro-batch of 16 rows" in caplog.text
    assert load_config(None, ["train.micro_batch_size=auto"]).train.micro_batch_size == "auto"
    with pytest.raises(ConfigError, match=r"train.micro_batch_size: must be an integer or auto, got 'big'"):
        load_config(None, ["train.micro_batch_size=big"])
    with pytest.raises(ConfigError, match="encode_batch_size applies to accumulation: per_micro_batch only"):
        load_config(None, ["train.encode_batch_size=auto"])


def _trials(cap: int, error: type[BaseException] = torch.OutOfMemoryError):
    model = toy_model()
    objective = build_objective(LossConfig(terms=LIGHT))
    encoder = FeatureEncoder(model, objective.feature_keys)
    batch = next(iter(ToyLoader(model.tokenizer, batch_size=8)))
    cfg = train_config("x", batch_size=8, micro_batch_size="auto")
    return model, Trials(encoder, objective, batch, cfg), cap_rows(model, cap, error)


def test_an_out_of_memory_trial_frees_its_tensors_and_gradients():
    model, trials, _ = _trials(cap=2)
    held = []
    model.text_model.register_forward_hook(lambda m, a, out: held.append(weakref.ref(out.last_hidden_state)))
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    assert trials.fits(4) is None  # 2 replayed micro-batches of 4 rows: the first vision pass raises
    assert trials.fits(2) == 0  # fits (no memory measured on the CPU)
    assert all(p.grad is None for p in model.parameters())
    assert held and all(ref() is None for ref in held)  # nothing of either trial is still alive


def test_an_error_other_than_out_of_memory_propagates():
    _, trials, _ = _trials(cap=2, error=ValueError)
    with pytest.raises(ValueError, match="simulated above 2 rows"):
        trials.fits(4)


def test_the_trial_batch_has_the_runs_largest_shapes():
    model = toy_model()
    batch = next(iter(ToyLoader(model.tokenizer, batch_size=6, edits=True)))
    big = trial_batch(batch, 16, model.context_length)
    assert big.pixel_values.shape[0] == len(big.ids) == 16 and big.input_ids.shape == (16, model.context_length)
    assert torch.equal(big.input_ids[6:12, : batch.input_ids.shape[1]], batch.input_ids)
    assert len(set(big.groups.tolist())) == len(set(batch.groups.tolist())) * 2 + len(set(batch.groups[:4].tolist()))
    third = sum(max(s, t) < 4 for s, t in zip(batch.edit_source.tolist(), batch.edit_target.tolist(), strict=True))
    assert (big.edit_target < 16).all() and len(big.edit_source) == len(batch.edit_source) * 2 + third


def test_every_rank_takes_the_smallest_choice_and_stops_together_when_one_found_none():
    model = toy_model()
    objective = build_objective(LossConfig(terms=LIGHT))
    encoder = FeatureEncoder(model, objective.feature_keys)
    batch = next(iter(ToyLoader(model.tokenizer, batch_size=8)))
    cfg = train_config("x", batch_size=8, micro_batch_size="auto")

    class TwoRanks(ParallelContext):  # this rank's context among 2, the other rank's choice given
        other = 2

        def all_ranks(self, value):
            return [value, self.other]

    ctx = TwoRanks(rank=0, world=2)
    assert fit_to_memory(encoder, objective, batch, cfg, ctx).micro_batch_size == 2  # another rank chose 2
    ctx.other = 0  # another rank found nothing
    with pytest.raises(RuntimeError, match=r"runs out of memory on cpu \(on another rank\); use train.precision=bf16"):
        fit_to_memory(encoder, objective, batch, cfg, ctx)


@pytest.mark.gpu
def test_on_cuda_the_choice_and_its_peak_memory_are_logged(tmp_path, caplog):
    with caplog.at_level(logging.INFO, logger="sharpclip"):
        auto, _ = _run(tmp_path, "auto", None, micro_batch_size="auto", device="cuda")
    assert auto.micro == 12 and "GiB allocated on cuda" in caplog.text


@pytest.mark.slow
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_two_gloo_processes_size_without_collectives_and_train_as_given_by_hand(tmp_path, precision):
    """2 processes under torchrun, dropout on, exact accumulation: each rank's trials run while the process group is
    live (any collective in them would pair with the other rank's and fail or hang), and the weights are those of
    the same run given the share, micro_batch_size=8, by hand (dropout masks depend on the micro-batch's shape, so
    another size would not give them). bf16: FSDP2 keeps a trial's gradient outside `.grad` unless the engine clears
    it (train.engine.Engine.discard_unsynced)."""
    import os
    import subprocess
    import sys

    from safetensors.torch import load_file

    worker = Path(__file__).with_name("trainer_worker.py")
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
    weights = []
    for name, micro in (("auto", "auto"), ("hand", "8")):
        cmd = [*torchrun, str(worker), str(tmp_path / name), str(tmp_path / f"{name}.safetensors"), "dropout",
               f"micro_batch_size={micro}", "max_steps=2", "epochs=1", f"precision={precision}"]  # fmt: skip
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300,
                              env={**os.environ, "OMP_NUM_THREADS": "1"})  # fmt: skip
        assert proc.returncode == 0, proc.stderr[-3000:]
        weights.append(load_file(tmp_path / f"{name}.safetensors"))
    for key, value in weights[1].items():
        assert torch.equal(weights[0][key], value), key


def test_trials_pad_captions_to_the_shortest_context_of_the_towers_they_run():
    """A distillation teacher that reads 32 positions under a student of 77: trial captions are padded to 32 (at 77
    the teacher's position embeddings would not reach)."""
    from sharpclip.config import TinyConfig
    from sharpclip.models.tiny import tiny_model

    student, teacher = toy_model(), tiny_model("clip", size=TinyConfig(context_length=32))
    objective = build_objective(LossConfig(terms={"distill": TermConfig("distill_cosine")}), monitor=False)
    encoder = FeatureEncoder(student, objective.feature_keys, teacher=teacher)
    batch = next(iter(ToyLoader(student.tokenizer, batch_size=4)))
    cfg = fit_to_memory(encoder, objective, batch, train_config("x", batch_size=4, micro_batch_size="auto"))
    assert cfg.micro_batch_size == 4


def test_auto_trials_hold_room_for_the_optimiser_state_it_will_allocate():
    """AdamW allocates exp_avg and exp_avg_sq at its first step, after the trials: each trial holds an allocation of
    exactly that size (8 bytes per fp32 trainable parameter), so a size chosen near capacity still fits at step 2;
    an optimiser that already holds its state adds nothing."""
    from sharpclip.train.micro_batch import optimizer_state_bytes
    from sharpclip.train.optim import build_optimizer

    model, trials, _ = _trials(cap=8)
    optimizer = build_optimizer(model, 1e-3, 0.1)
    assert Trials(trials.encoder, trials.objective, trials.batch, trials.cfg, optimizer=optimizer).state_bytes > 0
    for p in model.parameters():
        p.grad = torch.ones_like(p) if p.requires_grad else None
    optimizer.step()
    allocated = sum(t.numel() * t.element_size() for s in optimizer.state.values() for k, t in s.items()
                    if k in ("exp_avg", "exp_avg_sq"))  # fmt: skip
    assert optimizer_state_bytes(list(model.parameters())) == allocated == trials.state_bytes
    assert Trials(trials.encoder, trials.objective, trials.batch, trials.cfg, optimizer=optimizer).state_bytes == 0
