"""Jacobians and their products (fromp.curvature.jacobian) against dense float64 autograd."""

from __future__ import annotations

import pytest
import torch

from fromp import jacobians, per_example_grads
from fromp.curvature.jacobian import iter_jacobians, jvp, unflatten, vjp_sum
from fromp.likelihood import CategoricalLikelihood
from fromp.models import MultiHeadMLP, with_task
from fromp.testing import dense_jacobian, flat
from tests.cases import tiny_cnn, tiny_mlp


def _multihead():
    net = MultiHeadMLP(4, (5,), n_heads=3, head_size=2).double()
    return with_task(net, 1)


CASES = {
    "mlp": (tiny_mlp, lambda n: torch.randn(n, 4, dtype=torch.float64)),
    "cnn_bn": (tiny_cnn, lambda n: torch.randn(n, 1, 6, 6, dtype=torch.float64)),
    "multihead": (_multihead, lambda n: torch.randn(n, 4, dtype=torch.float64)),
}


@pytest.fixture(params=sorted(CASES))
def case(request):
    make_model, make_x = CASES[request.param]
    return make_model(), make_x(5)


@pytest.mark.parametrize("chunk_size", [None, 1, 2])
def test_jacobians_match_dense(case, chunk_size):
    model, x = case
    ref = dense_jacobian(model, x)
    got = jacobians(model, x, chunk_size=chunk_size)
    assert got.shape == ref.shape
    torch.testing.assert_close(got, ref, rtol=1e-10, atol=1e-12)
    rows = [r for r, _ in iter_jacobians(model, x, chunk_size=2)]
    assert [(r.start, r.stop) for r in rows] == [(0, 2), (2, 4), (4, 5)]


def test_multihead_jacobian_zero_on_other_heads():
    model = _multihead()
    x = torch.randn(3, 4, dtype=torch.float64)
    jac = unflatten(model, jacobians(model, x))
    for name, block in jac.items():
        if "heads.0" in name or "heads.2" in name:
            assert torch.count_nonzero(block) == 0
        if "heads.1" in name:
            assert torch.count_nonzero(block) > 0


def test_jvp_and_vjp_sum_match_dense(case):
    model, x = case
    ref = dense_jacobian(model, x)
    v = torch.randn(ref.shape[-1], dtype=torch.float64)
    f, jv = jvp(model, x, v)
    torch.testing.assert_close(f, model(x), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(jv, ref @ v, rtol=1e-10, atol=1e-12)
    u = torch.randn(ref.shape[:2], dtype=torch.float64)
    torch.testing.assert_close(
        vjp_sum(model, x, u), torch.einsum("ncp,nc->p", ref, u), rtol=1e-10, atol=1e-12
    )


def test_per_example_grads_match_dense(case):
    model, x = case
    lik = CategoricalLikelihood()
    with torch.no_grad():
        y = lik.sample(model(x))
    w = flat(model)
    ref = torch.stack(
        [
            torch.autograd.functional.jacobian(
                lambda v, i=i: lik.nll(
                    torch.func.functional_call(
                        model,
                        ({**unflatten(model, v)}, dict(model.named_buffers())),
                        (x[i : i + 1],),
                    ),
                    y[i : i + 1],
                ).sum(),
                w,
            )
            for i in range(len(x))
        ]
    )
    got = per_example_grads(model, x, y, lik.nll, chunk_size=2)
    torch.testing.assert_close(got, ref, rtol=1e-10, atol=1e-12)


def test_bad_inputs_named():
    model = tiny_mlp()
    with pytest.raises(ValueError, match=r"x must be a non-empty \[N, \.\.\.\] tensor"):
        jacobians(model, torch.zeros(0, 4, dtype=torch.float64))
    with pytest.raises(ValueError, match="chunk_size"):
        jacobians(model, torch.zeros(2, 4, dtype=torch.float64), chunk_size=0)
    with pytest.raises(ValueError, match="u must have"):
        vjp_sum(model, torch.zeros(2, 4, dtype=torch.float64), torch.zeros(3, 3))
    with pytest.raises(ValueError, match="vec must have"):
        jvp(model, torch.zeros(2, 4, dtype=torch.float64), torch.zeros(5))
    with pytest.raises(ValueError, match="model output must have shape"):
        jacobians(torch.nn.Linear(4, 3).double(), torch.zeros(2, 3, 4, dtype=torch.float64))
