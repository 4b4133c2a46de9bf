"""Decoding images from every `ImageSource` the loaders produce (paths, bytes, PIL images, parquet cells).

A failure raises `ImageLoadError` whose reason starts with "missing file" or "unreadable image"; the dataset turns it
into a `BadSample` naming the record.
"""

from __future__ import annotations

import io
from functools import lru_cache
from pathlib import Path

from PIL import Image

from sharpclip.data.schema import ImageSource, ParquetCell


class ImageLoadError(OSError):
    """The image of a sample is missing or cannot be decoded; `reason` is short and starts with the kind."""

    def __init__(self, reason: str):
        self.reason = reason
        super().__init__(reason)


def describe(source: ImageSource) -> str:
    """A short human name for an image source, for error messages and reports."""
    if isinstance(source, ParquetCell):
        return f"{source.file}[row group {source.row_group}, row {source.row}, column {source.column}]"
    if isinstance(source, (str, Path)):
        return str(source)
    return f"<{type(source).__name__}>"


@lru_cache(maxsize=4)  # per process: consecutive rows of one row group (the usual access) decode it once
def _row_group_column(file: str, row_group: int, column: str) -> list:
    import pyarrow.parquet as pq  # optional dependency: only UltraEdit-style parquet needs it

    table = pq.ParquetFile(file).read_row_group(row_group, columns=[column])
    return table.column(column).to_pylist()


def _cell_bytes(cell: ParquetCell) -> bytes:
    value = _row_group_column(cell.file, cell.row_group, cell.column)[cell.row]
    data = value.get("bytes") if isinstance(value, dict) else value
    if not data:
        raise ImageLoadError(f"missing file: no image bytes in {describe(cell)}")
    return data


def image_bytes(source: ImageSource) -> bytes | None:
    """The encoded bytes behind a source (None for an already decoded image); for duplicate detection."""
    if isinstance(source, ParquetCell):
        return _cell_bytes(source)
    if isinstance(source, bytes):
        return source
    if isinstance(source, (str, Path)):
        return Path(source).read_bytes()
    return None


def to_rgb(image: Image.Image) -> Image.Image:
    """RGB, with any transparency composited onto white (HF CLIPImageProcessor's rule; OpenAI's drops alpha)."""
    if "A" in image.getbands() or image.info.get("transparency") is not None:
        rgba = image.convert("RGBA")
        return Image.alpha_composite(Image.new("RGBA", rgba.size, (255, 255, 255, 255)), rgba).convert("RGB")
    return image.convert("RGB")


def _decode(data: bytes | Path | str, name: str) -> Image.Image:
    try:
        with Image.open(io.BytesIO(data) if isinstance(data, bytes) else data) as img:
            return to_rgb(img)  # converting forces the full decode, so truncated files fail here
    except FileNotFoundError:
        raise ImageLoadError(f"missing file: {name} does not exist") from None
    except (OSError, ValueError, Image.DecompressionBombError) as err:
        raise ImageLoadError(f"unreadable image: {name}: {err}") from None


def load_image(source: ImageSource) -> Image.Image:
    """The image as RGB; raises `ImageLoadError` when it is missing or corrupt."""
    if isinstance(source, Image.Image):
        return to_rgb(source)
    if isinstance(source, ParquetCell):
        return _decode(_cell_bytes(source), describe(source))
    if isinstance(source, bytes):
        return _decode(source, "<image bytes>")
    return _decode(Path(source), str(source))
