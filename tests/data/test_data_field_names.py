"""Data whose fields are not the configured ones: one line naming the file, the fields it has and the keys to set.

Made as other tools write it: open_clip's CSV/TSV (`filepath,title`), JSON Lines with other key names, a parquet
table with a `text` column, and shards written by webdataset's ShardWriter whose json holds the caption under
`text`. Every record failing the same way is one setup error found at the header or the first records (never one
line per record, never the advice to skip them all); a single bad record stays a bad sample.
"""

from __future__ import annotations

import csv
import io
import json
from pathlib import Path

import pytest
from data_helpers import cfg_for
from PIL import Image

from sharpclip.data import build_loader, read_samples
from sharpclip.data.schema import BadSampleError, BadSampleReport
from sharpclip.data.transforms import ClipImageTransform, Preprocessing, TextTokenizer
from sharpclip.models.tokenizer import build_word_tokenizer

TOK = build_word_tokenizer(["a photo of sample number"])
PREP = Preprocessing(ClipImageTransform(8), TextTokenizer(TOK, 77))
OPEN_CLIP_FIX = "set data.image_field=filepath data.caption_field=title"


def open_clip_csv(root: Path, suffix: str = ".csv", columns=("filepath", "title"), rows: int = 6) -> Path:
    """open_clip's `--train-data` table: a header of `filepath` and `title` (TSV: its default separator)."""
    (root / "images").mkdir(parents=True, exist_ok=True)
    for split in ("train", "val"):
        with open(root / f"{split}{suffix}", "w", newline="") as f:
            writer = csv.writer(f, delimiter="\t" if suffix == ".tsv" else ",")
            writer.writerow(columns)
            for i in range(rows):
                Image.new("RGB", (10, 8), (30 * i, 40, 90)).save(root / "images" / f"{i}.png")
                writer.writerow([f"images/{i}.png", f"a photo of sample {i}"])
    return root


@pytest.mark.parametrize("suffix", [".csv", ".tsv"])
def test_an_open_clip_table_is_one_line_naming_its_columns_and_both_keys(tmp_path, suffix):
    root = open_clip_csv(tmp_path / "d", suffix)
    with pytest.raises(ValueError) as err:
        read_samples(cfg_for("generic", root), "train", BadSampleReport("skip"))  # even under skip: nothing judged
    message = str(err.value)
    assert message == (
        f"{root / f'train{suffix}'}: no column 'image' (data.image_field), 'caption' (data.caption_field); its "
        f"columns are filepath, title: {OPEN_CLIP_FIX}"
    )
    assert "skip" not in message and "\n" not in message
    fixed = read_samples(cfg_for("generic", root, image_field="filepath", caption_field="title"), "train")
    assert [s.caption for s in fixed][:2] == ["a photo of sample 0", "a photo of sample 1"]


@pytest.mark.parametrize(
    ("columns", "fix"),
    [
        (("image", "title"), "set data.caption_field=title"),  # one key right: only the other is named
        (("file_name", "text"), "set data.image_field=file_name data.caption_field=text"),  # HF imagefolder names
        (("a", "b"), "set data.image_field to one of them data.caption_field to one of them"),  # no guess
    ],
)
def test_each_missing_key_is_named_with_the_likeliest_column(tmp_path, columns, fix):
    root = open_clip_csv(tmp_path / "d", columns=columns)
    with pytest.raises(ValueError, match="its columns are " + ", ".join(columns)) as err:
        read_samples(cfg_for("generic", root), "train")
    assert str(err.value).endswith(fix)


