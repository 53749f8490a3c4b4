"""Tests of xmldask.metrics: every metric against a plain brute-force reference written here."""

from __future__ import annotations

import logging
import math

import dask
import dask.array as da
import numpy as np
import pytest
import scipy.sparse as sp
from dask.delayed import Delayed

from xmldask.metrics import (
    PROPENSITY_PARAMETERS,
    average_auc,
    evaluate,
    f1_scores,
    hamming_loss,
    inverse_propensity,
    ndcg_at_k,
    precision_at_k,
    propensity,
    psndcg_at_k,
    psprecision_at_k,
    recall_at_k,
    report,
    top_k_accuracy,
)

KS = (1, 3, 5)
ROW_CHUNKS = (5, 11, 1, 13, 7)  # uneven row blocks of Y (37 rows)
PRED_CHUNKS = (20, 17)  # different row blocks of the predictions: must be aligned


# --------------------------------------------------------------------------------------------
# data


def make_data(seed=0, *, n=37, n_labels=12, top_k=6, dtype=np.float64, multiclass=False):
    """Truth (dense 0/1), top-k labels with -1 padding, sorted scores with ties, full scores with ties."""
    rng = np.random.default_rng(seed)
    T = np.zeros((n, n_labels), dtype=np.int8)
    for i in range(n):
        if multiclass:
            T[i, rng.integers(n_labels)] = 1
        elif i % 6 != 2:  # every sixth row has no labels
            T[i, rng.choice(n_labels, size=rng.integers(1, 6), replace=False)] = 1
    T[0, :] = 1 if not multiclass else T[0, :]  # a row with every label (AUC undefined)
    full = np.round(rng.normal(size=(n, n_labels)) + T, 1).astype(dtype)  # rounding: ties
    full[3, :] = 0.5  # a row of all-equal scores
    labels = np.full((n, top_k), -1, dtype=np.int64)
    scores = np.full((n, top_k), -np.inf, dtype=dtype)
    for i in range(n):
        order = np.argsort(-full[i], kind="stable")
        m = top_k - (i % 3)  # up to 2 padded slots per row
        labels[i, :m] = order[:m]
        scores[i, :m] = full[i, order[:m]]
    return T, labels, scores, full


def chunked(T, labels, scores, full, *, y_chunks=ROW_CHUNKS, pred_chunks=PRED_CHUNKS):
    Y = da.from_array(sp.csr_matrix(T), chunks=(y_chunks, -1), asarray=False, fancy=False)
    return (Y, da.from_array(labels, chunks=(pred_chunks, -1)), da.from_array(scores, chunks=(pred_chunks, -1)),
            da.from_array(full, chunks=(pred_chunks, 5)))


# --------------------------------------------------------------------------------------------
# brute-force references (loops over rows, independent of the implementation)


def disc(r):  # rank r = 1, 2, ...
    return 1.0 / math.log2(r + 1)


def ref_topk(T, labels, ks, inv_p=None):
    n = T.shape[0]
    out = {}
    for k in ks:
        p = nd = rc = acc = 0.0
        psp_num = psp_den = psn_num = psn_den = 0.0
        for i in range(n):
            true = set(np.flatnonzero(T[i]).tolist())
            top = [int(l) for l in labels[i, :k]]
            hits = [l >= 0 and l in true for l in top]
            p += sum(hits) / k
            if true:
                dcg = sum(disc(r + 1) for r, h in enumerate(hits) if h)
                idcg = sum(disc(r + 1) for r in range(min(k, len(true))))
                nd += dcg / idcg
                rc += sum(hits) / len(true)
            acc += any(hits)
            if inv_p is not None and true:
                ideal = sorted((inv_p[l] for l in true), reverse=True)[:k]
                psp_num += sum(inv_p[l] for l, h in zip(top, hits) if h)
                psp_den += sum(ideal)
                psn_num += sum(inv_p[l] * disc(r + 1) for r, (l, h) in enumerate(zip(top, hits)) if h) / idcg
                psn_den += sum(w * disc(r + 1) for r, w in enumerate(ideal)) / idcg
        out[f"P@{k}"], out[f"nDCG@{k}"], out[f"R@{k}"], out[f"Acc@{k}"] = p / n, nd / n, rc / n, acc / n
        if inv_p is not None:
            out[f"PSP@{k}"], out[f"PSnDCG@{k}"] = psp_num / psp_den, psn_num / psn_den
    return out


