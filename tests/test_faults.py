"""Fault injection: concurrent writers, lost and truncated chunks, values that do not fit, hostile paths.

Each test makes one fault happen for real (a second process, a deleted or cut file, an overflowing
number, a path that must not be replaced) and checks that xmldask refuses it with a clear message and
leaves the data as it was, never a store that reads wrong.
"""

from __future__ import annotations

import gzip
import json
import os
import re
import resource
import subprocess
import sys
from pathlib import Path

import dask.array as da
import numpy as np
import pytest
import scipy.sparse as sp
import zarr

from xmldask.io import ingest
from xmldask.io.parse import ParseError
from xmldask.store import StoreError, _fs, open_dataset, open_predictions, to_scipy, write_predictions
from xmldask.store.integrity import LOCK_NAME, WriterLock
from xmldask.store.models import open_model_store, write_model_store

N_FEATURES, N_LABELS = 40, 12


def _rows(n: int, seed: int) -> list[str]:
    """``n`` libsvm rows with sorted unique ids (some rows without labels)."""
    rng = np.random.default_rng(seed)
    lines = []
    for _ in range(n):
        labels = np.unique(rng.integers(0, N_LABELS, rng.integers(0, 3)))
        feats = np.unique(rng.integers(0, N_FEATURES, rng.integers(1, 6)))
        text = " ".join(f"{f}:{rng.random() + 0.5:.4f}" for f in feats)
        lines.append((",".join(map(str, labels)) + " " + text) if len(labels) else " " + text)
    return lines


def _text(path: Path, lines: list[str]) -> str:
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return str(path)


def _options():
    return {"n_features": N_FEATURES, "n_labels": N_LABELS}


def _cli(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    return subprocess.run([sys.executable, "-m", "xmldask.cli", *args], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=300)


def _same_dataset(url: str, reference: str) -> None:
    a, b = open_dataset(url), open_dataset(reference)
    assert (a.n_samples, a.n_features, a.n_labels) == (b.n_samples, b.n_features, b.n_labels)
    for name in ("X", "Y"):
        x, y = to_scipy(getattr(a, name)), to_scipy(getattr(b, name))
        assert (x != y).nnz == 0, name
    np.testing.assert_array_equal(a.label_counts, b.label_counts)


# ---------------------------------------------------------------- one writer at a time


@pytest.fixture
def base(tmp_path):
    """A dataset of 300 rows and two more files to append (3000 rows each)."""
    files = [_text(tmp_path / f"part{i}.txt", _rows(n, seed=i)) for i, n in enumerate((300, 3000, 3000))]
    url = str(tmp_path / "ds.zarr")
    ingest(files[0], url, block_rows=256, **_options())
    return url, files


@pytest.mark.slow
def test_two_concurrent_appends_one_wins_the_result_equals_a_serial_ingest(base, tmp_path):
    _, files = base
    # files large enough (about a second of ingest each) that the two appends overlap; whatever the timing,
    # every outcome must be serial-equivalent
    files = files[:1] + [_text(tmp_path / f"big{i}.txt", _rows(20_000, seed=10 + i)) for i in range(2)]
    for attempt in range(2):
        target = str(tmp_path / f"race{attempt}.zarr")
        ingest(files[0], target, block_rows=256, **_options())
        procs = [subprocess.Popen([sys.executable, "-m", "xmldask.cli", "ingest", path, "--out", target, "--append",
                                   "--block-rows", "256", "--no-progress"], cwd=tmp_path, stdout=subprocess.PIPE,
                                  stderr=subprocess.PIPE, text=True,
                                  env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])})
                 for path in files[1:]]
        results = [(p.wait(timeout=300), p.stderr.read()) for p in procs]
        for p in procs:
            p.stdout.close()
            p.stderr.close()
        codes = [code for code, _ in results]
        assert 0 in codes, results
        for code, err in results:
            if code:
                assert code == 2 and ("being written by" in err or "changed by another writer" in err), err
        applied = [s["path"] for s in open_dataset(target).meta["sources"]]
        assert applied[0] == files[0] and sorted(applied[1:]) == sorted(p for p, (c, _) in zip(files[1:], results)
                                                                         if c == 0)
        reference = str(tmp_path / f"serial{attempt}.zarr")
        ingest(applied, reference, block_rows=256, **_options())
        _same_dataset(target, reference)
        assert not (Path(target) / LOCK_NAME).exists()


