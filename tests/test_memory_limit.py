"""A pass over a store several times larger than the workers' total memory limit completes, and is right.

Two worker processes of :func:`xmldask.cluster.cluster` with a 240 MB limit each (a worker uses about
160 MB after its imports; measured peaks during this pass: 200-223 MB) run ``xt_x_q`` over a store
whose CSR matrix ``X`` alone is more than 3x their 480 MB total (416 row blocks: 7 synthetic blocks, repeated in
turn, checked against the 7 blocks' products times their repeats). Dask's memory manager is set to
restart (kill) a worker at 95% of its limit and not to pause or spill first: a worker that ever
held much more than one row block would be killed, the pass would fail with ``KilledWorker`` or the
worker processes would change; both are checked, as is each worker's peak RSS (``VmHWM``): below the
limit. (The nanny samples RSS, so a peak between 95% and 100% of the limit between two samples does
not kill the worker; one such peak, 223 of 229 MiB, was seen in CI.)
"""

from __future__ import annotations

import os
import resource
import sys

import dask
import numpy as np
import pytest

from xmldask import open_dataset
from xmldask.cluster import cluster
from xmldask.datasets import make_synthetic
from xmldask.linalg import xt_x_q
from xmldask.store import DatasetWriter

N_WORKERS = 2
MEMORY_LIMIT = 240_000_000  # bytes per worker
N_FEATURES, K = 50_000, 8
BLOCK_ROWS = 4_096  # about 0.45 M nonzeros, 3.6 MB per row block
N_BLOCKS = 416  # 1,703,936 rows of about 110 nonzeros: X is about 1.5 GB as an in-memory CSR matrix
#: row blocks generated; the store repeats them in turn (a pass that read one block in place of another, or one
#: twice, gives another sum), written at the speed of the store instead of the generator's
DISTINCT_BLOCKS = 7
#: the memory manager: no spilling or pausing (a worker uses 2/3 of its limit at rest), restart at 95%
MEMORY_CONFIG = {"distributed.worker.memory.target": False, "distributed.worker.memory.spill": False,
                 "distributed.worker.memory.pause": False, "distributed.worker.memory.terminate": 0.95}


@pytest.fixture(scope="module")
def big_store(tmp_path_factory):
    """The store of ``N_BLOCKS`` row blocks, block ``b`` the generated block ``b % DISTINCT_BLOCKS``, and the
    generated blocks (``X``, in memory)."""
    root = tmp_path_factory.mktemp("memory-limit")
    seed = make_synthetic(str(root / "seed.zarr"), n_samples=DISTINCT_BLOCKS * BLOCK_ROWS, n_features=N_FEATURES,
                          n_labels=64, multiclass=True, rank=4, avg_features=110, background=1.0,
                          feature_exponent=0.5, block_rows=BLOCK_ROWS, seed=3)
    blocks = [dask.compute(seed.X.blocks[i], seed.Y.blocks[i], scheduler="sync") for i in range(DISTINCT_BLOCKS)]
    url = str(root / "big.zarr")
    with DatasetWriter.create(url, n_features=N_FEATURES, n_labels=64, block_rows=BLOCK_ROWS) as writer:
        for b in range(N_BLOCKS):
            writer.write(*blocks[b % DISTINCT_BLOCKS])
        writer.commit()
    return url, [X for X, _ in blocks]


def _pid_and_peak_rss():
    """This process's id and peak RSS in bytes: ``VmHWM`` (``ru_maxrss`` would include the RSS of the
    process that spawned it, which Linux keeps across ``exec``)."""
    import os

    try:
        with open("/proc/self/status") as f:
            kib = next(int(line.split()[1]) for line in f if line.startswith("VmHWM:"))
    except (OSError, StopIteration):
        kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return os.getpid(), kib * 1024


