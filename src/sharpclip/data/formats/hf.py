"""Hugging Face datasets on disk: a `save_to_disk` folder, or parquet shards as the hub (and its cache) holds them.

Layouts (`data.root`; a hub cache folder `datasets--owner--name` resolves to its newest snapshot):
- `save_to_disk` of a `DatasetDict`: `dataset_dict.json` + `<split>/` folders; of a `Dataset`: `state.json` +
  `data-0000x-of-0000y.arrow` (Arrow stream files, memory-mapped: pages are read only when a cell is);
- hub parquet: `data/<split>-0000x-of-0000y[-hash].parquet`, `data/<split>/*.parquet`, `<split>/*.parquet`,
  `default/<split>/*.parquet` (the `refs/convert/parquet` layout), or one `.parquet` file as data.root; else the
  split-name rules `datasets.load_dataset(folder)` applies to a folder of parquet files: a folder name, else a file
  name, holding the split's keyword between separators (`-._ ` or digits) anywhere below data.root
  (`train.parquet`, `data/train.parquet`, `test-0.parquet`, `val/part-1.parquet`), where `train` also reads
  `training`, `validation` reads `valid`, `dev`, `val`, and `test` reads `testing`, `eval`, `evaluation`; when no
  name says a split, every parquet file is the train split. Several files of one split are its shards, in name order.

Columns, renamable as in the generic format: `data.image_field` (an HF Image struct `{bytes, path}`, binary, or a
path string relative to data.root), `data.caption_field` (a string, or a list = several captions),
`data.short_caption_field`, `data.id_field` (default: the row number) and `data.group_field`, each optional but the
first two. Text columns are read per row group; images stay in the file (`ParquetCell` / `ArrowCell`) until a
worker decodes them, so memory does not grow with the dataset. An Image struct with no bytes uses its path.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from sharpclip.config import DataConfig
from sharpclip.data.formats._common import caption_ok, field_mismatch
from sharpclip.data.schema import ArrowCell, BadSample, BadSampleReport, ImageSource, PairSample, ParquetCell
from sharpclip.data.text import is_blank


def resolve_hub_folder(root: Path) -> Path:
    """A hub cache folder (`datasets--o--n`, holding `snapshots/<revision>/`) → its newest snapshot; else `root`."""
    snapshots = root / "snapshots"
    if snapshots.is_dir():
        found = sorted((p for p in snapshots.iterdir() if p.is_dir()), key=lambda p: p.stat().st_mtime)
        if found:
            return found[-1]
    return root


def is_save_to_disk(root: Path) -> bool:
    """True for a `save_to_disk` folder (a Dataset's or a DatasetDict's)."""
    return (root / "dataset_dict.json").is_file() or (root / "state.json").is_file()


# datasets' split keywords (data_files.SPLIT_KEYWORDS): each group names one split
SPLIT_KEYWORDS = (
    ("train", "training"),
    ("validation", "valid", "dev", "val"),
    ("test", "testing", "eval", "evaluation"),
)
SEPARATORS = "-._ 0-9"  # what may stand around a keyword in a file or folder name


def parquet_files(root: Path, split: str) -> list[Path]:
    """The split's parquet shards in the hub layouts of the module docstring (sorted); [] when none."""
    if root.is_file() and root.suffix == ".parquet":
        return [root]
    for folder, pattern in (
        (root / "data", f"{split}-*.parquet"),
        (root / "data" / split, "*.parquet"),
        (root / split, "*.parquet"),
        (root / "default" / split, "*.parquet"),
        (root, f"{split}-*.parquet"),
    ):
        files = sorted(folder.glob(pattern)) if folder.is_dir() else []
        if files:
            return files
    return _files_by_keyword(root, split) if root.is_dir() else []


def _keywords(split: str) -> tuple[str, ...]:
    return next((group for group in SPLIT_KEYWORDS if split in group), (split,))


def _says(name: str, keywords: tuple[str, ...]) -> bool:
    """True when `name` holds one of `keywords` between separators (or the name's ends)."""
    return any(re.search(rf"(^|[{SEPARATORS}]){re.escape(k)}($|[{SEPARATORS}])", name) for k in keywords)


def _files_by_keyword(root: Path, split: str) -> list[Path]:
    """The split's files by datasets' rules: folder names first, then file names, else all files are train."""
    files = sorted(p for p in root.rglob("*.parquet") if p.is_file())
    groups = {*SPLIT_KEYWORDS, _keywords(split)}
    for names in (lambda p: p.relative_to(root).parts[:-1], lambda p: (p.name,)):
        found = {g: [p for p in files if any(_says(n, g) for n in names(p))] for g in groups}
        if any(found.values()):
            return found[_keywords(split)]
    return files if _keywords(split) == SPLIT_KEYWORDS[0] else []


def _arrow_files(root: Path, split: str) -> list[Path]:
    folder = root
    if (root / "dataset_dict.json").is_file():
        splits = json.loads((root / "dataset_dict.json").read_text(encoding="utf-8")).get("splits", [])
        if split not in splits:
            raise ValueError(f"{root}: split {split!r} not in this DatasetDict (it has {', '.join(splits)})")
        folder = root / split
    state = json.loads((folder / "state.json").read_text(encoding="utf-8"))
    saved = state.get("_split")
    if folder == root and saved and saved != split:  # one Dataset, saved from one split: not another split's data
        raise ValueError(
            f"{root}: this save_to_disk Dataset holds split {saved!r}, not {split!r}; save the other split too "
            "(DatasetDict.save_to_disk) or set data.train_split / data.eval_split (train.eval_every=0: no validation)"
        )
    return [folder / f["filename"] for f in state.get("_data_files", [])]


