"""``bench/scale.py --quick``: the whole pipeline at one tiny size, every stage a row with the documented keys."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # benchmarks run whole

REPO = Path(__file__).resolve().parents[1]
KEYS = {"n_samples", "nnz", "csr_bytes", "worker_memory_limit_bytes", "n_workers", "stage", "seconds",
        "peak_rss_bytes_per_worker", "worker_restarts"}


def test_scale_quick_writes_a_row_per_stage(tmp_path):
    out = tmp_path / "scale.json"
    done = subprocess.run([sys.executable, str(REPO / "bench" / "scale.py"), "--quick", "--json", str(out),
                           "--cache", str(tmp_path / "cache")], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = json.loads(out.read_text())
    assert [row["stage"] for row in rows] == ["ingest-train", "ingest-test", "spectrum", "train", "predict",
                                              "evaluate"]
    for row in rows:
        assert KEYS <= set(row), KEYS - set(row)
        assert "error" not in row
        assert row["n_samples"] == 3000 and row["n_workers"] == 2 and row["worker_memory_limit_bytes"] == 256 * 2**20
        assert row["seconds"] > 0 and row["nnz"] > 0 and row["csr_bytes"] > 8 * row["nnz"]
        assert 0 < row["peak_rss_bytes_per_worker"] < row["worker_memory_limit_bytes"]
        assert row["worker_restarts"] == 0
    assert "| stage |" in done.stdout


def test_scale_runs_a_subset_of_stages(tmp_path):
    """``--stages`` without the test split's ingest (e.g. one worker against two on training alone)."""
    out = tmp_path / "scale.json"
    done = subprocess.run([sys.executable, str(REPO / "bench" / "scale.py"), "--quick", "--workers", "1", "--stages",
                           "ingest-train", "train", "--json", str(out), "--cache", str(tmp_path / "cache")],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = json.loads(out.read_text())
    assert [row["stage"] for row in rows] == ["ingest-train", "train"]
    assert all("error" not in row and row["n_workers"] == 1 and row["stage_nnz"] == row["nnz"] for row in rows)


def test_scale_runs_an_xmc_preset_with_the_defaults(tmp_path):
    """``--preset``: the XMC generator's stores, the default model (the label-centroid tree), P@1 in the rows."""
    out = tmp_path / "scale.json"
    done = subprocess.run([sys.executable, str(REPO / "bench" / "scale.py"), "--preset", "xmc-10k", "--sizes", "4000",
                           "--test-rows", "500", "--memory-limit", "512MiB", "--json", str(out),
                           "--cache", str(tmp_path / "cache")], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = json.loads(out.read_text())
    assert [row["stage"] for row in rows] == ["spectrum", "train", "predict", "evaluate"]
    for row in rows:
        assert "error" not in row and row["worker_restarts"] == 0
        assert row["n_samples"] == 4000 and row["n_labels"] == 10_000 and 0 < row["store_bytes"] < row["csr_bytes"]
    assert rows[-1]["P@1"] > 0.3  # a random guess among 10,000 labels: 0.0003
