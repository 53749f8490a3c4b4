"""Streaming ingest of text files into a dataset store, with memory bounded by the batch size."""

from __future__ import annotations

import gzip
import hashlib
import io
import itertools
import logging
import re
import zlib
from collections.abc import Sequence
from dataclasses import dataclass

import fsspec
import numpy as np
import scipy.sparse as sp
from tqdm.auto import tqdm

from ..store import check_target, exists
from ..store.dataset import Dataset, DatasetWriter, check_dimension, open_dataset
from ..store.layout import BLOCK_ROWS
from .parse import FORMATS, ParseError, parse_batch, parse_header, parse_observed, sniff_format
from .transforms import NORMALIZATIONS, transform_rows

__all__ = ["ingest", "IngestError"]

logger = logging.getLogger(__name__)

IngestError = ParseError
BATCH_BYTES = 4 << 20


class _Tap(io.RawIOBase):
    """A raw reader that hashes and counts the bytes it passes on."""

    def __init__(self, raw):
        self.raw, self.sha256, self.bytes = raw, hashlib.sha256(), 0

    def readable(self) -> bool:
        return True

    def readinto(self, buffer) -> int:
        data = self.raw.read(len(buffer))
        n = len(data)
        buffer[:n] = data
        self.sha256.update(data)
        self.bytes += n
        return n


@dataclass
class _Source:
    path: str
    fmt: str
    header: tuple[int, int, int] | None
    size: int
    sha256: str | None = None  # computed where needed (appending: to skip what was ingested)


def _open_text(path: str, errors: str = "strict"):
    """Open ``path`` (local or fsspec URL, gzip or plain) as text; returns (text, tap, raw file)."""
    raw = fsspec.open(path, "rb").open()
    tap = _Tap(raw)
    buffered = io.BufferedReader(tap, buffer_size=1 << 20)
    stream = gzip.GzipFile(fileobj=buffered, mode="rb") if buffered.peek(2)[:2] == b"\x1f\x8b" else buffered
    # utf-8-sig: a byte-order mark at the start of the file is dropped (editors on Windows write one)
    return io.TextIOWrapper(stream, encoding="utf-8-sig", errors=errors, newline=None), tap, raw


_UNDECODABLE = re.compile("[\udc80-\udcff]")  # bytes that are not UTF-8, as "surrogateescape" keeps them


def _read_error(path: str, exc: Exception) -> ParseError:
    """The error for a file that cannot be read, at the line where reading fails.

    Text is decoded a chunk at a time, so the exception does not tell which line is bad: this
    error path reads the file again line by line. A truncated or corrupt gzip stream fails at the
    line it cuts (its text is lost); a byte that is not UTF-8 is found in its line, shown with it.
    """
    text, _, raw = _open_text(path, errors="surrogateescape")
    number, bad = 1, None
    try:
        for line in text:
            if _UNDECODABLE.search(line):
                bad = line.rstrip("\n").encode("utf-8", "surrogateescape").decode("utf-8", "replace")
                break
            number += 1
    except (EOFError, OSError, zlib.error):
        pass
    finally:
        raw.close()
    if isinstance(exc, UnicodeDecodeError):
        reason = f"the file is not UTF-8 text ({exc.reason})"
    else:
        reason = f"the gzip stream is truncated or corrupt ({exc})"
    return ParseError(reason, path=path, line=number, text=bad)


def _inspect(path: str, fmt: str) -> _Source:
    fs, fpath = fsspec.core.url_to_fs(path)
    if not fs.exists(fpath):
        raise FileNotFoundError(f"no such source file: {path}")
    text, _, raw = _open_text(path)
    try:
        first = text.readline().rstrip("\n")
    except (EOFError, OSError, zlib.error, UnicodeDecodeError) as exc:
        raise _read_error(path, exc) from None
    finally:
        raw.close()
    looks_like = sniff_format(path, first)
    hint = f" (the file looks like {looks_like.upper()}: --format auto reads it)"
    if fmt != "auto" and fmt != "xc" and looks_like == "xc":
        raise ParseError(f"line 1 is an XC header, not a {fmt} row{hint}", path=path, line=1, text=first)
    fmt = looks_like if fmt == "auto" else fmt
    header = parse_header(first) if fmt == "xc" else None
    if fmt == "xc" and header is None:
        raise ParseError("expected the XC header 'n_samples n_features n_labels'" + hint, path=path, line=1,
                         text=first)
    if header is not None:
        for name, value in zip(("n_features", "n_labels"), header[1:]):
            try:
                check_dimension(name, value)
            except ValueError as exc:
                raise ParseError(f"the header gives {exc}", path=path, line=1, text=first) from None
    return _Source(path, fmt, header, fs.size(fpath) or 0)


