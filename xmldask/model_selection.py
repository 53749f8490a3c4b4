"""Choose an estimator's parameters on the held-out slice of the training rows.

:class:`HeldOutSearch` fits one :class:`~xmldask.models.EmbeddingClassifier` per candidate setting and
keeps the one whose held-out P@1 (or loss) is best. Every candidate holds out the same rows (the split
is seeded by ``random_state`` and depends only on the row blocks), so the candidates are compared on
the same data, and no test row is ever seen: this is how the benchmarks choose ``k``, the ridge
``alpha`` and the kernel. The chosen estimator is the fitted candidate itself (no refit).

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

import itertools
import logging
import math
import numbers
import time

import numpy as np

from .models import kept_epoch
from .params import parse_grid
from .scheduling import thread_map

__all__ = ["HeldOutSearch", "held_out_score", "kept_epoch", "parse_grid"]

logger = logging.getLogger("xmldask.model_selection")

_SCORINGS = ("p@1", "loss")
_STRATEGIES = ("coordinate", "grid")


def _seed(random_state) -> int:
    return int(random_state) if isinstance(random_state, numbers.Integral) else 0


def held_out_score(estimator, scoring: str = "p@1") -> float:
    """The held-out figure of a fitted estimator's kept decoder (larger is better).

    ``scoring="p@1"`` returns the kept epoch's held-out P@1 (:func:`kept_epoch`), ``"loss"`` minus its
    held-out loss.
    """
    kept = kept_epoch(estimator)
    return float(kept["val_p@1"]) if scoring == "p@1" else -float(kept["val_loss"])


class HeldOutSearch:
    """Pick parameters of an estimator by its held-out score on the training rows.

    Parameters
    ----------
    estimator : EmbeddingClassifier
        The template; candidates are ``clone(estimator).set_params(**setting)``. Needs
        ``validation_fraction > 0``.
    param_grid : dict
        Parameter name to the list of values to try (in order: under ``"coordinate"`` the first
        value of each is where the search starts).
    strategy : {"coordinate", "grid"}, default "coordinate"
    scoring : {"p@1", "loss"}, default "p@1"
        Held-out P@1 (larger is better) or held-out loss (smaller is better) of each candidate's
        kept decoder. Ties keep the earlier candidate.
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
        split), it is kept when it beats them, and then fitted once more, in full.
    screen_repeats : int, default 1
        Fits of every screened setting, each holding out other random rows (seeds drawn from the
        template's ``random_state``); its score is their mean. A held-out slice of a few hundred rows
        is noise: repeats are what make a screen of small data a choice.
    n_jobs : int or None
        Fits of one step (a coordinate's values, or the whole grid) made at once, in threads of this
        process (None: one at a time). The results, and the model kept, are the same either way.
    Attributes
    ----------
    best_estimator_ : the fitted candidate with the best score
    best_params_ : dict
    best_score_ : float
        Its held-out score (P@1, or minus the loss).
    results_ : list of dict
        One per fitted candidate, in fitting order: ``params``, ``score``, ``val_p@1``,
        ``val_loss``, ``seconds``, and ``screened`` (fitted with ``screen``'s overrides).
    """

    def __init__(self, estimator, param_grid: dict, *, strategy: str = "coordinate", scoring: str = "p@1",
                 max_extensions: int = 2, screen: dict | None = None, screen_repeats: int = 1,
                 screen_finalist: bool = False, n_jobs: int | None = None):
        self.estimator, self.param_grid, self.strategy, self.scoring = estimator, param_grid, strategy, scoring
        self.max_extensions, self.screen, self.screen_repeats = max_extensions, screen, screen_repeats
        self.screen_finalist, self.n_jobs = screen_finalist, n_jobs

    def _validated(self) -> dict[str, list]:
        if self.strategy not in _STRATEGIES:
            raise ValueError(f"strategy must be one of {', '.join(map(repr, _STRATEGIES))}, but is {self.strategy!r}")
        if self.scoring not in _SCORINGS:
            raise ValueError(f"scoring must be one of {', '.join(map(repr, _SCORINGS))}, but is {self.scoring!r}")
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
        if not self.estimator.get_params(deep=False).get("validation_fraction"):
            raise ValueError("the estimator holds out no rows (validation_fraction=0): nothing to choose by")
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
        """Values past the better end of an increasing numeric grid, one at a time, while they win.

        A generator fed by the caller, who appends each yielded value's score to ``scores``: it goes
        on while the newest value is the best so far. Integer grids step to integers; a step is
        clipped to ``bounds`` and ends there.
        """
        numeric = all(isinstance(v, numbers.Real) and not isinstance(v, bool) and v > 0 for v in values)
        if self.max_extensions == 0 or len(values) < 2 or not numeric or list(values) != sorted(set(values)):
            return
        best = int(np.argmax(scores))
        if best not in (0, len(values) - 1):
            return
        up = best == len(values) - 1
        edge, ratio = (values[-1], values[-1] / values[-2]) if up else (values[0], values[0] / values[1])
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
        # a screened setting is judged on more held-out rows: fitted on other random splits too
        repeats = [params] + [{**params, "random_state": int(np.random.SeedSequence(
            [_seed(params.get("random_state")), i]).generate_state(1)[0])}
            for i in range(1, self.screen_repeats if overrides else 1)]
        by_statistics = bool(overrides) and self._screener is not None and self._screener.applies(params)
        return setting, key, repeats, by_statistics

    def _fits(self, repeats: list[dict], X, Y) -> tuple[object, list[dict], float]:
        """Fit every repeat: the first one's model, the kept epoch of each, and the seconds it took."""
        start = time.perf_counter()
        model = type(self.estimator)(**repeats[0]).fit(X, Y)
        kept = [kept_epoch(model)] + [kept_epoch(type(self.estimator)(**repeat).fit(X, Y)) for repeat in repeats[1:]]
        return model, kept, time.perf_counter() - start

    def _fit_many(self, settings: list[dict], X, Y, overrides: dict | None = None) -> list[float]:
        """The held-out score of each setting (:meth:`_fit_one`); the fits not yet made run in up to ``n_jobs``
        threads, and are recorded in the order of ``settings`` (the same results as one at a time)."""
        fits = {}
        if self.n_jobs and self.n_jobs > 1:
            todo = {}
            for setting in settings:
                _, key, repeats, by_statistics = self._prepare(setting, overrides)
                if key not in self._done and not by_statistics:
                    todo.setdefault(key, repeats)
            if len(todo) > 1:
                fits = dict(zip(todo, thread_map(lambda repeats: self._fits(repeats, X, Y), list(todo.values()),
                                                 self.n_jobs)))
        return [self._fit_one(setting, X, Y, overrides, fits)[0] for setting in settings]

    def _score(self, figures: dict) -> float:
        return float(figures["val_p@1"]) if self.scoring == "p@1" else -float(figures["val_loss"])

    def _fit_one(self, setting: dict, X, Y, overrides: dict | None = None,
                 fits: dict | None = None) -> tuple[float, object]:
        """Fit ``setting`` (with ``overrides`` on top, when screening), or take its fit from ``fits``; the held-out
        score and the model."""
        setting, key, repeats, by_statistics = self._prepare(setting, overrides)
        if key in self._done:
            return self._done[key]
        if by_statistics:
            start = time.perf_counter()
            model, kept = None, [self._screener.score(repeat) for repeat in repeats]
            seconds = time.perf_counter() - start
        else:
            model, kept, seconds = (fits or {}).get(key) or self._fits(repeats, X, Y)
        figures = {key: float(np.mean([k[key] for k in kept])) for key in ("val_p@1", "val_loss")}
        score = self._score(figures)
        self._first[key] = self._score(kept[0])  # on the rows a full fit holds out (the template's seed)
        self.results_.append({"params": dict(setting), "score": score, **figures,
                              "seconds": round(seconds, 3), "screened": bool(overrides)})
        logger.info("held-out search%s: %s -> %s %.4f (%.1f s)", " (screening)" if overrides else "", setting,
                    self.scoring, abs(score), self.results_[-1]["seconds"])
        # keep only the best fitted model in memory (a screened fit is never the one kept)
        if not overrides and (self._best is None or score > self._best[0]):
            self._best = (score, model, dict(setting))
        self._done[key] = (score, None)
        return score, model

    def fit(self, X, Y) -> HeldOutSearch:
        """Fit the candidates on ``X``, ``Y`` (row blocks, as for the estimator) and keep the best.

        Returns
        -------
        HeldOutSearch
            ``self``, with ``best_estimator_``, ``best_params_``, ``best_score_``, ``results_``.
        """
        grid = self._validated()
        self.results_, self._done, self._first, self._best = [], {}, {}, None
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
            best = self._search(cheap, X, Y, overrides=screen) if cheap else {}
            self._search(full or {}, X, Y, start=best)
            if self.screen_finalist and cheap:
                self._screened_finalist(best, screen, X, Y)
        score, model, setting = self._best
        self.best_score_, self.best_estimator_, self.best_params_ = score, model, setting
        del self._done, self._first, self._best, self._screener
        return self

    def _screened_finalist(self, setting: dict, overrides: dict, X, Y) -> None:
        """Keep the best screened ``setting`` as screened (``overrides`` on top), fitted in full, if on the full
        fits' held-out rows it scores higher than the best of them."""
        setting, key, repeats, _ = self._prepare(setting, overrides)
        score, full = self._first[key], self._best[0]
        if score <= full:
            return
        start = time.perf_counter()
        model = type(self.estimator)(**repeats[0]).fit(X, Y)
        self._best = (held_out_score(model, self.scoring), model, dict(setting))
        logger.info("held-out search: the screened %s beats the full fits (%s %.4f against %.4f; fitted in %.1f s)",
                    setting, self.scoring, abs(score), abs(full), time.perf_counter() - start)

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
        """The search as JSON: ``strategy``, ``scoring``, ``screen``, ``best_params``, ``best_score``, ``results``."""
        self._check_fitted()
        return {"strategy": self.strategy, "scoring": self.scoring, "screen": self.screen,
                "best_params": self.best_params_, "best_score": self.best_score_, "results": self.results_}
