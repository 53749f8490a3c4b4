"""Block kernels of the spectral label tree: pure NumPy/SciPy functions of one row block.

A row block ``Xb`` (CSR or dense, ``(b, d)``) with its labels ``Yb`` (CSR, ``(b, L)``) is routed
through the tree grown so far, which gives the block's *pairs* ``(row, node, p)``: every row with
every terminal node (a leaf or a node of the frontier still to be learned) it reaches with path
probability ``p > cutoff``. Every per-level partial sum is keyed by node: a kernel receives the
group of frontier nodes it accumulates (``nodes``, global ids, whose position is the local index
``j``) and returns one dense array with a leading axis of ``len(nodes)``.

The tree so far is two dense arrays: ``table`` of shape ``(n_nodes, 5)`` holding per node
``left, right, router, bias, sigma`` (``left = right = -1`` for a terminal node, ``router`` the
row of ``W``) and ``W`` of shape ``(n_routers, d)``: dense, or CSR while the tree grows (a router lives on
its node's features).

While the tree grows, every per-node vector lives on the node's own *slots*, not on all ``d`` features or
``L`` labels: sorted keys ``j d + feature`` (``j L + label``) for the features (labels) of the rows that
reach node ``j``, as a group's partial sums would otherwise take ``g (d + L)`` entries whatever the
nodes' sizes (text data: ``d`` in the hundred thousands, a deep node's rows a few hundred features).

References
----------
Mineiro and Karampatziakis, "A Hierarchical Spectral Method for Extreme Classification" (2015):
eq. (2) (node objective), section 3.4 (fractional routing), Algorithm 1 (prediction).
"""

from __future__ import annotations

import numpy as np
import scipy.sparse as sp
from scipy.special import erf

#: ``table`` columns
LEFT, RIGHT, ROUTER, BIAS, SIGMA = range(5)
TABLE_COLUMNS = 5

#: rows whose path probability is at most this are dropped from a node (the reference code's 1e-4)
CUTOFF = 1e-4
#: most stored entries of ``X`` gathered for one chunk of pairs, and most pairs in one chunk: a kernel's
#: memory is bounded whatever the number of nodes a row reaches under fractional routing (a chunk's
#: gathered rows take about 24 MiB, its ``(pairs, r)`` products about 10 MiB)
PAIR_NNZ, PAIR_CHUNK = 1 << 21, 1 << 17


def as_csr(Xb) -> sp.csr_matrix:
    """A row block as CSR (dense blocks converted), with sorted indices not required."""
    return sp.csr_matrix(Xb)


def routing_probability(t: np.ndarray, bias: np.ndarray, sigma: np.ndarray, *, deterministic: bool,
                        form: str = "code") -> np.ndarray:
    """Probability of going left (``w^T x > b``) at a node.

    Parameters
    ----------
    t : ndarray, shape (m,)
        Projections ``w^T x``.
    bias, sigma : ndarray, shape (m,)
        The node's bias ``b`` and routing width ``sigma``.
    deterministic : bool
        1 where ``t > b``, else 0.
    form : {"code", "paper"}
        ``"code"``: ``0.5 + 0.5 erf((t - b) / sigma)`` (the reference code); ``"paper"``:
        ``Phi((t - b) / sigma)``. The width itself is chosen when the node is learned.

    Returns
    -------
    ndarray, shape (m,)
    """
    if deterministic:
        return (t > bias).astype(np.float64)
    z = (t - bias) / sigma
    if form == "paper":
        z = z / np.sqrt(2.0)
    return 0.5 + 0.5 * erf(z)


def pair_chunks(X, rows: np.ndarray):
    """Slices of ``rows`` (the pairs' rows of the block ``X``) whose rows hold at most about
    :data:`PAIR_NNZ` stored entries each, and at most :data:`PAIR_CHUNK` rows."""
    if not len(rows):
        return []
    counts = np.diff(as_csr(X).indptr)[rows] if sp.issparse(X) else np.full(len(rows), X.shape[1])
    cum = np.cumsum(counts)
    cuts = np.searchsorted(cum, np.arange(PAIR_NNZ, cum[-1], PAIR_NNZ), side="right")
    bounds = np.unique(np.concatenate([[0], cuts, np.arange(PAIR_CHUNK, len(rows), PAIR_CHUNK), [len(rows)]]))
    return [slice(a, b) for a, b in zip(bounds[:-1], bounds[1:])]


