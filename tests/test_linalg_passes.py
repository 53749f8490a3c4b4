"""Block kernels and passes of :mod:`xmldask.linalg` against in-memory NumPy/SciPy references.

Tolerances: every result is a sum of products of at most ``N + D`` terms per entry (a length-``D``
product ``X Q`` inside a length-``N`` sum over rows, plus the centring terms). Standard rounding
analysis (Higham, *Accuracy and Stability of Numerical Algorithms*, 2nd ed., eq. 3.5) bounds the
error of such a computation by ``gamma_m * (the same computation on absolute values)`` with
``gamma_m ~ m * eps``. The tests check ``|result - reference| <= 2 (N + D + 4) eps * bound`` entrywise,
with ``eps`` of the dtype (float32: 1.2e-7, float64: 2.2e-16) and ``bound`` the reference computed
on ``|X| + 1 m^T`` (``m`` bounding the centring means), ``|w|`` and ``|Q|``. The reference itself is
computed in float64 from the same (float32-representable) values.
"""

from __future__ import annotations

import pickle
import warnings
from types import SimpleNamespace

import dask
import dask.array as da
import numpy as np
import pytest
import scipy.sparse as sp
from dask.core import get_dependencies
from dask.utils import parse_bytes

from xmldask import linalg
from xmldask.linalg import _kernels as K
from xmldask.linalg import passes
from xmldask.store import open_csr, write_csr

N, D, N_LABELS, K_COLS = 1037, 23, 11, 5
MEMORY_BLOCKS = (100,) * 10 + (37,)  # uneven: ten blocks of 100 rows and a remainder
STORE_BLOCK_ROWS = 128  # eight blocks of 128 rows and one of 13
DTYPES = [np.float32, np.float64]


# ------------------------------------------------------------------------------------------
# data and references


def _make_data():
    """float64 arrays holding float32-representable values (so both dtypes see the same numbers)."""
    rng = np.random.default_rng(20261101)
    A = sp.random(N, D, density=0.2, format="csr", random_state=rng, data_rvs=lambda s: rng.uniform(0.5, 2.0, s))
    A = A.tolil()
    A[:, 0] = rng.uniform(0.9, 1.1, (N, 1))  # a dense column whose mean dwarfs its spread (centring test)
    A[:, 5] = 0  # an empty column
    A[[3, 400, 1036], :] = 0  # empty rows, one of them the very last
    A = A.tocsr().astype(np.float32).astype(np.float64)
    A.eliminate_zeros()
    Y = sp.random(N, N_LABELS, density=0.1, format="csr", random_state=rng, data_rvs=np.ones)

    def f32(a):
        return np.asarray(a, dtype=np.float32).astype(np.float64)

    return SimpleNamespace(
        A=A,
        Y=Y.astype(np.float64),
        Q=f32(rng.standard_normal((D, K_COLS))),
        Z=f32(rng.standard_normal((D, K_COLS))),
        B=f32(rng.standard_normal((N, K_COLS))),
        w=f32(rng.uniform(0.2, 3.0, N)),
        mu=f32(rng.uniform(-0.5, 1.0, D)),  # arbitrary means, not X's: centring by given values
    )


DATA = _make_data()


@pytest.fixture(scope="module")
def stores(tmp_path_factory):
    root = tmp_path_factory.mktemp("linalg")
    x_url = write_csr(str(root / "x.zarr"), DATA.A.astype(np.float32), block_rows=STORE_BLOCK_ROWS)
    y_url = write_csr(str(root / "y.zarr"), DATA.Y.astype(np.float32), block_rows=STORE_BLOCK_ROWS)
    return x_url, y_url


def _inputs(source, dtype, stores):
    """Dask inputs in ``dtype`` from memory (blocks of 100 + 37) or from a real store (128 + 13)."""
    if source == "memory":
        meta = sp.csr_matrix((0, D), dtype=dtype)

        def rows(M):
            return da.from_array(M.astype(dtype), chunks=(MEMORY_BLOCKS, -1), asarray=False, fancy=False, meta=meta)

        X, Y = rows(DATA.A), rows(DATA.Y)
    else:
        X, Y = open_csr(stores[0], dtype=dtype), open_csr(stores[1], dtype=dtype)
    cast = {name: getattr(DATA, name).astype(dtype) for name in ("Q", "Z", "B")}
    # weights and means deliberately float64: they must not upcast a float32 pass
    return SimpleNamespace(X=X, Y=Y, w=DATA.w, mu=DATA.mu, **cast)


def _dense_x():
    return DATA.A.toarray()


def _means(center, w):
    """The centring means in float64 (zeros without centring) and a bound on their magnitude."""
    Xd = _dense_x()
    ww = np.ones(N) if w is None else w
    if center is False:
        mu = np.zeros(D)
    elif center is True:
        mu = Xd.T @ ww / ww.sum()
    else:
        mu = center
    m = np.abs(mu) + np.abs(Xd).T @ np.abs(ww) / np.abs(ww).sum()
    return mu, m


# name -> (build(inputs, weights, center) -> dask result(s), reference(Xc, X, ww, ops) -> array(s))
PASSES = {
    "xt_x_q": (lambda a, w, c: linalg.xt_x_q(a.X, a.Q, weights=w, center=c, split_every=3),
               lambda Xc, X, ww, o: Xc.T @ (ww[:, None] * (Xc @ o.Q))),
    "x_q": (lambda a, w, c: linalg.x_q(a.X, a.Q, center=None if c is False else c),
            lambda Xc, X, ww, o: Xc @ o.Q),
    "xt_b": (lambda a, w, c: linalg.xt_b(a.X, a.B, weights=w, center=c, split_every=2),
             lambda Xc, X, ww, o: Xc.T @ (ww[:, None] * o.B)),
    "yt_x_z": (lambda a, w, c: linalg.yt_x_z(a.Y, a.X, a.Z, weights=w, center=c),
               lambda Xc, X, ww, o: o.Y.T @ (ww[:, None] * (Xc @ o.Z))),
    "gram": (lambda a, w, c: linalg.gram(a.X, weights=w, center=c, split_every=4),
             lambda Xc, X, ww, o: Xc.T @ (ww[:, None] * Xc)),
    "column_sums": (lambda a, w, c: linalg.column_sums(a.X, weights=w),
                    lambda Xc, X, ww, o: X.T @ ww),
    "column_mean": (lambda a, w, c: linalg.column_mean(a.X, weights=w),
                    lambda Xc, X, ww, o: X.T @ ww / ww.sum()),
    "column_moments": (lambda a, w, c: linalg.column_moments(a.X, weights=w),
                       lambda Xc, X, ww, o: (X.T @ ww / ww.sum(), (X * X).T @ ww / ww.sum())),
}
WEIGHTED = {"xt_x_q", "xt_b", "yt_x_z", "gram", "column_sums", "column_mean", "column_moments"}
CENTERS = {"xt_x_q": (False, True, "given"), "x_q": (False, "given"), "xt_b": (False, True, "given"),
           "yt_x_z": (False, True, "given"), "gram": (False, True, "given")}
