"""Zarr stores: CSR round trips, datasets with safe appends, atomic writes, dense matrices."""

from __future__ import annotations

import pickle
import uuid

import dask
import dask.array as da
import fsspec
import numpy as np
import pytest
import scipy.sparse as sp
import zarr

import xmldask.store.csr as csr_module
import xmldask.store.dataset as dataset_module
from xmldask.store import (
    CSRWriter,
    DatasetWriter,
    StoreError,
    _fs,
    exists,
    open_csr,
    open_dataset,
    open_dense,
    remove,
    store_url,
    to_scipy,
    write_csr,
    write_dense,
)
from xmldask.store.layout import ATTR, LAYOUT_VERSION

# ---------------------------------------------------------------------------------------------- helpers


def random_csr(n_rows, n_cols, *, density=0.2, seed=0, empty_rows=(), dtype=np.float32) -> sp.csr_matrix:
    """A random CSR matrix with nonzero values (some integers, some tiny) and the given empty rows."""
    rng = np.random.default_rng(seed)
    mask = rng.random((n_rows, n_cols)) < density
    values = rng.standard_normal((n_rows, n_cols)).astype(dtype)
    values[rng.random((n_rows, n_cols)) < 0.3] = rng.integers(1, 5, size=1)[0]
    values[values == 0] = 1
    dense = np.where(mask, values, 0).astype(dtype)
    dense[list(empty_rows)] = 0
    return sp.csr_matrix(dense)


def random_labels(n_rows, n_labels, *, density=0.15, seed=1, empty_rows=()) -> sp.csr_matrix:
    rng = np.random.default_rng(seed)
    dense = (rng.random((n_rows, n_labels)) < density).astype(np.float32)
    dense[list(empty_rows)] = 0
    return sp.csr_matrix(dense)


def assert_csr_equal(actual, expected):
    assert actual.shape == expected.shape
    assert (sp.csr_matrix(actual) != sp.csr_matrix(expected)).nnz == 0


def block_bounds(n_rows, block_rows):
    return list(range(0, n_rows, block_rows)) + [n_rows] if n_rows else [0]


def check_blocks(X, expected, row_blocks, *, dtype=np.float32):
    """Chunks follow ``row_blocks``; each block is a csr_matrix of ``dtype`` equal to its rows."""
    assert X.shape == expected.shape
    assert X.dtype == np.dtype(dtype)
    assert X.chunks == (tuple(np.diff(row_blocks).tolist()) or (0,), (expected.shape[1],))
    assert type(X._meta) is sp.csr_matrix
    for i, (a, b) in enumerate(zip(row_blocks[:-1], row_blocks[1:])):
        block = X.blocks[i].compute()
        assert type(block) is sp.csr_matrix  # not csr_array: da.dot works on csr_matrix chunks
        assert block.dtype == np.dtype(dtype)
        assert block.has_sorted_indices
        assert_csr_equal(block, expected[a:b])
    whole = to_scipy(X)
    assert type(whole) is sp.csr_matrix
    assert_csr_equal(whole, expected)


def partial_entries(path) -> list:
    return [p for p in path.rglob("*") if ".partial-" in p.name]


def csr_attrs(url) -> dict:
    return dict(zarr.open_group(_fs.zarr_store(url, read_only=True), mode="r").attrs)


def set_attr(url, key, value, *, path=""):
    group = zarr.open_group(_fs.zarr_store(url), mode="r+")
    group = group[path] if path else group
    meta = dict(group.attrs[ATTR])
    meta[key] = value
    group.attrs.update({ATTR: meta})


@pytest.fixture
def tiny_shards(monkeypatch):
    """New CSR arrays get 16-element chunks in 32-element shards, so appends cross shards often."""
    create = csr_module._create_1d

    def tiny(group, name, dtype, *, chunk_elements, shard_chunks):
        return create(group, name, dtype, chunk_elements=16, shard_chunks=2)

    monkeypatch.setattr(csr_module, "_create_1d", tiny)


@pytest.fixture
def memory_root():
    """A fresh directory in fsspec's in-memory file system, removed afterwards."""
    name = f"xmldask-test-{uuid.uuid4().hex[:8]}"
    yield f"memory://{name}"
    fs = fsspec.filesystem("memory")
    if fs.exists(f"/{name}"):
        fs.rm(f"/{name}", recursive=True)


# ---------------------------------------------------------------------------------------------- CSR


@pytest.mark.parametrize(
    ("n_rows", "n_cols", "block_rows"),
    [(1003, 37, 100), (100, 10, 100), (99, 10, 100), (13, 9, 1), (1, 5, 3)],
)
def test_csr_round_trip(tmp_path, n_rows, n_cols, block_rows):
    A = random_csr(n_rows, n_cols, seed=n_rows)
    url = str(tmp_path / "a.zarr")
    assert write_csr(url, A, block_rows=block_rows) == url
    X = open_csr(url)
    bounds = block_bounds(n_rows, block_rows)
    attrs = csr_attrs(url)
    assert attrs[ATTR]["row_blocks"] == bounds
    assert attrs[ATTR]["nnz"] == A.nnz
    check_blocks(X, A, bounds)


def test_csr_layout_is_anndata_compatible(tmp_path):
    A = random_csr(50, 8)
    url = str(tmp_path / "a.zarr")
    write_csr(url, A, block_rows=16)
    group = zarr.open_group(url, mode="r")
    attrs = dict(group.attrs)
    assert attrs["encoding-type"] == "csr_matrix"
    assert attrs["encoding-version"] == "0.1.0"
    assert attrs["shape"] == [50, 8]
    assert attrs[ATTR]["kind"] == "csr"
    assert attrs[ATTR]["layout_version"] == LAYOUT_VERSION
    assert attrs[ATTR]["complete"] is True
    assert group["data"].dtype == np.float32
    assert group["indices"].dtype == np.int32
    assert group["indptr"].dtype == np.int64
    np.testing.assert_array_equal(group["indptr"][:], A.indptr)
    np.testing.assert_array_equal(group["indices"][:], A.indices)
    np.testing.assert_array_equal(group["data"][:], A.data)


