"""Train -> predict -> evaluate from store URLs (the jobs the CLI and the flows call)."""

from __future__ import annotations

import numpy as np
import pytest

from xmldask import jobs, metrics
from xmldask.datasets import make_synthetic
from xmldask.models import EmbeddingClassifier
from xmldask.store import open_dataset, open_predictions


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    root = tmp_path_factory.mktemp("jobs")
    kw = dict(n_samples=3000, n_features=400, n_labels=80, seed=3, block_rows=700)
    train = make_synthetic(str(root / "train.zarr"), **kw).url
    test = make_synthetic(str(root / "test.zarr"), split="test", **{**kw, "n_samples": 900}).url
    return root, train, test


def test_train_predict_evaluate(data):
    root, train, test = data
    model_url, pred_url = str(root / "model.zarr"), str(root / "pred.zarr")
    info = jobs.train(train, model_url, embedding="rembrandt", k=12, kernel="none", seed=5, max_epochs=3,
                      n_estimators=1)
    assert info["model"] == model_url and info["task"] == "multilabel" and info["n_passes"] > 0
    pinfo = jobs.predict(model_url, test, pred_url, top_k=7)
    assert (pinfo["n_samples"], pinfo["top_k"], pinfo["n_labels"]) == (900, 7, 80)
    results = jobs.evaluate(pred_url, test)
    assert results["propensity_source"] == "train"  # found through the model's recorded train_url
    # the same numbers as the model's own predictions scored in memory
    model = EmbeddingClassifier.load(model_url)
    ds = open_dataset(test)
    labels, _ = (a.compute() for a in model.predict_topk(ds.X, k=7))
    np.testing.assert_array_equal(open_predictions(pred_url).labels.compute(), labels)
    Y = ds.Y.compute()
    Y = Y.tocsr() if hasattr(Y, "tocsr") else Y
    for k in (1, 3, 5):
        hits = [len(set(labels[i, :k]) & set(Y[i].indices)) / k for i in range(Y.shape[0])]
        assert results[f"P@{k}"] == pytest.approx(np.mean(hits))
    assert results["P@1"] > 5 / 80  # far above chance
    # the baseline: the most frequent training labels for every row
    frequent = np.argsort(-np.asarray(open_dataset(train).label_counts), kind="stable")[:7]
    for k in (1, 3, 5):
        hits = [len(set(frequent[:k]) & set(Y[i].indices)) / k for i in range(Y.shape[0])]
        assert results["baseline"][f"P@{k}"] == pytest.approx(np.mean(hits))
    assert results["P@1"] > 2 * results["baseline"]["P@1"]
    assert f"| P@1 | {results['P@1']:.4f} | {results['baseline']['P@1']:.4f} |" in metrics.report(results)
    p = metrics.propensity(open_dataset(train).label_counts, 3000)
    assert results["PSP@1"] == pytest.approx(metrics.evaluate(ds.Y, labels, ks=(1,), propensities=p)["PSP@1"])


def test_refusals(data):
    root, train, test = data
    model_url = str(root / "model2.zarr")
    with pytest.raises(ValueError, match="kernel = 'rbf': Input should be 'none', 'gaussian' or 'laplacian'"):
        jobs.train(train, model_url, kernel="rbf")
    with pytest.raises(ValueError, match="unknown training parameter.s. kernal; known: embedding, n_components, "):
        jobs.train(train, model_url, kernal="none")
    with pytest.raises(ValueError, match="k is the former name of n_components: give n_components once"):
        jobs.train(train, model_url, n_components=8, k=8)
    jobs.train(train, model_url, embedding="cs", k=8, kernel="none", max_epochs=1, search=None)
    pca_url = str(root / "pca.zarr")  # a feature embedding: no label embedding R in the model
    jobs.train(train, pca_url, embedding="pca", k=8, kernel="none", max_epochs=1, search=None)
    assert jobs.predict(pca_url, test, str(root / "pca-pred.zarr"), top_k=3)["n_labels"] == 80
    with pytest.raises(FileExistsError, match="already exists"):
        jobs.train(train, model_url, embedding="cs", k=8)
    with pytest.raises(ValueError, match="top_k must be between 1 and the model's 80 labels"):
        jobs.predict(model_url, test, str(root / "p.zarr"), top_k=81)
    other = make_synthetic(str(root / "other.zarr"), n_samples=50, n_features=30, n_labels=80, seed=1).url
    with pytest.raises(ValueError, match="has 30 features but the model"):
        jobs.predict(model_url, other, str(root / "p.zarr"))
    jobs.predict(model_url, test, str(root / "p.zarr"), top_k=3)
    with pytest.raises(ValueError, match="predictions for 900 rows but"):
        jobs.evaluate(str(root / "p.zarr"), other)
    assert set(jobs.evaluate(str(root / "p.zarr"), test)) >= {"P@1", "P@3"}


