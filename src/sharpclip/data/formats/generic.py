"""The generic format: your own pairs (and edits) as JSON Lines, CSV/TSV, or a folder of `x.jpg` + `x.txt`.

`data.root` is either a file (`pairs.jsonl`, `pairs.csv`, `pairs.tsv`) or a folder holding `<split>.jsonl`,
`<split>.csv` or `<split>.tsv`; failing those, the folder `<root>/<split>/` (or `<root>`) of images with a
same-named `.txt` caption each. Image paths in files are relative to the file's folder.

Columns (renamable in the config): `image`, `caption` (a string, or a list = several captions per image),
optional `short_caption`, `id` (default: the line number) and `group` (rows of one group share a batch).
A JSON Lines record with `source_image` and `edited_image` is an edit: `source_caption`, `target_caption`,
`instruction`, `id`. SynthDense is written in this format.
"""

from __future__ import annotations

import csv
import re
from collections.abc import Iterator
from pathlib import Path

from sharpclip.config import DataConfig
from sharpclip.data.formats._common import (
    FIELD_NAMES,
    caption_ok,
    field_mismatch,
    fields,
    iter_jsonl,
    line_of,
    not_utf8,
    require_dir,
)
from sharpclip.data.schema import BadSample, BadSampleReport, EditSample, PairSample, Sample
from sharpclip.data.text import is_blank

IMAGE_SUFFIXES = (".jpg", ".jpeg", ".png", ".webp", ".bmp")
EDIT_KEYS = ("source_image", "edited_image", "source_caption", "target_caption")
_SURROGATE = re.compile("[\udc80-\udcff]")  # what errors="surrogateescape" makes of a byte that is not UTF-8


def _table_file(root: Path, split: str) -> Path | None:
    if root.is_file():
        return root
    for suffix in (".jsonl", ".csv", ".tsv"):
        if (root / f"{split}{suffix}").is_file():
            return root / f"{split}{suffix}"
    return None


def _is_edit(names) -> bool:
    return "source_image" in names and "edited_image" in names


def _records(path: Path, report: BadSampleReport, cfg: DataConfig) -> Iterator[tuple[str, dict]]:
    """(where, record) of each row; an empty CSV cell is left out unless it is the caption's (an empty caption is
    reported as such, not as a missing column). A CSV/TSV header without the configured image and caption columns
    is one setup error (`field_mismatch`) before any row is read."""
    if path.suffix in (".jsonl", ".json"):
        yield from iter_jsonl(path, report)
        return
    # undecodable bytes become surrogates, so one latin-1 row is a bad sample (file:line) and the rest still parse
    with open(report.read_file(path), encoding="utf-8", errors="surrogateescape", newline="") as f:
        reader = csv.DictReader(f, delimiter="\t" if path.suffix == ".tsv" else ",")
        names = [n for n in reader.fieldnames or [] if n]
        problem = None if not names or _is_edit(names) else field_mismatch(str(path), "column", names, cfg)
        if problem is not None:
            raise ValueError(problem)
        keep = (cfg.caption_field,)
        for i, row in enumerate(reader):
            values = {k: v for k, v in row.items() if v is not None and (v != "" or k in keep)}
            bad = next((v for v in values.values() if isinstance(v, str) and _SURROGATE.search(v)), None)
            if bad is not None:
                byte = ord(_SURROGATE.search(bad).group()) - 0xDC00
                reason = f"malformed record: not valid UTF-8 (byte 0x{byte:02x})"
                report.add(BadSample(f"{path}:{reader.line_num}", "?", reason))
                continue
            yield f"{path}:row {i + 1}", values


def _edit(record: dict, where: str, rid: str, base: Path, report: BadSampleReport) -> EditSample | None:
    got = fields(record, EDIT_KEYS, where, rid, report)
    if got is None or not all(caption_ok(c, where, rid, report) for c in got[2:]):
        return None
    src, edited, src_cap, tgt_cap = got
    return EditSample(
        id=rid,
        source_image=base / src,
        edited_image=base / edited,
        source_caption=src_cap,
        target_caption=tgt_cap,
        instruction=str(record.get("instruction", "")),
        source=where,
    )


