"""CSR matrices in Zarr row blocks: a streaming writer and a Dask reader (layout: :mod:`.layout`)."""

from __future__ import annotations

import uuid

import dask
import dask.array as da
import numpy as np
import scipy.sparse as sp
import zarr
from dask.base import tokenize

from . import _fs
from .integrity import commit_attrs, open_root
from .layout import (
    ATTR,
    BLOCK_ROWS,
    CHUNK_ELEMENTS,
    CSR_ENCODING,
    DATA_DTYPE,
    INDEX_DTYPE,
    INDPTR_DTYPE,
    LAYOUT_VERSION,
    SHARD_CHUNKS,
    StoreError,
    compressors,
    read_checked,
)

__all__ = ["CSRWriter", "check_csr_block", "write_csr", "open_csr", "csr_from_group", "to_scipy"]


class _Appender:
    """Appends to a 1-D Zarr array through one fixed buffer, writing whole shards.

    No shard is written twice and no memory is allocated after the buffer (one shard of
    elements), so memory stays flat however long the array grows.
    """

    def __init__(self, array: zarr.Array, start: int):
        self.array = array
        self.pos = int(start)  # where the buffer's first element goes
        self.unit = int((array.shards or array.chunks)[0])
        self.buffer = np.empty(self.unit, dtype=array.dtype)
        self.buffer.fill(0)  # touch every page now: memory use is the same for every matrix size
        self.fill = 0

    def push(self, values: np.ndarray) -> None:
        done = 0
        while done < len(values):
            capacity = self.unit - self.pos % self.unit  # up to the next shard boundary
            take = min(len(values) - done, capacity - self.fill)
            self.buffer[self.fill : self.fill + take] = values[done : done + take]
            self.fill += take
            done += take
            if self.fill == capacity:
                self.flush()

    def flush(self) -> None:
        if self.fill:
            stop = self.pos + self.fill
            self.array.resize((stop,))
            self.array[self.pos : stop] = self.buffer[: self.fill]
            self.pos, self.fill = stop, 0


def _create_1d(group: zarr.Group, name: str, dtype, *, chunk_elements: int, shard_chunks: int) -> zarr.Array:
    return group.create_array(
        name,
        shape=(0,),
        dtype=dtype,
        chunks=(chunk_elements,),
        shards=(chunk_elements * shard_chunks,),
        compressors=compressors(),
        fill_value=0,
    )


