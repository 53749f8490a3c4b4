"""Held-out parameter search: candidates, the choice, the saved record, the job and the command line."""

from __future__ import annotations

import json
import math
import threading

import dask
import numpy as np
import pytest

from xmldask import jobs
from xmldask.cli import main as cli_main
from xmldask.datasets import make_synthetic
from xmldask.model_selection import HeldOutSearch, held_out_score, parse_grid
from xmldask.models import ENSEMBLE_VERSION, EmbeddingClassifier, EnsembleClassifier, NotFittedError, load_model
from xmldask.models.embedding_classifier import MODEL_VERSION
from xmldask.models.ensemble import member_seed
from xmldask.params import AUTO_ESTIMATORS
from xmldask.store import open_dataset, open_predictions
from xmldask.store.models import open_model_store


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    root = tmp_path_factory.mktemp("search")
    kw = dict(n_samples=2400, n_features=300, n_labels=60, seed=7, block_rows=500)
    train = make_synthetic(str(root / "train.zarr"), **kw).url
    return root, train


@pytest.fixture(autouse=True)
def _threads():
    with dask.config.set(scheduler="threads"):
        yield


def _template(**kw):
    return EmbeddingClassifier(embedding="rembrandt", n_components=8, kernel="none", max_epochs=2,
                               random_state=3, **kw)


@pytest.mark.slow
def test_coordinate_search_keeps_the_best_held_out_candidate(data):
    ds = open_dataset(data[1])
    search = HeldOutSearch(_template(), {"n_components": [4, 16], "alpha": [1e-3, 1.0, 100.0]},
                           max_extensions=0).fit(ds.X, ds.Y)
    # coordinate: 2 values of n_components, then 3 of alpha of which one is the setting already fitted
    assert len(search.results_) == 4
    scores = [r["score"] for r in search.results_]
    assert search.best_score_ == max(scores)
    best = search.results_[int(np.argmax(scores))]
    assert search.best_params_ == best["params"]
    # the kept estimator is that candidate, fitted with those values
    assert held_out_score(search.best_estimator_) == pytest.approx(search.best_score_)
    for name, value in search.best_params_.items():
        assert search.best_estimator_.get_params()[name] == value
    # the second coordinate started from the first coordinate's winner
    first = search.results_[:2]
    winner = max(first, key=lambda r: r["score"])["params"]["n_components"]
    assert all(r["params"]["n_components"] == winner for r in search.results_[2:])
    # refitting the chosen setting alone gives the same held-out score (same held-out rows, same seed)
    again = _template().set_params(**search.best_params_).fit(ds.X, ds.Y)
    assert held_out_score(again) == pytest.approx(search.best_score_)
    labels, _ = search.predict_topk(ds.X[:50], k=3)
    assert labels.compute().shape == (50, 3)


@pytest.mark.slow
def test_grid_search_fits_every_combination(data):
    ds = open_dataset(data[1])
    search = HeldOutSearch(_template(), {"n_components": [4, 8], "kernel": ["none", "gaussian"]},
                           strategy="grid", scoring="loss").fit(ds.X, ds.Y)
    assert [tuple(r["params"].values()) for r in search.results_] == [
        (4, "none"), (4, "gaussian"), (8, "none"), (8, "gaussian")]
    assert search.best_score_ == max(-r["val_loss"] for r in search.results_)


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["grid", "coordinate"])
def test_fits_made_at_once_give_the_same_search(data, strategy, monkeypatch):
    """n_jobs=2: the fits of a step run in two threads; the results, their order and the model kept are those of
    one fit at a time, screened settings scored by the screener's statistics staying in this thread. The full fits
    of a step race (thread_map's ``at_once``), each with every BLAS thread, as a fit alone (a pool of other size
    rounds the losses' last digits otherwise)."""
    ds = open_dataset(data[1])
    grid = {"n_components": [4, 8], "alpha": [1e-3, 1.0], "kernel": ["none", "gaussian"]}
    if strategy == "grid":  # 4 fits of a step in two threads show it as well as 8
        grid = {"alpha": [1e-3, 1.0], "kernel": ["none", "gaussian"]}
    kw = dict(strategy=strategy, max_extensions=0, screen={"max_epochs": 0, "kernel": "none"} if strategy ==
              "coordinate" else None)
    threads = []
    fit = EmbeddingClassifier.fit

    def recording_fit(self, X, Y, *, validation_seed=None, callback=None):
        threads.append(threading.current_thread().name)
        return fit(self, X, Y, validation_seed=validation_seed, callback=callback)

    one = HeldOutSearch(_template(), grid, **kw).fit(ds.X, ds.Y)
    monkeypatch.setattr(EmbeddingClassifier, "fit", recording_fit)
    many = HeldOutSearch(_template(), grid, n_jobs=2, **kw).fit(ds.X, ds.Y)
    monkeypatch.setattr(EmbeddingClassifier, "fit", fit)

    def figures(search):
        return [{**r, "seconds": 0} for r in search.results_]

    assert figures(many) == figures(one)
    assert many.best_params_ == one.best_params_ and many.best_score_ == one.best_score_
    np.testing.assert_array_equal(many.best_estimator_.W_, one.best_estimator_.W_)
    pooled = [name for name in threads if name.startswith("xmldask-fit")]
    # grid: every one of the 4 fits in the pool; coordinate: the two kernels' full fits; each in a thread of its own
    # (they race: two run at a time, and one waiting for the others' warm starts lets another run)
    assert len(pooled) == (4 if strategy == "grid" else 2), threads
    assert len(set(pooled)) == len(pooled)


def test_full_fits_race_at_their_warm_start(data):
    """A full fit makes its decoder epochs only if its warm start (its ridge decoder) scores at least as high as
    every other full fit's: the leader is the fit ``race=False`` makes, every other one is its warm start alone."""
    ds = open_dataset(data[1])
    template = _template(n_random_features=64)
    grid = {"kernel": ["none", "gaussian"], "alpha": [1e-3, 1.0]}
    raced = HeldOutSearch(template, grid, strategy="grid").fit(ds.X, ds.Y)
    plain = HeldOutSearch(template, grid, strategy="grid", race=False).fit(ds.X, ds.Y)
    settings = [r["params"] for r in plain.results_]
    assert [r["params"] for r in raced.results_] == settings
    starts = [held_out_score(_template(n_random_features=64).set_params(**setting, max_epochs=0).fit(ds.X, ds.Y))
              for setting in settings]
    leader = int(np.argmax(starts))
    for i, (fast, slow) in enumerate(zip(raced.results_, plain.results_)):
        assert fast["score"] == pytest.approx(slow["score"] if i == leader else starts[i]), (i, starts)
    assert sum(r["score"] != pytest.approx(s) for r, s in zip(plain.results_, starts)) > 1  # epochs changed them
    assert raced.best_score_ == max(r["score"] for r in raced.results_)


def test_on_lead_gets_the_full_fit_the_race_leaves_making_its_epochs(data):
    """``on_lead`` is called once, in the leading fit's thread, with the full fit whose warm start scored highest of its
    step, as its epochs start (the fits the race stopped at their warm start are not leads)."""
    ds = open_dataset(data[1])
    template = _template(n_random_features=64)
    grid = {"kernel": ["none", "gaussian"], "alpha": [1e-3, 1.0]}
    leads = []
    raced = HeldOutSearch(template, grid, strategy="grid", n_jobs=2,
                          on_lead=lambda model: leads.append((model, threading.current_thread().name))).fit(ds.X, ds.Y)
    starts = [held_out_score(_template(n_random_features=64).set_params(**r["params"], max_epochs=0).fit(ds.X, ds.Y))
              for r in raced.results_]
    assert len(set(starts)) == len(starts)  # no tie: one leader
    (model, thread), = leads
    leader = raced.results_[int(np.argmax(starts))]["params"]
    assert {name: model.get_params(deep=False)[name] for name in leader} == leader
    assert len(model.history_) > 1 and thread.startswith("xmldask-fit")
    assert model is raced.best_estimator_ or raced.best_score_ >= held_out_score(model)


