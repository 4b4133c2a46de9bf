"""Decoding images from every `ImageSource` the loaders produce (paths, bytes, PIL images, parquet cells).

A failure raises `ImageLoadError` whose reason starts with "missing file", "not a regular file" (a FIFO, a directory
or a device: refused before it is opened, never waited on; data.files), "unreadable image" or "image too large"; the
dataset turns it into a `BadSample` naming the record.

High-bit-depth modes are scaled to 8 bits before the RGB conversion (PIL's own conversion clips them, so a 16-bit PNG
would become near-white): 16-bit (`I;16*`, and `I` holding values up to 65535, the mode PIL gives some 16-bit
greyscale files) by 255/65535; 32-bit `I` with larger values by 255/(2³¹ − 1); float (`F`) by 255 when its values
lie in [0, 1], else clipped to [0, 255]. An image whose header says it has more than
`max_pixels` pixels (data.max_image_pixels, default PIL's decompression-bomb limit) is refused before decoding.
"""

from __future__ import annotations

import io
import os
import warnings
from collections import OrderedDict
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image

from sharpclip.data.files import NotRegularFileError, open_regular, read_regular
from sharpclip.data.schema import ArrowCell, ImageSource, ParquetCell


class ImageLoadError(OSError):
    """The image of a sample is missing or cannot be decoded; `reason` is short and starts with the kind."""

    def __init__(self, reason: str):
        self.reason = reason
        super().__init__(reason)


def describe(source: ImageSource) -> str:
    """A short human name for an image source, for error messages and reports."""
    if isinstance(source, ArrowCell):
        return f"{source.file}[row {source.row}, column {source.column}]"
    if isinstance(source, ParquetCell):
        return f"{source.file}[row group {source.row_group}, row {source.row}, column {source.column}]"
    if isinstance(source, (str, Path)):
        return str(source)
    return f"<{type(source).__name__}>"


PARQUET_CACHE_BYTES = 256 << 20  # per process: the decoded column chunks kept for the next samples
PARQUET_OPEN_FILES = 8  # per process: open parquet files (their footers are parsed once)


class _ParquetCache:
    """Per-process LRU of open parquet files and of decoded (file, row group, column) chunks, bounded in bytes.

    pyarrow (so HF datasets) checks its 1 MiB page limit only every 1,024 values, so a row group of fewer rows (HF
    image datasets: 100) holds each column in one data page and one cell costs reading its whole column chunk. The
    cache lets a cell's neighbours (sequential reads, a locality-aware order) reuse that read; under a uniform shuffle
    over many row groups nearly every cell misses. Only the requested cell becomes a Python object.
    """

    def __init__(self, max_bytes: int, max_files: int) -> None:
        self.max_bytes, self.max_files = max_bytes, max_files
        self.clear()

    def clear(self) -> None:
        """Close the files and drop every chunk (also done in a forked DataLoader worker on first use)."""
        for handle in getattr(self, "files", {}).values():
            handle.close()
        self.pid = os.getpid()
        self.files: OrderedDict[str, Any] = OrderedDict()
        self.chunks: OrderedDict[tuple[str, int, str], Any] = OrderedDict()
        self.nbytes = 0
        self.reads = 0  # column chunks read from disk, for tests and measurements

    def _file(self, path: str) -> Any:
        import pyarrow.parquet as pq  # optional dependency: only UltraEdit-style parquet needs it

        if path not in self.files:
            self.files[path] = pq.ParquetFile(path)
            while len(self.files) > self.max_files:
                self.files.popitem(last=False)[1].close()
        self.files.move_to_end(path)
        return self.files[path]

    def column(self, cell: ParquetCell) -> Any:
        """The Arrow array of the cell's (file, row group, column), from the cache or read once."""
        if os.getpid() != self.pid:  # a forked worker: start empty rather than share the parent's handles
            self.clear()
        key = (cell.file, cell.row_group, cell.column)
        if key in self.chunks:
            self.chunks.move_to_end(key)
            return self.chunks[key]
        chunk = self._file(cell.file).read_row_group(cell.row_group, columns=[cell.column]).column(0)
        self.reads += 1
        if chunk.nbytes <= self.max_bytes:
            self.chunks[key] = chunk
            self.nbytes += chunk.nbytes
            while self.nbytes > self.max_bytes:
                self.nbytes -= self.chunks.popitem(last=False)[1].nbytes
        return chunk


