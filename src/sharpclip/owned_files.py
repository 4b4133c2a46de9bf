"""What sharpclip may replace or delete among the files it writes: only what it marked when it wrote it.

Every command that writes a file outside a run directory (a search index, an HTML page and its `<page>_files/`
thumbnails, a figure, a JSON or markdown report, compare, analyze and eval outputs, `validate-data --json`, the
demo's reports) writes it through this module. Run directories keep their own marker (train.run_dir) and exports
their own record (models.export); both follow the same rule. The rule, one for all of them:

- **the mark**: each folder sharpclip writes into holds a registry, `.sharpclip-files.json`, listing every file
  sharpclip wrote there with its size, mtime and sha256 at the time. A file is sharpclip's own when the registry
  lists it and its bytes are those recorded (stat first; the sha256 only when the size or mtime moved).
- **replace only that**: a path that does not exist may be written; one that is sharpclip's own may be replaced or
  deleted; anything else (the user's notes, another tool's `manifest.json`, a file edited since) is refused with
  one line naming the file and the flag that chooses another path (`NotOurs`, a `ValueError`).
- **no symlinks**: a symbolic link at a path sharpclip writes or deletes, at the folder it writes into (the user's
  `--out` included), or at a folder it makes below the path the user gave (`<page>_files`, an index's folder,
  `eval --out DIR`'s `DIR/<model>/`) is refused: nothing is written or deleted through one.
- **atomic**: a file is written under a per-process temporary name in its own folder, then renamed into place, so
  a killed or failed write (a full disk) leaves the old file and no half-written one.

API (everything else is private)::

    check([paths], flag)                 # refuse before writing anything: every path absent or ours
    folder(path, flag, derived=False)    # make a folder to write into; refuse a file or (derived) a symlink there
    with writing(path, flag) as tmp:     # write tmp (keeps path's suffix), then it replaces path, registered
        fig.savefig(tmp)
    write_text(path, text, flag)         # the same for text (write_bytes for bytes); returns path
    is_ours(path) / record(path)         # whether path is ours; its registry record ({size, mtime_ns, sha256})
    listed(folder)                       # the names the folder's registry lists
    registry_error(folder)               # why the folder's registry is not sharpclip's (None when it is or is absent)
    is_temporary(name)                   # whether a name is one of sharpclip's temporary names (a write in flight)
    remove(path, flag, listed=False)     # delete a file of ours (refuses any other; see its docstring)

The registry is updated under an `flock` of its folder, so writers in one folder at once do not lose entries. While
a rename is in flight the registry lists both the old and the new bytes' records, so a kill between the rename and
the registry's update never leaves a file of sharpclip's unowned (an index build killed after a chunk's rename
resumes). Sharpclip's temporary names (`.<stem>.<pid>-<hex>.tmp<suffix>`) are its own too (`is_temporary`).
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import re
import stat
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

REGISTRY = ".sharpclip-files.json"
KIND = "sharpclip written files"  # the registry's own mark: a file of that name without it is not ours either
_BLOCK = 1 << 20


class NotOurs(ValueError):
    """A path sharpclip will not write or delete: the message names it and the flag that chooses another."""


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(_BLOCK):
            h.update(block)
    return h.hexdigest()


def _advice(flag: str) -> str:
    return f"choose another {flag}" if flag else "choose another path"


def _read_registry(folder: Path, flag: str = "") -> dict[str, dict[str, Any]]:
    """The registry's {name: record} of `folder` ({} when there is none); a foreign or damaged one is refused."""
    path = folder / REGISTRY
    if path.is_symlink():
        raise NotOurs(f"{path} is a symbolic link, not sharpclip's record of its files; {_advice(flag)}")
    if not path.exists():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
        files = data["files"] if isinstance(data, dict) and data.get("kind") == KIND else None
    except (OSError, ValueError, KeyError) as err:
        raise NotOurs(f"{path}: not sharpclip's record of its files ({err}); {_advice(flag)}") from None
    if not isinstance(files, dict) or not all(_is_entry(r) for r in files.values()):
        raise NotOurs(f"{path}: not sharpclip's record of its files; {_advice(flag)}")
    return files