def test_search_refusals(data):
    ds = open_dataset(data[1])
    with pytest.raises(ValueError, match="unknown parameter 'k'"):
        HeldOutSearch(_template(), {"k": [4]}).fit(ds.X, ds.Y)
    with pytest.raises(ValueError, match="has no values"):
        HeldOutSearch(_template(), {"alpha": []}).fit(ds.X, ds.Y)
    with pytest.raises(ValueError, match="strategy must be one of"):
        HeldOutSearch(_template(), {"alpha": [1]}, strategy="random").fit(ds.X, ds.Y)
    with pytest.raises(ValueError, match="holds out no rows"):
        HeldOutSearch(_template(validation_fraction=0.0), {"alpha": [1]}).fit(ds.X, ds.Y)
    for bad in (0, 2.0, True):
        with pytest.raises(ValueError, match="n_jobs must be a positive integer"):
            HeldOutSearch(_template(), {"alpha": [1]}, n_jobs=bad).fit(ds.X, ds.Y)
    with pytest.raises(NotFittedError):
        HeldOutSearch(_template(), {"alpha": [1]}).predict_topk(ds.X, 3)


def test_parse_grid():
    grid = parse_grid(["k=50,150", "alpha=0.001, 1", "kernel=none,gaussian"], aliases={"k": "n_components"})
    assert grid == {"n_components": [50, 150], "alpha": [0.001, 1], "kernel": ["none", "gaussian"]}
    assert isinstance(grid["alpha"][0], float) and isinstance(grid["n_components"][0], int)
    for bad in (["alpha"], ["=1,2"], ["alpha="]):
        with pytest.raises(ValueError, match="must look like NAME=V1,V2"):
            parse_grid(bad)
    with pytest.raises(ValueError, match="given twice"):
        parse_grid(["alpha=1", "alpha=2"])


@pytest.mark.slow
def test_train_job_and_command_line_search(data, capsys):
    root, train = data
    url = str(root / "searched.zarr")
    grid = {"kernel": ["none", "gaussian"], "alpha": [1e-3, 10.0]}
    # without screening: kernel, then alpha at the best kernel (3 full fits)
    info = jobs.train(train, url, k=8, kernel="none", seed=3, max_epochs=1, search=grid, search_extensions=0,
                      search_screen=False)
    assert len(info["search"]) == 3 and {"kernel", "alpha"} <= set(info["search"][0]["params"])
    assert not any(r["screened"] for r in info["search"])
    # screened (the default): alpha by the ridge decoder on the linear map, then each kernel in full
    info = jobs.train(train, url, k=8, kernel="none", seed=3, max_epochs=1, search=grid, search_extensions=0,
                      overwrite=True, n_estimators=1)  # one model: its store holds the search's record
    assert [r["screened"] for r in info["search"]] == [True, True, False, False]
    screened = {"alpha", "kernel", "max_epochs"}
    assert [set(r["params"]) for r in info["search"]] == [screened] * 2 + [{"alpha", "kernel"}] * 2
    assert all(r["params"]["max_epochs"] == 0 and r["params"]["kernel"] == "none" for r in info["search"][:2])
    screened_best = max(info["search"][:2], key=lambda r: r["val_p@1"])["params"]["alpha"]
    assert {r["params"]["alpha"] for r in info["search"][2:]} == {screened_best}
    best = max(info["search"][2:], key=lambda r: r["val_p@1"])  # the best full fit, never a screened one
    assert info["params"]["kernel"] == best["params"]["kernel"]
    assert {r["params"]["kernel"] for r in info["search"][2:]} == {"none", "gaussian"}  # the job's names
    assert info["params"]["alpha"] == best["params"]["alpha"]
    _, attrs = open_model_store(url, model_version=MODEL_VERSION, class_name="EmbeddingClassifier")
    assert attrs["search"]["best_params"]["alpha"] == best["params"]["alpha"]
    with pytest.raises(ValueError, match="kernel must be one of"):
        jobs.train(train, str(root / "x.zarr"), search={"kernel": ["rbf"]})

    out = str(root / "cli.zarr")
    assert cli_main(["train", train, "--out", out, "--k", "6", "--kernel", "none", "--max-epochs", "1",
                     "--search", "k=4,6", "--search-extensions", "1", "--json", "--workers", "1"]) == 0
    printed = json.loads(capsys.readouterr().out)
    tried = [r["params"]["n_components"] for r in printed["search"] if r["screened"]]  # --k: its former name
    # past the winning end of the grid by one step at most: 2 below 4 (ratio 2/3, floored), 9 above 6
    assert tried[:2] == [4, 6] and tried[2:] in ([], [2], [9])
    chosen = printed["params"]["n_components"]
    assert chosen == max((r for r in printed["search"] if r["screened"]),
                         key=lambda r: r["val_p@1"])["params"]["n_components"]
    assert [r["params"]["n_components"] for r in printed["search"] if not r["screened"]] == [chosen]


@pytest.mark.slow
def test_conditional_parameters_are_searched_with_the_parameter_they_depend_on(data):
    ds = open_dataset(data[1])
    grid = {"kernel": ["none", "gaussian"], "bandwidth_scale": [0.5, 4.0], "alpha": [1e-3, 1.0]}
    search = HeldOutSearch(_template(n_random_features=64), grid, max_extensions=0, race=False).fit(ds.X, ds.Y)
    params = [r["params"] for r in search.results_]
    # none once (its bandwidth is ignored), gaussian at each bandwidth, then alpha at the best of those
    assert params[:3] == [{"kernel": "none", "alpha": 1e-3},
                          {"kernel": "gaussian", "bandwidth_scale": 0.5, "alpha": 1e-3},
                          {"kernel": "gaussian", "bandwidth_scale": 4.0, "alpha": 1e-3}]
    first = max(search.results_[:3], key=lambda r: r["score"])["params"]
    def without_alpha(params):
        return {k: v for k, v in params.items() if k != "alpha"}

    assert all(without_alpha(r["params"]) == without_alpha(first) for r in search.results_[3:])
    assert len(search.results_) == 4
    # a candidate's score does not depend on a bandwidth its kernel ignores
    plain = _template().set_params(kernel="none", bandwidth_scale=4.0, alpha=1e-3).fit(ds.X, ds.Y)
    assert held_out_score(plain) == pytest.approx(search.results_[0]["score"])


def test_grid_search_skips_settings_that_differ_only_in_ignored_parameters(data):
    ds = open_dataset(data[1])
    grid = {"kernel": ["none", "gaussian"], "bandwidth_scale": [0.5, 4.0]}
    search = HeldOutSearch(_template(n_random_features=64), grid, strategy="grid").fit(ds.X, ds.Y)
    assert [r["params"] for r in search.results_] == [
        {"kernel": "none"}, {"kernel": "gaussian", "bandwidth_scale": 0.5},
        {"kernel": "gaussian", "bandwidth_scale": 4.0}]


class _Scripted:
    """A stand-in estimator whose held-out P@1 is a given function of its parameters."""

    conditional_params = {}

    def __init__(self, score=None, validation_fraction=0.1, alpha=1.0, n_components=8):
        self.score, self.validation_fraction = score, validation_fraction
        self.alpha, self.n_components = alpha, n_components

    def get_params(self, deep=True):
        return {"score": self.score, "validation_fraction": self.validation_fraction, "alpha": self.alpha,
                "n_components": self.n_components}

    def search_bounds(self, X, Y):
        return {"n_components": (1, 40)}

    def fit(self, X, Y):
        self.history_ = [{"epoch": 0, "val_p@1": self.score(self.alpha, self.n_components), "val_loss": 0.0}]
        return self