_PARQUET = _ParquetCache(PARQUET_CACHE_BYTES, PARQUET_OPEN_FILES)


def _cell_bytes(cell: ParquetCell) -> bytes:
    column = _PARQUET.column(cell)
    if not 0 <= cell.row < len(column):
        raise ImageLoadError(f"missing file: {describe(cell)} is past the row group's {len(column)} rows")
    value = column[cell.row].as_py()  # this cell only
    data = value.get("bytes") if isinstance(value, dict) else value
    if not data:
        raise ImageLoadError(f"missing file: no image bytes in {describe(cell)}")
    return data


_ARROW_TABLES: dict[tuple[int, str], Any] = {}  # (pid, file) -> memory-mapped table; pages load on access


def _arrow_bytes(cell: ArrowCell) -> bytes:
    """The bytes of one cell of a memory-mapped Arrow stream file (HF Image struct or binary column)."""
    import pyarrow as pa  # optional dependency (extra [parquet]): only Arrow-backed datasets reach this

    key = (os.getpid(), cell.file)
    if key not in _ARROW_TABLES:
        _ARROW_TABLES[key] = pa.ipc.open_stream(pa.memory_map(cell.file)).read_all()
    column = _ARROW_TABLES[key].column(cell.column)
    if not 0 <= cell.row < len(column):
        raise ImageLoadError(f"missing file: {describe(cell)} is past the file's {len(column)} rows")
    value = column[cell.row].as_py()
    data = value.get("bytes") if isinstance(value, dict) else value
    if not data:
        raise ImageLoadError(f"missing file: no image bytes in {describe(cell)}")
    return data


def image_bytes(source: ImageSource) -> bytes | None:
    """The encoded bytes behind a source (None for an already decoded image); for duplicate detection."""
    if isinstance(source, ParquetCell):
        return _cell_bytes(source)
    if isinstance(source, ArrowCell):
        return _arrow_bytes(source)
    if isinstance(source, bytes):
        return source
    if isinstance(source, (str, Path)):
        return read_regular(source)
    return None


HIGH_BIT_MODES = ("I;16", "I;16L", "I;16B", "I;16N", "I", "F")


def to_8bit(image: Image.Image) -> Image.Image:
    """A greyscale image of more than 8 bits as 8-bit `L`, scaled (not clipped) as the module docstring says."""
    if image.mode not in HIGH_BIT_MODES:
        return image
    values = np.asarray(image, dtype=np.float64)
    if image.mode == "F":
        finite = values[np.isfinite(values)]
        scale = 255.0 if finite.size and finite.min() >= 0 and finite.max() <= 1 else 1.0
    elif image.mode == "I" and values.size and values.max() > 65535:  # a genuine 32-bit image: its full range
        scale = 255.0 / 2147483647.0
    else:
        scale = 255.0 / 65535.0
    out = np.clip(np.nan_to_num(values * scale), 0, 255)
    return Image.fromarray(np.rint(out).astype(np.uint8), mode="L")


def has_alpha(image: Image.Image) -> bool:
    """True when the image carries transparency (an alpha band, or a palette / tRNS transparent colour)."""
    return "A" in image.getbands() or image.info.get("transparency") is not None


