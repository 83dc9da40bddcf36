"""``hessian_structure="kron"`` on networks with normalisation layers (a ResNet's batch norm):
KFAC blocks for ``Linear`` / ``Conv2d`` and exact GGN-diagonal blocks for the normalisation
parameters, against dense float64 autograd: the precision, the evidence, the kernel, the
sampling square root and the variances; FROMP's Kronecker kernel on such a network."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from fromp import FROMPMethod, Laplace
from fromp.curvature.kron import kron_curvature
from fromp.likelihood import CategoricalLikelihood
from fromp.testing import dense_ggn, dense_jacobian

F64 = torch.float64


def _bn_mlp() -> nn.Module:
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4), nn.Tanh(), nn.Linear(4, 3))
    with torch.no_grad():  # running statistics and affine parameters away from the defaults
        net[1].running_mean.normal_()
        net[1].running_var.uniform_(0.5, 2.0)
        net[1].weight.uniform_(0.5, 1.5)
        net[1].bias.normal_()
    return net.to(F64).eval()


def _blockdiag_precision(net: nn.Module, g: torch.Tensor, delta: float) -> torch.Tensor:
    """The dense reference: each ``Linear`` tensor's full GGN block, each batch-norm
    tensor's GGN diagonal, no cross-tensor terms, plus ``delta``."""
    out = torch.zeros_like(g)
    k = 0
    for name, p in net.named_parameters():
        s = slice(k, k + p.numel())
        block = g[s, s]
        out[s, s] = torch.diag(torch.diagonal(block)) if name.startswith("1.") else block
        k += p.numel()
    return out + delta * torch.eye(len(g), dtype=g.dtype)


def test_one_example_kfac_and_norm_diagonal_against_dense():
    net = _bn_mlp()
    x, y = torch.randn(1, 3, dtype=F64), torch.tensor([1])
    delta = 0.7
    la = Laplace(net, "classification", "all", "kron", prior_precision=delta).fit((x, y))
    assert sorted(la.H.diag) == ["1.bias", "1.weight"]
    g = dense_ggn(net, x, CategoricalLikelihood())
    prec = _blockdiag_precision(net, g, delta)
    torch.testing.assert_close(torch.block_diag(*la.posterior_precision), prec)
    cov = torch.linalg.inv(prec)
    torch.testing.assert_close(la.posterior_covariance, cov)
    torch.testing.assert_close(la.posterior_variance, torch.diagonal(cov))
    root = la._sqrt_cov_times(torch.eye(len(cov), dtype=F64))  # rows: (S e_i)^T
    torch.testing.assert_close(root.T @ root, cov)
    # the evidence: log p(y|w) - delta/2 |w|^2 - 1/2 (log det P - P log delta)
    w = torch.cat([p.detach().reshape(-1) for p in net.parameters()])
    nll = CategoricalLikelihood().nll(net(x), y).sum()
    want = -nll - 0.5 * delta * w @ w - 0.5 * (torch.logdet(prec) - len(w) * math.log(delta))
    torch.testing.assert_close(la.log_marginal_likelihood().detach(), want.detach())
    # the kernel and the functional variance: J Sigma J^T
    xs = torch.randn(4, 3, dtype=F64)
    jac = dense_jacobian(net, xs)
    torch.testing.assert_close(la.gp().kernel(xs), torch.einsum("ncp,pq,mdq->ncmd", jac, cov, jac))
    torch.testing.assert_close(
        la.functional_variance_at(xs), torch.einsum("ncp,pq,ndq->ncd", jac, cov, jac)
    )


