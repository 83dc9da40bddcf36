"""FROMP (Pan et al., NeurIPS 2020) as an Avalanche strategy.

Training on task ``t`` minimises ``CE(current mini-batch) + tau * R(w)`` where
``R(w) = 1/2 sum_{s<t} r_s^T K_s^{-1} r_s`` is the functional regulariser of
:class:`fromp.continual.regularizer.FROMPRegularizer` on the memorable past of the earlier tasks.
This is the update of the reference code up to a factor ``tau`` (it uses
``grad CE / tau + grad R``; Adam is invariant to the factor, and gradient clipping is
applied at ``tau * grad_clip_norm`` so that it matches too).

After every experience (task ``t``), with the model in eval mode:

1. ``n_points`` memorable examples of the experience's training data are selected, the
   same number per class (``n_points // n_classes``), by ``tr Lambda`` (``select``);
2. the diagonal GGN of the whole training set of the task (through its head) is added to
   the running sum ``G``; the posterior variance is ``Sigma = 1 / (G + prior_precision)``
   (``curvature_combine``: ``G`` divided by ``E^a`` after ``E`` experiences, e.g. their
   mean);
3. targets ``m_s`` and kernels ``K_s`` of all memorable sets ``s <= t`` are (re)computed at
   the current weights and ``Sigma`` (as in the reference code, which regularises towards
   the latest solution) and factorised once.

Multi-head models (task label ``t`` selects head ``t``) regularise each memorable set
through its own head; single-head models (permuted MNIST, task label 0) through the one
head.
"""

from __future__ import annotations

import inspect
import warnings
from collections.abc import Callable
from typing import Any

import torch
from avalanche.core import SupervisedPlugin
from avalanche.evaluation import GenericPluginMetric
from avalanche.evaluation.metrics import Mean
from fromp_avalanche.benchmarks import experience_tensors
from fromp_avalanche.models import unwrap
from fromp_avalanche.template import MethodStrategy
from torch import Tensor, nn

from fromp.continual.methods import FROMPMethod, to_flat

__all__ = ["FROMP", "FROMPPenaltyMetric", "FROMPPlugin", "experience_tensors"]


