"""Leave-one-out estimates against brute-force retraining without each example: linear
regression (exact, ``e_i / (1 - h_ii)``), logistic and softmax regression (the Newton-step
estimate against retraining and against the dense Hessian), a small MLP (approximate), and
``newton_step_loo``'s default tolerance in float32."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import fromp
from fromp.curvature.jacobian import flat_params
from fromp.likelihood import get_likelihood
from fromp.memory.loo import last_layer_features, last_layer_ggn, last_layer_loo
from fromp.memory.sensitivity import memory_perturbation, newton_step_loo

D = torch.float64


def _fit(model: nn.Module, x, y, lik, delta: float, steps: int = 200) -> nn.Module:
    """Minimise ``sum_n nll + delta/2 |w|^2`` by L-BFGS to (float64) convergence."""
    lik = get_likelihood(lik)
    opt = torch.optim.LBFGS(
        model.parameters(), lr=1, max_iter=steps, tolerance_grad=1e-13, tolerance_change=0,
        line_search_fn="strong_wolfe",
    )  # fmt: skip

    def closure():
        opt.zero_grad()
        sq = sum(p.pow(2).sum() for p in model.parameters())
        loss = lik.nll(model(x), y).sum() + 0.5 * delta * sq
        loss.backward()
        return loss

    for _ in range(5):
        opt.step(closure)
    return model.eval()


def _retrained_loo(make, x, y, lik, delta, init: nn.Module) -> torch.Tensor:
    """Outputs ``f(x_i; w^{\\i})`` of the model retrained without example ``i`` ``[N, C]``."""
    rows = []
    for i in range(len(x)):
        keep = torch.arange(len(x)) != i
        net = make()
        net.load_state_dict(init.state_dict())  # warm start at w*: same basin
        _fit(net.train(), x[keep], y[keep], lik, delta)
        with torch.no_grad():
            rows.append(net(x[i : i + 1])[0])
    return torch.stack(rows)


def test_linear_regression_exact_closed_form():
    torch.manual_seed(0)
    n, d, delta = 20, 3, 0.7
    x = torch.randn(n, d, dtype=D)
    y = x @ torch.tensor([1.0, -2.0, 0.5], dtype=D) + 0.3 + 0.5 * torch.randn(n, dtype=D)
    xa = torch.cat([x, torch.ones(n, 1, dtype=D)], 1)
    hess = xa.T @ xa + delta * torch.eye(d + 1, dtype=D)
    w = torch.linalg.solve(hess, xa.T @ y)
    model = nn.Linear(d, 1).double().eval()
    with torch.no_grad():
        model.weight.copy_(w[:d][None])
        model.bias.copy_(w[d:])
    res = last_layer_loo(model, x, y[:, None], delta, "gaussian")
    loo = res.perturbation.loo_logits[:, 0]
    # closed form: LOO residual e_i / (1 - h_ii), h = X (X^T X + delta)^{-1} X^T
    h = torch.diagonal(xa @ torch.linalg.solve(hess, xa.T))
    e = y - xa @ w
    torch.testing.assert_close(y - loo, e / (1 - h), rtol=1e-10, atol=1e-12)
    # brute force: ridge refitted without example i (closed form again)
    for i in range(n):
        k = torch.arange(n) != i
        wi = torch.linalg.solve(xa[k].T @ xa[k] + delta * torch.eye(d + 1, dtype=D), xa[k].T @ y[k])
        torch.testing.assert_close(loo[i], xa[i] @ wi, rtol=1e-10, atol=1e-12)
    assert res.summary()["prior_precision"] == delta and res.summary()["n_fit"] == n


@pytest.mark.parametrize("classes", [2, 3])
def test_softmax_regression_against_dense_hessian_and_retraining(classes):
    torch.manual_seed(1)
    n, d, delta = 30, 2, 0.5
    x = torch.randn(n, d, dtype=D)
    y = (x[:, 0] * 2 + x[:, 1] + 0.8 * torch.randn(n, dtype=D) > 0).long()
    if classes == 3:
        y = y + (x[:, 1] > 0.7).long()

    def make():
        return nn.Linear(d, classes).double()

    model = _fit(make(), x, y, "categorical", delta)
    res = last_layer_loo(model, x, y, delta)
    # precision: the dense Hessian of the objective over theta = vec([W | b])
    lik = get_likelihood("categorical")
    xa = torch.cat([x, torch.ones(n, 1, dtype=D)], 1)

    def objective(theta):
        return lik.nll(xa @ theta.reshape(classes, d + 1).T, y).sum() + 0.5 * delta * theta @ theta

    theta = torch.cat([model.weight, model.bias[:, None]], 1).detach().flatten()
    torch.testing.assert_close(res.precision, torch.func.hessian(objective)(theta))
    # the same Newton step as newton_step_loo with the exact Hessian (nn.Linear's ordering)
    w = flat_params(model).detach()

    def obj_flat(w):
        wt, b = w[: classes * d].reshape(classes, d), w[classes * d :]
        return lik.nll(x @ wt.T + b, y).sum() + 0.5 * delta * w @ w

    q = fromp.FullGaussian(w, torch.func.hessian(obj_flat)(w))
    ref = newton_step_loo(model, q, x, y)
    torch.testing.assert_close(res.perturbation.loo_logits, ref, rtol=1e-8, atol=1e-10)
    # against retraining without each example: one Newton step from w*, close
    retrained = _retrained_loo(make, x, y, "categorical", delta, model)
    err = (res.perturbation.loo_logits - retrained).abs().max()
    shift = (retrained - res.perturbation.logits).abs().max()
    assert err < 0.2 * shift, (err, shift)
    # the uncorrected first-order estimate is much worse: the correction is what is tested
    plain = memory_perturbation(model, q, x, y, covariance="full").loo_logits
    assert (plain - retrained).abs().max() > err


def test_small_mlp_loo_correlates_with_retraining():
    torch.manual_seed(2)
    n, delta = 40, 1.0
    x = torch.randn(n, 2, dtype=D)
    y = ((x[:, 0] ** 2 + x[:, 1] + 0.5 * torch.randn(n, dtype=D)) > 0.8).long()

    def make():
        torch.manual_seed(3)
        return nn.Sequential(nn.Linear(2, 8), nn.Tanh(), nn.Linear(8, 2)).double()

    model = _fit(make(), x, y, "categorical", delta)
    lik = get_likelihood("categorical")
    retrained = lik.nll(_retrained_loo(make, x, y, "categorical", delta, model), y)
    q = fromp.fit_laplace(model, x, "categorical", prior_precision=delta, hessian_structure="full")
    est = memory_perturbation(model, q, x, y, covariance="full", correction=True).loo_nll()
    train = lik.nll(model(x).detach(), y)
    corr = torch.corrcoef(torch.stack([est, retrained]))[0, 1]
    assert corr > 0.95, corr
    # the estimate beats the training NLL as a predictor of the retrained LOO NLL
    assert (est - retrained).abs().mean() < 0.5 * (train - retrained).abs().mean()
    assert est.mean() > train.mean()  # leaving an example out can only hurt it on average


def test_newton_step_loo_default_tolerance_reached_in_float32():
    torch.manual_seed(4)
    x = torch.randn(12, 3)
    y = torch.randint(0, 3, (12,))
    net = nn.Sequential(nn.Linear(3, 5), nn.Tanh(), nn.Linear(5, 3)).eval()
    q = fromp.fit_laplace(net, x, "categorical", prior_precision=1.0, hessian_structure="full")
    # GGN curvature has rank <= C = 3, so GMRES is exact after C + 1 = 4 steps; a tolerance
    # float32 cannot reach would run to max_iter and raise
    out = newton_step_loo(net, q, x, y, hess_approx="ggn", max_iter=5)
    assert out.dtype == torch.float32 and out.shape == (12, 3)
    with pytest.raises(RuntimeError, match="GMRES did not reach"):
        newton_step_loo(net, q, x, y, hess_approx="ggn", max_iter=5, tol=1e-12)
    q64 = fromp.fit_laplace(
        net.double(), x.double(), "categorical", prior_precision=1.0, hessian_structure="full"
    )
    ref = newton_step_loo(net, q64, x.double(), y, hess_approx="ggn")
    torch.testing.assert_close(out.double(), ref, rtol=1e-3, atol=1e-4)
    with pytest.raises(ValueError, match="tol must be > 0"):
        newton_step_loo(net, q64, x.double(), y, tol=0.0)


def test_last_layer_ggn_and_features_against_dense():
    torch.manual_seed(5)
    net = nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 3)).double().eval()
    x = torch.randn(9, 3, dtype=D)
    phi, head = last_layer_features(net, x)
    assert head is net[2]
    torch.testing.assert_close(phi, torch.relu(net[0](x)).detach())
    lik = get_likelihood("categorical")
    xa = torch.cat([phi, torch.ones(9, 1, dtype=D)], 1)
    theta = torch.cat([head.weight, head.bias[:, None]], 1).detach().flatten()
    jac = torch.func.jacrev(lambda t: xa @ t.reshape(3, 5).T)(theta)  # [N, C, P]
    f = xa @ theta.reshape(3, 5).T
    dense = torch.einsum("ncp,nck,nkq->pq", jac, lik.hessian(f), jac)
    torch.testing.assert_close(last_layer_ggn(xa, f, lik), dense)


def test_last_layer_bad_arguments():
    net = nn.Sequential(nn.Linear(3, 2), nn.Softmax(-1)).eval()
    x, y = torch.randn(4, 3), torch.tensor([0, 1, 0, 1])
    with pytest.raises(ValueError, match=r"last nn\.Linear"):
        last_layer_loo(net, x, y, 1.0)
    with pytest.raises(ValueError, match=r"nn\.Linear"):
        last_layer_features(nn.Sequential(nn.Tanh()).eval(), x)
    with pytest.raises(ValueError, match="prior_precision must be finite and strictly positive"):
        last_layer_loo(net[0], x, y, 0.0)
    with pytest.raises(ValueError, match="y must have N=4"):
        last_layer_loo(net[0], x, y[:3], 1.0)


def _blobs(n: int = 60, seed: int = 6):
    g = torch.Generator().manual_seed(seed)
    y = torch.randint(0, 3, (n,), generator=g)
    x = torch.randn(n, 4, generator=g) + 1.5 * nn.functional.one_hot(y, 4).float()
    return x, y


def _mlp():
    return nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 3))


def test_loo_tracker_adam_uses_last_layer_laplace_with_weight_decay_times_n():
    from fromp.memory.loo import LOOTracker

    torch.manual_seed(7)
    x, y = _blobs()
    net = _mlp()
    # Adam's weight_decay is an L2 term of the loss (coupled): prior precision wd x N
    opt = torch.optim.Adam(net.parameters(), lr=0.05, weight_decay=0.01)
    tracker = LOOTracker()
    for epoch in range(3):
        net.train()
        for i in range(0, 60, 20):
            opt.zero_grad()
            nn.functional.cross_entropy(net(x[i : i + 20]), y[i : i + 20]).backward()
            opt.step()
        rec = tracker(net, x, y, opt)
        assert net.training  # mode restored
        ref = last_layer_loo(net.eval(), x, y, 0.01 * 60).perturbation.loo_summary()
        net.train()
        assert rec["epoch"] == epoch and rec["prior_precision"] == pytest.approx(0.6)
        assert rec["loo_nll"] == pytest.approx(ref["loo_nll"], rel=1e-6)
        assert rec["loo_accuracy"] == ref["loo_accuracy"] and rec["n"] == 60
    assert len(tracker.history) == 3
    # no weight decay and no prior precision: refused, naming the argument
    with pytest.raises(ValueError, match="prior_precision is needed"):
        LOOTracker()(net, x, y, torch.optim.SGD(net.parameters(), lr=0.1))
    # AdamW's weight decay is decoupled, not an L2 prior: refused, not read as one
    with pytest.raises(ValueError, match="decoupled"):
        LOOTracker()(net, x, y, torch.optim.AdamW(net.parameters(), lr=0.1, weight_decay=0.01))
    # a subset: fixed across calls, the posterior fitted on it (and reported so)
    sub = LOOTracker(prior_precision=1.0, max_examples=25)
    a, b = sub(net, x, y), sub(net, x, y)
    assert a["n"] == 25 and a["loo_nll"] == b["loo_nll"]
    assert a["curvature_examples"] == 25


def test_loo_tracker_ivon_last_layer_against_dense():
    from fromp.memory.loo import LOOTracker
    from fromp.optim import IVON

    torch.manual_seed(8)
    x, y = _blobs()
    x = x.double()
    net = _mlp().double()
    opt = IVON(net.parameters(), lr=0.1, ess=60, hess_init=0.5)
    for _ in range(5):
        with opt.sampled_params(train=True):
            opt.zero_grad()
            nn.functional.cross_entropy(net(x), y).backward()
        opt.step()
    rec = LOOTracker()(net, x, y, opt)
    q = opt.posterior(net)
    # dense: V_n = J_n Sigma_head J_n^T with Sigma the IVON variances of the head only
    mask = torch.zeros_like(q.variance)
    mask[-(6 * 3 + 3) :] = 1  # the head is the last Linear: its weight and bias come last
    w = q.mean
    jac = torch.func.jacrev(
        lambda w: torch.func.functional_call(
            net.eval(), fromp.curvature.jacobian.unflatten(net, w), (x,)
        )
    )(w)  # [N, C, P]
    cov = torch.einsum("ncp,p,nkp->nck", jac, q.variance * mask, jac)
    f = net(x).detach()
    lik = get_likelihood("categorical")
    e = torch.softmax(f, -1) - nn.functional.one_hot(y, 3)
    lam = lik.hessian(f)
    loo = f + torch.einsum(
        "ncd,nd->nc", cov, torch.linalg.solve(torch.eye(3, dtype=D) - lam @ cov, e)
    )
    assert rec["loo_nll"] == pytest.approx(lik.nll(loo, y).mean().item(), rel=1e-8)
    assert rec["posterior"].startswith("IVON posterior")
    # subset_of_weights="all": the full memory-perturbation equation over every weight
    rec_all = LOOTracker(subset_of_weights="all")(net, x, y, opt)
    full = memory_perturbation(net, q, x, y, covariance="full", correction=True)
    assert rec_all["loo_nll"] == pytest.approx(full.loo_nll().mean().item(), rel=1e-8)
    assert rec_all["loo_nll"] > rec["loo_nll"]  # all weights vary: larger leave-one-out moves
    with pytest.raises(ValueError, match="subset_of_weights must be"):
        LOOTracker(subset_of_weights="head")
    with pytest.raises(TypeError, match="scope"):  # 0.3's name, gone in 0.4
        LOOTracker(scope="all")


def test_loo_plugin_records_each_epoch_on_the_current_experience():
    from avalanche.training.supervised import Naive
    from fromp_avalanche.loo import LOOPlugin
    from fromp_bench.data import split_digits, to_avalanche

    from fromp.memory.loo import LOOTracker

    torch.manual_seed(9)
    seq = split_digits()
    bench = to_avalanche(seq)
    net = nn.Sequential(nn.Flatten(), nn.Linear(64, 16), nn.Tanh(), nn.Linear(16, 2))
    opt = torch.optim.SGD(net.parameters(), lr=0.05, weight_decay=1e-3)
    plugin = LOOPlugin()
    strategy = Naive(
        model=net, optimizer=opt, criterion=nn.CrossEntropyLoss(), train_mb_size=32,
        train_epochs=2, plugins=[plugin], evaluator=None,
    )  # fmt: skip
    for k, exp in enumerate(bench.train_stream[:3]):
        strategy.train(exp)
        assert [h["experience"] for h in plugin.history] == [
            e for e in range(k + 1) for _ in (0, 1)
        ]
        # the last record is the estimate on this experience's data, not a previous one's
        task = seq[k]
        ref = LOOTracker()(net, task.train_x, task.train_y, opt)
        last = plugin.history[-1]
        assert last["n"] == len(task.train_y)
        assert last["loo_nll"] == pytest.approx(ref["loo_nll"], rel=1e-5)
        assert last["prior_precision"] == pytest.approx(1e-3 * len(task.train_y))


def test_last_layer_remove_a_class_against_ridge_and_retraining():
    from fromp.memory.loo import last_layer_remove

    torch.manual_seed(10)
    # Gaussian likelihood: removing a set is exact (ridge refitted without it)
    n, d, delta = 30, 3, 0.4
    x = torch.randn(n, d, dtype=D)
    y = x @ torch.tensor([0.5, -1.0, 2.0], dtype=D) + 0.3 * torch.randn(n, dtype=D)
    xa = torch.cat([x, torch.ones(n, 1, dtype=D)], 1)
    w = torch.linalg.solve(xa.T @ xa + delta * torch.eye(d + 1, dtype=D), xa.T @ y)
    lin = nn.Linear(d, 1).double().eval()
    with torch.no_grad():
        lin.weight.copy_(w[:d][None])
        lin.bias.copy_(w[d:])
    remove = x[:, 0] > 0.3
    xe = torch.randn(7, d, dtype=D)
    before, after = last_layer_remove(lin, x, y[:, None], remove, delta, xe, "gaussian")
    k = ~remove
    wk = torch.linalg.solve(xa[k].T @ xa[k] + delta * torch.eye(d + 1, dtype=D), xa[k].T @ y[k])
    xea = torch.cat([xe, torch.ones(7, 1, dtype=D)], 1)
    torch.testing.assert_close(before[:, 0], xea @ w)
    torch.testing.assert_close(after[:, 0], xea @ wk)
    # softmax regression, a whole class removed: close to retraining without it
    x, y = _blobs(90, seed=11)
    x = x.double()
    model = _fit(nn.Linear(4, 3).double(), x, y, "categorical", 1.0)
    remove = y == 2
    before, after = last_layer_remove(model, x, y, remove, 1.0, x)
    retrained = _fit(nn.Linear(4, 3).double().requires_grad_(), x[~remove], y[~remove],
                     "categorical", 1.0)  # fmt: skip
    with torch.no_grad():
        p0, p1 = torch.softmax(before, -1), torch.softmax(after, -1)
        pr = torch.softmax(retrained(x), -1)
    corr = torch.corrcoef(torch.stack([(p1 - p0).flatten(), (pr - p0).flatten()]))[0, 1]
    assert corr > 0.9, corr
    with pytest.raises(ValueError, match="remove must be a bool tensor"):
        last_layer_remove(model, x, y, remove.long(), 1.0, x)


def test_kron_last_layer_loo_against_dense_kfac_posterior():
    """``hessian_structure="kron"``: ``V_n = J_n (B (x) A + delta I)^{-1} J_n^T`` with ``B = sum
    Lambda_n``, ``A = mean phi~ phi~^T`` formed densely, then the corrected LOO outputs."""
    from fromp.memory.loo import LOOTracker

    torch.manual_seed(3)
    x, y = _blobs()
    x = x.double()
    net = _mlp().double().eval()
    delta = 0.8
    rec = LOOTracker(prior_precision=delta, hessian_structure="kron")(net, x, y)
    phi, head = last_layer_features(net, x)
    phi1 = torch.cat([phi, torch.ones(len(phi), 1, dtype=D)], 1)
    f = head(phi).detach()
    lik = get_likelihood("categorical")
    lam = lik.hessian(f)
    prec = torch.kron(lam.sum(0), phi1.T @ phi1 / len(x)) + delta * torch.eye(3 * 7, dtype=D)
    jac = torch.einsum("ck,nd->nckd", torch.eye(3, dtype=D), phi1).reshape(len(x), 3, -1)
    cov = jac @ torch.linalg.inv(prec) @ jac.transpose(1, 2)
    e = torch.softmax(f, -1) - nn.functional.one_hot(y, 3)
    loo = f + torch.einsum(
        "ncd,nd->nc", cov, torch.linalg.solve(torch.eye(3, dtype=D) - lam @ cov, e)
    )
    assert rec["loo_nll"] == pytest.approx(lik.nll(loo, y).mean().item(), rel=1e-9)
    assert rec["posterior"].startswith("last-layer kron")
    with pytest.raises(ValueError, match="hessian_structure must be"):
        LOOTracker(hessian_structure="diag")


@pytest.mark.parametrize("structure", ["full", "kron"])
def test_recorded_training_passes_give_the_evaluation_pass_estimate(structure):
    """Features recorded during the epoch's forward passes (paired by ``observe``) give the
    same estimate as a separate evaluation pass when the weights did not move; after a
    real epoch of training they differ only through the features' staleness; the record
    is cleared after each estimate, so epoch 2 does not count epoch 1's passes."""
    from fromp.memory.loo import LOOTracker

    torch.manual_seed(4)
    x, y = _blobs()
    net = _mlp().eval()
    opt = torch.optim.Adam(net.parameters(), lr=0.05, weight_decay=0.01)
    tracker = LOOTracker(hessian_structure=structure)
    with tracker.recording(net):
        for i in range(0, 60, 20):
            net(x[i : i + 20])
            tracker.observe(y[i : i + 20])
    free = tracker(net, optimizer=opt)
    full = LOOTracker(hessian_structure=structure)(net, x, y, opt)
    assert free["features"] == "recorded training passes" and free["n"] == 60
    assert free["loo_nll"] == pytest.approx(full["loo_nll"], rel=1e-5)
    assert free["loo_accuracy"] == full["loo_accuracy"]
    with pytest.raises(ValueError, match="nothing recorded"):
        tracker(net, optimizer=opt)
    # recorded passes + a fresh pass over a subset: the posterior of all 60, estimates on 20
    with tracker.recording(net):
        for i in range(0, 60, 20):
            net(x[i : i + 20])
            tracker.observe(y[i : i + 20])
    part = tracker(net, x[:20], y[:20], opt)
    assert part["curvature_examples"] == 60 and part["n"] == 20
    from fromp.memory.loo import _full_loo, _kron_loo

    phi, head = last_layer_features(net, x)
    lik = get_likelihood("categorical")
    if structure == "kron":
        every = _kron_loo(phi, head, y, 0.01 * 60, lik)
    else:
        every = _full_loo(phi, head, y, 0.01 * 60, lik).perturbation
    assert part["loo_nll"] == pytest.approx(every.loo_nll()[:20].mean().item(), rel=1e-6)
    net.train()
    with tracker.recording(net):
        for i in range(0, 60, 20):
            opt.zero_grad()
            loss = nn.functional.cross_entropy(net(x[i : i + 20]), y[i : i + 20])
            tracker.observe(y[i : i + 20])
            loss.backward()
            opt.step()
    rec = tracker(net, optimizer=opt, epoch=1)
    assert rec["n"] == 60 and rec["epoch"] == 1 and net.training
    with pytest.raises(RuntimeError, match="observe"):
        tracker.observe(y[:20])
    with pytest.raises(ValueError, match="neither"):
        tracker(net, None, y, opt)


