"""Ingest throughput and peak memory for two file sizes 10x apart.

Generates synthetic XC text files (gzip), ingests each in a fresh subprocess, and prints one row
per size: text MB/s, rows/s and the subprocess's peak RSS. Peak RSS should not grow with the file.

    python bench/ingest.py [--rows 300000] [--factor 10] [--json FILE] [--workdir DIR]
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _tables import write_json


def child(source: str, out: str) -> None:
    """Run one ingest and print its figures as JSON (peak RSS of this process only)."""
    import psutil

    import xmldask.io
    from xmldask.store import integrity, open_dataset

    timer = integrity.timed()  # the integrity work: the inventory recorded at commit, checked at every open
    base_rss = psutil.Process().memory_info().rss
    start = time.perf_counter()
    ds = xmldask.io.ingest(source, out, overwrite=True)
    seconds = time.perf_counter() - start
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    record = timer.pop("record_inventory", 0.0)
    opened = []
    for _ in range(5):
        timer.clear()
        begin = time.perf_counter()
        open_dataset(out)
        opened.append((time.perf_counter() - begin, timer.get("check_inventory", 0.0)))
    open_s, check_s = sorted(opened)[len(opened) // 2]
    print(json.dumps({"seconds": seconds, "n_samples": ds.n_samples, "nnz": ds.meta["nnz"],
                      "peak_rss_mb": peak / 2**20, "rss_after_import_mb": base_rss / 2**20,
                      "inventory_ms": 1e3 * record, "open_ms": 1e3 * open_s, "check_ms": 1e3 * check_s}))


def text_bytes(path: Path) -> int:
    with gzip.open(path, "rb") as f:
        return sum(len(chunk) for chunk in iter(lambda: f.read(1 << 22), b""))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=300_000, help="rows of the small file (default 300000)")
    parser.add_argument("--factor", type=int, default=10, help="the large file has factor x rows (default 10)")
    parser.add_argument("--n-features", type=int, default=100_000)
    parser.add_argument("--n-labels", type=int, default=10_000)
    parser.add_argument("--workdir", default=None, help="where to write the files (default: a temporary dir)")
    parser.add_argument("--json", default=None, metavar="FILE", help="also write the rows as JSON")
    args = parser.parse_args()

    from xmldask.datasets import write_synthetic_text

    with tempfile.TemporaryDirectory(dir=args.workdir) as tmp:
        rows = []
        for n in (args.rows, args.rows * args.factor):
            source = Path(tmp) / f"synth-{n}.txt.gz"
            write_synthetic_text(str(source), n_samples=n, n_features=args.n_features, n_labels=args.n_labels, seed=0)
            result = subprocess.run([sys.executable, __file__, "--child", str(source), str(Path(tmp) / f"s{n}")],
                                    check=True, capture_output=True, text=True,
                                    env={**os.environ, "PYTHONWARNINGS": "ignore"})
            fig = json.loads(result.stdout.strip().splitlines()[-1])
            mb = text_bytes(source) / 1e6
            rows.append({"n_samples": fig["n_samples"], "nnz": fig["nnz"], "text_mb": round(mb, 1),
                         "gzip_mb": round(source.stat().st_size / 1e6, 1), "seconds": round(fig["seconds"], 2),
                         "mb_per_s": round(mb / fig["seconds"], 1),
                         "rows_per_s": round(fig["n_samples"] / fig["seconds"]),
                         "peak_rss_mb": round(fig["peak_rss_mb"], 1),
                         "rss_after_import_mb": round(fig["rss_after_import_mb"], 1),
                         "inventory_ms": round(fig["inventory_ms"], 1), "open_ms": round(fig["open_ms"], 1),
                         "check_ms": round(fig["check_ms"], 1),
                         "check_share_of_open": round(fig["check_ms"] / fig["open_ms"], 3)})
    small, large = rows[0]["peak_rss_mb"], rows[-1]["peak_rss_mb"]
    for row in rows:
        row["peak_rss_ratio_to_small"] = round(row["peak_rss_mb"] / small, 2)
    keys = list(rows[0])
    print("| " + " | ".join(keys) + " |")
    print("|" + "---|" * len(keys))
    for row in rows:
        print("| " + " | ".join(f"{row[k]:,}" if isinstance(row[k], int) else str(row[k]) for k in keys) + " |")
    print(f"\ntext {rows[-1]['text_mb'] / rows[0]['text_mb']:.1f}x larger, peak RSS {large / small:.2f}x")
    write_json(args.json, rows)


if __name__ == "__main__":
    if len(sys.argv) == 4 and sys.argv[1] == "--child":
        child(sys.argv[2], sys.argv[3])
    else:
        main()
