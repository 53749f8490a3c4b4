"""LEML: low-rank empirical risk minimisation for multi-label learning with missing labels, out of core.

:class:`LEML` fits ``Z = W H^T`` (``W``: ``n_features x k``, ``H``: ``n_labels x k``) minimising eq. (4)

    ``J(W, H) = sum_{(i, j) in Omega} l(Y_ij, x_i^T W h_j) + lam / 2 (||W||_F^2 + ||H||_F^2)``

(a sum over the observed entries ``Omega``, not a mean) by alternating minimisation, H-step first
(the paper's order) from a random ``W``:

- **W-step** (eq. (6)): a ``d k``-dimensional regularised problem whose gradient and Hessian-vector
  products are one pass each over the row blocks of ``X``, ``Y`` (and the observed-entry mask):
  eqs. (9)-(10) / Algorithm 1 for losses on ``Omega``, eqs. (11)-(12) / Algorithm 2 for the squared
  loss with full labels. Neither the ``n x L`` residual nor the ``d k``-dimensional Kronecker rows
  are formed; ``W`` and ``H`` are the only dense operands shipped to the blocks. The squared loss
  gives a linear system, solved by conjugate gradients (``scipy.sparse.linalg.cg``, warm-started
  from the previous ``W``: ``J`` never increases); the logistic and squared-hinge losses by
  trust-region Newton-CG (``scipy.optimize.minimize(method="trust-ncg")`` with ``hessp``), the
  Newton method of TRON that the paper uses.
- **H-step** (eq. (5)): independent per label, ``k`` variables each, in memory. Squared loss, full
  labels: ``H = Y^T Z (Z^T Z + lam/2 I)^-1`` from one pass (``Z^T Z``, ``Y^T Z``, ``Z = X W``);
  squared loss on ``Omega``: one pass accumulates every label's ``k x k`` Gram matrix over its
  observed rows, then ``L`` Cholesky solves; logistic / squared hinge: ``Z`` (``n x k``) and the
  observed entries are gathered once per H-step and every label's problem is solved by
  trust-region Newton-CG in memory.

Labels: the squared loss with full labels keeps ``Y`` in ``{0, 1}`` (decision threshold 0.5);
every other case encodes observed entries ``+1`` (relevant) / ``-1`` (not) and thresholds at 0, as
the reference implementation does. :class:`BinaryRelevance` is the paper's baseline: one ridge
regression per label on its observed entries, i.e. eq. (2) with a Frobenius regulariser, solved
as the W-step with ``H = I``.

References
----------
Yu, H.-F., Jain, P., Kar, P. and Dhillon, I. S. "Large-scale Multi-label Learning with Missing Labels"
(ICML 2014): eqs. (1)-(12), Algorithms 1-2, Claim 1 (the closed form the full-label squared loss
reaches as ``lam -> 0``), Section 5.2 (binary relevance on observed entries). Lin, C.-J., Weng, R. C.
and Keerthi, S. S. "Trust region Newton method for large-scale logistic regression" (JMLR 2008).
"""

from __future__ import annotations

import logging
import math
import time
from typing import Annotated, Literal

import dask
import dask.array as da
import numpy as np
import scipy.linalg
import scipy.optimize
import scipy.sparse as sp
import scipy.sparse.linalg as spla
from pydantic import Field

from ..base import NotFittedError, ParamsMixin, as_rows, check_float, check_int, seed_of
from ..linalg import dense_operand, x_q, xt_b, xt_x_q, yt_x_z
from ..linalg import gram as linalg_gram
from ..linalg.passes import block_sum
from ..params import FEATURES_HELP, FamilyParams
from ..store.models import SavedModel
from . import _graph
from . import _kernels as K
from . import _leml_kernels as LK

__all__ = ["LEML", "LEML_VERSION", "BinaryRelevance", "BinaryRelevanceParams", "LEMLParams"]

logger = logging.getLogger("xmldask.models")

#: version of the saved-model layout of :class:`LEML` and :class:`BinaryRelevance`
LEML_VERSION = 1

#: the loss names (:data:`xmldask.models._leml_kernels.LOSSES`)
LOSSES = LK.LOSSES

#: decision thresholds of the two label encodings: ``{0, 1}`` targets (full-label squared loss), ``+-1``
THRESHOLD_01, THRESHOLD_PM1 = 0.5, 0.0

#: largest per-block result of the squared-loss H-step on ``Omega`` (``n_labels x (k^2 + k + 1)`` float64)
LABEL_GRAM_MAX_BYTES = 1 << 30

#: ``solver="auto"`` solves the full-label squared loss exactly in memory (``solver="gram"``) when
#: ``X^T X`` and ``X^T Y`` (``n_features x (n_features + n_labels)`` float64) take at most this much
GRAM_MAX_BYTES = 256 << 20

SOLVERS = ("auto", "gram", "passes")

INITS = ("spectral", "random")
#: extra columns of the random sketch of ``X^T T`` that the spectral initialisation takes
INIT_OVERSAMPLE = 10

ROWS, WHOLE = "rows", "whole"

#: the input rows a LEML or binary-relevance model sees: as they are, or scaled to unit L2 norm
FEATURES = ("raw", "l2")


# --------------------------------------------------------------------------------------------
# graph functions: one pass each


