"""Ingest of XC, LIBSVM and VW text into dataset stores: round trips, transforms, appends, bad input."""

from __future__ import annotations

import gzip
import hashlib
import zlib
from pathlib import Path

import numpy as np
import pytest
import scipy.sparse as sp

from xmldask.io import FORMATS, ParseError, ingest
from xmldask.io.parse import parse_header
from xmldask.store import exists, open_dataset, to_scipy

# ---------------------------------------------------------------------------------------------- helpers


def make_data(seed=0, *, n_rows=103, n_features=40, n_labels=12, nonnegative=False):
    """A small random multilabel dataset with float32 values (integers, decimals, tiny ones).

    Rows 0, 17 and 50 have no labels; rows 4, 17 and the last have no features; row 2 uses the last
    feature and label, so that formats without a header infer the full dimensions.
    """
    rng = np.random.default_rng(seed)
    shape = (n_rows, n_features)
    values = rng.standard_normal(shape).astype(np.float32)
    values[rng.random(shape) < 0.3] = rng.integers(1, 4)
    values[rng.random(shape) < 0.1] *= np.float32(1e-7)
    values[values == 0] = 1
    if nonnegative:
        values = np.abs(values)
    dense = np.where(rng.random(shape) < 0.15, values, 0).astype(np.float32)
    dense[[r for r in (4, 17) if r < n_rows] + [n_rows - 1]] = 0
    dense[2, -1] = 1.5
    labels = (rng.random((n_rows, n_labels)) < 0.2).astype(np.float32)
    labels[[r for r in (0, 17, 50) if r < n_rows]] = 0
    labels[2, -1] = 1
    labels[n_rows - 1, 0] = 1
    return sp.csr_matrix(dense), sp.csr_matrix(labels)


def text_value(v) -> str:
    """Exact decimal text of a float32 value: integers plain, others as the repr of the double."""
    v = float(v)
    return str(int(v)) if v.is_integer() else repr(v)


def to_lines(X, Y, fmt, *, one_based=False, header=None) -> list[str]:
    """The lines of ``X``, ``Y`` in ``fmt`` (a tiny writer, independent of xmldask)."""
    base = int(one_based)
    lines = [" ".join(map(str, header or (X.shape[0], X.shape[1], Y.shape[1])))] if fmt == "xc" else []
    for i in range(X.shape[0]):
        labels = ",".join(str(j + base) for j in Y.indices[Y.indptr[i] : Y.indptr[i + 1]])
        tokens = []
        for j, v in zip(X.indices[X.indptr[i] : X.indptr[i + 1]], X.data[X.indptr[i] : X.indptr[i + 1]]):
            # VW: a feature without ":v" has the value 1
            tokens.append(str(j + base) if fmt == "vw" and v == 1 else f"{j + base}:{text_value(v)}")
        features = " ".join(tokens)
        lines.append(f"{labels} | {features}" if fmt == "vw" else f"{labels} {features}")
    return lines


def write_text(path: Path, lines, *, trailing_newline=True) -> Path:
    data = ("\n".join(lines) + ("\n" if trailing_newline else "")).encode()
    path.write_bytes(gzip.compress(data, mtime=0) if path.name.endswith(".gz") else data)
    return path


def reference_parse(path: Path, fmt: str, *, one_based=False, n_features=None, n_labels=None):
    """An independent, line-by-line parser: (X, Y) as float32 CSR."""
    opener = gzip.open if path.name.endswith(".gz") else open
    with opener(path, "rt", encoding="utf-8") as f:
        lines = f.read().split("\n")
    if fmt == "xc":
        _, n_features, n_labels = (int(t) for t in lines.pop(0).split())
    base = int(one_based)
    rx, cx, vx, ry, cy = [], [], [], [], []
    row = 0
    for line in lines:
        if line == "":
            continue
        if fmt == "vw":
            labels, _, features = line.partition("|")
            labels = labels.strip()
        else:
            first, _, rest = line.partition(" ")
            labels, features = ("", line) if line[0] == " " or ":" in first else (first, rest)
        for label in labels.split(",") if labels else []:
            ry.append(row)
            cy.append(int(label) - base)
        for token in features.split():
            fid, _, value = token.partition(":")
            rx.append(row)
            cx.append(int(fid) - base)
            vx.append(float(value) if value else 1.0)
        row += 1
    n_features = n_features if n_features is not None else max(cx) + 1
    n_labels = n_labels if n_labels is not None else max(cy) + 1
    X = sp.csr_matrix((np.asarray(vx, np.float32), (rx, cx)), shape=(row, n_features))
    Y = sp.csr_matrix((np.ones(len(ry), np.float32), (ry, cy)), shape=(row, n_labels))
    return X, Y


def assert_csr_equal(actual, expected):
    assert actual.shape == expected.shape
    assert actual.dtype == expected.dtype
    assert (sp.csr_matrix(actual) != sp.csr_matrix(expected)).nnz == 0


def block_bounds(n_rows, block_rows):
    return list(range(0, n_rows, block_rows)) + [n_rows] if n_rows else [0]


