"""Evaluation metrics for extreme multi-label and multiclass classification, streamed over row blocks.

Every metric is computed as per-block sufficient statistics (a pure NumPy/SciPy kernel applied to
one row block of the truth ``Y`` and the matching rows of the predictions) followed by a tree sum
of those statistics, exactly like the passes of :mod:`xmldask.linalg.passes`. No task ever holds
more than one row block, and :func:`evaluate` computes every requested metric in one
``dask.compute`` (one pass over ``Y`` and the predictions).

Inputs
------
``labels``, ``scores`` : shape (n_samples, top_k)
    Top-k predictions, **best first** along each row: ``labels[i, r]`` is the label ranked
    ``r + 1`` for sample ``i`` and ``scores[i, r]`` its score. A label id of ``-1`` is padding ("no
    prediction"): it never counts as a hit and is never a predicted label. The order given is the
    ranking (ties in ``scores`` are resolved by the order of the columns); when ``scores`` are given
    they are checked to be non-increasing along each row (ignoring padding). NumPy arrays or Dask
    arrays chunked by rows (for example the Zarr arrays ``labels`` and ``scores`` of a prediction
    store); their row chunks are aligned to ``Y``'s by rechunking.
``Y`` : shape (n_samples, n_labels)
    The truth: a Dask array of ``scipy.sparse`` CSR row blocks (``open_dataset(url).Y``) or an
    in-memory ``scipy.sparse`` matrix (or dense 0/1 NumPy array). Any stored non-zero is a relevant
    label.
``scores_full`` : shape (n_samples, n_labels), optional
    A full decision-function / score matrix as a Dask array of dense row blocks (or a NumPy array),
    needed by the metrics that look at every label of a row.

Which input each metric needs
-----------------------------
- ``P@k``, ``nDCG@k``, ``R@k``, ``Acc@k`` (each ``k <= top_k``) and ``error``: ``labels``.
- ``PSP@k``, ``PSnDCG@k``: ``labels`` and ``propensities`` (from the *training* label counts).
- ``avg_AUC``: ``scores_full``.
- ``hamming_loss``, ``micro_F1``, ``macro_F1``: a decision rule, either ``threshold=t`` with
  ``scores_full`` (exact) or with the top-k ``scores`` (see below), or ``decision_k=k`` with
  ``labels`` (each row's top ``k`` labels are its predicted set).

Definitions (``N`` = number of test rows, ``y_i`` the set of true labels of row ``i``, ``l_{i,r}``
its label ranked ``r``, ``[.]`` the indicator, ``D(r) = 1 / log2(r + 1)``):

- ``P@k = 1/N sum_i 1/k sum_{r<=k} [l_{i,r} in y_i]`` (XC repository).
- ``nDCG@k = 1/N sum_i DCG_i@k / IDCG_i@k`` with ``DCG_i@k = sum_{r<=k} [l_{i,r} in y_i] D(r)`` and
  the ideal ``IDCG_i@k = sum_{r <= min(k, |y_i|)} D(r)`` (XC repository, Bhatia et al.).
- ``PSP@k`` (normalised, as the XC repository's ``psprecision``):
  ``sum_i sum_{r<=k} [l_{i,r} in y_i] / p_{l_{i,r}}`` divided by its best achievable value
  ``sum_i sum_{r<=k} 1 / p_{m_{i,r}}``, where ``m_{i,1}, m_{i,2}, ...`` are the true labels of row
  ``i`` ordered by decreasing ``1/p``. It is a ratio of sums over the whole test set (not a mean of
  per-row ratios) and lies in ``[0, 1]``; 1 means the best possible propensity-scored gain.
- ``PSnDCG@k`` (normalised, as the XC repository's ``psndcg``): ``sum_i PSDCG_i@k / IDCG_i@k``
  divided by the same sum for the ideal ranking ``m_i``, where ``PSDCG_i@k = sum_{r<=k}
  [l_{i,r} in y_i] D(r) / p_{l_{i,r}}`` and ``IDCG_i@k`` is the (unweighted) ideal DCG above.
- ``R@k = 1/N sum_i |top-k_i intersect y_i| / |y_i|`` (XC repository's ``recall``).
- ``Acc@k = 1/N sum_i [top-k_i intersect y_i non-empty]``: top-k accuracy. For multiclass data
  (one label per row) it is the fraction of rows whose true class is among the top k. (LEML's
  "top-K accuracy", the mean fraction of the top K predictions that are relevant, is ``P@K`` here.)
- ``error = 1 - Acc@1``: the multiclass test error (for multilabel data: the fraction of rows whose
  top-ranked label is not relevant).
- ``avg_AUC``: LEML's "average AUC" (Yu et al. 2014, Sec. 5 "Evaluation Criteria", which defers to
  its Appendix E.1, following Bucak et al. 2009; the appendix is in the arXiv version 1307.5101, not
  in the ICML text): for each test row the area under the ROC curve of its score vector over all ``n_labels``
  labels (the relevant labels are the positives), averaged over rows. Tied scores get half credit
  (average ranks, the Mann-Whitney statistic). Rows whose AUC is undefined (no relevant label, or
  every label relevant) are left out of the average; ``avg_AUC_rows`` counts the rows that were
  averaged.
- Decisions for ``hamming_loss`` and the F1 scores: with ``threshold=t`` label ``l`` is predicted
  for row ``i`` iff its score is ``>= t`` (LEML rounds decision values to 0/1, i.e. ``t = 0.5``;
  for decision functions centred at 0 use ``t = 0``). With ``scores_full`` this is exact. With only
  the top-k ``scores``, the labels outside the stored top k count as not predicted; that is exact
  unless a row's k-th score is itself ``>= t`` (the row may be truncated): such rows are counted in
  ``threshold_truncated_rows`` and a warning is logged. With ``decision_k=k`` the predicted set of
  each row is its top ``k`` labels (padding excluded).
- ``hamming_loss = (FP + FN) / (N * n_labels)``; ``micro_F1 = 2 TP / (2 TP + FP + FN)`` over all
  (row, label) pairs; ``macro_F1`` is the mean of the per-label ``F1_l = 2 TP_l / (2 TP_l + FP_l +
  FN_l)`` over the labels that are relevant to or predicted for at least one test row (labels
  neither true nor predicted anywhere have an undefined 0/0 F1 and are left out, like scikit-learn's
  ``f1_score(average="macro")`` on label vectors).

**Rows with no true labels** (XC convention): they count in ``N`` for every top-k metric and score
0 (no hits: ``P@k``, ``nDCG@k``, ``R@k``, ``Acc@k`` and the propensity-scored numerators get 0, the
``PSP``/``PSnDCG`` denominators get 0), count as errors in ``error``, are left out of ``avg_AUC`` and
count normally (all their positive decisions are false positives) in the Hamming loss and F1
scores. ``n_samples_without_labels`` reports how many there were. A metric that is undefined for
the data (no rows, no relevant label anywhere) is ``nan``.

Propensities (Jain, Prabhu and Varma 2016): ``p_l = 1 / (1 + C (N_l + B)^-A)`` with ``C = (log N -
1) (B + 1)^A``, ``N`` the number of training samples and ``N_l`` the training count of label ``l``
(:func:`propensity`, :data:`PROPENSITY_PARAMETERS`).

References
----------
.. [1] K. Bhatia, K. Dahiya, H. Jain, P. Kar, A. Mittal, Y. Prabhu, M. Varma. The Extreme
   Classification Repository: Multi-label Datasets & Code (P@k, nDCG@k, PSP@k, PSnDCG@k; the
   ``pyxclib`` ``xc_metrics`` implementation).
.. [2] H. Jain, Y. Prabhu, M. Varma. Extreme Multi-label Loss Functions for Recommendation, Tagging,
   Ranking & Other Missing Label Applications. KDD 2016 (propensity model, Eq. for ``p_l``; PSP@k,
   PSnDCG@k).
.. [3] H.-F. Yu, P. Jain, P. Kar, I. S. Dhillon. Large-scale Multi-label Learning with Missing Labels
   (LEML). ICML 2014, Sec. 5 "Evaluation Criteria" and Appendix E.1 (top-K accuracy, Hamming loss,
   average AUC).
.. [4] S. S. Bucak, P. K. Mallapragada, R. Jin, A. K. Jain. Efficient Multi-label Ranking for
   Multi-class Learning: Application to Object Recognition. ICCV 2009 (per-instance AUC).

Examples
--------
>>> import numpy as np, scipy.sparse as sp
>>> from xmldask.metrics import evaluate
>>> Y = sp.csr_matrix(np.array([[1, 0, 1, 0], [0, 1, 0, 0]]))
>>> labels = np.array([[2, 1, 0], [0, 1, -1]])
>>> res = evaluate(Y, labels, ks=(1, 3))
>>> res["P@1"], round(res["P@3"], 4)
(0.5, 0.5)
"""

