"""SPEC (Peng et al., CVPR 2024) read from its release folder into a `ChoiceSet` (scored by eval.pairs.spec_scores).

The release (the `data.zip` of the Hugging Face dataset `wjpoom/SPEC`, unzipped) holds one folder per subset:
`absolute_size`, `relative_size`, `absolute_spatial`, `relative_spatial`, `existence`, `count`. Each holds
`image2text.json` and `text2image.json` beside the images; both files are JSON lists of samples with the same keys,
as the reference loader (`spec/dataset.py`) reads them:

    image2text.json   {"query": "<image path>", "keys": ["<caption>", ...], "label": <index of the true caption>}
    text2image.json   {"query": "<caption>", "keys": ["<image path>", ...], "label": <index of the true image>}

Image paths are relative to the subset folder. The two files are separate item sets (one per direction), not the
two halves of a paired item. The subset folders sit at the root given or under its `data/` folder.

One `ChoiceSet` item per sample: an image-to-text item has one image and K captions, a text-to-image item one
caption and K images; `extra` keeps each item's direction and label, `groups` its subset.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from sharpclip.data.formats._common import load_json
from sharpclip.data.schema import BadSample, BadSampleReport
from sharpclip.eval.embed import ImageRef
from sharpclip.eval.pair_data import ChoiceSet

SPEC_SUBSETS = ("absolute_size", "relative_size", "absolute_spatial", "relative_spatial", "existence", "count")
SPEC_FILES = {"i2t": "image2text.json", "t2i": "text2image.json"}


def spec_subset_dirs(root: Path) -> dict[str, Path]:
    """subset -> its folder, for the subsets present at `root` or `root/data` (in the release's order)."""
    for base in (root, root / "data"):
        found = {s: base / s for s in SPEC_SUBSETS if (base / s).is_dir()}
        if found:
            return found
    if (root / "data.zip").is_file():  # images read one by one from a 1.5 GB archive would each reopen it
        raise FileNotFoundError(f"SPEC: {root / 'data.zip'} is the release still zipped; unzip it in {root} first")
    raise FileNotFoundError(
        f"SPEC: none of the subset folders {', '.join(SPEC_SUBSETS)} under {root} or {root / 'data'}; point the "
        "root at the unzipped data.zip of wjpoom/SPEC"
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


def _items(folder: Path, direction: str, report: BadSampleReport) -> list[tuple[list[ImageRef], list[str], int]]:
    """(images, captions, label) of every good sample of one file; bad ones go to `report`."""
    path = folder / SPEC_FILES[direction]
    samples = load_json(path, f"SPEC {folder.name}", report)
    if not isinstance(samples, list):
        raise ValueError(f"{path}: expected a JSON list of samples, got {type(samples).__name__}")
    out = []
    for i, sample in enumerate(samples):
        problem = _sample_problem(sample, direction)
        if problem is not None:
            report.add(BadSample(f"{path}[{i}]", str(i), problem))
            continue
        query, keys = sample["query"], sample["keys"]
        if direction == "i2t":
            out.append(([ImageRef(str(folder / query))], list(keys), sample["label"]))
        else:
            out.append(([ImageRef(str(folder / k)) for k in keys], [query], sample["label"]))
    return out


def read_spec(root: str | Path, report: BadSampleReport | None = None) -> ChoiceSet:
    """Every SPEC subset present under `root`, both directions; malformed samples go to `report` (raising under its
    default `error` policy)."""
    report = report if report is not None else BadSampleReport("error")
    images, texts, groups, directions, labels = [], [], [], [], []
    for subset, folder in spec_subset_dirs(Path(root)).items():
        for direction in SPEC_FILES:
            for item_images, item_texts, label in _items(folder, direction, report):
                images.append(item_images)
                texts.append(item_texts)
                groups.append(subset)
                directions.append(direction)
                labels.append(label)
    extra = {"direction": directions, "label": labels}
    return ChoiceSet("spec", "spec", images, texts, groups, list(report.files), extra)
