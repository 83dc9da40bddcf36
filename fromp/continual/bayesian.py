"""Mean-field Gaussian (Bayesian) layers and networks for variational continual learning.

Every weight ``w`` has a factorised Gaussian posterior ``q(w) = N(mu, exp(logvar))`` and a
Gaussian prior ``p(w) = N(mu_0, v_0)`` stored as buffers (so it travels with
``state_dict``). VCL (Nguyen et al., 2018) sets the prior of task ``t`` to the posterior of
task ``t - 1`` (:meth:`BayesLayer.set_prior_from_posterior`).

Forward passes use the local reparameterisation trick (Kingma et al., 2015): for a linear
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
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from fromp.models import CifarCNN, MultiHeadMLP, MultiHeadModel

__all__ = [
    "BayesCifarCNN",
    "BayesConv2d",
    "BayesLayer",
    "BayesLinear",
    "BayesMultiHeadMLP",
    "BayesMultiHeadModel",
    "gaussian_kl",
    "gaussian_kl_flat",
    "to_bayesian",
]


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


class BayesLayer(nn.Module):
    """Common machinery of mean-field Gaussian layers.

    Parameters ``weight_mu``, ``weight_logvar`` (and ``bias_mu``, ``bias_logvar``);
    buffers ``weight_prior_mu``, ``weight_prior_var`` (and the bias ones). Subclasses
    implement :meth:`_op`, the layer's linear map ``(x, W, b) -> x * W + b``; the Gaussian of
    the pre-activations, ``N(op(x, mu_W, mu_b), op(x^2, var_W, var_b))`` (:meth:`_mean_var`),
    and the map at the means (:meth:`_deterministic`) follow from it.
    """

    weight_mu: nn.Parameter
    weight_logvar: nn.Parameter
    bias_mu: nn.Parameter | None
    bias_logvar: nn.Parameter | None

    def _init_bayes(
        self,
        weight_shape: tuple[int, ...],
        bias: bool,
        prior_mean: float,
        prior_var: float,
        init_logvar: float,
    ) -> None:
        if prior_var <= 0:
            raise ValueError(f"prior_var must be > 0, got {prior_var}")
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

    @torch.no_grad()
    def reset_mean(self, std: float) -> None:
        """Re-draw the means (weights and bias) from a normal ``N(0, std^2)`` truncated to
        ``[-2 std, 2 std]`` (the VCL reference initialisation, ``std = 0.1``)."""
        if std <= 0:
            raise ValueError(f"std must be > 0, got {std}")
        nn.init.trunc_normal_(self.weight_mu, 0.0, std, -2 * std, 2 * std)
        if self.bias_mu is not None:
            nn.init.trunc_normal_(self.bias_mu, 0.0, std, -2 * std, 2 * std)

    def _pairs(self) -> Iterator[tuple[Tensor, Tensor, Tensor, Tensor]]:
        """``(mu, logvar, prior_mu, prior_var)`` for the weight and the bias."""
        yield self.weight_mu, self.weight_logvar, self.weight_prior_mu, self.weight_prior_var
        if self.bias_mu is not None:
            yield self.bias_mu, self.bias_logvar, self.bias_prior_mu, self.bias_prior_var

    def kl(self) -> Tensor:
        """``KL(q || prior)`` of this layer's weights and bias (scalar, differentiable)."""
        return gaussian_kl_flat(self._pairs())

    @torch.no_grad()
    def set_prior_from_posterior(self) -> None:
        """Make the current posterior ``q`` the prior (VCL's recursion)."""
        for m, lv, m0, v0 in self._pairs():
            m0.copy_(m)
            v0.copy_(lv.exp())

    @torch.no_grad()
    def reset_prior(self, prior_mean: float = 0.0, prior_var: float = 1.0) -> None:
        """Set the prior back to ``N(prior_mean, prior_var)``."""
        for _, _, m0, v0 in self._pairs():
            m0.fill_(prior_mean)
            v0.fill_(prior_var)

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

    def _mean_var(self, x: Tensor) -> tuple[Tensor, Tensor]:
        mean = self._op(x, self.weight_mu, self.bias_mu)
        bvar = None if self.bias_logvar is None else self.bias_logvar.exp()
        return mean, self._op(x * x, self.weight_logvar.exp(), bvar)

    def _deterministic(self, x: Tensor) -> Tensor:
        return self._op(x, self.weight_mu, self.bias_mu)

    def forward(self, x: Tensor, n_samples: int | None = None) -> Tensor:
        """One sampled pre-activation per example ``[N, ...]`` (``[S, N, ...]`` with
        ``n_samples=S``) by local reparameterisation; the mean map when ``use_mean``."""
        if self.use_mean:
            out = self._deterministic(x)
            return out if n_samples is None else out.expand(n_samples, *out.shape)
        mean, var = self._mean_var(x)
        shape = mean.shape if n_samples is None else (n_samples, *mean.shape)
        eps = torch.randn(shape, dtype=mean.dtype, device=mean.device)
        return mean + var.clamp_min(0).sqrt() * eps


