"""Where a label-centroid model's prediction of a row goes: routing to groups, to clusters, and the candidates.

A saved model (``xmldask train --model centroid`` or the default at large label counts) and a test store: the
first ``--rows`` test rows are cut into row blocks of each ``--block-rows`` and run through the prediction's three
kernels in this process on one thread (no Dask): the group routers (:func:`~xmldask.models.centroid._best_groups`;
none with the summaries), the clusters (:func:`~xmldask.models._candidates.grouped_topk` by the routers, or
:func:`~xmldask.models._candidates.summary_topk` by the summaries) and the labels of the chosen clusters
(:func:`~xmldask.models._candidates.candidate_topk`), at each ``--beams`` (default: the model's). Each phase's
microseconds a row are the best of ``--repeats``, the block sizes and beams taken in turn in each repeat (a
memory-bound kernel's time moves with the machine's state: compare the rows of one run). A served model predicts
small blocks too: a kernel whose cost a row falls only with the block's rows shows it here. ``prepare s``: the
seconds the loaded model took to make what its predictions read (the routers transposed, the centroids by
cluster and feature), once.

Usage::

    python bench/predict_phases.py MODEL TEST --rows 5000 --block-rows 200,5000 --beams 10,20
    python bench/predict_phases.py MODEL TEST --json phases.json
"""

from __future__ import annotations

import argparse
import time

import numpy as np
from _tables import load_line, markdown_table, write_json

KEYS = ["labels", "routing", "block rows", "beam", "groups us", "clusters us", "candidates us", "us a row",
        "candidates a row", "prepare s"]


def _phases(model, Xb, beam: int, operands: dict) -> tuple[list[float], float]:
    """Seconds of the three phases on the row block ``Xb`` (transformed), and the candidate labels it scored."""
    from xmldask.models import centroid as C
    from xmldask.models._candidates import candidate_topk, grouped_topk

    start = time.perf_counter()
    if "routes" in operands:
        groups = C._best_groups(Xb, operands["routers"], int(model.group_beam_))
        middle = time.perf_counter()
        best = grouped_topk(Xb, groups, operands["routes"], beam)[0]
    else:  # no group routers
        middle = start
        best = C._best_clusters(Xb, operands["MT"], beam, (operands["MH"], operands["head"]))[0]
    routed = time.perf_counter()
    rows, slots = np.nonzero(best >= 0)
    candidate_topk(Xb, rows, best[rows, slots], operands["W"], model.order_, model.offsets_, 5,
                   threshold=float(getattr(model, "centroid_threshold_", None) or 0.0))
    end = time.perf_counter()
    scored = float(np.diff(model.offsets_)[best[rows, slots]].sum())
    return [middle - start, routed - middle, end - routed], scored


def measure(model_url: str, test_url: str, *, rows: int, block_rows: list[int], beams: list[int] | None,
            repeats: int) -> list[dict]:
    import dask
    import scipy.sparse as sp
    from threadpoolctl import threadpool_limits

    from xmldask.models import centroid as C
    from xmldask.models import load_model
    from xmldask.store import open_dataset

    with dask.config.set(scheduler="synchronous"):
        model = load_model(model_url)
        data = open_dataset(test_url)
        X = data.X[:min(rows, data.n_samples)].compute()
    X = C._rows_block(sp.csr_matrix(X), model.idf_)
    routed = model._routed()
    start = time.perf_counter()  # what a loaded model makes once for its predictions
    operands = dict(model._routers()) if routed else \
        dict(zip(("MT", "MH", "head"), C._split_summaries(model.M_)))
    operands["W"] = model._label_entries()["W"]
    prepare = time.perf_counter() - start
    beams = beams or [int(model.beam_)]
    best, scored = {}, {}
    with threadpool_limits(1):
        for repeat in range(repeats + 1):  # the first compiles the kernels and touches the arrays: not kept
            for b_rows in block_rows:
                for beam in beams:
                    total, cands = np.zeros(3), 0.0
                    for a in range(0, X.shape[0], b_rows):
                        seconds, n = _phases(model, X[a:a + b_rows], beam, operands)
                        total += seconds
                        cands += n
                    if repeat:
                        key = (b_rows, beam)
                        best[key] = np.minimum(best.get(key, total), total)
                        scored[key] = cands
    out = []
    for (b_rows, beam), seconds in best.items():
        us = 1e6 * seconds / X.shape[0]
        out.append({"model": model_url, "labels": int(model.n_labels_), "routing": "routers" if routed else
                    "summaries", "rows": int(X.shape[0]), "block rows": b_rows, "beam": beam,
                    "groups us": round(float(us[0]), 1), "clusters us": round(float(us[1]), 1),
                    "candidates us": round(float(us[2]), 1), "us a row": round(float(us.sum()), 1),
                    "candidates a row": round(scored[(b_rows, beam)] / X.shape[0]), "prepare s": round(prepare, 1)})
    return out


def _ints(text: str) -> list[int]:
    values = [int(v) for v in text.split(",") if v.strip()]
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: expected positive integers separated by commas")
    return values


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model", help="a saved label-centroid model store")
    parser.add_argument("test", help="a dataset store of test rows")
    parser.add_argument("--rows", type=int, default=5000, help="test rows (the first; default 5000)")
    parser.add_argument("--block-rows", type=_ints, default=[200, 5000], help="row block sizes (default 200,5000)")
    parser.add_argument("--beams", type=_ints, default=None, help="beams (default: the model's)")
    parser.add_argument("--repeats", type=int, default=3, help="repeats, the best kept (default 3)")
    parser.add_argument("--json", metavar="FILE", help="write the rows as JSON")
    args = parser.parse_args(argv)
    rows = measure(args.model, args.test, rows=args.rows, block_rows=args.block_rows, beams=args.beams,
                   repeats=args.repeats)
    print(f"\n### bench/predict_phases.py ({args.model}, first {rows[0]['rows']:,} test rows, one thread, best of "
          f"{args.repeats})\n")
    print(markdown_table(rows, KEYS))
    print(f"\n{load_line()}")
    write_json(args.json, rows)


if __name__ == "__main__":
    main()
