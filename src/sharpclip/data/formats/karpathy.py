"""COCO / Flickr30k / Flickr8k in Karpathy's split JSON (`dataset_coco.json`, `dataset_flickr30k.json`, ...).

`{"images": [{"filepath"?, "filename", "imgid", "split": train|restval|val|test, "sentences": [{"raw", ...}]}]}`.
Images at `<root>/<filepath>/<filename>` (COCO: `val2014/...`) or, without `filepath`, `<root>/<filename>`
(`<root>/flickr30k-images/` when that folder exists). Split `train` includes `restval`, as is standard.
Each image keeps its first 5 captions (some COCO images have 6-7): short-caption retrieval scores image i against
captions 5i..5i+4 (Long-CLIP `coco.py`). `data.caption_choice` picks the training caption.
"""

from __future__ import annotations

from pathlib import Path

from sharpclip.config import DataConfig
from sharpclip.data.formats._common import check_split, fields, load_json, require_file
from sharpclip.data.schema import BadSample, BadSampleReport, PairSample

FILES = ("dataset_coco.json", "dataset_flickr30k.json", "dataset_flickr8k.json")
CAPTIONS_PER_IMAGE = 5


def _annotation_file(root: Path, cfg: DataConfig) -> Path:
    if cfg.annotation_file:
        return require_file(root / cfg.annotation_file, "Karpathy split JSON")
    for name in FILES:
        if (root / name).is_file():
            return root / name
    raise FileNotFoundError(f"{root}: none of {', '.join(FILES)} found; set data.annotation_file")


def _sample(record: object, where: str, image_dir: Path, report: BadSampleReport) -> PairSample | None:
    rid = str(record.get("cocoid", record.get("imgid", "?"))) if isinstance(record, dict) else "?"
    got = fields(record, ("filename", "sentences"), where, rid, report)
    if got is None:
        return None
    raws = [s.get("raw") for s in got[1] if isinstance(s, dict)] if isinstance(got[1], list) else []
    captions = [r.strip() for r in raws if isinstance(r, str) and r.strip()][:CAPTIONS_PER_IMAGE]
    if not captions:
        report.add(BadSample(where, rid, "empty caption: no sentence has a non-empty 'raw'"))
        return None
    image = image_dir / record.get("filepath", "") / got[0]
    return PairSample(id=rid, image=image, caption=captions[0], captions=captions, source=where)


def read(root: Path, split: str, cfg: DataConfig, report: BadSampleReport) -> list[PairSample]:
    """One sample per image of `split` (train includes restval), with up to 5 captions."""
    check_split("karpathy", split, ("train", "val", "test"))
    path = _annotation_file(root, cfg)
    data = load_json(path, "Karpathy split JSON", report)
    if not isinstance(data, dict) or not isinstance(data.get("images"), list):
        raise ValueError(f"{path}: expected an object with an 'images' list (Karpathy split format)")
    wanted = {"train", "restval"} if split == "train" else {split}
    image_dir = root / "flickr30k-images" if (root / "flickr30k-images").is_dir() else root
    samples = []
    for i, record in enumerate(data["images"]):
        if isinstance(record, dict) and record.get("split") not in wanted:
            continue
        sample = _sample(record, f"{path}[images][{i}]", image_dir, report)
        if sample is not None:
            samples.append(sample)
    return samples
