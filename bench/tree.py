"""The spectral label tree and its candidate-restricted classifier against the paper's ALOI figures.

Mineiro and Karampatziakis, "A Hierarchical Spectral Method for Extreme Classification" (2015):
Table 3 (root purity and balance, eq. (2) vs random directions with a median bias), Table 4 (tree +
rank-50 LR: mean depth and candidates, tree recall, accuracy) and the ablations (deterministic tree
building; deterministic routing while training the classifier; one classifier shared by every leaf);
also lshtc1-dryrun-task2 (tree vs the recall of the most frequent training labels, tree + classifier
vs our flat EmbeddingClassifier). Every row gives our figure beside the paper's, the build / train
seconds, the passes, the peak RSS of this process (the only worker: no cluster is started) and, for
classifiers, prediction rows/s.

Fractional routing with the reference code's width makes every training row reach hundreds of
nodes at depth 14 on ALOI (path probability over 1e-4); the tree keeps each block's pairs with the
frontier between passes, so the depth-14 tree takes about 6 minutes (130 passes) on 2 cores.
The classifier variants train on the fractional tree (the paper's Table 4; ``--classifier-tree deterministic``:
the deterministic one, and no fractional tree is grown); ``--epochs 0`` skips them.

Usage::

    python bench/tree.py                       # ALOI, the default depths, one seed
    python bench/tree.py --dataset lshtc1-dryrun-task2 --json out.json
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import tempfile
import time

import dask
import numpy as np

from xmldask.io import ingest
from xmldask.models import EmbeddingClassifier
from xmldask.models.tree_classifier import CandidateScorer, TreeClassifier
from xmldask.store import open_dataset
from xmldask.tree import SpectralLabelTree

sys.path.insert(0, os.path.dirname(__file__))
from peers import _peak_rss_mb  # noqa: E402

DATA = os.environ.get("XMLDASK_SHARED_DATA", os.path.join(os.path.dirname(__file__), "..", "..", "shared", "data"))

#: the paper's ALOI figures (Tables 3, 4 and the ablations in section 5.2), percent
PAPER = {"root_purity_train": 86.7, "root_purity_test": 86.9, "test_balance": 49.98,
         "random_purity_train_mean": 71.9, "random_purity_train_max": 84.8, "random_purity_test_mean": 74.0,
         "random_purity_test_max": 85.6, "tree_recall_train": 98.1, "tree_recall_test": 96.5, "mean_depth": 13.94,
         "mean_candidates": 24.09, "accuracy_train": 95.97, "accuracy_test": 91.03, "flat_accuracy_test": 91.12,
         "det_tree_recall_train": 100.0, "det_tree_recall_test": 93.3, "shared_accuracy_test": 89.53,
         "det_routing_accuracy_test": 79.34}


def _open(name: str, split: str, work: str, block_rows: int, normalize: str = "none"):
    url = os.path.join(work, f"{name}-{split}-{normalize}.zarr")
    if not os.path.exists(url):
        ingest([os.path.join(DATA, name, f"{split}.txt.gz")], url, block_rows=block_rows, normalize=normalize)
    return open_dataset(url)


def _accuracy(model, data, k: int = 1) -> tuple[float, float]:
    """Top-1 accuracy (P@1) on ``data`` and prediction rows/s."""
    start = time.perf_counter()
    labels, _ = model.predict_topk(data.X, k=k)
    labels, Y = dask.compute(labels, data.Y)
    seconds = time.perf_counter() - start
    hits = np.asarray(Y.tocsr()[np.arange(labels.shape[0]), np.maximum(labels[:, 0], 0)]).ravel() > 0
    hits &= labels[:, 0] >= 0
    return 100 * float(hits.mean()), labels.shape[0] / seconds


def random_purity(tree: SpectralLabelTree, train, test, n_directions: int, seed: int) -> dict:
    """Purity of random unit directions with the (unweighted) training median as bias (Table 3's baseline)."""
    Xtr, Ytr, Xte, Yte = dask.compute(train.X, train.Y, test.X, test.Y)
    rng = np.random.default_rng(seed)
    W = rng.standard_normal((Xtr.shape[1], n_directions))
    W /= np.linalg.norm(W, axis=0)
    Ttr, Tte = np.asarray(Xtr @ W), np.asarray(Xte @ W)
    b = np.median(Ttr, axis=0)
    out = {}
    for split, T, Y in (("train", Ttr, Ytr), ("test", Tte, Yte)):
        left = (T > b).astype(np.float64)
        nl = np.asarray(Y.T @ left)
        nr = np.asarray(Y.sum(axis=0)).ravel()[:, None] - nl
        purity = 100 * np.maximum(nl, nr).sum(axis=0) / Y.sum()
        out[f"random_purity_{split}_mean"], out[f"random_purity_{split}_max"] = purity.mean(), purity.max()
    return out


def _tree_rows(tag: str, tree: SpectralLabelTree, train, test, seconds: float, paper: dict) -> list[dict]:
    """Recall (train, test), top-s recall, mean depth and candidates of a tree; ``paper``: the paper's figures."""
    ftr, fte = tree.figures(train.X, train.Y), tree.figures(test.X, test.Y)
    common = {"tree": tag, "seconds": round(seconds, 1), "passes": tree.n_passes_,
              "peak_rss_mb": round(_peak_rss_mb())}
    return [
        {"figure": "tree recall train %", "ours": 100 * ftr["tree_recall"], "paper": paper.get("recall_train"),
         **common},
        {"figure": "tree recall test %", "ours": 100 * fte["tree_recall"], "paper": paper.get("recall_test"), **common},
        {"figure": "top-s labels recall test %", "ours": 100 * fte["top_labels_recall"], "paper": None, **common},
        {"figure": "mean depth (train)", "ours": ftr["mean_depth"], "paper": paper.get("mean_depth"), **common},
        {"figure": "mean candidates (train)", "ours": ftr["mean_candidates"], "paper": paper.get("mean_candidates"),
         **common},
    ]


class _Rows(list):
    """The result rows; each is printed (one Markdown line) and saved to ``--json`` as soon as it is measured."""

    def __init__(self, json_path):
        super().__init__()
        self.json_path = json_path

    def add(self, *rows):
        for r in rows:
            self.append(r)
            print(_line(r), flush=True)
        if self.json_path:
            with open(self.json_path, "w") as fh:
                json.dump(list(self), fh, indent=1, default=float)


def _classifier_rows(model, train, test, tag, seconds, paper_train, paper_test, repeats: int = 1) -> list[dict]:
    """Train and test accuracy rows of ``model``; prediction rows/s on the test rows, the best of ``repeats``."""
    acc_tr, _ = _accuracy(model, train)
    acc_te, speed = _accuracy(model, test)
    for _ in range(repeats - 1):
        speed = max(speed, _accuracy(model, test)[1])
    common = {"tree": tag, "seconds": round(seconds, 1), "passes": getattr(model, "n_passes_", None),
              "peak_rss_mb": round(_peak_rss_mb()), "rows_per_s": round(speed)}
    return [{"figure": "accuracy train %", "ours": acc_tr, "paper": paper_train, **common},
            {"figure": "accuracy test %", "ours": acc_te, "paper": paper_test, **common}]


def _scorer_rows(args, rows, train, test, work, frac, depth, budgets, paper) -> None:
    """Our flat model, then one of its members as the scorer of the candidates of trees (``--classifier-tree``) at
    each leaf budget (tree recall, accuracy and prediction rows/s against the budget)."""
    from xmldask.jobs import train as train_job
    from xmldask.models import load_model

    start = time.perf_counter()
    url = os.path.join(work, f"{args.dataset}-flat.zarr")
    if args.flat == "default":  # xmldask train with no options: the model users get (an ensemble), and a member
        data = os.path.join(work, f"{args.dataset}-train-{args.normalize}.zarr")
        train_job(data, url, overwrite=True)
        model = load_model(url)
        members = getattr(model, "estimators_", [model])
        rows.add(*_classifier_rows(model, train, test, f"flat model (xmldask train defaults: {len(members)} "
                                   "members)", time.perf_counter() - start, None, paper.get("flat_accuracy_test"),
                                   repeats=args.speed_repeats))
        flat, tag, scorer = members[0], "flat model's first member alone", "its first member"
    else:
        flat = EmbeddingClassifier(embedding="rembrandt", n_components=args.rank, random_state=0).fit(train.X, train.Y)
        tag = scorer = f"flat EmbeddingClassifier (rembrandt k={args.rank})"
    rows.add(*_classifier_rows(flat, train, test, tag, time.perf_counter() - start, None,
                               paper.get("flat_accuracy_test"), repeats=args.speed_repeats))
    for budget in budgets:
        start = time.perf_counter()
        routing = args.classifier_tree
        tree = frac if budget == args.leaf_labels else SpectralLabelTree(
            max_depth=depth, leaf_labels=budget, routing=routing, random_state=0).fit(train.X, train.Y)
        if budget != args.leaf_labels:
            rows.add(*_tree_rows(f"{routing} depth {depth}, s={budget}, seed 0", tree, train, test,
                                 time.perf_counter() - start, {})[:2])
        rows.add(*_classifier_rows(CandidateScorer(tree, flat), train, test,
                                   f"{routing} tree s={budget} + {scorer} as scorer", 0.0, None,
                                   None, repeats=args.speed_repeats))


def run(args, rows: _Rows) -> None:
    work = args.work or tempfile.mkdtemp(prefix="xmldask-bench-tree-")
    train, test = (_open(args.dataset, split, work, args.block_rows, args.normalize) for split in ("train", "test"))
    aloi = args.dataset == "aloi"
    paper = PAPER if aloi else {}
    budgets = [int(b) for b in args.scorer_budgets.split(",")] if args.scorer_budgets else []
    for seed in range(args.seeds):
        # the deterministic tree (the paper's ablation), full depth
        start = time.perf_counter()
        det = SpectralLabelTree(max_depth=args.depth, leaf_labels=args.leaf_labels, routing="deterministic",
                                random_state=seed).fit(train.X, train.Y)
        figures = ({"recall_train": paper["det_tree_recall_train"], "recall_test": paper["det_tree_recall_test"]}
                   if aloi else {})
        rows.add(*_tree_rows(f"deterministic depth {args.depth}, s={args.leaf_labels}, seed {seed}", det, train,
                             test, time.perf_counter() - start, figures))
        # the fractional tree (the paper's), as deep as --fractional-depth; its root gives Table 3. With
        # --classifier-tree deterministic the deterministic tree (the same root) stands in for it
        start = time.perf_counter()
        fractional = args.classifier_tree == "fractional"
        frac_depth = (args.fractional_depth or args.depth) if fractional else args.depth
        frac = SpectralLabelTree(max_depth=frac_depth, leaf_labels=args.leaf_labels,
                                 random_state=seed).fit(train.X, train.Y) if fractional else det
        frac_s = time.perf_counter() - start
        ftr, fte = frac.figures(train.X, train.Y), frac.figures(test.X, test.Y)
        common = {"tree": f"root of the {args.classifier_tree} tree (seed {seed})", "seconds": None, "passes": None,
                  "peak_rss_mb": None}
        rows.add({"figure": "root purity train %", "ours": 100 * ftr["root_purity"],
                  "paper": paper.get("root_purity_train"), **common},
                 {"figure": "root purity test %", "ours": 100 * fte["root_purity"],
                  "paper": paper.get("root_purity_test"), **common},
                 {"figure": "test balance %", "ours": 100 * fte["root_balance"], "paper": paper.get("test_balance"),
                  **common})
        if seed == 0 and args.random_directions:
            rnd = random_purity(frac, train, test, args.random_directions, seed)
            rows.add(*[{"figure": f"{key.replace('_', ' ')} % ({args.random_directions} random w)", "ours": value,
                        "paper": paper.get(key), **common} for key, value in rnd.items()])
        figures = ({"recall_train": paper["tree_recall_train"], "recall_test": paper["tree_recall_test"],
                    "mean_depth": paper["mean_depth"], "mean_candidates": paper["mean_candidates"]} if aloi else {})
        if fractional:
            rows.add(*_tree_rows(f"fractional depth {frac_depth}, s={args.leaf_labels}, seed {seed}", frac,
                                 train, test, frac_s, figures))
        if args.flat and seed == 0:
            _scorer_rows(args, rows, train, test, work, frac, frac_depth, budgets, paper)
        # the candidate-restricted classifier and its ablations
        forms = args.forms.split(",")
        variants = [(f"rank-{args.rank} LR, per-leaf V, b; randomized routing", {}, ("accuracy_train", "accuracy_test"))
                    ] if "low_rank" in forms else []
        if "per_label" in forms:
            variants.append(("per-label weights, per-(leaf, candidate) bias (text form); randomized routing",
                             {"form": "per_label"}, (None, None)))
        if args.ablations:
            variants += [(f"rank-{args.rank} LR, shared V, b (ablation)", {"per_leaf": False},
                          (None, "shared_accuracy_test")),
                         (f"rank-{args.rank} LR, deterministic routing (ablation)", {"routing": "deterministic"},
                          (None, "det_routing_accuracy_test"))]
        for name, options, (key_tr, key_te) in variants if args.epochs else []:
            start = time.perf_counter()
            model = TreeClassifier(frac, n_components=args.rank, max_epochs=args.epochs, random_state=seed,
                                   validation_fraction=0, **options).fit(train.X, train.Y)  # the paper's passes
            rows.add(*_classifier_rows(model, train, test, f"{args.classifier_tree} tree + {name}, "
                                       f"{args.epochs} passes, seed {seed}", time.perf_counter() - start,
                                       paper.get(key_tr), paper.get(key_te)))


def _fmt(value) -> str:
    if value is None:
        return ""
    return f"{value:,.2f}" if isinstance(value, float) else f"{value:,}"


HEADER = ("| setting | figure | ours | paper | seconds | passes | peak RSS MB | predict rows/s |\n"
          "|---|---|---|---|---|---|---|---|")


def _line(r: dict) -> str:
    return (f"| {r['tree']} | {r['figure']} | {_fmt(r['ours'])} | {_fmt(r['paper'])} | {_fmt(r.get('seconds'))} | "
            f"{_fmt(r.get('passes'))} | {_fmt(r.get('peak_rss_mb'))} | {_fmt(r.get('rows_per_s'))} |")


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dataset", default="aloi")
    ap.add_argument("--depth", type=int, default=14, help="depth of the trees (default 14)")
    ap.add_argument("--fractional-depth", type=int, default=None,
                    help="depth of the fractional tree (default: --depth)")
    ap.add_argument("--leaf-labels", type=int, default=25)
    ap.add_argument("--rank", type=int, default=50)
    ap.add_argument("--epochs", type=int, default=30, help="classifier passes (the paper's code: 200-250)")
    ap.add_argument("--seeds", type=int, default=1)
    ap.add_argument("--random-directions", type=int, default=1000, help="Table 3 baseline (the paper: 10,000)")
    ap.add_argument("--flat", choices=["default", "rank"], default=None,
                    help="also fit our flat model (default: xmldask train with no options, and its first member "
                    "alone; rank: Rembrandt k = --rank, linear) and use it (the member) as the scorer of the trees' "
                    "candidates at each --scorer-budgets")
    ap.add_argument("--scorer-budgets", default="25,50,100",
                    help="leaf budgets of the fractional trees scored by the flat model")
    ap.add_argument("--speed-repeats", type=int, default=3,
                    help="the flat and scorer rows' prediction rows/s: the best of this many runs")
    ap.add_argument("--ablations", action="store_true", help="also the classifier ablations")
    ap.add_argument("--classifier-tree", choices=["fractional", "deterministic"], default="fractional",
                    help="the tree the classifiers and scorers take (deterministic: no fractional tree is grown)")
    ap.add_argument("--forms", default="low_rank",
                    help="the tree classifier's forms to train, comma-separated: low_rank (the paper's ALOI form), "
                    "per_label (its text form)")
    ap.add_argument("--block-rows", type=int, default=65536)
    ap.add_argument("--normalize", default="none", choices=["none", "l2", "sqrt"],
                    help="row transform at ingest (sqrt: the paper's Hellinger map for text)")
    ap.add_argument("--work", default=None, help="directory for the ingested stores (default: a temporary one)")
    ap.add_argument("--json", default=None, help="write the rows as a JSON list to this file")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    print(f"\n### {args.dataset}\n\n{HEADER}", flush=True)
    run(args, _Rows(args.json))


if __name__ == "__main__":
    main()
