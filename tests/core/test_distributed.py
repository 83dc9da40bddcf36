"""Data parallelism on torch.distributed (gloo, 2 processes on the CPU): sums over every
rank's data equal one process on all the data."""

from __future__ import annotations

import atexit
import datetime
import sys
import tempfile
import traceback
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

from fromp import distributed

WORLD = 2

pytestmark = pytest.mark.skipif(
    not torch.distributed.is_available() or sys.platform == "win32",
    reason="torch.distributed (gloo) is not available",
)


def _serve(rank: int, init_file: str, jobs, results) -> None:
    """A rank of the pool: joins the gloo group once, then runs each job ``fn_name`` it is
    sent (a function of this module by name, or a module-level function of another test
    module) as ``fn_name(rank)`` from the state of a fresh process (default dtype, seed,
    grad mode, one thread) and sends back ``(rank, "ok" | "error", torch.save'd bytes)``."""
    import io

    torch.set_num_threads(1)
    seed = torch.initial_seed()  # what a fresh process draws from
    torch.distributed.init_process_group(
        "gloo", init_method=f"file://{init_file}", rank=rank, world_size=WORLD,
        timeout=datetime.timedelta(seconds=120),
    )  # fmt: skip
    while (fn_name := jobs.get()) is not None:
        torch.set_default_dtype(torch.float32)
        torch.manual_seed(seed)
        torch.set_grad_enabled(True)
        buf = io.BytesIO()
        try:
            fn = globals()[fn_name] if isinstance(fn_name, str) else fn_name
            torch.save(fn(rank), buf)
            kind = "ok"
        except BaseException:
            buf = io.BytesIO(traceback.format_exc().encode())
            kind = "error"
        results.put((rank, kind, buf.getvalue()))
    torch.distributed.destroy_process_group()


class _Pool:
    """``WORLD`` processes in one gloo group, started once per test process and reused by
    every test that runs functions on the ranks (starting two interpreters that import
    torch and fromp costs more than most of these tests' work). A failed or stuck job closes
    the pool (the next job starts a new one): its ranks may be left inside a collective."""

    def __init__(self) -> None:
        ctx = mp.get_context("spawn")
        self.tmp = tempfile.TemporaryDirectory()
        init = str(Path(self.tmp.name) / "init")
        self.jobs = [ctx.Queue() for _ in range(WORLD)]
        self.results = ctx.Queue()
        self.procs = [
            ctx.Process(target=_serve, args=(r, init, self.jobs[r], self.results), daemon=True)
            for r in range(WORLD)
        ]
        for proc in self.procs:
            proc.start()

    def run(self, fn_name, timeout: float = 600.0) -> list:
        import io
        import queue

        for q in self.jobs:
            q.put(fn_name)
        got: dict[int, tuple[str, bytes]] = {}
        try:
            while len(got) < WORLD:
                rank, kind, payload = self.results.get(timeout=timeout)
                got[rank] = (kind, payload)
                if kind == "error":
                    raise AssertionError(f"rank {rank} failed:\n{payload.decode()}")
        except queue.Empty:
            self.close()
            raise AssertionError(f"the ranks did not answer within {timeout:.0f} s") from None
        except BaseException:
            self.close()
            raise
        return [torch.load(io.BytesIO(got[r][1]), weights_only=False) for r in range(WORLD)]

    def close(self) -> None:
        global _POOL
        for proc in self.procs:
            proc.kill()
            proc.join(10)
        self.tmp.cleanup()
        _POOL = None


_POOL: _Pool | None = None


def run_ranks(fn_name) -> list:
    """Each rank's return value of ``fn_name(rank)`` (a name in this module or a module-level
    function), run on the ``WORLD`` ranks of one gloo group."""
    global _POOL
    if _POOL is None:
        _POOL = _Pool()
        atexit.register(lambda: _POOL is not None and _POOL.close())
    return _POOL.run(fn_name)


# ----------------------------------------------------------------------- rank functions
def _sums(rank: int) -> dict:
    a = torch.arange(6.0).reshape(2, 3) * (rank + 1)  # rank 0: x, rank 1: 2x
    b = torch.tensor([rank + 1], dtype=torch.int64)
    c = torch.full((4,), 0.5 * (rank + 1), dtype=torch.float64)
    distributed.all_reduce_sum([a, b, c])
    return {"a": a, "b": b, "c": c, "world": distributed.world_size(), "rank": distributed.rank()}


def _fold_order(rank: int) -> dict:
    obj = {"seq": [rank], "t": torch.tensor([float(rank)])}
    out = distributed.fold(
        obj, lambda u, v: {"seq": u["seq"] + v["seq"], "t": u["t"] * 10 + v["t"]}
    )
    return out