def test_csr_empty_rows(tmp_path):
    # the first and last rows, and the whole third block, are empty
    empty = [0, 1, 7, *range(20, 30), 58, 59]
    A = random_csr(60, 12, empty_rows=empty, seed=3)
    assert np.all(np.diff(A.indptr)[empty] == 0)
    url = str(tmp_path / "a.zarr")
    write_csr(url, A, block_rows=10)
    check_blocks(open_csr(url), A, block_bounds(60, 10))


@pytest.mark.parametrize("n_cols", [0, 7])
def test_csr_zero_rows(tmp_path, n_cols):
    A = sp.csr_matrix((0, n_cols), dtype=np.float32)
    url = str(tmp_path / "a.zarr")
    write_csr(url, A, block_rows=10)
    X = open_csr(url)
    assert X.shape == (0, n_cols)
    assert X.chunks == ((0,), (n_cols,))
    B = to_scipy(X)
    assert type(B) is sp.csr_matrix
    assert B.shape == (0, n_cols)
    assert B.nnz == 0


def test_csr_all_zero(tmp_path):
    A = sp.csr_matrix((25, 4), dtype=np.float32)
    url = str(tmp_path / "a.zarr")
    write_csr(url, A, block_rows=10)
    check_blocks(open_csr(url), A, [0, 10, 20, 25])


def test_csr_pieces_of_varying_sizes(tmp_path):
    A = random_csr(1003, 21, seed=5, empty_rows=range(300, 340))
    cuts = [0, 0, 1, 18, 268, 271, 271, 771, 1003]
    pieces = (A[a:b] for a, b in zip(cuts[:-1], cuts[1:]))  # a generator, with empty pieces
    url = str(tmp_path / "a.zarr")
    write_csr(url, pieces, n_cols=21, block_rows=64)
    check_blocks(open_csr(url), A, block_bounds(1003, 64))


def test_csr_pieces_accept_csr_arrays_and_narrower_pieces(tmp_path):
    dense = random_csr(30, 10, seed=6).toarray()
    dense[:10, 5:] = 0
    A = sp.csr_matrix(dense)
    pieces = [sp.csr_array(A[:10, :5]), A[10:20], sp.coo_matrix(A[20:])]
    url = str(tmp_path / "a.zarr")
    write_csr(url, pieces, n_cols=10, block_rows=7)
    check_blocks(open_csr(url), A, block_bounds(30, 7))


def test_csr_unsorted_indices_are_stored_sorted(tmp_path):
    A = sp.csr_matrix((np.array([1, 2, 3], np.float32), np.array([3, 1, 0]), np.array([0, 2, 3])), shape=(2, 5))
    assert not A.has_sorted_indices
    url = str(tmp_path / "a.zarr")
    write_csr(url, A)
    np.testing.assert_array_equal(zarr.open_group(url, mode="r")["indices"][:], [1, 3, 0])
    assert_csr_equal(to_scipy(open_csr(url)), A)


def test_csr_piece_wider_than_matrix_is_refused(tmp_path):
    url = str(tmp_path / "a.zarr")
    with pytest.raises(ValueError, match="block has 6 columns, the matrix 5"):
        write_csr(url, [random_csr(3, 6)], n_cols=5)
    assert not exists(url)
    assert partial_entries(tmp_path) == []


def test_csr_commit_refuses_too_few_columns(tmp_path):
    group = zarr.open_group(str(tmp_path / "a.zarr"), mode="w")
    writer = CSRWriter(group)
    writer.write(sp.csr_matrix(np.eye(3, 10, dtype=np.float32)))
    with pytest.raises(ValueError, match="column id 2"):
        writer.commit(n_cols=2)
    writer.commit(n_cols=3)
    assert_csr_equal(to_scipy(open_csr(str(tmp_path / "a.zarr"))), np.eye(3, dtype=np.float32))


def test_csr_pieces_without_n_cols_are_refused(tmp_path):
    url = str(tmp_path / "a.zarr")
    with pytest.raises(ValueError, match="number of columns is unknown"):
        write_csr(url, [random_csr(3, 6)])
    assert not exists(url)
    assert partial_entries(tmp_path) == []


def test_csr_block_rows_must_be_positive(tmp_path):
    with pytest.raises(ValueError, match="block_rows must be positive, but is 0"):
        write_csr(str(tmp_path / "a.zarr"), random_csr(3, 3), block_rows=0)
    assert partial_entries(tmp_path) == []


