"""LEML (Yu, Jain, Kar, Dhillon, ICML 2014) out of core against the paper's Tables 2 and 4.

Sections (``--only``, comma-separated; default ``table2,table4``):

- ``table2``: full labels, bibtex and delicious, ``k / L`` = 20 / 40 / 60 % (``k = round(ratio * L)``),
  the squared, logistic and squared-hinge losses (``--losses``; ``--datasets``): top-3 accuracy
  (= P@3) and average AUC on the test split beside the paper's figures.
- ``table4``: bibtex with 20 % of the ``n x L`` training entries observed (``xmldask.missing.mask_dataset``,
  seed ``--mask-seed``), squared loss, ``k = round(0.4 L)``: top-3, Hamming loss (threshold 0: the
  model is trained on +-1 entries) and AUC, LEML against binary relevance (one ridge per label on its
  observed entries).
- ``synthetic``: LEML (full-label squared loss) on a synthetic store larger than the workers' total
  memory limit, on a ``LocalCluster`` (``--workers`` x 1 thread, ``--memory-limit`` each): seconds,
  passes and the peak RSS of each worker.

``lam`` and the row normalisation are chosen on held-out training rows: a seeded random 20 % of the
training rows is written to a validation store; for each normalisation of ``--normalizations``
(``none``, ``l2``: ``xmldask ingest --normalize``, the constant feature set after it), every ``lam`` of
``--lams`` (decades) is fitted on the other 80 % and scored by held-out P@3 (on the observed relevant
labels when labels are missing); a winner at an end of the grid extends it by a factor of ten while
the held-out P@3 improves (at most ``MAX_EXTENSIONS`` steps, like ``HeldOutSearch``), then the
winner's two neighbours a factor ``sqrt(10)`` away are tried; the best (normalisation, ``lam``) is
refitted on all training rows. Nothing is tuned on the test split. Rows get a constant feature
(``--bias``, default 1: the intercept of LIBLINEAR's ``-B 1``, an ingest option), which every label
needs for its base rate: most entries are irrelevant (-1 in the +-1 encoding). Rows report seconds and passes
of the final fit and the peak RSS of this process (``table2``/``table4`` run on Dask's threaded
scheduler in this process, so it is the peak of the one worker).

Datasets are ingested into a temporary directory (``--workdir``), never into the repository.

    python bench/leml.py [--only table2,table4,synthetic] [--datasets bibtex,delicious]
                         [--losses squared,logistic,sqhinge] [--ratios 0.2,0.4,0.6] [--lams 1,10,100,1000]
                         [--normalizations none,l2] [--n-iter 5] [--json FILE] [--workdir DIR]
"""

from __future__ import annotations

import argparse
import os
import resource
import tempfile
import time
from pathlib import Path

import numpy as np
from _tables import markdown_table, write_json

SHARED = Path(os.environ.get("XMLDASK_SHARED_DATA", Path(__file__).resolve().parents[2] / "shared" / "data"))

#: the paper's Table 2 (top-3 accuracy %, average AUC) by (dataset, k/L, loss)
PAPER_T2 = {
    ("bibtex", 0.2): {"squared": (34.16, 0.8910), "logistic": (25.65, 0.8677), "sqhinge": (27.37, 0.8541)},
    ("bibtex", 0.4): {"squared": (36.53, 0.9015), "logistic": (28.20, 0.8809), "sqhinge": (24.81, 0.8467)},
    ("bibtex", 0.6): {"squared": (38.00, 0.9040), "logistic": (28.68, 0.8861), "sqhinge": (23.26, 0.8505)},
    ("delicious", 0.2): {"squared": (61.20, 0.8854), "logistic": (53.68, 0.8588), "sqhinge": (57.27, 0.8894)},
    ("delicious", 0.4): {"squared": (61.23, 0.8827), "logistic": (49.13, 0.8534), "sqhinge": (52.95, 0.8868)},
    ("delicious", 0.6): {"squared": (61.15, 0.8814), "logistic": (46.76, 0.8517), "sqhinge": (49.58, 0.8852)},
}
#: the paper's Table 4, bibtex: (top-3 %, Hamming loss, average AUC)
PAPER_T4 = {"LEML": (28.50, 0.0136, 0.8332), "BR": (25.78, 0.0193, 0.8087)}

