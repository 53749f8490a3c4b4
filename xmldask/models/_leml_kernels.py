"""Pure NumPy/SciPy kernels of LEML (low-rank ERM for multi-label learning), one row block at a time.

Nothing here knows about Dask: :mod:`xmldask.models.leml` maps these functions over row blocks and
sums their results with the tree sums of :mod:`xmldask.linalg.passes`.

Scores are ``s_ij = x_i^T W h_j`` (``Z = W H^T``). The losses are summed over the observed entries
``Omega`` (a CSR mask of the block; ``None``: every entry), with labels encoded ``a_ij = +1`` for a
relevant label and ``-1`` otherwise (LEML's ``Omega`` solvers). The full-label squared loss of
Algorithm 2 keeps ``Y`` in ``{0, 1}`` (:func:`block_sq_full_grad`).

- :func:`loss_terms`: the loss value and its first / second derivatives in the score.
- :func:`block_grad`: ``X_b^T D H`` and ``sum l`` of one block, eq. (9) / Algorithm 1, with ``D``
  sparse on ``Omega`` (``D_ij = l'(a_ij, s_ij)``); the ``n_b x n_labels`` residual is never formed
  for a sparse ``Omega`` (only its observed entries), and in row sub-batches for a full one.
- :func:`block_hessp`: ``X_b^T U H`` with ``U_ij = l''(a_ij, s_ij) x_i^T S h_j`` on ``Omega``, eq. (10).
- :func:`block_sq_full_grad`: ``X_b^T (X_b W M - Y_b H)`` and the squared loss, eq. (11) /
  Algorithm 2 (``M = H^T H``; no ``n_b x n_labels`` matrix is formed).
- :func:`label_grams`: the per-label ``k x k`` Gram matrices ``sum_{i in Omega_j} z_i z_i^T`` and
  right-hand sides ``sum_{i in Omega_j} a_ij z_i`` of the squared-loss H-step, eq. (5).

References
----------
Yu, H.-F., Jain, P., Kar, P. and Dhillon, I. S. "Large-scale Multi-label Learning with Missing Labels"
(ICML 2014): eqs. (4)-(12), Algorithms 1 and 2; loss derivatives of its Appendix B.1.
"""

from __future__ import annotations

import numpy as np
import scipy.sparse as sp
from scipy.special import expit

from ..linalg import canonical
from ._kernels import _dense

__all__ = ["LOSSES", "ENTRY_BUDGET", "block_grad", "block_hessp", "block_sq_full_grad", "block_target_sketch",
           "curvature", "label_grams", "loss_terms", "signed_entries"]

#: loss names: squared ``(a - b)^2``, logistic ``log(1 + exp(-a b))``, squared hinge ``max(0, 1 - a b)^2``
LOSSES = ("squared", "logistic", "sqhinge")

#: most (entry x k) values held at once by one kernel (rows are processed in sub-batches below it)
ENTRY_BUDGET = 1 << 22


def loss_terms(a: np.ndarray, b: np.ndarray, loss: str, *, second: bool = False):
    """``sum l(a, b)``, ``l'(a, b)`` and (with ``second``) ``l''(a, b)`` element-wise, derivatives in ``b``.

    Parameters
    ----------
    a : ndarray
        Labels in ``{-1, +1}`` (or ``{0, 1}`` for the full-label squared loss).
    b : ndarray
        Scores, same shape.
    loss : {"squared", "logistic", "sqhinge"}
    second : bool
        Also return the second derivative (the generalised one for the squared hinge).

    Returns
    -------
    value : float
    d1 : ndarray
    d2 : ndarray (only with ``second``)
    """
    if loss == "squared":
        r = b - a
        value, d1 = float(np.dot(r.ravel(), r.ravel())), 2.0 * r
        d2 = np.full_like(b, 2.0) if second else None
    elif loss == "logistic":
        z = a * b
        value = float(np.logaddexp(0.0, -z).sum())
        p = expit(z)
        d1 = a * (p - 1.0)
        d2 = p * (1.0 - p) if second else None
    elif loss == "sqhinge":
        m = np.maximum(1.0 - a * b, 0.0)
        value, d1 = float(np.dot(m.ravel(), m.ravel())), -2.0 * a * m
        d2 = 2.0 * (m > 0) if second else None
    else:
        raise ValueError(f"loss must be one of {', '.join(map(repr, LOSSES))}, but is {loss!r}")
    return (value, d1, d2) if second else (value, d1)