def ref_auc(T, full):
    aucs = []
    for i in range(T.shape[0]):
        pos = [full[i, j] for j in range(T.shape[1]) if T[i, j]]
        neg = [full[i, j] for j in range(T.shape[1]) if not T[i, j]]
        if not pos or not neg:
            continue
        aucs.append(sum(1.0 if a > b else 0.5 if a == b else 0.0 for a in pos for b in neg) / (len(pos) * len(neg)))
    return float(np.mean(aucs)), len(aucs)


def ref_decision(T, Pm):
    """Hamming loss, micro-F1, macro-F1 of a dense 0/1 prediction matrix."""
    T, Pm = T.astype(bool), Pm.astype(bool)
    hl = float(np.mean(T != Pm))
    tp, fp, fn = np.sum(T & Pm), np.sum(~T & Pm), np.sum(T & ~Pm)
    micro = 2 * tp / (2 * tp + fp + fn)
    f1s = []
    for j in range(T.shape[1]):
        a, b, c = np.sum(T[:, j] & Pm[:, j]), np.sum(~T[:, j] & Pm[:, j]), np.sum(T[:, j] & ~Pm[:, j])
        if a + b + c:
            f1s.append(2 * a / (2 * a + b + c))
    return hl, float(micro), float(np.mean(f1s))


def pred_matrix_topk(labels, n_labels, k):
    Pm = np.zeros((labels.shape[0], n_labels), dtype=bool)
    for i in range(labels.shape[0]):
        for l in labels[i, :k]:
            if l >= 0:
                Pm[i, l] = True
    return Pm


def pred_matrix_topk_threshold(labels, scores, n_labels, t):
    Pm = np.zeros((labels.shape[0], n_labels), dtype=bool)
    for i in range(labels.shape[0]):
        for l, s in zip(labels[i], scores[i]):
            if l >= 0 and float(s) >= t:
                Pm[i, l] = True
    return Pm


def assert_close(res, ref, rtol=1e-12):
    for key, value in ref.items():
        assert key in res, key
        np.testing.assert_allclose(res[key], value, rtol=rtol, atol=1e-15, err_msg=key)


# --------------------------------------------------------------------------------------------
# every metric against the references


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_topk_metrics_match_reference(dtype):
    T, labels, scores, full = make_data(1, dtype=dtype)
    inv_p = 1.0 + np.random.default_rng(2).integers(0, 4, size=T.shape[1]).astype(float)  # ties in 1/p
    Y, L, S, _ = chunked(T, labels, scores, full)
    res = evaluate(Y, L, S, ks=KS, propensities=1.0 / inv_p)
    ref = ref_topk(T, labels, KS, inv_p)
    assert_close(res, ref)
    assert res["error"] == pytest.approx(1 - ref["Acc@1"])
    assert res["n_samples"] == 37
    assert res["n_samples_without_labels"] == sum(1 for i in range(37) if not T[i].any()) > 0
    assert {"P@1", "P@3", "P@5"} <= set(res)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_full_score_metrics_match_reference(dtype):
    T, labels, scores, full = make_data(3, dtype=dtype)
    Y, L, S, F = chunked(T, labels, scores, full)
    for t in (0.5, 0.0, 1.2):  # 0.5 and 1.2 hit tied (rounded) scores exactly
        res = evaluate(Y, L, S, ks=(1,), scores_full=F, threshold=t)
        Pm = np.array([[float(full[i, j]) >= t for j in range(T.shape[1])] for i in range(T.shape[0])])
        hl, micro, macro = ref_decision(T, Pm)
        assert_close(res, {"hamming_loss": hl, "micro_F1": micro, "macro_F1": macro})
    auc, rows = ref_auc(T, full)
    assert res["avg_AUC"] == pytest.approx(auc, rel=1e-12)
    assert res["avg_AUC_rows"] == rows < T.shape[0]  # the all-labels row and the empty rows are left out
    assert average_auc(Y, F) == pytest.approx(auc, rel=1e-12)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_decision_by_topk_scores_and_by_rank(dtype, caplog):
    T, labels, scores, full = make_data(4, dtype=dtype)
    Y, L, S, _ = chunked(T, labels, scores, full)
    n_labels = T.shape[1]
    with caplog.at_level(logging.WARNING, logger="xmldask.metrics"):
        res = evaluate(Y, L, S, ks=(1,), threshold=0.5)
    hl, micro, macro = ref_decision(T, pred_matrix_topk_threshold(labels, scores, n_labels, 0.5))
    assert_close(res, {"hamming_loss": hl, "micro_F1": micro, "macro_F1": macro})
    truncated = sum(1 for i in range(len(T)) if labels[i, -1] >= 0 and float(scores[i, -1]) >= 0.5)
    assert res["threshold_truncated_rows"] == truncated
    assert (truncated > 0) == ("beyond their top k" in caplog.text)
    for k in (1, 4, 6):
        res = evaluate(Y, L, S, ks=(1,), decision_k=k)
        hl, micro, macro = ref_decision(T, pred_matrix_topk(labels, n_labels, k))
        assert_close(res, {"hamming_loss": hl, "micro_F1": micro, "macro_F1": macro})
        assert hamming_loss(Y, labels=L, decision_k=k) == pytest.approx(hl, rel=1e-12)
        assert f1_scores(Y, labels=L, decision_k=k) == pytest.approx((micro, macro), rel=1e-12)


