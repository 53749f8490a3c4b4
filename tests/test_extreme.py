"""Large label spaces: the label-first XMC generator, the label-centroid tree against a plain SciPy reference, the
rule of ``model="auto"`` and the memory check before any pass."""

from __future__ import annotations

import dask.array as da
import numpy as np
import pytest
import scipy.sparse as sp

from xmldask import jobs
from xmldask.cli import main
from xmldask.models import LabelCentroidClassifier, load_model
from xmldask.models.centroid import balanced_clusters, labels_scored_per_row
from xmldask.store import exists, open_dataset, open_predictions
from xmldask.xmc import PRESETS, iter_xmc, make_xmc, preset, write_xmc_text

SMALL = dict(n_features=4000, n_labels=600, avg_labels=3.0, avg_features=40.0)


def _all(pieces):
    X, Y = zip(*pieces)
    return sp.vstack(X).tocsr(), sp.vstack(Y).tocsr()


# ------------------------------------------------------------------------------------------ the generator


def test_generator_is_seeded_split_and_block_free():
    X1, Y1 = _all(iter_xmc(n_samples=9000, seed=4, **SMALL))  # two generation chunks
    X2, Y2 = _all(iter_xmc(n_samples=9000, seed=4, **SMALL))
    assert (X1 != X2).nnz == 0 and (Y1 != Y2).nnz == 0
    Xt, _ = _all(iter_xmc(n_samples=9000, seed=4, split="test", **SMALL))
    X5, _ = _all(iter_xmc(n_samples=9000, seed=5, **SMALL))
    assert (X1 != Xt).nnz > 0 and (X1 != X5).nnz > 0
    assert X1.dtype == np.float32 and Y1.dtype == np.float32
    assert np.diff(X1.indptr).min() >= 1 and np.diff(Y1.indptr).min() >= 1  # every row has features and labels
    np.testing.assert_allclose(np.sqrt(X1.multiply(X1).sum(axis=1)).A1, 1.0, rtol=1e-5)  # unit L2 rows
    assert set(np.unique(Y1.data)) == {1.0}


def test_generator_reaches_the_wanted_means_and_a_long_tail():
    X, Y = _all(iter_xmc(n_samples=20000, seed=0, **{**SMALL, "n_labels": 5000}))
    assert abs(Y.nnz / Y.shape[0] - 3.0) < 0.45
    assert abs(X.nnz / X.shape[0] - 40.0) < 6.0
    counts = np.asarray(Y.sum(axis=0)).ravel()
    seen = counts[counts > 0]
    assert np.mean(seen <= 5) > 0.5 and counts.max() > 50 * np.median(seen)  # a Zipf head and a long tail


def test_generator_features_carry_the_labels():
    """Rows of a label share its words: the nearest tf-idf label centroid of a test row is one of its labels far
    more often than the most frequent label is (measured: 0.69 against 0.35)."""
    X, Y = _all(iter_xmc(n_samples=8000, seed=1, **SMALL))
    Xt, Yt = _all(iter_xmc(n_samples=1000, seed=1, split="test", **SMALL))
    top = LabelCentroidClassifier(beam=100).fit(X, Y).predict_topk(Xt, k=1)[0].compute()[:, 0]
    p1 = np.mean(np.asarray(Yt[np.arange(Yt.shape[0]), top]).ravel())
    frequent = np.asarray(Y.sum(axis=0)).ravel().argmax()
    assert p1 > 1.6 * np.mean(Yt[:, frequent].toarray())


def test_generator_refuses_bad_arguments():
    with pytest.raises(ValueError, match="background"):
        iter_xmc(n_samples=10, background=1.5, **SMALL)
    with pytest.raises(TypeError, match="unknown argument.*colour"):
        iter_xmc(n_samples=10, colour=1, **SMALL)
    with pytest.raises(ValueError, match="values must be"):
        iter_xmc(n_samples=10, values="tfidf", **SMALL)
    with pytest.raises(ValueError, match="unknown preset 'amazon'"):
        preset("amazon")


def test_presets_hold_the_published_sizes():
    assert preset("amazon-670k")["n_labels"] == 670_091 and preset("amazon-670k", "test")["n_samples"] == 153_025
    assert preset("xmc-1m", n_samples=10)["n_samples"] == 10
    assert all(p["n_labels"] >= 3_993 for p in PRESETS.values())


def test_text_and_store_hold_the_same_rows(tmp_path):
    from xmldask.io import ingest
    from xmldask.store.csr import to_scipy

    args = dict(n_samples=900, seed=2, **SMALL)
    ds = make_xmc(str(tmp_path / "direct.zarr"), block_rows=400, **args)
    write_xmc_text(str(tmp_path / "rows.txt.gz"), **args)
    read = ingest(str(tmp_path / "rows.txt.gz"), str(tmp_path / "read.zarr"), n_features=4000, n_labels=600)
    assert ds.meta["synthetic"]["generator"] == "xmc"
    Xa, Xb = (to_scipy(open_dataset(d.url).X) for d in (ds, read))
    np.testing.assert_allclose(Xa.toarray(), Xb.toarray(), rtol=1e-5, atol=1e-6)
    assert (to_scipy(open_dataset(ds.url).Y) != to_scipy(open_dataset(read.url).Y)).nnz == 0


def test_synth_preset_on_the_command_line(tmp_path, capsys):
    out = str(tmp_path / "p.zarr")
    assert main(["synth", "--preset", "eurlex-4k", "--n-samples", "300", "--out", out, "--no-progress"]) == 0
    ds = open_dataset(out)
    assert (ds.n_samples, ds.n_features, ds.n_labels) == (300, 5000, 3993)
    assert main(["synth", "--preset", "eurlex-4k", "--rank", "3", "--out", str(tmp_path / "q.zarr")]) == 2
    assert "--rank does not apply with --preset" in capsys.readouterr().err
    assert main(["synth", "--out", str(tmp_path / "r.zarr")]) == 2
    assert "--n-samples, --n-features, --n-labels required (or --preset NAME)" in capsys.readouterr().err


# ------------------------------------------------------------------------------ the label-centroid tree


def _reference_centroids(X, Y, features):
    """Unit ``Y^T X`` of unit (tf-idf) rows, plain SciPy."""
    X = sp.csr_matrix(X, dtype=np.float64)
    if features == "tfidf":
        df = np.asarray((X != 0).sum(axis=0)).ravel()
        X = X @ sp.diags(np.log((1 + X.shape[0]) / (1 + df)) + 1)
    norms = np.sqrt(np.asarray(X.multiply(X).sum(axis=1)).ravel())
    X = sp.diags(1 / np.where(norms > 0, norms, 1)) @ X
    C = (sp.csr_matrix(Y, dtype=np.float64).T @ X).toarray()
    norms = np.linalg.norm(C, axis=1)
    return C / np.where(norms > 0, norms, 1)[:, None], X


@pytest.fixture(scope="module")
def small():
    X, Y = _all(iter_xmc(n_samples=3000, seed=7, **{**SMALL, "n_labels": 800}))
    Xt, Yt = _all(iter_xmc(n_samples=500, seed=7, split="test", **{**SMALL, "n_labels": 800}))
    return X, Y, Xt, Yt


@pytest.mark.parametrize("features", ["tfidf", "l2"])
def test_centroids_and_exact_scores_match_a_scipy_reference(small, features):
    """Uneven row blocks, float32 input: the centroids equal the reference; with a beam over every cluster the top
    labels are the reference's cosine ranking over all seen labels."""
    X, Y, Xt, _ = small
    Xd = da.from_array(X, chunks=((700, 1100, 1200), (X.shape[1],)), asarray=False, fancy=False)
    Yd = da.from_array(Y, chunks=((700, 1100, 1200), (Y.shape[1],)), asarray=False, fancy=False)
    model = LabelCentroidClassifier(features=features, leaf_labels=50, beam=1000, svm_weight=0,
                                    random_state=0).fit(Xd, Yd)
    C, _ = _reference_centroids(X, Y, features)
    seen = np.flatnonzero(np.asarray(Y.sum(axis=0)).ravel() > 0)
    assert sorted(model.order_) == list(seen) and model.n_unseen_labels_ == 800 - len(seen)
    np.testing.assert_allclose(model.W_.toarray(), C[model.order_], atol=2e-6)
    # scores: cosine of the transformed test rows (idf of the training rows) with every seen centroid
    Xt64 = sp.csr_matrix(Xt, dtype=np.float64)
    if features == "tfidf":
        Xt64 = Xt64 @ sp.diags(model.idf_.astype(np.float64))
    norms = np.sqrt(np.asarray(Xt64.multiply(Xt64).sum(axis=1)).ravel())
    S = (sp.diags(1 / norms) @ Xt64 @ C.T)
    S[:, np.setdiff1d(np.arange(800), seen)] = -np.inf
    labels, scores = (a.compute() for a in model.predict_topk(Xt, k=5))
    np.testing.assert_allclose(scores, -np.sort(-S, axis=1)[:, :5], atol=2e-5)
    assert np.mean(labels[:, 0] == S.argmax(axis=1)) > 0.99  # up to float32 ties


def test_beam_restricts_candidates_to_the_best_clusters(small):
    X, Y, Xt, Yt = small
    model = LabelCentroidClassifier(leaf_labels=40, beam=2, random_state=1).fit(X, Y)
    labels, scores = (a.compute() for a in model.predict_topk(Xt, k=5))
    assert labels.dtype == np.int32 and scores.dtype == np.float32
    assert (np.diff(scores, axis=1) <= 0).all()  # best first
    cluster_of = np.empty(800, np.int64)
    cluster_of[model.order_] = np.repeat(np.arange(model.n_clusters_), np.diff(model.offsets_))
    used = cluster_of[labels]
    assert (np.array([len(set(row)) for row in used]) <= 2).all()
    p1 = np.mean(np.asarray(Yt[np.arange(Yt.shape[0]), labels[:, 0]]).ravel())
    assert p1 > 0.3


@pytest.mark.parametrize("slice_entries", [None, 97])
def test_centroids_without_the_held_out_rows_are_recovered_from_the_unit_ones(small, slice_entries, monkeypatch):
    """The held-out choice of the beam scores centroids without the held-out rows, recovered from the unit centroids
    and their norms (no second copy of the sums): the reference's ``unit(Y^T X - Y_h^T X_h)``, whole or written a
    slice of a few entries at a time."""
    from xmldask.models import centroid
    from xmldask.models.centroid import _unit_rows

    if slice_entries:
        monkeypatch.setattr(centroid, "WITHOUT_ENTRIES", slice_entries)

    X, Y, _, _ = small
    model = LabelCentroidClassifier(features="l2", leaf_labels=40, beam=3, random_state=0).fit(X, Y)
    Xu, Y64 = _unit_rows(X).astype(np.float64), sp.csr_matrix(Y, dtype=np.float64)
    P = (Y64.T @ Xu).tocsr()
    D = (Y64[:150].T @ Xu[:150]).tocsr()
    norms = np.sqrt(np.asarray(P.multiply(P).sum(axis=1)).ravel())
    expected = (P - D).toarray()
    lengths = np.linalg.norm(expected, axis=1, keepdims=True)
    expected = (expected / np.where(lengths > 0, lengths, 1))[model.order_]
    rest = np.asarray(Y64.sum(axis=0) - Y64[:150].sum(axis=0)).ravel()
    assert (rest[np.flatnonzero(np.diff(D.indptr))] == 0).any()  # some labels have all their rows held out
    W = model._without(norms, D, rest)
    np.testing.assert_allclose(W.toarray(), expected, atol=1e-5)
    assert W.dtype == np.float32 and W.indices.dtype == model.W_.indices.dtype and not (W.data == 0).any()
    unchanged = np.flatnonzero(np.diff(D[model.order_].indptr) == 0)
    assert len(unchanged) and len(unchanged) < len(model.order_)
    np.testing.assert_array_equal(W[unchanged].toarray(), model.W_[unchanged].toarray())  # exactly as they were


