"""COCO / Flickr30k / Flickr8k in Karpathy's split JSON (`dataset_coco.json`, `dataset_flickr30k.json`, ...).

`{"images": [{"filepath"?, "filename", "imgid", "split": train|restval|val|test, "sentences": [{"raw", ...}]}]}`.
Images at `<root>/<filepath>/<filename>` (COCO: `val2014/...`) or, without `filepath`, `<root>/<filename>`
(`<root>/flickr30k-images/` when that folder exists). Split `train` includes `restval`, as is standard.
Each image keeps its first 5 captions (some COCO images have 6-7): short-caption retrieval scores image i against
captions 5i..5i+4 (Long-CLIP `coco.py`). `data.caption_choice` picks the training caption.

`data.coco_flickr_protocol` picks the image set of the test split:
- `karpathy` (default): the Karpathy JSON's split (COCO 5k test, Flickr30k 1k test), the usual short-caption tables;
- `longclip`: the sets Long-CLIP (`eval/retrieval/coco.py`, `flickr30k.py`) and TULIP score. COCO: val2017 from
  COCO's own `annotations/captions_val2017.json` (5,000 images in image-id order, each with its first 5 captions in
  the file's order, as torchvision's `CocoCaptions`), images in `val2017/`. Flickr30k: every line of
  `results_20130124.token` (`<name>.jpg#k<TAB>caption`; 31,783 images × 5), consecutive lines of one image grouped,
  images in `flickr30k-images/`.
Captions are grouped per image here, in the reader, because these formats are multi-caption by design; no other
format ever merges records.
"""

from __future__ import annotations

from pathlib import Path

from sharpclip.config import DataConfig
from sharpclip.data.formats._common import check_split, fields, load_json, require_file
from sharpclip.data.schema import BadSample, BadSampleReport, PairSample
from sharpclip.data.text import is_blank

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
    captions = [r.strip() for r in raws if isinstance(r, str) and not is_blank(r)][:CAPTIONS_PER_IMAGE]
    if not captions:
        report.add(BadSample(where, rid, "empty caption: no sentence has a non-empty 'raw'"))
        return None
    image = image_dir / record.get("filepath", "") / got[0]
    return PairSample(id=rid, image=image, caption=captions[0], captions=captions, source=where)


COCO_VAL2017 = ("annotations/captions_val2017.json", "captions_val2017.json")
FLICKR_TOKENS = ("results_20130124.token", "flickr30k/results_20130124.token")


def _first_file(root: Path, names: tuple[str, ...]) -> Path | None:
    return next((root / n for n in names if (root / n).is_file()), None)


def _grouped(name: str, captions: list[str], image: Path, where: str) -> PairSample:
    return PairSample(id=name, image=image, caption=captions[0], captions=captions[:CAPTIONS_PER_IMAGE], source=where)


def read_coco_val2017(path: Path, root: Path, report: BadSampleReport) -> list[PairSample]:
    """COCO val2017 as torchvision's CocoCaptions reads it: images by sorted id, captions in file order."""
    data = load_json(path, "COCO captions_val2017.json", report)
    if not isinstance(data, dict) or not isinstance(data.get("images"), list) or "annotations" not in data:
        raise ValueError(f"{path}: expected COCO's caption format (an object with 'images' and 'annotations')")
    captions: dict[object, list[str]] = {}
    for ann in data["annotations"]:
        if isinstance(ann, dict) and isinstance(ann.get("caption"), str):
            captions.setdefault(ann.get("image_id"), []).append(ann["caption"])
    image_dir = root / "val2017" if (root / "val2017").is_dir() else root
    samples = []
    for image in sorted((i for i in data["images"] if isinstance(i, dict)), key=lambda i: i.get("id", 0)):
        where, rid = f"{path}[images][id {image.get('id')}]", str(image.get("id", "?"))
        if not captions.get(image.get("id")):
            report.add(BadSample(where, rid, "empty caption: no annotation for this image"))
            continue
        samples.append(_grouped(rid, captions[image["id"]], image_dir / str(image.get("file_name")), where))
    return samples


def read_flickr_tokens(path: Path, root: Path, report: BadSampleReport) -> list[PairSample]:
    """Every image of Flickr30k's `results_20130124.token`, in file order, its lines' captions grouped."""
    image_dir = root / "flickr30k-images" if (root / "flickr30k-images").is_dir() else root
    groups: dict[str, tuple[str, list[str]]] = {}
    with open(report.read_file(path), encoding="utf-8") as f:
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue
            key, sep, caption = line.rstrip("\n").partition("\t")
            if not sep or "#" not in key:
                report.add(BadSample(f"{path}:{lineno}", "?", "malformed record: expected '<image>#k<TAB>caption'"))
                continue
            name = key.rsplit("#", 1)[0]
            groups.setdefault(name, (f"{path}:{lineno}", []))[1].append(caption)
    return [_grouped(Path(n).stem, caps, image_dir / n, where) for n, (where, caps) in groups.items()]


def _read_longclip(root: Path, split: str, report: BadSampleReport) -> list[PairSample]:
    if split != "test":
        raise ValueError(f"karpathy: data.coco_flickr_protocol=longclip is a test protocol; split {split!r} has none")
    coco = _first_file(root, COCO_VAL2017)
    if coco is not None:
        return read_coco_val2017(coco, root, report)
    flickr = _first_file(root, FLICKR_TOKENS)
    if flickr is not None:
        return read_flickr_tokens(flickr, root, report)
    raise FileNotFoundError(
        f"{root}: data.coco_flickr_protocol=longclip needs COCO's annotations/captions_val2017.json (with val2017/) "
        "or Flickr30k's results_20130124.token (with flickr30k-images/)"
    )


def read(root: Path, split: str, cfg: DataConfig, report: BadSampleReport) -> list[PairSample]:
    """One sample per image of `split` (train includes restval), with up to 5 captions; under
    `data.coco_flickr_protocol=longclip`, COCO val2017 or the whole Flickr30k as the test split."""
    check_split("karpathy", split, ("train", "val", "test"))
    if cfg.coco_flickr_protocol == "longclip":
        return _read_longclip(root, split, report)
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
