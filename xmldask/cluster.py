"""One way to get a Dask ``distributed.Client`` for the command line, the flows and the benchmarks.

:func:`cluster` is a context manager that yields a ``distributed.Client``:

- connected to an existing scheduler when an address is given (``address=`` or ``--scheduler``,
  else the environment variable ``XMLDASK_SCHEDULER``); leaving the ``with`` block closes only the
  client, never that scheduler or its workers;
- otherwise on a new ``distributed.LocalCluster`` on this machine, closed on exit.

Either way it logs the dashboard link (logger ``xmldask.cluster``; also ``client.dashboard_link``),
limits the BLAS/OpenMP thread pools of every worker process to ``blas_threads`` (one by default; a worker plugin
calling ``threadpoolctl.threadpool_limits``; local worker processes also get ``OMP_NUM_THREADS``,
``OPENBLAS_NUM_THREADS`` and ``MKL_NUM_THREADS`` before they start), lets every worker's ``malloc``
reuse freed large blocks (:class:`MallocThresholds`), and can write a Dask
performance report (an HTML page of the task stream, worker profiles and bandwidth) of the body.

Default layout of a local cluster
---------------------------------
**One worker process using every core as a thread** (``processes=True``, ``n_workers=1``,
``threads_per_worker = cores``), with ``memory_limit="auto"`` (all of the machine's memory).

Why (the timings: docs/measurements.md, "Local cluster layout"): threads win because the per-block kernels
(SciPy's sparse products, Zarr's decompression) release the GIL, and one process holds one copy of
``Q`` and sums the ``(d, k)`` block results in place, where two processes exchange them over TCP. The
worker is still a separate process watched by a nanny, so its ``memory_limit`` is enforced (spill at 60%,
pause at 80%, restart at 95%), unlike threads of the client process (``processes=False``). Past a handful
of cores the GIL-holding parts (task bookkeeping, Python glue) start to matter: pass ``n_workers`` to split
the cores among processes.

**Small data: threads of this process.** When the data a cluster is started for is known (``data_bytes``,
e.g. a dataset store's :attr:`~xmldask.store.Dataset.nbytes`) and takes at most
:data:`IN_PROCESS_MEMORY_SHARE` of the machine's memory, the workers are threads of this process: no
process start-up, no pickling of row blocks and results between a worker and this process (where the
decoder's SGD epochs and the searches run), and no limit to enforce that the data could reach
(docs/measurements.md).

Examples
--------
>>> from xmldask.cluster import cluster
>>> with cluster(n_workers=1, threads_per_worker=1, dashboard_address=None) as client:  # doctest: +SKIP
...     G = xt_x_q(X, Q).compute()

From the command line, the same options for every command::

    parser = argparse.ArgumentParser()
    add_cluster_arguments(parser)
    args = parser.parse_args()
    with cluster_from_args(args) as client:
        ...
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import sys
import time
import weakref
from collections.abc import Iterator
from pathlib import Path

import psutil
from distributed import WorkerPlugin

__all__ = [
    "BLAS_ENV_VARS",
    "DEFAULT_TIMEOUT",
    "ENV_SCHEDULER",
    "IN_PROCESS_MEMORY_SHARE",
    "PAUSE_LIMIT",
    "PROFILE_HISTORY",
    "BlasThreadLimit",
    "MallocThresholds",
    "small_pages",
    "WorkerLost",
    "add_cluster_arguments",
    "cluster",
    "cluster_from_args",
    "default_layout",
    "lost_workers",
    "parse_memory_limit",
    "paused_out",
    "worker_blas_threads",
    "worker_loss_error",
]

logger = logging.getLogger(__name__)

#: the smallest worker memory limit accepted (bytes): a worker holds about 100 MiB before its first task, so a
#: smaller limit only pauses it (and floods the log with its memory warnings)
MIN_MEMORY_LIMIT = 128 * 2**20
#: seconds every worker may stay paused for memory before a job stops with a ``MemoryError`` (:func:`cluster`)
PAUSE_LIMIT = 60.0
#: seconds between two looks at the workers' status
PAUSE_POLL = 1.0
#: environment variable holding the address of an existing scheduler to connect to
ENV_SCHEDULER = "XMLDASK_SCHEDULER"
#: seconds to wait for a scheduler before giving up
DEFAULT_TIMEOUT = 10.0
#: environment variables read by OpenMP, OpenBLAS and MKL when a process starts
BLAS_ENV_VARS = ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS")
#: seconds (one-second cycles) of statistical profile a worker keeps for the dashboard's Profile page.
#: Dask keeps 1000, whose memory grows with the job's length until a small worker pauses with nothing to
#: spill (docs/measurements.md, "Profile history"); a minute of history is enough for the dashboard. (Dask
#: sizes this history, the scheduler's transition log and a comm's recent messages by one setting,
#: ``distributed.admin.low-level-log-length``; its developer logs get shorter too.)
PROFILE_HISTORY = 60
#: a local cluster for data of at most this share of the machine's memory runs its workers as threads of
#: this process (see "Small data" above): a sixteenth leaves the process far from any memory trouble that
#: a nanny-watched worker process would guard against
IN_PROCESS_MEMORY_SHARE = 1 / 16
#: the schemes a scheduler address may use
_SCHEMES = ("tcp", "tls", "inproc", "ucx", "ws", "wss")
_FIX = (
    "start a scheduler there (`dask scheduler`, then `dask worker ADDRESS` on each machine), correct the "
    f"address, or leave out --scheduler / unset ${ENV_SCHEDULER} to start a local cluster"
)


def default_layout(n_cores: int | None = None, data_bytes: int | None = None) -> tuple[int, int, bool]:
    """The default ``(n_workers, threads_per_worker, processes)`` of a local cluster.

    Parameters
    ----------
    n_cores : int, optional
        Cores to use; default the cores this process may run on.
    data_bytes : int, optional
        Size of the data the cluster is for, if known: at most :data:`IN_PROCESS_MEMORY_SHARE` of the
        machine's memory makes the workers threads of this process.

    Returns
    -------
    tuple of (int, int, bool)
        One worker with one thread per core, a process unless the data is small (see the module
        documentation for why).
    """
    if n_cores is None:
        n_cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    small = data_bytes is not None and data_bytes <= IN_PROCESS_MEMORY_SHARE * psutil.virtual_memory().total
    return 1, max(1, int(n_cores)), not small


def parse_memory_limit(value):
    """Check a worker memory limit and normalise it for ``distributed``.

    Parameters
    ----------
    value : str, int, float or None
        ``"auto"`` (the machine's memory divided among the workers), a size such as ``"2GB"``,
        ``"512 MiB"`` or a number of bytes, a fraction of the machine's memory such as ``0.25``, or
        ``None`` / ``0`` / ``"none"`` for no limit.

    Returns
    -------
    str, int, float or None
        ``"auto"``, a number of bytes (int), a fraction (float in (0, 1]) or ``None``.

    Raises
    ------
    ValueError
        For anything else, with the accepted forms in the message.
    """
    from dask.utils import parse_bytes

    if value is None or (isinstance(value, str) and value.strip().lower() in ("none", "0", "")):
        return None
    if isinstance(value, bool):
        raise ValueError(f"memory_limit must be 'auto', a size like '2GB', a number of bytes or None, not {value!r}")
    if isinstance(value, str):
        text = value.strip()
        if text.lower() == "auto":
            return "auto"
        try:
            number = float(text)
        except ValueError:
            number = None
        if number is not None and 0 < number <= 1:
            return number
        try:
            value = parse_bytes(text)
        except (ValueError, TypeError) as exc:
            raise ValueError(f"memory_limit {value!r} is not a size: use 'auto', a size like '2GB' or '512MiB', "
                             f"a number of bytes, a fraction of the machine's memory like 0.25, or 'none'") from exc
    if isinstance(value, float) and 0 < value <= 1:
        return value
    if isinstance(value, (int, float)) and value >= 0:
        if 0 < value < MIN_MEMORY_LIMIT:
            raise ValueError(f"memory_limit {int(value):,} bytes is below what a Dask worker holds before any task "
                             f"(about 100 MiB: docs/measurements.md); give at least {MIN_MEMORY_LIMIT // 2**20} MiB, "
                             "e.g. '2GB', or a fraction of the machine's memory such as 0.25")
        return int(value) or None
    raise ValueError(f"memory_limit must be 'auto', a size like '2GB', a number of bytes, a fraction in (0, 1] or "
                     f"None, but is {value!r}")


def _positive_int(name: str, value) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive integer or None, but is {value!r}")
    return value


def _normalise_address(address: str) -> str:
    """``host:port`` becomes ``tcp://host:port``; a malformed address is a ``ValueError``."""
    if not isinstance(address, str) or not address.strip():
        raise ValueError(f"a scheduler address must be a non-empty string like tcp://host:8786, not {address!r}")
    address = address.strip()
    if "://" not in address:
        address = "tcp://" + address
    scheme, _, location = address.partition("://")
    if scheme not in _SCHEMES:
        raise ValueError(f"invalid Dask scheduler address {address!r}: unknown protocol {scheme!r} (expected one of "
                         f"{', '.join(_SCHEMES)}), for example tcp://host:8786")
    if scheme in ("tcp", "tls", "ws", "wss"):
        host, sep, port = location.rpartition(":")
        if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ValueError(f"invalid Dask scheduler address {address!r}: expected {scheme}://HOST:PORT, "
                             f"for example {scheme}://127.0.0.1:8786")
    return address


@contextlib.contextmanager
def small_pages():
    """NumPy's arrays of 4 MiB or more in small pages inside the block, unless ``NUMPY_MADVISE_HUGEPAGE`` is set.

    NumPy ``madvise``-s transparent huge pages for them; a fresh huge page is zeroed (and memory compacted for it,
    under the kernel's ``defrag=madvise``: numpy/numpy#31590) at its first touch. Where the workers are threads of
    this process (small data), the fits' in-memory solves allocate such temporaries in every step: on the machine
    we measure on a fresh 64 MiB array was first written at 0.22 GB/s in huge pages against 1.67 in small ones, and
    bibtex's default training took 4.92 s against 2.60 (medians of 3). Worker processes streaming row blocks keep
    NumPy's default: the 1M-label fit on two of them took 1,361 s with huge pages against 1,550 without
    (docs/benchmarks.md, "Stop 79"). The numbers are the same either way; a value the user set is kept.
    """
    setter = None
    if "NUMPY_MADVISE_HUGEPAGE" not in os.environ:
        try:
            from numpy._core.multiarray import _set_madvise_hugepage as setter
        except ImportError:  # another NumPy layout: its default stays
            pass
    before = setter(False) if setter else None
    try:
        yield
    finally:
        if setter:
            setter(before)


class BlasThreadLimit(WorkerPlugin):
    """Worker plugin: limit the BLAS and OpenMP thread pools of each worker with ``threadpoolctl``.

    Every library ``threadpoolctl`` finds is limited (here two OpenBLAS copies: NumPy's and SciPy's).
    The controller is kept on the plugin and the previous limits are restored on teardown.

    Parameters
    ----------
    n_threads : int
        Threads per pool.
    """

    name = "xmldask-blas-threads"
    idempotent = False

    def __init__(self, n_threads: int):
        self.n_threads = int(n_threads)
        self.controller = None

    def __getstate__(self):
        return {"n_threads": self.n_threads, "controller": None}

    def setup(self, worker=None):
        """Apply the limit in this worker's process."""
        from threadpoolctl import threadpool_limits

        try:  # load SciPy's own BLAS now, so that it is limited too (threadpoolctl sees loaded libraries only)
            import scipy.linalg  # noqa: F401
        except ImportError:
            pass
        self.controller = threadpool_limits(limits=self.n_threads)

    def teardown(self, worker=None):
        """Restore the limits found at setup."""
        if self.controller is not None:
            self.controller.restore_original_limits()
            self.controller = None

    def __repr__(self) -> str:
        return f"{type(self).__name__}(n_threads={self.n_threads})"


class MallocThresholds(WorkerPlugin):
    """Worker plugin: let glibc's ``malloc`` keep freed large blocks for reuse (``mallopt``).

    Dask's nanny starts its workers with ``MALLOC_TRIM_THRESHOLD_=65536`` (so that freed memory goes back
    to the system at once), which also turns off glibc's adaptive thresholds: every array above 128 KiB
    is then mapped afresh and its pages faulted in one by one, and freeing it unmaps them. A pass
    allocates its block, ``X_b Q`` and a ``(d, k)`` result in every task, and two threads of one worker
    faulting and unmapping at once serialise on the kernel's address-space lock.

    This sets the threshold below which arrays come from the heap (and are reused) to
    ``memory_limit / 512`` between 128 KiB and 32 MiB (glibc's own adaptive maximum on 64-bit systems),
    and the trim threshold to twice that, as glibc's adaptive rule pairs them: a worker of the machine's
    24 GB gets 32 MiB, one of 1 GiB 2 MiB, one of 256 MiB 512 KiB. What the heap keeps grows with the
    threshold, so it is bounded by the worker's limit (docs/measurements.md). A no-op where the C library is
    not glibc. Teardown puts
    back what a process started with ``MALLOC_TRIM_THRESHOLD_`` had (a nanny's worker: 128 KiB and that
    trim threshold); a process started without it (workers that are threads of the client's process)
    keeps these thresholds, near where glibc's adaptive rule had taken it (mallopt cannot turn that rule
    back on).
    """

    name = "xmldask-malloc-thresholds"
    idempotent = True
    #: the share of the worker's memory limit, and the bounds, of the heap's ``M_MMAP_THRESHOLD``
    limit_share = 1 / 512
    bounds = (128 << 10, 32 << 20)

    def thresholds(self, memory_limit: int | None) -> tuple[int, int]:
        """``(mmap_threshold, trim_threshold)`` in bytes for a worker of ``memory_limit`` bytes (None: none)."""
        low, high = self.bounds
        mmap_threshold = high if not memory_limit else int(min(max(memory_limit * self.limit_share, low), high))
        return mmap_threshold, 2 * mmap_threshold

    def setup(self, worker=None):
        """Set the thresholds in this worker's process."""
        memory_limit = getattr(getattr(worker, "memory_manager", None), "memory_limit", None)
        _mallopt(*self.thresholds(memory_limit))

    def teardown(self, worker=None):
        """Back to the fixed thresholds of a process started with ``MALLOC_TRIM_THRESHOLD_``."""
        trim = os.environ.get("MALLOC_TRIM_THRESHOLD_")
        if trim and trim.isdigit():
            _mallopt(128 << 10, int(trim))

    def __repr__(self) -> str:
        return f"{type(self).__name__}(limit_share={self.limit_share}, bounds={self.bounds})"


def _mallopt(mmap_threshold: int, trim_threshold: int) -> bool:
    """glibc's ``mallopt(M_MMAP_THRESHOLD, ...)`` and ``mallopt(M_TRIM_THRESHOLD, ...)``; False without glibc."""
    import ctypes
    import ctypes.util

    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):  # musl and others: no mallopt
        return False
    M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3
    return bool(mallopt(M_MMAP_THRESHOLD, int(mmap_threshold))) and bool(mallopt(M_TRIM_THRESHOLD, int(trim_threshold)))


