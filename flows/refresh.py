"""Scheduled data refresh: ingest new files exactly once, retrain, promote the new model only if it is not worse.

Layout under ``<storage>/refresh/`` (each overridable; paths or fsspec URLs):

- ``incoming/``: drop new text files here (any format :func:`xmldask.io.ingest` reads).
- ``train.zarr``: the growing training dataset (created by the first file).
- ``ledger.json``: every file seen, by sha256: ``ingested`` (rows, time) or ``quarantined`` (error).
  A file whose checksum the ledger or the dataset's recorded sources already hold is skipped, so a
  file seen twice (under any name) is appended once.
- ``quarantine/``: files that failed validation, moved here with ``<name>.error.txt``; nothing of them
  is appended (an append that fails leaves the dataset as it was).
- ``models/<fingerprint>.zarr``: a copy of each promoted model (kept when old run directories are
  deleted); ``current.json``: the promoted model (URL, fingerprint, held-out metrics, time).

After the pick-up the stage flows of :mod:`flows.pipeline` run (Prefect cache hits where nothing
changed); the new model and the current one are evaluated on the same held-out test set and the new
one is promoted iff ``new[metric] >= current[metric]``. The report says which model is current and why.
"""


import datetime as _dt
from typing import Annotated

from fsspec.core import url_to_fs
from prefect import flow, get_run_logger, task
from prefect.cache_policies import NONE
from pydantic import Field

from xmldask.embedding.spectrum import SPECTRUM_COMPONENTS
from xmldask.models import DEFAULTS, TrainParams
from xmldask.params import TOP_K
from xmldask.store import StoreBusyError, exists, is_local, open_dataset, publish, temporary_sibling

from .pipeline import run_downstream, summary
from .stage_flows import (
    Format,
    LocalClusterOptions,
    Normalize,
    PositiveInt,
    dask_client,
    evaluate_flow,
    ingest_flow,
    interruptible,
    new_run_dir,
    output,
    predict_flow,
    report_flow,
)
from .stages import file_sha256, join, read_state, root_url, write_json

__all__ = ["pick_up", "refresh"]


def _now() -> str:
    return _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds")


def _files(folder: str) -> list[str]:
    """URLs of the files directly in ``folder`` (hidden ones left out), by name; none if it does not exist."""
    fs, path = url_to_fs(folder)
    if not fs.isdir(path):
        return []
    names = sorted(info["name"] for info in fs.ls(path, detail=True) if info["type"] == "file")
    names = [name for name in names if not name.rstrip("/").rpartition("/")[2].startswith(".")]
    return names if is_local(folder) else [fs.unstrip_protocol(name) for name in names]


def _quarantine(url: str, folder: str, error: str) -> str:
    """Move the file ``url`` into ``folder`` beside ``<name>.error.txt``; returns its new URL.

    A name already in the quarantine (an earlier file of the same name) gets a counter, ``a-2.txt``:
    no quarantined file or error record is ever overwritten.
    """
    name = url.rstrip("/").rpartition("/")[2]
    fs, path = url_to_fs(url)
    fs.makedirs(url_to_fs(folder)[1], exist_ok=True)
    stem, dot, ext = name.partition(".")
    target, n = join(folder, name), 1
    while fs.exists(url_to_fs(target)[1]) or fs.exists(url_to_fs(f"{target}.error.txt")[1]):
        n += 1
        target = join(folder, f"{stem}-{n}{dot}{ext}")
    fs.mv(path, url_to_fs(target)[1])
    with fs.open(url_to_fs(f"{target}.error.txt")[1], "w") as f:
        f.write(error + "\n")
    return target


def _io_failure(task, task_run, state) -> bool:
    """Retry only what may pass on a second try: I/O errors and a dataset busy with another writer,
    never a deterministic failure such as a parse error or a damaged store."""
    try:
        state.result()
    except (OSError, StoreBusyError):
        return True
    except BaseException:  # noqa: BLE001 - any other failure is deterministic
        return False
    return False


