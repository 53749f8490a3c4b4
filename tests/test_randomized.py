"""Randomized PCA (Algorithm 1) on row blocks against exact in-memory eigendecompositions.

Tolerances. When the sketch is at least as wide as the matrix (``k + p >= n_features``) the range
finder captures the whole range, so in exact arithmetic the result is the exact top-``k``
eigenspace and the only error is rounding. The products ``X^T X Q`` are sums of ``n_samples``
terms computed in the data's dtype: their relative error is at most about ``gamma_n = n eps``
(Higham, eq. 3.5), and by Davis-Kahan a perturbation ``E`` of ``M`` turns the eigenspace by at most
``||E|| / gap``. Hence ``sin(angle) <= C n eps lambda_1 / (lambda_k - lambda_{k+1})`` with a small
constant ``C`` (we use 4), and relative eigenvalue errors ``<= C n eps lambda_1 / lambda_k``.

With a narrower sketch the answer is approximate: the eigenvalues from an orthonormal sketch obey
Cauchy interlacing (never above the exact ones), and with a large spectral gap
(``lambda_{k+1} / lambda_k = r``) the subspace error decays like ``r^(q+1)``.
"""

from __future__ import annotations

import dask.array as da
import numpy as np
import pytest
import scipy.linalg
import scipy.sparse as sp

from xmldask.linalg.randomized import (
    check_random_state,
    eigh_from_sketch,
    gaussian_test_matrix,
    orthonormalize,
    randomized_eigh,
    randomized_pca,
    sketch_width,
)

BLOCKS = (250, 250, 250, 137, 100)  # uneven row blocks
N = sum(BLOCKS)
DTYPES = [np.float32, np.float64]


def _sparse(n, d, seed, density=0.3):
    rng = np.random.default_rng(seed)
    A = sp.random(n, d, density=density, format="csr", random_state=rng, data_rvs=lambda s: rng.uniform(0.5, 2, s))
    return A.astype(np.float32).astype(np.float64)  # float32-representable: both dtypes see the same numbers


def _dask(A, dtype):
    return da.from_array(sp.csr_matrix(A).astype(dtype), chunks=(BLOCKS, -1), asarray=False)


def _sin_angle(U, V) -> float:
    return float(np.sin(scipy.linalg.subspace_angles(U, V)).max())


def _exact(M, k):
    w, U = np.linalg.eigh(M)
    return w[::-1], U[:, ::-1][:, :k]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("center", [False, True])
def test_randomized_pca_exact_when_sketch_covers_range(dtype, center):
    d, k = 18, 5
    A = _sparse(N, d, 1)
    res = randomized_pca(_dask(A, dtype), k, oversample=20, n_iter=1, center=center, random_state=0)
    Ad = A.toarray()
    if center:
        Ad = Ad - Ad.mean(axis=0)
    w, U = _exact(Ad.T @ Ad, k)
    eps = np.finfo(dtype).eps
    angle_tol = 4 * N * eps * w[0] / (w[k - 1] - w[k])
    assert res.n_passes == 2
    assert res.components.shape == (d, k) and res.components.dtype == np.float64
    assert np.allclose(res.components.T @ res.components, np.eye(k), atol=1e-10)
    assert _sin_angle(res.components, U) <= angle_tol
    np.testing.assert_allclose(res.eigenvalues, w[:k], rtol=4 * N * eps * w[0] / w[k - 1])
    np.testing.assert_allclose(res.trace, w.sum(), rtol=4 * N * eps)
    if center:
        np.testing.assert_allclose(res.mean, A.toarray().mean(axis=0), rtol=4 * N * eps)
    else:
        assert res.mean is None


