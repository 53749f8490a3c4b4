"""Label and feature embeddings out of core: Rembrandt, compressed sensing, PLST, PCA.

- :class:`Rembrandt` (Algorithm 2 of Mineiro & Karampatziakis, 2015) and the function :func:`rembrandt`;
- :class:`CompressedSensing`: Algorithm 2 with ``q = p = 0`` (a whitened random projection);
- :class:`PLST`: top eigenvectors of ``Y^T Y``; :class:`PCAEmbedding`: top principal components of
  ``X`` ("PCA + LR"); :class:`RandomizedPCA`: Algorithm 1 as an estimator;
- :func:`sibling_fraction` / :func:`most_fraternal_fraction`: the hierarchy metric of Table 4.

Every estimator has ``fit``, ``transform``, ``save(url)`` and ``load(url)`` (or :func:`load_model`).
"""

from ._base import MODEL_VERSION, EmbeddingModel, NotFittedError, load_model
from .hierarchy import (
    LabelHierarchy,
    most_fraternal_fraction,
    nearest_neighbor_sibling_scores,
    read_hierarchy,
    read_label_map,
    sibling_fraction,
)
from .pca import PLST, PCAEmbedding, RandomizedPCA
from .rembrandt import CompressedSensing, Rembrandt, RembrandtMoments, RembrandtResult, rembrandt

__all__ = [
    "MODEL_VERSION",
    "PLST",
    "CompressedSensing",
    "EmbeddingModel",
    "LabelHierarchy",
    "NotFittedError",
    "PCAEmbedding",
    "RandomizedPCA",
    "Rembrandt",
    "RembrandtMoments",
    "RembrandtResult",
    "load_model",
    "most_fraternal_fraction",
    "nearest_neighbor_sibling_scores",
    "read_hierarchy",
    "read_label_map",
    "rembrandt",
    "sibling_fraction",
]
