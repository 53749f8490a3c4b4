"""Content fingerprints, store locations and the stage writer (no Prefect, no Dask at import time).

A stage writes its outputs into one directory, ``<storage>/runs/<run>/<stage>/`` (any fsspec URL):
first under a hidden temporary name beside it, then moved into place, and last its record
``stage.json`` (inputs with their URLs and content fingerprints, parameters, outputs, seconds, peak
memory, the Dask performance report). A directory without a record is unfinished and never reused.

Reuse is the flows' business (:mod:`flows.stage_flows`: Prefect's cache, keyed on
:func:`cache_key`); :func:`outputs_complete` tells them whether a cached record still points at
outputs that exist.
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import hashlib
import json
import logging
import shutil
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

from fsspec.core import url_to_fs

from xmldask.store import exists, is_local, open_dataset, publish, remove, storage_root, temporary_sibling

__all__ = ["PREVIOUS", "RECORD", "STAGE_VERSION", "StateFileError", "cache_key", "dataset_fingerprint",
           "file_sha256", "fingerprint", "is_dataset_store", "join", "outputs_complete", "read_json", "read_state",
           "root_url", "run_stage", "store_ref", "write_json"]

logger = logging.getLogger(__name__)

#: bump to invalidate every cached stage (for instance when a stage's outputs change meaning)
STAGE_VERSION = 2
RECORD = "stage.json"


# --------------------------------------------------------------------------------------------------
# locations: local paths and fsspec URLs alike


def root_url(storage: str | None = None) -> str:
    """The storage root (:func:`xmldask.store.storage_root`); a local one as an absolute path."""
    root = storage_root(storage).rstrip("/")
    if is_local(root):
        return str(Path(url_to_fs(root)[1]).resolve())
    return root


def join(base: str, *names: str) -> str:
    """``base/name/...`` for a local path or an fsspec URL."""
    return "/".join([str(base).rstrip("/"), *(str(n).strip("/") for n in names)])


def read_json(url: str, default=None):
    """The JSON document at ``url``, or ``default`` if there is none (or it is unreadable)."""
    fs, path = url_to_fs(url)
    try:
        with fs.open(path, "r") as f:
            return json.load(f)
    except (OSError, ValueError):
        return default


#: suffix of the copy of a state file that its last write replaced (:func:`write_json` with ``keep_previous``)
PREVIOUS = ".previous"


class StateFileError(ValueError):
    """A state file of the flows (the refresh ledger, the current model) exists but cannot be read."""


def read_state(url: str, default):
    """The JSON state file at ``url``, ``default`` if there is none; a file that exists but does not parse is a
    :class:`StateFileError` naming it and the kept previous version (never read as absent: a state reset
    silently would forget what it records)."""
    fs, path = url_to_fs(url)
    if not fs.exists(path):
        return default
    try:
        with fs.open(path, "r") as f:
            return json.load(f)
    except (OSError, ValueError) as exc:
        previous = f"{url}{PREVIOUS}"
        fix = (f"restore the previous version, kept as {previous} (copy it over {url})" if fs.exists(path + PREVIOUS)
               else f"no previous version is kept; remove {url} to start this record afresh")
        raise StateFileError(f"{url} cannot be read ({exc}): {fix}") from None


def write_json(url: str, obj, *, keep_previous: bool = False) -> None:
    """Write ``obj`` as JSON to ``url`` (atomically on a local disk: a temporary file renamed into place);
    ``keep_previous``: the version it replaces is kept as ``url + ".previous"`` (:func:`read_state` names it)."""
    text = json.dumps(obj, indent=2, sort_keys=True, default=str) + "\n"
    fs, path = url_to_fs(url)
    parent = path.rsplit("/", 1)[0]
    if parent:
        fs.makedirs(parent, exist_ok=True)
    if is_local(url):
        if keep_previous and Path(path).exists():
            kept = Path(path).with_name(f".{Path(path).name}{PREVIOUS}.tmp")
            shutil.copyfile(path, kept)
            kept.replace(path + PREVIOUS)
        tmp = Path(path).with_name(f".{Path(path).name}.tmp")
        tmp.write_text(text)
        tmp.replace(path)
    else:
        if keep_previous and fs.exists(path):
            fs.copy(path, path + PREVIOUS)
        with fs.open(path, "w") as f:
            f.write(text)


def upload(local_dir: Path, url: str) -> None:
    """Copy the files of ``local_dir`` (not its subdirectories) into the directory ``url``."""
    fs, path = url_to_fs(url)
    fs.makedirs(path, exist_ok=True)
    for file in sorted(Path(local_dir).iterdir()):
        if file.is_file():
            fs.put_file(str(file), f"{path.rstrip('/')}/{file.name}")


# --------------------------------------------------------------------------------------------------
# fingerprints


def _digest(obj) -> str:
    text = json.dumps(obj, sort_keys=True, default=str, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()


def fingerprint(stage: str, params: dict, inputs: dict[str, str]) -> str:
    """The fingerprint of a stage's output: ``sha256(stage, version, params, input fingerprints)``, 16 hex digits."""
    return _digest({"stage": stage, "version": STAGE_VERSION, "params": params, "inputs": inputs})[:16]


