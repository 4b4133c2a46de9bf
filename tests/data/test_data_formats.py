"""Each release format read from a fixture with its exact file layout: order, protocol rules, edge cases."""

from __future__ import annotations

import logging

import pytest
from data_helpers import FIXTURES, cfg_for

from sharpclip.data import BadSampleReport, EditSample, read_samples
from sharpclip.data.images import load_image


def ids(samples):
    return [s.id for s in samples]


def test_docci_goal_protocol_puts_qual_test_first_then_test_by_id():
    assert ids(read_samples(cfg_for("docci"), "test")) == ["qual_test_00000", "test_00000", "test_00001"]


def test_docci_test_only_variant_and_train_split():
    assert ids(read_samples(cfg_for("docci", docci_test="test"), "test")) == ["test_00000", "test_00001"]
    train = read_samples(cfg_for("docci"), "train")
    assert ids(train) == ["train_00000", "train_00001"]
    assert train[0].image == FIXTURES / "docci" / "images" / "train_00000.jpg"
    assert train[0].caption.startswith("A close-up of a red mailbox number 0")


def test_docci_unknown_split_names_the_choices():
    with pytest.raises(ValueError, match="qual_dev"):
        read_samples(cfg_for("docci"), "validation")


def test_goal_list_resolves_images_by_base_name_and_keeps_list_order():
    samples = read_samples(cfg_for("docci", list_file="docci_test.json"), "test")
    assert ids(samples) == ["qual_test_00000", "test_00000", "test_00001"]
    assert samples[1].caption == "GOAL caption test_00000"
    assert load_image(samples[1].image).size == (12, 8)


def test_dci_extra_caption_rule_leaves_out_only_empty_strings_as_tulip_and_logs_it(caplog):
    with caplog.at_level(logging.INFO, logger="sharpclip.data"):
        samples = read_samples(cfg_for("dci"), "all")
    # annotations/<unit>-data.json sorted; 105 (sa_1554210) has extra_caption "" and is left out; 102's " \n" is kept,
    # as TULIP's builder (len(extra_caption) == 0) keeps it
    assert ids(samples) == ["sa_1543972", "sa_1543978", "sa_1543980", "sa_1554200"]
    assert samples[1].caption == " \n"
    assert samples[3].caption == "First paragraph.\nSecond paragraph."  # newlines kept (GOAL, TULIP)
    assert samples[3].short_caption == "A short caption 1554200."
    assert "left out 1 records" in caplog.text


def test_dci_real_naming_ids_and_photos_come_from_the_image_field():
    base = FIXTURES / "dci" / "densely_captioned_images"
    assert sorted(p.name for p in (base / "annotations").iterdir())[0] == "101-data.json"
    sample = read_samples(cfg_for("dci"), "train")[0]
    assert sample.id == "sa_1543972" and sample.image == base / "photos" / "sa_1543972.jpg"
    assert sample.source.endswith("complete/101-data.json")


def test_dci_missing_photos_names_photos_not_annotations(tmp_path):
    import shutil

    shutil.copytree(FIXTURES / "dci", tmp_path / "dci")
    shutil.rmtree(tmp_path / "dci" / "densely_captioned_images" / "photos")  # before the SA-1B tar is extracted
    with pytest.raises(FileNotFoundError, match=r"densely_captioned_images/photos: DCI photos/ .*folder not found"):
        read_samples(cfg_for("dci", tmp_path / "dci"), "all")


def test_dci_official_splits_and_caption_modes():
    assert ids(read_samples(cfg_for("dci"), "test")) == ["sa_1543978", "sa_1554200"]
    assert read_samples(cfg_for("dci"), "valid") == []  # its only image has an empty extra_caption
    short = read_samples(cfg_for("dci", dci_caption="short"), "valid")
    assert short[0].caption == "A short caption 1554210."
    both = read_samples(cfg_for("dci", dci_caption="short_extra"), "test")
    assert both[1].caption == "A short caption 1554200.\nFirst paragraph.\nSecond paragraph."


def test_dci_goal_list_with_goal_relative_paths():
    samples = read_samples(cfg_for("dci", list_file="DCI_test.json"), "test")
    assert ids(samples) == ["sa_1543972", "sa_1554200"]
    assert samples[0].image == FIXTURES / "dci" / "densely_captioned_images" / "photos" / "sa_1543972.jpg"


def test_long_dci_rows_as_tulip_builds_them_whitespace_title_kept():
    samples = read_samples(cfg_for("long_dci"), "test")
    # the CSV TULIP's builder writes from the DCI fixture: 4 rows, one of them a quoted " \n" title
    assert ids(samples) == ["sa_1543972", "sa_1543978", "sa_1543980", "sa_1554200"]
    assert samples[1].caption == " \n"
    assert samples[3].caption == "First paragraph.\nSecond paragraph."
    assert all(s.image.is_file() for s in samples)


def test_long_dci_an_empty_title_is_still_a_bad_sample(tmp_path):
    (tmp_path / "dci_long.csv").write_text('filepath\ttitle\nsa_1.jpg\t""\nsa_2.jpg\tA title.\n', encoding="utf-8")
    report = BadSampleReport("skip")
    assert ids(read_samples(cfg_for("long_dci", tmp_path), "test", report)) == ["sa_2"]
    assert [b.reason for b in report.items] == ["empty caption"]


