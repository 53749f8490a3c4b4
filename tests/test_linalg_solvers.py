"""Blocked ridge least squares (Cholesky and CG) against an in-memory NumPy/SciPy reference.

Tolerances: the reference solves the same ridge system in float64 from the same (float32-
representable) numbers. A backward-stable solve of a system with condition number ``kappa`` whose
matrix and right-hand side carry relative errors ``delta`` has a relative forward error of about
``kappa * delta``. The blocked Gram matrix and right-hand side are sums of at most ``N + 4`` rounded
products (relative error ``<= (N + D + 4) eps``, Higham eq. 3.5; far less in practice), so Cholesky is
checked against ``kappa * (N + D + 4) * eps``. CG adds its stopping tolerance: a relative residual
``tol`` of the normal equations means a relative error of at most ``kappa * tol``.
"""

from __future__ import annotations

import dask
import dask.array as da
import numpy as np
import pytest
import scipy.sparse as sp

from xmldask import linalg
from xmldask.linalg import ridge_lstsq, solvers, x_q
from xmldask.store import open_csr, write_csr

N, D, K = 1037, 23, 4
BLOCKS = (100,) * 10 + (37,)
DTYPES = [np.float32, np.float64]
ALPHA = 1e-2


def _data():
    rng = np.random.default_rng(7)
    A = sp.random(N, D, density=0.25, format="lil", random_state=rng, data_rvs=lambda s: rng.uniform(0.5, 2.0, s))
    A[:, 0] = rng.uniform(0.9, 1.1, (N, 1))  # a nearly constant column: centring matters
    A[[5, 600], :] = 0  # empty rows
    A = A.tocsr().astype(np.float32).astype(np.float64)
    A.eliminate_zeros()
    B = (A @ rng.standard_normal((D, K)) + 0.1 * rng.standard_normal((N, K)) + 3.0).astype(np.float32)
    w = rng.uniform(0.0, 2.0, N).astype(np.float32).astype(np.float64)
    Y = sp.random(N, 9, density=0.2, format="csr", random_state=rng, data_rvs=np.ones)
    return A, B.astype(np.float64), w, Y


A, B, W, Y = _data()


def _reference(A, B, alpha, weights=None, center=False, scale_alpha=True):
    """Plain float64 ridge regression; also the condition number of the system."""
    X = A.toarray() if sp.issparse(A) else np.asarray(A, dtype=np.float64)
    B = B.toarray() if sp.issparse(B) else np.asarray(B, dtype=np.float64)
    w = np.ones(X.shape[0]) if weights is None else np.asarray(weights, dtype=np.float64)
    mu = w @ X / w.sum() if center else np.zeros(X.shape[1])
    Xc = X - mu
    G = Xc.T @ (w[:, None] * Xc)
    lam = alpha * np.trace(G) / X.shape[1] if scale_alpha else alpha
    M = G + lam * np.eye(X.shape[1])
    Z = np.linalg.solve(M, Xc.T @ (w[:, None] * B))
    intercept = (w @ B / w.sum() - mu @ Z) if center else None
    return Z, intercept, lam, np.linalg.cond(M)


def _x(dtype, chunks=BLOCKS):
    return da.from_array(A.astype(dtype), chunks=(chunks, -1), asarray=False)


def _assert_close(got, want, bound, what):
    err = np.linalg.norm(got - want) / max(np.linalg.norm(want), 1e-300)
    assert err <= bound, f"{what}: relative error {err:.3g} > {bound:.3g}"


CASES = [(w, c) for w in (False, True) for c in (False, True)]
CASE_IDS = [f"{'weighted' if w else 'unweighted'}-{'centred' if c else 'raw'}" for w, c in CASES]


@pytest.mark.slow
@pytest.mark.parametrize("dtype", DTYPES, ids=["float32", "float64"])
@pytest.mark.parametrize(("weighted", "center"), CASES, ids=CASE_IDS)
@pytest.mark.parametrize("solver", ["cholesky", "cg", "dual"])
def test_matches_reference(solver, weighted, center, dtype):
    weights = W if weighted else None
    Zref, bref, lam, kappa = _reference(A, B, ALPHA, weights, center)
    eps = np.finfo(dtype).eps
    tol = 1e-10 if dtype == np.float64 else 1e-5
    res = ridge_lstsq(_x(dtype), B.astype(dtype), ALPHA, solver=solver, weights=weights, center=center, tol=tol,
                      max_iter=200)
    assert res.solver == solver and res.coef.dtype == dtype and res.coef.shape == (D, K)
    assert res.alpha == pytest.approx(lam, rel=1e-5 if dtype == np.float32 else 1e-12)
    bound = kappa * ((N + D + 4) * eps + (tol if solver == "cg" else 0))
    _assert_close(res.coef, Zref, bound, "coef")
    if center:
        assert res.intercept.shape == (K,) and res.intercept.dtype == dtype
        # the intercept also carries the error of mu @ Z
        _assert_close(res.intercept, bref, 10 * bound * (1 + np.abs(Zref).sum() / np.linalg.norm(bref)), "intercept")
    else:
        assert res.intercept is None
    assert res.converged
    assert np.all(res.relative_residual <= (tol if solver == "cg" else 100 * (N + D) * eps))
    if solver != "cg":
        assert (res.n_passes, res.n_iter) == ({"cholesky": 1, "dual": 2}[solver], 0)
    else:
        assert res.n_passes == res.n_iter + 1 and 1 <= res.n_iter <= 200


