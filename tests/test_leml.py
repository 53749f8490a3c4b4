"""LEML and binary relevance against in-memory NumPy/SciPy references (Yu et al., ICML 2014)."""

from __future__ import annotations

import dask.array as da
import numpy as np
import pytest
import scipy.sparse as sp

from xmldask.models import _leml_kernels as LK
from xmldask.models.leml import LEML, BinaryRelevance
from xmldask.store.layout import StoreError

CHUNKS = (7, 13, 5, 15)  # uneven row blocks


def _rows(A, chunks=CHUNKS):
    return da.from_array(sp.csr_matrix(A), chunks=(chunks, -1), asarray=False, fancy=False)


def _data(seed=0, n=40, d=12, L=9, dtype=np.float32, observed=None):
    rng = np.random.default_rng(seed)
    X = sp.random(n, d, density=0.5, format="csr", random_state=rng, dtype=np.float64).astype(dtype)
    Y = sp.csr_matrix((rng.random((n, L)) < 0.3).astype(np.float32))
    O = None
    if observed is not None:
        O = sp.csr_matrix(((rng.random((n, L)) < observed) | (Y.toarray() > 0)).astype(np.float32))
    return X, Y, O


def _signs(Y, O):
    A = np.where(Y.toarray() > 0, 1.0, -1.0)
    mask = np.ones_like(A, bool) if O is None else O.toarray() > 0
    return A, mask


def _ref_loss(a, s, loss):
    if loss == "squared":
        return (a - s) ** 2, 2 * (s - a), np.full_like(s, 2.0)
    if loss == "logistic":
        p = 1 / (1 + np.exp(-a * s))
        return np.log1p(np.exp(-a * s)), a * (p - 1), p * (1 - p)
    m = np.maximum(1 - a * s, 0)
    return m ** 2, -2 * a * m, 2.0 * (m > 0)


