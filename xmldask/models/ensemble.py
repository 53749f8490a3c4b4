"""Bagged ensembles: the mean of the members' predictions, for any model family.

:class:`EnsembleClassifier` fits ``n_estimators`` copies of an estimator that differ only in their seed
(``random_state``). For an :class:`EmbeddingClassifier` a member's seed draws the rows it holds out for early
stopping (so each member fits ``W`` and its decoder on a different random 90% of the training rows), its random
features and its SGD order, and the ensemble predicts the mean of the members' probabilities (softmax rows for
multiclass problems, per-label sigmoids for multilabel ones), streamed over row blocks like a single model
(:func:`xmldask.models._graph.ensemble_topk`). For the other families a member's seed draws what their fits
draw (the centroids' 2-means label tree, LEML's start, the tree classifier's held-out rows), and the ensemble
predicts the mean of the scores its members list for a row (:func:`xmldask.models._graph.mean_topk`), as
Parabel and Omikuji average their trees. Ensembles are the rule among XMC methods: Parabel, Bonsai and
Omikuji grow 3 trees by default, and FastXML and SLEEC are ensembles too.

Measured (``python bench/peers.py``, the same held-out search, then 3 members): see docs/benchmarks.md.
"""

from __future__ import annotations

import logging
import math
import numbers
import threading

import dask
import dask.array as da
import numpy as np
import scipy.sparse as sp

from ..base import (
    NotFittedError,
    ParamsMixin,
    as_rows,
    check_fully_observed,
    kept_epoch,
    qualified_name,
    registered_class,
    seed_of,
)
from ..metrics import paired_gain
from ..params import AUTO_ESTIMATORS, kernel_name
from ..scheduling import thread_map
from ..store.layout import StoreError
from ..store.models import SavedModel, jsonable, store_location
from . import _graph
from .embedding_classifier import EmbeddingClassifier

__all__ = ["ENSEMBLE_VERSION", "EnsembleClassifier"]

logger = logging.getLogger(__name__)

#: version of the saved ensemble layout (2: members of any family, their class recorded; 1: embedding classifiers)
ENSEMBLE_VERSION = 2
#: a member of another family lists this many times ``k`` labels a row (at most all) for the mean over their union
LIST_FACTOR = 2


def member_seed(seed: int, index: int) -> int:
    """The seed of member ``index`` of an ensemble seeded with ``seed``: member 0 has ``seed`` itself."""
    if index == 0:
        return int(seed)
    return int(np.random.SeedSequence([int(seed), int(index)]).generate_state(1, np.uint64)[0] >> 1)