def test_urban1k_numeric_order_and_first_line_only():
    samples = read_samples(cfg_for("urban1k"), "test")
    assert ids(samples) == ["1", "2", "10"]
    assert samples[2].caption == "Urban scene number 10 with a bus."
    assert samples[2].image.name == "10.jpg" and samples[2].image.is_file()


def test_sharegpt4v_first_n_are_test_newlines_replaced_short_is_first_sentence():
    test = read_samples(cfg_for("sharegpt4v", sharegpt4v_test_size=3), "test")
    train = read_samples(cfg_for("sharegpt4v", sharegpt4v_test_size=3), "train")
    assert ids(test) == ["rec0", "rec1", "rec2"] and ids(train) == ["rec3"]
    assert test[1].caption == "The image shows scene 1. It has a newline inside. More text."
    assert test[1].short_caption == "The image shows scene 1"
    assert test[1].image == FIXTURES / "sharegpt4v" / "coco" / "train2017" / "000000000009.jpg"


def test_vg_keeps_first_record_per_image_id_and_url_folder():
    train = read_samples(cfg_for("vg"), "train")
    assert ids(train) == ["2356347", "2400001"]
    assert train[0].caption == "A large building. The sky is blue."
    assert train[1].image == FIXTURES / "vg" / "VG_100K_2" / "2400001.jpg"
    assert ids(read_samples(cfg_for("vg"), "val")) == ["2400002"]
    assert read_samples(cfg_for("vg"), "test") == []


def test_ultraedit_rows_become_edit_samples_across_row_groups():
    samples = read_samples(cfg_for("ultraedit"), "FreeForm_0")
    assert [type(s) for s in samples] == [EditSample] * 3
    assert ids(samples) == ["FreeForm_0/0", "FreeForm_0/1", "FreeForm_0/2"]
    last = samples[2]  # in the second row group
    assert (last.source_caption, last.target_caption) == ("a photo of a cat 2", "a photo of a dog 2")
    assert last.instruction == "turn the cat 2 into a dog"
    assert load_image(last.source_image).size == (12, 8)
    assert load_image(last.edited_image).getpixel((0, 0)) != load_image(last.source_image).getpixel((0, 0))


def test_ultraedit_train_reads_every_shard_including_region_based():
    assert len(read_samples(cfg_for("ultraedit"), "train")) == 5


def test_karpathy_five_captions_train_includes_restval():
    test = read_samples(cfg_for("karpathy"), "test")
    assert ids(test) == ["1002", "1003"]
    assert len(test[0].captions) == 5  # the sixth is dropped: image i owns captions 5i..5i+4
    assert test[0].image == FIXTURES / "karpathy" / "val2014" / "COCO_val2014_000000000002.jpg"
    assert ids(read_samples(cfg_for("karpathy"), "train")) == ["1000", "1001"]


def test_generic_jsonl_csv_and_folder():
    jsonl = read_samples(cfg_for("generic"), "train")
    assert ids(jsonl) == ["a", "b", "c"]
    assert (jsonl[0].short_caption, jsonl[0].group, jsonl[1].group) == ("red", "g1", "g1")
    assert jsonl[2].captions == ["a green circle", "a round green thing"]
    csv_rows = read_samples(cfg_for("generic"), "test")
    assert [s.caption for s in csv_rows] == ["a red square, seen from above", "a blue square"]
    folder = read_samples(cfg_for("generic"), "folder")
    assert [(s.id, s.caption) for s in folder] == [("x", "caption of x"), ("y", "caption of y")]


def test_generic_renamed_columns(tmp_path):
    (tmp_path / "pairs.csv").write_text("path,text\nimg.jpg,hello world\n")
    s = read_samples(cfg_for("generic", tmp_path / "pairs.csv", image_field="path", caption_field="text"), "x")
    assert (s[0].image, s[0].caption) == (tmp_path / "img.jpg", "hello world")


def test_missing_release_folder_says_what_to_check(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"docci_descriptions\.jsonlines.*data\.root"):
        read_samples(cfg_for("docci", tmp_path), "test")


@pytest.mark.parametrize(
    ("fmt", "split", "opened"),
    [
        ("vg", "train", ["train_split.json", "paragraphs_v1.json"]),
        ("ultraedit", "FreeForm_0", ["data/FreeForm_0-00000-of-00001.parquet"]),
        ("generic", "folder", ["folder/x.txt", "folder/y.txt"]),
        ("dci", "all", [f"densely_captioned_images/annotations/{u}-data.json" for u in range(101, 106)]),
    ],
)
def test_readers_record_the_annotation_files_they_open(fmt, split, opened):
    report = BadSampleReport("skip")
    read_samples(cfg_for(fmt), split, report)
    read_samples(cfg_for(fmt), split, report)  # a file read twice is listed once
    assert [p.relative_to(FIXTURES / fmt).as_posix() for p in report.files] == opened
