"""GradFac and the boosting baselines against plain in-memory NumPy references."""

from __future__ import annotations

import dask.array as da
import numpy as np
import pytest
import scipy.sparse as sp

from xmldask.models import GradFac, GradFacEN, MultinomialBoosting, OneVsRestBoosting, load_model
from xmldask.models import _boost_kernels as BK
from xmldask.models import gradfac as gradfac_module

CHUNKS = (23, 40, 17, 30)  # uneven row blocks, 110 rows


def _data(seed=0, n=110, d=5, K=4, dtype=np.float32, sparse=False):
    """Classes that depend on the features (learnable), some values repeated (ties in the bins)."""
    rng = np.random.default_rng(seed)
    X = rng.standard_normal((n, d))
    X[:, 0] = np.round(X[:, 0])  # few distinct values
    y = (np.argmax(X[:, :K] + 0.3 * rng.standard_normal((n, K)), axis=1)).astype(np.int64)
    X = X.astype(dtype)
    return (sp.csr_matrix(X) if sparse else X), y


def _dask_rows(X, chunks=CHUNKS):
    return da.from_array(X, chunks=(chunks, -1), asarray=False, fancy=False)


def _labels(y, K):
    return sp.csr_matrix((np.ones(len(y), np.float32), (np.arange(len(y)), y)), shape=(len(y), K))


# ---------------------------------------------------------------------------------------------
# the reference: plain NumPy, whole matrices, brute-force splits


def _ref_tree(bins, G, H, n_borders, depth, l2):
    """An oblivious tree by brute force: every (feature, border) of every level scored over all rows."""
    n, d = bins.shape
    leaf = np.zeros(n, np.int64)
    features, borders = [], []
    for _ in range(depth):
        best = (-np.inf, 0, 0)
        for f in range(d):
            for b in range(n_borders[f]):
                child = leaf * 2 + (bins[:, f] > b)
                gain = 0.0
                for c in np.unique(child):
                    rows = child == c
                    gain += G[rows].sum() ** 2 / (H[rows].sum() + l2)
                # a leaf with no rows adds 0, as in the histogram form
                if gain > best[0] + 1e-12:
                    best = (gain, f, b)
        features.append(best[1])
        borders.append(best[2])
        leaf = leaf * 2 + (bins[:, best[1]] > best[2])
    values = np.zeros(1 << depth)
    for c in range(1 << depth):
        rows = leaf == c
        values[c] = G[rows].sum() / (H[rows].sum() + l2)
    return values[leaf]


def _ref_boost(bins, y, K, n_borders, *, rounds, lr, depth, l2, method):
    n = len(y)
    S = np.zeros((n, K))
    Y = np.eye(K)[y]
    for _ in range(rounds):
        P = np.exp(S - S.max(1, keepdims=True))
        P /= P.sum(1, keepdims=True)
        R = Y - P
        if method == "gradfac":
            v = np.linalg.svd(R, full_matrices=False)[2][0]
            u = R @ v
            h = P @ (v * v) - (P @ v) ** 2
            S += lr * np.outer(_ref_tree(bins, u, h, n_borders, depth, l2), v)
        else:
            S += lr * np.column_stack([_ref_tree(bins, R[:, j], P[:, j] * (1 - P[:, j]), n_borders, depth, l2)
                                       for j in range(K)])
    return S


# ---------------------------------------------------------------------------------------------
# kernels


