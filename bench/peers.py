"""xmldask against its peers on the real datasets: Omikuji (Parabel- and Bonsai-like), napkinXC PLT, PECOS XR-Linear.

Every system trains on the same train file and predicts the top ``--top-k`` labels of every row of the
same test file, each in a fresh subprocess that reports its train seconds, predict seconds (rows/s),
peak RSS (``VmHWM`` of the process, which is a true peak; for xmldask the client process plus its
local Dask worker processes) and model size on disk, and writes ``labels.npy`` / ``scores.npy``
(best first). This process then scores every system with the same code,
:func:`xmldask.metrics.evaluate`, propensities from the training label counts (``A = 0.55``,
``B = 1.5``), and prints one Markdown table per dataset with each system's ratio to xmldask.

Systems:

- ``xmldask-default``: what a new user runs, ``xmldask train TRAIN --out MODEL`` with no option
  (``xmldask.jobs.train`` with no parameters: its own default held-out search, ``search="auto"``).
- ``xmldask-chosen``: one fit of the setting ``xmldask-default`` chose in the same run (its ``params``), without the
  search (``search=None``), with the ensemble members the default kept (``n_estimators``: the members it added
  that paid on held-out rows, 1 when none did): what the model the defaults pick costs on its own, to tell the
  search's share of the default's time from the model's. Needs ``xmldask-default`` before it; the
  default's row then gets ``train s / chosen``, its time over this one fit.
- ``xmldask-budget``: ``xmldask train TRAIN --out MODEL --time-budget B`` with ``B`` = ``--budget-factor`` (default
  3) times the fastest peer's train seconds in the same run: the best model that time buys. Needs a peer before it
  (it is listed last); its row gets ``train s / budget``.
- ``xmldask``: the text files are ingested into stores once (``xmldask.io.ingest``, no row transform;
  reused from ``storage/bench/peers/DATASET``), then ``xmldask.jobs.train`` (Rembrandt embedding) on
  the default local cluster and ``xmldask.jobs.predict``. The parameters are chosen by
  :class:`xmldask.model_selection.HeldOutSearch` on the held-out slice of the TRAINING rows that the
  classifier already keeps for early stopping, one parameter at a time (``--xmldask-search``, default
  ``features=raw,tfidf alpha=0.001,0.03,1 k=50,150,400 kernel=none,gaussian bandwidth_scale=1,4``:
  the input rows (raw or tf-idf, the idf from the training rows, part of the model), then the ridge
  of ``W`` with the linear decoder at ``k = 50``, then ``k``, then the feature map with the Gaussian
  kernel's bandwidth searched along with it; a grid of ``alpha`` or ``k`` whose best value is at its
  end is extended by up to two geometric steps while the held-out score improves, ``k`` at most the
  number of labels), the same rule for every dataset; then ``--xmldask-estimators`` (default 3)
  models with the chosen parameters and different seeds, each holding out its own rows, predict
  the mean of their probabilities (``xmldask.models.EnsembleClassifier``; member 0 is the searched
  model). The train seconds include every fit of the search and of the ensemble. The test split is
  never looked at before the predictions.
- ``omikuji-parabel``: ``omikuji.Model.default_hyper_param()`` (3 trees, balanced 2-means, max depth
  20, linear classifiers); ``omikuji-bonsai``: the same with ``cluster_k = 100`` and
  ``max_depth = 3``. Omikuji reads the (un-gzipped, temporary) XC text file itself, so its train
  seconds include parsing the text; it L2-normalises the rows itself.
- ``napkinxc-plt``: ``napkinxc.models.PLT`` with its defaults (rows L2-normalised by napkinXC) on
  the CSR matrices read from the stores.
- ``pecos-xrlinear``: PECOS XR-Linear (``LabelEmbeddingFactory`` PIFA + ``Indexer.gen`` hierarchical
  k-means + ``XLinearModel.train`` defaults) on L2-normalised CSR matrices saved as ``.npz``. libpecos
  1.2.8 needs numpy < 2 and scipy < 1.14, so it runs in its own virtual environment
  (``--pecos-venv``, default ``storage/bench/pecos-venv``) with ``bench/_pecos_child.py``; the venv is
  created on first use (``python3 -m venv``, then ``pip install torch==2.13.0 "numpy<2" "scipy<1.14"``
  and ``libpecos==1.2.8`` under the same pins) and reused afterwards. If it cannot be created, PECOS
  is skipped with a message.

``--aloi-table`` instead prints the Rembrandt paper's ALOI table: the embedding classifier with the
Rembrandt, PCA and compressed-sensing embeddings at ``k = 50`` and the identity feature map (the
paper's "+ LR": logistic regression on the embedded features), test error next to the paper's.

Usage::

    python bench/peers.py --quick                                   # yeast and bibtex
    python bench/peers.py --datasets delicious,lshtc1 --systems xmldask,napkinxc-plt
    python bench/peers.py --json bench/results/peers.json           # all five datasets
    python bench/peers.py --aloi-table

Datasets are read from ``$XMLDASK_SHARED_DATA`` (default ``../shared/data`` beside the repository);
nothing is copied into the repository.
"""

