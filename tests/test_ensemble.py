"""EnsembleClassifier: the mean of the members' probabilities against a NumPy reference, seeds, reuse, storage."""

from __future__ import annotations

import threading

import dask
import dask.array as da
import numpy as np
import pytest
import scipy.sparse as sp
from scipy.special import expit, softmax

from xmldask.datasets import make_synthetic
from xmldask.models import (
    LEML,
    BinaryRelevance,
    EmbeddingClassifier,
    EnsembleClassifier,
    LabelCentroidClassifier,
    NotFittedError,
    _graph,
    load_model,
)
from xmldask.models._kernels import mean_of_lists
from xmldask.models.ensemble import member_seed
from xmldask.store import StoreError


@pytest.fixture(autouse=True)
def _threads():
    with dask.config.set(scheduler="threads"):
        yield


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    root = tmp_path_factory.mktemp("ensemble")
    out = {}
    for name, multiclass, seed in (("multiclass", True, 1), ("multilabel", False, 2)):
        ds = make_synthetic(str(root / f"{name}.zarr"), n_samples=1500, n_features=200, n_labels=25,
                            multiclass=multiclass, rank=6, seed=seed, block_rows=400)
        out[name] = (sp.csr_matrix(ds.X.compute()), sp.csr_matrix(ds.Y.compute()))
    return out


def _template(**kw):
    return EmbeddingClassifier(**{"embedding": "rembrandt", "n_components": 6, "kernel": "gaussian",
                                  "n_random_features": 64, "max_epochs": 2, "batch_size": 256, **kw})


def _reference(members, X, task):
    """The mean probabilities, from each member's dense logits, in float64."""
    P = 0
    for member in members:
        S = np.asarray(member.decision_function(X).compute(), dtype=np.float64)
        P = P + (softmax(S, axis=1) if task == "multiclass" else expit(S))
    return P / len(members)


@pytest.mark.parametrize("task", ["multiclass", "multilabel"])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_mean_probabilities_and_topk_match_a_numpy_reference(data, task, dtype):
    X, Y = data[task]
    features = "tfidf" if task == "multiclass" else "l2"  # each member transforms the raw rows itself
    clf = EnsembleClassifier(_template(features=features, dtype=dtype), n_estimators=3, random_state=5).fit(X, Y)
    assert clf.task_ == task and len(clf.estimators_) == 3
    Xd = da.from_array(X, chunks=(333, -1), asarray=False, fancy=False)  # uneven blocks
    ref = _reference(clf.estimators_, Xd, task)
    tol = 1e-5 if dtype == np.float32 else 1e-12
    P = clf.decision_function(Xd).compute()
    assert P.dtype == dtype
    np.testing.assert_allclose(P, ref, atol=tol)
    if task == "multiclass":
        np.testing.assert_allclose(P.sum(axis=1), 1.0, atol=10 * tol)
    labels, scores = dask.compute(*clf.predict_topk(Xd, k=4))
    order = np.argsort(-ref, axis=1, kind="stable")[:, :4]
    # the labels are the reference's, except where two probabilities tie to rounding
    gap = np.take_along_axis(ref, order[:, :-1], 1) - np.take_along_axis(ref, order[:, 1:], 1)
    clear = (gap > 10 * tol).all(axis=1)
    assert clear.mean() > 0.95
    np.testing.assert_array_equal(labels[clear], order[clear])
    np.testing.assert_allclose(scores, np.take_along_axis(ref, labels, 1), atol=tol)
    # a score budget smaller than one block's probabilities gives the same answer
    small = _graph.ensemble_topk(Xd, clf._states(), clf.task_, 4, budget=25 * 7)
    small_labels, small_scores = dask.compute(*small)
    np.testing.assert_array_equal(small_labels, labels)
    np.testing.assert_allclose(small_scores, scores, atol=tol)


