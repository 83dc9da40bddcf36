"""KFAC of a network whose layers are reached by different examples (a head per example,
chosen from its input, inside one batch and across batches): each layer's input factor
``A`` is the mean of ``u u^T`` over the examples that reached THAT layer, ``B`` the sum of
their output-gradient outer products, against dense per-example sums in float64. A layer's
``A`` divided by all the batch's examples (or all the data's) is off by ``N_h / N``."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from fromp import Laplace
from fromp.curvature.kron import kron_curvature
from fromp.likelihood import CategoricalLikelihood
from fromp.testing import dense_nll_hessians

F64 = torch.float64


class Routed(nn.Module):
    """A shared layer, then head 0 for examples with ``x_0 > 0`` and head 1 for the rest
    (each head called once per batch, on its examples only)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.body = nn.Linear(4, 5)
        self.h0 = nn.Linear(5, 3)
        self.h1 = nn.Linear(5, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        z = torch.tanh(self.body(x))
        route = x[:, 0] > 0
        out = z.new_zeros(len(x), 3)
        out[route] = self.h0(z[route])
        out[~route] = self.h1(z[~route])
        return out


def data(mixed: bool) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Two batches; 9 examples reach head 0 and 4 head 1 (unequal). ``mixed``: both heads in
    each batch; else one head per batch."""
    g = torch.Generator().manual_seed(2)
    x = torch.randn(13, 4, generator=g, dtype=F64)
    x[:, 0] = x[:, 0].abs() * torch.tensor([1.0] * 9 + [-1.0] * 4, dtype=F64)
    y = torch.randint(0, 3, (13,), generator=g)
    order = torch.randperm(13, generator=g) if mixed else torch.arange(13)
    x, y = x[order], y[order]
    cut = 6 if mixed else 9
    return [(x[:cut], y[:cut]), (x[cut:], y[cut:])]


def dense_factors(model: Routed, batches):
    """``{layer: (A, B)}`` by per-example sums; ``A`` over the examples reaching the layer."""
    x = torch.cat([b[0] for b in batches])
    with torch.no_grad():
        z = torch.tanh(model.body(x))
        f = model(x)
    lam = dense_nll_hessians(CategoricalLikelihood(), f, torch.zeros(len(x), dtype=torch.long))
    route = x[:, 0] > 0
    out = {}
    for name, mask in (("h0", route), ("h1", ~route)):
        u = z[mask]
        out[name] = (u.T @ u / len(u), lam[mask].sum(0))  # the head's output is f
    # the shared layer: d f / d (body pre-activation) = W_head diag(1 - z^2), per example
    w = torch.where(route[:, None, None], model.h0.weight, model.h1.weight).detach()  # [N, C, 5]
    jz = w * (1 - z**2)[:, None, :]
    out["body"] = (x.T @ x / len(x), torch.einsum("nco,ncd,ndp->op", jz, lam, jz))
    return out


@pytest.mark.parametrize("mixed", [False, True], ids=["head-per-batch", "heads-in-batch"])
def test_input_factor_is_the_mean_over_the_examples_that_reached_the_layer(mixed):
    model = Routed().double().eval()
    batches = data(mixed)
    expected = dense_factors(model, batches)
    curv = kron_curvature(model, batches, CategoricalLikelihood())
    la = Laplace(model, "classification", "all", "kron").fit(batches)
    names = [n[0].split(".")[0] for n in curv.names]
    assert names == ["body", "h0", "h1"]
    for c in (curv, la.H):
        for name, blk in zip(names, c.blocks):
            a, b = expected[name]
            torch.testing.assert_close(blk.A, a, msg=f"A of {name}")
            torch.testing.assert_close(blk.B, b, msg=f"B of {name}")
            torch.testing.assert_close(blk.B_bias, b, msg=f"B_bias of {name}")
        assert [blk.n for blk in c.blocks] == [13, 9, 4]


def test_added_curvatures_weight_each_layer_by_its_own_examples():
    """``fit(b1)`` then ``fit(b2, override=False)`` equals ``fit([b1, b2])`` (the sum of two
    KFAC terms weights a head's ``A`` by the examples that reached it in each)."""
    model = Routed().double().eval()
    b1, b2 = data(mixed=True)
    one = Laplace(model, "classification", "all", "kron").fit([b1, b2])
    two = Laplace(model, "classification", "all", "kron").fit([b1])
    two.fit([b2], override=False)
    for p, q in zip(one.H.blocks, two.H.blocks):
        torch.testing.assert_close(p.A, q.A)
        torch.testing.assert_close(p.B, q.B)
    torch.testing.assert_close(one.log_marginal_likelihood(), two.log_marginal_likelihood())
