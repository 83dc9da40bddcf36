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


class Scale(nn.Module):
    """A parametrised layer with no capture rule: must go to the Jacobian fallback."""

    def __init__(self, n: int) -> None:
        super().__init__()
        self.s = nn.Parameter(torch.linspace(0.5, 1.5, n))

    def forward(self, x):
        return x * self.s.view(1, -1, *([1] * (x.ndim - 2)))


class ConvZoo(nn.Module):
    """Conv2d with stride/dilation/reflect padding, grouped conv with 'same' circular
    padding, BatchNorm2d (eval), GroupNorm, a 1x1-output conv (Gram route), Conv1d with
    stride, LayerNorm on a sequence, a sequence Linear, a Scale layer (fallback)."""

    def __init__(self, c: int = 3) -> None:
        super().__init__()
        self.c1 = nn.Conv2d(2, 4, 3, stride=2, dilation=1, padding=1, padding_mode="reflect")
        self.bn = nn.BatchNorm2d(4)
        self.c2 = nn.Conv2d(4, 4, 3, padding="same", dilation=2, groups=2, padding_mode="circular")
        self.gn = nn.GroupNorm(2, 4)
        self.scale = Scale(4)
        self.c3 = nn.Conv2d(4, 6, 4, stride=2, bias=False)  # 4x4 -> 1x1 output
        self.c1d = nn.Conv1d(1, 3, 3, stride=2, padding=1)  # on a 1-d view of the input
        self.ln = nn.LayerNorm(3)
        self.seq = nn.Linear(3, 2)
        self.fc = nn.Linear(6 + 2, c)
        with torch.no_grad():
            self.bn.running_mean.uniform_(-0.5, 0.5)
            self.bn.running_var.uniform_(0.5, 2.0)
            for norm in (self.bn, self.gn, self.ln):
                norm.weight.uniform_(0.5, 1.5)
                norm.bias.uniform_(-0.5, 0.5)

    def forward(self, x):
        h = torch.tanh(self.bn(self.c1(x)))  # B, 4, 4, 4
        h = torch.relu(self.scale(self.gn(self.c2(h))))
        h = torch.tanh(self.c3(h)).flatten(1)  # B, 6
        s = self.c1d(x[:, :1].flatten(2)[..., :15])  # B, 3, 8
        s = self.seq(torch.tanh(self.ln(s.transpose(1, 2)))).mean(1)  # B, 2
        return self.fc(torch.cat([h, s], 1))


def conv_zoo() -> nn.Module:
    return ConvZoo().double().eval()