def test_csr_writer_small_shards_and_append(tmp_path):
    """16-element chunks in 32-element shards: pieces cross shard boundaries many times."""
    url = str(tmp_path / "a.zarr")
    A = random_csr(317, 13, density=0.2, seed=7, empty_rows=range(100, 140))
    B = random_csr(131, 13, density=0.2, seed=8)
    group = zarr.open_group(url, mode="w")
    writer = CSRWriter(group, n_cols=13, block_rows=100, chunk_elements=16, shard_chunks=2)
    rng = np.random.default_rng(0)
    cuts = np.unique(np.r_[0, rng.integers(0, 317, 40), 317])
    for a, b in zip(cuts[:-1], cuts[1:]):
        writer.write(A[a:b])
    meta = writer.commit()
    assert group["data"].chunks == (16,)
    assert group["data"].shards == (32,)
    assert meta["nnz"] == A.nnz > 20 * 32  # more than 20 shards
    assert meta["row_blocks"] == block_bounds(317, 100)
    check_blocks(open_csr(url), A, block_bounds(317, 100))

    # append in pieces of one to 40 rows; the old last block (17 rows) stays as it is
    group = zarr.open_group(url, mode="r+")
    writer = CSRWriter(group, block_rows=60, append=True)
    start = 0
    while start < 131:
        stop = min(131, start + int(rng.integers(1, 40)))
        writer.write(B[start:stop])
        start = stop
    meta = writer.commit()
    expected_bounds = block_bounds(317, 100) + [377, 437, 448]
    assert meta["row_blocks"] == expected_bounds
    assert meta["nnz"] == A.nnz + B.nnz
    check_blocks(open_csr(url), sp.vstack([A, B], format="csr"), expected_bounds)


def test_csr_writer_append_discards_uncommitted_tail(tmp_path):
    url = str(tmp_path / "a.zarr")
    A, B, C = random_csr(40, 6, seed=1), random_csr(30, 6, seed=2), random_csr(20, 6, seed=3)
    group = zarr.open_group(url, mode="w")
    writer = CSRWriter(group, n_cols=6, block_rows=16, chunk_elements=8, shard_chunks=2)
    writer.write(A)
    writer.commit()
    # an append that dies after its rows reached the disk, without committing
    writer = CSRWriter(zarr.open_group(url, mode="r+"), block_rows=16, append=True)
    writer.write(B)
    writer.flush()
    del writer
    assert zarr.open_group(url, mode="r")["data"].shape[0] == A.nnz + B.nnz
    assert_csr_equal(to_scipy(open_csr(url)), A)
    writer = CSRWriter(zarr.open_group(url, mode="r+"), block_rows=16, append=True)
    writer.write(C)
    writer.commit()
    assert_csr_equal(to_scipy(open_csr(url)), sp.vstack([A, C]))
    assert zarr.open_group(url, mode="r")["data"].shape[0] == A.nnz + C.nnz


def test_csr_float64_blocks(tmp_path):
    A = random_csr(205, 11, seed=9)
    url = str(tmp_path / "a.zarr")
    write_csr(url, A, block_rows=50)
    assert zarr.open_group(url, mode="r")["data"].dtype == np.float32
    X = open_csr(url, dtype=np.float64)
    check_blocks(X, A.astype(np.float64), block_bounds(205, 50), dtype=np.float64)
    assert to_scipy(X).dtype == np.float64
    # float32 and float64 views of the same store are different Dask collections
    assert open_csr(url).name != X.name
    assert open_csr(url).name == open_csr(url).name


def test_csr_float64_input_is_stored_float32(tmp_path):
    A = random_csr(20, 5, dtype=np.float64)
    url = str(tmp_path / "a.zarr")
    write_csr(url, A)
    X = to_scipy(open_csr(url))
    assert X.dtype == np.float32
    assert_csr_equal(X, A.astype(np.float32))


def test_computing_one_block_reads_only_that_block(tmp_path, monkeypatch):
    A = random_csr(1003, 20, seed=10)
    url = str(tmp_path / "a.zarr")
    write_csr(url, A, block_rows=100)
    X = open_csr(url)
    calls = []
    read_rows = csr_module.CSRBlockReader.read_rows

    def spy(self, start, stop):
        calls.append((start, stop))
        return read_rows(self, start, stop)

    monkeypatch.setattr(csr_module.CSRBlockReader, "read_rows", spy)
    with dask.config.set(scheduler="sync"):
        assert_csr_equal(X.blocks[3].compute(), A[300:400])
        assert calls == [(300, 400)]
        calls.clear()
        assert_csr_equal(X.blocks[10].compute(), A[1000:1003])
        assert calls == [(1000, 1003)]
        calls.clear()
        assert_csr_equal(X[420:450].compute(), A[420:450])
        assert calls == [(420, 450)] or calls == [(400, 500)]


def test_csr_reader_slicing(tmp_path):
    A = random_csr(64, 9, seed=11)
    url = str(tmp_path / "a.zarr")
    write_csr(url, A, block_rows=16)
    reader = csr_module.CSRBlockReader(url, "", A.shape)
    assert_csr_equal(reader[5:20], A[5:20])
    assert_csr_equal(reader[5:20:3], A[5:20:3])
    assert_csr_equal(reader[5:20, 2:7], A[5:20, 2:7])
    assert_csr_equal(reader[20:5], A[20:5])


def test_csr_dask_array_pickles(tmp_path):
    A = random_csr(120, 7, seed=12)
    url = str(tmp_path / "a.zarr")
    write_csr(url, A, block_rows=50)
    X = open_csr(url)
    X.blocks[0].compute()  # the reader has opened the store: its handles must not be pickled
    Y = pickle.loads(pickle.dumps(X))
    assert_csr_equal(to_scipy(Y), A)


def test_block_reader_travels_with_the_array(tmp_path):
    """The reader a fused pass reads through is found from the array alone, also in another process
    (a served flow or a worker unpickles the array there), and only for the store's own array."""
    import subprocess
    import sys

    A = random_csr(120, 7, seed=14)
    url = str(tmp_path / "a.zarr")
    write_csr(url, A, block_rows=50)
    X = open_csr(url)
    reader = csr_module.block_reader(X)
    assert reader is not None
    assert_csr_equal(reader.read_rows(50, 100), A[50:100])
    for derived in (X[:60], X.rechunk((60, 7)), X.map_blocks(lambda b: b, dtype=X.dtype)):
        assert csr_module.block_reader(derived) is None
    assert csr_module.block_reader(np.zeros((2, 2))) is None
    code = ("import pickle, sys; from xmldask.store.csr import block_reader; "
            "r = block_reader(pickle.loads(sys.stdin.buffer.read())); "
            "print(r.read_rows(50, 100).nnz if r is not None else 'no reader')")
    out = subprocess.run([sys.executable, "-c", code], input=pickle.dumps(X), capture_output=True, check=True)
    assert out.stdout.decode().strip() == str(A[50:100].nnz)


