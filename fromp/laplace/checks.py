"""The checks of a fitted Laplace (:mod:`fromp.laplace.base` and its structures), run before
any work starts and before any state changes.

One function per entry point, each called in one line at its top:

* :func:`check_model` (construction, fit, predict): real weights on a real device, a
  float32 / float64 dtype, trainable parameters (the other arguments of the constructor are
  checked once each, by the setters of :class:`~fromp.laplace.base.BaseLaplace`);
* :func:`at_fit` (``fit``): the model in eval mode, the batches (:func:`groups`: tensors or
  mappings, a padded ``DistributedSampler``'s repeats dropped), the inputs of the model's
  dtype and shape, a model returning ``[N, C]``, and the targets for the likelihood
  (:meth:`fromp.likelihood.Likelihood.check_targets`: class indices in ``[0, C)``,
  Bernoulli labels in ``{0, 1}``, finite regression targets, no softmax over one output);
* :func:`at_predict` (``la(x)``, ``predictive_samples``, ``functional_variance``, the
  GP): a fit, the model in eval mode and of the fitted size, a non-empty finite ``x`` whose
  squares do not overflow, finite outputs;
* :func:`at_state_dict` (``state_dict``), :func:`at_load` (``load_state_dict``: a fit
  of a model of the same size);
* :func:`at_prior_search` (``optimize_prior_precision``): ``n_steps >= 1``,
  ``grid_size >= 1``, a scalar grid search, validation targets as at ``fit``.

The batches are materialised once (a one-shot iterator is not consumed by the check); the
functions that take data return the list the caller then uses.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils.data import DistributedSampler

from fromp._checks import check_batch, not_on_meta, require_eval

__all__ = [
    "at_fit",
    "at_load",
    "at_predict",
    "at_prior_search",
    "at_state_dict",
    "check_model",
    "finite_outputs",
    "groups",
    "model_dtype",
    "not_on_meta",
    "on_mapping",
]

_HALF = (torch.float16, torch.bfloat16)


def check_model(model: nn.Module) -> None:
    """``model`` has trainable parameters holding values (not on the ``meta`` device) in
    float32 or float64: the curvature's eigen- and Cholesky decompositions are not
    available in half precision, and a sum of ``N`` GGN terms in float16 / bfloat16 loses
    most digits, so half-precision models are refused (convert with ``model.float()``)."""
    params = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    if not params:
        raise ValueError(
            "model has no trainable parameters (every parameter has requires_grad=False): "
            "a Laplace posterior is over trainable weights"
        )
    not_on_meta(model)
    for name, p in params:
        if p.dtype in _HALF:
            raise ValueError(
                f"model parameter {name} is {p.dtype}: a Laplace posterior needs float32 or "
                "float64 weights (call model.float())"
            )


# ------------------------------------------------------------------------------ data


def model_dtype(model: nn.Module) -> torch.dtype:
    """The dtype of the model's first trainable parameter."""
    return next(p for p in model.parameters() if p.requires_grad).dtype


@contextmanager
def on_mapping(model: nn.Module, batch: Mapping | None, key_x: str = "input_ids") -> Iterator[Any]:
    """Within the block ``model(idx)`` is ``model(batch')``, ``batch'`` the mapping ``batch``
    with every tensor of its ``N = len(batch[key_x])`` examples indexed by ``idx``: a mapping
    batch (Hugging Face style, the model called on the whole mapping as laplace-torch calls
    it) becomes the input tensor ``arange(N)`` that every curvature, Jacobian and chunking
    path takes (slices, ``vmap`` over examples, ``functional_call``). ``batch`` None: nothing
    changes. Yields the index input ``[N]`` (None without a batch)."""
    if batch is None:
        yield None
        return
    n = len(batch[key_x])
    forward = model.forward

    def indexed(idx: Tensor, *args: Any, **kwargs: Any) -> Any:
        sub = {k: v[idx.to(v.device)] if isinstance(v, Tensor) and v.ndim and len(v) == n
               else v for k, v in batch.items()}  # fmt: skip
        return forward(sub, *args, **kwargs)

    had = "forward" in vars(model)
    model.forward = indexed  # type: ignore[method-assign]
    try:
        yield torch.arange(n, device=next(model.parameters()).device)
    finally:
        if had:
            model.forward = forward  # type: ignore[method-assign]
        else:
            del model.forward


