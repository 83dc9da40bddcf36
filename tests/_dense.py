"""Brute-force dense float64 references for the tests, written independently of ``fromp``'s
torch.func code paths: Jacobians through ``torch.autograd.functional.jacobian`` of the
batched forward pass with respect to one flat parameter vector, GGNs and kernels by
explicit per-example sums, and small test networks (an MLP, a CNN with weight sharing and a
batch-norm layer that is always put in eval mode)."""

from __future__ import annotations

import torch
from torch import Tensor, nn
from torch.func import functional_call


def flat(model: nn.Module) -> Tensor:
    """Trainable parameters of ``model`` flattened in ``named_parameters()`` order."""
    return torch.cat([p.detach().reshape(-1) for p in model.parameters() if p.requires_grad])


def split(model: nn.Module, w: Tensor) -> dict[str, Tensor]:
    """A flat vector ``w [P]`` as a parameter dict of ``model`` (differentiable in ``w``)."""
    out, i = {}, 0
    for name, p in model.named_parameters():
        if p.requires_grad:
            out[name] = w[i : i + p.numel()].view_as(p)
            i += p.numel()
    assert i == w.numel()
    return out


def forward_at(model: nn.Module, w: Tensor, x: Tensor) -> Tensor:
    """``f_w(x) [N, C]`` with the flat weights ``w`` (buffers from the module)."""
    return functional_call(model, (split(model, w), dict(model.named_buffers())), (x,))


def dense_jacobian(model: nn.Module, x: Tensor, w: Tensor | None = None) -> Tensor:
    """``J [N, C, P]`` by ``torch.autograd.functional.jacobian`` of the batched forward pass."""
    w = flat(model) if w is None else w
    return torch.autograd.functional.jacobian(lambda v: forward_at(model, v, x), w)


def dense_nll_hessians(lik, f: Tensor, y: Tensor) -> Tensor:
    """``d^2 nll(f_n, y_n) / d f_n^2`` ``[N, C, C]``, one autograd Hessian per example."""
    return torch.stack(
        [
            torch.autograd.functional.hessian(
                lambda fi, yi=y[i : i + 1]: lik.nll(fi.unsqueeze(0), yi).sum(), f[i]
            )
            for i in range(len(f))
        ]
    )


def dense_ggn(model: nn.Module, x: Tensor, lik, w: Tensor | None = None) -> Tensor:
    """``sum_n J_n^T Lambda_n J_n`` ``[P, P]`` with ``Lambda_n`` the autograd Hessian of the
    nll in ``f`` (targets drawn arbitrarily: the Hessian does not depend on them for the
    likelihoods tested)."""
    w = flat(model) if w is None else w
    jac = dense_jacobian(model, x, w)
    with torch.no_grad():
        f = forward_at(model, w, x)
    y = lik.sample(f)
    lam = dense_nll_hessians(lik, f, y)
    out = torch.zeros(w.numel(), w.numel(), dtype=w.dtype)
    for n in range(len(x)):
        out += jac[n].T @ lam[n] @ jac[n]
    return out


def dense_kernel(j1: Tensor, cov: Tensor, j2: Tensor) -> Tensor:
    """``K[n, c, m, d] = J1[n, c] Sigma J2[m, d]^T`` with a dense ``Sigma [P, P]``."""
    return torch.einsum("ncp,pq,mdq->ncmd", j1, cov, j2)


def tiny_mlp(d_in: int = 4, hidden: int = 5, c: int = 3) -> nn.Module:
    return nn.Sequential(nn.Linear(d_in, hidden), nn.Tanh(), nn.Linear(hidden, c)).double()


class TinyCNN(nn.Module):
    """Conv (weight sharing) -> BatchNorm (eval) -> ReLU -> conv -> pool -> linear; input
    ``[N, 1, 6, 6]``; BN statistics randomised so that eval mode is not the identity."""

    def __init__(self, c: int = 3) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(1, 2, 3, padding=1)
        self.bn = nn.BatchNorm2d(2)
        self.conv2 = nn.Conv2d(2, 2, 3)
        self.fc = nn.Linear(2 * 2 * 2, c)
        with torch.no_grad():
            self.bn.running_mean.uniform_(-0.5, 0.5)
            self.bn.running_var.uniform_(0.5, 2.0)
            self.bn.weight.uniform_(0.5, 1.5)
            self.bn.bias.uniform_(-0.5, 0.5)

    def forward(self, x: Tensor) -> Tensor:
        h = torch.relu(self.bn(self.conv1(x)))
        h = torch.nn.functional.max_pool2d(torch.tanh(self.conv2(h)), 2)
        return self.fc(h.flatten(1))


def tiny_cnn(c: int = 3) -> nn.Module:
    return TinyCNN(c).double().eval()
