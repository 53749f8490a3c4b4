"""Store integrity: a chunk inventory recorded at commit and checked at open, and the one-writer lock.

Zarr reads a chunk file that is missing as the array's fill value (zeros) and hands a truncated one
to the decompressor (which may crash the process). So every xmldask store records, in the root
attribute ``xmldask_inventory`` written in the same metadata write as its commit, the size in bytes
of every chunk file and the presence of every array's ``zarr.json`` that readers use. Opening a
store lists its files once (one directory walk, or one listing call on an object store) and refuses
a store whose inventory does not match, naming the store, the file and the fix. Sizes catch lost
and truncated files; the CRC-32C checksum of every chunk (:func:`xmldask.store.layout.compressors`)
catches bits flipped inside a file of the right size. The inventory also holds a digest of what
each array's metadata fixes for good (data type, chunking, codecs, fill value: not its shape, which
an append grows) and of the root attributes that the figures depend on (sizes, ``nnz``, array
references), so that an edited ``zarr.json`` is refused too.

A dataset accepts appends (``ingest --append``) from one writer at a time: the writer holds the
lock file ``<store>/.xmldask-writer.lock`` (created exclusively, on a local disk and on fsspec
file systems that support exclusive creation) from before it reads the committed state until its
commit. A second writer is refused with the holder's host, process and start time. A lock whose
process is gone (same host, process not running) is stale and taken over.
"""

from __future__ import annotations

import datetime as _dt
import functools
import hashlib
import json
import logging
import os
import socket
import time
import uuid
import weakref

import zarr

from . import _fs
from .layout import StoreError, check_kind

__all__ = ["INVENTORY_ATTR", "LOCK_NAME", "StoreBusyError", "WriterLock", "TailGuard", "check_inventory",
           "commit_attrs", "lock_present", "open_root", "record_inventory", "tails", "timed"]

logger = logging.getLogger(__name__)

#: root attribute holding ``{file key: size in bytes}`` (``-1``: metadata file, presence only)
INVENTORY_ATTR = "xmldask_inventory"
#: lock file of the writer appending to a dataset, inside the store
LOCK_NAME = ".xmldask-writer.lock"
_METADATA = "zarr.json"
_PRESENT_ONLY = -1

#: what to do about a damaged store, by store kind
_FIXES = {
    "dataset": "ingest its source files again (xmldask ingest ... --overwrite) or restore it from a backup",
    "model": "train the model again (xmldask train ... --overwrite) or restore it from a backup",
    "predictions": "predict again (xmldask predict ... --overwrite)",
}
_NOUNS = {"predictions": "prediction"}
_DEFAULT_FIX = "write it again (with overwrite) or restore it from a backup"


def _files(url: str) -> dict[str, int]:
    """``{key relative to the store: size}`` of every file under the store at ``url``."""
    fs, root, _ = _fs._split(url)
    root = root.rstrip("/")
    try:
        found = fs.find(root, detail=True)
    except FileNotFoundError:
        return {}
    return {path[len(root) + 1:]: int(info.get("size") or 0) for path, info in found.items()
            if path.startswith(root + "/")}


#: seconds spent per function, once a benchmark called :func:`timed`
_TIMES: dict[str, float] | None = None


def _timing(function):
    @functools.wraps(function)
    def timed_call(*args, **kwargs):
        if _TIMES is None:
            return function(*args, **kwargs)
        start = time.perf_counter()
        try:
            return function(*args, **kwargs)
        finally:
            _TIMES[function.__name__] = _TIMES.get(function.__name__, 0.0) + time.perf_counter() - start
    return timed_call


#: the fields of an array's ``zarr.json`` that no append changes (its digest is recorded)
_FIXED_FIELDS = ("node_type", "data_type", "chunk_grid", "chunk_key_encoding", "codecs", "fill_value",
                 "dimension_names", "storage_transformers")


def _digest(value) -> str:
    text = json.dumps(value, sort_keys=True, separators=(",", ":"), default=str)
    return "sha256:" + hashlib.sha256(text.encode()).hexdigest()[:32]


