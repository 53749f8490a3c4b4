"""``bench/predict_cost.py``: a saved label-centroid model and a test store, a row a pair with the documented keys."""

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


def test_predict_cost_writes_a_row_per_pair(tmp_path):
    train, test, model = (str(tmp_path / name) for name in ("train.zarr", "test.zarr", "model.zarr"))
    _xmldask("synth", "--preset", "xmc-10k", "--n-samples", "3000", "--out", train, "--no-progress")
    _xmldask("synth", "--preset", "xmc-10k", "--split", "test", "--n-samples", "400", "--out", test, "--no-progress")
    _xmldask("train", train, "--out", model, "--model", "centroid")
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
