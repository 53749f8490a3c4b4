"""The spectral label tree against an in-memory NumPy reference with an exact eigen-solver."""

from __future__ import annotations

import dask.array as da
import numpy as np
import pytest
import scipy.sparse as sp
import zarr
from scipy.special import erf

from xmldask.cluster import cluster
from xmldask.store import StoreError
from xmldask.tree import SpectralLabelTree
from xmldask.tree import _kernels as K
from xmldask.tree.growth import (
    MEDIAN_BINS,
    MEDIAN_PASSES,
    MEMORY_BUDGET,
    WORKER_MEMORY_SHARE,
    _jacobi_pcg,
    default_memory_budget,
)

CHUNKS = (500, 300)  # uneven row blocks, then the rest


def _chunks(n):
    return CHUNKS + (n - sum(CHUNKS),)


def _clustered(n=1237, d=12, L=16, *, multilabel=False, seed=0, dtype=np.float32):
    rng = np.random.default_rng(seed)
    centers = rng.normal(size=(L, d)) * 2.5
    y = rng.integers(0, L, n)
    Xd = centers[y] + rng.normal(size=(n, d))
    Yd = np.zeros((n, L))
    Yd[np.arange(n), y] = 1
    if multilabel:
        second = rng.random(n) < 0.4
        Yd[np.flatnonzero(second), (y[second] + 1) % L] = 1
    Xd = Xd.astype(dtype)
    return Xd, Yd


def _dask(Xd, Yd):
    X = da.from_array(sp.csr_matrix(Xd), chunks=(_chunks(len(Xd)), -1), asarray=False)
    Y = da.from_array(sp.csr_matrix(Yd.astype(np.float32)), chunks=(_chunks(len(Xd)), -1), asarray=False)
    return X, Y


def _reference_tree(Xd, Yd, *, max_depth, leaf_labels, recall=0.999, deterministic=False, multilabel=False,
                    routers=None):
    """Breadth-first tree with the exact top eigenvector of (I - PP^T) A (I - PP^T) and the exact weighted median.

    With ``routers`` (a fitted tree), children are routed by the tree's own ``(w, b, sigma)``: each
    node is then checked on exactly the weights the tree saw (deterministic routing is discontinuous
    at the median, where the histogram median and the exact one may differ by one row).
    """
    X = Xd.astype(np.float64)
    n, d = X.shape
    nodes = [{"p": np.ones(n), "depth": 0, "budget": leaf_labels}]
    level = [0]
    while level:
        nxt = []
        for i in level:
            node = nodes[i]
            p = np.where(node["p"] > K.CUTOFF, node["p"], 0.0)
            mass = Yd.T @ p
            order = np.argsort(-mass, kind="stable")
            positive = order[mass[order] > 0]
            cum = np.cumsum(mass[positive])
            k = int(np.searchsorted(cum, recall * cum[-1], side="right")) + 1
            node["cands"] = positive[:min(node["budget"], k)]
            node["budget"] = len(node["cands"])
            node["leaf"] = True
            if node["depth"] >= max_depth or len(node["cands"]) < leaf_labels:
                continue
            M = Yd.T @ (p[:, None] * X)
            if multilabel:
                A = M.T @ np.linalg.pinv(Yd.T @ (p[:, None] * Yd)) @ M
            else:
                A = M.T @ (M / np.maximum(mass, 1.0)[:, None])
            P = X.T @ p
            P /= np.linalg.norm(P)
            proj = np.eye(d) - np.outer(P, P)
            vals, vecs = np.linalg.eigh(proj @ A @ proj)
            lam, w = vals[-1], vecs[:, -1]
            w *= np.sign(w[np.argmax(np.abs(w))])
            t = X @ w
            active = np.flatnonzero(p > 0)
            srt = active[np.argsort(t[active], kind="stable")]
            cw = np.cumsum(p[srt])
            b = t[srt][np.argmax(cw > cw[-1] / 2)]
            m = p.sum()
            sigma = np.sqrt(lam / m)
            tq, bq, sq = t, b, sigma
            if routers is not None:
                row = routers.table_[i]
                tq = X @ routers.W_.toarray()[int(row[K.ROUTER])].astype(np.float64)
                bq, sq = row[K.BIAS], row[K.SIGMA]
            q = (tq > bq).astype(float) if deterministic else 0.5 + 0.5 * erf((tq - bq) / sq)
            node.update(leaf=False, w=w, b=b, sigma=sigma, lam=lam, children=(len(nodes), len(nodes) + 1))
            for share in (q, 1 - q):
                nodes.append({"p": node["p"] * share, "depth": node["depth"] + 1, "budget": node["budget"]})
            nxt += list(node["children"])
        level = nxt
    return nodes


def _compare(tree, ref, R):
    assert len(tree.table_) == len(ref)
    for i, node in enumerate(ref):
        row = tree.table_[i]
        if node["leaf"]:
            assert row[K.LEFT] < 0
            assert set(tree.candidates(i)) >= set(node["cands"])  # orphan repair may add labels
            continue
        assert tuple(row[[K.LEFT, K.RIGHT]].astype(int)) == node["children"]
        w = tree.W_.toarray()[int(row[K.ROUTER])].astype(np.float64)
        assert abs(w @ node["w"]) > 1 - 1e-5
        # histogram median: the upper edge of a bin of width 2R / BINS**PASSES holding the exact median
        assert node["b"] - 1e-4 * R <= row[K.BIAS] <= node["b"] + 2 * R / MEDIAN_BINS**MEDIAN_PASSES + 1e-4 * R
        assert row[K.SIGMA] == pytest.approx(node["sigma"], rel=1e-3)
        assert tree.eigenvalue_[i] == pytest.approx(node["lam"], rel=1e-4)


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("routing", ["fractional", "deterministic"])
def test_multiclass_tree_matches_exact_reference(dtype, routing):
    Xd, Yd = _clustered(dtype=dtype)
    X, Y = _dask(Xd, Yd)
    tree = SpectralLabelTree(max_depth=3, leaf_labels=3, n_power_iter=40, routing=routing, orphan_repair=False,
                             random_state=1).fit(X, Y)
    assert tree.task_ == "multiclass"
    ref = _reference_tree(Xd, Yd, max_depth=3, leaf_labels=3, deterministic=routing == "deterministic",
                          routers=tree)
    _compare(tree, ref, np.linalg.norm(Xd.astype(float), axis=1).max())
    # a level costs the same passes whatever its node count: state + stats + 2 (1 + 40) + 3 median
    per_level = 1 + 1 + 2 * 41 + MEDIAN_PASSES
    assert tree.levels_[1]["passes"] - tree.levels_[0]["passes"] == per_level
    assert tree.levels_[2]["passes"] - tree.levels_[1]["passes"] == per_level