@pytest.mark.parametrize("peak, expected", [
    (30.0, [0.01, 0.1, 1.0, 10.0, 100.0]),           # best at the top edge: two steps up, the second still wins
    (5.0, [0.01, 0.1, 1.0, 10.0, 100.0]),            # 10 wins, 100 does not: stops there
    (0.3, [0.01, 0.1, 1.0]),                         # an inner best: no extension
    (1e-4, [0.01, 0.1, 1.0, 0.001, 0.0001]),         # best at the bottom edge: steps down
])
@pytest.mark.parametrize("start", ["low", "high"])
def test_coordinate_search_extends_a_grid_past_its_winning_edge(peak, expected, start):
    """The ends of the grid in increasing order, whatever the order of its values (the first one is the search's
    start)."""
    score = lambda alpha, k: -abs(math.log(alpha / peak))  # noqa: E731
    grid = [0.01, 0.1, 1.0] if start == "low" else [1.0, 0.1, 0.01]
    search = HeldOutSearch(_Scripted(score), {"alpha": grid}).fit(None, None)
    assert [r["params"]["alpha"] for r in search.results_] == pytest.approx(grid + expected[3:])
    tried = [r["params"]["alpha"] for r in search.results_]
    assert search.best_params_["alpha"] == pytest.approx(min(tried, key=lambda a: abs(math.log(a / peak))))


def test_grid_extension_of_integers_stops_at_the_bound():
    search = HeldOutSearch(_Scripted(lambda alpha, k: k), {"n_components": [4, 8]}).fit(None, None)
    # 8 * 2 = 16, then 32, then the bound 40 would be a third step: max_extensions=2 stops first
    assert [r["params"]["n_components"] for r in search.results_] == [4, 8, 16, 32]
    search = HeldOutSearch(_Scripted(lambda alpha, k: k), {"n_components": [8, 24]}, max_extensions=3).fit(None, None)
    assert [r["params"]["n_components"] for r in search.results_] == [8, 24, 40]  # 72 clipped to 40, the end
    none = HeldOutSearch(_Scripted(lambda alpha, k: k), {"n_components": [4, 8]}, max_extensions=0).fit(None, None)
    assert [r["params"]["n_components"] for r in none.results_] == [4, 8]
    with pytest.raises(ValueError, match="max_extensions"):
        HeldOutSearch(_Scripted(lambda alpha, k: k), {"n_components": [4, 8]}, max_extensions=-1).fit(None, None)


def test_train_job_reports_no_parameter_the_chosen_kernel_ignores(data):
    root, train = data
    info = jobs.train(train, str(root / "bw.zarr"), k=8, kernel="none", seed=3, max_epochs=1, bandwidth_scale=0.5,
                      n_random_features=64, search={"kernel": ["none", "gaussian"], "bandwidth_scale": [0.5, 4.0]})
    assert [r["params"] for r in info["search"]] == [
        {"kernel": "none"}, {"kernel": "gaussian", "bandwidth_scale": 0.5},
        {"kernel": "gaussian", "bandwidth_scale": 4.0}]
    chosen = max(info["search"], key=lambda r: r["val_p@1"])["params"]
    assert info["params"]["kernel"] == chosen["kernel"]
    assert ("bandwidth_scale" in info["params"]) == (chosen["kernel"] == "gaussian")
    assert ("n_random_features" in info["params"]) == (chosen["kernel"] == "gaussian")


def test_train_job_default_ensemble_keeps_the_members_that_pay(data):
    """``n_estimators`` not given after a search: members tried on the first member's held-out rows, kept while they
    pay; the job reports each one and saves the members kept (a single model when none paid)."""
    root, train = data
    url = str(root / "auto-ensemble.zarr")
    info = jobs.train(train, url, k=8, kernel="gaussian", n_random_features=3, seed=0, max_epochs=0,
                      search={"alpha": [1e-3, 10.0]}, search_extensions=0, validation_fraction=0.3)
    gains = info["ensemble"]
    assert 1 <= len(gains) <= AUTO_ESTIMATORS - 1 and all(g["kept"] for g in gains[:-1])
    kept = 1 + sum(g["kept"] for g in gains)
    assert info["params"].get("n_estimators", 1) == kept
    model = load_model(url)
    assert (len(model.estimators_) if isinstance(model, EnsembleClassifier) else 1) == kept
    if kept > 1:
        assert model.member_gains_ == gains
    # asked for: fitted as asked, without the rule
    info = jobs.train(train, str(root / "asked.zarr"), k=8, kernel="none", seed=0, max_epochs=0, n_estimators=2,
                      search={"alpha": [1e-3, 10.0]}, search_extensions=0)
    assert "ensemble" not in info and len(load_model(str(root / "asked.zarr")).estimators_) == 2


def test_train_job_default_ensemble_begins_its_members_beside_the_kept_fits_epochs(data, monkeypatch, caplog):
    """The default ensemble's first member after the search's is fitted beside the epochs of the full fit the race
    leaves (``on_lead``): the same members and choices as fitted after the search; with a time budget, not."""
    import logging

    from xmldask.models import ensemble as E

    root, train = data
    kw = dict(k=8, kernel="gaussian", n_random_features=3, seed=0, max_epochs=2, search={"kernel": ["gaussian"]},
              validation_fraction=0.3)
    with caplog.at_level(logging.INFO, logger="xmldask"):
        early = jobs.train(train, str(root / "begun.zarr"), **kw)
    assert "fitted beside the decoder epochs of the first" in caplog.text
    monkeypatch.setattr(jobs, "_members_beside", lambda *a: None)
    plain = jobs.train(train, str(root / "not-begun.zarr"), **kw)
    assert early["ensemble"] and early["ensemble"] == plain["ensemble"] and early["params"] == plain["params"]
    X = open_dataset(train).X
    a, b = load_model(str(root / "begun.zarr")), load_model(str(root / "not-begun.zarr"))
    np.testing.assert_array_equal(a.predict_topk(X, k=3)[0].compute(), b.predict_topk(X, k=3)[0].compute())
    monkeypatch.undo()
    begun = []
    monkeypatch.setattr(E.EnsembleClassifier, "begin", lambda self, *a, **k: begun.append(1) or False)
    jobs.train(train, str(root / "budget.zarr"), **kw, time_budget=600)
    assert begun == []


def test_train_job_ensemble_after_a_search(data, capsys):
    root, train = data
    url = str(root / "ensemble.zarr")
    info = jobs.train(train, url, k=8, kernel="none", seed=3, max_epochs=1, n_estimators=2,
                      search={"alpha": [1e-3, 10.0]}, search_extensions=0)
    assert info["params"]["n_estimators"] == 2
    model = load_model(url)
    assert isinstance(model, EnsembleClassifier) and len(model.estimators_) == 2
    chosen = max(info["search"], key=lambda r: r["val_p@1"])["params"]["alpha"]
    assert [m.alpha for m in model.estimators_] == [chosen, chosen]
    assert [m.random_state for m in model.estimators_] == [3, member_seed(3, 1)]
    # member 0 is the search's winner: the same held-out figures as its full fit (the screened rows are means
    # over repeated splits, with max_epochs=0)
    first = max((r for r in info["search"] if not r.get("screened")), key=lambda r: r["val_p@1"])
    assert first["params"]["alpha"] == chosen
    assert held_out_score(model.estimators_[0]) == pytest.approx(first["val_p@1"])
    _, attrs = open_model_store(url, model_version=ENSEMBLE_VERSION, class_name="EnsembleClassifier")
    assert attrs["search"]["best_params"]["alpha"] == chosen and attrs["train_url"] == train
    pred = str(root / "ensemble-pred.zarr")
    out = jobs.predict(url, train, pred, top_k=3)
    assert out["n_samples"] == open_dataset(train).n_samples
    labels, scores = model.predict_topk(open_dataset(train).X, k=3)
    np.testing.assert_array_equal(open_predictions(pred).labels.compute(), labels.compute())
    # the command line
    cli_url = str(root / "ensemble-cli.zarr")
    assert cli_main(["train", train, "--out", cli_url, "--k", "6", "--kernel", "none", "--max-epochs", "1",
                     "--n-estimators", "2", "--json", "--workers", "1"]) == 0
    assert json.loads(capsys.readouterr().out)["params"]["n_estimators"] == 2
    assert len(load_model(cli_url).estimators_) == 2


