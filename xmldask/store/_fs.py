"""Locations of stores: the storage root, fsspec URLs, atomic publication.

Every store is addressed by a URL: a local path (relative paths are relative to the current
directory, as everywhere else) or any fsspec URL such as ``s3://bucket/data/train.zarr`` or
``memory://x``. Programs that pick a location themselves (the demo, the flows) put it under the
*storage root*: the ``root`` parameter, else the ``XMLDASK_STORAGE`` environment variable, else
``storage/`` in the current directory.
"""

from __future__ import annotations

import json
import logging
import os
import posixpath
import uuid

import fsspec
import zarr
from fsspec.core import split_protocol, url_to_fs
from zarr.storage import LocalStore

__all__ = ["storage_root", "store_url", "exists", "remove", "zarr_store", "temporary_sibling", "publish",
           "store_kind", "check_target", "recover"]

logger = logging.getLogger(__name__)

ENV_ROOT = "XMLDASK_STORAGE"
_LOCAL_PROTOCOLS = {"file", "local"}


def storage_root(root: str | None = None) -> str:
    """The storage root: ``root`` if given, else ``$XMLDASK_STORAGE``, else ``storage``."""
    return str(root or os.environ.get(ENV_ROOT) or "storage")


def store_url(name: str, *, root: str | None = None) -> str:
    """URL of the store called ``name`` under the storage root (``storage/<name>`` by default)."""
    base = storage_root(root).rstrip("/")
    return f"{base}/{name.lstrip('/')}"


def _split(url: str) -> tuple[fsspec.AbstractFileSystem, str, bool]:
    fs, path = url_to_fs(str(url))
    protocol = fs.protocol if isinstance(fs.protocol, str) else fs.protocol[0]
    return fs, path, protocol in _LOCAL_PROTOCOLS


def is_local(url: str) -> bool:
    return _split(url)[2]


def exists(url: str) -> bool:
    fs, path, _ = _split(url)
    return fs.exists(path)


def remove(url: str) -> None:
    """Delete the store at ``url`` (a missing store is not an error)."""
    fs, path, _ = _split(url)
    if fs.exists(path):
        fs.rm(path, recursive=True)


def zarr_store(url: str, *, read_only: bool = False):
    """A Zarr store object for ``url``: a ``LocalStore`` for paths, an fsspec store otherwise."""
    fs, path, local = _split(url)
    if local:
        return LocalStore(path, read_only=read_only)
    return zarr.storage.FsspecStore.from_url(str(url), read_only=read_only)


def temporary_sibling(url: str) -> str:
    """A fresh hidden name beside ``url`` to write into before :func:`publish`.

    A write that dies leaves only such a ``.NAME.partial-XXXX`` entry, never a store at ``url``.
    """
    protocol, path = split_protocol(str(url).rstrip("/"))
    parent, name = posixpath.split(path)
    tmp = f".{name}.partial-{uuid.uuid4().hex[:12]}"
    sibling = posixpath.join(parent, tmp) if parent else tmp
    # keep the protocol: "memory://x" must give "memory://.x.partial-...", not the local "memory:/..."
    return f"{protocol}://{sibling}" if protocol else sibling


#: the hidden name a replaced store is moved to while its replacement moves in: ``.NAME.replaced-XXXX``
_REPLACED = ".replaced-"


def _backups(url: str) -> list[str]:
    """Paths of replaced copies of ``url`` left by a replacement that died between its two moves, oldest first."""
    fs, path, _ = _split(url)
    parent, name = posixpath.split(path.rstrip("/"))
    prefix = f".{name}{_REPLACED}"
    try:
        entries = fs.ls(parent or ".", detail=True)
    except FileNotFoundError:
        return []
    found = [e for e in entries if posixpath.basename(e["name"].rstrip("/")).startswith(prefix)
             and _kind(fs, e["name"]) not in _NOT_OURS]  # a user's look-alike is left alone
    return [e["name"] for e in sorted(found, key=lambda e: (e.get("mtime") or e.get("LastModified") or 0, e["name"]))]


#: what :func:`store_kind` says of a path that xmldask did not write
_NOT_OURS = (None, "zarr", "directory", "file")


def recover(url: str) -> bool:
    """Finish a replacement of the store at ``url`` that died between its two moves.

    With nothing at ``url``, the replaced store is moved back (the replacement is lost; it was never
    published); with a store at ``url``, leftover replaced copies are deleted. Returns whether a
    store was moved back. Openers and :func:`publish` call it.
    """
    backups = _backups(url)
    if not backups:
        return False
    fs, path, local = _split(url)
    if fs.exists(path):
        for old in backups:
            fs.rm(old, recursive=True)
        return False
    logger.warning("%s: a replacement was interrupted between its two moves; moving the replaced store back "
                   "from %s", url, backups[-1])
    _move(fs, backups[-1], path, local)
    for old in backups[:-1]:
        fs.rm(old, recursive=True)
    return True


