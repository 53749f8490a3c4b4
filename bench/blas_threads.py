"""BLAS threads where the Dask workers are threads of this process: one pool for the workers and the fitting code.

A local cluster for small data runs its workers as threads of this process (``xmldask.cluster``), so a limit on
the workers' BLAS pools is the whole process's: it used to be one thread, and the fitting code's dense algebra in
this process (the screen's solves, a fit's Cholesky factors and SGD steps) ran on one core. Now
``blas_threads="auto"`` leaves an in-process cluster's pools alone (one thread stays the rule for worker
processes), and ``xmldask.scheduling.thread_map`` gives fits that run at once their share of the cores.

Two tables. **Kernels**: a 2,000 x 2,000 product (five of them), five Cholesky factors of a 2,000 x 2,000 matrix,
and 20,000 small products (128 x 128 by 128 x 50: the size that was measured 50x slower on a pool of spinning
threads, docs/measurements.md), with a pool of one thread and of every core, alone and with ``--callers`` threads
calling at once (each does the same work). **Fits**: ``xmldask.jobs.train`` of ``--train`` (default: a synthetic
text-like store generated here) in an in-process cluster with ``blas_threads=1`` against ``"auto"``: one fit of
``--params`` (no search) and the default search, each the best of ``--repeat`` in a fresh process.

    python bench/blas_threads.py [--train URL] [--params JSON] [--repeat 2] [--callers 2,4] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile
import time

from _tables import load_line, main_or_child, markdown_table, run_child, write_json

#: the setting of one fit: lshtc1-dryrun-task2's default choice (a Gaussian kernel with decoder epochs)
ONE_FIT = {"features": "tfidf", "n_components": 1000, "alpha": 90.0, "kernel": "gaussian", "search": None,
           "n_estimators": 1}


def _work(name: str):
    import numpy as np
    import scipy.linalg

    rng = np.random.default_rng(0)
    if name == "product 2000":
        a = rng.random((2000, 2000))
        return lambda: [a @ a for _ in range(5)]
    if name == "cholesky 2000":
        a = rng.random((2000, 2000))
        m = a @ a.T + 2000 * np.eye(2000)
        return lambda: [scipy.linalg.cho_factor(m) for _ in range(5)]
    b, c = rng.random((128, 128)), rng.random((128, 50))
    return lambda: [b @ c for _ in range(20000)]


def kernel_child(spec: dict) -> None:
    """One kernel with a pool of ``threads``: seconds alone and with ``callers`` threads at once."""
    from concurrent.futures import ThreadPoolExecutor

    from threadpoolctl import threadpool_limits

    run = _work(spec["kernel"])
    run()  # warm: pages and the pool's threads
    out = {}
    with threadpool_limits(limits=spec["threads"], user_api="blas"):
        start = time.perf_counter()
        run()
        out["alone"] = time.perf_counter() - start
        for callers in spec["callers"]:
            with ThreadPoolExecutor(callers) as pool:
                start = time.perf_counter()
                list(pool.map(lambda _: run(), range(callers)))
                out[str(callers)] = time.perf_counter() - start
    print(json.dumps(out))


def fit_child(spec: dict) -> None:
    """``jobs.train`` of ``spec["params"]`` in an in-process cluster with ``blas_threads``: the best of the repeats."""
    from xmldask import jobs
    from xmldask.cluster import cluster
    from xmldask.store import open_dataset

    best = float("inf")
    with tempfile.TemporaryDirectory(prefix="bench-blas-") as tmp, \
            cluster(dashboard_address=None, processes=False, blas_threads=spec["blas_threads"],
                    data_bytes=open_dataset(spec["train"]).nbytes):
        for i in range(spec["repeat"]):
            out = os.path.join(tmp, f"model{i}.zarr")
            start = time.perf_counter()
            info = jobs.train(spec["train"], out, **spec["params"])
            best = min(best, time.perf_counter() - start)
            shutil.rmtree(out)
    print(json.dumps({"seconds": best, "params": info["params"]}))


def child(spec: dict) -> None:
    (kernel_child if "kernel" in spec else fit_child)(spec)


def _checked(fig: dict, what: str) -> dict:
    if "error" in fig:
        raise SystemExit(f"{what}: {fig['error']}\n{fig.get('stderr', '')}")
    return fig


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--train", default=None, help="a training dataset store (default: a synthetic one)")
    parser.add_argument("--params", default=None, help="the one fit's parameters as JSON (default: ONE_FIT, k "
                        "lowered to the labels)")
    parser.add_argument("--repeat", type=int, default=2, help="fits per measurement, the best kept (default 2)")
    parser.add_argument("--callers", default="2,4", help="threads calling at once (default 2,4)")
    parser.add_argument("--json", default=None, metavar="FILE", help="also write the rows as JSON")
    args = parser.parse_args()
    callers = [int(v) for v in args.callers.split(",")]
    cores = len(os.sched_getaffinity(0))

    rows = []
    for kernel in ("product 2000", "cholesky 2000", "small 128x128x50"):
        figs = {threads: _checked(run_child(__file__, {"kernel": kernel, "threads": threads, "callers": callers}),
                                  kernel) for threads in (1, cores)}
        for threads, fig in figs.items():
            rows.append({"table": "kernels", "work": kernel, "BLAS threads": threads,
                         "alone s": round(fig["alone"], 3),
                         **{f"{c} callers s": round(fig[str(c)], 3) for c in callers},
                         "alone / one thread": round(fig["alone"] / figs[1]["alone"], 2)})
    keys = ["work", "BLAS threads", "alone s", *[f"{c} callers s" for c in callers], "alone / one thread"]
    print(markdown_table(rows, keys))

    with tempfile.TemporaryDirectory(prefix="bench-blas-data-") as tmp:
        train = args.train
        if train is None:
            from xmldask.datasets import make_synthetic

            train = os.path.join(tmp, "train.zarr")
            make_synthetic(train, n_samples=4000, n_features=20000, n_labels=1000, avg_features=15.0, seed=0)
        from xmldask.store import open_dataset

        n_labels = open_dataset(train).n_labels
        one = json.loads(args.params) if args.params else {**ONE_FIT, "n_components": min(1000, n_labels)}
        fits = []
        for what, params in (("one fit", one), ("default search", {})):
            row = {"table": "fits", "train": train if args.train else "synthetic 4,000 x 20,000, 1,000 labels",
                   "fit": what}
            for blas in (1, "auto"):
                fig = _checked(run_child(__file__, {"train": train, "params": params, "blas_threads": blas,
                                                    "repeat": args.repeat}), f"{what}, blas_threads={blas}")
                row[f"blas_threads={blas} s"] = round(fig["seconds"], 2)
            row["auto / 1"] = round(row["blas_threads=auto s"] / row["blas_threads=1 s"], 2)
            fits.append(row)
    keys = ["train", "fit", "blas_threads=1 s", "blas_threads=auto s", "auto / 1"]
    print()
    print(markdown_table(fits, keys))
    print(f"\n{load_line()}")
    write_json(args.json, rows + fits)


if __name__ == "__main__":
    main_or_child(main, child)
