"""The suite end to end over fixture files in the real release layouts (MMVP, Winoground, SugarCrepe, ARO, Urban-1K,
an image folder per class), with a colour stand-in encoder whose answers can be worked out by hand; and the
ModelEmbedder + manifest over a tiny real dual encoder."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from PIL import Image

from sharpclip.config import DataConfig, EvalConfig, load_config
from sharpclip.eval.embed import CachedEmbedder, ImageRef, load_image
from sharpclip.eval.pair_data import mmvp_set_from_pairs
from sharpclip.eval.report import markdown_report, suite_manifest, write_report
from sharpclip.eval.scoring import score_choice_set
from sharpclip.eval.suite import run_eval, run_suite

COLOURS = {"red": (255, 0, 0), "green": (0, 255, 0), "blue": (0, 0, 255)}


class ColourEmbedder:
    """Images -> their mean RGB; captions -> the sum of the colour words they name. Both L2-normalised."""

    def images(self, refs):
        rgb = [torch.tensor(np_mean(load_image(r))) for r in refs]
        return torch.nn.functional.normalize(torch.stack(rgb) + 1e-3, dim=1)

    def texts(self, captions):
        vecs = [
            sum(
                (torch.tensor(COLOURS[w], dtype=torch.float) for w in c.replace(".", " ").split() if w in COLOURS),
                torch.full((3,), 1e-3),
            )
            for c in captions
        ]
        return torch.nn.functional.normalize(torch.stack(vecs), dim=1)


def np_mean(image) -> list[float]:
    import numpy as np

    return np.asarray(image, dtype=np.float32).reshape(-1, 3).mean(0).tolist()


def _img(path: Path, colour: str | tuple, size=(16, 16)) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.new("RGB", size, COLOURS.get(colour, colour) if isinstance(colour, str) else colour).save(path)
    return path


def _mmvp(root: Path) -> None:
    d = root / "MLLM_VLM Images" / "Orientation"
    for q, c in [(1, "red"), (2, "blue"), (3, "green"), (4, "red")]:
        _img(d / f"{q}.jpg", c)
    (root / "Questions.csv").write_text(
        "Question ID,Type,Statement\n1,Orientation,a red thing\n2,Orientation,a blue thing\n"
        "3,Orientation,a green thing\n4,Orientation,a red thing\n"
    )


def _winoground(root: Path) -> None:
    for stem, c in [("ex0_0", "red"), ("ex0_1", "blue"), ("ex1_0", "red"), ("ex1_1", "green")]:
        _img(root / "images" / f"{stem}.png", c)
    rows = [
        {"id": 0, "image_0": "ex0_0", "image_1": "ex0_1", "caption_0": "red", "caption_1": "blue"},
        {"id": 1, "image_0": "ex1_0", "image_1": "ex1_1", "caption_0": "green", "caption_1": "red"},
    ]
    (root / "examples.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")


def _sugarcrepe(root: Path) -> None:
    _img(root / "val2017" / "000000000001.jpg", "red")
    _img(root / "val2017" / "000000000002.jpg", "blue")
    (root / "data").mkdir(parents=True)
    (root / "data" / "add_att.json").write_text(
        json.dumps(
            {
                "0": {"filename": "000000000001.jpg", "caption": "a red cube", "negative_caption": "a blue cube"},
                "1": {"filename": "000000000002.jpg", "caption": "a red cube", "negative_caption": "a blue cube"},
            }
        )
    )
    (root / "data" / "swap_obj.json").write_text(
        json.dumps(
            {
                "0": {"filename": "000000000002.jpg", "caption": "blue", "negative_caption": "green"},
            }
        )
    )


def _aro(root: Path) -> None:
    # Left half red, right half blue: only the bbox crop of the left half makes "red" the right answer.
    im = Image.new("RGB", (20, 10), COLOURS["blue"])
    im.paste(COLOURS["red"], (0, 0, 10, 10))
    (root / "images").mkdir(parents=True)
    im.save(root / "images" / "1.jpg")
    item = {
        "image_path": "1.jpg",
        "bbox_x": 0,
        "bbox_y": 0,
        "bbox_w": 9,
        "bbox_h": 10,
        "true_caption": "the red horse is on the grass",
        "false_caption": "the blue horse is on the grass",
        "relation_name": "on",
    }
    (root / "visual_genome_relation.json").write_text(json.dumps([item, {**item, "relation_name": "next to"}]))


def _urban(root: Path) -> None:
    for n, c in [(1, "red"), (2, "green"), (3, "blue")]:
        _img(root / "Urban1k" / "image" / f"{n}.jpg", c)
        (root / "Urban1k" / "caption").mkdir(parents=True, exist_ok=True)
    (root / "Urban1k" / "caption" / "1.txt").write_text("a red car\n")
    (root / "Urban1k" / "caption" / "2.txt").write_text("a green tree\n")
    (root / "Urban1k" / "caption" / "3.txt").write_text("a red and blue sign\n")  # equally near images 1 and 3


def _classes(root: Path) -> None:
    for c in ("red", "green", "blue"):
        _img(root / c / "a.jpg", c)
    _img(root / "red" / "b.jpg", (200, 0, 220))  # purple: closer to blue than to red -> top-1 miss, top-2 hit


@pytest.fixture
def data_root(tmp_path: Path) -> Path:
    for name, make in [
        ("mmvp", _mmvp),
        ("winoground", _winoground),
        ("sugarcrepe", _sugarcrepe),
        ("aro_relation", _aro),
        ("urban1k", _urban),
        ("zeroshot", _classes),
    ]:
        make(tmp_path / name)
    return tmp_path


def test_suite_over_fixtures(data_root: Path, tmp_path: Path) -> None:
    suites = ["mmvp", "winoground", "sugarcrepe", "aro_relation", "urban1k", "zeroshot"]
    cfg = EvalConfig(suites=suites, data_root=str(data_root), recall_k=[1, 2], zeroshot_k=[1, 2], progress=False)
    res = run_suite(ColourEmbedder(), cfg)
    r = res.results
    # MMVP: both statements of both pairs pick their own image (qid parity: odd -> first image).
    assert r["mmvp"]["per_pattern"] == {"Orientation and Direction": 100.0} and r["mmvp"]["pairs"] == 2
    # Winoground ex0 all right; ex1: captions green/red, images red/green -> all wrong.
    assert (r["winoground"]["text"], r["winoground"]["image"], r["winoground"]["group"]) == (50.0, 50.0, 50.0)
    assert r["sugarcrepe"]["per_subset"] == {"add_att": 50.0, "swap_obj": 100.0}
    assert r["aro_relation"]["per_relation"] == {"on": 100.0}  # "next to" excluded; crop makes "red" right
    # Urban-1K: caption 3 (red + blue) ties between images 1 and 3; the lower index (image 1) wins: a miss at R@1.
    assert r["urban1k"]["t2i"]["R@1"] == pytest.approx(200 / 3) and r["urban1k"]["t2i"]["R@2"] == 100.0
    assert r["zeroshot"]["top1"] == 75.0 and r["zeroshot"]["top2"] == 100.0
    assert res.datasets["mmvp"]["files"][0]["bytes"] > 0 and len(res.datasets["mmvp"]["files"][0]["sha256"]) == 64
    assert res.datasets["urban1k"]["images"]["count"] == 3

    paths = write_report(res, suite_manifest(res, ColourEmbedder(), cfg, "colour"), tmp_path / "out", [1, 2])
    assert [p.name for p in paths] == ["eval_report.json", "eval_report.md", "eval_manifest.json"]
    md = paths[1].read_text()
    assert "| urban1k | 66.67 | 100.00 |" in md and "| winoground | group | 50.00 |" in md
    manifest = json.loads(paths[2].read_text())
    assert "lower gallery index" in manifest["tie_policy"] and manifest["prompts"]["templates"] == ["a photo of a {}."]
    assert set(manifest["datasets"]) == set(suites)


class CallRecorder(ColourEmbedder):
    """ColourEmbedder that records every call, as ("images" | "texts", items)."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, list]] = []

    def images(self, refs):
        self.calls.append(("images", list(refs)))
        return super().images(refs)

    def texts(self, captions):
        self.calls.append(("texts", list(captions)))
        return super().texts(captions)


