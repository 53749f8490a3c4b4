"""Tests of xmldask.models: the decoder kernels against NumPy references, the estimator against in-memory pipelines."""

from __future__ import annotations

import pickle

import dask
import dask.array as da
import numpy as np
import pytest
import scipy.linalg
import scipy.sparse as sp
import zarr
from scipy.special import expit, log_expit, logsumexp, softmax

from xmldask.datasets import make_synthetic
from xmldask.models import EmbeddingClassifier, NotFittedError
from xmldask.models import _kernels as K
from xmldask.store import StoreError

# ----------------------------------------------------------------------------------------------
# fixtures


@pytest.fixture(scope="module")
def multiclass(tmp_path_factory):
    ds = make_synthetic(str(tmp_path_factory.mktemp("mc") / "train.zarr"), n_samples=3000, n_features=300,
                        n_labels=20, multiclass=True, rank=8, seed=1, block_rows=700)
    return ds.X, ds.Y


@pytest.fixture(scope="module")
def multilabel(tmp_path_factory):
    ds = make_synthetic(str(tmp_path_factory.mktemp("ml") / "train.zarr"), n_samples=3000, n_features=300,
                        n_labels=30, multiclass=False, rank=8, seed=2, block_rows=700)
    return ds.X, ds.Y


def _cs_embedding(n_labels, k, seed=0):
    """A compressed-sensing style label embedding: a random Gaussian matrix."""
    return np.random.default_rng(seed).standard_normal((n_labels, k)).astype(np.float32) / np.sqrt(k)


def _in_memory(X, Y):
    return sp.csr_matrix(X.compute()), sp.csr_matrix(Y.compute())


def _p_at_1(labels, Y):
    Y = sp.csr_matrix(Y)
    return float(np.mean(np.asarray(Y[np.arange(Y.shape[0]), labels]).ravel() != 0))


def _uneven(A, chunks):
    return da.from_array(A, chunks=(chunks, -1), asarray=False, fancy=False)


# ----------------------------------------------------------------------------------------------
# kernels


@pytest.mark.parametrize("kernel", ["gaussian", "laplacian"])
def test_rff_approximates_kernel(kernel):
    # phi(x).phi(y) = (2/m) sum_j cos(a_j) cos(b_j): a mean of m i.i.d. terms bounded by 2 in absolute
    # value, so its standard deviation is at most 2 / sqrt(m) (0.0063 for m = 100000); 5 sigma = 0.032.
    m = 100_000
    rng = np.random.default_rng(0)
    omega, phase = K.sample_frequencies(rng, 4, m, kernel, dtype=np.float64)
    Z = rng.normal(size=(6, 4)) * 0.5
    bw = 1.3
    F = K.rff_map(Z, omega, phase, bw)
    approx = F @ F.T
    exact = np.array([[K.kernel_value(x, y, kernel, bw) for y in Z] for x in Z])
    assert np.abs(approx - exact).max() < 5 * 2 / np.sqrt(m)
    assert np.allclose(np.diag(exact), 1)


def test_rff_float32_and_seeded():
    o1 = K.sample_frequencies(np.random.default_rng(3), 5, 10, "gaussian")
    o2 = K.sample_frequencies(np.random.default_rng(3), 5, 10, "gaussian")
    assert o1[0].dtype == np.float32 and np.array_equal(o1[0], o2[0]) and np.array_equal(o1[1], o2[1])
    F = K.rff_map(np.ones((3, 5), np.float32), *o1, 2.0)
    assert F.dtype == np.float32 and F.shape == (3, 10)
    with pytest.raises(ValueError, match="kernel"):
        K.sample_frequencies(np.random.default_rng(0), 2, 3, "polynomial")


@pytest.mark.parametrize("kernel", ["gaussian", "laplacian"])
def test_median_distance(kernel):
    Z = np.random.default_rng(0).normal(size=(40, 3))
    i, j = np.triu_indices(40, 1)
    d = np.abs(Z[i] - Z[j]).sum(1) if kernel == "laplacian" else np.linalg.norm(Z[i] - Z[j], axis=1)
    assert K.median_distance(Z, kernel) == pytest.approx(np.median(d))
    # more pairs than max_pairs: every pair of a random subset of rows, close to the median of all pairs
    Z = np.random.default_rng(1).normal(size=(600, 5))
    i, j = np.triu_indices(600, 1)
    d = np.abs(Z[i] - Z[j]).sum(1) if kernel == "laplacian" else np.linalg.norm(Z[i] - Z[j], axis=1)
    assert K.median_distance(Z, kernel, max_pairs=20_000) == pytest.approx(np.median(d), rel=0.03)


def _finite_difference(f, S, eps=1e-6):
    G = np.zeros_like(S)
    for idx in np.ndindex(S.shape):
        P, M = S.copy(), S.copy()
        P[idx] += eps
        M[idx] -= eps
        G[idx] = (f(P) - f(M)) / (2 * eps)
    return G


@pytest.mark.parametrize("loss_name", ["softmax", "logistic"])
def test_loss_gradients(loss_name):
    rng = np.random.default_rng(0)
    S = rng.normal(size=(5, 4)) * 3
    # rows with one label, two labels and none
    Y = sp.csr_matrix(np.array([[1, 0, 0, 0], [0, 1, 1, 0], [0, 0, 0, 0], [0, 0, 0, 1], [1, 1, 0, 1]], float))
    fn = K.softmax_loss if loss_name == "softmax" else K.logistic_loss
    loss, G = fn(S.copy(), Y)
    Yd = Y.toarray()
    if loss_name == "softmax":
        count = Yd.sum(1)
        target = Yd / np.maximum(count, 1)[:, None]
        ref = ((count > 0) * logsumexp(S, axis=1)).sum() - (target * S).sum()
        ref_grad = (count > 0)[:, None] * softmax(S, axis=1) - target
    else:
        ref = -(Yd * log_expit(S) + (1 - Yd) * log_expit(-S)).sum()
        ref_grad = expit(S) - Yd
    assert loss == pytest.approx(ref, rel=1e-12)
    assert np.allclose(G, ref_grad, atol=1e-12)
    assert np.allclose(G, _finite_difference(lambda T: fn(T.copy(), Y, gradient=False)[0], S), atol=1e-6)
    # dense labels give the same; float32 stays float32
    assert fn(S.copy(), Yd)[0] == pytest.approx(loss)
    loss32, G32 = fn(S.astype(np.float32), Y)
    assert G32.dtype == np.float32 and loss32 == pytest.approx(loss, rel=1e-5)


