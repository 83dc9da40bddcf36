"""The posterior blocks of ``studies/loo_posteriors.py`` against dense float64:
``V_n = sum_l J_nl P_l^{-1} J_nl^T`` with each layer's precision ``P_l`` formed in full."""

import pytest
import torch
from torch import nn

from fromp.likelihood import get_likelihood
from studies.loo_posteriors import Block, rows

DELTA = 0.7


def _setup(n: int):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 4), nn.Tanh(), nn.Linear(4, 3), nn.Tanh(), nn.Linear(3, 3))
    model = model.double().eval()
    x = torch.randn(n, 5, dtype=torch.float64)
    f, _, data = rows(model, x)
    lam = get_likelihood("categorical").hessian(f)
    # dense per-example Jacobians of each layer's weight [N, C, out, in] and bias [N, C, out]
    params = dict(model.named_parameters())
    jac = torch.func.jacrev(lambda p: torch.func.functional_call(model, p, (x,)))(params)
    jw = [jac[f"{i}.weight"] for i in (0, 2, 4)]
    jb = [jac[f"{i}.bias"] for i in (0, 2, 4)]
    return data, lam, jw, jb


def _ggn(j: torch.Tensor, lam: torch.Tensor) -> torch.Tensor:
    """``sum_n J_n^T Lambda_n J_n`` of rows ``j [N, C, P]``."""
    return torch.einsum("ncp,ncd,ndq->pq", j, lam, j)


def _cov(j: torch.Tensor, prec: torch.Tensor) -> torch.Tensor:
    return torch.einsum("ncp,pq,ndq->ncd", j, torch.linalg.inv(prec), j)


def _eye(p: int) -> torch.Tensor:
    return torch.eye(p, dtype=torch.float64)


def test_kron_block_is_dense_kfac():
    """KFAC weight block ``B (x) A + delta`` (``A`` the mean, ``B`` the sum) and the exact
    bias block ``G_b + delta``."""
    data, lam, jw, jb = _setup(7)
    u, g = data[1]
    blk = Block("kron", u, g, (u, g, lam))
    a = u.T @ u / len(u)
    b = torch.einsum("nco,ncd,ndp->op", g, lam, g)
    w, bb = jw[1].flatten(2), jb[1]
    dense = _cov(w, torch.kron(b, a) + DELTA * _eye(len(b) * len(a))) + _cov(
        bb, _ggn(bb, lam) + DELTA * _eye(len(b))
    )
    torch.testing.assert_close(blk.cov(DELTA), dense)


def test_ekfac_eigenvalues_are_the_dense_diagonal_in_the_kronecker_basis():
    data, lam, jw, _ = _setup(7)
    u, g = data[0]
    blk = Block("ekfac", u, g, (u, g, lam))
    qa = torch.linalg.eigh(u.T @ u / len(u))[1]
    qb = torch.linalg.eigh(torch.einsum("nco,ncd,ndp->op", g, lam, g))[1]
    q = torch.kron(qb, qa)
    dense = q.T @ _ggn(jw[0].flatten(2), lam) @ q
    torch.testing.assert_close(blk.e.flatten(), dense.diagonal())


@pytest.mark.parametrize("layer", [0, 1])
def test_ekfac_is_the_exact_ggn_when_kronecker_is_exact(layer):
    """One example: the weight GGN is ``(G^T Lambda G) (x) u u^T``, Kronecker-exact, so
    EKFAC's covariance is the dense GGN posterior's."""
    data, lam, jw, jb = _setup(1)
    u, g = data[layer]
    blk = Block("ekfac", u, g, (u, g, lam))
    w, bb = jw[layer].flatten(2), jb[layer]
    dense = _cov(w, _ggn(w, lam) + DELTA * _eye(w.shape[-1]))
    dense = dense + _cov(bb, _ggn(bb, lam) + DELTA * _eye(bb.shape[-1]))
    torch.testing.assert_close(blk.cov(DELTA), dense)


def test_mixed_variance_is_the_dense_block_diagonal():
    """Exact last layer (weight and bias jointly) plus KFAC hidden blocks: the functional
    covariance of the block-diagonal dense precision."""
    data, lam, jw, jb = _setup(7)
    blocks = [Block("kron", u, g, (u, g, lam)) for u, g in data[:2]]
    u, g = data[2]
    blocks.append(Block("exact", u, g, (u, g, lam)))
    got = sum(b.cov(DELTA) for b in blocks)
    dense = 0.0
    for i in range(2):
        ui, gi = data[i]
        a = ui.T @ ui / len(ui)
        b = torch.einsum("nco,ncd,ndp->op", gi, lam, gi)
        w, bb = jw[i].flatten(2), jb[i]
        dense = dense + _cov(w, torch.kron(b, a) + DELTA * _eye(len(b) * len(a)))
        dense = dense + _cov(bb, _ggn(bb, lam) + DELTA * _eye(len(b)))
    # last layer: parameters ordered (class c, feature j), the bias as feature D
    last = torch.cat([jw[2], jb[2].unsqueeze(-1)], -1).flatten(2)  # [N, C, C (D+1)]
    dense = dense + _cov(last, _ggn(last, lam) + DELTA * _eye(last.shape[-1]))
    torch.testing.assert_close(got, dense)
