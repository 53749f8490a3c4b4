"""Synthetic extreme multi-label (XMC) data with realistic statistics, streamed block by block.

The generator is a topic model. ``rank`` latent topics with Zipf-distributed popularity link sparse
term-count features to labels, so that the features-to-labels relation has rank ``rank`` and can be
learnt, while feature and label frequencies both follow power laws with a long tail:

* every feature *rank* ``r`` in ``[0, n_features)`` has the home topic ``r mod rank``; a feature
  token is *background* with probability ``background`` and then has a rank drawn from a Zipf law
  (exponent ``feature_exponent``) over all ranks; otherwise it belongs to one of the row's topics
  ``t`` and has rank ``t + rank * m``, ``m`` drawn from a Zipf law over the ranks of that topic;
* label tokens are drawn the same way over ``[0, n_labels)`` (exponent ``label_exponent``), from
  the row's topics only (no background);
* a row has 1 to 3 topics (``1 + Poisson(0.5)``, capped), drawn by popularity, with mixing weights
  drawn from a flat Dirichlet and sorted so that the first topic dominates; it has
  ``max(1, Poisson(avg_features))`` feature tokens, whose counts are the feature values, and
  ``1 + Poisson(avg_labels - 1)`` label tokens, de-duplicated into a binary label row. In
  multiclass mode a row has exactly one label, drawn from its first topic;
* feature and label ids are the ranks mapped through affine permutations
  ``id = (A * rank + B) mod size`` (``gcd(A, size) = 1``), so frequent ids are spread over the
  id range and nothing of size ``n_features * rank`` is ever stored.

The *model* (permutations, Zipf laws, topic popularity) depends only on ``seed`` and the sizes. The
rows come from a separate random stream keyed by ``(seed, split, chunk)`` and are generated in fixed
chunks of :data:`CHUNK_ROWS` rows, so that a ``"train"`` and a ``"test"`` split drawn with the same
seed share the model but not the rows, and the output never depends on ``block_rows``. Memory is
bounded by one chunk (plus Zipf tables of ``n_features + (n_features + n_labels) / rank`` floats).

References
----------
Blei, Ng and Jordan, "Latent Dirichlet Allocation", JMLR 3 (2003): the generative process
(topic mixtures per document, words drawn from the topics), here with Zipf-shaped topics and a
background (stop-word) distribution.
"""

from __future__ import annotations

import hashlib
import logging
import math
import numbers
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import scipy.sparse as sp

from .io.transforms import NORMALIZATIONS, transform_rows
from .store.layout import BLOCK_ROWS, DATA_DTYPE

__all__ = ["CHUNK_ROWS", "GENERATOR_VERSION", "iter_synthetic", "make_synthetic", "write_synthetic_text"]

logger = logging.getLogger(__name__)

#: rows generated per random-stream chunk; part of the definition of the output (with the version)
CHUNK_ROWS = 8192
#: version of the generative process: a change of the output for the same arguments bumps it
GENERATOR_VERSION = 1

#: topics per row: 1 + Poisson(_EXTRA_TOPICS), at most _MAX_TOPICS
_EXTRA_TOPICS = 0.5
_MAX_TOPICS = 3
_MAX_INDEX = np.iinfo(np.int32).max


# --------------------------------------------------------------------------------------------------
# argument checks


def _check_int(name: str, value, *, minimum: int = 1, maximum: int | None = None) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be an integer, but is {value!r}")
    value = int(value)
    if value < minimum:
        what = "positive" if minimum == 1 else ("non-negative" if minimum == 0 else f"at least {minimum}")
        raise ValueError(f"{name} must be {what}, but is {value}")
    if maximum is not None and value > maximum:
        raise ValueError(f"{name} must be at most {maximum}, but is {value}")
    return value


def _check_float(name: str, value, *, low: float, high: float = math.inf, low_open: bool = False) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a number, but is {value!r}")
    value = float(value)
    if math.isfinite(high):
        requirement = f"in [{low:g}, {high:g}]"
    else:
        requirement = f"greater than {low:g}" if low_open else f"at least {low:g}"
    if not math.isfinite(value) or (value <= low if low_open else value < low) or value > high:
        raise ValueError(f"{name} must be {requirement}, but is {value!r}")
    return value


DEFAULT_RANK = 32


