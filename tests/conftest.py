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


# ------------------------------------------------------------------ shared test networks
# Small float64 networks shared by the tests: ``make_net(kind)`` returns a fresh network
# (seeded, so equal calls give equal weights); ``any_net`` runs a test once per kind.


class _SmallCNN(torch.nn.Module):
    """Conv (weight sharing) -> ReLU -> conv -> max-pool -> linear; input ``[N, 1, 6, 6]``."""

    def __init__(self, c: int = 3) -> None:
        super().__init__()
        self.conv1 = torch.nn.Conv2d(1, 2, 3, padding=1)
        self.conv2 = torch.nn.Conv2d(2, 2, 3)
        self.fc = torch.nn.Linear(8, c)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.conv1(x))
        h = torch.nn.functional.max_pool2d(torch.tanh(self.conv2(h)), 2)
        return self.fc(h.flatten(1))


def _mlp(c: int = 3) -> torch.nn.Module:
    from _dense import tiny_mlp

    return tiny_mlp(4, 5, c)


def _cnn(c: int = 3) -> torch.nn.Module:
    return _SmallCNN(c).double()


def _multihead(c: int = 3, n_heads: int = 3) -> torch.nn.Module:
    from fromp.models import MultiHeadMLP

    return MultiHeadMLP(4, (5,), n_heads=n_heads, head_size=c).double()


def _bn(c: int = 3) -> torch.nn.Module:
    from _dense import tiny_cnn

    return tiny_cnn(c)  # batch norm with random statistics, in eval mode


#: kind -> (factory(c) -> network, input shape of one example)
NETS = {
    "mlp": (_mlp, (4,)),
    "cnn": (_cnn, (1, 6, 6)),
    "multihead": (_multihead, (4,)),
    "bn": (_bn, (1, 6, 6)),
}


class NetCase:
    """A test network with matching inputs: ``net``, ``inputs(n)``, ``kind`` and, for
    multi-head networks, ``n_heads`` (``head(t)`` is the network seen through head ``t``)."""

    def __init__(self, kind: str, c: int = 3, seed: int = 0) -> None:
        factory, self.input_shape = NETS[kind]
        torch.manual_seed(seed)
        self.kind, self.c, self.net = kind, c, factory(c)
        self.n_heads = getattr(self.net, "n_heads", 1)

    def inputs(self, n: int, seed: int = 1) -> torch.Tensor:
        g = torch.Generator().manual_seed(seed)
        return torch.randn(n, *self.input_shape, generator=g, dtype=torch.float64)

    def head(self, task: int | None = None) -> torch.nn.Module:
        from fromp.models import with_task

        return with_task(self.net, task if self.n_heads > 1 else None)


@pytest.fixture
def make_net():
    """``make_net(kind, c=3, seed=0) -> NetCase`` for kind in ``NETS``."""
    return NetCase


@pytest.fixture(params=sorted(NETS))
def any_net(request) -> NetCase:
    """One :class:`NetCase` per kind of network (MLP, CNN, multi-head MLP, BN in eval)."""
    return NetCase(request.param)
