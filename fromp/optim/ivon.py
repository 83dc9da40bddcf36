r"""Improved Variational Online Newton (IVON, Shen et al., ICML 2024).

IVON fits a mean-field Gaussian ``q(theta) = N(m, diag(sigma^2))`` to the posterior of a
network trained on ``N`` examples (the *effective sample size* ``ess``) with a prior
``N(0, 1 / delta)`` (``delta`` the ``prior_precision``; the paper's weight decay is
``delta / N``, written ``d`` below), at nearly the cost of Adam: the
curvature comes from the gradient at a sampled weight alone (a reparameterisation-trick
Hessian estimate), not from per-example gradients. Every step, for each of ``mc_samples``
draws ``theta = m + eps``, ``eps ~ N(0, sigma^2)``,

    ``g^ = grad l(theta)``,   ``h^ = g^ * eps / sigma^2``

(``l`` the mean mini-batch loss; both averaged over the draws), then, per coordinate,

    ``g  <- beta1 g + (1 - beta1) g^``
    ``h  <- beta2 h + (1 - beta2) h^ + (1 - beta2)^2 (h - h^)^2 / (2 (h + d))``
    ``gb  = g / (1 - beta1^t)``
    ``m  <- m - alpha (gb + d m) / (h + d)``
    ``sigma^2 = 1 / (N (h + d))``,   ``d = delta / N``

The third term of the ``h`` update (a Riemannian-gradient correction) keeps ``h + delta``
positive whatever the sign of ``h^``. With ``rescale_lr`` (the default) the step size is
``alpha = lr * (h0 + d)`` so that ``lr`` has the scale of an SGD learning rate at
initialisation (``h = h0``); ``clip_radius`` clips each coordinate of the preconditioned
step ``(gb + d m) / (h + d)`` to ``[-clip_radius, clip_radius]``; ``debias=False`` drops the
bias correction (``gb = g``).

The posterior is ``q = N(m, diag(1 / (N h + delta)))``: :meth:`IVON.posterior` returns
it as a :class:`~fromp.posterior.DiagonalGaussian`, so that ``fromp.dnn2gp(model,
opt.posterior(model), ...)`` is the DNN2GP Gaussian process at any IVON iterate.

Continual IVON: :meth:`IVON.set_prior` replaces the weight-decay prior by a diagonal
Gaussian ``N(m0, diag(1 / p0))`` (e.g. the previous task's posterior). The objective
``sum_i l_i + 1/2 (theta - m0)^T diag(p0) (theta - m0)``, divided by ``N``, gives the
update above with ``d = p0 / N`` (a ``[P]`` vector) and ``d m`` replaced by
``d (m - m0)``; the posterior precision is ``N h + p0``.

Typical use::

    opt = IVON(model.parameters(), lr=0.1, ess=len(train_set))
    for x, y in loader:
        for _ in range(opt.mc_samples):
            with opt.sampled_params(train=True):   # theta ~ q written into the parameters
                opt.zero_grad()
                loss_fn(model(x), y).backward()    # the mean is restored on exit
        opt.step()

or ``opt.step(closure)`` with a closure that zeroes the gradients, computes the loss and
calls ``backward()``: the optimizer draws, and evaluates the closure once per draw (VOGN's
protocol; a closure that draws itself, as ivon-opt's do, is refused). The loop above and
the prediction loop (``with opt.sampled_params(): model(x)``, no gradient kept) are those of
the official implementation, ivon-opt 0.1.3, whose documented arguments IVON accepts or
refuses with what to write instead (``docs/library.md`` has the mapping): with the same
draws both give the same weights. A deterministic term ``r(m)`` of the
objective, evaluated at the mean (e.g. FROMP's regulariser of the mean function), enters
through :meth:`IVON.add_gradient` between the draws and :meth:`IVON.step`: its gradient is
added to ``g^`` only.

Antithetic draws (``antithetic=True``): every second draw is the mirror ``theta = m - sigma
z`` of the draw before it (within a step when ``mc_samples`` is even, else across consecutive
steps). Every draw is still distributed as ``q``, so ``g^`` and ``h^`` remain unbiased, and
over a pair the terms odd in ``z`` cancel: on a quadratic loss the pair's ``h^`` is exactly ``a
z^2``, free of the ``g(m) z / sigma`` term that dominates the variance of independent draws.
Half of the draws need no random numbers, which on a CPU is most of IVON's cost over Adam's
(``benchmarks/results/ivon_speed.json``). Independent draws, as in the paper, are the default.

Like VOGN's, the state (momentum ``g``, Hessian estimate ``h``, step count, prior) is torch's
``self.state[p]``, so :meth:`IVON.state_dict` carries it; the hyperparameters are read from
``param_groups`` at every step, so schedulers and edits of a group apply from the next
step.

References:
    Y. Shen, N. Daheim, B. Cong, P. Nickl, G. M. Marconi, C. Bazan, R. Yokota, I. Gurevych,
    D. Cremers, M. E. Khan, T. Möllenhoff. Variational learning is effective for large deep
    networks. ICML 2024.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import Tensor, nn

from fromp._checks import check_positive
from fromp.distributed import is_distributed, mean_over_ranks, world_size
from fromp.optim._contract import (
    IVON_OPT_ONLY,
    GroupHyperparameters,
    check_closure_result,
    check_ess,
    check_groups,
    check_ivon_hyper,
    check_param_state,
    ivon_opt_spelling,
    param_views,
)
from fromp.optim.ivon_posterior import IVONPosterior

__all__ = ["DEFAULT_BETAS", "DEFAULT_WEIGHT_DECAY", "IVON"]

#: ``prior_precision / ess`` when no prior precision is given (the IVON paper's default
#: weight decay): ``prior_precision = 1e-4 * ess``.
DEFAULT_WEIGHT_DECAY = 1e-4
#: IVON's default ``(beta1, beta2)``: the paper's momenta of the gradient and of the Hessian
#: estimate (Shen et al., 2024).
DEFAULT_BETAS: tuple[float, float] = (0.9, 0.99999)
#: keys a parameter group saved before ``sync`` and ``debias`` existed lacks, with what such
#: an optimizer did: it always averaged over the processes and always debiased
_NEW_KEYS = {"sync": True, "debias": True}


def _refuse_positional(extra: tuple[Any, ...]) -> None:
    """ivon-opt's arguments after ``hess_init`` given by position: refused, naming each with
    fromp's keyword (fromp has no ``beta1``, ``beta2`` or ``weight_decay`` to put there)."""
    names = ("beta1", "beta2", "weight_decay", "mc_samples", "hess_approx", "clip_radius",
             "sync", "debias", "rescale_lr")  # fmt: skip
    given = ", ".join(f"{n}={v!r}" for n, v in zip(names, extra))
    raise TypeError(
        f"IVON takes params, lr, ess and hess_init by position (as ivon-opt does); pass the "
        f"rest by keyword: got {given} by position (ivon-opt's order); write "
        "betas=(beta1, beta2) and prior_precision=weight_decay * ess, and the others under "
        "their own names"
    )