def test_members_differ_only_in_their_seeds_and_member_0_is_the_single_model(data):
    X, Y = data["multilabel"]
    clf = EnsembleClassifier(_template(kernel="none"), n_estimators=3, random_state=11).fit(X, Y)
    seeds = [m.random_state for m in clf.estimators_]
    assert seeds[0] == 11 and len(set(seeds)) == 3 and seeds == [member_seed(11, i) for i in range(3)]
    single = _template(kernel="none", random_state=11).fit(X, Y)
    np.testing.assert_array_equal(clf.estimators_[0].Q_, single.Q_)
    # different seeds hold out different rows, so the members' W differ
    assert not np.allclose(clf.estimators_[0].W_, clf.estimators_[1].W_)
    assert set(clf.held_out_) == {"val_p@1", "val_loss"}
    assert clf.held_out_["val_p@1"] == pytest.approx(np.mean([max(m.history_, key=lambda h: -h["val_loss"])["val_p@1"]
                                                               for m in clf.estimators_]))
    # an ensemble of one is the single model
    one = EnsembleClassifier(_template(kernel="none"), n_estimators=1, random_state=11).fit(X, Y)
    np.testing.assert_allclose(one.decision_function(X).compute(), expit(single.decision_function(X).compute()),
                               atol=1e-6)


@pytest.mark.parametrize("scheduler", ["threads", "distributed"])
def test_members_fitted_at_once_are_the_members_fitted_one_at_a_time(data, scheduler, monkeypatch):
    from threadpoolctl import threadpool_limits

    from xmldask.scheduling import blas_share

    X, Y = data["multiclass"]
    threads = set()
    fit = EmbeddingClassifier.fit

    def recording_fit(self, *args, **kwargs):
        threads.add(threading.current_thread().name)
        return fit(self, *args, **kwargs)

    def both():
        # every member with the BLAS threads of a member in thread_map's pool (a product's last digits depend on them)
        with threadpool_limits(limits=blas_share(2), user_api="blas"):
            one = EnsembleClassifier(_template(), n_estimators=3, random_state=5).fit(X, Y)
            monkeypatch.setattr(EmbeddingClassifier, "fit", recording_fit)
            try:
                return one, EnsembleClassifier(_template(), n_estimators=3, random_state=5, n_jobs=2).fit(X, Y)
            finally:
                monkeypatch.setattr(EmbeddingClassifier, "fit", fit)

    if scheduler == "distributed":
        from distributed import Client

        with Client(processes=False, n_workers=1, threads_per_worker=2, dashboard_address=":0"):
            one, many = both()
    else:
        one, many = both()
    # member 0 alone (the others share its embedding), then members 1 and 2 in two threads of their own
    assert len([name for name in threads if name.startswith("xmldask-fit")]) == 2, threads
    for a, b in zip(one.estimators_, many.estimators_):
        assert a.random_state == b.random_state
        for name in ("W_", "Q_", "R_"):
            np.testing.assert_array_equal(getattr(a, name), getattr(b, name), err_msg=name)
        assert [{**h, "seconds": 0} for h in a.history_] == [{**h, "seconds": 0} for h in b.history_]
    np.testing.assert_array_equal(one.decision_function(X).compute(), many.decision_function(X).compute())


def test_fitted_members_are_reused_and_checked(data):
    X, Y = data["multiclass"]
    template = _template(kernel="none")
    first = _template(kernel="none", random_state=3).fit(X, Y)
    clf = EnsembleClassifier(template, n_estimators=2, random_state=3).fit(X, Y, fitted=[first])
    assert clf.estimators_[0] is first and clf.estimators_[1].random_state == member_seed(3, 1)
    with pytest.raises(ValueError, match=r"fitted member 0 .* \(differs in random_state\)"):
        EnsembleClassifier(template, n_estimators=2, random_state=4).fit(X, Y, fitted=[first])
    with pytest.raises(ValueError, match=r"\(differs in alpha\)"):
        EnsembleClassifier(_template(kernel="none", alpha=5.0), n_estimators=2, random_state=3).fit(
            X, Y, fitted=[first])
    with pytest.raises(ValueError, match="3 fitted members given for an ensemble of 2"):
        EnsembleClassifier(template, n_estimators=2, random_state=3).fit(X, Y, fitted=[first] * 3)