def test_label_block_bounds_cut_the_labels_into_blocks_of_equal_entries():
    from xmldask.models.centroid import LABEL_BLOCK_SHARE, label_block_bounds

    entries = np.minimum(np.random.default_rng(0).zipf(1.5, 10_000), 5_000).astype(np.float64)  # a long tail
    assert label_block_bounds(entries, None) is None
    assert label_block_bounds(entries, int(1e12)) is None  # one block fits
    limit = int(3 * entries.sum() * 8 / LABEL_BLOCK_SHARE / 7.5)  # eight blocks
    bounds = label_block_bounds(entries, limit)
    assert bounds[0] == 0 and bounds[-1] == len(entries) and (np.diff(bounds) > 0).all() and len(bounds) <= 9
    sums = np.add.reduceat(entries, bounds[:-1])
    assert (sums <= entries.sum() / 8 + entries.max()).all() and sums.min() > entries.sum() / 8 - entries.max()
    # a multiple of the tasks that share the blocks out: 3 on 2 threads become 4 (one thread idle no more)
    limit = int(3 * entries.sum() * 8 / LABEL_BLOCK_SHARE / 2.5)
    assert len(label_block_bounds(entries, limit)) - 1 == 3
    assert len(label_block_bounds(entries, limit, multiple_of=2)) - 1 == 4
    assert label_block_bounds(entries, int(1e12), multiple_of=2) is None  # one block still fits whole


def test_label_passes_group_consecutive_blocks_within_the_workers_memory():
    from xmldask.models.centroid import PASS_SHARE, label_passes

    entries = np.full(1000, 10.0)
    bounds = np.arange(0, 1001, 100)  # ten blocks of 8,000 bytes
    assert label_passes(None, entries, 10**9) == [None]
    assert [list(g) for g in label_passes(bounds, entries, None)] == [list(bounds)]
    groups = label_passes(bounds, entries, int(3 * 8_000 / PASS_SHARE))  # three blocks a pass
    assert [list(g) for g in groups] == [[0, 100, 200, 300], [300, 400, 500, 600], [600, 700, 800, 900],
                                         [900, 1000]]
    assert len(label_passes(bounds, entries, 1)) == 10  # a block a pass, even past the budget


@pytest.mark.parametrize("routing", ["summaries", "routers"])
def test_label_blocks_give_the_same_model_and_predictions(small, tmp_path, monkeypatch, caplog, routing,
                                                           unpaused_workers):
    """Workers whose memory limit a label-sized sum exceeds sum ``Y^T X`` in label blocks, and predict a loaded
    model read from its store in cluster blocks (of whole groups, with the routers): the same centroids, clusters
    and top labels (uneven row blocks)."""
    import logging

    import distributed

    from xmldask.models import centroid as C

    X, Y, Xt, _ = small
    chunks = (700, 1100, 1200)
    Xd = da.from_array(X, chunks=(chunks, (X.shape[1],)), asarray=False, fancy=False)
    Yd = da.from_array(Y, chunks=(chunks, (Y.shape[1],)), asarray=False, fancy=False)
    Xtd = da.from_array(Xt, chunks=((180, 320), (Xt.shape[1],)), asarray=False, fancy=False)
    kw = {"leaf_labels": 40, "beam": 3, "routing": routing, "centroid_threshold": 0, "random_state": 0}
    reference = LabelCentroidClassifier(**kw).fit(Xd, Yd)
    expected = [a.compute() for a in reference.predict_topk(Xtd, k=5)]
    monkeypatch.setattr(C, "LABEL_BLOCK_SHARE", 1e-3)
    monkeypatch.setattr(C, "PREDICT_BLOCK_SHARE", 1e-3)
    with distributed.LocalCluster(n_workers=1, threads_per_worker=2, processes=False, memory_limit="2GiB",
                                  dashboard_address=":0") as cluster, distributed.Client(cluster):
        model = LabelCentroidClassifier(**kw).fit(Xd, Yd)
        assert model.n_label_blocks_ > 2 and model.train_summary()["label_blocks"] == model.n_label_blocks_
        for name in ("order_", "offsets_", "label_counts_"):
            np.testing.assert_array_equal(getattr(model, name), getattr(reference, name))
        np.testing.assert_allclose(model.W_.toarray(), reference.W_.toarray(), atol=1e-6)
        monkeypatch.setattr(C, "PASS_SHARE", 1e-6)  # a pass a label block: the same centroids
        passes = LabelCentroidClassifier(**{**kw, "svm_weight": 0}).fit(Xd, Yd)
        routers = 0 if routing == "summaries" else 2  # at least a pass for each level of routers
        assert passes.n_passes_ - routers >= model.n_label_blocks_ + 1  # and the idf's pass
        assert routing == "routers" or passes.n_passes_ == model.n_label_blocks_ + 1
        np.testing.assert_allclose(passes.W_.toarray(), reference.W_.toarray(), atol=1e-6)
        np.testing.assert_array_equal(passes.order_, reference.order_)
        url = model.save(str(tmp_path / "blocked.zarr"))
        monkeypatch.setattr(C, "LAZY_BYTES", 0)  # its centroids left in the store, as a million labels' are
        loaded = LabelCentroidClassifier.load(url)
        with caplog.at_level(logging.INFO, logger="xmldask.models.centroid"):
            labels, scores = (a.compute() for a in loaded.predict_topk(Xtd, k=5))
        assert "cluster blocks read from" in caplog.text and "kept by the workers" in caplog.text
        assert "W_" not in loaded.__dict__  # only the workers read the centroids, by cluster block
        assert loaded.routing_ == routing
        reads = []
        read_rows = C._read_rows
        monkeypatch.setattr(C, "_read_rows", lambda *args: reads.append(args[1]) or read_rows(*args))
        again = [a.compute() for a in loaded.predict_topk(Xtd, k=5)]
        assert reads == []  # the workers kept every block, and the group routers
        monkeypatch.setattr(C, "SHARED_READ_SHARE", 0.0)  # each row block's tasks read the blocks
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="xmldask.models.centroid"):
            each = [a.compute() for a in loaded.predict_topk(Xtd, k=5)]
        assert "by each row block" in caplog.text and "W" in reads
        passes.save(url, overwrite=True)  # another model written there: its blocks are read anew
        monkeypatch.setattr(C, "SHARED_READ_SHARE", 1 / 4)
        reads.clear()
        [a.compute() for a in LabelCentroidClassifier.load(url).predict_topk(Xtd, k=5)]
        assert "W" in reads
    np.testing.assert_allclose(scores, expected[1], atol=1e-5)
    assert (labels == expected[0]).mean() > 0.99  # up to float32 ties
    assert labels.dtype == np.int32 and scores.dtype == np.float32
    for other in (again, each):
        np.testing.assert_array_equal(other[0], labels)
        np.testing.assert_array_equal(other[1], scores)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("budget", [None, 3, 0])  # default; a budget of 3 dense columns; no dense column
def test_dense_summary_columns_give_the_sparse_product(dtype, budget, monkeypatch):
    """The summaries split into dense shared columns and a sparse rest score every row as ``X @ M.T`` does, and
    the best clusters are the same, on rows of uneven lengths."""
    from xmldask.models import centroid as C

    if budget is not None:
        monkeypatch.setattr(C, "DENSE_BUDGET", budget * 16)
    rng = np.random.default_rng(3)
    M = sp.hstack([rng.random((16, 12)).astype(np.float32),  # 12 features in every summary
                   sp.random(16, 288, density=0.05, random_state=4, dtype=np.float32)], format="csr")
    M = C._unit_rows(M)
    X = sp.hstack([np.ones((37, 1), dtype), sp.random(37, 299, density=0.08, random_state=5, dtype=dtype)],
                  format="csr")  # every row has a shared feature
    MT, MH, head = C._split_summaries(M)
    shared = np.flatnonzero(np.bincount(M.indices, minlength=300) >= 4)  # in a quarter of the 16 clusters
    assert set(range(12)) <= set(shared) and set(head) <= set(shared)
    assert len(head) == (len(shared) if budget is None else budget) and MH.shape == (len(head), 16)
    assert MT[head].nnz == 0 and MT.nnz + np.count_nonzero(MH) == M.nnz
    reference = (sp.csr_matrix(X, dtype=np.float64) @ sp.csr_matrix(M, dtype=np.float64).T).toarray()
    np.testing.assert_allclose((X @ MT).toarray() + X[:, head] @ MH, reference, rtol=1e-5, atol=1e-6)
    for b in (1, 4):
        best = np.sort(C._best_clusters(X, MT, b, (MH, head))[0], axis=1)
        expected = np.sort(np.argpartition(-reference, b - 1, axis=1)[:, :b], axis=1)
        assert (best == expected).mean() > 0.99  # up to float32 ties


def test_prune_rows_drops_the_small_entries_of_every_row():
    """Pieces of a few entries (rows across their bounds, empty rows, float32): SciPy's matrix with its entries below
    the threshold in absolute value removed, rows not rescaled."""
    from xmldask.models._candidates import prune_rows

    W = sp.random(29, 40, density=0.3, format="csr", random_state=11, dtype=np.float32)
    W.data -= 0.5
    W = sp.csr_matrix(sp.diags((np.arange(29) % 7 != 3).astype(np.float32)) @ W)  # empty rows
    W.eliminate_zeros()
    expected = W.toarray()
    expected[np.abs(expected) < 0.2] = 0
    for piece in (1, 5, 1 << 24):
        got = prune_rows(W, 0.2, piece_entries=piece)
        assert got.dtype == np.float32 and got.nnz == np.count_nonzero(expected)
        np.testing.assert_array_equal(got.toarray(), expected)
    assert prune_rows(W, 0.0) is not None and prune_rows(W, 0.0).nnz == W.nnz


def test_candidates_leave_out_the_centroid_entries_below_the_threshold(small):
    """``candidate_topk(threshold=t)`` scores as the pruned centroids do (the classifiers' weights untouched)."""
    from xmldask.models._candidates import candidate_topk, prune_rows
    from xmldask.models.centroid import _rows_block

    X, Y, _, _ = small
    model = LabelCentroidClassifier(leaf_labels=40, beam=4, svm_weight=0.25, centroid_threshold=0,
                                    random_state=0).fit(X, Y)
    Xt = _rows_block(X[:300], model.idf_)
    rows = np.repeat(np.arange(300), 3)
    clusters = np.random.default_rng(0).integers(0, model.n_clusters_, 900)
    clusters[1::3] = (clusters[::3] + 1) % model.n_clusters_  # a row names a cluster once
    clusters[2::3] = (clusters[::3] + 2) % model.n_clusters_
    args = (Xt, rows, clusters)
    rest = (model.order_, model.offsets_, 5)
    for t in (0.01, 0.05):
        pruned = prune_rows(model.W_, t)
        assert 0 < pruned.nnz < model.W_.nnz
        for weight in (0.0, 0.25):
            got = candidate_topk(*args, model.W_, *rest, V=model.V_, bias=model.svm_bias_, weight=weight, threshold=t)
            expected = candidate_topk(*args, pruned, *rest, V=model.V_, bias=model.svm_bias_, weight=weight)
            np.testing.assert_array_equal(got[0], expected[0])
            np.testing.assert_allclose(got[1], expected[1], rtol=1e-6)