def test_csr_da_dot_against_scipy(tmp_path):
    A = random_csr(301, 17, seed=13)
    url = str(tmp_path / "a.zarr")
    write_csr(url, A, block_rows=64)
    Q = np.random.default_rng(0).standard_normal((17, 3))
    np.testing.assert_allclose(da.dot(open_csr(url, dtype=np.float64), Q).compute(), A @ Q, rtol=1e-12)


# ---------------------------------------------------------------------------------------------- URLs


@pytest.mark.parametrize("name", ["", "sub/dir/"])
def test_memory_urls(memory_root, name):
    url = f"{memory_root}/{name}a.zarr"
    A = random_csr(203, 9, seed=14)
    write_csr(url, A, block_rows=50)
    assert exists(url)
    check_blocks(open_csr(url), A, block_bounds(203, 50))
    with pytest.raises(FileExistsError):
        write_csr(url, A)
    B = random_csr(20, 3, seed=15)
    write_csr(url, B, overwrite=True)
    assert_csr_equal(to_scipy(open_csr(url)), B)
    fs = fsspec.filesystem("memory")
    assert not [p for p in fs.find(memory_root.removeprefix("memory:/"), withdirs=True) if ".partial-" in p]
    remove(url)
    assert not exists(url)


def test_memory_url_at_top_level(tmp_path, monkeypatch):
    """``memory://name`` (no directory): the temporary sibling must stay in memory, not on disk."""
    monkeypatch.chdir(tmp_path)
    url = f"memory://xmldask-top-{uuid.uuid4().hex[:8]}"
    try:
        tmp = _fs.temporary_sibling(url)
        assert tmp.startswith("memory://.xmldask-top-")
        A = random_csr(30, 4, seed=16)
        write_csr(url, A, block_rows=8)
        assert_csr_equal(to_scipy(open_csr(url)), A)
        assert list(tmp_path.iterdir()) == []
        assert not [p for p in fsspec.filesystem("memory").ls("/", detail=False) if ".partial-" in p]
    finally:
        remove(url)


def test_memory_dataset_and_dense(memory_root):
    X, Y = random_csr(70, 6, seed=17), random_labels(70, 4)
    url = f"{memory_root}/ds.zarr"
    with DatasetWriter.create(url, block_rows=32) as writer:
        writer.write(X, Y)
        writer.commit(n_features=6, n_labels=4)
    with DatasetWriter.append(url, block_rows=32) as writer:
        writer.write(X[:10], Y[:10])
        writer.commit()
    ds = open_dataset(url)
    assert_csr_equal(to_scipy(ds.X), sp.vstack([X, X[:10]]))
    assert_csr_equal(to_scipy(ds.Y), sp.vstack([Y, Y[:10]]))
    D = np.arange(30.0).reshape(10, 3)
    write_dense(f"{memory_root}/d.zarr", D, block_rows=4)
    np.testing.assert_array_equal(open_dense(f"{memory_root}/d.zarr").compute(), D)


@pytest.mark.parametrize(
    ("url", "prefix"),
    [
        ("/data/x.zarr", "/data/.x.zarr.partial-"),
        ("rel/x.zarr/", "rel/.x.zarr.partial-"),
        ("x.zarr", ".x.zarr.partial-"),
        ("memory://x", "memory://.x.partial-"),
        ("memory://bucket/x", "memory://bucket/.x.partial-"),
        ("file:///tmp/x", "file:///tmp/.x.partial-"),
    ],
)
def test_temporary_sibling(url, prefix):
    tmp = _fs.temporary_sibling(url)
    assert tmp.startswith(prefix)
    assert len(tmp) == len(prefix) + 12
    assert tmp != _fs.temporary_sibling(url)


def test_store_url_and_storage_root(monkeypatch):
    monkeypatch.delenv("XMLDASK_STORAGE", raising=False)
    assert store_url("a/b.zarr") == "storage/a/b.zarr"
    monkeypatch.setenv("XMLDASK_STORAGE", "s3://bucket/root/")
    assert store_url("/b.zarr") == "s3://bucket/root/b.zarr"
    assert store_url("b.zarr", root="/x") == "/x/b.zarr"


def test_remove_missing_store_is_not_an_error(tmp_path):
    remove(str(tmp_path / "nothing.zarr"))


# ---------------------------------------------------------------------------------------------- datasets


def snapshot(url) -> dict:
    """Everything a reader sees of a dataset."""
    ds = open_dataset(url)
    return {"meta": ds.meta, "X": to_scipy(ds.X), "Y": to_scipy(ds.Y), "counts": ds.label_counts,
            "chunks": (ds.X.chunks, ds.Y.chunks)}


def assert_same_snapshot(actual, expected):
    assert actual["meta"] == expected["meta"]
    assert actual["chunks"] == expected["chunks"]
    assert_csr_equal(actual["X"], expected["X"])
    assert_csr_equal(actual["Y"], expected["Y"])
    np.testing.assert_array_equal(actual["counts"], expected["counts"])


