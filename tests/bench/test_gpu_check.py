"""``make gpu-check`` (:mod:`fromp_bench.gpu_check`) on the CPU: it refuses a machine without
CUDA, a non-finite or non-positive budget, an output that is a file and unknown cases in one
line before any work; runs the runner end to end in quick mode (split-digits, tiny); records
a failure, a timeout or a spent budget with a reason and no number; writes each case as it
ends; computes the time ratios and flatness flags from independent numbers; reads a stopped
run's checkpoint as ``--resume`` does."""

from __future__ import annotations

import hashlib
import io
import json
import os
import time
from pathlib import Path

import pytest
import torch
from fromp_bench import gpu_check
from fromp_bench.plugins import _write_checkpoint

from fromp.continual import methods


# ------------------------------------------------------------------------------ refusals
def test_refuses_a_cpu_device_without_quick(capsys, tmp_path):
    assert gpu_check.main(["--device", "cpu", "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "--device cpu" in err and "CUDA" in err
    assert list(tmp_path.iterdir()) == []


def test_refuses_cuda_when_absent(monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert gpu_check.main(["--device", "cuda"]) == 2
    assert "CUDA is not available" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("extra", "named"),
    [(["--cases", "tests,nope"], "--cases"), (["--cases", ","], "--cases"),
     (["--budget", "0"], "--budget"), (["--budget", "-5"], "--budget"),
     (["--budget", "nan"], "--budget"), (["--budget", "inf"], "--budget")],
)  # fmt: skip
def test_refuses_bad_arguments_before_any_work(tmp_path, capsys, extra, named):
    """Before: --budget nan was accepted (the time budget off, NaN in the record)."""
    out = tmp_path / "out"
    assert gpu_check.main(["--device", "cpu", "--quick", "--out", str(out), *extra]) == 2
    err = capsys.readouterr().err.strip()
    assert named in err and "\n" not in err
    assert not out.exists()


def test_refuses_an_out_that_is_a_file_in_one_line(tmp_path, capsys):
    """Before: a FileExistsError traceback."""
    afile = tmp_path / "afile"
    afile.write_text("")
    assert gpu_check.main(["--device", "cpu", "--quick", "--out", str(afile)]) == 2
    err = capsys.readouterr().err.strip()
    assert f"--out {afile}: is a file" in err and "\n" not in err and "Traceback" not in err


# ------------------------------------------------------------------------- end to end
_run_command = gpu_check.run_command  # the real one (tests patch the module's)


def _runner_in_process(cmd: list[str], timeout: float) -> dict:
    """``run_command`` for ``python -m fromp_bench ...``: the runner's ``main`` with the same
    arguments in this process (single-threaded, as every test), which saves a process importing
    Avalanche; any other command (the synthetic-CIFAR study) still runs as its own process."""
    import contextlib
    import io

    from fromp_bench.__main__ import main

    if cmd[1:3] != ["-m", "fromp_bench"]:
        return _run_command(cmd, timeout)
    t0 = time.perf_counter()
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = main(cmd[3:])
    return {"returncode": rc, "stdout": out.getvalue(), "stderr": err.getvalue(),
            "timed_out": False, "wall_s": time.perf_counter() - t0}  # fmt: skip


@pytest.mark.slow
def test_quick_cpu_run_of_the_runner_end_to_end(tmp_path, monkeypatch):
    """The real runner, one strategy, split-digits at tiny sizes: per-task seconds from the
    run's record, the command with its paths relative (OUT, DATA), the record and summary.
    Split-digits runs in this process, the synthetic-CIFAR study as the check runs it (its
    own process)."""
    monkeypatch.setattr(gpu_check, "run_command", _runner_in_process)
    t0 = time.monotonic()
    rc = gpu_check.main(["--device", "cpu", "--quick", "--out", str(tmp_path), "--cases",
                         "split-digits/naive,split-cifar-1/naive"])  # fmt: skip
    assert time.monotonic() - t0 < 150
    (path,) = tmp_path.glob("*-cpu-quick.json")
    record = json.loads(path.read_text())
    case, cifar = record["cases"]["split-digits/naive"], record["cases"]["split-cifar-1/naive"]
    assert rc == 0 and case["status"] == "ok" and cifar["status"] == "ok", (case, cifar)
    assert len(case["per_task_s"]) == 5 and all(s > 0 for s in case["per_task_s"])
    assert len(cifar["per_task_s"]) == 6  # split CIFAR's six tasks, on synthetic files
    assert case["total_s"] == pytest.approx(sum(case["per_task_s"]))
    assert 0 <= case["mean_accuracy"] <= 100
    assert "--out OUT" in case["command"] and "--data-root DATA" in case["command"]
    assert "studies.synthetic_cifar --scale 0.02 -- split-cifar" in cifar["command"]
    assert str(tmp_path) not in path.read_text() and "/tmp/" not in case["command"]
    assert record["finished"]
    assert list(record["cases"]) == ["split-digits/naive", "split-cifar-1/naive"]
    assert "split-digits/naive" in path.with_suffix(".md").read_text()


def _fake_runner(calls: list[list[str]], seconds: dict[str, list[float]]):
    """``run_command`` in place of the processes: pytest answers with a summary line, the
    runner writes a results.json with the given per-task training seconds."""

    def run(cmd, timeout):
        calls.append(list(cmd))
        if "pytest" in cmd:
            out = "..s\n2 passed, 1 skipped, 40 deselected in 1.00s\n"
            return {"returncode": 0, "stdout": out, "stderr": "", "timed_out": False,
                    "wall_s": 1.0}  # fmt: skip
        assert cmd[1:3] in (["-m", "fromp_bench"], ["-m", "studies.synthetic_cifar"]), cmd
        bench = cmd[cmd.index("--") + 1] if "--" in cmd else cmd[3]
        strategy = cmd[cmd.index("--strategies") + 1]
        base = Path(cmd[cmd.index("--out") + 1]) / bench
        base.mkdir(parents=True)
        timing = [{"task": i + 1, "training_s": s, "kernel_s": 0.0, "evaluation_s": 0.5}
                  for i, s in enumerate(seconds[strategy])]  # fmt: skip
        run_ = {"strategy": strategy, "complete": True, "mean_accuracy": 90.0, "timing": timing}
        (base / "results.json").write_text(json.dumps({"runs": [run_]}))
        return {"returncode": 0, "stdout": "", "stderr": "", "timed_out": False, "wall_s": 2.0}

    return run


def test_every_case_in_order_with_a_value_and_quick_flags_unset(tmp_path, monkeypatch):
    calls: list[list[str]] = []
    seconds = {"naive": [1.0, 1.0, 1.0], "fromp": [1.0, 1.2, 1.2], "ewc": [1.0, 1.1, 1.1]}
    monkeypatch.setattr(gpu_check, "run_command", _fake_runner(calls, seconds))
    rc = gpu_check.main(["--device", "cpu", "--quick", "--out", str(tmp_path)])
    record = json.loads(next(tmp_path.glob("*-cpu-quick.json")).read_text())
    assert rc == 0 and record["finished"] and record["quick"]
    assert list(record["cases"]) == gpu_check.case_names(gpu_check.QUICK_CPU)
    assert record["cases"]["tests"]["passed"] == 2 and record["cases"]["tests"]["skipped"] == 1
    assert record["cases"]["split-digits/fromp"]["per_task_s"] == [1.0, 1.2, 1.2]
    bench = [c for c in calls if "fromp_bench" in c]  # one process per strategy
    assert [c[c.index("--strategies") + 1] for c in bench] == ["naive", "fromp", "ewc"]
    assert all(c[3] == "split-digits" and "--epochs" in c for c in bench)
    cifar = [c for c in calls if "studies.synthetic_cifar" in c]  # through its data's study
    assert [c[c.index("--strategies") + 1] for c in cifar] == ["naive", "fromp"]
    assert all(c[3:7] == ["--scale", "0.02", "--", "split-cifar"] for c in cifar)
    for c in cifar:  # its data in the run's own folder, not DATA
        assert c[c.index("--data-root") + 1] == c[c.index("--out") + 1]
    t = record["targets"]
    assert t["split-digits/fromp_over_naive"]["value"] == pytest.approx(3.4 / 3.0)
    assert t["split-cifar-1/fromp_over_naive"]["value"] == pytest.approx(3.4 / 3.0)
    assert "split-cifar-1/ewc_over_naive" not in t  # a group of its own strategies
    assert all(f["pass"] is None for f in t.values())  # quick mode: never pass or fail


def test_a_spent_budget_leaves_every_case_present_as_not_run(tmp_path, monkeypatch):
    monkeypatch.setattr(gpu_check, "run_command", lambda *a, **k: pytest.fail("ran a process"))
    rc = gpu_check.main(["--device", "cpu", "--quick", "--out", str(tmp_path), "--budget", "1e-6"])
    record = json.loads(next(tmp_path.glob("*.json")).read_text())
    assert rc == 1 and record["finished"]
    assert {c["status"] for c in record["cases"].values()} == {"not_run"}
    assert all("budget" in c["reason"] and "wall_s" not in c for c in record["cases"].values())


def test_a_failed_run_is_a_reason_and_each_case_is_written_as_it_ends(tmp_path, monkeypatch):
    seen: list[dict] = []
    real = _fake_runner([], {"naive": [1.0] * 3, "ewc": [1.0] * 3})

    def flaky(cmd, timeout):
        seen.append(json.loads(next(tmp_path.glob("*.json")).read_text()))
        if "fromp" in cmd[cmd.index("--strategies") + 1 :]:
            return {"returncode": 3, "stdout": "", "stderr": f"{cmd[cmd.index('--out') + 1]} "
                    "diverged", "timed_out": False, "wall_s": 1.0}  # fmt: skip
        return real(cmd, timeout)

    monkeypatch.setattr(gpu_check, "run_command", flaky)
    rc = gpu_check.main(["--device", "cpu", "--quick", "--out", str(tmp_path), "--cases",
                         "split-digits"])  # fmt: skip
    record = json.loads(next(tmp_path.glob("*.json")).read_text())
    fromp = record["cases"]["split-digits/fromp"]
    assert rc == 1 and fromp["status"] == "failed" and "exit status 3" in fromp["reason"]
    assert "OUT diverged" in fromp["reason"] and not {"per_task_s", "total_s"} & set(fromp)
    assert record["cases"]["split-digits/ewc"]["status"] == "ok"
    assert record["targets"]["split-digits/fromp_over_naive"]["value"] is None
    # the file on disk before each run: the earlier cases done, the later ones pending
    assert [c["cases"]["split-digits/ewc"]["status"] for c in seen] == ["pending"] * 3
    assert seen[2]["cases"]["split-digits/fromp"]["status"] == "failed" and not seen[2]["finished"]


# ---------------------------------------------------------------------------- targets
def _ok(per_task):
    return {"status": "ok", "per_task_s": per_task, "total_s": sum(per_task),
            "flatness": max(per_task[1:]) / min(per_task[1:])}  # fmt: skip


def test_targets_against_the_limits():
    cases = {
        "split-mnist/naive": _ok([10.0, 10.0, 10.0, 10.0, 10.0]),
        # task 1 has no penalty: flatness is over tasks 2..T (1.0 here), time 64 / 50 = 1.28
        "split-mnist/fromp": _ok([12.0, 13.0, 13.0, 13.0, 13.0]),
        # 65 / 50 = 1.3 > 1.2; tasks 2..5 grow 12 -> 15: 1.25 > 1.2
        "split-mnist/ewc": _ok([11.0, 12.0, 13.0, 14.0, 15.0]),
    }
    t = gpu_check.targets(cases, gpu_check.FULL, quick=False)
    assert t["split-mnist/fromp_over_naive"]["value"] == pytest.approx(1.28)
    assert t["split-mnist/fromp_over_naive"]["pass"] is True
    assert t["split-mnist/fromp_over_naive"]["per_task"] == pytest.approx([1.2, 1.3, 1.3, 1.3,
                                                                          1.3])  # fmt: skip
    assert t["split-mnist/ewc_over_naive"]["pass"] is False
    assert t["split-mnist/fromp_per_task_flat"]["pass"] is True
    assert t["split-mnist/naive_per_task_flat"]["pass"] is True
    assert t["split-mnist/ewc_per_task_flat"]["value"] == pytest.approx(1.25)
    assert t["split-mnist/ewc_per_task_flat"]["pass"] is False
    cases["split-mnist/naive"] = {"status": "timeout", "reason": "stopped after 80 s"}
    t = gpu_check.targets(cases, gpu_check.FULL, quick=False)
    flag = t["split-mnist/fromp_over_naive"]
    assert flag["pass"] is None and "timeout" in flag["note"]
    assert all(f["pass"] is None for f in gpu_check.targets(cases, gpu_check.FULL, True).values())


def test_per_task_time_is_training_and_method_phases_without_evaluation():
    run = {"mean_accuracy": 99.0, "timing": [
        {"task": 1, "training_s": 2.0, "evaluation_s": 1.0},
        {"task": 2, "training_s": 2.0, "memorable_s": 0.5, "kernel_s": 0.5, "evaluation_s": 2.0},
        {"task": 3, "training_s": 2.0, "memorable_s": 0.5, "kernel_s": 1.5, "evaluation_s": 3.0},
    ]}  # fmt: skip
    s = gpu_check.summarise_run(run)
    assert s["per_task_s"] == [2.0, 3.0, 4.0] and s["per_task_eval_s"] == [1.0, 2.0, 3.0]
    assert s["total_s"] == 9.0 and s["flatness"] == pytest.approx(4.0 / 3.0)
    assert s["phases_s"] == {"training_s": 6.0, "memorable_s": 1.0, "kernel_s": 2.0,
                             "evaluation_s": 6.0}  # fmt: skip


def test_a_stopped_runner_keeps_the_tasks_of_its_checkpoint(tmp_path, monkeypatch):
    """The stopped run's checkpoint is read as --resume reads it (checksum, weights only):
    the tasks it holds are kept; a crafted one is read as no checkpoint, its code not run."""
    marker = tmp_path / "marker"

    class Payload:
        def __reduce__(self):
            return (exec, (f"open({str(marker)!r}, 'w').write('ran')",))

    timing = [{"task": 1, "training_s": 3.0}, {"task": 2, "training_s": 4.0}]

    def stopped(state):
        def run(cmd, timeout):
            ck = Path(cmd[cmd.index("--out") + 1]) / "split-digits" / "checkpoints"
            ck.mkdir(parents=True)
            if isinstance(state, dict):
                _write_checkpoint(ck / "fromp-x-seed0.pt", state)
            else:
                buf = io.BytesIO()
                torch.save(state, buf)
                (ck / "fromp-x-seed0.pt").write_bytes(buf.getvalue())
                digest = hashlib.sha256(buf.getvalue()).hexdigest()
                (ck / "fromp-x-seed0.pt.sha256").write_text(digest)
            return {"returncode": -9, "stdout": "", "stderr": "", "timed_out": True,
                    "wall_s": 9.0}  # fmt: skip

        return run

    t = gpu_check.QUICK_CPU[0]
    good = {"version": 4, "config": {}, "model": {}, "timing": timing}
    monkeypatch.setattr(gpu_check, "run_command", stopped(good))
    out = gpu_check.timing_case(t, "fromp", "cpu", tmp_path, 9.0)
    assert out["status"] == "timeout" and "per_task_s" not in out
    assert out["partial"]["per_task_s"] == [3.0, 4.0]
    monkeypatch.setattr(gpu_check, "run_command", stopped([Payload()]))
    out = gpu_check.timing_case(t, "fromp", "cpu", tmp_path, 9.0)
    assert out["status"] == "timeout" and "partial" not in out and not marker.exists()


def test_a_benchmark_without_its_data_is_skipped_with_the_reason(tmp_path, monkeypatch):
    monkeypatch.setattr(gpu_check, "run_command", lambda *a, **k: pytest.fail("ran"))
    out = gpu_check.timing_case(gpu_check.FULL[0], "naive", "cuda", tmp_path, 60.0)
    assert out["status"] == "skipped" and "no MNIST under DATA/MNIST/raw" in out["reason"]
    assert str(tmp_path) not in out["reason"]


def test_the_tests_case_counts_a_real_pytest_run(tmp_path):
    f = tmp_path / "test_fake.py"
    f.write_text(
        "import pytest\n"
        "def test_a_cuda(): pass\n"
        "def test_b_cuda(): pytest.skip('no GPU')\n"
        "def test_c_cuda(): assert False\n"
        "def test_d(): pass\n"
    )
    out = gpu_check.tests_case(120, (str(f),))
    assert out["status"] == "failed" and "exit status 1" in out["reason"]
    assert (out["passed"], out["skipped"], out["failed"], out["deselected"]) == (1, 1, 1, 1)
    assert "-k cuda" in out["command"] and "wall_s" not in out


# --------------------------------------------------------------------- CUDA-adjacent
def test_phase_clock_synchronises_cuda(monkeypatch):
    calls = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda d=None: calls.append(d))
    methods._clock(torch.device("cpu"))
    assert calls == []
    methods._clock(torch.device("cuda", 0))
    assert calls == [torch.device("cuda", 0)]


def test_the_device_filter_selects_only_the_cheap_tests_here():
    """``pytest -k cuda`` on the device must not rerun the check inside the check: only the
    two cheap device tests here carry that word in their names."""
    word = "cu" + "da"
    names = [n for n in globals() if n.startswith("test_") and word in n.lower()]
    assert sorted(names) == ["test_phase_clock_synchronises_cuda", "test_refuses_cuda_when_absent"]
    assert word not in os.path.basename(__file__)
