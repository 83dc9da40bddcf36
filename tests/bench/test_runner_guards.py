"""The runner and the command-line tools lose no run and refuse bad input before any work:
runs of other settings kept apart (files, results.json, the report), non-run JSON in
``runs/``, unwritable outputs found before training or analysis, bad ``--model`` factories and
shapes, Ray arguments Ray would hang on, SIGTERM and the lock taken before the data checks.
Each case failed on 0.3.0 (commit 3cf50fd): see the docstrings."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from fromp_bench import command as bench_main
from fromp_bench.__main__ import main
from fromp_bench.cli import gp_main, memorable_main
from fromp_bench.command import settings_id
from fromp_bench.report import aggregate

QUICK = ["--n-test", "20", "--no-progress"]


def _one_line(capsys, *needles: str) -> str:
    err = capsys.readouterr().err.strip()
    for needle in needles:
        assert needle in err, err
    assert "\n" not in err and "Traceback" not in err, err
    return err


# ----------------------------------------------------------------------- lost runs (L1)
def test_settings_id_tells_settings_apart_and_keeps_defaults_plain():
    assert settings_id("split-digits", "naive", {}) == ""
    lr = settings_id("split-digits", "naive", {"lr": 0.5})
    assert lr.startswith("s") and len(lr) == 9
    assert settings_id("split-digits", "naive", {"lr": 0.5}) == lr  # stable
    assert settings_id("split-digits", "naive", {"lr": 0.25}) != lr
    tau10 = settings_id("split-digits", "fromp", {"kwargs": {"tau": 10.0}})
    assert tau10 != settings_id("split-digits", "fromp", {"kwargs": {"tau": 30.0}})
    epochs = settings_id("split-digits", "naive", {"train_epochs": 2})
    assert epochs != settings_id("split-digits", "naive", {"train_epochs": 2}, {"n_train": 48})
    assert settings_id("split-digits", "naive", {}, {"n_train": 40}) != ""


def test_a_run_with_other_settings_never_replaces_an_earlier_one(tmp_path, capsys):
    """Before: ``--epochs 1`` then ``--epochs 2 --n-train 48`` into one --out overwrote the
    first run's JSON and checkpoint (the label held only strategy, grid tag and seed)."""
    out = ["--out", str(tmp_path)]
    first = ["split-digits", "--strategies", "naive", "--epochs", "1", "--n-train", "40"]
    second = ["split-digits", "--strategies", "naive", "--epochs", "2", "--n-train", "48"]
    base = tmp_path / "split-digits"
    assert main([*first, *QUICK, *out]) == 0
    (ck1,) = (base / "checkpoints").glob("*.pt")
    (run1,) = (base / "runs").glob("*.json")
    kept = ck1.read_bytes(), run1.read_text()
    assert main([*second, *QUICK, *out]) == 0
    assert (ck1.read_bytes(), run1.read_text()) == kept
    assert len(list((base / "checkpoints").glob("*.pt"))) == 2
    assert len(list((base / "runs").glob("*.json"))) == 2
    payload = json.loads((base / "results.json").read_text())
    epochs = sorted(r["settings"]["train_epochs"] for r in payload["runs"])
    assert epochs == [1, 2]
    rows = payload["aggregate"]
    assert len(rows) == 2 and all(r["seeds"] == [0] for r in rows.values())
    assert all("train_epochs=" in label and "n_train=" in label for label in rows), rows
    report = (base / "report.md").read_text()
    assert all(label in report for label in rows)
    # the same (strategy, settings, seed) again replaces itself
    assert main([*first, *QUICK, *out]) == 0
    assert len(list((base / "runs").glob("*.json"))) == 2
    assert len(json.loads((base / "results.json").read_text())["runs"]) == 2
    # --report-only keeps them apart in the same way
    capsys.readouterr()
    assert main(["split-digits", "--report-only", *out]) == 0
    again = json.loads((base / "results.json").read_text())["aggregate"]
    assert sorted(again) == sorted(rows)


def test_the_aggregate_never_counts_one_seed_twice():
    """``--grid tau=10`` and ``--set tau=10`` name their files differently but are one
    (strategy, settings, seed): the aggregate keeps the later, one seed, no std of 0 over a
    run and itself."""
    run = {"strategy": "naive", "seed": 0, "complete": True, "failed": None, "settings": {}}
    run.update(mean_accuracy=80.0, accuracy_matrix=[[80.0]], final_accuracies=[80.0])
    later = {**run, "mean_accuracy": 90.0, "accuracy_matrix": [[90.0]], "final_accuracies": [90.0]}
    row = aggregate([run, later])["naive"]
    assert row["seeds"] == [0] and row["mean_accuracy"]["mean"] == 90.0


