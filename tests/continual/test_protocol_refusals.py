"""The continual methods refuse bad input at the entry point, naming the argument, before any
work (audit 2026-11-28: M8, M11, N13, N14), and work on the models users bring: tied weights
in VCL (N17) and ``torch.compile``d models in FROMP and EWC (N3), their curvature, Fisher
and kernels taken through the module inside the compiled wrapper."""

from __future__ import annotations

import math
import warnings

import pytest
import torch
from torch import nn

from fromp import EWCMethod, FROMPMethod, VCLMethod, select_memorable


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2)).eval()


def _data(n: int = 40) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randn(n, 4, generator=g), torch.arange(n) % 2


# ------------------------------------------------------------------------- M8: states
@pytest.mark.parametrize(
    "make", [FROMPMethod, lambda: EWCMethod(1.0), lambda: VCLMethod(nn.Linear(4, 2))]
)
def test_an_empty_state_is_refused_naming_every_missing_key(make):
    method = make()
    with pytest.raises(ValueError, match=r"state is missing keys \[") as err:
        method.load_state_dict({})
    message = str(err.value)
    assert "\n" not in message and "task_count" in message
    with pytest.raises(ValueError, match="state must be a dict"):
        method.load_state_dict([])  # type: ignore[arg-type]
    assert method.task_count == 0


def test_a_partial_fromp_state_names_all_it_lacks():
    state = FROMPMethod().state_dict()
    for key in ("regularizer", "ggn_terms"):
        del state[key]
    with pytest.raises(ValueError, match=r"missing keys \['ggn_terms', 'regularizer'\]"):
        FROMPMethod().load_state_dict(state)


# ------------------------------------------------------------------ N13, N14: settings
@pytest.mark.parametrize("seed", [-1.0, "1", True, math.nan, math.inf, -3, 2.0])
def test_a_bad_seed_is_refused_in_the_constructor(seed):
    with pytest.raises(ValueError, match=r"seed must be an int >= 0, got"):
        FROMPMethod(seed=seed)


@pytest.mark.parametrize("value", [2.5, math.nan, math.inf, True, 0, -3, "10"])
def test_bad_curvature_examples_are_refused_in_the_constructor(value):
    with pytest.raises(ValueError, match=r"curvature_examples must be an int >= 1 or None"):
        FROMPMethod(curvature_examples=value)


def test_good_settings_pass():
    FROMPMethod(seed=3, curvature_examples=None)
    FROMPMethod(seed=0, curvature_examples=5)


# ------------------------------------------------------------------------- M11: meta
def test_a_meta_device_model_is_refused_naming_the_device():
    with torch.device("meta"):
        net = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
    x, y = _data()
    calls = {
        "FROMPMethod.learn_task": lambda: FROMPMethod(n_points=4).learn_task(net, x, y, None),
        "EWCMethod.learn_task": lambda: EWCMethod(1.0).learn_task(net, x, y, None),
        "select_memorable": lambda: select_memorable(net, x, y, n_per_class=2),
    }
    for name, call in calls.items():
        with pytest.raises(ValueError, match=r"model tensor 0\.weight is on the meta device"):
            call()
        assert name  # every entry point refuses before its work


