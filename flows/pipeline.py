"""The xmldask pipeline as Prefect flow runs: ingest -> spectrum -> train -> predict -> evaluate -> report.

Every stage is a thin Prefect task over :mod:`xmldask.jobs` / :func:`xmldask.io.ingest`: it takes and
returns store URLs and small records, never arrays. Stage outputs are content-addressed under
``<storage>/stages/<stage>-<fingerprint>/`` (see :mod:`flows.stages`), so a re-run with the same inputs
and parameters reuses every finished stage and a changed parameter recomputes only the stages after it.
The report of each flow run goes to ``<storage>/runs/<time>-<id>/`` (``report.md``, ``metrics.json``,
``stages.json``, PNG plots) and to a Prefect Markdown artifact.

The flow owns one ``distributed.Client`` (:func:`xmldask.cluster.cluster`: a LocalCluster by default, or
the scheduler given by ``scheduler`` / ``$XMLDASK_SCHEDULER``); the tasks run in Prefect's default thread
runner and compute on that client.

Command line::

    python -m flows.pipeline                                  # synthetic data, local cluster, storage/
    python -m flows.pipeline --train ../shared/data/bibtex/train.txt.gz --test ../shared/data/bibtex/test.txt.gz
    python -m flows.pipeline --train storage/x/train.zarr --test storage/x/test.zarr --scheduler tcp://host:8786

The last line printed is the run directory.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import sys
from pathlib import Path
from typing import Annotated, Literal

from prefect import flow, get_run_logger, task
from prefect.cache_policies import NONE
from pydantic import Field

from xmldask import jobs
from xmldask.cluster import cluster
from xmldask.store import storage_root

from .stages import dataset_fingerprint, file_sha256, fingerprint, is_dataset_store, run_stage

__all__ = ["evaluate_stage", "ingest_stage", "main", "pipeline", "predict_stage", "report_stage", "spectrum_stage",
           "synthesize", "train_stage"]

PositiveInt = Annotated[int, Field(gt=0)]
Embedding = Literal["rembrandt", "cs", "plst", "pca"]
Kernel = Literal["none", "gaussian", "cauchy"]
#: the k of the evaluation (the report's P@k plot); the table shows 1, 3, 5
EVAL_KS = tuple(range(1, 11))


def _item(record: dict, name: str) -> dict:
    """``{"url", "fingerprint"}`` of one output of a stage record (the input of the next stage)."""
    return {"url": record["outputs"][name], "fingerprint": record["output_fingerprints"][name]}


# --------------------------------------------------------------------------------------------------
# stages (Prefect tasks: retries on the I/O-bound ones only)


@task(name="synthesize", retries=2, retry_delay_seconds=1, cache_policy=NONE)
def synthesize(*, storage: str | None, n_samples: int, n_features: int, n_labels: int, seed: int) -> dict[str, str]:
    """Synthetic XC text files ``train.txt.gz`` and ``test.txt.gz`` (test: n_samples / 5 rows), reused if present."""
    from xmldask.datasets import write_synthetic_text

    log = get_run_logger()
    base = Path(storage_root(storage)) / "synthetic" / f"synth-n{n_samples}-d{n_features}-l{n_labels}-seed{seed}"
    paths = {}
    for split, n in (("train", n_samples), ("test", max(1, n_samples // 5))):
        path = base / f"{split}.txt.gz"
        if not path.exists():
            log.info("generating %d synthetic %s rows into %s", n, split, path)
            write_synthetic_text(str(path), n_samples=n, n_features=n_features, n_labels=n_labels, seed=seed,
                                 split=split)
        paths[split] = str(path)
    return paths


@task(name="ingest", retries=2, retry_delay_seconds=1, cache_policy=NONE)
def ingest_stage(sources: list[str], *, split: str, storage: str | None = None, format: str = "auto",
                 one_based: bool = False, normalize: str = "none", like: dict | None = None) -> dict:
    """A dataset store from text files (ingested once per content), or an existing store as it is.

    ``like``: the record of the training data, whose dimensions the test data takes.
    """
    from xmldask.io import ingest
    from xmldask.store import open_dataset

    log = get_run_logger()
    if len(sources) == 1 and is_dataset_store(sources[0]):
        url = sources[0]
        log.info("%s: using the dataset store %s as it is", split, url)
        fp = dataset_fingerprint(url)
        return {"stage": f"ingest-{split}", "fingerprint": fp, "outputs": {"data": url},
                "output_fingerprints": {"data": fp}, "inputs": {}, "params": {}, "result": {}, "seconds": 0.0,
                "peak_rss_mb": float("nan"), "reused": True, "dir": None, "performance_report": None}
    dims = {}
    if like is not None:
        meta = open_dataset(like["outputs"]["data"]).meta
        dims = {"n_features": meta["n_features"], "n_labels": meta["n_labels"]}
    params = {"format": format, "one_based": one_based, "normalize": normalize, **dims}
    inputs = {f"source{i}": {"url": str(s), "fingerprint": file_sha256(s)} for i, s in enumerate(sources)}

    def compute(work: Path) -> dict:
        out = work / "data.zarr"
        ds = ingest([str(s) for s in sources], str(out), format=format, one_based=one_based, normalize=normalize,
                    **dims)
        return {"outputs": {"data": "data.zarr"}, "fingerprints": {"data": dataset_fingerprint(str(out))},
                "result": {k: v for k, v in ds.info().items() if isinstance(v, (int, float, str))}}

    return run_stage(f"ingest-{split}", params=params, inputs=inputs, compute=compute, storage=storage, log=log)


@task(name="spectrum", cache_policy=NONE)
def spectrum_stage(train: dict, *, storage: str | None = None, n_components: int = 50, seed: int = 0) -> dict:
    """Label statistics for the report: the spectrum of ``Y^T Y`` (Zarr, CSV, PNG) and the label-frequency plot."""
    import zarr

    from xmldask.embedding.spectrum import compute_spectrum, write_spectrum
    from xmldask.store import open_dataset

    from .report import plot_label_frequency

    data = _item(train, "data")

    def compute(work: Path) -> dict:
        spectrum = compute_spectrum(data["url"], matrix="Y", n_components=n_components, random_state=seed)
        write_spectrum(spectrum, work)
        zarr.save_array(str(work / "spectrum.zarr"), spectrum.eigenvalues)
        plot_label_frequency(open_dataset(data["url"]).label_counts, work / "label_frequency.png")
        return {"outputs": {"eigenvalues": "spectrum.zarr", "spectrum_png": "spectrum.png",
                            "label_frequency_png": "label_frequency.png"},
                "result": {"trace": float(spectrum.trace), "n_passes": spectrum.n_passes,
                           "top_eigenvalues": [float(v) for v in spectrum.eigenvalues[:10]]}}

    return run_stage("spectrum", params={"n_components": n_components, "seed": seed}, inputs={"train": data},
                     compute=compute, storage=storage, log=get_run_logger())


@task(name="train", cache_policy=NONE)
def train_stage(train: dict, *, storage: str | None = None, embedding: str = "rembrandt", k: int = 64,
                kernel: str = "gaussian", seed: int = 0, n_random_features: int = 2000, max_epochs: int = 10) -> dict:
    """Fit the embedding classifier (it fits its own label embedding) into ``model.zarr``."""
    params = {"embedding": embedding, "k": k, "kernel": kernel, "seed": seed, "n_random_features": n_random_features,
              "max_epochs": max_epochs}
    data = _item(train, "data")

    def compute(work: Path) -> dict:
        result = jobs.train(data["url"], str(work / "model.zarr"), **params)
        return {"outputs": {"model": "model.zarr"}, "result": result}

    return run_stage("train", params=params, inputs={"train": data}, compute=compute, storage=storage,
                     log=get_run_logger())


@task(name="predict", cache_policy=NONE)
def predict_stage(model: dict, test: dict, *, storage: str | None = None, top_k: int = 10) -> dict:
    """Top-``top_k`` predictions of the test rows into ``predictions.zarr``."""
    inputs = {"model": _item(model, "model"), "test": _item(test, "data")}

    def compute(work: Path) -> dict:
        result = jobs.predict(inputs["model"]["url"], inputs["test"]["url"], str(work / "predictions.zarr"),
                              top_k=top_k)
        return {"outputs": {"predictions": "predictions.zarr"}, "result": result}

    return run_stage("predict", params={"top_k": top_k}, inputs=inputs, compute=compute, storage=storage,
                     log=get_run_logger())


@task(name="evaluate", cache_policy=NONE)
def evaluate_stage(predictions: dict, test: dict, train: dict, *, storage: str | None = None) -> dict:
    """Every applicable metric at k = 1..10 (propensities from the training labels) into ``metrics.json``."""
    inputs = {"predictions": _item(predictions, "predictions"), "test": _item(test, "data"),
              "train": _item(train, "data")}

    def compute(work: Path) -> dict:
        metrics = jobs.evaluate(inputs["predictions"]["url"], inputs["test"]["url"], train_url=inputs["train"]["url"],
                                ks=EVAL_KS)
        (work / "metrics.json").write_text(json.dumps(metrics, indent=2, sort_keys=True, default=str) + "\n")
        return {"outputs": {"metrics": "metrics.json"}, "result": metrics}

    return run_stage("evaluate", params={"ks": list(EVAL_KS)}, inputs=inputs, compute=compute, storage=storage,
                     log=get_run_logger())


@task(name="report", retries=1, retry_delay_seconds=1, cache_policy=NONE)
def report_stage(run_dir: str, *, stages: dict[str, dict], title: str, dashboard: str | None,
                 notes: list[str] | None = None, artifact_key: str = "xmldask-report") -> dict:
    """Write ``report.md``, ``metrics.json`` and the plots into ``run_dir``; publish the Markdown artifact."""
    from prefect.artifacts import create_markdown_artifact

    from .report import plot_precision_at_k, write_report

    run = Path(run_dir)
    run.mkdir(parents=True, exist_ok=True)
    metrics = stages["evaluate"]["result"]
    plots = {"Precision at k": plot_precision_at_k(metrics, run / "precision_at_k.png")}
    spectrum = stages.get("spectrum")
    if spectrum:
        plots = {"Label frequency": spectrum["outputs"]["label_frequency_png"],
                 "Spectrum of Y^T Y": spectrum["outputs"]["spectrum_png"], **plots}
    text = write_report(run, metrics=metrics, stages=stages, title=title, dashboard=dashboard, notes=notes,
                        plots=plots)
    create_markdown_artifact(markdown=text, key=artifact_key, description=f"xmldask report, {run}")
    get_run_logger().info("report: %s", run / "report.md")
    return {"run_dir": str(run), "report": str(run / "report.md"), "metrics_json": str(run / "metrics.json")}


# --------------------------------------------------------------------------------------------------
# flows


def new_run_dir(storage: str | None, key: dict) -> Path:
    """``<storage>/runs/<UTC time>-<flow run id>``: one directory per flow run."""
    from prefect.runtime import flow_run

    stamp = _dt.datetime.now(_dt.UTC).strftime("%Y%m%dT%H%M%S")
    run_id = (flow_run.get_id() or fingerprint("run", key, {}))[:8]
    return Path(storage_root(storage)) / "runs" / f"{stamp}-{run_id}"


def run_downstream(train: dict, test: dict, *, storage: str | None, embedding: str, k: int, kernel: str, seed: int,
                   n_random_features: int, max_epochs: int, top_k: int, spectrum_components: int | None = 50) -> dict:
    """spectrum -> train -> predict -> evaluate on ingested data; returns the stage records by name."""
    stages = {}
    if spectrum_components:
        stages["spectrum"] = spectrum_stage(train, storage=storage, n_components=spectrum_components, seed=seed)
    stages["train"] = train_stage(train, storage=storage, embedding=embedding, k=k, kernel=kernel, seed=seed,
                                  n_random_features=n_random_features, max_epochs=max_epochs)
    stages["predict"] = predict_stage(stages["train"], test, storage=storage, top_k=top_k)
    stages["evaluate"] = evaluate_stage(stages["predict"], test, train, storage=storage)
    return stages


@flow(name="xmldask-pipeline", log_prints=True)
def pipeline(train: list[str] | None = None, test: list[str] | None = None, *, storage: str | None = None,
             scheduler: str | None = None, n_workers: PositiveInt | None = None,
             threads_per_worker: PositiveInt | None = None, processes: bool | None = None,
             memory_limit: str = "auto", dashboard_address: str | None = ":8787",
             format: Literal["auto", "xc", "libsvm", "vw"] = "auto", one_based: bool = False,
             normalize: Literal["none", "l2", "l1", "sqrt"] = "none",
             embedding: Embedding = "rembrandt", k: PositiveInt = 64, kernel: Kernel = "gaussian", seed: int = 0,
             n_random_features: PositiveInt = 2000, max_epochs: PositiveInt = 10,
             top_k: Annotated[int, Field(ge=10)] = 10, spectrum_components: PositiveInt = 50,
             synthetic_samples: PositiveInt = 20_000, synthetic_features: PositiveInt = 20_000,
             synthetic_labels: PositiveInt = 2_000) -> dict:
    """The whole pipeline: ingest -> spectrum -> train -> predict -> evaluate -> report.

    Parameters
    ----------
    train, test : list of str, optional
        Text files (ingested) or one dataset store URL each (used as it is). Default: synthetic data
        (``synthetic_*``) generated under ``<storage>/synthetic/``.
    storage : str, optional
        Storage root of the stage outputs and run directories (default ``$XMLDASK_STORAGE`` or ``storage``).
    scheduler : str, optional
        Address of a running Dask scheduler (``tcp://host:8786``); default ``$XMLDASK_SCHEDULER``, else a
        LocalCluster (``n_workers``, ``threads_per_worker``, ``processes``, ``memory_limit``,
        ``dashboard_address``).
    format, one_based, normalize
        How text files are ingested.
    embedding, k, kernel, seed, n_random_features, max_epochs
        The embedding classifier.
    top_k : int
        Labels predicted per row (at least 10, for P@1..10).
    spectrum_components : int
        Eigenvalues of ``Y^T Y`` estimated for the report.

    Returns
    -------
    dict
        ``run_dir``, ``report``, ``metrics`` (P@1, P@3, P@5, ...), ``dashboard`` and ``stages``
        (name to ``{"reused", "fingerprint", "dir", "seconds"}``).
    """
    log = get_run_logger()
    with cluster(scheduler, n_workers=n_workers, threads_per_worker=threads_per_worker, processes=processes,
                 memory_limit=memory_limit, dashboard_address=dashboard_address) as client:
        dashboard = client.dashboard_link if dashboard_address is not None or scheduler else None
        log.info("Dask dashboard: %s", dashboard or "none")
        stages = {}
        if not train or not test:
            if train or test:
                raise ValueError("give both train and test, or neither (for the synthetic default)")
            synth = synthesize(storage=storage, n_samples=synthetic_samples, n_features=synthetic_features,
                               n_labels=synthetic_labels, seed=seed)
            train, test = [synth["train"]], [synth["test"]]
        opts = {"storage": storage, "format": format, "one_based": one_based, "normalize": normalize}
        stages["ingest-train"] = ingest_stage(list(train), split="train", **opts)
        stages["ingest-test"] = ingest_stage(list(test), split="test", like=stages["ingest-train"], **opts)
        stages.update(run_downstream(stages["ingest-train"], stages["ingest-test"], storage=storage,
                                     embedding=embedding, k=k, kernel=kernel, seed=seed,
                                     n_random_features=n_random_features, max_epochs=max_epochs, top_k=top_k,
                                     spectrum_components=spectrum_components))
        run_dir = new_run_dir(storage, {name: rec["fingerprint"] for name, rec in stages.items()})
        title = f"xmldask pipeline: {', '.join(train)} -> {', '.join(test)}"
        out = report_stage(str(run_dir), stages=stages, title=title, dashboard=dashboard)
    computed = [name for name, rec in stages.items() if not rec["reused"]]
    log.info("stages computed: %s; reused: %s", ", ".join(computed) or "none",
             ", ".join(n for n in stages if n not in computed) or "none")
    return {**out, "dashboard": dashboard, "metrics": stages["evaluate"]["result"],
            "stages": {name: {key: rec.get(key) for key in ("reused", "fingerprint", "dir", "seconds")}
                       for name, rec in stages.items()}}


# --------------------------------------------------------------------------------------------------
# command line


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m flows.pipeline", description=__doc__.split("\n\n")[0])
    parser.add_argument("--train", nargs="+", metavar="SOURCE_OR_URL",
                        help="training text file(s) or dataset store (default: synthetic data)")
    parser.add_argument("--test", nargs="+", metavar="SOURCE_OR_URL", help="test text file(s) or dataset store")
    parser.add_argument("--scheduler", metavar="ADDRESS", help="running Dask scheduler, e.g. tcp://host:8786 "
                        "(default $XMLDASK_SCHEDULER, else a local cluster)")
    parser.add_argument("--storage", metavar="DIR", help="storage root (default $XMLDASK_STORAGE or storage/)")
    parser.add_argument("--workers", type=int, dest="n_workers", help="local cluster: worker processes")
    parser.add_argument("--threads-per-worker", type=int, help="local cluster: threads per worker")
    parser.add_argument("--memory-limit", default="auto", help="local cluster: memory limit per worker")
    parser.add_argument("--format", default="auto", choices=["auto", "xc", "libsvm", "vw"])
    parser.add_argument("--one-based", action="store_true", help="ids in the text files start at 1")
    parser.add_argument("--normalize", default="none", choices=["none", "l2", "l1", "sqrt"])
    parser.add_argument("--embedding", default="rembrandt", choices=["rembrandt", "cs", "plst", "pca"])
    parser.add_argument("--k", type=int, default=64, help="embedding dimension")
    parser.add_argument("--kernel", default="gaussian", choices=["none", "gaussian", "cauchy"])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--n-random-features", type=int, default=2000)
    parser.add_argument("--max-epochs", type=int, default=10)
    parser.add_argument("--top-k", type=int, default=10)
    parser.add_argument("--synthetic-samples", type=int, default=20_000)
    parser.add_argument("--synthetic-features", type=int, default=20_000)
    parser.add_argument("--synthetic-labels", type=int, default=2_000)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = vars(build_parser().parse_args(argv))
    result = pipeline(**args)
    print(f"Dask dashboard: {result['dashboard'] or 'none'}")
    metrics = result["metrics"]
    print("  ".join(f"{name} {metrics[name]:.4f}" for name in ("P@1", "P@3", "P@5") if name in metrics))
    print(f"report: {result['report']}")
    print(result["run_dir"])
    sys.stdout.flush()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