def test_multiclass():
    T, labels, scores, full = make_data(5, multiclass=True, n_labels=9)
    Y, L, S, F = chunked(T, labels, scores, full)
    res = evaluate(Y, L, S, ks=KS, scores_full=F)
    y = T.argmax(axis=1)
    for k in KS:
        assert res[f"Acc@{k}"] == pytest.approx(np.mean([y[i] in labels[i, :k] for i in range(len(y))]))
    assert res["error"] == pytest.approx(np.mean(labels[:, 0] != y))
    assert res["P@1"] == res["Acc@1"] == res["R@1"]
    assert res["avg_AUC"] == pytest.approx(ref_auc(T, full)[0], rel=1e-12)
    assert res["n_samples_without_labels"] == 0


def test_per_metric_functions_match_evaluate():
    T, labels, scores, full = make_data(6)
    Y, L, S, F = chunked(T, labels, scores, full)
    p = np.linspace(0.2, 1.0, T.shape[1])
    res = evaluate(Y, L, S, ks=(3,), propensities=p)
    assert precision_at_k(Y, L, k=3) == res["P@3"]
    assert ndcg_at_k(Y, L, k=3) == res["nDCG@3"]
    assert recall_at_k(Y, L, k=3) == res["R@3"]
    assert top_k_accuracy(Y, L, k=3) == res["Acc@3"]
    assert psprecision_at_k(Y, L, propensities=p, k=3) == res["PSP@3"]
    assert psndcg_at_k(Y, L, propensities=p, k=3) == res["PSnDCG@3"]


# --------------------------------------------------------------------------------------------
# streaming: block-count invariance, in-memory inputs, one compute


@pytest.mark.parametrize("y_chunks,pred_chunks", [((37,), (37,)), ((5, 11, 1, 13, 7), (20, 17)),
                                                  ((1,) * 37, (2,) * 18 + (1,))])
def test_block_count_invariance(y_chunks, pred_chunks):
    T, labels, scores, full = make_data(7, dtype=np.float32)
    Y, L, S, F = chunked(T, labels, scores, full, y_chunks=y_chunks, pred_chunks=pred_chunks)
    kw = dict(ks=KS, propensities=np.linspace(0.1, 1, T.shape[1]), scores_full=F, threshold=0.5)
    res = evaluate(Y, L, S, **kw, split_every=2)
    one = evaluate(sp.csr_matrix(T), labels, scores, **{**kw, "scores_full": full})  # in memory: one block
    assert res.keys() == one.keys()
    for key in res:
        assert res[key] == pytest.approx(one[key], rel=1e-12, abs=1e-15), key


def test_single_compute_and_lazy_result():
    T, labels, scores, full = make_data(8)
    Y, L, S, F = chunked(T, labels, scores, full)
    calls = []

    def counting_get(dsk, keys, **kwargs):
        calls.append(1)
        return dask.get(dsk, keys, **kwargs)

    with dask.config.set(scheduler=counting_get):
        res = evaluate(Y, L, S, scores_full=F, threshold=0.0, propensities=np.full(T.shape[1], 0.5))
    assert len(calls) == 1
    lazy = evaluate(Y, L, S, compute=False)
    assert isinstance(lazy, Delayed)
    assert lazy.compute()["P@5"] == res["P@5"]


