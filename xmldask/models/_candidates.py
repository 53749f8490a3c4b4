"""Scores of the candidate labels of rows, cluster by cluster: the prediction kernel of the label-centroid tree.

A block kernel (NumPy and a Numba loop; no Dask). Each row has chosen a few label clusters; a label's score is
``x . w_l`` (its centroid) plus ``weight * (x . v_l + b_l)`` (its classifier) and a row keeps its ``k`` best.

The clusters are taken one at a time, and the rows that chose a cluster a batch at a time: the batch's entries
are turned feature-major (an inverted index of its features, in scratch arrays sized by the largest), then each
label's entries are read once, and those of a feature the batch has add into the scores of its rows (a dense
``labels x rows`` block of at most :data:`ROW_SLOTS`). A call costs every entry of the chosen clusters once (a
lookup in one table of ``d`` entries), a (row, cluster) pair its row's features and the entries they meet; never
``d`` per cluster nor ``L``. Inverting the clusters' entries instead (two random writes an entry, where the
rows have far fewer) took 1.8 and 2.7 times as long at 1M labels (20,000 rows, one thread: routing 3.1 s against
1.8, candidates 5.7 s against 2.1); SciPy's product of a row block with a cluster's transposed centroids allocates
``d + 1`` row pointers per cluster.

The rows choose their clusters by the summaries in one kernel too (:func:`summary_topk`): the dense columns of
the features most summaries share a tile of clusters at a time for a batch of rows (each read once for the batch),
then each row's sparse entries into its scores, and its best kept as they come. At 1M labels (8,192 clusters, 94 M
summary entries, 5,000 rows, one thread) that took 133-145 us a row against 299-386 for SciPy's product of the
dense columns, a row-by-row product of the rest and ``np.argpartition`` of the ``rows x clusters`` scores.
"""

from __future__ import annotations

import dataclasses
import functools

import numpy as np
import scipy.sparse as sp

__all__ = ["ClusterEntries", "GroupRoutes", "candidate_topk", "grouped_topk", "prune_rows", "sparse_product_dense",
           "summary_topk"]

#: scores of a cluster's labels for a batch of its rows held at once (float64: 512 KiB, within a core's L2 cache);
#: a batch has ``ROW_SLOTS // labels`` rows. 8 MiB (1 << 20) took 1.2 times as long at 10K and 1M labels (10,000
#: rows, one thread: 43.4 against 36.0 and 184.0 against 156.7 us a row), 16 KiB (1 << 11) 1.2-1.6 times
ROW_SLOTS = 1 << 16

#: rows and clusters a tile of :func:`summary_topk` scores at once (float32: 1 MiB)
SUMMARY_ROWS = 256
SUMMARY_TILE = 1024


@functools.cache
def _compiled(name: str = "_topk_by_rows"):
    """The kernel ``name`` of this module compiled by Numba (cached on disk), imported on first use (Numba adds
    about 50 MB to a process: :func:`xmldask.models._svm._compiled`); the helpers it calls compiled first."""
    import numba

    global _insert
    if not isinstance(_insert, numba.core.dispatcher.Dispatcher):
        _insert = numba.njit(cache=True, nogil=True, inline="always")(_insert)
    return numba.njit(cache=True, nogil=True)(globals()[name])


def _insert(ids, best, i, value, j):  # pragma: no cover
    """``(j, value)`` into row ``i`` of the best ``(ids, best)`` so far, kept sorted (value descending, then the
    smaller id), its last dropped; returns the row's new last value."""
    h = best.shape[1] - 1
    while h > 0 and (value > best[i, h - 1] or (value == best[i, h - 1] and j < ids[i, h - 1])):
        best[i, h] = best[i, h - 1]
        ids[i, h] = ids[i, h - 1]
        h -= 1
    best[i, h] = value
    ids[i, h] = j
    return best[i, best.shape[1] - 1]


def _product_dense(x_indptr, x_indices, x_data, m_indptr, m_indices, m_data, out):  # pragma: no cover
    for i in range(len(x_indptr) - 1):
        for q in range(x_indptr[i], x_indptr[i + 1]):
            f, xv = x_indices[q], x_data[q]
            for e in range(m_indptr[f], m_indptr[f + 1]):
                out[i, m_indices[e]] += xv * m_data[e]
    return out


