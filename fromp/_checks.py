"""Input checks shared by the library, run before any work starts.

One rule for every argument: a value of the wrong type raises ``TypeError``; a tensor of the
wrong shape, an empty batch or non-finite entries (NaN or inf) raise ``ValueError``; every
message names the argument and says what was expected.
"""

from __future__ import annotations

import math
import operator
from typing import Any

import torch
from torch import Tensor, nn

__all__ = [
    "ArgumentTypeError",
    "check_batch",
    "check_finite",
    "check_positive",
    "check_prior_precision",
    "check_tensor",
    "check_vector",
    "device_dtype",
]


def check_tensor(x: object, name: str, expected: str) -> Tensor:
    """``x`` itself when it is a tensor, else ``TypeError`` naming ``name`` and the
    ``expected`` shape (e.g. ``"[N]"``)."""
    if not isinstance(x, Tensor):
        raise TypeError(f"{name} must be a Tensor of shape {expected}, got {type(x).__name__}")
    return x


def check_finite(x: Tensor, name: str) -> Tensor:
    """``x`` unchanged when its floating-point entries are all finite, else ``ValueError``
    (NaN and inf alike).

    A NaN or inf entry makes the sum non-finite, so a finite sum proves every entry finite;
    only a non-finite sum (a bad entry, or finite entries overflowing) takes the exact
    elementwise check. The sum is about 20x cheaper than ``isfinite(x).all()`` on a batch,
    which matters in optimizers' per-step checks."""
    if (
        x.is_floating_point()
        and not bool(torch.isfinite(x.sum()))
        and not bool(torch.isfinite(x).all())
    ):
        raise ValueError(f"{name} has non-finite entries (NaN or inf)")
    return x


def check_batch(x: object, name: str = "x") -> Tensor:
    """``x`` as a non-empty ``[N, ...]`` tensor with finite entries (returned unchanged)."""
    x = check_tensor(x, name, "[N, ...]")
    if x.ndim < 1 or len(x) == 0:
        raise ValueError(
            f"{name} must be a non-empty [N, ...] tensor (N >= 1), got shape {tuple(x.shape)}"
        )
    return check_finite(x, name)


def check_vector(
    v: object, size: int, name: str, *, nonnegative: bool = False, positive: bool = False
) -> Tensor:
    """``v`` as a finite ``[size]`` tensor (optionally ``>= 0`` or ``> 0``), returned unchanged."""
    v = check_tensor(v, name, f"[P]=[{size}]")
    if v.shape != (size,):
        raise ValueError(f"{name} must have shape [P]=[{size}], got {tuple(v.shape)}")
    check_finite(v, name)
    if positive and bool((v <= 0).any()):
        raise ValueError(f"{name} must be finite and strictly positive")
    if nonnegative and bool((v < 0).any()):
        raise ValueError(f"{name} must be finite and non-negative")
    return v


def check_positive(value: object, name: str) -> float:
    """``value`` as a finite positive float (a hyperparameter: ``lr``, ``kl_weight``, ...);
    a bool, a non-number, a value ``<= 0``, NaN or inf raise ``ValueError`` naming it."""
    if isinstance(value, bool) or not isinstance(value, int | float) or not value > 0:
        raise ValueError(f"{name} must be a positive float, got {value!r}")
    if not math.isfinite(value):
        raise ValueError(f"{name} must be finite, got {value!r}")
    return float(value)


def device_dtype(model: nn.Module) -> tuple[torch.device, torch.dtype]:
    """Device and dtype of the first trainable parameter of ``model``."""
    p = next((p for p in model.parameters() if p.requires_grad), None)
    if p is None:
        raise ValueError("model has no trainable parameters")
    return p.device, p.dtype


def require_eval(model: nn.Module) -> None:
    """Raise ValueError when batch norm or dropout layers of ``model`` are in training mode:
    per-example Jacobians (and the GGN, kernel, evidence built from them) need ``eval()``."""
    stochastic = (nn.modules.batchnorm._BatchNorm, nn.modules.dropout._DropoutNd)
    bad = [
        n or type(m).__name__
        for n, m in model.named_modules()
        if m.training and isinstance(m, stochastic)
    ]
    if bad:
        raise ValueError(
            f"model has batch-norm/dropout layers in training mode ({', '.join(bad[:3])}); "
            "call model.eval() first"
        )


