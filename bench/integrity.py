"""Cost of the store integrity check (chunk inventory recorded at commit, checked at open) in a predict.

Generates a synthetic training and test set, trains a small model, then runs ``jobs.predict`` (which
opens the model and the test set, checked, and writes a prediction store, recorded) several times,
and prints one row: predict seconds, the seconds spent recording and checking inventories, and their
share of the predict; plus the opens alone (``load_model``, ``open_dataset``) with the check's share; and a
read pass over every row block of the training store (as each pass of a fit reads them) with the seconds of
the content checks of each block (row pointers and column ids against the recorded shape) and their share.
The ingest side is measured by ``bench/ingest.py`` (columns ``inventory_ms``, ``check_ms``).

    python bench/integrity.py [--rows 200000] [--repeats 3] [--json FILE]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

from _tables import write_json


def _median_time(function, repeats: int, timer: dict) -> tuple[float, float]:
    """Median wall seconds of ``function()`` and the median seconds of integrity work inside it."""
    runs = []
    for _ in range(repeats):
        timer.clear()
        start = time.perf_counter()
        function()
        runs.append((time.perf_counter() - start, sum(timer.values())))
    return statistics.median(r[0] for r in runs), statistics.median(r[1] for r in runs)


def _read_pass(url: str, repeats: int) -> tuple[float, float]:
    """Median seconds of reading every row block of ``X`` and ``Y`` of the dataset store ``url`` (as a pass of
    a fit reads them), and of the content checks inside (:func:`xmldask.store.csr.check_csr_block`, timed)."""
    from xmldask.store import csr, open_dataset

    check, spent = csr.check_csr_block, []

    def timed_check(*args):
        start = time.perf_counter()
        try:
            return check(*args)
        finally:
            spent.append(time.perf_counter() - start)

    def one_pass():
        data = open_dataset(url)
        for array in (data.X, data.Y):
            reader, stop = csr.block_reader(array), 0
            for rows in array.chunks[0]:
                reader.read_rows(stop, stop + rows)
                stop += rows

    csr.check_csr_block = timed_check
    try:
        runs = []
        for _ in range(repeats):
            spent.clear()
            start = time.perf_counter()
            one_pass()
            runs.append((time.perf_counter() - start, sum(spent)))
    finally:
        csr.check_csr_block = check
    return statistics.median(r[0] for r in runs), statistics.median(r[1] for r in runs)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=200_000, help="training rows (default 200000; test: 1/4)")
    parser.add_argument("--n-features", type=int, default=50_000)
    parser.add_argument("--n-labels", type=int, default=5_000)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", default=None, metavar="FILE", help="also write the rows as JSON")
    args = parser.parse_args()

    from xmldask import jobs
    from xmldask.datasets import make_synthetic
    from xmldask.models import load_model
    from xmldask.store import integrity, open_dataset

    with tempfile.TemporaryDirectory() as tmp:
        train, test, model = (str(Path(tmp) / name) for name in ("train.zarr", "test.zarr", "model.zarr"))
        common = {"n_features": args.n_features, "n_labels": args.n_labels, "seed": 0}
        make_synthetic(train, n_samples=args.rows, **common)
        make_synthetic(test, n_samples=args.rows // 4, split="test", **common)
        jobs.train(train, model, k=32, n_random_features=500, max_epochs=2)
        timer = integrity.timed()
        n = iter(range(10**6))
        predict_s, predict_check_s = _median_time(
            lambda: jobs.predict(model, test, str(Path(tmp) / f"pred{next(n)}.zarr"), top_k=5), args.repeats, timer)
        load_s, load_check_s = _median_time(lambda: load_model(model), args.repeats, timer)
        open_s, open_check_s = _median_time(lambda: open_dataset(test), args.repeats, timer)
        files = sum(len(integrity.record_inventory(url)) for url in (model, test))
        pass_s, content_s = _read_pass(train, args.repeats)
    rows = [{
        "test_rows": args.rows // 4,
        "files_checked": files,
        "predict_s": round(predict_s, 3),
        "integrity_in_predict_ms": round(1e3 * predict_check_s, 2),
        "predict_ratio_checked_to_unchecked": round(predict_s / (predict_s - predict_check_s), 4),
        "load_model_ms": round(1e3 * load_s, 2),
        "load_model_check_ms": round(1e3 * load_check_s, 2),
        "load_ratio_checked_to_unchecked": round(load_s / (load_s - load_check_s), 3),
        "open_dataset_ms": round(1e3 * open_s, 2),
        "open_dataset_check_ms": round(1e3 * open_check_s, 2),
        "open_ratio_checked_to_unchecked": round(open_s / (open_s - open_check_s), 3),
        "read_pass_s": round(pass_s, 3),
        "content_checks_ms": round(1e3 * content_s, 2),
        "read_pass_ratio_checked_to_unchecked": round(pass_s / (pass_s - content_s), 4),
    }]
    keys = list(rows[0])
    print("| " + " | ".join(keys) + " |")
    print("|" + "---|" * len(keys))
    for row in rows:
        print("| " + " | ".join(f"{row[k]:,}" if isinstance(row[k], int) else str(row[k]) for k in keys) + " |")
    write_json(args.json, rows)


if __name__ == "__main__":
    main()
