"""Datasets several times larger than a hard memory cap are written in bounded memory."""

import json
import os
import subprocess
import sys
import textwrap

import pytest

CHILD = textwrap.dedent(
    """
    import json, resource, sys
    import psutil
    from xmldask.datasets import make_synthetic
    out, n_samples, budget = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    # warm up: imports, Zarr's I/O threads and their stacks exist before the cap is set
    make_synthetic(out + "-warmup", n_samples=20_000, n_features=200_000, n_labels=20_000, avg_features=60)
    cap = psutil.Process().memory_info().vms + budget
    resource.setrlimit(resource.RLIMIT_AS, (cap, cap))
    ds = make_synthetic(out, n_samples=n_samples, n_features=200_000, n_labels=20_000, avg_features=60)
    csr_bytes = (ds.meta["nnz"] + ds.meta["nnz_labels"]) * 8 + 2 * 8 * (n_samples + 1)
    try:  # the cap bites: the matrices themselves would not fit in memory
        bytearray(csr_bytes)
        fits = True
    except MemoryError:
        fits = False
    print(json.dumps({"nnz": ds.meta["nnz"], "nnz_labels": ds.meta["nnz_labels"], "n_samples": ds.n_samples,
                      "csr_bytes": csr_bytes, "whole_matrix_fits": fits, "cap_mb": cap / 2**20,
                      "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}))
    """
)


@pytest.mark.slow
def test_synthesize_dataset_larger_than_address_space_cap(tmp_path):
    budget = 192 << 20  # bytes of address space allowed beyond what the warmed-up process has mapped
    n_samples = 1_600_000  # about 73 M nonzeros: CSR arrays of about 650 MB, over 3x the budget
    env = {**os.environ, "MALLOC_ARENA_MAX": "2", "OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1"}
    out = str(tmp_path / "big.zarr")
    result = subprocess.run([sys.executable, "-c", CHILD, out, str(n_samples), str(budget)],
                            capture_output=True, text=True, env=env, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    figures = json.loads(result.stdout.strip().splitlines()[-1])
    assert figures["csr_bytes"] > 3 * budget, figures
    assert not figures["whole_matrix_fits"], figures
    assert figures["n_samples"] == n_samples

    # the store is complete and right: its first rows equal the generator's first piece
    import numpy as np

    from xmldask import open_dataset
    from xmldask.datasets import iter_synthetic

    ds = open_dataset(out)
    X0, Y0 = next(iter_synthetic(n_samples=n_samples, n_features=200_000, n_labels=20_000, avg_features=60))
    head = ds.X.blocks[0].compute()[: X0.shape[0]]
    assert (head != X0).nnz == 0
    assert (ds.Y.blocks[0].compute()[: Y0.shape[0]] != Y0).nnz == 0
    assert int(ds.label_counts.sum()) == figures["nnz_labels"]
    np.testing.assert_equal(ds.X.numblocks[0], len(ds.meta["row_blocks"]) - 1)
