"""Opening the user's files without ever blocking: anything but a regular file is refused before it is read.

`open()` on a named pipe (FIFO) waits for a writer that never comes, and a device such as /dev/zero never ends, so a
data path that is not a regular file would hang a run forever, where `data.on_bad_sample: skip` cannot help (nothing
returns). Every image, shard and annotation file sharpclip reads goes through `check_regular` or `open_regular`: the
path is `os.stat`-ed first, then opened with O_NONBLOCK (a FIFO that appears between the two calls still returns at
once) and checked again on the open descriptor, so the check and the read see the same file.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path
from typing import BinaryIO

KINDS = (  # (test on st_mode, what it is called in messages)
    (stat.S_ISFIFO, "a named pipe (FIFO)"),
    (stat.S_ISDIR, "a directory"),
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
    (stat.S_ISSOCK, "a socket"),
)


class NotRegularFileError(OSError):
    """A data path names a FIFO, a directory, a device or a socket; the message names the path and what it is."""

    def __init__(self, path: str | Path, kind: str):
        self.path, self.kind = str(path), kind
        super().__init__(f"not a regular file: {path} is {kind}")


def _kind(mode: int) -> str | None:
    """What a non-regular file is called (None for a regular file)."""
    if stat.S_ISREG(mode):
        return None
    return next((name for test, name in KINDS if test(mode)), "not a regular file")


def check_regular(path: str | Path) -> Path:
    """`path` when it is a regular file (symlinks followed); FileNotFoundError when it does not exist,
    NotRegularFileError when it is anything else. Opens nothing."""
    kind = _kind(os.stat(path).st_mode)
    if kind is not None:
        raise NotRegularFileError(path, kind)
    return Path(path)


def open_regular(path: str | Path) -> BinaryIO:
    """The regular file at `path` opened for binary reading (see the module docstring); raises as `check_regular`."""
    check_regular(path)
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0))
    try:
        kind = _kind(os.fstat(fd).st_mode)  # the file actually opened, in case the path changed after the stat
        if kind is not None:
            raise NotRegularFileError(path, kind)
        os.set_blocking(fd, True)
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def read_regular(path: str | Path) -> bytes:
    """The bytes of the regular file at `path` (raises as `check_regular`)."""
    with open_regular(path) as f:
        return f.read()
