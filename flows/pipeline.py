"""The xmldask pipeline as Prefect flow runs: ingest -> spectrum -> train -> predict -> evaluate -> report.

The ``xmldask-pipeline`` flow chains the stage flows of :mod:`flows.stage_flows` as subflows; they
pass store URLs (with content fingerprints) and small records, never arrays. Every flow run has a run
directory ``<storage>/runs/<time>-<id>/`` (a local path or any fsspec URL): the stages it computes
write there (``ingest-train/``, ``spectrum/``, ``train/``, ... each with its ``stage.json`` record and
Dask ``performance.html``), and the report goes there (``report.md``, ``metrics.json``,
``stages.json``, PNG plots; also a Prefect Markdown artifact). A stage whose inputs and parameters
have not changed is a Prefect cache hit: it computes nothing and its record points at the run
directory that computed it, so a changed parameter recomputes only the stages after it.

The flow owns one ``distributed.Client`` (:func:`xmldask.cluster.cluster`: a LocalCluster by default, or
the scheduler given by ``scheduler`` / ``$XMLDASK_SCHEDULER``) and logs its dashboard link; the stage
flows compute on that client.

Command line::

    python -m flows.pipeline                                  # synthetic data, local cluster, storage/
    python -m flows.pipeline --train ../shared/data/bibtex/train.txt.gz --test ../shared/data/bibtex/test.txt.gz
    python -m flows.pipeline --train storage/x/train.zarr --test storage/x/test.zarr --scheduler tcp://host:8786

The last line printed is the run directory.
"""


import argparse
import signal
import sys
from typing import Annotated

from prefect import flow, get_run_logger, task
from prefect.cache_policies import NONE
from pydantic import Field

from xmldask.embedding.spectrum import SPECTRUM_COMPONENTS
from xmldask.models import DEFAULTS, TrainParams
from xmldask.params import TOP_K, TreeParams, add_arguments, from_args
from xmldask.store import exists

from .stage_flows import (
    Format,
    LocalClusterOptions,
    Normalize,
    PositiveInt,
    add_command_line_options,
    dask_client,
    evaluate_flow,
    exit_on_interrupt,
    ingest_flow,
    interruptible,
    new_run_dir,
    output,
    parse_command_line,
    predict_flow,
    report_flow,
    spectrum_flow,
    train_flow,
    tree_flow,
)
from .stages import join, root_url

__all__ = ["main", "pipeline", "run_downstream", "synthesize"]


#: the generator's knobs of the default data: within a topic the head labels dominate (Zipf exponent 2),
#: so that knowing a row's topics predicts its labels far better than the most frequent labels do
#: (the generator's default 1.1 gives a flat within-topic tail that no model predicts well)
SYNTHETIC_KNOBS = {"label_exponent": 2.0}


