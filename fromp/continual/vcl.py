"""Variational continual learning (VCL; Nguyen, Li, Bui & Turner, ICLR 2018) as a plain
object for any PyTorch training loop: :class:`VCLMethod`.

VCL keeps a mean-field Gaussian posterior ``q_t(w) = prod_p N(w_p; mu_p, sigma_p^2)`` over
the weights (:mod:`fromp.continual.bayesian`) and, on task ``t`` with training set ``D_t``
(``N_t`` examples, the task's coreset removed), minimises the per-example negative ELBO

    ``L(q) = (1/S) sum_s mean_n CE(f_{w_s}(x_n), y_n) + KL(q || q_{t-1}) / N_t``,

``w_s ~ q`` (local reparameterisation in ``nn.Linear`` layers, whole draws of the other
Gaussian weights: :class:`fromp.continual.bayesian.MeanFieldTwin`), ``S = train_samples``,
and the prior ``q_{t-1}`` the previous task's posterior, ``q_0 = N(0, 1 / prior_precision)``.
The KL is the closed form, evaluated in one pass over all Gaussian parameters
(:func:`fromp.continual.bayesian.gaussian_kl_flat`).

The user's network is the posterior's means: VCL trains its parameters in place and keeps
the log-variances and the priors beside it (:attr:`VCLMethod.mean_field`), so after training
the network holds the posterior means, and ``net(x)`` is the prediction at the means. As in
the reference code:

* posterior log-variances start at ``init_logvar = -6``; the reference code's initialisation
  of the means is available: ``mean_init_std=0.1`` re-draws them from ``N(0, 0.1^2)``
  truncated at two standard deviations, and ``ml_init_epochs=E`` (None: the caller's epochs)
  fits them by maximum likelihood before task 1 (:meth:`VCLMethod.ml_init`, Adam; task 1
  then costs ``E`` more epochs). The default starts from the network's own weights, with
  no extra epochs;
* the KL covers the shared body and the heads trained so far (multi-head); a head never
  trained keeps the prior ``N(0, 1 / prior_precision)``;
* ``test_samples=S`` predicts with the Monte Carlo predictive ``log mean_s softmax(f_s)``
  over ``S`` weight samples (:meth:`VCLMethod.predict_log_proba`); the default, None,
  predicts at the posterior means (one pass of the network, as ``net(x)``);
* VCL + coreset: ``coreset_size`` points per task (``"random"`` or ``"kcenter"``,
  :mod:`fromp.continual.coreset`) are kept out of the training data. Before predicting a
  task, the propagated posterior is trained on the coreset (the task's own coreset through
  its head with task heads, the union of all coresets with one head) with the propagated
  posterior as prior, used, and then restored (:meth:`VCLMethod.prepare_eval`,
  :meth:`VCLMethod.restore`).

A plain loop (no Avalanche; the continual-method protocol of
:class:`fromp.continual.protocol.ContinualMethod` on the user's network)::

    method = VCLMethod(net, prior_precision=1.0, ml_init_epochs=5, coreset_size=40,
                       coreset_method="kcenter")
    opt = torch.optim.Adam(method.parameters(), lr=1e-3)  # net's and the log-variances
    for task, (x, y) in enumerate(tasks):
        x, y = method.split_coreset(x, y, task)      # the coreset is kept out
        method.begin_task(net, task=task, ess=len(x))    # N_t and the head of the task
        method.ml_init(x, y, lr=1e-3, batch_size=256)  # task 1 only: 5 epochs of ML
        for xb, yb in batches(x, y):
            nll, logits = method.nll(xb, yb, task)   # Monte Carlo cross-entropy
            loss = nll + method.loss_terms(net, xb, logits, task=task)  # + KL / N_t
            opt.zero_grad(); loss.backward(); opt.step()
        method.learn_task(net, x, y, task, optimizer=opt)  # posterior -> prior, fresh Adam
    method.prepare_eval(0, epochs=5, lr=1e-3, batch_size=256)  # coreset fine-tuning
    log_p = method.predict_log_proba(x_test, 0)      # at the means: log_softmax(net(x, 0))
    method.restore()

An optimizer the user built on ``net.parameters()`` takes the log-variances as one more
parameter group (:meth:`VCLMethod.add_variance_group`, what the Avalanche strategy does);
after ``net`` grows (a new head, new output units) :meth:`VCLMethod.sync` gives the new
units a posterior and a prior and puts the grown log-variances in that group.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from fromp._checks import (
    check_batch,
    check_positive,
    check_prior_precision,
    check_saved_settings,
    device_dtype,
)
from fromp.continual.bayesian import MeanFieldNet
from fromp.continual.bayesian import MeanFieldTwin as _MeanFieldTwin
from fromp.continual.coreset import select_coreset
from fromp.continual.protocol import ContinualMethod, Optim, TaskLabels, TaskStart

__all__ = ["VCLMethod"]

_CORESET_METHODS = ("random", "kcenter")
#: The settings saved with the state and compared on load.
_STATE_SETTINGS = ("prior_precision", "init_logvar", "coreset_size", "coreset_method")


def _count(value: object, name: str, low: int, optional: bool = False) -> int | None:
    """``value`` as an int ``>= low`` (None allowed when ``optional``)."""
    if value is None and optional:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        none = " or None" if optional else ""
        raise ValueError(f"{name} must be an int >= {low}{none}, got {value!r}")
    return int(value)


def _rate(value: object, name: str) -> float | None:
    return None if value is None else check_positive(value, name)


class VCLMethod(ContinualMethod):
    """VCL and VCL + coreset for any training loop (see the module docstring for the maths).

    ``net`` is the user's network and stays theirs: its parameters are the posterior means,
    trained in place. The posterior (:attr:`mean_field`) is a
    :class:`fromp.continual.bayesian.MeanFieldTwin` of ``net`` (the log-variances and the
    priors beside ``net``'s parameters), or ``net`` itself when it is a
    :class:`fromp.continual.bayesian.MeanFieldNet` (e.g. ``BayesMultiHeadMLP``; its priors are
    set to ``N(0, 1 / prior_precision)``, its log-variances kept). Pass ``net``
    to the protocol's calls (:class:`fromp.continual.protocol.ContinualMethod`) and train
    :meth:`parameters` (``net``'s and :meth:`variance_parameters`) with any optimizer (or
    add the log-variances to one of ``net.parameters()``: :meth:`add_variance_group`).

    Args:
        net: the network.
        prior_precision: ``delta``, the initial prior ``N(0, 1 / delta)`` on every Gaussian
            weight.
        init_logvar: initial posterior ``log sigma^2``.
        mean_init_std: re-draw the means (``net``'s Gaussian weights, in place, at
            construction) from ``N(0, mean_init_std^2)`` truncated at two standard
            deviations, the reference code's initialisation (None: ``net``'s own weights).
        train_samples: Monte Carlo samples ``S`` of the expected log-likelihood (each example
            draws its own ``nn.Linear`` weights by local reparameterisation, so one sample
            is one weight draw per example there).
        test_samples: Monte Carlo samples of the predictive (None: predict at the posterior
            means, one pass of ``net``).
        ml_init_epochs, ml_lr: epochs and Adam learning rate of the maximum-likelihood fit of
            the means before task 1 (:meth:`ml_init`; None: the caller's, e.g. the strategy's
            ``train_epochs`` and its optimizer's ``lr``; 0 epochs, the default: none, so that
            task 1 costs no more epochs than the others).
        coreset_size: points per task kept aside (0: plain VCL).
        coreset_method: ``"random"`` | ``"kcenter"`` (required when ``coreset_size > 0``).
        coreset_epochs, coreset_mb_size, coreset_lr: epochs, mini-batch size and Adam learning
            rate of the coreset training before prediction (None: the caller's).
        seed: seeds random coreset selection and the batches of the ML and coreset fits
            (None: drawn from torch's global generator, so a seeded run is reproducible).

    Attributes:
        model: ``net``. mean_field: the posterior (above). task_count: distinct experiences
        learnt. seen_heads: heads trained so far. coresets: ``(head, x, y)`` per task (on
        the CPU). ess, current_head: ``N_t`` and the head of the task being learnt
        (:meth:`begin_task`).
    """

    def __init__(
        self,
        net: nn.Module,
        *,
        prior_precision: float = 1.0,
        init_logvar: float = -6.0,
        mean_init_std: float | None = None,
        train_samples: int = 1,
        test_samples: int | None = None,
        ml_init_epochs: int | None = 0,
        ml_lr: float | None = None,
        coreset_size: int = 0,
        coreset_method: str | None = None,
        coreset_epochs: int | None = None,
        coreset_mb_size: int | None = None,
        coreset_lr: float | None = None,
        seed: int | None = None,
    ) -> None:
        super().__init__()
        if not isinstance(net, nn.Module):
            raise ValueError(f"net must be an nn.Module, got {type(net).__name__}")
        prior_precision = check_prior_precision(prior_precision)  # type: ignore[assignment]
        if isinstance(init_logvar, bool) or not isinstance(init_logvar, int | float):
            raise ValueError(f"init_logvar must be a finite float, got {init_logvar!r}")
        if not math.isfinite(init_logvar):
            raise ValueError(f"init_logvar must be a finite float, got {init_logvar!r}")
        if mean_init_std is not None:
            check_positive(mean_init_std, "mean_init_std")
        self.train_samples = _count(train_samples, "train_samples", 1)
        self.test_samples = _count(test_samples, "test_samples", 1, optional=True)
        self.ml_init_epochs = _count(ml_init_epochs, "ml_init_epochs", 0, optional=True)
        self.ml_lr = _rate(ml_lr, "ml_lr")
        self.coreset_size = _count(coreset_size, "coreset_size", 0)
        if self.coreset_size > 0 and coreset_method not in _CORESET_METHODS:
            raise ValueError(
                f"coreset_method must be 'random' or 'kcenter' when coreset_size > 0, "
                f"got {coreset_method!r}"
            )
        self.coreset_method = coreset_method
        self.coreset_epochs = _count(coreset_epochs, "coreset_epochs", 0, optional=True)
        self.coreset_mb_size = _count(coreset_mb_size, "coreset_mb_size", 1, optional=True)
        self.coreset_lr = _rate(coreset_lr, "coreset_lr")
        if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
            raise ValueError(f"seed must be an int or None, got {seed!r}")
        self.prior_precision = float(prior_precision)
        self.init_logvar = float(init_logvar)
        self.model = net
        if isinstance(net, MeanFieldNet):  # the user's own posterior: the method's prior
            self.mean_field: MeanFieldNet = net
            net.reset_prior(0.0, self.prior_precision)
        else:
            self.mean_field = _MeanFieldTwin(
                net, prior_precision=self.prior_precision, init_logvar=self.init_logvar
            )
        if mean_init_std is not None:
            self.mean_field.redraw_means(mean_init_std)
        # drawn after the initialisation (which draws from the global generator)
        self.seed = int(torch.randint(0, 2**31 - 1, ()).item()) if seed is None else int(seed)
        # method state
        self.seen_heads: set[int] = set()
        self.coresets: list[tuple[int, Tensor, Tensor]] = []  # (head, x, y)
        # the task being learnt
        self.ess: int | None = None
        self.current_head = 0
        # the posterior before coreset training (restored by restore())
        self._snapshot: dict[str, Tensor] | None = None
        self._tuned_key: object = None

    # -- the network ------------------------------------------------------------------
    def parameters(self) -> list[nn.Parameter]:
        """What an optimizer trains: the posterior's parameters, the means (``net``'s
        parameters) and the log-variances."""
        return list(self.mean_field.parameters())

    def variance_parameters(self) -> list[nn.Parameter]:
        """The log-variances that are not ``net``'s parameters (an optimizer built on
        ``net.parameters()`` needs them added; none when ``net`` is a ``MeanFieldNet``)."""
        return self.mean_field.variance_parameters()

    @staticmethod
    def check_optimizer(optimizer: object) -> None:
        """``ValueError`` naming ``optimizer`` unless it takes parameter groups (a
        ``torch.optim.Optimizer``): :meth:`add_variance_group` adds the log-variances to it."""
        if not callable(getattr(optimizer, "add_param_group", None)):
            raise ValueError(
                "optimizer must be a torch.optim.Optimizer (VCL adds the log-variances to it), "
                f"got {type(optimizer).__name__}"
            )

    def add_variance_group(self, optimizer: torch.optim.Optimizer) -> int | None:
        """Add :meth:`variance_parameters` to ``optimizer`` (one built on ``net.parameters()``)
        as a new parameter group with the optimizer's defaults (its ``lr``, ...); returns the
        group's index, for :meth:`sync`, or None (``optimizer`` unchanged) when there are no
        such log-variances (``net`` is a :class:`~fromp.continual.bayesian.MeanFieldNet`)."""
        self.check_optimizer(optimizer)
        variances = self.variance_parameters()
        if not variances:
            return None
        optimizer.add_param_group({"params": variances})
        return len(optimizer.param_groups) - 1

    def sync(
        self, optimizer: torch.optim.Optimizer | None = None, group: int | None = None
    ) -> bool:
        """After ``net`` gained or grew parameters (a new head, new output units): their
        log-variances and priors (:meth:`fromp.continual.bayesian.MeanFieldTwin.sync`) and
        ``optimizer``'s parameter group ``group`` (:meth:`add_variance_group`'s index) on the
        current log-variances, the optimizer's state of a replaced one dropped (as for a grown
        weight: its moments no longer fit). Returns whether anything changed."""
        if optimizer is not None and group is not None:
            self.check_optimizer(optimizer)
            n = len(optimizer.param_groups)
            if isinstance(group, bool) or not isinstance(group, int) or not 0 <= group < n:
                raise ValueError(f"group must be the index of one of the optimizer's {n} "
                                 f"parameter groups, got {group!r}")  # fmt: skip
        if not self.mean_field.sync():
            return False
        if optimizer is not None and group is not None:
            params, now = optimizer.param_groups[group], self.variance_parameters()
            for p in set(params["params"]) - set(now):
                optimizer.state.pop(p, None)
            params["params"] = now
        return True

    @property
    def multi_head(self) -> bool:
        """Whether a task label picks the head."""
        return self.mean_field.multi_head

    def head_of(self, task: int | None) -> int:
        """The head of ``task``: the task label with task heads, 0 with one head."""
        if not self.multi_head:
            return 0
        if (
            isinstance(task, bool)
            or not isinstance(task, int | Tensor)
            or (isinstance(task, Tensor) and task.numel() != 1)
        ):
            raise ValueError(f"task must be an int label for a multi-head network, got {task!r}")
        return int(task)

    def kl_heads(self, head: int | None = None) -> list[int] | None:
        """Heads whose KL enters the objective: those trained so far plus ``head`` (None:
        one head, the whole network)."""
        if not self.multi_head:
            return None
        return sorted(self.seen_heads | ({head} if head is not None else set()))

    def _task(self, task: int | Tensor | None) -> int | Tensor | None:
        """``task`` as the network takes it: None with one head, an int when a ``[N]``
        tensor holds one label (else the tensor: one head per example)."""
        if not self.multi_head:
            return None
        if isinstance(task, Tensor) and task.ndim > 0 and task.numel() > 0:
            if bool((task == task[0]).all()):
                return int(task[0])
        return task

    def sample_logits(
        self, x: Tensor, task: int | Tensor | None, n_samples: int | None = None
    ) -> Tensor:
        """Logits ``[S, N, K]`` of ``S`` weight samples (``train_samples`` when None)
        through head ``task`` (an int, a ``[N]`` tensor of labels, None with one head)."""
        s = self.train_samples if n_samples is None else n_samples
        return self.mean_field.sample_logits(x, self._task(task), s)

    @staticmethod
    def log_mean_softmax(logits: Tensor) -> Tensor:
        """``log mean_s softmax(f_s)`` ``[N, K]`` of logits ``[S, N, K]``: the log of the
        Monte Carlo predictive."""
        # log S as a Python number: a tensor made from it would be a blocking copy to the
        # GPU on every training step
        return torch.logsumexp(logits.log_softmax(-1), dim=0) - math.log(logits.shape[0])

    @torch.no_grad()
    def predict_log_proba(self, x: Tensor, task: int | Tensor | None) -> Tensor:
        """The predictive's log-probabilities ``[N, K]``: ``log_softmax`` of the network at
        the posterior means (``test_samples=None``), or the Monte Carlo predictive over
        ``test_samples`` samples."""
        if self.test_samples is None:
            return self.mean_field.mean_logits(x, self._task(task)).log_softmax(-1)
        return self.log_mean_softmax(self.sample_logits(x, task, self.test_samples))

    # -- the ELBO ---------------------------------------------------------------------
    def nll(self, x: Tensor, y: Tensor, task: int | Tensor | None) -> tuple[Tensor, Tensor]:
        """``(mean_s mean_n CE(f_{w_s}(x_n), y_n), logits [S, N, K])`` over
        ``train_samples`` samples."""
        logits = self.sample_logits(x, task)
        return self.samples_loss(logits, y), logits

    @staticmethod
    def samples_loss(
        logits: Tensor, y: Tensor, criterion: Callable[[Tensor, Tensor], Tensor] = F.cross_entropy
    ) -> Tensor:
        """``criterion`` (a mean cross-entropy on logits) over the logits ``[S, N, K]`` of
        ``S`` samples against ``y [N]`` repeated for each: ``mean_s mean_n CE(f_s(x_n), y_n)``
        for the default, the Monte Carlo expected negative log-likelihood per example."""
        s, n, k = logits.shape
        return criterion(logits.reshape(s * n, k), y.repeat(s))

    def loss(self, x: Tensor, y: Tensor, task: int | Tensor | None) -> Tensor:
        """The negative ELBO per example on a mini-batch: :meth:`nll` +
        :meth:`loss_terms` (``KL(q || q_{t-1}) / N_t``)."""
        nll, logits = self.nll(x, y, task)
        return nll + self.loss_terms(self.model, x, logits, task=task)

    # -- the protocol ------------------------------------------------------------------
    def _check_net(self, net: nn.Module) -> None:
        """``net`` must be the network the method was built on (or its posterior, or an
        adapter whose ``net`` it is): its posterior and priors are VCL's state."""
        mine = (self.model, self.mean_field)
        if not any(net is m or getattr(net, "net", None) is m for m in mine):
            raise ValueError(
                f"net must be the network the VCLMethod was built on (a "
                f"{type(self.model).__name__}), got a {type(net).__name__}"
            )

    def _begin(self, net: nn.Module, start: TaskStart) -> None:
        """:meth:`begin_task` for VCL: the head of ``task`` is trained and ``ess`` (``N_t``,
        the coreset removed; required) scales the KL in :meth:`loss_terms`; ``net`` is
        :attr:`model`; ``classes`` and ``growing_head`` are not used."""
        self._check_net(net)
        if start.ess is None:
            raise ValueError("ess (N_t, the task's training examples) is required by VCL")
        self.current_head, self.ess = self.head_of(start.task), start.ess

    def _loss_terms(
        self, net: nn.Module, x: Tensor, output: Tensor, task: TaskLabels, loss: Tensor | None
    ) -> Tensor:
        """:meth:`loss_terms` for VCL: ``KL(q || q_{t-1}) / N_t`` over the body and the heads
        trained so far plus the current one (a scalar, differentiable in the means and
        log-variances): the ELBO's weight term per example, in ``loss``'s dtype when given
        (else a floating ``output``'s); ``x`` and ``task`` are not used."""
        del x, task
        self._check_net(net)
        if self.ess is None:
            raise ValueError("call begin_task(net, task=..., ess=N_t) before loss_terms")
        kl = self.mean_field.kl(self.kl_heads(self.current_head)) / self.ess
        if loss is not None:
            kl = kl.to(loss.dtype)
        elif output.is_floating_point():
            kl = kl.to(output.dtype)
        self.last_terms = {"kl": kl.detach()}
        return kl

    def _learn(
        self, net: nn.Module, x: Tensor, y: Tensor, task: int | None, optimizer: Optim, key: int
    ) -> None:
        """:meth:`learn_task` for VCL, the end of the task: its posterior becomes the prior
        (body and the heads trained so far), its head counts as trained, and
        ``optimizer``'s state is cleared (a fresh Adam per task, as in the reference code).
        ``x``, ``y`` (may be None) and ``task`` are not used: the head is
        :meth:`begin_task`'s."""
        del x, y, task, key
        self._check_net(net)
        self.mean_field.set_prior_from_posterior(self.kl_heads(self.current_head))
        self.seen_heads.add(self.current_head)
        if optimizer is not None:
            optimizer.state.clear()

    # -- the fits that own their optimizer -----------------------------------------------
    def _fit(
        self,
        params: list[nn.Parameter],
        x: Tensor,
        y: Tensor,
        loss: Callable[[Tensor, Tensor], Tensor],
        *,
        epochs: int,
        lr: float,
        batch_size: int,
        generator: torch.Generator,
        device: Any,
    ) -> None:
        """``epochs`` passes of Adam over shuffled mini-batches of ``(x, y)``."""
        opt = torch.optim.Adam(params, lr=lr)
        with torch.enable_grad():
            for _ in range(epochs):
                perm = torch.randperm(len(x), generator=generator)
                for s in range(0, len(x), batch_size):
                    i = perm[s : s + batch_size]
                    value = loss(x[i].to(device), y[i].to(device))
                    opt.zero_grad(set_to_none=True)
                    value.backward()
                    opt.step()

    @staticmethod
    def _check_data(x: Tensor, y: Tensor) -> None:
        check_batch(x, "x")
        if not isinstance(y, Tensor) or y.shape != (len(x),):
            got = tuple(y.shape) if isinstance(y, Tensor) else type(y).__name__
            raise ValueError(f"y must be a tensor of N={len(x)} labels, got {got}")

    @staticmethod
    def _check_fit(epochs: Any, lr: Any, batch_size: Any) -> None:
        _count(epochs, "epochs", 0)
        check_positive(lr, "lr")
        _count(batch_size, "batch_size", 1)

    def needs_ml_init(self, epochs: int | None = None) -> bool:
        """Whether :meth:`ml_init` has work to do: no task learnt yet and a positive number
        of epochs (``ml_init_epochs``, else ``epochs``)."""
        epochs = epochs if self.ml_init_epochs is None else self.ml_init_epochs
        return self.task_count == 0 and bool(epochs)

    def ml_init(
        self,
        x: Tensor,
        y: Tensor,
        *,
        epochs: int | None = None,
        lr: float | None = None,
        batch_size: int,
        device: Any = None,
    ) -> None:
        """Before task 1 (nothing afterwards): a maximum-likelihood fit of the posterior
        means on ``(x [N, ...], y [N])`` through the current head (:meth:`begin_task`),
        ``ml_init_epochs`` of Adam at ``ml_lr``; ``epochs`` and ``lr`` are used where those
        settings are None (e.g. the strategy's ``train_epochs`` and learning rate)."""
        epochs = epochs if self.ml_init_epochs is None else self.ml_init_epochs
        lr = lr if self.ml_lr is None else self.ml_lr
        self._check_data(x, y)
        self._check_fit(epochs, lr, batch_size)
        if self.task_count > 0 or epochs == 0:
            return
        task = self.current_head if self.multi_head else None
        device = device_dtype(self.model)[0] if device is None else device
        g = torch.Generator().manual_seed(self.seed)
        q = self.mean_field
        with q.mean_mode():
            self._fit(
                q.mean_parameters(),
                x,
                y,
                lambda xb, yb: F.cross_entropy(q.mean_logits(xb, task), yb),
                epochs=epochs,
                lr=lr,
                batch_size=batch_size,
                generator=g,
                device=device,
            )

    # -- coresets ---------------------------------------------------------------------
    def check_coreset_size(self, n: int) -> None:
        """Refuse a task of ``n`` examples that the coreset would take whole."""
        if self.coreset_size >= n:
            raise ValueError(
                f"coreset_size={self.coreset_size} must be smaller than the task's {n} "
                "training examples"
            )

    def coreset_indices(self, n: int, x: Tensor | None = None) -> Tensor:
        """Indices ``[coreset_size]`` of the current task's coreset among its ``n`` examples
        (``"kcenter"`` needs the inputs ``x [n, ...]``; ``"random"`` draws from a generator
        seeded by ``seed`` and the task counter)."""
        self.check_coreset_size(n)
        if self.coreset_method == "kcenter":
            if x is None or len(x) != n:
                raise ValueError("x must hold the task's n inputs for kcenter coresets")
            return select_coreset(x, self.coreset_size, "kcenter")
        g = torch.Generator().manual_seed(self.seed * 1000 + self.task_count)
        return select_coreset(torch.empty(n, 0), self.coreset_size, "random", g)

    def add_coreset(self, task: int | None, x: Tensor, y: Tensor) -> None:
        """Keep ``(x, y)`` as the coreset of ``task`` (stored on the CPU)."""
        self._check_data(x, y)
        self.coresets.append((self.head_of(task), x.cpu(), y.cpu()))

    def take_coreset(
        self,
        n: int,
        rows: Callable[[Tensor | None], tuple[Tensor, Tensor]],
        task: int | None,
    ) -> Tensor:
        """Select and keep the coreset of ``task`` among its ``n`` examples; returns its
        indices ``[coreset_size]`` (none when ``coreset_size`` is 0). ``rows(idx)`` gives
        the ``(x, y)`` of the examples ``idx`` (all of them for None) and is asked only for
        what the selection needs: ``"kcenter"`` all the inputs, ``"random"`` the chosen
        rows."""
        if self.coreset_size == 0:
            return torch.zeros(0, dtype=torch.long)
        self.check_coreset_size(n)
        if self.coreset_method == "kcenter":
            x, y = rows(None)
            idx = self.coreset_indices(n, x)
            cx, cy = x[idx], y[idx]
        else:
            idx = self.coreset_indices(n)
            cx, cy = rows(idx)
        self.add_coreset(task, cx, cy)
        return idx

    def split_coreset(self, x: Tensor, y: Tensor, task: int | None) -> tuple[Tensor, Tensor]:
        """Select and keep the coreset of ``task`` from ``(x [N, ...], y [N])``
        (:meth:`take_coreset`); returns the rest, the data to train on (everything when
        ``coreset_size`` is 0)."""
        self._check_data(x, y)
        idx = self.take_coreset(len(x), lambda i: (x, y) if i is None else (x[i], y[i]), task)
        if len(idx) == 0:
            return x, y
        keep = torch.ones(len(x), dtype=torch.bool, device=x.device)
        keep[idx.to(x.device)] = False
        return x[keep], y[keep]

    def prepare_eval(
        self,
        task: int | None,
        *,
        epochs: int | None = None,
        lr: float | None = None,
        batch_size: int | None = None,
        device: Any = None,
    ) -> bool:
        """Before predicting ``task``: train the posterior on the coreset (the task's with
        task heads, all of them with one head), the propagated posterior as prior, for
        ``coreset_epochs`` of Adam at ``coreset_lr`` in mini-batches of ``coreset_mb_size``
        (``epochs``, ``lr`` and ``batch_size`` where those settings are None). The propagated
        posterior is kept and comes back with :meth:`restore`. Nothing to do without
        coresets, for a task without one, or when the posterior is already tuned for it.
        Returns whether the posterior is tuned."""
        if not self.coresets:
            return False
        head = self.head_of(task)
        key = head if self.multi_head else "all"
        if key == self._tuned_key:
            return True
        epochs = epochs if self.coreset_epochs is None else self.coreset_epochs
        lr = lr if self.coreset_lr is None else self.coreset_lr
        batch_size = batch_size if self.coreset_mb_size is None else self.coreset_mb_size
        self._check_fit(epochs, lr, batch_size)
        self.restore()
        parts = [(x, y) for h, x, y in self.coresets if h == head]
        if not parts:
            return False  # a task not trained yet: the propagated posterior
        x = torch.cat([p[0] for p in parts])
        y = torch.cat([p[1] for p in parts])
        self._snapshot = {k: v.detach().clone() for k, v in self.mean_field.state_dict().items()}
        self._tuned_key = key
        routed = head if self.multi_head else None
        heads = self.kl_heads()
        self._fit(
            self.parameters(),
            x,
            y,
            lambda xb, yb: self.nll(xb, yb, routed)[0] + self.mean_field.kl(heads) / len(x),
            epochs=epochs,
            lr=lr,
            batch_size=batch_size,
            generator=torch.Generator().manual_seed(self.seed + 7919 * self.task_count + head),
            device=device_dtype(self.model)[0] if device is None else device,
        )
        return True

    def restore(self) -> None:
        """The propagated posterior back after :meth:`prepare_eval` (the means, the
        log-variances and the network's buffers, e.g. batch-norm statistics)."""
        if self._snapshot is not None:
            self.mean_field.load_state_dict(self._snapshot)
        self._snapshot, self._tuned_key = None, None

    # -- state ------------------------------------------------------------------------
    def _settings(self) -> dict:
        """The settings a state must have been saved with to be loaded."""
        return {k: getattr(self, k) for k in _STATE_SETTINGS}

    def state_dict(self) -> dict:
        """All VCL state (on the CPU) but the network's own ``state_dict`` (the means; save
        it beside): the posterior's log-variances and priors where they are not the
        network's (``"mean_field"``), the coresets, the trained heads, the task counter and
        experience keys, the seed and the settings. The propagated posterior is restored
        first."""
        self.restore()
        return {
            "mean_field": self.mean_field.variational_state(),
            "task_count": self.task_count,
            "experiences": list(self.experiences),
            "seen_heads": sorted(self.seen_heads),
            "coresets": [(h, x.clone(), y.clone()) for h, x, y in self.coresets],
            "seed": self.seed,
            **self._settings(),
        }

    def load_state_dict(
        self, state: dict[str, Any], *, device: torch.device | str | None = None
    ) -> None:
        """Restore what :meth:`state_dict` returned (into the posterior, in place, on the
        network's device; ``device`` is not used). Refuses a state with missing keys (all
        named), saved with other settings or for another network, before changing
        anything."""
        del device
        if not isinstance(state, dict):
            raise ValueError(f"state must be a dict, got {type(state).__name__}")
        required = ["mean_field", "task_count", "experiences", "seen_heads", "coresets", "seed"]
        required += list(_STATE_SETTINGS)
        missing = [k for k in required if k not in state]
        if missing:
            raise ValueError(
                f"state is missing keys {missing}: not a VCLMethod.state_dict() of this version"
            )
        check_saved_settings(state, self._settings())
        self._snapshot, self._tuned_key = None, None
        self.mean_field.load_variational_state(state["mean_field"])
        self.experiences = [int(k) for k in state["experiences"]]
        self.seen_heads = set(int(h) for h in state["seen_heads"])
        self.coresets = [(int(h), x.clone(), y.clone()) for h, x, y in state["coresets"]]
        self.seed = int(state["seed"])
