"""Multiclass gradient boosting of oblivious trees over row blocks: GradFac and its baselines.

Four ways to grow the trees of a round from the residuals ``R = Y - P`` (``n x K``, the negative
gradient of the log-loss in the scores):

- :class:`GradFac` (``--model gradfac``): factorise ``R ~ u v^T`` by its top singular pair (``v``
  unit, the scale in ``u``: the exact eigenvector of ``R^T R``, or power steps warm-started from the
  last round's ``v`` when ``K`` is large), fit **one** tree to ``u`` and add ``lr * u(x) v^T``. A
  round costs the same for any number of classes.
- :class:`GradFacEN` (``--model gfen``): the same with the Elastic-Net factorisation of eq. (6),
  solved by alternating exact soft-threshold steps from the GradFac solution.
- :class:`MultinomialBoosting` (``--model mll``): Friedman's multinomial logistic boosting, one tree
  per class per round (the paper's MLL; ``K`` trees a round).
- :class:`OneVsRestBoosting` (``--model ovr``): ``K`` independent binary logistic boostings (one tree
  per class per round).

Every tree is an oblivious tree of depth ``max_depth`` on features binned once (quantile borders from a
sample of every block, one pass). A level is one pass over the row blocks: each block adds the
histograms of its targets and rows per (leaf, feature, bin); the level's (feature, border) is chosen in
memory from their sum. No tree is grown from a whole matrix in one process. The scores of the
training rows are the only state carried between rounds (``n x K`` float32, row blocks), updated by a
pass per round. Rows held out for early stopping (``validation_fraction``) get the same updates and
give the held-out loss that decides when to stop and which round to keep.

The state lives in this process when ``X`` is in memory, and as persisted Dask arrays of row blocks
(spilled to disk by the workers when they exceed their memory) when ``X`` is a Dask array, e.g. a
dataset store's; both run the same kernels (:mod:`._boost_kernels`) and give the same model.

Conventions: the symmetric softmax over all ``K`` scores (the paper's MLL spends ``K`` trees a round,
not ``K - 1``); scores start at 0; a leaf's value is ``sum(target) / (count + l2_leaf_reg)``, times the
learning rate.

References
----------
"Using Matrix Factorization Methods for Multiclass Classification Tasks" (anonymous ICML submission):
eqs. (3)-(6), Algorithm 1, Table 2. Friedman, J. H. "Greedy function approximation: a gradient boosting
machine" (2001). Oblivious trees as in CatBoost (Prokhorenkova et al. 2018).
"""

from __future__ import annotations

import itertools
import logging
import math
import time
import uuid
from typing import Annotated, Literal

import dask
import dask.array as da
import numpy as np
import scipy.sparse as sp
import zarr
from pydantic import Field

from ..base import BudgetError, NotFittedError, ParamsMixin, as_rows, check_float, check_int, seed_of
from ..linalg import dense_operand
from ..linalg.passes import ROWS, WHOLE, block_sum, per_block, per_block_objects
from ..params import FamilyParams
from ..store import remove, zarr_store
from ..store.models import SavedModel
from . import _boost_kernels as BK

__all__ = ["BOOSTING_VERSION", "BoostingParams", "GradFac", "GradFacEN", "MultinomialBoosting", "OneVsRestBoosting"]

logger = logging.getLogger("xmldask.models")

#: version of the saved-model layout of the boosting models
BOOSTING_VERSION = 1
#: largest histogram of a pass (bytes): the trees of a round are grown in groups that fit it
HISTOGRAM_BYTES = 256 << 20
#: rows of the quantile sample of the binning pass, over all blocks
SAMPLE_ROWS = 200_000
#: ``K`` up to which GradFac takes the exact eigenvector of ``R^T R`` (``K x K`` per block)
EXACT_GRAM_CLASSES = 128
#: ``backend="auto"``: boosting state (bins, scores, targets: about ``n (d + 12 K)`` bytes) up to which a
#: Dask array is boosted in this process, a pass costing no scheduling (on a local cluster a pass of
#: letter costs ~30 ms scheduled, ~2 ms in process); larger state stays in row blocks on the workers
LOCAL_STATE_BYTES = 256 << 20
#: trees whose scores are formed at once at prediction
PREDICT_TREES = 512


class BoostingParams(FamilyParams):
    """``xmldask train --model gradfac|gfen|mll|ovr``: multiclass boosting of oblivious trees (:class:`GradFac`,
    :class:`GradFacEN`, :class:`MultinomialBoosting`, :class:`OneVsRestBoosting`); the depth chosen and the rounds
    early-stopped on held-out rows unless given."""

    model: Literal["gradfac", "gfen", "mll", "ovr"] = "gradfac"
    rounds: Annotated[int, Field(gt=0)] = Field(
        1000, description="boosting: rounds at most (early-stopped on held-out training rows); a round grows 1 tree "
                          "(gradfac, gfen) or one per class")
    learning_rate: Annotated[float, Field(gt=0)] = Field(0.3, description="boosting: shrinkage of every tree")
    max_depth: Annotated[int, Field(ge=1, le=16)] = Field(6, description="boosting: depth of the oblivious trees")


_BOOSTING = BoostingParams()

_tokens = itertools.count()