class FROMPPlugin(SupervisedPlugin):
    """FROMP as an Avalanche plugin: a thin driver of a
    :class:`fromp.continual.methods.FROMPMethod`.

    ``before_backward`` adds ``tau * R(w)`` to the loss; ``after_training_exp`` calls
    :meth:`~fromp.continual.methods.FROMPMethod.learn_task` with the experience's data, task label
    and ``current_experience`` key (training the same experience again replaces its
    memorable set and GGN term). Works with plain modules, :mod:`fromp` models and
    Avalanche ``MultiTaskModule``s (``forward(x, task_labels)``). The method's attributes
    (``regularizer``, ``ggn_sum``, ``task_count``, ...) are readable on the plugin.

    What the loggers see: ``tau * R`` is added to ``strategy.loss`` for the backward pass
    and taken out of it again (as a constant) after it, so Avalanche's loss metrics (and the
    ``training_loss`` column of its ``CSVLogger``) record the loss without the penalty, as
    for any other strategy; :class:`FROMPPenaltyMetric` records ``tau * R`` (the
    :class:`FROMP` strategy adds it to its evaluator). With ``replay=True`` the memorable
    points' loss under their labels is added as well and stays in the logged loss (it is
    part of the data term). A warning (once) says when ``tau * R`` exceeds
    ``100 x`` the loss without it in the first steps of an experience.

    Args: those of :class:`fromp.continual.methods.FROMPMethod` (``curvature_examples`` defaults to
    1,000: the GGN after each experience on a random subsample of that many examples,
    rescaled; None: all examples, as in the paper).
    """

    #: ``tau * R`` above this multiple of the data loss gets a warning (once)
    dominance_ratio: float = 100.0

    def __init__(
        self,
        tau: float = 10.0,
        n_points: int = 40,
        *,
        curvature_examples: int | None = 1000,
        **kwargs: Any,
    ) -> None:
        super().__init__()
        self.method = FROMPMethod(tau, n_points, curvature_examples=curvature_examples, **kwargs)
        self._last_penalty: Tensor | None = None
        self._weighted: Tensor | None = None
        self._warned = False
        self._checks_left = 0

    def __setattr__(self, name: str, value: Any) -> None:
        # settings and state live on the method: plugin.x = v sets method.x
        method = self.__dict__.get("method")
        if (
            method is not None
            and not name.startswith("_")
            and name != "method"
            and hasattr(method, name)
        ):
            setattr(method, name, value)
        else:
            super().__setattr__(name, value)

    def __getattr__(self, name: str) -> Any:
        if name == "method":  # not set yet (e.g. during unpickling)
            raise AttributeError(name)
        return getattr(self.method, name)

    @property
    def last_penalty(self) -> float:
        """``R(w)`` of the last training step (read as a float here only, so that training
        itself never waits for the device)."""
        return 0.0 if self._last_penalty is None else float(self._last_penalty)

    def posterior_variance(self, net: nn.Module | None = None) -> Tensor:
        return self.method.posterior_variance(net)

    def penalty(self, net: nn.Module) -> Tensor:
        return self.method.penalty(net)

    def learn_task(self, *args: Any, **kwargs: Any) -> dict[str, float]:
        return self.method.learn_task(*args, **kwargs)

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
        m = self.method
        state = m.ggn_sum if m.posterior == "ggn" else m.optimizer_variance
        return None if state is None else to_flat(state, None, 0.0)

    # ------------------------------------------------------------------------ hooks
    @property
    def _penalty_at_mean(self) -> bool:
        return self.posterior == "ivon" and self.ivon_penalty == "mean"

    @property
    def last_weighted_penalty(self) -> float:
        """``tau * R(w)`` of the last training step (0 before the first memorable set)."""
        return float(self.last_weighted_penalty_tensor)

    @property
    def last_weighted_penalty_tensor(self) -> Tensor | float:
        """``tau * R(w)`` of the last training step as a detached tensor on the network's
        device, not read back (0.0 before the first memorable set): what a metric
        accumulates on every step without making training wait for the device."""
        return 0.0 if self._last_penalty is None else self.tau * self._last_penalty

    def before_training_exp(self, strategy: Any, *args: Any, **kwargs: Any) -> None:
        self._checks_left = 20  # steps of this experience whose penalty is compared
        self._last_penalty = None
        # a resumed run: the saved copy of the previous network into the (adapted) model
        self.method.attach_previous(unwrap(strategy.model))

    def before_backward(self, strategy: Any, *args: Any, **kwargs: Any) -> None:
        self._weighted = None
        if len(self.regularizer) == 0:
            return
        weighted = self._context_term(strategy)
        penalised = self.tau != 0 and not self._penalty_at_mean
        if penalised or self.method.replay:
            pen, rep = self.method.terms(unwrap(strategy.model))
            if rep is not None:  # the coreset's loss is part of the data term
                strategy.loss = strategy.loss + rep.to(strategy.loss.dtype)
            if penalised:
                self._last_penalty = pen.detach()
                fromp_term = self.tau * pen.to(strategy.loss.dtype)
                self._check_dominance(
                    fromp_term, strategy.loss, getattr(strategy, "experience", None)
                )
                weighted = fromp_term if weighted is None else fromp_term + weighted
        if weighted is not None:
            strategy.loss = strategy.loss + weighted
            self._weighted = weighted.detach()

    def _context_term(self, strategy: Any) -> Tensor | None:
        """``context_tau`` times :meth:`FROMPMethod.context_penalty` on the mini-batch,
        from the training step's outputs (one group per task label in the batch); None
        when ``context_tau = 0``."""
        if self.method.context_tau == 0:
            return None
        out, x = strategy.mb_output, strategy.mb_x
        tasks = getattr(strategy, "mb_task_id", None)
        if tasks is None or len(tasks.unique()) == 1:
            t = None if tasks is None else int(tasks[0])
            ctx = self.method.context_penalty(out, x, t)
        else:
            ctx = sum(
                self.method.context_penalty(out[tasks == t], x[tasks == t], int(t))
                * float((tasks == t).float().mean())
                for t in tasks.unique()
            )
        return self.method.context_tau * ctx.to(strategy.loss.dtype)

    def after_backward(self, strategy: Any, *args: Any, **kwargs: Any) -> None:
        # the loggers' loss: without the penalty (a constant taken out after the backward)
        if self._weighted is not None:
            strategy.loss = strategy.loss - self._weighted
            self._weighted = None

    def _check_dominance(self, weighted: Tensor, loss: Tensor, experience: Any) -> None:
        """Warn (once) when ``tau * R`` exceeds ``dominance_ratio`` times the loss without
        it; compared in the first steps of each experience only (a host sync each). When
        ``experience`` brings new classes to a shared head and nothing is replayed, the
        warning also names ``replay=True``."""
        if self._warned or self._checks_left <= 0:
            return
        self._checks_left -= 1
        w, data = float(weighted.detach()), float(loss.detach())
        if w > self.dominance_ratio * max(abs(data), 1e-8):
            self._warned = True
            coreset = not self.method.replay and _new_classes_on_one_head(experience)
            warnings.warn(
                f"FROMP: tau * R = {w:.3g} is {w / max(abs(data), 1e-8):.0f}x the loss "
                f"without it ({data:.3g}); the penalty dominates training: lower tau "
                f"(now {self.tau:g}) or raise prior_precision / jitter"
                + (
                    "; new classes on a head shared with earlier experiences: without the "
                    "old classes' labels FROMP stays far below Replay there, replay=True "
                    "keeps the memorable points as a labelled coreset (docs/avalanche.md)"
                    if coreset
                    else ""
                ),
                RuntimeWarning,
                stacklevel=2,
            )

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
        self._last_penalty = pen.detach()
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
        if self.method.function == "auto" and _grows_with_classes(net):
            # one head that grows with the classes: its first experience fills it, yet the
            # classes still arrive over the experiences (class-incremental)
            self.method.resolve_function("probs")
        self.method.learn_task(
            net, x, y, int(tasks[0]), variance, experience=int(exp.current_experience)
        )

    # ------------------------------------------------------------------------ state
    def state_dict(self) -> dict[str, Any]:
        """The method's state (:meth:`fromp.continual.methods.FROMPMethod.state_dict`)."""
        return self.method.state_dict()

    def load_state_dict(
        self, state: dict[str, Any], *, device: torch.device | str | None = None
    ) -> None:
        """Restore :meth:`state_dict`, tensors moved to ``device`` when given."""
        self.method.load_state_dict(state, device=device)


