"""The leave-one-out functions against the fourth audit: a fitted Laplace's likelihood and
noise are used (regression LOO with sigma = 0.5 equal to exact ridge refits; a Bernoulli
Laplace against a dense float64 formula), the corrected diagonal form refuses examples it has
no meaning for, labels outside the head are refused naming ``y``, bad tracker arguments are
refused by name, and the recorded tracker follows a multi-head model's current head."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

import fromp
from fromp import Laplace
from fromp.likelihood import GaussianLikelihood
from fromp.memory.loo import LOOTracker, last_layer_loo
from fromp.memory.sensitivity import memory_perturbation, newton_step_loo
from fromp.posterior import FullGaussian
from fromp.testing import dense_jacobian, forward_at

D = torch.float64


def _ridge_problem(n=14, d=3, sigma=0.5, delta=0.7, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, d, generator=g, dtype=D)
    y = x @ torch.randn(d, generator=g, dtype=D) + sigma * torch.randn(n, generator=g, dtype=D)
    return x, y.unsqueeze(-1), sigma, delta


def _ridge_map(x, y, sigma, delta):
    a = x.T @ x / sigma**2 + delta * torch.eye(x.shape[1], dtype=D)
    return torch.linalg.solve(a, x.T @ y[:, 0] / sigma**2)


def test_regression_laplace_loo_uses_its_sigma_and_equals_exact_ridge_refits():
    """At the MAP of Bayesian linear regression, the corrected LOO outputs are exact: each
    equals the prediction of the ridge refitted without the example (dense float64)."""
    x, y, sigma, delta = _ridge_problem()
    model = nn.Linear(3, 1, bias=False).to(D).eval()
    with torch.no_grad():
        model.weight.copy_(_ridge_map(x, y, sigma, delta)[None])
    la = Laplace(model, "regression", "all", "full", sigma_noise=sigma, prior_precision=delta)
    la.fit([(x, y)])
    want = torch.stack(
        [
            x[i] @ _ridge_map(torch.cat([x[:i], x[i + 1 :]]), torch.cat([y[:i], y[i + 1 :]]),
                              sigma, delta)
            for i in range(len(x))
        ]
    )  # fmt: skip
    for cov in ("diag", "full"):
        mp = memory_perturbation(model, la, x, y, covariance=cov, correction=True)
        torch.testing.assert_close(mp.loo_logits[:, 0], want, rtol=1e-10, atol=1e-12)
        # the NLL of the Laplace's noise, not sigma = 1
        nll = 0.5 * (y[:, 0] - want) ** 2 / sigma**2 + math.log(sigma) + 0.5 * math.log(2 * math.pi)
        assert mp.loo_summary()["loo_nll"] == pytest.approx(float(nll.mean()), rel=1e-10)
    same = memory_perturbation(model, la, x, y, GaussianLikelihood(sigma), correction=True)
    torch.testing.assert_close(same.loo_logits[:, 0], want, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("bad", ["gaussian", "categorical", "bernoulli", GaussianLikelihood(2.0)])
def test_an_explicit_likelihood_that_disagrees_with_the_laplace_is_refused(bad):
    x, y, sigma, _ = _ridge_problem()
    model = nn.Linear(3, 1, bias=False).to(D).eval()
    la = Laplace(model, "regression", "all", "full", sigma_noise=sigma).fit([(x, y)])
    with pytest.raises(ValueError, match="does not match the fitted Laplace"):
        memory_perturbation(model, la, x, y, bad)


def test_bernoulli_laplace_works_and_matches_the_dense_formula():
    torch.manual_seed(0)
    x = torch.randn(12, 3, dtype=D)
    yb = (x[:, 0] > 0).to(D)
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 1)).to(D).eval()
    la = Laplace(model, "bernoulli", "all", "full", prior_precision=0.5).fit([(x, yb)])
    mp = memory_perturbation(model, la, x, yb, covariance="full")
    w = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    jac = dense_jacobian(model, x, w)[:, 0]  # [N, P]
    f = forward_at(model, w, x)[:, 0].detach()
    p = torch.sigmoid(f)
    lam = p * (1 - p)
    prec = jac.T @ (lam[:, None] * jac) + 0.5 * torch.eye(len(w), dtype=D)
    v = torch.einsum("np,pq,nq->n", jac, torch.linalg.inv(prec), jac)
    loo = f + (p - yb) * v
    torch.testing.assert_close(mp.loo_logits[:, 0], loo, rtol=1e-8, atol=1e-12)
    nll = nn.functional.binary_cross_entropy_with_logits(loo, yb)
    assert mp.loo_summary()["loo_nll"] == pytest.approx(float(nll), rel=1e-8)


def test_softmax_over_one_output_is_refused():
    x, _, _, _ = _ridge_problem()
    model = nn.Linear(3, 1, bias=False).to(D).eval()
    q = fromp.DiagonalGaussian(model.weight.detach().reshape(-1), torch.ones(3, dtype=D))
    with pytest.raises(ValueError, match="at least 2 outputs"):
        memory_perturbation(model, q, x, torch.zeros(len(x), dtype=torch.long))


def test_corrected_diagonal_form_refused_where_one_minus_lambda_v_is_not_positive():
    """The audit's case (float64 3-4-3 MLP, 12 points, all/full Laplace, delta = 0.5) gave
    LOO NLL 6.9e14 as an ordinary number; it is refused naming how many examples."""
    old = torch.get_default_dtype()
    torch.set_default_dtype(D)  # the audit's reproducer, exactly
    try:
        torch.manual_seed(0)
        x = torch.randn(12, 3)
        y = torch.randint(0, 3, (12,))
        torch.manual_seed(1)
        m = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 3)).eval()
    finally:
        torch.set_default_dtype(old)
    la = Laplace(m, "classification", "all", "full", prior_precision=0.5).fit([(x, y)])
    plain = memory_perturbation(m, la, x, y)  # lambda and v, checked against dense elsewhere
    bad = int(((1 - plain.lam * plain.variance) <= 0).any(-1).sum())
    assert bad > 0
    with pytest.raises(ValueError, match=f"for {bad} of 12 examples"):
        memory_perturbation(m, la, x, y, covariance="diag", correction=True)
    full = memory_perturbation(m, la, x, y, covariance="full", correction=True).loo_summary()
    assert math.isfinite(full["loo_nll"]) and full["loo_nll"] < 100


def test_unknown_covariance_form_is_refused_naming_the_argument():
    """``covariance`` is ``"diag"`` or ``"full"``: 0.3's ``"diagonal"`` and any other form are
    refused naming the argument."""
    torch.manual_seed(0)
    x, y = torch.randn(10, 3), torch.randint(0, 3, (10,))
    m = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 3)).eval()
    la = Laplace(m, "classification", "all", "diag", prior_precision=1.0).fit([(x, y)])
    new = memory_perturbation(m, la, x, y, covariance="diag")
    full = memory_perturbation(m, la, x, y, covariance="full")
    assert not torch.allclose(full.loo_logits, new.loo_logits)  # the forms differ
    for bad in ("kron", "diagonal"):
        with pytest.raises(ValueError, match="covariance must be one of"):
            memory_perturbation(m, la, x, y, covariance=bad)


def _clf(c=3):
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, c)).to(D).eval()


@pytest.mark.parametrize("label", [5, -1, 3])
def test_labels_outside_the_head_refused_naming_y(label):
    x = torch.randn(8, 4, dtype=D)
    y = torch.zeros(8, dtype=torch.long)
    y[3] = label
    m = _clf()
    w = torch.cat([p.detach().reshape(-1) for p in m.parameters()])
    q_full = FullGaussian(w, torch.eye(len(w), dtype=D))
    q_diag = fromp.DiagonalGaussian(w, torch.ones(len(w), dtype=D))
    match = f"y holds label {label}"
    with pytest.raises(ValueError, match=match):
        memory_perturbation(m, q_diag, x, y)
    with pytest.raises(ValueError, match=match):
        newton_step_loo(m, q_full, x, y)
    with pytest.raises(ValueError, match=match):
        last_layer_loo(m, x, y, 1.0)
    with pytest.raises(ValueError, match=match):
        LOOTracker(prior_precision=1.0)(m, x, y)


def test_bernoulli_labels_outside_0_1_refused():
    x = torch.randn(8, 4, dtype=D)
    m = _clf(1)
    w = torch.cat([p.detach().reshape(-1) for p in m.parameters()])
    q = fromp.DiagonalGaussian(w, torch.ones(len(w), dtype=D))
    with pytest.raises(ValueError, match=r"y holds label 2, outside \{0, 1\}"):
        memory_perturbation(m, q, x, torch.full((8,), 2.0, dtype=D), "bernoulli")


@pytest.mark.parametrize("bad", [float("inf"), float("nan"), 0.0, -1.0])
def test_tracker_and_last_layer_loo_refuse_bad_prior_precision(bad):
    m = _clf()
    x, y = torch.randn(8, 4, dtype=D), torch.zeros(8, dtype=torch.long)
    with pytest.raises(ValueError, match="prior_precision"):
        last_layer_loo(m, x, y, bad)
    with pytest.raises(ValueError, match="prior_precision"):
        LOOTracker(prior_precision=bad)


def test_tracker_refuses_fractional_max_examples_and_x_without_y():
    with pytest.raises(ValueError, match="max_examples"):
        LOOTracker(max_examples=2.5)
    with pytest.raises(ValueError, match="y is required"):
        LOOTracker(prior_precision=1.0)(_clf(), torch.randn(8, 4, dtype=D))


def test_tracker_refuses_adamw_decoupled_weight_decay_as_a_prior():
    m = _clf()
    x, y = torch.randn(8, 4, dtype=D), torch.zeros(8, dtype=torch.long)
    with pytest.raises(ValueError, match="decoupled"):
        LOOTracker()(m, x, y, torch.optim.AdamW(m.parameters(), lr=0.1))
    adam = torch.optim.Adam(m.parameters(), lr=0.1, weight_decay=0.01)  # L2: accepted
    assert LOOTracker()(m, x, y, adam)["prior_precision"] == pytest.approx(0.08)


def test_tracker_record_reports_the_examples_of_the_fit():
    m = _clf()
    x, y = torch.randn(48, 4, dtype=D), torch.randint(0, 3, (48,))
    rec = LOOTracker(prior_precision=1.0, max_examples=5)(m, x, y)
    assert rec["n"] == 5 and rec["curvature_examples"] == 5


class _TwoHeads(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Linear(4, 5)
        self.heads = nn.ModuleList([nn.Linear(5, 2), nn.Linear(5, 2)])

    def forward(self, x, task=0):
        return self.heads[task](torch.tanh(self.body(x)))


def test_recorded_tracker_follows_the_current_head_across_experiences():
    """After an estimate, the next recording may use another head (a multi-head model's next
    task) instead of refusing it as 'the output layer changed'."""
    torch.manual_seed(0)
    net = _TwoHeads().to(D)
    tracker = LOOTracker(prior_precision=1.0)
    for task in (0, 1, 0):
        x, y = torch.randn(10, 4, dtype=D), torch.randint(0, 2, (10,))
        with tracker.recording(net):
            net(x, task)
            tracker.observe(y)
        rec = tracker(_Fixed(net, task), optimizer=None)
        ref = last_layer_loo(_Fixed(net, task), x, y, 1.0).summary()
        assert rec["loo_nll"] == pytest.approx(ref["loo_nll"], rel=1e-8)


class _Fixed(nn.Module):
    def __init__(self, net, task):
        super().__init__()
        self.net, self.task = net, task

    def forward(self, x):
        return self.net(x, self.task)


def test_loo_plugin_recorded_on_an_avalanche_multi_head_model_after_experience_1():
    """``LOOPlugin(recorded=True)`` on ``MTSimpleMLP`` (a head per task label) went on past
    experience 0 with the tracker following the current experience's head (it raised
    'the output layer changed' at the start of experience 1)."""
    from avalanche.benchmarks.scenarios.deprecated.generators import nc_benchmark
    from avalanche.benchmarks.utils import _make_taskaware_tensor_classification_dataset
    from avalanche.models import MTSimpleMLP
    from avalanche.training.supervised import Naive
    from fromp_avalanche.loo import LOOPlugin

    def data(n, seed):
        g = torch.Generator().manual_seed(seed)
        y = torch.arange(n) % 6
        x = torch.randn(n, 8, generator=g)
        x[:, :6] += 2.0 * nn.functional.one_hot(y, 6).float()
        return _make_taskaware_tensor_classification_dataset(x, y, targets=y.tolist())

    bm = nc_benchmark(data(60, 0), data(30, 1), n_experiences=3, task_labels=True,
                      shuffle=False, fixed_class_order=list(range(6)))  # fmt: skip
    torch.manual_seed(0)
    model = MTSimpleMLP(input_size=8, hidden_size=6)
    plugin = LOOPlugin(recorded=True, prior_precision=1.0)
    strategy = Naive(
        model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.05),
        criterion=nn.CrossEntropyLoss(), train_mb_size=10, train_epochs=2,
        plugins=[plugin], evaluator=None,
    )  # fmt: skip
    for exp in bm.train_stream:
        strategy.train(exp)
    assert [h["experience"] for h in plugin.history] == [0, 0, 1, 1, 2, 2]
    assert all(h["n"] == 20 and math.isfinite(h["loo_nll"]) for h in plugin.history)