def test_borders_and_bins_agree_with_the_raw_values():
    rng = np.random.default_rng(3)
    X = rng.standard_normal((300, 3))
    X[:, 1] = rng.integers(0, 5, 300)  # 5 distinct values: every one its own bin
    X[rng.random((300, 3)) < 0.3] = 0.0
    borders = BK.quantile_borders(sp.csr_matrix(X), max_bins=16)
    assert [len(b) <= 15 for b in borders] == [True] * 3
    np.testing.assert_allclose(borders[1], [0.5, 1.5, 2.5, 3.5])
    bins = BK.bin_block(sp.csr_matrix(X), borders)
    for f, cut in enumerate(borders):
        for b in range(len(cut)):  # the split rule on codes is the split rule on values
            np.testing.assert_array_equal(bins[:, f] > b, X[:, f] > cut[b])
    counts = np.bincount(bins[:, 0], minlength=16)
    zero_bin = np.searchsorted(borders[0], 0.0)
    assert counts[zero_bin] >= (X[:, 0] == 0).sum()  # one value is never cut, however many rows hold it
    assert np.delete(counts, zero_bin).max() <= 2 * 300 / 16  # the other bins: about equal counts


def test_histograms_and_best_split_match_brute_force():
    rng = np.random.default_rng(4)
    bins = rng.integers(0, 6, (50, 3)).astype(np.uint8)
    T = np.column_stack([rng.standard_normal((50, 2)), rng.random((50, 2))]).astype(np.float32)
    held = rng.random(50) < 0.2
    T[held] = 0  # as the targets kernel writes them
    features, borders = np.array([[1], [2]]), np.array([[2], [0]])
    hist = BK.histograms(bins, T, features=features, borders=borders, n_bins=6).reshape(2, 2, 2, 3, 6)
    leaf = BK.leaves(bins, features, borders)
    for j in range(2):
        for c in range(2):
            for f in range(3):
                for b in range(6):
                    rows = ~held & (leaf[:, j] == c) & (bins[:, f] == b)
                    assert hist[0, j, c, f, b] == pytest.approx(T[rows, j].sum(), abs=1e-5)
                    assert hist[1, j, c, f, b] == pytest.approx(T[rows, 2 + j].sum(), abs=1e-5)
    f, b, gain = BK.best_splits(hist, np.array([5, 5, 5]), 1.0)
    for j in range(2):
        def part(c, ff, bb, side, column, j=j):
            return T[~held & (leaf[:, j] == c) & ((bins[:, ff] <= bb) == side), column].sum()

        best = max(((sum(part(c, ff, bb, side, j) ** 2 / (part(c, ff, bb, side, 2 + j) + 1)
                         for c in range(2) for side in (True, False)), ff, bb)
                    for ff in range(3) for bb in range(5)), key=lambda t: t[0])
        assert gain[j] == pytest.approx(best[0])
        assert (f[j], b[j]) == (best[1], best[2])


# ---------------------------------------------------------------------------------------------
# whole models against the reference


@pytest.mark.parametrize("cls,method", [(GradFac, "gradfac"), (MultinomialBoosting, "mll")])
def test_boosting_matches_the_numpy_reference(cls, method):
    X, y = _data()
    model = cls(rounds=4, learning_rate=0.5, max_depth=2, max_bins=8, validation_fraction=0.0,
                block_rows=30, random_state=0).fit(X, y)
    bins = BK.bin_block(X, model.borders_)
    ref = _ref_boost(bins, y, 4, [len(b) for b in model.borders_], rounds=4, lr=0.5, depth=2, l2=1.0, method=method)
    np.testing.assert_allclose(model.decision_function(X).compute(), ref, rtol=2e-4, atol=2e-5)


def test_gradfac_v_is_the_top_right_singular_vector_and_power_steps_find_it(monkeypatch):
    X, _ = _data(K=4)
    y = np.random.default_rng(0).choice(4, size=len(X), p=[0.6, 0.25, 0.1, 0.05])  # distinct singular values
    model = GradFac(rounds=3, max_depth=2, validation_fraction=0.0, random_state=0).fit(X, y)
    exact = model.vectors_.copy()
    monkeypatch.setattr(gradfac_module, "EXACT_GRAM_CLASSES", 1)  # power steps instead
    power = GradFac(rounds=3, max_depth=2, validation_fraction=0.0, power_iter=30, random_state=0).fit(X, y)
    np.testing.assert_allclose(power.vectors_, exact, atol=1e-4)
    assert model.history_[1]["factor_error"] is not None
    R = np.eye(4)[y] - np.full((len(y), 4), 0.25)  # the residuals of the first round (scores 0)
    v = np.linalg.svd(R)[2][0]
    v = -v if v[np.argmax(np.abs(v))] < 0 else v
    np.testing.assert_allclose(exact[0], v, atol=1e-6)


