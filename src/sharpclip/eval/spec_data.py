"""SPEC (Peng et al., CVPR 2024) read from its release folder into a `ChoiceSet` (scored by eval.pairs.spec_scores).

The release (the `data.zip` of the Hugging Face dataset `wjpoom/SPEC`, unzipped) holds one folder per subset:
`absolute_size`, `relative_size`, `absolute_spatial`, `relative_spatial`, `existence`, `count`. Each holds
`image2text.json` and `text2image.json` beside the images; both files are JSON lists of samples with the same keys,
as the reference loader (`spec/dataset.py`) reads them:

    image2text.json   {"query": "<image path>", "keys": ["<caption>", ...], "label": <index of the true caption>}
    text2image.json   {"query": "<caption>", "keys": ["<image path>", ...], "label": <index of the true image>}

Image paths are relative to the subset folder. The two files are separate item sets (one per direction), not the
two halves of a paired item. The subset folders sit at the root given or under its `data/` folder.

All six subsets are read, and a release missing one is refused naming it: the headline means (`i2t_mean`,
`t2i_mean`, `mean`) average the subsets, so five of six would be another number under the same name. To score only
some, name them (`eval.data_options.spec.subsets=[count,existence]`); the report then lists the subsets run and
those left out. A subset file holding no samples is refused the same way.

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


SUBSETS_OPTION = "eval.data_options.spec.subsets"


def chosen_subsets(subsets: Any) -> tuple[str, ...]:
    """The subsets to read: all six when `subsets` is None or empty, else those named (in the release's order);
    a name that is not a SPEC subset raises ValueError naming the option."""
    if not subsets:
        return SPEC_SUBSETS
    if isinstance(subsets, str) or not all(isinstance(s, str) for s in subsets):
        raise ValueError(f"{SUBSETS_OPTION}: expected a list of subset names, got {subsets!r}")
    unknown = [s for s in subsets if s not in SPEC_SUBSETS]
    if unknown:
        choices = ", ".join(SPEC_SUBSETS)
        raise ValueError(f"{SUBSETS_OPTION}: {unknown[0]!r} is not a SPEC subset; choose from {choices}")
    return tuple(s for s in SPEC_SUBSETS if s in subsets)


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


def _present(root: Path, wanted: tuple[str, ...], chosen: bool) -> dict[str, Path]:
    """subset -> folder for each of `wanted`; one missing raises FileNotFoundError naming it (and, when all six were
    wanted, the option that scores fewer)."""
    found = spec_subset_dirs(root)
    missing = [s for s in wanted if s not in found]
    if missing:
        base = next(iter(found.values())).parent
        advice = (f"restore it, or name the subsets to score with {SUBSETS_OPTION}=[{','.join(found)}]"
                  if not chosen else f"restore it, or leave it out of {SUBSETS_OPTION}")  # fmt: skip
        raise FileNotFoundError(f"SPEC: subset folder {missing[0]!r} is missing from {base} ({len(missing)} of the "
                                f"{len(wanted)} subsets asked for: {', '.join(missing)}); {advice}")  # fmt: skip
    return {s: found[s] for s in wanted}


def _items(folder: Path, direction: str, report: BadSampleReport) -> list[tuple[list[ImageRef], list[str], int, str]]:
    """(images, captions, label, where: `file[index]`) of every good sample of one file; bad ones go to `report`."""
    path = folder / SPEC_FILES[direction]
    if not path.is_file():
        files = " and ".join(SPEC_FILES.values())
        raise FileNotFoundError(f"{path}: no such file; SPEC subset {folder.name!r} needs {files} (the unzipped "
                                "data.zip of wjpoom/SPEC)")  # fmt: skip
    samples = load_json(path, f"SPEC {folder.name}", report)
    if not isinstance(samples, list):
        raise ValueError(f"{path}: expected a JSON list of samples, got {type(samples).__name__}")
    if not samples:
        raise ValueError(f"{path}: holds no samples, so subset {folder.name!r} would be left out of the means; "
                         f"restore the file, or leave the subset out with {SUBSETS_OPTION}")  # fmt: skip
    out = []
    for i, sample in enumerate(samples):
        problem = _sample_problem(sample, direction)
        if problem is not None:
            report.add(BadSample(f"{path}[{i}]", str(i), problem))
            continue
        query, keys, where = sample["query"], sample["keys"], f"{path}[{i}]"
        if direction == "i2t":
            out.append(([ImageRef(str(folder / query))], list(keys), sample["label"], where))
        else:
            out.append(([ImageRef(str(folder / k)) for k in keys], [query], sample["label"], where))
    return out


def read_spec(root: str | Path, report: BadSampleReport | None = None, subsets: Any = None) -> ChoiceSet:
    """The SPEC subsets `subsets` names (default: all six, each required) under `root`, both directions; malformed
    samples go to `report` (raising under its default `error` policy). `parts` of the set: the subsets read."""
    report = report if report is not None else BadSampleReport("error")
    wanted = chosen_subsets(subsets)
    images, texts, groups, directions, labels, wheres = [], [], [], [], [], []
    for subset, folder in _present(Path(root), wanted, chosen=bool(subsets)).items():
        for direction in SPEC_FILES:
            for item_images, item_texts, label, where in _items(folder, direction, report):
                images.append(item_images)
                texts.append(item_texts)
                groups.append(subset)
                directions.append(direction)
                labels.append(label)
                wheres.append(where)
    extra = {"direction": directions, "label": labels, "where": wheres}  # where: each item's record, for messages
    return ChoiceSet("spec", "spec", images, texts, groups, list(report.files), extra, parts=list(wanted))