def check_dataset(ds, X, Y, row_blocks):
    """Meta, matrices and label counts of ``ds`` against in-memory ``X`` and (binary) ``Y``."""
    Y = sp.csr_matrix(Y, copy=True)
    Y.data[:] = 1
    meta = ds.meta
    assert meta["kind"] == "dataset"
    assert meta["complete"] is True
    assert ds.n_samples == meta["n_samples"] == X.shape[0] == Y.shape[0]
    assert ds.n_features == meta["n_features"] == X.shape[1]
    assert ds.n_labels == meta["n_labels"] == Y.shape[1]
    assert meta["nnz"] == X.nnz
    assert meta["nnz_labels"] == Y.nnz
    assert meta["rows_without_labels"] == int(np.count_nonzero(np.diff(Y.indptr) == 0))
    assert meta["row_blocks"] == row_blocks
    counts = ds.label_counts
    assert counts.dtype == np.int64
    np.testing.assert_array_equal(counts, np.asarray(Y.sum(axis=0)).ravel().astype(np.int64))
    check_blocks(ds.X, X, row_blocks)
    check_blocks(ds.Y, Y, row_blocks)
    assert np.all(to_scipy(ds.Y).data == 1)


def make_dataset(url, X, Y, *, block_rows, pieces=3, overwrite=False, sources=(), **commit):
    with DatasetWriter.create(url, block_rows=block_rows, overwrite=overwrite) as writer:
        writer.sources.extend(sources)
        cuts = np.linspace(0, X.shape[0], pieces + 1).astype(int)
        for a, b in zip(cuts[:-1], cuts[1:]):
            writer.write(X[a:b], Y[a:b])
        assert writer.n_samples == X.shape[0]
        ds = writer.commit(**commit)
    return ds


def test_dataset_create_commit_open(tmp_path):
    empty = [0, 5, 6, 102]
    X = random_csr(103, 25, seed=20, empty_rows=[1, 5, 50])
    Y = random_labels(103, 9, empty_rows=empty)
    Y.data[::3] = 2.5  # any stored label value means "has the label"
    url = str(tmp_path / "ds.zarr")
    ds = make_dataset(url, X, Y, block_rows=25, n_features=25, n_labels=9, note="hello")
    assert ds.url == url
    check_dataset(ds, X, Y, block_bounds(103, 25))
    assert open_dataset(url).meta == ds.meta
    meta = open_dataset(url).meta
    assert meta["rows_without_labels"] == int(np.count_nonzero(Y.getnnz(axis=1) == 0)) >= len(empty)
    assert meta["note"] == "hello"
    assert meta["sources"] == []
    assert meta["layout_version"] == LAYOUT_VERSION
    assert {"created", "updated", "generation", "label_counts_array"} <= meta.keys()
    assert ds.X.chunks[0] == ds.Y.chunks[0]
    info = ds.info()
    assert info["n_samples"] == 103
    assert info["rows_without_labels"] == meta["rows_without_labels"]
    assert info["row_blocks"] == 5
    assert info["labels_used"] == int(np.count_nonzero(Y.getnnz(axis=0)))
    assert "n_samples=103" in repr(ds)


def test_dataset_dimensions_given_at_create(tmp_path):
    X, Y = random_csr(30, 8, seed=21), random_labels(30, 5)
    url = str(tmp_path / "ds.zarr")
    with DatasetWriter.create(url, n_features=8, n_labels=5, block_rows=7) as writer:
        assert (writer.n_features, writer.n_labels) == (8, 5)
        writer.write(X, Y)
        ds = writer.commit()
    check_dataset(ds, X, Y, block_bounds(30, 7))


def test_dataset_n_labels_inferred_at_commit(tmp_path):
    X = random_csr(20, 4, seed=22)
    Y = sp.csr_matrix(([1.0, 1.0, 1.0], [0, 6, 2], [0, 1, 1, 3] + [3] * 17), shape=(20, 7), dtype=np.float32)
    ds = make_dataset(str(tmp_path / "ds.zarr"), X, Y, block_rows=8, n_features=4)
    assert ds.n_labels == 7
    check_dataset(ds, X, Y, block_bounds(20, 8))


def test_dataset_more_labels_than_used(tmp_path):
    X, Y = random_csr(20, 4, seed=23), random_labels(20, 3)
    ds = make_dataset(str(tmp_path / "ds.zarr"), X, Y, block_rows=8, n_features=4, n_labels=10)
    Y10 = sp.csr_matrix((Y.data, Y.indices, Y.indptr), shape=(20, 10))
    check_dataset(ds, X, Y10, block_bounds(20, 8))
    assert ds.label_counts[3:].sum() == 0


def test_dataset_with_zero_rows(tmp_path):
    X, Y = sp.csr_matrix((0, 4), dtype=np.float32), sp.csr_matrix((0, 3), dtype=np.float32)
    url = str(tmp_path / "ds.zarr")
    ds = make_dataset(url, X, Y, block_rows=8, n_features=4, n_labels=3)
    assert ds.n_samples == 0
    assert ds.meta["row_blocks"] == [0]
    assert to_scipy(ds.X).shape == (0, 4)
    np.testing.assert_array_equal(ds.label_counts, [0, 0, 0])
    X2, Y2 = random_csr(5, 4, seed=24), random_labels(5, 3)
    with DatasetWriter.append(url, block_rows=2) as writer:
        writer.write(X2, Y2)
        writer.commit()
    check_dataset(open_dataset(url), X2, Y2, [0, 2, 4, 5])


def test_dataset_float64(tmp_path):
    X, Y = random_csr(30, 5, seed=25), random_labels(30, 4)
    url = str(tmp_path / "ds.zarr")
    make_dataset(url, X, Y, block_rows=8, n_features=5, n_labels=4)
    ds = open_dataset(url, dtype=np.float64)
    assert ds.X.dtype == ds.Y.dtype == np.float64
    check_blocks(ds.X, X.astype(np.float64), block_bounds(30, 8), dtype=np.float64)


