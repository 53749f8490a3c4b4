"""Blocked regularised least squares with many right-hand sides: ``min_Z ||B - X Z||^2 + lam ||Z||^2``.

Three paths, all built from the passes of :mod:`xmldask.linalg.passes` (so no task holds more than
one or two row blocks of ``X`` and ``B``):

- ``"cholesky"`` for a small number of features ``d``: one pass accumulates ``X^T W X`` (dense,
  ``d x d``, in float64) and ``X^T W B``; the ridge system is then solved by a Cholesky
  factorisation in memory.
- ``"cg"`` for many features: conjugate gradients on the normal equations
  ``(X^T W X + lam I) Z = X^T W B``, for every column of ``B`` at once (each column its own
  step sizes), preconditioned by the diagonal of ``X^T W X + lam I`` (Jacobi). Each iteration is
  one fused pass ``X^T W (X P)`` over the columns not yet converged; the iterate with the
  smallest residual is kept for every column. The small vector algebra runs in float64, the passes
  in the data's dtype (a float64 operand doubles the time of a float32 pass).
- ``"dual"`` for many features but few rows ``n``: one pass computes the rows' Gram matrix ``X X^T``
  (``n x n``, float64) and gathers ``B``; the dual system ``(W^{1/2} X X^T W^{1/2} + lam I) A = W^{1/2} B``
  (centred when asked) is solved by Cholesky in memory and a second pass maps it back, ``Z = X^T W^{1/2} A``.
  Exact like ``"cholesky"``, in two passes where CG makes up to ``max_iter + 1`` (text data of a few
  thousand rows and tens of thousands of features: CG's 30 passes stop short of ``tol``).

As in the Rembrandt reference implementation, the ridge ``alpha`` is by default relative to the
scale of the data: ``lam = alpha * trace(X^T W X) / d``, the average per-feature second moment
(times the total weight), so one ``alpha`` suits data of any scale and size; the reference uses
10-100 CG iterations.

Sample weights ``w`` give the weighted problem ``sum_i w_i ||b_i - x_i Z||^2 + lam ||Z||^2``.
``center=True`` fits an unpenalised intercept: ``X`` is centred by its weighted column mean ``mu``
implicitly (never densified) and the intercept is ``b_mean - mu Z``, so predictions are
``X @ coef + intercept`` in both cases.

References
----------
Mineiro, P. and Karampatziakis, N. "Fast Label Embeddings via Randomized Linear Algebra" (ECML PKDD
2015), Algorithm 2 line 6 and Algorithm 3 line 4 (the least-squares steps). Hestenes, M. R. and
Stiefel, E. "Methods of Conjugate Gradients for Solving Linear Systems" (1952); the preconditioned
form as in Saad, "Iterative Methods for Sparse Linear Systems", 2nd ed., Algorithm 9.1.

Examples
--------
>>> import dask.array as da, numpy as np, scipy.sparse as sp
>>> from xmldask.linalg import ridge_lstsq
>>> A = sp.random(500, 40, density=0.2, format="csr", random_state=0)
>>> B = np.random.default_rng(0).normal(size=(500, 3))
>>> X = da.from_array(A, chunks=(128, -1), asarray=False)
>>> res = ridge_lstsq(X, B, alpha=1e-2, solver="cg", tol=1e-10, max_iter=100)
>>> ref = ridge_lstsq(X, B, alpha=1e-2, solver="cholesky")
>>> bool(np.allclose(res.coef, ref.coef, atol=1e-6)), ref.n_passes
(True, 1)
"""

from __future__ import annotations

import logging
import numbers
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from functools import cached_property

import dask
import dask.array as da
import numpy as np
import scipy.linalg
import scipy.sparse as sp

from ..scheduling import task_memory_limit
from ._kernels import working_dtype
from .passes import _as_weights, check_rows_operand, check_x, column_moments, column_sums, gram, row_gram, xt_b, xt_x_q

__all__ = ["MAX_DUAL_ROWS", "MAX_GRAM_FEATURES", "LstsqResult", "dual_applies", "ridge_lstsq"]

logger = logging.getLogger(__name__)