def test_k_beyond_the_labels_is_lowered_before_any_pass(data, caplog):
    """``k`` (and the search's ``k``) above the number of labels is lowered to it, with a message."""
    root, train, _ = data
    with caplog.at_level("WARNING", logger="xmldask.jobs"):
        info = jobs.train(train, str(root / "k1.zarr"), k=500, kernel="none", max_epochs=1, search=None)
    assert "k=500 is more than the 80 labels" in caplog.text and info["params"]["n_components"] == 80
    caplog.clear()
    with caplog.at_level("WARNING", logger="xmldask.jobs"):
        info = jobs.train(train, str(root / "k.zarr"), k=500, kernel="none", max_epochs=1,
                          search={"k": [8, 200, 400]}, search_extensions=0)
    assert "k=500" not in caplog.text  # one message, the search's
    # k = L first, where the search starts: every label direction, the identity (no decomposition)
    assert "the search's k=[8, 200, 400] exceed the 80 labels" in caplog.text and "trying k=[80, 8]" in caplog.text
    assert [r["params"]["n_components"] for r in info["search"] if r["screened"]] == [80, 8]


def test_model_families_are_trained_through_their_class(data):
    """``--model NAME`` finds the class registered as that family; its own constructor parameters pass through,
    the ones the training parameters set are refused, unknown ones named, before any pass."""
    from xmldask.base import FAMILIES
    from xmldask.models import LEML, BinaryRelevance, load_model

    assert FAMILIES["leml"] is LEML and FAMILIES["br"] is BinaryRelevance
    root, train, _ = data
    info = jobs.train(train, str(root / "br.zarr"), model="br", lam=3.0, max_cg_iter=7)
    assert info["params"]["lam"] == 3.0 and info["params"]["max_cg_iter"] == 7 and info["n_passes"] >= 1
    assert type(load_model(info["model"])) is BinaryRelevance
    with pytest.raises(ValueError, match="k is the former name of n_components"):  # one name per parameter
        jobs.train(train, str(root / "leml.zarr"), model="leml", k=4, n_components=3)
    with pytest.raises(ValueError, match="rank do not apply to --model leml; its parameters are n_components, "):
        jobs.train(train, str(root / "leml.zarr"), model="leml", k=4, rank=3)
    assert not (root / "leml.zarr").exists()


def test_defaults_fitted_to_the_data_are_not_warnings(data, caplog):
    """The default search's k beyond the labels is lowered silently (INFO): the user chose nothing to warn about."""
    root, train, _ = data
    with caplog.at_level("INFO", logger="xmldask.jobs"):
        jobs.train(train, str(root / "d.zarr"), max_epochs=1, n_estimators=1, search_extensions=0)
        jobs.train(train, str(root / "d2.zarr"), kernel="none", max_epochs=1, n_estimators=1, search=None, k=150)
    lowered = [r for r in caplog.records if "exceed the 80 labels" in r.getMessage() or "is more than" in
               r.getMessage()]
    assert [r.levelname for r in lowered] == ["INFO", "WARNING"]  # the default search's grid; the k given


