"""Routing by a low-rank part of the cluster summaries' dense head, then the exact summaries on a shortlist: measured.

A label-centroid model routed by its summaries scores every cluster for every row; the features most summaries
share (the head of a Zipf vocabulary, ``MH``: head features x clusters, dense) are most of that work (at 1M labels
46-49 of a row's 88 entries, each against 8,192 clusters). This script tries, on a saved model and a test store, to
replace that part by a rank-``r`` projection ``Q Q^T MH`` (``Q`` from a seeded subspace iteration: a row's head
scores are then ``(x_h Q) (Q^T MH)``, a dense product of ``r x n_clusters`` a row), add the exact tail, keep the
``shortlist`` best clusters, score those exactly and keep the model's ``beam`` best. Each row of the table: the
share of the exact beam's clusters found, the test P@1 through the model's own candidate scoring (its classifiers,
weight and centroid threshold), and the multiply-adds of a row's head scoring, against the exact kernel's. Nothing
here changes a model: it is the measurement for the routing the next change would build.

Usage::

    python bench/summary_rank.py MODEL TEST --rows 5000
    python bench/summary_rank.py MODEL TEST --ranks 8,16,32 --shortlists 2,4,8 --json rank.json
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import scipy.sparse as sp
from _tables import load_line, markdown_table, write_json

KEYS = ["rank", "shortlist", "head mass kept", "beam recall", "test P@1", "P@1 - exact", "head adds a row",
        "head adds / exact"]


def head_basis(MH: np.ndarray, rank: int, *, seed: int = 0, n_iter: int = 2) -> np.ndarray:
    """An orthonormal ``Q`` (head features x ``rank``) spanning about the top left singular directions of ``MH``
    (subspace iteration from a seeded Gaussian start)."""
    rng = np.random.default_rng(seed)
    Q, _ = np.linalg.qr(MH @ rng.standard_normal((MH.shape[1], rank)).astype(MH.dtype))
    for _ in range(n_iter):
        Q, _ = np.linalg.qr(MH @ (MH.T @ Q))
    return Q


def shortlisted(approx: np.ndarray, exact: np.ndarray, shortlist: int, beam: int) -> np.ndarray:
    """Each row's ``beam`` clusters of highest ``exact`` score among its ``shortlist`` of highest ``approx``."""
    short = np.argpartition(-approx, shortlist - 1, axis=1)[:, :shortlist] if shortlist < approx.shape[1] else \
        np.broadcast_to(np.arange(approx.shape[1]), approx.shape)
    pick = np.argsort(-np.take_along_axis(exact, short, axis=1), axis=1, kind="stable")[:, :beam]
    return np.take_along_axis(short, pick, axis=1).astype(np.int64)


