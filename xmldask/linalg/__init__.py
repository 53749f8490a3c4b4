"""Blocked linear algebra on Dask arrays of row blocks.

Two layers: :mod:`xmldask.linalg._kernels` (NumPy/SciPy functions on one row block) and
:mod:`xmldask.linalg.passes` (one pass over the row blocks: a running sum per task run at once, each
step computing one block's result, then a tree of those sums; every package's passes are built with its
:func:`block_sum` and :func:`per_block`), and on them
:mod:`xmldask.linalg.solvers` (regularised least squares by Cholesky, in the dual through the rows' Gram
matrix, or by conjugate gradients).
"""

from . import passes
from ._kernels import canonical, t_product, working_dtype
from .passes import *  # noqa: F403  (the passes' public names, listed once in passes.__all__)
from .solvers import MAX_DUAL_ROWS, MAX_GRAM_FEATURES, LstsqResult, dual_applies, ridge_lstsq

__all__ = [*passes.__all__, "MAX_DUAL_ROWS", "MAX_GRAM_FEATURES", "LstsqResult", "canonical", "dual_applies",
           "ridge_lstsq", "t_product", "working_dtype"]