def check_dataset(ds, X, Y, block_rows):
    assert ds.n_samples == X.shape[0]
    assert ds.n_features == X.shape[1]
    assert ds.n_labels == Y.shape[1]
    assert ds.meta["nnz"] == X.nnz
    assert ds.meta["nnz_labels"] == Y.nnz
    assert ds.meta["rows_without_labels"] == int(np.count_nonzero(Y.getnnz(axis=1) == 0))
    assert ds.meta["row_blocks"] == block_bounds(X.shape[0], block_rows)
    assert ds.X.chunks[0] == ds.Y.chunks[0] == tuple(np.diff(ds.meta["row_blocks"]))
    assert_csr_equal(to_scipy(ds.X), X)
    assert_csr_equal(to_scipy(ds.Y), Y)
    np.testing.assert_array_equal(ds.label_counts, Y.getnnz(axis=0))


def snapshot(url) -> dict:
    ds = open_dataset(url)
    return {"meta": ds.meta, "X": to_scipy(ds.X), "Y": to_scipy(ds.Y), "counts": ds.label_counts}


def assert_same_snapshot(actual, expected):
    assert actual["meta"] == expected["meta"]
    assert_csr_equal(actual["X"], expected["X"])
    assert_csr_equal(actual["Y"], expected["Y"])
    np.testing.assert_array_equal(actual["counts"], expected["counts"])


def partial_entries(path: Path) -> list[Path]:
    return [p for p in path.rglob("*") if ".partial-" in p.name]


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


FILE_NAMES = {  # (format, gzip): a name; VW is detected by the name or by the bar of its first line
    ("xc", True): "train.txt.gz",
    ("xc", False): "train.txt",
    ("libsvm", True): "train.svm.gz",
    ("libsvm", False): "train.svm",
    ("vw", True): "train.vw.gz",
    ("vw", False): "train.txt",
}


# ---------------------------------------------------------------------------------------------- round trips


ROUND_TRIPS = [  # every reader x {gzip, plain} x {0-, 1-based} in batches of ~200 bytes, and in one batch
    *((fmt, gz, one_based, 200) for fmt in FORMATS for gz in (True, False) for one_based in (False, True)),
    *((fmt, gz, one_based, 4 << 20) for fmt, gz, one_based in [("xc", True, False), ("libsvm", False, True),
                                                                 ("vw", True, True)]),
]


@pytest.mark.parametrize(
    ("fmt", "gz", "one_based", "batch_bytes"),
    ROUND_TRIPS,
    ids=[f"{f}-{'gzip' if g else 'plain'}-{int(o)}-based-batch{b}" for f, g, o, b in ROUND_TRIPS],
)
def test_round_trip(tmp_path, fmt, gz, one_based, batch_bytes):
    X, Y = make_data(seed=len(fmt) + 2 * gz + 4 * one_based)
    lines = to_lines(X, Y, fmt, one_based=one_based)
    path = write_text(tmp_path / FILE_NAMES[fmt, gz], lines, trailing_newline=gz)
    out = str(tmp_path / "ds.zarr")
    ds = ingest(str(path), out, one_based=one_based, block_rows=25, batch_bytes=batch_bytes)
    check_dataset(ds, X, Y, 25)  # blocks of 25, 25, 25, 25 and 3 rows
    assert open_dataset(out).meta == ds.meta
    X_ref, Y_ref = reference_parse(path, fmt, one_based=one_based)
    assert_csr_equal(X_ref, X)
    assert_csr_equal(Y_ref, Y)
    (source,) = ds.meta["sources"]
    assert source == {"path": str(path), "format": fmt, "sha256": sha256(path), "bytes": path.stat().st_size,
                      "rows": X.shape[0], "first_row": 0, "lines": len(lines)}
    assert ds.meta["transforms"] == {"normalize": "none", "bias": None, "one_based": one_based,
                                     "duplicates": "error", "bias_column": None}
    assert partial_entries(tmp_path) == []


@pytest.mark.parametrize("fmt", FORMATS)
def test_explicit_format(tmp_path, fmt):
    X, Y = make_data(seed=9, n_rows=31)
    path = write_text(tmp_path / "data", to_lines(X, Y, fmt))
    ds = ingest(str(path), str(tmp_path / "ds.zarr"), format=fmt, block_rows=8)
    check_dataset(ds, X, Y, 8)
    assert ds.meta["sources"][0]["format"] == fmt


def test_explicit_dimensions(tmp_path):
    X, Y = make_data(seed=10, n_rows=20, n_features=6, n_labels=4)
    path = write_text(tmp_path / "a.svm", to_lines(X, Y, "libsvm"))
    ds = ingest(str(path), str(tmp_path / "ds.zarr"), n_features=9, n_labels=7, block_rows=8)
    check_dataset(ds, sp.hstack([X, sp.csr_matrix((20, 3), dtype=np.float32)], format="csr"),
                  sp.hstack([Y, sp.csr_matrix((20, 3), dtype=np.float32)], format="csr"), 8)


