"""Smoke test of the scale benchmark (python -m benchmarks.scale) on tiny settings."""

from __future__ import annotations

import argparse
import importlib.util

import pytest

from benchmarks.scale import _plan, run_case


def test_plan_and_one_case_run():
    args = argparse.Namespace(device="cpu", threads=1, skip_laplace_torch=False)
    specs = _plan(["mlp"], args)
    cases = [s["case"] for s in specs]
    assert cases.count("laplace") == 2 and cases.count("laplace_torch") == 2
    assert "kernel" in cases and "predictive" in cases and cases[0] == "check"
    base = {"model": "mlp", "device": "cpu", "threads": 1, "lt_batch": 4, "gp_chunk": 4}
    out = run_case({**base, "case": "laplace", "n": 6})
    assert out["precision_sum"] > 0 and out["peak_rss_mb"] >= out["base_rss_mb"] > 0
    out = run_case({**base, "case": "kernel", "n": 5})
    assert out["shape"] == [2, 5, 5]


@pytest.mark.skipif(importlib.util.find_spec("laplace") is None, reason="laplace-torch absent")
def test_fromp_matches_laplace_torch_diag_ggn():
    base = {"model": "mlp", "device": "cpu", "threads": 1, "lt_batch": 4, "gp_chunk": 4}
    out = run_case({**base, "case": "check", "n": 6})
    assert out["max_abs_diff_over_max"] < 1e-5