def cache_key(context, parameters: dict) -> str:
    """Prefect ``cache_key_fn`` of a stage task ``task(inputs, params, out)``: ``<stage>-<fingerprint>``.

    The key is the stage name and its :func:`fingerprint` (parameters and the content fingerprints of
    the inputs); where the outputs go (``out``) is not part of it.
    """
    stage = context.task.name
    inputs = {name: item["fingerprint"] for name, item in parameters["inputs"].items()}
    return f"{stage}-{fingerprint(stage, parameters['params'], inputs)}"


def file_sha256(path: str) -> str:
    """sha256 of a file's bytes (local path or fsspec URL)."""
    fs, p = url_to_fs(path)
    digest = hashlib.sha256()
    with fs.open(p, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            digest.update(chunk)
    return digest.hexdigest()


def is_dataset_store(url: str) -> bool:
    """Whether ``url`` is an existing xmldask dataset store (rather than a text file)."""
    try:
        open_dataset(url)
    except Exception:  # noqa: BLE001 - anything that is not a readable dataset store is a source file
        return False
    return True


def dataset_fingerprint(url: str) -> str:
    """Content fingerprint of a dataset store: its sources' sha256s, transforms, dimensions and row count.

    Two stores ingested from the same files with the same transforms have the same fingerprint, wherever
    they are. A store without recorded sources (e.g. from :func:`xmldask.datasets.make_synthetic`) is
    fingerprinted by its generator parameters, else by its commit ``generation``.
    """
    return open_dataset(url).fingerprint


def _listing_fingerprint(url: str) -> str:
    """Fingerprint of any store from its file names, sizes and root metadata (reads no chunk)."""
    fs, path = url_to_fs(url)
    base = path.rstrip("/")
    files = fs.find(base, detail=True)
    listing = sorted((name[len(base):], info.get("size")) for name, info in files.items())
    root = f"{base}/zarr.json"
    meta = fs.cat_file(root).decode() if root in files else None
    return _digest({"files": listing, "zarr.json": meta})[:16]


def store_ref(value: str | dict) -> dict[str, str]:
    """``{"url", "fingerprint"}`` of a store given by its URL (or such a dict, returned as it is).

    The fingerprint of a stage's output is the one its record (``stage.json`` beside it) holds; a
    dataset store's is :func:`dataset_fingerprint`; any other store's comes from its file listing.
    """
    if isinstance(value, dict):
        return {"url": value["url"], "fingerprint": value["fingerprint"]}
    url = str(value).rstrip("/")
    parent, _, name = url.rpartition("/")
    record = read_json(join(parent, RECORD)) if parent else None
    for key, output in ((record or {}).get("outputs") or {}).items():
        if output.rstrip("/").rpartition("/")[2] == name:
            return {"url": url, "fingerprint": record["output_fingerprints"][key]}
    if not exists(url):
        raise FileNotFoundError(f"no store at {url}: give the URL of an existing store (or its stage record)")
    return {"url": url, "fingerprint": dataset_fingerprint(url) if is_dataset_store(url) else _listing_fingerprint(url)}


# --------------------------------------------------------------------------------------------------
# the stage writer


def _now() -> str:
    return _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds")


@contextlib.contextmanager
def peak_memory(interval: float = 0.1) -> Iterator[dict]:
    """Sample the resident memory of this process and its children (local Dask workers); yields a dict.

    On exit the dict holds ``peak_rss_mb`` (the largest sum seen) and ``start_rss_mb``. Workers of a
    remote scheduler are not children of this process and are not counted.
    """
    import psutil

    me = psutil.Process()

    def rss() -> int:
        total = 0
        for proc in [me, *me.children(recursive=True)]:
            with contextlib.suppress(psutil.Error):
                total += proc.memory_info().rss
        return total

    out = {"start_rss_mb": round(rss() / 2**20, 1)}
    peak = [rss()]
    stop = threading.Event()

    def sample():
        while not stop.wait(interval):
            peak[0] = max(peak[0], rss())

    thread = threading.Thread(target=sample, name="xmldask-peak-memory", daemon=True)
    thread.start()
    try:
        yield out
    finally:
        stop.set()
        thread.join()
        out["peak_rss_mb"] = round(max(peak[0], rss()) / 2**20, 1)


@contextlib.contextmanager
def _performance_report(path: Path):
    """A Dask performance report of the block if a distributed client is running, else nothing."""
    try:
        from distributed import default_client, performance_report

        default_client()
    except (ImportError, ValueError):
        yield None
        return
    with performance_report(filename=str(path)):
        yield path


def outputs_complete(record: dict | None) -> bool:
    """Whether a stage record's directory still holds its record and every output it names."""
    if not record or not record.get("dir"):
        return False
    urls = [join(record["dir"], RECORD), *record.get("outputs", {}).values()]
    return all(exists(url) for url in urls)


def run_stage(stage: str, *, params: dict, inputs: dict[str, dict], compute: Callable[[str, Path], dict], out: str,
              log: logging.Logger | logging.LoggerAdapter | None = None,
              on_dask: Callable[[], None] | None = None) -> dict:
    """Compute a stage into the directory ``out`` (path or fsspec URL) and return its record.

    Parameters
    ----------
    stage : str
        Stage name (``ingest``, ``spectrum``, ``train``, ...).
    params : dict
        JSON-serialisable parameters that change the outputs.
    inputs : dict
        ``{name: {"url": ..., "fingerprint": ...}}`` of what the stage consumes.
    compute : callable
        ``compute(work, scratch) -> dict`` writes stores under the URL ``work`` and small files (plots,
        JSON) into the local directory ``scratch`` (copied into ``work`` afterwards); it returns
        ``{"outputs": {name: file name in work}, "result": small dict, "fingerprints": {name: fp}}``
        (``fingerprints`` optional: content fingerprints of outputs, default the stage fingerprint).
    out : str
        The stage directory. An existing one is replaced (a retry's, or an unfinished one).
    log : logger, optional
    on_dask : callable, optional
        For a stage that computes on Dask: starts the run's client before the stage's performance report
        (``performance.html``, kept with the outputs) begins.

    Returns
    -------
    dict
        The record, also written last as ``out/stage.json``: ``stage``, ``fingerprint``, ``params``,
        ``inputs``, ``outputs`` (name to URL), ``output_fingerprints``, ``result``, ``seconds``,
        ``peak_rss_mb``, ``performance_report``, ``started``, ``finished``, ``dir``.
    """
    log = log or logger
    out = str(out).rstrip("/")
    fp = fingerprint(stage, params, {name: item["fingerprint"] for name, item in inputs.items()})
    work = temporary_sibling(out)
    fs, work_path = url_to_fs(work)
    fs.makedirs(work_path, exist_ok=True)
    started, start = _now(), time.perf_counter()
    log.info("stage %s: computing into %s", stage, out)
    try:
        if on_dask is not None:
            on_dask()
        with tempfile.TemporaryDirectory(prefix=f"xmldask-{stage}-") as scratch:
            with peak_memory() as memory, _performance_report(Path(scratch) / "performance.html") as report:
                done = compute(work, Path(scratch))
            upload(Path(scratch), work)
        publish(work, out, overwrite=True)
    except BaseException as exc:
        remove(work)
        from xmldask.cluster import WorkerLost, lost_workers, paused_out, worker_loss_error

        why = paused_out()
        if why:  # the workers stayed paused for memory and the job was cancelled: say so, not the task's error
            raise MemoryError(f"stage {stage}: {why}") from None
        lost = lost_workers() if worker_loss_error(exc) else ""
        if lost:  # a worker restarted (or died) and took the job's data: name it, not the cancelled task
            raise WorkerLost(f"stage {stage}: {lost} ({type(exc).__name__}: {exc})") from exc
        raise
    seconds = time.perf_counter() - start
    # the jobs report the temporary paths they wrote: name the final ones instead
    result = json.loads(json.dumps(done.get("result", {}), default=str).replace(work, out))
    outputs = {name: join(out, rel) for name, rel in done["outputs"].items()}
    record = {
        "stage": stage, "fingerprint": fp, "version": STAGE_VERSION, "params": params, "inputs": inputs,
        "outputs": outputs,
        "output_fingerprints": {name: (done.get("fingerprints") or {}).get(name, fp) for name in outputs},
        # what was fitted (a search's choice, the family model=auto chose), beside what was asked ("params")
        **({"fitted_params": result["params"]} if isinstance(result.get("params"), dict) else {}),
        "result": result, "seconds": round(seconds, 3), "peak_rss_mb": memory["peak_rss_mb"],
        "start_rss_mb": memory["start_rss_mb"],
        "performance_report": join(out, "performance.html") if report is not None else None,
        "started": started, "finished": _now(), "dir": out,
    }
    write_json(join(out, RECORD), record)
    log.info("stage %s: done in %.1f s (peak memory %.0f MB)", stage, record["seconds"], record["peak_rss_mb"])
    return record
