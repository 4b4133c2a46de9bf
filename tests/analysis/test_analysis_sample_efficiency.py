"""`analyze --sample-efficiency` (HN-CLIP Fig. 6 / Table A9): each run's fraction from its train_subset.json, its
method from its config, its best validation mean R@1; one line per method, seeds averaged, the full-data best as the
reference line. Run directories are written with the trainer's own files (config.yaml, train_subset.json,
metrics.jsonl)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from sharpclip.analysis.sample_efficiency import check_one_recipe, method_label, run_point, summarise
from sharpclip.cli import main
from sharpclip.config import load_config, to_yaml
from sharpclip.data.schema import PairSample
from sharpclip.data.subset import read_subset_record, select_subset
from sharpclip.train.run import RESOLVED_CONFIG, SUBSET_RECORD

HN = "loss.terms={hn: {loss: hn_clip, params: {gamma: 0.5}}}"
INFONCE = "loss.terms={clip: {loss: infonce}}"


def _run(root: Path, name: str, terms: str, fraction: float, values: list[float]) -> Path:
    run = root / name
    run.mkdir(parents=True)
    overrides = [terms] + ([f"data.train_fraction={fraction}"] if fraction < 1 else [])
    (run / RESOLVED_CONFIG).write_text("# world size 1\n" + to_yaml(load_config(None, overrides)))
    if fraction < 1:
        samples = [PairSample(id=f"s{i}", image=f"{i}.png", caption="c") for i in range(200)]
        (run / SUBSET_RECORD).write_text(json.dumps(select_subset(samples, fraction)[1].to_json()))
    records = [{"step": 1, "epoch": 0, "loss": 1.0}]  # a training step: not a validation
    records += [{"epoch": e, "eval": {"test": {"t2i_R@1": v - 1, "i2t_R@1": v + 1, "mean_R@1": v}}}
                for e, v in enumerate(values)]  # fmt: skip
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    return run


def test_points_summary_and_reference(tmp_path):
    runs = [
        _run(tmp_path, "hn_05_s0", HN, 0.05, [60.0, 70.0, 65.0]),  # best 70
        _run(tmp_path, "hn_05_s1", HN, 0.05, [72.0]),
        _run(tmp_path, "hn_20", HN, 0.2, [80.0]),
        _run(tmp_path, "clip_05", INFONCE, 0.05, [50.0]),
        _run(tmp_path, "clip_full", INFONCE, 1.0, [75.0, 74.0]),
        _run(tmp_path, "hn_full", HN, 1.0, [77.0]),
    ]
    points = [run_point(r) for r in runs]
    assert points[0]["value"] == 70.0 and points[0]["fraction"] == pytest.approx(10 / 200)  # ⌈0.05 · 200⌉ = 10
    assert points[0]["keys"] == ["eval/test/mean_R@1"]
    assert points[0]["ids_sha256"] == points[1]["ids_sha256"] == points[3]["ids_sha256"]  # one subset for all
    assert [p["method"] for p in points[:4]] == ["hn_clip γ=0.5"] * 3 + ["infonce"]
    summary = summarise(points)
    hn = summary["methods"]["hn_clip γ=0.5"]
    assert [(r["fraction"], r["mean"], r["min"], r["max"], r["runs"]) for r in hn] == [
        (0.05, 71.0, 70.0, 72.0, 2), (0.2, 80.0, 80.0, 80.0, 1), (1.0, 77.0, 77.0, 77.0, 1),
    ]  # fmt: skip
    assert summary["reference"]["value"] == 77.0 and summary["reference"]["method"] == "hn_clip γ=0.5"


def test_method_label_names_terms_gamma_and_adapter():
    cfg = load_config(None, ["loss.terms={hn: {loss: hn_clip, params: {gamma: 0.25}}, tok: {loss: filip}, "
                             "unused: {loss: infonce, weight: 0}}", "model.adapter.method=lora"])  # fmt: skip
    assert method_label(cfg) == "lora: hn_clip γ=0.25 + filip"


def test_the_cli_writes_the_figure_and_table(tmp_path):
    runs = [_run(tmp_path, "a", HN, 0.2, [80.0]), _run(tmp_path, "b", INFONCE, 1.0, [75.0])]
    out = tmp_path / "figs"
    assert main(["analyze", "sample-efficiency", *map(str, runs), "--out", str(out)]) == 0
    numbers = json.loads((out / "sample_efficiency.json").read_text())
    assert numbers["reference"]["value"] == 75.0 and (out / "sample_efficiency.png").stat().st_size > 0
    table = (out / "sample_efficiency.md").read_text()
    assert "| hn_clip γ=0.5 | 20.0 % | 80.00 | 80.00–80.00 | 1 |" in table
    assert "Reference: the best full-data run, infonce, 75.00." in table
    assert main(["analyze", "sample-efficiency", str(tmp_path / "missing")]) == 2
    with pytest.raises(SystemExit) as refused:  # argparse: RUN is required, a usage line
        main(["analyze", "sample-efficiency"])
    assert refused.value.code == 2


def _with(run: Path, *overrides: str) -> Path:
    """`run`'s config.yaml with `overrides` applied (as if it had been trained with them)."""
    cfg = load_config(run / RESOLVED_CONFIG, list(overrides), saved=True)
    (run / RESOLVED_CONFIG).write_text("# world size 1\n" + to_yaml(cfg))
    return run