def _grows_with_classes(net: nn.Module) -> bool:
    """Whether ``net`` holds a head that adds output units as new classes arrive
    (Avalanche's ``IncrementalClassifier``)."""
    from avalanche.models import IncrementalClassifier

    return any(isinstance(m, IncrementalClassifier) for m in net.modules())


class _DeviceMean(Mean):
    """Avalanche's weighted :class:`~avalanche.evaluation.metrics.Mean` whose sum stays a
    tensor on the values' device between reads: ``update`` runs on every training step
    and never waits for the GPU; ``result`` (once an epoch) reads it back."""

    def __init__(self) -> None:
        super().__init__()
        self._sum: Tensor | float = 0.0

    def update(self, value: Tensor | float, weight: float = 1.0) -> None:
        if isinstance(value, Tensor):
            value = value.detach().double()
        self._sum = self._sum + value * float(weight)
        self.weight += float(weight)

    def result(self) -> float:
        return 0.0 if self.weight == 0 else float(self._sum) / self.weight

    def reset(self) -> None:
        super().reset()
        self._sum = 0.0


class FROMPPenaltyMetric(GenericPluginMetric[float, Mean]):
    """Avalanche metric: the mean of ``tau * R(w)`` over an epoch's training steps
    (weighted by mini-batch size), emitted as ``FROMP_Penalty_Epoch`` after each training
    epoch, so every logger that records metrics (text, interactive, TensorBoard, W&B)
    shows it beside ``Loss_Epoch`` (the loss without the penalty, see
    :class:`FROMPPlugin`). Avalanche's ``CSVLogger`` writes fixed columns only: its
    ``training_loss`` is then the loss without the penalty.

    The :class:`FROMP` strategy adds it to an ``EvaluationPlugin`` that lacks it; with a
    :class:`FROMPPlugin` in another strategy pass it to the ``EvaluationPlugin``::

        EvaluationPlugin(loss_metrics(epoch=True), FROMPPenaltyMetric(), loggers=[...])
    """

    def __init__(self) -> None:
        super().__init__(_DeviceMean(), reset_at="epoch", emit_at="epoch", mode="train")

    def update(self, strategy: Any) -> None:
        plugin = next((p for p in strategy.plugins if isinstance(p, FROMPPlugin)), None)
        if plugin is not None:
            self._metric.update(plugin.last_weighted_penalty_tensor, len(strategy.mb_y))

    def __str__(self) -> str:
        return "FROMP_Penalty_Epoch"


def _new_classes_on_one_head(experience: Any) -> bool:
    """Whether ``experience`` (Avalanche's, with its classes timeline) brings classes that
    no earlier experience had, on task label 0 as the earlier ones (one head shared by all:
    class-incremental). False when the stream does not say."""
    previous = set(getattr(experience, "previous_classes", None) or [])
    now = set(getattr(experience, "classes_in_this_experience", None) or [])
    labels = set(getattr(experience, "task_labels", None) or [0])
    return bool(previous) and bool(now - previous) and labels == {0}


def _add_penalty_metric(evaluator: Any) -> None:
    """Add a :class:`FROMPPenaltyMetric` to an ``EvaluationPlugin`` that has none."""
    metrics = getattr(evaluator, "metrics", None)
    if isinstance(metrics, list) and not any(isinstance(m, FROMPPenaltyMetric) for m in metrics):
        metrics.append(FROMPPenaltyMetric())


