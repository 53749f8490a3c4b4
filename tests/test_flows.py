"""The Prefect flows on tiny synthetic data: end to end, stage flows, the cache, fsspec storage, refresh, deploy."""

from __future__ import annotations

import json
import os
import shutil
import sys
import uuid
from pathlib import Path

import fsspec
import pytest

from flows.pipeline import pipeline
from flows.refresh import refresh
from flows.report import tree_lines
from flows.stage_flows import (
    evaluate_flow,
    ingest_flow,
    predict_flow,
    report_flow,
    spectrum_flow,
    train_flow,
    tree_flow,
)
from xmldask.datasets import write_synthetic_text
from xmldask.models import load_model

DIMS = {"n_features": 1000, "n_labels": 100}
#: a small model, searching the kernel only (the default search's screening is tested in test_model_selection)
TRAIN = {"k": 8, "n_random_features": 100, "max_epochs": 2, "search": {"kernel": ["none", "gaussian"]}}
#: the pipeline's options of that model
MODEL = {"model": TRAIN, "spectrum_components": 10}
STAGES = ["ingest-train", "ingest-test", "spectrum", "train", "predict", "evaluate"]
#: the cached stage tasks of a pipeline run (ingest twice)
STAGE_TASKS = ["evaluate", "ingest", "ingest", "predict", "spectrum", "train"]
REPORT_FILES = {"report.md", "metrics.json", "stages.json", "label_frequency.png", "spectrum.png",
                "precision_at_k.png"}


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


def computed(result: dict) -> list[str]:
    return [name for name, rec in result["stages"].items() if not rec["reused"]]


def run_with_state(flow, *args, **kwargs) -> tuple[dict, str]:
    """Run a flow; returns its result and its flow run id."""
    state = flow(*args, return_state=True, **kwargs)
    return state.result(), str(state.state_details.flow_run_id)


def task_states(flow_run_id: str) -> list[tuple[str, str]]:
    """``(task name, state name)`` of the task runs of a flow run and its subflow runs, as the Prefect API has them."""
    from prefect import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId, FlowRunFilterParentFlowRunId
    from prefect.client.schemas.sorting import FlowRunSort, TaskRunSort

    with get_client(sync_client=True) as client:  # (this server wants sort and limit)
        children = client.read_flow_runs(flow_run_filter=FlowRunFilter(
            parent_flow_run_id=FlowRunFilterParentFlowRunId(any_=[flow_run_id])), sort=FlowRunSort.ID_DESC, limit=100)
        ids = [flow_run_id, *(str(run.id) for run in children)]
        runs = client.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=ids)),
                                     sort=TaskRunSort.ID_DESC, limit=100)
    return sorted((run.name.rsplit("-", 1)[0], run.state.name) for run in runs)


def stage_states(flow_run_id: str) -> dict[str, list[str]]:
    """Task name to the state names of its runs, for the stage tasks (not synthesize, pick-up, report)."""
    states: dict[str, list[str]] = {}
    for name, state in task_states(flow_run_id):
        if name in STAGE_TASKS:
            states.setdefault(name, []).append(state)
    return states


@pytest.mark.slow
def test_pipeline_end_to_end(first_run):
    assert computed(first_run) == STAGES
    assert {rec["state"] for rec in first_run["stages"].values()} == {"Completed"}
    run = Path(first_run["run_dir"])
    metrics = json.loads((run / "metrics.json").read_text())
    for key in ("P@1", "P@3", "P@5", "nDCG@5", "PSP@5", "P@10"):
        assert 0 <= metrics[key] <= 1
    assert metrics["P@1"] > 0.05  # far better than chance (1 / 100 labels)
    report = (run / "report.md").read_text()
    assert "| P@1 |" in report and "| train | computed |" in report
    for png in ("label_frequency.png", "spectrum.png", "precision_at_k.png"):
        assert (run / png).stat().st_size > 0
    for name, rec in first_run["stages"].items():  # every stage wrote into this run's directory
        assert Path(rec["dir"]) == run / name and (run / name / "stage.json").is_file(), name
    for stage in ("spectrum", "train", "predict", "evaluate"):  # the stages on Dask, the first one too
        assert (run / stage / "performance.html").is_file(), stage
        assert json.loads((run / stage / "stage.json").read_text())["performance_report"], stage
    assert (run / "train" / "model.zarr").is_dir() and (run / "predict" / "predictions.zarr").is_dir()
    record = json.loads((run / "train" / "stage.json").read_text())
    assert record["inputs"]["train"]["fingerprint"] and record["peak_rss_mb"] > 0
    assert record["inputs"]["train"]["url"] == str(run / "ingest-train" / "data.zarr")
    # what was fitted, beside what was asked: the search's choice of the kernel, in the record and the report
    fitted = record["fitted_params"]
    assert fitted == record["result"]["params"] and fitted["kernel"] in ("none", "gaussian")
    assert "## Model" in report and f"| kernel | {fitted['kernel']} |" in report
    assert "Held-out search: " in report and report.count("kernel=") >= 2
    assert not [p for p in run.iterdir() if p.name.startswith(".")]  # no partial directory left


