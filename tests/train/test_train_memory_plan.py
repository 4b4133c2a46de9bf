"""The memory plan (train.memory_plan) against what a real step allocates: parameters, gradients and AdamW's state
to the byte after an optimiser step of a tiny model; activations per row estimated within a stated tolerance of a
measured forward and backward; the layouts' division; the command's output and its one-line refusals."""

from __future__ import annotations

import pytest
import torch
from transformers import CLIPConfig, CLIPModel

from _support.tiny_run import toy_model
from sharpclip.cli import main
from sharpclip.config import ConfigError, load_config
from sharpclip.models.hf import wrap
from sharpclip.train import memory_plan as mp
from sharpclip.train.optim import build_optimizer

ACTIVATION_TOLERANCE = 0.10  # the estimate (layers × tokens × width × factor) against the measured bytes per row


def _step(model: torch.nn.Module) -> torch.optim.Optimizer:
    """One real optimiser step of `model` (so AdamW's state exists)."""
    optimizer = build_optimizer(model, 1e-3, 0.1)
    pixels = torch.randn(2, 3, 32, 32)
    ids = torch.randint(0, 20, (2, 12))
    image, text = model.encode_image(pixels).embedding, model.encode_text(ids, torch.ones_like(ids)).embedding
    (model.logit_scale.exp() * image @ text.T).sum().backward()  # every trainable weight gets a gradient
    optimizer.step()
    return optimizer


def _state_bytes(optimizer: torch.optim.Optimizer) -> int:
    return sum(t.nbytes for s in optimizer.state.values() for t in s.values() if isinstance(t, torch.Tensor))


def test_the_plan_holds_the_bytes_a_real_optimiser_step_allocates():
    model = toy_model()
    for p in model.vision_model.parameters():  # a frozen tower: parameters held, no gradient, no moments
        p.requires_grad_(False)
    optimizer = _step(model)
    held = sum(p.nbytes for p in model.parameters())
    grads = sum(p.grad.nbytes for p in model.parameters() if p.grad is not None)
    plan = mp.plan(mp.model_shape(model), "fp32", "replicate")
    assert (plan.parameters, plan.gradients, plan.optimizer) == (held, grads, _state_bytes(optimizer))
    assert plan.trainable_params < plan.total_params and plan.compute_copies == 0


def _clip(width: int = 128, layers: int = 3, act: str = "quick_gelu") -> torch.nn.Module:
    text = dict(hidden_size=width, intermediate_size=4 * width, num_hidden_layers=layers, num_attention_heads=4,
                max_position_embeddings=64, vocab_size=100, bos_token_id=0, eos_token_id=1, pad_token_id=1,
                hidden_act=act)  # fmt: skip
    vision = dict(hidden_size=width, intermediate_size=4 * width, num_hidden_layers=layers, num_attention_heads=4,
                  image_size=64, patch_size=8, hidden_act=act)  # fmt: skip
    return wrap(CLIPModel(CLIPConfig(text_config=text, vision_config=vision, projection_dim=width)))


@pytest.mark.parametrize(("precision", "act"), [("fp32", "quick_gelu"), ("bf16", "quick_gelu"), ("fp32", "gelu"),
                                                ("bf16", "gelu")])  # fmt: skip
def test_estimated_activations_are_within_the_tolerance_of_a_measured_forward_and_backward(precision, act):
    model = _clip(act=act)
    shape = mp.model_shape(model)
    assert [(t.name, t.layers, t.tokens, t.width) for t in shape.towers] == [("vision", 3, 65, 128),
                                                                              ("text", 3, 64, 128)]  # fmt: skip
    measured = mp.measure_activations(model, precision, torch.device("cpu"))
    estimated = mp.estimate_activations(shape.towers, precision)
    for tower, bytes_ in measured.items():
        assert bytes_ > 0
        assert abs(estimated[tower] - bytes_) <= ACTIVATION_TOLERANCE * bytes_, (tower, estimated, measured)
    assert all(p.grad is None for p in model.parameters())  # the trials leave no gradient behind


def test_measuring_leaves_every_random_generator_as_it_was():
    model = _clip(width=64, layers=1)
    torch.manual_seed(3)
    mp.measure_activations(model, "fp32", torch.device("cpu"))
    after = torch.rand(3)
    torch.manual_seed(3)
    torch.testing.assert_close(after, torch.rand(3))


