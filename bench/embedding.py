"""Label embeddings out of core: time, passes and memory (ALOI, a synthetic set larger than the workers'
memory), and the embedding-quality table of the Rembrandt paper (Table 4) on the LSHTC1 dry-run hierarchy.

Sections (``--only``, comma-separated; default all):

- ``aloi``: Rembrandt k = 50 on ALOI train (97,200 x 128, 1,000 classes; the paper: 4 s in Matlab on
  a dual Xeon E5-1650), plus CS, PLST and PCA for comparison. Wall time of ``fit``, passes over the
  data, peak RSS of each worker process.
- ``synthetic``: Rembrandt on a synthetic store whose in-memory CSR size exceeds the workers' total
  memory limit (``--synthetic-rows``).
- ``hierarchy``: Table 4: the fraction of labels whose nearest neighbour in the embedding is a
  sibling, on lshtc1-dryrun-task2 (train + val, rows L2-normalized, k = 100), for Rembrandt and CS
  (several ridges: this dataset is multiclass with about 5 rows per label and more features than
  rows, so an unregularised Pi_X Y is Y itself), PLST and the most-fraternal constant; Euclidean and
  cosine nearest neighbours.

The cluster is a ``distributed.LocalCluster`` (``--workers`` processes x 1 thread, ``--memory-limit``
each). Datasets are ingested into a temporary directory (``--workdir``), never into the repository.

    python bench/embedding.py [--only aloi,synthetic,hierarchy] [--workers 2] [--memory-limit 1GiB]
                              [--synthetic-rows 8000000] [--json FILE] [--workdir DIR]
"""

from __future__ import annotations

import argparse
import os
import resource
import tempfile
import time
from pathlib import Path

from _tables import markdown_table, write_json

SHARED = Path(os.environ.get("XMLDASK_SHARED_DATA", Path(__file__).resolve().parents[2] / "shared" / "data"))


def _peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _rss_mb() -> float:
    import psutil

    return psutil.Process().memory_info().rss / 2**20


def _csr_mb(ds) -> float:
    """In-memory size of X and Y as CSR (float32 data, int32 indices, int64 indptr)."""
    nnz = ds.meta["nnz"] + ds.meta.get("nnz_labels", 0)
    return (nnz * 8 + 2 * (ds.n_samples + 1) * 8) / 2**20


def _timed_fit(client, model, X, Y, *, label: str, dataset: str, ds) -> dict:
    """Fit ``model`` on the cluster; wall time, passes and the peak RSS of the workers during the fit."""
    client.run(_reset_peak)
    start = time.perf_counter()
    model.fit(X, Y)
    seconds = time.perf_counter() - start
    worker_peaks = client.run(_worker_peak_mb)
    return {"dataset": dataset, "method": label, "n_samples": ds.n_samples, "n_features": ds.n_features,
            "n_labels": ds.n_labels, "k": model.n_components, "seconds": round(seconds, 2),
            "passes": int(model.n_passes_), "csr_mb": round(_csr_mb(ds), 1),
            "peak_rss_mb_per_worker": round(max(worker_peaks.values()), 1),
            "client_peak_rss_mb": round(_peak_rss_mb(), 1)}


def _reset_peak() -> None:
    """Reset the kernel's peak-RSS counter of this process (Linux: write 5 to clear_refs)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass


def _worker_peak_mb() -> float:
    """Peak RSS since the last reset (VmHWM), else the process's lifetime peak."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return _peak_rss_mb()


# ------------------------------------------------------------------------------------------------


def bench_aloi(client, workdir: Path) -> list[dict]:
    from xmldask.embedding import PLST, CompressedSensing, PCAEmbedding, Rembrandt
    from xmldask.io import ingest

    url = str(workdir / "aloi.zarr")
    ds = ingest(str(SHARED / "aloi" / "train.txt.gz"), url, block_rows=16384, progress=False)
    X, Y = ds.X, ds.Y
    rows = []
    for label, model in [
        ("Rembrandt (q=1, p=20)", Rembrandt(n_components=50, random_state=0)),
        ("CS (q=p=0)", CompressedSensing(n_components=50, random_state=0)),
        ("PLST", PLST(n_components=50, random_state=0)),
        ("PCA (features)", PCAEmbedding(n_components=50, random_state=0)),
    ]:
        rows.append(_timed_fit(client, model, X, Y, label=label, dataset="ALOI", ds=ds))
    return rows


def bench_synthetic(client, workdir: Path, n_rows: int, memory_limit: str, n_workers: int) -> list[dict]:
    from dask.utils import parse_bytes

    from xmldask.datasets import make_synthetic
    from xmldask.embedding import Rembrandt

    url = str(workdir / "synthetic.zarr")
    start = time.perf_counter()
    ds = make_synthetic(url, n_samples=n_rows, n_features=1000, n_labels=10_000, seed=0, progress=False)
    gen_seconds = time.perf_counter() - start
    total_limit = parse_bytes(memory_limit) * n_workers / 2**20
    row = _timed_fit(client, Rembrandt(n_components=50, random_state=0), ds.X, ds.Y,
                     label="Rembrandt (q=1, p=20)", dataset="synthetic", ds=ds)
    row["workers_total_memory_limit_mb"] = round(total_limit, 1)
    row["generate_seconds"] = round(gen_seconds, 1)
    return [row]