def test_train_job_holds_small_training_rows_in_memory_for_its_fits(data, monkeypatch):
    """A search and an ensemble on rows that fit the workers' memory read the store once (persisted rows,
    no store reader), and make the model that reading it at every pass makes."""
    from xmldask.store.csr import block_reader

    root, train = data
    from_store = []
    search_fit = HeldOutSearch.fit

    def fit(self, X, Y, **kw):
        from_store.append(block_reader(X) is not None)
        return search_fit(self, X, Y, **kw)

    monkeypatch.setattr(HeldOutSearch, "fit", fit)
    kw = dict(k=8, kernel="none", seed=3, max_epochs=1, n_estimators=2, search={"alpha": [1e-3, 10.0]},
              search_extensions=0)
    held = load_model(jobs.train(train, str(root / "held.zarr"), **kw)["model"])
    monkeypatch.setattr(jobs, "IN_MEMORY_SHARE", 0.0)
    read = load_model(jobs.train(train, str(root / "read.zarr"), **kw)["model"])
    assert from_store == [False, True]
    X = open_dataset(train).X
    (a_labels, a_scores), (b_labels, b_scores) = (dask.compute(*m.predict_topk(X, k=3)) for m in (held, read))
    np.testing.assert_array_equal(a_labels, b_labels)
    np.testing.assert_allclose(a_scores, b_scores, rtol=1e-6)


@pytest.mark.slow
def test_screen_repeats_score_a_setting_by_the_mean_over_splits(data):
    """screen_repeats=3: a screened setting's figures are the mean of three fits on other held-out splits
    (seeds drawn from the template's), computed here one by one; full fits are made once."""
    from xmldask.base import kept_epoch

    ds = open_dataset(data[1])
    screen = {"max_epochs": 0, "kernel": "none"}
    search = HeldOutSearch(_template(), {"alpha": [1e-3, 1.0]}, screen=screen, screen_repeats=3,
                           max_extensions=0).fit(ds.X, ds.Y)
    screened = [r for r in search.results_ if r["screened"]]
    assert [r["params"]["alpha"] for r in screened] == [1e-3, 1.0]
    for record in screened:
        params = {**_template().get_params(deep=False), **screen, "alpha": record["params"]["alpha"]}
        seeds = [3] + [int(np.random.SeedSequence([3, i]).generate_state(1)[0]) for i in (1, 2)]
        kept = [kept_epoch(EmbeddingClassifier(**{**params, "random_state": s}).fit(ds.X, ds.Y)) for s in seeds]
        assert record["val_p@1"] == pytest.approx(np.mean([k["val_p@1"] for k in kept]))
        assert "val_loss" not in record  # a P@1 search screens without the loss
        assert len({k["val_p@1"] for k in kept}) > 1  # the splits differ
    full = [r for r in search.results_ if not r["screened"]]
    assert len(full) == 1 and search.best_estimator_.random_state == 3


def test_screen_fraction_screens_on_that_share_and_the_finalist_competes_on_the_full_fits_rows(data):
    """screen_fraction=0.3: a screened setting's figures are those of the fit holding out 0.3 of the rows; the
    screen's best then competes with the full fit on the full fit's own held-out rows (the template's 0.1), and the
    model kept holds out 0.1 whichever wins."""
    from xmldask.base import kept_epoch

    ds = open_dataset(data[1])
    screen = {"max_epochs": 0, "kernel": "none"}
    template = _template(validation_fraction=0.1)
    search = HeldOutSearch(template, {"alpha": [1e-3, 1.0], "kernel": ["gaussian"]}, screen=screen,
                           screen_fraction=0.3, screen_finalist=True, max_extensions=0).fit(ds.X, ds.Y)
    params = {**template.get_params(deep=False), **screen}
    screened = [r for r in search.results_ if r["screened"]]
    for record in screened:
        kept = kept_epoch(EmbeddingClassifier(**{**params, "alpha": record["params"]["alpha"],
                                                 "validation_fraction": 0.3}).fit(ds.X, ds.Y))
        assert record["val_p@1"] == pytest.approx(kept["val_p@1"], abs=1e-9)
    best_alpha = max(screened, key=lambda r: r["score"])["params"]["alpha"]
    as_screened = held_out_score(EmbeddingClassifier(**{**params, "alpha": best_alpha}).fit(ds.X, ds.Y))
    (full,) = [r["score"] for r in search.results_ if not r["screened"]]
    assert search.best_score_ == pytest.approx(max(as_screened, full))
    assert search.best_estimator_.validation_fraction == 0.1
    assert search.record()["screen_fraction"] == 0.3


@pytest.mark.parametrize("fraction", [0, 1, 1.5, -0.2, True, "0.3"])
def test_screen_fraction_outside_zero_one_is_refused_by_name(data, fraction):
    ds = open_dataset(data[1])
    with pytest.raises(ValueError, match="screen_fraction must be between 0 and 1"):
        HeldOutSearch(_template(), {"alpha": [1.0]}, screen={"max_epochs": 0}, screen_fraction=fraction).fit(ds.X, ds.Y)


@pytest.mark.parametrize("n, fraction, repeats", [
    (100_000, None, 1),  # the model's own 0.1 holds out 10,000 rows: its own split
    (8000, 0.125, 1),  # 1000 rows are an eighth: one split of them
    (4000, 0.25, 1),  # a quarter
    (2000, 0.25, 2),  # a quarter is 500 rows: two splits
    (300, 0.25, 5),  # 75 rows a split: at most five
])
def test_the_screen_holds_out_about_a_thousand_rows_in_as_few_splits_as_a_quarter_of_the_rows_allow(n, fraction,
                                                                                                      repeats):
    from types import SimpleNamespace

    from xmldask.models import TrainParams

    split = jobs._screen_split(TrainParams(), EmbeddingClassifier(validation_fraction=0.1),
                               SimpleNamespace(n_samples=n))
    assert split == {"screen_repeats": repeats, "screen_fraction": fraction}
    assert jobs._screen_split(TrainParams(search_repeats=3), EmbeddingClassifier(), None) == {"screen_repeats": 3}


@pytest.fixture(scope="module")
def multiclass_data(tmp_path_factory):
    url = str(tmp_path_factory.mktemp("search-mc") / "train.zarr")
    return make_synthetic(url, n_samples=1900, n_features=120, n_labels=12, multiclass=True, rank=6, seed=4,
                          block_rows=450).url