def sparse_product_dense(X: sp.csr_matrix, M: sp.csr_matrix, out: np.ndarray | None = None) -> np.ndarray:
    """``X @ M`` (both CSR) added into a dense float32 array (zeros when ``out`` is None), without the sparse
    product SciPy builds first: a row's cluster summaries, which at a thousand clusters and more are dense."""
    X, M = sp.csr_matrix(X), sp.csr_matrix(M)
    if out is None:
        out = np.zeros((X.shape[0], M.shape[1]), np.float32)
    return _compiled("_product_dense")(X.indptr, X.indices, X.data, M.indptr, M.indices, M.data, out)


def _summary_topk(xh_indptr, xh_indices, xh_data, x_indptr, x_indices, x_data,  # pragma: no cover
                  mt_indptr, mt_indices, mt_data, mh, n_clusters, n_head, b, rows, tile, row_entries):
    n = len(x_indptr) - 1
    ids = np.full((n, b), -1, np.int64)
    best = np.full((n, b), -np.inf, np.float32)
    loc = np.full(max(n_head, 1), -1, np.int32)
    feats = np.empty(row_entries, np.int64)
    ptr = np.zeros(row_entries + 1, np.int64)
    slot = np.empty(row_entries, np.int32)
    value = np.empty(row_entries, np.float32)
    out = np.empty((rows, n_clusters), np.float32)
    for r0 in range(0, n, rows):
        m = min(n, r0 + rows) - r0
        # the batch's head entries feature-major: its head features numbered in order of appearance, ptr their runs
        # of (row slot, value)
        nf = 0
        for s in range(m):
            for q in range(xh_indptr[r0 + s], xh_indptr[r0 + s + 1]):
                f = xh_indices[q]
                if loc[f] < 0:
                    loc[f] = nf
                    feats[nf] = f
                    ptr[nf + 1] = 0
                    nf += 1
                ptr[loc[f] + 1] += 1
        ptr[0] = 0
        for t in range(nf):
            ptr[t + 1] += ptr[t]
        for s in range(m):
            for q in range(xh_indptr[r0 + s], xh_indptr[r0 + s + 1]):
                t = loc[xh_indices[q]]
                slot[ptr[t]] = s
                value[ptr[t]] = xh_data[q]
                ptr[t] += 1
        for t in range(nf - 1, -1, -1):  # the fill moved each pointer to its feature's end: back to the starts
            ptr[t + 1] = ptr[t]
        ptr[0] = 0
        for t in range(nf):
            loc[feats[t]] = -1
        # the head's dense rows a tile of clusters at a time, each read once for all the batch's rows that have it
        # while their scores of the tile stay in cache
        for c0 in range(0, n_clusters, tile):
            w = min(n_clusters, c0 + tile) - c0
            for s in range(m):
                dst = out[s, c0:c0 + w]
                for c in range(w):
                    dst[c] = 0.0
            for t in range(nf):
                src = mh[feats[t], c0:c0 + w]  # contiguous rows: the loop below is vectorised
                for r in range(ptr[t], ptr[t + 1]):
                    dst, v = out[slot[r], c0:c0 + w], value[r]
                    for c in range(w):
                        dst[c] += v * src[c]
        # then each row alone: its sparse entries add into its scores, and its best are kept as they come (sorted:
        # a later cluster, a larger id, must beat a score)
        for s in range(m):
            i = r0 + s
            row = out[s]
            for q in range(x_indptr[i], x_indptr[i + 1]):
                f, xv = x_indices[q], x_data[q]
                for e in range(mt_indptr[f], mt_indptr[f + 1]):
                    row[mt_indices[e]] += xv * mt_data[e]
            last = best[i, b - 1]
            for c in range(n_clusters):
                if row[c] > last:
                    last = _insert(ids, best, i, row[c], c)
    return ids, best


