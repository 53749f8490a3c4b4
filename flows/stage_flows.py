"""One Prefect flow per stage: ingest, spectrum, train, predict, evaluate, report.

Each stage flow takes store URLs and typed parameters (validated by Prefect with pydantic) and returns
a small record (:func:`flows.stages.run_stage`); :func:`flows.pipeline.pipeline` chains them as
subflows, and each can be run on its own::

    from flows.stage_flows import train_flow
    record = train_flow("storage/bibtex/train.zarr", model={"n_components": 32}, scheduler="tcp://head:8786")
    record["outputs"]["model"]        # <storage>/runs/<time>-<id>/train/model.zarr

Inside, a thin task per stage (``ingest``, ``spectrum``, ``train``, ``predict``, ``evaluate``)
computes through :mod:`xmldask.jobs` into ``<run_dir>/<stage>/``. The task is cached by Prefect: its
cache key is the stage fingerprint (:func:`flows.stages.cache_key`: stage, version, parameters and
the content fingerprints of the inputs), and its record is persisted under
``<storage>/prefect-results/``. A re-run with the same inputs and parameters is a "Cached" task run
whose record points at the outputs of the run that computed them; if those outputs are gone, the
stage is computed again (``refresh_cache``). Only the I/O-bound tasks (ingest, report) retry.

Dask: a stage flow that computes with Dask uses the running client of the flow that called it (the
pipeline's); run on its own, it opens :func:`xmldask.cluster.cluster`: the ``scheduler`` parameter,
else ``$XMLDASK_SCHEDULER``, else a LocalCluster (``local_cluster`` options), closed at its end.
"""


import argparse
import contextlib
import datetime as _dt
import functools
import hashlib
import json
import logging
import os
import signal
import sys
import tempfile
import threading
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Annotated, Literal

from fsspec.core import url_to_fs
from prefect import flow, get_run_logger, task
from prefect.cache_policies import NONE
from pydantic import BaseModel, Field
from typing_extensions import TypedDict

from xmldask import jobs
from xmldask.embedding.spectrum import SPECTRUM_COMPONENTS
from xmldask.models import DEFAULTS, TrainParams
from xmldask.params import TOP_K, TreeParams, add_arguments, from_args
from xmldask.progress import progress_to
from xmldask.store import is_local, zarr_store

from .stages import (
    cache_key,
    dataset_fingerprint,
    file_sha256,
    is_dataset_store,
    join,
    outputs_complete,
    root_url,
    run_stage,
    store_ref,
    upload,
)

__all__ = ["EVAL_KS", "LazyClient", "LocalClusterOptions", "StoreRef", "compute_on_dask", "dask_client",
           "evaluate_flow", "exit_on_interrupt", "ingest_flow", "interruptible",
           "new_run_dir", "output", "predict_flow", "report_flow", "run_cached",
           "set_verbosity", "spectrum_flow", "train_flow", "tree_flow", "TREE_DEFAULTS", "add_command_line_options",
           "parse_command_line"]

PositiveInt = Annotated[int, Field(gt=0)]
Format = Literal["auto", "xc", "libsvm", "vw"]
Normalize = Literal["none", "l2", "l1", "sqrt"]
#: the k of the evaluation (the report's P@k plot); the report's table shows 1, 3, 5
EVAL_KS = tuple(range(1, 11))


class StoreRef(TypedDict):
    """A store and its content fingerprint, as one stage hands its output to the next."""

    url: str
    fingerprint: str


#: a store URL, or a :class:`StoreRef` (an output of another stage, with its fingerprint)
Store = str | StoreRef


class LocalClusterOptions(BaseModel):
    """The local Dask cluster a stage flow run on its own starts (see :func:`xmldask.cluster.cluster`)."""

    n_workers: PositiveInt | None = None
    threads_per_worker: PositiveInt | None = None
    processes: bool | None = None
    memory_limit: str = "auto"
    dashboard_address: str | None = ":8787"


# --------------------------------------------------------------------------------------------------
# Ctrl-C


