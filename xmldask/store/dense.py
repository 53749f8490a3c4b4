"""Dense matrices chunked by rows (layout: :mod:`.layout`)."""

from __future__ import annotations

import uuid

import dask.array as da
import numpy as np
import zarr

from . import _fs
from .integrity import commit_attrs, open_root
from .layout import ATTR, BLOCK_ROWS, DENSE_ENCODING, LAYOUT_VERSION, compressors

__all__ = ["write_dense", "open_dense"]


def write_dense(url: str, x, *, block_rows: int | None = None, overwrite: bool = False) -> str:
    """Write a 2-D NumPy or Dask array to a new store at ``url``, chunked by rows.

    A Dask array is written block by block (each task writes its own rows); the store appears at
    ``url`` only once complete.
    """
    _fs.check_target(url, kind="dense", overwrite=overwrite)
    if x.ndim != 2:
        raise ValueError(f"expected a 2-D array, got shape {x.shape}")
    rows = int(block_rows or (x.chunks[0][0] if isinstance(x, da.Array) else min(BLOCK_ROWS, max(1, x.shape[0]))))
    tmp = _fs.temporary_sibling(url)
    try:
        group = zarr.open_group(_fs.zarr_store(tmp), mode="w")
        array = group.create_array("values", shape=x.shape, dtype=x.dtype, chunks=(max(rows, 1), max(x.shape[1], 1)),
                                   compressors=compressors(), fill_value=0)
        if isinstance(x, da.Array):
            da.store(x.rechunk({0: rows, 1: -1}), array, lock=False)
        else:
            array[...] = np.asarray(x)
        meta = {"kind": "dense", "layout_version": LAYOUT_VERSION, "complete": True, "generation": uuid.uuid4().hex}
        commit_attrs(group, tmp, {**DENSE_ENCODING, "shape": list(x.shape), ATTR: meta})
        _fs.publish(tmp, url, overwrite=overwrite)
    except BaseException:
        _fs.remove(tmp)
        raise
    return url


def open_dense(url: str) -> da.Array:
    """Open a dense matrix store as a Dask array chunked by rows."""
    group, _ = open_root(url, "dense")
    return da.from_zarr(group["values"])
