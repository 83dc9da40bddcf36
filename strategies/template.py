"""The Avalanche template every strategy of :mod:`fromp_avalanche` is built on, and what the
plugins read from an Avalanche experience for a continual method's protocol."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from avalanche.training.plugins.evaluation import default_evaluator
from avalanche.training.templates import SupervisedTemplate
from torch import nn

from fromp.models import is_multitask, with_task

__all__ = [
    "MethodStrategy",
    "check_labels_fit",
    "experience_facts",
    "one_task_label",
    "require_optimizer_on",
]


def experience_facts(strategy: Any) -> dict[str, Any]:
    """What a continual method's ``begin_task`` takes from the strategy's experience: its
    task label (None when it has several), key (``current_experience``), size (``ess``)
    and classes."""
    exp = strategy.experience
    labels = list(getattr(exp, "task_labels", None) or [0])
    return {
        "task": int(labels[0]) if len(labels) == 1 else None,
        "experience": int(exp.current_experience),
        "ess": len(exp.dataset),
        "classes": [int(c) for c in getattr(exp, "classes_in_this_experience", None) or []],
    }


def one_task_label(task_labels: Any) -> int:
    """The one task label of an experience's ``[N]`` labels (``ValueError`` otherwise)."""
    tasks = task_labels.unique()
    if len(tasks) != 1:
        raise ValueError(f"an experience must hold one task label, got {tasks.tolist()}")
    return int(tasks[0])


class MethodStrategy(SupervisedTemplate):
    """Avalanche's ``SupervisedTemplate`` with a method's plugins in front of the user's.

    The method's plugins (e.g. :class:`fromp_avalanche.fromp.FROMPPlugin`) run before those in
    ``plugins``; ``self.plugin`` is the first of them. The keyword arguments are Avalanche's,
    with the defaults every strategy here uses.

    Args:
        method_plugins: the method's plugins, in hook order.
        model: the Avalanche model (a multi-head :mod:`fromp` model wrapped by
            :func:`fromp_avalanche.models.as_avalanche_model`).
        optimizer: its optimizer.
        criterion: the training loss (default ``nn.CrossEntropyLoss()``).
        train_mb_size, train_epochs, eval_mb_size, device, plugins, evaluator, eval_every:
            as in Avalanche, with its defaults (mini-batches of 1 for training and
            evaluation: pass e.g. ``train_mb_size=128``).
        **base_kwargs: further ``SupervisedTemplate`` arguments.
    """

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
        super().__init__(
            model=model,
            optimizer=optimizer,
            criterion=nn.CrossEntropyLoss() if criterion is None else criterion,
            train_mb_size=train_mb_size,
            train_epochs=train_epochs,
            eval_mb_size=eval_mb_size,
            device=device,
            plugins=[*method_plugins, *(plugins or [])],
            evaluator=evaluator,
            eval_every=eval_every,
            **base_kwargs,
        )

    def _before_training_exp(self, **kwargs: Any) -> None:
        super()._before_training_exp(**kwargs)
        check_labels_fit(self.model, self.experience, self.device)

    def _adapt_model(self, model: nn.Module | None) -> nn.Module:
        """The adaptation itself (Avalanche's); a strategy that adds parameters of its own
        when the model grows (VCL's twin) extends this, so that the optimizer refresh in
        :meth:`model_adaptation` sees them."""
        return super().model_adaptation(model)

    def model_adaptation(self, model: nn.Module | None = None) -> nn.Module:
        """Avalanche's model adaptation (heads added or grown for the experience), with the
        optimizer following the model: before the first adaptation the optimizer's
        parameters are mapped to their names (Avalanche's first ``make_optimizer``), and
        after every adaptation a parameter that grew (``IncrementalClassifier``) replaces
        its old tensor in the optimizer and a new one (a new head) is added to it.

        Avalanche itself refreshes the optimizer only before training an experience; a
        model adapted outside it (a checkpoint restored after heads grew, evaluation on a
        stream with new tasks) would otherwise train with an optimizer that holds the old
        head's tensors."""
        own = model is None or model is self.model
        if own and getattr(self, "optimized_param_id", True) is None:
            self.make_optimizer(reset_optimizer_state=True)
        out = self._adapt_model(model)
        if own and getattr(self, "optimized_param_id", None) is not None:
            self.make_optimizer(reset_optimizer_state=False)
        return out


def check_labels_fit(model: nn.Module, experience: Any, device: Any = "cpu") -> None:
    """Refuse (``ValueError``, before any training) an experience whose class labels do not
    index the model's outputs for its task: e.g. Avalanche's default global labels (2, 3 for
    the second split-MNIST task) with a fixed two-unit head per task. Heads that grow with
    the labels (Avalanche's ``MultiHeadClassifier`` / ``IncrementalClassifier``) pass."""
    classes = getattr(experience, "classes_in_this_experience", None)
    if not classes:
        return
    dataset = experience.dataset
    if len(dataset) == 0:
        return
    # at least two examples: a model that squeezes its features (x.squeeze(), e.g.
    # Avalanche's MTSimpleCNN) drops the batch dimension of a batch of one
    items = [dataset[i] for i in range(min(2, len(dataset)))]
    x = torch.stack([it[0] for it in items]).to(device)
    task = int(items[0][2]) if len(items[0]) > 2 else 0
    was_training = model.training
    model.eval()
    dev = torch.device(device)
    # a Bayesian model samples weights in its forward: the check must not move the RNG that
    # training draws from, or the run would differ from one without the check
    cuda = (
        [dev.index if dev.index is not None else torch.cuda.current_device()]
        if dev.type == "cuda"
        else []
    )
    try:
        with torch.random.fork_rng(devices=cuda), torch.no_grad():
            out = with_task(model, task if is_multitask(model) else None)(x)
    finally:
        model.train(was_training)
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
