"""PECOS XR-Linear for bench/peers.py, run by the Python of the PECOS virtualenv (libpecos needs numpy < 2).

Reads the L2-normalised CSR matrices ``X_train``, ``Y_train``, ``X_test`` (``.npz``) named in the JSON spec
(argument 1), builds PIFA label features and the hierarchical k-means cluster chain (``Indexer.gen``
defaults), trains ``XLinearModel`` with its defaults, predicts the top ``top_k`` labels of every test row
and writes ``labels.npy`` / ``scores.npy`` (best first) into ``spec["out"]``; prints its figures as JSON.
It imports nothing from xmldask.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path


def _peak_rss_mb() -> float:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmHWM:")) / 1024


def main(spec: dict) -> None:
    import numpy as np
    import scipy.sparse as sp
    from pecos.xmc import Indexer, LabelEmbeddingFactory
    from pecos.xmc.xlinear.model import XLinearModel

    out = Path(spec["out"])
    out.mkdir(parents=True, exist_ok=True)
    k = spec["top_k"]
    X = sp.load_npz(spec["X_train"]).tocsr().astype(np.float32)
    Y = sp.load_npz(spec["Y_train"]).tocsr().astype(np.float32)
    Xt = sp.load_npz(spec["X_test"]).tocsr().astype(np.float32)
    start = time.perf_counter()
    label_feat = LabelEmbeddingFactory.create(Y, X, method="pifa")
    chain = Indexer.gen(label_feat, seed=0)
    model = XLinearModel.train(X, Y, C=chain)
    train_s = time.perf_counter() - start
    model.save(str(out / "model"))
    start = time.perf_counter()
    P = model.predict(Xt, only_topk=k).tocsr()
    predict_s = time.perf_counter() - start
    labels = np.full((Xt.shape[0], k), -1, dtype=np.int32)
    scores = np.full((Xt.shape[0], k), -np.inf, dtype=np.float32)
    for i in range(Xt.shape[0]):
        s, e = P.indptr[i], P.indptr[i + 1]
        order = np.argsort(-P.data[s:e], kind="stable")[:k]
        labels[i, : len(order)] = P.indices[s:e][order]
        scores[i, : len(order)] = P.data[s:e][order]
    np.save(out / "labels.npy", labels)
    np.save(out / "scores.npy", scores)
    size = sum(p.stat().st_size for p in (out / "model").rglob("*") if p.is_file())
    print(json.dumps({"train_s": train_s, "predict_s": predict_s, "peak_rss_mb": _peak_rss_mb(), "model_bytes": size,
                      "n_test": Xt.shape[0],
                      "settings": "PIFA + Indexer.gen (hierarchical 2-means, leaves <= 100) + XLinearModel.train "
                                  "defaults, beam 10; rows L2-normalised"}))


if __name__ == "__main__":
    main(json.loads(sys.argv[1]))
