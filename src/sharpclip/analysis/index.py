"""A search index over one model's embeddings of one dataset: safetensors chunks beside a manifest, exact top-k.

Layout of an index folder (one model, one dataset):

    manifest.json            version, the model (name, class, sha256 of its weights, preprocessing, context length),
                             the dataset (name, how it was read, every item's source, captions, caption→image, and
                             every file read with size, mtime and sha256), chunk size, dimension, complete or not,
                             and (once complete) every chunk's size, mtime and sha256
    image-00000.safetensors  {"embedding": (≤ chunk, D) float32, L2-normalised}, images in dataset order
    text-00000.safetensors   the same for the dataset's captions (none for a folder of images without captions)
    .sharpclip-files.json    sharpclip's record of the files it wrote here (`sharpclip.owned_files`)
    .sharpclip-index.lock    flock-held by the process building the index (its pid inside)

Every file is written by `sharpclip.owned_files`' rule: atomically, under a per-process temporary name, and only over
a file sharpclip wrote; a folder that is a symbolic link, or that holds files but no record of sharpclip's, is refused.
`--rebuild` (`remove_index`) deletes only the manifest and the chunks, by their exact names, and only those the
folder's record lists; everything else in the folder stays. One build at a time: a second process that finds the
lock held waits for it (logging the holder's pid), then finds the index complete.

Building embeds `chunk_size` items at a time through an `eval.embed.Embedder` (the model's own preprocessing, as
`sharpclip eval` embeds) and writes each chunk atomically, so a killed build resumes at the first chunk not on disk;
a full disk ends it with one line (`IndexWriteError`). Before a build resumes and before an index answers a query,
the model and the files are checked against the manifest: a different weight digest or preprocessing, another item
list, or a file whose size or mtime changed and whose sha256 differs, is refused with one line (`IndexMismatch`).
A manifest is checked against its schema when read; a chunk whose size or mtime changed since the build is hashed
and refused unless its sha256 is the one recorded; an unreadable or wrong-shape chunk is refused naming the file.

Search is exact: cosine scores of L2-normalised vectors, computed `chunk_size` gallery rows at a time, each chunk's
top-k kept and the candidates merged (`top_k`); the order is eval's tie policy (higher score first, then the lower
gallery index), so the first hit of a caption query is the image `eval`'s R@1 counts.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import json
import logging
import os
import re
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file, save_file
from torch import Tensor

from sharpclip import owned_files
from sharpclip.data.images import describe
from sharpclip.data.schema import ArrowCell, ParquetCell
from sharpclip.eval.embed import Embedder, ImageRef
from sharpclip.eval.manifest import sha256_file, weights_sha256
from sharpclip.eval.retrieval import RetrievalSet
from sharpclip.progress import bar as progress_bar

INDEX_VERSION = 3  # 2: chunk digests in the manifest, files owned through owned_files' record; 3: resolved paths
MANIFEST = "manifest.json"
LOCK = ".sharpclip-index.lock"
CHUNK_NAME = re.compile(r"(image|text)-\d{5}\.safetensors")
FLAG = "--index"
CHUNK_SIZE = 1024  # items embedded and written per file: a killed build loses at most this many
SEARCH_CHUNK = 32768  # gallery rows scored at once: 32768 × Q floats of working memory


log = logging.getLogger(__name__)


class IndexMismatch(ValueError):
    """The index on disk was built from another model or other files than those given now, or is damaged; the
    message says which file and what to do."""


class IndexWriteError(OSError):
    """A chunk or the manifest could not be written (a full disk, a read-only folder); the message names the folder."""


# -- fingerprints -----------------------------------------------------------------------------------------------------
def source_key(source: Any) -> str:
    """A stable name for an image source: its path (zip member, parquet/arrow cell), or the sha256 of raw bytes."""
    if isinstance(source, ImageRef):
        return source.describe() + (f"@{list(source.bbox)}" if source.bbox else "")
    if isinstance(source, bytes):
        return "sha256:" + hashlib.sha256(source).hexdigest()
    return describe(source)


def resolved_key(source: Any) -> str:
    """`source_key` with the file's path resolved (absolute, links followed): one image has one key whichever working
    directory, relative path or link reached it, as the index's folder digest does."""
    if isinstance(source, ImageRef):
        return source_key(replace(source, path=str(Path(source.path).resolve())))
    if isinstance(source, ParquetCell | ArrowCell):
        return source_key(replace(source, file=str(Path(source.file).resolve())))
    return str(Path(source).resolve()) if isinstance(source, str | Path) else source_key(source)


