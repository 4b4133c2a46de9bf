"""The process-wide TF32 switches, saved and put back: the trainer turns TF32 on for CUDA (devices.set_tf32), which
would otherwise change the numerics of every later test in the same process. The switches are read and written
through the interface sharpclip uses (`allow_tf32`, `set_float32_matmul_precision`): torch refuses to read them
after a mix of it and the newer per-backend `fp32_precision`."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch


def tf32_flags() -> tuple[str, bool, bool]:
    """(float32 matmul precision, CUDA matmul allow_tf32, cuDNN allow_tf32)."""
    return (torch.get_float32_matmul_precision(), torch.backends.cuda.matmul.allow_tf32,
            torch.backends.cudnn.allow_tf32)  # fmt: skip


@contextlib.contextmanager
def tf32_restored() -> Iterator[None]:
    """Run the body; afterwards the TF32 switches are what they were before it."""
    precision, matmul, cudnn = tf32_flags()
    try:
        yield
    finally:  # the precision first: it sets allow_tf32 too, which is then put back exactly
        torch.set_float32_matmul_precision(precision)
        torch.backends.cuda.matmul.allow_tf32 = matmul
        torch.backends.cudnn.allow_tf32 = cudnn
