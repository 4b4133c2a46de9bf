"""Data faults: non-UTF-8 captions are bad samples with file:line; 16-bit, 32-bit and
float images are scaled to 8 bits, not clipped white; images above data.max_image_pixels are bad samples; a batch
whose every sample is bad is skipped and counted, and shrunken batches are logged."""

from __future__ import annotations

import itertools
import json
import logging

import numpy as np
import pytest
from data_helpers import prep
from PIL import Image

from sharpclip.config import PIL_MAX_IMAGE_PIXELS, DataConfig
from sharpclip.data import BadSampleError, build_loader, read_samples
from sharpclip.data.images import load_image
from sharpclip.data.validate import validate
from sharpclip.models.tokenizer import build_word_tokenizer

TOK = build_word_tokenizer(["a red square café photo"])


def _png(path, size=(8, 8)):
    Image.fromarray(np.full((size[1], size[0], 3), 120, dtype=np.uint8)).save(path)
    return path


def _generic(root, lines: list[bytes], suffix=".jsonl"):
    root.mkdir(parents=True, exist_ok=True)
    for i in range(4):
        _png(root / f"{i}.png")
    (root / f"train{suffix}").write_bytes(b"".join(lines))
    return DataConfig(format="generic", root=str(root), on_bad_sample="skip", num_workers=0)


def _jsonl(i: int, caption: str = "a red square") -> bytes:
    return (json.dumps({"id": f"r{i}", "image": f"{i}.png", "caption": caption}) + "\n").encode()


def test_a_non_utf8_jsonl_line_is_a_bad_sample_with_file_and_line(tmp_path):
    latin1 = '{"id": "r1", "image": "1.png", "caption": "a red café"}\n'.encode("latin-1")
    cfg = _generic(tmp_path / "d", [_jsonl(0), latin1, _jsonl(2)])
    report = validate(cfg, "train")
    assert report.samples == 2 and not report.ok
    assert any("train.jsonl:2" in e and "not valid UTF-8 (byte 0xe9" in e for e in report.errors), report.errors
    with pytest.raises(BadSampleError, match=r"train.jsonl:2: .*not valid UTF-8"):
        read_samples(DataConfig(format="generic", root=cfg.root), "train")


def test_a_latin1_csv_row_is_a_bad_sample_and_the_other_rows_are_read(tmp_path):
    rows = [b"id,image,caption\n", b"r0,0.png,a red square\n", "r1,1.png,a café\n".encode("latin-1"),
            b"r2,2.png,a red square\n"]  # fmt: skip
    cfg = _generic(tmp_path / "d", rows, suffix=".csv")
    report = validate(cfg, "train")
    assert report.samples == 2
    assert any("train.csv:3" in e and "not valid UTF-8 (byte 0xe9)" in e for e in report.errors), report.errors


def test_a_non_utf8_txt_caption_is_a_bad_sample_and_training_reads_the_rest(tmp_path):
    root = tmp_path / "folder"
    root.mkdir()
    for i in range(4):
        _png(root / f"{i}.png")
        (root / f"{i}.txt").write_bytes("a red café".encode("latin-1" if i == 1 else "utf-8"))
    cfg = DataConfig(format="generic", root=str(root), on_bad_sample="skip", num_workers=0)
    report = validate(cfg, "train")
    assert report.samples == 3 and any("1.txt:1" in e and "UTF-8" in e for e in report.errors), report.errors
    loader = build_loader(cfg, "train", prep(TOK, 8), batch_size=3)
    assert sum(len(b) for b in loader) == 3


def test_a_16_bit_gradient_png_keeps_its_gradient(tmp_path):
    ramp = np.tile(np.linspace(0, 65535, 256), (4, 1)).astype(np.uint16)
    Image.fromarray(ramp).save(tmp_path / "g16.png")
    assert Image.open(tmp_path / "g16.png").mode == "I;16"
    got = np.asarray(load_image(tmp_path / "g16.png"))[0, :, 0].astype(int)
    want = np.rint(ramp[0] / 257).astype(int)
    assert np.abs(got - want).max() <= 1 and got.mean() == pytest.approx(127.5, abs=1)  # not near-white
    cfg = DataConfig(format="generic", root=str(tmp_path / "d"))
    (tmp_path / "d").mkdir()
    Image.fromarray(ramp).save(tmp_path / "d" / "0.png")
    (tmp_path / "d" / "train.jsonl").write_bytes(_jsonl(0))
    assert validate(cfg, "train").ok


