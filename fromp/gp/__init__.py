"""A network with a Gaussian posterior as a Gaussian process (DNN2GP): the GP (``process``) and
its structured kernel (``kernel``)."""

from fromp.gp.process import (  # the names of the former module fromp.gp
    GP,
    GPPredictive,
    Posterior,
    dnn2gp,
)

__all__ = [
    "GP",
    "GPPredictive",
    "Posterior",
    "dnn2gp",
]
