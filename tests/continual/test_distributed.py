"""FROMP and EWC on torch.distributed (gloo, 2 processes on the CPU): each rank learns its
shard of every experience, and the memorable set, the curvature (GGN sum, Fisher) and the
penalty with its gradient equal one process on the concatenated shards, after tasks 2 and
3. The memorable set is also checked against a brute-force ``tr Lambda`` ranking."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from fromp.continual.ewc import EWCMethod
from fromp.continual.memorable import select_memorable
from fromp.continual.methods import FROMPMethod
from fromp.posterior import DiagonalGaussian
from tests.core.test_distributed import WORLD, run_ranks

pytestmark = pytest.mark.skipif(
    not torch.distributed.is_available(), reason="torch.distributed (gloo) is not available"
)

N, TASKS = 24, 3  # N examples per task, split into WORLD contiguous shards


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 3)).double()


def _task(t: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(50 + t)
    x = torch.randn(N, 4, generator=g, dtype=torch.float64)
    y = (torch.arange(N) % 3)[torch.randperm(N, generator=g)]
    return x, y


def _shard(v: torch.Tensor, rank: int | None) -> torch.Tensor:
    if rank is None:
        return v
    k = len(v) // WORLD
    return v[rank * k : (rank + 1) * k]


def _move(net: nn.Module, t: int) -> None:
    """New weights before task ``t`` (the same on every rank)."""
    g = torch.Generator().manual_seed(900 + t)
    with torch.no_grad():
        for p in net.parameters():
            p.add_(0.3 * torch.randn(p.shape, generator=g, dtype=p.dtype))


def _penalty_and_grad(method, net: nn.Module) -> dict:
    pen = method.penalty(net)
    grads = torch.autograd.grad(pen, list(net.parameters()), allow_unused=True)
    return {
        "penalty": pen.detach(),
        "grad": [torch.zeros_like(p) if g is None else g for g, p in zip(grads, net.parameters())],
    }


def _brute_memorable(net: nn.Module, x: torch.Tensor, y: torch.Tensor, k: int) -> torch.Tensor:
    """Per class, the ``k`` largest ``sum_c p_c (1 - p_c)`` (ties: data order), written out."""
    with torch.no_grad():
        p = torch.softmax(net(x), -1)
    score = (p * (1 - p)).sum(-1).tolist()
    picks = []
    for c in sorted(set(y.tolist())):
        members = [i for i in range(len(y)) if int(y[i]) == c]
        picks += sorted(members, key=lambda i: (-score[i], i))[:k]
    return x[picks]


def _fromp(rank: int | None, posterior: str) -> list[dict]:
    net = _net().eval()
    method = FROMPMethod(tau=1.0, n_points=6, curvature_examples=None, posterior=posterior)
    out = []
    for t in range(TASKS):
        _move(net, t)
        x, y = _task(t)
        brute = _brute_memorable(net, x, y, 2) if rank is None else None
        method.learn_task(net, _shard(x, rank), _shard(y, rank), None)
        _move(net, 10 + t)  # off the anchors, for a penalty that is not 0
        if t == 0:
            continue
        res = _penalty_and_grad(method, net)
        res["memorable"] = [m.inputs.clone() for m in method.regularizer.memories]
        res["labels"] = [m.labels.clone() for m in method.regularizer.memories]
        res["brute"] = brute
        res["ggn"] = (
            {n: v.clone() for n, v in method.ggn_sum.items()} if posterior == "ggn" else None
        )
        out.append(res)
    return out


def _fromp_ggn(rank: int) -> list[dict]:
    return _fromp(rank, "ggn")


def _fromp_kron(rank: int) -> list[dict]:
    return _fromp(rank, "kron")


def _ewc(rank: int | None, fisher: str, mode: str) -> list[dict]:
    net = _net().eval()
    method = EWCMethod(3.0, fisher=fisher, batch_size=4, mode=mode, decay_factor=0.5)
    out = []
    for t in range(TASKS):
        _move(net, t)
        x, y = _task(t)
        method.learn_task(net, _shard(x, rank), _shard(y, rank), None, experience=t)
        _move(net, 10 + t)
        if t == 0:
            continue
        res = _penalty_and_grad(method, net)
        res["importances"] = [{n: v.clone() for n, v in f.items()} for f in method.importances]
        out.append(res)
    return out


_EWC_CASES = [("exact", "separate"), ("empirical", "online"), ("minibatch", "separate")]


def _ewc_exact_separate(rank: int) -> list[dict]:
    return _ewc(rank, "exact", "separate")


def _ewc_empirical_online(rank: int) -> list[dict]:
    return _ewc(rank, "empirical", "online")


def _ewc_minibatch_separate(rank: int) -> list[dict]:
    return _ewc(rank, "minibatch", "separate")


def _close(a, b) -> None:
    torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("posterior", ["ggn", "kron"])
def test_fromp_over_two_ranks_equals_one_process(posterior):
    want = _fromp(None, posterior)
    fn = _fromp_ggn if posterior == "ggn" else _fromp_kron
    for ranks_out in run_ranks(fn):
        assert len(ranks_out) == len(want) == TASKS - 1  # after tasks 2 and 3
        for got, ref in zip(ranks_out, want):
            # the memorable set: every rank the same as one process, and the brute force
            assert len(got["memorable"]) == len(ref["memorable"])
            for a, b, la, lb in zip(
                got["memorable"], ref["memorable"], got["labels"], ref["labels"]
            ):
                assert torch.equal(a, b) and torch.equal(la, lb)
            assert torch.equal(ref["memorable"][-1], ref["brute"])
            if posterior == "ggn":
                assert set(got["ggn"]) == set(ref["ggn"])
                for n in ref["ggn"]:
                    _close(got["ggn"][n], ref["ggn"][n])
            _close(got["penalty"], ref["penalty"])
            assert float(ref["penalty"]) > 1e-6
            for a, b in zip(got["grad"], ref["grad"]):
                _close(a, b)


@pytest.mark.parametrize(("fisher", "mode"), _EWC_CASES)
def test_ewc_over_two_ranks_equals_one_process(fisher, mode):
    want = _ewc(None, fisher, mode)
    fn = globals()[f"_ewc_{fisher}_{mode}"]
    for ranks_out in run_ranks(fn):
        for got, ref in zip(ranks_out, want, strict=True):
            for fa, fb in zip(got["importances"], ref["importances"], strict=True):
                assert set(fa) == set(fb)
                for n in fb:
                    _close(fa[n], fb[n])
            _close(got["penalty"], ref["penalty"])
            assert float(ref["penalty"]) > 1e-6
            for a, b in zip(got["grad"], ref["grad"]):
                _close(a, b)


# ----------------------------------------------------------------------- the runner
#: what ``torchrun --standalone --nproc_per_node=1`` gives its one worker
_TORCHRUN_ONE = {
    "RANK": "0", "LOCAL_RANK": "0", "GROUP_RANK": "0", "ROLE_RANK": "0", "WORLD_SIZE": "1",
    "LOCAL_WORLD_SIZE": "1", "ROLE_WORLD_SIZE": "1", "ROLE_NAME": "default",
    "MASTER_ADDR": "localhost", "MASTER_PORT": "29500", "TORCHELASTIC_RESTART_COUNT": "0",
    "TORCHELASTIC_MAX_RESTARTS": "0", "TORCHELASTIC_RUN_ID": "none",
    "TORCHELASTIC_USE_AGENT_STORE": "False",
}  # fmt: skip


def _bench(out, nproc: int | None, *extra: str) -> tuple[dict, str]:
    """``fromp-bench`` on the built-in Split-Digits (2 tasks, tiny), plain (``nproc=None``:
    its ``main`` in this process, single-threaded as every test, which saves a process
    importing Avalanche), as torchrun's one worker (``nproc=1``: the same ``main`` in this
    process under the environment ``torchrun --nproc_per_node=1`` sets) or launched by
    ``torch.distributed.run`` with ``nproc`` gloo processes; the JSON of every run file in
    ``out`` (by file name) and the command's standard error."""
    import contextlib
    import io
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    args = ["split-digits", "--strategies", "ewc,fromp", "--epochs", "1", "--batch-size", "8",
            "--n-train", "80", "--n-test", "20", "--stop-after", "2", "--out", str(out),
            "--no-progress", *extra]  # fmt: skip
    if nproc is None or nproc == 1:
        from unittest import mock

        from fromp_bench.__main__ import main

        assert "RANK" not in os.environ and not torch.distributed.is_initialized()
        err = io.StringIO()
        with (
            contextlib.redirect_stderr(err),
            mock.patch.dict(os.environ, _TORCHRUN_ONE if nproc else {}),
        ):
            rc = main(args)
        assert not torch.distributed.is_initialized()
        done = subprocess.CompletedProcess(args, rc, "", err.getvalue())
    else:
        args = ["-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
                "-m", "fromp_bench", *args]  # fmt: skip
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(Path.cwd())}
        for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
            env.pop(k, None)
        done = subprocess.run([sys.executable, *args], env=env, capture_output=True,
                              text=True, timeout=900)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    base = Path(out) / "split-digits"
    assert (base / "results.json").exists()
    runs = {f.stem: json.loads(f.read_text()) for f in (base / "runs").glob("*.json")}
    return runs, done.stderr