@pytest.mark.slow
def test_pipeline_with_the_tree_stage(data, storage, scheduler):
    """--grow-tree: a cached tree stage between the spectrum and the train stage, whose classifier is the tree's;
    the report shows the tree's figures and its plots."""
    from flows.pipeline import build_parser

    args = build_parser().parse_args(["--grow-tree", "--tree-max-depth", "3", "--tree-leaf-labels", "10"])
    assert (args.grow_tree, args.tree_max_depth, args.tree_leaf_labels) == (True, 3, 10)
    tree = {"max_depth": 3, "leaf_labels": 10, "routing": "deterministic"}
    model = {"n_components": 8, "max_epochs": 3}
    result = pipeline([data["train"]], [data["test"]], storage=storage, scheduler=scheduler, model=model,
                      spectrum_components=4, tree=tree)
    assert list(result["stages"]) == ["ingest-train", "ingest-test", "spectrum", "tree", "train", "predict",
                                      "evaluate"]
    run = Path(result["run_dir"])
    record = json.loads((run / "tree" / "stage.json").read_text())
    assert record["params"] == {**tree, "random_state": 0, "unseen_labels": "ignore"}
    figures = record["result"]["test_figures"]
    assert 0 < figures["tree_recall"] <= 1 and figures["mean_depth"] <= 3
    by_depth = record["result"]["by_depth"]
    assert sum(by_depth["rows_by_depth"]) == sum(by_depth["rows_by_candidates"]) == 300
    trained = json.loads((run / "train" / "stage.json").read_text())
    assert trained["params"]["tree"] == str(run / "tree" / "tree.zarr") and trained["params"]["n_components"] == 8
    assert trained["result"]["params"]["max_epochs"] == 3
    report = (run / "report.md").read_text()
    assert "## Label tree" in report and "| tree_recall |" in report and "![Label tree" in report
    assert (run / "tree.png").stat().st_size > 0
    assert result["metrics"]["P@1"] > 0.05
    again = pipeline([data["train"]], [data["test"]], storage=storage, scheduler=scheduler, model=model,
                     spectrum_components=4, tree=tree)
    assert computed(again) == []  # the tree stage is cached like the others


def test_rerun_reuses_every_stage(first_run, data, storage, scheduler):
    records = sorted(Path(storage, "runs").glob("*/*/stage.json"))
    mtimes = [p.stat().st_mtime_ns for p in records]
    again, flow_run_id = run_with_state(pipeline, [data["train"]], [data["test"]], storage=storage,
                                        scheduler=scheduler, **MODEL)
    assert computed(again) == []
    assert {rec["state"] for rec in again["stages"].values()} == {"Cached"}
    states = stage_states(flow_run_id)
    assert sorted(states) == sorted(set(STAGE_TASKS)) and all(set(s) == {"Cached"} for s in states.values()), states
    assert again["metrics"] == first_run["metrics"]
    assert again["run_dir"] != first_run["run_dir"]
    # no stage directory written anew: the new run directory holds the report only
    assert {p.name for p in Path(again["run_dir"]).iterdir()} == REPORT_FILES
    assert sorted(Path(storage, "runs").glob("*/*/stage.json")) == records
    assert [p.stat().st_mtime_ns for p in records] == mtimes
    assert again["stages"]["train"]["dir"] == first_run["stages"]["train"]["dir"]
    assert "| train | reused |" in Path(again["report"]).read_text()


