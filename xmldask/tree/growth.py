"""Growing the spectral label tree level by level over row blocks.

All frontier nodes of one depth share the same passes over the data: every block task reads its
rows' pairs with the frontier nodes (the level state: row, node and path probability, kept between
passes where the block was computed) and returns partial sums keyed by node, which running sums and a
tree add up (:func:`xmldask.linalg.passes.block_sum`, the pattern of every pass of the project; with the
level state as a row operand each block's sums are computed where its state is).
A level costs ``1`` (moving the level state one level down) ``+ 1`` (statistics)
``+ 2 (1 + n_power_iter)`` (operator applications) ``+ MEDIAN_PASSES`` (weighted median) passes, plus
one for multilabel data (each node's ``Y^T D Y`` on its labels, so that the Jacobi-PCG iterations
need no pass; one per run of nodes whose blocks fit ``memory_budget``), whatever
its number of nodes, as long as the level's per-node partial sums fit in ``memory_budget`` bytes;
otherwise its nodes are split into groups, each with its own passes. The root level has no state to move.

The level state holds one pair per (row, frontier node) with a path probability over ``cutoff``:
one per row under deterministic routing, up to several hundred under the reference code's
fractional routing (ALOI at depth 14), which is what the routing costs in memory; routing every
pass from the root instead costs that work at every level above, at every pass.

References
----------
Mineiro and Karampatziakis, "A Hierarchical Spectral Method for Extreme Classification" (2015):
eq. (2) with the balance constraint projected out during power iteration (section 3.3), fractional
routing and the recall stopping rule (section 3.4); Halko, Martinsson and Tropp (2011), Algorithm
4.4 (randomized subspace iteration); the authors' code pmineiro/xlst (routing width, Jacobi-PCG,
weighted median, orphan repair).
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass, field

import dask.array as da
import numpy as np
import scipy.sparse as sp

from ..linalg.passes import ROWS, WHOLE, block_sum, check_rows_operand, check_x, dense_operand, per_block, whole_operand
from ..params import TREE_DEPTH, TREE_LEAF_LABELS
from ..scheduling import task_memory_limit
from . import _kernels as K

logger = logging.getLogger(__name__)

#: passes of the weighted-median refinement and histogram bins in each (resolution ``2R / 256**3``)
MEDIAN_PASSES, MEDIAN_BINS = 3, 256
#: default bytes of one block's per-node partial sums for a level (nodes beyond it form another group)
MEMORY_BUDGET = 1 << 28
#: on a cluster whose workers have a memory limit, the budget is at most this share of the smallest: a
#: worker holds a pass's node operand (as large), a tree-sum task two block results and its output, and
#: results waiting for it, beside the worker's own memory (1/8 restarted small workers: docs/measurements.md)
WORKER_MEMORY_SHARE = 1 / 16
#: Jacobi-PCG stops when ``||r||^2 < tol ||r_0||^2`` (the reference code's float32 / float64 tolerances)
CG_TOL = {np.dtype("float32"): 1e-4, np.dtype("float64"): 1e-6}
SIGMA_FORMS = ("code", "paper")
TASKS = ("auto", "multiclass", "multilabel")


@dataclass
class GrownTree:
    """The arrays of a grown tree (see :class:`xmldask.tree.SpectralLabelTree` for their meaning)."""

    table: np.ndarray
    W: sp.csr_matrix
    depth: np.ndarray
    eigenvalue: np.ndarray
    mass: np.ndarray
    cand_indptr: np.ndarray
    cand_indices: np.ndarray
    cand_scores: np.ndarray
    root_label_mass: np.ndarray
    task: str
    n_passes: int
    n_orphans: int
    seconds: float
    levels: list = field(default_factory=list)


class _Tree:
    """The tree under construction: node rows, routers (each on its node's features), candidate lists, and
    each frontier node's feature and label support (its parent's until its statistics pass)."""

    def __init__(self, d: int, L: int):
        self.d = d
        self.table = [[-1, -1, -1, 0.0, 1.0]]
        self.W: list[tuple[np.ndarray, np.ndarray]] = []  # (features, weights) per router
        self.depth, self.budget, self.eig, self.mass = [0], [None], [0.0], [0.0]
        self.cands: dict[int, tuple[np.ndarray, np.ndarray]] = {}
        self.features = {0: np.arange(d, dtype=np.int64)}
        self.labels = {0: np.arange(L, dtype=np.int64)}

    def routers(self) -> sp.csr_matrix:
        """``W`` as CSR float32, shape (max(n_routers, 1), d)."""
        if not self.W:
            return sp.csr_matrix((1, self.d), dtype=np.float32)
        indptr = np.zeros(len(self.W) + 1, dtype=np.int64)
        indptr[1:] = np.cumsum([len(f) for f, _ in self.W])
        return sp.csr_matrix((np.concatenate([w for _, w in self.W]).astype(np.float32),
                              np.concatenate([f for f, _ in self.W]), indptr), shape=(len(self.W), self.d))

    def arrays(self) -> tuple[np.ndarray, sp.csr_matrix]:
        return np.asarray(self.table, dtype=np.float64), self.routers()

    def split(self, node: int, features: np.ndarray, w: np.ndarray, bias: float, sigma: float) -> None:
        self.W.append((features, np.asarray(w, dtype=np.float32)))
        left, right = len(self.table), len(self.table) + 1
        self.table[node] = [left, right, len(self.W) - 1, bias, sigma]
        for child in (left, right):
            self.table.append([-1, -1, -1, 0.0, 1.0])
            self.depth.append(self.depth[node] + 1)
            self.budget.append(self.budget[node])
            self.eig.append(0.0)
            self.mass.append(0.0)
            self.features[child], self.labels[child] = self.features[node], self.labels[node]


class _Passes:
    """Level passes over ``(X, Y)``; counts the passes.

    Between levels each block's frontier (its rows' pairs with the nodes still to be learned, and
    their path probabilities) is kept as a persisted level state (one object per block, held where
    the block was computed: in the workers of a cluster), so that a pass routes nothing; a pass over
    the whole tree (``nodes=None``) routes from the root with the tree shipped once.
    """

    def __init__(self, X, Y, *, form, deterministic, cutoff, split_every, dense_bytes):
        self.X, self.Y = X, Y
        self.dense_bytes = dense_bytes
        self.static = {"form": form, "deterministic": deterministic, "cutoff": cutoff}
        self.split_every = split_every
        self.n_passes = 0
        self.table = self.W = None
        self.state = None  # the root's frontier: every row, p = 1

    def set_tree(self, tree: _Tree) -> None:
        self.table = dense_operand(np.asarray(tree.table, dtype=np.float64), name="table")
        self.W = router_operand(tree.routers(), min(self.dense_bytes, DENSE_ROUTERS_BYTES))

    def advance(self, tree: _Tree) -> None:
        """Move every block's frontier one level down the nodes just split (one pass, persisted)."""
        self.set_tree(tree)
        operands = [("Xb", self.X, ROWS), ("table", self.table, WHOLE), ("W", self.W, WHOLE),
                    ("pairs", self.state, ROWS)]
        state = per_block(K.advance, operands, tail=(), dtype=object, token="tree-advance", static=self.static)
        self.state = state.persist()
        self.n_passes += 1

    def run(self, kernel, whole: dict, nodes, tail, *, labels: bool = True, static: dict | None = None):
        """One pass: ``kernel`` on every block with the frontier pairs at ``nodes`` (or, when ``nodes`` is
        None, with the whole tree), tree-summed and computed."""
        operands = [("Xb", self.X, ROWS)] + ([("Yb", self.Y, ROWS)] if labels else [])
        kw = dict(static or {})
        if nodes is None:
            operands += [("table", self.table, WHOLE), ("W", self.W, WHOLE)]
            kw["form"] = self.static["form"]
        else:
            operands.append(("pairs", self.state, ROWS))
            kw["nodes"] = np.asarray(nodes, dtype=np.int64)
        operands += [(name, dense_operand(value, name=name), WHOLE) for name, value in whole.items()]
        self.n_passes += 1
        return block_sum(kernel, operands, tail=tail, dtype=np.float64, token=f"tree-{kernel.__name__}", static=kw,
                         split_every=self.split_every).compute()