@pytest.mark.slow
def test_pass_over_store_three_times_total_worker_memory(big_store):
    url, blocks = big_store
    ds = open_dataset(url)
    X = ds.X
    assert X.numblocks[0] == N_BLOCKS
    nnz, n_samples = ds.meta["nnz"], ds.n_samples
    csr_bytes = nnz * (X.dtype.itemsize + 4) + (n_samples + 1) * 8  # data + int32 indices + int64 indptr
    assert csr_bytes >= 3 * N_WORKERS * MEMORY_LIMIT, (csr_bytes, nnz)
    Q = np.random.default_rng(0).uniform(0.0, 1.0, (N_FEATURES, K)).astype(np.float32)

    with dask.config.set(MEMORY_CONFIG), \
            cluster(n_workers=N_WORKERS, threads_per_worker=1, processes=True, memory_limit=MEMORY_LIMIT,
                    dashboard_address=None) as client:
        before = client.run(_pid_and_peak_rss)
        result = xt_x_q(X, Q).compute()
        after = client.run(_pid_and_peak_rss)
        limits = {w["memory_limit"] for w in client.scheduler_info(n_workers=-1)["workers"].values()}
    assert limits == {MEMORY_LIMIT}
    assert {a: pid for a, (pid, _) in after.items()} == {a: pid for a, (pid, _) in before.items()}, "a worker restarted"
    peaks = [peak for _, peak in after.values()]
    assert max(peaks) < MEMORY_LIMIT, [p / 2**20 for p in peaks]

    # reference: each generated block's product in this process, float64, times the blocks of the store it is
    Q64 = Q.astype(np.float64)
    reference = np.zeros((N_FEATURES, K))
    for j, block in enumerate(blocks):
        block = block.astype(np.float64)
        reference += len(range(j, N_BLOCKS, DISTINCT_BLOCKS)) * (block.T @ (block @ Q64))
    max_row_nnz = max(int(np.diff(block.indptr).max(initial=0)) for block in blocks)
    assert result.dtype == np.float32 and result.shape == (N_FEATURES, K)
    # X >= 0 and Q >= 0, so the reference is also the product of the absolute values, which bounds the
    # rounding error (Higham, Accuracy and Stability of Numerical Algorithms, eq. 3.5): an entry is a
    # length-(row nnz) dot product inside a length-(block rows) sum inside a tree sum of at most
    # n_blocks terms, in float32; the observed error is far below this worst case.
    terms = max_row_nnz + BLOCK_ROWS + X.numblocks[0]
    bound = 2 * terms * np.finfo(np.float32).eps * reference
    error = np.abs(result.astype(np.float64) - reference)
    assert np.all(error <= bound + 1e-30), float((error / np.maximum(bound, 1e-30)).max())
    assert np.linalg.norm(error) <= 1e-5 * np.linalg.norm(reference)


def _fragment_heap() -> float:
    """Free 190 MB of 96 KB arrays (below glibc's mmap threshold) under one kept at the heap's top; RSS in MiB."""
    import numpy as np

    global _PINNED
    freed = [np.ones(12_000) for _ in range(2_000)]
    _PINNED = np.ones(12_000)  # the heap's top stays in use: the freed pages below it stay in the RSS
    del freed
    return _rss_mib()


def _rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc_trim")
def test_release_worker_memory_returns_freed_heap_to_the_os(client):
    """What a job freed stays in a worker's RSS (and counts against its limit) until it is trimmed."""
    from xmldask.scheduling import release_worker_memory

    idle = client.run(_rss_mib)
    before = client.run(_fragment_heap)
    assert all(before[w] > idle[w] + 100 for w in idle), (idle, before)  # freed, still resident
    with client.as_current():
        release_worker_memory()
    after = client.run(_rss_mib)
    assert all(after[w] < idle[w] + 40 for w in idle), (idle, before, after)
    release_worker_memory()  # no client: nothing to do


def test_thread_map_keeps_the_order_and_raises_the_first_error():
    import time as _time

    from xmldask.scheduling import concurrent_fits, thread_map

    def slow_square(x):
        _time.sleep(0.05 * (3 - x))  # the first item finishes last
        return x * x

    assert thread_map(slow_square, [0, 1, 2], n_jobs=3) == [0, 1, 4]
    assert thread_map(slow_square, [0, 1, 2]) == [0, 1, 4]

    def fails_on_one(x):
        if x == 1:
            raise KeyError(x)
        return x

    with pytest.raises(KeyError):
        thread_map(fails_on_one, [0, 1, 2], n_jobs=2)
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match="n_jobs"):
            thread_map(abs, [1, 2], n_jobs=bad)
    assert 1 <= concurrent_fits() <= len(os.sched_getaffinity(0))