@pytest.mark.parametrize(
    "values, mode, want",
    [(np.array([[0, 2**31 - 1]], dtype=np.int32), "I", [0, 255]),  # a 32-bit image: its full range
     (np.array([[0, 65535]], dtype=np.int32), "I", [0, 255]),  # 16-bit values in mode I
     (np.array([[0.0, 0.5, 1.0]], dtype=np.float32), "F", [0, 128, 255]),  # float in [0, 1]
     (np.array([[0.0, 100.0, 300.0]], dtype=np.float32), "F", [0, 100, 255])],  # float in 8-bit units
)  # fmt: skip
def test_32_bit_and_float_modes_are_scaled_to_8_bits(values, mode, want):
    image = Image.fromarray(values, mode=mode)
    assert np.asarray(load_image(image))[0, :, 0].tolist() == want


def test_an_image_over_max_image_pixels_is_a_bad_sample(tmp_path, caplog):
    assert PIL_MAX_IMAGE_PIXELS == Image.MAX_IMAGE_PIXELS  # the default is PIL's bomb limit
    root = tmp_path / "d"
    cfg = _generic(root, [_jsonl(i) for i in range(4)])
    _png(root / "2.png", size=(40, 30))  # 1,200 pixels
    cfg.max_image_pixels = 1000
    report = validate(cfg, "train")
    assert report.error_counts == {"image too large": 1}
    assert "2.png is 40×30 = 1,200 pixels, over data.max_image_pixels (1,000)" in report.errors[0]
    loader = build_loader(cfg, "train", prep(TOK, 8), batch_size=4, train=False)
    with caplog.at_level(logging.WARNING, logger="sharpclip.data"):
        assert [len(b) for b in loader] == [3]
    assert any("effective batch size mean 3.0, smallest 3, of 4 rows" in r.getMessage() for r in caplog.records)


def test_a_batch_whose_every_sample_is_bad_is_skipped_and_counted(tmp_path):
    root = tmp_path / "d"
    cfg = _generic(root, [_jsonl(i) for i in range(4)])
    for i in (0, 1):
        (root / f"{i}.png").write_bytes(b"not a png")
    loader = build_loader(cfg, "train", prep(TOK, 8), batch_size=2, train=False)
    batches = list(loader)
    assert [b.ids for b in batches] == [["r2", "r3"]]
    assert loader.batches_skipped == 1 and len(loader.report.items) == 2
    assert loader.epoch_sizes["skipped_batches"] == 1


def test_an_empty_csv_caption_is_an_empty_caption_not_a_missing_field(tmp_path):
    rows = [b"id,image,caption,group\n", b"r0,0.png,a red square,\n", b"r1,1.png,,\n", b"r2,2.png,a red square,\n"]
    cfg = _generic(tmp_path / "d", rows, suffix=".csv")
    report = validate(cfg, "train")
    assert report.samples == 2
    assert any("train.csv:row 2" in e and "empty caption" in e for e in report.errors), report.errors
    assert not any("missing field" in e for e in report.errors)


def test_a_missing_split_beside_other_split_files_names_the_split_file(tmp_path):
    cfg = _generic(tmp_path / "d", [_jsonl(0), _jsonl(1)])
    (tmp_path / "d" / "words.txt").write_text("a\nred\nsquare\n")  # a vocabulary beside the data, as documented
    with pytest.raises(FileNotFoundError, match=r"no val\.jsonl, val\.csv or val\.tsv \(the split files there: "
                                                r"train\.jsonl\)"):  # fmt: skip
        read_samples(cfg, "val")


def test_a_truncated_synthdense_manifest_names_the_file(tmp_path):
    from sharpclip.config import SynthDenseConfig
    from sharpclip.data.synthdense import corpus

    root = tmp_path / "synth"
    root.mkdir()
    (root / "manifest.json").write_text('{"config": {"seed')
    with pytest.raises(ValueError, match=rf"{root / 'manifest.json'}: unreadable SynthDense manifest.*delete the"):
        corpus.ensure(root, SynthDenseConfig())