from __future__ import annotations

import argparse
import gzip
import json
import math
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _tables import load_line, main_or_child, run_child, write_json

ROOT = Path(__file__).resolve().parents[1]
DATA = Path(os.environ.get("XMLDASK_SHARED_DATA", ROOT.parent / "shared" / "data"))
DATASETS = ("yeast", "bibtex", "delicious", "lshtc1-dryrun-task2", "aloi")
ALIASES = {"lshtc1": "lshtc1-dryrun-task2", "lshtc1-dryrun": "lshtc1-dryrun-task2"}
QUICK = ("yeast", "bibtex")
SYSTEMS = ("xmldask", "xmldask-default", "xmldask-chosen", "omikuji-parabel", "omikuji-bonsai", "napkinxc-plt",
           "pecos-xrlinear", "xmldask-budget")
#: xmldask's held-out search (coordinate-wise, in this order; the same for every dataset)
SEARCH = ("features=raw,tfidf", "alpha=0.001,0.03,1", "k=50,150,400", "kernel=none,gaussian", "bandwidth_scale=1,4")
#: members of xmldask's ensemble (EnsembleClassifier): Omikuji grows 3 trees by default
ESTIMATORS = 3
PECOS_CHILD = Path(__file__).resolve().parent / "_pecos_child.py"
PECOS_PINS = ("torch==2.13.0", "numpy<2", "scipy<1.14")
#: best peer figures measured on the 2-core machine these benches were written on (P@1 %; ALOI: top-1 accuracy)
REFERENCE = {"aloi": "84.0 (Omikuji Bonsai-like)", "bibtex": "64.3", "delicious": "68.8",
             "lshtc1-dryrun-task2": "31.9", "yeast": "76.0"}
#: test error % of the Rembrandt paper (Mineiro and Karampatziakis 2015) on ALOI, k = 50
PAPER_ALOI = {"rembrandt": ("RE + LR", 9.7), "pca": ("PCA + LR", 9.7), "cs": ("CS + LR", 10.8)}


def _pid_and_peak_rss_mb() -> tuple[int, float]:
    return os.getpid(), _peak_rss_mb()


def _peak_rss_mb() -> float:
    """Peak RSS of this process in MiB: ``VmHWM`` (``ru_maxrss`` would include the parent's)."""
    try:
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) for line in f if line.startswith("VmHWM:")) / 1024
    except (OSError, StopIteration):
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _size_bytes(path: str | Path) -> int:
    path = Path(path)
    if path.is_file():
        return path.stat().st_size
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def _write_topk(out: Path, rows, k: int) -> None:
    """``rows``: per test row, (label, score) pairs; saved sorted best first, ``-1`` / ``-inf`` padded."""
    import numpy as np

    labels = np.full((len(rows), k), -1, dtype=np.int32)
    scores = np.full((len(rows), k), -np.inf, dtype=np.float32)
    for i, row in enumerate(rows):
        row = sorted(row, key=lambda p: -p[1])[:k]
        for r, (label, score) in enumerate(row):
            labels[i, r], scores[i, r] = label, score
    np.save(out / "labels.npy", labels)
    np.save(out / "scores.npy", scores)