def exit_on_interrupt(what: str):
    """A SIGINT handler that ends this process at once with status 130: one line saying what was interrupted, this
    process's children (the temporary Prefect server, the local Dask workers) stopped, no traceback. The stages
    write into temporary directories published whole, so nothing half-written stays; a second Ctrl-C during the
    stop exits without waiting. (Without it, Prefect retries its temporary server, which the terminal's Ctrl-C
    stopped too, for a minute or more and ends in a traceback.)"""

    def interrupted(signum, frame):
        if getattr(interrupted, "once", False):
            os._exit(130)
        interrupted.once = True
        # straight to the file descriptor: a flow's log_prints would turn a print into a log record
        os.write(2, f"{what}: interrupted; the stages that finished are kept, nothing else was written\n".encode())
        try:
            import psutil

            children = psutil.Process().children(recursive=True)
            for child in children:
                child.terminate()
            _, alive = psutil.wait_procs(children, timeout=3)
            for child in alive:
                child.kill()
        finally:
            os._exit(130)

    return interrupted


def _owns_ctrl_c() -> bool:
    """Whether Ctrl-C is still Python's own in this thread of a script: the main thread, the default handler (no
    handler of the program's, of an enclosing flow's command line or of a notebook), not an interactive session."""
    return (threading.current_thread() is threading.main_thread()
            and signal.getsignal(signal.SIGINT) is signal.default_int_handler
            and not (hasattr(sys, "ps1") or sys.flags.interactive or "IPython" in sys.modules))


def interruptible(fn):
    """A flow run as the main work of a script ends on Ctrl-C as the command line does (:func:`exit_on_interrupt`):
    status 130 within seconds, one line, no child left, no traceback. Where Ctrl-C is not Python's default (a
    program that set its own SIGINT handler, a notebook, a thread, a flow inside a flow that has it) it is left
    alone: a program that wants its ``KeyboardInterrupt`` installs a SIGINT handler of its own first."""

    @functools.wraps(fn)
    def run(*args, **kwargs):
        if not _owns_ctrl_c():
            return fn(*args, **kwargs)
        previous = signal.signal(signal.SIGINT, exit_on_interrupt(fn.__name__))
        try:
            return fn(*args, **kwargs)
        finally:
            signal.signal(signal.SIGINT, previous)

    return run


# --------------------------------------------------------------------------------------------------
# Dask, run directories, cached stages


class LazyClient:
    """The Dask client of a flow run, started by the first stage that computes.

    A run whose stages are all Prefect cache hits starts no cluster. Thread-safe: stage tasks run in
    Prefect's worker threads. ``dashboard`` is the dashboard link once started (else None).
    """

    def __init__(self, scheduler: str | None, local: LocalClusterOptions):
        self.scheduler, self.local = scheduler, local
        self.client, self.dashboard = None, None
        self._stack, self._lock = contextlib.ExitStack(), threading.Lock()

    def get(self, data_url: str | None = None):
        """The client, starting the cluster (or connecting to the scheduler) on the first call; a local cluster
        started for the dataset store ``data_url`` runs its workers as threads of this process when the data
        is small (:func:`xmldask.cluster.default_layout`), unless ``processes`` is given."""
        from xmldask.cluster import cluster
        from xmldask.store import open_dataset

        with self._lock:
            if self.client is None:
                data_bytes = open_dataset(data_url).nbytes if data_url else None
                self.client = self._stack.enter_context(cluster(self.scheduler, **self.local.model_dump(),
                                                                data_bytes=data_bytes))
                if self.local.dashboard_address is not None or self.scheduler:
                    self.dashboard = self.client.dashboard_link
                get_run_logger().info("Dask dashboard: %s", self.dashboard or "none")
            return self.client

    def close(self) -> None:
        with self._lock:
            self._stack.close()
            self.client = None


#: the lazy clients of the flow runs of this process, innermost last
_ACTIVE: list[LazyClient] = []


