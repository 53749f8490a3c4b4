"""Model stores: an estimator's parameters, fitted scalars and fitted arrays in one Zarr group.

Layout: the group attributes ``xmldask`` (``kind = "model"``, ``class``, ``model_version``,
``layout_version``, ``complete`` and any extra facts such as the training data's URL), ``params``
(the constructor parameters as JSON) and ``fitted`` (fitted scalars and small lists), and one
array per fitted array (a sparse one: a group of its CSR ``data``, ``indices`` and ``indptr``, with
the attributes ``sparse = "csr"`` and ``shape``). Written under a hidden temporary name beside the target and moved into
place when complete, like every store.
"""

from __future__ import annotations

import json
import math
import numbers

import numpy as np
import scipy.sparse as sp
import zarr

from . import _fs
from .integrity import INVENTORY_ATTR, commit_attrs, open_root
from .layout import ATTR, CHUNK_ELEMENTS, LAYOUT_VERSION, StoreError, compressors, read_checked

__all__ = ["SavedModel", "jsonable", "model_class", "model_qualname", "open_model_store", "store_location",
           "update_model_meta", "write_model_store"]

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
    arrays : dict of str to ndarray, SciPy sparse matrix or None
        Fitted arrays (a sparse one as a group of its CSR ``data``, ``indices`` and ``indptr``; see
        :func:`read_model_array`); ``None`` entries are left out.
    meta : dict, optional
        Extra facts for the ``xmldask`` attribute.
    overwrite : bool, default False

    Returns
    -------
    str
        ``url``.
    """
    bad = non_finite(arrays)
    if bad:
        raise ValueError(f"the fitted model holds non-finite values ({bad}): it diverged or was fitted on "
                         f"non-finite data; nothing was written to {url}")
    _fs.check_target(url, kind="model", overwrite=overwrite)
    fitted = json.loads(json.dumps(fitted, default=float))
    tmp = _fs.temporary_sibling(url)
    try:
        group = zarr.open_group(_fs.zarr_store(tmp), mode="w")
        writes = []  # (group, name, array): written at once, each array's files its own
        for name, value in arrays.items():
            if value is None:
                continue
            if sp.issparse(value):  # a group of its CSR arrays
                value = sp.csr_matrix(value)
                sub = group.create_group(name)
                sub.attrs.update({"sparse": "csr", "shape": list(value.shape)})
                writes += [(sub, part, getattr(value, part)) for part in ("data", "indices", "indptr")]
                continue
            writes.append((group, name, value))
        _write_arrays(writes)
        info = {**(meta or {}), "kind": "model", "class": class_name, "model_version": model_version,
                "layout_version": LAYOUT_VERSION, "complete": True}
        commit_attrs(group, tmp, {ATTR: info, "params": params, "fitted": fitted})
        _fs.publish(tmp, url, overwrite=overwrite)
    except BaseException:
        _fs.remove(tmp)
        raise
    return url


def update_model_meta(url: str, meta: dict) -> None:
    """Add ``meta`` to the ``xmldask`` attribute of the model store at ``url`` (written by
    :func:`write_model_store`), in one commit of its root attributes: facts learned after the model was saved
    (e.g. the record of a search that kept it), without writing its arrays again."""
    group, info = _model_group(url)
    group = zarr.open_group(_fs.zarr_store(url), mode="r+")
    commit_attrs(group, url, {ATTR: {**info, **meta}})


def non_finite(arrays: dict) -> str:
    """The floating-point arrays of ``arrays`` (dense, or sparse by their stored values) that hold NaN or
    infinity, as ``"name: count, ..."`` (empty if none)."""
    counts = {}
    for name, value in arrays.items():
        values = getattr(value, "data", None) if sp.issparse(value) else value
        if values is None or not hasattr(values, "dtype") or values.dtype.kind not in "fc":
            continue
        bad = int(values.size - np.count_nonzero(np.isfinite(values)))
        if bad:
            counts[name] = bad
    return ", ".join(f"{name}: {count:,}" for name, count in counts.items())


def _chunks(shape: tuple) -> tuple | None:
    """Chunks of about :data:`~.layout.CHUNK_ELEMENTS` elements: the trailing sides whole (at most
    :data:`MODEL_CHUNK`), as many rows as fill the rest (65,536-element chunks of a label-sized vector read at a
    third of the speed of million-element ones: a 1M-label model's 1.4 GB took 4 s)."""
    if not shape:
        return None
    tail = tuple(max(1, min(side, MODEL_CHUNK)) for side in shape[1:])
    return (max(1, min(shape[0], CHUNK_ELEMENTS // math.prod(tail))),) + tail


#: arrays of a model written at once (threads waiting on Zarr's I/O and codecs; a model of 13 arrays on a local disk:
#: 84-90 ms one after the other)
WRITE_THREADS = 8


def _write_arrays(writes: list) -> None:
    """:func:`_write_array` of every ``(group, name, value)``, in up to :data:`WRITE_THREADS` threads (the first error
    raised here, after the others end)."""
    if len(writes) <= 1:
        for group, name, value in writes:
            _write_array(group, name, value)
        return
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(min(WRITE_THREADS, len(writes)), thread_name_prefix="xmldask-write") as pool:
        for future in [pool.submit(_write_array, *write) for write in writes]:
            future.result()


def _write_array(group, name: str, value) -> None:
    value = np.ascontiguousarray(value)
    array = group.create_array(name, shape=value.shape, dtype=value.dtype, chunks=_chunks(value.shape),
                               compressors=compressors(), fill_value=0)
    array[...] = value


def read_model_array(value, where: str = "the model store"):
    """A fitted array as :func:`write_model_store` wrote it (a CSR matrix from its group), or as given; a chunk
    that fails its checksum is a :class:`StoreError` naming ``where`` and the array."""
    if isinstance(value, zarr.Group):
        parts = tuple(np.asarray(read_checked(value[part], ..., where)) for part in ("data", "indices", "indptr"))
        return sp.csr_matrix(parts, shape=tuple(value.attrs["shape"]))
    return value if sp.issparse(value) else np.asarray(read_checked(value, ..., where))


def store_location(arrays) -> str:
    """The store of ``arrays`` (a Zarr group) for messages, as a path where it is local."""
    where = str(getattr(arrays, "store_path", "the model store"))
    return where.removeprefix("file://")


def _model_group(url: str):
    """The group and ``xmldask`` attribute of the model store at ``url``, after checking its kind, layout
    version, completeness and chunk inventory."""
    return open_root(url, "model")


def model_attrs(url: str) -> dict:
    """The root attributes of the model store at ``url`` (``params``, ``fitted``, ...), after its checks: the
    facts of a model without reading its arrays."""
    return dict(_model_group(url)[0].attrs)


def model_class(url: str) -> str:
    """The name of the estimator class recorded in the model store at ``url`` (``StoreError`` if it is not one):
    ``"LEML"``, whether the store records it qualified (``xmldask.models.leml.LEML``) or, written before, bare."""
    return model_qualname(url).rpartition(".")[2]


def model_qualname(url: str) -> str:
    """The estimator class as the model store at ``url`` records it: its module-qualified name (a bare class name
    in stores written before)."""
    return str(_model_group(url)[1].get("class"))


def open_model_store(url: str, *, model_version: int | tuple[int, ...], class_name: str | None = None,
                     hint: str = ""):
    """Open a model store after checking its kind, version (``model_version``: the one, or those, this code
    reads), completeness and (if given) class.

    Returns
    -------
    group : zarr.Group
    meta : dict
        The ``xmldask`` attribute.
    """
    group, meta = _model_group(url)
    held = str(meta.get("class")).rpartition(".")[2]
    if class_name is not None and held != class_name.rpartition(".")[2]:
        raise StoreError(f"{url} holds a {held} model, not a {class_name}; load it with {held}.load(url){hint}")
    versions = (model_version,) if isinstance(model_version, int) else tuple(model_version)
    if meta.get("model_version") not in versions:
        raise StoreError(f"{url} has model version {meta.get('model_version')}; this xmldask reads "
                         f"{', '.join(map(str, versions))}")
    return group, dict(meta)


class SavedModel:
    """``save`` and ``load`` of an estimator as a model store: its constructor parameters, the fitted scalars
    named in ``_SCALARS`` and the fitted arrays named in ``_ARRAYS`` (attribute names without their trailing
    underscore), under the version ``_MODEL_VERSION`` of the class's saved form.

    Mixed into the estimators (:class:`xmldask.base.ParamsMixin` gives ``get_params`` and
    ``_get_param_names``; each estimator its ``_check_fitted``). A class that saves more extends
    :meth:`_parts`; one that restores more extends :meth:`_from_parts`.
    """

    _MODEL_VERSION: int = 1
    #: earlier versions of the saved form that :meth:`load` still reads (``_from_group`` converts them)
    _EARLIER_VERSIONS: tuple[int, ...] = ()
    _ARRAYS: tuple[str, ...] = ()
    _SCALARS: tuple[str, ...] = ()
    #: constructor parameters that stores written by earlier versions hold under another name: old -> new
    _FORMER_PARAMS: dict[str, str] = {}

    def save(self, url: str, *, overwrite: bool = False, meta: dict | None = None) -> str:
        """Write the fitted model to a new model store at ``url`` (atomically).

        Parameters
        ----------
        url : str
            Path or fsspec URL.
        overwrite : bool, default False
            Replace an existing store (otherwise ``FileExistsError``).
        meta : dict, optional
            Extra JSON-serialisable facts recorded in the ``xmldask`` attribute (for example the URL of the
            training data, ``{"train_url": ...}``).

        Returns
        -------
        str
            ``url``.
        """
        params, fitted, arrays = self._parts()
        return write_model_store(url, class_name=f"{type(self).__module__}.{type(self).__qualname__}",
                                 model_version=self._MODEL_VERSION,
                                 params=params, fitted=fitted, arrays=arrays, meta=meta, overwrite=overwrite)

    def _parts(self) -> tuple[dict, dict, dict]:
        """What :meth:`save` writes: the parameters and fitted scalars as JSON, the fitted arrays."""
        self._check_fitted()
        params = {name: jsonable(value) for name, value in self.get_params(deep=False).items()}
        fitted = {name: jsonable(getattr(self, name + "_", None)) for name in self._SCALARS}
        return params, fitted, {name: getattr(self, name + "_", None) for name in self._ARRAYS}

    @classmethod
    def load(cls, url: str):
        """Read a model written by :meth:`save`.

        Raises
        ------
        StoreError
            No model at ``url``, an incomplete or newer store, or a model of another class
            (:func:`xmldask.models.load_model` reads any).
        """
        group, meta = open_model_store(url, model_version=(cls._MODEL_VERSION, *cls._EARLIER_VERSIONS),
                                       class_name=cls.__name__,
                                       hint=" (or xmldask.models.load_model(url) for any model)")
        model = cls._from_group(group, meta)._checked_finite(url)
        model._located(str(url), dict(group.attrs).get(INVENTORY_ATTR))
        return model

    def _located(self, url: str, inventory) -> None:
        """Told, once loaded, where its arrays are (``url``: the store, or its group of this model's arrays) and the
        store's recorded ``inventory``: a model that reads its arrays from there when it predicts keeps them."""

    def _checked_finite(self, url: str):
        """``self``, loaded from ``url``, after checking that its fitted arrays hold no NaN or infinity (a model
        with them is never saved, so the store was damaged after it was written)."""
        bad = non_finite(self._parts()[2])
        if bad:
            raise StoreError(f"{url}: the model holds non-finite values ({bad}), which xmldask never saves: the "
                             "store was damaged after it was written; retrain the model or restore a copy")
        return self

    @classmethod
    def _from_group(cls, group, meta: dict):
        """The fitted model in an opened model store (``meta``: its ``xmldask`` attribute)."""
        attrs = dict(group.attrs)
        return cls._from_parts(attrs["params"], attrs.get("fitted", {}), group)

    @classmethod
    def _from_parts(cls, params: dict, fitted: dict, arrays):
        """The fitted model from :meth:`_parts` (``arrays``: a mapping, such as the store's group, that lacks
        the arrays that were ``None``)."""
        params = {cls._FORMER_PARAMS.get(key, key): value for key, value in params.items()}
        names = cls._get_param_names()
        model = cls(**{key: value for key, value in params.items() if key in names})
        where = store_location(arrays)
        for name in cls._ARRAYS:
            setattr(model, name + "_", read_model_array(arrays[name], where) if name in arrays else None)
        for name, value in fitted.items():
            setattr(model, name + "_", value)
        return model