@pytest.mark.parametrize("dtype", DTYPES, ids=["float32", "float64"])
def test_predictions_with_intercept(dtype):
    """``X @ coef + intercept`` is the centred model's prediction."""
    res = ridge_lstsq(_x(dtype), B.astype(dtype), ALPHA, weights=W, center=True)
    Zref, bref, _, _ = _reference(A, B, ALPHA, W, True)
    want = A @ Zref + bref
    got = A @ res.coef.astype(np.float64) + res.intercept
    assert np.abs(got - want).max() <= 1e-3 * np.abs(want).max()


def test_scale_alpha_makes_the_solution_scale_free():
    """With ``lam = alpha * trace / d``, scaling X and B by c leaves Z unchanged; a fixed lam does not."""
    c = 1000.0
    base = ridge_lstsq(_x(np.float64), B, ALPHA, solver="cholesky")
    scaled = ridge_lstsq(da.from_array(A * c, chunks=(BLOCKS, -1), asarray=False), B * c, ALPHA, solver="cholesky")
    np.testing.assert_allclose(scaled.coef, base.coef, rtol=1e-9, atol=1e-12)
    assert scaled.alpha == pytest.approx(base.alpha * c**2)
    fixed = ridge_lstsq(_x(np.float64), B, 5.0, scale_alpha=False, solver="cholesky")
    assert fixed.alpha == 5.0
    _assert_close(fixed.coef, _reference(A, B, 5.0, scale_alpha=False)[0], 1e-9, "fixed lam")


def test_cg_keeps_the_best_iterate_and_reports_passes():
    """CG capped early: the kept iterate is the best seen, its reported residual is the true one."""
    Zref, _, lam, _ = _reference(A, B, 1e-4)
    res = ridge_lstsq(_x(np.float64), B, 1e-4, solver="cg", tol=1e-14, max_iter=3)
    assert not res.converged and res.n_iter == 3 and res.n_passes == 4
    G = A.T @ A
    rhs = A.T @ B
    true = np.linalg.norm(rhs - (G @ res.coef + lam * res.coef), axis=0) / np.linalg.norm(rhs, axis=0)
    np.testing.assert_allclose(res.relative_residual, true, rtol=1e-6)
    # more iterations never make the kept iterate worse
    more = ridge_lstsq(_x(np.float64), B, 1e-4, solver="cg", tol=1e-14, max_iter=6)
    assert np.all(more.relative_residual <= res.relative_residual)
    assert np.linalg.norm(more.coef - Zref) < np.linalg.norm(res.coef - Zref)


@pytest.mark.parametrize("center", [False, True])
def test_cg_warm_start(center):
    """Starting from the solution converges at once; the warm start's product shares the first pass."""
    exact = ridge_lstsq(_x(np.float64), B, ALPHA, solver="cholesky", center=center)
    res = ridge_lstsq(_x(np.float64), B, ALPHA, solver="cg", center=center, x0=exact.coef, tol=1e-8)
    assert res.converged and res.n_iter == 0
    assert res.n_passes == (2 if center else 1)
    np.testing.assert_allclose(res.coef, exact.coef)
    cold = ridge_lstsq(_x(np.float64), B, ALPHA, solver="cg", center=center, tol=1e-8)
    half = ridge_lstsq(_x(np.float64), B, ALPHA, solver="cg", center=center, tol=1e-8, x0=0.5 * exact.coef)
    assert half.converged and half.n_iter <= cold.n_iter


def test_columns_converge_independently():
    """A zero column of B converges at once (zero solution); the others still iterate."""
    B0 = B.copy()
    B0[:, 1] = 0
    res = ridge_lstsq(_x(np.float64), B0, ALPHA, solver="cg", tol=1e-10, max_iter=200)
    assert res.converged and np.all(res.coef[:, 1] == 0) and res.relative_residual[1] == 0
    _assert_close(res.coef, _reference(A, B0, ALPHA)[0], 1e-7, "coef")


