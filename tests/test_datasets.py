"""Tests of the synthetic XMC generator (xmldask.datasets) and the XC text writer (xmldask.io.xc_writer)."""

from __future__ import annotations

import gzip
import os

import numpy as np
import pytest
import scipy.sparse as sp

import xmldask
from xmldask.datasets import CHUNK_ROWS, iter_synthetic, make_synthetic, write_synthetic_text
from xmldask.io.transforms import transform_rows
from xmldask.io.xc_writer import write_xc, xc_lines
from xmldask.store import to_scipy

SMALL = {"n_samples": 2 * CHUNK_ROWS + 1234, "n_features": 3000, "n_labels": 400}


def generate(**kwargs) -> tuple[sp.csr_matrix, sp.csr_matrix]:
    pieces = list(iter_synthetic(**kwargs))
    return sp.vstack([x for x, _ in pieces], format="csr"), sp.vstack([y for _, y in pieces], format="csr")


def assert_same(A: sp.spmatrix, B: sp.spmatrix) -> None:
    A, B = sp.csr_matrix(A), sp.csr_matrix(B)
    assert A.shape == B.shape
    np.testing.assert_array_equal(A.indptr, B.indptr)
    np.testing.assert_array_equal(A.indices, B.indices)
    np.testing.assert_array_equal(A.data, B.data)


def differ(A: sp.spmatrix, B: sp.spmatrix) -> bool:
    return A.shape != B.shape or (A != B).nnz > 0


@pytest.fixture(scope="module")
def small():
    return generate(**SMALL, seed=7)


# ---------------------------------------------------------------------------------------------- determinism


def test_same_seed_gives_same_matrices(small):
    X, Y = generate(**SMALL, seed=7)
    assert_same(X, small[0])
    assert_same(Y, small[1])


def test_splits_and_seeds_give_other_rows(small):
    X_test, Y_test = generate(**SMALL, seed=7, split="test")
    X_other, Y_other = generate(**SMALL, seed=8)
    assert differ(X_test, small[0]) and differ(Y_test, small[1])
    assert differ(X_other, small[0]) and differ(Y_other, small[1])


def test_splits_share_the_model_seeds_do_not(small):
    # the label (and feature) frequency profile is a property of the model: the same seed gives the
    # same frequent ids in every split; another seed permutes the ids differently
    freq = {name: np.asarray(Y.sum(axis=0)).ravel() for name, Y in (
        ("train", small[1]),
        ("test", generate(**SMALL, seed=7, split="test")[1]),
        ("other", generate(**SMALL, seed=8)[1]),
    )}
    same = np.corrcoef(freq["train"], freq["test"])[0, 1]
    other = np.corrcoef(freq["train"], freq["other"])[0, 1]
    assert same > 0.95, same
    assert abs(other) < 0.5, other


def test_pieces_are_internal_chunks(small):
    sizes = [x.shape[0] for x, _ in iter_synthetic(**SMALL, seed=7)]
    assert sizes == [CHUNK_ROWS, CHUNK_ROWS, 1234]


# ---------------------------------------------------------------------------------------------- structure


def check_csr(M: sp.csr_matrix, n_rows: int, n_cols: int) -> None:
    assert isinstance(M, sp.csr_matrix)
    assert M.shape == (n_rows, n_cols)
    assert M.dtype == np.float32
    assert M.indices.min() >= 0 and M.indices.max() < n_cols
    rows = np.repeat(np.arange(n_rows), np.diff(M.indptr))
    keys = rows.astype(np.int64) * n_cols + M.indices
    assert np.all(np.diff(keys) > 0), "indices must be sorted within rows, without duplicates"
    assert np.all(M.data > 0)


@pytest.mark.parametrize("multiclass", [False, True])
def test_shapes_dtypes_and_entries(multiclass):
    n, d, L = 9000, 1500, 200
    pieces = list(iter_synthetic(n_samples=n, n_features=d, n_labels=L, multiclass=multiclass, seed=3))
    for X, Y in pieces:
        check_csr(X, X.shape[0], d)
        check_csr(Y, X.shape[0], L)
        assert X.has_canonical_format and Y.has_canonical_format
    X, Y = sp.vstack([x for x, _ in pieces], format="csr"), sp.vstack([y for _, y in pieces], format="csr")
    assert X.shape == (n, d) and Y.shape == (n, L)
    assert np.all(np.diff(X.indptr) >= 1)
    np.testing.assert_array_equal(Y.data, 1.0)
    np.testing.assert_array_equal(X.data, np.round(X.data))  # term counts
    labels_per_row = np.diff(Y.indptr)
    if multiclass:
        np.testing.assert_array_equal(labels_per_row, 1)
    else:
        assert labels_per_row.min() >= 1
        assert 2.0 < labels_per_row.mean() < 3.0  # 1 + Poisson(2) draws, minus repeats
    assert 12.0 < X.nnz / n < 20.0  # Poisson(20) tokens, minus repeats