#: routers are routed with as a dense array up to this size (a dense gather is faster than a sparse lookup),
#: as CSR beyond (text data: each router on its node's features)
DENSE_ROUTERS_BYTES = 1 << 26


def routing_routers(W, dense_bytes: int | None = None):
    """``W`` (dense or CSR) in the form routing takes: dense up to ``dense_bytes`` (default
    :data:`DENSE_ROUTERS_BYTES`), else CSR."""
    if W.shape[0] * W.shape[1] * 4 <= (DENSE_ROUTERS_BYTES if dense_bytes is None else dense_bytes):
        return W.toarray() if sp.issparse(W) else np.asarray(W)
    return sp.csr_matrix(W)


def router_operand(W, dense_bytes: int | None = None):
    """The routers as a whole operand, in :func:`routing_routers`' form."""
    return whole_operand(routing_routers(W, dense_bytes), name="W")


def default_memory_budget() -> int:
    """:data:`MEMORY_BUDGET`, or less on a cluster whose workers have a smaller memory limit (shared by the tasks a
    worker's threads run at once: :func:`~xmldask.scheduling.task_memory_limit`)."""
    limit = task_memory_limit()
    return MEMORY_BUDGET if limit is None else max(1, min(MEMORY_BUDGET, int(limit * WORKER_MEMORY_SHARE)))


