"""Choose an estimator's parameters on the held-out slice of the training rows.

:class:`HeldOutSearch` fits one estimator per candidate setting and keeps the one whose held-out P@1
(or loss) is best. Every candidate holds out the same rows (the split is seeded by ``random_state`` and
depends only on the row blocks), so the candidates are compared on the same data, and no test row is
ever seen. An estimator that holds out rows itself (:class:`~xmldask.models.EmbeddingClassifier`'s
``validation_fraction``: its decoder early-stops on them) is scored by its own held-out figures, and the
chosen estimator is the fitted candidate itself (no refit). Any other estimator with ``fit`` and
``predict_topk`` (LEML, binary relevance) is fitted on the rows the search does not hold out
(``validation_fraction`` of every row block, seeded) and scored by P@k on the held-out ones; the best
setting is then fitted again on all rows (``refit``).

A ``time_budget`` (seconds) stops the search when the next fit would not end within it (judged by the
fits so far) and keeps the best model found: the first fit always runs, so a budget shorter than one fit
is refused with the time that fit took.

Two strategies:

- ``"grid"``: every combination of the values (``prod(len(values))`` fits);
- ``"coordinate"`` (default): one parameter at a time, in the order given, each tried with the others
  at their best values so far (about ``sum(len(values))`` fits; settings already fitted are not
  fitted again).

A parameter that matters only for some values of another (the estimator's ``conditional_params``,
e.g. ``bandwidth_scale`` only for a random-feature ``kernel``) is never fitted where it is ignored
(``kernel=none`` is fitted once, whatever the bandwidths listed), and under ``"coordinate"`` it
is searched together with that other parameter: ``kernel=none,gaussian`` with
``bandwidth_scale=1,4`` tries none, gaussian at 1 and gaussian at 4, so a kernel is judged at its
best bandwidth, not at the first one.

Under ``"coordinate"``, a numeric grid whose best value is its largest (or smallest) is extended
geometrically, by the ratio of its last (first) two values, while the held-out score improves, at most
``max_extensions`` steps per side and within the estimator's ``search_bounds`` (``n_components`` is
at most the number of labels): a grid of ``alpha=0.001,0.03,1`` whose best is 1 tries 33.3, then
1110. A grid is a guess; the edge of a grid is where a guess is most often wrong.

Examples
--------
>>> import os, tempfile
>>> from xmldask.datasets import make_synthetic
>>> from xmldask.models import EmbeddingClassifier
>>> from xmldask.model_selection import HeldOutSearch
>>> data = make_synthetic(os.path.join(tempfile.mkdtemp(), "train.zarr"), n_samples=3000, n_features=300,
...                       n_labels=30, seed=0)
>>> base = EmbeddingClassifier(embedding="rembrandt", n_components=16, max_epochs=3, random_state=0)
>>> search = HeldOutSearch(base, {"kernel": ["none", "gaussian"], "alpha": [1e-3, 1.0]}).fit(data.X, data.Y)
>>> sorted(search.best_params_), 0 < search.best_score_ <= 1
(['alpha', 'kernel'], True)
>>> labels, scores = search.predict_topk(data.X[:100], k=5)
>>> labels.shape
(100, 5)
"""

from __future__ import annotations

import inspect
import itertools
import logging
import math
import numbers
import threading
import time

import dask
import numpy as np

from .base import BudgetError, kept_entry
from .models import HeldOut, kept_epoch
from .params import parse_grid
from .scheduling import step_aside, thread_map

__all__ = ["BudgetError", "HeldOutSearch", "held_out_score", "kept_epoch", "parse_grid"]

logger = logging.getLogger("xmldask.model_selection")

_SCORINGS = ("p@1", "p@3", "p@5", "loss")
#: the scorings of an estimator scored by its own held-out figures (``kept_epoch``)
_OWN_SCORINGS = ("p@1", "loss")

_STRATEGIES = ("coordinate", "grid")
#: the held-out figures a result records
_FIGURES = ("val_p@1", "val_p@3", "val_p@5", "val_loss")


def _seed(random_state) -> int:
    return int(random_state) if isinstance(random_state, numbers.Integral) else 0


def _params_key(params: dict) -> tuple:
    """Parameters as a dictionary key, but for ``time_budget`` (the search hands each fit the time left)."""
    return tuple(sorted((name, repr(value)) for name, value in params.items() if name != "time_budget"))


def held_out_score(estimator, scoring: str = "p@1") -> float:
    """The held-out figure of a fitted estimator's kept decoder (larger is better).

    ``scoring="p@1"`` returns the kept epoch's held-out P@1 (:func:`kept_epoch`), ``"loss"`` minus its
    held-out loss.
    """
    kept = kept_epoch(estimator)
    return float(kept["val_p@1"]) if scoring == "p@1" else -float(kept["val_loss"])


