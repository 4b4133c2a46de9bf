"""A search index over one model's embeddings of one dataset: safetensors chunks beside a manifest, exact top-k.

Layout of an index folder (one model, one dataset):

    manifest.json            version, the model (name, class, sha256 of its weights, preprocessing, context length),
                             the dataset (name, how it was read, every item's source, captions, caption→image, and
                             every file read with size, mtime and sha256), chunk size, dimension, complete or not
    image-00000.safetensors  {"embedding": (≤ chunk, D) float32, L2-normalised}, images in dataset order
    text-00000.safetensors   the same for the dataset's captions (none for a folder of images without captions)

Building embeds `chunk_size` items at a time through an `eval.embed.Embedder` (the model's own preprocessing, as
`sharpclip eval` embeds) and writes each chunk atomically (temporary file, then rename), so a killed build resumes at
the first chunk not on disk. Before a build resumes and before an index answers a query, the model and the files are
checked against the manifest: a different weight digest or preprocessing, another item list, or a file whose size
or mtime changed and whose sha256 differs, is refused with one line (`IndexMismatch`).

Search is exact: cosine scores of L2-normalised vectors, computed `chunk_size` gallery rows at a time, each chunk's
top-k kept and the candidates merged (`top_k`); the order is eval's tie policy (higher score first, then the lower
gallery index), so the first hit of a caption query is the image `eval`'s R@1 counts.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file
from torch import Tensor

from sharpclip.data.images import describe
from sharpclip.data.schema import ArrowCell, ParquetCell
from sharpclip.eval.embed import Embedder, ImageRef
from sharpclip.eval.manifest import sha256_file, weights_sha256
from sharpclip.eval.retrieval import RetrievalSet
from sharpclip.progress import bar as progress_bar

INDEX_VERSION = 1
MANIFEST = "manifest.json"
CHUNK_SIZE = 1024  # items embedded and written per file: a killed build loses at most this many
SEARCH_CHUNK = 32768  # gallery rows scored at once: 32768 × Q floats of working memory


class IndexMismatch(ValueError):
    """The index on disk was built from another model or other files than those given now; the message says which."""


# -- fingerprints -----------------------------------------------------------------------------------------------------
def source_key(source: Any) -> str:
    """A stable name for an image source: its path (zip member, parquet/arrow cell), or the sha256 of raw bytes."""
    if isinstance(source, ImageRef):
        return source.describe() + (f"@{list(source.bbox)}" if source.bbox else "")
    if isinstance(source, bytes):
        return "sha256:" + hashlib.sha256(source).hexdigest()
    return describe(source)


def source_file(source: Any) -> Path | None:
    """The file an image source is read from (None for bytes and decoded images)."""
    if isinstance(source, ImageRef | ParquetCell | ArrowCell):
        return Path(source.path if isinstance(source, ImageRef) else source.file)
    return Path(source) if isinstance(source, str | Path) else None


def file_record(path: Path) -> dict[str, Any]:
    """{size, mtime_ns, sha256} of one file."""
    st = path.stat()
    return {"size": st.st_size, "mtime_ns": st.st_mtime_ns, "sha256": sha256_file(path)}


def dataset_files(dataset: RetrievalSet) -> list[Path]:
    """Every file a dataset reads: its annotation files, then each image's file, first-seen order."""
    found = [Path(f) for f in dataset.files] + [p for p in map(source_file, dataset.images) if p is not None]
    return list(dict.fromkeys(found))


def changed_file(recorded: dict[str, dict[str, Any]]) -> str | None:
    """A one-line reason when a recorded file is missing or its bytes differ (stat first, sha256 when it moved)."""
    for name, rec in recorded.items():
        path = Path(name)
        if not path.is_file():
            return f"{name} is gone"
        st = path.stat()
        if (st.st_size, st.st_mtime_ns) != (rec["size"], rec["mtime_ns"]) and sha256_file(path) != rec["sha256"]:
            return f"{name} changed (sha256 {rec['sha256'][:12]}… at build time)"
    return None


def preprocessing_record(preprocess: Any, tokenizer: Any) -> dict[str, Any]:
    """What an index records of the preprocessing (data.transforms.ClipImageTransform / TextTokenizer fields)."""
    rec: dict[str, Any] = {k: getattr(preprocess, k, None) for k in ("size", "crop", "resample", "alpha")}
    for k in ("mean", "std"):
        value = getattr(preprocess, k, None)
        rec[k] = [round(float(v), 6) for v in value.reshape(-1)] if value is not None else None
    rec["context_length"] = getattr(tokenizer, "context_length", None)
    return rec


