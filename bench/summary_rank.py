"""Routing by a low-rank part of the cluster summaries' dense head, then the exact summaries on a shortlist: measured.

A label-centroid model routed by its summaries scores every cluster for every row; the features most summaries
share (the head of a Zipf vocabulary, ``MH``: head features x clusters, dense) are most of that work (at 1M labels
46-49 of a row's 88 entries, each against 8,192 clusters). This script tries, on a saved model and a test store, to
replace that part by a rank-``r`` projection ``Q Q^T MH`` (``Q`` from a seeded subspace iteration: a row's head
scores are then ``(x_h Q) (Q^T MH)``, a dense product of ``r x n_clusters`` a row), add the exact tail, keep the
``shortlist`` best clusters, score those exactly and keep the model's ``beam`` best. Each row of the table: the
share of the exact beam's clusters found, the test P@1 through the model's own candidate scoring (its classifiers,
weight and centroid threshold), the multiply-adds of a row's head scoring against the exact kernel's, and the time
of a row's routing on one thread against the exact kernel's (:func:`xmldask.models._candidates.summary_topk`),
measured in alternation, the best of ``--repeats``. The approximate routing runs in a Numba kernel of this script
(:func:`_shortlist_kernel`: the low-rank head a tile of clusters at a time for a batch of rows, the exact tail, the
shortlist kept as it comes, then the shortlisted pairs' exact head cluster by cluster). Nothing here changes a
model: it measures a routing that the library does not build.

Usage::

    python bench/summary_rank.py MODEL TEST --rows 5000
    python bench/summary_rank.py MODEL TEST --ranks 8,16,32 --shortlists 2,4,8 --json rank.json
"""

from __future__ import annotations

import argparse
import functools
import time

import numpy as np
import scipy.sparse as sp
from _tables import load_line, markdown_table, write_json

KEYS = ["rank", "shortlist", "head mass kept", "beam recall", "test P@1", "P@1 - exact", "head adds a row",
        "head adds / exact", "us a row", "us / exact"]

#: rows and clusters a tile of the approximate kernel scores at once (as :func:`summary_topk`'s)
ROWS, TILE = 256, 1024


def head_basis(MH: np.ndarray, rank: int, *, seed: int = 0, n_iter: int = 2) -> np.ndarray:
    """An orthonormal ``Q`` (head features x ``rank``) spanning about the top left singular directions of ``MH``
    (subspace iteration from a seeded Gaussian start)."""
    rng = np.random.default_rng(seed)
    Q, _ = np.linalg.qr(MH @ rng.standard_normal((MH.shape[1], rank)).astype(MH.dtype))
    for _ in range(n_iter):
        Q, _ = np.linalg.qr(MH @ (MH.T @ Q))
    return Q


