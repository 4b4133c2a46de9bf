"""Readers for the pair-choice benchmarks' released files, into one `ChoiceSet` shape (docs/evaluation.md).

Each item has a few images and a few captions; the evaluator scores every caption against every image of its item,
giving a (N, n_texts, n_images) tensor that eval/pairs.py scores. Layouts read here:

- MMVP-VLM: `Questions.csv` (Question ID, Type, Statement), images `MLLM_VLM Images/<Type of row 1>/<qid>.jpg`;
  consecutive rows form a pair; texts are "a photo of " + statement; the category is the CSV position (k // 15).
- Winoground: `examples.jsonl` ({id, image_0, image_1, caption_0, caption_1, ...}) with `images/<stem>.png`, at the
  root (flat) or as the HF hub snapshot of `facebook/winoground` has them: `data/examples.jsonl` with
  `data/images.zip` (read in place, never extracted) or the zip extracted to `data/images/`.
- SugarCrepe: `<name>.json` files {id: {filename, caption, negative_caption}}; images in a COCO val2017 folder.
- SynthDense MMVP-style pairs: `mmvp.jsonl` from data.synthdense.corpus.generate, two rows per pair.
- ARO: `visual_genome_relation.json` / `visual_genome_attribution.json` and `images/`; each item is cropped to its bbox.
"""

from __future__ import annotations

import csv
import json
import zipfile
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from sharpclip.data.formats._common import release_dir
from sharpclip.data.schema import BadSample, BadSampleReport
from sharpclip.eval.embed import ImageRef
from sharpclip.eval.pairs import mmvp_categories_by_position

SUGARCREPE_SUBSETS = ("add_att", "add_obj", "replace_att", "replace_obj", "replace_rel", "swap_att", "swap_obj")
MMVP_PROMPT = "a photo of "


@dataclass
class ChoiceSet:
    """Items of a pair-choice benchmark. kind picks the scorer: mmvp | winoground | sugarcrepe | aro_relation |
    aro_attribution | spec. groups: per item label (pattern, subset, relation, attribute pair), files: what was read."""

    name: str
    kind: str
    images: list[list[ImageRef]]
    texts: list[list[str]]
    groups: list[Any]
    files: list[Path] = field(default_factory=list)
    extra: dict[str, Any] = field(default_factory=dict)  # per-item lists (MMVP: qids)
    skipped: list[BadSample] = field(default_factory=list)  # items left out under on_bad_sample: skip
    parts: list[str] = field(default_factory=list)  # the parts a suite read, when it is read in parts (SPEC's subsets)

    def __len__(self) -> int:
        return len(self.texts)


def _need(path: Path, what: str) -> Path:
    if not path.exists():
        raise FileNotFoundError(f"{what}: {path} not found; point --data-root at the benchmark's release folder")
    return path


def read_mmvp(root: str | Path) -> ChoiceSet:
    """MMVP-VLM from its release folder (Questions.csv + 'MLLM_VLM Images/')."""
    root = Path(root)
    csv_path = _need(root / "Questions.csv", "MMVP-VLM")
    image_dir = _need(root / "MLLM_VLM Images", "MMVP-VLM images")
    with csv_path.open(newline="") as f:
        rows = list(csv.reader(f))[1:]
    if len(rows) % 2:
        raise ValueError(f"{csv_path}: {len(rows)} question rows, expected an even number (consecutive pairs)")
    images, texts, qids = [], [], []
    for r1, r2 in zip(rows[0::2], rows[1::2], strict=True):
        (q1, type1, st1), (q2, _, st2) = r1[:3], r2[:3]
        images.append([ImageRef(str(image_dir / type1 / f"{int(q)}.jpg")) for q in (q1, q2)])
        texts.append([MMVP_PROMPT + st1, MMVP_PROMPT + st2])
        qids.append((int(q1), int(q2)))
    groups = mmvp_categories_by_position(len(texts))
    return ChoiceSet("mmvp", "mmvp", images, texts, groups, [csv_path], {"qids": qids})


def mmvp_set_from_pairs(name: str, pairs: Sequence[tuple[Any, Any, str, str, str]]) -> ChoiceSet:
    """MMVP-style pairs from any source (SynthDense): (image_a, image_b, caption_a, caption_b, pattern) with caption_a
    describing image_a. Scored like MMVP-VLM, per pattern."""
    images = [
        [a if isinstance(a, ImageRef) else ImageRef(str(a)), b if isinstance(b, ImageRef) else ImageRef(str(b))]
        for a, b, *_ in pairs
    ]
    return ChoiceSet(name, "mmvp", images, [[ca, cb] for _, _, ca, cb, _ in pairs], [p[4] for p in pairs])


def read_synth_mmvp(root: str | Path) -> ChoiceSet:
    """SynthDense's MMVP-style pairs: `mmvp.jsonl` rows {id, image, caption, group, pattern}, two per group (image a,
    then image b), each caption true of its own image; images relative to `root`."""
    root = Path(root)
    path = _need(root / "mmvp.jsonl", "SynthDense MMVP pairs")
    groups: dict[str, list[dict]] = {}
    for line_no, line in enumerate(path.read_text().splitlines(), 1):
        if line.strip():
            try:
                row = json.loads(line)
                groups.setdefault(row["group"], []).append(row)
            except (KeyError, json.JSONDecodeError) as err:
                raise ValueError(f"{path}:{line_no}: not a SynthDense MMVP row ({err})") from None
    bad = [g for g, rows in groups.items() if len(rows) != 2]
    if bad:
        raise ValueError(f"{path}: group {bad[0]!r} has {len(groups[bad[0]])} rows, expected 2 (one per image)")
    pairs = [
        (root / a["image"], root / b["image"], a["caption"], b["caption"], a["pattern"]) for a, b in groups.values()
    ]
    cs = mmvp_set_from_pairs("synth_mmvp", pairs)
    cs.files = [path]
    return cs


