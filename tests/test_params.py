"""Training parameters are defined once (xmldask.params): every path has the same names and defaults."""

from __future__ import annotations

import inspect

import numpy as np
import pytest
import scipy.sparse as sp

from flows import deploy
from flows import pipeline as pipeline_module
from flows.refresh import refresh
from flows.stage_flows import train_flow
from xmldask import cli, jobs
from xmldask.models import EmbeddingClassifier, TrainParams, load_model
from xmldask.params import TreeParams, from_args, parse_grid, validated


def test_every_path_has_the_same_defaults():
    defaults = TrainParams()
    for flow in (train_flow, pipeline_module.pipeline, refresh):
        assert inspect.signature(flow.fn).parameters["model"].default == defaults, flow.name
    # the command lines give no value unless an option is given: the defaults above apply
    parsed = [cli.build_parser().parse_args(["train", "data.zarr", "--out", "model.zarr"]),
              pipeline_module.build_parser().parse_args([]), deploy.build_parser().parse_args(["--test", "t.zarr"])]
    for args in parsed:
        assert from_args(args, TrainParams) == {}
    # and the job's estimator has the same defaults as its parameters
    est = EmbeddingClassifier().get_params()
    assert est["n_components"] == defaults.n_components and est["random_state"] in (None, defaults.random_state)
    for name in ("kernel", "features", "alpha", "n_random_features", "max_epochs"):
        assert est[name] == getattr(defaults, name), name


def test_every_tree_path_has_the_same_defaults():
    """``xmldask tree``, the pipeline's ``--tree-*`` options and the tree stage take TreeParams; the estimator's
    defaults are its defaults, and the stage differs only where it says (labels without rows are left out)."""
    from flows.stage_flows import TREE_DEFAULTS
    from xmldask.tree import SpectralLabelTree

    args = cli.build_parser().parse_args(["tree", "data.zarr", "--out", "tree.zarr"])
    assert from_args(args, TreeParams) == {}
    args = pipeline_module.build_parser().parse_args(["--grow-tree"])
    assert from_args(args, TreeParams, prefix="tree-") == {}
    args = pipeline_module.build_parser().parse_args(["--grow-tree", "--tree-max-depth", "3", "--tree-routing",
                                                      "deterministic"])
    assert from_args(args, TreeParams, prefix="tree-") == {"max_depth": 3, "routing": "deterministic"}
    args = pipeline_module.build_parser().parse_args(["--grow-tree", "--tree-depth", "3"])  # its former name
    assert from_args(args, TreeParams, prefix="tree-") == {"max_depth": 3}
    defaults = TreeParams()
    assert TREE_DEFAULTS == defaults and defaults.unseen_labels == "ignore"  # one default on every path
    est = SpectralLabelTree().get_params()
    assert (est["max_depth"], est["leaf_labels"], est["routing"], est["random_state"]) == (
        defaults.max_depth, defaults.leaf_labels, defaults.routing, defaults.random_state)
    text = " ".join(next(a for a in cli.build_parser()._subparsers._actions if a.dest == "command")
                    .choices["tree"].format_help().split())
    for name, field in TreeParams.model_fields.items():
        assert f"--{name.replace('_', '-')}" in text and f"(default {field.default})" in text, name


def test_every_option_is_generated_with_its_default_and_help():
    parser = cli.build_parser()
    train = next(a for a in parser._subparsers._actions if a.dest == "command").choices["train"]
    text = train.format_help()
    for name, field in TrainParams.model_fields.items():
        option = "--" + name.replace("_", "-")
        assert option in text, option
        if field.default is not None:
            assert f"(default {field.default})" in " ".join(text.split()), name


