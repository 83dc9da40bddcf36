"""Smoke tests of the FROMP examples with tiny settings."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _load(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / "examples" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_fromp_toy_smoke(tmp_path):
    toy = _load("fromp_toy")
    tasks = toy.toy_tasks(10, seed=1)
    assert len(tasks) == 5 and tasks[0][0].shape == (20, 2)
    out = tmp_path / "toy.png"
    summary = toy.main(["--n-per-blob", "10", "--epochs", "2", "--grid", "12", "--out", str(out)])
    assert out.stat().st_size > 10_000
    for name in ("Naive", "FROMP"):
        assert len(summary[name]["final_accuracies"]) == 5


def test_memorable_digits_smoke(tmp_path):
    mem = _load("memorable_mnist")
    out = tmp_path / "mem.png"
    s = mem.main(
        ["--dataset", "digits", "--n-train", "400", "--epochs", "3", "--k", "2", "--out", str(out)]
    )
    assert out.stat().st_size > 5_000
    assert s["mean_score_most"] > s["mean_score_least"]


def test_memorable_mnist_smoke(tmp_path, mnist_root):
    mem = _load("memorable_mnist")
    out = tmp_path / "mem.png"
    argv = ["--data-root", str(mnist_root), "--n-train", "500", "--epochs", "1", "--k", "2"]
    s = mem.main([*argv, "--out", str(out)])
    assert out.exists() and s["n_train"] == 500


@pytest.mark.parametrize("bad", ["cifar"])
def test_memorable_bad_dataset(bad):
    mem = _load("memorable_mnist")
    with pytest.raises(ValueError, match="dataset must be"):
        mem.load(bad, None, 10, 0)


def test_fromp_plain_loop_smoke():
    pytest.importorskip("sklearn")
    loop = _load("fromp_plain_loop")
    summary = loop.main(["--epochs", "2", "--n-points", "6"])
    assert summary["task_count"] == 5 and len(summary["final_accuracies"]) == 5
    assert summary["mean_accuracy"] > 0.8