def test_centroid_threshold_auto_is_chosen_on_held_out_rows(small, tmp_path, monkeypatch):
    """``centroid_threshold="auto"``: the thresholds tried in order on the held-out rows, the last kept within
    PRUNE_TOLERANCE of the whole centroids' P@1; the fitted centroids have no entry below it, the summaries are those
    of the whole centroids, and the model saves and loads; a threshold that drops most entries is not taken; 0 and a
    given threshold are not searched; a threshold outside [0, 1) is refused."""
    from xmldask.models import centroid as C

    X, Y, Xt, _ = small
    whole = LabelCentroidClassifier(leaf_labels=40, centroid_threshold=0, random_state=2).fit(X, Y)
    assert whole.centroid_threshold_ == 0 and "p@1 by centroid threshold" not in whole.held_out_
    monkeypatch.setattr(C, "CENTROID_THRESHOLDS", (0.01, 0.03, 0.6))
    model = LabelCentroidClassifier(leaf_labels=40, random_state=2).fit(X, Y)
    scores, t = model.held_out_["p@1 by centroid threshold"], model.centroid_threshold_
    assert list(scores)[0] == 0.0 and t in scores and t < 0.6  # at 0.6 a label keeps at most two entries
    assert all(scores[0.0] - scores[u] <= C.PRUNE_TOLERANCE for u in scores if u <= t)
    assert model.train_summary()["centroid_threshold"] == t
    assert np.abs(model.W_.data).min() >= t and model.W_.nnz <= whole.W_.nnz
    np.testing.assert_allclose(model.M_.toarray(), whole.M_.toarray(), atol=1e-6)  # summaries of every entry
    again = load_model(model.save(str(tmp_path / "pruned.zarr")))
    assert again.centroid_threshold_ == t and again.W_.nnz == model.W_.nnz
    np.testing.assert_array_equal(again.predict_topk(Xt, k=3)[0].compute(), model.predict_topk(Xt, k=3)[0].compute())
    monkeypatch.setattr(C, "PRUNE_TOLERANCE", 1.0)
    monkeypatch.setattr(C, "BEAM_GAIN_SIGMAS", 1e9)  # nothing resolved, nothing too costly: the last is taken
    assert LabelCentroidClassifier(leaf_labels=40, random_state=2).fit(X, Y).centroid_threshold_ == 0.6
    given = LabelCentroidClassifier(leaf_labels=40, beam=3, summary_exponent=0, svm_weight=0,
                                    centroid_threshold=0.05, random_state=2).fit(X, Y)
    assert not given.held_out_ and given.centroid_threshold_ == 0.05 and np.abs(given.W_.data).min() >= 0.05
    for bad in (-0.1, 1.0, "big", True):
        with pytest.raises(ValueError, match="centroid_threshold"):
            LabelCentroidClassifier(centroid_threshold=bad).fit(X, Y)


def test_beam_auto_is_chosen_on_held_out_rows(small, tmp_path, monkeypatch):
    """``beam="auto"``: each of AUTO_BEAMS (at most the clusters) scored on held-out training rows left out of the
    centroids; a wider beam kept only for a gain beyond the rows' noise and of at least BEAM_MIN_GAIN (without those
    margins: the best, ties to the smaller), recorded, saved and used."""
    from xmldask.models import centroid as C
    from xmldask.models.centroid import AUTO_BEAMS, BEAM_MIN_GAIN, HELD_OUT_ROWS

    X, Y, Xt, _ = small
    model = LabelCentroidClassifier(leaf_labels=40, random_state=2).fit(X, Y)
    scores, rows = model.held_out_["p@1 by beam"], model.held_out_["rows"]
    assert sorted(scores) == sorted({min(b, model.n_clusters_) for b in AUTO_BEAMS})
    assert all((scores[b] - scores[model.beam_]) * rows <= 2 * np.sqrt(rows) or scores[b] - scores[model.beam_] <
               BEAM_MIN_GAIN for b in scores if b > model.beam_)
    monkeypatch.setattr(C, "BEAM_GAIN_SIGMAS", 0.0)
    monkeypatch.setattr(C, "BEAM_MIN_GAIN", 0.0)
    strict = LabelCentroidClassifier(leaf_labels=40, random_state=2).fit(X, Y)
    assert strict.beam_ == max(scores, key=lambda b: (scores[b], -b)) >= model.beam_
    monkeypatch.undo()
    assert 0 < model.held_out_["rows"] <= 1.2 * min(HELD_OUT_ROWS, X.shape[0]) and model.held_out_["p@1"] > 0.2
    # the held-out rows were left out: a row's own label centroid would otherwise make P@1 near 1
    inside = LabelCentroidClassifier(leaf_labels=40, beam=model.beam_, random_state=2).fit(X, Y)
    top = inside.predict_topk(X[:500], k=1)[0].compute()[:, 0]
    assert np.mean(np.asarray(Y[np.arange(500), top]).ravel()) > model.held_out_["p@1"] + 0.05
    model.save(str(tmp_path / "auto.zarr"))
    again = load_model(str(tmp_path / "auto.zarr"))
    assert again.beam_ == model.beam_ and again.beam == "auto"
    np.testing.assert_array_equal(again.predict_topk(Xt, k=3)[0].compute(), model.predict_topk(Xt, k=3)[0].compute())


def test_summaries_weigh_labels_by_their_rows_to_a_chosen_exponent(small, tmp_path, monkeypatch):
    """A cluster's summary is the normalised sum of its labels' centroids weighted by ``n_l ** g`` (a NumPy
    reference); ``summary_exponent="auto"`` compares SUMMARY_EXPONENTS on the held-out rows at the narrowest beam,
    takes a later one only for a gain beyond their noise (without that margin: the best, ties to the first),
    records and saves it; a given exponent is used as given."""
    from xmldask.models import centroid as C

    X, Y, Xt, _ = small
    model = LabelCentroidClassifier(leaf_labels=40, random_state=2).fit(X, Y)
    g = model.summary_exponent_
    assert g in C.SUMMARY_EXPONENTS and model.held_out_["summary exponent"] == g
    weights = model.label_counts_[model.order_].astype(np.float64) ** g
    W = model.W_.toarray().astype(np.float64)
    for c in range(model.n_clusters_):
        a, b = model.offsets_[c], model.offsets_[c + 1]
        summary = weights[a:b] @ W[a:b]
        np.testing.assert_allclose(model.M_[c].toarray().ravel(), summary / np.linalg.norm(summary), atol=2e-6)
    scores, rows = model.held_out_["p@1 by summary exponent"], model.held_out_["rows"]
    assert list(scores) == list(C.SUMMARY_EXPONENTS) and model.held_out_["beam compared"] == min(C.AUTO_BEAMS)
    assert all((scores[e] - scores[g]) * rows <= 2 * np.sqrt(rows) for e in scores if e > g)
    monkeypatch.setattr(C, "BEAM_GAIN_SIGMAS", 0.0)
    strict = LabelCentroidClassifier(leaf_labels=40, random_state=2).fit(X, Y)
    assert strict.summary_exponent_ == max(scores, key=lambda e: (scores[e], -e))
    monkeypatch.undo()
    model.save(str(tmp_path / "g.zarr"))
    again = load_model(str(tmp_path / "g.zarr"))
    assert again.summary_exponent_ == g and again.summary_exponent == "auto"
    given = LabelCentroidClassifier(leaf_labels=40, beam=5, summary_exponent=1, random_state=2).fit(X, Y)
    assert given.summary_exponent_ == 1 and "p@1 by summary exponent" not in given.held_out_ and given.beam_ == 5
    frequent = LabelCentroidClassifier(leaf_labels=40, beam=5, summary_exponent=0, random_state=2).fit(X, Y)
    assert (given.M_ != frequent.M_).nnz and (given.W_ != frequent.W_).nnz == 0  # the summaries only
    with pytest.raises(ValueError, match="summary_exponent must be 'auto' or a number >= 0"):
        LabelCentroidClassifier(summary_exponent=-1).fit(X, Y)


def test_label_classifiers_are_liblinears_squared_hinge_svms():
    """The dual coordinate descent gives the L2-regularised squared-hinge SVM with a bias column (liblinear's ``-s 1
    -B 1``; the reference: the primal minimised by SciPy's L-BFGS), float32 rows; a label without positives and
    one whose rows are all positive too."""
    from scipy.optimize import minimize

    from xmldask.models._svm import squared_hinge_svms

    rng = np.random.default_rng(0)
    X = sp.random(400, 60, density=0.1, format="csr", random_state=1, dtype=np.float32)
    X = sp.csr_matrix(sp.diags(1 / np.maximum(np.sqrt(X.multiply(X).sum(axis=1)).A1, 1e-9)) @ X, dtype=np.float32)
    Y = rng.random((400, 4)) < 0.15
    Y[:, 2], Y[:, 3] = False, True
    W = squared_hinge_svms(X, sp.csc_matrix(Y), C=2.0, tol=1e-6, max_passes=10000, seed=3)
    assert W.shape == (4, 61) and W.dtype == np.float32
    Xb = sp.hstack([X, np.ones((400, 1))], format="csr", dtype=np.float64)
    for j in range(4):
        y = np.where(Y[:, j], 1.0, -1.0)

        def objective(w, y=y):
            slack = np.maximum(0.0, 1.0 - y * (Xb @ w))
            return 0.5 * w @ w + 2.0 * slack @ slack, w - 4.0 * (Xb.T @ (y * slack))
        ref = minimize(objective, np.zeros(61), jac=True, method="L-BFGS-B", options={"gtol": 1e-10}).x
        for _ in range(5):  # then Newton on the rows in the loss: the objective is quadratic there, so exact
            rows = y * (Xb @ ref) < 1
            A = Xb[rows]
            ref = np.linalg.solve(np.eye(61) + 4.0 * (A.T @ A).toarray(), 4.0 * (A.T @ y[rows]))
        np.testing.assert_allclose(W[j], ref, atol=1e-4)


def test_cluster_classifiers_train_on_their_clusters_rows_and_prune():
    """``cluster_svms``: each cluster's labels on the rows with a label of the cluster (the others never seen), in
    the cluster's own features, weights below PRUNE dropped."""
    from xmldask.models._svm import PRUNE, cluster_svms, squared_hinge_svms

    rng = np.random.default_rng(1)
    X = sp.random(300, 50, density=0.2, format="csr", random_state=2, dtype=np.float32)
    Y = sp.csr_matrix(rng.random((300, 7)) < 0.1, dtype=np.float32)
    offsets = np.array([0, 3, 7])
    V, bias = cluster_svms(X, Y, offsets, seed=5)
    assert V.shape == (7, 50) and bias.shape == (7,) and V.dtype == np.float32
    part, part_bias = cluster_svms(X, Y, offsets, seed=5, columns=(2, 5))  # labels 2..4, each on its cluster's rows
    np.testing.assert_array_equal(part.toarray(), V[2:5].toarray())
    np.testing.assert_array_equal(part_bias, bias[2:5])
    for c in range(2):
        a, b = offsets[c], offsets[c + 1]
        rows = np.flatnonzero(np.asarray(Y[:, a:b].sum(axis=1)).ravel() > 0)
        ref = squared_hinge_svms(X[rows], sp.csc_matrix(Y[rows][:, a:b]), seed=5 + a)
        weights = ref[:, :-1].copy()
        weights[np.abs(weights) < PRUNE] = 0
        np.testing.assert_allclose(V[a:b].toarray(), weights, atol=1e-5)
        np.testing.assert_allclose(bias[a:b], ref[:, -1], atol=1e-5)


def test_cluster_classifiers_trained_in_chunks_of_labels_are_the_same(monkeypatch):
    """A cluster's labels are trained in chunks whose dense weights take at most DENSE_BYTES (a cluster of 100
    labels over 500,000 features is 200 MB): the same weights and biases as all at once."""
    from xmldask.models import _svm

    rng = np.random.default_rng(1)
    X = sp.random(300, 50, density=0.2, format="csr", random_state=2, dtype=np.float32)
    Y = sp.csr_matrix(rng.random((300, 9)) < 0.15, dtype=np.float32)
    offsets = np.array([0, 2, 9])
    whole, whole_bias = _svm.cluster_svms(X, Y, offsets, seed=5)
    calls = []
    train = _svm.squared_hinge_svms
    monkeypatch.setattr(_svm, "squared_hinge_svms", lambda X, P, **kw: calls.append(P.shape[1]) or train(X, P, **kw))
    monkeypatch.setattr(_svm, "DENSE_BYTES", 4 * 51 * 3)  # three labels of at most 50 features (and the bias)
    V, bias = _svm.cluster_svms(X, Y, offsets, seed=5)
    assert max(calls) <= 3 and sum(calls) == 9 and len(calls) >= 4
    np.testing.assert_array_equal(V.toarray(), whole.toarray())
    np.testing.assert_array_equal(bias, whole_bias)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("row_slots", [None, 8])