def _pass(kernel, X, Y, O, whole: dict, *, tail: tuple, static: dict, token: str, split_every: int = 8):
    """Tree sum over row blocks of ``kernel(Xb, Yb, [Ob], **whole, **static)``, lazily."""
    ops = [("Xb", X, ROWS), ("Yb", Y, ROWS), ("Ob", O, ROWS)]
    ops += [(name, dense_operand(value, name=name), WHOLE) for name, value in whole.items()]
    return block_sum(kernel, ops, tail=tail, dtype=np.float64, token=token, static=static, split_every=split_every)


def _label_stats_kernel(Xb, Yb, W, Ob=None, *, n_labels: int):
    E = LK.signed_entries(Yb, Ob, n_labels)
    Z = np.asarray(Xb @ W, dtype=np.float64)
    G, r = LK.label_grams(Z, E)
    count = np.diff(E.tocsc().indptr).astype(np.float64)
    return np.concatenate([G.reshape(n_labels, -1), r, count[:, None]], axis=1)


def _topk_kernel(Xb, W, HT, k=5):
    F = np.asarray(Xb @ W, dtype=np.float64)
    labels, scores = K.topk_scores(F, HT, None, k)
    return np.concatenate([labels.astype(np.float64), scores.astype(np.float64)], axis=1)


def _scores_kernel(Xb, W, HT):
    return (np.asarray(Xb @ W, dtype=np.float64) @ HT).astype(np.float32)


def _with_constant(Xb):
    """A row block with a constant feature 1 appended (the intercept's column)."""
    ones = np.ones((Xb.shape[0], 1), dtype=Xb.dtype)
    if sp.issparse(Xb):
        return sp.hstack([sp.csr_matrix(Xb), sp.csr_matrix(ones)], format="csr")
    return np.hstack([np.asarray(Xb), ones])


def _nnz_pass(A: da.Array):
    """Lazy number of stored entries of a Dask array of sparse row blocks."""
    return A.map_blocks(lambda b: np.array([[b.nnz]], dtype=np.int64), chunks=((1,) * A.numblocks[0], (1,)),
                        dtype=np.int64, meta=np.empty((0, 0), np.int64)).sum()


class _Counter:
    """Counts passes over the row blocks (one ``dask.compute`` of a pass graph each)."""

    def __init__(self):
        self.n = 0

    def compute(self, *graphs):
        self.n += 1
        return dask.compute(*graphs)


class _WProblem:
    """The W-step objective of eq. (6) for fixed ``H``: value + gradient and Hessian-vector products, one pass each.

    ``full_sq``: squared loss, every entry observed, ``Y`` in ``{0, 1}`` (Algorithm 2); otherwise
    Algorithm 1 over ``Omega`` (the mask ``O``, or every entry) with ``+-1`` labels.
    """

    def __init__(self, X, Y, O, H, lam, loss, full_sq, counter: _Counter):
        self.X, self.Y, self.O, self.H, self.lam, self.loss = X, Y, O, H, lam, loss
        self.full_sq, self.counter = full_sq, counter
        # H=None: the identity (binary relevance: one problem per label), never formed nor shipped
        self.d, self.k = X.shape[1], Y.shape[1] if H is None else H.shape[1]
        self.M = None if H is None else H.T @ H
        self._last = None

    def _whole(self, **arrays) -> tuple[dict, dict]:
        """The operands of a pass (``H`` and ``M`` when not the identity) and its static arguments."""
        identity = {name: None for name in ("H", "M") if name in arrays and arrays[name] is None}
        return {name: value for name, value in arrays.items() if name not in identity}, identity

    def fun_grad(self, w):
        if self._last is not None and np.array_equal(self._last[0], w):
            return self._last[1], self._last[2]
        W = w.reshape(self.d, self.k)
        d = self.d
        if self.full_sq:
            whole, static = self._whole(W=W, H=self.H, M=self.M)
            out = _pass(LK.block_sq_full_grad, self.X, self.Y, None, whole, tail=(d + 1, self.k), static=static,
                        token="leml-sq-grad-block")
            (out,) = self.counter.compute(out)
            G = 2.0 * out[:d]
        else:
            whole, static = self._whole(W=W, H=self.H)
            out = _pass(LK.block_grad, self.X, self.Y, self.O, whole, tail=(d + 1, self.k),
                        static={"loss": self.loss, **static}, token="leml-grad-block")
            (out,) = self.counter.compute(out)
            G = out[:d]
        f = float(out[d, 0]) + 0.5 * self.lam * float(np.vdot(W, W))
        g = (G + self.lam * W).ravel()
        self._last = (w.copy(), f, g)
        return f, g

    def hessp(self, w, s):
        S = np.asarray(s).reshape(self.d, self.k)
        if self.full_sq:
            (HS,) = self.counter.compute(xt_x_q(self.X, S if self.M is None else S @ self.M))
            HS = 2.0 * np.asarray(HS, dtype=np.float64)
        else:
            W = np.zeros_like(S) if w is None else np.asarray(w).reshape(self.d, self.k)
            whole, static = self._whole(W=W, H=self.H, S=S)
            out = _pass(LK.block_hessp, self.X, self.Y, self.O, whole, tail=(self.d, self.k),
                        static={"loss": self.loss, **static}, token="leml-hessp-block")
            (HS,) = self.counter.compute(out)
        return (HS + self.lam * S).ravel()