class _Race:
    """Full fits raced at their warm start: successive halving with two rungs, the decoder's warm start (its ridge
    solve) and its epochs.

    A fit makes its decoder epochs only if its warm start scores at least as high on the held-out rows as every other
    full fit's. The fits of a step (:meth:`together`, made by ``thread_map(..., at_once=True)``) wait for each other's
    warm start, stepping aside for the others meanwhile, so that which ones go on depends neither on which runs faster
    nor on how many run at once.
    """

    def __init__(self, score, names: dict):
        self._score, self._names = score, names  # history -> score; a fit's key -> its setting (for the log)
        self._starts: dict[tuple, float] = {}  # a fit's key -> the score of its warm start
        self._waiting: set[tuple] = set()  # fits made at once whose warm start is not scored yet
        self._cond = threading.Condition()

    def together(self, keys) -> None:
        with self._cond:
            self._waiting.update(keys)

    def callback(self, key, on_lead=None):
        """The ``callback`` of the fit ``key``: whether it makes another epoch. ``on_lead``: called (no argument) when
        the fit goes on past its warm start as the only leader, every other fit's warm start scored lower."""
        def another_epoch(history: list[dict]) -> bool:
            if len(history) > 1:  # past the warm start: raced already
                return True
            mine = self._score(history)
            with self._cond:
                self._starts[key] = mine
                self._waiting.discard(key)
                self._cond.notify_all()
                wait = bool(self._waiting)
            if wait:  # its slot is free meanwhile, taken again outside the lock (a fit in a slot may want the lock)
                with step_aside(), self._cond:
                    self._cond.wait_for(lambda: not self._waiting)
            if math.isnan(mine):  # no held-out figures: it neither stops nor stops another
                return True
            with self._cond:
                theirs = {other: start for other, start in self._starts.items()
                          if other != key and not math.isnan(start)}
            leader = max(theirs, key=theirs.get, default=None)
            if leader is None or theirs[leader] <= mine:
                if on_lead is not None and (leader is None or theirs[leader] < mine):
                    on_lead()
                return True
            logger.info("held-out search: %s makes no decoder epochs: its warm start scored %.4f, %s's %.4f",
                        self._names.get(key, key), abs(mine), self._names.get(leader, leader), abs(theirs[leader]))
            return False
        return another_epoch

    def finish(self, key, history: list[dict] | None) -> None:
        """The fit ``key`` ended (``history``: its held-out figures, or None if it failed)."""
        with self._cond:
            if history and key not in self._starts:
                self._starts[key] = self._score(history[:1])
            self._waiting.discard(key)
            self._cond.notify_all()


