"""The checks of a fitted Laplace (:mod:`fromp.laplace.base` and its structures), run before
any work starts and before any state changes.

One function per entry point, each called in one line at its top:

* :func:`at_init` (construction): the model (real weights on a real device, a
  float32 / float64 dtype, trainable parameters), a finite positive ``temperature``, a finite
  ``prior_mean`` and, for ``"kron"``, a prior precision constant on each parameter tensor;
* :func:`at_fit` (``fit``): the model in eval mode, the batches' inputs, and the
  targets for the likelihood (:meth:`fromp.likelihood.Likelihood.check_targets`: class
  indices in ``[0, C)``, Bernoulli labels in ``{0, 1}``, finite regression targets, no
  softmax over one output); a last layer with no trainable parameter;
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
from collections.abc import Iterable
from typing import Any

import torch
from torch import Tensor, nn

from fromp._checks import check_batch, check_prior_precision, not_on_meta, require_eval
from fromp.curvature.last_layer import last_linear

__all__ = [
    "at_fit",
    "at_init",
    "at_load",
    "at_predict",
    "at_prior_search",
    "at_state_dict",
    "check_model",
    "not_on_meta",
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


def _finite_number(value: Any, name: str) -> None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return  # the constructor's own type check names it
    if not math.isfinite(value):
        raise ValueError(f"{name} must be finite, got {value!r}")


def _kron_prior(prior_precision: Any, sizes: list[int]) -> None:
    """A ``[P]`` prior precision must be constant on each parameter tensor for ``"kron"``."""
    if not isinstance(prior_precision, Tensor) or prior_precision.ndim != 1:
        return
    if len(prior_precision) != sum(sizes) or len(prior_precision) == len(sizes):
        return
    k = 0
    for size in sizes:
        block = prior_precision[k : k + size]
        if not bool((block == block[0]).all()):
            raise ValueError(
                "hessian_structure='kron' needs prior_precision constant on each parameter "
                "tensor (a scalar or [n_layers]); got a [P] tensor that varies inside one"
            )
        k += size


def at_init(
    la: Any,
    model: nn.Module,
    subset_of_weights: str,
    temperature: Any,
    prior_precision: Any,
    prior_mean: Any,
) -> None:
    """Construction: the model (:func:`check_model`), ``temperature`` finite (``inf`` makes
    every evidence ``log p(D | w*) = 0``), ``prior_mean`` finite, and for the all-weights
    ``"kron"`` structure a per-parameter ``prior_precision`` constant on each tensor."""
    check_model(model)
    _finite_number(temperature, "temperature")
    if isinstance(prior_mean, int | float) and not isinstance(prior_mean, bool):
        _finite_number(prior_mean, "prior_mean")
    if isinstance(prior_mean, Tensor) and prior_mean.is_floating_point():
        if not bool(torch.isfinite(prior_mean).all()):
            raise ValueError("prior_mean is not finite (it has NaN or inf entries)")
    sizes = [p.numel() for p in model.parameters() if p.requires_grad]
    if subset_of_weights == "all":
        check_prior_precision(prior_precision, sizes={"n_layers": len(sizes), "P": sum(sizes)})
    else:  # the subset is found at the first fit: its shape is checked then (the setter)
        one_dim = isinstance(prior_precision, Tensor) and prior_precision.ndim == 1
        shape = {"n": len(prior_precision)} if one_dim else {}  # type: ignore[arg-type]
        check_prior_precision(prior_precision, sizes=shape)
    if getattr(type(la), "structure", "") == "kron" and subset_of_weights == "all":
        _kron_prior(prior_precision, sizes)


# ------------------------------------------------------------------------------ data


def _batches(data: Any) -> tuple[Any, list[Any]]:
    """``(what the caller should use, the batches)``: one batch (a tensor, a tuple whose
    first entry is a tensor, a dict) is returned as is; an iterable of batches as a list."""
    if isinstance(data, Tensor | dict):
        return data, [data]
    if isinstance(data, tuple) and len(data) > 0 and isinstance(data[0], Tensor):
        return data, [data]
    if data is None or isinstance(data, str) or not isinstance(data, Iterable):
        return data, []  # the caller's own normalisation refuses it, naming it
    batches = list(data)
    return batches, batches


def _xy(la: Any, batch: Any) -> tuple[Any, Any]:
    if isinstance(batch, Tensor):
        return batch, None
    if isinstance(batch, dict):
        kx = getattr(la, "dict_key_x", "input_ids")
        ky = getattr(la, "dict_key_y", "labels")
        return batch.get(kx), batch.get(ky)
    if isinstance(batch, tuple | list) and len(batch) > 0:
        return batch[0], (batch[1] if len(batch) > 1 else None)
    return None, None


def _n_outputs(model: nn.Module, x: Tensor) -> int | None:
    """``C`` from one example's forward pass (None when the output is not ``[1, C]``: the
    caller's own check names that)."""
    device = next(p for p in model.parameters()).device
    with torch.no_grad():
        f = model(x[:1].to(device))
    if not isinstance(f, Tensor) or f.ndim != 2:
        return None
    return f.shape[1]


