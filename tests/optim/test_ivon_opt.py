"""fromp.IVON for users of the official implementation, ivon-opt 0.1.3 (the mapping is in
docs/library.md): its README's training and prediction loops give ivon-opt's weights (the
reference ``tests/optim/data/ivon_opt_reference.json``, written by ivon-opt; ivon-opt itself is
not needed here), every ivon-opt spelling fromp names otherwise is refused with what to
write, and a parameter group's hyperparameters are read at every step."""

from __future__ import annotations

import copy
import json
import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from fromp import IVON
from tests.optim import ivon_opt_loops as loops

REFERENCE = json.loads((Path(__file__).parent / "data" / "ivon_opt_reference.json").read_text())


def _set_group(opt: IVON, i: int, key: str, value) -> None:
    """ivon-opt's edit of a group, written in fromp's names (by hand: the conversion of the
    mapping table, not fromp's code). ivon-opt keeps its weight decay ``delta / N`` when
    ``ess`` changes, fromp its prior precision ``delta``: the same run sets both."""
    group = opt.param_groups[i]
    if key == "ess":
        group["prior_precision"] *= value / group["ess"]
        group["ess"] = value
    elif key == "weight_decay":
        group["prior_precision"] = value * group["ess"]
    elif key in ("beta1", "beta2"):
        b = list(group["betas"])
        b[key == "beta2"] = value
        group["betas"] = tuple(b)
    else:
        group[key] = value


def _fromp(case: str, net: torch.nn.Module) -> IVON:
    """fromp.IVON with the arguments of the reference's ivon-opt optimizer, translated."""
    if case == "readme":
        return IVON(net.parameters(), lr=0.1, ess=64)
    if case == "every_argument":
        return IVON(net.parameters(), 0.05, 200.0, 0.25, betas=(0.8, 0.999),
                    prior_precision=1e-3 * 200.0, mc_samples=2, hess_approx="price",
                    clip_radius=0.5, sync=False, debias=False, rescale_lr=False)  # fmt: skip
    assert case == "groups_edited_mid_run"
    head = {"params": list(net[2].parameters()), "lr": 0.02, "betas": (0.9, 0.9999)}
    groups = [{"params": list(net[0].parameters())}, head]
    return IVON(groups, lr=0.1, ess=64, prior_precision=1e-3 * 64)


@pytest.mark.parametrize("case", sorted(loops.CASES))
def test_the_readme_loops_give_ivon_opt_weights(case):
    """100 steps of the README loops (seeded draws, prediction loops in between; every
    constructor argument; two groups whose weight decay, betas, lr, hess_init, ess and
    clip radius change mid-run) end at ivon-opt's weights and predictive probabilities to
    float64 rounding."""
    ref = REFERENCE["cases"][case]
    net = loops.model(REFERENCE["initial_weights"])
    got = loops.run(net, _fromp(case, net), loops.CASES[case], _set_group)
    start = torch.tensor([w for p in REFERENCE["initial_weights"] for w in p], dtype=loops.D)
    want = torch.tensor([w for p in ref["weights"] for w in p], dtype=loops.D)
    have = torch.tensor([w for p in got["weights"] for w in p], dtype=loops.D)
    assert (want - start).abs().max() > 0.01  # the run moved the weights
    torch.testing.assert_close(have, want, rtol=1e-9, atol=1e-12)
    torch.testing.assert_close(
        torch.tensor(got["prob"]), torch.tensor(ref["prob"]), rtol=1e-9, atol=1e-12
    )


def test_the_reference_file_is_small_json_written_by_ivon_opt():
    path = Path(__file__).parent / "data" / "ivon_opt_reference.json"
    assert path.stat().st_size < 100_000
    assert REFERENCE["ivon_opt"] == "0.1.3" and set(REFERENCE["cases"]) == set(loops.CASES)


# ----------------------------------------------------------------------------- refusals
def _params():
    return loops.model().parameters()


@pytest.mark.parametrize(
    ("kwargs", "write"),
    [
        ({"weight_decay": 1e-4}, "prior_precision=5.0"),  # 1e-4 * ess 50000
        ({"beta1": 0.8}, "betas=(0.8, 0.99999)"),
        ({"beta2": 0.999}, "betas=(0.9, 0.999)"),
        ({"beta1": 0.5, "beta2": 0.99, "weight_decay": 0.0}, "betas=(0.5, 0.99)"),
    ],
)
def test_ivon_opt_spellings_are_refused_with_what_to_write(kwargs, write):
    with pytest.raises(ValueError, match=r"ivon-opt") as err:
        IVON(_params(), lr=0.1, ess=50_000, **kwargs)
    assert write in str(err.value)
    for key in kwargs:
        assert f"{key}=" in str(err.value)  # names what was written


