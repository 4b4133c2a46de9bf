"""UltraEdit (Zhao et al. 2024) on the HF hub: parquet shards whose rows are instruction-edit pairs.

Layout: `<root>/data/<Split>-0000x-of-0000y.parquet` (e.g. `FreeForm_0-00000-of-00001.parquet`, `FreeForm-...`,
`RegionBase-...`). Columns used: `idx`, `edit_prompt` (the instruction), `source_caption`, `target_caption`,
`source_image`, `edited_image` (HF Image structs `{bytes, path}`); the `clip_sim_*`, `dinov2_sim`, `ssim`,
`edit_object` and `mask_image` columns are ignored. Split `train` reads every shard; any other split name reads the
shards whose file name starts with `<split>-`.

Captions are read eagerly; image bytes stay in the file and are decoded per sample (`ParquetCell`).
Each row becomes an `EditSample` (CLIP-IN): (source_image, source_caption) vs (edited_image, target_caption).
"""

from __future__ import annotations

from pathlib import Path

from sharpclip.config import DataConfig
from sharpclip.data.formats._common import caption_ok
from sharpclip.data.schema import BadSample, BadSampleReport, EditSample, ParquetCell

TEXT = ("idx", "edit_prompt", "source_caption", "target_caption")
IMAGES = ("source_image", "edited_image")


def shards(root: Path, split: str) -> list[Path]:
    """The split's parquet shards under `root/data` (or `root`), sorted; raises when none match."""
    folder = root / "data" if (root / "data").is_dir() else root
    files = sorted(folder.glob("*.parquet"))
    if split != "train":
        files = [f for f in files if f.name.startswith(f"{split}-")]
    if not files:
        raise FileNotFoundError(f"{folder}: no UltraEdit parquet shards for split {split!r} (<split>-*.parquet)")
    return files


def _rows(path: Path, report: BadSampleReport):
    import pyarrow.parquet as pq  # optional dependency: pip install -e ".[parquet]"

    pf = pq.ParquetFile(report.read_file(path))
    missing = [c for c in (*TEXT, *IMAGES) if c not in pf.schema_arrow.names]
    if missing:
        raise ValueError(f"{path}: not an UltraEdit shard; missing column(s) {', '.join(missing)}")
    for rg in range(pf.num_row_groups):
        columns = pf.read_row_group(rg, columns=list(TEXT)).to_pydict()
        for row in range(len(columns["idx"])):
            yield rg, row, {k: columns[k][row] for k in TEXT}


def _sample(path: Path, rg: int, row: int, rec: dict, report: BadSampleReport) -> EditSample | None:
    rid = f"{path.name.split('-')[0]}/{rec['idx']}"
    where = f"{path}[row group {rg}, row {row}]"
    for key in ("source_caption", "target_caption"):
        if not caption_ok(rec[key], where, rid, report):
            return None
    if not isinstance(rec["edit_prompt"], str):
        report.add(BadSample(where, rid, "malformed record: edit_prompt is not a string"))
        return None
    cell = {c: ParquetCell(str(path), rg, row, c) for c in IMAGES}
    return EditSample(
        id=rid,
        source_image=cell["source_image"],
        edited_image=cell["edited_image"],
        source_caption=rec["source_caption"],
        target_caption=rec["target_caption"],
        instruction=rec["edit_prompt"],
        source=where,
    )


def read(root: Path, split: str, cfg: DataConfig, report: BadSampleReport) -> list[EditSample]:
    """One `EditSample` per row of the split's shards, images left in the file as `ParquetCell`s."""
    samples = []
    for path in shards(root, split):
        for rg, row, rec in _rows(path, report):
            sample = _sample(path, rg, row, rec, report)
            if sample is not None:
                samples.append(sample)
    return samples
