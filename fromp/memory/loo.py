r"""Leave-one-out as a training tool: closed-form last-layer estimates, a per-epoch tracker
and the removal of a set of examples (a whole class).

* :func:`last_layer_loo`: the full-covariance last-layer Laplace-GGN ``(G + delta I)^{-1}``
  of ``f = W phi + b`` from the features, and the leave-one-out outputs
  ``f + V (I - Lambda V)^{-1} e`` (the exact Newton step of the output layer);
* :class:`LOOTracker`: the leave-one-out NLL and accuracy after each epoch of a plain
  PyTorch loop, from IVON's or VOGN's own posterior, or a last-layer Laplace for Adam/SGD
  (``fromp_avalanche.loo.LOOPlugin`` calls it from Avalanche);
* :func:`last_layer_remove`: the outputs after removing a set of examples, by Newton's
  method on the output layer (its first step is the memory-perturbation step).

The memory-perturbation quantities themselves are in :mod:`fromp.memory.sensitivity`.
"""

from __future__ import annotations

import inspect
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from fromp._checks import (
    check_batch,
    check_chunk_size,
    check_prior_precision,
    check_tensor,
)
from fromp.curvature.last_layer import (
    LastLinearRecord,
    augment_features,
    last_layer_features,
    last_layer_ggn,
    record_last_linear,
)
from fromp.likelihood import CategoricalLikelihood, Likelihood, get_likelihood
from fromp.memory.sensitivity import (
    MemoryPerturbation,
    _check_examples,
    check_loo_targets,
    memory_perturbation,
)

__all__ = [
    "LOOTracker",
    "LastLayerLOO",
    "last_layer_features",
    "last_layer_ggn",
    "last_layer_loo",
    "last_layer_remove",
]


@dataclass
class LastLayerLOO:
    """A full-covariance last-layer Laplace posterior and its leave-one-out estimates.

    Attributes:
        perturbation: the :class:`MemoryPerturbation` of the examples (``loo_logits`` the
            one-step leave-one-out outputs with the example's own curvature removed,
            ``f + V (I - Lambda V)^{-1} e``: the exact Newton step of the head).
        precision: ``G + delta I`` ``[C D1, C D1]`` over ``vec([W | b])`` (float64).
        prior_precision: ``delta``.
        n_fit: examples in the GGN.
    """

    perturbation: MemoryPerturbation
    precision: Tensor
    prior_precision: float
    n_fit: int

    def summary(self) -> dict[str, Any]:
        """:meth:`MemoryPerturbation.loo_summary` plus ``posterior``, ``prior_precision``
        and ``n_fit``."""
        out: dict[str, Any] = {"posterior": "last-layer full Laplace-GGN"}
        out |= {"prior_precision": self.prior_precision, "n_fit": self.n_fit}
        return out | self.perturbation.loo_summary()


