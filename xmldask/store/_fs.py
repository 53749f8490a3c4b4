"""Locations of stores: the storage root, fsspec URLs, atomic publication.

Every store is addressed by a URL: a local path (relative paths are relative to the current
directory, as everywhere else) or any fsspec URL such as ``s3://bucket/data/train.zarr`` or
``memory://x``. Programs that pick a location themselves (the demo, the flows) put it under the
*storage root*: the ``root`` parameter, else the ``XMLDASK_STORAGE`` environment variable, else
``storage/`` in the current directory.
"""

from __future__ import annotations

import os
import posixpath
import uuid

import fsspec
import zarr
from fsspec.core import split_protocol, url_to_fs
from zarr.storage import LocalStore

__all__ = ["storage_root", "store_url", "exists", "remove", "zarr_store", "temporary_sibling", "publish"]

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


def publish(tmp_url: str, url: str, *, overwrite: bool = False) -> None:
    """Move a finished store from ``tmp_url`` to ``url``.

    On a local disk the final step is one ``rename`` (atomic for readers). On object stores the
    move is a copy; readers are protected by the ``complete`` flag the writer sets last.
    An existing store at ``url`` is replaced only when ``overwrite`` is true.
    """
    fs, src, local = _split(tmp_url)
    _, dst, _ = _split(url)
    old = None
    if fs.exists(dst):
        if not overwrite:
            raise FileExistsError(f"{url} already exists; pass overwrite=True (--overwrite) to replace it")
        old = temporary_sibling(url) + ".old"
        _, old_path, _ = _split(old)
        _move(fs, dst, old_path, local)
    parent = posixpath.dirname(dst)
    if parent:
        fs.makedirs(parent, exist_ok=True)
    _move(fs, src, dst, local)
    if old is not None:
        remove(old)


def _move(fs, src: str, dst: str, local: bool) -> None:
    if local:
        os.replace(src, dst)
    else:
        fs.mv(src, dst, recursive=True)
