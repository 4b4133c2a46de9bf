"""Every command shown in README.md and docs/ still runs: parsed by the CLI's own parser, its configs and overrides
resolved as `sharpclip config` resolves them (load + validate + the objective against the feature table), without
running the job or building a model.

A fenced ```bash / ```shell block is checked line by line (backslash continuations joined, comments stripped, `;` /
`&&` / `|` separating commands):

- `sharpclip ...`, `python -m sharpclip ...` and torchrun's `-m sharpclip ...`: parsed as `cli.main` parses them; the
  YAML files and `key=value` overrides are loaded and validated. `...` in a command stands for arguments shown
  before it and is dropped.
- `python benchmarks/X.py`: the script exists. Any `configs/X.yaml`: the file exists.

- `torchrun ...` (also after `srun`): its own options parsed by torchrun's parser (torch.distributed.run), so a
  misspelt launcher flag fails too.

A block holding paths the user supplies (`/models/...`, `/data/...`, `recipe.yaml`, `$VARIABLES`) starts with a
`# template: ...` comment: its commands are parsed (argparse and override syntax) but not resolved. An unmarked block
with such a path fails, so a template is never skipped silently. A batch script (`#!` then `#SBATCH` directives, which
must come first) carries the comment right after its directives. Fenced ```yaml blocks must load as configs.
"""

from __future__ import annotations

import re
import shlex
import textwrap
from dataclasses import dataclass
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from sharpclip.cli import build_parser, parse_args
from sharpclip.config import is_deletion, load_config, split_args
from sharpclip.train.features import build_objective
from sharpclip.train.run import check_config

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
SHELL = ("bash", "shell", "sh")
TEMPLATE = "# template:"
ELISION = "..."
SCRIPT_HEADER = ("#!", "#SBATCH")  # a batch script's first lines, before its template comment
USER_PATH = re.compile(r"(^|=)(/|~|\$)|\$|^recipe\.ya?ml$")  # absolute, home or variable paths; a generic recipe
CONFIG_PATH = re.compile(r"(?:^|[=\s])(configs/[\w./-]+\.ya?ml)")
OVERRIDE_KEY = re.compile(r"^[A-Za-z_]\w*(\.[\w-]+)*$")


@dataclass(frozen=True)
class Block:
    """One fenced block: where it starts (page:line), its language and its lines, dedented."""

    where: str
    lang: str
    lines: tuple[str, ...]

    @property
    def template(self) -> bool:
        first = next((line for line in self.lines if line.strip() and not line.startswith(SCRIPT_HEADER)), "")
        return first.strip().startswith(TEMPLATE)


@dataclass(frozen=True)
class Command:
    """One shell command of a block: its words (after shell parsing) and whether its block is a template."""

    where: str
    words: tuple[str, ...]
    template: bool


def blocks(path: Path) -> list[Block]:
    """The fenced blocks of a Markdown page (fences may be indented, as inside a list item)."""
    found, current, lang, start = [], None, "", 0
    for no, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        fence = re.match(r"^\s*```(\w*)\s*$", line)
        if fence and current is None:
            current, lang, start = [], fence.group(1), no
        elif fence:
            text = textwrap.dedent("\n".join(current)).splitlines()
            found.append(Block(f"{path.relative_to(ROOT)}:{start}", lang, tuple(text)))
            current = None
        elif current is not None:
            current.append(line)
    return found


def commands(block: Block) -> list[Command]:
    """The block's commands: continuations joined, comments stripped, split at `;`, `&&`, `||` and `|`."""
    joined, pending = [], ""
    for line in block.lines:
        pending += line
        if line.endswith("\\"):
            pending = pending[:-1] + " "
            continue
        joined.append(pending)
        pending = ""
    out = []
    for line in [*joined, pending]:
        lexer = shlex.shlex(line, posix=True, punctuation_chars=";&|")
        lexer.whitespace_split, lexer.commenters = True, "#"
        words: list[str] = []
        for word in [*lexer, ";"]:
            if word in (";", "&&", "||", "|", "&"):
                if words:
                    out.append(Command(block.where, tuple(words), block.template))
                words = []
            else:
                words.append(word)
    return out


def sharpclip_args(words: tuple[str, ...]) -> list[str] | None:
    """The arguments after `sharpclip` / `python -m sharpclip` / `torchrun ... -m sharpclip`; None if not one."""
    for i, word in enumerate(words):
        if word == "sharpclip" and (i == 0 or words[i - 1] == "-m"):
            return [w for w in words[i + 1 :] if w != ELISION]
    return None


def config_words(args) -> list[str]:
    """The YAML files and overrides a parsed subcommand loads, in its own order."""
    words = list(getattr(args, "config_args", []) or [])
    target = getattr(args, "target", None)  # validate-data: a recipe (its data section) or a data folder
    if target and target.endswith((".yaml", ".yml")):
        words.insert(0, target)
    return words + list(getattr(args, "overrides", []) or [])


