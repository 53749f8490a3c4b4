"""The parameters of training, defined once: ``xmldask train``, :func:`xmldask.jobs.train`, the train stage
flow, the pipeline and the refresh flow all take :class:`TrainParams`; ``xmldask tree``,
:func:`xmldask.jobs.tree`, the tree stage flow and the pipeline's tree options take :class:`TreeParams`.

The command line's options are generated from the fields (:func:`add_arguments`, :func:`from_args`), the
Prefect flows take the model itself as a typed parameter (validated, and shown as one form in the UI),
and :func:`xmldask.jobs.train` validates its keyword arguments with it. A field's type, default and
description are written here and nowhere else.

Examples
--------
>>> TrainParams(k=32, kernel="none").k
32
>>> TrainParams(k=0)                                          # doctest: +ELLIPSIS
Traceback (most recent call last):
...
pydantic_core._pydantic_core.ValidationError: 1 validation error for TrainParams
...
"""

from __future__ import annotations

import argparse
import types
import typing
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

__all__ = ["AUTO_ESTIMATORS", "AUTO_SEARCH", "BOOSTING_MODELS", "DEFAULTS", "KERNELS", "KERNEL_ALIASES",
           "TrainParams", "TreeParams", "add_arguments", "from_args", "kernel_name", "parse_grid", "validated"]

PositiveInt = Annotated[int, Field(gt=0)]

#: the embedding classifier's feature maps, one vocabulary for the command line, the flows and the Python API:
#: ``none`` (the embedded predictions as they are) or random Fourier features of the Gaussian kernel (normal
#: frequencies) or of the Laplacian kernel (Cauchy frequencies)
KERNELS = ("none", "gaussian", "laplacian")
#: former names, still read (saved models, scripts and deployments written before): the decoder's ``identity``
#: and the command line's ``cauchy``
KERNEL_ALIASES = {"identity": "none", "cauchy": "laplacian"}
Kernel = Literal["none", "gaussian", "laplacian"]


def kernel_name(value) -> str:
    """The kernel ``value`` names (a former name mapped onto :data:`KERNELS`), or a ValueError listing them."""
    name = KERNEL_ALIASES.get(value, value) if isinstance(value, str) else value
    if name not in KERNELS:
        raise ValueError(f"kernel must be one of {', '.join(KERNELS)}, but is {value!r}")
    return name

#: what ``search="auto"`` (the default) chooses by held-out P@1 on the training rows, each parameter only
#: where it is not given, in this order: the input features, the embedding size ``k`` (400 is lowered to
#: the number of labels), the ridge ``alpha`` (grids extended past a winning end), then the decoder's
#: feature map, linear or Gaussian random features. The first three are screened by the ridge decoder on
#: the linear map (:data:`SCREEN`); the kernels are full fits (its measurements: docs/measurements.md)
AUTO_SEARCH = {"features": ("raw", "tfidf"), "k": (50, 400), "alpha": (1e-3, 0.1, 3.0), "kernel": ("none", "gaussian")}
#: how a search screens its candidates (``search_screen``): no decoder epochs (the ridge decoder alone)
#: and the linear feature map; the searched kernels and the winner get full fits. The screen's winner is a
#: model too: with ``max_epochs`` at its default and the linear map among the kernels searched, it is kept
#: when it beats the full fits on their held-out rows (the least-squares scores as the decoder)
SCREEN = {"max_epochs": 0, "kernel": "none"}
#: ``search_repeats="auto"``: held-out rows a screening decision should rest on in all. The standard error
#: of a held-out P@1 near 0.5 is sqrt(0.25 / rows): 4 points on 150 rows, 1.6 points on 1000 rows
SCREEN_ROWS = 1000
#: ``search_repeats="auto"``: at most this many splits per screened setting
MAX_SCREEN_REPEATS = 5
#: ``n_estimators="auto"`` after a search: the chosen setting is fitted this many times with other seeds (each
#: holding out its own rows) and the probabilities averaged, as Omikuji's default averages 3 trees (its
#: measurements: docs/measurements.md). Without a search (``--no-search``): 1
AUTO_ESTIMATORS = 3
#: passes of the tree classifier (``tree=``) unless ``max_epochs`` is given: its
#: :class:`~xmldask.models.tree_classifier.TreeClassifier` default (the reference code trains 200-250)
TREE_PASSES = 200
#: a spectral label tree's maximum depth and leaf label budget: the defaults of :class:`TreeParams`,
#: :class:`~xmldask.tree.SpectralLabelTree` and :func:`~xmldask.tree.growth.grow_tree` (the reference code's)
TREE_DEPTH, TREE_LEAF_LABELS = 14, 25
#: the parameters that apply with ``tree=`` and with ``model="leml"|"br"``
_SEARCH_PARAMS = {"search", "search_strategy", "search_extensions", "search_screen", "search_repeats", "time_budget"}
_TREE_PARAMS = {"model", "tree", "tree_form", "k", "max_epochs", "seed", *_SEARCH_PARAMS}
_LOW_RANK_PARAMS = {"model", "k", "loss", "lam", "n_iter", "features", "seed", *_SEARCH_PARAMS}
#: the model families of multiclass boosting, and the parameters that apply to them
BOOSTING_MODELS = ("gradfac", "gfen", "mll", "ovr")
_BOOSTING_PARAMS = {"model", "rounds", "learning_rate", "depth", "seed", *_SEARCH_PARAMS}
#: the parameters that apply with ``model="centroid"`` (the label-centroid classifier of large label spaces)
_CENTROID_PARAMS = {"model", "features", "seed", *_SEARCH_PARAMS}


