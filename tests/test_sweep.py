"""``fromp-bench sweep`` on a local Ray instance: the same results as the plain runner, one
Tune report per experience, and a trial that crashes resumes from its last experience."""

from __future__ import annotations

import csv
import json

import pytest

from benchmarks.__main__ import main
from benchmarks.runner import RunConfig, run

ray = pytest.importorskip("ray", reason="Ray Tune is an optional extra: pip install 'fromp[ray]'")


@pytest.mark.slow
def test_local_sweep_matches_the_runner_and_resumes_a_crashed_trial(tmp_path, monkeypatch):
    from benchmarks.sweep import sweep

    marker = tmp_path / "crashed"
    kw = dict(n_train=60, n_test=30, valid_fraction=0.2)
    payload = sweep(
        "split-digits",
        ["naive"],
        seeds=[0, 1],
        out=tmp_path / "out",
        overrides={"train_epochs": 1},
        num_cpus=2,
        max_failures=1,
        test_hooks={"crash_once_after": 2, "crash_marker": str(marker)},
        **kw,
    )
    assert marker.exists()  # one trial crashed after task 2 and was retried
    assert not payload["failed"] and len(payload["runs"]) == 2
    for res in payload["runs"]:
        plain = run(
            RunConfig("split-digits", "naive", res["seed"], overrides={"train_epochs": 1}, **kw)
        )
        assert res["accuracy_matrix"] == plain["accuracy_matrix"]
        assert res["valid_accuracy_matrix"] == plain["valid_accuracy_matrix"]
    base = tmp_path / "out" / "split-digits"
    assert json.loads((base / "results.json").read_text())["aggregate"]["naive"]["seeds"] == [0, 1]
    assert (base / "report.md").exists() and (base / "accuracy.png").exists()
    assert sorted(p.name for p in (base / "runs").glob("*.json")) == [
        "naive-seed0.json",
        "naive-seed1.json",
    ]
    # per-experience reports: tasks 1..5 (the crashed trial resumes at task 3), then the result
    reported = []
    for progress in (base / "ray" / "sweep").glob("*/progress.csv"):
        with progress.open() as f:
            reported.append([int(float(r["tasks_done"])) for r in csv.DictReader(f)])
    assert reported and all(r[-1] == 5 and set(r) >= {3, 4, 5} for r in reported)
    assert any(r[:5] == [1, 2, 3, 4, 5] for r in reported)


def test_sweep_validates_before_starting_ray(tmp_path, capsys, monkeypatch):
    def no_ray(*args, **kwargs):
        raise AssertionError("Ray started before the settings were checked")

    monkeypatch.setattr(ray, "init", no_ray)
    argv = ["sweep", "split-digits", "--strategies", "fromp", "--set", "tau=abc"]
    assert main([*argv, "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip()
    assert "--set tau='abc'" in err and "\n" not in err
    assert main(["sweep", "split-digits", "--gpus-per-trial", "-1", "--out", str(tmp_path)]) == 2
    assert "--gpus-per-trial must be >= 0" in capsys.readouterr().err