def _is_entry(entry: Any) -> bool:
    """A record, or a list of them: a write in flight (the old bytes and the new are both sharpclip's until the
    rename is done, so a kill between the rename and the registry's update leaves neither unowned)."""
    if isinstance(entry, list):
        return bool(entry) and all(isinstance(r, dict) for r in entry)
    return isinstance(entry, dict)


def _records(entry: Any) -> list[dict[str, Any]]:
    return [] if entry is None else entry if isinstance(entry, list) else [entry]


def record(path: str | Path) -> dict[str, Any] | None:
    """The registry's record of `path` ({size, mtime_ns, sha256}; the newest, during a write) when its folder's
    registry lists it, else None."""
    path = Path(path)
    try:
        found = _records(_read_registry(path.parent).get(path.name))
    except NotOurs:
        return None
    return found[-1] if found else None


def registry_error(folder: str | Path) -> str | None:
    """Why `folder`'s registry is not sharpclip's record (damaged, a link, another tool's file), one line naming it;
    None when there is none or it is sharpclip's."""
    try:
        _read_registry(Path(folder))
    except NotOurs as err:
        return str(err)
    return None


def listed(folder: str | Path) -> set[str]:
    """The names `folder`'s registry lists (empty without one, or with one that is not sharpclip's)."""
    try:
        return set(_read_registry(Path(folder)))
    except NotOurs:
        return set()


def _matches(path: Path, rec: dict[str, Any]) -> bool:
    st = path.lstat()
    if not stat.S_ISREG(st.st_mode):
        return False
    if (st.st_size, st.st_mtime_ns) == (rec.get("size"), rec.get("mtime_ns")):
        return True
    return st.st_size == rec.get("size") and _sha256(path) == rec.get("sha256")


def _matches_entry(path: Path, entry: Any) -> bool:
    return any(_matches(path, rec) for rec in _records(entry))


def _entry(path: Path) -> Any:
    try:
        return _read_registry(path.parent).get(path.name)
    except NotOurs:
        return None


def is_ours(path: str | Path) -> bool:
    """Whether `path` is a regular file (not a link) that sharpclip wrote and nobody changed since."""
    path = Path(path)
    entry = _entry(path)
    return entry is not None and not path.is_symlink() and path.exists() and _matches_entry(path, entry)


def _refusal(path: Path, flag: str) -> str | None:
    """Why `path` may not be written (None when it may: absent, or ours)."""
    if path.is_symlink():
        return f"{path} is a symbolic link; sharpclip never writes through one: {_advice(flag)}"
    if not path.exists():
        return None
    if path.is_dir():
        return f"{path} is a folder, not a file sharpclip wrote; {_advice(flag)}"
    entry = _read_registry(path.parent, flag).get(path.name)
    if entry is None:
        return (f"{path} exists and sharpclip did not write it (not in {REGISTRY} there); it replaces only its own "
                f"files: {_advice(flag)}, or move the file away")  # fmt: skip
    if not _matches_entry(path, entry):
        return f"{path} changed since sharpclip wrote it; it replaces only its own files: {_advice(flag)}, or move it"
    return None


def check(paths: Iterable[str | Path], flag: str = "") -> None:
    """Refuse (`NotOurs`, one line) unless every path may be written: absent or sharpclip's own, not a link, and its
    folder not a file. Call before writing anything, so a refused command leaves everything as it was."""
    for path in map(Path, paths):
        parent = path.parent
        if parent.is_symlink():  # the folder written into: never through a link, the user's --out included
            raise NotOurs(f"{parent} is a symbolic link; sharpclip never writes through one: {_advice(flag)}")
        if parent.exists() and not parent.is_dir():
            raise NotOurs(f"{parent} is a file, not a folder; {_advice(flag)}")
        if reason := _refusal(path, flag):
            raise NotOurs(reason)


def folder(path: str | Path, flag: str = "", derived: bool = False) -> Path:
    """Make folder `path` (and its parents) to write into. Refused: a file there, and a symbolic link there, whether
    sharpclip chose the name (`derived`: `<page>_files`, an index folder) or the user did. Returns `path`."""
    path = Path(path)
    if path.is_symlink():
        raise NotOurs(f"{path} is a symbolic link; sharpclip never writes through one: {_advice(flag)}")
    blocker = next((p for p in (path, *path.parents) if p.exists() or p.is_symlink()), None)
    if blocker is not None and not blocker.is_dir():
        raise NotOurs(f"{blocker} is a file, not a folder; {_advice(flag)}")
    path.mkdir(parents=True, exist_ok=True)
    return path


