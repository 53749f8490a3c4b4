"""Synthetic data shaped like the Extreme Classification Repository's, at any size, streamed block by block.

:mod:`xmldask.datasets` plants a low-rank relation (a few dozen topics); real XMC label spaces are not low
rank: most labels are rare, and each has words of its own. This generator is *label first*:

* label popularity follows a Zipf law (exponent ``label_exponent``) over ranks mapped to ids by an affine
  permutation; ids ``[g * group_size, (g + 1) * group_size)`` form group ``g``, a set of related labels;
* a row has ``1 + Poisson(avg_labels - 1)`` label draws: the first by popularity, each further one, with
  probability ``cooccur``, from the first label's group (by popularity within the group), else by popularity;
* a row has ``max(1, Poisson(avg_tokens))`` feature tokens. A token is *background* with probability
  ``background`` (a Zipf law over the whole vocabulary, exponent ``feature_exponent``: stop words and common
  words); otherwise it comes from one of the row's labels (chosen uniformly), from that label's group's
  words with probability ``group_share`` and else from the label's own words, each a Zipf law over
  ``group_words`` / ``label_words`` word slots whose ids are a hash of (seed, group or label, slot);
* feature values are the token counts (``values="counts"``) or ``log(1 + count)`` scaled to unit L2 norm per
  row (``values="l2"``, the sublinear tf rows of text benchmarks).

Nothing of size ``n_labels * label_words`` is stored: the word ids are computed (splitmix64). Memory is bounded
by one chunk of :data:`~xmldask.datasets.CHUNK_ROWS` rows and Zipf tables of ``n_features`` and ``n_labels``
floats. As in :mod:`xmldask.datasets`, the rows come from a stream keyed by ``(seed, split, chunk)``: a train and
a test split with the same seed share the label model, and the output never depends on the block size.

:data:`PRESETS` gives the published sizes and statistics of repository datasets (Bhatia et al., "The extreme
classification repository", manik varma's XC repository tables): rows, features, labels, labels per row and
features per row; the generator's own realised statistics are printed by ``bench/extreme.py --stats``.
"""

from __future__ import annotations

import math
from collections.abc import Iterator

import numpy as np
import scipy.sparse as sp

from .base import check_float, check_int
from .datasets import CHUNK_ROWS, affine_permutation, counts_to_csr, split_key, zipf_cdf
from .store.layout import BLOCK_ROWS, DATA_DTYPE

__all__ = ["PRESETS", "XMC_GENERATOR_VERSION", "iter_xmc", "make_xmc", "preset", "write_xmc_text"]

#: version of this generative process: a change of the output for the same arguments bumps it
XMC_GENERATOR_VERSION = 1

#: published statistics (train rows, test rows, features, labels, mean labels a row, mean features a row) of
#: repository datasets, and sets of 10 K, 100 K and 1 M labels shaped like the text sets (about 3 labels and
#: 80 nonzeros a row, a long label tail). ``bench/extreme.py --preset NAME`` generates them.
PRESETS: dict[str, dict] = {
    "eurlex-4k": {"n_train": 15_539, "n_test": 3_809, "n_features": 5_000, "n_labels": 3_993,
                  "avg_labels": 5.31, "avg_features": 236.8},
    "wiki10-31k": {"n_train": 14_146, "n_test": 6_616, "n_features": 101_938, "n_labels": 30_938,
                   "avg_labels": 18.64, "avg_features": 673.4},
    "amazoncat-13k": {"n_train": 1_186_239, "n_test": 306_782, "n_features": 203_882, "n_labels": 13_330,
                      "avg_labels": 5.04, "avg_features": 71.1},
    "amazon-670k": {"n_train": 490_449, "n_test": 153_025, "n_features": 135_909, "n_labels": 670_091,
                    "avg_labels": 5.45, "avg_features": 75.7},
    "xmc-10k": {"n_train": 30_000, "n_test": 5_000, "n_features": 50_000, "n_labels": 10_000,
                "avg_labels": 3.0, "avg_features": 83.0},
    "xmc-100k": {"n_train": 100_000, "n_test": 10_000, "n_features": 100_000, "n_labels": 100_000,
                 "avg_labels": 3.0, "avg_features": 83.0},
    "xmc-1m": {"n_train": 1_000_000, "n_test": 20_000, "n_features": 500_000, "n_labels": 1_000_000,
               "avg_labels": 3.0, "avg_features": 83.0},
}