def test_append_refused_while_another_live_writer_holds_the_lock(base, tmp_path):
    url, files = base
    before = open_dataset(url).meta
    with WriterLock(url):  # this test process is the live writer
        result = _cli("ingest", files[1], "--out", url, "--append", "--no-progress", cwd=tmp_path)
    assert result.returncode == 2
    assert "is being written by process" in result.stderr and str(os.getpid()) in result.stderr
    assert open_dataset(url).meta == before
    assert not (Path(url) / LOCK_NAME).exists()


def test_lock_of_a_killed_writer_is_taken_over(base, tmp_path):
    url, files = base
    # a process that takes the lock and dies without releasing it (as under kill -9)
    code = f"from xmldask.store.integrity import WriterLock; import os; WriterLock({url!r}).acquire(); os._exit(0)"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
    assert (Path(url) / LOCK_NAME).exists()
    ds = ingest(files[1], url, append=True, block_rows=256)
    assert ds.n_samples == 3300
    reference = str(tmp_path / "serial.zarr")
    ingest(files[:2], reference, block_rows=256, **_options())
    _same_dataset(url, reference)


def test_commit_refused_when_the_dataset_changed_underneath(base):
    from xmldask.store.dataset import DatasetWriter

    url, _ = base
    writer = DatasetWriter.append(url, block_rows=256)
    writer.write(sp.csr_matrix((1, N_FEATURES), dtype=np.float32), sp.csr_matrix((1, N_LABELS), dtype=np.float32))
    group = zarr.open_group(url, mode="r+")  # another writer that ignored the lock committed meanwhile
    group.attrs.update({"xmldask": {**dict(group.attrs)["xmldask"], "generation": "someone-else"}})
    with pytest.raises(StoreError, match="changed by another writer"):
        with writer:
            writer.commit()
    assert not (Path(url) / LOCK_NAME).exists()


# ---------------------------------------------------------------- lost and damaged chunks


@pytest.mark.slow
@pytest.mark.parametrize("key, damage", [(key, damage) for key in ("X/indices/c/0", "X/data/c/0", "Y/indptr/c/0")
                                          for damage in ("delete", "truncate")] + [("X/indptr/zarr.json", "delete")])
def test_dataset_with_a_lost_or_cut_chunk_is_refused(base, tmp_path, key, damage):
    url, _ = base
    path = Path(url) / key
    if damage == "delete":
        path.unlink()
    else:
        path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    expected = "is missing" if damage == "delete" else "bytes"
    with pytest.raises(StoreError, match=f"{url}.*damaged: {key}.*{expected}.*ingest"):
        open_dataset(url)
    result = _cli("info", url, cwd=tmp_path)
    assert result.returncode == 2 and key in result.stderr, result.stderr
    with pytest.raises(StoreError, match="damaged"):  # an append is refused as well
        ingest(base[1][1], url, append=True)


def _model(url: str) -> None:
    rng = np.random.default_rng(0)
    write_model_store(url, class_name="EmbeddingClassifier", model_version=1, params={}, fitted={},
                      arrays={"W": rng.random((300, 20), dtype=np.float32), "Q": rng.random((20, 7))})


@pytest.mark.parametrize("key", ["W/zarr.json", "W/c/0/0", "Q/c/0/0"])
def test_model_store_with_a_lost_chunk_or_metadata_is_refused(tmp_path, key):
    url = str(tmp_path / "model.zarr")
    _model(url)
    open_model_store(url, model_version=1)
    (Path(url) / key).unlink()
    with pytest.raises(StoreError, match=f"damaged: {key} is missing.*train"):
        open_model_store(url, model_version=1)


def test_model_store_cut_chunk_refused_not_segfault(tmp_path):
    url = str(tmp_path / "model.zarr")
    _model(url)
    path = Path(url) / "W/c/0/0"
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    with pytest.raises(StoreError, match="W/c/0/0 has .* bytes"):
        open_model_store(url, model_version=1)


def test_model_store_layout_version_is_checked(tmp_path):
    url = str(tmp_path / "model.zarr")
    _model(url)
    group = zarr.open_group(url, mode="r+")
    group.attrs.update({"xmldask": {**dict(group.attrs)["xmldask"], "layout_version": 99}})
    with pytest.raises(StoreError, match="layout version 99"):
        open_model_store(url, model_version=1)


def test_prediction_store_with_a_lost_chunk_is_refused(tmp_path):
    url = str(tmp_path / "pred.zarr")
    labels = da.from_array(np.arange(40, dtype=np.int32).reshape(20, 2) % 5, chunks=(8, 2))
    write_predictions(url, labels, labels.astype(np.float32), n_labels=5)
    open_predictions(url)
    (Path(url) / "labels/c/1/0").unlink()
    with pytest.raises(StoreError, match="damaged: labels/c/1/0 is missing.*predict again"):
        open_predictions(url)