def torchrun_parser():
    """torchrun's own argument parser (what `torchrun ARGS` parses its options with), without abbreviations: the docs
    spell every flag out."""
    from torch.distributed.run import get_args_parser

    parser = get_args_parser()
    parser.allow_abbrev = False
    return parser


def check(command: Command) -> None:
    """Fail with the command's page:line when it would not run (see the module docstring)."""
    words, where = command.words, f"{command.where}: {' '.join(command.words)}"
    for path in CONFIG_PATH.findall(" ".join(words)):
        assert (ROOT / path).is_file(), f"{where}: {path} does not exist"
    if words[0].startswith("python") and len(words) > 1 and words[1].startswith("benchmarks/"):
        assert (ROOT / words[1]).is_file(), f"{where}: no such benchmark script"
    if "torchrun" in words:
        launcher = words[words.index("torchrun") + 1 :]
        try:
            torchrun_parser().parse_args([w for w in launcher if w != ELISION])
        except SystemExit:
            pytest.fail(f"{where}: torchrun's parser refuses it")
    args = sharpclip_args(words)
    if args is None:
        return
    if not command.template:
        user = [w for w in args if USER_PATH.search(w) and not is_deletion(w)]
        assert not user, f"{where}: {user} are the user's paths; start the block with `{TEMPLATE} ...`"
    try:
        parsed = parse_args(build_parser(), args)  # exactly as `sharpclip` parses its command line
    except SystemExit:
        pytest.fail(f"{where}: the CLI's parser refuses it")
    files, overrides = split_args(config_words(parsed))
    for item in overrides:
        key, _, value = item.removeprefix("~").partition("=")  # ~key deletes, key:=value replaces
        key = key.removesuffix(":")
        assert OVERRIDE_KEY.match(key), f"{where}: {item!r} is not a dotted key=value, key:=value or ~key override"
        if value or "=" in item:
            OmegaConf.from_dotlist([f"{key}={value}"])
    if not command.template:
        check_config(load_config(files, overrides))  # what `sharpclip config` checks; ConfigError names the key


ALL_BLOCKS = [b for page in PAGES for b in blocks(page)]
ALL_COMMANDS = [c for b in ALL_BLOCKS if b.lang in SHELL for c in commands(b)]
SHARPCLIP = [c for c in ALL_COMMANDS if sharpclip_args(c.words) is not None]


def test_the_docs_show_commands_and_both_kinds_of_block() -> None:
    assert len(SHARPCLIP) >= 30, [c.where for c in SHARPCLIP]
    assert {c.template for c in SHARPCLIP} == {True, False}
    assert any(c.where.startswith("README.md") for c in SHARPCLIP)


@pytest.mark.parametrize("command", ALL_COMMANDS, ids=lambda c: f"{c.where} {' '.join(c.words)[:60]}")
def test_every_shell_command_in_the_docs_parses_and_resolves(command: Command) -> None:
    check(command)


@pytest.mark.parametrize("block", [b for b in ALL_BLOCKS if b.lang == "yaml"], ids=lambda b: b.where)
def test_every_yaml_block_in_the_docs_is_a_valid_config(block: Block, tmp_path: Path) -> None:
    path = tmp_path / "block.yaml"
    path.write_text("\n".join(block.lines) + "\n", encoding="utf-8")
    build_objective(load_config(path).loss)


def _one(line: str, template: bool = False) -> Command:
    return commands(Block("page.md:1", "bash", ((f"{TEMPLATE} yours",) if template else ()) + (line,)))[0]


@pytest.mark.parametrize(
    "line",
    [
        "sharpclip train configs/tiny_synthdense.yaml train.lrr=1e-4",  # unknown key
        "sharpclip train configs/no_such_recipe.yaml",  # missing config file
        "sharpclip trian configs/tiny_synthdense.yaml",  # unknown subcommand
        "sharpclip train configs/tiny_synthdense.yaml model.name=/models/clip",  # a user path, unmarked
        "sharpclip train configs/tiny_synthdense.yaml loss.terms.x.loss=no_such_loss",  # the objective is built
        "python benchmarks/no_such_script.py",
        "srun torchrun --nproc-per-nod 8 -m sharpclip train configs/tiny_synthdense.yaml",  # a cut launcher flag
        "torchrun --nprocs 8 -m sharpclip train configs/tiny_synthdense.yaml",  # not a torchrun flag
    ],
)
def test_the_check_fails_a_wrong_command(line: str) -> None:
    with pytest.raises((AssertionError, ValueError, pytest.fail.Exception)):
        check(_one(line))


