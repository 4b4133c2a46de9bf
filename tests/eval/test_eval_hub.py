"""Benchmarks in their Hugging Face hub layouts (local downloads), and `sharpclip eval --model RUN_DIR`."""

from __future__ import annotations

import io
import json
import zipfile
from pathlib import Path

import pytest
import torch
from PIL import Image

from sharpclip.config import DataConfig, EvalConfig
from sharpclip.data import read_samples
from sharpclip.data.images import load_image as load_source
from sharpclip.eval.benchmarks import load_eval_set
from sharpclip.eval.suite import run_suite

pq = pytest.importorskip("pyarrow.parquet")
pa = pytest.importorskip("pyarrow")
RGB = {"red": (255, 0, 0), "green": (0, 255, 0), "blue": (0, 0, 255)}


def _jpeg(colour: str) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (12, 12), RGB[colour]).save(buf, "JPEG")
    return buf.getvalue()


class ColourEmbedder:
    """Images -> mean RGB; captions -> the colour words they name (as tests/eval/test_eval_suite.py's)."""

    def images(self, refs):
        from sharpclip.eval.embed import _load

        rgb = [torch.tensor(list(_load(r).resize((1, 1)).getpixel((0, 0))), dtype=torch.float) for r in refs]
        return torch.nn.functional.normalize(torch.stack(rgb) + 1e-3, dim=1)

    def texts(self, captions):
        vecs = [sum((torch.tensor(RGB[w], dtype=torch.float) for w in c.split() if w in RGB), torch.full((3,), 1e-3))
                for c in captions]  # fmt: skip
        return torch.nn.functional.normalize(torch.stack(vecs), dim=1)


def sugarcrepe_repo(root: Path, subset: str, rows: list[tuple[str, str, str]]) -> Path:
    """HuggingFaceM4/SugarCrepe_<subset>: data/test-00000-of-00001-<hash>.parquet (image, tested_labels, true_label)."""
    repo = root / f"SugarCrepe_{subset}"
    (repo / "data").mkdir(parents=True)
    (repo / "README.md").write_text("---\ndataset_info:\n  features:\n  - name: image\n    dtype: image\n---\n")
    image_type = pa.struct([("bytes", pa.binary()), ("path", pa.string())])
    table = pa.table({
        "image": pa.array([{"bytes": _jpeg(c), "path": f"0000{i}.jpg"} for i, (c, _, _) in enumerate(rows)],
                          type=image_type),
        "tested_labels": [[pos, neg] for _, pos, neg in rows],
        "true_label": list(range(len(rows))),
    })  # fmt: skip
    pq.write_table(table, repo / "data" / "test-00000-of-00001-854ea511c026ba8f.parquet")
    return repo


def test_sugarcrepe_hub_parquet_scores_positive_against_negative(tmp_path):
    sugarcrepe_repo(tmp_path, "replace_att", [("red", "a red car", "a blue car"), ("blue", "a red sky", "a blue sky")])
    sugarcrepe_repo(tmp_path, "swap_obj", [("green", "a green cup", "a red cup")])
    cs = load_eval_set("sugarcrepe", EvalConfig(suites=["sugarcrepe"], roots={"sugarcrepe": str(tmp_path)}))
    assert cs.groups == ["replace_att", "replace_att", "swap_obj"] and cs.texts[0] == ["a red car", "a blue car"]
    assert load_source(cs.images[2][0]).getpixel((3, 3))[1] > 200  # the embedded COCO picture, decoded lazily
    result = run_suite(ColourEmbedder(), EvalConfig(suites=["sugarcrepe"], roots={"sugarcrepe": str(tmp_path)}))
    assert result.results["sugarcrepe"]["per_subset"] == {"replace_att": 50.0, "swap_obj": 100.0}


def test_hub_cache_folders_resolve_to_their_snapshot(tmp_path):
    cache = tmp_path / "datasets--HuggingFaceM4--SugarCrepe_add_att"
    snapshot = cache / "snapshots" / "a75d095"
    sugarcrepe_repo(snapshot.parent, "x", [("red", "a red cup", "a blue cup")]).rename(snapshot)
    cs = load_eval_set("sugarcrepe", EvalConfig(suites=["sugarcrepe"], roots={"sugarcrepe": str(tmp_path)}))
    assert cs.groups == ["add_att"]


def test_mmvp_hub_repository_reads_as_downloaded(tmp_path):
    """MMVP/MMVP_VLM: Questions.csv + 'MLLM_VLM Images/<Type>/<qid>.jpg' beside README.md and .gitattributes."""
    repo = tmp_path / "datasets--MMVP--MMVP_VLM" / "snapshots" / "adc8dc8"
    for qid, colour in [(1, "red"), (2, "blue")]:
        (repo / "MLLM_VLM Images" / "Orientation").mkdir(parents=True, exist_ok=True)
        (repo / "MLLM_VLM Images" / "Orientation" / f"{qid}.jpg").write_bytes(_jpeg(colour))
    (repo / "Questions.csv").write_text("Question ID,Type,Statement\n1,Orientation,red\n2,Orientation,blue\n")
    (repo / "README.md").write_text("---\nlicense: mit\n---\n")
    (repo / ".gitattributes").write_text("*.jpg filter=lfs\n")
    cfg = EvalConfig(suites=["mmvp"], roots={"mmvp": str(tmp_path / "datasets--MMVP--MMVP_VLM")})
    result = run_suite(ColourEmbedder(), cfg)
    assert result.results["mmvp"]["pairs"] == 1 and result.results["mmvp"]["mean"] == 100.0