from __future__ import annotations

import logging
import math
import numbers
from dataclasses import dataclass

import dask
import dask.array as da
import numpy as np
import scipy.sparse as sp

from .linalg.passes import block_sum, dense_operand

__all__ = [
    "PROPENSITY_PARAMETERS",
    "average_auc",
    "evaluate",
    "f1_scores",
    "hamming_loss",
    "inverse_propensity",
    "ndcg_at_k",
    "paired_gain",
    "precision_at_k",
    "propensity",
    "psndcg_at_k",
    "psprecision_at_k",
    "recall_at_k",
    "report",
    "top_k_accuracy",
]

logger = logging.getLogger(__name__)

#: ``(A, B)`` of the propensity model for the datasets it was fitted on (Jain et al. 2016): the
#: Wikipedia datasets (e.g. WikiLSHTC-325K), the Amazon datasets, and the default for all others.
PROPENSITY_PARAMETERS = {
    "default": (0.55, 1.5),
    "wikipedia": (0.5, 0.4),
    "amazon": (0.6, 2.6),
}

ROWS, WHOLE = "rows", "whole"


# --------------------------------------------------------------------------------------------
# propensities


def inverse_propensity(label_counts, n_samples: int, *, A: float = 0.55, B: float = 1.5) -> np.ndarray:
    """Inverse propensities ``1 / p_l = 1 + C (N_l + B)^-A`` of Jain et al. (2016).

    Parameters
    ----------
    label_counts : array_like of shape (n_labels,)
        ``N_l``: the number of training samples carrying each label (``Dataset.label_counts``).
    n_samples : int
        ``N``: the number of training samples.
    A, B : float
        Model parameters; see :data:`PROPENSITY_PARAMETERS` (defaults: 0.55, 1.5).

    Returns
    -------
    numpy.ndarray of shape (n_labels,), float64
        ``1 / p_l >= 1``; large for rare labels.

    References
    ----------
    H. Jain, Y. Prabhu, M. Varma. Extreme Multi-label Loss Functions for Recommendation, Tagging,
    Ranking & Other Missing Label Applications. KDD 2016, Sec. 3 (propensity model).
    """
    counts = np.asarray(label_counts)
    if counts.ndim != 1:
        raise ValueError(f"label_counts must be 1-D (one count per label), but has shape {counts.shape}")
    if not np.issubdtype(counts.dtype, np.number) or not np.all(np.isfinite(counts)) or np.any(counts < 0):
        raise ValueError("label_counts must be finite non-negative numbers (training rows per label)")
    if not isinstance(n_samples, numbers.Real) or not n_samples >= 1:
        raise ValueError(f"n_samples must be the number of training samples (at least 1), but is {n_samples!r}")
    if not (A > 0 and B > 0):
        raise ValueError(f"A and B must be positive, but are A={A!r}, B={B!r}")
    if counts.size and counts.max() > n_samples:
        raise ValueError(
            f"a label count ({int(counts.max())}) exceeds n_samples={n_samples}; pass the number of training "
            f"samples the counts were taken over (Dataset.n_samples of the training set)"
        )
    C = (math.log(n_samples) - 1.0) * (B + 1.0) ** A
    return 1.0 + C * np.power(counts.astype(np.float64) + B, -A)