@contextlib.contextmanager
def dask_client(scheduler: str | None = None, local: LocalClusterOptions | None = None) -> Iterator[LazyClient]:
    """The Dask client to compute on: the calling flow's, a running client, else a lazily started cluster.

    Parameters
    ----------
    scheduler : str, optional
        Address of a running scheduler. The client of a calling flow (or a running client of this
        process) is reused unless ``scheduler`` names another scheduler.
    local : LocalClusterOptions, optional
        The local cluster started when there is neither a running client nor a scheduler address
        (nor ``$XMLDASK_SCHEDULER``).

    Yields
    ------
    LazyClient
        Started by the first stage that computes (:func:`compute_on_dask`), closed at the end of the block.
    """
    from distributed import default_client

    wanted = scheduler if scheduler is None or "://" in scheduler else f"tcp://{scheduler}"
    if _ACTIVE and wanted in (None, _ACTIVE[-1].scheduler):
        yield _ACTIVE[-1]
        return
    try:
        running = default_client()
    except ValueError:
        running = None
    lazy = LazyClient(scheduler, local or LocalClusterOptions())
    if running is not None and wanted in (None, running.scheduler.address):
        get_run_logger().info("computing on the running Dask client (scheduler %s)", running.scheduler.address)
        lazy.client = running
    _ACTIVE.append(lazy)
    try:
        yield lazy
    finally:
        _ACTIVE.remove(lazy)
        lazy.close()


class _EngineLines(logging.Filter):
    """Drops the Prefect engine's own INFO lines from the terminal (a run beginning, a state reached, the temporary
    server starting and stopping): the stages' progress lines, and every warning, stay. The API (the UI) still
    receives them all."""

    PREFIXES = ("Beginning flow run", "Beginning subflow run", "Finished in state", "Created task run",
                "Created subflow run", "Executing ", "Starting temporary server", "Stopping temporary server",
                "See https://www.prefect.io", "View at ")

    def filter(self, record: logging.LogRecord) -> bool:
        return record.levelno > logging.INFO or not record.getMessage().startswith(self.PREFIXES)


def set_verbosity(verbose: bool) -> None:
    """Dask's own log lines (scheduler and worker start-up, ...) at WARNING unless ``verbose``, then also
    xmldask's at INFO; the flow runs' logs (the stages' progress) are shown either way, Prefect's engine lines
    (:class:`_EngineLines`) only with ``verbose``."""
    import distributed  # noqa: F401 - it sets its loggers' levels when imported: set ours after
    import prefect.logging  # noqa: F401 - configures Prefect's handlers: filter them after

    # local worker processes are spawned: they read the level from the environment when they import Dask
    os.environ["DASK_LOGGING__DISTRIBUTED"] = "info" if verbose else "warning"
    logging.getLogger("distributed").setLevel(logging.INFO if verbose else logging.WARNING)
    logging.getLogger("xmldask").setLevel(logging.INFO if verbose else logging.WARNING)
    from prefect.logging.handlers import PrefectConsoleHandler

    for name in ("prefect", ""):
        for handler in logging.getLogger(name).handlers:
            if isinstance(handler, PrefectConsoleHandler):
                for old in [f for f in handler.filters if isinstance(f, _EngineLines)]:
                    handler.removeFilter(old)
                if not verbose:
                    handler.addFilter(_EngineLines())


def add_command_line_options(parser: argparse.ArgumentParser) -> None:
    """The options every flow's command line has: where it runs (``--scheduler``, ``--storage``), ``-v``,
    and the training parameters (:func:`xmldask.params.add_arguments`)."""
    parser.add_argument("--scheduler", metavar="ADDRESS", help="running Dask scheduler, e.g. tcp://host:8786 "
                        "(default $XMLDASK_SCHEDULER, else a local cluster)")
    parser.add_argument("--storage", metavar="URL", help="storage root: a directory or an fsspec URL (default "
                        "$XMLDASK_STORAGE or storage/)")
    parser.add_argument("-v", "--verbose", action="store_true", help="also show the log lines of Dask and xmldask")
    add_arguments(parser, TrainParams)


def parse_command_line(parser: argparse.ArgumentParser, argv: list[str] | None,
                       skip: tuple[str, ...] = ()) -> tuple[argparse.Namespace, dict, dict]:
    """Parse a flow's command line (options of :func:`add_command_line_options`) and set the verbosity: the
    namespace, the training parameters given, and the other options but ``skip``."""
    args = parser.parse_args(argv)
    model = from_args(args, TrainParams)
    set_verbosity(args.verbose)
    others = {name: value for name, value in vars(args).items()
              if name not in TrainParams.model_fields and name not in ("verbose", *skip)}
    return args, model, others


def compute_on_dask(data_url: str | None = None) -> None:
    """Start the Dask client of the current flow run, if any (called by a stage task that computes, with the
    dataset store it reads most: a local cluster for small data runs threads of this process)."""
    if _ACTIVE:
        _ACTIVE[-1].get(data_url)


