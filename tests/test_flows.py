"""The Prefect flows on tiny synthetic data: end to end, reuse of finished stages, data refresh."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from flows.pipeline import pipeline
from flows.refresh import refresh
from xmldask.datasets import write_synthetic_text

DIMS = {"n_features": 1000, "n_labels": 100}
#: a small model: seconds per stage on 2 cores
MODEL = {"k": 8, "n_random_features": 100, "max_epochs": 2, "spectrum_components": 10}


pytestmark = pytest.mark.usefixtures("prefect_harness")


@pytest.fixture(scope="module")
def scheduler():
    """One in-process LocalCluster shared by the tests (each flow connects its own client)."""
    from distributed import LocalCluster

    with LocalCluster(n_workers=1, threads_per_worker=2, processes=False, dashboard_address=":0") as local:
        yield local.scheduler_address


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("flows-data")
    out = {}
    for split, n in (("train", 1500), ("test", 300), ("more", 300), ("more2", 300)):
        out[split] = write_synthetic_text(str(root / f"{split}.txt.gz"), n_samples=n, split=split, seed=0, **DIMS)
    return out


@pytest.fixture(scope="module")
def storage(tmp_path_factory) -> str:
    return str(tmp_path_factory.mktemp("flows-storage"))


@pytest.fixture(scope="module")
def first_run(data, storage, scheduler) -> dict:
    return pipeline([data["train"]], [data["test"]], storage=storage, scheduler=scheduler, **MODEL)


STAGES = ["ingest-train", "ingest-test", "spectrum", "train", "predict", "evaluate"]


def computed(result: dict) -> list[str]:
    return [name for name, rec in result["stages"].items() if not rec["reused"]]


def test_pipeline_end_to_end(first_run):
    assert computed(first_run) == STAGES
    run = Path(first_run["run_dir"])
    metrics = json.loads((run / "metrics.json").read_text())
    for key in ("P@1", "P@3", "P@5", "nDCG@5", "PSP@5", "P@10"):
        assert 0 <= metrics[key] <= 1
    assert metrics["P@1"] > 0.05  # far better than chance (1 / 100 labels)
    report = (run / "report.md").read_text()
    assert "| P@1 |" in report and "| train | computed |" in report
    for png in ("label_frequency.png", "spectrum.png", "precision_at_k.png"):
        assert (run / png).stat().st_size > 0
    for name, rec in first_run["stages"].items():
        assert (Path(rec["dir"]) / "stage.json").is_file(), name
    assert (Path(first_run["stages"]["train"]["dir"]) / "performance.html").is_file()
    record = json.loads((Path(first_run["stages"]["train"]["dir"]) / "stage.json").read_text())
    assert record["inputs"]["train"]["fingerprint"] and record["peak_rss_mb"] > 0


def test_rerun_reuses_every_stage(first_run, data, storage, scheduler):
    again = pipeline([data["train"]], [data["test"]], storage=storage, scheduler=scheduler, **MODEL)
    assert computed(again) == []
    assert again["metrics"] == first_run["metrics"]
    assert again["run_dir"] != first_run["run_dir"]
    assert "| train | reused |" in Path(again["report"]).read_text()


def test_store_urls_are_used_as_they_are(first_run, data, storage, scheduler):
    """The ingested stores as inputs have the same content fingerprints: everything downstream is reused."""
    train = str(Path(first_run["stages"]["ingest-train"]["dir"]) / "data.zarr")
    test = str(Path(first_run["stages"]["ingest-test"]["dir"]) / "data.zarr")
    again = pipeline([train], [test], storage=storage, scheduler=scheduler, **MODEL)
    assert computed(again) == []
    assert again["metrics"]["P@1"] == first_run["metrics"]["P@1"]


def test_parameter_change_recomputes_only_later_stages(first_run, data, storage, scheduler):
    more = pipeline([data["train"]], [data["test"]], storage=storage, scheduler=scheduler, **{**MODEL, "top_k": 12})
    assert computed(more) == ["predict", "evaluate"]
    other = pipeline([data["train"]], [data["test"]], storage=storage, scheduler=scheduler, **{**MODEL, "k": 4})
    assert computed(other) == ["train", "predict", "evaluate"]
    assert other["stages"]["spectrum"]["fingerprint"] == first_run["stages"]["spectrum"]["fingerprint"]


def test_parameters_are_validated(storage):
    from prefect.exceptions import ParameterTypeError

    with pytest.raises(ParameterTypeError):
        pipeline(storage=storage, k=0)
    with pytest.raises(ParameterTypeError):
        pipeline(storage=storage, embedding="nope")


def test_refresh_ingests_once_quarantines_and_promotes_by_the_metric(data, tmp_path, scheduler):
    storage = str(tmp_path / "storage")
    incoming = tmp_path / "storage" / "refresh" / "incoming"
    incoming.mkdir(parents=True)
    dataset = tmp_path / "storage" / "refresh" / "train.zarr"
    opts = {"storage": storage, "scheduler": scheduler, **MODEL}

    shutil.copy(data["train"], incoming / "part-000.txt.gz")
    first = refresh([data["test"]], **opts)
    assert [f["name"] for f in first["ingested"]] == ["part-000.txt.gz"] and first["promoted"]
    from xmldask.store import open_dataset

    assert open_dataset(str(dataset)).n_samples == 1500

    # the same file again, under another name too, and a malformed file: nothing appended
    shutil.copy(data["train"], incoming / "copy-of-part-000.txt.gz")
    (incoming / "bad.txt").write_text("this is not\nan XC file\n")
    generation = open_dataset(str(dataset)).meta["generation"]
    second = refresh([data["test"]], **opts)
    assert {f["name"] for f in second["skipped"]} == {"part-000.txt.gz", "copy-of-part-000.txt.gz"}
    assert [f["name"] for f in second["quarantined"]] == ["bad.txt"] and second["ingested"] == []
    assert open_dataset(str(dataset)).meta["generation"] == generation
    assert not (incoming / "bad.txt").exists()
    quarantine = tmp_path / "storage" / "refresh" / "quarantine"
    assert (quarantine / "bad.txt").exists() and (quarantine / "bad.txt.error.txt").read_text()
    assert not second["promoted"] and second["decision"].startswith("unchanged")
    assert set(computed(second)) == set()  # nothing new: every stage reused
    ledger = json.loads((tmp_path / "storage" / "refresh" / "ledger.json").read_text())
    assert sorted(e["status"] for e in ledger["files"].values()) == ["ingested", "quarantined"]

    # new rows with a much weaker model (k=1, one epoch): kept the previous model
    shutil.copy(data["more"], incoming / "part-001.txt.gz")
    worse = refresh([data["test"]], **{**opts, "k": 1, "max_epochs": 1, "n_random_features": 10})
    assert [f["name"] for f in worse["ingested"]] == ["part-001.txt.gz"]
    assert open_dataset(str(dataset)).n_samples == 1800
    assert worse["metrics"]["P@1"] < worse["current_metrics"]["P@1"]
    assert not worse["promoted"] and worse["decision"].startswith("kept the previous model")
    assert worse["current"]["fingerprint"] == first["current"]["fingerprint"]
    assert "kept the previous model" in Path(worse["report"]).read_text()

    # more rows and the usual model: not worse, promoted
    shutil.copy(data["more2"], incoming / "part-002.txt.gz")
    better = refresh([data["test"]], **opts)
    assert better["metrics"]["P@1"] >= better["current_metrics"]["P@1"]
    assert better["promoted"] and better["current"]["fingerprint"] != first["current"]["fingerprint"]
    current = json.loads((tmp_path / "storage" / "refresh" / "current.json").read_text())
    assert current["model"] == better["current"]["model"]