def test_command_line_values_are_validated_and_parsed():
    args = cli.build_parser().parse_args(["train", "d", "--out", "m", "--n-components", "32", "--alpha", "0.5",
                                          "--search", "n_components=8,16", "--search", "kernel=none,gaussian"])
    expected = {"n_components": 32, "alpha": 0.5, "search": {"n_components": [8, 16], "kernel": ["none", "gaussian"]}}
    assert from_args(args, TrainParams) == expected
    # the former names (--k, --seed, --depth, k= in a search) are read as today's
    args = cli.build_parser().parse_args(["train", "d", "--out", "m", "--k", "32", "--alpha", "0.5",
                                          "--search", "k=8,16", "--search", "kernel=none,gaussian"])
    assert from_args(args, TrainParams) == expected
    assert TrainParams(k=32, seed=3) == TrainParams(n_components=32, random_state=3)
    with pytest.raises(ValueError, match="k is the former name of n_components: give n_components once"):
        TrainParams(k=32, n_components=8)
    with pytest.raises(ValueError, match=r"invalid training parameters: n_components = 0: Input should be greater"):
        from_args(cli.build_parser().parse_args(["train", "d", "--out", "m", "--n-components", "0"]), TrainParams)
    assert cli.main(["train", "d", "--out", "m", "--n-estimators", "0"]) == 2  # the error, before any work
    with pytest.raises(ValueError, match="extra_inputs|Extra inputs are not permitted"):
        validated(TrainParams, {"kernal": "none"})


def test_one_kernel_vocabulary_that_reads_the_former_names(tmp_path):
    """none|gaussian|laplacian on every path; the former identity (decoder) and cauchy (command line) still read."""
    args = cli.build_parser().parse_args(["train", "d", "--out", "m", "--kernel", "cauchy"])
    assert from_args(args, TrainParams) == {"kernel": "laplacian"}
    assert TrainParams(kernel="cauchy") == TrainParams(kernel="laplacian")
    assert jobs._search_grid({"kernel": ["identity", "cauchy", "gaussian"]}) == {"kernel": ["none", "laplacian",
                                                                                            "gaussian"]}
    with pytest.raises(ValueError, match="kernel must be one of none, gaussian, laplacian, but is 'rbf'"):
        jobs._search_grid({"kernel": ["rbf"]})
    # a model saved with the decoder's former name loads and predicts as kernel none
    rng = np.random.default_rng(0)
    X, Y = sp.csr_matrix(rng.random((60, 5))), sp.csr_matrix(np.eye(3)[rng.integers(0, 3, 60)])
    kw = dict(embedding=np.eye(3), max_epochs=1, batch_size=32, random_state=0)
    old = EmbeddingClassifier(kernel="identity", **kw).fit(X, Y)
    new = EmbeddingClassifier(kernel="none", **kw).fit(X, Y)
    old.save(str(tmp_path / "old.zarr"))
    loaded = load_model(str(tmp_path / "old.zarr"))
    assert old.omega_ is None and loaded.kernel == "identity"
    np.testing.assert_array_equal(loaded.predict_topk(X, 2)[1].compute(), new.predict_topk(X, 2)[1].compute())
    with pytest.raises(ValueError, match="kernel must be one of none, gaussian, laplacian, but is 'rbf'"):
        EmbeddingClassifier(kernel="rbf", **kw).fit(X, Y)


def test_parse_grid():
    assert parse_grid(["n_components=50,150", "alpha=0.001, 1", "kernel=none,gaussian"]) == {
        "n_components": [50, 150], "alpha": [0.001, 1], "kernel": ["none", "gaussian"]}
    assert parse_grid(["k=50,150"]) == {"n_components": [50, 150]}  # a former name
    for bad in (["k"], ["=1"], ["k="]):
        with pytest.raises(ValueError, match="NAME=V1,V2"):
            parse_grid(bad)


