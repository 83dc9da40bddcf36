"""Mean-field Gaussian posteriors over a network's weights: the one implementation that
variational continual learning (:class:`fromp.continual.vcl.VCLMethod`) trains.

Every Gaussian weight ``w`` has a factorised posterior ``q(w) = N(mu, exp(logvar))`` and a
Gaussian prior ``p(w) = N(mu_0, v_0)``. Whatever holds them, a network exposes them as
*sites* ``(mu, logvar, mu_0, v_0)`` (:meth:`GaussianWeights.gaussian_sites`), and one code
path gives the KL, ``KL(q || p)`` in closed form over all sites at once
(:func:`gaussian_kl_flat`), and VCL's recursion, the posterior of task ``t - 1`` becoming
the prior of task ``t`` (:meth:`GaussianWeights.set_prior_from_posterior`). Two holders:

* :class:`BayesLayer` (:class:`BayesLinear`, :class:`BayesConv2d`) in a
  :class:`BayesMultiHeadModel` (:func:`to_bayesian` of a :mod:`fromp.models` network): the
  priors are buffers (they travel with ``state_dict``) and forward passes use local
  reparameterisation (below);
* :class:`MeanFieldTwin` of any module (a plain ``nn.Module``, a :mod:`fromp.models`
  network, an Avalanche ``MultiTaskModule``), which it leaves as it is: the module's own
  ``Linear``/``Conv2d`` parameters are the means, the twin keeps a log-variance and a prior
  per parameter, and a sampled network is the module run with local reparameterisation in
  its ``nn.Linear`` layers and whole weight draws of its other Gaussian parameters
  (:meth:`MeanFieldTwin.sample_logits`).

Both are a :class:`MeanFieldNet`: ``sample_logits(x, task, n_samples) -> [S, N, K]``,
``mean_logits(x, task) -> [N, K]`` (the network at its means), ``kl(heads)``,
``set_prior_from_posterior(heads)``, ``mean_mode()``, ``mean_parameters()``,
``variance_parameters()`` (the log-variances that are not the network's own parameters),
``sync()`` (after a module grew), ``variational_state()`` (what the network's
``state_dict`` does not hold).

The Bayesian layers use the local reparameterisation trick (Kingma et al., 2015): for a linear
map ``a = x W^T + b`` with independent Gaussian weights the pre-activations are Gaussian,
``a ~ N(x mu_W^T + mu_b, x^2 exp(logvar_W)^T + exp(logvar_b))``, so ``a`` is sampled
directly (one independent weight draw per example) instead of sampling ``W``. The same
holds for convolutions (``conv(x, mu)`` and ``conv(x^2, var)``).

Shapes: a layer maps ``[N, ...] -> [N, ...]``; with ``n_samples=S`` it maps an input without
a sample dimension to ``[S, N, ...]`` (the mean and variance are computed once and ``S``
pre-activations drawn), which is how the networks below share the cost of the first layer
between Monte Carlo samples.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.func import functional_call

from fromp._checks import check_prior_precision
from fromp.continual.named_state import fit_shape
from fromp.curvature.hooks import forward_hooks
from fromp.models import (
    CifarCNN,
    MultiHeadMLP,
    MultiHeadModel,
    head_parameters,
    is_multitask,
    with_task,
)

__all__ = [
    "BayesCifarCNN",
    "BayesConv2d",
    "BayesLayer",
    "BayesLinear",
    "BayesMultiHeadMLP",
    "BayesMultiHeadModel",
    "GaussianWeights",
    "MeanFieldNet",
    "MeanFieldTwin",
    "gaussian_kl",
    "gaussian_kl_flat",
    "gaussian_names",
    "local_std",
    "to_bayesian",
]

#: ``(mu, logvar, prior_mu, prior_var)`` of one Gaussian weight tensor (all of one shape).
Site = tuple[Tensor, Tensor, Tensor, Tensor]


def gaussian_kl(mu: Tensor, var: Tensor, mu0: Tensor, var0: Tensor) -> Tensor:
    """``KL(N(mu, diag var) || N(mu0, diag var0))`` summed over all entries (a scalar).

    ``0.5 * sum(log(var0 / var) + (var + (mu - mu0)^2) / var0 - 1)``; all tensors
    broadcast to a common shape.
    """
    return 0.5 * (torch.log(var0) - torch.log(var) + (var + (mu - mu0) ** 2) / var0 - 1.0).sum()


def gaussian_kl_flat(
    quads: Iterable[tuple[Tensor, Tensor, Tensor, Tensor]],
) -> Tensor:
    """``sum KL(N(mu, diag exp(logvar)) || N(mu0, diag var0))`` over every ``(mu, logvar,
    mu0, var0)`` of ``quads`` (tensors of one shape within each quadruple) in one pass: the
    four are concatenated into ``[P]`` vectors and the closed form
    ``0.5 * sum(log var0 - logvar + (exp(logvar) + (mu - mu0)^2) / var0 - 1)`` is evaluated
    once, instead of one expression per layer and parameter (a VCL step's KL costs the same
    few kernels whatever the number of layers and heads). Differentiable in ``mu`` and
    ``logvar``."""
    quads = list(quads)
    if not quads:
        raise ValueError("gaussian_kl_flat needs at least one parameter")
    mu, lv, mu0, v0 = (torch.cat([q[i].reshape(-1) for q in quads]) for i in range(4))
    return 0.5 * (torch.log(v0) - lv + (lv.exp() + (mu - mu0) ** 2) / v0 - 1.0).sum()


class GaussianWeights(nn.Module):
    """Weights with a mean-field Gaussian posterior and prior, seen as sites.

    Subclasses implement :meth:`gaussian_sites`; the KL and VCL's prior recursion are
    written once, here, over the sites.
    """

    def gaussian_sites(self, heads: Iterable[int] | None = None) -> list[Site]:
        """``(mu, logvar, prior_mu, prior_var)`` of every Gaussian weight tensor (of the
        body and the given heads for a network with task heads; all when None)."""
        raise NotImplementedError

    def kl(self, heads: Iterable[int] | None = None) -> Tensor:
        """``KL(q || prior)`` over :meth:`gaussian_sites` (a scalar, differentiable in the
        means and log-variances), in one pass (:func:`gaussian_kl_flat`)."""
        return gaussian_kl_flat(self.gaussian_sites(heads))

    @torch.no_grad()
    def set_prior_from_posterior(self, heads: Iterable[int] | None = None) -> None:
        """VCL's recursion: the posterior becomes the prior, ``mu_0 <- mu``,
        ``v_0 <- exp(logvar)`` (for the body and the given heads; all when None)."""
        for m, lv, m0, v0 in self.gaussian_sites(heads):
            m0.copy_(m)
            v0.copy_(lv.exp())

    @torch.no_grad()
    def redraw_means(self, std: float) -> None:
        """Re-draw every Gaussian mean from ``N(0, std^2)`` truncated to ``[-2 std, 2 std]``
        in place (the VCL reference initialisation, ``std = 0.1``)."""
        if std <= 0:
            raise ValueError(f"std must be > 0, got {std}")
        for mu, _, _, _ in self.gaussian_sites():
            nn.init.trunc_normal_(mu, 0.0, std, -2 * std, 2 * std)

    @torch.no_grad()
    def reset_prior(self, prior_mean: float = 0.0, prior_precision: float = 1.0) -> None:
        """Set the prior of every site back to ``N(prior_mean, 1 / prior_precision)``."""
        variance = 1.0 / check_prior_precision(prior_precision)  # type: ignore[operator]
        for _, _, m0, v0 in self.gaussian_sites():
            m0.fill_(prior_mean)
            v0.fill_(variance)


class MeanFieldNet(GaussianWeights):
    """A network with a mean-field Gaussian posterior: what :class:`fromp.continual.vcl.
    VCLMethod` trains (:class:`BayesMultiHeadModel`, :class:`MeanFieldTwin`)."""

    def sample_logits(self, x: Tensor, task: int | Tensor | None, n_samples: int) -> Tensor:
        """Logits ``[S, N, K]`` of ``S = n_samples`` weight samples through head ``task``."""
        raise NotImplementedError

    def mean_logits(self, x: Tensor, task: int | Tensor | None) -> Tensor:
        """Logits ``[N, K]`` of the network at the posterior means through head ``task``."""
        raise NotImplementedError

    @contextmanager
    def mean_mode(self) -> Iterator[MeanFieldNet]:
        """Within the context :meth:`mean_logits` is what a maximum-likelihood fit of
        :meth:`mean_parameters` trains."""
        yield self

    def mean_parameters(self) -> list[nn.Parameter]:
        """The parameters a maximum-likelihood fit of the means trains."""
        raise NotImplementedError

    def variance_parameters(self) -> list[nn.Parameter]:
        """The log-variances that are not parameters of the network the user gave (an
        optimizer of that network's parameters needs them added); none when the network
        is the posterior itself."""
        return []

    def sync(self) -> bool:
        """Give parameters that appeared or grew (a new head) a posterior and a prior;
        returns whether anything changed."""
        return False

    def variational_state(self) -> dict:
        """The posterior's state that the user's network's ``state_dict()`` does not hold
        (tensors by parameter name, on the CPU); none when the network is the posterior."""
        return {}

    def load_variational_state(self, state: dict) -> None:
        """Restore :meth:`variational_state` in place (refused, before changing anything,
        when its names or shapes differ from the network's)."""


def local_std(
    op: Callable[[Tensor, Tensor, Tensor | None], Tensor],
    x: Tensor,
    weight_var: Tensor,
    bias_var: Tensor | None,
) -> Tensor:
    """The standard deviation of the pre-activations ``op(x, W, b)`` of a layer with
    independent Gaussian weights and bias (local reparameterisation, Kingma et al., 2015):
    ``sqrt(op(x^2, var_W, var_b))``, ``op`` linear in the weights (``F.linear``,
    ``F.conv2d``). The variance is 0 only for an all-zero input without a Gaussian bias: it
    is clamped to the dtype's smallest normal number there, so that ``sqrt``'s gradient
    stays finite (and the noise vanishes)."""
    var = op(x * x, weight_var, bias_var)
    return var.clamp_min(torch.finfo(var.dtype).tiny).sqrt()


class BayesLayer(GaussianWeights):
    """Common machinery of mean-field Gaussian layers.

    Parameters ``weight_mu``, ``weight_logvar`` (and ``bias_mu``, ``bias_logvar``);
    buffers ``weight_prior_mu``, ``weight_prior_var`` (and the bias ones). Subclasses
    implement :meth:`_op`, the layer's linear map ``(x, W, b) -> x * W + b``; the Gaussian of
    the pre-activations, ``N(op(x, mu_W, mu_b), op(x^2, var_W, var_b))`` (:meth:`_mean_std`,
    :func:`local_std`),
    and the map at the means (:meth:`_deterministic`) follow from it.

    Args:
        weight_shape: shape of the weight (``[out, ...]``; the bias is ``[out]``).
        bias: whether the layer has a bias.
        prior_mean, prior_precision: the prior ``N(prior_mean, 1 / prior_precision)`` of
            every weight (the variance kept in the buffers ``*_prior_var``).
        init_logvar: initial posterior ``log sigma^2`` (VCL: -6).
    """

    weight_mu: nn.Parameter
    weight_logvar: nn.Parameter
    bias_mu: nn.Parameter | None
    bias_logvar: nn.Parameter | None

    def __init__(
        self,
        weight_shape: tuple[int, ...],
        bias: bool = True,
        *,
        prior_mean: float = 0.0,
        prior_precision: float = 1.0,
        init_logvar: float = -6.0,
    ) -> None:
        super().__init__()
        prior_var = 1.0 / check_prior_precision(prior_precision)  # type: ignore[operator]
        self.init_logvar = float(init_logvar)
        self.use_mean = False  # forward with W = mu (no sampling) when True
        self.weight_mu = nn.Parameter(torch.empty(weight_shape))
        self.weight_logvar = nn.Parameter(torch.full(weight_shape, self.init_logvar))
        self.register_buffer("weight_prior_mu", torch.full(weight_shape, float(prior_mean)))
        self.register_buffer("weight_prior_var", torch.full(weight_shape, float(prior_var)))
        if bias:
            out = weight_shape[0]
            self.bias_mu = nn.Parameter(torch.empty(out))
            self.bias_logvar = nn.Parameter(torch.full((out,), self.init_logvar))
            self.register_buffer("bias_prior_mu", torch.full((out,), float(prior_mean)))
            self.register_buffer("bias_prior_var", torch.full((out,), float(prior_var)))
        else:
            self.register_parameter("bias_mu", None)
            self.register_parameter("bias_logvar", None)
            self.register_buffer("bias_prior_mu", None)
            self.register_buffer("bias_prior_var", None)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Means as PyTorch's default ``nn.Linear``/``nn.Conv2d`` initialisation
        (uniform, fan-in scaled); log-variances ``init_logvar``."""
        fan_in = self.weight_mu[0].numel()
        nn.init.kaiming_uniform_(self.weight_mu, a=math.sqrt(5))
        with torch.no_grad():
            self.weight_logvar.fill_(self.init_logvar)
            if self.bias_mu is not None:
                bound = 1.0 / math.sqrt(fan_in)
                self.bias_mu.uniform_(-bound, bound)
                self.bias_logvar.fill_(self.init_logvar)

    def _pairs(self) -> Iterator[Site]:
        """``(mu, logvar, prior_mu, prior_var)`` for the weight and the bias."""
        yield self.weight_mu, self.weight_logvar, self.weight_prior_mu, self.weight_prior_var
        if self.bias_mu is not None:
            yield self.bias_mu, self.bias_logvar, self.bias_prior_mu, self.bias_prior_var

    def gaussian_sites(self, heads: Iterable[int] | None = None) -> list[Site]:
        """The weight's and the bias's sites (``heads``: a layer has none, must be None)."""
        if heads is not None:
            raise ValueError(f"heads must be None for a single layer, got {heads!r}")
        return list(self._pairs())

    @torch.no_grad()
    def load_mean_from(self, layer: nn.Module) -> None:
        """Copy a deterministic layer's ``weight`` (and ``bias``) into the means (ML init)."""
        if layer.weight.shape != self.weight_mu.shape:
            raise ValueError(
                f"layer.weight must have shape {tuple(self.weight_mu.shape)}, "
                f"got {tuple(layer.weight.shape)}"
            )
        self.weight_mu.copy_(layer.weight)
        if self.bias_mu is not None:
            if getattr(layer, "bias", None) is None:
                raise ValueError("layer has no bias but this Bayesian layer has one")
            self.bias_mu.copy_(layer.bias)

    def _op(self, x: Tensor, w: Tensor, b: Tensor | None) -> Tensor:
        raise NotImplementedError

    def _mean_std(self, x: Tensor) -> tuple[Tensor, Tensor]:
        mean = self._op(x, self.weight_mu, self.bias_mu)
        bvar = None if self.bias_logvar is None else self.bias_logvar.exp()
        return mean, local_std(self._op, x, self.weight_logvar.exp(), bvar)

    def _deterministic(self, x: Tensor) -> Tensor:
        return self._op(x, self.weight_mu, self.bias_mu)

    def forward(self, x: Tensor, n_samples: int | None = None) -> Tensor:
        """One sampled pre-activation per example ``[N, ...]`` (``[S, N, ...]`` with
        ``n_samples=S``) by local reparameterisation; the mean map when ``use_mean``."""
        if self.use_mean:
            out = self._deterministic(x)
            return out if n_samples is None else out.expand(n_samples, *out.shape)
        mean, std = self._mean_std(x)
        shape = mean.shape if n_samples is None else (n_samples, *mean.shape)
        eps = torch.randn(shape, dtype=mean.dtype, device=mean.device)
        return mean + std * eps


class BayesLinear(BayesLayer):
    """Mean-field Gaussian ``nn.Linear``: ``[N, in] -> [N, out]``.

    Pre-activations ``a ~ N(x mu_W^T + mu_b, x^2 var_W^T + var_b)`` (local
    reparameterisation). ``kw``: ``prior_mean``, ``prior_precision`` (the prior
    ``N(prior_mean, 1 / prior_precision)`` on every weight), ``init_logvar`` (VCL: -6), as
    :class:`BayesLayer`.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = True, **kw: Any):
        if in_features < 1 or out_features < 1:
            raise ValueError(
                f"in_features and out_features must be >= 1, got {in_features}, {out_features}"
            )
        super().__init__((out_features, in_features), bias, **kw)
        self.in_features, self.out_features = in_features, out_features

    def _op(self, x: Tensor, w: Tensor, b: Tensor | None) -> Tensor:
        return F.linear(x, w, b)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}"


class BayesConv2d(BayesLayer):
    """Mean-field Gaussian ``nn.Conv2d`` ``[N, C_in, H, W] -> [N, C_out, H', W']``.

    Pre-activations ``a ~ N(conv(x, mu_W) + mu_b, conv(x^2, var_W) + var_b)`` (local
    reparameterisation: independent across examples, output positions and channels).
    ``kw``: ``prior_mean``, ``prior_precision``, ``init_logvar`` as :class:`BayesLayer`.
    """

    def __init__(
        self,
        in_channels: int,
        out_channels: int,
        kernel_size: int | tuple[int, int],
        stride: int | tuple[int, int] = 1,
        padding: int | tuple[int, int] = 0,
        bias: bool = True,
        **kw: Any,
    ) -> None:
        k = (kernel_size, kernel_size) if isinstance(kernel_size, int) else tuple(kernel_size)
        super().__init__((out_channels, in_channels, *k), bias, **kw)
        self.in_channels, self.out_channels, self.kernel_size = in_channels, out_channels, k
        self.stride, self.padding = stride, padding

    def _op(self, x: Tensor, w: Tensor, b: Tensor | None) -> Tensor:
        return F.conv2d(x, w, b, stride=self.stride, padding=self.padding)

    def extra_repr(self) -> str:
        return (
            f"{self.in_channels}, {self.out_channels}, kernel_size={self.kernel_size}, "
            f"stride={self.stride}, padding={self.padding}"
        )


def _bayes_layers(module: nn.Module) -> list[BayesLayer]:
    return [m for m in module.modules() if isinstance(m, BayesLayer)]


def _make_bayes(module: nn.Module, **kw) -> BayesLayer:
    """The Bayesian version of an ``nn.Linear``/``nn.Conv2d`` with means copied from it."""
    if isinstance(module, nn.Linear):
        new = BayesLinear(module.in_features, module.out_features, module.bias is not None, **kw)
    else:
        if module.groups != 1 or module.dilation != (1, 1) or isinstance(module.padding, str):
            raise ValueError(f"unsupported Conv2d for to_bayesian: {module}")
        new = BayesConv2d(
            module.in_channels,
            module.out_channels,
            module.kernel_size,
            module.stride,
            module.padding,
            module.bias is not None,
            **kw,
        )
    new = new.to(device=module.weight.device, dtype=module.weight.dtype)
    new.load_mean_from(module)
    return new


def _convert(module: nn.Module, **kw) -> nn.Module:
    """A copy of ``module`` with every Linear/Conv2d replaced by its Bayesian version
    whose means are the original weights."""
    if isinstance(module, nn.Linear | nn.Conv2d):
        return _make_bayes(module, **kw)
    module = copy.deepcopy(module)
    stack = [module]
    while stack:
        parent = stack.pop()
        for name, child in parent.named_children():
            if isinstance(child, nn.Linear | nn.Conv2d):
                setattr(parent, name, _make_bayes(child, **kw))
            else:
                stack.append(child)
    return module


class BayesMultiHeadModel(MultiHeadModel, MeanFieldNet):
    """A :class:`~fromp.models.MultiHeadModel` whose Linear/Conv2d layers are mean-field
    Gaussian (built with :func:`to_bayesian`).

    ``forward(x, task, n_samples=None)`` gives logits ``[N, K]`` (one weight sample per
    example) or ``[S, N, K]`` with ``n_samples=S``. The first Bayesian layer computes its
    pre-activation mean and variance once for all ``S`` samples; later layers see the
    samples merged into the batch dimension.
    """

    def __init__(self, body: nn.Module, heads: nn.ModuleList) -> None:
        super().__init__()
        if len(heads) < 1:
            raise ValueError("heads must hold at least one head")
        self.body = body
        self.heads = heads
        self.n_heads = len(heads)
        self.head_size = heads[0].out_features

    # -- weight-space helpers -------------------------------------------------------
    @property
    def multi_head(self) -> bool:
        """Whether a task label picks one of several heads."""
        return self.n_heads > 1

    def body_layers(self) -> list[BayesLayer]:
        """The Bayesian layers of the shared body."""
        return _bayes_layers(self.body)

    def _selected(self, heads: Iterable[int] | None) -> list[BayesLayer]:
        idx = range(self.n_heads) if heads is None else sorted(set(int(h) for h in heads))
        for h in idx:
            if not 0 <= h < self.n_heads:
                raise ValueError(f"heads must be in [0, {self.n_heads}), got {h}")
        return self.body_layers() + [layer for h in idx for layer in _bayes_layers(self.heads[h])]

    def gaussian_sites(self, heads: Iterable[int] | None = None) -> list[Site]:
        """The sites of the body and of the given heads (all heads when None)."""
        return [q for layer in self._selected(heads) for q in layer._pairs()]

    @contextmanager
    def mean_mode(self) -> Iterator[BayesMultiHeadModel]:
        """Within the context every layer uses ``W = mu`` (a deterministic network whose
        parameters are the means; used for the maximum-likelihood initialisation)."""
        layers = _bayes_layers(self)
        old = [layer.use_mean for layer in layers]
        for layer in layers:
            layer.use_mean = True
        try:
            yield self
        finally:
            for layer, o in zip(layers, old):
                layer.use_mean = o

    def mean_parameters(self) -> list[nn.Parameter]:
        """The posterior means (``*_mu`` parameters)."""
        return [p for n, p in self.named_parameters() if n.endswith("_mu")]

    def sample_logits(self, x: Tensor, task: int | Tensor | None, n_samples: int) -> Tensor:
        """``self(x, task, n_samples=n_samples)``: ``[S, N, K]``."""
        return self(x, task, n_samples=n_samples)

    def mean_logits(self, x: Tensor, task: int | Tensor | None) -> Tensor:
        """``self(x, task)`` with every layer at its means: ``[N, K]``."""
        with self.mean_mode():
            return self(x, task)

    # -- forward --------------------------------------------------------------------
    def _run(self, module: nn.Module, x: Tensor, n_samples: int | None) -> tuple[Tensor, bool]:
        """Apply ``module``; returns the output and whether the sample dim was merged."""
        if isinstance(module, BayesLayer):
            if n_samples is None:
                return module(x), False
            return module(x, n_samples=n_samples).flatten(0, 1), True
        if isinstance(module, nn.Sequential):
            merged = False
            for m in module:
                x, m_now = self._run(m, x, None if merged else n_samples)
                merged = merged or m_now
            return x, merged
        return module(x), False

    def features(self, x: Tensor, n_samples: int | None = None) -> Tensor:
        """Shared features ``[N, D]``, or ``[S * N, D]`` (sample-major) with ``n_samples``."""
        h, merged = self._run(self.body, x, n_samples)
        if n_samples is not None and not merged:
            h = h.unsqueeze(0).expand(n_samples, *h.shape).flatten(0, 1)
        return h

    def forward(self, x: Tensor, task=None, n_samples: int | None = None) -> Tensor:
        """Sampled logits ``[N, K]``, or ``[S, N, K]`` with ``n_samples=S``."""
        if n_samples is not None and n_samples < 1:
            raise ValueError(f"n_samples must be >= 1, got {n_samples}")
        n = len(x)
        h = self.features(x, n_samples)
        s = 1 if n_samples is None else n_samples
        if isinstance(task, Tensor) and task.ndim == 0:
            task = int(task.item())
        if self.n_heads == 1:
            out = self.heads[0](h)
        elif task is None:
            raise ValueError(
                f"task is required: this model has {self.n_heads} heads "
                "(pass an int or a [N] tensor of task ids)"
            )
        elif isinstance(task, int):
            if not 0 <= task < self.n_heads:
                raise ValueError(f"task must be in [0, {self.n_heads}), got {task}")
            out = self.heads[task](h)
        else:
            if task.shape != (n,):
                raise ValueError(f"task tensor must have shape [N]=[{n}], got {tuple(task.shape)}")
            t = task.long().repeat(s)
            allh = torch.stack([head(h) for head in self.heads], dim=1)
            out = allh[torch.arange(len(h), device=h.device), t]
        return out if n_samples is None else out.unflatten(0, (s, n))

    @torch.no_grad()
    def predict_proba(self, x: Tensor, task=None, n_samples: int = 100) -> Tensor:
        """Monte Carlo predictive ``mean_s softmax(f_s(x))`` ``[N, K]``."""
        return self(x, task, n_samples=n_samples).softmax(-1).mean(0)


_LAYER_KW = ("prior_mean", "prior_precision", "init_logvar")


def to_bayesian(
    net: MultiHeadModel,
    *,
    prior_mean: float = 0.0,
    prior_precision: float = 1.0,
    init_logvar: float = -6.0,
) -> BayesMultiHeadModel:
    """Convert a :class:`~fromp.models.MultiHeadModel` (e.g. ``MultiHeadMLP``,
    ``CifarCNN``) to a :class:`BayesMultiHeadModel`: each ``nn.Linear``/``nn.Conv2d`` becomes
    a Bayesian layer whose means are the original weights, log-variances ``init_logvar``
    and prior ``N(prior_mean, 1 / prior_precision)``. ``net`` is not modified."""
    if isinstance(net, BayesMultiHeadModel):
        raise ValueError("net is already Bayesian")
    if not isinstance(net, MultiHeadModel):
        raise ValueError(f"net must be a fromp MultiHeadModel, got {type(net).__name__}")
    kw = dict(prior_mean=prior_mean, prior_precision=prior_precision, init_logvar=init_logvar)
    body = _convert(net.body, **kw)
    return BayesMultiHeadModel(body, _convert(net.heads, **kw))


def _layer_kw(kwargs: dict[str, Any]) -> dict[str, Any]:
    """Take the Bayesian layers' keywords (:data:`_LAYER_KW`) out of ``kwargs``."""
    return {k: kwargs.pop(k) for k in _LAYER_KW if k in kwargs}


class BayesMultiHeadMLP(BayesMultiHeadModel):
    """Bayesian :class:`~fromp.models.MultiHeadMLP`: the same arguments (``in_features=784,
    hidden=(256, 256), n_heads=5, head_size=2``), architecture and parameter order, and the
    keywords ``prior_mean``, ``prior_precision``, ``init_logvar`` of :func:`to_bayesian`.
    Split MNIST (VCL): ``BayesMultiHeadMLP(784, (256, 256), n_heads=5, head_size=2)``."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kw = _layer_kw(kwargs)
        net = MultiHeadMLP(*args, **kwargs)
        super().__init__(_convert(net.body, **kw), _convert(net.heads, **kw))


class BayesCifarCNN(BayesMultiHeadModel):
    """Bayesian :class:`~fromp.models.CifarCNN` (``in_channels=3, n_heads=6,
    head_size=10``, and :func:`to_bayesian`'s keywords; no dropout: weight noise replaces
    it)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kw = _layer_kw(kwargs)
        net = CifarCNN(*args, **kwargs, dropout=False)
        super().__init__(_convert(net.body, **kw), _convert(net.heads, **kw))


# ----------------------------------------------------------------------- any module
_GAUSSIAN = (nn.Linear, nn.Conv2d)


def gaussian_names(model: nn.Module) -> list[str]:
    """Names (as in ``model.named_parameters()``) of the trainable weights and biases of its
    ``nn.Linear`` and ``nn.Conv2d`` layers: the parameters a :class:`MeanFieldTwin` makes
    Gaussian. A tensor shared by several layers (tied weights) is one Gaussian parameter,
    under the name ``named_parameters()`` gives it (its first)."""
    first = {id(p): n for n, p in model.named_parameters()}
    out = []
    for prefix, module in model.named_modules():
        if isinstance(module, _GAUSSIAN):
            for n, p in module.named_parameters(recurse=False):
                name = f"{prefix}.{n}" if prefix else n
                if p.requires_grad and first.get(id(p)) == name:
                    out.append(name)
    return out


def _key(name: str) -> str:
    return name.replace(".", "__")


def _local_linears(model: nn.Module, gaussian: set[str]) -> list[tuple[nn.Linear, str, str | None]]:
    """``(layer, weight name, bias name or None)`` of the ``nn.Linear`` layers (their own
    ``forward``, not a subclass's) whose weight is Gaussian and whose parameters no other
    layer shares: the layers :class:`MeanFieldTwin` samples by local reparameterisation."""
    uses: dict[int, int] = {}
    for module in model.modules():
        for p in module.parameters(recurse=False):
            uses[id(p)] = uses.get(id(p), 0) + 1
    out = []
    for prefix, module in model.named_modules():
        if type(module).forward is not nn.Linear.forward:
            continue
        own = dict(module.named_parameters(recurse=False))
        if any(uses[id(p)] > 1 for p in own.values()):
            continue
        names = {n: f"{prefix}.{n}" if prefix else n for n in own}
        if names.get("weight") not in gaussian:
            continue
        bias = names.get("bias")
        out.append((module, names["weight"], bias if bias in gaussian else None))
    return out


class MeanFieldTwin(MeanFieldNet):
    """A mean-field Gaussian posterior over a module's ``Linear``/``Conv2d`` parameters,
    leaving the module as it is.

    The module's own parameters are the means ``mu`` (after training the module holds the
    posterior means), a log-variance ``log sigma^2`` of the same shape is kept per parameter
    (:meth:`variance_parameters`), and a prior ``N(mu_0, v_0)`` per parameter. All other
    parameters (batch-norm affine, embeddings, ...) stay deterministic: they are trained by
    the data term and enter no KL. The module keeps its class (an Avalanche dynamic module
    still grows).

    A sampled network (:meth:`sample_logits`) is the module itself, run with

    * local reparameterisation in each ``nn.Linear`` layer (Kingma et al., 2015): its output
      ``x mu_W^T + mu_b`` (the layer's own forward) plus ``sqrt(x^2 var_W^T + var_b) * eps``,
      ``eps ~ N(0, I)`` per example and unit, added by a forward hook: each example draws
      its own weights, exactly (the pre-activations of one example are independent
      Gaussians given its input), at the cost of a second product per layer;
    * whole draws ``w = mu + sigma * eps`` of every other Gaussian parameter (``Conv2d``
      layers, tied weights, ``Linear`` subclasses), one per sample and shared by the
      mini-batch, through :func:`torch.func.functional_call` (exact too; a draw costs
      ``P`` normal numbers whatever the batch size).

    ``twin.parameters()`` are the module's parameters (the means) followed by the
    log-variances. Call :meth:`sync` after the module gained or grew parameters (an
    Avalanche dynamic module adapting to a new experience): a parameter first seen (a new
    head) starts from the prior ``N(0, 1 / prior_precision)``, its log-variance at
    ``init_logvar`` and its mean as the module initialised it; a parameter that grew (new
    output units) keeps its old prior and variance in its leading slice.

    Args:
        model: the user's module: ``x -> logits``, a :mod:`fromp` multi-head model, or
            ``forward(x, task_labels)`` (Avalanche ``MultiTaskModule``).
        prior_precision: precision of the initial prior ``N(0, 1 / prior_precision)``.
        init_logvar: initial ``log sigma^2`` of every Gaussian parameter.

    Example:
        >>> net = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3))
        >>> twin = MeanFieldTwin(net)
        >>> twin.sample_logits(torch.randn(5, 4), None, 2).shape
        torch.Size([2, 5, 3])
        >>> twin.model is net
        True
    """

    def __init__(
        self, model: nn.Module, *, prior_precision: float = 1.0, init_logvar: float = -6.0
    ):
        super().__init__()
        self.model = model
        self.prior_var = 1.0 / check_prior_precision(prior_precision)  # type: ignore[operator]
        self.init_logvar = float(init_logvar)
        self.logvars = nn.ParameterDict()
        self.prior_mean: dict[str, Tensor] = {}
        self.prior_variance: dict[str, Tensor] = {}
        self.sync()

    @property
    def names(self) -> list[str]:
        """The Gaussian parameters' names in the model."""
        return gaussian_names(self.model)

    @property
    def multi_head(self) -> bool:
        """Whether the model takes a task label (:func:`fromp.models.is_multitask`)."""
        return is_multitask(self.model)

    def sync(self) -> bool:
        """Give every Gaussian parameter a log-variance and a prior of its shape (new ones:
        ``init_logvar`` and ``N(0, 1 / prior_precision)``; grown ones: padded). Returns whether
        anything changed (a log-variance that grew is a new tensor)."""
        changed = False
        params = dict(self.model.named_parameters())
        for n in self.names:
            p, k = params[n], _key(n)
            if k not in self.logvars or self.logvars[k].shape != p.shape:
                old = self.logvars[k].detach() if k in self.logvars else None
                lv = torch.full_like(p, self.init_logvar, requires_grad=False)
                if old is not None:
                    lv = fit_shape(old.to(p.device), p.shape, self.init_logvar)
                self.logvars[k] = nn.Parameter(lv.detach().clone())
                changed = True
            if n not in self.prior_mean:
                self.prior_mean[n] = torch.zeros_like(p).detach()
                self.prior_variance[n] = torch.full_like(p, self.prior_var).detach()
                changed = True
            elif self.prior_mean[n].shape != p.shape:
                self.prior_mean[n] = fit_shape(self.prior_mean[n], p.shape, 0.0)
                self.prior_variance[n] = fit_shape(self.prior_variance[n], p.shape, self.prior_var)
                changed = True
        return changed

    def _head(self, task: int | Tensor | None) -> nn.Module:
        """The model with its head fixed to ``task`` (the model itself with one head)."""
        return with_task(self.model, self._one_task(task) if self.multi_head else None)

    def forward(self, x: Tensor, task_labels: int | Tensor | None = None) -> Tensor:
        """:meth:`mean_logits`."""
        return self.mean_logits(x, task_labels)

    def mean_logits(self, x: Tensor, task: int | Tensor | None) -> Tensor:
        """The model's own logits ``[N, K]`` (its parameters are the means) through head
        ``task`` (ignored with one head)."""
        return self._head(task)(x)

    @staticmethod
    def _one_task(task: int | Tensor | None) -> int | None:
        """``task`` as one int label (a tensor must hold one label)."""
        if isinstance(task, Tensor) and task.ndim > 0:
            if task.numel() and not bool((task == task[0]).all()):
                raise ValueError(
                    "task_labels must hold one task for a MeanFieldTwin (a mini-batch of one "
                    f"task), got labels {task.unique().tolist()}"
                )
            task = task[0]
        return None if task is None else int(task)

    def variance(self, name: str) -> Tensor:
        """``sigma^2`` of parameter ``name``."""
        return self.logvars[_key(name)].exp()

    def variance_parameters(self) -> list[nn.Parameter]:
        """The log-variances, in :attr:`names` order."""
        return [self.logvars[_key(n)] for n in self.names]

    def gaussian_sites(self, heads: Iterable[int] | None = None) -> list[Site]:
        """The sites of the shared Gaussian parameters and of those of the task heads
        ``heads`` (all when None; heads as :func:`fromp.models.head_parameters` finds them:
        a head not listed, e.g. one not trained yet, is left out)."""
        params = dict(self.model.named_parameters())
        names = self.names
        if not names:
            raise ValueError("the model has no Linear or Conv2d parameters to make Gaussian")
        if heads is not None:
            keep, owner = {int(h) for h in heads}, head_parameters(self.model)
            names = [n for n in names if n not in owner or owner[n] in keep]
        return [
            (params[n], self.logvars[_key(n)], self.prior_mean[n], self.prior_variance[n])
            for n in names
        ]

    def sample_params(self, names: Iterable[str] | None = None) -> dict[str, Tensor]:
        """One draw ``w = mu + sigma * eps`` of the Gaussian parameters ``names`` (all of
        them when None; differentiable in ``mu`` and ``log sigma^2``), on the parameters'
        device."""
        params = dict(self.model.named_parameters())
        out = {}
        for n in self.names if names is None else names:
            mu, lv = params[n], self.logvars[_key(n)]
            out[n] = mu + (0.5 * lv).exp() * torch.randn_like(mu)
        return out

    @contextmanager
    def _local_noise(self, layers: list[tuple[nn.Linear, str, str | None]]) -> Iterator[None]:
        """Forward hooks adding ``sqrt(x^2 var_W^T + var_b) * eps`` to each layer's output."""

        names = {m: (w, b) for m, w, b in layers}

        def add_noise(module: nn.Module, args: tuple, out: Tensor) -> Tensor:
            weight, bias = names[module]
            b = None if bias is None else self.variance(bias)
            std = local_std(F.linear, args[0], self.variance(weight), b)
            return out + std * torch.randn_like(out)

        with forward_hooks(names, add_noise):
            yield

    def sample_logits(self, x: Tensor, task: int | Tensor | None, n_samples: int) -> Tensor:
        """Logits ``[S, N, K]`` of ``S = n_samples`` sampled networks through head ``task``:
        one pass of the model per sample, its ``nn.Linear`` layers by local
        reparameterisation, its other Gaussian parameters drawn whole (class docstring)."""
        if n_samples < 1:
            raise ValueError(f"n_samples must be >= 1, got {n_samples}")
        head = self._head(task)
        prefix = "model." if head is not self.model else ""
        names = self.names
        local = _local_linears(self.model, set(names))
        done = {n for _, w, b in local for n in (w, b) if n is not None}
        drawn = [n for n in names if n not in done]
        outs = []
        with self._local_noise(local):
            for _ in range(n_samples):
                if drawn:
                    w = {prefix + n: v for n, v in self.sample_params(drawn).items()}
                    outs.append(functional_call(head, w, (x,), strict=False))
                else:
                    outs.append(head(x))
        return torch.stack(outs)

    @contextmanager
    def mean_mode(self) -> Iterator[MeanFieldTwin]:
        """The model itself (its parameters are the means), in training mode."""
        was_training = self.model.training
        self.model.train()
        try:
            yield self
        finally:
            self.model.train(was_training)

    def mean_parameters(self) -> list[nn.Parameter]:
        """All the model's parameters (the means and the deterministic ones)."""
        return list(self.model.parameters())

    def variational_state(self) -> dict:
        """The log-variances and the priors by parameter name, on the CPU (the means are the
        model's own ``state_dict()``)."""

        def cpu(d: dict[str, Tensor]) -> dict[str, Tensor]:
            return {n: v.detach().cpu().clone() for n, v in d.items()}

        logvars = {n: self.logvars[_key(n)] for n in self.names}
        return {
            "logvars": cpu(logvars),
            "prior_mean": cpu(self.prior_mean),
            "prior_variance": cpu(self.prior_variance),
        }

    @torch.no_grad()
    def load_variational_state(self, state: dict) -> None:
        """Restore :meth:`variational_state` in place on the model's device: the
        log-variances into the tensors the optimizer holds, the priors. Refused, before
        anything changes, when a name is missing or a shape differs (a dynamic module not
        adapted to the experiences yet)."""
        params = dict(self.model.named_parameters())
        for part in ("logvars", "prior_mean", "prior_variance"):
            got = state.get(part)
            if not isinstance(got, dict) or set(got) != set(self.names):
                raise ValueError(
                    f"state[{part!r}] must hold the model's Gaussian parameters {self.names}, "
                    f"got {sorted(got) if isinstance(got, dict) else type(got).__name__}"
                )
            for n, v in got.items():
                if tuple(v.shape) != tuple(params[n].shape):
                    raise ValueError(
                        f"state[{part!r}][{n!r}] has shape {tuple(v.shape)}, the model's "
                        f"parameter {tuple(params[n].shape)} (adapt a dynamic module first)"
                    )
        for n, v in state["logvars"].items():
            self.logvars[_key(n)].copy_(v)
        device = next(self.model.parameters()).device
        self.prior_mean = {n: v.to(device).clone() for n, v in state["prior_mean"].items()}
        self.prior_variance = {n: v.to(device).clone() for n, v in state["prior_variance"].items()}