def test_failed_append_restores_the_rewritten_chunks(base):
    """An append rewrites the shard holding the committed end; a failing append puts it back byte for byte."""
    url, files = base
    before = {p.relative_to(url): p.read_bytes() for p in Path(url).rglob("*") if p.is_file()}
    bad = _text(Path(files[1]).with_name("bad.txt"), _rows(2500, seed=9) + ["1 3:x"])
    with pytest.raises(ParseError):
        ingest(bad, url, append=True, batch_bytes=4096)
    open_dataset(url)
    after = {p.relative_to(url): p.read_bytes() for p in Path(url).rglob("*") if p.is_file()}
    for key, data in before.items():
        if key.name != "zarr.json":  # array metadata may record the longer shape; readers ignore it
            assert after[key] == data, key


# ---------------------------------------------------------------- values that do not fit the store


@pytest.mark.parametrize("line, expected", [
    ("1 3000000000:1.0", "feature id 3e\\+09 is out of range.*int32"),
    ("3000000000 3:1.0", "label id 3e\\+09 is out of range.*int32"),
    ("1 3:1e39", "feature value 1e\\+39 does not fit float32"),
    ("1 3:-1e39", "feature value -1e\\+39 does not fit float32"),
])
def test_values_beyond_the_store_types_are_refused(tmp_path, line, expected):
    path = _text(tmp_path / "data.txt", ["0 1:1.0", line])
    out = str(tmp_path / "ds.zarr")
    with pytest.raises(ParseError, match=f"data.txt, line 2: {expected}"):
        ingest(path, out)
    assert not list(tmp_path.glob("*.zarr*")) and not list(tmp_path.glob(".*partial*"))


def test_absurd_header_refused_before_allocation(tmp_path):
    path = _text(tmp_path / "data.txt", ["1 20 1000000000000", "0 1:1.0"])
    with pytest.raises(ParseError, match="line 1: the header gives n_labels = 1000000000000 does not fit"):
        ingest(path, str(tmp_path / "ds.zarr"))
    assert [p.name for p in tmp_path.iterdir()] == ["data.txt"]


@pytest.mark.slow
def test_two_billion_labels_fit_and_cost_only_the_labels_used(tmp_path):
    """2e9 labels fit int32: counting them keeps only the labels seen (the dense vector would be 16 GB)."""
    path = _text(tmp_path / "data.txt", ["3 5 2000000000", "7 1:1.0", "1999999999 2:1.0", "7,12 3:1"])
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    ds = ingest(path, str(tmp_path / "ds.zarr"))
    grown = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - before
    assert ds.n_labels == 2_000_000_000 and ds.meta["nnz_labels"] == 4
    assert grown < 200e6
    counts = zarr.open_group(ds.url, mode="r")[ds.meta["label_counts_array"]]
    assert counts[7] == 2 and counts[12] == 1 and counts[1_999_999_999] == 1 and counts[8] == 0
    ds = ingest(_text(tmp_path / "more.txt", ["3 5 2000000000", "7 1:1", " 2:1", "5 1:2"]), ds.url, append=True)
    counts = zarr.open_group(ds.url, mode="r")[ds.meta["label_counts_array"]]
    assert counts[7] == 3 and counts[5] == 1 and counts[1_999_999_999] == 1


@pytest.mark.parametrize("gz", [False, True])
def test_byte_order_mark_on_line_one_is_accepted(tmp_path, gz):
    data = "\ufeff2 5 3\n0,2 1:1.5 3:2\n 4:1\n".encode()
    path = tmp_path / ("bom.txt.gz" if gz else "bom.txt")
    path.write_bytes(gzip.compress(data) if gz else data)
    ds = ingest(str(path), str(tmp_path / "ds.zarr"))
    assert (ds.n_samples, ds.n_features, ds.n_labels) == (2, 5, 3)
    assert to_scipy(ds.Y).toarray().tolist() == [[1, 0, 1], [0, 0, 0]]


@pytest.mark.parametrize("line", ["0 1:1 " + "x" * 5_000_000, "0 " + "9" * 5_000_000 + ":1",
                                  "y" * 5_000_000 + " 1:1"])
def test_huge_garbage_token_is_clipped_in_the_message(tmp_path, line):
    path = _text(tmp_path / "data.txt", [line])
    with pytest.raises(ParseError) as info:
        ingest(path, str(tmp_path / "ds.zarr"))
    assert "data.txt, line 1" in str(info.value) and len(str(info.value)) < 600


# ---------------------------------------------------------------- paths that must not be replaced


