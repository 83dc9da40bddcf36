r"""laplace-torch 0.3's subnetwork masks (``laplace.utils.subnetmask``): each picks the
entries ``S`` of ``w = parameters_to_vector(model.parameters())`` ``[P]`` of a subnetwork
Laplace; :meth:`SubnetMask.select` returns them as a sorted ``torch.long`` tensor
(``subnetwork_indices`` of ``fromp.Laplace(..., subset_of_weights="subnetwork")``).

Score masks keep the ``n_params_subnet`` entries of largest score: ``|w|``
(:class:`LargestMagnitudeSubnetMask`), a uniform random number
(:class:`RandomSubnetMask`), the marginal variance of a diagonal Laplace
(:class:`LargestVarianceDiagLaplaceSubnetMask`) or of diagonal SWAG
(:class:`LargestVarianceSWAGSubnetMask`, :func:`fit_diagonal_swag_var`). Name masks keep
whole tensors: :class:`ParamNameSubnetMask`, :class:`ModuleNameSubnetMask` (leaf modules)
and :class:`LastLayerSubnetMask` (the last ``nn.Linear``, found from one input).
"""

from __future__ import annotations

import copy
from typing import Any

import torch
from torch import Tensor, nn
from torch.nn.utils import parameters_to_vector

from fromp.curvature.last_layer import last_layer_features
from fromp.laplace.options import option

__all__ = [
    "LargestMagnitudeSubnetMask",
    "LargestVarianceDiagLaplaceSubnetMask",
    "LargestVarianceSWAGSubnetMask",
    "LastLayerSubnetMask",
    "ModuleNameSubnetMask",
    "ParamNameSubnetMask",
    "RandomSubnetMask",
    "ScoreBasedSubnetMask",
    "SubnetMask",
    "fit_diagonal_swag_var",
]


def _first_batch(train_loader: Any) -> tuple[Tensor, Tensor | None]:
    batch = train_loader if isinstance(train_loader, tuple) else next(iter(train_loader))
    if isinstance(batch, Tensor):
        return batch, None
    return batch[0], (batch[1] if len(batch) > 1 else None)


class SubnetMask:
    """A subnetwork of ``model``: :meth:`select` (once) gives its indices."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.parameter_vector = parameters_to_vector(model.parameters()).detach()
        self._n_params = self.parameter_vector.numel()
        self._indices: Tensor | None = None
        self._n_params_subnet: int | None = None

    @property
    def indices(self) -> Tensor:
        if self._indices is None:
            raise AttributeError("Subnetwork mask not selected: call select() first")
        return self._indices

    @property
    def n_params_subnet(self) -> int:
        return len(self.indices) if self._n_params_subnet is None else self._n_params_subnet

    def convert_subnet_mask_to_indices(self, subnet_mask: Tensor) -> Tensor:
        """A 0/1 (or bool) mask ``[P]`` as the sorted indices of its ones."""
        if not isinstance(subnet_mask, Tensor) or subnet_mask.ndim != 1:
            raise ValueError("subnet_mask must be a 1-D tensor")
        if subnet_mask.is_floating_point() or subnet_mask.is_complex():
            raise ValueError(f"subnet_mask must be integral or boolean, got {subnet_mask.dtype}")
        if len(subnet_mask) != self._n_params:
            raise ValueError(f"subnet_mask must have P={self._n_params} entries, got "
                             f"{len(subnet_mask)}")  # fmt: skip
        values = set(subnet_mask.unique().tolist())
        if not values <= {0, 1}:
            raise ValueError("subnet_mask must hold only 0 and 1")
        if 1 not in values:
            raise ValueError("subnet_mask selects no parameter")
        return subnet_mask.bool().nonzero(as_tuple=True)[0].long().cpu()

    def select(self, train_loader: Any = None) -> Tensor:
        """The subnetwork's indices ``[S]`` (sorted ``torch.long``); a mask selects once."""
        if self._indices is not None:
            raise ValueError("Subnetwork mask already selected")
        self._indices = self.convert_subnet_mask_to_indices(self.get_subnet_mask(train_loader))
        return self._indices

    def get_subnet_mask(self, train_loader: Any) -> Tensor:
        raise NotImplementedError