@pytest.mark.slow
@pytest.mark.parametrize("route", ["primal", "dual"])
@pytest.mark.parametrize("features", ["raw", "l2", "tfidf"])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("which", ["multilabel", "multiclass"])
def test_screener_gives_the_figures_of_the_screened_fit(data, multiclass_data, features, dtype, which, route,
                                                         monkeypatch):
    """A screened setting's held-out figures from the shared statistics equal those of its fit (uneven
    row blocks; every k, alpha and seed on the same statistics); in the dual too, where the fit solves its least
    squares through the rows' Gram matrix (taken here by lowering the feature limit)."""
    if route == "dual":
        from xmldask.linalg import solvers
        from xmldask.models import _screen

        monkeypatch.setattr(solvers, "MAX_GRAM_FEATURES", 0)
        monkeypatch.setattr(_screen, "MAX_GRAM_FEATURES", 0)
    ds = open_dataset(data[1] if which == "multilabel" else multiclass_data)
    template = _template(features=features, dtype=dtype)
    screener = template.screener(ds.X, ds.Y)
    for k, alpha, seed in [(8, 1e-3, 3), (5, 1.0, 3), (8, 1e-3, 11), (ds.Y.shape[1], 0.1, 3)]:  # k = L: the identity
        params = {**template.get_params(deep=False), "max_epochs": 0, "n_components": k, "alpha": alpha,
                  "random_state": seed}
        assert screener.applies(params)
        got = screener.score(params)
        fit = EmbeddingClassifier(**params).fit(ds.X, ds.Y)
        want = fit.history_[0]
        assert got["val_p@1"] == want["val_p@1"]
        assert got["val_loss"] == pytest.approx(want["val_loss"], rel=1e-4 if dtype == np.float32 else 1e-6)
        # a P@k screen: the same P@1 from the decoder not rescaled, and no loss
        ranked = screener.score(params, loss=False)
        assert ranked["val_p@1"] == want["val_p@1"] and "val_loss" not in ranked
    # one pass per input normalisation and held-out split (a tf-idf's document counts: one more); the dual
    # draws the held-out rows from the split's seed: one pass per input normalisation
    assert screener.n_passes == (2 if route == "primal" else 1) + (features == "tfidf")


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("kernel", ["none", "gaussian"])
@pytest.mark.parametrize("every_label", [False, True])
def test_a_full_fit_takes_what_it_would_compute_first_from_the_screen_s_statistics(data, dtype, kernel, every_label,
                                                                                   caplog):
    """After a screen, a full fit of any kernel (with decoder epochs) takes its Rembrandt embedding and its ridge map
    from the screener's statistics (``offer``), and on the linear map its decoder's normal equations and held-out
    features too: the model a fit alone makes, to rounding (uneven row blocks), with none of those passes."""
    import gc
    import logging

    ds = open_dataset(data[1])
    template = _template(dtype=dtype, n_random_features=64, features="tfidf")
    params = {**template.get_params(deep=False), "kernel": kernel, "n_components": ds.Y.shape[1] if every_label else 5,
              "alpha": 0.3}
    alone = EmbeddingClassifier(**params).fit(ds.X, ds.Y)
    want = {name: np.array(getattr(alone, name)) for name in ("W_", "intercept_", "Q_", "bias_")}
    want_history, want_passes = alone.history_, alone.n_passes_
    del alone
    gc.collect()  # what the fit shared in this process (computed_once) goes with it
    screener = template.screener(ds.X, ds.Y)
    screener.score({**params, "kernel": "none", "max_epochs": 0})  # a screen: its pass gathers the full fits' rows
    passes = screener.n_passes
    assert screener.offer(params)
    with caplog.at_level(logging.INFO, logger="xmldask.models"):
        fit = EmbeddingClassifier(**params).fit(ds.X, ds.Y)
    assert screener.n_passes == passes  # no pass made for the offer
    taken = [r.getMessage() for r in caplog.records if "taken from the screen's statistics" in r.getMessage()]
    assert len(taken) == 1 + (not every_label) + (kernel == "none")
    # left: tf-idf's document counts, the decoder's pass on random features, an epoch's each (2)
    assert fit.n_passes_ == 1 + (kernel == "gaussian") + 2 < want_passes
    tol = dict(rel=2e-3 if dtype == np.float32 else 1e-4)  # the stored rows are float32: so is a fit's own X^T X
    for name, value in want.items():
        np.testing.assert_allclose(getattr(fit, name), value, rtol=tol["rel"], atol=tol["rel"] * np.abs(value).max())
    assert [h["val_p@1"] for h in fit.history_] == [h["val_p@1"] for h in want_history]
    assert [h["val_loss"] for h in fit.history_] == pytest.approx([h["val_loss"] for h in want_history], **tol)


def test_the_screener_offers_nothing_it_does_not_hold(data, monkeypatch):
    """No offer before a screen's pass (it would be a pass of its own), nor on the dual route (its map is a pass)."""
    from xmldask.models import _screen

    ds = open_dataset(data[1])
    template = _template()
    params = template.get_params(deep=False)
    screener = template.screener(ds.X, ds.Y)
    assert not screener.offer(params) and screener.n_passes == 0
    monkeypatch.setattr(_screen, "MAX_GRAM_FEATURES", 0)
    dual = template.screener(ds.X, ds.Y)
    dual.score({**params, "max_epochs": 0})
    assert not dual.offer(params)


@pytest.mark.parametrize("features", ["raw", "tfidf"])
def test_screener_gathers_the_held_out_rows_of_a_settings_repeats_in_one_pass(data, features):
    """``prepare`` of a setting's repeats (other seeds: other held-out splits) makes one pass per input normalisation
    for all their splits; their scores are then those of a screener that made a pass per split."""
    ds = open_dataset(data[1])
    template = _template(features=features)
    repeats = [{**template.get_params(deep=False), "max_epochs": 0, "n_components": 8, "alpha": 0.1,
                "random_state": seed} for seed in (3, 11, 12)]
    screener = template.screener(ds.X, ds.Y)
    screener.prepare(repeats)
    assert screener.n_passes == 1 + (features == "tfidf")
    alone = template.screener(ds.X, ds.Y)
    for params in repeats:
        assert screener.score(params) == pytest.approx({**alone.score(params), "seconds": pytest.approx(0, abs=1e9),
                                                        "solve_seconds": pytest.approx(0, abs=1e9)})
    assert screener.n_passes == 1 + (features == "tfidf") and alone.n_passes == 3 + (features == "tfidf")


def test_screener_prepares_the_statistics_of_several_input_normalisations_in_one_compute(data, monkeypatch):
    """The screened settings of a search step on two input normalisations: their statistics in one compute (the
    tf-idf's document counts in one before), each's scores those of a screener that made them one at a time."""
    from xmldask.models import _screen

    ds = open_dataset(data[1])
    template = _template()
    settings = [{**template.get_params(deep=False), "max_epochs": 0, "n_components": 8, "alpha": 0.1,
                 "features": features} for features in ("raw", "tfidf")]
    computes = []
    compute = dask.compute
    monkeypatch.setattr(_screen.dask, "compute", lambda *a, **kw: computes.append(a) or compute(*a, **kw))
    screener = template.screener(ds.X, ds.Y)
    screener.prepare(settings)
    # two computes: the tf-idf's document counts, then the statistics of both; three passes over the rows
    assert len(computes) == 2 and screener.n_passes == 3
    monkeypatch.setattr(_screen.dask, "compute", compute)
    for params in settings:
        alone = template.screener(ds.X, ds.Y)
        assert screener.score(params) == pytest.approx({**alone.score(params), "seconds": pytest.approx(0, abs=1e9),
                                                        "solve_seconds": pytest.approx(0, abs=1e9)})
    assert screener.n_passes == 3  # none more for the scores


@pytest.mark.parametrize("route", ["primal", "dual"])
def test_screener_shares_a_split_s_factors_between_settings_within_its_cache(data, route, monkeypatch):
    """Settings on the same split reuse its centred Gram matrix and each ridge's factor: the same figures as a
    screener that keeps nothing (cache of 0 bytes), and the cache never holds more than its limit."""
    from xmldask.models import _screen

    if route == "dual":
        monkeypatch.setattr(_screen, "MAX_GRAM_FEATURES", 0)
    ds = open_dataset(data[1])
    base = {**_template().get_params(deep=False), "max_epochs": 0}
    settings = [{"n_components": k, "alpha": a, "random_state": s}
                for a in (1e-3, 1.0) for k in (4, 8) for s in (3, 11)]
    kept = _template().screener(ds.X, ds.Y)
    limit = 3 * 8 * (ds.X.shape[1] if route == "primal" else ds.X.shape[0]) ** 2  # three matrices: some dropped
    kept._shared.limit = limit
    nothing = _template().screener(ds.X, ds.Y)
    nothing._shared.limit = 0
    for setting in settings:
        a, b = kept.score({**base, **setting}), nothing.score({**base, **setting})
        assert a["val_p@1"] == b["val_p@1"] and a["val_loss"] == pytest.approx(b["val_loss"], rel=1e-6)
        assert kept._shared.bytes <= limit
    assert kept._shared.items and not nothing._shared.items


