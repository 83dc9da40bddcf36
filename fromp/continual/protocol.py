"""The one base class of every continual method of :mod:`fromp.continual`
(:class:`~fromp.continual.methods.FROMPMethod`, :class:`~fromp.continual.ewc.EWCMethod`,
:class:`~fromp.continual.vcl.VCLMethod`, and a user's own method), so that one training loop
drives any of them and the Avalanche plugins of ``fromp_avalanche`` are adapters that call it
and nothing else.

A training loop over a stream of experiences::

    for e, (x, y, task) in enumerate(stream):
        method.begin_task(net, task=task, experience=e, ess=len(x), classes=y.unique().tolist())
        for xb, yb in batches(x, y):
            out = with_task(net, task)(xb)
            loss = F.cross_entropy(out, yb)
            loss = loss + method.loss_terms(net, xb, out, task=task, loss=loss)
            opt.zero_grad()
            loss.backward()
            method.before_update(net, opt)
            opt.step()
        method.learn_task(net, x, y, task, optimizer=opt, experience=e)

``loss_terms`` returns the method's whole extra loss, already weighted (FROMP: ``tau R`` on
the memorable points, the coreset's loss with ``replay=True``, the context term; EWC: the
``lambda``-weighted quadratic; VCL: ``KL(q || q_{t-1}) / N_t``). ``before_update`` is what
the method does between the backward pass and the step (FROMP: the gradient clipping at
``tau * grad_clip_norm``, IVON's penalty at the mean). ``task_count`` is the number of
distinct experiences learnt (an experience learnt again counts once), for every method.

:class:`ContinualMethod` holds the public calls, their one documented signature and the
bookkeeping every method shares (the experience keys, ``task_count``, ``last_terms``, the
checks of ``begin_task``'s arguments); a method implements its own part in four hooks,
:meth:`~ContinualMethod._begin`, :meth:`~ContinualMethod._loss_terms`,
:meth:`~ContinualMethod._before_update` (optional) and :meth:`~ContinualMethod._learn`, and
its :meth:`~ContinualMethod.state_dict` / :meth:`~ContinualMethod.load_state_dict`::

    class L2Method(ContinualMethod):  # an L2 pull towards the weights after each experience
        def __init__(self, weight: float) -> None:
            super().__init__()
            self.weight, self.anchor = weight, None

        def _begin(self, net, start):
            pass

        def _loss_terms(self, net, x, output, task, loss):
            if self.anchor is None:
                return output.new_zeros(())
            value = self.weight * sum(((p - a) ** 2).sum()
                                      for p, a in zip(net.parameters(), self.anchor))
            self.last_terms["l2"] = value.detach()
            return value

        def _learn(self, net, x, y, task, optimizer, key):
            self.anchor = [p.detach().clone() for p in net.parameters()]

        def state_dict(self):
            return {"anchor": self.anchor, "task_count": self.task_count,
                    "experiences": list(self.experiences)}

        def load_state_dict(self, state, *, device=None):
            ...
"""

from __future__ import annotations

import abc
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, TypeAlias

import torch
from torch import Tensor, nn

from fromp._checks import check_count
from fromp.continual.experiences import add_experience, experience_key, forget_experience

__all__ = ["HOOKS", "PROTOCOL", "ContinualMethod", "Optim", "TaskLabels", "TaskStart"]

#: The protocol's methods, in the order a loop calls them (tests hold every method to them).
PROTOCOL = (
    "begin_task",
    "loss_terms",
    "before_update",
    "learn_task",
    "state_dict",
    "load_state_dict",
)
#: The hooks a method implements behind the first four (``_before_update``: optional).
HOOKS = ("_begin", "_loss_terms", "_before_update", "_learn")

#: A batch's task label as :meth:`ContinualMethod.loss_terms` takes it: an int, ``[B]``
#: labels, or None.
TaskLabels: TypeAlias = "int | Tensor | None"
#: The loop's optimizer as :meth:`ContinualMethod.learn_task` takes it (None: not given).
Optim: TypeAlias = "torch.optim.Optimizer | None"


