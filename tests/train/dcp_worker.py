"""Sharded checkpoints across layouts and world sizes, with `fully_shard` applied here to the tiny CLIP.

python -m torch.distributed.run --standalone --nproc_per_node 2 dcp_worker.py save-sharded DIR
    trains 2 steps with every encoder layer, each tower and the root fully_shard'ed (the 0-dim logit scale left out
    through ignored_params), checks rank 0's shards against the memory plan's `shard` layout, saves DIR/sharded with
    train.checkpoint and DIR/sharded.pt (the whole model and optimiser state, gathered: what loads must give back);
    then loads that checkpoint onto plain modules on both ranks and onto a freshly sharded model, comparing each
python -m torch.distributed.run --standalone --nproc_per_node 2 dcp_worker.py load-sharded DIR NAME
    loads DIR/NAME (saved by one process, unsharded) onto a fully_shard'ed model and compares with DIR/NAME.pt

Prints "OK <what>" per comparison that held; any difference raises (exit status 1).
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard, register_fsdp_forward_method

from _support.tiny_run import toy_model
from sharpclip.models.factory import save_weights
from sharpclip.train import checkpoint, distributed
from sharpclip.train import memory_plan as mp
from sharpclip.train.optim import build_optimizer, build_scheduler

STEPS = 2


def build(sharded: bool, seed: int):
    """The tiny CLIP (sharded: every encoder layer, each tower and the root), its AdamW and schedule."""
    model = toy_model(seed=seed)
    if sharded:
        mesh = init_device_mesh("cpu", (dist.get_world_size(),))
        ignored = {model.logit_scale}  # fully_shard refuses 0-dim parameters
        for tower in (model.vision_model, model.text_model):
            for layer in tower.encoder.layers:
                fully_shard(layer, mesh=mesh, ignored_params=ignored)
            fully_shard(tower, mesh=mesh, ignored_params=ignored)
        fully_shard(model, mesh=mesh, ignored_params=ignored)
        for method in ("encode_image", "encode_text"):  # the towers are called by method, not forward
            register_fsdp_forward_method(model, method)
    optimizer = build_optimizer(model, 1e-2, 0.1)
    return model, optimizer, build_scheduler(optimizer, 1, 10)


def train(model, optimizer, scheduler, steps: int = STEPS) -> None:
    """The same rows on every rank: sharded or not, every rank ends with the same (whole) weights."""
    generator = torch.Generator().manual_seed(7)
    for _ in range(steps):
        pixels = torch.randn(4, 3, 32, 32, generator=generator)
        ids = torch.randint(0, 20, (4, 12), generator=generator)
        image = model.encode_image(pixels).embedding
        text = model.encode_text(ids, torch.ones_like(ids)).embedding
        loss = torch.nn.functional.cross_entropy(model.logit_scale.exp() * image @ text.T, torch.arange(4))
        loss.backward()
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)


def whole(model, optimizer) -> dict:
    """The model and the optimiser state, gathered whole (every rank must call it)."""
    optimizer_state = get_optimizer_state_dict(model, optimizer, options=StateDictOptions(full_state_dict=True))
    return {"model": checkpoint.full_state(model), "optimizer": optimizer_state}


def save(directory: Path, name: str, model, optimizer, scheduler) -> Path:
    rank = dist.get_rank() if dist.is_initialized() else 0
    state = checkpoint.full_state(model) if checkpoint.is_sharded(model) else None
    rngs = [checkpoint.rng_state()] * (dist.get_world_size() if dist.is_initialized() else 1)
    sharded = checkpoint.sharded_state(model, optimizer, scheduler, rngs)
    trainer_state = {"step": STEPS, "loader": {}, "world_size": len(rngs)}
    reference = whole(model, optimizer)
    path = checkpoint.save(directory / name, STEPS, lambda d: save_weights(model, d, state), sharded, trainer_state,
                           main=rank == 0)  # fmt: skip
    if dist.is_initialized():  # rank 0 renames the folder complete: nobody reads it before (the trainer's barrier)
        dist.barrier()
    if rank == 0:
        torch.save({**reference, "last_epoch": scheduler.last_epoch}, directory / f"{name}.pt")
    return path


def compare(path: Path, reference: Path, sharded: bool, what: str, saved_world: int) -> None:
    """Load checkpoint `path` onto a fresh model (other initial weights) and compare it, gathered, with `reference`."""
    model, optimizer, scheduler = build(sharded, seed=1)
    weights, _, _ = checkpoint.load(path)
    checkpoint.load_model(model, weights)
    world = dist.get_world_size() if dist.is_initialized() else 1
    rngs = checkpoint.load_sharded(path, model, optimizer, scheduler, saved_world, world)
    got = whole(model, optimizer)
    if not dist.is_initialized() or dist.get_rank() == 0:
        want = torch.load(reference, weights_only=True)
        _equal(got["model"], want["model"], "model")
        _equal(got["optimizer"]["state"], want["optimizer"]["state"], "optimizer")
        assert scheduler.last_epoch == want["last_epoch"] == STEPS, (scheduler.last_epoch, want["last_epoch"])
        world = dist.get_world_size() if dist.is_initialized() else 1
        assert (rngs is not None) == (world == saved_world)
        print(f"OK {what}", flush=True)


def _equal(got: dict, want: dict, what: str) -> None:
    assert got.keys() == want.keys(), (what, sorted(got.keys() ^ want.keys())[:5])
    for key in want:
        a, b = got[key], want[key]
        if isinstance(b, dict):
            _equal(a, b, f"{what}.{key}")
        elif isinstance(b, torch.Tensor):
            assert torch.equal(a.cpu(), b.cpu()), f"{what}.{key} differs"
        else:
            assert a == b, (what, key, a, b)


def check_plan(model, optimizer) -> None:
    """Rank 0's local shards, bytes for bytes, against the memory plan's `shard` layout at this world size."""
    plain = toy_model()
    plan = mp.plan(mp.model_shape(plain), "fp32", "shard", world=dist.get_world_size())
    local = [p.to_local() if isinstance(p, torch.distributed.tensor.DTensor) else p for p in model.parameters()]
    moments = [t.to_local() if isinstance(t, torch.distributed.tensor.DTensor) else t
               for s in optimizer.state.values() for t in s.values() if isinstance(t, torch.Tensor)]  # fmt: skip
    held = (sum(t.nbytes for t in local), sum(t.nbytes for t in moments))
    assert held == (plan.parameters, plan.optimizer), (held, plan.parameters, plan.optimizer)
    print("OK plan", flush=True)


def main() -> None:
    mode, directory = sys.argv[1], Path(sys.argv[2])
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    if mode == "save-sharded":
        model, optimizer, scheduler = build(True, seed=0)
        train(model, optimizer, scheduler)
        if dist.get_rank() == 0:
            check_plan(model, optimizer)
        path = save(directory, "sharded", model, optimizer, scheduler)
        compare(path, directory / "sharded.pt", False, "sharded -> replicated on 2 ranks", 2)
        compare(path, directory / "sharded.pt", True, "sharded -> sharded on 2 ranks", 2)
        weights = checkpoint.snapshot(model)  # the same state again, written in the background while training goes on
        rngs = [checkpoint.rng_state()] * 2
        pending = checkpoint.begin_save(directory / "async", STEPS, lambda d: save_weights(model, d, weights),
                                        checkpoint.sharded_state(model, optimizer, scheduler, rngs),
                                        {"step": STEPS, "loader": {}, "world_size": 2}, main=dist.get_rank() == 0,
                                        asynchronous=True)  # fmt: skip
        train(model, optimizer, scheduler, steps=1)  # the step's own collectives while the save's run on their group
        path = pending.wait()
        dist.barrier()  # renamed complete by rank 0 before any rank reads it
        compare(path, directory / "sharded.pt", False, "asynchronous sharded save -> replicated", 2)
    else:
        name = sys.argv[3]
        compare(directory / name / checkpoint.checkpoint_name(STEPS), directory / f"{name}.pt", True,
                "replicated on 1 rank -> sharded on 2 ranks", 1)  # fmt: skip
    dist.barrier()
    distributed.shutdown()  # collects garbage first (gloo's threads, train.distributed)


if __name__ == "__main__":
    main()
