"""Train, predict and evaluate from store URLs: the functions the command line and the flows call.

Each job takes store URLs and small parameters, reads and writes Zarr stores, and returns a small
JSON-serialisable dict describing what it did; arrays never leave the library.

Examples
--------
>>> import os, tempfile
>>> from xmldask import jobs
>>> from xmldask.datasets import make_synthetic
>>> root = tempfile.mkdtemp()
>>> opts = {"n_features": 300, "n_labels": 30, "seed": 0}
>>> train = make_synthetic(os.path.join(root, "train.zarr"), n_samples=3000, **opts).url
>>> test = make_synthetic(os.path.join(root, "test.zarr"), n_samples=500, split="test", **opts).url
>>> info = jobs.train(train, os.path.join(root, "model.zarr"), n_components=16, search=None, max_epochs=3)
>>> info["task"], info["params"]["n_components"]
('multilabel', 16)
>>> jobs.predict(info["model"], test, os.path.join(root, "pred.zarr"), top_k=5)["n_samples"]
500
>>> metrics = jobs.evaluate(os.path.join(root, "pred.zarr"), test)
>>> metrics["P@1"] > 2 * metrics["baseline"]["P@1"]   # far above always predicting the most frequent labels
True
"""

from __future__ import annotations

import dataclasses
import logging
import math
import time

import dask
import dask.array as da
import numpy as np

from .base import FAMILIES, BudgetError, ParamsMixin, check_fully_observed, registered_class
from .models.families import SCHEMAS, TrainParams
from .params import (
    AUTO_ESTIMATORS,
    MAX_SCREEN_FRACTION,
    MAX_SCREEN_REPEATS,
    SCREEN,
    SCREEN_ROWS,
    TOP_K,
    FamilyParams,
    TreeParams,
    current_names,
    kernel_name,
    validated,
)
from .scheduling import concurrent_fits, memory_for_data, release_worker_memory
from .store import check_target, exists, open_dataset, open_predictions, write_predictions, zarr_store

logger = logging.getLogger(__name__)

__all__ = ["evaluate", "predict", "train", "tree", "tree_info"]


def train(train_url: str, out: str, *, overwrite: bool = False, **params) -> dict:
    """Fit the model family that ``model`` names on a dataset store and save it: one path for every family (the
    embedding classifier adds its screened search and its ensemble).

    Parameters
    ----------
    train_url : str
        Dataset store to train on.
    out : str
        Where to save the model (refused if it exists, unless ``overwrite``).
    overwrite : bool
        Replace an existing model store.
    **params
        :class:`~xmldask.models.TrainParams` (``model`` and its family's fields: for the embedding classifier
        ``embedding``, ``n_components``, ``kernel``, ``features``, ``alpha``,
        ``n_random_features``, ``max_epochs``, ``random_state``, ``n_estimators``, ``search``,
        ``search_strategy``, ``search_extensions``, ``search_screen``; their defaults are the command line's and the
        flows'), and further :class:`~xmldask.models.EmbeddingClassifier` parameters (e.g.
        ``bandwidth_scale``). ``search`` lists values to choose among on the held-out slice of the
        training rows (:class:`~xmldask.model_selection.HeldOutSearch`), e.g. ``{"n_components": [50, 150],
        "alpha": [1e-3, 1]}``. ``n_components`` (and the search's) larger than the data allows
        is lowered to the number of labels (of features, for ``embedding="pca"``) before any pass,
        with a warning. ``n_estimators > 1`` saves an :class:`~xmldask.models.EnsembleClassifier`
        whose member 0 is the single (searched) model.

    Returns
    -------
    dict
        ``model`` (URL), ``train`` (URL), ``seconds``, ``n_passes``, ``task``, the parameters and
        the last held-out figures; with ``search``, also ``search`` (every candidate's held-out
        score) and ``params`` holds the chosen values; with the default ensemble (``n_estimators="auto"`` after a
        search), ``ensemble``: the members tried after the first and whether each paid
        (:attr:`~xmldask.models.EnsembleClassifier.member_gains_`), and ``params["n_estimators"]`` the members kept.
    """
    from .models import EmbeddingClassifier

    called = time.perf_counter()  # a time budget is the whole job's, its checks and its save included
    params = current_names(params)  # a former name (k, seed, ...) read as today's
    extra = {name: params.pop(name) for name in list(params) if name not in TrainParams.model_fields}
    p = validated(TrainParams, params)
    _check_trainable(train_url)
    if p.model == "auto" and choose_model(train_url, params, extra, time_budget=p.time_budget) == "centroid":
        p = validated(TrainParams, {**_given(params), "model": "centroid"})
    if p.model not in ("embedding", "auto"):
        return _train_family(train_url, out, p, overwrite=overwrite, given=_given(params), called=called, **extra)
    unknown = sorted(set(extra) - set(EmbeddingClassifier._get_param_names()) | set(extra) & _SET_BY_THE_JOB)
    if unknown:
        known = [*SCHEMAS["embedding"].own_fields(), *FamilyParams.model_fields, "model", *_estimator_only()]
        raise ValueError(f"unknown training parameter(s) {', '.join(unknown)}; known: {', '.join(known)}")
    _check_model_target(out, overwrite, [train_url], tree=False)
    data = open_dataset(train_url)
    check_fully_observed(data, "the embedding classifier")
    check_search(params)
    k, search = _fit_to_data(p, data, set(_given(params)))
    asked = members_asked(p)
    start = time.perf_counter()
    with _EarlySave(out, overwrite, {"train_url": train_url}) as saves:
        if search or asked != 1:
            data = _held_in_memory(data)
        model = EmbeddingClassifier.from_params(p.model_copy(update={"n_components": k}), **extra)
        grid = _search_grid(search) if search else None
        chosen, leads = {}, []
        if grid:
            from .model_selection import HeldOutSearch

            screen = _search_grid({name: [value] for name, value in SCREEN.items()}) if p.search_screen else None
            search_ = HeldOutSearch(model, grid, strategy=p.search_strategy, max_extensions=p.search_extensions,
                                    screen={name: values[0] for name, values in screen.items()} if screen else None,
                                    **_screen_split(p, model, data),
                                    screen_finalist=_screened_decoder_may_win(p, search),
                                    n_jobs=concurrent_fits(), time_budget=p.time_budget,
                                    on_first_model=saves, on_lead=_members_beside(p, asked, data, leads))
            try:
                fitted = search_.fit(data.X, data.Y, started=called)
            except BaseException:
                for _, ensemble in leads:
                    ensemble.abandon()
                raise
            model = fitted.best_estimator_
            chosen = dict(fitted.best_params_)
        else:
            model.fit(data.X, data.Y)
            _check_one_fit(p.time_budget, time.perf_counter() - called)
        single, gains = model, None
        n_estimators = _members_in_budget(p, asked, fitted if grid else None, called)
        begun = next((ensemble for lead, ensemble in leads if lead is single), None) if n_estimators == asked else None
        for _, ensemble in leads:  # members started beside a fit that is not the one kept
            if ensemble is not begun:
                ensemble.abandon()
        if n_estimators != 1:
            from .models import EnsembleClassifier

            # the members the defaults add are kept only while they pay; those the user asks for are fitted
            model = (begun or EnsembleClassifier(
                type(single)(**single.get_params(deep=False)), n_estimators=n_estimators, random_state=p.random_state,
                n_jobs=concurrent_fits(), early_stopping=p.n_estimators == "auto")).fit(data.X, data.Y, fitted=[single])
            n_estimators, gains = len(model.estimators_), model.member_gains_
            if n_estimators == 1:
                model = single
        seconds = time.perf_counter() - start
        saves.save(model, {"train_url": train_url, **({"search": fitted.record()} if grid else {})})
    used_s = time.perf_counter() - called
    last = single.history_[-1] if getattr(single, "history_", None) else {}
    used = {name: getattr(p, name) for name in ("embedding", "kernel", "features", "alpha", "n_random_features",
                                                "max_epochs", "random_state")}
    # reported without the parameters the model ignores (a bandwidth of kernel none)
    ignored = {name for name, (parent, values) in single.conditional_params.items()
               if single.get_params(deep=False)[parent] not in values}
    return {
        "model": out,
        "train": train_url,
        "seconds": round(seconds, 3),
        "n_passes": int(sum(getattr(m, "n_passes_", 0) for m in getattr(model, "estimators_", [model]))),
        "task": getattr(model, "task_", None),
        "params": {name: value for name, value in {**used, "n_components": k, **extra, **chosen}.items()
                   if name not in ignored}
        | ({"n_estimators": n_estimators} if n_estimators != 1 else {}),
        **({"time_budget": {"seconds": p.time_budget, "used": round(used_s, 3), "n_estimators_asked": asked,
                            "skipped": fitted.skipped_ if grid else [],
                            "first_model_saved_s": round(saves.seconds, 3) if saves.saved else None}}
           if p.time_budget else {}),
        "held_out": {key: value for key, value in last.items() if isinstance(value, (int, float, str))},
        **({"search": fitted.results_} if grid else {}),
        **({"ensemble": gains} if gains is not None else {}),
    }