@pytest.mark.slow
@pytest.mark.parametrize("solver", ["cholesky", "cg", "dual"])
def test_sparse_and_lazy_right_hand_sides(solver, tmp_path):
    """B = Y (sparse row blocks) and B = Y Q (lazy, computed per block inside the pass), from stores."""
    X = open_csr(write_csr(str(tmp_path / "x.zarr"), A.astype(np.float32), block_rows=128))
    Ys = open_csr(write_csr(str(tmp_path / "y.zarr"), Y.astype(np.float32), block_rows=128))
    Q = np.random.default_rng(0).standard_normal((Y.shape[1], 3)).astype(np.float32)
    for rhs, dense_rhs in ((Ys, Y), (x_q(Ys, Q), Y @ Q)):
        Zref, bref, _, kappa = _reference(A, dense_rhs, ALPHA, center=True)
        res = ridge_lstsq(X, rhs, ALPHA, solver=solver, center=True, tol=1e-6, max_iter=200)
        assert res.coef.dtype == np.float32
        assert res.n_passes == {"cholesky": 1, "dual": 2, "cg": res.n_iter + 1}[solver]
        _assert_close(res.coef, Zref, kappa * 1e-4, "coef")
        _assert_close(res.intercept, bref, kappa * 1e-3, "intercept")


def test_vector_right_hand_side():
    res = ridge_lstsq(_x(np.float64), B[:, 2], ALPHA, center=True)
    Zref, bref, _, _ = _reference(A, B[:, 2:3], ALPHA, center=True)
    assert res.coef.shape == (D,) and np.ndim(res.intercept) == 0
    np.testing.assert_allclose(res.coef, Zref[:, 0], rtol=1e-9, atol=1e-12)
    np.testing.assert_allclose(res.intercept, bref[0], rtol=1e-9)


def test_auto_picks_by_feature_and_row_count(monkeypatch):
    assert ridge_lstsq(_x(np.float64), B, ALPHA).solver == "cholesky"
    monkeypatch.setattr(solvers, "MAX_GRAM_FEATURES", D - 1)
    assert ridge_lstsq(_x(np.float64), B, ALPHA).solver == "dual"
    monkeypatch.setattr(solvers, "MAX_DUAL_ROWS", N - 1)
    assert ridge_lstsq(_x(np.float64), B, ALPHA, max_iter=2).solver == "cg"


def test_dual_only_where_the_rows_gram_matrix_fits_a_quarter_of_a_workers_task(monkeypatch):
    monkeypatch.setattr(solvers, "task_memory_limit", lambda: None)  # no client, or no limit: the row count decides
    assert solvers.dual_applies(solvers.MAX_DUAL_ROWS) and not solvers.dual_applies(solvers.MAX_DUAL_ROWS + 1)
    monkeypatch.setattr(solvers, "task_memory_limit", lambda: 256 << 20)  # 4 x 8 n^2 <= 256 MiB: n <= 2896
    assert solvers.dual_applies(2896) and not solvers.dual_applies(2897)
    monkeypatch.setattr(solvers, "MAX_GRAM_FEATURES", D - 1)
    monkeypatch.setattr(solvers, "task_memory_limit", lambda: 32 * N * N - 1)
    assert ridge_lstsq(_x(np.float64), B, ALPHA, max_iter=2).solver == "cg"


def test_dual_with_lazy_weights_and_right_hand_side_between_them():
    """The classifier's call: ``B = Y Q`` and the weights both lazy, one row block each way (the dual computes the
    rows' Gram matrix, ``B`` and the weights; dask 2026.8 returned a Delayed between two arrays out of order)."""
    Ys = da.from_array(Y.astype(np.float32), chunks=(BLOCKS, -1), asarray=False)
    Q = np.random.default_rng(1).standard_normal((Y.shape[1], 3)).astype(np.float32)
    w = da.from_array(W, chunks=(BLOCKS,)).map_blocks(lambda b: b * 1.0, dtype=np.float64)
    res = ridge_lstsq(_x(np.float32), x_q(Ys, Q), ALPHA, solver="dual", weights=w, center=True)
    Zref, bref, _, kappa = _reference(A, Y @ Q, ALPHA, W, True)
    _assert_close(res.coef, Zref, kappa * 1e-5, "coef")
    _assert_close(res.intercept, bref, kappa * 1e-4, "intercept")


