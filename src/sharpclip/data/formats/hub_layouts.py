"""Benchmarks as their Hugging Face hub repositories hold them, read from a local download (never fetched here).

- Urban-1K, `BeichenZhang/Urban1k`: one `Urban1k.zip` (`Urban1k/image/N.jpg`, `Urban1k/caption/N.txt`), read from
  the archive without extracting it (1,000 images, about 80 MB, held encoded in memory).
- DOCCI, `google/docci`: `<split>.csv` files (train, test, qual_dev, qual_test) beside `images.tar.gz`, whose
  `images/` folder must be extracted first (a .tar.gz has no random access). The CSV columns are taken to be the
  descriptions file's fields (`example_id`, `image_file`, `description`); another header is refused, naming it.
  Earlier revisions of the repository hold `docci_descriptions.jsonlines`, which the DOCCI reader reads as is.
- A hub cache folder (`datasets--owner--name/snapshots/<revision>/`) stands for its newest snapshot (hf.py).
"""

from __future__ import annotations

import csv
import zipfile
from pathlib import Path

from sharpclip.data.formats._common import caption_ok
from sharpclip.data.schema import BadSample, BadSampleReport, PairSample

URBAN1K_ZIPS = ("Urban1k.zip", "Urban-1k.zip")  # the repository's file; an earlier revision's name
DOCCI_COLUMNS = ("example_id", "image_file", "description")


def urban1k_zip(root: Path) -> Path | None:
    """The Urban-1K archive in `root`, if the hub download is there unextracted."""
    return next((root / n for n in URBAN1K_ZIPS if (root / n).is_file()), None)


def _number(name: str) -> tuple[int, str]:
    stem = Path(name).stem
    return (int(stem), "") if stem.isdigit() else (1 << 62, stem)


def read_urban1k_zip(path: Path, report: BadSampleReport) -> list[PairSample]:
    """Urban-1K samples from the zip, in numeric order; each caption is its file's first line."""
    report.read_file(path)
    samples = []
    with zipfile.ZipFile(path) as archive:
        names = set(archive.namelist())
        captions = sorted((n for n in names if "/caption/" in n and n.endswith(".txt")), key=_number)
        for name in captions:
            stem = Path(name).stem
            where = f"{path}!{name}"
            image = name.replace("/caption/", "/image/")[: -len(".txt")] + ".jpg"
            if image not in names:
                report.add(BadSample(where, stem, f"missing file: {image} is not in the archive"))
                continue
            lines = archive.read(name).decode("utf-8", errors="replace").splitlines()
            if caption_ok(lines[0] if lines else "", where, stem, report):
                samples.append(PairSample(id=stem, image=archive.read(image), caption=lines[0], source=f"{where}:1"))
    return samples


def docci_split_csv(root: Path, split: str) -> Path | None:
    """`<root>/<split>.csv` of the hub layout, if present."""
    path = root / f"{split}.csv"
    return path if path.is_file() else None


def read_docci_csv(root: Path, split: str, report: BadSampleReport) -> list[PairSample]:
    """DOCCI samples of one hub CSV, in file order, images under `<root>/images/`."""
    images = root / "images"
    if not images.is_dir():
        raise FileNotFoundError(f"{root}: no images/ folder; extract the hub's images.tar.gz there (tar xzf)")
    path = report.read_file(root / f"{split}.csv")
    samples = []
    with open(path, encoding="utf-8", newline="") as f:
        reader = csv.DictReader(f)
        if reader.fieldnames is None or not set(DOCCI_COLUMNS) <= set(reader.fieldnames):
            raise ValueError(f"{path}: expected columns {', '.join(DOCCI_COLUMNS)}, got {reader.fieldnames}")
        for i, row in enumerate(reader):
            where, rid = f"{path}:row {i + 1}", row.get("example_id") or str(i)
            if caption_ok(row["description"], where, rid, report):
                image = images / row["image_file"]
                samples.append(PairSample(id=rid, image=image, caption=row["description"], source=where))
    return samples
