"""Observed-entry masks in dataset stores and LEML's missing-label simulation."""

from __future__ import annotations

import numpy as np
import pytest
import scipy.sparse as sp
import zarr

from xmldask.missing import bernoulli_entries, mask_dataset
from xmldask.store import DatasetWriter, open_dataset, to_scipy


def _dataset(url, n=300, d=20, L=30, block_rows=70, seed=0):
    rng = np.random.default_rng(seed)
    X = sp.random(n, d, density=0.2, format="csr", random_state=rng, dtype=np.float32)
    Y = sp.csr_matrix((rng.random((n, L)) < 0.1).astype(np.float32))
    with DatasetWriter.create(url, block_rows=block_rows) as w:
        w.write(X, Y)
        w.commit(n_features=d, n_labels=L)
    return X, Y


def test_bernoulli_entries_fraction_and_independence():
    rng = np.random.default_rng(0)
    n, L, p = 2000, 150, 0.2
    M = bernoulli_entries(n, L, p, rng)
    total = n * L
    # the count is Binomial(total, p): within 5 standard deviations
    assert abs(M.nnz - p * total) < 5 * np.sqrt(total * p * (1 - p))
    assert M.has_sorted_indices and M.max() == 1
    # columns and rows are uniform: per-column counts are Binomial(n, p)
    col = np.bincount(M.indices, minlength=L)
    assert np.all(np.abs(col - n * p) < 6 * np.sqrt(n * p * (1 - p)))
    assert bernoulli_entries(3, 4, 1.0, rng).nnz == 12


def test_mask_dataset_roundtrip_and_plain_zarr(tmp_path):
    src, out = str(tmp_path / "src.zarr"), str(tmp_path / "masked.zarr")
    X, Y = _dataset(src)
    info = mask_dataset(src, out, observed=0.3, seed=7)
    ds = open_dataset(out)
    assert ds.observed is not None and ds.observed.chunks == ds.Y.chunks and ds.Y.chunks[0] == ds.X.chunks[0]
    O, Ym = to_scipy(ds.observed), to_scipy(ds.Y)
    np.testing.assert_array_equal(to_scipy(ds.X).toarray(), X.toarray())
    # Y keeps exactly the observed relevant labels
    np.testing.assert_array_equal(Ym.toarray(), Y.toarray() * O.toarray())
    assert info["nnz_observed"] == O.nnz and abs(info["observed_fraction"] - 0.3) < 0.03
    # deterministic in the seed; another seed gives another mask
    mask_dataset(src, str(tmp_path / "again.zarr"), observed=0.3, seed=7)
    assert (to_scipy(open_dataset(str(tmp_path / "again.zarr")).observed) != O).nnz == 0
    mask_dataset(src, str(tmp_path / "other.zarr"), observed=0.3, seed=8)
    assert (to_scipy(open_dataset(str(tmp_path / "other.zarr")).observed) != O).nnz > 0
    # readable by plain Zarr as an anndata-style CSR group
    g = zarr.open_group(out, mode="r")["observed"]
    assert g.attrs["encoding-type"] == "csr_matrix"
    n = ds.n_samples
    plain = sp.csr_matrix((g["data"][: info["nnz_observed"]], g["indices"][: info["nnz_observed"]],
                           g["indptr"][: n + 1]), shape=tuple(g.attrs["shape"]))
    assert (plain != O).nnz == 0


def test_masked_dataset_append(tmp_path):
    src, out = str(tmp_path / "src.zarr"), str(tmp_path / "masked.zarr")
    _dataset(src)
    mask_dataset(src, out, observed=0.5, seed=1)
    before = open_dataset(out)
    rng = np.random.default_rng(3)
    Xn = sp.random(40, 20, density=0.2, format="csr", random_state=rng, dtype=np.float32)
    On = bernoulli_entries(40, 30, 0.5, rng)
    Yn = sp.csr_matrix(On.multiply(sp.csr_matrix((rng.random((40, 30)) < 0.2).astype(np.float32))))
    with DatasetWriter.append(out) as w:
        with pytest.raises(ValueError, match="pass observed="):
            w.write(Xn, Yn)
        bad = Yn.tolil()
        bad[0, np.flatnonzero(On[0].toarray()[0] == 0)[0]] = 1
        with pytest.raises(ValueError, match="outside the observed entries"):
            w.write(Xn, sp.csr_matrix(bad), observed=On)
        w.write(Xn, Yn, observed=On)
        w.commit()
    ds = open_dataset(out)
    assert ds.n_samples == before.n_samples + 40 and ds.observed.chunks == ds.Y.chunks
    np.testing.assert_array_equal(to_scipy(ds.observed)[-40:].toarray(), On.toarray())
    np.testing.assert_array_equal(to_scipy(ds.observed)[:-40].toarray(), to_scipy(before.observed).toarray())


@pytest.mark.parametrize("fraction", [0, -0.1, 1.5, float("nan")])
def test_mask_rejects_bad_fraction(tmp_path, fraction):
    src = str(tmp_path / "src.zarr")
    _dataset(src)
    with pytest.raises(ValueError, match=r"in \(0, 1\]"):
        mask_dataset(src, str(tmp_path / "m.zarr"), observed=fraction)


def test_unmasked_writer_refuses_a_mask(tmp_path):
    with DatasetWriter.create(str(tmp_path / "d.zarr")) as w:
        with pytest.raises(ValueError, match="no observed-entry mask"):
            w.write(sp.csr_matrix((2, 3)), sp.csr_matrix((2, 4)), observed=sp.csr_matrix((2, 4)))
