"""Rembrandt, compressed sensing, PLST, PCA embeddings, the hierarchy metric and ``xmldask spectrum``.

References are exact and in memory: ``Pi_X Y`` by least squares (``numpy.linalg.lstsq``) and its
SVD; Algorithm 2 itself run densely in float64 from the same Gaussian start.

Tolerances (see also tests/test_randomized.py). With ``rank(Pi_X Y) <= n_features <= k + p`` the
randomized range finder captures the whole range, so Rembrandt is exact up to rounding and the
ridge: the products ``Y^T X Z`` and the least-squares right-hand sides ``X^T Y Q`` are sums of
``n`` terms in the data's dtype (relative error ``<= n eps``), which Davis-Kahan turns into
``sin(angle) <= C n eps lambda_1 / (lambda_k - lambda_{k+1})`` (``C = 8``: the Cholesky solve of the
well-conditioned normal equations adds a few ``eps * cond``); the ridge
(``lam = 1e-9 * trace(X^T X) / d``) moves ``Pi_X`` by at most ``lam / sigma_min(X)^2`` (relative),
which is added to the relative error before the Davis-Kahan factor. The same bound is used when
comparing with Algorithm 2 run in memory from the same start.
"""

from __future__ import annotations

import csv
import importlib
import json

import dask
import dask.array as da
import numpy as np
import pytest
import scipy.linalg
import scipy.sparse as sp

from xmldask.cli import main
from xmldask.embedding import (
    PLST,
    CompressedSensing,
    PCAEmbedding,
    RandomizedPCA,
    Rembrandt,
    load_model,
    most_fraternal_fraction,
    nearest_neighbor_sibling_scores,
    read_hierarchy,
    rembrandt,
    sibling_fraction,
)
from xmldask.embedding._base import NotFittedError
from xmldask.linalg import solvers
from xmldask.linalg.randomized import eigh_from_sketch, orthonormalize
from xmldask.store import StoreError

rembrandt_module = importlib.import_module("xmldask.embedding.rembrandt")  # the package exports the function

BLOCKS = (300, 300, 250, 150, 37)  # uneven row blocks
N = sum(BLOCKS)
DTYPES = [np.float32, np.float64]
KINDS = ["multiclass", "multilabel"]


def _problem(kind: str, *, d: int = 12, c: int = 30, seed: int = 0):
    """Sparse features and binary labels with a planted linear relation (float32-representable values)."""
    rng = np.random.default_rng(seed)
    A = sp.random(N, d, density=0.4, format="csr", random_state=rng, data_rvs=lambda s: rng.uniform(0.5, 2, s))
    A = A.astype(np.float32).astype(np.float64)
    W = rng.normal(size=(d, c)) * np.arange(1, c + 1) ** -0.5
    S = A @ W + 0.5 * rng.normal(size=(N, c))
    if kind == "multiclass":
        Ym = sp.csr_matrix((np.ones(N), (np.arange(N), S.argmax(axis=1))), shape=(N, c))
    else:
        Ym = sp.csr_matrix((S > np.quantile(S, 0.9)).astype(np.float64))
    return A, Ym


@pytest.fixture(params=["one-pass", "passes", "dual"])
def path(request, monkeypatch):
    """Rembrandt's three paths: X^T X and X^T Y kept in memory after one pass, a pass per product, or the rows'
    Gram matrix X X^T and Y kept in memory after one pass (the dual, taken here by lowering the feature limit)."""
    if request.param == "passes":
        monkeypatch.setattr(rembrandt_module, "MAX_CROSS_ENTRIES", 0)
    if request.param == "dual":
        monkeypatch.setattr(solvers, "MAX_GRAM_FEATURES", 0)
    return request.param


def _dask(A, dtype):
    return da.from_array(sp.csr_matrix(A).astype(dtype), chunks=(BLOCKS, -1), asarray=False)


def _sin_angle(U, V) -> float:
    return float(np.sin(scipy.linalg.subspace_angles(U, V)).max())