def source_file(source: Any) -> Path | None:
    """The file an image source is read from (None for bytes and decoded images)."""
    if isinstance(source, ImageRef | ParquetCell | ArrowCell):
        return Path(source.path if isinstance(source, ImageRef) else source.file)
    return Path(source) if isinstance(source, str | Path) else None


def file_record(path: Path) -> dict[str, Any]:
    """{size, mtime_ns, sha256} of one file; ValueError naming it when it cannot be read (a record's missing image
    was the raw "[Errno 2] No such file or directory: '…'")."""
    try:
        st = path.stat()
        return {"size": st.st_size, "mtime_ns": st.st_mtime_ns, "sha256": sha256_file(path)}
    except OSError as err:
        reason = (err.strerror or str(err)).lower()
        raise ValueError(f"cannot read {path} to fingerprint the index: {reason}; fix or remove the record that "
                         "names it, or set data.on_bad_sample=skip") from None  # fmt: skip


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
        "items": [resolved_key(s) for s in dataset.images],
        "captions": list(dataset.captions),
        "caption_to_image": list(dataset.caption_to_image),
        "files": {str(p.resolve()): file_record(p) if hash_files else None for p in dataset_files(dataset)},
    }


def _write_json(path: Path, value: Any) -> None:
    with _writing(path, "manifest") as tmp:
        tmp.write_text(json.dumps(value, indent=1) + "\n", encoding="utf-8")


@contextlib.contextmanager
def _writing(path: Path, what: str) -> Iterator[Path]:
    """owned_files.writing for an index file; a failed write (a full disk) becomes one `IndexWriteError` line."""
    try:
        with owned_files.writing(path, FLAG) as tmp:
            yield tmp
    except owned_files.NotOurs:
        raise
    except (OSError, SafetensorError) as err:
        full = getattr(err, "errno", None) == errno.ENOSPC or "os error 28" in str(err)
        why = "no space left on device" if full else " ".join(str(err).split())
        raise IndexWriteError(f"cannot write index {what} to {path.parent}: {why}") from None


SCHEMA: dict[str, tuple[type, ...]] = {"version": (int,), "model": (dict,), "dataset": (dict,), "chunk_size": (int,),
                                       "dim": (int, type(None)), "complete": (bool,), "chunks": (dict,)}  # fmt: skip
MODEL_SCHEMA = {"name": (str,), "class": (str,), "digest": (str,), "preprocessing": (dict,)}
DATA_SCHEMA = {"name": (str,), "spec": (dict,), "items": (list,), "captions": (list,), "caption_to_image": (list,),
               "files": (dict,)}  # fmt: skip
FILE_SCHEMA = {"size": (int,), "mtime_ns": (int,), "sha256": (str,)}


def _schema_error(value: Any, schema: dict[str, tuple[type, ...]], where: str) -> str | None:
    if not isinstance(value, dict):
        return f"{where or 'the manifest'} is a JSON {type(value).__name__}, not an object"
    for key, types in schema.items():
        if key not in value:
            return f"key '{where}{key}' is missing"
        if not isinstance(value[key], types) or (isinstance(value[key], bool) and bool not in types):
            return f"key '{where}{key}' is a {type(value[key]).__name__}"
    return None


def manifest_error(manifest: Any) -> str | None:
    """What is wrong with a manifest's shape (a key missing, a wrong type, a list), or None when it is well formed."""
    if not isinstance(manifest, dict):
        return f"the manifest is a JSON {type(manifest).__name__}, not an object"
    if manifest.get("version") != INDEX_VERSION:
        return f"index version {manifest.get('version')!r}, this sharpclip reads {INDEX_VERSION}"
    why = _schema_error(manifest, SCHEMA, "") or _schema_error(manifest["model"], MODEL_SCHEMA, "model.")
    why = why or _schema_error(manifest["dataset"], DATA_SCHEMA, "dataset.")
    if why is None and manifest["chunk_size"] < 1:
        why = f"key 'chunk_size' is {manifest['chunk_size']}, not >= 1"
    records = [*manifest["dataset"]["files"].values(), *manifest["chunks"].values()] if why is None else []
    return why or next((e for r in records if (e := _schema_error(r, FILE_SCHEMA, "file record."))), None)


def read_manifest(folder: Path) -> dict[str, Any] | None:
    """The manifest of an index folder, or None when there is none; a damaged or hand-edited one → `IndexMismatch`
    naming the file and `--rebuild`."""
    path = folder / MANIFEST
    if not path.is_file():
        return None
    try:
        manifest = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise IndexMismatch(f"{path}: not a JSON manifest ({err}); rebuild the index (--rebuild)") from None
    if why := manifest_error(manifest):
        raise IndexMismatch(f"{path}: not a manifest this sharpclip can read ({why}); rebuild the index (--rebuild)")
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


