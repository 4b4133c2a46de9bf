"""Urban-1K (Long-CLIP): `Urban1k/image/N.jpg` with the first line of `Urban1k/caption/N.txt`, N = 1..1000.

The hub release (`BeichenZhang/Urban1k`) is `Urban1k.zip`, read unextracted (formats.hub_layouts).
Test only. Samples are in numeric order of N (GOAL's list order; Long-CLIP iterates `os.listdir`, an arbitrary one).
The first line's trailing newline is dropped (Long-CLIP keeps it; the tokenizer ignores it).
"""

from __future__ import annotations

from pathlib import Path

from sharpclip.config import DataConfig
from sharpclip.data.formats import hub_layouts
from sharpclip.data.formats._common import caption_ok, check_split, require_dir
from sharpclip.data.formats.goal import list_for_split, read_goal_list
from sharpclip.data.schema import BadSample, BadSampleReport, PairSample


def _key(path: Path) -> tuple[int, str]:
    return (int(path.stem), "") if path.stem.isdigit() else (1 << 62, path.stem)


def read(root: Path, split: str, cfg: DataConfig, report: BadSampleReport) -> list[PairSample]:
    """Urban-1K samples in numeric order (or of the GOAL list for the split)."""
    base = root / "Urban1k" if (root / "Urban1k").is_dir() else root
    list_file = list_for_split(cfg, split)
    archive = hub_layouts.urban1k_zip(root)
    if archive is not None and not (base / "caption").is_dir() and not list_file:  # the hub's Urban1k.zip
        check_split("urban1k", split, ("test",))
        return hub_layouts.read_urban1k_zip(archive, report)
    if list_file:
        return read_goal_list(root / list_file, require_dir(base / "image", "Urban-1K image/"), report)
    check_split("urban1k", split, ("test",))
    samples = []
    for path in sorted(require_dir(base / "caption", "Urban-1K caption/").glob("*.txt"), key=_key):
        try:
            text = report.read_file(path).read_text(encoding="utf-8")
        except UnicodeDecodeError as err:
            report.add(BadSample(str(path), path.stem, f"malformed record: not UTF-8 text ({err.reason})"))
            continue
        first = text.splitlines()[0] if text else ""
        if caption_ok(first, str(path), path.stem, report):
            samples.append(
                PairSample(id=path.stem, image=base / "image" / f"{path.stem}.jpg", caption=first, source=f"{path}:1")
            )
    return samples
