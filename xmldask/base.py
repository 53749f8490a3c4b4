"""What every estimator of xmldask shares: scikit-learn style parameters, ``predict``, ``NotFittedError``.

The lowest layer of the estimators: :mod:`xmldask.embedding`, :mod:`xmldask.tree` and :mod:`xmldask.models`
build on it.
"""

from __future__ import annotations

import inspect
import math
import numbers

import dask.array as da
import numpy as np
import scipy.sparse as sp


class NotFittedError(ValueError, AttributeError):
    """The estimator is used before ``fit``."""


class BudgetError(ValueError):
    """A time budget shorter than the one fit (or round) that a model cannot do without."""


def as_rows(A, name: str, block_rows: int | None = None) -> da.Array:
    """A Dask array of row blocks (an in-memory matrix is split into blocks of ``block_rows``; a sparse one
    first put in canonical form, on a copy when it is not)."""
    if isinstance(A, da.Array):
        if A.ndim != 2:
            raise ValueError(f"{name} must be 2-D, but has shape {A.shape}")
        if any(math.isnan(c) for c in A.chunks[0]):
            raise ValueError(f"{name} has unknown row-chunk sizes; fix: {name} = {name}.compute_chunk_sizes()")
        if len(A.chunks[1]) != 1:
            raise ValueError(f"{name} must be chunked by rows only (one column chunk), but has {len(A.chunks[1])} "
                             f"column chunks; fix: {name} = {name}.rechunk({{1: -1}})")
        return A
    if sp.issparse(A):
        A = sp.csr_matrix(A)
        if not A.has_canonical_format:  # sorted unique column ids, on a copy: the user's matrix is not changed
            A = A.copy()
            A.sum_duplicates()
    elif np.ndim(A) == 2:
        A = np.asarray(A)
    else:
        raise TypeError(f"{name} must be a 2-D Dask array of row blocks (open_dataset(url).{name}) or an in-memory "
                        f"matrix, but is a {type(A).__name__}")
    rows = block_rows or max(1, min(A.shape[0], 8192))
    return da.from_array(A, chunks=(rows, -1), asarray=False, fancy=False)


