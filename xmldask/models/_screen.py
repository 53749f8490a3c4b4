"""Screened fits of :class:`~xmldask.models.EmbeddingClassifier` from statistics every candidate shares.

A screened candidate of a search (``HeldOutSearch(screen=...)``: the ridge decoder alone, on the linear
feature map) is three least-squares problems: Rembrandt's embedding ``R``, the map ``W`` onto it and the
decoder ``Q``. The data enter all three only through ``X^T X``, ``X^T 1``, ``X^T Y`` and ``Y^T 1`` and
the held-out rows. One pass per input normalisation (``features``) computes them over all rows and
gathers the held-out rows of every split asked for; the training rows' statistics are those minus the
held-out rows' (a few hundred to ten thousand rows, in memory). Every ``(k, alpha, split)`` is then
solved in memory:

- ``R``: :class:`xmldask.embedding.RembrandtMoments` (the same ``R`` as the fit's Rembrandt);
- ``W``: ``(X_c^T X_c + lam I)^{-1} X_c^T Y R`` on the training rows, ``X_c`` centred (the fit's ridge,
  Cholesky);
- ``Q``: the fit's own warm start (:meth:`EmbeddingClassifier._warm_start`) on ``F = [X W + c, 1]``,
  whose ``F^T F`` and ``F^T Y`` are ``W^T (X^T X) W``, ``W^T X^T Y`` and their sums;

so a candidate costs a few small dense factorisations instead of three passes, and the held-out
figures are those of ``EmbeddingClassifier(**params).fit(X, Y)`` (to rounding).

It applies when the fit would take Rembrandt's one-pass route (at most
:data:`~xmldask.linalg.MAX_GRAM_FEATURES` features, ``X^T Y`` at most
:data:`~xmldask.embedding.rembrandt.MAX_CROSS_ENTRIES` entries) and to the screened settings only
(``embedding="rembrandt"``, ``kernel="none"``, ``max_epochs=0``); :meth:`Screener.applies` says.

With more features and few rows (:func:`~xmldask.linalg.solvers.dual_applies`), where the fit solves its
least squares in the dual, the screener does too: one pass per input normalisation computes the rows' Gram
matrix ``K = X X^T`` and gathers ``Y``, and every candidate is solved from them in memory:

- ``R``: :meth:`xmldask.embedding.RembrandtMoments.from_rows_gram` (Rembrandt's dual, all rows);
- ``W``: the dual solution ``A = (K_c[T, T] + lam I)^{-1} (Y_T R - 1 ybar_T^T R)`` on the training rows ``T``,
  ``K_c`` centred by the training rows' mean; a row's embedded prediction ``x W + c`` is then
  ``k_c(x, T) A + ybar_T^T R``, for the training rows and the held-out rows alike (the held-out rows are
  drawn from the split's seed, without a pass);
- ``Q``: the fit's warm start on those predictions.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from dataclasses import dataclass

import dask
import numpy as np
import scipy.linalg
import scipy.linalg.blas
import scipy.sparse as sp

from ..base import seed_of
from ..embedding import Rembrandt, RembrandtMoments
from ..embedding.rembrandt import MAX_CROSS_ENTRIES
from ..linalg import (
    MAX_GRAM_FEATURES,
    column_sums,
    gram,
    per_block_objects,
    row_gram,
    solvers,
    t_product,
    working_dtype,
    x_q,
    xt_b,
)
from ..scheduling import computed_once
from ..scheduling import read_only as _read_only
from . import _kernels as K
from ._graph import DecoderData

__all__ = ["Screener"]

#: bytes of the matrices that the screened candidates of one held-out split share (the training rows' centred Gram
#: matrix, its Cholesky factor for each ridge) kept between candidates, least recently used dropped first: the
#: settings of a coordinate search differ in one parameter and are scored on the same splits, so ``k`` reuses the
#: factor of its ``alpha`` and every ``alpha`` the centred Gram matrix of its split
CACHE_BYTES = 1 << 30


@dataclass
class _Moments:
    """One input normalisation's statistics over all rows (float64) and the held-out rows by split."""

    X: object  # the transformed rows (lazy)
    idf: np.ndarray | None
    G: np.ndarray  # X^T X
    s: np.ndarray  # X^T 1
    C: np.ndarray  # X^T Y (as Rembrandt accumulates it)
    y: np.ndarray  # Y^T 1
    task: str
    held: dict  # (split seed, fraction) -> (X_h, Y_h)
    features: str
    rembrandt: RembrandtMoments | None = None


