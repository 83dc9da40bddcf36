"""A loss term of fixed parameters whose value and gradient are computed in one call: eagerly,
or by replaying one CUDA graph of its whole forward and backward pass.

Within an experience FROMP's penalty (memorable inputs, kernels and targets fixed) and EWC's
quadratic (anchors and importances fixed) are functions of the weights alone, with static
shapes. Run eagerly they cost a training step hundreds of small operations, each a kernel
launch and the host's Python and dispatcher work to issue it: on a GPU, where such a step is
bound by launches, that host work *is* the step's time. :class:`StaticTerm` computes

    ``(L(w), grad_w L(w))``

in one call (:meth:`StaticTerm.__call__`) and returns ``L`` as a tensor whose backward pass
multiplies the stored gradient by the incoming one (one fused multiply for all parameters):
``d/dw [g L(w)] = g grad_w L(w)`` for the scalar ``g`` that reaches ``L`` in the loop's
backward (1 for ``loss = data_loss + L``). On a CUDA device the call replays a CUDA graph
(:class:`torch.cuda.CUDAGraph`) captured once per state of the term (``key``: the memorable
sets, the consolidated anchors, the parameters' identities, the loss dtype): one launch in
place of the forward's and the backward's kernels, no host work per kernel, nothing read
back. Elsewhere the same call computes the pair eagerly (``torch.autograd.grad``): the
capture's CPU-testable form, equal to the eager term in value and gradient.

Modes (the methods' ``cuda_graph=`` argument, :func:`check_mode`):

* ``"auto"`` (default): the CUDA graph when the parameters are on a CUDA device and no
  module of the network has hooks (they would run once, when the graph is captured); the
  method's plain autograd path elsewhere. A capture that fails (an operation a CUDA graph
  cannot hold, e.g. a host read inside a user's model) falls back to the plain path with a
  warning, once.
* ``"on"``: always :class:`StaticTerm` (a CUDA graph on CUDA, the eager pair on the CPU);
  a failed capture raises.
* ``"off"``: the plain autograd path (the reference the tests compare with).

What a replay assumes: the parameters are the same tensors, updated in place (optimizers
do); the term's state is unchanged since the capture (the ``key`` says when it is not, and
the graph is captured again). The backward refuses a gradient when a parameter was changed
in place since the forward (as autograd does for a saved tensor); double backward is not
supported.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Hashable, Sequence

import torch
from torch import Tensor, nn

__all__ = [
    "GRAPH_MODES",
    "Same",
    "StaticTerm",
    "check_mode",
    "param_key",
    "static_term",
    "trainable",
    "uses_graph",
]

GRAPH_MODES = ("auto", "on", "off")
#: eager calls on a side stream before a capture (cuBLAS workspaces, lazily built caches)
WARMUP_CALLS = 3


def check_mode(mode: object) -> str:
    """``mode`` when it is one of :data:`GRAPH_MODES`, else ``ValueError`` naming
    ``cuda_graph``."""
    if not isinstance(mode, str) or mode not in GRAPH_MODES:
        raise ValueError(f"cuda_graph must be one of {GRAPH_MODES}, got {mode!r}")
    return mode


def trainable(net: nn.Module) -> tuple[Tensor, ...]:
    """``net``'s parameters that require grad, in ``parameters()`` order."""
    return tuple(p for p in net.parameters() if p.requires_grad)


def param_key(params: Sequence[Tensor]) -> tuple:
    """The parameters' identities and storages (a parameter replaced, or its ``.data``
    reassigned, is seen): a key entry of :func:`static_term` (C-level maps, no Python
    frames per parameter)."""
    return (*map(id, params), *map(Tensor.data_ptr, params))


class Same:
    """A key entry equal to another only for the very same object (kept alive by the key,
    so that its id is not reused while the key is held)."""

    __slots__ = ("obj",)

    def __init__(self, obj: object) -> None:
        self.obj = obj

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Same) and other.obj is self.obj

    def __hash__(self) -> int:
        return id(self.obj)


def _hooked(net: nn.Module) -> bool:
    """Whether a module of ``net`` has forward or backward hooks (a graph would run them
    once, at the capture, not at every step)."""
    for m in net.modules():
        if m._forward_hooks or m._forward_pre_hooks or m._backward_hooks:
            return True
        if getattr(m, "_backward_pre_hooks", None):
            return True
    return False


def uses_graph(mode: str, params: Sequence[Tensor], net: nn.Module) -> bool | None:
    """How a step runs: True for a CUDA graph, False for the eager pair, None for the
    method's plain autograd path (``"off"``, or ``"auto"`` off CUDA or with hooks)."""
    cuda = bool(params) and all(p.is_cuda for p in params)
    if mode == "off" or (mode == "auto" and (not cuda or _hooked(net))):
        return None
    return cuda


