"""Variational continual learning (VCL; Nguyen, Li, Bui & Turner, ICLR 2018) for Avalanche:
a thin driver of :class:`fromp.continual.vcl.VCLMethod`, which holds the maths (the ELBO,
the posterior recursion, coresets, the fits that own their optimizer) and the state.

The hooks: after the dataset adaptation the task's coreset is kept out of the training set;
before the task ``begin_task`` (``N_t``) and, on the first task, the maximum-likelihood fit
of the means; ``before_backward`` adds ``KL(q || q_{t-1}) / N_t`` to the Monte Carlo
cross-entropy (the strategy's ``criterion`` on each weight sample); after the task the
posterior becomes the prior and the optimizer's state is reset (a fresh Adam per task, as in
the reference code); before evaluating a task the posterior is trained on the coreset, and
restored after the evaluation. ``forward`` returns ``log(mean_s softmax(f_s))`` so that
Avalanche's accuracy and cross-entropy work.
"""

from __future__ import annotations

import inspect
import warnings
from collections import defaultdict
from collections.abc import Callable
from typing import Any

import torch
from avalanche.training.plugins import SupervisedPlugin
from fromp_avalanche.benchmarks import experience_tensors
from fromp_avalanche.models import as_avalanche_model, unwrap
from fromp_avalanche.template import MethodStrategy
from torch import Tensor, nn

from fromp.continual.bayesian import BayesMultiHeadModel, MeanFieldNet, MeanFieldTwin
from fromp.continual.vcl import VCLMethod, prior_variance

__all__ = ["VCL", "VCLPlugin", "VCLTwinPlugin"]


def __getattr__(name: str) -> object:
    if (
        name == "dataset_tensors"
    ):  # the former name of fromp_avalanche.benchmarks.experience_tensors
        warnings.warn(
            "fromp_avalanche.vcl.dataset_tensors is deprecated: use "
            "fromp_avalanche.benchmarks.experience_tensors",
            DeprecationWarning,
            stacklevel=2,
        )
        return _train_tensors
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _train_tensors(dataset, batch_size: int = 2048) -> tuple[Tensor, Tensor, Tensor]:
    """``(x, y, task_labels)`` of ``dataset`` with its own (training) transforms."""
    return experience_tensors(dataset, batch_size, eval_transforms=False)


#: The keyword arguments of :class:`fromp.continual.vcl.VCLMethod` (the strategy takes them all).
METHOD_SETTINGS = tuple(inspect.signature(VCLMethod).parameters)[1:]


def _or(value: Any, default: Any) -> Any:
    return default if value is None else value


