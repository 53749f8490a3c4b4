"""NumPy's huge pages against small pages: the first touch of fresh arrays, and ``xmldask train`` in each mode.

NumPy ``madvise``-s transparent huge pages for every array of 4 MiB or more (``NUMPY_MADVISE_HUGEPAGE``, on by
default on Linux 4.6+); a local cluster whose workers are threads of this process turns that off inside it unless
the variable is set (:func:`xmldask.cluster.small_pages`). This prints the kernel's transparent-huge-page
settings, then, in a fresh process a mode (``NUMPY_MADVISE_HUGEPAGE=1``, ``=0``, and unset: NumPy's default
outside xmldask's in-process cluster, small pages inside it), the GB/s at which fresh arrays of ``--sizes`` MiB are
first written (``np.ones``: every page faulted in and zeroed by the kernel, then written) and, written again, reused
ones; with ``--train STORE``, the default ``xmldask train STORE`` (no option: the held-out search and the fit, under
the local cluster the command starts) in a fresh process a run, the modes alternated ``--repeats`` times: its
seconds and held-out P@1 (the same in every mode: the pages' size changes no number).

Usage::

    python bench/huge_pages.py
    python bench/huge_pages.py --train storage/bench/peers/bibtex/train.zarr --repeats 3 --json huge.json
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path

from _tables import load_line, main_or_child, markdown_table, run_child, write_json

MODES = {"huge pages (NumPy's default)": "1", "small pages": "0", "unset (xmldask's default)": None}
TOUCH_KEYS = ["mode", "MiB", "first touch GB/s", "reused GB/s", "first / reused s"]
TRAIN_KEYS = ["store", "mode", "runs", "train s (each)", "median s", "held-out P@1", "median / small pages"]


def _touch(spec: dict) -> dict:
    import numpy as np

    out = {}
    for mib in spec["sizes"]:
        n = mib * 2**20 // 8
        start = time.perf_counter()
        a = np.ones(n)  # fresh pages: faulted in and zeroed, then written
        first = time.perf_counter() - start
        start = time.perf_counter()
        a.fill(2.0)  # the same pages again
        again = time.perf_counter() - start
        del a
        out[str(mib)] = [first, again]
    return out


def _train(spec: dict) -> dict:
    from xmldask import jobs
    from xmldask.cluster import cluster
    from xmldask.store import open_dataset

    # as `xmldask train` starts it: for small data, workers that are threads of this process (small pages by
    # default there: :func:`xmldask.cluster.small_pages`)
    with tempfile.TemporaryDirectory() as tmp, cluster(dashboard_address=None,
                                                       data_bytes=open_dataset(spec["store"]).nbytes):
        start = time.perf_counter()
        info = jobs.train(spec["store"], str(Path(tmp) / "model.zarr"))
        seconds = time.perf_counter() - start
    return {"seconds": seconds, "val_p@1": info["held_out"]["val_p@1"]}


def _child(spec: dict) -> None:
    import json

    print(json.dumps(_touch(spec) if spec["what"] == "touch" else _train(spec)))


def _in_mode(value: str | None, spec: dict) -> dict:
    if value is None:
        os.environ.pop("NUMPY_MADVISE_HUGEPAGE", None)
    else:
        os.environ["NUMPY_MADVISE_HUGEPAGE"] = value
    result = run_child(__file__, spec)
    if "error" in result:
        raise SystemExit(f"{spec['what']} with NUMPY_MADVISE_HUGEPAGE={value}: {result['error']}\n"
                         f"{result.get('stderr', '')}")
    return result


def _thp_settings() -> str:
    root = Path("/sys/kernel/mm/transparent_hugepage")
    parts = []
    for name in ("enabled", "defrag"):
        try:
            parts.append(f"{name}: {(root / name).read_text().strip()}")
        except OSError:
            parts.append(f"{name}: not readable")
    return "; ".join(parts)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="8,64,256", help="MiB of the fresh arrays (default %(default)s)")
    parser.add_argument("--train", action="append", default=[], metavar="STORE",
                        help="a dataset store to train on by default in each mode (repeatable)")
    parser.add_argument("--repeats", type=int, default=3, help="runs of each mode a store (default %(default)s)")
    parser.add_argument("--json", metavar="FILE", help="write the rows as JSON")
    args = parser.parse_args(argv)
    sizes = [int(s) for s in args.sizes.split(",")]

    touch_rows = []
    for mode, value in MODES.items():
        result = _in_mode(value, {"what": "touch", "sizes": sizes})
        for mib in sizes:
            first, again = result[str(mib)]
            touch_rows.append({"table": "first touch", "mode": mode, "MiB": mib,
                               "first touch GB/s": round(mib / 1024 / first, 2),
                               "reused GB/s": round(mib / 1024 / again, 2),
                               "first / reused s": round(first / again, 1)})
    print(f"transparent huge pages: {_thp_settings()}\n")
    print(markdown_table(touch_rows, TOUCH_KEYS))

    train_rows = []
    for store in args.train:
        runs = {mode: [] for mode in MODES}
        for _ in range(args.repeats):
            for mode, value in MODES.items():
                runs[mode].append(_in_mode(value, {"what": "train", "store": store}))
                print(f"{store} {mode}: {runs[mode][-1]['seconds']:.2f} s", flush=True)
        small = statistics.median(r["seconds"] for r in runs["small pages"])
        for mode, results in runs.items():
            median = statistics.median(r["seconds"] for r in results)
            train_rows.append({"table": "train", "store": store, "mode": mode, "runs": len(results),
                               "train s (each)": ", ".join(f"{r['seconds']:.2f}" for r in results),
                               "median s": round(median, 2),
                               "held-out P@1": ", ".join(sorted({f"{r['val_p@1']:.4f}" for r in results})),
                               "median / small pages": round(median / small, 2)})
    if train_rows:
        print("\n" + markdown_table(train_rows, TRAIN_KEYS))
    print("\n" + load_line())
    write_json(args.json, touch_rows + train_rows)


if __name__ == "__main__":
    main_or_child(main, _child)
