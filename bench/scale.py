"""The whole pipeline at growing sizes under a per-worker memory limit: time, passes and memory per stage.

For every ``n`` of ``--sizes``, synthetic XC text files (``make_synthetic``'s generator,
:func:`xmldask.datasets.write_synthetic_text`: ``n`` training rows, ``n / 5`` test rows, the
pipeline's knobs) are written once under ``--cache`` (default ``$XMLDASK_STORAGE/bench/scale``, else
``storage/bench/scale``) and reused. Then a fresh process runs the stages of ``python -m
flows.pipeline`` in its order, calling what the stage tasks of :mod:`flows.stage_flows` call (without
Prefect's caching and records, so that each stage is timed alone and the workers are measured between
stages), on one Dask cluster:

- ``ingest-train``, ``ingest-test``: :func:`xmldask.io.ingest` of the text files (in the client
  process, as the pipeline's ingest task; ``--source store`` skips the text files and has the
  generator write the stores directly, with no ingest rows);
- ``spectrum``: :func:`xmldask.embedding.spectrum.compute_spectrum` of ``Y^T Y`` (50 components);
- ``tree`` (``--grow-tree`` only): :func:`xmldask.jobs.tree`; the train stage then fits the tree's
  candidate-restricted classifier, as ``flows.pipeline --grow-tree`` does;
- ``train``: :func:`xmldask.jobs.train` (default ``--model '{"search": null, "kernel": "none", "k":
  16}'``: the embedding classifier, no held-out search, whose 8-11 fits would measure the search
  rather than the scaling; the linear decoder, as the Gaussian kernel's 2000 random features need
  float64 partial sums of 2001 x L per task, which a 256 MiB worker refuses up front with a clear
  error; k = 16, as a CG pass costs nnz x k flops and the largest run must fit a session);
- ``predict``: :func:`xmldask.jobs.predict` (top 10) of the test rows;
- ``evaluate``: :func:`xmldask.jobs.evaluate` (k = 1..10, propensities of the training labels).

The cluster: ``--workers`` (2) single-threaded worker processes with ``--memory-limit`` (256 MiB: an
idle worker holds about 105 MiB of Python, NumPy, SciPy, Dask and Zarr) each,
a ``LocalCluster`` (:func:`xmldask.cluster.cluster`), or with ``--external`` a separately started
``dask scheduler`` and ``--workers`` ``dask worker`` processes (each with a nanny, as on a real
cluster), started and stopped by this script.

Per stage: ``seconds``; ``s_per_mnnz``, seconds per million nonzeros of the matrix the stage reads
(the training ``X`` for the training stages, the test ``X`` for ingest-test and predict, the test
``Y`` for evaluate); ``passes`` where the stage reports them; ``peak_rss_bytes_per_worker``, the
largest ``VmHWM`` of the worker processes, read in the workers (``client.run``) after the stage, the
high-water mark having been reset (``/proc/self/clear_refs``) before it; ``peak_rss_bytes_client``,
the same for the process that drives the stages; ``spilled_bytes``, what the workers wrote to disk
during the stage; ``worker_restarts``, how many worker processes were replaced during the stage
(process ids before and after). ``csr_bytes`` is the size of the training ``X`` and ``Y`` as SciPy
CSR in memory (float32 values, int32 indices, int64 row pointers), ``store_bytes`` that of its store on disk
(compressed); the evaluate row carries the test ``P@1`` and ``P@5``.

``--preset NAME`` (e.g. ``xmc-1m``: a million labels) generates the XMC generator's stores instead
(:func:`xmldask.xmc.make_xmc`, ``--sizes`` training rows, ``--test-rows`` test rows) and trains with the
defaults (``--model '{}'``: the label-centroid tree at that many labels):

    python bench/scale.py --preset xmc-1m --sizes 3000000 --test-rows 20000 --block-rows 32768 \
        --workers 2 --memory-limit 1GiB

    python bench/scale.py [--sizes 100000 1000000] [--workers 2] [--memory-limit 1GiB] [--external]
                          [--grow-tree [--tree-routing fractional|deterministic]] [--stages STAGE ...]
                          [--source text|store] [--json FILE] [--plot FILE.png] [--quick]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _tables import load_line, main_or_child, markdown_table, write_json  # noqa: E402 - bench/ is not a package

#: the generator's knobs of the pipeline's synthetic data (``flows.pipeline.SYNTHETIC_KNOBS``)
KNOBS = {"label_exponent": 2.0}
STAGES = ("ingest-train", "ingest-test", "spectrum", "tree", "train", "predict", "evaluate")
TABLE_KEYS = ["n_samples", "n_labels", "nnz", "csr_bytes", "store_bytes", "stage", "seconds", "s_per_mnnz", "passes",
              "peak_rss_bytes_per_worker", "peak_rss_bytes_client", "spilled_bytes", "worker_restarts",
              "worker_memory_limit_bytes", "n_workers", "cluster", "P@1", "P@5"]


# --------------------------------------------------------------------------------------------------
# in the workers (and in the driving process)


def _vmhwm_bytes() -> int:
    """Peak RSS of this process since the last :func:`_reset_peak` (``VmHWM``), in bytes."""
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmHWM:")) * 1024


def _reset_peak() -> int:
    """Reset ``VmHWM`` to the current RSS (Linux >= 4.0); returns this process's id."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:  # not Linux, or not allowed: the peak then covers the whole life of the process
        pass
    return os.getpid()