# --------------------------------------------------------------------------------------------
# the row blocks of the boosting state: in this process, or as Dask arrays


class _LocalRows:
    """The state as one dict of NumPy arrays per row block, in this process."""

    def __init__(self, blocks: list[dict]):
        self.blocks = blocks
        self.n_passes = 0

    def reduce(self, kernel, names: tuple, size: int, static: dict | None = None, **whole) -> np.ndarray:
        self.n_passes += 1
        out = np.zeros(size)
        for block in self.blocks:
            out += kernel(**{n: block[n] for n in names}, **whole, **(static or {}))
        return out

    def close(self) -> None:
        pass

    def update(self, name: str, kernel, names: tuple, cols: int, dtype, static: dict | None = None, **whole):
        self.n_passes += 1
        for block in self.blocks:
            block[name] = kernel(**{n: block[n] for n in names}, **whole, **(static or {}))


class _DaskRows:
    """The state as Dask arrays chunked by rows. Without ``scratch`` each update is persisted (on a
    ``distributed`` cluster the workers hold it and spill it to disk past their memory target); with
    ``scratch`` (a directory or fsspec URL the workers can reach) each update is written there as a
    Zarr array and read back by the next pass, so a worker holds a few row blocks at a time."""

    def __init__(self, arrays: dict[str, da.Array], scratch: str | None = None):
        self.scratch = f"{scratch.rstrip('/')}/boosting-{uuid.uuid4().hex[:12]}" if scratch else None
        self.urls: dict[str, str] = {}
        self.arrays = {}
        self.n_passes = 0
        for name, value in arrays.items():
            self._set(name, value)

    def _ops(self, names, whole):
        return ([(n, self.arrays[n], ROWS) for n in names]
                + [(n, dense_operand(np.asarray(v), name=n), WHOLE) for n, v in whole.items()])

    def reduce(self, kernel, names: tuple, size: int, static: dict | None = None, **whole) -> np.ndarray:
        self.n_passes += 1
        return block_sum(kernel, self._ops(names, whole), tail=(size,), dtype=np.float64, static=static,
                         token=f"boost-{kernel.__name__}-{next(_tokens)}").compute()

    def update(self, name: str, kernel, names: tuple, cols: int, dtype, static: dict | None = None, **whole):
        self.n_passes += 1
        out = per_block(kernel, self._ops(names, whole), tail=(cols,), dtype=dtype, stack=False, static=static,
                        token=f"boost-{name}-{next(_tokens)}")
        self._set(name, out)

    def _set(self, name: str, value: da.Array) -> None:
        old = self.urls.pop(name, None)
        if self.scratch is None:
            self.arrays[name] = value.persist()
        else:
            url = f"{self.scratch}/{name}-{next(_tokens)}.zarr"
            rows = value.chunks[0][0]
            target = zarr.open_array(zarr_store(url), mode="w", shape=value.shape, dtype=value.dtype,
                                     chunks=(rows, *value.shape[1:]), fill_value=0)
            da.store(value, target, lock=False)
            self.arrays[name] = da.from_zarr(target)
            self.urls[name] = url
        if old:
            remove(old)

    def close(self) -> None:
        """Delete the scratch arrays."""
        if self.scratch:
            remove(self.scratch)
        self.urls.clear()


# --------------------------------------------------------------------------------------------
# the estimators


#: the deepest trees a search extends its grid to: a level doubles a tree's leaves and its histograms (the cost of a
#: round), so past this the rounds' cost, not the held-out loss, decides (docs/measurements.md)
MAX_SEARCHED_DEPTH = 12


