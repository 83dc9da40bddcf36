"""The one protocol every continual method of :mod:`fromp.continual` implements
(:class:`~fromp.continual.methods.FROMPMethod`, :class:`~fromp.continual.ewc.EWCMethod`,
:class:`~fromp.continual.vcl.VCLMethod`), so that one training loop drives any of them and
the Avalanche plugins of ``fromp_avalanche`` are adapters that call it and nothing else.

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
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol, runtime_checkable

import torch
from torch import Tensor, nn

__all__ = ["PROTOCOL", "ContinualMethod"]

#: The protocol's methods, in the order a loop calls them (tests hold every method to them).
PROTOCOL = (
    "begin_task",
    "loss_terms",
    "before_update",
    "learn_task",
    "state_dict",
    "load_state_dict",
)


@runtime_checkable
class ContinualMethod(Protocol):
    """What a continual method offers a training loop (module docstring for the loop).

    Every method takes the network as its first argument (VCL: the network it was built on,
    whose parameters are the posterior means); nothing of a training step waits for the device (the
    only host reads are FROMP's bounded check of the penalty's size in the first steps of an
    experience).

    Attributes:
        task_count: the number of distinct experiences learnt (a key learnt again counts
            once).
        last_terms: the detached, weighted parts of the last :meth:`loss_terms` (and
            :meth:`before_update`) by name, for metrics and loggers (e.g. FROMP's
            ``"penalty"``, ``"replay"``, ``"context"``); never read back by the method.
    """

    task_count: int
    last_terms: dict[str, Tensor]

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
        """Before training an experience.

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
        ...

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
        loss before the backward pass.

        Args:
            net: the network being trained.
            x: the mini-batch's inputs ``[B, ...]``.
            output: the network's outputs on ``x`` from the step's own forward ``[B, C]``.
            task: the task label of the batch (an int, ``[B]`` labels, or None).
            loss: the data loss of the step (a scalar), for checks of the terms' scale.

        Returns a scalar tensor (0 when the method adds nothing yet).
        """
        ...

    def before_update(self, net: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        """After the backward pass, before ``optimizer.step()``."""
        ...

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
        the method's memory of it. ``optimizer``: the loop's (a posterior kept by the
        optimizer, or state the method resets). ``experience``: the key; learning a key
        again replaces its entry (default: :meth:`begin_task`'s, else a new key)."""
        ...

    def state_dict(self) -> dict[str, Any]:
        """All the method's state (tensors and plain containers)."""
        ...

    def load_state_dict(
        self, state: dict[str, Any], *, device: torch.device | str | None = None
    ) -> None:
        """Restore :meth:`state_dict`, tensors moved to ``device`` when given; refuses a
        state with missing keys or other settings before changing anything."""
        ...