def worker_blas_threads(client) -> dict[str, list[dict]]:
    """The thread pools ``threadpoolctl`` sees in each worker: ``{worker address: threadpool_info()}``.

    Parameters
    ----------
    client : distributed.Client

    Returns
    -------
    dict
        One list of dicts per worker, with keys such as ``internal_api``, ``filepath`` and
        ``num_threads``.
    """
    from threadpoolctl import threadpool_info

    return client.run(threadpool_info)


def _handshake(address: str, timeout: float) -> None:
    """Open one connection to ``address`` and exchange Dask's handshake, all within ``timeout`` seconds.

    ``Client`` waits for the handshake without a deadline: a server of another protocol (an HTTP
    server, say) that accepts the connection and says nothing would hang it. The probe runs in a
    thread of its own with its own event loop (callers may run inside one).
    """
    import asyncio
    from concurrent.futures import ThreadPoolExecutor

    from distributed.comm import connect

    async def probe():
        comm = await asyncio.wait_for(connect(address, timeout=timeout), timeout)
        await comm.close()

    pool = ThreadPoolExecutor(1, thread_name_prefix="xmldask-scheduler-probe")
    try:
        pool.submit(asyncio.run, probe()).result(timeout + 1)
    except TimeoutError as exc:  # asyncio's and concurrent.futures' are the builtin
        raise TimeoutError(f"no Dask scheduler answered within {timeout:g} s: nothing accepts connections there, or "
                           "what does is not a Dask scheduler") from exc
    finally:
        pool.shutdown(wait=False)