#: the process's knobs and their defaults (the presets change only the sizes and the per-row means)
DEFAULT_KNOBS = {"label_exponent": 1.0, "feature_exponent": 1.1, "group_size": 16, "cooccur": 0.5,
                 "background": 0.8, "group_share": 0.6, "label_words": 64, "group_words": 64,
                 "word_exponent": 0.5, "values": "l2"}
#: repeated tokens collapse into one nonzero: tokens drawn per row = this x the wanted nonzeros per row
#: (about what the default knobs lose to repeats; ``bench/extreme.py --stats`` prints the realised mean)
TOKENS_PER_NONZERO = 1.4
#: repeated label draws collapse too (a group's popular labels come up again): further draws a row = this x the
#: wanted further labels
DRAWS_PER_LABEL = 1.4
_MAX_INDEX = np.iinfo(np.int32).max


def preset(name: str, split: str = "train", **overrides) -> dict:
    """The arguments of :func:`iter_xmc` / :func:`make_xmc` for a :data:`PRESETS` entry and a split
    (``"train"`` or ``"test"``: its number of rows); ``overrides`` replace any of them (e.g. ``n_samples``)."""
    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r}; presets are {', '.join(PRESETS)}")
    if split not in ("train", "test"):
        raise ValueError(f"split must be 'train' or 'test' for a preset, but is {split!r}")
    p = PRESETS[name]
    args = {"n_samples": p["n_train" if split == "train" else "n_test"], "n_features": p["n_features"],
            "n_labels": p["n_labels"], "avg_labels": p["avg_labels"], "avg_features": p["avg_features"],
            "split": split}
    return {**args, **overrides}


def _check(*, n_samples, n_features, n_labels, avg_labels, avg_features, seed, split, **knobs) -> dict:
    unknown = sorted(set(knobs) - set(DEFAULT_KNOBS))
    if unknown:
        raise TypeError(f"unknown argument(s) {', '.join(unknown)}; the knobs are {', '.join(DEFAULT_KNOBS)}")
    k = {**DEFAULT_KNOBS, **knobs}
    if k["values"] not in ("counts", "l2"):
        raise ValueError(f"values must be 'counts' or 'l2', but is {k['values']!r}")
    if not isinstance(split, str) or not split:
        raise ValueError(f"split must be a non-empty string such as 'train' or 'test', but is {split!r}")
    return {
        "n_samples": check_int(n_samples, "n_samples", 1),
        "n_features": check_int(n_features, "n_features", 1, _MAX_INDEX),
        "n_labels": check_int(n_labels, "n_labels", 1, _MAX_INDEX),
        "avg_labels": check_float(avg_labels, "avg_labels", low=1.0),
        "avg_features": check_float(avg_features, "avg_features", low=0.0, low_open=True),
        "label_exponent": check_float(k["label_exponent"], "label_exponent", low=0.0),
        "feature_exponent": check_float(k["feature_exponent"], "feature_exponent", low=0.0),
        "word_exponent": check_float(k["word_exponent"], "word_exponent", low=0.0),
        "group_size": check_int(k["group_size"], "group_size", 1),
        "cooccur": check_float(k["cooccur"], "cooccur", low=0.0, high=1.0),
        "background": check_float(k["background"], "background", low=0.0, high=1.0),
        "group_share": check_float(k["group_share"], "group_share", low=0.0, high=1.0),
        "label_words": check_int(k["label_words"], "label_words", 1),
        "group_words": check_int(k["group_words"], "group_words", 1),
        "values": k["values"],
        "seed": check_int(seed, "seed", 0),
        "split": split,
    }


