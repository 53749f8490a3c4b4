"""Randomized PCA as an estimator (Algorithm 1), and the PLST and PCA-feature baselines built on it.

- :class:`RandomizedPCA`: top eigenpairs of ``X^T X`` (optionally centred) in ``q + 1`` passes.
- :class:`PLST`: Principal Label Space Transformation, the top eigenvectors of the empirical label
  covariance ``Y^T Y`` (Algorithm 1 with ``Y`` as the data), with Rembrandt's ``fit(X, Y)`` /
  ``transform(Y)`` API (``X`` is not used).
- :class:`PCAEmbedding`: the feature embedding of "PCA + LR", the top principal components of the
  centred ``X``; ``transform(X) = (X - mean) V``.

References
----------
P. Mineiro and N. Karampatziakis, "Fast Label Embeddings via Randomized Linear Algebra", ECML PKDD
2015: Algorithm 1, Sections 2.3 and 4 (PLST, PCA + LR baselines, Tables 2-4, Figure 1b).
F. Tai and H.-T. Lin, "Multilabel classification with principal label space transformation",
Neural Computation 24(9), 2012.
"""

from __future__ import annotations

import numpy as np

from ..linalg.randomized import randomized_pca
from ._base import EmbeddingModel, check_columns, project

__all__ = ["PCAEmbedding", "PLST", "RandomizedPCA"]


class RandomizedPCA(EmbeddingModel):
    """Randomized PCA of ``X^T X`` (Algorithm 1) over a Dask array of row blocks.

    Parameters
    ----------
    n_components : int, default 50
        ``k``.
    oversample : int, default 20
        ``p``.
    n_iter : int, default 1
        ``q``; ``fit`` reads the data ``q + 1`` times.
    center : bool, default False
        Decompose the scatter matrix of the centred ``X`` (classical PCA) instead of ``X^T X``.
    random_state : None, int or numpy.random.Generator
    split_every : int, default 8

    Attributes
    ----------
    components_ : ndarray, shape (n_features, k)
        Orthonormal columns.
    eigenvalues_ : ndarray, shape (k,)
        Eigenvalues of ``X^T X`` (or of the centred scatter matrix), decreasing.
    explained_variance_ratio_ : ndarray, shape (k,)
        ``eigenvalues_ / trace``.
    trace_ : float
        Sum of all eigenvalues.
    mean_ : ndarray of shape (n_features,) or None
        Column means (with ``center=True``).
    n_samples_, n_features_in_, n_passes_ : int

    References
    ----------
    Mineiro & Karampatziakis (2015), Algorithm 1.
    """

    _ARRAYS = ("components", "eigenvalues", "explained_variance_ratio", "mean")
    _SCALARS = ("trace", "n_samples", "n_features_in", "n_passes")
    _required = "components"

    def __init__(self, n_components: int = 50, *, oversample: int = 20, n_iter: int = 1, center: bool = False,
                 random_state=None, split_every: int = 8):
        self.n_components, self.oversample, self.n_iter, self.center = n_components, oversample, n_iter, center
        self.random_state, self.split_every = random_state, split_every

    def _run(self, A) -> None:
        res = randomized_pca(A, self.n_components, oversample=self.oversample, n_iter=self.n_iter,
                             center=self.center, random_state=self.random_state, split_every=self.split_every)
        self.components_ = res.components
        self.eigenvalues_ = res.eigenvalues
        self.trace_ = res.trace
        self.explained_variance_ratio_ = res.eigenvalues / res.trace if res.trace > 0 else np.zeros_like(
            res.eigenvalues)
        self.mean_ = res.mean
        self.n_samples_ = res.n_samples
        self.n_features_in_ = int(A.shape[1])
        self.n_passes_ = res.n_passes
        self.result_ = res

    def fit(self, X, Y=None):
        """Fit on the row blocks of ``X`` (``Y`` is ignored).

        Parameters
        ----------
        X : dask.array.Array, shape (n_samples, n_features)
        Y : ignored

        Returns
        -------
        self
        """
        self._run(X)
        return self

    def transform(self, X):
        """Project rows ``X`` (Dask row blocks, a SciPy sparse matrix or an ndarray): ``(X - mean) V`` (``X V``
        without centring), shape ``(n_samples, k)``, lazy for a Dask input."""
        self._check_fitted()
        check_columns(X, self.components_.shape[0], "X", "features")
        return project(X, self.components_, center=self.mean_)

    def fit_transform(self, X, Y=None):
        """``fit(X).transform(X)``."""
        return self.fit(X).transform(X)


class PCAEmbedding(RandomizedPCA):
    """Feature embedding for "PCA + LR": the top principal components of the centred ``X``.

    :class:`RandomizedPCA` with ``center=True`` by default; ``fit(X, Y=None)``, ``transform(X)``.

    References
    ----------
    Mineiro & Karampatziakis (2015), Section 4.1 (Table 2, Figure 1a: "PCA + LR").
    """

    def __init__(self, n_components: int = 50, *, oversample: int = 20, n_iter: int = 1, center: bool = True,
                 random_state=None, split_every: int = 8):
        super().__init__(n_components, oversample=oversample, n_iter=n_iter, center=center,
                         random_state=random_state, split_every=split_every)


class PLST(RandomizedPCA):
    """Principal Label Space Transformation: top eigenvectors of ``Y^T Y`` (Algorithm 1 on ``Y``).

    Same API as :class:`~xmldask.embedding.Rembrandt`: ``fit(X, Y)`` (``X`` unused, may be
    ``None``), ``transform(Y) = Y V``; ``embedding_`` is ``components_``.

    Parameters
    ----------
    n_components : int, default 50
    oversample : int, default 20
    n_iter : int, default 1
    center : bool, default False
        ``False``: the eigenvectors of ``Y^T Y`` as in the Rembrandt paper; ``True``: of the
        covariance of the shifted labels, as in Tai & Lin's PLST (then ``transform`` subtracts the
        label means).
    random_state : None, int or numpy.random.Generator
    split_every : int, default 8

    References
    ----------
    Tai & Lin (2012); Mineiro & Karampatziakis (2015), Section 2.3 and Table 4.
    """

    _SCALARS = RandomizedPCA._SCALARS + ("n_labels_in",)

    def __init__(self, n_components: int = 50, *, oversample: int = 20, n_iter: int = 1, center: bool = False,
                 random_state=None, split_every: int = 8):
        super().__init__(n_components, oversample=oversample, n_iter=n_iter, center=center,
                         random_state=random_state, split_every=split_every)

    @property
    def embedding_(self):
        return getattr(self, "components_", None)

    def fit(self, X, Y):
        """Fit on the row blocks of ``Y`` (``X`` is ignored).

        Parameters
        ----------
        X : ignored (may be None)
        Y : dask.array.Array, shape (n_samples, n_labels)

        Returns
        -------
        self
        """
        self._run(Y)
        self.n_labels_in_ = self.n_features_in_
        return self

    def transform(self, Y):
        """Embed label rows: ``(Y - mean) V`` (``Y V`` without centring)."""
        return super().transform(Y)

    def fit_transform(self, X, Y):
        """``fit(X, Y).transform(Y)``."""
        return self.fit(X, Y).transform(Y)
