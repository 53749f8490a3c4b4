"""Datasets: features X and labels Y as CSR row blocks, with metadata (layout: :mod:`.layout`)."""

from __future__ import annotations

import datetime as _dt
import hashlib
import json
import uuid
from dataclasses import dataclass, field

import dask.array as da
import numpy as np
import scipy.sparse as sp
import zarr

from . import _fs
from .csr import CSRWriter, csr_from_group
from .integrity import TailGuard, WriterLock, commit_attrs, open_root
from .layout import ATTR, BLOCK_ROWS, DATA_DTYPE, INDEX_DTYPE, LAYOUT_VERSION, StoreError, read_checked

__all__ = ["Dataset", "DatasetWriter", "format_info", "open_dataset"]

_COUNT_SLOTS = ("label_counts", "label_counts_next")
#: the group (and meta flag) of the observed-entry mask of a dataset with missing labels
OBSERVED = "observed"

#: label-count vectors up to this length are read and written whole; longer ones chunk by chunk
_DENSE_COUNTS = 1 << 24
_COUNT_CHUNK = 1 << 20


class _LabelCounts:
    """Rows per label, kept sparse (sorted ids and their counts): memory grows with the labels seen,
    not with the largest id (a header may announce two billion labels)."""

    def __init__(self):
        self.ids = np.zeros(0, np.int64)
        self.counts = np.zeros(0, np.int64)

    @property
    def top(self) -> int:
        """One past the largest label id counted (0 if none)."""
        return int(self.ids[-1]) + 1 if len(self.ids) else 0

    def add(self, ids: np.ndarray, counts: np.ndarray | None = None) -> None:
        """Count the label ids ``ids`` (with multiplicities ``counts``, else once each occurrence)."""
        if counts is None:
            ids, counts = np.unique(ids, return_counts=True)
        ids, counts = np.asarray(ids, np.int64), np.asarray(counts, np.int64)
        pos = np.searchsorted(self.ids, ids).clip(max=max(len(self.ids) - 1, 0))
        if len(self.ids) and np.array_equal(self.ids[pos], ids):  # no new label: add in place
            np.add.at(self.counts, pos, counts)
            return
        merged, inverse = np.unique(np.concatenate([self.ids, ids]), return_inverse=True)
        self.counts = np.bincount(inverse, weights=np.concatenate([self.counts, counts]),
                                  minlength=len(merged)).astype(np.int64)
        self.ids = merged

    @classmethod
    def read(cls, array) -> _LabelCounts:
        out = cls()
        step = array.shape[0] if array.shape[0] <= _DENSE_COUNTS else _COUNT_CHUNK
        for start in range(0, array.shape[0], max(step, 1)):
            block = np.asarray(array[start:start + step], dtype=np.int64)
            nz = np.flatnonzero(block)
            if len(nz):
                out.add(nz + start, block[nz])
        return out

    def write(self, array) -> None:
        """Write into a new zero-filled array (untouched chunks keep the fill value, unwritten)."""
        if not len(self.ids):
            return
        if array.shape[0] <= _DENSE_COUNTS:
            dense = np.zeros(self.top, np.int64)
            dense[self.ids] = self.counts
            array[: self.top] = dense
        else:
            array.set_coordinate_selection((self.ids,), self.counts)


def _now() -> str:
    return _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds")


