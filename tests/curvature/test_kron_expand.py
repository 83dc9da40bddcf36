"""The KFAC of a convolution against the dense GGN (float64 autograd): the positions are
averaged in ``A`` (KFAC-expand, ``A = (1/(N L)) sum u u^T``), so the Kronecker block is exact
where expand is exact and has the GGN's scale on a small CNN; summing the positions instead
made every convolution's block ``L`` times too large."""

from __future__ import annotations

import torch
from torch import nn

from fromp import Laplace
from fromp.curvature.kron import kron_curvature
from fromp.likelihood import CategoricalLikelihood
from fromp.testing import dense_ggn

F64 = torch.float64


class _Corner(nn.Module):
    """``[N, C, H, W] -> [N, C]``: the output at position (0, 0) only."""

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        return z[:, :, 0, 0]


def test_conv_kfac_exact_for_one_example_with_equal_patches():
    """One example whose input is constant in space (every patch ``u_l`` equal) and a loss
    that reads one output position: the GGN of the convolution's weight is exactly
    ``g g^T (x) u u^T`` and equals ``B (x) A``; the posterior precision is that plus delta."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(2, 3, 3), _Corner(), nn.Tanh(), nn.Linear(3, 4))
    model = model.to(F64).eval()
    x = torch.ones(1, 2, 5, 5, dtype=F64) * torch.tensor([0.7, -1.3], dtype=F64).view(1, 2, 1, 1)
    y = torch.tensor([2])
    g = dense_ggn(model, x, CategoricalLikelihood())
    p_w = model[0].weight.numel()
    la = Laplace(model, "classification", "all", "kron", prior_precision=0.5).fit((x, y))
    prec_w = la.posterior_precision[0]
    torch.testing.assert_close(prec_w, g[:p_w, :p_w] + 0.5 * torch.eye(p_w, dtype=F64))


def test_conv_kfac_has_the_ggn_scale():
    """On a small CNN the trace of each convolution's ``B (x) A`` is within a factor 2 of
    the trace of the exact GGN block (it was ``L`` = 25 and 4 times too large)."""
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Conv2d(2, 3, 3, padding=1), nn.Tanh(), nn.Conv2d(3, 3, 3, stride=2), nn.Tanh(),
        nn.Flatten(), nn.Linear(12, 4),
    ).to(F64).eval()  # fmt: skip
    x = torch.randn(16, 2, 5, 5, dtype=F64, generator=torch.Generator().manual_seed(1))
    lik = CategoricalLikelihood()
    g = dense_ggn(model, x, lik)
    curv = kron_curvature(model, [(x[:7], None), (x[7:], None)], lik)
    k = 0
    for blk, conv in zip(curv.blocks, (model[0], model[2], model[5])):
        p = conv.weight.numel()
        ratio = float(torch.trace(g[k : k + p, k : k + p]) / (blk.B.trace() * blk.A.trace()))
        assert 0.5 < ratio < 2.0, ratio
        k += p + conv.bias.numel()