def test_overwrite_never_replaces_a_plain_directory_or_file(base, tmp_path):
    _, files = base
    folder = tmp_path / "photos"
    folder.mkdir()
    (folder / "cat.jpg").write_bytes(b"precious")
    for target in (folder, Path(files[2])):
        with pytest.raises(FileExistsError, match="--overwrite replaces only a dataset store"):
            ingest(files[1], str(target), overwrite=True, **_options())
    assert (folder / "cat.jpg").read_bytes() == b"precious" and Path(files[2]).stat().st_size > 0
    result = _cli("ingest", files[1], "--out", str(folder), "--overwrite", "--no-progress", cwd=tmp_path)
    assert result.returncode == 2 and "not an xmldask store" in result.stderr


def test_overwrite_never_replaces_a_store_of_another_kind(base, tmp_path):
    url, _ = base
    labels = da.zeros((4, 2), dtype=np.int32, chunks=2)
    with pytest.raises(FileExistsError, match="is a dataset store; --overwrite replaces only a predictions store"):
        write_predictions(url, labels, labels.astype(np.float32), n_labels=3, overwrite=True)
    open_dataset(url)


def test_train_and_predict_never_write_over_their_inputs(base, tmp_path):
    url, _ = base
    before = open_dataset(url).meta
    result = _cli("train", url, "--out", url, "--overwrite", "--workers", "1", cwd=tmp_path)
    assert result.returncode == 2 and "is also an input of this command" in result.stderr, result.stderr
    from xmldask import jobs

    for out in (url, url + "/inner"):
        with pytest.raises(FileExistsError, match="input"):
            jobs.predict(str(tmp_path / "model.zarr"), url, out, overwrite=True)
    with pytest.raises(FileExistsError, match="input"):
        ingest(str(Path(url) / "zarr.json"), url, overwrite=True)
    assert open_dataset(url).meta == before


def test_replacement_interrupted_between_its_moves_is_recovered(base, tmp_path, monkeypatch):
    url, files = base
    before = open_dataset(url).meta
    moves = []
    real = _fs._move

    def die_on_second_move(fs, src, dst, local):
        moves.append(dst)
        if len(moves) == 2:
            raise KeyboardInterrupt("killed between the two moves")
        real(fs, src, dst, local)

    monkeypatch.setattr(_fs, "_move", die_on_second_move)
    with pytest.raises(KeyboardInterrupt):
        ingest(files[1], url, overwrite=True, block_rows=256, **_options())
    monkeypatch.undo()
    assert not Path(url).exists() and len(list(tmp_path.glob(".ds.zarr.replaced-*"))) == 1
    assert open_dataset(url).meta == before  # the opener moved the replaced store back
    assert not list(tmp_path.glob(".ds.zarr.replaced-*"))
    # a leftover copy beside a complete store is deleted by the next write
    leftover = tmp_path / ".ds.zarr.replaced-0123456789ab"
    leftover.mkdir()
    (leftover / "zarr.json").write_text(json.dumps({"zarr_format": 3, "node_type": "group",
                                                    "attributes": {"xmldask": {"kind": "dataset"}}}))
    ingest(files[1], url, overwrite=True, block_rows=256, **_options())
    assert not leftover.exists() and open_dataset(url).n_samples == 3000


def test_store_at_a_path_with_spaces_and_unicode(base, tmp_path):
    _, files = base
    out = str(tmp_path / "dir with space" / "données ü.zarr")
    ds = ingest(files[0], out, **_options())
    assert open_dataset(out).n_samples == ds.n_samples == 300


# ---------------------------------------------------------------- the refresh flow's pick-up


def test_quarantine_never_overwrites_an_earlier_file_of_the_same_name(tmp_path):
    from flows.refresh import _quarantine

    folder = str(tmp_path / "quarantine")
    moved = []
    for round_ in range(3):
        incoming = tmp_path / f"incoming{round_}"
        incoming.mkdir()
        moved.append(_quarantine(_text(incoming / "new.txt.gz", [f"content {round_}"]), folder, f"error {round_}"))
    assert [Path(m).name for m in moved] == ["new.txt.gz", "new-2.txt.gz", "new-3.txt.gz"]
    for round_, path in enumerate(moved):
        assert Path(path).read_text() == f"content {round_}\n"
        assert Path(path + ".error.txt").read_text() == f"error {round_}\n"