@dataclass
class Dataset:
    """An opened dataset store.

    Attributes
    ----------
    url : str
    X : dask.array.Array, shape (n_samples, n_features)
        Features; chunks are ``scipy.sparse.csr_matrix`` row blocks.
    Y : dask.array.Array, shape (n_samples, n_labels)
        Binary labels, with the same row blocks as ``X``.
    meta : dict
        The dataset metadata (see :mod:`xmldask.store.layout`).
    observed : dask.array.Array or None, shape (n_samples, n_labels)
        The observed label entries (stored 1.0; relevant and irrelevant alike) of a dataset with
        missing labels, with ``Y``'s row blocks; ``None``: every entry of ``Y`` is observed.
    """

    url: str
    X: da.Array
    Y: da.Array
    meta: dict = field(repr=False)
    observed: da.Array | None = field(default=None, repr=False)

    @property
    def n_samples(self) -> int:
        return int(self.meta["n_samples"])

    @property
    def n_features(self) -> int:
        return int(self.meta["n_features"])

    @property
    def n_labels(self) -> int:
        return int(self.meta["n_labels"])

    @property
    def nbytes(self) -> int:
        """Bytes of ``X`` and ``Y`` as in-memory CSR matrices: 4-byte values and column ids, 8-byte row
        pointers (what a process holding the whole dataset would need)."""
        return 8 * (int(self.meta["nnz"]) + int(self.meta["nnz_labels"])) + 16 * (self.n_samples + 1)

    @property
    def fingerprint(self) -> str:
        """Content fingerprint (16 hex digits): the sha256 of the source files, the transforms, the sizes.

        Two stores ingested from the same files with the same transforms have the same fingerprint, wherever
        they are. A store without recorded sources (e.g. from :func:`xmldask.datasets.make_synthetic`) is
        fingerprinted by its generator parameters, else by its commit ``generation``.
        """
        meta = self.meta
        content = {"sources": [s.get("sha256") for s in meta.get("sources") or []],
                   "transforms": meta.get("transforms"), "n_samples": meta.get("n_samples"),
                   "n_features": meta.get("n_features"), "n_labels": meta.get("n_labels")}
        if not content["sources"]:
            content["synthetic"] = meta.get("synthetic") or meta.get("generation")
        text = json.dumps(content, sort_keys=True, default=str, separators=(",", ":"))
        return hashlib.sha256(text.encode()).hexdigest()[:16]

    @property
    def label_counts(self) -> np.ndarray:
        """Number of rows carrying each label, shape (n_labels,)."""
        group = zarr.open_group(_fs.zarr_store(self.url, read_only=True), mode="r")
        name = str(self.meta.get("label_counts_array", ""))
        array = group.get(name) if name and not name.startswith("/") and ".." not in name.split("/") else None
        if not isinstance(array, zarr.Array) or array.shape != (self.n_labels,):
            raise StoreError(f"{self.url}: its label counts array {name!r} is not an array of {self.n_labels:,} "
                             "counts inside the store; ingest the dataset again from its source")
        return np.asarray(read_checked(array, ..., self.url), dtype=np.int64)

    def info(self) -> dict:
        """Summary figures: sizes, densities and the label-frequency profile."""
        counts = self.label_counts
        n = max(self.n_samples, 1)
        ordered = np.sort(counts)[::-1]
        return {
            "url": self.url,
            "n_samples": self.n_samples,
            "n_features": self.n_features,
            "n_labels": self.n_labels,
            "nnz": int(self.meta["nnz"]),
            "nnz_labels": int(self.meta["nnz_labels"]),
            "nbytes": self.nbytes,
            "avg_features_per_row": self.meta["nnz"] / n,
            "avg_labels_per_row": self.meta["nnz_labels"] / n,
            "rows_without_labels": int(self.meta["rows_without_labels"]),
            "labels_used": int(np.count_nonzero(counts)),
            "label_frequency_max": int(ordered[0]) if len(ordered) else 0,
            "label_frequency_median": float(np.median(counts)) if len(counts) else 0.0,
            "labels_seen_at_most_5_times": int(np.count_nonzero(counts <= 5)),
            "top_10_label_share": float(ordered[:10].sum() / max(counts.sum(), 1)),
            "row_blocks": len(self.meta["row_blocks"]) - 1,
            "nnz_observed": int(self.meta["nnz_observed"]) if self.meta.get(OBSERVED) else None,
            "sources": [{k: s[k] for k in ("path", "format", "rows", "sha256", "observed") if k in s}
                        for s in self.meta["sources"]],
            "transforms": self.meta.get("transforms", {}),
            "layout_version": self.meta["layout_version"],
        }

    def __repr__(self) -> str:
        return (f"Dataset({self.url!r}, n_samples={self.n_samples}, n_features={self.n_features}, "
                f"n_labels={self.n_labels}, nnz={self.meta['nnz']}, row_blocks={len(self.meta['row_blocks']) - 1})")


#: largest number of features or labels: ids are stored as int32
MAX_DIMENSION = int(np.iinfo(INDEX_DTYPE).max)


def _read_root(url: str):
    return open_root(url, "dataset")


