"""Scheduled data refresh: ingest new files exactly once, retrain, promote the new model only if it is not worse.

Layout under ``<storage>/refresh/`` (each overridable):

- ``incoming/``: drop new text files here (any format :func:`xmldask.io.ingest` reads).
- ``train.zarr``: the growing training dataset (created by the first file).
- ``ledger.json``: every file seen, by sha256: ``ingested`` (rows, time) or ``quarantined`` (error).
  A file whose checksum the ledger or the dataset's recorded sources already hold is skipped, so a
  file seen twice (under any name) is appended once.
- ``quarantine/``: files that failed validation, moved here with ``<name>.error.txt``; nothing of them
  is appended (an append that fails leaves the dataset as it was).
- ``current.json``: the promoted model (URL, fingerprint, held-out metrics, time).

After the pick-up the downstream stages of :mod:`flows.pipeline` run (reused where nothing changed);
the new model and the current one are evaluated on the same held-out test set and the new one is
promoted iff ``new[metric] >= current[metric]``. The report says which model is current and why.
"""

from __future__ import annotations

import datetime as _dt
import json
import os
import shutil
from pathlib import Path
from typing import Annotated, Literal

from prefect import flow, get_run_logger, task
from prefect.cache_policies import NONE
from pydantic import Field

from xmldask.cluster import cluster
from xmldask.store import exists, open_dataset, storage_root

from .pipeline import (
    Embedding,
    Kernel,
    PositiveInt,
    evaluate_stage,
    ingest_stage,
    new_run_dir,
    predict_stage,
    report_stage,
    run_downstream,
)
from .stages import file_sha256

__all__ = ["pick_up", "refresh"]


def _now() -> str:
    return _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds")


def _write_json(path: Path, obj) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(obj, indent=2, default=str) + "\n")
    os.replace(tmp, path)


def _read_json(path: Path, default):
    return json.loads(path.read_text()) if path.is_file() else default