def test_candidate_kernel_matches_dense_scores_of_the_chosen_clusters(dtype, row_slots, monkeypatch):
    """``candidate_topk``: uneven clusters (one empty), rows that chose several clusters, one or none, fewer
    candidates than ``k``, exact ties broken to the smaller label id, with and without the weighted classifiers,
    a cluster's rows in one batch or in batches of one to four: the k best of a dense NumPy score matrix masked to
    each row's clusters."""
    from xmldask.models import _candidates
    from xmldask.models._candidates import candidate_topk

    if row_slots:
        monkeypatch.setattr(_candidates, "ROW_SLOTS", row_slots)

    rng = np.random.default_rng(3)
    n, d, k = 40, 300, 7
    offsets = np.array([0, 5, 5, 19, 20, 44, 60])
    L = offsets[-1]
    order = rng.permutation(200)[:L]  # labels in cluster order: any ids
    X = sp.random(n, d, density=0.05, format="csr", random_state=1, dtype=dtype)
    W = sp.random(L, d, density=0.1, format="csr", random_state=2, dtype=dtype)
    W[7] = W[8]  # two labels of one cluster with equal scores on every row
    V = sp.random(L, d, density=0.05, format="csr", random_state=4, dtype=dtype)
    bias = rng.normal(size=L)
    chosen = [rng.choice(6, size=rng.integers(0, 4), replace=False) for _ in range(n)]
    rows = np.concatenate([np.full(len(c), i) for i, c in enumerate(chosen)]).astype(np.int64)
    clusters = np.concatenate(chosen).astype(np.int64)
    for weight in (0.0, 0.5):
        labels, scores = candidate_topk(X, rows, clusters, W, order, offsets, k, V=V, bias=bias, weight=weight)
        S = (X @ W.T).toarray().astype(np.float64) + weight * ((X @ V.T).toarray() + bias)
        for i, c in enumerate(chosen):
            cand = np.concatenate([np.arange(offsets[j], offsets[j + 1]) for j in c] + [np.zeros(0, int)])
            ranked = sorted(cand, key=lambda j: (-S[i, j], order[j]))[:k]
            m = len(ranked)
            np.testing.assert_allclose(scores[i, :m], S[i, ranked], rtol=1e-5, atol=1e-6)
            assert list(labels[i, :m]) == [order[j] for j in ranked] or np.allclose(np.diff(S[i, ranked]), 0)
            assert (labels[i, m:] == -1).all() and np.isneginf(scores[i, m:]).all()
        tied = [i for i, c in enumerate(chosen) if 2 in c and S[i, 7] == S[i, 8] and S[i, 7] >= scores[i, k - 1]]
        for i in tied:  # the smaller id first
            where = {lab: t for t, lab in enumerate(labels[i])}
            first, second = sorted([order[7], order[8]])
            assert where[first] < where.get(second, k)


def test_cluster_entries_hold_each_clusters_rows_by_feature():
    """``ClusterEntries.of``: each cluster's distinct features ascending, and their runs of (label slot, value)
    in label order: the rows of ``W`` again (uneven clusters, one empty, unsorted column ids); int16 slots where
    the clusters allow, int32 past."""
    from xmldask.models._candidates import ClusterEntries

    offsets = np.array([0, 4, 4, 11, 12, 30])
    W = sp.random(30, 200, density=0.1, format="csr", random_state=11, dtype=np.float32)
    shuffled = W.copy()
    for j in range(W.shape[0]):  # the same rows, column ids in any order
        run = slice(W.indptr[j], W.indptr[j + 1])
        permutation = np.random.default_rng(j).permutation(run.stop - run.start)
        shuffled.indices[run], shuffled.data[run] = W.indices[run][permutation], W.data[run][permutation]
    shuffled.has_sorted_indices = False
    E = ClusterEntries.of(shuffled, offsets)
    assert E.slot.dtype == np.int16 and E.nbytes > 0
    rebuilt = np.zeros(W.shape, np.float32)
    for c in range(len(offsets) - 1):
        features = E.features[E.fstart[c]:E.fstart[c + 1]]
        assert np.all(np.diff(features) > 0)
        np.testing.assert_array_equal(features, np.unique(W[offsets[c]:offsets[c + 1]].indices))
        for h, f in enumerate(features):
            u = E.fstart[c] + c + h
            run = slice(E.estart[c] + E.runs[u], E.estart[c] + E.runs[u + 1])
            assert np.all(np.diff(E.slot[run]) > 0)
            rebuilt[offsets[c] + E.slot[run], f] = E.value[run]
    np.testing.assert_array_equal(rebuilt, W.toarray())
    wide = ClusterEntries.of(sp.random(40_000, 3, density=0.5, format="csr", random_state=1), np.array([0, 40_000]))
    assert wide.slot.dtype == np.int32 and wide.slot.max() > np.iinfo(np.int16).max


@pytest.mark.parametrize("row_slots", [None, 1, 40])
def test_candidates_are_found_by_bisection_and_by_scan_alike(row_slots, monkeypatch):
    """Clusters with many more features than a batch of rows (the batch's features looked up one by one) and
    batches with many (the cluster's features scanned), with the centroids' threshold and the weighted classifiers:
    the k best of a dense NumPy score matrix, the same whatever the batches."""
    from xmldask.models import _candidates
    from xmldask.models._candidates import ClusterEntries, candidate_topk

    if row_slots:
        monkeypatch.setattr(_candidates, "ROW_SLOTS", row_slots)
    rng = np.random.default_rng(12)
    n, d, k = 60, 4000, 5
    offsets = np.array([0, 1, 9, 10, 40])
    order = rng.permutation(40)
    X = sp.random(n, d, density=0.004, format="csr", random_state=13, dtype=np.float32)
    W = sp.random(40, d, density=0.2, format="csr", random_state=14, dtype=np.float32)
    V = sp.random(40, d, density=0.05, format="csr", random_state=15, dtype=np.float32)
    bias = rng.normal(size=40)
    chosen = [rng.choice(4, size=rng.integers(1, 4), replace=False) for _ in range(n)]
    rows = np.concatenate([np.full(len(c), i) for i, c in enumerate(chosen)]).astype(np.int64)
    clusters = np.concatenate(chosen).astype(np.int64)
    for weight, threshold in ((0.0, 0.0), (0.5, 0.3)):
        kept = W.multiply(abs(W) >= threshold).tocsr()
        S = (X @ kept.T).toarray().astype(np.float64) + weight * ((X @ V.T).toarray() + bias)
        got = candidate_topk(X, rows, clusters, ClusterEntries.of(W, offsets), order, offsets, k,
                             V=ClusterEntries.of(V, offsets), bias=bias, weight=weight, threshold=threshold)
        assert got[0].shape == (n, k)
        for i, c in enumerate(chosen):
            cand = np.concatenate([np.arange(offsets[j], offsets[j + 1]) for j in c])
            ranked = sorted(cand, key=lambda j: (-S[i, j], order[j]))[:k]
            np.testing.assert_allclose(got[1][i, :len(ranked)], S[i, ranked], rtol=1e-5, atol=1e-6)
            assert list(got[0][i, :len(ranked)]) == [order[j] for j in ranked] or \
                np.allclose(np.diff(S[i, ranked]), 0)


def test_candidate_scores_are_the_same_bits_whatever_the_batches(monkeypatch):
    """A batch of many rows (features that many rows share: the label entries outside) and batches of one row (a
    feature's label entries inside): each score gets its terms in the same order, so the very same bits."""
    from xmldask.models import _candidates
    from xmldask.models._candidates import ClusterEntries, candidate_topk

    rng = np.random.default_rng(21)
    n, d, k = 200, 50, 6
    offsets = np.array([0, 30, 31, 80])
    X = sp.random(n, d, density=0.3, format="csr", random_state=22, dtype=np.float32)  # 60 rows a feature
    W = sp.random(80, d, density=0.3, format="csr", random_state=23, dtype=np.float32)  # runs of 1 to 20
    rows = np.repeat(np.arange(n), 2)
    clusters = np.concatenate([rng.choice(3, size=2, replace=False) for _ in range(n)])
    entries, order = ClusterEntries.of(W, offsets), np.arange(80)
    together = candidate_topk(X, rows, clusters, entries, order, offsets, k)
    monkeypatch.setattr(_candidates, "ROW_SLOTS", 1)  # a batch a row
    alone = candidate_topk(X, rows, clusters, entries, order, offsets, k)
    np.testing.assert_array_equal(together[0], alone[0])
    np.testing.assert_array_equal(together[1], alone[1])


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_grouped_topk_is_the_best_router_margins_in_each_rows_groups(dtype):
    """``grouped_topk``: uneven groups (one empty), rows that chose several groups in any order, one or none (and a
    row without features: the biases alone), fewer clusters than ``b``, an exact tie broken to the smaller cluster
    id; features whose routers' column is read from each group's start (as many entries as groups or more) and
    scanned whole (fewer): the ``b`` best of a dense NumPy margin matrix masked to each row's groups."""
    from xmldask.models._candidates import GroupRoutes, grouped_topk

    rng = np.random.default_rng(5)
    n, d, b = 40, 300, 5
    goffsets = np.array([0, 3, 3, 10, 11, 25, 40])
    U = sp.random(40, d, density=0.15, format="csr", random_state=6, dtype=dtype)
    U[6] = U[5]  # two clusters of one group with equal margins on every row
    bias = rng.normal(size=40)
    bias[6] = bias[5]
    X = sp.random(n, d, density=0.05, format="csr", random_state=7, dtype=dtype)
    X[3] = 0
    X.eliminate_zeros()
    routes = GroupRoutes.of(U, bias, goffsets)
    columns = np.diff(sp.csr_matrix(U.T).indptr)
    assert (routes.heavy >= 0).any() and ((routes.heavy < 0) & (columns > 0)).any()
    chosen = [rng.choice(6, size=rng.integers(0, 4), replace=False) for _ in range(n)]
    chosen[3] = np.array([3, 4])
    groups = np.full((n, 3), -1)
    for i, c in enumerate(chosen):
        groups[i, rng.permutation(3)[:len(c)]] = c
    ids, margins = grouped_topk(X, groups, routes, b)
    S = (X @ U.T).toarray().astype(np.float64) + bias
    for i, c in enumerate(chosen):
        cand = np.concatenate([np.arange(goffsets[g], goffsets[g + 1]) for g in c] + [np.zeros(0, int)])
        ranked = sorted(cand, key=lambda j: (-S[i, j], j))[:b]
        m = len(ranked)
        np.testing.assert_allclose(margins[i, :m], S[i, ranked], rtol=1e-5, atol=1e-6)
        assert list(ids[i, :m]) == ranked or np.allclose(np.diff(S[i, ranked]), 0)
        assert (ids[i, m:] == -1).all() and np.isneginf(margins[i, m:]).all()
    np.testing.assert_allclose(margins[3], np.sort(bias[10:25])[::-1][:b], atol=1e-12)  # groups 3 and 4
    tied = [i for i, c in enumerate(chosen) if 2 in c and S[i, 5] >= margins[i, b - 1]]
    assert tied
    for i in tied:  # the smaller id first
        where = {c: t for t, c in enumerate(ids[i])}
        assert where[5] < where.get(6, b)


