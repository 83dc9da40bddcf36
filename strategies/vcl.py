"""Variational continual learning (VCL; Nguyen, Li, Bui & Turner, ICLR 2018) for Avalanche:
an adapter of :class:`fromp.continual.vcl.VCLMethod`, which holds the maths (the ELBO, the
posterior recursion, coresets, the fits that own their optimizer) and the state.

The hooks: after the dataset adaptation the task's coreset is kept out of the training set;
before the task ``begin_task`` (``N_t``) and, on the first task, the maximum-likelihood fit
of the means; ``before_backward`` adds ``loss_terms`` (``KL(q || q_{t-1}) / N_t``) to the
Monte Carlo cross-entropy (the strategy's ``criterion`` on each weight sample); after the
task ``learn_task`` (the posterior becomes the prior, the optimizer's state is cleared: a
fresh Adam per task, as in the reference code); before evaluating a task the posterior is
trained on the coreset, and restored after the evaluation. ``forward`` returns
``log(mean_s softmax(f_s))`` so that Avalanche's accuracy and cross-entropy work.
"""

from __future__ import annotations

import inspect
from collections import defaultdict
from collections.abc import Callable
from typing import Any

import torch
from avalanche.training.plugins import SupervisedPlugin
from fromp_avalanche.benchmarks import experience_tensors
from fromp_avalanche.models import as_avalanche_model, unwrap
from fromp_avalanche.template import MethodStrategy, experience_facts
from torch import Tensor, nn

from fromp.continual.bayesian import BayesMultiHeadModel, MeanFieldNet
from fromp.continual.vcl import VCLMethod

__all__ = ["VCL", "VCLPlugin"]

#: The keyword arguments of :class:`fromp.continual.vcl.VCLMethod` (the strategy takes them all).
METHOD_SETTINGS = tuple(inspect.signature(VCLMethod).parameters)[1:]


class VCLPlugin(SupervisedPlugin):
    """VCL's hooks over :attr:`method`, a :class:`fromp.continual.vcl.VCLMethod` (module
    docstring); the strategy's ``train_epochs``, ``train_mb_size`` and learning rate fill
    the fit settings the method leaves None."""

    def __init__(self, method: VCLMethod):
        super().__init__()
        if not isinstance(method, VCLMethod):
            raise ValueError(f"method must be a VCLMethod, got {type(method).__name__}")
        self.method = method
        self._training = False

    def after_train_dataset_adaptation(self, strategy: Any, **kwargs: Any) -> None:
        m = self.method
        if m.coreset_size <= 0:
            return
        ds = strategy.adapted_dataset
        m.check_coreset_size(len(ds))
        if m.coreset_method == "kcenter":
            x, y, _ = experience_tensors(ds, eval_transforms=False)
            idx = m.coreset_indices(len(ds), x)
            cx, cy = x[idx], y[idx]
        else:
            idx = m.coreset_indices(len(ds))
            cx, cy, _ = experience_tensors(ds.subset(idx.tolist()), eval_transforms=False)
        keep = torch.ones(len(ds), dtype=torch.bool)
        keep[idx] = False
        strategy.adapted_dataset = ds.subset(torch.nonzero(keep).flatten().tolist())
        m.add_coreset(experience_facts(strategy)["task"], cx, cy)

    def before_training_exp(self, strategy: Any, **kwargs: Any) -> None:
        m = self.method
        self._training = True
        facts = {**experience_facts(strategy), "ess": len(strategy.adapted_dataset)}
        m.begin_task(unwrap(strategy.model), **facts)
        if m.needs_ml_init(strategy.train_epochs):
            x, y, _ = experience_tensors(strategy.adapted_dataset, eval_transforms=False)
            lr = strategy.optimizer.param_groups[0]["lr"]
            m.ml_init(x, y, epochs=strategy.train_epochs, lr=lr,
                      batch_size=strategy.train_mb_size, device=strategy.device)  # fmt: skip

    def before_backward(self, strategy: Any, **kwargs: Any) -> None:
        net, loss, out = unwrap(strategy.model), strategy.loss, strategy.mb_output
        task = strategy.mb_task_id
        strategy.loss = loss + self.method.loss_terms(net, strategy.mb_x, out, task=task, loss=loss)

    def after_training_exp(self, strategy: Any, **kwargs: Any) -> None:
        facts, net, opt = experience_facts(strategy), unwrap(strategy.model), strategy.optimizer
        key = facts["experience"]
        self.method.learn_task(net, None, None, facts["task"], optimizer=opt, experience=key)
        self._training = False

    def before_eval_exp(self, strategy: Any, **kwargs: Any) -> None:
        if self._training or not self.method.coresets:
            return
        self.method.prepare_eval(
            experience_facts(strategy)["task"],
            epochs=strategy.train_epochs,
            lr=strategy.optimizer.param_groups[0]["lr"],
            batch_size=strategy.train_mb_size,
            device=strategy.device,
        )

    def after_eval(self, strategy: Any, **kwargs: Any) -> None:
        self.method.restore()

    def state_dict(self) -> dict:
        """The method's state (:meth:`fromp.continual.vcl.VCLMethod.state_dict`)."""
        return self.method.state_dict()

    def load_state_dict(self, state: dict) -> None:
        """Restore :meth:`state_dict` (in place, into the network; a twin must have the same
        parameters: resume after the model's adaptation to the same experiences)."""
        self.method.load_state_dict(state)


