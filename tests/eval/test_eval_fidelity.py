"""Evaluation as the reference evaluators score the real releases: Winoground's hub layout and its RGBA images,
no merging of records, SugarCrepe per family, COCO/Flickr protocols, skip policy per suite, token masks, the DCI
recipe's protocol and the refusal to score training images."""

from __future__ import annotations

import json
import shutil
import zipfile
from pathlib import Path

import numpy as np
import pytest
import torch

from sharpclip.config import EvalConfig, load_config
from sharpclip.data.images import to_rgb
from sharpclip.data.overlap import OverlapError
from sharpclip.data.transforms import ClipImageTransform
from sharpclip.eval.benchmarks import load_eval_set
from sharpclip.eval.embed import ImageRef, load_image
from sharpclip.eval.pair_data import read_winoground
from sharpclip.eval.pairs import sugarcrepe_report
from sharpclip.eval.suite import run_eval, run_suite

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "data"
CONFIGS = Path(__file__).resolve().parents[2] / "configs"
COLOURS = {"red": (255, 0, 0), "green": (0, 255, 0), "blue": (0, 0, 255)}


class MeanColourEmbedder:
    """Images -> mean RGB after the alpha policy; captions -> the colour they name."""

    def __init__(self, alpha: str = "drop") -> None:
        self.alpha = alpha

    def images(self, refs):
        rgb = [np.asarray(to_rgb(load_image(r), self.alpha), dtype=np.float32).reshape(-1, 3).mean(0) for r in refs]
        return torch.nn.functional.normalize(torch.tensor(np.stack(rgb)) + 1e-3, dim=1)

    def texts(self, captions):
        vecs = [
            torch.tensor(COLOURS.get((c.split() or [""])[-1], (1, 1, 1)), dtype=torch.float) + 1e-3 for c in captions
        ]
        return torch.nn.functional.normalize(torch.stack(vecs), dim=1)


# ---- Winoground as released on the HF hub ----


def test_winoground_reads_the_hub_snapshot_with_the_zip_in_place() -> None:
    cs = read_winoground(FIXTURES / "winoground")
    assert cs.texts == [["red", "green"], ["blue", "red"]]
    assert cs.images[0][0] == ImageRef(
        str(FIXTURES / "winoground" / "data" / "images.zip"), member="images/ex_0_img_0.png"
    )
    assert [f.name for f in cs.files] == ["examples.jsonl", "images.zip"]
    rgba = load_image(cs.images[0][0])
    assert rgba.mode == "RGBA" and to_rgb(rgba).getpixel((6, 4)) == (0, 255, 0)  # the colour under alpha 0


def test_winoground_reads_the_extracted_zip_and_the_flat_layout(tmp_path: Path) -> None:
    hub = Path(shutil.copytree(FIXTURES / "winoground", tmp_path / "hub"))
    with zipfile.ZipFile(hub / "data" / "images.zip") as z:
        z.extractall(hub / "data")  # data/images/<stem>.png
    (hub / "data" / "images.zip").unlink()
    extracted = read_winoground(hub)
    assert extracted.images[1][1] == ImageRef(str(hub / "data" / "images" / "ex_1_img_1.png"))
    flat = Path(shutil.move(hub / "data", tmp_path / "flat"))  # examples.jsonl + images/ at the root
    assert read_winoground(flat).texts == extracted.texts
    with pytest.raises(FileNotFoundError, match=r"Winoground: examples\.jsonl not found"):
        read_winoground(tmp_path)


def test_winoground_scores_depend_on_the_alpha_policy_and_default_to_convert_rgb() -> None:
    cfg = EvalConfig(suites=["winoground"], roots={"winoground": str(FIXTURES / "winoground")}, progress=False)
    dropped = run_suite(MeanColourEmbedder("drop"), cfg).results["winoground"]
    white = run_suite(MeanColourEmbedder("white"), cfg).results["winoground"]
    # ex 0, image 0: half red, half transparent green. Dropped alpha: red and green tie (text wrong); on white
    # it is pinkish and "red" wins (text right). ex 1 is right either way.
    assert (dropped["text"], white["text"]) == (50.0, 100.0)
    assert dropped["examples"] == 2 and dropped["skipped"] == 0


# ---- no merging of records ----