@pytest.mark.parametrize("loss_name", ["softmax", "logistic"])
def test_rescale_grid_min_is_the_whole_grids_minimum(loss_name):
    from xmldask.models.embedding_classifier import RESCALE_FACTORS, RESCALE_OFFSETS, rescale_grid_min

    fn = K.softmax_loss if loss_name == "softmax" else K.logistic_loss
    # as _rescale searches them: a softmax is the same for every offset
    offsets = (0.0,) if loss_name == "softmax" else RESCALE_OFFSETS
    for seed in range(20):
        rng = np.random.default_rng(seed)
        # ridge-like scores: near-probabilities, a few rows' labels scored high
        Y = sp.random(200, 30, density=rng.uniform(0.02, 0.2), format="csr", random_state=seed)
        Y.data[:] = 1
        S = (0.3 * Y.toarray() + rng.normal(scale=rng.uniform(0.02, 0.3), size=Y.shape)).astype(np.float32)
        calls = []

        def loss(c, o, S=S, Y=Y, calls=calls):
            calls.append((c, o))
            return fn(c * S + o, Y, gradient=False)[0]

        grid = [(fn(c * S + o, Y, gradient=False)[0], i, j, c, o) for i, c in enumerate(RESCALE_FACTORS)
                for j, o in enumerate(offsets)]
        best = min(grid, key=lambda g: (g[0], g[1], g[2]))  # the first of ties, c then o
        assert rescale_grid_min(loss, RESCALE_FACTORS, offsets) == (best[3], best[4])
        # each loss evaluated once; fewer than the grid's where there are offsets to walk
        assert len(calls) == len(set(calls)) and len(calls) <= len(grid) and (len(offsets) == 1 or len(calls) < 40)


@pytest.mark.parametrize("special", ["finite", "nan", "-inf"])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_topk_rows_matches_stable_argsort_with_ties(special, dtype):
    # finite scores and k <= SELECT_K take the argmax scans, the others the partition
    rng = np.random.default_rng(0)
    S = rng.integers(0, 4, size=(200, 30)).astype(dtype)  # many ties
    S[5, :] = 1.0  # a row of equal scores
    S[9, :4] = -0.0  # equal to 0.0
    if special != "finite":
        S[7, 3] = np.nan if special == "nan" else -np.inf  # both rank last
    original = S.copy()
    for k in (1, 3, 7, K.SELECT_K, 30, 40):
        S = np.concatenate([S, np.zeros((200, 10), dtype)], axis=1) if k > S.shape[1] else S
        labels, scores = K.topk_rows(S, k)
        ref = np.argsort(-np.where(np.isnan(S), -np.inf, S), axis=1, kind="stable")[:, :k]
        assert labels.dtype == np.int32
        assert np.array_equal(labels, ref)
        assert np.array_equal(scores, np.take_along_axis(S, ref, axis=1), equal_nan=True)
        assert scores.dtype == dtype
        assert np.array_equal(S[:, :30], original, equal_nan=True)  # the input is left alone
    with pytest.raises(ValueError, match="k must be"):
        K.topk_rows(S, 41)


def test_topk_scores_sub_batches_equal_full():
    rng = np.random.default_rng(1)
    F, Q, bias = rng.normal(size=(50, 6)), rng.normal(size=(6, 40)), rng.normal(size=40)
    full = K.topk_rows(F @ Q + bias, 5)
    small = K.topk_scores(F, Q, bias, 5, budget=7 * 40)  # 7 rows at a time
    assert np.array_equal(small[0], full[0]) and np.allclose(small[1], full[1], rtol=1e-6)


# ----------------------------------------------------------------------------------------------
# the estimator against in-memory references


def _reference_W(Xm, Ym, R, alpha):
    """Ridge of Y R on centred X with lam = alpha * trace(Xc^T Xc) / d and an intercept."""
    Xd = Xm.toarray().astype(np.float64)
    B = Ym.toarray() @ R.astype(np.float64)
    mu = Xd.mean(0)
    Xc = Xd - mu
    G = Xc.T @ Xc
    lam = alpha * np.trace(G) / G.shape[0]
    W = np.linalg.solve(G + lam * np.eye(G.shape[0]), Xc.T @ (B - B.mean(0)))
    return W, B.mean(0) - mu @ W


def _reference_decoder(F, Ym, decoder_alpha):
    G = F.T.astype(np.float64) @ F / F.shape[0]
    lam = decoder_alpha * np.mean(np.diag(G)[:-1])
    G[np.arange(G.shape[0] - 1), np.arange(G.shape[0] - 1)] += lam
    return scipy.linalg.solve(G, F.T.astype(np.float64) @ Ym.toarray() / F.shape[0], assume_a="pos")


@pytest.mark.parametrize("kernel", ["none", "laplacian"])
def test_W_and_warm_start_equal_in_memory(multiclass, kernel):
    X, Y = multiclass
    Xm, Ym = _in_memory(X, Y)
    R = _cs_embedding(Y.shape[1], 6)
    clf = EmbeddingClassifier(embedding=R, kernel=kernel, n_random_features=64, max_epochs=0,
                              validation_fraction=0.0, dtype=np.float64, random_state=0).fit(X, Y)
    W, c = _reference_W(Xm, Ym, R, clf.alpha)
    assert np.allclose(clf.W_, W, rtol=1e-6, atol=1e-8) and np.allclose(clf.intercept_, c, atol=1e-8)
    F = K.decoder_features(Xm, clf.W_, clf.intercept_, clf.omega_, clf.phase_, clf.bandwidth_ or 1.0)
    Q = _reference_decoder(F, Ym, clf.decoder_alpha)
    assert np.allclose(clf.Q_, Q[:-1], rtol=1e-6, atol=1e-8) and np.allclose(clf.bias_, Q[-1], atol=1e-8)
    assert clf.task_ == "multiclass" and clf.n_passes_ == 2