def test_blank_lines_crlf_tabs_and_bare_rows(tmp_path):
    """Empty lines are skipped but counted; CRLF endings; tab after labels; rows of spaces."""
    path = tmp_path / "a.txt"
    path.write_bytes(b"4 5 3\r\n0,2 1:1.5 3:2\r\n\r\n   \r\n2\t4:-1\r\n\r\n 0:7\r\n")
    ds = ingest(str(path), str(tmp_path / "ds.zarr"), block_rows=3)
    X = sp.csr_matrix(np.array([[0, 1.5, 0, 2, 0], [0] * 5, [0, 0, 0, 0, -1], [7, 0, 0, 0, 0]], np.float32))
    Y = sp.csr_matrix(np.array([[1, 0, 1], [0, 0, 0], [0, 0, 1], [0, 0, 0]], np.float32))
    check_dataset(ds, X, Y, 3)
    assert ds.meta["sources"][0]["lines"] == 7
    # a bad row after the blank lines is reported at its own line
    path.write_bytes(b"4 5 3\r\n0,2 1:1.5\r\n\r\n   \r\n2\t4:x\r\n 0:7\r\n")
    with pytest.raises(ParseError, match=r"line 5: value of feature 4 'x' is not a number"):
        ingest(str(path), str(tmp_path / "ds2.zarr"))


def test_empty_sources(tmp_path):
    header_only = write_text(tmp_path / "a.txt", ["0 5 3"])
    ds = ingest(str(header_only), str(tmp_path / "ds.zarr"))
    assert (ds.n_samples, ds.n_features, ds.n_labels) == (0, 5, 3)
    assert to_scipy(ds.X).shape == (0, 5)
    empty = tmp_path / "b.svm"
    empty.write_bytes(b"")
    ds = ingest(str(empty), str(tmp_path / "ds2.zarr"), n_features=4, n_labels=2)
    assert (ds.n_samples, ds.n_features, ds.n_labels) == (0, 4, 2)


def test_several_sources_concatenate(tmp_path):
    X, Y = make_data(seed=11, n_rows=90)
    parts = [(0, 35, "xc", "a.txt.gz"), (35, 36, "libsvm", "b.svm"), (36, 90, "vw", "c.vw")]
    paths = []
    for a, b, fmt, name in parts:
        lines = to_lines(X[a:b], Y[a:b], fmt, header=(b - a, X.shape[1], Y.shape[1]))
        paths.append(write_text(tmp_path / name, lines))
    ds = ingest([str(p) for p in paths], str(tmp_path / "ds.zarr"), block_rows=16, batch_bytes=300)
    check_dataset(ds, X, Y, 16)
    assert [s["path"] for s in ds.meta["sources"]] == [str(p) for p in paths]
    assert [s["format"] for s in ds.meta["sources"]] == ["xc", "libsvm", "vw"]
    assert [s["sha256"] for s in ds.meta["sources"]] == [sha256(p) for p in paths]
    assert [s["rows"] for s in ds.meta["sources"]] == [35, 1, 54]
    assert [s["first_row"] for s in ds.meta["sources"]] == [0, 35, 36]
    assert [s["bytes"] for s in ds.meta["sources"]] == [p.stat().st_size for p in paths]
    assert [s["lines"] for s in ds.meta["sources"]] == [36, 1, 54]
    assert ds.info()["sources"] == [{k: s[k] for k in ("path", "format", "rows", "sha256")}
                                    for s in ds.meta["sources"]]


def test_fsspec_urls(tmp_path):
    """Sources and stores addressed by fsspec URLs (here the in-memory file system)."""
    import fsspec

    X, Y = make_data(seed=20, n_rows=40)
    lines = to_lines(X, Y, "xc")
    fs = fsspec.filesystem("memory")
    root = f"xmldask-ingest-{tmp_path.name}"
    try:
        fs.pipe(f"/{root}/in/a.txt.gz", gzip.compress(("\n".join(lines) + "\n").encode()))
        ds = ingest(f"memory://{root}/in/a.txt.gz", f"memory://{root}/ds.zarr", block_rows=16, batch_bytes=300)
        check_dataset(ds, X, Y, 16)
        assert ds.meta["sources"][0]["sha256"] == hashlib.sha256(fs.cat(f"/{root}/in/a.txt.gz")).hexdigest()
        assert not [p for p in fs.find(f"/{root}", withdirs=True) if ".partial-" in p]
    finally:
        fs.rm(f"/{root}", recursive=True)


def test_sources_with_disagreeing_headers(tmp_path):
    a = write_text(tmp_path / "a.txt", ["1 5 3", "0 1:1"])
    b = write_text(tmp_path / "b.txt", ["1 6 3", "0 1:1"])
    out = str(tmp_path / "ds.zarr")
    with pytest.raises(ParseError, match=r"b\.txt, line 1: the header gives n_features = 6, but 5 was expected"):
        ingest([str(a), str(b)], out)
    assert not exists(out)


def test_missing_source(tmp_path):
    with pytest.raises(FileNotFoundError, match="no such source file"):
        ingest(str(tmp_path / "nothing.txt"), str(tmp_path / "ds.zarr"))
    assert list(tmp_path.iterdir()) == []