def new_run_dir(storage: str | None) -> str:
    """``<storage>/runs/<UTC time>-<flow run id>``: the directory of the current flow run."""
    from prefect.runtime import flow_run

    stamp = _dt.datetime.now(_dt.UTC).strftime("%Y%m%dT%H%M%S")
    run_id = (flow_run.get_id() or uuid.uuid4().hex)[:8]
    return join(root_url(storage), "runs", f"{stamp}-{run_id}")


def result_storage(storage: str | None):
    """Where Prefect persists the stage records: ``<storage>/prefect-results`` (a path, or a saved block)."""
    url = join(root_url(storage), "prefect-results")
    if is_local(url):
        return Path(url)
    from prefect.filesystems import RemoteFileSystem

    block = RemoteFileSystem(basepath=url)  # Prefect needs a saved block for storage other than a local path
    block.save(f"xmldask-results-{hashlib.sha256(url.encode()).hexdigest()[:12]}", overwrite=True)
    return block


def run_cached(stage_task, *, inputs: dict[str, dict], params: dict, storage: str | None, run_dir: str | None,
               name: str | None = None) -> dict:
    """Run a stage task into ``<run_dir>/<name>`` through Prefect's cache; returns its record.

    A cached record whose outputs are gone (an old run directory deleted) is computed again, with
    ``refresh_cache`` so that the cache then holds the new record.

    Returns
    -------
    dict
        The stage record, plus ``state`` (the task run's state name: ``Completed`` or ``Cached``) and
        ``reused`` (true if cached).
    """
    out = join(run_dir or new_run_dir(storage), name or stage_task.name)
    configured = stage_task.with_options(result_storage=result_storage(storage))
    state = configured(inputs, params, out, return_state=True)
    record = state.result()
    if state.name == "Cached" and not outputs_complete(record):
        get_run_logger().warning("stage %s: the cached outputs in %s are gone; computing it again", stage_task.name,
                                 record.get("dir"))
        state = configured.with_options(refresh_cache=True)(inputs, params, out, return_state=True)
        record = state.result()
    return {**record, "state": state.name, "reused": state.name == "Cached"}


def output(record: dict, name: str) -> StoreRef:
    """The output ``name`` of a stage record, as the input of the next stage."""
    return {"url": record["outputs"][name], "fingerprint": record["output_fingerprints"][name]}


#: the options of every cached stage task: keyed on the stage fingerprint, the record persisted as JSON
CACHED = {"cache_key_fn": cache_key, "persist_result": True, "result_serializer": "json"}


# --------------------------------------------------------------------------------------------------
# ingest (no Dask: a streaming read in this process)


@task(name="ingest", retries=2, retry_delay_seconds=1, **CACHED)
def ingest_task(inputs: dict[str, dict], params: dict, out: str) -> dict:
    """Text files (``inputs`` ``source0``, ``source1``, ..., and with missing labels their files of observed
    entries ``observed0``, ...) into the dataset store ``data.zarr``."""
    from xmldask.io import ingest

    sources = [inputs[f"source{i}"]["url"] for i in range(sum(name.startswith("source") for name in inputs))]
    observed = [inputs[f"observed{i}"]["url"] for i in range(len(sources))] if "observed0" in inputs else None

    def compute(work: str, scratch: Path) -> dict:
        data = join(work, "data.zarr")
        ds = ingest(sources, data, observed=observed, **params)
        return {"outputs": {"data": "data.zarr"}, "fingerprints": {"data": dataset_fingerprint(data)},
                "result": {k: v for k, v in ds.info().items() if isinstance(v, (int, float, str))}}

    return run_stage("ingest", params=params, inputs=inputs, compute=compute, out=out, log=get_run_logger())