def _reference_pipeline(Xm, Ym, clf, holdout):
    """In-memory Algorithm 3 warm start: W, RFF, ridge decoder on the training rows, rescaled on held-out."""
    train = ~holdout
    W, c = _reference_W(Xm[train], Ym[train], clf.R_, clf.alpha)
    F = K.decoder_features(Xm, W.astype(np.float32), c.astype(np.float32), clf.omega_, clf.phase_, clf.bandwidth_)
    Q = _reference_decoder(F[train], Ym[train], clf.decoder_alpha)
    return F, Q


def test_fit_multiclass_above_chance_and_matches_reference(multiclass):
    X, Y = multiclass
    Xm, Ym = _in_memory(X, Y)
    R = _cs_embedding(Y.shape[1], 10)
    warm = EmbeddingClassifier(embedding=R, kernel="gaussian", n_random_features=300, max_epochs=0,
                               random_state=0).fit(X, Y)
    clf = EmbeddingClassifier(embedding=R, kernel="gaussian", n_random_features=300, max_epochs=4,
                              learning_rate=0.5, batch_size=1024, random_state=0).fit(X, Y)
    # the warm start agrees with an in-memory pipeline (same held-out rows, same random features)
    split_seed = int(np.random.default_rng(np.random.SeedSequence(0).spawn(4)[0]).integers(2**63))
    holdout = np.concatenate([K.holdout_mask(split_seed, b, c, 0.1) for b, c in enumerate(X.chunks[0])])
    F, Q = _reference_pipeline(Xm, Ym, warm, holdout)
    S_ref = F @ Q
    S = F[:, :-1] @ warm.Q_ + warm.bias_
    c = np.median(S[:, 0] / S_ref[:, 0])  # the held-out rescaling is a positive scalar
    assert c > 0 and np.allclose(S, c * S_ref, rtol=1e-3, atol=1e-3 * np.abs(S).max())
    labels, scores = dask.compute(*clf.predict_topk(X, k=3))
    top1 = np.bincount(Ym.indices, minlength=Y.shape[1]).max() / Y.shape[0]
    assert _p_at_1(labels[:, 0], Ym) > max(0.5, 2 * top1)
    h = clf.history_
    assert h[0]["epoch"] == 0 and len(h) >= 2 and min(e["val_loss"] for e in h[1:]) <= h[0]["val_loss"]
    assert clf.n_passes_ == 2 + len(h) - 1
    assert labels.dtype == np.int32 and scores.dtype == np.float32


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_held_out_rows_drawn_per_block_and_never_stored(dtype):
    """The held-out rows are a pure function of (seed, block): the lazy weights, the count of training
    rows and every block's mask agree, and a graph of the weights does not grow with the rows."""
    from xmldask.models._graph import HeldOut

    held = HeldOut(seed=11, fraction=0.3, chunks=(400, 7, 1000, 0, 93))
    masks = [held.mask(b) for b in range(len(held.chunks))]
    assert [m.shape[0] for m in masks] == list(held.chunks) and all(m.dtype == bool for m in masks)
    weights = held.weights(dtype)
    assert weights.dtype == dtype and weights.chunks == (held.chunks,)
    got = weights.compute()
    np.testing.assert_array_equal(got, (~np.concatenate(masks)).astype(dtype))
    assert held.n_train() == int(got.sum()) and 0.2 < 1 - got.mean() < 0.4
    assert not np.array_equal(masks[0][:400], HeldOut(12, 0.3, held.chunks).mask(0))  # another seed, other rows
    assert not np.array_equal(masks[0][:7], masks[1])  # each block its own stream
    assert HeldOut(11, 0.0, held.chunks).n_train() == sum(held.chunks)

    def graph_bytes(rows):
        return len(pickle.dumps(dict(HeldOut(11, 0.3, (rows,) * 16).weights(dtype).dask)))

    assert graph_bytes(10**7) < 1.2 * graph_bytes(10)  # no per-row array in the graph


def test_fit_multilabel(multilabel):
    X, Y = multilabel
    Xm, Ym = _in_memory(X, Y)
    clf = EmbeddingClassifier(embedding=_cs_embedding(Y.shape[1], 12), kernel="laplacian", n_random_features=300,
                              max_epochs=3, random_state=0).fit(X, Y)
    assert clf.task_ == "multilabel"
    labels, _ = dask.compute(*clf.predict_topk(X, k=1))
    freq = np.asarray(Ym.sum(0)).ravel()
    baseline = _p_at_1(np.full(Ym.shape[0], freq.argmax()), Ym)
    assert _p_at_1(labels[:, 0], Ym) > baseline + 0.1
    forced = EmbeddingClassifier(embedding=_cs_embedding(Y.shape[1], 12), kernel="none", task="multiclass",
                                 max_epochs=1, random_state=0).fit(X, Y)
    assert forced.task_ == "multiclass"


def test_uneven_blocks_in_memory_input_and_consistency(multiclass):
    X, Y = multiclass
    Xm, Ym = _in_memory(X, Y)
    chunks = (1000, 37, 963, 1000)
    Xu, Yu = _uneven(Xm, chunks), _uneven(Ym, chunks)
    clf = EmbeddingClassifier(embedding=_cs_embedding(Y.shape[1], 8), kernel="laplacian", n_random_features=100,
                              max_epochs=2, random_state=0).fit(Xu, Yu)
    S = clf.decision_function(Xu)
    assert S.chunks[0] == chunks and S.dtype == np.float32
    labels, scores = clf.predict_topk(Xu, k=4)
    S, labels, scores = dask.compute(S, labels, scores)
    assert np.array_equal(labels, np.argsort(-S, axis=1, kind="stable")[:, :4])
    assert np.allclose(scores, np.take_along_axis(S, labels.astype(np.int64), axis=1), rtol=1e-5, atol=1e-5)
    assert np.array_equal(clf.predict(Xm).compute(), labels[:, 0])  # in-memory X works too
    assert clf.transform(Xu).shape == (Xm.shape[0], 100)