def _read(source: _Source, batch_bytes: int):
    """Yield (lines, first_line) batches; returns the tap (for sha256 and bytes) via StopIteration."""
    text, tap, raw = _open_text(source.path)
    line = 1
    try:
        if source.header is not None:
            text.readline()
            line = 2
        while True:
            try:
                lines = text.readlines(batch_bytes)
            except (EOFError, zlib.error, gzip.BadGzipFile, UnicodeDecodeError) as exc:
                raise _read_error(source.path, exc) from None
            if not lines:
                break
            yield [ln.rstrip("\n") for ln in lines], line, tap.bytes
            line += len(lines)
    finally:
        raw.close()
    return tap, line


def ingest(
    sources: str | Sequence[str],
    out: str,
    *,
    format: str = "auto",
    one_based: bool = False,
    block_rows: int = BLOCK_ROWS,
    normalize: str = "none",
    bias: float | None = None,
    n_features: int | None = None,
    n_labels: int | None = None,
    duplicates: str = "error",
    overwrite: bool = False,
    append: bool = False,
    skip_ingested: bool = False,
    observed: str | Sequence[str] | None = None,
    batch_bytes: int = BATCH_BYTES,
    progress: bool = False,
) -> Dataset:
    """Read text files into a dataset store, streaming: memory is bounded by ``batch_bytes``.

    Several sources are concatenated row-wise into one dataset.

    Parameters
    ----------
    sources : str or list of str
        Paths or fsspec URLs of text files, gzip-compressed or plain.
    out : str
        Path or fsspec URL of the dataset store to write.
    format : {"auto", "xc", "libsvm", "vw"}
        ``auto`` guesses from each file's name and first line (see :mod:`xmldask.io.parse`).
    one_based : bool
        Feature and label ids in the files start at 1 (they are stored 0-based).
    block_rows : int
        Rows per row block of the store (one Dask task reads one block).
    normalize : {"none", "l2", "l1", "sqrt"}
        Row transform applied per block (``sqrt``: the Hellinger map).
    bias : float, optional
        Append a constant feature with this value as the last column.
    n_features, n_labels : int, optional
        The dimensions; default: from the XC header, else the largest id seen plus one.
    duplicates : {"error", "sum"}
        What to do with a feature id repeated within a row.
    overwrite : bool
        Replace an existing store at ``out``.
    append : bool
        Add the rows to the existing dataset at ``out`` (for data refresh). Its dimensions and
        transforms are kept; a source already ingested (same sha256) is an error unless
        ``skip_ingested``.
    skip_ingested : bool
        With ``append``: skip sources whose checksum the dataset already lists.
    observed : str or list of str, optional
        A dataset with missing labels: one file of observed label entries per source (same order),
        line ``i`` listing the comma-separated label ids whose entries are known for row ``i`` of its
        source, relevant and irrelevant alike (an empty line: none known; ids 0-based, or 1-based
        with ``one_based``). Stored as the dataset's ``observed`` mask (:class:`Dataset.observed`);
        every relevant label of a row must be observed. Without it every entry is observed.
    progress : bool
        Show a progress bar (bytes read).

    Returns
    -------
    Dataset
        The opened dataset.

    Raises
    ------
    ParseError
        Bad input: the message names the file, the line and its text. No store is left behind
        (an append leaves the dataset as it was).
    FileExistsError
        ``out`` exists and neither ``overwrite`` nor ``append`` was given.
    """
    sources = [sources] if isinstance(sources, str) else [str(s) for s in sources]
    _check_options(sources, out, format=format, normalize=normalize, append=append, overwrite=overwrite,
                   n_features=n_features, n_labels=n_labels)
    observed = _observed_files(observed, sources)
    existing = open_dataset(out) if append else None
    if existing is not None:
        _check_same_encoding(existing, normalize, bias)
        _check_same_mask(existing, observed)
        n_features = existing.n_features - (1 if bias is not None else 0)
        n_labels = existing.n_labels
    inspected = [_inspect(path, format) for path in sources]
    n_features, n_labels = _dimensions(inspected, n_features, n_labels)
    if bias is not None and n_features is None:
        raise ValueError("bias needs the number of features up front: pass n_features (--n-features) "
                         "or use the XC format, whose header gives it")
    if existing is not None:
        inspected = _not_yet_ingested(existing, inspected, skip_ingested)
        if not inspected:
            return existing
        writer = _append_writer(out, inspected, block_rows)
    else:
        if observed is not None and n_labels is None:
            raise ValueError("observed entries need the number of labels up front: pass n_labels (--n-labels) or "
                             "use the XC format, whose header gives it")
        writer = DatasetWriter.create(out, block_rows=block_rows, overwrite=overwrite,
                                      n_features=None if n_features is None else n_features + (bias is not None),
                                      n_labels=n_labels, observed=observed is not None)
    masks = dict(zip(sources, observed)) if observed is not None else {}
    rows = _RowOptions(one_based=one_based, n_features=n_features, n_labels=n_labels, duplicates=duplicates,
                       normalize=normalize, bias=bias, batch_bytes=batch_bytes)
    bar = tqdm(total=sum(s.size for s in inspected), unit="B", unit_scale=True, desc="ingest",
               disable=not progress)
    with writer, bar:
        seen_features = max((_write_source(writer, source, rows, bar, masks.get(source.path))
                             for source in inspected), default=0)
        if existing is not None:
            return writer.commit()
        d = n_features if n_features is not None else seen_features
        transforms = {"normalize": normalize, "bias": bias, "one_based": one_based, "duplicates": duplicates,
                      "bias_column": d if bias is not None else None}
        return writer.commit(n_features=d + (bias is not None), n_labels=n_labels, transforms=transforms)