@flow(name="xmldask-ingest", log_prints=True)
@interruptible
def ingest_flow(sources: list[str], *, split: str = "train", like: str | None = None, format: Format = "auto",
                one_based: bool = False, normalize: Normalize = "none", observed: list[str] | None = None,
                storage: str | None = None, run_dir: str | None = None) -> dict:
    """A dataset store from text files (ingested once per content), or an existing store as it is.

    Parameters
    ----------
    sources : list of str
        Text files (paths or fsspec URLs), or one dataset store URL (used as it is).
    split : str, default "train"
        The name of the output directory: ``<run_dir>/ingest-<split>``.
    like : str, optional
        The training dataset store, whose dimensions the test data takes.
    format, one_based, normalize
        How the text files are read (:func:`xmldask.io.ingest`).
    observed : list of str, optional
        Missing labels: one file of observed label entries per source (:func:`xmldask.io.ingest`'s
        ``observed``, ``xmldask ingest --observed``); part of the stage's cache key like the sources.
    storage : str, optional
        Storage root (path or fsspec URL; default ``$XMLDASK_STORAGE`` or ``storage``).
    run_dir : str, optional
        The run directory (default a new ``<storage>/runs/<time>-<id>``).

    Returns
    -------
    dict
        The stage record; ``outputs["data"]`` is the dataset store. A store used as it is has no
        task run: its record has ``state`` "Skipped" and no ``dir``.
    """
    log = get_run_logger()
    if len(sources) == 1 and is_dataset_store(sources[0]):
        ref = store_ref(sources[0])
        log.info("%s: using the dataset store %s as it is", split, ref["url"])
        return {"stage": "ingest", "fingerprint": ref["fingerprint"], "outputs": {"data": ref["url"]},
                "output_fingerprints": {"data": ref["fingerprint"]}, "inputs": {}, "params": {}, "result": {},
                "seconds": 0.0, "peak_rss_mb": None, "performance_report": None, "dir": None,
                "state": "Skipped", "reused": True}
    params = {"format": format, "one_based": one_based, "normalize": normalize}
    if like is not None:
        from xmldask.store import open_dataset

        meta = open_dataset(like).meta
        params.update(n_features=meta["n_features"], n_labels=meta["n_labels"])
    inputs = {f"source{i}": {"url": str(s), "fingerprint": file_sha256(str(s))} for i, s in enumerate(sources)}
    if observed is not None:
        if len(observed) != len(sources):
            raise ValueError(f"give one file of observed entries per source: {len(sources)} sources but "
                             f"{len(observed)} observed files")
        inputs.update({f"observed{i}": {"url": str(o), "fingerprint": file_sha256(str(o))}
                       for i, o in enumerate(observed)})
    return run_cached(ingest_task, inputs=inputs, params=params, storage=storage, run_dir=run_dir,
                      name=f"ingest-{split}")


# --------------------------------------------------------------------------------------------------
# spectrum, train, predict, evaluate (Dask)


@task(name="spectrum", **CACHED)
def spectrum_task(inputs: dict[str, dict], params: dict, out: str) -> dict:
    """The spectrum of ``Y^T Y`` (Zarr, CSV, PNG) and the label-frequency plot of ``inputs["train"]``."""
    import zarr

    from xmldask.embedding.spectrum import compute_spectrum, write_spectrum
    from xmldask.store import open_dataset

    from .report import plot_label_frequency

    data = inputs["train"]["url"]

    def compute(work: str, scratch: Path) -> dict:
        compute_on_dask(inputs["train"]["url"])
        spectrum = compute_spectrum(data, matrix="Y", n_components=params["n_components"],
                                    random_state=params["random_state"])
        write_spectrum(spectrum, scratch)
        zarr.save_array(zarr_store(join(work, "spectrum.zarr")), spectrum.eigenvalues)
        plot_label_frequency(open_dataset(data).label_counts, scratch / "label_frequency.png")
        return {"outputs": {"eigenvalues": "spectrum.zarr", "spectrum_png": "spectrum.png",
                            "label_frequency_png": "label_frequency.png"},
                "result": {"trace": float(spectrum.trace), "n_passes": spectrum.n_passes,
                           "top_eigenvalues": [float(v) for v in spectrum.eigenvalues[:10]]}}

    return run_stage("spectrum", params=params, inputs=inputs, compute=compute, out=out, log=get_run_logger(),
                     on_dask=lambda: compute_on_dask(inputs["train"]["url"]))


