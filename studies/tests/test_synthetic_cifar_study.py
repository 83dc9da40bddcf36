"""``studies.synthetic_cifar``: files torchvision reads as CIFAR-10 / CIFAR-100 at a scale of
their sizes (every class equally often), read by the runner's loader; written once per
scale; a folder holding other CIFAR files is refused; the runner's arguments are checked."""

from __future__ import annotations

import pytest
import torchvision.datasets as tvd
from fromp_bench.data import split_cifar

from studies import synthetic_cifar


@pytest.fixture
def accepted(monkeypatch):
    """The study's checksum override, undone after the test."""
    monkeypatch.setattr(tvd.CIFAR10, "_check_integrity", tvd.CIFAR10._check_integrity)
    monkeypatch.setattr(tvd.cifar, "check_integrity", tvd.cifar.check_integrity)
    synthetic_cifar.accept_synthetic_files()


def test_the_files_are_split_cifar_at_the_scale(tmp_path, accepted):
    synthetic_cifar.write(tmp_path, 0.004)
    seq = split_cifar(tmp_path, download=False)
    assert len(seq) == 6 and seq.input_shape == (3, 32, 32)
    assert len(seq[0].train_x) == 200 and len(seq[0].test_x) == 40  # 0.4 % of 50,000 / 10,000
    assert sorted(set(seq[0].train_y.tolist())) == list(range(10))
    assert len(seq[1].train_x) == 20 and sorted(set(seq[1].train_y.tolist())) == list(range(10))
    before = (tmp_path / "cifar-100-python" / "train").stat().st_mtime_ns
    synthetic_cifar.write(tmp_path, 0.004)  # there already: not written again
    assert (tmp_path / "cifar-100-python" / "train").stat().st_mtime_ns == before


def test_real_files_and_missing_arguments_are_refused(tmp_path):
    (tmp_path / "cifar-10-batches-py").mkdir()
    with pytest.raises(SystemExit, match="is not synthetic"):
        synthetic_cifar.write(tmp_path, 0.01)
    with pytest.raises(SystemExit, match="must give --data-root"):
        synthetic_cifar.main(["--scale", "0.01", "--", "split-cifar"])
    with pytest.raises(SystemExit, match="--scale must be in"):
        synthetic_cifar.main(["--scale", "2", "--", "split-cifar", "--data-root", "x"])