def _resolve_for(cls, data: dict, what: str, applicable: set, *, searched: bool = False) -> dict:
    """``data`` without an ensemble (and, unless the family is ``searched`` by the job, without a search), after
    refusing the parameters given (not at their defaults) that do not apply."""
    fields = cls.model_fields
    ignored = sorted(name for name, value in data.items()
                     if name in fields and name not in applicable and value != fields[name].default
                     and not (name == "n_estimators" and value == 1))  # 1: what "auto" resolves to here
    if ignored or (not searched and data.get("search") not in (None, "auto")):
        raise ValueError(f"{', '.join(ignored) or 'search'} do(es) not apply with {what} (it takes "
                         f"{', '.join(sorted(applicable - _SEARCH_PARAMS))})")
    return {**data, "n_estimators": 1} if searched else {**data, "search": None, "n_estimators": 1}


class TrainParams(BaseModel):
    """How a model is trained from a dataset store (every path takes these names and defaults)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    embedding: Literal["rembrandt", "cs", "plst", "pca"] = Field(
        "rembrandt", description="label embedding (rembrandt, cs, plst) or feature embedding (pca)")
    k: PositiveInt = Field(50, description="embedding dimension; at most the number of labels (a larger k is "
                                           "lowered to it, with a message)")
    kernel: Kernel = Field(
        "gaussian", description="random Fourier features of the embedded predictions: none (linear), gaussian or "
                                "laplacian (cauchy, its former name, is read too)")
    features: Literal["raw", "l2", "tfidf"] = Field(
        "raw", description="input rows as they are, scaled to unit L2 norm, or tf-idf weighted then scaled (idf of "
                           "the training rows, kept in the model)")
    alpha: Annotated[float, Field(ge=0)] = Field(1e-3, description="ridge of the regression onto the embedding "
                                                                   "(relative to the mean squared feature norm)")
    n_random_features: PositiveInt = Field(2000, description="random features of the kernel")
    max_epochs: Annotated[int, Field(ge=0)] = Field(10, description="decoder epochs at most (early-stopped on "
                                                                     "held-out training rows)")
    seed: int = Field(0, ge=0, description="seed of every random step (same seed, same model)")
    n_estimators: PositiveInt | Literal["auto"] = Field(
        "auto", description="an ensemble of N models with different seeds, each holding out its own rows, predicting "
                            f"their mean probability; auto: {AUTO_ESTIMATORS} after a search, 1 without")
    search: dict[str, list[int | float | str]] | Literal["auto"] | None = Field(
        "auto", description="parameters chosen by held-out P@1 on the training rows: a parameter and the values to "
                            "try, e.g. --search alpha=0.001,1 --search k=50,150 (in Python, {'alpha': [0.001, 1], "
                            "'k': [50, 150]}); auto: the input features, k, alpha and the kernel, each unless it is "
                            "given; none (--no-search): one fit")
    search_strategy: Literal["coordinate", "grid"] = Field(
        "coordinate", description="coordinate: one parameter at a time, in the order given; grid: every combination")
    search_screen: bool = Field(
        True, description="screen a search's candidates by the ridge decoder alone on the linear feature map "
                          "(no decoder epochs); the searched kernels and the winner get full fits")
    search_repeats: PositiveInt | Literal["auto"] = Field(
        "auto", description="fits of each screened setting, each on another random held-out split, scored by "
                            "their mean; auto: enough for about 1000 held-out rows in all (at most 5)")
    search_extensions: Annotated[int, Field(ge=0)] = Field(
        2, description="coordinate search: at most N geometric steps past a numeric grid's winning end (0: the "
                       "listed values only)")
    time_budget: Annotated[float, Field(gt=0)] | None = Field(
        None, description="seconds the training may take: the search stops when its next fit would not end in "
                          "time, the ensemble keeps the members that fit, and the best model so far is saved "
                          "(a budget shorter than one fit is refused with that fit's time); none: no limit")
    model: Literal["auto", "embedding", "centroid", "leml", "br", "gradfac", "gfen", "mll", "ovr"] = Field(
        "auto", description="auto: centroid when it scores fewer labels a row than a flat model (more than about "
                            "2,000 labels: xmldask.jobs.choose_model), else embedding, unless an option of one of "
                            "them is given; embedding: the label-embedding classifier, which scores every label; "
                            "centroid: label centroids in a balanced label tree, scoring the labels of a row's best "
                            "clusters only (large label spaces); leml: low-rank Z = W H^T of rank k "
                                 "(Yu et al. 2014) on the observed label entries (missing labels); br: binary "
                                 "relevance on them (LEML's baseline); multiclass boosting of oblivious trees: "
                                 "gradfac (one tree a round, the factorised gradient), gfen (its Elastic-Net "
                                 "factorisation), mll (one tree per class a round), ovr (one-vs-rest)")
    loss: Literal["squared", "logistic", "sqhinge"] = Field("squared", description="leml and br: the loss")
    lam: Annotated[float, Field(gt=0)] = Field(0.1, description="leml and br: the regulariser lam of eq. (4); "
                                                                 "chosen on held-out rows unless given (search auto)")
    n_iter: PositiveInt = Field(5, description="leml: alternations of the H- and W-steps")
    rounds: PositiveInt = Field(1000, description="boosting: rounds at most (early-stopped on held-out training "
                                                  "rows); a round grows 1 tree (gradfac, gfen) or one per class")
    learning_rate: Annotated[float, Field(gt=0)] = Field(0.3, description="boosting: shrinkage of every tree")
    depth: Annotated[int, Field(ge=1, le=16)] = Field(6, description="boosting: depth of the oblivious trees")
    tree: str | None = Field(
        None, description="a spectral label tree store (xmldask tree): train its candidate-restricted classifier "
                          f"instead (rank k, max_epochs passes at most, default {TREE_PASSES}, early-stopped on "
                          "held-out training rows; seed)")
    tree_form: Literal["low_rank", "per_label"] = Field(
        "low_rank", description="with tree: the classifier's form, low_rank (rank-k U shared by the leaves, V and b "
                                "per leaf: the paper's ALOI form) or per_label (a weight vector per label shared by "
                                "the leaves, a bias per leaf and candidate: its text form)")

    @model_validator(mode="before")
    @classmethod
    def _resolve_defaults(cls, data):
        """``search="auto"`` (the default) becomes the :data:`AUTO_SEARCH` of the parameters not given; with
        ``tree`` no search, :data:`TREE_PASSES` passes unless given, and the parameters of the embedding
        classifier refused (resolved here once, so a dumped and reloaded model is the same)."""
        if not isinstance(data, dict):
            return data
        if isinstance(data.get("kernel"), str):
            data = {**data, "kernel": KERNEL_ALIASES.get(data["kernel"], data["kernel"])}
        model = data.get("model", "auto")
        if model == "centroid":
            return _resolve_for(cls, data, "model=centroid", _CENTROID_PARAMS)
        if model in BOOSTING_MODELS:
            return _resolve_for(cls, data, f"model={model}", _BOOSTING_PARAMS, searched=True)
        only_boosting = sorted(name for name in ("rounds", "learning_rate", "depth")
                               if name in data and data[name] != cls.model_fields[name].default)
        if only_boosting:
            raise ValueError(f"{', '.join(only_boosting)} apply only with model={'|'.join(BOOSTING_MODELS)}")
        if model not in ("embedding", "auto"):
            return _resolve_for(cls, data, f"model={model}", _LOW_RANK_PARAMS, searched=True)
        if data.get("tree"):
            return _resolve_for(cls, {"max_epochs": TREE_PASSES, **data}, "tree=", _TREE_PARAMS)
        if data.get("tree_form", "low_rank") != "low_rank":
            raise ValueError("tree_form applies only with tree=")
        only_low_rank = sorted(name for name in ("loss", "lam", "n_iter")
                               if name in data and data[name] != cls.model_fields[name].default)
        if only_low_rank:
            raise ValueError(f"{', '.join(only_low_rank)} apply only with model=leml or model=br")
        if data.get("search", "auto") == "auto":
            data = {**data, "search": {name: list(values) for name, values in AUTO_SEARCH.items()
                                       if name not in data} or None}
        if data.get("n_estimators", "auto") == "auto":
            data = {**data, "n_estimators": AUTO_ESTIMATORS if data["search"] else 1}
        return data


def parse_grid(items: list[str], aliases: dict[str, str] | None = None) -> dict[str, list]:
    """``["alpha=0.001,0.1", "kernel=none,gaussian"]`` -> ``{"alpha": [0.001, 0.1], "kernel": [...]}``.

    Values are read as int, else float, else kept as strings; ``aliases`` renames parameters (e.g.
    ``{"k": "n_components"}``).
    """
    def value(text: str):
        for kind in (int, float):
            try:
                return kind(text)
            except ValueError:
                pass
        return text

    grid = {}
    for item in items:
        name, sep, values = item.partition("=")
        name = name.strip()
        if not sep or not name or not values.strip():
            raise ValueError(f"a search item must look like NAME=V1,V2,... but is {item!r}")
        name = (aliases or {}).get(name, name)
        if name in grid:
            raise ValueError(f"parameter {name!r} is given twice in the search")
        grid[name] = [value(v.strip()) for v in values.split(",") if v.strip()]
    return grid


#: the defaults (frozen): the default ``model`` parameter of every flow
DEFAULTS = TrainParams()


class TreeParams(BaseModel):
    """How a spectral label tree is grown (every path takes these names and defaults)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    depth: PositiveInt = Field(TREE_DEPTH, description="maximum depth (the reference code's 14; the paper's 12)")
    leaf_labels: PositiveInt = Field(
        TREE_LEAF_LABELS, description="a leaf's label budget S: the node stops splitting when its labels with mass fit "
                                      "it, and offers at most S candidates")
    routing: Literal["fractional", "deterministic"] = Field(
        "fractional", description="routing of the training rows while growing: fractional (each row down both "
                                  "sides, weighted by the erf of its margin) or deterministic (the paper's ablation)")
    unseen_labels: Literal["error", "ignore"] = Field(
        "ignore", description="labels with no training example: grow the tree without them (counted; no leaf "
                              "offers them, as no model predicts them), or refuse the data")
    seed: int = Field(0, ge=0, description="seed of every random step (same seed, same tree)")


