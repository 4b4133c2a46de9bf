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


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="sharpclip",
        description="Fine-tune CLIP-style image-text models to tell near-duplicate images and captions apart.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for add in (_add_config, _add_objectives):
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
