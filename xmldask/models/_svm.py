"""Per-label linear classifiers of a label cluster's rows: the squared-hinge SVMs of Parabel's leaves.

A block kernel (NumPy, SciPy and a Numba loop; no Dask): each label of a cluster gets an L2-regularised
squared-hinge linear SVM with a bias, trained one-vs-rest on the rows that have a label of the cluster (the rows
that reach the cluster's leaf in Parabel, Prabhu et al. 2018), by dual coordinate descent with shrinking (Hsieh et
al. 2008, liblinear's ``-s 1`` solver), and its weights below :data:`PRUNE` in magnitude dropped (Parabel's).
"""

from __future__ import annotations

import functools

import numpy as np
import scipy.sparse as sp

__all__ = ["PRUNE", "cluster_svms", "squared_hinge_svms", "streamed_pass"]

#: weights of a label's classifier smaller than this in magnitude are dropped (Parabel's and Omikuji's threshold
#: on unit tf-idf rows): the classifiers then hold fewer entries than the label centroids
PRUNE = 0.1
#: passes of the coordinate descent over a label's rows at most (it stops earlier when the projected gradient's
#: spread falls below ``tol``: liblinear's stopping rule)
MAX_PASSES = 100
#: that tolerance (liblinear's default for this solver)
TOL = 0.1
#: bytes of the dense weights (labels x the cluster's features, float32) trained at once: a cluster's labels are
#: trained in chunks of at most this (each label's classifier is the same either way). A cluster of 100 frequent
#: labels over 500,000 features is 200 MB dense: two tasks of a 1 GiB worker training such clusters at once took it
#: past 95 % of its limit, and it was restarted
DENSE_BYTES = 1 << 24


@functools.cache
def _compiled(name: str = "_dual_cd"):
    """The kernel ``name`` of this module (:func:`_dual_cd`) compiled by Numba (cached on disk), imported on first
    use: Numba adds about 50 MB to a process, which a worker that never trains a classifier should not carry
    (measured: a 256 MiB worker of ``bench/scale.py --quick`` went from 175 to 216 MiB and was paused)."""
    import numba

    return numba.njit(cache=True, nogil=True)(globals()[name])


def _dual_cd(indptr, indices, data, pos_indptr, pos_rows, n_cols, C, max_passes, tol, seed):  # pragma: no cover
    n = len(indptr) - 1
    m = len(pos_indptr) - 1
    W = np.zeros((m, n_cols + 1), np.float32)
    diag = 0.5 / C
    qd = np.empty(n)
    for i in range(n):
        s = 1.0 + diag  # the bias column's 1, and the squared hinge's diagonal
        for p in range(indptr[i], indptr[i + 1]):
            s += data[p] * data[p]
        qd[i] = s
    y, alpha, w = np.empty(n), np.zeros(n), np.zeros(n_cols + 1)
    index = np.arange(n)
    for j in range(m):
        np.random.seed(seed + j)  # noqa: NPY002 (numba's own generator of this thread, seeded per label)
        y[:] = -1.0
        for p in range(pos_indptr[j], pos_indptr[j + 1]):
            y[pos_rows[p]] = 1.0
        alpha[:] = 0.0
        w[:] = 0.0
        for i in range(n):
            index[i] = i
        active, bound = n, np.inf
        for _ in range(max_passes):
            pg_max, pg_min = -np.inf, np.inf
            for s in range(active):  # a random order of the active rows
                t = s + np.random.randint(active - s)  # noqa: NPY002
                index[s], index[t] = index[t], index[s]
            s = 0
            while s < active:
                i = index[s]
                g = w[n_cols]
                for p in range(indptr[i], indptr[i + 1]):
                    g += w[indices[p]] * data[p]
                g = y[i] * g - 1.0 + diag * alpha[i]
                pg = g
                if alpha[i] == 0.0:
                    if g > bound:  # shrinking: a row at its bound whose gradient says it stays there
                        active -= 1
                        index[s], index[active] = index[active], index[s]
                        continue
                    pg = min(g, 0.0)
                pg_max, pg_min = max(pg_max, pg), min(pg_min, pg)
                if abs(pg) > 1e-12:
                    old = alpha[i]
                    alpha[i] = max(old - g / qd[i], 0.0)
                    d = (alpha[i] - old) * y[i]
                    for p in range(indptr[i], indptr[i + 1]):
                        w[indices[p]] += d * data[p]
                    w[n_cols] += d
                s += 1
            if pg_max - pg_min <= tol:
                if active == n:
                    break
                active, bound = n, np.inf  # converged on the active rows: check all of them once more
                continue
            bound = pg_max if pg_max > 0 else np.inf
        for c in range(n_cols + 1):
            W[j, c] = w[c]
    return W


