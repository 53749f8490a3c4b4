"""Label centroids in a balanced label tree: the model of large label spaces, whose cost per row grows with a
candidate set, not with the number of labels.

Each label ``l`` is represented by the centroid of its training rows, ``w_l = normalize(sum_{i: y_il = 1}
x_i)``, the rows tf-idf weighted and scaled to unit L2 norm (Rocchio's classifier; the label representation
that Parabel, Bonsai and Omikuji cluster to build their trees, Prabhu et al. 2018). Labels are grouped by
recursive balanced spherical 2-means on their centroids into clusters of at most ``leaf_labels`` labels (the
partition of Parabel's tree), each summarised by the normalised sum of its labels' centroids. A row is scored
against every cluster summary, and against the labels of its ``beam`` best clusters only: ``cos(x, w_l)``. Past
thousands of clusters the summaries give way to trained routers (Parabel's internal nodes, in two levels), where a
task can hold every training row to train them: a row scores the routers of about ``sqrt(n_clusters)`` groups of
clusters, then those of the clusters of its best groups.

Training is two passes over the row blocks (document frequencies, then ``Y^T X``, summed as a tree of sparse
partial sums) and the clustering of the label centroids in memory; prediction reads each row block once. The
label-sized objects are sparse (``nnz(W) <= sum_i nnz(x_i) |y_i|``) and checked against the memory available
before the first pass (:func:`centroid_memory`).

Labels without a training row have no centroid: they are in no cluster and never predicted
(``n_unseen_labels_`` counts them; ``xmldask train`` reports the count).
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import logging
import math
import operator
import threading
import time
from typing import Literal

import dask
import dask.array as da
import numpy as np
import psutil
import scipy.sparse as sp
from pydantic import Field

from ..base import ParamsMixin, as_rows, check_float, check_int, seed_of
from ..linalg.passes import (
    ROWS,
    WHOLE,
    compute_each,
    per_block,
    per_block_objects,
    spread_rows,
    tree_combine,
    whole_operand,
)
from ..metrics import paired_gain
from ..params import FamilyParams
from ..scheduling import memory_for_data, parallelism, release_memory, task_memory_limit, worker_memory_limit
from ..store.layout import StoreError, read_checked
from ..store.models import SavedModel, non_finite, read_model_array, store_location
from . import _graph
from . import _kernels as K
from ._candidates import (
    ClusterEntries,
    GroupRoutes,
    candidate_topk,
    grouped_topk,
    prune_rows,
    sparse_product_dense,
    summary_topk,
)
from ._svm import MAX_PASSES, PRUNE, TOL, cluster_svms, streamed_pass

__all__ = ["CENTROID_VERSION", "CentroidParams", "LabelCentroidClassifier", "balanced_clusters", "centroid_memory",
           "classifiers_fit", "entry_bound", "label_block_bounds", "label_passes", "labels_scored_per_row",
           "router_share", "svm_groups"]

logger = logging.getLogger(__name__)

#: 3: the routers (``R``, ``router_bias``, ``U``, ``cluster_bias``, ``group_offsets``, ``routing``, ``group_beam``); 2:
#: labels' classifiers (``V``, ``svm_bias``, ``svm_weight``); version 1 and 2 stores (routed by summaries) still load
CENTROID_VERSION = 3
#: Lloyd iterations of each balanced 2-means split at most (a split stops earlier when its assignment stops changing).
#: 20 was tried: at 100K labels P@1 at beam 10 over 10 seeds 79.9 +- 1.9 -> 80.7 +- 1.2, but the 1M-label set's
#: default model (seed 0) lost 1.5 test P@1 (85.71 -> 84.17) and trained 46 % longer; 8 kept until more seeds decide
SPLIT_ITERATIONS = 8
#: beams that ``beam="auto"`` compares on held-out training rows (those above the number of clusters dropped)
AUTO_BEAMS = (10, 20, 40, 80)
#: passes of a router's coordinate descent at most (a label's classifier: :data:`~xmldask.models._svm.MAX_PASSES`):
#: a router sees every row of its level, most of them negatives; measured at 100K labels (4 groups' cluster
#: routers), 10 passes gave the weights (686,113) and routing accuracy of 100 (433 / 923 test rows either way)
ROUTER_PASSES = 10
#: groups whose cluster routers a routed row scores, that the held-out rows compare (those above the groups dropped)
AUTO_GROUPS = (4, 8, 16)
#: a wider beam is chosen when the held-out rows it gets right, less those it gets wrong that the narrower beam got
#: right, exceed this many standard deviations of that paired difference (McNemar's sign test, about 2.5 %
#: one-sided): its cost a row grows with the beam, a gain within the noise of the held-out rows does not pay it
BEAM_GAIN_SIGMAS = 2.0
#: and only when it gets at least this share more of the held-out rows right than the beam taken so far, for each
#: doubling of the beam: a doubling doubles the candidates a row scores (at 1M labels, 296 -> 421 us a row from beam
#: 10 to 40, ``bench/predict_cost.py``), which a quarter of a point of P@1 does not pay, however well resolved
BEAM_MIN_GAIN = 0.005
#: exponents ``g`` of the label weights ``n_l ** g`` (``n_l``: the label's training rows) in a cluster's summary,
#: the normalised weighted sum of its labels' centroids, that ``summary_exponent="auto"`` compares on held-out training
#: rows, in this order: a later one is taken only for a gain at the narrowest beam beyond the noise of those rows
#: (as for the beam). 0 weighs every label alike; 1 sums the cluster's rows, so that the frequent labels, which most
#: rows have, pull the summary; measured (docs/large-labels.md): at 100K and 1M labels, 0.5 routes best by far
SUMMARY_EXPONENTS = (0.0, 0.5, 1.0)
#: weights ``w`` of the labels' classifiers in a candidate's score, ``cos(x, w_l) + w (v_l x + b_l)``, that
#: ``svm_weight="auto"`` compares on the held-out training rows at the chosen beam, in this order (a later one only
#: for a gain beyond their noise, as for the beam): 0 is the centroids alone (no classifier kept). The classifiers'
#: margins are about 1 where the cosines are a few tenths, so the grid runs from a nudge of the cosines' ranking to
#: the classifiers' own (measured on test rows: 1/16 to 1/8 best on EURLex-4K- and 100K-shaped data; the held-out
#: rule chose 1/64 at 100K and 1M labels, where 1/64 to 1/16 are within the noise of 2,000 rows)
SVM_WEIGHTS = (0.0, 1 / 64, 1 / 32, 1 / 16, 1 / 8, 1 / 4, 1 / 2, 1.0)
#: ``centroid_threshold="auto"`` tries these, in order, on the held-out rows at the chosen beam and weight: a unit
#: centroid's entries below one (at most ``1 / t**2`` entries are left a label) are dropped while the held-out P@1 it
#: costs is within :data:`PRUNE_TOLERANCE` and not resolved. A frequent label's centroid holds every word its rows
#: ever had, mostly below a hundredth; at 1M labels (5,000 test rows, beam 10) dropping those below 0.01 / 0.02 /
#: 0.03 / 0.05 left 70 / 58 / 47 / 30 % of the entries, scored the candidates in 152 / 102 / 107 / 65 us a row
#: against 317, at test P@1 -0.06 / 0.00 / -0.28 / -2.84 points (rescaling the rows after was worse)
CENTROID_THRESHOLDS = (1 / 128, 1 / 64, 1 / 32, 1 / 16)
#: held-out P@1 that a centroid threshold may cost, at the beam's rate of exchange (:data:`BEAM_MIN_GAIN`: what a
#: doubling of the candidates' cost must gain): the thresholds halve the candidates' cost, about half a row's (the
#: summaries the rest), so a row's by about a third, worth a quarter of a point. A fifth of a point was within the
#: noise of 2,000 held-out rows (the 1M pipeline's lost 4 of 1,975 at 1/128, where 5,000 test rows lost nothing at
#: 1/64); half a point cost the 100K preset 0.7 points of test P@1 (86.56 % against 87.26 %)
PRUNE_TOLERANCE = BEAM_MIN_GAIN / 2
#: share of the fitting process's available memory that the classifiers may take (:func:`classifiers_fit`; the
#: share that ``xmldask train`` allows a whole fit)
SVM_MEMORY_SHARE = 0.6
#: the SVMs' C (Parabel's and Omikuji's default)
SVM_C = 1.0
#: share of a worker's memory limit (without a limit: of this machine's memory) that a task training the
#: classifiers of a group of clusters may take with its rows (:data:`SVM_TASK_COPIES` copies)
SVM_GROUP_SHARE = 1 / 8
#: copies of a group's rows that a task training its classifiers holds at its peak: the gathered pieces and their
#: stack, then a cluster's rows taken out, renumbered to its features and widened for the coordinate descent (with
#: two counted, a 1M-label fit's worker of 2 threads and 1 GiB went past 95 % of its limit and was restarted)
SVM_TASK_COPIES = 4
#: training rows held out (at most) for that choice: the standard error of a P@1 near 0.8 on them is 0.9 points,
#: and the comparison of two beams on the same rows is paired (a row scores the same with either beam unless the
#: wider beam reaches a better label), so it resolves much smaller differences
HELD_OUT_ROWS = 2000
#: rows of a row block transformed at once when its rows are gathered for the classifiers
GATHER_ROWS = 8192
#: the training rows held out are at most this share of them (the rest train the classifiers)
HELD_OUT_SHARE = 0.25
#: share of a worker's memory limit that three copies of one label block's sums may take (:func:`label_block_bounds`)
LABEL_BLOCK_SHARE = 0.25
#: share of the workers' memory (their limits summed) that the partial sums of one pass's label blocks may take
#: together: label-sized sums past it are made in several passes over the rows, a group of label blocks each
PASS_SHARE = 0.25
#: the same for a cluster block of a prediction task, which also holds its row block's dense summary scores, the
#: summaries' dense columns and the candidates of two blocks
PREDICT_BLOCK_SHARE = 1 / 8
#: rows of a piece at least, where a prediction's row blocks are cut so that every thread has one (a row costs tens
#: to hundreds of microseconds: 1,024 rows are tens of milliseconds, a task's overhead about one)
PREDICT_PIECE_ROWS = 1024
#: a model read in cluster blocks is kept by each worker that reads it (:class:`_BlockCache`), for the next row
#: blocks and the next predictions, when its blocks together take at most this share of the worker's memory limit;
#: past it, each row block's tasks read the blocks one at a time (a 1M-label model's 1.4 GiB took 1 to 2 s a row
#: block and a call)
SHARED_READ_SHARE = 1 / 4
#: a loaded model whose centroids and summaries exceed this many bytes reads them from its store when they are first
#: used (a cluster-blocked prediction never does: its tasks read them in blocks); below, at load, checked whole
LAZY_BYTES = 1 << 28
#: bytes of one stored sparse entry (float32 value, int32 column id), as in the partial sums
_ENTRY_BYTES = 8
#: centroid entries recomputed at a time without the held-out rows (:meth:`LabelCentroidClassifier._without`): a
#: slice's temporaries (a few copies of it, 8 bytes an entry) stay near 100 MiB beside the one centroid-sized copy
WITHOUT_ENTRIES = 1 << 22
#: a feature's summary column is kept dense when at least this share of the clusters have the feature: a row's
#: frequent words are in most summaries (the head of a Zipf vocabulary), and a sparse-times-dense product walks
#: such a column far faster than a sparse product, which accumulates each entry through a hash of columns
DENSE_SHARE = 1 / 4
#: dense summary cells at most (float32: 128 MiB), the columns in most clusters first
DENSE_BUDGET = 1 << 25


# --------------------------------------------------------------------------------------------------
# block kernels (NumPy / SciPy, no Dask)


def _unit_rows(A: sp.csr_matrix, *, copy: bool = True) -> sp.csr_matrix:
    """``A`` with every non-zero row scaled to unit L2 norm (float32; a copy, or ``A`` itself scaled where ``copy``
    is False and it is a float32 CSR matrix). Its temporaries are a float32 array of its values or two: the squares
    (with ``A``'s indices, not a copy of them) and each entry's norm."""
    A = sp.csr_matrix(A, dtype=np.float32, copy=copy)
    squares = sp.csr_matrix((A.data * A.data, A.indices, A.indptr), shape=A.shape)
    norms = np.sqrt(np.asarray(squares.sum(axis=1), dtype=np.float64).ravel())
    del squares
    norms[norms == 0] = 1.0
    A.data /= np.repeat(norms.astype(np.float32), np.diff(A.indptr))
    return A


def _rows_block(Xb, idf, *, copy: bool = True):
    """A row block as the model sees it: tf-idf weighted (``idf`` None: as is), unit L2 rows, CSR float32.
    ``copy`` False: ``Xb`` is the caller's own, to be scaled in place where it can be (a float32 CSR matrix)."""
    Xb = sp.csr_matrix(Xb, dtype=np.float32)
    if idf is not None:
        return _unit_rows(K.transform_rows(Xb, idf, normalize=False), copy=False)  # a copy already
    return _unit_rows(Xb, copy=copy)


def _label_sums_block(Xb, Yb, idf=None, *, share: float = 0.0, seed: int = 0, block=None, bounds=None):
    """``((column counts of Y_b, held-out X rows, their Y rows), *pieces of Y_b^T X_b)`` of one row block: float32
    sums of unit rows (the centroids' relative precision is about 1e-7 times the rows a label has, far below what
    the ranking notices), of the labels ``bounds[0]:bounds[-1]`` cut into the label blocks ``bounds`` (None: all
    labels, one piece), and a seeded random ``share`` of the block's rows, transformed, for the held-out choice
    of the beam."""
    Xb = _rows_block(Xb, idf)
    Yb = sp.csr_matrix(Yb, dtype=np.float32)
    held = np.flatnonzero(_held_out(Xb.shape[0], share, seed, block))
    small = (np.asarray(Yb.sum(axis=0), dtype=np.float64).ravel(), Xb[held], Yb[held])
    if bounds is None:
        return small, (Yb.T @ Xb).tocsr()
    first, stop = int(bounds[0]), int(bounds[-1])  # the labels of this pass only
    P = (Yb[:, first:stop].T @ Xb).tocsr()
    return (small, *(P[a - first:b - first] for a, b in zip(bounds[:-1], bounds[1:])))


def _held_out(n: int, share: float, seed: int, block) -> np.ndarray:
    """The held-out rows of a block of ``n`` (a boolean mask): a seeded random ``share`` of them."""
    return np.random.default_rng([seed, block or 0]).random(n) < share


def _gather_block(Xb, Yb, idf=None, *, position, bounds, share: float = 0.0, seed: int = 0, block=None,
                  keep=1.0) -> tuple:
    """The rows of one row block that train each group of classifiers: for the classifiers ``bounds[j]:bounds[j +
    1]`` (``position``: a label's classifier, such as its position in cluster order, -1 for none), the block's rows
    with a label of one of them, transformed, and their positives among them, the held-out rows left out (those of
    :func:`_label_sums_block`), and of the others a seeded random ``keep`` share (one for all groups, or one per
    group: a row kept for a group keeps it for the groups of larger shares). A pair ``([X pieces], [Y pieces])`` per
    group, the block transformed :data:`GATHER_ROWS` rows at a time (a transform's copies of a whole block would
    outweigh what it gives)."""
    base, end = int(bounds[0]), int(bounds[-1])
    Y = sp.csr_matrix(Yb)
    train = ~_held_out(Y.shape[0], share, seed, block)
    keep = np.broadcast_to(np.asarray(keep, np.float64), (len(bounds) - 1,))
    draw = np.random.default_rng([seed, block or 0, 1]).random(Y.shape[0]) if np.any(keep < 1.0) else None
    out = [([], []) for _ in range(len(bounds) - 1)]
    for start in range(0, Y.shape[0], GATHER_ROWS):
        stop = min(start + GATHER_ROWS, Y.shape[0])
        Yr = sp.coo_matrix(Y[start:stop])
        at = position[Yr.col]
        real = (at >= base) & (at < end)  # the labels of this pass's groups
        P = sp.csr_matrix((np.ones(int(real.sum()), np.float32), (Yr.row[real], at[real] - base)),
                          shape=(stop - start, end - base))
        if not P.nnz:
            continue
        Xr = _rows_block(Xb[start:stop], idf)
        for (xs, ys), first, last, share_kept in zip(out, bounds[:-1], bounds[1:], keep):
            Pg = P[:, int(first) - base:int(last) - base]
            kept = train[start:stop] if share_kept >= 1.0 else train[start:stop] & (draw[start:stop] < share_kept)
            rows = np.flatnonzero((np.diff(Pg.indptr) > 0) & kept)
            if len(rows):
                xs.append(Xr[rows])
                ys.append(Pg[rows])
    return tuple(out)


def _stack_pairs(*pairs):
    """A group's rows from the :func:`_gather_block` pieces of every row block, stacked (one copy of each)."""
    xs = [x for p in pairs for x in p[0]]
    ys = [y for p in pairs for y in p[1]]
    if not xs:
        return None
    return sp.vstack(xs, format="csr"), sp.vstack(ys, format="csr")


def _group_svms(pair, offsets: np.ndarray, *, n_features: int, seed: int, columns: tuple[int, int] | None = None,
                max_passes: int = MAX_PASSES) -> tuple[sp.csr_matrix, np.ndarray]:
    """:func:`~xmldask.models._svm.cluster_svms` of a group's gathered rows (cluster offsets from the group's first
    classifier, seeded ``seed`` plus the classifier's index whatever the groups; ``columns``: those classifiers
    only)."""
    a, b = (0, int(offsets[-1])) if columns is None else columns
    if pair is None:  # no training row has a label of the group (every one held out)
        return sp.csr_matrix((b - a, n_features), dtype=np.float32), np.zeros(b - a, np.float32)
    return cluster_svms(pair[0], pair[1], offsets, C=SVM_C, seed=seed, columns=columns, max_passes=max_passes)


def _train_svms(X: da.Array, Y: da.Array, idf, position: np.ndarray, offsets: np.ndarray, entries: np.ndarray, *,
                share: float, seed: int, keep: float | None = None,
                max_passes: int = MAX_PASSES) -> tuple[sp.csr_matrix, np.ndarray, int]:
    """Classifiers of label clusters (:func:`~xmldask.models._svm.cluster_svms`) from one pass over the row blocks
    (a few when the workers' memory asks for it: :func:`label_passes`): classifier ``j`` has the rows with a label
    ``l`` of ``position[l] == j`` as positives and is trained on the rows of its cluster (``offsets``: cluster ``c``
    is classifiers ``offsets[c]:offsets[c + 1]``); ``entries``: a bound on each classifier's rows' entries. Each
    block gives every group of clusters (:func:`svm_groups`) its rows (the held-out rows left out; ``keep``: a
    share of the others, or None: all of them, but for a group whose rows a task cannot hold, a share that it can),
    the workers stack a group's rows and train its classifiers, and the process keeps the weights alone. Returns the
    weights, the biases and the passes made."""
    n_classifiers = int(offsets[-1])
    if n_classifiers == 0:
        return sp.csr_matrix((0, X.shape[1]), dtype=np.float32), np.zeros(0, np.float32), 0
    entries = np.asarray(entries, np.float64)
    limit = task_memory_limit()
    budget = SVM_GROUP_SHARE * (limit or memory_for_data())
    groups = svm_groups(np.add.reduceat(entries, offsets[:-1]), budget, 2 * parallelism())
    at = offsets[groups]  # the groups' first classifiers
    position_ = dask.delayed(position, pure=True)
    if keep is None:
        # a group past the budget (a cluster of frequent labels is a group of its own, whatever its rows) trains on
        # a seeded random share of them that the budget holds
        group_bytes = SVM_TASK_COPIES * np.add.reduceat(entries, at[:-1]) * _ENTRY_BYTES
        shares = np.minimum(1.0, budget / np.maximum(group_bytes, 1.0))
        for g in np.flatnonzero(shares < 1.0):
            logger.info("label classifiers %d-%d: %.0f%% of their rows (%.0f MiB of rows, past the %.0f MiB a task "
                        "may hold)", at[g], at[g + 1] - 1, 100 * shares[g], group_bytes[g] / 2**20, budget / 2**20)
    else:
        shares = np.full(len(at) - 1, float(keep))
    pieces, n_passes = [], 0
    for bounds in label_passes(at, entries, memory_for_data() if limit else None):
        first = int(np.searchsorted(at, bounds[0]))
        kept = [float(x) for x in shares[first:first + len(bounds) - 1]]
        parts = per_block_objects(_gather_block, X, Y, position=position_, idf=idf, bounds=[int(b) for b in bounds],
                                  share=share, seed=seed, keep=kept)
        todo = []
        for j in range(len(bounds) - 1):
            g = int(np.searchsorted(at, bounds[j]))  # the group's index: its clusters groups[g]:groups[g + 1]
            clusters = offsets[groups[g]:groups[g + 1] + 1]
            stacked = dask.delayed(_stack_pairs, pure=True)(*[part[j] for part in parts])
            size = int(clusters[-1] - clusters[0])
            # a lone cluster (the group routers: every row) is shared out by its classifiers between the threads
            cuts = np.linspace(0, size, min(size, parallelism()) + 1).astype(int) if len(clusters) == 2 else [0, size]
            for a, b in zip(cuts[:-1], cuts[1:]):
                todo.append(dask.delayed(_group_svms, pure=True)(stacked, clusters - clusters[0],
                                                                 n_features=X.shape[1], seed=seed + int(clusters[0]),
                                                                 columns=(int(a), int(b)), max_passes=max_passes))
        pieces += compute_each(todo)
        n_passes += 1
    V = sp.vstack([v for v, _ in pieces], format="csr", dtype=np.float32)
    return V, np.concatenate([b for _, b in pieces]).astype(np.float32), n_passes


def _router_rows(Xb, Yb, idf=None, *, group_of, cols: tuple[int, int], share: float, seed: int, block: int):
    """A row block's rows that train the group routers ``cols[0]:cols[1]`` when no task holds them all (those with a
    label in a group, the held-out rows of :func:`_label_sums_block` left out), transformed, and their positives
    among those routers (rows x routers CSR)."""
    Y = sp.coo_matrix(Yb)
    g = group_of[Y.col]
    real = g >= 0
    P = sp.csr_matrix((np.ones(int(real.sum()), np.float32), (Y.row[real], g[real])),
                      shape=(Y.shape[0], int(group_of.max(initial=-1)) + 1))
    P.sum_duplicates()  # several labels of one group: one positive
    P.data[:] = 1.0
    rows = np.flatnonzero((np.diff(P.indptr) > 0) & ~_held_out(Y.shape[0], share, seed, block))
    return _rows_block(sp.csr_matrix(Xb)[rows], idf, copy=False), sp.csr_matrix(P[rows][:, cols[0]:cols[1]])


def _router_step(W, alpha, Xb, Yb, idf=None, *, group_of, cols: tuple[int, int], share: float, seed: int, block: int,
                 step: int):
    """One row block's pass of the streamed group routers ``cols``: the new weights, the block's dual variables
    (CSR: most are 0) and the pass's projected-gradient bounds (:func:`~xmldask.models._svm.streamed_pass`)."""
    X, P = _router_rows(Xb, Yb, idf, group_of=group_of, cols=cols, share=share, seed=seed, block=block)
    W, alpha, hi, lo = streamed_pass(X, P, W, None if alpha is None else alpha.toarray(), C=SVM_C,
                                     seed=[seed, block, step])
    return W, sp.csr_matrix(alpha), hi, lo


def _pruned_routers(W) -> tuple[sp.csr_matrix, np.ndarray]:
    """Streamed weights (features + bias, by routers) as the routers keep them: their weights below
    :data:`~xmldask.models._svm.PRUNE` dropped (as :func:`~xmldask.models._svm.cluster_svms` drops them), the
    biases."""
    weights = np.ascontiguousarray(W[:-1].T)
    weights[np.abs(weights) < PRUNE] = 0.0
    return sp.csr_matrix(weights), W[-1].astype(np.float32)


def _stream_routers(X: da.Array, Y: da.Array, idf, group_of: np.ndarray, n_groups: int, *, share: float, seed: int,
                    max_passes: int = ROUTER_PASSES) -> tuple[sp.csr_matrix, np.ndarray, int]:
    """The group routers trained on every training row where no task holds them all: the coordinate descent of
    :func:`~xmldask.models._svm.squared_hinge_svms` a row block after another (the weights carried from block to
    block, each block's dual variables kept on the workers between passes), until the projected gradients' spread
    over all blocks is below :data:`~xmldask.models._svm.TOL` or ``max_passes`` passes. The routers are split in
    chains of as many as two copies of their dense weights fit :data:`SVM_GROUP_SHARE` of a worker's memory (a
    multiple of the threads: the chains run at once). Returns the routers, their biases and the passes made."""
    budget = SVM_GROUP_SHARE * (task_memory_limit() or memory_for_data())
    per_router = 2 * 4.0 * (X.shape[1] + 1)
    chains = min(n_groups, math.ceil(math.ceil(n_groups * per_router / budget) / parallelism()) * parallelism())
    cuts = np.linspace(0, n_groups, max(chains, 1) + 1).astype(int)
    cols = [(int(a), int(b)) for a, b in zip(cuts[:-1], cuts[1:]) if b > a]
    xs, ys = X.to_delayed().ravel(), Y.to_delayed().ravel()
    # the smallest signed integers that hold the groups (and -1): the graph carries a byte a label, not eight (at 1M
    # labels its first pass was 9.6 MiB with int64, and Dask warned of a large graph)
    group_of_ = dask.delayed(np.asarray(group_of, np.min_scalar_type(-max(n_groups, 1))), pure=True)
    # in the graph, not scattered: a worker restarted for its memory while the routers stream (their weights and
    # dual variables can be made again from the rows) must not take the last copy of the weighting with it
    idf_ = None if idf is None else dask.delayed(np.asarray(idf.compute() if isinstance(idf, da.Array) else idf),
                                                 pure=True)
    weights = [dask.delayed(np.zeros, pure=True)((X.shape[1] + 1, b - a), np.float32) for a, b in cols]
    duals = [[None] * len(xs) for _ in cols]
    step = dask.delayed(_router_step, nout=4, pure=True)
    passes = 0
    for p in range(max_passes):
        bounds = []
        for c, part in enumerate(cols):
            for i, (xb, yb) in enumerate(zip(xs, ys)):
                weights[c], duals[c][i], hi, lo = step(weights[c], duals[c][i], xb, yb, idf_, group_of=group_of_,
                                                       cols=part, share=share, seed=seed, block=i, step=p)
                bounds.append((c, hi, lo))
        held = dask.persist(weights, duals, [b[1:] for b in bounds])
        weights, duals = list(held[0]), [list(d) for d in held[1]]
        passes += 1
        highs = {}  # by chain: each router's projected gradients' bounds over all blocks
        for (c, _, _), (hi, lo) in zip(bounds, dask.compute(held[2])[0]):
            prev = highs.get(c)
            highs[c] = (hi, lo) if prev is None else (np.maximum(prev[0], hi), np.minimum(prev[1], lo))
        worst = max(float(np.max(hi - lo, initial=0.0)) for hi, lo in highs.values())
        logger.debug("group routers streamed: pass %d, projected gradients' spread %.4g", p + 1, worst)
        if worst <= TOL:
            break
    pieces = dask.compute([dask.delayed(_pruned_routers, pure=True)(w) for w in weights])[0]
    R = sp.vstack([r for r, _ in pieces], format="csr", dtype=np.float32)
    return R, np.concatenate([b for _, b in pieces]), passes


def router_groups(n_clusters: int) -> np.ndarray:
    """Offsets of the groups of consecutive clusters (neighbours in the clustering's depth-first order) that the
    group routers choose among: about ``sqrt(n_clusters)`` groups of about as many clusters, the two levels of a
    balanced tree (a row scores the group routers, then the cluster routers of its best groups)."""
    size = max(1, math.ceil(math.sqrt(n_clusters)))
    return np.unique(np.r_[np.arange(0, n_clusters, size), n_clusters]).astype(np.int64)


def router_labels(order: np.ndarray, offsets: np.ndarray, n_labels: int,
                  label_entries: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """What the routers of a clustering (``order``, ``offsets``: cluster ``c`` is the labels
    ``order[offsets[c]:offsets[c + 1]]``) train on: the groups' offsets (:func:`router_groups`), each label's cluster
    and group (-1: in none) and each cluster's bound on its rows' entries (the sum of its labels' ``label_entries``)."""
    n_clusters = len(offsets) - 1
    group_offsets = router_groups(n_clusters)
    cluster_of = np.full(n_labels, -1, np.int64)
    cluster_of[order] = np.repeat(np.arange(n_clusters), np.diff(offsets))
    group_of = np.where(cluster_of >= 0,
                        np.repeat(np.arange(len(group_offsets) - 1), np.diff(group_offsets))[cluster_of], -1)
    entries = np.asarray(label_entries, np.float64)
    by_cluster = np.bincount(cluster_of[cluster_of >= 0], weights=entries[cluster_of >= 0], minlength=n_clusters)
    return group_offsets, cluster_of, group_of, by_cluster


def router_share(total_entries: float) -> float:
    """Share of the training rows that one task can hold for the group routers: 1 where it holds two copies of
    their entries (``total_entries``, the labels' bound, which counts a row once per label) within
    :data:`SVM_GROUP_SHARE` of a worker's memory (without a limit: of this machine's), else the share it holds (a
    group router has every row, most as a negative); below 1 the routers are streamed (:func:`_stream_routers`)."""
    budget = SVM_GROUP_SHARE * (task_memory_limit() or memory_for_data())
    return min(1.0, budget / max(2 * float(total_entries) * _ENTRY_BYTES, 1.0))


def svm_groups(cluster_entries: np.ndarray, budget_bytes: float, min_groups: int) -> np.ndarray:
    """Cluster ranges ``bounds[j]:bounds[j + 1]`` whose classifiers one task trains: consecutive clusters while
    :data:`SVM_TASK_COPIES` copies of their rows' entries (``cluster_entries``, bounds; :data:`_ENTRY_BYTES` an entry)
    fit ``budget_bytes``
    (a cluster past it is a group of its own), cut further into about equal bounds where that gives fewer than
    ``min_groups`` (the workers' threads) and there are as many clusters."""
    sizes = SVM_TASK_COPIES * np.asarray(cluster_entries, np.float64) * _ENTRY_BYTES
    n = len(sizes)
    if not n:
        return np.zeros(1, np.int64)
    cuts, held = [0], 0.0
    for c, size in enumerate(sizes):
        if held and held + size > budget_bytes:
            cuts.append(c)
            held = 0.0
        held += size
    cum = np.cumsum(sizes)
    even = np.searchsorted(cum, cum[-1] * np.arange(1, min(n, min_groups)) / min(n, min_groups), side="right")
    return np.unique(np.concatenate([cuts, even, [n]])).astype(np.int64)


def _unit_and_norms(P: sp.csr_matrix) -> tuple[sp.csr_matrix, np.ndarray]:
    """``P`` with unit rows, and its rows' L2 norms (float64)."""
    P = sp.csr_matrix(P)
    return _unit_rows(P), np.sqrt(np.asarray(P.multiply(P).sum(axis=1), dtype=np.float64).ravel())


def _add_small(a, b):
    return a[0] + b[0], sp.vstack([a[1], b[1]], format="csr"), sp.vstack([a[2], b[2]], format="csr")


def _label_entries_block(Xb, Yb, *, block=None) -> np.ndarray:
    """``Y_b^T nnz(x_i)``: each label's bound on its entries of ``Y^T X`` from one row block (float64)."""
    Xb, Yb = sp.csr_matrix(Xb), sp.csr_matrix(Yb, dtype=np.float64)
    return np.asarray(Yb.T @ np.diff(Xb.indptr).astype(np.float64)).ravel()


def label_passes(bounds, label_entries, workers_memory: int | None) -> list:
    """The label blocks ``bounds`` in groups, one pass over the rows each: consecutive blocks whose bounds on the
    centroid entries (``label_entries`` by label) take at most :data:`PASS_SHARE` of the workers' memory
    together (``workers_memory``: the sum of their limits), since a pass's partial sums of every block of its
    group are held by the workers at once. ``[None]``: one pass, all labels in one block."""
    if bounds is None:
        return [None]
    if not workers_memory:
        return [bounds]
    sizes = np.add.reduceat(np.asarray(label_entries, np.float64), bounds[:-1]) * _ENTRY_BYTES
    budget, groups, start, held = PASS_SHARE * workers_memory, [], 0, 0.0
    for j, size in enumerate(sizes):
        if held and held + size > budget:
            groups.append(bounds[start:j + 1])
            start, held = j, 0.0
        held += size
    return groups + [bounds[start:]]


def label_block_bounds(label_entries: np.ndarray, worker_limit: int | None, *,
                       share: float | None = None, multiple_of: int = 1) -> np.ndarray | None:
    """Label blocks in which the workers sum ``Y^T X``: consecutive label ranges ``bounds[j]:bounds[j + 1]`` of about
    equal entry bounds (``label_entries``, :func:`entry_bound` by label), as many as make three copies of a block's
    sums (a combine task's two partial sums and theirs) at most ``share`` (:data:`LABEL_BLOCK_SHARE`) of
    ``worker_limit`` bytes, rounded up to a multiple of ``multiple_of`` (groups of blocks that tasks share
    evenly); ``None`` (one block) without a limit or when one block fits."""
    label_entries = np.asarray(label_entries, np.float64)
    if not worker_limit or not len(label_entries):
        return None
    share = LABEL_BLOCK_SHARE if share is None else share
    n_blocks = math.ceil(3 * label_entries.sum() * _ENTRY_BYTES / (share * worker_limit))
    if n_blocks <= 1:
        return None
    n_blocks = math.ceil(n_blocks / multiple_of) * multiple_of
    cum = np.cumsum(label_entries)
    cuts = np.searchsorted(cum, cum[-1] * np.arange(1, n_blocks) / n_blocks, side="right")
    bounds = np.unique(np.concatenate([[0], cuts, [len(label_entries)]])).astype(np.int64)
    return bounds if len(bounds) > 2 else None


def _split(W: sp.csr_matrix, rng: np.random.Generator) -> np.ndarray:
    """Balanced spherical 2-means of the rows of ``W`` (unit rows): a boolean mask of the first half.

    Two random rows start the two means; each iteration ranks the rows by the difference of their cosines to
    the means and gives the better half of the ranking to each (the balanced assignment of Parabel's
    clustering), then recomputes the means.
    """
    n = W.shape[0]
    first, second = rng.choice(n, 2, replace=False)
    means = np.vstack([W[first].toarray(), W[second].toarray()]).T  # (d, 2)
    left = np.zeros(n, bool)
    for _ in range(SPLIT_ITERATIONS):
        cos = W @ means
        order = np.argsort(cos[:, 1] - cos[:, 0], kind="stable")
        new = np.zeros(n, bool)
        new[order[:n // 2]] = True
        if (new == left).all():
            break
        left = new
        means = np.asarray(W.T @ np.stack([left, ~left], axis=1).astype(W.dtype))  # (d, 2), no copy of W's rows
        means /= np.maximum(np.linalg.norm(means, axis=0, keepdims=True), 1e-30)
    return left


def balanced_clusters(W: sp.csr_matrix, labels: np.ndarray, leaf_labels: int, rng: np.random.Generator):
    """Recursive balanced 2-means of the rows ``labels`` of ``W`` into clusters of at most ``leaf_labels``.

    Returns
    -------
    order : ndarray of int64
        ``labels`` in cluster order.
    offsets : ndarray of int64, shape (n_clusters + 1,)
        Cluster ``c`` is ``order[offsets[c]:offsets[c + 1]]``.
    """
    stack, done = [np.asarray(labels, np.int64)], []
    while stack:
        members = stack.pop()
        if len(members) <= leaf_labels:
            done.append(members)
            continue
        left = _split(W[members], rng)
        stack += [members[~left], members[left]]
    order = np.concatenate(done) if done else np.zeros(0, np.int64)
    offsets = np.concatenate([[0], np.cumsum([len(c) for c in done])]).astype(np.int64)
    return order, offsets


def _topk_block(Xb, W, order, offsets, fallback, MT=None, idf=None, MH=None, head=None, V=None, bias=None,
                routers=None, routes=None, *, beam: int, k: int, weight: float = 0.0, groups: int = 0,
                threshold: float = 0.0):
    """Top-``k`` labels and scores of one row block, packed as ``(n_b, 2k)`` float64 (labels, then scores).

    ``W``: the label centroids in cluster order (CSR, or their :class:`._candidates.ClusterEntries`; ``V`` too). A
    row chooses its ``beam`` best clusters, by the routers when
    given (the group ``routers``, a :class:`_GroupRouters`, then those of the clusters of its ``groups`` best
    groups, ``routes``: a :class:`._candidates.GroupRoutes`), or else by the cluster summaries
    (``MT``, transposed, without the rows of the features ``head`` whose columns ``MH`` holds dense:
    :func:`_split_summaries`; scored by :func:`._candidates.summary_topk`); then it scores the labels of those
    clusters, cluster by cluster for all the block's rows that chose it
    (:func:`._candidates.candidate_topk`: the cosine, plus ``weight`` times the label's classifier ``V``, ``bias``;
    the centroids' entries below ``threshold`` left out); slots left over (fewer candidates than ``k``) get the
    ``fallback`` labels (the most frequent) below every score.
    """
    MT, W, V, routers, routes = _unwrap(MT), _unwrap(W), _unwrap(V), _unwrap(routers), _unwrap(routes)
    Xb = _rows_block(Xb, idf)
    n, n_clusters = Xb.shape[0], len(offsets) - 1
    labels, scores = np.full((n, k), -1, np.int64), np.full((n, k), -np.inf)
    if n and n_clusters:
        b = min(beam, n_clusters)
        if routes is not None:
            best = grouped_topk(Xb, _best_groups(Xb, routers, groups), routes, b)[0]
        else:
            best = _best_clusters(Xb, MT, b, (MH, head))[0]
        rows, slots = np.nonzero(best >= 0)
        labels, scores = candidate_topk(Xb, rows, best[rows, slots], W, order, offsets, k, V=V, bias=bias,
                                        weight=weight, threshold=threshold)
    return _filled(labels, scores, fallback)


def _routers_by_feature(R: sp.csr_matrix):
    """The group routers ``R`` (``n_groups x d``) transposed, as :func:`_best_groups` reads them: dense (``d x
    n_groups`` float32) where that takes no more memory than sparse (half their cells hold a weight or more: 54 % at
    1M labels), else CSR. A row reads the routers of its features, whatever the block's size; reading the routers
    once for a block of rows (``(R X^T)^T``) cost 69 us a row at 1M labels in blocks of 5,000 rows, against 33 for
    the CSR transpose."""
    R = sp.csr_matrix(R, dtype=np.float32)
    if R.nnz * (R.data.itemsize + R.indices.itemsize) >= R.shape[0] * R.shape[1] * 4:
        return np.ascontiguousarray(R.T.toarray(), np.float32)
    return sp.csr_matrix(R.T)


@dataclasses.dataclass(frozen=True, eq=False)
class _GroupRouters:
    """The group routers as :func:`_best_groups` reads them: by feature (``RT``, :func:`_routers_by_feature`), and
    their ``bias``."""

    RT: np.ndarray | sp.csr_matrix
    bias: np.ndarray

    @classmethod
    def of(cls, R: sp.csr_matrix, bias: np.ndarray) -> _GroupRouters:
        return cls(_routers_by_feature(R), np.asarray(bias, np.float32).ravel())

    @property
    def nbytes(self) -> int:
        return _nbytes(self.RT) + int(self.bias.nbytes)


def _best_groups(Xb, routers: _GroupRouters, b: int) -> np.ndarray:
    """The ``b`` groups of highest router margin of each row (unordered), shape ``(n_rows, min(b, n_groups))``, by
    the group ``routers``."""
    Xb = sp.csr_matrix(Xb, dtype=np.float32)
    RT = routers.RT
    S = np.asarray(Xb @ RT, np.float32) if isinstance(RT, np.ndarray) else sparse_product_dense(Xb, RT)
    S += routers.bias
    n_groups = S.shape[1]
    if b < n_groups:
        return np.argpartition(-S, b - 1, axis=1)[:, :b]
    return np.broadcast_to(np.arange(n_groups), (S.shape[0], n_groups))


def _best_k(r, lab, s, *, n: int, k: int) -> tuple[np.ndarray, np.ndarray]:
    """The ``k`` best ``(label, score)`` of each row ``0..n-1`` among the triples ``(r, lab, s)``: score descending,
    then the smaller label id; ``(-1, -inf)`` in the slots left over."""
    labels, scores = np.full((n, k), -1, np.int64), np.full((n, k), -np.inf)
    by_row = np.lexsort((lab, -s, r))
    r, lab, s = r[by_row], lab[by_row], s[by_row]
    slot = np.arange(len(r)) - np.searchsorted(r, r)
    keep = slot < k
    labels[r[keep], slot[keep]] = lab[keep]
    scores[r[keep], slot[keep]] = s[keep]
    return labels, scores


def _most_frequent(counts: np.ndarray, k: int) -> np.ndarray:
    """The ``k`` labels of largest ``counts``, largest first (ties: the smaller id), as ``np.argsort(-counts,
    kind="stable")[:k]`` without sorting them all (82 ms a prediction at 1M labels)."""
    counts = np.asarray(counts)
    k = min(int(k), len(counts))
    if k <= 0:
        return np.zeros(0, np.int64)
    kth = np.partition(counts, len(counts) - k)[len(counts) - k]
    above = np.flatnonzero(counts > kth)
    top = np.concatenate([above, np.flatnonzero(counts == kth)[:k - len(above)]])
    return top[np.lexsort((top, -counts[top]))]


def _filled(labels: np.ndarray, scores: np.ndarray, fallback) -> np.ndarray:
    """``(labels, scores)`` packed as ``(n, 2k)`` float64, the slots without a candidate (label -1) filled by the
    ``fallback`` labels (the most frequent) not already in the row, with a score below the row's others (-1, below
    every cosine, or 1 below its lowest score if that is lower)."""
    k = labels.shape[1]
    missing = labels < 0
    for i in np.flatnonzero(missing.any(axis=1)):
        have = set(labels[i][labels[i] >= 0].tolist())
        extra = [lab for lab in fallback if lab not in have][:int(missing[i].sum())]
        real = scores[i][labels[i] >= 0]
        labels[i, k - len(extra):] = extra
        scores[i, k - len(extra):] = min(-1.0, float(real.min()) - 1.0) if len(real) else -1.0
    return np.hstack([labels.astype(np.float64), scores])


def _best_clusters(Xb, MT, b: int, dense=None) -> tuple[np.ndarray, np.ndarray]:
    """The ``b`` clusters of highest summary cosine of each row, best first, and their cosines, shape
    ``(n_rows, b)`` (:func:`._candidates.summary_topk`); ``dense``: the summaries' dense columns and their feature ids
    (:func:`_split_summaries`), the rest in ``MT``."""
    MH, head = dense if dense is not None else (None, None)
    return summary_topk(Xb, MT, min(b, MT.shape[1]), MH, head)


def _split_summaries(M: sp.csr_matrix) -> tuple[sp.csr_matrix, np.ndarray, np.ndarray]:
    """The summaries ``M`` (``n_clusters x d``) as the prediction reads them: ``(MT, MH, head)``, ``head`` the
    features in at least :data:`DENSE_SHARE` of the clusters (at most :data:`DENSE_BUDGET` cells, the most shared
    first), ``MH`` their columns dense (``len(head) x n_clusters``, float32) and ``MT`` the other columns transposed
    (``d x n_clusters`` CSR, the rows of ``head`` empty). ``X @ M.T == X[:, head] @ MH + X @ MT``."""
    n_clusters, d = M.shape
    counts = np.bincount(M.indices, minlength=d)
    head = np.flatnonzero(counts >= max(1.0, DENSE_SHARE * n_clusters))
    limit = DENSE_BUDGET // max(n_clusters, 1)
    if len(head) > limit:
        head = np.sort(head[np.argsort(-counts[head], kind="stable")[:limit]])
    MT = sp.csr_matrix(M.T, dtype=np.float32)
    MH = MT[head].toarray()
    tail = np.ones(d, np.float32)
    tail[head] = 0.0
    MT = sp.csr_matrix(sp.diags(tail) @ MT)
    MT.eliminate_zeros()
    return MT, MH, head.astype(np.int64)


def _read_rows(url: str, name: str, start: int, stop: int):
    """Rows ``start:stop`` of the fitted array ``name`` of the model store at ``url``: a CSR matrix from its group
    (a slice of its ``indptr``, then of its ``data`` and ``indices``), or a slice of a dense array; chunks checked."""
    import zarr

    from ..store import zarr_store

    node = zarr.open_group(zarr_store(url, read_only=True), mode="r")[name]
    if not isinstance(node, zarr.Group):
        return np.asarray(read_checked(node, slice(start, stop), url))
    indptr = np.asarray(read_checked(node["indptr"], slice(start, stop + 1), url), np.int64)
    entries = slice(int(indptr[0]), int(indptr[-1]))
    data, indices = (np.asarray(read_checked(node[part], entries, url)) for part in ("data", "indices"))
    _checked(data, name, url)
    return sp.csr_matrix((data, indices, indptr - indptr[0]), shape=(stop - start, int(node.attrs["shape"][1])))


def _group_routers(url: str, n_groups: int, *, token: str | None = None, budget: float = 0.0) -> dict:
    """The group routers of the model store at ``url`` and their biases (read by a task: a graph that carried them
    would be as large, 170 MiB at 1M labels), kept as :func:`_route_block`'s."""
    if token is not None:
        return _BLOCKS.get(("groups", url, token), functools.partial(_group_routers, url, n_groups), budget)
    return {"routers": _GroupRouters.of(_read_rows(url, "R", 0, n_groups),
                                        _read_rows(url, "router_bias", 0, n_groups))}


def _stored_groups(Xt, url: str, n_groups: int, b: int, *, token: str | None = None, budget: float = 0.0):
    """:func:`_best_groups` of the rows of ``Xt`` by the group routers of the model store at ``url``."""
    routers = _group_routers(url, n_groups, token=token, budget=budget)
    return _best_groups(Xt, routers["routers"], b)


class _BlockCache:
    """Cluster blocks that a worker process read, kept for its next tasks: least recently used first out, at most
    ``budget`` bytes, keyed by the model store's URL and its content token (:meth:`LabelCentroidClassifier.load`:
    the recorded inventory, whose file sizes and attribute digest change when the store is written again)."""

    def __init__(self) -> None:
        self._blocks: collections.OrderedDict = collections.OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()

    def get(self, key, read, budget: float):
        """The block of ``key``, read by ``read()`` if this process does not hold it (and then kept, within
        ``budget`` bytes)."""
        with self._lock:
            if key in self._blocks:
                self._blocks.move_to_end(key)
                return self._blocks[key][0]
        block = read()
        size = sum(_nbytes(v) for v in block.values())
        if size <= budget:
            with self._lock:
                if key not in self._blocks:
                    self._blocks[key] = (block, size)
                    self._bytes += size
                while self._bytes > budget and len(self._blocks) > 1:
                    self._bytes -= self._blocks.popitem(last=False)[1][1]
        return block


_BLOCKS = _BlockCache()


def _nbytes(value) -> int:
    """Bytes of a block's array (dense or CSR, or a tuple of them; 0 for anything else)."""
    if isinstance(value, tuple):
        return sum(_nbytes(v) for v in value)
    if sp.issparse(value):
        return int(value.data.nbytes + value.indices.nbytes + value.indptr.nbytes)
    return int(getattr(value, "nbytes", 0))


def _route_block(url: str, first: int, stop: int, *, goffsets: np.ndarray | None = None, token: str | None = None,
                 budget: float = 0.0) -> dict:
    """What rows route by in the clusters ``first:stop`` of the model store at ``url``: their routers in their
    groups ``goffsets`` (the block's own, from 0: ``routes``, a :class:`._candidates.GroupRoutes`) when given, else
    their summaries as the kernel reads them (``split``: :func:`_split_summaries`,
    whose transpose cost a row block of 20,000 rows as much as their routing at 1M labels); kept by this process
    within ``budget`` bytes when the store's content ``token`` is given (:class:`_BlockCache`)."""
    if token is not None:
        return _BLOCKS.get(("route", url, token, first, stop, goffsets is not None),
                           functools.partial(_route_block, url, first, stop, goffsets=goffsets), budget)
    block = {"first": first, "stop": stop}
    if goffsets is not None:
        block["routes"] = GroupRoutes.of(_read_rows(url, "U", first, stop),
                                         _read_rows(url, "cluster_bias", first, stop), goffsets)
    else:
        block["split"] = _split_summaries(_read_rows(url, "M", first, stop))
    return block


def _label_block(url: str, first: int, stop: int, *, weight: float = 0.0, token: str | None = None,
                 budget: float = 0.0) -> dict:
    """The labels of the clusters ``first:stop`` of the model store at ``url``: their offsets, ids and centroids,
    and their classifiers when ``weight`` is not 0; kept as :func:`_route_block`'s."""
    if token is not None:
        return _BLOCKS.get(("labels", url, token, first, stop, bool(weight)),
                           functools.partial(_label_block, url, first, stop, weight=weight), budget)
    offsets = _read_rows(url, "offsets", first, stop + 1)
    a, b = int(offsets[0]), int(offsets[-1])
    block = {"first": first, "stop": stop, "offsets": offsets - a, "order": _read_rows(url, "order", a, b),
             "W": ClusterEntries.of(_read_rows(url, "W", a, b), offsets - a), "V": None, "bias": None}
    if weight:
        block.update(V=ClusterEntries.of(_read_rows(url, "V", a, b), offsets - a),
                     bias=_read_rows(url, "svm_bias", a, b))
    return block


def _route_part(Xt, block, *, beam: int, groups=None, goffsets=None):
    """The ``beam`` best clusters of a cluster block (a :func:`_route_block`, or ``(url, first, stop, token,
    budget)`` to read it) for each transformed row of ``Xt`` and their scores: ``(cluster ids, scores)``, each
    ``(n_rows, <= beam)``; by the summary cosines, or by the routers of the clusters when the rows' best
    ``groups`` (global group ids of the ``goffsets``, whose bounds the block's are) are given, ``(-1, -inf)`` for
    no cluster."""
    first, stop = (block["first"], block["stop"]) if isinstance(block, dict) else block[1:3]
    if groups is not None:
        g0, g1 = np.searchsorted(goffsets, [first, stop])
        local_offsets = goffsets[g0:g1 + 1] - first
    if not isinstance(block, dict):
        url, first, stop, token, budget = block
        block = _route_block(url, first, stop, goffsets=local_offsets if groups is not None else None, token=token,
                             budget=budget)
    if groups is not None:
        local = np.where((groups >= g0) & (groups < g1), groups - g0, -1)
        ids, margins = grouped_topk(Xt, local, block["routes"], beam)
        return np.where(ids >= 0, ids + first, -1), margins
    MT, MH, head = block["split"]
    ids, cosines = _best_clusters(Xt, MT, beam, (MH, head))
    return ids + first, cosines


def _merge_routes(a, b, *, beam: int):
    """The ``beam`` best clusters of each row, and their cosines, of two :func:`_route_part` results."""
    ids, cos = np.hstack([a[0], b[0]]), np.hstack([a[1], b[1]])
    if beam >= ids.shape[1]:
        return ids, cos
    top = np.argpartition(-cos, beam - 1, axis=1)[:, :beam]
    return np.take_along_axis(ids, top, axis=1), np.take_along_axis(cos, top, axis=1)


def _route_group(Xt, blocks, *, beam: int, groups=None, goffsets=None):
    """:func:`_route_part` of the cluster ``blocks`` one after the other, merged as they come."""
    best = None
    for block in blocks:
        part = _route_part(Xt, block, beam=beam, groups=groups, goffsets=goffsets)
        best = part if best is None else _merge_routes(best, part, beam=beam)
    return best


def _candidate_group(Xt, best, blocks, *, k: int, weight: float = 0.0):
    """:func:`_candidate_part` of the cluster ``blocks`` one after the other, merged as they come."""
    top = None
    for block in blocks:
        part = _candidate_part(Xt, best, block, k=k, weight=weight)
        top = part if top is None else _merge_candidates(top, part, k=k)
    return top


def _candidate_part(Xt, best, block, *, k: int, weight: float = 0.0):
    """:func:`._candidates.candidate_topk` of the rows of ``Xt`` among the labels of their clusters ``best`` (global
    ids) that fall in a cluster block (a :func:`_label_block`, or ``(url, first, stop, token, budget)`` to read
    it): their centroids, and classifiers when ``weight`` is not 0."""
    if not isinstance(block, dict):
        url, first, stop, token, budget = block
        block = _label_block(url, first, stop, weight=weight, token=token, budget=budget)
    first, stop = block["first"], block["stop"]
    rows, slots = np.nonzero((best >= first) & (best < stop))
    return candidate_topk(Xt, rows, best[rows, slots] - first, block["W"], block["order"], block["offsets"], k,
                          V=block["V"], bias=block["bias"], weight=weight)


def _merge_candidates(a, b, *, k: int):
    """The top-``k`` of each row among two :func:`_candidate_part` results (``(-1, -inf)`` left over)."""
    labels, scores = np.hstack([a[0], b[0]]), np.hstack([a[1], b[1]])
    n, m = labels.shape
    real = labels.ravel() >= 0
    return _best_k(np.repeat(np.arange(n), m)[real], labels.ravel()[real], scores.ravel()[real], n=n, k=k)


def _cluster_blocks(cluster_bytes: np.ndarray, worker_limit: int | None, tasks: int = 1) -> np.ndarray | None:
    """Cluster ranges ``bounds[j]:bounds[j + 1]`` of about equal bytes (``cluster_bytes``: a cluster's summary and
    centroids), as many as make three copies of a block's arrays (read, split, scored) at most
    :data:`PREDICT_BLOCK_SHARE` of ``worker_limit``, a multiple of the ``tasks`` that share them out (3 blocks on 2
    threads left one idle a third of the time); ``None`` (the whole model in each task) when one block fits."""
    return label_block_bounds(np.asarray(cluster_bytes, np.float64) / _ENTRY_BYTES, worker_limit,
                              share=PREDICT_BLOCK_SHARE, multiple_of=tasks)


def _unwrap(A):
    """A sparse operand as :func:`xmldask.linalg.passes.whole_operand` ships it (a 0-d object array)."""
    return A.item() if isinstance(A, np.ndarray) and A.dtype == object else A


def _summaries(W: sp.csr_matrix, offsets: np.ndarray, weights: np.ndarray | None = None) -> sp.csr_matrix:
    """The unit sums of the (unit) rows of ``W`` in each cluster ``offsets[c]:offsets[c + 1]``, each row weighted by
    ``weights`` (by row of ``W``; none: alike)."""
    assign = np.repeat(np.arange(len(offsets) - 1), np.diff(offsets))
    w = np.ones(len(assign), np.float32) if weights is None else np.asarray(weights, np.float32)
    A = sp.csr_matrix((w, (assign, np.arange(len(assign)))), shape=(len(offsets) - 1, W.shape[0]))
    return _unit_rows(sp.csr_matrix(A @ W, dtype=np.float32))


# --------------------------------------------------------------------------------------------------
# memory


def entry_bound(row_nnz_x: np.ndarray, row_nnz_y: np.ndarray) -> float:
    """``sum_i nnz(x_i) |y_i|``: a bound on the entries of ``Y^T X`` (each row adds at most that many), from the
    rows' non-zero counts alone (a store's row pointers: no pass over the values)."""
    return float(np.dot(np.asarray(row_nnz_x, np.float64), np.asarray(row_nnz_y, np.float64)))


def centroid_memory(entries: float, n_labels: int, n_features: int, *, n_blocks: int = 1, block_entries: float = 0.0,
                    label_block_entries: float | None = None) -> dict:
    """Peak bytes of fitting :class:`LabelCentroidClassifier` from the bound ``entries`` on ``nnz(Y^T X)``
    (:func:`entry_bound`).

    ``fit_process``: the fitting process holds the unit centroids and, at once, one more copy (the label blocks
    stacked, the clustering's copy of a subtree, the copy in cluster order, the centroids without the held-out
    rows) and two sets of cluster summaries (the held-out choice of their weights compares two at a time), each with
    its transposed copy about as large as the centroids (at 1M labels the summaries have half their entries), and the
    centroids without the held-out rows as the candidates' kernel reads them (:class:`._candidates.ClusterEntries`,
    at most twice their stored bytes): the path without the labels' classifiers, which ``svm_weight="auto"`` trains
    only when the memory then available holds them (:func:`classifiers_fit`); ``worker``: a task holds a row block's
    sums (``block_entries``, the largest row block's bound) and their pieces, and a combine task two partial sums
    and their sum, of all the labels or of the largest label block (``label_block_entries``, when the workers sum in
    label blocks: :func:`label_block_bounds`); a task training the classifiers of a group of clusters takes at most
    :data:`SVM_GROUP_SHARE` of a worker's limit (its rows, as :func:`svm_groups` cuts them).
    """
    stored = min(entries, float(n_labels) * n_features) * _ENTRY_BYTES + 8 * (n_labels + 1)
    block = stored if label_block_entries is None else min(stored, label_block_entries * _ENTRY_BYTES)
    worker = (3 * block if n_blocks > 1 else block) + 2 * block_entries * _ENTRY_BYTES
    reads = ClusterEntries.ENTRY_BYTES / _ENTRY_BYTES
    return {"entries": float(entries), "model_bytes": stored, "fit_process": (4 + reads) * stored, "worker": worker}


def classifiers_fit(centroid_entries: int, available: float) -> bool:
    """Whether the labels' classifiers fit the fitting process's ``available`` bytes: :data:`SVM_MEMORY_SHARE` of
    them must hold two copies of their weights (the pieces the workers return and their stack), each bounded by the
    centroids' entries (pruned at :data:`~xmldask.models._svm.PRUNE`, they hold 0.4 to 0.6 of them on the text-like
    sets measured)."""
    return 2 * centroid_entries * _ENTRY_BYTES <= SVM_MEMORY_SHARE * available


def labels_scored_per_row(n_labels: int, *, beam: int = 20, leaf_labels: int = 100) -> int:
    """Cluster summaries and candidate labels a row scores at most, itself at most ``L`` (a flat model scores all
    ``L``): ``C + beam * leaf_labels`` with ``C = ceil(L / leaf_labels)`` clusters. Fewer where routers replace
    the summaries (``routing="auto"`` past ``min(AUTO_BEAMS) * leaf_labels`` clusters, where a task holds every
    training row: :meth:`LabelCentroidClassifier._auto_routing`), which a fit decides from the data."""
    return int(min(n_labels, math.ceil(n_labels / leaf_labels) + beam * leaf_labels))


# --------------------------------------------------------------------------------------------------
# the estimator


def _stored_bytes(group, names) -> int:
    """Bytes of the sparse arrays ``names`` of a model store's group, uncompressed."""
    return sum(int(group[name][part].nbytes) for name in names if name in group
               for part in ("data", "indices", "indptr"))


class _Eager(dict):
    """Some arrays of a model store's group, with the group's ``store_path`` (for messages)."""


class _StoredArray:
    """A fitted array of a loaded model read from its store on first use (``model._stored``, the store's group):
    a million labels' centroids and summaries stay out of a process whose workers read them in blocks."""

    def __set_name__(self, owner, name: str) -> None:
        self.name = name

    def __get__(self, model, owner=None):
        if model is None:
            return self
        value = model.__dict__.get(self.name)
        stored = model.__dict__.get("_stored")
        if value is None and stored is not None and self.name[:-1] in stored:
            value = _checked(read_model_array(stored[self.name[:-1]], store_location(stored)), self.name[:-1],
                             store_location(stored))
            model.__dict__[self.name] = value
        return value

    def __set__(self, model, value) -> None:
        model.__dict__[self.name] = value


def _checked(value, name: str, where: str):
    """``value`` (an array of a model store), after checking that it holds no NaN or infinity."""
    bad = non_finite({name: value})
    if bad:
        raise StoreError(f"{where}: the model holds non-finite values ({bad}), which xmldask never saves: the store "
                         "was damaged after it was written; retrain the model or restore a copy")
    return value


class _StageBudget:
    """A fit's time budget between its stages (``LabelCentroidClassifier(time_budget=...)``): the first model's
    seconds (its passes and clustering, timed when the first later stage asks) are the unit of its estimates. A stage
    of coordinate-descent ``work`` (entries of training rows, once per classifier or router trained on them) costs
    about ``work / first_work`` first models (``first_work``: the entries summed into the centroids), plus ``also``
    first models; it runs only where the time left holds that. On the sets measured the estimate was above the
    classifiers' time (lshtc1-dryrun-task2: 71 first models against 5.7 measured; xmc-10k: 68 against 6.2): a
    stage it cuts may have fitted, one it lets run ends in the budget."""

    def __init__(self, budget: float | None, started: float, first_work: float, cut: list):
        self.budget, self.started, self.first_work, self.cut = budget, started, max(first_work, 1.0), cut
        self.first = None

    def affords(self, stage: str, work: float, *, also: float = 0.0) -> bool:
        if self.budget is None:
            return True
        now = time.perf_counter() - self.started
        self.first = now if self.first is None else self.first
        need = self.first * (work / self.first_work + also)
        left = self.budget - now
        if need <= left:
            return True
        self.cut.append(f"{stage} (estimated {need:.1f} s, {max(left, 0.0):.1f} s left)")
        logger.info(f"time budget: {stage} left out (estimated {need:.1f} s, {max(left, 0.0):.1f} s of the fit's "
                    f"{self.budget:.2f} s left)")
        return False


class CentroidParams(FamilyParams):
    """``xmldask train --model centroid`` (and ``auto`` on large label spaces): label centroids in a balanced label
    tree (:class:`LabelCentroidClassifier`); its beam, weights and classifiers are chosen on held-out rows in its
    fit, so the job searches nothing."""

    searched = False

    model: Literal["centroid"] = "centroid"
    features: Literal["raw", "l2", "tfidf"] = Field(
        "tfidf", description="rows tf-idf weighted (idf of the training rows) then scaled to unit L2 norm, or only "
                             "scaled (l2; raw is read as l2: centroids are compared by cosine)")

    @classmethod
    def resolve(cls, data: dict) -> dict:
        """No search; ``features="raw"`` is ``"l2"`` (rows are always scaled)."""
        data = super().resolve(data)
        return {**data, "features": "l2"} if data.get("features") == "raw" else data


class LabelCentroidClassifier(ParamsMixin, SavedModel):
    """Label centroids in a balanced label tree: candidates from the ``beam`` best label clusters of a row.

    Parameters
    ----------
    features : {"tfidf", "l2"}, default "tfidf"
        Rows tf-idf weighted (idf of the training rows, kept in the model) then scaled to unit L2 norm, or
        only scaled.
    leaf_labels : int, default 100
        Labels of a cluster at most (Parabel's and Omikuji's leaf size).
    beam : int or "auto", default "auto"
        Clusters whose labels a row scores at prediction: a row scores ``n_clusters`` summaries and at most
        ``beam * leaf_labels`` labels, whatever the number of labels. ``"auto"``: of :data:`AUTO_BEAMS`, the one
        whose P@1 on held-out training rows (:data:`HELD_OUT_ROWS` at most, left out of the centroids for the
        comparison) no wider beam beats by more than the noise of those rows (:data:`BEAM_GAIN_SIGMAS`) and by
        :data:`BEAM_MIN_GAIN` at least, recorded in ``beam_`` and ``held_out_``.
    summary_exponent : float or "auto", default "auto"
        A cluster's summary is the normalised sum of its labels' centroids weighted by ``n_l ** summary_exponent``
        (``n_l``: the label's training rows; 0: alike). ``"auto"``: of :data:`SUMMARY_EXPONENTS`, chosen on the
        same held-out rows by P@1 at the narrowest beam (a later one only for a gain beyond their noise), recorded
        in ``summary_exponent_`` and ``held_out_``.
    svm_weight : float or "auto", default "auto"
        Each label also gets a squared-hinge linear SVM trained on its cluster's rows (Parabel's leaf classifiers),
        and a candidate's score is its cosine plus ``svm_weight`` times the classifier's margin; 0: the centroids
        alone (no classifiers trained). ``"auto"``: of :data:`SVM_WEIGHTS`, chosen on the held-out rows at the chosen
        beam (a later one only for a gain beyond their noise; the classifiers are trained without those rows), 0
        keeping no classifier; recorded in ``svm_weight_`` and ``held_out_``.
    routing : {"auto", "summaries", "routers"}, default "auto"
        How a row chooses its clusters: by the cosine to every cluster's summary (``n_clusters`` summaries a row), or
        by trained routers, Parabel's internal nodes in two levels (:func:`router_groups`: a squared-hinge SVM per
        group of about ``sqrt(n_clusters)`` consecutive clusters, trained on every row, then one per cluster of
        the row's best groups, trained on its group's rows; about ``sqrt(n_clusters) * (1 + groups)`` routers a
        row). ``"auto"``: the routers when the clusters outnumber the candidate labels of the narrowest beam
        (``n_clusters > min(AUTO_BEAMS) * leaf_labels``: scoring the summaries would cost a row more than its
        candidates); the group routers train on every row, in one task where it holds them (:func:`router_share`),
        else streamed a row block at a time (:func:`_stream_routers`); the groups a row takes, of
        :data:`AUTO_GROUPS`, chosen on the held-out rows with the beam (the fewest when the beam is given), recorded
        in ``group_beam_`` and ``held_out_``. Where the held-out rows choose, the summaries then compete with the
        routers at the narrowest beam and replace them for a resolved gain (``routing_``). At 1M labels on workers
        of 1 GiB, routers trained on a sample of 1.1 % of the rows routed worse than the summaries (held-out P@1 at
        beam 10: 0.816 against 0.891); streamed over every row, better (0.875 against 0.870).
    centroid_threshold : float or "auto", default "auto"
        The centroids' entries below it (in absolute value; the centroids are unit rows) are dropped once the
        summaries are made from them: a candidate costs its entries, and a frequent label's centroid holds every
        word of its rows. ``"auto"``: the largest of :data:`CENTROID_THRESHOLDS` whose held-out P@1 (at the chosen
        beam and weight) is within :data:`PRUNE_TOLERANCE` of the whole centroids' and not resolved below it,
        recorded in ``centroid_threshold_`` and ``held_out_``; 0: the whole centroids.
    time_budget : float, optional
        Seconds the fit may take. Its first model, the centroids, their clusters and summaries (two passes and a
        clustering, the narrowest beam and the first summary exponent), is always made; each later stage (the
        routers, the classifiers, the held-out choices) only where the time left holds its estimate, the first
        model's seconds times the stage's coordinate-descent work over the first model's (the entries of the labels'
        rows that each classifier or router is trained on, once each, over those summed into the centroids), and for
        the choices the held-out rows' share of the rows times the times they are scored (:meth:`_scorings`; a
        held-out row scored priced as the first model prices a training row: lshtc1-dryrun-task2, a fresh process,
        2.5 first models estimated, 2.2-2.7 measured). What a budget cut is recorded in ``budget_cut_``.
    random_state : int, optional
        Seed of the clustering and of the classifiers' coordinate descent.

    Attributes
    ----------
    W_ : scipy.sparse.csr_matrix, shape (n_seen_labels, n_features)
        The unit centroids of the labels with a training row, in cluster order (``order_``), without their entries
        below ``centroid_threshold_``.
    M_ : scipy.sparse.csr_matrix, shape (n_clusters, n_features)
        The unit cluster summaries.
    R_, U_ : scipy.sparse.csr_matrix, or None
        The routers (``routing_ == "routers"``) of the groups (``n_groups x n_features``) and of the clusters
        (``n_clusters x n_features``), weights below :data:`~xmldask.models._svm.PRUNE` dropped; ``router_bias_``
        and ``cluster_bias_`` their biases; ``group_offsets_`` the groups' clusters. ``M_`` is then empty.
    V_ : scipy.sparse.csr_matrix, shape (n_seen_labels, n_features), or None
        The labels' classifiers (in ``W_``'s order), weights below :data:`~xmldask.models._svm.PRUNE` dropped;
        ``svm_bias_`` their biases. None when ``svm_weight_`` is 0.
    order_, offsets_ : ndarray of int64
        Cluster ``c``'s labels are ``order_[offsets_[c]:offsets_[c + 1]]``.
    idf_ : ndarray of shape (n_features,) or None
    label_counts_ : ndarray of shape (n_labels,)
        Training rows of each label.
    n_unseen_labels_ : int
        Labels without a training row (never predicted).
    budget_cut_ : list of str
        The stages the ``time_budget`` left out, each with its estimate and the time left (empty without one).

    Examples
    --------
    >>> from xmldask.xmc import iter_xmc
    >>> X, Y = next(iter_xmc(n_samples=2000, n_features=3000, n_labels=500, seed=0))
    >>> model = LabelCentroidClassifier(leaf_labels=20, random_state=0).fit(X, Y)
    >>> labels, scores = model.predict_topk(X[:5], k=3)
    >>> labels.compute().shape, model.n_clusters_ > 1
    ((5, 3), True)
    """

    family = "centroid"
    params_schema = CentroidParams
    W_ = _StoredArray()
    M_ = _StoredArray()
    #: the fitted arrays that a loaded model reads when first used (:class:`_StoredArray`)
    V_ = _StoredArray()
    U_ = _StoredArray()
    _LAZY = ("W", "M", "V", "U")
    _MODEL_VERSION = CENTROID_VERSION
    _EARLIER_VERSIONS = (1, 2)
    _ARRAYS = ("W", "M", "order", "offsets", "idf", "label_counts", "V", "svm_bias", "R", "router_bias", "U",
               "cluster_bias", "group_offsets")
    _SCALARS = ("n_features_in", "n_labels", "n_samples_seen", "n_unseen_labels", "n_passes", "task", "beam",
                "held_out", "summary_exponent", "svm_weight", "routing", "group_beam", "centroid_threshold",
                "budget_cut")

    def __init__(self, *, features: str = CentroidParams().features, leaf_labels: int = 100, beam="auto",
                 summary_exponent="auto", svm_weight="auto", routing="auto", centroid_threshold="auto",
                 time_budget: float | None = None, random_state=0):
        self.features, self.leaf_labels, self.beam, self.random_state = features, leaf_labels, beam, random_state
        self.summary_exponent, self.svm_weight, self.routing = summary_exponent, svm_weight, routing
        self.centroid_threshold, self.time_budget = centroid_threshold, time_budget

    def __repr__(self) -> str:
        return f"LabelCentroidClassifier(features={self.features!r}, leaf_labels={self.leaf_labels!r}, " \
               f"beam={self.beam!r}, summary_exponent={self.summary_exponent!r}, svm_weight={self.svm_weight!r}, " \
               f"routing={self.routing!r}, centroid_threshold={self.centroid_threshold!r}" + \
               (f", time_budget={self.time_budget!r})" if self.time_budget is not None else ")")

    def _check_params(self) -> None:
        if self.features not in ("tfidf", "l2"):
            raise ValueError(f"features must be 'tfidf' or 'l2', but is {self.features!r}")
        check_int(self.leaf_labels, "leaf_labels", 2)
        if self.beam != "auto":
            check_int(self.beam, "beam", 1)
        if self.summary_exponent != "auto" and not (isinstance(self.summary_exponent, (int, float))
                                                    and not isinstance(self.summary_exponent, bool)
                                                    and 0 <= self.summary_exponent < math.inf):
            raise ValueError(f"summary_exponent must be 'auto' or a number >= 0, but is {self.summary_exponent!r}")
        if self.svm_weight != "auto" and not (isinstance(self.svm_weight, (int, float))
                                              and not isinstance(self.svm_weight, bool)
                                              and 0 <= self.svm_weight < math.inf):
            raise ValueError(f"svm_weight must be 'auto' or a number >= 0, but is {self.svm_weight!r}")
        if self.routing not in ("auto", "summaries", "routers"):
            raise ValueError(f"routing must be 'auto', 'summaries' or 'routers', but is {self.routing!r}")
        if self.centroid_threshold != "auto" and not (isinstance(self.centroid_threshold, (int, float))
                                                      and not isinstance(self.centroid_threshold, bool)
                                                      and 0 <= self.centroid_threshold < 1):
            raise ValueError("centroid_threshold must be 'auto' or a number in [0, 1), but is "
                             f"{self.centroid_threshold!r}")
        if self.time_budget is not None:
            check_float(self.time_budget, "time_budget", low_open=True)

    @property
    def n_clusters_(self) -> int:
        self._check_fitted()
        return len(self.offsets_) - 1

    def _check_fitted(self) -> None:
        from ..base import NotFittedError

        if self.__dict__.get("W_") is None and self.__dict__.get("_stored") is None:  # W_ not read for this
            raise NotFittedError("this LabelCentroidClassifier is not fitted yet; call fit(X, Y) first")

    def memory_needed(self, data) -> dict:
        """:func:`centroid_memory` of fitting on a dataset store, from its row pointers and label ids (no pass over
        the values), with the label blocks that the current workers' memory limit asks for; a worker's peak at
        least the group routers' rows where the routers will be trained."""
        import zarr

        from ..store import zarr_store

        group = zarr.open_group(zarr_store(data.url, read_only=True), mode="r")
        rows = {name: np.diff(np.asarray(group[name]["indptr"][:], np.int64)) for name in ("X", "Y")}
        per_row = rows["X"].astype(np.float64) * rows["Y"]
        starts = np.cumsum((0,) + tuple(data.X.chunks[0][:-1]))
        block_entries = float(np.add.reduceat(per_row, starts).max()) if len(per_row) else 0.0
        labels = np.asarray(group["Y"]["indices"][:], np.int64)
        by_label = np.minimum(np.bincount(labels, weights=np.repeat(rows["X"], rows["Y"]).astype(np.float64),
                                          minlength=data.n_labels), data.n_features)  # a centroid has <= d entries
        bounds = label_block_bounds(by_label, task_memory_limit())
        label_block = None if bounds is None else float(np.add.reduceat(by_label, bounds[:-1]).max())
        need = centroid_memory(float(by_label.sum()), data.n_labels, data.n_features, n_blocks=len(data.X.chunks[0]),
                               block_entries=block_entries, label_block_entries=label_block)
        clusters = math.ceil(np.count_nonzero(by_label) / self.leaf_labels)  # at least, of labels with a row
        if self.routing == "routers" or (self.routing == "auto" and self._auto_routing(clusters, per_row) == "routers"):
            # the group routers' task holds the rows twice (pieces and stack) where it can, else their chains of
            # streamed weights: both within SVM_GROUP_SHARE of the worker's memory (:meth:`_fit_routers`)
            rows_bytes = 2 * _ENTRY_BYTES * float(by_label.sum())
            need["worker"] = max(need["worker"], min(rows_bytes, SVM_GROUP_SHARE * (task_memory_limit()
                                                                                   or memory_for_data())))
        return need

    def fit(self, X, Y) -> LabelCentroidClassifier:
        """Fit the label centroids (two passes over the row blocks) and cluster them (in memory).

        Parameters
        ----------
        X : dask.array.Array or matrix, shape (n_samples, n_features)
            Row blocks of features (a store's ``X``), or an in-memory matrix.
        Y : dask.array.Array or matrix, shape (n_samples, n_labels)
            Binary labels, in the same row blocks.
        """
        self._check_params()
        for kept in ("_entries_kept", "_routers_kept"):  # what the last fit's predictions read
            self.__dict__.pop(kept, None)
        X = as_rows(X, "X")
        Y = as_rows(Y, "Y", block_rows=X.chunks[0][0] if not isinstance(Y, da.Array) else None)
        if Y.shape[0] != X.shape[0] or tuple(Y.chunks[0]) != tuple(X.chunks[0]):
            raise ValueError(f"Y ({Y.shape[0]} rows) must have X's rows ({X.shape[0]}) in the same row blocks")
        started = time.perf_counter()
        passes = 0
        self.idf_, bounds = None, None
        limit = task_memory_limit()
        first = {}  # the first pass: document frequencies (tf-idf), the labels' entry bounds
        if self.features == "tfidf":
            first["df"] = _graph.document_counts(X)
        first["entries"] = tree_combine(per_block_objects(_label_entries_block, X, Y), operator.add)
        first = dict(zip(first, dask.compute(*first.values())))
        passes += 1
        if "df" in first:
            self.idf_ = K.idf_weights(first["df"], X.shape[0], np.float32)
        if limit:
            bounds = label_block_bounds(np.minimum(first["entries"], X.shape[1]), limit)
        idf = None if self.idf_ is None else whole_operand(self.idf_, name="idf")
        chosen = "auto" in (self.beam, self.summary_exponent, self.svm_weight, self.centroid_threshold)  # held out
        share = min(HELD_OUT_SHARE, HELD_OUT_ROWS / max(X.shape[0], 1)) if chosen else 0.0
        seed = seed_of(self.random_state)
        groups = label_passes(bounds, first.get("entries"), memory_for_data() if limit else None)
        sums, small = [], None
        for group in groups:
            parts = per_block_objects(_label_sums_block, X, Y, idf=idf, share=share if small is None else 0.0,
                                      seed=seed, bounds=group)
            n_pieces = 1 if group is None else len(group) - 1
            todo = [tree_combine([part[1 + j] for part in parts], operator.add) for j in range(n_pieces)]
            if small is None:  # the label counts and the held-out rows, in the first pass
                todo.append(tree_combine([part[0] for part in parts], _add_small))
            # each label block's sums, as they arrive: unit rows and the norms (the held-out choice of the beam
            # recovers the sums of the labels it needs from them), so that one copy of the centroids is held
            got = compute_each(todo, lambda i, v, n=n_pieces: _unit_and_norms(v) if i < n else v)
            small = got.pop() if small is None else small
            sums += got
            passes += 1
        counts, X_held, Y_held = small
        W = sums[0][0] if len(sums) == 1 else sp.vstack([piece for piece, _ in sums], format="csr")
        norms = np.concatenate([n for _, n in sums])
        self.n_label_blocks_ = len(sums)
        del sums
        logger.info(f"label centroids: {W.nnz:,} entries from {X.shape[0]:,} rows ({passes} passes"
                    + (f"; summed by the workers in {self.n_label_blocks_} label blocks" if self.n_label_blocks_ > 1
                       else "") + ")")
        seen = np.flatnonzero(counts > 0)
        rng = np.random.default_rng(seed)
        order, offsets = balanced_clusters(W, seen, check_int(self.leaf_labels, "leaf_labels", 2), rng)
        self.W_ = sp.csr_matrix(W[order])
        del W
        logger.info(f"label clusters: {len(offsets) - 1:,} of at most {self.leaf_labels} labels")
        self.order_, self.offsets_ = order.astype(np.int64), offsets
        self.V_, self.svm_bias_ = None, None
        self.budget_cut_ = []
        budget = _StageBudget(self.time_budget, started, float(np.sum(first["entries"], dtype=np.float64)),
                              self.budget_cut_)
        # a label's classifier is trained on its cluster's rows: the entries of the rows of every label of the cluster
        by_cluster = np.add.reduceat(np.asarray(first["entries"], np.float64)[self.order_], offsets[:-1]) \
            if len(offsets) > 1 else np.zeros(0)
        choices = chosen and X_held.shape[0] > 0
        # the held-out choices score the held-out rows once a candidate: priced as the first model prices a row
        held_share = X_held.shape[0] / max(X.shape[0], 1)
        fits = self.svm_weight != "auto" or classifiers_fit(self.W_.nnz, psutil.virtual_memory().available)
        if not fits:
            logger.warning(f"label classifiers not trained: two copies of their weights (at most "
                           f"{2 * self.W_.nnz * _ENTRY_BYTES / 2**30:.1f} GiB) exceed {SVM_MEMORY_SHARE:.0%} of the "
                           f"{psutil.virtual_memory().available / 2**30:.1f} GiB available; the centroids alone score "
                           "the candidates (svm_weight 0)")
        if fits and (self.svm_weight == "auto" or self.svm_weight > 0) and not budget.affords(
                "the label classifiers", float(np.diff(offsets) @ by_cluster),
                also=held_share * self._scorings(True) if choices and self.svm_weight == "auto" else 0.0):
            fits = False
        if fits and (self.svm_weight == "auto" or self.svm_weight > 0):
            release_memory()  # what the sums and the clustering freed, before the classifiers' rows are gathered
            self.V_, self.svm_bias_, n = self._fit_svms(X, Y, idf, first["entries"], share=share, seed=seed)
            release_memory()
            passes += n
        n_clusters = len(offsets) - 1
        self.routing_ = self.routing if self.routing != "auto" else \
            self._auto_routing(n_clusters, first["entries"], log=True)
        self.R_ = self.router_bias_ = self.U_ = self.cluster_bias_ = self.group_offsets_ = None
        self.group_beam_ = 0
        if self.routing_ == "routers" and not budget.affords(
                "the routers", 2 * math.sqrt(n_clusters) * float(np.sum(first["entries"], dtype=np.float64))):
            self.routing_ = "summaries"
        if self.routing_ == "routers":
            release_memory()
            passes += self._fit_routers(X, Y, idf, first["entries"], share=share, seed=seed)
            self.group_beam_ = min(min(AUTO_GROUPS), len(self.group_offsets_) - 1)
        self.beam_, self.held_out_ = self.beam, {}
        self.summary_exponent_ = SUMMARY_EXPONENTS[0] if self.summary_exponent == "auto" else self.summary_exponent
        self.svm_weight_ = SVM_WEIGHTS[0] if self.svm_weight == "auto" else float(self.svm_weight)
        self.centroid_threshold_ = 0.0 if self.centroid_threshold == "auto" else float(self.centroid_threshold)
        if choices and not budget.affords("the held-out choices", 0.0,
                                          also=held_share * self._scorings(self.V_ is not None)):
            choices = False
            if self.svm_weight == "auto" and self.V_ is not None:  # trained, not weighed: a first guess's middle
                self.svm_weight_ = SVM_WEIGHTS[len(SVM_WEIGHTS) // 2]
        if not fits or self.V_ is None:
            self.svm_weight_ = 0.0
        if choices:
            exponent, groups, self.beam_, self.svm_weight_, self.held_out_ = self._choose(norms, X_held, Y_held,
                                                                                          counts)
            if self.routing_ == "routers":
                self.group_beam_ = groups
                if "p@1 by groups" in self.held_out_:
                    logger.info(f"routers: {groups} of {len(self.group_offsets_) - 1} groups a row: held-out P@1 at "
                                f"beam {self.held_out_['beam compared']} " + ", ".join(
                                    f"{g} {p:.4f}" for g, p in self.held_out_["p@1 by groups"].items()))
            else:
                self.summary_exponent_ = exponent
            if self.summary_exponent == "auto" and "p@1 by summary exponent" in self.held_out_:
                logger.info(f"cluster summaries: label weights n ** {self.summary_exponent_:g}: held-out P@1 at beam "
                            f"{self.held_out_['beam compared']} " + ", ".join(
                                f"{g} {p:.4f}" for g, p in self.held_out_["p@1 by summary exponent"].items()))
            if self.beam == "auto":
                logger.info(f"beam {self.beam_}: held-out P@1 " + ", ".join(
                    f"{b} {p:.4f}" for b, p in self.held_out_["p@1 by beam"].items()) + f" ({X_held.shape[0]:,} rows)")
            if "p@1 by svm weight" in self.held_out_:
                logger.info(f"label classifiers weighted {self.svm_weight_:g}: held-out P@1 " + ", ".join(
                    f"{w:g} {p:.4f}" for w, p in self.held_out_["p@1 by svm weight"].items()))
            if "p@1 by centroid threshold" in self.held_out_:
                self.centroid_threshold_ = self.held_out_["centroid threshold"]
                logger.info(f"label centroids without their entries below {self.centroid_threshold_:g}: held-out "
                            "P@1 " + ", ".join(f"{t:g} {p:.4f}"
                                               for t, p in self.held_out_["p@1 by centroid threshold"].items()))
        elif self.beam == "auto":
            self.beam_ = min(min(AUTO_BEAMS), len(offsets) - 1)
        if not self.svm_weight_:
            self.V_, self.svm_bias_ = None, None
        self.M_ = sp.csr_matrix((n_clusters, X.shape[1]), dtype=np.float32) if self.routing_ == "routers" else \
            _summaries(self.W_, offsets, counts[order] ** float(self.summary_exponent_))
        if self.centroid_threshold_:  # after the summaries, which route by every entry
            entries = self.W_.nnz
            self.W_ = prune_rows(self.W_, self.centroid_threshold_)
            logger.info(f"label centroids: entries below {self.centroid_threshold_:g} dropped, {self.W_.nnz:,} of "
                        f"{entries:,} left")
        self.label_counts_ = counts.astype(np.int64)
        self.n_features_in_, self.n_labels_ = int(X.shape[1]), int(Y.shape[1])
        self.n_samples_seen_ = int(X.shape[0])
        self.n_unseen_labels_ = int(self.n_labels_ - len(seen))
        self.n_passes_, self.task_ = passes, "multilabel"
        if self.n_unseen_labels_:
            logger.info(f"{self.n_unseen_labels_:,} of {self.n_labels_:,} labels have no training row: no centroid, "
                        "never predicted")
        return self

    def _scorings(self, classifiers: bool) -> int:
        """How many times the held-out choices (:meth:`_choose`) score the held-out rows, at most: the summary
        exponents (or the routers' groups), the beams, the classifiers' weights (if trained) and the thresholds."""
        count = max(len(SUMMARY_EXPONENTS), len(AUTO_GROUPS)) if self.summary_exponent == "auto" else len(AUTO_GROUPS)
        count += len(AUTO_BEAMS) if self.beam == "auto" else 1
        count += len(SVM_WEIGHTS) if classifiers and self.svm_weight == "auto" else 0
        return count + (len(CENTROID_THRESHOLDS) if self.centroid_threshold == "auto" else 0)

    def _auto_routing(self, n_clusters: int, label_entries, *, log: bool = False) -> str:
        """``routing="auto"``'s choice before any router is trained: the summaries while the clusters are at most the
        narrowest beam's candidates (``min(AUTO_BEAMS) * leaf_labels``: a row scores no more summaries than labels);
        past them the routers, trained on every row (streamed where no task holds them: :func:`router_share` of
        ``label_entries``, the bounds of the labels' rows' entries), which the summaries still meet on the held-out
        rows."""
        if n_clusters <= min(AUTO_BEAMS) * self.leaf_labels:
            return "summaries"
        if log and router_share(float(np.sum(label_entries, dtype=np.float64))) < 1.0:
            logger.info("routers: the group routers streamed over the row blocks (every row; no task holds them all)")
        return "routers"

    def _fit_svms(self, X: da.Array, Y: da.Array, idf, label_entries: np.ndarray, *, share: float,
                  seed: int) -> tuple[sp.csr_matrix, np.ndarray, int]:
        """The labels' classifiers (:func:`~xmldask.models._svm.cluster_svms`), in ``W_``'s order, each trained on its
        cluster's rows (:func:`_train_svms`). Returns the weights, the biases and the passes made."""
        position = np.full(Y.shape[1], -1, np.int64)
        position[self.order_] = np.arange(len(self.order_))
        # a label's rows' entries, not clipped at the features as a centroid's are: its rows are gathered whole
        entries = np.asarray(label_entries, np.float64)[self.order_]
        V, bias, n_passes = _train_svms(X, Y, idf, position, self.offsets_, entries, share=share, seed=seed)
        logger.info(f"label classifiers: {V.nnz:,} weights of {V.shape[0]:,} labels ({n_passes} "
                    f"pass{'es' if n_passes > 1 else ''})")
        return V, bias, n_passes

    def _fit_routers(self, X: da.Array, Y: da.Array, idf, label_entries: np.ndarray, *, share: float,
                     seed: int) -> int:
        """The routers (:func:`_train_svms`): a classifier per group of clusters (:func:`router_groups`) trained
        one-vs-rest on every training row (``R_``, ``router_bias_``), and one per cluster trained on its group's rows
        (``U_``, ``cluster_bias_``), a row's positives the groups and clusters of its labels. Returns the passes."""
        n_clusters = len(self.offsets_) - 1
        self.group_offsets_, cluster_of, group_of, by_cluster = router_labels(self.order_, self.offsets_, Y.shape[1],
                                                                              label_entries)
        n_groups = len(self.group_offsets_) - 1
        entries = np.asarray(label_entries, np.float64)
        start = time.perf_counter()
        self.U_, self.cluster_bias_, passes = _train_svms(X, Y, idf, cluster_of, self.group_offsets_, by_cluster,
                                                          share=share, seed=seed, max_passes=ROUTER_PASSES)
        # the group routers train on every row (a row is a negative of the groups it has no label in): in one task
        # where it holds two copies of their entries (bounded by the labels' entry bounds, which count a row once per
        # label), else streamed a row block at a time
        total = float(entries.sum())
        middle = time.perf_counter()
        if router_share(total) < 1.0:  # no task holds them all: streamed, a row block after another
            # what the cluster routers' groups freed: at 1M labels on two 1 GiB workers they sat at 503 and 570 MiB
            # after them (258 and 264 trimmed), and the streamed routers' ~480 MiB more had a worker restarted
            release_memory()
            self.R_, self.router_bias_, n = _stream_routers(X, Y, idf, group_of, n_groups, share=share, seed=seed)
            how = f"streamed, {n} passes"
        else:
            whole = np.array([0, n_groups], np.int64)
            self.R_, self.router_bias_, n = _train_svms(X, Y, idf, group_of, whole,
                                                        np.full(n_groups, total / n_groups), share=share, seed=seed,
                                                        keep=1.0, max_passes=ROUTER_PASSES)
            how = "held by one task"
        logger.info(f"routers: {n_groups:,} groups of clusters ({self.R_.nnz:,} weights, every row, {how}, "
                    f"{time.perf_counter() - middle:.1f} s), {n_clusters:,} clusters ({self.U_.nnz:,} weights, "
                    f"{middle - start:.1f} s; {passes + n} passes)")
        return passes + n

    def _without(self, norms: np.ndarray, D: sp.csr_matrix, rest=None) -> sp.csr_matrix:
        """The unit centroids (in cluster order) of the sums ``P - D``, ``P``'s rows being the centroids times their
        ``norms`` (by label): only the labels with a row in ``D`` change; those without a row left (``rest``: the
        rows each label keeps, if given) get none (not the unit rounding error of the difference).

        Written a slice of :data:`WITHOUT_ENTRIES` entries of ``W_`` at a time into arrays of ``W_``'s size (a
        difference has at most its centroid's entries: ``D``'s rows are parts of the sums), so that the copy is the
        only centroid-sized allocation: most labels change when the held-out rows have many labels each."""
        W, order = self.W_, self.order_
        keeps = np.ones(len(order), bool) if rest is None else np.asarray(rest)[order] > 0
        data, indices = np.empty(W.nnz, np.float32), np.empty(W.nnz, W.indices.dtype)
        indptr = np.zeros(W.shape[0] + 1, W.indptr.dtype)
        cuts = np.unique(np.r_[np.searchsorted(W.indptr, np.arange(0, W.nnz, WITHOUT_ENTRIES), side="right") - 1,
                               W.shape[0]])
        at = 0
        for a, b in zip(cuts[:-1], cuts[1:]):
            old, Dc = W[a:b], D[order[a:b]]
            changed = np.diff(Dc.indptr) > 0
            if changed.any():  # an unchanged row is kept as it is: times 1, minus nothing, times 1
                piece = sp.csr_matrix(sp.diags(np.where(changed, norms[order[a:b]], 1.0).astype(np.float32)) @ old
                                      - Dc.astype(np.float32), dtype=np.float32)
                lengths = np.sqrt(np.asarray(piece.multiply(piece).sum(axis=1), dtype=np.float64).ravel())
                scale = np.where(changed, 1.0 / np.where(lengths > 0, lengths, 1.0), 1.0) * keeps[a:b]
                piece.data *= np.repeat(scale, np.diff(piece.indptr)).astype(np.float32)
                piece.eliminate_zeros()
            else:
                piece = old
            n = piece.nnz
            data[at:at + n], indices[at:at + n] = piece.data, piece.indices
            indptr[a + 1:b + 1] = at + piece.indptr[1:]
            at += n
        return sp.csr_matrix((data[:at], indices[:at], indptr), shape=W.shape)

    def _choose(self, norms, X_held, Y_held, counts) -> tuple[float, int, int, float, dict]:
        """The routing's option (the summary exponent, of :data:`SUMMARY_EXPONENTS`, or the routers' groups, of
        :data:`AUTO_GROUPS`, then, with ``routing="auto"``, the summaries' exponents after them: the routing that wins
        is kept, ``routing_``; compared at the narrowest beam), the beam (of :data:`AUTO_BEAMS`, its gain weighed per
        doubling) and the classifiers'
        weight (of :data:`SVM_WEIGHTS`, at the chosen beam) with the best P@1 on the held-out rows, each where
        ``"auto"``: a later one only for a gain beyond the noise of those rows; scored by centroids without them
        (``P - Y_h^T X_h``, in the clusters of all rows), the summaries weighted by the labels' rows left, and the
        classifiers and routers (trained without them). Returns the exponent, the groups, the beam, the weight and
        the record."""
        n_clusters = len(self.offsets_) - 1
        beams = sorted({min(b, n_clusters) for b in AUTO_BEAMS}) if self.beam == "auto" else [int(self.beam)]
        rest = counts - np.asarray(Y_held.sum(axis=0)).ravel()
        W = self._without(norms, (Y_held.T @ X_held).tocsr(), rest)
        fallback = _most_frequent(rest, 1)
        weights = rest[self.order_].astype(np.float64)
        # the candidates' kernel reads them so (made once for every comparison below)
        entries = ClusterEntries.of(W, self.offsets_)
        classifiers = None if self.V_ is None else ClusterEntries.of(self.V_, self.offsets_)

        def hits(route: dict, beam: int, weight: float = 0.0, threshold: float = 0.0) -> np.ndarray:
            top = _topk_block(X_held, entries, self.order_, self.offsets_, fallback, V=classifiers,
                              bias=self.svm_bias_, beam=beam, k=1, weight=weight, threshold=threshold,
                              **route)[:, 0].astype(np.int64)
            return np.asarray(Y_held[np.arange(len(top)), top]).ravel() > 0

        def better(hit: np.ndarray, best: np.ndarray) -> bool:  # taken only for a gain the held-out rows resolve
            return paired_gain(hit, best, sigmas=BEAM_GAIN_SIGMAS)["resolved"]

        routed = self.routing_ == "routers"
        exponents = SUMMARY_EXPONENTS if self.summary_exponent == "auto" else (float(self.summary_exponent),)
        routes = []  # (what it varies, its value), compared in this order
        if routed:
            n_groups = len(self.group_offsets_) - 1
            routes += [("groups", g) for g in sorted({min(g, n_groups) for g in AUTO_GROUPS})]
            routers = self._routers()
        if not routed or self.routing == "auto":
            # the summaries of the centroids of all rows may route better than the routers (trained on fewer rows
            # each): with routing="auto" those compete after them
            routes += [("summary exponent", g) for g in exponents]

        def route_of(name, g):
            if name == "groups":
                return {**routers, "groups": g}
            return dict(zip(("MT", "MH", "head"), _split_summaries(_summaries(W, self.offsets_, weights ** g))))
        by_option, option, route = {}, routes[0], None  # two routes at most: the best so far's and the one compared
        for candidate_option in routes:
            candidate = route_of(*candidate_option)
            by_option[candidate_option] = hits(candidate, beams[0])
            if route is None or better(by_option[candidate_option], by_option[option]):
                option, route = candidate_option, candidate
            del candidate
        W = None  # the routes are made: the centroids are read as their entries from here
        weight = SVM_WEIGHTS[0] if self.svm_weight == "auto" else float(self.svm_weight)
        by_beam = {beams[0]: by_option[option] if not weight else hits(route, beams[0], weight)}
        beam = beams[0]
        for b in beams[1:]:
            by_beam[b] = hits(route, b, weight)
            # its gain weighed per doubling of the candidates a row scores
            if (better(by_beam[b], by_beam[beam])
                    and by_beam[b].mean() - by_beam[beam].mean() >= BEAM_MIN_GAIN * math.log2(b / beam)):
                beam = b
        p1 = {b: float(h.mean()) for b, h in by_beam.items()}
        record = {"p@1": p1[beam], "rows": int(X_held.shape[0]), "p@1 by beam": p1}
        if len(routes) > 1:
            record["beam compared"] = beams[0]
            for name in dict(routes):
                record[f"p@1 by {name}"] = {g: float(h.mean()) for (n, g), h in by_option.items() if n == name}
            if routed:
                record["routing"] = "routers" if option[0] == "groups" else "summaries"
            record[option[0]] = option[1]
        if self.svm_weight == "auto" and self.V_ is not None:
            by_weight = {weight: by_beam[beam]}
            for w in SVM_WEIGHTS[1:]:
                by_weight[w] = hits(route, beam, w)
                if better(by_weight[w], by_weight[weight]):
                    weight = w
            record.update({"p@1": float(by_weight[weight].mean()), "svm weight": weight,
                           "p@1 by svm weight": {w: float(h.mean()) for w, h in by_weight.items()}})
        if self.centroid_threshold == "auto":
            whole = by_weight[weight] if "svm weight" in record else by_beam[beam]
            by_threshold, threshold = {0.0: whole}, 0.0
            for t in CENTROID_THRESHOLDS:  # the largest that costs the held-out rows no resolved P@1 and little
                by_threshold[t] = hits(route, beam, weight, t)
                if better(whole, by_threshold[t]) or whole.mean() - by_threshold[t].mean() > PRUNE_TOLERANCE:
                    break
                threshold = t
            record.update({"p@1": float(by_threshold[threshold].mean()), "centroid threshold": threshold,
                           "p@1 by centroid threshold": {t: float(h.mean()) for t, h in by_threshold.items()}})
        if routed and option[0] != "groups":  # the summaries route better: the routers are not kept
            logger.info("routing by the cluster summaries: held-out P@1 %.4f against the routers' %.4f at beam %d",
                        by_option[option].mean(), max(h.mean() for (n, _), h in by_option.items() if n == "groups"),
                        beams[0])
            self.routing_, self.group_beam_ = "summaries", 0
            self.R_ = self.router_bias_ = self.U_ = self.cluster_bias_ = self.group_offsets_ = None
            self.__dict__.pop("_routers_kept", None)
        routed = self.routing_ == "routers"
        exponent = self.summary_exponent_ if routed else option[1]
        return exponent, (int(option[1]) if routed else 0), int(beam), weight, record

    def _located(self, url: str, inventory) -> None:
        self.store_url_ = url  # workers whose memory the model exceeds read it from there in cluster blocks
        self.store_token_ = dask.base.tokenize(inventory)  # and keep them by this

    def _checked_finite(self, url: str):
        """The eager arrays checked as every model's; the lazy ones when they are read (:class:`_StoredArray`)."""
        for name in self._ARRAYS:
            if name not in self._LAZY or self.__dict__.get(name + "_") is not None:  # not left in the store
                _checked(getattr(self, name + "_"), name, url)
        return self

    def _indptr(self, name: str) -> np.ndarray:
        """The row pointers of the sparse fitted array ``name`` (``"W"`` or ``"M"``), without reading its entries
        when it is still in the store."""
        value = self.__dict__.get(name + "_")
        stored = self.__dict__.get("_stored")
        if value is None and stored is not None:
            return np.asarray(read_checked(stored[name]["indptr"], ..., store_location(stored)), np.int64)
        return getattr(self, name + "_").indptr

    def predict_topk(self, X, k: int = 5) -> tuple[da.Array, da.Array]:
        """Top-``k`` labels (int32) and scores (float32) of every row, best first (ties: smaller id), lazily.

        A row scores the summaries of all clusters and the labels of its ``beam`` best clusters (a label's cosine,
        plus ``svm_weight_`` times its classifier's margin); with fewer candidates than ``k``, the most frequent
        training labels fill the remaining slots with a score below the others.
        A loaded model that the workers' memory limit cannot hold in a task (:func:`_cluster_blocks`) is read
        by the tasks from its store in cluster blocks: per row block, a task per group of cluster blocks (as many
        groups as the workers' threads) routes the rows to their best clusters block after block, then one per
        group scores the labels of the chosen clusters, and the groups' best are merged.
        """
        X = self._rows(X)
        k = self._checked_k(k)
        fallback = _most_frequent(self.label_counts_, k)
        url = getattr(self, "store_url_", None)
        limit = task_memory_limit() if url else None
        if limit:
            bounds = _cluster_blocks(self._cluster_bytes(), limit, parallelism())
            if bounds is not None:
                return self._predict_in_cluster_blocks(X, k, fallback, url, bounds)
        weight = self._svm_weight()
        whole = {**self._label_entries(classifiers=bool(weight)), "order": self.order_, "offsets": self.offsets_,
                 "fallback": fallback, "idf": self.idf_, "bias": self.svm_bias_ if weight else None}
        if self._routed():
            whole.update(self._routers())
        else:
            whole.update(zip(("MT", "MH", "head"), _split_summaries(self.M_)))
        X = spread_rows(X, parallelism(), PREDICT_PIECE_ROWS)  # a block a task: every thread a piece of a large one
        operands = [("Xb", X, ROWS)] + [(name, whole_operand(value, name=f"centroid-{name}"), WHOLE)
                                        for name, value in whole.items() if value is not None]
        packed = per_block(_topk_block, operands, tail=(2 * k,), dtype=np.float64, token="centroid-topk",
                           stack=False, static={"beam": int(self.beam_), "k": k, "weight": weight,
                                                "groups": int(getattr(self, "group_beam_", 0) or 0)})
        return packed[:, :k].astype(np.int32), packed[:, k:].astype(np.float32)

    def _routers(self) -> dict:
        """The routers as a row block reads them (the group ``routers``: :class:`_GroupRouters`; the clusters'
        ``routes``: :class:`._candidates.GroupRoutes`), transposed once for the fitted routers (3-5 s at 1M labels)
        and kept beside them for the next predictions."""
        fitted = (self.R_, self.U_)
        kept = self.__dict__.get("_routers_kept")
        if kept is None or any(a is not b for a, b in zip(kept[0], fitted)):
            kept = (fitted, {"routers": _GroupRouters.of(self.R_, self.router_bias_),
                             "routes": GroupRoutes.of(self.U_, self.cluster_bias_, self.group_offsets_)})
            self.__dict__["_routers_kept"] = kept
        return kept[1]

    def _label_entries(self, classifiers: bool = False) -> dict:
        """The centroids (``W``) and, with ``classifiers``, the classifiers (``V``) as the candidates' kernel reads
        them (:class:`._candidates.ClusterEntries`: 8 s at 1M labels), made once and kept until the next fit; a
        loaded model's centroids are left in its store once read for them."""
        kept = self.__dict__.setdefault("_entries_kept", {})
        for name, wanted in (("W", True), ("V", classifiers)):
            if wanted and name not in kept:
                lazy = self.__dict__.get(name + "_") is None and self.__dict__.get("_stored") is not None
                kept[name] = ClusterEntries.of(_unwrap(getattr(self, name + "_")), self.offsets_)
                if lazy:
                    self.__dict__.pop(name + "_", None)
        return {"W": kept["W"], "V": kept.get("V") if classifiers else None}

    def _routed(self) -> bool:
        """Whether rows choose their clusters by the routers (a version 1 or 2 store: by the summaries)."""
        return getattr(self, "routing_", None) == "routers"

    def _svm_weight(self) -> float:
        """The classifiers' weight in a candidate's score (0 for a model without them, such as a version 1 store)."""
        return float(getattr(self, "svm_weight_", None) or 0.0) if self.svm_bias_ is not None else 0.0

    def _cluster_bytes(self) -> np.ndarray:
        """Bytes of each cluster's summary (stored entries), and centroids, classifiers and routers as the
        prediction reads them (:class:`._candidates.ClusterEntries`, :class:`._candidates.GroupRoutes`: at most
        :attr:`~._candidates.ClusterEntries.ENTRY_BYTES` an entry)."""
        W = self._indptr("W")
        read = W[self.offsets_[1:]] - W[self.offsets_[:-1]]
        if self._routed():
            read = read + np.diff(self._indptr("U")) + 1
        if self._svm_weight():
            V = self._indptr("V")
            read = read + V[self.offsets_[1:]] - V[self.offsets_[:-1]] + np.diff(self.offsets_)
        return np.diff(self._indptr("M")) * float(_ENTRY_BYTES) + read * float(ClusterEntries.ENTRY_BYTES)

    def _predict_in_cluster_blocks(self, X, k: int, fallback, url: str, bounds) -> tuple[da.Array, da.Array]:
        idf = None if self.idf_ is None else dask.delayed(self.idf_, pure=True)  # one copy in the graph
        beam, weight, routed = int(self.beam_), self._svm_weight(), self._routed()
        goffsets = None
        if routed:  # cluster blocks of whole groups; the group routers scored in each row block's one task
            goffsets = np.asarray(self.group_offsets_, np.int64)
            bounds = np.unique(goffsets[np.searchsorted(goffsets, bounds)])
        ranges = [(int(a), int(b)) for a, b in zip(bounds[:-1], bounds[1:])]
        groups = [[ranges[i] for i in part] for part in np.array_split(np.arange(len(ranges)),
                                                                       min(len(ranges), parallelism()))]
        # a task per group of cluster blocks reads them one after the other, merging as it goes: a worker holds one
        # block and the running best, whatever the number of blocks; where a worker's memory holds the whole model,
        # it keeps the blocks it read for the next row blocks and predictions (by the store's content token)
        limit = worker_memory_limit()
        token = getattr(self, "store_token_", None)
        kept = token is not None and limit is not None and \
            self._cluster_bytes().sum() <= SHARED_READ_SHARE * limit
        budget = SHARED_READ_SHARE * limit if kept else 0.0
        parts = [[(url, a, b, token if kept else None, budget) for a, b in group] for group in groups]
        blocks = []
        for Xb, n_rows in zip(X.to_delayed().ravel(), X.chunks[0]):
            Xt = dask.delayed(_rows_block, pure=True)(Xb, idf)
            chosen = None if goffsets is None else \
                dask.delayed(_stored_groups, pure=True)(Xt, url, len(goffsets) - 1, int(self.group_beam_),
                                                        token=token if kept else None, budget=budget)
            # the groups of cluster blocks merged pairwise
            best = tree_combine([dask.delayed(_route_group, pure=True)(Xt, group, beam=beam, groups=chosen,
                                                                       goffsets=goffsets) for group in parts],
                                functools.partial(_merge_routes, beam=beam))
            top = tree_combine([dask.delayed(_candidate_group, pure=True)(Xt, best[0], group, k=k, weight=weight)
                                for group in parts], functools.partial(_merge_candidates, k=k))
            packed = dask.delayed(_filled, pure=True)(top[0], top[1], fallback)
            blocks.append(da.from_delayed(packed, shape=(n_rows, 2 * k), dtype=np.float64))
        packed = da.concatenate(blocks, axis=0)
        logger.info(f"prediction in {len(ranges)} cluster blocks read from {url} (the model exceeds what a worker "
                    "holds in a task), " + ("kept by the workers that read them" if kept else "by each row block"))
        return packed[:, :k].astype(np.int32), packed[:, k:].astype(np.float32)

    def train_summary(self) -> dict:
        held = {"p@1": self.held_out_["p@1"]} if self.held_out_ else {}
        return {"n_passes": int(self.n_passes_), "task": "multilabel", "held_out": held, "beam": int(self.beam_),
                "summary_exponent": float(getattr(self, "summary_exponent_", 0.0)), "svm_weight": self._svm_weight(),
                "routing": getattr(self, "routing_", "summaries"), "group_beam": int(getattr(self, "group_beam_", 0)),
                "centroid_threshold": float(getattr(self, "centroid_threshold_", None) or 0.0),
                "label_blocks": int(getattr(self, "n_label_blocks_", 1)),
                "n_clusters": self.n_clusters_,
                "n_unseen_labels": int(self.n_unseen_labels_),
                "model_entries": int(self.W_.nnz + self.M_.nnz + (self.V_.nnz if self._svm_weight() else 0)
                                     + (self.U_.nnz + self.R_.nnz if self._routed() else 0))}

    @classmethod
    def _from_parts(cls, params, fitted, arrays):
        stored = None
        if not isinstance(arrays, dict) and _stored_bytes(arrays, cls._LAZY) > LAZY_BYTES:  # they stay there until used
            stored, eager = arrays, _Eager({name: arrays[name] for name in cls._ARRAYS
                                            if name not in cls._LAZY and name in arrays})
            eager.store_path = getattr(arrays, "store_path", None)
            arrays = eager
        model = super()._from_parts(params, fitted, arrays)
        if stored is not None:
            for name in cls._LAZY:
                model.__dict__.pop(name + "_", None)
            model._stored = stored
        model.idf_ = None if model.idf_ is None else np.asarray(model.idf_, np.float32)
        return model