def pair_dots(X: sp.csr_matrix, rows: np.ndarray, W: np.ndarray, widx: np.ndarray) -> np.ndarray:
    """``x_rows[i] . W[widx[i]]`` for every pair ``i`` (float64), shape ``(m,)``; ``W`` of shape ``(n, d)``,
    dense or CSR."""
    chunks = pair_chunks(X, rows)
    if len(chunks) > 1:
        return np.concatenate([pair_dots(X, rows[c], W, widx[c]) for c in chunks])
    sub = X[rows]
    counts = np.diff(sub.indptr)
    vals = sub.data.astype(np.float64)
    if sp.issparse(W):  # CSR routers: each stored entry of a pair's row looked up in its router
        contrib = vals * router_entries(W, np.repeat(widx, counts), sub.indices)
        return np.bincount(np.repeat(np.arange(len(rows)), counts), weights=contrib, minlength=len(rows))
    contrib = vals * W[np.repeat(widx, counts), sub.indices]
    return np.bincount(np.repeat(np.arange(len(rows)), counts), weights=contrib, minlength=len(rows))


def router_entries(W: sp.csr_matrix, routers: np.ndarray, features: np.ndarray) -> np.ndarray:
    """``W[routers[i], features[i]]`` for CSR ``W`` (0 where not stored), float64.

    One binary search per entry, the queries sorted, in the sorted keys ``router d + feature`` of ``W``'s
    entries (kept on ``W`` for the next call: the same scattered routers serve every block of a pass).
    SciPy's ``W[rows, cols]`` scans a row's entries per query: 70x slower for routers of 25,000 features.
    """
    keys = getattr(W, "_xmldask_keys", None)
    if keys is None:
        if not W.has_sorted_indices:
            W.sort_indices()
        keys = np.repeat(np.arange(W.shape[0], dtype=np.int64), np.diff(W.indptr)) * W.shape[1] + W.indices
        W._xmldask_keys = keys
    out = np.zeros(len(routers))
    if not len(keys) or not len(routers):
        return out
    want = np.asarray(routers, dtype=np.int64) * W.shape[1] + features
    order = np.argsort(want, kind="stable")
    pos = np.minimum(np.searchsorted(keys, want[order]), len(keys) - 1)
    hit = keys[pos] == want[order]
    out[order[hit]] = W.data[pos[hit]]
    return out


def route_pairs(Xb, table: np.ndarray, W: np.ndarray, *, deterministic: bool = False, form: str = "code",
                cutoff: float = CUTOFF, rng: np.random.Generator | None = None):
    """Route a row block from the root to the terminal nodes of the tree.

    Parameters
    ----------
    Xb : sparse or ndarray, shape (b, d)
    table : ndarray, shape (n_nodes, 5)
        ``left, right, router, bias, sigma`` per node (node 0 is the root).
    W : ndarray, shape (n_routers, d)
    deterministic : bool
        Left iff ``w^T x > b`` (path probabilities 0 or 1).
    form : {"code", "paper"}
        Routing probability (:func:`routing_probability`).
    cutoff : float
        Pairs with path probability at most ``cutoff`` are dropped (fractional routing).
    rng : numpy.random.Generator, optional
        Randomized routing: one uniform draw against the routing probability at every internal
        node (each row then reaches exactly one terminal node).

    Returns
    -------
    rows : ndarray of int64, shape (m,)
    nodes : ndarray of int64, shape (m,)
        Terminal node of each pair.
    p : ndarray of float64, shape (m,)
        Path probability (1 under deterministic or randomized routing).
    """
    X, W = as_csr(Xb), unwrap(W)
    n = X.shape[0]
    rows, nodes, p = np.arange(n, dtype=np.int64), np.zeros(n, dtype=np.int64), np.ones(n)
    done_r, done_n, done_p = [], [], []
    while len(rows):
        left = table[nodes, LEFT].astype(np.int64)
        terminal = left < 0
        done_r.append(rows[terminal])
        done_n.append(nodes[terminal])
        done_p.append(p[terminal])
        rows, nodes, p = rows[~terminal], nodes[~terminal], p[~terminal]
        if not len(rows):
            break
        node_rows = table[nodes]
        t = pair_dots(X, rows, W, node_rows[:, ROUTER].astype(np.int64))
        q = routing_probability(t, node_rows[:, BIAS], node_rows[:, SIGMA], deterministic=deterministic, form=form)
        if rng is not None:
            q = (rng.random(len(q)) < q).astype(np.float64)
        lchild, rchild = node_rows[:, LEFT].astype(np.int64), node_rows[:, RIGHT].astype(np.int64)
        pl, pr = p * q, p * (1.0 - q)
        keep_l, keep_r = pl > cutoff, pr > cutoff
        rows = np.concatenate([rows[keep_l], rows[keep_r]])
        nodes = np.concatenate([lchild[keep_l], rchild[keep_r]])
        p = np.concatenate([pl[keep_l], pr[keep_r]])
    rows, nodes, p = np.concatenate(done_r), np.concatenate(done_n), np.concatenate(done_p)
    order = np.lexsort((nodes, rows))
    return rows[order], nodes[order], p[order]