def store_kind(url: str) -> str | None:
    """What is at ``url``: ``None`` (nothing), an xmldask store kind (``"dataset"``, ``"model"``...),
    ``"zarr"`` (a Zarr group of no xmldask kind), ``"directory"`` or ``"file"``."""
    fs, path, _ = _split(url)
    return _kind(fs, path)


def _kind(fs, path: str) -> str | None:
    """:func:`store_kind` of ``path`` on the file system ``fs``."""
    if not fs.exists(path):
        return None
    if not fs.isdir(path):
        return "file"
    try:
        attrs = json.loads(fs.cat_file(f"{path.rstrip('/')}/zarr.json")).get("attributes") or {}
    except (FileNotFoundError, ValueError):
        return "directory"
    return str((attrs.get("xmldask") or {}).get("kind") or "zarr")


def _same_place(a: str, b: str) -> bool:
    """Whether ``a`` and ``b`` name the same location or one lies inside the other."""
    (fa, pa, la), (fb, pb, lb) = _split(a), _split(b)
    if la and lb:
        pa, pb = os.path.realpath(pa), os.path.realpath(pb)
    elif type(fa) is not type(fb):
        return False
    pa, pb = pa.rstrip("/"), pb.rstrip("/")
    return pa == pb or pa.startswith(pb + "/") or pb.startswith(pa + "/")


def check_target(url: str, *, kind: str, overwrite: bool = False, inputs=()) -> None:
    """Refuse to write a ``kind`` store at ``url`` unless that is safe, before any work starts.

    A store may be written where nothing is, or (with ``overwrite``) over a store of the same kind
    that is none of ``inputs`` (the stores the same command reads). A plain directory or file, a
    store of another kind, or an input is never replaced.

    Raises
    ------
    FileExistsError
        With what is at ``url`` and the fix.
    """
    for source in inputs:
        if source and _same_place(url, str(source)):
            raise FileExistsError(f"{url} is also an input of this command ({source}); write the {kind} store "
                                  "somewhere else")
    recover(url)
    found = store_kind(url)
    if found is None:
        return
    if not overwrite:
        raise FileExistsError(f"{url} already exists; pass overwrite=True (--overwrite) to replace it")
    if found != kind:
        what = {"file": "a file", "directory": "a directory that is not an xmldask store",
                "zarr": "a Zarr store not written by xmldask"}.get(found, f"a {found} store")
        raise FileExistsError(f"{url} is {what}; --overwrite replaces only a {kind} store. Choose another "
                              "location, or remove it yourself if it is no longer needed")


def _tmp_kind(tmp_url: str) -> str | None:
    kind = store_kind(tmp_url)
    return None if kind in (None, "file", "directory") else kind


def publish(tmp_url: str, url: str, *, overwrite: bool = False) -> None:
    """Move a finished store from ``tmp_url`` to ``url``.

    On a local disk the final step is one ``rename`` (atomic for readers). On object stores the
    move is a copy; readers are protected by the ``complete`` flag the writer sets last.
    An existing store at ``url`` is replaced only when ``overwrite`` is true and (for a Zarr store)
    it is of the same kind. The replaced store is first moved to the hidden name
    ``.NAME.replaced-XXXX`` and deleted last: if the process dies between the two moves,
    :func:`recover` (called by every opener and writer) moves it back.
    """
    fs, src, local = _split(tmp_url)
    _, dst, _ = _split(url)
    recover(url)
    old = None
    if fs.exists(dst):
        kind = _tmp_kind(tmp_url)
        if kind is not None:
            check_target(url, kind=kind, overwrite=overwrite)
        elif not overwrite:
            raise FileExistsError(f"{url} already exists; pass overwrite=True (--overwrite) to replace it")
        parent, name = posixpath.split(dst.rstrip("/"))
        old = posixpath.join(parent, f".{name}{_REPLACED}{uuid.uuid4().hex[:12]}")
        _move(fs, dst, old, local)
    parent = posixpath.dirname(dst)
    if parent:
        fs.makedirs(parent, exist_ok=True)
    _move(fs, src, dst, local)
    if old is not None:
        fs.rm(old, recursive=True)


def _move(fs, src: str, dst: str, local: bool) -> None:
    if local:
        os.replace(src, dst)
    else:
        fs.mv(src, dst, recursive=True)
