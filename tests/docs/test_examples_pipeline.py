"""The Avalanche pipeline example on a small synthetic stream: every method trains, and a
run interrupted after two experiences resumes from its checkpoint to the same accuracies."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch
from avalanche.benchmarks.scenarios.deprecated.generators import nc_benchmark
from avalanche.benchmarks.utils import _make_taskaware_tensor_classification_dataset

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "avalanche_pipeline.py"


def _load():
    spec = importlib.util.spec_from_file_location("avalanche_pipeline", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _benchmark(n_exp: int = 3, order: list[int] | None = None):
    """Labels counted from zero in each experience, as the example's SplitMNIST, in a
    shuffled class order: each experience adds a MTSimpleMLP head."""

    def ds(n: int, seed: int):
        g = torch.Generator().manual_seed(seed)
        y = torch.arange(n) % (2 * n_exp)
        x = 0.3 * torch.randn(n, 1, 28, 28, generator=g)
        x.view(n, -1)[torch.arange(n), y * 10] += 3.0
        return _make_taskaware_tensor_classification_dataset(x, y, targets=y.tolist())

    return nc_benchmark(
        ds(120, 0),
        ds(60, 1),
        n_exp,
        True,
        shuffle=False,
        fixed_class_order=order or list(range(2 * n_exp)),
        class_ids_from_zero_in_each_exp=True,
    )


def test_example_is_short():
    assert len(EXAMPLE.read_text().splitlines()) < 100


@pytest.mark.parametrize("method", ["fromp", "ewc", "vcl"])
@pytest.mark.slow
def test_example_trains_and_resumes(method, tmp_path):
    ex = _load()
    bm = _benchmark(order=[5, 2, 0, 4, 3, 1])
    full = ex.run(method, bm, tmp_path / "full", lr=1e-2)
    assert len(full) == 3 and all(0.0 <= v <= 1.0 for v in full.values())
    # interrupted after one and after two experiences (heads grown since), then restarted
    for stop in (1, 2):
        part = tmp_path / f"part{stop}"
        ex.run(method, bm, part, lr=1e-2, stop_after=stop)
        resumed = ex.run(method, bm, part, lr=1e-2)
        assert resumed == full