def _solve_quadratic(problem: _WProblem, W0: np.ndarray, *, tol: float, max_iter: int) -> tuple[np.ndarray, dict]:
    """The squared-loss W-step: ``(grad^2 g) w = -grad g(0)`` by CG from ``W0`` (1 pass per iteration)."""
    n = W0.size
    _, g0 = problem.fun_grad(np.zeros(n))
    b = -g0
    iters = [0]

    def matvec(s):
        iters[0] += 1
        return problem.hessp(None, s)

    op = spla.LinearOperator((n, n), matvec=matvec, dtype=np.float64)
    w, info = spla.cg(op, b, x0=W0.ravel(), rtol=tol, maxiter=max_iter)
    return w.reshape(W0.shape), {"cg_iterations": iters[0], "converged": info == 0}


def _solve_newton(fun_grad, hessp, x0: np.ndarray, *, tol: float, max_iter: int) -> tuple[np.ndarray, dict]:
    """Trust-region Newton-CG from ``x0`` until ``||grad|| <= tol ||grad(x0)||``."""
    _, g0 = fun_grad(x0)
    gtol = max(tol * float(np.linalg.norm(g0)), np.finfo(np.float64).tiny)
    res = scipy.optimize.minimize(fun_grad, x0, jac=True, hessp=hessp, method="trust-ncg",
                                  options={"gtol": gtol, "maxiter": max_iter})
    return res.x, {"newton_iterations": int(res.nit), "converged": bool(res.success), "fun": float(res.fun)}


class _GramProblem:
    """The full-label squared loss from ``G = X^T X`` and ``C = X^T Y`` alone (one pass), exactly.

    The small-feature shortcut of the paper's Algorithm 2: with ``G = U diag(g) U^T`` (once) and
    ``H^T H = V diag(m) V^T``, the W-step ``G W H^T H + lam/2 W = C H`` is solved exactly as
    ``W = U [(U^T C H V) / (g m^T + lam/2)] V^T``, and the H-step needs only ``Z^T Z = W^T G W`` and
    ``Y^T Z = C^T W``: no further pass over the rows. Where ``g_a m_b + lam/2`` vanishes (``lam = 0``,
    a singular ``G``) that entry is 0: the minimum-norm solution.
    """

    def __init__(self, G: np.ndarray, C: np.ndarray, nnz_y: float):
        self.G, self.C, self.nnz_y = 0.5 * (G + G.T), C, float(nnz_y)
        self.g, self.U = np.linalg.eigh(self.G)
        self.g = np.clip(self.g, 0.0, None)

    def h_step(self, W: np.ndarray, lam: float) -> tuple[np.ndarray, float]:
        return _h_full_sq(self.C.T @ W, W.T @ self.G @ W, W, lam, self.nnz_y)

    def w_step(self, H: np.ndarray, lam: float) -> tuple[np.ndarray, float]:
        m, V = np.linalg.eigh(H.T @ H)
        m = np.clip(m, 0.0, None)
        den = np.multiply.outer(self.g, m) + 0.5 * lam
        num = self.U.T @ (self.C @ (H @ V))
        scale = max(float(den.max()), 1.0) * np.finfo(np.float64).eps * den.size
        W = self.U @ np.divide(num, den, out=np.zeros_like(num), where=den > scale) @ V.T
        return W, self.objective(W, H, lam)

    def objective(self, W: np.ndarray, H: np.ndarray, lam: float) -> float:
        """``||Y - X W H^T||^2 + lam/2 (||W||^2 + ||H||^2)`` with ``||Y||^2 = nnz(Y)`` (binary ``Y``)."""
        loss = self.nnz_y - 2.0 * float(np.vdot(W, self.C @ H)) + float(np.vdot(W.T @ self.G @ W, H.T @ H))
        return loss + 0.5 * lam * (float(np.vdot(W, W)) + float(np.vdot(H, H)))


def _h_full_sq(YtZ: np.ndarray, ZtZ: np.ndarray, W: np.ndarray, lam: float, nnz_y: float) -> tuple[np.ndarray, float]:
    """``H = Y^T Z (Z^T Z + lam/2 I)^-1`` and ``J`` after it, from ``Y^T Z`` and ``Z^T Z``."""
    C = 0.5 * (ZtZ + ZtZ.T)
    H = _solve_sym(C + 0.5 * lam * np.eye(C.shape[0]), YtZ.T).T
    # J = ||Y||^2 - 2 <H, Y^T Z> + <H^T H, Z^T Z> + lam/2 (||W||^2 + ||H||^2); ||Y||^2 = nnz(Y) (binary)
    loss = nnz_y - 2.0 * float(np.vdot(H, YtZ)) + float(np.vdot(H.T @ H, C))
    return H, loss + 0.5 * lam * (float(np.vdot(W, W)) + float(np.vdot(H, H)))


def _solve_sym(A: np.ndarray, B: np.ndarray) -> np.ndarray:
    """``A^-1 B`` for symmetric positive (semi)definite ``A`` (least squares when singular)."""
    try:
        return scipy.linalg.solve(A, B, assume_a="pos")
    except (np.linalg.LinAlgError, scipy.linalg.LinAlgError):
        return scipy.linalg.lstsq(A, B)[0]


# --------------------------------------------------------------------------------------------
# estimators


