"""What every estimator of xmldask shares: scikit-learn style parameters, ``predict``, ``NotFittedError``.

The lowest layer of the estimators: :mod:`xmldask.embedding`, :mod:`xmldask.tree` and :mod:`xmldask.models`
build on it.
"""

from __future__ import annotations

import math
import numbers

import dask.array as da
import numpy as np
import scipy.sparse as sp


class NotFittedError(ValueError, AttributeError):
    """The estimator is used before ``fit``."""


def _as_rows(A, name: str, block_rows: int | None = None) -> da.Array:
    """A Dask array of row blocks (an in-memory matrix is split into blocks of ``block_rows``)."""
    if isinstance(A, da.Array):
        if A.ndim != 2:
            raise ValueError(f"{name} must be 2-D, but has shape {A.shape}")
        if any(math.isnan(c) for c in A.chunks[0]):
            raise ValueError(f"{name} has unknown row-chunk sizes; fix: {name} = {name}.compute_chunk_sizes()")
        if len(A.chunks[1]) != 1:
            raise ValueError(f"{name} must be chunked by rows only (one column chunk), but has {len(A.chunks[1])} "
                             f"column chunks; fix: {name} = {name}.rechunk({{1: -1}})")
        return A
    if sp.issparse(A):
        A = sp.csr_matrix(A)
    elif np.ndim(A) == 2:
        A = np.asarray(A)
    else:
        raise TypeError(f"{name} must be a 2-D Dask array of row blocks (open_dataset(url).{name}) or an in-memory "
                        f"matrix, but is a {type(A).__name__}")
    rows = block_rows or max(1, min(A.shape[0], 8192))
    return da.from_array(A, chunks=(rows, -1), asarray=False, fancy=False)


class ParamsMixin:
    """``get_params`` / ``set_params`` over the constructor parameters named in ``_param_names``, and
    ``predict`` from ``predict_topk`` for a classifier with ``n_labels_``."""

    _param_names: tuple[str, ...] = ()

    def get_params(self) -> dict:
        """The constructor parameters, as a dict."""
        return {name: getattr(self, name) for name in self._param_names}

    def set_params(self, **params):
        """Set constructor parameters (unknown names are an error); returns ``self``."""
        for name, value in params.items():
            if name not in self._param_names:
                raise ValueError(f"unknown parameter {name!r}; parameters are {', '.join(self._param_names)}")
            setattr(self, name, value)
        return self

    def _checked_k(self, k) -> int:
        if isinstance(k, bool) or not isinstance(k, numbers.Integral) or not 1 <= k <= self.n_labels_:
            raise ValueError(f"k must be an integer between 1 and n_labels = {self.n_labels_}, but is {k!r}")
        return int(k)

    def predict(self, X):
        """The best label of every row (int32), lazily: ``predict_topk(X, k=1)``'s labels.

        Returns
        -------
        dask.array.Array of int32, shape (n_samples,)
        """
        labels, _ = self.predict_topk(X, k=1)
        return labels[:, 0]

    def _rows(self, X) -> da.Array:
        """``X`` as row blocks, once the model is fitted (``_check_fitted``) and ``X`` has its features."""
        self._check_fitted()
        X = _as_rows(X, "X")
        if X.shape[1] != self.n_features_in_:
            raise ValueError(f"X has {X.shape[1]} features, but this model was fitted on {self.n_features_in_}")
        return X


def kept_epoch(estimator) -> dict:
    """The ``history_`` entry of a fitted estimator's kept decoder (the epoch its ``early_stopping`` chose)."""
    history = getattr(estimator, "history_", None)
    if not history or history[0].get("val_loss") is None or math.isnan(history[0]["val_loss"]):
        raise ValueError("the estimator has no held-out figures; fit it with validation_fraction > 0")
    if getattr(estimator, "early_stopping", "loss") == "p@1":
        return max(history, key=lambda h: h["val_p@1"])
    return min(history, key=lambda h: h["val_loss"])
