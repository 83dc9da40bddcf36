"""VCLMethod in a plain loop (no Avalanche): the ELBO's KL against a dense float64 closed
form, the posterior of task t as the prior of task t + 1 (after tasks 2 and 3, one head and
task heads, fromp networks, a user's Bayesian network and any module), coresets, state
round trip and refusals, the one name for the prior, ``prior_precision``; and the Avalanche
strategy giving the plain loop's numbers."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import fromp
from fromp.continual.bayesian import BayesMultiHeadModel, MeanFieldTwin, to_bayesian
from fromp.continual.coreset import kcenter_coreset
from fromp.continual.vcl import VCLMethod
from fromp.models import MultiHeadMLP

D = torch.float64


def _tasks(n_tasks=3, n=24, d=5, seed=0, dtype=D):
    g = torch.Generator().manual_seed(seed)
    out = []
    for t in range(n_tasks):
        x = torch.randn(n, d, generator=g, dtype=dtype) + t
        y = (x[:, 0] + x[:, 1] > 2 * t).long()
        out.append((x, y))
    return out


def _dense_kl(mu, var, mu0, var0) -> torch.Tensor:
    """``KL(N(mu, S) || N(mu0, S0))`` of dense ``[P, P]`` covariances in float64:
    ``0.5 (tr(S0^-1 S) + (mu0 - mu)^T S0^-1 (mu0 - mu) - P + log det S0 - log det S)``."""
    mu, var, mu0, var0 = (t.detach().reshape(-1).to(D) for t in (mu, var, mu0, var0))
    s, s0 = torch.diag(var), torch.diag(var0)
    s0_inv = torch.linalg.inv(s0)
    d = mu0 - mu
    return 0.5 * (
        torch.trace(s0_inv @ s) + d @ s0_inv @ d - len(mu) + torch.logdet(s0) - torch.logdet(s)
    )


def _parts(method: VCLMethod, heads) -> list[tuple]:
    """``(mu, var, mu0, var0)`` of the body's and the given heads' Gaussian weights, read
    from where each holder keeps them: a ``BayesMultiHeadModel``'s parameters and buffers by
    name, or the user's network's parameters and a ``MeanFieldTwin``'s log-variances and
    priors by parameter name."""
    q = method.mean_field
    if isinstance(q, BayesMultiHeadModel):
        sd = dict(q.named_parameters()) | dict(q.named_buffers())
        out = []
        for name in sd:
            if not name.endswith("_mu") or "prior" in name:
                continue
            if name.startswith("heads.") and int(name.split(".")[1]) not in heads:
                continue
            base = name.removesuffix("_mu")
            out.append(
                (sd[name], sd[base + "_logvar"].exp(), sd[base + "_prior_mu"],
                 sd[base + "_prior_var"])
            )  # fmt: skip
        return out
    out = []
    for name, p in method.model.named_parameters():
        if name.startswith("heads.") and int(name.split(".")[1]) not in heads:
            continue
        key = name.replace(".", "__")
        out.append((p, q.logvars[key].exp(), q.prior_mean[name], q.prior_variance[name]))
    return out


def _prior(method: VCLMethod, head: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The prior ``(mu0, var0)`` of head ``head``'s weight."""
    q = method.mean_field
    if isinstance(q, BayesMultiHeadModel):
        return q.heads[head].weight_prior_mu, q.heads[head].weight_prior_var
    name = f"heads.{head}.weight"
    return q.prior_mean[name], q.prior_variance[name]


def _dense_total(parts) -> torch.Tensor:
    mu, var, mu0, var0 = (torch.cat([p[i].detach().reshape(-1) for p in parts]) for i in range(4))
    return _dense_kl(mu, var, mu0, var0)


def _train(method: VCLMethod, x, y, task, steps=6, lr=0.05, bs=8):
    opt = torch.optim.Adam(method.parameters(), lr=lr)
    losses = []
    for k in range(steps):
        i = torch.arange(k * bs, (k + 1) * bs) % len(x)
        loss = method.loss(x[i], y[i], task)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    return losses


def _kl_term(method: VCLMethod) -> torch.Tensor:
    """The method's loss term ``KL(q || q_{t-1}) / N_t`` (the protocol's loss_terms)."""
    x = torch.zeros(1, 1, dtype=D)
    return method.loss_terms(method.model, x, x)