def _write_refused(open_writer, X, Y, message: str, **commit) -> None:
    """Writing ``X, Y`` (then committing with ``commit``, if given) through ``open_writer()`` fails with
    ``message``."""
    with pytest.raises(ValueError, match=message):
        with open_writer() as writer:
            writer.write(X, Y)
            if commit:
                writer.commit(**commit)


def test_dataset_write_checks(tmp_path):
    url = str(tmp_path / "ds.zarr")
    create = lambda: DatasetWriter.create(url)  # noqa: E731
    _write_refused(create, random_csr(3, 4), random_labels(2, 3), "X has 3 rows but Y has 2")
    _write_refused(create, random_csr(2, 4), sp.csr_matrix(np.eye(2, 6, 4, dtype=np.float32)),
                   "label id 5 is out of range for 3 labels", n_features=4, n_labels=3)
    _write_refused(create, sp.csr_matrix(np.eye(4, dtype=np.float32)), random_labels(4, 3),
                   "column id 3 is out of range for 2 columns", n_features=2, n_labels=3)
    assert not exists(url)
    assert partial_entries(tmp_path) == []


def test_dataset_append(tmp_path, tiny_shards):
    X1, Y1 = random_csr(103, 15, seed=30, empty_rows=[0]), random_labels(103, 8, seed=31, empty_rows=[3])
    X2, Y2 = random_csr(57, 15, seed=32), random_labels(57, 8, seed=33, empty_rows=[0, 56])
    X3, Y3 = random_csr(1, 15, seed=34), random_labels(1, 8, seed=35)
    url = str(tmp_path / "ds.zarr")
    before = make_dataset(url, X1, Y1, block_rows=25, n_features=15, n_labels=8, sources=[{"path": "a"}])
    with DatasetWriter.append(url, block_rows=20) as writer:
        assert writer.n_samples == 103
        for a, b in [(0, 3), (3, 3), (3, 40), (40, 57)]:
            writer.write(X2[a:b], Y2[a:b])
        writer.sources.append({"path": "b"})
        ds = writer.commit()
    bounds = [0, 25, 50, 75, 100, 103, 123, 143, 160]
    check_dataset(ds, sp.vstack([X1, X2], format="csr"), sp.vstack([Y1, Y2], format="csr"), bounds)
    assert open_dataset(url).meta == ds.meta
    assert ds.meta["sources"] == [{"path": "a"}, {"path": "b"}]
    assert ds.meta["generation"] != before.meta["generation"]
    assert ds.meta["created"] == before.meta["created"]
    assert ds.meta["label_counts_array"] != before.meta["label_counts_array"]
    assert ds.X.name != before.X.name
    # a second append, and an empty one
    with DatasetWriter.append(url, block_rows=20) as writer:
        writer.write(X3, Y3)
        ds = writer.commit()
    with DatasetWriter.append(url) as writer:
        empty = writer.commit()
    X, Y = sp.vstack([X1, X2, X3], format="csr"), sp.vstack([Y1, Y2, Y3], format="csr")
    check_dataset(ds, X, Y, bounds + [161])
    moving = {"generation": 0, "updated": 0, "label_counts_array": 0}  # change with every commit
    assert {**empty.meta, **moving} == {**ds.meta, **moving}
    assert empty.meta["label_counts_array"] != ds.meta["label_counts_array"]
    np.testing.assert_array_equal(empty.label_counts, ds.label_counts)
    assert zarr.open_group(url, mode="r")["X/data"].shards == (32,)  # appends really crossed shards


def check_unchanged_then_appends(url, before, X1, Y1, X_new, Y_new, row_blocks):
    """The failed append left the dataset at ``url`` as ``before`` (holding ``X1, Y1``), and a new append of
    ``X_new, Y_new`` commits on top of it with these row blocks (block size their first step)."""
    assert_same_snapshot(snapshot(url), before)
    with DatasetWriter.append(url, block_rows=row_blocks[1]) as writer:
        writer.write(X_new, Y_new)
        ds = writer.commit()
    check_dataset(ds, sp.vstack([X1, X_new], format="csr"), sp.vstack([Y1, Y_new], format="csr"), row_blocks)


def test_append_that_raises_leaves_dataset_unchanged(tmp_path, tiny_shards):
    X1, Y1 = random_csr(80, 10, seed=40), random_labels(80, 6, seed=41)
    X2, Y2 = random_csr(90, 10, seed=42), random_labels(90, 6, seed=43)
    url = str(tmp_path / "ds.zarr")
    make_dataset(url, X1, Y1, block_rows=30, n_features=10, n_labels=6)
    before = snapshot(url)
    with pytest.raises(RuntimeError, match="boom"):
        with DatasetWriter.append(url, block_rows=30) as writer:
            writer.write(X2[:50], Y2[:50])
            writer.write(X2[50:], Y2[50:])
            raise RuntimeError("boom")
    # the rows reached the disk beyond the committed end, yet readers see the old dataset
    assert zarr.open_group(url, mode="r")["X/data"].shape[0] > X1.nnz
    check_unchanged_then_appends(url, before, X1, Y1, X2[:20], Y2[:20], [0, 30, 60, 80, 100])


