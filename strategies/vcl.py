"""Variational continual learning (VCL; Nguyen, Li, Bui & Turner, ICLR 2018) for Avalanche:
an adapter of :class:`fromp.continual.vcl.VCLMethod` (the ELBO, the posterior recursion,
coresets and their fits, the state). Hooks: the task's coreset kept out of the adapted
dataset; ``begin_task`` (``N_t``) and the first task's ML fit of the means; ``loss_terms``
(``KL / N_t``) added to the Monte Carlo cross-entropy; ``learn_task`` (posterior -> prior, a
fresh optimizer state); coreset training before evaluating a task, restored after it."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable
from typing import Any

import torch
from fromp_avalanche.benchmarks import experience_tensors
from fromp_avalanche.models import as_avalanche_model, unwrap
from fromp_avalanche.protocol import MethodPlugin
from fromp_avalanche.template import MethodStrategy, method_parameters, show_signature
from torch import Tensor, nn

from fromp.continual.bayesian import BayesMultiHeadModel, MeanFieldNet
from fromp.continual.vcl import VCLMethod

__all__ = ["VCL", "VCLPlugin"]

_PARAMS = method_parameters(VCLMethod, "net")
METHOD_SETTINGS = tuple(_PARAMS)  #: VCLMethod's keyword arguments (the strategy takes them all)


class VCLPlugin(MethodPlugin):
    """:class:`~fromp_avalanche.protocol.MethodPlugin` over a :class:`fromp.continual.vcl.
    VCLMethod` (``ess``: the adapted dataset's size); the strategy's epochs, mini-batch
    size and learning rate fill the fit settings the method leaves None."""

    def __init__(self, method: VCLMethod):
        if not isinstance(method, VCLMethod):
            raise ValueError(f"method must be a VCLMethod, got {type(method).__name__}")
        super().__init__(method)
        self._training = False

    def facts(self, strategy: Any) -> dict[str, Any]:
        return {**super().facts(strategy), "ess": len(strategy.adapted_dataset)}

    def data(self, strategy: Any) -> tuple[None, None, int | None]:
        return None, None, self.facts(strategy)["task"]  # VCL reads no data after a task

    def after_train_dataset_adaptation(self, strategy: Any, **kwargs: Any) -> None:
        ds = strategy.adapted_dataset

        def rows(idx: Tensor | None) -> tuple[Tensor, Tensor]:
            part = ds if idx is None else ds.subset(idx.tolist())
            return experience_tensors(part, eval_transforms=False)[:2]

        idx = self.method.take_coreset(len(ds), rows, self.facts(strategy)["task"])
        if len(idx):  # the coreset kept out of the training data
            keep = torch.ones(len(ds), dtype=torch.bool)
            keep[idx] = False
            strategy.adapted_dataset = ds.subset(torch.nonzero(keep).flatten().tolist())

    def before_training_exp(self, strategy: Any, **kwargs: Any) -> None:
        self._training = True
        super().before_training_exp(strategy)
        m = self.method
        if m.needs_ml_init(strategy.train_epochs):
            x, y, _ = experience_tensors(strategy.adapted_dataset, eval_transforms=False)
            lr = strategy.optimizer.param_groups[0]["lr"]
            m.ml_init(x, y, epochs=strategy.train_epochs, lr=lr, batch_size=strategy.train_mb_size,
                      device=strategy.device)  # fmt: skip

    def after_training_exp(self, strategy: Any, **kwargs: Any) -> None:
        super().after_training_exp(strategy)
        self._training = False

    def before_eval_exp(self, strategy: Any, **kwargs: Any) -> None:
        if self._training or not self.method.coresets:
            return
        s, lr = strategy, strategy.optimizer.param_groups[0]["lr"]
        self.method.prepare_eval(self.facts(s)["task"], epochs=s.train_epochs, lr=lr,
                                 batch_size=s.train_mb_size, device=s.device)  # fmt: skip

    def after_eval(self, strategy: Any, **kwargs: Any) -> None:
        self.method.restore()


class VCL(MethodStrategy):
    """VCL and VCL + coreset on any classifier (converted as :class:`fromp.continual.vcl.
    VCLMethod` converts it; its keyword arguments are these), the optimizer (one group)
    re-pointed at the Bayesian parameters. ``criterion``: a cross-entropy on logits, applied
    to each Monte Carlo sample in training and to ``log mean_s softmax`` in evaluation."""

    def __init__(
        self,
        *,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        criterion: nn.Module | Callable | None = None,
        **kwargs: Any,
    ) -> None:
        settings = {k: v for k, v in kwargs.items() if k in METHOD_SETTINGS}
        template_kwargs = {k: v for k, v in kwargs.items() if k not in METHOD_SETTINGS}
        net = unwrap(model)
        if not isinstance(net, MeanFieldNet) and len(optimizer.param_groups) != 1:
            raise ValueError(
                "optimizer must have a single parameter group (it is re-pointed at the "
                f"Bayesian parameters), got {len(optimizer.param_groups)}"
            )
        method = VCLMethod(net, **settings)
        if method.net is not net:  # converted: the strategy trains the Bayesian network
            model = method.net
            if isinstance(method.net, BayesMultiHeadModel):
                model = as_avalanche_model(method.net)
            optimizer.param_groups[0]["params"] = list(model.parameters())
            optimizer.state = defaultdict(dict)
        super().__init__(method_plugins=[VCLPlugin(method)], model=model, optimizer=optimizer,
                         criterion=criterion, **template_kwargs)  # fmt: skip
        self._mc_logits: Tensor | None = None

    @property
    def method(self) -> VCLMethod:
        """The :class:`fromp.continual.vcl.VCLMethod` the strategy drives."""
        return self.plugin.method

    @property
    def net(self) -> MeanFieldNet:
        """The Bayesian network (``method.net``)."""
        return self.plugin.method.net

    def _adapt_model(self, model: nn.Module | None) -> nn.Module:
        """Avalanche's adaptation, then the twin's log-variances and priors of new units."""
        model = super()._adapt_model(model)
        self.net.sync()
        return model

    def forward(self) -> Tensor:
        """``log(mean_s softmax(f_s(x)))`` ``[N, K]`` over the method's samples."""
        m = self.method
        s = m.train_samples if self.is_training else m.test_samples
        logits = m.sample_logits(self.mb_x, self.mb_task_id, s)  # S, N, K
        self._mc_logits = logits if self.is_training else None
        return m.log_mean_softmax(logits)

    def criterion(self) -> Tensor:
        """The criterion over the samples' logits (training) or the predictive (evaluation)."""
        if self.is_training and self._mc_logits is not None:
            s, n, k = self._mc_logits.shape
            return self._criterion(self._mc_logits.reshape(s * n, k), self.mb_y.repeat(s))
        return self._criterion(self.mb_output, self.mb_y)


show_signature(VCL, _PARAMS)