def test_every_suite_embeds_up_front_in_two_calls_whether_this_rank_scores_or_not(data_root: Path) -> None:
    """A sharded embedder's ranks must all make the same calls: a rank that does not score embeds exactly what the
    scoring rank does (one images call, one texts call over every suite, each item once) and scores nothing."""
    suites = ["mmvp", "winoground", "sugarcrepe", "aro_relation", "urban1k", "zeroshot"]
    cfg = EvalConfig(suites=suites, data_root=str(data_root), recall_k=[1, 2], zeroshot_k=[1, 2], progress=False)
    scoring, embedding = CallRecorder(), CallRecorder()
    scored = run_suite(scoring, cfg).results
    assert run_suite(embedding, cfg, score=False).results == {}
    assert [kind for kind, _ in scoring.calls] == ["images", "texts"] and embedding.calls == scoring.calls
    for _, items in scoring.calls:
        assert len(items) == len(set(items))
    assert scored["zeroshot"]["top1"] == 75.0 and scored["urban1k"]["t2i"]["R@2"] == 100.0


def test_a_sealed_cache_refuses_what_was_not_embedded_up_front() -> None:
    cache = CachedEmbedder(ColourEmbedder())
    cache.fill([], ["a red cup"])
    cache.seal()
    assert cache.texts(["a red cup"]).shape == (1, 3)
    with pytest.raises(LookupError, match="not embedded up front"):
        cache.texts(["a blue cup"])