def test_ivon_opt_positional_order_beyond_hess_init_is_refused_naming_each():
    with pytest.raises(TypeError, match=r"beta1=0\.8, beta2=0\.999") as err:
        IVON(_params(), 0.1, 100, 1.0, 0.8, 0.999)
    assert "betas=(beta1, beta2)" in str(err.value)
    assert "prior_precision=weight_decay * ess" in str(err.value)
    opt = IVON(_params(), 0.1, 100, 0.5)  # the first four by position, as ivon-opt's
    assert opt.param_groups[0]["hess_init"] == 0.5 and opt.ess == 100


def test_hess_approx_gradsq_is_refused_naming_what_to_use():
    with pytest.raises(ValueError, match=r"hess_approx='gradsq'.*hess_approx='ef'"):
        IVON(_params(), lr=0.1, ess=100, hess_approx="gradsq")
    with pytest.raises(ValueError, match="hess_approx must be 'price'"):
        IVON(_params(), lr=0.1, ess=100, hess_approx="exact")
    IVON(_params(), lr=0.1, ess=100, hess_approx="price")


@pytest.mark.parametrize(("key", "value"), [("sync", "yes"), ("debias", 1), ("clip_radius", -1.0)])
def test_the_ivon_opt_arguments_are_checked(key, value):
    with pytest.raises(ValueError, match=key):
        IVON(_params(), lr=0.1, ess=100, **{key: value})


def _train_step(opt, net, seed=0):
    x, y = loops.data()
    torch.manual_seed(seed)
    with opt.sampled_params(train=True):
        opt.zero_grad()
        F.cross_entropy(net(x), y).backward()
    opt.step()


def _snapshot(opt, net):
    return [p.detach().clone() for p in net.parameters()], copy.deepcopy(opt.state_dict())


def _unchanged(opt, net, snap):
    weights, state = snap
    assert all(torch.equal(a, b) for a, b in zip(net.parameters(), weights, strict=True))
    now = opt.state_dict()["state"]
    for i, st in state["state"].items():
        assert now[i]["step"] == st["step"]
        assert torch.equal(now[i]["hess"], st["hess"]) and torch.equal(
            now[i]["momentum"], st["momentum"]
        )


@pytest.mark.parametrize(
    ("key", "value", "write"),
    [
        ("weight_decay", 100.0, "'prior_precision' = 1600.0"),  # 100 * the group's ess 16
        ("weight_decay", float("nan"), "'prior_precision' = nan"),
        ("beta2", 0.99, "'betas' = (0.9, 0.99)"),
    ],
)
def test_an_ivon_opt_group_key_set_mid_run_is_refused_at_the_step(key, value, write):
    """N16: a group's ``weight_decay`` (or ``beta2``) set after construction, as torch users
    and ivon-opt users do, is refused at the next step with fromp's key and the converted
    value; the weights and the state are unchanged; deleting it lets training go on."""
    net = loops.model()
    opt = IVON(net.parameters(), lr=0.1, ess=16)
    _train_step(opt, net)
    snap = _snapshot(opt, net)
    opt.param_groups[0][key] = value
    with pytest.raises(ValueError, match=r"IVON\.(draw|step)\(\): param_groups\[0\]") as err:
        _train_step(opt, net)
    assert write in str(err.value) and f"delete '{key}'" in str(err.value)
    _unchanged(opt, net, snap)
    with pytest.raises(ValueError, match=r"'prior_precision' = 0\.32"):
        IVON([{"params": list(net.parameters()), "weight_decay": 0.02}], lr=0.1, ess=16)
    del opt.param_groups[0][key]
    _train_step(opt, net)


def test_a_closure_that_draws_itself_is_refused_naming_the_difference():
    """ivon-opt's ``step(closure)`` runs a closure that enters ``sampled_params`` itself;
    fromp's draws and runs the closure at the draw: refused, state unchanged."""
    net = loops.model()
    opt = IVON(net.parameters(), lr=0.1, ess=64)
    x, y = loops.data()
    _train_step(opt, net)
    snap = _snapshot(opt, net)

    def ivon_opt_closure():
        with opt.sampled_params(train=True):
            opt.zero_grad()
            loss = F.cross_entropy(net(x), y)
            loss.backward()
        return loss

    with pytest.raises(RuntimeError, match=r"closure must not draw.*remove that `with`"):
        opt.step(ivon_opt_closure)
    _unchanged(opt, net, snap)
    assert not opt.sampled