def propensity(label_counts, n_samples: int, A: float = 0.55, B: float = 1.5) -> np.ndarray:
    """Label propensities ``p_l = 1 / (1 + C exp(-A log(N_l + B)))``, ``C = (log N - 1)(B + 1)^A``.

    Parameters
    ----------
    label_counts : array_like of shape (n_labels,)
        ``N_l``: training samples carrying each label, for example ``open_dataset(train).label_counts``.
    n_samples : int
        ``N``: the number of training samples (``open_dataset(train).n_samples``).
    A, B : float
        Model parameters. Defaults 0.55 and 1.5; Wikipedia-LSHTC 0.5 and 0.4; Amazon 0.6 and 2.6
        (:data:`PROPENSITY_PARAMETERS`).

    Returns
    -------
    numpy.ndarray of shape (n_labels,), float64
        Propensities (the probability that a relevant label is observed). For ``N > e`` they lie in
        ``(0, 1]``; pass them as ``propensities=`` to :func:`evaluate`.

    References
    ----------
    H. Jain, Y. Prabhu, M. Varma. Extreme Multi-label Loss Functions for Recommendation, Tagging,
    Ranking & Other Missing Label Applications. KDD 2016, Sec. 3.

    Examples
    --------
    >>> import numpy as np
    >>> p = propensity(np.array([0, 10, 1000]), 10_000)
    >>> bool(np.all(np.diff(p) > 0))
    True
    """
    return 1.0 / inverse_propensity(label_counts, n_samples, A=A, B=B)


# --------------------------------------------------------------------------------------------
# block kernels (NumPy/SciPy only, one row block)


@dataclass(frozen=True)
class _Config:
    """What the block kernel computes; also the layout of its flat statistics vector."""

    n_labels: int
    kmax: int = 0  # 0: no top-k ranking metrics
    ps: bool = False  # propensity-scored metrics
    auc: bool = False
    decision: str | None = None  # None, "full" (threshold on scores_full), "topk_threshold", "topk"
    threshold: float = 0.0
    decision_k: int = 0
    macro: bool = False

    def layout(self) -> dict[str, slice]:
        sizes = [("n_rows", 1), ("n_empty", 1)]
        if self.kmax:
            sizes += [(name, self.kmax) for name in ("hits", "ndcg", "recall", "acc")]
            if self.ps:
                sizes += [(name, self.kmax) for name in ("psp_num", "psp_den", "psndcg_num", "psndcg_den")]
        if self.auc:
            sizes += [("auc_sum", 1), ("auc_rows", 1)]
        if self.decision:
            sizes += [("tp", 1), ("fp", 1), ("fn", 1), ("truncated", 1)]
            if self.macro:
                sizes += [(name, self.n_labels) for name in ("tp_l", "fp_l", "fn_l")]
        out, start = {}, 0
        for name, size in sizes:
            out[name] = slice(start, start + size)
            start += size
        return out

    @property
    def size(self) -> int:
        return max(s.stop for s in self.layout().values())


def _truth_block(Yb, n_labels: int) -> sp.csr_matrix:
    """The block as a CSR matrix with sorted, unique indices and no explicit zeros (values ignored)."""
    Yb = Yb if sp.issparse(Yb) else np.asarray(Yb)
    Yb = sp.csr_matrix(Yb)
    if Yb.shape[1] != n_labels:
        raise ValueError(f"a row block of Y has {Yb.shape[1]} columns, expected n_labels = {n_labels}")
    if not Yb.has_canonical_format or (Yb.data.size and not np.all(Yb.data != 0)):
        Yb = Yb.copy()
        Yb.sum_duplicates()
        Yb.eliminate_zeros()
    return Yb


def _check_ids(labels: np.ndarray, n_labels: int, row0: int) -> None:
    bad = (labels < -1) | (labels >= n_labels)
    if np.any(bad):
        i, r = np.argwhere(bad)[0]
        raise ValueError(
            f"labels holds the id {int(labels[i, r])} at row {row0 + i}, rank {r + 1}: expected ids in "
            f"[0, {n_labels}) (n_labels of Y) or -1 for padding; check that the predictions and Y use the "
            f"same label numbering"
        )
    if labels.shape[1] > 1:
        s = np.sort(labels, axis=1)
        dup = (s[:, 1:] == s[:, :-1]) & (s[:, 1:] >= 0)
        if np.any(dup):
            i, r = np.argwhere(dup)[0]
            raise ValueError(
                f"labels lists the id {int(s[i, r])} twice in row {row0 + i}: each label may appear at most "
                f"once among a row's top-k predictions (use -1 for padding)"
            )


def _check_sorted(labels: np.ndarray, scores: np.ndarray, row0: int) -> None:
    valid = labels >= 0
    rows = np.nonzero(valid)[0]
    values = scores[valid]
    bad = (rows[1:] == rows[:-1]) & (values[1:] > values[:-1])
    if np.any(bad):
        i = int(rows[1:][bad][0])
        raise ValueError(
            f"scores must be sorted best first (non-increasing along each row, ignoring -1 padding), but row "
            f"{row0 + i} is not: {scores[i].tolist()}; sort the predictions first: "
            f"order = np.argsort(-scores, axis=1, kind='stable'); labels = np.take_along_axis(labels, order, 1); "
            f"scores = np.take_along_axis(scores, order, 1)"
        )


def _hit_flags(Yb: sp.csr_matrix, labels: np.ndarray) -> np.ndarray:
    """``flags[i, r] = 1.0`` iff ``labels[i, r]`` is a true label of row ``i`` (padding: 0)."""
    n, L = Yb.shape
    flags = np.zeros(labels.shape, dtype=np.float64)
    if Yb.nnz == 0 or labels.size == 0:
        return flags
    truth = np.repeat(np.arange(n, dtype=np.int64), np.diff(Yb.indptr)) * L + Yb.indices  # sorted
    r, c = np.nonzero(labels >= 0)
    query = r.astype(np.int64) * L + labels[r, c]
    pos = np.minimum(np.searchsorted(truth, query), truth.size - 1)
    flags[r, c] = truth[pos] == query
    return flags


def _ideal_weights(Yb: sp.csr_matrix, inv_p: np.ndarray, k: int) -> np.ndarray:
    """Per row, the ``k`` largest ``1/p_l`` over its true labels, descending, zero-padded: (n_b, k)."""
    n = Yb.shape[0]
    out = np.zeros((n, k), dtype=np.float64)
    if Yb.nnz == 0:
        return out
    rows = np.repeat(np.arange(n), np.diff(Yb.indptr))
    w = inv_p[Yb.indices]
    order = np.lexsort((-w, rows))  # grouped by row (rows stays as it is), largest weight first
    pos = np.arange(Yb.nnz) - Yb.indptr[rows]
    keep = pos < k
    out[rows[keep], pos[keep]] = w[order][keep]
    return out


