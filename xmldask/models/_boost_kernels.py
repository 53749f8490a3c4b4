"""Pure block kernels of gradient boosting with oblivious trees (NumPy/SciPy only, no Dask).

The boosting state of a row block is its binned features ``bins`` (``n_b x d`` uint8, one code per
feature: the number of the feature's borders below the value), its class ``y`` (int32), its scores
``S`` (``n_b x K`` float32), whether it is held out (``held``, bool) and the round's tree targets ``T``
(``n_b x m`` float32: one column per tree grown at once). Every kernel here maps one block's state to
a float64 vector (summed over blocks by the caller) or to a new block of state.

An oblivious tree of depth ``D`` splits every node of level ``l`` on the same (feature, border): a row's
leaf is ``sum_l 2^(D-1-l) [bins[f_l] > b_l]``, i.e. ``[x_f > border_f[b]]`` on the raw value.
"""

from __future__ import annotations

import numpy as np
import scipy.sparse as sp

#: the quantile sample of the binning pass: at most this many values of a block (rows x features)
SAMPLE_VALUES_PER_BLOCK = 1 << 21


# --------------------------------------------------------------------------------------------
# binning


def sample_rows(Xb, *, seed: int, block: int, rows: int):
    """Up to ``rows`` random rows of a block (as CSR), for the quantile borders."""
    n = Xb.shape[0]
    take = np.sort(np.random.default_rng([seed, block]).permutation(n)[:rows]) if rows < n else np.arange(n)
    return sp.csr_matrix(Xb[take] if sp.issparse(Xb) else np.asarray(Xb)[take], dtype=np.float64)


def quantile_borders(sample, max_bins: int) -> list[np.ndarray]:
    """Per feature, at most ``max_bins - 1`` borders (midpoints between distinct values) cutting the
    sample's values, implicit zeros included, into bins of about equal counts."""
    sample = sp.csc_matrix(sample)
    n = sample.shape[0]
    borders = []
    for f in range(sample.shape[1]):
        column = sample.data[sample.indptr[f]:sample.indptr[f + 1]]
        values, counts = np.unique(column, return_counts=True)
        zeros = n - column.size
        if zeros:
            at = np.searchsorted(values, 0.0)
            if at < values.size and values[at] == 0:
                counts[at] += zeros
            else:
                values, counts = np.insert(values, at, 0.0), np.insert(counts, at, zeros)
        if values.size > max_bins:  # cut where the cumulative count crosses each quantile
            cum = np.cumsum(counts)
            cuts = np.unique(np.searchsorted(cum, cum[-1] * np.arange(1, max_bins) / max_bins, side="left"))
            cuts = cuts[cuts < values.size - 1]
            values = np.concatenate([values[cuts], values[-1:]])
        borders.append(((values[:-1] + values[1:]) / 2).astype(np.float64))
    return borders


def bin_block(Xb, borders: list[np.ndarray]) -> np.ndarray:
    """The codes of a block: ``bins[i, f]`` = the number of ``borders[f]`` below ``X[i, f]`` (uint8)."""
    dense = Xb.toarray() if sp.issparse(Xb) else np.asarray(Xb)
    out = np.empty(dense.shape, dtype=np.uint8)
    for f, cut in enumerate(borders):
        out[:, f] = np.searchsorted(cut, dense[:, f], side="left")
    return out


def check_finite(Xb) -> np.ndarray:
    """``[non-finite values, first bad row]`` of a block (``-1`` if none), for the input check."""
    data = Xb.data if sp.issparse(Xb) else np.asarray(Xb)
    bad = ~np.isfinite(data)
    if not bad.any():
        return np.array([0.0, -1.0])
    if sp.issparse(Xb):
        row = np.searchsorted(Xb.indptr, np.flatnonzero(bad)[0], side="right") - 1
    else:
        row = np.flatnonzero(bad.any(axis=1))[0]
    return np.array([float(bad.sum()), float(row)])


