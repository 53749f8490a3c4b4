"""The tree classifier's passes: early-stopped on held-out training rows (the default) against every pass.

Grows one spectral label tree (``SpectralLabelTree``, ``--depth``, ``--leaf-labels``, ``--routing``) on the
training split, then fits :class:`~xmldask.models.tree_classifier.TreeClassifier` on it twice with the same
seed and ``--epochs`` passes at most: with its defaults (10 % of the rows held out, stopped after 10 passes
without a better held-out P@1, the best pass kept) and with ``validation_fraction=0`` (every row, every pass: the
reference code's loop). Prints passes, seconds and test P@1/P@3 of each, and the ratios.

Data: a shared dataset by name (``--dataset bibtex``, from ``$XMLDASK_SHARED_DATA`` or ``../shared/data``), or
``--dataset synthetic`` (``xmldask.datasets.make_synthetic``: ``--rows`` training rows, 2,000 features, 400
labels, and a test split of a fifth of them).

    python bench/tree_passes.py --dataset synthetic --rows 40000 [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from xmldask.io import ingest  # noqa: E402
from xmldask.metrics import precision_at_k  # noqa: E402
from xmldask.models.tree_classifier import TreeClassifier  # noqa: E402
from xmldask.store import open_dataset  # noqa: E402
from xmldask.tree import SpectralLabelTree  # noqa: E402

DATA = os.environ.get("XMLDASK_SHARED_DATA", os.path.join(os.path.dirname(__file__), "..", "..", "shared", "data"))


def _data(args, work: str):
    if args.dataset == "synthetic":
        from xmldask.datasets import make_synthetic

        opts = {"n_features": 2000, "n_labels": 400, "seed": 0}
        return tuple(make_synthetic(os.path.join(work, f"{split}.zarr"), n_samples=n, split=split, **opts)
                     for split, n in (("train", args.rows), ("test", args.rows // 5)))
    out = []
    for split in ("train", "test"):
        url = os.path.join(work, f"{split}.zarr")
        ingest([os.path.join(DATA, args.dataset, f"{split}.txt.gz")], url)
        out.append(open_dataset(url))
    return tuple(out)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dataset", default="synthetic", help="a shared dataset's name, or synthetic (default)")
    ap.add_argument("--rows", type=int, default=40000, help="synthetic training rows (default %(default)s)")
    ap.add_argument("--epochs", type=int, default=200, help="passes at most (default %(default)s)")
    ap.add_argument("--depth", type=int, default=8)
    ap.add_argument("--leaf-labels", type=int, default=25)
    ap.add_argument("--routing", choices=["fractional", "deterministic"], default="deterministic")
    ap.add_argument("--form", choices=["low_rank", "per_label"], default="low_rank")
    ap.add_argument("--json", default=None, metavar="FILE", help="write the rows as a JSON list")
    args = ap.parse_args(argv)
    work = tempfile.mkdtemp(prefix="xmldask-bench-tree-passes-")
    train, test = _data(args, work)
    start = time.perf_counter()
    tree = SpectralLabelTree(max_depth=args.depth, leaf_labels=args.leaf_labels, routing=args.routing,
                             random_state=0).fit(train.X, train.Y)
    grown = time.perf_counter() - start
    print(f"tree: {tree.n_leaves_:,} leaves in {grown:.1f} s", file=sys.stderr, flush=True)
    rows = []
    for name, options in (("early-stopped (default)", {}), ("every pass (validation_fraction=0)",
                                                           {"validation_fraction": 0})):
        start = time.perf_counter()
        model = TreeClassifier(tree, form=args.form, max_epochs=args.epochs, random_state=0, **options).fit(
            train.X, train.Y)
        seconds = time.perf_counter() - start
        labels, _ = (a.compute() for a in model.predict_topk(test.X, k=3))
        rows.append({"dataset": args.dataset, "classifier": name, "passes": len(model.history_),
                     "kept pass": int(model.best_epoch_), "seconds": round(seconds, 1),
                     "held-out P@1": round(100 * model.held_out_["p@1"], 2) if model.held_out_ else None,
                     "test P@1": round(100 * precision_at_k(test.Y, labels, k=1), 2),
                     "test P@3": round(100 * precision_at_k(test.Y, labels, k=3), 2)})
        print(f"{name}: {rows[-1]}", file=sys.stderr, flush=True)
    early, full = rows
    for key in ("passes", "seconds", "test P@1"):
        early[f"{key} / every pass"] = round(early[key] / full[key], 3) if full[key] else None
    columns = list(early)
    print(f"\n### bench/tree_passes.py ({args.dataset}; tree depth {args.depth}, s = {args.leaf_labels}, "
          f"{args.routing}, grown in {grown:.1f} s; {args.form}, at most {args.epochs} passes)\n")
    print("| " + " | ".join(columns) + " |")
    print("|" + "---|" * len(columns))
    for row in rows:
        print("| " + " | ".join("" if row.get(c) is None else str(row.get(c)) for c in columns) + " |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