@pytest.mark.parametrize(
    ("override", "key"),
    [("data.format=generic", "data.format"), ("data.root=/elsewhere/gen0", "data.root"),
     ("data.eval_split=val", "data.eval_split"), ("train.lr=0.001", "train.lr"),
     ("model.name=tiny-siglip", "model.name"), ("train.epochs=7", "train.epochs")],
)  # fmt: skip
def test_runs_of_different_recipes_are_refused_naming_the_keys(tmp_path, capsys, override, key):
    """Runs trained on another data set, model or learning rate are not one curve: refused, naming the key."""
    a = _run(tmp_path, "a", INFONCE, 0.5, [60.0])
    b = _with(_run(tmp_path, "b", INFONCE, 0.5, [62.0]), override)
    full = _run(tmp_path, "full", INFONCE, 1.0, [70.0])
    with pytest.raises(ValueError, match=rf"differ in more than the seed.*{re.escape(key)} \("):
        check_one_recipe([a, b, full])
    assert main(["analyze", "sample-efficiency", str(a), str(b), str(full), "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and key in err[0] and "Traceback" not in err[0], err
    assert not (tmp_path / "out" / "sample_efficiency.md").exists()


def test_seed_subset_size_method_and_bookkeeping_may_differ(tmp_path):
    runs = [
        _with(_run(tmp_path, "a", HN, 0.5, [60.0]), "train.seed=3", "data.subset_seed=2", "data.num_workers=0"),
        _with(_run(tmp_path, "b", HN, 0.2, [55.0]), "data.train_count=0", "train.progress=false"),
        _run(tmp_path, "c", INFONCE, 1.0, [70.0]),
    ]
    check_one_recipe(runs)
    other_gamma = _run(tmp_path, "d", HN.replace("0.5", "0.25"), 0.5, [61.0])
    check_one_recipe([*runs, other_gamma])  # another γ is another method label: another line
    margin = _with(_run(tmp_path, "e", HN, 0.5, [61.0]), "loss.terms.hn.weight=2.0")
    with pytest.raises(ValueError, match=r"runs of method 'hn_clip γ=0.5' differ in loss\.terms\.hn\.weight"):
        check_one_recipe([*runs, margin])


@pytest.mark.parametrize(
    "override",
    ["train.diagnostics_every=5", "data.preload=true", "eval.batch_size=32", "eval.chunk_size=128",
     "data.root=/srv/synth/", "data.root=/srv/./synth"],
)  # fmt: skip
def test_runs_differing_only_in_a_watch_or_memory_knob_or_a_paths_spelling_are_one_recipe(tmp_path, override):
    """A knob that changes no number (diagnostics, preloading, evaluation batch sizes) or a trailing `/` on data.root
    was refused as another recipe."""
    a = _with(_run(tmp_path, "a", INFONCE, 0.5, [60.0]), "data.root=/srv/synth")
    b = _with(_run(tmp_path, "b", INFONCE, 0.5, [62.0]), "data.root=/srv/synth", override)
    full = _with(_run(tmp_path, "full", INFONCE, 1.0, [70.0]), "data.root=/srv/synth")
    check_one_recipe([a, b, full])


@pytest.mark.parametrize(
    ("text", "problem"),
    [("garbage{", "Expecting value"), ('{"total": 0, "selected": 0}', "no 'fraction'"),
     (None, "'selected' 0 of 'total' 0 is not a subset"), ("[1, 2]", "expected a JSON object, got list"),
     (None, "'ids_sha256' is 5, not a str")],
)  # fmt: skip
def test_a_damaged_train_subset_json_is_one_line_naming_the_file(tmp_path, capsys, text, problem):
    run = _run(tmp_path, "a", HN, 0.5, [60.0])
    record = json.loads((run / SUBSET_RECORD).read_text())
    if text is None:
        record.update({"total": 0, "selected": 0} if "total" in problem else {"ids_sha256": 5})
        text = json.dumps(record)
    (run / SUBSET_RECORD).write_text(text)
    with pytest.raises(ValueError, match=rf"{re.escape(str(run / SUBSET_RECORD))}: damaged.*{re.escape(problem)}"):
        read_subset_record(run / SUBSET_RECORD)
    assert main(["analyze", "sample-efficiency", str(run), "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and str(run / SUBSET_RECORD) in err[0] and problem in err[0], err