@pytest.mark.parametrize("error, retried", [
    (ParseError("bad token", path="a.txt", line=3), False),
    (StoreError("damaged"), False),
    (OSError("connection reset"), True),
])
def test_pick_up_retries_only_what_may_pass(error, retried):
    from prefect.states import Failed

    from flows.refresh import _io_failure, pick_up
    from xmldask.store import StoreBusyError

    assert pick_up.retry_condition_fn is _io_failure
    assert _io_failure(pick_up, None, Failed(data=error)) is retried
    assert _io_failure(pick_up, None, Failed(data=StoreBusyError("busy"))) is True


# ---------------------------------------------------------------- clusters that cannot work


@pytest.mark.timeout(60)  # a wait past the 2 s timeout would hang here
def test_scheduler_address_where_something_else_listens_fails_within_the_timeout():
    import socket
    import threading

    from xmldask.cluster import cluster

    server = socket.create_server(("127.0.0.1", 0))
    accepted = []
    threading.Thread(target=lambda: accepted.append(server.accept()), daemon=True).start()
    address = f"tcp://127.0.0.1:{server.getsockname()[1]}"
    try:
        with pytest.raises(ConnectionError, match="no Dask scheduler answered within 2 s.*not a Dask scheduler"):
            with cluster(address, timeout=2):
                pass
    finally:
        server.close()
    assert accepted  # it connected, then gave up on the silent peer


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_worker_memory_limit_below_one_task_is_refused_before_the_first_pass(tmp_path):
    from xmldask.cluster import cluster
    from xmldask.datasets import make_synthetic
    from xmldask.models import EmbeddingClassifier

    ds = make_synthetic(str(tmp_path / "t.zarr"), n_samples=2000, n_features=500, n_labels=20_000, seed=0)
    with cluster(n_workers=1, threads_per_worker=1, memory_limit="300MB", dashboard_address=None) as client:
        with pytest.raises(ValueError, match="blocks of 2000 rows.*1 thread.*286.10 MiB.*--memory-limit"):
            EmbeddingClassifier(n_components=8, max_epochs=1).fit(ds.X, ds.Y)
        assert not client.run(lambda: 0) == {}  # the worker was never lost


def _centroid_model(tmp_path):
    from xmldask.models.centroid import LabelCentroidClassifier
    from xmldask.xmc import make_xmc

    data = make_xmc(str(tmp_path / "data.zarr"), n_samples=400, n_features=300, n_labels=60, seed=0)
    return LabelCentroidClassifier(leaf_labels=10, beam=2).fit(data.X, data.Y), data.url


def test_model_with_a_non_finite_weight_is_never_saved(tmp_path):
    model, _ = _centroid_model(tmp_path)
    model.W_.data[[0, 3]] = [np.nan, np.inf]
    url = tmp_path / "model.zarr"
    with pytest.raises(ValueError, match=r"non-finite values \(W: 2\).*nothing was written"):
        model.save(str(url))
    assert not url.exists() and not list(tmp_path.glob(".model.zarr*"))


def test_model_store_with_a_nan_written_into_it_is_refused_at_load(tmp_path):
    """One NaN written into a saved model's weights, the inventory rewritten to match (a store damaged by another
    program): load and predict refuse it and name the array; before, every score was NaN with exit 0."""
    from xmldask.models import load_model
    from xmldask.store.integrity import INVENTORY_ATTR, record_inventory

    model, data = _centroid_model(tmp_path)
    url = str(tmp_path / "model.zarr")
    model.save(url)
    group = zarr.open_group(url, mode="r+")
    group["W/data"][0] = np.nan
    group.attrs[INVENTORY_ATTR] = record_inventory(url)
    with pytest.raises(StoreError, match=r"model.zarr: the model holds non-finite values \(W: 1\)"):
        load_model(url)
    result = _cli("predict", url, data, "--out", str(tmp_path / "p.zarr"), cwd=tmp_path)
    assert result.returncode == 2 and "non-finite values (W: 1)" in result.stderr, result.stderr
    assert "Traceback" not in result.stderr and not (tmp_path / "p.zarr").exists()


def _rewrite(url: str, change) -> None:
    """``change(group)`` on a store, then its inventory recorded again: damage that the sizes cannot show."""
    from xmldask.store.integrity import INVENTORY_ATTR, record_inventory

    group = zarr.open_group(url, mode="r+")
    change(group)
    group.attrs[INVENTORY_ATTR] = record_inventory(url)


def _set(array: str, index: int, value):
    def change(group):
        group[array][index] = value
    return change


def _retype(group):
    path = Path(group.store.root) / "X" / "data" / "zarr.json"
    meta = json.loads(path.read_text())
    meta["data_type"] = "int32"
    path.write_text(json.dumps(meta))