def test_two_records_sharing_an_id_stay_two_gallery_items(tmp_path: Path) -> None:
    root = Path(shutil.copytree(FIXTURES / "sharegpt4v", tmp_path / "s"))
    path = root / "share-captioner_coco_lcs_sam_1246k_1107.json"
    records = json.loads(path.read_text())
    records[1]["id"] = records[0]["id"]
    path.write_text(json.dumps(records))
    cfg = EvalConfig(suites=["sharegpt4v"], roots={"sharegpt4v": str(root)}, progress=False)
    cfg.data_options = {"sharegpt4v": {"sharegpt4v_test_size": 3}}
    es = load_eval_set("sharegpt4v", cfg)
    assert (len(es.images), len(es.captions), es.caption_to_image) == (3, 3, [0, 1, 2])  # Long-CLIP scores 3 x 3


def test_karpathy_keeps_five_captions_per_image() -> None:
    es = load_eval_set("karpathy", EvalConfig(roots={"karpathy": str(FIXTURES / "karpathy")}))
    assert es.caption_to_image == [0] * 5 + [1] * 5


# ---- COCO / Flickr protocols ----


@pytest.mark.parametrize(
    ("suite", "protocol", "shape"),
    [("coco", "longclip", (3, 15)), ("flickr30k", "longclip", (3, 15)), ("coco", "karpathy", None)],
)
def test_coco_and_flickr_suites_offer_both_protocols(suite: str, protocol: str, shape) -> None:
    cfg = EvalConfig(roots={suite: str(FIXTURES / suite)}, data_options={suite: {"coco_flickr_protocol": protocol}})
    if shape is None:  # the default, Karpathy's split JSON: the val2017 release folder has none
        with pytest.raises(FileNotFoundError, match=r"dataset_coco\.json"):
            load_eval_set(suite, cfg)
        return
    es = load_eval_set(suite, cfg)
    assert (len(es.images), len(es.captions)) == shape and es.caption_to_image[:6] == [0] * 5 + [1]


# ---- SugarCrepe as the paper reports it ----


def test_sugarcrepe_per_subset_per_family_and_the_mean_of_subsets_named_so() -> None:
    per = {"add_att": 80.0, "add_obj": 90.0, "replace_att": 70.0, "replace_obj": 95.0, "replace_rel": 60.0}
    per |= {"swap_att": 50.0, "swap_obj": 40.0}
    out = sugarcrepe_report(per)
    assert out["per_subset"] == per
    assert out["per_family"] == {"replace": pytest.approx(75.0), "swap": 45.0, "add": 85.0}
    assert out["mean_of_subsets"] == pytest.approx(485 / 7) and "mean" not in out


# ---- bad samples per suite: error by default, skip and count by option ----


def _broken_long_dci(tmp_path: Path) -> Path:
    root = Path(shutil.copytree(FIXTURES / "long_dci", tmp_path / "long_dci"))
    (root / "photos" / "sa_1543980.jpg").unlink()  # a missing image
    with open(root / "dci_long.csv", "a", encoding="utf-8") as f:
        f.write('sa_9.jpg\t""\n')  # an empty title
    return root


def test_a_bad_record_aborts_under_error_and_is_skipped_and_counted_under_skip(tmp_path: Path) -> None:
    root = _broken_long_dci(tmp_path)
    strict = EvalConfig(suites=["long_dci"], roots={"long_dci": str(root)}, progress=False)
    with pytest.raises(ValueError, match=r"empty caption\. .*eval\.data_options\.long_dci\.on_bad_sample=skip"):
        run_suite(MeanColourEmbedder(), strict)
    lenient = EvalConfig(**{**strict.__dict__, "data_options": {"long_dci": {"on_bad_sample": "skip"}}})
    res = run_suite(MeanColourEmbedder(), lenient)
    assert res.results["long_dci"]["images"] == 3 and res.results["long_dci"]["skipped"] == 2
    record = res.datasets["long_dci"]["skipped"]
    assert record["count"] == 2 and any("sa_1543980.jpg" in s for s in record["samples"])


def test_winoground_skip_policy_leaves_out_an_example_with_a_missing_image(tmp_path: Path) -> None:
    root = Path(shutil.copytree(FIXTURES / "winoground", tmp_path / "w"))
    with open(root / "data" / "examples.jsonl", "a", encoding="utf-8") as f:
        f.write(json.dumps({"id": 2, "image_0": "nope", "image_1": "ex_1_img_1", "caption_0": "a", "caption_1": "b"}))
    cfg = EvalConfig(suites=["winoground"], roots={"winoground": str(root)}, progress=False)
    with pytest.raises(ValueError, match=r"examples\.jsonl:3: record 2: missing file"):
        run_suite(MeanColourEmbedder(), cfg)
    cfg.data_options = {"winoground": {"on_bad_sample": "skip"}}
    r = run_suite(MeanColourEmbedder(), cfg).results["winoground"]
    assert (r["examples"], r["skipped"]) == (2, 1)