def _groups(nodes: list[int], per_node_bytes, budget: int) -> list[list[int]]:
    """Consecutive groups of ``nodes`` whose partial sums (``per_node_bytes``: one size, or one per node)
    take at most ``budget`` bytes (at least one node a group)."""
    sizes = np.broadcast_to(np.asarray(per_node_bytes, dtype=np.int64), (len(nodes),))
    groups, current, used = [], [], 0
    for node, size in zip(nodes, sizes.tolist()):
        if current and used + size > budget:
            groups.append(current)
            current, used = [], 0
        current.append(node)
        used += size
    return groups + [current] if current else groups


def _jacobi_pcg(apply, B: np.ndarray, diag: np.ndarray, node_of: np.ndarray, *, max_iter: int,
                tol: float) -> np.ndarray:
    """Solve ``M_j V_j = B_j`` per node ``j`` and column, Jacobi-preconditioned CG from ``V = 0``.

    The rows of ``B`` (n_slots, r) are slots, ``node_of`` (n_slots,) their node; ``apply(V)`` computes
    ``M V`` for all nodes at once (one pass); ``diag`` (n_slots,) is the preconditioner's diagonal.
    Each (node, column) has its own step and Polak-Ribiere ``beta``; the iterate with the smallest
    residual is returned (the reference code's rule).
    """
    g = int(node_of.max(initial=-1)) + 1
    by_node = sp.csr_matrix((np.ones(len(node_of)), (node_of, np.arange(len(node_of)))), shape=(g, len(node_of)))

    def dot(A, C):  # per (node, column)
        return np.asarray(by_node @ (A * C))

    V = np.zeros_like(B)
    R = B.copy()
    Zp = R / diag[:, None]
    Pd = Zp.copy()
    r0 = dot(R, R)
    best, best_res = V.copy(), r0.copy()
    rz = dot(R, Zp)
    for _ in range(max_iter):
        if np.all(best_res <= tol * r0):
            break
        AP = apply(Pd)
        den = dot(Pd, AP)
        alpha = np.divide(rz, den, out=np.zeros_like(rz), where=den > 0)[node_of]
        V = V + alpha * Pd
        R_new = R - alpha * AP
        Z_new = R_new / diag[:, None]
        res = dot(R_new, R_new)
        better = res < best_res
        best = np.where(better[node_of], V, best)
        best_res = np.where(better, res, best_res)
        beta = np.divide(dot(Z_new, R_new - R), rz, out=np.zeros_like(rz), where=rz > 0)
        beta = np.maximum(beta, 0.0)[node_of]
        Pd = Z_new + beta * Pd
        rz = dot(R_new, Z_new)
        R = R_new
    return best