def test_deterministic_for_a_seed(multiclass):
    X, Y = multiclass
    kw = dict(embedding=_cs_embedding(Y.shape[1], 8), kernel="gaussian", n_random_features=100, max_epochs=2)
    a = EmbeddingClassifier(**kw, random_state=5).fit(X, Y)
    b = EmbeddingClassifier(**kw, random_state=5).fit(X, Y)
    c = EmbeddingClassifier(**kw, random_state=6).fit(X, Y)
    assert np.array_equal(a.Q_, b.Q_) and np.array_equal(a.omega_, b.omega_)
    assert not np.array_equal(a.omega_, c.omega_)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("sparse", [True, False])
def test_transform_rows_matches_reference(dtype, sparse):
    rng = np.random.default_rng(4)
    A = rng.random((40, 15)) * (rng.random((40, 15)) < 0.3)
    A[[3, 17, 39]] = 0.0  # empty rows, including the last one
    idf = K.idf_weights(np.count_nonzero(A, axis=0), A.shape[0])
    ref_idf = np.log((1 + 40) / (1 + np.count_nonzero(A, axis=0))) + 1
    np.testing.assert_allclose(idf, ref_idf, rtol=1e-6)
    for weights in (None, idf):
        ref = A * (1 if weights is None else ref_idf)
        norms = np.linalg.norm(ref, axis=1, keepdims=True)
        ref = np.divide(ref, norms, out=np.zeros_like(ref), where=norms > 0)
        block = sp.csr_matrix(A.astype(dtype)) if sparse else A.astype(dtype)
        out = K.transform_rows(block, weights)
        assert sp.issparse(out) == sparse and out.dtype == dtype
        np.testing.assert_allclose(K._dense(out), ref, rtol=1e-5, atol=1e-6)
    assert np.array_equal(K._dense(block), A.astype(dtype))  # the input is not modified


@pytest.mark.slow
@pytest.mark.parametrize("features", ["l2", "tfidf"])
def test_features_equal_fitting_on_transformed_rows(multiclass, features):
    """features='tfidf' / 'l2' is the raw pipeline on the transformed rows, with raw rows at prediction."""
    X, Y = multiclass
    Xm, Ym = _in_memory(X, Y)
    kw = dict(embedding=_cs_embedding(Y.shape[1], 8), kernel="gaussian", n_random_features=64, max_epochs=2,
              random_state=3)
    clf = EmbeddingClassifier(features=features, **kw).fit(X, Y)
    idf = None
    if features == "tfidf":
        idf = np.log((1 + Xm.shape[0]) / (1 + np.diff(Xm.tocsc().indptr))) + 1
        np.testing.assert_allclose(clf.idf_, idf, rtol=1e-6)
    else:
        assert clf.idf_ is None
    Xt = Xm @ sp.diags(idf) if idf is not None else Xm.copy()
    Xt = sp.diags(1 / np.maximum(np.sqrt(Xt.multiply(Xt).sum(axis=1).A.ravel()), 1e-30)) @ Xt
    Xt = da.from_array(sp.csr_matrix(Xt, dtype=np.float32), chunks=(X.chunks[0], -1), asarray=False, fancy=False)
    ref = EmbeddingClassifier(**kw).fit(Xt, Y)
    np.testing.assert_allclose(clf.W_, ref.W_, rtol=2e-3, atol=1e-5)
    a, b = dask.compute(clf.predict_topk(X, k=3), ref.predict_topk(Xt, k=3))
    assert np.mean(a[0] == b[0]) > 0.99
    with pytest.raises(ValueError, match="features must be one of"):
        EmbeddingClassifier(features="bm25", **kw).fit(X, Y)


def test_save_load_round_trip(multiclass, tmp_path):
    X, Y = multiclass
    clf = EmbeddingClassifier(embedding=_cs_embedding(Y.shape[1], 8), kernel="laplacian", n_random_features=50,
                              features="tfidf", max_epochs=1, random_state=0).fit(X, Y)
    url = str(tmp_path / "model.zarr")
    clf.save(url)
    with pytest.raises(FileExistsError, match="overwrite=True"):
        clf.save(url)
    clf.save(url, overwrite=True)
    back = EmbeddingClassifier.load(url)
    a, b = dask.compute(clf.predict_topk(X, k=3), back.predict_topk(X, k=3))
    assert np.array_equal(a[0], b[0]) and np.array_equal(a[1], b[1])
    assert back.history_ == clf.history_ and back.task_ == clf.task_ and back.kernel == "laplacian"
    assert back.features == "tfidf" and np.array_equal(back.idf_, clf.idf_)
    assert not [p for p in tmp_path.iterdir() if "partial" in p.name]
    # a store of another class is refused
    other = zarr.open_group(str(tmp_path / "other.zarr"), mode="w")
    other.attrs.update({"xmldask": {"kind": "model", "class": "Rembrandt", "model_version": 1, "layout_version": 1,
                                    "complete": True}})
    with pytest.raises(StoreError, match="Rembrandt model, not a EmbeddingClassifier"):
        EmbeddingClassifier.load(str(tmp_path / "other.zarr"))
    with pytest.raises(StoreError, match="no model store"):
        EmbeddingClassifier.load(str(tmp_path / "missing.zarr"))


def test_embedding_estimators_and_names(multiclass):
    X, Y = multiclass
    R = _cs_embedding(Y.shape[1], 5)

    class FixedEmbedding:
        def fit(self, X, Y):
            self.embedding_ = R
            return self

    class FeatureEmbedding:  # PCA-like: components_ (n_features, k), mean_
        components_ = np.random.default_rng(0).normal(size=(X.shape[1], 5)).astype(np.float32)
        mean_ = np.zeros(X.shape[1], np.float32)

        def fit(self, X, Y):
            return self

    a = EmbeddingClassifier(embedding=FixedEmbedding(), kernel="none", max_epochs=0, random_state=0).fit(X, Y)
    b = EmbeddingClassifier(embedding=R, kernel="none", max_epochs=0, random_state=0).fit(X, Y)
    assert np.array_equal(a.Q_, b.Q_)
    c = EmbeddingClassifier(embedding=FeatureEmbedding(), kernel="none", max_epochs=0, random_state=0).fit(X, Y)
    assert np.array_equal(c.W_, FeatureEmbedding.components_) and c.R_ is None
    with pytest.raises(ValueError, match="unknown embedding name"):
        EmbeddingClassifier(embedding="lda").fit(X, Y)