# ----------------------------------------------------------------------- S18
@pytest.mark.parametrize("content", ['{"a": 1}', "[1, 2]", '{"strategy": "naive"}'])
def test_report_only_refuses_json_that_is_not_a_run(content, tmp_path, capsys):
    """Before: ``{"a": 1}`` entered results.json as a run with strategy null, exit 0."""
    runs = tmp_path / "split-digits" / "runs"
    runs.mkdir(parents=True)
    (runs / "x.json").write_text(content)
    assert main(["split-digits", "--report-only", "--out", str(tmp_path)]) == 2
    _one_line(capsys, str(runs / "x.json"), "not a run result")
    assert not (tmp_path / "split-digits" / "results.json").exists()


# ----------------------------------------------------------------------- C3
def _no_training(monkeypatch):
    def trained(*args, **kwargs):
        raise AssertionError("training started before the outputs were checked")

    monkeypatch.setattr(bench_main, "run", trained)


def test_an_unwritable_report_is_found_before_training(tmp_path, capsys, monkeypatch):
    """Before: training completed, then writing report.md raised a raw traceback."""
    _no_training(monkeypatch)
    (tmp_path / "split-digits" / "report.md").mkdir(parents=True)
    argv = ["split-digits", "--strategies", "naive", "--epochs", "1", *QUICK]
    assert main([*argv, "--out", str(tmp_path)]) == 2
    _one_line(capsys, str(tmp_path / "split-digits" / "report.md"), "is a directory")
    real = os.access
    denied = tmp_path / "other" / "split-digits"
    monkeypatch.setattr(os, "access", lambda p, m: Path(p) != denied and real(p, m))
    assert main([*argv, "--out", str(tmp_path / "other")]) == 2
    _one_line(capsys, str(denied), "cannot write there")


@pytest.mark.parametrize("tool", ["memorable", "gp"])
@pytest.mark.parametrize("where", ["file", "under-file"])
def test_cli_out_that_cannot_be_written_is_refused_before_loading(
    tool, where, tmp_path, capsys, monkeypatch
):
    """Before: ``fromp-memorable --map`` and ``fromp-gp`` computed everything, then died on a
    raw PermissionError / NotADirectoryError."""
    import fromp_bench.cli as cli

    def loaded(*args, **kwargs):
        raise AssertionError("the network was loaded before --out was checked")

    monkeypatch.setattr(cli, "_load", loaded)
    f = tmp_path / "f"
    f.write_text("x")
    out = f if where == "file" else f / "sub"
    run = memorable_main if tool == "memorable" else gp_main
    extra = ["--map"] if tool == "memorable" else []
    assert run(["ck.pt", *extra, "--out", str(out)]) == 2
    _one_line(capsys, f"--out {out}")


# ----------------------------------------------------------------------- M9, S16
USER = textwrap.dedent(
    """
    import torch
    from torch import nn
    width = 2
    not_callable = 3
    def needs_arg(n):
        return nn.Linear(64, n)
    def wide():
        torch.manual_seed(0)
        return nn.Sequential(nn.Flatten(), nn.Linear(64, 10))
    def narrow_input():
        return nn.Sequential(nn.Flatten(), nn.Linear(784, 2))
    def good():
        torch.manual_seed(0)
        return nn.Sequential(nn.Flatten(), nn.Linear(64, 2))
    """
)


@pytest.fixture
def usernet(tmp_path, monkeypatch):
    (tmp_path / "guards_usernet.py").write_text(USER)
    monkeypatch.syspath_prepend(str(tmp_path))
    import guards_usernet

    torch.save(guards_usernet.good().state_dict(), tmp_path / "w.pt")
    return tmp_path


@pytest.mark.parametrize("tool", ["memorable", "gp"])
@pytest.mark.parametrize(
    ("spec", "weights", "needle"),
    [
        ("not_callable", True, "not_callable is a int, expected a factory callable"),
        ("needs_arg", True, "calling needs_arg() raised TypeError"),
        ("narrow_input", False, "does not take split-digits's inputs [N, 1x8x8]"),
        ("wide", False, "gives outputs [2, 10] on split-digits's inputs, expected [N, 2]"),
        ("good", False, "without --weights would analyse the factory's random initial"),
        ("good", "dir", "--weights {tmp} is a directory"),
    ],
)
def test_a_users_model_that_does_not_fit_is_refused_naming_the_argument(
    tool, spec, weights, needle, usernet, capsys
):
    """Before: raw tracebacks (not callable, a factory needing an argument, mat1 and mat2),
    a 10-output model analysed on 2-class tasks, a random initialisation analysed without a
    word, a directory of weights reported as missing."""
    argv = ["--model", f"guards_usernet:{spec}", "--benchmark", "split-digits"]
    if weights == "dir":
        argv += ["--weights", str(usernet)]
    elif spec in ("narrow_input", "wide"):
        argv += ["--random-init"]
    elif weights:
        argv += ["--weights", str(usernet / "w.pt")]
    run = memorable_main if tool == "memorable" else gp_main
    assert run([*argv, "--out", str(usernet / "o")]) == 2
    _one_line(capsys, f"--model guards_usernet:{spec}" if weights != "dir" else "--weights",
              needle.format(tmp=usernet))  # fmt: skip


