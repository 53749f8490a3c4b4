"""Embedding quality against a label hierarchy: the sibling fraction of Table 4 (Rembrandt paper).

The metric is the fraction of labels whose nearest neighbour in the embedding (another label, by
the rows of ``V``) is one of its siblings in the hierarchy. Two labels are *siblings* when they
share a parent node (in a DAG: at least one parent). Top-level nodes are siblings of each other
(children of a virtual root).

"Most fraternal" is the constant baseline of the paper: every label's nearest neighbour is the one
label with the most siblings; its score is ``(number of siblings of that label) / n_labels``.

Nearest neighbours are exact, computed block of rows by block of rows with matrix products (never
an ``L x L`` matrix): Euclidean distance by default (the paper says "nearest neighbor" with no
metric, i.e. the plain Euclidean one), or cosine similarity. Ties (notably between identical rows,
such as the zero rows that PLST gives labels outside its top eigenvectors in multiclass data) are
broken uniformly at random *in expectation*: a label whose nearest distance is attained by ``t``
labels, ``s`` of them siblings, scores ``s / t``. A zero row under the cosine metric has every other
label at the same similarity, and so scores its sibling count over ``n_labels - 1`` (chance).

Hierarchy files (:func:`read_hierarchy`):

- ``format="paths"``: one root-to-leaf path of node ids per line, separated by blanks (the LSHTC1
  ``cat_hier.txt``); consecutive ids are parent and child;
- ``format="edges"``: one ``parent child`` pair per line (the LSHTC2-4 ``hierarchy.txt``).

Node ids are mapped to label ids by a label map (``label_map.tsv``: header, then
``xc_label_id<TAB>original_id`` per line) or are the label ids themselves.

References
----------
P. Mineiro and N. Karampatziakis, "Fast Label Embeddings via Randomized Linear Algebra", ECML PKDD
2015, Section 4.3.1 and Table 4.
"""

from __future__ import annotations

import gzip
import logging
from dataclasses import dataclass

import numpy as np
import scipy.sparse as sp

__all__ = ["LabelHierarchy", "most_fraternal_fraction", "nearest_neighbor_sibling_scores", "read_hierarchy",
           "read_label_map", "sibling_fraction"]

logger = logging.getLogger(__name__)

_ROOT = object()  # the virtual root above the top-level nodes

#: entries of one block of the similarity matrix (rows x n_labels): 2**24 float64 = 128 MiB
BLOCK_ENTRIES = 1 << 24


def _open_text(path):
    path = str(path)
    return gzip.open(path, "rt") if path.endswith(".gz") else open(path)  # noqa: SIM115


def read_label_map(path) -> dict[int, int]:
    """Read a ``label_map.tsv(.gz)``: a header line, then ``xc_label_id<TAB>original_id`` per line.

    Returns
    -------
    dict
        ``original node id -> label id``.
    """
    mapping: dict[int, int] = {}
    with _open_text(path) as f:
        for lineno, line in enumerate(f, 1):
            parts = line.split()
            if not parts:
                continue
            if lineno == 1 and not parts[0].lstrip("-").isdigit():
                continue  # header
            if len(parts) != 2:
                raise ValueError(f"{path}, line {lineno}: expected 'label_id original_id', got {line.strip()!r}")
            mapping[int(parts[1])] = int(parts[0])
    return mapping