@flow(name="xmldask-spectrum", log_prints=True)
@interruptible
def spectrum_flow(train: Store, *, n_components: PositiveInt = SPECTRUM_COMPONENTS, random_state: int = 0,
                  storage: str | None = None, run_dir: str | None = None, scheduler: str | None = None,
                  local_cluster: LocalClusterOptions | None = None) -> dict:
    """Label statistics for the report: the top eigenvalues of ``Y^T Y`` and the label frequencies.

    Parameters
    ----------
    train : str or StoreRef
        The training dataset store.
    n_components : int, default 50
        Eigenvalues estimated (randomized PCA).
    random_state : int
    storage, run_dir
        As :func:`ingest_flow`.
    scheduler : str, optional
        A running Dask scheduler (``tcp://host:8786``) when run on its own; default
        ``$XMLDASK_SCHEDULER``, else a local cluster (``local_cluster``).

    Returns
    -------
    dict
        The stage record; ``outputs``: ``eigenvalues`` (Zarr), ``spectrum_png``, ``label_frequency_png``.
    """
    with dask_client(scheduler, local_cluster):
        return run_cached(spectrum_task, inputs={"train": store_ref(train)},
                          params={"n_components": n_components, "random_state": random_state}, storage=storage,
                          run_dir=run_dir)


@task(name="tree", **CACHED)
def tree_task(inputs: dict[str, dict], params: dict, out: str) -> dict:
    """Grow the spectral label tree on ``inputs["train"]`` into ``tree.zarr``; its figures on ``inputs["test"]``
    and their plot ``tree.png``."""
    from xmldask.store import open_dataset
    from xmldask.tree import SpectralLabelTree

    from .report import plot_tree

    def compute(work: str, scratch: Path) -> dict:
        compute_on_dask(inputs["train"]["url"])
        url = join(work, "tree.zarr")
        with progress_to(get_run_logger().info):  # a line a level
            grown = jobs.tree(inputs["train"]["url"], url, **params)
        test = open_dataset(inputs["test"]["url"])
        figures = {name: (value.tolist() if hasattr(value, "tolist") else value)
                   for name, value in SpectralLabelTree.load(url).leaf_figures(test.X, test.Y).items()
                   if name not in ("rows", "assignments", "covered")}
        plot_tree(figures, scratch / "tree.png")
        result = {**grown, "test_figures": jobs.tree_info(url, inputs["test"]["url"]), "by_depth": figures}
        return {"outputs": {"tree": "tree.zarr", "tree_png": "tree.png"}, "result": result}

    return run_stage("tree", params=params, inputs=inputs, compute=compute, out=out, log=get_run_logger(),
                     on_dask=lambda: compute_on_dask(inputs["train"]["url"]))


#: the tree stage's defaults: ``xmldask tree``'s, but a label with no training row is left out of the tree
#: (the pipeline's own synthetic data, and real label spaces, hold such labels)
TREE_DEFAULTS = TreeParams()


@flow(name="xmldask-tree", log_prints=True)
@interruptible
def tree_flow(train: Store, test: Store, *, tree: TreeParams = TREE_DEFAULTS,
              storage: str | None = None, run_dir: str | None = None, scheduler: str | None = None,
              local_cluster: LocalClusterOptions | None = None) -> dict:
    """The spectral label tree of the training data (:func:`xmldask.jobs.tree`) and its figures on the test
    data: tree recall, root purity, mean depth and candidates, and by leaf depth (plotted).

    Parameters
    ----------
    train, test : str or StoreRef
        The training and test dataset stores.
    tree : TreeParams or dict
        ``max_depth``, ``leaf_labels``, ``routing``, ``unseen_labels``, ``random_state``
        (:class:`xmldask.params.TreeParams`);
        those not given are :data:`TREE_DEFAULTS`.
    storage, run_dir, scheduler, local_cluster
        As :func:`spectrum_flow`.

    Returns
    -------
    dict
        The stage record; ``outputs``: ``tree`` (the tree store, for ``train_flow(model={"tree": ...})``)
        and ``tree_png``; ``result``: the growth facts, ``train_figures``, ``test_figures``, ``by_depth``.
    """
    tree = TreeParams(**{**TREE_DEFAULTS.model_dump(), **tree.model_dump(exclude_unset=True)})
    with dask_client(scheduler, local_cluster):
        return run_cached(tree_task, inputs={"train": store_ref(train), "test": store_ref(test)},
                          params=tree.model_dump(), storage=storage, run_dir=run_dir)


