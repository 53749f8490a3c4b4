"""Classifiers on Dask arrays of row blocks.

:class:`EmbeddingClassifier` is the stagewise decoder of Rembrandt (Mineiro and Karampatziakis 2015,
Algorithm 3): regress a label embedding on the features, map the result through an optional random
Fourier feature map, and fit a softmax / independent logistic decoder over row blocks, early-stopped on
held-out training rows.
"""

from .embedding_classifier import MODEL_VERSION, EmbeddingClassifier, NotFittedError

__all__ = ["MODEL_VERSION", "EmbeddingClassifier", "NotFittedError"]
