r"""The last layer of a network: its input features ``phi(x)``, the augmented features
``[phi, 1]`` and the GGN of a linear head, written once for every last-layer user (the
last-layer Laplace classes, :mod:`fromp.laplace.lastlayer`; the closed-form leave-one-out
estimates and the per-epoch tracker, :mod:`fromp.memory.loo`; the subnetwork masks and the
checks of :mod:`fromp.laplace`).

The output layer is the last :class:`torch.nn.Linear` called in a forward pass (or a layer
given by the caller), and its output must be the model's output ``[N, C]``:
:func:`record_last_linear` records it during any forward passes (also training passes),
:func:`last_layer_forward` makes one pass without gradients and checks it,
:func:`last_layer_ggn` is ``sum_n Lambda_n (x) phi~_n phi~_n^T`` over the head's weights.
A model inside ``torch.compile``'s wrapper is read through its original module
(:func:`fromp.models.uncompiled`).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import Tensor, nn

from fromp._checks import check_batch, check_model_output
from fromp.curvature.capture import LayerMap
from fromp.curvature.hooks import forward_hooks
from fromp.likelihood import Likelihood, get_likelihood
from fromp.models import uncompiled

__all__ = [
    "LastLinearRecord",
    "augment_features",
    "last_layer_features",
    "last_layer_forward",
    "last_layer_ggn",
    "last_linear",
    "record_last_linear",
]


class LastLinearRecord:
    """The last call recorded by :func:`record_last_linear`: the layer ``head``, its input
    ``phi`` (as given to the layer, in the autograd graph if the pass was) and its ``out``;
    all None before a forward pass and after :meth:`clear`."""

    def __init__(self) -> None:
        self.head: nn.Linear | None = None
        self.phi: Tensor | None = None
        self.out: Tensor | None = None

    def clear(self) -> None:
        """Forget the recorded call (the next forward pass records anew)."""
        self.head = self.phi = self.out = None


@contextmanager
def record_last_linear(
    model: nn.Module, layer: nn.Module | None = None
) -> Iterator[LastLinearRecord]:
    """Inside the block, the record of the last call of an ``nn.Linear`` of ``model`` (of
    ``layer`` alone when given), updated by every forward pass; hooks removed on exit.

    Raises:
        ValueError: ``model`` has no ``nn.Linear`` (and no ``layer`` is given).
    """
    model = uncompiled(model)
    layers = [layer] if layer is not None else [
        m for m in model.modules() if isinstance(m, nn.Linear)
    ]  # fmt: skip
    if not layers:
        raise ValueError(f"model must end in an nn.Linear layer; {type(model).__name__} has none")
    rec = LastLinearRecord()

    def hook(m: nn.Module, inputs: tuple[Tensor, ...], out: Tensor) -> None:
        rec.head, rec.phi, rec.out = m, inputs[0], out  # type: ignore[assignment]

    with forward_hooks(layers, hook):
        yield rec


def last_layer_forward(
    model: nn.Module, x: Tensor, layer: nn.Module | None = None, *, check: bool = True
) -> tuple[Tensor, Tensor, nn.Linear]:
    """``(f(x) [N, C], phi(x) [N, D], head)``: the outputs, the inputs of the output layer
    and that layer, from one forward pass without gradients (``model`` in eval mode).

    The output layer is ``layer`` when given, else the last ``nn.Linear`` called.
    ``check`` (default): the outputs are a finite ``[N, C]`` tensor and equal the output
    layer's own (true for an MLP, a CNN with a linear classifier, a multi-head model seen
    through :func:`fromp.models.with_task`), else a ``ValueError``; ``check=False`` (a layer
    already checked) skips these.
    """
    check_batch(x, "x")
    with record_last_linear(model, layer) as rec, torch.no_grad():
        f = uncompiled(model)(x)
    if rec.head is None or rec.phi is None or rec.out is None:
        if layer is not None:
            raise ValueError(f"the output layer {type(layer).__name__} is not called in the "
                             "model's forward pass")  # fmt: skip
        raise ValueError(f"model must end in an nn.Linear layer; {type(model).__name__} calls none")
    if check:
        check_model_output(f)
        _refuse_tied(model, rec.head)
        if not bool(torch.isfinite(f).all()):
            raise ValueError("model outputs are not finite (NaN or inf): check its weights")
        if rec.out.shape != f.shape or not torch.equal(rec.out, f):
            if layer is not None:
                raise ValueError(
                    "that layer's output is not the model's output (a last-layer posterior "
                    "needs the model to end in it)"
                )
            raise ValueError(
                "model's output must be the output of its last nn.Linear layer (a last-layer "
                f"posterior needs a linear head); {type(model).__name__} transforms it further"
            )
    return f, rec.phi.reshape(len(x), -1), rec.head  # type: ignore[return-value]


def _refuse_tied(model: nn.Module, head: nn.Module) -> None:
    """``ValueError`` when a trainable parameter of the output layer is registered in another
    layer too (tied weights): the last-layer posterior holds the features fixed, which a
    tied weight moves as well."""
    layer_map = LayerMap.of(model)
    name_of = {id(p): n for n, p in layer_map.named.items()}
    for attr, p in head.named_parameters(recurse=False):
        name = name_of.get(id(p))
        if name is not None and layer_map.shared(name):
            others = [layer_map.module_names[m] for m, _ in layer_map.owners[name] if m is not head]
            raise ValueError(
                f"the output layer's {attr} (parameter {name!r}) is tied to layer(s) {others}: "
                "a last-layer posterior holds the features fixed, but a tied weight moves "
                "them too; use subset_of_weights='all' (or untie the weight)"
            )


def last_layer_features(
    model: nn.Module, x: Tensor, layer: nn.Module | None = None
) -> tuple[Tensor, nn.Linear]:
    """``(phi(x) [N, D], head)``: :func:`last_layer_forward` without the outputs (checked)."""
    _, phi, head = last_layer_forward(model, x, layer)
    return phi, head


def last_linear(model: nn.Module, x: Tensor) -> tuple[str, nn.Linear] | None:
    """The name and the module of the last ``nn.Linear`` called in a forward pass of
    ``x[:1]`` (its output not checked), or None when none is called."""
    model = uncompiled(model)
    if not any(isinstance(m, nn.Linear) for m in model.modules()):
        return None
    device = next(p for p in model.parameters()).device
    with record_last_linear(model) as rec, torch.no_grad():
        model(x[:1].to(device))
    if rec.head is None:
        return None
    return next(n for n, m in model.named_modules() if m is rec.head), rec.head


def augment_features(phi: Tensor, bias: bool) -> Tensor:
    """``phi~ = [phi, 1]`` ``[N, D+1]`` with a bias, else ``phi`` ``[N, D]``: the head's
    Jacobian is ``J_n = I_C (x) phi~_n^T`` for ``theta = vec([W | b])`` (row-major)."""
    return torch.cat([phi, phi.new_ones(len(phi), 1)], 1) if bias else phi


def last_layer_ggn(phi: Tensor, logits: Tensor, likelihood: str | Likelihood) -> Tensor:
    r"""GGN of a linear head ``f = Theta phi~`` over ``theta = vec(Theta)`` (row-major,
    ``Theta = [W | b]`` ``[C, D1]``, ``phi~`` the features with a trailing 1 for a bias,
    :func:`augment_features`):

        ``G = sum_n Lambda_n (x) phi~_n phi~_n^T``  ``[C D1, C D1]``,

    since ``J_n = I_C (x) phi~_n^T``. For a canonical link (softmax, sigmoid, Gaussian) and a
    head linear in ``theta`` it is the exact Hessian of the summed NLL over the head. Sums
    over batches add.

    Args:
        phi: ``[N, D1]`` the (augmented) features. logits: ``[N, C]`` the head's outputs.
        likelihood: its name or a :class:`~fromp.likelihood.Likelihood`.
    """
    lik = get_likelihood(likelihood)
    big_lam = lik.hessian(logits)  # [N, C, C]
    c, d1 = logits.shape[1], phi.shape[1]
    g = phi.new_zeros(c, d1, c, d1)
    for i in range(c):  # C (C + 1) / 2 matrix products [D1, N] x [N, D1]
        for k in range(i, c):
            block = (phi * big_lam[:, i, k, None]).T @ phi
            g[i, :, k] = block
            if k != i:
                g[k, :, i] = block.T
    return g.reshape(c * d1, c * d1)