def test_save_load_and_load_model(data, tmp_path):
    X, Y = data["multiclass"]
    clf = EnsembleClassifier(_template(features="tfidf"), n_estimators=2, random_state=0).fit(X, Y)
    url = str(tmp_path / "ensemble.zarr")
    clf.save(url, meta={"train_url": "somewhere"})
    with pytest.raises(FileExistsError):
        clf.save(url)
    back = load_model(url)
    assert isinstance(back, EnsembleClassifier) and len(back.estimators_) == 2
    assert back.held_out_ == pytest.approx(clf.held_out_)
    np.testing.assert_array_equal(back.estimators_[1].idf_, clf.estimators_[1].idf_)
    a, b = clf.predict_topk(X, k=3), back.predict_topk(X, k=3)
    np.testing.assert_array_equal(a[0].compute(), b[0].compute())
    np.testing.assert_allclose(a[1].compute(), b[1].compute())
    with pytest.raises(StoreError, match=r"holds a EnsembleClassifier model.*load_model"):
        EmbeddingClassifier.load(url)
    single = str(tmp_path / "single.zarr")
    clf.estimators_[0].save(single)
    assert isinstance(load_model(single), EmbeddingClassifier)
    with pytest.raises(StoreError, match="no model store"):
        load_model(str(tmp_path / "missing.zarr"))


def test_refusals(data):
    X, Y = data["multiclass"]
    with pytest.raises(ValueError, match="n_estimators must be an integer of at least 1"):
        EnsembleClassifier(_template(), n_estimators=0).fit(X, Y)
    with pytest.raises(TypeError, match="estimator must be a model of an xmldask family"):
        EnsembleClassifier("rembrandt").fit(X, Y)
    with pytest.raises(TypeError, match="BinaryRelevance takes no random_state"):
        EnsembleClassifier(BinaryRelevance(), n_estimators=2).fit(X, Y)
    with pytest.raises(ValueError, match="early_stopping .* only an EmbeddingClassifier keeps"):
        EnsembleClassifier(LEML(n_components=4), n_estimators=2, early_stopping=True).fit(X, Y)
    with pytest.raises(ValueError, match="n_jobs must be a positive integer"):
        EnsembleClassifier(_template(), n_jobs=0).fit(X, Y)
    with pytest.raises(NotFittedError):
        EnsembleClassifier(_template()).predict_topk(X)
    clf = EnsembleClassifier(_template(kernel="none"), n_estimators=1, random_state=0).fit(X, Y)
    with pytest.raises(ValueError, match="k must be an integer between 1 and n_labels = 25"):
        clf.predict_topk(X, k=26)
    with pytest.raises(ValueError, match="X has 3 features"):
        clf.predict_topk(np.zeros((2, 3), np.float32))


def test_members_with_different_input_transforms(data):
    """Members that share a transform reuse it per block; members with their own get theirs."""
    X, Y = data["multiclass"]
    tfidf = EnsembleClassifier(_template(features="tfidf"), n_estimators=2, random_state=1).fit(X, Y)
    raw = _template(features="raw", random_state=2).fit(X, Y)
    members = tfidf.estimators_ + [raw]
    states = [{**m._state(), "features": m.features, "idf": m.idf_} for m in members]
    assert _graph._member_operands(states)[1]["same_input"] == (0, 0, 2)
    ref = _reference(members, X, "multiclass")
    Xd = da.from_array(X, chunks=(500, -1), asarray=False, fancy=False)
    np.testing.assert_allclose(_graph.ensemble_probabilities(Xd, states, "multiclass").compute(), ref, atol=1e-5)


def test_members_share_the_first_members_label_embedding(data, tmp_path):
    """share_embedding (default): the members after the first embed with member 0's fitted Rembrandt (fitted on all
    rows, the same data), so the embedding's passes are made once; without it each member embeds again."""
    X, Y = data["multilabel"]
    shared = EnsembleClassifier(_template(kernel="none"), n_estimators=3, random_state=4).fit(X, Y)
    own = EnsembleClassifier(_template(kernel="none"), n_estimators=3, random_state=4,
                             share_embedding=False).fit(X, Y)
    first = shared.estimators_[0]
    assert all(np.array_equal(m.R_, first.R_) for m in shared.estimators_[1:])
    assert not np.array_equal(own.estimators_[1].R_, first.R_)  # another seed, another sketch
    np.testing.assert_array_equal(own.estimators_[0].Q_, first.Q_)  # member 0 is the same fit either way
    assert sum(m.n_passes_ for m in shared.estimators_) < sum(m.n_passes_ for m in own.estimators_)
    # still an ensemble of different members, saved and loaded as one
    assert not np.array_equal(shared.estimators_[1].Q_, first.Q_)
    url = shared.save(str(tmp_path / "shared.zarr"))
    a, b = dask.compute(shared.predict_topk(X, k=3), load_model(url).predict_topk(X, k=3))
    np.testing.assert_array_equal(a[0], b[0])


