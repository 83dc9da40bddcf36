"""FROMP (Pan et al., NeurIPS 2020) as an Avalanche strategy.

Training on task ``t`` minimises ``CE(current mini-batch) + tau * R(w)`` where
``R(w) = 1/2 sum_{s<t} r_s^T K_s^{-1} r_s`` is the functional regulariser of
:class:`fromp.regularizer.FROMPRegularizer` on the memorable past of the earlier tasks.
This is the update of the reference code up to a factor ``tau`` (it uses
``grad CE / tau + grad R``; Adam is invariant to the factor, and gradient clipping is
applied at ``tau * grad_clip_norm`` so that it matches too).

After every experience (task ``t``), with the model in eval mode:

1. ``n_points`` memorable examples of the experience's training data are selected, the
   same number per class (``n_points // n_classes``), by ``tr Lambda`` (``select``);
2. the diagonal GGN of the whole training set of the task (through its head) is added to
   the running sum ``G``; the posterior variance is ``Sigma = 1 / (G + prior_precision)``;
3. targets ``m_s`` and kernels ``K_s`` of all memorable sets ``s <= t`` are (re)computed at
   the current weights and ``Sigma`` (as in the reference code, which regularises towards
   the latest solution) and factorised once.

Multi-head models (task label ``t`` selects head ``t``) regularise each memorable set
through its own head; single-head models (permuted MNIST, task label 0) through the one
head.
"""

from __future__ import annotations

import time
import warnings
from typing import Any

import torch
from avalanche.core import SupervisedPlugin
from torch import Tensor, nn

from fromp._checks import check_batch, check_vector, device_dtype
from fromp.curvature import diag_ggn, diag_ggn_linear
from fromp.jacobian import flat_params, num_params
from fromp.memorable import select_memorable
from fromp.models import with_task
from fromp.posterior import DiagonalGaussian
from fromp.regularizer import FROMPRegularizer
from strategies.benchmarks import experience_tensors
from strategies.models import Named, by_name, unwrap
from strategies.template import MethodStrategy

__all__ = ["FROMP", "FROMPPlugin", "experience_tensors"]

_SELECT = ("descending", "ascending", "random", "sensitivity")
_POSTERIORS = ("ggn", "vogn", "ivon")
_IVON_PENALTY = ("mean", "sample")


def _flat(value: Tensor | Named, net: nn.Module | None, fill: float) -> Tensor:
    """``value`` (a dict by parameter name; a flat vector is returned as it is) as one ``[P]``
    vector in ``net``'s parameter order, ``fill`` for parameters it lacks (default: the
    dict's order)."""
    if isinstance(value, Tensor):
        return value
    if net is None:
        return torch.cat([v.reshape(-1) for v in value.values()])
    ref = next(iter(value.values()))
    return torch.cat(
        [
            value[n].reshape(-1)
            if n in value
            else torch.full((p.numel(),), fill, dtype=ref.dtype, device=ref.device)
            for n, p in net.named_parameters()
            if p.requires_grad
        ]
    )