def test_a_template_is_parsed_but_not_resolved() -> None:
    check(_one("sharpclip train recipe.yaml model.name=/models/clip train.lr=1e-4", template=True))
    with pytest.raises(pytest.fail.Exception):
        check(_one("sharpclip export /models/x", template=True))  # --to is required: still parsed
    with pytest.raises(AssertionError):
        check(_one("sharpclip train recipe.yaml =/models/clip", template=True))  # not a dotted override


def test_continuations_comments_elisions_and_torchrun_are_read_as_the_shell_does() -> None:
    block = Block("page.md:1", "bash", ("torchrun --nproc_per_node 2 -m sharpclip train \\", "  a.yaml ...  # note"))
    (command,) = commands(block)
    assert sharpclip_args(command.words) == ["train", "a.yaml"]
    assert [c.words[0] for c in commands(Block("p:1", "bash", ("D=runs; sharpclip demo && echo ok",)))] == [
        "D=runs",
        "sharpclip",
        "echo",
    ]


SLURM_SCRIPTS = sorted((ROOT / "examples" / "slurm").glob("*.sbatch"))


def _script(name: str) -> Block:
    (script,) = [b for b in blocks(ROOT / "docs" / "gpus.md") if b.lines and name in "\n".join(b.lines[:12])
                 and b.lines[0].startswith("#!")]  # fmt: skip
    return script


def test_each_cluster_script_is_shown_whole_on_the_gpu_page() -> None:
    """examples/slurm/*.sbatch are the scripts docs/gpus.md shows, line for line, so the checks of the page's
    commands (torchrun's options, sharpclip's words) are checks of the files."""
    shown = {"\n".join(b.lines) for b in blocks(ROOT / "docs" / "gpus.md") if b.lines and b.lines[0].startswith("#!")}
    assert [p.name for p in SLURM_SCRIPTS] == ["sweep.sbatch", "train.sbatch", "train_torchrun.sbatch"]
    for path in SLURM_SCRIPTS:
        assert path.read_text(encoding="utf-8").rstrip("\n") in shown, f"{path.name} differs from docs/gpus.md"


def _requeue_safe(script: Block) -> Command:
    """The directives and the one srun line of a requeue-safe script: signal before the time limit, requeue, the
    task's CPUs passed to srun, --resume auto; returns the srun command."""
    directives = {line.split()[1] for line in script.lines if line.startswith("#SBATCH")}
    assert {"--requeue", "--open-mode=append"} <= directives
    assert any(d.startswith("--signal=B:USR1@") for d in directives)
    assert script.template
    (launch,) = [c for c in commands(script) if c.words[0] == "srun"]
    assert launch in ALL_COMMANDS
    assert "--cpus-per-task=$SLURM_CPUS_PER_TASK" in launch.words
    assert sharpclip_args(launch.words)[0] == "train" and launch.words[-2:] == ("--resume", "auto")
    assert "scontrol requeue" in "\n".join(script.lines)
    check(launch)
    return launch


def test_the_gpu_page_holds_a_checked_one_task_per_gpu_script_without_torchrun() -> None:
    script = _script("train.sbatch RECIPE")
    directives = {line.split()[1] for line in script.lines if line.startswith("#SBATCH")}
    assert {"--nodes=1", "--ntasks-per-node=8", "--gpus-per-node=8"} <= directives
    launch = _requeue_safe(script)
    assert "torchrun" not in launch.words and launch.words[launch.words.index("-m") - 1] == "python"


def test_the_gpu_page_holds_a_checked_torchrun_script_with_its_ranks_from_the_allocation() -> None:
    """One task per node: torchrun inside srun with a c10d rendezvous, its options parsed by torchrun's parser."""
    script = _script("train_torchrun.sbatch")
    directives = {line.split()[1] for line in script.lines if line.startswith("#SBATCH")}
    assert {"--nodes=1", "--ntasks-per-node=1", "--gpus-per-node=8"} <= directives
    launch = _requeue_safe(script)
    launcher = torchrun_parser().parse_args(list(launch.words[launch.words.index("torchrun") + 1 :]))
    assert (launcher.nproc_per_node, launcher.rdzv_backend, launcher.module) == ("$GPUS", "c10d", True)
    assert launcher.rdzv_endpoint == "$HEAD:$PORT"  # a port from the job id: two jobs on a node never share one
    # the pinned torchrun takes --signals-to-handle's default from PET_SIGNALS_TO_HANDLE and overwrites the older name
    assert "PET_SIGNALS_TO_HANDLE=SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1" in "\n".join(script.lines)
    assert any(a.option_strings[:1] == ["--signals-to-handle"] for a in torchrun_parser()._actions)


def test_a_batch_script_is_a_template_only_with_the_comment_after_its_directives() -> None:
    lines = ("#!/bin/bash", "#SBATCH --nodes=1", "# template: yours", "srun torchrun -m sharpclip train recipe.yaml")
    assert Block("p:1", "bash", lines).template
    assert not Block("p:1", "bash", (lines[0], lines[1], lines[3])).template
