"""An Avalanche plugin that records what the training step hands to the backward pass:
shared by the tests of FROMP's Avalanche plugin (penalty, coreset, context term)."""

from __future__ import annotations

import copy

import torch.nn.functional as F
from avalanche.core import SupervisedPlugin


class LossProbe(SupervisedPlugin):
    """Records, at each training step (after the plugins before it): the experience, the
    loss handed to the backward pass, the mini-batch's cross-entropy, its inputs and
    outputs, and a copy of the model (the first ``keep_models`` steps)."""

    def __init__(self, keep_models: int = 400) -> None:
        super().__init__()
        self.keep_models = keep_models
        self.steps: list[dict] = []

    def before_backward(self, strategy, **kwargs):
        keep = len(self.steps) < self.keep_models
        self.steps.append(
            {
                "exp": strategy.experience.current_experience,
                "loss": float(strategy.loss),
                "ce": float(F.cross_entropy(strategy.mb_output, strategy.mb_y)),
                "x": strategy.mb_x.detach().clone(),
                "out": strategy.mb_output.detach().clone(),
                "net": copy.deepcopy(strategy.model) if keep else None,
            }
        )
