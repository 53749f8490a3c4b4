"""The spectral label tree as an estimator: fit, route, figures, save and load."""

from __future__ import annotations

import dask
import dask.array as da
import numpy as np
import scipy.sparse as sp

from ..base import NotFittedError, ParamsMixin, as_rows
from ..linalg.passes import ROWS, WHOLE, block_sum, check_rows_operand, dense_operand, per_block
from ..params import TREE_DEPTH, TREE_LEAF_LABELS
from ..store.models import SavedModel
from . import _kernels as K
from .growth import grow_tree, router_operand

__all__ = ["TREE_VERSION", "SpectralLabelTree"]

#: version of the tree's saved form (2: ``W`` as CSR; version 1's dense ``W`` still loads)
TREE_VERSION = 2


class SpectralLabelTree(SavedModel, ParamsMixin):
    """Hierarchical spectral label tree: a filter from a row to a small set of candidate labels.

    Every internal node routes left iff ``w^T x > b``, with ``w`` the top eigenvector of
    ``X^T D Y (Y^T D Y)^-1 Y^T D X`` orthogonal to the weighted mean row (eq. 2) and ``b`` the
    weighted median of ``w^T x``; training rows are routed fractionally (probability of going left
    ``Phi``-shaped in ``(w^T x - b) / sigma``). A leaf's candidates are its most probable labels.
    Fitting makes a number of passes proportional to the depth (:func:`xmldask.tree.grow_tree`).

    Parameters
    ----------
    max_depth : int, default 14
        Largest leaf depth (the reference code's ALOI setting).
    leaf_labels : int, default 25
        Leaf label budget ``s``.
    recall : float, default 0.999
        Acceptable training recall of the stopping rule.
    routing : {"fractional", "deterministic"}, default "fractional"
        Routing of the training rows while growing.
    sigma : {"code", "paper"}, default "code"
        Routing width ``sqrt(lambda/m)`` with erf (reference code) or ``lambda/m`` with Phi (paper).
    task : {"auto", "multiclass", "multilabel"}, default "auto"
    block_size : int, default 10
    n_power_iter : int, default 1
    cg_max_iter : int, default 20
    orphan_repair : bool, default True
    memory_budget : int or None, default None
        Bytes of one block's per-node partial sums (``None``: by the workers' memory limit; see
        :func:`~xmldask.tree.grow_tree`).
    random_state : int, Generator or None, default 0

    Attributes
    ----------
    table_ : ndarray, shape (n_nodes, 5)
        ``left, right, router, bias, sigma`` per node (children ``-1`` at a leaf); node 0 is the root.
    W_ : scipy.sparse.csr_matrix of float32, shape (n_routers, n_features)
        The routers, each on its node's features (the features of the training rows that reached it).
    depth_, eigenvalue_, mass_ : ndarray, shape (n_nodes,)
        Depth, ``lambda`` and training mass ``m`` of every node.
    cand_indptr_, cand_indices_, cand_scores_ : ndarray
        Candidate labels of node ``i`` (leaves only): ``cand_indices_[cand_indptr_[i]:cand_indptr_[i+1]]``
        with their training mass (0 for a label added by orphan repair).
    root_label_mass_ : ndarray, shape (n_labels,)
        Training label counts; ``top_labels_`` the ``leaf_labels`` most frequent.

    References
    ----------
    Mineiro and Karampatziakis, "A Hierarchical Spectral Method for Extreme Classification" (2015),
    eq. (2), sections 3.3-3.4, Algorithm 1.
    """

    _MODEL_VERSION = TREE_VERSION
    _EARLIER_VERSIONS = (1,)
    _ARRAYS = ("table", "W", "depth", "eigenvalue", "mass", "cand_indptr", "cand_indices", "cand_scores",
               "root_label_mass", "top_labels")
    _SCALARS = ("task", "n_passes", "n_orphans", "fit_seconds", "levels", "n_features_in", "n_labels")

    def __init__(self, *, max_depth: int = TREE_DEPTH, leaf_labels: int = TREE_LEAF_LABELS, recall: float = 0.999,
                 routing: str = "fractional", sigma: str = "code", task: str = "auto", block_size: int = 10,
                 n_power_iter: int = 1, cg_max_iter: int = 20, orphan_repair: bool = True,
                 memory_budget: int | None = None, random_state=0):
        self.max_depth, self.leaf_labels, self.recall = max_depth, leaf_labels, recall
        self.routing, self.sigma, self.task = routing, sigma, task
        self.block_size, self.n_power_iter, self.cg_max_iter = block_size, n_power_iter, cg_max_iter
        self.orphan_repair, self.memory_budget, self.random_state = orphan_repair, memory_budget, random_state

    # -- fitting --------------------------------------------------------------------------------

    def fit(self, X, Y) -> SpectralLabelTree:
        """Grow the tree on row blocks ``X`` (n_samples, n_features) and labels ``Y`` (n_samples, n_labels)."""
        X = as_rows(X, "X")
        Y = check_rows_operand(as_rows(Y, "Y", X.chunks[0][0]) if not isinstance(Y, da.Array) else Y, X, "Y")
        grown = grow_tree(X, Y, **{name: getattr(self, name) for name in self._get_param_names()})
        for name in ("table", "W", "depth", "eigenvalue", "mass", "cand_indptr", "cand_indices", "cand_scores",
                     "root_label_mass", "task", "n_passes", "n_orphans", "levels"):
            setattr(self, name + "_", getattr(grown, name))
        self.fit_seconds_ = grown.seconds
        self.n_features_in_, self.n_labels_ = X.shape[1], Y.shape[1]
        self.top_labels_ = np.argsort(-self.root_label_mass_, kind="stable")[:self.leaf_labels].astype(np.int64)
        return self

    def _check_fitted(self) -> None:
        if getattr(self, "table_", None) is None:

            raise NotFittedError("this SpectralLabelTree is not fitted yet; call fit(X, Y) first")

    # -- using the tree -------------------------------------------------------------------------

    @property
    def n_leaves_(self) -> int:
        return int(np.count_nonzero(self.table_[:, K.LEFT] < 0))

    def candidates(self, node: int) -> np.ndarray:
        """Candidate labels of leaf ``node`` (best first by training mass, repaired orphans last)."""
        lo, hi = self.cand_indptr_[node], self.cand_indptr_[node + 1]
        return self.cand_indices_[lo:hi]

    def _tree_operands(self) -> list:
        return [("table", dense_operand(self.table_, name="table"), WHOLE),
                ("W", router_operand(self.W_), WHOLE)]

    def _cand_operands(self) -> list:
        return [(name, dense_operand(getattr(self, name + "_"), name=name), WHOLE)
                for name in ("cand_indptr", "cand_indices")]

    def route(self, X) -> da.Array:
        """Deterministic leaf of every row (Algorithm 1's filter), lazily.

        Returns
        -------
        dask.array.Array of int64, shape (n_samples,)
        """
        X = self._rows(X)
        return per_block(K.leaf_of, [("Xb", X, ROWS)] + self._tree_operands(), tail=(), dtype=np.int64,
                          token="tree-route", stack=False, static={"form": self.sigma})

    def predict_topk(self, X, *, k: int = 5) -> tuple[da.Array, da.Array]:
        """The static leaf predictor: the ``k`` candidates of each row's leaf with the largest training
        mass (normalised per leaf), ``-1`` / ``-inf`` padded; lazy ``(labels int32, scores float32)``."""
        X = self._rows(X)
        k = self._checked_k(k)
        scores = self.cand_scores_.copy()
        for node in np.flatnonzero(np.diff(self.cand_indptr_)):
            lo, hi = self.cand_indptr_[node], self.cand_indptr_[node + 1]
            total = scores[lo:hi].sum()
            scores[lo:hi] = scores[lo:hi] / total if total > 0 else scores[lo:hi]
        operands = [("Xb", X, ROWS)] + self._tree_operands() + self._cand_operands()
        operands.append(("cand_scores", dense_operand(scores, name="cand_scores"), WHOLE))
        packed = per_block(K.leaf_topk, operands, tail=(2 * k,), dtype=np.float64, token="tree-topk", stack=False,
                            static={"k": k, "form": self.sigma})
        return packed[:, :k].astype(np.int32), packed[:, k:].astype(np.float32)

    def figures(self, X, Y, *, split_every: int = 8) -> dict:
        """The tree's figures on ``(X, Y)`` in one pass (deterministic routing).

        Returns
        -------
        dict
            ``tree_recall`` (label-level: covered label assignments over all; for multiclass data the
            fraction of rows whose label is a candidate of their leaf), ``root_purity`` (sum over
            labels of the larger of its rows routed left or right at the root, over all assignments),
            ``root_balance`` (fraction of rows routed left), ``mean_depth`` and ``mean_candidates``
            (row averages of the leaf's depth and candidate count), ``top_labels_recall`` (recall of
            the ``leaf_labels`` most frequent training labels), ``n_samples``.
        """
        X = self._rows(X)
        Y = check_rows_operand(Y, X, "Y")
        if Y.shape[1] != self.n_labels_:
            raise ValueError(f"Y has {Y.shape[1]} labels, but this tree was fitted on {self.n_labels_}")
        operands = [("Xb", X, ROWS), ("Yb", Y, ROWS)] + self._tree_operands() + self._cand_operands()
        operands += [("depth", dense_operand(self.depth_, name="depth"), WHOLE),
                     ("top_labels", dense_operand(self.top_labels_, name="top_labels"), WHOLE)]
        L, F = self.n_labels_, K.N_FIGURES
        (s,) = dask.compute(block_sum(K.tree_figures, operands, tail=(F + L * 2,), dtype=np.float64,
                                      token="tree-figures", static={"form": self.sigma}, split_every=split_every))
        rows, assigned = max(s[0], 1), max(s[1], 1)
        left, right = s[F:F + L], s[F + L:]
        return {"tree_recall": s[2] / assigned, "root_purity": float(np.maximum(left, right).sum() / assigned),
                "root_balance": s[6] / rows, "mean_depth": s[3] / rows, "mean_candidates": s[4] / rows,
                "top_labels_recall": s[5] / assigned, "n_samples": int(s[0])}

    def leaf_figures(self, X, Y, *, split_every: int = 8) -> dict:
        """Where the rows of ``(X, Y)`` end, in one pass (deterministic routing): per node the rows, label
        assignments and covered assignments, and from them the row histograms of leaf depth and of
        candidate count and the recall by leaf depth (what the pipeline's report plots).

        Returns
        -------
        dict
            ``rows``, ``assignments``, ``covered`` (per node, ndarray of shape (n_nodes,)); ``depth``
            (the depths present), ``rows_by_depth``, ``recall_by_depth``; ``candidates`` (the candidate
            counts present) and ``rows_by_candidates``.
        """
        X = self._rows(X)
        Y = check_rows_operand(Y, X, "Y")
        if Y.shape[1] != self.n_labels_:
            raise ValueError(f"Y has {Y.shape[1]} labels, but this tree was fitted on {self.n_labels_}")
        operands = [("Xb", X, ROWS), ("Yb", Y, ROWS)] + self._tree_operands() + self._cand_operands()
        (s,) = dask.compute(block_sum(K.leaf_figures, operands, tail=(len(self.table_), 3), dtype=np.float64,
                                      token="tree-leaf-figures", static={"form": self.sigma}, split_every=split_every))
        rows, assignments, covered = s[:, 0], s[:, 1], s[:, 2]
        depth, n_cand = np.asarray(self.depth_, dtype=np.int64), np.diff(self.cand_indptr_)
        depths, at_depth = np.unique(depth, return_inverse=True)
        by = lambda values, groups, n: np.bincount(groups, weights=values, minlength=n)  # noqa: E731
        rows_d, assigned_d, covered_d = (by(v, at_depth, len(depths)) for v in (rows, assignments, covered))
        counts, at_count = np.unique(n_cand, return_inverse=True)
        return {"rows": rows, "assignments": assignments, "covered": covered, "depth": depths,
                "rows_by_depth": rows_d, "recall_by_depth": np.divide(covered_d, assigned_d, out=np.full(
                    len(depths), np.nan), where=assigned_d > 0),
                "candidates": counts, "rows_by_candidates": by(rows, at_count, len(counts))}

    # -- persistence ----------------------------------------------------------------------------

    @classmethod
    def _from_group(cls, group, meta: dict):
        """The saved tree, with ``meta_`` = its store's ``xmldask`` attribute (for example the training data's
        URL and fingerprint, given to :meth:`save` as ``meta``)."""
        tree = super()._from_group(group, meta)
        tree.W_ = sp.csr_matrix(tree.W_, dtype=np.float32)  # version 1: dense
        tree.meta_ = meta
        return tree