def _discounts(k: int) -> np.ndarray:
    return 1.0 / np.log2(np.arange(2, k + 2, dtype=np.float64))


def _ranking_stats(out, lay, cfg: _Config, Yb, labels, inv_p) -> None:
    K = cfg.kmax
    n_true = np.diff(Yb.indptr)
    has = n_true > 0
    f = _hit_flags(Yb, labels[:, :K])
    disc = _discounts(K)
    hits = np.cumsum(f, axis=1)
    idcg = np.cumsum(disc)[np.minimum(np.arange(K)[None, :], n_true[has, None] - 1)]  # (n_has, K)
    out[lay["hits"]] = hits.sum(axis=0)
    out[lay["ndcg"]] = (np.cumsum(f * disc, axis=1)[has] / idcg).sum(axis=0)
    out[lay["recall"]] = (hits[has] / n_true[has, None]).sum(axis=0)
    out[lay["acc"]] = (hits > 0).sum(axis=0)
    if cfg.ps:
        w = f * inv_p[np.maximum(labels[:, :K], 0)]
        ideal = _ideal_weights(Yb, inv_p, K)
        out[lay["psp_num"]] = np.cumsum(w, axis=1).sum(axis=0)
        out[lay["psp_den"]] = np.cumsum(ideal, axis=1).sum(axis=0)
        out[lay["psndcg_num"]] = (np.cumsum(w * disc, axis=1)[has] / idcg).sum(axis=0)
        out[lay["psndcg_den"]] = (np.cumsum(ideal * disc, axis=1)[has] / idcg).sum(axis=0)


def _auc_stats(out, lay, Yb, S: np.ndarray, row0: int) -> None:
    n, L = Yb.shape
    if np.isnan(S).any():
        i = int(np.argwhere(np.isnan(S))[0, 0])
        raise ValueError(f"scores_full holds NaN in row {row0 + i}; the average AUC needs a score for every label")
    n_pos = np.diff(Yb.indptr)
    ok = (n_pos > 0) & (n_pos < L)
    if not np.any(ok):
        return
    from scipy.stats import rankdata  # here: scipy.stats takes 0.4 s to import, which every process would pay

    R = rankdata(S, axis=1)  # average ranks (ties: half credit), ascending scores
    rows = np.repeat(np.arange(n), n_pos)
    pos_rank = np.bincount(rows, weights=R[rows, Yb.indices], minlength=n)
    P, Nn = n_pos[ok].astype(np.float64), (L - n_pos[ok]).astype(np.float64)
    auc = (pos_rank[ok] - P * (P + 1) / 2) / (P * Nn)
    out[lay["auc_sum"]] = auc.sum()
    out[lay["auc_rows"]] = ok.sum()


def _decision_stats(out, lay, cfg: _Config, Yb, labels, scores, S) -> None:
    n, L = Yb.shape
    t = np.float64(cfg.threshold)
    rows = np.repeat(np.arange(n), np.diff(Yb.indptr))
    if cfg.decision == "full":
        P = np.greater_equal(S, t)
        hit = P[rows, Yb.indices]
        n_pred = int(P.sum())
        pred_l = P.sum(axis=0) if cfg.macro else None
        tp_ids = Yb.indices[hit]
    else:
        if cfg.decision == "topk":
            lab = labels[:, : cfg.decision_k]
            pred = lab >= 0
        else:  # threshold on the top-k scores
            lab = labels
            pred = (lab >= 0) & np.greater_equal(scores, t)
            if lab.shape[1] < L and lab.shape[1] > 0:
                out[lay["truncated"]] = np.sum(pred[:, -1])
        flags = _hit_flags(Yb, lab).astype(bool) & pred
        n_pred = int(pred.sum())
        tp_ids = lab[flags]
        pred_l = np.bincount(lab[pred], minlength=L) if cfg.macro else None
    tp = tp_ids.size
    out[lay["tp"]] = tp
    out[lay["fp"]] = n_pred - tp
    out[lay["fn"]] = Yb.nnz - tp
    if cfg.macro:
        tp_l = np.bincount(tp_ids, minlength=L)
        out[lay["tp_l"]] = tp_l
        out[lay["fp_l"]] = pred_l - tp_l
        out[lay["fn_l"]] = np.bincount(Yb.indices, minlength=L) - tp_l


def block_stats(*, Yb, row_start, labels=None, scores=None, scores_full=None, inv_p=None,
                cfg: _Config) -> np.ndarray:
    """Sufficient statistics of one row block (pure NumPy/SciPy).

    Parameters
    ----------
    Yb : scipy.sparse matrix or numpy.ndarray, shape (n_b, n_labels)
        The block's truth (non-zeros are relevant labels).
    row_start : numpy.ndarray, shape (n_b,)
        Global row numbers of the block (for error messages).
    labels, scores : numpy.ndarray, shape (n_b, top_k), optional
        Top-k predictions, best first (-1: padding).
    scores_full : numpy.ndarray, shape (n_b, n_labels), optional
        Dense scores for every label.
    inv_p : numpy.ndarray, shape (n_labels,), optional
        Inverse propensities.
    cfg : _Config
        What to compute.

    Returns
    -------
    numpy.ndarray, shape (cfg.size,), float64
        The statistics, laid out by ``cfg.layout()``; summing them over blocks gives the totals.
    """
    row0 = int(row_start[0]) if len(row_start) else 0
    Yb = _truth_block(Yb, cfg.n_labels)
    lay = cfg.layout()
    out = np.zeros(cfg.size, dtype=np.float64)
    out[lay["n_rows"]] = Yb.shape[0]
    out[lay["n_empty"]] = np.sum(np.diff(Yb.indptr) == 0)
    if labels is not None:
        labels = np.asarray(labels).astype(np.int64, copy=False)
        _check_ids(labels, cfg.n_labels, row0)
        if scores is not None:
            scores = np.asarray(scores)
            _check_sorted(labels, scores, row0)
    if scores_full is not None:
        scores_full = np.asarray(scores_full)
    if cfg.kmax:
        _ranking_stats(out, lay, cfg, Yb, labels, inv_p)
    if cfg.auc:
        _auc_stats(out, lay, Yb, scores_full, row0)
    if cfg.decision:
        _decision_stats(out, lay, cfg, Yb, labels, scores, scores_full)
    return out


def _ratio(a: float, b: float) -> float:
    return float(a) / float(b) if b > 0 else math.nan


