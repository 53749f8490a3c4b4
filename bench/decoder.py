"""Measure EmbeddingClassifier (Rembrandt Algorithm 3 decoder) on a real dataset: held-out and test P@1, time.

The label embedding is the exact Rembrandt embedding computed in memory for small ``n_features``: the
top-``k`` eigenvectors of ``Y^T X (X^T X + lam I)^{-1} X^T Y`` (one blocked pass for ``X^T X`` and
``X^T Y``). Hyperparameters are to be chosen on the held-out slice of the training rows
(``history_``), never on the test split; the test P@1 is printed for the final report only.

Usage::

    python bench/decoder.py --dataset aloi --kernel none
    python bench/decoder.py --dataset aloi --kernel gaussian --n-random-features 4000 --bandwidth-scale 0.4
    python bench/decoder.py --dataset bibtex --kernel laplacian
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import tempfile
import time

import dask
import numpy as np
import scipy.linalg

from xmldask.io import ingest
from xmldask.linalg import gram, xt_b
from xmldask.metrics import precision_at_k
from xmldask.models import EmbeddingClassifier
from xmldask.store import open_dataset

DATA = os.environ.get("XMLDASK_SHARED_DATA", os.path.join(os.path.dirname(__file__), "..", "..", "shared", "data"))


def rembrandt_exact(X, Y, k: int, alpha: float = 1e-3) -> np.ndarray:
    """Top-``k`` right singular vectors of ``Pi_X Y`` (exact, for small ``n_features``)."""
    G, B = dask.compute(gram(X, dtype=np.float64), xt_b(X, Y.astype(np.float32)))
    G = G.astype(np.float64)
    lam = alpha * np.trace(G) / G.shape[0]
    A = scipy.linalg.cho_solve(scipy.linalg.cho_factor(G + lam * np.eye(G.shape[0])), B.astype(np.float64))
    M = B.T.astype(np.float64) @ A
    vals, vecs = scipy.linalg.eigh(M, subset_by_index=[M.shape[0] - k, M.shape[0] - 1])
    return vecs[:, ::-1].astype(np.float32)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dataset", default="aloi")
    ap.add_argument("--k", type=int, default=50)
    ap.add_argument("--kernel", default="none")
    ap.add_argument("--n-random-features", type=int, default=2000)
    ap.add_argument("--bandwidth-scale", type=float, default=1.0)
    ap.add_argument("--decoder-alpha", type=float, default=1e-3)
    ap.add_argument("--max-epochs", type=int, default=10)
    ap.add_argument("--batch-size", type=int, default=1024)
    ap.add_argument("--learning-rate", type=float, default=0.5)
    ap.add_argument("--momentum", type=float, default=0.9)
    ap.add_argument("--block-rows", type=int, default=16384)
    ap.add_argument("--normalize", default="none")
    ap.add_argument("--no-test", action="store_true", help="report the held-out slice only")
    ap.add_argument("--json", help="append the result row to this JSON-lines file")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    logging.getLogger("distributed").setLevel(logging.WARNING)
    with tempfile.TemporaryDirectory(prefix="xmldask-bench-") as tmp:
        t0 = time.perf_counter()
        src = os.path.join(DATA, args.dataset)
        train = ingest(os.path.join(src, "train.txt.gz"), f"{tmp}/train.zarr", block_rows=args.block_rows,
                       normalize=args.normalize)
        test = ingest(os.path.join(src, "test.txt.gz"), f"{tmp}/test.zarr", block_rows=args.block_rows,
                      normalize=args.normalize, n_features=train.X.shape[1], n_labels=train.Y.shape[1])
        t_ingest = time.perf_counter() - t0
        train, test = open_dataset(f"{tmp}/train.zarr"), open_dataset(f"{tmp}/test.zarr")
        t1 = time.perf_counter()
        R = rembrandt_exact(train.X, train.Y, args.k)
        t_embed = time.perf_counter() - t1
        clf = EmbeddingClassifier(embedding=R, kernel=args.kernel, n_random_features=args.n_random_features,
                                  bandwidth_scale=args.bandwidth_scale, decoder_alpha=args.decoder_alpha,
                                  max_epochs=args.max_epochs, batch_size=args.batch_size,
                                  learning_rate=args.learning_rate, momentum=args.momentum, random_state=0)
        t2 = time.perf_counter()
        clf.fit(train.X, train.Y)
        t_fit = time.perf_counter() - t2
        best = min(clf.history_, key=lambda h: h["val_loss"])
        row = {"dataset": args.dataset, **{k: v for k, v in vars(args).items() if k not in ("dataset", "json")},
               "val_p@1": best["val_p@1"], "val_loss": best["val_loss"], "best_epoch": best["epoch"],
               "epochs": len(clf.history_) - 1, "ingest_s": round(t_ingest, 1), "embed_s": round(t_embed, 1),
               "fit_s": round(t_fit, 1), "task": clf.task_, "bandwidth": clf.bandwidth_}
        if not args.no_test:
            t3 = time.perf_counter()
            labels, _ = clf.predict_topk(test.X, k=5)
            labels = labels.persist()
            row["test_p@1"] = precision_at_k(test.Y, labels, k=1)
            row["test_p@3"] = precision_at_k(test.Y, labels, k=3)
            row["predict_s"] = round(time.perf_counter() - t3, 1)
        print(json.dumps(row))
        if args.json:
            with open(args.json, "a") as fh:
                fh.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