def test_option_checks(tmp_path):
    path = write_text(tmp_path / "a.txt", ["1 5 3", "0 1:1"])
    out = str(tmp_path / "ds.zarr")
    with pytest.raises(ValueError, match="no source files given"):
        ingest([], out)
    with pytest.raises(ValueError, match="format must be one of"):
        ingest(str(path), out, format="csv")
    with pytest.raises(ValueError, match="normalize must be one of"):
        ingest(str(path), out, normalize="max")
    with pytest.raises(ValueError, match="duplicates must be 'error' or 'sum'"):
        ingest(str(path), out, duplicates="max")
    with pytest.raises(ValueError, match="append and overwrite exclude each other"):
        ingest(str(path), out, append=True, overwrite=True)
    assert not exists(out)
    assert partial_entries(tmp_path) == []


# ---------------------------------------------------------------------------------------------- transforms


def reference_transform(X, normalize, bias):
    dense = X.toarray().astype(np.float64)
    if normalize in ("l1", "sqrt"):
        norms = np.abs(dense).sum(axis=1)
    elif normalize == "l2":
        norms = np.sqrt((dense**2).sum(axis=1))
    else:
        norms = np.ones(dense.shape[0])
    dense = dense / np.where(norms > 0, norms, 1)[:, None]
    if normalize == "sqrt":
        dense = np.sqrt(dense)
    if bias is not None:
        dense = np.hstack([dense, np.full((dense.shape[0], 1), bias)])
    return dense.astype(np.float32)


@pytest.mark.parametrize("bias", [None, 1.0, 2.5])
@pytest.mark.parametrize("normalize", ["none", "l2", "l1", "sqrt"])
def test_transforms(tmp_path, normalize, bias):
    X, Y = make_data(seed=12, nonnegative=normalize == "sqrt")
    path = write_text(tmp_path / "a.txt.gz", to_lines(X, Y, "xc"))
    ds = ingest(str(path), str(tmp_path / "ds.zarr"), normalize=normalize, bias=bias, block_rows=40,
                batch_bytes=500)
    got = to_scipy(ds.X)
    assert got.dtype == np.float32
    expected = reference_transform(X, normalize, bias)
    np.testing.assert_allclose(got.toarray(), expected, rtol=2e-7, atol=0)
    assert ds.n_features == X.shape[1] + (bias is not None)
    assert ds.meta["transforms"]["normalize"] == normalize
    assert ds.meta["transforms"]["bias"] == bias
    assert ds.meta["transforms"]["bias_column"] == (X.shape[1] if bias is not None else None)
    assert_csr_equal(to_scipy(ds.Y), Y)
    norms = {"l2": 2, "sqrt": 2, "l1": 1}
    if normalize in norms:
        features = got[:, : X.shape[1]].toarray().astype(np.float64)
        row_norms = np.linalg.norm(features, ord=norms[normalize], axis=1)
        has_features = X.getnnz(axis=1) > 0
        np.testing.assert_allclose(row_norms[has_features], 1, rtol=1e-6)
        np.testing.assert_array_equal(row_norms[~has_features], 0)
    if bias is not None:
        np.testing.assert_array_equal(got[:, -1].toarray().ravel(), np.float32(bias))


def test_hellinger_is_sqrt_of_l1_normalised_rows(tmp_path):
    path = write_text(tmp_path / "a.txt", ["2 4 1", "0 0:1 1:3", "0 2:4 3:12"])
    ds = ingest(str(path), str(tmp_path / "ds.zarr"), normalize="sqrt")
    np.testing.assert_allclose(to_scipy(ds.X).toarray(), [[0.5, np.sqrt(0.75), 0, 0], [0, 0, 0.5, np.sqrt(0.75)]],
                               rtol=1e-7)


@pytest.mark.parametrize("normalize", ["l2", "l1", "sqrt"])
def test_normalize_batches_without_features(tmp_path, normalize):
    """One line per batch: some batches (and row blocks) hold no feature value at all."""
    path = write_text(tmp_path / "a.txt", ["4 3 2", "0 0:3 2:4", "1", " ", "0,1 1:2"])
    ds = ingest(str(path), str(tmp_path / "ds.zarr"), normalize=normalize, bias=1.0, batch_bytes=1, block_rows=1)
    X = sp.csr_matrix(np.array([[3, 0, 4], [0, 0, 0], [0, 0, 0], [0, 2, 0]], np.float32))
    np.testing.assert_allclose(to_scipy(ds.X).toarray(), reference_transform(X, normalize, 1.0), rtol=2e-7)


def test_bias_needs_the_number_of_features(tmp_path):
    X, Y = make_data(seed=13, n_rows=20)
    path = write_text(tmp_path / "a.svm", to_lines(X, Y, "libsvm"))
    out = str(tmp_path / "ds.zarr")
    with pytest.raises(ValueError, match="bias needs the number of features up front"):
        ingest(str(path), out, bias=1.0)
    assert not exists(out)
    ds = ingest(str(path), out, bias=1.0, n_features=X.shape[1], block_rows=8)
    np.testing.assert_array_equal(to_scipy(ds.X).toarray(), reference_transform(X, "none", 1.0))


# ---------------------------------------------------------------------------------------------- append


