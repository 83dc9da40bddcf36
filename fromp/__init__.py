"""fromp: continual learning in function space (FROMP, DNN2GP, VOGN) for PyTorch."""

from fromp import gp
from fromp.bayesian import (
    BayesCifarCNN,
    BayesConv2d,
    BayesLayer,
    BayesLinear,
    BayesMultiHeadMLP,
    BayesMultiHeadModel,
    gaussian_kl,
    to_bayesian,
)
from fromp.coreset import kcenter_coreset, random_coreset, select_coreset
from fromp.curvature import diag_ef, diag_fisher, diag_ggn, diag_ggn_linear
from fromp.ggn import ggn, ggn_vp
from fromp.gp import GP, dnn2gp, log_marginal_likelihood, optimize_prior_precision
from fromp.jacobian import (
    flat_params,
    jacobians,
    jvp,
    num_params,
    per_example_grads,
    trainable_params,
    unflatten,
    vjp_sum,
)
from fromp.laplace import (
    DiagLaplace,
    FullLaplace,
    accumulate_ggn,
    laplace,
    laplace_full,
    log_evidence_grid,
    prior_precision_vector,
)
from fromp.likelihood import (
    BernoulliLikelihood,
    CategoricalLikelihood,
    GaussianLikelihood,
    Likelihood,
    get_likelihood,
)
from fromp.memorable import memorability_scores, select_memorable
from fromp.methods import EWCMethod, FROMPMethod
from fromp.optim import IVON, OGN, VOGN
from fromp.posterior import DiagonalGaussian, FullGaussian, GaussianPosterior
from fromp.regularizer import FROMPRegularizer, MemorableSet, prob_jacobian, task_fn
from fromp.sensitivity import (
    LOOTracker,
    MemoryPerturbation,
    last_layer_loo,
    memory_perturbation,
    newton_step_loo,
    prediction_variance,
)

__version__ = "0.1.0"

__all__ = [  # noqa: RUF022 (grouped by topic, sorted within each group)
    "__version__",
    # continual-learning methods as plain objects for any training loop
    "EWCMethod",
    "FROMPMethod",
    # Jacobians and parameter vectors
    "flat_params",
    "jacobians",
    "jvp",
    "num_params",
    "per_example_grads",
    "trainable_params",
    "unflatten",
    "vjp_sum",
    # likelihoods
    "BernoulliLikelihood",
    "CategoricalLikelihood",
    "GaussianLikelihood",
    "Likelihood",
    "get_likelihood",
    # curvature: diagonal GGN / Fisher, full GGN, GGN-vector products
    "diag_ef",
    "diag_fisher",
    "diag_ggn",
    "diag_ggn_linear",
    "ggn",
    "ggn_vp",
    # posteriors and the Laplace approximation
    "DiagLaplace",
    "DiagonalGaussian",
    "FullGaussian",
    "GaussianPosterior",
    "FullLaplace",
    "accumulate_ggn",
    "laplace",
    "laplace_full",
    "prior_precision_vector",
    # DNN2GP Gaussian process and the Laplace evidence
    "GP",
    "dnn2gp",
    "gp",
    "log_evidence_grid",
    "log_marginal_likelihood",
    "optimize_prior_precision",
    # optimizers
    "IVON",
    "OGN",
    "VOGN",
    # memory perturbation: sensitivity and leave-one-out estimates
    "LOOTracker",
    "MemoryPerturbation",
    "last_layer_loo",
    "memory_perturbation",
    "newton_step_loo",
    "prediction_variance",
    # FROMP: memorable past and functional regulariser
    "FROMPRegularizer",
    "MemorableSet",
    "memorability_scores",
    "prob_jacobian",
    "select_memorable",
    "task_fn",
    # baselines: mean-field Gaussian layers (VCL) and coresets
    "BayesCifarCNN",
    "BayesConv2d",
    "BayesLayer",
    "BayesLinear",
    "BayesMultiHeadMLP",
    "BayesMultiHeadModel",
    "gaussian_kl",
    "kcenter_coreset",
    "random_coreset",
    "select_coreset",
    "to_bayesian",
]


def __getattr__(name: str) -> object:
    if name == "FunctionalRegularizer":  # the former name of FROMPRegularizer
        from fromp.regularizer import _former_name

        return _former_name(stacklevel=2)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
