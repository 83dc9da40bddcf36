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