# ---------------------------------------------------------------- N17: tied weights
class _Tied(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c = nn.Linear(6, 6), nn.Linear(6, 6), nn.Linear(6, 2)
        self.b.weight = self.a.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c(torch.tanh(self.b(torch.tanh(self.a(x)))))


def test_vcl_on_tied_weights_makes_the_shared_tensor_one_gaussian():
    from fromp.continual.bayesian import MeanFieldTwin, gaussian_names

    torch.manual_seed(0)
    model = _Tied().double()
    assert gaussian_names(model) == ["a.weight", "a.bias", "b.bias", "c.weight", "c.bias"]
    twin = MeanFieldTwin(model, prior_precision=2.0)
    assert sorted(twin.logvars) == sorted(k.replace(".", "__") for k in gaussian_names(model))
    x = torch.randn(5, 6, dtype=torch.float64)
    with torch.no_grad():
        for _, lv, _, _ in twin.gaussian_sites():
            lv.fill_(-80.0)  # no noise: every draw is the mean network, tied as the model is
    torch.testing.assert_close(twin.sample_logits(x, None, 2)[1], model(x))
    # the KL counts the shared tensor once: the closed form over the unique tensors
    with torch.no_grad():
        for _, lv, _, _ in twin.gaussian_sites():
            lv.fill_(-1.0)
    want = 0.0
    for p in (model.a.weight, model.a.bias, model.b.bias, model.c.weight, model.c.bias):
        v, v0 = math.exp(-1.0), 0.5
        want += 0.5 * float((math.log(v0 / v) + (v + p.detach() ** 2) / v0 - 1).sum())
    assert float(twin.kl().detach()) == pytest.approx(want, rel=1e-12)


def test_the_vcl_strategy_trains_a_model_with_tied_weights():
    pytest.importorskip("avalanche")
    from avalanche.benchmarks.scenarios.deprecated.generators import tensors_benchmark
    from avalanche.training.plugins import EvaluationPlugin
    from fromp_avalanche import VCL

    torch.manual_seed(0)
    x, y = torch.randn(40, 6), torch.arange(40) % 2
    bm = tensors_benchmark([(x, y)], [(x, y)], task_labels=[0])
    model = _Tied()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        strategy = VCL(
            model=model,
            optimizer=torch.optim.Adam(model.parameters(), lr=1e-2),
            train_mb_size=8,
            train_epochs=1,
            eval_mb_size=40,
            evaluator=EvaluationPlugin(loggers=[]),
        )
        strategy.train(bm.train_stream[0])
    assert strategy.method.task_count == 1
    assert model.b.weight is model.a.weight  # still tied


# ------------------------------------------------------------------ N3: torch.compile
def _compiled(net: nn.Module) -> nn.Module:
    return torch.compile(net, backend="aot_eager")


def test_compiled_models_learn_as_the_module_inside():
    """FROMP's and EWC's after-experience passes on a compiled model give the state of the
    module inside it (the curvature and Fisher passes run eagerly on it)."""
    x, y = _data()
    plain_f, compiled_f = FROMPMethod(n_points=4), FROMPMethod(n_points=4)
    plain_f.learn_task(_net(), x, y, None)
    compiled_f.learn_task(_compiled(_net()), x, y, None)
    for n, v in plain_f.ggn_sum.items():
        torch.testing.assert_close(compiled_f.ggn_sum[n], v, rtol=1e-6, atol=1e-9)
    plain_e, compiled_e = EWCMethod(1.0, fisher="exact"), EWCMethod(1.0, fisher="exact")
    plain_e.learn_task(_net(), x, y, None)
    compiled_e.learn_task(_compiled(_net()), x, y, None)
    for n, v in plain_e.importances[0].items():
        torch.testing.assert_close(compiled_e.importances[0][n], v, rtol=1e-6, atol=1e-9)
    # the penalty of the compiled model in training: its parameters, named without the
    # wrapper's prefix
    net = _compiled(_net())
    with torch.no_grad():
        for p in net.parameters():
            p.add_(0.1)
    torch.testing.assert_close(compiled_e.penalty(net), plain_e.penalty(net))
    assert float(compiled_f.penalty(net).detach()) > 0


@pytest.mark.parametrize("strategy_name", ["FROMP", "EWC"])
def test_the_strategies_train_a_compiled_model(strategy_name):
    pytest.importorskip("avalanche")
    import fromp_avalanche
    from avalanche.benchmarks.scenarios.deprecated.generators import tensors_benchmark
    from avalanche.training.plugins import EvaluationPlugin

    x, y = _data()
    bm = tensors_benchmark([(x, y), (x + 0.5, y)], [(x, y), (x + 0.5, y)], task_labels=[0, 0])
    model = _compiled(_net().train())
    extra = {"n_points": 4} if strategy_name == "FROMP" else {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        strategy = getattr(fromp_avalanche, strategy_name)(
            model=model,
            optimizer=torch.optim.Adam(model.parameters(), lr=1e-2),
            train_mb_size=8,
            train_epochs=1,
            eval_mb_size=40,
            evaluator=EvaluationPlugin(loggers=[]),
            **extra,
        )
        for exp in bm.train_stream:
            strategy.train(exp)
    assert strategy.plugin.method.task_count == 2


# --------------------------------------------- N12, N15: outputs and inputs the model takes
class _DictOut(nn.Module):
    """A Hugging Face-style model: a dict of outputs."""

    def __init__(self) -> None:
        super().__init__()
        self.body = _net()

    def forward(self, x: torch.Tensor) -> dict:
        return {"logits": self.body(x)}


def _learn(kind: str, net: nn.Module, x: torch.Tensor, y: torch.Tensor) -> None:
    if kind == "fromp":
        FROMPMethod(n_points=4).learn_task(net, x, y, None)
    elif kind == "ewc":
        EWCMethod(1.0).learn_task(net, x, y, None)
    else:
        select_memorable(net, x, y, "categorical", n_per_class=2)


@pytest.mark.parametrize("kind", ["fromp", "ewc", "memorable"])
def test_inputs_and_outputs_the_model_cannot_take_are_refused_before_any_work(kind):
    """A dict output, inputs of another dtype and inputs of the wrong width: one line naming
    the argument and what to write, not torch's error from inside the curvature pass."""
    x, y = _data()
    with pytest.raises(ValueError, match=r"got a dict.*model\(x\)\[\"logits\"\]"):
        _learn(kind, _DictOut(), x, y)
    with pytest.raises(ValueError, match=r"^x is torch.float64, the model torch.float32"):
        _learn(kind, _net(), x.double(), y)
    with pytest.raises(ValueError, match=r"cannot be called on x of shape \(40, 3\)"):
        _learn(kind, _net(), x[:, :3], y)
    _learn(kind, _net(), x, y)  # and the same call with fitting inputs works