def test_append_that_crashes_without_exit(tmp_path, tiny_shards):
    """A writer that vanishes (process killed): no commit, no ``__exit__``."""
    X1, Y1 = random_csr(64, 10, seed=50), random_labels(64, 6, seed=51)
    X2, Y2 = random_csr(70, 10, seed=52), random_labels(70, 6, seed=53)
    X3, Y3 = random_csr(15, 10, seed=54), random_labels(15, 6, seed=55)
    url = str(tmp_path / "ds.zarr")
    make_dataset(url, X1, Y1, block_rows=16, n_features=10, n_labels=6)
    before = snapshot(url)
    writer = DatasetWriter.append(url, block_rows=16)
    writer.write(X2, Y2)
    del writer
    assert zarr.open_group(url, mode="r")["X/data"].shape[0] > X1.nnz
    check_unchanged_then_appends(url, before, X1, Y1, X3, Y3, [0, 16, 32, 48, 64, 79])
    group = zarr.open_group(url, mode="r")
    assert group["X/data"].shape[0] == X1.nnz + X3.nnz
    assert group["Y/indptr"].shape[0] == 80


def test_append_that_crashes_inside_commit(tmp_path, tiny_shards, monkeypatch):
    """X, Y and the new label counts are written, the root attributes (the commit point) are not."""
    X1, Y1 = random_csr(40, 8, seed=60), random_labels(40, 5, seed=61)
    X2, Y2 = random_csr(30, 8, seed=62), random_labels(30, 5, seed=63)
    url = str(tmp_path / "ds.zarr")
    make_dataset(url, X1, Y1, block_rows=16, n_features=8, n_labels=5)
    before = snapshot(url)

    def crash():
        raise KeyboardInterrupt("killed during commit")

    monkeypatch.setattr(dataset_module, "_now", crash)
    with pytest.raises(KeyboardInterrupt):
        with DatasetWriter.append(url, block_rows=16) as writer:
            writer.write(X2, Y2)
            writer.commit()
    monkeypatch.undo()
    group = zarr.open_group(url, mode="r")
    assert group["X"].attrs[ATTR]["nnz"] == X1.nnz + X2.nnz  # X's own attributes moved on
    assert "label_counts_next" in group  # and the other label-count slot was written
    check_unchanged_then_appends(url, before, X1, Y1, X2[:5], Y2[:5], [0, 16, 32, 40, 45])


def test_append_refuses_out_of_range_ids(tmp_path):
    X1, Y1 = random_csr(20, 6, seed=70), random_labels(20, 4, seed=71)
    url = str(tmp_path / "ds.zarr")
    make_dataset(url, X1, Y1, block_rows=8, n_features=6, n_labels=4)
    before = snapshot(url)
    _write_refused(lambda: DatasetWriter.append(url), random_csr(3, 7), random_labels(3, 4),
                   "block has 7 columns, the matrix 6")
    with pytest.raises(ValueError, match="block has 5 columns, the matrix 4"):  # found at the commit
        with DatasetWriter.append(url) as writer:
            writer.write(random_csr(2, 6), sp.csr_matrix(np.eye(2, 5, 3, dtype=np.float32)))
            writer.commit()
    assert_same_snapshot(snapshot(url), before)


def test_append_to_missing_or_incomplete_dataset(tmp_path):
    url = str(tmp_path / "ds.zarr")
    with pytest.raises(StoreError, match="no dataset store"):
        DatasetWriter.append(url)
    make_dataset(url, random_csr(5, 3), random_labels(5, 2), block_rows=2, n_features=3, n_labels=2)
    set_attr(url, "complete", False)
    with pytest.raises(StoreError, match="incomplete"):
        DatasetWriter.append(url)


# ---------------------------------------------------------------------------------------------- atomicity


def test_create_that_raises_leaves_nothing(tmp_path):
    url = str(tmp_path / "ds.zarr")
    with pytest.raises(RuntimeError, match="boom"):
        with DatasetWriter.create(url, block_rows=4) as writer:
            writer.write(random_csr(10, 3), random_labels(10, 2))
            raise RuntimeError("boom")
    assert not exists(url)
    assert list(tmp_path.iterdir()) == []


def test_write_csr_that_raises_leaves_nothing(tmp_path):
    def pieces():
        yield random_csr(5, 4)
        raise RuntimeError("boom")

    url = str(tmp_path / "a.zarr")
    with pytest.raises(RuntimeError, match="boom"):
        write_csr(url, pieces(), n_cols=4)
    assert list(tmp_path.iterdir()) == []


def test_write_dense_that_raises_leaves_nothing(tmp_path):
    def fail(block):
        raise RuntimeError("boom")

    x = da.zeros((10, 3), chunks=(4, 3)).map_blocks(fail, dtype=float)
    with pytest.raises(RuntimeError, match="boom"):
        write_dense(str(tmp_path / "d.zarr"), x)
    assert list(tmp_path.iterdir()) == []


def test_existing_targets_are_refused_or_replaced(tmp_path):
    A, B = random_csr(10, 3, seed=80), random_csr(4, 2, seed=81)
    csr_url, ds_url, dense_url = (str(tmp_path / n) for n in ("a.zarr", "ds.zarr", "d.zarr"))
    write_csr(csr_url, A)
    make_dataset(ds_url, A, random_labels(10, 2), block_rows=4, n_features=3, n_labels=2)
    write_dense(dense_url, np.ones((3, 2)))
    with pytest.raises(FileExistsError, match="a.zarr already exists; pass overwrite=True"):
        write_csr(csr_url, B)
    with pytest.raises(FileExistsError, match="ds.zarr already exists; pass overwrite=True"):
        DatasetWriter.create(ds_url)
    with pytest.raises(FileExistsError, match="d.zarr already exists; pass overwrite=True"):
        write_dense(dense_url, np.zeros((2, 2)))
    assert_csr_equal(to_scipy(open_csr(csr_url)), A)
    assert partial_entries(tmp_path) == []

    write_csr(csr_url, B, overwrite=True)
    assert_csr_equal(to_scipy(open_csr(csr_url)), B)
    YB = random_labels(4, 3)
    ds = make_dataset(ds_url, B, YB, block_rows=4, overwrite=True, n_features=2, n_labels=3)
    check_dataset(ds, B, YB, [0, 4])
    write_dense(dense_url, np.zeros((2, 2)), overwrite=True)
    np.testing.assert_array_equal(open_dense(dense_url).compute(), np.zeros((2, 2)))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.zarr", "d.zarr", "ds.zarr"]