def _check_targets_of(la: Any, batches: list[Any], argument: str) -> None:
    """Every batch's inputs (finite, non-empty) and targets (for the likelihood)."""
    c = None
    for batch in batches:
        x, y = _xy(la, batch)
        if not isinstance(x, Tensor):
            continue  # dict inputs of a model taking dicts: the model's own forward checks
        check_batch(x, "data input" if argument == "train_loader" else f"{argument} input")
        if y is None:
            continue
        if not isinstance(y, Tensor):
            raise TypeError(f"{argument} targets must be tensors, got {type(y).__name__}")
        if c is None:
            c = _n_outputs(la.model, x)
            if c is None:
                return
        la.likelihood_fn.check_targets(y, c, f"{argument} targets y")


def at_fit(la: Any, data: Any) -> Any:
    """``fit``: the model (:func:`check_model`, eval mode), the inputs and the targets
    (``ValueError`` naming ``y``); for a last layer, trainable parameters in it and, with
    ``"kron"``, a prior constant on each of its tensors. Returns ``data`` (an iterable of
    batches as the list that was checked)."""
    model = la.model
    check_model(model)
    require_eval(model)
    data, batches = _batches(data)
    if not batches:
        return data
    _check_targets_of(la, batches, "train_loader")
    x0, _ = _xy(la, batches[0])
    if la.subset_of_weights == "last_layer" and getattr(la, "layer", None) is None:
        if isinstance(x0, Tensor) and len(x0) > 0:
            found = last_linear(model, x0)
            if found is not None:
                name, layer = found
                sizes = [p.numel() for p in layer.parameters(recurse=False) if p.requires_grad]
                if not sizes:
                    raise ValueError(
                        f"subset_of_weights='last_layer': the last layer ({name or 'model'}) "
                        "has no trainable parameters (requires_grad=False); unfreeze it or "
                        "use subset_of_weights='all'"
                    )
                if getattr(type(la), "structure", "") == "kron":
                    _kron_prior(getattr(la, "_prior_arg", None), sizes)
    return data


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
    if isinstance(x, dict):
        return  # dict inputs: the model's own forward checks them
    x = check_batch(x, "x")
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
    ``delta``) and validation targets valid for the likelihood. Returns ``val_loader`` (an
    iterable of batches as the list that was checked)."""
    if method == "marglik":
        _positive_int(n_steps, "n_steps")
        return val_loader
    if method != "gridsearch":
        return val_loader  # the method's own check names it
    _positive_int(grid_size, "grid_size")
    if prior_structure not in (None, "scalar"):
        raise ValueError(
            f"method='gridsearch' searches one scalar prior precision; prior_structure="
            f"{prior_structure!r} needs method='marglik'"
        )
    if val_loader is None:
        return val_loader
    at_state_dict(la)
    val_loader, batches = _batches(val_loader)
    if not batches:
        return val_loader
    c = None
    for batch in batches:
        x, y = _xy(la, batch)
        if isinstance(x, Tensor):
            check_batch(x, "val_loader input")
        if y is None or not isinstance(x, Tensor):
            continue
        if not isinstance(y, Tensor):
            raise TypeError(f"val_loader targets must be tensors, got {type(y).__name__}")
        c = _n_outputs(la.model, x) if c is None else c
        if c is not None:
            la.likelihood_fn.check_targets(y, c, "val_loader targets y")
    return val_loader