def _check_params(*, n_samples, n_features, n_labels, multiclass, rank, avg_features, avg_labels,
                  feature_exponent, label_exponent, topic_exponent, background, seed, split) -> dict:
    """Validate the generator arguments; returns them normalised to plain Python values."""
    if not isinstance(multiclass, (bool, np.bool_)):
        raise TypeError(f"multiclass must be True or False, but is {multiclass!r}")
    p = {
        "n_samples": _check_int("n_samples", n_samples),
        "n_features": _check_int("n_features", n_features, maximum=_MAX_INDEX),
        "n_labels": _check_int("n_labels", n_labels, maximum=_MAX_INDEX),
        "multiclass": bool(multiclass),
        "rank": _check_int("rank", DEFAULT_RANK if rank is None else rank),
        "avg_features": _check_float("avg_features", avg_features, low=0.0, low_open=True),
        "avg_labels": _check_float("avg_labels", avg_labels, low=1.0),
        "feature_exponent": _check_float("feature_exponent", feature_exponent, low=0.0),
        "label_exponent": _check_float("label_exponent", label_exponent, low=0.0),
        "topic_exponent": _check_float("topic_exponent", topic_exponent, low=0.0),
        "background": _check_float("background", background, low=0.0, high=1.0),
        "seed": _check_int("seed", seed, minimum=0),
    }
    if rank is None:
        p["rank"] = min(p["rank"], p["n_features"], p["n_labels"])
    for size in ("n_features", "n_labels"):
        if p["rank"] > p[size]:
            raise ValueError(f"rank must be at most {size} ({p[size]}), but is {p['rank']}: every topic needs its "
                             f"own {size[2:-1]}s; pass rank={p[size]} or less")
    if not isinstance(split, str) or not split:
        raise ValueError(f"split must be a non-empty string such as 'train' or 'test', but is {split!r}")
    p["split"] = split
    return p


# --------------------------------------------------------------------------------------------------
# the model: Zipf tables and permutations, a function of the seed and the sizes only


def zipf_cdf(n: int, exponent: float) -> np.ndarray:
    """Unnormalised cumulative Zipf weights ``cumsum((k + 1) ** -exponent)``, shape (n,)."""
    return np.cumsum(np.arange(1, n + 1, dtype=np.float64) ** -exponent)


def affine_permutation(rng: np.random.Generator, size: int) -> tuple[int, int]:
    """Random ``(A, B)`` with ``gcd(A, size) = 1``: ``(A * r + B) mod size`` permutes ``range(size)``."""
    if size <= 2:
        return 1, int(rng.integers(size))
    while True:
        a = int(rng.integers(1, size))
        if math.gcd(a, size) == 1:
            return a, int(rng.integers(size))


@dataclass(frozen=True)
class _Vocabulary:
    """Ranks ``[0, size)`` split among ``rank`` topics, with Zipf laws and an id permutation."""

    size: int
    rank: int
    topic_cdf: np.ndarray  # (ceil(size / rank),) Zipf over the position m of a rank t + rank * m
    topic_len: np.ndarray  # (rank,) number of ranks of each topic
    background_cdf: np.ndarray | None  # (size,) Zipf over all ranks, or None without background
    a: int
    b: int

    @classmethod
    def build(cls, rng, *, size: int, rank: int, exponent: float, background: bool) -> _Vocabulary:
        a, b = affine_permutation(rng, size)
        topic_len = (size - np.arange(rank) + rank - 1) // rank
        return cls(size=size, rank=rank, topic_cdf=zipf_cdf(int(topic_len[0]), exponent), topic_len=topic_len,
                   background_cdf=zipf_cdf(size, exponent) if background else None, a=a, b=b)

    def topic_ranks(self, topics: np.ndarray, u: np.ndarray) -> np.ndarray:
        """Ranks of tokens of the given topics, from uniforms ``u`` (truncated Zipf per topic)."""
        n = self.topic_len[topics]
        m = np.searchsorted(self.topic_cdf, u * self.topic_cdf[n - 1], side="right")
        return topics + self.rank * np.minimum(m, n - 1)

    def background_ranks(self, u: np.ndarray) -> np.ndarray:
        """Ranks of background tokens, from uniforms ``u``."""
        cdf = self.background_cdf
        return np.minimum(np.searchsorted(cdf, u * cdf[-1], side="right"), self.size - 1)

    def ids(self, ranks: np.ndarray) -> np.ndarray:
        """Column ids of ranks (the affine permutation), int64."""
        return (self.a * ranks.astype(np.int64) + self.b) % self.size


