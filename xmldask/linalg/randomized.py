"""Randomized range finder and randomized PCA (Algorithm 1 of Mineiro & Karampatziakis) on row blocks.

Three small steps, each usable alone:

1. :func:`gaussian_test_matrix`: the random start ``Q = randn(n, k + p)`` in the data's dtype;
2. :func:`randomized_eigh`: the randomized range finder for a symmetric positive semi-definite
   operator ``M`` that is only available through products ``Q -> M Q`` (``q`` power iterations, each
   followed by an orthogonalization), then the "small" eigenproblem on ``F = (M Q)^T (M Q)`` of size
   ``(k + p) x (k + p)`` and the back-substitution ``V = (M Q) U Sigma^+``;
3. :func:`randomized_pca`: ``M = X^T X`` (optionally centred) with ``X`` a Dask array of row blocks,
   one fused ``X^T (X Q)`` pass per product (:func:`xmldask.linalg.xt_x_q`): ``q + 1`` passes over the
   data in all (two for ``q = 1``). Use ``Y`` as ``X`` for the empirical label covariance ``Y^T Y``.

The same :func:`randomized_eigh` drives Rembrandt (Algorithm 2, :mod:`xmldask.embedding.rembrandt`)
with the operator ``Q -> Y^T X argmin_Z ||Y Q - X Z||^2``.

Random operands are drawn in the data's dtype (a float64 operand would double the time of a float32
pass); the small dense algebra (QR of the ``n x (k + p)`` sketch, the ``(k + p) x (k + p)``
eigenproblem) runs in float64. Results are deterministic for a given ``random_state`` and row
chunking, whatever the scheduler or number of workers: the random matrix is drawn in the calling
process and the tree sums of the passes add the block results in a fixed order.

References
----------
P. Mineiro and N. Karampatziakis, "Fast Label Embeddings via Randomized Linear Algebra", ECML PKDD
2015, arXiv:1412.6547: Algorithm 1 (randomized PCA) and Algorithm 2 (Rembrandt).
N. Halko, P.-G. Martinsson and J. A. Tropp, "Finding structure with randomness: probabilistic
algorithms for constructing approximate matrix decompositions", SIAM Review 53(2), 2011:
Algorithm 4.3 (randomized power iteration) and 4.4 (randomized subspace iteration).

Examples
--------
>>> import dask.array as da, numpy as np, scipy.sparse as sp
>>> from xmldask.linalg.randomized import randomized_pca
>>> A = sp.random(2000, 20, density=0.2, format="csr", dtype=np.float64, random_state=0)
>>> X = da.from_array(A, chunks=(500, -1), asarray=False)
>>> res = randomized_pca(X, 5, random_state=0)
>>> res.components.shape, res.n_passes
((20, 5), 2)
>>> exact = np.linalg.eigvalsh((A.T @ A).toarray())[::-1][:5]  # exact: k + p >= n_features
>>> bool(np.allclose(res.eigenvalues, exact, rtol=1e-6))
True
"""

from __future__ import annotations

import logging
import numbers
from collections.abc import Callable
from dataclasses import dataclass

import dask
import dask.array as da
import numpy as np
import scipy.linalg

from ._kernels import working_dtype
from .passes import column_moments, xt_x_q

__all__ = [
    "RandomizedPCAResult",
    "check_random_state",
    "eigh_from_sketch",
    "gaussian_test_matrix",
    "orthonormalize",
    "randomized_eigh",
    "randomized_pca",
    "sketch_width",
]

logger = logging.getLogger(__name__)


# --------------------------------------------------------------------------------------------
# small dense helpers (NumPy only)