@pytest.mark.parametrize("route", ["primal", "dual"])
def test_screener_holds_the_statistics_of_what_it_scored(data, route, monkeypatch):
    """``holds``: a setting on the statistics and embedding of one scored already (its score a solve), not one of
    another input normalisation (a pass) or another embedding (a decomposition; the identity needs none)."""
    from xmldask.models import _screen

    if route == "dual":
        monkeypatch.setattr(_screen, "MAX_GRAM_FEATURES", 0)
    ds = open_dataset(data[1])
    screener = _template().screener(ds.X, ds.Y)
    base = {**_template().get_params(deep=False), "max_epochs": 0, "n_components": 4}
    other = "tfidf" if base["features"] != "tfidf" else "raw"
    assert not screener.holds(base)
    out = screener.score(base)
    assert 0 < out["solve_seconds"] <= out["seconds"]
    assert screener.holds(base) and screener.holds({**base, "alpha": 7.0})
    assert not screener.holds({**base, "n_components": 6}) and not screener.holds({**base, "features": other})
    assert screener.holds({**base, "n_components": ds.Y.shape[1]})


def test_screener_refuses_what_it_does_not_compute(data, monkeypatch):
    from xmldask.models import _screen

    ds = open_dataset(data[1])
    screener = _template().screener(ds.X, ds.Y)
    base = {**_template().get_params(deep=False), "max_epochs": 0}
    assert screener.applies(base)
    for change in ({"max_epochs": 1}, {"kernel": "gaussian"}, {"embedding": "cs"}, {"validation_fraction": 0.0}):
        assert not screener.applies({**base, **change})
    with pytest.raises(ValueError, match="fit it instead"):
        screener.score({**base, "kernel": "gaussian"})
    monkeypatch.setattr(_screen, "MAX_GRAM_FEATURES", ds.X.shape[1] - 1)  # too many features for a Gram: the dual
    assert screener.applies(base)
    monkeypatch.setattr(_screen.solvers, "MAX_DUAL_ROWS", ds.X.shape[0] - 1)  # and too many rows: CG, no statistics
    assert not screener.applies(base)


@pytest.mark.slow
def test_search_chooses_the_same_with_and_without_the_screener(data, monkeypatch):
    """The screener changes how a screened setting is computed, not the search: same settings, same figures."""
    ds = open_dataset(data[1])
    grid = {"features": ["raw", "tfidf"], "n_components": [4, 16], "alpha": [1e-3, 1.0], "kernel": ["none"]}
    kw = dict(screen={"max_epochs": 0, "kernel": "none"}, screen_repeats=2, max_extensions=1)
    shared = HeldOutSearch(_template(), grid, **kw).fit(ds.X, ds.Y)
    monkeypatch.setattr(EmbeddingClassifier, "screener", lambda self, X, Y: None)
    fitted = HeldOutSearch(_template(), grid, **kw).fit(ds.X, ds.Y)
    assert [r["params"] for r in shared.results_] == [r["params"] for r in fitted.results_]
    for a, b in zip(shared.results_, fitted.results_):
        assert a["val_p@1"] == b["val_p@1"]
        # a P@1 search's screener computes no loss; the full fits have theirs
        assert ("val_loss" in a) is (not a["screened"])
        assert a.get("val_loss", b["val_loss"]) == pytest.approx(b["val_loss"], rel=1e-4)
    assert shared.best_params_ == fitted.best_params_


@pytest.mark.slow
def test_screened_finalist_is_kept_where_it_beats_the_full_fits(data):
    """screen_finalist: the screen's best setting as screened (the ridge decoder alone on the linear map) is kept,
    fitted once more, when it scores higher than the full fits on their held-out rows (its first split)."""
    ds = open_dataset(data[1])
    screen = {"max_epochs": 0, "kernel": "none"}
    template = _template(n_random_features=2)  # full fits on 2 Laplacian random features: poor
    grid = {"alpha": [1e-3, 1.0], "kernel": ["laplacian"]}
    kw = dict(screen=screen, screen_repeats=2, max_extensions=0)
    plain = HeldOutSearch(template, grid, **kw).fit(ds.X, ds.Y)
    search = HeldOutSearch(template, grid, screen_finalist=True, **kw).fit(ds.X, ds.Y)
    assert [r["params"] for r in search.results_] == [r["params"] for r in plain.results_]
    assert plain.best_params_["kernel"] == "laplacian" and plain.best_estimator_.max_epochs == 2
    screened = [r for r in plain.results_ if r["screened"]]
    winner = max(screened, key=lambda r: r["score"])["params"]
    assert search.best_params_ == winner == {"alpha": winner["alpha"], **screen}
    model = search.best_estimator_
    assert (model.max_epochs, model.kernel, model.alpha, model.random_state) == (0, "none", winner["alpha"], 3)
    # its score is its own fit's, on the full fit's held-out rows, and beats the full fit there
    assert search.best_score_ == held_out_score(model) > plain.best_score_
    alone = EmbeddingClassifier(**{**template.get_params(deep=False), **winner}).fit(ds.X, ds.Y)
    assert held_out_score(alone) == search.best_score_


def test_train_job_lets_the_screened_decoder_win_at_the_default_epochs_with_the_linear_map(data, monkeypatch):
    """The job offers the ridge decoder alone as a finalist unless the decoder's epochs or a nonlinear map are asked
    for (nothing is fitted here: the search is stopped as it starts)."""
    class Started(Exception):
        pass

    seen = []

    def fit(self, X, Y, **kw):
        seen.append(self.screen_finalist)
        raise Started

    monkeypatch.setattr(HeldOutSearch, "fit", fit)
    root, train = data
    for extra, expected in [({}, True), ({"max_epochs": 3}, False), ({"kernel": "gaussian"}, False),
                            ({"search": {"alpha": [1e-3, 1.0]}, "kernel": "none"}, True),
                            ({"search_screen": False}, False)]:
        with pytest.raises(Started):
            jobs.train(train, str(root / "never.zarr"), k=8, **extra)
        assert seen[-1] is expected, extra
    assert not (root / "never.zarr").exists()


def test_split_rows_are_each_blocks_seeded_rows():
    import scipy.sparse as sp

    from xmldask.models import _kernels as K
    from xmldask.models._graph import HeldOut

    chunks = (7, 13, 1, 15)
    A = sp.random(sum(chunks), 6, density=0.4, format="csr", random_state=0, dtype=np.float32)
    split = HeldOut(11, 0.3, chunks)
    X = dask.array.from_array(A, chunks=(chunks, -1), asarray=False, fancy=False)
    mask = np.concatenate([K.holdout_mask(11, b, n, 0.3) for b, n in enumerate(chunks)])
    for held, rows in ((True, mask), (False, ~mask)):
        part = split.rows(X, held=held)
        assert sum(part.chunks[0]) == rows.sum()
        np.testing.assert_array_equal(part.compute().toarray(), A.toarray()[rows])


def _leml_data(root):
    from xmldask.missing import mask_dataset

    kw = dict(n_features=60, n_labels=15, seed=3, block_rows=150)
    train = make_synthetic(str(root / "leml-train.zarr"), n_samples=700, **kw).url
    masked = mask_dataset(train, str(root / "leml-masked.zarr"), observed=0.3, seed=0)
    return open_dataset(train), open_dataset(masked["url"])