INVISIBLE = {
    "mixed": " \t\u200b\u00a0 ", "zwsp": "\u200b", "zwnj-zwj": "\u200c\u200d", "word-joiner": "\u2060",
    "bom": "\ufeff", "ideographic": "\u3000\u200b\n", "hangul-filler": "\u3164",
    "hangul-choseong-jungseong": "\u115f\u1160", "halfwidth-hangul-filler": "\uffa0",
    "grapheme-joiner": "\u034f", "mongolian-vowel-separator": "\u180e",
    "soft-hyphen": "\u00ad", "bidi-isolates": "\u2066\u2067\u2068\u2069", "variation-selector": " \ufe0f ",
    "tag": "\U000e0041\U000e007f", "khmer-inherent": "\u17b4",
    "control-characters": "\x01\x02 \x7f", "c1-controls": "\x80\x9f", "nul": "\x00",
}  # fmt: skip


@pytest.mark.parametrize("caption", INVISIBLE.values(), ids=INVISIBLE.keys())
def test_a_caption_of_whitespace_and_zero_width_characters_is_an_empty_caption(tmp_path, caption):
    cfg = _generic(tmp_path / "d", [_jsonl(0), _jsonl(1, caption), _jsonl(2, "a\u200bred square")])
    report = validate(cfg, "train")
    assert report.samples == 2 and not report.ok  # a visible caption with a zero-width space inside is kept
    assert any("train.jsonl:2" in e and "empty caption" in e for e in report.errors), report.errors


def test_the_default_ignorable_set_holds_the_invisible_characters_and_no_visible_ones():
    """data.ignorable is Unicode's Default_Ignorable_Code_Point set (DerivedCoreProperties.txt), not a hand list."""
    from sharpclip.data.ignorable import DEFAULT_IGNORABLE_RANGES, is_default_ignorable
    from sharpclip.data.text import is_blank

    for code in [0x3164, 0x115F, 0x1160, 0xFFA0, 0x034F, 0x200B, 0x180E, 0x00AD, *range(0x2066, 0x206A),
                 *range(0xFE00, 0xFE10), 0xE0000, 0xE0FFF]:  # fmt: skip
        assert is_default_ignorable(chr(code)), hex(code)
    for visible in "aЯ\u3131\u1100\ud55c\u1161\uffa1\u0300\u00e9\U0001f600":  # letters, jamo, a combining accent
        assert not is_default_ignorable(visible), hex(ord(visible))
    assert sum(last - first + 1 for first, last in DEFAULT_IGNORABLE_RANGES) == 4174  # the property's size since 14.0
    assert all(a[1] < b[0] for a, b in itertools.pairwise(DEFAULT_IGNORABLE_RANGES))
    assert not is_blank("\u3164a") and not is_blank("\u115f\u1161") and is_blank("\u3164 \u034f\u200b")


@pytest.mark.parametrize("visible", ["\u0600", "\u06dd", "\u0601\u0662", "\U000110bd"])
def test_a_caption_of_visible_format_characters_is_not_empty(visible):
    """Arabic number signs, the end-of-ayah mark and the Kaithi number sign are format characters (Cf) that are drawn:
    not Default_Ignorable, so not an empty caption."""
    from sharpclip.data.text import is_blank

    assert not is_blank(visible)


def test_an_invisible_caption_in_a_csv_and_in_a_caption_file_is_an_empty_caption(tmp_path):
    rows = ["id,image,caption\n", "r0,0.png,a red square\n", "r1,1.png,\u200b \u200b\n"]
    cfg = _generic(tmp_path / "csv", [r.encode() for r in rows], suffix=".csv")
    assert any("row 2" in e and "empty caption" in e for e in validate(cfg, "train").errors)
    folder = tmp_path / "folder"
    folder.mkdir()
    for i, text in enumerate(["a red square", "\ufeff\u200b \n"]):
        _png(folder / f"{i}.png")
        (folder / f"{i}.txt").write_text(text, encoding="utf-8")
    report = validate(DataConfig(format="generic", root=str(folder), num_workers=0), "train")
    assert report.samples == 1 and any("1.txt" in e and "empty caption" in e for e in report.errors), report.errors