@pytest.mark.parametrize("kind", ["twin", "bayes"])
def test_penalty_is_the_dense_kl_over_body_and_trained_heads_after_tasks_1_2_3(kind):
    """The user's ``MultiHeadMLP`` (the twin keeps its variances) and a user's
    ``BayesMultiHeadModel``: the KL over the body and the heads trained so far."""
    torch.manual_seed(0)
    net = MultiHeadMLP(5, (6,), n_heads=4, head_size=2).double()
    if kind == "bayes":
        net = to_bayesian(net)
    method = VCLMethod(net, prior_precision=2.0, train_samples=2, seed=0)
    assert method.model is net
    assert isinstance(method.mean_field, MeanFieldTwin if kind == "twin" else BayesMultiHeadModel)
    for t, (x, y) in enumerate(_tasks()):
        method.begin_task(net, task=t, ess=len(x))
        _train(method, x, y, t)
        # body + heads 0..t (trained or being trained): head 3 never enters
        want = _dense_total(_parts(method, set(range(t + 1)))) / len(x)
        got = _kl_term(method)
        assert float(want) > 1e-3
        torch.testing.assert_close(got, want.to(got.dtype), rtol=1e-10, atol=1e-12)
        # with every head, the value differs (the untrained head's KL is not zero)
        assert abs(float(_dense_total(_parts(method, {0, 1, 2, 3})) / len(x) - want)) > 1e-6
        method.learn_task(net, None, None, None)


@pytest.mark.parametrize("kind", ["task-heads", "one-head", "any-module", "bayes"])
def test_plain_loop_posterior_of_task_t_is_the_prior_of_task_t_plus_1(kind):
    torch.manual_seed(1)
    if kind in ("task-heads", "bayes"):
        net = MultiHeadMLP(5, (6,), n_heads=3, head_size=2).double()
        net = to_bayesian(net) if kind == "bayes" else net
    elif kind == "one-head":
        net = MultiHeadMLP(5, (6,), n_heads=1, head_size=2).double()
    else:
        net = nn.Sequential(nn.Linear(5, 6), nn.Tanh(), nn.Linear(6, 2)).double()
    method = VCLMethod(net, prior_precision=4.0, ml_init_epochs=2, ml_lr=0.01, train_samples=3)
    assert isinstance(method.mean_field, BayesMultiHeadModel if kind == "bayes" else MeanFieldTwin)
    heads = kind in ("task-heads", "bayes")
    head = (lambda t: t) if heads else (lambda t: 0)
    posterior = None
    for t, (x, y) in enumerate(_tasks()):
        method.begin_task(net, task=t, ess=len(x))
        if t > 0:  # at the start of a task only its new head (if any) is off its prior
            new = _dense_total(_parts(method, {t})) if heads else 0.0
            if heads:
                new = new - _dense_total(_parts(method, set()))  # the body's: 0
            torch.testing.assert_close(
                _kl_term(method), torch.as_tensor(new, dtype=D) / len(x), rtol=1e-9, atol=1e-12
            )
        method.ml_init(x, y, batch_size=8)  # task 1 only
        _train(method, x, y, t)
        sites = method.mean_field.gaussian_sites(method.kl_heads(head(t)))
        if posterior is not None:  # tasks 2 and 3: the prior is the previous posterior
            assert len(posterior) <= len(sites)
            for (_, _, m0, v0), (pm, pv) in zip(sites, posterior):
                assert torch.equal(m0, pm) and torch.equal(v0, pv)
            # ... and training moved the posterior off it
            assert any(not torch.equal(m, pm) for (m, _, _, _), (pm, _) in zip(sites, posterior))
        if heads:  # a head not trained yet keeps N(0, 1 / prior_precision)
            for h in range(t + 1, 3):
                mu0, var0 = _prior(method, h)
                assert torch.all(var0 == 0.25) and torch.all(mu0 == 0.0)
        method.learn_task(net, None, None, None)
        assert method.task_count == t + 1 and method.seen_heads == {head(s) for s in range(t + 1)}
        posterior = [(m.detach().clone(), lv.detach().exp()) for m, lv, _, _ in sites]
        # right after learn_task: the KL over what was learnt is zero
        kl = method.mean_field.kl(method.kl_heads())
        assert float(kl.detach()) == pytest.approx(0, abs=1e-12)
    log_p = method.predict_log_proba(_tasks()[0][0], 0)
    torch.testing.assert_close(log_p.exp().sum(-1), torch.ones(len(log_p), dtype=D))
    if kind != "bayes":  # at the means: the user's network's own prediction
        x0 = _tasks()[0][0]
        direct = net(x0, task=0) if heads else net(x0)
        torch.testing.assert_close(log_p, direct.log_softmax(-1), rtol=0, atol=0)