# ---- token masks without an attention mask ----


def test_token_mask_uses_the_tokenizers_end_of_text_not_the_legacy_config_id() -> None:
    from sharpclip.data.transforms import TextTokenizer
    from sharpclip.models.tiny import tiny_model

    model = tiny_model("clip")
    model.text_model.config.eos_token_id = 2  # openai/clip-vit-large-patch14's config.json
    ids, mask = TextTokenizer(model.tokenizer, 12)(["red square", "a blue circle on grass"])
    with torch.no_grad():
        out = model.encode_text(ids, tokens=True)
    assert torch.equal(out.token_mask, mask.bool())  # real tokens up to and including the first end-of-text
    model.tokenizer = None  # no tokenizer: the legacy id 2 means "the last vocabulary id", as OpenAI's eot
    with torch.no_grad():
        assert torch.equal(model.encode_text(ids, tokens=True).token_mask, mask.bool())


# ---- what the manifest records ----


def test_manifest_records_alpha_policy_and_text_cleaning(tmp_path: Path) -> None:
    from sharpclip.models.tiny import tiny_model

    cfg = load_config(
        overrides=[
            "eval.suites=[winoground]",
            f"eval.roots={{winoground: {FIXTURES / 'winoground'}}}",
            f"eval.output_dir={tmp_path}",
            "eval.progress=false",
            "eval.image_alpha=white",
        ]
    )
    paths = run_eval(cfg, model=tiny_model("clip"))
    manifest = json.loads(paths[2].read_text())
    assert manifest["image_preprocessing"]["alpha"].startswith("white")
    assert manifest["text"]["cleaning"].startswith("clip: ftfy.fix_text")
    assert manifest["datasets"]["winoground"]["skipped"]["count"] == 0
    assert ClipImageTransform(8).alpha == "drop"


# ---- the DCI recipe: one protocol end to end, and no scoring of training images ----


def test_dci_recipe_trains_and_validates_on_disjoint_official_splits_and_says_so() -> None:
    from sharpclip.data import read_samples
    from sharpclip.data.overlap import find_overlap, sample_images

    header = (CONFIGS / "hnclip_dci.yaml").read_text().split("\nmodel:")[0]
    assert "comparable" in header and "112" in header and "GOAL" in header and "long_dci" in header
    cfg = load_config([CONFIGS / "hnclip_dci.yaml"], [f"data.root={FIXTURES / 'dci'}"])
    train = sample_images(read_samples(cfg.data, cfg.data.train_split))
    held_out = sample_images(read_samples(cfg.data, cfg.data.eval_split))
    assert train and held_out and find_overlap(train, held_out).count == 0
    assert "long_dci" not in cfg.eval.suites


def test_eval_after_dci_training_refuses_long_dci_unless_warned(tmp_path: Path) -> None:
    base = [
        "model.name=tiny-clip",
        f"data.root={FIXTURES / 'dci'}",
        f"eval.roots={{long_dci: {FIXTURES / 'long_dci'}, dci: {FIXTURES / 'dci'}}}",
        f"eval.output_dir={tmp_path}",
        "eval.progress=false",
    ]
    cfg = load_config([CONFIGS / "hnclip_dci.yaml"], [*base, "eval.suites=[dci,long_dci]"])
    cfg.model.context_length = None
    with pytest.raises(OverlapError, match=r"eval suite 'long_dci': 2 of its 4 images are also training images"):
        run_eval(cfg)
    assert not (tmp_path / "eval_report.json").exists()  # refused before anything was scored
    cfg.data.overlap = "warn"
    report = json.loads(run_eval(cfg)[0].read_text())
    assert report["long_dci"]["images"] == 4 and report["dci"]["images"] == 2


def test_eval_of_a_runs_checkpoint_finds_the_runs_training_data(tmp_path: Path) -> None:
    from sharpclip.config import to_yaml
    from sharpclip.eval.suite import training_data

    run = load_config([CONFIGS / "hnclip_dci.yaml"], [f"data.root={FIXTURES / 'dci'}"])
    (tmp_path / "run" / "checkpoints" / "step-000010").mkdir(parents=True)
    (tmp_path / "run" / "config.yaml").write_text(to_yaml(run))
    cfg = load_config(overrides=[f"model.name={tmp_path / 'run' / 'checkpoints' / 'step-000010'}"])
    assert training_data(cfg).format == "dci" and training_data(cfg).root == str(FIXTURES / "dci")
    assert training_data(load_config(overrides=["model.name=tiny-clip"])).root == ""  # not a run's checkpoint
