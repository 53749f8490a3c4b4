"""The import structure of ``xmldask/`` and ``flows/``: no cycles, and no layer imports one above it.

Every import counts, function-level ones included (a lazy import is still a dependency). Layers, from
the bottom: scheduling/params/cluster/base (the estimator base) -> store -> io, linalg -> datasets,
metrics, embedding, tree -> models -> model_selection -> jobs, demo -> cli, flows and the package root (the
facade users import: ``xmldask.open_dataset``, ``xmldask.load_model``). A module may import its own package
and any layer below its own.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
LAYERS = [
    {"xmldask.scheduling", "xmldask.params", "xmldask.cluster", "xmldask.base"},
    {"xmldask.store", "xmldask.missing", "xmldask.progress"},
    {"xmldask.io", "xmldask.linalg"},
    {"xmldask.datasets", "xmldask.xmc", "xmldask.metrics", "xmldask.embedding", "xmldask.tree"},
    {"xmldask.models"},
    {"xmldask.model_selection"},
    {"xmldask.jobs", "xmldask.demo"},
    {"xmldask.cli", "flows", "xmldask"},  # the package root is the facade: what users import, any layer's
]


def _modules() -> dict[str, Path]:
    out = {}
    for package in ("xmldask", "flows"):
        for path in (REPO / package).rglob("*.py"):
            parts = path.relative_to(REPO).with_suffix("").parts
            out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def _imports(module: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The modules of ``xmldask``/``flows`` that ``module`` imports anywhere in its code."""
    found = set()
    is_package = path.name == "__init__.py"
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = module.split(".")[: len(module.split(".")) - node.level + (1 if is_package else 0)]
                base = ".".join(parts + ([node.module] if node.module else []))
            # ``from pkg import sub`` imports the submodule; ``from pkg import name`` the package
            targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base for alias in node.names]
        else:
            continue
        for target in targets:
            while target and target not in modules:
                target = target.rpartition(".")[0]
            if target and target != module:
                found.add(target)
    return found


def _layer(module: str) -> int:
    parts = module.split(".")
    for depth in range(len(parts), 0, -1):
        for rank, layer in enumerate(LAYERS):
            if ".".join(parts[:depth]) in layer:
                return rank
    raise AssertionError(f"{module} is in no layer: add its package to LAYERS in {Path(__file__).name}")


def _package(module: str) -> str:
    parts = module.split(".")
    return ".".join(parts[:2]) if parts[0] == "xmldask" and len(parts) > 1 else parts[0]


@pytest.fixture(scope="module")
def graph() -> dict[str, set[str]]:
    modules = _modules()
    return {module: _imports(module, path, modules) for module, path in modules.items()}


def test_no_import_cycles(graph):
    """Tarjan's strongly connected components of the module graph: each must be a single module."""
    index, low, stack, on_stack, cycles, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for module in sorted(graph):
        if module not in index:
            visit(module)
    assert cycles == []


def test_no_upward_imports(graph):
    upward = sorted(f"{module} (layer {_layer(module)}) imports {target} (layer {_layer(target)})"
                    for module, targets in graph.items() for target in targets
                    if _package(module) != _package(target) and _layer(target) > _layer(module))
    assert upward == []


def _private_imports(module: str, path: Path, modules: dict[str, Path]) -> list[str]:
    """``from A import _b`` and imports of a private module (``A._b``) where A is another package's."""
    found = []
    is_package = path.name == "__init__.py"
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if not isinstance(node, ast.ImportFrom):
            continue
        base = node.module or ""
        if node.level:
            parts = module.split(".")[: len(module.split(".")) - node.level + (1 if is_package else 0)]
            base = ".".join(parts + ([node.module] if node.module else []))
        for alias in node.names:
            target = f"{base}.{alias.name}"
            private = any(part.startswith("_") and not part.startswith("__") for part in target.split("."))
            owner = target if target in modules else base
            if private and _package(owner) != _package(module) and owner.split(".")[0] in ("xmldask", "flows"):
                found.append(f"{module}: from {base} import {alias.name}")
    return found


def test_no_private_imports_across_packages():
    """A package uses another's public names only (its own privates are its business)."""
    modules = _modules()
    assert [line for module, path in sorted(modules.items()) for line in _private_imports(module, path, modules)] == []


def test_the_checks_see_lazy_imports(graph):
    """A function-level import is found (cli imports the jobs inside its command functions)."""
    assert "xmldask.jobs" in graph["xmldask.cli"]