@dataclass(frozen=True)
class TaskStart:
    """:meth:`ContinualMethod.begin_task`'s arguments, checked, as its hook ``_begin`` gets
    them.

    Attributes:
        task: the task label (the head) as given, None for one head.
        experience: the experience's key (an int), None when not given.
        ess: ``N``, the experience's number of training examples (an int >= 1), or None.
        classes: the class labels the experience brings to the head (ints), or None.
        growing_head: the head adds output units as classes arrive.
    """

    task: int | None
    experience: int | None
    ess: int | None
    classes: tuple[int, ...] | None
    growing_head: bool


def _classes(classes: Sequence[int] | None) -> tuple[int, ...] | None:
    """``classes`` as a tuple of ints (None kept); ValueError naming it otherwise."""
    if classes is None:
        return None
    try:
        return tuple(int(c) for c in classes)
    except (TypeError, ValueError):
        raise ValueError(
            f"classes must be a sequence of int labels or None, got {classes!r}"
        ) from None


class ContinualMethod(abc.ABC):
    """What a continual method offers a training loop (module docstring for the loop), and
    the bookkeeping every method shares; subclasses implement the hooks (:data:`HOOKS`)
    and :meth:`state_dict` / :meth:`load_state_dict`, and call ``super().__init__()``.

    Every method takes the network as its first argument (VCL: the network it was built on,
    whose parameters are the posterior means); nothing of a training step waits for the device (the
    only host reads are FROMP's bounded check of the penalty's size in the first steps of an
    experience).

    Attributes:
        task_count: the number of distinct experiences learnt (a key learnt again counts
            once): ``len(experiences)``.
        experiences: the keys of the experiences learnt, in the order last learnt.
        last_terms: the detached, weighted parts of the last :meth:`loss_terms` (and
            :meth:`before_update`) by name, for metrics and loggers (e.g. FROMP's
            ``"penalty"``, ``"replay"``, ``"context"``); never read back by the method;
            emptied by :meth:`begin_task` and at the start of each :meth:`loss_terms`.
    """

    experiences: list[int]
    last_terms: dict[str, Tensor]

    def __init__(self) -> None:
        self.experiences = []
        self.last_terms = {}
        #: begin_task's experience key: learn_task's default, reset by learn_task
        self._experience: int | None = None

    # ------------------------------------------------------------------ the protocol
    def begin_task(
        self,
        net: nn.Module,
        *,
        task: int | None = None,
        experience: int | None = None,
        ess: int | None = None,
        classes: Sequence[int] | None = None,
        growing_head: bool = False,
    ) -> None:
        """Before training an experience: the arguments are checked (a ValueError naming
        the argument), the method's own preparation runs (:meth:`_begin`), then
        ``experience`` becomes :meth:`learn_task`'s default key and :attr:`last_terms` is
        emptied.

        Args:
            net: the network about to be trained (after any growth for the experience).
            task: its task label (the head), None for one head.
            experience: the experience's key (the default of :meth:`learn_task`'s).
            ess: ``N``, the number of training examples the experience's posterior is for
                (VCL's ``N_t``; required there).
            classes: the class labels the experience brings to the head.
            growing_head: the head adds output units as classes arrive (Avalanche's
                ``IncrementalClassifier``): its first experience fills it, yet more classes
                come.
        """
        start = TaskStart(
            task=task,
            experience=None if experience is None else experience_key([], experience),
            ess=None if ess is None else check_count(ess, "ess", allow_none=False),
            classes=_classes(classes),
            growing_head=bool(growing_head),
        )
        self._begin(net, start)
        self._experience = start.experience
        self.last_terms = {}

    def loss_terms(
        self,
        net: nn.Module,
        x: Tensor,
        output: Tensor,
        *,
        task: int | Tensor | None = None,
        loss: Tensor | None = None,
    ) -> Tensor:
        """The method's extra loss on a training step, already weighted: add it to the data
        loss before the backward pass (:meth:`_loss_terms`; :attr:`last_terms` is emptied
        first and holds its parts).

        Args:
            net: the network being trained.
            x: the mini-batch's inputs ``[B, ...]``.
            output: the network's outputs on ``x`` from the step's own forward ``[B, C]``.
            task: the task label of the batch (an int, ``[B]`` labels, or None).
            loss: the data loss of the step (a scalar), for checks of the terms' scale.

        Returns a scalar tensor (0 when the method adds nothing yet).
        """
        self.last_terms = {}
        return self._loss_terms(net, x, output, task, loss)

    def before_update(self, net: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        """After the backward pass, before ``optimizer.step()`` (:meth:`_before_update`;
        nothing unless the method changes the gradient beyond its loss's)."""
        self._before_update(net, optimizer)

    def learn_task(
        self,
        net: nn.Module,
        x: Tensor,
        y: Tensor,
        task: int | None,
        *,
        optimizer: torch.optim.Optimizer | None = None,
        experience: int | None = None,
    ) -> Any:
        """After training an experience on ``(x [N, ...], y [N])`` through head ``task``:
        the method's memory of it (:meth:`_learn`, whose value is returned). ``optimizer``:
        the loop's (a posterior kept by the optimizer, or state the method resets).
        ``experience``: the key; learning a key again replaces its entry (default:
        :meth:`begin_task`'s, else a new key). Once :meth:`_learn` returns, the key is the
        last of :attr:`experiences` (a key learnt again counts once in :attr:`task_count`)
        and :meth:`begin_task`'s key is spent."""
        key = experience_key(
            self.experiences, self._experience if experience is None else experience
        )
        result = self._learn(net, x, y, task, optimizer, key)
        forget_experience(self.experiences, key)  # a no-op where _learn took it out
        add_experience(self.experiences, key)
        self._experience = None
        return result

    @property
    def task_count(self) -> int:
        """The number of distinct experiences learnt: ``len(experiences)``."""
        return len(self.experiences)

    @abc.abstractmethod
    def state_dict(self) -> dict[str, Any]:
        """All the method's state (tensors and plain containers)."""

    @abc.abstractmethod
    def load_state_dict(
        self, state: dict[str, Any], *, device: torch.device | str | None = None
    ) -> None:
        """Restore :meth:`state_dict`, tensors moved to ``device`` when given; refuses a
        state with missing keys or other settings before changing anything."""

    # --------------------------------------------------------------------- the hooks
    @abc.abstractmethod
    def _begin(self, net: nn.Module, start: TaskStart) -> None:
        """The method's preparation for an experience (:meth:`begin_task`'s arguments
        checked in ``start``); may refuse them before the bookkeeping changes."""

    @abc.abstractmethod
    def _loss_terms(
        self, net: nn.Module, x: Tensor, output: Tensor, task: TaskLabels, loss: Tensor | None
    ) -> Tensor:
        """The method's weighted extra loss (:meth:`loss_terms`), its parts put in
        :attr:`last_terms` (empty on entry)."""

    def _before_update(self, net: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        """What the method does to the gradient (:meth:`before_update`): nothing here."""
        del net, optimizer

    @abc.abstractmethod
    def _learn(
        self, net: nn.Module, x: Tensor, y: Tensor, task: int | None, optimizer: Optim, key: int
    ) -> Any:
        """The method's memory of the experience of key ``key`` (:meth:`learn_task`'s
        ``experience``, or :meth:`begin_task`'s, or a new key, checked): a key in
        :attr:`experiences` is learnt again and its entry replaced (a hook that needs its
        old position takes it out with
        :func:`~fromp.continual.experiences.forget_experience`); the base records the key
        once this returns."""