def check_int(value, name: str, minimum: int, maximum: int | None = None) -> int:
    """``value`` as an int in ``[minimum, maximum]``, or a ValueError naming the parameter ``name``."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < minimum or \
            (maximum is not None and value > maximum):
        bound = f"of at least {minimum}" + (f" and at most {maximum}" if maximum is not None else "")
        raise ValueError(f"{name} must be an integer {bound}, but is {value!r}")
    return int(value)


def check_float(value, name: str, *, low: float = 0.0, high: float = math.inf, low_open: bool = False) -> float:
    """``value`` as a finite float in ``[low, high]`` (``(low, high]`` when ``low_open``), or a ValueError."""
    ok = isinstance(value, numbers.Real) and not isinstance(value, bool) and math.isfinite(value)
    ok = ok and (value > low if low_open else value >= low) and value <= high
    if not ok:
        bound = f"{'>' if low_open else '>='} {low}" + ("" if high == math.inf else f" and <= {high}")
        raise ValueError(f"{name} must be a finite number {bound}, but is {value!r}")
    return float(value)


def seed_of(random_state) -> int:
    """An integer seed from ``None``, an int, a ``SeedSequence`` or a ``Generator`` (normalised once)."""
    if random_state is None:
        return int(np.random.SeedSequence().generate_state(1, np.uint64)[0] >> 1)
    if isinstance(random_state, numbers.Integral) and not isinstance(random_state, bool):
        return int(random_state)
    if isinstance(random_state, np.random.Generator):
        return int(random_state.integers(0, 2**62))
    if isinstance(random_state, np.random.SeedSequence):
        return int(random_state.generate_state(1, np.uint64)[0] >> 1)
    raise ValueError(f"random_state must be None, an int, a SeedSequence or a numpy Generator, "
                     f"but is {random_state!r}")


#: every public estimator class by its module-qualified name (``xmldask.models.leml.LEML``), as its saved stores
#: record it (filled as the classes are defined): what :func:`xmldask.models.load_model` reads
MODEL_CLASSES: dict[str, type] = {}


def qualified_name(cls: type) -> str:
    """``module.QualName`` of a class: its key in :data:`MODEL_CLASSES` and the class its stores record."""
    return f"{cls.__module__}.{cls.__qualname__}"


def registered_class(name: str) -> type | None:
    """The registered class of a store's recorded ``name``: a qualified name, or (stores written before) a bare
    class name."""
    if name in MODEL_CLASSES:
        return MODEL_CLASSES[name]
    bare = [cls for cls in MODEL_CLASSES.values() if cls.__name__ == name]
    return bare[0] if len(bare) == 1 else None
#: the model families of ``xmldask train --model NAME`` (:class:`~xmldask.models.TrainParams`'s ``model``):
#: the classes that set ``family = NAME``, trained by :func:`xmldask.jobs.train` through their
#: :meth:`ParamsMixin.from_params` and :meth:`ParamsMixin.fit_dataset`
FAMILIES: dict[str, type] = {}


def check_fully_observed(data, what: str) -> None:
    """Refuse a dataset with missing labels (an observed-entry mask) for a model that reads every entry."""
    if getattr(data, "observed", None) is not None:
        raise ValueError(f"{data.url} has missing labels (an observed-entry mask) and {what} treats every label "
                         "entry as observed (unknown ones as irrelevant); train --model leml or --model br on it, or "
                         "use the fully labelled dataset")


class ParamsMixin:
    """scikit-learn's estimator contract: the constructor only stores its parameters; ``get_params`` /
    ``set_params`` over them (``deep`` and ``name__param`` for nested estimators, so
    ``sklearn.base.clone`` works); and ``predict`` from ``predict_topk`` for a classifier with
    ``n_labels_``. Every public subclass is registered in :data:`MODEL_CLASSES` by its qualified name.

    The parameters are the keyword arguments of ``__init__``; a class may name them in ``_param_names``
    instead.
    """

    _param_names: tuple[str, ...] | None = None
    #: the name of ``--model`` that trains this class (see :data:`FAMILIES`), if any
    family: str | None = None
    #: the family's training parameters (a :class:`~xmldask.params.FamilyParams`), next to the class
    params_schema: type | None = None

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        if cls.__name__.startswith("_"):  # a private base (shared code of public classes) is no model
            return
        MODEL_CLASSES[qualified_name(cls)] = cls
        if cls.__dict__.get("family"):
            FAMILIES[cls.family] = cls

    @classmethod
    def from_params(cls, params, **extra):
        """The estimator that a family's training parameters describe (``params``: an instance of its
        :attr:`params_schema`, a :class:`~xmldask.params.FamilyParams`), with further constructor parameters
        ``extra``."""
        if cls.params_schema is None:
            raise NotImplementedError(f"{cls.__name__} is not a model family of xmldask train")
        if not isinstance(params, cls.params_schema):
            params = cls.params_schema.model_validate({name: getattr(params, name)
                                                       for name in cls.params_schema.model_fields})
        return cls(**params.estimator_params(cls._get_param_names()), **extra)

    def fit_dataset(self, data):
        """Fit on a dataset store opened by :func:`xmldask.store.open_dataset` (its ``X`` and ``Y``);
        a dataset with missing labels is refused (only models that override this use the mask)."""
        check_fully_observed(data, type(self).__name__)
        return self.fit(data.X, data.Y)

    def train_summary(self) -> dict:
        """What :func:`xmldask.jobs.train` reports of the fitted model besides its parameters."""
        return {"n_passes": int(getattr(self, "n_passes_", 0)), "task": getattr(self, "task_", None)}

    @classmethod
    def _get_param_names(cls) -> tuple[str, ...]:
        """The constructor's parameters (``_param_names`` if the class names them)."""
        if cls._param_names is not None:
            return tuple(cls._param_names)
        signature = inspect.signature(cls.__init__)
        return tuple(p.name for p in signature.parameters.values()
                     if p.name != "self" and p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL))

    def get_params(self, deep: bool = True) -> dict:
        """The constructor parameters; with ``deep``, also ``name__param`` of each nested estimator."""
        out = {}
        for name in self._get_param_names():
            value = getattr(self, name)
            out[name] = value
            if deep and hasattr(value, "get_params") and not isinstance(value, type):
                out.update((f"{name}__{key}", inner) for key, inner in value.get_params(deep=True).items())
        return out

    def set_params(self, **params):
        """Set constructor parameters, ``name__param`` of nested estimators too (unknown names are an
        error); returns ``self``."""
        names = self._get_param_names()
        nested: dict[str, dict] = {}
        for key, value in params.items():
            name, _, inner = key.partition("__")
            if name not in names:
                raise ValueError(f"unknown parameter {name!r}; parameters are {', '.join(names)}")
            if inner:
                nested.setdefault(name, {})[inner] = value
            else:
                setattr(self, name, value)
        for name, inner in nested.items():
            getattr(self, name).set_params(**inner)
        return self

    def _checked_k(self, k) -> int:
        if isinstance(k, bool) or not isinstance(k, numbers.Integral) or not 1 <= k <= self.n_labels_:
            raise ValueError(f"k must be an integer between 1 and n_labels = {self.n_labels_}, but is {k!r}")
        return int(k)

    def predict(self, X):
        """The best label of every row (int32), lazily: ``predict_topk(X, k=1)``'s labels.

        Returns
        -------
        dask.array.Array of int32, shape (n_samples,)
        """
        labels, _ = self.predict_topk(X, k=1)
        return labels[:, 0]

    def _rows(self, X) -> da.Array:
        """``X`` as row blocks, once the model is fitted (``_check_fitted``) and ``X`` has its features."""
        self._check_fitted()
        X = as_rows(X, "X")
        if X.shape[1] != self.n_features_in_:
            raise ValueError(f"X has {X.shape[1]} features, but this model was fitted on {self.n_features_in_}")
        return X


def kept_epoch(estimator) -> dict:
    """The ``history_`` entry of a fitted estimator's kept decoder (the epoch its ``early_stopping`` chose)."""
    history = getattr(estimator, "history_", None)
    if not history or history[0].get("val_loss") is None or math.isnan(history[0]["val_loss"]):
        raise ValueError("the estimator has no held-out figures; fit it with validation_fraction > 0")
    return kept_entry(history, getattr(estimator, "early_stopping", "loss"))


def kept_entry(history: list[dict], early_stopping: str = "loss") -> dict:
    """The entry of ``history`` (held-out figures per epoch) whose decoder a fit early-stopped on ``early_stopping``
    (``"loss"`` or ``"p@1"``) keeps: the first of the best."""
    if early_stopping == "p@1":
        return max(history, key=lambda h: h["val_p@1"])
    return min(history, key=lambda h: h["val_loss"])
