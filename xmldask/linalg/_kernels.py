"""Row-block kernels: pure NumPy/SciPy functions on ONE row block (no Dask).

Every pass of :mod:`xmldask.linalg.passes` applies one of these functions to each row block and
sums the small results. A row block ``Xb`` (shape ``(n_b, d)``) is a ``scipy.sparse`` matrix
(CSR, as read from the stores) or a dense ``numpy.ndarray``; the other operands are dense.

Conventions shared by all kernels:

- ``weights`` is the block's slice of the per-row sample weights, shape ``(n_b,)``; ``None`` means
  all ones. ``W = diag(weights)``.
- ``center`` is a column-mean vector ``mu`` of shape ``(d,)`` or ``None``. Centring is implicit: the
  kernels act as if ``Xb`` were ``Xb - 1 mu^T`` but never densify ``Xb``, using
  ``(Xb - 1 mu^T) Q = Xb Q - 1 (mu^T Q)`` and ``(Xb - 1 mu^T)^T V = Xb^T V - mu (1^T V)``.
- The working dtype is NumPy's promotion of the two main operands' dtypes (at least float32):
  float32 blocks with a float32 operand give float32 results. ``weights`` and ``center`` are cast
  to the working dtype, so a float64 weight vector never upcasts a float32 pass.
"""

from __future__ import annotations

import glob

import numpy as np
import scipy.sparse as sp

__all__ = [
    "block_augmented",
    "block_colsq",
    "block_colsum",
    "block_cross",
    "block_gram",
    "block_gram_apply",
    "block_matmul",
    "block_row_gram",
    "block_tmatmul",
    "t_product",
    "unpack_centered",
    "working_dtype",
]


def working_dtype(*dtypes) -> np.dtype:
    """NumPy's result dtype of ``dtypes``, at least float32 (bool and small ints give float32)."""
    return np.result_type(*[np.dtype(t) for t in dtypes], np.float32)


def _dense(a) -> np.ndarray:
    return a.toarray() if sp.issparse(a) else np.asarray(a)


#: the share of stored entries in both sparse operands from which :func:`t_product` multiplies dense slabs of their rows
#: (BLAS) instead of SciPy's sparse product. Measured on this machine (``U^T U``, random entries): at 0.1 BLAS took
#: 0.5-1.3x SciPy's time, at 0.2 0.2-0.3x, on fully dense rows 0.01-0.02x (1,500 x 103: 56 ms -> 0.8 ms)
DENSE_SHARE = 0.1
#: the bytes of one dense slab of rows in :func:`t_product` (both operands' slabs together)
SLAB_BYTES = 1 << 24


