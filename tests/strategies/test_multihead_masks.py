"""EWC, FROMP and VCL on Avalanche multi-head models with masking and global labels.

Avalanche's ``MultiHeadClassifier(masking=True)`` keeps per task a mask of the units its
classes use (``active_units_T<t>``, set by ``adaptation`` in training mode) and outputs
``mask_value`` on the others. With global labels (Avalanche's default) each head spans the
labels up to its largest class, so the masks are what keeps a head on its task's classes:
nothing fromp runs after an experience (Fisher, memorable points, GGN, VCL's prior update,
ML initialisation and coreset training, the strategies' own checks) may change them. And
Avalanche's multi-task forward pads a narrower head with zeros that no mask covers: the
strategies refuse such a model before the experience where it happens (naming the fix)."""

from __future__ import annotations

import pytest
import torch
from avalanche.benchmarks.scenarios.deprecated.generators import nc_benchmark
from avalanche.benchmarks.utils import _make_taskaware_tensor_classification_dataset
from avalanche.core import SupervisedPlugin
from avalanche.models import MTSimpleMLP, MultiHeadClassifier, MultiTaskModule
from fromp_avalanche import EWC, FROMP, VCL
from torch import nn

N_CLASSES, D_IN = 6, 8
ORDER = [4, 1, 0, 5, 3, 2]  # tasks: {4, 1}, {0, 5}, {3, 2}: global labels, shuffled
HOOKS = (
    "after_train_dataset_adaptation",
    "before_training_exp",
    "after_training_exp",
    "before_eval_exp",
    "after_eval_exp",
    "after_eval",
)