def test_random_init_is_accepted_when_asked_for(usernet, capsys):
    argv = ["--model", "guards_usernet:good", "--benchmark", "split-digits", "--random-init"]
    assert gp_main([*argv, "--n", "6", "--n-fit", "40", "--out", str(usernet / "o")]) == 0


@pytest.mark.parametrize("tool", ["memorable", "gp"])
def test_a_directory_given_as_the_checkpoint_says_so(tool, tmp_path, capsys):
    run = memorable_main if tool == "memorable" else gp_main
    assert run([str(tmp_path), "--out", str(tmp_path / "o")]) == 2
    _one_line(capsys, f"checkpoint {tmp_path} is a directory, expected a file")


# ----------------------------------------------------------------------- M10
@pytest.mark.parametrize(
    ("extra", "needle"),
    [
        (["--cpus-per-trial", "0"], "--cpus-per-trial must be a number > 0, got 0.0"),
        (["--num-cpus", "0"], "--num-cpus must be >= 1, got 0"),
        (["--gpus-per-trial", "0.5"], "--gpus-per-trial 0.5: this machine has no GPU"),
        (["--address", "nonsense"], "--address 'nonsense': expected auto, local"),
        (["--address", "ray://head:port"], "expected auto, local, ray://host:port"),
        (["--address", "nonsense.invalid:1"], "--address nonsense.invalid:1: no Ray cluster"),
        (["--address", "127.0.0.1:1"], "--address 127.0.0.1:1: no Ray cluster reachable"),
    ],
)
def test_sweep_refuses_what_ray_would_hang_on_before_ray_starts(extra, needle, tmp_path,
                                                                capsys, monkeypatch):  # fmt: skip
    """Before: a raw Ray ValueError (--cpus-per-trial 0) or a hang until killed (the rest)."""
    ray = pytest.importorskip("ray")

    def no_ray(*args, **kwargs):
        raise AssertionError("Ray started before its arguments were checked")

    monkeypatch.setattr(ray, "init", no_ray)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    argv = ["sweep", "split-digits", "--strategies", "naive", *extra, "--out", str(tmp_path)]
    assert main(argv) == 2
    _one_line(capsys, needle)


# ----------------------------------------------------------------------- SIGTERM, lock
def test_sigterm_says_how_to_resume_and_releases_the_lock(tmp_path):
    """Before: SIGTERM ended fromp-bench with status 143, no resume hint, the lock left. The
    run is this process forked (no second import), terminated once its lock is taken."""
    import signal
    import time

    from tests.cases import exit_code, forked

    def run(cfg):
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(30)

    def job():
        bench_main.run = run  # in the child only
        return main(["split-digits", "--strategies", "naive", "--epochs", "1", "--n-train",
                     "40", "--n-test", "20", "--no-progress", "--out", str(tmp_path)])  # fmt: skip

    log = tmp_path / "stderr.txt"
    code = exit_code(forked(job, str(log)), 300)
    assert code == 130, log.read_text()[-2000:]
    assert "run the same command with --resume" in log.read_text()
    assert not (tmp_path / "split-digits" / ".lock").exists()


def test_a_locked_out_is_refused_before_the_data_checks(tmp_path, capsys, monkeypatch):
    """Before: the data were loaded and checked (about 28 s on MNIST) before the lock."""

    def no_data(*args, **kwargs):
        raise AssertionError("data checked before the lock was taken")

    monkeypatch.setattr(bench_main, "check_data", no_data)
    monkeypatch.setattr(bench_main, "load_sequence", no_data)
    base = tmp_path / "split-digits"
    base.mkdir()
    alive = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        (base / ".lock").write_text(str(alive.pid))
        argv = ["split-digits", "--strategies", "naive", "--epochs", "1", *QUICK]
        assert main([*argv, "--out", str(tmp_path)]) == 2
        _one_line(capsys, f"pid {alive.pid}")
    finally:
        alive.kill()
        alive.wait()