def test_loo_plugin_recorded_uses_the_epochs_own_passes_of_the_current_experience():
    """``LOOPlugin(recorded=True)``: each epoch's estimate is over exactly that epoch's
    training passes of the current experience (every example once), with the head at the
    epoch's end; close to the evaluation-pass estimate, and the hooks are gone afterwards."""
    from avalanche.training.supervised import Naive
    from fromp_avalanche.loo import LOOPlugin
    from fromp_bench.data import split_digits, to_avalanche

    from fromp.memory.loo import LOOTracker

    torch.manual_seed(10)
    seq = split_digits()
    bench = to_avalanche(seq)
    net = nn.Sequential(nn.Flatten(), nn.Linear(64, 16), nn.Tanh(), nn.Linear(16, 2))
    opt = torch.optim.SGD(net.parameters(), lr=0.05, weight_decay=1e-3)
    plugin = LOOPlugin(recorded=True, hessian_structure="kron")
    strategy = Naive(
        model=net, optimizer=opt, criterion=nn.CrossEntropyLoss(), train_mb_size=32,
        train_epochs=2, plugins=[plugin], evaluator=None,
    )  # fmt: skip
    for k, exp in enumerate(bench.train_stream[:2]):
        strategy.train(exp)
        last = plugin.history[-1]
        assert last["n"] == len(seq[k].train_y) and last["experience"] == k
        assert last["features"] == "recorded training passes"
        ref = LOOTracker(hessian_structure="kron")(net, seq[k].train_x, seq[k].train_y, opt)
        assert abs(last["loo_nll"] - ref["loo_nll"]) < 0.5 * ref["loo_nll"] + 0.02
    assert len(plugin.history) == 4
    assert all(not m._forward_hooks for m in net.modules())