@pytest.mark.parametrize("family", ["centroid", "leml"])
def test_an_ensemble_of_any_family(data, family):
    """``n_estimators`` with any family: its model fitted as without, then members with the next seeds, saved as
    an ensemble that ``xmldask.load_model`` and ``jobs.predict`` read; a family that draws nothing at random is
    refused before anything is written."""
    import xmldask
    from xmldask.models import EnsembleClassifier, LabelCentroidClassifier

    root, train, test = data
    kw = {"k": 4, "search": None} if family == "leml" else {}
    one = jobs.train(train, str(root / f"one-{family}.zarr"), model=family, seed=2, **kw)
    info = jobs.train(train, str(root / f"ens-{family}.zarr"), model=family, seed=2, n_estimators=2, **kw)
    assert info["params"]["n_estimators"] == 2 and info["n_estimators"] == 2
    assert {k: v for k, v in info["params"].items() if k != "n_estimators"} == one["params"]
    model = xmldask.load_model(info["model"])
    assert isinstance(model, EnsembleClassifier) and len(model.estimators_) == 2
    single = xmldask.load_model(one["model"])
    if isinstance(single, LabelCentroidClassifier):
        np.testing.assert_array_equal(model.estimators_[0].order_, single.order_)  # member 0 is the one model
    pred = jobs.predict(info["model"], test, str(root / f"ens-{family}-pred.zarr"), top_k=5)
    assert pred["n_samples"] == 900 and jobs.evaluate(pred["url"], test)["P@1"] > 5 / 80
    with pytest.raises(ValueError, match="--model br draws nothing at random"):
        jobs.train(train, str(root / "br-ens.zarr"), model="br", n_estimators=2)
    assert not (root / "br-ens.zarr").exists()


def test_ensemble_members_in_a_budget_say_what_the_time_left_buys(caplog, monkeypatch):
    """With a time budget the ensemble gets the members its time left buys (member 0, the model, always), and says so;
    a budget already spent says by how much, not a negative time left."""
    import logging
    from types import SimpleNamespace

    search = SimpleNamespace(best_fit_seconds_=1.0)
    now = 100.0
    monkeypatch.setattr(jobs.time, "perf_counter", lambda: now)  # the job started 2 s ago, whatever the machine's load
    with caplog.at_level(logging.INFO, logger="xmldask.jobs"):
        assert jobs._members_in_budget(SimpleNamespace(time_budget=None), 3, search, now - 2.0) == 3
        assert jobs._members_in_budget(SimpleNamespace(time_budget=10.0), 3, search, now - 2.0) == 3
        assert not caplog.records
        assert jobs._members_in_budget(SimpleNamespace(time_budget=3.5), 3, search, now - 2.0) == 2
        assert "2 of the 3 ensemble members fit in the 1.5 s left (a member takes about 1.0 s)" in caplog.text
        caplog.clear()
        assert jobs._members_in_budget(SimpleNamespace(time_budget=1.5), 3, search, now - 2.0) == 1
        assert "spent 0.5 s ago, the model is 1 of the 3 ensemble members" in caplog.text and " -" not in caplog.text