def test_coreset_selection_kcenter_and_random():
    torch.manual_seed(0)
    (x0, y0), (x1, y1), _ = _tasks(n=30)
    m = VCLMethod(
        MultiHeadMLP(5, (4,), n_heads=3, head_size=2).double(),
        coreset_size=5,
        coreset_method="kcenter",
    )
    xr, _ = m.split_coreset(x0, y0, 0)
    idx = kcenter_coreset(x0, 5)
    assert idx[0] == 0  # the first example first, as the reference code
    h, cx, cy = m.coresets[0]
    assert h == 0 and torch.equal(cx, x0[idx]) and torch.equal(cy, y0[idx])
    assert len(xr) == 25 and not (cx[:, None] == xr[None]).all(-1).any()  # kept out
    assert torch.equal(torch.cat([cx, xr]).sort(0).values, x0.sort(0).values)
    m.split_coreset(x1, y1, 1)
    assert [h for h, _, _ in m.coresets] == [0, 1]
    # random: reproducible from the seed and the task counter, different across tasks
    picks = []
    for _ in range(2):
        r = VCLMethod(nn.Linear(5, 2), coreset_size=4, coreset_method="random", seed=7)
        a = r.coreset_indices(30)
        r.learn_task(r.model, None, None, None)
        picks.append((a, r.coreset_indices(30)))
    assert torch.equal(picks[0][0], picks[1][0]) and torch.equal(picks[0][1], picks[1][1])
    assert not torch.equal(picks[0][0], picks[0][1])
    with pytest.raises(ValueError, match="coreset_size=4 must be smaller"):
        r.coreset_indices(4)
    with pytest.raises(ValueError, match="coreset_method"):
        VCLMethod(nn.Linear(5, 2), coreset_size=3)


def test_coreset_training_uses_the_task_head_and_restore_gives_the_propagated_posterior():
    torch.manual_seed(0)
    net = MultiHeadMLP(5, (4,), n_heads=3, head_size=2).double()
    m = VCLMethod(net, coreset_size=4, coreset_method="kcenter", train_samples=2, seed=1)
    q = m.mean_field
    for t, (x, y) in enumerate(_tasks(n_tasks=2)):
        x, y = m.split_coreset(x, y, t)
        m.begin_task(net, task=t, ess=len(x))
        _train(m, x, y, t)
        m.learn_task(net, None, None, None)
    propagated = {k: v.clone() for k, v in q.state_dict().items()}
    assert m.prepare_eval(1, epochs=3, lr=0.05, batch_size=2)
    now = q.state_dict()
    assert not torch.equal(now["model.heads.1.weight"], propagated["model.heads.1.weight"])
    assert not torch.equal(now["model.body.1.weight"], propagated["model.body.1.weight"])
    assert torch.equal(net.heads[1].weight, now["model.heads.1.weight"])  # the user's net
    # no data through head 0 and its mean at its prior's: its mean stays (its log-variance
    # may drift: Adam scales up the rounding-level KL gradient at the prior)
    assert torch.equal(now["model.heads.0.weight"], propagated["model.heads.0.weight"])
    # head 2, never trained, is in neither term
    untrained = [k for k in propagated if k.startswith(("model.heads.2.", "logvars.heads__2"))]
    assert len(untrained) == 4
    assert all(torch.equal(now[k], propagated[k]) for k in untrained)
    assert m.prepare_eval(1, epochs=3, lr=0.05, batch_size=2)  # tuned already: kept
    assert not m.prepare_eval(2, epochs=3, lr=0.05, batch_size=2)  # no coreset: propagated
    assert all(torch.equal(v, propagated[k]) for k, v in q.state_dict().items())
    m.prepare_eval(0, epochs=3, lr=0.05, batch_size=2)
    tuned = {k: v.clone() for k, v in q.state_dict().items()}
    with pytest.raises(ValueError, match="epochs"):
        m.prepare_eval(1)  # neither the call nor the method says how long: refused ...
    assert all(torch.equal(v, tuned[k]) for k, v in q.state_dict().items())  # ... first
    m.restore()
    assert all(torch.equal(v, propagated[k]) for k, v in q.state_dict().items())