def test_append(tmp_path):
    X, Y = make_data(seed=14, n_rows=100)
    files = []
    for i, (a, b) in enumerate([(0, 45), (45, 80), (80, 100)]):
        files.append(write_text(tmp_path / f"part{i}.txt.gz", to_lines(X[a:b], Y[a:b], "xc")))
    out = str(tmp_path / "ds.zarr")
    first = ingest(str(files[0]), out, block_rows=20)
    check_dataset(first, X[:45], Y[:45], 20)
    ds = ingest(str(files[1]), out, append=True, block_rows=20)
    assert ds.meta["row_blocks"] == [0, 20, 40, 45, 65, 80]
    assert_csr_equal(to_scipy(ds.X), X[:80])
    assert_csr_equal(to_scipy(ds.Y), Y[:80])
    np.testing.assert_array_equal(ds.label_counts, Y[:80].getnnz(axis=0))
    assert ds.meta["nnz"] == X[:80].nnz
    assert ds.meta["rows_without_labels"] == int(np.count_nonzero(Y[:80].getnnz(axis=1) == 0))
    assert [s["sha256"] for s in ds.meta["sources"]] == [sha256(files[0]), sha256(files[1])]
    assert [s["first_row"] for s in ds.meta["sources"]] == [0, 45]
    assert ds.meta["generation"] != first.meta["generation"]
    assert ds.meta["transforms"] == first.meta["transforms"]

    # the same file again: refused, or skipped
    before = snapshot(out)
    with pytest.raises(ValueError, match=r"part1\.txt\.gz was already ingested into .*same sha256"):
        ingest(str(files[1]), out, append=True)
    assert_same_snapshot(snapshot(out), before)
    same = ingest(str(files[1]), out, append=True, skip_ingested=True)
    assert same.meta == before["meta"]
    assert_same_snapshot(snapshot(out), before)
    # a copy under another name has the same checksum
    copy = tmp_path / "copy.txt.gz"
    copy.write_bytes(files[1].read_bytes())
    with pytest.raises(ValueError, match="already ingested"):
        ingest(str(copy), out, append=True)
    # skipping the known file, appending the new one
    ds = ingest([str(files[1]), str(files[2])], out, append=True, skip_ingested=True, block_rows=20)
    assert ds.meta["row_blocks"] == [0, 20, 40, 45, 65, 80, 100]
    assert_csr_equal(to_scipy(ds.X), X)
    assert_csr_equal(to_scipy(ds.Y), Y)
    np.testing.assert_array_equal(ds.label_counts, Y.getnnz(axis=0))
    assert [s["path"] for s in ds.meta["sources"]] == [str(f) for f in files]


def test_append_keeps_transforms(tmp_path):
    X, Y = make_data(seed=15, n_rows=60)
    a = write_text(tmp_path / "a.txt", to_lines(X[:30], Y[:30], "xc"))
    b = write_text(tmp_path / "b.txt", to_lines(X[30:], Y[30:], "xc"))
    out = str(tmp_path / "ds.zarr")
    ingest(str(a), out, normalize="l2", bias=1.0, block_rows=16)
    before = snapshot(out)
    with pytest.raises(ValueError, match="would mix two encodings"):
        ingest(str(b), out, append=True)
    assert_same_snapshot(snapshot(out), before)
    ds = ingest(str(b), out, append=True, normalize="l2", bias=1.0, block_rows=16)
    np.testing.assert_allclose(to_scipy(ds.X).toarray(), reference_transform(X, "l2", 1.0), rtol=2e-7)
    assert ds.n_features == X.shape[1] + 1


def test_append_with_libsvm_keeps_dimensions(tmp_path):
    X, Y = make_data(seed=16, n_rows=40)
    a = write_text(tmp_path / "a.txt", to_lines(X[:20], Y[:20], "xc"))
    b = write_text(tmp_path / "b.svm", to_lines(X[20:21], Y[20:21], "libsvm"))  # uses few features
    out = str(tmp_path / "ds.zarr")
    ingest(str(a), out, block_rows=8)
    ds = ingest(str(b), out, append=True, block_rows=8)
    assert (ds.n_features, ds.n_labels) == (X.shape[1], Y.shape[1])
    assert_csr_equal(to_scipy(ds.X), X[:21])


def test_append_error_leaves_dataset_unchanged(tmp_path):
    X, Y = make_data(seed=17, n_rows=50, n_features=10, n_labels=5)
    a = write_text(tmp_path / "a.txt", to_lines(X[:30], Y[:30], "xc"))
    out = str(tmp_path / "ds.zarr")
    ingest(str(a), out, block_rows=8)
    before = snapshot(out)
    good = to_lines(X[30:], Y[30:], "libsvm")
    bad = write_text(tmp_path / "bad.svm", good[:15] + ["1 3:1 10:2"] + good[15:])
    with pytest.raises(ParseError, match=r"bad\.svm, line 16: feature id 10 is out of range") as info:
        ingest(str(bad), out, append=True, batch_bytes=100)
    assert info.value.line == 16
    assert_same_snapshot(snapshot(out), before)
    header = write_text(tmp_path / "b.txt", ["20 11 5"] + good)
    with pytest.raises(ParseError, match=r"b\.txt, line 1: the header gives n_features = 11, but 10"):
        ingest(str(header), out, append=True)
    assert_same_snapshot(snapshot(out), before)
    assert partial_entries(tmp_path) == []
    ds = ingest(str(write_text(tmp_path / "c.svm", good)), out, append=True, block_rows=8)
    assert_csr_equal(to_scipy(ds.X), X)
    assert_csr_equal(to_scipy(ds.Y), Y)