def test_a_budgets_first_model_is_saved_then_completed_or_removed(data, monkeypatch):
    """With a time budget the first model is saved to the target as soon as the search makes it; the final save adds
    the search's record to it (the same model) or writes the better one; a job that fails after the first save
    leaves no store where there was none."""
    from xmldask.store import exists
    from xmldask.store.models import open_model_store

    root, train, _ = data
    url = str(root / "budget-model.zarr")
    saved = []
    real = jobs._EarlySave.__call__

    def spy(self, model):
        real(self, model)
        saved.append((open_model_store(url, model_version=type(model)._MODEL_VERSION)[1], model))

    monkeypatch.setattr(jobs._EarlySave, "__call__", spy)
    info = jobs.train(train, url, time_budget=600.0, search={"alpha": [0.1, 1.0]}, n_estimators=1, max_epochs=1)
    assert len(saved) == 1 and saved[0][0]["first_model"] is True and "search" not in saved[0][0]
    _, meta = open_model_store(url, model_version=EmbeddingClassifier._MODEL_VERSION)
    assert meta["first_model"] is False and meta["search"]["results"] == info["search"]
    assert EmbeddingClassifier.load(url).get_params()["alpha"] == meta["search"]["best_params"]["alpha"]
    assert info["time_budget"]["first_model_saved_s"] > 0 and info["time_budget"]["used"] <= 600.0
    # the search fails after the first model was saved: nothing is left where nothing was
    failing = str(root / "budget-failing.zarr")

    def boom(self, *args, **kwargs):
        raise RuntimeError("a later fit failed")

    monkeypatch.setattr(jobs, "_members_in_budget", boom)
    with pytest.raises(RuntimeError, match="a later fit failed"):
        jobs.train(train, failing, time_budget=600.0, search={"alpha": [0.1, 1.0]}, max_epochs=1)
    assert len(saved) == 2 and not exists(failing)
    # every family's search: binary relevance's first candidate saved, then the refit on all rows written over it
    monkeypatch.undo()
    from xmldask.models import BinaryRelevance

    br_url = str(root / "budget-br.zarr")
    info = jobs.train(train, br_url, model="br", time_budget=600.0)
    _, meta = open_model_store(br_url, model_version=BinaryRelevance._MODEL_VERSION)
    assert meta["first_model"] is False and meta["search"]["results"] == info["search"]
    assert 0 < info["time_budget"]["used"] <= 600.0 and info["time_budget"]["skipped"] == []


def test_model_auto_under_a_budget_takes_the_centroid_tree_where_the_embedding_would_outlast_it(data, monkeypatch,
                                                                                                  caplog):
    """``model auto`` with a time budget: the embedding classifier where its first model's factorizations fit in the
    budget (sides of at most TIMED_SIDE are not even timed), else the label-centroid tree, whose stages past its
    first model the budget cuts (recorded)."""
    import logging
    from types import SimpleNamespace

    root, train, _ = data
    assert jobs.embedding_outlasts(SimpleNamespace(n_features=400, n_samples=3000), 1e-6) == 0.0  # 400 features
    wide = SimpleNamespace(n_features=50_000, n_samples=4000)  # the dual: the rows' 4,000 x 4,000
    assert jobs.embedding_outlasts(wide, 1e-3) > 1e-3 and jobs.embedding_outlasts(wide, 1e6) == 0.0
    assert jobs.choose_model(train, {}, time_budget=60.0) == "embedding"
    monkeypatch.setattr(jobs, "embedding_outlasts", lambda data, budget: 2 * budget)
    with caplog.at_level(logging.INFO, logger="xmldask.models.centroid"):
        assert jobs.choose_model(train, {}, time_budget=60.0) == "centroid"
        assert jobs.choose_model(train, {}) == "embedding"  # no budget: by the labels alone
        assert jobs.choose_model(train, {"n_components": 10}, time_budget=60.0) == "embedding"  # its option
    assert "past the time budget of 60 s: the label-centroid tree" in caplog.text
    info = jobs.train(train, str(root / "budget-centroid.zarr"), time_budget=0.01)
    assert info["params"]["model"] == "centroid"
    from xmldask.models import LabelCentroidClassifier

    model = LabelCentroidClassifier.load(str(root / "budget-centroid.zarr"))
    assert model.svm_weight_ == 0 and model.V_ is None and model.summary_exponent_ == 0
    assert model.beam_ == min(10, model.n_clusters_) and model.held_out_ == {}  # the narrowest beam, nothing chosen
    assert any(cut.startswith("the label classifiers") for cut in model.budget_cut_)
    assert any(cut.startswith("the held-out choices") for cut in model.budget_cut_)
