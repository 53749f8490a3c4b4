"""Top-k of score rows by argmax scans or by a partition: where the scans pay (``xmldask.models._kernels``).

Every prediction ends in :func:`~xmldask.models._kernels.topk_rows` over sub-batches of at most
``SCORE_BUDGET`` scores (rows x labels). It takes ``k`` labels a row by ``k`` row-wise argmax scans when
``k <= SELECT_K`` and the scores are finite, else by ``np.argpartition``. This times both ways on random
float32 scores of one sub-batch (the best of ``--repeat``) in this process, one core, checks that they
agree, and says which one the kernel chooses.

    python bench/topk.py [--repeat 7] [--json FILE]
"""

from __future__ import annotations

import argparse
import time

import numpy as np
from _tables import load_line, markdown_table, write_json
from threadpoolctl import threadpool_limits

from xmldask.models import _kernels as K

LABELS = (100, 1000, 10000, 100000)
KS = (1, 5, 10, 20, 32, 50, 100)


def best_of(repeat: int, fn, *args) -> float:
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn(*args)
        times.append(time.perf_counter() - start)
    return min(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeat", type=int, default=7, help="timings per case (default 7; the best)")
    parser.add_argument("--json", default=None, metavar="FILE", help="also write the rows as JSON")
    args = parser.parse_args()

    rng = np.random.default_rng(0)
    chosen = K.SELECT_K
    rows = []
    with threadpool_limits(limits=1):
        for n_labels in LABELS:
            S = rng.standard_normal((max(1, K.SCORE_BUDGET // n_labels), n_labels)).astype(np.float32)
            for k in KS:
                if k > n_labels:
                    continue
                K.SELECT_K = 0  # the partition
                partition = best_of(args.repeat, K.topk_rows, S, k)
                reference = K.topk_rows(S, k)
                K.SELECT_K = k  # the scans
                scans = best_of(args.repeat, K.topk_rows, S, k)
                same = all(np.array_equal(a, b) for a, b in zip(K.topk_rows(S, k), reference))
                K.SELECT_K = chosen
                rows.append({"n_labels": n_labels, "rows": S.shape[0], "k": k,
                             "partition_ms": round(partition * 1e3, 2), "scans_ms": round(scans * 1e3, 2),
                             "speedup": round(partition / scans, 2), "same_result": "yes" if same else "NO",
                             "kernel_chooses": "scans" if k <= chosen else "partition"})
    print(markdown_table(rows, list(rows[0])))
    print(f"\nscans up to SELECT_K = {chosen}; {load_line()}")
    write_json(args.json, rows)


if __name__ == "__main__":
    main()
