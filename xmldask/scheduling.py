"""Which Dask scheduler computes now: the lowest layer, imported by the stores and the passes alike.

Nothing here imports ``distributed`` unless it is already loaded, so code that never uses a
distributed client does not pay for the import.
"""

from __future__ import annotations

import os
import sys

import dask
from dask.base import get_scheduler

__all__ = ["current_client", "parallelism"]


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
