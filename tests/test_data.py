"""Data discovery, task sequences and the clear error for missing data."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from _synthetic import synthetic_split
from fromp_bench import data as D


def test_root_precedence(monkeypatch, tmp_path):
    monkeypatch.delenv(D.DATA_ENV_VAR, raising=False)
    assert str(D.resolve_data_root()) == "data"
    monkeypatch.setenv(D.DATA_ENV_VAR, str(tmp_path / "env"))
    assert D.resolve_data_root() == tmp_path / "env"
    assert D.resolve_data_root(tmp_path / "arg") == tmp_path / "arg"


def test_split_mnist_missing_data_gives_clear_error(tmp_path):
    with pytest.raises(D.DataNotFoundError) as err:
        D.split_mnist(tmp_path, download=False)
    msg = str(err.value)
    assert str((tmp_path / "MNIST" / "raw").resolve()) in msg
    assert "train-images-idx3-ubyte" in msg and "t10k-labels-idx1-ubyte" in msg
    assert "--data-root" in msg and "FROMP_DATA" in msg and "download=True" in msg
    assert "\n" not in msg


def test_failed_download_is_reported_on_one_line(tmp_path, monkeypatch):
    import torchvision.datasets as tvd

    class Offline(tvd.MNIST):
        def download(self):
            raise RuntimeError("Error downloading:\n  no network")

    monkeypatch.setattr(tvd, "MNIST", Offline)
    with pytest.raises(D.DataNotFoundError) as err:
        D.split_mnist(tmp_path)
    msg = str(err.value)
    assert "Download failed: RuntimeError: Error downloading: no network" in msg
    assert "\n" not in msg


@pytest.mark.parametrize("loader", [D.load_fashion_mnist, D.load_cifar10, D.load_cifar100])
def test_other_data_sets_missing(loader, tmp_path):
    with pytest.raises(D.DataNotFoundError, match="Searched"):
        loader(tmp_path, download=False)


def test_split_digits_protocol():
    seq = D.split_digits()
    assert seq.name == "split-digits" and seq.multi_head and len(seq) == 5
    assert seq.input_shape == (1, 8, 8) and seq.n_outputs == 2
    total = 0
    for t, task in enumerate(seq):
        assert task.task_id == t and task.classes == [2 * t, 2 * t + 1]
        assert task.train_x.shape[1:] == (1, 8, 8) and task.train_x.dtype == torch.float32
        assert 0.0 <= task.train_x.min() and task.train_x.max() <= 1.0
        assert set(task.train_y.tolist()) == {0, 1} and set(task.test_y.tolist()) == {0, 1}
        total += len(task.train_x) + len(task.test_x)
    assert total == 1797
    # fixed split: the same seed gives the same tasks
    again = D.split_digits()
    assert torch.equal(again[3].test_x, seq[3].test_x)


def test_permuted_digits_protocol():
    """Split-Digits' images and split on one 10-way head: task 0 unpermuted, task t the
    t-th permutation of numpy's generator seeded with ``seed``, the same labels throughout."""
    seq = D.permuted_digits()
    assert seq.name == "permuted-digits" and not seq.multi_head and len(seq) == 5
    assert seq.input_shape == (64,) and seq.n_outputs == 10
    first, split = seq[0], D.split_digits()
    assert len(first.train_x) + len(first.test_x) == 1797
    for c in range(10):  # the same images as split-digits, flattened, in the same order
        s = split[c // 2]
        for x, y, sx, sy in ((first.train_x, first.train_y, s.train_x, s.train_y),
                             (first.test_x, first.test_y, s.test_x, s.test_y)):  # fmt: skip
            assert torch.equal(x[y == c], sx[sy == c % 2].flatten(1))
    rng = np.random.default_rng(0)
    perms = [np.arange(64)] + [rng.permutation(64) for _ in range(4)]
    assert len({tuple(p) for p in perms}) == 5
    for t, (task, perm) in enumerate(zip(seq, perms)):
        assert task.task_id == t and task.classes == list(range(10))
        assert torch.equal(task.train_x, first.train_x[:, perm])
        assert torch.equal(task.test_x, first.test_x[:, perm])
        assert torch.equal(task.train_y, first.train_y) and torch.equal(task.test_y, first.test_y)
        assert set(task.train_y.tolist()) == set(range(10))  # every task fills the head
    assert torch.equal(D.permuted_digits()[3].train_x, seq[3].train_x)  # fixed by its seed
    assert len(D.permuted_digits(n_tasks=2)) == 2
    with pytest.raises(ValueError, match="n_tasks must be >= 1"):
        D.permuted_digits(n_tasks=0)


def test_permuted_mnist_draws_the_same_permutations(monkeypatch):
    """permuted MNIST, on stand-in images: task t is the t-th permutation of numpy's generator
    seeded with ``seed`` (the tasks every earlier result was computed on)."""
    g = torch.Generator().manual_seed(0)
    fake = (torch.rand(12, 28, 28, generator=g), torch.arange(12) % 10,
            torch.rand(6, 28, 28, generator=g), torch.arange(6) % 10)  # fmt: skip
    monkeypatch.setattr(D, "load_mnist", lambda root, download: fake)
    seq = D.permuted_mnist(n_tasks=3, seed=4)
    rng = np.random.default_rng(4)
    perms = [np.arange(784)] + [rng.permutation(784) for _ in range(2)]
    assert (seq.name, seq.input_shape, seq.n_outputs, seq.multi_head) == (
        "permuted-mnist", (784,), 10, False)  # fmt: skip
    for task, perm in zip(seq, perms):
        assert torch.equal(task.train_x, fake[0].flatten(1)[:, perm])
        assert torch.equal(task.test_x, fake[2].flatten(1)[:, perm])
        assert torch.equal(task.train_y, fake[1])


def test_split_tasks_relabels_and_rejects_empty():
    x = torch.rand(20, 1, 4, 4)
    y = torch.arange(20) % 4
    tasks = D.split_tasks(x, y, x, y, [[0, 1], [2, 3]])
    assert [t.classes for t in tasks] == [[0, 1], [2, 3]]
    assert torch.equal(tasks[1].train_x, x[(y == 2) | (y == 3)])
    assert set(tasks[1].train_y.tolist()) == {0, 1}
    with pytest.raises(ValueError, match="no training examples of classes"):
        D.split_tasks(x, y, x, y, [[7, 8]])
    with pytest.raises(ValueError, match="class_groups"):
        D.split_tasks(x, y, x, y, [])


def test_synthetic_and_subsample():
    seq = synthetic_split(n_tasks=3, n_train=40, n_test=10)
    assert len(seq) == 3 and seq[0].train_x.shape == (40, 1, 28, 28)
    small = seq.subsample(8, 4, seed=1)
    assert [len(t.train_x) for t in small] == [8, 8, 8]
    assert [len(t.test_x) for t in small] == [4, 4, 4]


@pytest.mark.slow
def test_real_mnist_sequences(mnist_root):
    seq = D.split_mnist(mnist_root, download=False)
    assert len(seq) == 5 and seq.input_shape == (1, 28, 28)
    assert sum(len(t.train_x) for t in seq) == 60000
    assert sum(len(t.test_x) for t in seq) == 10000
    assert seq[0].train_x.max() == 1.0 and seq[0].train_x.min() == 0.0
    perm = D.permuted_mnist(mnist_root, n_tasks=3, download=False)
    assert not perm.multi_head and perm[0].train_x.shape == (60000, 784)
    # the first permuted task is unpermuted MNIST; the others are permutations of it
    x0, x1 = perm[0].train_x, perm[1].train_x
    assert not torch.equal(x0, x1)
    assert torch.equal(x0.sort(dim=1).values, x1.sort(dim=1).values)


def test_validation_split_is_disjoint_sized_and_fixed_by_its_seed():
    seq = D.split_digits()
    val = seq.with_validation(0.1, seed=0)
    for t, v in zip(seq, val):
        n = len(t.train_x)
        assert len(v.valid_x) == round(0.1 * n) and len(v.train_x) == n - len(v.valid_x)
        # the union of the two is the original training set, without repeats
        both = torch.cat([v.train_x, v.valid_x]).flatten(1)
        assert torch.equal(both.unique(dim=0), t.train_x.flatten(1).unique(dim=0))
        assert len(both.unique(dim=0)) == len(t.train_x.flatten(1).unique(dim=0))
        assert torch.equal(v.test_x, t.test_x)
    again = seq.with_validation(0.1, seed=0)
    other = seq.with_validation(0.1, seed=1)
    assert torch.equal(again[2].valid_x, val[2].valid_x)
    assert not torch.equal(other[2].valid_x, val[2].valid_x)
    # subsampling afterwards keeps the validation set whole
    small = val.subsample(50, 20)
    assert torch.equal(small[1].valid_x, val[1].valid_x) and len(small[1].train_x) == 50
    with pytest.raises(ValueError, match="fraction"):
        seq.with_validation(1.0)
    with pytest.raises(ValueError, match="already has a validation set"):
        val.with_validation(0.1)


def test_fingerprint_changes_with_any_tensor():
    seq = D.split_digits()
    fp = seq.fingerprint()
    assert [t["n_train"] for t in fp["tasks"]] == [len(t.train_x) for t in seq]
    assert seq.fingerprint() == fp
    seq[3].test_y[0] = 1 - seq[3].test_y[0]
    changed = seq.fingerprint()
    assert changed["hash"] != fp["hash"]
    assert [a["hash"] == b["hash"] for a, b in zip(fp["tasks"], changed["tasks"])] == [
        True,
        True,
        True,
        False,
        True,
    ]