def _connect(address: str, timeout: float):
    from distributed import Client

    start = time.perf_counter()
    try:
        if address.startswith("tcp://"):
            _handshake(address, timeout)
        return Client(address, timeout=timeout, set_as_default=True)
    except (OSError, TimeoutError) as exc:
        waited = time.perf_counter() - start
        raise ConnectionError(f"could not connect to the Dask scheduler at {address} (gave up after {waited:.1f} s, "
                              f"timeout {timeout:g} s: {exc}); {_FIX}") from exc


def _describe_limit(limit) -> str:
    from dask.utils import format_bytes

    if limit is None:
        return "none"
    if isinstance(limit, str):
        return limit
    return f"{limit:.0%} of RAM" if isinstance(limit, float) else format_bytes(limit)


def _dashboard(client, enabled: bool) -> str | None:
    if not enabled:
        return None
    try:
        link = client.dashboard_link
    except Exception:  # noqa: BLE001 - no dashboard service, or no bokeh: just no link
        return None
    return link or None


def _given_limit(memory_limit) -> bool:
    """Whether ``memory_limit`` sets a limit per worker (not ``"auto"``, nor none)."""
    return parse_memory_limit(memory_limit) not in ("auto", None)


@contextlib.contextmanager
def cluster(address: str | None = None, *, n_workers: int | None = None, threads_per_worker: int | None = None,
            processes: bool | None = None, memory_limit="auto", dashboard_address: str | int | None = ":8787",
            performance_report: str | os.PathLike | None = None, blas_threads: int | str | None = "auto",
            silence_logs: int | bool = logging.WARNING, timeout: float = DEFAULT_TIMEOUT,
            data_bytes: int | None = None, pause_limit: float = PAUSE_LIMIT, **cluster_kwargs) -> Iterator:
    """A ``distributed.Client`` on an existing scheduler or on a new local cluster.

    Parameters
    ----------
    address : str, optional
        Address of a running scheduler, such as ``tcp://host:8786`` (``host:8786`` means TCP).
        Default: the environment variable ``XMLDASK_SCHEDULER``; if that is unset or empty, a
        ``LocalCluster`` is started. On exit only the client is closed, never that scheduler.
    n_workers, threads_per_worker : int, optional
        Local cluster only. Default :func:`default_layout`: one worker with a thread per core
        (with only ``n_workers`` given, the cores are shared among them; with only
        ``threads_per_worker``, ``cores // threads_per_worker`` workers).
    processes : bool, optional
        Local cluster only: workers in their own processes, or as threads of this process. Default:
        threads when ``data_bytes`` is at most :data:`IN_PROCESS_MEMORY_SHARE` of the machine's memory
        and no ``memory_limit`` is given, else processes (an in-process worker's limit would count the whole
        process, the fitting code's arrays too: with a 1 GiB limit it paused at once on a 1M-label fit).
    memory_limit : str, int, float or None, default "auto"
        Local cluster only: limit per worker (:func:`parse_memory_limit`), e.g. ``"2GB"``. Dask
        spills to disk past 60% of it, pauses the worker at 80% and restarts it at 95%.
    dashboard_address : str, int or None, default ":8787"
        Local cluster only: where to serve the dashboard; ``0`` or ``":0"`` for a free port (if
        8787 is taken, Dask also picks a free port), ``None`` for no dashboard.
    performance_report : str or path-like, optional
        Write a Dask performance report (HTML) of everything computed inside the ``with`` block
        to this file; its parent directories are created.
    blas_threads : int, "auto" or None, default "auto"
        Threads of each BLAS/OpenMP pool inside every worker (``None``: leave them alone). One
        thread per pool avoids oversubscription when every core already runs a task. ``"auto"``: one in
        worker processes; left alone where the workers are threads of this process, whose pools they share with
        the code that fits in this process (its dense solves and decoder steps: a limit there is the whole
        process's). OpenBLAS serves concurrent callers from its one pool: measured on 2 cores, a 2000 x 2000
        product took 0.8 s alone with two threads against 1.5 s with one, and two or four callers at once took
        the same time with either (docs/measurements.md, "BLAS threads of in-process workers").
    silence_logs : int or bool, default logging.WARNING
        Local cluster only: level of the scheduler's and workers' log messages shown.
    timeout : float, default 10
        Seconds to wait for an existing scheduler (or for the local cluster to start).
    data_bytes : int, optional
        Local cluster only: the size of the data it is for, which chooses ``processes`` when that is not
        given (e.g. ``open_dataset(url).nbytes``).
    pause_limit : float, default :data:`PAUSE_LIMIT`
        Seconds that every worker may stay paused for memory (at ``distributed.worker.memory.pause`` of its
        limit, waiting for memory that may never be freed) before the job's tasks are cancelled and a
        ``MemoryError`` says so, with the limits.
    **cluster_kwargs
        Passed on to ``distributed.LocalCluster`` (e.g. ``local_directory``, ``scheduler_port``).

    Yields
    ------
    distributed.Client
        The client, set as the default scheduler of ``dask.compute`` inside the block; its
        ``dashboard_link`` is logged at start (``None`` without a dashboard).

    Raises
    ------
    ValueError
        A malformed address or option, with the accepted forms.
    ConnectionError
        No scheduler answered at ``address`` within ``timeout`` seconds.
    """
    if timeout is None or not timeout > 0:
        raise ValueError(f"timeout must be a positive number of seconds, but is {timeout!r}")
    auto_blas = isinstance(blas_threads, str) and blas_threads == "auto"
    if isinstance(blas_threads, str) and not auto_blas:
        raise ValueError(f"blas_threads must be a positive integer, 'auto' or None, but is {blas_threads!r}")
    blas_threads = 1 if auto_blas else _positive_int("blas_threads", blas_threads)
    source = "address"
    if address is None:
        address = os.environ.get(ENV_SCHEDULER) or None
        source = f"${ENV_SCHEDULER}"
    with contextlib.ExitStack() as stack:
        quiet = stack.enter_context(_MutedOnTrip())  # entered first: restores the log levels last
        if address is not None:
            local_only = {"n_workers": n_workers, "threads_per_worker": threads_per_worker, "processes": processes}
            ignored = [name for name, value in local_only.items() if value is not None] + sorted(cluster_kwargs)
            client = stack.enter_context(_existing(_normalise_address(address), source, timeout, ignored))
            dashboard_on = True
        else:
            if processes is None:
                # a limit given per worker asks for worker processes: threads of this process would count the whole
                # process (the fitting code's arrays too) against it, and pause at once
                processes = default_layout(data_bytes=data_bytes)[2] or _given_limit(memory_limit)
            if auto_blas and not processes:  # threads of this process: its pools are the fitting code's too
                blas_threads = None
            if not processes:
                stack.enter_context(small_pages())
            client = stack.enter_context(_local(
                n_workers=n_workers, threads_per_worker=threads_per_worker, processes=processes,
                memory_limit=memory_limit, dashboard_address=dashboard_address, blas_threads=blas_threads,
                silence_logs=silence_logs, timeout=timeout, cluster_kwargs=cluster_kwargs))
            dashboard_on = dashboard_address is not None
        if blas_threads is not None:
            client.register_plugin(BlasThreadLimit(blas_threads), name=BlasThreadLimit.name)
        client.register_plugin(MallocThresholds(), name=MallocThresholds.name)
        link = _dashboard(client, dashboard_on)
        logger.info("Dask dashboard: %s", link or "disabled")
        if performance_report is not None:
            from distributed import performance_report as report

            path = Path(performance_report).expanduser()
            path.parent.mkdir(parents=True, exist_ok=True)
            stack.enter_context(_logged_report(report, path))
        watch = stack.enter_context(_PauseWatch(client, pause_limit, on_trip=quiet.mute))
        try:
            yield client
        except Exception as exc:
            if watch.tripped:
                raise MemoryError(watch.tripped) from None
            lost = watch.lost() if worker_loss_error(exc) else ""
            if lost:
                raise WorkerLost(f"{lost} ({type(exc).__name__}: {exc})") from exc
            raise