# -- the manifest -----------------------------------------------------------------------------------------------------
def dataset_record(dataset: RetrievalSet, spec: dict[str, Any], hash_files: bool = True) -> dict[str, Any]:
    """The manifest's dataset part: how it was read (`spec`), items, captions, and every file's fingerprint
    (`hash_files`; without it the files are left to `changed_file`, which hashes only a file whose stat moved)."""
    return {
        "name": dataset.name,
        "spec": spec,
        "items": [source_key(s) for s in dataset.images],
        "captions": list(dataset.captions),
        "caption_to_image": list(dataset.caption_to_image),
        "files": {str(p): file_record(p) if hash_files else None for p in dataset_files(dataset)},
    }


def _write_json(path: Path, value: Any) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(value, indent=1) + "\n", encoding="utf-8")
    os.replace(tmp, path)


def read_manifest(folder: Path) -> dict[str, Any] | None:
    """The manifest of an index folder, or None when there is none."""
    path = folder / MANIFEST
    if not path.is_file():
        return None
    try:
        manifest = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as err:
        raise IndexMismatch(f"{path}: not a JSON manifest ({err}); rebuild the index (--rebuild)") from None
    if manifest.get("version") != INDEX_VERSION:
        raise IndexMismatch(f"{path}: index version {manifest.get('version')}, this sharpclip reads "
                            f"{INDEX_VERSION}; rebuild it (--rebuild)")  # fmt: skip
    return manifest


def mismatch(manifest: dict[str, Any], model: dict[str, Any], data: dict[str, Any]) -> str | None:
    """Why an index cannot serve this model and dataset (None when it can); checks the files on disk too."""
    old_model, old_data = manifest["model"], manifest["dataset"]
    if old_model["digest"] != model["digest"]:
        return (f"the model's weights differ (sha256 {model['digest'][:12]}…, the index was built with "
                f"{old_model['name']}, {old_model['digest'][:12]}…)")  # fmt: skip
    if old_model["preprocessing"] != model["preprocessing"]:
        return f"the preprocessing differs ({model['preprocessing']} vs {old_model['preprocessing']})"
    for key in ("items", "captions", "caption_to_image"):
        if old_data[key] != data[key]:
            return f"the dataset's {key.replace('_', ' ')} differ from those it was built over ({old_data['name']})"
    if set(old_data["files"]) != set(data["files"]):
        extra = sorted(set(old_data["files"]) ^ set(data["files"]))
        return f"the dataset reads other files than it was built over ({extra[0]}, {len(extra)} in all)"
    return changed_file(old_data["files"])


# -- building ---------------------------------------------------------------------------------------------------------
def _chunk_path(folder: Path, part: str, c: int) -> Path:
    return folder / f"{part}-{c:05d}.safetensors"


def _chunk_done(path: Path, rows: int) -> bool:
    if not path.is_file():
        return False
    try:
        return load_file(path)["embedding"].shape[0] == rows
    except Exception:  # a torn or foreign file: embed the chunk again (it is ours to rewrite)
        return False


def _embed_part(folder: Path, part: str, items: Sequence[Any], embed: Any, chunk: int, progress: bool) -> None:
    starts = range(0, len(items), chunk)
    bar = progress_bar(starts, enabled=progress, desc=f"index {part}s", unit="chunk")
    for c, start in enumerate(bar):
        path = _chunk_path(folder, part, c)
        rows = list(items[start : start + chunk])
        if _chunk_done(path, len(rows)):
            continue  # written by an earlier, interrupted build
        emb = embed(rows).float().contiguous()
        tmp = path.with_name(path.name + ".tmp")
        save_file({"embedding": emb}, str(tmp))
        os.replace(tmp, path)