@task(name="train", **CACHED)
def train_task(inputs: dict[str, dict], params: dict, out: str) -> dict:
    """Train the model ``params`` describe on ``inputs["train"]`` into ``model.zarr``."""

    def compute(work: str, scratch: Path) -> dict:
        compute_on_dask(inputs["train"]["url"])
        with progress_to(get_run_logger().info):  # a line a search candidate; with tree=, a line a pass
            result = jobs.train(inputs["train"]["url"], join(work, "model.zarr"), **params)
        return {"outputs": {"model": "model.zarr"}, "result": result}

    return run_stage("train", params=params, inputs=inputs, compute=compute, out=out, log=get_run_logger(),
                     on_dask=lambda: compute_on_dask(inputs["train"]["url"]))


@flow(name="xmldask-train", log_prints=True)
@interruptible
def train_flow(train: Store, *, model: TrainParams = DEFAULTS, storage: str | None = None,
               run_dir: str | None = None, scheduler: str | None = None,
               local_cluster: LocalClusterOptions | None = None) -> dict:
    """Train on the dataset store ``train`` the model that ``model`` describes (:class:`xmldask.models.TrainParams`,
    the options of ``xmldask train``, e.g. ``{"n_components": 32, "search": {"alpha": [0.001, 1]}}``; the fields not
    given keep their defaults): by default the self-tuned embedding classifier. ``storage``, ``run_dir``,
    ``scheduler`` and ``local_cluster`` as in :func:`spectrum_flow`. Returns the stage record;
    ``outputs["model"]`` is the model store."""
    with dask_client(scheduler, local_cluster):
        return run_cached(train_task, inputs={"train": store_ref(train)}, params=model.model_dump(), storage=storage,
                          run_dir=run_dir)


@task(name="predict", **CACHED)
def predict_task(inputs: dict[str, dict], params: dict, out: str) -> dict:
    """Top-``top_k`` predictions of ``inputs["model"]`` on ``inputs["test"]`` into ``predictions.zarr``."""

    def compute(work: str, scratch: Path) -> dict:
        compute_on_dask(inputs["test"]["url"])
        result = jobs.predict(inputs["model"]["url"], inputs["test"]["url"], join(work, "predictions.zarr"), **params)
        return {"outputs": {"predictions": "predictions.zarr"}, "result": result}

    return run_stage("predict", params=params, inputs=inputs, compute=compute, out=out, log=get_run_logger(),
                     on_dask=lambda: compute_on_dask(inputs["test"]["url"]))


@flow(name="xmldask-predict", log_prints=True)
@interruptible
def predict_flow(model: Store, test: Store, *, top_k: Annotated[int, Field(ge=1)] = TOP_K, name: str = "predict",
                 storage: str | None = None, run_dir: str | None = None, scheduler: str | None = None,
                 local_cluster: LocalClusterOptions | None = None) -> dict:
    """Top-``top_k`` labels and scores of every row of the dataset store ``test`` by the model store ``model``,
    into ``<run_dir>/<name>``. ``storage``, ``run_dir``, ``scheduler`` and ``local_cluster`` as in
    :func:`spectrum_flow`. Returns the stage record; ``outputs["predictions"]`` is the prediction store."""
    with dask_client(scheduler, local_cluster):
        return run_cached(predict_task, inputs={"model": store_ref(model), "test": store_ref(test)},
                          params={"top_k": top_k}, storage=storage, run_dir=run_dir, name=name)


@task(name="evaluate", **CACHED)
def evaluate_task(inputs: dict[str, dict], params: dict, out: str) -> dict:
    """Metrics of ``inputs["predictions"]`` against ``inputs["test"]`` into ``metrics.json``."""

    def compute(work: str, scratch: Path) -> dict:
        compute_on_dask(inputs["test"]["url"])
        train = inputs.get("train", {}).get("url")
        metrics = jobs.evaluate(inputs["predictions"]["url"], inputs["test"]["url"], train_url=train,
                                ks=tuple(params["ks"]))
        (scratch / "metrics.json").write_text(json.dumps(metrics, indent=2, sort_keys=True, default=str) + "\n")
        return {"outputs": {"metrics": "metrics.json"}, "result": metrics}

    return run_stage("evaluate", params=params, inputs=inputs, compute=compute, out=out, log=get_run_logger(),
                     on_dask=lambda: compute_on_dask(inputs["test"]["url"]))


