"""Rembrandt (Algorithm 2 of Mineiro & Karampatziakis) and the compressed-sensing baseline, out of core.

Rembrandt embeds the labels with the top right singular vectors of ``Pi_X Y``, the predictions of
the (ridge) least-squares model of ``Y`` on ``X``, equivalently the top eigenvectors of
``M = Y^T Pi_X Y``. ``M`` is never formed: a product ``M Q`` costs one blocked least-squares solve
``Z = argmin ||Y Q - X Z||^2 + lam ||Z||^2`` (:func:`xmldask.linalg.solvers.ridge_lstsq`, with the
lazy right-hand side ``x_q(Y, Q)``) and one fused pass ``Y^T (X Z)`` (:func:`xmldask.linalg.yt_x_z`),
inside the randomized range finder :func:`xmldask.linalg.randomized.randomized_eigh`.

Passes over the data: ``q + 1`` products, each one solve (1 pass with Cholesky, ``1 + iterations``
with CG) plus one ``Y^T X Z`` pass; plus one solve for the feature-side map when asked. When the
solve is by Cholesky (few features) and ``X^T Y`` is small (at most :data:`MAX_CROSS_ENTRIES`
entries), one pass accumulates ``X^T X``, ``X^T Y`` and the label sums instead, and every product
``M Q = (X^T Y)^T (X^T X + lam I)^{-1} (X^T Y) Q`` is then computed in memory: **one pass in all**.
When the solve is in the dual (many features, few rows: :func:`~xmldask.linalg.solvers.dual_applies`),
one pass computes the rows' Gram matrix ``K = X X^T`` and gathers ``Y``, and every product is
``M Q = Y^T K (K + lam I)^{-1} Y Q``, in memory: one pass too (two with the feature-side map).

References
----------
P. Mineiro and N. Karampatziakis, "Fast Label Embeddings via Randomized Linear Algebra", ECML PKDD
2015, arXiv:1412.6547: Algorithm 2 (Rembrandt), Section 2.4 (compressed sensing as Algorithm 2
with ``q = p = 0``), Algorithm 3 line 4 (the feature-side map).
D. Hsu, S. Kakade, J. Langford and T. Zhang, "Multi-label prediction via compressed sensing",
NIPS 2009.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import dask
import dask.array as da
import numpy as np
import scipy.linalg
import scipy.sparse as sp

from ..linalg import working_dtype
from ..linalg.passes import column_mean, column_sums, dense_operand, gram, row_gram, x_q, xt_b, yt_x_z
from ..linalg.randomized import check_random_state, randomized_eigh
from ._base import EmbeddingModel, check_columns, project

__all__ = ["MAX_CROSS_ENTRIES", "CompressedSensing", "Rembrandt", "RembrandtResult", "rembrandt",
           "RembrandtMoments"]

logger = logging.getLogger(__name__)

#: With a Cholesky solve, Rembrandt keeps ``X^T Y`` (dense, float64) in memory when it has at most
#: this many entries (128 MiB), and then makes a single pass over the data.
MAX_CROSS_ENTRIES = 1 << 24


@dataclass(frozen=True)
class RembrandtResult:
    """Result of :func:`rembrandt`.

    Attributes
    ----------
    embedding : ndarray, shape (n_labels, k), float64
        ``V``: orthonormal columns, approximately the top right singular vectors of ``Pi_X Y``.
    eigenvalues : ndarray, shape (k,), float64
        ``Sigma`` of Algorithm 2: eigenvalues of ``Y^T Pi_X Y``, decreasing.
    singular_values : ndarray, shape (k,), float64
        ``sqrt(eigenvalues)``: singular values of ``Pi_X Y``.
    alpha : float
        The ridge ``lam`` used by the least-squares steps.
    n_passes : int
        Passes made over the data (solves included).
    solver_passes : list of int
        Passes of each least-squares solve.
    converged : bool
        Every solve converged.
    feature_map : ndarray of shape (n_features, k) or None
        ``W = argmin ||Y V - X W||^2 + lam ||W||^2`` (Algorithm 3 line 4) when asked.
    intercept : ndarray of shape (k,) or None
        The feature map's intercept (with ``center=True``).
    start : ndarray, shape (n_labels, k + p)
        The Gaussian start matrix (for reproducing the compressed-sensing embedding).
    """

    embedding: np.ndarray
    eigenvalues: np.ndarray
    singular_values: np.ndarray
    alpha: float
    n_passes: int
    solver_passes: list = field(default_factory=list)
    converged: bool = True
    feature_map: np.ndarray | None = None
    intercept: np.ndarray | None = None
    start: np.ndarray | None = None


def _check_pair(X, Y) -> None:
    for name, A in (("X", X), ("Y", Y)):
        if not isinstance(A, da.Array):
            raise TypeError(f"{name} must be a dask array of row blocks (for example open_dataset(url).{name}), but "
                            f"is a {type(A).__name__}; wrap an in-memory matrix A with "
                            f"da.from_array(A, chunks=(block_rows, -1), asarray=False)")
        if A.ndim != 2:
            raise ValueError(f"{name} must be 2-D, but has shape {A.shape}")
    if X.shape[0] != Y.shape[0]:
        raise ValueError(f"X has {X.shape[0]} rows but Y has {Y.shape[0]}; they must hold the same samples")


def rembrandt(X, Y, n_components: int, *, oversample: int = 20, n_iter: int = 1, alpha: float = 1e-3,
              scale_alpha: bool = True, solver: str = "auto", center: bool = False, tol: float = 1e-4,
              max_iter: int = 30, feature_map: bool = False, random_state=None, split_every: int = 8
              ) -> RembrandtResult:
    """Label embedding by Rembrandt (Algorithm 2) over row blocks of ``X`` and ``Y``.

    Parameters
    ----------
    X : dask.array.Array, shape (n_samples, n_features)
        Feature row blocks (``scipy.sparse`` or dense), one column chunk, known chunk sizes.
    Y : dask.array.Array, shape (n_samples, n_labels)
        Label row blocks with ``X``'s row chunks: one-hot rows (multiclass) or binary rows (multilabel).
    n_components : int
        ``k``, the embedding dimension.
    oversample : int, default 20
        ``p``: the sketch has ``min(k + p, n_labels)`` columns.
    n_iter : int, default 1
        ``q``: range-finder iterations before the final product.
    alpha : float, default 1e-3
        Ridge of the least-squares steps, relative to the average per-feature second moment when
        ``scale_alpha`` (as in the reference implementation); it is the bias/variance knob of Section 2.3.
    scale_alpha : bool, default True
    solver : {"auto", "cholesky", "cg"}, default "auto"
        See :func:`xmldask.linalg.solvers.ridge_lstsq`.
    center : bool, default False
        Fit an unpenalised intercept in the least-squares steps (``Pi`` then projects onto the span
        of ``[1, X]``).
    tol, max_iter : float, int
        CG tolerance and iteration limit of each solve.
    feature_map : bool, default False
        Also fit ``W = argmin ||Y V - X W||^2`` (one more solve).
    random_state, split_every
        The seed of the test matrix, and the fan-in of the tree sums (default 8), as in
        :func:`xmldask.linalg.randomized.randomized_pca`.

    Returns
    -------
    RembrandtResult

    References
    ----------
    Mineiro & Karampatziakis (2015), Algorithm 2; its least-squares step is equation (2).
    """
    _check_pair(X, Y)
    rng = check_random_state(random_state)
    dtype = working_dtype(X.dtype, Y.dtype)
    from ..linalg.solvers import ridge_lstsq

    solve_kw = {"alpha": alpha, "scale_alpha": scale_alpha, "solver": solver, "center": center, "tol": tol,
                "max_iter": max_iter, "split_every": split_every}
    state = {"passes": 0, "solver_passes": [], "converged": True, "alpha": None, "label_sums": None}

    def solve(Q: np.ndarray):
        Qd = dense_operand(np.asarray(Q, dtype=dtype), name="Q")
        res = ridge_lstsq(X, x_q(Y, Qd), **solve_kw)
        state["passes"] += res.n_passes
        state["solver_passes"].append(res.n_passes)
        state["converged"] &= bool(res.converged)
        state["alpha"] = res.alpha
        return res

    def apply(Q: np.ndarray) -> np.ndarray:
        res = solve(Q)
        Z = np.asarray(res.coef, dtype=dtype)
        psi = yt_x_z(Y, X, Z, split_every=split_every)
        if center:
            if state["label_sums"] is None:
                psi, sums = dask.compute(psi, column_sums(Y, split_every=split_every))  # one pass
                state["label_sums"] = np.asarray(sums, dtype=np.float64)
            else:
                psi = psi.compute()
            # predictions are X Z + 1 intercept^T: add (Y^T 1) intercept^T
            psi = np.asarray(psi, np.float64) + np.outer(state["label_sums"], np.asarray(res.intercept, np.float64))
        else:
            psi = psi.compute()
        state["passes"] += 1
        logger.debug("rembrandt: product done, %d passes so far", state["passes"])
        return psi

    from ..linalg import solvers

    d, n_labels = X.shape[1], Y.shape[1]
    cholesky = solver == "cholesky" or (solver == "auto" and d <= solvers.MAX_GRAM_FEATURES)
    dual = solver == "dual" or (solver == "auto" and not cholesky and solvers.dual_applies(X.shape[0]))
    in_memory = None
    if cholesky and d * n_labels <= MAX_CROSS_ENTRIES:
        in_memory = _InMemoryNormal.from_data(X, Y, alpha=alpha, scale_alpha=scale_alpha, center=center,
                                              split_every=split_every)
    elif dual:
        in_memory = _InMemoryDual.from_data(X, Y, alpha=alpha, scale_alpha=scale_alpha, center=center,
                                            split_every=split_every)
    if in_memory is not None:
        state.update(passes=1, solver_passes=[1], alpha=in_memory.lam)
        apply = in_memory.apply

        def solve(Q):
            res = in_memory.solve(Q)
            state["passes"] += res.n_passes
            return res

    # Algorithm 2 starts from the raw Gaussian matrix (line 4); with q = 0 that is compressed sensing.
    V, eigenvalues, start = randomized_eigh(apply, Y.shape[1], n_components, oversample=oversample, n_iter=n_iter,
                                            random_state=rng, dtype=dtype, orthonormalize_start=False)
    W = intercept = None
    if feature_map:
        res = solve(V)
        W = np.asarray(res.coef, dtype=np.float64)
        intercept = None if res.intercept is None else np.asarray(res.intercept, dtype=np.float64)
    if not state["converged"]:
        # an inexact solve still gives a subspace of the randomized eigen-iteration (Algorithm 2 fixes
        # the number of steps too), so this is no warning: with the command line's default it cannot be acted on
        logger.info("rembrandt: a least-squares solve stopped at max_iter=%d before tol=%g (the embedding is "
                    "approximate; Rembrandt(max_iter=...) or a larger alpha solves it further)", max_iter, tol)
    return RembrandtResult(embedding=V, eigenvalues=eigenvalues, singular_values=np.sqrt(eigenvalues),
                           alpha=float(state["alpha"]), n_passes=int(state["passes"]),
                           solver_passes=list(state["solver_passes"]), converged=bool(state["converged"]),
                           feature_map=W, intercept=intercept, start=start)


class RembrandtMoments:
    """Rembrandt's embeddings, of any size and seed, from the uncentred ``X^T X``, ``X^T Y`` and ``Y^T 1`` in memory.

    The same embedding as :func:`rembrandt` (``center=False``) computes from the data when its solve is by
    Cholesky and ``X^T Y`` is small (same statistics and ``random_state``: the same ``V``), without a pass,
    and with one factorisation for every ``embedding(k, random_state=...)``: what a search uses to embed
    each candidate from the statistics its candidates share.

    Parameters
    ----------
    G, C, label_sums : array_like
        ``X^T X`` (d, d), ``X^T Y`` (d, n_labels) and ``Y^T 1`` (n_labels,).
    n_samples : int
    alpha, scale_alpha
        As :func:`rembrandt`.
    """

    def __init__(self, G, C, label_sums, n_samples: int, *, alpha: float = 1e-3, scale_alpha: bool = True):
        f64 = np.float64
        self._normal = _InMemoryNormal(np.asarray(G, f64), np.asarray(C, f64), np.asarray(label_sums, f64), n_samples,
                                       alpha=alpha, scale_alpha=scale_alpha)
        self._n_labels = self._normal.C.shape[1]

    @classmethod
    def from_rows_gram(cls, K, Y, n_features: int, *, alpha: float = 1e-3, scale_alpha: bool = True
                       ) -> RembrandtMoments:
        """The same from the rows' Gram matrix ``K = X X^T`` (n, n) and the labels ``Y`` (n, n_labels) in memory: the
        embedding :func:`rembrandt` computes when its solve is in the dual (many features, few rows)."""
        self = cls.__new__(cls)
        self._normal = _InMemoryDual(K, Y, n_features, alpha=alpha, scale_alpha=scale_alpha, center=False)
        self._n_labels = Y.shape[1]
        return self

    def embedding(self, n_components: int, *, oversample: int = 20, n_iter: int = 1, random_state=None,
                  dtype=np.float32) -> np.ndarray:
        """``V`` (n_labels, n_components) as :func:`rembrandt` with these options computes it."""
        V, _, _ = randomized_eigh(self._normal.apply, self._n_labels, n_components, oversample=oversample,
                                  n_iter=n_iter, random_state=check_random_state(random_state), dtype=dtype,
                                  orthonormalize_start=False)
        return V


class _InMemoryNormal:
    """``X^T X``, ``X^T Y`` and the label sums from one pass; least squares and products in memory.

    ``solve(Q)`` returns what :func:`~xmldask.linalg.solvers.ridge_lstsq` of ``Y Q`` on ``X`` would
    (``coef``, ``intercept``) and ``apply(Q)`` returns ``Y^T (X Z + 1 intercept^T)``, both without
    touching the data again (float64 throughout).
    """

    def __init__(self, G, C, label_sums, n_samples: int, *, mean=None, alpha: float, scale_alpha: bool):
        self.C, self.label_sums, self.mean = C, label_sums, mean
        d = G.shape[0]
        self.lam = float(alpha * np.trace(G) / d if scale_alpha else alpha)
        try:
            self.factor = scipy.linalg.cho_factor(G + self.lam * np.eye(d), lower=True)
        except np.linalg.LinAlgError:
            raise ValueError(f"X^T X + lam I ({d} x {d}, lam = {self.lam:.3g}) is not positive definite: the "
                             f"features are collinear or empty; fix: pass alpha > 0 (e.g. alpha=1e-6)") from None
        self.label_means = self.label_sums / n_samples

    @classmethod
    def from_data(cls, X, Y, *, alpha, scale_alpha, center, split_every) -> _InMemoryNormal:
        """The statistics of ``X`` and ``Y`` from one pass (``X`` centred when ``center``)."""
        f64 = np.float64
        lazy = [gram(X, center=center, dtype=f64, split_every=split_every),
                xt_b(X, Y, center=center, split_every=split_every), column_sums(Y, split_every=split_every)]
        if center:
            lazy.append(column_mean(X, split_every=split_every))
        computed = [np.asarray(a, dtype=f64) for a in dask.compute(*lazy)]
        return cls(*computed[:3], X.shape[0], mean=computed[3] if center else None, alpha=alpha,
                   scale_alpha=scale_alpha)

    def solve(self, Q):
        from types import SimpleNamespace

        Q = np.asarray(Q, dtype=np.float64)
        Z = scipy.linalg.cho_solve(self.factor, self.C @ Q)
        intercept = None if self.mean is None else self.label_means @ Q - self.mean @ Z
        return SimpleNamespace(coef=Z, intercept=intercept, n_passes=0, converged=True, alpha=self.lam)

    def apply(self, Q):
        # Y^T (X Z + 1 b^T) = C^T Z + s (ybar^T Q) with C = X_c^T Y (X centred when fitting an intercept)
        res = self.solve(Q)
        Psi = self.C.T @ res.coef
        if self.mean is not None:
            Psi += np.outer(self.label_sums, self.label_means @ np.asarray(Q, dtype=np.float64))
        return Psi


class _InMemoryDual:
    """The rows' Gram matrix ``K = X X^T`` and ``Y`` from one pass; Rembrandt's products in memory (few rows).

    ``apply(Q)`` returns ``Y^T (X Z + 1 intercept^T)`` for the ridge solution ``Z`` of ``Y Q`` on ``X``:
    ``Y^T K_c (K_c + lam I)^{-1} Y_c Q`` (plus the label sums times the mean of ``Y Q`` when centred), with
    ``K_c`` the centred rows' Gram matrix, without touching the data; ``solve(Q)`` maps the dual solution back
    to ``Z = X_c^T A`` (one pass).
    """

    def __init__(self, K, Y, n_features: int, *, X=None, alpha: float, scale_alpha: bool, center: bool,
                 split_every: int = 8):
        K = np.array(K, dtype=np.float64)
        self.X, self.Y, self.center, self.split_every = X, sp.csr_matrix(Y, dtype=np.float64), center, split_every
        self.label_sums = np.asarray(self.Y.sum(axis=0), dtype=np.float64).ravel()
        self.label_means = self.label_sums / K.shape[0]
        if center:
            m = K.mean(axis=1)
            K -= m[:, None]
            K -= m[None, :]
            K += m.mean()
        self.lam = float(alpha * np.trace(K) / n_features if scale_alpha else alpha)
        K[np.diag_indices_from(K)] += self.lam  # K itself is not needed again (apply)
        try:
            self.factor = scipy.linalg.cho_factor(K, lower=True, overwrite_a=True)
        except np.linalg.LinAlgError:
            raise ValueError(f"X X^T + lam I ({K.shape[0]} x {K.shape[0]}, lam = {self.lam:.3g}) is not positive "
                             f"definite: rows repeat or are empty; fix: pass alpha > 0 (e.g. alpha=1e-6)") from None

    @classmethod
    def from_data(cls, X, Y, *, alpha, scale_alpha, center, split_every) -> _InMemoryDual:
        from ..linalg.solvers import gather_rows

        K = row_gram(X, dtype=np.float64).compute()
        return cls(K, gather_rows(Y, sparse=True), X.shape[1], X=X, alpha=alpha, scale_alpha=scale_alpha,
                   center=center, split_every=split_every)

    def _dual(self, Q):
        Q = np.asarray(Q, dtype=np.float64)
        YQ = np.asarray(self.Y @ Q)
        if self.center:
            YQ -= self.label_means @ Q
        return Q, YQ, scipy.linalg.cho_solve(self.factor, YQ)

    def apply(self, Q):
        Q, YQ, A = self._dual(Q)
        # K A = YQ - lam A, since (K + lam I) A = YQ: the rows' predictions without an n x n product
        Psi = np.asarray(self.Y.T @ (YQ - self.lam * A))
        if self.center:
            Psi += np.outer(self.label_sums, self.label_means @ Q)
        return Psi

    def solve(self, Q):
        from types import SimpleNamespace

        Q, _, A = self._dual(Q)
        if self.center:  # X_c^T A = X^T (A - 1 (1^T A) / n), and the mean row X^T 1 / n from the same pass
            n = A.shape[0]
            A = np.hstack([A - A.sum(axis=0) / n, np.full((n, 1), 1 / n)])
        Z = np.asarray(xt_b(self.X, A, split_every=self.split_every).compute(), dtype=np.float64)
        intercept = None
        if self.center:
            Z, mean = Z[:, :-1], Z[:, -1]
            intercept = self.label_means @ Q - mean @ Z
        return SimpleNamespace(coef=Z, intercept=intercept, n_passes=1, converged=True, alpha=self.lam)


class Rembrandt(EmbeddingModel):
    """Rembrandt label embedding (Algorithm 2), out of core on Dask arrays of row blocks.

    Parameters
    ----------
    n_components : int, default 50
        ``k``, the embedding dimension.
    oversample : int, default 20
        ``p``.
    n_iter : int, default 1
        ``q``.
    alpha : float, default 1e-3
        Ridge of the least-squares steps (relative to the average per-feature second moment when
        ``scale_alpha``).
    scale_alpha : bool, default True
    solver : {"auto", "cholesky", "cg"}, default "auto"
    center : bool, default False
        Unpenalised intercept in the least-squares steps.
    tol : float, default 1e-4
    max_iter : int, default 30
    feature_map : bool, default False
        Also fit the feature-side map ``W`` (``feature_map_``), with ``X W ~ Y V``.
    random_state : None, int or numpy.random.Generator
    split_every : int, default 8

    Attributes
    ----------
    embedding_ : ndarray, shape (n_labels, k)
        ``V``; ``transform(Y) = Y V``.
    eigenvalues_ : ndarray, shape (k,)
        Eigenvalues of ``Y^T Pi_X Y`` (``Sigma`` of Algorithm 2).
    singular_values_ : ndarray, shape (k,)
        Singular values of ``Pi_X Y``.
    feature_map_ : ndarray of shape (n_features, k) or None
    intercept_ : ndarray of shape (k,) or None
    alpha_ : float
        The ridge ``lam`` used.
    n_passes_ : int
        Passes made over the data by ``fit``.
    converged_ : bool
    n_features_in_, n_labels_in_ : int

    References
    ----------
    Mineiro & Karampatziakis, "Fast Label Embeddings via Randomized Linear Algebra" (2015), Algorithm 2.

    Examples
    --------
    >>> import dask.array as da, numpy as np, scipy.sparse as sp
    >>> rng = np.random.default_rng(0)
    >>> A = sp.random(600, 30, density=0.3, format="csr", random_state=0)
    >>> labels = np.asarray((A @ rng.normal(size=(30, 8))).argmax(axis=1)).ravel()
    >>> L = sp.csr_matrix((np.ones(600), (np.arange(600), labels)), shape=(600, 8))
    >>> X = da.from_array(A, chunks=(200, -1), asarray=False)
    >>> Y = da.from_array(L, chunks=(200, -1), asarray=False)
    >>> model = Rembrandt(n_components=3, random_state=0).fit(X, Y)
    >>> model.embedding_.shape, model.n_passes_
    ((8, 3), 1)
    >>> model.transform(Y).shape
    (600, 3)
    """

    _ARRAYS = ("embedding", "eigenvalues", "singular_values", "feature_map", "intercept")
    _SCALARS = ("alpha", "n_passes", "converged", "n_features_in", "n_labels_in")

    def __init__(self, n_components: int = 50, *, oversample: int = 20, n_iter: int = 1, alpha: float = 1e-3,
                 scale_alpha: bool = True, solver: str = "auto", center: bool = False, tol: float = 1e-4,
                 max_iter: int = 30, feature_map: bool = False, random_state=None, split_every: int = 8):
        self.n_components, self.oversample, self.n_iter = n_components, oversample, n_iter
        self.alpha, self.scale_alpha, self.solver, self.center = alpha, scale_alpha, solver, center
        self.tol, self.max_iter, self.feature_map = tol, max_iter, feature_map
        self.random_state, self.split_every = random_state, split_every

    def _fit_options(self) -> dict:
        return {"oversample": self.oversample, "n_iter": self.n_iter}

    def fit(self, X, Y):
        """Fit the label embedding.

        Parameters
        ----------
        X : dask.array.Array, shape (n_samples, n_features)
        Y : dask.array.Array, shape (n_samples, n_labels)

        Returns
        -------
        self
        """
        res = rembrandt(X, Y, self.n_components, alpha=self.alpha, scale_alpha=self.scale_alpha, solver=self.solver,
                        center=self.center, tol=self.tol, max_iter=self.max_iter, feature_map=self.feature_map,
                        random_state=self.random_state, split_every=self.split_every, **self._fit_options())
        self.embedding_ = res.embedding
        self.eigenvalues_ = res.eigenvalues
        self.singular_values_ = res.singular_values
        self.feature_map_ = res.feature_map
        self.intercept_ = res.intercept
        self.alpha_ = res.alpha
        self.n_passes_ = res.n_passes
        self.converged_ = res.converged
        self.n_features_in_ = int(X.shape[1])
        self.n_labels_in_ = int(Y.shape[1])
        self.result_ = res
        return self

    def transform(self, Y):
        """Embed label rows ``Y`` (Dask row blocks, a SciPy sparse matrix or an ndarray): ``Y V``, shape
        ``(n_samples, k)`` in ``Y``'s working dtype, lazy with ``Y``'s row chunks for a Dask input."""
        self._check_fitted()
        check_columns(Y, self.embedding_.shape[0], "Y", "labels")
        return project(Y, self.embedding_)

    def fit_transform(self, X, Y):
        """``fit(X, Y).transform(Y)``."""
        return self.fit(X, Y).transform(Y)

    def inverse_transform(self, E):
        """Map embedded rows back to label scores: ``E V^T`` (the squared-loss optimal decoder).

        Parameters
        ----------
        E : ndarray or dask.array.Array, shape (n_samples, k)

        Returns
        -------
        ndarray or dask.array.Array, shape (n_samples, n_labels)
        """
        self._check_fitted()
        V = self.embedding_
        if isinstance(E, da.Array):
            return E @ V.T.astype(working_dtype(E.dtype))
        E = E.toarray() if sp.issparse(E) else np.asarray(E)
        return E @ V.T

    def predict_embedding(self, X):
        """Predicted embedding ``X W (+ intercept)`` from the fitted feature-side map (``feature_map=True``).

        Parameters
        ----------
        X : dask.array.Array, scipy.sparse matrix or ndarray, shape (n_samples, n_features)

        Returns
        -------
        dask.array.Array or ndarray, shape (n_samples, k)
        """
        self._check_fitted()
        if self.feature_map_ is None:
            raise ValueError(f"{type(self).__name__} was fitted without the feature-side map; "
                             f"refit with feature_map=True")
        check_columns(X, self.feature_map_.shape[0], "X", "features")
        out = project(X, self.feature_map_)
        if self.intercept_ is not None:
            out = out + np.asarray(self.intercept_, dtype=out.dtype)
        return out


class CompressedSensing(Rembrandt):
    """Compressed-sensing label embedding: Algorithm 2 with ``q = 0`` and ``p = 0``.

    The embedding is the whitened random projection ``V = (M G) (G^T M^2 G)^{-1/2}`` (up to a
    rotation: ``V = M G U Sigma^{-1}``) of the Gaussian sensing matrix ``G = randn(n_labels, k)``
    through ``M = Y^T Pi_X Y``: one least-squares solve and one pass. Same parameters and
    attributes as :class:`Rembrandt` (without ``oversample`` and ``n_iter``).

    References
    ----------
    Mineiro & Karampatziakis (2015), Section 2.4; Hsu, Kakade, Langford & Zhang, "Multi-label
    prediction via compressed sensing", NIPS 2009.
    """

    def __init__(self, n_components: int = 50, *, alpha: float = 1e-3, scale_alpha: bool = True,
                 solver: str = "auto", center: bool = False, tol: float = 1e-4, max_iter: int = 30,
                 feature_map: bool = False, random_state=None, split_every: int = 8):
        super().__init__(n_components, oversample=0, n_iter=0, alpha=alpha, scale_alpha=scale_alpha, solver=solver,
                         center=center, tol=tol, max_iter=max_iter, feature_map=feature_map,
                         random_state=random_state, split_every=split_every)
        del self.oversample, self.n_iter

    def _fit_options(self) -> dict:
        return {"oversample": 0, "n_iter": 0}