def _metadata_digest(raw: bytes) -> str | int:
    """The digest of an array's fixed metadata fields, or :data:`_PRESENT_ONLY` for a group's metadata (whose
    attributes an append rewrites; the root's are covered by the root digest)."""
    try:
        meta = json.loads(raw)
    except ValueError:
        return "unreadable"
    if not isinstance(meta, dict) or meta.get("node_type") != "array":
        return _PRESENT_ONLY
    return _digest({key: meta.get(key) for key in _FIXED_FIELDS})


def root_digest(attrs: dict) -> str:
    """The digest of a store's root attributes, without the inventory that records it."""
    return _digest({key: value for key, value in attrs.items() if key != INVENTORY_ATTR})


@_timing
def record_inventory(url: str, prefixes: list[str] | None = None, *, attrs: dict | None = None) -> dict:
    """The inventory of the store at ``url`` as it is now (call it after the last chunk write).

    Parameters
    ----------
    url : str
        The store (usually its temporary name before publication).
    prefixes : list of str, optional
        Record only files under these top-level paths (the arrays readers use); all by default.
        The root ``zarr.json`` (being written with the inventory) and hidden files are left out.
    attrs : dict, optional
        The root attributes the store will hold with this inventory: their digest is recorded under
        ``zarr.json`` (:func:`root_digest`).

    Returns
    -------
    dict of str to int or str
        File key to size in bytes; for an array's ``zarr.json``, the digest of its fixed fields
        (:data:`_FIXED_FIELDS`), for a group's ``-1`` (presence only).
    """
    fs, root, _ = _fs._split(url)
    out = {}
    for key, size in sorted(_files(url).items()):
        if key == _METADATA or any(part.startswith(".") for part in key.split("/")):
            continue
        if prefixes is not None and not any(key == p or key.startswith(p.rstrip("/") + "/") for p in prefixes):
            continue
        out[key] = (_metadata_digest(fs.cat_file(f"{root.rstrip('/')}/{key}"))
                    if key.rpartition("/")[2] == _METADATA else size)
    if attrs is not None:
        out[_METADATA] = root_digest(attrs)
    return out


def commit_attrs(group, url: str, update: dict, prefixes: list[str] | None = None) -> None:
    """Write the root attributes ``update`` of the store at ``url`` (its root ``group``) with its inventory,
    in one metadata write: the commit of a store."""
    attrs = {**dict(group.attrs), **update}
    group.attrs.update({**update, INVENTORY_ATTR: record_inventory(url, prefixes, attrs=attrs)})


def tails(recorded: dict[str, int]) -> set[str]:
    """The last chunk file of every array of an inventory: the files an append rewrites (its shard
    that holds the committed end gains the first new elements)."""
    last: dict[str, tuple] = {}
    for key in recorded:
        array, sep, index = key.rpartition("/c/")
        if not sep:
            continue
        try:
            position = tuple(int(i) for i in index.split("/"))
        except ValueError:
            continue
        if array not in last or position > last[array][0]:
            last[array] = (position, key)
    return {key for _, key in last.values()}


def mismatches(url: str, recorded: dict) -> tuple[list[str], list[str], dict[str, int]]:
    """Files of an inventory that are missing, files of another size, and the sizes found (the root
    ``zarr.json`` and metadata digests are checked by :func:`check_inventory`)."""
    found = _files(url)
    missing = [key for key in recorded if key != _METADATA and key not in found]
    resized = [key for key, size in recorded.items()
               if isinstance(size, int) and size != _PRESENT_ONLY and key in found and found[key] != size]
    return missing, resized, found


def _edited(url: str, attrs: dict, recorded: dict, found: dict) -> list[str]:
    """The recorded metadata whose digest differs now: ``zarr.json`` (the root attributes), array metadata."""
    edited = []
    if _METADATA in recorded and root_digest(attrs) != recorded[_METADATA]:
        edited.append(_METADATA)
    fs, root, _ = _fs._split(url)
    for key, digest in recorded.items():
        if key != _METADATA and isinstance(digest, str) and key in found and \
                _metadata_digest(fs.cat_file(f"{root.rstrip('/')}/{key}")) != digest:
            edited.append(key)
    return edited