CASES = [(name, weighted, center) for name in PASSES for weighted in ((False, True) if name in WEIGHTED else (False,))
         for center in CENTERS.get(name, (False,))]
CASE_IDS = [f"{n}-{'w' if w else 'unw'}-{c if c != 'given' else 'mu'}" for n, w, c in CASES]


def _build(name, inputs, weighted, center):
    c = inputs.mu if center == "given" else center
    return PASSES[name][0](inputs, inputs.w if weighted else None, c)


def _reference(name, weighted, center):
    """(reference, bound) in float64, each an array or a tuple of arrays."""
    w = DATA.w if weighted else None
    c = DATA.mu if center == "given" else center
    mu, m = _means(c, w)
    ww = np.ones(N) if w is None else w
    Xd = _dense_x()
    ops = SimpleNamespace(Q=DATA.Q, Z=DATA.Z, B=DATA.B, Y=DATA.Y.toarray())
    ref = PASSES[name][1](Xd - mu[None, :], Xd, ww, ops)
    abs_ops = SimpleNamespace(**{k: np.abs(v) for k, v in vars(ops).items()})
    Xabs = np.abs(Xd) + m[None, :]
    bound = PASSES[name][1](Xabs, Xabs, np.abs(ww), abs_ops)
    return ref, bound


def _as_tuple(x):
    return x if isinstance(x, tuple) else (x,)


def _assert_within_rounding(actual, expected, bound, dtype, what=""):
    eps = np.finfo(dtype).eps
    tol = 2 * (N + D + 4) * eps * bound + np.finfo(dtype).tiny
    err = np.abs(np.asarray(actual, dtype=np.float64) - expected)
    ratio = float((err / tol).max()) if err.size else 0.0
    assert ratio <= 1, f"{what}: error {err.max():.3g} exceeds the rounding bound (worst ratio {ratio:.3g})"


# ------------------------------------------------------------------------------------------
# block kernels


