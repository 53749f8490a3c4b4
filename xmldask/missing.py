"""Missing labels: the observed-entry mask of a dataset, and LEML's simulation of one.

A dataset with missing labels stores, beside ``Y``, the CSR group ``observed`` of the label
entries that are known (relevant or not), with ``Y``'s row blocks (:mod:`xmldask.store.layout`);
``open_dataset(url).observed`` opens it. Every other entry is unknown: it enters neither a loss
nor a target. :func:`mask_dataset` makes such a dataset from a fully labelled one by revealing a
uniformly random fraction of the ``n x L`` entries (each independently, Bernoulli), as in the
missing-label experiments of LEML (Yu et al. 2014, Section 5.2: "20% entries were revealed").
The mask is drawn sparsely (geometric gaps between revealed entries), so memory is proportional
to the revealed entries of one row block, never to ``n x L``.

References
----------
Yu, H.-F., Jain, P., Kar, P. and Dhillon, I. S. "Large-scale Multi-label Learning with Missing Labels"
(ICML 2014), Section 5.2 and Table 4.
"""

from __future__ import annotations

import math
import numbers

import numpy as np
import scipy.sparse as sp

from .store import exists, open_dataset
from .store.csr import block_reader
from .store.dataset import DatasetWriter

__all__ = ["bernoulli_entries", "mask_dataset"]

#: extra draws beyond the expected count, in standard deviations, before drawing more gaps
_SLACK_SD = 6.0


def bernoulli_entries(n_rows: int, n_cols: int, fraction: float, rng: np.random.Generator) -> sp.csr_matrix:
    """Each of the ``n_rows x n_cols`` entries independently with probability ``fraction``, as a CSR pattern.

    The positions are cumulative sums of geometric gaps, so memory and time are proportional to
    the number of drawn entries, not to ``n_rows x n_cols``.

    Returns
    -------
    scipy.sparse.csr_matrix of float32, shape (n_rows, n_cols)
        Values 1.0 at the drawn entries, sorted column ids.
    """
    total = n_rows * n_cols
    if fraction >= 1.0:
        pos = np.arange(total, dtype=np.int64)
    else:
        expected = total * fraction
        pieces, last = [], -1
        while last < total - 1:
            size = int(expected + _SLACK_SD * math.sqrt(expected) + 16)
            steps = np.cumsum(rng.geometric(fraction, size=size), dtype=np.int64) + last
            pieces.append(steps)
            last = int(steps[-1])
        pos = np.concatenate(pieces)
        pos = pos[pos < total]
    rows, cols = np.divmod(pos, n_cols)
    indptr = np.zeros(n_rows + 1, dtype=np.int64)
    np.cumsum(np.bincount(rows, minlength=n_rows), out=indptr[1:])
    return sp.csr_matrix((np.ones(len(pos), np.float32), cols.astype(np.int32), indptr), shape=(n_rows, n_cols))


def mask_dataset(data_url: str, out: str, *, observed: float, seed: int = 0, overwrite: bool = False) -> dict:
    """Write a copy of a dataset in which a uniformly random fraction of the label entries is observed.

    Every entry of the ``n x L`` label matrix is revealed independently with probability
    ``observed``; ``Y`` keeps the revealed relevant labels, ``observed`` stores the revealed entries
    (relevant and irrelevant alike). Row block ``b`` draws from ``default_rng([seed, b])``, so the
    result depends only on the data, ``observed`` and ``seed``. Streams one row block at a time.

    Parameters
    ----------
    data_url : str
        A fully labelled dataset store.
    out : str
        The new dataset store (refused if it exists, unless ``overwrite``).
    observed : float
        The fraction in ``(0, 1]``.
    seed : int
    overwrite : bool

    Returns
    -------
    dict
        ``url``, ``source``, ``observed`` (the requested fraction), ``observed_fraction`` (drawn),
        ``nnz_observed``, ``nnz_labels`` (relevant labels kept), ``seed``.
    """
    ok = isinstance(observed, numbers.Real) and not isinstance(observed, bool) and math.isfinite(observed)
    if not ok or not 0.0 < observed <= 1.0:
        raise ValueError(f"the observed fraction must be in (0, 1], but is {observed!r}; for example --observed 0.2 "
                         "reveals 20% of the label entries")
    if isinstance(seed, bool) or not isinstance(seed, numbers.Integral) or seed < 0:
        raise ValueError(f"seed must be a non-negative integer, but is {seed!r}")
    if exists(out) and not overwrite:
        raise FileExistsError(f"{out} already exists; pass overwrite=True (--overwrite) to replace it")
    src = open_dataset(data_url)
    if src.observed is not None:
        raise ValueError(f"{data_url} already has an observed-entry mask; mask the fully labelled dataset instead")
    bounds = [int(b) for b in src.meta["row_blocks"]]
    L = src.n_labels
    readers = (block_reader(src.X), block_reader(src.Y))
    block_rows = max([b - a for a, b in zip(bounds[:-1], bounds[1:])] or [1])
    writer = DatasetWriter.create(out, n_features=src.n_features, n_labels=L, block_rows=block_rows,
                                  overwrite=overwrite, observed=True)
    with writer:
        writer.sources = list(src.meta.get("sources", []))
        for b, (lo, hi) in enumerate(zip(bounds[:-1], bounds[1:])):
            Xb, Yb = (r.read_rows(lo, hi) for r in readers)
            Ob = bernoulli_entries(hi - lo, L, float(observed), np.random.default_rng([int(seed), b]))
            writer.write(Xb, sp.csr_matrix(Yb.multiply(Ob)), observed=Ob)
        ds = writer.commit(n_features=src.n_features, n_labels=L, transforms=src.meta.get("transforms", {}),
                           masked_from={"url": str(data_url), "observed": float(observed), "seed": int(seed)})
    n_obs = int(ds.meta["nnz_observed"])
    return {"url": out, "source": str(data_url), "observed": float(observed),
            "observed_fraction": n_obs / max(ds.n_samples * L, 1), "nnz_observed": n_obs,
            "nnz_labels": int(ds.meta["nnz_labels"]), "seed": int(seed)}
