"""Checks shared by the optimizers that keep a posterior (:class:`~fromp.optim.IVON`,
:class:`~fromp.optim.VOGN`), run before anything changes: the hyperparameters of every
parameter group at each step and in a loaded state (a scheduler, an edit of
``param_groups`` or ``load_state_dict`` may have changed them since construction), the
closure's result, the labels of a mini-batch and a loaded posterior state. Each refusal
names the argument; the weights and the optimizer state are left as they were."""

from __future__ import annotations

import math
import warnings
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor, nn

from fromp._checks import (
    check_class_targets,
    check_positive,
    check_prior_precision,
    check_vogn_hyper,
)
from fromp.likelihood import Likelihood, get_likelihood

__all__ = [
    "GroupHyperparameters",
    "check_betas",
    "check_closure_result",
    "check_ess",
    "check_groups",
    "check_ivon_hyper",
    "check_ivon_state",
    "check_param_state",
    "check_targets",
    "check_vogn_state",
    "deprecated_alias",
    "ess_alias",
    "renamed_kwarg",
]

#: Hyperparameters that act on the whole posterior: equal in every group.
_SHARED = {"IVON": ("mc_samples", "antithetic"),
           "VOGN": ("betas", "mc_samples", "kl_weight", "bias_correction")}  # fmt: skip


def _finite(value: object) -> bool:
    return not isinstance(value, bool) and isinstance(value, int | float) and math.isfinite(value)


def check_betas(betas: object, where: str = "") -> tuple[float, float]:
    """``betas`` two finite floats in ``[0, 1)`` (the decays of the momentum and of the
    curvature estimate, VOGN's and IVON's), as a tuple of floats."""
    if (
        not isinstance(betas, tuple | list)
        or len(betas) != 2
        or not all(_finite(b) and 0.0 <= b < 1.0 for b in betas)
    ):
        raise ValueError(f"{where}betas must be two floats in [0, 1), got {betas!r}")
    return (float(betas[0]), float(betas[1]))


_SCALE_MAX = float(torch.finfo(torch.float32).max)


def check_ivon_hyper(group: dict[str, Any], where: str = "") -> None:
    """The hyperparameters of an IVON parameter group, at construction, at every step and in
    a loaded state (a scheduler or an edit of ``param_groups`` may have changed them):
    ``lr`` finite and ``>= 0`` (``> 0`` at construction, checked there), ``ess`` and
    ``hess_init`` finite and positive, ``betas`` two floats in ``[0, 1)``,
    ``prior_precision`` finite and ``>= 0``, ``clip_radius`` None or positive,
    ``mc_samples`` an int ``>= 1``, ``antithetic`` and ``rescale_lr`` bools. ``where``
    prefixes the message (e.g. ``"IVON.step(): param_groups[1]: "``)."""
    keys = {"lr", "ess", "hess_init", "betas", "prior_precision", "clip_radius"}
    missing = (keys | {"mc_samples", "antithetic", "rescale_lr"}) - set(group)
    if missing:
        raise ValueError(f"{where}IVON parameter group is missing {sorted(missing)}")
    lr = group["lr"]
    if not _finite(lr) or not lr >= 0:
        raise ValueError(f"{where}lr must be a finite float >= 0, got {lr!r}")
    try:
        check_positive(group["ess"], "ess")
        check_positive(group["hess_init"], "hess_init")
        if group["clip_radius"] is not None:
            check_positive(group["clip_radius"], "clip_radius")
    except ValueError as err:
        raise ValueError(f"{where}{err}") from None
    if float(group["ess"]) ** -0.5 > _SCALE_MAX:
        raise ValueError(f"{where}ess={group['ess']!r} is too small: the posterior's scale "
                         "1 / sqrt(ess) overflows float32")  # fmt: skip
    check_betas(group["betas"], where)
    d = check_prior_precision(
        group["prior_precision"], allow_zero=True, name=f"{where}prior_precision"
    )
    if d / float(group["ess"]) > _SCALE_MAX:  # the weight decay delta / N of the step
        raise ValueError(f"{where}prior_precision / ess = {d!r} / {group['ess']!r} overflows "
                         "float32: ess is too small")  # fmt: skip
    mc = group["mc_samples"]
    if isinstance(mc, bool) or not isinstance(mc, int) or mc < 1:
        raise ValueError(f"{where}mc_samples must be an int >= 1, got {mc!r}")
    for name in ("antithetic", "rescale_lr"):
        if not isinstance(group[name], bool):
            raise ValueError(f"{where}{name} must be a bool, got {group[name]!r}")


def _as_tuple(value: Any) -> tuple[Any, ...]:
    return tuple(value) if isinstance(value, tuple | list) else (value,)


