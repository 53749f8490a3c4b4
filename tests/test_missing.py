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


# -- ingest --observed: a file of observed entries per source ------------------------------------

def _write_xc(path, X, Y):
    lines = [f"{X.shape[0]} {X.shape[1]} {Y.shape[1]}"]
    for i in range(X.shape[0]):
        labels = ",".join(map(str, Y[i].indices))
        feats = " ".join(f"{j}:{v:g}" for j, v in zip(X[i].indices, X[i].data))
        lines.append(f"{labels} {feats}")
    path.write_text("\n".join(lines) + "\n")


def _observed_lines(O) -> str:
    return "".join(",".join(map(str, O[i].indices)) + "\n" for i in range(O.shape[0]))


def _mask_for(Y, seed, p=0.3):
    rng = np.random.default_rng(seed)
    return sp.csr_matrix(((rng.random(Y.shape) < p) | (Y.toarray() > 0)).astype(np.float32))


def test_ingest_observed_file_equals_the_written_mask(tmp_path):
    from xmldask.io import ingest

    rng = np.random.default_rng(1)
    X = sp.random(50, 12, density=0.3, format="csr", random_state=rng, dtype=np.float32)
    X.data = np.round(X.data * 8) / 8
    Y = sp.csr_matrix((rng.random((50, 7)) < 0.2).astype(np.float32))
    O = _mask_for(Y, 2)
    _write_xc(tmp_path / "a.txt", X[:30], Y[:30])
    _write_xc(tmp_path / "b.txt", X[30:], Y[30:])
    (tmp_path / "a.obs").write_text(_observed_lines(O[:30]))
    (tmp_path / "b.obs").write_text(_observed_lines(O[30:]))
    url = str(tmp_path / "ds.zarr")
    ds = ingest([str(tmp_path / "a.txt"), str(tmp_path / "b.txt")], url, block_rows=16, batch_bytes=200,
                observed=[str(tmp_path / "a.obs"), str(tmp_path / "b.obs")])
    assert ds.observed is not None and ds.observed.chunks == ds.Y.chunks
    assert (to_scipy(ds.observed) != O).nnz == 0 and (to_scipy(ds.Y) != Y).nnz == 0
    assert ds.meta["sources"][1]["observed"] == str(tmp_path / "b.obs")
    # appending keeps the mask: another source needs its observed entries, and gets them
    _write_xc(tmp_path / "c.txt", X[:5], Y[:5])
    with pytest.raises(ValueError, match="has an observed-entry mask"):
        ingest(str(tmp_path / "c.txt"), url, append=True)
    (tmp_path / "c.obs").write_text(_observed_lines(O[:5]))
    ds = ingest(str(tmp_path / "c.txt"), url, append=True, observed=str(tmp_path / "c.obs"))
    assert (to_scipy(ds.observed) != sp.vstack([O, O[:5]])).nnz == 0


def test_ingest_observed_bad_input_names_the_line_and_leaves_nothing(tmp_path):
    from xmldask.io import ParseError, ingest

    rng = np.random.default_rng(3)
    X = sp.random(10, 6, density=0.5, format="csr", random_state=rng, dtype=np.float32)
    X.data[:] = 1
    Y = sp.csr_matrix(np.eye(10, 4, dtype=np.float32))  # row i < 4 has label i
    _write_xc(tmp_path / "d.txt", X, Y)
    good = _observed_lines(_mask_for(Y, 4)).splitlines()
    url = str(tmp_path / "ds.zarr")
    cases = {
        "uncovered": (["1"] + good[1:], r"obs, line 1: label 0 is relevant in .*d\.txt, line 2, but not observed"),
        "out of range": (good[:3] + ["0,9"] + good[4:], r"obs, line 4: label id 9 is outside \[0, 4\)"),
        "not an id": (good[:5] + ["1,x"] + good[6:], r"obs, line 6: label id 'x' is not an integer"),
        "short": (good[:7], r"obs, line 8: the file ends after 7 lines, but .*d\.txt has more rows \(its line 9\)"),
        "long": (good + ["2"], r"obs, line 11: more lines than the 10 rows"),
    }
    for name, (lines, message) in cases.items():
        (tmp_path / "d.obs").write_text("\n".join(lines) + "\n")
        with pytest.raises(ParseError, match=message):
            ingest(str(tmp_path / "d.txt"), url, observed=str(tmp_path / "d.obs"), block_rows=4)
        assert not (tmp_path / "ds.zarr").exists(), name
    with pytest.raises(ValueError, match="one file of observed entries per source"):
        ingest(str(tmp_path / "d.txt"), url, observed=[str(tmp_path / "d.obs")] * 2)
    with pytest.raises(FileNotFoundError, match="no such file of observed entries"):
        ingest(str(tmp_path / "d.txt"), url, observed=str(tmp_path / "none.obs"))


def test_cli_ingest_observed_one_based(tmp_path, capsys):
    from xmldask.cli import main

    rng = np.random.default_rng(5)
    X = sp.random(20, 5, density=0.5, format="csr", random_state=rng, dtype=np.float32)
    X.data[:] = 1
    Y = sp.csr_matrix((rng.random((20, 6)) < 0.3).astype(np.float32))
    O = _mask_for(Y, 6)
    body = "".join(",".join(str(j + 1) for j in Y[i].indices) + " " + " ".join(f"{j + 1}:1" for j in X[i].indices)
                   + "\n" for i in range(20))
    (tmp_path / "e.txt").write_text("20 5 6\n" + body)
    (tmp_path / "e.obs").write_text("".join(",".join(str(j + 1) for j in O[i].indices) + "\n" for i in range(20)))
    url = str(tmp_path / "ds.zarr")
    assert main(["ingest", str(tmp_path / "e.txt"), "--out", url, "--one-based", "--observed",
                 str(tmp_path / "e.obs"), "--no-progress"]) == 0
    capsys.readouterr()
    ds = open_dataset(url)
    assert (to_scipy(ds.observed) != O).nnz == 0 and (to_scipy(ds.Y) != Y).nnz == 0
