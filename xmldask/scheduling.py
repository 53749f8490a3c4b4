"""Which Dask scheduler computes now: the lowest layer, imported by the stores and the passes alike.

Nothing here imports ``distributed`` unless it is already loaded, so code that never uses a
distributed client does not pay for the import.
"""

from __future__ import annotations

import os
import sys
import threading
import weakref
from contextlib import contextmanager, nullcontext

import dask
from dask.base import get_scheduler

__all__ = ["blas_share", "computed_once", "concurrent_fits", "current_client", "memory_for_data", "parallelism",
           "release_memory", "release_worker_memory", "step_aside", "task_memory_limit", "thread_map",
           "worker_memory_limit", "worker_threads", "workers_in_process"]


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


def _cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def concurrent_fits() -> int:
    """How many model fits to run at once here: the tasks the scheduler runs at once, at most this process's
    cores. A fit's own algebra in this process (the decoder's solves and SGD steps) shares the cores with the
    other fits' (:func:`thread_map` gives each its share of BLAS threads), and its passes wait on the workers;
    two fits at once fill both."""
    return max(1, min(parallelism(), _cores()))


def blas_share(n_threads: int) -> int:
    """The BLAS threads each of ``n_threads`` calls of :func:`thread_map` run with: this process's cores shared
    among them, at least one each. A product's last digits depend on its BLAS threads (OpenBLAS), so a fit made
    alone gives a fit made in the pool's results exactly under this share."""
    return max(1, _cores() // n_threads)


def thread_map(func, items, n_jobs: int | None = None, *, at_once: bool = False) -> list:
    """``[func(item) for item in items]``, computed in up to ``n_jobs`` threads of this process.

    ``n_jobs`` None or 1: in order, in this thread. The results are in the order of ``items`` whatever
    the order the threads finish in; the first exception raised is raised here (the other calls finish
    first). While the threads run, this process's BLAS pools have the cores shared among them (at least one thread
    each): fits at once, each with its dense solves and SGD steps, took longer with a pool of every core
    (lshtc1-dryrun-task2, two ensemble members on 2 cores: 13.5 s against 11 s). Not with ``at_once``: calls that
    race run together only until the race cuts all but one, which then runs alone (its epochs, most of the time)
    and keeps every core, as a fit made alone does.

    ``at_once``: every call starts in a thread of its own, whatever ``n_jobs``, and at most ``n_jobs`` (None: 1) run
    at a time; a call that waits for another's progress steps aside (:func:`step_aside`) and lets another run. Calls
    that wait for each other (a race of fits) so finish with one slot as with many.
    """
    items = list(items)
    if n_jobs is not None and (isinstance(n_jobs, bool) or not isinstance(n_jobs, int) or n_jobs < 1):
        raise ValueError(f"n_jobs must be a positive integer or None, but is {n_jobs!r}")
    if len(items) < 2 or (not at_once and (not n_jobs or n_jobs == 1)):
        return [func(item) for item in items]
    from concurrent.futures import ThreadPoolExecutor

    from threadpoolctl import threadpool_limits

    n_threads = min(n_jobs or 1, len(items))
    slots = threading.Semaphore(n_threads)

    def in_a_slot(item):
        with slots:
            _slot.semaphore = slots
            try:
                return func(item)
            finally:
                _slot.semaphore = None

    # set and restored by this thread alone: OpenBLAS 0.3.30 ignored a change made from another thread after one
    # had been made (and one made while the calls run: a call left alone kept its share)
    # calls at once (a race) run together only until the race cuts them, then the one left runs alone: it keeps
    # every core (lshtc1's race: 17 s -> 13 s, bibtex's default 2.6-2.8 s -> 2.2-2.4 s)
    shared = n_threads > 1 and not at_once
    limits = threadpool_limits(limits=blas_share(n_threads), user_api="blas") if shared else nullcontext()
    with limits, ThreadPoolExecutor(len(items) if at_once else n_threads, thread_name_prefix="xmldask-fit") as pool:
        return list(pool.map(in_a_slot if at_once else func, items))


_slot = threading.local()


@contextmanager
def step_aside():
    """Inside a call of :func:`thread_map` with ``at_once``: free this call's slot while in the block (it waits for
    another call), and take one again after it. Elsewhere: nothing."""
    slots = getattr(_slot, "semaphore", None)
    if slots is None:
        yield
        return
    slots.release()
    try:
        yield
    finally:
        slots.acquire()


_ONCE_LOCK = threading.Lock()
_ONCE: dict = {}  # key -> (weak reference to the value's first array, the value)
_ONCE_PENDING: dict = {}  # key -> threading.Event, set when its computation ends


def computed_once(key, compute):
    """``compute()``, or the value an identical computation of this process made: ``(value, shared)``.

    For fits that share a step (the held-out search's full fits of one setting under two kernels, an ensemble's
    members on one embedding): the first caller of a ``key`` computes, callers that ask meanwhile (fits in other
    threads, :func:`thread_map`) wait for it instead of computing it again, and later callers take it while the
    value's first element, an array, is still referenced elsewhere (a fitted model holds it); nothing is kept past
    that. ``value``: a tuple whose first element is a NumPy array; its arrays must be left unchanged by every
    taker. ``key`` None: computed, never shared. A failed computation is made again by the next caller.
    """
    if key is None:
        return compute(), False
    while True:
        with _ONCE_LOCK:
            held = _ONCE.get(key)
            first = held[0]() if held is not None else None
            if first is not None:
                return (first, *held[1]), True
            event = _ONCE_PENDING.get(key)
            mine = event is None
            if mine:
                event = _ONCE_PENDING[key] = threading.Event()
        if mine:
            break
        event.wait()  # then taken, or computed here if that computation failed
    try:
        value = compute()

        def forget(ref, key=key):
            with _ONCE_LOCK:
                if key in _ONCE and _ONCE[key][0] is ref:
                    del _ONCE[key]

        ref = weakref.ref(value[0], forget)
        with _ONCE_LOCK:
            _ONCE[key] = (ref, tuple(value[1:]))  # the first array weakly: it keeps the entry
        return value, False
    finally:
        with _ONCE_LOCK:
            del _ONCE_PENDING[key]
        event.set()


def read_only(a):
    """``a`` (a NumPy array), marked read-only: the computations of this process may share it
    (:func:`computed_once`)."""
    a.flags.writeable = False
    return a


def worker_memory_limit() -> int | None:
    """The smallest memory limit (bytes) of the current client's workers, or ``None`` (no client, or no
    worker with a limit)."""
    client = current_client()
    if client is None:
        return None
    limits = [w.get("memory_limit") or 0 for w in client.scheduler_info().get("workers", {}).values()]
    limits = [int(limit) for limit in limits if limit > 0]
    return min(limits) if limits else None


def worker_threads() -> int:
    """The most threads a worker of the current client has (1 without a client): the tasks it runs at once."""
    client = current_client()
    if client is None:
        return 1
    return max((int(n) for n in client.nthreads().values()), default=1) or 1


def task_memory_limit() -> int | None:
    """The bytes one task may plan its memory by: the smallest of the current client's workers' memory limits, each
    shared among the worker's threads (a worker runs that many tasks at once, each at its own peak), or ``None``
    (no client, or no worker with a limit). Sizes that one task holds (a label block's sums, a group's rows, a cluster
    block) are cut by it; :func:`worker_memory_limit` is the worker's whole."""
    client = current_client()
    if client is None:
        return None
    shares = [int(w["memory_limit"]) // max(1, int(w.get("nthreads") or 1))
              for w in client.scheduler_info().get("workers", {}).values() if (w.get("memory_limit") or 0) > 0]
    return min(shares) if shares else None


def worker_memory_in_use() -> int:
    """The most memory (bytes) that one of the current client's workers holds now, as the scheduler last heard
    (0 without a client): what a worker holds before a job's tasks (the interpreter, the libraries, data kept)."""
    client = current_client()
    workers = client.scheduler_info().get("workers", {}).values() if client is not None else ()
    return max((int((w.get("metrics") or {}).get("memory") or 0) for w in workers), default=0)


def workers_in_process() -> bool:
    """Whether the current client's workers are threads of this process (a local cluster with
    ``processes=False``: their memory is this process's)."""
    client = current_client()
    workers = client.scheduler_info().get("workers", {}) if client is not None else {}
    return bool(workers) and all(str(address).startswith("inproc://") for address in workers)


def memory_for_data() -> int:
    """Bytes the workers of the current scheduler hold at most: the sum of the ``distributed`` workers'
    memory limits, or this machine's memory (no client, or a worker without a limit)."""
    import psutil

    client = current_client()
    if client is not None:
        limits = [w.get("memory_limit") or 0 for w in client.scheduler_info().get("workers", {}).values()]
        if limits and all(limit > 0 for limit in limits):
            return int(sum(limits))
    return int(psutil.virtual_memory().total)


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


def release_memory() -> None:
    """Hand the memory that this process and the current client's workers have freed back to the OS.

    Between the stages of a fit that holds label-sized objects: the blocks freed by many threads stay in their
    heaps (measured at 100,000 labels: 1.7 GB resident of which 0.6 GB in use), and the next stage's peak adds
    to them.
    """
    _trim_heap()
    release_worker_memory()