class FROMPPlugin(SupervisedPlugin):
    """The FROMP method state and hooks; see the module docstring.

    Args:
        tau: weight of the functional regulariser in the loss.
        n_points: memorable points per task (the paper's setting: 40 on split MNIST, 200 on
            permuted MNIST and split CIFAR), split evenly over the task's classes.
        kernel: ``"per_class"`` (FROMP), ``"joint"`` or ``"identity"`` (FROMP-L2).
        select: ``"descending"`` (largest ``tr Lambda``, FROMP), ``"ascending"``,
            ``"random"`` or ``"sensitivity"`` (largest memory-perturbation sensitivity
            ``sum_k |e_k lambda_k v_k|`` under the task's posterior ``N(w, Sigma)``, see
            :mod:`fromp.sensitivity`; ``Sigma`` is computed first, then the points).
        prior_precision: ``delta`` in ``Sigma = 1 / (G + delta)``.
        jitter: added to the kernels' diagonals before the Cholesky factorisation.
        grad_clip_norm: clip the total gradient norm at ``tau * grad_clip_norm`` (None: no
            clipping; ``grad_clip_norm`` when ``tau = 0``).
        posterior: ``"ggn"``: ``Sigma = 1 / (G + prior_precision)`` with ``G`` the running
            sum of the exact diagonal GGN over tasks; ``"vogn"``: the optimizer is a
            :class:`fromp.optim.VOGN` driven by :class:`strategies.vogn.VOGNPlugin` and
            ``Sigma`` is the variance of its posterior at the end of the task (no GGN pass;
            the regulariser's gradient enters VOGN's mean gradient only, its curvature
            uses the data loss only); ``"ivon"``: the same with a
            :class:`fromp.optim.IVON` driven by :class:`strategies.ivon.IVONPlugin`
            (``Sigma = 1 / (N (h + delta))``; see ``ivon_penalty``).
        curvature_examples: use at most this many (random) training examples of a task for
            its GGN, rescaled to the task size (None: all, as in the paper).
        chunk_size: examples per Jacobian chunk for the GGN and kernels.
        likelihood: the likelihood's name (``"categorical"``: softmax heads), for the
            memorability scores, the GGN and the kernels' ``p = inverse_link(f)``.
        seed: seeds the generator for ``select="random"`` and ``curvature_examples``.
        ivon_penalty: where IVON evaluates the regulariser (``posterior="ivon"``):
            ``"mean"`` (default): at the mean ``m`` of IVON's posterior, as FROMP defines it
            (a penalty on the mean function ``f(x; m)``), its gradient added to IVON's
            gradient estimate only (:meth:`fromp.optim.IVON.add_gradient`); the data loss
            alone is evaluated at the sampled weights and feeds IVON's Hessian estimate.
            ``"sample"``: in the loss at IVON's sampled weights, so that it enters both
            IVON's gradient and its Hessian estimate (and its value carries the sampling
            noise of the functions on the memorable points, about ``M C / 2``).
    """

    def __init__(
        self,
        tau: float = 10.0,
        n_points: int = 40,
        *,
        kernel: str = "per_class",
        select: str = "descending",
        prior_precision: float = 1e-3,
        jitter: float = 1e-6,
        grad_clip_norm: float | None = None,
        posterior: str = "ggn",
        curvature_examples: int | None = None,
        chunk_size: int = 64,
        likelihood: str = "categorical",
        seed: int = 0,
        ivon_penalty: str = "mean",
    ) -> None:
        super().__init__()
        if not tau >= 0:
            raise ValueError(f"tau must be >= 0, got {tau!r}")
        if not isinstance(n_points, int) or n_points < 1:
            raise ValueError(f"n_points must be a positive int, got {n_points!r}")
        if select not in _SELECT:
            raise ValueError(f"select must be one of {_SELECT}, got {select!r}")
        if not prior_precision > 0:
            raise ValueError(f"prior_precision must be > 0, got {prior_precision!r}")
        if grad_clip_norm is not None and not grad_clip_norm > 0:
            raise ValueError(f"grad_clip_norm must be > 0 or None, got {grad_clip_norm!r}")
        if posterior not in _POSTERIORS:
            raise ValueError(f"posterior must be one of {_POSTERIORS}, got {posterior!r}")
        if ivon_penalty not in _IVON_PENALTY:
            raise ValueError(f"ivon_penalty must be one of {_IVON_PENALTY}, got {ivon_penalty!r}")
        if curvature_examples is not None and curvature_examples < 1:
            raise ValueError(f"curvature_examples must be >= 1 or None, got {curvature_examples}")
        self.tau = float(tau)
        self.n_points = n_points
        self.select = select
        self.prior_precision = float(prior_precision)
        self.grad_clip_norm = grad_clip_norm
        self.posterior = posterior
        self.ivon_penalty = ivon_penalty
        self.curvature_examples = curvature_examples
        self.chunk_size = chunk_size
        self.likelihood = likelihood
        self.regularizer = FROMPRegularizer(
            kernel, likelihood, jitter=jitter, chunk_size=chunk_size
        )
        self.generator = torch.Generator().manual_seed(seed)
        # by parameter name: running sum of the tasks' diagonal GGNs (posterior="ggn"), or
        # the optimizer's posterior variance after the last task ("vogn", "ivon")
        self.ggn_sum: Named | None = None
        self.optimizer_variance: Named | None = None
        self.tasks_done = 0
        self.timings: list[dict[str, float]] = []
        self.last_penalty: float = 0.0

    # ---------------------------------------------------------------------- helpers
    @property
    def kernel(self) -> str:
        return self.regularizer.kernel

    @property
    def curvature(self) -> Tensor | None:
        """Deprecated: the flat ``[P]`` GGN sum (``"ggn"``) or optimizer posterior variance
        (``"vogn"``, ``"ivon"``); use :attr:`ggn_sum` / :attr:`optimizer_variance` (by
        parameter name) or :meth:`posterior_variance`."""
        warnings.warn(
            "FROMPPlugin.curvature is deprecated: use ggn_sum or optimizer_variance (by "
            "parameter name) or posterior_variance()",
            DeprecationWarning,
            stacklevel=2,
        )
        state = self.ggn_sum if self.posterior == "ggn" else self.optimizer_variance
        return None if state is None else _flat(state, None, 0.0)

    def posterior_variance(self, net: nn.Module | None = None) -> Tensor:
        """``Sigma`` ``[P]``: ``1 / (G + prior_precision)`` for ``posterior="ggn"`` (``G``
        the running GGN sum); for ``"vogn"`` / ``"ivon"`` the variance of the optimizer's
        posterior stored after the last task. In ``net``'s parameter order when given (a
        parameter added since, e.g. a new head, gets the prior variance
        ``1 / prior_precision``), else in the order the state was stored."""
        state = self.ggn_sum if self.posterior == "ggn" else self.optimizer_variance
        if state is None:
            raise RuntimeError("no task has been learnt yet")
        if self.posterior != "ggn":
            return _flat(state, net, 1.0 / self.prior_precision)
        return 1.0 / (_flat(state, net, 0.0) + self.prior_precision)

    def penalty(self, net: nn.Module) -> Tensor:
        """``R(w)`` on the memorable past (eval mode for the forward passes)."""
        was_training = net.training
        net.eval()
        try:
            return self.regularizer.penalty(net)
        finally:
            net.train(was_training)

    def learn_task(
        self,
        net: nn.Module,
        x: Tensor,
        y: Tensor,
        task: int,
        posterior_variance: Tensor | None = None,
    ) -> dict[str, float]:
        """Everything done after a task: select its memorable points, add its GGN (or,
        for ``posterior="vogn"`` or ``"ivon"``, store ``posterior_variance``), rebuild the
        kernels.
        ``net`` is the :mod:`fromp` model, ``x, y`` the task's training data, ``task`` its
        head. Returns the wall times of the three steps (seconds)."""
        if (posterior_variance is None) != (self.posterior == "ggn"):
            raise ValueError("posterior_variance must be given iff posterior is not 'ggn'")
        check_batch(x, "x")
        if posterior_variance is not None:
            check_vector(posterior_variance, num_params(net), "posterior_variance", positive=True)
        was_training = net.training
        net.eval()
        device, _ = device_dtype(net)
        head = with_task(net, task)
        times = {"select_s": 0.0, "curvature_s": 0.0, "kernel_s": 0.0}
        try:
            classes = sorted(int(c) for c in y.unique())
            per_class = self.n_points // len(classes)
            if per_class < 1:
                raise ValueError(
                    f"n_points={self.n_points} is fewer than the task's {len(classes)} classes"
                )
            sensitivity = self.select == "sensitivity"
            q = None
            if sensitivity:  # the points need this task's posterior: curvature first
                t0 = time.perf_counter()
                self._add_curvature(net, head, x, device, posterior_variance)
                times["curvature_s"] = time.perf_counter() - t0
                q = DiagonalGaussian(flat_params(net), self.posterior_variance(net).reciprocal())
            t0 = time.perf_counter()
            idx = select_memorable(
                head,
                x.to(device) if sensitivity else x,
                y,
                self.likelihood,
                per_class,
                order=self.select,
                classes=classes,
                generator=self.generator,
                posterior=q,
                chunk_size=self.chunk_size,
            )
            times["select_s"] = time.perf_counter() - t0
            if not sensitivity:
                t0 = time.perf_counter()
                self._add_curvature(net, head, x, device, posterior_variance)
                times["curvature_s"] = time.perf_counter() - t0
            t0 = time.perf_counter()
            variance = self.posterior_variance(net)
            self.regularizer.add_task(net, x[idx].to(device), task, variance)
            times["kernel_s"] = time.perf_counter() - t0
        finally:
            net.train(was_training)
        self.tasks_done += 1
        self.timings.append(times)
        return times

    def _add_curvature(
        self,
        net: nn.Module,
        head: nn.Module,
        x: Tensor,
        device: torch.device,
        posterior_variance: Tensor | None,
    ) -> None:
        """Store ``posterior_variance`` (optimizer posteriors) or add the task's diagonal GGN
        (on at most ``curvature_examples`` examples, rescaled) to the running sum, both by
        parameter name (a parameter new since the last task starts from zero)."""
        if posterior_variance is not None:
            self.optimizer_variance = by_name(net, posterior_variance.to(device))
            return
        xc, scale = x, 1.0
        if self.curvature_examples is not None and self.curvature_examples < len(x):
            sub = torch.randperm(len(x), generator=self.generator)
            xc, scale = x[sub[: self.curvature_examples]], len(x) / self.curvature_examples
        ggn = by_name(net, scale * self._diag_ggn(head, xc, device))
        if self.ggn_sum is not None:
            old = by_name(net, self.ggn_sum)
            ggn = {n: old[n] + g if n in old else g for n, g in ggn.items()}
        self.ggn_sum = ggn

    def _diag_ggn(self, head: nn.Module, x: Tensor, device: torch.device) -> Tensor:
        """Exact diagonal GGN of ``x``: the batched linear-layer formula for MLPs, per-example
        Jacobians (:func:`fromp.curvature.diag_ggn`) otherwise."""
        batches = ((x[s : s + 1024].to(device),) for s in range(0, len(x), 1024))
        try:
            return diag_ggn_linear(head, batches, self.likelihood)
        except ValueError:
            return diag_ggn(head, x.to(device), self.likelihood, chunk_size=self.chunk_size)

    # ------------------------------------------------------------------------ hooks
    @property
    def _penalty_at_mean(self) -> bool:
        return self.posterior == "ivon" and self.ivon_penalty == "mean"

    def before_backward(self, strategy: Any, *args: Any, **kwargs: Any) -> None:
        if len(self.regularizer) == 0 or self.tau == 0 or self._penalty_at_mean:
            return
        pen = self.penalty(unwrap(strategy.model))
        self.last_penalty = float(pen.detach())
        strategy.loss = strategy.loss + self.tau * pen.to(strategy.loss.dtype)

    def before_update(self, strategy: Any, *args: Any, **kwargs: Any) -> None:
        if self.grad_clip_norm is not None:
            max_norm = self.grad_clip_norm * (self.tau if self.tau > 0 else 1.0)
            torch.nn.utils.clip_grad_norm_(strategy.model.parameters(), max_norm)
        if self._penalty_at_mean and len(self.regularizer) and self.tau > 0:
            self._ivon_penalty_at_mean(strategy)

    @staticmethod
    def _ivon(strategy: Any) -> Any:
        """The strategy's optimizer, which ``posterior="ivon"`` needs to be an IVON."""
        from fromp.optim import IVON

        opt = strategy.optimizer
        if not isinstance(opt, IVON):
            raise TypeError(f"posterior='ivon' needs a fromp.optim.IVON, got {type(opt)}")
        return opt

    def _ivon_penalty_at_mean(self, strategy: Any) -> None:
        """``ivon_penalty="mean"``: restore IVON's mean (taking the data gradient at the
        draw), then add ``tau grad R(m)`` to IVON's gradient estimate."""
        opt = self._ivon(strategy)
        if opt.sampled:
            opt.restore(accumulate=True)  # reads .grad at the draw (after the clipping)
        params = opt.params
        with torch.enable_grad():
            pen = self.penalty(unwrap(strategy.model))
            grads = torch.autograd.grad(self.tau * pen, params, allow_unused=True)
        self.last_penalty = float(pen.detach())
        opt.add_gradient(grads)

    def after_training_exp(self, strategy: Any, *args: Any, **kwargs: Any) -> None:
        exp = strategy.experience
        x, y, t = experience_tensors(exp.dataset)
        net = unwrap(strategy.model)
        tasks = t.unique()
        if len(tasks) != 1:
            raise ValueError(f"an experience must hold one task label, got {tasks.tolist()}")
        variance = None
        if self.posterior == "vogn":
            opt = strategy.optimizer
            if not hasattr(opt, "posterior") or not hasattr(opt, "load_mean"):
                raise TypeError(f"posterior='vogn' needs a fromp.optim.VOGN, got {type(opt)}")
            opt.load_mean()  # the model holds the posterior mean
            variance = opt.posterior().variance
        elif self.posterior == "ivon":
            opt = self._ivon(strategy)
            if opt.sampled:
                opt.restore(accumulate=False)  # the model holds the posterior mean
            variance = opt.posterior(net).variance
        self.learn_task(net, x, y, int(tasks[0]), variance)

    # ------------------------------------------------------------------------ state
    def state_dict(self) -> dict[str, Any]:
        """All method state: settings, curvature sum, memorable sets with targets and
        Cholesky factors, task counter, RNG state, timings."""
        return {
            "tau": self.tau,
            "n_points": self.n_points,
            "select": self.select,
            "prior_precision": self.prior_precision,
            "grad_clip_norm": self.grad_clip_norm,
            "posterior": self.posterior,
            "ivon_penalty": self.ivon_penalty,
            "curvature_examples": self.curvature_examples,
            "chunk_size": self.chunk_size,
            "likelihood": self.likelihood,
            "ggn_sum": self.ggn_sum,
            "optimizer_variance": self.optimizer_variance,
            "regularizer": self.regularizer.state_dict(),
            "tasks_done": self.tasks_done,
            "generator": self.generator.get_state(),
            "timings": list(self.timings),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` (e.g. in a fresh process after a checkpoint)."""
        for key in (
            "tau",
            "n_points",
            "select",
            "prior_precision",
            "grad_clip_norm",
            "posterior",
            "ivon_penalty",
            "curvature_examples",
            "chunk_size",
            "likelihood",
            "tasks_done",
        ):
            if key in state:
                setattr(self, key, state[key])
        self.ggn_sum, self.optimizer_variance = (
            state.get("ggn_sum"),
            state.get("optimizer_variance"),
        )
        if "curvature" in state:  # flat [P] state of older checkpoints
            if self.posterior != "ggn":
                self.optimizer_variance = state["curvature"]
            else:
                self.ggn_sum = state["curvature"]
        self.regularizer.load_state_dict(state["regularizer"])
        if "generator" in state:
            self.generator.set_state(state["generator"])
        self.timings = list(state.get("timings", []))


class FROMP(MethodStrategy):
    """FROMP strategy: Avalanche's supervised template with a :class:`FROMPPlugin`.

    ``model`` is an Avalanche model wrapping a :mod:`fromp` model
    (:func:`strategies.models.as_avalanche_model`). Method keyword arguments are those of
    :class:`FROMPPlugin`; :data:`benchmarks.settings.SETTINGS` holds the settings per benchmark.
    Avalanche's template arguments (``criterion``, ``train_mb_size``, ...) are those of
    :class:`strategies.template.MethodStrategy`.
    With ``posterior="vogn"`` the optimizer must be a :class:`fromp.optim.VOGN`; a
    :class:`strategies.vogn.VOGNPlugin` drives it (``vogn_continual``: the task's posterior
    becomes the next task's prior, naive continual VOGN, as in that plugin). With
    ``posterior="ivon"`` it must be a :class:`fromp.optim.IVON`, driven by a
    :class:`strategies.ivon.IVONPlugin` (``ivon_continual``, default False: the prior stays
    IVON's weight decay).
    """

    def __init__(
        self,
        *,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        tau: float = 10.0,
        n_points: int = 40,
        kernel: str = "per_class",
        select: str = "descending",
        prior_precision: float = 1e-3,
        jitter: float = 1e-6,
        grad_clip_norm: float | None = None,
        posterior: str = "ggn",
        curvature_examples: int | None = None,
        chunk_size: int = 64,
        likelihood: str = "categorical",
        seed: int = 0,
        vogn_continual: bool = True,
        ivon_continual: bool = False,
        ivon_penalty: str = "mean",
        **template_kwargs: Any,
    ) -> None:
        extra: list[Any] = []
        if posterior == "vogn":
            from fromp.optim import VOGN
            from strategies.vogn import VOGNPlugin

            if not isinstance(optimizer, VOGN):
                raise TypeError(
                    f"posterior='vogn' needs a fromp.optim.VOGN optimizer, got {type(optimizer)}"
                )
            # after the FROMP plugin, so that FROMP reads the task's posterior before VOGN
            # turns it into the next prior
            extra.append(VOGNPlugin(optimizer, continual=vogn_continual))
        elif posterior == "ivon":
            from fromp.optim import IVON
            from strategies.ivon import IVONPlugin

            if not isinstance(optimizer, IVON):
                raise TypeError(
                    f"posterior='ivon' needs a fromp.optim.IVON optimizer, got {type(optimizer)}"
                )
            # after the FROMP plugin: FROMP's gradient clipping (before_update) acts on the
            # gradient IVON reads, and FROMP reads the task's posterior before IVON may turn
            # it into the next prior
            extra.append(IVONPlugin(optimizer, continual=ivon_continual))
        plugin = FROMPPlugin(
            tau,
            n_points,
            kernel=kernel,
            select=select,
            prior_precision=prior_precision,
            jitter=jitter,
            grad_clip_norm=grad_clip_norm,
            posterior=posterior,
            curvature_examples=curvature_examples,
            chunk_size=chunk_size,
            likelihood=likelihood,
            seed=seed,
            ivon_penalty=ivon_penalty,
        )
        super().__init__(
            method_plugins=[plugin, *extra],
            model=model,
            optimizer=optimizer,
            **template_kwargs,
        )