#: ``solver="auto"`` uses Cholesky up to this many features (a dense ``d x d`` float64 Gram matrix
#: per row block: 32 MiB at 2048), conjugate gradients beyond.
MAX_GRAM_FEATURES = 2048
#: ``solver="auto"`` solves in the dual beyond :data:`MAX_GRAM_FEATURES` features when there are at most this many
#: rows (the rows' Gram matrix in float64: 512 MiB at 8192 rows, held where the solve runs) and the Gram matrix
#: fits a quarter of the smallest worker's memory limit per thread (:func:`dual_applies`)
MAX_DUAL_ROWS = 8192

_SOLVERS = ("auto", "cholesky", "cg", "dual")


@dataclass(frozen=True)
class LstsqResult:
    """Result of :func:`ridge_lstsq`.

    Attributes
    ----------
    coef : ndarray, shape (n_features, k) or (n_features,)
        The solution ``Z``, in the working dtype of ``X`` and ``B``.
    intercept : ndarray of shape (k,) or float, or None
        With ``center=True``: ``b_mean - mu @ coef``, so that ``X @ coef + intercept`` predicts
        ``B``; ``None`` otherwise.
    alpha : float
        The ridge ``lam`` actually used (after scaling).
    solver : str
        ``"cholesky"``, ``"cg"`` or ``"dual"``.
    n_passes : int
        Passes made over the row blocks of ``X`` (and ``B``).
    n_iter : int
        CG iterations made (0 for Cholesky).
    converged : bool
        Every column reached the tolerance (always ``True`` for Cholesky).
    relative_residual : ndarray, shape (k,)
        ``||X^T W B - (X^T W X + lam I) z_j|| / ||X^T W B_j||`` of the kept iterate of each column
        (for CG the recursively updated residual, which tracks the true one closely; exactly 0
        reported for a zero right-hand side). A direct solve computes it when it is first read: it costs as
        much as the solve's back substitution (an ``m x m`` matrix times the ``m x k`` solution).
    residual : ndarray or callable
        ``relative_residual``, or the function that computes it.
    """

    coef: np.ndarray
    intercept: np.ndarray | float | None
    alpha: float
    solver: str
    n_passes: int
    n_iter: int
    converged: bool
    residual: np.ndarray | Callable[[], np.ndarray] = field(repr=False, compare=False)

    @cached_property
    def relative_residual(self) -> np.ndarray:
        return self.residual() if callable(self.residual) else self.residual


def _check_float(value, name: str, *, positive: bool = False) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not np.isfinite(value) or value < 0 or (
        positive and value == 0
    ):
        need = "a positive" if positive else "a non-negative"
        raise ValueError(f"{name} must be {need} finite number, but is {value!r}")
    return float(value)


