"""Train with open_clip's own training entry point, open_clip_train, with HN-CLIP's loss in place of its CLIP loss.

Nothing of open_clip_train changes but where its loss comes from: this script swaps the loss factory, then calls
open_clip_train's `main` with every other argument untouched. ClipLoss becomes `HNClipLoss` (open_clip's
--local-loss, --gather-with-grad, rank and world size carried over), SigLipLoss (--siglip) becomes
`SigLipMarginLoss` (--loss-dist-impl carried over); --hn-gamma sets the margin's γ (0.5, HN-CLIP's default).

    python examples/open_clip_train_hn.py --hn-gamma 0.5 --model ViT-B-32 --pretrained openai \\
        --train-data 'pairs/{00000..00099}.tar' --dataset-type webdataset --batch-size 128 --epochs 5 --lr 1e-5
    torchrun --nproc_per_node 8 examples/open_clip_train_hn.py --local-loss --gather-with-grad ...

open_clip is not a dependency of sharpclip: install it (`pip install 'open_clip_torch[training]'`) where you run
this; without it the script stops with one line saying so. pip resolves open_clip's own torch and torchvision
requirements and may replace the torch you installed (a CPU wheel, say): install torch and torchvision from the same
index first, and check `pip install --dry-run` before. Its
open_clip_train 3.x builds the loss with `create_loss(args)` in its main module; the later task-based trainer
builds `open_clip.loss.ClipLoss` / `SigLipLoss` when it makes its task. Both are swapped, whichever exists.
"""

from __future__ import annotations

import argparse
import functools
import importlib
import sys

from torch import nn

from sharpclip.losses.drop_in import HNClipLoss, SigLipMarginLoss


def hn_create_loss(args: argparse.Namespace, gamma: float) -> nn.Module:
    """open_clip's `create_loss(args)` with HN-CLIP's margin: the same settings, read off open_clip_train's args."""
    if getattr(args, "distill", False) or "coca" in args.model.lower():
        raise ValueError(
            "HN-CLIP's margin replaces the CLIP or SigLIP loss; --distill and CoCa models keep open_clip's"
        )
    if getattr(args, "siglip", False):
        return SigLipMarginLoss(
            cache_labels=True,
            rank=args.rank,
            world_size=args.world_size,
            dist_impl=getattr(args, "loss_dist_impl", None),
            gamma=gamma,
        )
    return HNClipLoss(
        local_loss=args.local_loss,
        gather_with_grad=args.gather_with_grad,
        cache_labels=True,
        rank=args.rank,
        world_size=args.world_size,
        use_horovod=getattr(args, "horovod", False),
        gamma=gamma,
    )


def install(gamma: float):
    """Swap open_clip_train's loss factory for HN-CLIP's; returns open_clip_train's main module."""
    entry = importlib.import_module("open_clip_train.main")
    if hasattr(entry, "create_loss"):  # open_clip_train 3.x: main() calls create_loss(args)
        entry.create_loss = functools.partial(hn_create_loss, gamma=gamma)
    else:  # the task-based trainer: its tasks construct these classes when they are made
        losses = importlib.import_module("open_clip.loss")
        losses.ClipLoss = functools.partial(HNClipLoss, gamma=gamma)
        losses.SigLipLoss = functools.partial(SigLipMarginLoss, gamma=gamma)
    return entry


MISSING = (
    "open_clip_train_hn.py: open_clip's training package is not installed ({name}): pip install "
    "'open_clip_torch[training]' (it brings its own torch and torchvision builds; see docs/own-code.md)"
)


def main(argv: list[str] | None = None) -> None:
    ours = argparse.ArgumentParser(add_help=False)
    ours.add_argument("--hn-gamma", type=float, default=0.5, help="γ of HN-CLIP's margin (0: open_clip's loss)")
    args, rest = ours.parse_known_args(sys.argv[1:] if argv is None else argv)
    try:
        entry = install(args.hn_gamma)
    except ModuleNotFoundError as err:  # open_clip (or what it imports first) missing: one line, not a traceback
        if (err.name or "").split(".")[0] not in ("open_clip_train", "open_clip", "torchvision", "timm"):
            raise
        raise SystemExit(MISSING.format(name=f"no module named {err.name!r}")) from None
    entry.main(rest)


if __name__ == "__main__":
    main()