@task(name="synthesize", retries=2, retry_delay_seconds=1, cache_policy=NONE)
def synthesize(*, storage: str | None, n_samples: int, n_features: int, n_labels: int, seed: int) -> dict[str, str]:
    """Synthetic XC text files ``train.txt.gz`` and ``test.txt.gz`` (test: n_samples / 5 rows), reused if present."""
    from xmldask.datasets import GENERATOR_VERSION, write_synthetic_text

    log = get_run_logger()
    knobs = "-".join(f"{name}{value:g}" for name, value in SYNTHETIC_KNOBS.items())
    base = join(root_url(storage), "synthetic",
                f"synth-n{n_samples}-d{n_features}-l{n_labels}-seed{seed}-{knobs}-v{GENERATOR_VERSION}")
    paths = {}
    for split, n in (("train", n_samples), ("test", max(1, n_samples // 5))):
        path = join(base, f"{split}.txt.gz")
        if not exists(path):
            log.info("generating %d synthetic %s rows into %s", n, split, path)
            write_synthetic_text(path, n_samples=n, n_features=n_features, n_labels=n_labels, seed=seed, split=split,
                                 **SYNTHETIC_KNOBS)
        paths[split] = path
    return paths


def run_downstream(train: dict, test: dict, *, storage: str | None, run_dir: str, model: TrainParams, top_k: int,
                   spectrum_components: int | None = SPECTRUM_COMPONENTS, tree: TreeParams | None = None) -> dict:
    """spectrum -> [tree] -> train -> predict -> evaluate (stage flows) on ingested data; returns the records by
    stage. With ``tree``, the tree stage grows a spectral label tree and the train stage fits its
    candidate-restricted classifier (``model``'s ``n_components``, ``max_epochs`` and ``random_state`` where given);
    the tree's ``random_state`` is ``model``'s unless given."""
    where = {"storage": storage, "run_dir": run_dir}
    data, test_data = output(train, "data"), output(test, "data")
    stages = {}
    if spectrum_components:
        stages["spectrum"] = spectrum_flow(data, n_components=spectrum_components, random_state=model.random_state,
                                           **where)
    if tree is not None:
        tree = tree if "random_state" in tree.model_fields_set else tree.model_copy(
            update={"random_state": model.random_state})
        stages["tree"] = tree_flow(data, test_data, tree=tree, **where)
        given = {name: getattr(model, name) for name in ("n_components", "max_epochs", "random_state")
                 if name in model.model_fields_set}
        model = TrainParams(**given, tree=output(stages["tree"], "tree")["url"])
    stages["train"] = train_flow(data, model=model, **where)
    stages["predict"] = predict_flow(output(stages["train"], "model"), test_data, top_k=top_k, **where)
    stages["evaluate"] = evaluate_flow(output(stages["predict"], "predictions"), test_data, data, **where)
    return stages


def summary(stages: dict[str, dict]) -> dict[str, dict]:
    """What a flow returns of each stage record."""
    keys = ("state", "reused", "fingerprint", "dir", "seconds")
    return {name: {key: rec.get(key) for key in keys} for name, rec in stages.items()}


@flow(name="xmldask-pipeline", log_prints=True)
@interruptible
def pipeline(train: list[str] | None = None, test: list[str] | None = None, *, storage: str | None = None,
             scheduler: str | None = None, n_workers: PositiveInt | None = None,
             threads_per_worker: PositiveInt | None = None, processes: bool | None = None,
             memory_limit: str = "auto", dashboard_address: str | None = ":8787",
             format: Format = "auto", one_based: bool = False, normalize: Normalize = "none",
             model: TrainParams = DEFAULTS, top_k: Annotated[int, Field(ge=TOP_K)] = TOP_K,
             spectrum_components: PositiveInt = SPECTRUM_COMPONENTS, tree: TreeParams | None = None,
             synthetic_samples: PositiveInt = 20_000, synthetic_features: PositiveInt = 2_000,
             synthetic_labels: PositiveInt = 500) -> dict:
    """The whole pipeline: ingest -> spectrum -> [tree] -> train -> predict -> evaluate -> report.

    Parameters
    ----------
    train, test : list of str, optional
        Text files (ingested) or one dataset store URL each (used as it is). Default: synthetic data
        (``synthetic_*``) generated under ``<storage>/synthetic/``.
    storage : str, optional
        Storage root of the run directories and Prefect's cached results: a path or an fsspec URL
        (default ``$XMLDASK_STORAGE`` or ``storage``).
    scheduler : str, optional
        Address of a running Dask scheduler (``tcp://host:8786``); default ``$XMLDASK_SCHEDULER``, else a
        LocalCluster (``n_workers``, ``threads_per_worker``, ``processes``, ``memory_limit``,
        ``dashboard_address``).
    format, one_based, normalize
        How text files are ingested.
    model : TrainParams or dict
        The training parameters (:class:`xmldask.models.TrainParams`, the options of ``xmldask train``),
        e.g. ``{"n_components": 32, "kernel": "none"}``; its ``random_state`` also seeds the synthetic data and the
        spectrum.
    top_k : int
        Labels predicted per row (at least 10, for P@1..10).
    spectrum_components : int
        Eigenvalues of ``Y^T Y`` estimated for the report.
    tree : TreeParams or dict, optional
        Grow a spectral label tree (:class:`xmldask.params.TreeParams`, the options of ``xmldask tree``,
        e.g. ``{"max_depth": 14, "leaf_labels": 25}``; labels with no training row are left out unless
        ``unseen_labels="error"``; its ``random_state`` is ``model``'s unless given) in its own stage, and train its
        candidate-restricted classifier instead of the embedding classifier; the report gains the tree's
        figures and plots.

    Returns
    -------
    dict
        ``run_dir``, ``report``, ``metrics`` (P@1, P@3, P@5, ...), ``dashboard`` and ``stages``
        (name to ``{"state", "reused", "fingerprint", "dir", "seconds"}``).
    """
    log = get_run_logger()
    local = LocalClusterOptions(n_workers=n_workers, threads_per_worker=threads_per_worker, processes=processes,
                                memory_limit=memory_limit, dashboard_address=dashboard_address)
    run_dir = new_run_dir(storage)
    log.info("run directory: %s", run_dir)
    with dask_client(scheduler, local) as dask:
        if not train or not test:
            if train or test:
                raise ValueError("give both train and test, or neither (for the synthetic default)")
            synth = synthesize(storage=storage, n_samples=synthetic_samples, n_features=synthetic_features,
                               n_labels=synthetic_labels, seed=model.random_state)
            train, test = [synth["train"]], [synth["test"]]
        opts = {"storage": storage, "run_dir": run_dir, "format": format, "one_based": one_based,
                "normalize": normalize}
        stages = {"ingest-train": ingest_flow(list(train), split="train", **opts)}
        stages["ingest-test"] = ingest_flow(list(test), split="test", like=stages["ingest-train"]["outputs"]["data"],
                                            **opts)
        stages.update(run_downstream(stages["ingest-train"], stages["ingest-test"], storage=storage, run_dir=run_dir,
                                     model=model, top_k=top_k, spectrum_components=spectrum_components, tree=tree))
        title = f"xmldask pipeline: {', '.join(train)} -> {', '.join(test)}"
        out = report_flow(stages, title=title, dashboard=dask.dashboard, run_dir=run_dir)
    computed = [name for name, rec in stages.items() if not rec["reused"]]
    log.info("stages computed: %s; reused: %s", ", ".join(computed) or "none",
             ", ".join(n for n in stages if n not in computed) or "none")
    return {**out, "dashboard": dask.dashboard, "metrics": stages["evaluate"]["result"], "stages": summary(stages)}


# --------------------------------------------------------------------------------------------------
# command line


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m flows.pipeline", description=__doc__.split("\n\n")[0])
    parser.add_argument("--train", nargs="+", metavar="SOURCE_OR_URL",
                        help="training text file(s) or dataset store (default: synthetic data)")
    parser.add_argument("--test", nargs="+", metavar="SOURCE_OR_URL", help="test text file(s) or dataset store")
    parser.add_argument("--workers", type=int, dest="n_workers", help="local cluster: worker processes")
    parser.add_argument("--threads-per-worker", type=int, help="local cluster: threads per worker")
    parser.add_argument("--memory-limit", default="auto", help="local cluster: memory limit per worker")
    parser.add_argument("--format", default="auto", choices=["auto", "xc", "libsvm", "vw"])
    parser.add_argument("--one-based", action="store_true", help="ids in the text files start at 1")
    parser.add_argument("--normalize", default="none", choices=["none", "l2", "l1", "sqrt"])
    parser.add_argument("--top-k", type=int, default=TOP_K)
    tree = parser.add_argument_group("label tree (a tree stage, then its candidate-restricted classifier)")
    tree.add_argument("--grow-tree", action="store_true", help="grow a spectral label tree and train its classifier")
    add_arguments(tree, TreeParams, title=None, prefix="tree-", exclude=("unseen_labels", "random_state"))
    parser.add_argument("--synthetic-samples", type=int, default=20_000)
    parser.add_argument("--synthetic-features", type=int, default=2_000)
    parser.add_argument("--synthetic-labels", type=int, default=500)
    add_command_line_options(parser)
    return parser


def main(argv: list[str] | None = None) -> int:
    signal.signal(signal.SIGINT, exit_on_interrupt("python -m flows.pipeline"))
    args, model, given = parse_command_line(
        build_parser(), argv, skip=("grow_tree", *(f"tree_{name}" for name in TreeParams.model_fields)))
    if args.grow_tree:
        given["tree"] = TreeParams(**from_args(args, TreeParams, prefix="tree-"))
    from prefect.settings import PREFECT_FLOWS_HEARTBEAT_FREQUENCY, temporary_settings

    # no heartbeat thread: on the command line the flow runs in this process against a temporary local
    # server (nothing watches for crashed runs) and each subflow run would wait up to a second for it
    with temporary_settings(updates={PREFECT_FLOWS_HEARTBEAT_FREQUENCY: None}):
        result = pipeline(**given, model=model)
    metrics = result["metrics"]
    print("  ".join(f"{name} {metrics[name]:.4f}" for name in ("P@1", "P@3", "P@5") if name in metrics))
    print(f"report: {result['report']}")
    print(result["run_dir"])
    sys.stdout.flush()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
