"""Graph functions of the embedding decoder: lazy Dask arrays built from the kernels of :mod:`._kernels`.

Every function maps a kernel over the row blocks of ``X`` (one task per block; ``Y`` and per-row
weights chunked like ``X``); dense operands (``W``, ``Omega``, ``Q``) are shipped once per graph with
:func:`xmldask.linalg.dense_operand`, never copied into each task. Reductions reuse the tree sums
of :mod:`xmldask.linalg` (:func:`~xmldask.linalg.gram`, :func:`~xmldask.linalg.xt_b`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import dask
import dask.array as da
import numpy as np
import scipy.sparse as sp

from ..linalg import ROWS, WHOLE, dense_operand, per_block, per_block_objects, tree_combine
from ..linalg.passes import SCATTER_BYTES
from ..scheduling import current_client
from ..store.csr import block_reader
from . import _kernels as K

__all__ = ["HeldOut", "decision_scores", "decoder_features", "document_counts", "ensemble_probabilities",
           "ensemble_topk", "mean_topk", "normal_equations", "sgd_epoch", "topk", "transform_rows"]


@dataclass(frozen=True)
class HeldOut:
    """Which rows of every row block a fit holds out: a seed, a fraction and the row blocks' sizes.

    The rows themselves are never stored: block ``b``'s mask is :func:`._kernels.holdout_mask`
    ``(seed, b, chunks[b], fraction)``, drawn again wherever it is needed (in a task, in the SGD
    reader), so a fit keeps nothing of size ``n`` in the client or in its graphs.
    """

    seed: int
    fraction: float
    chunks: tuple[int, ...]

    def mask(self, block: int) -> np.ndarray:
        """``True`` for the held-out rows of row block ``block``."""
        return K.holdout_mask(self.seed, block, self.chunks[block], self.fraction)

    def n_train(self) -> int:
        """The number of rows not held out (drawn block by block: memory of one block's mask)."""
        return sum(int(c) - int(np.count_nonzero(self.mask(b))) for b, c in enumerate(self.chunks))

    def weights(self, dtype) -> da.Array:
        """Lazy per-row weights, 1 for a training row and 0 for a held-out one, chunked by ``chunks``."""
        dtype = np.dtype(dtype)
        return da.map_blocks(_training_weights, seed=self.seed, fraction=self.fraction, out_dtype=dtype, dtype=dtype,
                             chunks=(self.chunks,), meta=np.empty(0, dtype),
                             name=f"training-weights-{dask.base.tokenize(self, dtype)}")

    def rows(self, A: da.Array, *, held: bool) -> da.Array:
        """The held-out rows of ``A`` (``held=True``) or the others, lazily: ``A``'s row blocks, each keeping its
        rows of the split (``A`` chunked by :attr:`chunks`)."""
        if tuple(A.chunks[0]) != self.chunks:
            raise ValueError(f"the array's row blocks {A.chunks[0]} are not the split's {self.chunks}")
        n_held = [int(np.count_nonzero(self.mask(b))) for b in range(len(self.chunks))]
        counts = tuple(h if held else int(c) - h for c, h in zip(self.chunks, n_held))
        return A.map_blocks(_rows_of_split, seed=self.seed, fraction=self.fraction, held=held,
                            chunks=(counts, *A.chunks[1:]), dtype=A.dtype, meta=A._meta,
                            name=f"split-rows-{dask.base.tokenize(A, self, held)}")


@dataclass
class DecoderData:
    """What the decoder's steps share: the data, the held-out split, the feature map's state, the
    normal equations of the training rows, the held-out rows' features and the history so far."""

    X: da.Array
    Y: da.Array
    split: HeldOut
    state: dict
    G: np.ndarray
    FtY: np.ndarray
    n_train: int
    task: str
    loss_fn: object
    Fh: np.ndarray | None
    Yh: sp.csr_matrix | None
    t_start: float
    history: list = field(default_factory=list)


def _training_weights(seed: int, fraction: float, out_dtype, block_info=None) -> np.ndarray:
    info = block_info[None]
    mask = K.holdout_mask(seed, info["chunk-location"][0], info["chunk-shape"][0], fraction)
    return (~mask).astype(out_dtype)


def _rows_of_split(Ab, seed: int, fraction: float, held: bool, block_info=None):
    mask = K.holdout_mask(seed, block_info[0]["chunk-location"][0], Ab.shape[0], fraction)
    return Ab[mask if held else ~mask]


def _map_rows(func, X: da.Array, *, whole: dict, out_cols: int, dtype, token: str, static: dict | None = None):
    """``func(Xb=block, **whole, **static)`` for every row block; result ``(n_samples, out_cols)`` chunked like X.

    One :func:`xmldask.linalg.per_block` task per block: a store-backed ``X`` is read inside it.
    """
    operands = [("Xb", X, ROWS)] + [(name, dense_operand(value, name=name), WHOLE)
                                   for name, value in whole.items() if value is not None]
    return per_block(func, operands, tail=(out_cols,), dtype=dtype, token=token, stack=False, static=static)


def _transform_block(Xb, idf, normalize):
    return K.transform_rows(Xb, None if idf is None else idf, normalize=normalize)


def transform_rows(X: da.Array, idf: np.ndarray | None, *, normalize: bool = True) -> da.Array:
    """Lazy :func:`._kernels.transform_rows` of every row block (idf shipped once per graph)."""
    if idf is None:
        return X.map_blocks(K.transform_rows, normalize=normalize, dtype=X.dtype, meta=X._meta)
    w = dense_operand(np.asarray(idf, dtype=X.dtype).reshape(1, -1), name="idf")
    return da.blockwise(_transform_block, ("i", "j"), X, ("i", "j"), w, ("w", "j"), concatenate=True,
                        dtype=X.dtype, meta=X._meta, normalize=normalize)


def _binary_block(Xb):
    Xb = sp.csr_matrix(Xb) if sp.issparse(Xb) else sp.csr_matrix(np.asarray(Xb))
    Xb = Xb.astype(np.float64)
    Xb.eliminate_zeros()
    Xb.data[:] = 1.0
    return Xb


def document_counts(X: da.Array, weights=None) -> da.Array:
    """Lazy number of (weighted) rows in which each column is non-zero, shape ``(n_features,)``."""
    from ..linalg import column_sums

    B = X.map_blocks(_binary_block, dtype=np.float64, meta=sp.csr_matrix((0, 0), dtype=np.float64))
    return column_sums(B, weights=weights)


def _feature_operands(state: dict) -> tuple[dict, dict]:
    whole = {"W": state["W"], "intercept": state["intercept"], "omega": state.get("omega"),
             "phase": state.get("phase")}
    return whole, {"bandwidth": float(state.get("bandwidth") or 1.0)}


def decoder_features(X: da.Array, state: dict) -> da.Array:
    """Lazy decoder features ``[phi(X W + c), 1]``, shape ``(n_samples, m + 1)``, chunked like ``X``.

    ``state`` holds ``W`` (n_features, k), ``intercept`` (k,) and, for random Fourier features,
    ``omega`` (k, m), ``phase`` (m,) and ``bandwidth``.
    """
    whole, static = _feature_operands(state)
    m = state["omega"].shape[1] if state.get("omega") is not None else state["W"].shape[1]
    return _map_rows(K.decoder_features, X, whole=whole, static=static, out_cols=m + 1, dtype=state["W"].dtype,
                     token="decoder-features")


#: rows of a block turned into features at once (bounds the memory of a task to a few hundred MB)
SUB_ROWS = 4096


def _sub_rows(n_cols: int, budget: int = K.SCORE_BUDGET) -> int:
    return max(1, min(SUB_ROWS, budget // max(n_cols, 1)))


def _scores_kernel(Xb, W, intercept, Q, bias, omega=None, phase=None, bandwidth=1.0):
    n = Xb.shape[0]
    S = np.empty((n, Q.shape[1]), dtype=Q.dtype)
    step = _sub_rows(Q.shape[0])
    for a in range(0, n, step):
        F = K.decoder_features(Xb[a:a + step], W, intercept, omega, phase, bandwidth)
        np.matmul(F[:, :-1], Q, out=S[a:a + step])
        S[a:a + step] += bias
    return S


def _topk_kernel(Xb, W, intercept, Q, bias, omega=None, phase=None, bandwidth=1.0, k=5, budget=K.SCORE_BUDGET):
    n = Xb.shape[0]
    out = np.empty((n, 2 * k), dtype=np.float64)
    step = _sub_rows(max(Q.shape), budget)
    for a in range(0, n, step):
        F = K.decoder_features(Xb[a:a + step], W, intercept, omega, phase, bandwidth)
        labels, scores = K.topk_scores(F[:, :-1], Q, bias, k, budget=budget)
        out[a:a + step, :k], out[a:a + step, k:] = labels, scores
    return out


def decision_scores(X: da.Array, state: dict) -> da.Array:
    """Lazy dense scores ``phi(X W + c) Q + bias``, shape ``(n_samples, n_labels)``, chunked like ``X``."""
    whole, static = _feature_operands(state)
    whole.update(Q=state["Q"], bias=state["bias"])
    return _map_rows(_scores_kernel, X, whole=whole, static=static, out_cols=state["Q"].shape[1],
                     dtype=state["Q"].dtype, token="decision-function")


def topk(X: da.Array, state: dict, k: int, *, budget: int = K.SCORE_BUDGET) -> tuple[da.Array, da.Array]:
    """Lazy top-``k`` labels (int32) and scores (float32), each ``(n_samples, k)``, best first.

    One task per row block computes both (packed in one float64 block, sliced lazily): compute
    ``labels`` and ``scores`` together (``dask.compute(labels, scores)``) to make one pass.
    """
    whole, static = _feature_operands(state)
    whole.update(Q=state["Q"], bias=state["bias"])
    packed = _map_rows(_topk_kernel, X, whole=whole, static={**static, "k": int(k), "budget": int(budget)},
                       out_cols=2 * k, dtype=np.float64, token="predict-topk")
    return packed[:, :k].astype(np.int32), packed[:, k:].astype(np.float32)


def _normal_block(Xb, Yb, seed: int, fraction: float, block: int, state):
    """One block of the decoder's pass (see :func:`normal_equations`)."""
    mask = K.holdout_mask(seed, block, Xb.shape[0], fraction)
    Yb = sp.csr_matrix(Yb, dtype=np.float32)
    counts = np.diff(Yb.indptr)
    held = np.flatnonzero(mask)
    out = {"counts": (int(counts.min()) if counts.size else 2**62, int(counts.max()) if counts.size else 0),
           "held": [(Xb[held], Yb[held])] if held.size else []}
    keep = np.flatnonzero(~mask)
    Xb, Yb = Xb[keep], Yb[keep]
    m1 = (state["omega"].shape[1] if state.get("omega") is not None else state["W"].shape[1]) + 1
    G = np.zeros((m1, m1))
    FtY = np.zeros((m1, Yb.shape[1]))
    step = _sub_rows(m1)
    for a in range(0, keep.size, step):
        F = K.decoder_features(Xb[a:a + step], state["W"], state["intercept"], state.get("omega"),
                               state.get("phase"), state.get("bandwidth") or 1.0)
        G += F.T @ F
        FtY += (Yb[a:a + step].T @ F).T
    out.update(G=G, FtY=FtY)
    return out


#: partial sums a task of the tree sum holds at once: its two inputs and their sum (:func:`_add`)
_TREE_OPERANDS = 3
_FLOAT64_BYTES = 8


def normal_equations_task_bytes(n_features_out: int, n_labels: int) -> int:
    """Bytes one task of :func:`normal_equations` needs at least, whatever the block rows.

    ``G`` ``(m + 1, m + 1)`` and ``FtY`` ``(m + 1, n_labels)`` in float64, three of each in a task of
    the tree sum, plus one sub-batch of features (:data:`SUB_ROWS` rows of ``m + 1``).

    Parameters
    ----------
    n_features_out : int
        ``m + 1``: the decoder's features (random features or embedding dimension) and the bias.
    n_labels : int
    """
    m1 = int(n_features_out)
    partials = _TREE_OPERANDS * _FLOAT64_BYTES * m1 * (m1 + int(n_labels))
    return partials + _FLOAT64_BYTES * _sub_rows(m1) * m1


def _add(a, b):
    return {"G": a["G"] + b["G"], "FtY": a["FtY"] + b["FtY"], "held": a["held"] + b["held"],
            "counts": (min(a["counts"][0], b["counts"][0]), max(a["counts"][1], b["counts"][1]))}


def normal_equations(X: da.Array, Y: da.Array, split: HeldOut, state: dict):
    """One pass for the decoder's warm start: a delayed dict of

    - ``G = F^T F`` and ``FtY = F^T Y`` (float64) over the rows ``split`` does not hold out, with
      ``F = [phi(X W + c), 1]`` formed in row sub-batches of at most :data:`SUB_ROWS` rows inside each
      task and never stored;
    - ``held``: the list of ``(X_b[mask_b], Y_b[mask_b])`` of the held-out rows (``mask_b = split.mask(b)``);
    - ``counts``: ``(min, max)`` over all rows of the number of labels per row.

    One task per row block, then a pairwise tree sum.
    """
    nbytes = sum(v.nbytes for v in state.values() if isinstance(v, np.ndarray))  # W: d x k, 123 MB on lshtc1
    parts = per_block_objects(_normal_block, X, Y, seed=split.seed, fraction=split.fraction,
                              state=_ship(state, nbytes))
    return tree_combine(parts, _add)


# --------------------------------------------------------------------------------------------
# the decoder's SGD epochs as tasks


def _ship(obj, nbytes: int | None = None):
    """``obj`` once for a whole graph: scattered to every worker of a current ``distributed`` client (a
    restarted worker loses nothing), else embedded in the graph; given its size ``nbytes``, scattered only from
    :data:`~xmldask.linalg.passes.SCATTER_BYTES` (no "large graph" warning, no round trip for a small one)."""
    client = current_client() if nbytes is None or nbytes >= SCATTER_BYTES else None
    if client is not None:
        return client.scatter([obj], broadcast=True, hash=False)[0]
    return dask.delayed(obj, traverse=False)


def sgd_block(carry: tuple, Xb, Yb, *, block: int, bounds: tuple[int, int], setup: dict, seed: int,
              learning_rate: float) -> tuple:
    """The decoder's SGD steps on the training rows of one row block, in a random order (``seed``).

    ``carry`` is ``(Q, V, loss, rows)``: the decoder, its momentum, and the summed loss and rows so far;
    a new carry is returned (the given one is never changed: a task may run again). ``Xb`` or ``Yb``
    ``None``: read rows ``bounds`` here by ``setup["readers"]``. ``setup`` also holds the held-out split
    (``seed``, ``fraction``), the feature map ``state``, the preconditioner ``P``, ``loss_fn``,
    ``batch_size``, ``momentum`` and ``l2`` (see :func:`._kernels.sgd_step`).
    """
    Xb = setup["readers"][0].read_rows(*bounds) if Xb is None else Xb
    Yb = sp.csr_matrix(setup["readers"][1].read_rows(*bounds) if Yb is None else Yb)
    Q, V, loss, rows = carry
    Q, V = Q.copy(), V.copy()
    st = setup["state"]
    train = np.flatnonzero(~K.holdout_mask(setup["seed"], block, Xb.shape[0], setup["fraction"]))
    np.random.default_rng(seed).shuffle(train)
    for a in range(0, train.size, setup["batch_size"]):
        idx = np.sort(train[a:a + setup["batch_size"]])
        F = K.decoder_features(Xb[idx], st["W"], st["intercept"], st["omega"], st["phase"], st["bandwidth"] or 1.0)
        loss += K.sgd_step(Q, V, setup["P"], F, Yb[idx], setup["loss_fn"], learning_rate=learning_rate,
                           momentum=setup["momentum"], l2=setup["l2"])
        rows += idx.size
    return Q, V, loss, rows


def _average_chains(*carries: tuple) -> tuple:
    """The chains' decoders and momenta averaged, weighted by the rows each saw; losses and rows summed."""
    rows = np.array([c[3] for c in carries], dtype=np.float64)
    w = rows / rows.sum() if rows.sum() else np.full(len(carries), 1.0 / len(carries))
    Q, V = (sum(wi * c[i].astype(np.float64) for wi, c in zip(w, carries)).astype(carries[0][i].dtype)
            for i in (0, 1))
    return Q, V, float(sum(c[2] for c in carries)), int(rows.sum())


def sgd_epoch(X: da.Array, Y: da.Array, setup: dict, Q: np.ndarray, V: np.ndarray, *, order, chains: int,
              seeds, learning_rate: float):
    """One SGD epoch of the decoder as tasks: a delayed ``(Q, V, loss, rows)``.

    The row blocks, in ``order``, are dealt to ``chains`` chains (block ``order[i]`` to chain ``i mod
    chains``); each chain runs :func:`sgd_block` on its blocks one after the other from ``(Q, V)``,
    each block in the order of its seed ``seeds[b]``, and the chains, which run at the same time on
    different workers, are averaged at the end (iterative parameter mixing: McDonald, Hall and Mann,
    "Distributed Training Strategies for the Structured Perceptron", NAACL 2010; Zinkevich, Weimer,
    Smola and Li, "Parallelized Stochastic Gradient Descent", NIPS 2010). One chain is sequential SGD.
    A task holds one row block, ``Q`` and ``V``; ``setup`` and the start are shipped once. A store's
    blocks are read inside the task that uses them (a block read in a task of its own could wait in
    a worker's memory for its chain).
    """
    readers = (block_reader(X), block_reader(Y))
    Xd, Yd = ([None] * A.numblocks[0] if r is not None else A.to_delayed(optimize_graph=False).ravel()
              for A, r in zip((X, Y), readers))
    bounds = np.cumsum((0,) + tuple(X.chunks[0])).tolist()
    setup_ref, carry0 = _ship({**setup, "readers": readers}), _ship((Q, V, 0.0, 0))
    token = dask.base.tokenize(order, seeds, learning_rate, chains)
    ends = []
    for c in range(chains):
        carry = carry0
        for j, b in enumerate(order[c::chains]):
            carry = dask.delayed(sgd_block)(carry, Xd[b], Yd[b], block=int(b), bounds=(bounds[b], bounds[b + 1]),
                                            setup=setup_ref, seed=int(seeds[b]), learning_rate=float(learning_rate),
                                            dask_key_name=f"decoder-sgd-{token}-{c}-{j}")
        ends.append(carry)
    return dask.delayed(_average_chains)(*ends, dask_key_name=f"decoder-sgd-average-{token}")


# --------------------------------------------------------------------------------------------
# ensembles: the mean of the members' probabilities


def _member_operands(states: list[dict]) -> tuple[dict, dict]:
    """Every member's arrays under numbered names, and the per-member static values."""
    whole = {}
    for i, state in enumerate(states):
        whole.update({f"{name}{i}": state.get(name) for name in ("idf", "W", "intercept", "omega", "phase", "Q",
                                                                 "bias")})
    features = tuple(state.get("features", "raw") for state in states)
    # the first member with the same input transform (members of one fit share their idf): done once per block
    same = tuple(next(j for j in range(i + 1) if features[j] == features[i] and _same_idf(states[j], states[i]))
                 for i in range(len(states)))
    static = {"features": features, "same_input": same,
              "bandwidths": tuple(float(state.get("bandwidth") or 1.0) for state in states)}
    return whole, static


def _same_idf(a: dict, b: dict) -> bool:
    x, y = a.get("idf"), b.get("idf")
    return (x is None and y is None) or (x is not None and y is not None and np.array_equal(x, y))


def _mean_probabilities(Xb, ops: dict, features: tuple, same_input: tuple, bandwidths: tuple,
                        task: str) -> np.ndarray:
    """The members' mean probabilities of one (sub-)block of raw rows, ``(n_b, n_labels)``."""
    P, inputs = None, {}
    for i, (kind, bandwidth) in enumerate(zip(features, bandwidths)):
        if same_input[i] == i:  # a transform no earlier member made
            inputs[i] = Xb if kind == "raw" else K.transform_rows(Xb, ops.get(f"idf{i}") if kind == "tfidf" else None)
        Xi = inputs[same_input[i]]
        F = K.decoder_features(Xi, ops[f"W{i}"], ops[f"intercept{i}"], ops.get(f"omega{i}"), ops.get(f"phase{i}"),
                               bandwidth)
        S = F[:, :-1] @ ops[f"Q{i}"]
        S += ops[f"bias{i}"]
        K.probabilities(S, task)
        P = S if P is None else np.add(P, S, out=P)
    P /= len(features)
    return P


def _ensemble_kernel(Xb, *, features, same_input, bandwidths, task, k=None, budget=K.SCORE_BUDGET, **ops):
    n, n_labels = Xb.shape[0], ops["Q0"].shape[1]
    widest = max(max(ops[f"Q{i}"].shape) for i in range(len(features)))
    step = _sub_rows(max(widest, n_labels), budget)
    out = np.empty((n, 2 * k if k else n_labels), dtype=np.float64 if k else ops["Q0"].dtype)
    for a in range(0, n, step):
        P = _mean_probabilities(Xb[a:a + step], ops, features, same_input, bandwidths, task)
        if k:
            out[a:a + step, :k], out[a:a + step, k:] = K.topk_rows(P, k)
        else:
            out[a:a + step] = P
    return out


def ensemble_probabilities(X: da.Array, states: list[dict], task: str) -> da.Array:
    """Lazy mean probabilities of the members, ``(n_samples, n_labels)``, chunked like the raw rows ``X``.

    Every member's ``state`` holds its feature map and decoder (as for :func:`topk`) and its input
    transform (``features``: ``"raw"``, ``"l2"`` or ``"tfidf"`` with ``idf``), applied per block here.
    """
    whole, static = _member_operands(states)
    n_labels = states[0]["Q"].shape[1]
    return _map_rows(_ensemble_kernel, X, whole=whole, static={**static, "task": task}, out_cols=n_labels,
                     dtype=states[0]["Q"].dtype, token="ensemble-probabilities")


def ensemble_topk(X: da.Array, states: list[dict], task: str, k: int, *,
                  budget: int = K.SCORE_BUDGET) -> tuple[da.Array, da.Array]:
    """Lazy top-``k`` labels (int32) and mean probabilities (float32) of the members, best first.

    Like :func:`topk`, one task per row block computes both, and at most ``budget`` entries of a
    member's scores are held at once (two such buffers: a member's and the running mean).
    """
    whole, static = _member_operands(states)
    packed = _map_rows(_ensemble_kernel, X, whole=whole,
                       static={**static, "task": task, "k": int(k), "budget": int(budget)},
                       out_cols=2 * k, dtype=np.float64, token="ensemble-topk")
    return packed[:, :k].astype(np.int32), packed[:, k:].astype(np.float32)


def _mean_of_lists_block(*parts, width: int, k: int) -> np.ndarray:
    labels, scores = [p[:, :width] for p in parts], [p[:, width:] for p in parts]
    top, best = K.mean_of_lists(labels, scores, k)
    return np.concatenate([top.astype(np.float64), best], axis=1)


def mean_topk(X: da.Array, lists: list[tuple[da.Array, da.Array]], k: int) -> tuple[da.Array, da.Array]:
    """Lazy top-``k`` labels (int32) and mean scores (float32) of models that list their best labels, from each
    model's ``(labels, scores)`` of the rows ``X`` (:func:`._kernels.mean_of_lists`, one task per row block)."""
    rows = X.chunks[0]
    width = int(lists[0][0].shape[1])
    packed = [da.concatenate([labels.astype(np.float64), scores.astype(np.float64)], axis=1).rechunk({0: rows, 1: -1})
              for labels, scores in lists]
    out = da.map_blocks(_mean_of_lists_block, *packed, width=width, k=int(k), dtype=np.float64,
                        chunks=(rows, (2 * k,)), token="ensemble-mean-of-lists")
    return out[:, :k].astype(np.int32), out[:, k:].astype(np.float32)