# --------------------------------------------------------------------------------------------- children


def _child_xmldask(spec: dict, out: Path) -> dict:
    import numpy as np

    from xmldask import jobs
    from xmldask.cluster import cluster
    from xmldask.params import current_names
    from xmldask.store import open_dataset, open_predictions

    if spec["system"] == "xmldask-default":  # what `xmldask train TRAIN --out MODEL` does, no option given
        params = {}
    elif spec["system"] == "xmldask-chosen":  # the default's chosen setting alone: no search, its members
        params = {**spec["chosen"], "search": None, "n_estimators": spec["chosen"].get("n_estimators", 1)}
    elif spec["system"] == "xmldask-budget":  # the defaults with a deadline
        params = {"time_budget": spec["budget"]}
    else:
        n_labels = open_dataset(spec["train_url"]).n_labels
        search = {name: sorted({min(v, n_labels) for v in values}) if name == "n_components" else values
                  for name, values in current_names(spec.get("search") or {}).items()}
        search = {name: values for name, values in search.items() if len(values) > 1}
        params = {"embedding": spec.get("embedding", "rembrandt"),
                  "n_components": min(spec.get("n_components", 50), n_labels),
                  "kernel": spec.get("kernel", "none"), "random_state": 0, "search": search or None,
                  "n_estimators": spec.get("n_estimators", 1),
                  "search_screen": False}  # every candidate in full, as when the benchmark page's figures were measured
        for name, values in search.items():  # the search starts from the first value of each
            params[name] = values[0]
    model_url = str(out / "model.zarr")
    # as `xmldask train` starts it: threads of this process for a dataset this small
    with cluster(dashboard_address=None, data_bytes=open_dataset(spec["train_url"]).nbytes) as client:
        start = time.perf_counter()
        info = jobs.train(spec["train_url"], model_url, **params)
        train_s = time.perf_counter() - start
        start = time.perf_counter()
        jobs.predict(model_url, spec["test_url"], str(out / "pred.zarr"), top_k=spec["top_k"])
        preds = open_predictions(str(out / "pred.zarr"))
        labels, scores = preds.labels.compute(), preds.scores.compute()
        predict_s = time.perf_counter() - start
        workers = client.run(_pid_and_peak_rss_mb)
    np.save(out / "labels.npy", labels)
    np.save(out / "scores.npy", scores)
    chosen = ", ".join(f"{name}={value}" for name, value in info["params"].items() if name != "random_state")
    tried = "; ".join(f"{_short(r['params'])}: {100 * r['val_p@1']:.1f}" for r in info.get("search", []))
    processes = {os.getpid(): _peak_rss_mb(), **dict(workers.values())}  # in-process workers counted once
    return {"train_s": train_s, "predict_s": predict_s, "peak_rss_mb": sum(processes.values()),
            "model_bytes": _size_bytes(model_url), "n_test": int(labels.shape[0]),
            "settings": chosen + (f" (held-out P@1 on train, {len(info['search'])} fits: {tried})" if tried else ""),
            "search": info.get("search"), "params": info["params"]}


def _short(params: dict) -> str:
    return ",".join(f"{name}={value}" for name, value in params.items())