def _head_split(X: sp.csr_matrix, head: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The entries of the CSR ``X`` in the sorted columns ``head``, as CSR arrays (int64 pointers and ids) whose
    column ids are positions in ``head``."""
    if not len(head):
        return np.zeros(X.shape[0] + 1, np.int64), np.zeros(0, np.int64), X.data[:0]
    pos = np.minimum(np.searchsorted(head, X.indices), len(head) - 1)
    hit = head[pos] == X.indices
    rows = np.repeat(np.arange(X.shape[0]), np.diff(X.indptr))[hit]
    indptr = np.concatenate([[0], np.cumsum(np.bincount(rows, minlength=X.shape[0]))]).astype(np.int64)
    return indptr, pos[hit].astype(np.int64), X.data[hit]


def summary_topk(X: sp.csr_matrix, MT: sp.csr_matrix, b: int, MH: np.ndarray | None = None,
                 head: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """The ``b`` columns of highest ``X @ (MT + MH on the head)`` of each row, best first (ties: the smaller id),
    and their values: ``(n_rows, b)`` int64 and float32, ``(-1, -inf)`` past the number of columns.

    ``MT`` (``d x n_clusters`` CSR) holds the summaries transposed, ``MH`` (``len(head) x n_clusters``, dense) the
    rows of the features ``head`` (sorted ids; their rows of ``MT`` empty). The rows are taken
    :data:`SUMMARY_ROWS` at a time and the columns :data:`SUMMARY_TILE` at a time: each feature of the batch reads
    its entries of the tile once for all the batch's rows that have it, into scores that stay in cache, and the
    rows' best are kept as they come; never the ``rows x n_clusters`` scores nor their sort.
    """
    X = sp.csr_matrix(X, dtype=np.float32)
    MT = sp.csr_matrix(MT, dtype=np.float32)
    MT.sort_indices()
    n_clusters = MT.shape[1]
    if MH is None or head is None or not len(head):
        MH, head = np.zeros((0, n_clusters), np.float32), np.zeros(0, np.int64)
    MH = np.ascontiguousarray(MH, np.float32)
    head = np.asarray(head, np.int64)
    xh_indptr, xh_indices, xh_data = _head_split(X, head)
    starts = np.arange(0, X.shape[0], SUMMARY_ROWS)
    entries = np.add.reduceat(np.diff(X.indptr), starts) if len(starts) else np.zeros(1, np.int64)
    return _compiled("_summary_topk")(xh_indptr, xh_indices, xh_data,
                                      X.indptr, X.indices, X.data, MT.indptr, MT.indices, MT.data, MH, n_clusters,
                                      len(head), int(b), SUMMARY_ROWS, SUMMARY_TILE, int(entries.max(initial=0)))


def _grouped_topk(x_indptr, x_indices, x_data, groups, ut_indptr, ut_indices, ut_data, heavy, directory,
                  bias, goffsets, group_of, b, max_entries):  # pragma: no cover
    n, n_chosen = groups.shape
    ids = np.full((n, b), -1, np.int64)
    best = np.full((n, b), -np.inf)
    chosen = np.empty(n_chosen, np.int64)
    on = np.zeros(len(goffsets) - 1, np.bool_)
    acc = np.empty(max(len(bias), 1))  # a row's margins, by cluster id: those of its groups set
    most = n_chosen * max_entries
    starts, ends = np.empty(most, np.int64), np.empty(most, np.int64)
    scan, xs = np.empty(most, np.bool_), np.empty(most, np.float32)
    for i in range(n):
        m = 0  # the row's groups, ascending (insertion: a few)
        for s in range(n_chosen):
            g = groups[i, s]
            if g < 0 or on[g]:
                continue
            on[g] = True
            h = m
            while h > 0 and chosen[h - 1] > g:
                chosen[h] = chosen[h - 1]
                h -= 1
            chosen[h] = g
            m += 1
        for s in range(m):
            for c in range(goffsets[chosen[s]], goffsets[chosen[s] + 1]):
                acc[c] = bias[c]
        # each feature of the row adds its column's entries in the row's groups: a long column (a directory row)
        # read from each group's start, a short one scanned whole; the runs' bounds first, then the runs (the
        # bounds' loads do not wait on each other: at 1M labels 0.65-1.04 of the time of run after run in 10
        # alternated runs, median 0.86)
        nr = 0
        for q in range(x_indptr[i], x_indptr[i + 1]):
            f = x_indices[q]
            lo = ut_indptr[f]
            h = heavy[f]
            if h < 0:
                starts[nr], ends[nr], scan[nr], xs[nr] = lo, ut_indptr[f + 1], True, x_data[q]
                nr += 1
                continue
            for s in range(m):
                g = chosen[s]
                starts[nr], ends[nr], scan[nr], xs[nr] = lo + directory[h, g], lo + directory[h, g + 1], False, \
                    x_data[q]
                nr += 1
        for r in range(nr):
            xv = np.float64(xs[r])
            if scan[r]:
                for e in range(starts[r], ends[r]):
                    c = ut_indices[e]
                    if on[group_of[c]]:
                        acc[c] += np.float64(ut_data[e]) * xv
            else:
                for e in range(starts[r], ends[r]):
                    acc[ut_indices[e]] += np.float64(ut_data[e]) * xv
        last = best[i, b - 1]
        for s in range(m):  # the row's best, kept sorted: margin descending, then the smaller cluster id
            for c in range(goffsets[chosen[s]], goffsets[chosen[s] + 1]):
                sc = acc[c]
                if sc > last or (sc == last and (ids[i, b - 1] < 0 or c < ids[i, b - 1])):
                    last = _insert(ids, best, i, sc, c)
        for s in range(m):
            on[chosen[s]] = False
    return ids, best


def _directory(ut_indptr, ut_indices, heavy_features, group_of, n_groups):  # pragma: no cover
    directory = np.zeros((len(heavy_features), n_groups + 1), np.int32)
    for h in range(len(heavy_features)):
        f = heavy_features[h]
        for e in range(ut_indptr[f], ut_indptr[f + 1]):
            directory[h, group_of[ut_indices[e]] + 1] += 1
        for g in range(n_groups):
            directory[h, g + 1] += directory[h, g]
    return directory


@dataclasses.dataclass(frozen=True, eq=False)
class GroupRoutes:
    """The clusters' routers as :func:`grouped_topk` reads them (:meth:`of`): transposed (``UT``, ``d x
    n_clusters`` CSR, cluster ids ascending in each feature's row), and, for each feature with at least as many
    entries as there are groups (``heavy``: its row of ``directory``, else -1), where each group's clusters start
    in its row (``directory``, int32, ``n_heavy x (n_groups + 1)``: never more cells than those features' entries
    and one more each); the routers' ``bias`` and the groups' ``goffsets`` (group ``j`` is the clusters
    ``goffsets[j]:goffsets[j + 1]``)."""

    UT: sp.csr_matrix
    heavy: np.ndarray
    directory: np.ndarray
    bias: np.ndarray
    goffsets: np.ndarray

    @classmethod
    def of(cls, U: sp.csr_matrix, bias: np.ndarray, goffsets: np.ndarray) -> GroupRoutes:
        """The routes of the routers ``U`` (a row a cluster), their ``bias``, in the groups ``goffsets``."""
        goffsets = np.asarray(goffsets, np.int64)
        UT = sp.csr_matrix(sp.csr_matrix(U).T, dtype=np.float32)
        UT.sort_indices()
        n_groups = len(goffsets) - 1
        entries = np.diff(UT.indptr)
        heavy_features = np.flatnonzero(entries >= max(n_groups, 1))
        heavy = np.full(UT.shape[0], -1, np.int32)
        heavy[heavy_features] = np.arange(len(heavy_features), dtype=np.int32)
        directory = _compiled("_directory")(UT.indptr, UT.indices, heavy_features, _group_of(goffsets), n_groups)
        return cls(UT, heavy, directory, np.asarray(bias, np.float64).ravel(), goffsets)

    @property
    def nbytes(self) -> int:
        return int(sum(a.nbytes for a in (self.UT.data, self.UT.indices, self.UT.indptr, self.heavy,
                                          self.directory, self.bias, self.goffsets)))


def _group_of(goffsets: np.ndarray) -> np.ndarray:
    """The group of each cluster of the groups ``goffsets``."""
    return np.repeat(np.arange(len(goffsets) - 1, dtype=np.int32), np.diff(goffsets))


def grouped_topk(X: sp.csr_matrix, groups: np.ndarray, routes: GroupRoutes, b: int) -> tuple[np.ndarray, np.ndarray]:
    """The ``b`` best clusters of each row of ``X`` by the margins of their routers (``routes``: :class:`GroupRoutes`)
    among the clusters of its ``groups`` (``n_rows x g`` group ids, ``-1`` for none), best first (ties: the smaller
    id), and their margins: ``(n_rows, b)`` int64 and float64, ``(-1, -inf)`` past the groups' clusters.

    Each feature of a row adds the entries of its routers' column in the row's groups: a row costs those entries
    (and the scan of the columns shorter than the number of groups) whatever the block's size. Reading each
    cluster's router once for all the block's rows that chose its group instead cost a row every entry of its
    groups over the rows of the block that share them: at 1M labels 84-105 us a row in blocks of 5,000 rows, and
    1,130 in blocks of 200.
    """
    X = sp.csr_matrix(X)
    groups = np.ascontiguousarray(groups, np.int64).reshape(X.shape[0], -1)
    UT = routes.UT
    return _compiled("_grouped_topk")(X.indptr, X.indices, X.data, groups, UT.indptr, UT.indices, UT.data,
                                      routes.heavy, routes.directory, routes.bias, routes.goffsets,
                                      _group_of(routes.goffsets), int(b),
                                      max(int(np.diff(X.indptr).max(initial=0)), 1))


def _entries_of(w_indptr, w_indices, w_data, offsets, n_features, slot):  # pragma: no cover
    n_clusters = len(offsets) - 1
    first = w_indptr[offsets[0]]
    seen = np.full(n_features, -1, np.int32)  # the last cluster a feature was met in, then its next entry's place
    count = np.zeros(n_features, np.int32)
    fstart = np.zeros(n_clusters + 1, np.int64)
    estart = np.zeros(n_clusters + 1, np.int64)
    for c in range(n_clusters):  # the clusters' distinct features, counted
        nd = 0
        for e in range(w_indptr[offsets[c]], w_indptr[offsets[c + 1]]):
            f = w_indices[e]
            if seen[f] != c:
                seen[f] = c
                nd += 1
        fstart[c + 1] = fstart[c] + nd
        estart[c + 1] = w_indptr[offsets[c + 1]] - first
    features = np.empty(fstart[n_clusters], np.int32)
    runs = np.zeros(fstart[n_clusters] + n_clusters, np.int32)
    value = np.empty(estart[n_clusters], np.float32)
    seen[:] = -1
    for c in range(n_clusters):
        u0 = fstart[c]
        nd = 0
        for e in range(w_indptr[offsets[c]], w_indptr[offsets[c + 1]]):
            f = w_indices[e]
            if count[f] == 0:
                features[u0 + nd] = f
                nd += 1
            count[f] += 1
        features[u0:u0 + nd] = np.sort(features[u0:u0 + nd])
        for h in range(nd):  # each pair's run (from the cluster's first entry), and where its next entry goes
            f = features[u0 + h]
            runs[u0 + c + h + 1] = runs[u0 + c + h] + count[f]
            seen[f] = runs[u0 + c + h]
        for j in range(offsets[c], offsets[c + 1]):  # the labels in order: a run's entries by label
            for e in range(w_indptr[j], w_indptr[j + 1]):
                f = w_indices[e]
                slot[estart[c] + seen[f]] = j - offsets[c]
                value[estart[c] + seen[f]] = w_data[e]
                seen[f] += 1
        for h in range(nd):
            count[features[u0 + h]] = 0
            seen[features[u0 + h]] = -1
    return features, fstart, runs, estart, value


@dataclasses.dataclass(frozen=True, eq=False)
class ClusterEntries:
    """The label rows of clusters (centroids or classifiers) as :func:`candidate_topk` reads them (:meth:`of`): for
    each cluster ``c`` its distinct features, ascending (``features[fstart[c]:fstart[c + 1]]``), and for each of
    those (the ``h``-th) the run of its labels' entries ``estart[c] + runs[fstart[c] + c + h]`` to ``estart[c] +
    runs[fstart[c] + c + h + 1]`` (a cluster's runs from its first entry, one more than its features): ``slot``
    the label's position in its cluster (ascending in a run; int16 where the clusters allow), ``value`` the
    weight. ``n_features``: the rows' width. 8 bytes a feature of a cluster and 6 an entry: at 1M labels 0.96 GB
    against 0.70 for the CSR rows."""

    features: np.ndarray
    fstart: np.ndarray
    runs: np.ndarray
    estart: np.ndarray
    slot: np.ndarray
    value: np.ndarray
    n_features: int

    @classmethod
    def of(cls, W: sp.csr_matrix, offsets: np.ndarray) -> ClusterEntries:
        """The entries of ``W``'s rows (in cluster order: cluster ``c`` is rows ``offsets[c]:offsets[c + 1]``)."""
        W = sp.csr_matrix(W)
        offsets = np.asarray(offsets, np.int64)
        widest = int(np.diff(offsets).max(initial=0))
        slot = np.empty(int(W.indptr[offsets[-1]] - W.indptr[offsets[0]]),
                        np.int16 if widest <= np.iinfo(np.int16).max + 1 else np.int32)
        features, fstart, runs, estart, value = _compiled("_entries_of")(
            W.indptr.astype(np.int64, copy=False), W.indices, W.data, offsets, int(W.shape[1]), slot)
        return cls(features, fstart, runs, estart, slot, value, n_features=int(W.shape[1]))

    @classmethod
    def empty(cls, n_clusters: int, n_features: int) -> ClusterEntries:
        return cls(np.zeros(0, np.int32), np.zeros(n_clusters + 1, np.int64), np.zeros(n_clusters, np.int32),
                   np.zeros(n_clusters + 1, np.int64), np.zeros(0, np.int16), np.zeros(0, np.float32),
                   n_features=int(n_features))

    @property
    def nbytes(self) -> int:
        return int(sum(a.nbytes for a in (self.features, self.fstart, self.runs, self.estart, self.slot,
                                          self.value)))

    #: bytes of an entry at most (a cluster's feature an entry): its slot (int16 or int32) and value, its
    #: feature's id and run
    ENTRY_BYTES = 4 + 4 + 4 + 4


def _topk_by_rows(x_indptr, x_indices, x_data, pair_ptr, pair_rows, offsets, order,  # pragma: no cover
                  w_features, w_fstart, w_runs, w_estart, w_slot, w_value, v_features, v_fstart, v_runs, v_estart,
                  v_slot, v_value, bias, weight, n_features, row_entries, row_slots, k, threshold):
    n = len(x_indptr) - 1
    labels = np.full((n, k), -1, np.int64)
    scores = np.full((n, k), -np.inf)
    loc = np.full(n_features, -1, np.int32)  # 4 bytes an entry: the table a cluster's features look up
    bits = np.zeros((n_features + 63) >> 6, np.uint64)  # and a bit a feature, looked up first (in cache)
    feats = np.empty(row_entries, np.int32)
    ptr = np.zeros(row_entries + 1, np.int64)
    slot = np.empty(row_entries, np.int32)
    value = np.empty(row_entries, np.float32)
    acc = np.empty(max(row_slots, 1))
    sources = 2 if weight != 0.0 else 1
    one = np.uint64(1)
    for c in range(len(offsets) - 1):
        a, b = offsets[c], offsets[c + 1]
        width = b - a
        if width == 0:
            continue
        step = max(1, row_slots // width)  # the cluster's rows a batch at a time: acc holds width x batch scores
        for p0 in range(pair_ptr[c], pair_ptr[c + 1], step):
            p1 = min(p0 + step, pair_ptr[c + 1])
            m = p1 - p0
            # the batch's features, numbered in order of appearance, and how many of its rows have each
            nf = 0
            for s in range(m):
                i = pair_rows[p0 + s]
                for q in range(x_indptr[i], x_indptr[i + 1]):
                    f = x_indices[q]
                    if loc[f] < 0:
                        loc[f] = nf
                        feats[nf] = f
                        ptr[nf + 1] = 0
                        bits[f >> 6] |= one << np.uint64(f & 63)
                        nf += 1
                    ptr[loc[f] + 1] += 1
            ptr[0] = 0
            for t in range(nf):
                ptr[t + 1] += ptr[t]
            for s in range(m):  # the rows' entries feature-major: (row slot in the batch, value)
                i = pair_rows[p0 + s]
                for q in range(x_indptr[i], x_indptr[i + 1]):
                    t = loc[x_indices[q]]
                    slot[ptr[t]] = s
                    value[ptr[t]] = x_data[q]
                    ptr[t] += 1
            for t in range(nf - 1, -1, -1):  # the fill moved each pointer to its feature's end: back to the starts
                ptr[t + 1] = ptr[t]
            ptr[0] = 0
            for j in range(width):
                init = weight * bias[a + j] if sources == 2 else 0.0
                for s in range(m):
                    acc[j * m + s] = init
            ascending = np.empty(0, np.int64)
            for source in range(sources):
                features, fstart, runs, estart, eslot, evalue = \
                    (w_features, w_fstart, w_runs, w_estart, w_slot, w_value) if source == 0 else \
                    (v_features, v_fstart, v_runs, v_estart, v_slot, v_value)
                scale = 1.0 if source == 0 else weight
                floor = threshold if source == 0 else 0.0  # centroid entries below it are left out
                u0, u1 = fstart[c], fstart[c + 1]
                # the cluster's features that the batch has: looked up one by one (bisection) where the batch has
                # few against the cluster's, else all of the cluster's scanned; features ascending either way
                probe = nf * (np.log2(u1 - u0 + 1.0) + 1.0) < u1 - u0
                if probe and len(ascending) != nf:
                    ascending = np.argsort(feats[:nf])
                lo = u0
                for h in range(nf if probe else u1 - u0):
                    if probe:
                        t = ascending[h]
                        f = feats[t]
                        z = u1
                        while lo < z:
                            mid = (lo + z) >> 1
                            if features[mid] < f:
                                lo = mid + 1
                            else:
                                z = mid
                        if lo >= u1:
                            break
                        if features[lo] != f:
                            continue
                        u = lo
                    else:
                        u = u0 + h
                        f = features[u]
                        if not (bits[f >> 6] >> np.uint64(f & 63)) & one:
                            continue
                        t = loc[f]
                    # the feature's (label entry, row entry) products: the shorter of the two lists outside, so
                    # that the inner loop's exits (a mispredicted branch each) are the fewer; each score still
                    # gets its terms in ascending feature order, one a feature
                    e0, e1 = estart[c] + runs[u + c], estart[c] + runs[u + c + 1]
                    if ptr[t + 1] - ptr[t] < e1 - e0:
                        for r in range(ptr[t], ptr[t + 1]):
                            xv, s = value[r], slot[r]
                            for e in range(e0, e1):
                                if abs(evalue[e]) >= floor:
                                    acc[eslot[e] * m + s] += (scale * evalue[e]) * xv
                    else:
                        for e in range(e0, e1):
                            if abs(evalue[e]) < floor:
                                continue
                            wv = scale * evalue[e]
                            base = eslot[e] * m
                            for r in range(ptr[t], ptr[t + 1]):
                                acc[base + slot[r]] += wv * value[r]
            for s in range(m):
                i = pair_rows[p0 + s]
                last = scores[i, k - 1]
                for j in range(width):  # into the row's best, kept sorted: score descending, then the smaller label
                    sc = acc[j * m + s]
                    if sc < last:
                        continue
                    lab = order[a + j]
                    if sc > last or labels[i, k - 1] < 0 or lab < labels[i, k - 1]:
                        last = _insert(labels, scores, i, sc, lab)
            for t in range(nf):
                loc[feats[t]] = -1
                bits[feats[t] >> 6] = 0
    return labels, scores


def candidate_topk(X: sp.csr_matrix, rows: np.ndarray, clusters: np.ndarray, W, order: np.ndarray,
                   offsets: np.ndarray, k: int, *, V=None, bias: np.ndarray | None = None,
                   weight: float = 0.0, threshold: float = 0.0) -> tuple[np.ndarray, np.ndarray]:
    """Top-``k`` labels (-1 where a row has fewer candidates) and scores (-inf there) of the rows of ``X`` among
    the labels of their clusters, best first, ties to the smaller label id.

    Row ``rows[t]`` scores the labels of cluster ``clusters[t]``: ``order[offsets[c]:offsets[c + 1]]``, whose
    centroids are those rows of ``W`` (and classifiers those of ``V``, biases of ``bias``); a label's score is
    ``X[i] . W[j]``, plus ``weight * (X[i] . V[j] + bias[j])`` when ``weight`` is not 0. A row names a cluster once.
    ``threshold``: the entries of ``W`` below it in absolute value are left out (as :func:`prune_rows` drops them).
    ``W`` and ``V``: CSR matrices, or their :class:`ClusterEntries` (made once for the calls that share them).

    The clusters are taken one at a time and the rows that chose one a batch at a time: the batch's entries turned
    feature-major, then the cluster's features that the batch has are found, by bisection where the batch has few
    features against the cluster (a block of few rows), else by a scan of all the cluster's features, and their
    entries add into the batch's scores. Scanning each label's entries instead (the clusters' rows as stored) cost
    a row every entry of its clusters over the rows of the block that share them (at 1M labels 554 us a row in
    blocks of 200 rows, 159 in blocks of 5,000, beam 10: :mod:`bench.predict_phases`).
    """
    X = sp.csr_matrix(X)
    rows, clusters = np.asarray(rows, np.int64), np.asarray(clusters, np.int64)
    offsets = np.asarray(offsets, np.int64)
    n_clusters = len(offsets) - 1
    if not isinstance(W, ClusterEntries):
        W = ClusterEntries.of(W, offsets)
    by_cluster = np.argsort(clusters, kind="stable")
    pair_ptr = np.searchsorted(clusters[by_cluster], np.arange(len(offsets)))
    weight = float(weight)
    if not weight or V is None:
        V, bias, weight = ClusterEntries.empty(n_clusters, W.n_features), np.zeros(0), 0.0
    elif not isinstance(V, ClusterEntries):
        V = ClusterEntries.of(V, offsets)
    bias = np.asarray(bias, np.float64)
    pair_rows = rows[by_cluster]
    row_entries = np.append(np.diff(X.indptr)[pair_rows], 0)  # a cluster's rows' entries: the largest batch's bound
    per_cluster = np.add.reduceat(row_entries, pair_ptr[:-1]) if len(pair_rows) else np.zeros(1, np.int64)
    per_cluster = np.where(np.diff(pair_ptr) > 0, per_cluster, 0)
    width = int(np.diff(offsets).max()) if len(offsets) > 1 else 1
    return _compiled()(X.indptr, X.indices, X.data, pair_ptr, pair_rows, offsets, np.asarray(order, np.int64),
                       W.features, W.fstart, W.runs, W.estart, W.slot, W.value, V.features, V.fstart, V.runs,
                       V.estart, V.slot, V.value, bias, weight, int(max(X.shape[1], W.n_features, V.n_features)),
                       int(per_cluster.max(initial=0)), max(ROW_SLOTS, width), int(k), float(threshold))


def prune_rows(W: sp.csr_matrix, threshold: float, *, piece_entries: int = 1 << 24) -> sp.csr_matrix:
    """``W`` without its entries below ``threshold`` in absolute value (its rows not rescaled), a piece of rows of
    about ``piece_entries`` entries at a time (the temporaries of a piece, not of the whole: 188 M entries at 1M
    labels)."""
    W = sp.csr_matrix(W)
    if threshold <= 0 or not W.nnz:
        return W
    cuts = np.unique(np.r_[np.searchsorted(W.indptr, np.arange(0, W.nnz, piece_entries), side="right") - 1,
                           W.shape[0]])
    data, indices, lengths = [], [], []
    for a, b in zip(cuts[:-1], cuts[1:]):
        lo, hi = W.indptr[a], W.indptr[b]
        keep = np.abs(W.data[lo:hi]) >= threshold
        rows = np.repeat(np.arange(b - a), np.diff(W.indptr[a:b + 1]))[keep]
        data.append(W.data[lo:hi][keep])
        indices.append(W.indices[lo:hi][keep])
        lengths.append(np.bincount(rows, minlength=b - a))
    indptr = np.concatenate([[0], np.cumsum(np.concatenate(lengths))]).astype(W.indptr.dtype)
    return sp.csr_matrix((np.concatenate(data), np.concatenate(indices), indptr), shape=W.shape)