@pytest.mark.parametrize("density", [0.1, 0.7])  # the routers kept sparse, and dense
def test_group_routers_by_feature_give_the_best_groups(density):
    """``_best_groups`` by the group routers transposed (CSR below half their cells, dense from there, in uneven
    row blocks): each row's ``b`` groups of highest margin, as NumPy's."""
    from xmldask.models import centroid as C

    R = sp.random(9, 200, density=density, format="csr", random_state=8, dtype=np.float32)
    rbias = np.random.default_rng(9).normal(size=9).astype(np.float32)
    X = sp.random(50, 200, density=0.1, format="csr", random_state=10, dtype=np.float32)
    routers = C._GroupRouters.of(R, rbias)
    assert isinstance(routers.RT, np.ndarray) == (density > 0.5)
    S = (X @ R.T).toarray() + rbias
    for rows in (slice(0, 7), slice(7, 50)):
        best = C._best_groups(X[rows], routers, 3)
        expected = np.argsort(-S[rows], axis=1)[:, :3]
        np.testing.assert_array_equal(np.sort(best, axis=1), np.sort(expected, axis=1))


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_sparse_product_dense_is_scipys_product_added_to_the_array(dtype):
    from xmldask.models._candidates import sparse_product_dense

    X = sp.random(37, 200, density=0.05, format="csr", random_state=5, dtype=dtype)
    X[3] = 0  # a row without features
    M = sp.random(200, 61, density=0.2, format="csr", random_state=6, dtype=dtype)
    np.testing.assert_allclose(sparse_product_dense(X, M), (X @ M).toarray(), rtol=1e-5, atol=1e-6)
    base = np.random.default_rng(7).normal(size=(37, 61)).astype(np.float32)
    out = sparse_product_dense(X, M, base.copy())
    np.testing.assert_allclose(out, base + (X @ M).toarray(), rtol=1e-5, atol=1e-5)
    assert out.dtype == np.float32
    np.testing.assert_array_equal(out[3], base[3])  # nothing added to the row without features


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("rows, tile", [(256, 1024), (5, 7)])  # one batch and tile; uneven batches and tiles
@pytest.mark.parametrize("with_head", [True, False])
def test_summary_topk_is_the_best_columns_of_the_product(dtype, rows, tile, with_head, monkeypatch):
    """The fused summary scores (dense head columns batched by tiles, the sparse rest row by row) and their best
    columns: NumPy's product and a stable sort, best first with ties to the smaller id, padded with (-1, -inf)
    where ``b`` exceeds the columns; rows without features score 0 everywhere (the first ``b`` columns)."""
    from xmldask.models import _candidates as K

    monkeypatch.setattr(K, "SUMMARY_ROWS", rows)
    monkeypatch.setattr(K, "SUMMARY_TILE", tile)
    rng = np.random.default_rng(8)
    X = sp.random(41, 120, density=0.1, format="csr", random_state=9, dtype=dtype)
    X.data = np.ceil(X.data * 4) / 4  # coarse values: exact sums in float32, and ties between columns
    X = sp.csr_matrix(sp.diags((np.arange(41) != 6).astype(dtype)) @ X)  # row 6 without features
    X.eliminate_zeros()
    M = sp.random(120, 23, density=0.3, format="csr", random_state=10, dtype=np.float32)
    M.data = np.ceil(M.data * 4) / 4
    head = np.sort(rng.choice(120, 15, replace=False)) if with_head else np.zeros(0, np.int64)
    MH = M[head].toarray()
    rest = sp.csr_matrix(sp.diags(np.isin(np.arange(120), head, invert=True).astype(np.float32)) @ M)
    reference = (sp.csr_matrix(X, dtype=np.float64) @ sp.csr_matrix(M, dtype=np.float64)).toarray()
    assert (reference == np.round(reference * 16) / 16).all()  # exact: the kernel's float32 sums are these
    for b in (1, 4, 23, 30):
        ids, values = K.summary_topk(X, rest, b, MH, head)
        assert ids.shape == values.shape == (41, b) and ids.dtype == np.int64 and values.dtype == np.float32
        width = min(b, 23)
        np.testing.assert_array_equal(values[:, :width], -np.sort(-reference, axis=1)[:, :width])
        np.testing.assert_array_equal(ids[:, :width], np.argsort(-reference, axis=1, kind="stable")[:, :width])
        assert (ids[:, width:] == -1).all() and np.isneginf(values[:, width:]).all()
    np.testing.assert_array_equal(K.summary_topk(X, rest, 4, MH, head)[0][6], [0, 1, 2, 3])


def test_scores_add_the_weighted_classifiers_of_the_candidates(small):
    """Uneven row blocks: with every parameter given (no held-out rows), the classifiers are those of every
    training row, and a candidate's score is its cosine plus svm_weight times its classifier's margin (NumPy)."""
    from xmldask.models._svm import cluster_svms
    from xmldask.models.centroid import _rows_block

    X, Y, Xt, _ = small
    Xd = da.from_array(X, chunks=((700, 1100, 1200), (X.shape[1],)), asarray=False, fancy=False)
    Yd = da.from_array(Y, chunks=((700, 1100, 1200), (Y.shape[1],)), asarray=False, fancy=False)
    model = LabelCentroidClassifier(leaf_labels=50, beam=1000, summary_exponent=0.5, svm_weight=0.25,
                                    centroid_threshold=0, random_state=0).fit(Xd, Yd)
    assert model.svm_weight_ == 0.25 and not model.held_out_
    Xu = _rows_block(X, model.idf_)
    P = sp.csr_matrix(Y, dtype=np.float32)[:, model.order_]
    V, bias = cluster_svms(Xu, P, model.offsets_, seed=0)
    np.testing.assert_allclose(model.V_.toarray(), V.toarray(), atol=1e-5)
    Tu = _rows_block(Xt, model.idf_).astype(np.float64)
    S = np.full((Xt.shape[0], Y.shape[1]), -np.inf)
    S[:, model.order_] = (Tu @ model.W_.T).toarray() + 0.25 * ((Tu @ model.V_.T).toarray() + model.svm_bias_)
    labels, scores = (a.compute() for a in model.predict_topk(Xt, k=5))
    np.testing.assert_allclose(scores, -np.sort(-S, axis=1)[:, :5], atol=2e-5)
    assert np.mean(labels[:, 0] == S.argmax(axis=1)) > 0.99  # up to float32 ties


def test_svm_weight_is_chosen_on_held_out_rows_saved_and_refused_when_bad(tmp_path):
    """``svm_weight="auto"`` compares SVM_WEIGHTS on the held-out rows at the chosen beam (a later one only past
    their noise), keeps no classifier when 0 wins; saved and loaded; a version 1 store (centroids alone) loads and
    predicts its cosines; a bad weight is refused."""
    from xmldask.base import qualified_name
    from xmldask.models import centroid as C
    from xmldask.store.models import write_model_store

    X, Y = _all(iter_xmc(n_samples=3000, seed=7, **{**SMALL, "n_labels": 200}))  # 15 rows a label: the classifiers
    Xt, Yt = _all(iter_xmc(n_samples=500, seed=7, split="test", **{**SMALL, "n_labels": 200}))  # have rows to learn
    model = LabelCentroidClassifier(leaf_labels=40, random_state=2).fit(X, Y)
    scores, rows = model.held_out_["p@1 by svm weight"], model.held_out_["rows"]
    w = model.svm_weight_
    assert list(scores) == list(C.SVM_WEIGHTS) and model.held_out_["svm weight"] == w
    assert all((scores[v] - scores[w]) * rows <= 2 * np.sqrt(rows) for v in scores if v > w)
    assert w > 0 and model.V_ is not None and model.train_summary()["svm_weight"] == w
    alone = LabelCentroidClassifier(leaf_labels=40, svm_weight=0, random_state=2).fit(X, Y)
    assert alone.V_ is None and alone.svm_weight_ == 0 and "p@1 by svm weight" not in alone.held_out_

    def p1(m):
        labels = m.predict_topk(Xt, k=1)[0].compute()[:, 0]
        return np.asarray(Yt[np.arange(Xt.shape[0]), labels]).mean()
    assert p1(model) > p1(alone)  # the classifiers rank the candidates better on these text-like rows
    url = model.save(str(tmp_path / "svm.zarr"))
    again = load_model(url)
    assert again.svm_weight_ == w and again.svm_weight == "auto"
    for a, b in zip(model.predict_topk(Xt, k=4), again.predict_topk(Xt, k=4)):
        np.testing.assert_array_equal(a.compute(), b.compute())
    params, fitted, arrays = alone._parts()  # as version 1 wrote it: no classifiers, no weight
    old = write_model_store(str(tmp_path / "v1.zarr"), class_name=qualified_name(LabelCentroidClassifier),
                            model_version=1, params={k: v for k, v in params.items() if k != "svm_weight"},
                            fitted={k: v for k, v in fitted.items() if k != "svm_weight"},
                            arrays={k: v for k, v in arrays.items() if k not in ("V", "svm_bias")})
    v1 = load_model(old)
    for a, b in zip(alone.predict_topk(Xt, k=4), v1.predict_topk(Xt, k=4)):
        np.testing.assert_array_equal(a.compute(), b.compute())
    with pytest.raises(ValueError, match="svm_weight must be 'auto' or a number >= 0"):
        LabelCentroidClassifier(svm_weight=-1).fit(X, Y)


def test_classifiers_are_left_out_when_the_memory_cannot_hold_them(small, monkeypatch, caplog):
    """``svm_weight="auto"`` trains the classifiers only when the memory available holds them; else the centroids
    alone, with a warning that says why (a given weight is trained as asked)."""
    import logging

    from xmldask.models import centroid as C

    X, Y, _, _ = small
    assert C.classifiers_fit(10**6, 10**9) and not C.classifiers_fit(10**9, 10**9)
    monkeypatch.setattr(C, "SVM_MEMORY_SHARE", 1e-12)
    with caplog.at_level(logging.WARNING, logger="xmldask.models.centroid"):
        model = LabelCentroidClassifier(leaf_labels=40, random_state=0).fit(X, Y)
    assert model.V_ is None and model.svm_weight_ == 0 and "label classifiers not trained" in caplog.text
    assert LabelCentroidClassifier(leaf_labels=40, svm_weight=0.5, random_state=0).fit(X, Y).V_ is not None


def test_a_group_of_classifiers_past_a_tasks_memory_trains_on_a_share_of_its_rows(small, monkeypatch, caplog):
    """A cluster of frequent labels is a group of its own whatever its rows (a 1M-label set's most frequent label has
    235,000 of 1,500,000 rows): past the task's budget its classifiers train on a seeded random share of them that the
    budget holds; within it, on all of them (the same classifiers as before)."""
    import logging

    from xmldask.models import centroid as C

    X, Y, _, _ = small
    Xd = da.from_array(X, chunks=((700, 1100, 1200), (X.shape[1],)), asarray=False, fancy=False)
    Yd = da.from_array(Y, chunks=((700, 1100, 1200), (Y.shape[1],)), asarray=False, fancy=False)
    position = np.arange(Y.shape[1])
    # per group: all rows, none, all: a group's share leaves the others' rows as they are
    whole = C._gather_block(X, Y, position=position, bounds=[0, 10, 20, 30], seed=3)
    shared = C._gather_block(X, Y, position=position, bounds=[0, 10, 20, 30], seed=3, keep=[1.0, 0.0, 1.0])
    rows = [sum(x.shape[0] for x in xs) for xs, _ in whole]
    assert rows[0] > 0 and rows[1] > 0 and [sum(x.shape[0] for x in xs) for xs, _ in shared] == [rows[0], 0, rows[2]]
    half = C._gather_block(X, Y, position=position, bounds=[0, 10, 20, 30], seed=3, keep=[0.5, 0.5, 0.5])
    assert 0 < sum(x.shape[0] for x in half[1][0]) < rows[1]
    reference = LabelCentroidClassifier(leaf_labels=40, svm_weight=0.5, random_state=0).fit(Xd, Yd)
    monkeypatch.setattr(C, "SVM_GROUP_SHARE", 3e6 / C.memory_for_data())  # 3 MB a task: the largest groups are past
    with caplog.at_level(logging.INFO, logger="xmldask.models.centroid"):
        sampled = LabelCentroidClassifier(leaf_labels=40, svm_weight=0.5, random_state=0).fit(Xd, Yd)
    assert "% of their rows" in caplog.text
    np.testing.assert_array_equal(sampled.order_, reference.order_)  # the same clusters, fewer rows for some
    assert sampled.V_.shape == reference.V_.shape and (sampled.V_ != reference.V_).nnz > 0


