"""fromp: continual learning in function space for PyTorch.

FROMP (functional regularisation of memorable past), DNN2GP (a trained network as a Gaussian
process), Laplace posteriors in laplace-torch's words, the VOGN and IVON optimizers and the
memory-perturbation equation. The package is plain PyTorch (it never imports Avalanche);
the Avalanche strategies are in ``strategies``, the benchmark runner in ``benchmarks``.

The public surface below is grouped by task; everything else lives in its module
(``fromp.bayesian`` for VCL's mean-field layers, ``fromp.coreset``, ``fromp.kron`` for
Kronecker factors, ``fromp.capture`` for layer capture, ...). See ``docs/glossary.md`` for
the names and ``CHANGELOG.md`` for what moved.
"""

from fromp.curvature import diag_ef, diag_fisher, diag_ggn
from fromp.ewc import EWCMethod
from fromp.ggn import ggn, ggn_vp
from fromp.gp import GP, dnn2gp
from fromp.jacobian import flat_params, jacobians, num_params, per_example_grads, unflatten
from fromp.laplace import (
    DiagLaplace,
    FullLaplace,
    laplace,
    laplace_full,
    log_evidence_grid,
    log_marginal_likelihood,
    optimize_prior_precision,
)
from fromp.laplace_factory import Laplace
from fromp.laplace_functional import FunctionalLaplace

# laplace-torch's option enums, importable from the top as in laplace-torch (listed in
# fromp.utils.__all__, not here: the top-level surface stays small)
from fromp.laplace_options import HessianStructure as HessianStructure
from fromp.laplace_options import LinkApprox as LinkApprox
from fromp.laplace_options import PredType as PredType
from fromp.laplace_options import PriorStructure as PriorStructure
from fromp.laplace_options import SubsetOfWeights as SubsetOfWeights
from fromp.laplace_options import TuningMethod as TuningMethod
from fromp.likelihood import (
    BernoulliLikelihood,
    CategoricalLikelihood,
    GaussianLikelihood,
    Likelihood,
    get_likelihood,
)
from fromp.loo import LOOTracker, last_layer_loo
from fromp.marglik_training import marglik_training
from fromp.memorable import memorability_scores, select_memorable
from fromp.methods import FROMPMethod
from fromp.optim import IVON, OGN, VOGN
from fromp.posterior import DiagonalGaussian, FullGaussian, GaussianPosterior
from fromp.regularizer import FROMPRegularizer
from fromp.sensitivity import (
    MemoryPerturbation,
    memory_perturbation,
    newton_step_loo,
    prediction_variance,
)

__version__ = "0.3.0"

__all__ = [  # noqa: RUF022 (grouped by task, sorted within each group)
    "__version__",
    # fitted posteriors, laplace-torch's API and fromp's one-call functions
    "Laplace",
    "DiagLaplace",
    "FullLaplace",
    "laplace",
    "laplace_full",
    "log_evidence_grid",
    "log_marginal_likelihood",
    "optimize_prior_precision",
    "FunctionalLaplace",
    "marglik_training",
    "DiagonalGaussian",
    "FullGaussian",
    "GaussianPosterior",
    # networks as Gaussian processes
    "GP",
    "dnn2gp",
    # continual-learning methods as plain objects for any training loop
    "FROMPMethod",
    "EWCMethod",
    "FROMPRegularizer",
    "memorability_scores",
    "select_memorable",
    # optimizers with a posterior
    "IVON",
    "OGN",
    "VOGN",
    # how much each example matters
    "MemoryPerturbation",
    "memory_perturbation",
    "newton_step_loo",
    "prediction_variance",
    "LOOTracker",
    "last_layer_loo",
    # curvature and Jacobians
    "diag_ef",
    "diag_fisher",
    "diag_ggn",
    "ggn",
    "ggn_vp",
    "flat_params",
    "jacobians",
    "num_params",
    "per_example_grads",
    "unflatten",
    # likelihoods
    "BernoulliLikelihood",
    "CategoricalLikelihood",
    "GaussianLikelihood",
    "Likelihood",
    "get_likelihood",
]

#: Names that left the top level in 0.3.0, and the module that has them.
_MOVED = {
    "accumulate_ggn": "fromp.laplace",
    "prior_precision_vector": "fromp.laplace",
    "prob_jacobian": "fromp.regularizer",
    "task_fn": "fromp.regularizer",
    "MemorableSet": "fromp.regularizer",
    "BayesCifarCNN": "fromp.bayesian",
    "BayesConv2d": "fromp.bayesian",
    "BayesLayer": "fromp.bayesian",
    "BayesLinear": "fromp.bayesian",
    "BayesMultiHeadMLP": "fromp.bayesian",
    "BayesMultiHeadModel": "fromp.bayesian",
    "gaussian_kl": "fromp.bayesian",
    "to_bayesian": "fromp.bayesian",
    "kcenter_coreset": "fromp.coreset",
    "random_coreset": "fromp.coreset",
    "select_coreset": "fromp.coreset",
    "trainable_params": "fromp.jacobian",
    "jvp": "fromp.jacobian",
    "vjp_sum": "fromp.jacobian",
    "diag_ggn_linear": "fromp.curvature",
}


def __getattr__(name: str) -> object:
    """Moved names still resolve, with a ``DeprecationWarning`` naming their module."""
    import importlib
    import warnings

    if name == "FunctionalRegularizer":  # the former name of FROMPRegularizer
        from fromp.regularizer import _former_name

        return _former_name(stacklevel=2)
    if name in _MOVED:
        warnings.warn(
            f"fromp.{name} moved to {_MOVED[name]}.{name}", DeprecationWarning, stacklevel=2
        )
        return getattr(importlib.import_module(_MOVED[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
