"""A network with a Gaussian posterior as a Gaussian process (DNN2GP): the GP (``process``) and
its structured kernel (``kernel``)."""

from fromp.gp.process import (  # the names of the former module fromp.gp
    GP,
    Posterior,
    dnn2gp,
)

__all__ = [
    "GP",
    "Posterior",
    "dnn2gp",
]


def __getattr__(name: str) -> object:
    """``fromp.gp.LaplaceGP`` (the GP of a fitted Laplace) moved to
    :mod:`fromp.laplace.laplace_gp` in 0.4, beside the Laplace classes; the old name resolves
    by module name at run time, with a ``DeprecationWarning``, until 0.5 (this package itself
    never imports the Laplace layer above it)."""
    if name == "LaplaceGP":
        import importlib
        import warnings

        warnings.warn(
            "fromp.gp.LaplaceGP moved to fromp.laplace.LaplaceGP", DeprecationWarning, stacklevel=2
        )
        return importlib.import_module("fromp.laplace.laplace_gp").LaplaceGP
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