class ScoreBasedSubnetMask(SubnetMask):
    """The ``n_params_subnet`` entries of largest :meth:`compute_param_scores`."""

    def __init__(self, model: nn.Module, n_params_subnet: int) -> None:
        super().__init__(model)
        if isinstance(n_params_subnet, bool) or not isinstance(n_params_subnet, int):
            raise TypeError(f"n_params_subnet must be an int, got {n_params_subnet!r}")
        if not 1 <= n_params_subnet <= self._n_params:
            raise ValueError(f"n_params_subnet must be in [1, P={self._n_params}], got "
                             f"{n_params_subnet}")  # fmt: skip
        self._n_params_subnet = n_params_subnet
        self._param_scores: Tensor | None = None

    def compute_param_scores(self, train_loader: Any) -> Tensor:
        raise NotImplementedError

    def get_subnet_mask(self, train_loader: Any) -> Tensor:
        if self._param_scores is None:
            self._param_scores = self.compute_param_scores(train_loader)
        if self._param_scores.shape != self.parameter_vector.shape:
            raise ValueError("parameter scores must have the parameter vector's shape [P]")
        top = torch.argsort(self._param_scores, descending=True)[: self._n_params_subnet]
        mask = torch.zeros(self._n_params, dtype=torch.bool)
        mask[top.cpu()] = True
        return mask


class RandomSubnetMask(ScoreBasedSubnetMask):
    """Entries drawn uniformly at random (torch's global generator)."""

    def compute_param_scores(self, train_loader: Any = None) -> Tensor:
        return torch.rand_like(self.parameter_vector)


class LargestMagnitudeSubnetMask(ScoreBasedSubnetMask):
    """The entries of largest ``|w|``."""

    def compute_param_scores(self, train_loader: Any = None) -> Tensor:
        return self.parameter_vector.abs()


class LargestVarianceDiagLaplaceSubnetMask(ScoreBasedSubnetMask):
    """The entries of largest marginal variance under ``diag_laplace_model`` (an all-weights
    diagonal Laplace, e.g. ``fromp.Laplace(model, lik, "all", "diag")``), fitted on
    ``train_loader`` by :meth:`select`; frozen parameters, which it does not cover, score
    ``-inf``."""

    def __init__(self, model: nn.Module, n_params_subnet: int, diag_laplace_model: Any) -> None:
        super().__init__(model, n_params_subnet)
        self.diag_laplace_model = diag_laplace_model

    def compute_param_scores(self, train_loader: Any) -> Tensor:
        if train_loader is None:
            raise ValueError("select(train_loader) needs the training data for the variances")
        la = self.diag_laplace_model
        la.fit(train_loader)
        var = la.posterior_variance
        scores = torch.full_like(self.parameter_vector, -torch.inf)
        mine = dict(zip(la.parameter_names, torch.split(var, la.sizes)))
        k = 0
        for name, p in self.model.named_parameters():
            if name in mine:
                scores[k : k + p.numel()] = mine[name].to(scores)
            k += p.numel()
        return scores


def fit_diagonal_swag_var(
    model: nn.Module,
    train_loader: Any,
    criterion: nn.Module,
    n_snapshots_total: int = 40,
    snapshot_freq: int = 1,
    lr: float = 0.01,
    momentum: float = 0.9,
    weight_decay: float = 3e-4,
    min_var: float = 1e-30,
) -> Tensor:
    """Diagonal SWAG (Maddox et al. 2019): SGD on a copy of ``model`` (train mode; the model
    is not changed) for ``snapshot_freq * n_snapshots_total`` epochs, a snapshot of the
    weights at every ``snapshot_freq``-th epoch; returns the snapshots' variance per entry
    ``E[w^2] - E[w]^2`` ``[P]``, clamped below at ``min_var``."""
    net = copy.deepcopy(model)
    net.train()
    device = next(net.parameters()).device
    opt = torch.optim.SGD(net.parameters(), lr=lr, momentum=momentum, weight_decay=weight_decay)
    first = second = None
    n = 0
    for epoch in range(snapshot_freq * n_snapshots_total):
        for x, y in train_loader:
            opt.zero_grad()
            criterion(net(x.to(device)), y.to(device)).backward()
            opt.step()
        if epoch % snapshot_freq == 0:
            w = parameters_to_vector(net.parameters()).detach()
            first = w if first is None else first * (n / (n + 1)) + w / (n + 1)
            second = w**2 if second is None else second * (n / (n + 1)) + w**2 / (n + 1)
            n += 1
    return torch.clamp(second - first**2, min_var)


