"""Throughput and memory of one fused ``X^T (X Q)`` pass: scipy in RAM vs xmldask on 1 and 2 cores.

Writes a synthetic dataset store once (``make_synthetic``) under ``--cache`` (default
``$XMLDASK_STORAGE/bench``, else ``storage/bench``) and reuses it while the parameters are the same;
then, for ``n`` rows and for ``n / 10`` rows (same features and density), times in fresh processes:

- ``scipy``: the whole matrix loaded in RAM as one ``csr_matrix``; only ``A.T @ (A @ Q)`` is timed;
- ``scipy-threads``: the same matrix in RAM cut into the store's row blocks, a thread per core each
  summing ``B.T @ (B @ Q)`` over every other block (no store, no Dask): what SciPy's kernels give on
  this machine's cores together, the ceiling of any blocked pass built on them;
- ``xmldask-1core``: ``xmldask.linalg.xt_x_q`` on a local cluster of one single-threaded worker,
  reading the store;
- ``xmldask-2core``: the same with the default local cluster of :mod:`xmldask.cluster` (one worker
  process with a thread per core; the machine this was written on has 2).

``Q`` is float32 ``(n_features, k)`` and shipped once; one pass is run first to warm up, then
``--repeat`` passes are timed and the median is reported. GFLOP/s count ``4 nnz k`` flops
(``2 nnz k`` for ``X Q`` and as many for ``X^T (X Q)``); ``ratio_to_scipy`` is scipy's seconds over
the system's (a speedup), ``ratio_to_scipy_threads`` the same against ``scipy-threads``. Peak RSS is
``VmHWM`` (a true peak, not a sample) of the scipy process or of each worker process (the largest
worker is reported).

    python bench/passes.py [--rows 1200000] [--features 100000] [--avg-features 130] [--k 64]
                           [--block-rows 65536] [--repeat 3] [--json FILE] [--quick]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import sys
import time
from pathlib import Path

import _tables
from _tables import load_line, main_or_child, write_json

SYSTEMS = ("scipy", "scipy-threads", "xmldask-1core", "xmldask-2core")


def _peak_rss_mb() -> float:
    """Peak RSS of this process in MiB: ``VmHWM`` (``ru_maxrss`` would include the RSS of the process
    that spawned it, which Linux keeps across ``exec``)."""
    try:
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) for line in f if line.startswith("VmHWM:")) / 1024
    except (OSError, StopIteration):
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _worker_peak() -> tuple[int, float]:
    return os.getpid(), _peak_rss_mb()


def _operand(n_features: int, k: int):
    import numpy as np

    return np.random.default_rng(0).standard_normal((n_features, k)).astype(np.float32)


def _threaded_product(A, Q, row_blocks, threads: int):
    """``A^T (A Q)`` over ``A``'s row blocks, a running sum per thread (SciPy releases the GIL in its kernels)."""
    from concurrent.futures import ThreadPoolExecutor

    import numpy as np

    bounds = np.cumsum((0,) + tuple(row_blocks))
    blocks = [A[a:b] for a, b in zip(bounds[:-1], bounds[1:])]

    def chain(j):
        total = None
        for B in blocks[j::threads]:
            part = B.T @ (B @ Q)
            total = part if total is None else total.__iadd__(part)
        return total

    def product():
        with ThreadPoolExecutor(threads) as pool:
            return sum(total for total in pool.map(chain, range(threads)) if total is not None)

    return product


def child(spec: dict) -> None:
    """Time one system on one store in this (fresh) process; print its figures as JSON."""
    import dask

    from xmldask import open_dataset

    ds = open_dataset(spec["url"])
    X = ds.X
    Q = _operand(X.shape[1], spec["k"])
    times = []
    if spec["system"].startswith("scipy"):
        from xmldask.store.csr import to_scipy

        with dask.config.set(scheduler="threads"):
            A = to_scipy(X)
        workers, threads = 1, 1
        product = lambda: A.T @ (A @ Q)  # noqa: E731
        if spec["system"] == "scipy-threads":
            threads = len(os.sched_getaffinity(0))
            product = _threaded_product(A, Q, X.chunks[0], threads)
        product()  # warm up
        for _ in range(spec["repeat"]):
            start = time.perf_counter()
            product()
            times.append(time.perf_counter() - start)
        peaks = [_peak_rss_mb()]
    else:
        from xmldask.cluster import cluster
        from xmldask.linalg import dense_operand, xt_x_q

        layout = {"n_workers": 1, "threads_per_worker": 1} if spec["system"] == "xmldask-1core" else {}
        with cluster(dashboard_address=None, **layout) as client:
            info = client.scheduler_info(n_workers=-1)["workers"]
            workers = len(info)
            threads = max(w["nthreads"] for w in info.values())
            Qd = dense_operand(Q, name="Q")  # shipped once, kept for every pass
            xt_x_q(X, Qd).compute()  # warm up
            for _ in range(spec["repeat"]):
                start = time.perf_counter()
                xt_x_q(X, Qd).compute()
                times.append(time.perf_counter() - start)
            peaks = [peak for _, peak in client.run(_worker_peak).values()]
    print(json.dumps({"times": times, "nnz": int(ds.meta["nnz"]), "n_samples": ds.n_samples,
                      "n_features": ds.n_features, "workers": workers, "threads_per_worker": threads,
                      "peak_rss_mb_per_worker": max(peaks), "n_blocks": X.numblocks[0]}))


