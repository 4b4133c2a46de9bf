"""Embedding images and captions in batches for evaluation: the only place in eval/ that touches a model.

Evaluators depend on the small `Embedder` protocol (two callables returning L2-normalised (N, D) tensors), never on
a model class. `ModelEmbedder` adapts any dual encoder with `encode_image(pixel_values)` / `encode_text(input_ids,
attention_mask)` (sharpclip.models.DualEncoder) given its image preprocessing and tokenizer, and counts how many
captions the tokenizer truncated (recorded in the eval manifest).

Images are decoded and preprocessed by a DataLoader (`num_workers` processes, pinned batches on a GPU), as training
batches are, and the towers run under the precision given (bf16: autocast, embeddings returned in float32), so a
validation during training runs at training speed. `ShardedEmbedder` splits the work over the ranks of a
distributed run and gathers the embeddings, so that no rank repeats another's.
"""

from __future__ import annotations

import io
import os
import zipfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import torch
from PIL import Image, UnidentifiedImageError
from torch import Tensor

from sharpclip.data.files import NotRegularFileError, open_regular
from sharpclip.data.images import load_image as load_source
from sharpclip.data.images import request_draft, to_rgb
from sharpclip.data.workers import ignore_stop_signals
from sharpclip.progress import bar as progress_bar


@dataclass(frozen=True)
class ImageRef:
    """An image on disk, or `member` of the zip archive at `path` (a release shipped zipped: Winoground's
    `data/images.zip`); `bbox` = (x, y, w, h) is cropped to (x, y, x + w, y + h) before preprocessing (ARO)."""

    path: str
    bbox: tuple[float, float, float, float] | None = None
    member: str | None = None

    def describe(self) -> str:
        """`path`, or `path!member` for a zip member, for messages."""
        return f"{self.path}!{self.member}" if self.member else self.path


class UnreadableImage(FileNotFoundError):
    """An image that cannot be read: `ref` names it, `reason` says why in a few words (no path, no advice: each
    command adds what applies to it, such as the record that names the image or the flag that gave it)."""

    def __init__(self, ref: str, reason: str) -> None:
        self.ref, self.reason = ref, reason
        super().__init__(f"cannot read image {ref}: {reason}")

    def __reduce__(self) -> tuple:  # picklable with its two arguments (a loader worker's error travels pickled)
        return (type(self), (self.ref, self.reason))


def _reason(err: BaseException) -> str:
    """Why an image could not be read, in a few words."""
    if isinstance(err, UnidentifiedImageError):
        return "not an image file PIL can decode"
    if isinstance(err, NotRegularFileError):
        return f"not a regular file ({err.kind})"
    if isinstance(err, FileNotFoundError):
        return "no such file"
    if isinstance(err, KeyError):
        return f"no member {err} in the archive"
    if isinstance(err, OSError) and err.strerror:
        return err.strerror
    return " ".join(str(err).split())[:160]


MAX_OPEN_ARCHIVES = 8  # zip archives a process keeps open at once (the oldest is closed first)
_ARCHIVES: dict[tuple[int, str], tuple[tuple[int, int], Any, zipfile.ZipFile]] = {}


def open_archive(path: str) -> zipfile.ZipFile:
    """The zip archive at `path`, opened once per process (each DataLoader worker keeps its own) and kept while its
    size and mtime are unchanged: a 60,000-member archive's central directory is read once, not once per image."""
    st = os.stat(path)
    key, stamp = (os.getpid(), path), (st.st_size, st.st_mtime_ns)
    found = _ARCHIVES.pop(key, None)
    if found is not None and found[0] == stamp:
        _ARCHIVES[key] = found  # most recently used last
        return found[2]
    if found is not None:
        _close(found)
    f = open_regular(path)  # a FIFO, folder or device is refused before it is read, never waited on
    try:
        archive = zipfile.ZipFile(f)
    except BaseException:
        f.close()
        raise
    _ARCHIVES[key] = (stamp, f, archive)
    for stale in [k for k in _ARCHIVES if k[0] != os.getpid()]:  # a parent's, inherited across fork: its copy closed
        _close(_ARCHIVES.pop(stale))
    while len(_ARCHIVES) > MAX_OPEN_ARCHIVES:
        _close(_ARCHIVES.pop(next(iter(_ARCHIVES))))
    return archive