def test_dense_in_memory_truth_and_zarr_predictions(tmp_path):
    zarr = pytest.importorskip("zarr")
    T, labels, scores, full = make_data(9)
    root = zarr.open_group(str(tmp_path / "pred.zarr"), mode="w")
    root.create_array("labels", data=labels, chunks=(8, labels.shape[1]))
    root.create_array("scores", data=scores, chunks=(8, scores.shape[1]))
    L, S = da.from_zarr(root["labels"]), da.from_zarr(root["scores"])
    res = evaluate(T, L, S, ks=KS)  # dense 0/1 NumPy truth, split like the predictions
    assert_close(res, ref_topk(T, labels, KS))


# --------------------------------------------------------------------------------------------
# a tiny example computed by hand


def test_hand_computed_example():
    # 3 samples, 5 labels. Truth: row 0 = {0, 2}, row 1 = {4}, row 2 = {} (no labels).
    Y = sp.csr_matrix(np.array([[1, 0, 1, 0, 0], [0, 0, 0, 0, 1], [0, 0, 0, 0, 0]]))
    labels = np.array([[2, 1, 0], [3, 4, -1], [0, 1, 2]])
    p = np.array([0.5, 1.0, 0.25, 1.0, 0.5])  # 1/p = 2, 1, 4, 1, 2
    res = evaluate(Y, labels, ks=(1, 3), propensities=p)
    # P@1: hits 1, 0, 0 -> 1/3.  P@3: (2/3 + 1/3 + 0) / 3 = 1/3.
    assert res["P@1"] == pytest.approx(1 / 3)
    assert res["P@3"] == pytest.approx(1 / 3)
    # nDCG@3: row 0 DCG = 1 + 1/log2(4) = 1.5, IDCG = 1 + 1/log2(3); row 1 DCG = 1/log2(3), IDCG = 1; row 2: 0.
    d3 = 1 / math.log2(3)
    assert res["nDCG@1"] == pytest.approx(1 / 3)
    assert res["nDCG@3"] == pytest.approx((1.5 / (1 + d3) + d3) / 3)
    # PSP@1: gains 1/p of hits = 4 (row 0: label 2); best: row 0 -> 4, row 1 -> 2: 4 / 6.
    assert res["PSP@1"] == pytest.approx(4 / 6)
    # PSP@3: gains 4 + 2 (row 0) + 2 (row 1) = 8; best 4 + 2 + 2 = 8 -> 1.
    assert res["PSP@3"] == pytest.approx(1.0)
    # PSnDCG@3: row 0 gain (4 + 2/2) / (1 + d3), best (4 + 2 d3) / (1 + d3); row 1 gain 2 d3 / 1, best 2.
    num = 5 / (1 + d3) + 2 * d3
    den = (4 + 2 * d3) / (1 + d3) + 2
    assert res["PSnDCG@3"] == pytest.approx(num / den)
    # R@3: row 0 2/2, row 1 1/1, row 2 0 -> 2/3; Acc@1 = 1/3; error = 2/3.
    assert res["R@3"] == pytest.approx(2 / 3)
    assert res["Acc@3"] == pytest.approx(2 / 3)
    assert res["error"] == pytest.approx(2 / 3)
    assert res["n_samples_without_labels"] == 1


def test_hand_computed_auc_with_ties():
    Y = sp.csr_matrix(np.array([[1, 0, 0, 1], [0, 0, 0, 0], [1, 1, 1, 1]]))
    S = np.array([[0.9, 0.9, 0.1, 0.3], [1.0, 2.0, 3.0, 4.0], [0.0, 0.0, 0.0, 0.0]], dtype=np.float32)
    # row 0: positives 0.9, 0.3 vs negatives 0.9, 0.1: pairs (0.9>0.9? tie 0.5), 1, 0, 1 -> 2.5/4.
    # rows 1 (no labels) and 2 (all labels) are undefined and left out.
    res = evaluate(Y, scores_full=S)
    assert res["avg_AUC"] == pytest.approx(2.5 / 4)
    assert res["avg_AUC_rows"] == 1


def test_propensity_formula():
    counts = np.array([0, 1, 10, 1000])
    N = 5000
    for A, B in PROPENSITY_PARAMETERS.values():
        C = (math.log(N) - 1) * (B + 1) ** A
        ref = [1 / (1 + C * math.exp(-A * math.log(c + B))) for c in counts]
        np.testing.assert_allclose(propensity(counts, N, A, B), ref, rtol=1e-14)
        np.testing.assert_allclose(inverse_propensity(counts, N, A=A, B=B), 1 / np.array(ref), rtol=1e-14)
    assert PROPENSITY_PARAMETERS == {"default": (0.55, 1.5), "wikipedia": (0.5, 0.4), "amazon": (0.6, 2.6)}
    with pytest.raises(ValueError, match="exceeds n_samples"):
        propensity(counts, 10)