class VCLPlugin(SupervisedPlugin):
    """VCL's hooks over a :class:`fromp.continual.vcl.VCLMethod` (see the module docstring).
    The method's settings and state (``task_count``, ``seen_heads``, ``coresets``,
    ``n_train``, ...) are readable on the plugin; settings left None by the method are the
    strategy's (``train_epochs``, ``train_mb_size``, the optimizer's ``lr``).

    Args:
        net: the Bayesian network (the one inside the strategy's model): a
            :class:`fromp.continual.bayesian.BayesMultiHeadModel` or ``MeanFieldTwin``.
        method: the method driven (None: ``VCLMethod(net, **kwargs)``).
        **kwargs: the keyword arguments of :class:`fromp.continual.vcl.VCLMethod`.
    """

    def __init__(self, net: MeanFieldNet, method: VCLMethod | None = None, **kwargs: Any):
        super().__init__()
        if not isinstance(net, MeanFieldNet):
            raise ValueError(
                f"net must be a BayesMultiHeadModel or a MeanFieldTwin, got {type(net).__name__}"
            )
        self.method = VCLMethod(net, **kwargs) if method is None else method
        if self.method.net is not net:
            raise ValueError("method must hold net (method.net is not net)")
        self._training = False

    def __getattr__(self, name: str) -> Any:
        if name == "method":
            raise AttributeError(name)
        return getattr(self.method, name)

    def mc_nll(self, x: Tensor, y: Tensor, task: Any) -> tuple[Tensor, Tensor]:
        """The former name of :meth:`fromp.continual.vcl.VCLMethod.nll` (deprecated)."""
        warnings.warn(
            "VCLPlugin.mc_nll is deprecated: use plugin.method.nll",
            DeprecationWarning,
            stacklevel=2,
        )
        return self.method.nll(x, y, task)

    def _task(self, strategy: Any) -> int:
        return int(strategy.experience.task_label) if self.method.multi_head else 0

    def after_train_dataset_adaptation(self, strategy: Any, **kwargs: Any) -> None:
        m = self.method
        if m.coreset_size <= 0:
            return
        ds = strategy.adapted_dataset
        m.check_coreset_size(len(ds))
        if m.coreset_method == "kcenter":
            x, y, _ = _train_tensors(ds)
            idx = m.coreset_indices(len(ds), x)
            cx, cy = x[idx], y[idx]
        else:
            idx = m.coreset_indices(len(ds))
            cx, cy, _ = _train_tensors(ds.subset(idx.tolist()))
        keep = torch.ones(len(ds), dtype=torch.bool)
        keep[idx] = False
        strategy.adapted_dataset = ds.subset(torch.nonzero(keep).flatten().tolist())
        m.add_coreset(self._task(strategy), cx, cy)

    def before_training_exp(self, strategy: Any, **kwargs: Any) -> None:
        m = self.method
        self._training = True
        m.begin_task(self._task(strategy), len(strategy.adapted_dataset))
        epochs = _or(m.ml_init_epochs, strategy.train_epochs)
        if m.task_count == 0 and epochs > 0:
            x, y, _ = _train_tensors(strategy.adapted_dataset)
            lr = _or(m.ml_lr, strategy.optimizer.param_groups[0]["lr"])
            bs = strategy.train_mb_size
            m.ml_init(x, y, epochs=epochs, lr=lr, batch_size=bs, device=strategy.device)

    def before_backward(self, strategy: Any, **kwargs: Any) -> None:
        strategy.loss += self.method.penalty()

    def after_training_exp(self, strategy: Any, **kwargs: Any) -> None:
        self.method.learn_task()
        self._training = False
        # a fresh optimizer state for the next task (as the reference code's new Adam per
        # task); done here so that a checkpoint taken after this task holds the same state
        strategy.optimizer.state = defaultdict(dict)

    def before_eval_exp(self, strategy: Any, **kwargs: Any) -> None:
        m = self.method
        if self._training or not m.coresets:
            return
        m.prepare_eval(
            self._task(strategy),
            epochs=_or(m.coreset_epochs, strategy.train_epochs),
            lr=_or(m.coreset_lr, strategy.optimizer.param_groups[0]["lr"]),
            batch_size=_or(m.coreset_mb_size, strategy.train_mb_size),
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


class VCLTwinPlugin(VCLPlugin):
    """:class:`VCLPlugin` over a :class:`fromp.continual.bayesian.MeanFieldTwin` (the class
    name the checkpoints of VCL on any other model carry)."""


class VCL(MethodStrategy):
    """VCL (``coreset_size=0``) and VCL + coreset as an Avalanche strategy.

    ``model`` is any classifier. A fromp ``MultiHeadModel`` (wrapped or not) is converted to
    mean-field Gaussian layers; a ``BayesMultiHeadModel`` is used as it is; any other module
    gets a :class:`fromp.continual.bayesian.MeanFieldTwin` (new heads start from the prior):
    see :class:`fromp.continual.vcl.VCLMethod`, whose keyword arguments these are
    (``prior_var`` deprecated: ``prior_precision = 1 / prior_var``).
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
        prior_var: float | None = None,
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
        if prior_var is not None:  # deprecated: the warning names the strategy
            prior_variance(prior_precision, prior_var, "VCL")
            with warnings.catch_warnings():
                warnings.filterwarnings("ignore", "VCLMethod.prior_var", DeprecationWarning)
                method = VCLMethod(net, **settings)
        else:
            method = VCLMethod(net, **settings)
        if method.net is not net:  # converted: the strategy trains the Bayesian network
            model = method.net
            if isinstance(method.net, BayesMultiHeadModel):
                model = as_avalanche_model(method.net)
            optimizer.param_groups[0]["params"] = list(model.parameters())
            optimizer.state = defaultdict(dict)
        plugin_class = VCLTwinPlugin if isinstance(method.net, MeanFieldTwin) else VCLPlugin
        plugin = plugin_class(method.net, method)
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
