"""Growing the spectral label tree on multilabel data: the label Gram pass against a pass per CG iteration.

On multilabel data every application of a node's operator solves ``Y^T D Y V = T`` by Jacobi-PCG (up to
``cg_max_iter`` = 20 iterations). The tree computes each group's ``Y^T D_j Y`` blocks on their labels
in one pass and runs the iterations in memory (``xmldask.tree.growth._label_gram``); the ablation
(``--ablation``) runs them as before, one pass over the data per iteration. Both grow the default tree
(fractional routing, depth 14, 25 leaf labels, seed 0) on the same row blocks in this process (Dask's
threaded scheduler), and the test rows give the tree recall.

    python bench/tree_growth.py [--datasets yeast,bibtex,delicious] [--ablation] [--json FILE]

Prints a Markdown table: dataset, variant, seconds, passes, train / test tree recall, and the
ablation's seconds and passes as ratios to the label Gram's.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from unittest import mock

sys.path.insert(0, os.path.dirname(__file__))
from _tables import markdown_table, write_json  # noqa: E402
from tree import DATA, _open  # noqa: E402

from xmldask.tree import SpectralLabelTree, growth  # noqa: E402

KEYS = ["dataset", "variant", "seconds", "passes", "tree_recall_train", "tree_recall_test", "seconds_ratio",
        "passes_ratio"]


def grow(name: str, work: str, *, ablation: bool, block_rows: int) -> dict:
    train, test = (_open(name, split, work, block_rows) for split in ("train", "test"))
    patch = mock.patch.object(growth, "_label_gram", lambda *args: None) if ablation else mock.MagicMock()
    with patch:
        start = time.perf_counter()
        tree = SpectralLabelTree(random_state=0).fit(train.X, train.Y)
        seconds = time.perf_counter() - start
    return {"dataset": name, "variant": "a pass per CG iteration" if ablation else "label Gram pass",
            "seconds": round(seconds, 2), "passes": int(tree.n_passes_),
            "tree_recall_train": round(100 * tree.figures(train.X, train.Y)["tree_recall"], 2),
            "tree_recall_test": round(100 * tree.figures(test.X, test.Y)["tree_recall"], 2)}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--datasets", default="yeast,bibtex,delicious")
    ap.add_argument("--ablation", action="store_true", help="also grow each tree with a pass per CG iteration")
    ap.add_argument("--block-rows", type=int, default=16_384)
    ap.add_argument("--work", default=None, help="directory for the ingested stores (default: a temporary one)")
    ap.add_argument("--json", default=None, help="write the rows as a JSON list to this file")
    args = ap.parse_args(argv)
    work = args.work or tempfile.mkdtemp(prefix="bench-tree-growth-")
    rows = []
    for name in args.datasets.split(","):
        if not os.path.exists(os.path.join(DATA, name)):
            print(f"skipping {name}: not in {DATA}", file=sys.stderr)
            continue
        fast = grow(name, work, ablation=False, block_rows=args.block_rows)
        rows.append(fast)
        if args.ablation:
            slow = grow(name, work, ablation=True, block_rows=args.block_rows)
            rows.append({**slow, "seconds_ratio": round(slow["seconds"] / fast["seconds"], 2),
                         "passes_ratio": round(slow["passes"] / fast["passes"], 2)})
        print(markdown_table(rows[-2 if args.ablation else -1:], KEYS), file=sys.stderr, flush=True)
    print(markdown_table(rows, KEYS))
    write_json(args.json, rows)


if __name__ == "__main__":
    main()