def to_rgb(image: Image.Image, alpha: str = "drop") -> Image.Image:
    """The image in RGB (16-bit, 32-bit and float greyscale first scaled to 8 bits, `to_8bit`), with transparency
    handled by `alpha`:

    - `drop` (default): PIL `convert("RGB")`, which discards alpha and keeps the colour under it. OpenAI CLIP,
      open_clip, Long-CLIP, GOAL, ARO and the DCI Winoground scorer all preprocess this way: an RGBA pixel
      (10, 200, 30, 0) stays (10, 200, 30).
    - `white`: composite onto white first (HF `CLIPImageProcessor`'s `convert_to_rgb`): that pixel becomes white.
    - `keep`: RGBA when the image has transparency, else RGB, so a later `to_rgb` can still choose (decoding uses it).
    """
    if alpha not in ("drop", "white", "keep"):
        raise ValueError(f"alpha policy {alpha!r}: expected drop, white or keep")
    image = to_8bit(image)
    if not has_alpha(image) or alpha == "drop":
        return image.convert("RGB")
    rgba = image.convert("RGBA")
    if alpha == "keep":
        return rgba
    return Image.alpha_composite(Image.new("RGBA", rgba.size, (255, 255, 255, 255)), rgba).convert("RGB")


def check_size(image: Image.Image, name: str, max_pixels: int | None) -> None:
    """`ImageLoadError` ("image too large") when the image has more than `max_pixels` pixels (None: no limit)."""
    width, height = image.size
    if max_pixels is not None and width * height > max_pixels:
        raise ImageLoadError(
            f"image too large: {name} is {width}×{height} = {width * height:,} pixels, over data.max_image_pixels "
            f"({max_pixels:,}); shrink it, or raise the limit if you trust the file"
        )


def request_draft(image: Image.Image, size: int) -> None:
    """Ask the JPEG decoder for its own 1/2, 1/4 or 1/8 DCT downscale, the largest that keeps both sides >= `size`
    (so a photo under twice `size` decodes whole); a no-op for other formats. Call before the pixels are read.

    The decoder skips most of the inverse DCT, so a 1500×1000 photo for a 224 px model decodes at 375×250 several
    times faster; the pixels differ slightly from a full decode + resize, so evaluation leaves it off by default.
    """
    if image.format == "JPEG":
        image.draft(None, (size, size))


def _decode(
    data: bytes | Path | str, name: str, draft_size: int | None = None, max_pixels: int | None = None
) -> Image.Image:
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)  # the size is checked just below
            with (
                io.BytesIO(data) if isinstance(data, bytes) else open_regular(data) as stream,
                Image.open(stream) as img,
            ):
                check_size(img, name, max_pixels)  # from the header: nothing decoded yet
                if draft_size:
                    request_draft(img, draft_size)
                return to_rgb(img, "keep")  # converting forces the full decode, so truncated files fail here
    except FileNotFoundError:
        raise ImageLoadError(f"missing file: {name} does not exist") from None
    except NotRegularFileError as err:
        raise ImageLoadError(f"not a regular file: {name} is {err.kind}; point the record at an image file") from None
    except Image.DecompressionBombError as err:  # above twice PIL's own limit: refused by PIL before our check
        raise ImageLoadError(f"image too large: {name}: {err}") from None
    except (OSError, ValueError) as err:
        if isinstance(err, ImageLoadError):
            raise
        raise ImageLoadError(f"unreadable image: {name}: {err}") from None


def load_image(source: ImageSource, draft_size: int | None = None, max_pixels: int | None = None) -> Image.Image:
    """The image as RGB, or RGBA when it has transparency (the image transform applies the alpha policy, `to_rgb`);
    raises `ImageLoadError` when it is missing, corrupt or over `max_pixels` pixels.

    draft_size: decode JPEGs at the smallest DCT scale whose sides stay >= this (`request_draft`); None: in full.
    """
    if isinstance(source, Image.Image):
        check_size(source, describe(source), max_pixels)
        return to_rgb(source, "keep")
    if isinstance(source, ParquetCell):
        return _decode(_cell_bytes(source), describe(source), draft_size, max_pixels)
    if isinstance(source, ArrowCell):
        return _decode(_arrow_bytes(source), describe(source), draft_size, max_pixels)
    if isinstance(source, bytes):
        return _decode(source, "<image bytes>", draft_size, max_pixels)
    return _decode(Path(source), str(source), draft_size, max_pixels)