def test_errors(multiclass):
    X, Y = multiclass
    R = _cs_embedding(Y.shape[1], 4)
    with pytest.raises(ValueError, match="kernel must be one of"):
        EmbeddingClassifier(embedding=R, kernel="rbf").fit(X, Y)
    with pytest.raises(ValueError, match="Y has 2999 rows but X has 3000"):
        EmbeddingClassifier(embedding=R).fit(X, Y[:-1])
    with pytest.raises(ValueError, match="embedding must have shape"):
        EmbeddingClassifier(embedding=R[:-1]).fit(X, Y)
    with pytest.raises(ValueError, match="n_random_features must be"):
        EmbeddingClassifier(embedding=R, n_random_features=0).fit(X, Y)
    with pytest.raises(NotFittedError, match="not fitted"):
        EmbeddingClassifier(embedding=R).predict_topk(X)
    clf = EmbeddingClassifier(embedding=R, kernel="none", max_epochs=0, random_state=0).fit(X, Y)
    with pytest.raises(ValueError, match="k must be an integer between 1 and n_labels = 20"):
        clf.predict_topk(X, k=21)
    with pytest.raises(ValueError, match="features"):
        clf.decision_function(X[:, :-1])


def test_rembrandt_k_beyond_the_features_adds_nothing():
    """X W has rank at most d, spanned by Rembrandt's top d directions: k = d predicts as k = L (what lets a
    search cap k at the number of features)."""
    rng = np.random.default_rng(0)
    n, d, L = 1200, 12, 40
    A = rng.normal(size=(n, d)).astype(np.float32)
    scores = A @ rng.normal(size=(d, L)) + 0.5 * rng.normal(size=(n, L))
    y = scores.argmax(axis=1)
    Ym = sp.csr_matrix((np.ones(n, np.float32), (np.arange(n), y)), shape=(n, L))
    X = da.from_array(sp.csr_matrix(A), chunks=(500, -1), asarray=False)
    Y = da.from_array(Ym, chunks=(500, -1), asarray=False)
    kw = dict(embedding="rembrandt", kernel="none", max_epochs=0, alpha=1e-3, random_state=0)
    small = EmbeddingClassifier(n_components=d, **kw).fit(X, Y)
    full = EmbeddingClassifier(n_components=L, **kw).fit(X, Y)
    a, b = dask.compute(small.predict(X), full.predict(X))
    assert np.mean(a == b) > 0.98
    assert small.search_bounds(X, Y)["n_components"] == (1, d)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["rembrandt", "cs", "plst"])
def test_a_label_embedding_of_every_direction_is_the_identity(multilabel, name):
    """k = n_labels: the identity, no decomposition; the predictions and held-out figures of the decomposition's
    basis (Rembrandt fitted as an estimator), the ridge decoder's and SGD's, since both are the same in any basis."""
    X, Y = multilabel
    L = Y.shape[1]
    kw = dict(kernel="none", max_epochs=2, alpha=1e-2, random_state=5)
    named = EmbeddingClassifier(embedding=name, n_components=L, **kw).fit(X, Y)
    np.testing.assert_array_equal(named.R_, np.eye(L, dtype=np.float32))
    assert named.n_passes_ == 1 + 1 + 2  # the map (one pass), the decoder's normal equations, two epochs
    from xmldask.embedding import Rembrandt

    basis = EmbeddingClassifier(embedding=Rembrandt(n_components=L, random_state=5), n_components=L, **kw).fit(X, Y)
    assert not np.allclose(np.abs(basis.R_), np.eye(L), atol=1e-3)  # another basis
    for a, b in zip(named.history_, basis.history_):
        assert a["val_p@1"] == pytest.approx(b["val_p@1"], abs=1e-3)
        assert a["val_loss"] == pytest.approx(b["val_loss"], rel=1e-3)
    s_named, s_basis = dask.compute(named.decision_function(X[:500]), basis.decision_function(X[:500]))
    np.testing.assert_allclose(s_named, s_basis, rtol=1e-3, atol=1e-3 * np.abs(s_basis).max())


def test_an_error_in_a_decoder_step_leaves_no_producer_thread(multiclass, monkeypatch):
    """The minibatch producer stops when the SGD loop raises, instead of waiting forever on its full queue."""
    import threading

    from xmldask.models import _kernels as MK

    X, Y = multiclass
    calls = {"n": 0}
    real = MK.softmax_loss

    def failing(S, Ym, **kw):
        calls["n"] += 1
        if "gradient" not in kw and calls["n"] > 3:  # a minibatch step of the SGD, not an evaluation
            raise RuntimeError("boom in a decoder step")
        return real(S, Ym, **kw)

    monkeypatch.setattr(MK, "softmax_loss", failing)
    before = set(threading.enumerate())
    with pytest.raises(RuntimeError, match="boom in a decoder step"):
        EmbeddingClassifier(embedding=_cs_embedding(Y.shape[1], 8), kernel="none", max_epochs=2, batch_size=64,
                            random_state=0).fit(X, Y)
    assert calls["n"] > 3
    producers = [t for t in threading.enumerate() if t not in before and "_minibatches" in t.name and t.is_alive()]
    assert producers == []