def _rows(path: Path) -> tuple[int, ...] | None:
    """The shape of a chunk's embedding, read from its header (None when the file is not a readable chunk)."""
    try:
        with safe_open(str(path), "pt") as f:
            return tuple(f.get_slice("embedding").get_shape())
    except Exception:
        return None


def _chunk_done(path: Path, rows: int) -> bool:
    """Whether an earlier, interrupted build of this index wrote this chunk whole (sharpclip's own, `rows` rows);
    a chunk of sharpclip's name whose bytes changed since is refused (`IndexMismatch`), anything else there too."""
    if not path.exists() and not path.is_symlink():
        return False
    if not owned_files.is_ours(path):
        if owned_files.record(path) is not None and not path.is_symlink():
            raise IndexMismatch(f"{path}: the index chunk changed since it was written; rebuild the index (--rebuild)")
        owned_files.check([path], FLAG)  # raises its one line: not a file sharpclip wrote
    shape = _rows(path)
    return shape is not None and shape[0] == rows


def _embed_part(folder: Path, part: str, items: Sequence[Any], embed: Any, chunk: int, progress: bool) -> None:
    starts = range(0, len(items), chunk)
    bar = progress_bar(starts, enabled=progress, desc=f"index {part}s", unit="chunk")
    for c, start in enumerate(bar):
        path = _chunk_path(folder, part, c)
        rows = list(items[start : start + chunk])
        if _chunk_done(path, len(rows)):
            continue  # written by an earlier, interrupted build
        emb = embed(rows).float().contiguous()
        with _writing(path, "chunk") as tmp:
            save_file({"embedding": emb}, str(tmp))


def _own_chunks(folder: Path) -> list[Path]:
    """The chunks sharpclip's record lists in `folder` (by their exact names), present or not."""
    listed = owned_files.listed(folder)
    return [folder / n for n in sorted(listed) if CHUNK_NAME.fullmatch(n)]


def check_folder(folder: Path, locked: bool = False) -> None:
    """Refuse (one line) an index folder that is a symbolic link or a file, or that holds files but no record of
    sharpclip's writing them (someone else's folder); writes nothing. A folder holding the build lock is a build's
    own: its contents are checked only `locked` (under that lock, where no build is half-way through starting)."""
    if folder.is_symlink() or (folder.exists() and not folder.is_dir()):
        owned_files.folder(folder, FLAG, derived=True)  # raises its one line
    names = [p.name for p in folder.iterdir()] if folder.is_dir() else []
    if LOCK in names and not locked:
        return  # a build's folder (perhaps mid-start): checked again under its lock
    names = [n for n in names if n != LOCK and not owned_files.is_temporary(n)]  # a build killed as it started
    if names and owned_files.REGISTRY not in names:
        raise owned_files.NotOurs(
            f"{folder}: not empty and not an index sharpclip wrote (no {owned_files.REGISTRY} there; it holds "
            f"{', '.join(sorted(names)[:3])}); nothing there is touched: choose another {FLAG} folder"
        )


class BuildLock:
    """`.sharpclip-index.lock` in an index folder, flock-held by the one process building it; another process
    waits for it (logging the holder's pid) or, with `wait=False`, is refused naming the pid."""

    def __init__(self, folder: Path, wait: bool = True) -> None:
        self.path, self.wait, self._fd = folder / LOCK, wait, -1

    def __enter__(self) -> BuildLock:
        try:
            self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o644)
        except OSError as err:
            raise owned_files.NotOurs(f"{self.path}: cannot open the index's lock ({err.strerror}); "
                                      f"choose another {FLAG} folder") from None  # fmt: skip
        self._refuse_foreign()
        try:
            fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(self._fd, 64, 0).decode(errors="replace").strip() or "?"
            if not self.wait:
                os.close(self._fd)
                raise IndexMismatch(f"{self.path.parent}: an index build is running there (pid {holder}); wait for "
                                    "it to finish") from None  # fmt: skip
            log.warning("waiting for pid %s, which is building the index %s", holder, self.path.parent)
            fcntl.flock(self._fd, fcntl.LOCK_EX)
        os.ftruncate(self._fd, 0)
        os.pwrite(self._fd, f"{os.getpid()}\n".encode(), 0)
        return self

    def _refuse_foreign(self) -> None:
        """Refuse (NotOurs) a file under the lock's name that sharpclip's lock cannot be: a hard link (another name
        shares its bytes) or text other than a pid; it is written in place, so it must be the lock alone."""
        st, text = os.fstat(self._fd), os.pread(self._fd, 64, 0)
        if st.st_nlink == 1 and re.fullmatch(rb"\d*\n?", text):
            return
        os.close(self._fd)
        why = "a hard link to another file" if st.st_nlink != 1 else "it holds other text"
        raise owned_files.NotOurs(f"{self.path}: not a lock sharpclip wrote ({why}); nothing there is touched: "
                                  f"choose another {FLAG} folder")  # fmt: skip

    def __exit__(self, *exc: object) -> None:
        os.close(self._fd)