HOLDOUT_FRACTION = 0.2
#: most factor-of-ten steps past a winning end of the lam grid
MAX_EXTENSIONS = 2
GRID_STEP = 10.0
#: after the decades, the winner's two neighbours this factor away are tried (coarse to fine)
FINE_STEP = 10.0 ** 0.5


def _peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _ingest(name: str, workdir: Path, bias: float | None, normalize: str = "none"):
    """``(train, test)`` stores of a shared dataset, rows normalised at ingest (the bias set after)."""
    from xmldask.io import ingest

    out = {}
    for split in ("train", "test"):
        url = workdir / f"{name}_{normalize}_{split}.zarr"
        out[split] = ingest(str(SHARED / name / f"{split}.txt.gz"), str(url), block_rows=2048, progress=False,
                            overwrite=True, bias=bias, normalize=normalize)
    return out["train"], out["test"]


def _ingest_all(name: str, workdir: Path, bias: float | None, normalizations) -> dict:
    """``{normalize: (train, test)}`` for every normalisation to choose from."""
    return {normalize: _ingest(name, workdir, bias, normalize) for normalize in normalizations}


def _split(ds, workdir: Path, seed: int = 0):
    """Write a seeded random 80 / 20 split of a dataset's rows (and mask) to two stores."""
    from xmldask.store import DatasetWriter, open_dataset, to_scipy

    X, Y = to_scipy(ds.X), to_scipy(ds.Y)
    O = to_scipy(ds.observed) if ds.observed is not None else None
    held = np.random.default_rng(seed).random(X.shape[0]) < HOLDOUT_FRACTION
    urls = []
    for part, rows in (("fit", ~held), ("val", held)):
        url = str(workdir / f"{Path(ds.url).stem}_{part}_{seed}.zarr")
        with DatasetWriter.create(url, block_rows=2048, overwrite=True, observed=O is not None) as w:
            w.write(X[rows], Y[rows], **({"observed": O[rows]} if O is not None else {}))
            w.commit(n_features=ds.n_features, n_labels=ds.n_labels)
        urls.append(url)
    return open_dataset(urls[0]), open_dataset(urls[1])


def _scores(model, ds, *, full: bool = True) -> dict:
    import dask

    from xmldask import metrics

    labels, scores = model.predict_topk(ds.X, k=3)
    if not full:
        labels, = dask.compute(labels)
        return {"P@3": metrics.evaluate(ds.Y, labels, ks=(3,))["P@3"]}
    r = metrics.evaluate(ds.Y, labels, scores, ks=(1, 3), scores_full=model.decision_function(ds.X),
                         threshold=float(model.threshold_))
    return {"P@1": r["P@1"], "P@3": r["P@3"], "avg_AUC": r["avg_AUC"], "hamming_loss": r["hamming_loss"]}


def _held_out_by_lam(make, fit, val, lams: list[float]) -> dict[float, float]:
    """Held-out P@3 by ``lam``: the decades of ``lams``, extended past a winning end (at most
    :data:`MAX_EXTENSIONS` steps), then the winner's neighbours :data:`FINE_STEP` away."""
    scores = {}

    def score(lam):
        lam = float(f"{lam:.6g}")
        if lam not in scores:
            model = make(lam).fit(fit.X, fit.Y, fit.observed)
            scores[lam] = round(_scores(model, val, full=False)["P@3"], 4)
        return scores[lam]

    for lam in lams:
        score(lam)
    for _ in range(MAX_EXTENSIONS):
        best = max(scores, key=scores.get)
        if best not in (min(scores), max(scores)) or len(scores) < 2:
            break
        nxt = best * GRID_STEP if best == max(scores) else best / GRID_STEP
        if score(nxt) <= scores[best]:
            break
    best = max(scores, key=scores.get)
    score(best / FINE_STEP)
    score(best * FINE_STEP)
    return scores


def _choose(make, trains: dict, workdir: Path, lams: list[float]) -> tuple[str, float, dict]:
    """``(normalize, lam)`` with the best held-out P@3, and every score tried, by normalisation."""
    tried = {normalize: _held_out_by_lam(make, *_split(train, workdir), lams) for normalize, train in trains.items()}
    normalize, lam = max(((nz, lam) for nz in tried for lam in tried[nz]), key=lambda t: tried[t[0]][t[1]])
    return normalize, lam, {nz: sorted(scores.items()) for nz, scores in tried.items()}