class BinaryRelevanceParams(FamilyParams):
    """``xmldask train --model br``: binary relevance (:class:`BinaryRelevance`) on the observed label entries;
    ``lam``, row scaling and an intercept chosen on held-out rows unless given."""

    model: Literal["br"] = "br"
    loss: Literal["squared", "logistic", "sqhinge"] = Field("squared", description="leml and br: the loss")
    lam: Annotated[float, Field(gt=0)] = Field(0.1, description="leml and br: the regulariser lam of eq. (4); "
                                                                 "chosen on held-out rows unless given (search auto)")
    features: Literal["raw", "l2", "tfidf"] = Field("raw", description=FEATURES_HELP)


class LEMLParams(BinaryRelevanceParams):
    """``xmldask train --model leml``: LEML (:class:`LEML`), low-rank ``Z = W H^T`` of rank ``k`` (Yu et al. 2014)
    on the observed label entries; ``lam``, row scaling and an intercept chosen on held-out rows unless given."""

    model: Literal["leml"] = "leml"
    n_components: Annotated[int, Field(gt=0)] = Field(50, description="leml: the rank k of Z = W H^T")
    n_iter: Annotated[int, Field(gt=0)] = Field(5, description="leml: alternations of the H- and W-steps")


_LEML, _BR = LEMLParams(), BinaryRelevanceParams()


class _LowRankLinear(SavedModel, ParamsMixin):
    """Scores ``x^T W H^T``: prediction, persistence and input checks shared by LEML and binary relevance."""

    _MODEL_VERSION = LEML_VERSION
    _ARRAYS = ("W", "H")
    #: a model that scores every label against a decision threshold (``threshold_``): its evaluation adds the
    #: metrics of those scores (avg_AUC, the Hamming loss: LEML's Appendix E.1)
    thresholded = True
    _SCALARS = ("loss", "threshold", "n_features_in", "n_labels", "n_passes", "history", "observed_fraction",
                "solver")

    def _check_fitted(self) -> None:
        if getattr(self, "H_", None) is None:
            raise NotFittedError(f"this {type(self).__name__} is not fitted yet; call fit(X, Y) first")

    def _inputs(self, X, Y, observed):
        """Row blocks of ``X``, ``Y`` and the mask, checked for matching rows before any pass."""
        X = as_rows(X, "X")
        blocks = X.chunks[0][0] if X.chunks[0] else None
        Y = as_rows(Y, "Y", block_rows=None if isinstance(Y, da.Array) else blocks)
        if Y.shape[0] != X.shape[0]:
            raise ValueError(f"Y has {Y.shape[0]} rows but X has {X.shape[0]}; they must hold the same samples")
        if tuple(Y.chunks[0]) != tuple(X.chunks[0]):
            raise ValueError(f"Y's row blocks must be X's ({len(X.chunks[0])} blocks); fix: Y = Y.rechunk({{0: "
                             f"X.chunks[0]}}) (or open both from one dataset store)")
        if observed is not None:
            observed = as_rows(observed, "observed", block_rows=None if isinstance(observed, da.Array) else blocks)
            if observed.shape != Y.shape:
                raise ValueError(f"the observed-entry mask has shape {observed.shape} but Y has {Y.shape}; the mask "
                                 "must have one row per sample and one column per label (build it with xmldask mask)")
            if tuple(observed.chunks[0]) != tuple(Y.chunks[0]):
                raise ValueError("the observed-entry mask's row blocks must be Y's; fix: observed = "
                                 "observed.rechunk({0: Y.chunks[0]}) (or open both from one dataset store)")
        return X, Y, observed

    def _model_rows(self, X: da.Array) -> da.Array:
        """``X`` as the model sees it: rows scaled to unit L2 norm (``features="l2"``), then a constant feature 1
        (``fit_intercept``: the last row of ``W_`` is the intercept's)."""
        if _check_choice(getattr(self, "features", "raw"), "features", FEATURES) == "l2":
            X = _graph.transform_rows(X, None)
        if getattr(self, "fit_intercept", False):
            X = X.map_blocks(_with_constant, chunks=(X.chunks[0], (X.shape[1] + 1,)), dtype=X.dtype, meta=X._meta)
        return X

    def _rows(self, X) -> da.Array:
        return self._model_rows(super()._rows(X))

    def decision_function(self, X) -> da.Array:
        """Dense scores ``X W H^T`` of every label (float32), lazily, chunked like ``X``.

        Large for many labels (``n_samples x n_labels``); use :meth:`predict_topk` for rankings.
        Labels are predicted relevant where the score is ``>= threshold_``.

        Returns
        -------
        dask.array.Array, shape (n_samples, n_labels)
        """
        X = self._rows(X)
        return _graph._map_rows(_scores_kernel, X, whole={"W": self.W_, "HT": np.ascontiguousarray(self.H_.T)},
                                out_cols=self.n_labels_, dtype=np.float32, token="leml-scores")

    def predict_topk(self, X, k: int = 5) -> tuple[da.Array, da.Array]:
        """Top-``k`` labels (int32) and scores (float32), best first, per row block (ties: smaller id).

        A block's ``n_b x n_labels`` scores are formed in row sub-batches of at most
        :data:`xmldask.models._kernels.SCORE_BUDGET` entries. Compute both together for one pass.
        """
        X = self._rows(X)
        k = self._checked_k(k)
        packed = _graph._map_rows(_topk_kernel, X, whole={"W": self.W_, "HT": np.ascontiguousarray(self.H_.T)},
                                  static={"k": k}, out_cols=2 * k, dtype=np.float64, token="leml-topk")
        return packed[:, :k].astype(np.int32), packed[:, k:].astype(np.float32)

    def fit_dataset(self, data):
        """Fit on a dataset store's ``X``, ``Y`` and its observed-entry mask, if any."""
        return self.fit(data.X, data.Y, data.observed)

    def train_summary(self) -> dict:
        last = self.history_[-1] if getattr(self, "history_", None) else {}
        return {"n_passes": int(self.n_passes_), "task": "multilabel", "observed_fraction": self.observed_fraction_,
                "threshold": self.threshold_, "held_out": {}, "objective": last.get("J_after_H")}

    def _common_fit_state(self, X, Y, O, loss, counter: _Counter) -> da.Array:
        """Sizes, label encoding and threshold; with a mask, its observed fraction (one pass). Returns the rows as the
        model sees them (:meth:`_model_rows`)."""
        if not isinstance(getattr(self, "fit_intercept", False), (bool, np.bool_)):
            raise ValueError(f"fit_intercept must be True or False, but is {self.fit_intercept!r}")
        rows = self._model_rows(X)  # checks features before any pass
        self.n_features_in_, self.n_labels_ = int(X.shape[1]), int(Y.shape[1])
        self.loss_ = loss
        self.full_sq_ = O is None and loss == "squared"
        self.threshold_ = THRESHOLD_01 if self.full_sq_ else THRESHOLD_PM1
        self.observed_fraction_ = None
        if O is not None:
            (n_obs,) = counter.compute(_nnz_pass(O))
            self.observed_fraction_ = float(n_obs) / max(X.shape[0] * Y.shape[1], 1)
        return rows