def bench_hierarchy(client, workdir: Path, alphas=(1e-3, 1e-1, 1.0, 10.0)) -> list[dict]:
    from xmldask.embedding import (
        PLST,
        CompressedSensing,
        Rembrandt,
        most_fraternal_fraction,
        read_hierarchy,
        sibling_fraction,
    )
    from xmldask.io import ingest

    root = SHARED / "lshtc1-dryrun-task2"
    url = str(workdir / "lshtc1.zarr")
    ds = ingest([str(root / "train.txt.gz"), str(root / "val.txt.gz")], url, normalize="l2", block_rows=2048,
                progress=False)
    hier = read_hierarchy(root / "cat_hier.txt.gz", label_map=root / "label_map.tsv.gz", n_labels=ds.n_labels)
    k = 100
    rows = [{"method": "Most fraternal", "alpha": "", "passes": 0, "seconds": 0.0,
             "sibling_fraction_euclidean": most_fraternal_fraction(hier),
             "sibling_fraction_cosine": most_fraternal_fraction(hier)}]
    models = [("PLST", None, PLST(n_components=k, random_state=0))]
    models += [(f"CS (q=p=0) alpha={a:g}", a, CompressedSensing(n_components=k, alpha=a, random_state=0))
               for a in alphas]
    models += [(f"Rembrandt alpha={a:g}", a, Rembrandt(n_components=k, alpha=a, random_state=0)) for a in alphas]
    for label, alpha, model in models:
        start = time.perf_counter()
        model.fit(ds.X, ds.Y)
        seconds = time.perf_counter() - start
        V = model.embedding_
        rows.append({"method": label, "alpha": "" if alpha is None else alpha, "passes": int(model.n_passes_),
                     "seconds": round(seconds, 2),
                     "sibling_fraction_euclidean": sibling_fraction(V, hier, metric="euclidean"),
                     "sibling_fraction_cosine": sibling_fraction(V, hier, metric="cosine")})
    for r in rows:
        r.update({"dataset": "lshtc1-dryrun-task2 train+val", "n_samples": ds.n_samples, "n_labels": ds.n_labels,
                  "k": k})
        for key in ("sibling_fraction_euclidean", "sibling_fraction_cosine"):
            r[key] = round(100 * r[key], 2)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", default="aloi,synthetic,hierarchy")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--memory-limit", default="1GiB", help="per worker (default 1GiB)")
    parser.add_argument("--synthetic-rows", type=int, default=8_000_000)
    parser.add_argument("--workdir", default=None, help="where to write the stores (default: a temporary dir)")
    parser.add_argument("--json", default=None, metavar="FILE", help="also write the rows as JSON")
    args = parser.parse_args()
    sections = [s.strip() for s in args.only.split(",") if s.strip()]

    from distributed import Client, LocalCluster

    all_rows: list[dict] = []
    with tempfile.TemporaryDirectory(dir=args.workdir) as tmp, \
            LocalCluster(n_workers=args.workers, threads_per_worker=1, memory_limit=args.memory_limit,
                         dashboard_address=None) as cluster, Client(cluster) as client:
        tmp = Path(tmp)
        perf_keys = ["dataset", "method", "n_samples", "n_features", "n_labels", "k", "seconds", "passes",
                     "csr_mb", "peak_rss_mb_per_worker", "client_peak_rss_mb"]
        if "aloi" in sections:
            rows = bench_aloi(client, tmp)
            print(f"## ALOI ({args.workers} workers x 1 thread, memory limit {args.memory_limit} each)\n")
            print(markdown_table(rows, perf_keys) + "\n")
            all_rows += rows
        if "synthetic" in sections:
            rows = bench_synthetic(client, tmp, args.synthetic_rows, args.memory_limit, args.workers)
            print(f"## Synthetic, larger than the workers' memory ({args.workers} x {args.memory_limit})\n")
            print(markdown_table(rows, perf_keys + ["workers_total_memory_limit_mb", "generate_seconds"]) + "\n")
            all_rows += rows
        if "hierarchy" in sections:
            rows = bench_hierarchy(client, tmp)
            print("## Table 4: sibling fraction (%) on the lshtc1-dryrun-task2 hierarchy, k = 100\n")
            print(markdown_table(rows, ["method", "alpha", "passes", "seconds", "sibling_fraction_euclidean",
                                "sibling_fraction_cosine"]) + "\n")
            all_rows += rows
    write_json(args.json, all_rows)


if __name__ == "__main__":
    main()
