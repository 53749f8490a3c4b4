"""Blocked linear algebra on Dask arrays of row blocks.

Two layers: :mod:`xmldask.linalg._kernels` (NumPy/SciPy functions on one row block) and
:mod:`xmldask.linalg.passes` (one pass over the row blocks: a task per block plus a tree sum; every
package's passes are built with its :func:`per_block` and :func:`tree_sum`), and on them
:mod:`xmldask.linalg.solvers` (regularised least squares by Cholesky or conjugate gradients).
"""

from ._kernels import working_dtype
from .passes import (
    ROWS,
    SCATTER_BYTES,
    WHOLE,
    check_rows_operand,
    check_x,
    column_mean,
    column_moments,
    column_sums,
    dense_operand,
    gram,
    per_block,
    tree_sum,
    x_q,
    xt_b,
    xt_x_q,
    yt_x_z,
)
from .solvers import MAX_GRAM_FEATURES, LstsqResult, ridge_lstsq

__all__ = [
    "MAX_GRAM_FEATURES",
    "ROWS",
    "SCATTER_BYTES",
    "WHOLE",
    "LstsqResult",
    "check_rows_operand",
    "check_x",
    "column_mean",
    "column_moments",
    "column_sums",
    "dense_operand",
    "gram",
    "per_block",
    "ridge_lstsq",
    "tree_sum",
    "x_q",
    "xt_b",
    "xt_x_q",
    "working_dtype",
    "yt_x_z",
]
