"""The subnetwork-Laplace speed study on a tiny run: both methods' times and their ratio
come from the same run, the precisions agree, and bad sizes are refused before any work."""

from __future__ import annotations

import json

import pytest

from studies import subnet_speed


def test_subnet_speed_records_both_methods_and_their_ratio(tmp_path):
    out = tmp_path / "rec.json"
    rec = subnet_speed.main(["--n", "2", "--subnet", "30", "--repeats", "1", "--out", str(out)])
    saved = json.loads(out.read_text())
    assert saved["methods"].keys() == {"reverse", "capture"}
    m = saved["methods"]
    assert saved["reverse_over_capture"] == pytest.approx(
        m["reverse"]["seconds"] / m["capture"]["seconds"]
    )
    assert saved["max_relative_difference"] < 1e-3
    assert saved["subnet"] == 30 and saved["n"] == 2 and saved["params"] > 11_000_000
    assert rec["command"].startswith("python -m studies.subnet_speed")


@pytest.mark.parametrize("flag", ["--n", "--subnet", "--repeats"])
def test_subnet_speed_refuses_a_size_below_one(tmp_path, flag):
    with pytest.raises(SystemExit):
        subnet_speed.main([flag, "0", "--out", str(tmp_path / "x.json")])
    assert not (tmp_path / "x.json").exists()