@_timing
def check_inventory(url: str, attrs: dict, kind: str) -> None:
    """Refuse the store at ``url`` if a file of its recorded inventory is missing or has another size.

    A store written before inventories were recorded (no ``xmldask_inventory``) is accepted with a
    warning. While a dataset's writer lock file is present (an append runs, or died), its arrays'
    last chunk files may have another size: an append rewrites the shard that holds the committed
    end (the committed elements unchanged); the writer restores them if it fails and the next
    writer adopts them.

    Raises
    ------
    StoreError
        Naming the store, the first missing or damaged files and the fix.
    """
    recorded = attrs.get(INVENTORY_ATTR)
    if recorded is None:
        logger.warning("%s records no chunk inventory (written by an older xmldask): its completeness is not "
                       "checked; write it again to add one", url)
        return
    missing, resized, found = mismatches(url, recorded)
    if resized and not missing and set(resized) <= tails(recorded) and lock_present(url):
        resized = []
    edited = _edited(url, attrs, recorded, found)
    if not (missing or resized or edited):
        return
    shown = [f"{key} is missing" for key in missing[:3]]
    shown += [f"{key} has {found[key]} bytes, {recorded[key]} were written" for key in resized[:3]]
    shown += [("the root attributes (zarr.json) were edited after they were written" if key == _METADATA else
               f"{key} (the array's type, chunks or codecs) was edited after it was written") for key in edited[:3]]
    more = len(missing) + len(resized) + len(edited) - len(shown)
    raise StoreError(f"{url} ({kind} store) is damaged: {'; '.join(shown)}"
                     f"{f' (and {more} more)' if more > 0 else ''}. Its data cannot be trusted: "
                     f"{_FIXES.get(kind, _DEFAULT_FIX)}")


# ---------------------------------------------------------------- one writer at a time


class StoreBusyError(StoreError):
    """Another live writer holds the store's writer lock (trying again later may succeed)."""



def _lock_path(url: str) -> tuple:
    fs, root, _ = _fs._split(url)
    return fs, f"{root.rstrip('/')}/{LOCK_NAME}"


def _holder_text(holder: dict | None) -> str:
    """Who holds a lock, from the facts its file gives (it may be empty while its writer fills it)."""
    if not holder or holder.get("pid") is None:
        return "another writer (its lock file names no process yet)"
    since = f" since {holder['since']}" if holder.get("since") else ""
    return f"process {holder['pid']} on {holder.get('host') or 'an unnamed host'}{since}"


def _read_holder(fs, path: str) -> dict | None:
    try:
        with fs.open(path, "rb") as f:
            return json.loads(f.read().decode("utf-8") or "{}")
    except FileNotFoundError:
        return None
    except ValueError:
        return {}


#: the locks this process holds, by token: a lock file of this process whose lock object is gone
#: (its writer vanished without releasing it) is stale
_HELD: weakref.WeakValueDictionary = weakref.WeakValueDictionary()