def _csr(A, n_cols: int) -> sp.csr_matrix:
    """``A`` as a canonical CSR matrix without stored zeros (a copy only when it is not one: never changed in
    place, another task may be reading the same block)."""
    A = sp.csr_matrix(A) if sp.issparse(A) else sp.csr_matrix(np.asarray(A))
    if A.shape[1] != n_cols:
        raise ValueError(f"expected {n_cols} columns, got {A.shape[1]}")
    return canonical(A, drop_zeros=True)


def signed_entries(Yb, Ob, n_labels: int) -> sp.csr_matrix:
    """The observed entries of a block as a CSR matrix of ``a_ij = +1`` (relevant) / ``-1`` (not).

    Parameters
    ----------
    Yb : sparse matrix, shape (n_b, n_labels)
        Relevant labels (non-zeros).
    Ob : sparse matrix, shape (n_b, n_labels)
        Observed entries (non-zeros); must contain every non-zero of ``Yb``.

    Returns
    -------
    scipy.sparse.csr_matrix, shape (n_b, n_labels), float64
        ``Ob``'s sparsity pattern with values ``+-1``.
    """
    Y, O = _csr(Yb, n_labels), _csr(Ob, n_labels)
    ok = np.repeat(np.arange(O.shape[0], dtype=np.int64), np.diff(O.indptr)) * n_labels + O.indices
    yk = np.repeat(np.arange(Y.shape[0], dtype=np.int64), np.diff(Y.indptr)) * n_labels + Y.indices
    pos = np.isin(ok, yk, assume_unique=True)
    if int(pos.sum()) != Y.nnz:
        raise ValueError(f"{Y.nnz - int(pos.sum())} relevant labels of this block lie outside its observed-entry mask; "
                         "a relevant label must be observed (build the mask with xmldask mask, or include every "
                         "relevant label in the observed entries)")
    return sp.csr_matrix((np.where(pos, 1.0, -1.0), O.indices, O.indptr), shape=O.shape)


def block_target_sketch(Xb, Yb, Omega: np.ndarray, Ob=None, *, n_labels: int, encoding: str) -> np.ndarray:
    """``X_b^T (T_b Omega)``: a block's share of a random sketch of ``X^T T`` (spectral initialisation).

    ``T`` is the training target: ``Y`` in ``{0, 1}`` (``encoding="01"``), every entry ``+-1``
    (``"pm1"``, formed as ``2 Y Omega - 1 1^T Omega`` without a dense ``T``), or with a mask ``Ob`` the
    observed entries ``+-1`` and zeros elsewhere. Returns ``(n_features, Omega.shape[1])`` float64.
    """
    if Ob is not None:
        TO = signed_entries(Yb, Ob, n_labels) @ Omega
    else:
        TO = _csr(Yb, n_labels).astype(np.float64) @ Omega
        if encoding == "pm1":
            TO = 2.0 * TO - Omega.sum(axis=0)[None, :]
        elif encoding != "01":
            raise ValueError(f"encoding must be '01' or 'pm1', but is {encoding!r}")
    return np.asarray(Xb.T @ TO, dtype=np.float64)