def build_index(
    folder: str | Path,
    embedder: Embedder,
    model: dict[str, Any],
    dataset: RetrievalSet,
    spec: dict[str, Any],
    chunk_size: int = CHUNK_SIZE,
    progress: bool = True,
) -> Path:
    """Embed `dataset` (images, then captions) into `folder`, resuming an interrupted build of the same model and
    files; refuses (IndexMismatch) an index of another model or other files. Returns the folder.

    model: {"name", "class", "digest", "preprocessing"} (`model_record`); spec: how to read the dataset again."""
    folder = Path(folder)
    manifest = read_manifest(folder)
    data = dataset_record(dataset, spec, hash_files=manifest is None)  # an existing index: stat its files first
    if manifest is None:
        if folder.exists() and any(folder.iterdir()):
            raise IndexMismatch(f"{folder}: not empty and holds no {MANIFEST}; choose another --index folder")
        folder.mkdir(parents=True, exist_ok=True)
        manifest = {"version": INDEX_VERSION, "model": model, "dataset": data, "chunk_size": chunk_size,
                    "dim": None, "complete": False}  # fmt: skip
        _write_json(folder / MANIFEST, manifest)
    elif reason := mismatch(manifest, model, data):
        raise IndexMismatch(f"index {folder}: {reason}; build a new one (--rebuild, or another --index)")
    if not manifest["complete"]:
        chunk = manifest["chunk_size"]
        _embed_part(folder, "image", dataset.images, embedder.images, chunk, progress)
        _embed_part(folder, "text", dataset.captions, embedder.texts, chunk, progress)
        manifest["dim"] = int(load_file(_chunk_path(folder, "image", 0))["embedding"].shape[1])
        manifest["complete"] = True
        _write_json(folder / MANIFEST, manifest)
    return folder


def model_record(name: str, model: torch.nn.Module, preprocess: Any, tokenizer: Any) -> dict[str, Any]:
    """The manifest's model part: the name given, its class, the weights' sha256 and the preprocessing."""
    return {"name": name, "class": type(model).__name__, "digest": weights_sha256(model),
            "preprocessing": preprocessing_record(preprocess, tokenizer)}  # fmt: skip


# -- reading and searching --------------------------------------------------------------------------------------------
@dataclass
class Index:
    """A complete index in memory. image: (N_img, D), text: (N_txt, D), L2-normalised float32."""

    folder: Path
    manifest: dict[str, Any]
    image: Tensor
    text: Tensor


def _read_part(folder: Path, part: str, n: int, chunk: int) -> Tensor:
    parts = [load_file(_chunk_path(folder, part, c))["embedding"] for c in range(-(-n // chunk))]
    return torch.cat(parts) if parts else torch.empty(0, 0)


def load_index(folder: str | Path) -> Index:
    """Read a complete index (no model or file check: `build_index` does those before it returns)."""
    folder = Path(folder)
    manifest = read_manifest(folder)
    if manifest is None or not manifest["complete"]:
        raise IndexMismatch(f"{folder}: no complete index here (build it first; an interrupted build resumes)")
    data, chunk = manifest["dataset"], manifest["chunk_size"]
    image = _read_part(folder, "image", len(data["items"]), chunk)
    text = _read_part(folder, "text", len(data["captions"]), chunk)
    return Index(folder, manifest, image, text)


def _chunk_top(scores: Tensor, k: int) -> tuple[Tensor, Tensor]:
    """topk of each row; a row whose k-th score ties an item left out (topk may keep either) is sorted stably so
    the lower index is kept, as eval ranks it. Real embeddings almost never tie, so the sort almost never runs."""
    v, i = scores.topk(k, dim=1)
    tied = ((scores >= v[:, -1:]).sum(1) > k).nonzero()[:, 0]
    if tied.numel():
        order = scores[tied].argsort(dim=1, descending=True, stable=True)[:, :k]
        v[tied], i[tied] = scores[tied].gather(1, order), order
    return v, i


def top_k(query: Tensor, gallery: Tensor, k: int, chunk_size: int = SEARCH_CHUNK) -> tuple[Tensor, Tensor]:
    """Exact top-k by cosine: (scores (Q, k'), indices (Q, k')), k' = min(k, G), best first; ties go to the lower
    gallery index (eval's tie policy).

    query: (Q, D), gallery: (G, D), both L2-normalised. Scores `chunk_size` gallery rows at a time and keeps each
    chunk's top k, so the work is one pass of matrix products plus top-k selections, never a sort of all G scores.
    """
    query, k = query.float(), min(k, gallery.shape[0])
    values, indices = [], []
    for start in range(0, gallery.shape[0], chunk_size):
        scores = query @ gallery[start : start + chunk_size].float().T
        v, i = _chunk_top(scores, min(k, scores.shape[1]))
        values.append(v)
        indices.append(i + start)
    v, i = torch.cat(values, 1), torch.cat(indices, 1)
    by_index = i.argsort(dim=1, stable=True)  # lower index first, then a stable sort by score keeps that among ties
    v, i = v.gather(1, by_index), i.gather(1, by_index)
    by_score = v.argsort(dim=1, descending=True, stable=True)[:, :k]
    return v.gather(1, by_score), i.gather(1, by_score)