def _trained(kind: str, tasks: int, **kw):
    torch.manual_seed(3)
    if kind == "bayes":
        net = to_bayesian(MultiHeadMLP(5, (4,), n_heads=3, head_size=2).double())
    elif kind == "heads":
        net = MultiHeadMLP(5, (4,), n_heads=3, head_size=2).double()
    else:
        net = nn.Sequential(nn.Linear(5, 4), nn.Tanh(), nn.Linear(4, 2)).double()
    m = VCLMethod(net, train_samples=2, seed=5, **kw)
    for t, (x, y) in enumerate(_tasks()[:tasks]):
        x, y = m.split_coreset(x, y, t)
        m.begin_task(net, task=t, ess=len(x))
        _train(m, x, y, t)
        m.learn_task(net, None, None, None)
    return m


@pytest.mark.parametrize("kind", ["bayes", "heads", "twin"])
def test_state_round_trip_resumes_exactly_and_other_settings_are_refused(kind):
    """The method's state with the network's own ``state_dict`` (the means) beside it."""
    kw = dict(coreset_size=3, coreset_method="random", prior_precision=2.0)
    a = _trained(kind, 2, **kw)
    state = a.state_dict()
    if kind != "bayes":  # the means are the network's, not the method's state
        assert set(state["mean_field"]) == {"logvars", "prior_mean", "prior_variance"}
    b = _trained(kind, 0, **kw)
    b.model.load_state_dict(a.model.state_dict())
    b.load_state_dict(state)
    assert b.task_count == 2 and b.seen_heads == a.seen_heads and b.seed == a.seed
    assert all(torch.equal(u[1], v[1]) for u, v in zip(a.coresets, b.coresets))
    a_state = a.mean_field.state_dict()
    assert all(torch.equal(v, a_state[k]) for k, v in b.mean_field.state_dict().items())
    for m0a, m0b in zip(a.mean_field.gaussian_sites(), b.mean_field.gaussian_sites()):
        assert torch.equal(m0a[2], m0b[2]) and torch.equal(m0a[3], m0b[3])  # the priors
    # task 3 from the loaded state: the very numbers of the uninterrupted run
    x, y = _tasks()[2]
    runs = []
    for m in (a, b):
        xs, ys = m.split_coreset(x, y, 2)
        m.begin_task(m.model, task=2, ess=len(xs))
        torch.manual_seed(11)
        runs.append(_train(m, xs, ys, 2))
    assert runs[0] == runs[1]
    # other settings: refused before anything changes
    for other in (
        dict(kw, prior_precision=1.0),
        dict(kw, coreset_size=4),
        dict(kw, coreset_method="kcenter"),
    ):
        c = _trained(kind, 0, **other)
        before = {k: v.clone() for k, v in c.mean_field.state_dict().items()}
        with pytest.raises(ValueError, match="state was saved with"):
            c.load_state_dict(state)
        assert c.task_count == 0 and not c.coresets
        assert all(torch.equal(v, before[k]) for k, v in c.mean_field.state_dict().items())
    with pytest.raises(ValueError, match="missing"):
        b.load_state_dict({"mean_field": state["mean_field"]})
    if kind != "bayes":  # a state of another network: refused before anything changes
        c = _trained(kind, 0, **kw)
        other = {**state, "mean_field": {**state["mean_field"], "logvars": {}}}
        with pytest.raises(ValueError, match="logvars"):
            c.load_state_dict(other)
        assert c.task_count == 0


def test_prior_precision_is_the_one_name_of_the_prior():
    import inspect

    m = VCLMethod(MultiHeadMLP(3, (2,), n_heads=1, head_size=2), prior_precision=4.0)
    assert m.prior_precision == 4.0
    assert torch.all(m.mean_field.prior_variance["heads.0.weight"] == 0.25)
    assert "prior_var" not in inspect.signature(VCLMethod).parameters
    with pytest.raises(TypeError, match="prior_var"):
        VCLMethod(nn.Linear(3, 2), prior_var=0.5)  # type: ignore[call-arg]
    assert fromp.VCLMethod is VCLMethod


@pytest.mark.parametrize(
    ("kwargs", "name"),
    [
        ({"train_samples": 0}, "train_samples"),
        ({"test_samples": 1.5}, "test_samples"),
        ({"coreset_size": -1}, "coreset_size"),
        ({"coreset_size": 2, "coreset_method": "greedy"}, "coreset_method"),
        ({"prior_precision": 0.0}, "prior_precision"),
        ({"prior_precision": float("nan")}, "prior_precision"),
        ({"ml_init_epochs": -1}, "ml_init_epochs"),
        ({"ml_lr": -1.0}, "ml_lr"),
        ({"mean_init_std": 0.0}, "mean_init_std"),
        ({"init_logvar": float("inf")}, "init_logvar"),
        ({"seed": 1.5}, "seed"),
    ],
)
def test_bad_settings_are_refused_before_any_work(kwargs, name):
    net = MultiHeadMLP(3, (2,), n_heads=2, head_size=2)
    rng = torch.random.get_rng_state()
    with pytest.raises(ValueError, match=name):
        VCLMethod(net, **kwargs)
    # refused before the means are re-drawn or the seed drawn
    assert torch.equal(rng, torch.random.get_rng_state())