def _ridge_operator(A, Ym, lam):
    """Dense ``M = Y^T X (X^T X + lam I)^{-1} X^T Y`` by least squares on the augmented system."""
    Ad, Yd = A.toarray(), Ym.toarray()
    d = Ad.shape[1]
    Z = np.linalg.lstsq(np.vstack([Ad, np.sqrt(lam) * np.eye(d)]), np.vstack([Yd, np.zeros((d, Yd.shape[1]))]),
                        rcond=None)[0]
    return Yd.T @ (Ad @ Z)


# ------------------------------------------------------------------------------------------
# Rembrandt against the exact SVD of Pi_X Y


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kind", KINDS)
def test_rembrandt_matches_exact_svd_of_projected_labels(kind, dtype, path):
    if path == "dual":
        pytest.skip("alpha=1e-9 on 1037 rows of 12 features: X X^T + lam I has condition ~1e10 (1025 zero "
                    "eigenvalues meet lam), the dual cannot reach the primal's 1e-8 here; the other tests cover it at "
                    "alpha >= 1e-3")
    k = 4
    A, Ym = _problem(kind)
    model = Rembrandt(n_components=k, oversample=10, n_iter=1, alpha=1e-9, random_state=0)
    model.fit(_dask(A, dtype), _dask(Ym, dtype))
    Ad, Yd = A.toarray(), Ym.toarray()
    P = Ad @ np.linalg.lstsq(Ad, Yd, rcond=None)[0]  # Pi_X Y
    _, s, Vt = np.linalg.svd(P)
    lam = s**2
    ridge = model.alpha_ / np.linalg.svd(Ad, compute_uv=False)[-1] ** 2  # relative change of Pi_X by the ridge
    tol = (8 * N * np.finfo(dtype).eps + 2 * ridge) * lam[0] / (lam[k - 1] - lam[k])
    assert model.embedding_.shape == (Ym.shape[1], k)
    assert np.allclose(model.embedding_.T @ model.embedding_, np.eye(k), atol=1e-8)
    assert _sin_angle(model.embedding_, Vt[:k].T) <= tol
    np.testing.assert_allclose(model.singular_values_, s[:k], rtol=tol)
    np.testing.assert_allclose(model.eigenvalues_, s[:k] ** 2, rtol=2 * tol)
    # one pass in all; or two products, each a one-pass Cholesky solve plus one Y^T X Z pass: 2 (q + 1)
    assert model.n_passes_ == (4 if path == "passes" else 1) and model.converged_
    assert model.result_.solver_passes == ([1, 1] if path == "passes" else [1])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kind", KINDS)
def test_rembrandt_matches_algorithm_2_in_memory(kind, dtype, path):
    """A sketch narrower than the range (d > k + p): same as the dense algorithm from the same start."""
    k, p, q = 3, 4, 1
    A, Ym = _problem(kind, d=40, c=25, seed=1)
    res = rembrandt(_dask(A, dtype), _dask(Ym, dtype), k, oversample=p, n_iter=q, alpha=1e-3, random_state=11)
    M = _ridge_operator(A, Ym, res.alpha)
    Q = res.start.astype(np.float64)
    for _ in range(q):
        Q = orthonormalize(M @ Q)
    V, sigma = eigh_from_sketch(M @ Q, k)
    lam = np.linalg.eigvalsh(M)[::-1]
    tol = 8 * N * np.finfo(dtype).eps * lam[0] / (sigma[k - 1] - lam[k + p])
    assert _sin_angle(res.embedding, V) <= tol
    np.testing.assert_allclose(res.eigenvalues, sigma, rtol=tol)
    # the sketch is orthonormal before the last product: Cauchy interlacing
    assert np.all(res.eigenvalues <= lam[:k] * (1 + tol))