def test_layouts_divide_parameters_gradients_and_moments_by_their_ranks():
    shape = mp.ModelShape(params=(((10, 4), 4, True), ((7,), 4, True), ((), 4, False)), largest_block=20,
                          towers=(mp.Tower("text", 2, 8, 4),), block_params=40)  # fmt: skip
    whole = mp.plan(shape, "fp32", "replicate", world=16, local=8)
    assert whole.shard_ranks == 1 and whole.parameters == (40 + 7 + 1) * 4
    shard = mp.plan(shape, "fp32", "shard", world=16, local=8)  # dim-0 chunks, rounded up: rank 0's share
    assert shard.shard_ranks == 16 and shard.parameters == (1 * 4 + 1 + 1) * 4 and shard.gradients == (4 + 1) * 4
    assert shard.optimizer == 2 * shard.gradients + 2 * mp.STEP_BYTES
    hybrid = mp.plan(shape, "bf16", "hybrid", world=16, local=8)
    assert hybrid.shard_ranks == 8 and hybrid.parameters == (2 * 4 + 1 + 1) * 4
    # gathered in bf16: two blocks in flight and the 8 parameters outside blocks (the towers' and the root's own)
    assert hybrid.compute_copies == (mp.PREFETCHED_BLOCKS * 20 + 8) * 2
    kept = mp.plan(shape, "bf16", "hybrid", world=16, local=8, keep_gathered=True)
    assert kept.compute_copies == 48 * 2  # every block gathered for the step
    accumulating = mp.plan(shape, "bf16", "hybrid", world=16, local=8, keep_gathered=True, accumulating=True)
    assert accumulating.compute_copies == 48 * 2 + 47 * 4  # and an fp32 unsharded gradient of every trainable one
    assert mp.plan(shape, "bf16", "replicate").compute_copies == 48 * 2  # every weight's bf16 copy


def test_checkpointing_keeps_each_layers_input_and_one_layer():
    tower = mp.Tower("vision", layers=4, tokens=10, width=8)
    assert mp.checkpointed(tower, 4000) == 4 * 10 * 8 * mp.HIDDEN_BYTES + 1000


def test_the_largest_micro_batch_fits_what_is_left_after_the_static_part():
    shape = mp.ModelShape(params=(((1000, 1000), 4, True),), largest_block=0, towers=(mp.Tower("text", 1, 1, 1),))
    plan = mp.plan(shape, "fp32", "replicate", activations={"text": 1 << 20})
    gpu = 4 * mp.GIB
    rows = plan.largest_rows(gpu)
    assert plan.total(rows) <= mp.usable(gpu) < plan.total(rows + 1)


def test_recipes_give_plausible_numbers_for_large_architectures():
    cfg = load_config(["configs/hnclip_docci.yaml"], [])
    big = mp.plan_for(cfg, arch="ViT-bigG-14", world=8, local=8)
    assert 2.4e9 < big.total_params < 2.7e9  # open_clip's published ViT-bigG-14 count: about 2.54 B
    # 16 B a parameter whole on every rank, plus bf16 copies; the recipe's gradient diagnostics add their fp32 copy
    assert 38 * mp.GIB < big.static - big.diagnostics_copy < 48 * mp.GIB
    assert big.diagnostics_copy == (big.total_params + big.trainable_params) * 4
    sharded = mp.plan_for(load_config(["configs/hnclip_docci.yaml"], ["train.layout=shard"]), "ViT-bigG-14", 8, 8)
    assert sharded.parameters == pytest.approx(big.parameters / 8, rel=1e-3)


def test_config_memory_prints_the_plan_and_the_largest_micro_batch(capsys):
    assert main(["config", "configs/hnclip_docci.yaml", "--memory", "--arch", "ViT-L-14", "--world-size", "8",
                 "--gpu-memory", "80GiB"]) == 0  # fmt: skip
    out = capsys.readouterr().out
    assert "427,747,841 parameters" in out and "largest micro-batch about" in out and "estimated" in out


