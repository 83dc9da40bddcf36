"""IVON and VOGN on torch.distributed (gloo, 2 processes on the CPU): each rank steps on its
own shard of the global mini-batch (of different sizes: 5 and 11 examples), the optimizers
average the gradient and curvature statistics over the ranks weighted by the examples, and
every rank ends where one process on the global batch of 16 does (same noise on both ranks:
one seed). With a different seed per rank (IVON's multi-GPU runs) the ranks still make one
and the same update. Without torch.distributed nothing changes."""

from __future__ import annotations

import sys

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from fromp import IVON, VOGN, distributed
from fromp.optim import per_example_grad_stats
from tests.core.test_distributed import run_ranks

WORLD = 2
D = torch.float64
X = torch.randn(16, 4, generator=torch.Generator().manual_seed(0), dtype=D)
Y = torch.randint(0, 3, (16,), generator=torch.Generator().manual_seed(1))
SHARDS = (slice(0, 5), slice(5, 16))  # unequal: the weighting rule matters
STEPS = 3

pytestmark = pytest.mark.skipif(
    not torch.distributed.is_available() or sys.platform == "win32",
    reason="torch.distributed (gloo) is not available",
)


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 3)).to(D)


def _flat(model: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def _closure(opt, model, rows):
    def closure():
        opt.zero_grad()
        loss = F.cross_entropy(model(X[rows]), Y[rows])
        loss.backward()
        return loss

    return closure


def _vogn_run(rows, curvature: str, seed_of_step) -> dict:
    model = _mlp()
    opt = VOGN(model, lr=0.05, ess=16, prior_precision=2.0, hess_approx=curvature)
    for t in range(STEPS):
        torch.manual_seed(seed_of_step(t))
        opt.step(_closure(opt, model, rows))
    return {
        "mean": _flat(model),
        "s": torch.cat([opt.state[q]["hess"].reshape(-1) for q in opt.params]),
    }


def _vogn_two_phase_run(rows, seed_of_step) -> dict:
    """The two-phase step (Avalanche's loop): ``h`` and the rank's count ``M_r`` given to
    ``set_curvature``."""
    model = _mlp()
    opt = VOGN(model, lr=0.05, ess=16, prior_precision=2.0)
    for t in range(STEPS):
        torch.manual_seed(seed_of_step(t))
        opt.sample_params()
        _closure(opt, model, rows)()
        h = per_example_grad_stats(model, X[rows], Y[rows], "categorical").curv
        opt.set_curvature(h, batch_size=rows.stop - rows.start)
        opt.step()
    return {"mean": _flat(model)}


def _ivon_run(rows, seed_of_step, batch_size, sync=True) -> dict:
    model = _mlp()
    opt = IVON(model.parameters(), lr=0.1, ess=16, hess_init=0.3, mc_samples=2, sync=sync)
    for t in range(STEPS):
        torch.manual_seed(seed_of_step(t))
        opt.step(_closure(opt, model, rows), batch_size=batch_size)
    hess = torch.cat([opt.state[p]["hess"].reshape(-1) for p in model.parameters()])
    return {"mean": _flat(model), "hess": hess}


def _everything(rank: int) -> dict:
    rows = SHARDS[rank]
    n = rows.stop - rows.start
    return {
        "vogn_ef": _vogn_run(rows, "ef", lambda t: 10 + t),
        "vogn_ggn": _vogn_run(rows, "ggn", lambda t: 10 + t),
        "ivon": _ivon_run(rows, lambda t: 20 + t, n),
        "ivon_own_seed": _ivon_run(rows, lambda t: 100 * rank + t, n),
        "ivon_no_sync": _ivon_run(rows, lambda t: 20 + t, n, sync=False),
        "ivon_sync_unset": _refusal(lambda: _ivon_run(rows, lambda t: 20 + t, n, sync=None)),
        "vogn_two_phase": _vogn_two_phase_run(rows, lambda t: 10 + t),
        "ranks": (distributed.world_size(), distributed.rank()),
    }


def _refusal(run) -> str:
    """The message of the error ``run()`` raises (empty when it runs)."""
    try:
        run()
    except ValueError as err:
        return str(err)
    return ""


@pytest.fixture(scope="module")
def ranks() -> list[dict]:
    return run_ranks(_everything)


def _close(a: torch.Tensor, b: torch.Tensor) -> None:
    torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)


