"""The model families of ``xmldask train`` and their training parameters, :class:`TrainParams`.

Each family's schema lives next to its estimator (:class:`~xmldask.models.embedding_classifier.EmbeddingParams`,
:class:`~xmldask.models.centroid.CentroidParams`, :class:`~xmldask.models.leml.LEMLParams`,
:class:`~xmldask.models.leml.BinaryRelevanceParams`, :class:`~xmldask.models.gradfac.BoostingParams`,
:class:`~xmldask.models.tree_classifier.TreeClassifierParams`), on the shared block
:class:`~xmldask.params.FamilyParams`. :class:`TrainParams` joins them, keyed on ``model``: its fields are every
family's (a field's type, default and description are its family's), and a value of ``model`` takes the fields
of its family only (another family's, given, is refused), with its family's defaults. It is the one schema of
``xmldask train`` (its options are generated from it), :func:`xmldask.jobs.train`, the train stage flow, the
pipeline and the refresh flow.

Examples
--------
>>> TrainParams(n_components=32, kernel="none").n_components
32
>>> TrainParams(k=32).n_components                           # a former name, still read
32
>>> TrainParams(model="tree", tree="tree.zarr").max_epochs     # the tree classifier's default passes
200
>>> TrainParams(n_components=0)                               # doctest: +ELLIPSIS
Traceback (most recent call last):
...
pydantic_core._pydantic_core.ValidationError: 1 validation error for TrainParams
...
"""

from __future__ import annotations

import copy
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, create_model, model_validator

from ..params import FamilyParams, current_names
from .centroid import CentroidParams
from .embedding_classifier import EmbeddingParams
from .gradfac import BoostingParams
from .leml import BinaryRelevanceParams, LEMLParams
from .tree_classifier import TreeClassifierParams

__all__ = ["DEFAULTS", "FAMILY_PARAMS", "SCHEMAS", "TrainParams"]

#: the families' schemas; a field that several take is listed (type, default, description) as the first has it
FAMILY_PARAMS: tuple[type[FamilyParams], ...] = (EmbeddingParams, CentroidParams, LEMLParams, BinaryRelevanceParams,
                                                 BoostingParams, TreeClassifierParams)
#: each value of ``model`` and its schema (``auto`` is the embedding classifier's until the job chooses)
SCHEMAS: dict[str, type[FamilyParams]] = {name: schema for schema in FAMILY_PARAMS for name in schema.family_names()}

MODEL_HELP = ("auto: centroid when it scores fewer labels a row than a flat model (more than about 2,000 labels: "
              "xmldask.jobs.choose_model), else embedding, unless an option of one of them is given; embedding: the "
              "label-embedding classifier, which scores every label; centroid: label centroids in a balanced label "
              "tree, scoring the labels of a row's best clusters only (large label spaces); leml: low-rank Z = W H^T "
              "of rank k (Yu et al. 2014) on the observed label entries (missing labels); br: binary relevance on "
              "them (LEML's baseline); multiclass boosting of oblivious trees: gradfac (one tree a round, the "
              "factorised gradient), gfen (its Elastic-Net factorisation), mll (one tree per class a round), ovr "
              "(one-vs-rest); tree: the candidate-restricted classifier of a spectral label tree (--tree URL)")


class _Joined(BaseModel):
    """The validation of :class:`TrainParams`: ``model``'s family takes the fields given."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    @model_validator(mode="before")
    @classmethod
    def _resolve(cls, data):
        """The fields given that ``model``'s family does not take, refused (those at their defaults are dropped:
        the flows pass every field); the family's rules (:meth:`~xmldask.params.FamilyParams.resolve`) and its
        defaults for the fields not given. ``tree=URL`` with ``model`` auto or embedding is the tree classifier (as
        before ``model="tree"`` existed)."""
        if not isinstance(data, dict):
            return data
        data = current_names(data)
        model = data.get("model", "auto")
        if data.get("tree") and model in ("auto", "embedding"):
            model = "tree"
        schema = SCHEMAS.get(model)
        if schema is None:
            return data  # refused by the field's type, with the values it takes
        own, fields = schema.model_fields, cls.model_fields
        foreign = [name for name, value in data.items() if name in fields and name not in own
                   and value != fields[name].default]
        if foreign:
            takes = "; ".join(f"{name}: model={'|'.join(_families_of(name))}" for name in foreign)
            raise ValueError(f"{', '.join(foreign)} do(es) not apply with model={model} (it takes "
                             f"{', '.join(schema.own_fields())}; {takes})")
        given = schema.resolve({**{name: value for name, value in data.items() if name in own}, "model": model})
        # the family's defaults where they are not the joined model's (which leaves the fields not given unset)
        defaults = {name: info.default for name, info in own.items()
                    if name not in given and info.default != fields[name].default}
        if model == data.get("model", "auto"):
            given.pop("model", None)  # as given (or not)
        return {**data, **defaults, **given}


def _families_of(field: str) -> list[str]:
    """The values of ``model`` whose family takes ``field``."""
    return [name for schema in FAMILY_PARAMS if field in schema.model_fields for name in schema.family_names()]


def _joined_fields() -> dict:
    """``model``, the families' own fields, then the shared block (the order of the options); a field that families
    take with other defaults says so in its description (its default is the first family's)."""
    fields = {"model": (Literal[("auto", *SCHEMAS)], Field("auto", description=MODEL_HELP))}
    for schema in FAMILY_PARAMS:
        for name in schema.own_fields():
            if name in fields:
                continue
            info = copy.copy(schema.model_fields[name])
            others = {other.family_names()[0]: other.model_fields[name].default for other in FAMILY_PARAMS
                      if name in other.own_fields() and other.model_fields[name].default != info.default}
            if others:
                info.description += "; default " + ", ".join(f"{v} with model={m}" for m, v in others.items())
            fields[name] = (info.annotation, info)
    fields.update((name, (info.annotation, info)) for name, info in FamilyParams.model_fields.items())
    return fields


#: the training parameters of every family, keyed on ``model`` (see the module's description)
TrainParams = create_model("TrainParams", __base__=_Joined, __module__=__name__,
                           __doc__="How a model is trained from a dataset store (every path takes these names and "
                                   "defaults): the fields of ``model``'s family (:data:`SCHEMAS`).",
                           **_joined_fields())

#: the defaults (frozen): the default ``model`` parameter of every flow
DEFAULTS = TrainParams()
