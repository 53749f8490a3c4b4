"""Passes over row-chunked Dask arrays: ``X Q``, ``X^T B``, ``X^T (X Q)``, ``Y^T (X Z)``, ``X^T X``, column moments.

Every pass is one ``blockwise`` task per row block, which applies a kernel of
:mod:`xmldask.linalg._kernels` to that block and returns a small dense result, followed by a sum of
those results: a running sum per task the scheduler runs at once, then a tree of those sums (at most
``split_every`` inputs per task; :func:`block_sum`). No task ever holds more than one row block of
``X`` (and of ``Y`` or ``B``), and a worker holds one running sum however many blocks there are, so a
pass runs over stores larger than memory in memory that does not grow with them.

Dask's own ``da.dot`` / ``@`` / ``.sum(axis)`` are not used on the sparse blocks: they either fail on
``scipy.sparse`` chunks (``np.matmul`` rejects them; ``keepdims``, dask#11880) or gather every partial
product into one task that loads every block (dask#6916).

Small dense operands (``Q``, ``Z``, a mean vector) are shipped once per pass as a single-chunk Dask
array on which every block task depends, never copied into each task: an in-memory operand is
embedded in the graph once, or, when a ``distributed`` client is the current scheduler and the
operand is at least :data:`SCATTER_BYTES`, scattered to every worker once (no "large graph" warning; a
worker lost mid-pass loses no operand).
Use :func:`dense_operand` to ship an operand once for several passes.

Inputs must be chunked by rows only (one chunk along the columns) with known chunk sizes, like
the arrays returned by :func:`xmldask.store.open_csr` and :func:`xmldask.store.open_dataset`. All
results are lazy Dask arrays; compute several with one ``dask.compute(...)`` to share work.

Centring (``center=``) never densifies ``X``:

- ``center=True`` centres ``X`` by its (weighted) column mean in the same single pass: each block
  also returns the sums ``X_b^T w``, ``w^T R_b`` and ``1^T w`` needed to correct the product at the
  end (:func:`xmldask.linalg._kernels.unpack_centered`);
- ``center=mu`` (an array of shape ``(n_features,)``) subtracts the given means implicitly inside
  each block. Numerically this is preferable when columns have a mean that is large compared to
  their spread (in float32 the one-pass correction then cancels many digits). Pass a computed
  (NumPy or persisted) ``mu``: a lazy ``mu`` that depends on ``X`` makes Dask keep every block of
  ``X`` in memory until the mean is known.

Sample weights ``weights`` (shape ``(n_samples,)``) multiply the rows: ``X^T diag(w) ...``.

Examples
--------
>>> import dask.array as da, numpy as np, scipy.sparse as sp
>>> from xmldask.linalg import xt_x_q
>>> A = sp.random(1000, 50, density=0.1, format="csr", dtype=np.float32, random_state=0)
>>> X = da.from_array(A, chunks=(300, -1), asarray=False)
>>> Q = np.ones((50, 4), dtype=np.float32)
>>> G = xt_x_q(X, Q).compute()
>>> G.shape, G.dtype
((50, 4), dtype('float32'))
>>> bool(np.allclose(G, A.T @ (A @ Q), rtol=1e-5))
True
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import math
import numbers
import uuid

import dask
import dask.array as da
import numpy as np
import scipy.sparse as sp
from dask.highlevelgraph import HighLevelGraph

from ..scheduling import current_client, parallelism
from ..store.csr import block_reader
from . import _kernels as K
from ._kernels import working_dtype

__all__ = [
    "ROWS",
    "SCATTER_BYTES",
    "WHOLE",
    "block_sum",
    "check_rows_operand",
    "check_x",
    "column_mean",
    "column_moments",
    "compute_each",
    "column_sums",
    "dense_operand",
    "gram",
    "per_block",
    "per_block_objects",
    "row_gram",
    "spread_rows",
    "tree_combine",
    "whole_operand",
    "x_q",
    "xt_b",
    "xt_x_q",
    "yt_x_z",
]

logger = logging.getLogger(__name__)

#: In-memory operands at least this large are scattered once to a current ``distributed`` client
#: instead of being embedded in the task graph.
SCATTER_BYTES = 1 << 20

#: :func:`gram` refuses results larger than this (its per-block results are dense ``d x d``).
GRAM_MAX_BYTES = 1 << 30

#: how :func:`per_block` hands an operand to each task: its row block (``ROWS``) or the whole of it (``WHOLE``)
ROWS, WHOLE = "rows", "whole"


# --------------------------------------------------------------------------------------------
# shipping operands


def _scatter_target(nbytes: int):
    return current_client() if nbytes >= SCATTER_BYTES else None


def dense_operand(A, *, name: str = "operand", nbytes: int | None = None, token: str | None = None) -> da.Array:
    """A small dense operand as a single-chunk Dask array, to be shipped once per graph.

    Parameters
    ----------
    A : array_like or dask.array.Array
        The operand, for example ``Q`` of shape ``(n_features, k)``.
    name : str
        Name used in error messages.
    nbytes : int, optional
        The operand's size when ``A.nbytes`` does not tell it (a 0-d object array holding a sparse
        matrix, which a kernel unwraps).
    token : str, optional
        A token of the operand's content where Dask's of ``A`` would not tell it (Dask tokenizes an object
        array by its objects' repr: two sparse matrices of one shape and number of entries would share a key).

    Returns
    -------
    dask.array.Array
        One chunk. A Dask array with several chunks is rechunked to one; an in-memory array is
        scattered once to the current ``distributed`` client when it is at least
        :data:`SCATTER_BYTES`, and embedded once in the graph otherwise.
    """
    if isinstance(A, da.Array):
        if any(math.isnan(c) for dim in A.chunks for c in dim):
            raise ValueError(f"{name} has unknown chunk sizes; compute them first: "
                             f"{name} = {name}.compute_chunk_sizes()")
        return A if math.prod(A.numblocks) == 1 else A.rechunk(A.shape)
    if sp.issparse(A):
        raise TypeError(f"{name} must be dense, but is a {type(A).__name__}; pass {name}.toarray()")
    A = np.asarray(A)
    nbytes = A.nbytes if nbytes is None else nbytes
    client = _scatter_target(nbytes)
    if client is not None:
        logger.debug("scattering %s (%d bytes) to %s", name, nbytes, client)
        # on every worker: each block task reads it anyway, and a worker that dies (or is restarted for
        # its memory) then loses no data the graph cannot get again (a future scattered to one worker only
        # is lost with it, and the whole computation fails)
        # under the key of the array's one chunk: ``da.from_delayed(future)`` would add a task aliasing it,
        # computed on one worker, and every task needing the operand would then be placed on that worker.
        # A new key each time: a key named by the operand's value would be shared by two graphs shipping the
        # same values, and the first one's release would take it from under the second ("lost dependencies")
        array_name = f"operand-{uuid.uuid4().hex}"
        key = (array_name,) + (0,) * A.ndim
        (future,) = client.scatter({key: A}, hash=False, broadcast=True).values()
        graph = HighLevelGraph.from_collections(array_name, {key: future}, dependencies=())
        return da.Array(graph, array_name, tuple((n,) for n in A.shape), dtype=A.dtype,
                        meta=np.empty((0,) * A.ndim, A.dtype))
    return da.from_array(A, chunks=A.shape, name=None if token is None else f"operand-{token}")


def whole_operand(A, *, name: str = "operand") -> da.Array:
    """:func:`dense_operand` for an array, a SciPy sparse matrix or a dataclass of arrays with their ``nbytes`` (a
    kernel's own layout, never changed once made: its token is computed once, kept on it): the last two travel in a
    0-d object array (scattered by the size of their arrays), which the kernel unwraps (``A.item()``)."""
    if sp.issparse(A):
        A = sp.csr_matrix(A)
        nbytes, token = A.data.nbytes + A.indices.nbytes + A.indptr.nbytes, (A.shape, A.data, A.indices, A.indptr)
    elif dataclasses.is_dataclass(A) and not isinstance(A, type):  # immutable: tokenized once (0.3 s a GB)
        nbytes = int(A.nbytes)
        if "_operand_token" not in A.__dict__:
            object.__setattr__(A, "_operand_token", dask.base.tokenize(
                type(A).__name__, *(getattr(A, field.name) for field in dataclasses.fields(A))))
        token = (A.__dict__["_operand_token"],)
    else:
        return dense_operand(A, name=name)
    holder = np.empty((), dtype=object)
    holder[()] = A
    return dense_operand(holder, name=name, nbytes=nbytes, token=dask.base.tokenize(*token))


def spread_rows(X: da.Array, parts: int, min_rows: int) -> da.Array:
    """``X`` with its row blocks cut into pieces of about equal rows, so that it has at least ``parts`` blocks
    (the tasks a scheduler runs at once) where its blocks have the rows: a block is cut into at most ``rows //
    min_rows`` pieces. A kernel that takes a row block whole, and all of a model beside it, then keeps every
    thread busy on a few large blocks (a store's one block of 20,000 test rows used one of two). The cuts are
    Dask's row slices of the blocks (SciPy sparse blocks slice as dense ones); ``X`` is returned as it is where no
    block is cut."""
    blocks = X.chunks[0]
    if len(blocks) >= parts:
        return X
    each = math.ceil(parts / len(blocks))
    chunks = []
    for rows in blocks:
        n = max(1, min(each, rows // max(min_rows, 1)))
        chunks += [rows // n + (i < rows % n) for i in range(n)]
    return X if len(chunks) == len(blocks) else X.rechunk({0: tuple(chunks)})


def _rows_from_memory(A: np.ndarray, row_chunks: tuple[int, ...]) -> da.Array:
    """An in-memory row operand (weights, B) chunked like ``X``; scattered by block when large."""
    chunks = (row_chunks,) + tuple((s,) for s in A.shape[1:])
    client = _scatter_target(A.nbytes)
    if client is None:
        return da.from_array(A, chunks=chunks)
    bounds = np.cumsum((0,) + tuple(row_chunks))
    pieces = [A[a:b] for a, b in zip(bounds[:-1], bounds[1:])]
    futures = client.scatter(pieces, hash=False)
    meta = np.empty((0,) * A.ndim, A.dtype)
    try:
        blocks = [da.from_delayed(f, shape=p.shape, dtype=A.dtype, meta=meta) for f, p in zip(futures, pieces)]
    except NotImplementedError:  # dask's array-expression engine has no from_delayed (yet): embed
        return da.from_array(A, chunks=chunks)
    return da.concatenate(blocks, axis=0)


# --------------------------------------------------------------------------------------------
# validation


def _fmt_chunks(chunks: tuple) -> str:
    shown = ", ".join(str(c) for c in chunks[:4])
    if len(chunks) > 5:
        shown += f", ..., {chunks[-1]}"
    elif len(chunks) == 5:
        shown += f", {chunks[-1]}"
    return f"({shown})"


def check_x(X, name: str = "X") -> da.Array:
    if not isinstance(X, da.Array):
        raise TypeError(
            f"{name} must be a dask array of row blocks (for example xmldask.store.open_csr(url) or "
            f"open_dataset(url).X), but is a {type(X).__name__}; wrap an in-memory matrix A with "
            f"da.from_array(A, chunks=(block_rows, -1), asarray=False)"
        )
    if X.ndim != 2:
        raise ValueError(f"{name} must be 2-D (n_samples, n_columns), but has shape {X.shape}")
    if any(math.isnan(c) for c in X.chunks[0]):
        raise ValueError(
            f"{name} has unknown row-chunk sizes; compute them first: {name} = {name}.compute_chunk_sizes()"
        )
    if len(X.chunks[1]) != 1:
        raise ValueError(
            f"{name} must be chunked by rows only (one chunk along its {X.shape[1]} columns), but has "
            f"{len(X.chunks[1])} column chunks {_fmt_chunks(X.chunks[1])}; fix: {name} = {name}.rechunk({{1: -1}})"
        )
    return X


def _check_same_rows(X: da.Array, A: da.Array, name: str, fix: str) -> None:
    if A.shape[0] != X.shape[0]:
        raise ValueError(f"{name} has {A.shape[0]} rows but X has {X.shape[0]}; they must hold the same samples")
    if tuple(A.chunks[0]) != tuple(X.chunks[0]):
        raise ValueError(
            f"{name}'s row blocks must be X's: X has {len(X.chunks[0])} row blocks {_fmt_chunks(X.chunks[0])}, "
            f"{name} has {len(A.chunks[0])} {_fmt_chunks(A.chunks[0])}; fix: {fix}"
        )


def check_rows_operand(A, X: da.Array, name: str) -> da.Array:
    """A row-chunked operand (``Y``, ``B``) aligned with ``X``: 2-D, one column chunk, same row blocks."""
    if not isinstance(A, da.Array):
        if A is None or (not sp.issparse(A) and np.ndim(A) != 2):
            raise ValueError(f"{name} must be a 2-D array with {X.shape[0]} rows")
        A = A if sp.issparse(A) else np.asarray(A)
        if A.shape[0] != X.shape[0]:
            raise ValueError(f"{name} has {A.shape[0]} rows but X has {X.shape[0]}; they must hold the same samples")
        if sp.issparse(A):
            A = da.from_array(sp.csr_matrix(A), chunks=(X.chunks[0], -1), asarray=False, fancy=False)
        else:
            A = _rows_from_memory(A, X.chunks[0])
    if A.ndim != 2:
        raise ValueError(f"{name} must be 2-D ({X.shape[0]} rows, n_columns), but has shape {A.shape}")
    if any(math.isnan(c) for c in A.chunks[0]):
        raise ValueError(f"{name} has unknown row-chunk sizes; fix: {name} = {name}.compute_chunk_sizes()")
    if len(A.chunks[1]) != 1:
        raise ValueError(
            f"{name} must be chunked by rows only (one chunk along its {A.shape[1]} columns), but has "
            f"{len(A.chunks[1])} column chunks; fix: {name} = {name}.rechunk({{1: -1}})"
        )
    _check_same_rows(X, A, name, f"{name} = {name}.rechunk({{0: X.chunks[0]}}) (or open both from one dataset store)")
    return A


def _as_weights(weights, X: da.Array) -> da.Array | None:
    if weights is None:
        return None
    if isinstance(weights, da.Array):
        if weights.ndim != 1:
            raise ValueError(f"weights must be 1-D with {X.shape[0]} entries, but has shape {weights.shape}")
        _check_same_rows(X, weights, "weights", "weights = weights.rechunk((X.chunks[0],))")
        return weights
    w = np.asarray(weights)
    if w.shape != (X.shape[0],):
        raise ValueError(f"weights must have shape ({X.shape[0]},), one per row of X, but has shape {w.shape}")
    if not np.issubdtype(w.dtype, np.number) or not np.all(np.isfinite(w)) or np.any(w < 0):
        raise ValueError("weights must be finite and non-negative numbers")
    return _rows_from_memory(w, X.chunks[0])


def _as_matrix(Q, n_rows: int, name: str, rows_of: str) -> tuple[da.Array, bool]:
    """A dense operand of ``n_rows`` rows as a single-chunk 2-D Dask array; also whether it was 1-D."""
    ndim = Q.ndim if isinstance(Q, da.Array) else np.ndim(Q)
    if ndim not in (1, 2):
        raise ValueError(f"{name} must be 1-D or 2-D ({n_rows}, k), but has {ndim} dimensions")
    shape = Q.shape if isinstance(Q, da.Array) or sp.issparse(Q) else np.shape(Q)
    if shape[0] != n_rows:
        raise ValueError(f"{name} must have {n_rows} rows (one per {rows_of}), but has shape {tuple(shape)}")
    Qd = dense_operand(Q, name=name)
    return (Qd[:, None], True) if ndim == 1 else (Qd, False)


def _as_center(center, X: da.Array):
    """``None`` (no centring), ``True`` (own mean, one pass) or a single-chunk mean vector."""
    if center is None or (isinstance(center, (bool, np.bool_)) and not center):
        return None
    if isinstance(center, (bool, np.bool_)):
        return True
    shape = center.shape if isinstance(center, da.Array) else np.shape(center)
    if tuple(shape) != (X.shape[1],):
        raise ValueError(
            f"center must be True, False or the column means of X, shape ({X.shape[1]},), but has shape {tuple(shape)}"
        )
    return dense_operand(center, name="center")


def _check_split_every(split_every) -> int:
    if not isinstance(split_every, numbers.Integral) or split_every < 2:
        raise ValueError(f"split_every must be an integer of at least 2, but is {split_every!r}")
    return int(split_every)


# --------------------------------------------------------------------------------------------
# graph building


def _apply(*args, _func, _names, _stack, _static, _readers=None):
    """Call a kernel on one row block's operands (blockwise passes contracted axes as 1-item lists).

    An operand in ``_readers`` arrives as its block's row bounds and is read here, in this task.
    """
    kwargs = dict(_static)
    for name, value in zip(_names, args):
        while isinstance(value, list):
            if len(value) != 1:
                raise RuntimeError(f"expected one chunk of {name}, got {len(value)}")
            value = value[0]
        if _readers and name in _readers:
            start, stop = (int(v) for v in np.asarray(value).ravel())
            value = _readers[name].read_rows(start, stop)
        kwargs[name] = value
    out = _func(**kwargs)
    return out[None] if _stack else out


def per_block(func, operands, *, tail: tuple[int, ...], dtype, token: str, stack: bool = True,
               static: dict | None = None) -> da.Array:
    """One task per row block: ``func(**{name: block})``.

    ``operands`` is a list of ``(name, array, kind)``: ``kind`` ``"rows"`` for arrays chunked like
    ``X`` (block ``i`` goes to task ``i``), ``"whole"`` for single-chunk operands (the same chunk to
    every task); ``None`` arrays are left out (the kernel's default applies). ``static`` holds small
    literal keyword arguments for the kernel. With ``stack`` the result has shape
    ``(n_blocks, *tail)``, one slice per block; otherwise ``(n_samples, *tail)`` chunked like ``X``.
    """
    args, names, readers, row_chunks = [], [], {}, None
    for j, (name, value, kind) in enumerate(operands):
        if value is None:
            continue
        reader = block_reader(value) if kind == ROWS else None
        if kind == ROWS:
            row_chunks = tuple(value.chunks[0])
        if reader is not None:
            # a store-backed operand: its blocks are read inside the kernel's task (no task of their
            # own, no intermediate result to hold), from the block bounds
            bounds = np.cumsum((0,) + tuple(value.chunks[0]))
            pairs = np.stack([bounds[:-1], bounds[1:]], axis=1)
            value, readers[name] = da.from_array(pairs, chunks=(1, 2)), reader
        dims = tuple(f"{name}{j}_{m}" for m in range(value.ndim))
        args += [value, ("i",) + dims[1:] if kind == ROWS else dims]
        names.append(name)
    out_ind = ("i",) + tuple(f"out_{m}" for m in range(len(tail)))
    return da.blockwise(
        _apply,
        out_ind,
        *args,
        _func=func,
        _names=tuple(names),
        _stack=stack,
        _static=dict(static or {}),
        _readers=readers or None,
        token=token,
        dtype=dtype,
        new_axes={f"out_{m}": size for m, size in enumerate(tail)},
        adjust_chunks={"i": 1} if stack else ({"i": row_chunks} if readers else None),
        concatenate=False,
        align_arrays=False,
        meta=np.empty((0,) * len(out_ind), dtype=dtype),
    )


def _flat(parts) -> list:
    if not isinstance(parts, list):
        return [parts]
    return [leaf for part in parts for leaf in _flat(part)]


def _sum_chunk(x, axis=None, keepdims=True):
    return x  # the block results already have their reduction axis of length 1


def _sum_combine(parts, axis=None, keepdims=True):
    """Sum block results in place into one new array: no concatenation of the inputs."""
    parts = _flat(parts)
    out = np.array(parts[0], copy=True)
    for part in parts[1:]:
        out += part
    return out


def _sum_aggregate(parts, axis=None, keepdims=False):
    out = _sum_combine(parts)
    return out if keepdims else out[0]


#: most bytes of block results one task of a tree sum takes as inputs: a large result (``X^T X Q``
#: with many features) is summed fewer at a time, so that a worker never holds many of them at once
REDUCE_BYTES = 32 * 2**20


def reduce_split_every(split_every: int, result_bytes: int) -> int:
    """``split_every`` lowered so that one combine task takes at most :data:`REDUCE_BYTES` of inputs
    (never below 2)."""
    return max(2, min(int(split_every), REDUCE_BYTES // max(int(result_bytes), 1)))


def _chain_apply(total, *args, **kwargs):
    """One step of a chain of :func:`block_sum`: the running sum plus one block's kernel result, in one task.

    The sum is written into the kernel's result when that is an array the kernel made (it owns its
    memory and is none of the task's inputs): a step then holds two arrays of the sum's size, not three.
    The running sum it is given is never changed (a task may run again)."""
    out = _apply(*args, **kwargs)
    if total is None:
        return out
    made = out if out.base is None else out.base
    if (made.flags.owndata and made.flags.writeable and out.dtype == total.dtype and out.shape == total.shape
            and not any(made is arg for arg in (*args, *kwargs["_static"].values()))):
        out += total
        return out
    return total + out


def _chains(n_blocks: int) -> int:
    """Running sums for a sum over ``n_blocks`` block results: one per task the scheduler runs at once; none
    (0) when that is every block, so that the blocks meet in the tree directly."""
    chains = min(n_blocks, parallelism())
    return chains if n_blocks > chains > 0 else 0


def _sum_name(parts: da.Array) -> tuple[str, str]:
    """The sum's name (``xt_x_q-block-<token>`` -> ``xt_x_q-sum``) and the block results' token."""
    prefix, token = parts.name.rsplit("-", 1)
    return f"{prefix.removesuffix('-block')}-sum", token


def _chain_sums(steps, parts: da.Array) -> da.Array:
    """The running sums ``steps`` (delayed, one per chain) as an array stacked like ``parts``."""
    meta = np.empty((0,) * parts.ndim, dtype=parts.dtype)
    sums = [da.from_delayed(total, shape=(1,) + parts.shape[1:], dtype=parts.dtype, meta=meta) for total in steps]
    return da.concatenate(sums, axis=0)


def _tree(parts: da.Array, split_every: int, name: str) -> da.Array:
    """The tree sum over axis 0 of stacked results, at most ``split_every`` inputs a task (fewer for large
    results: :func:`reduce_split_every`), each task adding its inputs in place rather than concatenating
    them (measured here: 0.04 s instead of 0.3-1 s for 16 results of 12.8 MB)."""
    result_bytes = int(np.prod(parts.shape[1:], dtype=np.int64)) * parts.dtype.itemsize
    return da.reduction(
        parts,
        _sum_chunk,
        _sum_aggregate,
        combine=_sum_combine,
        axis=0,
        concatenate=False,
        split_every=reduce_split_every(split_every, result_bytes),
        dtype=parts.dtype,
        meta=np.empty((0,) * (parts.ndim - 1), dtype=parts.dtype),
        name=name,
    )


def block_sum(func, operands, *, tail: tuple[int, ...], dtype, token: str, static: dict | None = None,
              split_every: int = 8) -> da.Array:
    """The sum over the row blocks of ``func(**{name: block})`` (arguments as for :func:`per_block`), shape
    ``tail``.

    Block ``i`` is computed *in* a step of running sum ``i mod c`` (``c`` = the tasks the scheduler runs
    at once, at most the number of blocks): the task that computes a block's result adds it to its chain's
    previous sum, so the scheduler runs each chain on the worker that holds its sum, and no block result
    waits in memory or travels to another worker. A worker thus holds its running sum and the block it is
    computing, however many blocks the pass has (a tree over the blocks held up to ``log(n_blocks)``
    partial sums a worker: peak memory grew with ``n``; block results computed in tasks of their own moved
    between workers about every other step). Only the ``c`` sums meet in a tree of at most
    ``split_every`` inputs a task (:func:`_tree`). With as many tasks at once as blocks, this is a tree
    over the blocks' results.

    A row operand read from a store (:func:`xmldask.store.csr.block_reader`) is read in the step's task; a
    computed one (a persisted state, a lazy product) is an input of the step, so the scheduler runs the step
    where the larger of its block and the running sum is and moves the smaller. (Computing such blocks'
    results in tasks of their own let them pile up, ready, ahead of the sequential steps: a tree level's
    sums of 122 blocks restarted workers of 256 MiB, where 7 blocks peaked at 214 MiB.)

    The order of the additions depends on ``c``, so a cluster of another size rounds differently (in
    the last bits of float32).
    """
    parts = per_block(func, operands, tail=tail, dtype=dtype, token=token, static=static)
    name, key_token = _sum_name(parts)
    n_blocks = parts.shape[0]
    chains = _chains(n_blocks)
    if not chains:
        return _tree(parts, split_every, name)
    names, columns, readers = [], [], {}
    for name_, value, kind in operands:
        if value is None:
            continue
        reader = block_reader(value) if kind == ROWS else None
        if reader is not None:
            readers[name_] = reader
            bounds = np.cumsum((0,) + tuple(value.chunks[0])).tolist()  # read in the step's task
            column = list(zip(bounds[:-1], bounds[1:]))
        elif kind == ROWS:  # a computed operand: its block is an input of the step
            column = list(value.to_delayed(optimize_graph=False).reshape(n_blocks))
        else:
            (whole,) = dense_operand(value, name=name_).to_delayed(optimize_graph=False).ravel()
            column = [whole] * n_blocks
        names.append(name_)
        columns.append(column)
    kwargs = dict(_func=func, _names=tuple(names), _stack=True, _static=dict(static or {}), _readers=readers)
    steps = []
    for c in range(chains):
        total = None
        for j, i in enumerate(range(c, n_blocks, chains)):
            total = dask.delayed(_chain_apply)(total, *(column[i] for column in columns),
                                               dask_key_name=f"{name}-chain-{key_token}-{c}-{j}", **kwargs)
        steps.append(total)
    return _tree(_chain_sums(steps, parts), split_every, name)


def per_block_objects(func, *arrays: da.Array, **static) -> list:
    """One delayed ``func(block_i of each array, block=i, **static)`` per row block (``static`` may hold
    delayed objects, passed whole): for block results that are not arrays (held-out rows, checks, partial
    sums of several kinds), gathered by ``dask.compute`` or combined by :func:`tree_combine`.

    A Dask array in ``static`` is passed as a delayed object of the whole: Dask 2026.8's delayed calls give keyword
    arguments the wrong values where arrays and delayed objects alternate among them (``p=delayed, q=array,
    r=delayed`` computes ``q`` as ``r``'s value and ``r`` as ``q``'s)."""
    parts = [a.to_delayed().ravel() for a in arrays]
    static = {name: dask.delayed(value) if isinstance(value, da.Array) else value for name, value in static.items()}
    return [dask.delayed(func)(*blocks, block=i, **static) for i, blocks in enumerate(zip(*parts))]


def tree_combine(parts: list, combine):
    """The delayed ``combine(a, b)`` of all ``parts``, pairwise as a binary tree: ``log2(len(parts))``
    levels, no task holds more than two results (the tree of :func:`block_sum` for results that are
    not arrays)."""
    if not parts:
        raise ValueError("tree_combine needs at least one part")
    while len(parts) > 1:
        parts = [dask.delayed(combine)(*parts[i:i + 2]) if i + 1 < len(parts) else parts[i]
                 for i in range(0, len(parts), 2)]
    return parts[0]


def compute_each(parts: list, each=None) -> list:
    """The values of the delayed ``parts``, ``each(i, value)`` of them if given: with a ``distributed`` client each
    is gathered as soon as it is computed, released on the workers and passed to ``each`` (results that together
    exceed the workers' memory never wait there for the last one); otherwise ``dask.compute``. A cancelled part
    raises ``CancelledError``, naming the workers that left the cluster meanwhile (a restart for memory loses the
    data scattered to the worker); inside :func:`xmldask.cluster.cluster` that becomes a
    :class:`~xmldask.cluster.WorkerLost` with their memory and what to change."""
    each = each or (lambda i, value: value)
    client = current_client()
    if client is None:
        return [each(i, value) for i, value in enumerate(dask.compute(*parts))]
    from concurrent.futures import CancelledError

    from distributed import as_completed

    workers = set(client.scheduler_info(n_workers=-1).get("workers", {}))
    futures = client.compute(list(parts))
    position = {id(future): i for i, future in enumerate(futures)}
    out = [None] * len(futures)
    for future, value in as_completed(futures, with_results=True):
        if isinstance(value, CancelledError):  # as_completed yields a cancelled future's error as its value
            lost = sorted(workers - set(client.scheduler_info(n_workers=-1).get("workers", {})))
            raise CancelledError(f"part {position[id(future)]} of {len(futures)} was cancelled ({value})" + (
                f": worker(s) {', '.join(lost)} left the cluster while the job ran, and with them data that "
                "cannot be computed again" if lost else ""))
        i = position[id(future)]
        future.release()
        out[i] = each(i, value)
    return out


def _finish_centered(total: da.Array, dtype) -> da.Array:
    p, q = total.shape[0] - 1, total.shape[1] - 1
    return total.map_blocks(K.unpack_centered, chunks=((p,), (q,)), dtype=dtype, meta=np.empty((0, 0), dtype))


def _product_pass(mu, kernels: tuple, operands: list, tail: tuple[int, int], dtype, token: str,
                  split_every: int, static: dict | None = None) -> da.Array:
    """One pass of a product with ``X`` centred or not: ``mu is True`` runs the augmented kernel (``X``'s
    weighted column sums carried along, the correction applied at the end); otherwise the plain kernel,
    with the given column means ``mu`` (or ``None``) subtracted inside each block."""
    augmented, plain = kernels
    if mu is True:
        total = block_sum(augmented, operands, tail=(tail[0] + 1, tail[1] + 1), dtype=dtype, token=token,
                          static=static, split_every=split_every)
        return _finish_centered(total, dtype)
    return block_sum(plain, operands + [("center", mu, WHOLE)], tail=tail, dtype=dtype, token=token, static=static,
                     split_every=split_every)


# --------------------------------------------------------------------------------------------
# passes


def xt_x_q(X, Q, *, weights=None, center=False, split_every: int = 8) -> da.Array:
    """Fused ``X^T diag(w) (X Q)`` in one pass over the row blocks.

    Parameters
    ----------
    X : dask.array.Array, shape (n_samples, n_features)
        Row blocks (``scipy.sparse`` or dense), one column chunk, known chunk sizes.
    Q : array_like or dask.array.Array, shape (n_features, k) or (n_features,)
        Dense operand, shipped once.
    weights : array_like or dask.array.Array of shape (n_samples,), optional
        Sample weights (non-negative); a Dask array must have ``X``'s row chunks.
    center : bool or array_like of shape (n_features,), default False
        ``True``: use ``Xc = X - 1 mu^T`` with ``mu`` the (weighted) column mean, in the same pass
        (the product is corrected at the end, which loses digits in float32 when a column's mean
        dwarfs its spread: measured 10% error for mean 1000, spread 1). An array: the column means
        to subtract inside each block (2e-5 error in the same case); compute it first with
        :func:`column_mean`.
    split_every : int, default 8
        Most block results summed by one task of the tree reduction.

    Returns
    -------
    dask.array.Array, shape (n_features, k) or (n_features,)
        ``Xc^T W Xc Q`` (``Xc = X`` without centring), one chunk, in the working dtype of ``X`` and
        ``Q`` (float32 for float32 inputs).
    """
    X = check_x(X)
    split_every = _check_split_every(split_every)
    Qd, vector = _as_matrix(Q, X.shape[1], "Q", "column of X")
    w = _as_weights(weights, X)
    mu = _as_center(center, X)
    dtype = working_dtype(X.dtype, Qd.dtype)
    out = _product_pass(mu, (K._augmented_gram_apply, K.block_gram_apply),
                        [("Xb", X, ROWS), ("Q", Qd, WHOLE), ("weights", w, ROWS)], Qd.shape, dtype,
                        "xt_x_q-block", split_every)
    return out[:, 0] if vector else out


def x_q(X, Q, *, center=None) -> da.Array:
    """``X Q`` as a row-chunked array aligned with ``X``.

    Parameters
    ----------
    X : dask.array.Array, shape (n_samples, n_features)
        Row blocks, one column chunk, known chunk sizes.
    Q : array_like or dask.array.Array, shape (n_features, k) or (n_features,)
        Dense operand, shipped once.
    center : array_like of shape (n_features,), optional
        Column means ``mu``: computes ``(X - 1 mu^T) Q`` without densifying ``X``. (``True`` is not
        accepted: the mean must be known before the first block; compute ``column_mean(X)`` first.)

    Returns
    -------
    dask.array.Array, shape (n_samples, k) or (n_samples,)
        Dense, with ``X``'s row chunks and one column chunk.
    """
    X = check_x(X)
    if isinstance(center, (bool, np.bool_)) and center:
        raise ValueError("x_q needs the column means before its first block: pass "
                         "center=column_mean(X).compute() (or center=None)")
    Qd, vector = _as_matrix(Q, X.shape[1], "Q", "column of X")
    mu = _as_center(center, X)
    dtype = working_dtype(X.dtype, Qd.dtype)
    out = per_block(K.block_matmul, [("Xb", X, ROWS), ("B", Qd, WHOLE), ("center", mu, WHOLE)],
                     tail=(Qd.shape[1],), dtype=dtype, token="x_q-block", stack=False)
    return out[:, 0] if vector else out


def xt_b(X, B, *, weights=None, center=False, split_every: int = 8) -> da.Array:
    """``X^T diag(w) B`` for ``B`` chunked by rows like ``X``.

    Parameters
    ----------
    X : dask.array.Array, shape (n_samples, n_features)
        Row blocks, one column chunk, known chunk sizes.
    B : dask.array.Array or array_like, shape (n_samples, k) or (n_samples,)
        Dense or sparse blocks with ``X``'s row chunks and one column chunk (an in-memory array is
        chunked like ``X``).
    weights : array_like or dask.array.Array of shape (n_samples,), optional
        Sample weights (non-negative).
    center : bool or array_like of shape (n_features,), default False
        Centre ``X`` by its (weighted) column mean (``True``, same pass) or by the given means.
        (``B`` need not be centred: ``Xc^T W B = Xc^T W Bc`` for the weighted mean.)
    split_every : int, default 8
        Most block results summed by one task of the tree reduction.

    Returns
    -------
    dask.array.Array, shape (n_features, k) or (n_features,)
        Dense, one chunk, in the working dtype of ``X`` and ``B``.
    """
    X = check_x(X)
    split_every = _check_split_every(split_every)
    vector = (B.ndim if isinstance(B, da.Array) or sp.issparse(B) else np.ndim(B)) == 1
    if vector:
        B = B[:, None] if isinstance(B, da.Array) else np.asarray(B)[:, None]
    B = check_rows_operand(B, X, "B")
    w = _as_weights(weights, X)
    mu = _as_center(center, X)
    dtype = working_dtype(X.dtype, B.dtype)
    out = _product_pass(mu, (K._augmented_tmatmul, K.block_tmatmul),
                        [("Xb", X, ROWS), ("Bb", B, ROWS), ("weights", w, ROWS)], (X.shape[1], B.shape[1]), dtype,
                        "xt_b-block", split_every)
    return out[:, 0] if vector else out


def yt_x_z(Y, X, Z, *, weights=None, center=False, split_every: int = 8) -> da.Array:
    """Fused ``Y^T diag(w) (X Z)`` in one pass over the row blocks of ``Y`` and ``X``.

    Parameters
    ----------
    Y : dask.array.Array, shape (n_samples, n_labels)
        Row blocks with ``X``'s row chunks and one column chunk (for example ``open_dataset(url).Y``).
    X : dask.array.Array, shape (n_samples, n_features)
        Row blocks, one column chunk, known chunk sizes.
    Z : array_like or dask.array.Array, shape (n_features, k) or (n_features,)
        Dense operand, shipped once.
    weights : array_like or dask.array.Array of shape (n_samples,), optional
        Sample weights (non-negative).
    center : bool or array_like of shape (n_features,), default False
        Centre ``X`` (not ``Y``) by its (weighted) column mean (``True``, same pass) or by the given
        means.
    split_every : int, default 8
        Most block results summed by one task of the tree reduction.

    Returns
    -------
    dask.array.Array, shape (n_labels, k) or (n_labels,)
        Dense, one chunk, in the working dtype of ``Y``, ``X`` and ``Z``.
    """
    X = check_x(X)
    Y = check_rows_operand(Y, X, "Y")
    split_every = _check_split_every(split_every)
    Zd, vector = _as_matrix(Z, X.shape[1], "Z", "column of X")
    w = _as_weights(weights, X)
    mu = _as_center(center, X)
    dtype = working_dtype(Y.dtype, X.dtype, Zd.dtype)
    out = _product_pass(mu, (K._augmented_cross, K.block_cross),
                        [("Yb", Y, ROWS), ("Xb", X, ROWS), ("Z", Zd, WHOLE), ("weights", w, ROWS)],
                        (Y.shape[1], Zd.shape[1]), dtype, "yt_x_z-block", split_every)
    return out[:, 0] if vector else out


def gram(X, *, weights=None, center=False, dtype=None, split_every: int = 8) -> da.Array:
    """Dense Gram matrix ``X^T diag(w) X`` for a small number of features.

    Every block result is a dense ``(n_features, n_features)`` matrix: meant for ``n_features`` up
    to a few thousand. For more features use :func:`xt_x_q` (products ``X^T X Q``).

    Parameters
    ----------
    X : dask.array.Array, shape (n_samples, n_features)
        Row blocks, one column chunk, known chunk sizes.
    weights : array_like or dask.array.Array of shape (n_samples,), optional
        Sample weights (non-negative).
    center : bool or array_like of shape (n_features,), default False
        Centre ``X`` by its (weighted) column mean (``True``, same pass) or by the given means.
        With ``center=True``, ``gram(X, weights=w, center=True) / w.sum()`` is the weighted
        (biased) covariance matrix. Centred Gram matrices are accumulated in float64 (then cast
        back), since centring cancels digits when a column's mean dwarfs its spread.
    dtype : numpy dtype, optional
        dtype of the accumulation and of the result (for example ``np.float64`` for a Gram matrix
        of float32 data that is to be factorised). Default: the working dtype of ``X``.
    split_every : int, default 8
        Most block results summed by one task of the tree reduction.

    Returns
    -------
    dask.array.Array, shape (n_features, n_features)
        Dense, symmetric, one chunk, in ``dtype`` (default the working dtype of ``X``).
    """
    X = check_x(X)
    split_every = _check_split_every(split_every)
    w = _as_weights(weights, X)
    mu = _as_center(center, X)
    dtype = working_dtype(X.dtype) if dtype is None else working_dtype(dtype)
    d = X.shape[1]
    # Centring subtracts nearly equal numbers when a column's mean is large compared to its spread:
    # accumulate centred Gram matrices in float64 (cheap for the small d this function is for).
    acc = np.result_type(dtype, np.float64) if mu is not None else dtype
    nbytes = (d + 1) ** 2 * acc.itemsize
    if nbytes > GRAM_MAX_BYTES:
        raise ValueError(
            f"gram of {d} features would be a dense {d} x {d} {acc} matrix per row block "
            f"({nbytes / 2**30:.1f} GiB, more than GRAM_MAX_BYTES = {GRAM_MAX_BYTES / 2**30:.0f} GiB); "
            f"use xt_x_q(X, Q) for products with X^T X instead"
        )
    return _product_pass(mu, (K._augmented_gram, K.block_gram), [("Xb", X, ROWS), ("weights", w, ROWS)], (d, d),
                         acc, "gram-block", split_every, static={"dtype": acc}).astype(dtype)


def row_gram(X, *, dtype=np.float64) -> da.Array:
    """The rows' Gram matrix ``X X^T`` (dense, ``n_samples x n_samples``) for a small number of rows.

    Block ``(i, j)`` is :func:`~xmldask.linalg._kernels.block_row_gram` of row blocks ``i`` and ``j``: one task
    per pair of blocks, each reading two blocks. Meant for a few thousand rows of many features (the dual
    form of least squares, :func:`xmldask.linalg.ridge_lstsq`'s ``"dual"`` solver), where ``X^T X`` is too large.

    Parameters
    ----------
    X : dask.array.Array, shape (n_samples, n_features)
        Row blocks, one column chunk, known chunk sizes.
    dtype : numpy dtype, default float64
        dtype of the products and of the result.

    Returns
    -------
    dask.array.Array, shape (n_samples, n_samples)
        Dense, chunked by ``X``'s row chunks along both axes.
    """
    X = check_x(X)
    dtype = np.dtype(dtype)
    return da.blockwise(functools.partial(K.block_row_gram, dtype=dtype), "ij", X, "ik", X, "jk", dtype=dtype,
                        concatenate=True, meta=np.empty((0, 0), dtype), token="row-gram", align_arrays=False)


def column_sums(X, *, weights=None, split_every: int = 8) -> da.Array:
    """Column sums ``X^T w`` (``w`` all ones without weights): shape ``(n_features,)``, one chunk, in the
    working dtype of ``X``. ``X``, ``weights`` and ``split_every`` as in :func:`gram`."""
    X = check_x(X)
    split_every = _check_split_every(split_every)
    w = _as_weights(weights, X)
    dtype = working_dtype(X.dtype)
    return block_sum(K.block_colsum, [("Xb", X, ROWS), ("weights", w, ROWS)], tail=(X.shape[1],),
                     dtype=dtype, token="column_sums-block", split_every=split_every)


def column_mean(X, *, weights=None, split_every: int = 8) -> da.Array:
    """(Weighted) column means ``X^T w / (1^T w)``: shape ``(n_features,)``, one chunk, in the working dtype
    of ``X``. ``X``, ``weights`` (with a positive sum) and ``split_every`` as in :func:`gram`."""
    total = _weighted_totals(X, weights, K._colsum_total, (), "column_mean", split_every)
    return total[:-1] / total[-1]


def column_moments(X, *, weights=None, split_every: int = 8) -> tuple[da.Array, da.Array]:
    """(Weighted) column mean and second moment, in one pass. ``X``, ``weights`` (with a positive sum) and
    ``split_every`` as in :func:`gram`.

    Returns
    -------
    mean : dask.array.Array, shape (n_features,)
        ``X^T w / (1^T w)``.
    second_moment : dask.array.Array, shape (n_features,)
        The raw (uncentred) second moment ``(X * X)^T w / (1^T w)``; the variance is
        ``second_moment - mean**2``. Both share one pass when computed together
        (``dask.compute(mean, second_moment)``); in the working dtype of ``X``.
    """
    total = _weighted_totals(X, weights, K._moments_total, (2,), "column_moments", split_every)
    return total[0, :-1] / total[0, -1], total[1, :-1] / total[1, -1]


def _weighted_totals(X, weights, kernel, lead: tuple[int, ...], name: str, split_every: int) -> da.Array:
    """Tree sum of ``kernel(Xb, weights=wb)``, whose results have shape ``lead + (n_features + 1,)``."""
    X = check_x(X)
    split_every = _check_split_every(split_every)
    w = _as_weights(weights, X)
    dtype = working_dtype(X.dtype)
    return block_sum(kernel, [("Xb", X, ROWS), ("weights", w, ROWS)], tail=lead + (X.shape[1] + 1,),
                     dtype=dtype, token=f"{name}-block", split_every=split_every)