def test_compressed_sensing_is_a_whitened_random_projection(path):
    k = 5
    A, Ym = _problem("multilabel", d=40, c=25, seed=2)
    X, Y = _dask(A, np.float64), _dask(Ym, np.float64)
    cs = CompressedSensing(n_components=k, alpha=1e-3, random_state=4).fit(X, Y)
    same = Rembrandt(n_components=k, oversample=0, n_iter=0, alpha=1e-3, random_state=4).fit(X, Y)
    np.testing.assert_array_equal(cs.embedding_, same.embedding_)
    assert cs.n_passes_ == (2 if path == "passes" else 1)  # one solve, one Y^T X Z pass
    G = np.random.default_rng(4).standard_normal((Ym.shape[1], k))  # the sensing matrix
    MG = _ridge_operator(A, Ym, cs.alpha_) @ G
    whitened = MG @ scipy.linalg.sqrtm(np.linalg.inv(MG.T @ MG)).real  # (M G)(G^T M^2 G)^{-1/2}
    V = cs.embedding_
    assert np.allclose(V.T @ V, np.eye(k), atol=1e-8)
    # V = whitened R for an orthogonal R (the eigenbasis of G^T M^2 G)
    R = whitened.T @ V
    assert np.allclose(R.T @ R, np.eye(k), atol=1e-8)
    np.testing.assert_allclose(whitened @ R, V, atol=1e-8)
    assert "oversample" not in cs.get_params()


@pytest.mark.parametrize("dtype", DTYPES)
def test_rembrandt_feature_map_and_intercept(dtype, path):
    k = 3
    A, Ym = _problem("multiclass", seed=3)
    X, Y = _dask(A, dtype), _dask(Ym, dtype)
    model = Rembrandt(n_components=k, oversample=10, alpha=1e-2, center=True, feature_map=True,
                      random_state=0).fit(X, Y)
    # 2 x (solve + pass) + 1 solve; the dual maps its last solve back by a pass
    assert model.n_passes_ == {"one-pass": 1, "passes": 5, "dual": 2}[path]
    Ad, Yd = A.toarray(), Ym.toarray()
    # Pi onto span([1, X]) with a ridge on X only: exact reference by centring
    mu, ybar = Ad.mean(axis=0), Yd.mean(axis=0)
    Xc = Ad - mu
    lam = model.alpha_
    Z = np.linalg.solve(Xc.T @ Xc + lam * np.eye(Xc.shape[1]), Xc.T @ (Yd - ybar))
    M = Yd.T @ (Xc @ Z + ybar)
    w, U = np.linalg.eigh((M + M.T) / 2)
    tol = 8 * N * np.finfo(dtype).eps * w[-1] / (w[-k] - w[-k - 1])
    assert _sin_angle(model.embedding_, U[:, ::-1][:, :k]) <= tol
    target = Yd @ model.embedding_
    W = np.linalg.solve(Xc.T @ Xc + lam * np.eye(Xc.shape[1]), Xc.T @ (target - target.mean(axis=0)))
    rtol = 1e-3 if dtype == np.float32 else 1e-8
    np.testing.assert_allclose(model.feature_map_, W, rtol=rtol, atol=rtol * np.abs(W).max())
    pred = model.predict_embedding(X).compute()
    np.testing.assert_allclose(pred, Xc @ W + target.mean(axis=0), atol=rtol * np.abs(target).max() * 10)