def test_svm_groups_cut_clusters_into_groups_within_the_budget():
    from xmldask.models import centroid as C
    from xmldask.models.centroid import svm_groups

    sizes = np.array([10, 10, 10, 10, 200, 10, 10, 10], float)
    budget = C.SVM_TASK_COPIES * 8 * 100  # 100 entries a group
    assert list(svm_groups(sizes, budget_bytes=budget, min_groups=1)) == [0, 4, 5, 8]
    assert list(svm_groups(sizes, budget_bytes=1e12, min_groups=1)) == [0, 8]
    assert list(svm_groups(sizes, budget_bytes=1e12, min_groups=2)) == [0, 4, 8]  # the threads' minimum, even bounds
    assert list(svm_groups(np.zeros(0), 1e6, 4)) == [0]


def test_balanced_clusters_partition_the_labels():
    rng = np.random.default_rng(0)
    W = sp.random(1000, 300, density=0.05, format="csr", random_state=0, dtype=np.float32)
    W = sp.diags(1 / np.maximum(np.sqrt(W.multiply(W).sum(axis=1)).A1, 1e-9)) @ W
    labels = np.arange(0, 1000, 2)
    order, offsets = balanced_clusters(sp.csr_matrix(W), labels, 32, rng)
    sizes = np.diff(offsets)
    assert sorted(order) == list(labels) and sizes.max() <= 32 and sizes.min() >= 16  # halves of 500 -> 15.6..31.25


def test_fewer_candidates_than_k_are_filled_by_frequent_labels():
    X = sp.csr_matrix(np.eye(6, 10, dtype=np.float32) + 0.1)
    Y = sp.csr_matrix(np.array([[1, 0, 0, 0], [1, 0, 0, 0], [0, 1, 0, 0], [0, 1, 0, 0], [1, 0, 0, 0], [0, 1, 0, 0]],
                               np.float32))
    model = LabelCentroidClassifier(leaf_labels=2, beam=1).fit(X, Y)
    assert model.n_unseen_labels_ == 2
    labels, scores = (a.compute() for a in model.predict_topk(X, k=3))
    assert set(labels[:, :2].ravel()) <= {0, 1} and (scores[:, 2] == -1).all()
    assert (labels[:, 2] >= 2).all() and (labels[:, 2] <= 3).all()  # unseen labels fill the last slot, score -1


def _meta_labels(model, Y):
    """The rows' clusters and groups of clusters as positives (rows x clusters, rows x groups), in NumPy."""
    cluster_of = np.full(Y.shape[1], -1)
    cluster_of[model.order_] = np.repeat(np.arange(model.n_clusters_), np.diff(model.offsets_))
    Yd = sp.csr_matrix(Y).toarray() > 0
    clusters = np.zeros((Y.shape[0], model.n_clusters_), bool)
    for label in np.flatnonzero(cluster_of >= 0):
        clusters[:, cluster_of[label]] |= Yd[:, label]
    groups = np.stack([clusters[:, a:b].any(axis=1) for a, b in zip(model.group_offsets_[:-1],
                                                                      model.group_offsets_[1:])], axis=1)
    return sp.csr_matrix(clusters, dtype=np.float32), sp.csr_matrix(groups, dtype=np.float32)


def test_router_groups_are_about_square_root_groups_of_consecutive_clusters():
    from xmldask.models.centroid import router_groups

    assert list(router_groups(9)) == [0, 3, 6, 9]
    assert list(router_groups(10)) == [0, 4, 8, 10]
    assert list(router_groups(1)) == [0, 1]
    sizes = np.diff(router_groups(8192))
    assert len(sizes) == 91 and sizes.max() == 91 and sizes.sum() == 8192


def test_routers_are_squared_hinge_svms_and_route_as_a_numpy_reference(small):
    """Uneven row blocks, every parameter given (no held-out rows): the group routers are one-vs-rest SVMs of all
    rows with a label, the cluster routers those of their group's rows; a row's candidates are the labels of the
    ``beam`` clusters of highest router margin among its ``groups`` best groups (dense NumPy scores)."""
    from xmldask.models._svm import cluster_svms
    from xmldask.models.centroid import ROUTER_PASSES, _rows_block

    X, Y, Xt, Yt = small
    Xd = da.from_array(X, chunks=((700, 1100, 1200), (X.shape[1],)), asarray=False, fancy=False)
    Yd = da.from_array(Y, chunks=((700, 1100, 1200), (Y.shape[1],)), asarray=False, fancy=False)
    model = LabelCentroidClassifier(leaf_labels=8, beam=3, summary_exponent=0, svm_weight=0, routing="routers",
                                    centroid_threshold=0, random_state=0).fit(Xd, Yd)
    assert model.routing_ == "routers" and not model.held_out_ and model.M_.nnz == 0
    n_groups = len(model.group_offsets_) - 1
    assert model.group_beam_ == 4 and n_groups == np.ceil(model.n_clusters_ / np.ceil(np.sqrt(model.n_clusters_)))
    Xu = _rows_block(X, model.idf_)
    clusters, groups = _meta_labels(model, Y)
    U, ubias = cluster_svms(Xu, clusters, model.group_offsets_, seed=0, max_passes=ROUTER_PASSES)
    R, rbias = cluster_svms(Xu, groups, np.array([0, n_groups]), seed=0, max_passes=ROUTER_PASSES)
    np.testing.assert_allclose(model.U_.toarray(), U.toarray(), atol=1e-5)
    np.testing.assert_allclose(model.R_.toarray(), R.toarray(), atol=1e-5)
    np.testing.assert_allclose(model.cluster_bias_, ubias, atol=1e-5)
    np.testing.assert_allclose(model.router_bias_, rbias, atol=1e-5)

    T = _rows_block(Xt, model.idf_).astype(np.float64)
    G = (T @ model.R_.T).toarray() + model.router_bias_
    Cm = (T @ model.U_.T).toarray() + model.cluster_bias_
    S = np.full((Xt.shape[0], Y.shape[1]), -np.inf)
    cos = (T @ model.W_.T).toarray()
    for i in range(Xt.shape[0]):
        best_groups = np.argsort(-G[i], kind="stable")[:4]
        allowed = np.concatenate([np.arange(model.group_offsets_[g], model.group_offsets_[g + 1])
                                  for g in best_groups])
        best = allowed[np.argsort(-Cm[i, allowed], kind="stable")[:3]]
        for c in best:
            a, b = model.offsets_[c], model.offsets_[c + 1]
            S[i, model.order_[a:b]] = cos[i, a:b]
    labels, scores = (a.compute() for a in model.predict_topk(Xt, k=5))
    finite = np.isfinite(-np.sort(-S, axis=1)[:, :5])
    np.testing.assert_allclose(scores[finite], (-np.sort(-S, axis=1)[:, :5])[finite], atol=2e-5)
    assert np.mean(labels[:, 0] == S.argmax(axis=1)) > 0.98  # up to float32 ties of margins and cosines
    p1 = np.mean(np.asarray(Yt[np.arange(Yt.shape[0]), labels[:, 0]]).ravel())
    assert p1 > 0.3


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_streamed_passes_reach_the_squared_hinge_optimum(dtype):
    """A row block after another (uneven blocks, one of a single row), every classifier at once: the streamed
    passes keep ``W = sum alpha_i y_i x_i`` and reach the primal objective of the SVMs trained on all rows at once."""
    from xmldask.models._svm import squared_hinge_svms, streamed_pass

    rng = np.random.default_rng(0)
    n, d, m = 500, 60, 4
    X = sp.random(n, d, density=0.12, random_state=1, format="csr", dtype=dtype)
    X = sp.csr_matrix(sp.diags(1 / np.maximum(np.sqrt(X.multiply(X).sum(axis=1)).A1, 1e-9)) @ X, dtype=dtype)
    P = sp.csr_matrix((rng.random((n, m)) < 0.25).astype(np.float32))
    Xa = sp.hstack([X, np.ones((n, 1))]).tocsr().astype(np.float64)
    signs = np.where(P.toarray() > 0, 1.0, -1.0)

    def objective(Wt):  # by classifier: 1/2 |w|^2 + sum of squared hinges, the bias a feature of value 1
        return 0.5 * (Wt ** 2).sum(axis=1) + (np.maximum(0, 1 - signs * (Xa @ Wt.T)) ** 2).sum(axis=0)

    best = objective(squared_hinge_svms(X, P.tocsc(), max_passes=2000, tol=1e-6).astype(np.float64))
    blocks = [(0, 180), (180, 181), (181, n)]
    W, alphas = np.zeros((d + 1, m), np.float32), [None] * len(blocks)
    for step in range(400):
        spread = 0.0
        for b, (lo, hi) in enumerate(blocks):
            W, alphas[b], high, low = streamed_pass(X[lo:hi], P[lo:hi], W, alphas[b], seed=[step, b])
            spread = max(spread, float(np.max(high - low)))
        if step == 0:
            first = objective(W.T.astype(np.float64))
    assert W.dtype == np.float32 and W.shape == (d + 1, m)
    dual = np.vstack(alphas).astype(np.float64) * signs
    np.testing.assert_allclose((Xa.T @ dual).T, W.T, atol=1e-4)  # the weights are the dual's
    np.testing.assert_allclose(objective(W.T.astype(np.float64)), best, rtol=1e-4)
    assert np.all(first > best * (1 + 1e-3))  # it did descend to there


def test_streamed_group_routers_are_those_of_every_row(small, monkeypatch, caplog):
    """Where no task holds every row (:func:`router_share` below 1), ``routing="routers"`` streams the group routers
    over the row blocks (uneven blocks, chains of routers run at once): one-vs-rest SVMs of all rows with a label, as
    those trained in one task, up to the coordinate descent's tolerance."""
    from xmldask.models import centroid as C
    from xmldask.models._svm import cluster_svms

    X, Y, Xt, _ = small
    Xd = da.from_array(X, chunks=((700, 1100, 1200), (X.shape[1],)), asarray=False, fancy=False)
    Yd = da.from_array(Y, chunks=((700, 1100, 1200), (Y.shape[1],)), asarray=False, fancy=False)
    kw = dict(leaf_labels=8, beam=3, summary_exponent=0, svm_weight=0, routing="routers", centroid_threshold=0,
              random_state=0)
    entries = np.diff(X.indptr).astype(np.float64) @ np.asarray(Y.sum(axis=1)).ravel()
    limit = C.task_memory_limit() or C.memory_for_data()
    # a task holds half the rows' two copies, and a chain's weights are a third of the routers'
    monkeypatch.setattr(C, "SVM_GROUP_SHARE", 8 * entries / limit)
    monkeypatch.setattr(C, "parallelism", lambda: 3)
    calls = []  # the heap the cluster routers freed is handed back before the group routers stream
    monkeypatch.setattr(C, "release_memory", lambda: calls.append("release"))
    stream = C._stream_routers
    monkeypatch.setattr(C, "_stream_routers", lambda *a, **k: calls.append("stream") or stream(*a, **k))
    train = C._train_svms
    monkeypatch.setattr(C, "_train_svms", lambda *a, **k: calls.append("train") or train(*a, **k))
    with caplog.at_level("INFO", logger="xmldask.models.centroid"):
        model = LabelCentroidClassifier(**kw).fit(Xd, Yd)
    assert C.router_share(entries) < 1 and "streamed, 10 passes" in caplog.text
    assert calls[-3:] == ["train", "release", "stream"]
    n_groups = len(model.group_offsets_) - 1
    _, groups = _meta_labels(model, Y)
    R, rbias = cluster_svms(C._rows_block(X, model.idf_), groups, np.array([0, n_groups]), seed=0, max_passes=1000)
    T = C._rows_block(Xt, model.idf_).astype(np.float64)
    whole = (T @ R.T).toarray() + rbias

    def margins(R, bias):
        return (T @ R.T).toarray() + bias

    # its 10 passes route as the converged routers (a row's best group), and more passes reach them
    assert np.mean(margins(model.R_, model.router_bias_).argmax(axis=1) == whole.argmax(axis=1)) > 0.9
    group_of = np.full(Y.shape[1], -1)
    group_of[model.order_] = np.searchsorted(model.group_offsets_, np.repeat(np.arange(model.n_clusters_),
                                                                             np.diff(model.offsets_)), side="right") - 1
    R2, b2, passes = C._stream_routers(Xd, Yd, C.whole_operand(model.idf_, name="idf"), group_of, n_groups,
                                       share=0.0, seed=0, max_passes=300)
    assert 10 < passes <= 300
    np.testing.assert_allclose(margins(R2, b2), whole, atol=0.1)  # a weight near the pruning threshold: either side
    assert model.routing_ == "routers" and model.predict_topk(Xt, k=2)[0].compute().shape == (Xt.shape[0], 2)