@pytest.mark.slow
def test_search_of_an_estimator_without_own_held_out_rows_scores_p_at_k_and_refits(tmp_path):
    from xmldask.models import LEML, BinaryRelevance
    from xmldask.models._graph import HeldOut

    full, masked = _leml_data(tmp_path)
    search = HeldOutSearch(LEML(n_components=4, n_iter=1, random_state=0),
                           {"lam": [0.1, 10.0], "features": ["raw", "l2"]}, scoring="p@3").fit(full.X, full.Y)
    scores = [r["score"] for r in search.results_]
    assert search.best_score_ == max(scores) and search.best_params_ == search.results_[scores.index(max(scores))][
        "params"]
    # the score is P@3 of the candidate fitted on the rows not held out, on the held-out rows
    split = HeldOut(0, 0.2, tuple(full.X.chunks[0]))
    best = search.best_params_
    alone = LEML(n_components=4, n_iter=1, random_state=0, **best).fit(split.rows(full.X, held=False),
                                                                         split.rows(full.Y, held=False))
    labels = alone.predict_topk(split.rows(full.X, held=True), k=5)[0].compute()
    truth = split.rows(full.Y, held=True).compute()
    from xmldask import metrics

    assert search.best_score_ == pytest.approx(metrics.precision_at_k(truth, labels, k=3))
    # the model kept is the best setting refitted on every row
    again = LEML(n_components=4, n_iter=1, random_state=0, **best).fit(full.X, full.Y)
    np.testing.assert_allclose(search.best_estimator_.W_, again.W_)
    # an observed-entry mask goes to every fit; an estimator holding out rows itself takes none
    br = HeldOutSearch(BinaryRelevance(max_cg_iter=5), {"lam": [1.0, 10.0]}, scoring="p@3", max_extensions=0).fit(
        masked.X, masked.Y, masked.observed)
    assert br.best_estimator_.observed_fraction_ < 0.5 and len(br.results_) == 2
    with pytest.raises(ValueError, match="takes no observed-entry mask"):
        HeldOutSearch(_template(), {"alpha": [1]}).fit(masked.X, masked.Y, masked.observed)
    with pytest.raises(ValueError, match="scoring must be one of 'p@1', 'p@3', 'p@5'"):
        HeldOutSearch(BinaryRelevance(), {"lam": [1.0]}, scoring="loss").fit(full.X, full.Y)


class _Clock:
    """A fake ``time.perf_counter``: fits advance it by their ``cost`` seconds."""

    now = 0.0

    def __call__(self):
        return self.now


class _Timed:
    """A stand-in estimator whose fit 'takes' ``cost`` seconds of the fake clock and scores ``value``."""

    clock = _Clock()

    def __init__(self, value=0.0, cost=1.0, random_state=0):
        self.value, self.cost, self.random_state = value, cost, random_state

    def get_params(self, deep=False):
        return {"value": self.value, "cost": self.cost, "random_state": self.random_state}

    def fit(self, X, Y):
        _Timed.clock.now += self.cost
        return self

    def predict_topk(self, X, k=5):
        # label 0 is relevant for every row of the test data: value 1 ranks it first, value 0 last
        labels = np.tile(np.arange(k) if self.value else np.arange(k)[::-1] + 1, (X.shape[0], 1))
        return dask.array.from_array(labels.astype(np.int32)), None


def test_time_budget_stops_the_search_and_keeps_the_best_so_far(monkeypatch):
    import scipy.sparse as sp

    import xmldask.model_selection as ms

    monkeypatch.setattr(ms.time, "perf_counter", _Timed.clock)
    X = dask.array.from_array(sp.csr_matrix(np.ones((50, 3))), chunks=(25, -1), asarray=False, fancy=False)
    first = sp.csr_matrix((np.ones(50), np.zeros(50, int), np.arange(51)), shape=(50, 8))  # label 0 on every row
    Y = dask.array.from_array(first, chunks=(25, -1), asarray=False, fancy=False)
    grid = {"value": [0, 1, 2, 3, 4]}
    # no budget: every value; a budget of 3.5 s: fits of 1 s each, the refit 1.25 s -> 2 fits, then stop
    assert len(HeldOutSearch(_Timed(), grid, scoring="p@1").fit(X, Y).results_) == 5
    search = HeldOutSearch(_Timed(), grid, scoring="p@1", time_budget=3.5).fit(X, Y)
    assert [r["params"]["value"] for r in search.results_] == [0, 1]
    assert [s["params"]["value"] for s in search.skipped_] == [2, 3, 4]
    assert search.best_params_ == {"value": 1} and search.seconds_ <= 3.5
    assert search.record()["skipped"] == search.skipped_
    with pytest.raises(ms.BudgetError, match=r"shorter than one fit: the first model .* was ready after 1.0 s; give "
                                             r"at least 2 s"):
        HeldOutSearch(_Timed(), grid, scoring="p@1", time_budget=0.5).fit(X, Y)
    for bad in (0, -1, math.inf, "10", True):
        with pytest.raises(ValueError, match="time_budget must be a positive number"):
            HeldOutSearch(_Timed(), grid, scoring="p@1", time_budget=bad).fit(X, Y)


def test_time_budget_makes_a_model_first_and_expects_screens_to_cost_what_the_screener_holds(data, monkeypatch):
    """With a time budget (and ``screen_finalist``) a first guess is fitted first (the middle of the alphas, whose
    fits cost alike; the first features), in full where the screen only leaves out the decoder epochs (the template's
    2, cut by the budget, from the ridge decoder the screened guess would be): a budget that holds one fit gets that
    model (a screen, then a model of its best, took two fits and the budget was refused). A screened setting whose
    statistics the screener holds is expected to cost a solve, one that needs a pass what those cost; the screen
    leaves the time of one more fit for its best."""
    import xmldask.model_selection as ms
    from xmldask.models._screen import Screener

    clock = _Clock()
    monkeypatch.setattr(ms.time, "perf_counter", clock)  # the fits' and the screener's clock too
    fit, score, gather = EmbeddingClassifier.fit, Screener.score, Screener._gather

    def timed_fit(self, *args, **kwargs):  # a fit: 1 s
        clock.now += 1.0
        return fit(self, *args, **kwargs)

    def timed_gather(self, wanted):  # a pass of the screener: 0.8 s an input normalisation; its solve: 0.1 s
        for est, _, splits in wanted:
            held = est.features in self._moments and all((s.seed, s.fraction) in self._moments[est.features].held
                                                         for s in splits)
            clock.now += 0.0 if held else 0.8
        return gather(self, wanted)

    def timed_score(self, params, **kwargs):
        out = score(self, params, **kwargs)
        clock.now += 0.1
        return out

    monkeypatch.setattr(EmbeddingClassifier, "fit", timed_fit)
    monkeypatch.setattr(Screener, "_gather", timed_gather)
    monkeypatch.setattr(Screener, "score", timed_score)
    ds = open_dataset(data[1])
    screen = {"max_epochs": 0, "kernel": "none"}
    grid = {"features": ["raw", "tfidf"], "alpha": [1e-3, 1.0, 10.0], "kernel": ["none"]}
    kw = dict(screen=screen, screen_finalist=True, max_extensions=0)
    for budget in (1.5, 4.0):
        clock.now = 0.0
        search = HeldOutSearch(_template(), grid, time_budget=budget, **kw).fit(ds.X, ds.Y)
        assert search.seconds_ <= budget
        screened = [r["params"] for r in search.results_ if r["screened"]]
        full = [r["params"] for r in search.results_ if not r["screened"]]
        assert full[0] == {"features": "raw", "alpha": 1.0, "kernel": "none"}  # the first model, with its epochs
        if budget == 1.5:  # the first model alone: no screen (0.9 s) and a fit (1 s) more
            assert search.best_params_ == full[0] and not screened and len(full) == 1
            # the search's own start (alpha 1e-3), its screen cut, is not scored after it either, though a screen
            # that holds out rows of its own would score it by a fit
            assert clock.now == 1.0 and len(search.skipped_) >= 1
            clock.now = 0.0
            search = HeldOutSearch(_template(), grid, time_budget=budget, screen_fraction=0.3, **kw).fit(ds.X, ds.Y)
            assert search.best_params_["alpha"] == 1.0 and clock.now == 1.0 and search.seconds_ <= budget
            assert isinstance(search.best_estimator_, EmbeddingClassifier)
        else:  # 1 s, then two screens of a pass (2 x 0.9 s), then solves (0.1 s each) while a fit (1 s) is left
            assert [(p["features"], p["alpha"]) for p in screened][:2] == [("raw", 1e-3), ("tfidf", 1e-3)]
            assert len(screened) == 4, screened  # the other two alphas of the features chosen: 3.0 s
            # then the full fit of the screen's best (1 s), which ends at the budget
            assert full[1:] == [{"features": "tfidf", "alpha": 10.0, "kernel": "none"}] and clock.now == 4.0


