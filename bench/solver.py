"""Blocked CG ridge solves with many right-hand sides: xmldask against the same method in memory, and the dual.

``xmldask.linalg.ridge_lstsq(X, B, alpha, center=True, solver="cg")`` on row blocks of a sparse X, for
k = 100, 400 and ``n_labels`` right-hand sides (the label-embedding regression of the decoder at
growing k; ``B = Y G`` for a seeded Gaussian ``G``), next to a plain SciPy implementation of the same
Jacobi-preconditioned CG on the whole matrix in RAM (centring applied implicitly, the same
``lam = alpha * trace / d``, 30 iterations). Both run on one thread pool of this process (the Dask
threaded scheduler for xmldask). Reports seconds, iterations, the largest relative residual of each,
and the ratio of the times. Beside them, ``solver="dual"`` (the exact solve through the rows' Gram matrix
``X X^T``, which ``solver="auto"`` takes for these few rows of many features): its seconds, its residual of
the same normal equations (computed in memory, float64) and CG's seconds over its.

Data: the lshtc1 dry-run training file of ``$XMLDASK_SHARED_DATA`` (tf-idf rows, 26,969 features,
1,139 labels) when present, else a synthetic dataset of the same shape.

Usage::

    python bench/solver.py [--ks 100,400,1139] [--block-rows 2000] [--json FILE]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

import dask
import dask.array as da
import numpy as np
import scipy.sparse as sp
from _tables import load_line, write_json

from xmldask.linalg import ridge_lstsq

ROOT = Path(__file__).resolve().parents[1]
DATA = Path(os.environ.get("XMLDASK_SHARED_DATA", ROOT.parent / "shared" / "data"))


def load() -> tuple[sp.csr_matrix, sp.csr_matrix, str]:
    from xmldask.datasets import make_synthetic
    from xmldask.io import ingest
    from xmldask.models import _kernels as K
    from xmldask.store.csr import to_scipy

    path = DATA / "lshtc1-dryrun-task2" / "train.txt.gz"
    with tempfile.TemporaryDirectory() as tmp:
        if path.exists():
            ds = ingest([str(path)], str(Path(tmp) / "train.zarr"))
            name = "lshtc1-dryrun-task2 train, tf-idf"
        else:
            ds = make_synthetic(str(Path(tmp) / "s.zarr"), n_samples=4463, n_features=26969, n_labels=1139, seed=0)
            name = "synthetic 4463 x 26969, 1139 labels, tf-idf"
        X, Y = to_scipy(ds.X).tocsr().astype(np.float32), to_scipy(ds.Y).tocsr()
    idf = K.idf_weights(np.bincount(X.indices, minlength=X.shape[1]), X.shape[0])
    return K.transform_rows(X, idf), Y, name


def _normal_equations(X: sp.csr_matrix, B: np.ndarray, alpha: float):
    """The centred ridge normal equations in memory: ``apply(P) = (X_c^T X_c + lam I) P``, the right-hand side
    ``X_c^T B_c``, the diagonal of ``X_c^T X_c`` and ``lam = alpha * trace / d``."""
    n, d = X.shape
    mu = np.asarray(X.mean(axis=0)).ravel()
    diag = np.asarray(X.multiply(X).sum(axis=0)).ravel() - n * mu**2
    lam = alpha * diag.sum() / d
    Bc = B - B.mean(axis=0)

    def apply(P):
        V = X @ P - (mu @ P)[None, :]
        return X.T @ V - np.outer(mu, V.sum(axis=0)) + lam * P

    return apply, X.T @ Bc - np.outer(mu, Bc.sum(axis=0)), diag, lam


def normal_residual(X: sp.csr_matrix, B: np.ndarray, alpha: float, Z: np.ndarray) -> float:
    """The largest relative residual ``||rhs - A z|| / ||rhs||`` of a solution's columns, in float64."""
    apply, rhs, _, _ = _normal_equations(X, B, alpha)
    return float((np.linalg.norm(rhs - apply(np.asarray(Z, np.float64)), axis=0) / np.linalg.norm(rhs, axis=0)).max())


