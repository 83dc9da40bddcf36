"""IVON: the update against the paper's formulas computed by hand in float64, sampling and
restoring the mean, parameter groups, the posterior as a DNN2GP kernel against the dense
``J Sigma J^T``, continual priors, checkpoints and argument checks."""

from __future__ import annotations

import copy
from collections import defaultdict

import pytest
import torch
from avalanche.models.dynamic_optimizers import update_optimizer

import fromp
from fromp.optim import IVON
from fromp.posterior import DiagonalGaussian
from fromp.testing import dense_jacobian, flat, forward_at
from tests.cases import tiny_cnn, tiny_mlp

D = torch.float64


def _data(n: int = 12, d: int = 4, c: int = 3, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, d, generator=g, dtype=D), torch.randint(0, c, (n,), generator=g)


def _loss(net, w, x, y):
    return torch.nn.functional.cross_entropy(forward_at(net, w, x), y)


def _coord(net, groups_spec, key, default):
    """A per-coordinate ``[P]`` vector of a hyperparameter in ``named_parameters`` order."""
    out = []
    for name, p in net.named_parameters():
        v = groups_spec.get(name.split(".")[0], {}).get(key, default)
        out.append(torch.full((p.numel(),), float(v), dtype=D))
    return torch.cat(out)


def _reference(
    net, x, y, steps, *, lr, ess, h0, b1, b2, wd, mc, seed, spec, prior=None, clip=None,
    mean_grad=None, antithetic=False,
):  # fmt: skip
    """IVON by hand on flat vectors: noise drawn in the same order as the optimiser (one
    ``randn`` per parameter group per draw), every formula of the paper spelt out.
    ``mean_grad(m)``: the gradient of a term evaluated at the mean, added to ``g^`` only.
    ``antithetic``: every second draw (counted over the whole run) is ``-z`` of the one
    before."""
    torch.manual_seed(seed)
    m = flat(net).clone()
    lr_v = _coord(net, spec, "lr", lr)
    wd_v = _coord(net, spec, "weight_decay", wd)
    h = _coord(net, spec, "hess_init", h0)
    alpha = lr_v * (h + wd_v)  # rescale_lr: lr (h0 + weight decay)
    if prior is None:
        delta, m0 = wd_v, torch.zeros_like(m)
    else:
        delta, m0 = prior.precision / ess, prior.mean
    g = torch.zeros_like(m)
    # one flat draw per parameter group (one group per child module, as _groups builds them)
    sizes = [sum(p.numel() for p in mod.parameters()) for mod in net.children()]
    sizes = [k for k in sizes if k]
    n_drawn, z_prev = 0, None
    for t in range(1, steps + 1):
        sigma2 = 1.0 / (ess * (h + delta))
        g_hat = torch.zeros_like(m)
        h_hat = torch.zeros_like(m)
        for _ in range(mc):
            if antithetic and n_drawn % 2 == 1:
                z = -z_prev
            else:
                z = z_prev = torch.cat([torch.randn(k, dtype=D) for k in sizes])
            n_drawn += 1
            eps = z * sigma2.sqrt()
            theta = (m + eps).requires_grad_(True)
            gi = torch.autograd.grad(_loss(net, theta, x, y), theta)[0]
            g_hat += gi / mc
            h_hat += gi * eps / sigma2 / mc
        if mean_grad is not None:
            g_hat = g_hat + mean_grad(m)  # enters g only: h_hat is from the draws alone
        g = b1 * g + (1 - b1) * g_hat
        h = b2 * h + (1 - b2) * h_hat + (1 - b2) ** 2 * (h - h_hat) ** 2 / (2 * (h + delta))
        g_bar = g / (1 - b1**t)
        upd = (g_bar + delta * (m - m0)) / (h + delta)
        if clip is not None:
            upd = upd.clamp(-clip, clip)
        m = m - alpha * upd
    return m, h, g, 1.0 / (ess * (h + delta))


def _closure(model, optim, x, y):
    """A closure for ``IVON.step``: zero the gradients, cross-entropy, backward."""

    def closure():
        optim.zero_grad()
        loss = torch.nn.functional.cross_entropy(model(x), y)
        loss.backward()
        return loss

    return closure


def _groups(net, spec, ess=None):
    """Parameter groups of ``spec`` (written, like the reference, with the weight decay
    ``delta / N``), in IVON's vocabulary: ``prior_precision = weight_decay * ess``."""
    out = []
    for name, mod in net.named_children():
        params = list(mod.parameters())
        if params:
            g = dict(spec.get(name, {}))
            if "weight_decay" in g:
                g["prior_precision"] = g.pop("weight_decay") * ess
            out.append({"params": params, **g})
    return out