# --------------------------------------------------------------------------------------------------
# command-line options generated from the fields


def _option(name: str) -> str:
    return "--" + name.replace("_", "-")


def _dest(prefix: str, name: str) -> str:
    return (prefix + name).replace("-", "_")


def add_arguments(parser: argparse.ArgumentParser, model: type[BaseModel] = TrainParams, *,
                  title: str | None = "training parameters", prefix: str = "", exclude: tuple[str, ...] = ()) -> None:
    """Add one ``--PREFIXname`` option per field of ``model`` but ``exclude`` (type, choices, default and help
    from the field), in a new argument group named ``title`` (``None``: to ``parser`` itself, e.g. a group).

    A ``dict`` field (``search``) is a repeatable ``NAME=V1,V2,...`` option. Every option defaults to
    ``None`` ("not given"), so :func:`from_args` keeps the model's own defaults.
    """
    group = parser.add_argument_group(title) if title else parser
    for name, field in model.model_fields.items():
        if name in exclude:
            continue
        annotation = field.annotation
        words = ()
        if typing.get_origin(annotation) in (typing.Union, types.UnionType):  # X | None, X | Literal[...]
            options = [a for a in typing.get_args(annotation) if a is not type(None)]
            words = tuple(w for a in options if typing.get_origin(a) is Literal for w in typing.get_args(a))
            annotation = next(a for a in options if typing.get_origin(a) is not Literal)
            if typing.get_origin(annotation) is Annotated and not words:  # X | None: the constraint is pydantic's
                annotation = typing.get_args(annotation)[0]
        help_text = f"{field.description} (default {field.default})" if field.default is not None else \
            field.description
        kwargs = {"default": None, "help": help_text}
        if typing.get_origin(annotation) is Literal:
            kwargs["choices"] = list(typing.get_args(annotation))
            if annotation is Kernel:  # a former name is read as the kernel it names
                kwargs.update(type=lambda text: KERNEL_ALIASES.get(text, text), metavar="|".join(KERNELS))
        elif annotation is bool:
            kwargs.update(action=argparse.BooleanOptionalAction)
        elif name == "search":
            kwargs.update(action="append", metavar="NAME=V1,V2,...")
            group.add_argument(f"--no-{prefix}search", dest=_dest(prefix, name), action="store_const", const=[],
                               help="one fit with the given parameters (no held-out search)")
        elif words:  # a number or one of some words (e.g. auto)
            kwargs.update(type=_number_or(annotation, words), metavar="N|" + "|".join(words))
        else:
            kwargs.update(type=annotation, metavar={float: "X", str: "URL"}.get(annotation, "N"))
        group.add_argument(_option(prefix + name), dest=_dest(prefix, name), **kwargs)


