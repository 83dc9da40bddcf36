"""EWC (Kirkpatrick et al., 2017) as a plain object for any PyTorch training loop: a
per-example Fisher diagonal per task, keyed by parameter name, and the quadratic penalty
(models and heads as in :mod:`fromp.methods`)."""

from __future__ import annotations

import torch
from torch import Tensor, nn

from fromp._checks import check_batch, device_dtype
from fromp.curvature import diag_ef, diag_fisher, diag_ggn
from fromp.jacobian import unflatten
from fromp.likelihood import Likelihood, get_likelihood
from fromp.methods import Named, by_name, fit_shape
from fromp.models import is_multitask, with_task

__all__ = ["EWCMethod", "ewc_penalty"]

_FISHERS = ("sampled", "empirical", "exact")


def ewc_penalty(
    w: Tensor | Named,
    anchors: list[Tensor] | list[Named],
    importances: list[Tensor] | list[Named],
    ewc_lambda: float,
) -> Tensor:
    """``(lambda / 2) sum_t sum_p F_{t,p} (w_p - w*_{t,p})^2`` (a scalar).

    ``w``, each anchor ``w*_t`` and each importance ``F_t`` are either flat ``[P]`` vectors
    or dicts ``{parameter name: tensor}``; with dicts, a parameter that a task's importance
    does not name (e.g. a head added after that task) gets no penalty from that task, and
    a parameter that grew since (new output units) is penalised on its old entries only."""
    if len(anchors) != len(importances):
        raise ValueError(
            f"anchors and importances must have equal lengths, got {len(anchors)} "
            f"and {len(importances)}"
        )
    terms = []
    for a, f in zip(anchors, importances):
        if isinstance(w, dict):
            for n, p in w.items():
                if n not in f:
                    continue
                old = tuple(slice(0, k) for k in f[n].shape)
                pn = p if p.shape == f[n].shape else p[old]
                terms.append((f[n] * (pn - a[n]) ** 2).reshape(-1))
        else:
            terms.append(f * (w - a) ** 2)
    total = (next(iter(w.values())) if isinstance(w, dict) else w).new_zeros(())
    for t in terms:
        total = total + t.sum()
    return 0.5 * ewc_lambda * total


def _live(model: nn.Module) -> Named:
    """The trainable parameters by name (differentiable)."""
    return {n: p for n, p in model.named_parameters() if p.requires_grad}