@dataclass(frozen=True)
class _Model:
    rank: int
    topic_cdf: np.ndarray  # (rank,) normalised cumulative topic popularity
    features: _Vocabulary
    labels: _Vocabulary


def _build_model(p: dict) -> _Model:
    rng = np.random.default_rng(np.random.SeedSequence(p["seed"], spawn_key=(0,)))
    cdf = zipf_cdf(p["rank"], p["topic_exponent"])
    features = _Vocabulary.build(rng, size=p["n_features"], rank=p["rank"], exponent=p["feature_exponent"],
                                 background=p["background"] > 0)
    labels = _Vocabulary.build(rng, size=p["n_labels"], rank=p["rank"], exponent=p["label_exponent"],
                               background=False)
    return _Model(rank=p["rank"], topic_cdf=cdf / cdf[-1], features=features, labels=labels)


def split_key(split: str) -> int:
    return int.from_bytes(hashlib.sha256(split.encode("utf-8")).digest()[:8], "little")


# --------------------------------------------------------------------------------------------------
# one chunk of rows (pure NumPy)


def counts_to_csr(rows: np.ndarray, cols: np.ndarray, n_rows: int, n_cols: int, *,
                   binary: bool) -> sp.csr_matrix:
    """CSR with sorted indices from token coordinates; repeated tokens add up (or give 1 if binary)."""
    keys, counts = np.unique(rows * np.int64(n_cols) + cols, return_counts=True)
    row_of = keys // n_cols
    indices = (keys - row_of * n_cols).astype(np.int32)
    data = np.ones(len(keys), DATA_DTYPE) if binary else counts.astype(DATA_DTYPE)
    indptr = np.zeros(n_rows + 1, np.int64)
    np.cumsum(np.bincount(row_of, minlength=n_rows), out=indptr[1:])
    out = sp.csr_matrix((data, indices, indptr), shape=(n_rows, n_cols))
    out.has_sorted_indices = True
    out.has_canonical_format = True
    return out


def _chunk(model: _Model, p: dict, rng: np.random.Generator, n: int) -> tuple[sp.csr_matrix, sp.csr_matrix]:
    """Generate ``n`` rows: features (term counts) and binary labels, both float32 CSR."""
    rows = np.arange(n)
    # the row's topics, and mixing weights sorted so that the first topic dominates
    n_topics = 1 + np.minimum(rng.poisson(_EXTRA_TOPICS, n), _MAX_TOPICS - 1)
    topics = np.searchsorted(model.topic_cdf, rng.random((n, _MAX_TOPICS)), side="right")
    topics = np.minimum(topics, model.rank - 1)
    weights = rng.standard_exponential((n, _MAX_TOPICS))
    weights[np.arange(_MAX_TOPICS) >= n_topics[:, None]] = 0.0
    weights = -np.sort(-weights, axis=1)
    bounds = np.cumsum(weights, axis=1)[:, :-1] / weights.sum(axis=1, keepdims=True)

    def token_topics(row_of: np.ndarray) -> np.ndarray:
        slot = (rng.random(len(row_of))[:, None] >= bounds[row_of]).sum(axis=1)
        return topics[row_of, np.minimum(slot, n_topics[row_of] - 1)]

    # features: background tokens from the global Zipf law, the others from the row's topics
    n_tokens = np.maximum(rng.poisson(p["avg_features"], n), 1)
    row_of = np.repeat(rows, n_tokens)
    ranks = np.empty(len(row_of), np.int64)
    is_bg = rng.random(len(row_of)) < p["background"]
    n_bg = int(np.count_nonzero(is_bg))
    if n_bg:
        ranks[is_bg] = model.features.background_ranks(rng.random(n_bg))
    topical = ~is_bg
    ranks[topical] = model.features.topic_ranks(token_topics(row_of[topical]),
                                                rng.random(len(row_of) - n_bg))
    X = counts_to_csr(row_of, model.features.ids(ranks), n, p["n_features"], binary=False)

    # labels: from the row's topics, de-duplicated; multiclass: one label of the first topic
    if p["multiclass"]:
        label_rows, label_topics = rows, topics[:, 0]
    else:
        label_rows = np.repeat(rows, 1 + rng.poisson(p["avg_labels"] - 1.0, n))
        label_topics = token_topics(label_rows)
    label_ranks = model.labels.topic_ranks(label_topics, rng.random(len(label_rows)))
    Y = counts_to_csr(label_rows, model.labels.ids(label_ranks), n, p["n_labels"], binary=True)
    return X, Y


