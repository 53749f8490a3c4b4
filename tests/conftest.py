"""Shared test fixtures: the location of the benchmark data, an isolated Prefect home."""

from __future__ import annotations

import atexit
import collections
import os
import shutil
import sys
import tempfile
from pathlib import Path

import pytest

# Importing prefect creates $PREFECT_HOME: keep it out of the user's home during tests.
_PREFECT_HOME = tempfile.mkdtemp(prefix="xmldask-tests-prefect-")
os.environ["PREFECT_HOME"] = _PREFECT_HOME
atexit.register(shutil.rmtree, _PREFECT_HOME, ignore_errors=True)



def _share_the_cores_among_test_processes():
    """Under ``pytest -n N`` each test process's BLAS pools (and those of the processes it starts) get its share of
    the cores, at least one thread: N processes each spinning a pool of every core ran the slow tests 19 % slower
    on this 2-core machine (three files, ``-n 2``: 204 s against 166 s). An explicit limit in the environment stays.

    The share is set in the environment before NumPy loads its BLAS, which then starts with that many threads and
    may still be raised (a test asks a cluster of threads for two: ``blas_threads=2``). A limit set at run time from
    this thread instead stays in force for NumPy's OpenBLAS 0.3.31 when another thread raises it (measured: that
    test got 1 thread); it is set only where BLAS was loaded before this file."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if workers < 2:
        return None
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    share = max(1, cores // workers)
    loaded = "numpy" in sys.modules
    for name in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
        os.environ.setdefault(name, str(share))
    if not loaded:
        return None
    from threadpoolctl import threadpool_limits

    return threadpool_limits(limits=int(os.environ["OPENBLAS_NUM_THREADS"]), user_api="blas")


_BLAS_SHARE = _share_the_cores_among_test_processes()


@pytest.fixture
def blas_unshared():
    """This process's BLAS pools at every core during a test that sets them from another thread (a cluster of
    threads given ``blas_threads``): NumPy's OpenBLAS 0.3.31 keeps a limit that this thread set against another
    thread's, so the share set here is lifted here (and set again after)."""
    if _BLAS_SHARE is None:
        yield
        return
    from threadpoolctl import threadpool_limits

    with threadpool_limits(limits=os.cpu_count() or 1, user_api="blas"):
        yield


REPO = Path(__file__).resolve().parents[1]
ENV_SHARED_DATA = "XMLDASK_SHARED_DATA"

#: ``*.txt.gz`` files under the shared data that are not datasets in the XC format
NOT_XC = {"cat_hier.txt.gz"}


def shared_data_dir() -> Path:
    """``$XMLDASK_SHARED_DATA`` if set, else ``<repo>/../shared/data`` (which may not exist)."""
    env = os.environ.get(ENV_SHARED_DATA)
    return Path(env) if env else REPO.parent / "shared" / "data"


def shared_xc_files() -> list[Path]:
    """Every XC-format ``*.txt.gz`` under the shared data directory (empty if it is absent)."""
    root = shared_data_dir()
    if not root.is_dir():
        return []
    return sorted(p for p in root.rglob("*.txt.gz") if p.name not in NOT_XC)


@pytest.fixture(scope="module")
def client():
    """A LocalCluster of two single-threaded worker processes (one per test module that asks for it)."""
    distributed = pytest.importorskip("distributed")
    cluster = distributed.LocalCluster(n_workers=2, threads_per_worker=1, processes=True, dashboard_address=":0")
    client = distributed.Client(cluster, set_as_default=False)
    try:
        yield client
    finally:
        client.close()
        cluster.close()


@pytest.fixture(scope="module")
def scheduler():
    """A running in-process scheduler for the commands' --scheduler option (faster than a cluster each)."""
    distributed = pytest.importorskip("distributed")
    with distributed.LocalCluster(n_workers=1, threads_per_worker=2, processes=False, dashboard_address=":0") as c:
        yield c.scheduler_address


@pytest.fixture(scope="session")
def prefect_harness():
    """A temporary Prefect database and API for the flow tests (started once, about 7 s).

    Flow-run heartbeats are off: each flow run (every stage subflow) would otherwise wait up to a
    second for its heartbeat thread at its end.
    """
    from prefect.settings import PREFECT_FLOWS_HEARTBEAT_FREQUENCY, temporary_settings
    from prefect.testing.utilities import prefect_test_harness

    # the temporary server's start-up waits up to two minutes (as flows/__init__.py sets for the flows):
    # 30 s was seen to run out on a loaded machine
    with prefect_test_harness(server_startup_timeout=120), \
            temporary_settings(updates={PREFECT_FLOWS_HEARTBEAT_FREQUENCY: None}):
        yield


@pytest.fixture
def shared_data() -> Path:
    """Path of the real benchmark data; skips the test where that directory is absent."""
    root = shared_data_dir()
    if not root.is_dir():
        pytest.skip(f"no shared benchmark data at {root} (set ${ENV_SHARED_DATA})")
    return root


#: fixtures that read the real benchmark datasets: a test that asks for one is ``slow`` (run by ``-m slow``)
SHARED_DATA_FIXTURES = {"shared_data", "shared_xc_file"}


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    """Mark ``slow`` every test that needs the real datasets (before ``-m`` selects), and order the files for the test
    processes (``-n 2 --dist loadfile --no-loadscope-reorder`` hands them out in this order): those with a test
    marked ``first``, then the others by their number of tests collected (before ``-m`` selects), most first
    (pytest-xdist's own order, which put the README blocks' one test of 250 s last, running alone after the other
    process had finished)."""
    for item in items:
        if SHARED_DATA_FIXTURES & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.slow)
    counts = collections.Counter(item.path for item in items)
    first = {item.path for item in items if item.get_closest_marker("first")}
    items.sort(key=lambda item: (item.path not in first, -counts[item.path]))  # stable within a file


def pytest_generate_tests(metafunc):
    """Parametrize ``shared_xc_file`` over the XC files of the shared data (one skipped case if absent)."""
    if "shared_xc_file" in metafunc.fixturenames:
        root = shared_data_dir()
        files = shared_xc_files()
        ids = [str(p.relative_to(root)) for p in files]
        metafunc.parametrize("shared_xc_file", files or [None], ids=ids or ["absent"])


@pytest.fixture
def unpaused_workers():
    """In-process workers (``processes=False``) hold their memory limit against the whole test process, with what
    earlier tests left in it: a pytest worker past 80 % of a 1 GiB limit pauses the worker and the test waits
    forever (measured: 922 MB after half the suite). Their limit still sizes the tasks; it does not pause, spill or
    aim them. ``distributed`` is imported first: a key that ``dask.config.set`` did not find is deleted on exit, and
    its defaults, added by the import inside the block, would go with it (the next test then failed with
    ``KeyError: 'distributed'``)."""
    import dask
    import distributed  # noqa: F401 (its defaults in the config before they are set)

    with dask.config.set({"distributed.worker.memory.target": False, "distributed.worker.memory.spill": False,
                          "distributed.worker.memory.pause": False}):
        yield