def root_pairs(n_rows: int):
    """The frontier of an unsplit tree: every row at the root with path probability 1."""
    return np.arange(n_rows, dtype=np.int64), np.zeros(n_rows, dtype=np.int64), np.ones(n_rows)


def frontier(pairs, n_rows: int):
    """``(rows, nodes, p)`` of a block's frontier pairs, sorted by node then row (the root's when ``pairs`` is
    None; a level-state operand arrives as a one-item object array)."""
    return root_pairs(n_rows) if pairs is None else unwrap(pairs)


def _local_pairs(pairs, n_rows, nodes):
    """The frontier pairs at the group's nodes: rows, local node index ``j`` (sorted), ``p`` (float64)."""
    rows, at, p = frontier(pairs, n_rows)
    nodes = np.asarray(nodes, dtype=np.int64)
    local = np.full(int(max(at.max(initial=0), nodes.max(initial=0))) + 1, -1, dtype=np.int64)
    local[nodes] = np.arange(len(nodes))
    j = local[at]
    keep = j >= 0
    return rows[keep], j[keep], p[keep].astype(np.float64)


def _segments(key: np.ndarray):
    """``(key, start, stop)`` of every run of equal values in ``key`` (pairs sorted by it)."""
    if not len(key):
        return []
    cuts = np.flatnonzero(np.diff(key)) + 1
    starts, stops = np.concatenate([[0], cuts]), np.concatenate([cuts, [len(key)]])
    return zip(key[starts].tolist(), starts.tolist(), stops.tolist())


def node_products(X: sp.csr_matrix, rows: np.ndarray, key: np.ndarray, M: np.ndarray) -> np.ndarray:
    """``x_rows[i] . M[key[i]]`` for pairs sorted by ``key``: one sparse product per run of equal keys
    (dense ``M`` of shape ``(g, d)``; :func:`pair_dots` for CSR), float64, shape ``(m,)``.

    (Measured on ALOI's row blocks, 24 % filled: as fast as dense BLAS products on gathered rows,
    without the dense copy.)
    """
    if sp.issparse(M):  # CSR routers
        return pair_dots(X, rows, M, key)
    out = np.empty(len(rows))
    for k, a, b in _segments(key):
        out[a:b] = X[rows[a:b]] @ M[k].astype(np.float64, copy=False)
    return out


def unwrap(value):
    """A whole operand shipped in a 0-d object array (a CSR ``W``, a level-state block): the object."""
    return value.item() if isinstance(value, np.ndarray) and value.dtype == object else value


def slot_offsets(slots: np.ndarray, g: int, width: int) -> np.ndarray:
    """Where each local node's slots start in ``slots`` (sorted keys ``j width + i``), shape (g + 1,)."""
    return np.searchsorted(slots, np.arange(g + 1, dtype=np.int64) * width)