def _held_out_p1(members, X, Y):
    """P@1 of the members' mean on the first member's held-out rows, from the NumPy reference."""
    Xh, Yh = members[0].held_out_rows(X, Y)
    Xh, truth = Xh.compute(), sp.csr_matrix(Yh.compute())
    top = _reference(members, sp.csr_matrix(Xh), members[0].task_).argmax(axis=1)
    return float((np.asarray(truth[np.arange(len(top)), top]).ravel() > 0).mean())


def test_early_stopping_keeps_members_that_pay_scored_on_rows_none_fitted(data, tmp_path):
    # three random features a member: members with other draws predict differently, and their mean better
    X, Y = data["multilabel"]
    clf = EnsembleClassifier(_template(n_random_features=3, max_epochs=0, validation_fraction=0.3), n_estimators=4,
                             random_state=0, early_stopping=True).fit(X, Y)
    first = clf.estimators_[0]
    assert all(m.validation_seed_ == first.validation_seed_ for m in clf.estimators_)
    gains = clf.member_gains_
    assert gains and gains[0]["kept"] and len(clf.estimators_) >= 2
    assert [g["members"] for g in gains] == list(range(2, len(gains) + 2))
    assert all(g["kept"] for g in gains[:-1]) and (gains[-1]["kept"] or len(clf.estimators_) == len(gains))
    assert len(clf.estimators_) == 1 + sum(g["kept"] for g in gains) <= 4
    for g in gains:
        assert g["kept"] == (g["wins"] - g["losses"] > 2 * np.sqrt(g["wins"] + g["losses"]))
    # the recorded P@1 is the mean's on the first member's held-out rows, which no member fitted
    assert gains[0]["val_p@1"] == pytest.approx(_held_out_p1(clf.estimators_[:2], X, Y), abs=1e-9)
    assert clf.held_out_["ensemble_val_p@1"] == pytest.approx(_held_out_p1(clf.estimators_, X, Y), abs=1e-9)
    url = clf.save(str(tmp_path / "ens.zarr"))
    back = load_model(url)
    assert back.member_gains_ == gains and back.held_out_ == pytest.approx(clf.held_out_)


def test_early_stopping_adds_no_member_that_predicts_alike(data, monkeypatch):
    """On the linear map a member holding out the first member's rows with its embedding differs at most in its SGD
    order: members predict alike (measured here with the rule off: few held-out rows change), so none is fitted."""
    from xmldask.models import ensemble as E

    X, Y = data["multilabel"]
    fits = []
    real_fit = EmbeddingClassifier.fit
    monkeypatch.setattr(EmbeddingClassifier, "fit", lambda self, *a, **kw: fits.append(1) or real_fit(self, *a, **kw))
    for epochs in (2, 0):
        fits.clear()
        clf = EnsembleClassifier(_template(kernel="none", max_epochs=epochs), n_estimators=3, random_state=0,
                                 early_stopping=True).fit(X, Y)
        assert len(fits) == 1 and len(clf.estimators_) == 1 and clf.member_gains_ == []
    # the rule's ground: with it off, the SGD order alone changes few held-out rows and no gain is resolved
    monkeypatch.setattr(E, "kernel_name", lambda kernel: "off")
    clf = EnsembleClassifier(_template(kernel="none", max_epochs=2), n_estimators=3, random_state=0,
                             early_stopping=True).fit(X, Y)
    assert len(clf.estimators_) == 1 and len(clf.member_gains_) == 1 and not clf.member_gains_[0]["kept"]
    assert clf.member_gains_[0]["wins"] + clf.member_gains_[0]["losses"] < 0.05 * X.shape[0]
    with pytest.raises(ValueError, match="validation_fraction > 0"):
        EnsembleClassifier(_template(validation_fraction=0.0), early_stopping=True).fit(X, Y)