def _jsonl(path: Path, records: list[dict]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def test_jsonl_with_other_keys_is_one_line_but_one_bad_record_stays_a_bad_sample(tmp_path):
    root = open_clip_csv(tmp_path / "d")
    records = [{"filepath": f"images/{i}.png", "text": f"a photo of sample {i}", "uid": i} for i in range(4)]
    _jsonl(root / "train.jsonl", records)
    with pytest.raises(ValueError) as err:
        read_samples(cfg_for("generic", root), "train", BadSampleReport("skip"))
    assert str(err.value).endswith(
        "train.jsonl: no JSON key 'image' (data.image_field), 'caption' (data.caption_field); its JSON keys are "
        "filepath, text, uid: set data.image_field=filepath data.caption_field=text"
    )
    good = [{"image": f"images/{i}.png", "caption": f"a photo of sample {i}"} for i in range(3)]
    _jsonl(root / "train.jsonl", [*good, {"filepath": "images/3.png", "caption": "a photo"}])
    report = BadSampleReport("skip")
    assert len(read_samples(cfg_for("generic", root), "train", report)) == 3
    assert [b.reason for b in report.items] == ["malformed record: missing field(s) image"]


def test_validate_data_and_train_print_one_line_without_the_advice_to_skip(tmp_path, capsys):
    from sharpclip.cli import main

    root = open_clip_csv(tmp_path / "d", rows=8)
    assert main(["validate-data", str(root), "--no-progress", "--json", str(tmp_path / "r.json")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("sharpclip validate-data: ") and err[0].endswith(OPEN_CLIP_FIX), err
    code = main(["train", "model.name=tiny-clip", "data.format=generic", f"data.root={root}", "data.num_workers=0",
                 "train.batch_size=4", "train.micro_batch_size=4", f"train.output_dir={tmp_path / 'run'}"])  # fmt: skip
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and OPEN_CLIP_FIX in err[-1] and "on_bad_sample" not in err[-1], err


def _jpeg(i: int) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (10, 8), (i * 7 % 256, 40, 90)).save(buf, "JPEG")
    return buf.getvalue()


def shardwriter(folder: Path, meta, txt: bool = False, samples: int = 16) -> list[Path]:
    """Shards as webdataset's ShardWriter writes them: `meta(i)` is sample i's json (None: no json)."""
    import webdataset as wds

    folder.mkdir(parents=True, exist_ok=True)
    with wds.ShardWriter(str(folder / "shard-%06d.tar"), maxcount=8, verbose=0) as sink:
        for i in range(samples):
            sample = {"__key__": f"{i:06d}", "jpg": _jpeg(i)}
            if meta(i) is not None:
                sample["json"] = meta(i)
            if txt:
                sample["txt"] = f"a photo of sample {i}"
            sink.write(sample)
    return sorted(folder.glob("*.tar"))


def _wds(root: Path, **kw):
    return cfg_for("webdataset", root, shuffle=False, **kw)


def test_shardwriter_json_with_the_caption_under_another_key_is_one_line(tmp_path, capsys):
    from sharpclip.cli import main

    shards = shardwriter(tmp_path / "w" / "train", lambda i: {"text": f"a photo of sample {i}", "key": f"{i:06d}"})
    expected = (
        f"{shards[0]}: sample 000000 has no .txt and no 'caption' (data.caption_field) in its .json, whose keys are "
        "text, key: set data.caption_field=text (or write a .txt per sample)"
    )
    with pytest.raises(ValueError) as err:
        read_samples(_wds(tmp_path / "w"), "train", BadSampleReport("skip"))
    assert str(err.value) == expected
    with pytest.raises(ValueError, match=r"set data\.caption_field=text"):
        build_loader(_wds(tmp_path / "w", on_bad_sample="skip"), "train", PREP, batch_size=4)  # before any step
    assert main(["validate-data", str(tmp_path / "w"), "--no-progress", "--json", str(tmp_path / "r.json")]) == 2
    assert capsys.readouterr().err.strip().splitlines() == [f"sharpclip validate-data: {expected}"]
    loader = build_loader(_wds(tmp_path / "w", caption_field="text"), "train", PREP, batch_size=4)
    assert sum(len(b.ids) for b in loader) == 16


def test_shards_without_any_caption_name_the_keys_and_one_uncaptioned_sample_is_a_bad_sample(tmp_path):
    shardwriter(tmp_path / "n" / "train", lambda i: {"key": f"{i:06d}", "status": "success"})
    with pytest.raises(ValueError, match=r"whose keys are key, status: set data.caption_field to one of them"):
        read_samples(_wds(tmp_path / "n"), "train")
    shardwriter(tmp_path / "one" / "train", lambda i: {"caption": f"a photo of sample {i}"} if i else {"k": 0})
    report = BadSampleReport("skip")
    assert len(read_samples(_wds(tmp_path / "one"), "train", report)) == 15  # only sample 0 lacks its caption
    assert [b.record for b in report.items] == ["000000"]
    with pytest.raises(BadSampleError, match="000000"):
        read_samples(_wds(tmp_path / "one"), "train")


def test_a_parquet_table_with_a_text_column_names_the_fix(tmp_path):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    (tmp_path / "data").mkdir()
    table = pa.table({"image": [{"bytes": _jpeg(i), "path": None} for i in range(3)], "text": ["a", "b", "c"]})
    pq.write_table(table, tmp_path / "data" / "train-00000-of-00001.parquet")
    with pytest.raises(ValueError) as err:
        read_samples(cfg_for("hf", tmp_path), "train")
    assert str(err.value).endswith(
        "no column 'caption' (data.caption_field); its columns are image, text: set data.caption_field=text"
    )
