"""The Laplace study on a GPU (``python -m studies.gpu_laplace``): it refuses a machine without
CUDA in one line; runs every case end to end on the CPU (``--quick``: a small CNN); records an
out-of-memory error, a failure or a case past its time share with a reason and no number, and
the other cases still run; computes the kron peak flag from independent numbers."""

from __future__ import annotations

import json
import socket
import time
from pathlib import Path

import pytest
import torch

from studies import gpu_laplace as gpu_check


# ------------------------------------------------------------------------------ refusals
def test_refuses_a_cpu_device_without_quick(capsys, tmp_path):
    assert gpu_check.main(["--device", "cpu", "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "--device cpu" in err and "CUDA" in err
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(
    ("extra", "named"),
    [(["--n-fit", "0"], "--n-fit"), (["--cases", "laplace,nope"], "--cases"),
     (["--budget", "0"], "--budget"), (["--budget", "nan"], "--budget")],
)  # fmt: skip
def test_refuses_bad_arguments_before_any_work(tmp_path, capsys, extra, named):
    out = tmp_path / "out"
    assert gpu_check.main(["--device", "cpu", "--quick", "--out", str(out), *extra]) == 2
    assert named in capsys.readouterr().err
    assert not out.exists()


# ------------------------------------------------------------------------- end to end
def test_quick_cpu_run_writes_every_case_with_a_value_or_a_reason(tmp_path):
    t0 = time.monotonic()
    rc = gpu_check.main(["--device", "cpu", "--quick", "--out", str(tmp_path)])
    assert time.monotonic() - t0 < 120
    (path,) = tmp_path.glob("*-cpu-laplace-quick.json")
    record = json.loads(path.read_text())
    assert rc == 0, {k: v.get("reason") for k, v in record["cases"].items()}
    assert record["finished"] and record["quick"]
    assert list(record["cases"]) == gpu_check.case_names()
    for name, case in record["cases"].items():
        assert case["status"] in ("ok", "skipped"), (name, case)
    n_params = sum(p.numel() for p in gpu_check.small_cnn().parameters())
    for subset, structure in gpu_check.LAPLACE_PAIRS:
        case = record["cases"][f"laplace/{subset}/{structure}"]
        assert case["fit"]["status"] == "ok" and case["fit"]["wall_s"] > 0
        assert case["glm"]["status"] == "ok" and case["glm"]["n"] == 32
        if subset == "all":
            assert case["fit"]["params"] == n_params
    assert record["cases"]["laplace/subnetwork/diag"]["fit"]["params"] == 50
    assert record["cases"]["distributed"]["status"] == "skipped"
    assert record["cases"]["ivon_adam"]["ratio_ivon_adam"] > 0
    assert all(f["pass"] is None for f in record["targets"].values())


def test_one_failing_case_is_recorded_and_the_next_ones_run(tmp_path, monkeypatch):
    real = gpu_check.laplace_case

    def flaky(model, data, subset, structure, *a):
        if structure == "kron":
            raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 130.00 GiB")
        return real(model, data, subset, structure, *a)

    monkeypatch.setattr(gpu_check, "laplace_case", flaky)
    cases = "laplace/all/kron,laplace/all/diag,ivon_adam"
    rc = gpu_check.main(["--device", "cpu", "--quick", "--out", str(tmp_path), "--cases", cases])
    record = json.loads(next(tmp_path.glob("*.json")).read_text())
    assert rc == 1  # in the check's order: the telling cases first
    assert list(record["cases"]) == ["laplace/all/kron", "ivon_adam", "laplace/all/diag"]
    kron = record["cases"]["laplace/all/kron"]
    assert kron["status"] == "oom" and "130.00 GiB" in kron["reason"]
    assert not {"wall_s", "peak_mb", "fit", "glm"} & set(kron)  # no number for a failure
    assert record["cases"]["laplace/all/diag"]["status"] == "ok"
    assert record["cases"]["ivon_adam"]["status"] == "ok"


# ----------------------------------------------------------------------------- guards
@pytest.mark.parametrize(
    ("err", "status"),
    [(torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2 GiB"), "oom"),
     (RuntimeError("DefaultCPUAllocator: can't allocate memory: you tried 9 GB"), "oom"),
     (RuntimeError("shape mismatch"), "error"), (ValueError("bad"), "error")],
)  # fmt: skip
def test_a_failure_is_a_status_and_a_reason_never_a_number(err, status):
    def boom():
        raise err

    out = gpu_check.guarded(boom, torch.device("cpu"), 60)
    assert out["status"] == status and type(err).__name__ in out["reason"]
    assert set(out) == {"status", "reason"}


def test_a_case_past_its_time_share_is_stopped(monkeypatch):
    monkeypatch.setattr(gpu_check, "MIN_CASE_S", 0.0)

    def slow():
        t_end = time.monotonic() + 10
        while time.monotonic() < t_end:
            time.sleep(0.01)

    t0 = time.monotonic()
    out = gpu_check.guarded(slow, torch.device("cpu"), 0.3)
    assert time.monotonic() - t0 < 3
    assert out["status"] == "timeout" and "0 s" in out["reason"] and "wall_s" not in out
    assert gpu_check.guarded(lambda: {"x": 1}, torch.device("cpu"), 5)["x"] == 1


def test_too_little_time_left_is_not_run():
    out = gpu_check.guarded(lambda: pytest.fail("ran"), torch.device("cpu"), 1.0)
    assert out["status"] == "not_run" and "budget" in out["reason"]


def test_a_predictive_that_would_not_fit_in_the_time_left_is_skipped_after_its_pilot():
    calls: list[int] = []

    def call(x):
        calls.append(len(x))
        time.sleep(0.05)
        return torch.full((len(x), 10), 0.1)

    x = torch.zeros(2000, 3)
    out = gpu_check.sized(call, x, 2000, 10, torch.device("cpu"), time.monotonic() + 6)
    assert calls == [4, 10]  # warm-up, pilot; 2000 inputs would take ~10 s of the 6 left
    assert out["status"] == "skipped" and out["pilot"]["n"] == 10 and "wall_s" not in out
    bad = gpu_check.sized(lambda x: torch.full((len(x), 10), float("nan")), x, 20, 10,
                          torch.device("cpu"), time.monotonic() + 60)  # fmt: skip
    assert bad["status"] == "error" and "non-finite" in bad["reason"]


# ---------------------------------------------------------------------------- targets
def test_the_kron_peak_flag_against_the_issue_limit():
    mib = 2**20
    cases = {"laplace/all/kron": {"glm": {"status": "ok", "n": 10_000, "peak_mb": 7_600e6 / mib}}}
    assert gpu_check.targets(cases, quick=False)["kron_glm_predictive_peak"]["pass"] is True
    # 8.05e9 bytes is 7.5 GiB: under 8 GiB, over the issue's 8 GB
    cases["laplace/all/kron"]["glm"]["peak_mb"] = 8.05e9 / mib
    assert gpu_check.targets(cases, quick=False)["kron_glm_predictive_peak"]["pass"] is False
    cases["laplace/all/kron"]["glm"] = {"status": "oom", "reason": "CUDA out of memory"}
    assert gpu_check.targets(cases, quick=False)["kron_glm_predictive_peak"]["pass"] is False
    cases["laplace/all/kron"]["glm"] = {"status": "ok", "n": 1_000, "peak_mb": 10.0}
    assert gpu_check.targets(cases, quick=False)["kron_glm_predictive_peak"]["pass"] is None


# ------------------------------------------------------------------------- distributed
def test_the_distributed_case_is_skipped_on_one_gpu(monkeypatch):
    monkeypatch.setattr(gpu_check, "gpu_count", lambda: 1)
    monkeypatch.setattr(gpu_check, "run_command", lambda *a, **k: pytest.fail("ran"))
    out = gpu_check.distributed_case(torch.device("cuda"), gpu_check.FULL, None, 60)
    assert out["status"] == "skipped" and out["reason"].startswith("1 GPU on this machine")


def test_the_distributed_case_launches_one_process_per_gpu(monkeypatch):
    seen = {}

    def launched(cmd, timeout, env=None):
        seen["cmd"] = cmd
        path = Path(cmd[cmd.index("--dist-worker") + 1])
        path.write_text(json.dumps({"world_size": 4, "structures": {
            "diag": {"equal": True}, "kron": {"equal": False}}}))  # fmt: skip
        return {"returncode": 0, "stdout": "", "stderr": "", "timed_out": False, "wall_s": 1.0}

    monkeypatch.setattr(gpu_check, "gpu_count", lambda: 4)
    monkeypatch.setattr(gpu_check, "run_command", launched)
    out = gpu_check.distributed_case(torch.device("cuda"), gpu_check.FULL, None, 60)
    assert "--nproc_per_node=4" in seen["cmd"] and "--dist-worker" in seen["cmd"]
    assert out["command"].startswith("torchrun --standalone --nproc_per_node=4 -m studies")
    assert out["status"] == "failed" and "kron" in out["reason"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_the_distributed_worker_compares_with_one_process(tmp_path, monkeypatch):
    for k, v in {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1",
                 "MASTER_PORT": str(_free_port())}.items():  # fmt: skip
        monkeypatch.setenv(k, v)
    out = tmp_path / "dist.json"
    gpu_check.dist_worker(out, "cpu", "small-cnn", 17, 8)
    got = json.loads(out.read_text())
    assert got["world_size"] == 1 and got["n_fit"] == 17
    for s in ("diag", "kron"):
        r = got["structures"][s]
        assert r["equal"] and r["max_prob_diff"] <= 1e-6 and r["single_s"] > 0
    assert not torch.distributed.is_initialized()