class HeldOutSearch:
    """Pick parameters of an estimator by its held-out score on the training rows.

    Parameters
    ----------
    estimator : estimator
        The template; candidates are ``clone(estimator).set_params(**setting)``. An estimator with a
        ``validation_fraction`` parameter (the embedding classifier) must hold out rows itself
        (``validation_fraction > 0``).
    param_grid : dict
        Parameter name to the list of values to try (in order: under ``"coordinate"`` the first
        value of each is where the search starts).
    strategy : {"coordinate", "grid"}, default "coordinate"
    scoring : {"p@1", "p@3", "p@5", "loss"}, default "p@1"
        Held-out P@k (larger is better) or, for an estimator holding out rows itself, held-out loss (smaller
        is better) of each candidate's kept decoder (P@1 or loss only). Ties keep the earlier candidate.
    max_extensions : int, default 2
        Most geometric steps past either end of a numeric grid under ``"coordinate"`` (0: none).
    screen : dict, optional
        Cheap settings to screen the candidates with, e.g. ``{"max_epochs": 0, "kernel": "none"}``
        (the ridge decoder alone, on the linear feature map). The parameters of the grid that are not
        keys of ``screen`` are searched first, every candidate fitted with these overrides; then the
        best setting is fitted in full (the template's values of the overridden parameters), once per
        value of the grid's parameters that are keys of ``screen`` (e.g. each ``kernel``), and the
        best of these full fits is kept: the screened fits only rank the settings (the model kept is
        always trained as asked, its decoder epochs included, unless ``screen_finalist``).
    screen_finalist : bool, default False
        The best screened setting competes with the full fits as it was screened (with ``screen``'s
        overrides: e.g. the ridge decoder alone). Compared on the full fits' own held-out rows (its first
        split), it is kept when it beats them, and then fitted once more, in full; or taken from a full fit of
        the same setting that started from it, where the estimator offers that fit's start (``at_warm_start``:
        the embedding classifier's ridge decoder before its epochs).
    screen_repeats : int, default 1
        Fits of every screened setting, each holding out other random rows (seeds drawn from the
        template's ``random_state``); its score is their mean. A held-out slice of a few hundred rows
        is noise: repeats are what make a screen of small data a choice.
    screen_fraction : float or None
        For an estimator that holds out rows itself: the share of the rows every screened fit holds out (its
        ``validation_fraction``; None: the template's). A larger share on small data gives a screened setting as
        many held-out rows in one split as several repeats would, at the cost of one fit. The screen's best is
        then compared with the full fits on their own held-out rows (scored again with the template's share).
    n_jobs : int or None
        Fits of one step (a coordinate's values, or the whole grid) made at once, in threads of this
        process (None: one at a time). The results, and the model kept, are the same either way, but for the
        last digits of the losses: fits at once share the BLAS threads (:func:`~xmldask.scheduling.thread_map`).
    validation_fraction : float, default 0.2
        For an estimator that holds out no rows itself: the share of every row block the search holds out
        (seeded by the estimator's ``random_state``).
    refit : bool, default True
        For such an estimator: fit the best setting again on all rows (``False``: keep the candidate fitted
        on the others).
    time_budget : float or None
        Seconds the search may take, its final refit included (None: no limit). With ``screen_finalist``, a first
        guess as screened (each number whose values cost alike at the middle of its values, the rest at their
        first) is fitted in full before the screen, the first model (a budget that holds one fit gets one), and
        the screen's best replaces it only where it scores higher.
    race : bool, default True
        For an estimator scored by its own held-out figures whose ``fit`` takes a ``callback`` (the embedding
        classifier): the full fits race at their warm start (successive halving with two rungs). A fit makes its
        decoder epochs only if the held-out score of its warm start (the ridge decoder) is at least that of every
        other full fit's warm start; fits made at once wait for each other's, so the outcome does not depend on their
        speed.
    on_first_model : callable, optional
        With a ``time_budget``: called with the first model (full fit) as soon as it is made, e.g. to save it, so
        that the best model so far is on disk. The seconds it takes are left at the end of the budget
        (``reserve_``): the job saves its final model in them.
    on_lead : callable, optional
        With ``race``: called with a full fit, in its thread, when the race leaves it making its decoder epochs as the
        only leader (every other full fit's warm start scored lower), e.g. to start beside its epochs the fits that
        would follow it (an ensemble's members: :meth:`~xmldask.models.EnsembleClassifier.begin`). The fit may still
        lose (to a later step, or to the screened finalist): ``best_estimator_`` says.

    Attributes
    ----------
    best_estimator_ : the fitted candidate with the best score
    best_params_ : dict
    best_score_ : float
        Its held-out score (P@1, or minus the loss).
    results_ : list of dict
        One per fitted candidate, in fitting order: ``params``, ``score``, ``val_p@1`` and ``val_loss`` (an
        estimator holding out rows itself) or ``val_p@1``, ``val_p@3``, ``val_p@5`` (the rows the search holds
        out), ``seconds``, and ``screened`` (fitted with ``screen``'s overrides).
    skipped_ : list of dict
        The settings the ``time_budget`` left unfitted.
    seconds_ : float
        The search's time, its refit included.
    best_fit_seconds_ : float
        The time of the fit that made ``best_estimator_`` (the cost of one more model of its setting).
    reserve_ : float
        The seconds of ``on_first_model``, left at the end of the ``time_budget`` (0 without one).
    """

    def __init__(self, estimator, param_grid: dict, *, strategy: str = "coordinate", scoring: str = "p@1",
                 max_extensions: int = 2, screen: dict | None = None, screen_repeats: int = 1,
                 screen_finalist: bool = False, screen_fraction: float | None = None, n_jobs: int | None = None,
                 validation_fraction: float = 0.2, refit: bool = True, time_budget: float | None = None,
                 race: bool = True, on_first_model=None, on_lead=None):
        self.estimator, self.param_grid, self.strategy, self.scoring = estimator, param_grid, strategy, scoring
        self.max_extensions, self.screen, self.screen_repeats = max_extensions, screen, screen_repeats
        self.screen_finalist, self.screen_fraction, self.n_jobs = screen_finalist, screen_fraction, n_jobs
        self.validation_fraction, self.refit, self.time_budget = validation_fraction, refit, time_budget
        self.race, self.on_first_model, self.on_lead = race, on_first_model, on_lead

    def _holds_out_itself(self) -> bool:
        return "validation_fraction" in self.estimator.get_params(deep=False)

    def _validated(self) -> dict[str, list]:
        if self.strategy not in _STRATEGIES:
            raise ValueError(f"strategy must be one of {', '.join(map(repr, _STRATEGIES))}, but is {self.strategy!r}")
        scorings = _OWN_SCORINGS if self._holds_out_itself() else _SCORINGS[:-1]
        if self.scoring not in scorings:
            raise ValueError(f"scoring must be one of {', '.join(map(repr, scorings))}, but is {self.scoring!r}")
        if self.time_budget is not None and (isinstance(self.time_budget, bool) or not isinstance(
                self.time_budget, numbers.Real) or not self.time_budget > 0 or not math.isfinite(self.time_budget)):
            raise ValueError(f"time_budget must be a positive number of seconds, but is {self.time_budget!r}")
        if not isinstance(self.param_grid, dict) or not self.param_grid:
            raise ValueError("param_grid must be a non-empty dict of parameter name to a list of values")
        known = set(self.estimator.get_params(deep=False))
        grid = {}
        for name, values in self.param_grid.items():
            if name not in known:
                raise ValueError(f"unknown parameter {name!r} in param_grid; parameters are {', '.join(sorted(known))}")
            values = list(values) if isinstance(values, (list, tuple)) else [values]
            if not values:
                raise ValueError(f"param_grid[{name!r}] has no values")
            grid[name] = values
        if self.n_jobs is not None and (isinstance(self.n_jobs, bool) or not isinstance(self.n_jobs, int)
                                        or self.n_jobs < 1):
            raise ValueError(f"n_jobs must be a positive integer or None, but is {self.n_jobs!r}")
        if isinstance(self.max_extensions, bool) or not isinstance(self.max_extensions, int) or self.max_extensions < 0:
            raise ValueError(f"max_extensions must be an integer >= 0, but is {self.max_extensions!r}")
        if self._holds_out_itself() and not self.estimator.get_params(deep=False).get("validation_fraction"):
            raise ValueError("the estimator holds out no rows (validation_fraction=0): nothing to choose by")
        if not self._holds_out_itself() and not 0 < self.validation_fraction < 1:
            raise ValueError(f"validation_fraction must be between 0 and 1, but is {self.validation_fraction!r}")
        if self.screen_fraction is not None and (
                not self._holds_out_itself() or isinstance(self.screen_fraction, bool)
                or not isinstance(self.screen_fraction, numbers.Real) or not 0 < self.screen_fraction < 1):
            raise ValueError(f"screen_fraction must be between 0 and 1 for an estimator that holds out rows itself "
                             f"(validation_fraction), but is {self.screen_fraction!r}")
        if self.screen is not None:
            if not isinstance(self.screen, dict) or set(self.screen) - known:
                raise ValueError(f"screen must be a dict of the estimator's parameters to cheap values, but is "
                                 f"{self.screen!r}")
        return grid

    def _effective(self, setting: dict) -> dict:
        """``setting`` without the parameters that the rest of the estimator's parameters make irrelevant."""
        conditions = getattr(self.estimator, "conditional_params", {})
        params = {**self.estimator.get_params(deep=False), **setting}
        return {name: value for name, value in setting.items()
                if name not in conditions or params[conditions[name][0]] in conditions[name][1]}

    def _coordinates(self, grid: dict) -> list[tuple[str, list[dict]]]:
        """The coordinate steps: each parameter's candidate values, with its conditional parameters.

        A step is a parameter and a list of partial settings to try: its values, each crossed with
        the values of the parameters that depend on it and that this value makes relevant.
        """
        conditions = getattr(self.estimator, "conditional_params", {})
        steps = []
        for name, values in grid.items():
            if conditions.get(name, (None,))[0] in grid:
                continue  # searched together with the parameter it depends on
            children = [child for child in grid if conditions.get(child, (None,))[0] == name]
            options = []
            for value in values:
                enabled = [child for child in children if value in conditions[child][1]]
                for combo in itertools.product(*(grid[child] for child in enabled)):
                    options.append({name: value, **dict(zip(enabled, combo))})
            steps.append((name, options))
        return steps

    def _extensions(self, values: list, scores: list, bounds: tuple):
        """Values past the better end of a numeric grid of distinct values (in increasing order, whatever the order
        they are tried in), one at a time, while they win.

        A generator fed by the caller, who appends each yielded value's score to ``scores``: it goes
        on while the newest value is the best so far. Integer grids step to integers; a step is
        clipped to ``bounds`` and ends there.
        """
        numeric = all(isinstance(v, numbers.Real) and not isinstance(v, bool) and v > 0 for v in values)
        if self.max_extensions == 0 or len(values) < 2 or not numeric or len(set(values)) != len(values):
            return
        ordered = sorted(values)
        best = ordered.index(values[int(np.argmax(scores))])
        if best not in (0, len(values) - 1):
            return
        up = best == len(values) - 1
        edge, ratio = (ordered[-1], ordered[-1] / ordered[-2]) if up else (ordered[0], ordered[0] / ordered[1])
        integer = all(isinstance(v, numbers.Integral) for v in values)
        low, high = bounds
        for _ in range(self.max_extensions):
            value = edge * ratio
            value = (math.ceil(value) if up else math.floor(value)) if integer else float(f"{value:.3g}")
            value = min(max(value, low), high)
            if value == edge or (integer and value < 1):
                return
            yield value
            if int(np.argmax(scores)) != len(scores) - 1:
                return
            edge = value

    def _prepare(self, setting: dict, overrides: dict | None):
        """The candidate ``setting`` (with ``overrides`` on top, when screening): its effective setting, its key,
        the parameters of its fits (one per repeat), and whether the screener's statistics score it."""
        overrides = overrides or {}
        setting = self._effective({**setting, **overrides})
        key = tuple(sorted((name, repr(value)) for name, value in setting.items())) + (bool(overrides),)
        params = {**self.estimator.get_params(deep=False), **setting}
        if overrides and self.screen_fraction is not None:
            params["validation_fraction"] = self.screen_fraction
        # a screened setting is judged on more held-out rows: fitted on other random splits too
        repeats = [params] + [{**params, "random_state": int(np.random.SeedSequence(
            [_seed(params.get("random_state")), i]).generate_state(1)[0])}
            for i in range(1, self.screen_repeats if overrides else 1)]
        by_statistics = bool(overrides) and self._screener is not None and self._screener.applies(params)
        return setting, key, repeats, by_statistics

    def _races(self) -> bool:
        """Whether the full fits race (:class:`_Race`): an estimator scored by its own held-out figures whose fit
        takes a ``callback`` between its epochs."""
        return (self.race and self._holds_out_itself() and self.scoring in _OWN_SCORINGS
                and "callback" in inspect.signature(type(self.estimator).fit).parameters)

    def _history_score(self, history: list[dict]) -> float:
        """The score of the decoder a fit keeps after the epochs of ``history``."""
        return self._score(kept_entry(history, self.estimator.get_params(deep=False).get("early_stopping", "loss")))

    def _fits(self, repeats: list[dict], X, Y, race: tuple | None = None) -> tuple[object, list[dict], float]:
        """Fit every repeat: the first one's model, the held-out figures of each, and the seconds it took
        (``race``: the key of a full fit, which races the others)."""
        start = time.perf_counter()
        fitted = [self._fit_scored(repeat, X, Y, race) for repeat in repeats]
        return fitted[0][0], [figures for _, figures in fitted], time.perf_counter() - start

    def _fit_scored(self, params: dict, X, Y, race: tuple | None = None) -> tuple[object, dict]:
        """A candidate fitted on the rows it may see, and its held-out figures (an estimator that takes a
        ``time_budget`` gets the search's time left; ``race``: its key in the race of the full fits)."""
        model = type(self.estimator)(**self._with_time_left(params))
        if self._screener is not None and hasattr(self._screener, "offer"):
            self._screener.offer(params)  # what the fit would first compute from the data, from the screen's statistics
        if self._split is None:
            if race is None or self._race is None:
                model.fit(X, Y)
            else:
                on_lead = (lambda: self.on_lead(model)) if self.on_lead is not None else None
                try:
                    model.fit(X, Y, callback=self._race.callback(race, on_lead))
                finally:
                    self._race.finish(race, getattr(model, "history_", None))
            return model, kept_epoch(model)
        model.fit(*self._split["fit"])
        return model, self._held_out_figures(model)

    def _with_time_left(self, params: dict) -> dict:
        if self.time_budget is None or "time_budget" not in params:
            return params
        left = self.time_budget - (time.perf_counter() - self._start) - self.reserve_
        return {**params, "time_budget": max(left, 1e-3)}

    def _held_out_figures(self, model) -> dict:
        """P@1, P@3, P@5 of ``model`` on the rows the search holds out (``val_p@k``)."""
        from . import metrics

        Xv, Yv = self._split["held"][:2]
        k = min(5, int(Yv.shape[1]))
        labels, _ = model.predict_topk(Xv, k=k)
        labels, truth = dask.compute(labels, Yv)
        return {f"val_p@{j}": metrics.precision_at_k(truth, labels, k=j) for j in (1, 3, 5) if j <= k}

    def _fit_many(self, settings: list[dict], X, Y, overrides: dict | None = None) -> list[float]:
        """The held-out score of each setting (:meth:`_fit_one`); the fits not yet made run in up to ``n_jobs``
        threads, and are recorded in the order of ``settings`` (the same results as one at a time)."""
        fits = {}
        racing = self._race is not None and not overrides
        if overrides and self._screener is not None and self.time_budget is None:
            # the settings the screener scores (other input normalisations, say) from statistics of one pass, their
            # tasks side by side (with a time budget, one setting at a time: each pass timed and paid as it comes)
            prepared = {key: repeats for _, key, repeats, by_statistics in
                        (self._prepare(setting, overrides) for setting in settings)
                        if by_statistics and key not in self._done}
            if len(prepared) > 1:
                start = time.perf_counter()
                self._screener.prepare([r for repeats in prepared.values() for r in repeats])
                share = (time.perf_counter() - start) / len(prepared)
                self._prepared.update(dict.fromkeys(prepared, share))  # each setting's share of the pass's time
        if racing or (self.n_jobs and self.n_jobs > 1):
            todo = {}
            for setting in settings:
                effective, key, repeats, by_statistics = self._prepare(setting, overrides)
                if key not in self._done and not by_statistics:
                    todo.setdefault(key, repeats)
                    self._names[key] = effective
            # with a time budget, fits of a kind run at once only when one of that kind was timed
            timed = self.time_budget is None or bool(self._fit_seconds[bool(overrides)])
            costliest = max(todo.values(), key=lambda repeats: self._cost(repeats[0]), default=[{}])[0]
            if len(todo) > 1 and timed and not self._over_budget(math.ceil(len(todo) / (self.n_jobs or 1)),
                                                                 screened=bool(overrides), params=costliest):
                if racing:  # the step's fits wait for each other's warm start, in threads of their own
                    self._race.together(list(todo))
                fits = dict(zip(todo, thread_map(lambda item: self._fits(item[1], X, Y, item[0] if racing else None),
                                                 list(todo.items()), self.n_jobs, at_once=racing)))
        return [self._fit_one(setting, X, Y, overrides, fits)[0] for setting in settings]

    def _score(self, figures: dict) -> float:
        return -float(figures["val_loss"]) if self.scoring == "loss" else float(figures[f"val_{self.scoring}"])

    def _fit_one(self, setting: dict, X, Y, overrides: dict | None = None,
                 fits: dict | None = None) -> tuple[float, object]:
        """Fit ``setting`` (with ``overrides`` on top, when screening), or take its fit from ``fits``; the held-out
        score and the model."""
        setting, key, repeats, by_statistics = self._prepare(setting, overrides)
        if key in self._done:
            return self._done[key]
        if key not in (fits or {}) and self._over_budget(screened=bool(overrides), params=repeats[0]):
            self.skipped_.append({"params": dict(setting), "screened": bool(overrides)})
            logger.info("held-out search: %s not fitted, the time budget of %g s would be spent", setting,
                        self.time_budget)
            self._done[key] = (-math.inf, None)
            return self._done[key]
        held = self.time_budget is not None and self._screener_holds(repeats)  # what a budget's estimates need
        if by_statistics:
            start = time.perf_counter()
            self._screener.prepare(repeats)  # the repeats' held-out rows in one pass
            model, kept = None, [self._screener.score(repeat, loss=self.scoring == "loss") for repeat in repeats]
            seconds = time.perf_counter() - start + self._prepared.pop(key, 0.0)
        else:
            self._names[key] = setting
            model, kept, seconds = (fits or {}).get(key) or self._fits(repeats, X, Y, None if overrides else key)
        figures = {key: float(np.mean([k[key] for k in kept])) for key in kept[0] if key in _FIGURES}
        score = self._score(figures)
        self._first[key] = self._score(kept[0])  # on the rows a full fit holds out (the template's seed)
        self.results_.append({"params": dict(setting), "score": score, **figures,
                              "seconds": round(seconds, 3), "screened": bool(overrides)})
        logger.info("held-out search%s: %s -> %s %.4f (%.1f s%s)", " (screening)" if overrides else "", setting,
                    self.scoring, abs(score), self.results_[-1]["seconds"], self._budget_used())
        self._fit_seconds[bool(overrides)].append(self._priced(seconds, model, overrides, len(repeats))
                                                  / self._cost(repeats[0]))
        if overrides:
            self._screen_seconds[held].append(seconds)
            if by_statistics and not held:  # its solve alone: what a setting on the statistics it made costs
                self._screen_seconds[True].append(sum(k.get("solve_seconds", seconds) for k in kept))
        if not overrides and self._best is None:
            self._check_first_model(setting)
        if not overrides and model is not None and callable(getattr(model, "at_warm_start", None)):
            warm = model.at_warm_start(release=True)  # its ridge decoder: the screened setting, should it win
            if warm is not None:
                self._warm[_params_key(warm.get_params(deep=False))] = warm
        # keep only the best fitted model in memory (a screened fit is never the one kept)
        if not overrides and (self._best is None or score > self._best[0]):
            first = self._best is None
            self._best, self.best_fit_seconds_ = (score, model, dict(setting)), seconds / len(repeats)
            if first:
                self._first_model_made(model)
        self._done[key] = (score, None)
        return score, model

    def _priced(self, seconds: float, model, overrides: dict | None, n_repeats: int) -> float:
        """What a budget expects a fit like this one to take: with a time budget, a full fit whose decoder epochs stop
        at the budget is priced by its warm start and first epoch (``history_``; the later epochs are what the
        budget cuts), else its ``seconds``."""
        history = getattr(model, "history_", None) if self.time_budget is not None and not overrides else None
        if history and len(history) > 1 and history[1].get("seconds", 0) > 0:
            return min(seconds, float(history[1]["seconds"]) * n_repeats)
        return seconds

    def _cost(self, params: dict) -> float:
        """The relative cost of fitting ``params`` (the estimator's ``relative_cost``, e.g. the width of the embedding
        classifier's decoder; 1 for an estimator without one)."""
        cost = getattr(self.estimator, "relative_cost", None)
        return max(float(cost(params)), 1e-9) if cost is not None and params else 1.0

    def _over_budget(self, n_fits: int = 1, *, screened: bool = False, params: dict | None = None) -> bool:
        """Whether ``n_fits`` more fits of ``params`` (``screened`` or full: at the highest time per unit of
        :meth:`_cost` of the fits of its kind so far, else of the other kind), and the refit, would end past the time
        budget; never before the first fit, nor before the first full fit (a model is always made)."""
        if self.time_budget is None or (not screened and self._best is None):
            return False
        rates = self._fit_seconds[screened] or self._fit_seconds[not screened]
        if not rates:
            return False
        full = self._fit_seconds[False] or rates
        cost = self._cost(params or {})
        refit = max(full) * cost / (1 - self.validation_fraction) if self._split is not None and self.refit else 0.0
        each = max(rates) * cost
        if screened and (self._screen_seconds[False] or self._screen_seconds[True]):
            # a screened setting costs what the screened ones of its kind cost so far, whatever its cost units: the
            # screen's fits all solve on the linear map, and what they cost is their passes and solves (a smaller
            # embedding needs a decomposition that the identity does not), not the width of their decoders; of
            # its kind: whether the screener holds its statistics already (a solve) or must make them (a pass)
            held = self._screener_holds([params or {}])
            each = max(self._screen_seconds[held] or self._screen_seconds[not held])
            # and the screen leaves the time of one more first model: its best, fitted as screened, may replace it
            refit += self._first_model_seconds
        return time.perf_counter() - self._start + n_fits * each + refit + self.reserve_ > self.time_budget

    def _screener_holds(self, repeats: list[dict]) -> bool:
        """Whether the screener holds the statistics of every repeat of a screened setting (its score a solve)."""
        screener = getattr(self, "_screener", None)
        return screener is not None and all(screener.applies(r) and screener.holds(r) for r in repeats)

    def _budget_used(self) -> str:
        if self.time_budget is None:
            return ""
        return f"; {time.perf_counter() - self._start:.1f} s of the {self.time_budget:g} s budget"

    def _check_first_model(self, setting: dict) -> None:
        """Refuse a time budget that was spent before the first model (full fit) was made, naming when it was."""
        elapsed = time.perf_counter() - self._start
        if self.time_budget is not None and elapsed > self.time_budget:
            raise BudgetError(f"a time budget of {self.time_budget:g} s is shorter than one fit: the first model "
                              f"({setting}) was ready after {elapsed:.1f} s; give at least {math.ceil(elapsed * 1.5)} "
                              "s, or no budget")

    def _first_model_made(self, model) -> None:
        """Hand the first model to ``on_first_model`` (with a time budget), its seconds kept as ``reserve_``."""
        if self.on_first_model is None or self.time_budget is None or model is None:
            return
        start = time.perf_counter()
        self.on_first_model(model)
        self.reserve_ = time.perf_counter() - start

    def fit(self, X, Y, observed=None, *, started: float | None = None) -> HeldOutSearch:
        """Fit the candidates on ``X``, ``Y`` (row blocks, as for the estimator; ``observed``: the observed-entry
        mask of an estimator that takes one) and keep the best. ``started``: when the ``time_budget`` began
        (a ``time.perf_counter()`` value; default: now).

        Returns
        -------
        HeldOutSearch
            ``self``, with ``best_estimator_``, ``best_params_``, ``best_score_``, ``results_``.
        """
        grid = self._validated()
        self._start = time.perf_counter() if started is None else started
        self._fit_seconds, self._screen_seconds, self.skipped_ = {True: [], False: []}, {True: [], False: []}, []
        self._first_model_seconds, self.reserve_ = 0.0, 0.0
        self.results_, self._done, self._first, self._best, self._warm = [], {}, {}, None, {}
        self._split, self._names, self._prepared = None, {}, {}
        self._race = _Race(self._history_score, self._names) if self._races() else None
        if not self._holds_out_itself():
            split = HeldOut(_seed(self.estimator.get_params(deep=False).get("random_state")),
                            float(self.validation_fraction), tuple(int(c) for c in X.chunks[0]))
            arrays = (X, Y) if observed is None else (X, Y, observed)
            self._split = {part: tuple(split.rows(A, held=held) for A in arrays)
                           for part, held in (("fit", False), ("held", True))}
            if split.n_train() == 0 or split.n_train() == X.shape[0]:
                raise ValueError(f"holding out {self.validation_fraction:g} of {X.shape[0]} rows leaves no rows to "
                                 "fit or none to score: the search needs more rows")
        elif observed is not None:
            raise ValueError(f"{type(self.estimator).__name__} takes no observed-entry mask")
        screen = dict(self.screen or {})
        # screened settings from statistics every candidate shares, where the estimator offers it
        self._screener = self.estimator.screener(X, Y) if screen and hasattr(self.estimator, "screener") else None
        # the parameters searched under the screen's overrides, then those searched by full fits
        cheap = {name: values for name, values in grid.items() if name not in screen}
        full = {name: values for name, values in grid.items() if name in screen}
        if not screen:
            self._search(cheap, X, Y)
        else:
            conditions = getattr(self.estimator, "conditional_params", {})
            # a conditional parameter follows the parameter it depends on into the full fits
            full.update({name: values for name, values in list(cheap.items())
                         if conditions.get(name, (None,))[0] in full})
            cheap = {name: values for name, values in cheap.items() if name not in full}
            # with a time budget a first guess (:meth:`_first_guess`), as screened, is fitted in full first: a model
            # in one fit (a screened setting then a model of it took two); the screen's best, as screened, replaces
            # it if it scores higher, and the full fits follow while the budget lasts, each kept if it beats them
            finalist_first = self.screen_finalist and cheap and self.time_budget is not None
            if finalist_first:
                self._budget_first_model(cheap, full, screen, X, Y)
            best = self._search(cheap, X, Y, overrides=screen) if cheap else {}
            if finalist_first:
                self._screened_finalist(best, screen, X, Y)
            self._search(full or {}, X, Y, start=best)
            if self.screen_finalist and cheap and not finalist_first:
                self._screened_finalist(best, screen, X, Y)
        score, model, setting = self._best
        if self._split is not None and self.refit:
            start = time.perf_counter()
            model = type(self.estimator)(**self._with_time_left({**self.estimator.get_params(deep=False), **setting}))
            model.fit(X, Y) if observed is None else model.fit(X, Y, observed)
            self.best_fit_seconds_ = time.perf_counter() - start
            logger.info("held-out search: %s refitted on all %d rows (%.1f s%s)", setting, X.shape[0],
                        time.perf_counter() - start, self._budget_used())
        self.best_score_, self.best_estimator_, self.best_params_ = score, model, setting
        self.seconds_ = time.perf_counter() - self._start
        del self._done, self._first, self._best, self._screener, self._split, self._warm, self._screen_seconds
        del self._first_model_seconds, self._race, self._names, self._prepared
        return self

    def _first_guess(self, grid: dict, overrides: dict | None = None) -> dict:
        """The setting a time budget's first model takes before anything is scored (fitted with ``overrides``):
        each numeric parameter whose values all cost alike (:meth:`_cost`) at the middle of its values (the upper
        middle of an even number; a ridge's held-out score is one-peaked in its strength, and the middle is the
        fewest grid steps from the peak wherever it lies, where the first value is the most), any other parameter
        at its first value."""
        first = {name: values[0] for name, values in grid.items()}
        guess = dict(first)
        for name, values in grid.items():
            if not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in values):
                continue
            if len({self._cost({**first, **(overrides or {}), name: v}) for v in values}) == 1:
                guess[name] = sorted(values)[len(values) // 2]
        return guess

    def _budget_first_model(self, cheap: dict, full: dict, screen: dict, X, Y) -> None:
        """A time budget's first model: the first guess (:meth:`_first_guess`) fitted in full where the screen's
        overrides only leave out the template's decoder epochs (the full fits' first values otherwise, the screen's
        feature map): its epochs, cut by the budget, start from the ridge decoder that the screened guess would be
        (kept where no epoch beats it on the held-out rows, and offered to the screen as that setting's fit), so
        that a budget that holds a fit and a few epochs gets both. Elsewhere the guess as screened."""
        guess = self._first_guess(cheap, screen)
        template = self.estimator.get_params(deep=False)
        setting = {**guess, **{name: values[0] for name, values in full.items()}}
        epochs_only = {name: value for name, value in screen.items()
                       if {**template, **setting}.get(name) != value} == {"max_epochs": 0}
        if not epochs_only or not template.get("max_epochs"):
            self._screened_finalist(guess, screen, X, Y)
            return
        _, model = self._fit_one(setting, X, Y)
        if model is None or not getattr(model, "history_", None):
            return
        # the ridge decoder's time, a screened setting's cost (the whole fit's where the warm start is not timed)
        warm = float(model.history_[0].get("seconds", 0.0)) or self.results_[-1]["seconds"]
        _, _, repeats, _ = self._prepare(guess, screen)
        self._first_model_seconds = warm
        self._fit_seconds[True].append(warm / self._cost(repeats[0]))
        self._screen_seconds[False].append(warm * len(repeats))

    def _screened_finalist(self, setting: dict, overrides: dict, X, Y) -> None:
        """Keep the best screened ``setting`` as screened (``overrides`` on top), fitted in full, if on the full
        fits' held-out rows it scores higher than the best of them (or if there is no full fit yet)."""
        setting, key, repeats, _ = self._prepare(setting, overrides)
        if self._best is not None and self._best[2] == setting:  # the first model already (a time budget's)
            return
        # as screened, holding out the rows the full fits hold out
        params = {**repeats[0], "validation_fraction": self.estimator.get_params(deep=False)["validation_fraction"]}
        full, model, start = self._best[0] if self._best else -math.inf, None, time.perf_counter()
        # a full fit of this setting with decoder epochs started from this very model (at_warm_start)
        warm = self._warm.get(_params_key(params))
        if self._best is not None and (key not in self._first or (params != repeats[0] and warm is None)) and \
                self._over_budget(screened=True, params=repeats[0]):
            return  # the budget cut its screen (recorded as skipped), or scoring it again would spend what is left
        if self._best is not None:
            if params == repeats[0]:
                score = self._first.get(key, -math.inf)
            elif warm is None and self._screener is not None and self._screener.applies(params):
                # the same figure as a warm start's, but a solve
                score = self._score(self._screener.score(params, loss=self.scoring == "loss"))
            else:
                model = warm or type(self.estimator)(**params).fit(X, Y)
                score = held_out_score(model, self.scoring)
            if score <= full:
                return
        model = model or warm or type(self.estimator)(**params).fit(X, Y)
        self._best = (held_out_score(model, self.scoring), model, dict(setting))
        # taken from a full fit: the seconds that fit took to its warm start
        self.best_fit_seconds_ = model.history_[0]["seconds"] if model is warm else time.perf_counter() - start
        if full > -math.inf:
            how = ("the ridge decoder of its full fit with epochs" if model is warm
                   else f"fitted in {time.perf_counter() - start:.1f} s")
            logger.info("held-out search: the screened %s beats the full fits (%s %.4f against %.4f; %s)", setting,
                        self.scoring, abs(score), abs(full), how)
        else:
            seconds = time.perf_counter() - start
            logger.info("held-out search: the screened %s fitted as the first model (%s %.4f; %.1f s%s)", setting,
                        self.scoring, abs(self._best[0]), seconds, self._budget_used())
            self._check_first_model(setting)
            self._first_model_made(model)
            if model is not warm:  # a screened setting's fits: what the budget expects a screened setting to cost
                self._fit_seconds[True].append(seconds / self._cost(params))
                self._screen_seconds[False].append(seconds * len(repeats))
                self._first_model_seconds = seconds

    def _search(self, grid: dict, X, Y, *, overrides: dict | None = None, start: dict | None = None) -> dict:
        """Search ``grid`` from the setting ``start`` (fitted with ``overrides``); the best setting found."""
        start = dict(start or {})
        if not grid:
            self._fit_one(start, X, Y, overrides)
            return start
        if self.strategy == "grid":
            settings = [{**start, **dict(zip(grid, values))} for values in itertools.product(*grid.values())]
            scores = self._fit_many(settings, X, Y, overrides)
            return settings[int(np.argmax(scores))]
        current = {**start, **{name: values[0] for name, values in grid.items()}}
        bounds = self.estimator.search_bounds(X, Y) if hasattr(self.estimator, "search_bounds") else {}
        for name, options in self._coordinates(grid):
            scores = self._fit_many([{**current, **option} for option in options], X, Y, overrides)
            if all(len(option) == 1 for option in options):  # no conditional parameters: may be extended
                for value in self._extensions(grid[name], scores, bounds.get(name, (0, math.inf))):
                    options.append({name: value})
                    scores.append(self._fit_one({**current, name: value}, X, Y, overrides)[0])
            current.update(options[int(np.argmax(scores))])  # the first of the ties
        return current

    def _check_fitted(self):
        if getattr(self, "best_estimator_", None) is None:
            from .models import NotFittedError

            raise NotFittedError("this HeldOutSearch is not fitted yet; call fit(X, Y) first")
        return self.best_estimator_

    def predict_topk(self, X, k: int = 5):
        """``best_estimator_.predict_topk(X, k)``."""
        return self._check_fitted().predict_topk(X, k)

    def decision_function(self, X):
        """``best_estimator_.decision_function(X)``."""
        return self._check_fitted().decision_function(X)

    def predict(self, X):
        """``best_estimator_.predict(X)``."""
        return self._check_fitted().predict(X)

    def save(self, url: str, *, overwrite: bool = False, meta: dict | None = None) -> str:
        """Save ``best_estimator_`` with the search's :meth:`record` in its ``meta`` (``search``)."""
        return self._check_fitted().save(url, overwrite=overwrite, meta={**(meta or {}), "search": self.record()})

    def record(self) -> dict:
        """The search as JSON: ``strategy``, ``scoring``, ``screen``, ``screen_fraction``, ``best_params``,
        ``best_score``, ``results``, ``time_budget``, ``skipped`` (the settings the budget left unfitted) and
        ``seconds``."""
        self._check_fitted()
        return {"strategy": self.strategy, "scoring": self.scoring, "screen": self.screen,
                "screen_fraction": self.screen_fraction,
                "best_params": self.best_params_, "best_score": self.best_score_, "results": self.results_,
                "time_budget": self.time_budget, "skipped": self.skipped_, "seconds": round(self.seconds_, 3)}
