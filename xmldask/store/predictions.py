"""Prediction stores: the top-k labels and scores of every row of a dataset (layout: :mod:`.layout`).

A prediction store is a Zarr group with two plain 2-D arrays that any Zarr reader understands:

- ``labels``: int32, ``(n_samples, top_k)``, label ids best first (``-1`` pads rows with fewer
  than ``top_k`` candidates);
- ``scores``: float32, same shape, the matching scores (``-inf`` for padding),

chunked by the row blocks of the data (no sharding, so every block task writes its own chunks).
The root attribute ``xmldask`` holds ``kind = "predictions"``, ``top_k``, ``n_samples``,
``n_labels``, the model and data URLs, and the time and throughput of the run.
"""

from __future__ import annotations

import math
import time
import uuid
from dataclasses import dataclass

import dask.array as da
import numpy as np
import zarr

from ..scheduling import parallelism
from . import _fs
from .integrity import commit_attrs, open_root
from .layout import ATTR, LAYOUT_VERSION, compressors

__all__ = ["Predictions", "open_predictions", "write_predictions"]

LABEL_DTYPE = np.dtype("int32")
SCORE_DTYPE = np.dtype("float32")


@dataclass(frozen=True)
class Predictions:
    """An opened prediction store.

    Attributes
    ----------
    url : str
    labels : dask.array.Array, shape (n_samples, top_k), int32
    scores : dask.array.Array, shape (n_samples, top_k), float32
    meta : dict
        The store's ``xmldask`` attributes.
    """

    url: str
    labels: da.Array
    scores: da.Array
    meta: dict

    @property
    def top_k(self) -> int:
        return int(self.labels.shape[1])


def open_predictions(url: str) -> Predictions:
    """Open a prediction store written by :func:`write_predictions` (or ``xmldask predict``)."""
    group, meta = open_root(url, "predictions")
    return Predictions(url, da.from_zarr(group["labels"]), da.from_zarr(group["scores"]), dict(meta))


def _block_batches(n_blocks: int, batch: int):
    for start in range(0, n_blocks, batch):
        yield start, min(n_blocks, start + batch)


def write_predictions(url: str, labels: da.Array, scores: da.Array, *, n_labels: int, meta: dict | None = None,
                      overwrite: bool = False, progress: bool = False) -> dict:
    """Compute lazy top-k ``labels`` and ``scores`` block by block into a new prediction store.

    Blocks are computed a batch at a time (twice the scheduler's parallelism), so a progress bar
    can follow the rows and only one batch of results is ever in memory. The store appears at
    ``url`` only once complete.

    Parameters
    ----------
    url : str
        Where to write (a local path or fsspec URL); must not exist unless ``overwrite``.
    labels, scores : dask.array.Array, shape (n_samples, top_k)
        Row-chunked, one column chunk (for example from a model's ``predict_topk``).
    n_labels : int
        Size of the label space (recorded, and used to check the ids).
    meta : dict, optional
        Extra JSON-serialisable facts to record (model and data URLs...).
    overwrite : bool, default False
        Replace an existing store at ``url``.
    progress : bool, default False
        Show a progress bar over the rows.

    Returns
    -------
    dict
        The store's ``xmldask`` attributes, including ``seconds`` and ``rows_per_second``.
    """
    _fs.check_target(url, kind="predictions", overwrite=overwrite)
    if labels.shape != scores.shape or labels.ndim != 2:
        raise ValueError(f"labels and scores must be 2-D of one shape, but have shapes {labels.shape} and "
                         f"{scores.shape}")
    if tuple(labels.chunks[0]) != tuple(scores.chunks[0]) or len(labels.chunks[1]) != 1:
        raise ValueError("labels and scores must share their row chunks and have one column chunk")
    n, k = labels.shape
    rows = max(1, max(labels.chunks[0], default=1))
    tmp = _fs.temporary_sibling(url)
    start = time.perf_counter()
    try:
        group = zarr.open_group(_fs.zarr_store(tmp), mode="w")
        chunk_shape = (rows, max(k, 1))
        out_labels = group.create_array("labels", shape=(n, k), dtype=LABEL_DTYPE, chunks=chunk_shape,
                                        compressors=compressors(), fill_value=-1)
        out_scores = group.create_array("scores", shape=(n, k), dtype=SCORE_DTYPE, chunks=chunk_shape,
                                        compressors=compressors(), fill_value=-np.inf)
        # zarr chunks of `rows` rows: rechunk so every dask block is exactly one zarr chunk row
        lab = labels.astype(LABEL_DTYPE).rechunk({0: rows})
        sco = scores.astype(SCORE_DTYPE).rechunk({0: rows})
        bounds = np.cumsum((0,) + lab.chunks[0])
        bar = None
        if progress:
            from tqdm.auto import tqdm

            bar = tqdm(total=n, unit="rows", desc="predict", unit_scale=True)
        try:
            for a, b in _block_batches(lab.numblocks[0], 2 * parallelism()):
                r0, r1 = int(bounds[a]), int(bounds[b])
                da.store([lab.blocks[a:b], sco.blocks[a:b]],
                         [out_labels, out_scores], regions=[(slice(r0, r1),), (slice(r0, r1),)], lock=False)
                if bar is not None:
                    bar.update(r1 - r0)
        finally:
            if bar is not None:
                bar.close()
        seconds = time.perf_counter() - start
        bad = _check_ids(out_labels, n_labels)
        if bad:
            raise ValueError(f"the model predicted {bad} label ids outside [0, {n_labels}) (other than -1 padding)")
        info = {
            "kind": "predictions",
            "layout_version": LAYOUT_VERSION,
            "complete": True,
            "generation": uuid.uuid4().hex,
            "n_samples": int(n),
            "top_k": int(k),
            "n_labels": int(n_labels),
            "seconds": round(seconds, 3),
            "rows_per_second": round(n / seconds, 1) if seconds > 0 else math.inf,
            **(meta or {}),
        }
        commit_attrs(group, tmp, {ATTR: info})
        _fs.publish(tmp, url, overwrite=overwrite)
    except BaseException:
        _fs.remove(tmp)
        raise
    return info


def _check_ids(array, n_labels: int) -> int:
    """Number of stored ids outside ``[-1, n_labels)`` (read back chunk by chunk)."""
    bad = 0
    step = array.chunks[0]
    for r in range(0, array.shape[0], step):
        block = array[r:r + step]
        bad += int(np.count_nonzero((block < -1) | (block >= n_labels)))
    return bad
