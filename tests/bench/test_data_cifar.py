"""Split CIFAR end to end on small synthetic files in torchvision's CIFAR format.

Real CIFAR-10/100 are not needed: the files written here have the layout and pickle format
of ``cifar-10-batches-py/`` and ``cifar-100-python/`` (torchvision's checksum check is
bypassed because the contents are synthetic).
"""

from __future__ import annotations

import pickle

import numpy as np
import pytest
import torch
import torchvision.datasets as tvd
from fromp_bench.data import split_cifar
from fromp_bench.runner import RunConfig, run


def _write(path, labels_key, labels, rng):
    data = rng.integers(0, 256, size=(len(labels), 3 * 32 * 32), dtype=np.uint8)
    with open(path, "wb") as fh:
        pickle.dump({"data": data, labels_key: list(labels)}, fh)


@pytest.fixture
def cifar_root(tmp_path, monkeypatch):
    rng = np.random.default_rng(0)
    c10 = tmp_path / "cifar-10-batches-py"
    c10.mkdir()
    for i in range(1, 6):
        _write(c10 / f"data_batch_{i}", "labels", np.arange(20) % 10, rng)
    _write(c10 / "test_batch", "labels", np.arange(30) % 10, rng)
    with open(c10 / "batches.meta", "wb") as fh:
        pickle.dump({"label_names": [f"c{i}" for i in range(10)]}, fh)
    c100 = tmp_path / "cifar-100-python"
    c100.mkdir()
    _write(c100 / "train", "fine_labels", np.arange(400) % 100, rng)
    _write(c100 / "test", "fine_labels", np.arange(200) % 100, rng)
    with open(c100 / "meta", "wb") as fh:
        pickle.dump({"fine_label_names": [f"f{i}" for i in range(100)]}, fh)
    monkeypatch.setattr(tvd.CIFAR10, "_check_integrity", lambda self: True)
    monkeypatch.setattr(tvd.cifar, "check_integrity", lambda path, md5=None: True)
    return tmp_path


def test_split_cifar_protocol(cifar_root):
    seq = split_cifar(cifar_root, download=False)
    assert seq.name == "split-cifar" and seq.multi_head and len(seq) == 6
    assert seq.input_shape == (3, 32, 32) and seq.n_outputs == 10
    assert seq[0].classes == list(range(10)) and len(seq[0].train_x) == 100
    for t in range(1, 6):
        assert seq[t].classes == list(range(10 * (t - 1), 10 * t))
        assert len(seq[t].train_x) == 40 and len(seq[t].test_x) == 20
        assert set(seq[t].train_y.tolist()) == set(range(10))
    x = seq[2].train_x
    assert x.shape[1:] == (3, 32, 32) and x.dtype == torch.float32
    assert 0.0 <= x.min() and x.max() <= 1.0


@pytest.mark.parametrize("strategy", ["naive", "fromp"])
def test_split_cifar_runs_through_the_runner(cifar_root, strategy):
    from fromp_bench.registry import get_strategy

    if not get_strategy(strategy).available():
        pytest.skip(f"{strategy} not installed")
    overrides: dict = {"train_epochs": 1, "train_mb_size": 32}
    stop = None
    if strategy == "fromp":  # its curvature and kernels cost ~5 s per task for this CNN on CPU
        overrides["kwargs"] = {"n_points": 10}
        stop = 2
    res = run(
        RunConfig(
            "split-cifar",
            strategy,
            data_root=str(cifar_root),
            overrides=overrides,
            train_size=20,
            stop_after=stop,
            progress=False,
        )
    )
    mat = res["accuracy_matrix"]
    assert len(mat) == (stop or 6) and res["complete"] == (stop is None)
    assert all(0.0 <= a <= 100.0 for a in mat[-1] if a is not None)