def _by_strategy(runs: dict) -> dict:
    assert len({r["strategy"] for r in runs.values()}) == len(runs) == 2, sorted(runs)
    return {r["strategy"]: r for r in runs.values()}


@pytest.mark.slow
def test_runner_under_torchrun_rank_zero_writes_and_one_process_is_unchanged(tmp_path):
    """``torchrun --nproc_per_node=1`` gives the plain run's numbers exactly; with 2 gloo
    processes rank 0 writes the results (one file per run), which hold the same settings,
    data and task sizes, and train both tasks to finite accuracies. The two-process run of
    the same command into the same folder, with ``--resume``, is a run of its own (the
    world size in its settings id): it starts anew, says so once per run, and replaces
    neither the plain run's result nor its checkpoint (before, it shared their label and
    silently replaced them)."""
    import json

    from fromp_bench.report import group_key

    plain_runs, _ = _bench(tmp_path / "plain", None)
    plain = _by_strategy(plain_runs)
    one = _by_strategy(_bench(tmp_path / "one", 1)[0])
    base = tmp_path / "plain" / "split-digits"
    before = {f.name: f.read_bytes() for f in (base / "checkpoints").glob("*.pt")}
    both, err = _bench(tmp_path / "plain", 2, "--resume")
    assert err.count("no checkpoint of these settings") == 2, err  # once per run, rank 0
    for stem, run in plain_runs.items():
        assert both[stem] == run  # the plain results are kept as they were
    two = _by_strategy({k: v for k, v in both.items() if k not in plain_runs})
    after = {f.name: f.read_bytes() for f in (base / "checkpoints").glob("*.pt")}
    assert {k: after[k] for k in before} == before and len(after) == 2 * len(before)
    assert len(json.loads((base / "results.json").read_text())["runs"]) == 4
    assert len({group_key(r) for r in both.values()}) == 4  # never seeds of one setting
    # one process trains to the plain run's weights, bit for bit (its checkpoints)
    from fromp_avalanche.checkpoint import read_checked

    ones = sorted((tmp_path / "one" / "split-digits" / "checkpoints").glob("*.pt"))
    assert sorted(f.name for f in ones) == sorted(before) and len(ones) == 2
    for f in ones:
        got, ref = read_checked(f)["model"], read_checked(base / "checkpoints" / f.name)["model"]
        assert got.keys() == ref.keys()
        for k in ref:
            assert torch.equal(got[k], ref[k]), (f.name, k)
    for name in ("ewc", "fromp"):
        assert one[name]["accuracy_matrix"] == plain[name]["accuracy_matrix"]
        assert one[name]["per_task"] == plain[name]["per_task"]
        assert "distributed" not in one[name] and "distributed" not in plain[name]
        got, ref = two[name], plain[name]
        assert got["distributed"] == {"world_size": 2, "backend": "gloo"}
        for key in ("settings", "data", "n_train_per_task", "seed"):
            assert got[key] == ref[key], key
        assert len(got["accuracy_matrix"]) == 2
        accs = [a for row in got["accuracy_matrix"] for a in row if a is not None]
        assert len(accs) == 3 and all(0.0 <= a <= 100.0 for a in accs)
        assert got["accuracy_matrix"][0][0] > 50.0  # it learnt task 1 (two classes)


