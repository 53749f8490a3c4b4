"""The on-disk layout of xmldask stores, version 1.

All stores are Zarr v3 groups. xmldask keeps its own facts in the group attribute ``xmldask``.

CSR matrix (``kind = "csr"``), anndata-compatible::

    <group>/zarr.json   attributes:
        encoding-type    "csr_matrix"
        encoding-version "0.1.0"
        shape            [n_rows, n_cols]
        xmldask          {kind, layout_version, complete, nnz, row_blocks, generation}
    <group>/data        float32 (nnz,)        the values, row after row
    <group>/indices     int32   (nnz,)        column ids, sorted within each row
    <group>/indptr      int64   (n_rows + 1,) row i is data[indptr[i]:indptr[i + 1]]

``row_blocks`` lists the boundaries ``[0, r1, r2, ..., n_rows]`` of the row blocks: one Dask
task reads one block. The 1-D arrays are chunked (about a million elements) inside shards (four
chunks) and compressed with lz4 + byte shuffle, a layout measured fast on this stack. The arrays may
be longer than ``indptr[n_rows]`` / ``n_rows + 1``: what lies beyond is an append that was never
committed, and readers ignore it.

Dense matrix (``kind = "dense"``): one 2-D array ``values`` chunked by rows, ``shape`` in the
attributes like above.

Dataset (``kind = "dataset"``): the features ``X`` and labels ``Y`` (binary; stored values 1.0)
as CSR groups with the same ``row_blocks``, the array ``label_counts`` (int64, n_labels: how many
rows carry each label), and in the root attributes the dataset metadata (n_samples, n_features,
n_labels, nnz, nnz_labels, rows_without_labels, sources with their sha256, transforms, times).
The root attributes are the commit point: an append writes X, Y and ``label_counts`` first and
the root attributes last, and readers take the row count from the root.
A dataset with missing labels (root attribute ``observed: true``) also holds the CSR group
``observed`` with the same ``row_blocks``: its non-zeros (stored 1.0) are the observed label
entries, relevant and irrelevant alike; ``Y`` then holds the observed relevant labels only (a
subset of ``observed``) and ``nnz_observed`` counts the observed entries. It is appended with ``X``
and ``Y``, before the root attributes.

Predictions (``kind = "predictions"``): two plain 2-D arrays chunked by rows, ``labels`` (int32,
``(n_samples, top_k)``, best first, ``-1`` padding) and ``scores`` (float32, same shape, ``-inf``
padding); the attributes add ``top_k``, ``n_samples``, ``n_labels``, the model and data URLs and
the throughput of the run (:mod:`.predictions`).

``complete`` is false while a store is being written and set true in the last write. Readers refuse
stores that are not complete. Every store also records, in the root attribute ``xmldask_inventory``
written with its commit, the size of each chunk file readers use; openers refuse a store whose files
do not match (:mod:`.integrity`). New stores are written under a hidden temporary name and moved into
place when complete.
"""

from __future__ import annotations

import numpy as np
from zarr.codecs import BloscCodec, Crc32cCodec

LAYOUT_VERSION = 1
ATTR = "xmldask"

CSR_ENCODING = {"encoding-type": "csr_matrix", "encoding-version": "0.1.0"}
DENSE_ENCODING = {"encoding-type": "array", "encoding-version": "0.2.0"}

DATA_DTYPE = np.dtype("float32")
INDEX_DTYPE = np.dtype("int32")
INDPTR_DTYPE = np.dtype("int64")

#: elements per chunk and per shard of the flat CSR arrays
CHUNK_ELEMENTS = 1 << 20
SHARD_CHUNKS = 4
#: default number of rows in one row block
BLOCK_ROWS = 65_536


def compressors():
    """The codecs after serialisation of every array xmldask writes: LZ4 in Blosc, then a CRC-32C checksum of the
    compressed chunk, checked on every read (:func:`read_checked` names the store, array and chunk of a
    mismatch). Stores written without the checksum keep loading: each array's metadata records its codecs."""
    return [BloscCodec(cname="lz4", clevel=5, shuffle="shuffle"), Crc32cCodec()]


def read_checked(array, key, where: str):
    """``array[key]``, a checksum mismatch raised as a :class:`StoreError` that names the store (``where``), the
    array and the chunks of ``key`` (a slice of a 1-d array, or ``...``)."""
    try:
        return array[key]
    except ValueError as exc:
        if "checksum" not in str(exc):
            raise
        size = array.chunks[0] if array.ndim else 1
        if isinstance(key, slice) and array.ndim == 1:
            start, stop, _ = key.indices(array.shape[0])
            chunks = f"chunks {start // size}..{max(start, stop - 1) // size} (entries {start:,}..{stop:,})"
        else:
            chunks = "a chunk"
        raise StoreError(f"{where}: {array.path} fails its checksum in {chunks}: its bytes changed after they were "
                         "written (a disk or copy fault); restore the store or write it again from its source") \
            from None


class StoreError(ValueError):
    """A store is missing, incomplete, of another kind, or of an unknown layout version."""


def check_kind(attrs: dict, kind: str, url: str) -> dict:
    """Return the ``xmldask`` attributes of a store after checking its kind, version and completeness."""
    meta = attrs.get(ATTR)
    if meta is None:
        raise StoreError(f"{url} is not an xmldask store (no '{ATTR}' attribute)")
    if meta.get("kind") != kind:
        raise StoreError(f"{url} holds a {meta.get('kind')!r} store, expected {kind!r}")
    version = meta.get("layout_version")
    if version != LAYOUT_VERSION:
        raise StoreError(
            f"{url} has layout version {version}; this xmldask reads version {LAYOUT_VERSION}"
        )
    if not meta.get("complete"):
        raise StoreError(
            f"{url} is incomplete: its write was interrupted or is still running. "
            "Write it again (with overwrite) once no writer is running."
        )
    return meta
