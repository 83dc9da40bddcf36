"""FROMP regulariser: kernels and penalty gradients against dense float64 autograd."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn
from torch.func import functional_call

from fromp.continual.regularizer import FROMPRegularizer, task_fn
from fromp.curvature.jacobian import flat_params, num_params, unflatten
from fromp.models import MultiHeadMLP


def _net(n_heads: int = 2, head_size: int = 3) -> nn.Module:
    torch.manual_seed(0)
    return MultiHeadMLP(4, (5,), n_heads=n_heads, head_size=head_size).double()


def _dense_prob_jac(net: nn.Module, x: torch.Tensor, task: int) -> torch.Tensor:
    """d softmax(f(x))/dw, [M, C, P], with torch.autograd.functional.jacobian."""
    w0 = flat_params(net)

    def probs(w):
        return torch.softmax(functional_call(net, unflatten(net, w), (x,), {"task": task}), -1)

    return torch.autograd.functional.jacobian(probs, w0)


def _perturb(net: nn.Module, scale: float = 0.3) -> None:
    with torch.no_grad():
        for p in net.parameters():
            p.add_(scale * torch.randn_like(p))


def _variance(net: nn.Module) -> torch.Tensor:
    return torch.rand(num_params(net), dtype=torch.float64) + 0.1


def _dense_kernels(g: torch.Tensor, v: torch.Tensor, kernel: str) -> list[torch.Tensor]:
    m, c, _ = g.shape
    if kernel == "per_class":
        return [g[:, k] @ torch.diag(v) @ g[:, k].T for k in range(c)]
    if kernel == "per_point":  # each point's [C, C] block with itself
        return [g[i] @ torch.diag(v) @ g[i].T for i in range(m)]
    gj = g.permute(1, 0, 2).reshape(c * m, -1)  # class-major (c, m)
    return [gj @ torch.diag(v) @ gj.T]


@pytest.mark.parametrize("kernel", ["per_class", "joint", "per_point"])
def test_stored_kernel_equals_dense(kernel):
    net = _net()
    x = torch.randn(6, 4, dtype=torch.float64)
    v = _variance(net)
    reg = FROMPRegularizer(kernel, jitter=1e-6, chunk_size=4)
    reg.add_task(net, x, 1, v)
    mem = reg.memories[0]
    g = _dense_prob_jac(net, x, 1)
    dense = _dense_kernels(g, v, kernel)
    k = mem.chol @ mem.chol.transpose(-1, -2) - mem.jitter * torch.eye(mem.chol.shape[-1])
    assert k.shape[0] == len(dense)
    for kk, dd in zip(k, dense):
        torch.testing.assert_close(kk, dd, atol=1e-10, rtol=1e-8)
    torch.testing.assert_close(reg.kernel_matrix(net, x, 1, v), torch.stack(dense))
    torch.testing.assert_close(mem.targets, torch.softmax(net(x, task=1), -1).detach())


def test_per_class_kernel_is_lambda_j_sigma_jt_lambda():
    """dp/dw = Lambda J for softmax: the per-class kernel is the diagonal block of
    Lambda J Sigma J^T Lambda."""
    net = _net(n_heads=1, head_size=3)
    x = torch.randn(5, 4, dtype=torch.float64)
    v = _variance(net)
    w0 = flat_params(net)
    jf = torch.autograd.functional.jacobian(
        lambda w: functional_call(net, unflatten(net, w), (x,)), w0
    )  # [M, C, P]
    p = torch.softmax(net(x), -1).detach()
    lam = torch.diag_embed(p) - p[:, :, None] * p[:, None, :]
    lj = torch.einsum("mck,mkp->mcp", lam, jf)
    full = torch.einsum("mcp,p,ndp->mcnd", lj, v, lj)  # [M, C, M, C]
    k = FROMPRegularizer("per_class").kernel_matrix(net, x, None, v)
    for c in range(3):
        torch.testing.assert_close(k[c], full[:, c, :, c])


@pytest.mark.parametrize("kernel", ["per_class", "joint", "per_point"])
def test_penalty_gradient_equals_brute_force_multihead(kernel):
    net = _net(n_heads=3, head_size=3)
    reg = FROMPRegularizer(kernel, jitter=1e-4)
    xs = [torch.randn(5, 4, dtype=torch.float64), torch.randn(4, 4, dtype=torch.float64)]
    v = _variance(net)
    reg.add_task(net, xs[0], 0, v)
    old_kernels = [_dense_kernels(_dense_prob_jac(net, xs[0], 0), v, kernel)]
    _perturb(net, 0.1)
    reg.add_task(net, xs[1], 2, v, update_previous=False)
    old_kernels.append(_dense_kernels(_dense_prob_jac(net, xs[1], 2), v, kernel))
    targets = [m.targets.clone() for m in reg.memories]
    _perturb(net)

    net.zero_grad()
    pen = reg.penalty(task_fn(net))
    pen.backward()
    got = torch.cat(
        [
            torch.zeros_like(p).reshape(-1) if p.grad is None else p.grad.reshape(-1)
            for p in net.parameters()
        ]
    )
    assert net.heads[1].weight.grad is None  # head 1 holds no memorable set

    expected = torch.zeros_like(got)
    value = 0.0
    for x, task, m, kernels in zip(xs, (0, 2), targets, old_kernels):
        g = _dense_prob_jac(net, x, task)  # [M, C, P] at the current w
        r = torch.softmax(net(x, task=task), -1).detach() - m  # [M, C]
        eye = torch.eye(kernels[0].shape[0], dtype=torch.float64)
        if kernel == "per_class":
            for c, kc in enumerate(kernels):
                a = torch.linalg.solve(kc + 1e-4 * eye, r[:, c])
                expected += g[:, c].T @ a
                value += 0.5 * float(r[:, c] @ a)
        elif kernel == "per_point":
            for i, ki in enumerate(kernels):
                a = torch.linalg.solve(ki + 1e-4 * eye, r[i])
                expected += g[i].T @ a
                value += 0.5 * float(r[i] @ a)
        else:
            rj = r.T.reshape(-1)
            gj = g.permute(1, 0, 2).reshape(-1, g.shape[-1])
            a = torch.linalg.solve(kernels[0] + 1e-4 * eye, rj)
            expected += gj.T @ a
            value += 0.5 * float(rj @ a)
    assert expected.abs().max() > 1e-3  # the check is not vacuous
    torch.testing.assert_close(got, expected, atol=1e-8, rtol=1e-6)
    assert pen.item() == pytest.approx(value, rel=1e-8)


def test_penalty_single_head_plain_module():
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 3)).double()
    x = torch.randn(5, 3, dtype=torch.float64)
    v = _variance(net)
    reg = FROMPRegularizer("per_class")
    reg.add_task(net, x, 0, v)
    assert reg.penalty(net).item() == pytest.approx(0.0, abs=1e-20)  # at the old solution
    kernels = _dense_kernels(_dense_prob_jac_plain(net, x), v, "per_class")
    _perturb(net)
    pen = reg.penalty(net)
    pen.backward()
    g = _dense_prob_jac_plain(net, x)
    r = torch.softmax(net(x), -1).detach() - reg.memories[0].targets
    exp = sum(
        g[:, c].T @ torch.linalg.solve(k + 1e-6 * torch.eye(5, dtype=torch.float64), r[:, c])
        for c, k in enumerate(kernels)
    )
    got = torch.cat([p.grad.reshape(-1) for p in net.parameters()])
    torch.testing.assert_close(got, exp, atol=1e-8, rtol=1e-6)


def _dense_prob_jac_plain(net, x):
    w0 = flat_params(net)
    return torch.autograd.functional.jacobian(
        lambda w: torch.softmax(functional_call(net, unflatten(net, w), (x,)), -1), w0
    )


def test_identity_kernel_is_squared_distance():
    net = _net()
    x = torch.randn(6, 4, dtype=torch.float64)
    reg = FROMPRegularizer("identity")
    reg.add_task(net, x, 1, _variance(net))
    old = torch.softmax(net(x, task=1), -1).detach()
    _perturb(net)
    new = torch.softmax(net(x, task=1), -1)
    expected = 0.5 * ((new - old) ** 2).sum()
    pen = reg.penalty(net)
    torch.testing.assert_close(pen, expected)
    (ga,) = torch.autograd.grad(pen, net.heads[1].weight)
    (gb,) = torch.autograd.grad(expected, net.heads[1].weight)
    torch.testing.assert_close(ga, gb)
    assert reg.memories[0].chol is None


def test_update_previous_refreshes_targets_and_kernels():
    net = _net()
    v = _variance(net)
    x0, x1 = torch.randn(4, 4, dtype=torch.float64), torch.randn(3, 4, dtype=torch.float64)
    reg = FROMPRegularizer()
    reg.add_task(net, x0, 0, v)
    _perturb(net)
    reg.add_task(net, x1, 1, 2 * v)  # update_previous=True: task 0 refreshed at new w, Sigma
    ref = FROMPRegularizer()
    ref.add_task(net, x0, 0, 2 * v)
    torch.testing.assert_close(reg.memories[0].targets, ref.memories[0].targets)
    torch.testing.assert_close(reg.memories[0].chol, ref.memories[0].chol)
    assert reg.penalty(net).item() == pytest.approx(0.0, abs=1e-20)
    assert reg.num_points == 7 and len(reg) == 2


def test_jitter_warning_and_failure():
    net = _net()
    x = torch.randn(4, 4, dtype=torch.float64)
    zero = torch.zeros(num_params(net), dtype=torch.float64)  # K = 0: singular
    reg = FROMPRegularizer(jitter=0.0)
    with pytest.warns(RuntimeWarning, match="not positive definite"):
        reg.add_task(net, x, 0, zero)
    assert reg.memories[0].jitter > 0
    assert torch.isfinite(reg.memories[0].chol).all()
    with pytest.raises(RuntimeError, match="Cholesky factorisation"):
        FROMPRegularizer(jitter=0.0, max_tries=0).add_task(net, x, 0, zero)
    # a well-conditioned kernel gives no warning
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        FROMPRegularizer(jitter=1e-6).add_task(net, x, 0, _variance(net))


def test_errors():
    net = _net()
    x = torch.randn(4, 4, dtype=torch.float64)
    with pytest.raises(ValueError, match="kernel must be one of"):
        FROMPRegularizer("diag")
    reg = FROMPRegularizer()
    with pytest.raises(ValueError, match=r"posterior_variance must have shape \[P\]"):
        reg.add_task(net, x, 0, torch.ones(3, dtype=torch.float64))
    with pytest.raises(ValueError, match="non-negative"):
        reg.add_task(net, x, 0, -torch.ones(num_params(net), dtype=torch.float64))
    with pytest.raises(ValueError, match="x_mem must be a non-empty"):
        reg.add_task(net, x[:0], 0, _variance(net))
    bad = x.clone()
    bad[0, 0] = float("nan")
    with pytest.raises(ValueError, match="NaN"):
        reg.add_task(net, bad, 0, _variance(net))
    assert reg.penalty(net).item() == 0.0


def test_state_dict_roundtrip_gives_identical_penalty():
    net = _net()
    reg = FROMPRegularizer("joint", jitter=1e-5)
    reg.add_task(net, torch.randn(4, 4, dtype=torch.float64), 0, _variance(net))
    reg.add_task(net, torch.randn(3, 4, dtype=torch.float64), 1, _variance(net))
    _perturb(net)
    state = reg.state_dict()
    fresh = FROMPRegularizer()  # settings come from the state
    fresh.load_state_dict(state)
    assert fresh.kernel == "joint" and fresh.jitter == 1e-5
    assert fresh.penalty(net).item() == reg.penalty(net).item()
    assert reg.penalty(net).item() > 0


def test_diag_ggn_linear_matches_per_example_jacobians():
    from fromp.curvature.diagonal import diag_ggn, diag_ggn_linear
    from fromp.models import LeNet5, with_task

    net = _net(n_heads=3, head_size=3)
    x = torch.randn(11, 4, dtype=torch.float64)
    for task in (0, 2):
        head = with_task(net, task)
        batches = [(x[:5],), (x[5:],)]
        fast = diag_ggn_linear(head, batches, "categorical")
        torch.testing.assert_close(fast, diag_ggn(head, x, "categorical"))
        parts = unflatten(net, fast)
        assert parts[f"heads.{task}.weight"].abs().sum() > 0  # the task's head is used
        assert parts[f"heads.{1}.weight"].abs().sum() == 0  # head 1 is not
    with pytest.raises(ValueError, match=r"not in an nn\.Linear"):
        diag_ggn_linear(LeNet5(), torch.randn(2, 1, 28, 28), "categorical")
    shared = nn.Linear(3, 3).double()
    with pytest.raises(ValueError, match="applied twice"):
        diag_ggn_linear(
            nn.Sequential(shared, nn.Tanh(), shared), torch.randn(2, 3).double(), "categorical"
        )


@pytest.mark.parametrize("kernel", ["per_class", "joint", "per_point", "identity"])
def test_batched_penalty_equals_per_task_loop(kernel):
    net = _net(n_heads=3, head_size=3)
    reg = FROMPRegularizer(kernel, jitter=1e-5)
    v = _variance(net)
    reg.add_task(net, torch.randn(4, 4, dtype=torch.float64), 0, v)
    reg.add_task(net, torch.randn(4, 4, dtype=torch.float64), 2, v)
    reg.add_task(net, torch.randn(3, 4, dtype=torch.float64), 1, v)  # another kernel size
    _perturb(net)
    looped = reg.penalty(task_fn(net))
    (g_loop,) = torch.autograd.grad(looped, net.body[1].weight)
    batched = reg.penalty(net)
    (g_batch,) = torch.autograd.grad(batched, net.body[1].weight)
    assert looped.item() > 0
    torch.testing.assert_close(batched, looped)
    torch.testing.assert_close(g_batch, g_loop)


def test_prob_gp_jacobians_and_conv_kernel_match_dense():
    """The GP of the probabilities that the regulariser builds: its per-example Jacobians
    (the generic vmap path, used for non-MLP networks) through head 1 of a multi-head
    network, and the kernel of a CNN, against dense autograd."""
    from fromp.continual.regularizer import _prob_gp
    from fromp.likelihood import get_likelihood
    from fromp.models import with_task

    net = _net(n_heads=2, head_size=3)
    x = torch.randn(5, 4, dtype=torch.float64)
    g = _dense_prob_jac(net, x, 1)
    gp = _prob_gp(with_task(net, 1), get_likelihood("categorical"), None, 2)
    torch.testing.assert_close(torch.cat([gp.jacobians(x[s : s + 2]) for s in (0, 2, 4)]), g)

    torch.manual_seed(0)
    conv = nn.Sequential(
        nn.Conv2d(1, 2, 3), nn.Tanh(), nn.Flatten(), nn.Linear(2 * 2 * 2, 3)
    ).double()
    xc = torch.randn(4, 1, 4, 4, dtype=torch.float64)
    v = _variance(conv)
    gc = _dense_prob_jac_plain(conv, xc)
    for kernel in ("per_class", "joint", "per_point"):
        k = FROMPRegularizer(kernel).kernel_matrix(conv, xc, None, v)
        torch.testing.assert_close(k, torch.stack(_dense_kernels(gc, v, kernel)))


def test_per_point_kernel_from_a_function_kernel_keeps_the_point_blocks():
    """A posterior of any structure hands the regulariser the outputs' kernel ``k_f`` ``[M,
    C, M, C]`` (``posterior="kron"``): the per-point kernel of the probabilities is ``A_m
    k_f[m, :, m, :] A_m^T``, here against ``dp(x_m)/dw Sigma dp(x_m)/dw^T`` by dense
    autograd."""
    net = _net(n_heads=2, head_size=3)
    x = torch.randn(5, 4, dtype=torch.float64)
    v = _variance(net)
    w0 = flat_params(net)
    jf = torch.autograd.functional.jacobian(
        lambda w: functional_call(net, unflatten(net, w), (x,), {"task": 1}), w0
    )  # [M, C, P]
    kf = torch.einsum("mcp,p,ndp->mcnd", jf, v, jf)
    got = FROMPRegularizer("per_point").kernel_matrix(net, x, 1, lambda model, x, t: kf)
    want = torch.stack(_dense_kernels(_dense_prob_jac(net, x, 1), v, "per_point"))
    assert got.shape == (5, 3, 3)
    torch.testing.assert_close(got, want)


def test_the_former_name_is_gone():
    import fromp
    import fromp.continual.regularizer as module

    for where in (fromp, module):
        assert not hasattr(where, "FunctionalRegularizer")
