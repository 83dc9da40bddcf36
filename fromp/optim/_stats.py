r"""The per-example statistics engine behind :class:`~fromp.optim.VOGN`.

:func:`per_example_grad_stats` returns the mean gradient ``g = (1/M) sum_i g_i`` and the mean
per-example curvature ``h = (1/M) sum_i h_i`` (``h_i = g_i^2``, ``hess_approx="ef"``, or the
per-example GGN diagonal ``diag(J_i^T Lambda_i J_i)``, ``hess_approx="ggn"``) of a mini-batch,
all ``[P]`` in ``named_parameters()`` order (trainable only).

Per-example quantities are exact for any architecture (convolutions with weight sharing
included). By default (``method="auto"``) squared gradients of models made of the layers
that :mod:`fromp.curvature.capture` handles (``Linear``, ``Conv1d/2d``, batch norm, ``LayerNorm``,
``GroupNorm``) come from one forward and one backward pass with layer capture
(``sum_i g_i^2 = (d^2)^T (a^2)`` for a linear layer; for a convolution the per-example
weight gradients of that layer alone, from its unfolded input); anything else uses
``torch.func.vmap`` over ``grad`` (``jacrev`` for the GGN), chunked over examples so that
peak memory is ``chunk_size * P`` numbers. Both are checked against loops over examples in
``tests/optim/test_vogn.py``. :class:`LayerCapture` gives the squared gradients of a forward pass
already made (the Avalanche plugin's).

Batch norm: per-example gradients cannot use batch statistics, so the per-example pass runs
the batch-norm layers in ``eval()`` mode (normalising with the running statistics). Dropout
stays active in training mode (independent masks per example).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from typing import Any

import torch
from torch import Tensor, nn
from torch.func import functional_call, grad_and_value, jacrev, vmap

from fromp._checks import check_batch, check_chunk_size, check_model_output, check_tensor
from fromp.curvature.capture import LayerCall, LayerMap, capture_calls
from fromp.curvature.hooks import forward_hooks
from fromp.curvature.jacobian import over_examples
from fromp.curvature.layer_rules import is_batch_norm, squared_grad_sums, supported_layer
from fromp.likelihood import Likelihood, get_likelihood
from fromp.models import uncompiled

__all__ = ["GradStats", "LayerCapture", "LossFn", "OutputCapture", "per_example_grad_stats"]

LossFn = Callable[[Tensor, Tensor], Tensor]


class GradStats:
    """Mini-batch statistics at one set of weights.

    Attributes:
        loss: mean per-example loss (scalar tensor).
        grad: ``(1/M) sum_i g_i`` ``[P]`` (None when not requested).
        curv: ``(1/M) sum_i h_i`` ``[P]`` (squared gradients or GGN diagonal).
        batch_size: ``M``, the examples of the mini-batch.
    """

    def __init__(self, loss: Tensor, grad: Tensor | None, curv: Tensor, batch_size: int) -> None:
        self.loss, self.grad, self.curv, self.batch_size = loss, grad, curv, batch_size


def _stochastic(m: nn.Module) -> bool:
    """Batch norm (batch statistics) or dropout (random masks): a layer whose training mode
    a recorded pass cannot replay per example."""
    return is_batch_norm(m) or isinstance(m, nn.modules.dropout._DropoutNd)


@contextmanager
def _bn_eval(
    model: nn.Module, kinds: Callable[[nn.Module], bool] = is_batch_norm
) -> Iterator[None]:
    """Temporarily put the batch-norm layers (or the layers passing ``kinds``) of ``model``
    in eval mode."""
    changed = [m for m in model.modules() if kinds(m) and m.training]
    for m in changed:
        m.eval()
    try:
        yield
    finally:
        for m in changed:
            m.train()


def _has_bn(model: nn.Module) -> bool:
    return any(is_batch_norm(m) for m in model.modules())


def _loss_fn(loss: Likelihood | LossFn | str) -> LossFn:
    if isinstance(loss, str | Likelihood):
        return get_likelihood(loss).nll
    if callable(loss):
        return loss
    raise ValueError(f"loss must be a Likelihood, a likelihood name or a callable, got {loss!r}")


def _hook_supported(layer_map: LayerMap) -> bool:
    """Whether every trainable parameter sits in exactly one layer that
    :mod:`fromp.curvature.capture` handles (``Linear``, ``Conv1d/2d``, batch norm with running
    statistics, ``LayerNorm``, ``GroupNorm``); batch norm in training mode counts, since the
    per-example pass runs it in eval mode."""
    if any(layer_map.shared(n) for n in layer_map.named):
        return False
    return all(supported_layer(m, assume_eval=True) for m in layer_map.layers())


def _layout(model: nn.Module) -> tuple[bool, LayerMap]:
    """``(hooks supported, the model's LayerMap)``."""
    layer_map = LayerMap.of(model)
    return _hook_supported(layer_map), layer_map


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
    (:mod:`fromp.curvature.capture`; one forward and one backward per chunk, the mean gradient from
    the same backward). Returns None when a layer is called more than once."""
    layer_map = LayerMap.of(model)
    named, name_of, layers = layer_map.named, layer_map.name_of(), list(layer_map.layers())
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
            f = check_model_output(model(x[s : s + step]))
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
    forward passes inside the ``with`` block (:func:`fromp.curvature.capture.capture_calls`), so
    that the squared per-example gradients of a loss of those outputs can be computed afterwards
    from the output gradients (:meth:`squared_grads`) without another forward pass.

    Usable when ``supported``: all parameters in layers :mod:`fromp.curvature.capture` handles and
    no batch-norm layer in training mode (batch statistics couple the examples).
    """

    def __init__(self, model: nn.Module, *, retain_grad: bool = False) -> None:
        self.model = model
        self.retain_grad = retain_grad
        self._outs: list[Tensor] = []
        ok, layer_map = _layout(model)
        self._named, self._name_of = layer_map.named, layer_map.name_of()
        self._layers = list(layer_map.layers())
        bn_train = any(is_batch_norm(m) and m.training for m in model.modules())
        self.supported = ok and not bn_train
        self.calls: list[LayerCall] = []
        self._stack: ExitStack | None = None

    def __enter__(self) -> LayerCapture:
        stack = ExitStack()
        self.calls = stack.enter_context(capture_calls(self._layers))
        self._outs = []
        if self.retain_grad:  # after capture's hooks: sees the output the network uses

            def keep(m: nn.Module, inputs: tuple[Tensor, ...], output: Tensor) -> None:
                if output.requires_grad:
                    output.retain_grad()
                self._outs.append(output)

            stack.enter_context(forward_hooks(self._layers, keep))
        self._stack = stack
        return self

    def __exit__(self, *exc: object) -> None:
        if self._stack is not None:
            self._stack.close()
            self._stack = None

    def squared_grads_of_mean_loss(self) -> Tensor | None:
        """``(1/M) sum_i g_i^2`` ``[P]`` after a ``backward()`` of the **mean** of ``M``
        per-example losses over the captured forward pass (``retain_grad=True``): the output
        gradient of the mean loss is ``d l_i / d z_i / M`` on row ``i``, so the per-example
        gradients are ``M`` times the per-row gradients read from the layers' outputs. None
        when it cannot be done exactly (unsupported model, a layer called more than once,
        no backward pass reached the layers)."""
        if not self.retain_grad or not self.supported or not self.calls:
            return None
        if len({id(c.module) for c in self.calls}) != len(self.calls):
            return None
        if len(self._outs) != len(self.calls):
            return None
        grads = tuple(o.grad for o in self._outs)
        if all(g is None for g in grads):
            return None
        m = len(self.calls[0].a)
        h_sum = {n: torch.zeros_like(p) for n, p in self._named.items()}
        _captured_squares(self.calls, grads, self._name_of, h_sum)
        return torch.cat([t.reshape(-1) for t in h_sum.values()]).mul_(m)

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
    hess_approx: str = "ef",
    chunk_size: int | None = None,
    method: str = "auto",
    need_grad: bool = True,
) -> GradStats:
    r"""Mean gradient and mean per-example curvature of a mini-batch at the model's weights.

    For ``g_i = d loss(f(x_i), y_i) / dw`` (``[P]``, ``w`` the trainable parameters):

    * ``grad = (1/M) sum_i g_i``,
    * ``curv = (1/M) sum_i g_i ** 2`` for ``hess_approx="ef"``, or
      ``(1/M) sum_i diag(J_i^T Lambda_i J_i) = (1/M) sum_i sum_k (L_i^T J_i)_k ** 2`` for
      ``hess_approx="ggn"`` (``J_i [C, P]`` the output Jacobian, ``Lambda_i = L_i L_i^T`` the
      likelihood's output Hessian; needs ``loss`` to be a :class:`Likelihood`).

    Two exact implementations (``method``):

    * ``"vmap"``: ``vmap(grad_and_value)`` (``vmap(jacrev)`` for the GGN) over examples, any
      architecture; forms the per-example gradients ``[chunk, P]``.
    * ``"hooks"`` (``hess_approx="ef"`` only): one forward and one backward of the summed loss
      record each layer's input ``a_i`` and output gradient ``d_i``; for a linear layer
      ``sum_i g_i^2 = (d^2)^T (a^2)`` without forming per-example gradients, for a
      convolution (weight sharing) the per-example gradients are formed for that layer only
      (one grouped weight-gradient convolution, batch as groups), batch norm (eval mode)
      uses ``xhat_i`` (:mod:`fromp.curvature.capture`). Supports models whose parameters all live in
      ``Linear``, ``Conv1d/2d``, batch-norm, ``LayerNorm`` and ``GroupNorm`` layers, each
      called once per forward pass.
    * ``"auto"``: ``"hooks"`` when supported, else ``"vmap"``.

    Work is done in chunks of ``chunk_size`` examples. Batch-norm layers run in eval mode
    (see the module docstring); dropout masks differ per example.

    Args:
        model: maps ``[M, ...] -> [M, C]`` (fix a head with :func:`fromp.models.with_task`).
        x: ``[M, ...]`` inputs. y: ``[M]`` (or ``[M, C]``) targets.
        loss: per-example loss ``(f [B, C], y [B]) -> [B]`` or a likelihood (its ``nll``).
        hess_approx: ``"ef"`` or ``"ggn"``.
        chunk_size: examples per vectorised call (None: the whole batch).
        method: ``"auto"``, ``"hooks"`` or ``"vmap"`` (above).
        need_grad: False skips the mean gradient where that saves work (hook path); the
            returned ``grad`` is then None.
    """
    if hess_approx not in ("ef", "ggn"):
        raise ValueError(f"hess_approx must be 'ef' or 'ggn', got {hess_approx!r}")
    if method not in ("auto", "vmap", "hooks"):
        raise ValueError(f"method must be 'auto', 'vmap' or 'hooks', got {method!r}")
    if method == "hooks" and hess_approx != "ef":
        raise ValueError("method='hooks' supports hess_approx='ef' only")
    check_batch(x, "x")
    check_tensor(y, "y", f"[M]=[{len(x)}]")
    if len(y) != len(x):
        raise ValueError(f"y must have M={len(x)} entries, got {len(y)}")
    chunk_size = check_chunk_size(chunk_size)
    step = len(x) if chunk_size is None else chunk_size
    if hess_approx == "ggn" and not isinstance(loss, str | Likelihood):
        raise ValueError("hess_approx='ggn' needs loss to be a Likelihood (or its name)")
    lik = get_likelihood(loss) if isinstance(loss, str | Likelihood) else None
    nll = _loss_fn(loss)

    model = uncompiled(model)  # the module inside torch.compile's wrapper
    params = {n: p.detach() for n, p in model.named_parameters() if p.requires_grad}
    if not params:
        raise ValueError("model has no trainable parameters")
    if hess_approx == "ef" and method != "vmap":
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
        return check_model_output(f, " for one example").squeeze(0)

    if hess_approx == "ef":

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
            if hess_approx == "ef":
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