def local_columns(Xs: sp.csr_matrix, support: np.ndarray) -> sp.csr_matrix:
    """``Xs[:, support]`` for rows whose features all lie in ``support`` (sorted): their columns renumbered,
    nothing copied but the column ids."""
    Xs = sp.csr_matrix(Xs)
    return sp.csr_matrix((Xs.data, np.searchsorted(support, Xs.indices), Xs.indptr),
                         shape=(Xs.shape[0], len(support)))


def _on_support(Xs: sp.csr_matrix, support: np.ndarray) -> sp.csr_matrix:
    """:func:`local_columns`, or ``Xs`` itself when ``support`` is every column."""
    return Xs if len(support) == Xs.shape[1] else local_columns(Xs, support)


def _to_slots(keys: np.ndarray, slots: np.ndarray, what: str) -> np.ndarray:
    """Positions of ``keys`` in the sorted ``slots``; every key must be one (a node's rows use only the
    features and labels of its parent's rows)."""
    pos = np.searchsorted(slots, keys)
    bad = pos >= len(slots)
    bad[~bad] = slots[pos[~bad]] != keys[~bad]
    if bad.any():
        raise AssertionError(f"{int(bad.sum())} {what} outside their node's slots")
    return pos


def _label_pairs(Yb, rows: np.ndarray, j: np.ndarray, p: np.ndarray):
    """Expand pairs by the labels of their row: pair index, ``j``, label and ``p`` per (pair, label)."""
    Y = sp.csr_matrix(Yb)
    sub = Y[rows]
    counts = np.diff(sub.indptr)
    pair = np.repeat(np.arange(len(rows)), counts)
    return pair, j[pair], sub.indices.astype(np.int64), p[pair]


def support_products(X: sp.csr_matrix, rows: np.ndarray, key: np.ndarray, M: np.ndarray, slots: np.ndarray,
                     offsets: np.ndarray, width: int) -> np.ndarray:
    """``x_rows[i] @ M_k`` for pairs sorted by ``key``, where node ``k``'s ``M_k`` lives on its feature slots
    (``M[offsets[k]:offsets[k + 1]]``, rows of ``slots`` keyed ``k width + feature``): one sparse product
    per node on its own columns, float64, shape ``(m,)`` or ``(m, r)`` as ``M`` is 1-D or 2-D."""
    out = np.empty((len(rows),) + M.shape[1:])
    for k, a, b in _segments(key):
        lo, hi = offsets[k], offsets[k + 1]
        local = _on_support(X[rows[a:b]], slots[lo:hi] - k * width)
        out[a:b] = np.asarray(local @ M[lo:hi].astype(np.float64, copy=False)).reshape(out[a:b].shape)
    return out


def level_stats(Xb, Yb, fslots, lslots, nodes, pairs=None):
    """Per node of the group: ``m = sum p``, ``mu = sum p x`` and ``a = sum p [x stored]`` on its feature
    slots ``fslots`` (whose nonzero ``a`` are the node's features: those its rows store, zeros too), and the
    label masses ``n_c = sum p y_c`` on its label slots ``lslots`` (sorted keys ``j d + feature``,
    ``j L + label``; a parent's slots hold its children's).

    ``pairs`` is the block's frontier (:func:`frontier`). Returns float64, shape
    ``(g + 2 len(fslots) + len(lslots),)``: ``[m (g), mu, a, n]`` (one block's partial sum).
    """
    g, (b, d), L = len(nodes), Xb.shape, Yb.shape[1]
    X = as_csr(Xb)
    nf = len(fslots)
    rows, j, p = _local_pairs(pairs, b, nodes)
    out = np.zeros(g + 2 * nf + len(lslots))
    out[:g] = np.bincount(j, weights=p, minlength=g)
    stored = sp.csr_matrix((np.ones(len(X.data)), X.indices, X.indptr), shape=X.shape)
    for c in pair_chunks(X, rows):
        P = sp.csr_matrix((p[c], (j[c], rows[c])), shape=(g, b))
        for i, M in enumerate((X, stored)):
            prod = sp.coo_matrix(P @ M)
            at = _to_slots(prod.row.astype(np.int64) * d + prod.col, fslots, "features")
            out[g + i * nf + at] += prod.data
    _, jl, labels, pl = _label_pairs(Yb, rows, j, p)
    at = _to_slots(jl * L + labels, lslots, "labels")
    out[g + 2 * nf:] = np.bincount(at, weights=pl, minlength=len(lslots))
    return out


