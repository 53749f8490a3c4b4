"""Label-embedding classifier: the stagewise decoder of Rembrandt's Algorithm 3, out of core.

Given a label embedding ``R`` (``n_labels x k``: Rembrandt, compressed sensing, PLST, or a feature
embedding such as PCA), :class:`EmbeddingClassifier` fits

1. ``W = argmin ||Y R - X W||^2 + lam ||W||^2`` (with an unpenalised intercept ``c``) by the blocked
   solver :func:`xmldask.linalg.ridge_lstsq`; ``Y R`` is computed per row block inside the pass;
2. features ``F = [phi(X W + c), 1]`` with ``phi`` the identity or random Fourier features
   ``sqrt(2/m) cos(Z Omega / sigma + b)`` of the Gaussian or the Laplacian kernel (bandwidth
   ``sigma`` by the median heuristic on a sample of rows), recomputed per row block, never stored;
3. the decoder ``Q = argmin loss(Y, F Q)`` for the softmax log loss (multiclass) or the independent
   logistic loss per label (multilabel): a ridge warm start ``(F^T F / n + lam I)^{-1} F^T Y / n``
   from one pass (Cholesky in float64, then rescaled on the held-out rows), refined by minibatch
   SGD with momentum preconditioned by the same ``(F^T F / n + lam I)^{-1}`` (as in the Rembrandt
   reference implementation), streaming row blocks and early-stopped on a held-out slice of the
   training rows. A small epoch runs in the fitting process (the next block is read while the
   current one is used); a large one runs as tasks on the cluster, in parallel chains of row blocks
   averaged at the end of the epoch (``sgd_chains``).

References
----------
Mineiro, P. and Karampatziakis, N. "Fast Label Embeddings via Randomized Linear Algebra" (ECML PKDD
2015), Algorithm 3 and section 4. Rahimi, A. and Recht, B. "Random Features for Large-Scale Kernel
Machines" (NIPS 2007). Agarwal, A., Kakade, S., Karampatziakis, N., Song, L. and Valiant, G.
"Least Squares Revisited: Scalable Approaches for Multi-class Prediction" (ICML 2014): least-squares
preconditioning of the log-loss gradient.
"""

from __future__ import annotations

import copy
import logging
import math
import queue
import threading
import time
from typing import Annotated, Literal

import dask
import dask.array as da
import numpy as np
import scipy.linalg
import scipy.sparse as sp
from pydantic import Field

from ..base import NotFittedError, ParamsMixin, as_rows, check_float, check_int, seed_of
from ..embedding import PLST, CompressedSensing, PCAEmbedding, Rembrandt
from ..linalg import ridge_lstsq, x_q
from ..params import (
    AUTO_SEARCH,
    FEATURES_HELP,
    KERNEL_ALIASES,
    FamilyParams,
    Features,
    Kernel,
    PositiveInt,
    kernel_name,
)
from ..scheduling import computed_once, parallelism
from ..scheduling import read_only as _read_only
from ..store.models import SavedModel
from . import _graph
from . import _kernels as K
from ._screen import Screener

__all__ = ["EPOCH_FEATURES_BYTES", "MODEL_VERSION", "SGD_CHAIN_BLOCKS", "SGD_CLUSTER_ENTRIES", "EmbeddingClassifier",
           "EmbeddingParams", "NotFittedError"]

logger = logging.getLogger("xmldask.models")

#: version of the saved-model layout; a change that old readers cannot read bumps it
MODEL_VERSION = 1

_TASKS = ("auto", "multiclass", "multilabel")
_STOP_METRICS = ("loss", "p@1")
#: names accepted for ``embedding=`` and the class looked up in :mod:`xmldask.embedding` at fit time
_EMBEDDING_CLASSES = {"rembrandt": Rembrandt, "cs": CompressedSensing, "plst": PLST, "pca": PCAEmbedding}

#: held-out rows on which the ridge warm start is rescaled to the log-loss scale (:meth:`_rescale`) at most,
RESCALE_ROWS = 2000
#: and score entries (rows x labels) at most: two scalars are fitted on them by about 28 evaluations of the loss,
#: which on all of them could cost more than the rest of a screened setting
RESCALE_ENTRIES = 1 << 18
#: scales ``c`` tried by the rescaling: 1, 2, 4, ..., 256 (ridge scores of 0/1 targets are near
#: probabilities; as logits they need a factor of this order)
RESCALE_FACTORS = 2.0 ** np.arange(0, 9)
#: bias offsets ``o`` tried for independent logistic losses (multilabel: most labels of a row are 0)
RESCALE_OFFSETS = (0.0, -1.0, -2.0, -4.0, -6.0, -8.0)


def rescale_grid_min(loss, factors, offsets) -> tuple[float, float]:
    """The ``(c, o)`` of the grid ``factors x offsets`` (both sorted) with the smallest ``loss(c, o)``, the first of
    ties in the order ``c`` then ``o``: the grid's whole search, in fewer evaluations. A loss of the logits
    ``c S + o`` is convex in ``o``, so along ``o`` its grid values fall then rise; for each ``c`` the search walks
    from the previous ``c``'s best ``o`` to where they stop falling (about 3 evaluations a factor instead of one per
    offset)."""
    best, j = (math.inf, factors[0], offsets[0]), 0
    for c in factors:
        values = {}  # offset index -> loss at this factor
        while True:
            for i in (j - 1, j, j + 1):
                if 0 <= i < len(offsets) and i not in values:
                    values[i] = loss(c, offsets[i])
            if j > 0 and values[j - 1] <= values[j]:
                j -= 1
            elif j + 1 < len(offsets) and values[j + 1] < values[j]:
                j += 1
            else:
                break
        if values[j] < best[0]:
            best = (values[j], c, offsets[j])
    return float(best[1]), float(best[2])
#: row blocks the bandwidth's sample rows are drawn from (a few blocks: one small read)
BANDWIDTH_BLOCKS = 8
#: score entries (training rows x labels) of an SGD epoch from which it runs as tasks on the cluster
#: (``sgd_chains``); a smaller epoch runs in the fitting process (a few seconds: less than a graph's overhead)
SGD_CLUSTER_ENTRIES = 1 << 28
#: row blocks per chain at least, with ``sgd_chains="auto"``
SGD_CHAIN_BLOCKS = 4
#: bytes of the training rows' decoder features up to which epochs in the fitting process keep them from the first
#: epoch to the next ones, instead of reading the row blocks and computing the features again every epoch (lshtc1's
#: 3,563 rows x 2,001 random features: 28.5 MB, docs/measurements.md)
EPOCH_FEATURES_BYTES = 1 << 28


