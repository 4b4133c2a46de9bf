"""`sharpclip compare` (analysis/compare.py): on two hand-built models whose ranks are known, the chosen queries, the
ranks, the top-k lists and the hardest caption negatives are the hand-computed ones; the page and figure are
written and readable; the CLI runs on two tiny models."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from _support.html_pages import check_page
from _support.tiny_files import write_generic
from sharpclip.analysis.compare import Side, compare_rankings, hardest_negative, write_compare
from sharpclip.cli import main
from sharpclip.eval.retrieval import RetrievalSet


def _n(*v: float) -> torch.Tensor:
    t = torch.tensor(v, dtype=torch.float32)
    return t / t.norm()


IMAGES = torch.eye(4)  # image i is e_i, for both models; caption i belongs to image i
TEXT_A = torch.stack([_n(1, 0, 0, 0), _n(0.9, 0.5, 0.8, 0), _n(0, 0, 1, 0), _n(0, 0, 0, 1)])
TEXT_B = torch.stack([_n(0.5, 0.9, 0, 0), _n(0, 1, 0, 0), _n(0, 0, 1, 0), _n(0, 0, 0, 1)])
# A: caption 1 scores e0 .9, e2 .8, e1 .5 (/√1.7): its ground truth at rank 3; B ranks it 1st.
# B: caption 0 scores e1 .9, e0 .5: its ground truth at rank 2; A ranks it 1st. Captions 2 and 3: rank 1 under both.


def test_hand_built_models_give_the_hand_computed_cases():
    result = compare_rankings(Side("A", IMAGES, TEXT_A), Side("B", IMAGES, TEXT_B), [0, 1, 2, 3], k=3, n=5)
    assert result["ranks"] == {"A": [1, 3, 1, 1], "B": [2, 1, 1, 1]}
    (b_case,) = result["b_better"]
    (a_case,) = result["a_better"]  # queries whose ranks are equal are in neither direction
    assert (b_case["query"], b_case["ground_truth"], a_case["query"]) == (1, 1, 0)
    a_on_1, b_on_1 = b_case["models"]
    assert (a_on_1["gt_rank"], b_on_1["gt_rank"]) == (3, 1)
    assert a_on_1["top"] == [0, 2, 1] and b_on_1["top"][0] == 1
    assert a_on_1["scores"] == pytest.approx(
        [0.9 / math.sqrt(1.7), 0.8 / math.sqrt(1.7), 0.5 / math.sqrt(1.7)], abs=1e-6
    )
    # caption 1's hardest negative is caption 0 under both towers: cos 0.9/√1.7 under A, 0.9/√1.06 under B
    for m in (a_on_1, b_on_1):
        assert m["hardest_negative"]["caption"] == 0
        assert m["hardest_negative"]["cosine"] == pytest.approx({"A": 0.9 / math.sqrt(1.7), "B": 0.9 / math.sqrt(1.06)})
    assert [m["gt_rank"] for m in a_case["models"]] == [1, 2]


def test_hardest_negative_skips_the_captions_of_the_same_image():
    text = torch.stack([_n(1, 0), _n(0.99, 0.1), _n(0, 1)])
    assert hardest_negative(text, torch.tensor([0, 0, 1]), 0) == (2, pytest.approx(0.0))
    assert hardest_negative(text, torch.tensor([0, 0, 1]), 2)[0] == 1
    assert hardest_negative(text, torch.tensor([0, 0, 0]), 0)[0] == -1


def test_page_and_figure_of_the_hand_built_cases(tmp_path: Path):
    root = write_generic(tmp_path / "d", n=4, splits=("test",))
    rows = [json.loads(line) for line in (root / "test.jsonl").read_text().splitlines()]
    captions = [r["caption"] for r in rows]
    captions[1] = "a <b>bold</b> & risky caption"  # shown as written, not as markup
    dataset = RetrievalSet("hand", [str(root / r["image"]) for r in rows], captions, [0, 1, 2, 3])
    result = compare_rankings(Side("A", IMAGES, TEXT_A), Side("B", IMAGES, TEXT_B), [0, 1, 2, 3], k=2, n=5)
    page, png, numbers = write_compare(result, dataset, tmp_path / "out")
    parsed = check_page(page)
    assert "a <b>bold</b> & risky caption" in parsed.text and "a &lt;b&gt;bold&lt;/b&gt; &amp;" in page.read_text()
    assert "B ranks the ground truth higher than A (1 queries)" in parsed.text
    assert "A: ground truth at rank 3" in parsed.text and "ground truth: rank 3" in parsed.text  # missed, shown apart
    # case 1: A's top 2 (0, 2) + the ground truth apart, B's top 2 (1 framed, 0); case 0: A's top 2 (0 framed, 1),
    # B's top 2 (1, 0 framed)
    assert len(parsed.images) == 3 + 2 + 2 + 2 and parsed.classes.count("mark") == 4
    assert "compare.png" in parsed.links and png.stat().st_size > 0
    assert json.loads(numbers.read_text())["captions"]["1"] == captions[1]
    assert "mark" in parsed.tags  # the hardest negative's words that differ from the query


def test_cli_compare_two_tiny_models(tmp_path: Path, capsys):
    root = write_generic(tmp_path / "d", n=10, splits=("test",))
    data = ["data.format=generic", f"data.root={root}", "eval.progress=false", "--index", str(tmp_path / "ix")]
    args = [
        "compare",
        "--model",
        "tiny-clip",
        "--model",
        "tiny-siglip",
        *data,
        "--out",
        str(tmp_path / "cmp"),
        "-k",
        "3",
    ]
    assert main(args) == 0
    assert "compare.html" in capsys.readouterr().out
    result = json.loads((tmp_path / "cmp" / "compare.json").read_text())
    assert result["models"] == ["tiny-clip", "tiny-siglip"] and result["sources"]["tiny-clip"] == "tiny-clip"
    for case in result["b_better"] + result["a_better"]:
        a, b = (m["gt_rank"] for m in case["models"])
        assert (a > b) == (case in result["b_better"]) and a != b
        assert [result["ranks"][m][case["query"]] for m in result["models"]] == [a, b]
    check_page(tmp_path / "cmp" / "compare.html")
    assert main(["compare", "--model", "tiny-clip", *args[5:]]) == 2
    assert "two models" in capsys.readouterr().err