def _summary_shortlist(xh_indptr, xh_indices, xh_data, x_indptr, x_indices, x_data,  # pragma: no cover
                       mt_indptr, mt_indices, mt_data, z, proj, mht, n_clusters, s, rows, tile):
    n = len(x_indptr) - 1
    rank = z.shape[1]
    ids = np.full((n, s), -1, np.int64)
    approx = np.full((n, s), -np.inf, np.float32)
    tails = np.zeros((n, s), np.float32)
    low = np.empty((rows, n_clusters), np.float32)
    tl = np.zeros(n_clusters, np.float32)
    for r0 in range(0, n, rows):
        m = min(n, r0 + rows) - r0
        # the low-rank head scores (x_h Q) (Q^T MH), a tile of clusters at a time for the batch's rows: each row of
        # the tile's projection read once for the batch, the sums over the rank in one order whatever the tile
        for c0 in range(0, n_clusters, tile):
            w = min(n_clusters, c0 + tile) - c0
            for t in range(m):
                dst, zr = low[t, c0:c0 + w], z[r0 + t]
                for c in range(w):
                    dst[c] = 0.0
                for j in range(rank):
                    src, zv = proj[j, c0:c0 + w], zr[j]
                    for c in range(w):
                        dst[c] += zv * src[c]
        for t in range(m):
            i = r0 + t
            # the exact tail into its own scores (kept for the shortlist), then the best approximate kept as they
            # come, sorted (a later cluster, a larger id, must beat a score)
            for q in range(x_indptr[i], x_indptr[i + 1]):
                f, xv = x_indices[q], x_data[q]
                for e in range(mt_indptr[f], mt_indptr[f + 1]):
                    tl[mt_indices[e]] += xv * mt_data[e]
            row = low[t]
            last = approx[i, s - 1]
            for c in range(n_clusters):
                sc = row[c] + tl[c]
                if sc <= last:
                    continue
                h = s - 1
                while h > 0 and sc > approx[i, h - 1]:
                    approx[i, h] = approx[i, h - 1]
                    ids[i, h] = ids[i, h - 1]
                    tails[i, h] = tails[i, h - 1]
                    h -= 1
                approx[i, h] = sc
                ids[i, h] = c
                tails[i, h] = tl[c]
                last = approx[i, s - 1]
            for q in range(x_indptr[i], x_indptr[i + 1]):
                f = x_indices[q]
                for e in range(mt_indptr[f], mt_indptr[f + 1]):
                    tl[mt_indices[e]] = 0.0
    # the exact head scores of the shortlisted (row, cluster) pairs, cluster by cluster: a cluster's dense head row
    # read once for all the rows that shortlisted it
    exact = np.full((n, s), -np.inf, np.float32)
    count = np.zeros(n_clusters + 1, np.int64)
    for i in range(n):
        for j in range(s):
            if ids[i, j] >= 0:
                count[ids[i, j] + 1] += 1
    for c in range(n_clusters):
        count[c + 1] += count[c]
    pairs = np.empty(count[n_clusters], np.int64)
    fill = count[:n_clusters].copy()
    for i in range(n):
        for j in range(s):
            c = ids[i, j]
            if c >= 0:
                pairs[fill[c]] = i * s + j
                fill[c] += 1
    for c in range(n_clusters):
        hrow = mht[c]
        for p in range(count[c], count[c + 1]):
            i, j = pairs[p] // s, pairs[p] % s
            acc = tails[i, j]
            for q in range(xh_indptr[i], xh_indptr[i + 1]):
                acc += xh_data[q] * hrow[xh_indices[q]]
            exact[i, j] = acc
    return ids, approx, exact


@functools.cache
def _shortlist_kernel():
    """The approximate routing kernel, compiled by Numba."""
    import numba

    return numba.njit(nogil=True)(_summary_shortlist)


def summary_shortlist(X, MT, head, Q, P, MHt, s: int):
    """The ``s`` clusters of highest approximate summary score of each row (the head by ``(x_h Q) P``, the tail
    ``MT`` exactly), by that score (ties: the smaller id), and their approximate and exact scores (the exact head
    from ``MHt``, the dense head transposed): ``(n_rows, s)`` int64, float32, float32."""
    from xmldask.models._candidates import _head_split

    X, MT = sp.csr_matrix(X, dtype=np.float32), sp.csr_matrix(MT, dtype=np.float32)
    MT.sort_indices()
    xh_indptr, xh_indices, xh_data = _head_split(X, head)
    Z = np.ascontiguousarray(sp.csr_matrix((xh_data, xh_indices, xh_indptr), shape=(X.shape[0], len(head))) @ Q,
                             np.float32)
    return _shortlist_kernel()(xh_indptr, xh_indices, xh_data, X.indptr, X.indices, X.data, MT.indptr, MT.indices,
                               MT.data, Z, np.ascontiguousarray(P, np.float32), np.ascontiguousarray(MHt, np.float32),
                               MT.shape[1], int(min(s, MT.shape[1])), ROWS, TILE)


