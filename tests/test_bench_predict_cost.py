"""``bench/predict_cost.py`` (a row a pair with the documented keys) and ``bench/summary_rank.py`` (a row a rank and
shortlist) on a saved label-centroid model and a test store."""

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
