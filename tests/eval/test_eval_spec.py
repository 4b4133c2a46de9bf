"""SPEC: the scorer on a hand-computed case, and the suite over a fixture with the release's exact layout
(tests/fixtures/data/spec: six subset folders, image2text.json / text2image.json of {query, keys, label}), scored
by a colour stand-in encoder whose every answer was worked out by hand from the fixture's plan."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from sharpclip.cli import main
from sharpclip.config import EvalConfig
from sharpclip.data.schema import BadSampleError
from sharpclip.eval.embed import load_image
from sharpclip.eval.pairs import spec_scores
from sharpclip.eval.spec_data import SPEC_SUBSETS, read_spec
from sharpclip.eval.suite import run_suite

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "data" / "spec"
RGB = {"red": (1.0, 0.0, 0.0), "green": (0.0, 1.0, 0.0), "blue": (0.0, 0.0, 1.0)}


class Colours:
    """Images -> mean RGB; captions -> the sum of the colour words they name; both L2-normalised."""

    def images(self, refs):
        rgb = [torch.tensor(np.asarray(load_image(r), dtype=np.float32).reshape(-1, 3).mean(0)) for r in refs]
        return torch.nn.functional.normalize(torch.stack(rgb), dim=1)

    def texts(self, captions):
        vecs = [sum((torch.tensor(RGB[w]) for w in c.split() if w in RGB), torch.zeros(3)) for c in captions]
        return torch.nn.functional.normalize(torch.stack(vecs), dim=1)


def test_spec_scores_by_hand() -> None:
    """Ragged K, a tie (first candidate wins, as torch.argmax), and the per-subset (not per-item) mean."""
    scores = [
        torch.tensor([0.1, 0.9, 0.3]),  # a / i2t, label 1: right
        torch.tensor([0.5, 0.5]),  # a / i2t, label 1: tie -> index 0: wrong
        torch.tensor([0.2, 0.1, 0.0, 0.4]),  # b / i2t, label 3: right
        torch.tensor([0.3, 0.2]),  # a / t2i, label 0: right
        torch.tensor([0.7, 0.7, 0.1]),  # b / t2i, label 0: tie -> index 0: right
        torch.tensor([0.0, 0.1, 0.2]),  # b / t2i, label 1: wrong
    ]
    out = spec_scores(scores, [1, 1, 3, 0, 0, 1], ["a", "a", "b", "a", "b", "b"], ["i2t"] * 3 + ["t2i"] * 3)
    assert out["i2t"] == {"a": 50.0, "b": 100.0} and out["i2t_mean"] == 75.0  # items would say 2/3 = 66.7
    assert out["t2i"] == {"a": 100.0, "b": 50.0} and out["t2i_mean"] == 75.0
    assert out["i2t_items"] == {"a": 2, "b": 1} and out["mean"] == 75.0


def test_spec_reader_keeps_the_release_structure() -> None:
    cs = read_spec(FIXTURE)
    assert cs.kind == "spec" and list(dict.fromkeys(cs.groups)) == list(SPEC_SUBSETS)
    first = cs.extra["direction"].index("t2i")  # absolute_size: its 2 image-to-text samples, then text-to-image
    assert first == 2 and [len(t) for t in cs.texts[:2]] == [3, 3] and len(cs.images[0]) == 1
    assert len(cs.images[first]) == 3 and cs.texts[first] == ["the blue object"]
    assert cs.images[first][0].path == str(FIXTURE / "absolute_size" / "images" / "absolute_size_2.png")
    assert [p.name for p in cs.files[:2]] == ["image2text.json", "text2image.json"]


def test_spec_suite_matches_the_hand_computed_scores() -> None:
    cfg = EvalConfig(suites=["spec"], roots={"spec": str(FIXTURE)}, progress=False)
    r = run_suite(Colours(), cfg).results["spec"]
    two_thirds = pytest.approx(200 / 3)
    assert r["i2t"] == {
        "absolute_size": 50.0, "relative_size": two_thirds, "absolute_spatial": 100.0, "relative_spatial": 75.0,
        "existence": 100.0, "count": 25.0,
    }  # fmt: skip
    assert r["t2i"] == {
        "absolute_size": 100.0, "relative_size": 50.0, "absolute_spatial": two_thirds, "relative_spatial": 50.0,
        "existence": 50.0, "count": two_thirds,
    }  # fmt: skip
    # unweighted means over the six subsets (the per-item mean of image-to-text would be 9 / 15 = 60 %)
    assert r["i2t_mean"] == pytest.approx((50 + 200 / 3 + 100 + 75 + 100 + 25) / 6)  # 69.44
    assert r["t2i_mean"] == pytest.approx((100 + 50 + 200 / 3 + 50 + 50 + 200 / 3) / 6)  # 63.89
    assert r["mean"] == pytest.approx((r["i2t_mean"] + r["t2i_mean"]) / 2)
    assert r["items"] == 15 + 13 and r["i2t_items"]["count"] == 4 and r["t2i_items"]["relative_spatial"] == 2


def _broken(tmp_path: Path) -> Path:
    root = tmp_path / "spec"
    shutil.copytree(FIXTURE, root)
    path = root / "count" / "image2text.json"
    rows = json.loads(path.read_text())
    rows[1]["label"] = 9  # K = 9: no such candidate
    path.write_text(json.dumps(rows))
    return root


def test_a_bad_spec_sample_names_its_file_and_index_or_is_skipped_and_counted(tmp_path: Path) -> None:
    root = _broken(tmp_path)
    with pytest.raises(BadSampleError, match=r"count/image2text.json\[1\].*label 9 is not an index"):
        read_spec(root)
    cfg = EvalConfig(suites=["spec"], roots={"spec": str(root)}, progress=False,
                     data_options={"spec": {"on_bad_sample": "skip"}})  # fmt: skip
    r = run_suite(Colours(), cfg).results["spec"]
    assert r["skipped"] == 1 and r["i2t"]["count"] == pytest.approx(100 / 3)  # 1 of the 3 left is right


def test_spec_without_subset_folders_says_where_it_looked_or_to_unzip(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="none of the subset folders"):
        read_spec(tmp_path)
    (tmp_path / "data.zip").write_bytes(b"PK")
    with pytest.raises(FileNotFoundError, match="still zipped; unzip it"):
        read_spec(tmp_path)


def test_sharpclip_eval_runs_spec_on_a_tiny_model(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["eval", "--model", "tiny-clip", "--suite", "spec", "--data-root", str(FIXTURE.parent)]
    assert main([*argv, "--out", str(tmp_path / "out"), "eval.progress=false"]) == 0
    printed = capsys.readouterr().out
    assert "| spec | i2t_mean |" in printed
    report = json.loads((tmp_path / "out" / "eval_report.json").read_text())["spec"]
    # one breakdown table, a row per subset: its accuracies and item counts in each direction
    assert "| spec | i2t | i2t_items | t2i | t2i_items |" in printed
    for subset in SPEC_SUBSETS:
        cells = [f"{report['i2t'][subset]:.2f}", str(report["i2t_items"][subset]), f"{report['t2i'][subset]:.2f}"]
        assert f"| {subset} | " + " | ".join(cells) + f" | {report['t2i_items'][subset]} |" in printed
    assert set(report["i2t"]) == set(SPEC_SUBSETS) and 0.0 <= report["mean"] <= 100.0


def test_the_reference_protocol_row_names_what_the_reader_reads() -> None:
    docs = (FIXTURE.parents[3] / "docs" / "evaluation.md").read_text(encoding="utf-8").splitlines()
    row = next(line for line in docs if line.startswith("| `spec` | SPEC "))
    assert f"{len(SPEC_SUBSETS)} subsets × 2 directions" in row and "`keys` (image→text), `query` (text→image)" in row


def _without(tmp_path: Path, *subsets: str) -> Path:
    root = tmp_path / "spec"
    shutil.copytree(FIXTURE, root)
    for subset in subsets:
        shutil.rmtree(root / subset)
    return root


def test_a_missing_spec_subset_is_refused_naming_it(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Five of six subsets would be averaged under the same names (i2t_mean, mean): refused, naming the subset."""
    root = _without(tmp_path, "count")
    with pytest.raises(FileNotFoundError, match=r"subset folder 'count' is missing.*eval\.data_options\.spec\.subsets"):
        read_spec(root)
    argv = ["eval", "--model", "tiny-clip", "--suite", "spec", "--data-root", str(tmp_path), "eval.progress=false"]
    assert main([*argv, "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "'count' is missing" in err[0] and "Traceback" not in err[0], err
    assert not (tmp_path / "out" / "eval_report.json").exists()


def test_spec_scores_only_the_subsets_named_and_the_report_lists_them(tmp_path: Path, caplog) -> None:
    root = _without(tmp_path, "count")  # a subset left out may be absent
    cfg = EvalConfig(suites=["spec"], roots={"spec": str(root)}, progress=False,
                     data_options={"spec": {"subsets": ["existence", "absolute_size"]}})  # fmt: skip
    with caplog.at_level("WARNING"):
        r = run_suite(Colours(), cfg).results["spec"]
    assert r["subsets"] == ["absolute_size", "existence"]  # in the release's order
    assert r["subsets_left_out"] == ["relative_size", "absolute_spatial", "relative_spatial", "count"]
    assert set(r["i2t"]) == set(r["t2i"]) == {"absolute_size", "existence"}
    assert r["i2t_mean"] == pytest.approx((50 + 100) / 2) and r["t2i_mean"] == pytest.approx((100 + 50) / 2)
    assert "scoring 2 of 6 subsets" in caplog.text
    from sharpclip.eval.report import markdown_report

    table = markdown_report({"spec": r}, [1])
    assert "| spec | subsets | absolute_size, existence |" in table
    assert "| spec | subsets_left_out | relative_size, absolute_spatial" in table
    full = run_suite(Colours(), EvalConfig(suites=["spec"], roots={"spec": str(FIXTURE)}, progress=False))
    assert full.results["spec"]["subsets"] == list(SPEC_SUBSETS) and full.results["spec"]["subsets_left_out"] == []


@pytest.mark.parametrize(
    ("subsets", "match"),
    [(["count"], r"subset folder 'count' is missing.*leave it out of eval\.data_options\.spec\.subsets"),
     (["cnt"], r"'cnt' is not a SPEC subset; choose from absolute_size"),
     ("count", "expected a list of subset names")],
)  # fmt: skip
def test_named_spec_subsets_must_exist_and_be_spec_subsets(tmp_path: Path, subsets, match) -> None:
    root = _without(tmp_path, "count")
    cfg = EvalConfig(suites=["spec"], roots={"spec": str(root)}, progress=False,
                     data_options={"spec": {"subsets": subsets}})  # fmt: skip
    with pytest.raises((FileNotFoundError, ValueError), match=match):
        run_suite(Colours(), cfg)


def test_subsets_is_a_data_option_of_spec_only() -> None:
    from sharpclip.config import ConfigError

    EvalConfig(data_options={"spec": {"subsets": ["count"]}})
    with pytest.raises(ConfigError, match=r"eval\.data_options\.docci\.subsets: not a data option"):
        EvalConfig(data_options={"docci": {"subsets": ["count"]}})


def test_an_empty_spec_file_or_a_subset_skipped_whole_is_refused_not_dropped_from_the_means(tmp_path: Path) -> None:
    root = _without(tmp_path)
    (root / "existence" / "text2image.json").write_text("[]")
    with pytest.raises(ValueError, match=r"existence/text2image.json: holds no samples"):
        read_spec(root)
    (root / "existence" / "text2image.json").unlink()
    with pytest.raises(FileNotFoundError, match=r"existence/text2image.json: no such file; SPEC subset 'existence'"):
        read_spec(root)
    (root / "existence" / "text2image.json").write_text((FIXTURE / "existence" / "text2image.json").read_text())
    path = root / "count" / "image2text.json"
    path.write_text(json.dumps([{**row, "label": 99} for row in json.loads(path.read_text())]))  # every one bad
    cfg = EvalConfig(suites=["spec"], roots={"spec": str(root)}, progress=False,
                     data_options={"spec": {"on_bad_sample": "skip"}})  # fmt: skip
    with pytest.raises(ValueError, match=r"every i2t sample of subset 'count' was skipped as bad"):
        run_suite(Colours(), cfg)