def _futures_of(operands) -> list:
    """The ``distributed`` futures (scattered operands) in the graphs of ``operands``' arrays."""
    try:
        from distributed import futures_of
    except ImportError:  # pragma: no cover - distributed is a dependency
        return []
    return [future for _, value, _ in operands if value is not None for future in futures_of(value)]


def _finalize_keeping(total, cfg, ks, *futures) -> dict:
    return finalize(total, cfg, ks)


def finalize(total: np.ndarray, cfg: _Config, ks: tuple[int, ...]) -> dict:
    """Metrics from the summed statistics (see the module docstring for the definitions)."""
    lay = cfg.layout()
    g = {name: total[s] for name, s in lay.items()}
    N = float(g["n_rows"][0])
    res: dict = {}
    if cfg.kmax:
        for name, key in (("P", "hits"), ("nDCG", "ndcg"), ("R", "recall"), ("Acc", "acc")):
            for k in ks:
                value = g[key][k - 1] / k if key == "hits" else g[key][k - 1]
                res[f"{name}@{k}"] = _ratio(value, N)
        if cfg.ps:
            for k in ks:
                res[f"PSP@{k}"] = _ratio(g["psp_num"][k - 1], g["psp_den"][k - 1])
            for k in ks:
                res[f"PSnDCG@{k}"] = _ratio(g["psndcg_num"][k - 1], g["psndcg_den"][k - 1])
        res["error"] = 1.0 - _ratio(g["acc"][0], N)
    if cfg.auc:
        res["avg_AUC"] = _ratio(g["auc_sum"][0], g["auc_rows"][0])
        res["avg_AUC_rows"] = int(g["auc_rows"][0])
    if cfg.decision:
        tp, fp, fn = (float(g[x][0]) for x in ("tp", "fp", "fn"))
        res["hamming_loss"] = _ratio(fp + fn, N * cfg.n_labels)
        res["micro_F1"] = _ratio(2 * tp, 2 * tp + fp + fn)
        if cfg.macro:
            denom = 2 * g["tp_l"] + g["fp_l"] + g["fn_l"]
            seen = denom > 0
            res["macro_F1"] = float(np.mean(2 * g["tp_l"][seen] / denom[seen])) if np.any(seen) else math.nan
        if cfg.decision == "topk_threshold":
            res["threshold_truncated_rows"] = int(g["truncated"][0])
    res["n_samples"] = int(N)
    res["n_samples_without_labels"] = int(g["n_empty"][0])
    return res


# --------------------------------------------------------------------------------------------
# input checks and alignment


def _fmt_chunks(chunks: tuple) -> str:
    shown = ", ".join(str(c) for c in chunks[:4])
    return f"({shown}{', ...' if len(chunks) > 4 else ''})"


def _known_rows(A: da.Array, name: str) -> None:
    if any(math.isnan(c) for dim in A.chunks for c in dim):
        raise ValueError(f"{name} has unknown chunk sizes; compute them first: {name} = {name}.compute_chunk_sizes()")


def _shape(A) -> tuple:
    return tuple(A.shape) if hasattr(A, "shape") else np.shape(A)


def _row_chunks_hint(*arrays) -> tuple | None:
    for A in arrays:
        if isinstance(A, da.Array) and A.ndim >= 1 and not any(math.isnan(c) for c in A.chunks[0]):
            return A.chunks[0]
    return None


def _is_sparse(A) -> bool:
    return sp.issparse(A) or (isinstance(A, da.Array) and sp.issparse(getattr(A, "_meta", None)))


def _as_truth(Y, hint) -> da.Array:
    if isinstance(Y, da.Array):
        if Y.ndim != 2:
            raise ValueError(f"Y must be 2-D (n_samples, n_labels), but has shape {Y.shape}")
        _known_rows(Y, "Y")
        if len(Y.chunks[1]) != 1:
            raise ValueError(
                f"Y must be chunked by rows only (one chunk along its {Y.shape[1]} labels), but has "
                f"{len(Y.chunks[1])} column chunks {_fmt_chunks(Y.chunks[1])}; open it with "
                f"xmldask.store.open_dataset(url).Y, or wrap an in-memory matrix with "
                f"da.from_array(Y, chunks=(block_rows, -1), asarray=False)"
            )
        return Y
    if isinstance(Y, np.ndarray) and Y.ndim == 2 and Y.size and (Y.min() < 0 or Y.max() > 1):
        raise ValueError(f"Y must be the truth (0/1 relevance, n_samples x n_labels), but holds values from "
                         f"{Y.min()} to {Y.max()}: are these predicted label ids? The truth goes first: "
                         f"evaluate(Y, labels, ...), precision_at_k(Y, labels, k=...)")
    if sp.issparse(Y) or (isinstance(Y, np.ndarray) and Y.ndim == 2):
        Y = sp.csr_matrix(Y)
        return da.from_array(Y, chunks=(hint or (Y.shape[0],), -1), asarray=False, fancy=False)
    raise TypeError(
        f"Y must be a dask array of CSR row blocks (open_dataset(url).Y) or a scipy.sparse matrix, "
        f"but is a {type(Y).__name__}"
    )


def _align(A, Y: da.Array, name: str, n_cols: int | None = None, kind: str | None = None) -> da.Array:
    """A dense 2-D operand with ``Y``'s row chunks and one column chunk."""
    if sp.issparse(A):
        raise TypeError(f"{name} must be dense, but is a {type(A).__name__}; pass {name}.toarray()")
    if not isinstance(A, da.Array):
        A = np.asarray(A)
    shape = _shape(A)
    if len(shape) != 2:
        raise ValueError(f"{name} must be 2-D, but has shape {shape}")
    if shape[0] != Y.shape[0]:
        raise ValueError(
            f"{name} has {shape[0]} rows but Y has {Y.shape[0]}; they must hold the same samples in the same order"
        )
    if n_cols is not None and shape[1] != n_cols:
        raise ValueError(
            f"{name} must have shape {(Y.shape[0], n_cols)} (one column per label of Y), but has shape {shape}"
        )
    if kind == "int" and not np.issubdtype(A.dtype, np.integer):
        raise TypeError(f"{name} must hold integer label ids (-1 for padding), but has dtype {A.dtype}")
    if kind == "float" and not (np.issubdtype(A.dtype, np.floating) or np.issubdtype(A.dtype, np.integer)):
        raise TypeError(f"{name} must hold real scores, but has dtype {A.dtype}")
    if isinstance(A, da.Array):
        _known_rows(A, name)
        if tuple(A.chunks[0]) != tuple(Y.chunks[0]) or len(A.chunks[1]) != 1:
            A = A.rechunk((Y.chunks[0], -1))
        return A
    return da.from_array(A, chunks=(Y.chunks[0], -1))