def check_dimension(name: str, value) -> None:
    """Refuse a number of features or labels that the store's int32 ids cannot hold."""
    if value is not None and not 0 <= int(value) <= MAX_DIMENSION:
        raise ValueError(f"{name} = {value} does not fit the store: ids are int32, so at most {MAX_DIMENSION}")


def open_dataset(url: str, *, dtype=DATA_DTYPE) -> Dataset:
    """Open a dataset store.

    Parameters
    ----------
    url : str
        Path or fsspec URL of the store.
    dtype : numpy dtype, default float32
        dtype of the blocks of ``X`` and ``Y`` (the store holds float32).

    Returns
    -------
    Dataset
        With ``.X`` and ``.Y`` as Dask arrays of CSR row blocks and ``.meta``.
    """
    _, meta = _read_root(url)
    common = {"n_rows": meta["n_samples"], "row_blocks": meta["row_blocks"],
              "generation": meta["generation"], "dtype": dtype}
    X = csr_from_group(url, "X", n_cols=meta["n_features"], **common)
    Y = csr_from_group(url, "Y", n_cols=meta["n_labels"], **common)
    observed = csr_from_group(url, OBSERVED, n_cols=meta["n_labels"], **common) if meta.get(OBSERVED) else None
    return Dataset(url=str(url), X=X, Y=Y, meta=meta, observed=observed)