@flow(name="xmldask-evaluate", log_prints=True)
@interruptible
def evaluate_flow(predictions: Store, test: Store, train: Store | None = None, *, name: str = "evaluate",
                  storage: str | None = None, run_dir: str | None = None, scheduler: str | None = None,
                  local_cluster: LocalClusterOptions | None = None) -> dict:
    """Every applicable metric at k = 1..10 (propensities from the training labels).

    Parameters
    ----------
    predictions, test : str or StoreRef
        The prediction store and the dataset store with the true labels.
    train : str or StoreRef, optional
        The training dataset store (label propensities of PSP@k); default the one the model recorded.
    name : str, default "evaluate"
        The output directory: ``<run_dir>/<name>``.
    storage, run_dir, scheduler, local_cluster
        As :func:`spectrum_flow`.

    Returns
    -------
    dict
        The stage record; ``result`` holds the metrics (``"P@1"``, ...), ``outputs["metrics"]`` their JSON.
    """
    inputs = {"predictions": store_ref(predictions), "test": store_ref(test)}
    if train is not None:
        inputs["train"] = store_ref(train)
    with dask_client(scheduler, local_cluster):
        return run_cached(evaluate_task, inputs=inputs, params={"ks": list(EVAL_KS)}, storage=storage,
                          run_dir=run_dir, name=name)


# --------------------------------------------------------------------------------------------------
# report (no Dask, not cached: every run writes its own)


@task(name="report", retries=1, retry_delay_seconds=1, cache_policy=NONE)
def report_task(run_dir: str, *, stages: dict[str, dict], title: str, dashboard: str | None,
                notes: list[str] | None = None, artifact_key: str = "xmldask-report") -> dict:
    """Write ``report.md``, ``metrics.json``, ``stages.json`` and the plots into ``run_dir``; publish the artifact.

    The files are written into a local temporary directory, then copied to ``run_dir`` (any fsspec URL).
    """
    from prefect.artifacts import create_markdown_artifact

    from .report import plot_precision_at_k, tree_lines, write_report

    metrics = stages["evaluate"]["result"]
    with tempfile.TemporaryDirectory(prefix="xmldask-report-") as tmp:
        local = Path(tmp)
        plots = {}
        spectrum = stages.get("spectrum")
        if spectrum:
            for caption, key in (("Label frequency", "label_frequency_png"), ("Spectrum of Y^T Y", "spectrum_png")):
                fs, path = url_to_fs(spectrum["outputs"][key])
                fs.get_file(path, str(local / Path(path).name))
                plots[caption] = local / Path(path).name
        tree = stages.get("tree")
        if tree:
            fs, path = url_to_fs(tree["outputs"]["tree_png"])
            fs.get_file(path, str(local / "tree.png"))
            plots["Label tree: rows by leaf depth and by candidate count, recall by depth"] = local / "tree.png"
        plots["Precision at k"] = plot_precision_at_k(metrics, local / "precision_at_k.png")
        text = write_report(local, run_dir=run_dir, metrics=metrics, stages=stages, title=title, dashboard=dashboard,
                            notes=notes, plots=plots, sections=tree_lines(tree["result"]) if tree else None)
        upload(local, run_dir)
    create_markdown_artifact(markdown=text, key=artifact_key, description=f"xmldask report, {run_dir}")
    get_run_logger().info("report: %s", join(run_dir, "report.md"))
    return {"run_dir": run_dir, "report": join(run_dir, "report.md"), "metrics_json": join(run_dir, "metrics.json")}


@flow(name="xmldask-report", log_prints=True)
@interruptible
def report_flow(stages: dict[str, dict], *, title: str = "xmldask pipeline", dashboard: str | None = None,
                notes: list[str] | None = None, artifact_key: str = "xmldask-report", storage: str | None = None,
                run_dir: str | None = None) -> dict:
    """The report of a run from its stage records (``evaluate`` required, ``spectrum`` for its plots).

    Parameters
    ----------
    stages : dict
        Stage name to the record a stage flow returned.
    title, dashboard, notes
        The report's title, the Dask dashboard link, lines under the title.
    artifact_key : str
        Key of the Prefect Markdown artifact.
    storage, run_dir
        As :func:`ingest_flow`.

    Returns
    -------
    dict
        ``run_dir``, ``report`` and ``metrics_json`` (URLs).
    """
    return report_task(run_dir or new_run_dir(storage), stages=stages, title=title, dashboard=dashboard, notes=notes,
                       artifact_key=artifact_key)