def _streamed_cd(indptr, indices, data, pos_indptr, pos_cols, order, W, alpha, C):  # pragma: no cover
    n_cols = W.shape[0] - 1
    m = W.shape[1]
    diag = 0.5 / C
    y = np.empty(m, np.float32)
    g = np.empty(m, np.float32)
    delta = np.empty(m, np.float32)
    hi = np.full(m, -np.inf)
    lo = np.full(m, np.inf)
    for i in order:
        # the row's margins under every classifier at once: a feature's weights are a contiguous row of W
        g[:] = W[n_cols]
        for p in range(indptr[i], indptr[i + 1]):
            row, v = W[indices[p]], data[p]
            for j in range(m):
                g[j] += v * row[j]
        y[:] = -1.0
        for p in range(pos_indptr[i], pos_indptr[i + 1]):
            y[pos_cols[p]] = 1.0
        qd = 1.0 + diag  # the bias column's 1, and the squared hinge's diagonal
        for p in range(indptr[i], indptr[i + 1]):
            qd += data[p] * data[p]
        moved = False
        for j in range(m):
            a = alpha[i, j]
            gj = y[j] * g[j] - 1.0 + diag * a
            pg = min(gj, 0.0) if a == 0.0 else gj
            hi[j], lo[j] = max(hi[j], pg), min(lo[j], pg)
            delta[j] = 0.0
            if abs(pg) > 1e-12:
                new = max(a - gj / qd, 0.0)
                alpha[i, j] = new
                delta[j] = (new - a) * y[j]
                moved = True
        if moved:
            for p in range(indptr[i], indptr[i + 1]):
                row, v = W[indices[p]], data[p]
                for j in range(m):
                    row[j] += v * delta[j]
            for j in range(m):
                W[n_cols, j] += delta[j]
    return hi, lo


def streamed_pass(X: sp.csr_matrix, positives: sp.csr_matrix, W: np.ndarray, alpha: np.ndarray | None, *,
                  C: float = 1.0, seed=0) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """One pass of :func:`squared_hinge_svms`' dual coordinate descent over the rows of a block, for every
    classifier at once, from the weights ``W`` of the passes before (``(n_features + 1) x n_classifiers``, the
    bias last) and the block's dual variables ``alpha`` (``n_rows x n_classifiers``; None: zeros): the solver of
    classifiers whose rows no task holds, a row block after another (``positives``: the block's rows x
    classifiers, non-zero where a row is positive). The rows in a random order seeded ``seed``; no shrinking.

    Returns the new ``W`` and ``alpha`` (copies) and, by classifier, the largest and smallest projected gradient
    of the pass (liblinear's stopping rule: their spread over every block below
    :data:`TOL`)."""
    X, P = sp.csr_matrix(X, dtype=np.float32), sp.csr_matrix(positives)
    W = np.array(W, np.float32, order="C")
    alpha = np.zeros((X.shape[0], W.shape[1]), np.float32) if alpha is None else np.array(alpha, np.float32)
    order = np.random.default_rng(seed).permutation(X.shape[0]).astype(np.int64)
    hi, lo = _compiled("_streamed_cd")(X.indptr, X.indices, X.data,  # as they are: no int64 copy of the indices
                                       P.indptr.astype(np.int64), P.indices.astype(np.int64), order, W, alpha,
                                       np.float32(C))
    return W, alpha, hi, lo