def _listed_reference(dense: list[np.ndarray], width: int, k: int):
    """:func:`mean_of_lists` in plain NumPy: each member lists its ``width`` best labels (stable order); a row's
    candidates are their union, a label a member did not list scored by its lowest listed score."""
    n, L = dense[0].shape
    labels, scores = [], []
    for i in range(n):
        lists = [np.argsort(-S[i], kind="stable")[:width] for S in dense]
        union = sorted(set(np.concatenate(lists).tolist()))
        mean = np.zeros(len(union))
        for S, listed in zip(dense, lists):
            floor = S[i, listed].min()
            mean += [S[i, j] if j in set(listed.tolist()) else floor for j in union]
        mean /= len(dense)
        best = np.argsort(-mean, kind="stable")[:k]
        labels.append(np.asarray(union)[best])
        scores.append(mean[best])
    return np.array(labels), np.array(scores)


@pytest.mark.parametrize("width", [3, 7, 12])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_mean_of_lists_matches_a_numpy_reference(width, dtype):
    """The mean over the union of the members' lists; with every label listed, the exact mean of the scores."""
    rng = np.random.default_rng(width)
    dense = [rng.normal(size=(40, 12)).astype(dtype) for _ in range(3)]
    dense[1][:5] = dense[0][:5]  # members that list the same labels
    dense[2][5:8] = np.round(dense[2][5:8])  # ties within a member
    k = min(3, width)
    lists = [np.argsort(-S, axis=1, kind="stable")[:, :width] for S in dense]
    labels, scores = mean_of_lists(lists, [np.take_along_axis(S, a, 1) for S, a in zip(dense, lists)], k)
    ref_labels, ref_scores = _listed_reference(dense, width, k)
    np.testing.assert_allclose(scores, ref_scores, rtol=1e-6 if dtype == np.float32 else 1e-12)
    clear = np.abs(np.diff(ref_scores, axis=1)).min(axis=1) > 1e-5  # the labels, where no two means tie to rounding
    np.testing.assert_array_equal(labels[clear], ref_labels[clear])
    if width == 12:
        mean = np.mean([S.astype(np.float64) for S in dense], axis=0)
        np.testing.assert_allclose(scores, -np.sort(-mean, axis=1)[:, :k], rtol=1e-6)


@pytest.mark.parametrize("family", ["centroid", "leml"])
def test_an_ensemble_of_another_family_averages_its_members_lists(data, family, tmp_path):
    """Members of any family with their own seeds; the mean of their lists, per uneven row block; saved with the
    members' class and read back by load_model (the centroids' arrays read from the members' groups)."""
    X, Y = data["multilabel"]
    template = LabelCentroidClassifier(leaf_labels=4) if family == "centroid" else LEML(n_components=5, n_iter=3)
    clf = EnsembleClassifier(template, n_estimators=3, random_state=4).fit(X, Y)
    assert [m.random_state for m in clf.estimators_] == [member_seed(4, i) for i in range(3)]
    assert type(clf.estimators_[0]) is type(template) and clf.n_labels_ == 25
    Xd = da.from_array(X, chunks=(333, -1), asarray=False, fancy=False)  # uneven blocks
    labels, scores = dask.compute(*clf.predict_topk(Xd, k=4))
    lists = [dask.compute(*m.predict_topk(Xd, k=8)) for m in clf.estimators_]
    ref_labels, ref_scores = mean_of_lists([a for a, _ in lists], [s for _, s in lists], 4)
    np.testing.assert_array_equal(labels, ref_labels)
    np.testing.assert_allclose(scores, ref_scores, rtol=1e-6)
    assert labels.dtype == np.int32 and scores.dtype == np.float32
    if family == "leml":  # its members score every label: the mean of their dense scores, where all are listed
        dense = np.mean([m.decision_function(Xd).compute() for m in clf.estimators_], axis=0)
        np.testing.assert_allclose(clf.decision_function(Xd).compute(), dense, rtol=1e-5, atol=1e-6)
        everything = _graph.mean_topk(Xd, [m.predict_topk(Xd, k=25) for m in clf.estimators_], 4)[1].compute()
        np.testing.assert_allclose(everything, -np.sort(-dense, axis=1)[:, :4], rtol=1e-5, atol=1e-6)
    else:  # seeds draw other label trees
        assert clf.estimators_[0].n_clusters_ > 1
        assert not np.array_equal(lists[0][0], lists[1][0])
    url = str(tmp_path / "ensemble.zarr")
    clf.save(url)
    back = load_model(url)
    assert isinstance(back, EnsembleClassifier) and type(back.estimators_[0]) is type(template)
    again = dask.compute(*back.predict_topk(Xd, k=4))
    np.testing.assert_array_equal(again[0], labels)
    np.testing.assert_allclose(again[1], scores, rtol=1e-6)
    assert back.train_summary()["n_estimators"] == 3