def last_layer_loo(
    model: nn.Module,
    x: Tensor,
    y: Tensor,
    prior_precision: float,
    likelihood: str | Likelihood = "categorical",
    *,
    chunk_size: int = 256,
) -> LastLayerLOO:
    r"""Leave-one-out estimates of every example of ``(x, y)`` under a full-covariance
    Laplace-GGN posterior over the output layer, fitted on exactly ``(x, y)``.

    With features ``phi~_n`` ``[D1]`` (:func:`last_layer_features`, a trailing 1 for a
    bias), ``J_n = I_C (x) phi~_n^T``, precision ``H = sum_n Lambda_n (x) phi~_n phi~_n^T +
    delta I`` (:func:`last_layer_ggn`) and ``Sigma = H^{-1}``, the prediction covariance is
    ``V_n[c, k] = phi~_n^T Sigma[c, :, k, :] phi~_n`` and the leave-one-out outputs are

        ``f_n^{\n} = f_n + V_n (I - Lambda_n V_n)^{-1} e_n``,

    one exact Newton step of the head's training objective without example ``n`` (exact for a
    Gaussian likelihood: the classical ``e_n / (1 - h_nn)``). The features are held fixed, so
    this is the leave-one-out of retraining the head alone. ``delta`` should be the prior
    precision (weight decay times ``N`` for a mean-reduced loss) the network was trained
    with; too small a ``delta`` with few examples per feature makes ``H`` ill-conditioned.

    Cost: one forward pass, ``O(N C^2 D1^2)`` for ``G`` and ``V``, one Cholesky of
    ``C D1 x C D1`` (full by definition: the last layer is small).

    Args:
        model: ``[N, ...] -> [N, C]`` in eval mode, ending in an ``nn.Linear``.
        x: ``[N, ...]`` the training examples. y: ``[N]`` targets.
        prior_precision: ``delta > 0``.
        likelihood: its name or a :class:`~fromp.likelihood.Likelihood`.
        chunk_size: examples per chunk of the ``V_n`` computation.
    """
    _check_examples(x, y)
    check_prior_precision(prior_precision)
    chunk_size = check_chunk_size(chunk_size, allow_none=False)
    lik = get_likelihood(likelihood)
    phi, head = last_layer_features(model, x)
    check_loo_targets(y, head.out_features, lik)
    return _full_loo(phi, head, y, float(prior_precision), lik, chunk_size)


def _full_loo(
    phi: Tensor, head: nn.Linear, y: Tensor, prior_precision: float, lik: Likelihood,
    chunk_size: int = 256, fit_phi: Tensor | None = None,
) -> LastLayerLOO:  # fmt: skip
    """:func:`last_layer_loo` from the features ``phi`` ``[N, D]`` of the head; the GGN from
    ``fit_phi`` ``[N', D]`` when given (else from ``phi``)."""
    with torch.no_grad():
        f = head(phi)
    dtype = f.dtype
    # float64 inside: softmax's Lambda is singular along the sum of the logits, so with a
    # small delta the precision is too ill-conditioned for a float32 Cholesky
    phi, f = augment_features(phi, head.bias is not None).double(), f.double()
    fit, f_fit = _fit_set(head, phi, f, fit_phi)
    y = y.to(f.device)
    c, d1 = f.shape[1], phi.shape[1]
    eye = torch.eye(c * d1, dtype=phi.dtype, device=phi.device)
    precision = last_layer_ggn(fit, f_fit, lik) + prior_precision * eye
    chol = torch.linalg.cholesky(precision)
    sigma = torch.cholesky_inverse(chol).reshape(c, d1, c * d1).permute(1, 0, 2)
    sigma = sigma.reshape(d1, c * c * d1)  # [D1, C C D1]: V_n[c, k] = phi~_n^T Sigma_ck phi~_n
    cov = torch.cat(
        [
            ((p @ sigma).view(len(p), c, c, d1) * p[:, None, None, :]).sum(-1)
            for p in phi.split(chunk_size)
        ]
    )
    mp = _corrected_loo(f, y, cov, lik, dtype)
    return LastLayerLOO(mp, precision, float(prior_precision), len(fit))


def _fit_set(
    head: nn.Linear, phi: Tensor, f: Tensor, fit_phi: Tensor | None
) -> tuple[Tensor, Tensor]:
    """The (augmented, float64) features and outputs the curvature is summed over."""
    if fit_phi is None:
        return phi, f
    with torch.no_grad():
        f_fit = head(fit_phi.to(head.weight)).double()
    return augment_features(fit_phi, head.bias is not None).double(), f_fit