def _check_one_fit(budget: float | None, seconds: float) -> None:
    """Refuse a time budget that the one fit asked for (no search) exceeded, naming its time (nothing is saved)."""
    if budget is not None and seconds > budget:
        raise BudgetError(f"a time budget of {budget:g} s is shorter than one fit, which took {seconds:.1f} s; give at "
                          f"least {math.ceil(seconds * 1.5)} s, or no budget")


def members_asked(p: TrainParams) -> int:
    """The ensemble's size that ``n_estimators`` asks for: as given, or for ``"auto"``
    :data:`~xmldask.params.AUTO_ESTIMATORS` after the embedding classifier's search (each added member kept only
    while it pays), else 1."""
    if p.n_estimators != "auto":
        return int(p.n_estimators)
    return AUTO_ESTIMATORS if p.model in ("auto", "embedding") and p.search else 1


class _EarlySave:
    """The job's saves of its model, as a context around its fits. With a time budget the search hands it its first
    model as soon as it is made (``on_first_model``), which it saves to the target: the best model so far is on disk
    while the search goes on, and the seconds the save took are what the search leaves at the end of the budget for
    the final save (:meth:`save`). A job that fails after that first save leaves no store where there was none (a
    store the user let the job overwrite is already replaced)."""

    def __init__(self, out: str, overwrite: bool, meta: dict):
        self.out, self.overwrite, self.meta = out, overwrite, meta
        self.existed, self.seconds, self.model = False, 0.0, None

    @property
    def saved(self) -> bool:
        return self.model is not None

    def __call__(self, model) -> None:
        start = time.perf_counter()
        self.existed = exists(self.out)
        model.save(self.out, overwrite=self.overwrite, meta={**self.meta, "first_model": True})
        self.seconds, self.model = time.perf_counter() - start, model
        logger.info("time budget: the first model saved to %s (%.2f s) while the search goes on", self.out,
                    self.seconds)

    def save(self, model, meta: dict) -> None:
        """The job's final save: ``model``; where it is the first model saved already, only ``meta`` added (the
        search's record) to its store."""
        if not self.saved:
            model.save(self.out, overwrite=self.overwrite, meta=meta)
        elif model is self.model:
            from .store.models import update_model_meta

            update_model_meta(self.out, {**meta, "first_model": False})
        else:
            model.save(self.out, overwrite=True, meta={**meta, "first_model": False})

    def __enter__(self) -> _EarlySave:
        return self

    def __exit__(self, kind, error, traceback) -> bool:
        if kind is not None and self.saved and not self.existed:
            from .store import remove

            remove(self.out)
        return False


