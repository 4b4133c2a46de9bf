"""Device placement: every tensor that reaches a tower or a loss is on the model's device; `auto` resolves as
documented; bad devices and bf16 on a GPU without it are one-line config errors; checkpoints are device-free."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from _support.tiny_run import ToyLoader, toy_model, train_config
from sharpclip import devices
from sharpclip.config import ConfigError, LossConfig, ModelConfig, TermConfig, load_config
from sharpclip.models.factory import save_checkpoint
from sharpclip.train import checkpoint
from sharpclip.train.features import FeatureEncoder, build_objective, to_model_device
from sharpclip.train.trainer import Trainer

TERMS = {"hn": TermConfig("hn_clip"), "tok": TermConfig("filip", weight=0.5), "short": TermConfig("infonce")}


class DeviceCheck:
    """Forward pre-hooks on both towers and a wrapper around the objective that record every tensor's device."""

    def __init__(self, model, objective):
        self.seen: dict[str, set[torch.device]] = {"vision": set(), "text": set(), "loss": set()}
        self.objective = objective
        for name, tower in (("vision", model.vision_model), ("text", model.text_model)):
            tower.register_forward_pre_hook(self._hook(name), with_kwargs=True)

    def _record(self, where: str, values) -> None:
        for v in values:
            if isinstance(v, torch.Tensor):
                self.seen[where].add(v.device)

    def _hook(self, where: str):
        def hook(module, args, kwargs):
            self._record(where, [*args, *kwargs.values()])

        return hook

    def __call__(self, features):
        self._record("loss", features.values())
        return self.objective(features)

    def __getattr__(self, name):  # the rest of the objective's interface (diagnose, param_of, ...)
        return getattr(self.objective, name)


def _trainer(tmp_path: Path, device: str, **overrides) -> tuple[Trainer, DeviceCheck]:
    model = toy_model()
    objective = build_objective(LossConfig(terms=TERMS))
    cfg = train_config(str(tmp_path / "run"), device=device, **overrides)
    loader = ToyLoader(model.tokenizer, n=32, batch_size=cfg.batch_size, edits=True)

    def write_model(d: Path) -> None:
        save_checkpoint(model, d, ModelConfig(name="tiny-clip"))

    trainer = Trainer(model, objective, loader, cfg, tmp_path / "run", write_model=write_model)
    check = DeviceCheck(model, objective)
    trainer.objective = check
    return trainer, check


def _assert_all_on(check: DeviceCheck, device: torch.device) -> None:
    for where, seen in check.seen.items():
        assert seen == {device}, f"{where} received tensors on {seen}, the model is on {device}"


def _train_and_check(tmp_path: Path, device: str) -> None:
    trainer, check = _trainer(tmp_path, device, max_steps=2, diagnostics_every=1)
    trainer.fit()
    assert trainer.device == torch.device(device)
    assert {p.device for p in trainer.model.parameters()} == {trainer.device}
    _assert_all_on(check, trainer.device)


def test_every_tensor_reaching_towers_and_losses_is_on_the_model_device_cpu(tmp_path):
    _train_and_check(tmp_path, "cpu")


@pytest.mark.gpu
def test_every_tensor_reaching_towers_and_losses_is_on_the_model_device_cuda(tmp_path):
    _train_and_check(tmp_path, "cuda:0")


def test_the_one_move_takes_every_batch_tensor_to_the_model_device():
    """On the meta device (shapes only, no data): pixels, ids, masks, short captions and edit indices all move."""
    model = toy_model()
    batch = next(iter(ToyLoader(model.tokenizer, n=8, batch_size=8, edits=True)))
    batch.short_input_ids, batch.short_attention_mask = batch.input_ids.clone(), batch.attention_mask.clone()
    assert to_model_device(batch, model) is batch  # already there: no copy
    moved = to_model_device(batch, model.to("meta"))
    fields = {k: v.device.type for k, v in vars(moved).items() if isinstance(v, torch.Tensor)}
    assert set(fields) >= {"pixel_values", "input_ids", "attention_mask", "short_input_ids", "short_attention_mask",
                           "groups", "edit_source", "edit_target"}  # fmt: skip
    assert set(fields.values()) == {"meta"}


# -- resolution ---------------------------------------------------------------------------------------------------
def _fake_cuda(monkeypatch, count: int, bf16: bool = True) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: count > 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: count)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *_: "Fake GPU")
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *_, **__: bf16)


