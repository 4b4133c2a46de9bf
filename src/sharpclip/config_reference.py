"""Every configuration key with its type, default and description, from the schema in `sharpclip.config`.

The descriptions are the comments that `config.py` writes beside each field (or in the comment lines directly above
it, when there is no comment on the line itself); the section texts are the dataclasses' docstrings. Comments are not
kept at run time, so the source is read with `tokenize` (comments by line) and `ast` (each field's lines): keeping
them as comments leaves the schema as readable as before and needs no second copy of any text. A key whose field has
neither is listed by `undocumented()` (a test fails on it).

    python -m sharpclip.config_reference > docs/config.md   # the docs site's Configuration reference
    sharpclip config --explain train.lr                     # one key; a prefix such as `train` lists its keys
"""

from __future__ import annotations

import ast
import difflib
import io
import json
import re
import sys
import tokenize
import typing
from dataclasses import MISSING, dataclass, fields, is_dataclass
from pathlib import Path
from typing import Any

from sharpclip import config
from sharpclip.config import Config, ConfigError

PRAGMAS = ("fmt:", "noqa", "type:")  # tool comments, never descriptions
REGENERATE = "python -m sharpclip.config_reference > docs/config.md"


@dataclass(frozen=True)
class Key:
    """One configuration key: its dotted name (`<name>` for a user-chosen dict key, `[]` for a list item), the
    annotation as written in config.py, the default as YAML shows it, and its description."""

    name: str
    type: str
    default: str
    help: str


@dataclass(frozen=True)
class Section:
    """A dataclass of the schema at a dotted prefix (`model`, `model.adapter`, `loss.terms.<name>`): its docstring and
    its own keys (nested sections are listed separately)."""

    name: str
    doc: str
    keys: tuple[Key, ...]


def _comment_text(text: str) -> str:
    text = text.lstrip("#").strip()
    return "" if text.startswith(PRAGMAS) else text


def field_comments(source: str) -> dict[tuple[str, str], str]:
    """(class name, field name) -> its description in `source`: the comment on the field's lines, else the
    comment lines directly above it (joined); fields without either are absent."""
    trailing: dict[int, str] = {}
    own_line: dict[int, str] = {}
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT:
            row = tok.start[0]
            (own_line if tok.line.strip().startswith("#") else trailing)[row] = _comment_text(tok.string)
    found = {}
    for cls in (node for node in ast.parse(source).body if isinstance(node, ast.ClassDef)):
        for stmt in cls.body:
            if not (isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name)):
                continue
            text = next((trailing[r] for r in range(stmt.lineno, stmt.end_lineno + 1) if trailing.get(r)), "")
            row, above = stmt.lineno - 1, []
            while not text and row in own_line:
                above.insert(0, own_line[row])
                row -= 1
            text = text or " ".join(t for t in above if t)
            if text:
                found[(cls.name, stmt.target.id)] = text
    return found


def _default(f: Any) -> Any:
    if f.default is not MISSING:
        return f.default
    if f.default_factory is not MISSING:
        return f.default_factory()
    return None


def _yaml(value: Any) -> str:
    """A default as a YAML flow value (what `sharpclip config` shows, on one line)."""
    if value is None:
        return "null"
    if isinstance(value, str):
        return json.dumps(value) if value == "" or value != value.strip() else value
    if isinstance(value, bool):
        return str(value).lower()
    return json.dumps(value) if isinstance(value, list | dict) else repr(value)


def _nested(kind: Any) -> tuple[str, type] | None:
    """('', cls) for a dataclass field, ('.<name>', cls) for dict[str, cls], ('[]', cls) for list[cls]; else None."""
    if is_dataclass(kind):
        return "", kind
    origin, args = typing.get_origin(kind), typing.get_args(kind)
    if origin is dict and args and is_dataclass(args[-1]):
        return ".<name>", args[-1]
    if origin is list and args and is_dataclass(args[0]):
        return "[]", args[0]
    return None


def sections(cls: type = Config, prefix: str = "", comments: dict | None = None) -> list[Section]:
    """The schema's sections, depth first in field order, each with its keys (a dict or list of dataclasses is a key
    of its parent and a section of its own, e.g. `loss.terms` and `loss.terms.<name>`)."""
    comments = field_comments(Path(config.__file__).read_text(encoding="utf-8")) if comments is None else comments
    hints = typing.get_type_hints(cls, vars(config))
    keys, below = [], []
    for f in fields(cls):
        name = f"{prefix}.{f.name}" if prefix else f.name
        nested = _nested(hints[f.name])
        if nested is not None:
            below += sections(nested[1], name + nested[0], comments)
        if nested is None or nested[0]:
            keys.append(Key(name, str(f.type), _yaml(_default(f)), comments.get((cls.__name__, f.name), "")))
    doc = " ".join((cls.__doc__ or "").split()) if is_dataclass(cls) and cls.__doc__ else ""
    own = [Section(prefix, doc, tuple(keys))] if prefix else []
    return own + below


