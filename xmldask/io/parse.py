"""Parsing of the text formats, one batch of lines at a time (pure functions, no I/O).

Formats
-------
``xc``
    The Extreme Classification Repository format: a header ``n_samples n_features n_labels``,
    then one row per line, ``l1,l2,... f:v f:v ...``. A row without labels starts with a space
    (or directly with a ``f:v`` token).
``libsvm``
    The same rows without a header (LIBSVM / svmlight multi-label).
``vw``
    Vowpal Wabbit lines ``l1,l2 | f:v f ...``: labels before the bar, numeric feature ids after it;
    a feature without ``:v`` has value 1. Namespaces, importance weights and tags are not supported.

Rules shared by all formats: ids are integers (0-based unless ``one_based``), values are finite
numbers, a feature id may appear only once in a row (``duplicates="error"``, the default) or its
values are summed (``duplicates="sum"``); a label listed twice counts once with ``"sum"``. An
empty line (no characters at all) is skipped; a line of spaces is a row with no labels and no
features.

The fast path parses a whole batch with vectorised NumPy; when it finds anything wrong, a slow,
strict pass over the batch finds the first offending line and token for the error message.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import numpy as np
import scipy.sparse as sp

__all__ = ["FORMATS", "ParseError", "Batch", "parse_batch", "parse_observed", "sniff_format"]

FORMATS = ("xc", "libsvm", "vw")
_DOUBLE_COLON = re.compile(r":[^\s:]*:")
_HEADER = re.compile(r"\s*(\d+)\s+(\d+)\s+(\d+)\s*")
#: the numbers the fast path reads (NumPy): ASCII decimal floats, inf and nan; Python's float() and
#: int() also take "1_000" and non-ASCII digits, which the fast path rejects
_NUMBER = re.compile(r"[+-]?(?:(?:\d+\.?\d*|\.\d+)(?:[eE][+-]?\d+)?|inf(?:inity)?|nan)", re.ASCII | re.IGNORECASE)
#: ids are stored as int32: the largest id allowed is one below its maximum (the count of ids must fit too)
MAX_ID = int(np.iinfo(np.int32).max) - 1
#: values are stored as float32: larger magnitudes would become infinity
MAX_VALUE = float(np.finfo(np.float32).max)
#: characters of an offending token shown in an error message
TOKEN_CHARS = 40
#: the separators NumPy knows; str.split() also splits on non-ASCII spaces such as U+00A0
_ASCII_SPACES = re.compile(r"[ \t\n\r\f\v]+")


class ParseError(ValueError):
    """Bad input: names the file, the line number (1-based) and the offending text."""

    def __init__(self, reason: str, *, path: str = "?", line: int | None = None, text: str | None = None):
        self.reason, self.path, self.line, self.text = reason, path, line, text
        where = f"{path}, line {line}" if line is not None else path
        shown = "" if text is None else f": {_clip(text)!r}"
        super().__init__(f"{where}: {reason}{shown}")


def _token(token: str) -> str:
    """A token for an error message: quoted, and clipped to :data:`TOKEN_CHARS` characters."""
    return repr(_clip(token, TOKEN_CHARS))


def _clip(text: str, width: int = 120) -> str:
    text = text.rstrip("\n")
    return text if len(text) <= width else text[: width - 3] + "..."


@dataclass
class Batch:
    """Rows parsed from consecutive lines: features ``X`` and labels ``Y`` as CSR (0-based, sorted)."""

    X: sp.csr_matrix
    Y: sp.csr_matrix
    line_numbers: np.ndarray  # 1-based line number of each row


def parse_header(line: str) -> tuple[int, int, int] | None:
    """``(n_samples, n_features, n_labels)`` if ``line`` is an XC header, else ``None``."""
    match = _HEADER.fullmatch(line.rstrip("\n"))
    return tuple(int(g) for g in match.groups()) if match else None


def sniff_format(path: str, first_line: str) -> str:
    """Guess the format from the file name and its first line."""
    name = path.lower().removesuffix(".gz")
    if name.endswith(".vw"):
        return "vw"
    if parse_header(first_line) is not None:
        return "xc"
    if "|" in first_line:
        return "vw"
    return "libsvm"


def _split_rows(lines: list[str], fmt: str) -> tuple[list[str], list[str]]:
    """Label part and feature part of every line."""
    labels, features = [], []
    if fmt == "vw":
        for ln in lines:
            head, bar, rest = ln.partition("|")
            if not bar or (rest and not rest[0].isspace()):
                raise ValueError  # no bar, or a namespace: the slow pass explains
            labels.append(head.strip())
            features.append(rest)
    else:
        for ln in lines:
            if not ln or ln[0].isspace():
                labels.append("")
                features.append(ln)
                continue
            head, _, rest = ln.partition(" ")
            if "\t" in head:
                head, _, more = head.partition("\t")
                rest = more + " " + rest
            if ":" in head:
                labels.append("")
                features.append(ln)
            else:
                labels.append(head)
                features.append(rest)
    return labels, features


def _fast(lines: list[str], fmt: str, one_based: bool):
    labels, features = _split_rows(lines, fmt)
    n_feat = np.fromiter((f.count(":") for f in features), dtype=np.int64, count=len(features))
    n_tok = np.fromiter((len(f.split()) for f in features), dtype=np.int64, count=len(features))
    if fmt == "vw" and not np.array_equal(n_feat, n_tok):  # bare ids mean value 1
        features = [" ".join(t if ":" in t else t + ":1" for t in f.split()) for f in features]
        n_feat = n_tok
    if not np.array_equal(n_feat, n_tok):
        raise ValueError
    text = " ".join(features)
    if _DOUBLE_COLON.search(text):
        raise ValueError
    numbers = np.fromstring(text.replace(":", " "), sep=" ", dtype=np.float64) if text.strip() else np.zeros(0)
    if numbers.size != 2 * n_feat.sum():
        raise ValueError
    n_lab = np.fromiter((lab.count(",") + 1 if lab else 0 for lab in labels), dtype=np.int64, count=len(labels))
    label_text = ",".join(lab for lab in labels if lab)
    label_ids = np.fromstring(label_text, sep=",", dtype=np.float64) if label_text else np.zeros(0)
    if label_ids.size != n_lab.sum():
        raise ValueError
    feature_ids, values = numbers[0::2], numbers[1::2]
    offset = 1 if one_based else 0
    return n_feat, feature_ids - offset, values, n_lab, label_ids - offset


def _check_ids(ids: np.ndarray, limit: int | None) -> np.ndarray:
    """Mask of bad ids: not integers, negative, >= limit or beyond the store's int32 (:data:`MAX_ID`)."""
    bad = (ids != np.floor(ids)) | (ids < 0) | ~np.isfinite(ids) | (ids > MAX_ID)
    if limit is not None:
        bad |= ids >= limit
    return bad