def classes_of(Yb) -> np.ndarray:
    """The class of every row of a label block (one label per row), or ``-1 - labels`` where a row has
    ``labels != 1``."""
    Yb = sp.csr_matrix(Yb)
    counts = np.diff(Yb.indptr)
    y = np.full(Yb.shape[0], -1, dtype=np.int64)
    one = counts == 1
    y[one] = Yb.indices[Yb.indptr[:-1][one]]
    y[~one] = -1 - counts[~one]
    return y.astype(np.int32)


def held_out(n: int, *, seed: int, block: int, fraction: float) -> np.ndarray:
    """The block's held-out rows (a seeded coin per row): the same for every backend and every pass."""
    if fraction <= 0:
        return np.zeros(n, dtype=bool)
    return np.random.default_rng([seed, block, 7]).random(n) < fraction


# --------------------------------------------------------------------------------------------
# gradients and factorisation


def softmax(S: np.ndarray) -> np.ndarray:
    Z = S.astype(np.float64) - S.max(axis=1, keepdims=True)
    np.exp(Z, out=Z)
    Z /= Z.sum(axis=1, keepdims=True)
    return Z


def sigmoid(S: np.ndarray) -> np.ndarray:
    return 0.5 * (1.0 + np.tanh(0.5 * S.astype(np.float64)))


def residuals(S: np.ndarray, y: np.ndarray, link: str) -> np.ndarray:
    """The negative gradient of the loss in the scores: ``1[y = j] - p_j`` (float64)."""
    R = -(softmax(S) if link == "softmax" else sigmoid(S))
    R[np.arange(y.size), y] += 1.0
    return R


def losses(S: np.ndarray, y: np.ndarray, link: str) -> np.ndarray:
    """Per row: the negative log-likelihood (softmax: of the class; sigmoid: the sum of the binary ones)."""
    S = S.astype(np.float64)
    rows = np.arange(y.size)
    if link == "softmax":
        top = S.max(axis=1)
        return top + np.log(np.exp(S - top[:, None]).sum(axis=1)) - S[rows, y]
    signs = -np.ones_like(S)
    signs[rows, y] = 1.0
    return np.logaddexp(0.0, -signs * S).sum(axis=1)


def stats(S, y, held, *, link: str, gram: bool, v: np.ndarray | None = None) -> np.ndarray:
    """``[R^T R (K^2, training rows; if gram) or R^T R v and |R|^2 (K + 1; if v), train loss, train rows,
    held-out loss, held-out correct, held-out rows]`` of a block (one softmax of the block's scores)."""
    train = ~held
    if link == "softmax":
        Z = S.astype(np.float64) - S.max(axis=1, keepdims=True)
        E = np.exp(Z)
        total = E.sum(axis=1)
        loss = np.log(total) - Z[np.arange(y.size), y]
        R = -E[train] / total[train, None] if gram or v is not None else None
    else:
        loss = losses(S, y, link)
        R = -sigmoid(S[train]) if gram or v is not None else None
    head = []
    if R is not None:
        R[np.arange(R.shape[0]), y[train]] += 1.0
        head = [(R.T @ R).ravel()] if gram else [R.T @ (R @ v), [np.einsum("ij,ij->", R, R)]]
    correct = S[held].argmax(axis=1) == y[held]
    tail = np.array([loss[train].sum(), train.sum(), loss[held].sum(), correct.sum(), held.sum()])
    return np.concatenate(head + [tail])


def power_step(S, y, held, *, v: np.ndarray, link: str) -> np.ndarray:
    """``R^T (R v)`` over the block's training rows (one step of the power method on ``R^T R``)."""
    train = ~held
    R = residuals(S[train], y[train], link)
    return R.T @ (R @ v)


