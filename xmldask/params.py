"""The parameters of training, defined once: the shared block of every model family (:class:`FamilyParams`;
each family's schema, next to its estimator, adds its own fields) and the spectral label tree's
(:class:`TreeParams`: ``xmldask tree``, :func:`xmldask.jobs.tree`, the tree stage flow and the pipeline's tree
options). :class:`xmldask.models.TrainParams` joins the families' schemas, keyed on ``model``: ``xmldask
train``, :func:`xmldask.jobs.train`, the train stage flow, the pipeline and the refresh flow all take it.

The command line's options are generated from the fields (:func:`add_arguments`, :func:`from_args`), the
Prefect flows take the model itself as a typed parameter (validated, and shown as one form in the UI),
and :func:`xmldask.jobs.train` validates its keyword arguments with it. A field's type, default and
description are written once, in its schema.

Examples
--------
>>> TreeParams(depth=8).leaf_labels
25
>>> TreeParams(depth=0)                                       # doctest: +ELLIPSIS
Traceback (most recent call last):
...
pydantic_core._pydantic_core.ValidationError: 1 validation error for TreeParams
...
"""

from __future__ import annotations

import argparse
import types
import typing
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

__all__ = ["AUTO_ESTIMATORS", "AUTO_SEARCH", "FEATURES_HELP", "KERNELS", "KERNEL_ALIASES", "FamilyParams",
           "TOP_K", "TreeParams", "add_arguments", "from_args", "kernel_name", "parse_grid", "validated"]

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
AUTO_SEARCH = {"features": ("raw", "tfidf"), "n_components": (50, 400), "alpha": (1e-3, 0.1, 3.0),
               "kernel": ("none", "gaussian")}
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
#: ``search_repeats="auto"``: a screened fit holds out up to this share of the rows (more than the model's own
#: ``validation_fraction`` on small data), so that :data:`SCREEN_ROWS` rows take one split, not several
MAX_SCREEN_FRACTION = 0.25
#: ``n_estimators="auto"`` after a search: the chosen setting is fitted this many times with other seeds (each
#: holding out its own rows) and the probabilities averaged, as Omikuji's default averages 3 trees (its
#: measurements: docs/measurements.md). Without a search (``--no-search``): 1
AUTO_ESTIMATORS = 3
#: labels a row that prediction keeps by default: the report's P@1 .. P@10 (``xmldask predict``, the flows)
TOP_K = 10
#: a spectral label tree's maximum depth and leaf label budget: the defaults of :class:`TreeParams`,
#: :class:`~xmldask.tree.SpectralLabelTree` and :func:`~xmldask.tree.growth.grow_tree` (the reference code's)
TREE_DEPTH, TREE_LEAF_LABELS = 14, 25
#: the input features of the families that take ``features``
Features = Literal["raw", "l2", "tfidf"]
FEATURES_HELP = ("input rows as they are, scaled to unit L2 norm, or tf-idf weighted then scaled (idf of the training "
                 "rows, kept in the model)")


#: parameters' former names, still read (scripts, saved models' records, the refresh deployments written before):
#: scikit-learn's names now, one name per concept
FORMER_NAMES = {"k": "n_components", "seed": "random_state", "depth": "max_depth", "tree_form": "form"}


def current_names(data: dict) -> dict:
    """``data`` with its keys' former names (:data:`FORMER_NAMES`) read as today's, a ``search`` grid's too; both
    given is refused."""
    if isinstance(data.get("search"), dict):
        data = {**data, "search": current_names(data["search"])}
    if not any(name in data for name in FORMER_NAMES):
        return data
    out = {}
    for name, value in data.items():
        new = FORMER_NAMES.get(name, name)
        if new in out or (new != name and new in data):
            raise ValueError(f"{name} is the former name of {new}: give {new} once")
        out[new] = value
    return out


