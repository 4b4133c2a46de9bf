"""The engine (train.engine: FSDP2) and the parallel context (train.parallel).

- W processes train the weights of one: 3 steps through `Trainer.fit` on 2 and 4 gloo ranks, both accumulation
  modes, every layout (replicate, shard over all ranks, hybrid with nodes of 2), in float32, every step clipped: the
  losses and global gradient norms of every step and every weight after the 3 steps equal one process's holding the
  ranks' rows in rank order (1e-5 relative), and so do the gradient diagnostics of a sharded run.
  Also blocks kept gathered (`train.keep_gathered`), fused AdamW, and blocks compiled under the engine's hooks
  (Dynamo's eager backend: no graph break). bf16 (FSDP2's mixed precision, sharded) trains within bf16 rounding of
  it, and one bf16 step on W ranks is within a tenth of bf16's distance from fp32 of one process's. The step-level twin
  (tests/train/test_train_distributed.py) covers LoRA, a frozen tower and SigLIP's bias under
  each layout in float64.
- The step's agreement gives the gather every rank's feature shapes (no shape exchange inside a step), the mesh of
  each layout, and the optimiser state's conversion for checkpoints that resume on another world size or layout.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from sharpclip.config import ConfigError
from sharpclip.train.engine import by_name
from sharpclip.train.parallel import WIDTHS, Agreement, ParallelContext

WORKER = Path(__file__).with_name("engine_worker.py")


@pytest.fixture(scope="module")
def one_process(tmp_path_factory):
    """One process's losses and weights for each mode, holding 2 or 4 ranks' rows in rank order."""
    sys.path.insert(0, str(WORKER.parent))
    from engine_worker import MODES, train

    runs: dict[tuple[str, int], tuple] = {}

    def get(mode: str, world: int):
        if (mode, world) not in runs:
            out = tmp_path_factory.mktemp(f"one-{mode}-{world}")
            if mode == "diagnostics":  # exact, with the gradient diagnostics every 2 steps
                runs[mode, world] = (*train(out, "exact", "replicate", world=world, diagnostics_every=2), out)
            else:
                assert mode in MODES
                runs[mode, world] = train(out, mode, "replicate", world=world)
        return runs[mode, world]

    return get


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 4])
def test_ranks_train_the_weights_of_one_process_in_every_mode_and_layout(tmp_path, one_process, world):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(world), str(WORKER)]
    proc = subprocess.run([*cmd, str(tmp_path)], capture_output=True, text=True, timeout=900,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-4000:]
    losses, weights = json.loads((tmp_path / "losses.json").read_text()), load_file(tmp_path / "weights.safetensors")
    assert len(losses) == 14 and "exact/shard, fused AdamW" in losses and "exact/shard, kept gathered" in losses
    assert losses.pop("compile graph breaks") == [0]  # compiled blocks under FSDP2's hooks (Dynamo, eager backend)
    _bf16_is_one_model_at_every_world_size(losses, weights, world)
    got, expected = _diagnostics(tmp_path / "diagnostics"), _diagnostics(one_process("diagnostics", world)[2])
    assert [r["step"] for r in got] == [r["step"] for r in expected] == [0, 2]
    for mine, one in zip(got, expected, strict=True):
        for key in ("loss_infonce", "loss_hn", "grad_norm_infonce", "grad_norm_hn", "grad_cosine", "batch_rows"):
            assert mine[key] == pytest.approx(one[key], rel=1e-4), key
    bf16 = losses.pop("bf16")  # exact, shard, bf16 parameters and fp32 reduction: bf16 rounding of the fp32 run
    assert bf16[:3] == pytest.approx(one_process("exact", world)[0][:3], rel=2e-2) and bf16 != losses["exact/shard"]
    for case, got in losses.items():
        mode = case.split("/")[0]
        expected_losses, expected = one_process(mode, world)
        assert len(got) == len(expected_losses) == 6, case  # 3 losses, 3 gradient norms
        assert min(got[3:]) > 0.01  # above train.grad_clip: every step was clipped
        assert got == pytest.approx(expected_losses, rel=1e-5), case
        names = {k[len(case) + 1 :] for k in weights if k.startswith(f"{case}/")}
        assert names == set(expected), case
        # atol: 1e-5 of the weights' scale (max |w|): a bias whose gradient is exactly zero, as attention's key
        # bias, moves by float rounding alone, which AdamW's normalisation amplifies to about 1e-6
        scale = max(float(v.abs().max()) for v in expected.values() if v.is_floating_point())
        for name, value in expected.items():
            assert torch.allclose(weights[f"{case}/{name}"], value, rtol=1e-5, atol=1e-5 * scale), (case, name)


def _bf16_is_one_model_at_every_world_size(losses: dict, weights: dict, world: int) -> None:
    """One bf16 step on W ranks (replicated and sharded) against one process holding their rows: the loss and the
    gradients differ by at most a tenth of what separates bf16 from fp32 on one process (one process follows the
    engine's casting rules, train.engine.OneProcessCasts)."""
    from engine_worker import bf16_step

    (loss, grads), (loss32, grads32) = bf16_step("bf16", world=world), bf16_step("fp32", world=world)
    for layout in ("replicate", "shard"):
        case = f"bf16 step/{layout}"
        mine = {k[len(case) + 1 :]: v for k, v in weights.items() if k.startswith(f"{case}/")}
        assert mine.keys() == grads.keys(), case
        assert abs(losses.pop(case) - loss) <= 0.1 * abs(loss - loss32), case
        assert _relative(mine, grads) <= 0.1 * _relative(grads, grads32), case


def _relative(got: dict, expected: dict) -> float:
    """The relative L2 distance of two sets of tensors, all taken as one vector."""
    diff = sum(float((got[k].double() - v.double()).square().sum()) for k, v in expected.items())
    return (diff / sum(float(v.double().square().sum()) for v in expected.values())) ** 0.5


def _diagnostics(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "diagnostics.jsonl").read_text().splitlines()]


