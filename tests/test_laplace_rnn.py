"""Recurrent layers that ``torch.func.vmap`` cannot batch (``nn.GRU`` and ``nn.RNN`` write
their hidden state in place) go through per-example Jacobians one example at a time: the
diagonal GGN, the all-weights diagonal, full and low-rank Laplaces and the DNN2GP kernel
against dense float64 autograd (``nn.LSTM``, which vmap batches, as a control)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import fromp
from fromp import Laplace
from fromp.likelihood import CategoricalLikelihood
from fromp.testing import dense_jacobian, dense_nll_hessians, flat

F64 = torch.float64


class Recurrent(nn.Module):
    """A recurrent layer over 2 steps of 2 features, then a linear head on the last state."""

    def __init__(self, cell: type[nn.RNNBase]) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.rnn = cell(2, 3, batch_first=True)
        self.fc = nn.Linear(3, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(self.rnn(x.view(len(x), 2, 2))[0][:, -1])


def setup(cell):
    model = Recurrent(cell).double().eval()
    g = torch.Generator().manual_seed(1)
    x = torch.randn(9, 4, generator=g, dtype=F64)
    y = torch.randint(0, 3, (9,), generator=g)
    jac = dense_jacobian(model, x)
    with torch.no_grad():
        f = model(x)
    lam = dense_nll_hessians(CategoricalLikelihood(), f, y)
    return model, x, y, jac, torch.einsum("ncp,ncd,ndq->pq", jac, lam, jac)


CELLS = pytest.mark.parametrize("cell", [nn.GRU, nn.RNN, nn.LSTM], ids=["gru", "rnn", "lstm"])


@CELLS
def test_diag_ggn_of_a_recurrent_model(cell):
    model, x, _, _, g = setup(cell)
    torch.testing.assert_close(fromp.diag_ggn(model, x, "categorical"), torch.diagonal(g))


@CELLS
@pytest.mark.parametrize("structure", ["diag", "full", "lowrank"])
def test_all_weights_laplace_of_a_recurrent_model(cell, structure):
    model, x, y, jac, g = setup(cell)
    p = len(g)
    kw = {"low_rank": p} if structure == "lowrank" else {}
    la = Laplace(model, "classification", "all", structure, prior_precision=0.5, **kw)
    la.fit([(x, y)])
    prec = torch.diag(torch.diagonal(g)) if structure == "diag" else g
    cov = torch.linalg.inv(prec + 0.5 * torch.eye(p, dtype=F64))
    torch.testing.assert_close(la.posterior_variance, torch.diagonal(cov))
    want = torch.einsum("ncp,pq,ndq->ncd", jac[:4], cov, jac[:4])
    torch.testing.assert_close(la.functional_variance_at(x[:4]), want)
    assert torch.isfinite(la.log_marginal_likelihood())


@CELLS
def test_dnn2gp_kernel_of_a_recurrent_model(cell):
    model, x, _, jac, g = setup(cell)
    q = fromp.DiagonalGaussian(flat(model), torch.diagonal(g) + 1.0)
    gp = fromp.dnn2gp(model, q, "categorical")
    want = torch.einsum("ncp,p,mdp->ncmd", jac[:3], 1 / q.precision, jac[5:])
    torch.testing.assert_close(gp.kernel(x[:3], x[5:]), want)


@pytest.mark.parametrize("structure", ["diag", "full"])
def test_subnetwork_of_a_recurrent_model(structure):
    model, x, y, _, _ = setup(nn.GRU)
    Laplace(model, "classification", "subnetwork", structure,
            subnetwork_indices=torch.arange(0, 20, 2)).fit([(x, y)])  # fmt: skip


def test_random_modules_still_refused_by_the_batched_jacobians():
    """The per-example fallback is for batching limits only: dropout in train mode still
    raises (a loop would silently draw one dropout mask per example)."""
    model = nn.Sequential(nn.Linear(4, 5), nn.Dropout(0.5), nn.Linear(5, 3)).train()
    with pytest.raises(RuntimeError, match="random"):
        fromp.jacobians(model, torch.randn(3, 4))