def test_auto_search_chooses_what_is_not_given():
    """The default search="auto" chooses features, k, alpha and the kernel by held-out P@1, each unless given."""
    everything = {"features": ["raw", "tfidf"], "n_components": [50, 400], "alpha": [1e-3, 0.1, 3.0],
                  "kernel": ["none", "gaussian"]}
    assert TrainParams().search == everything and list(TrainParams().search) == list(everything)  # in this order
    assert TrainParams(n_components=8).search == {name: v for name, v in everything.items() if name != "n_components"}
    assert TrainParams(k=8).search == TrainParams(n_components=8).search  # the former name, given
    assert TrainParams(kernel="gaussian", features="raw", n_components=8, alpha=0.1).search is None
    assert TrainParams(kernel="gaussian").search == {name: v for name, v in everything.items() if name != "kernel"}
    assert TrainParams().search_screen and not TrainParams(search_screen=False).search_screen
    assert TrainParams().search_repeats == "auto" and TrainParams(search_repeats=3).search_repeats == 3
    parser = cli.build_parser()
    repeats = parser.parse_args(["train", "d", "--out", "m", "--search-repeats", "2"])
    assert from_args(repeats, TrainParams) == {"search_repeats": 2}
    with pytest.raises(ValueError, match="search_repeats"):
        TrainParams(search_repeats=0)
    assert TrainParams(search=None).search is None
    assert TrainParams(search={"alpha": [0.1, 1]}).search == {"alpha": [0.1, 1]}  # an explicit search as given
    assert TrainParams(**TrainParams(k=8).model_dump()) == TrainParams(k=8)  # resolved once: dumps round-trip
    no_search = cli.build_parser().parse_args(["train", "d", "--out", "m", "--no-search"])
    assert from_args(no_search, TrainParams) == {"search": None}


def test_auto_ensemble_follows_the_search():
    """n_estimators="auto" (kept as given: a number given is told from the default, whatever it is): an ensemble
    of AUTO_ESTIMATORS after the embedding classifier's search, one model without one (--no-search, every searched
    parameter given, or another family); a given number is kept."""
    from xmldask.jobs import members_asked
    from xmldask.params import AUTO_ESTIMATORS

    assert AUTO_ESTIMATORS > 1 and TrainParams().n_estimators == "auto"
    assert members_asked(TrainParams()) == AUTO_ESTIMATORS
    assert members_asked(TrainParams(search=None)) == 1
    assert members_asked(TrainParams(kernel="gaussian", features="raw", n_components=8, alpha=0.1)) == 1
    assert members_asked(TrainParams(model="leml")) == 1 and members_asked(TrainParams(tree="t.zarr")) == 1
    assert members_asked(TrainParams(model="centroid")) == 1
    assert members_asked(TrainParams(n_estimators=3)) == 3 and TrainParams(n_estimators=3).n_estimators == 3
    assert members_asked(TrainParams(search=None, n_estimators=5)) == 5
    assert members_asked(TrainParams(model="leml", n_estimators=3)) == 3  # an ensemble of any family, when given
    parser = cli.build_parser()
    no_search = parser.parse_args(["train", "d", "--out", "m", "--no-search"])
    assert members_asked(TrainParams(**from_args(no_search, TrainParams))) == 1
    given = parser.parse_args(["train", "d", "--out", "m", "--n-estimators", str(AUTO_ESTIMATORS)])
    assert from_args(given, TrainParams) == {"n_estimators": AUTO_ESTIMATORS}  # given, though the default's number


def test_tree_defaults_are_one_value_on_every_path():
    """The tree's depth and leaf budget and the tree classifier's passes: the same default in the schema, the
    estimators and the growth function (each reads the constant of xmldask.params)."""
    import inspect

    from xmldask.models.tree_classifier import TreeClassifier, TreeClassifierParams
    from xmldask.params import TreeParams
    from xmldask.tree import SpectralLabelTree
    from xmldask.tree.growth import grow_tree

    fields = TreeParams.model_fields
    for func in (SpectralLabelTree, grow_tree):
        params = inspect.signature(func).parameters
        assert params["max_depth"].default == fields["max_depth"].default
        assert params["leaf_labels"].default == fields["leaf_labels"].default
    passes = TreeClassifierParams.model_fields["max_epochs"].default
    assert inspect.signature(TreeClassifier).parameters["max_epochs"].default == passes
    assert TrainParams(tree="t.zarr").max_epochs == passes


def _families():
    from xmldask.base import FAMILIES

    return sorted(FAMILIES.items())


