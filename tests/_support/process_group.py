"""A gloo process group of one rank inside the test process, for code that calls torch.distributed's collectives."""

from __future__ import annotations

import contextlib
import socket
from collections.abc import Iterator

import torch.distributed as dist


@contextlib.contextmanager
def one_rank_group() -> Iterator[None]:
    """A one-rank gloo group on a free local port, destroyed afterwards."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()
