"""The one last-layer module (fromp.curvature.last_layer): the output layer's features found
and checked by one forward pass, recorded over training passes, ``[phi, 1]``, and the one
last-layer GGN that the full last-layer Laplace and leave-one-out share, against dense
float64 Jacobians of the network with respect to its head."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from fromp import Laplace
from fromp.curvature.last_layer import (
    augment_features,
    last_layer_forward,
    last_layer_ggn,
    last_linear,
    record_last_linear,
)
from fromp.likelihood import get_likelihood

F64 = torch.float64


def _net(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 3)).double().eval()


def test_forward_gives_the_outputs_the_head_and_its_inputs():
    net = _net()
    x = torch.randn(7, 4, dtype=F64)
    f, phi, head = last_layer_forward(net, x)
    assert head is net[2]
    torch.testing.assert_close(phi, torch.tanh(net[0](x)).detach())
    torch.testing.assert_close(f, net(x).detach())
    assert not phi.requires_grad and not f.requires_grad
    f2, phi2, _ = last_layer_forward(net, x, net[2], check=False)  # a layer already known
    torch.testing.assert_close((f2, phi2), (f, phi))
    assert last_linear(net, x) == ("2", net[2])
    assert last_linear(nn.Sequential(nn.Tanh()), x) is None


class _Pair(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.head = nn.Linear(4, 3)

    def forward(self, x):
        f = self.head(x)
        return f, f.sum(1)


@pytest.mark.parametrize(
    "model,layer,match",
    [
        (nn.Sequential(nn.Linear(4, 3), nn.Softmax(-1)), None, "transforms it further"),
        (nn.Sequential(nn.Tanh()), None, "has none"),
        (nn.Sequential(nn.Linear(4, 3), nn.Tanh(), nn.Linear(3, 2)), 0, "that layer's output"),
        (nn.Sequential(nn.Linear(4, 3)), nn.Linear(3, 3), "is not called"),
        (_Pair(), None, r"must return a \[N, C\] tensor of outputs, got a tuple"),
    ],
    ids=["softmax", "no-linear", "inner-layer", "not-called", "tuple"],
)
def test_a_model_not_ending_in_its_linear_head_is_refused(model, layer, match):
    if isinstance(layer, int):
        layer = model[layer]
    with pytest.raises(ValueError, match=match):
        last_layer_forward(model.eval(), torch.randn(3, 4), layer)


def test_recording_keeps_the_last_call_of_each_pass_in_the_graph_and_removes_its_hooks():
    net = _net().train()
    x1, x2 = torch.randn(3, 4, dtype=F64), torch.randn(6, 4, dtype=F64)
    with record_last_linear(net) as rec:
        assert rec.head is None
        net(x1)
        net(x2).sum().backward()
        assert rec.head is net[2] and rec.phi.shape == (6, 5) and rec.phi.requires_grad
        torch.testing.assert_close(rec.out, net[2](rec.phi))
        rec.clear()
        assert rec.head is None and rec.phi is None
    assert not any(m._forward_hooks for m in net.modules())


def test_one_last_layer_ggn_for_the_full_last_layer_laplace():
    """``la.posterior_precision - delta I`` of the full last-layer Laplace is
    :func:`last_layer_ggn` of ``[phi, 1]`` (in the flat order ``(W row-major, b)``), which is
    ``sum_n J_n^T Lambda_n J_n`` with ``J_n`` the network's Jacobian in its head, by
    ``torch.func.jacrev``; the sum over two batches equals the one over their union."""
    net = _net(1)
    x = torch.randn(11, 4, dtype=F64)
    y = torch.randint(0, 3, (11,))
    lik = get_likelihood("categorical")
    head = net[2]
    params = {"weight": head.weight.detach(), "bias": head.bias.detach()}

    def f_of(p):
        return torch.func.functional_call(net, {f"2.{k}": v for k, v in p.items()}, (x,))

    jac = torch.func.jacrev(f_of)(params)
    j = torch.cat([jac["weight"].flatten(2), jac["bias"].flatten(2)], 2)  # [N, C, P]
    f = net(x).detach()
    dense = torch.einsum("ncp,nck,nkq->pq", j, lik.hessian(f), j)
    la = Laplace(net, "classification", "last_layer", "full", prior_precision=1.0)
    la.fit([(x[:5], y[:5]), (x[5:], y[5:])])
    eye = torch.eye(len(dense), dtype=F64)
    torch.testing.assert_close(la.posterior_precision - eye, dense, rtol=1e-10, atol=1e-12)
    phi = torch.tanh(net[0](x)).detach()
    internal = last_layer_ggn(augment_features(phi, True), f, lik)  # [W | b] row-major
    c, d1 = 3, 6
    perm = torch.cat([torch.arange(c * d1).view(c, d1)[:, :-1].flatten(), torch.arange(c) * d1 + 5])
    torch.testing.assert_close(internal[perm][:, perm], dense, rtol=1e-10, atol=1e-12)
    assert torch.equal(augment_features(phi, False), phi)
    torch.testing.assert_close(augment_features(phi, True)[:, -1], torch.ones(11, dtype=F64))