class EmbeddingParams(FamilyParams):
    """``xmldask train --model embedding`` (and ``auto`` where it scores fewer labels a row than the centroids):
    the label-embedding classifier (:class:`EmbeddingClassifier`), which scores every label, searched and averaged
    over an ensemble by default."""

    model: Literal["auto", "embedding"] = "auto"
    embedding: Literal["rembrandt", "cs", "plst", "pca"] = Field(
        "rembrandt", description="label embedding (rembrandt, cs, plst) or feature embedding (pca)")
    n_components: PositiveInt = Field(50, description="embedding dimension k; at most the number of labels (a larger "
                                                      "k is lowered to it, with a message)")
    kernel: Kernel = Field(
        "gaussian", description="random Fourier features of the embedded predictions: none (linear), gaussian or "
                                "laplacian (cauchy, its former name, is read too)")
    features: Features = Field("raw", description=FEATURES_HELP)
    alpha: Annotated[float, Field(ge=0)] = Field(1e-3, description="ridge of the regression onto the embedding "
                                                                   "(relative to the mean squared feature norm)")
    n_random_features: PositiveInt = Field(2000, description="random features of the kernel")
    max_epochs: Annotated[int, Field(ge=0)] = Field(10, description="decoder epochs at most (early-stopped on "
                                                                     "held-out training rows)")

    @classmethod
    def resolve(cls, data: dict) -> dict:
        """A former kernel name read as the kernel it names; ``search="auto"`` (the default) becomes the
        :data:`~xmldask.params.AUTO_SEARCH` of the parameters not given (resolved once: a dumped and reloaded model
        is the same). ``n_estimators="auto"`` is the job's (:func:`xmldask.jobs.members_asked`)."""
        if isinstance(data.get("kernel"), str):
            data = {**data, "kernel": KERNEL_ALIASES.get(data["kernel"], data["kernel"])}
        if data.get("search", "auto") == "auto":
            data = {**data, "search": {name: list(values) for name, values in AUTO_SEARCH.items()
                                       if name not in data} or None}
        return data


#: the defaults of :class:`EmbeddingParams`: the constructor's defaults of its fields
_DEFAULTS = EmbeddingParams(search=None)


def _put(out: queue.Queue, item, stop: threading.Event) -> bool:
    """``out.put(item)`` unless ``stop`` is set first (checked every 0.1 s); whether it was put."""
    while not stop.is_set():
        try:
            out.put(item, timeout=0.1)
            return True
        except queue.Full:
            continue
    return False


