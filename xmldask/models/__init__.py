"""Classifiers on Dask arrays of row blocks.

:class:`EmbeddingClassifier` is the stagewise decoder of Rembrandt (Mineiro and Karampatziakis 2015,
Algorithm 3): regress a label embedding on the features, map the result through an optional random
Fourier feature map, and fit a softmax / independent logistic decoder over row blocks, early-stopped on
held-out training rows. :class:`EnsembleClassifier` averages the probabilities of several of them fitted
with different seeds (each on its own random 90% of the rows). :class:`LEML` is low-rank empirical risk
minimisation with missing labels (Yu et al. 2014), :class:`BinaryRelevance` its per-label baseline.
:class:`LabelCentroidClassifier` scores only the labels of a row's best label clusters (large label spaces),
:class:`TreeClassifier` the candidates of a spectral label tree's leaves.
:class:`GradFac`, :class:`GradFacEN`, :class:`MultinomialBoosting` and :class:`OneVsRestBoosting` are
multiclass gradient boosting of oblivious trees (GradFac: one tree a round for any number of classes).
:func:`load_model` reads any of them. Each family's training parameters are a schema next to its estimator;
:class:`TrainParams` joins them, keyed on ``model`` (:mod:`xmldask.models.families`).
"""

from ..base import MODEL_CLASSES, NotFittedError, kept_epoch, registered_class
from ._graph import HeldOut
from .centroid import CENTROID_VERSION, LabelCentroidClassifier
from .embedding_classifier import MODEL_VERSION, EmbeddingClassifier
from .ensemble import ENSEMBLE_VERSION, EnsembleClassifier
from .families import DEFAULTS, FAMILY_PARAMS, TrainParams
from .gradfac import BOOSTING_VERSION, BoostingParams, GradFac, GradFacEN, MultinomialBoosting, OneVsRestBoosting
from .leml import LEML, LEML_VERSION, BinaryRelevance, BinaryRelevanceParams, LEMLParams
from .tree_classifier import TreeClassifier

__all__ = ["BOOSTING_VERSION", "BinaryRelevance", "BinaryRelevanceParams", "BoostingParams", "CENTROID_VERSION",
           "DEFAULTS", "ENSEMBLE_VERSION", "EmbeddingClassifier", "EnsembleClassifier", "FAMILY_PARAMS", "GradFac",
           "GradFacEN", "HeldOut", "LEML", "LEMLParams", "LEML_VERSION", "LabelCentroidClassifier", "MODEL_VERSION",
           "MultinomialBoosting", "NotFittedError", "OneVsRestBoosting", "TrainParams", "TreeClassifier",
           "kept_epoch", "load_model"]



def load_model(url: str):
    """The fitted model saved at ``url`` (a classifier, ensemble, tree or embedding), of whichever class its
    store records.

    Raises
    ------
    StoreError
        No model at ``url``, an incomplete or newer store, or a class this xmldask does not know.
    """
    import importlib

    from ..store.layout import StoreError
    from ..store.models import model_qualname

    name = model_qualname(url)
    module, _, attr = name.rpartition(".")
    cls = None
    if module.split(".")[0] == "xmldask":  # only this package's modules, whatever a store names
        try:
            cls = getattr(importlib.import_module(module), attr, None)
        except ImportError:
            cls = None  # moved since: found by its class name below
    if cls not in MODEL_CLASSES.values():  # a store written before classes were recorded by qualified name
        cls = registered_class(attr)
    if cls is None or not (hasattr(cls, "load") and hasattr(cls, "fit")):
        readable = sorted(c.__name__ for c in MODEL_CLASSES.values() if hasattr(c, "load") and hasattr(c, "fit"))
        raise StoreError(f"{url} holds a {name} model, which this xmldask cannot read (it reads "
                         f"{', '.join(readable)})")
    return cls.load(url)
