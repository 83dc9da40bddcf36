"""The networks of the FROMP paper, as plain ``nn.Module``s with optional task heads.

Every model here maps ``x [N, ...] -> logits [N, K]`` and takes a ``task`` argument that
selects the output head: an ``int`` (one head for the whole batch), a ``[N]`` long tensor
(one head per example) or ``None`` (allowed only with a single head). Single-head models
ignore ``task``. :func:`with_task` fixes the head, giving a module ``x -> logits`` that
shares the parameters, which is what the curvature and GP tools of :mod:`fromp` expect.
Avalanche multi-task wrappers live in :mod:`fromp_avalanche.models`.
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence

import torch
from torch import Tensor, nn

__all__ = [
    "CifarCNN",
    "LeNet5",
    "MultiHeadMLP",
    "MultiHeadModel",
    "TaskView",
    "head_parameters",
    "is_multitask",
    "takes_task_labels",
    "uncompiled",
    "with_task",
]

TaskArg = int | Tensor | None


class MultiHeadModel(nn.Module):
    """A shared body followed by ``n_heads`` linear heads of width ``head_size``.

    Subclasses define ``self.body`` (``x -> features [N, D]``) and call
    :meth:`_make_heads`.
    """

    n_heads: int
    head_size: int
    body: nn.Module
    heads: nn.ModuleList

    def _make_heads(self, in_features: int, n_heads: int, head_size: int) -> None:
        if n_heads < 1 or head_size < 1:
            raise ValueError(
                f"n_heads and head_size must be >= 1, got n_heads={n_heads}, head_size={head_size}"
            )
        self.n_heads, self.head_size = n_heads, head_size
        self.heads = nn.ModuleList(nn.Linear(in_features, head_size) for _ in range(n_heads))

    def features(self, x: Tensor) -> Tensor:
        """The shared representation ``[N, D]``."""
        return self.body(x)

    def forward(self, x: Tensor, task: TaskArg = None) -> Tensor:
        """Logits ``[N, head_size]`` of the head(s) selected by ``task``."""
        h = self.features(x)
        if self.n_heads == 1:
            return self.heads[0](h)
        if task is None:
            raise ValueError(
                f"task is required: this model has {self.n_heads} heads "
                "(pass an int or a [N] tensor of task ids)"
            )
        if isinstance(task, Tensor) and task.ndim == 0:
            task = int(task.item())
        if isinstance(task, int):
            if not 0 <= task < self.n_heads:
                raise ValueError(f"task must be in [0, {self.n_heads}), got {task}")
            return self.heads[task](h)
        if task.shape != (len(x),):
            raise ValueError(f"task tensor must have shape [N]=[{len(x)}], got {tuple(task.shape)}")
        out = torch.stack([head(h) for head in self.heads], dim=1)  # N, H, K
        return out[torch.arange(len(x), device=x.device), task.long()]


class MultiHeadMLP(MultiHeadModel):
    """Fully connected ReLU network with task heads (FROMP's MNIST models).

    Split MNIST: ``MultiHeadMLP(784, (256, 256), n_heads=5, head_size=2)``.
    Permuted MNIST: ``MultiHeadMLP(784, (100, 100), n_heads=1, head_size=10)``.
    Inputs of any shape ``[N, ...]`` are flattened.
    """

    def __init__(
        self,
        in_features: int = 784,
        hidden: Sequence[int] = (256, 256),
        n_heads: int = 5,
        head_size: int = 2,
    ) -> None:
        super().__init__()
        layers: list[nn.Module] = [nn.Flatten()]
        width = in_features
        for h in hidden:
            layers += [nn.Linear(width, h), nn.ReLU()]
            width = h
        self.body = nn.Sequential(*layers)
        self._make_heads(width, n_heads, head_size)


class CifarCNN(MultiHeadModel):
    """FROMP's split-CIFAR network: conv 32-32-64-64 (3x3), max-pooling, FC 512, heads.

    Input ``[N, 3, 32, 32]``. Dropout (0.25 after each pooling, 0.5 before the heads) as in
    the reference architecture; it is inactive in ``eval()`` mode, where all curvature is
    computed.
    """

    def __init__(
        self, in_channels: int = 3, n_heads: int = 6, head_size: int = 10, dropout: bool = True
    ) -> None:
        super().__init__()
        p1, p2 = (0.25, 0.5) if dropout else (0.0, 0.0)
        self.body = nn.Sequential(
            nn.Conv2d(in_channels, 32, 3, padding=1),
            nn.ReLU(),
            nn.Conv2d(32, 32, 3),
            nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Dropout(p1),
            nn.Conv2d(32, 64, 3, padding=1),
            nn.ReLU(),
            nn.Conv2d(64, 64, 3),
            nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Dropout(p1),
            nn.Flatten(),
            nn.Linear(64 * 6 * 6, 512),
            nn.ReLU(),
            nn.Dropout(p2),
        )
        self._make_heads(512, n_heads, head_size)


class LeNet5(MultiHeadModel):
    """LeNet-5 for 28x28 inputs: conv 6 (5x5, padding 2) - pool - conv 16 (5x5) - pool -
    FC 120 - FC 84 - heads, with ReLU activations."""

    def __init__(self, in_channels: int = 1, n_heads: int = 1, head_size: int = 10) -> None:
        super().__init__()
        self.body = nn.Sequential(
            nn.Conv2d(in_channels, 6, 5, padding=2),
            nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Conv2d(6, 16, 5),
            nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Flatten(),
            nn.Linear(16 * 5 * 5, 120),
            nn.ReLU(),
            nn.Linear(120, 84),
            nn.ReLU(),
        )
        self._make_heads(84, n_heads, head_size)


def uncompiled(model: nn.Module) -> nn.Module:
    """The module inside ``torch.compile``'s wrapper (``model._orig_mod``), else ``model``.

    The compiled module and the original share their parameters (names without the
    ``_orig_mod.`` prefix here); curvature, Jacobian and Fisher passes run eagerly on the
    original, since a compiled backward cannot be differentiated again (``create_graph``)
    nor run per example under ``torch.func``."""
    while isinstance(getattr(model, "_orig_mod", None), nn.Module):
        model = model._orig_mod
    return model


def takes_task_labels(model: nn.Module) -> bool:
    """Whether ``model.forward`` takes the task label as a second argument named
    ``task_labels``: the convention of Avalanche's ``MultiTaskModule``
    (``forward(x, task_labels)``), recognised without importing Avalanche."""
    try:
        params = inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        return False
    return "task_labels" in params


def is_multitask(model: nn.Module) -> bool:
    """Whether ``model`` needs a task label: a :class:`MultiHeadModel` with several heads,
    or a module whose ``forward`` takes ``task_labels`` (an Avalanche ``MultiTaskModule``,
    e.g. with a ``MultiHeadClassifier``)."""
    return getattr(model, "n_heads", 1) > 1 or takes_task_labels(model)


def head_parameters(model: nn.Module) -> dict[str, int]:
    """The parameters of ``model`` that belong to one task's head: ``{name: task label}``
    (names as in ``model.named_parameters()``); every other parameter is shared.

    Heads are recognised by structure, for :mod:`fromp`'s networks and Avalanche's without
    importing it: a :class:`MultiHeadModel`'s ``heads[t]`` (task ``t``), and a module whose
    ``classifiers`` is an ``nn.ModuleDict`` keyed by task labels (Avalanche's
    ``MultiHeadClassifier``: ``classifiers["t"]``), wherever they sit in ``model``."""
    out: dict[str, int] = {}
    names = {id(p): n for n, p in model.named_parameters()}
    for module in model.modules():
        if isinstance(module, MultiHeadModel) and module.n_heads > 1:
            heads = dict(enumerate(module.heads))
        else:
            found = getattr(module, "classifiers", None)
            if not isinstance(found, nn.ModuleDict) or not all(k.isdigit() for k in found):
                continue
            heads = {int(k): m for k, m in found.items()}
        for task, head in heads.items():
            for p in head.parameters():
                if id(p) in names:
                    out[names[id(p)]] = task
    return out


class TaskView(nn.Module):
    """``x -> model(x, task)``: a module with a fixed head sharing ``model``'s parameters
    (in the same order), for tools that call ``module(x)``. Its output is always
    ``[N, C]``: a model that squeezes the batch dimension of a single example (Avalanche's
    ``MTSimpleCNN``) gets it back.

    ``model(x, task=task)`` for :mod:`fromp` models, ``model(x, task)`` (an ``int`` task
    label, Avalanche's single-task path) for modules whose ``forward`` takes
    ``task_labels``."""

    def __init__(self, model: nn.Module, task: int) -> None:
        super().__init__()
        self.model = model
        self.task = int(task)
        self._positional = takes_task_labels(model)

    def forward(self, x: Tensor) -> Tensor:
        if self._positional:
            out = self.model(x, self.task)
        else:
            out = self.model(x, task=self.task)
        if out.ndim == 1 and x.ndim > 1 and x.shape[0] == 1:
            # a model that squeezes its features (Avalanche's MTSimpleCNN: x.squeeze())
            # drops the batch dimension of a batch of one: [C] -> [1, C]
            out = out.unsqueeze(0)
        return out


def with_task(model: nn.Module, task: int | None) -> nn.Module:
    """``model`` with its head fixed to ``task`` (``model`` itself when the model needs no
    task label). A model that needs one (:func:`is_multitask`) refuses ``task=None``."""
    if not is_multitask(model):
        return model
    if task is None:
        raise ValueError(
            f"task must be an int for a multi-task model ({type(model).__name__} takes a "
            "task label), got None"
        )
    return TaskView(model, task)