def _close(entry: tuple[tuple[int, int], Any, zipfile.ZipFile]) -> None:
    entry[2].close()
    entry[1].close()


def _open(ref: ImageRef) -> Any:
    if ref.member is not None:
        return Image.open(io.BytesIO(open_archive(ref.path).read(ref.member)))
    with open_regular(ref.path) as f:  # a FIFO, folder or device is refused before it is read, never waited on
        return Image.open(io.BytesIO(f.read()))


def load_image(ref: ImageRef | str | Path, draft_size: int | None = None) -> Any:
    """A PIL image, RGB or (with transparency) RGBA, cropped to the ref's bbox when it has one.

    Transparency is kept here; the preprocessing applies the alpha policy (`data.images.to_rgb`: by default PIL's
    `convert("RGB")`, as the reference evaluators), so evaluation and training treat alpha the same way.
    draft_size: JPEG draft decoding (`data.images.request_draft`) to sides >= this; never for a ref with a bbox,
    whose coordinates are the full image's.
    """
    ref = ref if isinstance(ref, ImageRef) else ImageRef(str(ref))
    try:
        with _open(ref) as im:
            if draft_size and ref.bbox is None:
                request_draft(im, draft_size)
            image = to_rgb(im, "keep")
    except (OSError, KeyError) as err:
        raise UnreadableImage(ref.describe(), _reason(err)) from None
    if ref.bbox is not None:
        x, y, w, h = ref.bbox
        image = image.crop((x, y, x + w, y + h))
    return image


@runtime_checkable
class Embedder(Protocol):
    """What evaluators need: L2-normalised embeddings, (N, D), for images and for captions."""

    def images(self, refs: Sequence[ImageRef | str | Path]) -> Tensor:
        """(N, D) L2-normalised image embeddings, in the order of `refs`."""

    def texts(self, captions: Sequence[str]) -> Tensor:
        """(N, D) L2-normalised caption embeddings, in the order of `captions`."""


class DualEncoderLike(Protocol):
    """The part of sharpclip.models.DualEncoder used here; both return an object with `.embedding` (B, D)."""

    def encode_image(self, pixel_values: Tensor, tokens: bool = False) -> Any:
        """Embeddings of a (B, 3, H, W) pixel batch."""

    def encode_text(self, input_ids: Tensor, attention_mask: Tensor | None = None, tokens: bool = False) -> Any:
        """Embeddings of a (B, L) token batch."""


class TokenizerLike(Protocol):
    """sharpclip.data.transforms.TextTokenizer: captions -> (input_ids, attention_mask), each (B, L); `lengths` gives
    untruncated token counts (bos and eos included) and `context_length` is L."""

    context_length: int

    def __call__(self, texts: Sequence[str]) -> tuple[Tensor, Tensor]:
        """(input_ids, attention_mask), each (B, L)."""

    def lengths(self, texts: Sequence[str]) -> list[int]:
        """Untruncated token counts, bos and eos included."""


def _model_device(model: Any) -> torch.device:
    """The device of a module's first parameter; the CPU for anything else."""
    params = getattr(model, "parameters", None)
    first = next(iter(params()), None) if callable(params) else None
    return first.device if first is not None else torch.device("cpu")


def _embedding(out: Any) -> Tensor:
    emb = out.embedding if hasattr(out, "embedding") else out
    return torch.nn.functional.normalize(emb.float(), dim=-1)


def _load(ref: Any, draft_size: int | None = None) -> Any:
    if isinstance(ref, ImageRef | str | Path):
        return load_image(ref, draft_size)
    return load_source(ref, draft_size)  # bytes, PIL images, parquet cells


@dataclass(frozen=True)
class _Failed:
    """What a loader worker returns for an image it could not load or preprocess: its index. The embedder loads it
    again in its own process, so the error raised is the image's own (one line naming it), not the worker's
    traceback flattened into a message ("Caught FileNotFoundError in DataLoader worker process 0 ...")."""

    index: int


class _Pixels(torch.utils.data.Dataset):
    """refs[i] -> (3, H, W) preprocessed pixels (what the embedder's DataLoader workers run), or `_Failed(i)`."""

    def __init__(self, refs: Sequence[Any], preprocess: Callable[[Any], Tensor], draft_size: int | None) -> None:
        self.refs, self.preprocess, self.draft_size = refs, preprocess, draft_size

    def __len__(self) -> int:
        return len(self.refs)

    def __getitem__(self, i: int) -> Tensor | _Failed:
        try:
            return self.preprocess(_load(self.refs[i], self.draft_size))
        except Exception:  # raised again, in the embedder's own process (ModelEmbedder.images)
            return _Failed(i)


