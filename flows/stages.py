"""Content fingerprints and the stage runner: a finished stage with the same inputs and parameters is reused.

A stage's output directory is content-addressed: ``<storage>/stages/<stage>-<fingerprint>/``, where the
fingerprint hashes the stage name, its version, its parameters and the fingerprints of its inputs. The
directory is written under a hidden temporary name and renamed into place only once complete, with its
record ``stage.json`` (inputs with their URLs and fingerprints, parameters, outputs, seconds, peak memory,
the Dask performance report). A stage whose directory exists is therefore finished and is reused; a
changed input or parameter gives another fingerprint, so only the stages that depend on it run again.

This module imports neither Prefect nor Dask at import time: the flows wrap :func:`run_stage` in tasks.
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import hashlib
import json
import logging
import os
import shutil
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

from xmldask.store import _fs, open_dataset, storage_root

__all__ = ["STAGE_VERSION", "dataset_fingerprint", "file_sha256", "fingerprint", "is_dataset_store", "run_stage",
           "stage_dir"]

logger = logging.getLogger(__name__)

#: bump to invalidate every stored stage (for instance when a stage's outputs change meaning)
STAGE_VERSION = 1
RECORD = "stage.json"


def _digest(obj) -> str:
    text = json.dumps(obj, sort_keys=True, default=str, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()


def fingerprint(stage: str, params: dict, inputs: dict[str, str]) -> str:
    """The fingerprint of a stage's output: ``sha256(stage, version, params, input fingerprints)``, 16 hex digits."""
    return _digest({"stage": stage, "version": STAGE_VERSION, "params": params, "inputs": inputs})[:16]


def file_sha256(path: str) -> str:
    """sha256 of a file's bytes (local path or fsspec URL)."""
    import fsspec

    digest = hashlib.sha256()
    with fsspec.open(path, "rb") as f:
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
    meta = open_dataset(url).meta
    content = {"sources": [s.get("sha256") for s in meta.get("sources") or []],
               "transforms": meta.get("transforms"), "n_samples": meta.get("n_samples"),
               "n_features": meta.get("n_features"), "n_labels": meta.get("n_labels")}
    if not content["sources"]:
        content["synthetic"] = meta.get("synthetic") or meta.get("generation")
    return _digest(content)[:16]


def stage_dir(stage: str, fp: str, *, storage: str | None = None) -> Path:
    """Where the stage with fingerprint ``fp`` keeps its outputs: ``<storage>/stages/<stage>-<fp>``."""
    root = storage_root(storage)
    if not _fs.is_local(root):
        raise ValueError(f"the flows keep stage outputs and reports on a local disk; {root!r} is not a local path "
                         "(give --storage a directory)")
    return Path(root) / "stages" / f"{stage}-{fp}"


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


def read_record(directory: Path) -> dict | None:
    """The ``stage.json`` of a finished stage directory, or None."""
    path = Path(directory) / RECORD
    if not path.is_file():
        return None
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def run_stage(stage: str, *, params: dict, inputs: dict[str, dict], compute: Callable[[Path], dict],
              storage: str | None = None, log: logging.Logger | logging.LoggerAdapter | None = None) -> dict:
    """Run a stage unless a finished one with the same fingerprint exists; returns its record.

    Parameters
    ----------
    stage : str
        Stage name (``ingest``, ``spectrum``, ``train``, ...).
    params : dict
        JSON-serialisable parameters that change the outputs.
    inputs : dict
        ``{name: {"url": ..., "fingerprint": ...}}`` of what the stage consumes.
    compute : callable
        ``compute(workdir) -> dict`` writes the outputs into ``workdir`` and returns
        ``{"outputs": {name: file name in workdir}, "result": small dict, "fingerprints": {name: fp}}``
        (``fingerprints`` optional: content fingerprints of outputs, default the stage fingerprint).
    storage : str, optional
        The storage root (default ``$XMLDASK_STORAGE`` or ``storage``).

    Returns
    -------
    dict
        The record: ``stage``, ``fingerprint``, ``params``, ``inputs``, ``outputs`` (name to URL),
        ``output_fingerprints``, ``result``, ``seconds``, ``peak_rss_mb``, ``performance_report``,
        ``started``, ``finished``, ``dir``, and ``reused`` (true if nothing was computed now).
    """
    log = log or logger
    fp = fingerprint(stage, params, {name: item["fingerprint"] for name, item in inputs.items()})
    final = stage_dir(stage, fp, storage=storage)
    record = read_record(final)
    if record is not None and all(Path(url).exists() for url in record["outputs"].values()):
        log.info("stage %s: reusing %s (computed %s in %.1f s)", stage, final, record["finished"], record["seconds"])
        return {**record, "reused": True}
    final.parent.mkdir(parents=True, exist_ok=True)
    work = final.parent / f".{final.name}.partial-{uuid.uuid4().hex[:12]}"
    work.mkdir()
    started, start = _now(), time.perf_counter()
    log.info("stage %s: computing into %s", stage, final)
    try:
        with peak_memory() as memory, _performance_report(work / "performance.html") as report:
            done = compute(work)
        seconds = time.perf_counter() - start
        # the jobs report the temporary paths they wrote: name the final ones instead
        result = json.loads(json.dumps(done.get("result", {}), default=str).replace(str(work), str(final)))
        outputs = {name: str(final / rel) for name, rel in done["outputs"].items()}
        record = {
            "stage": stage, "fingerprint": fp, "version": STAGE_VERSION, "params": params, "inputs": inputs,
            "outputs": outputs,
            "output_fingerprints": {name: (done.get("fingerprints") or {}).get(name, fp) for name in outputs},
            "result": result, "seconds": round(seconds, 3), "peak_rss_mb": memory["peak_rss_mb"],
            "start_rss_mb": memory["start_rss_mb"],
            "performance_report": str(final / "performance.html") if report is not None else None,
            "started": started, "finished": _now(), "dir": str(final),
        }
        (work / RECORD).write_text(json.dumps(record, indent=2, default=str) + "\n")
        if final.exists():  # an unfinished directory (no record) left by a killed run
            shutil.rmtree(final)
        os.replace(work, final)
    except BaseException:
        shutil.rmtree(work, ignore_errors=True)
        raise
    log.info("stage %s: done in %.1f s (peak memory %.0f MB)", stage, record["seconds"], record["peak_rss_mb"])
    return {**record, "reused": False}