def test_config_memory_without_the_architecture_is_one_line_naming_arch(capsys):
    assert main(["config", "configs/hnclip_docci.yaml", "--memory"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--arch" in err[0] and "ViT-bigG-14" in err[0]


@pytest.mark.parametrize("text", ["80", "eighty GiB", "-3GB", "80XB"])
def test_a_bad_gpu_memory_size_is_refused(text):
    if text == "80":
        assert mp.parse_size(text) == 80
        return
    with pytest.raises(ConfigError, match="--gpu-memory"):
        mp.parse_size(text)


def test_sizes_read_as_written():
    assert mp.parse_size("80GiB") == 80 * mp.GIB and mp.parse_size("141 GB") == 141 * 10**9


def test_the_plan_heads_train_log_even_after_the_process_logged_before_the_run(tmp_path):
    """A message logged before the run (INFO then disabled, and cached so by `logging`) must not keep the run's INFO
    lines out of train.log."""
    import logging

    from _support.tiny_files import tiny_config, write_generic
    from sharpclip.train.run import run_train

    logging.getLogger("sharpclip.train").info("before the run")
    root = write_generic(tmp_path / "data")
    run_train(tiny_config(root, tmp_path / "run", "train.eval_every=0", "train.max_steps=1"))
    log = (tmp_path / "run" / "train.log").read_text()
    assert "memory plan per rank: layout replicate" in log and "activations per row (estimated)" in log, log[:3000]
    assert "checkpoint step-000001 written in" in log  # each save's seconds


def test_measure_builds_the_architecture_on_the_meta_device_then_runs_it_for_real(tmp_path, capsys):
    """--arch with a model config JSON (no weights anywhere) and --measure: the structure materialised with random
    weights, a forward and backward measured; the same shapes give the estimate within the tolerance."""
    import json

    arch = tmp_path / "small.json"
    arch.write_text(json.dumps({"embed_dim": 64, "vision_cfg": {"image_size": 64, "layers": 2, "width": 64,
                                "patch_size": 16}, "text_cfg": {"context_length": 32, "width": 64, "heads": 4,
                                "layers": 2}}))  # fmt: skip
    cfg = load_config(["configs/hnclip_docci.yaml"], ["train.precision=fp32", "train.grad_checkpointing=false"])
    measured = mp.print_plan(cfg, str(arch), measure=True)
    estimated = mp.print_plan(cfg, str(arch))
    assert "activations per row (measured on cpu)" in capsys.readouterr().out
    assert measured.activation_source == "measured on cpu" and estimated.activation_source == "estimated"
    assert measured.static == estimated.static and measured.total_params == estimated.total_params
    assert abs(estimated.per_row - measured.per_row) <= ACTIVATION_TOLERANCE * measured.per_row, (measured, estimated)


def test_the_logged_plan_takes_the_runs_ranks_per_node_not_the_environment(monkeypatch):
    """Training logs the plan for its parallel context's node size (what the hybrid mesh is built from), whatever
    LOCAL_WORLD_SIZE says."""
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    cfg = load_config(["configs/hnclip_docci.yaml"], ["train.layout=hybrid", "train.precision=fp32"])
    logged = mp.log_plan(cfg, toy_model(), torch.device("cpu"), world=4, local=2)
    assert logged.shard_ranks == 2 and mp.plan_for(cfg, world=4, model=toy_model()).shard_ranks == 4


def test_the_plan_refuses_what_training_refuses_and_its_flags_ask_for_it(capsys):
    """Matrix 6 M4 (a hybrid layout over 8 ranks of 3-GPU nodes was planned; training refuses it) and M5
    (--gpu-memory without --memory printed the config, the flag ignored)."""
    args = ["config", "configs/hnclip_docci.yaml", "--arch", "ViT-L-14", "--gpu-memory", "80GiB"]
    assert main([*args, "--world-size", "8", "--gpus-per-node", "3", "train.layout=hybrid"]) == 2
    err = capsys.readouterr().err
    assert "hybrid shards within a node" in err and "a whole number of nodes of 3" in err
    assert main([*args, "--world-size", "3", "train.batch_size=128"]) == 2
    assert "must be divisible by the 3 processes" in capsys.readouterr().err
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "largest micro-batch about" in out and "\ntrain:\n" not in out


def test_the_plan_counts_the_diagnostics_model_copy_on_several_ranks():
    """The gradient diagnostics keep a plain fp32 copy of the model (and its gradients) on every rank of a run of
    several: the plan's static part holds it there, and nothing on one process."""
    cfg = load_config(None, ["model.name=tiny-clip", "train.diagnostics_every=50"])
    one, eight = mp.plan_for(cfg, world=1), mp.plan_for(cfg, world=8)
    assert one.diagnostics_copy == 0
    assert eight.diagnostics_copy == (eight.total_params + eight.trainable_params) * 4 > 0
    assert eight.static == one.static + eight.diagnostics_copy  # replicated: nothing else differs
    assert any("diagnostics" in line for line in eight.lines())