def test_refusals_in_the_loop():
    m = VCLMethod(MultiHeadMLP(3, (2,), n_heads=2, head_size=2), train_samples=1)
    with pytest.raises(ValueError, match="begin_task"):
        _kl_term(m)
    with pytest.raises(ValueError, match="ess"):
        m.begin_task(m.model, task=0, ess=0)
    with pytest.raises(ValueError, match="ess"):
        m.begin_task(m.model, task=0)
    with pytest.raises(ValueError, match="task must be an int"):
        m.begin_task(m.model, task=None, ess=5)
    with pytest.raises(ValueError, match="task must be an int"):
        m.begin_task(m.model, task=torch.tensor([0, 1]), ess=5)
    with pytest.raises(ValueError, match="the network the VCLMethod was built on"):
        m.begin_task(nn.Linear(3, 2), task=0, ess=5)
    assert m.ess is None  # nothing set by the refused calls
    with pytest.raises(ValueError, match="y must be"):
        m.ml_init(
            torch.randn(4, 3), torch.zeros(3, dtype=torch.long), epochs=1, lr=0.1, batch_size=2
        )


def test_the_users_optimizer_takes_the_log_variances_and_follows_a_grown_head():
    """A plain loop's optimizer on ``net.parameters()``: :meth:`add_variance_group` adds the
    log-variances as one group with the optimizer's defaults; after the head grows,
    :meth:`sync` puts the grown log-variance in that group, its stale Adam moments dropped,
    the others' kept; a bad group is refused before the posterior changes."""
    net = nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 2)).double()
    method = VCLMethod(net)
    opt = torch.optim.Adam([{"params": list(net.parameters()), "lr": 0.1}], lr=0.02)
    assert method.add_variance_group(opt) == 1
    assert opt.param_groups[1]["lr"] == 0.02  # the optimizer's default
    assert opt.param_groups[1]["params"] == method.variance_parameters()
    method.begin_task(net, ess=8)
    x, y = torch.randn(8, 3, dtype=D), torch.tensor([0, 1] * 4)
    nll, logits = method.nll(x, y, None)
    (nll + method.loss_terms(net, x, logits)).backward()
    opt.step()
    old = method.variance_parameters()
    assert all(p in opt.state for p in old)
    net[2] = nn.Linear(4, 3).double()  # one more class: a grown head
    with pytest.raises(ValueError, match="group must be"):
        method.sync(opt, 2)
    assert method.variance_parameters() == old  # refused before the posterior changed
    assert method.sync(opt, 1)
    now = method.variance_parameters()
    assert opt.param_groups[1]["params"] == now and len(now) == len(old)
    assert now[0] is old[0] and now[0] in opt.state  # the body's: moments kept
    assert now[2] is not old[2] and now[2].shape == (3, 4)  # the grown head's: new
    assert not any(p in opt.state for p in set(old) - set(now))
    assert not method.sync(opt, 1)  # nothing grew since
    with pytest.raises(ValueError, match=r"optimizer must be a torch\.optim\.Optimizer"):
        method.add_variance_group(object())


def test_samples_loss_is_the_mean_over_samples_of_the_criterion():
    """``mean_s CE(f_s, y)``, by a loop over the samples in float64 (and a user's criterion
    gets the stacked ``[S N, K]`` logits and ``y`` repeated per sample)."""
    g = torch.Generator().manual_seed(1)
    logits, y = torch.randn(3, 5, 4, generator=g, dtype=D), torch.tensor([0, 3, 1, 2, 3])
    ref = sum(nn.functional.cross_entropy(logits[s], y) for s in range(3)) / 3
    torch.testing.assert_close(VCLMethod.samples_loss(logits, y), ref, rtol=1e-12, atol=0)
    seen = VCLMethod.samples_loss(logits, y, lambda f, t: torch.stack([f.sum(), t.sum()]))
    torch.testing.assert_close(seen, torch.stack([logits.sum(), y.sum() * 3.0]).to(D))


