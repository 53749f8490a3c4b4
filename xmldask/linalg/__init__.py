"""Blocked linear algebra on Dask arrays of row blocks.

Two layers: :mod:`xmldask.linalg._kernels` (NumPy/SciPy functions on one row block) and
:mod:`xmldask.linalg.passes` (one pass over the row blocks: a task per block plus a tree sum), and on them
:mod:`xmldask.linalg.solvers` (regularised least squares by Cholesky or conjugate gradients).
"""

from .passes import (
    SCATTER_BYTES,
    column_mean,
    column_moments,
    column_sums,
    dense_operand,
    gram,
    x_q,
    xt_b,
    xt_x_q,
    yt_x_z,
)
from .solvers import MAX_GRAM_FEATURES, LstsqResult, ridge_lstsq

__all__ = [
    "MAX_GRAM_FEATURES",
    "SCATTER_BYTES",
    "LstsqResult",
    "column_mean",
    "column_moments",
    "column_sums",
    "dense_operand",
    "gram",
    "ridge_lstsq",
    "x_q",
    "xt_b",
    "xt_x_q",
    "yt_x_z",
]
