"""Prediction cost a row against the number of labels: saved models, each predicting the same test rows.

Each ``--pair MODEL=TEST`` (a model store and a dataset store) predicts the top ``--top-k`` labels of the first
``--rows`` rows of its test store (fewer if a test store is smaller: every pair predicts the same number of rows, so
that a call's fixed costs weigh the same on each row), ``--repeats`` times, back to back in one process under the
local Dask cluster that ``xmldask predict`` starts for that data (:func:`xmldask.cluster.cluster`); the table gives
the median seconds, rows/s, microseconds a row and each pair's cost a row over the first pair's: issue 40's
"prediction time per row at 1M labels against that at 10K". The model is loaded once (as a served model would be);
each repeat reads the rows from the store, predicts and gathers the top labels and scores in one graph
(``dask.compute(*predict_topk(X))``, what ``xmldask predict`` runs before writing them).

Usage::

    python bench/predict_cost.py --pair M10K=TEST10K --pair M1M=TEST1M --rows 5000
    python bench/predict_cost.py --pair M10K=TEST10K --pair M1M=TEST1M --json cost.json
"""

from __future__ import annotations

import argparse
import statistics
import time

import dask
from _tables import markdown_table, write_json

KEYS = ["model", "labels", "rows", "routing", "beam", "seconds", "rows/s", "us a row", "cost a row / first"]


def measure(model_url: str, test_url: str, *, rows: int, top_k: int, repeats: int) -> dict:
    from xmldask.cluster import cluster
    from xmldask.models import load_model
    from xmldask.store import open_dataset

    data = open_dataset(test_url)
    n = min(rows, data.n_samples)
    with cluster(dashboard_address=None, data_bytes=data.nbytes):
        model = load_model(model_url)
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            labels, scores = model.predict_topk(data.X[:n], k=top_k)
            dask.compute(labels, scores)  # one graph, as `xmldask predict` stores both
            times.append(time.perf_counter() - start)
    seconds = statistics.median(times)
    return {"model": model_url, "labels": int(model.n_labels_), "rows": n,
            "routing": getattr(model, "routing_", None) or "summaries", "beam": int(getattr(model, "beam_", 0)),
            "seconds": round(seconds, 2), "rows/s": round(n / seconds), "us a row": round(1e6 * seconds / n, 1)}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pair", action="append", required=True, help="MODEL=TEST: a model store and a test store")
    parser.add_argument("--rows", type=int, default=5000, help="test rows a model predicts (the first; default 5000)")
    parser.add_argument("--top-k", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=3, help="predictions a model, the median kept (default 3)")
    parser.add_argument("--json", metavar="FILE", help="write the rows as JSON")
    args = parser.parse_args(argv)
    from xmldask.store import open_dataset

    pairs = []
    for pair in args.pair:
        model_url, sep, test_url = pair.partition("=")
        if not sep:
            parser.error(f"--pair {pair!r}: expected MODEL=TEST")
        pairs.append((model_url, test_url))
    # the same rows for every pair: measured at stop 77, a 10K model's row cost 51.8 us over 5,000 rows and 33.1 us
    # over 20,000 (a call's fixed cost spread over fewer rows): a 1M model's 20,000 rows read 1.86x, not 3.09x
    n = min([args.rows] + [open_dataset(test_url).n_samples for _, test_url in pairs])
    if n < args.rows:
        print(f"predicting {n:,} rows a pair, the smallest test store's (not --rows {args.rows:,})", flush=True)
    rows = []
    for model_url, test_url in pairs:
        rows.append(measure(model_url, test_url, rows=n, top_k=args.top_k, repeats=args.repeats))
        print(f"{model_url}: {rows[-1]['rows/s']} rows/s", flush=True)
    for row in rows:
        row["cost a row / first"] = round(row["us a row"] / rows[0]["us a row"], 2)
    print(f"\n### bench/predict_cost.py (first {n:,} test rows, top {args.top_k}, median of "
          f"{args.repeats})\n")
    print(markdown_table(rows, KEYS))
    if args.json:
        write_json(args.json, rows)


if __name__ == "__main__":
    main()
