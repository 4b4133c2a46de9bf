"""Pair-choice benchmarks in their Hugging Face hub layouts, read from a local download into a `ChoiceSet`.

SugarCrepe, `HuggingFaceM4/SugarCrepe_<subset>` (seven repositories: add_att, add_obj, replace_att, replace_obj,
replace_rel, swap_att, swap_obj): `data/test-00000-of-00001-<hash>.parquet` with columns `image` (an HF Image
struct, the COCO val2017 picture embedded), `tested_labels` = [positive caption, negative caption] (the release
JSON's `caption`, `negative_caption`, in that order) and `true_label` (a ClassLabel over all captions; not needed).
Rows are in the release JSON's order. The eval root holds one folder per subset, named `SugarCrepe_<subset>` (or
the hub cache's `datasets--HuggingFaceM4--SugarCrepe_<subset>`); a root that is one such folder reads that subset.
MMVP-VLM's hub repository (`MMVP/MMVP_VLM`: `Questions.csv` + `MLLM_VLM Images/`) is the release layout that
`pair_data.read_mmvp` reads as it is.
"""

from __future__ import annotations

from pathlib import Path

from sharpclip.data.formats.hf import resolve_hub_folder
from sharpclip.data.schema import ParquetCell
from sharpclip.eval.pair_data import SUGARCREPE_SUBSETS, ChoiceSet, read_sugarcrepe

HUB_PREFIX = "SugarCrepe_"
CACHE_PREFIX = "datasets--HuggingFaceM4--SugarCrepe_"


def sugarcrepe_hub_folders(root: Path) -> dict[str, Path]:
    """subset -> its repository folder (snapshot resolved) found at or under `root`, in the release's subset order."""
    found = {}
    for subset in SUGARCREPE_SUBSETS:
        for name in (f"{HUB_PREFIX}{subset}", f"{CACHE_PREFIX}{subset}"):
            if root.name == name:
                found[subset] = resolve_hub_folder(root)
            elif (root / name).is_dir():
                found[subset] = resolve_hub_folder(root / name)
    return {s: p for s, p in found.items() if sorted(p.glob("data/*.parquet"))}


def read_sugarcrepe_hub(root: str | Path) -> ChoiceSet:
    """The SugarCrepe subsets present in hub layout under `root`; images stay in the parquet files until embedded."""
    import pyarrow.parquet as pq  # optional dependency (extra [parquet]): only the hub layout is parquet

    folders = sugarcrepe_hub_folders(Path(root))
    if not folders:
        raise FileNotFoundError(f"SugarCrepe: no {HUB_PREFIX}<subset>/data/*.parquet under {root}")
    images, texts, groups, files = [], [], [], []
    for subset, folder in folders.items():
        for path in sorted(folder.glob("data/*.parquet")):
            pf = pq.ParquetFile(path)
            if not {"image", "tested_labels"} <= set(pf.schema_arrow.names):
                raise ValueError(f"{path}: not a SugarCrepe hub shard (columns {pf.schema_arrow.names})")
            files.append(path)
            for rg in range(pf.num_row_groups):
                labels = pf.read_row_group(rg, columns=["tested_labels"]).column(0).to_pylist()
                for row, pair in enumerate(labels):
                    if not isinstance(pair, list) or len(pair) != 2:
                        where = f"{path}[row group {rg}, row {row}]"
                        raise ValueError(f"{where}: tested_labels is not [positive caption, negative caption]")
                    images.append([ParquetCell(str(path), rg, row, "image")])
                    texts.append([pair[0], pair[1]])
                    groups.append(subset)
    return ChoiceSet("sugarcrepe", "sugarcrepe", images, texts, groups, files)


def read_sugarcrepe_any(root: str | Path) -> ChoiceSet:
    """The hub layout when present under `root`, else the release JSON files (pair_data.read_sugarcrepe)."""
    return read_sugarcrepe_hub(root) if sugarcrepe_hub_folders(Path(root)) else read_sugarcrepe(root)