def build_index(
    folder: str | Path,
    embedder: Embedder,
    model: dict[str, Any],
    dataset: RetrievalSet,
    spec: dict[str, Any],
    chunk_size: int = CHUNK_SIZE,
    progress: bool = True,
    wait: bool = True,
) -> Path:
    """Embed `dataset` (images, then captions) into `folder`, resuming an interrupted build of the same model and
    files; refuses (IndexMismatch) an index of another model or other files. Returns the folder. One build at a
    time (`BuildLock`; `wait`: wait for another process's build, else refuse naming its pid).

    model: {"name", "class", "digest", "preprocessing"} (`model_record`); spec: how to read the dataset again."""
    folder = Path(folder)
    check_folder(folder)  # before anything is written
    owned_files.folder(folder, FLAG, derived=True)
    with BuildLock(folder, wait):
        check_folder(folder, locked=True)  # again under the lock
        _build_locked(folder, embedder, model, dataset, spec, chunk_size, progress)
    return folder


def _own_manifest(folder: Path) -> dict[str, Any] | None:
    """The folder's manifest when sharpclip wrote it and nobody changed it since; None when there is none."""
    path = folder / MANIFEST
    if path.is_symlink():
        raise owned_files.NotOurs(f"{path} is a symbolic link, not an index manifest sharpclip wrote; nothing there is "
                                  f"touched: move it away, or choose another {FLAG} folder")  # fmt: skip
    manifest = read_manifest(folder)
    if manifest is not None and not owned_files.is_ours(path):
        if why := owned_files.registry_error(folder):
            raise owned_files.NotOurs(f"{why}; nothing there is touched")
        if owned_files.record(path) is None:
            raise owned_files.NotOurs(f"{path}: not an index manifest sharpclip wrote (not in {owned_files.REGISTRY}); "
                                      f"nothing there is touched: choose another {FLAG} folder")  # fmt: skip
        raise IndexMismatch(f"{path}: changed since sharpclip wrote it; rebuild the index (--rebuild)")
    return manifest