@contextlib.contextmanager
def _locked(folder: Path) -> Iterator[None]:
    fd = os.open(folder, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def _temporary(path: Path) -> Path:
    return path.with_name(f".{path.stem}.{os.getpid()}-{os.urandom(3).hex()}.tmp{path.suffix}")


_TEMPORARY = re.compile(r"\..+\.\d+-[0-9a-f]{6}\.tmp(\.[^.]+)?")


def is_temporary(name: str) -> bool:
    """Whether `name` has the form of sharpclip's temporary names (`.<stem>.<pid>-<hex>.tmp<suffix>`)."""
    return _TEMPORARY.fullmatch(name) is not None


def _update(folder: Path, changes: dict[str, Any], flag: str) -> None:
    """Apply {name: record, or None to forget it} to `folder`'s registry (under its flock), written atomically."""
    with _locked(folder):
        files = _read_registry(folder, flag)
        for name, rec in changes.items():
            if rec is None:
                files.pop(name, None)
            else:
                files[name] = rec
        text = json.dumps({"kind": KIND, "files": dict(sorted(files.items()))}, indent=1) + "\n"
        tmp = _temporary(folder / REGISTRY)
        try:
            tmp.write_text(text, encoding="utf-8")
            os.replace(tmp, folder / REGISTRY)
        finally:
            tmp.unlink(missing_ok=True)


@contextlib.contextmanager
def writing(path: str | Path, flag: str = "") -> Iterator[Path]:
    """Yield a temporary path (in `path`'s folder, with its suffix) to write; when the block ends without an error
    it replaces `path` and the registry records it. Refused up front (`NotOurs`) when `path` is not ours to
    replace. The temporary file is removed on any error."""
    path = Path(path)
    check([path], flag)
    folder(path.parent, flag)
    _read_registry(path.parent, flag)  # a foreign registry: refused before anything is written
    tmp = _temporary(path)
    try:
        yield tmp
        st = tmp.stat()
        rec = {"size": st.st_size, "mtime_ns": st.st_mtime_ns, "sha256": _sha256(tmp)}
        check([path], flag)  # again: something may have appeared there while we wrote
        old = _records(_entry(path)) if path.exists() else []
        _update(path.parent, {path.name: [*old, rec]}, flag)  # both sharpclip's while the rename is in flight
        os.replace(tmp, path)
        _update(path.parent, {path.name: rec}, flag)
    except OSError as err:
        if err.filename is not None or err.errno is None:
            raise
        raise OSError(err.errno, f"cannot write {path}: {err.strerror}") from None  # a full disk names the file
    finally:
        tmp.unlink(missing_ok=True)


def write_bytes(path: str | Path, data: bytes, flag: str = "") -> Path:
    """Write `data` to `path` by `writing`'s rule; returns `path`."""
    with writing(path, flag) as tmp:
        tmp.write_bytes(data)
    return Path(path)


def write_text(path: str | Path, text: str, flag: str = "") -> Path:
    """Write `text` (UTF-8) to `path` by `writing`'s rule; returns `path`."""
    return write_bytes(path, text.encode("utf-8"), flag)


def remove(path: str | Path, flag: str = "", listed: bool = False) -> None:
    """Delete `path` if it is sharpclip's own (and forget it); absent: nothing to do; anything else: `NotOurs`.

    `listed`: also a file the registry lists whose bytes changed since (a damaged index chunk that sharpclip's own
    check found, deleted on the user's explicit request such as `--rebuild`); still never a link or an unlisted file."""
    path = Path(path)
    damaged_own = listed and path.is_file() and not path.is_symlink() and record(path) is not None
    if not damaged_own and (reason := _refusal(path, flag)):
        raise NotOurs(reason)
    if path.exists():
        path.unlink()
    if record(path) is not None:
        _update(path.parent, {path.name: None}, flag)
