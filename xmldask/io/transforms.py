"""Row transforms applied to each block of features as it is ingested or generated."""

from __future__ import annotations

import numpy as np
import scipy.sparse as sp

__all__ = ["NORMALIZATIONS", "transform_rows"]

#: ``none``; ``l2`` / ``l1``: scale each row to unit norm; ``sqrt``: the Hellinger map of the
#: spectral-tree paper (scale to unit L1 norm, then take square roots: rows get unit L2 norm).
NORMALIZATIONS = ("none", "l2", "l1", "sqrt")


def transform_rows(X: sp.csr_matrix, *, normalize: str = "none", bias: float | None = None,
                   bias_column: int | None = None) -> sp.csr_matrix:
    """Normalise the rows of a CSR block and optionally set a constant bias feature.

    Parameters
    ----------
    X : scipy.sparse.csr_matrix, shape (n_rows, n_features)
        Sorted indices; modified copies are returned, ``X`` is not changed.
    normalize : {"none", "l2", "l1", "sqrt"}
        Rows with no nonzero stay zero. ``sqrt`` requires non-negative values.
    bias : float, optional
        Value of the bias feature, set in column ``bias_column`` after normalisation.
    bias_column : int, optional
        Column of the bias feature, which must hold no values (default: the last column of ``X``).

    Returns
    -------
    scipy.sparse.csr_matrix
        Same shape and dtype as ``X``.
    """
    if normalize not in NORMALIZATIONS:
        raise ValueError(f"normalize must be one of {NORMALIZATIONS}, but is {normalize!r}")
    X = sp.csr_matrix(X, copy=True)
    if normalize != "none":
        rows = np.repeat(np.arange(X.shape[0]), np.diff(X.indptr))
        if normalize == "sqrt" and X.nnz and X.data.min() < 0:
            raise ValueError("the sqrt (Hellinger) map needs non-negative feature values")
        values = X.data.astype(np.float64)
        # astype: bincount of no values (a block without features) is int64 even with weights
        norms = np.bincount(rows, weights=values**2 if normalize == "l2" else np.abs(values),
                            minlength=X.shape[0]).astype(np.float64, copy=False)
        if normalize == "l2":
            norms = np.sqrt(norms)
        scale = np.divide(1.0, norms, out=np.zeros_like(norms), where=norms > 0)
        values *= scale[rows]
        if normalize == "sqrt":
            values = np.sqrt(values)
        X.data = values.astype(X.dtype)
    if bias is not None:
        column = X.shape[1] - 1 if bias_column is None else int(bias_column)
        if not 0 <= column < X.shape[1]:
            raise ValueError(f"bias_column {column} is outside the {X.shape[1]} columns")
        ones = sp.csr_matrix((np.full(X.shape[0], bias, X.dtype), np.full(X.shape[0], column),
                              np.arange(X.shape[0] + 1)), shape=X.shape)
        if np.any(X.indices == column):
            raise ValueError(f"column {column} already holds values; the bias feature needs an empty column")
        X = (X + ones).tocsr()
        X.sort_indices()
    return X