def test_transform_and_inverse_transform_keep_dtype():
    A, Ym = _problem("multilabel")
    X, Y = _dask(A, np.float32), _dask(Ym, np.float32)
    model = Rembrandt(n_components=3, random_state=0).fit(X, Y)
    E = model.transform(Y)
    assert isinstance(E, da.Array) and E.dtype == np.float32 and E.chunks[0] == BLOCKS
    np.testing.assert_allclose(E.compute(), Ym @ model.embedding_, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(model.transform(Ym), Ym @ model.embedding_, rtol=1e-12)
    assert model.inverse_transform(E.compute()).shape == Ym.shape
    with pytest.raises(ValueError, match="30 columns"):
        model.transform(np.ones((2, 3)))
    with pytest.raises(NotFittedError):
        Rembrandt().transform(Ym)
    with pytest.raises(ValueError, match="feature_map=True"):
        model.predict_embedding(X)


# ------------------------------------------------------------------------------------------
# baselines


@pytest.mark.parametrize("dtype", DTYPES)
def test_plst_is_top_eigenvectors_of_label_covariance(dtype):
    k = 4
    _, Ym = _problem("multilabel", c=20)
    model = PLST(n_components=k, random_state=0).fit(None, _dask(Ym, dtype))
    w, U = np.linalg.eigh((Ym.T @ Ym).toarray())
    w, U = w[::-1], U[:, ::-1]
    tol = 8 * N * np.finfo(dtype).eps * w[0] / (w[k - 1] - w[k])
    assert model.embedding_ is model.components_ and model.n_passes_ == 2
    assert _sin_angle(model.embedding_, U[:, :k]) <= tol
    np.testing.assert_allclose(model.eigenvalues_, w[:k], rtol=tol)
    np.testing.assert_allclose(model.trace_, Ym.nnz, rtol=1e-6)


def test_pca_embedding_centres_features():
    k = 3
    A, _ = _problem("multilabel", d=15)
    X = _dask(A, np.float64)
    model = PCAEmbedding(n_components=k, random_state=0).fit(X)
    Xc = A.toarray() - A.toarray().mean(axis=0)
    w, U = np.linalg.eigh(Xc.T @ Xc)
    assert _sin_angle(model.components_, U[:, ::-1][:, :k]) < 1e-8
    np.testing.assert_allclose(model.explained_variance_ratio_, w[::-1][:k] / w.sum(), rtol=1e-8)
    np.testing.assert_allclose(model.transform(X).compute(), Xc @ model.components_, atol=1e-10)
    assert not RandomizedPCA().center and PCAEmbedding().center


# ------------------------------------------------------------------------------------------
# determinism, save / load


def test_same_seed_same_result_with_one_or_two_workers():
    from distributed import Client, LocalCluster

    A, Ym = _problem("multilabel", d=40, c=25, seed=5)
    X, Y = _dask(A, np.float32), _dask(Ym, np.float32)
    kwargs = {"n_components": 4, "oversample": 5, "solver": "cg", "max_iter": 5, "random_state": 9}
    with dask.config.set(scheduler="synchronous"):
        local = Rembrandt(**kwargs).fit(X, Y)
    with LocalCluster(n_workers=2, threads_per_worker=1, processes=False, dashboard_address=":0") as cluster, \
            Client(cluster):
        two = Rembrandt(**kwargs).fit(X, Y)
        pca_two = PLST(n_components=3, random_state=1).fit(None, Y)
    np.testing.assert_array_equal(local.embedding_, two.embedding_)
    np.testing.assert_array_equal(local.eigenvalues_, two.eigenvalues_)
    assert local.n_passes_ == two.n_passes_
    pca_one = PLST(n_components=3, random_state=1).fit(None, Y)
    np.testing.assert_array_equal(pca_one.embedding_, pca_two.embedding_)


def test_save_load_round_trip_and_refusals(tmp_path):
    A, Ym = _problem("multiclass")
    X, Y = _dask(A, np.float32), _dask(Ym, np.float32)
    model = Rembrandt(n_components=3, feature_map=True, random_state=np.random.default_rng(1)).fit(X, Y)
    url = str(tmp_path / "rembrandt.zarr")
    model.save(url)
    back = Rembrandt.load(url)
    for name in ("embedding_", "eigenvalues_", "singular_values_", "feature_map_"):
        np.testing.assert_array_equal(getattr(back, name), getattr(model, name))
    assert back.n_passes_ == model.n_passes_ and back.alpha_ == model.alpha_ and back.intercept_ is None
    assert back.n_components == 3 and back.random_state is None  # a Generator is not saved
    np.testing.assert_array_equal(back.transform(Ym), model.transform(Ym))
    assert type(load_model(url)) is Rembrandt
    with pytest.raises(FileExistsError, match="overwrite=True"):
        model.save(url)
    model.save(url, overwrite=True)
    with pytest.raises(StoreError, match="not a PLST"):
        PLST.load(url)
    with pytest.raises(StoreError, match="no model store|not a saved"):
        Rembrandt.load(str(tmp_path / "missing.zarr"))
    plst = PLST(n_components=2, random_state=0).fit(None, Y)
    plst.save(str(tmp_path / "plst.zarr"))
    back = load_model(str(tmp_path / "plst.zarr"))
    assert isinstance(back, PLST) and back.mean_ is None
    np.testing.assert_array_equal(back.embedding_, plst.embedding_)
    assert not list(tmp_path.glob(".*partial*"))  # no temporary leftovers
    with pytest.raises(NotFittedError):
        Rembrandt().save(str(tmp_path / "unfitted.zarr"))


# ------------------------------------------------------------------------------------------
# hierarchy metric


def _write(path, text):
    path.write_text(text)
    return path


def test_sibling_fraction_brute_force_with_ties(tmp_path):
    # nodes: 100 -> {0, 1, 2}, 101 -> {3, 4}, 102 -> {5}; labels are the leaves 0..5
    leaves = {i: i for i in range(6)}  # internal nodes are not labels
    hier = read_hierarchy(_write(tmp_path / "h.txt", "100 0\n100 1\n100 2\n101 3\n101 4\n102 5\n"), format="edges",
                          label_map=leaves)
    paths = read_hierarchy(_write(tmp_path / "p.txt", "7 100 0\n7 100 1\n7 100 2\n7 101 3\n7 101 4\n8 102 5\n"),
                           label_map=leaves)
    assert hier.n_labels == 6
    assert (hier.siblings() != paths.siblings()).nnz == 0
    np.testing.assert_array_equal(hier.sibling_counts(), [2, 2, 2, 1, 1, 0])
    assert most_fraternal_fraction(hier) == pytest.approx(2 / 6)
    E = np.array([[0, 0], [0.1, 0], [5, 5], [5, 5.2], [0.05, 0.01], [9, 9]], dtype=float)
    # label 0 -> 4 (not sibling); 1 -> 4; 2 -> 3; 3 -> 2; 4 -> 0 (sibling? no: 4 is under 101) ; 5 -> 3
    scores = nearest_neighbor_sibling_scores(E, hier)
    np.testing.assert_array_equal(scores, [0, 0, 0, 0, 0, 0])
    E2 = np.array([[0, 0], [0, 0.1], [0, -0.1], [5, 5], [5, 5.1], [9, 0]], dtype=float)
    # 0: tie between 1 and 2 (both siblings) -> 1; 1 -> 0; 2 -> 0; 3 -> 4; 4 -> 3; 5 -> nearest is 3 (not)
    np.testing.assert_array_equal(nearest_neighbor_sibling_scores(E2, hier), [1, 1, 1, 1, 1, 0])
    assert sibling_fraction(E2, hier) == pytest.approx(5 / 6)
    # exact ties with one sibling of two: expected 1/2; blockwise equals unblocked
    E3 = np.array([[0, 0], [1, 0], [0, 0], [0, 1], [0, 0], [3, 3]], dtype=float)
    s1 = nearest_neighbor_sibling_scores(E3, hier)
    s2 = nearest_neighbor_sibling_scores(E3, hier, block_rows=2)
    np.testing.assert_array_equal(s1, s2)
    assert s1[0] == pytest.approx(0.5)  # ties: 2 (sibling) and 4 (not)
    # cosine: zero rows are at chance level (siblings / (L - 1))
    cos = nearest_neighbor_sibling_scores(np.zeros((6, 2)), hier, metric="cosine")
    np.testing.assert_allclose(cos, hier.sibling_counts() / 5)


def test_lshtc1_hierarchy_file(shared_data):
    root = shared_data / "lshtc1-dryrun-task2"
    hier = read_hierarchy(root / "cat_hier.txt.gz", label_map=root / "label_map.tsv.gz", n_labels=1139)
    assert hier.in_hierarchy.all() and hier.membership.shape[0] == 1139
    assert most_fraternal_fraction(hier) == pytest.approx(hier.sibling_counts().max() / 1139)


# ------------------------------------------------------------------------------------------
# command line


def test_cli_spectrum_writes_table_and_plot(tmp_path, capsys):
    from xmldask.datasets import make_synthetic
    from xmldask.store import open_dataset

    url = str(tmp_path / "synth.zarr")
    make_synthetic(url, n_samples=3000, n_features=200, n_labels=40, seed=0, block_rows=700, progress=False)
    out = tmp_path / "spectrum"
    assert main(["spectrum", url, "--matrix", "Y", "--k", "8", "--out", str(out)]) == 0
    assert "top eigenvalues" in capsys.readouterr().out
    rows = list(csv.DictReader(open(out / "spectrum.csv")))
    assert [int(r["rank"]) for r in rows] == list(range(1, 9))
    Ym = open_dataset(url).Y.compute()
    Yd = (Ym.T @ Ym).toarray() if sp.issparse(Ym) else np.asarray(Ym.T @ Ym)
    exact = np.linalg.eigvalsh(Yd)[::-1]
    got = np.array([float(r["eigenvalue"]) for r in rows])
    assert np.all(got <= exact[:8] * (1 + 1e-4))
    np.testing.assert_allclose(got[:3], exact[:3], rtol=1e-2)
    np.testing.assert_allclose(float(rows[-1]["cumulative_share"]), exact[:8].sum() / np.trace(Yd), rtol=2e-2)
    assert (out / "spectrum.png").stat().st_size > 1000 and "| rank |" in (out / "spectrum.md").read_text()
    assert main(["spectrum", url, "--matrix", "X", "--k", "3", "--center", "--no-plot", "--out",
                 str(tmp_path / "x")]) == 0
    assert not (tmp_path / "x" / "spectrum.png").exists()
    assert main(["spectrum", str(tmp_path / "missing.zarr"), "--out", str(tmp_path / "m")]) == 2
    json.dumps(rows)


def test_spectrum_plot_is_titled_after_the_ingested_files(tmp_path):
    """A pipeline's stage store is always data.zarr: the title names what it was ingested from."""
    from xmldask.datasets import write_synthetic_text
    from xmldask.embedding.spectrum import _data_name
    from xmldask.io import ingest

    text = write_synthetic_text(str(tmp_path / "train.txt.gz"), n_samples=50, n_features=20, n_labels=5, seed=0)
    ingest(text, str(tmp_path / "data.zarr"))
    assert _data_name(str(tmp_path / "data.zarr")) == "train.txt.gz"
    assert _data_name(str(tmp_path / "absent.zarr")) == "absent.zarr"


def test_spectrum_takes_fewer_columns_where_the_workers_hold_few(tmp_path, monkeypatch, caplog, unpaused_workers):
    """Workers whose memory limit cannot hold the column-sized operands of k + p columns: pairwise sums, then fewer
    eigenvalues (lower bounds of the exact ones, the largest within 5 % on this flat spectrum of 40 labels), with a
    warning; not even two columns: a clear error."""
    import logging

    import distributed

    from xmldask.datasets import make_synthetic
    from xmldask.embedding import spectrum as S
    from xmldask.store import open_dataset

    url = str(tmp_path / "synth.zarr")
    make_synthetic(url, n_samples=3000, n_features=200, n_labels=40, seed=0, block_rows=700, progress=False)
    A = open_dataset(url).Y
    column = 40 * np.dtype(np.float32 if A.dtype == np.float32 else np.float64).itemsize
    assert S._fitting_columns(A, 10, 20, None, url) == (10, 20, 8)
    assert S._fitting_columns(A, 10, 20, int(30 * 11 * column / S.MEMORY_SHARE), url) == (10, 20, 8)
    assert S._fitting_columns(A, 10, 20, int(30 * 5 * column / S.MEMORY_SHARE), url) == (10, 20, 2)
    with caplog.at_level(logging.WARNING, logger="xmldask.embedding.spectrum"):
        assert S._fitting_columns(A, 10, 20, int(12 * 5 * column / S.MEMORY_SHARE), url) == (6, 6, 2)
    assert "6 eigenvalues instead of 10" in caplog.text
    with pytest.raises(MemoryError, match="needs workers of at least"):
        S._fitting_columns(A, 10, 20, int(5 * column / S.MEMORY_SHARE), url)
    Ym = A.compute()
    exact = np.linalg.eigvalsh((Ym.T @ Ym).toarray() if sp.issparse(Ym) else np.asarray(Ym.T @ Ym))[::-1]
    monkeypatch.setattr(S, "MEMORY_SHARE", 12 * 5 * column / 2**29)  # a task of a 1 GiB worker of 2 threads: 12 columns
    with distributed.LocalCluster(n_workers=1, threads_per_worker=2, processes=False, memory_limit="1GiB",
                                  dashboard_address=":0") as cluster, distributed.Client(cluster):
        spectrum = S.compute_spectrum(url, n_components=10)
    assert len(spectrum.eigenvalues) == 6 and np.all(spectrum.eigenvalues <= exact[:6] * (1 + 1e-4))
    np.testing.assert_allclose(spectrum.eigenvalues[0], exact[0], rtol=5e-2)