@task(name="pick-up", retries=2, retry_delay_seconds=1, retry_condition_fn=_io_failure, cache_policy=NONE)
def pick_up(incoming: str, dataset: str, *, ledger: str, quarantine: str, format: str = "auto",
            one_based: bool = False, normalize: str = "none") -> dict:
    """Append every new file of ``incoming`` to ``dataset`` once; quarantine the files that fail validation.

    Idempotent (safe to retry): a file is skipped if its sha256 is in the ledger or among the dataset's
    recorded sources, so a crash between the append and the ledger update appends nothing twice.

    Returns
    -------
    dict
        ``ingested``, ``skipped``, ``quarantined``: lists of ``{"name", "sha256", ...}``.
    """
    from xmldask.io import ingest

    log = get_run_logger()
    book = read_state(ledger, {"files": {}})
    out = {"ingested": [], "skipped": [], "quarantined": []}
    for url in _files(incoming):
        name = url.rpartition("/")[2]
        sha = file_sha256(url)
        known = {s.get("sha256") for s in open_dataset(dataset).meta.get("sources", [])} if exists(dataset) else set()
        entry = book["files"].get(sha)
        if sha in known or (entry and entry["status"] == "ingested"):
            log.info("skipping %s: already ingested (sha256 %s)", name, sha[:12])
            out["skipped"].append({"name": name, "sha256": sha})
            continue
        try:
            ds = ingest(url, dataset, append=exists(dataset), format=format, one_based=one_based, normalize=normalize)
        except StoreBusyError:
            raise  # another writer appends to the dataset: the file is fine, the task retries
        except Exception as exc:  # noqa: BLE001 - any failure quarantines the file; the dataset is unchanged
            error = f"{type(exc).__name__}: {exc}"
            entry = {"name": name, "sha256": sha, "status": "quarantined", "error": error,
                     "moved_to": _quarantine(url, quarantine, error), "at": _now()}
            log.warning("quarantined %s: %s", name, error)
            out["quarantined"].append(entry)
        else:
            rows = next((s["rows"] for s in reversed(ds.meta["sources"]) if s["sha256"] == sha), None)
            entry = {"name": name, "path": url, "sha256": sha, "status": "ingested", "rows": rows, "at": _now(),
                     "n_samples_after": ds.n_samples}
            log.info("ingested %s: %s rows (dataset now %d rows)", name, rows, ds.n_samples)
            out["ingested"].append(entry)
        book["files"][sha] = entry
        write_json(ledger, book, keep_previous=True)
    return out


@task(name="promote", retries=2, retry_delay_seconds=1, cache_policy=NONE)
def promote(model: dict, *, models: str) -> str:
    """Copy the model store ``model["url"]`` to ``<models>/<fingerprint>.zarr`` (kept if present); returns its URL."""
    target = join(models, f"{model['fingerprint']}.zarr")
    if not exists(target):
        fs, src = url_to_fs(model["url"])
        tmp = temporary_sibling(target)
        fs.copy(src, url_to_fs(tmp)[1], recursive=True)
        publish(tmp, target)
    return target


def _decide(new: dict, current: dict | None, metric: str) -> tuple[bool, str]:
    """Promote iff there is no current model or ``new[metric] >= current[metric]``; returns (promote, reason)."""
    if current is None:
        return True, f"promoted the new model: there was no current model ({metric} {new[metric]:.4f})"
    if new[metric] >= current[metric]:
        return True, (f"promoted the new model: {metric} {new[metric]:.4f} >= {current[metric]:.4f} of the previous "
                      "model")
    return False, (f"kept the previous model: the new model's {metric} {new[metric]:.4f} is worse than "
                   f"{current[metric]:.4f}")