def check_count(value: object, name: str, *, allow_none: bool = True) -> int | None:
    """``value`` as an int ``>= 1`` (or None where ``allow_none``); ValueError naming
    ``name`` otherwise (bools and floats included). The one rule for every count argument
    of fromp (``chunk_size``, ``penalty_points``, ``memory_batch``, ...)."""
    if value is None and allow_none:
        return None
    what = "a positive int or None" if allow_none else "a positive int"
    try:
        if isinstance(value, bool):
            raise TypeError
        number = operator.index(value)  # type: ignore[arg-type]
    except TypeError:
        raise ValueError(f"{name} must be {what}, got {value!r}") from None
    if number < 1:
        raise ValueError(f"{name} must be {what}, got {value!r}")
    return number


def check_chunk_size(chunk_size: object, *, allow_none: bool = True) -> int | None:
    """``chunk_size`` as an int ``>= 1`` (or None where ``allow_none``: the default chunk);
    ValueError naming the argument otherwise (:func:`check_count`)."""
    return check_count(chunk_size, "chunk_size", allow_none=allow_none)


def check_class_targets(y: Tensor, n_outputs: int, likelihood: Any, name: str = "y") -> None:
    """Targets ``y`` of a classification likelihood refused by name before any work when
    they do not fit a head of ``n_outputs`` outputs: class indices ``0 <= y < C`` (integer
    valued) for ``"categorical"``, ``{0, 1}`` for ``"bernoulli"``; finite values for
    ``"gaussian"``. ``likelihood`` is a :class:`fromp.likelihood.Likelihood` (its ``name``
    is read)."""
    kind = getattr(likelihood, "name", likelihood)
    if kind == "gaussian":
        if y.is_floating_point() and not bool(torch.isfinite(y).all()):
            raise ValueError(f"{name} has non-finite regression targets (NaN or inf)")
        return
    if y.is_floating_point() and not bool(torch.isfinite(y).all()):
        raise ValueError(f"{name} has non-finite class labels (NaN or inf)")
    if y.is_floating_point() and not bool((y == y.round()).all()):
        raise ValueError(f"{name} must hold class indices, got fractional labels")
    if y.numel() == 0:
        return
    lo, hi = int(y.min()), int(y.max())
    top = 1 if kind == "bernoulli" else n_outputs - 1
    if lo < 0 or hi > top:
        what = "{0, 1}" if kind == "bernoulli" else f"0..{top} (the model has {n_outputs} outputs)"
        bad = lo if lo < 0 else hi
        raise ValueError(f"{name} holds label {bad}, outside {what}")


def check_model_output(f: object, where: str = "") -> Tensor:
    """``f`` unchanged when it is a model's ``[N, C]`` output tensor, else ``ValueError``
    saying what the model returned (a tuple or dict, as Hugging Face-style models return,
    or a tensor of another shape) and what to write instead; ``where`` (e.g. ``" for one
    example"``) ends the message."""
    if not isinstance(f, Tensor):
        raise ValueError(
            f"model must return a [N, C] tensor of outputs, got a {type(f).__name__}{where}: "
            "wrap it in an nn.Module whose forward returns the logits (e.g. model(x)[0] or "
            'model(x)["logits"])'
        )
    if f.ndim != 2:
        raise ValueError(f"model output must have shape [N, C], got {tuple(f.shape)}{where}")
    return f


def probe_outputs(model: nn.Module, x: Tensor, argument: str = "x", n: int = 2) -> Tensor:
    """The model's outputs on the first ``n`` examples of ``x`` (no gradient, on the model's
    device), before any work on ``x``: refused (``ValueError`` naming ``argument``) when
    ``x`` does not fit the model (a floating dtype other than its trainable weights', a shape
    the model cannot take) or the model returns no tensor (a tuple or dict:
    :func:`check_model_output`)."""
    params = [p for p in model.parameters() if p.requires_grad] or list(model.parameters())
    p = params[0] if params else None
    if p is not None and x.is_floating_point() and x.dtype != p.dtype:
        raise ValueError(
            f"{argument} is {x.dtype}, the model {p.dtype}: convert one (e.g. "
            f"{argument}.to({p.dtype}))"
        )
    try:
        with torch.no_grad():
            f = model(x[:n].to(p.device if p is not None else x.device))
    except (RuntimeError, IndexError, TypeError, KeyError) as err:
        raise ValueError(
            f"the model cannot be called on {argument} of shape {tuple(x.shape)}: {err}"
        ) from err
    if not isinstance(f, Tensor):
        check_model_output(f, f" on {argument}")
    return f


def not_on_meta(model: nn.Module) -> None:
    """``ValueError`` naming the first parameter or buffer of ``model`` on the ``meta`` device
    (a model built without its weights' values)."""
    for name, t in [*model.named_parameters(), *model.named_buffers()]:
        if t.device.type == "meta":
            raise ValueError(
                f"model tensor {name} is on the meta device (no values): load the weights "
                "first (model.to_empty(device=...) then load_state_dict)"
            )


