"""SPEC (Peng et al., CVPR 2024) read from its release folder into a `ChoiceSet` (scored by eval.pairs.spec_scores).

The release (the `data.zip` of the Hugging Face dataset `wjpoom/SPEC`, unzipped) holds one folder per subset:
`absolute_size`, `relative_size`, `absolute_spatial`, `relative_spatial`, `existence`, `count`. Each holds
`image2text.json` and `text2image.json` beside the images; both files are JSON lists of samples with the same keys,
as the reference loader (`spec/dataset.py`) reads them:

    image2text.json   {"query": "<image path>", "keys": ["<caption>", ...], "label": <index of the true caption>}
    text2image.json   {"query": "<caption>", "keys": ["<image path>", ...], "label": <index of the true image>}

Image paths are relative to the subset folder. The two files are separate item sets (one per direction), not the
two halves of a paired item. The subset folders sit at the root given or under its `data/` folder; a root that
holds only the downloaded `data.zip` is read in place (annotations and images straight from the archive, wherever
the subset folders sit inside it), never extracted.

One `ChoiceSet` item per sample: an image-to-text item has one image and K captions, a text-to-image item one
caption and K images; `extra` keeps each item's direction and label, `groups` its subset.
"""

from __future__ import annotations

import json
import posixpath
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sharpclip.data.formats._common import load_json
from sharpclip.data.schema import BadSample, BadSampleReport
from sharpclip.eval.embed import ImageRef
from sharpclip.eval.pair_data import ChoiceSet

SPEC_SUBSETS = ("absolute_size", "relative_size", "absolute_spatial", "relative_spatial", "existence", "count")
SPEC_FILES = {"i2t": "image2text.json", "t2i": "text2image.json"}
RELEASE_ARCHIVE = "data.zip"  # what the hub repository holds (hf_hub_download(..., filename="data.zip"))


@dataclass(frozen=True)
class SubsetSource:
    """One subset's folder: on disk (`member` None) or the folder `member` (a prefix ending in '/') of the zip at
    `path`."""

    path: Path
    member: str | None = None

    def describe(self, name: str) -> str:
        """Where file `name` of the subset is, for messages."""
        return f"{self.path}!{self.member}{name}" if self.member is not None else str(self.path / name)

    def load(self, name: str, report: BadSampleReport) -> Any:
        """The subset's JSON file `name`, parsed (the file or the archive recorded in `report` as read)."""
        if self.member is None:
            return load_json(self.path / name, f"SPEC {self.path.name}", report)
        report.read_file(self.path)
        with zipfile.ZipFile(self.path) as archive:
            try:
                data = archive.read(self.member + name)
            except KeyError:
                raise FileNotFoundError(f"SPEC: {self.describe(name)} not found in the archive") from None
        try:
            return json.loads(data.decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as err:
            raise ValueError(f"{self.describe(name)}: not valid UTF-8 JSON ({err})") from None

    def image(self, relative: str) -> ImageRef:
        """The image at `relative` (a path from the subset folder)."""
        if self.member is None:
            return ImageRef(str(self.path / relative))
        return ImageRef(str(self.path), member=posixpath.normpath(self.member + relative))


def _zip_subsets(archive: Path) -> dict[str, SubsetSource]:
    """subset -> its folder inside `archive`: wherever a `<subset>/image2text.json` member sits."""
    with zipfile.ZipFile(archive) as z:
        names = z.namelist()
    found: dict[str, SubsetSource] = {}
    for name in names:
        parts = name.split("/")
        if len(parts) >= 2 and parts[-1] == SPEC_FILES["i2t"] and parts[-2] in SPEC_SUBSETS:
            found.setdefault(parts[-2], SubsetSource(archive, name[: -len(SPEC_FILES["i2t"])]))
    return {s: found[s] for s in SPEC_SUBSETS if s in found}


def spec_subsets(root: Path) -> dict[str, SubsetSource]:
    """subset -> where it is read from, for the subsets present (in the release's order): folders at `root` or
    `root/data`, else the archive `root/data.zip` (or `root` itself when it is that file)."""
    for base in (root, root / "data"):
        found = {s: SubsetSource(base / s) for s in SPEC_SUBSETS if (base / s).is_dir()}
        if found:
            return found
    archive = root if root.suffix == ".zip" else root / RELEASE_ARCHIVE
    found = _zip_subsets(archive) if archive.is_file() else {}
    if found:
        return found
    raise FileNotFoundError(
        f"SPEC: none of the subset folders {', '.join(SPEC_SUBSETS)} under {root} or {root / 'data'}, and no "
        f"{RELEASE_ARCHIVE} holding them; point the root at the download of wjpoom/SPEC (its data.zip, or unzipped)"
    )


def _sample_problem(sample: Any, direction: str) -> str | None:
    """Why a sample is not a SPEC sample of `direction`, or None."""
    if not isinstance(sample, dict) or not {"query", "keys", "label"} <= sample.keys():
        return "malformed record: needs query, keys and label"
    query, keys, label = sample["query"], sample["keys"], sample["label"]
    if not isinstance(query, str) or not query or not isinstance(keys, list) or not keys:
        return "malformed record: query must be a non-empty string and keys a non-empty list"
    if not all(isinstance(k, str) and k for k in keys):
        return "malformed record: every key must be a non-empty string"
    if isinstance(label, bool) or not isinstance(label, int) or not 0 <= label < len(keys):
        return f"malformed record: label {label!r} is not an index into its {len(keys)} keys"
    return None


def _items(
    source: SubsetSource, direction: str, report: BadSampleReport
) -> list[tuple[list[ImageRef], list[str], int]]:
    """(images, captions, label) of every good sample of one file; bad ones go to `report`."""
    where = source.describe(SPEC_FILES[direction])
    samples = source.load(SPEC_FILES[direction], report)
    if not isinstance(samples, list):
        raise ValueError(f"{where}: expected a JSON list of samples, got {type(samples).__name__}")
    out = []
    for i, sample in enumerate(samples):
        problem = _sample_problem(sample, direction)
        if problem is not None:
            report.add(BadSample(f"{where}[{i}]", str(i), problem))
            continue
        query, keys = sample["query"], sample["keys"]
        if direction == "i2t":
            out.append(([source.image(query)], list(keys), sample["label"]))
        else:
            out.append(([source.image(k) for k in keys], [query], sample["label"]))
    return out


def read_spec(root: str | Path, report: BadSampleReport | None = None) -> ChoiceSet:
    """Every SPEC subset present under `root`, both directions; malformed samples go to `report` (raising under its
    default `error` policy)."""
    report = report if report is not None else BadSampleReport("error")
    images, texts, groups, directions, labels = [], [], [], [], []
    for subset, source in spec_subsets(Path(root)).items():
        for direction in SPEC_FILES:
            for item_images, item_texts, label in _items(source, direction, report):
                images.append(item_images)
                texts.append(item_texts)
                groups.append(subset)
                directions.append(direction)
                labels.append(label)
    extra = {"direction": directions, "label": labels}
    return ChoiceSet("spec", "spec", images, texts, groups, list(report.files), extra)
