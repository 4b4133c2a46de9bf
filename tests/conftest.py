"""Shared test set-up: make tests/_support importable (as `_support`) from every test module and worker script;
skip tests marked `gpu` where CUDA is not available; put the process-wide TF32 switches back after every test."""

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))

from _support.tf32 import tf32_restored  # importable once the path above is set


@pytest.fixture(autouse=True)
def _tf32_switches_restored():
    """A Trainer on CUDA turns TF32 on for the whole process; no test hands that to the next."""
    with tf32_restored():
        yield


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA (torch.cuda.is_available() is False)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
