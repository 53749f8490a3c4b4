"""The candidate-restricted classifier of the spectral label tree (Algorithm 1's ``H``).

:class:`TreeClassifier` scores only the candidates of a row's leaf: ``(U^T x)^T V_l + b_l`` with a
shared low-rank ``U`` (``n_features x k``) and a per-leaf ``V_l`` (``k x |C_l|``) and ``b_l`` (the
paper's ALOI form), or ``w_c^T x + b_{l,c}`` with weights per label shared by every leaf and a bias per
leaf and candidate (its text form, ODP and LSHTC); a softmax over the candidates (multiclass) or an
independent logistic per candidate (multilabel). Training streams rounds of rows one after the other,
carrying the model: every pass samples each row's leaf afresh by randomized routing (each internal node
draws left with its routing probability), skips rows whose labels miss the sampled leaf, and takes one
full-batch heavy-ball step per leaf present in the round, leaves in random order. A round is as many
consecutive row blocks as :data:`STEP_BYTES` holds (rows made dense), a row block where the rows stay
sparse; with every row in one round this is the reference code's loop. Inference routes
deterministically and ranks the leaf's candidates.

References
----------
Mineiro and Karampatziakis, "A Hierarchical Spectral Method for Extreme Classification" (2015),
Algorithm 1, section 3.5, section 5.2 (ALOI: rank-50 LR, shared U, per-leaf V and b); the authors'
code pmineiro/xlst ``aloi/runaloi.m`` (preconditioner, momentum, step schedule) and its ``treeupdate`` mex
(the text form: per-feature step scale, lazy momentum).
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
import scipy.sparse as sp
from pydantic import Field
from threadpoolctl import threadpool_limits

from ..base import NotFittedError, ParamsMixin, as_rows, check_float, check_int, seed_of
from ..linalg.passes import ROWS, WHOLE, gram, per_block, whole_operand
from ..params import FamilyParams
from ..store.models import SavedModel
from ..tree import leaf_of, route_pairs, rows_by_node
from ..tree.growth import router_operand, routing_routers
from ..tree.model import SpectralLabelTree
from . import _kernels as MK
from ._graph import HeldOut

__all__ = ["TREE_CLASSIFIER_VERSION", "CandidateScorer", "TreeClassifier", "TreeClassifierParams"]

logger = logging.getLogger(__name__)

TREE_CLASSIFIER_VERSION = 2
#: the preconditioner of ``U``'s gradient is the full ``(0.5 X^T X + ridge tr/d I)^-1`` (rows made dense) up to
#: this many features, its diagonal beyond (rows kept sparse, a step touching only the rows of ``U`` at the
#: leaf's features). The diagonal is not used for fewer features however sparse the rows: faster a pass, it
#: let the loss of a deep tree (a step per leaf, many leaves) rise (docs/measurements.md, "Tree classifier")
DENSE_PRECONDITIONER_MAX_FEATURES = 4096
#: with the full preconditioner (rows made dense), consecutive row blocks are joined into one round of leaf
#: steps while their dense rows and preconditioned copy (float64) take at most this many bytes: each leaf then
#: takes one full-batch step a pass over the round's rows, the reference code's loop, whatever the store's block
#: size: a step per leaf and block would take twice the steps of the mean V and b gradients under the same
#: momentum, and was less accurate on ALOI (docs/measurements.md, "Tree classifier")
STEP_BYTES = 512 * 2**20
#: the text form's per-feature step scale ``1 / C_f``, ``C_f = max(1, sum_i x_if^2) + FEATURE_SCALE_RIDGE
#: mean_f C_f`` (the reference code's ``treeupdate``: lambda = 1e-3)
FEATURE_SCALE_RIDGE = 1e-3
FORMS = ("low_rank", "per_label")
#: the reference code's step size, momentum and decay per pass for each form (``learning_rate="auto"`` ...)
SCHEDULES = {"low_rank": {"learning_rate": 0.25, "momentum": 0.8, "decay": 0.999},
             "per_label": {"learning_rate": 1.0, "momentum": 0.95, "decay": 0.99}}
#: a pass whose mean training loss is not finite or exceeds this multiple of the best pass's has diverged: the
#: weights go back to those the best pass started from, the momenta to zero, and the step size is halved (the
#: embedding classifier's rule). A pass's loss is a mean over the same rows each pass, so a rise by this much is
#: not noise.
DIVERGENCE_FACTOR = 2.0
#: halvings of the step size before training stops with an error (the step is then 1/1024 of the first)
MAX_BACKOFFS = 10



class TreeClassifierParams(FamilyParams):
    """``xmldask train --model tree --tree URL`` (or ``--tree URL`` alone): the candidate-restricted classifier
    (:class:`TreeClassifier`) of a spectral label tree, its passes early-stopped on held-out training rows."""

    searched = False

    model: Literal["tree"] = "tree"
    tree: str | None = Field(
        None, description="a spectral label tree store (xmldask tree): train its candidate-restricted classifier "
                          "(--model tree; rank n_components, max_epochs passes at most, early-stopped on held-out "
                          "training rows; random_state)")
    form: Literal["low_rank", "per_label"] = Field(
        "low_rank", description="with tree: the classifier's form, low_rank (rank-k U shared by the leaves, V and b "
                                "per leaf: the paper's ALOI form) or per_label (a weight vector per label shared by "
                                "the leaves, a bias per leaf and candidate: its text form)")
    n_components: Annotated[int, Field(gt=0)] = Field(50, description="the rank k of the classifier (form low_rank)")
    max_epochs: Annotated[int, Field(ge=0)] = Field(
        200, description="passes at most (early-stopped on held-out training rows; the reference code trains "
                         "200-250)")

    @classmethod
    def resolve(cls, data: dict) -> dict:
        """No search; the tree store is required."""
        if not data.get("tree"):
            raise ValueError("model=tree needs tree=URL: a spectral label tree store (xmldask tree DATA --out URL)")
        return super().resolve(data)


_TREE = TreeClassifierParams(tree="<a tree store>")


class TreeClassifier(SavedModel, ParamsMixin):
    """Spectral label tree + candidate-restricted rank-``n_components`` logistic regression.

    Parameters
    ----------
    tree : SpectralLabelTree or str, optional
        The label tree: a fitted one or the URL of a saved one (its candidates and routers are copied into the
        model), or a tree *specification* (an unfitted ``SpectralLabelTree``; default ``SpectralLabelTree()``)
        that :meth:`fit` grows on the same rows first, so that ``sklearn.base.clone`` gives an estimator that
        refits (the tree grown is ``tree_``).
    n_components : int, default 50
        Width of the shared ``U`` (the rank of the classifier; ``form="low_rank"`` only).
    form : {"low_rank", "per_label"}, default "low_rank"
        ``low_rank``: ``(U^T x)^T V_l + b_l`` (the paper's ALOI form; ``U``'s step preconditioned by
        ``(0.5 X^T X + ridge)^-1``). ``per_label``: ``w_c^T x + b_{l,c}``, one weight vector per label
        (the columns of ``V``, ``n_features x n_labels``) shared by every leaf and a bias per leaf and
        candidate (the paper's text form); a step on feature ``f`` is scaled by ``1 / C_f``, ``C_f =
        max(1, sum_i x_if^2) + 1e-3 mean(C)``, and moves only the weights of the leaf's rows' features and
        candidates (momentum too: the reference code's lazy momentum).
    per_leaf : bool, default True
        Per-leaf ``V_l, b_l`` (``per_label``: per-leaf biases); ``False``: one ``V, b`` over all labels
        shared by every leaf, still scored over the leaf's candidates only (the paper's "same classifier at
        every leaf" ablation).
    routing : {"randomized", "deterministic"}, default "randomized"
        Leaf of a training row: re-sampled every pass, or the deterministic one (ablation).
    max_epochs : int, default 200
        Passes over the training rows at most (the reference code: 200 to 250), early-stopped on held-out rows.
    validation_fraction : float, default 0.1
        Training rows held out (a seeded random share of every row block, at most ``max_validation_rows``):
        after each pass their P@1 (deterministic routing, the leaf's candidates) is measured, training stops
        after ``n_iter_no_change`` passes without a better one and the weights of the best pass are kept. 0:
        every row trains and all ``max_epochs`` passes are made (the reference code's loop).
    max_validation_rows : int, default 10000
    n_iter_no_change : int, default 10
        Passes without a better held-out P@1 before training stops.
    learning_rate, momentum, decay : float or "auto", default "auto"
        The heavy-ball steps: step size, momentum and the step size's multiplier per pass; ``auto`` takes the
        reference code's for the form (:data:`SCHEDULES`: ``low_rank`` 0.25, 0.8, 0.999 from ``runaloi.m``;
        ``per_label`` 1, 0.95, 0.99 from its LSHTC and ODP scripts).
    ridge : float, default 1e-2
        ``lambda`` of the preconditioner ``(0.5 X^T X + lambda tr(X^T X)/d I)^-1``.
    task : {"auto", "multiclass", "multilabel"}, default "auto"
        ``auto`` takes the tree's.
    time_budget : float, optional
        Seconds the fit may take (growing the tree, if it is a specification, included): no pass starts that
        would end past it (judged by the longest pass so far); at least one pass is made.
    random_state : int or None, default 0

    Attributes
    ----------
    U_ : ndarray, shape (n_features, n_components), or None (``per_label``)
    V_ : ndarray, shape (n_components, n_slots), or (n_features, n_labels) (``per_label``)
        Per leaf: column ``s`` scores candidate ``cand_indices_[s]`` (slots of leaf ``l``:
        ``cand_indptr_[l]:cand_indptr_[l+1]``); shared: ``n_slots = n_labels``, column = label;
        ``per_label``: column = label.
    b_ : ndarray, shape (n_slots,)
    history_ : list of dict
        Per pass: ``epoch``, ``loss`` (mean over the trained rows; None if not finite), ``learning_rate``,
        ``skipped`` (fraction of rows whose labels missed their sampled leaf), ``seconds``, ``val_p@1`` (the
        held-out P@1 after the pass); ``backoff`` True where the pass diverged and training went back to the
        weights the best pass started from, with half the step size (:data:`DIVERGENCE_FACTOR`); ``stopped``
        on the last pass when early stopping or the time budget ended training.
    best_epoch_ : int
        The pass whose weights are kept: the best held-out P@1 (the last pass without held-out rows).
    held_out_ : dict
        ``p@1`` of the kept pass and the held-out ``rows`` (empty without held-out rows).
    preconditioner_ : {"full", "diagonal", "feature_scale"}
        Of ``U``'s gradient: the full one up to :data:`DENSE_PRECONDITIONER_MAX_FEATURES` features, else the
        diagonal (sparse rows); ``per_label``: the per-feature step scale.
    """

    family = "tree"
    params_schema = TreeClassifierParams
    #: the job holds the training rows in memory for the fit (a pass per epoch)
    many_passes = True
    _MODEL_VERSION = TREE_CLASSIFIER_VERSION
    _EARLIER_VERSIONS = (1,)  # the tree's W dense
    _FORMER_PARAMS = {"rank": "n_components", "n_epochs": "max_epochs"}
    _ARRAYS = ("U", "V", "b", "cand_indptr", "cand_indices", "table", "W")
    _SCALARS = ("task", "sigma_form", "n_features_in", "n_labels", "n_passes", "fit_seconds", "history",
                "preconditioner", "best_epoch", "held_out")

    def __init__(self, tree=None, *, n_components: int = _TREE.n_components, form: str = _TREE.form,
                 per_leaf: bool = True, routing: str = "randomized", max_epochs: int = _TREE.max_epochs,
                 learning_rate="auto", decay="auto", momentum="auto", ridge: float = 1e-2, task: str = "auto",
                 validation_fraction: float = 0.1, max_validation_rows: int = 10000, n_iter_no_change: int = 10,
                 time_budget: float | None = None, random_state=0):
        self.tree, self.n_components, self.form = tree, n_components, form
        self.validation_fraction, self.max_validation_rows = validation_fraction, max_validation_rows
        self.n_iter_no_change, self.time_budget = n_iter_no_change, time_budget
        self.per_leaf, self.routing = per_leaf, routing
        self.max_epochs, self.learning_rate, self.decay, self.momentum = max_epochs, learning_rate, decay, momentum
        self.ridge, self.task, self.random_state = ridge, task, random_state

    def train_summary(self) -> dict:
        """What :func:`xmldask.jobs.train` reports of the fitted classifier: its tree store (if given as one), the
        passes, the last epoch's loss and skipped share, the held-out figures, the kept epoch and the backoffs."""
        return {**({"tree": self.tree} if isinstance(self.tree, str) else {}), "n_passes": int(self.n_passes_),
                "task": self.task_, "training": {key: self.history_[-1][key] for key in ("loss", "skipped")},
                "held_out": dict(self.held_out_), "best_epoch": int(self.best_epoch_),
                "backoffs": sum(bool(h.get("backoff")) for h in self.history_)}

    # -- fitting --------------------------------------------------------------------------------

    def _check_params(self) -> SpectralLabelTree:
        """The tree (loaded from its URL; an unfitted specification as it is: :meth:`fit` grows it) after
        checking the parameters."""
        tree = SpectralLabelTree() if self.tree is None else self.tree
        tree = SpectralLabelTree.load(tree) if isinstance(tree, str) else tree
        if not isinstance(tree, SpectralLabelTree):
            raise ValueError("tree must be a SpectralLabelTree (fitted, or a specification to grow) or the URL of a "
                             f"saved one (xmldask tree TRAIN_URL --out TREE_URL), but is {self.tree!r}")
        for name in ("n_components", "max_epochs"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
                raise ValueError(f"{name} must be a positive integer, but is {value!r}")
        if self.routing not in ("randomized", "deterministic"):
            raise ValueError(f"routing must be 'randomized' or 'deterministic', but is {self.routing!r}")
        if self.form not in FORMS:
            raise ValueError(f"form must be one of {', '.join(map(repr, FORMS))}, but is {self.form!r}")
        if self.time_budget is not None:
            check_float(self.time_budget, "time_budget", low_open=True)
        check_float(self.validation_fraction, "validation_fraction", low=0.0, high=0.5)
        check_int(self.max_validation_rows, "max_validation_rows", 1)
        check_int(self.n_iter_no_change, "n_iter_no_change", 1)
        for name in SCHEDULES[self.form]:
            value = getattr(self, name)
            if value != "auto" and (isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0):
                raise ValueError(f"{name} must be 'auto' or a non-negative number, but is {value!r}")
        return tree

    def _schedule(self) -> tuple[float, float, float]:
        """Step size, momentum and decay per pass, ``auto`` resolved by the form."""
        return tuple(float(SCHEDULES[self.form][name] if getattr(self, name) == "auto" else getattr(self, name))
                     for name in ("learning_rate", "momentum", "decay"))

    def fit(self, X, Y) -> TreeClassifier:
        """Train on row blocks ``X`` (n_samples, n_features) and labels ``Y`` (n_samples, n_labels)."""
        tree = self._check_params()
        deadline = math.inf if self.time_budget is None else time.perf_counter() + float(self.time_budget)
        X = as_rows(X, "X")
        Y = as_rows(Y, "Y", X.chunks[0][0])
        if getattr(tree, "table_", None) is None:  # a specification: grown on these rows (a copy: params unchanged)
            tree = type(tree)(**tree.get_params(deep=False)).fit(X, Y)
        self.tree_ = tree
        if X.shape[1] != tree.n_features_in_ or Y.shape[1] != tree.n_labels_:
            raise ValueError(f"X, Y have {X.shape[1]} features and {Y.shape[1]} labels, but the tree was grown on "
                             f"{tree.n_features_in_} and {tree.n_labels_}; train on the tree's training data")
        start = time.perf_counter()
        X, Y, held = self._held_out_split(X, Y)
        rng = np.random.default_rng(self.random_state)
        d, r = X.shape[1], int(self.n_components)
        self.task_ = tree.task_ if self.task == "auto" else self.task
        self.table_, self.W_ = tree.table_, tree.W_
        self.cand_indptr_, self.cand_indices_ = tree.cand_indptr_, tree.cand_indices_
        self.sigma_form_ = tree.sigma
        precond = self._preconditioner(X)
        self.n_passes_ = 1
        n_slots = len(self.cand_indices_) if self.per_leaf else tree.n_labels_
        if self.form == "per_label":  # single precision, as the reference code's memory-mapped weights
            U, V = None, np.zeros((d, tree.n_labels_), dtype=np.float32)
        else:
            U, V = rng.standard_normal((d, r)) / np.sqrt(d), np.zeros((r, n_slots))
        b = np.zeros(n_slots)
        self.history_ = []
        rounds = [([X.blocks[i] for i in group], [Y.blocks[i] for i in group])
                  for group in _rounds(X.chunks[0], 0 if _precond_is_diagonal(precond) else 16 * d)]
        # the steps multiply small matrices: one BLAS thread (a pool of spinning threads is far slower on such
        # products on a busy machine: docs/measurements.md)
        with threadpool_limits(limits=1):
            U, V, b = self._epochs(rounds, tree, U, V, b, precond, rng, start, deadline, held)
        self.U_ = None if U is None else U.astype(np.float32)
        self.V_, self.b_ = V.astype(np.float32), b.astype(np.float32)
        self.n_features_in_, self.n_labels_ = d, tree.n_labels_
        self.fit_seconds_ = time.perf_counter() - start
        return self

    def _held_out_split(self, X: da.Array, Y: da.Array):
        """``(training X, training Y, (held-out X, Y) in memory or None)``: :class:`HeldOut`'s seeded share of every
        row block (``validation_fraction``, at most ``max_validation_rows`` rows in all)."""
        fraction = min(float(self.validation_fraction), self.max_validation_rows / max(X.shape[0], 1))
        split = HeldOut(seed_of(self.random_state), fraction, tuple(int(c) for c in X.chunks[0]))
        if fraction <= 0 or not any(split.mask(i).any() for i in range(len(split.chunks))):
            return X, Y, None
        blocks = dask.compute(*split.rows(X, held=True).to_delayed().ravel(),
                              *split.rows(Y, held=True).to_delayed().ravel())
        half = len(blocks) // 2
        Xh, Yh = (sp.vstack([sp.csr_matrix(p) for p in part]).tocsr() for part in (blocks[:half], blocks[half:]))
        return split.rows(X, held=False), split.rows(Y, held=False), (Xh, Yh)

    def _held_out_p1(self, held, W, U, V, b) -> float:
        """P@1 of the weights ``U, V, b`` on the held-out rows ``held`` (deterministic routing by the routers ``W``,
        as predicted)."""
        Xh, Yh = held
        out = _topk_block(Xh, V, b, self.cand_indptr_, self.cand_indices_, self.table_, W, U, k=1,
                          form=self.sigma_form_, task=self.task_, per_leaf=bool(self.per_leaf))
        top = out[:, 0].astype(np.int64)
        found = top >= 0
        hits = np.asarray(Yh[np.flatnonzero(found), top[found]]).ravel() > 0
        return float(hits.sum() / Xh.shape[0])

    def _epochs(self, rounds, tree, U, V, b, precond, rng, start, deadline=math.inf, held=None):
        """The passes of :meth:`fit` (the heavy-ball steps, leaf by leaf, round by round).

        A leaf holds a few rows (ALOI: about 6), so a step is a handful of small dense products: the
        round's rows are made dense when narrow and preconditioned once per round (``X M^-1``, so that
        a leaf's preconditioned ``U`` gradient is ``(X M^-1)_l^T delta V_l^T``), its labels looked up
        per leaf without sparse indexing. With many features (sparse rows, a diagonal preconditioner) a
        step reads and moves only the rows of ``U`` at the leaf's features (:class:`_RowHeavyBall`): the
        same iterates, in time proportional to the leaf's nonzeros instead of ``n_features x n_components``.
        The per-label form (``U`` is ``None``; rows sparse) steps the block of ``V`` at the leaf's features and
        candidates, its momentum only there (the reference code's lazy momentum: not the dense iterates).
        """
        sparse_rows = _precond_is_diagonal(precond)
        per_label = U is None
        eta, mu, decay = self._schedule()
        heavy_ball = None if per_label else _RowHeavyBall if sparse_rows else _DenseHeavyBall
        steps = None if per_label else heavy_ball(U, mu)
        mV, mb = np.zeros_like(V), np.zeros_like(b)
        W = routing_routers(self.W_)
        best = {"loss": np.inf, "epoch": 1, "weights": None}
        kept = {"p@1": -np.inf, "epoch": 0, "weights": None}  # the best held-out P@1 so far
        backoffs, longest = 0, 0.0
        for epoch in range(int(self.max_epochs)):
            epoch_start = time.perf_counter()
            # a pass's loss is that of the weights it starts from, moved by the steps before each leaf's
            weights = _copies(None if per_label else steps.result(), V, b)
            loss_sum = rows_used = rows_seen = 0
            for Xd, Yd in rounds:  # each a list of row blocks
                parts = dask.compute(*Xd, *Yd)
                Xb, Yb = (sp.vstack([sp.csr_matrix(p) for p in half]).tocsr()
                          for half in (parts[:len(Xd)], parts[len(Xd):]))
                rows, leaf, _ = route_pairs(Xb, self.table_, W, form=self.sigma_form_,
                                               deterministic=self.routing == "deterministic",
                                               rng=rng if self.routing == "randomized" else None)
                rows_seen += Xb.shape[0]
                Xs = Xb if sparse_rows else Xb.toarray()
                XP = None if sparse_rows else precond(Xs)
                groups = list(rows_by_node(leaf))
                for i in rng.permutation(len(groups)):
                    node, idx = groups[i][0], rows[groups[i][1]]
                    cands, cols = self._slots(node)
                    if not len(cands):
                        continue
                    Yl = _leaf_targets(Yb, idx, cands)
                    keep = Yl.any(axis=1)
                    if not keep.any():
                        continue
                    idx, Yl = idx[keep], Yl[keep]
                    if per_label:  # the weights of the leaf's features and candidates, lazy momentum
                        feats, Xl = _compressed_rows(Xs[idx])
                        block = np.ix_(feats, cands)
                        loss, gV, gb = _per_label_gradients(Xl, Yl, V[block], b[cols], self.task_)
                        mV[block] = mu * mV[block] - (eta * precond[feats])[:, None] * gV
                        V[block] += mV[block]
                    elif sparse_rows:  # the leaf's rows on their own features
                        feats, Xl = _compressed_rows(Xs[idx])
                        loss, gU, gV, gb = _leaf_gradients(Xl, Yl, steps.rows(feats), V[:, cols], b[cols], self.task_)
                        gU *= precond[feats][:, None]
                    else:
                        feats = None
                        loss, gU, gV, gb = _leaf_gradients(Xs[idx], Yl, steps.U, V[:, cols], b[cols], self.task_,
                                                           XP[idx])
                    if not per_label:
                        mV[:, cols] = mu * mV[:, cols] - eta * gV
                        V[:, cols] += mV[:, cols]
                        steps.step(feats, eta * gU)
                    loss_sum += loss * len(Yl)
                    rows_used += len(Yl)
                    mb[cols] = mu * mb[cols] - eta * gb
                    b[cols] += mb[cols]
            self.n_passes_ += 1
            loss = loss_sum / max(rows_used, 1)
            self.history_.append({"epoch": epoch + 1, "loss": loss if np.isfinite(loss) else None, "learning_rate": eta,
                                  "skipped": 1 - rows_used / max(rows_seen, 1),
                                  "seconds": round(time.perf_counter() - start, 3)})
            logger.info("tree classifier pass %d of %d: loss %.4f, %.1f%% of the rows skipped (%.1f s)", epoch + 1,
                        self.max_epochs, loss, 100 * self.history_[-1]["skipped"], self.history_[-1]["seconds"])
            if rows_used and not loss <= DIVERGENCE_FACTOR * best["loss"]:  # also NaN
                backoffs += 1
                if backoffs > MAX_BACKOFFS:
                    raise FloatingPointError(
                        f"the tree classifier diverged: pass {epoch + 1}'s training loss {loss:.4g} against "
                        f"{best['loss']:.4g} at pass {best['epoch']}, after {MAX_BACKOFFS} halvings of the step "
                        f"size (now {eta:.3g}); give a smaller learning_rate (--learning-rate) or another form")
                U, V, b = _copies(*(best["weights"] or weights))
                steps = None if per_label else heavy_ball(U, mu)
                mV, mb = np.zeros_like(V), np.zeros_like(b)
                eta *= 0.5
                self.history_[-1]["backoff"] = True
                logger.warning("tree classifier pass %d diverged (loss %.4g, the best %.4g at pass %d): back to the "
                               "weights pass %d started from, with half the step size (%.3g)", epoch + 1, loss,
                               best["loss"], best["epoch"], best["epoch"], eta)
            elif rows_used and loss < best["loss"]:
                best = {"loss": loss, "epoch": epoch + 1, "weights": weights}
            eta *= decay
            if held is not None and not self.history_[-1].get("backoff"):
                after = _copies(None if per_label else steps.result(), V, b)
                p1 = self._held_out_p1(held, W, *after)
                self.history_[-1]["val_p@1"] = p1
                if p1 > kept["p@1"]:
                    kept = {"p@1": p1, "epoch": epoch + 1, "weights": after}
                elif epoch + 1 - kept["epoch"] >= int(self.n_iter_no_change):
                    self.history_[-1]["stopped"] = "n_iter_no_change"
                    logger.info("tree classifier: no better held-out P@1 in %d passes; the weights of pass %d kept "
                                "(P@1 %.4f on %d rows)", self.n_iter_no_change, kept["epoch"], kept["p@1"],
                                held[0].shape[0])
                    break
            longest = max(longest, time.perf_counter() - epoch_start)
            if epoch + 1 < int(self.max_epochs) and time.perf_counter() + longest > deadline:
                self.history_[-1]["stopped"] = "time_budget"
                logger.info("time budget of %g s: the tree classifier stops after %d passes", self.time_budget,
                            epoch + 1)
                break
        self.held_out_ = {}
        self.best_epoch_ = len(self.history_)
        if kept["weights"] is not None:
            self.best_epoch_, self.held_out_ = kept["epoch"], {"p@1": kept["p@1"], "rows": int(held[0].shape[0])}
            return kept["weights"]
        return (None if per_label else steps.result()), V, b

    def _slots(self, node) -> tuple[np.ndarray, np.ndarray]:
        """The leaf's candidate labels and their columns of ``V`` / entries of ``b``."""
        return _leaf_slots(self.cand_indptr_, self.cand_indices_, node, bool(self.per_leaf))

    def _preconditioner(self, X: da.Array):
        """``M = 0.5 X^T X + ridge tr(X^T X)/d I``: up to :data:`DENSE_PRECONDITIONER_MAX_FEATURES` features
        ``rows -> rows M^-1`` (Cholesky, once), so that a leaf's preconditioned ``U`` gradient is
        ``(X M^-1)_l^T delta V_l^T``; beyond, the inverse of ``M``'s diagonal (a vector); the per-label form's
        step scale ``1 / C_f`` (a vector). Sets ``preconditioner_`` ("full", "diagonal" or "feature_scale")."""
        d = X.shape[1]
        self.preconditioner_ = ("feature_scale" if self.form == "per_label" else
                                "full" if d <= DENSE_PRECONDITIONER_MAX_FEATURES else "diagonal")
        if self.preconditioner_ == "full":
            G = gram(X, dtype=np.float64).compute()
            M = 0.5 * G + self.ridge * np.trace(G) / d * np.eye(d)
            inverse = MK.inverse_from_cholesky(scipy.linalg.cho_factor(M))
            return lambda rows: np.asarray(rows @ inverse)
        from ..linalg.passes import column_moments

        _, second = column_moments(X)
        squares = second.compute() * X.shape[0]  # sum_i x_if^2
        if self.preconditioner_ == "feature_scale":
            C = np.maximum(1.0, squares)
            return 1.0 / (C + FEATURE_SCALE_RIDGE * C.mean())
        diag = 0.5 * squares
        return 1.0 / (diag + self.ridge * diag.sum() / d)

    def _check_fitted(self) -> None:
        if getattr(self, "V_", None) is None:

            raise NotFittedError("this TreeClassifier is not fitted yet; call fit(X, Y) first")

    # -- prediction ------------------------------------------------------------------------------

    def predict_topk(self, X, *, k: int = 5) -> tuple[da.Array, da.Array]:
        """Top-``k`` candidates of each row's deterministic leaf by score, lazily; ``-1`` / ``-inf`` padding
        when the leaf has fewer than ``k`` candidates. Scores are the softmax over the candidates
        (multiclass) or the logistic probabilities (multilabel).

        Returns
        -------
        labels : dask.array.Array of int32, shape (n_samples, k)
        scores : dask.array.Array of float32, shape (n_samples, k)
        """
        X = self._rows(X)
        k = self._checked_k(k)
        whole = {name: getattr(self, name + "_") for name in self._ARRAYS}
        operands = [("Xb", X, ROWS)] + [(n, router_operand(v) if n == "W" else whole_operand(v, name=n), WHOLE)
                                        for n, v in whole.items() if v is not None]
        packed = per_block(_topk_block, operands, tail=(2 * k,), dtype=np.float64, token="tree-classifier-topk",
                            stack=False, static={"k": k, "form": self.sigma_form_, "task": self.task_,
                                                 "per_leaf": bool(self.per_leaf)})
        return packed[:, :k].astype(np.int32), packed[:, k:].astype(np.float32)

    # -- persistence ----------------------------------------------------------------------------

    def _parts(self) -> tuple[dict, dict, dict]:
        """The parameters (``tree`` as its URL, or ``None``: its routers and candidates are among the arrays),
        fitted scalars and arrays."""
        params, fitted, arrays = super()._parts()
        params["tree"] = self.tree if isinstance(self.tree, str) else None
        return params, fitted, arrays


class _DenseHeavyBall:
    """Heavy-ball steps on all of ``U``: ``m <- mu m - g``, ``U <- U + m`` (``g`` the gradient scaled by the
    step size, on every row or on ``rows``)."""

    def __init__(self, U: np.ndarray, momentum: float):
        self.U, self.m, self.mu = U, np.zeros_like(U), float(momentum)

    def rows(self, rows: np.ndarray) -> np.ndarray:
        return self.U[rows]

    def step(self, rows, G: np.ndarray) -> None:
        self.m *= self.mu
        if rows is None:
            self.m -= G
        else:
            self.m[rows] -= G
        self.U += self.m

    def result(self) -> np.ndarray:
        return self.U


class _RowHeavyBall:
    """The heavy-ball steps of :class:`_DenseHeavyBall` when each gradient has a few nonzero rows (the
    features of a leaf's rows), in time proportional to those rows.

    Between two steps that touch row ``i``, its momentum only decays: after ``gap`` steps it is
    ``mu^gap m_i`` and the row has moved by ``m_i (mu + ... + mu^gap)``. Each row keeps the step it is
    current at and is brought forward when a step reads or writes it (exactly the dense iterates, up to
    rounding); :meth:`result` brings every row forward.
    """

    def __init__(self, U: np.ndarray, momentum: float):
        self.U, self.m, self.mu = U, np.zeros_like(U), float(momentum)
        self.current = np.zeros(U.shape[0], dtype=np.int64)  # the step each row is current at
        self.t = 0  # steps taken

    def _forward(self, rows: np.ndarray, to: int) -> None:
        gap = to - self.current[rows]
        decay = self.mu ** gap
        moved = self.mu * (1.0 - decay) / (1.0 - self.mu) if self.mu != 1 else gap.astype(np.float64)
        self.U[rows] += self.m[rows] * moved[:, None]
        self.m[rows] *= decay[:, None]
        self.current[rows] = to

    def rows(self, rows: np.ndarray) -> np.ndarray:
        """Rows ``rows`` of ``U`` as the dense iterates have them now."""
        self._forward(rows, self.t)
        return self.U[rows]

    def step(self, rows: np.ndarray, G: np.ndarray) -> None:
        """One step whose gradient (scaled by the step size) is ``G`` on ``rows`` and zero elsewhere."""
        self._forward(rows, self.t)
        self.t += 1
        self.m[rows] = self.mu * self.m[rows] - G
        self.U[rows] += self.m[rows]
        self.current[rows] = self.t

    def result(self) -> np.ndarray:
        self._forward(np.arange(self.U.shape[0]), self.t)
        return self.U


def _copies(*arrays):
    """Copies of the arrays (``None`` stays ``None``): the weights kept for a step-size backoff."""
    return tuple(None if a is None else a.copy() for a in arrays)


def _precond_is_diagonal(precond) -> bool:
    """Whether :meth:`TreeClassifier._preconditioner` gave the diagonal (a vector; the rows stay sparse)."""
    return not callable(precond)


def _rounds(chunks: tuple, row_bytes: int) -> list[list[int]]:
    """Consecutive row blocks joined into rounds of leaf steps, each at most :data:`STEP_BYTES` at ``row_bytes`` a
    row (``0``: every block a round of its own)."""
    rounds, rows = [], 0
    for i, n in enumerate(chunks):
        if rounds and row_bytes and (rows + n) * row_bytes <= STEP_BYTES:
            rounds[-1].append(i)
            rows += n
        else:
            rounds.append([i])
            rows = n
    return rounds


def _compressed_rows(Xl: sp.csr_matrix) -> tuple[np.ndarray, sp.csr_matrix]:
    """The features present in the rows ``Xl`` and the rows on those features only (same values)."""
    feats, inverse = np.unique(Xl.indices, return_inverse=True)
    return feats, sp.csr_matrix((Xl.data, inverse.ravel(), Xl.indptr), shape=(Xl.shape[0], len(feats)))


def _leaf_gradients(Xl, Yl, U, V, b, task, XPl=None):
    """Mean loss and gradients of one leaf's rows: ``dV``, ``db`` means, ``dU`` a sum (the reference code's);
    with ``XPl`` (the rows times the preconditioner) ``dU`` is preconditioned: ``XPl^T delta V^T``."""
    H = np.asarray(Xl @ U)
    S = H @ V + b
    loss, delta = _dense_softmax_loss(S, Yl) if task == "multiclass" else MK.logistic_loss(S, Yl)
    m = len(Yl)
    rows = Xl if XPl is None else XPl
    return loss / m, np.asarray(rows.T @ (delta @ V.T)), H.T @ delta / m, delta.mean(axis=0)


def _per_label_gradients(Xl, Yl, Vl, bl, task):
    """Mean loss and gradients of one leaf's rows in the text form (scores ``Xl Vl + bl``, ``Vl`` the
    weights of the rows' features and the leaf's candidates): ``dV`` a sum (the reference code's
    per-example steps over a pass), ``db`` a mean (its ``eta / N_l``)."""
    S = np.asarray(Xl @ Vl, dtype=np.float64) + bl
    loss, delta = _dense_softmax_loss(S, Yl) if task == "multiclass" else MK.logistic_loss(S, Yl)
    return loss / len(Yl), np.asarray(Xl.T @ delta), delta.mean(axis=0)


def _dense_softmax_loss(S: np.ndarray, Y: np.ndarray) -> tuple[float, np.ndarray]:
    """:func:`xmldask.models._kernels.softmax_loss` for a few dense rows, every one with a label: the summed
    ``logsumexp(s_i) - mean_{j in y_i} s_ij`` and its gradient ``softmax(s_i) - y_i / |y_i|``."""
    T = Y / Y.sum(axis=1, keepdims=True)
    Z = S - S.max(axis=1, keepdims=True)
    E = np.exp(Z)
    total = E.sum(axis=1, keepdims=True)
    loss = float((np.log(total[:, 0]) - (T * Z).sum(axis=1)).sum())
    return loss, E / total - T


def _leaf_targets(Yb: sp.csr_matrix, idx: np.ndarray, cands: np.ndarray) -> np.ndarray:
    """Dense 0/1 targets of rows ``idx`` over the leaf's candidates (CSR slices, no sparse fancy indexing)."""
    starts, stops = Yb.indptr[idx], Yb.indptr[np.asarray(idx) + 1]
    counts = stops - starts
    owner = np.repeat(np.arange(len(idx)), counts)
    labels = Yb.indices[np.repeat(starts - np.cumsum(counts) + counts, counts) + np.arange(counts.sum())]
    order = np.argsort(cands, kind="stable")
    ranked = cands[order]
    pos = np.minimum(np.searchsorted(ranked, labels), max(len(ranked) - 1, 0))
    hit = ranked[pos] == labels if len(ranked) else np.zeros(len(labels), dtype=bool)
    out = np.zeros((len(idx), len(cands)))
    out[owner[hit], order[pos[hit]]] = 1.0
    return out


def _leaf_slots(cand_indptr, cand_indices, node, per_leaf: bool) -> tuple[np.ndarray, np.ndarray]:
    """A leaf's candidates and their columns of ``V``: its own slots, or the labels themselves when shared."""
    lo, hi = int(cand_indptr[node]), int(cand_indptr[node + 1])
    cands = cand_indices[lo:hi]
    return cands, (np.arange(lo, hi) if per_leaf else cands)


def _topk_block(Xb, V, b, cand_indptr, cand_indices, table, W, U=None, *, k, form, task, per_leaf):
    """Packed ``[labels (k), scores (k)]`` of a row block (see :meth:`TreeClassifier.predict_topk`; ``U``
    ``None``: the per-label form)."""
    X = sp.csr_matrix(Xb)
    leaf = leaf_of(X, table, W, form=form)
    out = np.empty((X.shape[0], 2 * k))
    out[:, :k], out[:, k:] = -1, -np.inf
    H = None if U is None else np.asarray(X @ U, dtype=np.float64)
    for node, rows in rows_by_node(leaf):
        cands, cols = _leaf_slots(cand_indptr, cand_indices, node, per_leaf)
        if not len(cands):
            continue
        if U is None:  # the weights of the rows' features only (a leaf's columns of V span every feature)
            feats, Xl = _compressed_rows(X[rows])
            S = np.asarray(Xl @ V[np.ix_(feats, cands)], dtype=np.float64) + b[cols]
        else:
            S = H[rows] @ V[:, cols] + b[cols]
        P = MK.probabilities(S, task)
        m = min(k, len(cands))
        top = np.argsort(-P, axis=1, kind="stable")[:, :m]
        out[rows[:, None], np.arange(m)[None, :]] = cands[top]
        out[rows[:, None], k + np.arange(m)[None, :]] = np.take_along_axis(P, top, axis=1)
    return out


class CandidateScorer(ParamsMixin):
    """Any fitted classifier's scores restricted to the candidates of the tree's leaf (Algorithm 1 with
    that classifier as ``H``): the top-``k`` of a row are its leaf's candidates with the highest scores.

    Parameters
    ----------
    tree : SpectralLabelTree
        Fitted tree (routes the raw rows).
    classifier : EmbeddingClassifier
        Fitted on the same features and labels; its decoder features ``transform(X)`` and decoder
        ``Q_``, ``bias_`` score the candidates only.

    References
    ----------
    Mineiro and Karampatziakis (2015), Algorithm 1 (``H(x, F(x))`` for a generic base classifier ``H``).
    """


    def __init__(self, tree=None, classifier=None):
        self.tree, self.classifier = tree, classifier

    def _check_fitted(self) -> None:
        self.tree._check_fitted()
        if not hasattr(self.classifier, "transform"):
            raise TypeError(f"CandidateScorer scores with one fitted EmbeddingClassifier (its decoder features and "
                            f"Q_), not a {type(self.classifier).__name__}; of an ensemble, pass one of its "
                            f"estimators_")
        self.classifier._check_fitted()
        if (self.tree.n_features_in_, self.tree.n_labels_) != (self.classifier.n_features_in_,
                                                                self.classifier.n_labels_):
            raise ValueError("the tree and the classifier were fitted on data of different shapes")
        self.n_features_in_, self.n_labels_ = self.tree.n_features_in_, self.tree.n_labels_

    def predict_topk(self, X, *, k: int = 5) -> tuple[da.Array, da.Array]:
        """Top-``k`` candidates by the classifier's score (raw decoder scores), ``-1`` / ``-inf`` padded; lazy."""
        X = self._rows(X)
        k = self._checked_k(k)
        F = self.classifier.transform(X)
        whole = {"QT": np.ascontiguousarray(self.classifier.Q_.T), "bias": self.classifier.bias_,
                 "table": self.tree.table_, "W": self.tree.W_, "cand_indptr": self.tree.cand_indptr_,
                 "cand_indices": self.tree.cand_indices_}
        operands = [("Xb", X, ROWS), ("Fb", F, ROWS)]
        operands += [(n, router_operand(v) if n == "W" else whole_operand(v, name=n), WHOLE)
                     for n, v in whole.items() if v is not None]
        packed = per_block(_candidate_topk_block, operands, tail=(2 * k,), dtype=np.float64,
                            token="candidate-scorer-topk", stack=False, static={"k": k, "form": self.tree.sigma})
        return packed[:, :k].astype(np.int32), packed[:, k:].astype(np.float32)


def _candidate_topk_block(Xb, Fb, QT, table, W, cand_indptr, cand_indices, bias=None, *, k, form):
    """Packed ``[labels (k), scores (k)]``: each row's leaf candidates scored by ``F Q + bias``.

    ``QT`` is ``Q^T`` (labels x features, C order), so that a leaf's candidates are a gather of whole
    rows; one product per leaf present in the block.
    """
    leaf = leaf_of(Xb, table, W, form=form)
    out = np.empty((len(leaf), 2 * k))
    out[:, :k], out[:, k:] = -1, -np.inf
    F = np.asarray(Fb)
    with threadpool_limits(limits=1):  # many small products: no BLAS thread pool to wake for each
        for node, rows in rows_by_node(leaf):
            cands, _ = _leaf_slots(cand_indptr, cand_indices, node, True)
            if not len(cands):
                continue
            S = F[rows] @ QT[cands].T
            if bias is not None:
                S += bias[cands]
            m = min(k, len(cands))
            top = np.argsort(-S, axis=1, kind="stable")[:, :m]
            out[rows[:, None], np.arange(m)[None, :]] = cands[top]
            out[rows[:, None], k + np.arange(m)[None, :]] = np.take_along_axis(S, top, axis=1)
    return out