def test_members_begun_beside_the_first_fit_are_the_members_fit_makes(data, monkeypatch):
    """``begin`` at the first member's warm start fits the members early stopping tries first, in a thread of their
    own, beside the first one's epochs: ``fit(fitted=[first])`` takes them, with the same choices and members."""
    X, Y = data["multilabel"]
    template = _template(n_random_features=3, max_epochs=2, validation_fraction=0.3)
    plain = EnsembleClassifier(template, n_estimators=3, random_state=0, early_stopping=True).fit(X, Y)
    threads = []
    real_fit = EmbeddingClassifier.fit

    def recording_fit(self, *a, **kw):
        threads.append((self.random_state, threading.current_thread().name))
        return real_fit(self, *a, **kw)

    monkeypatch.setattr(EmbeddingClassifier, "fit", recording_fit)
    ensemble = EnsembleClassifier(template, n_estimators=3, random_state=0, early_stopping=True)
    first = EmbeddingClassifier(**{**template.get_params(deep=False), "random_state": 0})
    begun = []
    first.fit(X, Y, callback=lambda history: len(history) > 1 or begun.append(ensemble.begin(first, X, Y)) or True)
    assert begun == [True]
    ensemble.fit(X, Y, fitted=[first])
    assert ensemble.member_gains_ == plain.member_gains_
    assert len(ensemble.estimators_) == len(plain.estimators_)
    for mine, theirs in zip(ensemble.estimators_, plain.estimators_):
        assert mine.random_state == theirs.random_state
        np.testing.assert_allclose(mine.Q_, theirs.Q_, rtol=1e-4, atol=1e-5)
    # the second member was fitted in the thread begin started; members after it as fit fits them
    assert (member_seed(0, 1), "xmldask-members") in threads
    assert all(name != "xmldask-members" for seed, name in threads if seed != member_seed(0, 1))


def test_members_begun_beside_a_model_not_kept_are_stopped_and_not_taken(data, monkeypatch):
    X, Y = data["multilabel"]
    template = _template(n_random_features=3, max_epochs=2, validation_fraction=0.3)
    first = EmbeddingClassifier(**{**template.get_params(deep=False), "random_state": 0}).fit(X, Y)
    # on the linear map the members would be the first one again: none is started
    linear = EmbeddingClassifier(**{**template.get_params(deep=False), "kernel": "none", "random_state": 0}).fit(X, Y)
    assert not EnsembleClassifier(linear, n_estimators=3, random_state=0, early_stopping=True).begin(linear, X, Y)
    assert not EnsembleClassifier(template, n_estimators=3, random_state=0).begin(first, X, Y)  # no early stopping
    assert not EnsembleClassifier(template, n_estimators=1, random_state=0, early_stopping=True).begin(first, X, Y)
    # stopped before its epochs: the member ends at its warm start
    gate = threading.Event()
    real_fit = EmbeddingClassifier.fit
    monkeypatch.setattr(EmbeddingClassifier, "fit",
                        lambda self, *a, **kw: (threading.current_thread().name != "xmldask-members" or gate.wait())
                        and real_fit(self, *a, **kw))
    ensemble = EnsembleClassifier(template, n_estimators=3, random_state=0, early_stopping=True)
    assert ensemble.begin(first, X, Y)
    begun = ensemble._begun
    begun._stop.set()
    gate.set()
    (member,) = begun.result()
    assert len(member.history_) == 1 and member.history_[-1]["stopped"] == "callback"
    ensemble.abandon()
    assert ensemble._begun is None
    # begun beside another model: fit stops them and fits its own members
    other = EnsembleClassifier(template, n_estimators=2, random_state=0, early_stopping=True)
    assert other.begin(first, X, Y)
    again = EmbeddingClassifier(**{**template.get_params(deep=False), "random_state": 0}).fit(X, Y)
    other.fit(X, Y, fitted=[again])
    assert other._begun is None and len(other.member_gains_) == 1
    assert all(m.validation_seed_ == again.validation_seed_ for m in other.estimators_)