def test_overwrite_that_fails_keeps_the_old_store(tmp_path):
    url = str(tmp_path / "ds.zarr")
    X, Y = random_csr(10, 3, seed=82), random_labels(10, 2)
    make_dataset(url, X, Y, block_rows=4, n_features=3, n_labels=2)
    before = snapshot(url)
    with pytest.raises(RuntimeError, match="boom"):
        with DatasetWriter.create(url, overwrite=True) as writer:
            writer.write(random_csr(5, 3), random_labels(5, 2))
            raise RuntimeError("boom")
    assert_same_snapshot(snapshot(url), before)
    assert [p.name for p in tmp_path.iterdir()] == ["ds.zarr"]


@pytest.mark.parametrize("kind", ["csr", "dataset", "dense"])
def test_incomplete_store_is_refused(tmp_path, kind):
    url = str(tmp_path / "s.zarr")
    if kind == "csr":
        write_csr(url, random_csr(5, 3))
        opener = open_csr
    elif kind == "dataset":
        make_dataset(url, random_csr(5, 3), random_labels(5, 2), block_rows=2, n_features=3, n_labels=2)
        opener = open_dataset
    else:
        write_dense(url, np.ones((3, 2)))
        opener = open_dense
    opener(url)
    set_attr(url, "complete", False)
    with pytest.raises(StoreError, match="s.zarr is incomplete: its write was interrupted or is still running"):
        opener(url)
    set_attr(url, "complete", True)
    set_attr(url, "layout_version", 99)
    with pytest.raises(StoreError, match="layout version 99; this xmldask reads version 1"):
        opener(url)


@pytest.mark.parametrize(
    ("kind", "opener", "expected"),
    [
        ("csr", open_dataset, "holds a 'csr' store, expected 'dataset'"),
        ("csr", open_dense, "holds a 'csr' store, expected 'dense'"),
        ("dataset", open_csr, "holds a 'dataset' store, expected 'csr'"),
        ("dense", open_csr, "holds a 'dense' store, expected 'csr'"),
        ("dense", open_dataset, "holds a 'dense' store, expected 'dataset'"),
    ],
)
def test_store_of_another_kind_is_refused(tmp_path, kind, opener, expected):
    url = str(tmp_path / "s.zarr")
    if kind == "csr":
        write_csr(url, random_csr(5, 3))
    elif kind == "dataset":
        make_dataset(url, random_csr(5, 3), random_labels(5, 2), block_rows=2, n_features=3, n_labels=2)
    else:
        write_dense(url, np.ones((3, 2)))
    with pytest.raises(StoreError, match=expected):
        opener(url)


@pytest.mark.parametrize("opener", [open_csr, open_dataset, open_dense])
def test_missing_or_foreign_store_is_refused(tmp_path, opener):
    with pytest.raises(StoreError, match="no .*store at"):
        opener(str(tmp_path / "missing.zarr"))
    zarr.open_group(str(tmp_path / "plain.zarr"), mode="w").attrs["x"] = 1
    with pytest.raises(StoreError, match="is not an xmldask store"):
        opener(str(tmp_path / "plain.zarr"))


# ---------------------------------------------------------------------------------------------- dense


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_dense_numpy_round_trip(tmp_path, dtype):
    x = np.random.default_rng(0).standard_normal((103, 7)).astype(dtype)
    url = str(tmp_path / "d.zarr")
    write_dense(url, x, block_rows=10)
    y = open_dense(url)
    assert y.dtype == dtype
    assert y.chunks == ((10,) * 10 + (3,), (7,))
    np.testing.assert_array_equal(y.compute(), x)
    attrs = csr_attrs(url)
    assert attrs["encoding-type"] == "array"
    assert attrs["shape"] == [103, 7]
    assert attrs[ATTR]["kind"] == "dense"


def test_dense_numpy_default_block_rows(tmp_path):
    x = np.arange(12.0).reshape(4, 3)
    write_dense(str(tmp_path / "d.zarr"), x)
    y = open_dense(str(tmp_path / "d.zarr"))
    assert y.chunks == ((4,), (3,))
    np.testing.assert_array_equal(y.compute(), x)


@pytest.mark.parametrize(
    ("chunks", "block_rows", "expected"),
    [
        ((7, 30, 1, 65), None, (7,) * 14 + (5,)),
        ((7, 30, 1, 65), 25, (25, 25, 25, 25, 3)),
        ((50, 50, 3), None, (50, 50, 3)),
    ],
)
def test_dense_dask_round_trip(tmp_path, chunks, block_rows, expected):
    x = np.random.default_rng(1).standard_normal((103, 5)).astype(np.float32)
    dx = da.from_array(x, chunks=(chunks, (2, 3)))
    url = str(tmp_path / "d.zarr")
    write_dense(url, dx, block_rows=block_rows)
    y = open_dense(url)
    assert y.chunks == (expected, (5,))
    assert y.dtype == np.float32
    np.testing.assert_array_equal(y.compute(), x)


def test_dense_needs_two_dimensions(tmp_path):
    with pytest.raises(ValueError, match="expected a 2-D array, got shape"):
        write_dense(str(tmp_path / "d.zarr"), np.ones(5))
    assert list(tmp_path.iterdir()) == []