def _build_locked(folder: Path, embedder: Embedder, model: dict[str, Any], dataset: RetrievalSet,
                  spec: dict[str, Any], chunk_size: int, progress: bool) -> None:  # fmt: skip
    manifest = _own_manifest(folder)
    data = dataset_record(dataset, spec, hash_files=manifest is None)  # an existing index: stat its files first
    if manifest is None:
        for path in _own_chunks(folder):  # an earlier index's chunks: sharpclip's own, never another's
            owned_files.remove(path, FLAG, listed=True)
        manifest = {"version": INDEX_VERSION, "model": model, "dataset": data, "chunk_size": chunk_size,
                    "dim": None, "complete": False, "chunks": {}}  # fmt: skip
        _write_json(folder / MANIFEST, manifest)
    elif reason := mismatch(manifest, model, data):
        raise IndexMismatch(f"index {folder}: {reason}; build a new one (--rebuild, or another --index)")
    if not manifest["complete"]:
        chunk = manifest["chunk_size"]
        _embed_part(folder, "image", dataset.images, embedder.images, chunk, progress)
        _embed_part(folder, "text", dataset.captions, embedder.texts, chunk, progress)
        names = [_chunk_path(folder, p, c).name for p, n in _parts(manifest) for c in range(-(-n // chunk))]
        manifest["chunks"] = {n: owned_files.record(folder / n) for n in names}
        manifest["dim"] = int(_rows(_chunk_path(folder, "image", 0))[1])
        manifest["complete"] = True
        _write_json(folder / MANIFEST, manifest)


def _parts(manifest: dict[str, Any]) -> list[tuple[str, int]]:
    data = manifest["dataset"]
    return [("image", len(data["items"])), ("text", len(data["captions"]))]


def remove_index(folder: Path) -> None:
    """`--rebuild`: delete an index's own files (its manifest and its chunks, by their exact names, only those
    sharpclip's record lists), nothing else; refuses a folder that is not an index sharpclip wrote."""
    if folder.is_symlink() or (folder.exists() and not folder.is_dir()):
        owned_files.folder(folder, "--rebuild", derived=True)  # raises its one line
    if not folder.exists():
        return
    manifest = folder / MANIFEST
    if why := owned_files.registry_error(folder):
        raise owned_files.NotOurs(f"--rebuild: {why}; nothing deleted")
    if owned_files.record(manifest) is None:
        raise owned_files.NotOurs(
            f"--rebuild: {folder} holds no index manifest sharpclip wrote (none listed in {owned_files.REGISTRY}); "
            f"it is not an index, nothing deleted: choose another {FLAG} folder"
        )
    with BuildLock(folder, wait=False):
        paths = [manifest, *_own_chunks(folder)]
        for path in paths:  # every one checked before the first is deleted: a refusal leaves the index whole
            if path.is_symlink() or (path.exists() and not path.is_file()):
                raise owned_files.NotOurs(
                    f"--rebuild: {path} is a symbolic link or a folder, not a file "
                    f"sharpclip wrote; nothing deleted: move it away, or choose another {FLAG}"
                )
        for path in paths:
            owned_files.remove(path, FLAG, listed=True)


def model_record(
    name: str, model: torch.nn.Module, preprocess: Any, tokenizer: Any, digest: str | None = None
) -> dict[str, Any]:
    """The manifest's model part: the name given, its class, the weights' sha256 (`digest` when the caller has it,
    e.g. eval.manifest.cached_weights_sha256's) and the preprocessing."""
    return {"name": name, "class": type(model).__name__, "digest": digest or weights_sha256(model),
            "preprocessing": preprocessing_record(preprocess, tokenizer)}  # fmt: skip


# -- reading and searching --------------------------------------------------------------------------------------------
@dataclass
class Index:
    """A complete index in memory. image: (N_img, D), text: (N_txt, D), L2-normalised float32."""

    folder: Path
    manifest: dict[str, Any]
    image: Tensor
    text: Tensor


def _read_chunk(path: Path, rec: dict[str, Any] | None, rows: int, dim: int) -> Tensor:
    """One chunk, checked: present, its bytes those the manifest recorded (sha256 when its size or mtime moved),
    readable, `rows` × `dim`; else `IndexMismatch` naming the file and `--rebuild`."""
    advice = "rebuild the index (--rebuild)"
    if rec is None:
        raise IndexMismatch(f"{path}: the manifest records no such chunk; {advice}")
    if path.is_symlink():
        raise IndexMismatch(f"{path}: a symbolic link, not the chunk sharpclip wrote; move it away, then {advice}")
    if not path.is_file():
        raise IndexMismatch(f"{path}: the index chunk is gone; {advice}")
    st = path.stat()
    if (st.st_size, st.st_mtime_ns) != (rec["size"], rec["mtime_ns"]) and sha256_file(path) != rec["sha256"]:
        raise IndexMismatch(f"{path}: the index chunk changed since the build (sha256 {rec['sha256'][:12]}… then); "
                            f"{advice}")  # fmt: skip
    try:
        emb = load_file(path)["embedding"]
    except Exception as err:
        raise IndexMismatch(f"{path}: unreadable index chunk ({' '.join(str(err).split())[:120]}); {advice}") from None
    if emb.dim() != 2 or tuple(emb.shape) != (rows, dim):
        raise IndexMismatch(f"{path}: the index chunk holds {tuple(emb.shape)}, not ({rows}, {dim}); {advice}")
    return emb


def _read_part(folder: Path, manifest: dict[str, Any], part: str, n: int) -> Tensor:
    chunk, dim = manifest["chunk_size"], manifest["dim"]
    parts = []
    for c, start in enumerate(range(0, n, chunk)):
        path = _chunk_path(folder, part, c)
        parts.append(_read_chunk(path, manifest["chunks"].get(path.name), min(chunk, n - start), dim))
    return torch.cat(parts) if parts else torch.empty(0, dim or 0)


def load_index(folder: str | Path) -> Index:
    """Read a complete index, every chunk checked against the manifest (the model and the dataset's files are
    `build_index`'s checks, done before it returns)."""
    folder = Path(folder)
    manifest = read_manifest(folder)
    if manifest is None or not manifest["complete"] or manifest["dim"] is None:
        raise IndexMismatch(f"{folder}: no complete index here (build it first; an interrupted build resumes)")
    image = _read_part(folder, manifest, "image", len(manifest["dataset"]["items"]))
    text = _read_part(folder, manifest, "text", len(manifest["dataset"]["captions"]))
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