def test_store_urls_are_used_as_they_are(first_run, data, storage, scheduler):
    """The ingested stores as inputs have the same content fingerprints: everything downstream is reused."""
    train = str(Path(first_run["stages"]["ingest-train"]["dir"]) / "data.zarr")
    test = str(Path(first_run["stages"]["ingest-test"]["dir"]) / "data.zarr")
    again = pipeline([train], [test], storage=storage, scheduler=scheduler, **MODEL)
    assert computed(again) == []
    assert again["metrics"]["P@1"] == first_run["metrics"]["P@1"]


@pytest.mark.slow
def test_parameter_change_recomputes_only_later_stages(first_run, data, storage, scheduler):
    more = pipeline([data["train"]], [data["test"]], storage=storage, scheduler=scheduler, **{**MODEL, "top_k": 12})
    assert computed(more) == ["predict", "evaluate"]
    assert {p.name for p in Path(more["run_dir"]).iterdir()} == REPORT_FILES | {"predict", "evaluate"}
    other, flow_run_id = run_with_state(pipeline, [data["train"]], [data["test"]], storage=storage,
                                        scheduler=scheduler, **{**MODEL, "model": {**TRAIN, "k": 4}})
    assert computed(other) == ["train", "predict", "evaluate"]
    states = stage_states(flow_run_id)
    assert states["ingest"] == ["Cached", "Cached"] and states["spectrum"] == ["Cached"]
    assert states["train"] == states["predict"] == states["evaluate"] == ["Completed"]
    assert other["stages"]["spectrum"]["fingerprint"] == first_run["stages"]["spectrum"]["fingerprint"]


def test_parameters_are_validated(storage):
    from prefect.exceptions import ParameterTypeError

    with pytest.raises(ParameterTypeError):
        pipeline(storage=storage, model={"k": 0})
    with pytest.raises(ParameterTypeError):
        pipeline(storage=storage, model={"embedding": "nope"})
    with pytest.raises(ParameterTypeError):
        train_flow("x.zarr", storage=storage, model={"kernel": "nope"})
    with pytest.raises(ParameterTypeError):  # a misspelt parameter is not silently ignored
        train_flow("x.zarr", storage=storage, model={"kernal": "none"})


@pytest.mark.slow
def test_each_stage_flow_runs_on_its_own(first_run, data, storage, scheduler, monkeypatch):
    """Store URLs in, a record out; each flow opens its own client (here via $XMLDASK_SCHEDULER)."""
    monkeypatch.setenv("XMLDASK_SCHEDULER", scheduler)
    ingested = ingest_flow([data["train"]], storage=storage)
    assert ingested["state"] == "Cached"  # the pipeline's ingest of the same file
    train_url = ingested["outputs"]["data"]
    test_url = first_run["stages"]["ingest-test"]["dir"] + "/data.zarr"

    # a URL given as a string gets the fingerprint the producing stage recorded: the pipeline's train is reused
    assert train_flow(train_url, storage=storage, model=TRAIN)["state"] == "Cached"

    model = train_flow(train_url, storage=storage, model={**TRAIN, "k": 6, "n_estimators": 2})  # an ensemble
    assert model["state"] == "Completed" and model["params"]["n_estimators"] == 2
    assert len(load_model(model["outputs"]["model"]).estimators_) == 2
    # the held-out search and the input features are train parameters like the others
    searched = train_flow(train_url, storage=storage,
                          model={**TRAIN, "features": "tfidf", "search": {"alpha": [0.001, 10.0]}})
    assert searched["state"] == "Completed" and searched["params"]["search"] == {"alpha": [0.001, 10.0]}
    tried = searched["result"]["search"]
    assert [r["params"]["alpha"] for r in tried][:2] == [0.001, 10.0]  # then steps past the winning end
    assert searched["result"]["params"]["alpha"] == max(tried, key=lambda r: r["val_p@1"])["params"]["alpha"]
    assert searched["result"]["params"]["features"] == "tfidf"
    run = Path(model["dir"]).parent
    assert Path(model["dir"]) == run / "train" and run.parent == Path(storage, "runs")
    pred = predict_flow(model["outputs"]["model"], test_url, storage=storage)
    assert pred["state"] == "Completed" and Path(pred["dir"]).parent != run  # a run directory per flow run
    assert pred["inputs"]["model"]["fingerprint"] == model["fingerprint"]
    evaluated = evaluate_flow(pred["outputs"]["predictions"], test_url, train_url, storage=storage)
    assert 0.01 < evaluated["result"]["P@1"] <= 1
    spectrum = spectrum_flow(train_url, n_components=5, storage=storage)
    assert spectrum["state"] == "Completed" and len(spectrum["result"]["top_eigenvalues"]) == 5
    out = report_flow({"spectrum": spectrum, "evaluate": evaluated}, title="stage flows", storage=storage)
    assert "| P@1 |" in Path(out["report"]).read_text()
    assert {"spectrum.png", "label_frequency.png"} <= {p.name for p in Path(out["run_dir"]).iterdir()}


