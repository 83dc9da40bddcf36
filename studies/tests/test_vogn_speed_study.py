"""studies/vogn_speed.py: its ratios come from its own timings."""

from __future__ import annotations

import json

import pytest


def test_speed_benchmark_ratios_come_from_its_own_timings(tmp_path):
    from studies import vogn_speed

    out = tmp_path / "speed.json"
    vogn_speed.main(["--ivon", "--steps", "3", "--models", "mlp", "--out", str(out)])
    r = json.loads(out.read_text())["models"]["mlp"]
    assert r["num_params"] == 269_322  # the FROMP split-MNIST MLP, every head
    for key in ("adam", "vogn", "ivon", "ivon_antithetic", "normal"):
        assert 0 < r[key + "_min"] <= r[key]
    assert r["ratio_ivon_adam_mean"] == pytest.approx(r["ivon_mean"] / r["adam_mean"])
    assert r["ratio_ivon_antithetic_adam_mean"] == pytest.approx(
        r["ivon_antithetic_mean"] / r["adam_mean"]
    )
    assert r["ratio_normal_floor"] == pytest.approx(
        (r["adam_mean"] + r["normal_mean"]) / r["adam_mean"]
    )
    assert r["ratio_normal_floor_antithetic"] == pytest.approx(
        (r["adam_mean"] + r["normal_mean"] / 2) / r["adam_mean"]
    )