def _check_ks(ks, top_k: int | None) -> tuple[int, ...]:
    if isinstance(ks, numbers.Integral):
        ks = (ks,)
    ks = tuple(ks)
    if not ks or not all(isinstance(k, numbers.Integral) and k >= 1 for k in ks):
        raise ValueError(f"ks must be positive integers, such as (1, 3, 5), but is {ks!r}")
    ks = tuple(sorted({int(k) for k in ks}))
    if top_k is not None and ks[-1] > top_k:
        raise ValueError(
            f"k={ks[-1]} is larger than the {top_k} predictions per row (labels has {top_k} columns); "
            f"pass ks with every k <= {top_k}, or predict with top_k >= {ks[-1]}"
        )
    return ks


def _as_inv_propensity(propensities, n_labels: int) -> np.ndarray:
    if isinstance(propensities, da.Array):
        propensities = propensities.compute()
    p = np.asarray(propensities, dtype=np.float64)
    if p.shape != (n_labels,):
        raise ValueError(
            f"propensities must have shape ({n_labels},), one per label of Y, but has shape {p.shape}; "
            f"compute them with propensity(train.label_counts, train.n_samples)"
        )
    if not np.all(np.isfinite(p)) or np.any(p <= 0):
        raise ValueError("propensities must be finite and positive (p_l in (0, 1]); see propensity()")
    return 1.0 / p


# --------------------------------------------------------------------------------------------
# entry points


def evaluate(Y, labels=None, scores=None, *, ks=(1, 3, 5), propensities=None, scores_full=None,
             threshold: float | None = None, decision_k: int | None = None, macro: bool = True, split_every: int = 8,
             compute: bool = True):
    """Every applicable metric in one pass over the row blocks.

    Parameters
    ----------
    Y : dask.array.Array or scipy.sparse matrix, shape (n_samples, n_labels)
        The truth, CSR row blocks (``open_dataset(url).Y``). An in-memory matrix is split like
        ``labels`` (or ``scores_full``) when that is a Dask array, else kept as one block. Every
        metric takes the truth first, then the predictions, as scikit-learn's do.
    labels : numpy.ndarray or dask.array.Array of int, shape (n_samples, top_k), or None
        Top-k predicted label ids, best first; -1 is padding. ``None`` skips the top-k metrics.
    scores : numpy.ndarray or dask.array.Array, shape (n_samples, top_k), or None
        Their scores (non-increasing along each row; checked). Needed only for ``threshold`` without
        ``scores_full``.
    ks : int or sequence of int, default (1, 3, 5)
        The ``k`` of ``P@k``, ``nDCG@k``, ``PSP@k``, ``PSnDCG@k``, ``R@k``, ``Acc@k``; each
        ``<= top_k``.
    propensities : array_like of shape (n_labels,), optional
        ``p_l`` from :func:`propensity` on the *training* label counts; enables ``PSP@k`` and
        ``PSnDCG@k``.
    scores_full : dask.array.Array or numpy.ndarray, shape (n_samples, n_labels), optional
        Dense scores of every label (row blocks); enables ``avg_AUC`` and exact thresholding.
    threshold : float, optional
        Decide "label predicted" iff its score ``>= threshold`` (``scores_full`` if given, else the
        top-k ``scores``); enables ``hamming_loss``, ``micro_F1``, ``macro_F1``.
    decision_k : int, optional
        Alternatively, predict each row's top ``decision_k`` labels (not with ``threshold``).
    macro : bool, default True
        Compute ``macro_F1`` (its statistics are three ``n_labels`` vectors per block).
    split_every : int, default 8
        Most block results summed by one task of the tree reduction.
    compute : bool, default True
        ``False`` returns a ``dask.delayed`` object of the dict instead, to be computed together with
        other work.

    Returns
    -------
    dict
        Metric name to ``float``: ``"P@k"``, ``"nDCG@k"``, ``"R@k"``, ``"Acc@k"`` for each ``k``
        and ``"error"`` (with ``labels``); ``"PSP@k"``, ``"PSnDCG@k"`` (with ``propensities``);
        ``"avg_AUC"`` and ``"avg_AUC_rows"`` (with ``scores_full``); ``"hamming_loss"``,
        ``"micro_F1"``, ``"macro_F1"`` (with ``threshold`` or ``decision_k``;
        ``"threshold_truncated_rows"`` when thresholding top-k scores); always ``"n_samples"`` and
        ``"n_samples_without_labels"``. Definitions and conventions: module :mod:`xmldask.metrics`.

    References
    ----------
    The Extreme Classification Repository (Bhatia et al.) for P@k, nDCG@k, PSP@k, PSnDCG@k, R@k;
    Jain, Prabhu, Varma (KDD 2016) for the propensity-scored metrics; Yu, Jain, Kar, Dhillon (LEML,
    ICML 2014, Appendix E.1) for top-K accuracy, Hamming loss and average AUC.
    """
    for name, A in (("labels", labels), ("scores", scores), ("scores_full", scores_full)):
        if A is not None and _is_sparse(A):
            raise TypeError(f"{name} is a sparse matrix: is it the truth? The truth goes first: "
                            f"evaluate(Y, labels, scores, ...), precision_at_k(Y, labels, k=...)")
    hint = _row_chunks_hint(labels, scores, scores_full)
    Y = _as_truth(Y, hint)
    n_samples, n_labels = Y.shape
    if labels is None and scores is not None:
        raise ValueError("scores were given without labels; pass the top-k label ids as labels")
    if threshold is not None and decision_k is not None:
        raise ValueError("pass either threshold (decide by score) or decision_k (decide by rank), not both")
    if split_every is None or not isinstance(split_every, numbers.Integral) or split_every < 2:
        raise ValueError(f"split_every must be an integer of at least 2, but is {split_every!r}")

    operands = [("Yb", Y, ROWS), ("row_start", da.arange(n_samples, chunks=(Y.chunks[0],)), ROWS)]
    top_k = None
    if labels is not None:
        L = _align(labels, Y, "labels", kind="int")
        top_k = L.shape[1]
        operands.append(("labels", L, ROWS))
        if scores is not None:
            if tuple(_shape(scores)) != tuple(_shape(labels)):
                raise ValueError(
                    f"scores must have the shape of labels {tuple(_shape(labels))} (one score per predicted "
                    f"label), but has shape {tuple(_shape(scores))}"
                )
            operands.append(("scores", _align(scores, Y, "scores", kind="float"), ROWS))
    ks = _check_ks(ks, top_k)
    if propensities is not None and labels is None:
        raise ValueError("propensities need top-k labels: pass labels (the PS metrics are top-k metrics)")
    inv_p = None
    if propensities is not None:
        inv_p = _as_inv_propensity(propensities, n_labels)
        # scattered when large (a million labels): never a label-sized array in the graph sent to the scheduler
        operands.append(("inv_p", dense_operand(inv_p, name="inv_p"), WHOLE))
    if scores_full is not None:
        operands.append(("scores_full", _align(scores_full, Y, "scores_full", n_cols=n_labels, kind="float"), ROWS))

    decision = None
    if threshold is not None:
        if not isinstance(threshold, numbers.Real) or not math.isfinite(threshold):
            raise ValueError(f"threshold must be a finite number, but is {threshold!r}")
        if scores_full is not None:
            decision = "full"
        elif scores is not None:
            decision = "topk_threshold"
        else:
            raise ValueError("threshold needs scores: pass scores_full (exact) or the top-k scores with labels")
    elif decision_k is not None:
        if labels is None:
            raise ValueError("decision_k needs the top-k labels: pass labels")
        if not isinstance(decision_k, numbers.Integral) or not 1 <= decision_k <= top_k:
            raise ValueError(
                f"decision_k must be an integer in [1, {top_k}] (labels has {top_k} columns), but is {decision_k!r}"
            )
        decision = "topk"

    cfg = _Config(
        n_labels=int(n_labels),
        kmax=ks[-1] if labels is not None else 0,
        ps=inv_p is not None,
        auc=scores_full is not None,
        decision=decision,
        threshold=float(threshold) if threshold is not None else 0.0,
        decision_k=int(decision_k or 0),
        macro=bool(macro) and decision is not None,
    )
    total = block_sum(block_stats, operands, tail=(cfg.size,), dtype=np.float64, token="metrics-block",
                      static={"cfg": cfg}, split_every=int(split_every))
    # the futures of scattered operands ride along as arguments: a delayed call keeps a future alive only when it
    # holds it itself (through the array's graph, the conversion to a delayed graph would drop it)
    result = dask.delayed(_finalize_keeping, pure=True)(total, cfg, ks, *_futures_of(operands))
    if not compute:
        return result
    (res,) = dask.compute(result)
    if res.get("threshold_truncated_rows"):
        logger.warning(
            "%d rows have all %d top-k scores >= threshold %g: labels beyond their top k may also pass it and "
            "were counted as not predicted; pass scores_full (or predict more labels) for exact F1/Hamming loss",
            res["threshold_truncated_rows"], top_k, threshold,
        )
    return res