def _child_omikuji(spec: dict, out: Path) -> dict:
    import omikuji

    from xmldask.store import open_dataset
    from xmldask.store.csr import to_scipy

    hp = omikuji.Model.default_hyper_param()
    settings = "default_hyper_param() (n_trees=3, cluster_k=2, max_depth=20)"
    if spec["system"] == "omikuji-bonsai":
        hp.cluster_k, hp.max_depth = 100, 3
        settings = "default_hyper_param() with cluster_k=100, max_depth=3"
    with tempfile.TemporaryDirectory(prefix="peers-omikuji-", dir=out) as tmp:
        text = Path(tmp) / "train.txt"
        with gzip.open(spec["train_gz"], "rb") as src, open(text, "wb") as dst:
            shutil.copyfileobj(src, dst)
        start = time.perf_counter()
        model = omikuji.Model.train_on_data(str(text), hp, n_threads=os.cpu_count())
        train_s = time.perf_counter() - start
    model.save(str(out / "model"))
    X = to_scipy(open_dataset(spec["test_url"]).X)
    X.sort_indices()
    start = time.perf_counter()
    rows = []
    for i in range(X.shape[0]):
        s, e = X.indptr[i], X.indptr[i + 1]
        rows.append(model.predict(list(zip(X.indices[s:e].tolist(), X.data[s:e].tolist())), top_k=spec["top_k"]))
    predict_s = time.perf_counter() - start
    _write_topk(out, rows, spec["top_k"])
    return {"train_s": train_s, "predict_s": predict_s, "peak_rss_mb": _peak_rss_mb(),
            "model_bytes": _size_bytes(out / "model"), "n_test": X.shape[0], "settings": settings}


def _child_napkinxc(spec: dict, out: Path) -> dict:
    from napkinxc.models import PLT

    from xmldask.store import open_dataset
    from xmldask.store.csr import to_scipy

    train, test = open_dataset(spec["train_url"]), open_dataset(spec["test_url"])
    X, Y = to_scipy(train.X), to_scipy(train.Y)
    Xt = to_scipy(test.X)
    model = PLT(str(out / "model"), seed=0, threads=0)
    start = time.perf_counter()
    model.fit(X, Y)
    train_s = time.perf_counter() - start
    del X, Y
    start = time.perf_counter()
    rows = model.predict_proba(Xt, top_k=spec["top_k"])
    predict_s = time.perf_counter() - start
    _write_topk(out, rows, spec["top_k"])
    return {"train_s": train_s, "predict_s": predict_s, "peak_rss_mb": _peak_rss_mb(),
            "model_bytes": _size_bytes(out / "model"), "n_test": Xt.shape[0],
            "settings": "PLT defaults (hierarchical k-means arity 2, max_leaves 100, liblinear log loss)"}


CHILDREN = {"xmldask": _child_xmldask, "xmldask-default": _child_xmldask, "xmldask-chosen": _child_xmldask,
            "xmldask-budget": _child_xmldask,
            "omikuji-parabel": _child_omikuji,
            "omikuji-bonsai": _child_omikuji, "napkinxc-plt": _child_napkinxc}


def child(spec: dict) -> None:
    """Run one system in this fresh process; print its figures as JSON on the last line."""
    import logging

    if spec["system"].startswith("xmldask"):  # first, as `xmldask train` imports it: before NumPy loads OpenBLAS
        import xmldask  # noqa: F401
    logging.basicConfig(level=logging.WARNING)
    out = Path(spec["out"])
    out.mkdir(parents=True, exist_ok=True)
    print(json.dumps(CHILDREN[spec["system"]](spec, out)))


# --------------------------------------------------------------------------------------------- parent


def dataset_dir(name: str) -> Path:
    return DATA / ALIASES.get(name, name)


def prepare(name: str, work: Path) -> dict:
    """Train/test stores of dataset ``name`` under ``work`` (ingested once, reused)."""
    from xmldask.io import ingest
    from xmldask.store import open_dataset

    src = dataset_dir(name)
    train_gz, test_gz = src / "train.txt.gz", src / "test.txt.gz"
    work.mkdir(parents=True, exist_ok=True)
    urls = {"train_gz": str(train_gz), "test_gz": str(test_gz), "train_url": str(work / "train.zarr"),
            "test_url": str(work / "test.zarr")}
    start, reused = time.perf_counter(), True
    try:
        train = open_dataset(urls["train_url"])
    except Exception:  # noqa: BLE001 - absent or unreadable: ingest again
        reused = False
        train = ingest(str(train_gz), urls["train_url"], overwrite=True)
    try:
        open_dataset(urls["test_url"])
    except Exception:  # noqa: BLE001
        reused = False
        ingest(str(test_gz), urls["test_url"], n_features=train.n_features, n_labels=train.n_labels, overwrite=True)
    urls["ingest_s"] = "reused" if reused else f"{time.perf_counter() - start:.2f} s"
    return urls