@pytest.mark.slow
@pytest.mark.parametrize("routing", ["fractional", "deterministic"])
def test_tree_on_sparse_features_keeps_each_node_on_its_own_features(routing, monkeypatch):
    """Classes in four groups, each group's rows nonzero on its own 10 of 40 features: nodes below the root
    hold a part of the features (deterministic routing; fractional routing keeps every row in every node to
    depth 3 here), and their routers (learned on those features alone) are the exact ones."""
    Xd, Yd = _clustered(n=1237, d=40, L=16, seed=4)
    group_of_class = np.arange(16) % 4
    features_of_row = group_of_class[Yd.argmax(axis=1)]
    Xd = np.where(np.arange(40)[None, :] // 10 == features_of_row[:, None], Xd + 3.0, 0.0).astype(np.float32)
    X, Y = _dask(Xd, Yd)
    tree = SpectralLabelTree(max_depth=3, leaf_labels=3, n_power_iter=40, routing=routing, orphan_repair=False,
                             random_state=1).fit(X, Y)
    # zeros stored in the rows (a text file's "f:0") are features of their rows' nodes, and change no router
    rows, cols = np.nonzero(Xd)
    zeros = (np.arange(len(Xd)), np.where(features_of_row < 3, 39, 0))  # past / before the row's features
    Xz = sp.csr_matrix((np.concatenate([Xd[rows, cols], np.zeros(len(Xd), np.float32)]),
                        (np.concatenate([rows, zeros[0]]), np.concatenate([cols, zeros[1]]))), shape=Xd.shape)
    assert Xz.nnz == np.count_nonzero(Xd) + len(Xd)
    stats = K.level_stats(Xz, sp.csr_matrix(Yd), np.arange(40), np.arange(16), [0])
    assert (stats[1 + 40:1 + 80] > 0).all()  # the root's features: every column, 39 by its stored zeros alone
    stats = K.level_stats(Xz[features_of_row == 0], sp.csr_matrix(Yd[features_of_row == 0]), np.arange(40),
                          np.arange(16), [0])
    np.testing.assert_array_equal(np.flatnonzero(stats[1 + 40:1 + 80]), list(range(10)) + [39])
    # ... and so do routers routed as CSR (text data's; small ones are routed dense)
    import xmldask.tree.growth as growth

    monkeypatch.setattr(growth, "DENSE_ROUTERS_BYTES", 0)
    Xz = da.from_array(Xz, chunks=(_chunks(len(Xd)), -1), asarray=False)
    stored = SpectralLabelTree(max_depth=3, leaf_labels=3, n_power_iter=40, routing=routing, orphan_repair=False,
                               random_state=1).fit(Xz, Y)
    np.testing.assert_allclose(stored.W_.toarray(), tree.W_.toarray(), atol=1e-5)
    np.testing.assert_array_equal(stored.route(Xz).compute(), tree.route(X).compute())
    ref = _reference_tree(Xd, Yd, max_depth=3, leaf_labels=3, deterministic=routing == "deterministic",
                          routers=tree)
    _compare(tree, ref, np.linalg.norm(Xd.astype(float), axis=1).max())
    # a router is zero off its node's features, and some node below the root lacks a whole group
    support = [np.flatnonzero(np.abs(Xd).T @ (node["p"] > K.CUTOFF)) for node in ref if not node["leaf"]]
    for w, features in zip(tree.W_.toarray(), support):
        assert not np.delete(w, features).any()
    assert min(len(f) for f in support) <= (30 if routing == "deterministic" else 40)


def test_csr_routers_give_the_dense_routers_products():
    rng = np.random.default_rng(0)
    W = sp.random(40, 300, density=0.2, format="csr", dtype=np.float32, random_state=1)
    shuffled = W.copy()  # the same matrix with each row's entries out of order
    for r in range(W.shape[0]):
        lo, hi = W.indptr[r], W.indptr[r + 1]
        perm = lo + rng.permutation(hi - lo)
        shuffled.indices[lo:hi], shuffled.data[lo:hi] = W.indices[perm], W.data[perm]
    shuffled.has_sorted_indices = False
    routers, features = rng.integers(0, 40, 5000), rng.integers(0, 300, 5000)
    for csr in (W, shuffled):
        np.testing.assert_array_equal(K.router_entries(csr, routers, features), W.toarray()[routers, features])
    X = sp.random(200, 300, density=0.1, format="csr", random_state=2)
    rows, widx = rng.integers(0, 200, 700), rng.integers(0, 40, 700)
    np.testing.assert_allclose(K.pair_dots(X, rows, W, widx), K.pair_dots(X, rows, W.toarray(), widx))
    order = np.argsort(widx, kind="stable")
    np.testing.assert_allclose(K.node_products(X, rows[order], widx[order], W),
                               K.node_products(X, rows[order], widx[order], W.toarray()))
    assert not K.router_entries(sp.csr_matrix((3, 300), dtype=np.float32), routers % 3, features).any()


def test_multilabel_tree_matches_exact_reference():
    Xd, Yd = _clustered(multilabel=True, seed=3)
    X, Y = _dask(Xd, Yd)
    tree = SpectralLabelTree(max_depth=2, leaf_labels=4, n_power_iter=30, cg_max_iter=40, orphan_repair=False,
                             random_state=2).fit(X, Y)
    assert tree.task_ == "multilabel"
    ref = _reference_tree(Xd, Yd, max_depth=2, leaf_labels=4, multilabel=True)
    root = ref[0]
    w = tree.W_.toarray()[0].astype(np.float64)
    # the reference code's CG stops at ||r||^2 < 1e-4 ||r0||^2 (float32): close, not exact
    assert abs(w @ root["w"]) > 0.99
    assert tree.eigenvalue_[0] == pytest.approx(root["lam"], rel=0.02)


def test_label_gram_blocks_match_dense_products():
    Xd, Yd = _clustered(n=300, multilabel=True, seed=5)
    Xb, Yb = sp.csr_matrix(Xd), sp.csr_matrix(Yd)
    L = Yd.shape[1]
    rng = np.random.default_rng(1)
    rows = np.sort(np.concatenate([np.arange(300), rng.choice(300, 200, replace=False)]))
    nodes_of_pair = rng.integers(7, 10, len(rows))  # frontier nodes 7, 8, 9 (9 not in the group)
    p = rng.uniform(0.1, 1.0, len(rows))
    order = np.lexsort((rows, nodes_of_pair))
    pairs = (rows[order].astype(np.int32), nodes_of_pair[order].astype(np.int32), p[order].astype(np.float32))
    group = [8, 7]
    D = [np.zeros((300, 300)) for _ in group]  # per local node: diag of its path probabilities by row
    for r_, n_, p_ in zip(*pairs):
        if n_ in group:
            D[group.index(n_)][r_, r_] += p_
    S = np.stack([np.diag(Dj) @ Yd for Dj in D])  # label masses per local node
    slots = np.flatnonzero(S.ravel() > 0)
    node_of = slots // L
    offsets = np.searchsorted(node_of, np.arange(len(group) + 1))
    flat = K.level_label_gram(Xb, Yb, slots, offsets, np.asarray(group), pairs)
    at = 0
    for j, Dj in enumerate(D):
        labels = slots[offsets[j]:offsets[j + 1]] - j * L
        want = Yd[:, labels].T.astype(np.float64) @ Dj @ Yd[:, labels]
        n = len(labels)
        np.testing.assert_allclose(flat[at:at + n * n].reshape(n, n), want, rtol=1e-6)
        at += n * n
    assert at == len(flat)


def test_label_gram_gives_the_tree_of_the_cg_passes(monkeypatch):
    from xmldask.tree import growth

    Xd, Yd = _clustered(multilabel=True, seed=11)
    X, Y = _dask(Xd, Yd)
    fast = SpectralLabelTree(max_depth=3, leaf_labels=4, random_state=0).fit(X, Y)
    gram = growth._label_gram

    def one_node_a_pass(passes, group, slots, node_of, memory_budget):
        largest = np.diff(np.searchsorted(node_of, np.arange(len(group) + 1))).max()
        return gram(passes, group, slots, node_of, int(largest) ** 2 * 8)

    monkeypatch.setattr(growth, "_label_gram", one_node_a_pass)  # the budget holds one node's block
    runs = SpectralLabelTree(max_depth=3, leaf_labels=4, random_state=0).fit(X, Y)
    monkeypatch.setattr(growth, "_label_gram", lambda *args: None)  # a pass per CG iteration, as before
    slow = SpectralLabelTree(max_depth=3, leaf_labels=4, random_state=0).fit(X, Y)
    for other in (runs, slow):
        np.testing.assert_allclose(fast.W_.toarray(), other.W_.toarray(), rtol=1e-4, atol=1e-5)
        np.testing.assert_array_equal(fast.cand_indices_, other.cand_indices_)
    assert fast.n_passes_ < runs.n_passes_ < slow.n_passes_  # 35, 39 and 64 here (the CG stops early)


def test_jacobi_pcg_solves_per_column():
    rng = np.random.default_rng(0)
    sizes, r = (9, 5, 1), 4  # nodes with different numbers of label slots
    Ms = [(lambda A: A @ A.T + n * np.eye(n))(rng.normal(size=(n, n))) for n in sizes]
    M = sp.block_diag(Ms).toarray()
    node_of = np.repeat(np.arange(len(sizes)), sizes)
    B = rng.normal(size=(sum(sizes), r))
    V = _jacobi_pcg(lambda P: M @ P, B, np.diag(M), node_of, max_iter=50, tol=1e-20)
    np.testing.assert_allclose(V, np.linalg.solve(M, B), rtol=1e-8, atol=1e-10)


def test_single_power_step_default_is_close_on_a_clear_gap():
    Xd, Yd = _clustered(seed=5)
    X, Y = _dask(Xd, Yd)
    tree = SpectralLabelTree(max_depth=1, leaf_labels=3, random_state=0).fit(X, Y)
    ref = _reference_tree(Xd, Yd, max_depth=1, leaf_labels=3)
    assert abs(tree.W_.toarray()[0].astype(float) @ ref[0]["w"]) > 0.95
    # norms, task, level 0, level 1 state and stats, orphans
    assert tree.n_passes_ == 2 + 1 + 4 + MEDIAN_PASSES + 1 + 1 + 2


def test_stopping_rule_budget_and_orphan_repair():
    Xd, Yd = _clustered(n=1500, L=30, seed=7)
    X, Y = _dask(Xd, Yd)
    tree = SpectralLabelTree(max_depth=3, leaf_labels=2, random_state=0).fit(X, Y)
    leaves = np.flatnonzero(tree.table_[:, K.LEFT] < 0)
    assert tree.depth_[leaves].max() <= 3
    assert tree.n_orphans_ > 0
    leaf = tree.route(X).compute()
    y = Yd.argmax(1)
    covered = np.array([y[i] in set(tree.candidates(leaf[i])) for i in range(len(y))])
    # after repair, every label with training rows is covered for at least one of its rows
    assert set(y[covered]) == set(y)
    sizes = np.diff(tree.cand_indptr_)[leaves]
    assert sizes.max() > 2  # repaired leaves exceed the budget


@pytest.fixture(scope="module")
def multilabel_tree():
    """A depth-3 tree on clustered multilabel rows: ``(Xd, Yd, X, Y, tree)``."""
    Xd, Yd = _clustered(multilabel=True, seed=11)
    X, Y = _dask(Xd, Yd)
    return Xd, Yd, X, Y, SpectralLabelTree(max_depth=3, leaf_labels=4, random_state=0).fit(X, Y)


def test_leaf_figures_match_a_loop(multilabel_tree):
    Xd, Yd, X, Y, tree = multilabel_tree
    got = tree.leaf_figures(X, Y)
    leaf = tree.route(X).compute()
    n_nodes = len(tree.table_)
    rows, assigned, covered = np.zeros(n_nodes), np.zeros(n_nodes), np.zeros(n_nodes)
    for i in range(len(leaf)):
        labels = np.flatnonzero(Yd[i])
        rows[leaf[i]] += 1
        assigned[leaf[i]] += len(labels)
        covered[leaf[i]] += len(set(labels) & set(tree.candidates(leaf[i])))
    np.testing.assert_array_equal(got["rows"], rows)
    np.testing.assert_array_equal(got["assignments"], assigned)
    np.testing.assert_array_equal(got["covered"], covered)
    for d, n, r in zip(got["depth"], got["rows_by_depth"], got["recall_by_depth"]):
        at = tree.depth_[leaf] == d
        assert n == at.sum()
        if n:
            assert r == pytest.approx(covered[tree.depth_ == d].sum() / assigned[tree.depth_ == d].sum())
    sizes = np.diff(tree.cand_indptr_)[leaf]
    assert dict(zip(got["candidates"], got["rows_by_candidates"])) == pytest.approx(
        {c: float((sizes == c).sum()) for c in got["candidates"]})
    assert got["rows_by_depth"].sum() == len(leaf)
    assert got["covered"].sum() / got["assignments"].sum() == pytest.approx(tree.figures(X, Y)["tree_recall"])


def test_figures_match_a_loop(multilabel_tree):
    Xd, Yd, X, Y, tree = multilabel_tree
    fig = tree.figures(X, Y)
    leaf = tree.route(X).compute()
    t = Xd.astype(np.float64) @ tree.W_.toarray()[0].astype(np.float64)
    left = t > tree.table_[0, K.BIAS]
    covered = assigned = top = 0
    for i in range(len(leaf)):
        labels = np.flatnonzero(Yd[i])
        assigned += len(labels)
        covered += len(set(labels) & set(tree.candidates(leaf[i])))
        top += len(set(labels) & set(tree.top_labels_))
    nl, nr = Yd[left].sum(0), Yd[~left].sum(0)
    assert fig["tree_recall"] == pytest.approx(covered / assigned)
    assert fig["top_labels_recall"] == pytest.approx(top / assigned)
    assert fig["root_purity"] == pytest.approx(np.maximum(nl, nr).sum() / assigned)
    assert fig["root_balance"] == pytest.approx(left.mean())
    assert fig["mean_depth"] == pytest.approx(tree.depth_[leaf].mean())
    assert fig["mean_candidates"] == pytest.approx(np.diff(tree.cand_indptr_)[leaf].mean())
    labels, scores = tree.predict_topk(X, k=2)
    labels = labels.compute()
    assert all(lab in set(tree.candidates(leaf[i])) for i, row in enumerate(labels) for lab in row if lab >= 0)


def test_save_load_and_feature_count_refused(tmp_path):
    Xd, Yd = _clustered()
    X, Y = _dask(Xd, Yd)
    tree = SpectralLabelTree(max_depth=2, leaf_labels=3, random_state=0).fit(X, Y)
    url = str(tmp_path / "tree.zarr")
    tree.save(url, meta={"train_url": "x"})
    loaded = SpectralLabelTree.load(url)
    assert sp.issparse(loaded.W_) and (loaded.W_ != tree.W_).nnz == 0  # the routers, as CSR
    np.testing.assert_array_equal(loaded.route(X).compute(), tree.route(X).compute())
    assert loaded.figures(X, Y) == tree.figures(X, Y)
    # a store of the first version (dense W) still loads, as CSR
    from xmldask.store.models import open_model_store, write_model_store

    params, fitted, arrays = tree._parts()
    old = str(tmp_path / "tree-v1.zarr")
    write_model_store(old, class_name="SpectralLabelTree", model_version=1, params=params, fitted=fitted,
                      arrays={**arrays, "W": tree.W_.toarray()})
    assert "W" in open_model_store(old, model_version=1)[0].array_keys()
    v1 = SpectralLabelTree.load(old)
    assert sp.issparse(v1.W_) and (v1.W_ != tree.W_).nnz == 0
    np.testing.assert_array_equal(v1.route(X).compute(), tree.route(X).compute())
    with pytest.raises(FileExistsError):
        tree.save(url)
    with pytest.raises(ValueError, match="features"):
        loaded.route(da.from_array(sp.csr_matrix(Xd[:, :5]), chunks=(_chunks(len(Xd)), -1), asarray=False))
    from xmldask.models import EmbeddingClassifier, load_model

    assert isinstance(load_model(url), SpectralLabelTree)
    with pytest.raises(StoreError, match="SpectralLabelTree"):
        EmbeddingClassifier.load(url)


@pytest.mark.parametrize("bad", [{"max_depth": 0}, {"leaf_labels": -1}, {"leaf_labels": 2.5}, {"routing": "x"},
                                 {"sigma": "x"}])
def test_bad_parameters(bad):
    Xd, Yd = _clustered(n=100)
    X = da.from_array(sp.csr_matrix(Xd), chunks=(50, -1), asarray=False)
    Y = da.from_array(sp.csr_matrix(Yd), chunks=(50, -1), asarray=False)
    with pytest.raises(ValueError):
        SpectralLabelTree(**bad).fit(X, Y)


def test_tree_classifier_gradients_match_finite_differences():
    from xmldask.models.tree_classifier import _leaf_gradients

    rng = np.random.default_rng(0)
    Xl = sp.csr_matrix(rng.normal(size=(7, 5)))
    U, V, b = rng.normal(size=(5, 3)), rng.normal(size=(3, 4)), rng.normal(size=4)
    for task, Yl in (("multiclass", np.eye(4)[rng.integers(0, 4, 7)]),
                     ("multilabel", (rng.random((7, 4)) < 0.4).astype(float))):
        loss, gU, gV, gb = _leaf_gradients(Xl, Yl, U, V, b, task)
        m, eps = Xl.shape[0], 1e-6
        for param, grad, scale in ((U, gU, 1.0 / m), (V, gV, 1.0), (b, gb, 1.0)):
            idx = tuple(rng.integers(0, s) for s in param.shape)
            param[idx] += eps
            up = _leaf_gradients(Xl, Yl, U, V, b, task)[0]
            param[idx] -= 2 * eps
            down = _leaf_gradients(Xl, Yl, U, V, b, task)[0]
            param[idx] += eps
            # dV, db are gradients of the mean loss; dU of the summed loss (the reference code's scaling)
            assert grad[idx] * scale == pytest.approx((up - down) / (2 * eps), rel=1e-5, abs=1e-8)


def test_tree_classifier_step_helpers_match_the_general_kernels():
    """The leaf step's dense shortcuts: targets by lookup, the small-batch softmax, the row-preconditioned
    ``U`` gradient, against sparse indexing, ``softmax_loss`` and the preconditioner applied afterwards."""
    from xmldask.models import _kernels as MK
    from xmldask.models.tree_classifier import _dense_softmax_loss, _leaf_gradients, _leaf_targets

    rng = np.random.default_rng(1)
    Yb = sp.random(40, 30, density=0.1, format="csr", random_state=1)
    Yb.data[:] = 1
    idx, cands = np.array([3, 17, 17, 0, 39, 8]), np.array([29, 4, 11, 0, 7, 22, 13])
    np.testing.assert_array_equal(_leaf_targets(Yb, idx, cands), Yb[idx][:, cands].toarray())
    S, Y = rng.normal(size=(6, 7)), (rng.random((6, 7)) < 0.3).astype(float)
    Y[np.arange(6), rng.integers(0, 7, 6)] = 1  # every row has a label
    loss, grad = _dense_softmax_loss(S, Y)
    ref_loss, ref_grad = MK.softmax_loss(S.copy(), Y)
    assert loss == pytest.approx(ref_loss, rel=1e-12)
    np.testing.assert_allclose(grad, ref_grad, atol=1e-12)
    Xl, U, V, b = rng.normal(size=(6, 5)), rng.normal(size=(5, 3)), rng.normal(size=(3, 7)), rng.normal(size=7)
    Minv = np.linalg.inv((lambda A: A @ A.T + np.eye(5))(rng.normal(size=(5, 5))))
    plain = _leaf_gradients(Xl, Y, U, V, b, "multiclass")
    preconditioned = _leaf_gradients(Xl, Y, U, V, b, "multiclass", Xl @ Minv)
    np.testing.assert_allclose(preconditioned[1], Minv @ plain[1], rtol=1e-10)


def test_row_heavy_ball_gives_the_dense_iterates():
    """Steps whose gradients touch a few rows, taken lazily (rows brought forward when read or written), give
    the dense heavy-ball iterates: after every step on the rows it reads, and at the end on every row."""
    from xmldask.models.tree_classifier import _DenseHeavyBall, _RowHeavyBall

    rng = np.random.default_rng(3)
    d, r = 40, 3
    U0 = rng.normal(size=(d, r))
    dense, lazy = _DenseHeavyBall(U0.copy(), 0.8), _RowHeavyBall(U0.copy(), 0.8)
    for _ in range(300):
        rows = np.unique(rng.integers(0, d, rng.integers(0, 6)))  # sometimes none, rows idle for long gaps
        np.testing.assert_allclose(lazy.rows(rows), dense.rows(rows), rtol=1e-10, atol=1e-12)
        G = rng.normal(size=(len(rows), r)) * 0.1
        dense.step(rows, G)
        lazy.step(rows, G)
    np.testing.assert_allclose(lazy.result(), dense.result(), rtol=1e-9, atol=1e-12)


def test_tree_classifier_on_sparse_rows_steps_only_the_leaf_features(monkeypatch):
    """Beyond DENSE_PRECONDITIONER_MAX_FEATURES the rows stay sparse and U moves row by row: the same model
    as the dense steps on the same sparse path (float32 data, uneven row blocks)."""
    from xmldask.models import tree_classifier as TC

    Xd, Yd = _clustered(seed=5)
    Xd[np.abs(Xd) < 1.0] = 0  # sparse rows
    X, Y = _dask(Xd, Yd)
    tree = SpectralLabelTree(max_depth=3, leaf_labels=6, random_state=0).fit(X, Y)
    assert TC.TreeClassifier(tree, n_components=5, max_epochs=1).fit(X, Y).preconditioner_ == "full"
    monkeypatch.setattr(TC, "DENSE_PRECONDITIONER_MAX_FEATURES", 4)  # 12 features: the diagonal, sparse rows
    lazy = TC.TreeClassifier(tree, n_components=5, max_epochs=4, random_state=0).fit(X, Y)
    assert lazy.preconditioner_ == "diagonal"
    monkeypatch.setattr(TC, "_RowHeavyBall", TC._DenseHeavyBall)
    dense = TC.TreeClassifier(tree, n_components=5, max_epochs=4, random_state=0).fit(X, Y)
    for name in ("U_", "V_", "b_"):
        np.testing.assert_allclose(getattr(lazy, name), getattr(dense, name), rtol=1e-4, atol=1e-6)
    assert lazy.history_[-1]["loss"] < lazy.history_[0]["loss"]


def test_tree_classifier_joins_row_blocks_into_one_round_of_leaf_steps(monkeypatch):
    """Rows made dense: the uneven row blocks are one round of leaf steps, a full-batch step per leaf and pass as
    in the reference code, so the model is that of the same rows in one block; with a round of one block at most,
    a step per leaf and block gives another model."""
    from xmldask.models import tree_classifier as TC

    Xd, Yd = _clustered(seed=4)
    X, Y = _dask(Xd, Yd)
    assert X.numblocks[0] > 2
    assert TC._rounds(X.chunks[0], 16 * Xd.shape[1]) == [list(range(X.numblocks[0]))]
    assert TC._rounds((1, 2, 1, 3), TC.STEP_BYTES // 3) == [[0, 1], [2], [3]]
    one = tuple(da.from_array(sp.csr_matrix(a.astype(np.float32)), chunks=(len(Xd), -1), asarray=False)
                for a in (Xd, Yd))
    tree = SpectralLabelTree(max_depth=2, leaf_labels=6, random_state=0).fit(X, Y)
    kw = dict(n_components=6, max_epochs=3, random_state=0, validation_fraction=0)  # every row, as in one block
    joined, single = TC.TreeClassifier(tree, **kw).fit(X, Y), TC.TreeClassifier(tree, **kw).fit(*one)
    for name in ("U_", "V_", "b_"):
        np.testing.assert_allclose(getattr(joined, name), getattr(single, name), rtol=1e-5, atol=1e-6)
    monkeypatch.setattr(TC, "STEP_BYTES", 16 * Xd.shape[1] * max(X.chunks[0]))
    per_block = TC.TreeClassifier(tree, **kw).fit(X, Y)
    assert not np.allclose(per_block.V_, joined.V_, rtol=1e-3, atol=1e-4)
    assert TC._rounds(X.chunks[0], 16 * Xd.shape[1]) == [[i] for i in range(X.numblocks[0])]
    assert TC._rounds((5, 3, 4, 2), 0) == [[0], [1], [2], [3]]  # sparse rows: a round a block


def _per_label_reference(Xd, Yd, chunks, leaf, tree, *, epochs, eta, momentum, decay, multilabel):
    """The text form's passes in plain NumPy: rounds of one row block (rows stay sparse), the leaves in the order
    of the classifier's generator, one full-batch step per leaf on the weights of its rows' features and its
    candidates (lazy momentum) and on its biases."""
    squares = (Xd.astype(np.float64) ** 2).sum(axis=0)
    C = np.maximum(1.0, squares)
    scale = 1.0 / (C + 1e-3 * C.mean())
    ip, ix = tree.cand_indptr_, tree.cand_indices_
    V, b = np.zeros((Xd.shape[1], Yd.shape[1])), np.zeros(len(ix))
    mV, mb = np.zeros_like(V), np.zeros_like(b)
    rng = np.random.default_rng(0)
    for _ in range(epochs):
        for rows in np.split(np.arange(len(Xd)), np.cumsum(chunks)[:-1]):
            nodes = np.unique(leaf[rows])
            for i in rng.permutation(len(nodes)):
                idx = rows[leaf[rows] == nodes[i]]
                slots = np.arange(ip[nodes[i]], ip[nodes[i] + 1])
                cands = ix[slots]
                T = Yd[np.ix_(idx, cands)]
                keep = T.any(axis=1)
                if not len(cands) or not keep.any():
                    continue
                idx, T = idx[keep], T[keep]
                S = Xd[idx].astype(np.float64) @ V[:, cands] + b[slots]
                if multilabel:
                    delta = 1.0 / (1.0 + np.exp(-S)) - T
                else:
                    E = np.exp(S - S.max(axis=1, keepdims=True))
                    delta = E / E.sum(axis=1, keepdims=True) - T / T.sum(axis=1, keepdims=True)
                feats = np.flatnonzero((Xd[idx] != 0).any(axis=0))
                block = np.ix_(feats, cands)
                mV[block] = momentum * mV[block] - eta * scale[feats][:, None] * (Xd[idx][:, feats].T @ delta)
                V[block] += mV[block]
                mb[slots] = momentum * mb[slots] - eta * delta.mean(axis=0)
                b[slots] += mb[slots]
        eta *= decay
    return V, b


@pytest.mark.parametrize("multilabel", [False, True])
def test_tree_classifier_per_label_form_matches_a_numpy_reference(multilabel):
    """The text form (weights per label shared by the leaves, a bias per leaf and candidate, the reference code's
    per-feature step scale and lazy momentum) against plain NumPy: sparse float32 rows in uneven blocks."""
    from xmldask.models.tree_classifier import TreeClassifier

    Xd, Yd = _clustered(seed=7, multilabel=multilabel)
    Xd[np.abs(Xd) < 0.8] = 0
    X, Y = _dask(Xd, Yd)
    tree = SpectralLabelTree(max_depth=3, leaf_labels=5, random_state=0).fit(X, Y)
    kw = dict(epochs=3, eta=0.5, momentum=0.9, decay=0.95, multilabel=multilabel)
    model = TreeClassifier(tree, form="per_label", routing="deterministic", max_epochs=kw["epochs"],
                           learning_rate=kw["eta"], momentum=kw["momentum"], decay=kw["decay"],
                           validation_fraction=0, random_state=0).fit(X, Y)
    assert model.U_ is None and model.V_.shape == (Xd.shape[1], Yd.shape[1])
    assert model.preconditioner_ == "feature_scale"
    V, b = _per_label_reference(Xd, Yd, X.chunks[0], tree.route(X).compute(), tree, **kw)
    np.testing.assert_allclose(model.V_, V, rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose(model.b_, b, rtol=1e-4, atol=1e-6)
    assert model.history_[-1]["loss"] < model.history_[0]["loss"]
    with pytest.raises(ValueError, match="form must be one of 'low_rank', 'per_label'"):
        TreeClassifier(tree, form="text").fit(X, Y)


@pytest.mark.parametrize("options", [{}, {"per_leaf": False}, {"routing": "deterministic"},
                                     {"form": "per_label"}])
def test_tree_classifier_fits_predicts_within_candidates_and_round_trips(tmp_path, options):
    from xmldask.models import load_model
    from xmldask.models.tree_classifier import TreeClassifier

    Xd, Yd = _clustered(seed=4)
    X, Y = _dask(Xd, Yd)
    tree = SpectralLabelTree(max_depth=2, leaf_labels=6, random_state=0).fit(X, Y)
    model = TreeClassifier(tree, n_components=6, max_epochs=15, random_state=0, **options).fit(X, Y)
    assert model.history_[-1]["loss"] < model.history_[0]["loss"]
    labels, scores = (a.compute() for a in model.predict_topk(X, k=3))
    leaf = tree.route(X).compute()
    y = Yd.argmax(1)
    if model.per_leaf:
        assert all(lab in set(tree.candidates(leaf[i])) for i, row in enumerate(labels) for lab in row if lab >= 0)
        np.testing.assert_allclose(np.where(np.isfinite(scores), scores, 0).sum(1) <= 1 + 1e-5, True)
    accuracy = np.mean(labels[:, 0] == y)
    recall = tree.figures(X, Y)["tree_recall"]
    assert accuracy > 0.8 * recall if model.per_leaf else accuracy > 0.5
    url = str(tmp_path / "m.zarr")
    model.save(url)
    loaded = load_model(url)
    np.testing.assert_array_equal(loaded.predict_topk(X, k=3)[0].compute(), labels)
    # a store written when the passes were the parameter n_epochs loads with it as max_epochs
    params, fitted, _ = model._parts()
    params["n_epochs"] = params.pop("max_epochs")
    former = TreeClassifier._from_parts(params, fitted, zarr.open_group(url, mode="r"))
    assert former.max_epochs == 15 and former.get_params() == loaded.get_params()


def test_pair_chunks_give_the_same_tree(monkeypatch):
    Xd, Yd = _clustered(n=900)
    X, Y = _dask(Xd, Yd)
    whole = SpectralLabelTree(max_depth=2, leaf_labels=3, random_state=0).fit(X, Y)
    monkeypatch.setattr(K, "PAIR_NNZ", 97)  # many small chunks of pairs per block
    monkeypatch.setattr(K, "PAIR_CHUNK", 89)
    chunked = SpectralLabelTree(max_depth=2, leaf_labels=3, random_state=0).fit(X, Y)
    np.testing.assert_allclose(chunked.W_.toarray(), whole.W_.toarray(), rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(chunked.cand_indices_, whole.cand_indices_)


@pytest.mark.parametrize("routing", ["fractional", "deterministic"])
def test_level_state_holds_the_pairs_routing_from_the_root_finds(routing):
    """Moving each block's frontier one level at a time reaches the pairs (row, terminal node, p) that routing
    every row from the root gives: the level state loses no pair and routes none twice."""
    Xd, Yd = _clustered(n=900)
    X, Y = _dask(Xd, Yd)
    tree = SpectralLabelTree(max_depth=3, leaf_labels=3, routing=routing, random_state=0).fit(X, Y)
    Xs = sp.csr_matrix(Xd)
    deterministic = routing == "deterministic"
    rows, nodes, p = K.route_pairs(Xs, tree.table_, tree.W_, deterministic=deterministic)
    state, got = None, {}
    for _ in range(tree.max_depth + 1):
        r, n, q = K.frontier(state, len(Xd))
        leaf = tree.table_[n, K.LEFT] < 0
        got.update({(a, b): c for a, b, c in zip(r[leaf], n[leaf], q[leaf])})
        state = K.advance(Xs, tree.table_, tree.W_, state, deterministic=deterministic)
    assert not len(K.frontier(state, len(Xd))[0])
    assert set(got) == set(zip(rows, nodes))
    np.testing.assert_allclose([got[key] for key in zip(rows, nodes)], p, rtol=1e-6)  # the state keeps float32


def test_node_groups_give_the_same_tree():
    Xd, Yd = _clustered(n=900)
    X, Y = _dask(Xd, Yd)
    whole = SpectralLabelTree(max_depth=3, leaf_labels=3, random_state=0).fit(X, Y)
    grouped = SpectralLabelTree(max_depth=3, leaf_labels=3, memory_budget=1, random_state=0).fit(X, Y)
    np.testing.assert_allclose(grouped.W_.toarray(), whole.W_.toarray(), rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(grouped.cand_indices_, whole.cand_indices_)
    assert grouped.n_passes_ > whole.n_passes_  # one group, with its own passes, per node


@pytest.fixture(scope="module")
def scheduler():
    """An in-process scheduler for the commands' --scheduler option."""
    distributed = pytest.importorskip("distributed")
    with distributed.LocalCluster(n_workers=1, threads_per_worker=2, processes=False, dashboard_address=":0") as c:
        yield c.scheduler_address


def test_cli_tree_tree_info_train_predict_evaluate(tmp_path, capsys, scheduler):
    import json

    from xmldask.cli import main

    common = ["--n-features", "200", "--n-labels", "30", "--multiclass", "--seed", "3", "--no-progress"]
    train, test = str(tmp_path / "train.zarr"), str(tmp_path / "test.zarr")
    assert main(["synth", "--out", train, "--n-samples", "1500", *common]) == 0
    assert main(["synth", "--out", test, "--n-samples", "400", "--split", "test", *common]) == 0
    tree, model, pred = (str(tmp_path / name) for name in ("tree.zarr", "model.zarr", "pred.zarr"))
    assert main(["tree", train, "--out", tree, "--depth", "3", "--leaf-labels", "8", "--seed", "1",
                 "--scheduler", scheduler]) == 0
    capsys.readouterr()
    assert main(["tree-info", tree, test, "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert {"tree_recall", "root_purity", "mean_depth", "mean_candidates", "top_labels_recall"} <= set(info)
    assert 0 < info["tree_recall"] <= 1 and info["mean_depth"] <= 3
    assert main(["train", train, "--out", model, "--tree", tree, "--k", "8", "--max-epochs", "5",
                 "--scheduler", scheduler]) == 0
    assert main(["predict", model, test, "--out", pred, "--top-k", "3", "--no-progress",
                 "--scheduler", scheduler]) == 0
    capsys.readouterr()
    assert main(["evaluate", pred, test, "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["P@1"] > 1 / 30
    # the text form: weights per label shared by the leaves, a bias per leaf and candidate
    per_label, pred2 = str(tmp_path / "per-label.zarr"), str(tmp_path / "pred2.zarr")
    assert main(["train", train, "--out", per_label, "--tree", tree, "--form", "per_label", "--max-epochs", "5",
                 "--scheduler", scheduler, "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["params"]["form"] == "per_label"
    assert main(["predict", per_label, test, "--out", pred2, "--top-k", "3", "--no-progress",
                 "--scheduler", scheduler]) == 0
    capsys.readouterr()
    assert main(["evaluate", pred2, test, "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["P@1"] > 1 / 30
    assert main(["train", train, "--out", str(tmp_path / "m3.zarr"), "--tree-form", "per_label"]) == 2  # former name
    assert "form do(es) not apply with model=auto" in capsys.readouterr().err
    # refusals before any pass: an existing store, a bad depth, data of another feature count
    assert main(["tree", train, "--out", tree]) == 2
    assert "already exists" in capsys.readouterr().err
    assert main(["tree", train, "--out", str(tmp_path / "t2.zarr"), "--depth", "0"]) == 2
    assert "invalid tree parameters: max_depth = 0" in capsys.readouterr().err
    other = str(tmp_path / "other.zarr")
    assert main(["synth", "--out", other, "--n-samples", "100", "--n-features", "150", "--n-labels", "30",
                 "--multiclass", "--no-progress"]) == 0
    assert main(["tree-info", tree, other]) == 2
    assert "150 features" in capsys.readouterr().err


def test_candidate_scorer_is_the_classifier_restricted_to_the_leaf():
    from xmldask.models import EmbeddingClassifier
    from xmldask.models.tree_classifier import CandidateScorer

    Xd, Yd = _clustered(seed=6)
    X, Y = _dask(Xd, Yd)
    tree = SpectralLabelTree(max_depth=2, leaf_labels=5, random_state=0).fit(X, Y)
    clf = EmbeddingClassifier(embedding="rembrandt", n_components=6, kernel="none", max_epochs=3,
                              random_state=0).fit(X, Y)
    labels, scores = (a.compute() for a in CandidateScorer(tree, clf).predict_topk(X, k=2))
    S = clf.decision_function(X).compute()
    leaf = tree.route(X).compute()
    for i in range(0, len(leaf), 37):
        cands = tree.candidates(leaf[i])
        best = cands[np.argsort(-S[i, cands], kind="stable")[:2]]
        np.testing.assert_array_equal(labels[i, :len(best)], best)
        np.testing.assert_allclose(scores[i, :len(best)], S[i, best], rtol=1e-4, atol=1e-5)
    from xmldask.models import EnsembleClassifier

    ensemble = EnsembleClassifier(clf, n_estimators=2, random_state=0).fit(X, Y)
    with pytest.raises(TypeError, match="pass one of its estimators_"):
        CandidateScorer(tree, ensemble).predict_topk(X, k=2)


def test_job_refuses_a_label_without_training_rows_before_any_pass_or_grows_without_it(tmp_path):
    from xmldask import jobs
    from xmldask.io import ingest

    src = tmp_path / "train.txt"
    src.write_text("4 3 5\n0 0:1 1:2\n1 1:1\n2,3 0:1 2:1\n0 2:3\n")  # label 4 has no row
    data = str(tmp_path / "train.zarr")
    ingest([str(src)], data)
    out = str(tmp_path / "tree.zarr")
    with pytest.raises(ValueError, match="1 labels with no training example.*unseen_labels='ignore'"):
        jobs.tree(data, out, depth=2, leaf_labels=2, unseen_labels="error")
    assert jobs.tree(data, out, depth=2, leaf_labels=2)["n_unseen_labels"] == 1  # the default: counted, ignored
    import shutil

    shutil.rmtree(out)
    with pytest.raises(ValueError, match="invalid tree parameters: max_depth = 0: Input should be greater than 0"):
        jobs.tree(data, out, depth=0)
    with pytest.raises(ValueError, match="unseen_labels = 'drop': Input should be 'error' or 'ignore'"):
        jobs.tree(data, out, depth=2, unseen_labels="drop")
    import os

    assert not os.path.exists(out)
    grown = jobs.tree(data, out, depth=2, leaf_labels=2, unseen_labels="ignore")
    assert grown["n_unseen_labels"] == 1
    tree = SpectralLabelTree.load(out)
    assert 4 not in tree.cand_indices_ and set(tree.cand_indices_) <= {0, 1, 2, 3}


def test_tree_jobs_hold_small_training_rows_in_memory(tmp_path, monkeypatch):
    """The tree job and the tree classifier's job fit on persisted rows when they are small (no store reader),
    and make what reading the store at every pass makes."""
    from xmldask import jobs
    from xmldask.datasets import make_synthetic
    from xmldask.models.tree_classifier import TreeClassifier
    from xmldask.store.csr import block_reader

    train = make_synthetic(str(tmp_path / "train.zarr"), n_samples=900, n_features=60, n_labels=12, seed=3,
                           block_rows=300).url
    from_store = []
    for cls in (SpectralLabelTree, TreeClassifier):
        monkeypatch.setattr(cls, "fit", lambda self, X, Y, _fit=cls.fit: from_store.append(
            block_reader(X) is not None) or _fit(self, X, Y))
    trees, models = [], []
    for share in (jobs.IN_MEMORY_SHARE, 0.0):
        monkeypatch.setattr(jobs, "IN_MEMORY_SHARE", share)
        tree = jobs.tree(train, str(tmp_path / f"tree-{share}.zarr"), depth=3, leaf_labels=3, seed=0)["tree"]
        model = jobs.train(train, str(tmp_path / f"clf-{share}.zarr"), tree=tree, k=4, max_epochs=2)["model"]
        trees.append(SpectralLabelTree.load(tree))
        models.append(TreeClassifier.load(model))
    assert from_store == [False, False, True, True]
    np.testing.assert_allclose(trees[0].W_.toarray(), trees[1].W_.toarray(), rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(trees[0].cand_indices_, trees[1].cand_indices_)
    np.testing.assert_allclose(models[0].U_, models[1].U_, rtol=1e-5, atol=1e-6)


def test_memory_budget_follows_the_workers_memory_limit():
    assert default_memory_budget() == MEMORY_BUDGET  # no cluster
    with cluster(n_workers=1, threads_per_worker=1, processes=False, memory_limit="256MiB", dashboard_address=None):
        assert default_memory_budget() == int(256 * 2**20 * WORKER_MEMORY_SHARE)
    with cluster(n_workers=1, threads_per_worker=1, processes=False, memory_limit="64GiB", dashboard_address=None):
        assert default_memory_budget() == MEMORY_BUDGET


def test_tree_classifier_logs_a_line_a_pass(caplog):
    from xmldask.models.tree_classifier import TreeClassifier

    Xd, Yd = _clustered()
    X, Y = _dask(Xd, Yd)
    tree = SpectralLabelTree(max_depth=2, leaf_labels=3, random_state=0).fit(X, Y)
    with caplog.at_level("INFO", logger="xmldask.models.tree_classifier"):
        model = TreeClassifier(tree, n_components=4, max_epochs=3, random_state=0).fit(X, Y)
    lines = [r.getMessage() for r in caplog.records if r.name == "xmldask.models.tree_classifier"]
    assert [line.split(":")[0] for line in lines] == [f"tree classifier pass {i} of 3" for i in (1, 2, 3)]
    assert f"loss {model.history_[-1]['loss']:.4f}" in lines[-1]


def test_tree_classifier_backs_off_a_diverging_step_and_converges(caplog):
    """A step size far too large (the text data's failure: the loss grew by orders of magnitude, saved with exit
    0): a pass whose loss exceeds DIVERGENCE_FACTOR times the best goes back to the weights the best pass started
    from, with half the step, logged, until the passes converge; the fitted loss is finite and below the first
    pass's."""
    from xmldask.models import tree_classifier as TC

    Xd, Yd = _clustered(seed=4)
    X, Y = _dask(Xd, Yd)
    tree = SpectralLabelTree(max_depth=2, leaf_labels=6, random_state=0).fit(X, Y)
    with caplog.at_level("WARNING", logger="xmldask.models.tree_classifier"):
        model = TC.TreeClassifier(tree, n_components=6, max_epochs=25, learning_rate=40.0, momentum=0.9,
                                  validation_fraction=0, random_state=0).fit(X, Y)  # every pass: the back-offs
    losses = [h["loss"] for h in model.history_]
    backoffs = [h["epoch"] for h in model.history_ if h.get("backoff")]
    assert backoffs, losses  # the step diverged at first ...
    warned = [r.getMessage().split(" (")[0] for r in caplog.records
              if r.name == "xmldask.models.tree_classifier" and r.levelname == "WARNING"]
    assert warned == [f"tree classifier pass {e} diverged" for e in backoffs]
    rates = [h["learning_rate"] for h in model.history_]
    assert rates[-1] < 40.0 / 2 ** len(backoffs) * 1.0001
    assert np.isfinite(model.V_).all() and np.isfinite(model.U_).all()
    assert losses[-1] is not None and losses[-1] < losses[0]  # ... and converged
    best_before = min(x for x in losses[:backoffs[-1] - 1] if x is not None)
    assert losses[-1] <= TC.DIVERGENCE_FACTOR * best_before


def test_tree_classifier_that_diverges_at_every_step_size_stops_with_the_numbers(monkeypatch):
    from xmldask.models import tree_classifier as TC

    Xd, Yd = _clustered(seed=4)
    X, Y = _dask(Xd, Yd)
    tree = SpectralLabelTree(max_depth=2, leaf_labels=6, random_state=0).fit(X, Y)
    monkeypatch.setattr(TC, "DIVERGENCE_FACTOR", 0.0)  # every pass "diverges"
    with pytest.raises(FloatingPointError, match=r"diverged: pass 11's training loss .* after 10 halvings"):
        TC.TreeClassifier(tree, n_components=6, max_epochs=30, random_state=0).fit(X, Y)


def test_tree_classifier_time_budget_stops_the_passes(monkeypatch):
    """No pass starts that would end past the budget (judged by the longest pass so far); the passes made are the
    unbudgeted fit's first ones."""
    from types import SimpleNamespace

    from xmldask.models import tree_classifier as TC

    Xd, Yd = _clustered(seed=4)
    X, Y = _dask(Xd, Yd)
    tree = SpectralLabelTree(max_depth=2, leaf_labels=6, random_state=0).fit(X, Y)
    clock = SimpleNamespace(now=0.0)

    def tick():  # every reading one second later
        clock.now += 1.0
        return clock.now

    monkeypatch.setattr(TC, "time", SimpleNamespace(perf_counter=tick))
    full = TC.TreeClassifier(tree, n_components=6, max_epochs=12, random_state=0).fit(X, Y)
    cut = TC.TreeClassifier(tree, n_components=6, max_epochs=12, random_state=0, time_budget=12).fit(X, Y)
    assert cut.history_[-1]["stopped"] == "time_budget" and 1 <= len(cut.history_) < len(full.history_)
    assert [h["loss"] for h in cut.history_] == [h["loss"] for h in full.history_[:len(cut.history_)]]
    one = TC.TreeClassifier(tree, n_components=6, max_epochs=12, random_state=0, time_budget=0.1).fit(X, Y)
    assert len(one.history_) == 1  # at least one pass
    with pytest.raises(ValueError, match="time_budget"):
        TC.TreeClassifier(tree, time_budget=0).fit(X, Y)


def test_tree_classifier_early_stops_on_held_out_rows_and_keeps_the_best_pass():
    """The passes stop after n_iter_no_change without a better held-out P@1; the weights kept are the best pass's
    (its P@1 recomputed on the same held-out rows by predict_topk); no held-out row is trained on."""
    from xmldask.models import tree_classifier as TC
    from xmldask.models._graph import HeldOut

    Xd, Yd = _clustered(seed=4)
    X, Y = _dask(Xd, Yd)
    tree = SpectralLabelTree(max_depth=2, leaf_labels=6, random_state=0).fit(X, Y)
    model = TC.TreeClassifier(tree, n_components=6, max_epochs=60, n_iter_no_change=3, validation_fraction=0.2,
                              random_state=0).fit(X, Y)
    scores = [h["val_p@1"] for h in model.history_]
    assert model.history_[-1]["stopped"] == "n_iter_no_change" and len(scores) < 60
    best = int(np.argmax(scores))  # the first of the best
    assert model.best_epoch_ == best + 1 and len(scores) == best + 1 + 3
    assert model.held_out_["p@1"] == scores[best] and model.held_out_["rows"] > 0
    split = HeldOut(0, 0.2, tuple(X.chunks[0]))
    held = np.concatenate([split.mask(i) for i in range(X.numblocks[0])])
    assert held.sum() == model.held_out_["rows"]
    labels, _ = (a.compute() for a in model.predict_topk(Xd[held].astype(np.float32), k=1))
    assert np.mean(Yd[held][np.arange(held.sum()), labels[:, 0]] > 0) == pytest.approx(scores[best])
    # the held-out rows are not trained on: other labels there change the held-out scores, not the passes
    Yd2 = Yd.copy()
    Yd2[held] = np.roll(Yd2[held], 1, axis=1)
    kw = dict(n_components=6, max_epochs=4, n_iter_no_change=10, validation_fraction=0.2, random_state=0)
    other = TC.TreeClassifier(tree, **kw).fit(*_dask(Xd, Yd2))
    same = TC.TreeClassifier(tree, **kw).fit(X, Y)
    assert [h["loss"] for h in other.history_] == pytest.approx([h["loss"] for h in same.history_], rel=1e-6)
    assert [h["val_p@1"] for h in other.history_] != [h["val_p@1"] for h in same.history_]
    with pytest.raises(ValueError, match="validation_fraction"):
        TC.TreeClassifier(tree, validation_fraction=0.9).fit(X, Y)