def test_rank_can_equal_sizes_and_single_column():
    X, Y = generate(n_samples=50, n_features=1, n_labels=1, rank=1, seed=0)
    np.testing.assert_array_equal(X.indices, 0)
    np.testing.assert_array_equal(Y.toarray(), 1.0)
    X, Y = generate(n_samples=300, n_features=40, n_labels=8, rank=8, multiclass=True, background=0.0)
    check_csr(X, 300, 40)
    check_csr(Y, 300, 8)


# ---------------------------------------------------------------------------------------------- statistics


def loglog_slope(counts: np.ndarray, lo: int, hi: int) -> float:
    """Slope of log(frequency) against log(rank) over the ranks lo..hi (1-based) of sorted counts."""
    ranks = np.arange(lo, hi + 1)
    return float(np.polyfit(np.log(ranks), np.log(counts[lo - 1 : hi]), 1)[0])


@pytest.fixture(scope="module")
def medium():
    return generate(n_samples=30000, n_features=20000, n_labels=2000, seed=11)


def test_label_frequencies_are_heavy_tailed(medium):
    _, Y = medium
    counts = np.sort(np.asarray(Y.sum(axis=0)).ravel())[::-1]
    assert counts[199] > 0
    head, body = loglog_slope(counts, 1, 100), loglog_slope(counts, 20, 200)
    share = counts[:20].sum() / counts.sum()  # the top 1% of the labels
    msg = f"head slope {head:.2f}, body slope {body:.2f}, top-1% share {share:.2f}"
    assert -1.6 < head < -0.4, msg
    assert -2.0 < body < -0.6, msg
    assert share > 0.2, msg
    # a long tail: most labels are much rarer than the average label
    assert np.median(counts) < 0.5 * counts.mean(), (np.median(counts), counts.mean())


def test_feature_frequencies_are_zipf_like(medium):
    X, _ = medium
    counts = np.sort(np.bincount(X.indices, weights=X.data, minlength=X.shape[1]))[::-1]
    head, body = loglog_slope(counts, 1, 200), loglog_slope(counts, 100, 2000)
    share = counts[:200].sum() / counts.sum()
    msg = f"head slope {head:.2f}, body slope {body:.2f}, top-1% share {share:.2f}"
    assert -1.5 < head < -0.5, msg
    assert -1.6 < body < -0.7, msg
    assert share > 0.3, msg


# ---------------------------------------------------------------------------------------------- learnability


def ridge_scores(X_train, Y_train, X_test, lam: float = 1.0) -> np.ndarray:
    """Test scores of in-memory ridge regression W = (XᵀX + λI)⁻¹ XᵀY on L2-normalised rows."""
    X_train = transform_rows(X_train, normalize="l2").astype(np.float64)
    X_test = transform_rows(X_test, normalize="l2").astype(np.float64)
    gram = (X_train.T @ X_train).toarray() + lam * np.eye(X_train.shape[1])
    W = np.linalg.solve(gram, (X_train.T @ Y_train).toarray())
    return np.asarray(X_test @ W)


@pytest.mark.parametrize("multiclass", [False, True])
def test_test_split_is_predictable(multiclass):
    kw = {"n_features": 2000, "n_labels": 500, "multiclass": multiclass, "seed": 5}
    X_train, Y_train = generate(n_samples=6000, split="train", **kw)
    X_test, Y_test = generate(n_samples=1500, split="test", **kw)
    top1 = ridge_scores(X_train, Y_train, X_test).argmax(axis=1)
    p_at_1 = float(np.asarray(Y_test[np.arange(Y_test.shape[0]), top1]).mean())
    most_frequent = int(np.asarray(Y_train.sum(axis=0)).argmax())
    baseline = float(Y_test[:, most_frequent].toarray().mean())
    what = "top-1 accuracy" if multiclass else "P@1"
    assert p_at_1 >= 2.0 * baseline, f"ridge {what} {p_at_1:.3f} vs most-frequent-label {what} {baseline:.3f}"