def _slot_pairs(Yb, rows, j, p, slots):
    """Expand pairs by their row's labels: pair index, slot (position of ``j L + label`` in ``slots``), ``p``."""
    pair, jl, labels, pl = _label_pairs(Yb, rows, j, p)
    return pair, np.searchsorted(slots, jl * Yb.shape[1] + labels), pl


def level_yt_x(Xb, Yb, Omega, xslots, slots, nodes, pairs=None):
    """``T_j = Y^T D_j X Omega_j`` for every node ``j`` of the group, at its label slots.

    ``Omega`` has shape ``(len(xslots), r)``: each node's block on its feature slots ``xslots`` (sorted
    ``j d + feature``); ``slots`` (sorted ``j L + label``) lists the (node, label) pairs with label mass,
    which every (pair, label) of the frontier is. Returns float64 ``(n_slots, r)``.
    """
    r = Omega.shape[1]
    X = as_csr(Xb)
    d = X.shape[1]
    rows, j, p = _local_pairs(pairs, Xb.shape[0], nodes)
    xoff = slot_offsets(xslots, len(nodes), d)
    out = np.zeros((len(slots), r))
    for c in pair_chunks(X, rows):
        xo = support_products(X, rows[c], j[c], Omega, xslots, xoff, d)  # (m, r)
        pair, slot, pl = _slot_pairs(Yb, rows[c], j[c], p[c], slots)
        out += sp.csr_matrix((pl, (slot, pair)), shape=(len(slots), len(xo))) @ xo
    return out


def _pairs_times_v(Yb, rows, j, p, V, slots):
    """``p_i (Y_i V_j)`` per pair (``V`` per slot, ``(n_slots, r)``), shape (m, r)."""
    pair, slot, _ = _slot_pairs(Yb, rows, j, p, slots)
    gather = sp.csr_matrix((np.ones(len(pair)), (pair, slot)), shape=(len(rows), len(slots)))
    return np.asarray(gather @ V) * p[:, None]


def level_xt_y(Xb, Yb, V, slots, xslots, nodes, pairs=None):
    """``Z_j = X^T D_j Y V_j`` for every node ``j`` of the group on its feature slots ``xslots``; ``V`` per
    label slot ``(n_slots, r)``; float64 ``(len(xslots), r)``."""
    g, d, r = len(nodes), Xb.shape[1], V.shape[1]
    X = as_csr(Xb)
    rows, j, p = _local_pairs(pairs, Xb.shape[0], nodes)
    xoff = slot_offsets(xslots, g, d)
    out = np.zeros((len(xslots), r))
    for c in pair_chunks(X, rows):
        yv = _pairs_times_v(Yb, rows[c], j[c], p[c], V, slots)
        rc = rows[c]
        for k, a, b in _segments(j[c]):
            lo, hi = xoff[k], xoff[k + 1]
            out[lo:hi] += np.asarray(_on_support(X[rc[a:b]], xslots[lo:hi] - k * d).T @ yv[a:b])
    return out


def level_yt_y(Xb, Yb, V, slots, nodes, pairs=None):
    """``Y^T D_j Y V_j`` for every node ``j`` of the group (one CG matrix product), per slot; float64
    ``(n_slots, r)``."""
    rows, j, p = _local_pairs(pairs, Xb.shape[0], nodes)
    out = np.zeros(V.shape)
    for c in pair_chunks(Xb, rows):
        yv = _pairs_times_v(Yb, rows[c], j[c], p[c], V, slots)
        pair, slot, _ = _slot_pairs(Yb, rows[c], j[c], p[c], slots)
        out += sp.csr_matrix((np.ones(len(pair)), (slot, pair)), shape=(len(slots), len(yv))) @ yv
    return out