def test_urban1k_hub_zip_is_read_without_extracting(tmp_path):
    """BeichenZhang/Urban1k holds one Urban1k.zip with Urban1k/image/N.jpg and Urban1k/caption/N.txt."""
    with zipfile.ZipFile(tmp_path / "Urban1k.zip", "w") as z:
        for n, colour in [(10, "green"), (2, "red"), (1, "blue")]:
            z.writestr(f"Urban1k/image/{n}.jpg", _jpeg(colour))
            z.writestr(f"Urban1k/caption/{n}.txt", f"a {colour} street\nsecond line\n")
    samples = read_samples(DataConfig(format="urban1k", root=str(tmp_path)), "test")
    assert [s.id for s in samples] == ["1", "2", "10"] and samples[0].caption == "a blue street"
    assert load_source(samples[1].image).getpixel((5, 5))[0] > 200
    result = run_suite(ColourEmbedder(), EvalConfig(suites=["urban1k"], roots={"urban1k": str(tmp_path)}))
    assert result.results["urban1k"]["t2i"]["R@1"] == 100.0


def test_docci_hub_csvs_with_extracted_images(tmp_path):
    """google/docci: train.csv, test.csv, qual_dev.csv, qual_test.csv beside images.tar.gz (extracted to images/)."""
    (tmp_path / "images").mkdir()
    for split, ids in [("test", ["test_00001", "test_00000"]), ("qual_test", ["qual_test_00000"])]:
        rows = ["example_id,split,image_file,description"] + [f"{i},{split},{i}.jpg,A red thing {i}." for i in ids]
        (tmp_path / f"{split}.csv").write_text("\n".join(rows) + "\n")
        for i in ids:
            (tmp_path / "images" / f"{i}.jpg").write_bytes(_jpeg("red"))
    (tmp_path / "images.tar.gz").write_bytes(b"")
    samples = read_samples(DataConfig(format="docci", root=str(tmp_path)), "test")
    assert [s.id for s in samples] == ["qual_test_00000", "test_00000", "test_00001"]  # GOAL's 5,100 protocol order
    assert samples[1].image == tmp_path / "images" / "test_00000.jpg"
    (tmp_path / "test.csv").write_text("id,caption\nx,y\n")
    with pytest.raises(ValueError, match="expected columns example_id, image_file, description"):
        read_samples(DataConfig(format="docci", root=str(tmp_path), docci_test="test"), "test")


def test_eval_of_a_run_directory_uses_its_newest_or_best_checkpoint(tmp_path, capsys):
    from sharpclip.cli import main
    from sharpclip.config import ModelConfig
    from sharpclip.models import create_model, save_checkpoint
    from sharpclip.train import checkpoint

    run = tmp_path / "run"
    cfg = ModelConfig(name="tiny-clip")
    for step in (2, 4):
        model = create_model(cfg)
        checkpoint.save(run / "checkpoints", step, lambda d, m=model: save_checkpoint(m, d, cfg), {}, {"step": step})
    checkpoint.mark_best(run / "checkpoints", run / "checkpoints" / "step-000002", 0.5)
    with zipfile.ZipFile(tmp_path / "Urban1k.zip", "w") as z:
        for n, colour in [(1, "red"), (2, "blue")]:
            z.writestr(f"Urban1k/image/{n}.jpg", _jpeg(colour))
            z.writestr(f"Urban1k/caption/{n}.txt", f"a {colour} thing\n")
    argv = ["eval", "--model", str(run), "--suite", "urban1k", f"eval.roots.urban1k={tmp_path}", "eval.progress=false"]
    assert main(argv) == 0
    manifest = json.loads((run / "eval" / "step-000004" / "eval_manifest.json").read_text())
    assert manifest["model"]["name"].endswith("checkpoints/step-000004")
    assert main([*argv, "--best"]) == 0  # its own folder: the newest checkpoint's report stays
    assert json.loads((run / "eval" / "step-000002" / "eval_manifest.json").read_text())["model"]["name"].endswith(
        "step-000002"
    )
    assert json.loads((run / "eval" / "step-000004" / "eval_manifest.json").read_text()) == manifest
    assert main(["eval", "--model", "tiny-clip", "--best", "--suite", "urban1k"]) == 2
    assert "--best picks a checkpoint of a run directory" in capsys.readouterr().err


def generic_pairs(root: Path, split: str = "val") -> Path:
    """A generic-format folder: `<split>.jsonl` with two image-caption pairs and their images."""
    root.mkdir(parents=True, exist_ok=True)
    rows = []
    for i, colour in enumerate(["red", "blue"]):
        (root / f"{i}.jpg").write_bytes(_jpeg(colour))
        rows.append({"image": f"{i}.jpg", "caption": f"picture number {i}"})
    (root / f"{split}.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return root


def test_eval_of_a_run_directory_reads_the_runs_own_data_config(tmp_path):
    from sharpclip.cli import main
    from sharpclip.config import ModelConfig, load_config, to_yaml
    from sharpclip.models import create_model, save_checkpoint
    from sharpclip.train import checkpoint

    data = generic_pairs(tmp_path / "data")
    run = tmp_path / "run"
    cfg = ModelConfig(name="tiny-clip")
    model = create_model(cfg)
    checkpoint.save(run / "checkpoints", 3, lambda d: save_checkpoint(model, d, cfg), {}, {"step": 3})
    resolved = load_config(None, ["data.format=generic", f"data.root={data}", "data.eval_split=val"])
    (run / "config.yaml").write_text(to_yaml(resolved))  # what run_train writes
    assert main(["eval", "--model", str(run), "--suite", "retrieval", "eval.progress=false"]) == 0
    report = json.loads((run / "eval" / "step-000003" / "eval_report.json").read_text())
    assert report["retrieval"]["images"] == 2
