"""Shared by tests/data: where the fixtures are, and a config pointing at one of them."""

from __future__ import annotations

import shutil
from pathlib import Path

from sharpclip.config import DataConfig
from sharpclip.data.transforms import ClipImageTransform, Preprocessing, TextTokenizer

FIXTURES = Path(__file__).parents[1] / "fixtures" / "data"


def cfg_for(fmt: str, root: Path | str | None = None, **kw) -> DataConfig:
    """Format `fmt` at `root` (its fixture by default), decoded in the test process unless `num_workers` is given."""
    kw.setdefault("num_workers", 0)
    return DataConfig(format=fmt, root=str(root if root is not None else FIXTURES / fmt), **kw)


def copy_fixture(fmt: str, tmp_path: Path) -> Path:
    """A writable copy of one format's fixture, to break on purpose."""
    return Path(shutil.copytree(FIXTURES / fmt, tmp_path / fmt))


def prep(tokenizer, size: int = 224, context: int = 77) -> Preprocessing:
    """CLIP preprocessing at `size` px and `context` tokens: what a model's model_transforms would give a loader."""
    return Preprocessing(ClipImageTransform(size), TextTokenizer(tokenizer, context))