def _members_beside(p: TrainParams, asked: int, data, leads: list):
    """The search's ``on_lead`` for the default ensemble: the members it would try first (as many as the fits that
    run at once: the fits the trial makes anyway) start as the race leaves a full fit making its epochs, beside them
    (:meth:`~xmldask.models.EnsembleClassifier.begin`); each lead and its ensemble go to ``leads``. None (nothing
    started early) with a time budget (the members are fitted as the budget's time left allows), one core, or no
    ensemble."""
    slots = concurrent_fits()
    if p.n_estimators != "auto" or asked == 1 or p.time_budget is not None or slots < 2:
        return None

    def start(model) -> None:
        from .models import EnsembleClassifier

        ensemble = EnsembleClassifier(type(model)(**model.get_params(deep=False)), n_estimators=asked,
                                      random_state=p.random_state, n_jobs=concurrent_fits(), early_stopping=True)
        if ensemble.begin(model, data.X, data.Y, n_members=slots):
            leads.append((model, ensemble))

    return start


def _members_in_budget(p: TrainParams, asked: int, search, start: float) -> int:
    """The ensemble's members: ``asked``, or with a ``time_budget`` as many as its time left allows (member 0
    is fitted; each other costs what member 0's fit cost; the search's ``reserve_``, the final save's time, left)."""
    if asked == 1 or p.time_budget is None:
        return asked
    elapsed = time.perf_counter() - start + getattr(search, "reserve_", 0.0)
    member = search.best_fit_seconds_ if search is not None else elapsed
    affordable = 1 + max(0, int((p.time_budget - elapsed) // max(member, 1e-9)))
    left = p.time_budget - elapsed
    if affordable < asked and left > 0:
        logger.info("time budget: %d of the %d ensemble members fit in the %.1f s left (a member takes about %.1f s)",
                    affordable, asked, left, member)
    elif affordable < asked:
        logger.info("time budget: spent %.1f s ago, the model is 1 of the %d ensemble members (a member takes about "
                    "%.1f s)", -left, asked, member)
    return min(affordable, asked)


#: a search's or an ensemble's fits, a tree's growth and its classifier's epochs read the training rows from the
#: workers' memory, read from the store once, when they take at most this share of it
#: (:func:`xmldask.scheduling.memory_for_data`)
IN_MEMORY_SHARE = 1 / 8


def _held_in_memory(data):
    """``data`` with ``X`` and ``Y`` persisted in the workers' memory when they are small enough
    (:data:`IN_MEMORY_SHARE`), so that many passes read the store once (docs/measurements.md); as it is
    otherwise, each pass then reading its blocks from the store."""
    if data.nbytes > IN_MEMORY_SHARE * memory_for_data():
        return data
    logger.info("holding the training rows in memory for the fits (%.1f MB)", data.nbytes / 1e6)
    X, Y = dask.persist(data.X, data.Y)
    return dataclasses.replace(data, X=X, Y=Y)


#: estimator parameters the job sets from :class:`~xmldask.models.TrainParams` (under the job's names)
_SET_BY_THE_JOB = frozenset({"n_components", "random_state"})


def _estimator_only() -> list[str]:
    from .models import EmbeddingClassifier

    return [name for name in EmbeddingClassifier._get_param_names()
            if name not in TrainParams.model_fields and name not in _SET_BY_THE_JOB]


def _screened_decoder_may_win(p: TrainParams, search: dict) -> bool:
    """Whether the screen's best setting, the ridge decoder alone on the linear map (:data:`SCREEN`), may be the
    model kept: when the decoder's epochs are at their default and the search may choose the linear map (the
    least-squares scores are a decoder beside the logistic / softmax one)."""
    return (p.search_screen and p.max_epochs == TrainParams.model_fields["max_epochs"].default
            and SCREEN["kernel"] in [kernel_name(value) for value in search.get("kernel", [p.kernel])])


def _screen_split(p: TrainParams, model, data) -> dict:
    """How the screen holds out rows: ``screen_repeats`` (``search_repeats``) and ``screen_fraction``.

    ``search_repeats="auto"``: :data:`SCREEN_ROWS` held-out rows in one split where they are at most
    :data:`MAX_SCREEN_FRACTION` of the rows (a screened setting then costs one solve, not one per repeat), else that
    share in each of the splits that give about :data:`SCREEN_ROWS` in all (at most :data:`MAX_SCREEN_REPEATS`). The
    model's own held-out share where it already holds out that many rows.
    """
    own = model.validation_fraction
    if p.search_repeats != "auto":
        return {"screen_repeats": int(p.search_repeats)}
    n = max(data.n_samples, 1)
    fraction = max(own, min(MAX_SCREEN_FRACTION, SCREEN_ROWS / n))
    held = max(1.0, min(fraction * n, model.max_validation_rows))
    repeats = int(min(MAX_SCREEN_REPEATS, math.ceil(SCREEN_ROWS / held)))
    return {"screen_repeats": repeats, "screen_fraction": fraction if fraction != own else None}


def _fit_to_data(p: TrainParams, data, given=frozenset()) -> tuple[int, dict | None]:
    """``n_components`` (k) and the search's lowered to what the data allows, before any pass: a warning if the
    user gave them (``given``: the parameters set), else an INFO line (defaults are fitted to the data silently)."""
    most, what = (data.n_features, "features") if p.embedding == "pca" else (data.n_labels, "labels")
    k = p.n_components
    search = dict(p.search) if p.search else None
    if k > most:
        if not (search and "n_components" in search):  # a searched k is reported below, with its grid
            logger.log(logging.WARNING if "n_components" in given else logging.INFO,
                       "k=%d is more than the %d %s of %s: using k=%d", k, most, what, data.url, most)
        k = most
    if search and "n_components" in search:
        if p.embedding == "rembrandt" and data.n_features < most:
            # X W has rank at most d, and Rembrandt's top-d directions already span it: a larger k gives
            # the same predictions (the same distances between rows of X W, for the kernels too) at more cost
            most, what = data.n_features, "features (X W has rank at most that many)"
        values = [int(v) for v in search["n_components"]]
        lowered = list(dict.fromkeys(min(v, most) for v in values))
        if p.embedding == "rembrandt" and data.n_labels in lowered[1:]:
            # k = L first, where the search starts: every label direction, and the identity (no decomposition: the
            # cheapest screen, and the cheapest first model under a time budget)
            lowered = [data.n_labels] + [v for v in lowered if v != data.n_labels]
        if lowered != values:
            logger.log(logging.WARNING if "search" in given else logging.INFO,
                       "the search's k=%s exceed the %d %s of %s: trying k=%s", values, most, what, data.url, lowered)
        search["n_components"] = lowered
    return k, search


def _train_family(train_url: str, out: str, p: TrainParams, *, overwrite: bool, given: dict | None = None,
                  called: float, **extra) -> dict:
    """``train(..., model=NAME)``: fit and save the model family registered under ``NAME``
    (:data:`xmldask.base.FAMILIES`: LEML, binary relevance, the boosting models, the centroids, a tree's
    classifier) on the dataset store, with the held-out search of its ``auto_search`` unless its parameters are
    given."""
    from . import models  # noqa: F401  (defines the families)

    cls = FAMILIES[p.model]
    unknown = sorted(set(extra) - set(cls._get_param_names()))
    if unknown:
        raise ValueError(f"{', '.join(unknown)} do not apply to --model {p.model}; its parameters are "
                         f"{', '.join(cls._get_param_names())}")
    try:
        est = cls.from_params(p, **extra)
    except TypeError as exc:  # a constructor parameter that the training parameters set
        raise ValueError(f"--model {p.model}: {exc}; give it as a training parameter") from None
    asked = members_asked(p)
    if asked > 1 and "random_state" not in est.get_params(deep=False):
        raise ValueError(f"--model {p.model} draws nothing at random, so an ensemble's members would all be one "
                         "model: give n_estimators 1")
    _check_model_target(out, overwrite, [train_url, *([p.tree] if p.model == "tree" else [])], tree=False)
    data = open_dataset(train_url)
    grid = _family_grid(cls, p, {**(given or {}), **extra})
    start = time.perf_counter()
    if hasattr(est, "memory_needed"):
        _check_memory(est, data, members=asked)
    fitted = None
    with _EarlySave(out, overwrite, {"train_url": train_url}) as saves:
        if grid:
            from .model_selection import HeldOutSearch

            reads_mask = cls.fit_dataset is not ParamsMixin.fit_dataset  # LEML, BR: the observed entries
            if not reads_mask:
                check_fully_observed(data, cls.__name__)
            data = _held_in_memory(data)
            fitted = HeldOutSearch(est, grid, scoring=cls.search_scoring, strategy=p.search_strategy,
                                   max_extensions=p.search_extensions, n_jobs=concurrent_fits(),
                                   time_budget=p.time_budget, on_first_model=saves).fit(
                data.X, data.Y, data.observed if reads_mask else None, started=called)
            est = fitted.best_estimator_
        else:
            if getattr(cls, "many_passes", False) or asked > 1:  # passes or fits: the rows read once
                data = _held_in_memory(data)
            if p.time_budget and "time_budget" in est.get_params(deep=False):  # the job's time left, from its call
                est.set_params(time_budget=max(p.time_budget - (time.perf_counter() - called), 1e-3))
            est.fit_dataset(data)
            if "time_budget" not in est.get_params(deep=False):  # a model that cannot stop early: its one fit
                _check_one_fit(p.time_budget, time.perf_counter() - called)
        single, n_estimators = est, _members_in_budget(p, asked, fitted, called)
        if n_estimators > 1:
            from .models import EnsembleClassifier

            est = EnsembleClassifier(type(single)(**single.get_params(deep=False)), n_estimators=n_estimators,
                                     random_state=p.random_state).fit_dataset(data, fitted=[single])
        seconds = time.perf_counter() - start
        saves.save(est, {"train_url": train_url, **({"tree_url": p.tree} if p.model == "tree" else {}),
                         **({"search": fitted.record()} if grid else {})})
    used_s = time.perf_counter() - called
    return {"model": out, "train": train_url, "seconds": round(seconds, 3),
            "params": {"model": p.model, **single.get_params(deep=False),
                       **({"n_estimators": n_estimators} if n_estimators > 1 else {})},
            **est.train_summary(),
            **({"time_budget": {"seconds": p.time_budget, "used": round(used_s, 3),
                                "skipped": fitted.skipped_ if grid else [],
                                "cut": list(getattr(single, "budget_cut_", None) or [])}} if p.time_budget else {}),
            **({"search": fitted.results_} if grid else {})}


def _family_grid(cls, p: TrainParams, given: dict) -> dict | None:
    """The held-out search of a model family (its estimator's names): ``search`` as given, or for ``"auto"`` the
    family's ``auto_search`` without the parameters given; ``None`` for no search (``--no-search``, a family
    with no ``auto_search``, or every parameter given)."""
    if not p.search:
        return None
    if p.search == "auto":
        grid = {name: list(values) for name, values in getattr(cls, "auto_search", {}).items() if name not in given}
        return grid or None
    check_search({"model": p.model, "search": p.search})
    return _search_grid(p.search)


#: the parameters of ``model="auto"`` that the embedding classifier takes and the centroids do not (they search
#: nothing): one of them given keeps the embedding classifier
_EMBEDDING_ONLY = tuple(name for name in SCHEMAS["embedding"].model_fields
                        if name not in SCHEMAS["centroid"].own_fields()
                        and name not in ("model", "random_state", "search", "time_budget", "n_estimators"))


def choose_model(train_url: str, given: dict, extra: dict | None = None, *, time_budget: float | None = None) -> str:
    """The family of ``model="auto"`` (the default) for a dataset store: ``"centroid"`` when it scores fewer labels
    a row than a flat model, which scores all of them (:func:`~xmldask.models.centroid.labels_scored_per_row`:
    more than about 2,000 labels with its defaults), else ``"embedding"``; with a ``time_budget``, also
    ``"centroid"`` where the embedding classifier's first model would not be ready in it
    (:func:`embedding_outlasts`): the label-centroid tree's first model is two passes and a clustering.

    The embedding classifier is kept whenever an option that only it takes is given (``k``, ``kernel``, a
    search grid, ``tree``, ...), so that such a command means what it says. The choice is logged.
    """
    from .models.centroid import labels_scored_per_row
    from .models.centroid import logger as progress

    given = _given(current_names(given))
    search = given.get("search", "auto")
    named = [name for name in _EMBEDDING_ONLY if given.get(name) is not None] + \
        (["search"] if isinstance(search, dict) and search else []) + sorted(extra or {})
    if named:
        return "embedding"
    n_labels = open_dataset(train_url).n_labels
    scored = labels_scored_per_row(n_labels)
    if scored < n_labels:
        progress.info(f"model auto: {n_labels:,} labels, so the label-centroid tree (it scores at most {scored:,} "
                      f"cluster summaries and labels a row, a flat model all {n_labels:,} labels; --model embedding "
                      "for the flat one)")
        return "centroid"
    if time_budget is not None:
        seconds = embedding_outlasts(open_dataset(train_url), time_budget)
        if seconds:
            progress.info(f"model auto: the embedding classifier's first model factors two matrices of "
                          f"{_factored_side(open_dataset(train_url)):,} rows, about {seconds:.1f} s on this machine, "
                          f"past the time budget of {time_budget:g} s: the label-centroid tree, whose first model is "
                          "two passes and a clustering (--model embedding for the flat one)")
            return "centroid"
    return "embedding"


#: the side of a square matrix whose factorization is timed on this machine, to scale to a larger one's
#: (:func:`embedding_outlasts`); below it, a factorization takes a few milliseconds
TIMED_SIDE = 1024


def _factored_side(data) -> int | None:
    """The side of the matrices that the embedding classifier's first model factors with ``solver="auto"`` (the
    Rembrandt embedding's ridge and the decoder's: the features' Gram matrix up to
    :data:`~xmldask.linalg.MAX_GRAM_FEATURES` features, beyond it the rows' where the dual applies); None where
    they are solved iteratively."""
    from .linalg import MAX_GRAM_FEATURES, dual_applies

    if data.n_features <= MAX_GRAM_FEATURES:
        return int(data.n_features)
    return int(data.n_samples) if dual_applies(data.n_samples) else None


def embedding_outlasts(data, time_budget: float) -> float:
    """The seconds of the embedding classifier's first model's two factorizations (the Rembrandt embedding's and
    the ridge decoder's, of :func:`_factored_side`), if they alone exceed ``time_budget``, else 0: a Cholesky
    factorization of :data:`TIMED_SIDE` timed here and scaled by the cube of the sides (an over-estimate: the
    BLAS's speed grows with the side; 4,463 rows took 0.82 s against 2.9 s so scaled, on this 2-core machine).
    Sides up to :data:`TIMED_SIDE` are not timed (they take milliseconds)."""
    import scipy.linalg

    side = _factored_side(data)
    if side is None or side <= TIMED_SIDE:
        return 0.0
    rng = np.random.default_rng(0)
    A = rng.random((TIMED_SIDE, TIMED_SIDE))
    A += A.T + 2 * TIMED_SIDE * np.eye(TIMED_SIDE)  # diagonally dominant: positive definite (its values cost alike)
    start = time.perf_counter()
    scipy.linalg.cho_factor(A, lower=True, overwrite_a=True)
    seconds = 2 * (time.perf_counter() - start) * (side / TIMED_SIDE) ** 3
    return seconds if seconds > time_budget else 0.0


def _given(params: dict) -> dict:
    """The training parameters that differ from their defaults: the flows pass every field (the defaults dumped),
    the command line only those given."""
    defaults = TrainParams().model_dump()

    def value_of(value):
        if isinstance(value, dict):
            return {key: list(v) if isinstance(v, (list, tuple)) else [v] for key, v in value.items()}
        return value

    return {name: value for name, value in params.items() if value_of(value) != defaults.get(name, object())}


#: share of the memory limits that a fit's estimated peak may take: the rest is for Dask, the Python heap and
#: what the estimate leaves out
MEMORY_SHARE = 0.6


def _check_memory(est, data, *, members: int = 1) -> None:
    """Refuse, before any pass, a fit whose estimated peak (``est.memory_needed(data)``: bytes of the fitting
    process and of one task, the task's added to the process's where the workers are its threads, else times the
    threads of a worker process, each running one; an
    ensemble's fitting process also holds its ``members`` - 1 other fitted models) exceeds
    :data:`MEMORY_SHARE` of this machine's available memory or of the
    smallest worker's limit, with the numbers and what to change."""
    import dask
    import psutil

    from .scheduling import worker_memory_in_use, worker_memory_limit, worker_threads, workers_in_process

    need = dict(est.memory_needed(data))
    need["fit_process"] = need.get("fit_process", 0) + (members - 1) * need.get("model_bytes", 0)
    in_process = workers_in_process()
    if in_process:  # the workers' tasks run in this process: a worker's peak is its peak too
        need["fit_process"] = need.get("fit_process", 0) + need.get("worker", 0)
    elif need.get("worker") and worker_threads() > 1:
        # a worker process runs a task a thread, each sized by its share of the limit (task_memory_limit): the
        # worker's peak is theirs together (measured: 1 worker, 2 threads, 1 GiB: one task estimated at 0.37 GiB,
        # the worker paused at 820-890 MiB)
        need["task"] = need["worker"]
        need["worker"] = need["worker"] * worker_threads()
    limits = {"fit_process": psutil.virtual_memory().available, "worker": worker_memory_limit()}
    said = [f"the {what.replace('_', ' ')} needs about {need[what] / 2**30:.2f} GiB of its {limit / 2**30:.2f} GiB "
            f"(at most {MEMORY_SHARE:.0%} is used)" for what, limit in limits.items()
            if limit and need.get(what, 0) > MEMORY_SHARE * limit]
    # a worker pauses at a share of its limit (Dask's distributed.worker.memory.pause) that counts what it holds
    # before the job (the interpreter and libraries: 100-130 MiB fresh, more after earlier stages)
    pause, held = dask.config.get("distributed.worker.memory.pause", 0.8), worker_memory_in_use()
    limit = limits["worker"]
    if limit and pause and not in_process and not said and need.get("worker", 0) + held > pause * limit:
        said.append(f"a worker needs about {need['worker'] / 2**30:.2f} GiB"
                    + (f" ({worker_threads()} threads, a task each)" if "task" in need else "")
                    + f" on top of the {held / 2**30:.2f} GiB it "
                    f"holds before the job, past the {pause * limit / 2**30:.2f} GiB ({pause:.0%} of its limit) at "
                    "which Dask pauses it")
    if said:
        raise MemoryError(f"{type(est).__name__} on {data.url} ({data.n_samples} rows, {data.n_features} features, "
                          f"{data.n_labels} labels) would not fit: {'; '.join(said)}. Fix: "
                          "give the workers more memory (--memory-limit, or a cluster with larger workers), train on "
                          "fewer features (a smaller vocabulary), or on a sample of the rows"
                          + (", or give each worker fewer threads (--threads-per-worker)" if "task" in need else "")
                          + (f", or an ensemble of fewer than {members} members" if members > 1 else ""))
    logger.info("estimated peak memory: %s%s", ", ".join(f"{k} {v / 2**30:.2f} GiB" for k, v in need.items()
                                                        if k != "entries") + (
                f" ({worker_threads()} tasks at once)" if "task" in need else ""),
                f" (beside the {held / 2**30:.2f} GiB a worker holds now)" if held and not in_process else "")
    return need


#: the training parameters a search may choose (besides the embedding classifier's own, :func:`_estimator_only`)
SEARCHABLE = ("features", "n_components", "alpha", "kernel", "n_random_features", "max_epochs", "embedding")


def check_search(params: dict) -> None:
    """Refuse a ``search`` over a parameter the embedding classifier does not have, naming the documented ones
    (the command line calls it before its cluster starts; :func:`train` before any pass)."""
    search = params.get("search")
    if not isinstance(search, dict):
        return
    model = params.get("model") or "auto"
    if model in ("auto", "embedding"):
        known, what = [*SEARCHABLE, *_estimator_only()], "the search can choose; it chooses"
    else:
        from . import models  # noqa: F401  (defines the families)

        known = list(FAMILIES[model]._get_param_names())
        what = f"of --model {model}; it has"
    unknown = [name for name in current_names(search) if name not in known]
    if unknown:
        raise ValueError(f"--search {', '.join(unknown)}: not a parameter {what} {', '.join(known)}")


def _search_grid(search: dict) -> dict:
    """The estimator's grid of a search (a former parameter name or kernel name read as today's)."""
    grid = {}
    for name, values in current_names(search).items():
        values = list(values) if isinstance(values, (list, tuple)) else [values]
        grid[name] = [kernel_name(v) for v in values] if name == "kernel" else values
    return grid


def check_predict_inputs(model_url: str, data_url: str) -> None:
    """Refuse a dataset whose features are not the model's, from the stores' attributes alone (the command line
    calls it before its cluster starts; :func:`predict` checks again on the loaded model)."""
    from .store.models import model_attrs

    fitted = model_attrs(model_url).get("fitted") or {}
    expected, given = fitted.get("n_features_in"), open_dataset(data_url).n_features
    if expected is not None and int(expected) != given:
        raise ValueError(f"{data_url} has {given} features but the model {model_url} was trained on {expected}; "
                         "predict on data ingested like the training data")


def predict(model_url: str, data_url: str, out: str, *, top_k: int = TOP_K, overwrite: bool = False,
            progress: bool = False) -> dict:
    """Top-``top_k`` labels and scores of every row of a dataset store into a prediction store.

    Returns
    -------
    dict
        The prediction store's attributes: ``n_samples``, ``top_k``, ``seconds``,
        ``rows_per_second``, ``model``, ``data``, ``url``.
    """
    from .models import load_model

    check_target(out, kind="predictions", overwrite=overwrite, inputs=[model_url, data_url])
    model = load_model(model_url)
    data = open_dataset(data_url)
    n_labels = int(model.n_labels_)
    if data.X.shape[1] != model.n_features_in_:
        raise ValueError(f"{data_url} has {data.X.shape[1]} features but the model {model_url} was trained on "
                         f"{model.n_features_in_}; predict on data ingested like the training data")
    if not 1 <= top_k <= n_labels:
        raise ValueError(f"top_k must be between 1 and the model's {n_labels} labels, but is {top_k}")
    release_worker_memory()  # what a training job left in the workers' heaps
    labels, scores = model.predict_topk(data.X, k=top_k)
    info = write_predictions(out, labels, scores, n_labels=n_labels, overwrite=overwrite, progress=progress,
                             meta={"model": model_url, "data": data_url, "data_fingerprint": data.fingerprint})
    return {"url": out, **info}


def evaluate(pred_url: str, data_url: str, *, train_url: str | None = None, ks=(1, 3, 5), A: float = 0.55,
             B: float = 1.5) -> dict:
    """Metrics of a prediction store against a dataset store's labels.

    Propensities for ``PSP@k``/``PSnDCG@k`` (Jain et al. 2016, parameters ``A``, ``B``) come from the
    label counts of ``train_url`` if given, else of the training set recorded in the model the
    predictions came from, else of the evaluated data itself (``propensity_source`` says which).

    Returns
    -------
    dict
        Metric name to value (``"P@1"``, ``"P@3"``, ``"P@5"``, ``"nDCG@k"``, ``"PSP@k"``, ...), plus
        ``n_samples``, ``propensity_source`` and ``baseline``: the same metrics for predicting the
        most frequent labels of the training data (of the propensity source) for every row, the
        trivial model a model must beat.
    """
    from . import metrics

    preds = open_predictions(pred_url)
    data = open_dataset(data_url)
    if preds.labels.shape[0] != data.Y.shape[0]:
        raise ValueError(f"{pred_url} holds predictions for {preds.labels.shape[0]} rows but {data_url} has "
                         f"{data.Y.shape[0]}; predict on this dataset first (xmldask predict MODEL {data_url} ...)")
    made_from = preds.meta.get("data_fingerprint")
    if made_from is not None and made_from != data.fingerprint:
        raise ValueError(f"{pred_url} holds predictions made from {preds.meta.get('data')} (dataset fingerprint "
                         f"{made_from}), not from {data_url} ({data.fingerprint}): evaluate them against the "
                         f"dataset they were made from, or predict on this one first (xmldask predict MODEL "
                         f"{data_url} ...)")
    ks = tuple(k for k in ks if k <= preds.top_k)
    source_url = train_url or _model_train_url(preds.meta.get("model"))
    source = open_dataset(source_url) if source_url and exists(source_url) else data
    if source.Y.shape[1] != data.Y.shape[1]:
        raise ValueError(f"{source.url} has {source.Y.shape[1]} labels but {data_url} has {data.Y.shape[1]}")
    propensities = metrics.propensity(source.label_counts, source.Y.shape[0], A=A, B=B)
    # the baseline: every row gets the most frequent labels of the training data, scored in the same pass
    frequent = np.argsort(-np.asarray(source.label_counts), kind="stable")[:preds.top_k].astype(preds.labels.dtype)
    constant = da.broadcast_to(frequent, preds.labels.shape, chunks=preds.labels.chunks)
    results, baseline = dask.compute(
        metrics.evaluate(data.Y, preds.labels, preds.scores, ks=ks, propensities=propensities, compute=False,
                         **_full_scores(preds.meta.get("model"), data)),
        metrics.evaluate(data.Y, constant, ks=ks, propensities=propensities, compute=False))
    results["propensity_source"] = "train" if source is not data else "test"
    results["baseline"] = {name: value for name, value in baseline.items() if name not in _COUNTS}
    return results


#: figures of the evaluated rows, the same for the model and the baseline
_COUNTS = ("n_samples", "n_samples_without_labels")


def _full_scores(model_url: str | None, data) -> dict:
    """For a model that scores every label against a threshold (``thresholded``: LEML, binary relevance): its
    scores and decision threshold, for ``avg_AUC`` and the Hamming loss (LEML's Appendix E.1 metrics); otherwise
    nothing."""
    from .models import load_model
    from .store.models import model_qualname

    if not model_url or not exists(model_url) or not getattr(registered_class(model_qualname(model_url)),
                                                             "thresholded", False):
        return {}
    model = load_model(model_url)
    return {"scores_full": model.decision_function(data.X), "threshold": float(model.threshold_)}


def _model_train_url(model_url: str | None) -> str | None:
    """The training dataset URL recorded in a model store, if any."""
    if not model_url or not exists(model_url):
        return None
    import zarr

    attrs = dict(zarr.open_group(zarr_store(model_url, read_only=True), mode="r").attrs)
    return (attrs.get("xmldask") or {}).get("train_url")


# --------------------------------------------------------------------------------------------
# spectral label tree


def _check_model_target(out: str, overwrite: bool, inputs: list, *, tree: bool) -> None:
    """:func:`~xmldask.store.check_target` of a model store, and with ``overwrite`` a label tree is replaced only
    by a tree, a classifier only by a classifier (a tree is an input of classifiers trained on it)."""
    from .store.models import model_class

    check_target(out, kind="model", overwrite=overwrite, inputs=inputs)
    if overwrite and exists(out):
        held = model_class(out)
        if (held == "SpectralLabelTree") != tree:
            what = "a label tree" if held == "SpectralLabelTree" else f"a {held} model"
            raise FileExistsError(f"{out} holds {what}; --overwrite replaces a {'tree' if tree else 'classifier'} "
                                  "only by another: choose another --out, or remove it yourself")


#: bytes per feature column that every model needs at least (four float64 vectors)
PER_FEATURE_BYTES = 32
#: training rows a model needs at least (one to fit, one for the held-out choices)
MIN_TRAINING_ROWS = 2


def _check_trainable(train_url: str) -> None:
    """Refuse a training set with too few rows or no label, before any cluster work, with the numbers."""
    data = open_dataset(train_url)
    if data.n_samples < MIN_TRAINING_ROWS:
        raise ValueError(f"{train_url} has {data.n_samples} row{'s' if data.n_samples != 1 else ''}: training needs "
                         f"at least {MIN_TRAINING_ROWS}; ingest more rows (xmldask ingest ... --append)")
    if not int(data.meta.get("nnz_labels", 1)):
        raise ValueError(f"{train_url} has no label in its {data.n_samples:,} rows: there is nothing to learn")
    import psutil

    # every model holds a few float64 vectors over the features (idf, column moments, a preconditioner)
    needed, available = PER_FEATURE_BYTES * data.n_features, psutil.virtual_memory().available
    if needed > available:
        raise MemoryError(f"{train_url} has {data.n_features:,} feature columns (its largest feature id + 1): a model "
                          f"holds vectors over them, at least {needed / 2**30:.1f} GiB, and {available / 2**30:.1f} "
                          "GiB are available. Number the features compactly (0 .. the number in use) and ingest "
                          "again")


def _fingerprint(data) -> str:
    """Content fingerprint of a dataset store: its sources' sha256 and its shape."""
    import hashlib
    import json

    facts = {"sources": [src.get("sha256") for src in data.meta.get("sources", [])],
             "shape": [data.n_samples, data.n_features, data.n_labels]}
    return hashlib.sha256(json.dumps(facts, sort_keys=True).encode()).hexdigest()


def tree(train_url: str, out: str, *, overwrite: bool = False, **params) -> dict:
    """Grow a :class:`~xmldask.tree.SpectralLabelTree` on a dataset store and save it.

    ``params`` are the fields of :class:`~xmldask.params.TreeParams` (``max_depth``, ``leaf_labels``,
    ``routing``, ``unseen_labels``, ``random_state``; former names read) and any other keyword of the tree (e.g.
    ``memory_budget``).
    Bad input is refused before any pass: a parameter out of its range, an existing ``out``, and with
    ``unseen_labels="error"`` a training label with no example (the default, ``"ignore"``, grows the tree
    without them, counts them in ``n_unseen_labels`` and no leaf ever offers them, as no model predicts them).

    Returns
    -------
    dict
        ``tree`` (URL), ``train``, ``seconds``, ``n_passes``, ``n_nodes``, ``n_leaves``, ``n_orphans``,
        ``n_unseen_labels``, ``task``, ``params`` and the training figures of :meth:`SpectralLabelTree.figures`.
    """
    import numpy as np

    from .tree import SpectralLabelTree

    params = current_names(params)
    p = validated(TreeParams, {name: value for name, value in params.items() if name in TreeParams.model_fields})
    extra = {name: value for name, value in params.items() if name not in TreeParams.model_fields}
    _check_model_target(out, overwrite, [train_url], tree=True)
    data = open_dataset(train_url)
    check_fully_observed(data, "the spectral tree")
    missing = np.flatnonzero(data.label_counts == 0)
    if len(missing) and p.unseen_labels == "error":
        raise ValueError(f"{train_url} has {len(missing)} labels with no training example (first: "
                         f"{missing[:5].tolist()}); the tree cannot place them. Ingest with the labels present "
                         f"only (remap the label ids), train on data that covers every label, or grow the tree "
                         f"without them: unseen_labels='ignore' (--unseen-labels ignore)")
    if len(missing):
        logger.warning("%s: %d labels have no training example (first: %s); no leaf will offer them", train_url,
                       len(missing), missing[:5].tolist())
    model = SpectralLabelTree(max_depth=p.max_depth, leaf_labels=p.leaf_labels, routing=p.routing,
                              random_state=p.random_state, **extra)
    start = time.perf_counter()
    rows = _held_in_memory(data)  # a tree's 100-250 passes
    model.fit(rows.X, rows.Y)
    figures = model.figures(rows.X, rows.Y)
    seconds = time.perf_counter() - start
    model.save(out, overwrite=overwrite, meta={"train_url": train_url, "train_fingerprint": _fingerprint(data)})
    return {"tree": out, "train": train_url, "seconds": round(seconds, 3), "n_passes": int(model.n_passes_) + 1,
            "n_nodes": int(len(model.table_)), "n_leaves": model.n_leaves_, "n_orphans": int(model.n_orphans_),
            "n_unseen_labels": int(len(missing)), "task": model.task_, "params": {**p.model_dump(), **extra},
            "train_figures": figures}


def tree_info(tree_url: str, data_url: str) -> dict:
    """The figures of a saved tree on a dataset store (one pass): ``tree_recall``, ``root_purity``,
    ``root_balance``, ``mean_depth``, ``mean_candidates``, ``top_labels_recall``, ``n_samples``, plus
    the tree's ``n_nodes``, ``n_leaves``, ``max_depth`` and ``leaf_labels``."""
    from .tree import SpectralLabelTree

    model = SpectralLabelTree.load(tree_url)
    data = open_dataset(data_url)
    if data.n_features != model.n_features_in_ or data.n_labels != model.n_labels_:
        raise ValueError(f"{data_url} has {data.n_features} features and {data.n_labels} labels but the tree "
                         f"{tree_url} was grown on {model.n_features_in_} and {model.n_labels_}; use data ingested "
                         f"like the tree's training data")
    figures = {key: (float(v) if key != "n_samples" else int(v)) for key, v in model.figures(data.X, data.Y).items()}
    return {**figures, "n_nodes": int(len(model.table_)), "n_leaves": model.n_leaves_,
            "max_depth": int(model.max_depth), "leaf_labels": int(model.leaf_labels), "tree": tree_url,
            "data": data_url}
