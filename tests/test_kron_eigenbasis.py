"""The all-weights Kronecker Laplace in its factors' eigenbases, against dense float64 KFAC
built here by definition (``A = (1/(N L)) sum u u^T`` from the unfolded layer inputs, ``B =
sum_n sum_ll' Jz^T Lambda Jz`` from autograd Jacobians of the output in the layer's output),
on layers with 3 and 4 output channels: a rotation with ``Q_B`` where ``Q_B^T`` belongs (or
``Q_A`` for ``Q_A^T``) changes every number below, while with 2 output channels ``Q_B`` can be
a symmetric reflection and hide it. The convolutions take both code paths of the rotated
Jacobian rows (rotating the product ``Q_B^T (g u^T) Q_A``, and the rotated factors
``(Q_B^T g)(Q_A^T u)^T``), the linear head the factored one."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from fromp import Laplace
from fromp.likelihood import CategoricalLikelihood
from fromp.testing import dense_jacobian, dense_nll_hessians

F64 = torch.float64
DELTA = 0.3


def cnn() -> nn.Sequential:
    """conv 1->3 (25 positions: the product is rotated), conv 3->4 stride 2 (4 positions:
    the factors are rotated), linear 16->3."""
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(1, 3, 3, padding=1), nn.Tanh(), nn.Conv2d(3, 4, 3, stride=2), nn.Tanh(),
        nn.Flatten(), nn.Linear(16, 3),
    ).to(F64).eval()  # fmt: skip


def mlp() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 5)).to(F64).eval()


def inputs(model: nn.Sequential, n: int = 7) -> torch.Tensor:
    g = torch.Generator().manual_seed(3)
    shape = (1, 5, 5) if isinstance(model[0], nn.Conv2d) else (4,)
    return torch.randn(n, *shape, generator=g, dtype=F64)


def dense_kfac_precision(model: nn.Sequential, x: torch.Tensor, delta: float) -> torch.Tensor:
    """``blockdiag(B (x) A + delta I, B_bias + delta I, ...)`` in parameter order."""
    blocks = []
    for i, m in enumerate(model):
        if not isinstance(m, nn.Linear | nn.Conv2d):
            continue
        head, tail = model[:i], model[i + 1 :]
        with torch.no_grad():
            a = head(x)
            z = m(a)
            f = tail(z)
        lam = dense_nll_hessians(CategoricalLikelihood(), f, torch.zeros(len(x), dtype=torch.long))
        jz = torch.stack([
            torch.autograd.functional.jacobian(lambda zz, t=tail: t(zz.unsqueeze(0))[0], z[n])
            for n in range(len(x))
        ])  # [N, C, *z]  # fmt: skip
        if isinstance(m, nn.Conv2d):
            u = nn.functional.unfold(a, m.kernel_size, padding=m.padding, stride=m.stride)
            u = u.transpose(1, 2)  # [N, L, in k k]
            jz = jz.flatten(3)  # [N, C, out, L]
        else:
            u, jz = a.unsqueeze(1), jz.unsqueeze(-1)
        amat = torch.einsum("nli,nlj->ij", u, u) / (len(x) * u.shape[1])
        # weight: B sums g g^T over examples and positions; bias (exact): over examples of
        # the position-summed gradients
        bmat = torch.einsum("ncol,ncd,ndpl->op", jz, lam, jz)
        bias = torch.einsum("ncol,ncd,ndpk->op", jz, lam, jz)
        blocks += [torch.kron(bmat, amat), bias]
    prec = torch.block_diag(*blocks)
    return prec + delta * torch.eye(len(prec), dtype=F64)


@pytest.fixture(params=["cnn", "mlp"])
def case(request):
    model = cnn() if request.param == "cnn" else mlp()
    x = inputs(model)
    g = torch.Generator().manual_seed(4)
    y = torch.randint(0, model[-1].out_features, (len(x),), generator=g)
    la = Laplace(model, "classification", "all", "kron", prior_precision=DELTA).fit([(x, y)])
    cov = torch.linalg.inv(dense_kfac_precision(model, x, DELTA))
    return model, x, la, cov


def test_eigenvectors_are_not_symmetric(case):
    """The test would not see ``Q_B`` for ``Q_B^T`` if every ``Q_B`` were symmetric."""
    _, _, la, _ = case
    asym = [float((q - q.T).abs().max()) for q in la._eig.qb]
    assert min(asym) > 1e-3 and all(len(q) >= 3 for q in la._eig.qb)


def test_functional_variance_and_kernel_match_dense_kfac(case):
    model, x, la, cov = case
    jac = dense_jacobian(model, x[:4])
    expected = torch.einsum("ncp,pq,mdq->ncmd", jac, cov, jac)
    torch.testing.assert_close(
        la.functional_variance_at(x[:4]), torch.stack([expected[n, :, n] for n in range(4)])
    )
    torch.testing.assert_close(la.gp().kernel(x[:4]), expected)
    j2 = dense_jacobian(model, x[4:])
    torch.testing.assert_close(
        la.gp().kernel(x[:4], x[4:]), torch.einsum("ncp,pq,mdq->ncmd", jac, cov, j2)
    )


def test_posterior_variance_and_square_root_match_dense_kfac(case):
    _, _, la, cov = case
    torch.testing.assert_close(la.posterior_variance, torch.diagonal(cov))
    root = la._sqrt_cov_times(torch.eye(len(cov), dtype=F64))  # rows R^T: R R^T = Sigma
    torch.testing.assert_close(root.T @ root, cov)


def test_log_det_matches_dense_kfac(case):
    _, _, la, cov = case
    expected = -torch.logdet(cov) - len(cov) * torch.log(torch.tensor(DELTA, dtype=F64))
    torch.testing.assert_close(la.log_det_ratio, expected)
