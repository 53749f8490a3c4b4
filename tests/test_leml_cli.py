"""The command line for LEML: mask, train --model leml|br, predict, evaluate (AUC, Hamming loss)."""

from __future__ import annotations

import json

import numpy as np
import pytest
import scipy.sparse as sp

from xmldask import metrics
from xmldask.cli import main
from xmldask.models import LEML, load_model
from xmldask.store import DatasetWriter, open_dataset, to_scipy


def _dataset(url, n=120, d=30, L=12, seed=0):
    rng = np.random.default_rng(seed)
    X = sp.random(n, d, density=0.3, format="csr", random_state=rng, dtype=np.float32)
    Y = sp.csr_matrix(((X @ rng.standard_normal((d, L))) > 0.8).astype(np.float32))
    with DatasetWriter.create(url, block_rows=40) as w:
        w.write(X, Y)
        w.commit(n_features=d, n_labels=L)


@pytest.mark.slow
def test_mask_train_predict_evaluate(tmp_path, capsys, scheduler):
    full, masked = str(tmp_path / "full.zarr"), str(tmp_path / "masked.zarr")
    _dataset(full)
    assert main(["mask", full, "--observed", "0.3", "--seed", "3", "--out", masked, "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert abs(info["observed_fraction"] - 0.3) < 0.05
    model = str(tmp_path / "leml.zarr")
    assert main(["train", masked, "--out", model, "--model", "leml", "--k", "4", "--lam", "1", "--loss", "squared",
                 "--n-iter", "2", "--no-search", "--json", "--scheduler", scheduler]) == 0
    trained = json.loads(capsys.readouterr().out)
    assert trained["threshold"] == 0.0 and trained["n_passes"] > 0
    pred = str(tmp_path / "pred.zarr")
    assert main(["predict", model, full, "--out", pred, "--top-k", "5", "--no-progress", "--scheduler", scheduler]) == 0
    capsys.readouterr()
    assert main(["evaluate", pred, full, "--json"]) == 0
    res = json.loads(capsys.readouterr().out)
    # the reported AUC and Hamming loss are those of the model's full scores at its threshold
    est = load_model(model)
    assert isinstance(est, LEML)
    ds = open_dataset(full)
    S = to_scipy(ds.X) @ est.W_ @ est.H_.T
    Y = to_scipy(ds.Y)
    assert res["avg_AUC"] == pytest.approx(metrics.average_auc(Y, S), abs=1e-6)
    assert res["hamming_loss"] == pytest.approx(((S >= 0) != (Y.toarray() > 0)).mean(), abs=1e-9)
    br = str(tmp_path / "br.zarr")
    assert main(["train", masked, "--out", br, "--model", "br", "--lam", "1", "--scheduler", scheduler]) == 0


@pytest.mark.slow
def test_train_leml_and_br_choose_their_parameters_on_held_out_rows(tmp_path, capsys, scheduler):
    """By default the family's own search: the parameters not given, by held-out P@3; the best refitted."""
    full = str(tmp_path / "full.zarr")
    _dataset(full, n=400)
    model = str(tmp_path / "leml.zarr")
    args = ["--k", "4", "--n-iter", "1", "--json", "--scheduler", scheduler]
    assert main(["train", full, "--out", model, "--model", "leml", "--lam", "1", *args]) == 0
    trained = json.loads(capsys.readouterr().out)
    tried = [r["params"] for r in trained["search"]]
    assert {name for params in tried for name in params} == {"features", "fit_intercept"}  # lam is given
    best = max(trained["search"], key=lambda r: r["score"])  # ties: the earlier, as max keeps
    assert {name: trained["params"][name] for name in best["params"]} == best["params"]
    assert trained["params"]["lam"] == 1 and load_model(model).features == best["params"]["features"]
    assert main(["train", full, "--out", str(tmp_path / "br.zarr"), "--model", "br", "--search", "lam=1,10",
                 "--search-extensions", "0", "--json", "--scheduler", scheduler]) == 0
    assert [r["params"] for r in json.loads(capsys.readouterr().out)["search"]] == [{"lam": 1}, {"lam": 10}]
    assert main(["train", full, "--out", str(tmp_path / "one.zarr"), "--model", "leml", "--no-search", *args]) == 0
    assert "search" not in json.loads(capsys.readouterr().out)
    assert main(["train", full, "--out", str(tmp_path / "bad.zarr"), "--model", "leml", "--search", "alpha=1",
                 *args]) == 2
    assert "--search alpha: not a parameter of --model leml" in capsys.readouterr().err
    assert main(["train", full, "--out", str(tmp_path / "bad.zarr"), "--model", "leml", "--time-budget", "0",
                 *args]) == 2
    assert "time_budget" in capsys.readouterr().err


def test_every_model_without_a_mask_refuses_masked_data(tmp_path, capsys, scheduler):
    """Only LEML and binary relevance read the mask; every other model says so before any pass."""
    full, masked = str(tmp_path / "full.zarr"), str(tmp_path / "masked.zarr")
    _dataset(full)
    main(["mask", full, "--observed", "0.5", "--out", masked])
    tree = str(tmp_path / "tree.zarr")
    assert main(["tree", full, "--out", tree, "--depth", "2", "--leaf-labels", "3"]) == 0
    capsys.readouterr()
    out = str(tmp_path / "m.zarr")
    for what, argv in {"the embedding classifier": ["train", masked, "--out", out, "--k", "4"],
                       "GradFac": ["train", masked, "--out", out, "--model", "gradfac"],
                       "OneVsRestBoosting": ["train", masked, "--out", out, "--model", "ovr"],
                       "TreeClassifier": ["train", masked, "--out", out, "--tree", tree],
                       "the spectral tree": ["tree", masked, "--out", out]}.items():
        assert main([*argv, "--scheduler", scheduler]) == 2, what
        err = capsys.readouterr().err
        assert "has missing labels" in err and what in err, (what, err)
        assert not (tmp_path / "m.zarr").exists()


def test_bad_input(tmp_path, capsys, scheduler):
    full = str(tmp_path / "full.zarr")
    _dataset(full)
    assert main(["mask", full, "--observed", "0", "--out", str(tmp_path / "m.zarr")]) == 2
    assert "(0, 1]" in capsys.readouterr().err
    assert main(["train", full, "--out", str(tmp_path / "m.zarr"), "--model", "leml", "--k", "13",
                 "--scheduler", scheduler]) == 2
    assert "at most the number of labels" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["train", full, "--out", str(tmp_path / "m.zarr"), "--model", "leml", "--loss", "hinge"])
    assert not (tmp_path / "m.zarr").exists()
