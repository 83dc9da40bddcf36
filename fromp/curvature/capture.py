r"""Layer capture: per-layer inputs and back-propagated output gradients, and the per-example
gradient statistics that follow from them without per-example Jacobians of the whole net.

For a layer ``z = op(a; theta)`` applied once per forward pass, the gradient of a scalar
``v_n^T f(x_n)`` with respect to ``theta`` *for example n alone* depends only on the layer's
input ``a_n`` and the back-propagated output signal ``g_n = d(v_n^T f_n)/dz_n`` (one backward
pass of ``sum_n v_n^T f_n`` gives every ``g_n``, since example ``n``'s output depends only on
its own row in eval mode):

The per-layer rules (which layers, and how each one's per-example gradients and their
squares follow from ``a`` and ``g``) are in :mod:`fromp.curvature.layer_rules`.

Everything else is routed to the per-example Jacobian fallback (:func:`torch.func.jacrev`
over the fallback parameters only): a parametrised layer of another type, a supported layer
called more than once per forward pass, a parameter shared between layers, or a layer whose
captured gradient fails a one-time self-check against autograd (e.g. its weight is also used
outside its ``forward``). No parameter is ever skipped: :class:`CapturePlan` assigns each
trainable parameter to exactly one of the two routes.

Shapes: ``B`` examples of a chunk, ``K`` columns (output directions per example), ``C``
outputs, ``P`` trainable parameters flattened in ``named_parameters()`` order.
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn
from torch.func import functional_call, jacrev

from fromp._checks import check_chunk_size, check_model_output
from fromp.curvature.hooks import forward_hooks
from fromp.curvature.jacobian import over_examples
from fromp.curvature.layer_rules import (
    DEFAULT_MEMORY_BUDGET,
    per_example_layer_grads,
    squared_grad_sums,
    supported_layer,
)
from fromp.models import uncompiled

__all__ = [
    "DEFAULT_MEMORY_BUDGET",
    "CapturePlan",
    "ColumnFn",
    "LayerCall",
    "LayerMap",
    "capture_calls",
    "fallback_jacobian",
    "per_example_layer_grads",
    "squared_grad_sums",
    "sum_squared_column_grads",
    "supported_layer",
]


@dataclass
class LayerCall:
    """One recorded call: the layer, its input ``a`` (detached) and its output ``z`` (in
    the autograd graph; gradients are taken with respect to it)."""

    module: nn.Module
    a: Tensor
    z: Tensor


_LAYER_MAPS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


@dataclass(frozen=True)
class LayerMap:
    """Where each trainable parameter of a model is registered: the one reading of a model's
    layer structure behind layer capture (:class:`CapturePlan`, the structured GP kernel,
    VOGN's statistics and the KFAC factors of :mod:`fromp.curvature.kron` all start here).

    Attributes:
        named: trainable parameters by name, in ``named_parameters()`` order (``P`` in all).
        owners: parameter name -> every ``(layer, attribute)`` registering it (more than one:
            a parameter shared between layers).
        module_names: layer -> its name in ``named_modules()``.
    """

    named: dict[str, Tensor]
    owners: dict[str, list[tuple[nn.Module, str]]]
    module_names: dict[nn.Module, str]

    @classmethod
    def of(cls, model: nn.Module) -> LayerMap:
        """The map of ``model``, cached while its trainable parameters stay the same objects
        (a parameter frozen or replaced makes a new map). A compiled model's layers are its
        original module's (the same objects), named as the model names them (with the
        wrapper's ``_orig_mod.`` prefix)."""
        named = {n: p for n, p in model.named_parameters() if p.requires_grad}
        sig = tuple(id(p) for p in named.values())
        hit = _LAYER_MAPS.get(model)
        if hit is not None and hit[0] == sig:
            return hit[1]
        by_id = {id(p): n for n, p in named.items()}
        owners: dict[str, list[tuple[nn.Module, str]]] = {n: [] for n in named}
        module_names: dict[nn.Module, str] = {}
        for mname, mod in model.named_modules(remove_duplicate=False):
            module_names.setdefault(mod, mname)
            for pn, p in mod._parameters.items():
                if p is not None and id(p) in by_id:
                    entry = (mod, pn)
                    if entry not in owners[by_id[id(p)]]:
                        owners[by_id[id(p)]].append(entry)
        out = cls(named, owners, module_names)
        _LAYER_MAPS[model] = (sig, out)
        return out

    def shared(self, name: str) -> bool:
        """Whether parameter ``name`` is registered in more than one layer."""
        return len(self.owners[name]) > 1

    def layers(self) -> dict[nn.Module, list[tuple[str, str]]]:
        """Layer -> ``[(parameter name, attribute)]`` of its trainable parameters registered
        nowhere else, in ``named_parameters()`` order (shared parameters left out)."""
        return self._layers

    def name_of(self) -> dict[tuple[int, str], str]:
        """``(id(layer), attribute) -> parameter name`` for parameters registered once."""
        return self._name_of

    @functools.cached_property
    def _layers(self) -> dict[nn.Module, list[tuple[str, str]]]:
        out: dict[nn.Module, list[tuple[str, str]]] = {}
        for name, own in self.owners.items():
            if len(own) == 1:
                out.setdefault(own[0][0], []).append((name, own[0][1]))
        return out

    @functools.cached_property
    def _name_of(self) -> dict[tuple[int, str], str]:
        return {(id(m), pn): n for m, plist in self._layers.items() for n, pn in plist}

    def exclusive_layers(self, rule: Callable[[nn.Module], bool]) -> list[nn.Module]:
        """Layers passing ``rule`` whose trainable parameters are all registered only there,
        in ``named_parameters()`` order."""
        shared_in = {m for name, own in self.owners.items() if len(own) > 1 for m, _ in own}
        return [m for m in self.layers() if m not in shared_in and rule(m)]


@contextmanager
def capture_calls(modules: list[nn.Module]) -> Iterator[list[LayerCall]]:
    """Record every call of ``modules`` inside the ``with`` block as a :class:`LayerCall`.

    The hook returns a copy of each output to the rest of the network, so that in-place
    operations after the layer (``ReLU(inplace=True)``, ``out += identity`` in ResNets) do
    not rewrite the recorded ``z``. Hooks are removed on exit, also after an error."""
    calls: list[LayerCall] = []

    def hook(m: nn.Module, inputs: tuple[Tensor, ...], output: Tensor) -> Tensor:
        calls.append(LayerCall(m, inputs[0].detach(), output))
        return output.clone() if output.requires_grad else output

    with forward_hooks(modules, hook):
        yield calls


# ----------------------------------------------------------------------------- the plan


@dataclass
class CapturePlan:
    """Which trainable parameters of a model go through layer capture and which through
    per-example Jacobians, decided once from a probe forward pass.

    Attributes:
        names: trainable parameter names in ``named_parameters()`` order.
        captured: supported layers called exactly once, whose parameters passed the self
            check; their parameters are ``captured_params``.
        fallback: parameter names routed to the Jacobian fallback (with ``reasons``).
        bytes_per_example: estimated working memory per example of a chunk.
    """

    names: list[str]
    shapes: dict[str, torch.Size]
    captured: list[nn.Module] = field(default_factory=list)
    captured_params: dict[str, tuple[nn.Module, str]] = field(default_factory=dict)
    fallback: list[str] = field(default_factory=list)
    reasons: dict[str, str] = field(default_factory=dict)
    bytes_per_example: int = 0
    param_of: dict[tuple[int, str], str] = field(default_factory=dict)

    @classmethod
    def build(
        cls,
        model: nn.Module,
        x0: Tensor,
        *,
        n_columns: int,
        method: str = "auto",
        check: bool = True,
    ) -> CapturePlan:
        """Probe ``model`` on a few examples ``x0`` and route every trainable parameter.

        ``method="jacobian"`` routes everything to the fallback; ``"capture"`` raises when
        a parameter cannot be captured; ``"auto"`` falls back per parameter."""
        if method not in ("auto", "capture", "jacobian"):
            raise ValueError(f"method must be 'auto', 'capture' or 'jacobian', got {method!r}")
        run = uncompiled(model)  # probe passes eagerly; names as ``model`` gives them
        layer_map = LayerMap.of(model)
        named = layer_map.named
        if not named:
            raise ValueError("model has no trainable parameters")
        plan = cls(list(named), {n: p.shape for n, p in named.items()})
        candidates: dict[nn.Module, list[tuple[str, str]]] = {}
        for name, own in layer_map.owners.items():
            if method == "jacobian":
                plan.reasons[name] = "method='jacobian'"
            elif len(own) > 1:
                plan.reasons[name] = "parameter shared between layers"
            elif not supported_layer(own[0][0]):
                plan.reasons[name] = f"{type(own[0][0]).__name__} has no capture rule"
            else:
                candidates.setdefault(own[0][0], []).append((name, own[0][1]))
        elt = x0.element_size() if x0.is_floating_point() else 4
        act = 0
        if candidates:
            mods = list(candidates)
            with torch.enable_grad(), capture_calls(mods) as calls:
                f = check_model_output(run(x0))
            counts: dict[nn.Module, int] = {}
            for c in calls:
                counts[c.module] = counts.get(c.module, 0) + 1
            unused = [mod for mod in candidates if counts.get(mod, 0) == 0]
            idle = _unused_without_gradient(f, unused, named, candidates)
            for mod, plist in candidates.items():
                if mod in idle:  # never called, no gradient (another task's head): zero
                    for name, pn in plist:
                        plan.captured_params[name] = (mod, pn)
                        plan.param_of[(id(mod), pn)] = name
                elif counts.get(mod, 0) != 1:
                    why = "never called" if counts.get(mod, 0) == 0 else "called more than once"
                    for name, _ in plist:
                        plan.reasons[name] = f"{type(mod).__name__} {why} per forward pass"
            good = [c for c in calls if counts[c.module] == 1]
            act = sum(c.z[0].numel() + c.a[0].numel() for c in calls)
            if check and good:
                for mod in _self_check(f, good, named, candidates):
                    for name, _ in candidates[mod]:
                        plan.reasons[name] = (
                            f"{type(mod).__name__}: captured gradient differs from autograd"
                        )
            for c in good:
                if all(n not in plan.reasons for n, _ in candidates[c.module]):
                    plan.captured.append(c.module)
                    for name, pn in candidates[c.module]:
                        plan.captured_params[name] = (c.module, pn)
                        plan.param_of[(id(c.module), pn)] = name
            n_out = f.shape[1]
        else:
            with torch.no_grad():
                n_out = check_model_output(run(x0)).shape[1]
        plan.fallback = [n for n in plan.names if n not in plan.captured_params]
        if method == "capture" and plan.fallback:
            first = plan.fallback[0]
            raise ValueError(
                f"method='capture' cannot capture parameter {first!r}: {plan.reasons[first]}"
            )
        p_fb = sum(plan.shapes[n].numel() for n in plan.fallback)
        x_numel = x0[0].numel()
        plan.bytes_per_example = elt * (
            (6 + 2 * n_columns) * act + 2 * x_numel + 3 * n_out * p_fb + n_columns * n_out
        )
        return plan

    def chunk_size(self, memory_budget: int) -> int:
        """Examples per chunk so that the estimated working memory stays within
        ``memory_budget`` bytes (half of it; the other half is for per-layer temporaries)."""
        return max(1, int(memory_budget // 2 // max(1, self.bytes_per_example)))


def _unused_without_gradient(
    f: Tensor,
    unused: list[nn.Module],
    params: dict[str, Tensor],
    candidates: dict[nn.Module, list[tuple[str, str]]],
) -> set[nn.Module]:
    """Layers never called in the probe whose parameters get no gradient from ``v^T f``
    either (e.g. the heads of other tasks): their curvature is exactly zero. A layer whose
    weight is used outside its ``forward`` has a gradient and goes to the fallback."""
    if not unused:
        return set()
    names = [n for m in unused for n, _ in candidates[m]]
    gen = torch.Generator(device="cpu").manual_seed(4321)
    v = torch.randn(f.shape, generator=gen, dtype=f.dtype).to(f.device)
    grads = dict(
        zip(
            names,
            torch.autograd.grad(
                f, [params[n] for n in names], v, retain_graph=True, allow_unused=True
            ),
        )
    )
    return {
        m
        for m in unused
        if all(grads[n] is None or not bool(grads[n].any()) for n, _ in candidates[m])
    }


def _self_check(
    f: Tensor,
    calls: list[LayerCall],
    params: dict[str, Tensor],
    candidates: dict[nn.Module, list[tuple[str, str]]],
) -> set[nn.Module]:
    """Layers whose per-example gradients, summed over the probe examples, differ from
    autograd's gradient of ``v^T f`` for a random ``v`` (e.g. a weight also used outside the
    layer's ``forward``)."""
    gen = torch.Generator(device="cpu").manual_seed(1234)
    v = torch.randn(f.shape, generator=gen, dtype=f.dtype).to(f.device)
    zs = [c.z for c in calls]
    names = [n for c in calls for n, _ in candidates[c.module]]
    prm = [params[n] for n in names]
    grads = torch.autograd.grad(f, zs + prm, grad_outputs=v, allow_unused=True)
    gz, gp = grads[: len(zs)], dict(zip(names, grads[len(zs) :]))
    tol = 1e-4 if f.dtype != torch.float64 else 1e-9
    bad: set[nn.Module] = set()
    for c, g in zip(calls, gz):
        if g is None:
            continue
        per = per_example_layer_grads(c.module, c.a, g.detach())
        for name, pn in candidates[c.module]:
            ref = gp[name]
            got = per[pn].sum(0)
            ref = torch.zeros_like(got) if ref is None else ref
            scale = float(ref.abs().max()) + float(got.abs().max()) + 1e-30
            if float((got - ref).abs().max()) > tol * scale:
                bad.add(c.module)
    return bad


# ----------------------------------------------------------------------------- the engine

ColumnFn = Callable[[Tensor, Any], Tensor]
"""``(f [B, C] detached, per-example extra or None) -> V [B, C, K]``: the output directions
whose per-example gradients are squared and summed."""


def fallback_jacobian(model: nn.Module, names: list[str], x: Tensor) -> Tensor:
    """Per-example Jacobians ``[B, C, P_fb]`` of the outputs with respect to the fallback
    parameters ``names`` only (the others are the module's own)."""
    params = dict(model.named_parameters())
    sub = {n: params[n].detach() for n in names}
    buffers = dict(model.named_buffers())

    def single(p: dict[str, Tensor], xi: Tensor) -> Tensor:
        full = {**{k: v.detach() for k, v in params.items()}, **p}
        return functional_call(model, (full, buffers), (xi.unsqueeze(0),)).squeeze(0)

    jac = over_examples(jacrev(single), (None, 0))(sub, x)  # a loop for nn.GRU / nn.RNN
    return torch.cat([jac[n].reshape(*jac[n].shape[:2], -1) for n in names], dim=-1)


def sum_squared_column_grads(
    model: nn.Module,
    batches: Iterator[tuple[Tensor, Any]],
    columns: ColumnFn,
    *,
    memory_budget: int = DEFAULT_MEMORY_BUDGET,
    chunk_size: int | None = None,
    method: str = "auto",
) -> Tensor:
    r"""``sum_n sum_k (d (V_{n,:,k}^T f(x_n)) / dw)^2`` ``[P]``: the diagonal of
    ``sum_n J_n^T V_n V_n^T J_n`` for output directions ``V_n [C, K]`` chosen per example by
    ``columns`` (``V = L``, the square root of the output Hessian, gives the GGN diagonal;
    the gradient of the nll at the label gives the empirical Fisher; at sampled labels, the
    Monte-Carlo Fisher).

    Per chunk of ``B`` examples: one forward pass recording the captured layers' inputs and
    outputs, ``K`` backward passes to those outputs (never to the parameters), then the layer
    rules of :func:`squared_grad_sums`; parameters of :attr:`CapturePlan.fallback` use
    per-example Jacobians ``[B, C, P_fb]``.

    Memory: ``B`` is ``chunk_size`` or, when None, derived from ``memory_budget`` bytes via
    :meth:`CapturePlan.chunk_size` (activations and their ``K`` gradients of ``B`` examples,
    plus ``B * C * P_fb`` for the fallback); per-example gradients of a convolution are formed
    in sub-chunks within the budget. It is an estimate of the working set, not a hard cap.

    Args:
        model: ``[B, ...] -> [B, C]``.
        batches: ``(x [N, ...], extra)`` pairs; ``extra`` is None or a tensor ``[S, N, ...]``
            (e.g. ``S`` sampled label sets) sliced per chunk along dimension 1 and passed
            to ``columns``.
        columns: see :data:`ColumnFn`.
        method: ``"auto"`` (capture, fallback per parameter), ``"capture"`` (refuse
            fallback) or ``"jacobian"`` (per-example Jacobians for every parameter).
    """
    if isinstance(memory_budget, bool) or not isinstance(memory_budget, int) or memory_budget < 1:
        raise ValueError(f"memory_budget must be a positive int (bytes), got {memory_budget!r}")
    chunk_size = check_chunk_size(chunk_size)
    model = uncompiled(model)
    named = {n: p for n, p in model.named_parameters() if p.requires_grad}
    if not named:
        raise ValueError("model has no trainable parameters")
    p0 = next(iter(named.values()))
    device, dtype = p0.device, p0.dtype
    acc = {n: torch.zeros_like(p, memory_format=torch.contiguous_format) for n, p in named.items()}
    plan: CapturePlan | None = None
    for x, extra in batches:
        x = x.to(device)
        if plan is None:
            with torch.no_grad():
                f0 = check_model_output(model(x[:2]))
            n_k = columns(f0, None if extra is None else extra[:, :2]).shape[-1]
            plan = CapturePlan.build(model, x[:2], n_columns=n_k, method=method)
        step = chunk_size or plan.chunk_size(memory_budget)
        for s in range(0, len(x), step):
            xc = x[s : s + step]
            ec = None if extra is None else extra[:, s : s + step]
            _accumulate_chunk(model, plan, xc, ec, columns, acc, memory_budget)
    assert plan is not None
    return torch.cat([acc[n].reshape(-1) for n in plan.names]).to(device=device, dtype=dtype)


def _accumulate_chunk(
    model: nn.Module,
    plan: CapturePlan,
    x: Tensor,
    extra: Tensor | None,
    columns: ColumnFn,
    acc: dict[str, Tensor],
    memory_budget: int,
) -> None:
    if plan.captured:
        with torch.enable_grad(), capture_calls(plan.captured) as calls:
            f = model(x)
        v = columns(f.detach(), extra)  # B, C, K
        zs = [c.z for c in calls]
        n_k = v.shape[-1]
        per_k = [
            torch.autograd.grad(f, zs, grad_outputs=v[:, :, k], retain_graph=k < n_k - 1)
            for k in range(n_k)
        ]
        del f
        for i, c in enumerate(calls):
            gs = torch.stack([g[i] for g in per_k])  # K, B, ...
            for pn, t in squared_grad_sums(
                c.module, c.a, gs, memory_budget=memory_budget // 2
            ).items():
                name = plan.param_of.get((id(c.module), pn))
                if name is not None:  # None: a shared weight of a captured layer
                    acc[name] += t
            del gs
        del per_k, calls, zs
    else:
        with torch.no_grad():
            v = columns(model(x), extra)
    if plan.fallback:
        jac = fallback_jacobian(model, plan.fallback, x)  # B, C, P_fb
        sq = torch.einsum("nck,ncp->nkp", v.to(jac.dtype), jac).pow(2).sum((0, 1))
        i = 0
        for n in plan.fallback:
            k = plan.shapes[n].numel()
            acc[n] += sq[i : i + k].view(plan.shapes[n])
            i += k