class LargestVarianceSWAGSubnetMask(ScoreBasedSubnetMask):
    """The entries of largest diagonal-SWAG variance (:func:`fit_diagonal_swag_var`, with
    cross-entropy for ``"classification"`` and the mean squared error for
    ``"regression"``)."""

    def __init__(
        self,
        model: nn.Module,
        n_params_subnet: int,
        likelihood: str = "classification",
        swag_n_snapshots: int = 40,
        swag_snapshot_freq: int = 1,
        swag_lr: float = 0.01,
    ) -> None:
        likelihood = option(likelihood)
        if likelihood not in ("classification", "regression"):
            raise ValueError(f"likelihood must be 'classification' or 'regression', got "
                             f"{likelihood!r}")  # fmt: skip
        super().__init__(model, n_params_subnet)
        self.likelihood = likelihood
        self.swag_n_snapshots, self.swag_snapshot_freq = swag_n_snapshots, swag_snapshot_freq
        self.swag_lr = swag_lr

    def compute_param_scores(self, train_loader: Any) -> Tensor:
        if train_loader is None:
            raise ValueError("select(train_loader) needs the training data for SWAG")
        crit = nn.CrossEntropyLoss() if self.likelihood == "classification" else nn.MSELoss()
        return fit_diagonal_swag_var(self.model, train_loader, crit, self.swag_n_snapshots,
                                     self.swag_snapshot_freq, self.swag_lr)  # fmt: skip


class _NamedTensorsMask(SubnetMask):
    """Whole parameter tensors chosen by name: the names are checked and resolved by
    :meth:`_chosen` (the parameters they name), the mask holds every entry of those."""

    #: the argument that names them, for the messages
    _argument = ""

    def __init__(self, model: nn.Module, names: list[str]) -> None:
        super().__init__(model)
        self._names = list(names)

    def _chosen(self) -> list[Tensor]:
        raise NotImplementedError

    def get_subnet_mask(self, train_loader: Any = None) -> Tensor:
        if not self._names:
            raise ValueError(f"{self._argument} must not be empty")
        chosen = {id(p) for p in self._chosen()}
        return torch.cat([torch.full((p.numel(),), id(p) in chosen, dtype=torch.bool)
                          for p in self.model.parameters()])  # fmt: skip


class ParamNameSubnetMask(_NamedTensorsMask):
    """The parameter tensors named in ``parameter_names`` (``model.named_parameters()``)."""

    _argument = "parameter_names"

    def __init__(self, model: nn.Module, parameter_names: list[str]) -> None:
        super().__init__(model, parameter_names)

    def _chosen(self) -> list[Tensor]:
        named = dict(self.model.named_parameters())
        missing = [n for n in self._names if n not in named]
        if missing:
            raise ValueError(f"parameters {missing} do not exist in the model")
        return [named[n] for n in self._names]


class ModuleNameSubnetMask(_NamedTensorsMask):
    """The parameters of the leaf modules named in ``module_names``
    (``model.named_modules()``)."""

    _argument = "module_names"

    def __init__(self, model: nn.Module, module_names: list[str]) -> None:
        super().__init__(model, module_names)

    def _chosen(self) -> list[Tensor]:
        modules = dict(self.model.named_modules())
        for name in self._names:
            if name not in modules:
                raise ValueError(f"module {name!r} does not exist in the model")
            if list(modules[name].children()):
                raise ValueError(f"module {name!r} has children (name a leaf module)")
            if not list(modules[name].parameters()):
                raise ValueError(f"module {name!r} has no parameters")
        return [p for n in self._names for p in modules[n].parameters()]


class LastLayerSubnetMask(ModuleNameSubnetMask):
    """The last ``nn.Linear`` layer (``last_layer_name``, or found from the first input of
    ``train_loader``)."""

    def __init__(self, model: nn.Module, last_layer_name: str | None = None) -> None:
        super().__init__(model, [] if last_layer_name is None else [last_layer_name])
        self.last_layer_name = last_layer_name

    def get_subnet_mask(self, train_loader: Any) -> Tensor:
        if self.last_layer_name is None:
            if train_loader is None:
                raise ValueError("select(train_loader) needs an input to find the last layer")
            x, _ = _first_batch(train_loader)
            dev = next(self.model.parameters()).device
            with torch.no_grad():
                _, layer = last_layer_features(self.model, x[:1].to(dev))
            self.last_layer_name = next(n for n, m in self.model.named_modules() if m is layer)
            self._names = [self.last_layer_name]
        return super().get_subnet_mask(train_loader)
