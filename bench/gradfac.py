"""GradFac's Table 2: micro-F1 by stratified k-fold cross-validation at equal weak-model budgets, beside the paper.

For each UCI dataset (pooled as ``../shared/notes/seed-specs.md`` says: wine, letter and segmentation
all rows; mnist and pendigits the training rows) and each method (``mll``, ``gradfac``, ``gfen``,
``ovr``; optionally ``catboost`` and ``lightgbm`` if installed), one model per fold is fitted at the
largest budget and scored at every budget from its first trees (staged prediction, so the budgets
of a fold are one fit). A budget counts trees: GradFac and GFEN grow one a round, MLL and OVR one per
class a round, LightGBM one per class an iteration, CatBoost one (with vector leaves) an iteration.
No early stopping (the budget is the model). Accuracy and micro-F1 are computed separately and
asserted equal (one prediction per row).

Then, beyond the paper, ``--aloi``: ALOI (1000 classes) on its train/test split, GradFac against MLL at
the same wall-clock budget: MLL boosts ``--aloi-mll-rounds`` rounds (1000 trees each); GradFac's
accuracy is taken after the rounds that fit in MLL's time (its per-round seconds, recorded in
``history_``). The ``round_ms_per_1k_rows`` column is the mean seconds of a round per 1000 training rows
(the claim: a GradFac round costs about the same for any number of classes K).

    python bench/gradfac.py [--datasets wine letter ...] [--methods mll gradfac gfen ovr]
                            [--folds 10] [--run-folds N] [--learning-rate 0.3] [--aloi]
                            [--out-of-core N [N ...]] [--json FILE] [--quick]

``--out-of-core N ...`` fits GradFac (``--ooc-rounds`` rounds, ``backend="dask"``, the state in Zarr
scratch arrays) on synthetic multiclass stores of N rows on a local cluster of ``--ooc-workers``
processes limited to ``--ooc-memory-limit`` each, with Dask's spilling off and a worker restarted at
95% of its limit; it reports each worker's peak RSS (``VmHWM``, read in the workers) and restarts.

``--run-folds N`` runs the first N of the ``--folds`` folds (the split is the same), to bound the time.
Data: ``$XMLDASK_SHARED_DATA`` (default ``../shared/data`` beside the checkout).
"""

from __future__ import annotations

import argparse
import csv
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import scipy.sparse as sp

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _tables import markdown_table, write_json  # noqa: E402

from xmldask.io import read_text  # noqa: E402
from xmldask.models import GradFac, GradFacEN, MultinomialBoosting, OneVsRestBoosting  # noqa: E402

MODELS = {"mll": MultinomialBoosting, "gradfac": GradFac, "gfen": GradFacEN, "ovr": OneVsRestBoosting}


def _paper_table() -> dict[str, dict[int, dict[str, tuple[float, float]]]]:
    """The paper's Table 2 (``papers/gradfac_table2.csv``: micro-F1, mean and standard deviation over the
    folds, by dataset and budget in trees) as dataset -> budget -> method -> (mean, sd)."""
    table: dict = {}
    with open(Path(__file__).parent / "papers" / "gradfac_table2.csv", newline="") as f:
        for row in csv.DictReader(f):
            table.setdefault(row["dataset"], {})[int(row["trees"])] = {
                method: (float(row[method]), float(row[method + "_sd"])) for method in MODELS}
    return table


PAPER = _paper_table()
#: which files of a dataset are pooled for the cross-validation
POOL = {"wine": ("train",), "letter": ("train", "test"), "segmentation": ("train", "test"),
        "mnist": ("train",), "pendigits": ("train",)}
PEERS = ("catboost", "lightgbm")


def data_dir() -> Path:
    return Path(os.environ.get("XMLDASK_SHARED_DATA", Path(__file__).resolve().parents[2] / "shared" / "data"))


def load(name: str) -> tuple[sp.csr_matrix, np.ndarray]:
    """The pooled rows of a UCI dataset: features (CSR) and one class per row."""
    parts = [read_text(str(data_dir() / "uci" / name / f"{part}.txt.gz")) for part in POOL[name]]
    X = sp.vstack([p[0] for p in parts], format="csr")
    Y = sp.vstack([p[1] for p in parts], format="csr")
    if (np.diff(Y.indptr) != 1).any():
        raise ValueError(f"{name}: every row must have exactly one class")
    return X, Y.indices.astype(np.int64)


def stratified_folds(y: np.ndarray, n_folds: int, seed: int = 0) -> np.ndarray:
    """The fold of every row: each class's rows shuffled and dealt round-robin to the folds."""
    rng = np.random.default_rng(seed)
    fold = np.empty(len(y), np.int64)
    offset = 0
    for c in np.unique(y):
        rows = rng.permutation(np.flatnonzero(y == c))
        fold[rows] = (np.arange(len(rows)) + offset) % n_folds
        offset += len(rows)
    return fold