# --------------------------------------------------------------------------------------------------
# public API




def iter_synthetic(*, n_samples: int, n_features: int, n_labels: int, multiclass: bool = False, rank: int | None = None,
                   avg_features: float = 20.0, avg_labels: float = 3.0, feature_exponent: float = 1.1,
                   label_exponent: float = 1.1, topic_exponent: float = 1.0, background: float = 0.3,
                   seed: int = 0, split: str = "train") -> Iterator[tuple[sp.csr_matrix, sp.csr_matrix]]:
    """Generate synthetic extreme multi-label data as pieces of rows.

    See the module documentation for the generative model. Arguments are checked when the function
    is called, before the first piece is generated.

    Parameters
    ----------
    n_samples, n_features, n_labels, multiclass, rank, avg_features, avg_labels, feature_exponent, \
label_exponent, topic_exponent, background, seed, split
        As :func:`make_synthetic`.

    Yields
    ------
    X : scipy.sparse.csr_matrix, shape (n_rows, n_features)
        float32 term counts, sorted indices, no duplicate entries, at least one nonzero per row.
    Y : scipy.sparse.csr_matrix, shape (n_rows, n_labels)
        float32 binary labels, sorted indices; at least one label per row (exactly one if
        ``multiclass``). ``n_rows`` is :data:`CHUNK_ROWS` except for the last piece.

    Examples
    --------
    >>> import scipy.sparse as sp
    >>> pieces = list(iter_synthetic(n_samples=100, n_features=1000, n_labels=50, seed=1))
    >>> X = sp.vstack([x for x, _ in pieces]); X.shape
    (100, 1000)
    """
    p = _check_params(n_samples=n_samples, n_features=n_features, n_labels=n_labels, multiclass=multiclass,
                      rank=rank, avg_features=avg_features, avg_labels=avg_labels,
                      feature_exponent=feature_exponent, label_exponent=label_exponent,
                      topic_exponent=topic_exponent, background=background, seed=seed, split=split)
    return _iter_chunks(p)



def _iter_chunks(p: dict) -> Iterator[tuple[sp.csr_matrix, sp.csr_matrix]]:
    model = _build_model(p)
    key = split_key(p["split"])
    for index, start in enumerate(range(0, p["n_samples"], CHUNK_ROWS)):
        rng = np.random.default_rng(np.random.SeedSequence(p["seed"], spawn_key=(1, key, index)))
        yield _chunk(model, p, rng, min(CHUNK_ROWS, p["n_samples"] - start))