def _dataset(n: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    y = torch.arange(n) % N_CLASSES
    x = torch.randn(n, D_IN, generator=g)
    x[:, :N_CLASSES] += 2.0 * nn.functional.one_hot(y, N_CLASSES).float()
    return _make_taskaware_tensor_classification_dataset(x, y, targets=y.tolist())


def _benchmark(from_zero: bool = False):
    return nc_benchmark(
        _dataset(90, 0),
        _dataset(60, 1),
        n_experiences=3,
        task_labels=True,
        shuffle=False,
        fixed_class_order=ORDER,
        class_ids_from_zero_in_each_exp=from_zero,
    )


class _MaskedHeads(MultiTaskModule):
    """A body and a ``MultiHeadClassifier`` with masking whose heads are all as wide as the
    labels (``initial_out_features``): global labels, no padding."""

    def __init__(self) -> None:
        super().__init__()
        self.features = nn.Sequential(nn.Linear(D_IN, 10), nn.ReLU())
        self.classifier = MultiHeadClassifier(10, initial_out_features=N_CLASSES, masking=True)

    def forward(self, x, task_labels):
        return self.classifier(self.features(x), task_labels)


def _masks(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: b.clone() for n, b in model.named_buffers() if "active_units" in n}


class _Outputs(SupervisedPlugin):
    """The evaluation's predicted classes by experience."""

    def __init__(self) -> None:
        super().__init__()
        self.predicted: dict[int, set[int]] = {}

    def after_eval_forward(self, strategy, **kwargs):
        e = strategy.experience.current_experience
        got = self.predicted.setdefault(e, set())
        got |= set(strategy.mb_output.argmax(1).tolist())


def _strategy(method: str, model: nn.Module, **kw):
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    args = dict(train_mb_size=10, train_epochs=1, eval_mb_size=16, evaluator=None, **kw)
    if method == "ewc":
        return EWC(model=model, optimizer=opt, ewc_lambda=1.0, **args)
    if method == "fromp":
        return FROMP(model=model, optimizer=opt, tau=1.0, n_points=4, **args)
    settings = dict(train_samples=2, ml_init_epochs=1, seed=0)
    if method == "vcl-coreset":
        settings.update(coreset_size=4, coreset_method="random", coreset_epochs=1)
    with pytest.warns(UserWarning, match="log-variance"):
        return VCL(model=model, optimizer=opt, **settings, **args)


def _record_masks(strategy) -> list[tuple[str, dict, dict]]:
    """Wrap every hook of the method's plugin: ``(hook, masks before, masks after)``."""
    calls: list[tuple[str, dict, dict]] = []
    plugin = strategy.plugin
    for name in HOOKS:
        hook = getattr(plugin, name)

        def wrapped(strat, *args, _hook=hook, _name=name, **kwargs):
            before = _masks(strat.model)
            out = _hook(strat, *args, **kwargs)
            calls.append((_name, before, _masks(strat.model)))
            return out

        setattr(plugin, name, wrapped)
    return calls


@pytest.mark.parametrize("method", ["ewc", "fromp", "vcl", "vcl-coreset"])
def test_no_step_of_the_method_changes_a_heads_masks(method):
    """After experiences 2 and 3: every head's active units are exactly its task's classes,
    every hook of the method's plugin (the work after each experience, VCL's ML fit and
    coreset training before evaluation) leaves every head's mask as it found it, and each
    head predicts only its own task's classes."""
    bm = _benchmark()
    torch.manual_seed(0)
    model = _MaskedHeads()
    outputs = _Outputs()
    strategy = _strategy(method, model, plugins=[outputs])
    calls = _record_masks(strategy)
    classes = {e: sorted(exp.classes_in_this_experience) for e, exp in enumerate(bm.train_stream)}
    assert classes == {0: [1, 4], 1: [0, 5], 2: [2, 3]}
    for e, exp in enumerate(bm.train_stream):
        strategy.train(exp)
        if e == 0:
            continue
        # experiences 2 and 3
        units = model.classifier.active_units
        assert units == {t: classes[t] for t in range(e + 1)}, units
        masks = _masks(model)  # the task masks and the inner heads' (unused) buffers
        task_masks = sorted(k for k in masks if "active_units_T" in k)
        assert task_masks == [f"classifier.active_units_T{t}" for t in range(e + 1)]
        for t in range(e + 1):
            active = masks[f"classifier.active_units_T{t}"].nonzero().flatten().tolist()
            assert active == classes[t]
        steps = [c for c in calls if c[0] == "after_training_exp"]
        assert len(steps) == e + 1
        outputs.predicted.clear()
        strategy.eval(bm.test_stream[: e + 1])
        assert set(outputs.predicted) == set(range(e + 1))
        for t, predicted in outputs.predicted.items():
            assert predicted <= set(classes[t]), (t, predicted)
    hooks = {name for name, _, _ in calls}
    assert {"before_training_exp", "after_training_exp", "before_eval_exp", "after_eval"} <= hooks
    for name, before, after in calls:
        assert before.keys() == after.keys(), name
        for k in before:
            assert torch.equal(before[k], after[k]), (name, k)
    if method == "vcl-coreset":  # the coreset training did run before evaluating
        assert strategy.method.coresets and strategy.method._snapshot is None


@pytest.mark.parametrize("method", ["ewc", "fromp", "vcl"])
def test_heads_padded_by_avalanche_are_refused_before_the_experience(method):
    """``MTSimpleMLP`` with global labels: once the head of task 1 spans labels 0-5 the
    head of task 0 (labels up to 4: 5 units) is padded to 6 units by Avalanche's multi-task
    forward with a zero that masking does not cover. The strategy refuses before the method
    sees experience 1, naming the fix; with labels counted from zero in each experience the
    same model trains through every experience."""
    bm = _benchmark()
    torch.manual_seed(0)
    model = MTSimpleMLP(input_size=D_IN, hidden_size=6)
    strategy = _strategy(method, model)
    seen = []
    strategy.plugins.append(type("Seen", (SupervisedPlugin,), {
        "before_training_exp": lambda self, s, **kw: seen.append(s.experience.current_experience)
    })())  # fmt: skip
    strategy.train(bm.train_stream[0])
    with pytest.raises(ValueError, match="class_ids_from_zero_in_each_exp=True") as err:
        strategy.train(bm.train_stream[1])
    assert "head of task 0" in str(err.value) and "5 outputs" in str(err.value)
    assert "initial_out_features" in str(err.value)
    assert seen == [0]  # no plugin saw experience 1
    assert strategy.plugin.method.task_count == 1
    # evaluating after experience 0 on every task adapts heads for tasks 1 and 2: refused too
    with pytest.raises(ValueError, match="class_ids_from_zero_in_each_exp=True"):
        strategy.eval(bm.test_stream)

    torch.manual_seed(0)
    model = MTSimpleMLP(input_size=D_IN, hidden_size=6)
    strategy = _strategy(method, model)
    fresh = _benchmark(from_zero=True)
    for exp in fresh.train_stream:
        strategy.train(exp)
    res = strategy.eval(fresh.test_stream)
    assert strategy.plugin.method.task_count == 3 and res is not None


def test_fromp_models_in_avalanche_are_never_padded():
    """fromp's own multi-head models route a batch of one task to its head: nothing is
    padded, so global labels within a fixed head width pass the check."""
    from fromp_avalanche.models import as_avalanche_model
    from fromp_avalanche.template import check_heads_unpadded

    from fromp.models import MultiHeadMLP

    bm = _benchmark()
    model = as_avalanche_model(MultiHeadMLP(D_IN, (5,), n_heads=3, head_size=N_CLASSES))
    for exp in bm.train_stream:
        check_heads_unpadded(model, exp)