def _split(la: Any, batch: Any, argument: str) -> tuple[Mapping | None, Any, Any]:
    """``(mapping, x, y)`` of one batch: a mapping (``x`` its index input
    :func:`on_mapping`, ``y`` its ``dict_key_y`` entry), ``x``, or ``(x, y, ...)``."""
    if isinstance(batch, Mapping):
        kx, ky = la.dict_key_x, la.dict_key_y
        if kx not in batch:
            raise ValueError(f"a mapping batch of {argument} lacks dict_key_x={kx!r} (keys: "
                             f"{list(batch)})")  # fmt: skip
        return batch, torch.arange(len(batch[kx])), batch.get(ky)
    if isinstance(batch, Tensor):
        return None, batch, None
    if isinstance(batch, tuple | list) and len(batch) > 0 and isinstance(batch[0], Tensor):
        return None, batch[0], (batch[1] if len(batch) > 1 else None)
    raise TypeError(f"{argument} batches must be x, (x, y) or mappings holding dict_key_x, got "
                    f"{type(batch).__name__}")  # fmt: skip


def _head(batch: Any, m: int, n: int) -> Any:
    """The first ``m`` of a batch's ``n`` examples."""
    cut = lambda v: v[:m] if isinstance(v, Tensor) and v.ndim and len(v) == n else v  # noqa: E731
    if isinstance(batch, Mapping):
        return {k: cut(v) for k, v in batch.items()}
    if isinstance(batch, Tensor):
        return batch[:m]
    return type(batch)(cut(v) for v in batch)


def _batches(data: Any, la: Any, argument: str = "train_loader") -> list[Any]:
    """``data``'s batches: one batch (a tensor, a tuple whose first entry is a tensor, a
    mapping) or an iterable of them. Over a padded ``DistributedSampler`` (``drop_last=False``
    and ``N`` not a multiple of the number of processes: it repeats examples to even the
    shards) the repeats, which end each process's stream, are dropped: every process then
    fits its share of the ``N`` examples once."""
    if isinstance(data, Tensor | Mapping):
        return [data]
    if isinstance(data, tuple) and len(data) > 0 and isinstance(data[0], Tensor):
        return [data]
    if data is None or isinstance(data, str) or not isinstance(data, Iterable):
        raise TypeError(f"{argument} must be a DataLoader, a list of batches or one batch, "
                        f"got {type(data).__name__}")  # fmt: skip
    batches = list(data)
    sampler = getattr(data, "sampler", None)
    if isinstance(sampler, DistributedSampler) and not sampler.drop_last:
        n_data = len(sampler.dataset)  # type: ignore[arg-type]
        keep = len(range(sampler.rank, n_data, sampler.num_replicas))
        if sampler.total_size != n_data:
            out, seen = [], 0
            for b in batches:
                m = len(_split(la, b, argument)[1])
                if seen < keep:
                    out.append(b if seen + m <= keep else _head(b, keep - seen, m))
                seen += m
            batches = out
    return batches


def _n_outputs(la: Any, x: Tensor, argument: str) -> int:
    """``C`` from one example's forward pass; refused, naming ``argument``, when ``x`` does
    not fit the model (its dtype, its shape) or the model does not return ``[N, C]``."""
    model = la.model
    dtype = model_dtype(model)
    if x.is_floating_point() and x.dtype != dtype:
        raise ValueError(f"{argument} is {x.dtype}, the model {dtype}: convert one (e.g. "
                         f"x.to({dtype}))")  # fmt: skip
    device = next(p for p in model.parameters()).device
    try:
        with torch.no_grad():
            f = model(x[:1].to(device))
    except (RuntimeError, IndexError, TypeError, KeyError) as err:
        raise ValueError(f"the model cannot be called on {argument} of shape "
                         f"{tuple(x.shape)}: {err}") from err  # fmt: skip
    if not isinstance(f, Tensor):
        raise ValueError(f"the model must return a [N, C] tensor, got a {type(f).__name__}; wrap "
                         "it (a module whose forward returns the logits tensor)")  # fmt: skip
    if f.ndim != 2:
        raise ValueError(f"the model must return a [N, C] tensor, got shape {tuple(f.shape)}")
    return f.shape[1]