def test_append_to_missing_dataset(tmp_path):
    path = write_text(tmp_path / "a.txt", ["1 5 3", "0 1:1"])
    with pytest.raises(Exception, match="no dataset store"):
        ingest(str(path), str(tmp_path / "ds.zarr"), append=True)


def test_existing_store_without_overwrite(tmp_path):
    X, Y = make_data(seed=18, n_rows=30)
    a = write_text(tmp_path / "a.txt", to_lines(X, Y, "xc"))
    out = str(tmp_path / "ds.zarr")
    ingest(str(a), out, block_rows=8)
    before = snapshot(out)
    with pytest.raises(FileExistsError, match=r"ds\.zarr already exists; pass overwrite=True"):
        ingest(str(a), out)
    assert_same_snapshot(snapshot(out), before)
    # an overwrite that fails keeps the old store
    bad = write_text(tmp_path / "bad.txt", ["1 5 3", "0 1:x"])
    with pytest.raises(ParseError, match=r"bad\.txt, line 2"):
        ingest(str(bad), out, overwrite=True)
    assert_same_snapshot(snapshot(out), before)
    # a successful one replaces it
    X2, Y2 = make_data(seed=19, n_rows=12)
    b = write_text(tmp_path / "b.txt", to_lines(X2, Y2, "xc"))
    check_dataset(ingest(str(b), out, overwrite=True, block_rows=5), X2, Y2, 5)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.txt", "b.txt", "bad.txt", "ds.zarr"]


# ---------------------------------------------------------------------------------------------- bad input


def good_lines(fmt, n=30):
    """Valid rows whose ids (labels 1-4, features 1-9) are in range both 0- and 1-based (10 features, 5 labels)."""
    bar = " | " if fmt == "vw" else " "
    return [f"{1 + i % 4}{bar}{1 + i % 7}:1 {8 + i % 2}:2.5" for i in range(n)]


BAD_LINES = [
    # id, format, bad line, options, expected text in the message
    # tokens
    ("malformed-token", "xc", "1 3:4:5 6:1", {}, "malformed token '3:4:5'"),
    ("token-without-value", "libsvm", "1 3:4 oops", {}, "malformed token 'oops'"),
    # feature values
    ("non-numeric-value", "xc", "1 3:abc", {}, "value of feature 3 'abc' is not a number"),
    ("underscore-value", "xc", "1 3:1_0", {}, "'1_0' is not a number"),
    ("non-ascii-digit", "xc", "1 3:\u0661", {}, "'\u0661' is not a number"),
    ("non-ascii-space", "libsvm", "1 3:4\u00a05:6", {}, "malformed token"),
    ("nan-value", "xc", "1 3:nan", {}, "feature value nan is not a finite number"),
    ("inf-value", "xc", "1 3:inf", {}, "feature value inf is not a finite number"),
    ("minus-inf-value", "libsvm", "1 3:-Infinity", {}, "feature value -inf is not a finite number"),
    # feature ids
    ("feature-out-of-range", "xc", "1 10:1", {}, "feature id 10 is out of range: ids must be integers [0, 10)"),
    ("feature-out-of-range-1-based", "xc", "1 11:1", {"one_based": True},
     "feature id 11 is out of range: ids must be integers [1, 11)"),
    ("feature-zero-1-based", "xc", "1 0:1", {"one_based": True}, "feature id 0 is out of range"),
    ("negative-feature-id", "xc", "1 -1:2", {}, "feature id -1 is out of range"),
    ("negative-feature-id-libsvm", "libsvm", "1 -3:2", {}, "feature id -3 is out of range: ids must be integers >= 0"),
    ("feature-id-not-integer", "xc", "1 2.5:1", {}, "feature id 2.5 is not an integer"),
    ("feature-id-not-a-number", "libsvm", "1 x:1", {}, "feature id 'x' is not an integer"),
    # label ids
    ("label-out-of-range", "xc", "5 3:1", {}, "label id 5 is out of range: ids must be integers [0, 5)"),
    ("label-out-of-range-1-based", "xc", "6 3:1", {"one_based": True}, "label id 6 is out of range"),
    ("label-not-integer", "xc", "1.5 3:1", {}, "label id 1.5 is not an integer"),
    ("label-not-a-number", "libsvm", "a,b 3:1", {}, "label id 'a' is not an integer"),
    ("empty-label", "xc", "1,,2 3:1", {}, "malformed labels: empty label id"),
    # repeated ids
    ("duplicate-feature", "xc", "1 3:1 5:1 3:2", {}, "feature id 3 appears twice in the row"),
    ("duplicate-feature-1-based", "xc", "1 3:1 3:2", {"one_based": True}, "feature id 3 appears twice"),
    ("duplicate-label", "xc", "1,2,1 3:1", {}, "label id 1 appears twice in the row"),
    # Vowpal Wabbit
    ("vw-namespace", "vw", "1 |ns 3:1", {}, "Vowpal Wabbit namespaces ('|name') are not supported"),
    ("vw-importance-weight", "vw", "1 2.0 | 3:1", {}, "importance weights and tags are not supported"),
    ("vw-without-bar", "vw", "1 3:1", {}, "a Vowpal Wabbit line needs 'labels | features'"),
    ("vw-bad-value", "vw", "1 | 3:x", {}, "value of feature 3 'x' is not a number"),
    # transforms
    ("sqrt-of-negative", "xc", "1 3:-2", {"normalize": "sqrt"}, "negative feature value"),
]


