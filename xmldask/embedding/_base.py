"""Shared machinery of the embedding estimators: parameters, fitted checks, Zarr save/load.

A saved model is a Zarr v3 group::

    <group>/zarr.json   attributes:
        xmldask   {kind: "model", class: "Rembrandt", model_version: 1, layout_version, complete: true}
        params    the constructor parameters (JSON; a Generator random_state is saved as null)
        fitted    the fitted scalar attributes (n_passes_, alpha_, ...)
    <group>/<name>      one array per fitted array attribute (embedding, eigenvalues, ...)

It is written under a hidden temporary name beside the target and moved into place when complete
(:func:`xmldask.store._fs.temporary_sibling` / :func:`~xmldask.store._fs.publish`), like every store.
"""

from __future__ import annotations

import inspect
import numbers

import dask.array as da
import numpy as np
import scipy.sparse as sp
import zarr

from ..store import _fs
from ..store.layout import ATTR, LAYOUT_VERSION, StoreError, compressors

__all__ = ["MODEL_VERSION", "EmbeddingModel", "NotFittedError", "load_model"]

#: version of the saved-model layout; a change that old readers cannot read bumps it
MODEL_VERSION = 1

_REGISTRY: dict[str, type] = {}


class NotFittedError(ValueError, AttributeError):
    """The estimator is used before ``fit``."""


def _jsonable(value):
    if isinstance(value, np.random.Generator | np.random.SeedSequence):
        return None
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, tuple):
        return list(value)
    return value


class EmbeddingModel:
    """Base class: ``__init__`` stores parameters only; ``fit`` sets the attributes ending in ``_``.

    Subclasses list their fitted array attributes in ``_arrays`` and fitted scalars in ``_scalars``
    (names without the trailing underscore).
    """

    _arrays: tuple[str, ...] = ()
    _scalars: tuple[str, ...] = ()
    _required: str = "embedding"

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        _REGISTRY[cls.__name__] = cls

    # -- parameters ------------------------------------------------------------------------

    @classmethod
    def _param_names(cls) -> list[str]:
        sig = inspect.signature(cls.__init__)
        return [p.name for p in sig.parameters.values() if p.name != "self" and p.kind != p.VAR_KEYWORD]

    def get_params(self) -> dict:
        """The constructor parameters, as a dict."""
        return {name: getattr(self, name) for name in self._param_names()}

    def __repr__(self) -> str:
        sig = inspect.signature(type(self).__init__)
        shown = []
        for name, value in self.get_params().items():
            default = sig.parameters[name].default
            if value is not default and not (isinstance(value, str | numbers.Number) and value == default):
                shown.append(f"{name}={value!r}")
        return f"{type(self).__name__}({', '.join(shown)})"

    # -- fitted state ----------------------------------------------------------------------

    def _check_fitted(self) -> None:
        if getattr(self, self._required + "_", None) is None:
            raise NotFittedError(f"this {type(self).__name__} is not fitted yet; call fit(...) first")

    # -- persistence -----------------------------------------------------------------------

    def save(self, url: str, *, overwrite: bool = False) -> str:
        """Write the parameters and fitted arrays to a new Zarr store at ``url``.

        Parameters
        ----------
        url : str
            Path or fsspec URL.
        overwrite : bool, default False
            Replace an existing store at ``url`` (otherwise ``FileExistsError``).

        Returns
        -------
        str
            ``url``.
        """
        self._check_fitted()
        if _fs.exists(url) and not overwrite:
            raise FileExistsError(f"{url} already exists; pass overwrite=True to replace it")
        params = {name: _jsonable(value) for name, value in self.get_params().items()}
        fitted = {name: _jsonable(getattr(self, name + "_", None)) for name in self._scalars}
        tmp = _fs.temporary_sibling(url)
        try:
            group = zarr.open_group(_fs.zarr_store(tmp), mode="w")
            for name in self._arrays:
                value = getattr(self, name + "_", None)
                if value is None:
                    continue
                value = np.ascontiguousarray(value)
                chunks = tuple(max(1, min(s, 1 << 16)) for s in value.shape) if value.ndim else ()
                array = group.create_array(name, shape=value.shape, dtype=value.dtype, chunks=chunks or None,
                                           compressors=compressors(), fill_value=0)
                array[...] = value
            meta = {"kind": "model", "class": type(self).__name__, "model_version": MODEL_VERSION,
                    "layout_version": LAYOUT_VERSION, "complete": True}
            group.attrs.update({ATTR: meta, "params": params, "fitted": fitted})
            _fs.publish(tmp, url, overwrite=overwrite)
        except BaseException:
            _fs.remove(tmp)
            raise
        return url

    @classmethod
    def load(cls, url: str):
        """Read a model saved by :meth:`save`; refuses a store of another class.

        Parameters
        ----------
        url : str

        Returns
        -------
        EmbeddingModel
            An instance of ``cls``, fitted.
        """
        group, meta = _open_model(url)
        if meta.get("class") != cls.__name__:
            raise StoreError(f"{url} holds a {meta.get('class')} model, not a {cls.__name__}; "
                             f"load it with {meta.get('class')}.load(url) or xmldask.embedding.load_model(url)")
        return cls._from_group(group)

    @classmethod
    def _from_group(cls, group):
        attrs = dict(group.attrs)
        names = set(cls._param_names())
        model = cls(**{k: v for k, v in attrs["params"].items() if k in names})
        for name in cls._arrays:
            setattr(model, name + "_", group[name][...] if name in group else None)
        for name, value in attrs.get("fitted", {}).items():
            setattr(model, name + "_", value)
        return model


def _open_model(url: str):
    try:
        group = zarr.open_group(_fs.zarr_store(url, read_only=True), mode="r")
    except FileNotFoundError as exc:
        raise StoreError(f"no model store at {url}") from exc
    meta = dict(group.attrs).get(ATTR)
    if not meta or meta.get("kind") != "model":
        kind = None if not meta else meta.get("kind")
        raise StoreError(f"{url} is not a saved xmldask model (kind {kind!r})")
    if meta.get("model_version") != MODEL_VERSION:
        raise StoreError(f"{url} has model version {meta.get('model_version')}; this xmldask reads {MODEL_VERSION}")
    if not meta.get("complete"):
        raise StoreError(f"{url} is incomplete (its write did not finish); write it again")
    return group, meta


def load_model(url: str) -> EmbeddingModel:
    """Load any saved embedding model, whatever its class.

    Parameters
    ----------
    url : str

    Returns
    -------
    EmbeddingModel
    """
    group, meta = _open_model(url)
    cls = _REGISTRY.get(meta.get("class"))
    if cls is None:
        raise StoreError(f"{url} holds a {meta.get('class')!r} model, which this xmldask does not know")
    return cls._from_group(group)


# -- helpers shared by the estimators ----------------------------------------------------------


def project(A, V: np.ndarray, *, center: np.ndarray | None = None):
    """``(A - 1 mu^T) V`` for a Dask array of row blocks (lazily, per block) or an in-memory matrix.

    ``V`` is cast to ``A``'s working dtype so that a float32 pass stays float32.
    """
    from ..linalg._kernels import working_dtype
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