def _kron_loo(
    phi: Tensor,
    head: nn.Linear,
    y: Tensor,
    prior_precision: float,
    lik: Likelihood,
    fit_phi: Tensor | None = None,
) -> MemoryPerturbation:
    r"""Leave-one-out under a Kronecker (KFAC) last-layer Laplace-GGN: precision
    ``B (x) A + delta I`` with ``B = sum_n Lambda_n`` ``[C, C]`` and ``A = (1/N) sum_n phi~_n
    phi~_n^T`` ``[D1, D1]`` (fromp's KFAC convention, :mod:`fromp.curvature.kron`). With ``B = Q_b
    diag(b) Q_b^T`` and ``A = Q_a diag(a) Q_a^T``, the prediction covariance is

        ``V_n = Q_b diag_k(sum_j (Q_a^T phi~_n)_j^2 / (b_k a_j + delta)) Q_b^T``,

    ``O(N D1^2 + N C^2)`` in all: no ``C D1 x C D1`` matrix, so it stays cheap for wide
    features and many classes. The factors are summed over ``fit_phi`` ``[N', D]`` when
    given (else over ``phi``)."""
    with torch.no_grad():
        f = head(phi)
        f_fit = f if fit_phi is None else head(fit_phi.to(head.weight))
    dtype = f.dtype
    bias = head.bias is not None
    phi = augment_features(phi.detach(), bias)
    fit = phi if fit_phi is None else fit_phi.detach().to(phi)
    f = f.double()
    y = y.to(f.device)
    b, qb = torch.linalg.eigh(_hessian_sum(lik, f_fit))
    a, qa = torch.linalg.eigh(_second_moment(fit, bias and fit_phi is not None))
    b, a = b.clamp_min(0), a.clamp_min(0)
    w = 1.0 / (b[:, None] * a[None, :] + prior_precision)  # [C, D1]
    m = (phi @ qa.to(phi)).double().pow(2) @ w.T  # [N, C] in B's eigenbasis
    cov = torch.einsum("ck,nk,dk->ncd", qb, m, qb)
    return _corrected_loo(f, y, cov, lik, dtype)


def _hessian_sum(lik: Likelihood, f: Tensor) -> Tensor:
    """``sum_n Lambda(f_n)`` ``[C, C]`` (float64) from the outputs ``f`` ``[N, C]``; for a
    softmax ``diag(sum_n p_n) - P^T P`` (``P`` ``[N, C]`` the probabilities, in ``f``'s
    precision, the ``C x C`` sums accumulated by BLAS), without the ``[N, C, C]`` Hessians."""
    if isinstance(lik, CategoricalLikelihood):
        # exp / sum by hand: torch.softmax over a short last dimension (C = 10) is several
        # times slower on a CPU than these three vectorised passes
        p = (f - f.amax(-1, keepdim=True)).exp()
        p = p / p.sum(-1, keepdim=True)
        return torch.diag(p.sum(0).double()) - (p.T @ p).double()
    return lik.hessian(f.double()).sum(0)


def _second_moment(phi: Tensor, augment: bool) -> Tensor:
    """``(1/N) sum_n phi~_n phi~_n^T`` (float64) of the features ``phi`` ``[N, D]``, with
    ``phi~ = [phi, 1]`` if ``augment`` (assembled from ``phi^T phi`` and ``sum_n phi_n``
    without copying ``phi``), else of ``phi`` as given."""
    n = len(phi)
    gram = (phi.T @ phi).double()
    if not augment:
        return gram / n
    s = phi.sum(0).double()[:, None]
    one = gram.new_full((1, 1), float(n))
    return torch.cat([torch.cat([gram, s], 1), torch.cat([s.T, one], 1)]) / n


