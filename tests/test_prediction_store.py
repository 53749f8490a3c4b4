"""Prediction stores: round trip, refusal to overwrite, nothing left behind on bad input."""

from __future__ import annotations

import dask.array as da
import numpy as np
import pytest
import zarr

from xmldask.store import StoreError, _fs, open_dataset, open_predictions, write_predictions


def _topk(n=1001, k=5, n_labels=50, chunks=(300, 300, 401), seed=0):
    rng = np.random.default_rng(seed)
    labels = np.stack([rng.permutation(n_labels)[:k] for _ in range(n)]).astype(np.int64)
    labels[7, 3:] = -1  # a row with fewer candidates than k
    scores = -np.sort(-rng.random((n, k)), axis=1)
    scores[7, 3:] = -np.inf
    return labels, scores, da.from_array(labels, chunks=(chunks, -1)), da.from_array(scores, chunks=(chunks, -1))


@pytest.mark.parametrize("url", ["local", "memory://preds/p.zarr"])
def test_round_trip(tmp_path, url):
    url = str(tmp_path / "p.zarr") if url == "local" else url
    labels, scores, L, S = _topk()
    info = write_predictions(url, L, S, n_labels=50, meta={"model": "m.zarr"}, overwrite=url.startswith("memory"))
    assert info["n_samples"] == 1001 and info["top_k"] == 5 and info["model"] == "m.zarr"
    assert info["rows_per_second"] > 0
    p = open_predictions(url)
    assert p.top_k == 5 and p.labels.dtype == np.int32 and p.scores.dtype == np.float32
    np.testing.assert_array_equal(p.labels.compute(), labels)
    np.testing.assert_array_equal(p.scores.compute(), scores.astype(np.float32))
    # plain zarr readers see the two arrays
    group = zarr.open_group(_fs.zarr_store(url, read_only=True), mode="r")
    assert group["labels"].shape == (1001, 5) and group["labels"].chunks == (401, 5)


def test_refuses_to_overwrite(tmp_path):
    url = str(tmp_path / "p.zarr")
    _, _, L, S = _topk()
    write_predictions(url, L, S, n_labels=50)
    with pytest.raises(FileExistsError, match="already exists"):
        write_predictions(url, L, S, n_labels=50)
    _, _, L2, S2 = _topk(seed=1)
    write_predictions(url, L2, S2, n_labels=50, overwrite=True)
    np.testing.assert_array_equal(open_predictions(url).labels.compute(), L2.compute())


def test_out_of_range_ids_leave_nothing_behind(tmp_path):
    url = str(tmp_path / "p.zarr")
    _, _, L, S = _topk()
    with pytest.raises(ValueError, match=r"label ids outside \[0, 10\)"):
        write_predictions(url, L, S, n_labels=10)
    assert list(tmp_path.iterdir()) == []


def test_shape_errors(tmp_path):
    _, _, L, S = _topk()
    with pytest.raises(ValueError, match="one shape"):
        write_predictions(str(tmp_path / "p.zarr"), L, S[:, :3], n_labels=50)
    with pytest.raises(ValueError, match="share their row chunks"):
        write_predictions(str(tmp_path / "p.zarr"), L, S.rechunk({0: 100}), n_labels=50)


def test_open_errors(tmp_path):
    with pytest.raises(StoreError, match="no prediction store"):
        open_predictions(str(tmp_path / "missing.zarr"))
    from xmldask.datasets import make_synthetic

    url = make_synthetic(str(tmp_path / "d.zarr"), n_samples=50, n_features=20, n_labels=10, seed=0).url
    open_dataset(url)
    with pytest.raises(StoreError, match="expected 'predictions'"):
        open_predictions(url)