def level_label_gram(Xb, Yb, slots, offsets, nodes, pairs=None):
    """Every node's ``Y^T D_j Y`` on its slots, its blocks flattened one after the other.

    The slots of local node ``j`` are ``slots[offsets[j]:offsets[j + 1]]`` (``n_j`` of them); its block
    is ``n_j x n_j``, row-major, after the blocks of the nodes before it. Returns float64, shape
    ``(sum_j n_j^2,)``: one pass for what the CG solves would otherwise read at every iteration.
    """
    sizes = np.diff(offsets)
    starts = np.concatenate([[0], np.cumsum(sizes * sizes)])
    node_of = np.repeat(np.arange(len(sizes)), sizes)
    rows, j, p = _local_pairs(pairs, Xb.shape[0], nodes)
    out = np.zeros(int(starts[-1]))
    for c in pair_chunks(Xb, rows):
        pair, slot, pl = _slot_pairs(Yb, rows[c], j[c], p[c], slots)
        A = sp.csr_matrix((np.ones(len(pair)), (pair, slot)), shape=(len(rows[c]), len(slots)))
        G = (A.T @ sp.csr_matrix(A.multiply(p[c][:, None]))).tocoo()  # a pair's slots share its node
        k = node_of[G.row]
        at = starts[k] + (G.row - offsets[k]) * sizes[k] + (G.col - offsets[k])
        out += np.bincount(at, weights=G.data, minlength=len(out))
    return out


def level_histogram(Xb, w, lo, hi, xslots, nodes, pairs=None, *, bins):
    """Weighted histogram of ``w_j^T x`` per node over ``bins`` equal bins of ``[lo_j, hi_j)``; ``w`` on the
    nodes' feature slots ``xslots``.

    Returns an array of float64, shape ``(g, bins + 2)``: column 0 the weight below ``lo_j``, columns
    ``1..bins`` the bins, the last the weight at or above ``hi_j``.
    """
    g = len(nodes)
    X = as_csr(Xb)
    rows, j, p = _local_pairs(pairs, Xb.shape[0], nodes)
    xoff = slot_offsets(xslots, g, X.shape[1])
    out = np.zeros(g * (bins + 2))
    for c in pair_chunks(X, rows):
        jc = j[c]
        t = support_products(X, rows[c], jc, w, xslots, xoff, X.shape[1])
        width = (hi[jc] - lo[jc]) / bins
        k = np.floor((t - lo[jc]) / np.where(width > 0, width, 1.0)).astype(np.int64) + 1
        k = np.clip(k, 0, bins + 1)
        k[t < lo[jc]] = 0
        k[t >= hi[jc]] = bins + 1
        out += np.bincount(jc * (bins + 2) + k, weights=p[c], minlength=g * (bins + 2))
    return out.reshape(g, bins + 2)


def advance(Xb, table, W, pairs=None, *, form="code", deterministic=False, cutoff=CUTOFF):
    """The block's frontier one level down: pairs at nodes just split move to their children (path
    probability times the routing probability, dropped at ``cutoff`` or below); pairs at nodes that
    stayed leaves are dropped. Returns the new frontier as a 0-d object array (a level-state block)."""
    X, W = as_csr(Xb), unwrap(W)
    rows, at, p = frontier(pairs, Xb.shape[0])
    node_rows = table[at]
    split = node_rows[:, LEFT] >= 0
    rows, at, p, node_rows = rows[split], at[split], p[split], node_rows[split]
    new_r, new_n, new_p = [], [], []
    for c in pair_chunks(X, rows):
        router = node_rows[c, ROUTER].astype(np.int64)
        t = node_products(X, rows[c], router, W)
        q = routing_probability(t, node_rows[c, BIAS], node_rows[c, SIGMA], deterministic=deterministic, form=form)
        for child, weight in ((LEFT, p[c] * q), (RIGHT, p[c] * (1.0 - q))):
            keep = weight > cutoff
            new_r.append(rows[c][keep])
            new_n.append(node_rows[c, child][keep].astype(np.int64))
            new_p.append(weight[keep])
    rows = np.concatenate(new_r) if new_r else np.zeros(0, np.int64)
    nodes = np.concatenate(new_n) if new_n else np.zeros(0, np.int64)
    p = np.concatenate(new_p) if new_p else np.zeros(0)
    order = np.lexsort((rows, nodes))
    out = np.empty((), dtype=object)
    # 12 bytes a pair (row within the block, node id, p): the state is what fractional routing costs
    out[()] = (rows[order].astype(np.int32), nodes[order].astype(np.int32), p[order].astype(np.float32))
    return out