def _number_or(kind, words: tuple[str, ...]):
    """An argparse type: one of ``words``, else ``kind(text)``."""
    if typing.get_origin(kind) is Annotated:
        kind = typing.get_args(kind)[0]

    def convert(text: str):
        return text if text in words else kind(text)
    convert.__name__ = f"{kind.__name__} or {'/'.join(words)}"
    return convert


def from_args(args: argparse.Namespace, model: type[BaseModel] = TrainParams, *, prefix: str = "") -> dict:
    """The fields given on the command line (options added by :func:`add_arguments` with the same
    ``prefix``; ``search`` parsed into a dict), validated by ``model``."""
    given = {name: getattr(args, _dest(prefix, name)) for name in model.model_fields
             if getattr(args, _dest(prefix, name), None) is not None}
    if "search" in given:
        given["search"] = parse_grid(given["search"], aliases={"n-random-features": "n_random_features",
                                                                "max-epochs": "max_epochs"}) or None
        _check_search_values(model, given["search"] or {})
    validated(model, given)
    return given


def _check_search_values(model: type[BaseModel], grid: dict) -> None:
    """Each searched value of a training parameter has the parameter's type (``--search k=abc`` named at once,
    with the option, before any work)."""
    from pydantic import TypeAdapter

    for name, values in grid.items():
        field = model.model_fields.get(name)
        if field is None or name == "search":
            continue  # an estimator's own parameter: checked by the job against the estimator
        adapter = TypeAdapter(field.annotation)
        for value in values:
            try:
                adapter.validate_python(value)
            except ValidationError as exc:
                raise ValueError(f"--search {name}={','.join(map(str, values))}: {value!r} is not a value of "
                                 f"{name} ({exc.errors()[0]['msg'].lower()}); e.g. --search "
                                 f"{name}={field.default if field.default is not None else '...'}") from None


def validated(model: type[BaseModel], given: dict) -> BaseModel:
    """``model(**given)``, with a :class:`ValueError` that names each bad parameter, its value and the rule."""
    try:
        return model(**given)
    except ValidationError as exc:
        problems = "; ".join(f"{'.'.join(str(p) for p in err['loc'])} = {err.get('input')!r}: {err['msg']}"
                             for err in exc.errors())
        what = "training" if model is TrainParams else model.__name__.removesuffix("Params").lower()
        raise ValueError(f"invalid {what} parameters: {problems}") from None