def _reference_sgd_epoch(Xm, Ym, setup, Q, V, order, chains, seeds, lr, chunks):
    """Chains of preconditioned momentum SGD in plain NumPy (softmax gradient by SciPy), averaged by rows."""
    bounds = np.cumsum((0,) + tuple(chunks))
    st, bs = setup["state"], setup["batch_size"]
    ends = []
    for c in range(chains):
        Qc, Vc, loss, rows = Q.astype(np.float64), V.astype(np.float64), 0.0, 0
        for b in order[c::chains]:
            train = np.flatnonzero(~K.holdout_mask(setup["seed"], int(b), int(chunks[b]), setup["fraction"]))
            np.random.default_rng(int(seeds[b])).shuffle(train)
            for a in range(0, train.size, bs):
                idx = bounds[b] + np.sort(train[a:a + bs])
                F = Xm[idx].toarray().astype(np.float64) @ st["W"] + st["intercept"]
                F = np.hstack([F, np.ones((idx.size, 1))])
                S = F @ Qc
                Yd = Ym[idx].toarray()
                loss += (logsumexp(S, axis=1) - (Yd * S).sum(1)).sum()
                grad = F.T @ (softmax(S, axis=1) - Yd) / idx.size
                Vc = setup["momentum"] * Vc + setup["P"] @ grad
                Qc = Qc - lr * Vc
                rows += idx.size
        ends.append((Qc, Vc, loss, rows))
    w = np.array([e[3] for e in ends], float) / sum(e[3] for e in ends)
    return (sum(wi * e[0] for wi, e in zip(w, ends)), sum(wi * e[1] for wi, e in zip(w, ends)),
            sum(e[2] for e in ends), sum(e[3] for e in ends))


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("chains,source", [(1, "memory"), (3, "memory"), (2, "store")])
def test_sgd_epoch_on_the_cluster_matches_numpy(multiclass, dtype, chains, source):
    """An SGD epoch as tasks (uneven blocks dealt to chains, each block's rows in its seed's order, the
    chains averaged by rows; a store's blocks read in the tasks) equals the same algorithm in NumPy."""
    from xmldask.models import _graph
    from xmldask.store.csr import block_reader

    X, Y = multiclass
    Xm, Ym = _in_memory(X, Y)
    chunks = (1000, 37, 463, 500, 300, 700) if source == "memory" else X.chunks[0]
    Xu, Yu = (_uneven(Xm, chunks), _uneven(Ym, chunks)) if source == "memory" else (X, Y)
    assert (block_reader(Xu) is not None) == (source == "store")
    rng = np.random.default_rng(3)
    k, L = 5, Y.shape[1]
    state = {"W": (rng.standard_normal((Xm.shape[1], k)) / 10).astype(dtype),
             "intercept": rng.standard_normal(k).astype(dtype), "omega": None, "phase": None, "bandwidth": None}
    A = rng.standard_normal((k + 1, k + 1))
    setup = {"seed": 7, "fraction": 0.2, "state": state, "P": (A @ A.T / (k + 1) + np.eye(k + 1)).astype(dtype) / 4,
             "loss_fn": K.softmax_loss, "batch_size": 128, "momentum": 0.9, "l2": 0.0}
    Q, V = (rng.standard_normal((k + 1, L)) / 10).astype(dtype), (rng.standard_normal((k + 1, L)) / 100).astype(dtype)
    Q0, V0 = Q.copy(), V.copy()
    order, seeds = rng.permutation(len(chunks)), rng.integers(2**62, size=len(chunks))
    epoch = _graph.sgd_epoch(Xu, Yu, setup, Q, V, order=order, chains=chains, seeds=seeds, learning_rate=0.3)
    read_tasks = [key for key in dict(epoch.__dask_graph__()) if isinstance(key, tuple) and key[0] == Xu.name]
    assert (read_tasks == []) == (source == "store")  # a store's blocks are read in the SGD tasks
    got = dask.compute(epoch)[0]
    want = _reference_sgd_epoch(Xm, Ym, setup, Q, V, order, chains, seeds, 0.3, chunks)
    assert np.array_equal(Q, Q0) and np.array_equal(V, V0)  # the start is not changed
    tol = 2e-3 if dtype == np.float32 else 1e-9
    for a, b in zip(got[:2], want[:2]):
        assert a.dtype == dtype
        np.testing.assert_allclose(a, b, rtol=tol, atol=tol * np.abs(b).max())
    assert got[2] == pytest.approx(want[2], rel=tol) and got[3] == want[3]
    n_held = sum(int(K.holdout_mask(7, b, c, 0.2).sum()) for b, c in enumerate(chunks))
    assert got[3] == Xm.shape[0] - n_held


def test_sgd_chains_where_the_epochs_run(multiclass, monkeypatch):
    """Small epochs run in the fitting process; large ones (or an explicit number of chains) as tasks, ``auto``
    giving one chain per task the scheduler runs at once, at most one per SGD_CHAIN_BLOCKS blocks."""
    from xmldask.models import embedding_classifier as EC

    X, Y = multiclass  # 5 blocks
    kw = dict(embedding=_cs_embedding(Y.shape[1], 6), kernel="none", max_epochs=1, random_state=0)
    seen = []
    real = EC._graph.sgd_epoch

    def spy(*args, chains, **kwargs):
        seen.append(chains)
        return real(*args, chains=chains, **kwargs)

    monkeypatch.setattr(EC._graph, "sgd_epoch", spy)
    EmbeddingClassifier(**kw).fit(X, Y)
    EmbeddingClassifier(**kw, sgd_chains=1).fit(X, Y)
    assert seen == []  # 2,700 x 20 entries: in this process
    EmbeddingClassifier(**kw, sgd_chains=2).fit(X, Y)
    EmbeddingClassifier(**kw, sgd_chains=9).fit(X, Y)  # at most one chain a block
    monkeypatch.setattr(EC, "SGD_CLUSTER_ENTRIES", 0)
    monkeypatch.setattr(EC, "parallelism", lambda: 8)
    EmbeddingClassifier(**kw).fit(X, Y)  # 5 blocks: one chain (SGD_CHAIN_BLOCKS = 4)
    monkeypatch.setattr(EC, "SGD_CHAIN_BLOCKS", 2)
    EmbeddingClassifier(**kw).fit(X, Y)
    monkeypatch.setattr(EC, "parallelism", lambda: 1)
    EmbeddingClassifier(**kw).fit(X, Y)
    assert seen == [2, 5, 1, 2, 1]
    for bad in (0, -1, 1.5, "many"):
        with pytest.raises(ValueError, match="sgd_chains"):
            EmbeddingClassifier(**kw, sgd_chains=bad).fit(X, Y)


def test_sgd_chains_give_the_same_decoder_on_a_distributed_cluster(multiclass, client):
    """Two chains on two worker processes give the decoder of the same chains in threads, and it predicts
    (float64: BLAS rounds float32 products differently with another number of threads, and SGD amplifies it)."""
    X, Y = multiclass
    kw = dict(embedding=_cs_embedding(Y.shape[1], 8), kernel="gaussian", n_random_features=64, max_epochs=3,
              sgd_chains=2, dtype=np.float64, random_state=0)
    local = EmbeddingClassifier(**kw).fit(X, Y)
    with client.as_current():
        remote = EmbeddingClassifier(**kw).fit(X, Y)
    assert len(remote.history_) == len(local.history_) >= 2
    np.testing.assert_allclose(remote.Q_, local.Q_, rtol=1e-7, atol=1e-9)
    labels = local.predict(X).compute()
    assert _p_at_1(labels, sp.csr_matrix(Y.compute())) > 0.5