@dataclass
class _RowsGram:
    """One input normalisation's rows' Gram matrix ``K = X X^T`` (float64) and the labels, all rows in memory."""

    K: np.ndarray
    Y: sp.csr_matrix  # float64
    idf: np.ndarray | None
    task: str
    features: str
    n_features: int
    rembrandt: RembrandtMoments | None = None


def _held_rows(Xb, Yb, splits: tuple, block: int) -> list:
    """The held-out rows ``(X_b[mask], Y_b[mask])`` of one row block for every ``(seed, fraction)``."""
    Yb = sp.csr_matrix(Yb, dtype=np.float32)
    out = []
    for seed, fraction in splits:
        rows = np.flatnonzero(K.holdout_mask(seed, block, Xb.shape[0], fraction))
        out.append((Xb[rows], Yb[rows]))
    return out


class _Cache:
    """Values by key, least recently used dropped first while their arrays take more than ``limit`` bytes."""

    def __init__(self, limit: int):
        self.limit, self.bytes, self.items = int(limit), 0, OrderedDict()

    def get(self, key, make):
        """The value of ``key``, made by ``make()`` (and kept, if it fits) when not held."""
        if key in self.items:
            self.items.move_to_end(key)
            return self.items[key][0]
        value = make()
        size = sum(a.nbytes for a in (value if isinstance(value, tuple) else (value,)) if isinstance(a, np.ndarray))
        if size <= self.limit:
            self.items[key] = (value, size)
            self.bytes += size
            while self.bytes > self.limit:
                _, (_, dropped) = self.items.popitem(last=False)
                self.bytes -= dropped
        return value


def _stack(parts: list):
    return sp.vstack(parts).tocsr() if sp.issparse(parts[0]) else np.vstack(parts)


