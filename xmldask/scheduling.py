"""Which Dask scheduler computes now: the lowest layer, imported by the stores and the passes alike.

Nothing here imports ``distributed`` unless it is already loaded, so code that never uses a
distributed client does not pay for the import.
"""

from __future__ import annotations

import os
import sys

import dask
from dask.base import get_scheduler

__all__ = ["current_client", "parallelism", "release_worker_memory", "worker_memory_limit"]


def current_client():
    """The ``distributed.Client`` that ``dask.compute`` would use now, or ``None``."""
    if "distributed" not in sys.modules:
        return None
    from distributed import Client

    try:
        get = get_scheduler()
    except (RuntimeError, ValueError):
        return None
    client = getattr(get, "__self__", None)
    if isinstance(client, Client) and not client.asynchronous:
        return client
    return None


def parallelism() -> int:
    """Tasks the current scheduler runs at once (workers x threads for a distributed client)."""
    client = current_client()
    if client is not None:
        return max(1, sum(client.nthreads().values()))
    return max(1, dask.config.get("num_workers", None) or os.cpu_count() or 1)


def worker_memory_limit() -> int | None:
    """The smallest memory limit (bytes) of the current client's workers, or ``None`` (no client, or no
    worker with a limit)."""
    client = current_client()
    if client is None:
        return None
    limits = [w.get("memory_limit") or 0 for w in client.scheduler_info().get("workers", {}).values()]
    limits = [int(limit) for limit in limits if limit > 0]
    return min(limits) if limits else None


def _trim_heap() -> None:
    """Collect garbage and return the freed heap to the OS (glibc's ``malloc_trim``; a no-op elsewhere)."""
    import ctypes
    import gc

    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def release_worker_memory() -> None:
    """Hand the memory the workers of the current client have freed back to the OS.

    After a long computation a worker's RSS stays near its peak (freed blocks stay in the process's
    heap), and its nanny counts that against the memory limit: the next job's first tasks may push it
    over and have the worker restarted. A no-op without a ``distributed`` client.
    """
    client = current_client()
    if client is not None:
        client.run(_trim_heap)
