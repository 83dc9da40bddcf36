"""A network with a Gaussian posterior as a Gaussian process (DNN2GP): the GP (``process``) and
its structured kernel (``kernel``)."""

from fromp.gp.process import (
    GP,
    GPPredictive,
    dnn2gp,
)

__all__ = [
    "GP",
    "GPPredictive",
    "dnn2gp",
]
