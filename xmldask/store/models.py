"""Model stores: an estimator's parameters, fitted scalars and fitted arrays in one Zarr group.

Layout: the group attributes ``xmldask`` (``kind = "model"``, ``class``, ``model_version``,
``layout_version``, ``complete`` and any extra facts such as the training data's URL), ``params``
(the constructor parameters as JSON) and ``fitted`` (fitted scalars and small lists), and one
array per fitted array. Written under a hidden temporary name beside the target and moved into
place when complete, like every store.
"""

from __future__ import annotations

import json
import numbers

import numpy as np
import zarr

from . import _fs
from .integrity import INVENTORY_ATTR, open_root, record_inventory
from .layout import ATTR, LAYOUT_VERSION, StoreError, compressors

__all__ = ["jsonable", "model_class", "open_model_store", "write_model_store"]

#: largest chunk side of a model array
MODEL_CHUNK = 1 << 16


def jsonable(value):
    """A parameter as JSON: NumPy scalars as Python numbers, tuples as lists, arrays as ``"ndarray"``,
    random generators as ``None`` (they are not saved), other objects by their class name."""
    if isinstance(value, np.ndarray):
        return "ndarray"
    if isinstance(value, np.random.Generator | np.random.SeedSequence):
        return None
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, tuple):
        return [jsonable(v) for v in value]
    if isinstance(value, str | numbers.Number | bool | type(None) | list | dict):
        return value
    return type(value).__name__


def write_model_store(url: str, *, class_name: str, model_version: int, params: dict, fitted: dict,
                      arrays: dict, meta: dict | None = None, overwrite: bool = False) -> str:
    """Write a fitted model to a new store at ``url`` (atomically).

    Parameters
    ----------
    url : str
        Path or fsspec URL; an existing store is replaced only with ``overwrite``.
    class_name : str
        The estimator's class, checked by :func:`open_model_store`.
    model_version : int
        Version of the estimator's saved form.
    params, fitted : dict
        JSON-serialisable constructor parameters and fitted scalars (NaN and infinity allowed).
    arrays : dict of str to ndarray or None
        Fitted arrays; ``None`` entries are left out.
    meta : dict, optional
        Extra facts for the ``xmldask`` attribute.
    overwrite : bool, default False

    Returns
    -------
    str
        ``url``.
    """
    _fs.check_target(url, kind="model", overwrite=overwrite)
    fitted = json.loads(json.dumps(fitted, default=float))
    tmp = _fs.temporary_sibling(url)
    try:
        group = zarr.open_group(_fs.zarr_store(tmp), mode="w")
        for name, value in arrays.items():
            if value is None:
                continue
            value = np.ascontiguousarray(value)
            chunks = tuple(max(1, min(s, MODEL_CHUNK)) for s in value.shape) if value.ndim else None
            array = group.create_array(name, shape=value.shape, dtype=value.dtype, chunks=chunks,
                                       compressors=compressors(), fill_value=0)
            array[...] = value
        info = {**(meta or {}), "kind": "model", "class": class_name, "model_version": model_version,
                "layout_version": LAYOUT_VERSION, "complete": True}
        group.attrs.update({ATTR: info, "params": params, "fitted": fitted, INVENTORY_ATTR: record_inventory(tmp)})
        _fs.publish(tmp, url, overwrite=overwrite)
    except BaseException:
        _fs.remove(tmp)
        raise
    return url


def _model_group(url: str):
    """The group and ``xmldask`` attribute of the model store at ``url``, after checking its kind, layout
    version, completeness and chunk inventory."""
    return open_root(url, "model")


def model_class(url: str) -> str:
    """The estimator class recorded in the model store at ``url`` (``StoreError`` if it is not one)."""
    return str(_model_group(url)[1].get("class"))


def open_model_store(url: str, *, model_version: int, class_name: str | None = None, hint: str = ""):
    """Open a model store after checking its kind, version, completeness and (if given) class.

    Returns
    -------
    group : zarr.Group
    meta : dict
        The ``xmldask`` attribute.
    """
    group, meta = _model_group(url)
    if meta.get("model_version") != model_version:
        raise StoreError(f"{url} has model version {meta.get('model_version')}; this xmldask reads {model_version}")
    if class_name is not None and meta.get("class") != class_name:
        raise StoreError(f"{url} holds a {meta.get('class')} model, not a {class_name}; load it with "
                         f"{meta.get('class')}.load(url){hint}")
    return group, dict(meta)
