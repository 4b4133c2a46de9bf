"""Every command that writes files replaces only what it wrote (sharpclip.owned_files), one writer at a time.

Each writer of `WRITERS` is run once into a clean folder to learn every name it writes; then, for each of those
names (thumbnails: the first two of a `_files/` folder), a user's file is put under that name alone and the command
run again: it must refuse (exit 2) and leave every user file byte-identical. A symbolic link under its first name,
pointing out of the folder, must be refused the same way, the file it points to untouched.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest

from _support.tiny_files import write_generic
from sharpclip.analysis.index import LOCK
from sharpclip.cli import main
from sharpclip.config import load_config, to_yaml
from sharpclip.owned_files import REGISTRY

Writer = Callable[[dict, Path], int]


def _search_page(ctx: dict, out: Path) -> int:
    return main(["search", "--model", "tiny-clip", *ctx["data"], "--index", ctx["index"], "--text", ctx["caption"],
                 "-k", "2", "--html", str(out / "page.html")])  # fmt: skip


def _search_index(ctx: dict, out: Path) -> int:
    return main(["search", "--model", "tiny-clip", *ctx["data"], "--index", str(out)])


def _compare(ctx: dict, out: Path) -> int:
    return main(["compare", "--model", "tiny-clip", "--model", "tiny-siglip", *ctx["data"], "--index", ctx["index"],
                 "--out", str(out), "-k", "2", "-n", "1"])  # fmt: skip


def _feature_map(ctx: dict, out: Path) -> int:
    return main(["analyze", "--feature-map", ctx["image"], "--text", "red", "--model", "tiny-clip", "--out", str(out)])


def _analyze_runs(ctx: dict, out: Path) -> int:
    return main(["analyze", ctx["run"], "--out", str(out)])


def _sample_efficiency(ctx: dict, out: Path) -> int:
    return main(["analyze", "sample-efficiency", ctx["run"], "--out", str(out)])


def _geometry(ctx: dict, out: Path) -> int:
    return main(["analyze", "--geometry", "generic", "--data-root", ctx["root"], "--model", "tiny-clip", "--out",
                 str(out), "--pairs", "2"])  # fmt: skip


def _validate_json(ctx: dict, out: Path) -> int:
    return main(["validate-data", ctx["root"] + "/generic", "--split", "test", "--json", str(out / "report.json"),
                 "--no-progress"])  # fmt: skip


def _eval_report(ctx: dict, out: Path) -> int:
    return main(["eval", "--model", "tiny-clip", *ctx["data"], "--suite", "retrieval", "--out", str(out)])


WRITERS: dict[str, Writer] = {
    "search --html": _search_page,
    "search --index": _search_index,
    "compare --out": _compare,
    "analyze --feature-map --out": _feature_map,
    "analyze RUN --out": _analyze_runs,
    "analyze --sample-efficiency --out": _sample_efficiency,
    "analyze --geometry --out": _geometry,
    "validate-data --json": _validate_json,
    "eval --out": _eval_report,
}


@pytest.fixture(scope="module")
def ctx(tmp_path_factory: pytest.TempPathFactory) -> dict:
    base = tmp_path_factory.mktemp("owned")
    data = write_generic(base / "root" / "generic", n=6, splits=("test",))
    caption = json.loads((data / "test.jsonl").read_text().splitlines()[1])["caption"]
    run = base / "run_a"
    run.mkdir()
    rows = [{"step": 5 * k, "epoch": k // 2, "loss_infonce": 0.01, "grad_norm_infonce": 1e-3} for k in range(4)]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows) + json.dumps(
        {"epoch": 0, "eval/retrieval/t2i/R@1": 50.0, "eval/retrieval/mean_R@1": 50.0}) + "\n")  # fmt: skip
    (run / "config.yaml").write_text(to_yaml(load_config(None, [])))
    return {
        "base": base, "root": str(base / "root"), "index": str(base / "ix"), "caption": caption, "run": str(run),
        "image": str(data / "images" / "test-1.png"),
        "data": ["data.format=generic", f"data.root={data}", "eval.progress=false", "eval.num_workers=0"],
    }  # fmt: skip


def _written(out: Path) -> list[Path]:
    """The files a writer wrote under `out` (relative; its record and lock left out); of a `_files/` folder (page
    thumbnails) the first two."""
    names = sorted(p.relative_to(out) for p in out.rglob("*") if p.is_file() and p.name not in (REGISTRY, LOCK))
    thumbs = [p for p in names if p.parent.name.endswith("_files")]
    return [p for p in names if p not in thumbs] + thumbs[:2]


def _learn(ctx: dict, name: str) -> list[Path]:
    out = ctx["base"] / "learn" / name.replace(" ", "_").replace("-", "")
    assert WRITERS[name](ctx, out) == 0
    names = _written(out)
    assert names, f"{name} wrote nothing"
    return names


@pytest.mark.parametrize("name", list(WRITERS))
def test_a_writer_leaves_a_users_file_under_each_of_its_names_byte_identical(ctx: dict, name: str, tmp_path: Path):
    for k, rel in enumerate(_learn(ctx, name)):
        out = tmp_path / f"try{k}"
        (out / rel).parent.mkdir(parents=True, exist_ok=True)
        mine = f"the user's own {rel} ({name})\n".encode()
        (out / rel).write_bytes(mine)
        assert WRITERS[name](ctx, out) == 2, f"{name} did not refuse a user's {rel}"
        assert (out / rel).read_bytes() == mine, f"{name} changed the user's {rel}"


@pytest.mark.parametrize("name", list(WRITERS))
def test_a_writer_never_writes_through_a_symlink_out_of_its_folder(ctx: dict, name: str, tmp_path: Path):
    rel = _learn(ctx, name)[0]
    outside = tmp_path / "outside.txt"
    outside.write_bytes(b"not sharpclip's")
    out = tmp_path / "out"
    (out / rel).parent.mkdir(parents=True, exist_ok=True)
    (out / rel).symlink_to(outside)
    assert WRITERS[name](ctx, out) == 2, f"{name} wrote through a link at {rel}"
    assert outside.read_bytes() == b"not sharpclip's" and (out / rel).is_symlink()


@pytest.mark.parametrize("name", ["search --html", "compare --out", "analyze --feature-map --out", "eval --out"])
def test_a_writer_replaces_its_own_files_on_a_second_run(ctx: dict, name: str, tmp_path: Path):
    out = tmp_path / "out"
    assert WRITERS[name](ctx, out) == 0
    assert WRITERS[name](ctx, out) == 0  # what it wrote is its own to replace
