"""Reading the releases as their reference evaluators do: CLIP's text cleaning, split-bound list files, train/eval
overlap, repeated ids, COCO val2017 and the whole Flickr30k."""

from __future__ import annotations

import json
import logging
import random
import shutil
from pathlib import Path

import pytest
import torch
from data_helpers import FIXTURES, cfg_for

from sharpclip.config import ConfigError
from sharpclip.data import read_samples
from sharpclip.data.formats.goal import list_for_split, split_named_by
from sharpclip.data.overlap import OverlapError, check_overlap, find_overlap, sample_images
from sharpclip.data.text import CLIP_CLEANING, NO_CLEANING, clip_clean
from sharpclip.data.transforms import TextTokenizer
from sharpclip.data.validate import validate
from sharpclip.models.tokenizer import build_word_tokenizer

# ---- text cleaning: open_clip's rule (ftfy.fix_text, html.unescape twice, " ".join(text.split())), hand-derived ----

CLEANED = [  # raw caption -> what open_clip's basic_clean + whitespace_clean give (before its lowercasing)
    ("The encoder’s output", "The encoder's output"),
    ("“quoted” and ‘single’", "\"quoted\" and 'single'"),
    ("cats &amp; dogs", "cats & dogs"),
    ("cats &amp;amp; dogs", "cats & dogs"),  # unescaped twice
    ("a  red\tcube\n\non   grass ", "a red cube on grass"),
    ("ﬁne print", "fine print"),  # ligature split by ftfy
    ("plain ascii, no change.", "plain ascii, no change."),
]


@pytest.mark.parametrize(("raw", "expected"), CLEANED)
def test_clip_clean_matches_open_clips_rule(raw: str, expected: str) -> None:
    assert clip_clean(raw) == expected


def test_token_ids_equal_open_clips_on_typographic_quotes_and_html_entities() -> None:
    tok = build_word_tokenizer(["the encoder's output", "cats & dogs", "quoted"])
    tokenize = TextTokenizer(tok, 16, pad_to_context=True)  # full padding, to compare with max_length below
    raw = ["The encoder’s output", "cats &amp;amp; dogs", "“quoted”"]
    expected = ["the encoder's output", "cats & dogs", '"quoted"']  # open_clip's cleaned and lowercased text
    ids, mask = tokenize(raw)
    want = tok(expected, padding="max_length", max_length=16, return_tensors="pt")
    assert torch.equal(ids, want["input_ids"]) and torch.equal(mask, want["attention_mask"])
    plain = tok(raw, padding="max_length", max_length=16, return_tensors="pt")["input_ids"]
    assert not torch.equal(plain, want["input_ids"])  # transformers' CLIPTokenizer alone tokenises them differently
    assert tokenize.cleaning == CLIP_CLEANING and tokenize.lengths(raw) == [
        int(m.sum()) for m in want["attention_mask"]
    ]


def test_siglip_tokenizers_are_not_cleaned() -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import GemmaTokenizer, PreTrainedTokenizerFast, SiglipTokenizer

    from sharpclip.data.text import uses_clip_cleaning
    from sharpclip.models.tiny import tiny_model

    backend = Tokenizer(models.WordLevel({"<unk>": 0, "<eos>": 1, "cats": 2, "&amp;": 3}, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    other = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>", eos_token="<eos>", pad_token="<eos>")
    plain = TextTokenizer(other, 4)
    assert plain.clean is None and plain.cleaning == NO_CLEANING
    assert plain(["cats &amp;"])[0][0, :2].tolist() == [2, 3]  # left as written
    assert not any(uses_clip_cleaning(cls.__new__(cls)) for cls in (SiglipTokenizer, GemmaTokenizer))
    assert TextTokenizer(tiny_model("clip").tokenizer, 16).cleaning == CLIP_CLEANING


def test_clip_clean_fast_path_equals_the_full_rule_on_random_text() -> None:
    import html

    import ftfy

    rng = random.Random(0)
    alphabet = "ab &;#x\t\n\r\x0b\x0c\x1f\x7f’“é ﬁ<>"
    for _ in range(400):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randrange(12)))
        assert clip_clean(text) == " ".join(html.unescape(html.unescape(ftfy.fix_text(text))).split())


# ---- list files apply to the split they name ----


def test_list_file_name_says_its_split() -> None:
    assert split_named_by("DCI_test.json") == "test" and split_named_by("DCI_train_del_org.json") == "train"
    assert split_named_by("urban_dataset_test.json") == "test" and split_named_by("contest.json") is None


def test_list_file_replaces_only_the_split_it_names() -> None:
    goal = cfg_for("dci", list_file="DCI_test.json")
    assert [s.caption for s in read_samples(goal, "test")] == ["GOAL DCI caption 1543972", "GOAL DCI caption 1554200"]
    train = read_samples(goal, "train")  # the official train split, not the list again
    assert [s.id for s in train] == ["sa_1543972", "sa_1543980"] and train[0].caption.startswith("A long")


def test_list_without_a_split_in_its_name_needs_list_split(tmp_path: Path) -> None:
    root = Path(shutil.copytree(FIXTURES / "dci", tmp_path / "dci"))
    shutil.copy(root / "DCI_test.json", root / "goal_list.json")
    with pytest.raises(ConfigError, match=r"data\.list_file='goal_list\.json'.*data\.list_split"):
        read_samples(cfg_for("dci", root, list_file="goal_list.json"), "test")
    assert len(read_samples(cfg_for("dci", root, list_file="goal_list.json", list_split="test"), "test")) == 2
    both = cfg_for("dci", root, list_files={"train": "DCI_train_del_org.json", "test": "DCI_test.json"})
    assert [s.id for s in read_samples(both, "train")] == ["sa_1543978", "sa_1543980"]
    assert list_for_split(both, "valid") == ""