@flow(name="xmldask-refresh", log_prints=True)
@interruptible
def refresh(test: list[str], *, incoming: str | None = None, dataset: str | None = None,
            storage: str | None = None, scheduler: str | None = None, n_workers: PositiveInt | None = None,
            threads_per_worker: PositiveInt | None = None, processes: bool | None = None,
            dashboard_address: str | None = ":8787", format: Format = "auto", one_based: bool = False,
            normalize: Normalize = "none", model: TrainParams = DEFAULTS,
            top_k: Annotated[int, Field(ge=TOP_K)] = TOP_K,
            spectrum_components: PositiveInt | None = SPECTRUM_COMPONENTS, metric: str = "P@1") -> dict:
    """Pick up new files, append them once, retrain, and promote the new model if it is not worse.

    The parameters not listed here are those of :func:`flows.pipeline.pipeline`.

    Parameters
    ----------
    test : list of str
        The held-out test set: text file(s) or a dataset store; both models are evaluated on it.
    incoming : str, optional
        Folder of new files (default ``<storage>/refresh/incoming``).
    dataset : str, optional
        The training dataset store to grow (default ``<storage>/refresh/train.zarr``).
    metric : str, default "P@1"
        The held-out metric of the promotion rule (larger is better).

    Returns
    -------
    dict
        ``ingested``, ``skipped``, ``quarantined`` (file lists), ``promoted`` (bool), ``decision`` (text),
        ``current`` (the current model record), ``metrics`` (of the new model), ``stages``, ``run_dir``.
    """
    log = get_run_logger()
    base = join(root_url(storage), "refresh")
    incoming = incoming or join(base, "incoming")
    dataset = dataset or join(base, "train.zarr")
    current_path = join(base, "current.json")
    run_dir = new_run_dir(storage)
    local = LocalClusterOptions(n_workers=n_workers, threads_per_worker=threads_per_worker, processes=processes,
                                dashboard_address=dashboard_address)
    with dask_client(scheduler, local) as dask:
        picked = pick_up(incoming, dataset, ledger=join(base, "ledger.json"), quarantine=join(base, "quarantine"),
                         format=format, one_based=one_based, normalize=normalize)
        if not exists(dataset):
            raise FileNotFoundError(f"no training data yet: {dataset} does not exist and {incoming} held no valid "
                                    "file; drop text files into the incoming folder")
        where = {"storage": storage, "run_dir": run_dir}
        stages = {"ingest-train": ingest_flow([dataset], split="train", **where)}
        stages["ingest-test"] = ingest_flow(list(test), split="test", like=dataset, format=format,
                                            one_based=one_based, normalize=normalize, **where)
        stages.update(run_downstream(stages["ingest-train"], stages["ingest-test"], model=model, top_k=top_k,
                                     spectrum_components=spectrum_components, **where))
        new_metrics = stages["evaluate"]["result"]
        new_model = output(stages["train"], "model")
        current = read_state(current_path, None)
        current_metrics = None
        if current is not None and current["fingerprint"] == new_model["fingerprint"]:
            promote_it = False
            decision = f"unchanged: the current model is this one ({metric} {new_metrics[metric]:.4f})"
        else:
            if current is not None:  # evaluate the current model on the same test set and propensities
                model = {"url": current["model"], "fingerprint": current["fingerprint"]}
                test_data, train_data = output(stages["ingest-test"], "data"), output(stages["ingest-train"], "data")
                old_pred = predict_flow(model, test_data, top_k=top_k, name="predict-current", **where)
                old_eval = evaluate_flow(output(old_pred, "predictions"), test_data, train_data,
                                         name="evaluate-current", **where)
                current_metrics = old_eval["result"]
                stages["predict-current"], stages["evaluate-current"] = old_pred, old_eval
            promote_it, decision = _decide(new_metrics, current_metrics, metric)
        if promote_it:
            current = {"model": promote(new_model, models=join(base, "models")),
                       "fingerprint": new_model["fingerprint"], "trained_in": new_model["url"],
                       "train": stages["ingest-train"]["outputs"]["data"], "metric": metric,
                       "metrics": {key: new_metrics[key] for key in new_metrics if "@" in key}, "promoted_at": _now()}
            write_json(current_path, current, keep_previous=True)
        log.info("%s", decision)
        notes = [f"**Model decision:** {decision}.", "",
                 f"Current model: `{current['model']}`", "",
                 f"New files ingested: {', '.join(f['name'] for f in picked['ingested']) or 'none'}; "
                 f"skipped (seen before): {', '.join(f['name'] for f in picked['skipped']) or 'none'}; "
                 f"quarantined: {', '.join(f['name'] for f in picked['quarantined']) or 'none'}."]
        notes += [f"- quarantined `{f['name']}`: {f['error']}" for f in picked["quarantined"]]
        out = report_flow(stages, title=f"xmldask refresh of {dataset}", dashboard=dask.dashboard, notes=notes,
                          artifact_key="xmldask-refresh-report", run_dir=run_dir)
    return {**picked, **out, "promoted": promote_it, "decision": decision, "current": current,
            "metrics": new_metrics, "current_metrics": current_metrics, "stages": summary(stages)}
