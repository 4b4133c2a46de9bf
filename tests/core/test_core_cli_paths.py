"""Every path flag and path argument of every subcommand expands `~` (matrix 5 N6: `--index=~/idx` and `--html=~/p`
made a folder named `~`): the parser of each command is walked, so a new path flag without `type=path_arg` fails."""

from __future__ import annotations

import argparse
import os

import pytest

from sharpclip.cli import build_parser, parse_args, path_arg, positive_int

# string-valued options that are not paths (a name, a metric, a caption, a list of suites, ...)
NOT_PATHS = {
    ("config", "explain"), ("demo", "arms"), ("demo", "sizes"), ("demo", "task"), ("blend", "sweep"),
    ("blend", "target"), ("blend", "guard"), ("validate-data", "overrides"), ("validate-data", "format"),
    ("validate-data", "split"), ("eval", "suite"), ("eval-table", "label"), ("analyze dynamics", "metric"),
    ("analyze sample-efficiency", "metric"), ("analyze geometry", "suite"), ("analyze near-duplicates", "suite"),
    ("analyze feature-map", "text"), ("search", "suite"), ("search", "text"), ("compare", "suite"),
    ("config", "gpu_memory"), ("export", "license"), ("export", "base_model"), ("export", "dataset"),  # Hub ids
}  # fmt: skip
# the least each command needs to parse (a path under test replaces its own word)
MINIMAL = {
    "export": ["SRC", "--to", "DIR"], "blend": ["INIT", "FT", "--to", "DIR", "--alpha", "0.5"],
    "distill": ["--captions", "C", "--to", "DIR"], "validate-data": ["TARGET"], "search": ["--model", "M"],
    "compare": ["--model", "M"], "eval-table": ["REPORT"], "analyze dynamics": ["RUN"],
    "analyze sample-efficiency": ["RUN"], "analyze feature-map": ["IMAGE", "--text", "t", "--model", "M"],
}  # fmt: skip


def _commands(parser: argparse.ArgumentParser | None = None, prefix: str = "") -> dict[str, argparse.ArgumentParser]:
    """Every (sub)command's parser by its words ("eval", "analyze geometry"), nested subcommands walked too."""
    found = {}
    for action in (parser or build_parser())._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                if sub in found.values():  # an alias (analyze convergence = dynamics)
                    continue
                found[prefix + name] = sub
                found.update(_commands(sub, f"{prefix}{name} "))
    return found


def _takes_a_word(action: argparse.Action) -> bool:
    return action.nargs != 0 and not action.choices and action.dest not in ("help", "config_args", "debug")


def _path_actions() -> list[tuple[str, argparse.Action]]:
    found = []
    for command, parser in _commands().items():
        for action in parser._actions:
            if not _takes_a_word(action) or action.type in (int, float, positive_int):
                continue
            if (command, action.dest) in NOT_PATHS:
                assert action.type is not path_arg, (command, action.dest)
                continue
            found.append((command, action))
    return found


def test_every_word_taking_option_is_either_a_path_arg_or_named_as_not_a_path():
    untyped = [(c, a.dest) for c, a in _path_actions() if a.type is not path_arg]
    assert not untyped, f"give these type=path_arg (or list them in NOT_PATHS): {untyped}"


@pytest.mark.parametrize("command, action", _path_actions(), ids=lambda x: getattr(x, "dest", x))
def test_every_path_flag_of_every_command_expands_a_tilde(command: str, action: argparse.Action, tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    argv = [*command.split(), *MINIMAL.get(command, [])]
    if action.option_strings:
        argv.append(f"{action.option_strings[-1]}=~/x")  # the form a shell leaves alone
    else:  # a positional: its word in MINIMAL (positionals come first there), or appended
        dests = [a.dest for a in _commands()[command]._actions if not a.option_strings and _takes_a_word(a)]
        where = len(command.split()) + dests.index(action.dest)
        if command in MINIMAL:
            argv[where] = "~/x"
        else:
            argv.append("~/x")
    got = getattr(parse_args(build_parser(), argv), action.dest)
    want = os.path.join(str(tmp_path), "x")
    assert got == want or (isinstance(got, list) and want in got), (argv, got)