def trees_per_round(method: str, K: int) -> int:
    return K if method in ("mll", "ovr", "lightgbm") else 1


def fit_and_score(method: str, X, y, Xt, yt, K: int, budgets: list[int], lr: float, seed: int) -> dict:
    """Accuracy at every budget (trees) of one fit at the largest, the fit's seconds and round seconds."""
    per = trees_per_round(method, K)
    rounds = max(budgets) // per
    start = time.perf_counter()
    if method in MODELS:
        model = MODELS[method](rounds=rounds, learning_rate=lr, validation_fraction=0.0, random_state=seed).fit(X, y)
        seconds = time.perf_counter() - start
        round_s = statistics.mean(h["seconds"] for h in model.history_ if "seconds" in h)
        out = {}
        for b in budgets:  # the model after b // per rounds: its first (b // per) * per trees
            out[b] = np.asarray(model.predict_topk(Xt, k=1, trees=(b // per) * per)[0].compute())[:, 0]
    elif method == "lightgbm":
        import lightgbm

        params = {"objective": "multiclass", "num_class": K, "num_leaves": 64, "max_depth": 6, "seed": seed,
                  "verbose": -1, "num_threads": 2, **({} if lr is None else {"learning_rate": lr})}
        model = lightgbm.train(params, lightgbm.Dataset(X.astype(np.float32), label=y), num_boost_round=rounds)
        seconds = time.perf_counter() - start
        round_s = seconds / rounds
        out = {b: model.predict(Xt.astype(np.float32), num_iteration=b // per).argmax(axis=1) for b in budgets}
    else:
        import catboost

        model = catboost.CatBoostClassifier(iterations=rounds, depth=6, loss_function="MultiClass",
                                            **({} if lr is None else {"learning_rate": lr}),
                                            random_seed=seed, verbose=False, thread_count=2,
                                            allow_writing_files=False)
        model.fit(X.toarray(), y)
        seconds = time.perf_counter() - start
        round_s = seconds / rounds
        Xd = Xt.toarray()
        out = {b: np.asarray(model.predict(Xd, ntree_end=b // per)).ravel().astype(np.int64) for b in budgets}
    scores = {}
    for b, pred in out.items():
        acc = float((pred == yt).mean())
        tp = int((pred == yt).sum())
        fp = fn = len(yt) - tp  # one prediction per row: a wrong one is a false positive and a false negative
        micro_f1 = 2 * tp / (2 * tp + fp + fn)
        assert abs(micro_f1 - acc) < 1e-12
        scores[b] = micro_f1
    return {"scores": scores, "seconds": seconds, "round_seconds": round_s}


def table2(args) -> list[dict]:
    rows = []
    for name in args.datasets:
        X, y = load(name)
        K = int(y.max()) + 1
        paper_budgets = sorted(b for b in PAPER[name] if args.max_budget is None or b <= args.max_budget)
        paper_budgets = paper_budgets if not args.quick else [min(PAPER[name])]
        run_budget = {b: b if not args.quick else max(K, b // 10 // K * K) for b in paper_budgets}
        folds = stratified_folds(y, args.folds, seed=args.seed)
        results = {m: [] for m in args.methods}
        for f in range(min(args.run_folds or args.folds, args.folds)):
            train, test = folds != f, folds == f
            for method in args.methods:
                lr = args.learning_rate if method in MODELS else args.peer_learning_rate
                r = fit_and_score(method, X[train], y[train], X[test], y[test], K, list(run_budget.values()), lr,
                                  args.seed)
                results[method].append(r)
                print(f"{name} fold {f} {method}: " + ", ".join(f"{b}: {s:.4f}" for b, s in r["scores"].items())
                      + f" ({r['seconds']:.1f} s)", file=sys.stderr, flush=True)
        for method, runs in results.items():
            for b in paper_budgets:
                got = [r["scores"][run_budget[b]] for r in runs]
                paper = PAPER[name][b].get(method)
                rows.append({
                    "dataset": name, "n": int(len(y)), "K": K, "budget_trees": run_budget[b],
                    "method": method, "folds": len(runs), "micro_f1": statistics.mean(got),
                    "sd": statistics.stdev(got) if len(got) > 1 else 0.0,
                    "paper_micro_f1": paper[0] if paper else None, "paper_sd": paper[1] if paper else None,
                    "delta_vs_paper": statistics.mean(got) - paper[0] if paper else None,
                    "fit_seconds": statistics.mean(r["seconds"] for r in runs),
                    "round_ms_per_1k_rows": 1e6 * statistics.mean(r["round_seconds"] for r in runs) / (len(y) * (
                        args.folds - 1) / args.folds),
                })
    return rows


def aloi(args) -> list[dict]:
    """GradFac against MLL on ALOI at MLL's wall-clock time."""
    X, Y = read_text(str(data_dir() / "aloi" / "train.txt.gz"))
    Xt, Yt = read_text(str(data_dir() / "aloi" / "test.txt.gz"))
    y, yt = Y.indices.astype(np.int64), Yt.indices.astype(np.int64)
    rows = []
    start = time.perf_counter()
    mll = MultinomialBoosting(rounds=args.aloi_mll_rounds, learning_rate=args.learning_rate, validation_fraction=0.0,
                              random_state=args.seed).fit(X, y)
    mll_seconds = time.perf_counter() - start
    mll_acc = float((np.asarray(mll.predict(Xt).compute()) == yt).mean())
    start = time.perf_counter()
    gf = GradFac(rounds=args.aloi_gf_rounds, learning_rate=args.learning_rate, validation_fraction=0.0,
                 random_state=args.seed).fit(X, y)
    gf_seconds = time.perf_counter() - start
    elapsed = np.cumsum([h.get("seconds", 0.0) for h in gf.history_[:-1]])
    within = int(np.searchsorted(elapsed, mll_seconds * elapsed[-1] / gf_seconds, side="right")) if len(elapsed) else 0
    within = max(1, min(within, len(gf.values_)))
    for label, model, trees, seconds in (("mll", mll, len(mll.values_), mll_seconds),
                                         ("gradfac (MLL's time)", gf, within, mll_seconds),
                                         ("gradfac (all rounds)", gf, len(gf.values_), gf_seconds)):
        pred = np.asarray(model.predict_topk(Xt, k=1, trees=trees)[0].compute())[:, 0]
        rounds = trees if model is gf else trees // 1000
        round_s = statistics.mean(h["seconds"] for h in model.history_ if "seconds" in h)
        rows.append({"dataset": "aloi", "n": int(len(y)), "K": 1000, "method": label, "rounds": rounds,
                     "budget_trees": trees, "micro_f1": float((pred == yt).mean()), "fit_seconds": seconds,
                     "round_ms_per_1k_rows": 1e6 * round_s / len(y)})
    assert abs(rows[0]["micro_f1"] - mll_acc) < 1e-12
    return rows


#: the memory manager of the out-of-core runs: no spilling or pausing, restart a worker at 95% of its limit
#: (a worker that ever held much more than a few row blocks is killed; restarts are counted)
MEMORY_CONFIG = {"distributed.worker.memory.target": False, "distributed.worker.memory.spill": False,
                 "distributed.worker.memory.pause": False, "distributed.worker.memory.terminate": 0.95}


def _pid_and_peak_rss():
    """This worker's process id and peak RSS in bytes (``VmHWM``: a true peak, not a sample)."""
    with open("/proc/self/status") as f:
        return os.getpid(), next(int(line.split()[1]) for line in f if line.startswith("VmHWM:")) * 1024


def out_of_core(args) -> list[dict]:
    """GradFac fitted from synthetic multiclass stores on a local cluster of worker processes with a memory
    limit, the state in Zarr scratch arrays: seconds, passes and each worker's peak RSS per size."""
    import tempfile

    import dask

    from xmldask import open_dataset
    from xmldask.cluster import cluster
    from xmldask.datasets import make_synthetic

    rows = []
    cache = Path(args.cache or tempfile.mkdtemp(prefix="gradfac-ooc-"))
    for n in args.out_of_core:
        url = str(cache / f"synthetic-{n}.zarr")
        if not Path(url).exists():
            make_synthetic(url, n_samples=n, n_features=args.ooc_features, n_labels=args.ooc_classes, multiclass=True,
                           avg_features=args.ooc_features / 2, seed=args.seed, block_rows=args.ooc_block_rows)
        data = open_dataset(url)
        nnz = int(data.meta["nnz"])
        csr_bytes = nnz * (data.X.dtype.itemsize + 4) + (n + 1) * 8
        with tempfile.TemporaryDirectory(prefix="gradfac-scratch-") as scratch, dask.config.set(MEMORY_CONFIG), \
                cluster(n_workers=args.ooc_workers, threads_per_worker=1, processes=True,
                        memory_limit=args.ooc_memory_limit, dashboard_address=None) as client:
            before = client.run(_pid_and_peak_rss)
            start = time.perf_counter()
            model = GradFac(rounds=args.ooc_rounds, backend="dask", scratch=scratch, random_state=args.seed)
            model.fit(data.X, data.Y)
            seconds = time.perf_counter() - start
            after = client.run(_pid_and_peak_rss)
            limit = min(w["memory_limit"] for w in client.scheduler_info(n_workers=-1)["workers"].values())
        restarts = len(set(before) ^ set(after)) + sum(before[a][0] != after[a][0] for a in set(before) & set(after))
        rows.append({"n_samples": n, "nnz": nnz, "csr_bytes": csr_bytes, "n_workers": args.ooc_workers,
                     "worker_memory_limit_bytes": limit,
                     "csr_over_total_limit": csr_bytes / (limit * args.ooc_workers),
                     "rounds": model.rounds_, "passes": model.n_passes_, "seconds": seconds,
                     "seconds_per_pass_per_m_rows": seconds / model.n_passes_ / (n / 1e6),
                     "peak_rss_bytes_per_worker": max(peak for _, peak in after.values()),
                     "worker_restarts": restarts,
                     "held_out_accuracy": model.history_[-1]["val_accuracy"]})
        print(f"out of core n={n}: {seconds:.1f} s, peak {rows[-1]['peak_rss_bytes_per_worker'] / 2**20:.0f} MiB",
              file=sys.stderr, flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--datasets", nargs="+", default=list(PAPER), choices=[*PAPER, "none"])
    parser.add_argument("--methods", nargs="+", default=list(MODELS), choices=[*MODELS, *PEERS])
    parser.add_argument("--folds", type=int, default=10, help="folds of the cross-validation (default 10)")
    parser.add_argument("--run-folds", type=int, default=None, metavar="N",
                        help="run only the first N folds (default: all)")
    parser.add_argument("--max-budget", type=int, default=None, metavar="TREES",
                        help="only the paper's budgets up to this many trees (default: all)")
    parser.add_argument("--learning-rate", type=float, default=0.3, help="xmldask's methods' (default 0.3)")
    parser.add_argument("--peer-learning-rate", type=float, default=None,
                        help="LightGBM's and CatBoost's (default: their own defaults, 0.1 and automatic; LightGBM's "
                             "multiclass diverged at 0.3 on letter)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--aloi", action="store_true", help="also GradFac vs MLL on ALOI at equal wall-clock time")
    parser.add_argument("--aloi-mll-rounds", type=int, default=2, help="MLL rounds on ALOI (1000 trees each)")
    parser.add_argument("--aloi-gf-rounds", type=int, default=2000, help="GradFac rounds on ALOI at most")
    parser.add_argument("--out-of-core", nargs="+", type=int, default=[], metavar="N",
                        help="also fit GradFac on synthetic stores of these sizes on a memory-limited cluster")
    parser.add_argument("--ooc-features", type=int, default=64, help="out of core: features (default 64)")
    parser.add_argument("--ooc-classes", type=int, default=20, help="out of core: classes (default 20)")
    parser.add_argument("--ooc-rounds", type=int, default=5, help="out of core: rounds (default 5)")
    parser.add_argument("--ooc-workers", type=int, default=2, help="out of core: worker processes (default 2)")
    parser.add_argument("--ooc-memory-limit", default="400MiB", help="out of core: per worker (default 400MiB)")
    parser.add_argument("--ooc-block-rows", type=int, default=65_536, help="out of core: rows per block")
    parser.add_argument("--cache", default=None, metavar="DIR", help="out of core: where the stores are kept")
    parser.add_argument("--json", default=None, metavar="FILE", help="also write the rows as JSON")
    parser.add_argument("--quick", action="store_true", help="smoke test: wine, 2 folds, small budget")
    args = parser.parse_args()
    if args.quick:
        args.datasets, args.run_folds = ["wine"], args.run_folds or 2
    if args.datasets == ["none"]:
        args.datasets = []
    rows = table2(args) if args.datasets else []
    keys = ["dataset", "n", "K", "budget_trees", "method", "folds", "micro_f1", "sd", "paper_micro_f1", "paper_sd",
            "delta_vs_paper", "fit_seconds", "round_ms_per_1k_rows"]
    print(markdown_table(rows, keys))
    if args.aloi:
        extra = aloi(args)
        print()
        print(markdown_table(extra, ["dataset", "n", "K", "method", "rounds", "budget_trees", "micro_f1",
                                     "fit_seconds", "round_ms_per_1k_rows"]))
        rows += extra
    if args.out_of_core:
        extra = out_of_core(args)
        print()
        print(markdown_table(extra, ["n_samples", "nnz", "csr_bytes", "csr_over_total_limit", "n_workers",
                                     "worker_memory_limit_bytes", "rounds", "passes", "seconds",
                                     "seconds_per_pass_per_m_rows", "peak_rss_bytes_per_worker", "worker_restarts",
                                     "held_out_accuracy"]))
        rows += extra
    write_json(args.json, rows)


if __name__ == "__main__":  # worker processes are spawned: this guard keeps them from running the bench
    main()
