"""`--overwrite` of a run directory deletes its `eval/` reports (sharpclip's own, as their folders' records say) but
never a file the user put beside them: that is refused in one line naming it, and left byte-identical."""

from __future__ import annotations

from pathlib import Path

import pytest

from sharpclip.owned_files import write_text
from sharpclip.train.run_dir import RunDirError, open_run_dir, write_marker


def _run_with_reports(path: Path) -> Path:
    path.mkdir()
    write_marker(path)
    (path / "metrics.jsonl").write_text("{}\n")
    for name in ("eval_report.json", "eval_report.md", "eval_manifest.json"):
        write_text(path / "eval" / "step-000004" / name, "{}\n", "--out")
    return path


def test_overwrite_refuses_a_users_file_beside_the_runs_eval_reports(tmp_path: Path) -> None:
    run = _run_with_reports(tmp_path / "run")
    (run / "eval" / "step-000004" / "my_analysis.ipynb").write_text("hours of work")
    with pytest.raises(RunDirError, match=r"eval/step-000004/my_analysis\.ipynb"):
        open_run_dir(run, "overwrite")
    assert (run / "eval" / "step-000004" / "my_analysis.ipynb").read_text() == "hours of work"
    assert (run / "eval" / "step-000004" / "eval_report.md").is_file()


def test_overwrite_deletes_the_runs_own_eval_reports(tmp_path: Path) -> None:
    run = _run_with_reports(tmp_path / "run")
    open_run_dir(run, "overwrite").release()
    assert not (run / "eval").exists()