def _refuse_hess_approx(hess_approx: object) -> None:
    """ivon-opt's ``hess_approx``: ``"price"`` (the reparameterisation estimate, what IVON
    computes) is accepted, ``"gradsq"`` refused (``ess`` times the squared mini-batch
    gradient is no estimate of the Hessian of the mean loss: it grows with ``ess / M`` for a
    mini-batch of ``M``)."""
    if hess_approx == "price":
        return
    if hess_approx == "gradsq":
        raise ValueError(
            "IVON(hess_approx='gradsq') is not supported: ess times the squared mini-batch "
            "gradient is not an estimate of the Hessian of the mean loss (it grows with "
            "ess / batch size); leave hess_approx out (IVON's estimate is ivon-opt's "
            "'price'), or use fromp.VOGN(hess_approx='ef') for squared per-example gradients"
        )
    raise ValueError(f"hess_approx must be 'price' (ivon-opt's default), got {hess_approx!r}")


class IVON(IVONPosterior, GroupHyperparameters, torch.optim.Optimizer):
    r"""Improved Variational Online Newton; see the module docstring for the update.

    The arguments are those of the official implementation, ivon-opt 0.1.3, in its order,
    with fromp's names for two quantities: ``prior_precision`` (ivon-opt's ``weight_decay``
    is ``prior_precision / ess``) and ``betas`` (ivon-opt's ``beta1``, ``beta2``); those
    spellings, at construction or in a parameter group, are refused with the value to write.

    Args:
        params: an iterable of tensors or of parameter-group dicts (each group may override
            every hyperparameter below except ``mc_samples``, ``antithetic`` and ``sync``,
            which are global).
        lr: learning rate (scaled by ``hess_init + prior_precision / ess`` when
            ``rescale_lr``).
        ess: effective sample size ``N`` (usually the training-set size; VOGN's name too);
            sets the posterior scale ``sigma^2 = 1 / (N h + delta)``.
        hess_init: initial Hessian estimate ``h0 > 0`` (VOGN's name for its initial
            curvature too).
        betas: ``(beta1, beta2)``, the decays of the momentum of the gradient and of the
            Hessian estimate (default ``(0.9, 0.99999)``; torch's and VOGN's form, which LR
            schedulers that cycle the momentum edit).
        prior_precision: ``delta >= 0``, the whole precision of the prior ``N(0, 1 /
            delta)`` on the weights (VOGN's name and meaning); the update uses ``delta / N``
            (the IVON paper's and ivon-opt's weight decay). None: ``1e-4 * ess`` (their
            default weight decay 1e-4). ``h + delta / N`` must stay positive: with ``delta =
            0``, ``hess_init > 0`` keeps it so.
        mc_samples: draws per step when stepping with a closure (``>= 1``).
        hess_approx: ``"price"``, the reparameterisation estimate ``h^`` (ivon-opt's default
            and the only one IVON computes; ivon-opt's ``"gradsq"`` is refused).
        clip_radius: clip each coordinate of the preconditioned step (None or ``inf``: no
            clipping).
        sync: under ``torch.distributed`` with several processes, True averages ``g^`` and
            ``h^`` over the processes before each update (weighted by ``step(batch_size=)``),
            so every process makes the same update; False lets each process update on its
            own (ivon-opt's default; with ``DistributedDataParallel`` the gradients are
            averaged already, the Hessian estimates are not). None (default): refused at the
            first step of a run with several processes, which must choose; no effect in one
            process.
        debias: divide the momentum by ``1 - beta1^t`` (Adam's bias correction; ivon-opt's
            default).
        rescale_lr: ``alpha = lr * (hess_init + prior_precision / ess)``.
        antithetic: draw in mirrored pairs: every second draw is ``-z`` of the draw before
            it (within a step when ``mc_samples`` is even, else across consecutive steps),
            instead of a fresh ``z``. Each draw is still ``N(m, sigma^2)``, so ``g^`` and
            ``h^`` stay unbiased; over a pair the terms odd in ``z`` cancel (for a quadratic
            loss the pair's ``h^`` is ``a z^2`` whatever the gradient at ``m``, against ``a
            z^2 + g(m) z / sigma`` for independent draws), and half of the draws need no
            random numbers (on a CPU the normal fill is most of IVON's cost over Adam).
        weight_decay, beta1, beta2: ivon-opt's spellings, refused with fromp's
            (``prior_precision = weight_decay * ess``, ``betas = (beta1, beta2)``) and the
            value to write.

    Memory: the state (``g``, ``h``) and eight work buffers, flat, ``10 P`` numbers for ``P``
    parameters (``13 P`` after :meth:`set_prior`), against Adam's ``2 P``: for a torchvision
    ResNet-18 (11.7 M parameters, float32) about 470 MB. Every operation of a step is one
    pass over a flat vector (the draw 2 and a normal fill, the restore 2, the update 13).

    The state is torch's ``self.state[p]``: ``"step"``, ``"momentum"`` ``g``, ``"hess"``
    ``h`` and, after :meth:`set_prior`, ``"prior_mean"`` and ``"prior_precision"`` (shapes
    of the parameter).
    """

    def __init__(
        self,
        params: Iterable[Tensor] | Iterable[dict[str, Any]],
        lr: float,
        ess: float | None = None,
        hess_init: float = 1.0,
        *ivon_opt_positional: Any,
        betas: tuple[float, float] = DEFAULT_BETAS,
        prior_precision: float | None = None,
        mc_samples: int = 1,
        hess_approx: str = "price",
        clip_radius: float | None = None,
        sync: bool | None = None,
        debias: bool = True,
        rescale_lr: bool = True,
        antithetic: bool = False,
        weight_decay: float | None = None,
        beta1: float | None = None,
        beta2: float | None = None,
    ) -> None:
        if ivon_opt_positional:
            _refuse_positional(ivon_opt_positional)
        if ess is None:
            raise ValueError("ess is required: IVON(params, lr, ess=N), N the training-set size")
        ess = check_ess(ess)
        spelt = {k: v for k, v in zip(IVON_OPT_ONLY, (weight_decay, beta1, beta2)) if v is not None}
        if spelt:
            raise ValueError(ivon_opt_spelling(spelt, ess, betas, group=False))
        _refuse_hess_approx(hess_approx)
        if isinstance(params, nn.Module):
            raise ValueError("params must be an iterable of tensors (model.parameters())")
        if prior_precision is None:
            prior_precision = DEFAULT_WEIGHT_DECAY * ess
        defaults = dict(
            lr=lr,
            ess=ess,
            prior_precision=prior_precision,
            hess_init=hess_init,
            betas=tuple(betas) if isinstance(betas, list) else betas,
            mc_samples=mc_samples,
            clip_radius=clip_radius,
            sync=sync,
            debias=debias,
            rescale_lr=rescale_lr,
            antithetic=antithetic,
        )
        check_positive(lr, "lr")
        check_ivon_hyper(defaults)
        super().__init__(params, defaults)
        for i, group in enumerate(self.param_groups):
            check_positive(group["lr"], "lr")
            check_ivon_hyper(group, f"IVON(): param_groups[{i}]: ")
            for name in ("mc_samples", "antithetic", "sync"):
                if group[name] != defaults[name]:
                    raise ValueError(f"{name} is global: do not set it per parameter group")
            for p in group["params"]:
                if not p.is_floating_point():
                    raise ValueError(f"params must be floating point, got {p.dtype}")
            kinds = {(p.dtype, p.device) for p in group["params"]}
            if len(kinds) > 1:
                raise ValueError(
                    "params of one group must share dtype and device, got "
                    f"{sorted(map(str, kinds))}"
                )
        self._work_cache: dict[int, dict[str, Any]] = {}
        self._version = 0  # bumped when the prior or the loaded state changes
        self._drawn = False  # the parameters hold theta, the mean is in the work buffers
        self._n_acc = 0  # draws accumulated for the next step
        self._in_closure = False  # step(closure) holds a draw while the closure runs
        # antithetic: the z of the last fresh draw, per group, while its mirror is unused
        self._mirror: list[Tensor] | None = None
        self._states()  # self.state[p] for every parameter, as torch's optimizers keep it

    # ------------------------------------------------------------------ bookkeeping
    def _pairs(self) -> Iterator[tuple[dict[str, Any], Tensor]]:
        for group in self.param_groups:
            for p in group["params"]:
                yield group, p

    def _fresh(self, p: Tensor, group: dict[str, Any]) -> dict[str, Tensor]:
        """The state a parameter starts with (:meth:`_states`): ``momentum`` 0, ``hess``
        ``hess_init`` and, in a group whose parameters have a prior from :meth:`set_prior`,
        the group's prior ``N(0, 1 / delta)``."""
        st = {
            "momentum": torch.zeros_like(p, memory_format=torch.preserve_format).detach(),
            "hess": torch.full_like(p, group["hess_init"]).detach(),
        }
        if any("prior_precision" in self.state[q] for q in group["params"] if q is not p):
            st["prior_mean"] = torch.zeros_like(p).detach()
            st["prior_precision"] = torch.full_like(p, group["prior_precision"]).detach()
        return st

    def _state_changed(self) -> None:
        self._version += 1

    @property
    def antithetic(self) -> bool:
        return bool(self.param_groups[0]["antithetic"])

    @property
    def ess(self) -> float:
        """``N`` of the first group; setting it sets every group's."""
        return float(self.param_groups[0]["ess"])

    @ess.setter
    def ess(self, value: float) -> None:
        value = check_positive(value, "ess")
        for group in self.param_groups:
            group["ess"] = value

    @staticmethod
    def _delta(group: dict[str, Any], st: dict[str, Tensor]) -> Tensor | float:
        """``delta``: ``p0 / N`` after :meth:`set_prior`, else the weight decay."""
        if "prior_precision" in st:
            return st["prior_precision"] / group["ess"]
        return float(group["prior_precision"]) / float(group["ess"])

    # ------------------------------------------------------------------ work buffers
    _BUFFERS = ("mom", "hess", "den", "rsd", "z", "mean", "ga", "ha", "buf", "gx")

    def _work(self, gi: int, group: dict[str, Any], states: list[dict[str, Tensor]]) -> dict:
        """Flat ``[P_g]`` buffers of group ``gi`` and their per-parameter views, reused across
        steps (fresh temporaries cost page faults on every step on a CPU), so that every
        operation of a step is one pass over a flat vector:

        - ``mom`` / ``hess``: flat copies of the state ``g`` and ``h`` of ``self.state``
          (copied in after a load, a device move, a new prior or a new parameter; written
          back after every update);
        - ``den = h + delta`` and ``rsd = den^{-1/2}`` of the current ``h`` (``sigma =
          rsd / sqrt(N)``), kept from the last update;
        - ``z`` (the standard-normal draw), ``mean`` (``m`` while the parameters hold
          ``theta``), ``ga`` / ``ha`` (sums of ``g^`` and ``h^`` over the draws), ``gx``
          (the gradient of :meth:`add_gradient`), ``buf`` (scratch);
        - after :meth:`set_prior`: ``m0`` and ``p0`` (copies of the state) and ``dvec =
          p0 / N``.

        Memory: ``10 P`` numbers (``13 P`` with a prior)."""
        params = group["params"]
        p0 = params[0]
        key = (tuple(p.shape for p in params), p0.dtype, p0.device)
        work = self._work_cache.get(gi)
        if work is None or work["key"] != key:
            work = {"key": key, "den_key": None, "pending": False, "has_gx": False}
            for name in self._BUFFERS:
                self._flat(work, name, params)
            self._work_cache[gi] = work
        prior = "prior_precision" in states[0]
        src = (
            self._version,
            prior,
            [id(v) for st in states for v in st.values() if isinstance(v, Tensor)],
        )
        if work.get("src") != src:  # the state was replaced or edited: copy it in
            torch._foreach_copy_(work["mom_v"], [st["momentum"] for st in states])
            torch._foreach_copy_(work["hess_v"], [st["hess"] for st in states])
            if prior:
                if "m0" not in work:
                    for name in ("m0", "p0", "dvec"):
                        self._flat(work, name, params)
                torch._foreach_copy_(work["m0_v"], [st["prior_mean"] for st in states])
                torch._foreach_copy_(work["p0_v"], [st["prior_precision"] for st in states])
            work["src"], work["den_key"] = src, None
        return work

    @staticmethod
    def _flat(work: dict[str, Any], name: str, params: list[Tensor]) -> None:
        p0 = params[0]
        flat = torch.empty(sum(p.numel() for p in params), dtype=p0.dtype, device=p0.device)
        work[name] = flat
        work[name + "_v"] = param_views(flat, params)

    def _den_key(self, group: dict[str, Any]) -> tuple[Any, ...]:
        """What ``den`` depends on besides ``h``: it is recomputed when this changes."""
        return (group["ess"], group["prior_precision"], self._version, self._step_count())

    @staticmethod
    def _set_den(work: dict[str, Any], group: dict[str, Any], prior: bool) -> None:
        """``den = h + delta``, ``rsd = den^{-1/2}`` (and ``dvec = p0 / N`` with a prior)."""
        if prior:
            torch.div(work["p0"], group["ess"], out=work["dvec"])
            torch.add(work["hess"], work["dvec"], out=work["den"])
        else:
            torch.add(work["hess"], group["prior_precision"] / group["ess"], out=work["den"])
        torch.rsqrt(work["den"], out=work["rsd"])

    def _group_states(self) -> list[list[dict[str, Any]]]:
        states, out, i = self._states(), [], 0
        for group in self.param_groups:
            out.append(states[i : i + len(group["params"])])
            i += len(group["params"])
        return out

    def _group_work(self) -> list[tuple[dict[str, Any], dict[str, Any], bool]]:
        states = self._states()
        out, i = [], 0
        for gi, group in enumerate(self.param_groups):
            n = len(group["params"])
            sts = states[i : i + n]
            i += n
            out.append((group, self._work(gi, group, sts), "prior_precision" in sts[0]))
        return out

    @staticmethod
    def _gz(w: dict[str, Any], out: Tensor) -> Tensor:
        """``out = g^ z / rsd = s c h^`` of a single accumulated draw ``theta = m + s sigma
        z`` (``sigma = c rsd``, ``s = +-1``)."""
        return torch.mul(w["ga"], w["z"], out=out).div_(w["rsd"])

    @classmethod
    def _fold_pending(cls, w: dict[str, Any]) -> None:
        """``ha = h^ = s g^ z / sigma`` of a single accumulated draw, formed on demand (the
        update fuses it otherwise)."""
        if w["pending"]:
            cls._gz(w, w["ha"]).mul_(w["sign"] / w["c"])
            w["pending"] = False

    # ------------------------------------------------------------------ sampling
    @property
    def sampled(self) -> bool:
        """Whether the parameters currently hold a draw ``theta`` (not the mean)."""
        return self._drawn

    @torch.no_grad()
    def draw(self, generator: torch.Generator | None = None) -> None:
        """Write ``theta = m + sigma z``, ``z ~ N(0, I)``, ``sigma^2 = 1 / (N (h + delta))``,
        into the parameters (the mean is kept aside). Pair with :meth:`restore` (or use
        :meth:`sampled_params`).

        Memory: ten flat buffers of the size of the parameters, kept between steps."""
        if self._drawn and self._in_closure:
            raise RuntimeError(
                "IVON.step(closure) draws the weights itself and runs the closure at each of "
                "its mc_samples draws: the closure must not draw (ivon-opt's closures hold "
                "`with optimizer.sampled_params(train=True):`); remove that `with` from the "
                "closure, or run the `with` blocks and then call step() without a closure"
            )
        if self._drawn:
            raise RuntimeError("IVON.draw(): the parameters already hold a draw; restore() first")
        check_groups(self.param_groups, "IVON.draw()")
        mirror = self._mirror
        for gi, (group, w, prior) in enumerate(self._group_work()):
            if w["den_key"] != self._den_key(group):  # else computed by the last update
                self._set_den(w, group, prior)
                w["den_key"] = self._den_key(group)
            self._fold_pending(w)  # a second draw before the step overwrites z
            w["c"] = float(group["ess"]) ** -0.5  # sigma = c rsd
            if mirror is not None:  # theta = m - sigma z of the last fresh draw
                if mirror[gi] is not w["z"]:
                    w["z"].copy_(mirror[gi])
                w["sign"] = -1.0
            else:
                w["z"].normal_(generator=generator)
                w["sign"] = 1.0
            params = group["params"]
            torch._foreach_copy_(w["mean_v"], params)
            torch._foreach_addcmul_(params, w["z_v"], w["rsd_v"], value=w["sign"] * w["c"])
        if mirror is not None:
            self._mirror = None
        elif self.antithetic:
            self._mirror = [self._work_cache[gi]["z"] for gi in range(len(self.param_groups))]
        self._drawn = True

    @torch.no_grad()
    def restore(self, accumulate: bool = True) -> None:
        """Write the mean back into the parameters. With ``accumulate``, first read the
        gradient ``g^`` at the draw from ``.grad`` (None counts as zero) and add ``g^`` and
        ``h^ = g^ (theta - m) / sigma^2 = g^ z / sigma`` to the sums that the next
        :meth:`step` averages."""
        if not self._drawn:
            raise RuntimeError("IVON.restore(): no draw to restore (call draw() first)")
        try:
            for group, w, _ in self._group_work() if accumulate else ():
                grads = [
                    torch.zeros_like(p) if p.grad is None else p.grad.detach()
                    for p in group["params"]
                ]
                if self._n_acc == 0:  # h^ = g^ z / sigma is formed by the update
                    torch._foreach_copy_(w["ga_v"], grads)
                    w["pending"] = True
                else:
                    torch._foreach_add_(w["ga_v"], grads)
                    torch.div(w["z"], w["rsd"], out=w["buf"])  # z stays for its mirror
                    torch._foreach_addcmul_(w["ha_v"], grads, w["buf_v"], value=w["sign"] / w["c"])
            if accumulate:
                self._n_acc += 1
        finally:
            for gi, group in enumerate(self.param_groups):
                torch._foreach_copy_(group["params"], self._work_cache[gi]["mean_v"])
            self._drawn = False

    @torch.no_grad()
    def add_gradient(self, grads: Iterable[Tensor | None] | None = None) -> None:
        """Add the gradient of a deterministic term of the objective, evaluated at the mean
        ``m`` (e.g. a regulariser of the mean function, such as FROMP's), to the next
        :meth:`step`: it enters the momentum ``g`` as ``g^ + grad``, not the Hessian
        estimate ``h^`` (whose reparameterisation estimate ``g^ (theta - m) / sigma^2`` is
        for gradients at the draws). The objective is then ``E_q[l(theta)] + r(m)``, whose
        natural-gradient step for the mean is ``(g^ + grad r(m) + delta m) / (h + delta)``.

        Args:
            grads: one tensor (or None: zero) per parameter in parameter-group order; None:
                read ``.grad`` of the parameters (call ``backward()`` at the mean first).

        Call after :meth:`restore` (at least one draw accumulated) and before :meth:`step`;
        several calls add up.
        """
        if self._drawn:
            raise RuntimeError("IVON.add_gradient(): the parameters hold a draw; restore() first")
        if self._n_acc == 0:
            raise RuntimeError(
                "IVON.add_gradient(): no draw accumulated yet; it adds to the gradient of "
                "the next step, so call it after restore(accumulate=True)"
            )
        params = self.params
        if grads is None:
            grads = [None if p.grad is None else p.grad.detach() for p in params]
        else:
            grads = list(grads)
            if len(grads) != len(params):
                raise ValueError(f"grads must hold {len(params)} tensors, got {len(grads)}")
        for i, (g, p) in enumerate(zip(grads, params)):
            if g is not None and g.shape != p.shape:
                raise ValueError(
                    f"grads[{i}] must have shape {tuple(p.shape)}, got {tuple(g.shape)}"
                )
        i = 0
        for _, w, _ in self._group_work():
            if not w["has_gx"]:
                w["gx"].zero_()
                w["has_gx"] = True
            for view in w["gx_v"]:
                g = grads[i]
                i += 1
                if g is not None:
                    view.add_(g.to(view))

    @contextmanager
    def sampled_params(
        self, train: bool = False, generator: torch.Generator | None = None
    ) -> Iterator[None]:
        """Hold a draw ``theta ~ q`` in the parameters inside the ``with`` block; the mean is
        restored on exit, also when the block raises. With ``train=True`` (training), a block
        that exits normally contributes its ``.grad`` (at ``theta``) to the next
        :meth:`step`; zero the gradients inside the block before ``backward()``. Without
        (prediction, ivon-opt's default), the block leaves the next step as it was."""
        self.draw(generator)
        ok = False
        try:
            yield
            ok = True
        finally:
            self.restore(accumulate=train and ok)

    # ------------------------------------------------------------------ update
    @torch.no_grad()
    def step(  # type: ignore[override]
        self, closure: Callable[[], Tensor] | None = None, *, batch_size: int | None = None
    ) -> Tensor | None:
        """One IVON update.

        With ``closure`` (zeroes the gradients, computes the mean loss, calls
        ``backward()``, returns the loss: the protocol VOGN shares): ``mc_samples`` draws,
        each evaluated inside :meth:`sampled_params`; returns the mean loss. The closure
        does not draw (ivon-opt's closures enter ``sampled_params(train=True)`` themselves:
        refused, naming the difference). Without: averages the draws accumulated since the
        last step (at least one :meth:`sampled_params` block with ``train=True``).

        Several processes (``torch.distributed`` initialised, more than one rank), with
        ``sync=True``: the averaged ``g^``, ``h^`` (and :meth:`add_gradient`'s term) of this
        rank, means over its ``batch_size`` examples, become the means over all ranks' examples,
        ``sum_r M_r g^_r / sum_r M_r`` (:func:`fromp.distributed.mean_over_ranks`;
        ``batch_size=None`` weighs the ranks equally, right when they have equal batches),
        before the update, so every rank makes the same update. Each rank's ``h^`` comes
        from its own draw: seed each rank differently (``torch.manual_seed(seed +
        fromp.distributed.rank())``, as in IVON's multi-GPU runs) and the ``h^`` of the
        ranks average like ``world_size`` Monte Carlo samples; with one seed on every rank
        the draws are equal and the step is exactly one process's on the global batch. With
        ``sync=False`` each rank updates on its own statistics (ivon-opt's default)."""
        check_groups(self.param_groups, "IVON.step()")
        sync = self.param_groups[0]["sync"]
        if sync is None and is_distributed():
            raise ValueError(
                f"IVON.step(): torch.distributed runs {world_size()} processes and IVON was "
                "built without sync: pass IVON(..., sync=True) to average the gradient and "
                "Hessian estimates over the processes (weighted by step(batch_size=...)), or "
                "sync=False to let each process update on its own (ivon-opt's default)"
            )
        loss = None
        if closure is not None:
            if self._n_acc:
                raise RuntimeError("IVON.step(closure): draws were already accumulated")
            total = 0.0
            try:
                for _ in range(self.mc_samples):
                    with self.sampled_params(train=True), torch.enable_grad():
                        for p in self.params:  # a closure that never calls backward(): None
                            p.grad = None
                        self._in_closure = True
                        try:
                            value = closure()
                        finally:
                            self._in_closure = False
                        check_closure_result("IVON", value, self.params)
                    total = total + torch.as_tensor(value).detach()
            except BaseException:
                self._discard()  # the draws of this step so far: the state is unchanged
                raise
            loss = total / self.mc_samples
        if self._drawn:
            raise RuntimeError("IVON.step(): the parameters hold a draw; restore() it first")
        if self._n_acc == 0:
            raise RuntimeError(
                "IVON.step() needs gradients at sampled weights: compute the loss and "
                "backward() inside `with opt.sampled_params(train=True):`, or pass a closure"
            )
        work = self._group_work()
        if sync and is_distributed():
            bufs = []
            for _, w, _ in work:
                self._fold_pending(w)  # h^ of this rank's draw, before the average
                bufs += [w["ga"], w["ha"]] + ([w["gx"]] if w["has_gx"] else [])
            mean_over_ranks(bufs, 1.0 if batch_size is None else batch_size)
        finite = torch.stack([torch.isfinite(w["ga"]).all() for _, w, _ in work]).all()
        if not bool(finite):  # one host sync per step; refuse before any state changes
            self._discard()
            raise FloatingPointError(
                "IVON.step(): the gradient at the sampled weights is not finite (a NaN or "
                "infinite loss?); the weights and the optimizer state are unchanged"
            )
        self._update(self._n_acc)
        self._n_acc = 0
        return loss

    def _discard(self) -> None:
        """Forget the draws accumulated for the next step (and any added gradient)."""
        self._n_acc = 0
        for w in self._work_cache.values():
            w["pending"] = False
            w["has_gx"] = False

    def _update(self, n_draws: int) -> None:
        """The update of the module docstring, in place in the flat buffers, from the sums
        ``ga`` (``g^``) and ``ha`` (``h^``) over ``n_draws`` draws (or, for one draw,
        ``h^ = g^ z / sigma`` formed here) and ``rsd`` of the draws (old ``h``); leaves
        ``den`` and ``rsd`` of the new ``h`` for the next draw. 13 passes over ``[P]``
        (12 without ``clip_radius``), fewer than half of them divisions or square roots."""
        work = self._group_work()
        t = self._step_count() + 1
        for st in self._states():
            st["step"] = t
        for (group, w, prior), sts in zip(work, self._group_states()):
            params = group["params"]
            b1, b2 = group["betas"]
            wd = group["prior_precision"] / group["ess"]  # delta / N
            bc1 = 1 - b1**t if group["debias"] else 1.0
            ga, ha, buf, hess, mom = w["ga"], w["ha"], w["buf"], w["hess"], w["mom"]
            den, rsd, c = w["den"], w["rsd"], w["c"]
            if n_draws > 1:
                ga.div_(n_draws)
            mom.lerp_(ga, 1 - b1)  # g <- b1 g + (1 - b1) g^
            if w["has_gx"]:
                mom.add_(w["gx"], alpha=1 - b1)  # the deterministic term: g^ + grad r(m)
                w["has_gx"] = False
            # buf = s c (h^ - h), with sigma = c rsd of the draws (old h) and s = +-1
            if w["pending"]:  # one draw, theta = m + s sigma z: h^ = s g^ z / sigma
                s = w["sign"]
                self._gz(w, buf).sub_(hess, alpha=s * c)
                w["pending"] = False
            else:
                s = 1.0
                torch.sub(ha, hess, alpha=n_draws, out=buf).mul_(c / n_draws)
            # h <- h + (1 - b2)(h^ - h) + (1 - b2)^2 (h - h^)^2 / (2 (h + delta)), old h
            hess.add_(buf, alpha=s * (1 - b2) / c)
            buf.mul_(rsd)  # c (h^ - h) / sqrt(h + delta)
            hess.addcmul_(buf, buf, value=(1 - b2) ** 2 / (2 * c * c))
            self._set_den(w, group, prior)  # den, rsd of the new h
            # buf = bc1 (gb + delta (m - m0)) / (h + delta), the step before the 1/bc1 factor
            torch.div(mom, den, out=buf)
            if prior:
                torch._foreach_copy_(w["ga_v"], params)
                ga.sub_(w["m0"]).mul_(w["dvec"])
                buf.addcdiv_(ga, den, value=bc1)
            elif wd:
                torch._foreach_addcdiv_(w["buf_v"], params, w["den_v"], value=wd * bc1)
            if group["clip_radius"] is not None and math.isfinite(group["clip_radius"]):
                buf.clamp_(-group["clip_radius"] * bc1, group["clip_radius"] * bc1)
            alpha = group["lr"]
            if group["rescale_lr"]:
                alpha = alpha * (group["hess_init"] + wd)
            torch._foreach_add_(params, w["buf_v"], alpha=-alpha / bc1)
            torch._foreach_copy_([st["momentum"] for st in sts], w["mom_v"])  # into self.state
            torch._foreach_copy_([st["hess"] for st in sts], w["hess_v"])
            w["den_key"] = self._den_key(group)

    # ------------------------------------------------------------------ (de)serialisation
    def state_dict(self) -> dict[str, Any]:
        """torch's optimizer state dict: ``"state"`` (per parameter index: ``"step"``,
        ``"momentum"``, ``"hess"`` and, after :meth:`set_prior`, ``"prior_mean"`` and
        ``"prior_precision"``; with ``antithetic``, ``"mirror"``, the draw the next one
        mirrors) and ``"param_groups"``. The tensors are the live ones, as torch's (copy
        them to keep them)."""
        if self._drawn:
            raise RuntimeError("IVON.state_dict(): the parameters hold a draw; restore() first")
        self._states()
        out = super().state_dict()
        out["state"] = {i: dict(st) for i, st in out["state"].items()}
        if self._mirror is not None:  # antithetic: the next draw mirrors this z
            views = [v for g in self._mirror for v in self._split(g)]
            for i, v in enumerate(views):
                out["state"][i]["mirror"] = v.clone()
        return out

    def _split(self, flat: Tensor) -> list[Tensor]:
        """A flat group vector as per-parameter views (the group is found by its size)."""
        for group in self.param_groups:
            if sum(p.numel() for p in group["params"]) == flat.numel():
                return param_views(flat, group["params"])
        raise ValueError("a mirror draw that fits no parameter group")

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Inverse of :meth:`state_dict`, refused before any change when it does not fit
        (the parameters themselves, i.e. the mean, are the model's: load them with the
        model). Groups saved without ``sync`` or ``debias`` (before they existed) get what
        that optimizer did: ``sync=True``, ``debias=True``. An
        ivon-opt state dict is refused: it has no step count (ivon-opt restarts its bias
        correction after a load), so no run continues from it as it would have."""
        groups = [dict(g) for g in state_dict.get("param_groups", [])]
        if any("hess" in g for g in groups) or "count" in state_dict.get("state", {}):
            raise ValueError(
                "IVON.load_state_dict: this is an ivon-opt state dict (its groups hold "
                "'momentum' and 'hess'); it records no step count, which the momentum's bias "
                "correction needs, so fromp.IVON cannot continue it: load the model's weights "
                "and start fromp.IVON from them, or finish the run with ivon-opt"
            )
        state_dict = {**state_dict, "param_groups": [{**_NEW_KEYS, **g} for g in groups]}
        # refuse before anything is replaced: torch's load overwrites the groups
        check_groups(state_dict["param_groups"], "IVON.load_state_dict")
        check_param_state(state_dict.get("state", {}), self.params, ("momentum", "hess"), "IVON")
        super().load_state_dict(state_dict)
        mirror = []
        for st in self._own_state_copies():
            if "mirror" in st:
                mirror.append(st.pop("mirror"))
        self._mirror = None
        if mirror:
            self._mirror, i = [], 0
            for group in self.param_groups:
                k = len(group["params"])
                self._mirror.append(torch.cat([z.reshape(-1) for z in mirror[i : i + k]]))
                i += k
        self._n_acc = 0
        self._version += 1