# ----------------------------------------------------------------------- tests
def test_single_process_is_a_no_op():
    a = torch.ones(3)
    distributed.all_reduce_sum([a])
    assert torch.equal(a, torch.ones(3))
    assert distributed.fold(5, lambda u, v: u + v) == 5
    assert not distributed.is_distributed()
    assert distributed.world_size() == 1 and distributed.rank() == 0


def test_all_reduce_sum_over_two_ranks():
    res = run_ranks("_sums")
    want_a = torch.arange(6.0).reshape(2, 3) * 3  # x + 2x
    for r, out in enumerate(res):
        assert out["world"] == WORLD and out["rank"] == r
        torch.testing.assert_close(out["a"], want_a, rtol=0, atol=0)
        assert out["b"].tolist() == [3] and out["b"].dtype == torch.int64
        torch.testing.assert_close(out["c"], torch.full((4,), 1.5, dtype=torch.float64))


def test_fold_combines_in_rank_order_on_every_rank():
    """A non-commutative combine shows the order: rank 0 first, then rank 1."""
    res = run_ranks("_fold_order")
    for out in res:
        assert out["seq"] == [0, 1]
        assert out["t"].tolist() == [1.0]  # 0 * 10 + 1


# ----------------------------------------------------------------------- Laplace.fit
def _laplace_data(n: int = 24) -> tuple:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, 4, generator=g, dtype=torch.float64)
    y = torch.randint(0, 3, (n,), generator=g)
    return x, y


def _laplace_model() -> torch.nn.Module:
    torch.manual_seed(0)
    net = torch.nn.Sequential(
        torch.nn.Linear(4, 5), torch.nn.Tanh(), torch.nn.Linear(5, 3)
    ).double()
    return net.eval()


def _laplace_fit(
    rank: int | None, structure: str, n: int = 24, shuffle: bool = False, subset: str = "all"
) -> dict:
    """A Laplace fit on the rank's shard (a DistributedSampler's split), or on all the data
    in one process when ``rank`` is None."""
    from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

    from fromp import Laplace

    x, y = _laplace_data(n)
    data = TensorDataset(x, y)
    if rank is None:
        loader = DataLoader(data, batch_size=5)
    else:
        sampler = DistributedSampler(data, num_replicas=WORLD, rank=rank, shuffle=shuffle)
        loader = DataLoader(data, batch_size=5, sampler=sampler)
    la = Laplace(_laplace_model(), "classification", subset, structure, prior_precision=0.7)
    la.fit(loader)
    return {
        "evidence": la.log_marginal_likelihood().detach(),
        "n_data": la.n_data,
        "variance": la.functional_variance_at(x[:6]).detach(),
    }


def _laplace_diag(rank: int) -> dict:
    return _laplace_fit(rank, "diag")


def _laplace_kron(rank: int) -> dict:
    return _laplace_fit(rank, "kron")


def _laplace_full(rank: int) -> dict:
    return _laplace_fit(rank, "full")


def _padded_diag(rank: int) -> dict:
    return _laplace_fit(rank, "diag", n=23, shuffle=True)


def _padded_last_layer_kron(rank: int) -> dict:
    return _laplace_fit(rank, "kron", n=23, subset="last_layer")


@pytest.mark.parametrize(("subset", "structure"), [("all", "diag"), ("last_layer", "kron")])
def test_laplace_fit_over_a_padded_distributed_sampler_equals_one_process(subset, structure):
    """N = 23 over 2 ranks: the sampler (drop_last=False) repeats one example to even the
    shards; the fit drops the repeat, so the posterior is one process's on the 23 examples
    (the fifth audit, N6: the repeat was counted, evidence -32.97 against -31.41)."""
    want = _laplace_fit(None, structure, n=23, subset=subset)
    name = "_padded_diag" if structure == "diag" else "_padded_last_layer_kron"
    for out in run_ranks(name):
        assert out["n_data"] == want["n_data"] == 23
        torch.testing.assert_close(out["evidence"], want["evidence"], rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(out["variance"], want["variance"], rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("structure", ["diag", "kron", "full"])
def test_laplace_fit_over_a_distributed_sampler_equals_one_process(structure):
    """Two ranks, each fitting its half of the data through a DistributedSampler: the
    evidence, the data count and the GLM variance equal one process fitting all the data."""
    want = _laplace_fit(None, structure)
    for out in run_ranks(f"_laplace_{structure}"):
        assert out["n_data"] == want["n_data"] == 24
        torch.testing.assert_close(out["evidence"], want["evidence"], rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(out["variance"], want["variance"], rtol=1e-10, atol=1e-12)
