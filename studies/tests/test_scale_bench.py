"""Smoke test of the scale benchmark (python -m studies.scale) on tiny settings."""

from __future__ import annotations

import argparse
import importlib.util

import pytest
import torch

from studies.scale import _plan, check_device, main, run_case


def test_plan_and_one_case_run():
    args = argparse.Namespace(device="cpu", threads=1, skip_laplace_torch=False)
    specs = _plan(["mlp"], args)
    cases = [s["case"] for s in specs]
    assert cases.count("laplace") == 2 and cases.count("laplace_torch") == 2
    assert "kernel" in cases and "kernel_full" in cases and "predictive" in cases
    assert cases[0] == "check"
    args.cases = ["kernel_full"]
    assert [(s["case"], s["n"]) for s in _plan(["cnn"], args)] == [
        ("kernel_full", 256),
        ("kernel_full", 1024),
    ]
    base = {"model": "mlp", "device": "cpu", "threads": 1, "lt_batch": 4, "gp_chunk": 4}
    out = run_case({**base, "case": "laplace", "n": 6})
    assert out["precision_sum"] > 0 and out["peak_rss_mb"] >= out["base_rss_mb"] > 0
    out = run_case({**base, "case": "kernel", "n": 5})
    assert out["shape"] == [2, 5, 5] and out["method"] == "structured"
    out = run_case({**base, "case": "kernel_full", "n": 5})
    assert out["shape"] == [5, 2, 5, 2]
    kron = _plan(["resnet18"], argparse.Namespace(**{**vars(args), "cases": ["laplace_kron"]}))
    assert [(s["n"], s["target_n"]) for s in kron] == [(1000, 1000), (10000, 10000)]
    out = run_case({**base, "model": "cnn", "case": "laplace_kron", "n": 3, "kron_batch": 2})
    assert out["kron_blocks"] == 11 and out["diagonal_tensors"] == 0  # 5 conv, 6 heads
    assert out["log_marginal_likelihood"] < 0


def test_device_option_checked_before_any_case(monkeypatch, capsys, tmp_path):
    """--device cuda without CUDA, an unknown device or case: a one-line error naming the
    option, before any case runs or any file is written."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    out = tmp_path / "scale.json"
    for argv, msg in (
        (["--device", "cuda"], "--device cuda: CUDA is not available"),
        (["--device", "cuda:1"], "--device cuda:1: CUDA is not available"),
        (["--device", "gpu0"], "--device must be a torch device"),
        (["--cases", "kernel,ggn"], "--cases must be among"),
    ):
        with pytest.raises(SystemExit):
            main(["--models", "mlp", "--out", str(out), *argv])
        assert msg in capsys.readouterr().err
    assert not out.exists()
    assert check_device("cpu") == "cpu"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert check_device("cuda") == "cuda"  # accepted where a GPU is present
    with pytest.raises(ValueError, match="--device must be 'cpu' or 'cuda"):
        check_device("meta")


@pytest.mark.skipif(importlib.util.find_spec("laplace") is None, reason="laplace-torch absent")
def test_fromp_matches_laplace_torch_diag_ggn():
    base = {"model": "mlp", "device": "cpu", "threads": 1, "lt_batch": 4, "gp_chunk": 4}
    out = run_case({**base, "case": "check", "n": 6})
    assert out["max_abs_diff_over_max"] < 1e-5


def test_kernel_profile_refuses_no_inputs(capsys):
    from studies.kernel_profile import main as profile_main

    with pytest.raises(SystemExit):
        profile_main(["--n", "0"])
    assert "--n must be >= 1, got 0" in capsys.readouterr().err


def test_kernel_vs_revision_runs_and_compares(tmp_path):
    """The regression benchmark loads the GP module of a git revision beside the current
    one (here a fresh repository: the current file, then a commit that doubles the kernel):
    the first agrees with the current kernels, the second differs by a half, so the old
    revision really is what is timed; an unknown revision is one clear line."""
    import shutil
    import subprocess

    from studies import kernel_vs_revision as kvr

    repo = tmp_path / "repo"
    (repo / "fromp" / "gp").mkdir(parents=True)
    gp_file = repo / "fromp" / "gp" / "process.py"
    shutil.copy(kvr.ROOT / "fromp" / "gp" / "process.py", gp_file)
    git = ["git", "-c", "user.name=t", "-c", "user.email=t@t", "-c", "commit.gpgsign=false"]

    def run_git(*cmd: str) -> None:
        subprocess.run([*git, *cmd], cwd=repo, check=True, capture_output=True)

    run_git("init", "-q")
    run_git("add", "fromp/gp/process.py")
    run_git("commit", "-q", "-m", "gp")
    out = tmp_path / "k.json"
    args = ["--repo", str(repo), "--n", "4", "--out", str(out)]
    with open(gp_file, "a") as fh:
        fh.write("\n_k = GP.kernel\nGP.kernel = lambda self, *a, **k: 2 * _k(self, *a, **k)\n")
    run_git("commit", "-q", "-am", "doubled")
    rep = kvr.main(["--rev", "HEAD~1", "--repeats", "1", *args])
    assert out.exists()
    for kind in ("per_class", "full"):
        assert rep["kernels"][kind]["max_rel_diff"] < 1e-6
    rep = kvr.main(["--rev", "HEAD", "--repeats", "1", *args])
    for kind in ("per_class", "full"):
        assert abs(rep["kernels"][kind]["max_rel_diff"] - 0.5) < 1e-6
    with pytest.raises(SystemExit, match="--rev 'no-such-rev'"):
        kvr.main(["--rev", "no-such-rev", *args])


def test_scale_study_runs_the_laplace_predictive_case():
    """studies.scale's ``laplace_predictive`` case: one fit, then the predictive
    on each ``n`` in ascending order, probabilities summing to one."""
    from studies.scale import run_case

    spec = {"model": "mlp", "device": "cpu", "threads": 1, "lt_batch": 4, "gp_chunk": 4,
            "case": "laplace_predictive", "n": 5, "ns": [5, 2], "structure": "kron",
            "pred_fit": 16, "memory_budget": 1 << 20}  # fmt: skip
    out = run_case(spec)
    assert [r["n"] for r in out["predictive"]] == [2, 5]
    assert all(abs(r["prob_sum_mean"] - 1) < 1e-5 for r in out["predictive"])
    assert out["predictive"][-1]["pred_peak_rss_mb"] >= out["fit_rss_mb"] > 0