@pytest.mark.parametrize("change, expected", [
    (_set("X/indices", 5, 200), r"damaged in rows 0..256: column id 200 outside the 40 columns recorded"),
    (_set("X/indices", 7, -3), r"damaged in rows 0..256: column id -3 outside"),
    (_set("X/indices", 9, 2_000_000), r"column id 2,000,000 outside"),
    (_set("Y/indptr", 3, 1), r"Y is damaged in rows 0..256: the row pointers decrease at row"),
    (_set("X/indptr", 300, 10**9), r"X is damaged in rows 256..300: row pointers .* outside the"),
    (_retype, r"data is 1-d int32, not the 1-d float array a CSR store holds"),
])
def test_stored_ids_and_pointers_are_checked_against_the_shape_as_blocks_are_read(base, tmp_path, change, expected):
    """Ids beyond the recorded features, decreasing row pointers, a retyped array (the sizes rewritten to match):
    the block that holds them is refused as it is read, with the store and the rows; before, wrong scores with
    exit 0 or a segmentation fault in SciPy's kernels."""
    url, _ = base
    _rewrite(url, change)
    data = open_dataset(url)
    with pytest.raises(StoreError, match=expected):
        to_scipy(data.X), to_scipy(data.Y)
    result = _cli("train", url, "--out", str(tmp_path / "m.zarr"), "--no-search", cwd=tmp_path)
    assert result.returncode == 2 and re.search(expected, result.stderr), result.stderr[-2000:]
    assert "Traceback" not in result.stderr and not (tmp_path / "m.zarr").exists()


def _flip(path: Path, at: float = 0.5) -> None:
    """One bit flipped inside a file (its size unchanged: the inventory of sizes cannot see it)."""
    raw = bytearray(path.read_bytes())
    raw[int(len(raw) * at)] ^= 0x10
    path.write_bytes(bytes(raw))


@pytest.mark.parametrize("key", ["X/data/c/0", "X/indices/c/0", "Y/indptr/c/0"])
def test_a_bit_flipped_in_a_dataset_chunk_fails_its_checksum_named(base, tmp_path, key):
    url, _ = base
    _flip(Path(url) / key)
    data = open_dataset(url)  # the sizes are as recorded
    with pytest.raises(StoreError, match=rf"{url}.*: {key.split('/c/')[0]} fails its checksum in .*restore the store"):
        to_scipy(data.X), to_scipy(data.Y)
    result = _cli("train", url, "--out", str(tmp_path / "m.zarr"), "--no-search", cwd=tmp_path)
    assert result.returncode == 2 and "fails its checksum" in result.stderr, result.stderr[-2000:]
    assert "Traceback" not in result.stderr


def test_a_bit_flipped_in_a_model_chunk_fails_its_checksum_named(tmp_path):
    from xmldask.models import load_model

    model, data = _centroid_model(tmp_path)
    url = str(tmp_path / "model.zarr")
    model.save(url)
    _flip(Path(url) / "W" / "data" / "c" / "0", at=0.3)
    with pytest.raises(StoreError, match=r"model.zarr: W/data fails its checksum"):
        load_model(url)
    result = _cli("predict", url, data, "--out", str(tmp_path / "p.zarr"), cwd=tmp_path)
    assert result.returncode == 2 and "W/data fails its checksum" in result.stderr, result.stderr[-2000:]


def _edit_json(path: Path, change) -> None:
    meta = json.loads(path.read_text())
    change(meta)
    path.write_text(json.dumps(meta))


@pytest.mark.parametrize("key, change, expected", [
    ("X/data/zarr.json", lambda m: m.update(data_type="int32"),
     r"X/data/zarr.json \(the array's type, chunks or codecs\) was edited"),
    ("zarr.json", lambda m: m["attributes"]["xmldask"].update(nnz=5),
     r"the root attributes \(zarr.json\) were edited"),
    ("zarr.json", lambda m: m["attributes"]["xmldask"].update(n_features=50),
     r"the root attributes \(zarr.json\) were edited"),
    ("zarr.json", lambda m: m["attributes"]["xmldask"].update(label_counts_array="/etc/passwd"),
     r"the root attributes \(zarr.json\) were edited"),
])
def test_edited_array_metadata_and_root_attributes_are_refused(base, tmp_path, key, change, expected):
    """What the sizes cannot show: a retyped array (before, predict exit 0 with P@1 0.815 -> 0.579), edited
    sizes and references in the root attributes (printed by info as facts; a KeyError traceback)."""
    url, _ = base
    _edit_json(Path(url) / key, change)
    with pytest.raises(StoreError, match=rf"{url} \(dataset store\) is damaged: {expected}"):
        open_dataset(url)
    result = _cli("info", url, cwd=tmp_path)
    assert result.returncode == 2 and "was edited" in result.stderr or "were edited" in result.stderr, result.stderr
    assert "Traceback" not in result.stderr


