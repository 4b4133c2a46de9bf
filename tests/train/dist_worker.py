"""Worker of the multi-process tests, launched by torchrun: every case of `_support.tiny_dual.CASES` on this rank's
rows of one global batch, through the real training step; rank 0 writes every rank's loss terms, monitor and
objective calls (JSON) and the gradients averaged over ranks (safetensors).

python dist_worker.py OUT_DIR BACKEND      (gloo on the CPU, nccl on one GPU per rank)
"""

import json
import os
import sys
from datetime import timedelta
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch
import torch.distributed as dist
from safetensors.torch import save_file

from _support.tiny_dual import CASES, LAYOUT_CASES, parallel_context, rows_for, run_case, run_diagnostics, tiny_batch
from sharpclip.train import distributed


def main(out: Path, backend: str) -> None:
    device = "cpu"
    if backend == "nccl":
        device = f"cuda:{int(os.environ['LOCAL_RANK'])}"
        torch.cuda.set_device(device)
    dist.init_process_group(backend, timeout=timedelta(seconds=60))  # a regression fails instead of hanging
    rank, world = distributed.rank(), distributed.world_size()
    records, tensors = {}, {}
    runs = [(name, mode, "replicate") for name, mode in CASES]
    runs += [(name, mode, layout) for layout in ("shard", "hybrid") for name, mode in LAYOUT_CASES]
    for name, mode, layout in runs:
        rows = rows_for(mode, world)[rank]
        batch = tiny_batch(rows, edits=mode != "per_micro_batch")
        ctx = parallel_context(layout, local_world=2)  # hybrid: nodes of 2 processes
        result, grads, calls = run_case(name, mode, batch, device, ctx)
        key = f"{name}/{mode}" if layout == "replicate" else f"{layout}:{name}/{mode}"
        records[key] = {"terms": result.terms, "monitor": result.monitor, "rows": result.rows,
                        "calls": distributed.all_ranks_lists([calls])}  # fmt: skip
        tensors.update({f"{key}/{p}": g.contiguous() for p, g in grads.items()})
    for accumulation in ("exact", "per_micro_batch"):
        batch = tiny_batch(rows_for(accumulation, world)[rank], edits=False)
        records[f"diagnostics/{accumulation}"] = run_diagnostics(accumulation, batch, device)
    if rank == 0:
        save_file(tensors, out / "grads.safetensors")
        (out / "records.json").write_text(json.dumps(records))
    distributed.shutdown()  # collects garbage first (gloo's threads, train.distributed)


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2])
