"""GOAL's evaluation lists (PerceptualAI-Lab/GOAL `datasets/*_test.json`): a JSON list of `{filename, caption}`.

GOAL's file names are relative to its own checkout (`../DCI/.../photos/sa_1543972.jpg`), so images are looked up by
base name in the format's image folder (DCI `photos/`, DOCCI `images/`, Urban-1K `image/`). The list's order is kept:
it defines the ground-truth index of the R@K protocol (DOCCI: 100 `qual_test` then 5,000 `test`).

A list replaces one split only (`list_for_split`), so a recipe that trains on one list never validates on it.
"""

from __future__ import annotations

import re
from pathlib import Path, PurePosixPath

from sharpclip.config import ConfigError, DataConfig
from sharpclip.data.formats._common import caption_ok, fields, load_json
from sharpclip.data.schema import BadSampleReport, PairSample

SPLIT_WORDS = {"train": "train", "val": "val", "valid": "valid", "test": "test"}


def split_named_by(list_file: str) -> str | None:
    """The split a list's file name says (`DCI_test.json`: test, `DCI_train_del_org.json`: train), else None.

    Words are the name's parts between `_`, `-`, `.` and spaces; a name that says two splits says none.
    """
    words = re.split(r"[_\-. ]+", PurePosixPath(list_file.replace("\\", "/")).stem.lower())
    said = {SPLIT_WORDS[w] for w in words if w in SPLIT_WORDS}
    return said.pop() if len(said) == 1 else None


def list_for_split(cfg: DataConfig, split: str) -> str:
    """The list file that replaces `split` ("" for none): `data.list_files[split]`, else `data.list_file` when it is
    for this split (`data.list_split`, else the split its file name says)."""
    if split in cfg.list_files:
        return cfg.list_files[split]
    if not cfg.list_file:
        return ""
    target = cfg.list_split or split_named_by(cfg.list_file)
    if target is None:
        raise ConfigError(
            f"data.list_file={cfg.list_file!r}: its name does not say which split it replaces (train, val, test); "
            "set data.list_split (or use data.list_files.<split>)"
        )
    return cfg.list_file if target == split else ""


def read_goal_list(list_file: Path, image_dir: Path, report: BadSampleReport) -> list[PairSample]:
    """One `PairSample` per entry; id = the image's base name without extension."""
    entries = load_json(list_file, "GOAL-style {filename, caption} list", report)
    if not isinstance(entries, list):
        raise ValueError(f"{list_file}: expected a JSON list of {{filename, caption}} objects")
    samples = []
    for i, entry in enumerate(entries):
        where = f"{list_file}[{i}]"
        got = fields(entry, ("filename", "caption"), where, str(i), report)
        if got is None:
            continue
        filename, caption = got
        name = PurePosixPath(str(filename).replace("\\", "/")).name
        rid = PurePosixPath(name).stem
        if caption_ok(caption, where, rid, report):
            samples.append(PairSample(id=rid, image=image_dir / name, caption=caption, source=where))
    return samples