def targets(S, y, held, *, link: str, newton: bool, v: np.ndarray | None = None,
            en: tuple | None = None) -> np.ndarray:
    """The round's tree targets and their weights, ``[G, H]`` (float32, ``n_b x 2m``, 0 on held-out
    rows). ``G``: the residuals ``R`` (one tree per class), ``R v`` (one tree, GradFac), or its
    Elastic-Net soft threshold ``scale * S(2 R v, a1) / (2 (|v|^2 + a2))`` (``en = (a1, a2, scale)``).
    ``H``: with ``newton``, the curvature of the loss along each tree's output (``p_j (1 - p_j)``, or
    ``v^T (diag(p) - p p^T) v``), else 1 (a leaf's value is then the mean target)."""
    P = softmax(S) if link == "softmax" else sigmoid(S)
    R = -P
    R[np.arange(y.size), y] += 1.0
    if v is None:
        G, H = R, P * (1 - P) if newton else np.ones_like(R)
    else:
        G = R @ v[:, None]
        if en is not None:
            a1, a2, scale = en
            G = scale * soft_threshold(2 * G, a1) / (2 * (float(v @ v) + a2))
        if newton and link == "softmax":
            H = (P @ (v * v))[:, None] - (P @ v)[:, None] ** 2
        elif newton:
            H = (P * (1 - P)) @ (v * v)[:, None]
        else:
            H = np.ones_like(G)
    out = np.concatenate([G, H], axis=1).astype(np.float32)
    out[held] = 0.0
    return out


def max_abs_projection(S, y, held, *, v: np.ndarray, link: str) -> np.ndarray:
    """``max_i |r_i^T v|`` over the block's training rows."""
    train = ~held
    return np.array([np.abs(residuals(S[train], y[train], link) @ v).max(initial=0.0)])


def soft_threshold(z, t):
    return np.sign(z) * np.maximum(np.abs(z) - t, 0.0)


def en_v_step(S, y, held, T, *, link: str) -> np.ndarray:
    """``[R^T u, |u|^2]`` over the training rows, ``u`` the block's targets (the Elastic-Net v-step)."""
    train = ~held
    R = residuals(S[train], y[train], link)
    u = T[train, 0].astype(np.float64)
    return np.concatenate([R.T @ u, [u @ u]])


# --------------------------------------------------------------------------------------------
# oblivious trees


def leaves(bins: np.ndarray, features: np.ndarray, borders: np.ndarray) -> np.ndarray:
    """Leaf of every row in each of ``m`` trees grown so far: ``features``, ``borders``: ``m x levels``
    (int); returns ``n_b x m`` int64."""
    m, depth = features.shape
    leaf = np.zeros((bins.shape[0], m), dtype=np.int64)
    for level in range(depth):
        leaf <<= 1
        leaf += bins[:, features[:, level]] > borders[:, level]
    return leaf


def histograms(bins, T, *, features: np.ndarray, borders: np.ndarray, n_bins: int,
               right_only: bool = False) -> np.ndarray:
    """Sums of the targets and of their weights per (tree, leaf, feature, bin): ``2 x m x 2^level x d
    x n_bins`` flattened (``T = [G, H]``, ``n_b x 2m``, as :func:`targets` writes it: zero on held-out
    rows, which therefore add nothing; ``level`` the levels of ``features``).

    With ``right_only``, only the rows on the right of each tree's last split, per parent leaf
    (``2^(level-1)`` leaves): the left children are the parent's histogram minus these (histogram
    subtraction, half the rows). One ``bincount`` of the rows per (tree, feature, sum): no ``n_b x d``
    temporaries."""
    d = bins.shape[1]
    m = T.shape[1] // 2
    depth = features.shape[1] - (1 if right_only else 0)
    n_leaves = 1 << depth
    size = n_leaves * n_bins
    leaf = leaves(bins, features[:, :depth], borders[:, :depth]) * n_bins
    out = np.empty((2, m, n_leaves, d, n_bins))
    for j in range(m):
        B, offset, g, h = bins, leaf[:, j], T[:, j], T[:, m + j]
        if right_only:
            rows = bins[:, features[j, -1]] > borders[j, -1]
            B, offset, g, h = bins[rows], offset[rows], g[rows], h[rows]
        g, h = g.astype(np.float64), h.astype(np.float64)
        for f in range(d):
            index = offset + B[:, f]
            out[0, j, :, f] = np.bincount(index, weights=g, minlength=size).reshape(n_leaves, n_bins)
            out[1, j, :, f] = np.bincount(index, weights=h, minlength=size).reshape(n_leaves, n_bins)
    return out.ravel()


