"""fromp: continual learning in function space for PyTorch.

FROMP (functional regularisation of memorable past), DNN2GP (a trained network as a Gaussian
process), Laplace posteriors in laplace-torch's words, the VOGN and IVON optimizers and the
memory-perturbation equation. The package is plain PyTorch (it never imports Avalanche);
the Avalanche strategies are in ``fromp_avalanche`` (the folder ``strategies/``), the benchmark
runner in ``fromp_bench`` (the folder ``benchmarks/``).

The public surface below is grouped by task; everything else lives in its module
(``fromp.continual.bayesian`` for VCL's mean-field layers, ``fromp.continual.coreset``,
``fromp.curvature.kron`` for Kronecker factors, ``fromp.curvature.capture`` for layer capture, ...).
See ``docs/glossary.md`` for the names and ``CHANGELOG.md`` for what moved in each release.
"""

from fromp.continual.ewc import EWCMethod
from fromp.continual.memorable import memorability_scores, select_memorable
from fromp.continual.methods import FROMPMethod
from fromp.continual.protocol import ContinualMethod as ContinualMethod
from fromp.continual.regularizer import FROMPRegularizer
from fromp.continual.vcl import VCLMethod
from fromp.curvature.diagonal import diag_ef, diag_fisher, diag_ggn
from fromp.curvature.ggn import ggn, ggn_vp
from fromp.curvature.jacobian import (
    flat_params,
    jacobians,
    num_params,
    per_example_grads,
    unflatten,
)
from fromp.gp.process import GP, dnn2gp

# laplace-torch's other classes, importable from the top as from ``laplace`` (listed in
# fromp.laplace.__all__, not here: the top-level surface stays small)
from fromp.laplace import BaseLaplace as BaseLaplace
from fromp.laplace import (
    DiagLaplace,
    FullLaplace,
    FunctionalLaplace,
    Laplace,
    fit_laplace,
    log_evidence_grid,
    log_marginal_likelihood,
    marglik_training,
    optimize_prior_precision,
)
from fromp.laplace import DiagLLLaplace as DiagLLLaplace
from fromp.laplace import DiagSubnetLaplace as DiagSubnetLaplace
from fromp.laplace import FullLLLaplace as FullLLLaplace
from fromp.laplace import FullSubnetLaplace as FullSubnetLaplace
from fromp.laplace import KronLaplace as KronLaplace
from fromp.laplace import KronLLLaplace as KronLLLaplace
from fromp.laplace import LLLaplace as LLLaplace
from fromp.laplace import LowRankLaplace as LowRankLaplace
from fromp.laplace import ParametricLaplace as ParametricLaplace
from fromp.laplace import SubnetLaplace as SubnetLaplace

# laplace-torch's option enums, importable from the top as in laplace-torch (listed in
# fromp.utils.__all__, not here: the top-level surface stays small)
from fromp.laplace.options import FunctionalApproximation as FunctionalApproximation
from fromp.laplace.options import HessianStructure as HessianStructure
from fromp.laplace.options import LinkApprox as LinkApprox
from fromp.laplace.options import PredType as PredType
from fromp.laplace.options import PriorStructure as PriorStructure
from fromp.laplace.options import SubsetOfWeights as SubsetOfWeights
from fromp.laplace.options import TuningMethod as TuningMethod
from fromp.likelihood import (
    BernoulliLikelihood,
    CategoricalLikelihood,
    GaussianLikelihood,
    Likelihood,
    get_likelihood,
)
from fromp.memory.loo import LOOTracker, last_layer_loo
from fromp.memory.sensitivity import (
    MemoryPerturbation,
    memory_perturbation,
    newton_step_loo,
    prediction_variance,
)
from fromp.optim import IVON, OGN, VOGN
from fromp.posterior import DiagonalGaussian, FullGaussian, GaussianPosterior

__version__ = "0.4.0"

__all__ = [  # noqa: RUF022 (grouped by task, sorted within each group)
    "__version__",
    # fitted posteriors, laplace-torch's API and fromp's one-call functions
    "Laplace",
    "DiagLaplace",
    "FullLaplace",
    "fit_laplace",
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
    "VCLMethod",
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