class _Boosting(SavedModel, ParamsMixin):
    """What the four boosting models share: inputs, binning, the round loop, prediction and storage."""

    #: how a round grows its trees: "factor" (one tree on the factorised residuals) or "per_class"
    _trees = "per_class"
    #: the link of the scores: "softmax" (multinomial) or "sigmoid" (one-vs-rest)
    _link = "softmax"
    #: ``xmldask train --model NAME`` chooses the trees' depth by held-out loss unless given (the rounds early-stop
    #: on the same held-out rows; a grid whose deepest value wins is extended, at most to :data:`MAX_SEARCHED_DEPTH`)
    auto_search = {"max_depth": [6, 10]}
    search_scoring = "loss"
    params_schema = BoostingParams

    def search_bounds(self, X, Y) -> dict[str, tuple]:
        """``max_depth`` is 1 to :data:`MAX_SEARCHED_DEPTH`."""
        return {"max_depth": (1, MAX_SEARCHED_DEPTH)}

    def __init__(self, *, rounds: int = _BOOSTING.rounds, learning_rate: float = _BOOSTING.learning_rate,
                 max_depth: int = _BOOSTING.max_depth, max_bins: int = 64,
                 l2_leaf_reg: float = 1.0, leaf_estimation: str = "newton", validation_fraction: float = 0.1,
                 n_iter_no_change: int = 20,
                 block_rows: int = 8192, backend: str = "auto", scratch: str | None = None,
                 time_budget: float | None = None, random_state=None):
        self.rounds, self.learning_rate, self.max_depth, self.max_bins = rounds, learning_rate, max_depth, max_bins
        self.time_budget = time_budget
        self.l2_leaf_reg, self.leaf_estimation = l2_leaf_reg, leaf_estimation
        self.validation_fraction, self.n_iter_no_change = validation_fraction, n_iter_no_change
        self.block_rows, self.backend, self.scratch, self.random_state = block_rows, backend, scratch, random_state

    def __repr__(self) -> str:
        return f"{type(self).__name__}(rounds={self.rounds!r}, learning_rate={self.learning_rate!r})"

    def _validated(self) -> dict:
        if self.backend not in ("auto", "local", "dask"):
            raise ValueError(f"backend must be 'auto', 'local' or 'dask', but is {self.backend!r}")
        if self.leaf_estimation not in ("newton", "gradient"):
            raise ValueError(f"leaf_estimation must be 'newton' or 'gradient', but is {self.leaf_estimation!r}")
        return dict(rounds=check_int(self.rounds, "rounds", 1),
                    learning_rate=check_float(self.learning_rate, "learning_rate", low_open=True),
                    max_depth=check_int(self.max_depth, "max_depth", 1, 16),
                    max_bins=check_int(self.max_bins, "max_bins", 2, 255),
                    l2_leaf_reg=check_float(self.l2_leaf_reg, "l2_leaf_reg"),
                    validation_fraction=check_float(self.validation_fraction, "validation_fraction", high=0.5),
                    n_iter_no_change=check_int(self.n_iter_no_change, "n_iter_no_change", 1),
                    block_rows=check_int(self.block_rows, "block_rows", 1),
                    scratch=None if self.scratch is None else str(self.scratch),
                    time_budget=None if getattr(self, "time_budget", None) is None else
                    check_float(self.time_budget, "time_budget", low_open=True))

    # ---------------------------------------------------------------- inputs

    def _state(self, X, Y, p: dict, seed: int):
        """The row blocks (``_LocalRows`` for an in-memory ``X``, ``_DaskRows`` for a Dask array) with
        ``bins``, ``y``, ``held`` and zero scores ``S``, after checking the inputs: two passes (the
        checks with the quantile sample, then the binning)."""
        lazy = isinstance(X, da.Array)
        memory = None if lazy else _in_memory_rows(X)
        X = as_rows(X if lazy else memory, "X", block_rows=p["block_rows"])
        if lazy and p["scratch"] is not None and len(set(X.chunks[0][:-1])) > 1:
            raise ValueError("scratch needs row blocks of one size (the last may be smaller); fix: X = "
                             "X.rechunk({0: ROWS}) (a dataset store's blocks are)")
        y, n_labels = self._classes(Y, X)
        n, d = X.shape
        state_bytes = n * (d + 12 * n_labels)  # bins, scores, targets and weights (per-class trees)
        if lazy and (self.backend == "local" or self.backend == "auto" and state_bytes <= LOCAL_STATE_BYTES):
            lazy = False  # small enough to boost in this process: no scheduling per pass
        self.n_features_in_, self.n_labels_ = int(d), int(n_labels)
        if self.n_labels_ < 2:
            raise ValueError(f"a multiclass model needs at least 2 classes, but the labels have {self.n_labels_}")
        sample_rows = max(1, math.ceil(min(SAMPLE_ROWS, n) * max(X.chunks[0]) / max(n, 1)))
        sample_rows = min(sample_rows, max(1, BK.SAMPLE_VALUES_PER_BLOCK // max(d, 1)))
        checked = dask.compute(*per_block_objects(_check_and_sample, X, y, seed=seed, rows=sample_rows))
        starts = np.cumsum((0,) + X.chunks[0])
        for i, (finite, _, _) in enumerate(checked):
            if finite[0] > 0:
                raise ValueError(f"X has non-finite values (NaN or infinite), the first in row "
                                 f"{starts[i] + int(finite[1])}; boosting needs finite features")
        for i, (_, labels, _) in enumerate(checked):
            if labels[0] > 0:
                raise ValueError(f"{type(self).__name__} is a multiclass model: every row needs exactly one label, "
                                 f"but {int(sum(c[1][0] for c in checked))} rows do not (the first, row "
                                 f"{starts[i] + int(labels[1])}, has {int(labels[2])}); use a multilabel model "
                                 "(embedding, leml, br) for such data")
        self.borders_ = BK.quantile_borders(sp.vstack([c[2] for c in checked]), p["max_bins"])
        n_bins = max(len(b) for b in self.borders_) + 1
        frac, K = p["validation_fraction"], self.n_labels_
        if not lazy:
            y = y.compute()
            if memory is None:
                memory = [block.compute() for block in X.blocks]  # row blocks as they are
                memory = sp.vstack(memory, format="csr") if sp.issparse(memory[0]) else np.concatenate(memory)
            blocks = [{"bins": BK.bin_block(memory[a:b], self.borders_), "y": y[a:b],
                       "held": BK.held_out(b - a, seed=seed, block=i, fraction=frac),
                       "S": np.zeros((b - a, K), np.float32)}
                      for i, (a, b) in enumerate(zip(starts[:-1], starts[1:]))]
            return _LocalRows(blocks), n_bins
        bins = X.map_blocks(_bin_block, borders=self.borders_, dtype=np.uint8, meta=np.empty((0, 0), np.uint8))
        held = y.map_blocks(_held_block, seed=seed, fraction=frac, dtype=bool, meta=np.empty((0,), bool))
        S = da.zeros((n, K), dtype=np.float32, chunks=(X.chunks[0], (K,)))
        return _DaskRows({"bins": bins, "y": y, "held": held, "S": S}, scratch=p["scratch"]), n_bins

    def _classes(self, Y, X: da.Array) -> tuple[da.Array, int]:
        """Per row its class as a lazy int32 array chunked like ``X`` (``-1 - labels`` where a row has
        no or several labels), and the number of classes: from a one-label-per-row label matrix (a
        dataset store's ``Y``) or a vector of class ids."""
        if isinstance(Y, da.Array) and Y.ndim == 2 or sp.issparse(Y) or np.ndim(Y) == 2:
            Yr = as_rows(Y, "Y", block_rows=X.chunks[0][0])
            if Yr.shape[0] != X.shape[0]:
                raise ValueError(f"Y has {Yr.shape[0]} rows but X has {X.shape[0]}; they must hold the same samples")
            Yr = Yr.rechunk({0: X.chunks[0]})
            return Yr.map_blocks(BK.classes_of, drop_axis=1, dtype=np.int32, meta=np.empty((0,), np.int32)), \
                int(Yr.shape[1])
        y = np.asarray(Y)
        if y.ndim != 1 or y.shape[0] != X.shape[0]:
            raise ValueError(f"y must hold one class per row of X ({X.shape[0]} rows), but has shape {y.shape}")
        if not np.issubdtype(y.dtype, np.integer) or (y.size and y.min() < 0):
            raise ValueError(f"y must hold class ids 0, 1, ... (integers), but has dtype {y.dtype}"
                             + (f" and the id {y.min()}" if np.issubdtype(y.dtype, np.integer) else ""))
        return da.from_array(y.astype(np.int32), chunks=(X.chunks[0],)), int(y.max(initial=0)) + 1

    # ---------------------------------------------------------------- fit

    def fit(self, X, Y) -> _Boosting:
        """Boost ``rounds`` rounds (fewer if the held-out loss stops improving for ``n_iter_no_change``
        rounds; the best round is kept).

        Parameters
        ----------
        X : dask.array.Array or array_like, shape (n_samples, n_features)
            Features, dense or sparse; a Dask array of row blocks is fitted out of core.
        Y : array_like
            One class per row: a label matrix with one label per row (``n_samples x n_classes``, e.g. a
            dataset store's ``Y``) or a vector of class ids.
        """
        p = self._validated()
        extra = self._validated_extra()
        start = time.perf_counter()
        rows, n_bins = self._state(X, Y, p, seed_of(self.random_state))
        self.n_bins_ = n_bins
        try:
            trees, history, best = self._boost(rows, p, extra, start)
        finally:
            rows.close()
        K, D = self.n_labels_, p["max_depth"]
        factor = self._trees == "factor"
        kept = trees[:best]
        self.rounds_ = len(kept)
        self.features_ = np.concatenate([r[0] for r in kept] or [np.zeros((0, D))]).astype(np.int32)
        self.tree_borders_ = np.concatenate([r[1] for r in kept] or [np.zeros((0, D))]).astype(np.uint8)
        self.values_ = np.concatenate([r[2] for r in kept] or [np.zeros((0, 1 << D))]).astype(np.float32)
        self.vectors_ = np.concatenate([r[3]["vectors"] for r in kept] or [np.zeros((0, K))]).astype(np.float32) \
            if factor else np.zeros((0, K), np.float32)
        self.classes_ = np.zeros(0, np.int32) if factor else \
            np.concatenate([r[3]["classes"] for r in kept] or [np.zeros(0)]).astype(np.int32)
        self.history_ = history
        self.n_passes_ = rows.n_passes + 2
        self.fit_seconds_ = time.perf_counter() - start
        return self

    def _boost(self, rows, p: dict, extra: dict, start: float) -> tuple[list, list, int]:
        """The rounds: per round its trees (features, borders, values, outputs); the history; the best
        round by held-out loss (the last without held-out rows). With a ``time_budget`` (from ``start``), no round
        starts that would end past it (as long as the longest round so far)."""
        deadline = start + p["time_budget"] if p["time_budget"] is not None else math.inf
        longest = 0.0
        K, D, n_bins = self.n_labels_, p["max_depth"], self.n_bins_
        factor = self._trees == "factor"
        exact = factor and K <= EXACT_GRAM_CLASSES
        validate = p["validation_fraction"] > 0
        trees: list[tuple] = []
        history, best, best_loss, stale, v = [], 0, math.inf, 0, None
        for t in range(p["rounds"] + 1):
            # the round's first power step (many classes) rides on the statistics pass
            v = self._start(v) if factor and not exact else None
            st = rows.reduce(BK.stats, ("S", "y", "held"), (K * K if exact else 0 if v is None else K + 1) + 5,
                             static={"link": self._link, "gram": exact}, **({} if v is None else {"v": v}))
            train_loss, n_train, val_loss, val_correct, n_val = st[-5:]
            entry = {"round": t, "trees": sum(len(r[0]) for r in trees), "train_loss": train_loss / max(n_train, 1),
                     "val_loss": val_loss / n_val if n_val else None,
                     "val_accuracy": val_correct / n_val if n_val else None}
            history.append(entry)
            if validate and n_val and entry["val_loss"] < best_loss - 1e-9:
                best, best_loss, stale = t, entry["val_loss"], 0
            elif validate and n_val:
                stale += 1
            if t == p["rounds"] or stale >= p["n_iter_no_change"]:
                break
            if time.perf_counter() + longest > deadline:
                entry["stopped"] = "time_budget"
                if not trees:
                    raise BudgetError(f"a time budget of {p['time_budget']:g} s ended before the first round: "
                                      f"preparing the rows took {time.perf_counter() - start:.1f} s; give more, or no "
                                      "budget")
                logger.info("time budget of %g s: boosting stops after %d rounds", p["time_budget"], t)
                break
            round_start = time.perf_counter()
            if factor:
                v, entry["factor_error"] = self._factor(rows, st[:-5], v, extra)
                v = self._targets(rows, v, int(n_train), extra)
                groups, outputs = [(0, 1)], {"vectors": v[None, :]}
            else:
                rows.update("T", BK.targets, ("S", "y", "held"), 2 * K, np.float32, static=self._target_static())
                per = max(1, HISTOGRAM_BYTES // (16 << (D - 1)) // (self.n_features_in_ * n_bins))
                groups, outputs = [(a, min(a + per, K)) for a in range(0, K, per)], {"classes": np.arange(K)}
            F, B, V = self._grow(rows, groups, D, n_bins, p["l2_leaf_reg"])
            V *= p["learning_rate"]
            trees.append((F, B, V, outputs))
            rows.update("S", BK.apply_trees, ("bins", "S"), K, np.float32, features=F, borders=B, values=V, **outputs)
            entry["seconds"] = time.perf_counter() - round_start
            longest = max(longest, entry["seconds"])
            logger.debug("round %d: train loss %.4f, held-out loss %s", t, entry["train_loss"], entry["val_loss"])
        return trees, history, best if validate else len(trees)

    def _validated_extra(self) -> dict:
        return {}

    def _factor(self, rows, gram, v_prev, extra):
        raise NotImplementedError

    def _targets(self, rows, v, n_train, extra):
        """Write the round's targets ``T = R v`` (one tree); returns the tree's output vector ``v``."""
        rows.update("T", BK.targets, ("S", "y", "held"), 2, np.float32, static=self._target_static(), v=v)
        return v

    def _target_static(self, **more) -> dict:
        return {"link": self._link, "newton": self.leaf_estimation == "newton", **more}

    def _grow(self, rows, groups, D, n_bins, l2):
        """Grow the round's trees level by level, a pass per level and group of target columns."""
        m, d = groups[-1][1], self.n_features_in_
        n_borders = np.array([len(b) for b in self.borders_])
        F, B = np.zeros((m, 0), np.int64), np.zeros((m, 0), np.int64)
        last = [None] * len(groups)  # per group, the histograms of the last level's leaves
        for level in range(D):
            new_f, new_b = np.zeros(m, np.int64), np.zeros(m, np.int64)
            for g, (a, b) in enumerate(groups):
                leaves = 1 << max(level - 1, 0)  # level 0: all rows; then the rows right of the last split
                flat = rows.reduce(_histograms, ("bins", "T"), 2 * (b - a) * (d * n_bins * leaves),
                                   static={"n_bins": n_bins, "columns": (a, b), "right_only": level > 0},
                                   features=F[a:b], borders=B[a:b])
                hist = flat.reshape(2, b - a, leaves, d, n_bins)
                if level > 0:
                    hist = BK.children(last[g], hist)
                new_f[a:b], new_b[a:b], _ = BK.best_splits(hist, n_borders, l2)
                last[g] = hist
            F, B = np.column_stack([F, new_f]), np.column_stack([B, new_b])
        V = np.concatenate([BK.leaf_values(h, F[a:b], B[a:b], l2) for h, (a, b) in zip(last, groups)])
        return F, B, V

    # ---------------------------------------------------------------- predict

    def _check_fitted(self) -> None:
        if getattr(self, "values_", None) is None:
            raise NotFittedError(f"this {type(self).__name__} is not fitted yet; call fit(X, Y) first")

    def decision_function(self, X, *, trees: int | None = None) -> da.Array:
        """The scores of every class (float32), lazily, chunked like ``X``; with ``trees``, of the first
        ``trees`` trees only (staged prediction: the model after fewer rounds).

        Returns
        -------
        dask.array.Array, shape (n_samples, n_classes)
        """
        X = self._rows(X)
        T = len(self.values_) if trees is None else check_int(trees, "trees", 0, len(self.values_))
        factor = len(self.vectors_) > 0
        whole = [np.concatenate(self.borders_ + [np.zeros(0)]), np.array([len(b) for b in self.borders_]),
                 self.features_[:T], self.tree_borders_[:T], self.values_[:T],
                 self.vectors_[:T] if factor else self.classes_[:T]]
        args = [X, ("i", "x")]
        for j, value in enumerate(whole):
            args += [dense_operand(value, name=f"model{j}"), tuple(f"w{j}_{q}" for q in range(value.ndim))]
        return da.blockwise(_scores_block, ("i", "k"), *args, new_axes={"k": self.n_labels_}, concatenate=True,
                            dtype=np.float32, meta=np.empty((0, 0), np.float32), factor=factor,
                            n_labels=self.n_labels_, token=f"boost-scores-{next(_tokens)}")

    def predict_proba(self, X, *, trees: int | None = None) -> da.Array:
        """Class probabilities (float32): the softmax of the scores (one-vs-rest: the sigmoids, normalised)."""
        return self.decision_function(X, trees=trees).map_blocks(_probabilities, link=self._link, dtype=np.float32)

    def predict_topk(self, X, k: int = 5, *, trees: int | None = None) -> tuple[da.Array, da.Array]:
        """Top-``k`` classes (int32) and their probabilities (float32), best first (ties: smaller id)."""
        k = self._checked_k(k)
        P = self.predict_proba(X, trees=trees)
        packed = P.map_blocks(_topk_block, k=k, chunks=(P.chunks[0], (2 * k,)), dtype=np.float64)
        return packed[:, :k].astype(np.int32), packed[:, k:].astype(np.float32)

    # ---------------------------------------------------------------- persistence

    _MODEL_VERSION = BOOSTING_VERSION
    _ARRAYS = ("features", "tree_borders", "values", "vectors", "classes")
    _SCALARS = ("n_features_in", "n_labels", "n_bins", "rounds", "n_passes", "history", "fit_seconds")

    def _parts(self) -> tuple[dict, dict, dict]:
        """The parameters, trees and fitted scalars, and the per-feature bin borders concatenated."""
        params, fitted, arrays = super()._parts()
        arrays["border_values"] = np.concatenate(self.borders_ + [np.zeros(0)])
        arrays["border_counts"] = np.array([len(b) for b in self.borders_], dtype=np.int64)
        return params, fitted, arrays

    @classmethod
    def _from_parts(cls, params: dict, fitted: dict, arrays):
        model = super()._from_parts(params, fitted, arrays)
        cuts = np.cumsum(np.asarray(arrays["border_counts"][...]))[:-1]
        model.borders_ = list(np.split(np.asarray(arrays["border_values"][...]), cuts))
        return model

    def train_summary(self) -> dict:
        kept = self.history_[self.rounds_] if self.history_ else {}
        return {"n_passes": int(self.n_passes_), "task": "multiclass", "rounds": self.rounds_,
                "trees": int(len(self.values_)),
                "held_out": {"loss": kept.get("val_loss"), "accuracy": kept.get("val_accuracy")}}


class GradFac(_Boosting):
    """Gradient boosting with a factorised gradient: one oblivious tree per round for any number of classes.

    Each round factorises the residuals ``R = Y - softmax(S)`` into ``u v^T`` by their top singular
    pair (``v`` unit), fits one tree to ``u`` and adds ``learning_rate * u(x) v^T`` to the scores.

    Parameters
    ----------
    rounds : int, default 1000
        Boosting rounds at most (one tree each).
    learning_rate : float, default 0.3
        Shrinkage of every tree (XGBoost's default; with Newton leaves).
    max_depth : int, default 6
        Depth of the oblivious trees (``2^max_depth`` leaves).
    max_bins : int, default 64
        Bins per feature (quantile borders of a sample of the rows, at most 255).
    l2_leaf_reg : float, default 1.0
        Added to a leaf's weight sum in its value and in the split gain.
    leaf_estimation : {"newton", "gradient"}, default "newton"
        Leaf values (and split gains) from the sums of the targets over the sums of the loss's
        curvature along the tree's output (a Newton step, as CatBoost and XGBoost do), or over row
        counts (the mean target: the paper's MSE fit of the gradient).
    validation_fraction : float, default 0.1
        Training rows held out for early stopping (0: none; every round is kept).
    n_iter_no_change : int, default 20
        Rounds without a better held-out loss before stopping.
    power_iter : int, default 1
        With more than :data:`EXACT_GRAM_CLASSES` classes: power steps on ``R^T R`` a round, warm-started
        from the last round's ``v`` (the first rides on the statistics pass, each further one is a
        pass); with fewer, the exact eigenvector of ``R^T R`` (no pass of its own).
    block_rows : int, default 8192
        Rows per block of an in-memory ``X``.
    scratch : str, optional
        With the ``dask`` backend: a directory or fsspec URL that every worker can reach, where the
        boosting state is written as Zarr arrays between passes (a worker then holds a few row blocks
        at a time, however large the data); deleted after the fit. ``None``: the state is persisted in
        the workers' memory, which Dask spills to disk past its memory target.
    backend : {"auto", "local", "dask"}, default "auto"
        Where the boosting state lives: ``local`` in this process (a Dask ``X`` is read into it once),
        ``dask`` in row blocks on the scheduler's workers (out of core), ``auto`` local for an
        in-memory ``X`` or a state up to :data:`LOCAL_STATE_BYTES`, else ``dask``.
    time_budget : float, optional
        Seconds the fit may take: no round starts that would end past it (judged by the longest round so far);
        the best round so far is kept. A budget that ends before the first round raises
        :class:`~xmldask.base.BudgetError`.
    random_state : int, optional
        Seed of the row sample of the borders and of the held-out rows.

    Attributes
    ----------
    history_ : list of dict
        Per round: ``train_loss``, ``val_loss``, ``val_accuracy``, ``factor_error`` (``|R - u v^T| / |R|``),
        trees so far, seconds.
    rounds_ : int
        The rounds kept (the best held-out loss).
    """

    family = "gradfac"
    _trees = "factor"

    def __init__(self, *, rounds: int = _BOOSTING.rounds, learning_rate: float = _BOOSTING.learning_rate,
                 max_depth: int = _BOOSTING.max_depth, max_bins: int = 64,
                 l2_leaf_reg: float = 1.0, leaf_estimation: str = "newton", validation_fraction: float = 0.1,
                 n_iter_no_change: int = 20,
                 power_iter: int = 1, block_rows: int = 8192, backend: str = "auto", scratch: str | None = None,
                 time_budget: float | None = None, random_state=None):
        super().__init__(rounds=rounds, learning_rate=learning_rate, max_depth=max_depth, max_bins=max_bins,
                         l2_leaf_reg=l2_leaf_reg, leaf_estimation=leaf_estimation,
                         validation_fraction=validation_fraction,
                         n_iter_no_change=n_iter_no_change, block_rows=block_rows, backend=backend,
                         scratch=scratch, time_budget=time_budget, random_state=random_state)
        self.power_iter = power_iter

    def _validated_extra(self) -> dict:
        return {"power_iter": check_int(self.power_iter, "power_iter", 1)}

    def _start(self, v_prev):
        """The start of the power steps: the last round's ``v``, a fixed random vector at first."""
        v = v_prev if v_prev is not None else np.random.default_rng(0).standard_normal(self.n_labels_)
        return v / np.linalg.norm(v)

    def _factor(self, rows, head, v, extra):
        """The unit ``v`` of the top singular pair of ``R`` and the relative error ``|R - u v^T| / |R|``.

        ``head`` is ``R^T R`` (its top eigenvector) or, with many classes, ``[R^T R v, |R|^2]`` for the
        start ``v``: the first power step, taken by the statistics pass; ``power_iter - 1`` more follow."""
        K = self.n_labels_
        if v is None:
            w, U = np.linalg.eigh(head.reshape(K, K))
            v, top, total = U[:, -1], w[-1], np.trace(head.reshape(K, K))
        else:
            w, total = head[:K], head[K]
            for _ in range(extra["power_iter"] - 1):
                v = w / max(np.linalg.norm(w), 1e-300)
                w = rows.reduce(BK.power_step, ("S", "y", "held"), K, static={"link": self._link}, v=v)
            top = float(v @ w)  # the Rayleigh quotient |R v|^2 of the last v
            v = w / max(np.linalg.norm(w), 1e-300)
        err = math.sqrt(max(1.0 - max(top, 0.0) / max(total, 1e-300), 0.0))
        return (-v if v[np.argmax(np.abs(v))] < 0 else v), err  # a fixed sign (u v^T does not depend on it)


class GradFacEN(GradFac):
    """GradFac with the Elastic-Net factorisation of eq. (6) (``--model gfen``).

    ``min |R - u v^T|^2 + a1 |u|_1 + a2 |u|^2 + b1 |v|_1 + b2 |v|^2``, by ``en_iter`` alternations of
    the exact soft-threshold steps from the GradFac solution (a ``u``-step is row-local; a ``v``-step is
    a pass). The L1 weights are relative, so one value serves any data: ``a1 = en_l1_u * max_i
    |2 r_i^T v|`` and ``b1 = en_l1_v * max_j |2 R_j^T u|`` (1 zeroes everything); the L2 weights are
    ``a2 = en_l2_u`` and ``b2 = en_l2_v * n_train``. L1 on ``u`` zeroes the targets of the rows the
    factor fits worst; L1 on ``v`` lets classes skip the round. The tree fits ``u |v|`` and outputs
    ``v / |v|``. Other parameters: :class:`GradFac`.
    """

    family = "gfen"

    def __init__(self, *, rounds: int = _BOOSTING.rounds, learning_rate: float = _BOOSTING.learning_rate,
                 max_depth: int = _BOOSTING.max_depth, max_bins: int = 64,
                 l2_leaf_reg: float = 1.0, leaf_estimation: str = "newton", validation_fraction: float = 0.1,
                 n_iter_no_change: int = 20,
                 power_iter: int = 1, en_l1_u: float = 0.05, en_l2_u: float = 0.0, en_l1_v: float = 0.05,
                 en_l2_v: float = 0.0, en_iter: int = 1, block_rows: int = 8192, backend: str = "auto",
                 scratch: str | None = None, time_budget: float | None = None, random_state=None):
        super().__init__(rounds=rounds, learning_rate=learning_rate, max_depth=max_depth, max_bins=max_bins,
                         l2_leaf_reg=l2_leaf_reg, leaf_estimation=leaf_estimation,
                         validation_fraction=validation_fraction,
                         n_iter_no_change=n_iter_no_change, power_iter=power_iter, block_rows=block_rows,
                         backend=backend, scratch=scratch, time_budget=time_budget, random_state=random_state)
        self.en_l1_u, self.en_l2_u, self.en_l1_v, self.en_l2_v = en_l1_u, en_l2_u, en_l1_v, en_l2_v
        self.en_iter = en_iter

    def _validated_extra(self) -> dict:
        return {**super()._validated_extra(), "en_iter": check_int(self.en_iter, "en_iter", 1),
                **{name: check_float(getattr(self, name), name, high=1.0 if "l1" in name else math.inf)
                   for name in ("en_l1_u", "en_l2_u", "en_l1_v", "en_l2_v")}}

    def _u_step(self, rows, v, extra, scale=1.0):
        """Targets ``T = scale * u``, ``u`` the soft-threshold step against ``v``."""
        a1 = extra["en_l1_u"] * 2 * rows.reduce(BK.max_abs_projection, ("S", "y", "held"), 1,
                                                static={"link": self._link}, v=v)[0]
        rows.update("T", BK.targets, ("S", "y", "held"), 2, np.float32, v=v,
                    static=self._target_static(en=(a1, extra["en_l2_u"], scale)))

    def _targets(self, rows, v, n_train, extra):
        for _ in range(extra["en_iter"]):
            self._u_step(rows, v, extra)
            out = rows.reduce(BK.en_v_step, ("S", "y", "held", "T"), len(v) + 1, static={"link": self._link})
            z, uu = 2 * out[:-1], out[-1]
            v_new = BK.soft_threshold(z, extra["en_l1_v"] * np.abs(z).max()) / (2 * (uu + extra["en_l2_v"] * n_train))
            if uu <= 0 or not np.any(v_new):
                break
            v = v_new
        norm = float(np.linalg.norm(v))
        self._u_step(rows, v, extra, scale=norm)
        return v / norm


# --------------------------------------------------------------------------------------------


class MultinomialBoosting(_Boosting):
    """Multinomial logistic boosting (Friedman 2001; the paper's MLL): one oblivious tree per class per
    round, each fitted to its column of the residuals (``--model mll``). Parameters: :class:`GradFac`."""

    family = "mll"


class OneVsRestBoosting(_Boosting):
    """One-vs-rest logistic boosting: per class, a binary logistic model boosted with one tree per
    round on ``1[y = j] - sigmoid(s_j)`` (``--model ovr``). Parameters: :class:`GradFac`."""

    family = "ovr"
    _link = "sigmoid"


# --------------------------------------------------------------------------------------------
# block functions (module level: pickled to the workers by reference)


def _in_memory_rows(X):
    """An in-memory ``X`` as CSR or a 2-D array."""
    if sp.issparse(X):
        return sp.csr_matrix(X)
    X = np.asarray(X)
    if X.ndim != 2:
        raise ValueError(f"X must be 2-D, but has shape {X.shape}")
    return X


def _check_and_sample(Xb, yb, *, block, seed, rows):
    """The input checks of a block (non-finite features; rows without exactly one label) and its rows of
    the quantile sample."""
    bad = np.flatnonzero(yb < 0)
    labels = np.array([bad.size, bad[0] if bad.size else -1, -1 - yb[bad[0]] if bad.size else 0])
    return BK.check_finite(Xb), labels, BK.sample_rows(Xb, seed=seed, block=block, rows=rows)


def _bin_block(Xb, borders):
    return BK.bin_block(Xb, borders)


def _held_block(yb, seed, fraction, block_id=None):
    return BK.held_out(yb.shape[0], seed=seed, block=block_id[0], fraction=fraction)


def _histograms(bins, T, *, features, borders, n_bins, columns, right_only):
    a, b = columns
    m = T.shape[1] // 2
    if (a, b) != (0, m):
        T = np.concatenate([T[:, a:b], T[:, m + a:m + b]], axis=1)
    return BK.histograms(bins, T, features=features, borders=borders, n_bins=n_bins, right_only=right_only)


def _scores_block(Xb, flat_borders, n_borders, features, borders, values, outputs, *, factor: bool, n_labels: int):
    """The scores of a block of raw rows: binned with the model's borders, then its trees a slice at a time."""
    bins = BK.bin_block(Xb, np.split(flat_borders, np.cumsum(n_borders)[:-1]))
    S = np.zeros((Xb.shape[0], n_labels), np.float32)
    for a in range(0, len(values), PREDICT_TREES):
        b = a + PREDICT_TREES
        out = {"vectors": outputs[a:b]} if factor else {"classes": outputs[a:b]}
        S = BK.apply_trees(bins, S, features=features[a:b], borders=borders[a:b], values=values[a:b], **out)
    return S


def _probabilities(S, link):
    if link == "softmax":
        return BK.softmax(S).astype(np.float32)
    P = BK.sigmoid(S)
    return (P / P.sum(axis=1, keepdims=True)).astype(np.float32)


def _topk_block(P: np.ndarray, k: int) -> np.ndarray:
    """``[labels, probabilities]`` of the ``k`` largest per row, best first (ties: smaller id)."""
    order = np.lexsort((np.broadcast_to(np.arange(P.shape[1]), P.shape), -P), axis=1)[:, :k]
    return np.concatenate([order, np.take_along_axis(P, order, axis=1)], axis=1).astype(np.float64)
