"""`sharpclip demo --out DIR` refuses, before any data is generated or any arm trained, a report file in DIR that
sharpclip did not write and a `compare_infonce_hn` there that is a symbolic link (a folder sharpclip names is never
written through a link); the user's files stay byte-identical."""

from __future__ import annotations

from pathlib import Path

import pytest

import sharpclip.demo as demo
from sharpclip.cli import main
from sharpclip.demo.compare import FOLDER
from sharpclip.owned_files import NotOurs, write_text


@pytest.fixture
def no_work(monkeypatch: pytest.MonkeyPatch) -> None:
    def generated(*args: object, **kwargs: object) -> None:
        raise AssertionError("the demo generated data before refusing its --out")

    monkeypatch.setattr(demo, "prepare_data", generated)


@pytest.mark.parametrize("name", demo.REPORT_FILES)
def test_a_users_report_file_is_refused_before_anything_is_trained(tmp_path: Path, no_work: None, name: str, capsys):
    out = tmp_path / "demo"
    out.mkdir()
    (out / name).write_text("my own notes\n")
    assert main(["demo", "--quick", "--no-progress", "--out", str(out)]) == 2
    assert name in capsys.readouterr().err and (out / name).read_text() == "my own notes\n"
    assert sorted(p.name for p in out.iterdir()) == [name]


def test_a_linked_compare_folder_is_refused_and_nothing_written_through_it(tmp_path: Path, no_work: None, capsys):
    mine = tmp_path / "mine"
    mine.mkdir()
    out = tmp_path / "demo"
    out.mkdir()
    (out / FOLDER).symlink_to(mine)
    assert main(["demo", "--quick", "--no-progress", "--out", str(out)]) == 2
    assert "symbolic link" in capsys.readouterr().err and list(mine.iterdir()) == []


def test_the_demos_own_reports_pass_the_check(tmp_path: Path) -> None:
    out = tmp_path / "demo"
    for name in demo.REPORT_FILES:
        write_text(out / name, "{}\n", "--out")
    demo.check_outputs(out)  # its own: replaced by the next demo
    (out / "report.md").write_text("edited by hand\n")
    with pytest.raises(NotOurs, match=r"report\.md changed since sharpclip wrote it"):
        demo.check_outputs(out)