class DatasetWriter:
    """Write a new dataset, or append rows to one, block by block, safely.

    Use :meth:`create` or :meth:`append` as a context manager, :meth:`write` row pieces, then
    :meth:`commit`. Leaving the block without committing (an exception) discards everything: a new
    store never appears at its URL, an append leaves the dataset as it was.

    A new store is written under a hidden temporary name beside ``url`` and moved into place by
    :meth:`commit`. An append writes past the committed end of the arrays and makes the new rows
    visible by rewriting the root attributes last; an append that died is discarded by the next.
    One writer at a time may append: :meth:`append` takes the dataset's writer lock
    (:class:`~xmldask.store.integrity.WriterLock`; a second writer is refused with a ``StoreError``)
    and :meth:`commit` refuses if the committed state changed since the append started.
    """

    def __init__(self, url: str, *, target: str, group: zarr.Group, meta: dict, block_rows: int,
                 append: bool, overwrite: bool = False, lock: WriterLock | None = None):
        self.url, self._target, self._group = str(url), target, group
        self.meta, self._append, self._overwrite = meta, append, overwrite
        self._lock = lock
        self._tails = TailGuard(url, group) if append else None
        self._done = False
        if append:
            self._X = CSRWriter(group["X"], block_rows=block_rows, append=True,
                                committed=(meta["row_blocks"], meta["nnz"]))
            self._Y = CSRWriter(group["Y"], block_rows=block_rows, append=True,
                                committed=(meta["row_blocks"], meta["nnz_labels"]))
            self._counts = _LabelCounts.read(group[meta["label_counts_array"]])
            self._O = CSRWriter(group[OBSERVED], block_rows=block_rows, append=True,
                                committed=(meta["row_blocks"], meta["nnz_observed"])) if meta.get(OBSERVED) else None
        else:
            self._X = CSRWriter(group.create_group("X"), n_cols=meta.get("n_features"), block_rows=block_rows)
            self._Y = CSRWriter(group.create_group("Y"), n_cols=meta.get("n_labels"), block_rows=block_rows)
            self._counts = _LabelCounts()
            self._O = CSRWriter(group.create_group(OBSERVED), n_cols=meta.get("n_labels"),
                                block_rows=block_rows) if meta.get(OBSERVED) else None
        self.rows_without_labels = int(meta.get("rows_without_labels", 0))
        self.sources: list[dict] = list(meta.get("sources", []))

    @classmethod
    def create(cls, url: str, *, n_features: int | None = None, n_labels: int | None = None,
               block_rows: int = BLOCK_ROWS, overwrite: bool = False, observed: bool = False) -> DatasetWriter:
        """Start a new dataset at ``url``; ``n_features``/``n_labels`` may be given at commit instead.

        With ``observed``, the dataset has missing labels: every :meth:`write` also gives the
        observed entries, stored as the CSR group ``observed`` beside ``Y`` with the same row blocks.
        """
        if _fs.exists(url) and not overwrite:
            raise FileExistsError(f"{url} already exists; pass overwrite=True (--overwrite) to replace it, "
                                  "or append=True (--append) to add rows to it")
        _fs.check_target(url, kind="dataset", overwrite=overwrite)
        check_dimension("n_features", n_features)
        check_dimension("n_labels", n_labels)
        tmp = _fs.temporary_sibling(url)
        try:
            group = zarr.open_group(_fs.zarr_store(tmp), mode="w")
            meta = {"kind": "dataset", "layout_version": LAYOUT_VERSION, "complete": False,
                    "n_features": n_features, "n_labels": n_labels, "created": _now(), OBSERVED: bool(observed)}
            group.attrs.update({ATTR: meta})
            return cls(url, target=tmp, group=group, meta=meta, block_rows=block_rows, append=False,
                       overwrite=overwrite)
        except BaseException:
            _fs.remove(tmp)
            raise

    @classmethod
    def append(cls, url: str, *, block_rows: int = BLOCK_ROWS) -> DatasetWriter:
        """Start appending rows to the complete dataset at ``url`` (taking its writer lock)."""
        _read_root(url)  # a missing or damaged dataset is refused before the lock is taken
        lock = WriterLock(url).acquire()
        try:
            _, meta = _read_root(url)  # the committed state, read under the lock
            group = zarr.open_group(_fs.zarr_store(url), mode="r+")
            return cls(url, target=url, group=group, meta=dict(meta), block_rows=block_rows, append=True, lock=lock)
        except BaseException:
            lock.release()
            raise

    @property
    def n_samples(self) -> int:
        return self._X.n_rows

    @property
    def n_labels(self) -> int | None:
        return self.meta.get("n_labels")

    @property
    def n_features(self) -> int | None:
        return self.meta.get("n_features")

    def write(self, X: sp.csr_matrix, Y: sp.csr_matrix, observed: sp.csr_matrix | None = None) -> None:
        """Append rows: features ``X`` and labels ``Y`` (same number of rows; Y's values are set to 1).

        ``observed`` (a dataset with missing labels only, and then required): the observed entries
        of these rows (non-zeros, stored as 1), which must include every relevant label of ``Y``.
        """
        if X.shape[0] != Y.shape[0]:
            raise ValueError(f"X has {X.shape[0]} rows but Y has {Y.shape[0]}")
        Y = sp.csr_matrix((np.ones(Y.nnz, DATA_DTYPE), Y.indices, Y.indptr), shape=Y.shape)
        if (observed is None) != (self._O is None):
            raise ValueError("this dataset has an observed-entry mask: pass observed= with every write"
                             if observed is None else "this dataset has no observed-entry mask (every label entry is "
                             "observed); create it with observed=True to store one")
        if observed is not None:
            O = sp.csr_matrix(observed, dtype=DATA_DTYPE)
            O.eliminate_zeros()
            if O.shape[0] != Y.shape[0]:
                raise ValueError(f"observed has {O.shape[0]} rows but Y has {Y.shape[0]}; one mask row per sample")
            O.data[:] = 1
            if Y.nnz and (Y.shape[1] > O.shape[1] or Y.multiply(O).nnz != Y.nnz):
                raise ValueError("Y has relevant labels outside the observed entries; a relevant label is observed "
                                 "by definition: include it in observed")
            self._O.write(O)
        self._X.write(X)
        self._Y.write(Y)
        if Y.nnz:
            self._counts.add(Y.indices)
        self.rows_without_labels += int(np.count_nonzero(np.diff(Y.indptr) == 0))

    def commit(self, *, n_features: int | None = None, n_labels: int | None = None, **extra) -> Dataset:
        """Make the written rows visible (and, for a new store, move it into place); returns the dataset."""
        if self._append:
            self._check_unchanged()
        n_features = int(n_features if n_features is not None else self.meta.get("n_features") or 0)
        n_labels = int(n_labels if n_labels is not None else self.meta.get("n_labels") or self._counts.top)
        if self._counts.top > n_labels:
            raise ValueError(f"label id {self._counts.top - 1} is out of range for {n_labels} labels")
        check_dimension("n_features", n_features)
        check_dimension("n_labels", n_labels)
        row_blocks = self._X.new_row_blocks()
        x_meta = self._X.commit(n_cols=n_features, row_blocks=row_blocks)
        y_meta = self._Y.commit(n_cols=n_labels, row_blocks=row_blocks)
        if self._O is not None:
            extra["nnz_observed"] = self._O.commit(n_cols=n_labels, row_blocks=row_blocks)["nnz"]
        slot = _COUNT_SLOTS[1] if self.meta.get("label_counts_array") == _COUNT_SLOTS[0] else _COUNT_SLOTS[0]
        chunks = (max(1, min(n_labels, _COUNT_CHUNK)),)
        self._counts.write(self._group.create_array(slot, shape=(n_labels,), dtype=np.int64, chunks=chunks,
                                                    fill_value=0, overwrite=True))
        meta = {
            **self.meta,
            **extra,
            "complete": True,
            "n_samples": self.n_samples,
            "n_features": n_features,
            "n_labels": n_labels,
            "nnz": x_meta["nnz"],
            "nnz_labels": y_meta["nnz"],
            "rows_without_labels": self.rows_without_labels,
            "row_blocks": row_blocks,
            "label_counts_array": slot,
            "sources": self.sources,
            "generation": uuid.uuid4().hex,
            "updated": _now(),
        }
        commit_attrs(self._group, self._target, {ATTR: meta}, ["X", "Y", slot])
        self.meta = meta
        if not self._append:
            _fs.publish(self._target, self.url, overwrite=self._overwrite)
        self._done = True
        self._release()
        return open_dataset(self.url)

    def _check_unchanged(self) -> None:
        """Refuse to commit an append if another writer committed since it started (optimistic check)."""
        fresh = dict(zarr.open_group(_fs.zarr_store(self.url, read_only=True), mode="r").attrs).get(ATTR) or {}
        if fresh.get("generation") != self.meta.get("generation"):
            raise StoreError(f"{self.url} was changed by another writer while this append ran (it now has "
                             f"{fresh.get('n_samples')} rows, {self.meta.get('n_samples')} when the append started); "
                             "this append is discarded: run it again")

    def _release(self) -> None:
        if self._lock is not None:
            self._lock.release()

    def abort(self) -> None:
        """Discard what was written since the last commit."""
        if self._done:
            return
        self._done = True
        if not self._append:
            _fs.remove(self._target)
        # an append's uncommitted tail is invisible to readers and truncated by the next append; the
        # committed chunk files it rewrote are put back as they were
        if self._tails is not None:
            self._tails.restore()
        self._release()

    def __enter__(self) -> DatasetWriter:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if not self._done:
            self.abort()


