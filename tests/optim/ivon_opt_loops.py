"""The training and prediction loops of ivon-opt 0.1.3's README, on a tiny float64 problem,
for any optimizer with ivon-opt's ``sampled_params`` / ``step`` API: run with ivon-opt by
``tests/optim/data/make_ivon_opt_reference.py`` (which writes ``ivon_opt_reference.json``) and
with :class:`fromp.IVON` by ``tests/optim/test_ivon_opt.py``. Nothing here imports ivon-opt.

The loop (README, "Training loop" and "Prediction"): for each mini-batch ``(X, y)`` of 16
examples in turn, ``train_samples`` blocks ``with optimizer.sampled_params(train=True):
optimizer.zero_grad(); loss(model(X), y).backward()``, then ``optimizer.step()``; every
``predict_every`` steps the prediction loop, ``test_samples`` blocks ``with
optimizer.sampled_params(): softmax(model(X_test))`` averaged. The draws come from torch's
global generator, seeded once before the loop; mid-run edits of ``param_groups`` are applied
by ``set_group`` before the step they are listed at."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

D = torch.float64
BATCH = 16


def data() -> tuple[torch.Tensor, torch.Tensor]:
    """64 examples with 4 features and 3 classes (a seeded generator of its own)."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 4, generator=g, dtype=D)
    y = (x[:, 0] + 0.5 * x[:, 1] > 0).long() + (x[:, 2] > 1).long()
    return x, y


def model(weights: list[list[float]] | None = None) -> nn.Module:
    """4-5-3 MLP with tanh, float64; ``weights`` (per parameter, flat) replace torch's init."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 3)).to(D)
    if weights is not None:
        with torch.no_grad():
            for p, w in zip(net.parameters(), weights, strict=True):
                p.copy_(torch.tensor(w, dtype=D).view_as(p))
    return net


def flat_weights(net: nn.Module) -> list[list[float]]:
    return [p.detach().reshape(-1).tolist() for p in net.parameters()]


def run(
    net: nn.Module,
    optimizer: Any,
    case: dict[str, Any],
    set_group: Callable[[Any, int, str, Any], None],
) -> dict[str, Any]:
    """The README loops for ``case["steps"]`` steps (``train_samples``, ``test_samples``,
    ``predict_every``, ``seed``, ``changes``: ``[step, group, key, value]`` rows); returns
    the final weights and the last prediction loop's mean probabilities."""
    x, y = data()
    torch.manual_seed(case["seed"])
    changes = case.get("changes", [])
    prob = None
    for t in range(case["steps"]):
        for step, group, key, value in changes:
            if step == t:
                set_group(optimizer, group, key, value)
        rows = slice((t * BATCH) % len(x), (t * BATCH) % len(x) + BATCH)
        for _ in range(case["train_samples"]):
            with optimizer.sampled_params(train=True):
                optimizer.zero_grad()
                logit = net(x[rows])
                loss = F.cross_entropy(logit, y[rows])
                loss.backward()
        optimizer.step()
        if (t + 1) % case["predict_every"] == 0:
            sampled_probs = []
            with torch.no_grad():
                for _ in range(case["test_samples"]):
                    with optimizer.sampled_params():
                        sampled_probs.append(F.softmax(net(x[:8]), dim=1))
            prob = torch.mean(torch.stack(sampled_probs), dim=0)
    assert prob is not None
    return {"weights": flat_weights(net), "prob": prob.tolist()}


#: the cases: ivon-opt's constructor arguments (its names), group split and edits
CASES: dict[str, dict[str, Any]] = {
    "readme": {
        "kwargs": {"lr": 0.1, "ess": 64},
        "steps": 100, "seed": 1, "train_samples": 1, "test_samples": 3, "predict_every": 10,
    },
    "every_argument": {
        # lr, ess, hess_init (ivon-opt rounds hess_init to float32: 0.25 is exact in both)
        "positional": [0.05, 200.0, 0.25],
        "kwargs": {"beta1": 0.8, "beta2": 0.999, "weight_decay": 1e-3, "mc_samples": 2,
                   "hess_approx": "price", "clip_radius": 0.5, "sync": False,
                   "debias": False, "rescale_lr": False},
        "steps": 100, "seed": 2, "train_samples": 2, "test_samples": 2, "predict_every": 25,
    },
    "groups_edited_mid_run": {
        "kwargs": {"lr": 0.1, "ess": 64, "weight_decay": 1e-3},
        "groups": [{}, {"lr": 0.02, "beta2": 0.9999}],  # the first layer, the head
        "changes": [
            [30, 0, "weight_decay", 0.05], [30, 1, "beta2", 0.99], [40, 1, "lr", 0.05],
            [50, 0, "beta1", 0.5], [60, 0, "hess_init", 0.5], [70, 1, "ess", 128.0],
            [80, 0, "clip_radius", 0.01],
        ],
        "steps": 100, "seed": 3, "train_samples": 1, "test_samples": 2, "predict_every": 20,
    },
}  # fmt: skip


def param_groups(net: nn.Module, case: dict[str, Any]) -> list[dict[str, Any]] | Any:
    """The parameters (or the groups, each with its ivon-opt options: the first layer's and
    the head's) the optimizer of ``case`` is built on."""
    if "groups" not in case:
        return net.parameters()
    parts = [list(net[0].parameters()), list(net[2].parameters())]
    return [{"params": p, **g} for p, g in zip(parts, case["groups"], strict=True)]
