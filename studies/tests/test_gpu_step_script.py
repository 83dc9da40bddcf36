"""``studies/gpu_step.sh``, the GPU measurement in one command, on the CPU at tiny sizes: it
runs the GPU check (quick mode, one case) and then the step profile, each writing its record
and its log under OUT, and exits 0 when both did."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_the_script_runs_the_check_then_the_profile(tmp_path):
    env = {**os.environ, "DEVICE": "cpu", "QUICK": "1", "CASES": "split-digits/naive",
           "PYTHON": sys.executable, "PROFILE_ARGS": "--benchmark split-digits --n-train "
           "192 --skip 2 --steps 2 --trace-steps 2 --strategies naive,fromp"}  # fmt: skip
    res = subprocess.run(["bash", "studies/gpu_step.sh", str(tmp_path), "120"], cwd=ROOT,
                         env=env, capture_output=True, text=True, timeout=600)  # fmt: skip
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]
    (check,) = tmp_path.glob("*-cpu-quick.json")
    assert json.loads(check.read_text())["cases"]["split-digits/naive"]["status"] == "ok"
    (profile,) = tmp_path.glob("*-cpu-step-profile.json")
    record = json.loads(profile.read_text())
    assert set(record["runner"]) == {"naive", "fromp"} and record["torch_profiler"]["fromp"]
    assert profile.with_suffix(".md").exists()
    assert (tmp_path / "gpu_check.log").stat().st_size > 0
    assert "step profile exit 0" in res.stdout