@pytest.mark.parametrize("block", [256, 7])
@pytest.mark.parametrize("lower", [True, False])
def test_inverse_from_cholesky_is_the_inverse(lower, block):
    """SGD's preconditioner: the inverse of the decoder's normal matrix from its Cholesky factor (potri)."""
    import scipy.linalg

    from xmldask.models._kernels import inverse_from_cholesky

    A = np.random.default_rng(0).normal(size=(60, 25))
    H = A.T @ A + 0.1 * np.eye(25)
    P = inverse_from_cholesky(scipy.linalg.cho_factor(H, lower=lower), block=block)  # 7: uneven blocks
    np.testing.assert_allclose(P, np.linalg.inv(H), rtol=1e-10, atol=1e-12)
    np.testing.assert_array_equal(P, P.T)


def test_time_budget_stops_the_decoder_epochs(multiclass, monkeypatch):
    """No epoch starts that would end past the budget (each clock reading one second later here); the epochs made
    are the unbudgeted fit's first ones, and a budget spent before them keeps the ridge decoder."""
    from types import SimpleNamespace

    from xmldask.models import embedding_classifier as EC

    X, Y = multiclass
    clock = SimpleNamespace(now=0.0)

    def tick():
        clock.now += 1.0
        return clock.now

    monkeypatch.setattr(EC, "time", SimpleNamespace(perf_counter=tick))
    kw = dict(embedding=_cs_embedding(Y.shape[1], 8), kernel="none", max_epochs=6, n_iter_no_change=10,
              random_state=5)
    full = EmbeddingClassifier(**kw).fit(X, Y)
    cut = EmbeddingClassifier(**kw, time_budget=12).fit(X, Y)
    assert cut.history_[-1]["stopped"] == "time_budget" and 1 < len(cut.history_) < len(full.history_)
    assert [h["train_loss"] for h in cut.history_[1:]] == [h["train_loss"] for h in full.history_[1:len(cut.history_)]]
    ridge = EmbeddingClassifier(**{**kw, "max_epochs": 0}).fit(X, Y)
    none = EmbeddingClassifier(**kw, time_budget=0.5).fit(X, Y)
    assert len(none.history_) == 1 and np.array_equal(none.Q_, ridge.Q_)
    with pytest.raises(ValueError, match="time_budget"):
        EmbeddingClassifier(**kw, time_budget=-3).fit(X, Y)


def test_at_warm_start_is_the_fit_without_epochs(multilabel):
    """A fit with decoder epochs on the linear map keeps its ridge decoder: ``at_warm_start()`` is the model that
    ``max_epochs=0`` fits (not one with random features, nor one without epochs)."""
    X, Y = multilabel
    kw = dict(embedding="rembrandt", n_components=8, kernel="none", random_state=2)
    epochs = EmbeddingClassifier(**kw, max_epochs=3, learning_rate=8.0).fit(X, Y)
    ridge = EmbeddingClassifier(**kw, max_epochs=0, learning_rate=8.0).fit(X, Y)
    warm = epochs.at_warm_start()
    assert warm.get_params() == ridge.get_params()
    np.testing.assert_array_equal(warm.Q_, ridge.Q_)
    np.testing.assert_array_equal(warm.bias_, ridge.bias_)
    assert not np.array_equal(epochs.Q_, warm.Q_)  # the epochs' decoder is untouched
    assert warm.n_passes_ == ridge.n_passes_ < epochs.n_passes_
    assert [h["val_p@1"] for h in warm.history_] == [h["val_p@1"] for h in ridge.history_]
    np.testing.assert_array_equal(warm.predict_topk(X, 3)[0].compute(), ridge.predict_topk(X, 3)[0].compute())
    assert ridge.at_warm_start() is None and warm.at_warm_start() is None
    assert epochs.at_warm_start(release=True) is not None and epochs.at_warm_start() is None  # handed over
    gaussian = EmbeddingClassifier(**{**kw, "kernel": "gaussian"}, n_random_features=50, max_epochs=1).fit(X, Y)
    assert gaussian.at_warm_start() is None


def test_a_callback_stops_the_epochs_where_it_returns_false(multilabel, monkeypatch):
    """``fit(callback=...)`` is asked before each epoch with the history so far (the warm start first); where it
    returns false the epochs stop, and the model is the one with that many epochs (the same minibatches). SGD's
    preconditioner is made only for epochs: not where the callback stops them before the first."""
    from xmldask.models import _kernels

    inverses = []
    inverse = _kernels.inverse_from_cholesky
    monkeypatch.setattr(_kernels, "inverse_from_cholesky", lambda *a, **kw: inverses.append(1) or inverse(*a, **kw))
    X, Y = multilabel
    kw = dict(embedding="rembrandt", n_components=8, kernel="none", learning_rate=8.0, n_iter_no_change=5,
              random_state=2)
    seen = []

    def two_epochs(history):
        seen.append([h["epoch"] for h in history])
        return len(history) < 3

    cut = EmbeddingClassifier(**kw, max_epochs=5).fit(X, Y, callback=two_epochs)
    two = EmbeddingClassifier(**kw, max_epochs=2).fit(X, Y)
    assert seen == [[0], [0, 1], [0, 1, 2]]
    assert cut.history_[-1]["stopped"] == "callback" and len(cut.history_) == 3
    assert [h["val_loss"] for h in cut.history_] == [h["val_loss"] for h in two.history_]
    np.testing.assert_array_equal(cut.Q_, two.Q_)
    assert len(inverses) == 2  # the two fits with epochs
    none = EmbeddingClassifier(**kw, max_epochs=5).fit(X, Y, callback=lambda history: False)
    ridge = EmbeddingClassifier(**kw, max_epochs=0).fit(X, Y)
    assert len(none.history_) == 1 and none.history_[0]["stopped"] == "callback" and np.array_equal(none.Q_, ridge.Q_)
    assert len(inverses) == 2