def test_report_is_one_markdown_table():
    T, labels, scores, full = make_data(10)
    Y, L, S, F = chunked(T, labels, scores, full)
    res = evaluate(Y, L, S, propensities=np.full(T.shape[1], 0.5), scores_full=F, threshold=0.5)
    text = report(res, title="run 1")
    rows = [line for line in text.splitlines() if line.startswith("|")]
    assert rows[0] == "| metric | value |"
    names = [r.split("|")[1].strip() for r in rows[2:]]
    assert names[:3] == ["P@1", "P@3", "P@5"]
    assert set(names) == set(res)
    assert names.index("nDCG@5") < names.index("PSP@1") < names.index("avg_AUC") < names.index("n_samples")
    assert f"| P@1 | {res['P@1']:.4f} |" in text and "| n_samples | 37 |" in text


# --------------------------------------------------------------------------------------------
# errors


def test_errors_name_expected_found_and_fix():
    T, labels, scores, full = make_data(11)
    Y = sp.csr_matrix(T)
    with pytest.raises(ValueError, match=r"labels has 36 rows but Y has 37"):
        evaluate(Y, labels[:-1])
    with pytest.raises(ValueError, match=r"scores must have the shape of labels \(37, 6\).*\(37, 5\)"):
        evaluate(Y, labels, scores[:, :5])
    with pytest.raises(ValueError, match=r"k=7 is larger than the 6 predictions.*top_k >= 7"):
        evaluate(Y, labels, ks=(1, 7))
    with pytest.raises(ValueError, match="ks must be positive integers"):
        evaluate(Y, labels, ks=(0,))
    with pytest.raises(TypeError, match="integer label ids"):
        evaluate(Y, labels.astype(float))
    with pytest.raises(ValueError, match=r"propensities must have shape \(12,\).*\(11,\).*propensity\("):
        evaluate(Y, labels, propensities=np.ones(11))
    with pytest.raises(ValueError, match=r"scores_full must have shape \(37, 12\).*\(37, 11\)"):
        evaluate(Y, labels, scores_full=full[:, :11])
    with pytest.raises(ValueError, match="either threshold .* or decision_k"):
        evaluate(Y, labels, scores, threshold=0.5, decision_k=1)
    with pytest.raises(ValueError, match="threshold needs scores"):
        evaluate(Y, labels, threshold=0.5)
    with pytest.raises(ValueError, match=r"decision_k must be an integer in \[1, 6\]"):
        evaluate(Y, labels, decision_k=9)
    Ycols = da.from_array(Y, chunks=(10, 6), asarray=False, fancy=False)
    with pytest.raises(ValueError, match=r"chunked by rows only.*2 column chunks"):
        evaluate(Ycols, labels)


def test_the_truth_goes_first():
    """Every metric takes (Y, predictions); the old order (predictions, Y) is refused, not misread."""
    T, labels, scores, full = make_data(13)
    Y = sp.csr_matrix(T)
    for call in (lambda: precision_at_k(labels, Y, k=1), lambda: evaluate(labels, scores, Y),
                 lambda: ndcg_at_k(labels, da.from_array(Y, chunks=(10, -1), asarray=False), k=1)):
        with pytest.raises((TypeError, ValueError), match="truth goes first"):
            call()
    with pytest.raises(TypeError, match="truth goes first"):
        average_auc(full, Y)
    with pytest.raises(ValueError, match="truth goes first"):  # predicted ids in the truth's place
        evaluate(labels, labels)
    assert precision_at_k(Y, labels, k=1) == evaluate(Y, labels, ks=(1,))["P@1"]


def test_errors_found_in_blocks():
    T, labels, scores, full = make_data(12)
    Y, L, S, _ = chunked(T, labels, scores, full)
    bad = labels.copy()
    bad[30, 1] = 12
    with pytest.raises(ValueError, match=r"id 12 at row 30, rank 2: expected ids in \[0, 12\).*-1 for padding"):
        evaluate(Y, da.from_array(bad, chunks=(PRED_CHUNKS, -1)))
    bad[30, 1] = -2
    with pytest.raises(ValueError, match="id -2 at row 30"):
        evaluate(Y, bad)
    dup = labels.copy()
    dup[14, 2] = dup[14, 0]
    with pytest.raises(ValueError, match=f"id {dup[14, 0]} twice in row 14"):
        evaluate(Y, dup)
    unsorted = scores.copy()
    unsorted[20, 1] = unsorted[20, 0] + 1
    with pytest.raises(ValueError, match=r"sorted best first.*row 20.*np.argsort\(-scores"):
        evaluate(Y, labels, unsorted)
    nan_full = full.copy()
    nan_full[5, 3] = np.nan
    with pytest.raises(ValueError, match="NaN in row 5"):
        evaluate(Y, scores_full=nan_full)