class CSRWriter:
    """Write a CSR matrix into a Zarr group one piece of rows at a time.

    Memory stays bounded by one shard per array plus the piece being written, whatever the
    matrix size. Nothing is visible to readers until :meth:`commit`.

    Parameters
    ----------
    group : zarr.Group
        An empty group (new matrix) or a committed CSR group (``append=True``).
    n_cols : int or None
        Number of columns; may be left ``None`` until :meth:`commit`.
    block_rows : int
        Rows per row block of the new rows.
    append : bool
        Continue an existing matrix. Anything beyond its committed end (an append that died
        before committing) is discarded first.
    committed : (row_blocks, nnz), optional
        With ``append``: the committed state to continue from, when another record (a dataset's
        root attributes) is authoritative rather than the group's own attributes.
    """

    def __init__(
        self,
        group: zarr.Group,
        *,
        n_cols: int | None = None,
        block_rows: int = BLOCK_ROWS,
        append: bool = False,
        committed: tuple[list[int], int] | None = None,
        chunk_elements: int = CHUNK_ELEMENTS,
        shard_chunks: int = SHARD_CHUNKS,
    ):
        if block_rows < 1:
            raise ValueError(f"block_rows must be positive, but is {block_rows}")
        self.group = group
        self.block_rows = int(block_rows)
        self.n_cols = n_cols
        if append:
            meta = group.attrs[ATTR]
            row_blocks, nnz0 = committed or (meta["row_blocks"], meta["nnz"])
            self.row_blocks, self.nnz = [int(b) for b in row_blocks], int(nnz0)
            n0, nnz0 = self.row_blocks[-1], self.nnz
            if n_cols is None:
                self.n_cols = int(group.attrs["shape"][1])
            arrays = {name: group[name] for name in ("data", "indices", "indptr")}
            for name, length in (("data", nnz0), ("indices", nnz0), ("indptr", n0 + 1)):
                if arrays[name].shape[0] != length:
                    arrays[name].resize((length,))
        else:
            self.row_blocks, self.nnz = [0], 0
            n0, nnz0 = 0, 0
            group.attrs.update({**CSR_ENCODING, "shape": [0, n_cols or 0], ATTR: self._meta(complete=False)})
            kw = {"chunk_elements": chunk_elements, "shard_chunks": shard_chunks}
            arrays = {
                "data": _create_1d(group, "data", DATA_DTYPE, **kw),
                "indices": _create_1d(group, "indices", INDEX_DTYPE, **kw),
                "indptr": _create_1d(group, "indptr", INDPTR_DTYPE, chunk_elements=max(1, chunk_elements // 4),
                                     shard_chunks=shard_chunks),
            }
            arrays["indptr"].resize((1,))
            arrays["indptr"][0:1] = np.zeros(1, INDPTR_DTYPE)
        self.n_rows_start = n0
        self.n_rows = n0
        self.nnz = nnz0
        self._max_col = -1  # largest column id written since the last commit
        self._data = _Appender(arrays["data"], nnz0)
        self._indices = _Appender(arrays["indices"], nnz0)
        self._indptr = _Appender(arrays["indptr"], n0 + 1)

    def write(self, block: sp.csr_matrix) -> None:
        """Append the rows of ``block`` (any number of rows)."""
        block = sp.csr_matrix(block)
        if self.n_cols is not None and block.shape[1] > self.n_cols:
            raise ValueError(f"block has {block.shape[1]} columns, the matrix {self.n_cols}")
        if not block.has_sorted_indices:  # the layout promises sorted column ids within each row
            block = block.sorted_indices()
        if block.nnz:
            self._max_col = max(self._max_col, int(block.indices.max()))
        self._data.push(block.data.astype(DATA_DTYPE, copy=False))
        self._indices.push(block.indices.astype(INDEX_DTYPE, copy=False))
        self._indptr.push(block.indptr[1:].astype(INDPTR_DTYPE) + self.nnz)
        self.n_rows += block.shape[0]
        self.nnz += int(block.indptr[-1])

    def new_row_blocks(self) -> list[int]:
        """Row-block boundaries after the rows written so far (the committed ones, then new blocks)."""
        start = self.n_rows_start
        bounds = list(range(start + self.block_rows, self.n_rows, self.block_rows))
        tail = [self.n_rows] if self.n_rows > start else []
        return self.row_blocks + bounds + tail

    def flush(self) -> None:
        for appender in (self._data, self._indices, self._indptr):
            appender.flush()

    def commit(self, *, n_cols: int | None = None, row_blocks: list[int] | None = None,
               inventory: str | None = None) -> dict:
        """Flush and publish the new rows to readers; returns the new ``xmldask`` attributes.

        ``inventory``: the URL of the store whose root is this group, to record its chunk inventory
        (:mod:`.integrity`) with the commit; leave it out when another record (a dataset's root) commits.
        """
        self.flush()
        n_cols = self.n_cols if n_cols is None else int(n_cols)
        if n_cols is None:
            raise ValueError("the number of columns is unknown: pass n_cols to commit()")
        if self._max_col >= n_cols:
            raise ValueError(f"column id {self._max_col} is out of range for {n_cols} columns")
        self.n_cols = n_cols
        self._max_col = -1
        self.row_blocks = row_blocks if row_blocks is not None else self.new_row_blocks()
        self.n_rows_start = self.n_rows
        meta = self._meta(complete=True)
        update = {"shape": [self.n_rows, self.n_cols], ATTR: meta}
        if inventory is not None:
            commit_attrs(self.group, inventory, update)
        else:
            self.group.attrs.update(update)
        return meta

    def _meta(self, *, complete: bool) -> dict:
        return {
            "kind": "csr",
            "layout_version": LAYOUT_VERSION,
            "complete": complete,
            "nnz": int(self.nnz),
            "row_blocks": [int(b) for b in self.row_blocks],
            "generation": uuid.uuid4().hex,
        }


def write_csr(url: str, matrix_or_blocks, *, n_cols: int | None = None, block_rows: int = BLOCK_ROWS,
              overwrite: bool = False) -> str:
    """Write a CSR matrix (or an iterable of CSR row pieces) to a new store at ``url``.

    The store appears at ``url`` only once complete; an existing store is replaced only with
    ``overwrite=True``.
    """
    _fs.check_target(url, kind="csr", overwrite=overwrite)
    pieces = [matrix_or_blocks] if sp.issparse(matrix_or_blocks) else matrix_or_blocks
    if sp.issparse(matrix_or_blocks) and n_cols is None:
        n_cols = matrix_or_blocks.shape[1]
    tmp = _fs.temporary_sibling(url)
    try:
        group = zarr.open_group(_fs.zarr_store(tmp), mode="w")
        writer = CSRWriter(group, n_cols=n_cols, block_rows=block_rows)
        for piece in pieces:
            writer.write(piece)
        writer.commit(inventory=tmp)
        _fs.publish(tmp, url, overwrite=overwrite)
    except BaseException:
        _fs.remove(tmp)
        raise
    return url


class CSRBlockReader:
    """Reads row ranges of a CSR group; picklable, opens the store lazily in each process."""

    ndim = 2

    def __init__(self, url: str, path: str, shape: tuple[int, int], dtype=DATA_DTYPE):
        self.url, self.path = str(url), path
        self.shape = tuple(int(s) for s in shape)
        self.dtype = np.dtype(dtype)
        self._arrays = None

    def __getstate__(self):
        return {**self.__dict__, "_arrays": None}

    def _where(self) -> str:
        return f"{self.url}{'/' + self.path if self.path else ''}"

    def _open(self):
        if self._arrays is None:
            root = zarr.open_group(_fs.zarr_store(self.url, read_only=True), mode="r")
            group = root[self.path] if self.path else root
            names = ("data", "indices", "indptr")
            arrays = tuple(group[name] for name in names)
            for name, array, kinds in zip(names, arrays, ("f", "iu", "iu")):
                if array.dtype.kind not in kinds or array.ndim != 1:
                    raise StoreError(f"{self._where()}: {name} is {array.ndim}-d {array.dtype}, not the 1-d "
                                     f"{'float' if kinds == 'f' else 'integer'} array a CSR store holds: its "
                                     "metadata was changed after it was written; "
                                     "ingest the dataset again from its source")
            self._arrays = arrays
        return self._arrays

    def read_rows(self, start: int, stop: int) -> sp.csr_matrix:
        """Rows ``start:stop`` as a ``csr_matrix``, reading only their part of the store, after checking what
        they hold (:func:`check_csr_block`)."""
        data, indices, indptr = self._open()
        where = self.url  # the arrays' paths name the group
        ptr = read_checked(indptr, slice(start, stop + 1), where) if stop > start else np.zeros(1, INDPTR_DTYPE)
        lo, hi = int(ptr[0]), int(ptr[-1])
        if lo < 0 or hi < lo or hi > data.shape[0] or hi > indices.shape[0]:
            raise self._damaged(start, stop, f"row pointers {lo}..{hi} outside the {data.shape[0]:,} stored entries")
        ids = read_checked(indices, slice(lo, hi), where)
        problem = check_csr_block(ptr, ids, self.shape[1])
        if problem:
            raise self._damaged(start, stop, problem)
        values = read_checked(data, slice(lo, hi), where).astype(self.dtype, copy=False)
        return sp.csr_matrix((values, ids, ptr - lo), shape=(stop - start, self.shape[1]))

    def _damaged(self, start: int, stop: int, problem: str) -> StoreError:
        return StoreError(f"{self._where()} is damaged in rows {start:,}..{stop:,}: {problem}; ingest the dataset "
                          "again from its source")

    def __getitem__(self, key):
        rows, cols = (key + (slice(None),))[:2] if isinstance(key, tuple) else (key, slice(None))
        start, stop, step = rows.indices(self.shape[0])
        block = self.read_rows(start, max(start, stop))
        if step != 1:
            block = block[::step]
        if cols != slice(None) and cols != slice(0, self.shape[1], None):
            block = block[:, cols]
        return block


def check_csr_block(indptr: np.ndarray, indices: np.ndarray, n_cols: int) -> str:
    """What is wrong with a CSR row block's stored row pointers and column ids (``""``: nothing): the pointers
    must not decrease, and every id must lie in ``[0, n_cols)``. One pass over the ids (their minimum and
    maximum), far cheaper than their decompression; SciPy checks neither, and a wrong id is a wrong score or a
    crash in its C++ kernels."""
    steps = np.diff(indptr)
    if steps.size and steps.min() < 0:
        row = int(np.argmax(steps < 0))
        return f"the row pointers decrease at row {row} of the block ({int(indptr[row])} -> {int(indptr[row + 1])})"
    if indices.size:
        low, high = int(indices.min()), int(indices.max())
        if low < 0 or high >= n_cols:
            bad = low if low < 0 else high
            return f"column id {bad:,} outside the {n_cols:,} columns recorded"
    return ""


def block_reader(x) -> CSRBlockReader | None:
    """The store reader behind a Dask array returned by :func:`open_csr` / ``open_dataset`` (unchanged
    since), or ``None``. ``reader.read_rows(a, b)`` gives the rows of a block, so a pass may read a
    block inside the task that uses it instead of in a task of its own.

    The reader is the one the array's own graph holds (``da.from_array`` keeps it under
    ``original-<name>``): nothing is registered outside the graph, and an array derived from the
    store's (sliced, rechunked, computed on) has another name and no reader.
    """
    name = getattr(x, "name", None)
    graph = getattr(x, "dask", None)
    if not isinstance(name, str) or not name.startswith("csr-") or graph is None:
        return None
    layer = getattr(graph, "layers", {}).get(f"original-{name}")
    reader = None if layer is None else dict(layer).get(f"original-{name}")
    return reader if isinstance(reader, CSRBlockReader) else None


def csr_from_group(url: str, path: str, *, n_rows: int, n_cols: int, row_blocks: list[int],
                   generation: str, dtype=DATA_DTYPE) -> da.Array:
    """Dask array of ``csr_matrix`` row blocks for the CSR group ``path`` inside the store ``url``."""
    chunks = (tuple(int(b - a) for a, b in zip(row_blocks[:-1], row_blocks[1:])) or (0,), (int(n_cols),))
    reader = CSRBlockReader(url, path, (n_rows, n_cols), dtype)
    name = f"csr-{tokenize(str(url), path, generation, row_blocks, str(np.dtype(dtype)))}"
    return da.from_array(
        reader,
        chunks=chunks,
        name=name,
        asarray=False,
        fancy=False,
        meta=sp.csr_matrix((0, int(n_cols)), dtype=dtype),
    )


def open_csr(url: str, *, dtype=DATA_DTYPE) -> da.Array:
    """Open a CSR matrix store as a Dask array whose chunks are ``scipy.sparse.csr_matrix`` row blocks.

    Each task reads only its own row block. Pass ``dtype=np.float64`` to compute in double precision.
    """
    group, meta = open_root(url, "csr")
    n_rows, n_cols = group.attrs["shape"]
    return csr_from_group(url, "", n_rows=n_rows, n_cols=n_cols, row_blocks=meta["row_blocks"],
                          generation=meta["generation"], dtype=dtype)


def to_scipy(x: da.Array) -> sp.csr_matrix:
    """Compute a Dask array of CSR row blocks into one in-memory ``csr_matrix`` (small data only)."""
    blocks = [x.blocks[i] for i in range(x.numblocks[0])]
    parts = dask.compute(*blocks)
    if not parts:
        return sp.csr_matrix(x.shape, dtype=x.dtype)
    return sp.vstack(parts, format="csr")