def _agreement(rows, edits, widths) -> Agreement:
    agreement = Agreement(rank=1, world=len(rows))
    agreement.rows, agreement.edits = rows, edits
    agreement.widths = [dict.fromkeys(WIDTHS, w) for w in widths]
    return agreement


def test_the_agreement_gives_every_ranks_feature_shapes():
    """Rows, edit pairs and caption widths travel in the step's agreement; every feature's shape on every rank
    follows (the image tokens' count and the width D are the same on every rank)."""
    features = {"image": torch.zeros(4, 8), "text_tokens": torch.zeros(4, 16, 8), "image_tokens": torch.zeros(4, 9, 8),
                "text_token_mask": torch.zeros(4, 16, dtype=torch.bool), "source_image": torch.zeros(1, 8)}  # fmt: skip
    shapes = _agreement([6, 4], [2, 1], [24, 16]).shapes(features)
    assert shapes == [
        [[6, 8, 0], [6, 24, 8], [6, 9, 8], [6, 24, 0], [2, 8, 0]],
        [[4, 8, 0], [4, 16, 8], [4, 9, 8], [4, 16, 0], [1, 8, 0]],
    ]
    with pytest.raises(ValueError, match="'text_tokens' has shape"):  # a feature that does not follow the batch
        _agreement([6, 4], [2, 1], [24, 32]).shapes(features)
    assert _agreement([6, 4], [2, 1], [24, 16]).shapes({"unknown": torch.zeros(4)}) is None  # exchanged instead


@pytest.mark.parametrize(("layout", "world", "local", "shape"), [
    ("replicate", 8, 8, (8, 1)), ("shard", 8, 8, (8,)), ("hybrid", 16, 8, (2, 8)), ("hybrid", 4, 2, (2, 2)),
])  # fmt: skip
def test_each_layout_has_its_mesh(layout, world, local, shape):
    assert ParallelContext(rank=0, world=world, local_world=local, layout=layout).mesh_shape()[0] == shape


def test_hybrid_refuses_ranks_that_are_not_whole_nodes():
    with pytest.raises(ConfigError, match=r"train.layout: hybrid .* 6 processes .* nodes of 4"):
        ParallelContext(rank=0, world=6, local_world=4, layout="hybrid").mesh_shape()


def test_one_process_is_the_same_object_with_one_rank_and_no_engine():
    ctx = ParallelContext.one_process()
    model = torch.nn.Linear(2, 2)
    assert (ctx.rank, ctx.world, ctx.several) == (0, 1, False) and ctx.shard(model, torch.device("cpu")) is None
    assert type(model) is torch.nn.Linear  # nothing wrapped
    assert ctx.agree(None) == [False] and ctx.all_ranks(3) == [3]


