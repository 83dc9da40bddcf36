"""``fromp-bench sweep`` on a local Ray instance: the same results as the plain runner, one
Tune report per experience, and a trial that crashes resumes from its last experience."""

from __future__ import annotations

import csv
import json

import pytest
from fromp_bench.__main__ import main
from fromp_bench.runner import RunConfig, run

ray = pytest.importorskip("ray", reason="Ray Tune is an optional extra: pip install 'fromp[ray]'")


@pytest.mark.slow
def test_local_sweep_matches_the_runner_and_resumes_a_crashed_trial(tmp_path, monkeypatch):
    from fromp_bench.sweep import sweep

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
    names = sorted(p.name for p in (base / "runs").glob("*.json"))
    assert [n.rsplit("-", 1)[1] for n in names] == ["seed0.json", "seed1.json"]
    assert len({n.rsplit("-", 1)[0] for n in names}) == 1  # one settings label
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
    assert "--gpus-per-trial must be a number >= 0" in capsys.readouterr().err


@pytest.mark.slow
def test_resume_runs_only_the_added_trials_and_keeps_the_finished_ones(tmp_path, monkeypatch):
    """A sweep resumed with an added seed and an added strategy runs exactly those trials (in
    a further Tune experiment), keeps the finished trial's result, and reports all of them."""
    import shutil
    import tempfile
    from pathlib import Path

    from fromp_bench.sweep import sweep

    # a temporary root of this test's own (pytest-xdist runs other sweeps beside it)
    own_tmp = Path(tempfile.mkdtemp(prefix="fs-"))
    monkeypatch.setattr(tempfile, "tempdir", str(own_tmp))

    kw = dict(n_train=40, n_test=20, overrides={"train_epochs": 1}, num_cpus=2)
    out = tmp_path / "out"
    first = sweep("split-digits", ["naive"], seeds=[0], out=out, **kw)
    base = out / "split-digits"
    (naive0_file,) = (base / "runs").glob("naive-*seed0.json")
    before = naive0_file.read_text()
    again = sweep("split-digits", ["naive", "joint"], seeds=[0, 1], out=out, resume=True, **kw)
    got = sorted((r["strategy"], r["seed"]) for r in again["runs"])
    assert got == [("joint", 0), ("joint", 1), ("naive", 0), ("naive", 1)]
    assert not again["failed"]
    naive0 = next(r for r in again["runs"] if (r["strategy"], r["seed"]) == ("naive", 0))
    assert naive0["accuracy_matrix"] == first["runs"][0]["accuracy_matrix"]
    assert naive0_file.read_text() == before
    ran = {p.name: len(list(p.glob("*/progress.csv"))) for p in (base / "ray").iterdir()}
    assert ran == {"sweep": 1, "sweep-1": 3}, ran  # the finished trial was not run again
    # nothing left behind in the temporary directory
    leftover = list(own_tmp.glob("fromp-sweep-*"))
    shutil.rmtree(own_tmp, ignore_errors=True)
    assert not leftover


@pytest.mark.slow
def test_sigterm_shuts_ray_down_and_removes_the_trials_temporary_files(tmp_path):
    """``kill`` (SIGTERM) of a running sweep: exit 130 with the --resume hint, no Ray process
    of the sweep left, its trial directories removed, the Tune state kept for --resume."""
    import os
    import shutil
    import signal
    import subprocess
    import sys
    import tempfile
    import time
    from pathlib import Path

    psutil = pytest.importorskip("psutil")
    # a short TMPDIR of the sweep's own: Ray puts its sockets there (a 107-character limit)
    tmp_root = Path(tempfile.mkdtemp(prefix="fs-"))
    env = {**os.environ, "TMPDIR": str(tmp_root), "OMP_NUM_THREADS": "1"}
    cmd = [
        sys.executable, "-m", "fromp_bench", "sweep", "split-digits", "--strategies", "naive",
        "--seeds", "1", "--n-train", "200", "--n-test", "20", "--epochs", "5000",
        "--num-cpus", "1", "--out", str(tmp_path / "out"),
    ]  # fmt: skip
    proc = subprocess.Popen(cmd, env=env, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.time() + 300  # Ray starts slowly on a loaded machine (pytest-xdist)
        while time.time() < deadline and not list(tmp_root.glob("fromp-sweep-*/fromp-trial-*")):
            time.sleep(0.5)
        assert list(tmp_root.glob("fromp-sweep-*/fromp-trial-*")), "no trial started"
        children = psutil.Process(proc.pid).children(recursive=True)
        assert children
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
        leftover = list(tmp_root.glob("fromp-sweep-*"))
        shutil.rmtree(tmp_root, ignore_errors=True)
    assert proc.returncode == 130, err
    assert "--resume" in err
    time.sleep(2)
    alive = [c for c in children if c.is_running() and c.status() != psutil.STATUS_ZOMBIE]
    assert not alive, [c.cmdline()[:3] for c in alive]
    assert not leftover
    assert (tmp_path / "out" / "split-digits" / "ray" / "sweep").is_dir()