def row_norm_max(Xb) -> np.ndarray:
    """Largest Euclidean row norm of the block, shape (1,)."""
    X = as_csr(Xb)
    sq = np.asarray(X.multiply(X).sum(axis=1)).ravel() if X.shape[0] else np.zeros(1)
    return np.array([np.sqrt(sq.max(initial=0.0))])


def leaf_label_counts(Xb, Yb, table, W, leaves, labels, *, form="code"):
    """Rows carrying each of ``labels`` that deterministic routing sends to each of ``leaves``.

    Returns
    -------
    ndarray of float64, shape (len(leaves), len(labels))
    """
    X = as_csr(Xb)
    rows, at, _ = route_pairs(X, table, W, deterministic=True, form=form)
    leaf_pos = np.full(table.shape[0], -1, dtype=np.int64)
    leaf_pos[np.asarray(leaves, dtype=np.int64)] = np.arange(len(leaves))
    label_pos = np.full(Yb.shape[1], -1, dtype=np.int64)
    label_pos[np.asarray(labels, dtype=np.int64)] = np.arange(len(labels))
    pair, jl, lab, _ = _label_pairs(Yb, rows, leaf_pos[at], np.ones(len(rows)))
    lp = label_pos[lab]
    keep = (lp >= 0) & (jl >= 0)
    n_leaves, n_labels = len(leaves), len(labels)
    counts = np.bincount(jl[keep] * n_labels + lp[keep], minlength=n_leaves * n_labels)
    return counts.reshape(n_leaves, n_labels).astype(np.float64)


def coverage(Xb, Yb, table, W, cand_indptr, cand_indices, *, form="code"):
    """Per label: rows carrying it (column 0) and those whose deterministic leaf has it (column 1);
    also, for the recall figures, per row the number of true labels covered.

    Returns
    -------
    ndarray of float64, shape (L, 2)
    """
    X = as_csr(Xb)
    L = Yb.shape[1]
    rows, at, _ = route_pairs(X, table, W, deterministic=True, form=form)
    covered = candidate_membership(Yb, rows, at, cand_indptr, cand_indices)
    pair, _, labels, _ = _label_pairs(Yb, rows, at, np.ones(len(rows)))
    out = np.zeros((L, 2))
    out[:, 0] = np.bincount(labels, minlength=L)
    out[:, 1] = np.bincount(labels[covered], minlength=L)
    return out


def candidate_membership(Yb, rows, at, cand_indptr, cand_indices) -> np.ndarray:
    """For every (pair, true label) of ``_label_pairs``: whether the label is a candidate of the pair's node."""
    pair, node, labels, _ = _label_pairs(Yb, rows, at, np.ones(len(rows)))
    L = Yb.shape[1]
    counts = np.diff(cand_indptr)
    keys = np.repeat(np.arange(len(counts), dtype=np.int64), counts) * L + cand_indices
    keys.sort()
    want = node * L + labels
    pos = np.searchsorted(keys, want)
    pos = np.minimum(pos, max(len(keys) - 1, 0))
    return (keys[pos] == want) if len(keys) else np.zeros(len(want), dtype=bool)


def rows_by_node(node_of_row: np.ndarray):
    """``(node, rows)`` for every node present, rows ascending (one sort, not one scan per node)."""
    order = np.argsort(node_of_row, kind="stable")
    nodes, first = np.unique(node_of_row[order], return_index=True)
    return zip(nodes, np.split(order, first[1:]))


def leaf_of(Xb, table, W, *, form="code") -> np.ndarray:
    """The deterministic leaf of every row of the block, shape (b,)."""
    rows, at, _ = route_pairs(Xb, table, W, deterministic=True, form=form)
    out = np.empty(Xb.shape[0], dtype=np.int64)
    out[rows] = at
    return out


