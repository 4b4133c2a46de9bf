"""Helpers shared by the format readers: reading annotation files, checking records, naming where things are.

A reader returns the samples of one split and records every annotation file it opens in the report
(`BadSampleReport.read_file`: the eval manifest hashes exactly those). A record it cannot use (malformed, empty
caption) goes to the `BadSampleReport`, which raises or records it by policy; a missing annotation file is a setup
error and always raises.
Records a protocol leaves out on purpose (DCI's empty `extra_caption`, VG's duplicate ids) are logged, not reported.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from sharpclip.data.files import check_regular
from sharpclip.data.schema import BadSample, BadSampleReport, log
from sharpclip.data.text import is_blank


def require_file(path: Path, what: str) -> Path:
    """`path` if it is a file; otherwise a FileNotFoundError that says what was expected there (NotRegularFileError
    when something else, a FIFO or a folder, stands there)."""
    if path.exists() and not path.is_file():
        check_regular(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path}: {what} not found; check data.root (docs/data.md shows the layout)")
    return path


def require_dir(path: Path, what: str) -> Path:
    """`path` if it is a folder; otherwise a FileNotFoundError that says what was expected there."""
    if not path.is_dir():
        raise FileNotFoundError(f"{path}: {what} folder not found; check data.root (docs/data.md shows the layout)")
    return path


def release_dir(root: Path, marker: str, what: str, subfolders: tuple[str, ...] = ("", "data")) -> Path:
    """The folder under `root` that holds `marker`: `root` itself (the flat layout) or one of `subfolders` (the HF
    hub snapshot keeps a dataset's files under `data/`). Raises naming every place looked at."""
    for sub in subfolders:
        if (root / sub / marker).exists():
            return root / sub
    looked = ", ".join(str(root / sub / marker) for sub in subfolders)
    raise FileNotFoundError(f"{what}: {marker} not found (looked for {looked}); point the root at the release folder")


def load_json(path: Path, what: str, report: BadSampleReport) -> Any:
    """The parsed JSON file (recorded in `report` as read); a missing or invalid file raises with the path and the
    parser's line/column."""
    report.read_file(require_file(path, what))
    data = path.read_bytes()
    try:
        return json.loads(data.decode("utf-8"))
    except UnicodeDecodeError as err:  # one file holds every record: nothing to skip, so a setup error
        raise ValueError(f"{path}:{line_of(data, err.start)}: {not_utf8(data, err)}; re-save it as UTF-8") from None
    except json.JSONDecodeError as err:
        raise ValueError(f"{path}: line {err.lineno} column {err.colno}: not valid JSON ({err.msg})") from None


def line_of(data: bytes, offset: int) -> int:
    """The 1-based line number of byte `offset` in `data`."""
    return data.count(b"\n", 0, offset) + 1


def not_utf8(data: bytes, err: UnicodeDecodeError) -> str:
    """A short reason for a UTF-8 decoding failure: the offending byte and its column."""
    column = err.start - (data.rfind(b"\n", 0, err.start) + 1) + 1
    return f"not valid UTF-8 (byte 0x{data[err.start]:02x} at column {column})"


def decode_utf8(data: bytes, where: str, rid: str, report: BadSampleReport) -> str | None:
    """`data` as UTF-8 text, or None after reporting a malformed record at `where` (file:line)."""
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as err:
        report.add(BadSample(where, rid, f"malformed record: {not_utf8(data, err)}"))
        return None


def iter_jsonl(path: Path, report: BadSampleReport):
    """(where, record) for each non-blank line of a JSON Lines file; a line that is not a JSON object is reported."""
    report.read_file(require_file(path, "JSON Lines file"))
    with open(path, "rb") as f:
        for lineno, raw in enumerate(f, start=1):
            where = f"{path}:{lineno}"
            line = decode_utf8(raw, where, "?", report)  # one bad line is one bad sample, not a crash
            if line is None or not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as err:
                report.add(BadSample(where, "?", f"malformed record: not valid JSON ({err.msg})"))
                continue
            if not isinstance(record, dict):
                report.add(BadSample(where, "?", "malformed record: not a JSON object"))
                continue
            yield where, record


def fields(record: Any, keys: tuple[str, ...], where: str, rid: str, report: BadSampleReport) -> tuple | None:
    """The values of `keys` in `record`, or None after reporting which key is missing or of the wrong kind."""
    if not isinstance(record, dict):
        report.add(BadSample(where, rid, f"malformed record: expected a JSON object, got {type(record).__name__}"))
        return None
    missing = [k for k in keys if k not in record or record[k] is None]
    if missing:
        report.add(BadSample(where, rid, f"malformed record: missing field(s) {', '.join(missing)}"))
        return None
    return tuple(record[k] for k in keys)


# Names other tools give the image and caption columns (open_clip's CSV: filepath, title; webdataset / img2dataset:
# txt, url; HF datasets: text, file_name), most likely first: the guess a mismatch message offers as the fix.
IMAGE_NAMES = ("image", "filepath", "file_path", "image_path", "img_path", "file_name", "filename", "path", "file",
               "img", "jpg", "png", "image_file", "url", "image_url")  # fmt: skip
CAPTION_NAMES = ("caption", "title", "text", "txt", "captions", "sentence", "sentences", "prompt", "description",
                 "alt_text", "alt", "label")  # fmt: skip
FIELD_NAMES = {"image_field": IMAGE_NAMES, "caption_field": CAPTION_NAMES}


def field_fix(names: list[str], cfg: Any, keys: tuple[str, ...]) -> str:
    """'set data.image_field=filepath data.caption_field=title': the `data.*` keys of `keys` to set, each with the
    most likely of `names` (`FIELD_NAMES`), or 'to one of them' when none is a common name."""
    fixes = []
    for key in keys:
        guess = next((n for common in FIELD_NAMES[key] for n in names if n.lower() == common), None)
        fixes.append(f"data.{key}={guess}" if guess else f"data.{key} to one of them")
    return "set " + " ".join(fixes)


def field_mismatch(where: str, noun: str, names: list[str], cfg: Any, keys: tuple[str, ...] = tuple(FIELD_NAMES)):
    """None when every configured field of `keys` (DataConfig attributes) is among `names`; else the one-line
    setup error for a whole file whose fields are not the configured ones, before any record is judged: it names
    the file (`where`), the fields it has (`noun`s: columns, JSON keys) and the `data.*` keys to set, with a guess
    from the common names (open_clip's `filepath,title` → data.image_field=filepath data.caption_field=title)."""
    missing = tuple(k for k in keys if getattr(cfg, k) not in names)
    if not missing:
        return None
    wanted = ", ".join(f"{getattr(cfg, k)!r} (data.{k})" for k in missing)
    found = ", ".join(names) or "none"
    return f"{where}: no {noun} {wanted}; its {noun}s are {found}: {field_fix(names, cfg, missing)}"


def caption_ok(text: Any, where: str, rid: str, report: BadSampleReport, blank_ok: bool = False) -> bool:
    """True for a non-blank string; otherwise reports an empty caption (or a malformed one) and returns False.

    blank_ok: accept a whitespace-only caption (only "" is empty), as TULIP's Long-DCI builder and evaluator do.
    Otherwise a caption of only whitespace and invisible characters (zero-width space, BOM: data.text.is_blank) is
    empty."""
    if not isinstance(text, str):
        report.add(BadSample(where, rid, f"malformed record: caption is {type(text).__name__}, not a string"))
        return False
    if (not text) if blank_ok else is_blank(text):
        report.add(BadSample(where, rid, "empty caption"))
        return False
    return True


def note_left_out(fmt: str, count: int, why: str) -> None:
    """Log records that a protocol drops on purpose, so that nothing disappears silently."""
    if count:
        log.info("%s: left out %d records (%s)", fmt, count, why)


def check_split(fmt: str, split: str, known: tuple[str, ...]) -> None:
    """Raise a ValueError naming the format's splits unless `split` is one of them."""
    if split not in known:
        raise ValueError(f"{fmt}: unknown split {split!r}; this format has {', '.join(known)}")