_ORDERS = ("descending", "ascending", "random", "sensitivity")


def _select(rank: int | None) -> dict:
    """``select_memorable`` in every order, indices and points, on uneven shards (rank 0: the
    first 10 examples, rank 1: the other 14) or, ``rank=None``, one process on all of them."""
    net = _net().eval()
    x, y = _task(0)
    if rank is not None:
        x, y = (x[:10], y[:10]) if rank == 0 else (x[10:], y[10:])
    mean = torch.cat([p.detach().reshape(-1) for p in net.parameters()])
    q = DiagonalGaussian(mean, torch.linspace(0.1, 1.0, len(mean), dtype=torch.float64))
    out = {}
    for order in _ORDERS:
        kw = {"order": order, "posterior": q, "chunk_size": 5}
        kw["generator"] = torch.Generator().manual_seed(3)
        idx = select_memorable(net, x, y, "categorical", 3, **kw)
        kw["generator"] = torch.Generator().manual_seed(3)
        out[order] = (idx, *select_memorable(net, x, y, "categorical", 3, points=True, **kw))
    return out


def test_select_memorable_over_two_uneven_shards_equals_one_process():
    want = _select(None)
    x, y = _task(0)
    for order in _ORDERS:  # one process: the points are the examples at the indices
        idx, xm, ym = want[order]
        assert torch.equal(xm, x[idx]) and torch.equal(ym, y[idx])
    assert not torch.equal(want["descending"][0], want["ascending"][0])
    for got in run_ranks(_select):
        for order in _ORDERS:  # indices into the concatenation of the shards, and the points
            for a, b in zip(got[order], want[order]):
                assert torch.equal(a, b), order