@pytest.mark.slow
@pytest.mark.parametrize(("batch_bytes", "gz"), [(100, False), (4 << 20, True)], ids=["batch100-plain", "batch4M-gzip"])
@pytest.mark.parametrize(("fmt", "bad", "options", "expected"), [c[1:] for c in BAD_LINES],
                         ids=[c[0] for c in BAD_LINES])
def test_bad_line(tmp_path, fmt, bad, options, expected, batch_bytes, gz):
    rows = good_lines(fmt)
    rows.insert(21, bad)
    lines = (["30 10 5"] if fmt == "xc" else []) + rows
    line = 22 + (fmt == "xc")
    path = write_text(tmp_path / (("data.vw" if fmt == "vw" else "data.txt") + (".gz" if gz else "")), lines)
    out = str(tmp_path / "ds.zarr")
    with pytest.raises(ParseError) as info:
        ingest(str(path), out, batch_bytes=batch_bytes, **options)
    message = str(info.value)
    assert message.startswith(f"{path}, line {line}: ")
    assert expected in message
    assert repr(bad) in message  # the offending line, quoted
    assert (info.value.path, info.value.line, info.value.text) == (str(path), line, bad)
    assert isinstance(info.value, ValueError)
    assert not exists(out)
    assert partial_entries(tmp_path) == []


def test_bad_line_without_failing_duplicates_sum(tmp_path):
    """With duplicates="sum", a repeated feature id adds its values and a repeated label counts once."""
    lines = ["3 6 4", "1,3,1 2:1.5 0:1 2:2.25", "0 5:1 5:-1", "2 1:1"]
    path = write_text(tmp_path / "a.txt", lines)
    ds = ingest(str(path), str(tmp_path / "ds.zarr"), duplicates="sum")
    X = np.zeros((3, 6), np.float32)
    X[0, [0, 2]] = [1, 3.75]
    X[2, 1] = 1
    np.testing.assert_array_equal(to_scipy(ds.X).toarray(), X)
    assert ds.meta["nnz"] == 3  # the sum 1 - 1 is no entry
    np.testing.assert_array_equal(to_scipy(ds.Y).toarray(), [[0, 1, 0, 1], [1, 0, 0, 0], [0, 0, 1, 0]])
    np.testing.assert_array_equal(ds.label_counts, [1, 1, 1, 1])
    assert ds.meta["nnz_labels"] == 4
    assert ds.meta["transforms"]["duplicates"] == "sum"


@pytest.mark.parametrize(("header", "rows", "kind"), [("31 10 5", 30, "too-few"), ("29 10 5", 30, "too-many")])
def test_header_row_count_disagrees(tmp_path, header, rows, kind):
    path = write_text(tmp_path / "data.txt.gz", [header] + good_lines("xc", rows))
    out = str(tmp_path / "ds.zarr")
    with pytest.raises(ParseError) as info:
        ingest(str(path), out, batch_bytes=100)
    claimed = header.split()[0]
    assert str(info.value) == f"{path}, line 1: the header says {claimed} rows but the file has {rows}: {header!r}"
    assert not exists(out)
    assert partial_entries(tmp_path) == []


def test_xc_format_needs_a_header(tmp_path):
    path = write_text(tmp_path / "data.svm", good_lines("libsvm"))
    out = str(tmp_path / "ds.zarr")
    with pytest.raises(ParseError) as info:
        ingest(str(path), out, format="xc")
    assert str(info.value) == (f"{path}, line 1: expected the XC header 'n_samples n_features n_labels' (the file "
                               "looks like LIBSVM: --format auto reads it): '1 1:1 8:2.5'")
    assert not exists(out)


@pytest.mark.parametrize("fmt", ["vw", "libsvm"])
def test_another_format_on_an_xc_file_suggests_auto(tmp_path, fmt):
    path = write_text(tmp_path / "data.txt", ["2 6 4", "1 2:1", "0,3 1:2"])
    with pytest.raises(ParseError, match=rf"line 1 is an XC header, not a {fmt} row \(the file looks like XC: "
                                         r"--format auto reads it\)"):
        ingest(str(path), str(tmp_path / "ds.zarr"), format=fmt)


def truncated_gzip(tmp_path, fraction):
    """A gzip file cut after ``fraction`` of its bytes, and the line the cut falls in (by zlib)."""
    rng = np.random.default_rng(0)
    lines = ["400 1000 50"] + [
        f"{rng.integers(50)} " + " ".join(f"{j}:{rng.random():.6f}" for j in np.sort(rng.choice(1000, 8, False)))
        for _ in range(400)
    ]
    data = gzip.compress(("\n".join(lines) + "\n").encode(), mtime=0)
    cut = data[: int(len(data) * fraction)]
    readable = zlib.decompressobj(wbits=31).decompress(cut)
    path = tmp_path / "cut.txt.gz"
    path.write_bytes(cut)
    return path, readable.count(b"\n") + 1


