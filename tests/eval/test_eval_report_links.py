"""`sharpclip eval --model RUN` writes its reports into `RUN/eval/<checkpoint>/`, folders sharpclip names: a symbolic
link at either (`RUN/eval` or `RUN/eval/<checkpoint>`) is refused in one line and nothing is written through it."""

from __future__ import annotations

from pathlib import Path

import pytest

from _support.finetuned_run import finetuned_run, init_checkpoint
from _support.tiny_files import write_generic
from sharpclip.cli import main


@pytest.fixture(scope="module")
def run_and_data(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    base = tmp_path_factory.mktemp("evallinks")
    finetuned_run(base / "run", init_checkpoint(base / "init"))
    return base / "run", write_generic(base / "data", n=4, splits=("test",))


def _eval(run: Path, data: Path) -> int:
    return main(["eval", "--model", str(run), "data.format=generic", f"data.root={data}", "data.eval_split=test",
                 "--suite", "retrieval", "eval.progress=false", "eval.num_workers=0"])  # fmt: skip


@pytest.mark.parametrize("link", ["eval", "eval/step-000003"])
def test_a_link_at_a_folder_eval_names_in_a_run_is_refused(run_and_data, tmp_path: Path, link: str, capsys) -> None:
    run, data = run_and_data
    mine = tmp_path / "mine"
    mine.mkdir()
    (run / link).parent.mkdir(parents=True, exist_ok=True)
    (run / link).symlink_to(mine)
    try:
        assert _eval(run, data) == 2
        assert "symbolic link" in capsys.readouterr().err and list(mine.iterdir()) == []
    finally:
        (run / link).unlink()


def test_a_link_below_the_out_folder_of_several_models_is_refused(run_and_data, tmp_path: Path, capsys) -> None:
    """Matrix 6 V4: `eval --model x/run --model y/run --out OUT` with OUT/y a link to the user's folder wrote
    OUT/y/run/ inside it. Each model's OUT/<name>/ is a folder sharpclip names: a link on the way is refused."""
    run, data = run_and_data
    users, out = tmp_path / "userdir", tmp_path / "out"
    users.mkdir()
    out.mkdir()
    (out / "run").symlink_to(users, target_is_directory=True)
    code = main(["eval", "--model", str(run), "--model", str(run.parent / "init"), "--out", str(out),
                 "data.format=generic", f"data.root={data}", "data.eval_split=test", "--suite", "retrieval",
                 "eval.progress=false", "eval.num_workers=0"])  # fmt: skip
    assert code == 2 and "symbolic link" in capsys.readouterr().err
    assert list(users.iterdir()) == [] and sorted(p.name for p in out.iterdir()) == ["run"]