def test_tree_stage_grows_without_labels_no_training_row_has(tmp_path, scheduler):
    """The pipeline's own synthetic data (and real label spaces) hold labels with no training row: the tree
    stage grows without them and says how many, where ``xmldask tree`` refuses them by default."""
    train, test = tmp_path / "train.txt", tmp_path / "test.txt"
    train.write_text("6 3 5\n0 0:1 1:2\n1 1:1\n2,3 0:1 2:1\n0 2:3\n1 0:2\n3 1:1 2:1\n")  # label 4: no row
    test.write_text("2 3 5\n4 0:1\n1 1:1\n")
    opts = {"storage": str(tmp_path / "storage"), "scheduler": scheduler}
    train_url = ingest_flow([str(train)], storage=opts["storage"])["outputs"]["data"]
    test_url = ingest_flow([str(test)], split="test", like=train_url, storage=opts["storage"])["outputs"]["data"]
    grown = tree_flow(train_url, test_url, tree={"depth": 2, "leaf_labels": 2, "routing": "deterministic"},  # depth:
                      **opts)  # max_depth's former name, as older deployments hold it
    assert grown["state"] == "Completed" and grown["result"]["n_unseen_labels"] == 1
    assert "1 labels have no training example" in "\n".join(tree_lines(grown["result"]))


def test_deleted_outputs_are_recomputed(first_run, tmp_path, scheduler):
    """A cached record whose outputs are gone is computed again, and a directory without record is not reused."""
    stages = first_run["stages"]
    args = (stages["predict"]["dir"] + "/predictions.zarr", stages["ingest-test"]["dir"] + "/data.zarr")
    opts = {"storage": str(tmp_path / "storage"), "scheduler": scheduler}
    first = evaluate_flow(*args, **opts)
    assert first["state"] == "Completed" and evaluate_flow(*args, **opts)["state"] == "Cached"

    (Path(first["dir"]) / "stage.json").unlink()  # an unfinished directory: outputs without their record
    second = evaluate_flow(*args, **opts)
    assert second["state"] == "Completed" and second["dir"] != first["dir"]
    shutil.rmtree(Path(second["dir"]).parent)  # an old run directory deleted
    third = evaluate_flow(*args, **opts)
    assert third["state"] == "Completed" and (Path(third["dir"]) / "metrics.json").is_file()
    fourth = evaluate_flow(*args, **opts)
    assert fourth["state"] == "Cached" and fourth["dir"] == third["dir"]  # the cache holds the new record
    assert fourth["result"] == first["result"]


@pytest.mark.slow
def test_pipeline_on_an_fsspec_url(tmp_path):
    """The whole pipeline with ``memory://`` storage (synthetic data too) on an in-process cluster; then all cached."""
    storage = f"memory://xmldask-flows-{uuid.uuid4().hex[:8]}"
    opts = {"storage": storage, "n_workers": 1, "threads_per_worker": 2, "processes": False, "dashboard_address": None,
            "synthetic_samples": 1000, "synthetic_features": 500, "synthetic_labels": 50, **MODEL}
    try:
        first = pipeline(**opts)
        fs = fsspec.filesystem("memory")
        assert first["run_dir"].startswith(f"{storage}/runs/")
        metrics = json.loads(fs.cat_file(first["metrics_json"]))
        assert metrics["P@1"] == first["metrics"]["P@1"] > 0.02
        assert "| P@1 |" in fs.cat_file(first["report"]).decode()
        names = {name.rpartition("/")[2] for name in fs.ls(first["run_dir"], detail=False)}
        assert names == REPORT_FILES | set(STAGES)
        assert fs.exists(f"{first['stages']['train']['dir']}/model.zarr/zarr.json")
        assert fs.ls(f"{storage}/prefect-results")

        again = pipeline(**opts)
        assert {rec["state"] for rec in again["stages"].values()} == {"Cached"}
        assert again["metrics"] == first["metrics"]
        assert {name.rpartition("/")[2] for name in fs.ls(again["run_dir"], detail=False)} == REPORT_FILES
    finally:
        fsspec.filesystem("memory").rm(storage.removeprefix("memory://"), recursive=True)