def parse_batch(lines: list[str], first_line: int, *, fmt: str, one_based: bool = False,
                n_features: int | None = None, n_labels: int | None = None,
                duplicates: str = "error", path: str = "?") -> Batch:
    """Parse consecutive lines into CSR features and labels.

    Parameters
    ----------
    lines : list of str
        Lines without their newline; empty strings are skipped (blank lines).
    first_line : int
        1-based line number of ``lines[0]`` in the file (for error messages).
    fmt : {"xc", "libsvm", "vw"}
    one_based : bool
        Ids in the text start at 1.
    n_features, n_labels : int, optional
        Upper bounds for ids; ``None`` means unbounded (inferred later).
    duplicates : {"error", "sum"}
    path : str
        File name used in error messages.

    Returns
    -------
    Batch
        ``X`` has ``max(n_features, max id + 1)`` columns, ``Y`` likewise.

    Raises
    ------
    ParseError
        On the first malformed line, with its number and text.
    """
    if duplicates not in ("error", "sum"):
        raise ValueError(f"duplicates must be 'error' or 'sum', but is {duplicates!r}")
    numbers = [first_line + i for i, ln in enumerate(lines) if ln]
    lines = [ln for ln in lines if ln]
    line_numbers = np.asarray(numbers, dtype=np.int64)
    try:
        n_feat, fid, val, n_lab, lid = _fast(lines, fmt, one_based)
    except ValueError:
        _diagnose(lines, line_numbers, fmt, one_based, path)
        raise ParseError("could not parse these lines", path=path,
                         line=int(line_numbers[0]) if len(line_numbers) else first_line) from None
    rows_f = np.repeat(np.arange(len(lines)), n_feat)
    rows_l = np.repeat(np.arange(len(lines)), n_lab)

    def fail(mask, rows, reason):
        row = int(rows[np.argmax(mask)])
        raise ParseError(reason, path=path, line=int(line_numbers[row]), text=lines[row])

    base = 1 if one_based else 0
    if np.any(bad := ~np.isfinite(val)):
        fail(bad, rows_f, f"feature value {val[np.argmax(bad)]} is not a finite number")
    if np.any(bad := np.abs(val) > MAX_VALUE):
        fail(bad, rows_f, f"feature value {val[np.argmax(bad)]:g} does not fit float32 (magnitude at most "
                          f"{MAX_VALUE:.4g}): rescale the values")
    for ids, rows, limit, kind in ((fid, rows_f, n_features, "feature"), (lid, rows_l, n_labels, "label")):
        if np.any(bad := _check_ids(ids, limit)):
            allowed = (f"[{base}, {min(limit, MAX_ID + 1) + base})" if limit is not None
                       else f">= {base} and <= {MAX_ID + base} (ids are stored as int32)")
            value = ids[np.argmax(bad)] + base
            what = "is not an integer" if value != np.floor(value) else "is out of range"
            fail(bad, rows, f"{kind} id {value:g} {what}: ids must be integers {allowed}")
    n_cols = int(max(n_features or 0, fid.max() + 1 if fid.size else 0))
    n_lab_cols = int(max(n_labels or 0, lid.max() + 1 if lid.size else 0))
    X = _csr(n_feat, fid, val.astype(np.float32), len(lines), n_cols)
    Y = _csr(n_lab, lid, np.ones(lid.size, np.float32), len(lines), n_lab_cols)
    for M, what in ((X, "feature"), (Y, "label")):
        dup = _duplicate_mask(M)
        if dup.any():
            if duplicates == "error":
                row = int(np.repeat(np.arange(M.shape[0]), np.diff(M.indptr))[np.argmax(dup)])
                raise ParseError(f"{what} id {int(M.indices[np.argmax(dup)]) + base} appears twice in the row "
                                 "(pass duplicates='sum' / --duplicates sum to add their values)",
                                 path=path, line=int(line_numbers[row]), text=lines[row])
            M.sum_duplicates()
    # zeros carry nothing in a sparse row: written ones, sums that cancel, values below float32's smallest (1e-50)
    X.eliminate_zeros()
    Y.data[:] = 1.0
    return Batch(X=X, Y=Y, line_numbers=line_numbers)