def test_each_suite_records_only_its_own_files(tmp_path: Path) -> None:
    """Urban-1K and DOCCI side by side in one data root with no per-suite folder: both suites fall back to the root,
    and each manifest record lists only the annotation files its own reader opened."""
    import shutil

    fixtures = Path(__file__).parents[1] / "fixtures" / "data"
    for fmt in ("urban1k", "docci"):
        shutil.copytree(fixtures / fmt, tmp_path, dirs_exist_ok=True)
    _mmvp(tmp_path / "mmvp")
    (tmp_path / "mmvp" / "notes.txt").write_text("not read by the MMVP reader\n")
    cfg = EvalConfig(suites=["urban1k", "docci", "mmvp"], data_root=str(tmp_path), recall_k=[1], progress=False)
    datasets = run_suite(ColourEmbedder(), cfg).datasets
    listed = {
        name: [Path(f["path"]).relative_to(tmp_path).as_posix() for f in d["files"]] for name, d in datasets.items()
    }
    assert listed == {
        "urban1k": ["Urban1k/caption/1.txt", "Urban1k/caption/2.txt", "Urban1k/caption/10.txt"],
        "docci": ["docci_descriptions.jsonlines"],
        "mmvp": ["mmvp/Questions.csv"],
    }
    assert datasets["urban1k"]["images"]["count"] == 3 and datasets["docci"]["images"]["count"] == 3


@pytest.mark.parametrize("hash_images", [False, True])
def test_zeroshot_hashes_images_only_under_hash_images(
    data_root: Path, monkeypatch: pytest.MonkeyPatch, hash_images: bool
) -> None:
    from sharpclip.eval import manifest

    hashed: list[Path] = []
    real = manifest.sha256_file
    monkeypatch.setattr(manifest, "sha256_file", lambda path, *a: hashed.append(Path(path)) or real(path, *a))
    cfg = EvalConfig(suites=["zeroshot"], data_root=str(data_root), hash_images=hash_images, progress=False)
    record = run_suite(ColourEmbedder(), cfg).datasets["zeroshot"]
    assert record["files"] == []  # an image folder per class: no annotation file
    assert record["images"]["count"] == 4 and record["images"]["bytes"] > 0
    assert len(hashed) == (4 if hash_images else 0)
    assert ("sha256_of_sorted_list" in record["images"]) == hash_images


def test_synthdense_style_pairs_scored_like_mmvp(tmp_path: Path) -> None:
    a, b = _img(tmp_path / "a.png", "red"), _img(tmp_path / "b.png", "blue")
    c, d = _img(tmp_path / "c.png", "green"), _img(tmp_path / "d.png", "green")
    cs = mmvp_set_from_pairs("synth", [(a, b, "red", "blue", "colour"), (c, d, "green", "green", "count")])
    out = score_choice_set(ColourEmbedder(), cs)
    # Identical images tie: both statements choose image 2, so statement 1 is wrong and the pair fails.
    assert out["per_pattern"] == {"colour": 100.0, "count": 0.0} and out["mean"] == 50.0


def test_unknown_suite_and_missing_files(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="unknown"):
        run_suite(ColourEmbedder(), EvalConfig(suites=["nope"]))
    with pytest.raises(FileNotFoundError, match=r"Questions\.csv"):
        run_suite(ColourEmbedder(), EvalConfig(suites=["mmvp"], data_root=str(tmp_path)))


def test_markdown_table_layout() -> None:
    md = markdown_report({"docci": {"task": "retrieval", "t2i": {"R@1": 50.0}, "i2t": {"R@1": 25.0}}}, [1])
    assert md.splitlines()[:3] == ["| suite | T→I R@1 | I→T R@1 |", "|---|---|---|", "| docci | 50.00 | 25.00 |"]