def _top_eigenpairs(Z: np.ndarray, bounds: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``lambda = sqrt(top eigenvalue of Z_j^T Z_j)`` and ``w = Z_j v / lambda`` per node, node ``j`` the rows
    ``bounds[j]:bounds[j + 1]`` of ``Z`` (sign: largest entry > 0); ``W`` flat like ``Z``'s rows."""
    g = len(bounds) - 1
    lam, W = np.zeros(g), np.zeros(Z.shape[0])
    for j in range(g):
        Zj = Z[bounds[j]:bounds[j + 1]]
        vals, vecs = np.linalg.eigh(Zj.T @ Zj)
        mu = vals[-1]
        if not mu > 0:
            continue
        lam[j] = math.sqrt(mu)
        w = Zj @ vecs[:, -1]
        w /= np.linalg.norm(w)
        lam[j] = lam[j] if np.isfinite(w).all() else 0.0
        W[bounds[j]:bounds[j + 1]] = w * np.sign(w[np.argmax(np.abs(w))])
    return lam, W


def _candidates(mass: np.ndarray, budget: int, recall: float) -> np.ndarray:
    """The node's labels by mass, descending (ties by label id): the smallest top-k over ``recall`` of
    the mass, at most ``budget`` of them, labels with mass only."""
    order = np.argsort(-mass, kind="stable")
    positive = order[mass[order] > 0]
    if not len(positive):
        return positive
    cum = np.cumsum(mass[positive])
    k = int(np.searchsorted(cum, recall * cum[-1], side="right")) + 1
    return positive[:min(budget, k, len(positive))]


def _task(Y: da.Array) -> str:
    many = per_block(_rows_with_many_labels, [("Yb", Y, ROWS)], tail=(1,), dtype=np.float64,
                      token="tree-task-block")
    return "multilabel" if float(many.sum().compute()) > 0 else "multiclass"


def _rows_with_many_labels(Yb):
    return np.array([float(np.count_nonzero(np.diff(sp.csr_matrix(Yb).indptr) > 1))])


def _max_row_norm(X: da.Array) -> float:
    parts = per_block(K.row_norm_max, [("Xb", X, ROWS)], tail=(1,), dtype=np.float64, token="tree-norm-block")
    return float(parts.max().compute())


def grow_tree(X, Y, *, max_depth: int = TREE_DEPTH, leaf_labels: int = TREE_LEAF_LABELS, recall: float = 0.999,
              routing: str = "fractional", sigma: str = "code", task: str = "auto", block_size: int = 10,
              n_power_iter: int = 1, cg_max_iter: int = 20, orphan_repair: bool = True, cutoff: float = K.CUTOFF,
              memory_budget: int | None = None, split_every: int = 8, random_state=None) -> GrownTree:
    """Grow a hierarchical spectral label tree over row blocks, level by level.

    Parameters
    ----------
    X : dask.array.Array, shape (n_samples, n_features)
        Row blocks (CSR or dense), one column chunk.
    Y : dask.array.Array, shape (n_samples, n_labels)
        Binary labels with ``X``'s row blocks.
    max_depth : int
        Largest depth of a leaf (the root has depth 0).
    leaf_labels : int
        Leaf label budget ``s``: a node splits only while ``s`` labels are needed for ``recall`` of
        its label mass (``smin = s - 1``); a leaf keeps its top labels, at most ``s`` (orphan
        repair may add more).
    recall : float
        Acceptable training recall ``phi`` of the stopping rule (0.999 in the paper).
    routing : {"fractional", "deterministic"}
        Routing of the training rows while the tree grows (the paper's ablation: deterministic).
    sigma : {"code", "paper"}
        Routing width: ``sqrt(lambda / m)`` with ``erf`` (the reference code) or ``lambda / m``
        with ``Phi`` (the paper's text).
    task : {"auto", "multiclass", "multilabel"}
        Diagonal ``Y^T D Y`` (multiclass) or Jacobi-PCG solves (multilabel); ``auto``: multilabel
        when some row has more than one label (one extra pass).
    block_size, n_power_iter : int
        Randomized subspace iteration: ``block_size`` columns, ``n_power_iter`` power steps after
        the first application (the reference code: 10 and 1).
    cg_max_iter : int
        Jacobi-PCG iterations at most (multilabel).
    orphan_repair : bool
        Append every label no training row's deterministic leaf covers to the leaf where most of
        its rows land (two passes).
    cutoff : float
        Path probabilities at most this are dropped.
    memory_budget : int or None
        Bytes of one block's per-node partial sums for a level; larger levels are split into groups.
        ``None``: :data:`MEMORY_BUDGET`, or :data:`WORKER_MEMORY_SHARE` of the smallest worker memory
        limit of the current cluster, shared by the worker's threads, when that is less.
    split_every : int
        Fan-in of the tree sums.
    random_state : int, numpy.random.Generator or None
        Seeds the random test matrices (each node its own stream, from the node id).

    Returns
    -------
    GrownTree
    """
    X = check_x(X)
    Y = check_rows_operand(Y, X, "Y")
    memory_budget = default_memory_budget() if memory_budget is None else memory_budget
    for name, value in (("max_depth", max_depth), ("leaf_labels", leaf_labels), ("block_size", block_size),
                        ("memory_budget", memory_budget)):
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
            raise ValueError(f"{name} must be a positive integer, but is {value!r}")
    if routing not in ("fractional", "deterministic"):
        raise ValueError(f"routing must be 'fractional' or 'deterministic', but is {routing!r}")
    if sigma not in SIGMA_FORMS:
        raise ValueError(f"sigma must be one of {SIGMA_FORMS}, but is {sigma!r}")
    if task not in TASKS:
        raise ValueError(f"task must be one of {TASKS}, but is {task!r}")
    if not 0 < recall <= 1:
        raise ValueError(f"recall must be in (0, 1], but is {recall!r}")
    seed = (int(random_state) if isinstance(random_state, (int, np.integer))
            else int(np.random.default_rng(random_state).integers(2**63)))
    start = time.perf_counter()
    n, d = X.shape
    L = Y.shape[1]
    extra_passes = 1 + (task == "auto")
    task = _task(Y) if task == "auto" else task
    R = _max_row_norm(X)
    passes = _Passes(X, Y, form=sigma, deterministic=routing == "deterministic", cutoff=cutoff,
                     split_every=split_every, dense_bytes=memory_budget)
    passes.n_passes = extra_passes
    tree = _Tree(d, L)
    tree.budget[0] = int(leaf_labels)
    root_mass = None
    levels = []
    frontier = [0]
    for depth in range(max_depth + 1):
        if not frontier:
            break
        if depth:
            passes.advance(tree)
        splittable, stats = [], {}
        sizes = [(1 + 2 * len(tree.features[node]) + len(tree.labels[node])) * 8 for node in frontier]
        for group in _groups(frontier, sizes, memory_budget):
            stats.update(_level_stats(passes, tree, group))
        if depth == 0:
            root_mass = np.zeros(L)
            root_mass[stats[0].labels] = stats[0].mass
        for node in frontier:
            st = stats[node]
            tree.mass[node] = st.m
            tree.features[node], tree.labels[node] = st.features, st.labels  # what its children inherit
            at = _candidates(st.mass, tree.budget[node], recall)
            cands = st.labels[at]
            tree.budget[node] = len(cands)  # s_node = min(s_parent, k): the children's inherited budget
            tree.cands[node] = (cands, st.mass[at])
            if depth < max_depth and len(cands) >= leaf_labels and st.m > 0 and np.linalg.norm(st.mu) > 0:
                splittable.append(node)
        # a node's partial sums: Z on its features, T on its labels (x r each), a median histogram
        per_node = [(len(stats[node].features) + len(stats[node].labels)) * block_size * 8 + (MEDIAN_BINS + 2) * 8
                    for node in splittable]
        next_frontier = []
        for group in _groups(splittable, per_node, memory_budget):
            next_frontier += _learn_group(passes, tree, group, stats, task=task, block_size=block_size,
                                          n_power_iter=n_power_iter, cg_max_iter=cg_max_iter, R=R, sigma=sigma,
                                          seed=seed, L=L, memory_budget=memory_budget)
        for node in frontier:  # its children hold what they inherit
            del tree.features[node], tree.labels[node]
        levels.append({"depth": depth, "nodes": len(frontier), "split": len(next_frontier) // 2,
                       "passes": passes.n_passes, "seconds": round(time.perf_counter() - start, 3)})
        logger.info("tree level %d: %d nodes, %d split (%d passes so far)", depth, len(frontier),
                    len(next_frontier) // 2, passes.n_passes)
        frontier = next_frontier
    n_orphans = 0
    passes.state = None  # frees the level state
    passes.set_tree(tree)
    if orphan_repair:
        n_orphans = _repair_orphans(passes, tree, L, memory_budget)
    table, W = tree.arrays()
    indptr = np.zeros(len(table) + 1, dtype=np.int64)
    lists = [tree.cands[i] if i in tree.cands and table[i, K.LEFT] < 0 else (np.zeros(0, np.int64), np.zeros(0))
             for i in range(len(table))]
    indptr[1:] = np.cumsum([len(c) for c, _ in lists])
    return GrownTree(table=table, W=W, depth=np.asarray(tree.depth, dtype=np.int32),
                     eigenvalue=np.asarray(tree.eig), mass=np.asarray(tree.mass),
                     cand_indptr=indptr, cand_indices=np.concatenate([c for c, _ in lists]).astype(np.int64),
                     cand_scores=np.concatenate([s for _, s in lists]).astype(np.float64),
                     root_label_mass=root_mass, task=task, n_passes=passes.n_passes, n_orphans=n_orphans,
                     seconds=time.perf_counter() - start, levels=levels)


@dataclass
class _NodeStats:
    """A frontier node's statistics pass: its weight ``m``, its features (those of its rows) with ``mu = sum p x``
    on them, and its labels with mass (ascending) with their masses."""

    m: float
    features: np.ndarray
    mu: np.ndarray
    labels: np.ndarray
    mass: np.ndarray


def _slots(supports: list[np.ndarray], width: int) -> np.ndarray:
    """Sorted keys ``j width + i`` of the group's supports (local node ``j``, its sorted ids ``i``)."""
    if not supports:
        return np.zeros(0, np.int64)
    return np.concatenate([j * width + np.asarray(ids, dtype=np.int64) for j, ids in enumerate(supports)])


def _level_stats(passes: _Passes, tree: _Tree, group: list[int]) -> dict[int, _NodeStats]:
    """One statistics pass for a group of frontier nodes, on the supports they inherited; each node's own."""
    d, L, g = tree.d, passes.Y.shape[1], len(group)
    fsup, lsup = [tree.features[node] for node in group], [tree.labels[node] for node in group]
    fslots, lslots = _slots(fsup, d), _slots(lsup, L)
    nf = len(fslots)
    s = passes.run(K.level_stats, {"fslots": fslots, "lslots": lslots}, group, (g + 2 * nf + len(lslots),))
    mu, a, mass = s[g:g + nf], s[g + nf:g + 2 * nf], s[g + 2 * nf:]
    fo, lo = np.cumsum([0] + [len(f) for f in fsup]), np.cumsum([0] + [len(f) for f in lsup])
    out = {}
    for j, node in enumerate(group):
        on = a[fo[j]:fo[j + 1]] > 0
        has = mass[lo[j]:lo[j + 1]] > 0
        out[node] = _NodeStats(m=float(s[j]), features=fsup[j][on], mu=mu[fo[j]:fo[j + 1]][on], labels=lsup[j][has],
                               mass=mass[lo[j]:lo[j + 1]][has])
    return out


def _learn_group(passes: _Passes, tree: _Tree, group: list[int], stats: dict, *, task, block_size, n_power_iter,
                 cg_max_iter, R, sigma, seed, L, memory_budget) -> list[int]:
    """Learn the routers of a group of nodes of one level (shared passes); split them; new node ids.

    Every node's vectors live on its slots: ``Q``, ``Z`` and ``w`` on its features, ``T``, ``V`` and the CG
    vectors on its labels with mass.
    """
    g, d = len(group), tree.d
    st = [stats[node] for node in group]
    # the (node, feature) slots: the node's rows' features
    xslots = _slots([s.features for s in st], d)
    sizes = np.array([len(s.features) for s in st])
    bounds = np.concatenate([[0], np.cumsum(sizes)])
    x_node = np.repeat(np.arange(g), sizes)
    x_sum = sp.csr_matrix((np.ones(len(x_node)), (x_node, np.arange(len(x_node)))), shape=(g, len(x_node)))
    mu = np.concatenate([s.mu for s in st])
    P = mu / np.sqrt(x_sum @ (mu * mu))[x_node]
    # the (node, label) slots with label mass: T, V and the CG vectors live there, not on g x L
    slots = _slots([s.labels for s in st], L)
    node_of = np.repeat(np.arange(g), [len(s.labels) for s in st])
    S_slot = np.concatenate([s.mass for s in st])

    label_gram = None if task == "multiclass" else _label_gram(passes, group, slots, node_of, memory_budget)

    def project(Z):  # (I - P P^T) Z per node
        return Z - P[:, None] * (x_sum @ (P[:, None] * Z))[x_node]

    def apply(Q):
        # (I - PP^T) A (I - PP^T) Q: projecting the input too keeps the operator symmetric, so a
        # rank-deficient A (a node with fewer labels than block_size) cannot leak A P into the Ritz values
        Q = project(Q)
        r = Q.shape[1]
        T = passes.run(K.level_yt_x, {"Omega": Q, "xslots": xslots, "slots": slots}, group, (len(slots), r))
        if task == "multiclass":
            V = T / np.maximum(S_slot, 1.0)[:, None]
        else:
            tol = CG_TOL.get(np.dtype(passes.X.dtype), 1e-6)
            gram_times = (label_gram.__matmul__ if label_gram is not None else
                          lambda M: passes.run(K.level_yt_y, {"V": M, "slots": slots}, group, (len(slots), r)))
            V = _jacobi_pcg(gram_times, T, np.maximum(S_slot, passes.static["cutoff"]), node_of, max_iter=cg_max_iter,
                            tol=tol)
        return project(passes.run(K.level_xt_y, {"V": V, "slots": slots, "xslots": xslots}, group,
                                  (len(xslots), r)))

    def orthonormal(Z):  # each node's block by QR (zero columns past a node's feature count)
        out = np.zeros_like(Z)
        for j in range(g):
            q = np.linalg.qr(Z[bounds[j]:bounds[j + 1]])[0]
            out[bounds[j]:bounds[j + 1], :q.shape[1]] = q
        return out

    r = min(block_size, d)
    Omega = np.concatenate([np.random.default_rng([seed, node]).standard_normal((n, r))
                            for node, n in zip(group, sizes)])
    Z = apply(Omega)
    for _ in range(n_power_iter):
        Z = apply(orthonormal(Z))
    lam, Wg = _top_eigenpairs(Z, bounds)
    bias = _weighted_median(passes, group, Wg, xslots, R)
    new = []
    for j, node in enumerate(group):
        m = tree.mass[node]
        tree.eig[node] = lam[j]
        if not lam[j] > 0:
            continue
        width = math.sqrt(lam[j] / m) if sigma == "code" else lam[j] / m
        tree.split(node, st[j].features, Wg[bounds[j]:bounds[j + 1]], bias[j], width)
        new += [int(tree.table[node][K.LEFT]), int(tree.table[node][K.RIGHT])]
    return new


def _label_gram(passes: _Passes, group: list[int], slots: np.ndarray, node_of: np.ndarray, memory_budget: int):
    """The group's ``Y^T D_j Y`` blocks on their slots as one block-diagonal CSR matrix, so that the
    Jacobi-PCG solves need no pass: one pass per run of nodes whose dense blocks fit ``memory_budget``
    (each block kept sparse afterwards: labels that share no row at the node add nothing). ``None`` when
    one node's block alone exceeds the budget (the solves then take a pass per iteration)."""
    offsets = np.searchsorted(node_of, np.arange(len(group) + 1))
    sizes = np.diff(offsets)
    if len(sizes) and int(sizes.max()) ** 2 * 8 > memory_budget:
        return None
    L = passes.Y.shape[1]
    blocks = []
    for run in _groups(list(range(len(group))), sizes * sizes * 8, memory_budget):
        j0, j1 = run[0], run[-1] + 1
        sub = slots[offsets[j0]:offsets[j1]] - j0 * L  # the run's slots, its first node as local node 0
        sub_sizes = sizes[j0:j1]
        flat = passes.run(K.level_label_gram, {"slots": sub, "offsets": offsets[j0:j1 + 1] - offsets[j0]},
                          group[j0:j1], (int(np.sum(sub_sizes * sub_sizes)),))
        starts = np.concatenate([[0], np.cumsum(sub_sizes * sub_sizes)])
        blocks += [sp.csr_matrix(flat[a:b].reshape(n, n)) for a, b, n in zip(starts[:-1], starts[1:], sub_sizes)]
    return sp.block_diag(blocks, format="csr") if blocks else sp.csr_matrix((0, 0))


def _weighted_median(passes: _Passes, group: list[int], Wg: np.ndarray, xslots: np.ndarray, R: float) -> np.ndarray:
    """Weighted median of ``w_j^T x`` per node (``Wg`` on the feature slots ``xslots``) by histogram
    refinement (``MEDIAN_PASSES`` passes): the upper edge of the final bin where the cumulative weight first
    exceeds half."""
    g = len(group)
    lo, hi = np.full(g, -R * (1 + 1e-9) - 1e-300), np.full(g, R * (1 + 1e-9) + 1e-300)
    for _ in range(MEDIAN_PASSES):
        h = passes.run(K.level_histogram, {"w": Wg, "lo": lo, "hi": hi, "xslots": xslots}, group, (g, MEDIAN_BINS + 2),
                       labels=False, static={"bins": MEDIAN_BINS})
        half = h.sum(axis=1) / 2
        cum = np.cumsum(h, axis=1)
        k = np.argmax(cum > half[:, None], axis=1)  # column; 1..bins within range
        k = np.clip(k, 1, MEDIAN_BINS)
        width = (hi - lo) / MEDIAN_BINS
        lo, hi = lo + (k - 1) * width, lo + k * width
    return hi


def _repair_orphans(passes: _Passes, tree: _Tree, L: int, memory_budget: int) -> int:
    """Append labels no row's deterministic leaf covers to the leaf where most of their rows land."""
    table, _ = tree.arrays()
    leaves = np.flatnonzero(table[:, K.LEFT] < 0)
    indptr, indices = _cand_csr(tree, len(table))
    cov = passes.run(K.coverage, {"cand_indptr": indptr, "cand_indices": indices}, None, (L, 2))
    orphans = np.flatnonzero((cov[:, 0] > 0) & (cov[:, 1] == 0))
    for chunk in _groups(list(orphans), len(leaves) * 8, memory_budget):
        counts = passes.run(K.leaf_label_counts, {"leaves": leaves, "labels": np.asarray(chunk)}, None,
                            (len(leaves), len(chunk)))
        for i, label in enumerate(chunk):
            leaf = int(leaves[np.argmax(counts[:, i])])
            cands, scores = tree.cands.get(leaf, (np.zeros(0, np.int64), np.zeros(0)))
            tree.cands[leaf] = (np.append(cands, label), np.append(scores, 0.0))
    return len(orphans)


def _cand_csr(tree: _Tree, n_nodes: int) -> tuple[np.ndarray, np.ndarray]:
    lists = [tree.cands.get(i, (np.zeros(0, np.int64), None))[0] for i in range(n_nodes)]
    indptr = np.zeros(n_nodes + 1, dtype=np.int64)
    indptr[1:] = np.cumsum([len(c) for c in lists])
    return indptr, (np.concatenate(lists) if lists else np.zeros(0)).astype(np.int64)


__all__ = ["GrownTree", "grow_tree"]