IMAGE_EXTENSIONS = (".png", ".jpg", ".jpeg")  # Winoground's images are PNG (some RGBA)


def _find_image(folder: Path, stem: str) -> ImageRef:
    for ext in IMAGE_EXTENSIONS:
        if (folder / f"{stem}{ext}").exists():
            return ImageRef(str(folder / f"{stem}{ext}"))
    raise FileNotFoundError(f"no image {stem}.png/.jpg in {folder}")


def winoground_images(base: Path) -> tuple[Any, list[Path]]:
    """(stem -> ImageRef, the archive read if any) for a Winoground folder: `images/`, else `images.zip`, whose
    members (`images/<stem>.png`, or at the zip's top level) are read in place."""
    if (base / "images").is_dir():
        return lambda stem: _find_image(base / "images", stem), []
    archive = base / "images.zip"
    if not archive.is_file():
        raise FileNotFoundError(f"Winoground: neither {base / 'images'}/ nor {archive} found")
    with zipfile.ZipFile(archive) as z:
        members = {Path(n).stem: n for n in z.namelist() if Path(n).suffix.lower() in IMAGE_EXTENSIONS}

    def find(stem: str) -> ImageRef:
        if stem not in members:
            raise FileNotFoundError(f"no image {stem}.png/.jpg in {archive}")
        return ImageRef(str(archive), member=members[stem])

    return find, [archive]


def read_winoground(root: str | Path, report: BadSampleReport | None = None) -> ChoiceSet:
    """Winoground from `examples.jsonl` + `images/` (or `images.zip`), at `root` or `root/data` (the HF layout).

    A line that is not a Winoground example, or whose image is missing, goes to `report` (raising under its
    default `error` policy; under `skip` the example is left out and counted)."""
    report = report if report is not None else BadSampleReport("error")
    base = release_dir(Path(root), "examples.jsonl", "Winoground")
    path = report.read_file(base / "examples.jsonl")
    find, archives = winoground_images(base)
    images, texts = [], []
    with path.open(encoding="utf-8") as f:
        for line_no, line in enumerate(f, 1):
            if not line.strip():
                continue
            ex: Any = None
            try:
                ex = json.loads(line)
                pair = [find(ex[k]) for k in ("image_0", "image_1")]
                captions = [ex["caption_0"], ex["caption_1"]]
            except (KeyError, TypeError, json.JSONDecodeError, FileNotFoundError) as err:
                kind = "missing file" if isinstance(err, FileNotFoundError) else "malformed record"
                rid = str(ex.get("id", "?")) if isinstance(ex, dict) else "?"
                report.add(BadSample(f"{path}:{line_no}", rid, f"{kind}: not a Winoground example ({err})"))
                continue
            images.append(pair)
            texts.append(captions)
    return ChoiceSet("winoground", "winoground", images, texts, [""] * len(texts), [path, *archives])


def read_sugarcrepe(root: str | Path, image_dir: str | Path | None = None) -> ChoiceSet:
    """SugarCrepe: the subset files present under `root` (or `root/data`), images in `image_dir` (default
    `root/val2017`)."""
    root = Path(root)
    data = root / "data" if (root / "data").is_dir() else root
    files = [data / f"{s}.json" for s in SUGARCREPE_SUBSETS if (data / f"{s}.json").exists()]
    if not files:
        raise FileNotFoundError(f"SugarCrepe: none of {', '.join(SUGARCREPE_SUBSETS)}.json under {data}")
    img_dir = Path(image_dir) if image_dir else root / "val2017"
    images, texts, groups = [], [], []
    for path in files:
        for key, item in json.loads(path.read_text()).items():
            if not {"filename", "caption", "negative_caption"} <= item.keys():
                raise ValueError(f"{path}: item {key!r} lacks filename/caption/negative_caption")
            images.append([ImageRef(str(img_dir / item["filename"]))])
            texts.append([item["caption"], item["negative_caption"]])
            groups.append(path.stem)
    return ChoiceSet("sugarcrepe", "sugarcrepe", images, texts, groups, files)


def read_aro(root: str | Path, which: str) -> ChoiceSet:
    """ARO VG-Relation (`which="relation"`) or VG-Attribution (`"attribution"`); captions are [false, true]."""
    if which not in ("relation", "attribution"):
        raise ValueError(f"ARO: which must be 'relation' or 'attribution', got {which!r}")
    root = Path(root)
    path = _need(root / f"visual_genome_{which}.json", f"ARO VG-{which}")
    images, texts, groups = [], [], []
    for i, item in enumerate(json.loads(path.read_text())):
        try:
            bbox = (item["bbox_x"], item["bbox_y"], item["bbox_w"], item["bbox_h"])
            images.append([ImageRef(str(root / "images" / item["image_path"]), bbox)])
            texts.append([item["false_caption"], item["true_caption"]])
            groups.append(item["relation_name"] if which == "relation" else tuple(item["attributes"][:2]))
        except (KeyError, TypeError) as err:
            raise ValueError(f"{path}: item {i} lacks field {err}") from None
    return ChoiceSet(f"aro_{which}", f"aro_{which}", images, texts, groups, [path])
