"""The runner builds IVON from settings written with ivon-opt's names (``beta2``,
``weight_decay``) under IVON's names: the same optimizer."""

from __future__ import annotations

import pytest
import torch
from fromp_bench.runner import SettingsError, _make_optimizer, ivon_kwargs
from fromp_bench.settings import settings_for
from torch import nn

from fromp.optim import IVON


def _groups(opt: torch.optim.Optimizer) -> list[dict]:
    return [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups]


def test_registry_settings_build_ivon_with_its_names():
    """The registry's ivon-opt names become IVON's (which refuses them, giving the same
    conversion); several processes average IVON's statistics (sync=True)."""
    extra = settings_for("ivon", "split-mnist")["optimizer_kwargs"]
    assert {"beta2", "weight_decay"} <= set(extra)  # the registry keeps the old names
    net = nn.Linear(3, 2)
    new = _make_optimizer("ivon", net, 0.2, 1200, extra)
    with pytest.raises(ValueError, match=r"prior_precision=0\.12"):
        IVON(net.parameters(), lr=0.2, ess=1200, **extra)
    rest = {k: v for k, v in extra.items() if k not in ("beta1", "beta2", "weight_decay")}
    want = IVON(
        net.parameters(), lr=0.2, ess=1200, prior_precision=1e-4 * 1200,
        betas=(extra.get("beta1", 0.9), extra["beta2"]), sync=True, **rest,
    )  # fmt: skip
    assert _groups(new) == _groups(want)
    # weight_decay 1e-4 at ess 1200: prior precision 0.12; beta2 0.99999 with beta1 0.9
    (g,) = _groups(new)
    assert g["prior_precision"] == pytest.approx(0.12, rel=1e-12)
    assert tuple(g["betas"]) == (0.9, 0.99999) and g["sync"] is True


def test_current_names_pass_through_and_mixed_names_are_refused():
    same = {"betas": (0.8, 0.999), "prior_precision": 2.0, "hess_init": 0.1}
    assert ivon_kwargs(same, 100) == same
    assert ivon_kwargs({"beta1": 0.5}, 10)["betas"] == (0.5, 0.99999)
    with pytest.raises(SettingsError, match=r"opt\.betas and opt\.beta1 / opt\.beta2"):
        ivon_kwargs({"betas": (0.9, 0.99), "beta2": 0.9}, 10)
    with pytest.raises(SettingsError, match=r"opt\.prior_precision and opt\.weight_decay"):
        ivon_kwargs({"weight_decay": 1e-4, "prior_precision": 1.0}, 10)
    for bad in (-1.0, float("nan"), "x", True):
        with pytest.raises(SettingsError, match=r"opt\.weight_decay must be a finite number"):
            ivon_kwargs({"weight_decay": bad}, 10)
