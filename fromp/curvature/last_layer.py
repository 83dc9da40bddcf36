r"""The last layer of a network: its input features ``phi(x)`` and the GGN of a linear head.

One home for the last-layer quantities that the last-layer Laplace structures
(:mod:`fromp.laplace.structures`) and the closed-form leave-one-out estimates
(:mod:`fromp.memory.loo`) both use: :func:`last_layer_features` finds the output layer (the
last ``nn.Linear`` called, whose output must be the model's) and records its input;
:func:`last_layer_ggn` is ``sum_n Lambda_n (x) phi~_n phi~_n^T`` over the head's weights.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from fromp._checks import check_batch
from fromp.curvature.hooks import forward_hooks
from fromp.likelihood import Likelihood, get_likelihood

__all__ = ["last_layer_features", "last_layer_ggn"]


def last_layer_features(model: nn.Module, x: Tensor) -> tuple[Tensor, nn.Linear]:
    """The inputs ``phi(x)`` ``[N, D]`` of the model's output layer and that layer.

    The output layer is the last :class:`torch.nn.Linear` called in the forward pass, and its
    output must be the model's output ``[N, C]`` (true for an MLP, a CNN with a linear
    classifier, a multi-head model seen through :func:`fromp.models.with_task`); otherwise a
    ``ValueError``. ``model`` in eval mode; no gradients are kept."""
    check_batch(x, "x")
    calls: list[tuple[nn.Linear, Tensor, Tensor]] = []

    def hook(mod: nn.Module, inp: tuple[Tensor, ...], out: Tensor) -> None:
        calls.append((mod, inp[0], out))  # type: ignore[arg-type]

    linears = [m for m in model.modules() if isinstance(m, nn.Linear)]
    with forward_hooks(linears, hook), torch.no_grad():
        f = model(x)
    if not calls:
        raise ValueError(f"model must end in an nn.Linear layer; {type(model).__name__} has none")
    if not bool(torch.isfinite(f).all()):
        raise ValueError("model outputs are not finite (NaN or inf): check its weights")
    head, phi, out = calls[-1]
    if out.shape != f.shape or not torch.equal(out, f):
        raise ValueError(
            "model's output must be the output of its last nn.Linear layer (a last-layer "
            f"posterior needs a linear head); {type(model).__name__} transforms it further"
        )
    return phi.reshape(len(x), -1), head


def augment_features(phi: Tensor, bias: bool) -> Tensor:
    """``[phi, 1]`` ``[N, D+1]`` with a bias, else ``phi``."""
    return torch.cat([phi, phi.new_ones(len(phi), 1)], 1) if bias else phi


def last_layer_ggn(phi: Tensor, logits: Tensor, likelihood: str | Likelihood) -> Tensor:
    r"""GGN of a linear head ``f = Theta phi~`` over ``theta = vec(Theta)`` (row-major,
    ``Theta = [W | b]`` ``[C, D1]``, ``phi~`` the features with a trailing 1 for a bias):

        ``G = sum_n Lambda_n (x) phi~_n phi~_n^T``  ``[C D1, C D1]``,

    since ``J_n = I_C (x) phi~_n^T``. For a canonical link (softmax, sigmoid, Gaussian) and a
    head linear in ``theta`` it is the exact Hessian of the summed NLL over the head.

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