def children(parent: np.ndarray, right: np.ndarray) -> np.ndarray:
    """The histograms of a level's leaves (``2 x m x 2L x d x bins``, leaf ``2p + bit``) from the
    previous level's (``L`` leaves) and those of the rows right of the new split."""
    return np.stack([parent - right, right], axis=3).reshape(2, right.shape[1], -1, *right.shape[3:])


def best_splits(hist: np.ndarray, n_borders: np.ndarray, l2: float) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Each tree's best (feature, border) for its next level from its histograms of target sums ``G``
    and weight sums ``H`` (``m x leaves x d x bins`` each): the largest sum over leaves of
    ``G_left^2 / (H_left + l2) + G_right^2 / (H_right + l2)``. Returns features, borders, gains."""
    sums, weights = hist
    m, _, d, n_bins = sums.shape
    left_s = np.cumsum(sums, axis=3)[..., :-1]
    left_w = np.cumsum(weights, axis=3)[..., :-1]
    total_s, total_w = sums.sum(axis=3, keepdims=True), weights.sum(axis=3, keepdims=True)
    gain = (left_s ** 2 / (left_w + l2) + (total_s - left_s) ** 2 / (total_w - left_w + l2)).sum(axis=1)
    valid = np.arange(n_bins - 1)[None, :] < n_borders[:, None]  # d x (bins - 1)
    gain = np.where(valid[None], gain, -np.inf).reshape(m, -1)
    best = gain.argmax(axis=1)
    return best // (n_bins - 1), best % (n_bins - 1), gain[np.arange(m), best]


def leaf_values(hist: np.ndarray, features: np.ndarray, borders: np.ndarray, l2: float) -> np.ndarray:
    """The leaf values ``G / (H + l2)`` (``m x 2^depth``) of the trees whose last level is chosen, from
    the histograms of that level (``m x 2^(depth-1) x d x bins``)."""
    sums, weights = hist
    m = sums.shape[0]
    rows = np.arange(m)
    f, b = features[:, -1], borders[:, -1]
    s = sums[rows, :, f, :]  # m x leaves x bins
    w = weights[rows, :, f, :]
    below = np.arange(s.shape[2])[None, None, :] <= b[:, None, None]
    left_s, left_w = np.where(below, s, 0).sum(axis=2), np.where(below, w, 0).sum(axis=2)
    right_s, right_w = s.sum(axis=2) - left_s, w.sum(axis=2) - left_w
    values = np.stack([left_s / (left_w + l2), right_s / (right_w + l2)], axis=2)  # leaf = 2 parent + bit
    return values.reshape(m, -1)


def apply_trees(bins, S, *, features, borders, values, vectors=None, classes=None) -> np.ndarray:
    """The scores after adding the trees (float32): ``S + sum_t values_t[leaf_t(x)] o_t``, the output
    ``o_t`` of a tree its ``vectors`` row (``m x K``, factor trees) or the unit vector of its class
    (``classes``, per-class trees)."""
    leaf = leaves(bins, features, borders)
    H = np.take_along_axis(values, leaf.T, axis=1).T  # n_b x m
    if vectors is not None:
        return (S + H @ vectors).astype(np.float32)
    onehot = sp.csr_matrix((np.ones(len(classes)), (np.arange(len(classes)), classes)),
                           shape=(len(classes), S.shape[1]))
    return (S + (onehot.T @ H.T).T).astype(np.float32)