def test_the_strategy_gives_the_plain_loops_numbers():
    """The Avalanche strategy (no shuffling, the global RNG re-seeded before each training
    step) and a plain loop over the same data with the same seeds: the same losses, the same
    coresets and the same posterior."""
    from avalanche.training.plugins import SupervisedPlugin
    from fromp_avalanche.vcl import VCL
    from fromp_bench.data import to_avalanche

    from tests.cases import synthetic_split

    seq = synthetic_split(n_tasks=3, input_shape=(6,), train_size=20, test_size=10)
    settings = dict(
        train_samples=2,
        test_samples=3,
        ml_init_epochs=1,
        ml_lr=0.01,
        coreset_size=3,
        coreset_method="kcenter",
        prior_precision=2.0,
        seed=4,
    )
    lr, bs, epochs = 0.01, 8, 2

    class Seeder(SupervisedPlugin):
        def __init__(self):
            super().__init__()
            self.step, self.losses = 0, []

        def before_forward(self, strategy, **kw):
            torch.manual_seed(100 + self.step)
            self.step += 1

        def after_backward(self, strategy, **kw):
            self.losses.append(float(strategy.loss.detach()))

    torch.manual_seed(0)
    net = MultiHeadMLP(6, (5,), n_heads=3, head_size=2)
    model_opt = torch.optim.Adam(net.parameters(), lr=lr)
    seeder = Seeder()
    with pytest.warns(UserWarning, match="log-variance"):
        strat = VCL(
            model=net,
            optimizer=model_opt,
            train_mb_size=bs,
            train_epochs=epochs,
            evaluator=None,
            plugins=[seeder],
            **settings,
        )
    for exp in to_avalanche(seq).train_stream:
        strat.train(exp, shuffle=False)

    torch.manual_seed(0)
    plain = MultiHeadMLP(6, (5,), n_heads=3, head_size=2)
    method = VCLMethod(plain, **settings)
    opt = torch.optim.Adam(method.parameters(), lr=lr)
    losses, step = [], 0
    for t, task in enumerate(seq):
        x, y = method.split_coreset(task.train_x, task.train_y, t)
        method.begin_task(plain, task=t, ess=len(x))
        method.ml_init(x, y, epochs=1, batch_size=bs)
        for _ in range(epochs):
            for s in range(0, len(x), bs):
                torch.manual_seed(100 + step)
                step += 1
                loss = method.loss(x[s : s + bs], y[s : s + bs], t)
                opt.zero_grad()
                loss.backward()
                opt.step()
                losses.append(float(loss.detach()))
        method.learn_task(plain, x, y, t, optimizer=opt)  # a fresh Adam state per task

    assert len(losses) == len(seeder.losses) == 3 * epochs * 3
    assert losses == seeder.losses
    for (h, cx, cy), (h2, cx2, cy2) in zip(strat.method.coresets, method.coresets):
        assert h == h2 and torch.equal(cx, cx2) and torch.equal(cy, cy2)
    mine = strat.method.mean_field.state_dict()
    for k, v in method.mean_field.state_dict().items():
        assert torch.equal(v, mine[k]), k
    assert strat.model is net  # the user's network holds the posterior means
    for (k, v), w in zip(plain.state_dict().items(), net.state_dict().values(), strict=True):
        assert torch.equal(v, w), k


def test_the_plain_loop_of_the_avalanche_guide_runs():
    """docs/avalanche.md's VCL loop, run as written (an empty namespace, its 3 stand-in tasks
    of 96 examples)."""
    from tests.docs.test_docs_examples import run_doc_block

    env = run_doc_block("avalanche.md", "VCL in a plain loop")
    method = env["method"]
    # the user's network is the means: no network of the method's own
    assert not hasattr(method, "net") and method.model is env["net"]
    assert method.mean_field.model is env["net"]
    assert method.task_count == 3 and method.seen_heads == {0, 1, 2}
    assert [h for h, _, _ in method.coresets] == [0, 1, 2] and len(method.coresets[0][1]) == 40
    probs = env["probs"]
    assert probs.shape == (96, 2)
    torch.testing.assert_close(probs.sum(1), torch.ones(96))
    net = env["MultiHeadMLP"](784, (256, 256), n_heads=5, head_size=2)
    fresh = VCLMethod(net, prior_precision=1.0, coreset_size=40, coreset_method="kcenter")
    net.load_state_dict(env["net"].state_dict())
    fresh.load_state_dict(env["state"])
    torch.testing.assert_close(fresh.mean_field.kl(), method.mean_field.kl())