class EnsembleClassifier(SavedModel, ParamsMixin):
    """Mean prediction of ``n_estimators`` models of one family fitted with different seeds.

    Parameters
    ----------
    estimator : estimator of any model family
        The template: every member is ``type(estimator)(**estimator.get_params(deep=False))`` with its own
        ``random_state`` (member 0 gets ``random_state`` itself, so it is the model a single fit with
        that seed gives). An :class:`EmbeddingClassifier` needs ``validation_fraction > 0`` for the members to
        differ in their rows; its members' probabilities are averaged over every label. Members of the other
        families average the scores they list a row (``LIST_FACTOR`` times ``k`` labels each; a label a member
        did not list counts its lowest listed score, :func:`xmldask.models._kernels.mean_of_lists`).
    n_estimators : int, default 3
    random_state : int or None
        Seed of member 0 and, through :func:`member_seed`, of the others.
    share_embedding : bool, default True
        The members after the first embed the labels with the first member's fitted embedding (an
        embedding given by name is fitted on all rows, the same data for every member) instead of
        fitting it again: Rembrandt's passes are made once per ensemble, not once per member.
    n_jobs : int or None
        Members fitted at once, in threads of this process (None: one at a time). The members are the
        same either way.
    early_stopping : bool, default False
        Add the members after the first one at a time (fitted ``n_jobs`` at once), each holding out the first
        member's rows, and keep a member only if the top-1 label of the members' mean on those rows gains on the
        ensemble without it by more than the noise (:func:`xmldask.metrics.paired_gain`); stop at the first that
        does not: ``n_estimators`` is then the most (embedding classifiers only). A member costs a fit; on the
        linear feature map none is fitted: holding out the first member's rows with its embedding, a member has
        its least squares and warm start, and differs at most in the order of its decoder's minibatches on a loss
        convex in the decoder (with the ridge decoder alone, not even that: it would be the first one again);
        such members predict alike (on delicious: 31 held-out rows right and 34 wrong that the first member had
        the other way, of 1,292). Without it, every member holds out its own rows (the ensemble fits on all of
        them).

    Attributes
    ----------
    estimators_ : list
        The fitted members.
    task_ : str
    n_labels_, n_features_in_ : int
    held_out_ : dict
        The members' mean held-out ``val_p@1`` and ``val_loss`` at their kept epochs (each member on
        its own held-out rows: an estimate of a single member, not of the ensemble); with ``early_stopping``,
        also the ensemble's ``ensemble_val_p@1`` on the rows they all held out.
    member_gains_ : list of dict
        With ``early_stopping``: per member tried after the first, ``members`` (the ensemble's size with it),
        ``val_p@1`` (of the mean with it), ``wins``, ``losses`` (held-out rows it makes right / wrong) and
        ``kept``.

    Examples
    --------
    >>> import numpy as np, scipy.sparse as sp
    >>> from xmldask.models import EmbeddingClassifier, EnsembleClassifier
    >>> rng = np.random.default_rng(0)
    >>> X = sp.csr_matrix(rng.normal(size=(600, 8)).astype(np.float32))
    >>> y = X.toarray()[:, :3].argmax(axis=1)
    >>> Y = sp.csr_matrix((np.ones(600, np.float32), (np.arange(600), y)), shape=(600, 3))
    >>> member = EmbeddingClassifier(embedding=np.eye(3), kernel="none", max_epochs=3, batch_size=256)
    >>> clf = EnsembleClassifier(member, n_estimators=3, random_state=0).fit(X, Y)
    >>> labels, scores = clf.predict_topk(X, k=1)
    >>> bool((labels.compute()[:, 0] == y).mean() > 0.8)
    True
    """

    _MODEL_VERSION = ENSEMBLE_VERSION
    _EARLIER_VERSIONS = (1,)

    def __init__(self, estimator=None, *, n_estimators: int = AUTO_ESTIMATORS, random_state=None,
                 share_embedding: bool = True, n_jobs: int | None = None, early_stopping: bool = False):
        self.estimator, self.n_estimators = estimator, n_estimators
        self.random_state, self.share_embedding, self.n_jobs = random_state, share_embedding, n_jobs
        self.early_stopping = early_stopping

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.estimator!r}, n_estimators={self.n_estimators!r})"

    def _members(self) -> list:
        template = self.estimator
        if not (hasattr(template, "get_params") and hasattr(template, "predict_topk") and hasattr(template, "fit")):
            raise TypeError(f"estimator must be a model of an xmldask family (with get_params, fit and predict_topk), "
                            f"but is {type(template).__name__}")
        n = self.n_estimators
        if isinstance(n, bool) or not isinstance(n, numbers.Integral) or n < 1:
            raise ValueError(f"n_estimators must be an integer of at least 1, but is {n!r}")
        jobs = self.n_jobs
        if jobs is not None and (isinstance(jobs, bool) or not isinstance(jobs, numbers.Integral) or jobs < 1):
            raise ValueError(f"n_jobs must be a positive integer or None, but is {jobs!r}")
        seed = seed_of(self.random_state)
        params = template.get_params(deep=False)
        if "random_state" not in params:
            raise TypeError(f"{type(template).__name__} takes no random_state: its members would all be one model")
        if self.early_stopping and not self._embedding():
            raise ValueError("early_stopping judges the members on the first member's held-out rows, which only "
                             f"an EmbeddingClassifier keeps; give n_estimators for a {type(template).__name__}")
        if self.early_stopping and not params.get("validation_fraction"):
            raise ValueError("early_stopping judges the members on held-out rows: the estimator must hold some out "
                             "(validation_fraction > 0)")
        return [type(template)(**{**params, "random_state": member_seed(seed, i)}) for i in range(int(n))]

    def begin(self, first, X, Y, n_members: int = 1) -> bool:
        """Start fitting, in a thread of this process, the first ``n_members`` members after ``first`` that
        ``early_stopping`` would try, while ``first`` makes its decoder epochs: member 0 past its warm start (its
        embedding and held-out rows made), e.g. a held-out search's leading full fit
        (:class:`~xmldask.model_selection.HeldOutSearch`'s ``on_lead``). One fit seldom fills every core; its
        members then take the cores its epochs leave. :meth:`fit` with ``fitted=[first]`` takes them (the same
        members as fitted there, the same choices); :meth:`abandon` stops them at their warm start if ``first`` is
        not the model kept. Whether members were started (not where none would be tried: a single member, no
        ``early_stopping``, members of another family, or members that would be the first one again)."""
        rest = self._members()[1:1 + max(0, int(n_members))]
        if not (self.early_stopping and self._embedding() and rest):
            return False
        self._share_embedding(first, rest)
        if self._alike(first, rest):
            return False
        self._begun = _Begun(first, rest, lambda m, callback: m.fit(X, Y, validation_seed=first.validation_seed_,
                                                                     callback=callback), self.n_jobs)
        logger.info("ensemble: %d member(s) fitted beside the decoder epochs of the first", len(rest))
        return True

    def abandon(self) -> None:
        """Stop the members :meth:`begin` started (at their warm start) and drop them."""
        begun, self._begun = getattr(self, "_begun", None), None
        if begun is not None:
            begun.stop()

    def _share_embedding(self, first, rest: list) -> None:
        for member in rest:
            if (self.share_embedding and self._embedding() and isinstance(member.embedding, str)
                    and getattr(first, "embedding_kind_", None) == "label"):
                member.set_params(embedding=first.R_)  # the same data: embed once per ensemble

    @staticmethod
    def _alike(first, rest: list) -> bool:
        """Whether the members would be the first one again: on the linear map with the first member's rows and
        embedding (but for the order of the decoder's minibatches)."""
        return kernel_name(first.kernel) == "none" and not isinstance(rest[0].embedding, str)

    def _embedding(self) -> bool:
        """Whether the members are embedding classifiers (their probabilities averaged over every label)."""
        return isinstance(self.estimator, EmbeddingClassifier)

    def fit(self, X, Y, *, fitted: list | None = None) -> EnsembleClassifier:
        """Fit the members on ``X``, ``Y`` (row blocks, as for the template's ``fit``).

        Parameters
        ----------
        fitted : list, optional
            Members already fitted on the same data with the template's parameters and the first
            seeds (e.g. the winner of a :class:`~xmldask.model_selection.HeldOutSearch`, which is
            member 0): they are reused, not fitted again.

        Returns
        -------
        EnsembleClassifier
            ``self``, fitted.
        """
        X = as_rows(X, "X")
        return self._fit_members(lambda member: member.fit(X, Y), X, Y, fitted)

    def fit_dataset(self, data, *, fitted: list | None = None) -> EnsembleClassifier:
        """Fit the members on a dataset store opened by :func:`xmldask.store.open_dataset`, as the template's
        ``fit_dataset`` does (LEML's and binary relevance's members read its observed entries)."""
        if self._embedding():
            check_fully_observed(data, "an ensemble of EmbeddingClassifier")
            return self.fit(data.X, data.Y, fitted=fitted)
        return self._fit_members(lambda member: member.fit_dataset(data), data.X, data.Y, fitted)

    def _fit_members(self, fit, X, Y, fitted: list | None) -> EnsembleClassifier:
        members = self._members()
        fitted = list(fitted or [])
        if len(fitted) > len(members):
            raise ValueError(f"{len(fitted)} fitted members given for an ensemble of {len(members)}")
        for i, model in enumerate(fitted):
            want = members[i].get_params(deep=False)
            have = model.get_params(deep=False) if type(model) is type(members[i]) else {}
            differ = [name for name in want if name not in have or not _same(want[name], have[name])]
            if differ or not _is_fitted(model):
                raise ValueError(f"fitted member {i} is not the template fitted with seed {want['random_state']} "
                                 f"(differs in {', '.join(differ) or 'being unfitted'})")
        self.estimators_ = list(fitted)
        self.member_gains_ = self._ensemble_p1 = None
        rest = members[len(fitted):]
        if not self.estimators_ and rest:  # the first member alone: the others may share its embedding
            self.estimators_.append(fit(rest.pop(0)))
        first = self.estimators_[0]
        self._share_embedding(first, rest)
        begun, self._begun = getattr(self, "_begun", None), None
        if begun is not None and (begun.first is not first or not self.early_stopping):
            begun.stop()  # started beside another model's epochs
            begun = None
        if self.early_stopping:
            self._add_while_gaining(X, Y, rest, begun)
        else:
            self.estimators_ += thread_map(fit, rest, self.n_jobs)
        return self._fitted()

    def _add_while_gaining(self, X, Y, rest: list, begun: _Begun | None = None) -> None:
        """Fit ``rest`` one at a time on the first member's held-out rows, keeping each while it pays
        (``early_stopping``; ``begun``: the first of them, started by :meth:`begin`)."""
        first = self.estimators_[0]
        self.member_gains_ = []
        if self._alike(first, rest):
            # nothing drawn but the SGD order: the same rows, embedding, least squares, no random features
            logger.info("ensemble: no member added: on the linear map with the first member's rows and embedding, "
                        "a member would be the first one again%s", " but for the order of its decoder's minibatches"
                        if first.max_epochs else " (the ridge decoder)")
            return
        Xh, Yh = first.held_out_rows(X, Y)
        Xh, truth = dask.persist(Xh)[0], sp.csr_matrix(Yh.compute())
        hits = self._top1_hits(self.estimators_, Xh, truth)
        self._ensemble_p1 = float(hits.mean()) if len(hits) else math.nan
        batch = max(1, int(self.n_jobs or 1))  # fitted at once (one fit seldom fills every core), judged in turn
        fitted = begun.result() if begun is not None else []
        for i, member in enumerate(rest):
            if not fitted:
                fitted = thread_map(lambda m: m.fit(X, Y, validation_seed=first.validation_seed_),
                                    rest[i:i + batch], self.n_jobs)
            member = fitted.pop(0)
            new = self._top1_hits([*self.estimators_, member], Xh, truth)
            gain = paired_gain(new, hits)
            kept = gain["resolved"]
            self.member_gains_.append({"members": len(self.estimators_) + 1, "val_p@1": float(new.mean()),
                                       "wins": gain["wins"], "losses": gain["losses"], "kept": kept})
            logger.info("ensemble member %d: held-out P@1 of the mean %.4f against %.4f (%d rows right, %d wrong "
                        "that were right): %s", len(self.estimators_) + 1, new.mean(), hits.mean(), gain["wins"],
                        gain["losses"], "kept" if kept else "not kept, no more members (the gain is within the "
                        "noise of the held-out rows)")
            if not kept:
                break
            self.estimators_.append(member)
            hits, self._ensemble_p1 = new, float(new.mean())

    def _top1_hits(self, members: list, Xh, truth: sp.csr_matrix) -> np.ndarray:
        labels, _ = _graph.ensemble_topk(Xh, self._states(members), members[0].task_, 1)
        top = labels.compute()[:, 0].astype(np.int64)
        return np.asarray(truth[np.arange(len(top)), top]).ravel() > 0

    def _fitted(self) -> EnsembleClassifier:
        first = self.estimators_[0]
        self.task_, self.n_labels_ = getattr(first, "task_", None), first.n_labels_
        self.n_features_in_ = first.n_features_in_
        kept = []
        for member in self.estimators_:
            history = getattr(member, "history_", None) or []
            if history and history[0].get("val_loss") is not None and not np.isnan(history[0]["val_loss"]):
                kept.append(kept_epoch(member))
        self.held_out_ = ({key: float(np.mean([h[key] for h in kept])) for key in ("val_p@1", "val_loss")}
                          if kept else {})
        if getattr(self, "_ensemble_p1", None) is not None:
            self.held_out_["ensemble_val_p@1"] = self._ensemble_p1
        return self

    # -- prediction -----------------------------------------------------------------------------

    def _check_fitted(self) -> None:
        if not getattr(self, "estimators_", None):
            raise NotFittedError(f"this {type(self).__name__} is not fitted yet; call fit(X, Y) first")

    def _states(self, members: list | None = None) -> list[dict]:
        return [{**member._state(), "features": member.features, "idf": member.idf_}
                for member in (self.estimators_ if members is None else members)]

    def decision_function(self, X) -> da.Array:
        """Dense mean probabilities (embedding classifiers) or mean scores (the members' ``decision_function``) of
        every label, lazily, chunked like ``X`` (``n_samples x n_labels``)."""
        if self._embedding():
            return _graph.ensemble_probabilities(self._rows(X), self._states(), self.task_)
        if not all(hasattr(member, "decision_function") for member in self.estimators_):
            raise TypeError(f"{type(self.estimators_[0]).__name__} scores no dense rows; use predict_topk")
        X = self._rows(X)
        return sum(member.decision_function(X) for member in self.estimators_) / len(self.estimators_)

    def predict_topk(self, X, k: int = 5) -> tuple[da.Array, da.Array]:
        """Top-``k`` labels (int32) and their mean probabilities or scores (float32), best first, computed per row
        block: two lazy ``(n_samples, k)`` arrays, as :meth:`EmbeddingClassifier.predict_topk` gives."""
        X, k = self._rows(X), self._checked_k(k)
        if self._embedding():
            return _graph.ensemble_topk(X, self._states(), self.task_, k)
        listed = min(self.n_labels_, LIST_FACTOR * k)
        return _graph.mean_topk(X, [member.predict_topk(X, k=listed) for member in self.estimators_], k)

    def train_summary(self) -> dict:
        """The first member's summary, with the members' passes summed and their number."""
        summary = dict(self.estimators_[0].train_summary())
        summary["n_passes"] = int(sum(getattr(m, "n_passes_", 0) for m in self.estimators_))
        return {**summary, "n_estimators": len(self.estimators_)}

    # -- persistence ----------------------------------------------------------------------------

    def _parts(self) -> tuple[dict, dict, dict]:
        """What :meth:`save` writes: a model store whose ``fitted`` attribute lists every member's parameters
        and fitted scalars, with member ``i``'s arrays under ``members/i/`` (as the member's class saves them)
        and the members' class in the parameters (``estimator_class``)."""
        self._check_fitted()
        members, arrays = [], {}
        for i, member in enumerate(self.estimators_):
            params, fitted, member_arrays = member._parts()
            members.append({"params": params, "fitted": fitted})
            arrays.update({f"members/{i}/{name}": value for name, value in member_arrays.items()})
        params = {"n_estimators": len(self.estimators_), "random_state": jsonable(self.random_state),
                  "estimator": members[0]["params"], "estimator_class": qualified_name(type(self.estimators_[0]))}
        gains = {"member_gains": self.member_gains_} if getattr(self, "member_gains_", None) is not None else {}
        return params, {"members": members, "held_out": self.held_out_, **gains}, arrays

    @classmethod
    def _from_group(cls, group, meta: dict) -> EnsembleClassifier:
        attrs = dict(group.attrs)
        name = attrs["params"].get("estimator_class", qualified_name(EmbeddingClassifier))  # version 1: embedding
        member_class = registered_class(name)
        if member_class is None or not hasattr(member_class, "_from_parts"):
            raise StoreError(f"{store_location(group)}: an ensemble of {name} models, which this xmldask cannot read")
        members = [member_class._from_parts(m["params"], m["fitted"], group[f"members/{i}"])
                   for i, m in enumerate(attrs["fitted"]["members"])]
        model = cls(members[0], n_estimators=len(members), random_state=attrs["params"].get("random_state"))
        model.estimators_ = members
        model.member_gains_ = attrs["fitted"].get("member_gains")
        model._ensemble_p1 = attrs["fitted"].get("held_out", {}).get("ensemble_val_p@1")
        return model._fitted()

    def _checked_finite(self, url: str):
        for i, member in enumerate(self.estimators_):
            member._checked_finite(f"{url}/members/{i}")
        return self

    def _located(self, url: str, inventory) -> None:
        for i, member in enumerate(self.estimators_):
            member._located(f"{url.rstrip('/')}/members/{i}", inventory)