def _final(make, lam, train, test) -> tuple[object, dict]:
    start = time.perf_counter()
    model = make(lam).fit(train.X, train.Y, train.observed)
    seconds = time.perf_counter() - start
    return model, {"lam": lam, "seconds": round(seconds, 1), "passes": int(model.n_passes_), **_scores(model, test),
                   "peak_rss_mb": round(_peak_rss_mb(), 1)}


def bench_table2(workdir: Path, datasets, losses, ratios, lams, n_iter: int, bias: float | None,
                 normalizations) -> list[dict]:
    from xmldask.models import LEML

    rows = []
    for name in datasets:
        stores = _ingest_all(name, workdir, bias, normalizations)
        L = next(iter(stores.values()))[0].n_labels
        for ratio in ratios:
            k = int(round(ratio * L))
            for loss in losses:
                def make(lam, k=k, loss=loss):
                    return LEML(n_components=k, loss=loss, lam=lam, n_iter=n_iter, random_state=0)

                normalize, lam, tried = _choose(make, {nz: tt[0] for nz, tt in stores.items()}, workdir, lams)
                model, row = _final(make, lam, *stores[normalize])
                p3, auc = PAPER_T2[(name, ratio)][loss]
                row = {"dataset": name, "k/L": ratio, "k": k, "loss": loss, "normalize": normalize,
                       "top3": round(100 * row["P@3"], 2), "paper_top3": p3, "AUC": round(row["avg_AUC"], 4),
                       "paper_AUC": auc, **row, "solver": model.solver_, "held_out_P@3_by_lam": tried}
                print(markdown_table([row], T2_KEYS), flush=True)
                rows.append(row)
    return rows


def bench_table4(workdir: Path, lams, n_iter: int, mask_seed: int, bias: float | None,
                 normalizations) -> list[dict]:
    from xmldask.missing import mask_dataset
    from xmldask.models import LEML, BinaryRelevance
    from xmldask.store import open_dataset

    stores = {}
    for normalize, (full, test) in _ingest_all("bibtex", workdir, bias, normalizations).items():
        url = str(workdir / f"bibtex_{normalize}_train_obs20.zarr")
        # the same seed and row blocks: the same entries observed for every normalisation
        info = mask_dataset(full.url, url, observed=0.2, seed=mask_seed, overwrite=True)
        stores[normalize] = (open_dataset(url), test)
    k = int(round(0.4 * full.n_labels))
    methods = {
        "LEML": lambda lam: LEML(n_components=k, loss="squared", lam=lam, n_iter=n_iter, random_state=0),
        "BR": lambda lam: BinaryRelevance(loss="squared", lam=lam),
    }
    rows = []
    for method, make in methods.items():
        normalize, lam, tried = _choose(make, {nz: tt[0] for nz, tt in stores.items()}, workdir, lams)
        rows.append(_table4_row(method, make, normalize, lam, stores, k, info, mask_seed, tried))
    return rows


def _table4_row(method, make, normalize, lam, stores, k, info, mask_seed, tried) -> dict:
    _, row = _final(make, lam, *stores[normalize])
    train = stores[normalize][0]
    p3, ham, auc = PAPER_T4[method]
    row = {"method": method, "k": k if method == "LEML" else train.n_labels, "normalize": normalize,
           "observed_fraction": round(info["observed_fraction"], 4), "mask_seed": mask_seed,
           "top3": round(100 * row["P@3"], 2), "paper_top3": p3, "hamming": round(row["hamming_loss"], 4),
           "paper_hamming": ham, "AUC": round(row["avg_AUC"], 4), "paper_AUC": auc, **row,
           "held_out_P@3_by_lam": tried}
    print(markdown_table([row], T4_KEYS), flush=True)
    return row


def _worker_peak_mb() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    return _peak_rss_mb()