def all_keys() -> list[Key]:
    """Every key of the schema, in the order of `sections`."""
    return [k for s in sections() for k in s.keys]


def undocumented() -> list[str]:
    """The keys without a description, and the sections without a docstring (both must be empty)."""
    return [k.name for k in all_keys() if not k.help] + [f"{s.name} (section)" for s in sections() if not s.doc]


def _cell(text: str) -> str:
    """Text safe inside a Markdown table cell: pipes, HTML brackets and emphasis markers escaped."""
    for raw, safe in (("|", "\\|"), ("<", "&lt;"), (">", "&gt;"), ("*", "\\*")):
        text = text.replace(raw, safe)
    return text


def markdown() -> str:
    """The Configuration reference page (docs/config.md), generated: regenerate it with `REGENERATE`."""
    lines = [
        "# Configuration reference",
        "",
        "Every key of a sharpclip config, with its type, its default and what it does. Set a key in a YAML",
        "recipe (`train:` then `lr: 1e-4`) or on the command line as a dotted override (`train.lr=1e-4`);",
        "`sharpclip config RECIPE` prints the resolved values, and `sharpclip config --explain KEY` prints one key's",
        "entry (a prefix such as `train` or `data.augment` lists its keys). `<name>` stands for a name you choose",
        "(a loss term's) and `[]` for an item of a list.",
        "",
        "This page is generated from the schema, `src/sharpclip/config.py`, where each description is the comment",
        f"beside its field: after changing a field, regenerate it with `{REGENERATE}` (a test fails while it is",
        "stale or while a key has no description).",
        "",
        "## Overrides",
        "",
        "`key=value` merges into the earlier layers (a mapping's entries are added to or updated: a warning says so",
        "when entries of the earlier layers stay); `key:=value` replaces the key's whole value (`'loss.terms:={clip:",
        "{loss: infonce}}'`: InfoNCE alone, whatever the recipe's terms); `~key` deletes an entry of a mapping",
        "(`~loss.terms.tok`; a schema setting goes back to its default). Quote overrides that hold braces or `~` in a",
        "shell. [Objectives](objectives.md#swapping-the-objective-on-the-command-line) has examples.",
    ]
    for section in sections():
        depth = "#" * (2 + section.name.count(".") - section.name.count("<name>."))
        lines += ["", f"{depth} `{section.name}`", "", _cell(section.doc), ""]
        lines += ["| key | type | default | what it does |", "|---|---|---|---|"]
        lines += [f"| `{k.name}` | `{k.type}` | `{k.default}` | {_cell(k.help)} |" for k in section.keys]
    return "\n".join(lines) + "\n"


def _generic(query: str, names: set[str]) -> str:
    """`query` with each user-chosen dict key written `<name>`, as the schema lists it (loss.terms.hn.weight ->
    loss.terms.<name>.weight)."""
    done: list[str] = []
    for part in query.split("."):
        known = ".".join([*done, part])
        if not any(n == known or n.startswith((known + ".", known + "[]")) for n in names):
            part = "<name>" if any(n.startswith(".".join([*done, "<name>"])) for n in names) else part
        done.append(part)
    return ".".join(done)


def _matching(query: str, keys: list[Key]) -> list[Key]:
    bare = _generic(re.sub(r"\[\d*\]", "[]", query.rstrip(".")), {k.name for k in keys})
    return [k for k in keys if k.name == bare or k.name.startswith((bare + ".", bare + "[]."))]


def explain(query: str) -> str:
    """The entry of key `query`, or of every key under the prefix `query` (`train`, `data.augment`), as text. Another
    tool's name for a key (`train.learning_rate`, `train.wd`: the aliases the overrides know, config.ALIASES) gives
    that key's entry after a line naming it; an unknown name raises ConfigError with the closest keys."""
    keys = all_keys()
    chosen, heading = _matching(query, keys), ""
    leaf = query.rstrip(".").rsplit(".", 1)[-1].replace("-", "_")
    if not chosen:
        alias = config.ALIASES.get(leaf)
        if alias:
            chosen, heading = _matching(alias, keys), f"{query} is called {alias} here:\n"
    if not chosen:
        close = [config.ALIASES[m] for m in difflib.get_close_matches(leaf, list(config.ALIASES), n=1, cutoff=0.8)]
        close += config.suggest_keys(query.rstrip("."))
        close += difflib.get_close_matches(query, [k.name for k in keys], n=3, cutoff=0.6)
        close = list(dict.fromkeys(close))[:3]
        hint = f"; did you mean {', '.join(close)}?" if close else "; a section such as `train` lists its keys"
        raise ConfigError(f"--explain {query}: no such key{hint}")
    return heading + "\n".join(f"{k.name} ({k.type}, default {k.default}): {k.help}" for k in chosen) + "\n"


if __name__ == "__main__":
    sys.stdout.write(markdown())
