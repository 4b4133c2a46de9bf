"""The `sharpclip` command: one subcommand per job, each a thin call into the library (no logic of its own).

Each subcommand is added by one `_add_<name>` function; its handler imports what it needs lazily so that
`sharpclip --help` stays fast.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence


def _add_config(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("config", help="print the resolved, validated config (YAML + dotted overrides)")
    p.add_argument("config", nargs="?", help="YAML recipe (defaults when omitted)")
    p.add_argument("overrides", nargs="*", help="dotted overrides, e.g. train.lr=1e-4")

    def run(args: argparse.Namespace) -> int:
        from sharpclip.config import load_config, to_yaml

        print(to_yaml(load_config(args.config, args.overrides)), end="")
        return 0

    p.set_defaults(handler=run)


def _add_objectives(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("objectives", help="list the registered loss terms, their inputs and hyperparameters")

    def run(args: argparse.Namespace) -> int:
        from sharpclip.losses import registry

        for spec in registry.specs():
            params = ", ".join(f"{k}={v!r}" for k, v in spec.params.items()) or "-"
            inputs = ", ".join(spec.inputs + tuple(f"[{k}]" for k in spec.optional_inputs))
            print(f"{spec.name:16s} inputs: {inputs}\n{'':16s} params: {params}\n{'':16s} {spec.summary}")
        return 0

    p.set_defaults(handler=run)


def _add_export(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("export", help="write a transformers folder (AutoModel-loadable) and check it reloads exactly")
    p.add_argument("source", metavar="RUN_OR_CHECKPOINT", help="run directory, sharpclip checkpoint or HF folder")
    p.add_argument("--to", required=True, metavar="DIR", help="output folder")
    p.add_argument("--vision-only", action="store_true", help="export the vision tower alone (CLIPVisionModel)")

    def run(args: argparse.Namespace) -> int:
        from sharpclip.models.export import ExportError, export_model

        try:
            print(export_model(args.source, args.to, vision_only=args.vision_only))
        except ExportError as err:
            print(f"sharpclip export: {err}", file=sys.stderr)
            return 1
        return 0

    p.set_defaults(handler=run)


def _add_distill(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("distill", help="distil the text tower into a RoPE text tower (CLIP-IN eq. 7 / TULIP)")
    p.add_argument("config", nargs="?", help="YAML recipe; its `model` section names the teacher")
    p.add_argument("overrides", nargs="*", help="dotted overrides, e.g. model.name=/models/clip-vit-large-patch14")
    p.add_argument("--captions", required=True, metavar="FILE", help="text file, one (long) caption per line")
    p.add_argument("--to", required=True, metavar="DIR", help="where to write the student's sharpclip checkpoint")
    p.add_argument("--steps", type=int, default=1000)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--lr", type=float, default=5e-4)

    def run(args: argparse.Namespace) -> int:
        from sharpclip.config import load_config
        from sharpclip.models.distill import DistillSettings, run_distill

        path, overrides = args.config, list(args.overrides)
        if path is not None and "=" in path:  # no YAML given: the first positional is already an override
            path, overrides = None, [path, *overrides]
        cfg = load_config(path, overrides)
        settings = DistillSettings(steps=args.steps, batch_size=args.batch_size, lr=args.lr, seed=cfg.train.seed)
        report = run_distill(cfg.model, args.captions, args.to, settings, log=print)
        print(report)
        return 0

    p.set_defaults(handler=run)


def _add_validate_data(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("validate-data", help="check a dataset: counts, bad samples, duplicates, token lengths")
    p.add_argument("target", metavar="CONFIG_OR_PATH", help="a YAML recipe (its data section) or a data folder/file")
    p.add_argument("overrides", nargs="*", help="dotted overrides for a recipe, e.g. data.root=/data/docci")
    p.add_argument("--format", help="the data format (default: the recipe's, or detected from the folder)")
    p.add_argument("--split", help="the split to check (default: the train split; test for test-only formats)")
    p.add_argument("--tokenizer", help="a local HF tokenizer folder for exact token counts")
    p.add_argument("--json", metavar="FILE", help="write the JSON report here instead of printing it")

    def run(args: argparse.Namespace) -> int:
        import json

        from sharpclip.data import validate as v

        try:
            cfg = v.config_for(args.target, args.overrides, args.format)
            counter, name = v.tokenizer_counter(cfg, args.tokenizer)
            report = v.validate(cfg, args.split or v.default_split(cfg), counter, name)
        except (OSError, ValueError) as err:  # no such folder, unknown split, unreadable annotation file
            print(f"sharpclip validate-data: {err}", file=sys.stderr)
            return 2
        print(report.summary())
        text = json.dumps(report.to_json(), indent=2)
        if args.json:
            with open(args.json, "w", encoding="utf-8") as f:
                f.write(text + "\n")
        else:
            print(text)
        return 0 if report.ok else 1

    p.set_defaults(handler=run)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="sharpclip",
        description="Fine-tune CLIP-style image-text models to tell near-duplicate images and captions apart.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for add in (_add_config, _add_objectives, _add_export, _add_distill, _add_validate_data):
        add(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if getattr(args, "handler", None) is None:
        parser.print_help()
        return 2
    from sharpclip.config import ConfigError

    try:
        return args.handler(args)
    except ConfigError as err:
        print(f"sharpclip: config error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
