"""Reaching the process group's key-value store: joining it in bounded time with one line on failure, and
telling whether it still answers.

Started by a scheduler without torchrun (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT in the environment), rank 0
hosts the store on MASTER_PORT and the other ranks connect to it. Two failures used to be a traceback or silence:

- the port is taken: rank 0's `init_process_group` raises `DistNetworkError ... EADDRINUSE` (30 lines); `joining`
  turns it, and any other store error of the start, into one `ProcessGroupError` line naming the address;
- another program listens there: a rank connects to it and waits for an answer that never comes, and the store's
  own timeout does not bound that wait. `joining` bounds it by `train.dist_timeout_min`: a rank still not in the
  process group then prints one line naming the address and ends.

After rank 0 (the store's host) died, every call on the store makes torch print a C++ stack dump before it raises;
`store_reachable` asks the operating system first (a TCP connect to the store's address, which the store ignores),
so the failure propagation (train.failures.failures_end_every_rank) skips a store that is gone. A host that is
still being torn down may accept that connect, so the failing rank's own store calls also run under
`c10d_stderr_silenced`, which sends this process's stderr (file descriptor 2, where torch's C++ writes) to the null
device for their duration; the rank's own line is printed outside it.
"""

from __future__ import annotations

import contextlib
import os
import socket
import sys
import threading
from collections.abc import Iterator

import torch.distributed as dist

DEFAULT_TIMEOUT_MIN = 10.0  # torch's own default for the process group when train.dist_timeout_min is unset
EXIT_NO_GROUP = 2  # a rank that could not join: a start-up error, as the CLI's own


class ProcessGroupError(OSError):
    """The process group could not be started (its store's port is taken, or its address does not answer)."""


def store_address() -> str:
    """'MASTER_ADDR:MASTER_PORT' as the environment gives them ('?' for what is unset)."""
    return f"{os.environ.get('MASTER_ADDR', '?')}:{os.environ.get('MASTER_PORT', '?')}"


def _describe(err: BaseException) -> str:
    text = " ".join(str(err).split())
    if "EADDRINUSE" in text or "address already in use" in text:
        return (f"the store's port {store_address()} (MASTER_ADDR:MASTER_PORT) is already in use by another "
                "program; choose a free MASTER_PORT for this job")  # fmt: skip
    return f"the store at {store_address()} (MASTER_ADDR:MASTER_PORT) failed: {type(err).__name__}: {text[:300]}"


def _watchdog(done: threading.Event, timeout_min: float, err_fd: int) -> None:
    if done.wait(timeout_min * 60):
        return
    rank = os.environ.get("RANK", "?")
    who = ("the other ranks did not connect to the store it hosts" if rank == "0" else
           "no process-group store answered there: rank 0 did not start or failed, or another program listens on "
           "that port")  # fmt: skip
    line = (f"sharpclip: rank {rank} could not join the process group within {timeout_min:g} min "
            f"(train.dist_timeout_min) at {store_address()} (MASTER_ADDR:MASTER_PORT): {who}")  # fmt: skip
    with contextlib.suppress(OSError):
        os.write(err_fd, (line + "\n").encode())  # the real stderr: fd 2 is silenced while joining
    os._exit(EXIT_NO_GROUP)


@contextlib.contextmanager
def joining(timeout_min: float | None) -> Iterator[None]:
    """Around `init_process_group`: a store error of the start is one ProcessGroupError line; a rank still waiting
    after `timeout_min` (DEFAULT_TIMEOUT_MIN when None) prints one line and exits with EXIT_NO_GROUP. torch's C++
    output is silenced meanwhile: a store client answered by another program (an HTTP server or proxy on that
    address) retries with a C++ stack dump each time, 99 lines before the one line."""
    done = threading.Event()
    sys.stderr.flush()
    err_fd = os.dup(2)
    threading.Thread(target=_watchdog, args=(done, timeout_min or DEFAULT_TIMEOUT_MIN, err_fd), daemon=True,
                     name="sharpclip-join").start()  # fmt: skip
    try:
        with c10d_stderr_silenced():
            yield
    except (dist.DistNetworkError, dist.DistStoreError) as err:
        raise ProcessGroupError(f"cannot start the process group: {_describe(err)}") from err
    finally:
        done.set()
        os.close(err_fd)


def _address(store: object) -> tuple[str, int] | None:
    """(host, port) of the TCP store under `store` (through PrefixStore wrappers), or None for another kind."""
    for _ in range(8):
        if isinstance(store, dist.TCPStore):
            return store.host, store.port
        store = getattr(store, "underlying_store", None)
        if store is None:
            return None
    return None


def store_reachable(store: object, timeout_s: float = 1.0) -> bool:
    """Whether the store's host still accepts connections: a plain TCP connect, so that a store that is gone is
    found without a store call (each prints a C++ stack dump). True without asking for a store that is not a TCP
    store, and under torchrun, whose launcher hosts the store and outlives every rank."""
    address = _address(store)
    if address is None or os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        return True
    try:
        with socket.create_connection(address, timeout=timeout_s):
            return True
    except OSError:
        return False


@contextlib.contextmanager
def c10d_stderr_silenced() -> Iterator[None]:
    """This process's file descriptor 2 on the null device for the duration (torch's C++ warnings and stack dumps of
    calls on a dead store go there); Python's sys.stderr is flushed first and restored after."""
    sys.stderr.flush()
    saved, null = os.dup(2), os.open(os.devnull, os.O_WRONLY)
    os.dup2(null, 2)
    try:
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        os.close(null)