def test_run_eval_with_tiny_model_writes_manifest(data_root: Path, tmp_path: Path) -> None:
    from sharpclip.models.tiny import tiny_model

    model = tiny_model("clip")
    long = " ".join(["red"] * 100)  # over the 77-token context: counted as truncated
    (data_root / "urban1k" / "Urban1k" / "caption" / "2.txt").write_text(long + "\n")
    cfg = load_config(
        overrides=[
            "eval.suites=[urban1k,aro_relation]",
            f"eval.data_root={data_root}",
            f"eval.output_dir={tmp_path / 'ev'}",
            "eval.progress=false",
            "eval.batch_size=2",
        ]
    )
    paths = run_eval(cfg, model=model)
    report = json.loads(paths[0].read_text())
    assert 0.0 <= report["urban1k"]["t2i"]["R@1"] <= 100.0 and report["urban1k"]["captions"] == 3
    m = json.loads(paths[2].read_text())
    assert m["text"]["context_length"] == 77 and m["text"]["captions_truncated"] == 1
    assert m["text"]["captions_embedded"] == 5  # 3 Urban-1K captions + 2 distinct ARO captions
    assert m["image_preprocessing"]["image_size"] == model.vision_model.config.image_size
    assert len(m["model"]["weights_sha256"]) == 64 and m["model"]["parameters"] > 0
    assert m["image_preprocessing"]["mean"][0] == pytest.approx(0.48145466)
    assert isinstance(ImageRef("x").bbox, type(None))


