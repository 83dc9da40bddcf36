"""Checks shared by the optimizers that keep a posterior (:class:`~fromp.optim.IVON`,
:class:`~fromp.optim.VOGN`), run before anything changes: the hyperparameters of every
parameter group at each step and in a loaded state (a scheduler, an edit of
``param_groups`` or ``load_state_dict`` may have changed them since construction), the
closure's result, the labels of a mini-batch and a loaded posterior state. Each refusal
names the argument; the weights and the optimizer state are left as they were."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import Tensor

from fromp._checks import check_positive, check_prior_precision

__all__ = [
    "IVON_OPT_ONLY",
    "GroupHyperparameters",
    "check_betas",
    "check_closure_result",
    "check_ess",
    "check_groups",
    "check_ivon_hyper",
    "check_param_state",
    "check_vogn_groups",
    "check_vogn_hyper",
    "ivon_opt_spelling",
    "param_views",
]

#: Hyperparameters that act on the whole posterior: equal in every group.
_SHARED = {"IVON": ("mc_samples", "antithetic", "sync"),
           "VOGN": ("betas", "mc_samples", "kl_weight", "bias_correction")}  # fmt: skip

#: ivon-opt 0.1.3's names of quantities fromp.IVON names otherwise (one name per quantity):
#: ``weight_decay`` is ``prior_precision / ess``, ``(beta1, beta2)`` is ``betas``. Refused,
#: as arguments and as parameter-group keys, by :func:`ivon_opt_spelling`'s message.
IVON_OPT_ONLY = ("weight_decay", "beta1", "beta2")


def _finite(value: object) -> bool:
    return not isinstance(value, bool) and isinstance(value, int | float) and math.isfinite(value)


def _check_step_lr(lr: object, where: str) -> None:
    """A step size read at a step: finite and ``>= 0`` (a scheduler may bring it to 0; the
    constructors ask for ``> 0``)."""
    if not _finite(lr) or not lr >= 0:  # type: ignore[operator]
        raise ValueError(f"{where}lr must be a finite float >= 0, got {lr!r}")


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


def ivon_opt_spelling(found: Mapping[str, Any], ess: Any, betas: Any, group: bool) -> str:
    """The message refusing ivon-opt's spellings in ``found`` (keys of
    :data:`IVON_OPT_ONLY` with their values), as constructor arguments or (``group``) as
    keys of a parameter group, with what to write instead, converted:
    ``prior_precision = weight_decay * ess`` (``ess`` the constructor's or the group's) and
    ``betas = (beta1, beta2)`` (a missing one from ``betas``)."""

    def put(key: str, value: str) -> str:
        return f"'{key}' = {value}" if group else f"{key}={value}"

    todo = []
    if "weight_decay" in found:
        wd = found["weight_decay"]
        ok = all(not isinstance(v, bool) and isinstance(v, int | float) for v in (wd, ess))
        value = repr(float(wd) * float(ess)) if ok else "weight_decay * ess"
        todo.append(
            f"{put('prior_precision', value)} (the whole prior precision, weight_decay * ess "
            f"= {wd!r} * {ess!r}; ivon-opt's weight_decay is prior_precision / ess)"
        )
    if "beta1" in found or "beta2" in found:
        ok = isinstance(betas, tuple | list) and len(betas) == 2
        old = tuple(betas) if ok else (0.9, 0.99999)
        b = (found.get("beta1", old[0]), found.get("beta2", old[1]))
        todo.append(f"{put('betas', f'({b[0]!r}, {b[1]!r})')} (torch's (beta1, beta2))")
    wrote = ", ".join(put(k, repr(v)) for k, v in found.items())
    if group:
        keys = " and ".join(f"'{k}'" for k in found)
        what = "an ivon-opt key" if len(found) == 1 else "ivon-opt's keys"
        return (f"{wrote}: {what}; fromp.IVON's groups hold {' and '.join(todo)}: set "
                f"{'it' if len(todo) == 1 else 'them'} and delete {keys}")  # fmt: skip
    return f"IVON({wrote}): ivon-opt's spelling; fromp.IVON takes {' and '.join(todo)}"


_SCALE_MAX = float(torch.finfo(torch.float32).max)


def check_ivon_hyper(group: dict[str, Any], where: str = "") -> None:
    """The hyperparameters of an IVON parameter group, at construction, at every step and in
    a loaded state (a scheduler or an edit of ``param_groups`` may have changed them):
    ``lr`` finite and ``>= 0`` (``> 0`` at construction, checked there), ``ess`` and
    ``hess_init`` finite and positive, ``betas`` two floats in ``[0, 1)``,
    ``prior_precision`` finite and ``>= 0``, ``clip_radius`` None or positive (``inf``: no
    clipping), ``mc_samples`` an int ``>= 1``, ``antithetic``, ``debias`` and
    ``rescale_lr`` bools, ``sync`` None or a bool; ivon-opt's keys (``weight_decay``,
    ``beta1``, ``beta2``) refused with fromp's, converted. ``where`` prefixes the message
    (e.g. ``"IVON.step(): param_groups[1]: "``)."""
    spelt = {k: group[k] for k in IVON_OPT_ONLY if k in group}
    if spelt:
        msg = ivon_opt_spelling(spelt, group.get("ess"), group.get("betas"), group=True)
        raise ValueError(where + msg)
    keys = {"lr", "ess", "hess_init", "betas", "prior_precision", "clip_radius"}
    missing = (keys | {"mc_samples", "antithetic", "rescale_lr", "debias", "sync"}) - set(group)
    if missing:
        raise ValueError(f"{where}IVON parameter group is missing {sorted(missing)}")
    _check_step_lr(group["lr"], where)
    try:
        check_positive(group["ess"], "ess")
        check_positive(group["hess_init"], "hess_init")
        radius = group["clip_radius"]
        if radius is not None and radius != math.inf:
            check_positive(radius, "clip_radius")
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
    for name in ("antithetic", "debias", "rescale_lr"):
        if not isinstance(group[name], bool):
            raise ValueError(f"{where}{name} must be a bool, got {group[name]!r}")
    if group["sync"] is not None and not isinstance(group["sync"], bool):
        raise ValueError(f"{where}sync must be None, True or False, got {group['sync']!r}")


def check_vogn_groups(groups: list[Any]) -> list[dict[str, Any]]:
    """Parameter groups for :class:`fromp.optim.VOGN`: dicts with ``"params"`` and optionally
    ``"lr"`` and ``"prior_precision"`` (a float for the group's slice of ``delta``); the keys
    that act on the whole posterior (one draw, one KL weight, one ``s`` schedule) must be the
    constructor's."""
    out = []
    for i, g in enumerate(groups):
        if not isinstance(g, dict) or "params" not in g:
            raise ValueError(
                f"params_or_model[{i}] must be a parameter group dict with 'params' (or pass "
                f"tensors only), got {type(g).__name__}"
            )
        unknown = set(g) - {"params", "lr", "prior_precision"}
        if unknown & set(_SHARED["VOGN"]):
            key = sorted(unknown & set(_SHARED["VOGN"]))[0]
            raise ValueError(
                f"params_or_model[{i}][{key!r}]: VOGN keeps one {key} for all parameter groups; "
                f"pass it to the constructor"
            )
        if unknown:
            raise ValueError(
                f"params_or_model[{i}] has unknown keys {sorted(unknown)}; a VOGN parameter "
                "group takes 'params', 'lr' and 'prior_precision'"
            )
        if "lr" in g:
            check_positive(g["lr"], f"params_or_model[{i}]['lr']")
        params = g["params"]
        params = [params] if isinstance(params, Tensor) else list(params)
        out.append({**g, "params": params})
    return out


def check_vogn_hyper(group: dict[str, Any], where: str = "") -> None:
    """The hyperparameters of a VOGN parameter group, read at every step or loaded from a
    state dict (``ValueError`` naming the argument): ``lr`` finite and ``>= 0``, ``betas``
    two floats in ``[0, 1)``, ``mc_samples`` an int ``>= 0``, ``kl_weight`` finite and
    positive, ``bias_correction`` a bool, ``prior_precision`` None or finite and positive."""
    missing = {"lr", "betas", "mc_samples", "kl_weight", "bias_correction"} - set(group)
    if missing:
        raise ValueError(f"{where}VOGN parameter group is missing {sorted(missing)}")
    _check_step_lr(group["lr"], where)
    try:
        check_positive(group["kl_weight"], "kl_weight")
        if group.get("prior_precision") is not None:
            check_prior_precision(group["prior_precision"])
    except ValueError as err:
        raise ValueError(f"{where}{err}") from None
    check_betas(group["betas"], where)
    mc = group["mc_samples"]
    if isinstance(mc, bool) or not isinstance(mc, int) or mc < 0:
        raise ValueError(f"{where}mc_samples must be an int >= 0, got {mc!r}")
    if not isinstance(group["bias_correction"], bool):
        raise ValueError(f"{where}bias_correction must be a bool, got {group['bias_correction']!r}")


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


def param_views(flat: Tensor, params: Sequence[Tensor]) -> list[Tensor]:
    """``flat`` ``[sum of the numels]`` as views shaped like ``params``, in their order
    (every flat vector of the optimizers follows its parameters' order)."""
    return [v.view_as(p) for v, p in zip(flat.split([p.numel() for p in params]), params)]


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
    ``param_groups`` and torch's ``self.state`` alike: the parameters in group order, the
    global ``mc_samples``, the step count."""

    param_groups: list[dict[str, Any]]
    state: dict[Tensor, dict[str, Any]]

    @property
    def params(self) -> list[Tensor]:
        """All parameters, group by group (the order of every flat vector)."""
        return [p for group in self.param_groups for p in group["params"]]

    @property
    def mc_samples(self) -> int:
        """Weight draws per ``step(closure)`` (one for all groups)."""
        return int(self.param_groups[0]["mc_samples"])

    def _step_count(self) -> int:
        """``t``, the steps since the start (or the last reset of the state or the prior)."""
        steps = [int(self.state[p].get("step", 0)) for p in self.params if p in self.state]
        return max(steps, default=0)

    def _fresh(self, p: Tensor, group: dict[str, Any]) -> dict[str, Tensor]:
        """The state ``p`` starts with (without ``"step"``)."""
        raise NotImplementedError

    def _state_changed(self) -> None:
        """Called when :meth:`_states` created or moved a parameter's state."""
        raise NotImplementedError

    def _states(self) -> list[dict[str, Any]]:
        """``self.state[p]`` of every parameter in group order, created where missing (a
        parameter added after construction, e.g. a new head, or a reset of ``self.state``,
        which restarts it) by :meth:`_fresh` at the current step count; tensors follow the
        parameter's device and dtype."""
        t, out = None, []
        for group in self.param_groups:
            for p in group["params"]:
                st = self.state[p]
                if "hess" not in st:
                    t = self._step_count() if t is None else t
                    st.update(self._fresh(p, group), step=t)
                    self._state_changed()
                elif st["hess"].device != p.device or st["hess"].dtype != p.dtype:
                    for k, v in list(st.items()):
                        if isinstance(v, Tensor):
                            st[k] = v.to(device=p.device, dtype=p.dtype)
                    self._state_changed()
                out.append(st)
        return out

    def _own_state_copies(self) -> list[dict[str, Any]]:
        """After torch's ``load_state_dict`` (which may share the caller's tensors): every
        tensor of ``self.state[p]`` a detached copy on ``p``'s device and dtype, the step
        count an int; returns the states in group order."""
        states = []
        for p in self.params:
            st = self.state[p]
            for k, v in list(st.items()):
                if isinstance(v, Tensor):
                    st[k] = v.detach().to(p).clone()
                elif k == "step":
                    st[k] = int(v)
            states.append(st)
        return states
