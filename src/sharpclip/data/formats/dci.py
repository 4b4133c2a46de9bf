"""DCI, Densely Captioned Images (Urbanek et al. 2024): one JSON per image under `densely_captioned_images/`.

Layout: `photos/sa_N.jpg` (the SA-1B archive, extracted separately), `annotations/<id>-data.json`,
`complete/<id>-data.json` (adds summaries/negatives), `splits.json` (`{"train": [...], "valid": [...], "test":
[...]}`, file names in `complete/`). The file name is the annotation unit's id; the photo is named only by the
record's `image` field (relative to `photos/`), which also gives the sample id (`sa_N`). Each JSON has `image`,
`short_caption`, `extra_caption` (may be "" and may contain newlines), `mask_data`, `mask_keys`.

Splits: train | valid | test (the official `splits.json`; test is the small official one, ~112 images) and `all`
(every `annotations/*.json`, sorted by path, as TULIP builds Long-DCI). Caption (`data.dci_caption`): `extra` =
`extra_caption` only, the GOAL / Long-DCI rule, where records whose `extra_caption` is the empty string are left out
(and logged), exactly TULIP's `len(...) == 0` test (a whitespace-only one is kept, as TULIP keeps it); `short`;
`short_extra` = short + "\\n" + extra. GOAL's DCI protocol (1,999 test images) is its `DCI_test.json` list, for the
split its name says (`data.list_file`, `data.list_files`; see formats.goal).
"""

from __future__ import annotations

from pathlib import Path

from sharpclip.config import DataConfig
from sharpclip.data.formats._common import (
    caption_ok,
    check_split,
    fields,
    load_json,
    note_left_out,
    require_dir,
)
from sharpclip.data.formats.goal import list_for_split, read_goal_list
from sharpclip.data.schema import BadSample, BadSampleReport, PairSample
from sharpclip.data.text import is_blank

SPLITS = ("train", "valid", "test", "all")


def dataset_dir(root: Path) -> Path:
    """`root`'s `densely_captioned_images/` child when there is one (the release's base folder), else `root`."""
    nested = root / "densely_captioned_images"
    return nested if nested.is_dir() else root


def photos_dir(base: Path) -> Path:
    """`<base>/photos`, or an error saying that the photos (the SA-1B images) are what is missing."""
    return require_dir(base / "photos", "DCI photos/ (the SA-1B images, extracted from sa_000138.tar)")


def _split_files(base: Path, split: str, report: BadSampleReport) -> list[Path]:
    if split == "all":
        return sorted(require_dir(base / "annotations", "DCI annotations/").glob("*.json"))
    names = load_json(base / "splits.json", "DCI splits.json", report)
    if not isinstance(names, dict) or split not in names:
        raise ValueError(f"{base / 'splits.json'}: expected a JSON object with a {split!r} list")
    # splits.json names files in complete/; fall back to annotations/ for releases that lack complete/
    return [
        base / "complete" / n if (base / "complete" / n).is_file() else base / "annotations" / n for n in names[split]
    ]


def _caption(short: str, extra: str, mode: str) -> str:
    if mode == "short":
        return short
    if mode == "short_extra":
        return f"{short}\n{extra}" if not is_blank(extra) else short
    return extra


def _read_one(path: Path, photos: Path, mode: str, report: BadSampleReport) -> PairSample | str | None:
    """The sample, None after reporting a bad record, or "left out" for an empty `extra_caption` under `extra`."""
    where, rid = str(path), path.stem
    if not path.is_file():
        report.add(BadSample(where, rid, "missing file: annotation listed in splits.json does not exist"))
        return None
    try:
        record = load_json(path, "DCI annotation", report)
    except ValueError as err:
        report.add(BadSample(where, rid, f"malformed record: {err}"))
        return None
    got = fields(record, ("image", "short_caption", "extra_caption"), where, rid, report)
    if got is None:
        return None
    image, short, extra = got
    if mode == "extra" and extra == "":  # TULIP's builder: len(extra_caption) == 0; whitespace is kept
        return "left out"
    caption = _caption(short, extra, mode) if isinstance(short, str) and isinstance(extra, str) else None
    if not caption_ok(caption, where, rid, report, blank_ok=mode == "extra"):
        return None
    return PairSample(
        id=Path(image).stem, image=photos / image, caption=caption, short_caption=short or None, source=where
    )


def read(root: Path, split: str, cfg: DataConfig, report: BadSampleReport) -> list[PairSample]:
    """DCI samples of `split` (or of the GOAL list for it), captions by `data.dci_caption`."""
    base = dataset_dir(root)
    photos = photos_dir(base)
    list_file = list_for_split(cfg, split)
    if list_file:
        return read_goal_list(root / list_file, photos, report)
    check_split("dci", split, SPLITS)
    samples, left_out = [], 0
    for path in _split_files(base, split, report):
        got = _read_one(path, photos, cfg.dci_caption, report)
        left_out += got == "left out"
        if isinstance(got, PairSample):
            samples.append(got)
    note_left_out("dci", left_out, "empty extra_caption under the extra_caption rule")
    return samples