def check_groups(groups: Sequence[dict[str, Any]], where: str) -> None:
    """Every group's hyperparameters valid, the shared ones equal to the first group's;
    ``where`` (``"IVON.step()"``, ``"VOGN.load_state_dict"``, ...) opens the message and
    names the optimizer."""
    kind = where.split(".", 1)[0]
    check = check_ivon_hyper if kind == "IVON" else check_vogn_hyper
    for i, group in enumerate(groups):
        check(group, f"{where}: param_groups[{i}]: ")
        for key in _SHARED[kind]:
            if _as_tuple(group[key]) != _as_tuple(groups[0][key]):
                raise ValueError(
                    f"{where}: param_groups[{i}]: {kind} keeps one {key} for all parameter "
                    f"groups, got {group[key]!r} and {groups[0][key]!r}"
                )


def check_closure_result(kind: str, value: Any, params: Sequence[Tensor]) -> None:
    """The closure returned the loss and called ``backward()`` (the gradients were cleared
    before it ran, so some parameter must have one)."""
    if value is None:
        raise TypeError(
            f"{kind}.step(closure): the closure returned None; it must zero the gradients, "
            "compute the (mean) loss, call loss.backward() and return the loss"
        )
    if all(p.grad is None for p in params):
        raise RuntimeError(
            f"{kind}.step(closure): the closure did not call backward() (no parameter has a "
            "gradient at the sampled weights); the weights and the optimizer state are "
            "unchanged"
        )


def check_targets(opt: Any, net: nn.Module, x: Tensor, y: Tensor) -> None:
    """Labels of a classification likelihood (``opt.likelihood``) in the range of the
    model's outputs, refused naming ``y``; the output count is found once per model by a
    one-example forward pass in eval mode (no batch-norm update, no dropout draw)."""
    if not isinstance(opt.likelihood, str | Likelihood):
        return  # a callable loss: its own targets
    lik = get_likelihood(opt.likelihood)
    if lik.name == "gaussian":
        return
    cache = opt.__dict__.setdefault("_n_outputs", {})
    n_out = cache.get(id(net))
    if n_out is None:
        was_training = net.training
        net.eval()
        try:
            with torch.no_grad():
                n_out = cache[id(net)] = int(net(x[:1]).shape[-1])
        finally:
            net.train(was_training)
    check_class_targets(y, n_out, lik, "y")


def check_vogn_state(vogn: Any, size: int) -> None:
    """A flat ``"vogn"`` state entry of fromp 0.5 (``[P]`` tensors) that fits a VOGN over
    ``size`` (``P``) numbers."""
    if not isinstance(vogn, dict):
        raise ValueError(f"vogn state must be a dict, got {type(vogn).__name__}")
    keys = ("mu", "s", "m", "step", "prior_mean", "prior_precision", "init_s", "train_set_size")
    missing = set(keys) - set(vogn)
    if missing:
        raise ValueError(f"vogn state is missing {sorted(missing)}")
    for key in ("mu", "s", "m", "prior_mean", "prior_precision"):
        v = vogn[key]
        if not isinstance(v, Tensor) or v.shape != (size,):
            raise ValueError(f"vogn state's {key!r} must be a [P]=[{size}] tensor")
        if not bool(torch.isfinite(v).all()):
            raise ValueError(f"vogn state's {key!r} has non-finite entries (NaN or inf)")
    init_s = vogn["init_s"]
    if init_s is not None and (not isinstance(init_s, Tensor) or init_s.shape != (size,)):
        raise ValueError(f"vogn state's 'init_s' must be None or a [P]=[{size}] tensor")
    check_prior_precision(
        vogn["prior_precision"], sizes={"P": size}, name="vogn state's 'prior_precision'"
    )
    n = vogn["train_set_size"]
    if n is not None and (isinstance(n, bool) or not isinstance(n, int | float) or not n > 0):
        raise ValueError(f"vogn state's train_set_size (ess) must be a positive number, got {n!r}")


def check_ivon_state(ivon: Any, params: Sequence[Tensor], groups: Sequence[dict[str, Any]]) -> None:
    """An ``"ivon"`` state entry that fits an IVON over ``params`` in ``groups``."""
    if not isinstance(ivon, dict) or "params" not in ivon or "step" not in ivon:
        raise ValueError("ivon state must be a dict with 'step' and 'params'")
    if len(ivon["params"]) != len(params):
        raise ValueError(
            f"ivon state has {len(ivon['params'])} parameters, optimizer has {len(params)}"
        )
    for p, st in zip(params, ivon["params"]):
        if not isinstance(st, dict) or "hess" not in st or "momentum" not in st:
            raise ValueError("ivon state must hold 'momentum' and 'hess' per parameter")
        if st["hess"].shape != p.shape:
            raise ValueError(f"ivon state shape {tuple(st['hess'].shape)} != {tuple(p.shape)}")
        if not bool(torch.isfinite(st["hess"]).all() & torch.isfinite(st["momentum"]).all()):
            raise ValueError("ivon state has non-finite entries (NaN or inf)")
    mirror = ivon.get("mirror")
    if mirror is not None:
        sizes = [sum(p.numel() for p in g["params"]) for g in groups]
        if [z.numel() for z in mirror] != sizes:
            got = [z.numel() for z in mirror]
            raise ValueError(f"ivon state's mirror draw has sizes {got}, expected {sizes}")