class WorkerLost(MemoryError):
    """A job failed because Dask workers left the cluster while it ran, taking data or tasks with them; the
    message names the workers, their last memory reading and what to change. A ``MemoryError``, because that is
    what it nearly always is (a nanny restarts its worker past 95 % of the worker's memory limit), and so that
    code which stops cleanly on memory errors (the command line, the flows' stages) stops cleanly on it too."""


def worker_loss_error(exc: BaseException) -> bool:
    """Whether ``exc`` is how Dask reports work lost with a worker: a future cancelled because its dependencies
    were lost, a task that killed its workers (``KilledWorker``), or a scatter that found no worker (a
    ``TimeoutError`` while they restart)."""
    from concurrent.futures import CancelledError

    from distributed.scheduler import KilledWorker

    return isinstance(exc, (CancelledError, KilledWorker, TimeoutError))


class _MutedOnTrip:
    """Dask's and asyncio's log records above CRITICAL once :meth:`mute` is called (a job cancelled on purpose
    logs a traceback per interrupted exchange while the cluster closes), their levels restored on exit."""

    NAMES = ("distributed", "asyncio")

    def __init__(self):
        self.saved: dict[str, int] = {}

    def mute(self) -> None:
        for name in self.NAMES:
            log = logging.getLogger(name)
            self.saved.setdefault(name, log.level)
            log.setLevel(logging.CRITICAL + 1)

    def __enter__(self) -> _MutedOnTrip:
        return self

    def __exit__(self, *exc) -> None:
        for name, level in self.saved.items():
            logging.getLogger(name).setLevel(level)