def bench_synthetic(workdir: Path, n_rows: int, workers: int, memory_limit: str, k: int) -> list[dict]:
    from distributed import Client, LocalCluster

    from xmldask.datasets import make_synthetic
    from xmldask.models import LEML

    url = str(workdir / "synthetic.zarr")
    start = time.perf_counter()
    ds = make_synthetic(url, n_samples=n_rows, n_features=1000, n_labels=1000, seed=0, progress=False)
    generated = time.perf_counter() - start
    csr_mb = ((ds.meta["nnz"] + ds.meta["nnz_labels"]) * 8 + 2 * (ds.n_samples + 1) * 8) / 2**20
    with LocalCluster(n_workers=workers, threads_per_worker=1, memory_limit=memory_limit,
                      dashboard_address=None) as cluster, Client(cluster) as client:
        start = time.perf_counter()
        # the solver that makes a pass per CG step (the memory to keep flat); solver="auto" would take the
        # one-pass Gram shortcut on these 1,000 features
        model = LEML(n_components=k, loss="squared", lam=1.0, n_iter=2, max_cg_iter=5, solver="passes",
                     random_state=0).fit(ds.X, ds.Y)
        seconds = time.perf_counter() - start
        peaks = client.run(_worker_peak_mb)
        limit = cluster.workers[next(iter(cluster.workers))].memory_manager.memory_limit / 2**20
    return [{"dataset": "synthetic", "n_samples": ds.n_samples, "n_features": ds.n_features, "n_labels": ds.n_labels,
             "k": k, "csr_mb": round(csr_mb, 1), "workers_total_memory_limit_mb": round(workers * limit, 1),
             "seconds": round(seconds, 1), "passes": int(model.n_passes_),
             "peak_rss_mb_per_worker": round(max(peaks.values()), 1), "generate_seconds": round(generated, 1),
             "J_after_H": [round(float(h["J_after_H"]), 1) for h in model.history_]}]


T2_KEYS = ["dataset", "k/L", "k", "loss", "normalize", "lam", "top3", "paper_top3", "AUC", "paper_AUC", "seconds",
           "passes", "solver", "peak_rss_mb"]
T4_KEYS = ["method", "k", "normalize", "lam", "top3", "paper_top3", "hamming", "paper_hamming", "AUC", "paper_AUC",
           "seconds", "passes", "peak_rss_mb"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", default="table2,table4")
    parser.add_argument("--datasets", default="bibtex,delicious")
    parser.add_argument("--losses", default="squared,logistic,sqhinge")
    parser.add_argument("--ratios", default="0.2,0.4,0.6")
    parser.add_argument("--lams", default="1,10,100,1000", help="lam grid (decades) for the held-out choice")
    parser.add_argument("--normalizations", default="none,l2",
                        help="row normalisations (ingest --normalize) for the held-out choice")
    parser.add_argument("--n-iter", type=int, default=5, help="alternations (the paper reports 5)")
    parser.add_argument("--mask-seed", type=int, default=0)
    parser.add_argument("--bias", type=float, default=1.0, help="constant feature appended to every row (0: none)")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--memory-limit", default="1GiB")
    parser.add_argument("--synthetic-rows", type=int, default=4_000_000)
    parser.add_argument("--synthetic-k", type=int, default=32)
    parser.add_argument("--workdir", default=None)
    parser.add_argument("--json", default=None, metavar="FILE")
    args = parser.parse_args()
    sections = [s.strip() for s in args.only.split(",") if s.strip()]
    lams = [float(v) for v in args.lams.split(",")]
    normalizations = [v.strip() for v in args.normalizations.split(",") if v.strip()]
    rows: list[dict] = []
    with tempfile.TemporaryDirectory(dir=args.workdir) as tmp:
        tmp = Path(tmp)
        if "table2" in sections:
            print("## Table 2: full labels (top-3 = P@3 in %, average AUC)\n", flush=True)
            got = bench_table2(tmp, args.datasets.split(","), args.losses.split(","),
                               [float(r) for r in args.ratios.split(",")], lams, args.n_iter, args.bias or None,
                               normalizations)
            print("\n" + markdown_table(got, T2_KEYS) + "\n")
            rows += got
        if "table4" in sections:
            print("## Table 4: bibtex, 20% of the entries observed, squared loss, k = 0.4 L\n", flush=True)
            got = bench_table4(tmp, lams, args.n_iter, args.mask_seed, args.bias or None, normalizations)
            print("\n" + markdown_table(got, T4_KEYS) + "\n")
            rows += got
        if "synthetic" in sections:
            got = bench_synthetic(tmp, args.synthetic_rows, args.workers, args.memory_limit, args.synthetic_k)
            print(f"## Synthetic, larger than the workers' memory ({args.workers} x {args.memory_limit})\n")
            print(markdown_table(got, list(got[0])) + "\n")
            rows += got
    write_json(args.json, rows)


if __name__ == "__main__":
    main()