def _csr(counts, ids, values, n_rows, n_cols) -> sp.csr_matrix:
    indptr = np.zeros(n_rows + 1, dtype=np.int64)
    np.cumsum(counts, out=indptr[1:])
    M = sp.csr_matrix((values, ids.astype(np.int32), indptr), shape=(n_rows, n_cols))
    M.has_canonical_format = False
    M.sort_indices()
    return M


def _duplicate_mask(M: sp.csr_matrix) -> np.ndarray:
    """True at each entry whose column equals the previous entry's in the same row (sorted indices)."""
    if M.nnz < 2:
        return np.zeros(M.nnz, bool)
    same = np.zeros(M.nnz, bool)
    same[1:] = M.indices[1:] == M.indices[:-1]
    same[M.indptr[1:-1][M.indptr[1:-1] < M.nnz]] = False  # first entry of each row
    return same


# ---------------------------------------------------------------- slow, strict pass for messages


def _diagnose(lines, line_numbers, fmt, one_based, path) -> None:
    for ln, number in zip(lines, line_numbers):
        reason = _line_error(ln, fmt)
        if reason:
            raise ParseError(reason, path=path, line=int(number), text=ln)


def _number(token: str, kind: str) -> str | None:
    if not _NUMBER.fullmatch(token):
        return f"{kind} {_token(token)} is not a number"
    return None