def test_macro_f1_leaves_out_labels_neither_true_nor_predicted():
    T, labels, scores, full = make_data(13)
    T2 = np.hstack([T, np.zeros((T.shape[0], 3), dtype=T.dtype)])  # 3 labels nobody has ...
    full2 = np.hstack([full, np.full((T.shape[0], 3), -10.0)])  # ... and nobody predicts
    res = evaluate(sp.csr_matrix(T2), scores_full=full2, threshold=0.5)
    hl, micro, macro = ref_decision(T2, full2 >= 0.5)
    assert_close(res, {"hamming_loss": hl, "micro_F1": micro, "macro_F1": macro})
    assert res["macro_F1"] == pytest.approx(evaluate(sp.csr_matrix(T), scores_full=full,
                                                     threshold=0.5)["macro_F1"])


def test_on_dataset_stores_with_training_propensities(tmp_path):
    from xmldask.datasets import make_synthetic
    from xmldask.store import open_dataset, to_scipy

    kw = dict(n_features=40, n_labels=30, seed=1, block_rows=64)
    make_synthetic(str(tmp_path / "train.zarr"), n_samples=300, **kw)
    make_synthetic(str(tmp_path / "test.zarr"), n_samples=150, split="test", **kw)
    train, test = open_dataset(str(tmp_path / "train.zarr")), open_dataset(str(tmp_path / "test.zarr"))
    p = propensity(train.label_counts, train.n_samples)
    # predictions: the training popularity ranking, perturbed per row, in blocks of 40 rows (not 64)
    rng = np.random.default_rng(0)
    noisy = train.label_counts[None, :] + rng.normal(scale=3.0, size=(test.n_samples, test.n_labels))
    labels = np.argsort(-noisy, axis=1)[:, :5]
    scores = -np.sort(-noisy, axis=1)[:, :5]
    res = evaluate(test.Y, da.from_array(labels, chunks=(40, -1)), da.from_array(scores, chunks=(40, -1)),
                   propensities=p, scores_full=da.from_array(noisy, chunks=(40, -1)), threshold=10.0)
    T = to_scipy(test.Y).toarray()
    assert_close(res, ref_topk(T, labels, KS, 1 / p), rtol=1e-10)
    assert res["avg_AUC"] == pytest.approx(ref_auc(T, noisy)[0], rel=1e-10)
    hl, micro, macro = ref_decision(T, noisy >= 10.0)
    assert_close(res, {"hamming_loss": hl, "micro_F1": micro, "macro_F1": macro})


def test_label_sized_propensities_are_scattered_and_survive_a_delayed_result():
    """A million-label-sized propensity vector is scattered, not sent in the graph (no large-graph warning), and the
    delayed result (``compute=False``) computed after the arrays that built it are gone still finds it."""
    import gc
    import warnings

    import distributed

    n, n_labels = 300, 200_000  # 1.6 MB of inverse propensities: above the scatter threshold
    rng = np.random.default_rng(0)
    Y = sp.random(n, n_labels, density=3 / n_labels, format="csr", random_state=1, dtype=np.float32)
    Y.data[:] = 1
    labels = rng.integers(0, n_labels, (n, 5))
    labels[:, 0] = np.asarray(Y.argmax(axis=1)).ravel()
    scores = -np.sort(-rng.random((n, 5)), axis=1)
    propensities = rng.uniform(0.1, 1, n_labels)
    expected = evaluate(Y, labels, scores, propensities=propensities)
    with distributed.LocalCluster(n_workers=1, threads_per_worker=1, processes=False, dashboard_address=":0") as c, \
            distributed.Client(c), warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # "Sending large graph of size ..."
        result = evaluate(da.from_array(Y, chunks=(120, n_labels), asarray=False), labels, scores,
                          propensities=propensities, compute=False)
        gc.collect()
        (got,) = dask.compute(result)
    for key in ("P@1", "P@5", "PSP@5"):
        assert got[key] == pytest.approx(expected[key])
