"""Pure NumPy kernels of the embedding decoder, each applied to one row block (or one sub-batch of rows).

Nothing here knows about Dask: :mod:`xmldask.models._graph` maps these functions over row blocks and
:mod:`xmldask.models.embedding_classifier` combines them into an estimator.

- Random Fourier features (Rahimi and Recht 2007): :func:`sample_frequencies`, :func:`rff_map`,
  :func:`median_distance` (the median heuristic for the bandwidth) and :func:`kernel_value` (the
  kernel the features approximate, for tests).
- Decoder features of one block: :func:`decoder_features` (``[phi(X_b W + c), 1]``).
- Losses with their gradient with respect to the scores: :func:`softmax_loss` (multiclass log loss)
  and :func:`logistic_loss` (independent log loss per label, multilabel).
- Top-k of score rows: :func:`topk_rows` (one sub-batch of scores) and :func:`topk_scores` (scores
  ``F Q + bias`` computed and reduced in row sub-batches, so an ``n_b x n_labels`` block is never held
  at once).

References
----------
Mineiro, P. and Karampatziakis, N. "Fast Label Embeddings via Randomized Linear Algebra" (ECML PKDD
2015), Algorithm 3. Rahimi, A. and Recht, B. "Random Features for Large-Scale Kernel Machines"
(NIPS 2007), Algorithm 1.
"""

from __future__ import annotations

import math

import numpy as np
import scipy.linalg
import scipy.sparse as sp
from scipy.special import expit

__all__ = [
    "FEATURES",
    "holdout_mask",
    "idf_weights",
    "transform_rows",
    "SCORE_BUDGET",
    "MINIBATCH_SCORES",
    "probabilities",
    "decoder_features",
    "kernel_value",
    "logistic_loss",
    "inverse_from_cholesky",
    "sgd_step",
    "median_distance",
    "rff_map",
    "sample_frequencies",
    "softmax_loss",
    "topk_rows",
    "topk_scores",
    "mean_of_lists",
]

#: input features: the raw values, rows scaled to unit L2 norm, or tf-idf (columns weighted by their
#: smoothed inverse document frequency on the training rows, then rows scaled to unit L2 norm)
FEATURES = ("raw", "l2", "tfidf")

#: most score entries (rows x labels) held at once by :func:`topk_scores` and the blocked score
#: kernels: 4 MiB of float32, a few times that with the top-k selection's temporaries (a larger budget was
#: no faster: docs/measurements.md), so a worker with a small memory limit can score many labels while it
#: holds its blocks
SCORE_BUDGET = 1 << 20

#: :func:`topk_rows` takes up to this many labels a row by ``k`` argmax scans (a scan of a row costs
#: a fraction of partitioning it); more by ``np.argpartition``, which wins beyond (``python bench/topk.py``;
#: docs/measurements.md)
SELECT_K = 32

#: most score entries of one SGD minibatch (the batch is cut to fit; 256 MiB of float32)
MINIBATCH_SCORES = 1 << 26


def _dense(a) -> np.ndarray:
    return a.toarray() if sp.issparse(a) else np.asarray(a)


# --------------------------------------------------------------------------------------------
# input features


def holdout_mask(seed: int, block: int, n_rows: int, fraction: float) -> np.ndarray:
    """The held-out rows of one row block: each row with probability ``fraction``, shape ``(n_rows,)``.

    A pure function of ``(seed, block)`` (its own random stream per block), so that every process
    draws the same rows of a block and no mask of all ``n`` rows is ever kept or shipped.
    """
    if fraction <= 0:
        return np.zeros(n_rows, dtype=bool)
    return np.random.default_rng([int(seed), int(block)]).random(n_rows) < fraction


def idf_weights(document_counts: np.ndarray, n_rows: int, dtype=np.float32) -> np.ndarray:
    """Smoothed inverse document frequencies ``log((1 + n) / (1 + df)) + 1`` (scikit-learn's ``smooth_idf``)."""
    df = np.asarray(document_counts, dtype=np.float64)
    return (np.log((1.0 + n_rows) / (1.0 + df)) + 1.0).astype(dtype)