def _worker_state(dask_worker=None) -> dict:
    """Process id, peak RSS and bytes spilled to disk so far of one worker."""
    spilled = 0
    data = getattr(dask_worker, "data", None)
    total = getattr(data, "spilled_total", None)
    if total is not None:
        spilled = int(total.disk)
    return {"pid": os.getpid(), "peak": _vmhwm_bytes(), "spilled": spilled}


# --------------------------------------------------------------------------------------------------
# one size in a fresh process


def _csr_bytes(ds) -> int:
    """Bytes of the dataset's ``X`` and ``Y`` as SciPy CSR (float32 data, int32 indices, int64 indptr)."""
    return (int(ds.meta["nnz"]) + _nnz_y(ds)) * 8 + 2 * (ds.n_samples + 1) * 8


def _nnz_y(ds) -> int:
    return int(ds.meta["nnz_labels"])


def child(spec: dict) -> None:
    """Run every stage on one size in this (fresh) process; print one JSON row per stage."""
    import logging

    # the library's progress lines (epochs, solver iterations) go to the child's log with their times
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    logging.getLogger("xmldask").setLevel(logging.INFO)
    logging.getLogger("distributed").setLevel(logging.WARNING)
    from xmldask import jobs, open_dataset
    from xmldask.cluster import cluster, parse_memory_limit
    from xmldask.embedding.spectrum import compute_spectrum
    from xmldask.io import ingest
    from xmldask.params import current_names

    work = Path(spec["work"])
    limit = parse_memory_limit(spec["memory_limit"])
    layout = {} if spec["address"] else {"n_workers": spec["workers"], "threads_per_worker": 1,
                                         "memory_limit": limit, "local_directory": str(work / "dask")}
    rows = []
    with cluster(spec["address"], dashboard_address=None, **layout) as client:
        client.wait_for_workers(spec["workers"], timeout=60)
        n_workers = len(client.scheduler_info(n_workers=-1)["workers"])
        urls = {"train": spec.get("train_store") or str(work / "train.zarr"),
                "test": spec.get("test_store") or str(work / "test.zarr"),
                "tree": str(work / "tree.zarr"), "model": str(work / "model.zarr"),
                "predictions": str(work / "predictions.zarr")}
        sizes = {}

        def reads(name):
            """nonzeros of what a stage reads"""
            return sizes.get(name)

        def stage_ingest(split):
            extra = {}
            if split == "test":
                meta = open_dataset(urls["train"]).meta
                extra = {"n_features": meta["n_features"], "n_labels": meta["n_labels"]}
            ds = ingest([spec[f"{split}_text"]], urls[split], block_rows=spec["block_rows"], **extra)
            return {"nnz_read": int(ds.meta["nnz"]), "passes": 1}

        def stage_spectrum():
            s = compute_spectrum(urls["train"], matrix="Y", n_components=50, random_state=0)
            return {"nnz_read": reads("train_y"), "passes": int(s.n_passes)}

        def stage_tree():
            t = spec["tree"]
            r = jobs.tree(urls["train"], urls["tree"], max_depth=t["depth"], leaf_labels=t["leaf_labels"],
                          routing=t["routing"], random_state=0)
            return {"nnz_read": reads("train"), "passes": r.get("n_passes")}

        def stage_train():
            params = current_names(dict(spec["model"]))
            if spec["tree"]:
                given = {k: v for k, v in params.items() if k in ("n_components", "max_epochs", "random_state")}
                params = {**given, "tree": urls["tree"]}
            r = jobs.train(urls["train"], urls["model"], **params)
            return {"nnz_read": reads("train"), "passes": r.get("n_passes")}

        def stage_predict():
            jobs.predict(urls["model"], urls["test"], urls["predictions"], top_k=10)
            return {"nnz_read": reads("test"), "passes": 1}

        def stage_evaluate():
            r = jobs.evaluate(urls["predictions"], urls["test"], train_url=urls["train"], ks=tuple(range(1, 11)))
            return {"nnz_read": reads("test_y"), "passes": 1, "P@1": r.get("P@1"), "P@5": r.get("P@5")}

        stages = {"ingest-train": lambda: stage_ingest("train"), "ingest-test": lambda: stage_ingest("test"),
                  "spectrum": stage_spectrum, "tree": stage_tree, "train": stage_train, "predict": stage_predict,
                  "evaluate": stage_evaluate}
        for name in spec["stages"]:
            if name in ("spectrum", "tree", "train", "predict", "evaluate") and "train" not in sizes:
                train = open_dataset(urls["train"])
                sizes.update(train=int(train.meta["nnz"]), train_y=_nnz_y(train), n_samples=train.n_samples,
                             csr_bytes=_csr_bytes(train))
            if name in ("predict", "evaluate") and "test" not in sizes:  # --stages without ingest-test
                test = open_dataset(urls["test"])
                sizes.update(test=int(test.meta["nnz"]), test_y=_nnz_y(test))
            before = client.run(_worker_state)
            client.run(_reset_peak)
            _reset_peak()
            start = time.perf_counter()
            error = None
            try:
                facts = stages[name]()
            except Exception as exc:  # noqa: BLE001 - reported in the row; the later stages cannot run
                facts, error = {}, f"{type(exc).__name__}: {str(exc)[:300]}"
            seconds = time.perf_counter() - start
            client_peak = _vmhwm_bytes()
            try:
                client.wait_for_workers(n_workers, timeout=60)
            except TimeoutError:
                pass
            after = client.run(_worker_state)
            old_pids = {state["pid"] for state in before.values()}
            restarts = sum(1 for state in after.values() if state["pid"] not in old_pids)
            spilled = sum(state["spilled"] for state in after.values()) - sum(
                state["spilled"] for addr, state in before.items() if addr in after and
                after[addr]["pid"] == state["pid"])
            nnz_read = facts.get("nnz_read")
            row = {"stage": name, "seconds": round(seconds, 3),
                   "s_per_mnnz": round(seconds / nnz_read * 1e6, 4) if nnz_read else None,
                   "passes": facts.get("passes"),
                   "peak_rss_bytes_per_worker": max(state["peak"] for state in after.values()),
                   "peak_rss_bytes_client": client_peak, "spilled_bytes": max(0, spilled),
                   "worker_restarts": restarts, "stage_nnz": nnz_read,
                   **{key: facts[key] for key in ("P@1", "P@5") if facts.get(key) is not None},
                   **({"error": error} if error else {})}
            rows.append(row)
            print(f"[scale] {name}: {seconds:.1f} s, worker peak {row['peak_rss_bytes_per_worker'] / 2**20:.0f} MiB"
                  + (f" ({error})" if error else ""), file=sys.stderr, flush=True)
            if error:
                break
    if not sizes:
        train = open_dataset(urls["train"])
        sizes.update(train=int(train.meta["nnz"]), n_samples=train.n_samples, csr_bytes=_csr_bytes(train))
    n_labels = open_dataset(urls["train"]).n_labels
    for row in rows:
        row.update(n_samples=sizes["n_samples"], nnz=sizes["train"], csr_bytes=sizes["csr_bytes"], n_labels=n_labels,
                   store_bytes=_store_bytes(urls["train"]),
                   worker_memory_limit_bytes=int(limit) if limit else None, n_workers=n_workers)
    print(json.dumps(rows))