@pytest.mark.parametrize("n_jobs", [None, 2])
def test_thread_map_at_once_runs_every_call_and_lets_a_waiting_one_step_aside(n_jobs):
    """``at_once``: each call in a thread of its own, at most ``n_jobs`` (None: one) running; calls that wait for
    each other (here all three, at a barrier) finish when each steps aside while it waits."""
    import threading
    import time

    from xmldask.scheduling import step_aside, thread_map

    arrived, cond, running, most = [], threading.Condition(), [0], [0]

    lock = threading.Lock()

    def holding(change):  # +1 once a call holds a slot, -1 before it frees it
        with lock:
            running[0] += change
            most[0] = max(most[0], running[0])

    def meet(x):
        holding(+1)
        with cond:
            arrived.append(x)
            cond.notify_all()
        holding(-1)
        with step_aside(), cond:
            assert cond.wait_for(lambda: len(arrived) == 3, timeout=10)
        holding(+1)
        time.sleep(0.02)
        holding(-1)
        return threading.current_thread().name, x * x

    out = thread_map(meet, [0, 1, 2], n_jobs, at_once=True)
    assert [x for _, x in out] == [0, 1, 4] and len({name for name, _ in out}) == 3
    assert most[0] <= (n_jobs or 1)
    with step_aside():  # outside such a call: nothing
        pass


def test_thread_map_gives_each_fit_its_share_of_the_blas_threads():
    """While thread_map's threads run, this process's BLAS pools have the cores divided among them (at least one
    thread each); the limits found before come back after, also when a call raises."""
    import threading
    import time as _time

    from threadpoolctl import threadpool_info, threadpool_limits

    from xmldask.scheduling import thread_map

    def blas(_=None):
        return {pool["num_threads"] for pool in threadpool_info() if pool["user_api"] == "blas"}

    cores = len(os.sched_getaffinity(0))
    barrier = threading.Barrier(2)

    def settled(want):  # the limits as they are once the calling thread has set them (a few ms)
        deadline = _time.monotonic() + 5
        while blas() != want and _time.monotonic() < deadline:
            _time.sleep(0.01)
        return blas()

    def together(_):
        barrier.wait(5)
        pools = settled({max(1, cores // 2)})
        barrier.wait(5)  # neither call ends before both looked
        return pools


    with threadpool_limits(limits=cores, user_api="blas"):
        assert thread_map(together, [0, 1], n_jobs=2) == [{max(1, cores // 2)}] * 2
        assert blas() == {cores} and thread_map(blas, [0, 1]) == [{cores}] * 2  # restored; one at a time: all
        with pytest.raises(KeyError):
            thread_map(lambda x: {}[x], [0, 1], n_jobs=2)
        assert blas() == {cores}


def test_computed_once_shares_a_value_while_it_is_held():
    """Callers of one key at once wait for the first one's computation; later callers take the value while its first
    array is referenced; then, or after a failure, it is computed again. ``None``: never shared."""
    import gc
    import threading

    import numpy as np

    from xmldask.scheduling import computed_once, thread_map

    calls, started, go = [], threading.Event(), threading.Event()

    def slow():
        calls.append(1)
        started.set()
        go.wait(5)  # the second caller asks meanwhile
        return np.arange(3.0), "meta"

    def ask(i):
        if i:
            started.wait(5)
            threading.Timer(0.2, go.set).start()
        return computed_once("k", slow)

    (first, shared0), (second, shared1) = thread_map(ask, [0, 1], n_jobs=2)
    assert len(calls) == 1 and sorted([shared0, shared1]) == [False, True]
    assert first[0] is second[0] and first[1] == second[1] == "meta"
    assert computed_once("k", slow) == ((first[0], "meta"), True) and len(calls) == 1  # held: taken
    go.set()
    del first, second
    gc.collect()
    value, shared = computed_once("k", slow)  # no longer held anywhere: computed again
    assert not shared and len(calls) == 2

    def fails():
        raise KeyError("boom")

    with pytest.raises(KeyError):
        computed_once("other", fails)
    assert computed_once("other", lambda: (np.zeros(1),))[1] is False  # computed after the failure
    assert computed_once(None, slow)[1] is False and computed_once(None, slow)[1] is False and len(calls) == 4