def test_routing_auto_takes_routers_past_the_narrowest_candidates_and_chooses_the_groups(small, tmp_path):
    """``routing="auto"``: the summaries while the clusters are at most ``min(AUTO_BEAMS) * leaf_labels``, the
    routers past it, with the groups a row takes chosen on the held-out rows and saved; the summaries then compete
    with the routers on those rows and replace them where they route better (here: routers trained on 2,700 rows)."""
    from xmldask.models.centroid import AUTO_BEAMS, AUTO_GROUPS, SUMMARY_EXPONENTS

    X, Y, Xt, _ = small
    flat = LabelCentroidClassifier(leaf_labels=40, random_state=0).fit(X, Y)
    assert flat.routing_ == "summaries" and flat.n_clusters_ <= min(AUTO_BEAMS) * 40 and flat.U_ is None
    auto = LabelCentroidClassifier(leaf_labels=4, random_state=0).fit(X, Y)
    record = auto.held_out_
    assert auto.n_clusters_ > min(AUTO_BEAMS) * 4 and set(record["p@1 by summary exponent"]) == set(SUMMARY_EXPONENTS)
    assert record["routing"] == auto.routing_ == "summaries"  # the routers were trained, then beaten
    assert max(record["p@1 by summary exponent"].values()) > max(record["p@1 by groups"].values())
    assert auto.U_ is None and auto.R_ is None and auto.group_beam_ == 0
    assert auto.summary_exponent_ == record["summary exponent"] and auto.M_.nnz > 0
    routed = LabelCentroidClassifier(leaf_labels=4, routing="routers", random_state=0).fit(X, Y)
    assert routed.routing_ == "routers" and "p@1 by summary exponent" not in routed.held_out_
    assert set(routed.held_out_["p@1 by groups"]) == {min(g, len(routed.group_offsets_) - 1) for g in AUTO_GROUPS}
    assert routed.group_beam_ == routed.held_out_["groups"]
    assert routed.held_out_["p@1 by groups"] == record["p@1 by groups"]  # the same routers as the auto fit's
    assert routed.train_summary()["routing"] == "routers"
    for model, name in ((routed, "routed"), (auto, "auto")):
        again = load_model(model.save(str(tmp_path / f"{name}.zarr")))
        assert again.routing_ == model.routing_ and again.group_beam_ == model.group_beam_
        for a, b in zip(model.predict_topk(Xt, k=4), again.predict_topk(Xt, k=4)):
            np.testing.assert_array_equal(a.compute(), b.compute())
    with pytest.raises(ValueError, match="routing must be 'auto', 'summaries' or 'routers'"):
        LabelCentroidClassifier(routing="tree").fit(X, Y)


def test_routing_auto_streams_the_group_routers_where_no_task_holds_every_row(small, monkeypatch, caplog):
    """Past the narrowest beam's candidates, where a task cannot hold every row for the group routers
    (:func:`router_share` below 1), ``routing="auto"`` still trains the routers, streamed over every row, and the
    summaries meet them on the held-out rows; ``routing="routers"`` trains the same routers."""
    from xmldask.models import centroid as C

    X, Y, Xt, _ = small
    kw = dict(leaf_labels=4, random_state=0)
    entries = np.diff(X.indptr).astype(np.float64) @ np.asarray(Y.sum(axis=1)).ravel()
    # a task holds half the rows' two copies
    monkeypatch.setattr(C, "SVM_GROUP_SHARE", 8 * entries / (C.task_memory_limit() or C.memory_for_data()))
    assert C.router_share(entries) == pytest.approx(0.5)
    with caplog.at_level("INFO", logger="xmldask.models.centroid"):
        auto = LabelCentroidClassifier(**kw).fit(X, Y)
    assert "the group routers streamed over the row blocks" in caplog.text and "streamed, " in caplog.text
    record = auto.held_out_
    assert "p@1 by groups" in record and "p@1 by summary exponent" in record  # trained, then compared
    assert auto.routing_ == record["routing"]
    routed = LabelCentroidClassifier(routing="routers", **kw).fit(X, Y)
    assert routed.routing_ == "routers" and routed.R_.nnz > 0
    assert routed.held_out_["p@1 by groups"] == record["p@1 by groups"]  # the same routers as the auto fit's
    flat = LabelCentroidClassifier(routing="summaries", **kw).fit(X, Y)
    assert flat.n_passes_ < auto.n_passes_


def test_a_wider_beam_must_gain_per_doubling_of_its_candidates(small, monkeypatch):
    """The beam's held-out gain is weighed per doubling: a beam four times as wide must gain twice the minimum."""
    from xmldask.models import centroid as C

    X, Y, _, _ = small
    kw = dict(leaf_labels=10, random_state=0, routing="summaries", summary_exponent=0.5, svm_weight=0)
    base = LabelCentroidClassifier(**kw).fit(X, Y)
    p1 = base.held_out_["p@1 by beam"]
    beams = sorted(p1)
    gains = {b: p1[b] - p1[beams[0]] for b in beams[1:]}
    assert any(g > 0 for b, g in gains.items() if b >= 4 * beams[0]), p1  # two doublings or more gain on these rows
    monkeypatch.setattr(C, "BEAM_GAIN_SIGMAS", 0.0)  # every gain resolved: the minimum decides
    for b, g in gains.items():
        if g <= 0:
            continue
        doublings = np.log2(b / beams[0])
        monkeypatch.setattr(C, "AUTO_BEAMS", (beams[0], b))
        monkeypatch.setattr(C, "BEAM_MIN_GAIN", 0.99 * g / doublings)
        assert LabelCentroidClassifier(**kw).fit(X, Y).beam_ == b
        monkeypatch.setattr(C, "BEAM_MIN_GAIN", 1.01 * g / doublings)
        assert LabelCentroidClassifier(**kw).fit(X, Y).beam_ == beams[0]


def test_save_load_and_bad_parameters(small, tmp_path):
    X, Y, Xt, _ = small
    model = LabelCentroidClassifier(leaf_labels=60, random_state=3).fit(X, Y)
    model.save(str(tmp_path / "m.zarr"))
    again = load_model(str(tmp_path / "m.zarr"))
    assert isinstance(again, LabelCentroidClassifier) and again.get_params() == model.get_params()
    for a, b in zip(model.predict_topk(Xt, k=4), again.predict_topk(Xt, k=4)):
        np.testing.assert_array_equal(a.compute(), b.compute())
    with pytest.raises(ValueError, match="features must be 'tfidf' or 'l2'"):
        LabelCentroidClassifier(features="raw").fit(X, Y)
    with pytest.raises(ValueError, match="beam must be an integer of at least 1"):
        LabelCentroidClassifier(beam=0).fit(X, Y)
    clone = type(model)(**model.get_params())
    assert clone.fit(X, Y).n_clusters_ == model.n_clusters_  # refits from its parameters alone


# ----------------------------------------------------------------------------- model auto and memory


@pytest.fixture(scope="module")
def stores(tmp_path_factory):
    root = tmp_path_factory.mktemp("extreme")
    many = dict(n_features=3000, n_labels=3000, avg_labels=3.0, avg_features=30.0)
    train = make_xmc(str(root / "train.zarr"), n_samples=3000, seed=0, block_rows=1000, **many).url
    test = make_xmc(str(root / "test.zarr"), n_samples=400, seed=0, split="test", **many).url
    return root, train, test


def test_model_auto_takes_the_centroid_tree_past_a_flat_models_cost(stores, capsys):
    root, train, test = stores
    assert labels_scored_per_row(3000) == 2030 < 3000 and labels_scored_per_row(1000) == 1000
    assert labels_scored_per_row(1_000_000) == 10_000 + 2000  # the summaries of 10,000 clusters, 20 of 100 labels
    assert jobs.choose_model(train, {}) == "centroid"
    assert jobs.choose_model(train, {"k": 20}) == "embedding"  # an option of the flat model keeps it
    assert jobs.choose_model(train, {"search": None, "seed": 3}) == "centroid"
    from xmldask.models import DEFAULTS  # what the flows pass when nothing is given: every default, dumped

    assert jobs.choose_model(train, DEFAULTS.model_dump()) == "centroid"
    assert jobs.choose_model(train, {**DEFAULTS.model_dump(), "kernel": "none"}) == "embedding"
    model, pred = str(root / "auto.zarr"), str(root / "auto-pred.zarr")
    assert main(["train", train, "--out", model]) == 0
    err = capsys.readouterr().err
    assert "model auto: 3,000 labels, so the label-centroid tree" in err and "Traceback" not in err
    assert isinstance(load_model(model), LabelCentroidClassifier)
    assert main(["predict", model, test, "--out", pred, "--top-k", "5"]) == 0
    assert open_predictions(pred).labels.shape == (400, 5)
    results = jobs.evaluate(pred, test)
    assert results["P@1"] > 1.5 * results["baseline"]["P@1"]  # measured 0.51 against 0.28


def test_a_fit_that_cannot_fit_is_refused_before_any_pass(stores, monkeypatch, capsys):
    root, train, _ = stores
    monkeypatch.setattr(jobs, "MEMORY_SHARE", 1e-6)
    out = str(root / "refused.zarr")
    with pytest.raises(MemoryError, match=r"LabelCentroidClassifier on .* \(3000 rows, 3000 features, 3000 labels\) "
                                          r"would not fit: the fit process needs about"):
        jobs.train(train, out, model="centroid")
    assert not exists(out)
    assert main(["train", train, "--out", out]) == 2
    err = capsys.readouterr().err
    assert "would not fit" in err and "Fix: give the workers more memory" in err and "Traceback" not in err
    assert not exists(out)


def test_an_ensembles_fit_counts_its_other_members(stores, monkeypatch, capsys):
    """The fitting process of an ensemble also holds its other fitted members: a fit that one member's peak leaves
    room for and three members' do not is refused before any pass, naming the smaller ensemble as a fix."""
    import psutil

    root, train, _ = stores
    data = open_dataset(train)
    est = LabelCentroidClassifier()
    one, three = jobs._check_memory(est, data), jobs._check_memory(est, data, members=3)
    assert three["fit_process"] == one["fit_process"] + 2 * one["model_bytes"] > one["fit_process"]
    middle = (one["fit_process"] + three["fit_process"]) / 2
    monkeypatch.setattr(psutil, "virtual_memory", lambda: type("Memory", (), {"available": middle / 0.6})())
    monkeypatch.setattr(jobs, "MEMORY_SHARE", 0.6)
    jobs._check_memory(est, data)  # one member fits
    out = str(root / "ensemble-refused.zarr")
    with pytest.raises(MemoryError, match="would not fit: the fit process needs .* or an ensemble of fewer than 3"):
        jobs.train(train, out, model="centroid", n_estimators=3)
    assert not exists(out)


