"""The continual-method protocol (:class:`fromp.continual.protocol.ContinualMethod`) on
Avalanche's hooks: :class:`MethodPlugin`, the adapter the plugins of FROMP, EWC and VCL are
(in the shape of Avalanche's ``LwFPlugin``: the hooks call the method, which holds the maths
and the settings), and what it reads of an Avalanche experience."""

from __future__ import annotations

from typing import Any

import torch
from avalanche.core import SupervisedPlugin
from fromp_avalanche.benchmarks import experience_tensors
from fromp_avalanche.models import unwrap
from torch import Tensor

__all__ = ["MethodPlugin", "experience_facts", "one_task_label"]


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


def one_task_label(task_labels: Tensor) -> int:
    """The one task label of an experience's ``[N]`` labels (``ValueError`` otherwise)."""
    tasks = task_labels.unique()
    if len(tasks) != 1:
        raise ValueError(f"an experience must hold one task label, got {tasks.tolist()}")
    return int(tasks[0])


class MethodPlugin(SupervisedPlugin):
    """A continual method (:attr:`method`) on Avalanche's hooks: ``before_training_exp``
    calls ``begin_task`` (:meth:`facts`), ``before_backward`` adds ``loss_terms`` to the
    strategy's loss, ``before_update`` calls ``before_update`` with the strategy's
    optimizer, ``after_training_exp`` calls ``learn_task`` with the experience's data
    (:meth:`data`), the optimizer and ``current_experience`` as key; ``state_dict`` and
    ``load_state_dict`` are the method's. The network is the strategy's model, unwrapped
    from fromp's Avalanche adapter."""

    #: the experience's data for ``learn_task`` read with its evaluation transforms
    eval_transforms = True

    def __init__(self, method: Any) -> None:
        super().__init__()
        self.method = method

    def facts(self, strategy: Any) -> dict[str, Any]:
        """The keyword arguments of ``begin_task`` (:func:`experience_facts`)."""
        return experience_facts(strategy)

    def data(self, strategy: Any) -> tuple[Tensor | None, Tensor | None, int | None]:
        """``(x, y, task)`` of the experience for ``learn_task``."""
        x, y, t = experience_tensors(
            strategy.experience.dataset, eval_transforms=self.eval_transforms
        )
        return x, y, one_task_label(t)

    def before_training_exp(self, strategy: Any, *args: Any, **kwargs: Any) -> None:
        self.method.begin_task(unwrap(strategy.model), **self.facts(strategy))

    def before_backward(self, strategy: Any, *args: Any, **kwargs: Any) -> None:
        net, loss, out = unwrap(strategy.model), strategy.loss, strategy.mb_output
        task = strategy.mb_task_id
        strategy.loss = loss + self.method.loss_terms(net, strategy.mb_x, out, task=task, loss=loss)

    def before_update(self, strategy: Any, *args: Any, **kwargs: Any) -> None:
        self.method.before_update(unwrap(strategy.model), strategy.optimizer)

    def after_training_exp(self, strategy: Any, *args: Any, **kwargs: Any) -> None:
        x, y, task = self.data(strategy)
        key, opt = int(strategy.experience.current_experience), strategy.optimizer
        self.method.learn_task(unwrap(strategy.model), x, y, task, optimizer=opt, experience=key)

    def state_dict(self) -> dict[str, Any]:
        """The method's state (its ``state_dict``)."""
        return self.method.state_dict()

    def load_state_dict(
        self, state: dict[str, Any], *, device: torch.device | str | None = None
    ) -> None:
        """Restore :meth:`state_dict`, tensors moved to ``device`` when given."""
        self.method.load_state_dict(state, device=device)