def make_synthetic(out: str, *, n_samples: int, n_features: int, n_labels: int, multiclass: bool = False,
                   rank: int | None = None, avg_features: float = 20.0, avg_labels: float = 3.0,
                   feature_exponent: float = 1.1, label_exponent: float = 1.1, topic_exponent: float = 1.0,
                   background: float = 0.3, seed: int = 0, split: str = "train", block_rows: int = BLOCK_ROWS,
                   normalize: str = "none", overwrite: bool = False, progress: bool = False):
    """Generate a synthetic dataset straight into a dataset store.

    Rows are generated and written one piece at a time (:func:`iter_synthetic`), so memory stays
    bounded by one generation chunk whatever ``n_samples`` is. The store appears at ``out`` only once
    complete.

    Parameters
    ----------
    out : str
        Path or fsspec URL of the new store.
    n_samples : int
        Number of rows.
    n_features : int
        Number of feature columns (at most 2**31 - 1).
    n_labels : int
        Number of label columns (at most 2**31 - 1).
    multiclass : bool, default False
        Exactly one label per row (drawn from the row's dominant topic) instead of a label set.
    rank : int, optional
        Number of latent topics, the rank of the planted feature-label relation; default 32, or
        ``min(n_features, n_labels)`` if smaller. At most ``n_features`` and ``n_labels``.
    avg_features : float, default 20.0
        Mean number of feature tokens per row (``max(1, Poisson(avg_features))``); repeated tokens
        add up, so the mean number of nonzeros per row is somewhat smaller.
    avg_labels : float, default 3.0
        Mean number of label draws per row (``1 + Poisson(avg_labels - 1)``), at least 1; repeated
        draws collapse, so the mean number of distinct labels is somewhat smaller. Ignored when
        ``multiclass``.
    feature_exponent : float, default 1.1
        Zipf exponent of the feature frequencies (0 gives uniform frequencies).
    label_exponent : float, default 1.1
        Zipf exponent of the label frequencies within a topic.
    topic_exponent : float, default 1.0
        Zipf exponent of the topic popularity. It shapes the head of the label frequencies, and how
        much better than predicting the most frequent labels a model can do: flatter (e.g. 0.5)
        makes the most frequent labels rarer and the data harder to guess without the features.
    background : float, default 0.3
        Probability that a feature token is background (drawn from the global Zipf law over all
        features, independent of the topics), in [0, 1].
    seed : int, default 0
        Seed of the model and the rows; the same seed and arguments give the same output.
    split : str, default "train"
        Name of the split: splits drawn with the same seed share the model (the feature-label
        relation) but have independent rows.
    block_rows : int, default BLOCK_ROWS
        Rows per row block of the store (one Dask task each); does not change the data.
    normalize : {"none", "l2", "l1", "sqrt"}, default "none"
        Row normalisation of the features (:func:`xmldask.io.transforms.transform_rows`).
    overwrite : bool, default False
        Replace an existing store at ``out``; otherwise an existing store is an error.
    progress : bool, default False
        Show a progress bar.

    Returns
    -------
    xmldask.store.Dataset
        The new dataset, ``X`` of shape (n_samples, n_features) and ``Y`` of shape
        (n_samples, n_labels). Its ``meta["synthetic"]`` records every generator argument (and
        ``generator_version``), ``meta["transforms"]`` the normalisation.
    """
    from tqdm.auto import tqdm

    from .store.dataset import DatasetWriter

    p = _check_params(n_samples=n_samples, n_features=n_features, n_labels=n_labels, multiclass=multiclass,
                      rank=rank, avg_features=avg_features, avg_labels=avg_labels,
                      feature_exponent=feature_exponent, label_exponent=label_exponent,
                      topic_exponent=topic_exponent, background=background, seed=seed, split=split)
    block_rows = _check_int("block_rows", block_rows)
    if normalize not in NORMALIZATIONS:
        raise ValueError(f"normalize must be one of {NORMALIZATIONS}, but is {normalize!r}")
    with DatasetWriter.create(out, n_features=p["n_features"], n_labels=p["n_labels"], block_rows=block_rows,
                              overwrite=overwrite) as writer, \
            tqdm(total=p["n_samples"], unit="rows", desc="synthetic", disable=not progress) as bar:
        for X, Y in _iter_chunks(p):
            if normalize != "none":
                X = transform_rows(X, normalize=normalize)
            writer.write(X, Y)
            bar.update(X.shape[0])
        dataset = writer.commit(synthetic={**p, "generator_version": GENERATOR_VERSION},
                                transforms={"normalize": normalize})
    logger.info("wrote %r", dataset)
    return dataset



def write_synthetic_text(path: str, *, n_samples: int, n_features: int, n_labels: int, multiclass: bool = False,
                         rank: int | None = None, avg_features: float = 20.0, avg_labels: float = 3.0,
                         feature_exponent: float = 1.1, label_exponent: float = 1.1,
                         topic_exponent: float = 1.0, background: float = 0.3, seed: int = 0,
                         split: str = "train") -> str:
    """Write the rows of :func:`iter_synthetic` as an Extreme Classification Repository text file.

    Parameters
    ----------
    path : str
        Path or fsspec URL of the file, gzip-compressed if it ends with ``.gz``. An existing file is
        replaced; the file appears only once complete.
    n_samples, n_features, n_labels, multiclass, rank, avg_features, avg_labels, feature_exponent, \
label_exponent, topic_exponent, background, seed, split
        As :func:`make_synthetic`.

    Returns
    -------
    str
        ``path``.

    See Also
    --------
    xmldask.io.xc_writer.write_xc : the file format.
    """
    from .io.xc_writer import write_xc

    pieces = iter_synthetic(n_samples=n_samples, n_features=n_features, n_labels=n_labels, multiclass=multiclass,
                            rank=rank, avg_features=avg_features, avg_labels=avg_labels,
                            feature_exponent=feature_exponent, label_exponent=label_exponent,
                            topic_exponent=topic_exponent, background=background, seed=seed, split=split)
    return write_xc(path, pieces, n_samples=n_samples, n_features=n_features, n_labels=n_labels)