def test_label_counts_reference_outside_the_store_is_refused(base):
    """A reference rewritten with the inventory to match (another program): it must name an array of the store."""
    url, _ = base
    group = zarr.open_group(url, mode="r+")
    attrs = dict(group.attrs)
    attrs["xmldask"] = {**attrs["xmldask"], "label_counts_array": "X/indptr"}
    from xmldask.store.integrity import commit_attrs

    commit_attrs(group, url, {"xmldask": attrs["xmldask"]}, ["X", "Y"])
    with pytest.raises(StoreError, match=r"label counts array 'X/indptr' is not an array of 12 counts"):
        _ = open_dataset(url).label_counts


def test_evaluate_refuses_predictions_made_from_another_dataset(tmp_path):
    """Before: predictions of one dataset evaluated against another of the same shape, exit 0, P@1 0.052."""
    from xmldask import jobs

    model, data = _centroid_model(tmp_path)
    model_url = model.save(str(tmp_path / "model.zarr"))
    from xmldask.xmc import make_xmc

    other = make_xmc(str(tmp_path / "other.zarr"), n_samples=400, n_features=300, n_labels=60, seed=1).url
    jobs.predict(model_url, data, str(tmp_path / "p.zarr"), top_k=5)
    assert jobs.evaluate(str(tmp_path / "p.zarr"), data)["n_samples"] == 400  # its own dataset: evaluated
    result = _cli("evaluate", str(tmp_path / "p.zarr"), other, cwd=tmp_path)
    assert result.returncode == 2, result.stderr
    assert "predictions made from" in result.stderr and "not from" in result.stderr and other in result.stderr


# ---------------------------------------------------------------- the smaller cases


def test_a_users_directory_named_like_a_replaced_store_is_never_touched(base, tmp_path):
    """Before: a read-only ``xmldask info X`` deleted ``.X.replaced-1`` (and with only that, moved it to X)."""
    url, _ = base
    mine = tmp_path / ".ds.zarr.replaced-1"
    mine.mkdir()
    (mine / "notes.txt").write_text("mine")
    assert _cli("info", url, cwd=tmp_path).returncode == 0
    assert (mine / "notes.txt").read_text() == "mine"
    alone = tmp_path / "alone"
    alone.mkdir()
    (alone / ".x.zarr.replaced-1").mkdir()
    result = _cli("info", str(alone / "x.zarr"), cwd=tmp_path)
    assert result.returncode == 2 and "no dataset store" in result.stderr, result.stderr
    assert (alone / ".x.zarr.replaced-1").is_dir() and not (alone / "x.zarr").exists()


def test_spectrum_never_overwrites_a_users_files_without_overwrite(base, tmp_path):
    url, _ = base
    out = tmp_path / "out"
    out.mkdir()
    (out / "spectrum.csv").write_text("mine")
    result = _cli("spectrum", url, "--out", str(out), "--k", "3", "--no-plot", cwd=tmp_path)
    assert result.returncode == 2 and "spectrum.csv already exists" in result.stderr and "--overwrite" in result.stderr
    assert (out / "spectrum.csv").read_text() == "mine" and not (out / "spectrum.md").exists()
    again = _cli("spectrum", url, "--out", str(out), "--k", "3", "--no-plot", "--overwrite", cwd=tmp_path)
    assert again.returncode == 0, again.stderr
    assert (out / "spectrum.csv").read_text().startswith("rank")


def test_a_lock_file_without_details_is_described_as_such():
    from xmldask.store.integrity import _holder_text

    assert _holder_text({}) == _holder_text(None) == "another writer (its lock file names no process yet)"
    assert _holder_text({"pid": 7, "host": "h", "since": None}) == "process 7 on h"
    assert _holder_text({"pid": 7, "host": "h", "since": "2026-01-01"}) == "process 7 on h since 2026-01-01"


def test_too_few_rows_and_a_negative_seed_are_refused_by_name(tmp_path):
    one = _text(tmp_path / "one.txt", ["0 1:1 2:1"])
    assert _cli("ingest", one, "--out", str(tmp_path / "one.zarr"), cwd=tmp_path).returncode == 0
    result = _cli("train", str(tmp_path / "one.zarr"), "--out", str(tmp_path / "m.zarr"), cwd=tmp_path)
    assert result.returncode == 2 and "has 1 row: training needs at least 2" in result.stderr, result.stderr
    result = _cli("train", str(tmp_path / "one.zarr"), "--out", str(tmp_path / "m.zarr"), "--random-state", "-1",
                  cwd=tmp_path)
    assert result.returncode == 2 and "random_state = -1" in result.stderr and "CancelledError" not in result.stderr