def test_a_budgets_first_guess_takes_the_middle_of_numbers_that_cost_alike():
    """Before anything is scored, a time budget's first model takes each numeric parameter whose values cost alike
    at the middle of its values (the upper middle of an even number, in sorted order), any other at its first: on
    the linear map the embedding classifier's cost is its width (``n_components``), and its ridge strength costs
    nothing."""
    search = HeldOutSearch(_template(), {})
    grid = {"features": ["raw", "tfidf"], "alpha": [90.0, 1e-3, 3.0, 0.1], "n_components": [400, 50],
            "max_epochs": [0, 5, 10]}
    linear = {"kernel": "none"}
    assert search._first_guess(grid, linear) == {"features": "raw", "alpha": 3.0, "n_components": 400,
                                                 "max_epochs": 5}
    # with random features the width is theirs: every n_components costs alike
    assert search._first_guess(grid, {"kernel": "gaussian"})["n_components"] == 400
    assert search._first_guess({"n_components": [400, 50, 6]}, {"kernel": "gaussian"}) == {"n_components": 50}
    assert search._first_guess({"alpha": [1e-3, 1.0, 10.0]}) == {"alpha": 1.0}
    assert search._first_guess({"fit_intercept": [True, False], "alpha": [2.0]}) == {"fit_intercept": True,
                                                                                      "alpha": 2.0}


@pytest.mark.parametrize("screen_fraction", [None, 0.3])
def test_screened_finalist_is_taken_from_the_full_fit_of_its_setting(data, monkeypatch, screen_fraction):
    """Where the screen's best, as screened, wins and a full fit of the same setting on the linear map ran with
    decoder epochs, the search keeps that fit's ridge decoder (``at_warm_start``) instead of fitting it again: the
    same model as a fresh fit of the chosen setting, one fit fewer. A screen that held out other rows
    (``screen_fraction``) does not solve the finalist again on the full fits' rows either: the warm start's figure
    is that solve's."""
    import gc

    from xmldask.models._screen import Screener

    gc.collect()  # no model of an earlier test left to share its map with this one's (computed_once)
    screened = []
    score = Screener.score
    monkeypatch.setattr(Screener, "score", lambda self, params, **kw: screened.append(params) or
                        score(self, params, **kw))
    ds = open_dataset(data[1])
    screen = {"max_epochs": 0, "kernel": "none"}
    template = _template()
    grid = {"alpha": [1e-3, 1.0], "kernel": ["none"]}

    def worse_epochs(self, d, Q, P, p, rng, callback=None):  # an epoch of lower held-out loss that ranks no label right
        d.history.append({**d.history[0], "epoch": 1, "val_loss": 0.0, "val_p@1": 0.0})
        return Q * 0, 1

    monkeypatch.setattr(EmbeddingClassifier, "_sgd", worse_epochs)
    fits = []
    original = EmbeddingClassifier.fit
    monkeypatch.setattr(EmbeddingClassifier, "fit", lambda self, *a, **kw: fits.append(self.get_params()) or
                        original(self, *a, **kw))
    search = HeldOutSearch(template, grid, screen=screen, screen_finalist=True, max_extensions=0,
                           screen_fraction=screen_fraction, n_jobs=1).fit(ds.X, ds.Y)
    assert search.best_params_ == {"alpha": search.best_params_["alpha"], **screen}
    assert len(screened) == len(grid["alpha"])  # the screened settings alone
    full_fits = [f for f in fits if f["max_epochs"] > 0]
    assert len(full_fits) == 1 and not [f for f in fits if f["max_epochs"] == 0 and
                                         f["validation_fraction"] == template.validation_fraction]
    model = search.best_estimator_
    alone = original(EmbeddingClassifier(**{**template.get_params(deep=False), **search.best_params_}), ds.X, ds.Y)
    # its ridge map and decoder statistics were the screen's (Screener.offer): no pass of its own, the same model to
    # rounding
    assert model.max_epochs == 0 and model.n_passes_ == 0 < alone.n_passes_
    np.testing.assert_allclose(model.Q_, alone.Q_, rtol=1e-4, atol=1e-5 * np.abs(alone.Q_).max())
    np.testing.assert_allclose(model.bias_, alone.bias_, rtol=1e-4, atol=1e-5 * np.abs(alone.bias_).max())
    assert model.history_[0].keys() == alone.history_[0].keys() and len(model.history_) == 1
    for name, value in alone.history_[0].items():
        if name != "seconds":
            assert model.history_[0][name] == (value if value is None else pytest.approx(value, rel=1e-5)), name
    assert search.best_score_ == pytest.approx(held_out_score(alone), rel=1e-5)


def test_time_budget_hands_the_first_model_on_and_leaves_its_seconds_at_the_end(monkeypatch):
    """``on_first_model`` gets the first model as soon as it is made, once; the seconds it took (the job's save) are
    left at the end of the budget (``reserve_``), so the search stops a fit earlier than without it."""
    import scipy.sparse as sp

    import xmldask.model_selection as ms

    monkeypatch.setattr(ms.time, "perf_counter", _Timed.clock)
    X = dask.array.from_array(sp.csr_matrix(np.ones((50, 3))), chunks=(25, -1), asarray=False, fancy=False)
    first = sp.csr_matrix((np.ones(50), np.zeros(50, int), np.arange(51)), shape=(50, 8))
    Y = dask.array.from_array(first, chunks=(25, -1), asarray=False, fancy=False)
    grid = {"value": [0, 1, 2, 3, 4]}
    handed = []

    def save(model):  # "takes" a second of the fake clock
        handed.append(model.value)
        _Timed.clock.now += 1.0

    # a budget of 5.5 s: fits of 1 s, the refit 1.25 s; the first save's 1 s, and 1 s left for the last save,
    # leave room for one fit after the first (the search ends at 4.25 s, the job's last save at 5.25 s)
    search = HeldOutSearch(_Timed(), grid, scoring="p@1", time_budget=5.5, on_first_model=save).fit(X, Y)
    assert handed == [0] and search.reserve_ == 1.0
    assert [r["params"]["value"] for r in search.results_] == [0, 1]
    assert search.seconds_ + search.reserve_ <= 5.5
    without = HeldOutSearch(_Timed(), grid, scoring="p@1", time_budget=5.5).fit(X, Y)
    assert [r["params"]["value"] for r in without.results_] == [0, 1, 2, 3] and without.reserve_ == 0.0
    # no budget: nothing is handed on
    HeldOutSearch(_Timed(), grid, scoring="p@1", on_first_model=save).fit(X, Y)
    assert handed == [0]