def groups(la: Any, data: Any, argument: str) -> list[tuple[Any, list[Any]]]:
    """``data``'s batches (:func:`_batches`) as ``[(mapping or None, [(x, y), ...])]``
    (:func:`on_mapping`: one group per mapping batch, consecutive tensor batches in one
    group), every input and target checked: finite non-empty inputs of the model's dtype,
    targets valid for the likelihood (:meth:`fromp.likelihood.Likelihood.check_targets`), a
    model returning ``[N, C]``."""
    batches = _batches(data, la, argument)
    if not batches:
        raise ValueError(f"{argument} is empty: expected at least one batch")
    out: list[tuple[Any, list[Any]]] = []
    c = None
    for batch in batches:
        mapping, x, y = _split(la, batch, argument)
        if mapping is None:
            check_batch(x, f"{argument} input")
        elif len(x) == 0:
            raise ValueError(f"{argument} has an empty mapping batch")
        if y is not None and not isinstance(y, Tensor):
            raise TypeError(f"{argument} targets must be tensors, got {type(y).__name__}")
        if y is not None and len(y) != len(x):
            raise ValueError(f"{argument} batch has {len(x)} inputs and {len(y)} targets")
        if c is None or mapping is not None:
            what = (f"{argument} mapping batches (the model is called on the whole mapping, "
                    "as in laplace-torch)") if mapping is not None else f"{argument} x"  # fmt: skip
            with on_mapping(la.model, mapping, la.dict_key_x):
                c = _n_outputs(la, x, what)
        if y is not None:
            la.likelihood_fn.check_targets(y, c, f"{argument} targets y")
        if mapping is None and out and out[-1][0] is None:
            out[-1][1].append((x, y))
        else:
            out.append((mapping, [(x, y)]))
    return out


def at_fit(la: Any, data: Any) -> list[tuple[Any, list[Any]]]:
    """``fit``: the model (:func:`check_model`, eval mode) and the batches
    (:func:`groups`). Returns the groups."""
    model = la.model
    check_model(model)
    require_eval(model)
    return groups(la, data, "train_loader")


# ------------------------------------------------------------------------------ predict


def at_state_dict(la: Any) -> None:
    """A fit (or a loaded state) exists: ``ValueError`` "call fit(train_loader) first"."""
    if getattr(la, "H", None) is None:
        raise ValueError("call fit(train_loader) first")


def at_predict(la: Any, x: Any, outputs: bool = True, memory_budget: int | None = None) -> None:
    """A prediction at ``x``: a fit, the model in eval mode (dropout on would make the
    predictive random), the model still of the fitted size, ``x`` a non-empty ``[N, ...]``
    tensor with finite entries whose squared norm is finite in its dtype (the functional
    variance ``J Sigma J^T`` carries the squares of the inputs: ``|x| ~ 1e30`` overflows
    float32 to NaN), and finite outputs ``f(x)`` (``outputs=False``: the caller checks the
    outputs it computes anyway with :func:`finite_outputs`, saving a forward pass), by
    forward passes of as many inputs as ``memory_budget`` holds."""
    at_state_dict(la)
    model = la.model
    require_eval(model)
    check_model(model)
    x = check_batch(x, "x")
    _n_outputs(la, x, "x")  # x of the model's dtype and shape, outputs [N, C]
    if x.is_floating_point():
        big = float(torch.linalg.vector_norm(x.detach(), float("inf")))  # no [N, ...] copy
        limit = math.sqrt(torch.finfo(x.dtype).max / max(1, x[0].numel()))
        if big > limit:
            raise ValueError(
                f"x has entries too large (max |x| = {big:.3g}): their squares overflow "
                f"{x.dtype} in the functional variance (keep |x| below {limit:.3g}, e.g. "
                "normalise the inputs)"
            )
    if not hasattr(la, "_subset_size"):  # a GP Laplace: no weight subset to compare
        if outputs:
            _outputs(la, x, memory_budget)
        return
    n_fit = la.num_params
    try:
        n_now = la._subset_size()
    except ValueError as err:
        raise ValueError(f"the model changed since the fit: {err}") from None
    if n_now != n_fit:
        raise ValueError(
            f"the model has P={n_now} parameters in the subset, the posterior has {n_fit}: "
            "the model changed since the fit (fit again, or load the fitted model's weights)"
        )
    if outputs:
        _outputs(la, x, memory_budget)