class FROMP(MethodStrategy):
    """FROMP strategy: Avalanche's supervised template with a :class:`FROMPPlugin`.

    ``model`` is any classifier: a plain ``nn.Module`` (one head, e.g. Avalanche's
    ``SimpleMLP`` or a torchvision ResNet), an Avalanche ``MultiTaskModule`` whose
    ``forward(x, task_labels)`` picks a head (``MTSimpleMLP``, ``MultiHeadClassifier``,
    grown heads included), or a :mod:`fromp` multi-head model, wrapped or not by
    :func:`fromp_avalanche.models.as_avalanche_model`. Method keyword arguments are those of
    :class:`FROMPPlugin`; :data:`fromp_bench.settings.SETTINGS` holds the settings per benchmark.
    Avalanche's template arguments (``criterion``, ``train_mb_size``, ...) are those of
    :class:`fromp_avalanche.template.MethodStrategy`.
    With ``posterior="vogn"`` the optimizer must be a :class:`fromp.optim.VOGN`; a
    :class:`fromp_avalanche.vogn.VOGNPlugin` drives it (``vogn_continual``: the task's posterior
    becomes the next task's prior, naive continual VOGN, as in that plugin). With
    ``posterior="ivon"`` it must be a :class:`fromp.optim.IVON`, driven by a
    :class:`fromp_avalanche.ivon.IVONPlugin` (``ivon_continual``, default False: the prior stays
    IVON's weight decay).
    """

    def __init__(
        self,
        *,
        model: nn.Module | None = None,
        optimizer: torch.optim.Optimizer | None = None,
        criterion: nn.Module | Callable | None = None,
        vogn_continual: bool = True,
        ivon_continual: bool = False,
        **kwargs: Any,
    ) -> None:
        # the method's keyword arguments (FROMPMethod's signature, written there once; see
        # the __signature__ set below the class) go to the plugin, the rest to the template
        template_kwargs = {k: v for k, v in kwargs.items() if k not in _METHOD_PARAMS}
        method_kwargs = {k: v for k, v in kwargs.items() if k in _METHOD_PARAMS}
        if model is None or optimizer is None:
            raise TypeError("FROMP needs model= and optimizer=")
        posterior = method_kwargs.get("posterior", _METHOD_PARAMS["posterior"].default)
        extra: list[Any] = []
        if posterior == "vogn":
            from fromp_avalanche.vogn import VOGNPlugin

            from fromp.optim import VOGN

            if not isinstance(optimizer, VOGN):
                raise TypeError(
                    f"posterior='vogn' needs a fromp.optim.VOGN optimizer, got {type(optimizer)}"
                )
            # after the FROMP plugin, so that FROMP reads the task's posterior before VOGN
            # turns it into the next prior
            extra.append(VOGNPlugin(optimizer, continual=vogn_continual))
        elif posterior == "ivon":
            from fromp_avalanche.ivon import IVONPlugin

            from fromp.optim import IVON

            if not isinstance(optimizer, IVON):
                raise TypeError(
                    f"posterior='ivon' needs a fromp.optim.IVON optimizer, got {type(optimizer)}"
                )
            # after the FROMP plugin: FROMP's gradient clipping (before_update) acts on the
            # gradient IVON reads, and FROMP reads the task's posterior before IVON may turn
            # it into the next prior
            extra.append(IVONPlugin(optimizer, continual=ivon_continual))
        plugin = FROMPPlugin(**method_kwargs)
        super().__init__(
            method_plugins=[plugin, *extra],
            model=model,
            optimizer=optimizer,
            criterion=criterion,
            **template_kwargs,
        )
        _add_penalty_metric(self.evaluator)


#: FROMPMethod's keyword arguments by name (the one place they are written)
_METHOD_PARAMS: dict[str, inspect.Parameter] = {
    n: p.replace(kind=inspect.Parameter.KEYWORD_ONLY)
    for n, p in inspect.signature(FROMPMethod.__init__).parameters.items()
    if n != "self"
}


def _signature() -> inspect.Signature:
    """FROMP's signature for ``help``, introspection and Avalanche's mapping of positional
    arguments: keyword-only ``model``, ``optimizer``, ``criterion``, FROMPMethod's
    arguments, ``vogn_continual``, ``ivon_continual`` and Avalanche's template arguments."""
    own = inspect.signature(_INIT).parameters
    params = [own["self"], own["model"], own["optimizer"], own["criterion"]]
    params += list(_METHOD_PARAMS.values())
    params += [own["vogn_continual"], own["ivon_continual"], own["kwargs"]]
    return inspect.Signature(params)


#: FROMP's own __init__ (Avalanche's template wraps it: positional arguments are mapped, in
#: this signature's order, by Avalanche's legacy support with its
#: PositionalArgumentsDeprecatedWarning)
_INIT = getattr(FROMP.__init__, "__wrapped__", FROMP.__init__)
_INIT.__signature__ = _signature()  # type: ignore[attr-defined]