def _check_int(value, name: str, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < minimum:
        raise ValueError(f"{name} must be an integer of at least {minimum}, but is {value!r}")
    return int(value)


def ridge_lstsq(X, B, alpha: float = 1e-3, *, scale_alpha: bool = True, solver: str = "auto", weights=None,
                center: bool = False, tol: float = 1e-4, max_iter: int = 30, x0=None,
                split_every: int = 8) -> LstsqResult:
    """Solve ``min_Z sum_i w_i ||b_i - x_i Z||^2 + lam ||Z||^2`` over the row blocks of ``X`` and ``B``.

    Parameters
    ----------
    X : dask.array.Array, shape (n_samples, n_features)
        Row blocks (``scipy.sparse`` or dense), one column chunk, known chunk sizes.
    B : dask.array.Array or array_like, shape (n_samples, k) or (n_samples,)
        Right-hand sides, dense or sparse, chunked by rows like ``X`` (an in-memory array is chunked
        like ``X``). May be lazy, for example ``x_q(Y, Q)``: each block is then computed where it is
        used, in each pass that needs it (one pass for Cholesky and for CG).
    alpha : float, default 1e-3
        Ridge strength; relative to the data scale when ``scale_alpha``.
    scale_alpha : bool, default True
        Use ``lam = alpha * trace(X^T W X) / n_features`` (the average per-feature second moment
        times the total weight; with ``center=True`` of the centred ``X``), as the Rembrandt
        reference implementation does. ``False``: ``lam = alpha``.
    solver : {"auto", "cholesky", "cg", "dual"}, default "auto"
        ``"auto"``: Cholesky up to :data:`MAX_GRAM_FEATURES` features; beyond, the dual for few rows (at
        most :data:`MAX_DUAL_ROWS`, their Gram matrix within the workers' memory: :func:`dual_applies`), CG
        for more.
    weights : array_like or dask.array.Array of shape (n_samples,), optional
        Non-negative sample weights.
    center : bool, default False
        Fit an unpenalised intercept, centring ``X`` implicitly by its weighted column mean.
    tol : float, default 1e-4
        CG stops when every column's relative residual of the normal equations is at most ``tol``.
    max_iter : int, default 30
        Most CG iterations (one pass each).
    x0 : array_like of shape (n_features, k), optional
        CG starting point (a warm start, e.g. the previous solution); default zeros. Costs one
        more pass unless it is zero.
    split_every : int, default 8
        Most block results summed by one task of the tree reductions.

    Returns
    -------
    LstsqResult
        ``coef``, ``intercept``, the ``lam`` used, the solver, passes and iterations made, and the
        relative residuals.

    Raises
    ------
    ValueError
        For bad parameters, misaligned operands, or a singular system (``lam = 0`` with
        collinear features): the message says which and how to fix it.
    """
    X = check_x(X)
    vector = (B.ndim if hasattr(B, "ndim") else np.ndim(B)) == 1
    if vector:
        B = B[:, None] if isinstance(B, da.Array) else np.asarray(B)[:, None]
    B = check_rows_operand(B, X, "B")
    alpha = _check_float(alpha, "alpha")
    if solver not in _SOLVERS:
        raise ValueError(f"solver must be one of {', '.join(map(repr, _SOLVERS))}, but is {solver!r}")
    tol = _check_float(tol, "tol")
    max_iter = _check_int(max_iter, "max_iter", 1)
    if not isinstance(center, (bool, np.bool_)):
        raise ValueError(f"center must be True or False, but is {center!r}; to centre by given means, "
                         f"subtract them from B's model yourself")
    d = X.shape[1]
    dtype = working_dtype(X.dtype, B.dtype)
    if solver == "auto":
        solver = "cholesky" if d <= MAX_GRAM_FEATURES else "dual" if dual_applies(X.shape[0]) else "cg"
    if solver != "cg" and x0 is not None:
        raise ValueError(f"x0 is a CG warm start; solver={solver!r} does not use it (drop x0 or use solver='cg')")
    system = _System(X, B, alpha, scale_alpha, weights, bool(center), split_every)
    if solver == "cg":
        result = _cg(system, tol, max_iter, x0)
    else:
        result = (_cholesky if solver == "cholesky" else _dual)(system)
    coef = result.coef.astype(dtype, copy=False)
    intercept = None if result.intercept is None else result.intercept.astype(dtype, copy=False)
    if vector:
        coef = coef[:, 0]
        intercept = None if intercept is None else intercept[0]
    return replace(result, coef=coef, intercept=intercept)


@dataclass(frozen=True)
class _System:
    """The least-squares problem of :func:`ridge_lstsq`, checked: what every solver needs."""

    X: da.Array
    B: da.Array
    alpha: float
    scale_alpha: bool
    weights: object
    center: bool
    split_every: int


def _b_mean(B, weights, split_every):
    """Lazy weighted column mean of ``B``: column sums and total weight, as one chunk."""
    return column_sums(B, weights=weights, split_every=split_every)


def _cholesky(system: _System) -> LstsqResult:
    X, B, alpha, weights, center, split_every = (system.X, system.B, system.alpha, system.weights, system.center,
                                                 system.split_every)
    f64 = np.float64
    G = gram(X, weights=weights, center=center, dtype=f64, split_every=split_every)
    R = xt_b(X, B, weights=weights, center=center, split_every=split_every)
    lazy = [G, R]
    if center:
        lazy += [*column_moments(X, weights=weights, split_every=split_every)[:1], _b_mean(B, weights, split_every),
                 _total_weight(X, weights, split_every)]
    computed = dask.compute(*lazy)
    G, R = computed[0], np.asarray(computed[1], dtype=f64)
    d = G.shape[0]
    lam = alpha * np.trace(G) / d if system.scale_alpha else alpha
    Z, rel = _ridge_solve(G, R, lam, "X^T W X", "the features are collinear or empty")
    intercept = None
    if center:
        mu, bsum, total = (np.asarray(a, dtype=f64) for a in computed[2:])
        intercept = bsum / total - mu @ Z
    return LstsqResult(Z, intercept, float(lam), "cholesky", n_passes=1, n_iter=0, converged=True,
                       residual=rel)


def dual_applies(n_rows: int) -> bool:
    """Whether ``solver="auto"`` takes the dual for ``n_rows`` rows (beyond :data:`MAX_GRAM_FEATURES` features): at
    most :data:`MAX_DUAL_ROWS` rows, and the rows' float64 Gram matrix, computed as one block by one task and
    copied by the solve, at most a quarter of the smallest worker's memory limit per thread
    (:func:`~xmldask.scheduling.task_memory_limit`; any size without a limit)."""
    limit = task_memory_limit()
    return n_rows <= MAX_DUAL_ROWS and (limit is None or 4 * 8 * n_rows * n_rows <= limit)


def _ridge_solve(A: np.ndarray, rhs: np.ndarray, lam: float, name: str, cause: str):
    """``(A + lam I)^{-1} rhs`` by Cholesky (``A`` gets the ridge in place) and the function of no argument that
    computes its relative residual (the product ``A Z`` costs as much as the solve, so it is made only when read); a
    system that is not positive definite raises a ValueError naming it (``name``), the likely ``cause`` and the
    fix."""
    A[np.diag_indices_from(A)] += lam
    try:
        factor = scipy.linalg.cho_factor(A, lower=True, check_finite=True)
    except np.linalg.LinAlgError:
        raise ValueError(
            f"{name} + lam I ({A.shape[0]} x {A.shape[0]}, lam = {lam:.3g}) is not positive definite: {cause} and "
            f"the ridge is {'zero' if lam == 0 else 'too small'}; fix: pass alpha > 0 (e.g. alpha=1e-6)"
        ) from None
    Z = scipy.linalg.cho_solve(factor, rhs)
    return Z, lambda: _relative(rhs - A @ Z, rhs)


def gather_rows(A, *, sparse: bool = False):
    """A row-chunked Dask array (dense or sparse blocks) as one in-memory matrix: dense, or CSR with ``sparse``
    (for few rows).

    Its blocks are computed as Delayed objects, on their own: dask 2026.8's ``dask.compute(array, [delayed], array)``
    hands back its results out of order (collections of one kind are grouped; computing delayed objects between
    arrays gives the second array's result to the delayed slot).
    """
    blocks = dask.compute(*A.to_delayed().ravel()) if isinstance(A, da.Array) else [A]
    if sparse:
        return sp.vstack([sp.csr_matrix(b) for b in blocks], format="csr")
    return np.concatenate([b.toarray() if sp.issparse(b) else np.asarray(b) for b in blocks], axis=0)


def _dual(system: _System) -> LstsqResult:
    """The exact solution through the rows' Gram matrix: ``Z = X_c^T W^{1/2} (W^{1/2} K_c W^{1/2} + lam I)^{-1}
    W^{1/2} B_c`` on the rows of positive weight, ``K_c`` the Gram matrix of the (weighted-mean) centred rows."""
    X, B, alpha, weights, center = system.X, system.B, system.alpha, system.weights, system.center
    f64 = np.float64
    n, d = X.shape
    K, w = dask.compute(row_gram(X, dtype=f64), _as_weights(weights, X))
    B = gather_rows(B).astype(f64, copy=False)
    w = np.ones(n) if w is None else np.asarray(w, dtype=f64).ravel()
    rows = np.flatnonzero(w > 0)
    if not rows.size:
        raise ValueError(f"every one of the {n} rows has weight 0: there is nothing to fit")
    ws = w[rows]
    total = ws.sum()
    K = np.asarray(K, dtype=f64)[np.ix_(rows, rows)]
    Bs = B[rows]
    b_mean = ws @ Bs / total if center else None
    if center:  # K_c = (I - 1 w^T / t) K (I - w 1^T / t) on these rows
        m = K @ ws / total
        K -= m[:, None]
        K -= m[None, :]
        K += ws @ m / total
        Bs = Bs - b_mean
    root = np.sqrt(ws)
    M = K
    M *= root[:, None]
    M *= root[None, :]
    rhs = root[:, None] * Bs
    lam = alpha * np.trace(M) / d if system.scale_alpha else alpha
    A, rel = _ridge_solve(M, rhs, lam, "W^(1/2) X X^T W^(1/2)", "rows repeat or are empty")
    coeffs = np.zeros((n, A.shape[1]))
    coeffs[rows] = root[:, None] * A
    if center:  # X_c^T a = X^T (a - w (1^T a) / t); mu = X^T w / t from the same pass
        coeffs -= np.outer(w, coeffs.sum(axis=0) / total)
        coeffs = np.hstack([coeffs, w[:, None] / total])
    Z = np.asarray(xt_b(X, coeffs, split_every=system.split_every).compute(), dtype=f64)
    intercept = None
    if center:
        Z, mu = Z[:, :-1], Z[:, -1]
        intercept = b_mean - mu @ Z
    return LstsqResult(Z, intercept, float(lam), "dual", n_passes=2, n_iter=0, converged=True,
                       residual=rel)


def _total_weight(X, weights, split_every):
    """Lazy total weight ``1^T w`` (``n_samples`` without weights) as a 0-d array."""
    if weights is None:
        return da.from_array(np.asarray(X.shape[0], dtype=np.float64))
    ones = da.ones((X.shape[0], 1), chunks=(X.chunks[0], 1), dtype=np.float64)
    return column_sums(ones, weights=weights, split_every=split_every)[0]


def _relative(residual: np.ndarray, rhs: np.ndarray) -> np.ndarray:
    num = np.linalg.norm(residual, axis=0)
    den = np.linalg.norm(rhs, axis=0)
    return np.where(den > 0, num / np.where(den > 0, den, 1), 0.0)


def _cg(system: _System, tol: float, max_iter: int, x0) -> LstsqResult:
    """Jacobi-preconditioned conjugate gradients on ``(X^T W X + lam I) Z = X^T W B``: one pass for the
    right-hand side and the diagonal (:func:`_first_pass`), then one pass per iteration."""
    x0 = _checked_start(x0, system.X.shape[1], system.B.shape[1])
    first = _first_pass(system, x0)
    apply = _normal_operator(system, first)
    # The iterates are kept transposed, one row per right-hand side (k x d, C order): selecting the
    # active columns is then a gather of contiguous rows, not a strided copy of a d x k matrix.
    Z = np.zeros(first.rhs.T.shape) if x0 is None else np.ascontiguousarray(x0.T)
    n_passes = 1
    if x0 is None:
        R = np.ascontiguousarray(first.rhs.T)
    elif system.center:
        R = np.ascontiguousarray(first.rhs.T) - apply(Z.T).T
        n_passes += 1
    else:  # the warm start's product came with the first pass
        R = np.ascontiguousarray((first.rhs - (first.start_product + first.lam * x0)).T)
    best, best_rel, n_iter = _pcg(apply, Z, R, 1.0 / first.precond, np.linalg.norm(first.rhs, axis=0), tol,
                                  max_iter)
    converged = bool(np.all(best_rel <= tol))
    if not converged:
        logger.info("cg stopped after %d iterations with max relative residual %.3g > tol %.3g", n_iter,
                    best_rel.max(), tol)
    intercept = first.b_mean - first.mean @ best if system.center else None
    return LstsqResult(best, intercept, float(first.lam), "cg", n_passes=n_passes + n_iter, n_iter=n_iter,
                       converged=converged, residual=best_rel)


def _checked_start(x0, d: int, k: int) -> np.ndarray | None:
    """The warm start as a float64 ``(d, k)`` array, or ``None`` for none (or an all-zero one)."""
    if x0 is None:
        return None
    x0 = np.asarray(x0, dtype=np.float64)
    if x0.ndim == 1:
        x0 = x0[:, None]
    if x0.shape != (d, k):
        raise ValueError(f"x0 must have shape ({d}, {k}) like the solution, but has shape {x0.shape}")
    if not np.all(np.isfinite(x0)):
        raise ValueError("x0 must be finite")
    return x0 if np.any(x0) else None


@dataclass(frozen=True)
class _FirstPass:
    """What CG's first pass gives (float64): the right-hand side ``X^T W B`` (centred), the ridge ``lam``,
    the Jacobi preconditioner ``diag(X^T W X) + lam``, ``X``'s column means and ``B``'s (for the
    intercept), and ``X^T W X x0`` when a warm start without centring fused it into the pass."""

    rhs: np.ndarray
    lam: float
    precond: np.ndarray
    mean: np.ndarray
    b_mean: np.ndarray | None
    start_product: np.ndarray | None


def _first_pass(system: _System, x0: np.ndarray | None) -> _FirstPass:
    X, B, weights, split_every = system.X, system.B, system.weights, system.split_every
    mean, second = column_moments(X, weights=weights, split_every=split_every)
    lazy = [xt_b(X, B, weights=weights, center=system.center, split_every=split_every), mean, second,
            _total_weight(X, weights, split_every)]
    if system.center:
        lazy.append(_b_mean(B, weights, split_every))
    elif x0 is not None:  # no mean needed first: fuse the warm start's product into this pass
        lazy.append(xt_x_q(X, x0.astype(working_dtype(X.dtype)), weights=weights, split_every=split_every))
    rhs, mean, second, total, *extra = (np.asarray(a, dtype=np.float64) for a in dask.compute(*lazy))
    diag = np.maximum(total * (second - mean**2) if system.center else total * second, 0.0)
    lam = system.alpha * diag.sum() / X.shape[1] if system.scale_alpha else system.alpha
    precond = diag + lam
    if np.any(precond <= 0):
        empty = " after centring" if system.center else ""
        raise ValueError(
            f"{int(np.sum(precond <= 0))} features are empty (all zero{empty}) and the ridge is zero: the normal "
            f"equations are singular; fix: pass alpha > 0 (e.g. alpha=1e-6) or drop the empty features"
        )
    return _FirstPass(rhs=rhs, lam=float(lam), precond=precond, mean=mean,
                      b_mean=extra[0] / total if system.center else None,
                      start_product=extra[0] if extra and not system.center else None)


def _normal_operator(system: _System, first: _FirstPass):
    """``P -> (X^T W X + lam I) P`` (centred), one fused pass per call in the data's dtype, float64 out."""
    dtype = working_dtype(system.X.dtype)
    mu = first.mean.astype(dtype) if system.center else None

    def apply(P: np.ndarray) -> np.ndarray:
        out = xt_x_q(system.X, P.astype(dtype), weights=system.weights, center=mu,
                     split_every=system.split_every).compute()
        out = np.asarray(out, dtype=np.float64)
        out += first.lam * P
        return out

    return apply


def _pcg(apply, Z: np.ndarray, R: np.ndarray, inv_precond: np.ndarray, rhs_norm: np.ndarray, tol: float,
         max_iter: int) -> tuple[np.ndarray, np.ndarray, int]:
    """Preconditioned CG on the rows of ``Z`` (``k x d``, one right-hand side a row, residuals ``R``), each
    column stopping at its own relative residual ``tol``: the best iterate of every column ``(d, k)``, its
    relative residual and the number of iterations (one ``apply`` each)."""
    k = Z.shape[0]
    scale = np.where(rhs_norm > 0, rhs_norm, 1.0)
    rel = np.linalg.norm(R, axis=1) / scale
    best, best_rel = Z.copy(), rel.copy()
    active = np.flatnonzero(rel > tol)
    P = R * inv_precond
    rz = np.einsum("ij,ij->i", R, P)
    n_iter = 0
    # the vector algebra is in place where it can be: with many right-hand sides of many features the
    # iterates are large and their copies, not the pass, took the time
    while active.size and n_iter < max_iter:
        every = active.size == k
        Pa = P if every else P[active]
        APa = np.ascontiguousarray(apply(Pa.T).T)
        n_iter += 1
        pap = np.einsum("ij,ij->i", Pa, APa)
        step = np.divide(rz[active], pap, out=np.zeros_like(pap), where=pap > 0)[:, None]
        APa *= step
        Ra = R if every else R[active]
        Ra -= APa
        Pa_step = np.multiply(Pa, step, out=APa)  # APa is no longer needed
        if every:
            Z += Pa_step
        else:
            R[active] = Ra
            Z[active] += Pa_step
        rel[active] = np.linalg.norm(Ra, axis=1) / scale[active]
        improved = active[rel[active] < best_rel[active]]
        best[improved] = Z[improved]
        best_rel[improved] = rel[improved]
        logger.debug("cg iteration %d: %d columns active, max relative residual %.3g", n_iter, active.size,
                     rel[active].max())
        Sa = Ra * inv_precond
        rz_new = np.einsum("ij,ij->i", Ra, Sa)
        beta = np.divide(rz_new, rz[active], out=np.zeros_like(rz_new), where=rz[active] > 0)[:, None]
        if every:
            P *= beta
            P += Sa
        else:
            P[active] = Sa + beta * Pa
        rz[active] = rz_new
        active = active[(rel[active] > tol) & (pap > 0)]
    return np.ascontiguousarray(best.T), best_rel, n_iter