def paired_gain(hits, base_hits, *, sigmas: float = 2.0) -> dict:
    """Whether ``hits`` (per row, e.g. a top-1 label right) beat ``base_hits`` on the same rows by more than their
    noise: the rows only ``hits`` gets right (``wins``) less those only ``base_hits`` gets right (``losses``) must
    exceed ``sigmas`` standard deviations of that difference, ``sqrt(wins + losses)`` (McNemar's sign test;
    2 sigmas: about 2.5 % one-sided). The rows both get right or wrong say nothing about the difference, so the
    test resolves gains much smaller than the standard error of either score.

    Returns
    -------
    dict
        ``wins``, ``losses`` (int) and ``resolved`` (bool).

    Examples
    --------
    >>> import numpy as np
    >>> paired_gain(np.r_[np.ones(30), np.zeros(70)], np.r_[np.ones(20), np.zeros(80)])
    {'wins': 10, 'losses': 0, 'resolved': True}
    """
    hits, base_hits = np.asarray(hits, bool), np.asarray(base_hits, bool)
    if hits.shape != base_hits.shape:
        raise ValueError(f"hits {hits.shape} and base_hits {base_hits.shape} must be of the same rows")
    wins, losses = int(np.sum(hits & ~base_hits)), int(np.sum(base_hits & ~hits))
    return {"wins": wins, "losses": losses, "resolved": bool(wins - losses > sigmas * math.sqrt(wins + losses))}


def precision_at_k(Y, labels, *, k: int = 5) -> float:
    """``P@k``: the fraction of the top ``k`` predicted labels that are relevant, averaged over rows.

    Parameters
    ----------
    Y : dask.array.Array or scipy.sparse matrix, shape (n_samples, n_labels)
        The truth (CSR row blocks).
    labels : array_like or dask.array.Array of int, shape (n_samples, top_k)
        Top-k label ids, best first (-1: padding); ``k <= top_k``.
    k : int, default 5

    Returns
    -------
    float

    References
    ----------
    The Extreme Classification Repository (Bhatia et al.), precision@k.
    """
    return evaluate(Y, labels, ks=(k,))[f"P@{k}"]


def ndcg_at_k(Y, labels, *, k: int = 5) -> float:
    """``nDCG@k``, normalised by the ideal DCG over ``min(k, |y_i|)`` positives (shapes: :func:`precision_at_k`).

    References
    ----------
    The Extreme Classification Repository (Bhatia et al.), nDCG@k.
    """
    return evaluate(Y, labels, ks=(k,))[f"nDCG@{k}"]


def psprecision_at_k(Y, labels, *, propensities, k: int = 5) -> float:
    """Normalised propensity-scored precision ``PSP@k`` (module docstring; shapes: :func:`precision_at_k`).

    ``propensities`` has shape ``(n_labels,)``, from :func:`propensity` on the training counts.

    References
    ----------
    H. Jain, Y. Prabhu, M. Varma, KDD 2016; normalisation of the XC repository's ``psprecision``.
    """
    return evaluate(Y, labels, ks=(k,), propensities=propensities)[f"PSP@{k}"]