def _columns(names: list[str], cfg: DataConfig, where: Path) -> list[str]:
    problem = field_mismatch(str(where), "column", names, cfg)
    if problem is not None:
        raise ValueError(problem)
    optional = (cfg.short_caption_field, cfg.id_field, cfg.group_field)
    return [cfg.caption_field, *(c for c in optional if c in names)]


def _pyarrow():
    try:  # an optional dependency (extra [parquet]): imported only when a parquet / Arrow folder is read
        import pyarrow
        import pyarrow.parquet
    except ImportError as err:
        raise ImportError("data.format: hf reads with pyarrow: pip install 'sharpclip[parquet]'") from err
    return pyarrow


def _image_kind(schema, column: str) -> str:
    import pyarrow as pa  # optional (extra [parquet]); _pyarrow() has checked it is there

    kind = schema.field(column).type
    if pa.types.is_struct(kind):
        return "struct"
    return "path" if pa.types.is_string(kind) or pa.types.is_large_string(kind) else "binary"


def _parquet_rows(path: Path, cfg: DataConfig, report: BadSampleReport) -> Iterator[tuple[str, dict, ImageSource]]:
    pf = _pyarrow().parquet.ParquetFile(report.read_file(path))
    text = _columns(pf.schema_arrow.names, cfg, path)
    kind = _image_kind(pf.schema_arrow, cfg.image_field)
    read = text + ([cfg.image_field] if kind == "path" else [])
    for rg in range(pf.num_row_groups):
        columns = pf.read_row_group(rg, columns=read).to_pydict()
        for row in range(pf.metadata.row_group(rg).num_rows):
            rec = {k: columns[k][row] for k in read}
            image = rec.pop(cfg.image_field) if kind == "path" else ParquetCell(str(path), rg, row, cfg.image_field)
            yield f"{path}[row group {rg}, row {row}]", rec, image


def _arrow_rows(path: Path, cfg: DataConfig, report: BadSampleReport) -> Iterator[tuple[str, dict, ImageSource]]:
    pa = _pyarrow()
    table = pa.ipc.open_stream(pa.memory_map(str(report.read_file(path)))).read_all()
    text = _columns(table.schema.names, cfg, path)
    kind = _image_kind(table.schema, cfg.image_field)
    columns = {k: table.column(k).to_pylist() for k in text}
    image = table.column(cfg.image_field).combine_chunks()
    paths = image.field("path").to_pylist() if kind == "struct" else image.to_pylist() if kind == "path" else None
    has_bytes = image.field("bytes").is_valid().to_pylist() if kind == "struct" else None
    for row in range(table.num_rows):
        rec = {k: columns[k][row] for k in text}
        if kind == "binary" or (kind == "struct" and has_bytes[row]):
            source: ImageSource = ArrowCell(str(path), row, cfg.image_field)
        else:
            source = paths[row]
        yield f"{path}[row {row}]", rec, source


def _resolve(image: ImageSource, root: Path) -> ImageSource | None:
    if isinstance(image, str):
        return Path(image) if Path(image).is_absolute() else root / image
    return image


def _sample(where: str, n: int, rec: dict, image: Any, root: Path, cfg: DataConfig, report: BadSampleReport):
    rid = str(rec.get(cfg.id_field, n))
    if image is None:
        report.add(BadSample(where, rid, "missing file: the image cell has neither bytes nor a path"))
        return None
    caption = rec[cfg.caption_field]
    captions = caption if isinstance(caption, list) else None
    texts = captions if captions is not None else [caption]
    if not texts or not all(caption_ok(t, where, rid, report) for t in texts):
        return None
    short, group = rec.get(cfg.short_caption_field), rec.get(cfg.group_field)
    return PairSample(
        id=rid,
        image=_resolve(image, root),
        caption=texts[0],
        short_caption=short if isinstance(short, str) and not is_blank(short) else None,
        captions=captions,
        group=None if group is None else str(group),
        source=where,
    )


def read(root: Path, split: str, cfg: DataConfig, report: BadSampleReport) -> list[PairSample]:
    """One `PairSample` per row of the split, in file and row order; images left in the files."""
    root = resolve_hub_folder(root)
    if is_save_to_disk(root):
        files, rows = _arrow_files(root, split), _arrow_rows
    else:
        files, rows = parquet_files(root, split), _parquet_rows
    if not files:
        raise FileNotFoundError(
            f"{root}: no Hugging Face dataset for split {split!r} (a save_to_disk folder with state.json or "
            f"dataset_dict.json, or parquet files whose folder or file name says the split, e.g. "
            f"data/{split}-00000-of-00001.parquet or {split}.parquet); set data.train_split / data.eval_split to a "
            "split the folder has"
        )
    samples, n = [], 0
    base = root if root.is_dir() else root.parent
    for path in files:
        for where, rec, image in rows(path, cfg, report):
            sample = _sample(where, n, rec, image, base, cfg, report)
            n += 1
            if sample is not None:
                samples.append(sample)
    return samples