# ---- train / evaluation overlap ----


def test_overlap_counts_the_same_file_and_a_byte_equal_copy_not_a_namesake(tmp_path: Path) -> None:
    photos = FIXTURES / "dci" / "densely_captioned_images" / "photos"
    copy = tmp_path / "copy"
    copy.mkdir()
    shutil.copy(photos / "sa_1543972.jpg", copy / "sa_1543972.jpg")  # Long-DCI with its own copy of the photos
    shutil.copy(photos / "sa_1543978.jpg", copy / "sa_1543980.jpg")  # same name as a train photo, other bytes
    train = [photos / "sa_1543972.jpg", photos / "sa_1543980.jpg"]
    found = find_overlap(train, [photos / "sa_1543972.jpg", copy / "sa_1543972.jpg", copy / "sa_1543980.jpg"])
    assert found.count == 2 and found.examples == ["sa_1543972.jpg", "sa_1543972.jpg"]


def test_goal_test_list_after_official_train_split_refuses_or_warns(caplog) -> None:
    cfg = cfg_for("dci", list_file="DCI_test.json")
    train, held_out = sample_images(read_samples(cfg, "train")), sample_images(read_samples(cfg, "test"))
    with pytest.raises(OverlapError, match=r"1 of its 2 images are also training images \(e\.g\. sa_1543972\.jpg\)"):
        check_overlap(train, held_out, "validation split 'test'")
    with caplog.at_level(logging.WARNING, logger="sharpclip.data"):
        assert check_overlap(train, held_out, "validation split 'test'", "warn").count == 1
    assert "1 of its 2 images" in caplog.text
    goal_train = sample_images(read_samples(cfg_for("dci", list_file="DCI_train_del_org.json"), "train"))
    assert find_overlap(goal_train, held_out).count == 0  # GOAL's own train and test lists are disjoint


def test_a_training_run_whose_validation_shares_images_refuses_to_start(tmp_path: Path) -> None:
    from sharpclip.config import load_config
    from sharpclip.train.run import build_trainer

    base = [
        "model.name=tiny-clip",
        "data.format=dci",
        f"data.root={FIXTURES / 'dci'}",
        "train.batch_size=2",
        "train.micro_batch_size=2",
        f"train.output_dir={tmp_path / 'run'}",
        "train.progress=false",
        "data.num_workers=0",
    ]
    with pytest.raises(OverlapError, match=r"validation split 'test'.*1 of its 2 images"):
        build_trainer(load_config(overrides=[*base, "data.list_files={test: DCI_test.json}"]))
    assert build_trainer(load_config(overrides=base)) is not None  # official train vs official test: disjoint
    build_trainer(load_config(overrides=[*base, "data.list_files={test: DCI_test.json}", "data.overlap=warn"]))
    goal = "data.list_files={train: DCI_train_del_org.json, test: DCI_test.json}"  # GOAL's protocol end to end
    assert build_trainer(load_config(overrides=[*base, goal])) is not None


# ---- repeated ids: reported, never merged ----


def test_validate_data_reports_repeated_ids_pointing_at_different_images(tmp_path: Path) -> None:
    root = Path(shutil.copytree(FIXTURES / "sharegpt4v", tmp_path / "s"))
    path = root / "share-captioner_coco_lcs_sam_1246k_1107.json"
    records = json.loads(path.read_text())
    records[1]["id"] = records[0]["id"]  # two records, one id, two different images
    path.write_text(json.dumps(records))
    rep = validate(cfg_for("sharegpt4v", root, sharegpt4v_test_size=3), "test")
    assert rep.samples == 3 and rep.repeated_ids == 2 and rep.repeated_ids_different_images == 2
    assert rep.repeated_id_examples == ["rec0 (2 records)"] and "repeated ids: 2 records" in rep.summary()
    assert validate(cfg_for("sharegpt4v", sharegpt4v_test_size=3), "test").repeated_ids == 0


# ---- COCO val2017 and the whole Flickr30k (Long-CLIP / TULIP) ----


def test_coco_val2017_protocol_images_by_id_first_five_captions_in_file_order() -> None:
    samples = read_samples(cfg_for("karpathy", FIXTURES / "coco", coco_flickr_protocol="longclip"), "test")
    assert [s.id for s in samples] == ["139", "285", "632"]  # the file lists 632 first: torchvision sorts ids
    assert samples[1].captions == [f"image 285 caption {k}" for k in range(5)]  # the sixth is dropped
    assert samples[0].image == FIXTURES / "coco" / "val2017" / "000000000139.jpg" and samples[0].image.is_file()


def test_flickr30k_whole_set_protocol_every_line_grouped_per_image() -> None:
    samples = read_samples(cfg_for("karpathy", FIXTURES / "flickr30k", coco_flickr_protocol="longclip"), "test")
    assert [s.id for s in samples] == ["1000092795", "10002456", "1000268201"]  # file order, as Long-CLIP
    assert samples[0].captions == [f"1000092795 caption {k} ." for k in range(5)]
    assert samples[2].image == FIXTURES / "flickr30k" / "flickr30k-images" / "1000268201.jpg"
    with pytest.raises(FileNotFoundError, match=r"captions_val2017\.json"):
        read_samples(cfg_for("karpathy", coco_flickr_protocol="longclip"), "test")  # a Karpathy-only folder