def _corrected_loo(f: Tensor, y: Tensor, cov: Tensor, lik: Likelihood, dtype: torch.dtype):
    """:class:`MemoryPerturbation` with ``loo_logits = f + V (I - Lambda V)^{-1} e`` from the
    outputs ``f`` ``[N, C]`` and prediction covariances ``V`` ``[N, C, C]``; tensors returned
    in ``dtype``."""
    with torch.enable_grad():
        fr = f.detach().requires_grad_(True)
        error = torch.autograd.grad(lik.nll(fr, y).sum(), fr)[0]
    big_lam = lik.hessian(f)
    lam = torch.diagonal(big_lam, dim1=-2, dim2=-1)
    eye_c = torch.eye(f.shape[1], dtype=f.dtype, device=f.device)
    rhs = torch.linalg.solve(eye_c - big_lam @ cov, error.unsqueeze(-1)).squeeze(-1)
    var = torch.diagonal(cov, dim1=-2, dim2=-1).clone()
    loo = f + torch.einsum("ncd,nd->nc", cov, rhs)
    return MemoryPerturbation(
        logits=f.to(dtype),
        targets=y.to(dtype) if y.is_floating_point() else y,
        error=error.to(dtype),
        lam=lam.to(dtype),
        variance=var.to(dtype),
        covariance=cov.to(dtype),
        sensitivity=(error * lam * var).abs().sum(-1).to(dtype),
        loo_logits=loo.to(dtype),
        likelihood=lik,
    )


def _head_slices(model: nn.Module, head: nn.Linear) -> tuple[slice, slice | None]:
    """Positions of ``head.weight`` and ``head.bias`` in the flat trainable parameters."""
    where: dict[int, slice] = {}
    i = 0
    for p in model.parameters():
        if p.requires_grad:
            where[id(p)] = slice(i, i + p.numel())
            i += p.numel()
    if id(head.weight) not in where:
        raise ValueError("model's output layer must be trainable for a last-layer posterior")
    return where[id(head.weight)], where.get(id(head.bias)) if head.bias is not None else None


def _diagonal_last_layer_loo(
    model: nn.Module, posterior: Any, phi: Tensor, head: nn.Linear, y: Tensor, lik: Likelihood
) -> MemoryPerturbation:
    """Leave-one-out from a diagonal posterior (IVON, VOGN) restricted to the output layer,
    from the head's features ``phi``: ``V_n = diag_c(sum_d phi~_nd^2 s_cd)`` with ``s`` the
    head's posterior variances (exact: ``J_n = I_C (x) phi~_n^T`` and a diagonal ``Sigma``
    give a diagonal ``V_n``)."""
    sw, sb = _head_slices(model, head)
    mean, var = posterior.mean.detach(), posterior.variance.detach()
    if mean.numel() != sum(p.numel() for p in model.parameters() if p.requires_grad) or (
        not torch.equal(mean[sw].view_as(head.weight).to(head.weight), head.weight.detach())
    ):
        raise ValueError(
            "optimizer's posterior must be over the model's trainable parameters in "
            "model.parameters() order, with its mean in the model (not a sampled draw)"
        )
    with torch.no_grad():
        f = head(phi)
    dtype = f.dtype
    phi, f = phi.double(), f.double()
    s_w = var[sw].view_as(head.weight).double()  # [C, D]
    v = phi.pow(2) @ s_w.T  # [N, C]
    if sb is not None:
        v = v + var[sb].double()
    return _corrected_loo(f, y.to(f.device), torch.diag_embed(v), lik, dtype)


