"""Long-DCI (TULIP, Najdenkoska et al.): `dci_long.csv`, tab-separated, header `filepath<TAB>title`.

Built by TULIP from DCI's `annotations/*.json` (sorted), `title` = the full `extra_caption` (no short caption), rows
with an empty `extra_caption` dropped (`len == 0`: a whitespace-only one is written, and kept here, since TULIP's
`pd.read_csv` evaluator scores it). Images are opened at `<root>/<filepath>`, or `<root>/photos/<filepath>` when
`root` is DCI's dataset folder. Test only: all-vs-all retrieval, R@1/5/10.
"""

from __future__ import annotations

import csv
from pathlib import Path

from sharpclip.config import DataConfig
from sharpclip.data.formats._common import caption_ok, check_split, fields, require_file
from sharpclip.data.schema import BadSampleReport, PairSample

TSV = "dci_long.csv"


def read(root: Path, split: str, cfg: DataConfig, report: BadSampleReport) -> list[PairSample]:
    """Long-DCI samples in `dci_long.csv` row order."""
    check_split("long_dci", split, ("test", "all"))
    path = require_file(root / (cfg.annotation_file or TSV), "Long-DCI dci_long.csv")
    image_dir = root / "photos" if (root / "photos").is_dir() else root
    samples = []
    with open(report.read_file(path), encoding="utf-8", newline="") as f:
        reader = csv.DictReader(f, delimiter="\t")  # quoted fields may hold newlines, as pandas writes them
        if reader.fieldnames is None or not {"filepath", "title"} <= set(reader.fieldnames):
            raise ValueError(f"{path}: expected a tab-separated header 'filepath<TAB>title', got {reader.fieldnames}")
        for i, row in enumerate(reader):
            where = f"{path}:row {i + 1}"
            got = fields(row, ("filepath", "title"), where, str(i), report)
            if got is None or not caption_ok(got[1], where, Path(got[0]).stem, report, blank_ok=True):
                continue
            samples.append(PairSample(id=Path(got[0]).stem, image=image_dir / got[0], caption=got[1], source=where))
    return samples