def test_dual_uses_only_the_rows_of_positive_weight():
    """Zero-weight rows (the held-out rows of a fit) leave the dual system: the same solution as without them."""
    w = W.copy()
    w[::3] = 0
    keep = w > 0
    res = ridge_lstsq(_x(np.float64), B, ALPHA, solver="dual", weights=w, center=True)
    Zref, bref, _, _ = _reference(A[keep], B[keep], ALPHA, w[keep], True)
    np.testing.assert_allclose(res.coef, Zref, rtol=1e-8, atol=1e-10)
    np.testing.assert_allclose(res.intercept, bref, rtol=1e-8)


def test_same_answer_for_any_chunking_of_the_same_blocks_and_any_split():
    """Different tree shapes agree to rounding; the same graph gives bit-identical results."""
    one = ridge_lstsq(_x(np.float64), B, ALPHA, solver="cg", tol=1e-12, max_iter=200, split_every=2)
    again = ridge_lstsq(_x(np.float64), B, ALPHA, solver="cg", tol=1e-12, max_iter=200, split_every=2)
    np.testing.assert_array_equal(one.coef, again.coef)
    other = ridge_lstsq(_x(np.float64, chunks=(300, 300, 437)), B, ALPHA, solver="cg", tol=1e-12, max_iter=200)
    np.testing.assert_allclose(other.coef, one.coef, rtol=1e-8, atol=1e-12)


@pytest.mark.slow
@pytest.mark.parametrize("solver", ["cholesky", "cg", "dual"])
def test_two_worker_cluster_gives_the_synchronous_answer(solver, client, tmp_path):
    X = open_csr(write_csr(str(tmp_path / "x.zarr"), A.astype(np.float32), block_rows=100))
    kwargs = dict(solver=solver, weights=W, center=True, tol=1e-6, max_iter=100)
    with dask.config.set(scheduler="synchronous"):
        local = ridge_lstsq(X, B.astype(np.float32), ALPHA, **kwargs)
    with client.as_current():
        remote = ridge_lstsq(X, B.astype(np.float32), ALPHA, **kwargs)
    assert (remote.n_passes, remote.n_iter) == (local.n_passes, local.n_iter)
    eps = np.finfo(np.float32).eps
    # same blocks, same reduction tree: equal up to a few ulps (BLAS kernels may differ per process)
    np.testing.assert_allclose(remote.coef, local.coef, rtol=64 * eps, atol=64 * eps * np.abs(local.coef).max())
    np.testing.assert_allclose(remote.intercept, local.intercept, rtol=64 * eps)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        (dict(solver="lu"), "solver must be one of"),
        (dict(alpha=-1.0), "alpha must be a non-negative"),
        (dict(alpha=float("nan")), "alpha must be"),
        (dict(tol=-1e-3), "tol must be"),
        (dict(max_iter=0), "max_iter must be an integer of at least 1"),
        (dict(center=np.zeros(D)), "center must be True or False"),
        (dict(solver="cholesky", x0=np.zeros((D, K))), "x0 is a CG warm start"),
        (dict(solver="dual", x0=np.zeros((D, K))), "x0 is a CG warm start"),
        (dict(solver="cg", x0=np.zeros((D, K + 1))), r"x0 must have shape \(23, 4\)"),
    ],
)
def test_bad_parameters(kwargs, match):
    kwargs = {"alpha": ALPHA, **kwargs}
    with pytest.raises(ValueError, match=match):
        ridge_lstsq(_x(np.float64), B, **kwargs)


def test_dual_refuses_rows_that_all_weigh_nothing():
    with pytest.raises(ValueError, match="every one of the 1037 rows has weight 0"):
        ridge_lstsq(_x(np.float64), B, ALPHA, solver="dual", weights=np.zeros(N), center=True)


def test_misaligned_right_hand_side():
    with pytest.raises(ValueError, match="B has 10 rows but X has 1037"):
        ridge_lstsq(_x(np.float64), B[:10], ALPHA)
    with pytest.raises(ValueError, match="B's row blocks must be X's"):
        ridge_lstsq(_x(np.float64), da.from_array(B, chunks=(500, -1)), ALPHA)


@pytest.mark.parametrize("solver", ["cholesky", "cg", "dual"])
def test_singular_system_without_ridge(solver):
    A0 = A.tolil()
    A0[:, 3] = 0  # an empty feature makes X^T X singular
    X0 = da.from_array(A0.tocsr(), chunks=(BLOCKS, -1), asarray=False)
    with pytest.raises(ValueError, match="alpha > 0"):
        ridge_lstsq(X0, B, 0.0, solver=solver)
    assert ridge_lstsq(X0, B, 1e-6, solver=solver, max_iter=5).coef[3].tolist() == [0.0] * K


def test_exported():
    assert linalg.ridge_lstsq is ridge_lstsq and linalg.LstsqResult is solvers.LstsqResult