def _alive(holder: dict) -> bool:
    """False only when the holder ran on this host and its process (or, in this process, its lock) is gone."""
    if holder.get("host") != socket.gethostname() or not isinstance(holder.get("pid"), int):
        return True
    if holder["pid"] == os.getpid():
        return holder.get("token") in _HELD
    try:
        os.kill(holder["pid"], 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def lock_present(url: str) -> bool:
    """Whether the store at ``url`` has a writer lock file (of a live writer or one that died)."""
    fs, path = _lock_path(url)
    return fs.exists(path)


class WriterLock:
    """The exclusive writer lock of the store at ``url`` (a context manager).

    Raises
    ------
    StoreError
        On :meth:`acquire`, when another live writer holds the lock.
    """

    def __init__(self, url: str):
        self.url = str(url)
        self._fs, self._path = _lock_path(self.url)
        self.token = uuid.uuid4().hex
        self.held = False

    def _create(self) -> bool:
        info = {"host": socket.gethostname(), "pid": os.getpid(), "token": self.token,
                "since": _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds")}
        payload = json.dumps(info).encode("utf-8")
        try:
            with self._fs.open(self._path, "xb") as f:
                f.write(payload)
        except FileExistsError:
            return False
        except (ValueError, NotImplementedError):  # no exclusive creation here: write, then read back
            if self._fs.exists(self._path):
                return False
            with self._fs.open(self._path, "wb") as f:
                f.write(payload)
        return (_read_holder(self._fs, self._path) or {}).get("token") == self.token

    def acquire(self) -> WriterLock:
        if not self._create():
            holder = _read_holder(self._fs, self._path)
            if holder is not None and not _alive(holder):
                logger.warning("%s: taking over the writer lock of process %s, which is no longer running",
                               self.url, holder.get("pid"))
                self._fs.rm(self._path)
                if self._create():
                    self.held = True
                    _HELD[self.token] = self
                    return self
                holder = _read_holder(self._fs, self._path)
            who = _holder_text(holder)
            raise StoreBusyError(f"{self.url} is being written by {who}: one writer at a time may append to a dataset. "
                             f"Run this again when that writer has finished; if no writer is running (it was "
                             f"killed on another machine), delete {self.url.rstrip('/')}/{LOCK_NAME}")
        self.held = True
        _HELD[self.token] = self
        return self

    def release(self) -> None:
        if not self.held:
            return
        self.held = False
        if (_read_holder(self._fs, self._path) or {}).get("token") == self.token:
            self._fs.rm(self._path)

    def __enter__(self) -> WriterLock:
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()


# ---------------------------------------------------------------- opening


def open_root(url: str, kind: str):
    """The root group of the ``kind`` store at ``url`` and its ``xmldask`` attributes, after checking
    kind, layout version, completeness and the chunk inventory (an interrupted replacement is
    recovered first).

    Raises
    ------
    StoreError
        No store at ``url``, or one that fails a check.
    """
    _fs.recover(url)
    try:
        group = zarr.open_group(_fs.zarr_store(url, read_only=True), mode="r")
    except FileNotFoundError as exc:
        if kind == "dataset" and _fs.store_kind(url) == "file":
            raise StoreError(f"{url} is a file, not a dataset store: ingest it first (xmldask ingest {url} --out "
                             "DATA.zarr), then use DATA.zarr") from None
        raise StoreError(f"no {_NOUNS.get(kind, kind)} store at {url}") from exc
    attrs = dict(group.attrs)
    meta = check_kind(attrs, kind, url)
    check_inventory(url, attrs, kind)
    return group, meta


class TailGuard:
    """Keeps an append's rewrites of a dataset's committed chunk files undoable.

    Created by the writer under its lock: a died append's rewritten tail files (committed elements
    unchanged, readers ignore what lies beyond) are adopted into the inventory; the bytes of the
    tail files are kept (one shard per array) so that :meth:`restore` can put them back when the
    append fails, leaving the store byte-identical.
    """

    def __init__(self, url: str, group: zarr.Group):
        self.url = str(url)
        recorded = dict(group.attrs).get(INVENTORY_ATTR)
        self.saved: dict[str, bytes] = {}
        if recorded is None:
            return
        missing, resized, found = mismatches(self.url, recorded)
        if missing or not set(resized) <= tails(recorded):
            check_inventory(self.url, dict(group.attrs), "dataset")  # raises
        if resized:
            logger.warning("%s: adopting the last chunk files rewritten by an append that died: %s", self.url,
                           ", ".join(resized))
            group.attrs.update({INVENTORY_ATTR: {**recorded, **{key: found[key] for key in resized}}})
        fs, root, _ = _fs._split(self.url)
        self._fs, self._root = fs, root.rstrip("/")
        self.saved = {key: fs.cat_file(f"{self._root}/{key}") for key in tails(recorded)}

    def restore(self) -> None:
        """Put the tail files back as they were when the append started."""
        for key, data in self.saved.items():
            self._fs.pipe_file(f"{self._root}/{key}", data)



def timed() -> dict[str, float]:
    """Start accumulating the seconds spent recording and checking inventories in this process.

    Returns the dict that :func:`record_inventory` and :func:`check_inventory` add their times to,
    under their names (for benchmarks: the cost of the integrity work).
    """
    global _TIMES
    _TIMES = {}
    return _TIMES
