"""``fromp-bench sweep`` on a local Ray instance: the same results as the plain runner, one
Tune report per experience, and a trial that crashes resumes from its last experience."""

from __future__ import annotations

import csv
import json

import pytest
from fromp_bench.__main__ import main
from fromp_bench.runner import RunConfig, run

ray = pytest.importorskip("ray", reason="Ray Tune is an optional extra: pip install 'fromp[ray]'")


@pytest.fixture(scope="module")
def local_ray():
    """One local Ray instance for the module's sweeps (a sweep uses a Ray already initialised
    and leaves it running), so each test pays for its trials, not for starting Ray. One CPU:
    a sweep's trials run one after another in one reused actor (``reuse_actors``), so a sweep
    starts one worker process importing torch and Avalanche, not one per concurrent trial."""
    ray.init(num_cpus=1, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


@pytest.mark.slow
def test_local_sweep_matches_the_runner_resumes_a_crashed_trial_and_runs_only_added_trials(
    tmp_path, monkeypatch, local_ray
):
    """Two seeds of Naive as Tune trials, one crashing once after task 2 and retried: the
    same results as the plain runner, one Tune report per experience, the plain runner's
    report. Then resumed with an added seed and an added strategy: exactly those trials run
    (in a further Tune experiment), the finished trials' results are kept and all of them
    reported; nothing is left in the temporary directory."""
    import shutil
    import tempfile
    from pathlib import Path

    from fromp_bench.sweep import sweep

    # a temporary root of this test's own (pytest-xdist runs other sweeps beside it)
    own_tmp = Path(tempfile.mkdtemp(prefix="fs-"))
    monkeypatch.setattr(tempfile, "tempdir", str(own_tmp))
    marker = tmp_path / "crashed"
    out = tmp_path / "out"
    kw = dict(train_size=60, test_size=30, valid_fraction=0.2, overrides={"train_epochs": 1})
    payload = sweep(
        "split-digits",
        ["naive"],
        seeds=[0, 1],
        out=out,
        num_cpus=2,
        max_failures=1,
        test_hooks={"crash_once_after": 2, "crash_marker": str(marker)},
        **kw,
    )
    assert marker.exists()  # one trial crashed after task 2 and was retried
    assert ray.is_initialized()  # the caller's Ray is left running
    assert not payload["failed"] and len(payload["runs"]) == 2
    for res in payload["runs"]:
        plain = run(
            RunConfig(
                "split-digits", "naive", res["seed"], overrides={"train_epochs": 1},
                train_size=60, test_size=30, valid_fraction=0.2,
            )
        )  # fmt: skip
        assert res["accuracy_matrix"] == plain["accuracy_matrix"]
        assert res["valid_accuracy_matrix"] == plain["valid_accuracy_matrix"]
    base = out / "split-digits"
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

    # resumed with an added seed (2) and an added strategy (joint): naive 1 is kept
    (naive1_file,) = (base / "runs").glob("naive-*seed1.json")
    before = naive1_file.read_text()
    again = sweep("split-digits", ["naive", "joint"], seeds=[1, 2], out=out, resume=True,
                  num_cpus=2, **kw)  # fmt: skip
    got = sorted((r["strategy"], r["seed"]) for r in again["runs"])
    # naive 0 (not asked for) is reported from its record, as the plain runner does
    assert got == [("joint", 1), ("joint", 2), ("naive", 0), ("naive", 1), ("naive", 2)], got
    assert not again["failed"]
    naive1 = next(r for r in again["runs"] if (r["strategy"], r["seed"]) == ("naive", 1))
    first_naive1 = next(r for r in payload["runs"] if r["seed"] == 1)
    assert naive1["accuracy_matrix"] == first_naive1["accuracy_matrix"]
    assert naive1_file.read_text() == before
    ran = {p.name: len(list(p.glob("*/progress.csv"))) for p in (base / "ray").iterdir()}
    assert ran == {"sweep": 2, "sweep-1": 3}, ran  # the finished trial was not run again
    # nothing left behind in the temporary directory
    leftover = list(own_tmp.glob("fromp-sweep-*"))
    shutil.rmtree(own_tmp, ignore_errors=True)
    assert not leftover


def test_sweep_validates_before_starting_ray(tmp_path, capsys, monkeypatch):
    def no_ray(*args, **kwargs):
        raise AssertionError("Ray started before the settings were checked")

    monkeypatch.setattr(ray, "init", no_ray)
    argv = ["sweep", "split-digits", "--strategies", "fromp", "--set", "tau=abc"]
    assert main([*argv, "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip()
    assert "tau must be a number or 'auto'" in err and "\n" not in err
    assert main(["sweep", "split-digits", "--gpus-per-trial", "-1", "--out", str(tmp_path)]) == 2
    assert "--gpus-per-trial must be a number >= 0" in capsys.readouterr().err


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
    psutil.wait_procs(children, timeout=2)  # at most the 2 s it waited before, no longer
    alive = [c for c in children if c.is_running() and c.status() != psutil.STATUS_ZOMBIE]
    assert not alive, [c.cmdline()[:3] for c in alive]
    assert not leftover
    assert (tmp_path / "out" / "split-digits" / "ray" / "sweep").is_dir()


class _Payload:
    """Pickles as a call of ``exec`` that writes ``marker`` (what a crafted file would do)."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (exec, (f"open({str(self.marker)!r}, 'w').write('ran')",))


def _plant(base, marker) -> list:
    """Crafted pickles wherever Tune keeps state under the sweep's folder (``tuner.pkl``, a
    ``CLOUDPICKLE_FALLBACK`` blob in ``experiment_state-*.json``, a trial's ``params.pkl``
    and checkpoint), in the folder the next invocation would have used too."""
    import io
    import pickle

    import torch

    blob = pickle.dumps(_Payload(marker))
    files = []
    for exp in ("sweep", "sweep-1"):
        d = base / "ray" / exp
        (d / "trial_0" / "checkpoint_000000").mkdir(parents=True)
        state = {"trial_data": [[{"_type": "CLOUDPICKLE_FALLBACK", "value": blob.hex()}]]}
        trial = d / "trial_0"
        files += [d / "tuner.pkl", d / "experiment_state-2026-11-28_00-00-00.json",
                  trial / "params.pkl", trial / "checkpoint_000000" / "run.pt"]  # fmt: skip
        files[-4].write_bytes(blob)
        files[-3].write_text(json.dumps(state))
        files[-2].write_bytes(blob)
        buf = io.BytesIO()
        torch.save({"model": _Payload(marker)}, buf)
        files[-1].write_bytes(buf.getvalue())
    (base / "ray" / "tuner.pkl").write_bytes(blob)
    return files


@pytest.mark.slow
def test_resume_never_loads_tunes_state_and_refuses_crafted_records(tmp_path, capsys, local_ray):
    """Before: ``sweep --resume`` restored Ray Tune's state from ``--out`` (``tuner.pkl``,
    ``experiment_state-*.json``), which unpickled a crafted file and ran its code. Now the
    sweep reads only its own records: a crafted checkpoint or run record is refused in one
    line before Ray starts, and Tune's files, crafted, are never read (the sweep resumes and
    finishes beside them); no marker file appears."""
    import hashlib
    import io
    import pickle

    import torch
    from fromp_bench.command import plan, run_name

    out, marker = tmp_path / "out", tmp_path / "marker"
    base = out / "split-digits"
    argv = ["sweep", "split-digits", "--strategies", "naive", "--epochs", "1", "--n-train",
            "40", "--n-test", "20", "--num-cpus", "1", "--no-progress", "--out", str(out),
            "--resume"]  # fmt: skip
    protocol = {"n_train": 40, "n_test": 20, "valid_fraction": None, "valid_seed": 0}
    ((_, _, tag),) = plan("split-digits", ["naive"], {"train_epochs": 1}, [{}], "cpu", protocol)
    label = run_name("naive", tag, 0)
    planted = _plant(base, marker)
    # a crafted checkpoint (checksum matching) of the trial: refused before Ray starts
    ckpt = base / "checkpoints" / f"{label}.pt"
    ckpt.parent.mkdir(parents=True)
    for kind in ("zip", "legacy", "pickle"):
        buf = io.BytesIO()
        if kind == "pickle":
            pickle.dump({"model": _Payload(marker)}, buf)
        else:
            torch.save(
                {"model": _Payload(marker)}, buf, _use_new_zipfile_serialization=kind == "zip"
            )
        ckpt.write_bytes(buf.getvalue())
        (ckpt.parent / f"{label}.pt.sha256").write_text(hashlib.sha256(buf.getvalue()).hexdigest())
        capsys.readouterr()
        assert main(argv) == 2
        err = capsys.readouterr().err.strip()
        assert str(ckpt) in err and "needs code to load" in err and "\n" not in err, err
        assert not marker.exists()
    ckpt.unlink()
    # a run record that is a pickle, not JSON: refused naming it
    record = base / "runs" / f"{label}.json"
    record.parent.mkdir(parents=True, exist_ok=True)
    record.write_bytes(pickle.dumps(_Payload(marker)))
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert str(record) in err and "not a run result" in err and "\n" not in err, err
    record.unlink()
    # with only Tune's crafted files left, the sweep runs to its end beside them
    assert main(argv) == 0
    assert not marker.exists()
    assert all(f.read_bytes() for f in planted)  # untouched, and never loaded
    assert json.loads(record.read_text())["complete"]
    assert (base / "ray" / "sweep-2").is_dir()  # a new folder for this invocation's Tune files
    # resumed again: the finished trial is reported from its record, Ray is not started
    before = record.read_text()
    assert main(argv) == 0 and record.read_text() == before
    assert not (base / "ray" / "sweep-3").exists() and not marker.exists()