@dataclass(frozen=True)
class _RowOptions:
    """How the rows of every source are parsed and transformed (the options of :func:`ingest`)."""

    one_based: bool
    n_features: int | None
    n_labels: int | None
    duplicates: str
    normalize: str
    bias: float | None
    batch_bytes: int


def _check_options(sources, out, *, format, normalize, append, overwrite, n_features, n_labels) -> None:
    if not sources:
        raise ValueError("no source files given")
    if format not in ("auto", *FORMATS):
        raise ValueError(f"format must be one of auto, {', '.join(FORMATS)}; got {format!r}")
    if normalize not in NORMALIZATIONS:
        raise ValueError(f"normalize must be one of {', '.join(NORMALIZATIONS)}; got {normalize!r}")
    if append and overwrite:
        raise ValueError("append and overwrite exclude each other")
    if not append and exists(out) and not overwrite:
        raise FileExistsError(f"{out} already exists; pass overwrite=True (--overwrite) to replace it, "
                              "or append=True (--append) to add rows to it")
    if not append:
        check_target(out, kind="dataset", overwrite=overwrite, inputs=sources)
    check_dimension("n_features", n_features)
    check_dimension("n_labels", n_labels)


def _check_same_encoding(existing: Dataset, normalize: str, bias: float | None) -> None:
    old = existing.meta.get("transforms", {})
    if (old.get("normalize"), old.get("bias")) != (normalize, bias):
        raise ValueError(f"{existing.url} was ingested with normalize={old.get('normalize')!r}, "
                         f"bias={old.get('bias')!r}; appending with normalize={normalize!r}, bias={bias!r} "
                         "would mix two encodings")


def _observed_files(observed, sources: list[str]) -> list[str] | None:
    """One file of observed entries per source, or ``None``."""
    if observed is None:
        return None
    observed = [observed] if isinstance(observed, str) else [str(o) for o in observed]
    if len(observed) != len(sources):
        raise ValueError(f"give one file of observed entries per source: {len(sources)} sources but "
                         f"{len(observed)} observed files")
    for path in observed:
        fs, fpath = fsspec.core.url_to_fs(path)
        if not fs.exists(fpath):
            raise FileNotFoundError(f"no such file of observed entries: {path}")
    return observed


