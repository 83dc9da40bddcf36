"""Avalanche adapters for the models of :mod:`fromp.models`."""

from __future__ import annotations

from avalanche.models import MultiTaskModule
from torch import Tensor, nn

from fromp.continual.methods import Named, by_name
from fromp.models import MultiHeadModel

__all__ = ["AvalancheMultiHead", "Named", "as_avalanche_model", "by_name", "unwrap"]


class AvalancheMultiHead(MultiTaskModule):
    """A :class:`fromp.models.MultiHeadModel` as an Avalanche ``MultiTaskModule``: the task
    label of each example selects its head.

    The wrapped model is ``self.net``; its parameters are the adapter's (same order), so
    posteriors and curvature computed on ``self.net`` index the same ``[P]`` vector.
    """

    def __init__(self, net: MultiHeadModel) -> None:
        super().__init__()
        self.net = net

    def forward(self, x: Tensor, task_labels: Tensor | int) -> Tensor:
        if isinstance(task_labels, int):
            return self.net(x, task=task_labels)
        if task_labels.numel() > 0 and bool((task_labels == task_labels[0]).all()):
            return self.net(x, task=int(task_labels[0]))
        return self.net(x, task=task_labels)

    def forward_single_task(self, x: Tensor, task_label: int) -> Tensor:
        return self.net(x, task=int(task_label))


def as_avalanche_model(net: nn.Module) -> nn.Module:
    """Wrap a multi-head model for Avalanche; single-head models are returned unchanged."""
    if isinstance(net, MultiHeadModel) and net.n_heads > 1:
        return AvalancheMultiHead(net)
    return net


def unwrap(model: nn.Module) -> nn.Module:
    """The :mod:`fromp` model inside an Avalanche adapter (or ``model`` itself)."""
    return model.net if isinstance(model, AvalancheMultiHead) else model