def _check_choice(value, name: str, choices: tuple) -> str:
    if value not in choices:
        raise ValueError(f"{name} must be one of {', '.join(map(repr, choices))}, but is {value!r}")
    return value


def _check_loss(loss) -> str:
    if loss not in LOSSES:
        raise ValueError(f"loss must be one of {', '.join(map(repr, LOSSES))}, but is {loss!r}")
    return loss


class LEML(_LowRankLinear):
    """Low-rank ERM multi-label classifier ``Z = W H^T`` with missing labels (Yu et al. 2014).

    Parameters
    ----------
    n_components : int, default 50
        ``k``, the rank of ``Z`` (at most the number of labels).
    loss : {"squared", "logistic", "sqhinge"}, default "squared"
        Loss on the observed entries.
    lam : float, default 0.1
        ``lam`` of eq. (4), multiplying ``(||W||^2 + ||H||^2) / 2`` against a *summed* loss (the
        reference implementation's default ``-l 0.1``); choose it on held-out training rows.
    n_iter : int, default 5
        Alternations (H-step then W-step); the paper reports results after 5.
    tol : float, default 1e-3
        Relative stopping tolerance of each W-step (CG residual ``||r|| <= tol ||b||``; Newton:
        ``||grad|| <= tol ||grad(W_0)||``) and H-step Newton solve.
    max_cg_iter : int, default 20
        Most CG iterations (passes) of one squared-loss W-step (the reference implementation's 20;
        CG is warm-started from the previous ``W``, so an inexact W-step still lowers ``J``).
    max_newton_iter : int, default 10
        Most trust-region Newton iterations of one W-step or H-step (logistic / squared hinge).
    init : {"spectral", "random"}, default "spectral"
        The initial ``W``. ``spectral``: the top ``k`` left singular vectors of a random sketch
        ``X^T T Omega`` of ``X^T T`` (``T`` the training targets: ``Y``, or the observed entries as
        ``+-1``; ``Omega`` Gaussian with ``k + 10`` columns; one pass, or none on the Gram path), scaled
        by ``init_scale``: the subspace that best explains the targets linearly, as the SVD start of
        alternating minimisation for matrix completion (Jain, Netrapalli and Sanghavi 2013); columns
        beyond the rank of ``X^T T`` are random. ``random`` (the paper's code starts at random): normal
        with standard deviation ``init_scale / sqrt(n_features)``.
    init_scale : float, default 1.0
        Norm of each initial column of ``W`` (``random``: in expectation).
    features : {"raw", "l2"}, default "raw"
        The input rows as they are, or scaled to unit L2 norm (at fit and predict time).
    fit_intercept : bool, default False
        Append a constant feature 1 to every row (the intercept of LIBLINEAR's ``-B 1``; with ``+-1`` targets
        most entries are irrelevant, and the constant carries each label's base rate). ``W_`` gets a last row.
    solver : {"auto", "gram", "passes"}, default "auto"
        How the full-label squared loss is solved. ``gram``: one pass for ``X^T X`` and ``X^T Y``,
        then every alternation exactly in memory (each W-step solved exactly, not by ``max_cg_iter``
        CG steps; the paper's small-feature shortcut of Algorithm 2); ``passes``: the gradient and
        every CG step are passes over the rows. ``auto``: ``gram`` when those two matrices take at
        most :data:`GRAM_MAX_BYTES`, else ``passes``. Other losses and masked labels always make passes.
    random_state : int, Generator, SeedSequence or None
        Seed of the initial ``W``.

    Attributes
    ----------
    W_ : ndarray, shape (n_features, k), or (n_features + 1, k) with ``fit_intercept``
    H_ : ndarray, shape (n_labels, k)
    threshold_ : float
        0.5 (full-label squared loss, ``{0, 1}`` targets) or 0 (``+-1`` targets).
    history_ : list of dict
        Per alternation: ``J`` after the H-step and after the W-step, passes, solver iterations.
    n_passes_ : int
        Passes over the row blocks during ``fit``.
    solver_ : {"gram", "passes"}
        The solver used.
    """


    family = "leml"
    params_schema = LEMLParams
    #: ``xmldask train --model leml`` chooses these by held-out P@3 unless given (coordinate search, from the first
    #: values; the lam grid extended past a winning end): decades of lam, rows scaled or not, a constant feature
    auto_search = {"features": ["l2", "raw"], "fit_intercept": [True, False], "lam": [1.0, 10.0, 100.0]}
    search_scoring = "p@3"
    #: parameters saved under another name by earlier versions
    _FORMER_PARAMS = {"k": "n_components"}

    def __init__(self, *, n_components: int = _LEML.n_components, loss: str = _LEML.loss, lam: float = _LEML.lam,
                 n_iter: int = _LEML.n_iter, tol: float = 1e-3, max_cg_iter: int = 20, max_newton_iter: int = 10,
                 init: str = "spectral", init_scale: float = 1.0, solver: str = "auto", features: str = _LEML.features,
                 fit_intercept: bool = False, random_state=None):
        self.n_components, self.loss, self.lam, self.n_iter = n_components, loss, lam, n_iter
        self.tol, self.max_cg_iter, self.max_newton_iter = tol, max_cg_iter, max_newton_iter
        self.init, self.init_scale, self.solver, self.random_state = init, init_scale, solver, random_state
        self.features, self.fit_intercept = features, fit_intercept

    def __repr__(self) -> str:
        return f"LEML(n_components={self.n_components!r}, loss={self.loss!r}, lam={self.lam!r})"

    def search_bounds(self, X, Y) -> dict[str, tuple]:
        """``n_components`` is at most the number of labels; ``lam`` is positive."""
        return {"n_components": (1, int(Y.shape[1])), "lam": (0.0, math.inf)}

    def _validated(self, n_labels: int) -> dict:
        loss = _check_loss(self.loss)
        k = check_int(self.n_components, "n_components", 1)
        if k > n_labels:
            raise ValueError(f"n_components (the rank k) must be at most the number of labels ({n_labels}), but is "
                             f"{k}; a rank-k Z = W H^T with k > n_labels is not low rank: pass k <= {n_labels}")
        return dict(loss=loss, k=k, lam=check_float(self.lam, "lam"), n_iter=check_int(self.n_iter, "n_iter", 1),
                    tol=check_float(self.tol, "tol", low_open=True, high=1.0),
                    max_cg_iter=check_int(self.max_cg_iter, "max_cg_iter", 1),
                    max_newton_iter=check_int(self.max_newton_iter, "max_newton_iter", 1),
                    init=_check_choice(self.init, "init", INITS),
                    init_scale=check_float(self.init_scale, "init_scale", low_open=True),
                    solver=_check_choice(self.solver, "solver", SOLVERS))

    def fit(self, X, Y, observed=None) -> LEML:
        """Alternating minimisation of eq. (4): ``n_iter`` times an H-step, then a W-step.

        Parameters
        ----------
        X : dask.array.Array or scipy.sparse matrix, shape (n_samples, n_features)
            Row blocks (``open_dataset(url).X``).
        Y : dask.array.Array or scipy.sparse matrix, shape (n_samples, n_labels)
            Relevant labels, ``X``'s row blocks.
        observed : dask.array.Array or scipy.sparse matrix, shape (n_samples, n_labels), optional
            The observed entries (non-zeros; positives and negatives alike; ``open_dataset(url).observed``);
            ``None``: every entry is observed. Every relevant label must be observed.

        Returns
        -------
        LEML
            ``self``, fitted.
        """
        t0 = time.perf_counter()
        X, Y, O = self._inputs(X, Y, observed)
        p = self._validated(Y.shape[1])
        if p["lam"] == 0 and not (O is None and p["loss"] == "squared"):
            raise ValueError("lam must be positive except for the full-label squared loss (the closed form of Claim 1)")
        counter = _Counter()
        X = self._common_fit_state(X, Y, O, p["loss"], counter)
        rng = np.random.default_rng(seed_of(self.random_state))
        d, L, k = X.shape[1], Y.shape[1], p["k"]
        H = np.zeros((L, k))
        E = gram = None
        nnz_y = counter.compute(_nnz_pass(Y))[0] if self.full_sq_ else None
        self.solver_ = self._solver(p["solver"], d, L)
        if self.solver_ == "gram":
            G, C = counter.compute(linalg_gram(X, dtype=np.float64), xt_b(X, Y))
            gram = _GramProblem(np.asarray(G, np.float64), np.asarray(C, np.float64), nnz_y)
        W = self._initial_w(X, Y, O, p, rng, counter, gram)
        history = []
        for it in range(p["n_iter"]):
            before = counter.n
            if gram is not None:
                H, j_h = gram.h_step(W, p["lam"])
                W, j_w = gram.w_step(H, p["lam"])
                info = {}
            else:
                W, H, E, j_h, j_w, info = self._alternate(X, Y, O, W, H, E, p, counter, nnz_y)
            history.append({"iteration": it + 1, "J_after_H": j_h, "J_after_W": j_w, "passes": counter.n - before,
                            "seconds": round(time.perf_counter() - t0, 3), **info})
            logger.info("LEML iteration %d: J %.6g after the H-step, %d passes", it + 1, j_h, counter.n - before)
        self.W_, self.H_ = W, H
        self.history_, self.n_passes_ = history, counter.n
        return self

    def _alternate(self, X, Y, O, W, H, E, p: dict, counter, nnz_y):
        """One H-step and one W-step by passes over the rows; ``(W, H, E, J after H, J after W, solver info)``
        (``E``: the observed entries, gathered once for the Newton H-steps)."""
        if self.full_sq_:
            H, j_h = self._h_step_full_sq(X, Y, W, p["lam"], counter, nnz_y)
        elif p["loss"] == "squared":
            H, j_h = self._h_step_sq_omega(X, Y, O, W, p["lam"], counter)
        else:
            if E is None:
                E = self._gather_entries(Y, O, counter)
            H, j_h = self._h_step_newton(X, E, W, H, p, counter)
        problem = _WProblem(X, Y, O, H, p["lam"], p["loss"], self.full_sq_, counter)
        if p["loss"] == "squared":
            W, info = _solve_quadratic(problem, W, tol=p["tol"], max_iter=p["max_cg_iter"])
        else:
            w, info = _solve_newton(problem.fun_grad, problem.hessp, W.ravel(), tol=p["tol"],
                                    max_iter=p["max_newton_iter"])
            W = w.reshape(W.shape)
        j_w = info.pop("fun", None)
        if j_w is not None:
            j_w += 0.5 * p["lam"] * float(np.vdot(H, H))
        return W, H, E, j_h, j_w, info

    def _initial_w(self, X, Y, O, p: dict, rng, counter, gram) -> np.ndarray:
        """``W`` to start from (``init``): ``n_features x k``, columns of norm ``init_scale``."""
        d, L, k = X.shape[1], Y.shape[1], p["k"]
        W = rng.standard_normal((d, k)) * (p["init_scale"] / math.sqrt(max(d, 1)))
        if p["init"] == "random":
            return W
        Omega = rng.standard_normal((L, min(L, k + INIT_OVERSAMPLE)))
        if gram is not None:
            B = gram.C @ Omega
        else:
            B = _pass(LK.block_target_sketch, X, Y, O, {"Omega": Omega}, tail=(d, Omega.shape[1]),
                      static={"n_labels": L, "encoding": "01" if self.full_sq_ else "pm1"}, token="leml-init-block")
            (B,) = counter.compute(B)
        U, s, _ = np.linalg.svd(np.asarray(B, np.float64), full_matrices=False)
        tol = s[0] * max(B.shape) * np.finfo(np.float64).eps if s.size else 0.0
        rank = min(k, int(np.count_nonzero(s > tol)))
        W[:, :rank] = p["init_scale"] * U[:, :rank]
        return W

    def _solver(self, solver: str, d: int, L: int) -> str:
        """``gram`` or ``passes`` (``gram`` only for the full-label squared loss)."""
        fits = 8 * d * (d + L) <= GRAM_MAX_BYTES
        if solver == "gram" and not self.full_sq_:
            has = f"the {self.loss_} loss" if self.loss_ != "squared" else "an observed-entry mask"
            raise ValueError(f"solver='gram' solves the full-label squared loss only; this fit has {has}: use "
                             "solver='auto' or 'passes'")
        return "gram" if solver == "gram" or (solver == "auto" and self.full_sq_ and fits) else "passes"

    # -- H-steps (eq. (5)) ---------------------------------------------------------------------

    @staticmethod
    def _h_step_full_sq(X, Y, W, lam, counter, nnz_y):
        """``H = Y^T Z (Z^T Z + lam/2 I)^-1``, ``Z = X W``; one pass (``Y^T Z`` and ``X^T X W``)."""
        YtZ, XtXW = counter.compute(yt_x_z(Y, X, W), xt_x_q(X, W))
        return _h_full_sq(np.asarray(YtZ, np.float64), W.T @ np.asarray(XtXW, np.float64), W, lam, nnz_y)

    @staticmethod
    def _h_step_sq_omega(X, Y, O, W, lam, counter):
        """Per label ``(2 G_j + lam I) h_j = 2 r_j`` from one pass accumulating ``G_j``, ``r_j`` over ``Omega_j``."""
        L, k = Y.shape[1], W.shape[1]
        width = k * k + k + 1
        if L * width * 8 > LABEL_GRAM_MAX_BYTES:
            raise ValueError(f"the squared-loss H-step on observed entries holds {L} labels x k^2 = {k * k} Gram "
                             f"entries per block ({L * width * 8 / 2**30:.1f} GiB); lower k")
        out = _pass(_label_stats_kernel, X, Y, O, {"W": W}, tail=(L, width), static={"n_labels": L},
                    token="leml-label-grams-block")
        (S,) = counter.compute(out)
        G = S[:, :k * k].reshape(L, k, k)
        r, count = S[:, k * k:k * k + k], S[:, -1]
        A = 2.0 * G + lam * np.eye(k)[None]
        H = np.linalg.solve(A, 2.0 * r[:, :, None])[:, :, 0]
        # sum_j sum_{i in Omega_j} (a_ij - z_i^T h_j)^2 = sum_j (|Omega_j| - 2 h_j^T r_j + h_j^T G_j h_j)
        loss = float(count.sum() - 2.0 * np.einsum("jk,jk->", H, r) + np.einsum("jk,jkl,jl->", H, G, H))
        return H, loss + 0.5 * lam * (float(np.vdot(W, W)) + float(np.vdot(H, H)))

    @staticmethod
    def _gather_entries(Y, O, counter):
        """Every row's signed observed entries (``O`` given) or relevant labels (``O is None``) as one CSR."""
        L = Y.shape[1]
        if O is None:
            blocks = counter.compute(*[Y.blocks[i] for i in range(Y.numblocks[0])])
            return ("full", sp.vstack([sp.csr_matrix(b) for b in blocks], format="csr"))
        E = da.map_blocks(LK.signed_entries, Y, O, n_labels=L, dtype=np.float64, meta=sp.csr_matrix((0, L)))
        blocks = counter.compute(*[E.blocks[i] for i in range(E.numblocks[0])])
        return ("omega", sp.vstack(blocks, format="csr"))

    @staticmethod
    def _h_step_newton(X, E, W, H, p, counter):
        """Every label's eq. (5) at once (the problems are independent), in memory, by trust-region Newton-CG.

        The transposed problem of the W-step kernels: rows are labels, the identity is their
        features, ``Z = X W`` plays ``H``.
        """
        (Z,) = counter.compute(x_q(X, W))
        Z = np.asarray(Z, np.float64)
        kind, M = E
        L, k = H.shape
        I_L = sp.identity(L, format="csr", dtype=np.float64)
        if kind == "full":
            Yt, Ot = M.T.tocsr(), None
        else:
            Et = M.T.tocsr()
            Yt = Et.copy()
            Yt.data = (Yt.data > 0).astype(np.float64)
            Yt.eliminate_zeros()
            Ot = Et
        lam, loss = p["lam"], p["loss"]

        def fun_grad(h):
            Hm = h.reshape(L, k)
            out = LK.block_grad(I_L, Yt, Hm, Z, Ot, loss=loss)
            return float(out[L, 0]) + 0.5 * lam * float(np.vdot(Hm, Hm)), (out[:L] + lam * Hm).ravel()

        def hessp(h, s):
            S = s.reshape(L, k)
            return (LK.block_hessp(I_L, Yt, h.reshape(L, k), Z, S, Ot, loss=loss) + lam * S).ravel()

        h, info = _solve_newton(fun_grad, hessp, H.ravel(), tol=p["tol"], max_iter=p["max_newton_iter"])
        return h.reshape(L, k), info["fun"] + 0.5 * lam * float(np.vdot(W, W))