@dataclass(frozen=True)
class LabelHierarchy:
    """Parents of the labels.

    Attributes
    ----------
    membership : scipy.sparse.csr_matrix, shape (n_labels, n_parents), bool
        ``membership[i, j]``: parent node ``j`` is a parent of label ``i``.
    parent_ids : list
        The node id of each parent column (``None`` for the virtual root).
    n_labels : int
    """

    membership: sp.csr_matrix
    parent_ids: list
    n_labels: int

    @property
    def in_hierarchy(self) -> np.ndarray:
        """Labels that have at least one parent (appear in the hierarchy)."""
        return np.diff(self.membership.indptr) > 0

    def siblings(self, rows=None) -> sp.csr_matrix:
        """Sibling indicator rows: ``S[i, j] = 1`` when labels ``rows[i]`` and ``j != rows[i]`` share a parent.

        Parameters
        ----------
        rows : array_like of int, optional
            Label ids (default all: an ``L x L`` sparse matrix).

        Returns
        -------
        scipy.sparse.csr_matrix, shape (len(rows), n_labels), bool
        """
        rows = np.arange(self.n_labels) if rows is None else np.asarray(rows)
        M = self.membership.astype(np.int32)
        S = (M[rows] @ M.T).tocsr()
        S = S.tocoo()
        keep = S.col != rows[S.row]
        return sp.csr_matrix((np.ones(int(keep.sum()), dtype=bool), (S.row[keep], S.col[keep])),
                             shape=(len(rows), self.n_labels))

    def sibling_counts(self) -> np.ndarray:
        """Number of sibling labels of every label, shape (n_labels,)."""
        counts = np.zeros(self.n_labels, dtype=np.int64)
        step = max(1, BLOCK_ENTRIES // max(self.n_labels, 1))
        for start in range(0, self.n_labels, step):
            rows = np.arange(start, min(start + step, self.n_labels))
            counts[rows] = np.diff(self.siblings(rows).indptr)
        return counts


def read_hierarchy(path, *, label_map=None, n_labels: int | None = None, format: str = "paths") -> LabelHierarchy:
    """Read a label hierarchy file.

    Parameters
    ----------
    path : str or Path
        Plain or gzipped text.
    label_map : str, Path or dict, optional
        A ``label_map.tsv(.gz)`` file or a dict ``original node id -> label id``; nodes not in it
        are internal nodes (not labels). Default: the node ids are the label ids.
    n_labels : int, optional
        Number of labels (default: the largest label id + 1).
    format : {"paths", "edges"}, default "paths"
        One root-to-leaf path per line, or one ``parent child`` pair per line.

    Returns
    -------
    LabelHierarchy
    """
    if format not in ("paths", "edges"):
        raise ValueError(f"format must be 'paths' or 'edges', but is {format!r}")
    if label_map is not None and not isinstance(label_map, dict):
        label_map = read_label_map(label_map)
    edges: set = set()
    children_seen: set = set()
    with _open_text(path) as f:
        for lineno, line in enumerate(f, 1):
            parts = line.split()
            if not parts:
                continue
            try:
                ids = [int(p) for p in parts]
            except ValueError:
                raise ValueError(f"{path}, line {lineno}: node ids must be integers, got {line.strip()!r}") from None
            if format == "edges":
                if len(ids) != 2:
                    raise ValueError(f"{path}, line {lineno}: expected 'parent child', got {line.strip()!r}")
                edges.add((ids[0], ids[1]))
                children_seen.add(ids[1])
            else:
                edges.add((_ROOT, ids[0]))
                edges.update(zip(ids[:-1], ids[1:]))
                children_seen.update(ids[1:])
    if format == "edges":  # top-level nodes: parents that are never children
        edges.update((_ROOT, p) for p, _ in list(edges) if p not in children_seen)
    elif children_seen:
        edges = {(p, c) for p, c in edges if not (p is _ROOT and c in children_seen)}

    def label_of(node):
        if label_map is None:
            return node
        return label_map.get(node)

    pairs = [(label_of(c), p) for p, c in edges if label_of(c) is not None]
    if not pairs:
        raise ValueError(f"{path}: no node of the hierarchy is a label (check label_map)")
    max_label = max(lab for lab, _ in pairs)
    if n_labels is None:
        n_labels = max_label + 1
    elif max_label >= n_labels:
        raise ValueError(f"{path}: label id {max_label} is out of range for n_labels = {n_labels}")
    parents = sorted({p for _, p in pairs}, key=lambda p: (p is not _ROOT, -1 if p is _ROOT else p))
    column = {p: j for j, p in enumerate(parents)}
    rows = np.array([lab for lab, _ in pairs], dtype=np.int64)
    cols = np.array([column[p] for _, p in pairs], dtype=np.int64)
    membership = sp.csr_matrix((np.ones(len(rows), dtype=bool), (rows, cols)), shape=(n_labels, len(parents)))
    membership.sum_duplicates()
    parent_ids = [None if p is _ROOT else p for p in parents]
    return LabelHierarchy(membership=membership, parent_ids=parent_ids, n_labels=int(n_labels))


def nearest_neighbor_sibling_scores(embedding, hierarchy: LabelHierarchy, *, metric: str = "euclidean",
                                    block_rows: int | None = None) -> np.ndarray:
    """Per label, the (expected) indicator that its nearest neighbour in the embedding is a sibling.

    Parameters
    ----------
    embedding : array_like, shape (n_labels, k)
        One row per label.
    hierarchy : LabelHierarchy
    metric : {"euclidean", "cosine"}, default "euclidean"
    block_rows : int, optional
        Labels per block (default: about 2**24 / n_labels).

    Returns
    -------
    ndarray, shape (n_labels,), float64
        In ``[0, 1]``: ``s / t`` for ``t`` labels tied at the nearest distance, ``s`` of them siblings.
    """
    if metric not in ("euclidean", "cosine"):
        raise ValueError(f"metric must be 'euclidean' or 'cosine', but is {metric!r}")
    E = np.asarray(embedding, dtype=np.float64)
    if E.ndim != 2 or E.shape[0] != hierarchy.n_labels:
        raise ValueError(f"embedding must have one row per label ({hierarchy.n_labels}), but has shape {E.shape}")
    L = E.shape[0]
    if L < 2:
        return np.zeros(L)
    sq = np.einsum("ij,ij->i", E, E)
    if metric == "cosine":
        norms = np.sqrt(sq)
        E = np.divide(E, norms[:, None], out=np.zeros_like(E), where=norms[:, None] > 0)
        scale = 1.0
    else:
        scale = float(sq.max()) if L else 1.0
    step = int(block_rows or max(1, BLOCK_ENTRIES // L))
    out = np.zeros(L)
    for start in range(0, L, step):
        rows = np.arange(start, min(start + step, L))
        S = E[rows] @ E.T
        if metric == "euclidean":  # maximize -||e_j||^2 + 2 e_i.e_j  (= ||e_i||^2 - dist^2)
            S = 2.0 * S - sq[None, :]
        S[np.arange(len(rows)), rows] = -np.inf
        best = S.max(axis=1)
        tied = S >= (best - 1e-9 * max(scale, 1e-300))[:, None]
        n_tied = tied.sum(axis=1)
        sib = hierarchy.siblings(rows).tocoo()
        hits = np.bincount(sib.row, weights=tied[sib.row, sib.col], minlength=len(rows))
        out[rows] = hits / n_tied
    return out


def sibling_fraction(embedding, hierarchy: LabelHierarchy, *, metric: str = "euclidean",
                     block_rows: int | None = None) -> float:
    """Fraction of labels whose nearest neighbour in the embedding is a sibling (Table 4).

    Parameters
    ----------
    embedding : array_like, shape (n_labels, k)
    hierarchy : LabelHierarchy
    metric : {"euclidean", "cosine"}, default "euclidean"
    block_rows : int, optional

    Returns
    -------
    float
        Averaged over the labels that appear in the hierarchy; ties count in expectation.

    References
    ----------
    Mineiro & Karampatziakis (2015), Section 4.3.1, Table 4.
    """
    scores = nearest_neighbor_sibling_scores(embedding, hierarchy, metric=metric, block_rows=block_rows)
    present = hierarchy.in_hierarchy
    return float(scores[present].mean()) if present.any() else 0.0


def most_fraternal_fraction(hierarchy: LabelHierarchy) -> float:
    """The "most fraternal" constant baseline of Table 4.

    Every label's nearest neighbour is the label ``c*`` with the most siblings: it scores for the
    siblings of ``c*`` (``c*`` itself scores 0).

    Returns
    -------
    float
        ``max_i n_siblings(i) / n_labels_in_hierarchy``.
    """
    counts = hierarchy.sibling_counts()
    present = hierarchy.in_hierarchy
    return float(counts[present].max() / present.sum()) if present.any() else 0.0