def measure(model_url: str, test_url: str, *, rows: int, ranks: list[int], shortlists: list[int],
            repeats: int = 3) -> tuple[dict, list]:
    import dask
    from threadpoolctl import threadpool_limits

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
    MHt = np.ascontiguousarray(MH.T)
    beam, n_clusters = int(model.beam_), MH.shape[1]
    weight = float(model.svm_weight_ or 0.0)
    entries = model._label_entries(classifiers=bool(weight))  # made once for every P@1 below
    W, V = entries["W"], entries["V"]

    def p_at_1(best: np.ndarray) -> float:
        hit_rows, slots = np.nonzero(best >= 0)
        labels, _ = candidate_topk(Xb, hit_rows, best[hit_rows, slots], W, model.order_, model.offsets_, 1, V=V,
                                   bias=getattr(model, "svm_bias_", None), weight=weight,
                                   threshold=float(model.centroid_threshold_ or 0.0))
        top, ok = labels[:, 0], labels[:, 0] >= 0
        return float((np.asarray(Y[np.flatnonzero(ok), top[ok]]).ravel() > 0).sum() / n)

    runs = {"exact": lambda: summary_topk(Xb, MT, beam, MH, head)}
    settings = []
    for rank in ranks:
        if rank >= len(head):
            continue
        Q = head_basis(MH, rank)
        P = Q.T @ MH
        for times in shortlists:
            size = min(n_clusters, times * beam)
            settings.append((rank, size, P))
            runs[rank, size] = lambda Q=Q, P=P, size=size: summary_shortlist(Xb, MT, head, Q, P, MHt, size)
    seconds, got = {key: [] for key in runs}, {}
    with threadpool_limits(1):
        summary_topk(Xb[:64], MT, beam, MH, head)  # both kernels compiled before they are timed
        Q1 = head_basis(MH, 1)
        summary_shortlist(Xb[:64], MT, head, Q1, Q1.T @ MH, MHt, beam)
        for _ in range(repeats):  # in alternation: the machine's drift falls on all alike
            for key, run in runs.items():
                start = time.perf_counter()
                got[key] = run()
                seconds[key].append(time.perf_counter() - start)
    us = {key: 1e6 * min(times) / n for key, times in seconds.items()}
    ids = got["exact"][0]
    head_entries = float(np.mean(np.diff(Xb[:, head].indptr)))
    mass = float(np.sum(MH.astype(np.float64) ** 2))
    exact_p1 = p_at_1(ids)
    context = {"model": model_url, "rows": n, "clusters": n_clusters, "head features": len(head), "beam": beam,
               "head entries a row": round(head_entries, 1),
               "tail entries a row": round(float(np.diff(MT.indptr)[Xb.indices].sum()) / n),
               "exact routing us a row": round(us["exact"], 1),
               "exact P@1": round(exact_p1, 4)}
    table = []
    for rank, size, P in settings:
        short, _, exact = got[rank, size]
        best = np.take_along_axis(short, np.lexsort((short, -exact), axis=1)[:, :beam], axis=1)
        recall = float(np.mean([len(set(a) & set(b)) for a, b in zip(best.tolist(), ids.tolist())]) / beam)
        p1 = p_at_1(best)
        adds = rank * (head_entries + n_clusters) + size * head_entries
        table.append({"rank": rank, "shortlist": size,
                      "head mass kept": round(float(np.sum(P.astype(np.float64) ** 2)) / mass, 3),
                      "beam recall": round(recall, 4), "test P@1": round(p1, 4),
                      "P@1 - exact": round(p1 - exact_p1, 4), "head adds a row": round(adds),
                      "head adds / exact": round(adds / (head_entries * n_clusters), 3),
                      "us a row": round(us[rank, size], 1), "us / exact": round(us[rank, size] / us["exact"], 3)})
        print(f"rank {rank}, shortlist {size}: recall {recall:.4f}, P@1 {p1:.4f}, {us[rank, size]:.1f} us a row",
              flush=True)
    return context, table


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model", help="a saved label-centroid model routed by its summaries")
    parser.add_argument("test", help="a test dataset store")
    parser.add_argument("--rows", type=int, default=5000, help="test rows (the first; default 5000)")
    parser.add_argument("--ranks", default="8,16,32,64", help="ranks of the head's projection (default 8,16,32,64)")
    parser.add_argument("--shortlists", default="2,4,8",
                        help="shortlists, in multiples of the model's beam (default 2,4,8)")
    parser.add_argument("--repeats", type=int, default=3,
                        help="timed runs of each kernel, in alternation; the best is reported (default 3)")
    parser.add_argument("--json", metavar="FILE", help="write the rows as JSON (each with the model's figures)")
    args = parser.parse_args(argv)
    ranks = [int(v) for v in args.ranks.split(",")]
    shortlists = [int(v) for v in args.shortlists.split(",")]
    context, table = measure(args.model, args.test, rows=args.rows, ranks=ranks, shortlists=shortlists,
                             repeats=args.repeats)
    print(f"\n### bench/summary_rank.py ({context['rows']:,} test rows; {context['clusters']:,} clusters, "
          f"{context['head features']:,} head features, {context['head entries a row']} head entries a row, "
          f"{context['tail entries a row']:,} summary entries of its other features, beam "
          f"{context['beam']}; exact routing {context['exact routing us a row']} us a row on one thread, test P@1 "
          f"{context['exact P@1']})\n")
    print(markdown_table(table, KEYS))
    print(f"\n{load_line()}")
    if args.json:
        write_json(args.json, [{**context, **row} for row in table])


if __name__ == "__main__":
    main()