def check_saved_settings(state: dict[str, Any], settings: dict[str, Any]) -> None:
    """Refuse (``ValueError``) a method state saved with settings other than ``settings``
    (``{name: value}``), naming the first that differs; a setting that an older state does not
    hold is not compared. For ``load_state_dict``, before anything is changed."""
    bad = [(k, state[k], v) for k, v in settings.items() if k in state and state[k] != v]
    if bad:
        key, saved, value = bad[0]
        raise ValueError(
            f"state was saved with {key}={saved!r}, method has {value!r}: resume with the "
            "settings of the run"
        )


class ArgumentTypeError(TypeError, ValueError):
    """An argument of the wrong type: a ``TypeError`` (the rule of this module) that is also
    a ``ValueError``, so that code which caught the ``ValueError`` some checks raised for a
    wrong type before they shared one implementation keeps working."""


def check_prior_precision(
    value: object,
    *,
    sizes: dict[str, int] | None = None,
    like: Tensor | None = None,
    allow_zero: bool = False,
    name: str = "prior_precision",
) -> float | Tensor:
    """The prior precision ``delta`` checked before any work: the one rule for every
    ``prior_precision`` argument (and setter, parameter-group key, loaded state) of fromp.

    Args:
        value: a number (``int`` or ``float``; not a ``bool``) or, where ``sizes`` is given,
            a tensor of shape ``[]`` or ``[n]`` for ``n`` one of ``sizes``' values (a ``[1]``
            tensor is laplace-torch's scalar form and becomes ``[]`` when ``1`` is not among
            them).
        sizes: the lengths a one-dimensional ``delta`` may have, by the name the message
            gives them, e.g. ``{"n_layers": 3, "P": 1200}``; ``{}``: a number or a 0-dim
            tensor; None: a number only (no tensor).
        like: return a tensor with ``like``'s dtype and device (differentiable in a tensor
            ``value``: the evidence is optimised through it); None: a number is returned as a
            ``float`` and a tensor as it is.
        allow_zero: ``delta >= 0`` (IVON's group key: no prior) instead of ``delta > 0``.
        name: the argument's name in the messages.

    Raises:
        ArgumentTypeError: (a ``TypeError`` and a ``ValueError``) a bool, a non-number, or a
            tensor where ``sizes`` is None.
        ValueError: a shape outside ``[]`` and ``[n]`` for ``n`` in ``sizes``; a NaN, inf or
            ``delta <= 0`` (``< 0`` with ``allow_zero``) entry.
    """
    sign = ">= 0" if allow_zero else "strictly positive"
    types: tuple[type, ...] = (int, float) if sizes is None else (int, float, Tensor)
    if isinstance(value, bool) or not isinstance(value, types):
        what = "a number >= 0" if allow_zero else "a positive number"
        if sizes is not None:
            shapes = ["[]", *(f"[{k}]=[{n}]" for k, n in sizes.items())]
            listed = ", ".join(shapes[:-1]) + " or " + shapes[-1] if sizes else shapes[0]
            what += f" or a tensor of shape {listed}"
        raise ArgumentTypeError(f"{name} must be {what}, got {type(value).__name__}")
    if not isinstance(value, Tensor):
        if not (math.isfinite(value) and (value >= 0 if allow_zero else value > 0)):
            raise ValueError(f"{name} must be finite and {sign}, got {value!r}")
        if like is None:
            return float(value)
        return torch.tensor(float(value), dtype=like.dtype, device=like.device)
    assert sizes is not None
    d = value if like is None else value.to(dtype=like.dtype, device=like.device)
    if d.shape == (1,) and 1 not in sizes.values():
        d = d.reshape(())  # laplace-torch's scalar form
    if d.ndim > 1 or (d.ndim == 1 and len(d) not in sizes.values()):
        allowed = " or ".join(f"[{k}]=[{n}]" for k, n in sizes.items())
        what = f"a scalar or have shape {allowed}" if sizes else "a scalar"
        raise ValueError(f"{name} must be {what}, got shape {tuple(d.shape)}")
    v = d.detach()
    if not bool(torch.isfinite(v).all()):
        raise ValueError(f"{name} must be finite and {sign}, got non-finite entries (NaN or inf)")
    if not bool((v >= 0 if allow_zero else v > 0).all()):
        raise ValueError(f"{name} must be finite and {sign}, got an entry {float(v.min()):g}")
    return d
