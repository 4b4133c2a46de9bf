"""The reference-protocol table of docs/evaluation.md, checked against the code and the release-layout fixtures, so
it stays true: one row per benchmark suite, each claim (split, counts, caption field, truncation, image mode) tied to
the constant or the reader behaviour that implements it."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from sharpclip.config import DataConfig, EvalConfig
from sharpclip.data import read_samples
from sharpclip.eval import pairs
from sharpclip.eval.benchmarks import DATASETS
from sharpclip.eval.pair_data import MMVP_PROMPT, SUGARCREPE_SUBSETS

ROOT = Path(__file__).resolve().parents[2]
FIXTURES = ROOT / "tests" / "fixtures" / "data"
NO_REFERENCE = {"generic", "synthdense", "synth_mmvp", "zeroshot", "retrieval"}  # sharpclip's own, no paper protocol


def _table() -> dict[str, list[str]]:
    lines = (ROOT / "docs" / "evaluation.md").read_text(encoding="utf-8").splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("| suite | reference (repo: file) |"))
    rows = {}
    for line in lines[start + 2 :]:
        if not line.startswith("|"):
            break
        cells = [c.strip() for c in line.strip("|").split(" | ")]
        rows[cells[0].strip("`")] = cells[1:]
    return rows


TABLE = _table()
COLUMNS = ("reference", "split", "caption", "truncation", "image")


def cell(suite: str, column: str) -> str:
    return TABLE[suite][COLUMNS.index(column)]


def _fixture(fmt: str, **options):
    return DataConfig(format=fmt, root=str(FIXTURES / fmt), **options)


def test_one_row_per_benchmark_suite() -> None:
    assert set(TABLE) == set(DATASETS) - NO_REFERENCE
    assert all(len(cells) == len(COLUMNS) for cells in TABLE.values())


def test_image_mode_is_convert_rgb_for_every_suite_as_the_default_policy() -> None:
    assert all('convert("RGB")' in cell(s, "image") for s in TABLE)
    assert EvalConfig().image_alpha == "drop" and DataConfig().image_alpha == "drop"
    assert all("bbox crop" in cell(s, "image") for s in ("aro_relation", "aro_attribution"))


def test_truncation_is_the_models_context_for_every_suite() -> None:
    assert all(cell(s, "truncation").startswith("context") for s in TABLE)


def test_retrieval_rows_match_the_readers_defaults() -> None:
    assert "5,100" in cell("docci", "split") and DataConfig().docci_test == "goal"
    assert read_samples(_fixture("docci"), "test")[0].id.startswith("qual_test")
    assert "first 1,000 records" in cell("sharegpt4v", "split") and DataConfig().sharegpt4v_test_size == 1000
    sharegpt = read_samples(_fixture("sharegpt4v", sharegpt4v_test_size=1), "test")[0]
    assert "\n" not in sharegpt.caption and "`\\n` → space" in cell("sharegpt4v", "caption")
    assert cell("dci", "caption") == '`extra_caption` (only `""` left out)'
    assert [s.caption for s in read_samples(_fixture("dci"), "all")].count(" \n") == 1  # whitespace-only kept
    assert "whitespace-only titles kept" in cell("long_dci", "split")
    assert any(not s.caption.strip() for s in read_samples(_fixture("long_dci"), "test"))


@pytest.mark.parametrize("suite", ["coco", "flickr30k"])
def test_coco_and_flickr_rows_name_both_protocols_karpathy_by_default(suite: str) -> None:
    assert cell(suite, "reference").startswith("Karpathy") and "coco_flickr_protocol: longclip" in cell(
        suite, "reference"
    )
    assert DataConfig().coco_flickr_protocol == "karpathy"
    samples = read_samples(_longclip(suite), "test")
    assert len(samples) == 3 and all(len(s.captions) == 5 for s in samples)
    assert "5 per image" in cell(suite, "caption")
    karpathy = read_samples(_fixture("karpathy"), "test")  # the default: the split JSON's test split
    assert [len(s.captions) for s in karpathy] == [5, 5]


def _longclip(suite: str) -> DataConfig:
    return DataConfig(format="karpathy", root=str(FIXTURES / suite), coco_flickr_protocol="longclip")


def test_pair_choice_rows_match_the_scorers() -> None:
    assert f'`"{MMVP_PROMPT}" + Statement`' == cell("mmvp", "caption")
    n_patterns, per = (int(x) for x in re.search(r"(\d+) patterns × (\d+)", cell("mmvp", "split")).groups())
    assert (n_patterns, per) == (len(pairs.MMVP_CATEGORIES), pairs.MMVP_PAIRS_PER_CATEGORY)
    assert cell("sugarcrepe", "split").startswith(f"{len(SUGARCREPE_SUBSETS)} files")
    assert "(replace, swap, add)" in cell("sugarcrepe", "split")
    assert tuple(pairs.SUGARCREPE_FAMILIES) == ("replace", "swap", "add")
    assert f"minus {len(pairs.ARO_EXCLUDED_RELATIONS)}" in cell("aro_relation", "split")
    assert f"≥ {pairs.ARO_MIN_ATTRIBUTE_COUNT}" in cell("aro_attribution", "split")
    assert "RGBA" in cell("winoground", "image")
