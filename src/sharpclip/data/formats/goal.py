"""GOAL's evaluation lists (PerceptualAI-Lab/GOAL `datasets/*_test.json`): a JSON list of `{filename, caption}`.

GOAL's file names are relative to its own checkout (`../DCI/.../photos/sa_1543972.jpg`), so images are looked up by
base name in the format's image folder (DCI `photos/`, DOCCI `images/`, Urban-1K `image/`). The list's order is kept:
it defines the ground-truth index of the R@K protocol (DOCCI: 100 `qual_test` then 5,000 `test`).
"""

from __future__ import annotations

from pathlib import Path, PurePosixPath

from sharpclip.data.formats._common import caption_ok, fields, load_json
from sharpclip.data.schema import BadSampleReport, PairSample


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