#: the pause watch of each client that :func:`cluster` yields, while it runs
_WATCHES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _current_watch(client):
    if client is None:
        from distributed import default_client

        try:
            client = default_client()
        except ValueError:
            return None
    return _WATCHES.get(client)


def lost_workers(client=None) -> str:
    """The workers of ``client`` (default: the current one) that left the cluster since its :func:`cluster` block
    began, with their last memory reading and what to change (the message of the :class:`WorkerLost` that
    :func:`cluster` raises), else ``""``. For code that runs a job inside a block entered elsewhere."""
    watch = _current_watch(client)
    return watch.lost() if watch is not None else ""


def paused_out(client=None) -> str:
    """Why the jobs of ``client`` (default: the current one) were cancelled, if its workers stayed paused for
    memory past :data:`PAUSE_LIMIT` (the message of the ``MemoryError`` that :func:`cluster` raises), else ``""``.
    For code that runs a job inside a :func:`cluster` block entered elsewhere (a flow's stage), whose error
    otherwise names only the cancelled task."""
    watch = _current_watch(client)
    return watch.tripped if watch is not None else ""


class _PauseWatch:
    """Watches the workers while a job runs: when every one of them has been paused for memory longer than
    ``limit`` seconds, the client's tasks are cancelled (the job's ``compute`` raises) and :attr:`tripped` says
    why, with the workers' memory and limits. A pause that ends (memory freed, spilled) resets the clock. It also
    keeps each worker's last memory reading, so that :meth:`lost` can name the workers that left and how full they
    were."""

    def __init__(self, client, limit: float, on_trip=None):
        import threading

        self.client, self.limit, self.tripped, self.on_trip = client, float(limit), "", on_trip
        self.seen: dict[str, tuple[str, float, float]] = {}  # address: (name, memory, limit) when last seen
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="xmldask-pause-watch", daemon=True)

    def __enter__(self) -> _PauseWatch:
        _WATCHES[self.client] = self
        self._workers()  # the workers at the start: a job shorter than a poll can lose one too
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        _WATCHES.pop(self.client, None)

    def _workers(self) -> dict | None:
        """The scheduler's workers (address: info), their readings kept in :attr:`seen`; ``None`` if it did not
        answer."""
        try:
            workers = self.client.scheduler_info(n_workers=-1).get("workers", {})
        except Exception:  # noqa: BLE001 - the client is closing, or the scheduler is briefly busy
            return None
        for address, w in workers.items():
            self.seen[address] = (str(w.get("name")), float((w.get("metrics") or {}).get("memory", 0) or 0),
                                  float(w.get("memory_limit") or 0))
        return workers

    def lost(self) -> str:
        """The workers seen since the watch began that the scheduler no longer has, as a sentence with their last
        memory reading and what to change; ``""`` if none left."""
        workers = self._workers()
        if workers is None:
            return ""
        gone = [(address, *self.seen[address]) for address in sorted(set(self.seen) - set(workers))]
        if not gone:
            return ""
        # a worker restarted by its nanny keeps its name, at a new address; restarts between two polls go uncounted
        by_name: dict[str, list] = {}
        for address, name, memory, limit in gone:
            by_name.setdefault(name, []).append((address, memory, limit))
        said = []
        for name, left in by_name.items():
            address, memory, limit = max(left, key=lambda item: item[1])
            reading = f"{memory / 2**20:,.0f} MiB" + (f" of its {limit / 2**20:,.0f} MiB limit ({memory / limit:.0%})"
                                                        if limit else "")
            times = f", {len(left)} times" if len(left) > 1 else ""
            said.append(f"{name} ({address}{times}; last seen using {reading})")
        import dask

        # past the share where Dask starts to spill, the worker was full enough for its nanny's restart
        full = any(limit and memory >= dask.config.get("distributed.worker.memory.target") * limit
                   for _, _, memory, limit in gone)
        terminate = dask.config.get("distributed.worker.memory.terminate")
        return (f"{len(by_name)} Dask worker(s) left the cluster while the job ran: {'; '.join(said)}. "
                + (f"A worker's nanny restarts it past {terminate:.0%} of its memory limit (between two readings, a "
                   "second apart), and the work or data it held is lost. " if full else
                   "Their data and tasks went with them (a worker's log says why it stopped). ")
                + "Give the workers more memory (--memory-limit), or fewer threads each (--threads-per-worker), "
                "or smaller row blocks (xmldask ingest --block-rows)")

    def _run(self) -> None:
        since = None
        while not self._stop.wait(PAUSE_POLL):
            workers = self._workers()
            if workers is None:
                continue
            if not workers or any(w.get("status") != "paused" for w in workers.values()):
                since = None
                continue
            since = since or time.monotonic()
            if time.monotonic() - since < self.limit:
                continue
            used = ", ".join(f"{w.get('name')}: {(w.get('metrics') or {}).get('memory', 0) / 2**20:,.0f} MiB of "
                             f"{(w.get('memory_limit') or 0) / 2**20:,.0f} MiB" for w in workers.values())
            self.tripped = (f"every Dask worker has been paused for memory for more than {self.limit:g} s ({used}), "
                            "waiting for memory that the job cannot free: give the workers more memory "
                            "(--memory-limit), or fewer threads per worker, or smaller row blocks "
                            "(xmldask ingest --block-rows)")
            logger.info("%s; cancelling the job", self.tripped)
            if self.on_trip is not None:
                self.on_trip()
            from distributed import Future

            try:
                self.client.cancel([Future(key, self.client) for key in list(self.client.futures)], force=True)
            except Exception:  # noqa: BLE001 - the job ended meanwhile
                pass
            return