def test_auto_is_the_local_rank_gpu_with_cuda_and_the_cpu_without(monkeypatch):
    _fake_cuda(monkeypatch, 0)
    assert devices.resolve_device("auto", "train.device") == torch.device("cpu")
    _fake_cuda(monkeypatch, 4)
    monkeypatch.setenv("LOCAL_RANK", "2")
    assert devices.resolve_device("auto", "train.device") == torch.device("cuda", 2)
    assert devices.resolve_device("cuda", "train.device") == torch.device("cuda", 2)
    assert devices.resolve_device("cuda:1", "train.device") == torch.device("cuda", 1)
    assert devices.resolve_device("cpu", "train.device") == torch.device("cpu")


def test_one_visible_gpu_per_rank_is_cuda_0_whatever_the_local_rank(monkeypatch):
    """SLURM-style start-up: CUDA_VISIBLE_DEVICES leaves each task its own single GPU, which it sees as cuda:0."""
    _fake_cuda(monkeypatch, 1)
    monkeypatch.setenv("LOCAL_RANK", "3")
    assert devices.resolve_device("auto", "train.device") == torch.device("cuda", 0)
    assert devices.resolve_device("cuda", "train.device") == torch.device("cuda", 0)
    _fake_cuda(monkeypatch, 2)  # several GPUs visible but fewer than the local ranks: a real misconfiguration
    with pytest.raises(ConfigError, match=r"^train\.device: cuda:3 does not exist \(local rank 3\)"):
        devices.resolve_device("auto", "train.device")


def test_any_cuda_device_is_made_current_with_or_without_torchrun(monkeypatch):
    from sharpclip.train import distributed

    current = []
    monkeypatch.setattr(torch.cuda, "set_device", current.append)
    for key in ("RANK", "WORLD_SIZE"):
        monkeypatch.delenv(key, raising=False)
    assert distributed.init_from_env(torch.device("cuda", 1)) is False  # no torchrun: no process group
    assert current == [torch.device("cuda", 1)]  # but cuda:1 is current, so nothing lands on GPU 0


def test_the_process_group_timeout_is_train_dist_timeout_min(monkeypatch):
    from datetime import timedelta

    from sharpclip.config import TrainConfig
    from sharpclip.train import distributed

    calls = []
    monkeypatch.setattr(distributed.dist, "init_process_group", lambda **kw: calls.append(kw))
    monkeypatch.setattr(distributed, "is_distributed", lambda: False)
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert distributed.init_from_env(torch.device("cpu"), 0.5)
    assert calls == [{"backend": "gloo", "timeout": timedelta(seconds=30)}]
    assert TrainConfig().dist_timeout_min == 60  # rank 0 may count shards or write a ViT-L checkpoint meanwhile
    with pytest.raises(ConfigError, match=r"^train\.dist_timeout_min: must be > 0"):
        load_config(overrides=["train.dist_timeout_min=0"])


def test_cuda_without_cuda_and_a_missing_index_are_config_errors(monkeypatch):
    _fake_cuda(monkeypatch, 0)
    with pytest.raises(
        ConfigError, match=r"^train\.device: 'cuda' but this machine has no usable CUDA; available: cpu"
    ):
        devices.resolve_device("cuda", "train.device")
    _fake_cuda(monkeypatch, 1)
    with pytest.raises(
        ConfigError, match=r"^eval\.device: cuda:3 does not exist .* available: cpu, cuda:0 \.\. cuda:0"
    ):
        devices.resolve_device("cuda:3", "eval.device")
    with pytest.raises(ConfigError, match=r"train\.device: 'gpu' is not a device"):
        load_config(overrides=["train.device=gpu"])


def test_bf16_on_a_gpu_without_it_names_the_key_and_the_alternative(monkeypatch):
    _fake_cuda(monkeypatch, 1, bf16=False)
    with pytest.raises(ConfigError, match=r"train.precision: bf16 is not supported on cuda:0 \(Fake GPU\); use "
                                          r"train.precision=fp32"):  # fmt: skip
        devices.check_precision("bf16", torch.device("cuda", 0), "train.precision")
    devices.check_precision("fp32", torch.device("cuda", 0), "train.precision")
    devices.check_precision("bf16", torch.device("cpu"), "train.precision")


def test_the_trainer_refuses_cuda_on_a_machine_without_it(tmp_path, monkeypatch):
    _fake_cuda(monkeypatch, 0)
    with pytest.raises(ConfigError, match=r"^train\.device"):
        _trainer(tmp_path, "cuda")


