"""The per-task time study: its record, and its refusals before any work."""

from __future__ import annotations

import json

import pytest

from studies import task_time


def test_record_holds_per_task_times_and_ratios(tmp_path):
    out = tmp_path / "t.json"
    argv = ["--tasks", "3", "--steps", "2", "--n-train", "200", "--batch-size", "32"]
    task_time.main([*argv, "--out", str(out)])
    rec = json.loads(out.read_text())
    assert rec["command"].startswith("python -m studies.task_time")
    for m in task_time.METHODS:
        per = rec["per_task"][m]
        assert len(per["train_s"]) == len(per["total_s"]) == 3
        for a, b, c in zip(per["train_s"], per["after_task_s"], per["total_s"]):
            assert a > 0 and b >= 0 and c == pytest.approx(a + b)
        want = [a / b for a, b in zip(per["total_s"], rec["per_task"]["naive"]["total_s"])]
        assert rec["ratio_to_naive"][m] == pytest.approx(want)
    assert rec["ratio_to_naive"]["naive"] == [1.0, 1.0, 1.0]
    assert rec["per_task"]["naive"]["after_task_s"] == pytest.approx([0, 0, 0], abs=1e-3)


def test_bad_arguments_refused_before_any_work(tmp_path, capsys):
    with pytest.raises(SystemExit):
        task_time.main(["--tasks", "0", "--out", str(tmp_path / "t.json")])
    assert "--tasks must be >= 1" in capsys.readouterr().err
    assert not (tmp_path / "t.json").exists()


def test_record_holds_the_penalty_step_after_each_task(tmp_path):
    out = tmp_path / "t.json"
    argv = ["--tasks", "2", "--steps", "1", "--n-train", "100", "--batch-size", "20"]
    task_time.main([*argv, "--repeats", "2", "--out", str(out)])
    after = json.loads(out.read_text())["after_each_task"]
    assert after["fromp_memorable_points"] == [40, 80]  # 40 per task
    for key in ("fromp_penalty_step_ms", "ewc_penalty_step_ms", "fromp_forward_backward_ms"):
        assert len(after[key]) == 2 and all(v > 0 for v in after[key])
    for key in ("fromp_select_s", "fromp_curvature_s", "fromp_kernel_s"):
        assert len(after[key]) == 2 and all(v >= 0 for v in after[key])