def t_product(U, R) -> np.ndarray:
    """``U^T R`` of two row blocks (``(n_b, p)`` and ``(n_b, q)``), dense ``(p, q)``, in their promoted dtype.

    Two sparse operands with at least :data:`DENSE_SHARE` of their cells stored are multiplied as dense slabs of
    rows of at most :data:`SLAB_BYTES`, whatever the block's size: SciPy's sparse product, which builds a sparse
    result entry by entry, is up to 100x slower there than BLAS on the same rows.
    """
    if sp.issparse(U) and sp.issparse(R) and min(_share(U), _share(R)) >= DENSE_SHARE:
        U, R = sp.csr_matrix(U), sp.csr_matrix(R)
        dtype = np.result_type(U.dtype, R.dtype)
        out = np.zeros((U.shape[1], R.shape[1]), dtype=dtype)
        step = max(1, SLAB_BYTES // (dtype.itemsize * max(U.shape[1] + R.shape[1], 1)))
        for a in range(0, U.shape[0], step):
            out += U[a:a + step].toarray().T @ R[a:a + step].toarray()
        return out
    return _dense(U.T @ R)


def _share(A) -> float:
    """The share of ``A``'s cells that are stored (1 for an empty shape)."""
    cells = A.shape[0] * A.shape[1]
    return A.nnz / cells if cells else 1.0


def _operand(a, dtype) -> np.ndarray | sp.sparray | sp.spmatrix:
    """Dense operand cast to ``dtype`` (no copy when it already is); sparse operands are kept."""
    if sp.issparse(a):
        return a if a.dtype == dtype else a.astype(dtype)
    return np.asarray(a, dtype=dtype)


def _vector(v, dtype, length: int, name: str) -> np.ndarray | None:
    if v is None:
        return None
    v = np.asarray(v, dtype=dtype)
    if v.shape != (length,):
        raise ValueError(f"{name} must have shape ({length},), but has shape {v.shape}")
    return v


def _scale_rows(M, w: np.ndarray | None):
    """``diag(w) @ M`` for dense or sparse ``M`` (a new array; ``M`` is not modified)."""
    if w is None:
        return M
    if sp.issparse(M):
        M = sp.csr_matrix(M, copy=True)
        M.data *= np.repeat(w, np.diff(M.indptr)).astype(M.data.dtype, copy=False)
        return M
    return M * w[:, None]


def canonical(M, *, drop_zeros: bool = False):
    """``M`` itself when it is dense or a CSR matrix in canonical form (sorted, unique column ids; with
    ``drop_zeros`` also no stored zeros), else a canonical copy.

    A row block may be an input of several tasks running at once on one worker; SciPy canonicalises some
    operands in place (``power``, ``eliminate_zeros``), which is a data race on a shared block. Kernels
    call this instead, and never change an input.
    """
    if not sp.issparse(M):
        return M
    M = sp.csr_matrix(M)
    if M.has_canonical_format and not (drop_zeros and M.nnz and not M.data.all()):
        return M
    M = M.copy()
    M.sum_duplicates()
    if drop_zeros:
        M.eliminate_zeros()
    return M


def _last_level_cache_bytes(default: int = 32 << 20) -> int:
    """Size of this machine's largest CPU cache (Linux sysfs), else ``default``."""
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    sizes = []
    for path in glob.glob("/sys/devices/system/cpu/cpu0/cache/index*/size"):
        try:
            with open(path) as f:
                text = f.read().strip()
            sizes.append(int(text[:-1]) * units[text[-1]] if text[-1:] in units else int(text))
        except (OSError, ValueError):
            continue
    return max(sizes, default=default)


#: a sparse-times-dense product whose randomly accessed rows (of the dense operand for a CSR block, of the
#: result for a CSC one: a transposed CSR block) take more than this many bytes is computed in column slabs:
#: a quarter of the largest cache, which those rows share with the other operand and the other cores
CACHE_BYTES = _last_level_cache_bytes() // 4
#: columns of a slab: one 64-byte cache line of its dtype per row
_LINE_BYTES = 64


def _sparse_dense(A, B: np.ndarray) -> np.ndarray:
    """``A @ B`` for sparse ``A`` and dense ``B`` (a dense result), in column slabs of ``B`` when large.

    SciPy reads (CSR ``A``) or writes (CSC ``A``, a transposed row block) whole rows of ``k`` values at
    random places; when those rows do not fit in the cache, every one costs a trip to memory, and the
    cores share the bus. With slabs of one cache line a row, the rows of a slab stay in cache, for one
    more pass over ``A``'s (sequential) index arrays per slab. Below :data:`CACHE_BYTES` slabs lose
    (``python bench/kernels.py``: 0.39-0.81x with rows of 0.5-7.8 MiB on this machine's 32 MiB L3; 1.36-2.06x
    with rows of 12.2-24.4 MiB).
    """
    width = max(1, _LINE_BYTES // B.dtype.itemsize)
    k = B.shape[1] if B.ndim == 2 else 1
    random_rows = {"csr": A.shape[1], "csc": A.shape[0]}.get(getattr(A, "format", None), 0)
    if k <= width or random_rows * k * B.dtype.itemsize <= CACHE_BYTES:
        return _dense(A @ B)
    out = np.empty((A.shape[0], k), dtype=np.result_type(A.dtype, B.dtype))
    for start in range(0, k, width):
        out[:, start : start + width] = A @ np.ascontiguousarray(B[:, start : start + width])
    return out


def _column_sums(M) -> np.ndarray:
    return np.asarray(M.sum(axis=0)).ravel() if sp.issparse(M) else M.sum(axis=0)


def block_matmul(Xb, B, *, center=None) -> np.ndarray:
    """``Xb @ B`` for one row block, optionally with ``Xb`` centred.

    Parameters
    ----------
    Xb : scipy.sparse matrix or ndarray, shape (n_b, d)
        Row block.
    B : ndarray or scipy.sparse matrix, shape (d, k)
        Dense (or sparse) right operand.
    center : ndarray of shape (d,), optional
        Column means ``mu``; computes ``(Xb - 1 mu^T) @ B = Xb @ B - 1 (mu^T B)``.

    Returns
    -------
    ndarray, shape (n_b, k)
        Dense, in the working dtype of ``Xb`` and ``B``.
    """
    dtype = working_dtype(Xb.dtype, B.dtype)
    B = _operand(B, dtype)
    out = (_sparse_dense(Xb, B) if sp.issparse(Xb) and isinstance(B, np.ndarray) else _dense(Xb @ B))
    out = out.astype(dtype, copy=False)
    mu = _vector(center, dtype, Xb.shape[1], "center")
    if mu is not None:
        out = out - _dense(B.T @ mu).astype(dtype, copy=False)[None, :]
    return out


def block_tmatmul(Xb, Bb, *, weights=None, center=None) -> np.ndarray:
    """``Xb^T diag(w) Bb`` for one row block ``Bb`` of a row-chunked matrix.

    Parameters
    ----------
    Xb : scipy.sparse matrix or ndarray, shape (n_b, d)
        Row block.
    Bb : ndarray or scipy.sparse matrix, shape (n_b, k)
        The same rows of the other row-chunked operand.
    weights : ndarray of shape (n_b,), optional
        Sample weights of the rows.
    center : ndarray of shape (d,), optional
        Column means ``mu`` of ``X``; computes ``(Xb - 1 mu^T)^T W Bb = Xb^T W Bb - mu (w^T Bb)``.

    Returns
    -------
    ndarray, shape (d, k)
        Dense, in the working dtype of ``Xb`` and ``Bb``.
    """
    dtype = working_dtype(Xb.dtype, Bb.dtype)
    if Bb.shape[0] != Xb.shape[0]:
        raise ValueError(f"the blocks have {Xb.shape[0]} and {Bb.shape[0]} rows; they must be the same rows")
    V = _scale_rows(_operand(Bb, dtype), _vector(weights, dtype, Xb.shape[0], "weights"))
    out = (_sparse_dense(Xb.T, V) if sp.issparse(Xb) and isinstance(V, np.ndarray) else _dense(Xb.T @ V))
    out = out.astype(dtype, copy=False)
    mu = _vector(center, dtype, Xb.shape[1], "center")
    if mu is not None:
        out = out - np.outer(mu, _column_sums(V).astype(dtype, copy=False))
    return out


def block_gram_apply(Xb, Q, *, weights=None, center=None) -> np.ndarray:
    """Fused ``Xb^T diag(w) (Xb @ Q)`` for one row block, optionally with ``Xb`` centred.

    Only the ``(n_b, k)`` product ``Xb @ Q`` is held besides the block.

    Parameters
    ----------
    Xb : scipy.sparse matrix or ndarray, shape (n_b, d)
        Row block.
    Q : ndarray, shape (d, k)
        Dense operand.
    weights : ndarray of shape (n_b,), optional
        Sample weights of the rows.
    center : ndarray of shape (d,), optional
        Column means ``mu``; computes ``Xc^T W Xc Q`` with ``Xc = Xb - 1 mu^T``, implicitly.

    Returns
    -------
    ndarray, shape (d, k)
        Dense, in the working dtype of ``Xb`` and ``Q``.
    """
    V = block_matmul(Xb, Q, center=center)
    return block_tmatmul(Xb, V, weights=weights, center=center)


def block_cross(Yb, Xb, Z, *, weights=None, center=None) -> np.ndarray:
    """``Yb^T diag(w) (Xb @ Z)`` for one row block of ``Y`` and the same rows of ``X``.

    Parameters
    ----------
    Yb : scipy.sparse matrix or ndarray, shape (n_b, n_labels)
        Row block of ``Y``.
    Xb : scipy.sparse matrix or ndarray, shape (n_b, d)
        The same rows of ``X``.
    Z : ndarray, shape (d, k)
        Dense operand.
    weights : ndarray of shape (n_b,), optional
        Sample weights of the rows.
    center : ndarray of shape (d,), optional
        Column means ``mu`` of ``X``; computes ``Yb^T W (Xb - 1 mu^T) Z``. ``Y`` is not centred.

    Returns
    -------
    ndarray, shape (n_labels, k)
        Dense, in the working dtype of ``Xb`` and ``Z``.
    """
    if Yb.shape[0] != Xb.shape[0]:
        raise ValueError(f"the blocks of Y and X have {Yb.shape[0]} and {Xb.shape[0]} rows; they must be the same")
    V = block_matmul(Xb, Z, center=center)
    return block_tmatmul(Yb, V, weights=weights)


def block_gram(Xb, *, weights=None, center=None, dtype=None) -> np.ndarray:
    """Dense ``Xb^T diag(w) Xb`` for one row block (for a small number of columns ``d``).

    Parameters
    ----------
    Xb : scipy.sparse matrix or ndarray, shape (n_b, d)
        Row block.
    weights : ndarray of shape (n_b,), optional
        Sample weights of the rows.
    center : ndarray of shape (d,), optional
        Column means ``mu``; computes ``Xc^T W Xc`` with ``Xc = Xb - 1 mu^T`` as
        ``G - s mu^T - mu s^T + (1^T w) mu mu^T`` where ``G = Xb^T W Xb`` and ``s = Xb^T w``
        (which cancels digits when a column's mean is large compared to its spread: see ``dtype``).
    dtype : numpy dtype, optional
        dtype of the computation and of the result; default the working dtype of ``Xb``. float64
        keeps centred Gram matrices of float32 data accurate at little cost for small ``d``.

    Returns
    -------
    ndarray, shape (d, d)
        Dense, in ``dtype``.
    """
    dtype = working_dtype(Xb.dtype) if dtype is None else np.dtype(dtype)
    Xb = _operand(Xb, dtype)
    w = _vector(weights, dtype, Xb.shape[0], "weights")
    G = t_product(Xb, _scale_rows(Xb, w)).astype(dtype, copy=False)
    mu = _vector(center, dtype, Xb.shape[1], "center")
    if mu is not None:
        s = block_colsum(Xb, w)
        total = dtype.type(Xb.shape[0]) if w is None else w.sum(dtype=dtype)
        G = G - np.outer(s, mu) - np.outer(mu, s) + total * np.outer(mu, mu)
    return G


def block_row_gram(Xi, Xj, dtype=np.float64) -> np.ndarray:
    """Dense ``Xi Xj^T`` of two row blocks (one block of the rows' Gram matrix ``X X^T``), in ``dtype``.

    The operands are cast to ``dtype`` first, so float32 rows give float64 inner products when asked.
    """
    dtype = np.dtype(dtype)
    return _dense(_operand(Xi, dtype) @ _operand(Xj, dtype).T).astype(dtype, copy=False)


def block_colsum(Xb, weights=None) -> np.ndarray:
    """Column sums ``Xb^T w`` of one row block (``w`` all ones when ``weights`` is ``None``).

    Parameters
    ----------
    Xb : scipy.sparse matrix or ndarray, shape (n_b, d)
    weights : ndarray of shape (n_b,), optional

    Returns
    -------
    ndarray, shape (d,)
        In the working dtype of ``Xb``.
    """
    dtype = working_dtype(Xb.dtype)
    w = _vector(weights, dtype, Xb.shape[0], "weights")
    if w is None:
        w = np.ones(Xb.shape[0], dtype=dtype)
    return _dense(Xb.T @ w).astype(dtype, copy=False).ravel()


def block_colsq(Xb, weights=None) -> np.ndarray:
    """Weighted column sums of squares ``(Xb * Xb)^T w`` of one row block: :func:`block_colsum` of the squares."""
    squares = _operand(canonical(Xb), working_dtype(Xb.dtype))
    if sp.issparse(squares):  # a new matrix: Xb may be read by another task right now
        return block_colsum(sp.csr_matrix((squares.data ** 2, squares.indices, squares.indptr), squares.shape),
                            weights)
    return block_colsum(np.square(squares), weights)


def block_augmented(Ub, Rb, *, weights=None, dtype=None) -> np.ndarray:
    """``[Ub, 1]^T diag(w) [Rb, 1]``: a product and the sums needed to centre it afterwards.

    The result ``P`` has ``P[:p, :q] = Ub^T W Rb``, ``P[:p, q] = Ub^T w``, ``P[p, :q] = w^T Rb`` and
    ``P[p, q] = 1^T w``. It is additive over row blocks; :func:`unpack_centered` turns the total into
    the product with ``X`` centred by its (weighted) column mean, so that centring costs no extra pass.

    Parameters
    ----------
    Ub : scipy.sparse matrix or ndarray, shape (n_b, p)
    Rb : ndarray or scipy.sparse matrix, shape (n_b, q)
    weights : ndarray of shape (n_b,), optional
    dtype : numpy dtype, optional
        dtype of the computation and of the result; default the working dtype of ``Ub`` and ``Rb``.

    Returns
    -------
    ndarray, shape (p + 1, q + 1)
        In ``dtype``.
    """
    dtype = working_dtype(Ub.dtype, Rb.dtype) if dtype is None else np.dtype(dtype)
    Ub = _operand(Ub, dtype)
    n_b, p = Ub.shape
    q = Rb.shape[1]
    w = _vector(weights, dtype, n_b, "weights")
    if w is None:
        w = np.ones(n_b, dtype=dtype)
    Rw = _scale_rows(_operand(Rb, dtype), w)
    out = np.empty((p + 1, q + 1), dtype=dtype)
    out[:p, :q] = t_product(Ub, Rw)
    out[:p, q] = _dense(Ub.T @ w).ravel()
    out[p, :q] = _column_sums(Rw)
    out[p, q] = w.sum(dtype=dtype)
    return out


def unpack_centered(P: np.ndarray) -> np.ndarray:
    """Centred product from a summed :func:`block_augmented` result.

    With ``ubar = U^T w / (1^T w)`` and ``rbar = R^T w / (1^T w)`` the weighted column means,
    ``U^T W R - (U^T w)(w^T R) / (1^T w)`` equals ``(U - 1 ubar^T)^T W R``, ``U^T W (R - 1 rbar^T)`` and
    ``(U - 1 ubar^T)^T W (R - 1 rbar^T)``: centring either factor, or both, gives the same product.
    For ``U = X`` (or ``R = X V``) this is the product with ``X`` centred by its weighted column mean:
    ``P[:p, :q] - outer(P[:p, q], P[p, :q]) / P[p, q]``.

    Parameters
    ----------
    P : ndarray, shape (p + 1, q + 1)
        Sum over all row blocks of :func:`block_augmented`.

    Returns
    -------
    ndarray, shape (p, q)
    """
    total = P[-1, -1]
    return P[:-1, :-1] - np.outer(P[:-1, -1], P[-1, :-1] / total)


# Per-block functions of the passes that centre ``X`` by its own (weighted) mean in the same pass:
# each returns a :func:`block_augmented` result, to be summed and finished by :func:`unpack_centered`.


def _augmented_gram_apply(Xb, Q, *, weights=None) -> np.ndarray:
    return block_augmented(Xb, block_matmul(Xb, Q), weights=weights)


def _augmented_cross(Yb, Xb, Z, *, weights=None) -> np.ndarray:
    return block_augmented(Yb, block_matmul(Xb, Z), weights=weights)


def _augmented_tmatmul(Xb, Bb, *, weights=None) -> np.ndarray:
    return block_augmented(Xb, Bb, weights=weights)


def _augmented_gram(Xb, *, weights=None, dtype=None) -> np.ndarray:
    return block_augmented(Xb, Xb, weights=weights, dtype=dtype)


def _colsum_total(Xb, *, weights=None) -> np.ndarray:
    """``[Xb^T w, 1^T w]``, shape (d + 1,)."""
    dtype = working_dtype(Xb.dtype)
    w = _vector(weights, dtype, Xb.shape[0], "weights")
    total = dtype.type(Xb.shape[0]) if w is None else w.sum(dtype=dtype)
    return np.append(block_colsum(Xb, w), total)


def _moments_total(Xb, *, weights=None) -> np.ndarray:
    """``[[Xb^T w, 1^T w], [(Xb * Xb)^T w, 1^T w]]``, shape (2, d + 1)."""
    first = _colsum_total(Xb, weights=weights)
    second = np.append(block_colsq(Xb, weights), first[-1])
    return np.stack([first, second])
