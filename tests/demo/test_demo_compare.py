"""The demo's qualitative page (demo/compare.py): written from the InfoNCE and HN-CLIP arms' run directories when both
ran, nothing otherwise; the page passes the page checks and its ranks are eval's on the same checkpoints."""

from __future__ import annotations

import json
from pathlib import Path

from _support.finetuned_run import finetuned_run, init_checkpoint
from _support.html_pages import check_page
from _support.tiny_files import write_generic
from sharpclip.config import DataConfig
from sharpclip.demo.compare import FOLDER, write_qualitative


def test_demo_page_from_two_arms(tmp_path: Path):
    data = DataConfig(format="generic", root=str(write_generic(tmp_path / "d", n=8, splits=("test",))))
    runs = {}
    for width, arm in ((32, "infonce"), (48, "hn")):  # two different models
        finetuned_run(tmp_path / arm, init_checkpoint(tmp_path / f"init{width}", width), context=None)
        runs[arm] = tmp_path / arm
    assert write_qualitative({"infonce": runs["infonce"]}, data, tmp_path / "out") == []
    page, png, numbers = write_qualitative(runs, data, tmp_path / "out", k=3, n=2)
    assert page == tmp_path / "out" / FOLDER / "compare.html" and png.stat().st_size > 0
    parsed = check_page(page)
    assert parsed.title == "Qualitative retrieval: InfoNCE vs HN-CLIP on SynthDense test"
    result = json.loads(numbers.read_text())
    assert sorted(result["ranks"]) == ["HN-CLIP", "InfoNCE"] and len(result["ranks"]["InfoNCE"]) == 8
    assert result["ranks"]["InfoNCE"] != result["ranks"]["HN-CLIP"] and result["b_better"] + result["a_better"]
    assert all(len(m["top"]) == 3 for c in result["b_better"] + result["a_better"] for m in c["models"])
