"""Forward hooks for the length of a ``with`` block: the one place in fromp that registers a
forward hook. Every capture of layer inputs or outputs (layer capture, last-layer features,
leave-one-out recording, VOGN's recorded outputs, the probes of the checks) registers and
removes its hooks here, the same way."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from typing import Any

from torch import nn

__all__ = ["forward_hooks"]


@contextmanager
def forward_hooks(
    modules: Iterable[nn.Module],
    hook: Callable[..., Any],
    *,
    with_kwargs: bool = False,
) -> Iterator[None]:
    """``hook(module, inputs, output)`` registered as a forward hook on every module of
    ``modules`` inside the block (``with_kwargs=True``: ``hook(module, args, kwargs,
    output)``, the call's keyword arguments too). A hook that returns a value replaces the
    module's output, and hooks registered later (an inner block) see that value, as in
    :meth:`torch.nn.Module.register_forward_hook`; all are removed on exit, also after an
    error."""
    handles = []
    try:
        for m in modules:
            handles.append(m.register_forward_hook(hook, with_kwargs=with_kwargs))
        yield
    finally:
        for h in handles:
            h.remove()