def _sub_rows(n_rows: int, per_row: float, k: int, budget: int) -> int:
    return max(1, min(n_rows, int(budget // max(per_row * max(k, 1), 1.0))))


def _entry_scores(A: np.ndarray, H: np.ndarray | None, E: sp.csr_matrix) -> np.ndarray:
    """``a_i^T h_j`` at the non-zeros of ``E`` (row-major order); ``H=None`` is the identity (``a_ij``)."""
    rows = np.repeat(np.arange(E.shape[0]), np.diff(E.indptr))
    if H is None:
        return np.asarray(A[rows, E.indices], dtype=np.float64)
    return np.einsum("ij,ij->i", A[rows], H[E.indices])


def _times(M, H: np.ndarray | None):
    """``M H`` (``M`` dense or sparse), or ``M`` itself (dense) for ``H=None``, the identity: a sparse ``M`` has as
    many columns as the dense ``X_b W`` of its rows, and ``X_b^T M`` with a dense ``M`` is the fast product."""
    if H is None:
        return M.toarray() if sp.issparse(M) else M
    return M @ H


def _dense_signs(Yb: sp.csr_matrix, encoding: str) -> np.ndarray:
    D = Yb.toarray().astype(np.float64) != 0
    return np.where(D, 1.0, -1.0) if encoding == "pm1" else D.astype(np.float64)


def _batches(Xb, Yb, Ob, n_labels: int, k: int, budget: int):
    """Row sub-batches ``(X_s, Y_s, E_s)`` of a block; ``E_s`` is the signed observed CSR (or ``None``: all)."""
    Xb = Xb if sp.issparse(Xb) else np.asarray(Xb)
    Yb = _csr(Yb, n_labels)
    E = None if Ob is None else signed_entries(Yb, Ob, n_labels)
    n = Xb.shape[0]
    per_row = n_labels if E is None else max(E.nnz / max(n, 1), 1.0)
    step = _sub_rows(n, per_row, k, budget)
    for a in range(0, n, step):
        yield Xb[a:a + step], Yb[a:a + step], (None if E is None else E[a:a + step])


def block_grad(Xb, Yb, W: np.ndarray, H: np.ndarray | None, Ob=None, *, loss: str,
               budget: int = ENTRY_BUDGET) -> np.ndarray:
    """Gradient ``X_b^T D H`` of the block's loss over ``Omega`` and the loss itself (Algorithm 1).

    Parameters
    ----------
    Xb : sparse or ndarray, shape (n_b, n_features)
    Yb : sparse, shape (n_b, n_labels)
    W : ndarray, shape (n_features, k)
    H : ndarray, shape (n_labels, k), or None
        ``None``: the identity (``k = n_labels``: binary relevance), never formed.
    Ob : sparse, shape (n_b, n_labels), optional
        Observed entries; ``None``: every entry is observed.
    loss : {"squared", "logistic", "sqhinge"}
    budget : int
        Most entry x k values held at once.

    Returns
    -------
    ndarray, shape (n_features + 1, k), float64
        Rows ``:n_features``: ``X_b^T D H``; ``[n_features, 0]``: ``sum_{Omega_b} l(a_ij, s_ij)``.
    """
    d, k = W.shape
    out = np.zeros((d + 1, k), dtype=np.float64)
    for Xs, Ys, Es in _batches(Xb, Yb, Ob, k if H is None else H.shape[0], k, budget):
        A = np.asarray(Xs @ W, dtype=np.float64)
        if Es is None:
            value, D = loss_terms(_dense_signs(Ys, "pm1"), _times(A, None if H is None else H.T), loss)
            DH = _times(D, H)
        else:
            value, d1 = loss_terms(Es.data, _entry_scores(A, H, Es), loss)
            DH = _times(sp.csr_matrix((d1, Es.indices, Es.indptr), shape=Es.shape), H)
        out[:d] += _dense(Xs.T @ DH)
        out[d, 0] += value
    return out


def curvature(a: np.ndarray, b: np.ndarray, loss: str) -> np.ndarray:
    """``l''(a, b)`` element-wise (the generalised one for the squared hinge), as :func:`loss_terms` gives
    it with ``second=True``, without the loss value and first derivative a Hessian-vector product
    does not need (the logistic loss's ``log(1 + e^-z)`` costs more than ``l''`` itself)."""
    if loss == "squared":
        return np.full_like(b, 2.0)
    if loss == "logistic":
        p = expit(a * b)
        return p * (1.0 - p)
    if loss == "sqhinge":
        return 2.0 * (a * b < 1.0)
    raise ValueError(f"loss must be one of {', '.join(map(repr, LOSSES))}, but is {loss!r}")


def block_hessp(Xb, Yb, W: np.ndarray, H: np.ndarray | None, S: np.ndarray, Ob=None, *, loss: str,
                budget: int = ENTRY_BUDGET) -> np.ndarray:
    """Hessian-vector product ``X_b^T U H`` of the block's loss at ``W`` along ``S`` (eq. (10)).

    ``U_ij = l''(a_ij, x_i^T W h_j) x_i^T S h_j`` on ``Omega``. Shapes as :func:`block_grad`;
    ``S`` has ``W``'s shape. Returns ``(n_features, k)`` float64.
    """
    d, k = W.shape
    out = np.zeros((d, k), dtype=np.float64)
    # the squared loss's curvature is 2 wherever W is: X_b W is not needed
    WS = S if loss == "squared" else np.concatenate([W, S], axis=1)
    HT = None if H is None else H.T
    for Xs, Ys, Es in _batches(Xb, Yb, Ob, k if H is None else H.shape[0], WS.shape[1], budget):
        AB = np.asarray(Xs @ WS, dtype=np.float64)
        A, B = (None, AB) if loss == "squared" else (AB[:, :k], AB[:, k:])
        if Es is None:
            d2 = 2.0 if loss == "squared" else curvature(_dense_signs(Ys, "pm1"), _times(A, HT), loss)
            UH = _times(d2 * _times(B, HT), H)
        else:
            d2 = 2.0 if loss == "squared" else curvature(Es.data, _entry_scores(A, H, Es), loss)
            U = sp.csr_matrix((d2 * _entry_scores(B, H, Es), Es.indices, Es.indptr), shape=Es.shape)
            UH = _times(U, H)
        out += _dense(Xs.T @ UH)
    return out


def block_sq_full_grad(Xb, Yb, W: np.ndarray, H: np.ndarray | None, M: np.ndarray | None) -> np.ndarray:
    """``X_b^T (X_b W M - Y_b H)`` and ``||Y_b - X_b W H^T||_F^2`` for ``M = H^T H`` (eq. (11), Algorithm 2);
    ``H=None`` and ``M=None``: the identity.

    ``Y_b`` in ``{0, 1}``; the ``n_b x n_labels`` residual is never formed (the loss is
    ``||Y_b||^2 - 2 <Y_b H, A> + <A M, A>`` with ``A = X_b W``). Returns ``(n_features + 1, k)`` float64:
    the (half) gradient rows, then the loss at ``[n_features, 0]``.
    """
    d, k = W.shape
    Yb = _csr(Yb, k if H is None else H.shape[0])
    A = np.asarray(Xb @ W, dtype=np.float64)
    B = _dense(_times(Yb, H)).astype(np.float64, copy=False)
    AM = _times(A, M)
    out = np.empty((d + 1, k), dtype=np.float64)
    out[:d] = Xb.T @ (AM - B)
    out[d] = 0.0
    y2 = float(np.dot(Yb.data, Yb.data))
    out[d, 0] = y2 - 2.0 * float(np.vdot(B, A)) + float(np.vdot(AM, A))
    return out


def label_grams(Z: np.ndarray, E: sp.csr_matrix, *, budget: int = ENTRY_BUDGET) -> tuple[np.ndarray, np.ndarray]:
    """Per-label ``G_j = sum_{i in Omega_j} z_i z_i^T`` and ``r_j = sum_{i in Omega_j} a_ij z_i``.

    Parameters
    ----------
    Z : ndarray, shape (n_samples, k)
        ``X W``.
    E : csr_matrix, shape (n_samples, n_labels)
        Signed observed entries (:func:`signed_entries`).

    Returns
    -------
    G : ndarray, shape (n_labels, k, k)
    r : ndarray, shape (n_labels, k)
    """
    n, k = Z.shape
    L = E.shape[1]
    G = np.zeros((L, k * k), dtype=np.float64)
    pattern = E.copy()
    pattern.data = np.ones_like(pattern.data)
    step = max(1, budget // max(k * k, 1))
    for a in range(0, n, step):
        Zs = Z[a:a + step]
        outer = (Zs[:, :, None] * Zs[:, None, :]).reshape(len(Zs), k * k)
        G += pattern[a:a + step].T @ outer
    return G.reshape(L, k, k), np.asarray(E.T @ Z)