CASES = {
    "one-sample": dict(mc=1, spec={}),
    "three-samples": dict(mc=3, spec={}),
    # the group's prior precision delta = 0.05 x ess: the reference's weight decay 0.05
    "groups": dict(mc=2, spec={"2": {"lr": 0.02, "weight_decay": 0.05, "hess_init": 0.7}}),
    "prior-and-clip": dict(mc=1, spec={}, prior=True, clip=0.05),
    # mirrored pairs across consecutive steps, within a step, and straddling steps
    "antithetic-one-sample": dict(mc=1, spec={}, antithetic=True),
    "antithetic-two-samples": dict(mc=2, spec={}, antithetic=True),
    "antithetic-three-samples-groups": dict(
        mc=3, spec={"2": {"lr": 0.02, "hess_init": 0.7}}, antithetic=True
    ),
    "antithetic-prior-and-clip": dict(mc=1, spec={}, prior=True, clip=0.05, antithetic=True),
}


@pytest.mark.parametrize("case", list(CASES))
def test_update_matches_formulas_by_hand(case):
    cfg = CASES[case]
    torch.manual_seed(1)
    net = tiny_mlp()
    x, y = _data()
    hyper = dict(lr=0.1, ess=40.0, h0=0.3, b1=0.8, b2=0.7, wd=0.01)
    prior = None
    if cfg.get("prior"):
        g = torch.Generator().manual_seed(5)
        p = flat(net).numel()
        prior = DiagonalGaussian(
            torch.randn(p, generator=g, dtype=D), torch.rand(p, generator=g, dtype=D) + 0.5
        )
    want_m, want_h, want_g, want_var = _reference(
        net, x, y, 4, mc=cfg["mc"], seed=3, spec=cfg["spec"], prior=prior,
        clip=cfg.get("clip"), antithetic=cfg.get("antithetic", False), **hyper,
    )  # fmt: skip
    opt = IVON(
        _groups(net, cfg["spec"], hyper["ess"]),
        lr=hyper["lr"],
        ess=hyper["ess"],
        hess_init=hyper["h0"],
        betas=(hyper["b1"], hyper["b2"]),
        prior_precision=hyper["wd"] * hyper["ess"],
        mc_samples=cfg["mc"],
        clip_radius=cfg.get("clip"),
        antithetic=cfg.get("antithetic", False),
    )
    if prior is not None:
        opt.set_prior(prior, model=net)
    torch.manual_seed(3)

    def closure():
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(net(x), y)
        loss.backward()
        return loss

    for _ in range(4):
        opt.step(closure)
    torch.testing.assert_close(flat(net), want_m, rtol=1e-10, atol=1e-12)
    hess = torch.cat([st["hess"].reshape(-1) for st in [opt.state[p] for p in opt.params]])
    mom = torch.cat([st["momentum"].reshape(-1) for st in [opt.state[p] for p in opt.params]])
    torch.testing.assert_close(hess, want_h, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(mom, want_g, rtol=1e-10, atol=1e-12)
    q = opt.posterior(net)
    torch.testing.assert_close(q.mean, want_m, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(q.variance, want_var, rtol=1e-10, atol=1e-12)
    assert opt.state[opt.params[0]]["step"] == 4


@pytest.mark.parametrize("mc", [1, 3])
def test_add_gradient_at_the_mean_enters_the_momentum_not_the_hessian(mc):
    """A term ``r(m) = k sum sin(m)`` evaluated at the mean after each step's draws: its
    gradient is added to ``g^`` once per step (not once per draw, not to ``h^``), over
    4 steps in float64 against the hand-written update."""
    torch.manual_seed(1)
    net = tiny_mlp()
    x, y = _data()
    hyper = dict(lr=0.1, ess=40.0, h0=0.3, b1=0.8, b2=0.7, wd=0.01)

    def mean_grad(m):
        return 0.3 * torch.cos(m)

    want_m, want_h, want_g, _ = _reference(
        net, x, y, 4, mc=mc, seed=3, spec={}, mean_grad=mean_grad, **hyper
    )
    opt = IVON(
        _groups(net, {}), lr=hyper["lr"], ess=hyper["ess"], hess_init=hyper["h0"],
        betas=(hyper["b1"], hyper["b2"]), prior_precision=hyper["wd"] * hyper["ess"],
    )  # fmt: skip
    torch.manual_seed(3)
    for _ in range(4):
        for _ in range(mc):
            with opt.sampled_params(train=True):
                opt.zero_grad()
                torch.nn.functional.cross_entropy(net(x), y).backward()
        opt.zero_grad()
        with torch.enable_grad():  # r at the mean, by autograd, through .grad
            sum(0.3 * torch.sin(p).sum() for p in net.parameters()).backward()
        opt.add_gradient()
        opt.step()
    torch.testing.assert_close(flat(net), want_m, rtol=1e-10, atol=1e-12)
    hess = torch.cat([st["hess"].reshape(-1) for st in [opt.state[p] for p in opt.params]])
    mom = torch.cat([st["momentum"].reshape(-1) for st in [opt.state[p] for p in opt.params]])
    torch.testing.assert_close(hess, want_h, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(mom, want_g, rtol=1e-10, atol=1e-12)
    with pytest.raises(RuntimeError, match="no draw accumulated"):
        opt.add_gradient()
    with pytest.raises(RuntimeError, match="restore"):
        with opt.sampled_params(train=False):
            opt.add_gradient()
    with pytest.raises(ValueError, match="grads must hold"):
        with opt.sampled_params(train=True):
            opt.zero_grad()
            torch.nn.functional.cross_entropy(net(x), y).backward()
        opt.add_gradient([None])
    with pytest.raises(ValueError, match=r"grads\[0\] must have shape"):
        opt.add_gradient([torch.zeros(1, dtype=D)] + [None] * (len(opt.params) - 1))


def test_sampled_params_loop_equals_closure_and_h_estimate_is_unbiased_on_a_quadratic():
    x, y = _data()
    torch.manual_seed(0)
    net_a, net_b = tiny_mlp(), tiny_mlp()
    net_b.load_state_dict(net_a.state_dict())
    kw = dict(lr=0.05, ess=30.0, hess_init=0.5, mc_samples=2)
    opt_a, opt_b = IVON(net_a.parameters(), **kw), IVON(net_b.parameters(), **kw)
    torch.manual_seed(9)
    for _ in range(3):
        for _ in range(2):
            with opt_a.sampled_params(train=True):
                assert opt_a.sampled
                opt_a.zero_grad()
                torch.nn.functional.cross_entropy(net_a(x), y).backward()
            assert not opt_a.sampled
        opt_a.step()
    torch.manual_seed(9)
    for _ in range(3):

        def closure():
            opt_b.zero_grad()
            loss = torch.nn.functional.cross_entropy(net_b(x), y)
            loss.backward()
            return loss

        opt_b.step(closure)
    torch.testing.assert_close(flat(net_a), flat(net_b), rtol=0, atol=0)

    # h^ = g(theta) eps / sigma^2 is unbiased for the diagonal Hessian of a quadratic
    # l(w) = 1/2 sum_j a_j w_j^2 (stated tolerance: 4 standard errors over 4000 draws).
    w = torch.zeros(5, dtype=D, requires_grad=True)
    a = torch.tensor([0.5, 1.0, 2.0, 3.0, 4.0], dtype=D)
    quad = IVON([w], lr=1e-9, ess=10.0, hess_init=1.0, betas=(0.0, 0.0), prior_precision=0)
    torch.manual_seed(0)
    draws = []
    for _ in range(4000):
        with quad.sampled_params(train=True):
            w.grad = None
            (0.5 * (a * w * w).sum()).backward()
        work = quad._work_cache[0]
        quad._fold_pending(work)  # h^ of this draw, formed on demand
        draws.append(work["ha"].clone())
        work["pending"] = False
        quad._n_acc = 0
    h_hat = torch.stack(draws)
    se = h_hat.std(0) / 4000**0.5
    assert ((h_hat.mean(0) - a).abs() < 4 * se + 1e-12).all(), (h_hat.mean(0), a)


def test_exception_inside_sampling_restores_mean_and_discards_the_draw():
    torch.manual_seed(0)
    net = tiny_mlp()
    x, y = _data()
    opt = IVON(net.parameters(), lr=0.1, ess=20.0, hess_init=0.1)
    mean = flat(net).clone()
    with pytest.raises(KeyError), opt.sampled_params(train=True):
        assert not torch.equal(flat(net), mean)  # a draw is in the parameters
        torch.nn.functional.cross_entropy(net(x), y).backward()
        raise KeyError("boom")
    assert torch.equal(flat(net), mean) and not opt.sampled
    with pytest.raises(RuntimeError, match="sampled_params"):
        opt.step()  # the failed draw contributed nothing
    with opt.sampled_params(train=False):
        torch.nn.functional.cross_entropy(net(x), y).backward()
    assert torch.equal(flat(net), mean)
    with pytest.raises(RuntimeError, match="sampled_params"):
        opt.step()  # train=False draws are for prediction only

    def bad_closure():
        raise ValueError("closure failed")

    with pytest.raises(ValueError, match="closure failed"):
        opt.step(bad_closure)
    assert torch.equal(flat(net), mean)
    with pytest.raises(RuntimeError, match="already hold a draw"), opt.sampled_params():
        opt.draw()
    assert torch.equal(flat(net), mean)


@pytest.mark.parametrize("make", [tiny_mlp, tiny_cnn], ids=["mlp", "cnn"])
def test_posterior_is_the_dnn2gp_kernel_against_dense(make):
    torch.manual_seed(0)
    net = make()
    x = torch.randn(10, 4, dtype=D) if make is tiny_mlp else torch.randn(10, 1, 6, 6, dtype=D)
    y = torch.randint(0, 3, (10,))
    # groups in reverse order: posterior(net) must still follow named_parameters()
    opt = IVON(list(net.parameters())[::-1], lr=0.05, ess=25.0, hess_init=0.2, betas=(0.9, 0.9))

    def closure():
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(net(x), y)
        loss.backward()
        return loss

    for _ in range(3):
        opt.step(closure)
    q = opt.posterior(net)
    torch.testing.assert_close(q.mean, flat(net), rtol=0, atol=0)
    q_group = opt.posterior()
    assert not torch.equal(q_group.mean, q.mean)  # group order differs
    xt = x[:4]
    gp = fromp.dnn2gp(net, q, "categorical", chunk_size=3)
    jac = dense_jacobian(net, xt)
    cov = torch.diag(q.variance)
    want = torch.einsum("ncp,pq,mdq->ncmd", jac, cov, jac)
    torch.testing.assert_close(gp.kernel(xt, method="jacobian"), want, rtol=1e-9, atol=1e-12)
    want_var = torch.einsum("ncp,p,ndp->ncd", jac, q.variance, jac)
    torch.testing.assert_close(gp.variance(xt), want_var, rtol=1e-9, atol=1e-12)
    # precision = N (h + delta)
    hess = {id(p): st["hess"] for p, st in zip(opt.params, [opt.state[p] for p in opt.params])}
    prec = torch.cat([(25.0 * (hess[id(p)] + 1e-4)).reshape(-1) for p in net.parameters()])
    torch.testing.assert_close(q.precision, prec)


def test_continual_prior_and_reset():
    torch.manual_seed(0)
    net = tiny_mlp()
    x, y = _data()
    opt = IVON(net.parameters(), lr=0.05, ess=50.0, hess_init=0.2, prior_precision=0.5)
    p0 = opt.prior()
    torch.testing.assert_close(p0.precision, torch.full_like(p0.precision, 0.5))
    assert p0.mean.abs().max() == 0
    for _ in range(3):
        with opt.sampled_params(train=True):
            opt.zero_grad()
            torch.nn.functional.cross_entropy(net(x), y).backward()
        opt.step()
    q = opt.posterior()
    new_prior = opt.set_prior()
    torch.testing.assert_close(new_prior.mean, q.mean, rtol=0, atol=0)
    torch.testing.assert_close(new_prior.precision, q.precision, rtol=0, atol=0)
    assert opt.state[opt.params[0]]["step"] == 0
    # h restarts at h0: the new posterior precision is N h0 + p0
    opt.ess = 80.0
    torch.testing.assert_close(opt.posterior().precision, 80.0 * 0.2 + q.precision)
    with pytest.raises(ValueError, match="P="):
        opt.set_prior(DiagonalGaussian(torch.zeros(3, dtype=D), torch.ones(3, dtype=D)))


def test_state_is_torchs_a_reset_restarts_it_and_the_round_trip_is_exact():
    """The state is torch's ``self.state[p]`` (no other copy): ``state_dict()`` has it per
    parameter index; a reset of ``self.state`` (Avalanche's ``reset_state=True``) restarts
    it (step 0, ``h = hess_init``, no momentum), as for any torch optimizer; a state dict
    loaded into a fresh optimizer continues bit for bit; one without ``momentum`` is
    refused before any change."""
    torch.manual_seed(0)
    net = tiny_cnn()
    x, y = torch.randn(8, 1, 6, 6, dtype=D), torch.randint(0, 3, (8,))
    opt = IVON(net.parameters(), lr=0.05, ess=30.0, hess_init=0.3, mc_samples=2)
    for _ in range(3):
        opt.step(_closure(net, opt, x, y))
    saved = copy.deepcopy(opt.state_dict())
    assert set(saved["state"]) == set(range(len(opt.params)))
    assert all(st["step"] == 3 and "hess" in st for st in saved["state"].values())
    for i, p in enumerate(opt.params):
        assert torch.equal(saved["state"][i]["hess"], opt.state[p]["hess"])

    net2 = tiny_cnn()
    net2.load_state_dict(net.state_dict())
    opt2 = IVON(net2.parameters(), lr=0.7, ess=1.0)
    opt2.load_state_dict(saved)
    assert opt2.param_groups[0]["lr"] == 0.05 and opt2.ess == 30.0 and opt2.mc_samples == 2
    torch.manual_seed(7)
    opt.step(_closure(net, opt, x, y))
    torch.manual_seed(7)
    opt2.step(_closure(net2, opt2, x, y))
    torch.testing.assert_close(flat(net), flat(net2), rtol=0, atol=0)
    torch.testing.assert_close(opt.posterior().precision, opt2.posterior().precision)
    bad = copy.deepcopy(saved)
    del bad["state"][0]["momentum"]
    before = copy.deepcopy(opt2.state_dict())
    with pytest.raises(ValueError, match="momentum"):
        opt2.load_state_dict(bad)
    assert all(torch.equal(before["state"][0][k], opt2.state[opt2.params[0]][k])
               for k in ("hess", "momentum"))  # fmt: skip

    update_optimizer(opt, dict(net.named_parameters()), None, reset_state=True)
    assert isinstance(opt.state, defaultdict)
    q = opt.posterior()
    torch.testing.assert_close(q.precision, torch.full_like(q.precision, 30.0 * (0.3 + 1e-4)))
    assert all(opt.state[p]["step"] == 0 for p in opt.params)


def test_antithetic_pair_cancels_the_odd_terms_and_resumes_mid_pair():
    # l(w) = 1/2 sum_j a_j w_j^2 at m != 0: a mirrored pair's h^ = (g(m + s z) - g(m - s z))
    # z / (2 s) is a z^2 exactly; independent draws add a m z / sigma, which is not zero
    a = torch.tensor([0.5, 1.0, 2.0, 3.0, 4.0], dtype=D)
    m = torch.tensor([1.0, -2.0, 0.5, 3.0, -1.0], dtype=D)
    for antithetic in (True, False):
        w = torch.nn.Parameter(m.clone())
        quad = IVON([w], lr=0.1, ess=10.0, hess_init=1.0, mc_samples=2, antithetic=antithetic)
        std = quad.posterior().std  # the same for both draws of the step
        torch.manual_seed(0)
        zs = []
        for _ in range(2):
            with quad.sampled_params(train=True):
                w.grad = None
                zs.append((w.detach() - m) / std)
                (0.5 * (a * w * w).sum()).backward()
        work = quad._work_cache[0]
        pair = work["ha"] / 2
        if antithetic:
            torch.testing.assert_close(zs[1], -zs[0], rtol=0, atol=1e-12)
            torch.testing.assert_close(pair, a * zs[0] ** 2, rtol=1e-12, atol=1e-12)
        else:
            assert (pair - a * (zs[0] ** 2 + zs[1] ** 2) / 2).abs().max() > 0.1

    # one draw per step: after 3 steps the 4th draw mirrors the 3rd; a checkpoint taken in
    # between carries it (and the setting), so that the resumed run is the same run
    torch.manual_seed(0)
    net = tiny_mlp()
    x, y = _data()

    opt = IVON(net.parameters(), lr=0.1, ess=20.0, hess_init=0.1, antithetic=True)
    for _ in range(3):
        opt.step(_closure(net, opt, x, y))
    saved = opt.state_dict()
    assert "mirror" in saved["state"][0]
    net2 = tiny_mlp()
    net2.load_state_dict(net.state_dict())
    opt2 = IVON(net2.parameters(), lr=0.1, ess=20.0)
    opt2.load_state_dict(saved)
    assert opt2.antithetic
    for seed, pending in ((11, False), (12, True)):  # step 4 ends a pair, step 5 opens one
        torch.manual_seed(seed)
        opt.step(_closure(net, opt, x, y))
        torch.manual_seed(seed)
        opt2.step(_closure(net2, opt2, x, y))
        torch.testing.assert_close(flat(net), flat(net2), rtol=0, atol=0)
        assert ("mirror" in opt2.state_dict()["state"][0]) == pending


def test_float32_and_dtype_preserved():
    net = torch.nn.Linear(3, 2)
    opt = IVON(net.parameters(), lr=0.1, ess=10.0)
    x, y = torch.randn(5, 3), torch.randint(0, 2, (5,))
    with opt.sampled_params(train=True):
        opt.zero_grad()
        torch.nn.functional.cross_entropy(net(x), y).backward()
    opt.step()
    assert all(st["hess"].dtype == torch.float32 for st in [opt.state[p] for p in opt.params])
    assert opt.posterior().precision.dtype == torch.float32


@pytest.mark.parametrize(
    ("kwargs", "name"),
    [
        ({"lr": 0.0}, "lr"),
        ({"lr": -1.0}, "lr"),
        ({"ess": 0}, "ess"),
        ({"ess": float("inf")}, "ess"),
        ({"hess_init": 0.0}, "hess_init"),
        ({"betas": (1.0, 0.9)}, "betas"),
        ({"betas": (0.9, -0.1)}, "betas"),
        ({"betas": (0.9,)}, "betas"),
        ({"prior_precision": -1e-3}, "prior_precision"),
        ({"prior_precision": float("nan")}, "prior_precision"),
        ({"mc_samples": 0}, "mc_samples"),
        ({"mc_samples": 1.5}, "mc_samples"),
        ({"clip_radius": 0.0}, "clip_radius"),
        ({"antithetic": 1}, "antithetic"),
    ],
)
def test_bad_arguments_name_the_argument(kwargs, name):
    net = torch.nn.Linear(3, 2)
    base = {"lr": 0.1, "ess": 10.0, **kwargs}
    with pytest.raises(ValueError, match=name):
        IVON(net.parameters(), **base)


def test_bad_group_and_model_arguments():
    a, b = torch.nn.Linear(3, 2), torch.nn.Linear(2, 2)
    with pytest.raises(ValueError, match="lr"):
        IVON([{"params": a.parameters()}, {"params": b.parameters(), "lr": -1}], lr=0.1, ess=5)
    with pytest.raises(ValueError, match="mc_samples"):
        IVON([{"params": a.parameters(), "mc_samples": 3}], lr=0.1, ess=5)
    with pytest.raises(ValueError, match="antithetic"):
        IVON([{"params": a.parameters(), "antithetic": True}], lr=0.1, ess=5)
    with pytest.raises(ValueError, match="params"):
        IVON(a, lr=0.1, ess=5)
    with pytest.raises(ValueError, match="dtype"):
        IVON([a.weight, torch.nn.Parameter(b.weight.detach().double())], lr=0.1, ess=5)
    opt = IVON(a.parameters(), lr=0.1, ess=5)
    with pytest.raises(ValueError, match="exactly"):
        opt.posterior(b)
    with pytest.raises(ValueError, match="ess"):
        opt.ess = -2


def test_a_non_finite_loss_is_refused_and_changes_nothing():
    """A NaN loss (so NaN gradients at the draw) raises in step() with the mean, the
    Hessian estimate, the momentum and the step count as they were; training then goes on."""
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    opt = IVON(model.parameters(), lr=0.1, ess=100)
    x, y = torch.randn(8, 3), torch.randint(0, 2, (8,))

    def good():
        with opt.sampled_params(train=True):
            opt.zero_grad()
            torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()

    good()
    before = [p.detach().clone() for p in model.parameters()]
    state = copy.deepcopy(opt.state_dict())
    with opt.sampled_params(train=True):
        opt.zero_grad()
        (torch.nn.functional.cross_entropy(model(x), y) * float("nan")).backward()
    with pytest.raises(FloatingPointError, match="not finite"):
        opt.step()
    for p, b in zip(model.parameters(), before):
        assert torch.equal(p, b)
    after = opt.state_dict()
    for i, s0 in state["state"].items():
        assert after["state"][i]["step"] == s0["step"]
        for k in ("hess", "momentum"):
            assert torch.equal(s0[k], after["state"][i][k]), k
    good()  # the next step works
    assert all(torch.isfinite(p).all() for p in model.parameters())
