"""``make gpu-check``'s script: refuses a machine without CUDA in one line, summarises the
runner's per-phase timings (FROMP over Naive), and runs every part end to end on tiny sizes
on the CPU (``--smoke``). Phase clocks synchronise CUDA before reading the time."""

from __future__ import annotations

import json

import pytest
import torch

from benchmarks.studies import gpu_check
from fromp.continual import methods


def test_refuses_a_cpu_device_without_smoke(capsys):
    assert gpu_check.main(["--device", "cpu"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "--device cpu" in err and "CUDA" in err


def test_refuses_cuda_when_absent(monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert gpu_check.main(["--device", "cuda"]) == 2
    assert "CUDA is not available" in capsys.readouterr().err


def test_summary_adds_phases_over_tasks_and_takes_fromp_over_naive():
    results = {
        "runs": [
            {"strategy": "fromp", "mean_accuracy": 99.0,
             "timing": [{"task": 1, "training_s": 2.0, "kernel_s": 1.0},
                        {"task": 2, "training_s": 3.0, "kernel_s": 2.0}]},
            {"strategy": "naive", "mean_accuracy": 60.0,
             "timing": [{"task": 1, "training_s": 1.0}, {"task": 2, "training_s": 1.5}]},
        ]
    }  # fmt: skip
    s = gpu_check.summarise_split(results)
    assert s["fromp"]["seconds"] == {"training_s": 5.0, "kernel_s": 3.0}
    assert s["fromp"]["total_s"] == 8.0 and s["naive"]["total_s"] == 2.5
    assert s["fromp"]["fromp_over_naive"] == pytest.approx(8.0 / 2.5)
    assert "task" not in s["naive"]["seconds"]  # the task index is not a time


def test_smoke_run_writes_every_part(tmp_path):
    parts = "split_mnist,laplace_resnet18,ivon_adam_resnet18"
    rc = gpu_check.main(["--device", "cpu", "--smoke", "--out", str(tmp_path), "--parts", parts])
    record = json.loads((tmp_path / "gpu_check.json").read_text())
    assert rc == 0, record
    split = record["split_mnist"]["strategies"]
    assert set(split) == {"fromp", "naive"} and split["fromp"]["fromp_over_naive"] > 0
    assert (tmp_path / "split-digits.json").exists()
    lap = record["laplace_resnet18"]
    assert lap["n"] == 64 and lap["params"] == 11_181_642  # resnet18(num_classes=10)
    assert record["ivon_adam_resnet18"]["ratio_ivon_adam"] > 0


def test_phase_clock_synchronises_cuda(monkeypatch):
    calls = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda d=None: calls.append(d))
    methods._clock(torch.device("cpu"))
    assert calls == []
    methods._clock(torch.device("cuda", 0))
    assert calls == [torch.device("cuda", 0)]


def test_the_avalanche_study_refuses_a_diverged_run():
    from types import SimpleNamespace

    from benchmarks.studies.avalanche_models import check_trained

    net = torch.nn.Linear(2, 2)
    check_trained(SimpleNamespace(model=net, loss=torch.tensor(0.3)), "ok")
    with pytest.raises(RuntimeError, match="loss is not finite"):
        check_trained(SimpleNamespace(model=net, loss=torch.tensor(float("nan"))), "x")
    with torch.no_grad():
        net.weight[0, 0] = float("inf")
    with pytest.raises(RuntimeError, match="weights weight are not finite"):
        check_trained(SimpleNamespace(model=net, loss=torch.tensor(0.3)), "x")