def _as_vector(value: float | Tensor, like: Tensor, name: str) -> Tensor:
    """``value`` (a float or a ``[P]`` tensor) as a detached ``[P]`` copy like ``like``."""
    t = torch.as_tensor(value, dtype=like.dtype, device=like.device)
    if t.ndim == 0:
        t = t.expand_as(like)
    if t.shape != like.shape:
        raise ValueError(f"{name} must be a float or a [P]={like.numel()} tensor, got {t.shape}")
    return t.detach().clone()


def check_ess(n: object) -> float:
    """``N`` a finite number ``> 0`` (an int stays an int)."""
    if isinstance(n, bool) or not isinstance(n, int | float) or not n > 0 or not math.isfinite(n):
        raise ValueError(f"ess must be a positive number (the training-set size), got {n!r}")
    return n


def ess_alias(ess: float | None, train_set_size: float | None, who: str) -> float | None:
    """``ess``, or the deprecated ``train_set_size=`` (with a ``DeprecationWarning``)."""
    if train_set_size is None:
        return ess
    warnings.warn(f"{who}(train_set_size=...) is deprecated: use {who}(ess=...)",
                  DeprecationWarning, stacklevel=3)  # fmt: skip
    if ess is not None and ess != train_set_size:
        raise ValueError(f"pass ess or train_set_size (a deprecated synonym), not both: "
                         f"got {ess!r} and {train_set_size!r}")  # fmt: skip
    return train_set_size


def deprecated_alias(old: str, new: str, who: str) -> property:
    """A property ``old`` that reads and writes ``new`` with a ``DeprecationWarning``."""

    def get(self: Any) -> Any:
        warnings.warn(f"{who}.{old} is deprecated: use {who}.{new}", DeprecationWarning,
                      stacklevel=2)  # fmt: skip
        return getattr(self, new)

    def put(self: Any, value: Any) -> None:
        warnings.warn(f"{who}.{old} is deprecated: use {who}.{new}", DeprecationWarning,
                      stacklevel=2)  # fmt: skip
        setattr(self, new, value)

    return property(get, put, doc=f"Deprecated synonym of :attr:`{new}`.")


def renamed_kwarg(
    new: Any, old: Any, old_name: str, new_name: str, who: str, how: str = "", stacklevel: int = 3
) -> Any:
    """The value of a constructor argument renamed from ``old_name`` to ``new_name``: ``new``,
    or the deprecated ``old`` (not None: a ``DeprecationWarning`` naming the new argument,
    ``how`` says how to convert, e.g. ``"prior_precision = weight_decay * ess"``); both
    given is a ``ValueError``. Call it with the old value already converted."""
    if old is None:
        return new
    hint = f" ({how})" if how else ""
    warnings.warn(f"{who}({old_name}=...) is deprecated: use {who}({new_name}=...){hint}",
                  DeprecationWarning, stacklevel=stacklevel)  # fmt: skip
    if new is not None:
        raise ValueError(f"{who}: pass {new_name} or the deprecated {old_name}, not both")
    return old


def check_param_state(
    state: Any, params: Sequence[Tensor], required: Sequence[str], who: str
) -> None:
    """torch's per-index optimizer state (``state_dict()["state"]``) that fits ``params``:
    indices of parameters, each a dict with the ``required`` tensors, every tensor of the
    parameter's shape (``"step"`` a number) and finite. ``ValueError`` naming the entry,
    before anything is loaded."""
    if not isinstance(state, dict):
        raise ValueError(f"{who} state must be a dict of parameter index -> dict")
    for i, st in state.items():
        if isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < len(params):
            raise ValueError(f"{who} state has index {i!r}, the optimizer has {len(params)} "
                             "parameters")  # fmt: skip
        if not isinstance(st, dict):
            raise ValueError(f"{who} state[{i}] must be a dict")
        missing = [k for k in required if k not in st]
        if missing:
            raise ValueError(f"{who} state[{i}] is missing {missing}")
        for k, v in st.items():
            if k == "step":
                if not _finite(float(v)) or float(v) < 0:
                    raise ValueError(f"{who} state[{i}]['step'] must be a count >= 0, got {v!r}")
                continue
            if not isinstance(v, Tensor) or v.shape != params[i].shape:
                raise ValueError(f"{who} state[{i}][{k!r}] must be a tensor of shape "
                                 f"{tuple(params[i].shape)}")  # fmt: skip
            if not bool(torch.isfinite(v).all()):
                raise ValueError(f"{who} state[{i}][{k!r}] has non-finite entries (NaN or inf)")


class GroupHyperparameters:
    """What :class:`~fromp.optim.IVON` and :class:`~fromp.optim.VOGN` read from their
    ``param_groups`` alike: the parameters in group order and the global ``mc_samples``."""

    param_groups: list[dict[str, Any]]

    @property
    def params(self) -> list[Tensor]:
        """All parameters, group by group (the order of every flat vector)."""
        return [p for group in self.param_groups for p in group["params"]]

    @property
    def mc_samples(self) -> int:
        """Weight draws per ``step(closure)`` (one for all groups)."""
        return int(self.param_groups[0]["mc_samples"])