def test_norm_diagonal_is_exact_over_many_examples_on_a_cnn():
    """The batch-norm blocks are the exact GGN diagonal over all examples and batches (KFAC
    is exact only for the layers' Kronecker blocks of one example)."""
    torch.manual_seed(1)
    net = nn.Sequential(
        nn.Conv2d(2, 3, 3, padding=1), nn.BatchNorm2d(3), nn.ReLU(), nn.Conv2d(3, 2, 3),
        nn.GroupNorm(1, 2), nn.Flatten(), nn.Linear(2 * 3 * 3, 3),
    ).to(F64)  # fmt: skip
    with torch.no_grad():
        net[1].running_mean.normal_()
        net[1].running_var.uniform_(0.5, 2.0)
    net.eval()
    x = torch.randn(9, 2, 5, 5, dtype=F64)
    curv = kron_curvature(net, [(x[:4], None), (x[4:], None)], CategoricalLikelihood())
    g = torch.diagonal(dense_ggn(net, x, CategoricalLikelihood()))
    k, want = 0, {}
    for name, p in net.named_parameters():
        want[name] = g[k : k + p.numel()].view_as(p)
        k += p.numel()
    assert sorted(curv.diag) == ["1.bias", "1.weight", "4.bias", "4.weight"]
    for name, h in curv.diag.items():
        torch.testing.assert_close(h, want[name])
    both = curv + curv  # data added twice: the diagonal doubles with the B sums
    torch.testing.assert_close(both.diag["1.weight"], 2 * want["1.weight"])
    assert type(curv).from_state_dict(curv.state_dict()).diag.keys() == curv.diag.keys()


def test_fromp_kron_kernel_on_a_batch_norm_network_matches_dense():
    net = _bn_mlp()
    x, y = torch.randn(1, 3, dtype=F64), torch.tensor([0])
    delta = 0.4
    method = FROMPMethod(tau=1.0, n_points=1, posterior="kron", prior_precision=delta)
    method.learn_task(net, x, y, None)
    cov = torch.linalg.inv(
        _blockdiag_precision(net, dense_ggn(net, x, CategoricalLikelihood()), delta)
    )
    jf = dense_jacobian(net, x)
    p = torch.softmax(net(x), -1).detach()
    a = torch.diag_embed(p) - p[:, :, None] * p[:, None, :]
    jp = torch.einsum("mca,map->mcp", a, jf)
    want = torch.einsum("mcp,pq,ncq->cmn", jp, cov, jp)[[0]]  # the one class trained
    mem = method.regularizer.memories[0]
    k = mem.chol @ mem.chol.transpose(-1, -2) - mem.jitter * torch.eye(1, dtype=F64)
    torch.testing.assert_close(k, want, rtol=1e-8, atol=1e-12)
    assert float(method.penalty(net).detach()) == pytest.approx(0.0, abs=1e-12)


def test_a_factor_the_solver_cannot_decompose_is_retried_in_float64(monkeypatch):
    """LAPACK's eigh can fail on a large factor with many equal eigenvalues (a ResNet layer
    fitted on few inputs); the retry in float64 with a tiny diagonal ramp gives the same
    decomposition up to 1e-10 relative."""
    from fromp.curvature import kron

    monkeypatch.setattr(kron, "_eigh_mrrr", lambda sym: None)  # (its own test: fast paths)
    u = torch.randn(50, 3, dtype=torch.float32)
    m = u @ u.T
    real = torch.linalg.eigh

    def failing_once(failure: str, calls: list):
        def eigh(a, *args, **kwargs):
            calls.append(a.dtype)
            if len(calls) == 1 and failure == "raise":
                raise torch.linalg.LinAlgError("linalg.eigh: The algorithm failed to converge")
            vals, vecs = real(a, *args, **kwargs)
            return (vals * float("nan"), vecs) if len(calls) == 1 else (vals, vecs)

        return eigh

    for failure in ("raise", "nan"):
        calls: list = []
        monkeypatch.setattr(torch.linalg, "eigh", failing_once(failure, calls))
        vals, vecs = kron._eigh(m)
        assert calls == [torch.float32, torch.float64] and vals.dtype == torch.float32
        torch.testing.assert_close(vecs @ torch.diag(vals) @ vecs.T, m, rtol=1e-5, atol=1e-4)
    monkeypatch.setattr(torch.linalg, "eigh", lambda a: (a[0] * float("nan"), a))
    with pytest.raises(FloatingPointError, match="not finite even in float64"):
        kron._eigh(m)