@pytest.mark.slow
def test_refresh_ingests_once_quarantines_and_promotes_by_the_metric(data, tmp_path, scheduler):
    storage = str(tmp_path / "storage")
    incoming = tmp_path / "storage" / "refresh" / "incoming"
    incoming.mkdir(parents=True)
    dataset = tmp_path / "storage" / "refresh" / "train.zarr"
    opts = {"storage": storage, "scheduler": scheduler, **MODEL}

    shutil.copy(data["train"], incoming / "part-000.txt.gz")
    first = refresh([data["test"]], **opts)
    assert [f["name"] for f in first["ingested"]] == ["part-000.txt.gz"] and first["promoted"]
    assert Path(first["current"]["model"]).parent == tmp_path / "storage" / "refresh" / "models"
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
    worse = refresh([data["test"]], **{**opts, "model": {**TRAIN, "k": 1, "max_epochs": 1, "n_random_features": 10}})
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

    # a truncated state file stops the next run with its name and the kept copy (before: read as absent)
    from flows.stages import PREVIOUS, StateFileError

    state = tmp_path / "storage" / "refresh" / "current.json"
    state.write_text(state.read_text()[:20])
    assert (state.parent / f"current.json{PREVIOUS}").exists()  # the promotion above replaced the first one
    with pytest.raises(ValueError, match=r"current.json cannot be read .*restore the previous version, kept as") \
            as info:
        refresh([data["test"]], **opts)
    assert type(info.value).__name__ == StateFileError.__name__  # Prefect re-raises the task's error


def test_deploy_builds_the_scheduled_refresh_deployment(monkeypatch):
    """The deployment ``python -m flows.deploy`` serves: the refresh flow, the cron schedule, the parameters."""
    from flows import deploy
    from flows.refresh import refresh as refresh_flow

    served = {}
    monkeypatch.setattr(refresh_flow, "serve", lambda **options: served.update(options))
    assert deploy.main(["--cron", "*/15 * * * *", "--test", "t.zarr", "--storage", "s3://bucket/xmc",
                        "--n-components", "32", "--features", "tfidf", "--search", "alpha=0.01,1",
                        "--n-estimators", "2"]) == 0
    assert served["cron"] == "*/15 * * * *"
    assert served["parameters"] == {"test": ["t.zarr"], "storage": "s3://bucket/xmc", "metric": "P@1",
                                    "model": {"n_components": 32, "features": "tfidf", "search": {"alpha": [0.01, 1]},
                                              "n_estimators": 2}}

    deployment = deploy.build_deployment(**{key: served[key] for key in ("cron", "name")}, **served["parameters"])
    assert deployment.name == "xmldask-refresh" and deployment.flow_name == "xmldask-refresh"
    assert [s.schedule.cron for s in deployment.schedules] == ["*/15 * * * *"]
    assert deployment.parameters == served["parameters"]
    assert deployment.entrypoint == "flows.refresh.refresh"  # imported as a module of the package


def test_ingest_flow_with_missing_labels(data, storage, tmp_path):
    """The observed-entry files are inputs of the ingest stage: stored as the mask, and part of its cache key."""
    import numpy as np

    from xmldask.io import read_text
    from xmldask.store import open_dataset, to_scipy

    _, Y = read_text(data["test"])
    Y = Y.tocsr()
    extra = np.random.default_rng(0).integers(0, Y.shape[1], Y.shape[0])
    lines = [sorted(set(Y[i].indices.tolist()) | {int(extra[i])}) for i in range(Y.shape[0])]
    obs = tmp_path / "test.observed"
    obs.write_text("".join(",".join(map(str, ids)) + "\n" for ids in lines))
    first = ingest_flow([data["test"]], split="observed", observed=[str(obs)], storage=storage)
    ds = open_dataset(first["outputs"]["data"])
    assert ds.observed is not None and to_scipy(ds.observed).nnz == sum(map(len, lines))
    assert ingest_flow([data["test"]], split="observed", observed=[str(obs)], storage=storage)["state"] == "Cached"
    obs.write_text("".join(",".join(map(str, sorted(set(Y[i].indices.tolist())))) + "\n" for i in range(Y.shape[0])))
    again = ingest_flow([data["test"]], split="observed", observed=[str(obs)], storage=storage)
    assert again["state"] == "Completed" and to_scipy(open_dataset(again["outputs"]["data"]).observed).nnz == Y.nnz


