"""Variational continual learning (VCL; Nguyen, Li, Bui & Turner, ICLR 2018) for Avalanche.

Any model: a fromp ``MultiHeadModel`` is converted to a mean-field Gaussian
:class:`fromp.continual.bayesian.BayesMultiHeadModel` (:func:`fromp.continual.bayesian.to_bayesian`,
local reparameterisation, as in the reference code); every other module (a plain ``nn.Module``, an
Avalanche ``MultiTaskModule``, a torchvision network) gets a mean-field Gaussian twin of its
``Linear``/``Conv2d`` parameters through ``torch.func.functional_call``
(:class:`fromp.continual.vcl.MeanFieldTwin`), other parameters staying deterministic.
For task ``t`` with training set ``D_t`` (``N_t`` examples, coreset points removed) VCL
maximises the per-example ELBO, i.e. minimises

    ``L(q) = (1/S) sum_s mean_n CE(f_{w_s}(x_n), y_n) + KL(q || q_{t-1}) / N_t``,

with ``S = train_samples`` local-reparameterisation samples, and the prior ``q_{t-1}`` the
previous task's posterior (``q_0 = N(0, prior_var)``). As in the reference code:

* task 1 starts from a maximum-likelihood fit of the means (``ml_init_epochs`` epochs of
  Adam on the cross-entropy), posterior log-variances start at ``init_logvar = -6``;
* the KL covers the shared body and the heads trained so far (multi-head); a head that was
  never trained keeps the prior ``N(0, prior_var)``;
* predictions average the softmax over ``test_samples`` weight samples; ``forward`` returns
  ``log(mean_s softmax(f_s))`` so that Avalanche's accuracy and cross-entropy work;
* VCL + coreset: ``coreset_size`` points per task (``"random"`` or ``"kcenter"``) are kept
  out of the training data. Before evaluation a copy of the propagated posterior is
  trained on the coreset (the coreset of the evaluated task through its head for
  multi-head models, the union of all coresets for a single head) with the propagated
  posterior as prior, used to predict, and then discarded.

All method state (posterior and prior, coresets, trained heads, task counter) lives in the
plugin and in the network, and is returned by :meth:`VCLPlugin.state_dict`.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from avalanche.training.plugins import SupervisedPlugin
from torch import Tensor, nn

from fromp.continual.bayesian import BayesLayer, BayesMultiHeadModel, to_bayesian
from fromp.continual.coreset import select_coreset
from fromp.continual.vcl import MeanFieldTwin
from fromp.models import MultiHeadModel, is_multitask, with_task
from strategies.benchmarks import experience_tensors
from strategies.models import as_avalanche_model, unwrap
from strategies.template import MethodStrategy

__all__ = ["VCL", "VCLPlugin", "VCLTwinPlugin"]


def __getattr__(name: str) -> object:
    if name == "dataset_tensors":  # the former name of strategies.benchmarks.experience_tensors
        import warnings

        warnings.warn(
            "strategies.vcl.dataset_tensors is deprecated: use "
            "strategies.benchmarks.experience_tensors",
            DeprecationWarning,
            stacklevel=2,
        )
        return _train_tensors
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _train_tensors(dataset, batch_size: int = 2048) -> tuple[Tensor, Tensor, Tensor]:
    """``(x, y, task_labels)`` of ``dataset`` with its own (training) transforms."""
    return experience_tensors(dataset, batch_size, eval_transforms=False)


def _head_arg(task_labels: Tensor, net: nn.Module):
    """The ``task`` argument for ``net``: None (single head), an int or a ``[N]`` tensor."""
    if getattr(net, "n_heads", 1) == 1:
        return None
    if task_labels.numel() > 0 and bool((task_labels == task_labels[0]).all()):
        return int(task_labels[0])
    return task_labels


class VCLPlugin(SupervisedPlugin):
    """VCL state and hooks (see the module docstring).

    Args:
        net: the Bayesian network (the one inside the strategy's model).
        train_samples: MC samples ``S`` of the expected log-likelihood during training.
        test_samples: MC samples of the predictive at evaluation.
        ml_init_epochs: epochs of the maximum-likelihood fit of the means before task 1
            (None: the strategy's ``train_epochs``; 0: no ML initialisation).
        ml_lr: learning rate of that fit (None: the strategy optimizer's ``lr``).
        coreset_size: points per task kept aside (0: plain VCL).
        coreset_method: ``"random"`` | ``"kcenter"`` (required when ``coreset_size > 0``).
        coreset_epochs: epochs of coreset training before evaluation (None: ``train_epochs``).
        coreset_mb_size: its mini-batch size (None: the strategy's ``train_mb_size``).
        coreset_lr: its Adam learning rate (None: the strategy optimizer's ``lr``).
        seed: seeds random coreset selection and coreset training (None: drawn from
            torch's global generator, so a seeded run is reproducible).
    """

    def __init__(
        self,
        net: BayesMultiHeadModel,
        *,
        train_samples: int = 10,
        test_samples: int = 100,
        ml_init_epochs: int | None = None,
        ml_lr: float | None = None,
        coreset_size: int = 0,
        coreset_method: str | None = None,
        coreset_epochs: int | None = None,
        coreset_mb_size: int | None = None,
        coreset_lr: float | None = None,
        seed: int | None = None,
    ) -> None:
        super().__init__()
        if not isinstance(net, BayesMultiHeadModel):
            raise ValueError(f"net must be a BayesMultiHeadModel, got {type(net).__name__}")
        if train_samples < 1 or test_samples < 1:
            raise ValueError(
                f"train_samples and test_samples must be >= 1, got {train_samples}, {test_samples}"
            )
        if coreset_size < 0:
            raise ValueError(f"coreset_size must be >= 0, got {coreset_size}")
        if coreset_size > 0 and coreset_method not in ("random", "kcenter"):
            raise ValueError(
                f"coreset_method must be 'random' or 'kcenter' when coreset_size > 0, "
                f"got {coreset_method!r}"
            )
        if ml_init_epochs is not None and ml_init_epochs < 0:
            raise ValueError(f"ml_init_epochs must be >= 0 or None, got {ml_init_epochs}")
        self.net = net
        self.train_samples, self.test_samples = int(train_samples), int(test_samples)
        self.ml_init_epochs, self.ml_lr = ml_init_epochs, ml_lr
        self.coreset_size, self.coreset_method = int(coreset_size), coreset_method
        self.coreset_epochs, self.coreset_mb_size = coreset_epochs, coreset_mb_size
        self.coreset_lr = coreset_lr
        self.seed = int(torch.randint(0, 2**31 - 1, ()).item()) if seed is None else int(seed)
        # method state
        self.task_count = 0
        self.seen_heads: set[int] = set()
        self.coresets: list[tuple[int, Tensor, Tensor]] = []  # (head, x, y)
        # transient
        self.n_train = 1
        self.current_head = 0
        self._training = False
        self._snapshot: dict[str, Tensor] | None = None
        self._tuned_key: object = None

    # -- helpers ----------------------------------------------------------------------
    @property
    def multi_head(self) -> bool:
        return self.net.n_heads > 1

    def kl_heads(self, head: int | None = None) -> list[int] | None:
        """Heads whose KL enters the objective: trained ones plus ``head``."""
        if not self.multi_head:
            return None
        return sorted(self.seen_heads | ({head} if head is not None else set()))

    def mc_nll(self, x: Tensor, y: Tensor, task) -> tuple[Tensor, Tensor]:
        """``(mean_s mean_n CE, logits [S, N, K])`` with ``train_samples`` samples."""
        logits = self.net(x, task, n_samples=self.train_samples)
        s, n, k = logits.shape
        return F.cross_entropy(logits.reshape(s * n, k), y.repeat(s)), logits

    def _lr(self, strategy, value: float | None) -> float:
        return float(value if value is not None else strategy.optimizer.param_groups[0]["lr"])

    # -- training ---------------------------------------------------------------------
    def after_train_dataset_adaptation(self, strategy, **kwargs):
        self.current_head = int(strategy.experience.task_label) if self.multi_head else 0
        if self.coreset_size <= 0:
            return
        ds = strategy.adapted_dataset
        if self.coreset_size >= len(ds):
            raise ValueError(
                f"coreset_size={self.coreset_size} must be smaller than the task's "
                f"{len(ds)} training examples"
            )
        if self.coreset_method == "kcenter":
            x, y, _ = _train_tensors(ds)
            idx = select_coreset(x, self.coreset_size, "kcenter")
            cx, cy = x[idx], y[idx]
        else:
            g = torch.Generator().manual_seed(self.seed * 1000 + self.task_count)
            idx = select_coreset(torch.empty(len(ds), 0), self.coreset_size, "random", g)
            cx, cy, _ = _train_tensors(ds.subset(idx.tolist()))
        keep = torch.ones(len(ds), dtype=torch.bool)
        keep[idx] = False
        strategy.adapted_dataset = ds.subset(torch.nonzero(keep).flatten().tolist())
        self.coresets.append((self.current_head, cx.cpu(), cy.cpu()))

    def before_training_exp(self, strategy, **kwargs):
        self._training = True
        self.n_train = len(strategy.adapted_dataset)
        epochs = strategy.train_epochs if self.ml_init_epochs is None else self.ml_init_epochs
        if self.task_count == 0 and epochs > 0:
            x, y, _ = _train_tensors(strategy.adapted_dataset)
            self._ml_fit(strategy, x, y, epochs)

    def _ml_fit(self, strategy, x: Tensor, y: Tensor, epochs: int) -> None:
        """Maximum-likelihood fit of the posterior means (task 1 initialisation)."""
        device = strategy.device
        task = self.current_head if self.multi_head else None
        opt = torch.optim.Adam(self.net.mean_parameters(), lr=self._lr(strategy, self.ml_lr))
        g = torch.Generator().manual_seed(self.seed)
        bs = strategy.train_mb_size
        with torch.enable_grad(), self.net.mean_mode():
            for _ in range(epochs):
                perm = torch.randperm(len(x), generator=g)
                for s in range(0, len(x), bs):
                    i = perm[s : s + bs]
                    loss = F.cross_entropy(self.net(x[i].to(device), task), y[i].to(device))
                    opt.zero_grad(set_to_none=True)
                    loss.backward()
                    opt.step()

    def before_backward(self, strategy, **kwargs):
        kl = self.net.kl(self.kl_heads(self.current_head))
        strategy.loss += kl / self.n_train

    def after_training_exp(self, strategy, **kwargs):
        heads = self.kl_heads(self.current_head)
        self.net.set_prior_from_posterior(heads)
        self.seen_heads.add(self.current_head)
        self.task_count += 1
        self._training = False
        # a fresh optimizer state for the next task (as the reference code's new Adam per
        # task); done here so that a checkpoint taken after this task holds the same state
        strategy.optimizer.state = defaultdict(dict)

    # -- evaluation with coresets -------------------------------------------------------
    def before_eval_exp(self, strategy, **kwargs):
        if self._training or not self.coresets:
            return
        head = int(strategy.experience.task_label) if self.multi_head else 0
        key = head if self.multi_head else "all"
        if key == self._tuned_key:
            return
        self._restore()
        parts = [(x, y) for h, x, y in self.coresets if h == head]
        if not parts:
            return  # a task not trained yet: no coreset, use the propagated posterior
        x = torch.cat([p[0] for p in parts])
        y = torch.cat([p[1] for p in parts])
        self._snapshot = {k: v.detach().clone() for k, v in self.net.state_dict().items()}
        self._tuned_key = key
        self._train_on_coreset(strategy, x, y, head)

    def _train_on_coreset(self, strategy, x: Tensor, y: Tensor, head: int) -> None:
        """Train the posterior on the coreset with the propagated posterior as prior."""
        device = strategy.device
        task = head if self.multi_head else None
        epochs = strategy.train_epochs if self.coreset_epochs is None else self.coreset_epochs
        bs = self.coreset_mb_size or strategy.train_mb_size
        opt = torch.optim.Adam(self.net.parameters(), lr=self._lr(strategy, self.coreset_lr))
        g = torch.Generator().manual_seed(self.seed + 7919 * self.task_count + head)
        heads = self.kl_heads()
        with torch.enable_grad():
            for _ in range(epochs):
                perm = torch.randperm(len(x), generator=g)
                for s in range(0, len(x), bs):
                    i = perm[s : s + bs]
                    nll, _ = self.mc_nll(x[i].to(device), y[i].to(device), task)
                    loss = nll + self.net.kl(heads) / len(x)
                    opt.zero_grad(set_to_none=True)
                    loss.backward()
                    opt.step()

    def _restore(self) -> None:
        if self._snapshot is not None:
            self.net.load_state_dict(self._snapshot)
        self._snapshot, self._tuned_key = None, None

    def after_eval(self, strategy, **kwargs):
        self._restore()

    # -- checkpointing ----------------------------------------------------------------
    def state_dict(self) -> dict:
        """All VCL state: network (posterior and prior), coresets, trained heads, counter."""
        self._restore()
        return {
            "net": {k: v.detach().cpu().clone() for k, v in self.net.state_dict().items()},
            "task_count": self.task_count,
            "seen_heads": sorted(self.seen_heads),
            "coresets": [(h, x.clone(), y.clone()) for h, x, y in self.coresets],
            "seed": self.seed,
        }

    def load_state_dict(self, state: dict) -> None:
        """Restore what :meth:`state_dict` returned (in place, into ``self.net``)."""
        missing = {"net", "task_count", "seen_heads", "coresets"} - set(state)
        if missing:
            raise ValueError(f"state is missing keys {sorted(missing)}")
        self._snapshot, self._tuned_key = None, None
        self.net.load_state_dict(state["net"])
        self.task_count = int(state["task_count"])
        self.seen_heads = set(int(h) for h in state["seen_heads"])
        self.coresets = [(int(h), x.clone(), y.clone()) for h, x, y in state["coresets"]]
        self.seed = int(state.get("seed", self.seed))


class VCLTwinPlugin(SupervisedPlugin):
    """VCL on any model through a :class:`fromp.continual.vcl.MeanFieldTwin` (see that module).

    ``before_training_exp``: on the first task, a maximum-likelihood fit of the means
    (``ml_init_epochs`` epochs of Adam); ``before_backward``: adds ``KL(q || q_{t-1}) / N_t``;
    ``after_training_exp``: the posterior becomes the prior, the optimizer state is reset
    (a fresh Adam per task, as in the reference code). No coresets on this path.

    Args:
        twin: the twin of the strategy's model (the strategy's ``model``).
        train_samples, test_samples, ml_init_epochs, ml_lr: as in :class:`VCLPlugin`.
    """

    def __init__(
        self,
        twin: MeanFieldTwin,
        *,
        train_samples: int = 10,
        test_samples: int = 100,
        ml_init_epochs: int | None = None,
        ml_lr: float | None = None,
        seed: int | None = None,
    ) -> None:
        super().__init__()
        if train_samples < 1 or test_samples < 1:
            raise ValueError(
                f"train_samples and test_samples must be >= 1, got {train_samples}, {test_samples}"
            )
        if ml_init_epochs is not None and ml_init_epochs < 0:
            raise ValueError(f"ml_init_epochs must be >= 0 or None, got {ml_init_epochs}")
        self.net = twin
        self.train_samples, self.test_samples = int(train_samples), int(test_samples)
        self.ml_init_epochs, self.ml_lr = ml_init_epochs, ml_lr
        self.seed = int(torch.randint(0, 2**31 - 1, ()).item()) if seed is None else int(seed)
        self.task_count = 0
        self.n_train = 1

    def before_training_exp(self, strategy, **kwargs):
        self.n_train = len(strategy.adapted_dataset)
        epochs = strategy.train_epochs if self.ml_init_epochs is None else self.ml_init_epochs
        if self.task_count == 0 and epochs > 0:
            x, y, t = _train_tensors(strategy.adapted_dataset)
            self._ml_fit(strategy, x, y, int(t[0]), epochs)

    def _ml_fit(self, strategy, x: Tensor, y: Tensor, task: int, epochs: int) -> None:
        """Maximum-likelihood fit of the means (the plain model) before task 1."""
        model = self.net.model
        head = with_task(model, task if is_multitask(model) else None)
        lr = float(
            self.ml_lr if self.ml_lr is not None else strategy.optimizer.param_groups[0]["lr"]
        )
        opt = torch.optim.Adam(model.parameters(), lr=lr)
        g = torch.Generator().manual_seed(self.seed)
        bs, device = strategy.train_mb_size, strategy.device
        was_training = model.training
        model.train()
        with torch.enable_grad():
            for _ in range(epochs):
                perm = torch.randperm(len(x), generator=g)
                for s in range(0, len(x), bs):
                    i = perm[s : s + bs]
                    loss = F.cross_entropy(head(x[i].to(device)), y[i].to(device))
                    opt.zero_grad(set_to_none=True)
                    loss.backward()
                    opt.step()
        model.train(was_training)

    def before_backward(self, strategy, **kwargs):
        strategy.loss += self.net.kl() / self.n_train

    def after_training_exp(self, strategy, **kwargs):
        self.net.set_prior_from_posterior()
        self.task_count += 1
        strategy.optimizer.state = defaultdict(dict)

    def state_dict(self) -> dict:
        """The twin's means, log-variances and priors, and the task counter (on the CPU)."""
        return {
            "net": {k: v.detach().cpu().clone() for k, v in self.net.state_dict().items()},
            **self.net.method_state(),
            "task_count": self.task_count,
            "seed": self.seed,
        }

    def load_state_dict(self, state: dict) -> None:
        """Restore :meth:`state_dict` into the twin (which must have the same parameters:
        resume after the model's adaptation to the same experiences)."""
        self.net.load_state_dict(state["net"])
        self.net.load_method_state(state)
        self.task_count = int(state["task_count"])
        self.seed = int(state.get("seed", self.seed))


class VCL(MethodStrategy):
    """VCL (``coreset_size=0``) and VCL + coreset as an Avalanche strategy.

    ``model`` is any classifier. A fromp ``MultiHeadModel`` (wrapped or not) is converted to
    mean-field Gaussian layers, keeping its weights as means; a ``BayesMultiHeadModel`` is
    used as it is; any other module gets a :class:`fromp.continual.vcl.MeanFieldTwin` (new heads
    start from the prior).
    After a conversion the optimizer (one parameter group) is re-pointed at the Bayesian
    parameters (means and log-variances), with its hyper-parameters kept and state cleared.
    ``criterion`` must be a cross-entropy on logits: it is applied to each Monte Carlo
    sample in training and to ``log(mean_s softmax)`` in evaluation.
    A converted network's means are re-drawn from ``N(0, mean_init_std^2)`` truncated at two
    standard deviations, as in the VCL reference code (None keeps the given weights): the
    prior's absolute precision (``1 / exp(init_logvar)``) protects weights of that scale.
    Adam's state is reset at the start of every task (a fresh optimizer per task, as in the
    reference code). Other keyword arguments are those of :class:`VCLPlugin` and Avalanche's
    template arguments (``criterion``, ``train_mb_size``, ...) as in
    :class:`strategies.template.MethodStrategy`.
    """

    def __init__(
        self,
        *,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        criterion: nn.Module | Callable | None = None,
        train_samples: int = 10,
        test_samples: int = 100,
        ml_init_epochs: int | None = None,
        ml_lr: float | None = None,
        coreset_size: int = 0,
        coreset_method: str | None = None,
        coreset_epochs: int | None = None,
        coreset_mb_size: int | None = None,
        coreset_lr: float | None = None,
        prior_var: float = 1.0,
        init_logvar: float = -6.0,
        mean_init_std: float | None = 0.1,
        seed: int | None = None,
        **template_kwargs: Any,
    ) -> None:
        net = unwrap(model)
        self._twin: MeanFieldTwin | None = None
        if not isinstance(net, MultiHeadModel):  # any other module: a mean-field twin
            twin = MeanFieldTwin(model, prior_var=prior_var, init_logvar=init_logvar)
            if len(optimizer.param_groups) != 1:
                raise ValueError(
                    "optimizer must have a single parameter group (it is re-pointed at the "
                    f"twin's means and log-variances), got {len(optimizer.param_groups)}"
                )
            if coreset_size:
                raise ValueError(
                    "coreset_size must be 0 for a model that is not a fromp MultiHeadModel "
                    "(coresets are implemented for fromp models only)"
                )
            optimizer.param_groups[0]["params"] = list(twin.parameters())
            optimizer.state = defaultdict(dict)
            self._twin = twin
            plugin = VCLTwinPlugin(
                twin,
                train_samples=train_samples,
                test_samples=test_samples,
                ml_init_epochs=ml_init_epochs,
                ml_lr=ml_lr,
                seed=seed,
            )
            super().__init__(
                method_plugins=[plugin], model=twin, optimizer=optimizer, **template_kwargs
            )
            self._mc_logits = None
            return
        if not isinstance(net, BayesMultiHeadModel):
            net = to_bayesian(net, prior_var=prior_var, init_logvar=init_logvar)
            if mean_init_std is not None:
                for layer in net.modules():
                    if isinstance(layer, BayesLayer):
                        layer.reset_mean(mean_init_std)
            model = as_avalanche_model(net)
            if len(optimizer.param_groups) != 1:
                raise ValueError(
                    "optimizer must have a single parameter group (it is re-pointed at the "
                    f"Bayesian parameters), got {len(optimizer.param_groups)}"
                )
            optimizer.param_groups[0]["params"] = list(model.parameters())
            optimizer.state = defaultdict(dict)
        plugin = VCLPlugin(
            net,
            train_samples=train_samples,
            test_samples=test_samples,
            ml_init_epochs=ml_init_epochs,
            ml_lr=ml_lr,
            coreset_size=coreset_size,
            coreset_method=coreset_method,
            coreset_epochs=coreset_epochs,
            coreset_mb_size=coreset_mb_size,
            coreset_lr=coreset_lr,
            seed=seed,
        )
        super().__init__(
            method_plugins=[plugin],
            model=model,
            optimizer=optimizer,
            criterion=criterion,
            **template_kwargs,
        )
        self._mc_logits: Tensor | None = None

    @property
    def net(self) -> BayesMultiHeadModel | MeanFieldTwin:
        """The Bayesian network (a :class:`fromp.continual.vcl.MeanFieldTwin` for other models)."""
        return self.plugin.net

    def _adapt_model(self, model: nn.Module | None) -> nn.Module:
        """Avalanche's adaptation (new heads or units), then the twin's log-variances and
        priors for the new parameters (before the optimizer is refreshed)."""
        model = super()._adapt_model(model)
        if self._twin is not None:
            self._twin.sync()
        return model

    def forward(self) -> Tensor:
        """``log(mean_s softmax(f_s(x)))`` ``[N, K]`` over ``train_samples`` (training) or
        ``test_samples`` (evaluation) weight samples."""
        net = self.plugin.net
        s = self.plugin.train_samples if self.is_training else self.plugin.test_samples
        if self._twin is not None:
            task = None
            if is_multitask(self._twin.model):
                t = self.mb_task_id
                if t.numel() and not bool((t == t[0]).all()):
                    raise ValueError("a mini-batch must hold one task label for VCL on this model")
                task = int(t[0])
            logits = self._twin.sample_logits(self.mb_x, task, s)
        else:
            task = _head_arg(self.mb_task_id, net)
            logits = net(self.mb_x, task, n_samples=s)  # S, N, K
        self._mc_logits = logits if self.is_training else None
        return torch.logsumexp(logits.log_softmax(-1), dim=0) - torch.log(
            torch.tensor(float(s), dtype=logits.dtype, device=logits.device)
        )

    def criterion(self) -> Tensor:
        """Training: MC average of the criterion over samples (the KL term is added by the
        plugin). Evaluation: the criterion on the predictive log-probabilities."""
        if self.is_training and self._mc_logits is not None:
            s, n, k = self._mc_logits.shape
            return self._criterion(self._mc_logits.reshape(s * n, k), self.mb_y.repeat(s))
        return self._criterion(self.mb_output, self.mb_y)