class FamilyParams(BaseModel):
    """The training parameters every model family takes (the shared block). A family's schema subclasses it
    next to its estimator, sets ``model`` to the family's names (a ``Literal`` with a default) and adds its own
    fields with their defaults; :class:`xmldask.models.TrainParams` joins the schemas, keyed on ``model``.

    A field sets the estimator parameter of its own name (scikit-learn's where it has one: ``n_components``,
    ``random_state``, ``max_depth``), whose constructor default is the field's (tests/test_params.py checks every
    family); a former name (:data:`FORMER_NAMES`) is read as it. The fields in :attr:`job_fields` are the job's
    (the search, the ensemble), no estimator's.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)
    #: fields the job reads, which set no estimator parameter
    job_fields: typing.ClassVar[tuple[str, ...]] = (
        "model", "search", "search_strategy", "search_screen", "search_repeats", "search_extensions", "n_estimators")
    #: whether ``search="auto"`` searches this family (by its estimator's ``auto_search``); else no search is taken
    searched: typing.ClassVar[bool] = True

    random_state: int = Field(0, ge=0, description="seed of every random step (same seed, same model)")
    search: dict[str, list[int | float | str]] | Literal["auto"] | None = Field(
        "auto", description="parameters chosen by held-out scores on the training rows: a parameter and the values "
                            "to try, e.g. --search alpha=0.001,1 --search k=50,150 (in Python, {'alpha': [0.001, 1], "
                            "'k': [50, 150]}); auto: each family's own choices (embedding: the input features, k, "
                            "alpha and the kernel; leml and br: lam, row scaling and an intercept; boosting: the "
                            "depth), each unless it is given; none (--no-search): one fit")
    search_strategy: Literal["coordinate", "grid"] = Field(
        "coordinate", description="coordinate: one parameter at a time, in the order given; grid: every combination")
    search_screen: bool = Field(
        True, description="screen a search's candidates by the ridge decoder alone on the linear feature map "
                          "(no decoder epochs); the searched kernels and the winner get full fits")
    search_repeats: PositiveInt | Literal["auto"] = Field(
        "auto", description="fits of each screened setting, each on another random held-out split, scored by "
                            "their mean; auto: one split of about 1000 held-out rows where they are at most a quarter "
                            "of the rows, else enough splits of a quarter for 1000 (at most 5)")
    search_extensions: Annotated[int, Field(ge=0)] = Field(
        2, description="coordinate search: at most N geometric steps past a numeric grid's winning end (0: the "
                       "listed values only)")
    n_estimators: PositiveInt | Literal["auto"] = Field(
        "auto", description="an ensemble of N models of the family with different seeds, predicting their mean "
                            "(probabilities of the embedding classifiers, each holding out its own rows; the scores "
                            f"the others list a row); auto: {AUTO_ESTIMATORS} with model=embedding after a search, "
                            "each added member kept only while it gains on held-out rows, else 1")
    time_budget: Annotated[float, Field(gt=0)] | None = Field(
        None, description="seconds the whole training job may take: the first model is saved as soon as it is "
                          "made, the search stops when its next fit would not end in time, the ensemble keeps the "
                          "members that fit, and the best model so far is saved; with model auto, the label-centroid "
                          "tree where the embedding classifier's first model would not be ready in time (a budget "
                          "shorter than one fit is refused with that fit's time); none: no limit")

    @model_validator(mode="before")
    @classmethod
    def _resolve(cls, data):
        return cls.resolve(current_names(data)) if isinstance(data, dict) else data

    @classmethod
    def family_names(cls) -> tuple[str, ...]:
        """The values of ``model`` that this schema describes."""
        return typing.get_args(cls.model_fields["model"].annotation)

    @classmethod
    def own_fields(cls) -> tuple[str, ...]:
        """The fields this family adds to the shared block."""
        return tuple(name for name in cls.model_fields if name not in FamilyParams.model_fields and name != "model")

    @classmethod
    def resolve(cls, data: dict) -> dict:
        """The family's rules on the parameters given (``data``, before validation): none by default, and for a
        family that is not :attr:`searched`, no search (one given is refused)."""
        if cls.searched:
            return data
        if data.get("search") not in (None, "auto"):
            raise ValueError(f"search does not apply with model={cls.family_names()[0]} (it takes "
                             f"{', '.join(cls.own_fields())})")
        return {**data, "search": None}

    def estimator_params(self, names) -> dict:
        """The parameters these fields set of an estimator whose constructor takes ``names``."""
        return {field: getattr(self, field) for field in type(self).model_fields
                if field not in self.job_fields and field in names}


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
        name = FORMER_NAMES.get(name, name)
        if name in grid:
            raise ValueError(f"parameter {name!r} is given twice in the search")
        grid[name] = [value(v.strip()) for v in values.split(",") if v.strip()]
    return grid


class TreeParams(BaseModel):
    """How a spectral label tree is grown (every path takes these names and defaults)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    max_depth: PositiveInt = Field(TREE_DEPTH, description="maximum depth (the reference code's 14; the paper's 12)")
    leaf_labels: PositiveInt = Field(
        TREE_LEAF_LABELS, description="a leaf's label budget S: the node stops splitting when its labels with mass fit "
                                      "it, and offers at most S candidates")
    routing: Literal["fractional", "deterministic"] = Field(
        "fractional", description="routing of the training rows while growing: fractional (each row down both "
                                  "sides, weighted by the erf of its margin) or deterministic (the paper's ablation)")
    unseen_labels: Literal["error", "ignore"] = Field(
        "ignore", description="labels with no training example: grow the tree without them (counted; no leaf "
                              "offers them, as no model predicts them), or refuse the data")
    random_state: int = Field(0, ge=0, description="seed of every random step (same seed, same tree)")

    @model_validator(mode="before")
    @classmethod
    def _former(cls, data):
        return current_names(data) if isinstance(data, dict) else data


# --------------------------------------------------------------------------------------------------
# command-line options generated from the fields


def _option(name: str) -> str:
    return "--" + name.replace("_", "-")


def _dest(prefix: str, name: str) -> str:
    return (prefix + name).replace("-", "_")


def add_arguments(parser: argparse.ArgumentParser, model: type[BaseModel], *,
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
        former = [_option(prefix + old) for old, new in FORMER_NAMES.items() if new == name]  # still read
        group.add_argument(_option(prefix + name), *former, dest=_dest(prefix, name), **kwargs)


def _number_or(kind, words: tuple[str, ...]):
    """An argparse type: one of ``words``, else ``kind(text)``."""
    if typing.get_origin(kind) is Annotated:
        kind = typing.get_args(kind)[0]

    def convert(text: str):
        return text if text in words else kind(text)
    convert.__name__ = f"{kind.__name__} or {'/'.join(words)}"
    return convert


def from_args(args: argparse.Namespace, model: type[BaseModel], *, prefix: str = "") -> dict:
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
        what = "training" if model.__name__ == "TrainParams" else model.__name__.removesuffix("Params").lower()
        raise ValueError(f"invalid {what} parameters: {problems}") from None