@task(name="pick-up", retries=2, retry_delay_seconds=1, cache_policy=NONE)
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
    ledger_path, quarantine_dir = Path(ledger), Path(quarantine)
    book = _read_json(ledger_path, {"files": {}})
    out = {"ingested": [], "skipped": [], "quarantined": []}
    folder = Path(incoming)
    files = sorted(p for p in folder.iterdir() if p.is_file() and not p.name.startswith(".")) if folder.is_dir() else []
    for path in files:
        sha = file_sha256(str(path))
        known = {s.get("sha256") for s in open_dataset(dataset).meta.get("sources", [])} if exists(dataset) else set()
        entry = book["files"].get(sha)
        if sha in known or (entry and entry["status"] == "ingested"):
            log.info("skipping %s: already ingested (sha256 %s)", path.name, sha[:12])
            out["skipped"].append({"name": path.name, "sha256": sha})
            continue
        try:
            if exists(dataset):
                ds = ingest(str(path), dataset, append=True, format=format, one_based=one_based, normalize=normalize)
            else:
                ds = ingest(str(path), dataset, format=format, one_based=one_based, normalize=normalize)
        except Exception as exc:  # noqa: BLE001 - any failure quarantines the file; the dataset is unchanged
            quarantine_dir.mkdir(parents=True, exist_ok=True)
            target = quarantine_dir / path.name
            shutil.move(str(path), target)
            (quarantine_dir / f"{path.name}.error.txt").write_text(f"{type(exc).__name__}: {exc}\n")
            entry = {"name": path.name, "sha256": sha, "status": "quarantined", "error": f"{type(exc).__name__}: {exc}",
                     "moved_to": str(target), "at": _now()}
            log.warning("quarantined %s: %s", path.name, entry["error"])
            out["quarantined"].append(entry)
        else:
            rows = next((s["rows"] for s in reversed(ds.meta["sources"]) if s["sha256"] == sha), None)
            entry = {"name": path.name, "path": str(path), "sha256": sha, "status": "ingested", "rows": rows,
                     "at": _now(), "n_samples_after": ds.n_samples}
            log.info("ingested %s: %s rows (dataset now %d rows)", path.name, rows, ds.n_samples)
            out["ingested"].append(entry)
        book["files"][sha] = entry
        _write_json(ledger_path, book)
    return out


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
def refresh(test: list[str], *, incoming: str | None = None, dataset: str | None = None,
            storage: str | None = None, scheduler: str | None = None, n_workers: PositiveInt | None = None,
            threads_per_worker: PositiveInt | None = None, processes: bool | None = None,
            dashboard_address: str | None = ":8787", format: Literal["auto", "xc", "libsvm", "vw"] = "auto",
            one_based: bool = False, normalize: Literal["none", "l2", "l1", "sqrt"] = "none",
            embedding: Embedding = "rembrandt", k: PositiveInt = 64, kernel: Kernel = "gaussian", seed: int = 0,
            n_random_features: PositiveInt = 2000, max_epochs: PositiveInt = 10,
            top_k: Annotated[int, Field(ge=10)] = 10, spectrum_components: PositiveInt | None = 50,
            metric: str = "P@1") -> dict:
    """Pick up new files, append them once, retrain, and promote the new model if it is not worse.

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
    Other parameters as :func:`flows.pipeline.pipeline`.

    Returns
    -------
    dict
        ``ingested``, ``skipped``, ``quarantined`` (file lists), ``promoted`` (bool), ``decision`` (text),
        ``current`` (the current model record), ``metrics`` (of the new model), ``stages``, ``run_dir``.
    """
    log = get_run_logger()
    base = Path(storage_root(storage)) / "refresh"
    incoming = incoming or str(base / "incoming")
    dataset = dataset or str(base / "train.zarr")
    current_path = base / "current.json"
    with cluster(scheduler, n_workers=n_workers, threads_per_worker=threads_per_worker, processes=processes,
                 dashboard_address=dashboard_address) as client:
        dashboard = client.dashboard_link if dashboard_address is not None or scheduler else None
        log.info("Dask dashboard: %s", dashboard or "none")
        picked = pick_up(incoming, dataset, ledger=str(base / "ledger.json"), quarantine=str(base / "quarantine"),
                         format=format, one_based=one_based, normalize=normalize)
        if not exists(dataset):
            raise FileNotFoundError(f"no training data yet: {dataset} does not exist and {incoming} held no valid "
                                    "file; drop text files into the incoming folder")
        stages = {"ingest-train": ingest_stage([dataset], split="train", storage=storage)}
        stages["ingest-test"] = ingest_stage(list(test), split="test", like=stages["ingest-train"], storage=storage,
                                             format=format, one_based=one_based, normalize=normalize)
        stages.update(run_downstream(stages["ingest-train"], stages["ingest-test"], storage=storage,
                                     embedding=embedding, k=k, kernel=kernel, seed=seed,
                                     n_random_features=n_random_features, max_epochs=max_epochs, top_k=top_k,
                                     spectrum_components=spectrum_components))
        new_metrics = stages["evaluate"]["result"]
        current = _read_json(current_path, None)
        current_metrics = None
        if current is not None and current["fingerprint"] == stages["train"]["fingerprint"]:
            promote, decision = False, f"unchanged: the current model is this one ({metric} {new_metrics[metric]:.4f})"
        else:
            if current is not None:  # evaluate the current model on the same test set and propensities
                model = {"outputs": {"model": current["model"]},
                         "output_fingerprints": {"model": current["fingerprint"]}}
                old_pred = predict_stage(model, stages["ingest-test"], storage=storage, top_k=top_k)
                old_eval = evaluate_stage(old_pred, stages["ingest-test"], stages["ingest-train"], storage=storage)
                current_metrics = old_eval["result"]
                stages["predict-current"], stages["evaluate-current"] = old_pred, old_eval
            promote, decision = _decide(new_metrics, current_metrics, metric)
        if promote:
            current = {"model": stages["train"]["outputs"]["model"], "fingerprint": stages["train"]["fingerprint"],
                       "train": stages["ingest-train"]["outputs"]["data"], "metric": metric,
                       "metrics": {key: new_metrics[key] for key in new_metrics if "@" in key}, "promoted_at": _now()}
            _write_json(current_path, current)
        log.info("%s", decision)
        notes = [f"**Model decision:** {decision}.", "",
                 f"Current model: `{current['model']}`", "",
                 f"New files ingested: {', '.join(f['name'] for f in picked['ingested']) or 'none'}; "
                 f"skipped (seen before): {', '.join(f['name'] for f in picked['skipped']) or 'none'}; "
                 f"quarantined: {', '.join(f['name'] for f in picked['quarantined']) or 'none'}."]
        notes += [f"- quarantined `{f['name']}`: {f['error']}" for f in picked["quarantined"]]
        run_dir = new_run_dir(storage, {name: rec["fingerprint"] for name, rec in stages.items()})
        out = report_stage(str(run_dir), stages=stages, title=f"xmldask refresh of {dataset}", dashboard=dashboard,
                           notes=notes, artifact_key="xmldask-refresh-report")
    return {**picked, **out, "promoted": promote, "decision": decision, "current": current,
            "metrics": new_metrics, "current_metrics": current_metrics,
            "stages": {name: {key: rec.get(key) for key in ("reused", "fingerprint", "dir")}
                       for name, rec in stages.items()}}
