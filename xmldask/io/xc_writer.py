"""Write datasets in the text format of the Extreme Classification Repository.

The format: a header line ``n_samples n_features n_labels``, then one line per row::

    l1,l2,l3 f1:v1 f2:v2 ...

with 0-based label ids separated by commas, then the features as ``id:value`` pairs separated by
spaces. A row without labels starts with a single space, then its features; a row without features
is its labels alone (and a row with neither is a single space). Values are written compactly:
integral values as integers, others in the shortest form that reads back to the same float32.

References
----------
Bhatia, Dahiya, Jain, Kar, Mittal, Prabhu and Varma, "The Extreme Classification Repository:
Multi-label Datasets and Code" (http://manikvarma.org/downloads/XC/XMLRepository.html): the format.
"""

from __future__ import annotations

import contextlib
import gzip
import os
import posixpath
import uuid
from collections.abc import Iterable

import numpy as np
import scipy.sparse as sp
from fsspec.core import url_to_fs

__all__ = ["write_xc", "xc_lines"]

#: integral values up to this magnitude are written as integers
_INT_LIMIT = 2.0**53


def _format_values(values: np.ndarray) -> np.ndarray:
    """Compact text of values: integers for integral values, else the shortest float32 repr."""
    values = np.asarray(values, dtype=np.float32)
    integral = np.isfinite(values) & (values == np.round(values)) & (np.abs(values) < _INT_LIMIT)
    if integral.all():
        return values.astype(np.int64).astype(str)
    text = values.astype(str).astype(object)
    if integral.any():
        text[integral] = values[integral].astype(np.int64).astype(str)
    return text.astype(str)


def _check_piece(X, Y, n_features: int | None, n_labels: int | None) -> tuple[sp.csr_matrix, sp.csr_matrix]:
    X, Y = _canonical(X), _canonical(Y)
    if X.shape[0] != Y.shape[0]:
        raise ValueError(f"X has {X.shape[0]} rows but Y has {Y.shape[0]}")
    for name, M, limit in (("feature", X, n_features), ("label", Y, n_labels)):
        if limit is not None and M.nnz and int(M.indices.max()) >= limit:
            raise ValueError(f"{name} id {int(M.indices.max())} is out of range for {limit} {name}s")
    return X, Y


def _canonical(M) -> sp.csr_matrix:
    """``M`` as CSR with sorted indices and no duplicates, copied rather than changed if needed."""
    M = sp.csr_matrix(M)
    if not M.has_canonical_format:
        M = M.copy()
        M.sum_duplicates()
    return M


def _xc_text(X: sp.csr_matrix, Y: sp.csr_matrix) -> str:
    """The lines of the rows of ``X`` and ``Y``, each ending with a newline."""
    n = X.shape[0]
    x_len, y_len = np.diff(X.indptr), np.diff(Y.indptr)
    empty = (x_len == 0) & (y_len == 0)
    # piece layout of row i: its labels, its features, then " " if the row is empty, then "\n"
    row_len = y_len + x_len + empty + 1
    starts = np.zeros(n + 1, np.int64)
    np.cumsum(row_len, out=starts[1:])
    pieces = np.empty(int(starts[-1]), dtype=object)

    label_text = Y.indices.astype(str)
    first = np.zeros(Y.nnz, bool)
    first[Y.indptr[:-1][y_len > 0]] = True
    label_text = np.where(first, label_text, np.strings.add(",", label_text))
    y_row = np.repeat(np.arange(n), y_len)
    pieces[starts[:-1][y_row] + np.arange(Y.nnz) - Y.indptr[y_row]] = label_text

    feature_text = np.strings.add(np.strings.add(" ", X.indices.astype(str)),
                                  np.strings.add(":", _format_values(X.data)))
    x_row = np.repeat(np.arange(n), x_len)
    pieces[starts[:-1][x_row] + y_len[x_row] + np.arange(X.nnz) - X.indptr[x_row]] = feature_text

    pieces[starts[1:][empty] - 2] = " "
    pieces[starts[1:] - 1] = "\n"
    return "".join(pieces.tolist())


def xc_lines(X, Y) -> list[str]:
    """Text lines (without newlines) of the rows of one piece, in the XC repository format.

    Parameters
    ----------
    X : scipy.sparse matrix, shape (n_rows, n_features)
        Features; duplicate entries are summed, ids are written sorted.
    Y : scipy.sparse matrix, shape (n_rows, n_labels)
        Labels: the column ids of the stored entries are written, whatever their values.

    Returns
    -------
    list of str
        ``n_rows`` lines such as ``"3,17 0:1 5:2.5"``.
    """
    X, Y = _check_piece(X, Y, None, None)
    return _xc_text(X, Y).split("\n")[:-1]


def _is_local(fs) -> bool:
    protocol = fs.protocol if isinstance(fs.protocol, str) else fs.protocol[0]
    return protocol in ("file", "local")


def write_xc(path: str, pieces: Iterable[tuple], *, n_samples: int, n_features: int, n_labels: int) -> str:
    """Write row pieces to a text file in the XC repository format.

    The file is written under a hidden temporary name beside ``path`` and renamed when complete: an
    error (including a wrong number of rows) leaves no partial file, and an existing file at ``path``
    is replaced only by a complete one.

    Parameters
    ----------
    path : str
        Local path or fsspec URL; gzip-compressed if it ends with ``.gz``.
    pieces : iterable of (X, Y)
        Row pieces: ``X`` features, shape (n_rows, n_features), ``Y`` labels, shape (n_rows, n_labels),
        sparse matrices with the same number of rows.
    n_samples : int
        Total number of rows of the pieces (written in the header first, checked at the end).
    n_features, n_labels : int
        Number of feature and label columns, for the header; ids must be below them.

    Returns
    -------
    str
        ``path``.
    """
    for name, value in (("n_samples", n_samples), ("n_features", n_features), ("n_labels", n_labels)):
        if int(value) < 0:
            raise ValueError(f"{name} must be non-negative, but is {value}")
    fs, target = url_to_fs(str(path))
    parent, name = posixpath.split(target.rstrip("/"))
    tmp = posixpath.join(parent, f".{name}.partial-{uuid.uuid4().hex[:12]}")
    if parent:
        fs.makedirs(parent, exist_ok=True)
    rows = 0
    try:
        with fs.open(tmp, "wb") as raw:
            out = gzip.GzipFile(fileobj=raw, mode="wb", compresslevel=6, mtime=0) if name.endswith(".gz") else raw
            try:
                out.write(f"{int(n_samples)} {int(n_features)} {int(n_labels)}\n".encode("ascii"))
                for X, Y in pieces:
                    X, Y = _check_piece(X, Y, n_features, n_labels)
                    rows += X.shape[0]
                    if rows > n_samples:
                        raise ValueError(f"the pieces hold more rows than n_samples={n_samples}")
                    out.write(_xc_text(X, Y).encode("ascii"))
            finally:
                if out is not raw:
                    out.close()
        if rows != n_samples:
            raise ValueError(f"the pieces hold {rows} rows, but n_samples is {n_samples}")
        if _is_local(fs):
            os.replace(tmp, target)
        else:
            fs.mv(tmp, target)
    except BaseException:
        with contextlib.suppress(Exception):
            fs.rm(tmp)
        raise
    return str(path)