def test_an_index_keyed_optimiser_state_converts_to_parameter_names():
    """Checkpoints written before the engine keyed AdamW's state by index; a resume keys it by name (what any world
    size or layout can load), and drops the saving device's foreach/fused choice."""
    saved = {"state": {0: {"step": 1}, 1: {"step": 2}},
             "param_groups": [{"params": [0], "names": ["a.weight"], "foreach": True, "lr": 1.0},
                              {"params": [1], "names": ["b.bias"], "fused": True, "lr": 2.0}]}  # fmt: skip
    named = by_name(saved)
    assert named["state"] == {"a.weight": {"step": 1}, "b.bias": {"step": 2}}
    assert named["param_groups"] == [{"params": ["a.weight"], "names": ["a.weight"], "lr": 1.0},
                                     {"params": ["b.bias"], "names": ["b.bias"], "lr": 2.0}]  # fmt: skip


def test_auto_micro_batches_under_a_sharded_layout_are_refused_in_one_line(tmp_path):
    """`auto`'s trials run each rank alone; a sharded forward gathers parameters from the other ranks."""
    from _support.tiny_run import ToyLoader, toy_model, train_config
    from sharpclip.config import LossConfig, TermConfig
    from sharpclip.train.features import build_objective
    from sharpclip.train.trainer import Trainer

    model = toy_model()
    cfg = train_config(str(tmp_path), micro_batch_size="auto", layout="shard")
    objective = build_objective(LossConfig(terms={"c": TermConfig("infonce")}))
    ctx = ParallelContext(rank=0, world=2, layout="shard")
    with pytest.raises(ConfigError, match=r"^train.micro_batch_size: auto .* train.layout=shard cannot run .*"
                                          r"or use train.layout=replicate$"):  # fmt: skip
        Trainer(model, objective, ToyLoader(model.tokenizer), cfg, tmp_path, lambda d: None, ctx=ctx)


@pytest.mark.slow
@pytest.mark.parametrize("validation_images", [21, 1])
def test_a_sharded_run_validates_and_checkpoints_as_one_process_does(tmp_path, validation_images):
    """`sharpclip train` on 2 gloo ranks with train.layout=shard and validation every epoch (each rank embeds its
    share of the images through the sharded towers, in as many forward passes as the other: with 1 image, rank 1
    embeds a padding item, else rank 0's passes wait for its gathers, a collective mismatch that aborted the run):
    the same validation metrics as one process, and checkpoints written from the gathered weights."""
    from _support.tiny_files import write_generic

    data = write_generic(tmp_path / "data", n=21)
    validation = (data / "test.jsonl").read_text().splitlines(keepends=True)[:validation_images]
    (data / "test.jsonl").write_text("".join(validation))
    args = ["model.name=tiny-clip", "data.num_workers=0", "train.device=cpu", "train.eval_every=1", "train.lr=1e-3",
            "train.progress=false", "train.dist_timeout_min=1", "data.format=generic", f"data.root={data}",
            "train.batch_size=8", "train.micro_batch_size=2", "train.epochs=2"]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
    for name, launcher, extra in (("one", [sys.executable], []), ("two", torchrun, ["train.layout=shard"])):
        cmd = [*launcher, "-m", "sharpclip", "train", *args, *extra, f"train.output_dir={tmp_path / name}"]
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
        assert proc.returncode == 0, proc.stderr[-3000:]
    evals = {}
    for name in ("one", "two"):
        records = map(json.loads, (tmp_path / name / "metrics.jsonl").read_text().splitlines())
        evals[name] = [r for r in records if "eval/mean_R@1" in r]
    assert len(evals["two"]) == len(evals["one"]) == 2
    for two, one in zip(evals["two"], evals["one"], strict=True):
        assert two == pytest.approx(one, rel=1e-6)
    assert sorted(p.name for p in (tmp_path / "two" / "checkpoints").iterdir()) == ["best.json", "step-000002",
                                                                                    "step-000004"]  # fmt: skip
    one = load_file(tmp_path / "one" / "checkpoints" / "step-000004" / "model.safetensors")
    two = load_file(tmp_path / "two" / "checkpoints" / "step-000004" / "model.safetensors")
    scale = max(float(v.abs().max()) for v in one.values() if v.is_floating_point())  # as in the test above
    assert one.keys() == two.keys() and all(torch.allclose(two[k], one[k], rtol=1e-5, atol=1e-5 * scale) for k in one)


def test_a_norm_over_no_gradient_is_a_zero_on_the_engines_device():
    """A sharded run whose rank holds no DTensor gradient still all-reduces its sum of squares: on the mesh's device
    (NCCL reduces only CUDA tensors), not the CPU."""
    from sharpclip.train.engine import _sum_of_squares

    zero = _sum_of_squares([], torch.device("meta"))
    assert zero.device.type == "meta" and zero.shape == ()
    assert float(_sum_of_squares([torch.ones(4), torch.ones(5)], torch.device("cpu"))) == 9.0
