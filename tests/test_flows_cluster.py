"""The pipeline on a separately started ``dask scheduler`` + 2 ``dask worker`` processes, and with a worker killed."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from test_flows import DIMS, MODEL

from flows.pipeline import pipeline
from xmldask.datasets import write_synthetic_text

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("prefect_harness")]
DASK = str(Path(sys.executable).with_name("dask"))
KEYS = ("P@1", "P@3", "P@5", "nDCG@5", "PSP@5")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def dask_processes(tmp_path):
    """``dask scheduler`` and two single-threaded ``dask worker`` processes (no nanny) on 127.0.0.1."""
    from distributed import Client

    address = f"tcp://127.0.0.1:{_free_port()}"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    procs = [subprocess.Popen([DASK, "scheduler", "--host", "127.0.0.1", "--port", address.rsplit(":", 1)[1],
                               "--no-dashboard"], env=env, cwd=tmp_path, stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL)]
    for i in range(2):
        procs.append(subprocess.Popen([DASK, "worker", address, "--nthreads", "1", "--no-nanny", "--name", f"w{i}",
                                       "--memory-limit", "2GB", "--no-dashboard", "--local-directory", str(tmp_path)],
                                      env=env, cwd=tmp_path, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
    try:
        with Client(address, timeout=30) as client:
            client.wait_for_workers(2, timeout=60)
        yield address, procs
    finally:
        for proc in reversed(procs):
            proc.terminate()
        for proc in procs:
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()


@pytest.fixture
def data(tmp_path) -> dict[str, str]:
    return {split: write_synthetic_text(str(tmp_path / f"{split}.txt.gz"), n_samples=n, split=split, seed=0, **DIMS)
            for split, n in (("train", 1500), ("test", 300))}


def _local_metrics(data, storage) -> dict:
    result = pipeline([data["train"]], [data["test"]], storage=storage, n_workers=1, threads_per_worker=2,
                      processes=False, dashboard_address=None, **MODEL)
    return result["metrics"]


def test_separate_scheduler_gives_the_local_metrics(dask_processes, data, tmp_path):
    address, _ = dask_processes
    remote = pipeline([data["train"]], [data["test"]], storage=str(tmp_path / "remote"), scheduler=address, **MODEL)
    assert all(not rec["reused"] for rec in remote["stages"].values())
    local = _local_metrics(data, str(tmp_path / "local"))
    for key in KEYS:
        assert remote["metrics"][key] == pytest.approx(local[key], rel=1e-5, abs=1e-9), key


def test_worker_killed_mid_stage_the_flow_completes(dask_processes, data, tmp_path, monkeypatch):
    """A worker dies as the train stage starts (killed from inside the stage, so always during it: no race with
    the stage's speed); the scheduler moves the stage's work to the other worker and the flow completes with the
    local metrics."""
    from xmldask import jobs

    address, procs = dask_processes
    storage = tmp_path / "killed"
    train = jobs.train

    def train_after_a_worker_dies(*args, **kwargs):
        if procs[2].poll() is None:
            procs[2].kill()
            procs[2].wait(timeout=30)
        return train(*args, **kwargs)

    monkeypatch.setattr(jobs, "train", train_after_a_worker_dies)
    result = pipeline([data["train"]], [data["test"]], storage=str(storage), scheduler=address, **MODEL)
    assert procs[2].returncode is not None, "the worker was not killed during the train stage"
    local = _local_metrics(data, str(tmp_path / "local"))
    for key in KEYS:
        assert result["metrics"][key] == pytest.approx(local[key], rel=1e-5, abs=1e-9), key