class EmbeddingClassifier(SavedModel, ParamsMixin):
    """Multiclass / multilabel classifier through a label embedding (Algorithm 3 of Rembrandt).

    Parameters
    ----------
    embedding : ndarray of shape (n_labels, k), str, or estimator, default "rembrandt"
        The label embedding ``R``; a name (``"rembrandt"``, ``"cs"``, ``"plst"``, ``"pca"``) of an
        estimator of :mod:`xmldask.embedding` (looked up at ``fit`` and fitted with
        ``n_components``); or an estimator with ``fit(X, Y)`` and ``embedding_`` (fitted at ``fit``
        unless it already has ``embedding_``). A feature embedding with ``components_``
        (``n_features x k``, e.g. PCA) and no ``embedding_`` is used directly as ``W`` (with its
        ``mean_`` as centre, if any).
    n_components : int, default 50
        ``k`` for an embedding given by name.
    features : {"raw", "l2", "tfidf"}, default "raw"
        What ``X`` is turned into before everything else (fit and prediction alike): the raw values;
        rows scaled to unit L2 norm; or tf-idf: every column weighted by its smoothed inverse
        document frequency ``log((1 + n) / (1 + df)) + 1`` over the training rows (one extra pass),
        then rows scaled to unit L2 norm. The transform is part of the model, so predictions take
        the raw rows.
    kernel : {"none", "gaussian", "laplacian"}, default "gaussian"
        The feature map ``phi`` applied to ``X W + c``: none (the identity), or random Fourier features of the
        Gaussian kernel (normal frequencies) or the Laplacian kernel (Cauchy frequencies).
    n_random_features : int, default 2000
        ``m``, the number of random Fourier features.
    bandwidth_scale : float, default 1.0
        ``sigma = bandwidth_scale * median pairwise distance`` (Euclidean for Gaussian, L1 for
        Laplacian) of a sample of rows of ``X W + c``.
    alpha : float, default 1e-3
        Ridge of ``W`` relative to the data scale (:func:`xmldask.linalg.ridge_lstsq`).
    decoder_alpha : float, default 1e-3
        Ridge of the decoder's warm start and preconditioner, relative to the mean diagonal of
        ``F^T F / n``.
    task : {"auto", "multiclass", "multilabel"}, default "auto"
        ``"auto"``: multiclass (softmax loss) iff every training row has exactly one label,
        multilabel (independent logistic losses) otherwise.
    max_epochs : int, default 10
        Most SGD epochs over the training rows (0: the rescaled ridge decoder only).
    batch_size : int, default 4096
        Rows per SGD step (fewer when ``batch_size x n_labels`` exceeds ``MINIBATCH_SCORES``).
    learning_rate : float, default 4.0
        Step size of the preconditioned SGD (halved, from the best iterate, after an epoch
        without held-out improvement).
    momentum : float, default 0.9

        The defaults were chosen on the held-out slice of the ALOI training rows (``bench/decoder.py``):
        Gaussian random features with ``sigma = 0.5 x`` median distance and steps of 4 with
        momentum 0.9 on 4096-row batches reached 93.8% held-out accuracy in 4 epochs (identity
        features, steps of 1 on 2048 rows: 87.3% after 20 epochs). The softmax loss has curvature
        far below the least-squares preconditioner's, hence steps above 1. Over 10 epochs
        (``python bench/decoder.py --dataset aloi --kernel gaussian --batch-size 4096 --learning-rate 4
        --no-test --bandwidth-scale S``) the held-out accuracy was 94.2% at ``S = 0.5`` and 94.4% at
        ``S = 1``, hence ``bandwidth_scale = 1``.
    l2 : float, default 0.0
        Weight decay on ``Q`` (not the bias) in the SGD steps.
    sgd_chains : int or "auto", default "auto"
        Where and how the SGD epochs run. An epoch of fewer than :data:`SGD_CLUSTER_ENTRIES` score
        entries (training rows x labels: a few seconds of work) runs in this process, the next row
        block read while the current one is used. A larger epoch runs as tasks on the cluster, where
        the blocks are: the blocks are dealt to ``sgd_chains`` chains that step through their blocks
        on different workers at the same time, and the chains' decoders are averaged at the end of
        the epoch (one chain: plain sequential SGD). ``"auto"``: the tasks the cluster runs at once,
        at most one chain per :data:`SGD_CHAIN_BLOCKS` row blocks; the decoder then depends on the
        size of the cluster (pass an int for the same decoder on any cluster).
    validation_fraction : float, default 0.1
        Fraction of the training rows held out for early stopping (a seeded random subset of
        every row block); they are excluded from all fitting steps (``W``, ``sigma``, ``Q``).
    max_validation_rows : int, default 10000
        Cap on the held-out rows (their features are kept in memory).
    n_iter_no_change : int, default 2
        Stop after this many epochs without improvement of the held-out metric.
    early_stopping : {"loss", "p@1"}, default "loss"
        Held-out metric used to keep the best decoder.
    bandwidth_sample : int, default 2000
        Rows sampled for the median heuristic.
    dtype : numpy dtype, default float32
        dtype of the features, ``W``, ``Q`` (Cholesky factorisations run in float64).
    time_budget : float, optional
        Seconds the fit may take: no decoder epoch starts that would end past it (judged by the longest epoch so
        far; none when the steps before them spent it: the ridge decoder is kept). The embedding and the ridge
        maps are always fitted.
    random_state : int, SeedSequence, Generator or None
        Seeds the held-out split, the random features, the bandwidth sample and the SGD order.

    Attributes
    ----------
    idf_ : ndarray of shape (n_features,) or None
        Column weights of ``features="tfidf"``.
    W_ : ndarray, shape (n_features, k)
    intercept_ : ndarray, shape (k,)
    omega_, phase_ : ndarray of shape (k, m) and (m,), or None
        Random Fourier features (unit bandwidth); ``None`` for the identity.
    bandwidth_ : float or None
    Q_ : ndarray, shape (m, n_labels)
    bias_ : ndarray, shape (n_labels,)
    R_ : ndarray of shape (n_labels, k) or None
        The label embedding used.
    task_ : str
        ``"multiclass"`` or ``"multilabel"``.
    history_ : list of dict
        Per epoch: ``epoch``, ``learning_rate``, ``train_loss`` (mean per row), ``val_loss``,
        ``val_p@1``, ``seconds``; epoch 0 is the warm start.
    n_passes_ : int
        Passes over the row blocks of ``X`` made by ``fit`` (not counting an embedding's own).
    validation_seed_ : int
        The seed of the rows the fit held out (``fit``'s ``validation_seed``); not saved.

    Notes
    -----
    ``decision_function`` returns dense ``n_samples x n_labels`` scores: large for many labels;
    ``predict_topk`` never forms a block of them.

    References
    ----------
    Mineiro and Karampatziakis (2015), Algorithm 3 (``W``: line 4, ``phi``: line 5, ``Q``: line 6,
    early stopping on held-out loss: section 4.1; Cauchy random features, 4000 of them: section
    4.3.3). Rahimi and Recht (2007), Algorithm 1 (random Fourier features).

    Examples
    --------
    >>> import numpy as np, scipy.sparse as sp
    >>> from xmldask.models import EmbeddingClassifier
    >>> rng = np.random.default_rng(0)
    >>> X = sp.csr_matrix(rng.normal(size=(600, 8)).astype(np.float32))
    >>> y = X.toarray()[:, :3].argmax(axis=1)
    >>> Y = sp.csr_matrix((np.ones(600, np.float32), (np.arange(600), y)), shape=(600, 3))
    >>> clf = EmbeddingClassifier(embedding=np.eye(3), kernel="gaussian", n_random_features=200,
    ...                           max_epochs=5, learning_rate=0.5, batch_size=256, random_state=0).fit(X, Y)
    >>> labels, scores = clf.predict_topk(X, k=1)
    >>> bool((labels.compute()[:, 0] == y).mean() > 0.8)
    True
    """

    family = "embedding"
    params_schema = EmbeddingParams
    _MODEL_VERSION = MODEL_VERSION
    _ARRAYS = ("W", "intercept", "omega", "phase", "Q", "bias", "R", "idf")
    _SCALARS = ("bandwidth", "task", "n_passes", "n_features_in", "n_labels", "history", "embedding_kind", "lam")

    def __init__(self, *, embedding=_DEFAULTS.embedding, n_components: int = _DEFAULTS.n_components,
                 features: str = _DEFAULTS.features, kernel: str = _DEFAULTS.kernel,
                 n_random_features: int = _DEFAULTS.n_random_features, bandwidth_scale: float = 1.0,
                 alpha: float = _DEFAULTS.alpha, decoder_alpha: float = 1e-3, task: str = "auto",
                 max_epochs: int = _DEFAULTS.max_epochs, batch_size: int = 4096,
                 learning_rate: float = 4.0, momentum: float = 0.9, l2: float = 0.0, sgd_chains="auto",
                 validation_fraction: float = 0.1, max_validation_rows: int = 10000, n_iter_no_change: int = 2,
                 early_stopping: str = "loss", bandwidth_sample: int = 2000, dtype=np.float32,
                 time_budget: float | None = None, random_state=None):
        self.embedding, self.n_components, self.features = embedding, n_components, features
        self.kernel, self.n_random_features, self.bandwidth_scale = kernel, n_random_features, bandwidth_scale
        self.alpha, self.decoder_alpha, self.task = alpha, decoder_alpha, task
        self.max_epochs, self.batch_size = max_epochs, batch_size
        self.learning_rate, self.momentum, self.l2, self.sgd_chains = learning_rate, momentum, l2, sgd_chains
        self.validation_fraction, self.max_validation_rows = validation_fraction, max_validation_rows
        self.n_iter_no_change, self.early_stopping = n_iter_no_change, early_stopping
        self.bandwidth_sample, self.dtype, self.random_state = bandwidth_sample, dtype, random_state
        self.time_budget = time_budget

    @staticmethod
    def relative_cost(params: dict) -> float:
        """How the cost of a fit with ``params`` compares with others' (for a time budget): the width of the decoder
        its epochs train, the random features of a kernel or the embedding size of the linear map."""
        kernel = kernel_name(params.get("kernel", "gaussian"))
        return float(params.get("n_random_features", 2000) if kernel != "none" else params.get("n_components", 50))

    #: parameters that matter only for some values of another: name -> (other, its values that use it);
    #: :class:`~xmldask.model_selection.HeldOutSearch` searches them together and skips ignored ones
    conditional_params = {name: ("kernel", ("gaussian", "laplacian"))
                          for name in ("n_random_features", "bandwidth_scale", "bandwidth_sample")}


    def search_bounds(self, X, Y) -> dict[str, tuple]:
        """Ranges of the numeric parameters for a search on ``X``, ``Y`` (how far a grid may be extended).

        ``n_components`` of a label embedding given by name is at most the number of labels (of a
        feature embedding, the number of features); of Rembrandt's, also at most the number of
        features: ``X W`` has rank at most ``d`` and Rembrandt's top ``d`` directions span it.
        """
        most = Y.shape[1] if self.embedding in ("rembrandt", "cs", "plst") else X.shape[1]
        if self.embedding == "rembrandt":
            most = min(most, X.shape[1])
        return {"n_components": (1, int(most)), "n_random_features": (1, math.inf)}

    def screener(self, X, Y):
        """What a search's screen uses instead of a fit per screened setting on ``X``, ``Y``: a
        :class:`~xmldask.models._screen.Screener` (statistics shared by every candidate, one pass per input
        normalisation), whose ``score(params)`` is the fit's held-out figures for the settings it
        ``applies(params)`` to."""
        X, Y = self._check_xy(X, Y)
        return Screener(X, Y, type(self), template=self.get_params(deep=False))

    def __repr__(self) -> str:
        shown = [f"{k}={v!r}" for k, v in self.get_params(deep=False).items()
                 if not isinstance(v, np.ndarray) and k in ("embedding", "kernel", "n_random_features", "task")]
        return f"{type(self).__name__}({', '.join(shown)})"

    # -- validation ---------------------------------------------------------------------------

    def _validated(self) -> dict:
        if self.features not in K.FEATURES:
            raise ValueError(f"features must be one of {', '.join(map(repr, K.FEATURES))}, but is {self.features!r}")
        if self.task not in _TASKS:
            raise ValueError(f"task must be one of {', '.join(map(repr, _TASKS))}, but is {self.task!r}")
        if self.early_stopping not in _STOP_METRICS:
            raise ValueError(f"early_stopping must be one of {', '.join(map(repr, _STOP_METRICS))}, "
                             f"but is {self.early_stopping!r}")
        dtype = np.dtype(self.dtype)
        if dtype not in (np.float32, np.float64):
            raise ValueError(f"dtype must be float32 or float64, but is {dtype}")
        return dict(
            kernel=kernel_name(self.kernel),
            n_components=check_int(self.n_components, "n_components", 1),
            n_random_features=check_int(self.n_random_features, "n_random_features", 1),
            bandwidth_scale=check_float(self.bandwidth_scale, "bandwidth_scale", low_open=True),
            alpha=check_float(self.alpha, "alpha"),
            decoder_alpha=check_float(self.decoder_alpha, "decoder_alpha", low_open=True),
            max_epochs=check_int(self.max_epochs, "max_epochs", 0),
            batch_size=check_int(self.batch_size, "batch_size", 1),
            learning_rate=check_float(self.learning_rate, "learning_rate", low_open=True),
            momentum=check_float(self.momentum, "momentum", high=0.999),
            l2=check_float(self.l2, "l2"),
            sgd_chains="auto" if self.sgd_chains == "auto" else check_int(self.sgd_chains, "sgd_chains", 1),
            validation_fraction=check_float(self.validation_fraction, "validation_fraction", high=0.5),
            max_validation_rows=check_int(self.max_validation_rows, "max_validation_rows", 0),
            n_iter_no_change=check_int(self.n_iter_no_change, "n_iter_no_change", 1),
            bandwidth_sample=check_int(self.bandwidth_sample, "bandwidth_sample", 2),
            dtype=dtype,
            time_budget=None if getattr(self, "time_budget", None) is None else
            check_float(self.time_budget, "time_budget", low_open=True),
        )

    def _check_fitted(self) -> None:
        if getattr(self, "Q_", None) is None:
            raise NotFittedError(f"this {type(self).__name__} is not fitted yet; call fit(X, Y) first")

    def _check_x(self, X) -> da.Array:
        return self._input_features(self._rows(X))

    def _input_features(self, X: da.Array) -> da.Array:
        """``X`` as the model sees it (the ``features`` transform, with the fitted ``idf_``)."""
        features = getattr(self, "features", "raw") or "raw"
        if features == "raw":
            return X
        return _graph.transform_rows(X, getattr(self, "idf_", None) if features == "tfidf" else None)

    # -- the embedding --------------------------------------------------------------------------

    def _every_label(self, p: dict, n_labels: int) -> np.ndarray | None:
        """The identity ``(n_labels, n_labels)`` when a named label embedding is asked for ``k >= n_labels``
        directions, else ``None``. A label embedding of every direction is an orthonormal basis of all of them, and
        the ridge map, the decoder (its ridge, the SGD steps and their preconditioner) and the random features'
        distribution are the same in any orthonormal basis: the identity gives the predictions Rembrandt's (or
        CS's, or PLST's) basis gives, without its decomposition (docs/measurements.md)."""
        name = self.embedding.lower() if isinstance(self.embedding, str) else None
        if name in _EMBEDDING_CLASSES and name != "pca" and p["n_components"] >= n_labels:
            return np.eye(n_labels, dtype=p["dtype"])
        return None

    def _resolve_embedding(self, X: da.Array, Y: da.Array, p: dict):
        """``("label", R)`` or ``("feature", (V, mean))`` from the ``embedding`` parameter; the passes of an
        embedding fitted here are in ``self._embedding_passes``."""
        self._embedding_passes = 0
        emb = self.embedding
        if emb is None:
            raise ValueError("embedding is required: an (n_labels, k) array, an estimator with fit(X, Y) and "
                             "embedding_, or one of " + ", ".join(map(repr, _EMBEDDING_CLASSES)))
        if isinstance(emb, str):
            if emb.lower() not in _EMBEDDING_CLASSES:
                raise ValueError(f"unknown embedding name {emb!r}; known names: "
                                 f"{', '.join(map(repr, _EMBEDDING_CLASSES))} (or pass an array or an estimator)")
            every = self._every_label(p, Y.shape[1])
            if every is not None:
                logger.info("k=%d keeps all %d label directions: the embedding is the identity", p["n_components"],
                            Y.shape[1])
                return "label", every
            if emb.lower() != "pca":  # a label embedding
                return "label", self._named_embedding(emb.lower(), X, Y, p)
            emb = PCAEmbedding(n_components=p["n_components"], random_state=self._seed)
        if isinstance(emb, np.ndarray) or (not hasattr(emb, "fit") and np.ndim(emb) == 2):
            R = np.asarray(emb, dtype=p["dtype"])
            if R.ndim != 2 or R.shape[0] != Y.shape[1]:
                raise ValueError(f"embedding must have shape (n_labels, k) = ({Y.shape[1]}, k), but has {R.shape}")
            return "label", R
        if not hasattr(emb, "fit"):
            raise TypeError(f"embedding must be an array, a name or an estimator with fit(X, Y), but is "
                            f"{type(emb).__name__}")
        if getattr(emb, "embedding_", None) is None and getattr(emb, "components_", None) is None:
            logger.info("fitting the embedding %r", emb)
            emb.fit(X, Y)
            self._embedding_passes = int(getattr(emb, "n_passes_", 0))
        if getattr(emb, "embedding_", None) is not None:
            R = np.asarray(emb.embedding_, dtype=p["dtype"])
            if R.ndim != 2 or R.shape[0] != Y.shape[1]:
                raise ValueError(f"{type(emb).__name__}.embedding_ must have shape (n_labels, k) = "
                                 f"({Y.shape[1]}, k), but has {R.shape}")
            return "label", R
        V = np.asarray(emb.components_, dtype=p["dtype"])
        if V.shape[0] != X.shape[1] and V.shape[1] == X.shape[1]:
            V = V.T  # scikit-learn layout (k, n_features)
        if V.shape[0] != X.shape[1]:
            raise ValueError(f"{type(emb).__name__}.components_ must have shape (n_features, k) = "
                             f"({X.shape[1]}, k), but has {V.shape}")
        mean = getattr(emb, "mean_", None)
        return "feature", (V, None if mean is None else np.asarray(mean, dtype=p["dtype"]))

    def _named_embedding(self, name: str, X: da.Array, Y: da.Array, p: dict) -> np.ndarray:
        """``R`` of the embedding named ``name`` (k and seed from the parameters) fitted on ``X``, ``Y``, once for
        the fits of this process that ask for the same one (:func:`~xmldask.scheduling.computed_once`)."""
        def fit():
            emb = _EMBEDDING_CLASSES[name](n_components=p["n_components"], random_state=self._seed)
            logger.info("fitting the embedding %r", emb)
            emb.fit(X, Y)
            return (_read_only(np.asarray(emb.embedding_, dtype=p["dtype"])), int(getattr(emb, "n_passes_", 0)),
                    "a fit of the same data")

        (R, self._embedding_passes, origin), shared = computed_once(self._embedding_key(name, p, self._seed, X, Y), fit)
        if shared:
            logger.info("the embedding %s (k=%d) taken from %s", name, R.shape[1], origin)
        return R

    # what a fit computes first from the data, under keys that another computation of the same values (a fit of
    # the same rows under another kernel, an ensemble's member, a screen's statistics: Screener.offer) may use

    @staticmethod
    def _embedding_key(name: str, p: dict, seed: int, X: da.Array, Y: da.Array) -> str:
        """The key of the named embedding ``R`` fitted on the input features ``X`` and labels ``Y``."""
        return dask.base.tokenize("embedding", name, p["n_components"], seed, X, Y, np.dtype(p["dtype"]).str)

    @staticmethod
    def _ridge_map_key(X: da.Array, Y: da.Array, R: np.ndarray, p: dict, split: _graph.HeldOut) -> str:
        """The key of the ridge map ``(W, intercept)`` from ``X`` onto ``Y R`` on the training rows of ``split``."""
        return dask.base.tokenize("ridge-map", X, Y, R, p["alpha"], split.seed, split.fraction, split.chunks,
                                  np.dtype(p["dtype"]).str)

    @staticmethod
    def _decoder_data_key(X: da.Array, Y: da.Array, split: _graph.HeldOut, W: np.ndarray, intercept: np.ndarray,
                          p: dict) -> str:
        """The key of the linear map's decoder statistics: ``F^T F``, ``F^T Y`` of ``F = [X W + c, 1]`` over the
        training rows of ``split``, the held-out rows' ``F`` and ``Y``, and the task the labels show."""
        return dask.base.tokenize("decoder-data", X, Y, split.seed, split.fraction, split.chunks, W, intercept,
                                  np.dtype(p["dtype"]).str)

    # -- fit ------------------------------------------------------------------------------------

    def _check_worker_memory(self, X, Y, p) -> None:
        """Refuse before the first pass a fit whose decoder pass cannot fit one worker's memory limit, shared by the
        tasks its threads run at once.

        A task of the decoder's pass holds ``F^T F`` and ``F^T Y`` partial sums (float64, three at a
        time in the tree sum: :func:`_graph.normal_equations_task_bytes`) plus its row block; a worker
        whose limit is below that is restarted again and again until Dask gives up (``KilledWorker``)
        after minutes.
        """
        from ..scheduling import task_memory_limit, worker_threads

        limit = task_memory_limit()  # a worker's limit shared by the tasks its threads run at once
        if limit is None:
            return
        m1 = (p["n_random_features"] if p["kernel"] != "none" else min(p["n_components"], Y.shape[1])) + 1
        need = _graph.normal_equations_task_bytes(m1, Y.shape[1])
        block_rows = max(X.chunks[0], default=0)
        need += block_rows * m1 * np.dtype(p["dtype"]).itemsize  # the held-out and feature rows of one block
        if need > limit:
            from dask.utils import format_bytes

            raise ValueError(
                f"one task of the decoder's pass needs about {format_bytes(need)} ({m1 - 1} decoder features x "
                f"{Y.shape[1]} labels in float64 partial sums, blocks of {block_rows} rows) but the smallest worker "
                f"memory limit gives each of its {worker_threads()} thread(s) {format_bytes(limit)}: raise the limit "
                f"(--memory-limit) above {format_bytes(need * worker_threads())} or give the workers fewer threads, "
                "or lower n_random_features (--n-random-features) or k; fewer block rows (ingest --block-rows) help "
                "only the last term")

    def fit(self, X, Y, *, validation_seed: int | None = None, callback=None) -> EmbeddingClassifier:
        """Fit ``W``, the feature map and the decoder ``Q`` (Algorithm 3).

        Parameters
        ----------
        X : dask.array.Array or scipy.sparse matrix, shape (n_samples, n_features)
            Row blocks (``open_dataset(url).X``); an in-memory matrix is split into row blocks.
        Y : dask.array.Array or scipy.sparse matrix, shape (n_samples, n_labels)
            Binary labels with ``X``'s row blocks.
        validation_seed : int, optional
            The seed of the held-out rows (``validation_seed_`` of a fitted model); by default drawn from
            ``random_state``. Models fitted with the same seed on the same row blocks hold out the same rows,
            so that their mean is scored on rows none of them fitted (:class:`~xmldask.models.EnsembleClassifier`
            with ``early_stopping``).
        callback : callable, optional
            Called before each decoder epoch with the ``history_`` so far (the warm start's held-out figures
            first); the epochs stop where it returns false (:class:`~xmldask.model_selection.HeldOutSearch` races
            its full fits so). The decoder kept is the best so far by ``early_stopping``, as after any stop.

        Returns
        -------
        EmbeddingClassifier
            ``self``, fitted.
        """
        t_start = time.perf_counter()
        p = self._validated()
        self._seed = seed_of(self.random_state)
        X, Y = self._check_xy(X, Y)
        self._check_worker_memory(X, Y, p)
        passes = self._fit_idf(X, p["dtype"])
        X = self._input_features(X)
        rng_split, rng_feat, rng_bw, rng_sgd = (np.random.default_rng(s)
                                                for s in np.random.SeedSequence(self._seed).spawn(4))
        split = self._held_out(X, p, int(rng_split.integers(2**63)) if validation_seed is None else validation_seed)
        self.validation_seed_ = split.seed
        state, n = self._fit_feature_map(X, Y, split, p)  # Algorithm 3, lines 3-4
        passes += n
        self._fit_random_features(X, split, state, p, rng_feat, rng_bw)  # line 5
        d, n = self._decoder_data(X, Y, split, state, p, t_start)  # one pass: normal equations, held-out rows
        passes += n
        Q, chol = self._warm_start(d, p)
        # the linear map's ridge decoder, as fitted with max_epochs=0 (at_warm_start); a random-feature decoder,
        # m + 1 wide, is not kept
        self._ridge_decoder = (Q.copy(), passes) if p["max_epochs"] > 0 and p["kernel"] == "none" else None
        if p["max_epochs"] > 0:  # line 6
            if d.Fh is None:
                logger.warning("no held-out rows (validation_fraction=%g): SGD runs %d epochs without early "
                               "stopping", p["validation_fraction"], p["max_epochs"])
            if callback is None or callback(d.history):
                # SGD's preconditioner (F^T F / n + lam I)^{-1}, made for the epochs alone (a raced fit may make none)
                P = K.inverse_from_cholesky(chol).astype(p["dtype"])
                Q, n_epochs = self._sgd(d, Q, P, p, rng_sgd, callback)
                passes += n_epochs
            else:
                d.history[-1]["stopped"] = "callback"
        self.task_ = d.task
        self.W_, self.intercept_ = state["W"], state["intercept"]
        self.omega_, self.phase_, self.bandwidth_ = state["omega"], state["phase"], state["bandwidth"]
        self.Q_, self.bias_ = np.ascontiguousarray(Q[:-1]), np.ascontiguousarray(Q[-1])
        self.n_features_in_, self.n_labels_ = X.shape[1], Y.shape[1]
        self.history_ = d.history
        self.n_passes_ = passes
        logger.info("fitted in %.1f s, %d passes", time.perf_counter() - t_start, passes)
        return self

    def at_warm_start(self, release: bool = False) -> EmbeddingClassifier | None:
        """This fitted model as fitted with ``max_epochs=0`` (the same model: the ridge decoder its epochs
        started from), for a fit with decoder epochs on the linear map (``kernel='none'``); else ``None``.

        The held-out search takes the ridge decoder it screened from a full fit of the same setting instead of
        fitting it again. That decoder (as large as ``Q_``; never saved) is kept in memory until a call with
        ``release=True``, after which this model has none to give.
        """
        start = getattr(self, "_ridge_decoder", None)
        if release:
            self._ridge_decoder = None
        if start is None:
            return None
        Q, passes = start
        model = copy.copy(self)
        model.max_epochs, model._ridge_decoder = 0, None
        model.Q_, model.bias_ = np.ascontiguousarray(Q[:-1]), np.ascontiguousarray(Q[-1])
        model.history_, model.n_passes_ = self.history_[:1], passes
        return model

    # -- the steps of fit -----------------------------------------------------------------------

    @staticmethod
    def _check_xy(X, Y) -> tuple[da.Array, da.Array]:
        X = as_rows(X, "X")
        Y = as_rows(Y, "Y", block_rows=X.chunks[0][0] if not isinstance(Y, da.Array) else None)
        if Y.shape[0] != X.shape[0]:
            raise ValueError(f"Y has {Y.shape[0]} rows but X has {X.shape[0]}; they must hold the same samples")
        if tuple(Y.chunks[0]) != tuple(X.chunks[0]):
            raise ValueError(f"Y's row blocks must be X's ({len(X.chunks[0])} blocks); fix: Y = Y.rechunk({{0: "
                             f"X.chunks[0]}}) (or open both from one dataset store)")
        return X, Y

    def _fit_idf(self, X, dtype) -> int:
        """``idf_`` for ``features='tfidf'`` (one pass; passes made returned), else ``None``."""
        self.idf_ = None
        if self.features != "tfidf":
            return 0
        df = dask.compute(_graph.document_counts(X))[0]
        self.idf_ = K.idf_weights(df, X.shape[0], dtype)
        return 1

    @staticmethod
    def _held_out(X, p, seed: int) -> _graph.HeldOut:
        """The held-out rows: a seeded random subset of every block, drawn per block where needed
        (nothing n-sized is kept), at most ``max_validation_rows`` in all."""
        frac = min(p["validation_fraction"], p["max_validation_rows"] / max(X.shape[0], 1))
        split = _graph.HeldOut(int(seed), float(frac), tuple(int(c) for c in X.chunks[0]))
        if split.n_train() == 0:
            raise ValueError("no training rows left after holding out the validation rows; "
                             "lower validation_fraction")
        return split

    def _fit_feature_map(self, X, Y, split, p) -> tuple[dict, int]:
        """The embedding and ``W``, ``c`` (on the training rows): the decoder's state, passes made."""
        dtype = p["dtype"]
        kind, emb = self._resolve_embedding(X, Y, p)
        self.embedding_kind_ = kind
        if kind == "label":
            self.R_ = emb

            def solve():
                res = ridge_lstsq(X, x_q(Y, emb), p["alpha"], center=True, weights=split.weights(dtype))
                return (_read_only(res.coef.astype(dtype)), _read_only(np.asarray(res.intercept, dtype=dtype)),
                        res.n_passes, "a fit of the same rows and embedding")

            # fits of one setting under other kernels, or an ensemble's members on one embedding: solved once
            (W, intercept, n_passes, origin), shared = computed_once(self._ridge_map_key(X, Y, emb, p, split), solve)
            if shared:
                logger.info("the least squares onto the embedding taken from %s", origin)
            return {"W": W, "intercept": intercept}, self._embedding_passes + n_passes
        V, mean = emb
        self.R_ = None
        intercept = -(mean @ V) if mean is not None else np.zeros(V.shape[1])
        return {"W": V, "intercept": intercept.astype(dtype)}, self._embedding_passes

    def _fit_random_features(self, X, split, state, p, rng_feat, rng_bw) -> None:
        """Frequencies, phases and the median-heuristic bandwidth of the kernel's random features into
        ``state`` (all ``None`` for ``kernel='none'``)."""
        if p["kernel"] == "none":
            state.update(omega=None, phase=None, bandwidth=None)
            return
        omega, phase = K.sample_frequencies(rng_feat, state["W"].shape[1], p["n_random_features"], p["kernel"],
                                            p["dtype"])
        sample = self._bandwidth_sample(X, split, state, p["bandwidth_sample"], rng_bw)
        bandwidth = p["bandwidth_scale"] * K.median_distance(sample, p["kernel"], rng=rng_bw)
        state.update(omega=omega, phase=phase, bandwidth=bandwidth)
        logger.info("random features: %s kernel, m=%d, bandwidth %.4g", p["kernel"], omega.shape[1], bandwidth)

    def _decoder_data(self, X, Y, split, state, p, t_start) -> _graph.DecoderData:
        """One pass: ``F^T F`` and ``F^T Y`` of the training rows, the held-out rows' features, the task (on the
        linear map, taken where the same were made already: :meth:`_decoder_data_key`); and the passes made."""
        def compute():
            out = dask.compute(_graph.normal_equations(X, Y, split, state))[0]
            held = out["held"]
            Fh = Yh = None
            if held:
                Xh = (sp.vstack([h[0] for h in held]).tocsr() if sp.issparse(held[0][0])
                      else np.vstack([h[0] for h in held]))
                Yh = sp.vstack([sp.csr_matrix(h[1]) for h in held]).tocsr()
                Fh = K.decoder_features(Xh, state["W"], state["intercept"], state["omega"], state["phase"],
                                        state["bandwidth"] or 1.0)
            task = "multiclass" if out["counts"] == (1, 1) else "multilabel"
            return out["G"], out["FtY"], Fh, Yh, task, 1, "a fit of the same rows and map"

        linear = state["omega"] is None
        key = self._decoder_data_key(X, Y, split, state["W"], state["intercept"], p) if linear else None
        (G, FtY, Fh, Yh, task, passes, origin), shared = computed_once(key, compute)
        if shared:
            logger.info("the decoder's normal equations taken from %s", origin)
        task = task if self.task == "auto" else self.task
        loss_fn = K.softmax_loss if task == "multiclass" else K.logistic_loss
        return _graph.DecoderData(X=X, Y=Y, split=split, state=state, G=G, FtY=FtY, n_train=split.n_train(),
                                  task=task, loss_fn=loss_fn, Fh=Fh, Yh=Yh, t_start=t_start), passes

    def _warm_start(self, d: _graph.DecoderData, p, *, loss: bool = True) -> tuple[np.ndarray, tuple]:
        """The ridge decoder (rescaled on the held-out rows) and the Cholesky factor of ``F^T F / n + lam I`` (whose
        inverse is SGD's preconditioner).
        ``loss=False``: the decoder not rescaled and its held-out P@1 alone (``val_loss`` nan), for a screen that
        ranks by P@k: a positive scale and an offset common to every label keep each row's order of the labels."""
        m1 = d.G.shape[0]
        H = d.G / d.n_train
        scale = float(np.mean(np.diag(H)[:-1])) or 1.0
        self.lam_ = p["decoder_alpha"] * scale
        H[np.arange(m1 - 1), np.arange(m1 - 1)] += self.lam_
        try:
            chol = scipy.linalg.cho_factor(H, lower=True)
        except np.linalg.LinAlgError as exc:
            raise ValueError(f"the decoder's normal equations are singular; increase decoder_alpha "
                             f"(now {p['decoder_alpha']})") from exc
        dtype = p["dtype"]
        Q = scipy.linalg.cho_solve(chol, d.FtY.astype(np.float64) / d.n_train).astype(dtype)
        if loss:
            Q = self._rescale(Q, d.Fh, d.Yh, d.loss_fn, d.task)
        val = self._evaluate(d.Fh, d.Yh, Q, d.loss_fn if loss else None)
        d.history.append({"epoch": 0, "learning_rate": None, "train_loss": None, **val,
                          "seconds": time.perf_counter() - d.t_start})
        if loss:
            logger.info("epoch 0 (warm start): held-out loss %.5g, P@1 %.4f", val["val_loss"], val["val_p@1"])
        else:
            logger.info("epoch 0 (warm start): held-out P@1 %.4f", val["val_p@1"])
        return Q, chol

    def _bandwidth_sample(self, X, split, state, size, rng) -> np.ndarray:
        """``X W + c`` for up to ``size`` training rows drawn from up to :data:`BANDWIDTH_BLOCKS` random row blocks."""
        n_blocks = X.numblocks[0]
        chosen = np.sort(rng.choice(n_blocks, size=min(BANDWIDTH_BLOCKS, n_blocks), replace=False))
        parts = dask.compute(*[X.blocks[int(b)] for b in chosen])
        Z = []
        for b, Xb in zip(chosen, parts):
            Zb = K._dense(Xb @ state["W"]) + state["intercept"]
            Z.append(Zb[~split.mask(int(b))])
        Z = np.concatenate(Z)
        if Z.shape[0] > size:
            Z = Z[rng.choice(Z.shape[0], size, replace=False)]
        return Z

    @staticmethod
    def _scores(F: np.ndarray, Q: np.ndarray, rows: int = 4096):
        for a in range(0, F.shape[0], rows):
            yield a, F[a:a + rows] @ Q

    def _evaluate(self, Fh, Yh, Q, loss_fn) -> dict:
        """Mean held-out loss per row and P@1 of the decoder ``Q`` (``nan`` without held-out rows; the loss ``nan``
        without a ``loss_fn``)."""
        if Fh is None:
            return {"val_loss": math.nan, "val_p@1": math.nan}
        loss, hits = 0.0, 0
        rows = max(1, K.SCORE_BUDGET // Q.shape[1])
        for a, S in self._scores(Fh, Q, rows):
            Yb = Yh[a:a + S.shape[0]]
            top = S.argmax(axis=1)
            hits += int(np.asarray(Yb[np.arange(S.shape[0]), top]).ravel().astype(bool).sum())
            loss += loss_fn(S, Yb, gradient=False)[0] if loss_fn is not None else math.nan
        return {"val_loss": loss / Fh.shape[0], "val_p@1": hits / Fh.shape[0]}

    def _rescale(self, Q, Fh, Yh, loss_fn, task):
        """Scale the ridge decoder (and, multilabel, shift its bias) to minimise the held-out log loss.

        Ridge scores of one-hot targets are near-probabilities, far too flat as logits; a scalar
        ``c`` (and for independent logistic losses an offset ``o``) fitted on (a sample of) the held-out
        rows maps them to the log-loss scale: ``Q <- c Q``, ``bias <- c bias + o``.
        """
        if Fh is None:
            return Q
        sub = slice(0, min(Fh.shape[0], RESCALE_ROWS, max(1, RESCALE_ENTRIES // Q.shape[1])))
        S0 = Fh[sub] @ Q
        Ys = Yh[sub]
        offsets = (0.0,) if task == "multiclass" else RESCALE_OFFSETS
        c, o = rescale_grid_min(lambda c, o: loss_fn(c * S0 + o, Ys, gradient=False)[0], RESCALE_FACTORS, offsets)
        logger.info("warm start rescaled by %g, offset %g", c, o)
        Q = Q * Q.dtype.type(c)
        Q[-1] += Q.dtype.type(o)
        return Q

    @staticmethod
    def _minibatches(d: _graph.DecoderData, order, batch_size, rng, out, stop, kept: dict | None = None):
        """Producer: put ``(F_mb, Y_mb)`` of the training rows of the blocks in ``order`` into ``out``.

        Runs in a background thread: the next block is read (by Dask) and the next minibatch's
        features are computed while the caller updates the decoder with the current one. ``kept`` (a dict, by
        block): the features and labels of a block's training rows, made at its first epoch and taken by the next
        ones (the same minibatches, not read nor computed again).
        """
        st = d.state

        def features(X):
            return K.decoder_features(X, st["W"], st["intercept"], st["omega"], st["phase"], st["bandwidth"] or 1.0)

        try:
            for b in order:
                if kept is not None and int(b) in kept:
                    F, Yt = kept[int(b)]
                else:
                    Xb, Yb = dask.compute(d.X.blocks[int(b)], d.Y.blocks[int(b)])
                    rows = np.flatnonzero(~d.split.mask(int(b)))
                    Xt, Yt = Xb[rows], sp.csr_matrix(Yb)[rows]
                    F = None
                    if kept is not None:
                        F = kept[int(b)] = (features(Xt), Yt)
                        F = F[0]
                # positions among the block's training rows, in a random order; each minibatch's in row order
                order_rows = np.arange(Yt.shape[0])
                rng.shuffle(order_rows)
                for a in range(0, order_rows.size, batch_size):
                    idx = np.sort(order_rows[a:a + batch_size])
                    if not _put(out, (features(Xt[idx]) if F is None else F[idx], Yt[idx]), stop):
                        return  # the consumer has stopped
            _put(out, None, stop)
        except BaseException as exc:  # hand the error to the consumer
            _put(out, exc, stop)

    def _sgd_chains(self, d: _graph.DecoderData, p) -> int:
        """0 when the epochs run in this process, else the chains of :func:`._graph.sgd_epoch` (``sgd_chains``)."""
        n_blocks = d.X.numblocks[0]
        if d.n_train * d.Y.shape[1] < SGD_CLUSTER_ENTRIES and p["sgd_chains"] in ("auto", 1):
            return 0
        if p["sgd_chains"] == "auto":
            return max(1, min(parallelism(), n_blocks // SGD_CHAIN_BLOCKS))
        return min(p["sgd_chains"], n_blocks)

    def _epoch_here(self, d: _graph.DecoderData, Q, V, P, p, bs, order, seed, lr,
                    kept: dict | None = None) -> tuple[float, int]:
        """One epoch in this process, ``Q`` and ``V`` updated in place: the summed loss and the rows (``kept``: the
        blocks' features between epochs, :meth:`_minibatches`)."""
        batches, stop = queue.Queue(maxsize=2), threading.Event()
        producer = threading.Thread(target=self._minibatches, daemon=True,
                                    args=(d, order, bs, np.random.default_rng(seed), batches, stop, kept))
        producer.start()
        total_loss, total_rows = 0.0, 0
        try:
            while (item := batches.get()) is not None:
                if isinstance(item, BaseException):
                    raise item
                Fm, Ym = item
                total_loss += K.sgd_step(Q, V, P, Fm, Ym, d.loss_fn, learning_rate=lr, momentum=p["momentum"],
                                         l2=p["l2"])
                total_rows += Fm.shape[0]
        finally:  # also when this loop raises: the producer stops instead of waiting on a full queue
            stop.set()
            producer.join()
        return total_loss, total_rows

    def _sgd(self, d: _graph.DecoderData, Q, P, p, rng, callback=None) -> tuple[np.ndarray, int]:
        """Preconditioned minibatch SGD with momentum from ``Q``, early-stopped on the held-out rows;
        the best decoder and the epochs (passes) made."""
        lr = p["learning_rate"]
        # a minibatch's scores are batch x n_labels: keep them under MINIBATCH_SCORES entries
        bs = max(1, min(p["batch_size"], K.MINIBATCH_SCORES // Q.shape[1]))
        chains = self._sgd_chains(d, p)
        if chains:
            setup = {"seed": d.split.seed, "fraction": d.split.fraction, "state": d.state, "P": P,
                     "loss_fn": d.loss_fn, "batch_size": bs, "momentum": p["momentum"], "l2": p["l2"]}
            logger.info("SGD epochs on the cluster: %d chain(s) over %d row blocks", chains, d.X.numblocks[0])
        metric = "val_loss" if self.early_stopping == "loss" else "val_p@1"
        sign = 1.0 if metric == "val_loss" else -1.0
        best_val = sign * d.history[0][metric] if d.Fh is not None else math.inf
        best_Q = Q.copy()
        V = np.zeros_like(Q)
        bad = 0
        n_epochs = 0
        deadline = d.t_start + p["time_budget"] if p["time_budget"] is not None else math.inf
        # with a budget, an epoch is expected to cost what the warm start cost until one is timed
        longest = time.perf_counter() - d.t_start if p["time_budget"] is not None else 0.0
        # the training rows' features kept between the epochs made here, when they are few
        kept = {} if not chains and d.n_train * d.G.shape[0] * np.dtype(p["dtype"]).itemsize <= \
            EPOCH_FEATURES_BYTES else None
        for epoch in range(1, p["max_epochs"] + 1):
            if callback is not None and epoch > 1 and not callback(d.history):  # fit asked before the first
                d.history[-1]["stopped"] = "callback"
                break
            if time.perf_counter() + longest > deadline:
                d.history[-1]["stopped"] = "time_budget"
                logger.info("time budget of %g s: the decoder stops after %d epochs", p["time_budget"], n_epochs)
                break
            epoch_start = time.perf_counter()
            n_epochs += 1
            order = rng.permutation(d.X.numblocks[0])
            seed = rng.integers(2**62)
            if chains:
                seeds = np.random.default_rng(seed).integers(2**62, size=order.size)
                Q, V, total_loss, total_rows = dask.compute(_graph.sgd_epoch(
                    d.X, d.Y, setup, Q, V, order=order, chains=chains, seeds=seeds, learning_rate=lr))[0]
            else:
                total_loss, total_rows = self._epoch_here(d, Q, V, P, p, bs, order, seed, lr, kept)
            if not np.all(np.isfinite(Q)):
                logger.warning("epoch %d diverged (learning_rate %g); restarting from the best decoder with half the "
                               "step", epoch, lr)
                val = {"val_loss": math.inf, "val_p@1": 0.0}
            else:
                val = self._evaluate(d.Fh, d.Yh, Q, d.loss_fn)
            d.history.append({"epoch": epoch, "learning_rate": lr, "train_loss": total_loss / max(total_rows, 1),
                            **val, "seconds": time.perf_counter() - d.t_start})
            longest = max(longest, time.perf_counter() - epoch_start)
            logger.info("epoch %d: lr %.3g, train loss %.5g, held-out loss %.5g, P@1 %.4f (%.1f s)", epoch, lr,
                        d.history[-1]["train_loss"], val["val_loss"], val["val_p@1"], d.history[-1]["seconds"])
            if d.Fh is None:
                best_Q = Q.copy()
                continue
            score = sign * val[metric]
            if score < best_val:
                best_val, best_Q, bad = score, Q.copy(), 0
            else:
                bad += 1
                if bad >= p["n_iter_no_change"]:
                    break
                Q, lr = best_Q.copy(), lr * 0.5
                V[...] = 0
        return best_Q, n_epochs

    # -- prediction -----------------------------------------------------------------------------

    def held_out_rows(self, X, Y) -> tuple[da.Array, da.Array]:
        """The rows of ``X``, ``Y`` (the training data, in its row blocks) that the fit held out, lazily."""
        if getattr(self, "validation_seed_", None) is None:
            raise NotFittedError(f"this {type(self).__name__} was not fitted in this process: its held-out rows "
                                 "are not known")
        X, Y = self._check_xy(X, Y)
        split = self._held_out(X, self._validated(), self.validation_seed_)
        return split.rows(X, held=True), split.rows(Y, held=True)

    def _state(self) -> dict:
        return {"W": self.W_, "intercept": self.intercept_, "omega": self.omega_, "phase": self.phase_,
                "bandwidth": self.bandwidth_, "Q": self.Q_, "bias": self.bias_}

    def transform(self, X) -> da.Array:
        """Decoder features ``phi(X W + c)`` (without the bias column), lazily, chunked like ``X``.

        Returns
        -------
        dask.array.Array, shape (n_samples, m)
        """
        X = self._check_x(X)
        F = _graph.decoder_features(X, self._state())
        return F[:, :-1]

    def decision_function(self, X) -> da.Array:
        """Dense scores ``phi(X W + c) Q + bias`` of every label, lazily, chunked like ``X``.

        Large for many labels (``n_samples x n_labels``); use :meth:`predict_topk` for rankings.

        Parameters
        ----------
        X : dask.array.Array or scipy.sparse matrix, shape (n_samples, n_features)

        Returns
        -------
        dask.array.Array, shape (n_samples, n_labels)
            Logits (softmax for multiclass, independent sigmoids for multilabel), in ``dtype``.
        """
        return _graph.decision_scores(self._check_x(X), self._state())

    def predict_topk(self, X, k: int = 5) -> tuple[da.Array, da.Array]:
        """Top-``k`` labels and their scores, best first, computed per row block.

        A block's full ``n_b x n_labels`` scores are never formed: they are reduced in row
        sub-batches of at most :data:`xmldask.models._kernels.SCORE_BUDGET` entries. Ties are broken by
        the smaller label id.

        Parameters
        ----------
        X : dask.array.Array or scipy.sparse matrix, shape (n_samples, n_features)
        k : int, default 5
            ``1 <= k <= n_labels``.

        Returns
        -------
        labels : dask.array.Array of int32, shape (n_samples, k)
        scores : dask.array.Array of float32, shape (n_samples, k)
            Compute both together (``dask.compute(labels, scores)``) for one pass.
        """
        X = self._check_x(X)
        return _graph.topk(X, self._state(), self._checked_k(k))

    # -- persistence (save and load: SavedModel) ------------------------------------------------

    def _parts(self) -> tuple[dict, dict, dict]:
        """What :meth:`save` writes: the constructor parameters as JSON (an array embedding is recorded as
        ``"ndarray"``, an estimator by its class name, ``dtype`` by its name), the fitted scalars
        (``history`` among them) and one array per fitted array (``W``, ``intercept``, ``omega``, ``phase``,
        ``Q``, ``bias``, ``R``, ``idf``)."""
        params, fitted, arrays = super()._parts()
        params["dtype"] = np.dtype(self.dtype).name
        return params, fitted, arrays

    @classmethod
    def _from_parts(cls, params: dict, fitted: dict, arrays) -> EmbeddingClassifier:
        """The fitted model; its ``embedding`` parameter is the saved ``R`` (``None`` for a feature
        embedding)."""
        model = super()._from_parts({**params, "dtype": np.dtype(params.get("dtype", "float32"))}, fitted, arrays)
        model.embedding = model.R_
        return model
