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
from sharpclip.analysis.compare import (
    Side,
    compare_rankings,
    hardest_negative,
    is_small_move,
    sign_test,
    totals,
    write_compare,
)
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
    assert "B ranks the ground truth higher than A: 1 of 4 queries (1 shown, largest moves first)" in parsed.text
    assert "over 4 queries: B ranks the ground truth higher on 1, A on 1, tied on 2" in parsed.text
    assert "Every rank move between the two models is small" in parsed.text  # 3 → 1 and 1 → 2
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
    out = capsys.readouterr().out
    assert "compare.html" in out and "over 10 queries: tiny-siglip ranks the ground truth higher on " in out
    result = json.loads((tmp_path / "cmp" / "compare.json").read_text())
    assert result["models"] == ["tiny-clip", "tiny-siglip"] and result["sources"]["tiny-clip"] == "tiny-clip"
    for case in result["b_better"] + result["a_better"]:
        a, b = (m["gt_rank"] for m in case["models"])
        assert (a > b) == (case in result["b_better"]) and a != b
        assert [result["ranks"][m][case["query"]] for m in result["models"]] == [a, b]
    check_page(tmp_path / "cmp" / "compare.html")
    assert main(["compare", "--model", "tiny-clip", *args[5:]]) == 2
    assert "two models" in capsys.readouterr().err


def test_compare_totals_count_every_query_not_the_ones_shown():
    # 40 queries: B better on 10 (one by 20 places, the others by one), 30 tied
    ranks_a = torch.tensor([30, 5, 6, 7, 8] + [2] * 5 + [1] * 30)
    ranks_b = torch.tensor([10, 4, 5, 6, 7] + [1] * 5 + [1] * 30)
    t = totals("A", "B", ranks_a, ranks_b)
    assert (t["queries"], t["b_better"], t["a_better"], t["tied"]) == (40, 10, 0, 30)
    assert t["large_moves"] == {"b_better": 1, "a_better": 0}  # 30 → 10 only; 5 → 4 and 2 → 1 are small
    assert t["sign_test_p"] == pytest.approx(2 / 2**10)
    assert t["R@1"] == {"A": 75.0, "B": 87.5} and t["mean_rank"]["A"] == pytest.approx((30 + 26 + 10 + 30) / 40)
    assert sign_test(5, 5) == 1.0 and sign_test(0, 0) == 1.0
    assert is_small_move(10, 9) and is_small_move(31, 30) and is_small_move(40, 36) and not is_small_move(10, 3)


def test_compare_cases_shown_are_the_largest_moves_and_the_json_has_the_totals(tmp_path: Path):
    g = torch.Generator().manual_seed(0)
    images = torch.nn.functional.normalize(torch.randn(12, 16, generator=g), dim=-1)
    text_a = torch.nn.functional.normalize(images + 0.9 * torch.randn(12, 16, generator=g), dim=-1)
    text_b = torch.nn.functional.normalize(images + 0.9 * torch.randn(12, 16, generator=g), dim=-1)
    result = compare_rankings(Side("A", images, text_a), Side("B", images, text_b), list(range(12)), k=2, n=2)
    ra, rb = (torch.tensor(result["ranks"][m]) for m in "AB")
    t = result["totals"]
    assert t["b_better"] == int((ra > rb).sum()) and t["a_better"] == int((ra < rb).sum())
    assert t["b_better"] + t["a_better"] + t["tied"] == 12
    moves = sorted((ra - rb).tolist(), reverse=True)
    assert [int(ra[c["query"]] - rb[c["query"]]) for c in result["b_better"]] == [m for m in moves if m > 0][:2]


def test_compare_figure_puts_a_heading_before_each_direction():
    from sharpclip.analysis.compare import _figure_rows

    result = compare_rankings(Side("A", IMAGES, TEXT_A), Side("B", IMAGES, TEXT_B), [0, 1, 2, 3], k=2, n=5)
    rows = _figure_rows(result, 3)
    assert [kind for kind, _ in rows] == ["heading", "case", "heading", "case"]
    assert rows[0][1].startswith("B ranks the ground truth higher than A: 1 of 4 queries")
    assert rows[2][1].startswith("A ranks the ground truth higher than B: 1 of 4 queries")
    result["a_better"] = []
    assert _figure_rows(result, 3)[-1] == ("heading", "A ranks the ground truth higher than B: no query")