# ---------------------------------------------------------------------------------------------- stores


@pytest.mark.parametrize("block_rows", [1000, 7777, 65536])
def test_make_synthetic_round_trip(tmp_path, small, block_rows):
    url = str(tmp_path / "synth.zarr")
    ds = make_synthetic(url, **SMALL, seed=7, block_rows=block_rows)
    assert isinstance(ds, xmldask.Dataset)
    ds = xmldask.open_dataset(url)
    X, Y = to_scipy(ds.X), to_scipy(ds.Y)
    assert_same(X, small[0])
    assert_same(Y, small[1])
    assert (ds.n_samples, ds.n_features, ds.n_labels) == (SMALL["n_samples"], SMALL["n_features"],
                                                           SMALL["n_labels"])
    assert ds.meta["nnz"] == X.nnz and ds.meta["nnz_labels"] == Y.nnz
    assert ds.meta["rows_without_labels"] == 0
    assert ds.meta["row_blocks"][1] == min(block_rows, SMALL["n_samples"])
    np.testing.assert_array_equal(ds.label_counts, np.asarray(Y.sum(axis=0)).ravel().astype(np.int64))
    synthetic = ds.meta["synthetic"]
    assert synthetic["seed"] == 7 and synthetic["split"] == "train" and synthetic["rank"] == 32
    assert synthetic["n_samples"] == SMALL["n_samples"] and synthetic["multiclass"] is False
    assert ds.meta["sources"] == []
    assert ds.meta["transforms"] == {"normalize": "none"}


def test_make_synthetic_normalizes_and_refuses_to_overwrite(tmp_path):
    url = str(tmp_path / "synth.zarr")
    kw = {"n_samples": 500, "n_features": 300, "n_labels": 50, "multiclass": True, "seed": 1}
    ds = make_synthetic(url, **kw, normalize="l2", block_rows=128)
    X_ref, Y_ref = generate(**kw)
    X = to_scipy(ds.X)
    np.testing.assert_array_equal(X.indices, X_ref.indices)
    np.testing.assert_allclose(X.data, transform_rows(X_ref, normalize="l2").data, rtol=1e-6)
    np.testing.assert_allclose(np.asarray(X.multiply(X).sum(axis=1)).ravel(), 1.0, rtol=1e-5)
    assert_same(to_scipy(ds.Y), Y_ref)
    assert ds.meta["transforms"] == {"normalize": "l2"}
    with pytest.raises(FileExistsError):
        make_synthetic(url, **kw)
    ds = make_synthetic(url, **{**kw, "n_samples": 100}, overwrite=True)
    assert ds.n_samples == 100


# ---------------------------------------------------------------------------------------------- XC text


def read_xc(path: str) -> tuple[sp.csr_matrix, sp.csr_matrix]:
    """A small independent parser of the XC repository format."""
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as f:
        n, d, L = (int(v) for v in f.readline().split())
        x_rows, x_cols, x_vals, y_rows, y_cols = [], [], [], [], []
        for i, line in enumerate(f):
            labels, _, features = line.rstrip("\n").partition(" ")
            for label in filter(None, labels.split(",")):
                y_rows.append(i)
                y_cols.append(int(label))
            for pair in features.split():
                col, val = pair.split(":")
                x_rows.append(i)
                x_cols.append(int(col))
                x_vals.append(float(val))
    assert i == n - 1
    X = sp.csr_matrix((np.array(x_vals, np.float32), (x_rows, x_cols)), shape=(n, d))
    Y = sp.csr_matrix((np.ones(len(y_rows), np.float32), (y_rows, y_cols)), shape=(n, L))
    return X, Y


@pytest.mark.parametrize("name", ["train.txt", "train.txt.gz"])
def test_write_synthetic_text_reads_back(tmp_path, name):
    kw = {"n_samples": CHUNK_ROWS + 10, "n_features": 700, "n_labels": 90, "seed": 4}
    path = str(tmp_path / name)
    assert write_synthetic_text(path, **kw) == path
    X_ref, Y_ref = generate(**kw)
    X, Y = read_xc(path)
    assert_same(X, X_ref)
    assert_same(Y, Y_ref)
    assert os.listdir(tmp_path) == [name]