class _Begun:
    """Members fitted in a thread of their own (:meth:`EnsembleClassifier.begin`): ``fit(member, callback)`` for each
    of ``members``, in up to ``n_jobs`` threads; :meth:`stop` ends their fits at their warm start."""

    def __init__(self, first, members: list, fit, n_jobs: int | None):
        self.first, self._members, self._stop = first, members, threading.Event()
        self._fitted, self._error = None, None

        def run():
            try:
                self._fitted = thread_map(lambda m: fit(m, lambda history: not self._stop.is_set()), members, n_jobs)
            except BaseException as error:  # raised where the members are taken
                self._error = error

        self._thread = threading.Thread(target=run, name="xmldask-members", daemon=True)
        self._thread.start()

    def result(self) -> list:
        """The fitted members (their fits awaited); a fit's error is raised here."""
        self._thread.join()
        if self._error is not None:
            raise self._error
        return list(self._fitted)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


def _is_fitted(model) -> bool:
    try:
        model._check_fitted()
    except NotFittedError:
        return False
    return True


def _same(a, b) -> bool:
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        return isinstance(a, np.ndarray) and isinstance(b, np.ndarray) and a.shape == b.shape and bool(np.all(a == b))
    try:
        return bool(a == b)
    except (TypeError, ValueError):
        return a is b