def measure(model_url: str, test_url: str, *, rows: int, ranks: list[int], shortlists: list[int]) -> tuple[dict, list]:
    import dask

    import xmldask
    from xmldask.models import load_model
    from xmldask.models._candidates import candidate_topk, summary_topk
    from xmldask.models.centroid import _rows_block, _split_summaries, _unwrap

    with dask.config.set(scheduler="synchronous"):
        model = load_model(model_url)
        if getattr(model, "M_", None) is None:
            raise SystemExit(f"{model_url}: not a label-centroid model with cluster summaries")
        data = xmldask.open_dataset(test_url)
        n = min(rows, data.n_samples)
        X, Y = sp.csr_matrix(data.X[:n].compute()), sp.csr_matrix(data.Y[:n].compute())
    Xb = _rows_block(X, model.idf_)
    MT, MH, head = _split_summaries(sp.csr_matrix(_unwrap(model.M_)))
    beam, n_clusters = int(model.beam_), MH.shape[1]
    W, V = _unwrap(model.W_), _unwrap(getattr(model, "V_", None))

    def p_at_1(best: np.ndarray) -> float:
        hit_rows, slots = np.nonzero(best >= 0)
        labels, _ = candidate_topk(Xb, hit_rows, best[hit_rows, slots], W, model.order_, model.offsets_, 1, V=V,
                                   bias=getattr(model, "svm_bias_", None), weight=float(model.svm_weight_ or 0.0),
                                   threshold=float(model.centroid_threshold_ or 0.0))
        top, ok = labels[:, 0], labels[:, 0] >= 0
        return float((np.asarray(Y[np.flatnonzero(ok), top[ok]]).ravel() > 0).sum() / n)

    summary_topk(Xb[:64], MT, beam, MH, head)  # compiled before it is timed
    start = time.perf_counter()
    ids, _ = summary_topk(Xb, MT, beam, MH, head)
    exact_us = 1e6 * (time.perf_counter() - start) / n
    Xh = sp.csr_matrix(Xb[:, head])
    tail = np.asarray((Xb @ MT).todense(), np.float32)
    exact = np.asarray(Xh @ MH, np.float32) + tail
    head_entries = float(np.diff(Xh.indptr).mean())
    mass = float(np.sum(MH.astype(np.float64) ** 2))
    exact_p1 = p_at_1(ids)
    context = {"model": model_url, "rows": n, "clusters": n_clusters, "head features": len(head), "beam": beam,
               "head entries a row": round(head_entries, 1), "exact routing us a row": round(exact_us, 1),
               "exact P@1": round(exact_p1, 4)}
    table = []
    for rank in ranks:
        if rank >= len(head):
            continue
        Q = head_basis(MH, rank)
        B = Q.T @ MH
        kept = float(np.sum(B.astype(np.float64) ** 2)) / mass
        approx = np.asarray(Xh @ Q, np.float32) @ B + tail
        for times in shortlists:
            size = min(n_clusters, times * beam)
            best = shortlisted(approx, exact, size, beam)
            recall = float(np.mean([len(set(a) & set(b)) for a, b in zip(best.tolist(), ids.tolist())]) / beam)
            p1 = p_at_1(best)
            adds = rank * (head_entries + n_clusters) + size * head_entries
            table.append({"rank": rank, "shortlist": size, "head mass kept": round(kept, 3),
                          "beam recall": round(recall, 4), "test P@1": round(p1, 4),
                          "P@1 - exact": round(p1 - exact_p1, 4), "head adds a row": round(adds),
                          "head adds / exact": round(adds / (head_entries * n_clusters), 3)})
            print(f"rank {rank}, shortlist {size}: recall {recall:.4f}, P@1 {p1:.4f}", flush=True)
    return context, table


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model", help="a saved label-centroid model routed by its summaries")
    parser.add_argument("test", help="a test dataset store")
    parser.add_argument("--rows", type=int, default=5000, help="test rows (the first; default 5000)")
    parser.add_argument("--ranks", default="8,16,32,64", help="ranks of the head's projection (default 8,16,32,64)")
    parser.add_argument("--shortlists", default="2,4,8",
                        help="shortlists, in multiples of the model's beam (default 2,4,8)")
    parser.add_argument("--json", metavar="FILE", help="write the rows as JSON (each with the model's figures)")
    args = parser.parse_args(argv)
    ranks = [int(v) for v in args.ranks.split(",")]
    shortlists = [int(v) for v in args.shortlists.split(",")]
    context, table = measure(args.model, args.test, rows=args.rows, ranks=ranks, shortlists=shortlists)
    print(f"\n### bench/summary_rank.py ({context['rows']:,} test rows; {context['clusters']:,} clusters, "
          f"{context['head features']:,} head features, {context['head entries a row']} head entries a row, beam "
          f"{context['beam']}; exact routing {context['exact routing us a row']} us a row on one thread, test P@1 "
          f"{context['exact P@1']})\n")
    print(markdown_table(table, KEYS))
    print(f"\n{load_line()}")
    if args.json:
        write_json(args.json, [{**context, **row} for row in table])


if __name__ == "__main__":
    main()
