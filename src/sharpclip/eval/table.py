"""One table across models (CLIP_benchmark's `eval` over several models, then `build`): a row per model, each
suite's headline figures as columns, and a second table with every per-subset figure, a column per model.

    reports = [("hn", read_report("runs/hn/eval/step-000120")), ("infonce", read_report(...))]
    write_tables(reports, "tables/")   # eval_table.csv / .md (headlines), eval_table_detail.csv / .md

Headline figures (`headline`): a retrieval suite gives `T→I R@1`, `I→T R@1` and their mean (`mean R@1`, the
best-checkpoint key); every other suite its top-level numbers, e.g. SPEC's `i2t_mean`, `t2i_mean`, `mean`,
Winoground's `text`, `image`, `group`, zero-shot's `top1`, `top5`, MMVP's `mean`. Counts (items, images, skipped) are
left out. The detail (`detail`) is every number one level down: a retrieval suite's R@K, mean and median rank each
way, SPEC's 12 per-subset accuracies, MMVP's per-pattern ones. A model without a suite leaves its cells empty.

A study's tables (given each report's run settings, analysis.study_table): `eval_long.csv`, a row per (run, suite,
metric) with the run's settings as columns (CLIP_benchmark's `build` shape; `pandas.read_csv(...).pivot_table(
index=["objective", "fraction"], columns="metric", values="value")` is one line), and `eval_grouped.csv` / `.md`, the
headline figures of the runs that differ in their seed alone (one recipe_sha256) as mean ± sample std and n.
"""

from __future__ import annotations

import csv
import io
import json
import statistics
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from sharpclip import owned_files

REPORT = "eval_report.json"  # eval.report's JSON, one per model and checkpoint
TABLE_FILES = ("eval_table.csv", "eval_table.md", "eval_table_detail.csv", "eval_table_detail.md", "eval_long.csv",
               "eval_grouped.csv", "eval_grouped.md")  # fmt: skip
Reports = Sequence[tuple[str, dict[str, dict[str, Any]]]]  # (row label, eval_report.json's {suite: metrics})
Settings = Sequence[dict[str, Any]]  # each report's run settings (analysis.study_table.report_settings), in order
GROUP_BY = ("objective", "fraction", "train_count", "model", "data", "recipe_sha256")  # every setting but the seed


def _number(value: Any) -> bool:
    return isinstance(value, float) and not isinstance(value, bool)


def headline(suite: str, metrics: dict[str, Any]) -> dict[str, float]:
    """{column: value} of one suite's headline figures (module docstring)."""
    if metrics.get("task") == "retrieval":
        t2i, i2t = metrics["t2i"]["R@1"], metrics["i2t"]["R@1"]
        return {f"{suite} T→I R@1": t2i, f"{suite} I→T R@1": i2t, f"{suite} mean R@1": (t2i + i2t) / 2}
    return {f"{suite} {key}": value for key, value in metrics.items() if _number(value)}


def detail(suite: str, metrics: dict[str, Any]) -> dict[str, float]:
    """{'suite key: sub': value} of every number one level down (per subset, per direction, per pattern)."""
    return {f"{suite} {key}: {sub}": v for key, value in metrics.items() if isinstance(value, dict)
            for sub, v in value.items() if _number(v)}  # fmt: skip


def report_file(source: str | Path) -> Path:
    """The eval_report.json that `source` names: itself, the one in a folder, or a run directory's newest evaluated
    checkpoint's (RUN/eval/step-N/); a folder with none is a one-line ValueError."""
    path = Path(source).expanduser()
    if path.is_dir() and not (path / REPORT).is_file():
        found = sorted((path / "eval").glob(f"*/{REPORT}")) if (path / "eval").is_dir() else []
        if not found:
            raise ValueError(f"{source}: no {REPORT} here nor in {path / 'eval'}/*/ (run `sharpclip eval` first)")
        return found[-1]
    return path / REPORT if path.is_dir() else path


def read_report(source: str | Path) -> dict[str, dict[str, Any]]:
    """The {suite: metrics} of a finished eval: an eval_report.json, a folder holding one, or a run directory (the
    report of its newest evaluated checkpoint, RUN/eval/step-N/); anything else is a one-line ValueError."""
    path = report_file(source)
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as err:
        raise ValueError(f"{path}: not a readable eval report ({err})") from None
    if not isinstance(data, dict) or not all(isinstance(v, dict) for v in data.values()):
        raise ValueError(f"{path}: not an eval report ({{suite: metrics}} as `sharpclip eval` writes)")
    return data


def short_labels(names: Sequence[str]) -> list[str]:
    """Row labels: each name's last path part (`runs/x/hn` → `hn`) when those differ, else the names as given."""
    short = [Path(n).name or n for n in names]
    return short if len(set(short)) == len(short) else list(names)


def _columns(rows: list[dict[str, float]]) -> list[str]:
    return list(dict.fromkeys(c for row in rows for c in row))


def headline_rows(reports: Reports) -> tuple[list[str], list[dict[str, float]]]:
    """(columns in first-seen order, one {column: value} per model)."""
    rows = [{c: v for suite, m in results.items() for c, v in headline(suite, m).items()} for _, results in reports]
    return _columns(rows), rows


def detail_rows(reports: Reports) -> tuple[list[str], list[dict[str, float]]]:
    """(metric names in first-seen order, one {metric: value} per model): the detail table is transposed (a row per
    metric, a column per model), since a suite may have dozens."""
    rows = [{c: v for suite, m in results.items() for c, v in detail(suite, m).items()} for _, results in reports]
    return _columns(rows), rows