def test_one_estimator_base_with_the_scikit_learn_contract(tmp_path):
    """Every estimator takes its parameters from ``__init__``; ``get_params(deep=True)`` and ``set_params``
    reach nested estimators (what ``sklearn.base.clone`` relies on); one ``load_model`` reads any store."""
    import numpy as np

    from xmldask.base import MODEL_CLASSES, ParamsMixin
    from xmldask.embedding import Rembrandt
    from xmldask.models import EmbeddingClassifier, EnsembleClassifier, load_model

    names = {cls.__name__ for cls in MODEL_CLASSES.values()}
    assert {"EmbeddingClassifier", "EnsembleClassifier", "LEML", "BinaryRelevance", "Rembrandt"} <= names
    assert all(issubclass(cls, ParamsMixin) for cls in MODEL_CLASSES.values())
    member = EmbeddingClassifier(n_components=7, kernel="none")
    ensemble = EnsembleClassifier(member, n_estimators=2)
    deep = ensemble.get_params()
    assert deep["estimator"] is member and deep["estimator__n_components"] == 7
    assert set(ensemble.get_params(deep=False)) == {"estimator", "n_estimators", "random_state", "share_embedding",
                                                    "n_jobs", "early_stopping"}
    ensemble.set_params(estimator__n_components=9, n_estimators=3)
    assert member.n_components == 9 and ensemble.n_estimators == 3
    # clone as scikit-learn does it: the class and its shallow parameters, nested estimators cloned
    params = {k: (type(v)(**v.get_params(deep=False)) if isinstance(v, ParamsMixin) else v)
              for k, v in ensemble.get_params(deep=False).items()}
    clone = type(ensemble)(**params)
    assert clone.get_params()["estimator__n_components"] == 9 and clone.estimator is not member
    with pytest.raises(ValueError, match="unknown parameter 'bogus'"):
        member.set_params(bogus=1)
    # an embedding estimator shares the base, and load_model reads its store too
    rng = np.random.default_rng(0)
    import scipy.sparse as sp

    X = sp.random(60, 12, density=0.3, format="csr", random_state=0, dtype=np.float32)
    Y = sp.csr_matrix((rng.random((60, 5)) < 0.3).astype(np.float32))
    emb = Rembrandt(n_components=3, random_state=0)
    assert emb.get_params(deep=False)["n_components"] == 3
    url = str(tmp_path / "emb.zarr")
    import dask.array as da

    emb.fit(da.from_array(X, chunks=(25, -1), asarray=False), da.from_array(Y, chunks=(25, -1), asarray=False))
    emb.save(url)
    assert type(load_model(url)) is Rembrandt
    # one registry: the embeddings' own loader reads it too, and refuses a model of another kind
    from xmldask import embedding
    from xmldask.store import StoreError

    assert type(embedding.load_model(url)) is Rembrandt
    other = str(tmp_path / "clf.zarr")
    EmbeddingClassifier(embedding="rembrandt", n_components=2, kernel="none", max_epochs=1, random_state=0).fit(
        da.from_array(X, chunks=(25, -1), asarray=False), da.from_array(Y, chunks=(25, -1), asarray=False)).save(other)
    with pytest.raises(StoreError, match="EmbeddingClassifier' model, which is not an embedding model"):
        embedding.load_model(other)


def _estimators():
    """Every public estimator class of the registry, with a constructor that fits small data quickly."""
    import xmldask.models  # noqa: F401  (every estimator of the package, registered as its module is imported)
    from xmldask.base import MODEL_CLASSES

    small = {"EmbeddingClassifier": {"embedding": "rembrandt", "n_components": 3, "kernel": "none", "max_epochs": 1},
             "EnsembleClassifier": None, "TreeClassifier": {"n_components": 3, "max_epochs": 2},
             "SpectralLabelTree": {"max_depth": 2}, "LabelCentroidClassifier": {"leaf_labels": 3},
             "LEML": {"n_components": 3, "n_iter": 2}, "BinaryRelevance": {},
             "GradFac": {"rounds": 3}, "GradFacEN": {"rounds": 3}, "MultinomialBoosting": {"rounds": 3},
             "OneVsRestBoosting": {"rounds": 3}}
    by_name = {cls.__name__: cls for cls in MODEL_CLASSES.values()}
    return [(name, by_name[name], small[name]) for name in sorted(small)]