def format_info(info: dict) -> str:
    """:meth:`Dataset.info` as aligned text lines (``xmldask info``)."""
    rows = [
        ("dataset", info["url"]),
        ("rows", f"{info['n_samples']:,} ({info['row_blocks']} row blocks)"),
        ("features", f"{info['n_features']:,}  nnz {info['nnz']:,}  ({info['avg_features_per_row']:.2f} per row)"),
        ("labels", f"{info['n_labels']:,}  used {info['labels_used']:,}  ({info['avg_labels_per_row']:.2f} per row)"),
        ("rows without labels", f"{info['rows_without_labels']:,}"),
        ("label frequency", f"max {info['label_frequency_max']:,}, median {info['label_frequency_median']:g}, "
                            f"{info['labels_seen_at_most_5_times']:,} labels seen <= 5 times, "
                            f"top 10 labels carry {100 * info['top_10_label_share']:.1f}% of assignments"),
    ]
    if info.get("nnz_observed") is not None:
        share = info["nnz_observed"] / max(info["n_samples"] * info["n_labels"], 1)
        rows.append(("observed entries", f"{info['nnz_observed']:,} ({100 * share:.2f}% of rows x labels; "
                                         "the rest are unknown)"))
    for source in info["sources"]:
        rows.append(("source", f"{source['path']} ({source['format']}, {source['rows']:,} rows, "
                               f"sha256 {source['sha256'][:12]}...)"
                               + (f", observed entries from {source['observed']}" if "observed" in source else "")))
    width = max(len(name) for name, _ in rows)
    return "\n".join(f"  {name:<{width}}  {value}" for name, value in rows)