def test_tf32_is_on_by_default_and_switchable():
    from sharpclip.config import TrainConfig

    assert TrainConfig().tf32 is True and TrainConfig().device == "auto"
    before = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    try:
        devices.set_tf32(True)
        assert torch.backends.cuda.matmul.allow_tf32 and torch.backends.cudnn.allow_tf32
        devices.set_tf32(False)
        assert not torch.backends.cuda.matmul.allow_tf32 and not torch.backends.cudnn.allow_tf32
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = before


def test_num_workers_auto_is_this_ranks_cores_within_the_cpu_quota(monkeypatch, tmp_path):
    monkeypatch.setattr(devices, "CGROUP", tmp_path)  # no quota file: no quota
    monkeypatch.setattr(devices.os, "sched_getaffinity", lambda _: set(range(2)), raising=False)
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    assert devices.resolve_num_workers("auto") == 2
    monkeypatch.setattr(devices.os, "sched_getaffinity", lambda _: set(range(64)), raising=False)
    assert devices.resolve_num_workers("auto") == 64  # not capped below what the cores allow
    (tmp_path / "cpu.max").write_text("450000 100000\n")  # a pod allowed 4.5 cores on a 64-core host
    assert devices.cpu_quota() == 4.5 and devices.resolve_num_workers("auto") == 5
    (tmp_path / "cpu.max").write_text("max 100000\n")
    assert devices.cpu_quota() is None
    monkeypatch.setattr(devices.os, "sched_getaffinity", lambda _: set(range(12)), raising=False)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")  # four ranks share the node's 12 cores
    assert devices.resolve_num_workers("auto") == 3
    assert devices.resolve_num_workers(0) == 0 and devices.resolve_num_workers("5") == 5
    with pytest.raises(ConfigError, match=r"^data\.num_workers"):
        load_config(overrides=["data.num_workers=many"])


# -- checkpoints --------------------------------------------------------------------------------------------------
def _final_weights(tmp_path: Path, device: str, resume_from: Path | None = None, **overrides) -> dict:
    trainer, _ = _trainer(tmp_path, device, **overrides)
    if resume_from is not None:
        trainer.resume(resume_from)
    trainer.fit()
    return {k: v.detach().cpu() for k, v in trainer.model.state_dict().items()}


def test_checkpoints_hold_no_device_state_and_load_onto_the_cpu(tmp_path):
    trainer, _ = _trainer(tmp_path, "cpu", max_steps=1, checkpoint_every=1)
    trainer.fit()
    ckpt = checkpoint.latest(tmp_path / "run" / "checkpoints")
    keys = checkpoint.sharded_keys(ckpt)
    assert any(k.startswith("rng.ranks.0.torch") for k in keys)
    assert not any(".cuda." in k for k in keys)  # trained on the CPU: no GPU generator to restore
    assert {t.device.type for t in load_file(str(ckpt / "model.safetensors")).values()} == {"cpu"}


def _resume_across(tmp_path: Path, first: str, second: str) -> None:
    """Train 4 steps on `second`; train 2 on `first`, resume on `second` for the other 2: the same weights.

    (The first 2 steps are the warm-up, whose rates do not depend on the run's length.) TF32 is off: CPU fp32 and
    CUDA TF32 matmuls differ in the 4th digit, which Adam's steps would carry into the weights."""
    common = {"max_steps": 4, "checkpoint_every": 2, "epochs": 1, "warmup_steps": 2, "tf32": False}
    reference = _final_weights(tmp_path / "ref", second, **common)
    half = _trainer(tmp_path / "a", first, **{**common, "max_steps": 2})[0]
    half.fit()
    ckpt = checkpoint.latest(tmp_path / "a" / "run" / "checkpoints")
    resumed = _final_weights(tmp_path / "b", second, resume_from=ckpt, **common)
    for name, ref in reference.items():
        assert torch.allclose(resumed[name], ref, atol=1e-4, rtol=1e-4), name


def test_a_checkpoint_resumes_exactly_on_the_cpu(tmp_path):
    _resume_across(tmp_path, "cpu", "cpu")


@pytest.mark.gpu
@pytest.mark.parametrize(("first", "second"), [("cuda:0", "cpu"), ("cpu", "cuda:0")])
def test_a_checkpoint_resumes_on_another_device(tmp_path, first, second):
    _resume_across(tmp_path, first, second)