def reference_cg(X: sp.csr_matrix, B: np.ndarray, alpha: float, iters: int = 30) -> tuple[np.ndarray, float]:
    """Jacobi-preconditioned CG on the centred normal equations, all columns at once, in memory."""
    apply, rhs, diag, lam = _normal_equations(X, B, alpha)
    inv = 1.0 / (diag + lam)
    Z = np.zeros_like(rhs)
    R = rhs.copy()
    S = inv[:, None] * R
    P = S.copy()
    rz = np.einsum("ij,ij->j", R, S)
    for _ in range(iters):
        AP = apply(P)
        step = rz / np.einsum("ij,ij->j", P, AP)
        Z += step * P
        R -= step * AP
        S = inv[:, None] * R
        rz_new = np.einsum("ij,ij->j", R, S)
        P = S + (rz_new / rz) * P
        rz = rz_new
    res = np.linalg.norm(rhs - apply(Z), axis=0) / np.linalg.norm(rhs, axis=0)
    return Z, float(res.max())


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ks", default="100,400,1139", help="right-hand sides (default 100,400,1139)")
    parser.add_argument("--block-rows", type=int, default=2000)
    parser.add_argument("--alpha", type=float, default=1.0)
    parser.add_argument("--json", default=None, metavar="FILE")
    args = parser.parse_args(argv)
    X, Y, name = load()
    Xd = da.from_array(X, chunks=(args.block_rows, -1), asarray=False, fancy=False)
    rows = []
    for k in (int(v) for v in args.ks.split(",")):
        G = np.random.default_rng(0).standard_normal((Y.shape[1], k)).astype(np.float32)
        B = np.asarray(Y @ G, dtype=np.float64)
        start = time.perf_counter()
        _, ref_res = reference_cg(X.astype(np.float64), B, args.alpha)
        ref_s = time.perf_counter() - start
        with dask.config.set(scheduler="threads"):
            start = time.perf_counter()
            res = ridge_lstsq(Xd, B.astype(np.float32), args.alpha, center=True, solver="cg", tol=0.0, max_iter=30)
            ours_s = time.perf_counter() - start
            start = time.perf_counter()
            dual = ridge_lstsq(Xd, B.astype(np.float32), args.alpha, center=True, solver="dual")
            dual_s = time.perf_counter() - start
        rows.append({"k": k, "n_samples": X.shape[0], "n_features": X.shape[1], "nnz": int(X.nnz),
                     "system": "xmldask ridge_lstsq cg", "seconds": round(ours_s, 2), "iterations": res.n_iter,
                     "max_relative_residual": float(res.relative_residual.max()),
                     "reference_seconds": round(ref_s, 2), "reference_max_relative_residual": ref_res,
                     "ratio_to_reference": round(ref_s / ours_s, 2), "dual_seconds": round(dual_s, 2),
                     "dual_passes": dual.n_passes,
                     "dual_max_relative_residual": normal_residual(X.astype(np.float64), B, args.alpha, dual.coef),
                     "cg_seconds_over_dual": round(ours_s / dual_s, 2)})
        print(f"k={k} done", file=sys.stderr, flush=True)
    keys = ["k", "seconds", "iterations", "max_relative_residual", "reference_seconds",
            "reference_max_relative_residual", "ratio_to_reference", "dual_seconds", "dual_passes",
            "dual_max_relative_residual", "cg_seconds_over_dual"]
    print(f"\n### CG ridge solves, {name}: {X.shape[0]:,} rows, {X.shape[1]:,} features, {X.nnz:,} nnz, "
          f"{args.block_rows}-row blocks\n")
    print("| " + " | ".join(keys) + " |")
    print("|" + "---|" * len(keys))
    for row in rows:
        print("| " + " | ".join(f"{row[k]:.2e}" if "residual" in k else str(row[k]) for k in keys) + " |")
    print("\n- ratio_to_reference = reference seconds / xmldask seconds (above 1: xmldask is faster); "
          "the reference is float64 in RAM, xmldask float32 passes with float64 iterates")
    print("- dual: ridge_lstsq(..., solver='dual'), the exact solve through X X^T (what solver='auto' takes here); "
          "its residual is of the same normal equations (float64, in memory, the float32 solution); "
          "cg_seconds_over_dual = CG's seconds / the dual's")
    print("\n" + load_line())
    write_json(args.json, rows)


if __name__ == "__main__":
    main()
