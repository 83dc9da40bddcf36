"""The dense float64 references and test networks now live in :mod:`fromp.testing`; this
module re-exports them for tests that still import ``_dense``."""

from fromp.testing import (  # noqa: F401
    ConvZoo,
    Scale,
    TinyCNN,
    conv_zoo,
    dense_ggn,
    dense_jacobian,
    dense_kernel,
    dense_nll_hessians,
    flat,
    forward_at,
    split,
    tiny_cnn,
    tiny_mlp,
)