def _check_same_mask(existing: Dataset, observed) -> None:
    if (existing.observed is None) != (observed is None):
        raise ValueError(f"{existing.url} has an observed-entry mask: give the new sources' observed entries "
                         "(observed= / --observed)" if observed is None else
                         f"{existing.url} has no observed-entry mask (every label entry is observed): append "
                         "without observed= / --observed")


def _not_yet_ingested(existing: Dataset, inspected: list[_Source], skip_ingested: bool) -> list[_Source]:
    """The sources whose sha256 the dataset does not list yet (one it lists is an error unless skipped)."""
    known = {s["sha256"]: s for s in existing.meta["sources"]}
    todo = []
    for source in inspected:
        source.sha256 = _sha256(source.path)
        if source.sha256 in known:
            if not skip_ingested:
                raise ValueError(f"{source.path} was already ingested into {existing.url} "
                                 f"(as {known[source.sha256]['path']}, same sha256); pass skip_ingested=True "
                                 "(--skip-ingested) to skip such files")
            logger.info("skipping %s: already ingested", source.path)
            continue
        todo.append(source)
    return todo


def _append_writer(out: str, todo: list[_Source], block_rows: int) -> DatasetWriter:
    writer = DatasetWriter.append(out, block_rows=block_rows)
    # another writer may have committed between the check above and taking the lock
    committed = {s["sha256"] for s in writer.sources}
    if committed.intersection(source.sha256 for source in todo):
        writer.abort()
        raise ValueError(f"a source was ingested into {out} by another writer meanwhile; run this again "
                         "(with skip_ingested=True / --skip-ingested to skip it)")
    return writer


class _ObservedReader:
    """The lines of a file of observed entries, taken a batch of rows at a time."""

    def __init__(self, path: str, source: _Source, n_labels: int, one_based: bool):
        self.path, self.source, self.n_labels, self.one_based = path, source, n_labels, one_based
        self.text, _, self.raw = _open_text(path)
        self.line = 1

    def take(self, batch) -> sp.csr_matrix:
        """The observed entries of a parsed batch's rows, checked to cover its relevant labels."""
        n = batch.Y.shape[0]
        try:
            got = [ln.rstrip("\n") for ln in itertools.islice(self.text, n)]
        except (EOFError, OSError, zlib.error, UnicodeDecodeError) as exc:
            raise _read_error(self.path, exc) from None
        if len(got) < n:
            row = int(batch.line_numbers[len(got)])
            raise ParseError(f"the file ends after {self.line - 1 + len(got)} lines, but {self.source.path} has more "
                             f"rows (its line {row}): one line of observed entries per row", path=self.path,
                             line=self.line + len(got))
        O = parse_observed(got, self.line, n_labels=self.n_labels, one_based=self.one_based, path=self.path)
        missing = batch.Y - batch.Y.multiply(O)
        missing.eliminate_zeros()
        if missing.nnz:
            r = int(np.flatnonzero(np.diff(missing.indptr))[0])
            label = int(missing.indices[missing.indptr[r]]) + self.one_based
            data_line = int(batch.line_numbers[r])
            raise ParseError(f"label {label} is relevant in {self.source.path}, line {data_line}, but not observed "
                             "here: a relevant label is observed by definition", path=self.path, line=self.line + r,
                             text=got[r])
        self.line += n
        return O

    def finish(self) -> None:
        """Check that no line is left over."""
        extra = self.text.readline()
        if extra.strip():
            raise ParseError(f"more lines than the {self.line - 1} rows of {self.source.path}: one line of observed "
                             "entries per row", path=self.path, line=self.line, text=extra)


