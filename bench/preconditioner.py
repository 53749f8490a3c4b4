"""SGD's preconditioner ``(F^T F / n + lam I)^{-1}`` from its Cholesky factor: how long a decoder's m takes.

A decoder with epochs inverts its ``(m + 1) x (m + 1)`` normal matrix once (``m`` = 2,000 random features by
default). ``xmldask.models._kernels.inverse_from_cholesky`` runs LAPACK's ``potri`` (one triangle of the inverse)
and copies that triangle over the other in place, a block of rows at a time. Beside it: the same ``potri`` with
the whole-matrix symmetrisation it used before (``tril(P) + tril(P).T - diag(diag(P))``), and
``cho_solve`` against the identity; the largest difference of each from ``numpy.linalg.inv`` (float64). Each way
runs in a fresh process: its first call (as a fit makes it, once: its m x m temporaries are fresh pages) and the
best of ``--repeat`` more.

    python bench/preconditioner.py [--ms 500,1000,2001,4001] [--repeat 3] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np
import scipy.linalg
from _tables import load_line, main_or_child, markdown_table, run_child, write_json

from xmldask.models._kernels import inverse_from_cholesky


def whole_matrix(chol) -> np.ndarray:
    """The symmetrisation before: three m x m temporaries, one of them a transposed sum."""
    factor, lower = chol
    inverse, info = scipy.linalg.lapack.dpotri(factor, lower=int(lower))
    triangle = np.tril(inverse) if lower else np.triu(inverse)
    return triangle + triangle.T - np.diag(np.diag(inverse))


WAYS = {"blocks": lambda chol, m: inverse_from_cholesky(chol), "whole": lambda chol, m: whole_matrix(chol),
        "cho_solve": lambda chol, m: scipy.linalg.cho_solve(chol, np.eye(m))}


def child(spec: dict) -> None:
    """One way at one m in this fresh process: its first call's seconds, the best of the next, its largest error."""
    m, way = spec["m"], WAYS[spec["way"]]
    F = np.random.default_rng(0).standard_normal((2 * m, m))
    H = F.T @ F / F.shape[0] + 1e-2 * np.eye(m)
    chol = scipy.linalg.cho_factor(H, lower=True)
    times = []
    for _ in range(1 + spec["repeat"]):
        start = time.perf_counter()
        P = way(chol, m)
        times.append(time.perf_counter() - start)
    error = float(np.abs(P - np.linalg.inv(H)).max())
    print(json.dumps({"first": times[0], "best": min(times[1:]), "error": error}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ms", default="500,1000,2001,4001", help="matrix sizes m + 1 (default 500,1000,2001,4001)")
    parser.add_argument("--repeat", type=int, default=3, help="timings after the first (default 3; the best)")
    parser.add_argument("--json", default=None, metavar="FILE", help="also write the rows as JSON")
    args = parser.parse_args()

    rows = []
    for m in (int(v) for v in args.ms.split(",")):
        row = {"m + 1": m}
        for way in WAYS:
            fig = run_child(__file__, {"m": m, "way": way, "repeat": args.repeat})
            if "error" in fig and not isinstance(fig["error"], float):
                raise SystemExit(f"{way} at m + 1 = {m}: {fig['error']}\n{fig.get('stderr', '')}")
            row.update({f"{way} first s": round(fig["first"], 4), f"{way} best s": round(fig["best"], 4),
                        f"{way} max error": float(f"{fig['error']:.2e}")})
        row["whole / blocks, first"] = round(row["whole first s"] / row["blocks first s"], 2)
        row["cho_solve / blocks, first"] = round(row["cho_solve first s"] / row["blocks first s"], 2)
        rows.append(row)
    print(markdown_table(rows, list(rows[0])))
    print(f"\n{load_line()}")
    write_json(args.json, rows)


if __name__ == "__main__":
    main_or_child(main, child)