def _pair(record: dict, where: str, rid: str, base: Path, cfg: DataConfig, report: BadSampleReport):
    got = fields(record, (cfg.image_field, cfg.caption_field), where, rid, report)
    if got is None:
        return None
    image, caption = got
    captions = caption if isinstance(caption, list) else None
    if captions is not None and not all(caption_ok(c, where, rid, report) for c in captions or [""]):
        return None
    if captions is None and not caption_ok(caption, where, rid, report):
        return None
    short = record.get(cfg.short_caption_field)
    group = record.get(cfg.group_field)
    return PairSample(
        id=rid,
        image=base / image,
        caption=captions[0] if captions else caption,
        short_caption=short if isinstance(short, str) and not is_blank(short) else None,
        captions=captions,
        group=None if group is None else str(group),
        source=where,
    )


KEYS_SHOWN = 12  # JSON keys named in a mismatch message


def _check_keys(path: Path, records: list[tuple[str, dict]], cfg: DataConfig) -> None:
    """One setup error when no pair record of a JSON Lines file has the configured image (or caption) key: every
    record would fail the same way, so no record is judged (and skipping would skip them all)."""
    pairs = [r for _, r in records if not _is_edit(r)]
    names = list(dict.fromkeys(k for r in pairs for k in r))  # every key seen, in first-seen order
    missing = tuple(k for k in FIELD_NAMES if not any(getattr(cfg, k) in r for r in pairs))
    if pairs and missing:
        raise ValueError(field_mismatch(str(path), "JSON key", names[:KEYS_SHOWN], cfg, missing))


def _read_table(path: Path, cfg: DataConfig, report: BadSampleReport) -> list[Sample]:
    samples = []
    records = list(_records(path, report, cfg))
    _check_keys(path, records, cfg)
    for n, (where, record) in enumerate(records):
        rid = str(record.get(cfg.id_field, n))
        sample = (
            _edit(record, where, rid, path.parent, report)
            if _is_edit(record)
            else _pair(record, where, rid, path.parent, cfg, report)
        )
        if sample is not None:
            samples.append(sample)
    return samples


def _read_folder(folder: Path, report: BadSampleReport) -> list[PairSample]:
    images = {p.stem: p for p in sorted(folder.iterdir()) if p.suffix.lower() in IMAGE_SUFFIXES}
    texts = {p.stem: p for p in sorted(folder.glob("*.txt"))}
    samples = []
    for stem in sorted(images.keys() | texts.keys()):
        if stem not in texts:
            report.add(BadSample(str(images[stem]), stem, f"empty caption: no {stem}.txt beside the image"))
        elif stem not in images:
            report.add(BadSample(str(texts[stem]), stem, f"missing file: no image {stem}.jpg/.png for the caption"))
        else:
            data = report.read_file(texts[stem]).read_bytes()
            where = str(texts[stem])
            try:
                caption = data.decode("utf-8").strip()
            except UnicodeDecodeError as err:
                reason = f"malformed record: {not_utf8(data, err)}"
                report.add(BadSample(f"{where}:{line_of(data, err.start)}", stem, reason))
                continue
            if caption_ok(caption, str(texts[stem]), stem, report):
                samples.append(PairSample(id=stem, image=images[stem], caption=caption, source=str(texts[stem])))
    return samples


def read(root: Path, split: str, cfg: DataConfig, report: BadSampleReport) -> list[Sample]:
    """Samples from the split's table file, else from its folder of image + `.txt` pairs."""
    table = _table_file(root, split)
    if table is not None:
        return _read_table(table, cfg, report)
    tables = sorted(p.name for p in root.glob("*") if p.suffix in (".jsonl", ".csv", ".tsv")) if root.is_dir() else []
    if tables and not (root / split).is_dir():  # a folder of split files lacking this one: not a folder of pairs
        raise FileNotFoundError(
            f"{root}: no {split}.jsonl, {split}.csv or {split}.tsv (the split files there: {', '.join(tables[:5])})"
        )
    folder = root / split if (root / split).is_dir() else require_dir(root, "generic data")
    samples = _read_folder(folder, report)
    if not samples and not report.items and folder == root:  # nothing for this split anywhere: say where we looked
        raise FileNotFoundError(
            f"{root}: no {split}.jsonl, {split}.csv or {split}.tsv, no {split}/ folder, and no image + .txt pairs in "
            "the folder itself (generic format; see docs/data.md)"
        )
    return samples