def test_a_worker_that_would_pause_for_what_it_already_holds_is_refused_before_any_pass(stores, monkeypatch):
    """A worker pauses at 80 % of its limit counting what it holds before the job (measured: 2 workers of 500 MiB
    paused at 401 MiB, a job estimated at 0.25 GiB a worker, then cancelled after 60 s): a job whose estimate
    does not fit beside it is refused before any pass, with the numbers; one that does is let through."""
    import xmldask.scheduling as S

    root, train, _ = stores
    data = open_dataset(train)
    est = LabelCentroidClassifier()
    need = jobs._check_memory(est, data)["worker"]
    limit = 2**30
    monkeypatch.setattr(S, "worker_memory_limit", lambda: limit)
    monkeypatch.setattr(S, "workers_in_process", lambda: False)
    monkeypatch.setattr(S, "worker_memory_in_use", lambda: int(0.8 * limit - need) - 2**20)
    jobs._check_memory(est, data)  # 1 MiB to spare
    monkeypatch.setattr(S, "worker_memory_in_use", lambda: int(0.8 * limit - need) + 2**20)
    with pytest.raises(MemoryError, match=r"a worker needs about .* GiB on top of the .* GiB it holds before the job, "
                                          r"past the 0.80 GiB \(80% of its limit\) at which Dask pauses it. Fix"):
        jobs._check_memory(est, data)
    out = str(root / "paused.zarr")
    monkeypatch.setattr(S, "worker_memory_in_use", lambda: limit)
    with pytest.raises(MemoryError, match="at which Dask pauses it"):
        jobs.train(train, out, model="centroid")
    assert not exists(out)


def test_memory_estimate_counts_the_router_rows_and_in_process_workers(stores, monkeypatch):
    """Routers to train: a worker's peak at least the group routers' rows (two copies of the entries' bound, at most
    SVM_GROUP_SHARE of its limit), past its label blocks' sums; workers that are threads of the fitting process:
    their peak added to its own."""
    import distributed

    from xmldask.models import centroid as C
    from xmldask.models.centroid import SVM_GROUP_SHARE

    monkeypatch.setattr(C, "LABEL_BLOCK_SHARE", 1e-3)  # label blocks: a worker's sums smaller than the rows
    from xmldask.scheduling import workers_in_process

    _, train, _ = stores
    data = open_dataset(train)
    assert not workers_in_process()  # no client
    with distributed.LocalCluster(n_workers=1, threads_per_worker=1, processes=False, memory_limit="1GiB",
                                  dashboard_address=":0") as cluster, distributed.Client(cluster):
        assert workers_in_process()
        flat = LabelCentroidClassifier(routing="summaries").memory_needed(data)
        routed = LabelCentroidClassifier(routing="routers").memory_needed(data)
        rows = min(2 * 8 * flat["entries"], SVM_GROUP_SHARE * 2**30)
        assert routed["worker"] == max(flat["worker"], rows) > flat["worker"]
        assert routed["fit_process"] == flat["fit_process"]
        # auto: 3,000 labels in at least 30 clusters of 100, below 10 x 100: the summaries
        assert LabelCentroidClassifier().memory_needed(data) == flat
        est = LabelCentroidClassifier(routing="routers")
        need = jobs._check_memory(est, data)
        assert need["fit_process"] == routed["fit_process"] + routed["worker"]


def test_a_worker_of_several_threads_sizes_a_task_by_its_share_and_counts_its_tasks(stores, monkeypatch):
    """A worker runs a task a thread (measured: 1 worker, 2 threads, 1 GiB, one task estimated at 0.37 GiB: the
    worker paused at 820-890 MiB): a task's label blocks and rows are sized by the worker's limit shared by its
    threads (task_memory_limit), the worker's estimate is its threads' tasks together, and a worker that would pause
    for them is refused before any pass, naming its threads."""
    import distributed

    import xmldask.scheduling as S
    from xmldask.models import centroid as C

    # label blocks and a sample of the routers' rows at this data's size
    monkeypatch.setattr(C, "LABEL_BLOCK_SHARE", 1e-3)
    monkeypatch.setattr(C, "SVM_GROUP_SHARE", 1e-3)
    root, train, _ = stores
    data = open_dataset(train)
    assert S.task_memory_limit() is None and S.worker_threads() == 1  # no client
    needs = {}
    for threads in (1, 2):
        with distributed.LocalCluster(n_workers=1, threads_per_worker=threads, processes=False, memory_limit="1GiB",
                                      dashboard_address=":0") as cluster, distributed.Client(cluster):
            assert S.worker_threads() == threads and S.task_memory_limit() == 2**30 // threads
            assert S.worker_memory_limit() == 2**30
            needs[threads] = LabelCentroidClassifier(routing="routers").memory_needed(data)
    # a task of a 2-thread worker holds half the label block sums and at most half the rows of a 1-thread one's
    assert needs[2]["worker"] < needs[1]["worker"]
    assert needs[2]["fit_process"] == needs[1]["fit_process"]
    # worker processes (not this process's threads): the worker's estimate is its threads' tasks together
    monkeypatch.setattr(S, "workers_in_process", lambda: False)
    monkeypatch.setattr(S, "worker_memory_limit", lambda: 2**30)
    monkeypatch.setattr(S, "worker_memory_in_use", lambda: 0)
    monkeypatch.setattr(S, "worker_threads", lambda: 3)
    monkeypatch.setattr(C, "task_memory_limit", lambda: 2**30 // 3)
    est = LabelCentroidClassifier(routing="routers")
    task = est.memory_needed(data)["worker"]
    need = jobs._check_memory(est, data)
    assert need["task"] == task and need["worker"] == 3 * task
    monkeypatch.setattr(S, "worker_memory_in_use", lambda: int(0.8 * 2**30 - 3 * task) + 2**20)
    with pytest.raises(MemoryError, match=r"a worker needs about .* GiB \(3 threads, a task each\) on top of .* "
                                          r"at which Dask pauses it. Fix: .*fewer threads \(--threads-per-worker\)"):
        jobs._check_memory(est, data)


def test_centroid_refuses_the_flat_models_options(stores):
    _, train, _ = stores
    with pytest.raises(ValueError, match="kernel do.es. not apply with model=centroid"):
        jobs.train(train, "never.zarr", model="centroid", kernel="none")


def test_a_large_loaded_model_reads_its_centroids_when_used(small, tmp_path, monkeypatch):
    """Past LAZY_BYTES a loaded model leaves its centroids and summaries in the store (a cluster-blocked prediction
    never reads them whole): the same cluster sizes and predictions once read; a NaN written into them is refused
    where they are read (whole, or by a task's block)."""
    import zarr

    from xmldask.models import centroid as C
    from xmldask.store import StoreError
    from xmldask.store.integrity import INVENTORY_ATTR, record_inventory

    X, Y, Xt, _ = small
    model = LabelCentroidClassifier(leaf_labels=40, beam=3, random_state=0).fit(X, Y)
    url = model.save(str(tmp_path / "lazy.zarr"))
    monkeypatch.setattr(C, "LAZY_BYTES", 0)
    loaded = LabelCentroidClassifier.load(url)
    assert "W_" not in loaded.__dict__ and "M_" not in loaded.__dict__
    np.testing.assert_array_equal(loaded._cluster_bytes(), model._cluster_bytes())
    assert "W_" not in loaded.__dict__  # the sizes came from the row pointers
    np.testing.assert_array_equal(loaded.predict_topk(Xt, k=3)[0].compute(), model.predict_topk(Xt, k=3)[0].compute())
    assert (loaded.W_ != model.W_).nnz == 0
    group = zarr.open_group(url, mode="r+")
    group["W/data"][0] = np.nan
    group.attrs[INVENTORY_ATTR] = record_inventory(url)
    damaged = LabelCentroidClassifier.load(url)
    with pytest.raises(StoreError, match=r"non-finite values \(W: 1\)"):
        damaged.predict_topk(Xt, k=3)  # reads W whole, in this process
    with pytest.raises(StoreError, match=r"non-finite values \(W: 1\)"):
        C._read_rows(url, "W", 0, 5)


def test_prediction_cuts_a_large_row_block_for_every_thread(small, monkeypatch):
    """A whole model's prediction of one large row block: a piece of it a thread (here 3 pieces for 3 threads),
    the same labels and scores as one task of the whole block."""
    import dask

    from xmldask.models import centroid as C

    X, Y, Xt, _ = small
    model = LabelCentroidClassifier(leaf_labels=40, beam=3, random_state=0).fit(X, Y)
    one = da.from_array(Xt, chunks=(Xt.shape[0], Xt.shape[1]), asarray=False, fancy=False)
    with dask.config.set(num_workers=3, scheduler="threads"):
        monkeypatch.setattr(C, "PREDICT_PIECE_ROWS", 100)
        labels, scores = model.predict_topk(one, k=4)
        assert labels.numblocks[0] == 3
        monkeypatch.setattr(C, "PREDICT_PIECE_ROWS", Xt.shape[0])
        whole_labels, whole_scores = model.predict_topk(one, k=4)
        assert whole_labels.numblocks[0] == 1
        np.testing.assert_array_equal(labels.compute(), whole_labels.compute())
        np.testing.assert_array_equal(scores.compute(), whole_scores.compute())


def test_a_time_budget_makes_the_first_model_and_cuts_the_stages_it_cannot_hold(small, monkeypatch):
    """``time_budget``: the first model (centroids, clusters, summaries at the first exponent, the narrowest beam) is
    always made; the classifiers and the held-out choices only where the time left holds their estimate (the first
    model's seconds times their work over its own): a budget that holds them gives the model of no budget, one that
    does not gives the centroids alone, as ``svm_weight=0`` with the narrowest beam, and says what it cut."""
    import xmldask.models.centroid as C

    X, Y, Xt, _ = small
    kw = dict(leaf_labels=60, random_state=3)
    whole = LabelCentroidClassifier(**kw).fit(X, Y)
    roomy = LabelCentroidClassifier(**kw, time_budget=1e6).fit(X, Y)
    assert roomy.budget_cut_ == [] and roomy.held_out_ == whole.held_out_ and roomy.svm_weight_ == whole.svm_weight_
    for a, b in zip(whole.predict_topk(Xt, k=3), roomy.predict_topk(Xt, k=3)):
        np.testing.assert_array_equal(a.compute(), b.compute())
    tight = LabelCentroidClassifier(**kw, time_budget=1e-3).fit(X, Y)
    bare = LabelCentroidClassifier(**kw, svm_weight=0, beam=min(C.AUTO_BEAMS), summary_exponent=0,
                                   centroid_threshold=0).fit(X, Y)
    assert [cut.split(" (")[0] for cut in tight.budget_cut_] == ["the label classifiers", "the held-out choices"]
    assert tight.V_ is None and tight.svm_weight_ == 0 and tight.held_out_ == {}
    for a, b in zip(bare.predict_topk(Xt, k=3), tight.predict_topk(Xt, k=3)):
        np.testing.assert_array_equal(a.compute(), b.compute())
    # the classifiers trained but no time left to weigh them: the middle of the weights, as a budget's first guess
    calls = iter([True, False])
    monkeypatch.setattr(C._StageBudget, "affords", lambda self, stage, work, also=0.0: next(calls, False))
    guessed = LabelCentroidClassifier(**kw, time_budget=1.0).fit(X, Y)
    assert guessed.V_ is not None and guessed.svm_weight_ == C.SVM_WEIGHTS[len(C.SVM_WEIGHTS) // 2]
    with pytest.raises(ValueError, match="time_budget"):
        LabelCentroidClassifier(time_budget=0).fit(X, Y)


@pytest.mark.parametrize("k", [0, 1, 3, 7, 12])
def test_most_frequent_labels_are_those_of_a_stable_sort(k):
    """``_most_frequent``: the ``k`` largest counts, ties (at the cut too) to the smaller id, as a stable sort."""
    from xmldask.models.centroid import _most_frequent

    counts = np.array([3, 1, 3, 0, 5, 3, 1, 5, 0, 2])
    np.testing.assert_array_equal(_most_frequent(counts, k), np.argsort(-counts, kind="stable")[:k])
    random = np.random.default_rng(k).integers(0, 4, size=1000)
    np.testing.assert_array_equal(_most_frequent(random, k), np.argsort(-random, kind="stable")[:k])
