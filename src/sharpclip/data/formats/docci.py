"""DOCCI (Onoe et al. 2024): `docci_descriptions.jsonlines` + a flat `images/` folder.

Each line is `{example_id, split, image_file, description}`, split in train | test | qual_dev | qual_test.
Test protocols (`data.docci_test`):
- `goal` (default, HN-CLIP/GOAL): 5,100 images, the 100 `qual_test` first, then the 5,000 `test`, each by example id;
- `test`: the 5,000 `test` images only (FineLIP).
GOAL's own `docci_test.json` list replaces the split its name says (`data.list_file`; see formats.goal). The hub
repository `google/docci` now holds `<split>.csv` files + `images.tar.gz` instead of the jsonlines
(formats.hub_layouts).
"""

from __future__ import annotations

from pathlib import Path

from sharpclip.config import DataConfig
from sharpclip.data.formats import hub_layouts
from sharpclip.data.formats._common import caption_ok, check_split, fields, iter_jsonl, require_dir
from sharpclip.data.formats.goal import list_for_split, read_goal_list
from sharpclip.data.schema import BadSampleReport, PairSample

DESCRIPTIONS = "docci_descriptions.jsonlines"
SPLITS = ("train", "test", "qual_dev", "qual_test")


def _read_all(root: Path, report: BadSampleReport) -> list[tuple[str, PairSample]]:
    out = []
    for where, record in iter_jsonl(root / DESCRIPTIONS, report):
        rid = str(record.get("example_id", "?"))
        got = fields(record, ("example_id", "split", "image_file", "description"), where, rid, report)
        if got is None or not caption_ok(got[3], where, rid, report):
            continue
        example_id, split, image_file, description = got
        out.append(
            (split, PairSample(id=example_id, image=root / "images" / image_file, caption=description, source=where))
        )
    return out


def read(root: Path, split: str, cfg: DataConfig, report: BadSampleReport) -> list[PairSample]:
    """DOCCI samples of `split` under `data.docci_test` (or of the GOAL list for it)."""
    list_file = list_for_split(cfg, split)
    if list_file:
        return read_goal_list(root / list_file, require_dir(root / "images", "DOCCI images/"), report)
    check_split("docci", split, SPLITS)
    if not (root / DESCRIPTIONS).is_file() and hub_layouts.docci_split_csv(root, split):  # google/docci's CSVs
        wanted = ("qual_test", "test") if split == "test" and cfg.docci_test == "goal" else (split,)
        by_id = [sorted(hub_layouts.read_docci_csv(root, name, report), key=lambda s: s.id) for name in wanted]
        return [s for part in by_id for s in part]
    wanted = ("qual_test", "test") if split == "test" and cfg.docci_test == "goal" else (split,)
    rows = _read_all(root, report)
    picked = [(wanted.index(s), sample.id, sample) for s, sample in rows if s in wanted]
    return [sample for *_, sample in sorted(picked, key=lambda t: t[:2])]