def test_cli_eval_writes_report(data_root: Path, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    from sharpclip.cli import main

    out = tmp_path / "cli"
    argv = ["eval", "--model", "tiny-clip", "--suite", "urban1k,winoground", "--data-root", str(data_root)]
    assert main([*argv, "--out", str(out), "eval.progress=false"]) == 0
    printed = capsys.readouterr().out
    assert "| urban1k |" in printed and "| winoground | group |" in printed
    assert json.loads((out / "eval_manifest.json").read_text())["model"]["name"] == "tiny-clip"
    assert main(["eval", "--suite", "mmvp", "--data-root", str(tmp_path / "empty")]) == 2
    assert "Questions.csv" in capsys.readouterr().err


def _synthdense(root: Path) -> None:
    """The layout data.synthdense.corpus.generate writes: test.jsonl (generic format), mmvp.jsonl, images/<split>/."""
    rows, mmvp = [], []
    for i, c in enumerate(["red", "green", "blue"]):
        _img(root / "images" / "test" / f"{i}.png", c)
        rows.append({"id": str(i), "image": f"images/test/{i}.png", "caption": f"a {c} square", "group": "f0"})
    for k, (a, b, pattern) in enumerate([("red", "blue", "colour"), ("green", "green", "count")]):
        for half, c in (("a", a), ("b", b)):
            rid = f"mmvp-{k:06d}-{half}"
            _img(root / "images" / "mmvp" / f"{rid}.png", c)
            mmvp.append(
                {
                    "id": rid,
                    "image": f"images/mmvp/{rid}.png",
                    "caption": f"one {c} star",
                    "group": f"mmvp-{k:06d}",
                    "pattern": pattern,
                }
            )
    (root / "test.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    (root / "mmvp.jsonl").write_text("\n".join(json.dumps(r) for r in mmvp) + "\n")


def test_synthdense_suites(tmp_path: Path) -> None:
    _synthdense(tmp_path / "synth")
    cfg = EvalConfig(
        suites=["synthdense", "synth_mmvp"],
        roots={"synthdense": str(tmp_path / "synth"), "synth_mmvp": str(tmp_path / "synth")},
        recall_k=[1],
        progress=False,
    )
    r = run_suite(ColourEmbedder(), cfg).results
    assert r["synthdense"]["t2i"]["R@1"] == 100.0 and r["synthdense"]["captions"] == 3
    # Pair 2 shows two identical images: a tie sends both statements to image b, so the pair fails.
    assert r["synth_mmvp"]["per_pattern"] == {"colour": 100.0, "count": 0.0}
    # "retrieval" evaluates the run's own data section (format, root, eval split).
    data = DataConfig(format="generic", root=str(tmp_path / "synth"), eval_split="test")
    res = run_suite(ColourEmbedder(), EvalConfig(suites=["retrieval"], recall_k=[1], progress=False), data)
    assert res.results["retrieval"]["t2i"]["R@1"] == 100.0 and res.datasets["retrieval"]["root"] == data.root


def test_dci_suite_reads_goal_list_through_per_suite_data_options() -> None:
    from sharpclip.config import ConfigError
    from sharpclip.eval.benchmarks import load_eval_set

    root = Path(__file__).parents[1] / "fixtures" / "data" / "dci"
    official = EvalConfig(suites=["dci"], roots={"dci": str(root)}, progress=False)
    assert load_eval_set("dci", official).captions != ["GOAL DCI caption 1543972", "GOAL DCI caption 1554200"]
    goal = EvalConfig(**{**official.__dict__, "data_options": {"dci": {"list_file": "DCI_test.json"}}})
    es = load_eval_set("dci", goal)
    assert es.captions == ["GOAL DCI caption 1543972", "GOAL DCI caption 1554200"]
    assert [Path(i).name for i in es.images] == ["sa_1543972.jpg", "sa_1554200.jpg"]
    assert run_suite(ColourEmbedder(), goal).results["dci"]["captions"] == 2
    cfg = load_config(overrides=["eval.data_options={dci: {list_file: DCI_test.json}}"])
    assert cfg.eval.data_options == {"dci": {"list_file": "DCI_test.json"}}
    with pytest.raises(ConfigError, match=r"eval\.data_options\.dci\.lst_file"):
        EvalConfig(data_options={"dci": {"lst_file": "DCI_test.json"}})


def test_eval_without_a_data_root_says_eval_data_root_is_empty(capsys: pytest.CaptureFixture) -> None:
    from sharpclip.cli import main

    with pytest.raises(ValueError, match=r"eval\.data_root is empty"):
        run_suite(ColourEmbedder(), EvalConfig(suites=["mmvp"], progress=False))
    assert main(["eval", "--model", "tiny-clip", "--suite", "mmvp", "eval.progress=false"]) == 2
    assert "eval.data_root is empty" in capsys.readouterr().err


def test_suite_lists_with_empty_entries_parse_and_a_bad_name_is_one_line(capsys: pytest.CaptureFixture) -> None:
    from sharpclip.cli import main, suite_names

    assert suite_names("generic,,mmvp") == ["generic", "mmvp"]
    assert suite_names(" docci , urban1k,") == ["docci", "urban1k"]
    assert main(["eval", "--model", "tiny-clip", "--suite", "mmvp,,", "eval.progress=false"]) == 2
    assert "eval.data_root is empty" in capsys.readouterr().err  # parsed: it got as far as the missing data
    assert main(["eval", "--model", "tiny-clip", "--suite", "generic]", "eval.progress=false"]) == 2
    err = capsys.readouterr().err
    assert "'generic]' is not a suite name" in err and err.count("\n") == 1


def test_a_killed_report_rewrite_never_leaves_a_mix_that_looks_complete(tmp_path: Path, monkeypatch) -> None:
    """A kill between the renames of a re-write: no manifest (the set is visibly incomplete), and a rerun completes
    it with a manifest that names the hashes of the two files beside it."""
    import hashlib
    import os
    from pathlib import Path

    from sharpclip import owned_files
    from sharpclip.eval.suite import SuiteResult

    def result(score: float) -> SuiteResult:
        return SuiteResult(results={"x": {"task": "other", "score": score}})

    out = tmp_path / "out"
    write_report(result(1.0), {"model": {"name": "A"}}, out, [1])
    replace = os.replace

    def killed_before_the_markdown(src, dst):
        if Path(dst).name == "eval_report.md":
            raise KeyboardInterrupt  # SIGINT between the report's rename and the markdown's
        replace(src, dst)

    monkeypatch.setattr(owned_files.os, "replace", killed_before_the_markdown)
    with pytest.raises(KeyboardInterrupt):
        write_report(result(2.0), {"model": {"name": "B"}}, out, [1])
    assert not (out / "eval_manifest.json").exists()  # model A's manifest never stands beside model B's numbers
    names = sorted(p.name for p in out.iterdir())  # no temporary left; sharpclip's record of its files beside them
    assert names == [owned_files.REGISTRY, "eval_report.json", "eval_report.md"]
    monkeypatch.undo()
    paths = write_report(result(2.0), {"model": {"name": "B"}}, out, [1])
    manifest = json.loads(paths[2].read_text())
    assert manifest["model"]["name"] == "B" and json.loads(paths[0].read_text())["x"]["score"] == 2.0
    for p in paths[:2]:
        assert manifest["report_sha256"][p.name] == hashlib.sha256(p.read_bytes()).hexdigest()