def _mix(x: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser: a bijection of uint64 that scatters nearby keys."""
    with np.errstate(over="ignore"):
        z = x + np.uint64(0x9E3779B97F4A7C15)
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return z ^ (z >> np.uint64(31))


class _Model:
    """The label model: popularity ranks and ids, groups, and the hashed word ids (a function of the seed and sizes)."""

    def __init__(self, p: dict):
        rng = np.random.default_rng(np.random.SeedSequence(p["seed"], spawn_key=(2,)))
        self.p = p
        L, d = p["n_labels"], p["n_features"]
        self.label_cdf = zipf_cdf(L, p["label_exponent"])
        self.a, self.b = affine_permutation(rng, L)
        self.a_inv = pow(self.a, -1, L) if L > 1 else 1
        self.fa, self.fb = affine_permutation(rng, d)
        self.feature_cdf = zipf_cdf(d, p["feature_exponent"])
        self.label_word_cdf = zipf_cdf(p["label_words"], p["word_exponent"])
        self.group_word_cdf = zipf_cdf(p["group_words"], p["word_exponent"])
        self.salt = np.uint64(int(rng.integers(1, 2**62)))

    def draw_labels(self, u: np.ndarray) -> np.ndarray:
        """Label ids by popularity from uniforms ``u``."""
        cdf = self.label_cdf
        ranks = np.minimum(np.searchsorted(cdf, u * cdf[-1], side="right"), len(cdf) - 1)
        return (self.a * ranks.astype(np.int64) + self.b) % self.p["n_labels"]

    def draw_in_group(self, first: np.ndarray, u: np.ndarray) -> np.ndarray:
        """A label of each ``first`` label's group, by popularity within the group, from uniforms ``u``."""
        L, G = self.p["n_labels"], self.p["group_size"]
        members = (first // G * G)[:, None] + np.arange(G)[None, :]
        valid = members < L
        ranks = (self.a_inv * ((np.where(valid, members, 0) - self.b) % L)) % L
        weight = np.where(valid, (ranks + 1.0) ** -self.p["label_exponent"], 0.0)
        cdf = np.cumsum(weight, axis=1)
        slot = (u[:, None] * cdf[:, -1:] >= cdf).sum(axis=1)
        return members[np.arange(len(first)), np.minimum(slot, G - 1)]

    def word_ids(self, kind: int, owner: np.ndarray, cdf: np.ndarray, u: np.ndarray) -> np.ndarray:
        """Feature ids of words of ``owner`` labels (kind 1) or groups (kind 2), slots drawn from ``cdf``."""
        slot = np.minimum(np.searchsorted(cdf, u * cdf[-1], side="right"), len(cdf) - 1)
        key = (np.uint64(kind) << np.uint64(60)) ^ (owner.astype(np.uint64) << np.uint64(16)) ^ slot.astype(np.uint64)
        return (_mix(key ^ self.salt) % np.uint64(self.p["n_features"])).astype(np.int64)

    def background_ids(self, u: np.ndarray) -> np.ndarray:
        cdf = self.feature_cdf
        ranks = np.minimum(np.searchsorted(cdf, u * cdf[-1], side="right"), len(cdf) - 1)
        return (self.fa * ranks.astype(np.int64) + self.fb) % self.p["n_features"]


def _chunk(model: _Model, rng: np.random.Generator, n: int) -> tuple[sp.csr_matrix, sp.csr_matrix]:
    p = model.p
    rows = np.arange(n)
    # labels: the first by popularity, the others from its group (cooccur) or by popularity
    n_draws = 1 + rng.poisson((p["avg_labels"] - 1.0) * DRAWS_PER_LABEL, n)
    label_rows = np.repeat(rows, n_draws)
    first_slot = np.r_[0, np.cumsum(n_draws)[:-1]]
    labels = model.draw_labels(rng.random(len(label_rows)))
    first = labels[first_slot][label_rows]
    in_group = rng.random(len(label_rows)) < p["cooccur"]
    in_group[first_slot] = False
    if in_group.any():
        labels[in_group] = model.draw_in_group(first[in_group], rng.random(int(in_group.sum())))
    Y = counts_to_csr(label_rows, labels, n, p["n_labels"], binary=True)

    # features: background words, else words of one of the row's labels or of its group
    avg_tokens = p["avg_features"] * TOKENS_PER_NONZERO
    n_tokens = np.maximum(rng.poisson(avg_tokens, n), 1)
    token_rows = np.repeat(rows, n_tokens)
    ids = np.empty(len(token_rows), np.int64)
    kind = rng.random(len(token_rows))
    bg = kind < p["background"]
    ids[bg] = model.background_ids(rng.random(int(bg.sum())))
    own = ~bg
    counts = np.diff(Y.indptr)[token_rows[own]]
    pick = Y.indptr[token_rows[own]] + (rng.random(len(counts)) * counts).astype(np.int64)
    label = Y.indices[pick].astype(np.int64)
    group_word = rng.random(len(label)) < p["group_share"]
    words = np.empty(len(label), np.int64)
    words[group_word] = model.word_ids(2, label[group_word] // p["group_size"], model.group_word_cdf,
                                       rng.random(int(group_word.sum())))
    words[~group_word] = model.word_ids(1, label[~group_word], model.label_word_cdf,
                                        rng.random(int((~group_word).sum())))
    ids[own] = words
    X = counts_to_csr(token_rows, ids, n, p["n_features"], binary=False)
    if p["values"] == "l2":
        X.data = np.log1p(X.data).astype(DATA_DTYPE)
        norms = np.sqrt(np.add.reduceat(X.data.astype(np.float64) ** 2, X.indptr[:-1])) if X.nnz else np.ones(0)
        X.data /= np.repeat(norms, np.diff(X.indptr)).astype(DATA_DTYPE)
    return X, Y


def iter_xmc(*, n_samples: int, n_features: int, n_labels: int, avg_labels: float = 3.0, avg_features: float = 83.0,
             seed: int = 0, split: str = "train", **knobs) -> Iterator[tuple[sp.csr_matrix, sp.csr_matrix]]:
    """Rows of the label-first XMC process (module docstring), in pieces of :data:`~xmldask.datasets.CHUNK_ROWS`.

    Parameters
    ----------
    n_samples, n_features, n_labels : int
        Sizes.
    avg_labels : float, default 3.0
        Mean label draws a row (repeats collapse, so the mean number of labels is a little lower).
    avg_features : float, default 83.0
        Mean nonzeros a row wanted (tokens drawn: ``TOKENS_PER_NONZERO`` times as many).
    seed : int, default 0
    split : str, default "train"
        Splits with the same seed share the label model, not the rows.
    **knobs
        :data:`DEFAULT_KNOBS`: ``label_exponent``, ``feature_exponent``, ``group_size``, ``cooccur``,
        ``background``, ``group_share``, ``label_words``, ``group_words``, ``word_exponent``, ``values``.

    Yields
    ------
    X : scipy.sparse.csr_matrix (float32), Y : scipy.sparse.csr_matrix (float32, binary)

    Examples
    --------
    >>> X, Y = next(iter_xmc(n_samples=200, n_features=5000, n_labels=1000, seed=1))
    >>> X.shape, Y.shape, bool(Y.sum(axis=1).min() >= 1)
    ((200, 5000), (200, 1000), True)
    """
    p = _check(n_samples=n_samples, n_features=n_features, n_labels=n_labels, avg_labels=avg_labels,
               avg_features=avg_features, seed=seed, split=split, **knobs)
    return _iter_chunks(p)


def _iter_chunks(p: dict) -> Iterator[tuple[sp.csr_matrix, sp.csr_matrix]]:
    model = _Model(p)
    key = split_key(p["split"])
    for index, start in enumerate(range(0, p["n_samples"], CHUNK_ROWS)):
        rng = np.random.default_rng(np.random.SeedSequence(p["seed"], spawn_key=(3, key, index)))
        yield _chunk(model, rng, min(CHUNK_ROWS, p["n_samples"] - start))


def make_xmc(out: str, *, block_rows: int = BLOCK_ROWS, overwrite: bool = False, progress: bool = False, **args):
    """Generate :func:`iter_xmc` rows straight into a dataset store (atomically; memory: one chunk).

    ``args`` are :func:`iter_xmc`'s (see :func:`preset` for the repository-shaped sizes). Returns the
    :class:`xmldask.store.Dataset`, whose ``meta["synthetic"]`` records every argument.
    """
    from tqdm.auto import tqdm

    from .store.dataset import DatasetWriter

    p = _check(**{"avg_labels": 3.0, "avg_features": 83.0, "seed": 0, "split": "train", **args})
    block_rows = check_int(block_rows, "block_rows", 1)
    with DatasetWriter.create(out, n_features=p["n_features"], n_labels=p["n_labels"], block_rows=block_rows,
                              overwrite=overwrite) as writer, \
            tqdm(total=p["n_samples"], unit="rows", desc="xmc", disable=not progress) as bar:
        for X, Y in _iter_chunks(p):
            writer.write(X, Y)
            bar.update(X.shape[0])
        return writer.commit(synthetic={**p, "generator": "xmc", "generator_version": XMC_GENERATOR_VERSION},
                             transforms={"normalize": "l2" if p["values"] == "l2" else "none"})


def write_xmc_text(path: str, **args) -> str:
    """Write :func:`iter_xmc` rows as an XC repository text file (gzip if ``path`` ends with ``.gz``; atomic)."""
    from .io.xc_writer import write_xc

    p = _check(**{"avg_labels": 3.0, "avg_features": 83.0, "seed": 0, "split": "train", **args})
    return write_xc(path, _iter_chunks(p), n_samples=p["n_samples"], n_features=p["n_features"],
                    n_labels=p["n_labels"])


def label_tail(Y_counts: np.ndarray) -> dict:
    """Statistics of a label-frequency vector: labels seen, share seen at most 5 times among those, mean rows a
    seen label (``math`` only, for the benchmark's table)."""
    seen = Y_counts[Y_counts > 0]
    return {"labels_seen": int(len(seen)), "tail_le5": float(np.mean(seen <= 5)) if len(seen) else math.nan,
            "rows_per_label": float(seen.mean()) if len(seen) else math.nan}