def test_an_ivon_opt_state_dict_is_refused():
    """ivon-opt keeps ``momentum`` and ``hess`` in its groups and no step count (its layout
    written out here): refused before any change."""
    net = loops.model()
    opt = IVON(net.parameters(), lr=0.1, ess=64)
    _train_step(opt, net)
    snap = _snapshot(opt, net)
    numel = sum(p.numel() for p in net.parameters())
    ivon_opt = {
        "state": {"count": 0, "avg_grad": None, "avg_nxg": None, "avg_gsq": None},
        "param_groups": [{
            "lr": 0.1, "mc_samples": 1, "beta1": 0.9, "beta2": 0.99999, "weight_decay": 1e-4,
            "hess_init": 1.0, "ess": 64, "clip_radius": math.inf, "numel": numel,
            "momentum": torch.zeros(numel, dtype=loops.D),
            "hess": torch.ones(numel, dtype=loops.D), "params": list(range(4)),
        }],
    }  # fmt: skip
    with pytest.raises(ValueError, match=r"ivon-opt state dict.*no step count"):
        opt.load_state_dict(ivon_opt)
    _unchanged(opt, net, snap)


def test_a_state_dict_saved_before_sync_and_debias_loads_with_what_that_optimizer_did():
    """Groups saved without ``sync`` and ``debias`` come from an IVON that always averaged
    over the processes and debiased: they load as ``sync=True``, ``debias=True``."""
    net = loops.model()
    opt = IVON(net.parameters(), lr=0.1, ess=64)
    _train_step(opt, net)
    saved = copy.deepcopy(opt.state_dict())
    for group in saved["param_groups"]:
        del group["sync"], group["debias"]
    other = IVON(loops.model().parameters(), lr=0.1, ess=64, sync=False, debias=False)
    other.load_state_dict(saved)
    assert other.param_groups[0]["sync"] is True and other.param_groups[0]["debias"] is True


# ----------------------------------------------------------------------------- sampled_params
def test_the_prediction_block_leaves_the_next_step_as_it_was():
    """``sampled_params()`` (ivon-opt's default ``train=False``) between the training blocks
    and the step: the step is that of a run without it (the training draws from their own
    generator)."""

    def run(predict: bool):
        net = loops.model()
        opt = IVON(net.parameters(), lr=0.1, ess=64)
        x, y = loops.data()
        g = torch.Generator().manual_seed(5)
        for _ in range(3):
            with opt.sampled_params(train=True, generator=g):
                opt.zero_grad()
                F.cross_entropy(net(x), y).backward()
            if predict:
                with torch.no_grad(), opt.sampled_params():
                    net(x)
            opt.step()
        return torch.cat([p.detach().reshape(-1) for p in net.parameters()])

    assert torch.equal(run(True), run(False))


# ----------------------------------------------------------------------------- group edits
EDITS = [
    ("lr", 0.03),
    ("betas", (0.7, 0.995)),
    ("prior_precision", 3.0),
    ("ess", 40.0),
    ("hess_init", 0.2),
    ("clip_radius", 1e-3),
    ("debias", False),
    ("rescale_lr", False),
]


@pytest.mark.parametrize(("key", "value"), EDITS, ids=[k for k, _ in EDITS])
def test_a_group_edited_mid_run_steps_as_a_fresh_optimizer_with_that_value(key, value):
    """A group's hyperparameter changed between steps (a scheduler, a hand edit) is read at
    the next step: that step equals the one of an optimizer built with the new value and
    loaded with the state (bit for bit), and differs from the step without the edit."""
    kw = {"lr": 0.1, "ess": 16, "hess_init": 0.5, "prior_precision": 1.0}
    net = loops.model()
    opt = IVON(net.parameters(), **kw)
    for s in range(3):
        _train_step(opt, net, seed=s)
    saved = copy.deepcopy(opt.state_dict()["state"])
    net_b, net_c = loops.model(), loops.model()
    for other in (net_b, net_c):
        other.load_state_dict(net.state_dict())
    fresh = IVON(net_b.parameters(), **{**kw, key: value})
    fresh.load_state_dict({**fresh.state_dict(), "state": copy.deepcopy(saved)})
    unedited = IVON(net_c.parameters(), **kw)
    unedited.load_state_dict({**unedited.state_dict(), "state": copy.deepcopy(saved)})
    opt.param_groups[0][key] = value
    for o, n in ((opt, net), (fresh, net_b), (unedited, net_c)):
        _train_step(o, n, seed=7)
    for a, b in zip(net.parameters(), net_b.parameters(), strict=True):
        assert torch.equal(a, b)
    for p, q in zip(opt.params, fresh.params, strict=True):
        assert torch.equal(opt.state[p]["hess"], fresh.state[q]["hess"])
        assert torch.equal(opt.state[p]["momentum"], fresh.state[q]["momentum"])
    assert not all(
        torch.equal(a, b) for a, b in zip(net.parameters(), net_c.parameters(), strict=True)
    )