def test_the_ranks_ran_distributed(ranks):
    assert [r["ranks"] for r in ranks] == [(2, 0), (2, 1)]


@pytest.mark.parametrize("curvature", ["ef", "ggn"])
def test_vogn_on_two_ranks_equals_one_process_on_the_global_batch(ranks, curvature):
    one = _vogn_run(slice(0, 16), curvature, lambda t: 10 + t)
    for r in ranks:
        _close(r[f"vogn_{curvature}"]["mean"], one["mean"])
        _close(r[f"vogn_{curvature}"]["s"], one["s"])
    # the check can fail: one rank's shard alone gives another posterior
    alone = _vogn_run(SHARDS[0], curvature, lambda t: 10 + t)
    assert not torch.allclose(alone["s"], one["s"], rtol=1e-3)


def test_ivon_on_two_ranks_with_one_seed_equals_one_process_on_the_global_batch(ranks):
    one = _ivon_run(slice(0, 16), lambda t: 20 + t, None)
    for r in ranks:
        _close(r["ivon"]["mean"], one["mean"])
        _close(r["ivon"]["hess"], one["hess"])
    # equal weights instead of the examples' (5 and 11) would give another step
    equal = 0.5 * (
        _ivon_run(SHARDS[0], lambda t: 20 + t, None)["hess"]
        + _ivon_run(SHARDS[1], lambda t: 20 + t, None)["hess"]
    )
    assert not torch.allclose(equal, one["hess"], rtol=1e-6)


def test_vogn_two_phase_step_weighs_the_ranks_by_their_counts(ranks):
    one = _vogn_two_phase_run(slice(0, 16), lambda t: 10 + t)
    for r in ranks:
        _close(r["vogn_two_phase"]["mean"], one["mean"])


def test_ivon_without_sync_steps_each_rank_on_its_own(ranks):
    """``sync=False`` (ivon-opt's default): each rank is one process on its own shard;
    ``sync`` unset is refused under several processes, naming both choices."""
    for r, rows in zip(ranks, SHARDS):
        alone = _ivon_run(rows, lambda t: 20 + t, None)
        _close(r["ivon_no_sync"]["mean"], alone["mean"])
        _close(r["ivon_no_sync"]["hess"], alone["hess"])
        assert "sync=True" in r["ivon_sync_unset"] and "sync=False" in r["ivon_sync_unset"]


def test_ivon_with_a_seed_per_rank_makes_one_update_on_every_rank(ranks):
    a, b = ranks[0]["ivon_own_seed"], ranks[1]["ivon_own_seed"]
    torch.testing.assert_close(a["mean"], b["mean"], rtol=0, atol=0)
    torch.testing.assert_close(a["hess"], b["hess"], rtol=0, atol=0)
    assert not torch.equal(a["hess"], ranks[0]["ivon"]["hess"])  # other noise, other h


def test_without_torch_distributed_nothing_changes():
    assert not distributed.is_distributed()
    t = torch.tensor([1.0, 2.0])
    distributed.mean_over_ranks([t], 7)
    assert torch.equal(t, torch.tensor([1.0, 2.0]))
    a = _ivon_run(slice(0, 16), lambda t: 20 + t, None)
    b = _ivon_run(slice(0, 16), lambda t: 20 + t, 16)
    torch.testing.assert_close(a["mean"], b["mean"], rtol=0, atol=0)
    for sync in (None, False):  # sync has no effect in one process
        c = _ivon_run(slice(0, 16), lambda t: 20 + t, None, sync=sync)
        torch.testing.assert_close(a["mean"], c["mean"], rtol=0, atol=0)
