"""Worker memory of the label-centroid tree's routers, trained as its fit trains them, with and without handing the
freed heap back between the cluster routers and the streamed group routers.

The model store gives the clustering (its ``order`` and ``offsets``, and its ``idf``); the training store the rows.
Under a local cluster of ``--workers`` worker processes of ``--memory-limit`` each (one thread each), the script
makes the labels' entry bounds in one pass, trains the cluster routers (the fit's ``_train_svms`` on the groups of
:func:`~xmldask.models.centroid.router_groups`), reads each worker's RSS idle, and, in the row ``trimmed``, hands
the workers' freed heap back (:func:`xmldask.scheduling.release_memory`, what the fit now does there) before it
streams ``--passes`` passes of the group routers (``_stream_routers``); the row ``kept`` streams them on the heap as
the cluster routers left it. Each row: the workers' RSS sampled every half second (MiB: the largest of the
workers), before, during and after each phase, and the streamed routers' peak over the limit. A worker that its
nanny restarts shows as a row with ``restarted`` workers.

Usage::

    python bench/router_memory.py TRAIN MODEL --passes 3
    python bench/router_memory.py TRAIN MODEL --passes 3 --modes trimmed --json router_memory.json
"""

from __future__ import annotations

import argparse
import json
import threading
import time

from _tables import markdown_table, run_child, write_json

KEYS = ["mode", "workers", "memory limit MiB", "before MiB", "cluster routers s", "cluster routers peak MiB",
        "idle after MiB", "streamed start MiB", "streamed s", "streamed peak MiB", "streamed peak / limit", "restarted"]


def _child(spec: dict) -> None:
    import dask
    import numpy as np

    from xmldask.cluster import cluster
    from xmldask.models import centroid as C
    from xmldask.models import load_model
    from xmldask.scheduling import release_memory, worker_memory_limit
    from xmldask.store import open_dataset

    data, model = open_dataset(spec["train"]), load_model(spec["model"])
    X, Y = data.X, data.Y
    with cluster(n_workers=spec["workers"], threads_per_worker=1, memory_limit=spec["memory_limit"],
                 dashboard_address=None) as client:
        peak, stop, seen = [0], [], set()
        limit = worker_memory_limit()

        def largest() -> int:
            workers = client.scheduler_info()["workers"]
            seen.update(workers)
            return max((w["metrics"]["memory"] for w in workers.values()), default=0) // 2**20

        def watch():
            while not stop:
                peak[0] = max(peak[0], largest())
                time.sleep(0.5)
        threading.Thread(target=watch, daemon=True).start()
        idf = None if getattr(model, "idf_", None) is None else np.asarray(model.idf_)
        entries = np.add.reduce(dask.compute(*[dask.delayed(C._label_entries_block)(x, y) for x, y in
                                               zip(X.to_delayed().ravel(), Y.to_delayed().ravel())]))
        group_offsets, cluster_of, group_of, by_cluster = C.router_labels(np.asarray(model.order_),
                                                                          np.asarray(model.offsets_), Y.shape[1],
                                                                          entries)
        n_groups = len(group_offsets) - 1
        release_memory()
        time.sleep(2)
        row = {"mode": spec["mode"], "workers": spec["workers"], "memory limit MiB": limit // 2**20,
               "before MiB": largest()}
        peak[0], start = 0, time.perf_counter()
        C._train_svms(X, Y, idf, cluster_of, group_offsets, by_cluster, share=0.05, seed=0,
                      max_passes=C.ROUTER_PASSES)
        row.update({"cluster routers s": round(time.perf_counter() - start, 1), "cluster routers peak MiB": peak[0]})
        time.sleep(3)
        row["idle after MiB"] = largest()
        if spec["mode"] == "trimmed":
            release_memory()
            time.sleep(3)
        row["streamed start MiB"] = largest()
        peak[0], start = 0, time.perf_counter()
        C._stream_routers(X, Y, idf, group_of, n_groups, share=0.05, seed=0, max_passes=spec["passes"])
        stop.append(True)
        row.update({"streamed s": round(time.perf_counter() - start, 1), "streamed peak MiB": peak[0],
                    "streamed peak / limit": round(peak[0] / (limit / 2**20), 2),
                    "restarted": len(seen) - spec["workers"]})
    print(json.dumps(row))


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("train", help="the training dataset store")
    parser.add_argument("model", help="a label-centroid tree model store fitted on it (its clustering is used)")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--memory-limit", default="1GiB", help="each worker's (default 1GiB)")
    parser.add_argument("--passes", type=int, default=3, help="passes of the streamed group routers (default 3)")
    parser.add_argument("--modes", default="kept,trimmed", help="kept, trimmed or both (default both, each in a "
                        "fresh process)")
    parser.add_argument("--json", metavar="FILE", help="write the rows as JSON")
    args = parser.parse_args(argv)
    rows = []
    for mode in args.modes.split(","):
        spec = {"mode": mode, "train": args.train, "model": args.model, "workers": args.workers,
                "memory_limit": args.memory_limit, "passes": args.passes}
        rows.append(run_child(__file__, spec))
    print(markdown_table(rows, KEYS))
    write_json(args.json, rows)


if __name__ == "__main__":
    from _tables import main_or_child

    main_or_child(main, _child)