def _routed_labels(Xb, Yb, table, W, cand_indptr, cand_indices, form):
    """The block as CSR, every row's deterministic leaf, the row ids, and per (row, true label): the leaf,
    the label and whether the leaf's candidates hold it."""
    X = as_csr(Xb)
    leaf = leaf_of(X, table, W, form=form)
    rows = np.arange(X.shape[0])
    covered = candidate_membership(Yb, rows, leaf, cand_indptr, cand_indices)
    _, node, labels, _ = _label_pairs(Yb, rows, leaf, np.ones(len(rows)))
    return X, leaf, rows, node, labels, covered


def tree_figures(Xb, Yb, table, W, cand_indptr, cand_indices, depth, top_labels, *, form="code"):
    """Sums behind the tree's figures over one block (deterministic routing).

    Returns
    -------
    ndarray of float64, shape (N_FIGURES + 2 L,)
        ``rows, label assignments, covered assignments, depth sum, candidate-count sum, assignments
        covered by the top training labels, rows routed left at the root`` then the label counts
        routed left (L) and right (L) at the root.
    """
    W = unwrap(W)
    X, leaf, rows, _, labels, covered = _routed_labels(Xb, Yb, table, W, cand_indptr, cand_indices, form)
    L = Yb.shape[1]
    top = np.zeros(L, dtype=bool)
    top[np.asarray(top_labels, dtype=np.int64)] = True
    out = np.zeros(N_FIGURES + 2 * L)
    out[:N_FIGURES] = [X.shape[0], len(labels), covered.sum(), depth[leaf].sum(), np.diff(cand_indptr)[leaf].sum(),
                       top[labels].sum(), 0.0]
    if table[0, LEFT] >= 0:
        left = pair_dots(X, rows, W, np.zeros(len(rows), dtype=np.int64)) > table[0, BIAS]
        out[N_FIGURES - 1] = left.sum()
        pair, _, labels, _ = _label_pairs(Yb, rows, leaf, np.ones(len(rows)))
        out[N_FIGURES:N_FIGURES + L] = np.bincount(labels[left[pair]], minlength=L)
        out[N_FIGURES + L:] = np.bincount(labels[~left[pair]], minlength=L)
    return out


#: leading entries of :func:`tree_figures`
N_FIGURES = 7


def leaf_figures(Xb, Yb, table, W, cand_indptr, cand_indices, *, form="code"):
    """Per node, over one block (deterministic routing): rows reaching it, their label assignments and
    the assignments its candidates cover (non-zero at leaves only).

    Returns
    -------
    ndarray of float64, shape (n_nodes, 3)
    """
    _, leaf, _, node, _, covered = _routed_labels(Xb, Yb, table, W, cand_indptr, cand_indices, form)
    n_nodes = table.shape[0]
    out = np.zeros((n_nodes, 3))
    out[:, 0] = np.bincount(leaf, minlength=n_nodes)
    out[:, 1] = np.bincount(node, minlength=n_nodes)
    out[:, 2] = np.bincount(node[covered], minlength=n_nodes)
    return out


def leaf_topk(Xb, table, W, cand_indptr, cand_indices, cand_scores, *, k, form="code"):
    """Top-``k`` candidates of each row's deterministic leaf by their leaf score (the static leaf
    predictor), packed ``[labels (k), scores (k)]`` with ``-1`` / ``-inf`` padding, shape (b, 2k)."""
    leaf = leaf_of(Xb, table, W, form=form)
    b = len(leaf)
    out = np.empty((b, 2 * k))
    out[:, :k], out[:, k:] = -1, -np.inf
    for node, rows in rows_by_node(leaf):
        lo, hi = cand_indptr[node], cand_indptr[node + 1]
        order = np.argsort(-cand_scores[lo:hi], kind="stable")[:k]
        m = len(order)
        out[rows[:, None], np.arange(m)[None, :]] = cand_indices[lo:hi][order]
        out[rows[:, None], k + np.arange(m)[None, :]] = cand_scores[lo:hi][order]
    return out