def test_overwrite_never_turns_a_tree_into_a_classifier_or_back(tmp_path):
    from xmldask import jobs

    model, data = _centroid_model(tmp_path)
    tree, clf = str(tmp_path / "tree.zarr"), str(tmp_path / "clf.zarr")
    jobs.tree(data, tree, depth=2, leaf_labels=20, unseen_labels="ignore")
    model.save(clf)
    with pytest.raises(FileExistsError, match="holds a label tree; --overwrite replaces a classifier only by another"):
        jobs.train(data, tree, overwrite=True, model="centroid")
    with pytest.raises(FileExistsError, match="holds a LabelCentroidClassifier model; --overwrite replaces a tree"):
        jobs.tree(data, clf, overwrite=True, depth=2, leaf_labels=20, unseen_labels="ignore")
    assert jobs.train(data, clf, overwrite=True, model="centroid")["model"] == clf  # like by like: replaced


def test_values_that_vanish_in_float32_are_no_stored_entries(tmp_path):
    """Before: 1e-50 (below float32's smallest) and written zeros were stored as explicit zero entries."""
    path = _text(tmp_path / "tiny.txt", ["0 1:1e-50 2:0.5 3:0", "1 1:2"])
    ds = ingest(path, str(tmp_path / "tiny.zarr"))
    X = to_scipy(ds.X)
    assert ds.meta["nnz"] == X.nnz == 2 and (X.data != 0).all()
    np.testing.assert_array_equal(X.toarray(), [[0, 0, 0.5, 0], [0, 2, 0, 0]])


def test_a_feature_id_near_the_int32_limit_is_refused_before_training(tmp_path):
    """Before: accepted, then train died of an 8 GiB MemoryError traceback."""
    path = _text(tmp_path / "far.txt", ["0 1:1 2147483646:1", "1 2:1"])
    assert _cli("ingest", path, "--out", str(tmp_path / "far.zarr"), cwd=tmp_path).returncode == 0
    result = _cli("train", str(tmp_path / "far.zarr"), "--out", str(tmp_path / "m.zarr"), cwd=tmp_path)
    assert result.returncode == 2 and "2,147,483,647 feature columns" in result.stderr, result.stderr[-2000:]
    assert "Traceback" not in result.stderr and "Number the features compactly" in result.stderr


def test_a_truncated_tail_chunk_under_a_dead_writers_lock_is_named(base, tmp_path):
    """A dead writer's lock lets the tail chunks differ in size (its append may have rewritten them); a tail cut
    short is then caught by its checksum, and the error names the store (before: the checksum message alone)."""
    url, _ = base
    code = f"from xmldask.store.integrity import WriterLock; import os; WriterLock({url!r}).acquire(); os._exit(0)"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
    path = Path(url) / "X" / "indices" / "c" / "0"
    path.write_bytes(path.read_bytes()[: path.stat().st_size - 7])
    data = open_dataset(url)  # the lock excuses the tail's size
    with pytest.raises(StoreError, match=rf"{url}: X/indices fails its checksum"):
        to_scipy(data.X)


def test_an_existing_out_is_refused_before_a_cluster_starts_and_a_text_file_gets_the_ingest_hint(base, tmp_path):
    url, files = base
    (tmp_path / "m.zarr").mkdir()
    for command in (["train", url, "--out", str(tmp_path / "m.zarr")],
                    ["predict", url, url, "--out", str(tmp_path / "m.zarr")]):
        result = _cli(*command, cwd=tmp_path)
        assert result.returncode == 2 and "Dask dashboard" not in result.stderr, result.stderr
    result = _cli("info", files[0], cwd=tmp_path)
    assert result.returncode == 2 and "is a file, not a dataset store: ingest it first" in result.stderr


def test_predict_on_data_of_other_features_is_refused_before_a_cluster_starts(tmp_path):
    from xmldask.xmc import make_xmc

    model, data = _centroid_model(tmp_path)  # 300 features
    url = model.save(str(tmp_path / "model.zarr"))
    other = make_xmc(str(tmp_path / "other.zarr"), n_samples=50, n_features=200, n_labels=60, seed=1).url
    result = _cli("predict", url, other, "--out", str(tmp_path / "p.zarr"), cwd=tmp_path)
    assert result.returncode == 2 and "has 200 features but the model" in result.stderr, result.stderr
    assert "Dask dashboard" not in result.stderr
