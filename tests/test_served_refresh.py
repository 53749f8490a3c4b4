"""The scheduled refresh as users serve it: a real ``prefect server``, ``python -m flows.deploy``, and
``prefect deployment run`` (the user guide's commands, docs/guide.md), each in its own process.

Slow (a server start and two flow runs, about two minutes on 2 cores); ``.ci/run`` runs it.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from xmldask.datasets import write_synthetic_text

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[1]
PREFECT = str(Path(sys.executable).with_name("prefect"))
DEPLOYMENT = "xmldask-refresh/xmldask-refresh"
#: seconds to wait for the server to answer, the deployment to be registered, a flow run to end
SERVER_START, REGISTER, RUN = 240, 120, 600


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _stop(proc: subprocess.Popen) -> None:
    """Stop a process and its children (each was started in its own session)."""
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def _wait(what: str, check, timeout: float, proc: subprocess.Popen, log: Path) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if check():
            return
        if proc.poll() is not None:
            pytest.fail(f"{what}: the process ended with {proc.returncode}:\n{log.read_text()[-3000:]}")
        time.sleep(1)
    pytest.fail(f"{what}: not within {timeout} s:\n{log.read_text()[-3000:]}")


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """A Prefect server on a free port with its own home, and the refresh deployment served against it."""
    root = tmp_path_factory.mktemp("served")
    port = _free_port()
    env = {key: value for key, value in os.environ.items() if not key.startswith("PREFECT_")}
    env.update(PREFECT_HOME=str(root / "prefect-home"), PREFECT_API_URL=f"http://127.0.0.1:{port}/api",
               PREFECT_SERVER_ANALYTICS_ENABLED="false", DO_NOT_TRACK="1", XMLDASK_STORAGE=str(root / "storage"))
    logs = {name: root / f"{name}.log" for name in ("server", "deploy")}
    server = subprocess.Popen([PREFECT, "server", "start", "--host", "127.0.0.1", "--port", str(port)], env=env,
                              stdout=logs["server"].open("w"), stderr=subprocess.STDOUT, start_new_session=True)
    procs = [server]
    try:
        _wait("prefect server start", lambda: _api_health(port), SERVER_START, server, logs["server"])
        test = write_synthetic_text(str(root / "test.txt.gz"), n_samples=300, n_features=500, n_labels=40, seed=0,
                                    split="test")
        deploy = subprocess.Popen(
            [sys.executable, "-m", "flows.deploy", "--test", test, "--cron", "0 0 1 1 *",
             "--n-components", "8", "--n-random-features", "200", "--max-epochs", "2"],
            cwd=REPO, env=env, stdout=logs["deploy"].open("w"), stderr=subprocess.STDOUT, start_new_session=True)
        procs.append(deploy)

        def registered() -> bool:
            return subprocess.run([PREFECT, "deployment", "inspect", DEPLOYMENT], env=env,
                                  capture_output=True).returncode == 0

        _wait("python -m flows.deploy", registered, REGISTER, deploy, logs["deploy"])
        yield {"env": env, "root": root, "storage": root / "storage", "logs": logs, "procs": procs}
    finally:
        for proc in reversed(procs):
            _stop(proc)


def _api_health(port: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/api/health", timeout=5) as response:
            return response.status == 200
    except OSError:
        return False


def _run_deployment(served) -> subprocess.CompletedProcess:
    """``prefect deployment run NAME --watch``: one run now, watched until it ends (exit 0 iff Completed)."""
    return subprocess.run([PREFECT, "deployment", "run", DEPLOYMENT, "--watch", "--watch-timeout", str(RUN)],
                          env=served["env"], capture_output=True, text=True, timeout=RUN + 60)


def test_served_refresh_ingests_promotes_and_quarantines(served):
    env, storage = served["env"], served["storage"]
    inspected = subprocess.run([PREFECT, "deployment", "inspect", DEPLOYMENT], env=env, capture_output=True,
                               text=True).stdout
    assert "0 0 1 1 *" in inspected and "flows.refresh.refresh" in inspected  # the cron schedule, the module
    incoming = storage / "refresh" / "incoming"
    incoming.mkdir(parents=True)
    write_synthetic_text(str(incoming / "part-000.txt.gz"), n_samples=1500, n_features=500, n_labels=40, seed=0,
                         split="train")

    first = _run_deployment(served)
    log = served["logs"]["deploy"].read_text()
    assert first.returncode == 0 and "Completed" in first.stdout, first.stdout + first.stderr + log[-3000:]
    current = json.loads((storage / "refresh" / "current.json").read_text())
    assert Path(current["model"]).parent == storage / "refresh" / "models" and Path(current["model"]).is_dir()
    assert current["metrics"]["P@1"] > 0.2
    ledger = json.loads((storage / "refresh" / "ledger.json").read_text())
    assert [(e["name"], e["status"], e["rows"]) for e in ledger["files"].values()] == [
        ("part-000.txt.gz", "ingested", 1500)]

    (incoming / "bad.txt").write_text("1500 500 40\nthis is not an XC row\n")
    second = _run_deployment(served)
    assert second.returncode == 0 and "Completed" in second.stdout, second.stdout + second.stderr
    quarantine = storage / "refresh" / "quarantine"
    assert (quarantine / "bad.txt").exists() and not (incoming / "bad.txt").exists()
    assert "line 2" in (quarantine / "bad.txt.error.txt").read_text()
    ledger = json.loads((storage / "refresh" / "ledger.json").read_text())
    assert sorted(e["status"] for e in ledger["files"].values()) == ["ingested", "quarantined"]
    assert json.loads((storage / "refresh" / "current.json").read_text()) == current  # nothing new: unchanged
    shutil.rmtree(incoming)


def test_ctrl_c_stops_serving_with_status_130_and_one_line(served):
    """Last in this module: it stops the served deployment (Prefect pauses it)."""
    deploy = served["procs"][-1]
    log = served["logs"]["deploy"]
    before = len(log.read_text())
    os.killpg(deploy.pid, signal.SIGINT)  # as a terminal does
    assert deploy.wait(timeout=10) == 130
    said = log.read_text()[before:]
    assert "interrupted; the deployment 'xmldask-refresh' is paused" in said and "Traceback" not in said, said


def test_serving_without_a_prefect_server_is_refused(tmp_path):
    env = {key: value for key, value in os.environ.items() if not key.startswith("PREFECT_")}
    env.update(PREFECT_HOME=str(tmp_path / "prefect-home"))
    done = subprocess.run([sys.executable, "-m", "flows.deploy", "--test", str(tmp_path / "test.zarr")], cwd=REPO,
                          env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stderr
    assert "a schedule needs a Prefect server: run `prefect server start`" in done.stderr, done.stderr