def _outputs(la: Any, x: Tensor, memory_budget: int | None = None) -> None:
    """The model's outputs at ``x`` are finite, checked a chunk of inputs at a time (the
    memory of one chunk's forward pass, :meth:`~fromp.laplace.predictive.LaplaceTorchAPI.
    _forward_step`)."""
    device = next(p for p in la.model.parameters()).device
    x = x.to(device)
    step = la._forward_step(x, memory_budget) if hasattr(la, "_forward_step") else len(x)
    with torch.no_grad():
        for s in range(0, len(x), step):
            finite_outputs(la.model(x[s : s + step]))


def finite_outputs(f: Any) -> Any:
    """``f`` (the model's outputs at the predict inputs, or draws of them), refused when not
    finite: the predictive is undefined there."""
    if isinstance(f, Tensor) and not bool(torch.isfinite(f.detach()).all()):
        raise ValueError(
            "the model's outputs at x are not finite (NaN or inf: overflow); the predictive "
            "is undefined there"
        )
    return f


def at_load(la: Any, state: Any) -> None:
    """``load_state_dict``: a dict from :meth:`state_dict` whose fit has as many parameters
    as this model has in the subset (both sizes named)."""
    if not isinstance(state, dict):
        raise TypeError(f"state must be a dict from state_dict(), got {type(state).__name__}")
    missing = [k for k in ("parameter_names", "mean", "H") if k not in state]
    if missing:
        raise ValueError(f"state is missing {missing}: expected a dict from state_dict()")
    if la.subset_of_weights == "subnetwork":
        return  # the subnetwork's indices and tensors are compared by its own loader
    params = dict(la.model.named_parameters())
    names = list(state["parameter_names"])
    absent = [n for n in names if n not in params]
    if absent:
        raise ValueError(
            f"state is over parameters {absent[:3]} that this model does not have (it was "
            "fitted on another model)"
        )
    p_model = sum(params[n].numel() for n in names)
    p_state = int(state["mean"].numel())
    if p_model != p_state:
        raise ValueError(
            f"state was fitted on a model with P={p_state} parameters in the subset, this "
            f"model has P={p_model} (another width?)"
        )


# ------------------------------------------------------------------------------ prior search


def _positive_int(value: Any, name: str) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive int, got {value!r}")


def at_prior_search(
    la: Any,
    method: str,
    prior_structure: Any,
    n_steps: Any,
    grid_size: Any,
    val_loader: Any,
) -> Any:
    """``optimize_prior_precision``: ``n_steps >= 1`` (``"marglik"``); for
    ``"gridsearch"``, ``grid_size >= 1``, a scalar prior structure (the grid is over one
    ``delta``) and validation targets valid for the likelihood. Returns the validation
    batches as :func:`groups` (None for ``"marglik"``)."""
    if method == "marglik":
        _positive_int(n_steps, "n_steps")
        return None
    if method != "gridsearch":
        raise ValueError(f"method must be 'marglik' or 'gridsearch', got {method!r}")
    _positive_int(grid_size, "grid_size")
    if prior_structure not in (None, "scalar"):
        raise ValueError(
            f"method='gridsearch' searches one scalar prior precision; prior_structure="
            f"{prior_structure!r} needs method='marglik'"
        )
    if val_loader is None:
        raise ValueError("method='gridsearch' needs val_loader (validation data (x, y))")
    out = groups(la, val_loader, "val_loader")
    if any(y is None for _, batches in out for _, y in batches):
        raise ValueError("val_loader batches must include targets (x, y)")
    return out