class BayesLinear(BayesLayer):
    """Mean-field Gaussian ``nn.Linear``: ``[N, in] -> [N, out]``.

    Pre-activations ``a ~ N(x mu_W^T + mu_b, x^2 var_W^T + var_b)`` (local
    reparameterisation). Prior ``N(prior_mean, prior_var)`` on every weight, posterior
    log-variances initialised to ``init_logvar`` (VCL: -6).
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        *,
        prior_mean: float = 0.0,
        prior_var: float = 1.0,
        init_logvar: float = -6.0,
    ) -> None:
        super().__init__()
        if in_features < 1 or out_features < 1:
            raise ValueError(
                f"in_features and out_features must be >= 1, got {in_features}, {out_features}"
            )
        self.in_features, self.out_features = in_features, out_features
        self._init_bayes((out_features, in_features), bias, prior_mean, prior_var, init_logvar)

    def _op(self, x: Tensor, w: Tensor, b: Tensor | None) -> Tensor:
        return F.linear(x, w, b)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}"


class BayesConv2d(BayesLayer):
    """Mean-field Gaussian ``nn.Conv2d`` ``[N, C_in, H, W] -> [N, C_out, H', W']``.

    Pre-activations ``a ~ N(conv(x, mu_W) + mu_b, conv(x^2, var_W) + var_b)`` (local
    reparameterisation: independent across examples, output positions and channels).
    """

    def __init__(
        self,
        in_channels: int,
        out_channels: int,
        kernel_size: int | tuple[int, int],
        stride: int | tuple[int, int] = 1,
        padding: int | tuple[int, int] = 0,
        bias: bool = True,
        *,
        prior_mean: float = 0.0,
        prior_var: float = 1.0,
        init_logvar: float = -6.0,
    ) -> None:
        super().__init__()
        k = (kernel_size, kernel_size) if isinstance(kernel_size, int) else tuple(kernel_size)
        self.in_channels, self.out_channels, self.kernel_size = in_channels, out_channels, k
        self.stride, self.padding = stride, padding
        shape = (out_channels, in_channels, *k)
        self._init_bayes(shape, bias, prior_mean, prior_var, init_logvar)

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


class BayesMultiHeadModel(MultiHeadModel):
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
    def body_layers(self) -> list[BayesLayer]:
        """The Bayesian layers of the shared body."""
        return _bayes_layers(self.body)

    def _selected(self, heads: Iterable[int] | None) -> list[BayesLayer]:
        idx = range(self.n_heads) if heads is None else sorted(set(int(h) for h in heads))
        for h in idx:
            if not 0 <= h < self.n_heads:
                raise ValueError(f"heads must be in [0, {self.n_heads}), got {h}")
        return self.body_layers() + [layer for h in idx for layer in _bayes_layers(self.heads[h])]

    def kl(self, heads: Iterable[int] | None = None) -> Tensor:
        """``KL(q || prior)`` of the body plus the given heads (all heads when None), in one
        pass over their parameters (:func:`gaussian_kl_flat`)."""
        return gaussian_kl_flat(q for layer in self._selected(heads) for q in layer._pairs())

    def set_prior_from_posterior(self, heads: Iterable[int] | None = None) -> None:
        """Posterior becomes prior for the body and the given heads (all when None)."""
        for layer in self._selected(heads):
            layer.set_prior_from_posterior()

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


def to_bayesian(
    net: MultiHeadModel,
    *,
    prior_mean: float = 0.0,
    prior_var: float = 1.0,
    init_logvar: float = -6.0,
) -> BayesMultiHeadModel:
    """Convert a :class:`~fromp.models.MultiHeadModel` (e.g. ``MultiHeadMLP``,
    ``CifarCNN``) to a :class:`BayesMultiHeadModel`: each ``nn.Linear``/``nn.Conv2d`` becomes
    a Bayesian layer whose means are the original weights, log-variances ``init_logvar``
    and prior ``N(prior_mean, prior_var)``. ``net`` is not modified."""
    if isinstance(net, BayesMultiHeadModel):
        raise ValueError("net is already Bayesian")
    if not isinstance(net, MultiHeadModel):
        raise ValueError(f"net must be a fromp MultiHeadModel, got {type(net).__name__}")
    kw = dict(prior_mean=prior_mean, prior_var=prior_var, init_logvar=init_logvar)
    body = _convert(net.body, **kw)
    return BayesMultiHeadModel(body, _convert(net.heads, **kw))


class BayesMultiHeadMLP(BayesMultiHeadModel):
    """Bayesian :class:`~fromp.models.MultiHeadMLP` (same architecture and parameter
    order; ``kw``: ``prior_mean``, ``prior_var``, ``init_logvar`` as :func:`to_bayesian`).
    Split MNIST (VCL): ``BayesMultiHeadMLP(784, (256, 256), n_heads=5, head_size=2)``."""

    def __init__(
        self,
        in_features: int = 784,
        hidden: Sequence[int] = (256, 256),
        n_heads: int = 5,
        head_size: int = 2,
        **kw,
    ) -> None:
        net = MultiHeadMLP(in_features, hidden, n_heads, head_size)
        super().__init__(_convert(net.body, **kw), _convert(net.heads, **kw))


class BayesCifarCNN(BayesMultiHeadModel):
    """Bayesian :class:`~fromp.models.CifarCNN` (no dropout: weight noise replaces it)."""

    def __init__(self, in_channels: int = 3, n_heads: int = 6, head_size: int = 10, **kw) -> None:
        net = CifarCNN(in_channels, n_heads, head_size, dropout=False)
        super().__init__(_convert(net.body, **kw), _convert(net.heads, **kw))