class LOOTracker:
    r"""Leave-one-out estimates of the training set after each epoch of training, a
    generalisation estimate computed without a validation set.

    Call it after an epoch with the model, the training examples and the optimizer::

        tracker = LOOTracker(prior_precision=1e-4 * len(x))   # or weight decay from Adam
        for epoch in range(epochs):
            train_one_epoch(model, opt)
            tracker(model, x, y, opt)          # -> {"loo_nll": ..., "loo_accuracy": ...}
        tracker.history                        # one record per call

    Posterior, by optimizer:

    * an optimizer with its own posterior (:class:`fromp.optim.IVON`,
      :class:`fromp.optim.VOGN`): its diagonal Gaussian, restricted to the output layer
      (``subset_of_weights="last_layer"``, cost one forward pass) or over all weights
      (``subset_of_weights="all"``, :func:`memory_perturbation`, ``C`` backward passes per
      example);
    * any other (Adam, SGD) or none: a full-covariance last-layer Laplace-GGN refitted at each
      call (:func:`last_layer_loo`) with ``prior_precision``, by default the optimizer's
      ``weight_decay`` times ``N`` (the prior precision of the summed objective that a
      mean-reduced loss with weight decay optimises).

    Leave-one-out outputs ``f + V (I - Lambda V)^{-1} e``. Cost: one forward pass over ``x``
    plus ``O(N C^2 D1^2 + (C D1)^3)`` for the full last-layer Laplace, ``O(N D1^2 + N C^2)``
    for ``hessian_structure="kron"``;
    ``max_examples`` caps ``N`` by a fixed random subset (the posterior is then fitted on the
    subset, which makes it wider: the estimate is pessimistic).

    **Free during training.** Inside ``with tracker.recording(model):`` every forward pass
    records the inputs ``phi`` of the output layer; ``tracker.observe(y)`` after each pass
    pairs them with that batch's targets, and ``tracker(model, optimizer=opt)`` (no ``x``)
    estimates from what the epoch recorded, with the output layer's current weights: no
    extra forward pass. The features are those of the training passes (their weights, their
    dropout masks; IVON's sampled weights), the price of not evaluating again. Between the
    two: ``tracker(model, x_sub, y_sub, opt)`` after a recorded epoch sums the Laplace
    curvature over all recorded passes and estimates on a fresh pass over a subset
    (``max_examples``), which keeps the posterior of all ``N`` examples::

        tracker = LOOTracker(hessian_structure="kron")
        for epoch in range(epochs):
            with tracker.recording(model):
                for xb, yb in loader:
                    loss = F.cross_entropy(model(xb), yb)
                    tracker.observe(yb)
                    ...
            tracker(model, optimizer=opt, epoch=epoch)

    Args:
        likelihood: its name or a :class:`~fromp.likelihood.Likelihood`.
        prior_precision: ``delta`` of the last-layer Laplace (None: the optimizer's weight
            decay times ``N``; an error if there is none).
        subset_of_weights: ``"last_layer"`` or ``"all"``, for an optimizer's own posterior
            (the names of :func:`fromp.Laplace`).
        hessian_structure: the last-layer Laplace for Adam/SGD: ``"full"`` (exact GGN) or
            ``"kron"`` (KFAC, ``B (x) A``: cheap for wide features and many classes).
        max_examples: use at most this many training examples (None: all).
        seed: of the subset.
    """

    def __init__(
        self,
        likelihood: str | Likelihood = "categorical",
        *,
        prior_precision: float | None = None,
        subset_of_weights: str = "last_layer",
        hessian_structure: str = "full",
        max_examples: int | None = None,
        seed: int = 0,
    ) -> None:
        if subset_of_weights not in ("last_layer", "all"):
            raise ValueError(
                f"subset_of_weights must be 'last_layer' or 'all', got {subset_of_weights!r}"
            )
        if hessian_structure not in ("full", "kron"):
            raise ValueError(
                f"hessian_structure must be 'full' or 'kron', got {hessian_structure!r}"
            )
        if prior_precision is not None:
            check_prior_precision(prior_precision)
        if max_examples is not None and (
            isinstance(max_examples, bool) or not isinstance(max_examples, int) or max_examples < 1
        ):
            raise ValueError(f"max_examples must be an int >= 1 or None, got {max_examples!r}")
        self.likelihood = get_likelihood(likelihood)
        self.prior_precision = prior_precision
        self.subset_of_weights = subset_of_weights
        self.hessian_structure = hessian_structure
        self.max_examples = max_examples
        self.seed = seed
        self.history: list[dict[str, Any]] = []
        self._record: LastLinearRecord | None = None  # inside recording(): the last Linear
        self._recorded: list[tuple[Tensor, Tensor]] = []  # (phi, y) of observed passes
        self._head: nn.Linear | None = None

    @contextmanager
    def recording(self, model: nn.Module) -> Iterator[LOOTracker]:
        """Record the output layer's inputs of every forward pass of ``model`` inside the
        block (a hook on each ``nn.Linear``: the last one called in a pass is the head);
        pair each pass with its targets by :meth:`observe`. Hooks are removed on exit."""

        try:
            with record_last_linear(model) as self._record:
                yield self
        finally:
            self._record = None

    def observe(self, y: Tensor) -> None:
        """Pair the forward pass just made inside :meth:`recording` with its targets
        ``y`` ``[B]`` (the features are stored detached: ``B x D`` numbers per pass)."""
        rec = self._record
        if rec is None or rec.head is None or rec.phi is None:
            raise RuntimeError(
                "observe(y) needs a forward pass of the model inside tracker.recording(model)"
            )
        head, phi = rec.head, rec.phi.detach().reshape(len(rec.phi), -1)
        if len(phi) != len(y):
            raise ValueError(f"y must have the batch's {len(phi)} targets, got {len(y)}")
        if self._head is not None and head is not self._head:
            raise ValueError("the output layer changed between recorded forward passes")
        self._head = head
        self._recorded.append((phi, y.detach()))
        rec.clear()

    def _delta(self, optimizer: Any, n: int) -> tuple[float, str]:
        if self.prior_precision is not None:
            return float(self.prior_precision), "given"
        groups = getattr(optimizer, "param_groups", None) or []
        decoupled = isinstance(optimizer, torch.optim.AdamW) or any(
            g.get("decoupled_weight_decay", False) for g in groups
        )
        if decoupled and any(float(g.get("weight_decay", 0.0)) > 0 for g in groups):
            raise ValueError(
                f"{type(optimizer).__name__}'s weight_decay is decoupled (w <- w - lr wd w "
                "beside the adaptive step), not an L2 prior on the loss, so it gives no "
                "prior precision: pass LOOTracker(prior_precision=...)"
            )
        wd = {float(g.get("weight_decay", 0.0)) for g in groups}
        if len(wd) == 1 and (w := wd.pop()) > 0:
            return w * n, "optimizer weight_decay x N"
        raise ValueError(
            "prior_precision is needed: the optimizer has no (single, positive) weight_decay "
            "to derive it from; pass LOOTracker(prior_precision=...)"
        )

    def __call__(
        self,
        model: nn.Module,
        x: Tensor | None = None,
        y: Tensor | None = None,
        optimizer: Any = None,
        *,
        epoch: int | None = None,
    ) -> dict[str, Any]:
        """Estimate, append to :attr:`history` and return ``{"epoch", "posterior",
        "prior_precision", "n", "loo_nll", "train_nll", "loo_accuracy", "train_accuracy",
        "seconds", "features"}`` (accuracies for classification). Without ``x`` and ``y``:
        from the passes recorded since the last call (:meth:`recording`), which are then
        cleared. ``model`` is put in eval mode for the estimate and restored after."""
        start = time.perf_counter()
        recorded = x is None
        if recorded:
            if y is not None:
                raise ValueError("pass both x and y, or neither (to use the recorded passes)")
            if not self._recorded or self._head is None:
                raise ValueError(
                    "no x given and nothing recorded: call tracker(model, x, y, ...), or train "
                    "inside tracker.recording(model) with tracker.observe(y) after each pass"
                )
            phi = torch.cat([p for p, _ in self._recorded])
            y = torch.cat([t.to(phi.device) for _, t in self._recorded])
            # the next recording may use another head (multi-head models: the next task's)
            head, self._recorded, self._head = self._head, [], None
        else:
            if y is None:
                raise ValueError("y is required with x (or pass neither: the recorded passes)")
            _check_examples(x, y)
        fit_phi = None
        if not recorded and self._recorded:  # passes recorded: the curvature from them
            fit_phi = torch.cat([p for p, _ in self._recorded])
            self._recorded, self._head = [], None
        n = len(y)
        keep = None
        if self.max_examples is not None and n > self.max_examples:
            gen = torch.Generator().manual_seed(self.seed)
            keep = torch.randperm(n, generator=gen)[: self.max_examples]
            y = y[keep.to(y.device)]
            if recorded:
                phi = phi[keep.to(phi.device)]
            else:
                x = x[keep.to(x.device)]
        was_training = model.training
        model.eval()
        try:
            own = getattr(optimizer, "posterior", None)
            if not (
                callable(own) and self.subset_of_weights == "all"
            ):  # else memory_perturbation's
                if not recorded:
                    phi, head = last_layer_features(model, x)
                check_loo_targets(y, head.out_features, self.likelihood)
            if callable(own):
                q = own(model) if "model" in inspect.signature(own).parameters else own()
                name = f"{type(optimizer).__name__} posterior ({self.subset_of_weights})"
                delta: float | None = None
                if self.subset_of_weights == "all":
                    if recorded:
                        raise ValueError(
                            "subset_of_weights='all' needs x and y (recorded passes hold the "
                            "output layer's inputs only)"
                        )
                    mp = memory_perturbation(
                        model, q, x, y, self.likelihood, covariance="full", correction=True
                    )
                else:
                    mp = _diagonal_last_layer_loo(model, q, phi, head, y, self.likelihood)
            else:
                n_fit = len(y) if fit_phi is None else len(fit_phi)
                delta, how = self._delta(optimizer, n_fit)
                name = f"last-layer {self.hessian_structure} Laplace-GGN (delta: {how})"
                if self.hessian_structure == "kron":
                    mp = _kron_loo(phi, head, y, delta, self.likelihood, fit_phi)
                else:
                    mp = _full_loo(phi, head, y, delta, self.likelihood, fit_phi=fit_phi)
                    mp = mp.perturbation
        finally:
            model.train(was_training)
        record: dict[str, Any] = {
            "epoch": len(self.history) if epoch is None else epoch,
            "posterior": name,
            "prior_precision": delta,
            "n": len(y),
            "features": "recorded training passes" if recorded else "one evaluation pass",
            "curvature_examples": len(y) if fit_phi is None else len(fit_phi),
            **mp.loo_summary(),
            "seconds": time.perf_counter() - start,
        }
        self.history.append(record)
        return record