def check_random_state(random_state) -> np.random.Generator:
    """Normalize ``random_state`` (``None``, an int, a ``SeedSequence`` or a ``Generator``) to a Generator.

    Parameters
    ----------
    random_state : None, int, numpy.random.SeedSequence or numpy.random.Generator
        ``None`` gives fresh OS entropy (non-reproducible); an int or ``SeedSequence`` seeds a new
        PCG64 generator; a ``Generator`` is used as is (and advanced).

    Returns
    -------
    numpy.random.Generator
    """
    if isinstance(random_state, np.random.Generator):
        return random_state
    if random_state is None or isinstance(random_state, np.random.SeedSequence):
        return np.random.default_rng(random_state)
    if isinstance(random_state, numbers.Integral) and not isinstance(random_state, bool):
        if random_state < 0:
            raise ValueError(f"random_state must be a non-negative integer, but is {random_state}")
        return np.random.default_rng(int(random_state))
    raise TypeError(f"random_state must be None, an int, a SeedSequence or a numpy Generator, "
                    f"but is {type(random_state).__name__}")


def _check_count(name: str, value, *, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be an integer, but is {value!r}")
    if value < minimum:
        raise ValueError(f"{name} must be at least {minimum}, but is {value}")
    return int(value)


def sketch_width(n_components: int, oversample: int, n: int) -> int:
    """Columns of the random sketch: ``k + p``, at most ``n`` (a wider sketch cannot add anything).

    Parameters
    ----------
    n_components : int
        ``k``, at least 1 and at most ``n``.
    oversample : int
        ``p``, at least 0.
    n : int
        Order of the operator (``n_features`` for ``X^T X``, ``n_labels`` for Rembrandt).

    Returns
    -------
    int
    """
    k = _check_count("n_components", n_components, minimum=1)
    p = _check_count("oversample", oversample, minimum=0)
    if k > n:
        raise ValueError(f"n_components must be at most {n} (the order of the matrix), but is {k}; lower it")
    return min(k + p, n)


def gaussian_test_matrix(n_rows: int, n_cols: int, *, random_state=None, dtype=np.float64) -> np.ndarray:
    """Standard Gaussian matrix ``randn(n_rows, n_cols)`` drawn directly in ``dtype``.

    Parameters
    ----------
    n_rows, n_cols : int
    random_state : None, int or numpy.random.Generator
    dtype : float32 or float64

    Returns
    -------
    ndarray, shape (n_rows, n_cols)
    """
    rng = check_random_state(random_state)
    dtype = np.dtype(dtype)
    if dtype not in (np.dtype(np.float32), np.dtype(np.float64)):
        raise ValueError(f"dtype must be float32 or float64, but is {dtype}")
    return rng.standard_normal((n_rows, n_cols), dtype=dtype)


def orthonormalize(A) -> np.ndarray:
    """Orthonormal basis of the range of ``A`` (thin QR in float64, ``diag(R) >= 0`` for a unique answer).

    Parameters
    ----------
    A : array_like, shape (n, m), n >= m

    Returns
    -------
    ndarray, shape (n, m), float64
        ``Q`` with ``Q^T Q = I`` and ``range(Q) = range(A)`` when ``A`` has full column rank.
    """
    A = np.asarray(A, dtype=np.float64)
    Q, R = scipy.linalg.qr(A, mode="economic", check_finite=True)
    signs = np.where(np.diag(R) < 0, -1.0, 1.0)
    return Q * signs


def _flip_signs(V: np.ndarray) -> np.ndarray:
    """Make the entry of largest magnitude of every column positive (a deterministic sign convention)."""
    if V.size == 0:
        return V
    rows = np.argmax(np.abs(V), axis=0)
    signs = np.sign(V[rows, np.arange(V.shape[1])])
    signs[signs == 0] = 1.0
    return V * signs


def eigh_from_sketch(Psi, n_components: int) -> tuple[np.ndarray, np.ndarray]:
    """Lines 9-11 of Algorithms 1 and 2: top eigenpairs of ``M`` from ``Psi = M Q``.

    ``F = Psi^T Psi`` (``(k + p) x (k + p)``) has eigenvalues ``Sigma^2``; ``V = Psi U Sigma^+``.
    When ``Q`` has orthonormal columns spanning an invariant subspace of ``M``, the columns of ``V``
    are exact eigenvectors of ``M`` and ``Sigma`` its eigenvalues.

    Parameters
    ----------
    Psi : array_like, shape (n, m)
        ``M Q`` for the (orthonormalized) sketch ``Q``.
    n_components : int
        ``k <= m`` eigenpairs to return.

    Returns
    -------
    V : ndarray, shape (n, k), float64
        Orthonormal columns (for eigenvalues that are not zero; a column for a zero eigenvalue is
        zero), sign-normalized: the entry of largest magnitude of each column is positive.
    eigenvalues : ndarray, shape (k,), float64
        ``Sigma``, in decreasing order (the eigenvalues of ``M`` for a PSD ``M``).

    References
    ----------
    Mineiro & Karampatziakis (2015), Algorithm 1 lines 9-11 and Algorithm 2 lines 9-11.
    """
    Psi = np.asarray(Psi, dtype=np.float64)
    k = int(n_components)
    if not 1 <= k <= Psi.shape[1]:
        raise ValueError(f"n_components must be between 1 and {Psi.shape[1]}, but is {k}")
    F = Psi.T @ Psi
    F = (F + F.T) / 2
    w, U = scipy.linalg.eigh(F)
    order = np.argsort(w)[::-1][:k]
    w, U = np.clip(w[order], 0.0, None), U[:, order]
    sigma = np.sqrt(w)
    # Sigma^+: treat eigenvalues at round-off level of the largest as zero
    cutoff = sigma[0] * Psi.shape[1] * np.finfo(np.float64).eps if sigma.size and sigma[0] > 0 else 0.0
    inv = np.divide(1.0, sigma, out=np.zeros_like(sigma), where=sigma > cutoff)
    V = (Psi @ U) * inv
    return _flip_signs(V), sigma


# --------------------------------------------------------------------------------------------
# the range finder for an implicit operator


def randomized_eigh(apply: Callable[[np.ndarray], np.ndarray], n: int, n_components: int, *, oversample: int = 20,
                    n_iter: int = 1, random_state=None, dtype=np.float64, orthonormalize_start: bool = True
                    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Top eigenpairs of a PSD operator ``M`` (``n x n``) known only through ``Q -> M Q``.

    ``Q = randn(n, k + p)``; ``q`` times: ``Q = orth(M Q)``; then ``Psi = M Q`` and
    :func:`eigh_from_sketch`. ``apply`` is called ``q + 1`` times.

    Parameters
    ----------
    apply : callable
        ``apply(Q)`` with ``Q`` an ndarray ``(n, m)`` in ``dtype`` returns ``M Q`` as an array ``(n, m)``.
    n : int
        Order of ``M``.
    n_components : int
        ``k``.
    oversample : int, default 20
        ``p``; the sketch has ``min(k + p, n)`` columns.
    n_iter : int, default 1
        ``q``, power (subspace) iterations before the final product.
    random_state : None, int or numpy.random.Generator
    dtype : numpy dtype, default float64
        dtype of the operands passed to ``apply`` (use the data's dtype).
    orthonormalize_start : bool, default True
        Orthonormalize the Gaussian start before the first product. Algorithm 2 with ``q = p = 0``
        (compressed sensing) uses the raw Gaussian matrix: pass False.

    Returns
    -------
    V : ndarray, shape (n, k), float64
        Approximate top eigenvectors, orthonormal columns.
    eigenvalues : ndarray, shape (k,), float64
        Approximate top eigenvalues ``Sigma``, decreasing.
    start : ndarray, shape (n, min(k + p, n))
        The Gaussian start matrix (before any orthogonalization), in ``dtype``.

    References
    ----------
    Mineiro & Karampatziakis (2015), Algorithm 1 (lines 3-11) and Algorithm 2 (lines 3-11);
    Halko, Martinsson & Tropp (2011), Algorithm 4.4.
    """
    q = _check_count("n_iter", n_iter, minimum=0)
    width = sketch_width(n_components, oversample, n)
    dtype = np.dtype(dtype)
    start = gaussian_test_matrix(n, width, random_state=random_state, dtype=dtype)
    Q = orthonormalize(start).astype(dtype) if orthonormalize_start else start
    for i in range(q):
        Psi = np.asarray(apply(Q))
        logger.debug("randomized range finder: iteration %d of %d done", i + 1, q)
        Q = orthonormalize(Psi).astype(dtype)
    Psi = np.asarray(apply(Q))
    V, eigenvalues = eigh_from_sketch(Psi, n_components)
    return V, eigenvalues, start


# --------------------------------------------------------------------------------------------
# Algorithm 1 on row blocks


@dataclass(frozen=True)
class RandomizedPCAResult:
    """Result of :func:`randomized_pca`.

    Attributes
    ----------
    components : ndarray, shape (n_features, k), float64
        Approximate top eigenvectors of ``Xc^T Xc`` (``Xc = X`` or ``X`` centred), orthonormal columns.
    eigenvalues : ndarray, shape (k,), float64
        The corresponding eigenvalues of ``Xc^T Xc`` (not divided by ``n_samples``), decreasing.
    trace : float
        ``trace(Xc^T Xc)``, the sum of all eigenvalues (for explained-variance ratios), computed in
        the first pass.
    mean : ndarray of shape (n_features,) or None
        Column means of ``X`` when centred.
    n_samples : int
    n_passes : int
        Passes over the data: ``n_iter + 1``.
    """

    components: np.ndarray
    eigenvalues: np.ndarray
    trace: float
    mean: np.ndarray | None
    n_samples: int
    n_passes: int


def randomized_pca(X, n_components: int, *, oversample: int = 20, n_iter: int = 1, center: bool = False,
                   random_state=None, split_every: int = 8) -> RandomizedPCAResult:
    """Randomized PCA of ``X^T X`` (Algorithm 1) in ``n_iter + 1`` passes over the row blocks.

    Parameters
    ----------
    X : dask.array.Array, shape (n_samples, n_features)
        Row blocks (``scipy.sparse`` or dense), one column chunk, known chunk sizes. Pass the label
        matrix ``Y`` for the spectrum of the empirical label covariance ``Y^T Y``.
    n_components : int
        ``k``.
    oversample : int, default 20
        ``p``.
    n_iter : int, default 1
        ``q``; the data are read ``q + 1`` times.
    center : bool, default False
        Decompose the scatter matrix of ``X`` centred by its column mean (classical PCA) instead of
        the uncentred ``X^T X`` of Algorithm 1. Centring is implicit (``X`` is never densified) and
        happens inside each pass (see :func:`xmldask.linalg.xt_x_q`).
    random_state : None, int or numpy.random.Generator
    split_every : int, default 8
        Fan-in of the tree sums.

    Returns
    -------
    RandomizedPCAResult

    References
    ----------
    Mineiro & Karampatziakis (2015), Algorithm 1; Halko, Martinsson & Tropp (2011), Algorithm 4.4.
    """
    if not isinstance(X, da.Array):
        raise TypeError(f"X must be a dask array of row blocks, but is a {type(X).__name__}; wrap an "
                        f"in-memory matrix A with da.from_array(A, chunks=(block_rows, -1), asarray=False)")
    if X.ndim != 2:
        raise ValueError(f"X must be 2-D (n_samples, n_features), but has shape {X.shape}")
    n_samples, d = X.shape
    dtype = working_dtype(X.dtype)
    rng = check_random_state(random_state)
    extras: dict = {}

    def apply(Q: np.ndarray) -> np.ndarray:
        product = xt_x_q(X, Q, center=bool(center), split_every=split_every)
        if extras:  # later passes: the product only
            return product.compute()
        mean, second = column_moments(X, split_every=split_every)
        product, mean, second = dask.compute(product, mean, second)  # one pass: shared block reads
        mean, second = np.asarray(mean, np.float64), np.asarray(second, np.float64)
        extras["mean"] = mean
        extras["trace"] = float(n_samples * (second.sum() - (mean @ mean if center else 0.0)))
        return product

    components, eigenvalues, _ = randomized_eigh(apply, d, n_components, oversample=oversample, n_iter=n_iter,
                                                 random_state=rng, dtype=dtype)
    return RandomizedPCAResult(components=components, eigenvalues=eigenvalues, trace=extras["trace"],
                               mean=extras["mean"] if center else None, n_samples=int(n_samples),
                               n_passes=int(n_iter) + 1)
