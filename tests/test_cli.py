"""The command-line contract: ingest, synth, info, demo."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest

import xmldask
from xmldask.cli import main
from xmldask.store import to_scipy


def _write_xc(path, rows, n_features, n_labels):
    lines = [f"{len(rows)} {n_features} {n_labels}"] + rows
    path.write_text("\n".join(lines) + "\n")
    return str(path)


def test_array_expression_engine_is_refused_clearly():
    """dask's opt-in array-expression engine lacks what the passes build on: one clear error at import."""
    env = {**os.environ, "DASK_ARRAY__QUERY_PLANNING": "True"}
    run = subprocess.run([sys.executable, "-c", "import xmldask"], env=env, capture_output=True, text=True)
    assert run.returncode != 0
    assert "DASK_ARRAY__QUERY_PLANNING=False" in run.stderr.splitlines()[-1]


def test_ingest_info_json(tmp_path, capsys):
    src = _write_xc(tmp_path / "a.txt", ["0,2 0:1 3:2.5", " 1:1", "1 2:0.5"], 4, 3)
    out = str(tmp_path / "a.zarr")
    assert main(["ingest", src, "--out", out, "--block-rows", "2", "--no-progress"]) == 0
    capsys.readouterr()
    assert main(["info", out, "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert (info["n_samples"], info["n_features"], info["n_labels"], info["nnz"]) == (3, 4, 3, 4)
    assert info["rows_without_labels"] == 1
    assert info["row_blocks"] == 2
    X = to_scipy(xmldask.open_dataset(out).X).toarray()
    np.testing.assert_array_equal(X, [[1, 0, 0, 2.5], [0, 1, 0, 0], [0, 0, 0.5, 0]])


def test_ingest_several_sources_and_append(tmp_path, capsys):
    a = _write_xc(tmp_path / "a.txt", ["0 0:1", "1 1:1"], 2, 2)
    b = _write_xc(tmp_path / "b.txt", ["1 0:2"], 2, 2)
    out = str(tmp_path / "ab.zarr")
    assert main(["ingest", a, b, "--out", out, "--no-progress"]) == 0
    assert xmldask.open_dataset(out).n_samples == 3
    assert main(["ingest", b, "--out", out, "--append", "--no-progress"]) == 2
    assert "already ingested" in capsys.readouterr().err
    assert main(["ingest", b, "--out", out, "--append", "--skip-ingested", "--no-progress"]) == 0
    assert xmldask.open_dataset(out).n_samples == 3


def test_ingest_error_is_one_clear_line(tmp_path, capsys):
    src = _write_xc(tmp_path / "bad.txt", ["0 0:1", "1 1:x"], 2, 2)
    out = tmp_path / "bad.zarr"
    assert main(["ingest", src, "--out", str(out), "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert "bad.txt, line 3" in err and "'1 1:x'" in err and "Traceback" not in err
    assert not out.exists()
    assert [p.name for p in tmp_path.iterdir()] == ["bad.txt"]


def test_existing_store_is_refused(tmp_path, capsys):
    src = _write_xc(tmp_path / "a.txt", ["0 0:1"], 1, 1)
    out = str(tmp_path / "a.zarr")
    assert main(["ingest", src, "--out", out, "--no-progress"]) == 0
    assert main(["ingest", src, "--out", out, "--no-progress"]) == 2
    assert "already exists" in capsys.readouterr().err
    assert main(["ingest", src, "--out", out, "--overwrite", "--no-progress"]) == 0


def test_synth_and_info(tmp_path, capsys):
    out = str(tmp_path / "s.zarr")
    args = ["synth", "--out", out, "--n-samples", "500", "--n-features", "300", "--n-labels", "50",
            "--seed", "3", "--block-rows", "128", "--no-progress"]
    assert main(args) == 0
    capsys.readouterr()
    assert main(["info", out, "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert (info["n_samples"], info["n_features"], info["n_labels"]) == (500, 300, 50)
    assert info["nnz"] > 0 and info["row_blocks"] == 4
    assert main(["synth", "--out", str(tmp_path / "m.zarr"), "--n-samples", "200", "--n-features", "100",
                 "--n-labels", "20", "--multiclass", "--no-progress"]) == 0
    Y = to_scipy(xmldask.open_dataset(str(tmp_path / "m.zarr")).Y)
    np.testing.assert_array_equal(np.diff(Y.indptr), 1)


def test_demo_runs_and_reuses(tmp_path, capsys):
    args = ["demo", "--root", str(tmp_path), "--n-samples", "2000", "--n-features", "500", "--n-labels", "100"]
    assert main(args) == 0
    first = capsys.readouterr().out
    assert "ingesting" in first and "rows" in first
    stores = sorted(p.name for p in tmp_path.glob("demo/*/*.zarr"))
    assert stores == ["test.zarr", "train.zarr"]
    assert main(args) == 0
    assert "reusing" in capsys.readouterr().out


def test_help_mentions_every_command(capsys):
    with pytest.raises(SystemExit):
        main(["--help"])
    out = capsys.readouterr().out
    for command in ("ingest", "synth", "info", "demo"):
        assert command in out


def test_train_predict_evaluate(tmp_path, capsys, scheduler):
    """The contract: train TRAIN --out MODEL, predict MODEL DATA --out PRED, evaluate PRED DATA --json."""
    common = ["--n-features", "300", "--n-labels", "40", "--seed", "2", "--no-progress"]
    train, test = str(tmp_path / "train.zarr"), str(tmp_path / "test.zarr")
    assert main(["synth", "--out", train, "--n-samples", "2000", *common]) == 0
    assert main(["synth", "--out", test, "--n-samples", "500", "--split", "test", *common]) == 0
    model, pred = str(tmp_path / "model.zarr"), str(tmp_path / "pred.zarr")
    capsys.readouterr()
    assert main(["train", train, "--out", model, "--embedding", "rembrandt", "--k", "8", "--kernel", "none",
                 "--max-epochs", "2", "--seed", "1", "--scheduler", scheduler]) == 0
    out = capsys.readouterr()
    assert f"wrote {model}" in out.out and "Dask dashboard: http" in out.err
    # the search's candidates (input features, alpha) as they finish, without -v
    assert out.err.count("held-out search (screening): ") >= 4 and "p@1 0." in out.err
    assert main(["predict", model, test, "--out", pred, "--top-k", "5", "--no-progress",
                 "--scheduler", scheduler]) == 0
    assert "500 rows x top 5" in capsys.readouterr().out
    assert main(["evaluate", pred, test, "--json"]) == 0
    results = json.loads(capsys.readouterr().out)
    assert {"P@1", "P@3", "P@5", "nDCG@5", "PSP@5"} <= set(results)
    assert 40 / 2000 < results["P@1"] <= 1  # far above a random guess
    assert main(["evaluate", pred, test]) == 0
    assert "| P@1 |" in capsys.readouterr().out
    # refusals: an existing model, a top-k beyond the labels, a bad --ks
    assert main(["train", train, "--out", model, "--scheduler", scheduler]) == 2
    assert "already exists" in capsys.readouterr().err
    assert main(["predict", model, test, "--out", str(tmp_path / "p2.zarr"), "--top-k", "41",
                 "--scheduler", scheduler]) == 2
    assert "top_k must be between 1 and the model's 40 labels" in capsys.readouterr().err
    assert main(["evaluate", pred, test, "--ks", "1,x"]) == 2
    assert "--ks must be comma-separated integers" in capsys.readouterr().err


def test_train_summary_names_training_figures_as_training():
    """The tree classifier's last pass's loss is a training figure, its held-out P@1 that of the pass it kept, and
    step-size backoffs are counted; the embedding classifier's held-out figures keep their name."""
    from xmldask.cli import _train_text

    tree = {"model": "m.zarr", "seconds": 3.0, "task": "multilabel", "n_passes": 36,
            "training": {"loss": 5.9997, "skipped": 0.2143}, "backoffs": 1}
    text = _train_text(tree)
    assert text.endswith("36 passes, 1 step-size backoffs; last pass: training loss 6, skipped 0.2143)")
    assert "held out" not in text
    tree.update(held_out={"p@1": 0.4375, "rows": 480}, best_epoch=25)
    assert _train_text(tree).endswith("36 passes, 1 step-size backoffs, kept pass 25; held out: p@1 0.4375; "
                                      "last pass: training loss 6, skipped 0.2143)")
    flat = {"model": "m.zarr", "seconds": 3.0, "task": "multilabel", "n_passes": 4, "held_out": {"val_p@1": 0.61}}
    assert _train_text(flat).endswith("4 passes; held out: val_p@1 0.61)")


def _commands() -> list[str]:
    import argparse

    from xmldask.cli import build_parser

    return sorted(next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction)).choices)


@pytest.mark.parametrize("command", _commands())
def test_every_option_and_argument_has_help_in_words(command, capsys):
    """Each option and positional of --help has a description, and none shows Python (a dict, a constant)."""
    import argparse

    from xmldask.cli import build_parser

    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices[command]
    bare = [a.dest for a in sub._actions if not a.help and a.dest != "help"]
    assert not bare, f"{command}: no help for {bare}"
    with pytest.raises(SystemExit):
        main([command, "--help"])
    text = capsys.readouterr().out
    assert "AUTO_SEARCH" not in text and "{'" not in text.replace("(in Python, {'", "")


@pytest.mark.parametrize("search, expected", [
    ("k=abc", "--search n_components=abc: 'abc' is not a value of n_components"),  # k: its former name
    ("alpha=abc", "--search alpha=abc: 'abc' is not a value of alpha"),
    ("kk=1,2", "--search kk: not a parameter the search can choose; it chooses features, n_components, alpha"),
])
def test_search_errors_name_the_option_before_a_cluster_starts(tmp_path, capsys, search, expected):
    """Before: "invalid literal for int() with base 10: 'abc'" after the cluster started; the parameters named as
    everywhere (scikit-learn's names; a former name, k, read as today's), the estimator's random_state not among
    those a search chooses."""
    out = str(tmp_path / "d.zarr")
    assert main(["synth", "--out", out, "--n-samples", "50", "--n-features", "10", "--n-labels", "4"]) == 0
    capsys.readouterr()
    assert main(["train", out, "--out", str(tmp_path / "m.zarr"), "--search", search]) == 2
    err = capsys.readouterr().err
    assert expected in err and "Dask dashboard" not in err and "random_state" not in err, err