@pytest.mark.slow
def test_pipeline_defaults_take_the_centroid_tree_on_many_labels(tmp_path, scheduler):
    """The pipeline with no model option on a 3,000-label dataset trains what `xmldask train` would (model auto:
    the label-centroid tree), and its report is written."""
    from xmldask.models import LabelCentroidClassifier
    from xmldask.xmc import make_xmc

    many = dict(n_features=3000, n_labels=3000, avg_labels=3.0, avg_features=30.0, seed=0)
    train = make_xmc(str(tmp_path / "train.zarr"), n_samples=3000, **many).url
    test = make_xmc(str(tmp_path / "test.zarr"), n_samples=400, split="test", **many).url
    result = pipeline([train], [test], storage=str(tmp_path / "storage"), scheduler=scheduler)
    run = Path(result["run_dir"])
    assert isinstance(load_model(str(run / "train" / "model.zarr")), LabelCentroidClassifier)
    record = json.loads((run / "train" / "stage.json").read_text())
    assert record["result"]["params"]["model"] == "centroid" and record["result"]["n_clusters"] > 1
    metrics = json.loads((run / "metrics.json").read_text())
    assert metrics["P@1"] > 0.2 and (run / "report.md").is_file()


@pytest.mark.parametrize("url", ["local", "memory://xmldask-state/refresh"])
def test_state_files_keep_their_previous_version_and_a_corrupt_one_is_named(tmp_path, url):
    """The refresh flow's ledger and current model: written atomically with the replaced version kept; a
    truncated one stops the run naming the file and the kept copy (before: read as absent, the ledger silently
    rewritten, the promotion made with no comparison)."""
    from flows.stages import PREVIOUS, StateFileError, read_state, write_json

    base = str(tmp_path) if url == "local" else url
    path = f"{base}/{uuid.uuid4().hex}/current.json"
    assert read_state(path, {"files": {}}) == {"files": {}}  # absent: the default
    write_json(path, {"model": "a"}, keep_previous=True)
    with pytest.raises(StateFileError, match="no previous version is kept"):
        fs, p = fsspec.core.url_to_fs(path)
        fs.pipe_file(p, b'{"model": ')
        read_state(path, None)
    write_json(path, {"model": "a"}, keep_previous=True)
    write_json(path, {"model": "b"}, keep_previous=True)
    assert read_state(path, None) == {"model": "b"} and read_state(path + PREVIOUS, None) == {"model": "a"}
    fs.pipe_file(p, b'{"model": "b"')  # cut
    with pytest.raises(StateFileError, match=rf"{path} cannot be read .*restore the previous version, kept as "
                                             rf"{path}{PREVIOUS}"):
        read_state(path, None)


