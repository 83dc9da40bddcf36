"""Shared fixtures. Real data is found through ``$FROMP_DATA`` (CI: ``../shared/data``)."""

from __future__ import annotations

import os
from pathlib import Path

import matplotlib
import pytest
import torch

matplotlib.use("Agg")


def _has_mnist(root: Path) -> bool:
    raw = root / "MNIST" / "raw"
    return any((raw / f"train-images-idx3-ubyte{ext}").exists() for ext in ("", ".gz"))


@pytest.fixture(scope="session")
def mnist_root() -> Path:
    """The data root holding real MNIST; skips the test (with the reason) when absent."""
    env = os.environ.get("FROMP_DATA", "")
    if not env:
        pytest.skip("real MNIST needed: set FROMP_DATA to a data root holding MNIST/raw/")
    root = Path(env)
    if not _has_mnist(root):
        pytest.skip(f"real MNIST needed: {root / 'MNIST' / 'raw'} has no MNIST files")
    return root


@pytest.fixture(autouse=True)
def _seed_and_threads():
    """Every test starts from the same RNG state; tests run single-threaded for speed on
    small tensors and to keep CI timings stable."""
    torch.manual_seed(0)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