def squared_hinge_svms(X: sp.csr_matrix, positives: sp.csc_matrix, *, C: float = 1.0, max_passes: int = MAX_PASSES,
                       tol: float = TOL, seed: int = 0) -> np.ndarray:
    """One squared-hinge linear SVM per column of ``positives`` (rows x labels, its non-zeros the positive rows),
    all rows of ``X`` negative elsewhere: ``min_w 1/2 |w|^2 + C sum_i max(0, 1 - y_i (w x_i + b))^2`` with the bias
    ``b`` as a feature of value 1 (regularised, as liblinear's ``-B 1``); column ``j``'s row order seeded ``seed +
    j`` (the same classifier whatever the other columns).

    Returns
    -------
    ndarray of float32, shape (n_labels, n_features + 1)
        The weights, then the bias.
    """
    X = sp.csr_matrix(X)
    positives = sp.csc_matrix(positives)
    return _compiled()(X.indptr.astype(np.int64), X.indices.astype(np.int64), X.data.astype(np.float64),
                    positives.indptr.astype(np.int64), positives.indices.astype(np.int64), X.shape[1], float(C),
                    int(max_passes), float(tol), int(seed))


def cluster_svms(X: sp.csr_matrix, Y: sp.csr_matrix, offsets: np.ndarray, *, C: float = 1.0, prune: float = PRUNE,
                 seed: int = 0, columns: tuple[int, int] | None = None,
                 max_passes: int = MAX_PASSES) -> tuple[sp.csr_matrix, np.ndarray]:
    """The classifiers of the label clusters ``offsets`` (cluster ``c``: columns ``offsets[c]:offsets[c + 1]`` of
    ``Y``), each label's trained on the rows of ``X`` that have a label of its cluster, label ``j`` seeded
    ``seed + j``; ``columns``: ``(a, b)``, the classifiers of the labels ``a:b`` only (the others' clusters' rows
    all the same), so that tasks can share a cluster's labels; ``max_passes``: of each coordinate descent.

    Returns
    -------
    V : csr_matrix of float32, shape (n_labels, n_features)
        The weights, those below ``prune`` in magnitude dropped.
    bias : ndarray of float32, shape (n_labels,)
    """
    X, Y = sp.csr_matrix(X), sp.csc_matrix(Y)
    first, last = (0, int(offsets[-1])) if columns is None else (int(columns[0]), int(columns[1]))
    pieces, biases = [], []
    for c in range(len(offsets) - 1):
        start, stop = max(int(offsets[c]), first), min(int(offsets[c + 1]), last)
        if start >= stop:
            continue
        rows = np.flatnonzero(np.diff(Y[:, int(offsets[c]):int(offsets[c + 1])].tocsr().indptr))
        Yc = Y[:, start:stop].tocsr()
        Xc = X[rows]
        columns_, local = np.unique(Xc.indices, return_inverse=True)  # the cluster's features only
        Xl = sp.csr_matrix((Xc.data, local.reshape(-1), Xc.indptr), shape=(len(rows), len(columns_)))
        Yr = Yc[rows].tocsc()
        chunk = max(1, DENSE_BYTES // (4 * (len(columns_) + 1)))  # labels whose dense weights take DENSE_BYTES
        for a in range(0, stop - start, chunk):
            b = min(a + chunk, stop - start)
            Wc = squared_hinge_svms(Xl, Yr[:, a:b], C=C, seed=seed + start + a, max_passes=max_passes) \
                if len(rows) else np.zeros((b - a, 1), np.float32)
            weights = Wc[:, :-1]
            weights[np.abs(weights) < prune] = 0.0
            kept = sp.csr_matrix(weights)
            pieces.append(sp.csr_matrix((kept.data, columns_[kept.indices], kept.indptr), shape=(b - a, X.shape[1])))
            biases.append(Wc[:, -1].copy())  # not a view: it would keep every dense W alive
            del Wc, weights
    V = sp.vstack(pieces, format="csr", dtype=np.float32) if pieces else sp.csr_matrix((0, X.shape[1]), np.float32)
    return V, (np.concatenate(biases) if biases else np.zeros(0)).astype(np.float32)