@pytest.mark.parametrize("batch_bytes", [200, 4 << 20], ids=["batch200", "batch4M"])
@pytest.mark.parametrize("fraction", [0.6, 0.999])
def test_truncated_gzip(tmp_path, batch_bytes, fraction):
    path, line = truncated_gzip(tmp_path, fraction)
    assert 100 < line <= 402
    out = str(tmp_path / "ds.zarr")
    with pytest.raises(ParseError) as info:
        ingest(str(path), out, batch_bytes=batch_bytes)
    assert str(info.value).startswith(f"{path}, line {line}: the gzip stream is truncated or corrupt")
    assert info.value.line == line
    assert not exists(out)
    assert partial_entries(tmp_path) == []


def test_gzip_truncated_in_its_first_line(tmp_path):
    path = tmp_path / "cut.txt.gz"
    path.write_bytes(gzip.compress(b"2 3 4\n0 1:1\n")[:12])
    with pytest.raises(ParseError, match=r"cut\.txt\.gz, line 1: the gzip stream is truncated"):
        ingest(str(path), str(tmp_path / "ds.zarr"))
    assert [p.name for p in tmp_path.iterdir()] == ["cut.txt.gz"]


def test_corrupt_gzip(tmp_path):
    data = bytearray(gzip.compress(("\n".join(["400 10 5"] + good_lines("xc", 400)) + "\n").encode()))
    data[len(data) // 2 : len(data) // 2 + 8] = b"\x00" * 8
    path = tmp_path / "bad.txt.gz"
    path.write_bytes(bytes(data))
    with pytest.raises(ParseError, match=r"bad\.txt\.gz, line \d+: the gzip stream is truncated or corrupt"):
        ingest(str(path), str(tmp_path / "ds.zarr"))
    assert [p.name for p in tmp_path.iterdir()] == ["bad.txt.gz"]


@pytest.mark.parametrize("batch_bytes", [100, 4 << 20], ids=["batch100", "batch4M"])
@pytest.mark.parametrize("where", [1, 23, 31])
def test_not_utf8(tmp_path, batch_bytes, where):
    lines = [s.encode() for s in ["30 10 5"] + good_lines("xc")]
    lines[where - 1] = lines[where - 1][:3] + b"\xff" + lines[where - 1][3:]
    path = tmp_path / "data.txt"
    path.write_bytes(b"\n".join(lines) + b"\n")
    out = str(tmp_path / "ds.zarr")
    with pytest.raises(ParseError) as info:
        ingest(str(path), out, format="xc", batch_bytes=batch_bytes)
    assert str(info.value).startswith(f"{path}, line {where}: the file is not UTF-8 text")
    assert info.value.text == lines[where - 1].decode("utf-8", "replace")
    assert not exists(out)
    assert partial_entries(tmp_path) == []


# ---------------------------------------------------------------------------------------------- real data


def count_tokens(path: Path) -> tuple[tuple[int, int, int], int, int, int]:
    """Header, number of ':' (feature tokens), of labels, and of rows without labels: counted on the raw text."""
    colons = labels = unlabelled = 0
    with gzip.open(path, "rt", encoding="utf-8") as f:
        header = tuple(int(t) for t in f.readline().split())
        for line in f:
            colons += line.count(":")
            first = line.split(" ", 1)[0].strip()
            if first and ":" not in first:
                labels += first.count(",") + 1
            else:
                unlabelled += 1
    return header, colons, labels, unlabelled


@pytest.mark.slow
@pytest.mark.shared_data
def test_real_data(tmp_path, shared_xc_file, shared_data):
    header, colons, labels, unlabelled = count_tokens(shared_xc_file)
    assert parse_header(" ".join(map(str, header))) == header
    ds = ingest(str(shared_xc_file), str(tmp_path / "ds.zarr"))
    assert (ds.n_samples, ds.n_features, ds.n_labels) == header
    assert ds.X.shape == header[:2]
    assert ds.Y.shape == (header[0], header[2])
    assert ds.meta["nnz"] == colons
    assert ds.meta["nnz_labels"] == labels
    assert ds.meta["rows_without_labels"] == unlabelled
    assert ds.meta["sources"][0]["format"] == "xc"
    assert ds.meta["sources"][0]["sha256"] == sha256(shared_xc_file)
    assert int(ds.label_counts.sum()) == labels


@pytest.mark.slow
@pytest.mark.shared_data
def test_real_data_aloi_vw_equals_xc(tmp_path, shared_data):
    vw, xc = shared_data / "aloi" / "aloi_train.vw.gz", shared_data / "aloi" / "train.txt.gz"
    if not (vw.exists() and xc.exists()):
        pytest.skip("ALOI is not in the shared data")
    from_xc = ingest(str(xc), str(tmp_path / "xc.zarr"))
    from_vw = ingest(str(vw), str(tmp_path / "vw.zarr"), one_based=True)
    assert from_vw.meta["sources"][0]["format"] == "vw"
    assert (from_vw.n_samples, from_vw.n_features, from_vw.n_labels) == (97200, 128, 1000)
    assert_csr_equal(to_scipy(from_vw.X), to_scipy(from_xc.X))
    assert_csr_equal(to_scipy(from_vw.Y), to_scipy(from_xc.Y))