# --------------------------------------------------------------------------------------------------
# the driver


def cache_dir(path: str | None) -> Path:
    if path:
        return Path(path)
    root = os.environ.get("XMLDASK_STORAGE")
    base = Path(root) if root else Path(__file__).resolve().parents[1] / "storage"
    return base / "bench" / "scale"


def ensure_data(root: Path, *, n_samples: int, n_features: int, n_labels: int, avg_features: float, seed: int,
                source: str, block_rows: int, knobs: dict = KNOBS) -> dict:
    """The text files (``source="text"``) or stores (``"store"``) of one size, generated if absent."""
    from xmldask.datasets import GENERATOR_VERSION, make_synthetic, write_synthetic_text

    base = root / (f"synth-n{n_samples}-d{n_features}-l{n_labels}-f{avg_features:g}-seed{seed}-"
                   f"{'-'.join(f'{k}{v:g}' for k, v in knobs.items())}-v{GENERATOR_VERSION}")
    base.mkdir(parents=True, exist_ok=True)
    out = {}
    for split, n in (("train", n_samples), ("test", max(1, n_samples // 5))):
        params = {"n_samples": n, "n_features": n_features, "n_labels": n_labels, "avg_features": avg_features,
                  "seed": seed, "split": split, **knobs}
        start = time.perf_counter()
        if source == "text":
            path = base / f"{split}.txt.gz"
            if not path.exists():
                write_synthetic_text(str(path), **params)
                print(f"wrote {path} in {time.perf_counter() - start:.1f} s", file=sys.stderr)
            out[f"{split}_text"] = str(path)
        else:
            path = base / f"{split}-b{block_rows}.zarr"
            if not (path / "zarr.json").exists():
                make_synthetic(str(path), **params, block_rows=block_rows, overwrite=True)
                print(f"wrote {path} in {time.perf_counter() - start:.1f} s", file=sys.stderr)
            out[f"{split}_store"] = str(path)
    return out


def ensure_preset(root: Path, *, preset_name: str, n_samples: int, test_rows: int, seed: int, block_rows: int) -> dict:
    """The stores of the XMC generator's preset ``preset_name`` (:mod:`xmldask.xmc`) with ``n_samples`` training
    and ``test_rows`` test rows, generated if absent."""
    from xmldask.xmc import XMC_GENERATOR_VERSION, make_xmc, preset

    base = root / f"xmc-{preset_name}-n{n_samples}-seed{seed}-v{XMC_GENERATOR_VERSION}"
    base.mkdir(parents=True, exist_ok=True)
    out = {}
    for split, n in (("train", n_samples), ("test", test_rows)):
        path = base / f"{split}-n{n}-b{block_rows}.zarr"
        if not (path / "zarr.json").exists():
            start = time.perf_counter()
            make_xmc(str(path), **preset(preset_name, split, n_samples=n, seed=seed), block_rows=block_rows,
                     overwrite=True)
            print(f"wrote {path} in {time.perf_counter() - start:.1f} s", file=sys.stderr)
        out[f"{split}_store"] = str(path)
    return out


def _store_bytes(url: str) -> int:
    """Bytes of a local store on disk (what the workers would hold compressed)."""
    return sum(f.stat().st_size for f in Path(url).rglob("*") if f.is_file())


class ExternalCluster:
    """A ``dask scheduler`` and ``n`` ``dask worker`` processes (each with its nanny), started by this script."""

    def __init__(self, *, n_workers: int, memory_limit: str, directory: Path):
        self.n_workers, self.memory_limit, self.directory = n_workers, memory_limit, directory
        self.procs: list[subprocess.Popen] = []

    def __enter__(self) -> str:
        dask = str(Path(sys.executable).with_name("dask"))
        file = self.directory / "scheduler.json"
        from xmldask.cluster import PROFILE_HISTORY

        # the workers a user starts are configured like the local cluster's (see PROFILE_HISTORY)
        env = {**os.environ, "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1",
               "DASK_LOGGING__DISTRIBUTED": "warning",
               "DASK_DISTRIBUTED__ADMIN__LOW_LEVEL_LOG_LENGTH": str(PROFILE_HISTORY),
               "PYTHONPATH": os.pathsep.join(filter(None, [str(Path(__file__).resolve().parent),
                                                           os.environ.get("PYTHONPATH")]))}
        log = open(self.directory / "cluster.log", "a")  # noqa: SIM115 - closed with the processes
        self._log = log
        self.procs.append(subprocess.Popen([dask, "scheduler", "--scheduler-file", str(file), "--port", "0",
                                            "--no-dashboard", "--host", "127.0.0.1"],
                                           stdout=log, stderr=log, env=env))
        deadline = time.monotonic() + 60
        while not file.exists():
            if time.monotonic() > deadline or self.procs[0].poll() is not None:
                self.__exit__()
                raise RuntimeError(f"the dask scheduler did not start; see {self.directory / 'cluster.log'}")
            time.sleep(0.2)
        address = json.loads(file.read_text())["address"]
        for i in range(self.n_workers):
            self.procs.append(subprocess.Popen(
                [dask, "worker", address, "--nworkers", "1", "--nthreads", "1", "--memory-limit", self.memory_limit,
                 "--no-dashboard", "--host", "127.0.0.1", "--local-directory", str(self.directory / f"w{i}")],
                stdout=log, stderr=log, env=env))
        return address

    def __exit__(self, *exc) -> None:
        for proc in reversed(self.procs):  # workers first, then the scheduler
            proc.terminate()
        for proc in self.procs:
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                proc.kill()
        if hasattr(self, "_log"):
            self._log.close()


def run_size(spec: dict) -> list[dict]:
    """Run one size in a fresh process; its per-stage progress lines are shown as they come."""
    proc = subprocess.Popen([sys.executable, __file__, "--child", json.dumps(spec)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env={**os.environ, "PYTHONWARNINGS": "ignore"})
    err = []

    def relay():
        for line in proc.stderr:
            err.append(line)
            if line.startswith("[scale] "):
                sys.stderr.write("  " + line[8:])
                sys.stderr.flush()

    thread = threading.Thread(target=relay, daemon=True)
    thread.start()
    out = proc.stdout.read()
    proc.wait()
    thread.join()
    Path(spec["log"]).write_text("".join(err))
    if proc.returncode != 0:
        raise RuntimeError(f"n={spec['n_samples']} failed (log: {spec['log']}):\n{''.join(err)[-4000:]}")
    return json.loads(out.strip().splitlines()[-1])


def plot(rows: list[dict], path: str) -> None:
    """Seconds and per-worker peak RSS of every stage against n (log-log), the memory limit dashed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    for cluster_kind in sorted({r["cluster"] for r in rows}):
        for color, stage in enumerate(STAGES):
            pts = sorted((r["n_samples"], r) for r in rows if r["stage"] == stage and r["cluster"] == cluster_kind
                         and r.get("seconds") is not None and "error" not in r)
            if not pts:
                continue
            ns = [n for n, _ in pts]
            style = "-o" if cluster_kind == "local" else "--s"
            label = stage if cluster_kind == "local" else f"{stage} (external)"
            left.plot(ns, [r["seconds"] for _, r in pts], style, color=f"C{color}", label=label)
            right.plot(ns, [r["peak_rss_bytes_per_worker"] / 2**20 for _, r in pts], style, color=f"C{color}",
                       label=label)
    limits = {r["worker_memory_limit_bytes"] for r in rows if r.get("worker_memory_limit_bytes")}
    for limit in limits:
        right.axhline(limit / 2**20, color="k", ls=":", lw=1)
    left.set(xscale="log", yscale="log", xlabel="training rows n", ylabel="seconds", title="time per stage")
    right.set(xscale="log", xlabel="training rows n", ylabel="MiB", title="peak RSS per worker (limit dotted)")
    left.legend(fontsize=7)
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", type=int, nargs="+", default=[100_000, 1_000_000], metavar="N",
                        help="training rows n of each run (test rows: n / 5)")
    parser.add_argument("--features", type=int, default=50_000, help="columns of X (default 50000)")
    parser.add_argument("--labels", type=int, default=1_000, help="columns of Y (default 1000)")
    parser.add_argument("--avg-features", type=float, default=100.0,
                        help="feature tokens per row of the generator (default 100: about 63 nonzeros per row)")
    parser.add_argument("--label-exponent", type=float, default=KNOBS["label_exponent"],
                        help=f"Zipf exponent of the label frequencies (default {KNOBS['label_exponent']:g}, the "
                             "pipeline's; the tree needs every label in the training rows: 1.1 covers 1000 labels "
                             "from 10^5 rows)")
    parser.add_argument("--preset", default=None, metavar="NAME",
                        help="the XMC generator's preset (xmldask.xmc.PRESETS, e.g. xmc-1m) with --sizes training "
                             "rows, written straight to stores, instead of make_synthetic's data")
    parser.add_argument("--test-rows", type=int, default=None, metavar="N",
                        help="test rows with --preset (default: the preset's)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--block-rows", type=int, default=16_384,
                        help="rows per block of the stores (default 16384: about 8 MiB of CSR a block here; a pass "
                             "task holds its block a few times over, in a worker that idles at about 105 MiB)")
    parser.add_argument("--workers", type=int, default=2, help="worker processes, one thread each (default 2)")
    parser.add_argument("--memory-limit", default="256MiB", help="memory limit per worker (default 256MiB)")
    parser.add_argument("--external", action="store_true",
                        help="also run on a separately started dask scheduler + --workers dask worker processes")
    parser.add_argument("--external-only", action="store_true", help="only on the external cluster")
    parser.add_argument("--source", choices=["text", "store"], default="text",
                        help="text: XC files ingested as the pipeline does (default); store: the generator writes "
                             "the stores (no ingest stages)")
    parser.add_argument("--grow-tree", action="store_true", help="add the tree stage; train its classifier")
    parser.add_argument("--tree-depth", type=int, default=14)
    parser.add_argument("--tree-leaf-labels", type=int, default=25)
    parser.add_argument("--tree-routing", choices=["fractional", "deterministic"], default="fractional",
                        help="routing of the training rows while the tree grows (default fractional)")
    parser.add_argument("--stages", nargs="+", choices=STAGES, default=None, metavar="STAGE",
                        help=f"run only these stages (of {', '.join(STAGES)}; default all that apply)")
    parser.add_argument("--model", default=None, metavar="JSON",
                        help="training parameters (xmldask.models.TrainParams), default "
                             "'{\"search\": null, \"kernel\": \"none\", \"k\": 16}', with --preset '{}' (the "
                             "defaults: the label-centroid tree past about 2,000 labels)")
    parser.add_argument("--cache", default=None, metavar="DIR",
                        help="where the generated data live (default $XMLDASK_STORAGE/bench/scale, else "
                             "storage/bench/scale)")
    parser.add_argument("--json", default=None, metavar="FILE", help="also write the rows as JSON")
    parser.add_argument("--plot", default=None, metavar="FILE.png", help="time and per-worker memory against n")
    parser.add_argument("--load", nargs="+", default=None, metavar="JSON",
                        help="run nothing: the table (and --plot, --json) of rows saved by earlier --json runs")
    parser.add_argument("--quick", action="store_true",
                        help="smoke test: one size of 3000 rows, 1000 features, 200 labels, 2 decoder epochs")
    args = parser.parse_args(argv)
    if args.model is None:
        args.model = "{}" if args.preset else '{"search": null, "kernel": "none", "k": 16}'
    if args.quick:
        # 1000 features: with 2000, the Gram's float64 partial sums (three of 32 MB in a combine task) took a 256 MiB
        # worker to 242 MiB, within a MiB of the nanny's restart threshold (95 %): a restart in one CI run of many
        args.sizes, args.features, args.labels = [3_000], 1_000, 200
        args.model = json.dumps({**json.loads(args.model), "k": 16, "max_epochs": 2, "n_random_features": 200})
    return args


def main(argv=None) -> None:
    args = parse_args(argv)
    model = json.loads(args.model)
    root = cache_dir(args.cache)
    root.mkdir(parents=True, exist_ok=True)
    if args.preset:
        args.source = "store"
    stages = [s for s in STAGES if (s != "tree" or args.grow_tree) and (args.source == "text" or
                                                                        not s.startswith("ingest"))
              and (args.stages is None or s in args.stages)]
    kinds = ["external"] if args.external_only else ["local", *(["external"] if args.external else [])]
    tree = ({"depth": args.tree_depth, "leaf_labels": args.tree_leaf_labels, "routing": args.tree_routing}
            if args.grow_tree else None)
    rows = []
    for file in args.load or []:
        rows += json.loads(Path(file).read_text())
    for n in [] if args.load else args.sizes:
        if args.preset:
            from xmldask.xmc import preset

            test_rows = args.test_rows or preset(args.preset, "test")["n_samples"]
            data = ensure_preset(root, preset_name=args.preset, n_samples=n, test_rows=test_rows, seed=args.seed,
                                 block_rows=args.block_rows)
        else:
            data = ensure_data(root, n_samples=n, n_features=args.features, n_labels=args.labels,
                               avg_features=args.avg_features, seed=args.seed, source=args.source,
                               block_rows=args.block_rows, knobs={**KNOBS, "label_exponent": args.label_exponent})
        for kind in kinds:
            work = Path(tempfile.mkdtemp(prefix=f"scale-n{n}-{kind}-", dir=root))
            spec = {**data, "n_samples": n, "work": str(work), "workers": args.workers,
                    "memory_limit": args.memory_limit, "block_rows": args.block_rows, "model": model, "tree": tree,
                    "stages": stages,
                    "address": None, "log": str(root / f"scale-n{n}-{kind}.log")}
            print(f"n={n} on the {kind} cluster ({args.workers} x {args.memory_limit})", file=sys.stderr, flush=True)
            try:
                if kind == "external":
                    with ExternalCluster(n_workers=args.workers, memory_limit=args.memory_limit,
                                         directory=work) as address:
                        got = run_size({**spec, "address": address})
                else:
                    got = run_size(spec)
            finally:
                shutil.rmtree(work, ignore_errors=True)
            rows += [{**row, "cluster": kind} for row in got]

    print(markdown_table(rows, TABLE_KEYS + (["error"] if any("error" in r for r in rows) else [])))
    print("\n" + load_line())
    write_json(args.json, rows)
    if args.plot:
        plot(rows, args.plot)


if __name__ == "__main__":
    main_or_child(main, child)
