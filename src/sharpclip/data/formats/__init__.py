"""Readers of each dataset's files as released; `FORMATS[name](root, split, cfg, report) -> list of samples`.

Every reader is a pure function of the files: it keeps the release's order (which defines ground truth for the
retrieval protocols), names the file and record of every bad sample, and logs what a protocol leaves out on purpose.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from sharpclip.config import DataConfig
from sharpclip.data.formats import (
    dci,
    docci,
    generic,
    hf,
    karpathy,
    long_dci,
    sharegpt4v,
    synthdense,
    ultraedit,
    urban1k,
    vg,
    webdataset,
)
from sharpclip.data.schema import BadSampleReport, Sample

Reader = Callable[[Path, str, DataConfig, BadSampleReport], list[Sample]]

FORMATS: dict[str, Reader] = {
    "synthdense": synthdense.read,
    "generic": generic.read,
    "docci": docci.read,
    "dci": dci.read,
    "long_dci": long_dci.read,
    "urban1k": urban1k.read,
    "sharegpt4v": sharegpt4v.read,
    "vg": vg.read,
    "ultraedit": ultraedit.read,
    "karpathy": karpathy.read,
    "webdataset": webdataset.read,
    "hf": hf.read,
}
