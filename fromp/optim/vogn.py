r"""Variational Online Gauss-Newton (VOGN) and its deterministic variant OGN.

VOGN (Khan et al., 2018; Osawa et al., 2019) fits a mean-field Gaussian
``q(w) = N(mu, diag(sigma^2))`` to the (tempered) posterior of a network trained with
``N`` examples, a prior ``p(w) = N(mu_0, diag(1 / delta))`` and a KL weight (temperature)
``tau``. With the data term written as a mean over examples, every step

1. draws ``w ~ q`` (``mc_samples`` draws; ``mc_samples = 0`` is OGN: ``w = mu``),
2. computes on a mini-batch of ``M`` examples, at ``w``, the mean gradient
   ``g = (1/M) sum_i g_i`` and a per-example curvature ``h = (1/M) sum_i h_i`` with
   ``g_i = d nll(f(x_i; w), y_i) / dw`` and either ``h_i = g_i^2`` (``curvature="ef"``, the
   squared per-example gradients of VOGN) or the exact diagonal of the per-example GGN
   ``h_i = diag(J_i^T Lambda_i J_i)`` (``curvature="ggn"``), averaged over the draws,
3. updates (Adam's convention: ``beta`` is the decay)::

       delta~ = tau * delta / N
       m  <- beta1 m + (1 - beta1) (g + delta~ (mu - mu_0))
       s  <- beta2 s + (1 - beta2) h
       mu <- mu - lr * m^ / (s^ + delta~)

   with ``m^ = m / (1 - beta1^t)`` and ``s^ = s / (1 - beta2^t)`` when ``bias_correction``
   (the correction of ``s`` only applies when ``s`` starts at zero, i.e.
   ``init_precision=None``; otherwise ``s^ = s``).

The posterior is ``q = N(mu, diag(1 / (N (s^ + delta~) / tau)))``: precision
``N s^ / tau + delta``. For ``tau = 1`` this is ``N (s^ + delta~)``. As in ``torchsso``
(the reference implementation of Osawa et al.), ``init_precision`` is the initial value of
``s`` (so ``q`` starts with precision ``N s_0 / tau + delta``) and ``kl_weight`` scales
both the prior term and the sampling variance.

Everything is kept as flat ``[P]`` vectors, parameters in ``named_parameters()`` order
(trainable only), the order of :func:`fromp.jacobian.flat_params`.

Per-example quantities are exact for any architecture (convolutions with weight sharing
included). By default (``method="auto"``) squared gradients of models made of the layers
that :mod:`fromp.capture` handles (``Linear``, ``Conv1d/2d``, batch norm, ``LayerNorm``,
``GroupNorm``) come from one forward and one backward pass with layer capture
(``sum_i g_i^2 = (d^2)^T (a^2)`` for a linear layer; for a convolution the per-example
weight gradients of that layer alone, from its unfolded input); anything else uses
``torch.func.vmap`` over ``grad`` (``jacrev`` for the GGN), chunked over examples so that
peak memory is ``chunk_size * P`` numbers. Both are checked against loops over examples in
``tests/test_vogn.py``.

Typical use::

    opt = VOGN(model, lr=1e-3, train_set_size=len(train_x), prior_precision=100.0,
               kl_weight=0.02)
    for x, y in loader:
        loss = opt.step(x, y)            # samples w ~ q, per-example stats, update
    q = opt.posterior()                  # DiagonalGaussian over the flat parameters
    probs = predict_mc(model, q, x_test, n_samples=20)

Batch norm: its affine parameters get a posterior like any other parameter. Per-example
gradients cannot use batch statistics, so the per-example pass runs the batch-norm layers
in ``eval()`` mode (normalising with the running statistics); when the model is in
training mode, :meth:`VOGN.step` first runs one no-grad training-mode forward pass of the
mini-batch at the first sampled weights to update the running statistics. Dropout stays
active in training mode (independent masks per example).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import Tensor, nn
from torch.func import functional_call, grad_and_value, jacrev, vmap

from fromp.capture import LayerCall, capture_calls, squared_grad_sums, supported_layer
from fromp.likelihood import Likelihood, get_likelihood
from fromp.posterior import DiagonalGaussian

__all__ = [
    "OGN",
    "VOGN",
    "GradStats",
    "LayerCapture",
    "per_example_grad_stats",
    "predict_mc",
    "predict_mean",
]

LossFn = Callable[[Tensor, Tensor], Tensor]
_BN = (nn.modules.batchnorm._BatchNorm,)


class GradStats:
    """Mini-batch statistics at one set of weights.

    Attributes:
        loss: mean per-example loss (scalar tensor).
        grad: ``(1/M) sum_i g_i`` ``[P]`` (None when not requested).
        curv: ``(1/M) sum_i h_i`` ``[P]`` (squared gradients or GGN diagonal).
        n: ``M``.
    """

    def __init__(self, loss: Tensor, grad: Tensor | None, curv: Tensor, n: int) -> None:
        self.loss, self.grad, self.curv, self.n = loss, grad, curv, n


@contextmanager
def _bn_eval(model: nn.Module) -> Iterator[None]:
    """Temporarily put the batch-norm layers of ``model`` in eval mode."""
    changed = [m for m in model.modules() if isinstance(m, _BN) and m.training]
    for m in changed:
        m.eval()
    try:
        yield
    finally:
        for m in changed:
            m.train()


def _has_bn(model: nn.Module) -> bool:
    return any(isinstance(m, _BN) for m in model.modules())


def _loss_fn(loss: Likelihood | LossFn | str) -> LossFn:
    if isinstance(loss, str | Likelihood):
        return get_likelihood(loss).nll
    if callable(loss):
        return loss
    raise ValueError(f"loss must be a Likelihood, a likelihood name or a callable, got {loss!r}")


def _hook_supported(model: nn.Module) -> bool:
    """Whether every trainable parameter sits directly in one layer that
    :mod:`fromp.capture` handles (``Linear``, ``Conv1d/2d``, batch norm with running
    statistics, ``LayerNorm``, ``GroupNorm``); batch norm in training mode counts, since the
    per-example pass runs it in eval mode."""
    owners: dict[int, int] = {}
    for m in model.modules():
        own = [p for p in m.parameters(recurse=False) if p.requires_grad]
        if not own:
            continue
        for p in own:
            owners[id(p)] = owners.get(id(p), 0) + 1
        if isinstance(m, _BN) and type(m) in _BN_TYPES:
            if m.running_mean is None or m.running_var is None:
                return False
        elif not supported_layer(m):
            return False
    return all(c == 1 for c in owners.values())


_BN_TYPES = (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d)
_LAYOUT_CACHE: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _layout(
    model: nn.Module,
) -> tuple[bool, dict[str, Tensor], dict[int, tuple[nn.Module, str]], dict[tuple[int, str], str]]:
    """``(hooks supported, trainable params by name, id(param) -> (layer, name),
    (id(layer), name) -> param name)``, cached per model while its trainable parameters stay
    the same objects."""
    named = {n: p for n, p in model.named_parameters() if p.requires_grad}
    sig = tuple(id(p) for p in named.values())
    hit = _LAYOUT_CACHE.get(model)
    if hit is not None and hit[0] == sig:
        return hit[1]
    owner: dict[int, tuple[nn.Module, str]] = {}
    for m in model.modules():
        for pn, p in m.named_parameters(recurse=False):
            if p.requires_grad:
                owner[id(p)] = (m, pn)
    name_of = {(id(owner[id(p)][0]), owner[id(p)][1]): n for n, p in named.items()}
    out = (_hook_supported(model), named, owner, name_of)
    _LAYOUT_CACHE[model] = (sig, out)
    return out


def _captured_squares(
    calls: list[LayerCall], grads: tuple[Tensor | None, ...], name_of: dict, h_sum: dict
) -> None:
    """Add ``sum_i g_i^2`` of every captured layer (output gradients ``grads``) to ``h_sum``."""
    for c, g in zip(calls, grads):
        if g is None:
            continue
        for pn, t in squared_grad_sums(c.module, c.a, g.detach().unsqueeze(0)).items():
            name = name_of.get((id(c.module), pn))
            if name is not None:
                h_sum[name] += t


def _ef_stats_hooks(
    model: nn.Module, x: Tensor, y: Tensor, nll: LossFn, step: int, need_grad: bool = True
) -> GradStats | None:
    """Squared per-example gradients from layer inputs and output gradients
    (:mod:`fromp.capture`; one forward and one backward per chunk, the mean gradient from
    the same backward). Returns None when a layer is called more than once."""
    _, named, owner, name_of = _layout(model)
    layers = list(dict.fromkeys(m for m, _ in owner.values()))
    p0 = next(iter(named.values()))
    total = sum(p.numel() for p in named.values())
    g_flat = torch.zeros(total, dtype=p0.dtype, device=p0.device)
    h_flat = torch.zeros(total, dtype=p0.dtype, device=p0.device)
    g_sum, h_sum, i = {}, {}, 0
    for n, p in named.items():
        g_sum[n] = g_flat[i : i + p.numel()].view_as(p)
        h_sum[n] = h_flat[i : i + p.numel()].view_as(p)
        i += p.numel()
    loss_sum = torch.zeros((), dtype=p0.dtype, device=x.device)
    params = list(named.values()) if need_grad else []
    for s in range(0, len(x), step):
        with torch.enable_grad(), capture_calls(layers) as calls:
            f = model(x[s : s + step])
            losses = nll(f, y[s : s + step])
        if losses.shape != (len(f),):
            raise ValueError(f"loss must return per-example values [B], got {tuple(losses.shape)}")
        if len({id(c.module) for c in calls}) != len(calls):
            return None
        zs = [c.z for c in calls]
        grads = torch.autograd.grad(losses.sum(), zs + params, allow_unused=True)
        _captured_squares(calls, grads[: len(zs)], name_of, h_sum)
        for n, g in zip(named, grads[len(zs) :]):
            if g is not None:
                g_sum[n] += g
        loss_sum = loss_sum + losses.detach().sum()
    n_ex = len(x)
    grad = g_flat.div_(n_ex) if need_grad else None
    return GradStats(loss_sum / n_ex, grad, h_flat.div_(n_ex), n_ex)


class LayerCapture:
    """Records the inputs and outputs of the parametrised layers of ``model`` during the
    forward passes inside the ``with`` block (:func:`fromp.capture.capture_calls`), so that
    the squared per-example gradients of a loss of those outputs can be computed afterwards
    from the output gradients (:meth:`squared_grads`) without another forward pass.

    Usable when ``supported``: all parameters in layers :mod:`fromp.capture` handles and no
    batch-norm layer in training mode (batch statistics couple the examples).
    """

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        ok, self._named, self._owner, self._name_of = _layout(model)
        bn_train = any(isinstance(m, _BN) and m.training for m in model.modules())
        self.supported = ok and not bn_train
        self.calls: list[LayerCall] = []
        self._ctx: Any = None

    def __enter__(self) -> LayerCapture:
        layers = list(dict.fromkeys(m for m, _ in self._owner.values()))
        self._ctx = capture_calls(layers)
        self.calls = self._ctx.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        if self._ctx is not None:
            self._ctx.__exit__(None, None, None)
            self._ctx = None

    def squared_grads(self, losses: Tensor) -> Tensor | None:
        """``(1/M) sum_i g_i^2`` ``[P]`` for per-example ``losses [M]`` computed from the
        captured forward pass (the graph is retained for a later backward). None when it
        cannot be done exactly (unsupported model, a layer called more than once)."""
        if not self.supported or not self.calls:
            return None
        if len({id(c.module) for c in self.calls}) != len(self.calls):
            return None
        zs = [c.z for c in self.calls]
        grads = torch.autograd.grad(losses.sum(), zs, retain_graph=True, allow_unused=True)
        h_sum = {n: torch.zeros_like(p) for n, p in self._named.items()}
        _captured_squares(self.calls, grads, self._name_of, h_sum)
        return torch.cat([t.reshape(-1) for t in h_sum.values()]).div_(len(losses))


def per_example_grad_stats(
    model: nn.Module,
    x: Tensor,
    y: Tensor,
    loss: Likelihood | LossFn | str = "categorical",
    *,
    curvature: str = "ef",
    chunk_size: int | None = None,
    method: str = "auto",
    need_grad: bool = True,
) -> GradStats:
    r"""Mean gradient and mean per-example curvature of a mini-batch at the model's weights.

    For ``g_i = d loss(f(x_i), y_i) / dw`` (``[P]``, ``w`` the trainable parameters):

    * ``grad = (1/M) sum_i g_i``,
    * ``curv = (1/M) sum_i g_i ** 2`` for ``curvature="ef"``, or
      ``(1/M) sum_i diag(J_i^T Lambda_i J_i) = (1/M) sum_i sum_k (L_i^T J_i)_k ** 2`` for
      ``curvature="ggn"`` (``J_i [C, P]`` the output Jacobian, ``Lambda_i = L_i L_i^T`` the
      likelihood's output Hessian; needs ``loss`` to be a :class:`Likelihood`).

    Two exact implementations (``method``):

    * ``"vmap"``: ``vmap(grad_and_value)`` (``vmap(jacrev)`` for the GGN) over examples, any
      architecture; forms the per-example gradients ``[chunk, P]``.
    * ``"hooks"`` (``curvature="ef"`` only): one forward and one backward of the summed loss
      record each layer's input ``a_i`` and output gradient ``d_i``; for a linear layer
      ``sum_i g_i^2 = (d^2)^T (a^2)`` without forming per-example gradients, for a
      convolution (weight sharing) the per-example gradients are formed for that layer only
      (one grouped weight-gradient convolution, batch as groups), batch norm (eval mode)
      uses ``xhat_i`` (:mod:`fromp.capture`). Supports models whose parameters all live in
      ``Linear``, ``Conv1d/2d``, batch-norm, ``LayerNorm`` and ``GroupNorm`` layers, each
      called once per forward pass.
    * ``"auto"``: ``"hooks"`` when supported, else ``"vmap"``.

    Work is done in chunks of ``chunk_size`` examples. Batch-norm layers run in eval mode
    (see the module docstring); dropout masks differ per example.

    Args:
        model: maps ``[M, ...] -> [M, C]`` (fix a head with :func:`fromp.models.with_task`).
        x: ``[M, ...]`` inputs. y: ``[M]`` (or ``[M, C]``) targets.
        loss: per-example loss ``(f [B, C], y [B]) -> [B]`` or a likelihood (its ``nll``).
        curvature: ``"ef"`` or ``"ggn"``.
        chunk_size: examples per vectorised call (None: the whole batch).
        method: ``"auto"``, ``"hooks"`` or ``"vmap"`` (above).
        need_grad: False skips the mean gradient where that saves work (hook path); the
            returned ``grad`` is then None.
    """
    if curvature not in ("ef", "ggn"):
        raise ValueError(f"curvature must be 'ef' or 'ggn', got {curvature!r}")
    if method not in ("auto", "vmap", "hooks"):
        raise ValueError(f"method must be 'auto', 'vmap' or 'hooks', got {method!r}")
    if method == "hooks" and curvature != "ef":
        raise ValueError("method='hooks' supports curvature='ef' only")
    if not isinstance(x, Tensor) or x.ndim < 1 or len(x) == 0:
        raise ValueError(f"x must be a non-empty tensor [M, ...], got {getattr(x, 'shape', x)}")
    if len(y) != len(x):
        raise ValueError(f"y must have M={len(x)} entries, got {len(y)}")
    step = len(x) if chunk_size is None else int(chunk_size)
    if step < 1:
        raise ValueError(f"chunk_size must be a positive int or None, got {chunk_size}")
    if curvature == "ggn" and not isinstance(loss, str | Likelihood):
        raise ValueError("curvature='ggn' needs loss to be a Likelihood (or its name)")
    lik = get_likelihood(loss) if isinstance(loss, str | Likelihood) else None
    nll = _loss_fn(loss)

    params = {n: p.detach() for n, p in model.named_parameters() if p.requires_grad}
    if not params:
        raise ValueError("model has no trainable parameters")
    if curvature == "ef" and method != "vmap":
        supported = _layout(model)[0]
        if method == "hooks" and not supported:
            raise ValueError(
                "method='hooks' needs all parameters in Linear, Conv1d/2d, batch-norm (with "
                "running statistics), LayerNorm or GroupNorm layers; use method='vmap'"
            )
        if supported:
            with _bn_eval(model):
                stats = _ef_stats_hooks(model, x, y, nll, step, need_grad)
            if stats is not None:
                return stats
            if method == "hooks":
                raise ValueError("method='hooks' needs each layer to be called once per forward")
    buffers = dict(model.named_buffers())

    def out1(p: dict[str, Tensor], xi: Tensor) -> Tensor:
        f = functional_call(model, (p, buffers), (xi.unsqueeze(0),))
        if f.ndim != 2:
            raise ValueError(f"model output must have shape [M, C], got {tuple(f.shape)}")
        return f.squeeze(0)

    if curvature == "ef":

        def single(p: dict[str, Tensor], xi: Tensor, yi: Tensor) -> Tensor:
            return nll(out1(p, xi).unsqueeze(0), yi.unsqueeze(0)).sum()

        fn = vmap(grad_and_value(single), in_dims=(None, 0, 0), randomness="different")
    else:
        assert lik is not None

        def single_ggn(p: dict[str, Tensor], xi: Tensor, yi: Tensor):
            def both(q: dict[str, Tensor]) -> tuple[Tensor, Tensor]:
                f = out1(q, xi)
                return f, f

            jac, f = jacrev(both, has_aux=True)(p)
            f = f.detach()
            gf, val = grad_and_value(lambda ff: nll(ff.unsqueeze(0), yi.unsqueeze(0)).sum())(f)
            lt = lik.sqrt_hessian(f.unsqueeze(0)).squeeze(0)  # C, K
            g = {n: torch.tensordot(gf, j, dims=1) for n, j in jac.items()}
            h = {
                n: torch.tensordot(lt.transpose(0, 1), j, dims=1).pow(2).sum(0)
                for n, j in jac.items()
            }
            return g, h, val

        fn = vmap(single_ggn, in_dims=(None, 0, 0), randomness="different")

    g_sum = {n: torch.zeros_like(p) for n, p in params.items()}
    h_sum = {n: torch.zeros_like(p) for n, p in params.items()}
    loss_sum = torch.zeros((), dtype=next(iter(params.values())).dtype, device=x.device)
    with _bn_eval(model):
        for s in range(0, len(x), step):
            xs, ys = x[s : s + step], y[s : s + step]
            if curvature == "ef":
                g, val = fn(params, xs, ys)
                h = {n: t.pow(2).sum(0) for n, t in g.items()}
            else:
                g, h, val = fn(params, xs, ys)
                h = {n: t.sum(0) for n, t in h.items()}
            for n in params:
                g_sum[n] += g[n].sum(0)
                h_sum[n] += h[n]
            loss_sum = loss_sum + val.detach().sum()
    m = len(x)
    grad = torch.cat([t.reshape(-1) for t in g_sum.values()]) / m
    curv = torch.cat([t.reshape(-1) for t in h_sum.values()]) / m
    return GradStats(loss_sum / m, grad if need_grad else None, curv, m)


def _as_vector(value: float | Tensor, like: Tensor, name: str) -> Tensor:
    t = torch.as_tensor(value, dtype=like.dtype, device=like.device)
    if t.ndim == 0:
        t = t.expand_as(like)
    if t.shape != like.shape:
        raise ValueError(f"{name} must be a float or a [P]={like.numel()} tensor, got {t.shape}")
    return t.detach().clone()


class VOGN(torch.optim.Optimizer):
    r"""Variational Online Gauss-Newton with a diagonal Gaussian posterior.

    See the module docstring for the update. The optimiser keeps its own flat state
    (``mu``, ``s``, ``m``, step count, prior, ``N``) outside ``self.state``, so Avalanche's
    optimizer resets (``make_optimizer(reset_optimizer_state=True)``) do not erase the
    posterior; :meth:`state_dict` / :meth:`load_state_dict` carry it. After every step the
    parameters hold ``mu``.

    Two ways to step:

    * **Standalone** (exact, all MC samples): ``loss = opt.step(x, y)`` or
      ``opt.step(x, y, regularizer=fn)``. For each draw ``w ~ q`` the optimiser writes ``w``
      into the model, computes :func:`per_example_grad_stats` of the data loss, and, if
      given, ``fn()`` (a scalar using the model, e.g. a FROMP function-space regulariser):
      its gradient is added to ``g`` only, never to the curvature ``h``. The regulariser must
      be on the scale of the mean per-example loss (a term ``R`` of the full objective
      ``sum_i nll_i + R`` enters as ``R / N``). ``model=`` overrides the module used for the
      forward pass (e.g. ``with_task(net, t)``; it must share the parameters).
    * **Two-phase** (training loops that call ``loss.backward(); optimizer.step()``, such as
      Avalanche's; see :class:`strategies.vogn.VOGNPlugin`): ``opt.sample_params()`` before
      the forward pass, ``opt.set_curvature(h)`` after the backward pass with the per-example
      curvature of the data loss at the sampled weights, then ``opt.step()``: ``g`` is read
      from the parameters' ``.grad`` (everything that was back-propagated: data loss plus
      any regulariser). The lowest level is :meth:`update` ``(g, h)``.

    Args:
        params_or_model: the model (needed by the standalone step) or an iterable of its
            parameters (only the two-phase / :meth:`update` API then).
        lr: step size ``alpha``.
        betas: ``(beta1, beta2)`` decays of ``m`` and ``s``.
        train_set_size: ``N``; may be None until the first step (the Avalanche plugin sets
            it for every experience).
        prior_precision: ``delta``, a float or ``[P]`` tensor (default 1.0).
        prior_mean: ``mu_0`` ``[P]`` (default zeros) or a :class:`DiagonalGaussian` prior,
            whose precision is then ``delta`` too (``prior_precision`` must then be None).
        init_precision: initial ``s`` (float or ``[P]``; torchsso's convention); None: 0.
        mc_samples: draws per step; 0 gives OGN (no sampling, ``w = mu``).
        kl_weight: ``tau``, the weight of the KL term (tempering).
        likelihood: the per-example loss: a :class:`Likelihood`, its name, or a callable
            ``(f [B, C], y [B]) -> [B]`` (``curvature="ef"`` only).
        curvature: ``"ef"`` (squared per-example gradients, VOGN) or ``"ggn"`` (exact
            per-example GGN diagonal; costs a Jacobian per example).
        bias_correction: Adam-style bias correction (see the module docstring).
        chunk_size: examples per vectorised per-example call (bounds memory).
        method: how per-example squared gradients are computed, see
            :func:`per_example_grad_stats` (``"auto"``, ``"hooks"`` or ``"vmap"``).
    """

    def __init__(
        self,
        params_or_model: nn.Module | Iterable[Tensor],
        *,
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        train_set_size: int | None = None,
        prior_precision: float | Tensor | None = None,
        prior_mean: Tensor | DiagonalGaussian | None = None,
        init_precision: float | Tensor | None = None,
        mc_samples: int = 1,
        kl_weight: float = 1.0,
        likelihood: Likelihood | LossFn | str = "categorical",
        curvature: str = "ef",
        bias_correction: bool = True,
        chunk_size: int | None = None,
        method: str = "auto",
    ) -> None:
        if isinstance(params_or_model, nn.Module):
            self.model: nn.Module | None = params_or_model
            named = [(n, p) for n, p in params_or_model.named_parameters() if p.requires_grad]
            params = [p for _, p in named]
        else:
            self.model = None
            params = list(params_or_model)
            if any(isinstance(p, dict) for p in params):
                raise ValueError("VOGN takes one parameter group: a model or a list of tensors")
        if not params:
            raise ValueError("params_or_model has no trainable parameters")
        if not (isinstance(lr, int | float) and lr > 0):
            raise ValueError(f"lr must be a positive float, got {lr!r}")
        if len(betas) != 2 or not all(0.0 <= b < 1.0 for b in betas):
            raise ValueError(f"betas must be two floats in [0, 1), got {betas!r}")
        if not (isinstance(mc_samples, int) and mc_samples >= 0):
            raise ValueError(f"mc_samples must be an int >= 0, got {mc_samples!r}")
        if not (isinstance(kl_weight, int | float) and kl_weight > 0):
            raise ValueError(f"kl_weight must be a positive float, got {kl_weight!r}")
        if curvature not in ("ef", "ggn"):
            raise ValueError(f"curvature must be 'ef' or 'ggn', got {curvature!r}")
        if chunk_size is not None and int(chunk_size) < 1:
            raise ValueError(f"chunk_size must be a positive int or None, got {chunk_size}")
        if method not in ("auto", "vmap", "hooks"):
            raise ValueError(f"method must be 'auto', 'vmap' or 'hooks', got {method!r}")
        defaults = dict(
            lr=float(lr),
            betas=tuple(float(b) for b in betas),
            mc_samples=int(mc_samples),
            kl_weight=float(kl_weight),
            bias_correction=bool(bias_correction),
        )
        super().__init__(params, defaults)
        self.likelihood = likelihood
        self.loss_fn: LossFn = _loss_fn(likelihood)  # per-example loss (f, y) -> [B]
        self.curvature = curvature
        self.chunk_size = chunk_size
        self.method = method

        mu = torch.cat([p.detach().reshape(-1) for p in params]).clone()
        if isinstance(prior_mean, DiagonalGaussian):
            if prior_precision is not None:
                raise ValueError(
                    "prior_precision must be None when prior_mean is a DiagonalGaussian "
                    "(its precision is the prior precision)"
                )
            prior_precision = prior_mean.precision
            prior_mean = prior_mean.mean
        delta = _as_vector(
            1.0 if prior_precision is None else prior_precision, mu, "prior_precision"
        )
        if not (torch.isfinite(delta).all() and (delta > 0).all()):
            raise ValueError("prior_precision must be finite and strictly positive")
        mu0 = (
            torch.zeros_like(mu) if prior_mean is None else _as_vector(prior_mean, mu, "prior_mean")
        )
        if init_precision is None:
            s0 = torch.zeros_like(mu)
        else:
            s0 = _as_vector(init_precision, mu, "init_precision")
            if not (torch.isfinite(s0).all() and (s0 >= 0).all()):
                raise ValueError("init_precision must be finite and >= 0")
        if train_set_size is not None and not (int(train_set_size) >= 1):
            raise ValueError(f"train_set_size must be a positive int, got {train_set_size!r}")
        self.vogn_state: dict[str, Any] = {
            "mu": mu,
            "s": s0.clone(),
            "m": torch.zeros_like(mu),
            "step": 0,
            "prior_mean": mu0,
            "prior_precision": delta,
            "init_s": s0 if init_precision is not None else None,
            "train_set_size": None if train_set_size is None else int(train_set_size),
        }
        self._pending_curv: Tensor | None = None
        self._sampled = False
        self._version = 0  # bumped when the prior or the state is replaced
        self._std_cache: tuple[tuple, Tensor] | None = None
        self._dt_cache: tuple[tuple, Tensor] | None = None
        self._work: dict[str, Tensor] = {}  # [P] work buffers (see _buffer)

    # ---------------------------------------------------------------- hyper-parameters
    @property
    def params(self) -> list[Tensor]:
        return self.param_groups[0]["params"]

    @property
    def mc_samples(self) -> int:
        return int(self.param_groups[0]["mc_samples"])

    @property
    def kl_weight(self) -> float:
        return float(self.param_groups[0]["kl_weight"])

    @property
    def train_set_size(self) -> int | None:
        return self.vogn_state["train_set_size"]

    @train_set_size.setter
    def train_set_size(self, n: int) -> None:
        if not (isinstance(n, int) and n >= 1):
            raise ValueError(f"train_set_size must be a positive int, got {n!r}")
        self.vogn_state["train_set_size"] = n

    def _n(self) -> int:
        n = self.vogn_state["train_set_size"]
        if n is None:
            raise ValueError("train_set_size is not set: pass train_set_size=N or set it")
        return n

    # ---------------------------------------------------------------- posterior
    def _s_scale(self) -> float:
        """``c`` with ``s^ = c s`` (bias correction of ``s`` when it starts at zero)."""
        st = self.vogn_state
        beta2 = self.param_groups[0]["betas"][1]
        if self.param_groups[0]["bias_correction"] and st["init_s"] is None and st["step"] > 0:
            return 1.0 / (1.0 - beta2 ** st["step"])
        return 1.0

    def _s_hat(self) -> Tensor:
        return self.vogn_state["s"] * self._s_scale()

    def _delta_tilde(self) -> Tensor:
        """``tau delta / N`` ``[P]`` (cached until the prior, N or tau change)."""
        key = (self._n(), self.kl_weight, self._version)
        if self._dt_cache is None or self._dt_cache[0] != key:
            self._dt_cache = (key, self.vogn_state["prior_precision"] * (key[1] / key[0]))
        return self._dt_cache[1]

    def posterior_precision(self, out: Tensor | None = None) -> Tensor:
        """``N s^ / tau + delta`` ``[P]`` (written into ``out`` when given)."""
        st = self.vogn_state
        alpha = self._n() * self._s_scale() / self.kl_weight
        return torch.add(st["prior_precision"], st["s"], alpha=alpha, out=out)

    def posterior(self) -> DiagonalGaussian:
        """``q = N(mu, diag(1 / (N s^ / tau + delta)))`` (copies of the state)."""
        return DiagonalGaussian(self.vogn_state["mu"].clone(), self.posterior_precision().clone())

    def prior(self) -> DiagonalGaussian:
        st = self.vogn_state
        return DiagonalGaussian(st["prior_mean"].clone(), st["prior_precision"].clone())

    def set_prior(
        self, prior: DiagonalGaussian | None = None, *, reset: bool = True
    ) -> DiagonalGaussian:
        """Make ``prior`` (default: the current posterior) the prior ``N(mu_0, 1/delta)``.

        With ``reset`` (a new task of naive continual VOGN), ``m``, the step count and ``s``
        restart (``s`` at its initial value, so with ``init_precision=None`` the next
        posterior starts equal to the prior); ``mu`` is kept. Returns the new prior.
        """
        prior = self.posterior() if prior is None else prior
        st = self.vogn_state
        if prior.mean.shape != st["mu"].shape:
            raise ValueError(
                f"prior must have P={st['mu'].numel()} entries, got {tuple(prior.mean.shape)}"
            )
        self._version += 1
        st["prior_mean"] = prior.mean.detach().to(st["mu"]).clone()
        st["prior_precision"] = prior.precision.detach().to(st["mu"]).clone()
        if reset:
            st["m"].zero_()
            st["step"] = 0
            st["s"] = torch.zeros_like(st["mu"]) if st["init_s"] is None else st["init_s"].clone()
        return self.prior()

    # ---------------------------------------------------------------- parameters
    def _sync_device(self) -> None:
        """Follow the parameters when the model was moved after construction."""
        p0 = self.params[0]
        st = self.vogn_state
        if st["mu"].device != p0.device or st["mu"].dtype != p0.dtype:
            for k, v in st.items():
                if isinstance(v, Tensor):
                    st[k] = v.to(device=p0.device, dtype=p0.dtype)
            self._version += 1

    @torch.no_grad()
    def _write(self, vec: Tensor) -> None:
        i = 0
        for p in self.params:
            k = p.numel()
            p.copy_(vec[i : i + k].view_as(p))
            i += k

    def _read_grad(self) -> Tensor:
        parts = []
        for p in self.params:
            parts.append(torch.zeros_like(p).reshape(-1) if p.grad is None else p.grad.reshape(-1))
        return torch.cat(parts).detach()

    def _buffer(self, name: str) -> Tensor:
        """A ``[P]`` work buffer like ``mu``, reused across steps. Fresh ``[P]`` temporaries
        cost page faults on every step on a CPU; the hot path writes into these instead."""
        mu = self.vogn_state["mu"]
        buf = self._work.get(name)
        if buf is None or buf.shape != mu.shape or buf.dtype != mu.dtype or buf.device != mu.device:
            buf = self._work[name] = torch.empty_like(mu)
        return buf

    @torch.no_grad()
    def sample_params(
        self, generator: torch.Generator | None = None, *, copy: bool = True
    ) -> Tensor:
        """Write ``w ~ q`` (``w = mu`` when ``mc_samples == 0``) into the parameters and return
        ``w`` ``[P]``. Sampling uses the scaled std ``sqrt(tau / (N (s^ + delta~)))``.

        With ``copy=False`` the returned tensor is an internal buffer (``mu`` itself when
        ``mc_samples == 0``) that the next draw overwrites: no ``[P]`` allocation per step,
        what the training loops use."""
        self._sync_device()
        mu = self.vogn_state["mu"]
        if self.mc_samples == 0:
            w = mu
        else:
            key = (self.vogn_state["step"], self._n(), self.kl_weight, self._version)
            if self._std_cache is None or self._std_cache[0] != key:
                std = self.posterior_precision(out=self._buffer("std")).rsqrt_()
                self._std_cache = (key, std)
            w = self._buffer("sample")
            w.normal_(generator=generator).mul_(self._std_cache[1]).add_(mu)
        self._write(w)
        self._sampled = True
        return w.clone() if copy else w

    @torch.no_grad()
    def load_mean(self) -> None:
        """Write ``mu`` into the parameters."""
        self._write(self.vogn_state["mu"])
        self._sampled = False

    @torch.no_grad()
    def sync_mean_from_params(self) -> None:
        """Set ``mu`` to the parameters' current values (after loading a model by hand)."""
        self.vogn_state["mu"] = torch.cat([p.detach().reshape(-1) for p in self.params]).clone()

    # ---------------------------------------------------------------- updates
    @torch.no_grad()
    def update(self, grad: Tensor, curv: Tensor) -> None:
        """One VOGN update from ``g`` ``[P]`` (mean data gradient plus any extra terms, no
        prior term) and ``h`` ``[P]`` (mean per-example curvature); writes ``mu`` into the
        parameters."""
        self._sync_device()
        st = self.vogn_state
        mu = st["mu"]
        for name, v in (("grad", grad), ("curv", curv)):
            if v.shape != mu.shape:
                raise ValueError(f"{name} must have shape [P]=[{mu.numel()}], got {tuple(v.shape)}")
        group = self.param_groups[0]
        beta1, beta2 = group["betas"]
        dt = self._delta_tilde()
        st["step"] += 1
        t = st["step"]
        m, s = st["m"], st["s"]
        m.mul_(beta1).add_(grad.to(mu), alpha=1 - beta1)
        diff = torch.sub(mu, st["prior_mean"], out=self._buffer("diff"))
        m.addcmul_(diff, dt, value=1 - beta1)
        s.mul_(beta2).add_(curv.to(mu), alpha=1 - beta2)
        bc1 = 1 - beta1**t if group["bias_correction"] else 1.0
        denom = torch.add(dt, s, alpha=self._s_scale(), out=self._buffer("denom"))  # s^ + δ~
        mu.addcdiv_(m, denom, value=-group["lr"] / bc1)
        self.load_mean()

    def set_curvature(self, curv: Tensor) -> None:
        """Store ``h`` ``[P]`` for the next argument-less :meth:`step`."""
        self._pending_curv = curv.detach()

    def step(  # type: ignore[override]
        self,
        x: Tensor | Callable[[], Any] | None = None,
        y: Tensor | None = None,
        *,
        regularizer: Callable[[], Tensor] | None = None,
        model: nn.Module | None = None,
    ) -> Tensor | None:
        """One VOGN step.

        ``step(x, y, regularizer=None, model=None)``: standalone step on the mini-batch
        ``(x, y)`` averaging ``max(mc_samples, 1)`` draws; returns the mean data loss.

        ``step()``: two-phase step (``g`` from ``.grad``, ``h`` from :meth:`set_curvature`).
        """
        if callable(x) and y is None:
            raise TypeError("VOGN.step takes (x, y), not a closure; see the class docstring")
        if x is None:
            if self._pending_curv is None:
                raise ValueError(
                    "VOGN.step() without a batch needs the curvature of the mini-batch: call "
                    "set_curvature(h) after the backward pass (VOGNPlugin does this), or use "
                    "step(x, y)"
                )
            curv, self._pending_curv = self._pending_curv, None
            self.update(self._read_grad(), curv)
            return None
        if y is None:
            raise ValueError("y is required with x")
        net = model if model is not None else self.model
        if net is None:
            raise ValueError("step(x, y) needs the model: construct VOGN with the model")
        draws = max(self.mc_samples, 1)
        g_acc = h_acc = loss_acc = None
        try:
            for d in range(draws):
                self.sample_params(copy=False)
                if d == 0 and net.training and _has_bn(net):
                    with torch.no_grad():
                        net(x)  # update the batch-norm running statistics at w
                stats = per_example_grad_stats(
                    net,
                    x,
                    y,
                    self.likelihood,
                    curvature=self.curvature,
                    chunk_size=self.chunk_size,
                    method=self.method,
                )
                g = stats.grad
                assert g is not None
                if regularizer is not None:
                    for p in self.params:
                        p.grad = None
                    with torch.enable_grad():
                        reg = regularizer()
                        if reg.ndim != 0:
                            raise ValueError(f"regularizer must return a scalar, got {reg.shape}")
                        reg.backward()
                    g = g + self._read_grad()
                    for p in self.params:
                        p.grad = None
                g_acc = g if g_acc is None else g_acc + g
                h_acc = stats.curv if h_acc is None else h_acc + stats.curv
                loss_acc = stats.loss if loss_acc is None else loss_acc + stats.loss
        except BaseException:
            self.load_mean()  # never leave a sample in the parameters
            raise
        assert g_acc is not None and h_acc is not None and loss_acc is not None
        if draws > 1:
            g_acc, h_acc = g_acc.div_(draws), h_acc.div_(draws)
        self.update(g_acc, h_acc)
        return loss_acc / draws

    # ---------------------------------------------------------------- (de)serialisation
    def state_dict(self) -> dict[str, Any]:
        """torch's optimizer state plus ``"vogn"``: the posterior state (tensors cloned)."""
        out = super().state_dict()
        out["vogn"] = {
            k: (v.clone() if isinstance(v, Tensor) else v) for k, v in self.vogn_state.items()
        }
        return out

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Inverse of :meth:`state_dict`; also writes ``mu`` into the parameters."""
        state_dict = dict(state_dict)
        vogn = state_dict.pop("vogn", None)
        if vogn is None:
            raise ValueError("state_dict has no 'vogn' entry: it was not saved by VOGN")
        super().load_state_dict(state_dict)
        self.load_vogn_state(vogn)

    def load_vogn_state(self, vogn: dict[str, Any]) -> None:
        """Load the posterior state alone (``state_dict()["vogn"]``)."""
        mu = self.vogn_state["mu"]
        missing = set(self.vogn_state) - set(vogn)
        if missing:
            raise ValueError(f"vogn state is missing {sorted(missing)}")
        if vogn["mu"].shape != mu.shape:
            raise ValueError(f"vogn state has P={vogn['mu'].numel()}, optimizer has {mu.numel()}")
        self.vogn_state = {
            k: (v.detach().to(mu).clone() if isinstance(v, Tensor) else v) for k, v in vogn.items()
        }
        self._version += 1
        self.load_mean()


class OGN(VOGN):
    """Online Gauss-Newton: :class:`VOGN` without sampling (``mc_samples=0``)."""

    def __init__(self, params_or_model: nn.Module | Iterable[Tensor], **kwargs: Any) -> None:
        if kwargs.get("mc_samples", 0) != 0:
            raise ValueError("OGN does not sample: mc_samples must be 0 (use VOGN)")
        kwargs["mc_samples"] = 0
        super().__init__(params_or_model, **kwargs)


@contextmanager
def _eval_mode(model: nn.Module) -> Iterator[None]:
    """Evaluate ``model`` in eval mode (no dropout, batch norm with running statistics) and
    restore its mode afterwards."""
    modes = [(m, m.training) for m in model.modules()]
    model.eval()
    try:
        yield
    finally:
        for m, mode in modes:
            m.training = mode


def _check_posterior(model: nn.Module, posterior: DiagonalGaussian) -> dict[str, Tensor]:
    params = {n: p.detach() for n, p in model.named_parameters() if p.requires_grad}
    total = sum(p.numel() for p in params.values())
    if posterior.num_params != total:
        raise ValueError(f"posterior has P={posterior.num_params}, model has {total}")
    return params


def _unflatten(params: dict[str, Tensor], vec: Tensor) -> dict[str, Tensor]:
    out, i = {}, 0
    for n, p in params.items():
        out[n] = vec[i : i + p.numel()].view_as(p).to(p)
        i += p.numel()
    return out


@torch.no_grad()
def predict_mc(
    model: nn.Module,
    posterior: DiagonalGaussian,
    x: Tensor,
    n_samples: int = 10,
    *,
    likelihood: Likelihood | str = "categorical",
    generator: torch.Generator | None = None,
) -> Tensor:
    """Monte-Carlo predictive ``(1/S) sum_s inverse_link(f(x; w_s))``, ``w_s ~ posterior``.

    Args:
        model: maps ``[N, ...] -> [N, C]``; its parameters are not modified; it is
            evaluated in eval mode (its mode is restored afterwards).
        posterior: over the model's trainable parameters (``[P]``).
        x: ``[N, ...]``. n_samples: ``S >= 1``.

    Returns:
        ``[N, C]`` (class probabilities for classification).
    """
    if not (isinstance(n_samples, int) and n_samples >= 1):
        raise ValueError(f"n_samples must be a positive int, got {n_samples!r}")
    params = _check_posterior(model, posterior)
    lik = get_likelihood(likelihood)
    buffers = dict(model.named_buffers())
    acc = None
    with _eval_mode(model):
        for _ in range(n_samples):
            w = _unflatten(params, posterior.sample(generator=generator))
            p = lik.inverse_link(functional_call(model, (w, buffers), (x,)))
            acc = p if acc is None else acc + p
    assert acc is not None
    return acc / n_samples


@torch.no_grad()
def predict_mean(
    model: nn.Module,
    posterior: DiagonalGaussian,
    x: Tensor,
    *,
    likelihood: Likelihood | str = "categorical",
) -> Tensor:
    """``inverse_link(f(x; posterior.mean))`` ``[N, C]``."""
    params = _check_posterior(model, posterior)
    w = _unflatten(params, posterior.mean)
    with _eval_mode(model):
        f = functional_call(model, (w, dict(model.named_buffers())), (x,))
    return get_likelihood(likelihood).inverse_link(f)