def _pecos_python(venv: Path) -> Path:
    return venv / "bin" / "python"


def ensure_pecos(venv: Path, timeout: float) -> tuple[Path | None, str]:
    """The Python of a virtualenv where ``import pecos`` works (created on first use), or a reason."""
    python = _pecos_python(venv)

    def works() -> bool:
        if not python.exists():
            return False
        return subprocess.run([str(python), "-c", "import pecos.xmc.xlinear"], capture_output=True).returncode == 0

    if works():
        return python, ""
    print(f"creating the PECOS virtualenv {venv} (torch==2.13.0 CPU, numpy<2, scipy<1.14, libpecos==1.2.8)",
          file=sys.stderr, flush=True)
    venv.parent.mkdir(parents=True, exist_ok=True)
    log = venv.parent / "pecos-install.log"
    constraints = venv.parent / "pecos-constraints.txt"
    constraints.write_text("\n".join(PECOS_PINS) + "\n")
    steps = [["python3", "-m", "venv", str(venv)],
             [str(python), "-m", "pip", "install", "-c", str(constraints), *PECOS_PINS],
             [str(python), "-m", "pip", "install", "-c", str(constraints), "libpecos==1.2.8"]]
    deadline = time.monotonic() + timeout
    with open(log, "a") as fh:
        for step in steps:
            if step[0] == "python3" and python.exists():
                continue
            try:
                result = subprocess.run(step, stdout=fh, stderr=subprocess.STDOUT,
                                        timeout=max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                return None, f"installing PECOS took longer than {timeout:.0f} s (log: {log})"
            if result.returncode != 0:
                return None, f"`{' '.join(step)}` failed (exit {result.returncode}; log: {log})"
    return (python, "") if works() else (None, f"libpecos installed but `import pecos` fails (log: {log})")


def _save_npz(urls: dict, work: Path) -> dict:
    """L2-normalised CSR ``.npz`` of the stores for PECOS (written once, reused)."""
    import numpy as np
    import scipy.sparse as sp

    from xmldask.store import open_dataset
    from xmldask.store.csr import to_scipy

    paths = {key: work / f"{key}.npz" for key in ("X_train", "Y_train", "X_test")}
    if not all(p.exists() for p in paths.values()):
        train, test = open_dataset(urls["train_url"]), open_dataset(urls["test_url"])
        for key, matrix in (("X_train", train.X), ("Y_train", train.Y), ("X_test", test.X)):
            M = sp.csr_matrix(to_scipy(matrix), dtype=np.float32)
            if key.startswith("X"):
                norms = np.sqrt(np.asarray(M.multiply(M).sum(axis=1)).ravel())
                M = sp.csr_matrix(sp.diags(1 / np.where(norms > 0, norms, 1)) @ M, dtype=np.float32)
            M.sort_indices()
            sp.save_npz(paths[key], M)
    return {key: str(p) for key, p in paths.items()}


def run_system(system: str, spec: dict, timeout: float, pecos_python: Path | None) -> dict:
    if system == "pecos-xrlinear":
        return run_child(str(PECOS_CHILD), spec, timeout=timeout, python=str(pecos_python), args=())
    return run_child(__file__, spec, timeout=timeout)


def score(out: Path, urls: dict, top_k: int) -> dict:
    """Every system's metrics, by the same code: xmldask.metrics.evaluate, propensities from train."""
    import numpy as np

    from xmldask import metrics
    from xmldask.store import open_dataset

    train, test = open_dataset(urls["train_url"]), open_dataset(urls["test_url"])
    labels, scores = np.load(out / "labels.npy"), np.load(out / "scores.npy")
    props = metrics.propensity(train.label_counts, train.n_samples, A=0.55, B=1.5)
    ks = tuple(k for k in (1, 3, 5) if k <= top_k)
    return metrics.evaluate(test.Y, labels, scores, ks=ks, propensities=props)


def _ratio(a, b) -> float | None:
    if a is None or b is None or not b or (isinstance(a, float) and math.isnan(a)):
        return None
    return round(a / b, 2)


def _fmt(value) -> str:
    if value is None:
        return "—"
    if isinstance(value, float):
        return f"{value:,.2f}" if abs(value) < 1e5 else f"{value:,.0f}"
    return str(value)


def print_table(name: str, rows: list[dict], meta: dict) -> None:
    keys = ["system", "P@1 %", "P@3 %", "P@5 %", "nDCG@5 %", "PSP@5 %", "train s", "predict rows/s",
            "peak RSS MB", "model MB", "P@1 / xmldask", "train s / xmldask", "rows/s / xmldask",
            "train s / fastest peer", "train s / chosen", "budget s", "train s / budget"]
    print(f"\n### {name} ({meta['n_train']:,} train, {meta['n_test']:,} test rows, {meta['n_features']:,} features, "
          f"{meta['n_labels']:,} labels; {meta['task']})\n")
    print("| " + " | ".join(keys) + " |")
    print("|" + "---|" * len(keys))
    for row in rows:
        print("| " + " | ".join(_fmt(row.get(k)) for k in keys) + " |")
    print()
    for row in rows:
        if row.get("error"):
            print(f"- {row['system']}: did not run: {row['error']}")
        else:
            print(f"- {row['system']}: {row['settings']}")
    if meta["task"] == "multiclass":
        print("- multiclass: top-1 accuracy = P@1")
    print(f"- best peer P@1 measured before on this 2-core machine: {REFERENCE.get(name, '?')} %")
    print(f"- ingest of the text files into xmldask stores (once, not in train s): {meta['ingest_s']}; "
          f"peak RSS of xmldask = client + local Dask worker processes")


def run_dataset(name: str, args, work_root: Path, pecos: tuple[Path | None, str]) -> list[dict]:
    import numpy as np

    from xmldask.store import open_dataset
    from xmldask.store.csr import to_scipy

    work = work_root / name
    urls = prepare(name, work)
    train, test = open_dataset(urls["train_url"]), open_dataset(urls["test_url"])
    counts = np.diff(to_scipy(train.Y).indptr)  # labels per training row
    meta = {"n_train": train.n_samples, "n_test": test.n_samples, "n_features": train.n_features,
            "n_labels": train.n_labels, "ingest_s": urls["ingest_s"],
            "task": "multiclass" if (counts == 1).all() else "multilabel"}
    rows, chosen = [], None
    for system in args.systems:
        out = work / system
        shutil.rmtree(out, ignore_errors=True)
        peer_times = [r["train s"] for r in rows if not r["system"].startswith("xmldask") and "error" not in r]
        budget = args.budget_factor * min(peer_times) if peer_times else None
        spec = {"system": system, "out": str(out), "top_k": args.top_k, "search": args.xmldask_search,
                "n_estimators": args.xmldask_estimators, "chosen": chosen, "budget": budget, **urls}
        missing = {"xmldask-chosen": (chosen, "xmldask-default did not run before it"),
                   "xmldask-budget": (budget, "no peer ran before it")}.get(system, (True, ""))
        if missing[0] is None:
            rows.append({"system": system, "error": missing[1]})
            print(f"{name} {system}: skipped ({missing[1]})", file=sys.stderr, flush=True)
            continue
        if system == "pecos-xrlinear":
            if pecos[0] is None:
                rows.append({"system": system, "error": f"PECOS skipped: {pecos[1]}"})
                print(f"{name} {system}: skipped ({pecos[1]})", file=sys.stderr, flush=True)
                continue
            spec.update(_save_npz(urls, work))
        print(f"{name} {system} ...", file=sys.stderr, flush=True)
        fig = run_system(system, spec, args.timeout, pecos[0])
        if "error" in fig:
            rows.append({"system": system, "error": fig["error"]})
            print(f"{name} {system} failed: {fig.get('stderr', fig['error'])}", file=sys.stderr, flush=True)
            continue
        res = score(out, urls, args.top_k)
        row = {"dataset": name, "system": system}
        for key in ("P@1", "P@3", "P@5", "nDCG@5", "PSP@5"):
            row[f"{key} %"] = round(100 * res[key], 2) if key in res else None
        row.update({"train s": round(fig["train_s"], 2), "predict rows/s": round(fig["n_test"] / fig["predict_s"], 1),
                    "peak RSS MB": round(fig["peak_rss_mb"], 1), "model MB": round(fig["model_bytes"] / 2**20, 2),
                    "settings": fig["settings"], "task": meta["task"]})
        rows.append(row)
        if system == "xmldask-default":
            chosen = fig["params"]
        if system == "xmldask-budget":
            row.update({"budget s": round(budget, 2), "train s / budget": _ratio(row["train s"], budget)})
        print(f"{name} {system}: P@1 {row['P@1 %']} %, train {row['train s']} s", file=sys.stderr, flush=True)
        if not args.keep:
            shutil.rmtree(out, ignore_errors=True)
    base = next((r for r in rows if r["system"] == "xmldask" and "error" not in r), None)
    peers = [r for r in rows if not r["system"].startswith("xmldask") and "error" not in r]
    fastest = min((r["train s"] for r in peers), default=None)
    one_fit = next((r["train s"] for r in rows if r["system"] == "xmldask-chosen" and "error" not in r), None)
    for row in rows:
        if row["system"] == "xmldask-default" and one_fit and "error" not in row:
            row["train s / chosen"] = _ratio(row["train s"], one_fit)
        if base and "error" not in row:
            row["P@1 / xmldask"] = _ratio(row["P@1 %"], base["P@1 %"])
            row["train s / xmldask"] = _ratio(row["train s"], base["train s"])
            row["rows/s / xmldask"] = _ratio(row["predict rows/s"], base["predict rows/s"])
        if fastest and "error" not in row:
            row["train s / fastest peer"] = _ratio(row["train s"], fastest)
        row.setdefault("dataset", name)
    print_table(name, rows, meta)
    return rows


def aloi_table(args, work_root: Path) -> list[dict]:
    """The Rembrandt paper's ALOI table (k = 50, identity feature map) from xmldask."""
    work = work_root / "aloi"
    urls = prepare("aloi", work)
    rows = []
    for embedding in args.aloi_embeddings.split(","):
        label, paper = PAPER_ALOI[embedding]
        out = work / f"aloi-table-{embedding}"
        shutil.rmtree(out, ignore_errors=True)
        spec = {"system": "xmldask", "out": str(out), "top_k": 1, "kernel": "none", "embedding": embedding,
                "n_components": 50, **urls}
        print(f"aloi table {embedding} ...", file=sys.stderr, flush=True)
        fig = run_system("xmldask", spec, args.timeout, None)
        if "error" in fig:
            rows.append({"table": "aloi-paper", "method": label, "error": fig["error"]})
            print(f"aloi {embedding} failed: {fig.get('stderr', fig['error'])}", file=sys.stderr, flush=True)
            continue
        res = score(out, urls, 1)
        rows.append({"table": "aloi-paper", "method": label, "test error % (xmldask)": round(100 * res["error"], 2),
                     "test error % (paper)": paper, "train s": round(fig["train_s"], 1),
                     "peak RSS MB": round(fig["peak_rss_mb"], 1), "settings": fig["settings"]})
        if not args.keep:
            shutil.rmtree(out, ignore_errors=True)
    keys = ["method", "test error % (xmldask)", "test error % (paper)", "train s", "peak RSS MB"]
    print("\n### ALOI, k = 50, identity features (the Rembrandt paper's table)\n")
    print("| " + " | ".join(keys) + " |")
    print("|" + "---|" * len(keys))
    for row in rows:
        print("| " + " | ".join(_fmt(row.get(k)) for k in keys) + " |")
    print("\n- EmbeddingClassifier(embedding=..., n_components=50, kernel='none'), other parameters default; "
          "test error = 1 - top-1 accuracy")
    for row in rows:
        if row.get("error"):
            print(f"- {row['method']}: did not run: {row['error']}")
    return rows


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--datasets", default=",".join(DATASETS),
                        help=f"comma-separated names under $XMLDASK_SHARED_DATA (default {','.join(DATASETS)}; "
                             "lshtc1 = lshtc1-dryrun-task2)")
    parser.add_argument("--systems", default=",".join(SYSTEMS), help=f"comma-separated, of {','.join(SYSTEMS)}")
    parser.add_argument("--quick", action="store_true", help="the small datasets only: " + ", ".join(QUICK))
    parser.add_argument("--top-k", type=int, default=5, help="predictions per row (default 5)")
    parser.add_argument("--xmldask-search", nargs="*", default=list(SEARCH), metavar="NAME=V1,V2",
                        help="xmldask's held-out search on the training rows, coordinate-wise in this order "
                             f"(default {' '.join(SEARCH)}; none: k=50, kernel none, defaults)")
    parser.add_argument("--xmldask-estimators", type=int, default=ESTIMATORS, metavar="N",
                        help=f"xmldask: an ensemble of N models with the searched parameters and different seeds "
                             f"(default {ESTIMATORS}, as Omikuji's 3 trees; 1: the searched model alone)")
    parser.add_argument("--budget-factor", type=float, default=3.0, metavar="X",
                        help="xmldask-budget: --time-budget of X times the fastest peer's train seconds (default 3)")
    parser.add_argument("--pecos-venv", default=str(ROOT / "storage" / "bench" / "pecos-venv"), metavar="DIR",
                        help="virtualenv with libpecos (created on first use; default storage/bench/pecos-venv)")
    parser.add_argument("--pecos-install-timeout", type=float, default=1800.0, metavar="S")
    parser.add_argument("--work", default=str(ROOT / "storage" / "bench" / "peers"), metavar="DIR",
                        help="stores, models and predictions (default storage/bench/peers)")
    parser.add_argument("--timeout", type=float, default=3600.0, help="seconds per system and dataset")
    parser.add_argument("--keep", action="store_true", help="keep the models and predictions")
    parser.add_argument("--aloi-table", action="store_true",
                        help="print the paper's ALOI table (RE / PCA / CS + LR at k = 50) instead")
    parser.add_argument("--aloi-embeddings", default=",".join(PAPER_ALOI), metavar="LIST",
                        help=f"with --aloi-table: which rows (default {','.join(PAPER_ALOI)})")
    parser.add_argument("--json", default=None, metavar="FILE", help="also write the rows as JSON")
    args = parser.parse_args(argv)
    from xmldask.model_selection import parse_grid

    args.xmldask_search = parse_grid([item for item in args.xmldask_search if item != "none"])
    names = list(QUICK) if args.quick else [ALIASES.get(n, n) for n in args.datasets.split(",") if n]
    args.systems = [s for s in args.systems.split(",") if s]
    unknown = [s for s in args.systems if s not in SYSTEMS]
    if unknown:
        parser.error(f"unknown systems {unknown}; choose from {', '.join(SYSTEMS)}")
    systems = args.systems
    if "xmldask-chosen" in systems and "xmldask-default" not in systems[:systems.index("xmldask-chosen")]:
        parser.error("xmldask-chosen fits the setting xmldask-default chose: list xmldask-default before it")
    missing = [n for n in names if not (dataset_dir(n) / "train.txt.gz").exists()]
    if missing and not args.aloi_table:
        parser.error(f"no train.txt.gz for {missing} under {DATA} (set $XMLDASK_SHARED_DATA)")
    work_root = Path(args.work)

    if args.aloi_table:
        rows = aloi_table(args, work_root)
    else:
        pecos = (None, "not requested")
        if "pecos-xrlinear" in args.systems:
            pecos = ensure_pecos(Path(args.pecos_venv), args.pecos_install_timeout)
            if pecos[0] is None:
                print(f"PECOS XR-Linear will be skipped: {pecos[1]}", file=sys.stderr, flush=True)
        rows = []
        for name in names:
            rows.extend(run_dataset(name, args, work_root, pecos))
    print("\n" + load_line())
    write_json(args.json, rows)


if __name__ == "__main__":
    main_or_child(main, child)
