"""Visual Genome paragraphs (Krause et al. 2017, im2p): `paragraphs_v1.json` + `{train,val,test}_split.json`.

`paragraphs_v1.json` is a list of `{url, image_id, paragraph}`; a split file is a list of image ids. The image is
`<root>/<second-to-last URL part>/<last URL part>` (`VG_100K/2356347.jpg` or `VG_100K_2/...`). The file repeats some
`image_id`s; like the standard conversion, the first record per id is kept (the rest are logged as left out).
"""

from __future__ import annotations

from pathlib import Path

from sharpclip.config import DataConfig
from sharpclip.data.formats._common import caption_ok, check_split, fields, load_json, note_left_out
from sharpclip.data.schema import BadSampleReport, PairSample

PARAGRAPHS = "paragraphs_v1.json"


def _image_path(root: Path, url: str, image_id: int) -> Path:
    parts = str(url).rstrip("/").split("/")
    folder = parts[-2] if len(parts) >= 2 else "VG_100K"
    return root / folder / (parts[-1] or f"{image_id}.jpg")


def read(root: Path, split: str, cfg: DataConfig, report: BadSampleReport) -> list[PairSample]:
    """VG paragraph samples of the ids in `<split>_split.json`, first record per id."""
    check_split("vg", split, ("train", "val", "test"))
    wanted = load_json(root / f"{split}_split.json", f"VG {split}_split.json", report)
    wanted = {int(i) for i in wanted}
    path = root / PARAGRAPHS
    seen: set[int] = set()
    samples, duplicates = [], 0
    for i, record in enumerate(load_json(path, "VG paragraphs_v1.json", report)):
        where = f"{path}[{i}]"
        got = fields(record, ("url", "image_id", "paragraph"), where, str(i), report)
        if got is None:
            continue
        url, image_id, paragraph = got
        if image_id not in wanted:
            continue
        if image_id in seen:
            duplicates += 1
            continue
        seen.add(image_id)
        if caption_ok(paragraph, where, str(image_id), report):
            samples.append(
                PairSample(id=str(image_id), image=_image_path(root, url, image_id), caption=paragraph, source=where)
            )
    note_left_out("vg", duplicates, "repeated image_id; the first record per id is kept")
    return samples
