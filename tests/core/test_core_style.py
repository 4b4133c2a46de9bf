"""The code base stays ruff-clean (lint and format) and layered (imports point down), as the house style asks."""

from __future__ import annotations

import ast
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("args", [["check"], ["format", "--check"]])
def test_ruff_clean(args):
    ruff = shutil.which("ruff")
    assert ruff, "ruff is a [dev] dependency: pip install -e '.[dev]'"
    proc = subprocess.run(
        [ruff, *args, "src", "tests", "benchmarks", "examples"], cwd=ROOT, capture_output=True, text=True
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-1000:]


def test_public_functions_of_data_eval_models_have_docstrings():
    ruff = shutil.which("ruff")
    assert ruff, "ruff is a [dev] dependency: pip install -e '.[dev]'"
    packages = [f"src/sharpclip/{p}" for p in ("data", "eval", "models")]
    args = ["check", "--isolated", "--select", "D102,D103", *packages]
    proc = subprocess.run([ruff, *args], cwd=ROOT, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-1000:]


# -- imports point down ---------------------------------------------------------------------------------------------
# The layers of src/sharpclip, lowest first (DESIGN.md, "What flows through it"): a module may import its own part
# and any part of a lower layer, never a part of its own layer or above. Parts in one layer are independent.
LAYERS = (
    ("config",),  # typed settings, read by everything
    ("config_reference",),  # every key's description, from config.py's comments (docs/config.md, config --explain)
    ("devices", "collectives", "owned_files", "progress"),  # the machine: devices, precision, worker counts;
    # collectives across processes; which output files sharpclip may replace (the files it wrote); progress bars on
    # a terminal
    ("data",),  # samples, preprocessing operations, batches
    ("models", "losses"),  # dual encoders (and what they decide about their inputs); pure loss math
    ("eval",),  # embedders, metrics, benchmarks, reports
    ("train",),  # the loop, steps, checkpoints of a run (validation through eval)
    ("analysis",),  # figures and statistics of finished runs and checkpoints
    ("demo",),  # the embedded SynthDense experiment
    ("sweep", "model_card"),  # a study's tasks (a sweep file); an export's card (the run, its reports, their labels)
    ("cli",),  # the command line
    ("__main__",),  # python -m sharpclip
)
LAYER = {part: i for i, parts in enumerate(LAYERS) for part in parts}
SRC = ROOT / "src"
PACKAGE = SRC / "sharpclip"
LAZY_OK = {"cli"}  # `sharpclip --help` stays fast: every subcommand imports its stack when it runs


def _module_name(path: Path) -> str:
    parts = path.relative_to(SRC).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _is_module(dotted: str) -> bool:
    base = SRC.joinpath(*dotted.split("."))
    return base.with_suffix(".py").is_file() or (base / "__init__.py").is_file()


def _imports(path: Path) -> list[tuple[int, str, bool]]:
    """(line, imported sharpclip module, inside a function?) for every import of `path`, at any depth."""
    module = _module_name(path)
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found: list[tuple[int, str, bool]] = []

    def visit(node: ast.AST, in_function: bool) -> None:
        for child in ast.iter_child_nodes(node):
            nested = in_function or isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda)
            if isinstance(child, ast.Import):
                found.extend((child.lineno, a.name, in_function) for a in child.names)
            elif isinstance(child, ast.ImportFrom):
                base = child.module or ""
                if child.level:
                    anchor = package.split(".")[: len(package.split(".")) - child.level + 1]
                    base = ".".join([*anchor, *([child.module] if child.module else [])])
                names = [f"{base}.{a.name}" for a in child.names if _is_module(f"{base}.{a.name}")]
                found.extend((child.lineno, name, in_function) for name in names or [base])
            visit(child, nested)

    visit(ast.parse(path.read_text(encoding="utf-8")), False)
    return [(line, name, fn) for line, name, fn in found if name.split(".")[0] == "sharpclip"]


def _part(dotted: str) -> str | None:
    parts = dotted.split(".")
    return parts[1] if len(parts) > 1 else None  # None: the package root (sharpclip.__version__)


def test_every_part_of_the_package_has_a_layer():
    parts = {p.stem if p.is_file() else p.name for p in PACKAGE.iterdir() if p.suffix == ".py" or p.is_dir()}
    parts -= {"__init__", "__pycache__"}
    assert parts == set(LAYER), f"give these a layer in LAYERS (or drop the stale ones): {parts ^ set(LAYER)}"


def test_imports_point_down_even_inside_functions():
    wrong = []
    for path in sorted(PACKAGE.rglob("*.py")):
        here = _part(_module_name(path))
        for line, name, _ in _imports(path):
            there = _part(name)
            if here is None or there is None or there == here:
                continue
            if LAYER[there] >= LAYER[here]:
                wrong.append(f"{path.relative_to(ROOT)}:{line}: {here} (layer {LAYER[here]}) imports {name} "
                             f"(layer {LAYER[there]})")  # fmt: skip
    assert not wrong, "imports that point up or sideways:\n" + "\n".join(wrong)


def test_sharpclip_modules_are_imported_at_the_top_or_say_why_not():
    """A function-level import must not hide the layering: only cli.py imports lazily by design; anywhere else a
    lazy import of a sharpclip module carries a comment on its line saying why (e.g. code that loads only when used)."""
    lines_of: dict[Path, list[str]] = {}
    hidden = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if _part(_module_name(path)) in LAZY_OK:
            continue
        for line, name, in_function in _imports(path):
            text = lines_of.setdefault(path, path.read_text(encoding="utf-8").splitlines())[line - 1]
            if in_function and "#" not in text:
                hidden.append(f"{path.relative_to(ROOT)}:{line}: {name}")
    assert not hidden, "move these imports to the top of the module (or comment why they are lazy):\n" + "\n".join(
        hidden
    )


def _import_graph() -> dict[str, set[str]]:
    """Module -> the sharpclip modules it imports (at any depth, type-checking imports included)."""
    graph: dict[str, set[str]] = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        module = _module_name(path)
        graph[module] = {name for _, name, _ in _imports(path) if _is_module(name) and name != module}
    return graph


def test_no_module_imports_one_that_imports_it_back():
    """Each module reads on its own: no import cycle, even one hidden in a function or behind TYPE_CHECKING."""
    graph, cycles = _import_graph(), []

    def visit(module: str, trail: list[str]) -> None:
        for nxt in sorted(graph.get(module, ())):
            if nxt in trail:
                cycles.append(" -> ".join([*trail[trail.index(nxt) :], nxt]))
            elif nxt not in done:
                visit(nxt, [*trail, nxt])
        done.add(module)

    done: set[str] = set()
    for module in sorted(graph):
        if module not in done:
            visit(module, [module])
    assert not cycles, "import cycles:\n" + "\n".join(sorted(set(cycles)))