def _int_id(token: str, kind: str) -> str | None:
    # like the fast path, accept integral numbers such as "3.0"
    if not _NUMBER.fullmatch(token) or not float(token).is_integer():
        return f"{kind} id {_token(token)} is not an integer"
    return None


def _tokens(text: str) -> list[str]:
    return [t for t in _ASCII_SPACES.split(text) if t]


def _line_error(ln: str, fmt: str) -> str | None:
    if fmt == "vw":
        head, bar, rest = ln.partition("|")
        if not bar:
            return "malformed line: a Vowpal Wabbit line needs 'labels | features'"
        if rest and not rest[0].isspace():
            return "Vowpal Wabbit namespaces ('|name') are not supported: write '| f:v ...'"
        head = head.strip()
        if len(head.split()) > 1:
            return "malformed labels: importance weights and tags are not supported, only 'l1,l2 |'"
        tokens = _tokens(rest)
        label_part = head
    else:
        tokens = _tokens(ln)
        label_part = ""
        if tokens and not ln[0].isspace() and ":" not in tokens[0]:
            label_part = tokens.pop(0)
    if label_part:
        for token in label_part.split(","):
            if not token:
                return "malformed labels: empty label id (two commas or a trailing comma)"
            if reason := _int_id(token, "label"):
                return reason
    for token in tokens:
        if fmt == "vw" and ":" not in token:
            token = token + ":1"
        if token.count(":") != 1:
            return f"malformed token {_token(token)}: expected 'id:value'"
        fid, value = token.split(":")
        if reason := _int_id(fid, "feature"):
            return reason
        if reason := _number(value, f"value of feature {_clip(fid, TOKEN_CHARS)}"):
            return reason
    return None


def parse_observed(lines: list[str], first_line: int, *, n_labels: int, one_based: bool = False,
                   path: str = "?") -> sp.csr_matrix:
    """Observed label entries, one line per row: comma-separated label ids (an empty line: none).

    The file of observed entries of a dataset with missing labels (``xmldask ingest --observed``):
    line ``i`` lists the label ids whose entries are known for row ``i`` of the data, relevant and
    irrelevant alike. Returns a CSR matrix of ones, ``(len(lines), n_labels)``, sorted, a repeated
    id counted once. Raises :class:`ParseError` naming the line for a malformed id or one outside
    ``[0, n_labels)``.
    """
    offset = 1 if one_based else 0
    rows, ids = [], []
    for i, ln in enumerate(lines):
        text = ln.strip()
        if not text:
            continue
        for token in text.split(","):
            token = token.strip()
            reason = "empty label id (two commas or a trailing comma)" if not token else _int_id(token, "label")
            if reason:
                raise ParseError(reason, path=path, line=first_line + i, text=ln)
            label = int(float(token)) - offset
            if not 0 <= label < n_labels:
                raise ParseError(f"label id {token} is outside [{offset}, {n_labels + offset})", path=path,
                                 line=first_line + i, text=ln)
            rows.append(i)
            ids.append(label)
    O = sp.csr_matrix((np.ones(len(ids), np.float32), (np.asarray(rows, np.int64), np.asarray(ids, np.int64))),
                      shape=(len(lines), n_labels))
    O.sum_duplicates()
    O.data[:] = 1.0
    return O