def transform_rows(Xb, idf: np.ndarray | None = None, *, normalize: bool = True):
    """One row block with columns scaled by ``idf`` (if given), then rows scaled to unit L2 norm.

    Sparse blocks stay sparse (CSR), dense blocks dense; all-zero rows stay zero. The dtype is kept.
    """
    if idf is not None:
        idf = np.asarray(idf).reshape(-1).astype(Xb.dtype, copy=False)
    if sp.issparse(Xb):
        Xb = sp.csr_matrix(Xb, copy=True)
        if idf is not None:
            Xb.data *= idf[Xb.indices]
        if normalize:
            rows = np.repeat(np.arange(Xb.shape[0]), np.diff(Xb.indptr))
            norms = np.sqrt(np.bincount(rows, Xb.data.astype(np.float64) ** 2, minlength=Xb.shape[0]))
            norms[norms == 0] = 1.0
            Xb.data /= norms[rows].astype(Xb.dtype)
        return Xb
    Xb = np.array(Xb, copy=True)
    if idf is not None:
        Xb *= idf
    if normalize:
        norms = np.linalg.norm(Xb, axis=1, keepdims=True)
        norms[norms == 0] = 1.0
        Xb /= norms.astype(Xb.dtype)
    return Xb


# --------------------------------------------------------------------------------------------
# random Fourier features


def sample_frequencies(rng: np.random.Generator, n_inputs: int, n_components: int, kernel: str,
                       dtype=np.float32) -> tuple[np.ndarray, np.ndarray]:
    """Random frequencies ``Omega`` and phases ``b`` of random Fourier features for unit bandwidth.

    Parameters
    ----------
    rng : numpy.random.Generator
    n_inputs : int
        Dimension ``k`` of the inputs ``z``.
    n_components : int
        Number ``m`` of random features.
    kernel : {"gaussian", "laplacian"}
        ``"gaussian"``: ``Omega`` standard normal, for ``k(x, y) = exp(-||x - y||_2^2 / 2)``;
        ``"laplacian"``: ``Omega`` standard Cauchy, for ``k(x, y) = exp(-||x - y||_1)``.
    dtype : numpy dtype, default float32

    Returns
    -------
    omega : ndarray, shape (n_inputs, n_components)
    phase : ndarray, shape (n_components,)
        Uniform on ``[0, 2 pi)``.

    References
    ----------
    Rahimi and Recht (2007), Algorithm 1: ``p(omega)`` is the Fourier transform of the kernel.
    """
    if kernel == "gaussian":
        omega = rng.standard_normal((n_inputs, n_components))
    elif kernel == "laplacian":
        omega = rng.standard_cauchy((n_inputs, n_components))
    else:
        raise ValueError(f"kernel must be 'gaussian' or 'laplacian' for random features, but is {kernel!r}")
    phase = rng.uniform(0.0, 2.0 * np.pi, n_components)
    return omega.astype(dtype), phase.astype(dtype)


def rff_map(Z, omega: np.ndarray, phase: np.ndarray, bandwidth: float, *, out: np.ndarray | None = None) -> np.ndarray:
    """Random Fourier features ``sqrt(2 / m) cos(Z Omega / sigma + b)``.

    Parameters
    ----------
    Z : ndarray, shape (n_rows, k)
        Inputs.
    omega : ndarray, shape (k, m)
        Frequencies from :func:`sample_frequencies` (unit bandwidth).
    phase : ndarray, shape (m,)
    bandwidth : float
        ``sigma``: the kernel becomes ``k((x - y) / sigma)``.
    out : ndarray of shape (n_rows, m) or a wider array's leading columns, optional
        Where to write (avoids a copy when the caller appends a bias column).

    Returns
    -------
    ndarray, shape (n_rows, m)
        In ``omega``'s dtype. ``E[phi(x) . phi(y)] = k(x, y)`` over the random ``Omega``, ``b``.

    References
    ----------
    Rahimi and Recht (2007), Algorithm 1.
    """
    dtype = omega.dtype
    m = omega.shape[1]
    A = np.asarray(Z, dtype=dtype) @ (omega / dtype.type(bandwidth))
    A += phase
    out = np.cos(A, out=A if out is None else out)
    out *= dtype.type(np.sqrt(2.0 / m))
    return out


