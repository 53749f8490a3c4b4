"""Sparse-dense block products whole or in column slabs: where slabs pay (``xmldask.linalg._kernels``).

A pass's kernels multiply a CSR row block by a dense operand (``X Q``: rows of ``Q`` read at random)
and its transpose by the block's dense rows (``X^T V``: rows of the result written at random). When
those ``d x k`` rows do not fit in the cache, ``_sparse_dense`` computes the product in slabs of one
64-byte cache line a row. This times both ways on random CSR blocks of growing ``d`` (float32, the
best of ``--repeat``) in this process, one core, and says which one the kernels choose here
(``CACHE_BYTES``, a quarter of the largest cache).

    python bench/kernels.py [--rows 20000] [--repeat 5] [--json FILE]
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import scipy.sparse as sp
from _tables import load_line, markdown_table, write_json

from xmldask.linalg import _kernels as K

#: (d, k, nonzeros per row)
CASES = [(500, 400, 20), (1000, 400, 20), (2000, 64, 50), (4000, 64, 50), (8000, 64, 50), (16000, 64, 50),
         (32000, 64, 80), (50000, 64, 80), (100000, 32, 80), (100000, 64, 80)]


def best_of(repeat: int, A, B) -> float:
    """The best of ``repeat`` timings of ``_sparse_dense(A, B)``."""
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        K._sparse_dense(A, B)
        times.append(time.perf_counter() - start)
    return min(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=20_000, help="rows of a block (default 20000)")
    parser.add_argument("--repeat", type=int, default=5, help="timings per product (default 5; the best)")
    parser.add_argument("--json", default=None, metavar="FILE", help="also write the rows as JSON")
    args = parser.parse_args()

    rng = np.random.default_rng(0)
    chosen = K.CACHE_BYTES
    rows = []
    for d, k, per_row in CASES:
        A = sp.random(args.rows, d, density=per_row / d, format="csr", dtype=np.float32, random_state=rng)
        Q = rng.standard_normal((d, k)).astype(np.float32)
        V = rng.standard_normal((args.rows, k)).astype(np.float32)
        seconds = {}
        for way, cache in (("whole", 1 << 62), ("slabs", 0)):
            K.CACHE_BYTES = cache
            seconds[way] = best_of(args.repeat, A, Q), best_of(args.repeat, A.T, V)
        K.CACHE_BYTES = chosen
        row_bytes = d * k * 4
        rows.append({
            "d": d, "k": k, "rows_mib": round(row_bytes / 2**20, 1),
            "xq_whole_ms": round(seconds["whole"][0] * 1e3, 1), "xq_slabs_ms": round(seconds["slabs"][0] * 1e3, 1),
            "xq_speedup": round(seconds["whole"][0] / seconds["slabs"][0], 2),
            "xtv_whole_ms": round(seconds["whole"][1] * 1e3, 1), "xtv_slabs_ms": round(seconds["slabs"][1] * 1e3, 1),
            "xtv_speedup": round(seconds["whole"][1] / seconds["slabs"][1], 2),
            "kernels_choose": "slabs" if k > 16 and row_bytes > chosen else "whole",
        })
    print(markdown_table(rows, list(rows[0])))
    print(f"\nslabs beyond CACHE_BYTES = {chosen / 2**20:g} MiB; {load_line()}")
    write_json(args.json, rows)


if __name__ == "__main__":
    main()