@pytest.mark.parametrize("name, cls, params", _estimators(), ids=lambda v: v if isinstance(v, str) else "")
def test_sklearn_clone_of_every_estimator_refits(name, cls, params):
    """scikit-learn's own clone on every estimator (fitted first): the clone has the parameters, no fitted state,
    and refits, the tree classifier too (its tree is a specification it grows, or a fitted tree it copies)."""
    import dask.array as da
    import numpy as np
    import scipy.sparse as sp
    from sklearn.base import clone

    from xmldask.models import EmbeddingClassifier

    rng = np.random.default_rng(0)
    X = sp.random(120, 10, density=0.5, format="csr", random_state=0, dtype=np.float32)
    y = rng.integers(0, 4, 120)
    Y = sp.csr_matrix((np.ones(120, np.float32), (np.arange(120), y)), shape=(120, 4))
    Xd, Yd = (da.from_array(m, chunks=(50, -1), asarray=False) for m in (X, Y))
    if params is None:  # the ensemble, of any member
        params = {"estimator": EmbeddingClassifier(embedding="rembrandt", n_components=2, kernel="none",
                                                   max_epochs=1), "n_estimators": 2}
    fitted = cls(**params).fit(Xd, Yd)
    again = clone(fitted)
    assert again.get_params(deep=False).keys() == fitted.get_params(deep=False).keys()
    again.fit(Xd, Yd)
    assert type(again) is cls and again is not fitted
    if hasattr(again, "predict_topk") and name != "SpectralLabelTree":
        labels, _ = again.predict_topk(Xd[:5], k=2)
        assert np.asarray(labels.compute() if hasattr(labels, "compute") else labels).shape == (5, 2)
    if hasattr(again, "save"):  # and xmldask.load_model, at the top of the package, opens its store
        import tempfile

        import xmldask

        with tempfile.TemporaryDirectory() as tmp:
            url = again.save(f"{tmp}/m.zarr")
            assert type(xmldask.load_model(url)) is cls


def test_the_registry_holds_the_public_classes_only():
    import xmldask.models  # noqa: F401
    from xmldask.base import FAMILIES, MODEL_CLASSES

    assert not [cls for cls in MODEL_CLASSES.values() if cls.__name__.startswith("_")]
    assert set(FAMILIES.values()) <= set(MODEL_CLASSES.values())
    # keyed by module-qualified name, each key the class's own module and name
    assert all(name == f"{cls.__module__}.{cls.__qualname__}" for name, cls in MODEL_CLASSES.items())


def test_stores_record_the_qualified_class_and_older_stores_still_load(tmp_path):
    """A model store records its class by module-qualified name; a store that records a bare name (written before)
    loads as that class; a store naming a module outside xmldask is refused without importing it."""
    import sys

    import dask.array as da
    import numpy as np
    import scipy.sparse as sp
    import zarr

    import xmldask
    from xmldask.models import LEML
    from xmldask.store import StoreError
    from xmldask.store.integrity import commit_attrs
    from xmldask.store.models import model_class, model_qualname

    rng = np.random.default_rng(0)
    X = da.from_array(sp.random(40, 6, density=0.5, format="csr", random_state=rng), chunks=(20, -1),
                      asarray=False, fancy=False)
    Y = da.from_array(sp.csr_matrix((rng.random((40, 4)) < 0.3).astype(np.float32)), chunks=(20, -1),
                      asarray=False, fancy=False)
    url = str(tmp_path / "leml.zarr")
    LEML(n_components=2, n_iter=1).fit(X, Y).save(url)
    assert model_qualname(url) == "xmldask.models.leml.LEML" and model_class(url) == "LEML"
    group = zarr.open_group(url, mode="r+")

    def recorded_as(name):
        attrs = dict(group.attrs)
        commit_attrs(group, url, {**attrs, "xmldask": {**attrs["xmldask"], "class": name}})

    recorded_as("LEML")  # as stores written before recorded it
    assert type(xmldask.load_model(url)) is LEML
    recorded_as("antigravity.LEML")
    assert type(xmldask.load_model(url)) is LEML and "antigravity" not in sys.modules  # found by its name only
    recorded_as("xmldask.models.leml.Nothing")
    with pytest.raises(StoreError, match="holds a xmldask.models.leml.Nothing model, which this xmldask cannot"):
        xmldask.load_model(url)
