"""The Avalanche template every strategy of :mod:`fromp_avalanche` is built on."""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch
from avalanche.training.plugins.evaluation import default_evaluator
from avalanche.training.templates import SupervisedTemplate
from torch import Tensor, nn

from fromp.models import is_multitask, takes_task_labels, with_task

__all__ = [
    "MethodStrategy",
    "check_heads_unpadded",
    "check_labels_fit",
    "method_parameters",
    "require_optimizer_on",
    "show_signature",
]


class MethodStrategy(SupervisedTemplate):
    """Avalanche's ``SupervisedTemplate`` with a method's plugins (``method_plugins``, in hook
    order; ``self.plugin`` is the first) in front of the user's ``plugins``. The other
    keyword arguments are Avalanche's, with its defaults (``criterion``: cross-entropy;
    mini-batches of 1 for training and evaluation: pass e.g. ``train_mb_size=128``)."""

    def __init__(
        self,
        *,
        method_plugins: Sequence[Any],
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        criterion: nn.Module | Callable | None = None,
        train_mb_size: int = 1,
        train_epochs: int = 1,
        eval_mb_size: int | None = 1,
        device: str | torch.device = "cpu",
        plugins: list[Any] | None = None,
        evaluator: Any = default_evaluator,
        eval_every: int = -1,
        **base_kwargs: Any,
    ) -> None:
        if not method_plugins:
            raise ValueError("method_plugins must hold at least the method's plugin")
        self.plugin = method_plugins[0]
        criterion = nn.CrossEntropyLoss() if criterion is None else criterion
        super().__init__(model=model, optimizer=optimizer, criterion=criterion,
                         train_mb_size=train_mb_size, train_epochs=train_epochs,
                         eval_mb_size=eval_mb_size, device=device,
                         plugins=[*method_plugins, *(plugins or [])], evaluator=evaluator,
                         eval_every=eval_every, **base_kwargs)  # fmt: skip

    def _before_training_exp(self, **kwargs: Any) -> None:
        super()._before_training_exp(**kwargs)
        check_labels_fit(self.model, self.experience, self.device)

    def _adapt_model(self, model: nn.Module | None) -> nn.Module:
        """Avalanche's adaptation; a strategy with parameters of its own that grow with the
        model (VCL's log-variances) extends this."""
        return super().model_adaptation(model)

    def model_adaptation(self, model: nn.Module | None = None) -> nn.Module:
        """Avalanche's model adaptation with the optimizer following the model after every
        adaptation (Avalanche refreshes it only before training): a grown parameter replaces
        its old tensor in the optimizer, a new one (a new head) is added, also when the
        model adapts outside training (a restored checkpoint, evaluation on new tasks).
        Then, before any plugin works on the experience (training or evaluation), the heads
        of the strategy's model are checked (:func:`check_heads_unpadded`)."""
        own = model is None or model is self.model
        if own and getattr(self, "optimized_param_id", True) is None:
            self.make_optimizer(reset_optimizer_state=True)
        out = self._adapt_model(model)
        if own and getattr(self, "optimized_param_id", None) is not None:
            self.make_optimizer(reset_optimizer_state=False)
        if own and getattr(self, "experience", None) is not None:
            check_heads_unpadded(out, self.experience, self.device)
        return out


def check_labels_fit(model: nn.Module, experience: Any, device: Any = "cpu") -> None:
    """Refuse (``ValueError``, before any training) an experience whose class labels do not
    index the model's outputs for its task: e.g. Avalanche's default global labels (2, 3 for
    the second split-MNIST task) with a fixed two-unit head per task. Heads that grow with
    the labels (Avalanche's ``MultiHeadClassifier`` / ``IncrementalClassifier``) pass."""
    classes = getattr(experience, "classes_in_this_experience", None)
    if not classes:
        return
    x = _two_inputs(experience, device)
    if x is None:
        return
    first = experience.dataset[0]
    task = int(first[2]) if len(first) > 2 else 0
    with _quiet_eval(model, device):
        out = with_task(model, task if is_multitask(model) else None)(x)
    width = out.shape[-1]
    if max(classes) >= width:
        raise ValueError(
            f"experience {experience.current_experience} has class labels "
            f"{sorted(classes)} but the model's output for task {task} has {width} units: "
            "build the benchmark with class_ids_from_zero_in_each_exp=True (e.g. "
            "SplitMNIST(n_experiences=5, return_task_id=True, "
            "class_ids_from_zero_in_each_exp=True)), or use heads that grow with the labels "
            "(avalanche.models.MultiHeadClassifier)"
        )


def _two_inputs(experience: Any, device: Any) -> Tensor | None:
    """Two inputs ``[2, ...]`` of the experience (one when it has one; None when empty): a
    model that squeezes (MTSimpleCNN) drops the batch dimension of a batch of one."""
    dataset = experience.dataset
    if len(dataset) == 0:
        return None
    return torch.stack([dataset[i][0] for i in range(min(2, len(dataset)))]).to(device)