def _csv(header: list[str], body: list[list[str]]) -> str:
    buffer = io.StringIO()
    writer = csv.writer(buffer, lineterminator="\n")
    writer.writerows([header, *body])
    return buffer.getvalue()


def _markdown(header: list[str], body: list[list[str]]) -> str:
    cells = [[c.replace("|", "\\|") for c in row] for row in [header, *body]]
    lines = ["| " + " | ".join(cells[0]) + " |", "|" + "---|" * len(header)]
    return "\n".join(lines + ["| " + " | ".join(r) + " |" for r in cells[1:]]) + "\n"


def _cell(value: float | None, places: int | None) -> str:
    if value is None:
        return "" if places is None else "–"
    return repr(value) if places is None else f"{value:.{places}f}"


def long_rows(reports: Reports, settings: Settings) -> tuple[list[str], list[list[Any]]]:
    """(header, rows) of the long table: a row per (run, suite, metric), headline figures then the detail."""
    keys = list(dict.fromkeys(k for s in settings for k in s))
    body = []
    for (label, results), setting in zip(reports, settings, strict=True):
        for suite, metrics in results.items():
            figures = {**headline(suite, metrics), **detail(suite, metrics)}
            body += [[label, *(setting.get(k, "") for k in keys), suite, name.removeprefix(f"{suite} "), value]
                     for name, value in figures.items()]  # fmt: skip
    return ["run", *keys, "suite", "metric", "value"], body


def grouped_rows(reports: Reports, settings: Settings) -> tuple[list[str], list[dict[str, Any]]]:
    """(headline columns, one row per GROUP_BY setting): {setting: value, "n", "seeds", column: [values]}; a report
    without run settings is a group of its own."""
    columns, rows = headline_rows(reports)
    groups: dict[tuple, dict[str, Any]] = {}
    for (label, _), setting, row in zip(reports, settings, rows, strict=True):
        key = tuple(setting.get(k, "") for k in GROUP_BY) if setting.get("recipe_sha256") else (label,)
        group = groups.setdefault(key, {**{k: setting.get(k, "") for k in GROUP_BY}, "runs": [], "seeds": []})
        group["runs"].append(label)
        group["seeds"].append(setting.get("seed", ""))
        for c in columns:
            group.setdefault(c, []).extend([row[c]] if c in row else [])
    return columns, list(groups.values())


def _spread(values: list[float], places: int | None) -> list[str]:
    if not values:
        return ["", ""] if places is None else ["–"]
    mean = statistics.fmean(values)
    std = statistics.stdev(values) if len(values) > 1 else 0.0
    return [repr(mean), repr(std)] if places is None else [f"{mean:.{places}f} ± {std:.{places}f}"]


def grouped_tables(reports: Reports, settings: Settings) -> dict[str, str]:
    """eval_grouped.csv (mean and sample std columns) and .md (mean ± std), a row per group of seeds."""
    columns, groups = grouped_rows(reports, settings)
    out = {}
    for name, places in (("eval_grouped.csv", None), ("eval_grouped.md", 2)):
        stats = [s for c in columns for s in ([f"{c} mean", f"{c} std"] if places is None else [c])]
        header = [*GROUP_BY, "n", "seeds", "runs", *stats]
        body = [[*(str(g[k]) for k in GROUP_BY), str(len(g["runs"])), " ".join(map(str, g["seeds"])),
                 " ".join(g["runs"]), *(v for c in columns for v in _spread(g[c], places))]
                for g in groups]  # fmt: skip
        out[name] = (_csv if places is None else _markdown)(header, body)
    return out


def tables(reports: Reports, settings: Settings | None = None) -> dict[str, str]:
    """{file name: text} of the table files (CSV at full precision, markdown at two decimals); `settings`: each
    report's run settings (none known: empty cells)."""
    settings = list(settings) if settings is not None else [{} for _ in reports]
    labels = [label for label, _ in reports]
    out = {}
    columns, rows = headline_rows(reports)
    for name, places in (("eval_table.csv", None), ("eval_table.md", 2)):
        body = [[label] + [_cell(row.get(c), places) for c in columns] for label, row in zip(labels, rows, strict=True)]
        out[name] = (_csv if places is None else _markdown)(["model", *columns], body)
    metrics, rows = detail_rows(reports)
    for name, places in (("eval_table_detail.csv", None), ("eval_table_detail.md", 2)):
        body = [[m] + [_cell(row.get(m), places) for row in rows] for m in metrics]
        out[name] = (_csv if places is None else _markdown)(["metric", *labels], body)
    out["eval_long.csv"] = _csv(*long_rows(reports, settings))
    return out | grouped_tables(reports, settings)


def check_tables(out_dir: str | Path) -> None:
    """Refuse (one line, before any evaluation) a table file in `out_dir` that sharpclip did not write."""
    owned_files.check([Path(out_dir) / name for name in TABLE_FILES], "--table")


def write_tables(reports: Reports, out_dir: str | Path, settings: Settings | None = None) -> list[Path]:
    """The table files into `out_dir` (owned_files' rule: a file there sharpclip did not write is refused)."""
    if len({label for label, _ in reports}) != len(reports):
        raise ValueError(f"two reports have the same label ({', '.join(label for label, _ in reports)}); rename one")
    check_tables(out_dir)
    owned_files.folder(out_dir, "--table")
    texts = tables(reports, settings)
    return [owned_files.write_text(Path(out_dir) / name, text, "--table") for name, text in texts.items()]
