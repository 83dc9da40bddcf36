"""Variational continual learning (VCL; Nguyen, Li, Bui & Turner, ICLR 2018) for Avalanche:
an adapter of :class:`fromp.continual.vcl.VCLMethod` (the ELBO, the posterior recursion,
coresets and their fits, the state). Hooks: the coreset kept out of the adapted dataset;
``begin_task`` and the optional ML fit; ``loss_terms`` (``KL / N_t``); ``learn_task``;
coreset training before evaluating a task, restored after it. The user's model (its
parameters are the posterior means) and optimizer are the strategy's."""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import torch
from fromp_avalanche.benchmarks import experience_tensors
from fromp_avalanche.models import unwrap
from fromp_avalanche.protocol import MethodPlugin
from fromp_avalanche.template import MethodStrategy, method_parameters, show_signature
from torch import Tensor, nn

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
    """VCL and VCL + coreset on any classifier, with :class:`fromp.continual.vcl.VCLMethod`'s
    keyword arguments. ``model`` is trained in place (its parameters are the posterior
    means); the log-variances (grown heads' included) are a new parameter group of
    ``optimizer`` (one warning). ``criterion`` (a cross-entropy on logits) is applied to each
    Monte Carlo sample in training; evaluation is ``model`` at the means, or with
    ``test_samples=S`` the criterion on ``log mean_s softmax`` of ``S`` samples."""

    def __init__(self, *, model: nn.Module, optimizer: torch.optim.Optimizer,
                 criterion: nn.Module | Callable | None = None, **kwargs: Any) -> None:  # fmt: skip
        settings = {k: v for k, v in kwargs.items() if k in METHOD_SETTINGS}
        template_kwargs = {k: v for k, v in kwargs.items() if k not in METHOD_SETTINGS}
        VCLMethod.check_optimizer(optimizer)  # before the method changes the model
        method = VCLMethod(unwrap(model), **settings)
        self._variance_group = method.add_variance_group(optimizer)
        if self._variance_group is not None:
            warnings.warn(  # stacklevel 3: the caller of Avalanche's wrapper of __init__
                f"VCL: the posterior's {len(method.variance_parameters())} log-variance tensors "
                f"were added to your optimizer as parameter group {self._variance_group} (its "
                "default settings); your model's parameters are the posterior means, trained in "
                "place",
                stacklevel=3,
            )
        super().__init__(method_plugins=[VCLPlugin(method)], model=model, optimizer=optimizer,
                         criterion=criterion, **template_kwargs)  # fmt: skip
        self._mc_logits: Tensor | None = None

    @property
    def method(self) -> VCLMethod:
        """The :class:`fromp.continual.vcl.VCLMethod` the strategy drives."""
        return self.plugin.method

    def _adapt_model(self, model: nn.Module | None) -> nn.Module:
        """Avalanche's adaptation, then the log-variances and priors of new or grown units
        (the strategy's own model only), in the optimizer's variance group."""
        out = super()._adapt_model(model)
        if model is None or model is self.model:
            self.method.sync(self.optimizer, self._variance_group)
        return out

    def forward(self) -> Tensor:
        """Training: ``log(mean_s softmax(f_s(x)))`` ``[N, K]`` over ``train_samples``
        samples. Evaluation: the model at the means (Avalanche's forward), or the Monte
        Carlo predictive over ``test_samples`` samples when it is set."""
        m = self.method
        if not self.is_training and m.test_samples is None:
            self._mc_logits = None
            return super().forward()
        s = m.train_samples if self.is_training else m.test_samples
        logits = m.sample_logits(self.mb_x, self.mb_task_id, s)  # S, N, K
        self._mc_logits = logits if self.is_training else None
        return m.log_mean_softmax(logits)

    def criterion(self) -> Tensor:
        """The criterion over the samples' logits (training) or the predictive (evaluation)."""
        if self.is_training and self._mc_logits is not None:
            return self.method.samples_loss(self._mc_logits, self.mb_y, self._criterion)
        return self._criterion(self.mb_output, self.mb_y)


show_signature(VCL, _PARAMS)