@contextlib.contextmanager
def _existing(address: str, source: str, timeout: float, ignored: list[str]):
    """A client of the scheduler at ``address``; the local-cluster options given (``ignored``) are named in a
    warning."""
    if ignored:
        logger.warning("connecting to the scheduler at %s (from %s): ignoring the local-cluster options %s",
                       address, source, ", ".join(ignored))
    with _connect(address, timeout) as client:
        workers = len(client.scheduler_info(n_workers=-1).get("workers", {}))
        if not workers:  # a job submitted now would wait for a worker forever, with no message
            try:
                client.wait_for_workers(1, timeout=timeout)
            except TimeoutError:
                raise ConnectionError(
                    f"the Dask scheduler at {address} (from {source}) has no workers: none joined within "
                    f"{timeout:g} s. Start some (dask worker {address}), or leave out the address for a local "
                    "cluster") from None
            workers = len(client.scheduler_info(n_workers=-1).get("workers", {}))
        logger.info("connected to the Dask scheduler at %s (%d workers)", address, workers)
        yield client


def _worker_layout(n_workers, threads_per_worker) -> tuple[int, int]:
    """``(n_workers, threads_per_worker)`` of a local cluster: :func:`default_layout`, or the cores shared
    among the workers given, or as many workers as the threads given fit the cores."""
    layout = default_layout()
    n_workers = _positive_int("n_workers", n_workers)
    threads_per_worker = _positive_int("threads_per_worker", threads_per_worker)
    cores = layout[0] * layout[1]
    if n_workers is None and threads_per_worker is None:
        return layout[0], layout[1]
    if n_workers is None:
        return max(1, cores // threads_per_worker), threads_per_worker
    if threads_per_worker is None:
        return n_workers, max(1, cores // n_workers)
    return n_workers, threads_per_worker


@contextlib.contextmanager
def _local(*, n_workers, threads_per_worker, processes, memory_limit, dashboard_address, blas_threads, silence_logs,
           timeout, cluster_kwargs: dict):
    """A client of a new ``LocalCluster`` (see :func:`cluster` for the options); both closed on exit."""
    import dask
    from distributed import Client, LocalCluster

    n_workers, threads_per_worker = _worker_layout(n_workers, threads_per_worker)
    processes = default_layout()[2] if processes is None else bool(processes)
    cluster_kwargs = dict(cluster_kwargs)
    kwargs = dict(n_workers=n_workers, threads_per_worker=threads_per_worker, processes=processes,
                  memory_limit=parse_memory_limit(memory_limit), silence_logs=silence_logs)
    if dashboard_address is None:
        # the scheduler serves HTTP (health, metrics) anyway: on a free port, so no clash with 8787
        kwargs["dashboard_address"] = ":0"
        kwargs["scheduler_kwargs"] = {"dashboard": False, **cluster_kwargs.pop("scheduler_kwargs", {})}
    else:
        kwargs["dashboard_address"] = (f":{dashboard_address}" if isinstance(dashboard_address, int)
                                       else dashboard_address)
    spawn_env = {}
    if processes and blas_threads is not None:
        env = {name: str(blas_threads) for name in BLAS_ENV_VARS}
        kwargs["env"] = {**env, **cluster_kwargs.pop("env", {})}
        spawn_env = {f"distributed.nanny.pre-spawn-environ.{name}": blas_threads for name in BLAS_ENV_VARS}
    kwargs.update(cluster_kwargs)
    if dask.config.get("distributed.admin.low-level-log-length") > PROFILE_HISTORY:  # a lower one stays
        spawn_env["distributed.admin.low-level-log-length"] = PROFILE_HISTORY
    with dask.config.set(spawn_env):
        local = LocalCluster(**kwargs)
    with _closed_quietly(local), Client(local, timeout=timeout, set_as_default=True) as client:
        if silence_logs and silence_logs > logging.INFO:
            client.register_plugin(_QuietTaskErrors(), name="xmldask-quiet-task-errors")
        logger.info("started a local Dask cluster: %d worker(s) x %d thread(s) (%s), memory limit %s per worker",
                    n_workers, threads_per_worker, "worker processes" if processes else "threads of this process",
                    _describe_limit(kwargs["memory_limit"]))
        yield client


class _TaskErrorFilter(logging.Filter):
    """Drops a worker's "Compute Failed" record: the task's exception reaches the client, which raises it (the
    command line prints it as one line, or with its traceback if it is not an error it knows)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith("Compute Failed")


class _QuietTaskErrors(WorkerPlugin):
    """Worker plugin of the local clusters (unless their logs are shown at INFO): the filter above on every
    worker, present and future, so that a refused input is one line and not a traceback per worker."""

    def setup(self, worker) -> None:
        logging.getLogger("distributed.worker").addFilter(_TaskErrorFilter())

    def teardown(self, worker) -> None:
        log = logging.getLogger("distributed.worker")
        for f in [f for f in log.filters if isinstance(f, _TaskErrorFilter)]:
            log.removeFilter(f)


class _ShutdownHeartbeat(logging.Filter):
    """Drops a worker's "Failed to communicate with scheduler during heartbeat" traceback."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith("Failed to communicate with scheduler during heartbeat")


@contextlib.contextmanager
def _closed_quietly(local):
    """Close the local cluster on exit without the heartbeat traceback of its shutdown race.

    A worker whose heartbeat is in flight while the scheduler closes logs an ERROR with a traceback
    (dask/distributed#7105), at the end of a job that went well. Only while the cluster closes, and only
    that message, is dropped; a heartbeat lost during the job is still logged.
    """
    try:
        yield local
    finally:
        quiet, worker_log = _ShutdownHeartbeat(), logging.getLogger("distributed.worker")
        worker_log.addFilter(quiet)
        try:
            local.close()
        finally:
            worker_log.removeFilter(quiet)


@contextlib.contextmanager
def _logged_report(report, path: Path):
    with report(filename=str(path)):
        yield
    logger.info("wrote the Dask performance report %s", path)


# --------------------------------------------------------------------------------------------------
# command line


def _memory_limit_arg(text: str):
    try:
        return parse_memory_limit(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _positive_int_arg(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, not {text!r}")
    return value


def add_cluster_arguments(parser: argparse.ArgumentParser) -> argparse._ArgumentGroup:
    """Add the Dask cluster options shared by the commands to ``parser``.

    Adds ``--scheduler ADDRESS``, ``--workers N``, ``--threads-per-worker N``, ``--memory-limit SIZE``
    and ``--performance-report FILE``; :func:`cluster_from_args` turns the parsed values into a
    :func:`cluster`.

    Parameters
    ----------
    parser : argparse.ArgumentParser

    Returns
    -------
    argparse._ArgumentGroup
        The group holding the options.
    """
    workers, threads, _ = default_layout()
    group = parser.add_argument_group("Dask cluster")
    group.add_argument("--scheduler", metavar="ADDRESS", default=None,
                       help=f"address of a running Dask scheduler, e.g. tcp://host:8786 (default ${ENV_SCHEDULER}; "
                            "if unset, start a local cluster)")
    group.add_argument("--workers", metavar="N", type=_positive_int_arg, default=None,
                       help=f"local cluster: workers (default {workers})")
    group.add_argument("--threads-per-worker", metavar="N", type=_positive_int_arg, default=None,
                       help=f"local cluster: threads per worker (default: the cores shared among the workers; "
                            f"{threads} with one worker)")
    group.add_argument("--memory-limit", metavar="SIZE", type=_memory_limit_arg, default="auto",
                       help="local cluster: memory limit per worker, e.g. 2GB, or 'auto' (RAM / workers, the "
                            "default) or 'none'")
    group.add_argument("--processes", action=argparse.BooleanOptionalAction, default=None,
                       help="local cluster: workers as processes, or threads of this process (default: threads for "
                            f"data of at most 1/{round(1 / IN_PROCESS_MEMORY_SHARE)} of the machine's memory, "
                            "processes above)")
    group.add_argument("--performance-report", metavar="FILE", default=None,
                       help="write a Dask performance report (HTML) of the run to FILE")
    return group


def cluster_from_args(args: argparse.Namespace, **kwargs):
    """:func:`cluster` configured by the options of :func:`add_cluster_arguments`.

    Parameters
    ----------
    args : argparse.Namespace
        Parsed arguments (missing attributes take the defaults).
    **kwargs
        Further arguments of :func:`cluster` (e.g. ``dashboard_address``, ``data_bytes``), overriding ``args``.

    Returns
    -------
    contextlib.AbstractContextManager
        Use as ``with cluster_from_args(args) as client:``.
    """
    options = {
        "address": getattr(args, "scheduler", None),
        "n_workers": getattr(args, "workers", None),
        "threads_per_worker": getattr(args, "threads_per_worker", None),
        "processes": getattr(args, "processes", None),
        "memory_limit": getattr(args, "memory_limit", "auto"),
        "performance_report": getattr(args, "performance_report", None),
    }
    options.update(kwargs)
    return cluster(options.pop("address"), **options)