def last_layer_remove(
    model: nn.Module,
    x: Tensor,
    y: Tensor,
    remove: Tensor,
    prior_precision: float,
    x_eval: Tensor,
    likelihood: str | Likelihood = "categorical",
    *,
    steps: int | None = None,
    tol: float = 1e-10,
) -> tuple[Tensor, Tensor]:
    r"""Outputs at ``x_eval`` before and after removing the examples ``remove`` from the
    training set, by Newton's method on the output layer (features held fixed).

    With the head ``theta = vec([W | b])`` ``[C D1]``, ``J_n = I_C (x) phi~_n^T``, ``S`` the
    removed set and ``K`` the kept one, the head's objective without ``S`` is

        ``F(theta) = sum_{n in K} nll(J_n theta, y_n) + delta/2 |theta|^2 - r^T theta``,

    where ``r = grad [sum_n nll + delta/2 |theta|^2]`` at the trained head ``theta*`` is what
    training left of the full objective's gradient (zero at its optimum): subtracting it makes
    ``theta*`` the exact optimum of the full objective, so the move measures the removal of
    ``S`` alone, not unfinished training. ``F`` is convex (strictly, ``delta > 0``); Newton's
    method from ``theta*`` with step ``(H_K + delta I)^{-1} grad F`` (``H_K = sum_{n in K}
    J_n^T Lambda_n J_n``, :func:`last_layer_ggn`, the exact Hessian for a canonical link) and
    a backtracking line search on ``F`` converges to its minimiser. Its first step is the
    memory-perturbation step ``d theta = (H_K + delta I)^{-1} g_S``, ``g_S = sum_{i in S}
    J_i^T e_i`` (``steps=1``; exact for a Gaussian likelihood). Removing a whole class is a
    large move on which one step overshoots (the logits of the removed class fall far, where
    ``Lambda`` has changed); the iterated steps follow the curvature along the way.

    Cost: per step one ``C D1 x C D1`` GGN over the kept examples and one Cholesky solve;
    10 steps on the MNIST study (``benchmarks/studies/loo_class_out.py``).

    Args:
        model: ``[N, ...] -> [N, C]`` in eval mode, ending in an ``nn.Linear``.
        x: ``[N, ...]`` the training examples. y: ``[N]`` targets.
        remove: ``[N]`` bool, the examples removed (e.g. ``y == c``: a whole class).
        prior_precision: ``delta > 0``.
        x_eval: ``[M, ...]`` where to evaluate.
        likelihood: its name or a :class:`~fromp.likelihood.Likelihood`.
        steps: Newton steps (None: until the Newton decrement ``grad F^T d theta / 2`` is
            below ``tol``, at most 100; 1: the one-step memory-perturbation estimate).
        tol: the stopping Newton decrement.

    Returns:
        ``(f_eval [M, C], f_eval_after [M, C])``.
    """
    _check_examples(x, y)
    check_tensor(remove, "remove", f"[N]=[{len(x)}] bool")
    if remove.dtype != torch.bool or remove.shape != (len(x),):
        raise ValueError(
            f"remove must be a bool tensor of shape [{len(x)}], got {remove.dtype} "
            f"{tuple(remove.shape)}"
        )
    check_prior_precision(prior_precision)
    if steps is not None and steps < 1:
        raise ValueError(f"steps must be >= 1 or None, got {steps}")
    check_batch(x_eval, "x_eval")
    lik = get_likelihood(likelihood)
    phi, head = last_layer_features(model, x)
    phi_e, _ = last_layer_features(model, x_eval)
    bias = head.bias is not None
    theta0 = head.weight.detach().double()
    if bias:
        theta0 = torch.cat([theta0, head.bias.detach().double()[:, None]], 1)  # [C, D1]
    phi, phi_e = augment_features(phi, bias).double(), augment_features(phi_e, bias).double()
    remove = remove.to(phi.device)
    y = y.to(phi.device)
    keep = ~remove
    delta = float(prior_precision)

    def objective(theta: Tensor, rows: Tensor) -> tuple[Tensor, Tensor]:
        """``sum_{rows} nll + delta/2 |theta|^2`` and its gradient ``[C, D1]``."""
        with torch.enable_grad():
            th = theta.detach().requires_grad_(True)
            val = lik.nll(phi[rows] @ th.T, y[rows]).sum() + 0.5 * delta * th.pow(2).sum()
            return val.detach(), torch.autograd.grad(val, th)[0]

    everything = torch.ones_like(keep)
    _, residual = objective(theta0, everything)  # r: zero at the full objective's optimum

    def f_obj(theta: Tensor) -> tuple[Tensor, Tensor]:
        val, grad = objective(theta, keep)
        return val - (residual * theta).sum(), grad - residual

    theta = theta0
    value, grad = f_obj(theta)
    eye = torch.eye(theta.numel(), dtype=phi.dtype, device=phi.device)
    for _ in range(steps or 100):
        hess = last_layer_ggn(phi[keep], phi[keep] @ theta.T, lik) + delta * eye
        move = torch.linalg.solve(hess, grad.reshape(-1)).reshape_as(theta)
        decrement = 0.5 * float((grad * move).sum())
        if steps is None and decrement < tol:
            break
        t = 1.0
        if steps != 1:  # backtracking (Armijo) line search on the convex F
            for _ in range(30):
                new_value, _ = f_obj(theta - t * move)
                if new_value <= value - 0.25 * t * 2 * decrement:
                    break
                t *= 0.5
        theta = theta - t * move
        value, grad = f_obj(theta)
    dtype = x_eval.dtype if x_eval.is_floating_point() else phi_e.dtype
    return (phi_e @ theta0.T).to(dtype), (phi_e @ theta.T).to(dtype)
