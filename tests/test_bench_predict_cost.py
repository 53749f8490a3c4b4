"""``bench/predict_cost.py`` (a row a pair with the documented keys) and ``bench/summary_rank.py`` (a row a rank and
shortlist) and ``bench/predict_phases.py`` (a row a block size and beam) on a saved label-centroid model and a test
store."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # benchmarks run whole

REPO = Path(__file__).resolve().parents[1]
KEYS = {"model", "labels", "rows", "routing", "beam", "seconds", "rows/s", "us a row", "cost a row / first"}


def _xmldask(*args: str) -> None:
    done = subprocess.run([sys.executable, "-m", "xmldask.cli", *args], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    root = tmp_path_factory.mktemp("predict-cost")
    train, test, model = (str(root / name) for name in ("train.zarr", "test.zarr", "model.zarr"))
    _xmldask("synth", "--preset", "xmc-10k", "--n-samples", "3000", "--out", train, "--no-progress")
    _xmldask("synth", "--preset", "xmc-10k", "--split", "test", "--n-samples", "400", "--out", test, "--no-progress")
    _xmldask("train", train, "--out", model, "--model", "centroid")
    return model, test


def test_predict_cost_writes_a_row_per_pair(saved, tmp_path):
    model, test = saved
    out = tmp_path / "cost.json"
    done = subprocess.run([sys.executable, str(REPO / "bench" / "predict_cost.py"), "--pair", f"{model}={test}",
                           "--pair", f"{model}={test}", "--rows", "300", "--repeats", "2", "--json", str(out)],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = json.loads(out.read_text())
    assert len(rows) == 2 and all(KEYS <= set(row) for row in rows)
    assert all(row["rows"] == 300 and row["labels"] == 10_000 and row["routing"] == "summaries" for row in rows)
    assert rows[0]["cost a row / first"] == 1
    assert all(row["us a row"] > 0 and row["rows/s"] * row["us a row"] == pytest.approx(1e6, rel=0.01)
               for row in rows)
    assert "| model |" in done.stdout


def test_predict_cost_predicts_the_same_rows_for_every_pair(saved, tmp_path):
    """A smaller test store sets the rows of every pair: a call's fixed costs spread over 5,000 rows of one pair and
    20,000 of the other made a ratio of 3.09 read 1.86 (stop 77)."""
    model, test = saved
    small = str(tmp_path / "small.zarr")
    _xmldask("synth", "--preset", "xmc-10k", "--split", "test", "--n-samples", "250", "--out", small, "--no-progress")
    out = tmp_path / "cost.json"
    done = subprocess.run([sys.executable, str(REPO / "bench" / "predict_cost.py"), "--pair", f"{model}={test}",
                           "--pair", f"{model}={small}", "--rows", "300", "--repeats", "1", "--json", str(out)],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert [row["rows"] for row in json.loads(out.read_text())] == [250, 250]
    assert "predicting 250 rows a pair, the smallest test store's (not --rows 300)" in done.stdout


def test_summary_rank_writes_a_row_per_rank_and_shortlist(saved, tmp_path):
    model, test = saved
    out = tmp_path / "rank.json"
    done = subprocess.run([sys.executable, str(REPO / "bench" / "summary_rank.py"), model, test, "--rows", "300",
                           "--ranks", "2,4", "--shortlists", "1,1000", "--json", str(out)],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = json.loads(out.read_text())
    assert [row["rank"] for row in rows] == [2, 2, 4, 4]
    for row in rows:
        assert 0 < row["head mass kept"] <= 1 and 0 <= row["beam recall"] <= 1 and row["rows"] == 300
        assert row["us a row"] > 0 and row["us / exact"] > 0 and row["tail entries a row"] >= 0
    # a shortlist of every cluster scores them all exactly: the exact beam (but for float32 near-ties) and P@1
    whole = [row for row in rows if row["shortlist"] == row["clusters"]]
    assert len(whole) == 2 and all(row["beam recall"] > 0.99 and abs(row["P@1 - exact"]) <= 2 / 300 for row in whole)
    assert all(row["shortlist"] == row["beam"] for row in rows if row not in whole)
    assert "| rank |" in done.stdout


def test_predict_phases_writes_a_row_per_block_size_and_beam(saved, tmp_path):
    """``bench/predict_phases.py`` on the summaries' model and on a model routed by routers (fitted here)."""
    from xmldask.models import LabelCentroidClassifier
    from xmldask.store import open_dataset

    model, test = saved
    train = open_dataset(str(Path(model).parent / "train.zarr"))
    routed = str(tmp_path / "routed.zarr")
    LabelCentroidClassifier(routing="routers", beam=4).fit(train.X, train.Y).save(routed)
    for url, routing in ((model, "summaries"), (routed, "routers")):
        out = tmp_path / f"{routing}.json"
        done = subprocess.run([sys.executable, str(REPO / "bench" / "predict_phases.py"), url, test, "--rows", "300",
                               "--block-rows", "7,300", "--beams", "2,4", "--repeats", "1", "--json", str(out)],
                              capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr[-3000:]
        rows = json.loads(out.read_text())
        assert [(row["block rows"], row["beam"]) for row in rows] == [(7, 2), (7, 4), (300, 2), (300, 4)]
        for row in rows:
            assert row["routing"] == routing and row["labels"] == 10_000 and row["rows"] == 300
            assert row["clusters us"] > 0 and row["candidates us"] > 0
            assert (row["groups us"] > 0) == (routing == "routers")
            assert row["us a row"] == pytest.approx(row["groups us"] + row["clusters us"] + row["candidates us"],
                                                    abs=0.2)
        # a wider beam scores more candidates, whatever the block's size
        assert rows[1]["candidates a row"] > rows[0]["candidates a row"] == rows[2]["candidates a row"]
        assert "| labels |" in done.stdout