def cache_dir(path: str | None) -> Path:
    if path:
        return Path(path)
    root = os.environ.get("XMLDASK_STORAGE")
    return Path(root) / "bench" if root else Path(__file__).resolve().parents[1] / "storage" / "bench"


def ensure_store(root: Path, *, n_samples: int, n_features: int, avg_features: float, block_rows: int,
                 seed: int) -> str:
    """The store for these parameters under ``root``, written if absent (or written with other parameters)."""
    from xmldask import open_dataset
    from xmldask.datasets import make_synthetic

    params = {"n_samples": n_samples, "n_features": n_features, "n_labels": 1000, "avg_features": avg_features,
              "seed": seed}
    url = str(root / f"passes-n{n_samples}-d{n_features}-f{avg_features:g}-b{block_rows}-s{seed}.zarr")
    if Path(url).exists():
        try:
            ds = open_dataset(url)
            synthetic = ds.meta.get("synthetic", {})
            if all(synthetic.get(k) == v for k, v in params.items()) and ds.meta["row_blocks"][1] == min(
                    block_rows, n_samples):
                return url
        except Exception as exc:  # noqa: BLE001 - an unreadable leftover: write it again
            print(f"rewriting {url}: {exc}", file=sys.stderr)
    root.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    make_synthetic(url, **params, block_rows=block_rows, overwrite=True, progress=sys.stderr.isatty())
    print(f"wrote {url} in {time.perf_counter() - start:.1f} s", file=sys.stderr)
    return url


def run_child(spec: dict) -> dict:
    result = _tables.run_child(__file__, spec)
    if "error" in result:
        raise RuntimeError(f"{spec['system']} failed: {result['error']}\n{result.get('stderr', '')}")
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=1_200_000,
                        help="rows n of the large store (default 1200000: about 1e8 nonzeros)")
    parser.add_argument("--factor", type=int, default=10, help="the small store has n / factor rows (default 10)")
    parser.add_argument("--features", type=int, default=100_000, help="columns d (default 100000)")
    parser.add_argument("--avg-features", type=float, default=130.0,
                        help="feature tokens per row of the generator (default 130: about 100 nonzeros per row)")
    parser.add_argument("--k", type=int, default=64, help="columns of Q (default 64)")
    parser.add_argument("--block-rows", type=int, default=65_536,
                        help="rows per row block (default 65536, the stores' default)")
    parser.add_argument("--repeat", type=int, default=3, help="timed passes per system (default 3; median)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--systems", nargs="+", choices=SYSTEMS, default=list(SYSTEMS))
    parser.add_argument("--cache", default=None, metavar="DIR",
                        help="where the stores live (default $XMLDASK_STORAGE/bench, else storage/bench)")
    parser.add_argument("--json", default=None, metavar="FILE", help="also write the rows as JSON")
    parser.add_argument("--quick", action="store_true", help="smoke-test sizes (20000 rows, 20000 features, 1 pass)")
    args = parser.parse_args()
    if args.quick:
        args.rows, args.features, args.avg_features, args.block_rows, args.repeat = 20_000, 20_000, 30.0, 2_048, 1

    root = cache_dir(args.cache)
    rows = []
    for n in (args.rows, max(1, args.rows // args.factor)):
        url = ensure_store(root, n_samples=n, n_features=args.features, avg_features=args.avg_features,
                           block_rows=args.block_rows, seed=args.seed)
        scipy_seconds = threads_seconds = None
        for system in args.systems:
            fig = run_child({"system": system, "url": url, "k": args.k, "repeat": args.repeat})
            seconds = statistics.median(fig["times"])
            if system == "scipy":
                scipy_seconds = seconds
            if system == "scipy-threads":
                threads_seconds = seconds
            flops = 4 * fig["nnz"] * args.k
            rows.append({
                "system": system, "n_samples": fig["n_samples"], "n_features": fig["n_features"], "nnz": fig["nnz"],
                "k": args.k, "n_blocks": fig["n_blocks"], "workers": fig["workers"],
                "threads_per_worker": fig["threads_per_worker"], "seconds": round(seconds, 3),
                "seconds_min": round(min(fig["times"]), 3), "gflops": round(flops / seconds / 1e9, 2),
                "ratio_to_scipy": round(scipy_seconds / seconds, 2) if scipy_seconds else None,
                "ratio_to_scipy_threads": round(threads_seconds / seconds, 2) if threads_seconds else None,
                "peak_rss_mb_per_worker": round(fig["peak_rss_mb_per_worker"], 1),
            })
            print(f"{system} n={n}: {seconds:.3f} s", file=sys.stderr, flush=True)

    keys = list(rows[0])
    print("| " + " | ".join(keys) + " |")
    print("|" + "---|" * len(keys))
    for row in rows:
        print("| " + " | ".join(f"{row[k]:,}" if isinstance(row[k], int) else str(row[k]) for k in keys) + " |")
    print("\n" + load_line())
    write_json(args.json, rows)


if __name__ == "__main__":
    main_or_child(main, child)