@contextmanager
def _quiet_eval(model: nn.Module, device: Any) -> Iterator[None]:
    """The model in evaluation mode without gradients, the RNG left as it was (a Bayesian
    model samples in its forward: a check must not move training's draws)."""
    was_training = model.training
    model.eval()
    dev = torch.device(device)
    cuda = []
    if dev.type == "cuda":
        cuda = [dev.index if dev.index is not None else torch.cuda.current_device()]
    try:
        with torch.random.fork_rng(devices=cuda), torch.no_grad():
            yield
    finally:
        model.train(was_training)


def check_heads_unpadded(model: nn.Module, experience: Any, device: Any = "cpu") -> None:
    """Refuse (``ValueError``, before any plugin works on the experience) a multi-task model
    whose head of a task is padded by Avalanche's multi-task forward.

    Avalanche's ``MultiTaskModule.forward(x, task_labels)`` with a tensor of task labels (as
    Avalanche's strategies, evaluation and a user's ``model(x, t)`` call it) returns
    ``[N, max_class_label]``: the ``w_t`` outputs of head ``t`` followed by ``max_class_label
    - w_t`` zeros. ``MultiHeadClassifier``'s masking sets the inactive units *inside* a head
    to ``mask_value`` but not these zeros, so a head whose logits all fall below 0 predicts
    class ``w_t``, a class of another task. Heads differ in width when the labels are global
    (Avalanche's default: SplitMNIST's task 1 holds digits 2 and 3, its head grows to 4
    units while task 4's has 10) or tasks have different numbers of classes.

    Checked for every head trained so far (the model's ``known_train_tasks_labels``) and the
    experience's own, by calling the model both ways on two of the experience's inputs: the
    tensor-label output must be as wide as the head's (:func:`fromp.models.with_task`). A
    model that splits no batch by task label (fromp's multi-head models) passes.
    """
    if not takes_task_labels(model):
        return
    from avalanche.models import MultiTaskModule

    tasks = {int(t) for t in getattr(experience, "task_labels", None) or [0]}
    for m in model.modules():
        if isinstance(m, MultiTaskModule):
            tasks |= {int(t) for t in m.known_train_tasks_labels}
    x = _two_inputs(experience, device)
    if x is None:
        return
    with _quiet_eval(model, device):
        for t in sorted(tasks):
            own = with_task(model, t)(x).shape[-1]
            padded = model(x, torch.full((len(x),), t, dtype=torch.long, device=x.device))
            if padded.shape[-1] > own:
                width = padded.shape[-1]
                raise ValueError(
                    f"experience {experience.current_experience}: Avalanche's multi-task "
                    f"forward pads the {own} outputs of the head of task {t} with zeros to "
                    f"{width} units, which masking does not cover: once that head's logits "
                    f"fall below 0 it predicts class {own}, a class of another task. Count "
                    "the labels from zero in each experience (e.g. SplitMNIST(n_experiences=5, "
                    "return_task_id=True, class_ids_from_zero_in_each_exp=True)), or give "
                    "every head the same width (MultiHeadClassifier(in_features, "
                    "initial_out_features=<the number of classes>))"
                )


def require_optimizer_on(model: nn.Module, optimizer: Any, cls: type) -> None:
    """Refuse an optimizer that is not a ``cls`` (``TypeError``) or does not hold exactly
    ``model``'s trainable parameters (``ValueError``), before any work."""
    if not isinstance(optimizer, cls):
        raise TypeError(
            f"optimizer must be a fromp.optim.{cls.__name__} built on the model, "
            f"got {type(optimizer)}"
        )
    opt_ids = {id(p) for p in optimizer.params}
    if opt_ids != {id(p) for p in model.parameters() if p.requires_grad}:
        raise ValueError("optimizer must hold exactly the model's trainable parameters")


def method_parameters(method: type, *skip: str) -> dict[str, inspect.Parameter]:
    """The constructor arguments of a method class but ``self`` and ``skip``, keyword-only:
    the strategy's own (written once, on the method)."""
    params = inspect.signature(method.__init__).parameters.items()
    kind = inspect.Parameter.KEYWORD_ONLY
    return {n: p.replace(kind=kind) for n, p in params if n not in ("self", *skip)}


def show_signature(
    strategy: type, params: dict[str, inspect.Parameter], after: Sequence[str] = ()
) -> None:
    """Give ``strategy.__init__`` the signature ``model, optimizer, criterion``, ``params``,
    ``after``, ``**kwargs``: for ``help`` and Avalanche's mapping of positional arguments."""
    init = getattr(strategy.__init__, "__wrapped__", strategy.__init__)
    own = inspect.signature(init).parameters
    first = [own[n] for n in ("self", "model", "optimizer", "criterion")]
    init.__signature__ = inspect.Signature(  # type: ignore[attr-defined]
        [*first, *params.values(), *(own[n] for n in (*after, "kwargs"))]
    )