def psndcg_at_k(Y, labels, *, propensities, k: int = 5) -> float:
    """Normalised propensity-scored ``PSnDCG@k`` (module docstring; shapes: :func:`psprecision_at_k`).

    References
    ----------
    H. Jain, Y. Prabhu, M. Varma, KDD 2016; normalisation of the XC repository's ``psndcg``.
    """
    return evaluate(Y, labels, ks=(k,), propensities=propensities)[f"PSnDCG@{k}"]


def recall_at_k(Y, labels, *, k: int = 5) -> float:
    """``R@k``: the fraction of a row's relevant labels among its top ``k``, averaged over rows.

    Rows without relevant labels score 0 (XC repository convention). Shapes: :func:`precision_at_k`.
    """
    return evaluate(Y, labels, ks=(k,))[f"R@{k}"]


def top_k_accuracy(Y, labels, *, k: int = 1) -> float:
    """``Acc@k``: the fraction of rows with a relevant label among the top ``k`` (multiclass top-k accuracy).

    ``1 - top_k_accuracy(Y, labels, k=1)`` is the multiclass test error. Shapes: :func:`precision_at_k`.
    """
    return evaluate(Y, labels, ks=(k,))[f"Acc@{k}"]


def average_auc(Y, scores_full) -> float:
    """LEML's average AUC: the per-row ROC AUC over all labels, averaged over rows where it is defined.

    Parameters
    ----------
    Y : dask.array.Array or scipy.sparse matrix, shape (n_samples, n_labels)
        The truth.
    scores_full : dask.array.Array or numpy.ndarray, shape (n_samples, n_labels)
        Dense scores of every label, in row blocks.

    Returns
    -------
    float

    References
    ----------
    H.-F. Yu, P. Jain, P. Kar, I. S. Dhillon. Large-scale Multi-label Learning with Missing Labels.
    ICML 2014, Appendix E.1 (after Bucak et al., ICCV 2009).
    """
    return evaluate(Y, scores_full=scores_full)["avg_AUC"]


def _decision_metrics(labels, scores, Y, scores_full, threshold, decision_k) -> dict:
    if threshold is None and decision_k is None:
        raise ValueError("pass a decision rule: threshold=t (scores >= t are predicted) or decision_k=k (top k)")
    return evaluate(Y, labels, scores, ks=(1,), scores_full=scores_full, threshold=threshold, decision_k=decision_k)


def hamming_loss(Y, *, labels=None, scores=None, scores_full=None, threshold: float | None = None,
                 decision_k: int | None = None) -> float:
    """Hamming loss ``(FP + FN) / (n_samples * n_labels)`` of thresholded or top-k decisions.

    Parameters
    ----------
    Y : dask.array.Array or scipy.sparse matrix, shape (n_samples, n_labels)
    labels, scores : shape (n_samples, top_k), optional
        Top-k predictions (for ``decision_k``, or ``threshold`` without ``scores_full``).
    scores_full : shape (n_samples, n_labels), optional
        Dense scores (exact thresholding).
    threshold, decision_k
        The decision rule; see :func:`evaluate`.

    References
    ----------
    LEML (Yu et al., ICML 2014), Appendix E.1: decision values rounded to 0/1 (``threshold=0.5``).
    """
    return _decision_metrics(labels, scores, Y, scores_full, threshold, decision_k)["hamming_loss"]


def f1_scores(Y, *, labels=None, scores=None, scores_full=None, threshold: float | None = None,
              decision_k: int | None = None) -> tuple[float, float]:
    """Micro- and macro-averaged F1 of thresholded or top-k decisions (arguments: :func:`hamming_loss`).

    Returns
    -------
    micro_F1, macro_F1 : float
        See the module docstring for the macro average over labels that are true or predicted.
    """
    res = _decision_metrics(labels, scores, Y, scores_full, threshold, decision_k)
    return res["micro_F1"], res["macro_F1"]


_ORDER = ("P", "nDCG", "PSP", "PSnDCG", "R", "Acc")
_SINGLE = ("error", "avg_AUC", "hamming_loss", "micro_F1", "macro_F1")
_COUNTS = ("n_samples", "n_samples_without_labels", "avg_AUC_rows", "threshold_truncated_rows")


def report(results: dict, *, digits: int = 4, title: str | None = None) -> str:
    """One Markdown table (metric | value) of the results of :func:`evaluate`.

    Parameters
    ----------
    results : dict
        As returned by :func:`evaluate` (unknown keys are listed after the known ones). A
        ``"baseline"`` entry (a dict of the same metrics for a trivial model, as
        :func:`xmldask.jobs.evaluate` adds) becomes a second column, with the lift over it.
    digits : int, default 4
        Decimals shown for metric values (counts are shown as integers).
    title : str, optional
        A header line above the table (for example the run or model name).

    Returns
    -------
    str
        Markdown: ranking metrics grouped by family and increasing ``k``, then the single metrics,
        then the counts.
    """
    def family_key(name: str):
        fam, _, k = name.partition("@")
        return (_ORDER.index(fam), int(k)) if fam in _ORDER and k.isdigit() else None

    def shown(name: str, value) -> str:
        if name in _COUNTS or isinstance(value, numbers.Integral):
            return f"{int(value)}"
        if isinstance(value, numbers.Real):
            return "nan" if math.isnan(value) else f"{value:.{digits}f}"
        return str(value)

    baseline = results.get("baseline") if isinstance(results.get("baseline"), dict) else None
    results = {name: value for name, value in results.items() if name != "baseline" or baseline is None}
    ranked = sorted((n for n in results if family_key(n) is not None), key=family_key)
    single = [n for n in _SINGLE if n in results]
    counts = [n for n in _COUNTS if n in results]
    rest = [n for n in results if n not in ranked and n not in single and n not in counts]
    lines = [f"**{title}**", ""] if title else []
    if baseline is None:
        lines += ["| metric | value |", "|---|---:|"]
    else:
        lines += ["| metric | value | baseline: most frequent labels | ratio |", "|---|---:|---:|---:|"]
    for name in ranked + single + rest + counts:
        value = results[name]
        if baseline is None:
            lines.append(f"| {name} | {shown(name, value)} |")
            continue
        base = baseline.get(name)
        ratio = f"{value / base:.2f}" if isinstance(base, numbers.Real) and base > 0 and name in ranked else ""
        lines.append(f"| {name} | {shown(name, value)} | {'' if base is None else shown(name, base)} | {ratio} |")
    return "\n".join(lines) + "\n"