@pytest.mark.parametrize("cls", [GradFac, GradFacEN, MultinomialBoosting, OneVsRestBoosting])
def test_dask_row_blocks_give_the_in_memory_model(cls):
    X, y = _data(sparse=True)
    kwargs = dict(rounds=3, max_depth=3, max_bins=8, validation_fraction=0.2, n_iter_no_change=5, random_state=1)
    local = cls(block_rows=30, **kwargs).fit(X[:110], y)
    Xd = _dask_rows(X, chunks=(30, 30, 30, 20))
    lazy = cls(backend="dask", **kwargs).fit(Xd, _dask_rows(_labels(y, 4), chunks=(30, 30, 30, 20)))
    auto = cls(**kwargs).fit(Xd, _dask_rows(_labels(y, 4), chunks=(30, 30, 30, 20)))  # small: in process
    np.testing.assert_array_equal(auto.values_, local.values_)
    np.testing.assert_array_equal(local.features_, lazy.features_)
    np.testing.assert_allclose(local.values_, lazy.values_, rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(local.decision_function(X).compute(), lazy.decision_function(Xd).compute(),
                               rtol=1e-5, atol=1e-6)
    assert lazy.n_passes_ == local.n_passes_


@pytest.mark.parametrize("cls", [GradFac, GradFacEN, MultinomialBoosting, OneVsRestBoosting])
def test_each_model_learns_far_above_the_majority_class(cls):
    X, y = _data(n=600, seed=2)
    model = cls(rounds=30, learning_rate=0.3, random_state=0).fit(X[:500], y[:500])
    acc = (model.predict(X[500:]).compute() == y[500:]).mean()
    assert acc > 0.7 > np.bincount(y[500:]).max() / 100
    labels, probs = model.predict_topk(X[500:], k=2)
    labels, probs = labels.compute(), probs.compute()
    assert (probs[:, 0] >= probs[:, 1]).all() and (labels[:, 0] == model.predict(X[500:]).compute()).all()
    np.testing.assert_allclose(model.predict_proba(X[500:]).compute().sum(axis=1), 1, rtol=1e-5)


def test_gradfac_trees_per_round_and_staged_prediction():
    X, y = _data()
    gf = GradFac(rounds=5, validation_fraction=0.0, max_depth=2).fit(X, y)
    mll = MultinomialBoosting(rounds=5, validation_fraction=0.0, max_depth=2).fit(X, y)
    assert len(gf.values_) == 5 and len(mll.values_) == 5 * 4
    first = gf.decision_function(X, trees=2).compute()
    again = GradFac(rounds=2, validation_fraction=0.0, max_depth=2).fit(X, y).decision_function(X).compute()
    np.testing.assert_allclose(first, again, rtol=1e-6, atol=1e-7)


def test_early_stopping_keeps_the_best_round():
    X, y = _data(n=300, seed=5)
    model = GradFac(rounds=200, learning_rate=1.0, validation_fraction=0.3, n_iter_no_change=3).fit(X, y)
    losses = [h["val_loss"] for h in model.history_]
    assert len(model.history_) < 201
    assert model.rounds_ == int(np.argmin(losses)) and len(model.values_) == model.rounds_


def test_save_load_round_trip(tmp_path):
    X, y = _data()
    for cls in (GradFacEN, OneVsRestBoosting):
        model = cls(rounds=3, max_depth=2, random_state=0).fit(X, y)
        url = str(tmp_path / cls.__name__)
        model.save(url)
        again = load_model(url)
        assert type(again) is cls and again.get_params() == model.get_params()
        np.testing.assert_array_equal(again.decision_function(X).compute(), model.decision_function(X).compute())


# ---------------------------------------------------------------------------------------------
# bad input: clear errors before any pass


def test_bad_input_is_refused_before_any_pass():
    X, y = _data()
    Y = _labels(y, 4).tolil()
    Y[7, 2] = 1.0 if y[7] != 2 else 0.0
    Y[7, 3] = 1.0
    with pytest.raises(ValueError, match="exactly one label.*row 7"):
        GradFac(rounds=2).fit(X, sp.csr_matrix(Y))
    Xn = X.copy()
    Xn[42, 1] = np.nan
    with pytest.raises(ValueError, match="non-finite.*row 42"):
        GradFac(rounds=2, backend="dask").fit(_dask_rows(Xn), y)
    for bad in (0, -3, 2.5, True):
        with pytest.raises(ValueError, match="rounds must be an integer of at least 1"):
            GradFac(rounds=bad).fit(X, y)
    with pytest.raises(ValueError, match="at least 2 classes"):
        GradFac().fit(X, np.zeros(len(y), int))


# ---------------------------------------------------------------------------------------------
# the command line: train --model gradfac|gfen|mll|ovr on a dataset store, predict, evaluate


def test_cli_train_predict_evaluate(tmp_path, capsys, scheduler):
    import json

    from xmldask.cli import main
    from xmldask.store import DatasetWriter, open_dataset, to_scipy

    X, y = _data(n=300, seed=6)
    url = str(tmp_path / "data.zarr")
    with DatasetWriter.create(url, block_rows=70) as w:
        w.write(sp.csr_matrix(X), _labels(y, 4))
        w.commit(n_features=X.shape[1], n_labels=4)
    for name, cls in (("gradfac", GradFac), ("mll", MultinomialBoosting)):
        model = str(tmp_path / f"{name}.zarr")
        assert main(["train", url, "--out", model, "--model", name, "--rounds", "20", "--depth", "3", "--json",
                     "--scheduler", scheduler]) == 0
        trained = json.loads(capsys.readouterr().out)
        assert trained["task"] == "multiclass" and trained["params"]["rounds"] == 20
        est = load_model(model)
        assert type(est) is cls and est.max_depth == 3
        pred = str(tmp_path / f"{name}-pred.zarr")
        assert main(["predict", model, url, "--out", pred, "--top-k", "3", "--no-progress",
                     "--scheduler", scheduler]) == 0
        capsys.readouterr()
        assert main(["evaluate", pred, url, "--json"]) == 0
        res = json.loads(capsys.readouterr().out)
        expected = (est.predict(to_scipy(open_dataset(url).X)).compute() == y).mean()
        assert res["Acc@1"] == pytest.approx(expected) and res["Acc@1"] > 0.7
    # the depth not given: chosen by held-out loss (the grid 6, 10 extended while it wins, at most 12)
    searched = str(tmp_path / "searched.zarr")
    assert main(["train", url, "--out", searched, "--model", "gradfac", "--rounds", "5", "--json",
                 "--scheduler", scheduler]) == 0
    trained = json.loads(capsys.readouterr().out)
    tried = [r["params"]["max_depth"] for r in trained["search"]]
    assert tried[:2] == [6, 10] and max(tried) <= 12
    best = max(trained["search"], key=lambda r: r["score"])["params"]["max_depth"]
    assert trained["params"]["max_depth"] == best == load_model(searched).max_depth
    assert main(["train", url, "--out", str(tmp_path / "bad"), "--model", "gradfac", "--rounds", "0"]) != 0
    assert "rounds = 0: Input should be greater than 0" in capsys.readouterr().err
    assert main(["train", url, "--out", str(tmp_path / "bad2"), "--model", "gradfac", "--k", "5"]) != 0
    assert "do(es) not apply with model=gradfac" in capsys.readouterr().err


def test_bench_quick_runs_and_writes_its_rows(tmp_path, shared_data):
    """``bench/gradfac.py --quick`` as a user runs it: the table and the JSON rows with the paper's figures."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    if not (shared_data / "uci" / "wine").exists():
        pytest.skip("no UCI data")
    out = tmp_path / "rows.json"
    root = Path(__file__).resolve().parents[1]
    done = subprocess.run([sys.executable, str(root / "bench" / "gradfac.py"), "--quick", "--methods", "mll", "gradfac",
                           "--json", str(out)], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "XMLDASK_SHARED_DATA": str(shared_data)})
    assert done.returncode == 0, done.stderr
    rows = json.loads(out.read_text())
    assert [r["method"] for r in rows] == ["mll", "gradfac"]
    for r in rows:
        assert r["paper_micro_f1"] in (0.949, 0.948) and 0.5 < r["micro_f1"] <= 1 and r["folds"] == 2
    assert "| wine |" in done.stdout


def test_scratch_state_gives_the_same_model_and_is_removed(tmp_path):
    """The Dask state written to Zarr arrays between passes (``scratch``) gives the in-memory model;
    nothing is left in the scratch directory after the fit."""
    X, y = _data(sparse=True)
    kwargs = dict(rounds=3, max_depth=3, max_bins=8, validation_fraction=0.2, random_state=1)
    local = GradFac(block_rows=30, **kwargs).fit(X, y)
    Xd = _dask_rows(X, chunks=(30, 30, 30, 20))
    spilled = GradFac(backend="dask", scratch=str(tmp_path), **kwargs).fit(Xd, y)
    np.testing.assert_allclose(spilled.values_, local.values_, rtol=1e-5, atol=1e-7)
    assert list(tmp_path.iterdir()) == []
    with pytest.raises(ValueError, match="scratch needs row blocks of one size"):
        GradFac(backend="dask", scratch=str(tmp_path), **kwargs).fit(_dask_rows(X), y)


def test_histogram_subtraction_gives_the_full_histograms():
    rng = np.random.default_rng(8)
    bins = rng.integers(0, 7, (90, 4)).astype(np.uint8)
    T = rng.random((90, 6)).astype(np.float32)
    F, B = rng.integers(0, 4, (3, 3)), rng.integers(0, 6, (3, 3))
    full = BK.histograms(bins, T, features=F, borders=B, n_bins=7).reshape(2, 3, 8, 4, 7)
    parent = BK.histograms(bins, T, features=F[:, :2], borders=B[:, :2], n_bins=7).reshape(2, 3, 4, 4, 7)
    right = BK.histograms(bins, T, features=F, borders=B, n_bins=7, right_only=True).reshape(2, 3, 4, 4, 7)
    np.testing.assert_allclose(BK.children(parent, right), full, atol=1e-9)


def test_time_budget_stops_the_rounds_and_keeps_the_rounds_made(monkeypatch):
    from xmldask.base import BudgetError

    class Clock:
        """Every reading one second later: a round takes 2 s (its start and its end are read)."""

        now = 0.0

        def perf_counter(self):
            self.now += 1.0
            return self.now

    monkeypatch.setattr(gradfac_module, "time", Clock())
    X, y = _data(n=300, seed=5)
    opts = dict(rounds=30, learning_rate=0.3, validation_fraction=0.3, n_iter_no_change=100, random_state=0)
    full = GradFac(**opts).fit(X, y)
    cut = GradFac(**opts, time_budget=20).fit(X, y)
    assert cut.history_[-1]["stopped"] == "time_budget" and len(cut.history_) < len(full.history_)
    assert 0 < cut.rounds_ <= len(cut.history_)
    n = min(len(cut.values_), len(full.values_))
    np.testing.assert_array_equal(cut.values_[:n], full.values_[:n])  # the same rounds, fewer of them
    with pytest.raises(BudgetError, match="ended before the first round"):
        GradFac(**opts, time_budget=0.5).fit(X, y)
    with pytest.raises(ValueError, match="time_budget"):
        GradFac(**opts, time_budget=-1).fit(X, y)