def _stack(items: list[Tensor | _Failed]) -> Tensor | _Failed:
    """A batch of pixels (the DataLoader's own collation), or the batch's first `_Failed`."""
    failed = next((x for x in items if isinstance(x, _Failed)), None)
    return failed if failed is not None else torch.utils.data.default_collate(items)


class ModelEmbedder:
    """Batches images and captions through a dual encoder without gradients, with a progress bar.

    preprocess: PIL image -> (3, H, W) tensor (data.transforms.ClipImageTransform). tokenizer: a `TokenizerLike`
    (data.transforms.TextTokenizer). `num_truncated` counts captions longer than the context length.
    device: where inputs go; default the model's own (its parameters' device), so a model trained on a GPU is
    evaluated there. jpeg_draft: JPEG draft decoding to the preprocessing's size (off by default: exact pixels).
    num_workers: image decoding processes (0: in this process). precision: fp32, or bf16 (autocast on the towers).
    """

    def __init__(
        self,
        model: DualEncoderLike,
        preprocess: Callable[[Any], Tensor],
        tokenizer: TokenizerLike,
        batch_size: int = 64,
        device: str | torch.device | None = None,
        progress: bool = True,
        jpeg_draft: bool = False,
        num_workers: int = 0,
        precision: str = "fp32",
    ) -> None:
        self.model, self.preprocess, self.tokenizer = model, preprocess, tokenizer
        self.batch_size, self.progress = batch_size, progress
        self.device = torch.device(device) if device is not None else _model_device(model)
        self.draft_size = getattr(preprocess, "size", None) if jpeg_draft else None
        self.num_workers, self.precision = num_workers, precision
        self.num_captions = 0
        self.num_truncated = 0

    def _batches(self, items: Sequence[Any], what: str) -> Any:
        starts = range(0, len(items), self.batch_size)
        return progress_bar(starts, enabled=self.progress, desc=f"embed {what}", unit="batch")

    def _autocast(self) -> Any:
        enabled = self.precision == "bf16"
        return torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=enabled)

    @torch.no_grad()
    def images(self, refs: Sequence[Any]) -> Tensor:
        """Load, preprocess and encode `refs` in batches of `batch_size`; (N, D) on the CPU."""
        workers = min(self.num_workers, -(-len(refs) // self.batch_size))  # no more workers than batches
        loader = torch.utils.data.DataLoader(
            _Pixels(refs, self.preprocess, self.draft_size), batch_size=self.batch_size, num_workers=workers,
            pin_memory=self.device.type == "cuda", prefetch_factor=4 if workers else None, collate_fn=_stack,
            worker_init_fn=ignore_stop_signals,  # a validation's workers survive a stop signal: the rank decides
        )  # fmt: skip
        bar = progress_bar(loader, enabled=self.progress, desc="embed images", unit="batch")
        out = []
        for pixels in bar:
            if isinstance(pixels, _Failed):
                self.preprocess(_load(refs[pixels.index], self.draft_size))  # its own error, in this process
                raise UnreadableImage(str(refs[pixels.index]), "failed in a loader worker only")
            with self._autocast():
                out.append(_embedding(self.model.encode_image(pixels.to(self.device, non_blocking=True))))
        return torch.cat(out).cpu() if out else torch.empty(0)

    @torch.no_grad()
    def texts(self, captions: Sequence[str]) -> Tensor:
        """Tokenise and encode `captions` in batches, counting those over the context length."""
        out = []
        for s in self._batches(captions, "captions"):
            batch = list(captions[s : s + self.batch_size])
            self.num_captions += len(batch)
            self.num_truncated += sum(n > self.tokenizer.context_length for n in self.tokenizer.lengths(batch))
            ids, mask = self.tokenizer(batch)
            with self._autocast():
                out.append(_embedding(self.model.encode_text(ids.to(self.device), mask.to(self.device))))
        return torch.cat(out).cpu() if out else torch.empty(0)


Gather = Callable[[Tensor], list[Tensor]]  # this rank's rows -> every rank's in rank order, or [] on a rank that
# does not score (train.validation gathers to rank 0 only)


class ShardedEmbedder:
    """An Embedder whose rank `rank` of `world` embeds every world-th item (from `rank` on) and `gather` collects
    the ranks' shards: each item is embedded once over the ranks. The rank that `gather` hands the shards to
    receives all (N, D) in order; a rank it hands nothing gets an empty tensor (it embedded for the scoring rank).

    Every rank embeds the same number of items, ⌈N / world⌉: a share one short is padded with the first item, whose
    embedding is dropped. A sharded model (train.layout shard or hybrid) gathers its parameters from every rank in
    each forward pass, so the ranks must make the same passes, also when there are fewer items than ranks."""

    def __init__(self, inner: Embedder, rank: int, world: int, gather: Gather) -> None:
        self.inner, self.rank, self.world, self.gather = inner, rank, world, gather

    def __getattr__(self, name: str) -> Any:  # device, preprocess, num_truncated, ... for the manifest
        return getattr(self.inner, name)

    def _sharded(self, items: Sequence[Any], embed: Callable[[list], Tensor]) -> Tensor:
        share = list(items[self.rank :: self.world])
        short = -(-len(items) // self.world) - len(share)  # padded so that every rank makes the same passes
        mine = embed(share + [items[0]] * short)[: len(share)] if short else embed(share)
        shards = [s.cpu() for s in self.gather(mine)]
        if not shards:  # not the scoring rank: its share went there
            return torch.empty(0)
        width = max(s.shape[-1] if s.ndim == 2 else 0 for s in shards)
        out = torch.empty(len(items), width)
        for r, shard in enumerate(shards):
            if shard.numel():  # a rank past the last item has nothing
                out[r :: self.world] = shard
        return out

    def images(self, refs: Sequence[Any]) -> Tensor:
        """(N, D) image embeddings, this rank's share embedded here."""
        return self._sharded(refs, self.inner.images)

    def texts(self, captions: Sequence[str]) -> Tensor:
        """(N, D) caption embeddings, this rank's share embedded here."""
        return self._sharded(captions, self.inner.texts)


class CachedEmbedder:
    """Wraps an Embedder so that each distinct image ref / caption is embedded once per evaluation run.

    `fill` embeds everything a run will ask for up front, in one call per kind (a sharded embedder's ranks then
    take part in exactly two gathers, whatever the scoring asks later); `seal` makes a later miss an error instead
    of an embedding only the scoring rank would run."""

    def __init__(self, inner: Embedder) -> None:
        self.inner = inner
        self.device = getattr(inner, "device", None)  # where the scoring runs (eval.retrieval): the model's device
        self.sealed = False
        self._img: dict[Any, Tensor] = {}
        self._txt: dict[str, Tensor] = {}

    def fill(self, refs: Sequence[Any], captions: Sequence[str]) -> None:
        """Embed every distinct ref and caption not cached yet: one `images` and one `texts` call (on an empty
        cache and distinct items, exactly `inner.images(refs)` and `inner.texts(captions)`)."""
        self._add(list(refs), self._img, self.inner.images)
        self._add(list(captions), self._txt, self.inner.texts)

    def seal(self) -> None:
        """From now on, anything not cached raises LookupError."""
        self.sealed = True

    def _add(self, keys: list[Any], cache: dict, embed: Callable[[list], Tensor]) -> None:
        new = list(dict.fromkeys(k for k in keys if k not in cache))
        if new and self.sealed:
            raise LookupError(f"{len(new)} items (first {new[0]!r}) were not embedded up front: the evaluation "
                              "asks for inputs that eval.scoring.set_inputs does not list")  # fmt: skip
        if new:
            for k, e in zip(new, embed(new), strict=True):
                cache[k] = e

    def _lookup(self, keys: Sequence[Any], cache: dict, embed: Callable[[list], Tensor]) -> Tensor:
        self._add(list(keys), cache, embed)
        return torch.stack([cache[k] for k in keys])

    def images(self, refs: Sequence[ImageRef | str | Path]) -> Tensor:
        """Image embeddings, computing only refs not seen before."""
        return self._lookup(list(refs), self._img, self.inner.images)

    def texts(self, captions: Sequence[str]) -> Tensor:
        """Caption embeddings, computing only captions not seen before."""
        return self._lookup(list(captions), self._txt, self.inner.texts)