class VCL(MethodStrategy):
    """VCL (``coreset_size=0``) and VCL + coreset as an Avalanche strategy.

    ``model`` is any classifier. A fromp ``MultiHeadModel`` (wrapped or not) is converted to
    mean-field Gaussian layers; a ``BayesMultiHeadModel`` is used as it is; any other module
    gets a :class:`fromp.continual.bayesian.MeanFieldTwin` (new heads start from the prior):
    see :class:`fromp.continual.vcl.VCLMethod`, whose keyword arguments these are.
    After a conversion the optimizer (one parameter group) is re-pointed at the Bayesian
    parameters (means and log-variances), with its hyper-parameters kept and state cleared.
    ``criterion`` must be a cross-entropy on logits: it is applied to each Monte Carlo
    sample in training and to ``log(mean_s softmax)`` in evaluation.
    Adam's state is reset at the start of every task (a fresh optimizer per task, as in the
    reference code). Avalanche's template arguments (``criterion``, ``train_mb_size``, ...)
    are those of :class:`fromp_avalanche.template.MethodStrategy`.
    """

    def __init__(
        self,
        *,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        train_samples: int = 10,
        test_samples: int = 100,
        ml_init_epochs: int | None = None,
        ml_lr: float | None = None,
        coreset_size: int = 0,
        coreset_method: str | None = None,
        coreset_epochs: int | None = None,
        coreset_mb_size: int | None = None,
        coreset_lr: float | None = None,
        prior_precision: float = 1.0,
        init_logvar: float = -6.0,
        mean_init_std: float | None = 0.1,
        seed: int | None = None,
        criterion: nn.Module | Callable | None = None,
        **template_kwargs: Any,
    ) -> None:
        settings = {k: v for k, v in locals().items() if k in METHOD_SETTINGS}
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
        plugin = VCLPlugin(method)
        template_kwargs["criterion"] = criterion
        super().__init__(
            method_plugins=[plugin], model=model, optimizer=optimizer, **template_kwargs
        )
        self._mc_logits: Tensor | None = None

    @property
    def method(self) -> VCLMethod:
        """The :class:`fromp.continual.vcl.VCLMethod` the strategy drives."""
        return self.plugin.method

    @property
    def net(self) -> MeanFieldNet:
        """The Bayesian network (a ``BayesMultiHeadModel``, or a ``MeanFieldTwin``)."""
        return self.plugin.method.net

    def _adapt_model(self, model: nn.Module | None) -> nn.Module:
        """Avalanche's adaptation (new heads or units), then the twin's log-variances and
        priors for the new parameters (before the optimizer is refreshed)."""
        model = super()._adapt_model(model)
        self.net.sync()
        return model

    def forward(self) -> Tensor:
        """``log(mean_s softmax(f_s(x)))`` ``[N, K]`` over ``train_samples`` (training) or
        ``test_samples`` (evaluation) weight samples."""
        m = self.method
        s = m.train_samples if self.is_training else m.test_samples
        logits = m.sample_logits(self.mb_x, self.mb_task_id, s)  # S, N, K
        self._mc_logits = logits if self.is_training else None
        return m.log_mean_softmax(logits)

    def criterion(self) -> Tensor:
        """Training: MC average of the criterion over samples (the KL term is added by the
        plugin). Evaluation: the criterion on the predictive log-probabilities."""
        if self.is_training and self._mc_logits is not None:
            s, n, k = self._mc_logits.shape
            return self._criterion(self._mc_logits.reshape(s * n, k), self.mb_y.repeat(s))
        return self._criterion(self.mb_output, self.mb_y)