def kernel_value(x: np.ndarray, y: np.ndarray, kernel: str, bandwidth: float = 1.0) -> float:
    """The shift-invariant kernel that :func:`rff_map` approximates (``gaussian`` or ``laplacian``)."""
    delta = (np.asarray(x, np.float64) - np.asarray(y, np.float64)) / bandwidth
    if kernel == "gaussian":
        return float(np.exp(-0.5 * delta @ delta))
    if kernel == "laplacian":
        return float(np.exp(-np.abs(delta).sum()))
    raise ValueError(f"kernel must be 'gaussian' or 'laplacian', but is {kernel!r}")


def median_distance(Z: np.ndarray, kernel: str, *, max_pairs: int = 200_000,
                    rng: np.random.Generator | None = None) -> float:
    """Median pairwise distance of the rows of ``Z`` (the median heuristic for the bandwidth).

    Parameters
    ----------
    Z : ndarray, shape (n_rows, k)
        A sample of rows.
    kernel : {"gaussian", "laplacian"}
        Euclidean distances for ``"gaussian"``, L1 distances for ``"laplacian"`` (the norm in the
        kernel's exponent).
    max_pairs : int, default 200000
        All pairs of the rows when they are at most this many, else all pairs of a random subset of
        rows that has at most this many (``scipy.spatial.distance.pdist``, no ``pairs x k`` temporaries:
        0.015 s where as many random pairs of 2,000 rows of k = 159 took 1.38 s, the median 0.2 % apart).
    rng : numpy.random.Generator, optional
        For the subset; default seed 0.

    Returns
    -------
    float
        The median of the non-zero distances (1.0 if all rows are equal).
    """
    from scipy.spatial.distance import pdist

    Z = np.asarray(Z, dtype=np.float64)
    n = Z.shape[0]
    if n < 2:
        return 1.0
    if n * (n - 1) // 2 > max_pairs:
        m = int((1 + math.isqrt(1 + 8 * max_pairs)) // 2)  # m (m - 1) / 2 <= max_pairs
        rng = np.random.default_rng(0) if rng is None else rng
        Z = Z[np.sort(rng.choice(n, m, replace=False))]
    dist = pdist(Z, "cityblock" if kernel == "laplacian" else "euclidean")
    dist = dist[dist > 0]
    return float(np.median(dist)) if dist.size else 1.0


def inverse_from_cholesky(chol, block: int = 256) -> np.ndarray:
    """``H^-1`` from ``cho_factor(H, lower=True)`` by LAPACK's ``potri`` (a third of the work of solving
    against the identity: 0.31 s instead of 0.50 s for m = 2,000 on one core).

    ``potri`` fills one triangle; the other is copied over in place, ``block`` rows at a time (with a whole
    ``tril + tril.T - diag`` instead: 0.45 s in all against 0.15 s for m + 1 = 2,001, a first call in a fresh
    process, ``bench/preconditioner.py``).
    """
    factor, lower = chol
    inverse, info = scipy.linalg.lapack.dpotri(factor, lower=int(lower))
    if info != 0:
        raise np.linalg.LinAlgError(f"potri failed (info {info})")
    m = inverse.shape[0]
    for a in range(0, m, block):
        b = min(a + block, m)
        diagonal = inverse[a:b, a:b]
        if lower:
            diagonal[...] = np.tril(diagonal) + np.tril(diagonal, -1).T
            inverse[a:b, b:] = inverse[b:, a:b].T
        else:
            diagonal[...] = np.triu(diagonal) + np.triu(diagonal, 1).T
            inverse[b:, a:b] = inverse[a:b, b:].T
    return inverse


def decoder_features(Xb, W: np.ndarray, intercept: np.ndarray, omega: np.ndarray | None = None,
                     phase: np.ndarray | None = None, bandwidth: float = 1.0) -> np.ndarray:
    """Decoder features of one row block: ``[phi(X_b W + c), 1]`` (the constant column is the bias).

    Parameters
    ----------
    Xb : scipy.sparse matrix or ndarray, shape (n_b, n_features)
    W : ndarray, shape (n_features, k)
        Features-to-embedding map (Algorithm 3, line 4).
    intercept : ndarray, shape (k,)
    omega, phase : ndarray, optional
        Random Fourier features (:func:`sample_frequencies`); ``None``: ``phi`` is the identity.
    bandwidth : float, default 1.0

    Returns
    -------
    ndarray, shape (n_b, m + 1)
        In ``W``'s dtype; ``m = k`` for the identity, else ``omega.shape[1]``.

    References
    ----------
    Mineiro and Karampatziakis (2015), Algorithm 3, line 5.
    """
    dtype = W.dtype
    Z = _dense(Xb @ W).astype(dtype, copy=False)
    Z += intercept.astype(dtype, copy=False)
    m = Z.shape[1] if omega is None else omega.shape[1]
    F = np.empty((Z.shape[0], m + 1), dtype=dtype)
    if omega is None:
        F[:, :m] = Z
    else:
        rff_map(Z, omega, phase, bandwidth, out=F[:, :m])
    F[:, m] = 1
    return F


# --------------------------------------------------------------------------------------------
# losses


def _binary_csr(Yb, n_rows: int, n_labels: int) -> sp.csr_matrix:
    """The labels of a block as a CSR matrix with unit values and no duplicate entries."""
    Y = sp.csr_matrix(Yb, dtype=np.float32, copy=True)
    if Y.shape != (n_rows, n_labels):
        raise ValueError(f"labels have shape {Y.shape}, scores ({n_rows}, {n_labels})")
    Y.sum_duplicates()
    Y.eliminate_zeros()
    Y.data[:] = 1
    return Y


def softmax_loss(S: np.ndarray, Yb, *, gradient: bool = True) -> tuple[float, np.ndarray | None]:
    """Multiclass log loss ``sum_i [ logsumexp(s_i) - mean_{j in y_i} s_ij ]`` and its gradient.

    A row with one label contributes ``-log softmax(s_i)_y``; a row with several labels has the
    uniform distribution over them as its target; a row without labels contributes nothing.

    Parameters
    ----------
    S : ndarray, shape (n_rows, n_labels)
        Scores; overwritten by the gradient when ``gradient`` (to save memory).
    Yb : scipy.sparse matrix or ndarray, shape (n_rows, n_labels)
        Binary labels (any non-zero is a label).
    gradient : bool, default True

    Returns
    -------
    loss : float
        Summed over the rows (float64).
    grad : ndarray of shape (n_rows, n_labels) or None
        ``d loss / d S = [y_i != 0] (softmax(s_i) - y_i / |y_i|)``, in ``S``'s dtype, in place of ``S``.
    """
    n, L = S.shape
    Y = _binary_csr(Yb, n, L)
    count = np.diff(Y.indptr)
    has = (count > 0).astype(np.float64)
    rows = np.repeat(np.arange(n), count)
    target = 1.0 / np.maximum(count, 1)
    # log-sum-exp in S's dtype with the row maximum subtracted (exact to rounding, no float64 copy)
    top = S.max(axis=1, keepdims=True)
    E = np.subtract(S, top)
    np.exp(E, out=E)
    total = E.sum(axis=1, dtype=np.float64)
    lse = top[:, 0].astype(np.float64) + np.log(total)
    ys = np.bincount(rows, weights=S[rows, Y.indices].astype(np.float64) * target[rows], minlength=n)
    loss = float(has @ lse - ys.sum())
    if not gradient:
        return loss, None
    G = S
    np.multiply(E, (has / total).astype(S.dtype)[:, None], out=G)
    G[rows, Y.indices] -= target[rows].astype(S.dtype)
    return loss, G


def logistic_loss(S: np.ndarray, Yb, *, gradient: bool = True) -> tuple[float, np.ndarray | None]:
    """Independent log loss per label ``sum_ij [ log(1 + exp(s_ij)) - y_ij s_ij ]`` (float64, summed over rows
    and labels) and, when ``gradient``, its gradient ``sigmoid(S) - Y`` written over the logits ``S``
    (``None`` otherwise); the arguments as in :func:`softmax_loss` (any non-zero label is a positive)."""
    n, L = S.shape
    Y = _binary_csr(Yb, n, L)
    rows = np.repeat(np.arange(n), np.diff(Y.indptr))
    pos = S[rows, Y.indices].astype(np.float64)
    # softplus(s) = max(s, 0) + log1p(exp(-|s|)), stable for any s (in S's dtype, summed in float64)
    T = np.abs(S)
    np.negative(T, out=T)
    np.exp(T, out=T)
    np.log1p(T, out=T)
    T += np.maximum(S, 0)
    loss = float(T.sum(dtype=np.float64) - pos.sum())
    del T
    if not gradient:
        return loss, None
    G = expit(S, out=S)
    G[rows, Y.indices] -= 1
    return loss, G


def sgd_step(Q: np.ndarray, V: np.ndarray, P: np.ndarray, F: np.ndarray, Yb, loss_fn, *, learning_rate: float,
             momentum: float, l2: float) -> float:
    """One preconditioned step with momentum of the decoder ``Q`` on a minibatch, in place on ``Q`` and ``V``.

    ``V <- momentum V + P (F^T dloss/dS / n + l2 [Q; 0])``, ``Q <- Q - learning_rate V`` with ``S = F Q``
    (the bias row, ``Q``'s last, is not decayed); returns the minibatch's summed loss.

    Parameters
    ----------
    Q, V : ndarray, shape (m + 1, n_labels)
        The decoder and its momentum, updated in place.
    P : ndarray, shape (m + 1, m + 1)
        The preconditioner ``(F^T F / n + lam I)^{-1}``.
    F : ndarray, shape (n_rows, m + 1)
        The minibatch's decoder features (:func:`decoder_features`).
    Yb : scipy.sparse matrix, shape (n_rows, n_labels)
    loss_fn : callable
        :func:`softmax_loss` or :func:`logistic_loss`.
    """
    dtype = Q.dtype.type
    loss, G = loss_fn(F @ Q, Yb)
    grad = F.T @ G
    grad *= dtype(1.0 / F.shape[0])
    if l2:
        grad[:-1] += dtype(l2) * Q[:-1]
    V *= dtype(momentum)
    V += P @ grad
    Q -= dtype(learning_rate) * V
    return loss


# --------------------------------------------------------------------------------------------
# top-k


def probabilities(S: np.ndarray, task: str) -> np.ndarray:
    """Scores to probabilities in place: softmax of every row (multiclass) or a sigmoid per entry.

    Parameters
    ----------
    S : ndarray, shape (n_rows, n_labels)
        Scores; overwritten.
    task : {"multiclass", "multilabel"}

    Returns
    -------
    ndarray
        ``S``.
    """
    if task == "multiclass":
        S -= S.max(axis=1, keepdims=True)
        np.exp(S, out=S)
        S /= S.sum(axis=1, keepdims=True)
    else:
        expit(S, out=S)
    return S


def topk_rows(S: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """The ``k`` largest entries of every row of ``S``, best first.

    Ties are broken by the smaller label id, so the result equals the first ``k`` columns of a
    stable ``argsort(-S, kind="stable")`` exactly. Finite scores and ``k <= SELECT_K``: ``k`` argmax
    scans (:func:`_topk_by_scans`); otherwise ``np.argpartition`` finds the ``k``-th largest value of
    each row, and the (rare) rows with several entries equal to it at the boundary are redone with a
    stable sort. NaN scores rank last.

    Parameters
    ----------
    S : ndarray, shape (n_rows, n_labels)
    k : int
        ``1 <= k <= n_labels``.

    Returns
    -------
    labels : ndarray of int32, shape (n_rows, k)
    scores : ndarray, shape (n_rows, k)
        In ``S``'s dtype.
    """
    n, L = S.shape
    if not 1 <= k <= L:
        raise ValueError(f"k must be between 1 and n_labels = {L}, but is {k}")
    if k <= SELECT_K and S.dtype.kind == "f" and np.isfinite(S).all():
        return _topk_by_scans(S, k)
    neg = -S
    if np.isnan(neg).any():
        neg = np.where(np.isnan(neg), np.inf, neg)
    if k < L:
        part = np.argpartition(neg, k - 1, axis=1)[:, :k]
    else:
        part = np.broadcast_to(np.arange(L), (n, L)).copy()
    vals = np.take_along_axis(neg, part, axis=1)
    # order the k candidates by (score desc, id asc)
    order = np.lexsort((part, vals), axis=1)
    idx = np.take_along_axis(part, order, axis=1)
    if k < L:
        kth = np.take_along_axis(vals, order[:, -1:], axis=1)  # the k-th best value (negated)
        n_better_eq = (neg <= kth).sum(axis=1)
        ties = np.flatnonzero(n_better_eq > k)
        for i in ties:  # more entries equal to the k-th value than slots: smaller ids first
            idx[i] = np.argsort(neg[i], kind="stable")[:k]
    labels = idx.astype(np.int32)
    return labels, np.take_along_axis(S, idx, axis=1)


def mean_of_lists(labels: list[np.ndarray], scores: list[np.ndarray], k: int) -> tuple[np.ndarray, np.ndarray]:
    """Top-``k`` of the members' mean score over the labels they listed, for models that list a row's best labels
    only (an ensemble of any family: each member's ``predict_topk``).

    A row's candidates are the union of the labels its members listed; a member that did not list a candidate
    counts its lowest listed score for that row (the most it scored the label, a bound whatever the scale of
    its scores). Where every member lists every label this is the exact mean.

    Parameters
    ----------
    labels, scores : list of ndarray, shape (n_rows, width) each
        Each member's labels and scores of every row (``width >= k``; labels distinct within a row).
    k : int

    Returns
    -------
    labels : ndarray of int32, shape (n_rows, k)
    scores : ndarray of float64, shape (n_rows, k)
        Best first; ties by the smaller label id.
    """
    n, m = labels[0].shape[0], len(labels)
    floors = [np.asarray(s, np.float64).min(axis=1, initial=np.inf) for s in scores]
    listed = np.concatenate([np.asarray(a, np.int64) for a in labels], axis=1)
    above = np.concatenate([np.asarray(s, np.float64) - f[:, None] for s, f in zip(scores, floors)], axis=1)
    width = listed.shape[1]
    order = np.argsort(listed, axis=1, kind="stable")
    listed, above = np.take_along_axis(listed, order, 1), np.take_along_axis(above, order, 1)
    first = np.ones(listed.shape, bool)
    first[:, 1:] = listed[:, 1:] != listed[:, :-1]
    starts = np.flatnonzero(first.ravel())
    mean = np.full(n * width, -np.inf)
    if len(starts):
        mean[starts] = (np.add.reduceat(above.ravel(), starts) + np.sum(floors, axis=0)[starts // width]) / m
    mean = mean.reshape(n, width)
    cols, best = topk_rows(mean, min(k, width))  # sorted by label within a row: a smaller column is a smaller id
    return np.take_along_axis(listed, cols.astype(np.int64), 1).astype(np.int32), best


def _topk_by_scans(S: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """:func:`topk_rows` of finite scores by ``k`` row-wise argmax scans: each takes every row's largest
    remaining entry (the first, i.e. the smaller label id, among equals) and marks it ``-inf``, which no
    finite entry equals; so the result is the stable sort's."""
    work = S.copy()
    rows = np.arange(S.shape[0])
    idx = np.empty((S.shape[0], k), dtype=np.intp)
    for i in range(k):
        idx[:, i] = j = work.argmax(axis=1)
        work[rows, j] = -np.inf
    return idx.astype(np.int32), np.take_along_axis(S, idx, axis=1)


def topk_scores(F: np.ndarray, Q: np.ndarray, bias: np.ndarray | None, k: int, *,
                budget: int = SCORE_BUDGET) -> tuple[np.ndarray, np.ndarray]:
    """Top-``k`` labels of the scores ``F Q + bias``, computed in row sub-batches.

    At most ``budget`` score entries (rows x labels) are held at once, so a block of ``n_b x
    n_labels`` scores is never formed when ``n_labels`` is large.

    Parameters
    ----------
    F : ndarray, shape (n_rows, m)
        Features.
    Q : ndarray, shape (m, n_labels)
    bias : ndarray of shape (n_labels,), optional
    k : int
    budget : int, default SCORE_BUDGET

    Returns
    -------
    labels : ndarray of int32, shape (n_rows, k)
        Best first, ties by smaller label id (:func:`topk_rows`).
    scores : ndarray of float32, shape (n_rows, k)
    """
    n, L = F.shape[0], Q.shape[1]
    if not 1 <= k <= L:
        raise ValueError(f"k must be between 1 and n_labels = {L}, but is {k}")
    rows = max(1, budget // max(L, 1))
    labels = np.empty((n, k), dtype=np.int32)
    scores = np.empty((n, k), dtype=np.float32)
    for a in range(0, n, rows):
        S = F[a:a + rows] @ Q
        if bias is not None:
            S += bias
        labels[a:a + rows], scores[a:a + rows] = topk_rows(S, k)
    return labels, scores