@pytest.mark.parametrize("name, cls", _families(), ids=[name for name, _ in _families()])
def test_each_family_schema_matches_its_estimator(name, cls):
    """Each family's schema lives next to its estimator: every field of its own sets a constructor parameter of the
    same default (the constructors read the schema's defaults), and the shared block's seed and budget set the
    estimator's where it takes them; the joined TrainParams takes the schema's field as it is."""
    from xmldask.models.families import SCHEMAS

    schema = cls.params_schema
    assert SCHEMAS[name] is schema and name in schema.family_names()
    signature = inspect.signature(cls).parameters
    for field in schema.own_fields():
        if field in schema.job_fields:
            continue
        assert field in signature, (name, field)  # one name: the field's is the estimator's parameter's
        default = schema.model_fields[field].default
        if (name, field) != ("tree", "tree"):  # the estimator's tree: a specification by default (grown in fit)
            assert signature[field].default == default, (name, field)
        joined = TrainParams.model_fields[field]
        assert joined.annotation == schema.model_fields[field].annotation, (name, field)
    for field in ("random_state", "time_budget"):
        assert field in signature or field == "time_budget" or name == "br", (name, field)


@pytest.mark.parametrize("name, cls", _families(), ids=[name for name, _ in _families()])
def test_each_family_takes_its_own_fields_with_its_defaults(name, cls):
    """TrainParams keyed on ``model``: a family gets its own defaults for the fields not given (the centroids'
    tf-idf rows, the tree classifier's 200 passes), refuses another family's fields by name, and builds its
    estimator from them (from_params) with the values given."""
    from xmldask.models.families import FAMILY_PARAMS

    schema = cls.params_schema
    base = {"model": name, **({"tree": "t.zarr"} if name == "tree" else {})}
    params, family = TrainParams(**base), schema(**base)
    for field in schema.model_fields:
        assert getattr(params, field) == getattr(family, field), (name, field)
    assert TrainParams(model="centroid").features == "tfidf" != TrainParams().features
    foreign = next(field for other in FAMILY_PARAMS for field in other.own_fields()
                   if field not in schema.model_fields and other.model_fields[field].default is not None)
    other_value = {"embedding": "pca", "kernel": "none", "n_components": 7, "loss": "logistic", "rounds": 3,
                   "form": "per_label", "features": "l2"}.get(foreign)
    if other_value is not None:
        with pytest.raises(ValueError, match=f"{foreign} do\\(es\\) not apply with model={name}"):
            TrainParams(**base, **{foreign: other_value})
    est = cls.from_params(TrainParams(**base, random_state=3))
    assert est.get_params().get("random_state", 3) == 3
    assert type(est) is cls


def test_the_tree_classifier_is_a_family_with_a_tree_store():
    with pytest.raises(ValueError, match="model=tree needs tree=URL"):
        TrainParams(model="tree")
    assert TrainParams(tree="t.zarr").model == "tree" == TrainParams(model="tree", tree="t.zarr").model
    assert TrainParams(tree="t.zarr").search is None and TrainParams(model="centroid").search is None
    with pytest.raises(ValueError, match="search does not apply with model=tree"):
        TrainParams(tree="t.zarr", search={"n_components": [1, 2]})
    with pytest.raises(ValueError, match="n_components do\\(es\\) not apply with model=br"):
        TrainParams(model="br", k=5)
    old = TrainParams(tree="t.zarr").model_dump() | {"model": "auto"}  # a dump from before model="tree"
    assert TrainParams(**old) == TrainParams(tree="t.zarr")


@pytest.mark.parametrize("name, cls", _families(), ids=[name for name, _ in _families()])
def test_no_family_default_is_typed_twice(name, cls):
    """A constructor reads its family's defaults from the schema (``n_components=_LEML.n_components``), never types
    them again:
    each parameter that a schema field sets has an attribute of the schema's defaults as its default, not a literal."""
    import ast
    import textwrap

    schema = cls.params_schema
    init = next(c.__init__ for c in cls.__mro__ if "__init__" in c.__dict__)
    node = ast.parse(textwrap.dedent(inspect.getsource(init))).body[0]
    args = node.args
    positional = args.posonlyargs + args.args
    defaults = {a.arg: d for a, d in zip(positional[len(positional) - len(args.defaults):], args.defaults)}
    defaults.update({a.arg: d for a, d in zip(args.kwonlyargs, args.kw_defaults) if d is not None})
    for field in schema.own_fields():
        parameter = field
        if (name, field) == ("tree", "tree") or field in schema.job_fields:
            continue  # the estimator's tree: a specification by default (grown in fit); the job's is a store
        assert isinstance(defaults[parameter], ast.Attribute), (name, parameter, ast.unparse(defaults[parameter]))