class EWCMethod:
    """EWC with a per-example Fisher diagonal, for any training loop (no Avalanche needed).

    The importance of task ``t`` is ``F_t = (1 / N_t) sum_n diag(g_n g_n^T)`` ``[P]``,
    ``g_n = grad_w -log p(y_n | f_w(x_n))`` through head ``t``, with ``y_n`` sampled from
    the model (``fisher="sampled"``), the observed labels (``"empirical"``) or its exact
    expectation (``"exact"``: the GGN diagonal). The penalty is

        ``(lambda / 2) sum_{t < T} sum_p F_{t,p} (w_p - w*_{t,p})^2``          (separate)
        ``(lambda / 2) sum_p F~_p (w_p - w*_{T-1,p})^2``, ``F~ <- gamma F~ + F_t``  (online)

    with ``w*_t`` the weights after task ``t``. Anchors and importances are dicts keyed by
    parameter name, so a head added later is not penalised by earlier tasks and never
    shifts their entries.

    Args:
        ewc_lambda: ``lambda``.
        mode: ``"separate"`` or ``"online"``.
        decay_factor: ``gamma`` of the online mode, applied once per learnt task after the
            first.
        fisher: ``"sampled"`` (default) | ``"empirical"`` | ``"exact"``.
        fisher_samples: labels drawn per example for ``"sampled"``.
        max_examples: use at most this many (random) examples for the Fisher (None: all).
        chunk_size: examples per vectorised per-example-gradient call.
        likelihood: a :class:`fromp.likelihood.Likelihood` or its name.

    Example (a plain PyTorch loop)::

        method = EWCMethod(ewc_lambda=100.0)
        for task, (x, y) in enumerate(tasks):
            for xb, yb in batches(x, y):
                loss = F.cross_entropy(with_task(net, task)(xb), yb) + method.penalty(net)
                ...
            method.learn_task(net, x, y, task)
    """

    def __init__(
        self,
        ewc_lambda: float,
        *,
        mode: str = "separate",
        decay_factor: float = 1.0,
        fisher: str = "sampled",
        fisher_samples: int = 1,
        max_examples: int | None = None,
        chunk_size: int = 128,
        likelihood: str | Likelihood = "categorical",
    ) -> None:
        if not ewc_lambda >= 0:
            raise ValueError(f"ewc_lambda must be >= 0, got {ewc_lambda}")
        if mode not in ("separate", "online"):
            raise ValueError(f"mode must be 'separate' or 'online', got {mode!r}")
        if not 0.0 <= decay_factor <= 1.0:
            raise ValueError(f"decay_factor must be in [0, 1], got {decay_factor}")
        if fisher not in _FISHERS:
            raise ValueError(f"fisher must be one of {_FISHERS}, got {fisher!r}")
        if fisher_samples < 1:
            raise ValueError(f"fisher_samples must be >= 1, got {fisher_samples}")
        if max_examples is not None and max_examples < 1:
            raise ValueError(f"max_examples must be >= 1 or None, got {max_examples}")
        self.ewc_lambda, self.mode, self.decay_factor = float(ewc_lambda), mode, decay_factor
        self.fisher, self.fisher_samples = fisher, int(fisher_samples)
        self.max_examples, self.chunk_size = max_examples, int(chunk_size)
        self.likelihood = get_likelihood(likelihood)
        self.anchors: list[Named] = []  # w*_t by parameter name
        self.importances: list[Named] = []  # F_t by name (online: a single decayed sum)
        self.task_count = 0

    def penalty(self, net: nn.Module) -> Tensor:
        """The current penalty (scalar, differentiable in ``net``'s parameters)."""
        w = _live(net)
        if not self.anchors:
            return next(iter(w.values())).new_zeros(())

        def named(v: Tensor | Named) -> Named:  # flat [P] vectors assigned by hand
            return unflatten(net, v) if isinstance(v, Tensor) else v

        anchors = [named(a) for a in self.anchors]
        importances = [named(f) for f in self.importances]
        return ewc_penalty(w, anchors, importances, self.ewc_lambda)

    @torch.no_grad()
    def fisher_diagonal(self, net: nn.Module, x: Tensor, y: Tensor, task: int | None) -> Tensor:
        """Per-example-averaged Fisher diagonal ``[P]`` of ``(x, y)`` through head ``task``
        (eval mode)."""
        model = with_task(net, task)
        lik = self.likelihood
        was_training = net.training
        net.eval()
        try:
            with torch.enable_grad():
                if self.fisher == "sampled":
                    f = diag_fisher(
                        model,
                        (x, y),
                        lik,
                        n_samples=self.fisher_samples,
                        chunk_size=self.chunk_size,
                    )
                elif self.fisher == "empirical":
                    f = diag_ef(model, (x, y), lik, chunk_size=self.chunk_size)
                else:
                    f = diag_ggn(model, x, lik, chunk_size=self.chunk_size)
        finally:
            net.train(was_training)
        return f / len(x)

    def learn_task(self, net: nn.Module, x: Tensor, y: Tensor, task: int | None) -> None:
        """After training on task ``task`` with data ``x [N, ...]``, ``y [N]``: store the
        anchor ``w*`` and the Fisher (separate), or decay the running Fisher once and add
        the new one (online)."""
        check_batch(x, "x")
        if self.max_examples is not None and len(x) > self.max_examples:
            idx = torch.randperm(len(x))[: self.max_examples]
            x, y = x[idx], y[idx]
        device, _ = device_dtype(net)
        task = task if is_multitask(net) else None
        f = by_name(net, self.fisher_diagonal(net, x.to(device), y.to(device), task))
        w = by_name(net, _live(net))
        if self.mode == "separate":
            self.anchors.append(w)
            self.importances.append(f)
        else:
            prev = self.importances[0] if self.importances else {}
            decayed = {n: v * self.decay_factor for n, v in prev.items()}
            summed = {}
            for n, v in f.items():
                if n in decayed:
                    summed[n] = fit_shape(decayed[n], v.shape, 0.0) + v
                else:
                    summed[n] = v
            self.anchors = [w]
            self.importances = [{**decayed, **summed}]
        self.task_count += 1

    def _settings(self) -> dict:
        return {
            "mode": self.mode,
            "decay_factor": self.decay_factor,
            "fisher": self.fisher,
            "fisher_samples": self.fisher_samples,
            "likelihood": self.likelihood.name,
        }

    def state_dict(self) -> dict:
        """Anchors and importances (``{name: tensor}`` per task, on the CPU), the task
        counter and the settings."""
        return {
            "anchors": [{n: v.cpu().clone() for n, v in a.items()} for a in self.anchors],
            "importances": [{n: v.cpu().clone() for n, v in f.items()} for f in self.importances],
            "task_count": self.task_count,
            **self._settings(),
        }

    def load_state_dict(self, state: dict, net: nn.Module | None = None) -> None:
        """Restore what :meth:`state_dict` returned, on ``net``'s device (flat ``[P]``
        anchors and importances of older checkpoints are read in ``net``'s parameter
        order). Refuses a state saved with other settings."""
        missing = {"anchors", "importances", "task_count"} - set(state)
        if missing:
            raise ValueError(f"state is missing keys {sorted(missing)}")
        for key, value in self._settings().items():  # keys absent in older checkpoints
            if state.get(key, value) != value:
                raise ValueError(
                    f"state was saved with {key}={state[key]!r}, method has {value!r}: "
                    "resume with the settings of the run"
                )

        def load(items: list) -> list[Named]:
            out = []
            for d in items:
                if isinstance(d, Tensor):
                    if net is None:
                        raise ValueError("net is required to read flat [P] anchors")
                    d = unflatten(net, d)
                dev = None if net is None else device_dtype(net)[0]
                out.append({n: v.detach().clone().to(dev or v.device) for n, v in d.items()})
            return out

        self.anchors = load(state["anchors"])
        self.importances = load(state["importances"])
        self.task_count = int(state["task_count"])