@pytest.mark.parametrize("loss", ["squared", "logistic", "sqhinge"])
@pytest.mark.parametrize("observed", [None, 0.3])
def test_block_gradient_and_hessp_match_dense_reference(loss, observed):
    X, Y, O = _data(observed=observed)
    rng = np.random.default_rng(1)
    W, H, S = rng.standard_normal((12, 4)), rng.standard_normal((9, 4)), rng.standard_normal((12, 4))
    A, mask = _signs(Y, O)
    Xd = X.toarray().astype(np.float64)
    scores = Xd @ W @ H.T
    value, d1, d2 = _ref_loss(A, scores, loss)
    ref_f = value[mask].sum()
    ref_g = Xd.T @ np.where(mask, d1, 0) @ H
    ref_hv = Xd.T @ np.where(mask, d2 * (Xd @ S @ H.T), 0) @ H
    # small budget: many row sub-batches
    got = LK.block_grad(X, Y, W, H, O, loss=loss, budget=64)
    np.testing.assert_allclose(got[:-1], ref_g, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(got[-1, 0], ref_f, rtol=1e-6)
    hv = LK.block_hessp(X, Y, W, H, S, O, loss=loss, budget=64)
    np.testing.assert_allclose(hv, ref_hv, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("loss", ["squared", "logistic", "sqhinge"])
@pytest.mark.parametrize("observed", [None, 0.3])
def test_identity_h_given_as_none_equals_the_explicit_identity(loss, observed):
    """Binary relevance's ``H = I`` is never formed (``H=None``): the same gradient, Hessian-vector product and
    full squared gradient as with ``np.eye(L)``."""
    X, Y, O = _data(observed=observed)
    rng = np.random.default_rng(3)
    W, S = rng.standard_normal((12, 9)), rng.standard_normal((12, 9))
    eye = np.eye(9)
    np.testing.assert_allclose(LK.block_grad(X, Y, W, None, O, loss=loss, budget=64),
                               LK.block_grad(X, Y, W, eye, O, loss=loss, budget=64), rtol=1e-10, atol=1e-10)
    np.testing.assert_allclose(LK.block_hessp(X, Y, W, None, S, O, loss=loss, budget=64),
                               LK.block_hessp(X, Y, W, eye, S, O, loss=loss, budget=64), rtol=1e-10, atol=1e-10)
    if observed is None and loss == "squared":
        np.testing.assert_allclose(LK.block_sq_full_grad(X, Y, W, None, None),
                                   LK.block_sq_full_grad(X, Y, W, eye, eye), rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("loss", ["squared", "logistic", "sqhinge"])
def test_curvature_is_the_second_derivative_of_loss_terms(loss):
    rng = np.random.default_rng(2)
    a, b = np.where(rng.random(200) < 0.5, 1.0, -1.0), rng.normal(scale=3.0, size=200)
    b[:5] = a[:5]  # the hinge's kink at a b = 1
    np.testing.assert_array_equal(LK.curvature(a, b, loss), LK.loss_terms(a, b, loss, second=True)[2])


def test_full_squared_gradient_kernel():
    X, Y, _ = _data()
    rng = np.random.default_rng(2)
    W, H = rng.standard_normal((12, 3)), rng.standard_normal((9, 3))
    Xd, Yd = X.toarray().astype(np.float64), Y.toarray()
    out = LK.block_sq_full_grad(X, Y, W, H, H.T @ H)
    R = Xd @ W @ H.T - Yd
    np.testing.assert_allclose(out[:-1], Xd.T @ R @ H, rtol=1e-6, atol=1e-9)
    np.testing.assert_allclose(out[-1, 0], (R ** 2).sum(), rtol=1e-6)


def test_mask_must_cover_relevant_labels():
    X, Y, O = _data(observed=0.3)
    O = O.tolil()
    i, j = Y.nonzero()
    O[i[0], j[0]] = 0
    with pytest.raises(ValueError, match="outside its observed-entry mask"):
        LK.signed_entries(Y, sp.csr_matrix(O), Y.shape[1])


def _claim1(X, Y, k):
    """Claim 1: argmin_{rank Z <= k} ||Y - X Z||_F = V_X S_X^-1 M_k, M = U_X^T Y."""
    U, s, Vt = np.linalg.svd(X, full_matrices=False)
    M = U.T @ Y
    Um, sm, Vmt = np.linalg.svd(M, full_matrices=False)
    Mk = (Um[:, :k] * sm[:k]) @ Vmt[:k]
    return Vt.T @ (Mk / s[:, None])


@pytest.mark.slow
@pytest.mark.parametrize("solver", ["gram", "passes"])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_full_label_squared_loss_reaches_claim1_closed_form(dtype, solver):
    rng = np.random.default_rng(3)
    n, d, L, k = 60, 10, 8, 3
    X = sp.random(n, d, density=0.6, format="csr", random_state=rng, dtype=np.float64).astype(dtype)
    X = X + sp.identity(n, format="csr", dtype=dtype)[:, :d] * 2  # full column rank
    # labels with a planted rank-k structure plus noise flips: a clear gap after sigma_k
    C = np.eye(k)[rng.integers(0, k, n)]
    P = (rng.random((k, L)) < 0.5).astype(float)
    Yd = (C @ P > 0).astype(float)
    flip = rng.random((n, L)) < 0.03
    Yd[flip] = 1 - Yd[flip]
    Y = sp.csr_matrix(Yd.astype(np.float32))
    model = LEML(n_components=k, loss="squared", lam=1e-8, n_iter=30, tol=1e-12, max_cg_iter=500, solver=solver,
                 random_state=0)
    model.fit(_rows(X, (11, 20, 29)), _rows(Y, (11, 20, 29)))
    assert model.solver_ == solver
    Xd = X.toarray().astype(np.float64)
    Z_ref = _claim1(Xd, Yd, k)
    Z = model.W_ @ model.H_.T
    # the fitted predictions equal the closed form's (Z itself is identified up to X's null space; X has full rank)
    np.testing.assert_allclose(Xd @ Z, Xd @ Z_ref, atol=1e-5 if dtype == np.float64 else 2e-4)
    np.testing.assert_allclose(Z, Z_ref, atol=1e-4 if dtype == np.float64 else 2e-3)
    assert model.threshold_ == 0.5


def _dense_w_step(Xd, A, mask, H, lam, loss):
    """The W-step of eq. (6) with explicit Kronecker rows x_ij = h_j (x) x_i, solved in memory."""
    from scipy.optimize import minimize

    rows, cols = np.nonzero(mask)
    Xt = np.stack([np.kron(Xd[i], H[j]) for i, j in zip(rows, cols)])  # vec(W) row-major: W[a, b] -> a*k + b
    a = A[rows, cols]
    if loss == "squared":
        dk = Xt.shape[1]
        return np.linalg.solve(2 * Xt.T @ Xt + lam * np.eye(dk), 2 * Xt.T @ a)

    def f(w):
        s = Xt @ w
        v, d1, _ = _ref_loss(a, s, loss)
        return v.sum() + 0.5 * lam * w @ w, Xt.T @ d1 + lam * w

    return minimize(f, np.zeros(Xt.shape[1]), jac=True, method="L-BFGS-B", options={"gtol": 1e-12, "ftol": 0}).x


@pytest.mark.parametrize("loss", ["squared", "logistic", "sqhinge"])
def test_w_step_equals_kronecker_solution(loss):
    from xmldask.models.leml import _Counter, _solve_newton, _solve_quadratic, _WProblem

    X, Y, O = _data(n=30, d=6, L=5, observed=0.4, dtype=np.float32)
    rng = np.random.default_rng(4)
    H = rng.standard_normal((5, 2))
    lam = 0.5
    problem = _WProblem(_rows(X, (9, 14, 7)), _rows(Y, (9, 14, 7)), _rows(O, (9, 14, 7)), H, lam, loss, False,
                        _Counter())
    W0 = np.zeros((6, 2))
    if loss == "squared":
        W, _ = _solve_quadratic(problem, W0, tol=1e-12, max_iter=200)
    else:
        w, _ = _solve_newton(problem.fun_grad, problem.hessp, W0.ravel(), tol=1e-10, max_iter=100)
        W = w.reshape(6, 2)
    A, mask = _signs(Y, O)
    ref = _dense_w_step(X.toarray().astype(np.float64), A, mask, H, lam, loss).reshape(6, 2)
    np.testing.assert_allclose(W, ref, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("loss", ["squared", "logistic", "sqhinge"])
def test_h_step_equals_per_label_solution(loss):
    X, Y, O = _data(n=30, d=6, L=5, observed=0.4)
    model = LEML(n_components=2, loss=loss, lam=0.7, n_iter=1, tol=1e-10, max_newton_iter=100, random_state=5)
    from xmldask.models.leml import _Counter

    Xr, Yr, Or = (_rows(M, (9, 14, 7)) for M in (X, Y, O))
    rng = np.random.default_rng(6)
    W = rng.standard_normal((6, 2))
    p = dict(lam=0.7, loss=loss, tol=1e-10, max_newton_iter=100)
    c = _Counter()
    if loss == "squared":
        H, _ = model._h_step_sq_omega(Xr, Yr, Or, W, 0.7, c)
    else:
        E = model._gather_entries(Yr, Or, c)
        H, _ = model._h_step_newton(Xr, E, W, np.zeros((5, 2)), p, c)
    Z = X.toarray().astype(np.float64) @ W
    A, mask = _signs(Y, O)
    from scipy.optimize import minimize

    for j in range(5):
        Zj, aj = Z[mask[:, j]], A[mask[:, j], j]

        def f(h, Zj=Zj, aj=aj):
            v, d1, _ = _ref_loss(aj, Zj @ h, loss)
            return v.sum() + 0.35 * h @ h, Zj.T @ d1 + 0.7 * h

        ref = minimize(f, np.zeros(2), jac=True, method="L-BFGS-B", options={"gtol": 1e-12, "ftol": 0}).x
        np.testing.assert_allclose(H[j], ref, rtol=1e-5, atol=1e-6)


@pytest.mark.slow
@pytest.mark.parametrize("loss", ["squared", "logistic", "sqhinge"])
@pytest.mark.parametrize("observed", [None, 0.3])
@pytest.mark.parametrize("init", ["spectral", "random"])
def test_objective_never_increases(loss, observed, init):
    X, Y, O = _data(n=50, d=10, L=8, observed=observed)
    model = LEML(n_components=3, loss=loss, lam=0.5, n_iter=4, tol=1e-6, init=init, random_state=0)
    model.fit(_rows(X, (20, 30)), _rows(Y, (20, 30)), None if O is None else _rows(O, (20, 30)))
    J = [h["J_after_H"] for h in model.history_]
    assert all(b <= a * (1 + 1e-9) + 1e-9 for a, b in zip(J, J[1:])), J
    assert model.threshold_ == (0.5 if observed is None and loss == "squared" else 0.0)


@pytest.mark.parametrize("lam", [0.0, 0.5, 20.0])
def test_gram_solver_equals_the_passes_solved_exactly(lam):
    """Each alternation of the in-memory shortcut equals the out-of-core one with its CG run to convergence."""
    X, Y, _ = _data(n=70, d=12, L=9)
    X = X + sp.identity(70, format="csr", dtype=X.dtype)[:, :12]  # full column rank: a unique W-step at lam = 0
    fits = {solver: LEML(n_components=4, loss="squared", lam=lam, n_iter=3, tol=1e-13, max_cg_iter=2000, solver=solver,
                         random_state=1).fit(_rows(X, (25, 30, 15)), _rows(Y, (25, 30, 15)))
            for solver in ("gram", "passes")}
    gram, passes = fits["gram"], fits["passes"]
    # float32 rows: the passes' products are float32 (the Gram pass accumulates in float64)
    np.testing.assert_allclose(gram.W_, passes.W_, rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose(gram.H_, passes.H_, rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose([h["J_after_H"] for h in gram.history_], [h["J_after_H"] for h in passes.history_],
                               rtol=1e-6)
    assert gram.n_passes_ == 2 < passes.n_passes_  # nnz(Y), then X^T X and X^T Y in one pass


def test_gram_solver_auto_and_refusals():
    X, Y, O = _data(n=40, d=8, L=6, observed=0.4)
    assert LEML(n_components=2, lam=1.0, n_iter=1).fit(_rows(X), _rows(Y)).solver_ == "gram"
    assert LEML(n_components=2, lam=1.0, n_iter=1).fit(_rows(X), _rows(Y), _rows(O)).solver_ == "passes"
    assert LEML(n_components=2, loss="logistic", lam=1.0, n_iter=1).fit(_rows(X), _rows(Y)).solver_ == "passes"
    with pytest.raises(ValueError, match="observed-entry mask"):
        LEML(n_components=2, lam=1.0, solver="gram").fit(_rows(X), _rows(Y), _rows(O))
    with pytest.raises(ValueError, match="solver must be one of"):
        LEML(n_components=2, lam=1.0, solver="exact").fit(_rows(X), _rows(Y))


@pytest.mark.parametrize("case", ["full01", "fullpm1", "masked"])
def test_target_sketch_kernel_equals_dense(case):
    X, Y, O = _data(n=30, d=7, L=6, observed=0.4 if case == "masked" else None)
    Omega = np.random.default_rng(1).standard_normal((6, 4))
    A, mask = _signs(Y, O)
    T = Y.toarray() if case == "full01" else A * mask
    got = LK.block_target_sketch(X, Y, Omega, None if O is None else O, n_labels=6,
                                 encoding="01" if case == "full01" else "pm1")
    np.testing.assert_allclose(got, X.toarray().astype(np.float64).T @ T @ Omega, rtol=1e-6, atol=1e-9)


def _initial_w(model, X, Y, O, rng, solver):
    """``model``'s initial ``W`` (and the passes it took) for in-memory data in two row blocks."""
    from xmldask.models.leml import _Counter, _GramProblem

    Xr, Yr, Or = model._inputs(_rows(X, (25, X.shape[0] - 25)), _rows(Y, (25, Y.shape[0] - 25)),
                               None if O is None else _rows(O, (25, O.shape[0] - 25)))
    counter = _Counter()
    model._common_fit_state(Xr, Yr, Or, "squared", counter)
    gram = None
    if solver == "gram":
        Xd = X.toarray().astype(np.float64)
        gram = _GramProblem(Xd.T @ Xd, Xd.T @ Y.toarray(), Y.nnz)
    W = model._initial_w(Xr, Yr, Or, model._validated(Y.shape[1]), rng, counter, gram)
    return W, counter.n


@pytest.mark.parametrize(("solver", "observed"), [("gram", None), ("passes", None), ("passes", 0.4)])
def test_spectral_init_spans_the_top_directions_of_the_sketch(solver, observed):
    from xmldask.models.leml import INIT_OVERSAMPLE

    X, Y, O = _data(n=60, d=10, L=9, observed=observed)
    k = 3
    W, passes = _initial_w(LEML(n_components=k, lam=1.0, init_scale=2.0, solver=solver), X, Y, O,
                           np.random.default_rng(4), solver)
    rng = np.random.default_rng(4)
    rng.standard_normal((10, k))
    Omega = rng.standard_normal((9, min(9, k + INIT_OVERSAMPLE)))
    A, mask = _signs(Y, O)
    T = Y.toarray() if observed is None else A * mask
    U = np.linalg.svd(X.toarray().astype(np.float64).T @ T @ Omega, full_matrices=False)[0][:, :k]
    np.testing.assert_allclose(W @ W.T, 4.0 * U @ U.T, atol=1e-8)  # the same subspace, columns of norm 2
    assert passes == (1 if solver == "passes" else 0) + (1 if observed is not None else 0)


def test_spectral_init_beyond_the_rank_of_the_targets_is_random():
    X, Y, _ = _data(n=40, d=8, L=6)
    Y = sp.csr_matrix(np.repeat(Y.toarray()[:, :1], 6, axis=1))  # X^T Y has rank 1
    W, _ = _initial_w(LEML(n_components=4, lam=1.0, solver="gram"), X, Y, None, np.random.default_rng(0), "gram")
    u = np.linalg.svd(X.toarray().astype(np.float64).T @ Y.toarray()[:, :1])[0][:, 0]
    np.testing.assert_allclose(abs(W[:, 0] @ u), 1.0, rtol=1e-9)  # the one direction, unit norm
    random = np.random.default_rng(0).standard_normal((8, 4)) / np.sqrt(8)
    np.testing.assert_array_equal(W[:, 1:], random[:, 1:])  # the other three: the random start


def test_binary_relevance_equals_per_label_ridge():
    X, Y, O = _data(n=40, d=8, L=6, observed=0.4)
    lam = 0.3
    br = BinaryRelevance(loss="squared", lam=lam, tol=1e-12, max_cg_iter=500)
    br.fit(_rows(X), _rows(Y), _rows(O))
    Xd = X.toarray().astype(np.float64)
    A, mask = _signs(Y, O)
    for j in range(6):
        Xj = Xd[mask[:, j]]
        ref = np.linalg.solve(Xj.T @ Xj + lam / 2 * np.eye(8), Xj.T @ A[mask[:, j], j])
        np.testing.assert_allclose(br.W_[:, j], ref, rtol=1e-6, atol=1e-8)


def test_predict_save_load_roundtrip(tmp_path):
    X, Y, O = _data(observed=0.5)
    model = LEML(n_components=3, loss="logistic", lam=0.5, n_iter=2, random_state=0).fit(_rows(X), _rows(Y), _rows(O))
    S = model.decision_function(_rows(X)).compute()
    np.testing.assert_allclose(S, X.toarray() @ model.W_ @ model.H_.T, rtol=1e-5, atol=1e-5)
    labels, scores = da.compute(*model.predict_topk(_rows(X), k=3))
    np.testing.assert_array_equal(labels, np.argsort(-S, axis=1, kind="stable")[:, :3])
    url = str(tmp_path / "leml.zarr")
    model.save(url)
    from xmldask.models import load_model

    again = load_model(url)
    assert isinstance(again, LEML) and again.loss_ == "logistic" and again.threshold_ == 0.0
    np.testing.assert_array_equal(again.W_, model.W_)
    with pytest.raises(StoreError, match="LEML"):
        BinaryRelevance.load(url)
    # a store written when the rank was the parameter k loads with it as n_components
    params, fitted, _ = model._parts()
    params["k"] = params.pop("n_components")
    former = LEML._from_parts(params, fitted, {"W": model.W_, "H": model.H_})
    assert former.n_components == 3 and former.get_params() == model.get_params()
    np.testing.assert_array_equal(former.H_, model.H_)


def test_bad_input_fails_before_any_pass():
    X, Y, O = _data(observed=0.5)
    with pytest.raises(ValueError, match="at most the number of labels"):
        LEML(n_components=10).fit(_rows(X), _rows(Y))
    with pytest.raises(ValueError, match="loss must be one of"):
        LEML(n_components=2, loss="hinge").fit(_rows(X), _rows(Y))
    with pytest.raises(ValueError, match="mask has shape"):
        LEML(n_components=2).fit(_rows(X), _rows(Y), _rows(O[:, :5]))
    with pytest.raises(ValueError, match="row blocks"):
        LEML(n_components=2).fit(_rows(X), _rows(Y), _rows(O, (20, 20)))


def _model_view(X, features, fit_intercept):
    """The reference of what a model sees: rows scaled to unit L2 norm, then a constant column."""
    Xd = X.toarray().astype(np.float64)
    if features == "l2":
        norms = np.linalg.norm(Xd, axis=1, keepdims=True)
        Xd = Xd / np.where(norms > 0, norms, 1.0)
    return np.hstack([Xd, np.ones((len(Xd), 1))]) if fit_intercept else Xd


@pytest.mark.parametrize("features, fit_intercept", [("l2", False), ("raw", True), ("l2", True)])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_features_and_intercept_equal_fitting_the_transformed_rows(features, fit_intercept, dtype, tmp_path):
    X, Y, O = _data(dtype=dtype, observed=0.5)
    Xm = _model_view(X, features, fit_intercept)
    opts = dict(n_components=3, loss="squared", lam=0.5, n_iter=2, tol=1e-10, max_cg_iter=500, random_state=0)
    model = LEML(**opts, features=features, fit_intercept=fit_intercept).fit(_rows(X), _rows(Y), _rows(O))
    plain = LEML(**opts).fit(_rows(sp.csr_matrix(Xm).astype(dtype)), _rows(Y), _rows(O))
    assert model.n_features_in_ == X.shape[1] and model.W_.shape == (Xm.shape[1], 3)
    np.testing.assert_allclose(model.W_, plain.W_, rtol=1e-3 if dtype == np.float32 else 1e-6, atol=1e-5)
    S = model.decision_function(_rows(X)).compute()
    np.testing.assert_allclose(S, Xm @ model.W_ @ model.H_.T, rtol=1e-4, atol=1e-5)
    model.save(str(tmp_path / "m.zarr"))
    again = LEML.load(str(tmp_path / "m.zarr"))
    np.testing.assert_array_equal(again.decision_function(_rows(X)).compute(), S)
    br = BinaryRelevance(lam=0.5, tol=1e-12, max_cg_iter=500, features=features, fit_intercept=fit_intercept)
    br.fit(_rows(X), _rows(Y), _rows(O))
    A, mask = _signs(Y, O)
    j = 0
    Xj = Xm[mask[:, j]]
    ref = np.linalg.solve(Xj.T @ Xj + 0.25 * np.eye(Xm.shape[1]), Xj.T @ A[mask[:, j], j])
    np.testing.assert_allclose(br.W_[:, j], ref, rtol=1e-5, atol=1e-6)


def test_features_and_intercept_are_checked_before_any_pass():
    X, Y, _ = _data()
    with pytest.raises(ValueError, match="features must be one of 'raw', 'l2'"):
        LEML(n_components=2, features="tfidf").fit(_rows(X), _rows(Y))
    with pytest.raises(ValueError, match="fit_intercept must be True or False"):
        BinaryRelevance(fit_intercept="yes").fit(_rows(X), _rows(Y))