def _write_source(writer: DatasetWriter, source: _Source, opts: _RowOptions, bar, observed: str | None) -> int:
    """Parse, transform and write the rows of one source (and its observed entries), and record it in
    the writer; the widest feature id seen plus one."""
    rows_before = writer.n_samples
    reader = _read(source, opts.batch_bytes)
    mask = None if observed is None else _ObservedReader(observed, source, writer.n_labels, opts.one_based)
    try:
        tap, next_line, seen_features = _write_batches(writer, reader, source, opts, bar, mask)
        if mask is not None:
            mask.finish()
    finally:
        if mask is not None:
            mask.raw.close()
    rows = writer.n_samples - rows_before
    if source.header is not None and rows != source.header[0]:
        raise ParseError(f"the header says {source.header[0]} rows but the file has {rows}",
                         path=source.path, line=1, text=" ".join(map(str, source.header)))
    writer.sources.append({"path": source.path, "format": source.fmt, "sha256": tap.sha256.hexdigest(),
                           "bytes": tap.bytes, "rows": rows, "first_row": rows_before, "lines": next_line - 1,
                           **({} if observed is None else {"observed": observed})})
    return seen_features


def _write_batches(writer: DatasetWriter, reader, source: _Source, opts: _RowOptions, bar, mask):
    """Write every batch of rows of ``reader``; ``(tap, next line, widest feature id seen + 1)``."""
    seen_features, done = 0, 0
    while True:
        try:
            lines, first, done_now = next(reader)
        except StopIteration as stop:
            tap, next_line = stop.value
            return tap, next_line, seen_features
        batch = parse_batch(lines, first, fmt=source.fmt, one_based=opts.one_based, n_features=opts.n_features,
                            n_labels=opts.n_labels, duplicates=opts.duplicates, path=source.path)
        X = batch.X
        seen_features = max(seen_features, X.shape[1])
        if opts.bias is not None:
            X.resize((X.shape[0], opts.n_features + 1))
        if opts.normalize == "sqrt" and X.nnz and X.data.min() < 0:
            row = int(X.indptr.searchsorted(int((X.data < 0).argmax()), side="right")) - 1
            line = int(batch.line_numbers[row])
            raise ParseError("negative feature value: the sqrt (Hellinger) map needs values >= 0",
                             path=source.path, line=line, text=lines[line - first])
        O = None if mask is None else mask.take(batch)
        writer.write(transform_rows(X, normalize=opts.normalize, bias=opts.bias), batch.Y,
                     **({} if O is None else {"observed": O}))
        bar.update(done_now - done)
        done = done_now


def _dimensions(sources: list[_Source], n_features: int | None, n_labels: int | None):
    """The (n_features, n_labels) bounds: explicit values, else agreed XC headers, else None."""
    for source in sources:
        if source.header is None:
            continue
        _, d, L = source.header
        for name, given, found in (("n_features", n_features, d), ("n_labels", n_labels, L)):
            if given is not None and given != found:
                raise ParseError(f"the header gives {name} = {found}, but {given} was expected "
                                 "(from an earlier file, the target dataset or the n_features/n_labels options)",
                                 path=source.path, line=1, text=" ".join(map(str, source.header)))
        n_features, n_labels = d, L
    return n_features, n_labels


def _sha256(path: str) -> str:
    digest = hashlib.sha256()
    with fsspec.open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            digest.update(chunk)
    return digest.hexdigest()


def read_text(path: str, *, fmt: str | None = None, one_based: bool = False) -> tuple[sp.csr_matrix, sp.csr_matrix]:
    """A whole text file (XC, libsvm or VW; gzip or plain; local or fsspec URL) as in-memory CSR
    ``(X, Y)``, for data that fits in memory (the UCI sets of the boosting benchmark); :func:`ingest`
    writes a dataset store instead. The header's sizes (XC) are the matrices' shapes.

    Raises
    ------
    ParseError
        A malformed line, named by file and line number.
    """
    text, _, raw = _open_text(path)
    with raw, text:
        lines = text.read().splitlines()
    header = parse_header(lines[0]) if lines else None
    fmt = fmt or sniff_format(path, lines[0] if lines else "")
    body, first = (lines[1:], 2) if header else (lines, 1)
    batch = parse_batch(body, first, fmt=fmt, one_based=one_based, n_features=header[1] if header else None,
                        n_labels=header[2] if header else None, path=path)
    X, Y = batch.X, batch.Y
    if header:
        X = sp.csr_matrix((X.data, X.indices, X.indptr), shape=(X.shape[0], header[1]))
        Y = sp.csr_matrix((Y.data, Y.indices, Y.indptr), shape=(Y.shape[0], header[2]))
    return X, Y
