"""Shared machinery of the embedding estimators: parameters, fitted checks, Zarr save/load.

A saved model is a Zarr v3 group::

    <group>/zarr.json   attributes:
        xmldask   {kind: "model", class: "Rembrandt", model_version: 1, layout_version, complete: true}
        params    the constructor parameters (JSON; a Generator random_state is saved as null)
        fitted    the fitted scalar attributes (n_passes_, alpha_, ...)
    <group>/<name>      one array per fitted array attribute (embedding, eigenvalues, ...)

Written and read by :mod:`xmldask.store.models` (atomically, like every store).
"""

from __future__ import annotations

import inspect
import numbers

import dask.array as da
import numpy as np
import scipy.sparse as sp

from ..base import NotFittedError, ParamsMixin, registered_class
from ..store.layout import StoreError
from ..store.models import SavedModel, open_model_store

__all__ = ["MODEL_VERSION", "EmbeddingModel", "NotFittedError", "load_model"]

#: version of the saved-model layout; a change that old readers cannot read bumps it
MODEL_VERSION = 1


class EmbeddingModel(SavedModel, ParamsMixin):
    """Base class: ``__init__`` stores parameters only; ``fit`` sets the attributes ending in ``_``.

    Subclasses list their fitted array attributes in ``_ARRAYS`` and fitted scalars in ``_SCALARS``
    (names without the trailing underscore), which ``save`` writes and ``load`` reads.
    """

    _MODEL_VERSION = MODEL_VERSION
    _required: str = "embedding"

    # -- parameters (ParamsMixin: get_params / set_params from the constructor) -------------

    def __repr__(self) -> str:
        sig = inspect.signature(type(self).__init__)
        shown = []
        for name, value in self.get_params(deep=False).items():
            default = sig.parameters[name].default
            if value is not default and not (isinstance(value, str | numbers.Number) and value == default):
                shown.append(f"{name}={value!r}")
        return f"{type(self).__name__}({', '.join(shown)})"

    # -- fitted state ----------------------------------------------------------------------

    def _check_fitted(self) -> None:
        if getattr(self, self._required + "_", None) is None:
            raise NotFittedError(f"this {type(self).__name__} is not fitted yet; call fit(...) first")


def load_model(url: str) -> EmbeddingModel:
    """The embedding model saved at ``url``, whatever its class (:func:`xmldask.models.load_model` opens any model)."""
    group, meta = open_model_store(url, model_version=MODEL_VERSION)
    cls = registered_class(str(meta.get("class")))
    if cls is None or not issubclass(cls, EmbeddingModel):
        raise StoreError(f"{url} holds a {meta.get('class')!r} model, which is not an embedding model of this "
                         f"xmldask")
    return cls._from_group(group, meta)._checked_finite(url)


# -- helpers shared by the estimators ----------------------------------------------------------


def project(A, V: np.ndarray, *, center: np.ndarray | None = None):
    """``(A - 1 mu^T) V`` for a Dask array of row blocks (lazily, per block) or an in-memory matrix.

    ``V`` is cast to ``A``'s working dtype so that a float32 pass stays float32.
    """
    from ..linalg import working_dtype
    from ..linalg.passes import x_q

    dtype = working_dtype(A.dtype)
    V = np.asarray(V, dtype=dtype)
    mu = None if center is None else np.asarray(center, dtype=dtype)
    if isinstance(A, da.Array):
        return x_q(A, V, center=mu)
    out = A @ V
    out = np.asarray(out.toarray() if sp.issparse(out) else out, dtype=dtype)
    if mu is not None:
        out = out - mu @ V
    return out


def check_columns(A, n: int, name: str, what: str) -> None:
    if getattr(A, "ndim", 2) != 2 or A.shape[1] != n:
        shape = getattr(A, "shape", None)
        raise ValueError(f"{name} must have {n} columns (the {what} seen in fit), but has shape {shape}")
