"""Blocked linear algebra on Dask arrays of row blocks.

Two layers: :mod:`xmldask.linalg._kernels` (NumPy/SciPy functions on one row block) and
:mod:`xmldask.linalg.passes` (one pass over the row blocks: a task per block plus a tree sum).
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

__all__ = [
    "SCATTER_BYTES",
    "column_mean",
    "column_moments",
    "column_sums",
    "dense_operand",
    "gram",
    "x_q",
    "xt_b",
    "xt_x_q",
    "yt_x_z",
]