def test_report_model_section_names_the_fitted_parameters_and_every_candidate():
    from flows.report import model_lines

    result = {"seconds": 3.2, "n_passes": 7, "params": {"model": "centroid", "beam": 40, "features": "tfidf"},
              "held_out": {"p@1": 0.8123}, "n_clusters": 1024, "beam": 40,
              "search": [{"params": {"kernel": "none"}, "score": 0.61, "screened": True, "seconds": 1.0},
                         {"params": {"kernel": "gaussian"}, "score": 0.65, "screened": False, "seconds": 2.5}]}
    text = "\n".join(model_lines(result))
    assert "Family: **centroid**" in text and "| beam | 40 |" in text and "| features | tfidf |" in text
    assert "| held-out p@1 | 0.8123 |" in text and "| n_clusters | 1,024 |" in text
    assert "| 1 | kernel=none | 0.6100 | yes | 1.0 |" in text and "| 2 | kernel=gaussian | 0.6500 |  | 2.5 |" in text
    assert model_lines({}) == []


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_ctrl_c_in_the_pipeline_exits_130_at_once_with_one_line_and_no_child_left(tmp_path):
    """A real SIGINT to a real `python -m flows.pipeline` while a stage computes: before, about 160 s and 200 lines
    (the temporary Prefect server died of the same signal and the flow retried its API), exit 1."""
    import os
    import signal
    import subprocess
    import sys

    import psutil

    env = {key: value for key, value in os.environ.items() if not key.startswith("PREFECT_")}
    env.update(PREFECT_HOME=str(tmp_path / "prefect-home"), XMLDASK_STORAGE=str(tmp_path / "storage"))
    proc = subprocess.Popen([sys.executable, "-m", "flows.pipeline", "--synthetic-samples", "20000",
                             "--synthetic-features", "2000", "--synthetic-labels", "200", "-v"],
                            cwd=Path(__file__).resolve().parents[1], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    seen = []
    for line in proc.stdout:  # -v: the stage lines, as they happen
        seen.append(line)
        if "stage spectrum: computing" in line or "stage train: computing" in line:
            break
    assert proc.poll() is None, "".join(seen[-30:])
    children = psutil.Process(proc.pid).children(recursive=True)
    assert children  # the temporary Prefect server at least
    proc.send_signal(signal.SIGINT)
    rest = proc.communicate(timeout=60)[0]  # at once: the children get 3 s to stop, then are killed
    assert proc.returncode == 130, rest[-3000:]
    assert "interrupted; the stages that finished are kept" in rest and "Traceback" not in rest, rest[-3000:]
    _, alive = psutil.wait_procs(children, timeout=10)
    assert not alive, [p.cmdline() for p in alive]


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_ctrl_c_in_a_stage_flow_run_from_a_script_exits_130_at_once(tmp_path):
    """The terminal's Ctrl-C (SIGINT to the whole process group, the temporary Prefect server included) while
    `train_flow` computes in a user's script: before, about 74 s of Prefect retrying its dead server, 150 lines
    ending in an `httpx.ConnectError` traceback, exit 1."""
    import signal
    import subprocess
    import sys

    import psutil

    from xmldask.datasets import make_synthetic

    make_synthetic(str(tmp_path / "train.zarr"), n_samples=20_000, n_features=2_000, n_labels=200, seed=0)
    script = tmp_path / "train.py"
    script.write_text("from flows.stage_flows import train_flow\n"
                      f"train_flow({str(tmp_path / 'train.zarr')!r}, storage={str(tmp_path / 'storage')!r})\n")
    env = {key: value for key, value in os.environ.items() if not key.startswith("PREFECT_")}
    root = Path(__file__).resolve().parents[1]
    env.update(PREFECT_HOME=str(tmp_path / "prefect-home"), PYTHONPATH=str(root))
    proc = subprocess.Popen([sys.executable, str(script)], cwd=root, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    seen = []
    for line in proc.stdout:
        seen.append(line)
        if "held-out search" in line:  # the train stage computes
            break
    assert proc.poll() is None, "".join(seen[-30:])
    children = psutil.Process(proc.pid).children(recursive=True)
    assert children  # the temporary Prefect server at least
    os.killpg(proc.pid, signal.SIGINT)  # as a terminal does
    rest = proc.communicate(timeout=30)[0]
    assert proc.returncode == 130, rest[-3000:]
    assert "train_flow: interrupted; the stages that finished are kept" in rest, rest[-3000:]
    assert "Traceback" not in rest, rest[-3000:]
    _, alive = psutil.wait_procs(children, timeout=10)
    assert not alive, [p.cmdline() for p in alive]


def test_a_flow_takes_ctrl_c_only_where_it_is_python_s_default(monkeypatch):
    import signal

    from flows.stage_flows import interruptible

    seen = []

    @interruptible
    def work():
        seen.append(signal.getsignal(signal.SIGINT))
        return 7

    monkeypatch.delitem(sys.modules, "IPython", raising=False)  # pytest may have imported it
    monkeypatch.delattr(sys, "ps1", raising=False)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    assert work() == 7 and seen[-1] is not signal.default_int_handler and seen[-1].__name__ == "interrupted"
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # put back

    def mine(signum, frame):
        pass

    signal.signal(signal.SIGINT, mine)  # the program's own handler is left alone
    try:
        assert work() == 7 and seen[-1] is mine
    finally:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    monkeypatch.setattr(sys, "ps1", ">>> ", raising=False)  # an interactive session keeps KeyboardInterrupt
    assert work() == 7 and seen[-1] is signal.default_int_handler


def test_prefect_engine_lines_leave_the_terminal_unless_verbose(monkeypatch):
    import logging

    # set_verbosity sets process-wide levels and an environment variable: put them back for the other tests
    monkeypatch.setenv("DASK_LOGGING__DISTRIBUTED", os.environ.get("DASK_LOGGING__DISTRIBUTED", "warning"))
    saved = {name: logging.getLogger(name).level for name in ("distributed", "xmldask")}

    from flows.stage_flows import _EngineLines, set_verbosity

    def record(message, level=logging.INFO):
        return logging.LogRecord("prefect.task_runs", level, __file__, 1, message, None, None)

    keep = _EngineLines()
    assert not keep.filter(record("Finished in state Completed()"))
    assert not keep.filter(record("Beginning subflow run 'x' for flow 'xmldask-train'"))
    assert keep.filter(record("stage train: computing into storage/runs/x/train"))
    assert keep.filter(record("Finished in state Failed('boom')", logging.WARNING))  # a warning stays
    from prefect.logging.handlers import PrefectConsoleHandler

    try:
        set_verbosity(False)
        consoles = [h for name in ("prefect", "") for h in logging.getLogger(name).handlers
                    if isinstance(h, PrefectConsoleHandler)]
        assert consoles and all(any(isinstance(f, _EngineLines) for f in h.filters) for h in consoles)
        set_verbosity(True)
        assert not any(isinstance(f, _EngineLines) for h in consoles for f in h.filters)
    finally:
        for name, level in saved.items():
            logging.getLogger(name).setLevel(level)


def test_a_stage_whose_job_was_cancelled_for_memory_says_so_and_leaves_nothing(tmp_path, monkeypatch):
    """A flow's stage runs inside a cluster block entered by the flow: when the pause watch cancelled its job, the
    stage fails with the watch's MemoryError (the workers' memory, what to change), not the error of whatever
    code met the cancelled task (measured before: "scipy.sparse does not support dtype object"), and its
    unfinished directory is removed."""
    import xmldask.cluster
    from flows.stages import run_stage

    def compute(work, scratch):
        raise ValueError("scipy.sparse does not support dtype object")

    out = str(tmp_path / "train")
    with pytest.raises(ValueError, match="dtype object"):  # not paused: the job's own error
        run_stage("train", params={}, inputs={}, compute=compute, out=out)
    said = "every Dask worker has been paused for memory for more than 60 s (0: 401 MiB of 500 MiB)"
    monkeypatch.setattr(xmldask.cluster, "paused_out", lambda client=None: said)
    with pytest.raises(MemoryError, match=r"^stage train: every Dask worker has been paused .*401 MiB of 500"):
        run_stage("train", params={}, inputs={}, compute=compute, out=out)
    assert list(tmp_path.iterdir()) == []


def test_a_stage_whose_worker_left_names_it_and_leaves_nothing(tmp_path, monkeypatch):
    """A worker restarted past 95 % of its limit takes the job's data with it: the stage fails with a WorkerLost
    (a MemoryError) that names the worker and what to change, not Dask's bare cancelled future, and its unfinished
    directory is removed; an error that is not how Dask reports lost work stays the job's own."""
    from concurrent.futures import CancelledError

    import xmldask.cluster
    from flows.stages import run_stage

    def cancelled(work, scratch):
        raise CancelledError("('train-part-3',) cancelled for reason: lost dependencies")

    def broken(work, scratch):
        raise ValueError("a bad block")

    said = "1 Dask worker(s) left the cluster while the job ran: 0 (tcp://127.0.0.1:1; last seen using 980 MiB)"
    monkeypatch.setattr(xmldask.cluster, "lost_workers", lambda client=None: said)
    out = str(tmp_path / "train")
    with pytest.raises(ValueError, match="a bad block"):
        run_stage("train", params={}, inputs={}, compute=broken, out=out)
    with pytest.raises(xmldask.cluster.WorkerLost,
                       match=r"^stage train: 1 Dask worker.*980 MiB\) \(CancelledError: .*lost dependencies"):
        run_stage("train", params={}, inputs={}, compute=cancelled, out=out)
    assert list(tmp_path.iterdir()) == []