def _squared_projection(
    model: nn.Module, buffers: dict[str, Tensor], n_args: int, names: list[str], batched: list
) -> Callable[..., dict[str, Tensor]]:
    """``(params, v [C, K], *leaves of one example) -> {name: sum_k (J^T v_k)^2}`` for the
    model called as ``model(*leaves[:n_args], **dict(zip(names, leaves[n_args:])))``
    (the ``batched`` leaves given without their example dimension)."""

    def one(p: dict[str, Tensor], v: Tensor, *xs: Any) -> dict[str, Tensor]:
        xs = tuple(x.unsqueeze(0) if bt else x for x, bt in zip(xs, batched))

        def fi(q: dict[str, Tensor]) -> Tensor:
            kw = dict(zip(names, xs[n_args:]))
            return functional_call(model, (q, buffers), xs[:n_args], kw)[0]

        jac = jacrev(fi)(p)  # name -> [C, *shape]
        return {n: torch.tensordot(v.T, j, dims=1).pow(2).sum(0) for n, j in jac.items()}

    return one


class OutputCapture:
    r"""Records every call of ``model`` (the module a closure calls) inside the ``with``
    block: its arguments and its output ``f [B, C]``, whose gradient is kept. After the
    closure's ``backward()`` of a **mean** loss over the ``M`` rows of all recorded calls,
    ``l = (1/M) sum_i l_i(f_i)``, the row ``i`` of ``f.grad`` is ``(d l_i / d f_i) / M``,
    so the per-example output gradient ``r_i = M f_i.grad`` is known without the targets,
    and :meth:`curvature` gives the per-example curvature ``h = (1/M) sum_i h_i`` ``[P]``:

    * ``"ef"``: ``h_i = (J_i^T r_i)^2``, the squared per-example gradient;
    * ``"ggn"``: ``h_i = sum_k (J_i^T L_{i,k})^2 = diag(J_i^T Lambda_i J_i)``, with
      ``Lambda_i = L_i L_i^T`` the likelihood's output Hessian at ``f_i`` (the loss must be
      that likelihood's negative log-likelihood).

    Calls made while ``paused()`` is true (a term of the objective that is not the data's,
    :meth:`fromp.optim.VOGN.extra_term`) are not recorded.

    ``J_i = d f_i / d w`` ``[C, P]`` comes from ``jacrev`` of one example, batched over the
    examples with ``vmap`` (one call per example where ``vmap`` cannot batch the module, e.g.
    a multi-task module that splits its batch by task label). Arguments whose first
    dimension is ``B`` are split by example, the others shared. Batch-norm and dropout
    layers run in eval mode for this pass (batch statistics couple the examples; a dropout
    mask of the recorded pass cannot be replayed). Memory: ``chunk * C *
    P`` numbers per chunk of examples. The order of ``[P]`` is ``named_parameters()``'s
    (trainable only)."""

    def __init__(self, model: nn.Module, paused: Callable[[], bool] | None = None) -> None:
        self.model = model
        self.paused = paused
        self.calls: list[tuple[tuple[Any, ...], dict[str, Any], Tensor]] = []
        self.skipped = 0  # calls made while paused (not examples)
        self._stack: ExitStack | None = None

    def __enter__(self) -> OutputCapture:
        self.calls, self.skipped = [], 0

        def keep(m: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], out: Any) -> None:
            if self.paused is not None and self.paused():
                self.skipped += 1
                return
            if isinstance(out, Tensor) and out.requires_grad and out.ndim == 2:
                out.retain_grad()
                self.calls.append((args, kwargs, out))

        self._stack = ExitStack()
        self._stack.enter_context(forward_hooks([self.model], keep, with_kwargs=True))
        return self

    def __exit__(self, *exc: object) -> None:
        if self._stack is not None:
            self._stack.close()
            self._stack = None

    @property
    def batch_size(self) -> int:
        """``M``: the rows of the recorded calls that the loss reached."""
        return sum(len(f) for _, _, f in self.calls if f.grad is not None)

    def curvature(
        self,
        likelihood: Likelihood | str | None,
        hess_approx: str,
        chunk_size: int | None,
        output_grads: list[Tensor] | None = None,
    ) -> Tensor | None:
        """``h = (1/M) sum_i h_i`` ``[P]`` (see the class docstring); None when no recorded
        output was reached by the backward pass. ``hess_approx="ggn"`` needs ``likelihood``.

        ``output_grads``: the per-example output gradients ``r_i = d l_i / d f_i`` of the
        first ``len(output_grads)`` recorded calls, given (e.g. of the data loss alone,
        when the backward pass also carried other terms); the others are not used."""
        if output_grads is not None:
            calls = [(a, k, r) for (a, k, _), r in zip(self.calls, output_grads)]
            m = sum(len(r) for r in output_grads)
            grads = [r.detach() for r in output_grads]
        else:
            calls = [(a, k, f) for a, k, f in self.calls if f.grad is not None]
            m = self.batch_size
            grads = [f.grad.detach() * m for _, _, f in calls]
        if not calls:
            return None
        fs = [f for _, _, f in self.calls][: len(calls)] if output_grads is not None else None
        lik = None if likelihood is None else get_likelihood(likelihood)
        if hess_approx == "ggn" and lik is None:
            raise ValueError("hess_approx='ggn' needs a Likelihood (or its name) as the loss")
        model = uncompiled(self.model)  # per-example passes run eagerly
        params = {n: p.detach() for n, p in model.named_parameters() if p.requires_grad}
        buffers = dict(model.named_buffers())
        h = {n: torch.zeros_like(p) for n, p in params.items()}
        with _bn_eval(model, _stochastic):
            for j, (args, kwargs, f) in enumerate(calls):
                if fs is not None:
                    f = fs[j]
                b = len(f)
                leaves = [*args, *kwargs.values()]
                batched = [isinstance(t, Tensor) and t.ndim > 0 and len(t) == b for t in leaves]
                if hess_approx == "ef":
                    vec = grads[j].unsqueeze(-1)  # [B, C, 1]: r_i
                else:
                    assert lik is not None
                    vec = lik.sqrt_hessian(f.detach())  # [B, C, K]: L_i
                one = _squared_projection(model, buffers, len(args), list(kwargs), batched)
                fn = over_examples(one, (None, 0, *[0 if bt else None for bt in batched]))
                step = b if chunk_size is None else chunk_size
                for s in range(0, b, step):
                    xs = [t[s : s + step] if bt else t for t, bt in zip(leaves, batched)]
                    out = fn(params, vec[s : s + step], *xs)
                    for n in h:
                        h[n] += out[n].sum(0)
        return torch.cat([t.reshape(-1) for t in h.values()]).div_(m)