@pytest.mark.parametrize("dtype", DTYPES)
def test_randomized_pca_planted_gap(dtype):
    """A sketch narrower than the matrix: interlacing, and an error shrinking like r^(q+1)."""
    rng = np.random.default_rng(5)
    d, k, r = 120, 6, 0.05
    # planted spectrum: k strong directions, the rest at relative level r
    basis = np.linalg.qr(rng.normal(size=(d, d)))[0]
    scales = np.r_[np.linspace(10, 6, k), np.full(d - k, 6 * np.sqrt(r) * 0.9)]
    Ad = (rng.normal(size=(N, d)) * scales) @ basis.T
    Ad = Ad.astype(np.float32).astype(np.float64)
    X = da.from_array(Ad.astype(dtype), chunks=(BLOCKS, -1))
    w, U = _exact(Ad.T @ Ad, k)
    ratio = w[k] / w[k - 1]
    errors = []
    for q in (0, 1, 2):
        res = randomized_pca(X, k, oversample=10, n_iter=q, random_state=3)
        assert res.n_passes == q + 1
        assert np.all(res.eigenvalues <= w[:k] * (1 + 4 * N * np.finfo(dtype).eps))  # interlacing
        errors.append(_sin_angle(res.components, U))
    # with ||Omega_2 Omega_1^+|| <= 100 (the Gaussian factor; here far below), tan <= 100 r^(q+1)
    for q, err in enumerate(errors):
        assert err <= 100 * ratio ** (q + 1) + 1e-3 * (dtype == np.float32)
    assert errors[2] < errors[0]


def test_randomized_pca_reproducible_and_dtype():
    A = _sparse(N, 30, 2)
    X = _dask(A, np.float32)
    a = randomized_pca(X, 4, random_state=7)
    b = randomized_pca(X, 4, random_state=np.random.default_rng(7))
    np.testing.assert_array_equal(a.components, b.components)
    np.testing.assert_array_equal(a.eigenvalues, b.eigenvalues)


def test_label_covariance_spectrum_uses_y_as_x():
    rng = np.random.default_rng(3)
    Ym = sp.csr_matrix((rng.random((N, 25)) < 0.1).astype(np.float64))
    res = randomized_pca(_dask(Ym, np.float32), 25, oversample=0, random_state=0)
    w, _ = _exact((Ym.T @ Ym).toarray(), 25)
    np.testing.assert_allclose(res.eigenvalues, w, rtol=1e-4, atol=1e-3 * w[0])
    np.testing.assert_allclose(res.trace, Ym.nnz, rtol=1e-6)


def test_randomized_eigh_operator_and_helpers():
    rng = np.random.default_rng(0)
    B = rng.normal(size=(40, 40))
    M = B @ B.T
    calls = []

    def apply(Q):
        calls.append(Q.shape)
        return M @ Q

    V, w, start = randomized_eigh(apply, 40, 5, oversample=35, n_iter=2, random_state=0)
    assert len(calls) == 3 and start.shape == (40, 40)
    ew, EU = _exact(M, 5)
    np.testing.assert_allclose(w, ew[:5], rtol=1e-10)
    assert _sin_angle(V, EU) < 1e-8
    # sign convention: the largest-magnitude entry of each column is positive
    assert np.all(V[np.abs(V).argmax(axis=0), np.arange(5)] > 0)
    Q = orthonormalize(rng.normal(size=(10, 4)))
    assert np.allclose(Q.T @ Q, np.eye(4))
    assert gaussian_test_matrix(3, 2, random_state=0, dtype=np.float32).dtype == np.float32
    V2, w2 = eigh_from_sketch(M @ np.eye(40)[:, :40], 3)
    np.testing.assert_allclose(w2, ew[:3], rtol=1e-10)
    assert sketch_width(5, 20, 12) == 12 and sketch_width(5, 20, 100) == 25


@pytest.mark.parametrize("bad, error", [
    ({"n_components": 0}, ValueError), ({"oversample": -1}, ValueError), ({"n_iter": -1}, ValueError),
    ({"n_components": 31}, ValueError), ({"random_state": "x"}, TypeError), ({"n_components": 2.5}, TypeError),
])
def test_randomized_pca_rejects_bad_parameters(bad, error):
    X = _dask(_sparse(N, 30, 4), np.float64)
    kwargs = {"n_components": 3, **bad}
    with pytest.raises(error):
        randomized_pca(X, kwargs.pop("n_components"), **kwargs)
    with pytest.raises(TypeError, match="dask array"):
        randomized_pca(np.ones((3, 3)), 1)
    assert isinstance(check_random_state(None), np.random.Generator)
