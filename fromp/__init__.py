"""fromp: continual learning in function space (FROMP, DNN2GP, VOGN) for PyTorch."""

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
from fromp.likelihood import (
    BernoulliLikelihood,
    CategoricalLikelihood,
    GaussianLikelihood,
    Likelihood,
    get_likelihood,
)
from fromp.posterior import DiagonalGaussian

__version__ = "0.1.0"

__all__ = [
    # likelihoods
    "BernoulliLikelihood",
    "CategoricalLikelihood",
    # posteriors
    "DiagonalGaussian",
    "GaussianLikelihood",
    "Likelihood",
    "__version__",
    # jacobians
    "flat_params",
    "get_likelihood",
    "jacobians",
    "jvp",
    "num_params",
    "per_example_grads",
    "trainable_params",
    "unflatten",
    "vjp_sum",
]

# --- core: GGN, Laplace, DNN2GP GP, evidence (fromp.gp is the module) ---
from fromp import gp
from fromp.ggn import ggn, ggn_vp
from fromp.gp import GP, dnn2gp, log_marginal_likelihood, optimize_prior_precision
from fromp.laplace import (
    DiagLaplace,
    FullGaussian,
    FullLaplace,
    accumulate_ggn,
    laplace,
    laplace_full,
    prior_precision_vector,
)

__all__ += [  # core: GGN, Laplace, DNN2GP GP, evidence
    "GP",
    "DiagLaplace",
    "FullGaussian",
    "FullLaplace",
    "accumulate_ggn",
    "dnn2gp",
    "ggn",
    "ggn_vp",
    "gp",
    "laplace",
    "laplace_full",
    "log_marginal_likelihood",
    "optimize_prior_precision",
    "prior_precision_vector",
]
# --- end core ---

# --- baselines: mean-field Gaussian layers (VCL) and coresets ---
from fromp.bayesian import (  # noqa: E402
    BayesCifarCNN,
    BayesConv2d,
    BayesLayer,
    BayesLinear,
    BayesMultiHeadMLP,
    BayesMultiHeadModel,
    gaussian_kl,
    to_bayesian,
)
from fromp.coreset import kcenter_coreset, random_coreset, select_coreset  # noqa: E402

__all__ += [  # baselines: mean-field Gaussian layers (VCL) and coresets
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

# --- optimizers: VOGN / OGN ---
from fromp.optim import IVON, OGN, VOGN  # noqa: E402

__all__ += ["IVON", "OGN", "VOGN"]  # optimizers: VOGN / OGN / IVON

# --- memory perturbation: sensitivity and leave-one-out estimates ---
from fromp.sensitivity import (  # noqa: E402
    MemoryPerturbation,
    memory_perturbation,
    prediction_variance,
)

__all__ += ["MemoryPerturbation", "memory_perturbation", "prediction_variance"]

# --- FROMP: memorable past and functional regulariser ---
from fromp.curvature import diag_ef, diag_fisher, diag_ggn, diag_ggn_linear  # noqa: E402
from fromp.memorable import memorability_scores, select_memorable  # noqa: E402
from fromp.regularizer import (  # noqa: E402
    FROMPRegularizer,
    FunctionalRegularizer,
    MemorableSet,
    prob_jacobian,
    task_fn,
)

__all__ += [  # FROMP: memorable past and functional regulariser
    "FROMPRegularizer",
    "FunctionalRegularizer",
    "MemorableSet",
    "diag_ef",
    "diag_fisher",
    "diag_ggn",
    "diag_ggn_linear",
    "memorability_scores",
    "prob_jacobian",
    "select_memorable",
    "task_fn",
]
# --- end FROMP ---