class BinaryRelevance(_LowRankLinear):
    """Binary relevance: one L2-regularised regression per label on its observed entries (LEML's baseline).

    Minimises ``sum_{(i, j) in Omega} l(Y_ij, x_i^T w_j) + lam / 2 ||W||_F^2`` (eq. (2) with a
    Frobenius regulariser; the labels' problems are independent), as the LEML W-step with ``H = I``:
    one pass per CG iteration (squared loss) or per Newton gradient / Hessian product.

    Parameters
    ----------
    loss : {"squared", "logistic", "sqhinge"}, default "squared"
    lam : float, default 0.1
    tol, max_newton_iter, features, fit_intercept
        As :class:`LEML`.
    max_cg_iter : int, default 100
        Most CG iterations of the (single, cold-started) squared-loss solve.
    """


    family = "br"
    params_schema = BinaryRelevanceParams
    auto_search = LEML.auto_search
    search_scoring = LEML.search_scoring

    def __init__(self, *, loss: str = _BR.loss, lam: float = _BR.lam, tol: float = 1e-3, max_cg_iter: int = 100,
                 max_newton_iter: int = 10, features: str = _BR.features, fit_intercept: bool = False):
        self.loss, self.lam = loss, lam
        self.tol, self.max_cg_iter, self.max_newton_iter = tol, max_cg_iter, max_newton_iter
        self.features, self.fit_intercept = features, fit_intercept

    def __repr__(self) -> str:
        return f"BinaryRelevance(loss={self.loss!r}, lam={self.lam!r})"

    def fit(self, X, Y, observed=None) -> BinaryRelevance:
        """Fit ``W`` (``n_features x n_labels``); arguments as :meth:`LEML.fit`."""
        X, Y, O = self._inputs(X, Y, observed)
        loss = _check_loss(self.loss)
        lam = check_float(self.lam, "lam", low_open=True)
        tol = check_float(self.tol, "tol", low_open=True, high=1.0)
        counter = _Counter()
        X = self._common_fit_state(X, Y, O, loss, counter)
        d, L = X.shape[1], Y.shape[1]
        problem = _WProblem(X, Y, O, None, lam, loss, self.full_sq_, counter)  # H = I, never formed
        W0 = np.zeros((d, L))
        if loss == "squared":
            W, info = _solve_quadratic(problem, W0, tol=tol, max_iter=check_int(self.max_cg_iter, "max_cg_iter", 1))
        else:
            w, info = _solve_newton(problem.fun_grad, problem.hessp, W0.ravel(), tol=tol,
                                    max_iter=check_int(self.max_newton_iter, "max_newton_iter", 1))
            W = w.reshape(d, L)
        self.W_, self.H_ = W, np.eye(L)
        self.history_, self.n_passes_ = [info], counter.n
        return self