class Screener:
    """Held-out figures of screened :class:`EmbeddingClassifier` fits on ``X``, ``Y``, without a pass each.

    Parameters
    ----------
    X, Y : dask.array.Array
        The training rows, as given to the fits.
    estimator_class : type
        :class:`~xmldask.models.EmbeddingClassifier` (or a subclass): whose parameters, held-out split and
        decoder warm start the screener uses.

    ``score(params)`` returns the ``history_[0]`` entry (``val_p@1``, ``val_loss``) that
    ``EmbeddingClassifier(**params).fit(X, Y)`` records, for the ``params`` that :meth:`applies` to, with the
    seconds it took and those of its solve alone (``solve_seconds``: what a setting whose statistics it
    :meth:`holds` costs).
    """

    def __init__(self, X, Y, estimator_class, template: dict | None = None):
        self.X, self.Y, self.estimator_class = X, Y, estimator_class
        # the search's template: the first pass gathers the held-out rows of its full fits too (:meth:`offer`)
        self.template = dict(template or {})
        self._offered: list = []  # what keeps the offers (computed_once holds them weakly)
        self._lock = threading.Lock()
        self._moments: dict[str, _Moments] = {}
        self._embeddings: dict[tuple, np.ndarray] = {}
        self._shared = _Cache(CACHE_BYTES)  # by split: centred Gram matrices and their factors (:data:`CACHE_BYTES`)
        self.n_passes = 0

    @staticmethod
    def _rembrandt() -> Rembrandt:
        return Rembrandt()  # the fit's: EmbeddingClassifier makes Rembrandt(n_components, random_state)

    def _route(self) -> str | None:
        """``"primal"`` where the fit's least squares take the one-pass Cholesky route, ``"dual"`` where they are
        solved in the dual, ``None`` otherwise (conjugate gradients: no shared statistics)."""
        d, n_labels = self.X.shape[1], self.Y.shape[1]
        if d <= MAX_GRAM_FEATURES:
            return "primal" if d * n_labels <= MAX_CROSS_ENTRIES else None
        return "dual" if solvers.dual_applies(self.X.shape[0]) else None

    def applies(self, params: dict) -> bool:
        """Whether ``params`` is a screened setting this screener computes as the fit would."""
        return (params.get("kernel") in ("none", "identity") and params.get("max_epochs") == 0
                and self._shares_map(params))

    def _shares_map(self, params: dict) -> bool:
        """Whether the fit of ``params`` (any kernel and epochs) takes Rembrandt's embedding and a ridge map onto it
        that these statistics give."""
        emb = self._rembrandt()
        return (isinstance(params.get("embedding"), str) and params["embedding"].lower() == "rembrandt"
                and self._route() is not None
                and not emb.center and emb.solver == "auto" and params.get("validation_fraction", 0) > 0)

    def score(self, params: dict, *, loss: bool = True) -> dict:
        """The held-out figures of the fit of ``params`` (``val_p@1``, ``val_loss``, ``seconds``); ``loss=False``:
        without ``val_loss`` and the decoder's rescaling, which the loss needs and P@k does not (on bibtex a fifth of
        a screened setting's time)."""
        if not self.applies(params):
            raise ValueError(f"the screener does not compute {params}; fit it instead")
        start = time.perf_counter()
        est, p, seed, split = self._setting(params)
        if self._route() == "dual":
            G, FtY, n_t, Fh, Yh, task = self._dual_decoder(est, p, split, seed)
        else:
            G, FtY, n_t, Fh, Yh, task = self._primal_decoder(est, p, split, seed)
        task = task if est.task == "auto" else est.task
        d = DecoderData(X=None, Y=None, split=split, state={}, G=G, FtY=FtY, n_train=int(round(n_t)), task=task,
                         loss_fn=K.softmax_loss if task == "multiclass" else K.logistic_loss, Fh=Fh,
                         Yh=Yh if Fh is not None else None, t_start=start)
        est._warm_start(d, p, loss=loss)
        end = time.perf_counter()
        figures = {**d.history[0], "seconds": end - start, "solve_seconds": end - self._ready}
        if not loss:
            del figures["val_loss"]
        return figures

    def _setting(self, params: dict) -> tuple:
        """The estimator of ``params``, its validated parameters, its seed and its held-out split (as its fit's)."""
        est = self.estimator_class(**params)
        p = est._validated()
        seed = seed_of(params.get("random_state"))
        rng_split = np.random.default_rng(np.random.SeedSequence(seed).spawn(4)[0])
        return est, p, seed, est._held_out(self.X, p, int(rng_split.integers(2**63)))

    def holds(self, params: dict) -> bool:
        """Whether the statistics that :meth:`score` takes for ``params`` are held already (its score then a solve,
        no pass nor decomposition): for a time budget's estimate of its cost."""
        est, p, seed, split = self._setting(params)
        dual = self._route() == "dual"
        m = self._moments.get(("dual", est.features) if dual else est.features)
        if m is None or (not dual and (split.seed, split.fraction) not in m.held):
            return False
        identity = est._every_label(p, self.Y.shape[1]) is not None
        return identity or (("dual",) * dual + (est.features, p["n_components"], seed)) in self._embeddings

    @staticmethod
    def _normal_equations(F: np.ndarray, Y) -> tuple[np.ndarray, np.ndarray]:
        """``[F, 1]^T [F, 1]`` and ``[F, 1]^T Y`` (float64) of the training rows' embedded predictions ``F``."""
        s = F.sum(axis=0)
        G = np.empty((F.shape[1] + 1,) * 2)
        G[:-1, :-1] = F.T @ F
        G[:-1, -1] = G[-1, :-1] = s
        G[-1, -1] = F.shape[0]
        FtY = np.vstack([np.asarray(Y.T @ F).T, np.asarray(Y.sum(axis=0)).reshape(1, -1)])
        return G, FtY

    def offer(self, params: dict) -> bool:
        """Make what a full fit of ``params`` (any kernel, decoder epochs or not) first computes from the data, from
        these statistics instead, and offer it to the fit under its own keys (:func:`~xmldask.scheduling.computed_once`;
        kept while this screener is): its Rembrandt embedding, its ridge map onto it and, on the linear map, its
        decoder's normal equations and held-out features, to rounding what the fit would compute. The fit then
        makes no pass before its decoder's (none at all on the linear map with the ridge decoder alone). Only from
        statistics held already, with the held-out rows of the fit's split (the first pass gathers the template's),
        and on the primal route (the dual's map is a pass over the rows). Returns whether it offered them."""
        if self._route() != "primal" or not self._shares_map(params):
            return False
        with self._lock:  # the fits of a search step ask at once, from threads
            est, p, seed, split = self._setting(params)
            m = self._moments.get(est.features)
            if m is None or (split.seed, split.fraction) not in m.held:
                return False
            R = est._every_label(p, self.Y.shape[1])
            if R is None:
                R = _read_only(self._embedding(m, p, seed))
                key = est._embedding_key("rembrandt", p, seed, m.X, self.Y)
                self._offered.append(computed_once(key, lambda: (R, 0, "the screen's statistics"))[0])
                R = self._offered[-1][0]  # the one the fit takes (another fit's, if one made it first)
            W, c, G, FtY, n_t, Fh, Yh = self._decoder_statistics(m, R, p, split)
            W, c = _read_only(W), _read_only(c)
            key = est._ridge_map_key(m.X, self.Y, R, p, split)
            self._offered.append(computed_once(key, lambda: (W, c, 0, "the screen's statistics"))[0])
            if p["kernel"] == "none":
                W, c = self._offered[-1][:2]  # those the fit takes (another fit's, if one made them first)
                key = est._decoder_data_key(m.X, self.Y, split, W, c, p)
                value = tuple(_read_only(a) if isinstance(a, np.ndarray) else a for a in (G, FtY, Fh)) + (
                    Yh if Fh is not None else None, m.task, 0, "the screen's statistics")
                self._offered.append(computed_once(key, lambda: value)[0])
        return True

    def _primal_decoder(self, est, p, split, seed):
        """The decoder's normal equations, held-out features and task from ``X^T X``, ``X^T Y``, the held-out rows."""
        m = self._statistics(est, p, split)
        R = est._every_label(p, self.Y.shape[1])
        R = self._embedding(m, p, seed) if R is None else R
        self._ready = time.perf_counter()  # what follows is a solve on the statistics
        _, _, A, FtY, n_t, Fh, Yh = self._decoder_statistics(m, R, p, split)
        return A, FtY, n_t, Fh, Yh, m.task

    def _decoder_statistics(self, m: _Moments, R: np.ndarray, p: dict, split):
        """The ridge map ``W``, ``c`` onto ``R`` on the training rows of ``split``, and its decoder's normal equations
        ``F^T F``, ``F^T Y`` over those rows, their number and the held-out rows' ``F`` and ``Y``."""
        Xh, Yh = m.held[split.seed, split.fraction]
        W, c, (Gc, mu, C_t, y_t, n_t, WGW) = self._feature_map(m, (split.seed, split.fraction), Xh, Yh, R, p)
        # the decoder's normal equations of F = [X W + c, 1] over the training rows, from the statistics:
        # X^T X = Gc + n mu mu^T and X^T 1 = n mu over them
        W64, c64 = W.astype(np.float64), c.astype(np.float64)
        Wm = W64.T @ mu
        Ws = n_t * Wm
        A = np.empty((W.shape[1] + 1,) * 2)
        A[:-1, :-1] = (WGW + n_t * np.outer(Wm, Wm) + np.outer(Ws, c64) + np.outer(c64, Ws)
                       + n_t * np.outer(c64, c64))
        A[:-1, -1] = A[-1, :-1] = Ws + n_t * c64
        A[-1, -1] = n_t
        FtY = np.vstack([W64.T @ C_t + np.outer(c64, y_t), y_t[None, :]])
        Fh = K.decoder_features(Xh, W, c) if Xh.shape[0] else None
        return W, c, A, FtY, n_t, Fh, Yh

    def _dual_decoder(self, est, p, split, seed):
        """The same from the rows' Gram matrix: every row's embedded prediction ``k_c(x, T) A + ybar_T^T R``."""
        g = self._rows_gram(est, p)
        held = np.concatenate([split.mask(b) for b in range(len(split.chunks))])
        T, H = np.flatnonzero(~held), np.flatnonzero(held)
        R = est._every_label(p, self.Y.shape[1])
        R = (self._dual_embedding(g, p, seed) if R is None else R).astype(np.float64)
        self._ready = time.perf_counter()  # what follows is a solve on the statistics

        def centred():  # the training rows' Gram matrix K_TT, centred by their mean
            M = g.K[np.ix_(T, T)]
            row_means = M.mean(axis=1)
            overall = row_means.mean()
            M -= row_means[:, None]
            M -= row_means[None, :]
            M += overall
            return M, row_means, np.array([overall, np.trace(M)])

        M, row_means, (overall, trace) = self._shared.get(("dual", g.features, split.seed, split.fraction), centred)
        Y_T = g.Y[T]
        YR = np.asarray(Y_T @ R)
        c = YR.mean(axis=0)
        lam = p["alpha"] * trace / g.n_features

        def factor():
            Ml = M.copy()
            Ml[np.diag_indices_from(Ml)] += lam
            return scipy.linalg.cho_factor(Ml, lower=True, overwrite_a=True)

        A = scipy.linalg.cho_solve(self._shared.get(("dual", g.features, split.seed, split.fraction, p["alpha"]),
                                                    factor), YR - c)
        dtype = p["dtype"]
        # the training rows' predictions K_TT A + c are YR - lam A, since (K_TT + lam I) A = YR - c: no product
        F_T = (YR - lam * A).astype(dtype).astype(np.float64)  # as the fit's float32 features round them
        G, FtY = self._normal_equations(F_T, Y_T)
        Fh = Yh = None
        if H.size:
            K_HT = g.K[np.ix_(H, T)]
            K_HT -= K_HT.mean(axis=1)[:, None]
            K_HT -= row_means[None, :] - overall
            Fh = np.empty((H.size, A.shape[1] + 1), dtype=dtype)
            Fh[:, :-1] = K_HT @ A + c
            Fh[:, -1] = 1
            Yh = sp.csr_matrix(g.Y[H], dtype=np.float32)
        return G, FtY, T.size, Fh, Yh, g.task

    def _rows_gram(self, est, p) -> _RowsGram:
        """The rows' Gram matrix of ``est``'s input normalisation and the labels (a pass if new)."""
        features = est.features
        g = self._moments.get(("dual", features))
        if g is None:
            from ..linalg.solvers import gather_rows

            est._fit_idf(self.X, p["dtype"])
            self.n_passes += est.features == "tfidf"
            X = est._input_features(self.X)
            Kx = row_gram(X, dtype=np.float64).compute()
            Y = gather_rows(self.Y, sparse=True).astype(np.float64)
            counts = np.diff(Y.indptr)  # stored labels per row, as the fit's decoder pass counts them
            task = "multiclass" if counts.size and counts.min() == counts.max() == 1 else "multilabel"
            g = _RowsGram(K=Kx, Y=Y, idf=est.idf_, task=task, features=features, n_features=X.shape[1])
            self._moments[("dual", features)] = g
            self.n_passes += 1
        return g

    def _dual_embedding(self, g: _RowsGram, p: dict, seed: int) -> np.ndarray:
        """Rembrandt's ``R`` as the fit makes it in the dual (all rows, the fit's seed), by ``(features, k, seed)``."""
        key = ("dual", g.features, p["n_components"], seed)
        if key not in self._embeddings:
            emb = self._rembrandt()
            if g.rembrandt is None:
                g.rembrandt = RembrandtMoments.from_rows_gram(g.K, g.Y, g.n_features, alpha=emb.alpha,
                                                              scale_alpha=emb.scale_alpha)
            V = g.rembrandt.embedding(p["n_components"], oversample=emb.oversample, n_iter=emb.n_iter,
                                      random_state=seed, dtype=working_dtype(self.X.dtype, self.Y.dtype))
            self._embeddings[key] = V.astype(p["dtype"])
        return self._embeddings[key]

    # -- the shared statistics ------------------------------------------------------------------

    def prepare(self, params_list: list[dict]) -> None:
        """Gather, in one pass, the statistics and held-out rows that :meth:`score` of ``params_list`` will ask for
        (the repeats of a setting: the same one on other seeds; the settings of a search step: other input
        normalisations, each's statistics a task of the same pass, computed side by side), instead of a pass each."""
        if self._route() != "primal":
            return
        by_features: dict = {}
        for params in params_list:
            if self.applies(params):
                est, p, _, split = self._setting(params)
                by_features.setdefault(est.features, (est, p, []))[2].append(split)
        self._gather(list(by_features.values()))

    def _statistics(self, est, p, split, *more) -> _Moments:
        """The statistics of ``est``'s input normalisation, with the held-out rows of ``split`` (and of the ``more``
        splits: a pass gathers all those not held)."""
        self._gather([(est, p, [split, *more])])
        return self._moments[est.features]

    def _gather(self, wanted: list[tuple]) -> None:
        """For each ``(est, p, splits)`` of ``wanted`` (one an input normalisation), the statistics of ``est``'s input
        normalisation and the held-out rows of ``splits``, those not held, in one compute (a tf-idf's document counts
        first, a pass of their own)."""
        plans, lazy, gathered = [], [], []
        for est, p, splits in wanted:
            features = est.features
            m = self._moments.get(features)
            if m is None and self.template and self._shares_map(self.template):
                # and those of the full fits, which may take their statistics (:meth:`offer`)
                splits = [*splits, self._setting(self.template)[3]]
            keys = list(dict.fromkeys((s.seed, s.fraction) for s in splits))
            missing = [key for key in keys if m is None or key not in m.held]
            if not missing:
                continue
            if m is None:
                est._fit_idf(self.X, p["dtype"])
                self.n_passes += est.features == "tfidf"
                X = est._input_features(self.X)
            else:
                X = m.X
            Y = self.Y
            held = per_block_objects(_held_rows, X, Y, splits=tuple(missing))
            moments = None
            if m is None:
                counts = x_q(Y, np.ones((Y.shape[1], 1), dtype=np.float32))
                moments = [gram(X, dtype=np.float64), column_sums(X), xt_b(X, Y), column_sums(Y), counts.min(),
                           counts.max()]
            plans.append((est, X, missing))
            lazy.append(moments)
            gathered.append(held)
        # the arrays' reductions and the delayed blocks as separate arguments: Dask 2026.8 mixes up the values of
        # arrays and delayed objects nested together in one collection (as in per_block_objects' keywords)
        moments_out, held_out = dask.compute(lazy, gathered)
        for (est, X, missing), moments, blocks in zip(plans, moments_out, held_out):
            if moments is not None:
                f64 = np.float64
                G, s, C, y, low, high = moments
                task = "multiclass" if (int(low), int(high)) == (1, 1) else "multilabel"
                self._moments[est.features] = _Moments(
                    X=X, idf=est.idf_, G=np.asarray(G, f64), s=np.asarray(s, f64), C=np.asarray(C, f64),
                    y=np.asarray(y, f64), task=task, held={}, features=est.features)
            m = self._moments[est.features]
            self.n_passes += 1
            for i, key in enumerate(missing):
                m.held[key] = (_stack([b[i][0] for b in blocks]), _stack([b[i][1] for b in blocks]).tocsr())

    def _embedding(self, m: _Moments, p: dict, seed: int) -> np.ndarray:
        """Rembrandt's ``R`` as the fit makes it (all rows, the fit's seed), by ``(features, k, seed)``."""
        key = (m.features, p["n_components"], seed)
        if key not in self._embeddings:
            emb = self._rembrandt()
            if m.rembrandt is None:
                m.rembrandt = RembrandtMoments(m.G, m.C, m.y, self.X.shape[0], alpha=emb.alpha,
                                               scale_alpha=emb.scale_alpha)
            V = m.rembrandt.embedding(p["n_components"], oversample=emb.oversample, n_iter=emb.n_iter,
                                      random_state=seed, dtype=working_dtype(m.X.dtype, self.Y.dtype))
            self._embeddings[key] = V.astype(p["dtype"])
        return self._embeddings[key]

    def _feature_map(self, m: _Moments, split: tuple, Xh, Yh, R: np.ndarray, p: dict):
        """``W``, ``c`` of the ridge onto ``Y R`` over the training rows of ``split`` (its seed and fraction; centred,
        ``lam = alpha tr / d``), and their statistics ``(X_c^T X_c, mean row, X^T Y, Y^T 1, n)``."""
        f64 = np.float64
        Xh64 = sp.csr_matrix(Xh, dtype=f64) if sp.issparse(Xh) else np.asarray(Xh, dtype=f64)
        n_t = float(self.X.shape[0] - Xh.shape[0])

        def centred():  # the training rows' centred Gram matrix and mean row, made in one d x d buffer
            Gc = t_product(Xh64, Xh64)
            np.subtract(m.G, Gc, out=Gc)
            mu = (m.s - np.asarray(Xh64.sum(axis=0), dtype=f64).ravel()) / n_t
            # Gc -= n mu mu^T in place, on whichever of Gc and its transpose (the same matrix) is column-major
            Gc = scipy.linalg.blas.dger(-n_t, mu, mu, a=Gc if Gc.flags.f_contiguous else Gc.T, overwrite_a=True)
            return Gc, mu, np.array([np.trace(Gc)])

        Gc, mu, (trace,) = self._shared.get(("primal", m.features, *split), centred)
        Yh64 = sp.csr_matrix(Yh, dtype=f64)
        C_t = m.C - t_product(Xh64, Yh64)
        y_t = m.y - np.asarray(Yh64.sum(axis=0), dtype=f64).ravel()
        R64 = np.asarray(R, dtype=f64)
        B = C_t @ R64 - np.outer(mu, y_t @ R64)
        d = Gc.shape[0]
        lam = p["alpha"] * trace / d
        def factor():  # Gc + lam I, made in place of a d x d identity (three d x d passes less)
            Gl = Gc.copy()
            Gl[np.diag_indices_from(Gl)] += lam
            return scipy.linalg.cho_factor(Gl, lower=True, overwrite_a=True)

        chol = self._shared.get(("primal", m.features, *split, p["alpha"]), factor)
        Z = scipy.linalg.cho_solve(chol, B)
        c = (y_t @ R64) / n_t - mu @ Z
        # Z^T Gc Z without the d x d product: (Gc + lam I) Z = B, so Gc Z = B - lam Z (k x d x k, not k x d x d; the
        # map W is Z rounded to the fit's dtype, a relative 1e-7 in float32)
        ZGZ = Z.T @ (B - lam * Z)
        ZGZ = (ZGZ + ZGZ.T) / 2
        return Z.astype(p["dtype"]), c.astype(p["dtype"]), (Gc, mu, C_t, y_t, n_t, ZGZ)
