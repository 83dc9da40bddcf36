"""Smoke tests of the DNN2GP examples with tiny settings (figures and summaries written)."""

from __future__ import annotations

import importlib.util
import json
import math
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def _load(name: str):
    spec = importlib.util.spec_from_file_location(name, EXAMPLES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_dnn2gp_regression_example(tmp_path):
    ex = _load("dnn2gp_regression")
    res = ex.main(["--out", str(tmp_path), "--n", "40", "--epochs", "60", "--hidden", "8"])
    for fig in ("dnn2gp_regression.png", "dnn2gp_evidence.png"):
        assert (tmp_path / fig).stat().st_size > 10_000
    saved = json.loads((tmp_path / "dnn2gp_regression.json").read_text())
    assert saved["n"] == 40
    assert math.isfinite(res["log_evidence_full"]) and res["delta_grid_full"] > 0
    assert res["log_evidence_diag"] <= res["log_evidence_full"] + 1e-6  # Hadamard


def _check_mnist_outputs(tmp_path, res):
    for fig in ("dnn2gp_mnist_kernel.png", "dnn2gp_mnist_variance.png"):
        assert (tmp_path / fig).stat().st_size > 10_000
    assert json.loads((tmp_path / "dnn2gp_mnist_kernel.json").read_text())["n_train"] > 0
    assert all(v > 0 for v in res["median_variance"].values())
    assert -1 <= res["kernel_corr_different_class"] <= 1


def test_dnn2gp_mnist_kernel_example_without_mnist(tmp_path):
    ex = _load("dnn2gp_mnist_kernel")
    empty = tmp_path / "no-data"
    empty.mkdir()
    args = ["--data-root", str(empty), "--out", str(tmp_path), "--n-train", "200"]
    res = ex.main([*args, "--epochs", "1", "--n-kernel", "20", "--n-var", "30", "--hidden", "16"])
    assert res["data"].startswith("sklearn digits")
    assert "rotated digits (90°)" in res["median_variance"]
    _check_mnist_outputs(tmp_path, res)


@pytest.mark.slow
def test_dnn2gp_mnist_kernel_example_real_mnist(tmp_path, mnist_root):
    ex = _load("dnn2gp_mnist_kernel")
    args = ["--data-root", str(mnist_root), "--out", str(tmp_path), "--n-train", "300"]
    res = ex.main([*args, "--epochs", "1", "--n-kernel", "20", "--n-var", "30", "--hidden", "16"])
    assert res["data"] == "MNIST"
    _check_mnist_outputs(tmp_path, res)
