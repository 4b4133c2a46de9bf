"""`sharpclip <command> ...` in this process, recording the sample ids of every batch each rank trains on.

python rank_worker.py IDS_DIR train key=value ...     (also under torchrun; IDS_DIR/rank<R>.jsonl, one line a step)
python rank_worker.py OUT_DIR check-dir               (under torchrun: each rank checks its own OUT_DIR/rank<R>)

The ids are appended as each step starts, so a run killed mid-epoch and resumed leaves the ids of every step it
trained, the replayed ones included (tests cut the file back to the checkpoint's step).
"""

import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

from sharpclip.cli import main
from sharpclip.train import distributed
from sharpclip.train.run import check_shared_dir
from sharpclip.train.run_dir import RunDirError
from sharpclip.train.trainer import Trainer


def record_ids(directory: Path) -> None:
    step = Trainer._train_step

    def recorded(self, batch, *args):
        with open(directory / f"rank{os.environ.get('RANK', '0')}.jsonl", "a", encoding="utf-8") as f:
            f.write(json.dumps({"step": self.state.step + 1, "epoch": self.state.epoch, "ids": batch.ids}) + "\n")
        return step(self, batch, *args)

    Trainer._train_step = recorded


def check_dirs(out: Path) -> None:
    """Each rank checks a directory of its own, as ranks on nodes without a shared file system would."""
    distributed.init_from_env(torch.device("cpu"), 0.5)
    mine = out / f"rank{distributed.rank()}"
    mine.mkdir(parents=True, exist_ok=True)
    try:
        check_shared_dir(mine)
        message = "accepted"
    except RunDirError as err:
        message = str(err)
    (out / f"rank{distributed.rank()}.txt").write_text(message)
    distributed.shutdown()


if __name__ == "__main__":
    target = Path(sys.argv[1])
    target.mkdir(parents=True, exist_ok=True)
    if sys.argv[2] == "check-dir":
        check_dirs(target)
        raise SystemExit(0)
    record_ids(target)
    raise SystemExit(main(sys.argv[2:]))
