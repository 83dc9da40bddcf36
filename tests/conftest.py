"""Shared fixtures. Real data is found through ``$FROMP_DATA`` (CI: ``../shared/data``)."""

from __future__ import annotations

import os
from pathlib import Path

import matplotlib
import pytest
import torch

matplotlib.use("Agg")

#: scripts that write reference data (they need packages the tests do not have): not tests
collect_ignore_glob = ["*/data/*.py"]


def pytest_collection_modifyitems(config, items) -> None:
    """The longer tests (``@pytest.mark.slow``) first, in their collection order: under
    ``-n`` the workers start on them and the run ends on short tests, not waiting on one
    long test that happened to come last."""
    items.sort(key=lambda item: item.get_closest_marker("slow") is None)


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


# ------------------------------------------------------------------ shared test networks
# Small float64 networks shared by the tests (one set, in ``fromp.testing``):
# ``make_net(kind)`` returns a fresh network (seeded, so equal calls give equal weights);
# ``any_net`` runs a test once per kind.
from tests.cases import NETS, NetCase  # noqa: E402


@pytest.fixture
def make_net():
    """``make_net(kind, c=3, seed=0) -> NetCase`` for kind in ``NETS``."""
    return NetCase


@pytest.fixture(params=sorted(NETS))
def any_net(request) -> NetCase:
    """One :class:`NetCase` per kind of network (MLP, CNN, multi-head MLP, BN in eval)."""
    return NetCase(request.param)


def quick_run_config(tmp_path: Path, overrides: dict, **kw):
    """A runner config for a quick Naive run on split-digits (96 training and 40 test
    examples per task, checkpointed in ``tmp_path``) with these training ``overrides``."""
    from fromp_bench.runner import RunConfig

    base = dict(
        benchmark="split-digits",
        strategy="naive",
        seed=0,
        overrides=overrides,
        train_size=96,
        test_size=40,
        checkpoint=str(tmp_path / "run.pt"),
        progress=False,
    )
    base.update(kw)
    return RunConfig(**base)