# -- the GPU paths of precision, RNG replay and compilation ---------------------------------------------------------
@pytest.mark.gpu
def test_exact_accumulation_replays_cuda_dropout():
    """With dropout drawn on the GPU, the replay uses the masks the no-grad pass drew (the CUDA generator restored)."""
    from _support.tiny_towers import TinyTowers, make_batch, objective, split_batch
    from sharpclip.train.accumulate import cached_gradient_step, concat_features

    cuda = torch.device("cuda", 0)
    model = TinyTowers(dropout=0.3).to(cuda)
    micro = [{k: v.to(cuda) for k, v in mb.items()} for mb in split_batch(make_batch(64, seed=3), 16)]
    obj = objective("infonce")
    model.zero_grad()
    torch.cuda.manual_seed(5)
    feats = concat_features([model.encode(mb) for mb in micro])
    ref_loss = obj({**feats, **model.model_inputs()})["loss"]
    ref_loss.backward()
    ref = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()
    torch.cuda.manual_seed(5)
    terms = cached_gradient_step(model.encode, micro, lambda f: obj({**f, **model.model_inputs()}), device=cuda)
    assert torch.allclose(ref_loss.detach(), terms["loss"], atol=1e-10)
    for name, grad in ref.items():
        assert torch.allclose(model.get_parameter(name).grad, grad, atol=1e-6, rtol=0), name


@pytest.mark.gpu
def test_bf16_tf32_and_compile_train_on_cuda(tmp_path):
    trainer, check = _trainer(tmp_path, "cuda", max_steps=2, precision="bf16", compile=True, grad_checkpointing=True)
    trainer.fit()
    _assert_all_on(check, trainer.device)


# -- speed settings on the CPU ------------------------------------------------------------------------------------
def _step_grads(grad_checkpointing: bool) -> dict[str, torch.Tensor]:
    from sharpclip.train.step import run_step

    model = toy_model(attention_dropout=0.2).train()
    if grad_checkpointing:
        model.hf_model.activation_checkpointing_enable({"use_reentrant": False})
    batch = next(iter(ToyLoader(model.tokenizer, n=16, batch_size=16)))
    objective = build_objective(LossConfig(terms={"hn": TermConfig("hn_clip")}))
    torch.manual_seed(3)
    run_step(FeatureEncoder(model, objective.feature_keys), objective, batch, micro_batch_size=4)
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def test_gradient_checkpointing_under_exact_accumulation_gives_the_same_gradients():
    """Dropout on: checkpointing recomputes each layer inside the replay, and must draw the replayed masks again."""
    plain, checkpointed = _step_grads(False), _step_grads(True)
    assert plain.keys() == checkpointed.keys() and len(plain) > 10
    for name, grad in plain.items():
        assert torch.allclose(checkpointed[name], grad, atol=1e-6), name


def test_a_compile_failure_says_which_key_turns_it_off(tmp_path, monkeypatch):
    from torch._inductor.exc import InductorError

    import sharpclip.train.trainer as trainer_module

    def broken_compile(model, **options):  # what a missing compiler does: the first call of the compiled tower raises
        def fail(*args, **kwargs):
            raise InductorError(RuntimeError("no working C++ compiler found\nlong traceback"), None)

        model.vision_model.forward = fail

    monkeypatch.setattr(trainer_module, "compile_blocks", broken_compile)
    trainer, _ = _trainer(tmp_path, "cpu", max_steps=1, compile=True)
    with pytest.raises(RuntimeError, match=r"^train.compile: torch.compile could not compile the transformer blocks "
                                           r"on cpu "
                                           r"\(InductorError: RuntimeError: no working C\+\+ compiler found\); "
                                           r"train without it: train.compile=false$"):  # fmt: skip
        trainer.fit()


@pytest.mark.parametrize("switch", ["allow_tf32", "precision"])
def test_the_tf32_switches_are_put_back(switch):
    """What the autouse fixture of conftest.py does after every test: after devices.set_tf32 (what a Trainer on
    CUDA calls) or a changed float32 matmul precision, the switches read as before."""
    from _support.tf32 import tf32_flags, tf32_restored

    before = tf32_flags()
    with tf32_restored():
        if switch == "allow_tf32":
            devices.set_tf32(not before[1])
        else:
            torch.set_float32_matmul_precision("medium" if before[0] != "medium" else "highest")
        assert tf32_flags() != before
    assert tf32_flags() == before