class _Precomputed(torch.autograd.Function):
    """``L`` from its stored value, differentiable in the parameters through the stored
    gradient: backward returns ``g * grad_w L`` (fresh tensors, one fused multiply)."""

    @staticmethod
    def forward(ctx, value, n, *rest):  # type: ignore[no-untyped-def, override]
        grads, params = rest[:n], rest[n:]
        ctx.n, ctx.grads = n, grads
        ctx.versions = [p._version for p in params]
        ctx.params = params
        return value.detach().clone()

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, g):  # type: ignore[no-untyped-def, override]
        for p, v in zip(ctx.params, ctx.versions):
            if p._version != v:
                raise RuntimeError(
                    "a parameter was modified in place between the captured loss term's "
                    "forward and its backward (its gradient was taken at the old weights)"
                )
        present = [gr for gr in ctx.grads if gr is not None]
        scaled = iter(torch._foreach_mul(present, g.to(present[0].dtype)) if present else [])
        out = [None if gr is None else next(scaled) for gr in ctx.grads]
        return (None, None, *([None] * ctx.n), *out)


class StaticTerm:
    """``fn() -> (L, *extras)`` of the fixed parameters ``params``, as ``(L, *extras)`` with
    ``L`` differentiable through the gradient computed with it (module docstring).

    Args:
        fn: computes the term from the parameters as they are (under grad mode): a scalar
            ``L`` first, then any other tensors to report (returned detached; None allowed).
        params: the tensors ``L`` is differentiated in (those that require grad).
        key: the state ``fn`` reads besides the parameters' values; a different key at a
            call means the graph must be captured again.
        graph: replay a CUDA graph (else the eager pair).

    The outputs of a graph are copied out of its static buffers at every call (so a value
    kept by the caller is not overwritten by the next step).
    """

    def __init__(
        self,
        fn: Callable[[], tuple[Tensor | None, ...]],
        params: Sequence[Tensor],
        key: Hashable,
        *,
        graph: bool,
    ) -> None:
        self.fn, self.params, self.key, self.graph = fn, list(params), key, graph
        self._cuda_graph: torch.cuda.CUDAGraph | None = None
        self._static: tuple[tuple[Tensor | None, ...], tuple[Tensor | None, ...]] | None = None
        self.captures = 0

    def _pair(self) -> tuple[tuple[Tensor | None, ...], tuple[Tensor | None, ...]]:
        with torch.enable_grad():
            outs = self.fn()
            assert outs[0] is not None
            grads = torch.autograd.grad(outs[0], self.params, allow_unused=True)
        return outs, grads

    def _capture(self) -> None:
        """Warm up on a side stream, then capture the pair (on the parameters' device)."""
        device = self.params[0].device
        with torch.cuda.device(device):
            side = torch.cuda.Stream(device)
            side.wait_stream(torch.cuda.current_stream(device))
            with torch.cuda.stream(side):
                for _ in range(WARMUP_CALLS):
                    self._pair()
            torch.cuda.current_stream(device).wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                static = self._pair()
        self._cuda_graph, self._static = graph, static
        self.captures += 1

    def release(self) -> None:
        """Free the graph and its static buffers."""
        if self._cuda_graph is not None:
            self._cuda_graph.reset()
        self._cuda_graph, self._static = None, None

    def __call__(self) -> tuple[Tensor | None, ...]:
        if self.graph:
            if self._cuda_graph is None:
                self._capture()
            assert self._cuda_graph is not None and self._static is not None
            self._cuda_graph.replay()
            outs, grads = self._static
        else:
            outs, grads = self._pair()
        value = outs[0]
        assert value is not None
        loss = _Precomputed.apply(value.detach(), len(grads), *grads, *self.params)
        extras = [None if o is None else o.detach().clone() for o in outs[1:]]
        return (loss, *extras)


def static_term(
    cache: dict,
    mode: str,
    net: nn.Module,
    params: Sequence[Tensor],
    key: Hashable,
    fn: Callable[[], tuple[Tensor | None, ...]],
    owner: str,
) -> StaticTerm | None:
    """The :class:`StaticTerm` of ``key`` kept in ``cache`` (the method's dict), built (and
    its graph captured) when the key changed; None for the plain path (:func:`uses_graph`,
    decided when the key changes, so hooks added within an experience are seen at the next
    change). ``"auto"`` falls back to the plain path for good, with a warning, when a
    capture fails."""
    if cache.get("key") == key:
        return cache.get("term")
    if cache.get("failed") and mode == "auto":
        return None
    old = cache.pop("term", None)
    if old is not None:
        old.release()
    graph = uses_graph(mode, params, net)
    term = None if graph is None else StaticTerm(fn, params, key, graph=graph)
    if term is not None and graph:
        try:
            term._capture()
        except RuntimeError as err:
            term.release()
            if mode != "auto":
                raise
            warnings.warn(
                f"{owner}: the loss term could not be captured in a CUDA graph ({err}); "
                "it runs eagerly (cuda_graph='off' silences this)",
                RuntimeWarning,
                stacklevel=4,
            )
            cache["failed"], term = True, None
    cache.update(key=key, term=term)
    return term