def test_write_xc_to_fsspec_url():
    fsspec = pytest.importorskip("fsspec")
    fs = fsspec.filesystem("memory")
    X, Y = generate(n_samples=40, n_features=30, n_labels=8, rank=4, seed=3)
    url = "memory://test_datasets/xc/train.txt.gz"
    try:
        write_xc(url, [(X, Y)], n_samples=40, n_features=30, n_labels=8)
        assert fs.ls("/test_datasets/xc", detail=False) == ["/test_datasets/xc/train.txt.gz"]
        lines = gzip.decompress(fs.cat(url)).decode().splitlines()
    finally:
        fs.rm("/test_datasets", recursive=True)
    assert lines == ["40 30 8", *xc_lines(X, Y)]


def test_xc_lines_formats_edge_cases():
    X = sp.csr_matrix(np.array([[0, 2.0, 0.5], [1.0, 0, 0], [0, 0, 0], [0, 0, 0]], np.float32))
    Y = sp.csr_matrix(np.array([[1, 0, 1], [0, 0, 0], [0, 1, 0], [0, 0, 0]], np.float32))
    assert xc_lines(X, Y) == ["0,2 1:2 2:0.5", " 0:1", "1", " "]
    values = np.array([0.1, 1 / 3, 1e-7, 123456789.0, -2.0], np.float32)
    line = xc_lines(sp.csr_matrix(values[None, :]), sp.csr_matrix((1, 1)))[0]
    assert line == " 0:0.1 1:0.33333334 2:1e-07 3:123456792 4:-2"
    np.testing.assert_array_equal([np.float32(p.split(":")[1]) for p in line.split()], values)


def test_write_xc_float_values_round_trip(tmp_path):
    X, Y = generate(n_samples=300, n_features=100, n_labels=20, rank=8, seed=2)
    X = transform_rows(X, normalize="l2")
    path = str(tmp_path / "l2.txt")
    write_xc(path, [(X[:100], Y[:100]), (X[100:], Y[100:])], n_samples=300, n_features=100, n_labels=20)
    X_back, Y_back = read_xc(path)
    assert_same(X_back, X)  # the shortest repr of a float32 reads back exactly
    assert_same(Y_back, Y)


def test_write_xc_leaves_nothing_on_error(tmp_path):
    X, Y = generate(n_samples=100, n_features=50, n_labels=10, rank=4, seed=0)
    path = tmp_path / "bad.txt.gz"
    with pytest.raises(ValueError, match="hold 100 rows, but n_samples is 101"):
        write_xc(str(path), [(X, Y)], n_samples=101, n_features=50, n_labels=10)
    with pytest.raises(ValueError, match="out of range"):
        write_xc(str(path), [(X, Y)], n_samples=100, n_features=50, n_labels=5)
    assert os.listdir(tmp_path) == []


# ---------------------------------------------------------------------------------------------- arguments


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"n_labels": 0}, "n_labels must be positive, but is 0"),
    ({"n_samples": -1}, "n_samples must be positive, but is -1"),
    ({"rank": 0}, "rank must be positive, but is 0"),
    ({"rank": 64}, r"rank must be at most n_labels \(50\), but is 64"),
    ({"avg_features": 0.0}, "avg_features must be greater than 0, but is 0.0"),
    ({"avg_labels": 0.5}, "avg_labels must be at least 1, but is 0.5"),
    ({"background": 1.5}, r"background must be in \[0, 1\], but is 1.5"),
    ({"feature_exponent": float("nan")}, "feature_exponent must be at least 0"),
    ({"seed": -3}, "seed must be non-negative, but is -3"),
    ({"split": ""}, "split must be a non-empty string"),
])
def test_invalid_arguments(kwargs, message):
    args = {"n_samples": 10, "n_features": 100, "n_labels": 50, **kwargs}
    with pytest.raises(ValueError, match=message):
        iter_synthetic(**args)  # checked at the call, before any row is generated


def test_invalid_types_and_store_options(tmp_path):
    small = {"n_samples": 10, "n_features": 10, "n_labels": 5, "rank": 2}
    with pytest.raises(TypeError, match="n_features must be an integer"):
        iter_synthetic(n_samples=10, n_features=10.5, n_labels=5)
    with pytest.raises(TypeError, match="seed must be an integer"):
        iter_synthetic(**small, seed="0")
    with pytest.raises(ValueError, match="normalize must be one of"):
        make_synthetic(str(tmp_path / "x.zarr"), **small, normalize="l3")
    with pytest.raises(ValueError, match="block_rows must be positive"):
        make_synthetic(str(tmp_path / "x.zarr"), **small, block_rows=0)
    assert os.listdir(tmp_path) == []