@pytest.mark.parametrize("kernel", ["none", "gaussian"])
def test_epochs_keep_the_training_features_between_epochs(multilabel, monkeypatch, kernel):
    """Epochs in the fitting process keep each block's training features from the first epoch (up to
    EPOCH_FEATURES_BYTES): the same minibatches and the same model as computing them every epoch, fewer
    feature computations (uneven row blocks, several minibatches a block)."""
    from xmldask.models import embedding_classifier

    X, Y = multilabel
    calls = []
    features = embedding_classifier.K.decoder_features
    monkeypatch.setattr(embedding_classifier.K, "decoder_features",
                        lambda *a, **kw: calls.append(a[0].shape[0]) or features(*a, **kw))
    # in float64: the BLAS's products of a block's rows and of a minibatch's differ in their last digits (OpenBLAS
    # 0.3.31 on AMD EPYC: the rounding depends on the number of rows), which four epochs of float32 SGD grow to 1e-3
    kw = dict(embedding="rembrandt", n_components=8, kernel=kernel, n_random_features=40, max_epochs=4,
              batch_size=256, n_iter_no_change=10, random_state=4, dtype="float64")
    fits = {}
    for limit in (embedding_classifier.EPOCH_FEATURES_BYTES, 0):
        monkeypatch.setattr(embedding_classifier, "EPOCH_FEATURES_BYTES", limit)
        calls.clear()
        fits[limit > 0] = (EmbeddingClassifier(**kw).fit(X, Y), len(calls))
    (kept, n_kept), (again, n_again) = fits[True], fits[False]
    assert len(kept.history_) == len(again.history_) == 5
    for a, b in zip(kept.history_, again.history_):
        if a.get("train_loss") is not None or b.get("train_loss") is not None:  # None at the warm start
            assert a["train_loss"] == pytest.approx(b["train_loss"], rel=1e-5)
        assert a["val_p@1"] == b["val_p@1"]
    np.testing.assert_allclose(kept.Q_, again.Q_, rtol=1e-4, atol=1e-6)
    n_blocks = len(X.chunks[0])
    assert n_again - n_kept >= 3 * n_blocks  # epochs 2-4 compute nothing (at least a minibatch a block each)


@pytest.mark.parametrize("k", [8, 30])  # Rembrandt's embedding, and the identity (k = L)
def test_fits_of_one_setting_share_the_embedding_and_the_least_squares(multilabel, monkeypatch, k):
    """Fits of the same rows, embedding, alpha and held-out rows made at once in threads (the search's full fits of
    one setting under two kernels) fit the embedding and solve the least squares onto it once; each model is the one
    a fit alone makes. Nothing is kept once no model holds them."""
    import gc

    from threadpoolctl import threadpool_limits

    from xmldask.embedding import Rembrandt
    from xmldask.models import embedding_classifier
    from xmldask.scheduling import blas_share, thread_map

    X, Y = multilabel
    solves, embeddings = [], []
    ridge, fit = embedding_classifier.ridge_lstsq, Rembrandt.fit
    monkeypatch.setattr(embedding_classifier, "ridge_lstsq", lambda *a, **kw: solves.append(1) or ridge(*a, **kw))
    monkeypatch.setattr(Rembrandt, "fit", lambda self, *a, **kw: embeddings.append(1) or fit(self, *a, **kw))
    kw = dict(embedding="rembrandt", n_components=k, max_epochs=1, n_random_features=40, random_state=5)
    together = thread_map(lambda kernel: EmbeddingClassifier(**kw, kernel=kernel).fit(X, Y), ["none", "gaussian"],
                          n_jobs=2)
    assert len(solves) == 1 and len(embeddings) == (k < Y.shape[1])
    assert together[0].W_ is together[1].W_ and not together[0].W_.flags.writeable
    states = [(m.W_.copy(), m.R_.copy(), m.Q_.copy(), m.n_passes_) for m in together]
    del together
    gc.collect()
    for kernel, (W, R, Q, n_passes) in zip(["none", "gaussian"], states):
        # with the BLAS threads of a fit in thread_map's pool (its products' last digits depend on them)
        with threadpool_limits(limits=blas_share(2), user_api="blas"):
            alone = EmbeddingClassifier(**kw, kernel=kernel).fit(X, Y)
        np.testing.assert_array_equal(alone.W_, W)
        np.testing.assert_array_equal(alone.R_, R)
        np.testing.assert_array_equal(alone.Q_, Q)
        assert alone.n_passes_ == n_passes
        del alone
        gc.collect()
    assert len(solves) == 3 and len(embeddings) == 3 * (k < Y.shape[1])  # each fit alone solved its own


def test_decoder_normal_equations_scatter_a_large_feature_map(multilabel, client):
    """The warm start's pass ships ``W`` (d x k: 123 MB on lshtc1, which printed distributed's "large graph"
    warning) scattered once, not inside the graph, with the same sums as in threads; a small one stays inline."""
    import warnings

    from xmldask.models import _graph

    X, Y = multilabel
    rng = np.random.default_rng(0)
    split = _graph.HeldOut(5, 0.2, tuple(int(c) for c in X.chunks[0]))
    for k, scattered in ((2000, True), (4, False)):  # W of 2.4 MB and of 4.8 kB (SCATTER_BYTES: 1 MiB)
        state = {"W": rng.standard_normal((X.shape[1], k)).astype(np.float32) / 10,
                 "intercept": np.zeros(k, np.float32), "omega": None, "phase": None, "bandwidth": None}
        want = dask.compute(_graph.normal_equations(X, Y, split, state), scheduler="threads")[0]
        with client.as_current(), warnings.catch_warnings():
            warnings.simplefilter("error", UserWarning)  # "Sending large graph of size ..."
            graph = _graph.normal_equations(X, Y, split, state)
            size = len(pickle.dumps(dict(graph.__dask_graph__()), protocol=5))
            assert (size < state["W"].nbytes / 4) == scattered
            got = dask.compute(graph)[0]
        # float32 products summed in other orders (other BLAS threads): errors on the scale of the largest sums
        for name in ("G", "FtY"):
            np.testing.assert_allclose(got[name], want[name], rtol=1e-6, atol=1e-6 * np.abs(want[name]).max())