def test_last_layer_remove_iterated_newton_matches_refitted_softmax_regression():
    """Removing a class from softmax regression on fixed features: the iterated Newton steps
    reach the head refitted without the class (dense float64, to ~1e-6); one step is the
    memory-perturbation step ``(H_K + delta I)^{-1} g_S`` formed densely; from a head that
    is not at the optimum the move is that of the residual-corrected objective."""
    from fromp.memory.loo import last_layer_remove

    x, y = _blobs(120, seed=12)
    x = x.double()
    delta = 0.5
    model = _fit(nn.Linear(4, 3).double(), x, y, "categorical", delta)
    remove = y == 1
    xe = torch.randn(9, 4, dtype=D)
    before, after = last_layer_remove(model, x, y, remove, delta, xe)
    refit = nn.Linear(4, 3).double()
    refit.load_state_dict(model.state_dict())
    _fit(refit.requires_grad_(), x[~remove], y[~remove], "categorical", delta)
    with torch.no_grad():
        torch.testing.assert_close(before, model(xe))
        torch.testing.assert_close(after, refit(xe), atol=1e-6, rtol=1e-6)
        one = last_layer_remove(model, x, y, remove, delta, xe, steps=1)[1]
        # dense one-step: theta + (H_K + delta I)^{-1} g_S over vec([W | b]) (row-major)
        xa = torch.cat([x, torch.ones(len(x), 1, dtype=D)], 1)
        theta = torch.cat([model.weight, model.bias[:, None]], 1)
        f = xa @ theta.T
        p = torch.softmax(f, -1)
        e = p - nn.functional.one_hot(y, 3).double()
        k = ~remove
        lam = torch.diag_embed(p[k]) - p[k, :, None] * p[k, None, :]
        h = torch.einsum("nck,ni,nj->cikj", lam, xa[k], xa[k]).reshape(15, 15)
        g = torch.einsum("nc,ni->ci", e[remove], xa[remove]).reshape(15)
        step = torch.linalg.solve(h + delta * torch.eye(15, dtype=D), g).reshape(3, 5)
        xea = torch.cat([xe, torch.ones(9, 1, dtype=D)], 1)
        torch.testing.assert_close(one, xea @ (theta + step).T)
        # the one step overshoots here; iterating moves the answer away from it
        assert (one - refit(xe)).abs().max() > 10 * (after - refit(xe)).abs().max()
    # a head short of the optimum: the answer zeroes grad [L_K + delta/2 |t|^2] - r
    off = nn.Linear(4, 3).double()
    with torch.no_grad():
        off.weight.copy_(model.weight + 0.1 * torch.randn(3, 4, dtype=D))
        off.bias.copy_(model.bias)
    _, moved = last_layer_remove(off.eval(), x, y, remove, delta, x)

    def grad(w: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        w = w.detach().requires_grad_(True)
        loss = nn.functional.cross_entropy(xa[rows] @ w.T, y[rows], reduction="sum")
        return torch.autograd.grad(loss + 0.5 * delta * w.pow(2).sum(), w)[0]

    t0 = torch.cat([off.weight, off.bias[:, None]], 1).detach()
    t1 = torch.linalg.lstsq(xa, moved).solution.T  # [C, D1]: the head the outputs come from
    r = grad(t0, torch.ones_like(k))
    torch.testing.assert_close(grad(t1, k) - r, torch.zeros_like(r), atol=1e-6, rtol=0)
    with pytest.raises(ValueError, match="steps must be"):
        last_layer_remove(model, x, y, remove, delta, xe, steps=0)


def test_kron_factor_shortcuts_against_dense_sums():
    """The Kronecker factors without ``[N, C, C]`` Hessians or an augmented copy: ``sum_n
    Lambda_n`` (softmax closed form, other likelihoods summed), ``mean phi~ phi~^T`` with the
    bias column assembled, and the curvature of a separate fit set equal to the set itself."""
    from fromp.memory.loo import _hessian_sum, _kron_loo, _second_moment

    torch.manual_seed(13)
    f = 3 * torch.randn(50, 4)
    cat = get_likelihood("categorical")
    tol = {"rtol": 1e-5, "atol": 1e-5}  # the probabilities in float32, like the outputs
    torch.testing.assert_close(_hessian_sum(cat, f), cat.hessian(f.double()).sum(0), **tol)
    dense = cat.hessian(f.double()).sum(0)
    torch.testing.assert_close(_hessian_sum(cat, f + 80.0), dense, **tol)
    torch.testing.assert_close(_hessian_sum(cat, f.double()), dense)
    gau = get_likelihood("gaussian")
    torch.testing.assert_close(_hessian_sum(gau, f), gau.hessian(f.double()).sum(0))
    phi = torch.rand(50, 6)
    aug = torch.cat([phi, torch.ones(50, 1)], 1).double()
    torch.testing.assert_close(_second_moment(phi, True), aug.T @ aug / 50)
    torch.testing.assert_close(_second_moment(phi, False), phi.double().T @ phi.double() / 50)
    head = nn.Linear(6, 4)
    y = torch.randint(0, 4, (50,))
    own = _kron_loo(phi, head, y, 0.3, cat)
    given = _kron_loo(phi, head, y, 0.3, cat, fit_phi=phi.clone())
    torch.testing.assert_close(given.loo_logits, own.loo_logits)
    torch.testing.assert_close(given.covariance, own.covariance)