@pytest.mark.parametrize("layout", ["csr", "dense"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_kernels_match_numpy(layout, dtype):
    rows = slice(100, 300)
    Xd = _dense_x()[rows]
    Xb = sp.csr_matrix(Xd).astype(dtype) if layout == "csr" else Xd.astype(dtype)
    Yb = DATA.Y[rows].astype(dtype)
    Bb = DATA.B[rows].astype(dtype)
    Q = DATA.Q.astype(dtype)
    w, mu = DATA.w[rows], DATA.mu  # float64 on purpose
    Xc = Xd - mu[None, :]
    cases = {
        "block_matmul": (K.block_matmul(Xb, Q), Xd @ DATA.Q),
        "block_matmul centred": (K.block_matmul(Xb, Q, center=mu), Xc @ DATA.Q),
        "block_tmatmul": (K.block_tmatmul(Xb, Bb, weights=w, center=mu), Xc.T @ (w[:, None] * DATA.B[rows])),
        "block_tmatmul sparse B": (K.block_tmatmul(Xb, Yb, weights=w), Xd.T @ (w[:, None] * DATA.Y[rows].toarray())),
        "block_gram_apply": (K.block_gram_apply(Xb, Q), Xd.T @ (Xd @ DATA.Q)),
        "block_gram_apply w mu": (K.block_gram_apply(Xb, Q, weights=w, center=mu),
                                  Xc.T @ (w[:, None] * (Xc @ DATA.Q))),
        "block_cross": (K.block_cross(Yb, Xb, Q, weights=w, center=mu),
                        DATA.Y[rows].toarray().T @ (w[:, None] * (Xc @ DATA.Q))),
        "block_gram": (K.block_gram(Xb), Xd.T @ Xd),
        "block_gram w mu": (K.block_gram(Xb, weights=w, center=mu), Xc.T @ (w[:, None] * Xc)),
        "block_colsum": (K.block_colsum(Xb), Xd.sum(axis=0)),
        "block_colsum w": (K.block_colsum(Xb, w), Xd.T @ w),
        "block_colsq w": (K.block_colsq(Xb, w), (Xd * Xd).T @ w),
    }
    rtol = 1e-5 if dtype == np.float32 else 1e-12  # 200 rows, values O(1): far inside n*eps
    for what, (got, want) in cases.items():
        assert isinstance(got, np.ndarray), what
        assert got.dtype == dtype, f"{what}: {got.dtype}"  # float64 weights/means do not upcast
        assert got.shape == want.shape, what
        np.testing.assert_allclose(got, want, rtol=rtol, atol=rtol * np.abs(want).max(), err_msg=what)


@pytest.mark.parametrize("dtype", DTYPES)
def test_kernels_in_column_slabs_match_numpy(dtype, monkeypatch):
    """Products too large for a core's cache are computed in slabs of one cache line a row (uneven last slab)."""
    monkeypatch.setattr(K, "CACHE_BYTES", 0)
    rng = np.random.default_rng(3)
    A = sp.random(300, 70, density=0.1, format="csr", dtype=dtype, random_state=rng)
    Q, V = rng.standard_normal((70, 37)).astype(dtype), rng.standard_normal((300, 37)).astype(dtype)
    w, mu = rng.random(300), rng.random(70)
    Ad, Ac = A.toarray().astype(np.float64), A.toarray() - mu[None, :]
    cases = {
        "block_matmul": (K.block_matmul(A, Q, center=mu), Ac @ Q),
        "block_tmatmul": (K.block_tmatmul(A, V, weights=w, center=mu), Ac.T @ (w[:, None] * V)),
        "block_gram_apply": (K.block_gram_apply(A, Q), Ad.T @ (Ad @ Q)),
    }
    rtol = 1e-5 if dtype == np.float32 else 1e-12
    for what, (got, want) in cases.items():
        assert got.dtype == dtype and got.shape == want.shape, what
        np.testing.assert_allclose(got, want, rtol=rtol, atol=rtol * np.abs(want).max(), err_msg=what)

    class Recording:  # the sparse operand, recording the widths of the dense operands it is multiplied by
        def __init__(self, M):
            self.M, self.shape, self.dtype, self.format, self.widths = M, M.shape, M.dtype, M.format, []

        def __matmul__(self, B):
            self.widths.append(B.shape[1])
            assert B.flags.c_contiguous
            return self.M @ B

    recorded = Recording(A)
    np.testing.assert_allclose(K._sparse_dense(recorded, Q), A @ Q, rtol=rtol)
    width = 64 // np.dtype(dtype).itemsize
    assert recorded.widths == [width] * (37 // width) + [37 % width]
    recorded = Recording(A.T.tocsc())  # a transposed block: the result's rows are the random ones
    K._sparse_dense(recorded, V)
    assert recorded.widths == [width] * (37 // width) + [37 % width]
    rows_bytes = 70 * 37 * np.dtype(dtype).itemsize  # Q's rows, or A^T V's
    monkeypatch.setattr(K, "CACHE_BYTES", rows_bytes)
    for M, B in ((A, Q), (A.T.tocsc(), V)):  # fits: one product, whatever the other dimension
        recorded = Recording(M)
        K._sparse_dense(recorded, B)
        assert recorded.widths == [37]
    assert 1 << 20 <= K._last_level_cache_bytes() <= 1 << 32


@pytest.mark.parametrize("dtypes", [(np.float32, np.float32), (np.float64, np.float64), (np.float32, np.float64)])
def test_t_product_of_dense_rows_in_slabs_matches_scipy(dtypes, monkeypatch):
    """Sparse operands with most cells stored are multiplied as dense slabs of rows (an uneven last slab), others by
    SciPy: the same product, in SciPy's dtype, either way."""
    rng = np.random.default_rng(5)
    full = sp.random(301, 40, density=0.9, format="csr", dtype=dtypes[0], random_state=rng)
    thin = sp.random(301, 23, density=0.02, format="csr", dtype=dtypes[1], random_state=rng)
    dense = rng.standard_normal((301, 23)).astype(dtypes[1])
    monkeypatch.setattr(K, "SLAB_BYTES", 64 * 8 * np.dtype(dtypes[1]).itemsize)  # 8 rows of 64 columns a slab
    taken = []
    monkeypatch.setattr(K, "_dense", lambda a: taken.append("scipy") or (a.toarray() if sp.issparse(a) else a))
    for U, R, path in ((full, full, None), (full, sp.csr_matrix(full[:, :23], dtype=dtypes[1]), None),
                       (full, thin, "scipy"), (full, dense, "scipy"), (full[:0], full[:0], None)):
        taken.clear()
        got = K.t_product(U, R)
        want = U.toarray().astype(np.float64).T @ (R.toarray() if sp.issparse(R) else R).astype(np.float64)
        assert isinstance(got, np.ndarray) and got.shape == want.shape
        assert got.dtype == np.result_type(U.dtype, R.dtype)
        assert taken == ([path] if path else [])
        rtol = 1e-5 if got.dtype == np.float32 else 1e-12
        np.testing.assert_allclose(got, want, rtol=rtol, atol=rtol * max(np.abs(want).max(initial=0), 1))
    Xb = full[:150]  # the kernels that take it: block_gram and block_augmented
    np.testing.assert_allclose(K.block_gram(Xb), Xb.toarray().T @ Xb.toarray(), rtol=1e-5)
    aug = K.block_augmented(Xb, Xb)
    np.testing.assert_allclose(K.unpack_centered(aug), np.cov(Xb.toarray().T.astype(np.float64), bias=True) * 150,
                               rtol=1e-4, atol=1e-4)


def test_kernels_promote_like_numpy_and_handle_empty_blocks():
    Xb = sp.csr_matrix(DATA.A[:50]).astype(np.float32)
    assert K.block_matmul(Xb, DATA.Q).dtype == np.float64  # float32 X with a float64 Q: NumPy's rule
    assert K.block_gram_apply(Xb, DATA.Q.astype(np.float32)).dtype == np.float32
    assert K.block_colsum(sp.csr_matrix(DATA.Y[:50].astype(bool))).dtype == np.float32
    empty = sp.csr_matrix((0, D), dtype=np.float32)
    Q = DATA.Q.astype(np.float32)
    assert K.block_matmul(empty, Q).shape == (0, K_COLS)
    np.testing.assert_array_equal(K.block_gram_apply(empty, Q, weights=np.ones(0), center=DATA.mu),
                                  np.zeros((D, K_COLS)))
    np.testing.assert_array_equal(K.block_gram(empty, center=DATA.mu), np.zeros((D, D)))
    np.testing.assert_array_equal(K.block_augmented(empty, empty @ Q), np.zeros((D + 1, K_COLS + 1)))
    with pytest.raises(ValueError, match=r"weights must have shape \(50,\)"):
        K.block_colsum(Xb, np.ones(49))


def test_augmented_blocks_sum_to_the_centred_product():
    """``unpack_centered`` of summed ``block_augmented`` = product with X centred by its weighted mean."""
    Xd, w = _dense_x(), DATA.w
    mu = Xd.T @ w / w.sum()
    total = sum(K.block_augmented(DATA.A[a:a + 100], DATA.A[a:a + 100] @ DATA.Q, weights=w[a:a + 100])
                for a in range(0, N, 100))
    want = (Xd - mu).T @ (w[:, None] * ((Xd - mu) @ DATA.Q))
    np.testing.assert_allclose(K.unpack_centered(total), want, rtol=1e-10, atol=1e-10 * np.abs(want).max())


# ------------------------------------------------------------------------------------------
# passes on the synchronous scheduler


@pytest.mark.slow
@pytest.mark.parametrize("source", ["memory", "store"])
@pytest.mark.parametrize("dtype", DTYPES, ids=["float32", "float64"])
@pytest.mark.parametrize(("name", "weighted", "center"), CASES, ids=CASE_IDS)
def test_pass_matches_reference(name, weighted, center, dtype, source, stores):
    inputs = _inputs(source, dtype, stores)
    result = _as_tuple(_build(name, inputs, weighted, center))
    with dask.config.set(scheduler="synchronous"):
        got = dask.compute(*result)
    ref, bound = (_as_tuple(r) for r in _reference(name, weighted, center))
    for g, r, b, lazy in zip(got, ref, bound, result):
        assert g.dtype == dtype and lazy.dtype == dtype  # float64 weights/means never upcast float32
        assert g.shape == r.shape == lazy.shape
        _assert_within_rounding(g, r, b, dtype, name)
    if name == "x_q":
        assert result[0].chunks[0] == inputs.X.chunks[0]  # row chunks aligned with X


def test_vector_operands_and_dask_weights(stores):
    inputs = _inputs("store", np.float64, stores)
    Xd, w = _dense_x(), DATA.w
    w_da = da.from_array(w, chunks=(inputs.X.chunks[0],))
    q = DATA.Q[:, 0]
    with dask.config.set(scheduler="synchronous"):
        got = dask.compute(linalg.xt_x_q(inputs.X, q, weights=w_da), linalg.x_q(inputs.X, da.from_array(q, chunks=7)),
                           linalg.xt_b(inputs.X, DATA.B[:, 0], weights=w_da))
    np.testing.assert_allclose(got[0], Xd.T @ (w * (Xd @ q)), rtol=1e-12)
    np.testing.assert_allclose(got[1], Xd @ q, rtol=1e-12, atol=1e-14)
    np.testing.assert_allclose(got[2], Xd.T @ (w * DATA.B[:, 0]), rtol=1e-12, atol=1e-14)
    assert [g.shape for g in got] == [(D,), (N,), (D,)]


@pytest.mark.parametrize("chains", [2, 100])
def test_column_moments_share_one_pass(stores, monkeypatch, chains):
    """One task per block (a running sum's step, or a block's own task when each block has a task slot),
    shared by both outputs."""
    monkeypatch.setattr(passes, "parallelism", lambda: chains)
    X = open_csr(stores[0])
    mean, second = linalg.column_moments(X)
    graph = {**mean.__dask_graph__(), **second.__dask_graph__()}
    kernel_tasks = [k for k in graph if str(k).startswith(("column_moments-sum-chain", "('column_moments-block"))]
    assert len(kernel_tasks) == X.numblocks[0]


def test_graph_is_deterministic(stores):
    X = open_csr(stores[0])
    a = linalg.xt_x_q(X, DATA.Q, weights=DATA.w, center=DATA.mu)
    b = linalg.xt_x_q(open_csr(stores[0]), DATA.Q.copy(), weights=DATA.w.copy(), center=DATA.mu.copy())
    assert a.name == b.name
    assert linalg.xt_x_q(X, DATA.Q + 1).name != a.name


def test_centring_accuracy_when_a_mean_dwarfs_the_spread():
    """float32, a column of mean 1000 and spread 1: the documented accurate routes stay accurate.

    ``xt_x_q`` with given means centres each block before the products (measured: ~2e-5 relative
    error; the one-pass ``center=True`` correction loses ~10%); centred ``gram`` accumulates in float64.
    """
    rng = np.random.default_rng(4)
    A = DATA.A.tolil()
    A[:, 1] = np.float32(1000) + rng.standard_normal((N, 1)).astype(np.float32)
    A = A.tocsr()
    Ad = A.toarray()
    mu = Ad.mean(axis=0)
    X = da.from_array(A.astype(np.float32), chunks=(MEMORY_BLOCKS, -1), asarray=False)
    with dask.config.set(scheduler="synchronous"):
        got_q = linalg.xt_x_q(X, DATA.Q.astype(np.float32), center=mu).compute()
        got_g_true, got_g_mu = dask.compute(linalg.gram(X, center=True), linalg.gram(X, center=mu))
    want_q = (Ad - mu).T @ ((Ad - mu) @ DATA.Q)
    want_g = (Ad - mu).T @ (Ad - mu)
    assert got_q.dtype == got_g_true.dtype == got_g_mu.dtype == np.float32
    np.testing.assert_allclose(got_q, want_q, rtol=1e-4, atol=1e-4 * np.abs(want_q).max())
    for got in (got_g_true, got_g_mu):
        np.testing.assert_allclose(got, want_g, rtol=1e-5, atol=1e-6 * np.abs(want_g).max())


# ------------------------------------------------------------------------------------------
# graph shape: one X block per task, bounded fan-in, operands shipped once


def test_xt_x_q_graph_has_bounded_fan_in(tmp_path):
    rng = np.random.default_rng(1)
    A = sp.random(640, D, density=0.2, format="csr", dtype=np.float32, random_state=rng)
    X = open_csr(write_csr(str(tmp_path / "x.zarr"), A, block_rows=10))
    assert X.numblocks[0] == 64
    split_every = 4
    result = linalg.xt_x_q(X, DATA.Q.astype(np.float32), weights=DATA.w[:640], split_every=split_every)
    graph = dict(result.__dask_graph__())
    # a store-backed X is read inside the block tasks: no task of X's own, no X block held between tasks
    assert not [k for k in graph if isinstance(k, tuple) and k[0] == X.name]
    steps = [k for k in graph if "xt_x_q-sum-chain" in str(k)]  # each block's result made in a running sum's step
    assert len(steps) == 64
    for key in steps:
        assert len(get_dependencies(graph, key)) <= 3  # the previous sum, Q and its weights block
    fan_in = {key: len(get_dependencies(graph, key)) for key in graph}
    over = {k: v for k, v in fan_in.items() if v > split_every}
    assert not over, f"tasks with more than split_every={split_every} inputs: {over}"
    # an in-memory X keeps one task per block, each used by exactly one block task
    Xm = da.from_array(A, chunks=(10, -1), asarray=False)
    graph = dict(linalg.xt_x_q(Xm, DATA.Q.astype(np.float32), split_every=split_every).__dask_graph__())
    x_keys = {k for k in graph if isinstance(k, tuple) and k[0] == Xm.name}
    assert len(x_keys) == 64
    for key in graph:
        assert len(get_dependencies(graph, key) & x_keys) <= 1
    with dask.config.set(scheduler="synchronous"):
        got = result.compute()
    Ad = A.toarray().astype(np.float64)
    want = Ad.T @ (DATA.w[:640, None] * (Ad @ DATA.Q.astype(np.float32)))
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4 * np.abs(want).max())


def test_dense_operand_is_embedded_once(stores):
    X = open_csr(stores[0])
    rng = np.random.default_rng(2)
    Q = rng.standard_normal((D, 4000))  # 736 KB, below SCATTER_BYTES: embedded in the graph
    result = linalg.xt_x_q(X, Q, center=DATA.mu)
    size = len(pickle.dumps(dict(result.__dask_graph__()), protocol=5))
    assert Q.nbytes < size < Q.nbytes + 200_000, f"{size}-byte graph, {Q.nbytes}-byte Q, {X.numblocks[0]} blocks"


def _product_block(Xb, A, B):
    return np.concatenate([Xb @ A.item().T.toarray(), Xb @ B.item().T.toarray()], axis=1)


def test_sparse_operands_of_one_shape_and_size_are_two_operands():
    """Dask tokenizes an object array by its objects' repr (shape, entries): two sparse operands alike in both, in
    one graph, must not share a key (each task would get one of them twice)."""
    A = sp.csr_matrix(np.eye(4, dtype=np.float32))
    B = sp.csr_matrix(np.eye(4, dtype=np.float32)[::-1] * 2)
    assert passes.whole_operand(A).name != passes.whole_operand(B).name
    assert passes.whole_operand(A).name == passes.whole_operand(A.copy()).name  # the same content, one key
    Xd = np.arange(24, dtype=np.float32).reshape(6, 4)
    X = da.from_array(Xd, chunks=(4, 4))
    out = passes.per_block(_product_block, [("Xb", X, passes.ROWS), ("A", passes.whole_operand(A), passes.WHOLE),
                                            ("B", passes.whole_operand(B), passes.WHOLE)],
                           tail=(8,), dtype=np.float32, token="two-operands", stack=False)
    np.testing.assert_array_equal(out.compute(scheduler="sync"), np.hstack([Xd @ A.T.toarray(), Xd @ B.T.toarray()]))


def test_a_dataclass_operand_is_tokenized_once_by_its_content(monkeypatch):
    """A kernel's own layout (a frozen dataclass of arrays): one key for the same content, another for other
    content, its token computed on its first shipping only; the kernel gets the object itself."""
    import dataclasses

    @dataclasses.dataclass(frozen=True, eq=False)
    class Layout:
        a: np.ndarray
        b: sp.csr_matrix

        @property
        def nbytes(self):
            return self.a.nbytes + self.b.data.nbytes

    first = Layout(np.arange(5.0), sp.csr_matrix(np.eye(3)))
    same = Layout(np.arange(5.0), sp.csr_matrix(np.eye(3)))
    other = Layout(np.arange(5.0), sp.csr_matrix(2 * np.eye(3)))
    key = passes.whole_operand(first).name
    assert key == passes.whole_operand(same).name != passes.whole_operand(other).name
    calls = []
    tokenize = dask.base.tokenize
    monkeypatch.setattr(dask.base, "tokenize", lambda *a, **kw: calls.append(a) or tokenize(*a, **kw))
    assert passes.whole_operand(first).name == key
    assert not any(isinstance(part, np.ndarray) and part.size == 5 for args in calls for part in args)
    assert passes.whole_operand(first).compute(scheduler="sync").item() is first


# ------------------------------------------------------------------------------------------
# validation


def test_input_errors_say_what_and_how_to_fix(stores):
    X = open_csr(stores[0])
    dense = da.from_array(_dense_x(), chunks=(100, 10))
    with pytest.raises(TypeError, match="dask array of row blocks"):
        linalg.xt_x_q(DATA.A, DATA.Q)
    with pytest.raises(ValueError, match=r"chunked by rows only.*3 column chunks.*X.rechunk\(\{1: -1\}\)"):
        linalg.xt_x_q(dense, DATA.Q)
    unknown = da.zeros((20, D), chunks=(10, -1)).map_blocks(np.asarray, chunks=((np.nan, np.nan), (D,)))
    with pytest.raises(ValueError, match=r"unknown row-chunk sizes.*compute_chunk_sizes\(\)"):
        linalg.column_sums(unknown)
    Y_other = da.from_array(DATA.Y, chunks=(MEMORY_BLOCKS, -1), asarray=False)
    with pytest.raises(ValueError, match=r"Y's row blocks must be X's: X has 9 row blocks \(128, 128, 128, 128, "
                                         r"\.\.\., 13\), Y has 11 .*Y.rechunk\(\{0: X.chunks\[0\]\}\)"):
        linalg.yt_x_z(Y_other, X, DATA.Z)
    with pytest.raises(ValueError, match="B has 10 rows but X has 1037"):
        linalg.xt_b(X, np.ones((10, 2)))
    with pytest.raises(ValueError, match=r"weights must have shape \(1037,\)"):
        linalg.xt_x_q(X, DATA.Q, weights=np.ones(5))
    with pytest.raises(ValueError, match="finite and non-negative"):
        linalg.column_sums(X, weights=-DATA.w)
    with pytest.raises(ValueError, match=r"weights = weights.rechunk\(\(X.chunks\[0\],\)\)"):
        linalg.column_mean(X, weights=da.from_array(DATA.w, chunks=100))
    with pytest.raises(ValueError, match=r"Q must have 23 rows \(one per column of X\), but has shape \(22, 5\)"):
        linalg.xt_x_q(X, DATA.Q[:22])
    with pytest.raises(ValueError, match=r"center must be True, False or the column means of X, shape \(23,\)"):
        linalg.xt_x_q(X, DATA.Q, center=np.ones(3))
    with pytest.raises(ValueError, match=r"center=column_mean\(X\).compute\(\)"):
        linalg.x_q(X, DATA.Q, center=True)
    with pytest.raises(ValueError, match="split_every must be an integer of at least 2, but is 1"):
        linalg.gram(X, split_every=1)
    with pytest.raises(ValueError, match=r"use xt_x_q\(X, Q\)"):
        linalg.gram(da.zeros((10, 20_000), chunks=(5, -1)))


# ------------------------------------------------------------------------------------------
# a two-worker LocalCluster gives the same answers


def _compute_all(graphs, scheduler):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        results = dask.compute(*graphs, scheduler=scheduler)
    large = [str(w.message) for w in caught if "large" in str(w.message).lower()]
    assert not large, large
    return results


def _check_same_answers(cases, results, expected, dtype):
    eps = np.finfo(dtype).eps
    for (name, weighted, center), got, want in zip(cases, results, expected):
        ref, bound = _reference(name, weighted, center)
        for g, e, r, b in zip(_as_tuple(got), _as_tuple(want), _as_tuple(ref), _as_tuple(bound)):
            assert g.dtype == dtype
            # same graph, same reduction order: equal up to a few ulps (BLAS kernels may differ per process)
            np.testing.assert_allclose(g, e, rtol=8 * eps, atol=8 * eps * np.abs(b).max(), err_msg=name)
            _assert_within_rounding(g, r, b, dtype, name)


@pytest.mark.slow
@pytest.mark.parametrize("dtype", DTYPES, ids=["float32", "float64"])
def test_local_cluster_matches_synchronous(dtype, stores, client):
    inputs = _inputs("store", dtype, stores)
    graphs = [_build(n, inputs, w, c) for n, w, c in CASES]
    expected = _compute_all(graphs, "synchronous")
    results = _compute_all(graphs, client)
    _check_same_answers(CASES, results, expected, dtype)


@pytest.mark.slow
def test_local_cluster_with_scattered_operands(stores, client, monkeypatch):
    """Every in-memory operand (Q, Z, B, weights, means) scattered to the workers once."""
    cases = [case for case in CASES if case[1] or case[0] == "x_q"]
    inputs = _inputs("store", np.float32, stores)
    expected = _compute_all([_build(n, inputs, w, c) for n, w, c in cases], "synchronous")
    monkeypatch.setattr(passes, "SCATTER_BYTES", 0)
    with client.as_current():
        graphs = [_build(n, inputs, w, c) for n, w, c in cases]
        xt_b = graphs[cases.index(("xt_b", True, "given"))]
        # B, w and mu are not inside the graph
        assert len(pickle.dumps(dict(xt_b.__dask_graph__()), protocol=5)) < inputs.B.nbytes
        results = _compute_all(graphs, client)
    _check_same_answers(cases, results, expected, np.float32)


def test_large_operand_is_scattered_not_embedded(tmp_path, client):
    """A 10 MB Q would trigger distributed's "large graph" warning if embedded; it is scattered once."""
    d, k = 30_000, 100
    rng = np.random.default_rng(3)
    A = sp.random(300, d, density=0.002, format="csr", dtype=np.float32, random_state=rng)
    X = open_csr(write_csr(str(tmp_path / "wide.zarr"), A, block_rows=64))
    Q = rng.standard_normal((d, k)).astype(np.float32)
    threshold = parse_bytes(dask.config.get("distributed.admin.large-graph-warning-threshold"))
    assert Q.nbytes > threshold > passes.SCATTER_BYTES
    with pytest.warns(UserWarning, match="large graph"):  # the control: embedding it does warn
        dask.compute(linalg.xt_x_q(X, Q), scheduler=client)
    with client.as_current():
        result = linalg.xt_x_q(X, Q, split_every=2)
        assert len(pickle.dumps(dict(result.__dask_graph__()), protocol=5)) < 200_000
        (got,) = _compute_all([result], client)
    want = (A.T @ (A @ Q.astype(np.float64)))
    assert got.dtype == np.float32
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4 * np.abs(want).max())


@pytest.mark.slow
def test_the_same_operand_values_shipped_pass_after_pass(tmp_path, client):
    """An iterative solver ships equal operands in pass after pass (the identity, a repeated direction): each
    is scattered under a key of its own, so releasing one pass's operand never takes the next one's away."""
    A = sp.random(400, 2000, density=0.01, format="csr", dtype=np.float32, random_state=7)
    X = open_csr(write_csr(str(tmp_path / "same.zarr"), A, block_rows=50))
    Q = np.ones((2000, 200), dtype=np.float32)  # 1.6 MB: scattered
    want = A.T @ (A @ Q)
    with client.as_current():
        names = set()
        for _ in range(30):
            Qd = passes.dense_operand(Q)
            names.add(Qd.name)
            np.testing.assert_allclose(linalg.xt_x_q(X, Qd).compute(), want, rtol=1e-4, atol=1e-3)
            del Qd
    assert len(names) == 30


def test_scattered_operand_survives_a_worker_restart(tmp_path, client):
    """A dense operand is on every worker under its array's chunk key (no task aliasing it, which one worker
    would compute and every block task then follow), so a pass still completes after one worker is restarted."""
    rng = np.random.default_rng(4)
    A = sp.random(400, 2000, density=0.01, format="csr", dtype=np.float32, random_state=rng)
    X = open_csr(write_csr(str(tmp_path / "r.zarr"), A, block_rows=50))
    Q = rng.standard_normal((2000, 200)).astype(np.float32)  # 1.6 MB: scattered
    assert Q.nbytes >= passes.SCATTER_BYTES
    with client.as_current():
        result = linalg.xt_x_q(X, Q, split_every=2)
        Qd = passes.dense_operand(Q)
        assert list(Qd.__dask_graph__()) == [(Qd.name, 0, 0)]  # the scattered data itself
        keys = [k for k in result.__dask_graph__() if str(k).startswith("('operand-")]
        assert len(keys) == 1, "Q was not scattered"
        has = client.has_what()
        assert len(has) == 2 and all({str(k) for k in keys} <= {str(k) for k in held} for held in has.values())
        worker = next(iter(client.scheduler_info()["workers"]))
        client.restart_workers([worker])
        (got,) = _compute_all([result], client)
    want = A.T @ (A @ Q.astype(np.float64))
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4 * np.abs(want).max())


def test_sum_tree_takes_fewer_large_results_per_task(monkeypatch):
    """A combine task takes at most REDUCE_BYTES of block results (never fewer than 2), same sum."""
    rng = np.random.default_rng(0)
    A = sp.random(900, 400, density=0.05, format="csr", dtype=np.float64, random_state=1)
    Q = rng.standard_normal((400, 6))
    X = da.from_array(A, chunks=(100, -1), asarray=False)  # 9 blocks, results of 400 x 6 x 8 = 19200 bytes
    monkeypatch.setattr(passes, "REDUCE_BYTES", 3 * 19200)
    monkeypatch.setattr(passes, "parallelism", lambda: 9)  # as many chains as blocks: a tree over the blocks
    assert passes.reduce_split_every(8, 19200) == 3
    assert passes.reduce_split_every(8, 10**9) == 2
    assert passes.reduce_split_every(4, 1) == 4
    out = linalg.xt_x_q(X, Q, split_every=8)
    graph = dict(out.__dask_graph__())
    widest = max(len(get_dependencies(graph, key)) for key in graph if "xt_x_q-sum" in str(key))
    assert widest == 3
    np.testing.assert_allclose(out.compute(), A.T @ (A @ Q), rtol=1e-10)


@pytest.mark.parametrize("chains", [1, 3])
def test_in_memory_rows_run_one_running_sum_per_parallel_task(monkeypatch, chains):
    """Rows not read from a store: block i goes to step i // c of running sum i mod c (c = the tasks run at
    once), which takes that block, the previous sum and Q, and only the c sums meet in the tree; the same
    sum, uneven blocks, float32."""
    rng = np.random.default_rng(1)
    A = sp.random(1000, 300, density=0.05, format="csr", dtype=np.float32, random_state=3)
    Q = rng.standard_normal((300, 4)).astype(np.float32)
    chunks = (100, 130, 70, 100, 100, 150, 50, 100, 100, 100)
    X = da.from_array(A, chunks=(chunks, -1), asarray=False)
    monkeypatch.setattr(passes, "parallelism", lambda: chains)
    out = linalg.xt_x_q(X, Q, split_every=8)
    graph = dict(out.__dask_graph__())
    steps = [key for key in graph if "xt_x_q-sum-chain" in str(key)]
    assert len(steps) == len(chunks)
    for key in steps:  # its block of X, Q and (after the first step) the previous running sum
        c, j = (int(p) for p in key.split("-")[-2:])
        deps = set(get_dependencies(graph, key))
        assert (X.name, c + chains * j, 0) in deps and len(deps) == 2 + (j > 0)
    expected = A.toarray().astype(np.float64)
    np.testing.assert_allclose(out.compute(), expected.T @ (expected @ Q), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("chains", [1, 3])
def test_block_sum_computes_each_block_in_a_step_of_its_running_sum(tmp_path, monkeypatch, chains):
    """With the rows read from a store, block i is computed in step i // c of running sum i mod c: a task
    per block, depending on the previous sum and the whole operands only (no block task whose result waits
    or travels); the same sum as NumPy, uneven blocks, float32, weighted and centred."""
    rng = np.random.default_rng(2)
    A = sp.random(1000, 300, density=0.05, format="csr", dtype=np.float32, random_state=5)
    X = open_csr(write_csr(str(tmp_path / "x.zarr"), A, block_rows=130))  # 7 x 130 + 90
    Q = rng.standard_normal((300, 4)).astype(np.float32)
    mu = (np.asarray(A.mean(axis=0)).ravel() + 0.1).astype(np.float32)
    monkeypatch.setattr(passes, "parallelism", lambda: chains)
    out = linalg.xt_x_q(X, Q, center=mu, split_every=8)
    graph = dict(out.__dask_graph__())
    steps = sorted((key for key in graph if "xt_x_q-sum-chain" in str(key)), key=lambda k: [int(p) for p in
                                                                                         k.split("-")[-2:]])
    assert len(steps) == X.numblocks[0] == 8
    assert not [key for key in graph if "xt_x_q-block" in str(key)]
    operands = {key for key in graph if key not in steps and not get_dependencies(graph, key)}
    for key in steps:
        c, j = (int(p) for p in key.split("-")[-2:])
        previous = {f"{key.rsplit('-', 1)[0]}-{j - 1}"} if j else set()
        assert set(get_dependencies(graph, key)) - operands == previous
    assert {int(key.split("-")[-2]) for key in steps} == set(range(chains))
    dense = A.toarray().astype(np.float64) - mu
    np.testing.assert_allclose(out.compute(), dense.T @ (dense @ Q), rtol=1e-4, atol=1e-4)


def test_chain_step_never_changes_its_inputs():
    """A step adds the running sum into the kernel's own new result, but never into the sum it is given, an
    operand the kernel returns as is, or a view of one."""
    total = np.ones((1, 3))
    kw = dict(_names=("B",), _stack=True, _static={"keep": np.arange(3.0)}, _readers=None)

    def fresh(B, keep):
        return B * 2

    def same(B, keep):
        return B

    def view(B, keep):
        return keep[:]

    B = np.full(3, 5.0)
    np.testing.assert_array_equal(passes._chain_apply(total, B, _func=fresh, **kw), [[11.0, 11.0, 11.0]])
    np.testing.assert_array_equal(passes._chain_apply(total, B, _func=same, **kw), [[6.0, 6.0, 6.0]])
    np.testing.assert_array_equal(passes._chain_apply(total, B, _func=view, **kw), [[1.0, 2.0, 3.0]])
    np.testing.assert_array_equal(total, np.ones((1, 3)))
    np.testing.assert_array_equal(B, np.full(3, 5.0))
    np.testing.assert_array_equal(kw["_static"]["keep"], np.arange(3.0))


def test_block_sum_of_a_computed_row_operand_takes_its_blocks_into_the_steps(monkeypatch):
    """A row operand that is not read from a store (here in memory, uneven blocks) is an input of the chain's
    steps: block i of it goes to step i // c of running sum i mod c, and no kernel result is computed in a
    task of its own (whose result would wait, ready, for the sequential steps); the sum is NumPy's."""
    A = sp.random(500, 50, density=0.1, format="csr", dtype=np.float64, random_state=6)
    X = da.from_array(A, chunks=((100, 130, 70, 100, 100), -1), asarray=False)
    monkeypatch.setattr(passes, "parallelism", lambda: 2)
    out = linalg.column_sums(X)
    graph = dict(out.__dask_graph__())
    assert not [key for key in graph if "column_sums-block" in str(key)]
    steps = [key for key in graph if "column_sums-sum-chain" in str(key)]
    assert len(steps) == 5
    for key in steps:
        c, j = (int(p) for p in key.split("-")[-2:])
        assert (X.name, 2 * j + c, 0) in set(get_dependencies(graph, key))
    np.testing.assert_allclose(out.compute(), np.asarray(A.sum(axis=0)).ravel(), rtol=1e-12)


@pytest.mark.parametrize("n_blocks", [1, 2, 7])
def test_per_block_objects_and_tree_combine_match_the_in_memory_result(n_blocks):
    """Block results that are not arrays: one task per row block (uneven chunks), combined pairwise; the same
    as the in-memory computation, whatever the number of blocks."""
    A = sp.random(70, 9, density=0.3, format="csr", dtype=np.float32, random_state=2)
    Y = np.arange(70, dtype=np.float32).reshape(70, 1)
    chunks = tuple(np.diff(np.linspace(0, 70, n_blocks + 1).astype(int)).tolist())
    if n_blocks == 7:
        chunks = (1, 20, 9, 10, 10, 5, 15)
    X, Yd = da.from_array(A, chunks=(chunks, -1), asarray=False), da.from_array(Y, chunks=(chunks, -1))

    def figures(Xb, Yb, *, block, scale):
        return {"rows": [block] * Xb.shape[0], "gram": (Xb.T @ Xb).toarray() * scale, "top": float(Yb.max())}

    def combine(a, b):
        return {"rows": a["rows"] + b["rows"], "gram": a["gram"] + b["gram"], "top": max(a["top"], b["top"])}

    parts = passes.per_block_objects(figures, X, Yd, scale=dask.delayed(2.0))
    assert len(parts) == len(chunks)
    total = passes.tree_combine(parts, combine).compute()
    assert total["rows"] == [b for b, size in enumerate(chunks) for _ in range(size)]
    np.testing.assert_allclose(total["gram"], 2 * (A.T @ A).toarray(), rtol=1e-5)
    assert total["top"] == 69.0
    with pytest.raises(ValueError, match="at least one part"):
        passes.tree_combine([], combine)


def test_per_block_objects_pass_arrays_and_delayed_objects_to_their_own_arguments():
    """Keyword operands that alternate between Dask arrays (one block or several) and delayed objects each reach
    their own argument (Dask 2026.8's delayed calls swap such values)."""
    X = da.ones((10, 3), chunks=(4, 3))
    static = {"p": dask.delayed(np.full(2, 1.0), pure=True), "q": da.from_array(np.full(3, 2.0)),
              "r": dask.delayed(np.full(4, 3.0), pure=True), "s": da.from_array(np.full(6, 4.0), chunks=2), "t": 5}

    def shapes(Xb, *, block, **kw):
        return {name: (np.shape(v), float(np.mean(v))) for name, v in kw.items()}
    for part in dask.compute(*passes.per_block_objects(shapes, X, **static)):
        assert part == {"p": ((2,), 1.0), "q": ((3,), 2.0), "r": ((4,), 3.0), "s": ((6,), 4.0), "t": ((), 5.0)}


def _non_canonical(n=60, d=25, seed=4):
    """A float32 CSR block with unsorted column ids, a duplicate entry and a stored zero."""
    A = sp.random(n, d, density=0.3, format="csr", dtype=np.float32, random_state=seed)
    A = sp.csr_matrix(sp.diags(np.linspace(1, 2, n).astype(np.float32)) @ A, dtype=np.float32)
    rows = np.flatnonzero(np.diff(A.indptr) >= 3)
    A.indices[A.indptr[rows[0]]:A.indptr[rows[0] + 1]] = A.indices[A.indptr[rows[0]]:A.indptr[rows[0] + 1]][::-1]
    A.indices[A.indptr[rows[1]] + 1] = A.indices[A.indptr[rows[1]]]  # a duplicate column id
    A.data[A.indptr[rows[2]]] = 0  # a stored zero
    A.has_sorted_indices = False
    assert not A.has_canonical_format
    return A


def test_block_kernels_never_change_their_input():
    """A row block may be read by several tasks at once: no kernel may canonicalise it in place (SciPy's
    ``power`` did, in block_colsq, which raced with gram in one compute)."""
    rng = np.random.default_rng(0)
    A = _non_canonical()
    n, d = A.shape
    dense = A.toarray()  # duplicates summed, as SciPy reads them
    w, Q, B, mu = rng.random(n), rng.standard_normal((d, 3)), rng.standard_normal((n, 2)), rng.random(d)
    before = (A.data.copy(), A.indices.copy(), A.indptr.copy())
    calls = {
        "colsum": (lambda M: K.block_colsum(M, w), dense.T @ w),
        "colsq": (lambda M: K.block_colsq(M, w), (dense**2).T @ w),
        "gram": (lambda M: K.block_gram(M, weights=w, center=mu), (dense - mu).T @ (w[:, None] * (dense - mu))),
        "gram_apply": (lambda M: K.block_gram_apply(M, Q, weights=w), dense.T @ (w[:, None] * (dense @ Q))),
        "matmul": (lambda M: K.block_matmul(M, Q, center=mu), (dense - mu) @ Q),
        "tmatmul": (lambda M: K.block_tmatmul(M, B, weights=w), dense.T @ (w[:, None] * B)),
        "augmented": (lambda M: K.unpack_centered(K._augmented_gram(M, weights=w)), None),
    }
    for name, (call, expected) in calls.items():
        got = call(A)
        for array, saved in zip((A.data, A.indices, A.indptr), before):
            np.testing.assert_array_equal(array, saved, err_msg=name)
        if expected is not None:
            np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-4, err_msg=name)


@pytest.mark.slow
def test_reductions_sharing_unsorted_blocks_in_one_compute_are_deterministic():
    """gram and the column moments of the same blocks with unsorted column ids, in one threaded compute: the
    same result every time, equal to the in-memory one (before the fix, about 4 % of such computes differed)."""
    rng = np.random.default_rng(0)
    A = sp.random(3000, 300, density=0.05, format="csr", dtype=np.float32, random_state=1)
    A = sp.csr_matrix(sp.diags(rng.random(3000)) @ A, dtype=np.float32)  # a product: unsorted column ids
    assert not A.has_sorted_indices
    X = da.from_array(A, chunks=(700, -1), asarray=False, fancy=False)
    wm = rng.random(3000)
    w = da.from_array(wm.astype(np.float32), chunks=700)
    dense = A.toarray().astype(np.float64)
    mean = dense.T @ wm / wm.sum()
    expected = (dense - mean).T @ (wm[:, None] * (dense - mean))
    with dask.config.set(scheduler="threads", num_workers=4):
        for _ in range(100):
            G, m, _sq = dask.compute(linalg.gram(X, weights=w, center=True, dtype=np.float64),
                                     *linalg.column_moments(X, weights=w))
            np.testing.assert_allclose(G, expected, rtol=1e-4, atol=1e-6)
            np.testing.assert_allclose(m, mean, rtol=1e-4, atol=1e-7)


def test_in_memory_rows_and_label_blocks_are_canonical_copies():
    """An in-memory sparse input is split into canonical blocks without changing the user's matrix; LEML's
    block helper drops stored zeros and duplicates on a copy."""
    from xmldask.base import as_rows
    from xmldask.models._leml_kernels import signed_entries

    A = _non_canonical()
    before = (A.data.copy(), A.indices.copy(), A.indptr.copy())
    X = as_rows(A, "X", 25)
    block = X.blocks[0].compute()
    assert block.has_canonical_format
    np.testing.assert_allclose(X.compute().toarray(), A.toarray())
    Y = sp.csr_matrix(A, copy=True)
    Y.data[:] = 1
    Y.data[3] = 0  # a stored zero: not a label
    O = sp.csr_matrix(np.ones(A.shape, dtype=np.float32))
    saved = (Y.data.copy(), Y.indices.copy(), Y.indptr.copy())
    S = signed_entries(Y, O, A.shape[1])
    expected = np.where(Y.toarray() > 0, 1.0, -1.0)
    np.testing.assert_array_equal(S.toarray(), expected)
    for array, copy in zip((A.data, A.indices, A.indptr, Y.data, Y.indices, Y.indptr), before + saved):
        np.testing.assert_array_equal(array, copy)


@pytest.mark.parametrize("source", ["memory", "store"])
@pytest.mark.parametrize("dtype", DTYPES, ids=["float32", "float64"])
def test_row_gram_matches_numpy(source, dtype, stores):
    """``X X^T`` block by block (uneven row blocks, both ways), in float64 from float32 rows when asked."""
    inputs = _inputs(source, dtype, stores)
    want = DATA.A.astype(dtype).astype(np.float64) @ DATA.A.astype(dtype).astype(np.float64).T
    K = passes.row_gram(inputs.X)
    assert K.shape == (N, N) and K.chunks == (inputs.X.chunks[0],) * 2 and K.dtype == np.float64
    np.testing.assert_allclose(K.compute(), want.toarray(), rtol=1e-12, atol=1e-12)
    K32 = passes.row_gram(inputs.X, dtype=np.float32).compute()
    assert K32.dtype == np.float32
    np.testing.assert_allclose(K32, want.toarray(), rtol=1e-5, atol=1e-5 * np.abs(want).max())


def test_spread_rows_cuts_few_row_blocks_into_one_a_thread():
    """Row blocks cut into pieces of about equal rows until there are ``parts`` blocks, never below ``min_rows`` a
    piece; SciPy sparse blocks keep their rows; enough blocks, or too few rows to cut, leave ``X`` as it is."""
    from xmldask.linalg.passes import spread_rows

    A = sp.random(2500, 30, density=0.2, format="csr", random_state=0, dtype=np.float32)
    X = da.from_array(A, chunks=((2000, 500), (30,)), asarray=False, fancy=False)
    spread = spread_rows(X, 4, 300)
    assert spread.chunks[0] == (1000, 1000, 500)  # the 500-row block would give pieces below 300 rows
    assert (spread.compute() != A).nnz == 0
    assert spread.blocks[1].compute().shape == (1000, 30) and sp.issparse(spread.blocks[1].compute())
    assert spread_rows(X, 7, 100).chunks[0] == (500,) * 4 + (125,) * 4  # each block in ceil(7 / 2) pieces
    assert spread_rows(X, 2, 1) is X and spread_rows(X, 4, 2000) is X
