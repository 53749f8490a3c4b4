"""xmldask's default against its peers on large label spaces: 10K, 100K (and 1M) labels from the XMC generator.

Each label count is a preset of :mod:`xmldask.xmc` (``xmc-10k``, ``xmc-100k``, ``xmc-1m``: text-like rows, about
3 labels and 83 non-zeros a row, a Zipf label tail; or any other preset, e.g. ``amazon-670k``). The train and test
splits are written once as XC text files (``storage/bench/extreme/PRESET/{train,test}.txt.gz``) and ingested into
stores from those files, so every system reads the same rows. Then, as in ``bench/peers.py`` (whose children this
script runs), each system trains and predicts the top ``--top-k`` labels of every test row in a fresh process that
reports its train seconds, prediction rows/s, peak RSS (``VmHWM``; for xmldask the client and its local Dask
worker processes) and model size; every system is scored by the same code (:func:`xmldask.metrics.evaluate`,
propensities from the training label counts, ``A = 0.55``, ``B = 1.5``).

Systems: ``xmldask-default`` (``xmldask train TRAIN --out MODEL``, no option: ``model="auto"``), ``omikuji-parabel``,
``omikuji-bonsai``, ``napkinxc-plt``, ``pecos-xrlinear`` (in its own virtualenv, see ``bench/peers.py``).

Usage::

    python bench/extreme.py                                  # xmc-10k and xmc-100k, every system
    python bench/extreme.py --presets xmc-10k --systems xmldask-default,omikuji-parabel
    python bench/extreme.py --json bench/results/extreme.json --plot docs/extreme.png
    python bench/extreme.py --stats --presets eurlex-4k,wiki10-31k   # the generator's statistics only
    python bench/extreme.py --presets xmc-100k --knobs background=0.9,label_words=32,avg_labels=5  # another shape

``--test-rows N`` predicts on the first N test rows only (Omikuji's Python API predicts one row a call).
"""

from __future__ import annotations

import argparse
import shutil
import sys
import time
from pathlib import Path

import peers
from _tables import load_line, main_or_child, markdown_table, write_json

ROOT = Path(__file__).resolve().parents[1]
SYSTEMS = ("xmldask-default", "omikuji-parabel", "omikuji-bonsai", "napkinxc-plt", "pecos-xrlinear")
PRESETS = ("xmc-10k", "xmc-100k")
KEYS = ["preset", "labels", "system", "P@1 %", "P@3 %", "P@5 %", "PSP@5 %", "train s", "predict rows/s",
        "peak RSS MB", "model MB", "P@1 / best peer", "train s / fastest peer", "RSS / smallest peer",
        "rows/s / fastest peer"]


def generate(preset: str, work: Path, seed: int, test_rows: int | None, knobs: dict | None = None) -> dict:
    """The preset's train and test splits as XC text files and ingested stores under ``work`` (made once);
    ``knobs`` override the generator's knobs or the preset's means (``--knobs``)."""
    from xmldask.io import ingest
    from xmldask.store import open_dataset
    from xmldask.xmc import preset as preset_args
    from xmldask.xmc import write_xmc_text

    work.mkdir(parents=True, exist_ok=True)
    urls = {}
    start = time.perf_counter()
    made = False
    for split in ("train", "test"):
        text, store = work / f"{split}.txt.gz", work / f"{split}.zarr"
        args = preset_args(preset, split, **(knobs or {}))
        if split == "test" and test_rows:
            args["n_samples"] = min(args["n_samples"], test_rows)
        if not text.exists():
            write_xmc_text(str(text), seed=seed, **args)
            shutil.rmtree(store, ignore_errors=True)
            made = True
        try:
            open_dataset(str(store))
        except Exception:  # noqa: BLE001 - absent or unreadable: ingest again
            ingest(str(text), str(store), n_features=args["n_features"], n_labels=args["n_labels"], overwrite=True)
            made = True
        urls[f"{split}_gz"], urls[f"{split}_url"] = str(text), str(store)
    urls["ingest_s"] = f"{time.perf_counter() - start:.1f} s" if made else "reused"
    return urls


def stats(preset: str, urls: dict, knobs: dict | None = None) -> dict:
    """The realised statistics of the generated training split beside the preset's published ones."""
    import numpy as np

    from xmldask.store import open_dataset
    from xmldask.xmc import PRESETS as PUBLISHED

    train = open_dataset(urls["train_url"])
    info = train.info()
    counts = np.asarray(train.label_counts)
    seen = counts[counts > 0]
    want = {**PUBLISHED[preset], **{k: v for k, v in (knobs or {}).items() if k in ("avg_labels", "avg_features")}}
    return {"preset": preset, "rows": train.n_samples, "features": train.n_features, "labels": train.n_labels,
            "labels a row (published)": want["avg_labels"], "labels a row": round(info["avg_labels_per_row"], 2),
            "non-zeros a row (published)": want["avg_features"],
            "non-zeros a row": round(info["avg_features_per_row"], 1), "labels seen": int(len(seen)),
            "seen labels with <= 5 rows %": round(100 * float(np.mean(seen <= 5)), 1),
            "rows a seen label": round(float(seen.mean()), 2)}


def parse_knobs(text: str | None) -> dict:
    """``--knobs NAME=VALUE,...``: the generator's knobs (:data:`xmldask.xmc.DEFAULT_KNOBS`) or a preset's means
    (``avg_labels``, ``avg_features``), typed as their defaults are."""
    from xmldask.xmc import DEFAULT_KNOBS

    known = {**DEFAULT_KNOBS, "avg_labels": 1.0, "avg_features": 1.0}
    knobs = {}
    for item in filter(None, (text or "").split(",")):
        name, _, value = item.partition("=")
        if name not in known or not value:
            raise SystemExit(f"--knobs: {item!r} is not NAME=VALUE with NAME one of {', '.join(known)}")
        knobs[name] = type(known[name])(value)
    return knobs


def work_dir(args, preset: str) -> Path:
    """Where a preset's data and runs live: ``--work/PRESET``, or ``PRESET+name=value...`` with ``--knobs``."""
    return Path(args.work) / "+".join([preset, *(f"{name}={value}" for name, value in sorted(args.knobs.items()))])


def run_preset(preset: str, args, pecos) -> list[dict]:
    work = work_dir(args, preset)
    urls = generate(preset, work, args.seed, args.test_rows, args.knobs)
    from xmldask.store import open_dataset

    n_labels = open_dataset(urls["train_url"]).n_labels
    rows = []
    for system in args.systems:
        out = work / system
        shutil.rmtree(out, ignore_errors=True)
        spec = {"system": system, "out": str(out), "top_k": args.top_k, "chosen": None, "search": None,
                "n_estimators": 1, **urls}
        if system == "pecos-xrlinear":
            if pecos[0] is None:
                rows.append({"preset": preset, "labels": n_labels, "system": system, "error": pecos[1]})
                continue
            spec.update(peers._save_npz(urls, work))
        print(f"{preset} {system} ...", file=sys.stderr, flush=True)
        fig = peers.run_system(system, spec, args.timeout, pecos[0])
        if "error" in fig:
            rows.append({"preset": preset, "labels": n_labels, "system": system, "error": fig["error"]})
            print(f"{preset} {system} failed: {fig.get('stderr', fig['error'])}", file=sys.stderr, flush=True)
            continue
        res = peers.score(out, urls, args.top_k)
        row = {"preset": preset, "labels": n_labels, "system": system}
        for key in ("P@1", "P@3", "P@5", "PSP@5"):
            row[f"{key} %"] = round(100 * res[key], 2)
        row.update({"train s": round(fig["train_s"], 1), "predict rows/s": round(fig["n_test"] / fig["predict_s"]),
                    "peak RSS MB": round(fig["peak_rss_mb"]), "model MB": round(fig["model_bytes"] / 2**20, 1),
                    "settings": fig["settings"]})
        rows.append(row)
        print(f"{preset} {system}: P@1 {row['P@1 %']} %, train {row['train s']} s, {row['predict rows/s']} rows/s, "
              f"{row['peak RSS MB']} MB", file=sys.stderr, flush=True)
        if not args.keep:
            shutil.rmtree(out, ignore_errors=True)
    done = [r for r in rows if "error" not in r]
    peer_rows = [r for r in done if not r["system"].startswith("xmldask")]
    if peer_rows:
        best = max(r["P@1 %"] for r in peer_rows)
        fastest = min(r["train s"] for r in peer_rows)
        smallest = min(r["peak RSS MB"] for r in peer_rows)
        quickest = max(r["predict rows/s"] for r in peer_rows)
        for r in done:
            r["P@1 / best peer"] = round(r["P@1 %"] / best, 3)
            r["train s / fastest peer"] = round(r["train s"] / fastest, 2)
            r["RSS / smallest peer"] = round(r["peak RSS MB"] / smallest, 2)
            r["rows/s / fastest peer"] = round(r["predict rows/s"] / quickest, 2)
    return rows


def plot(rows: list[dict], path: str) -> None:
    """Train seconds, prediction rows/s and peak RSS against the number of labels, one line per system."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    done = [r for r in rows if "error" not in r]
    systems = list(dict.fromkeys(r["system"] for r in done))
    fig, axes = plt.subplots(1, 4, figsize=(16, 3.8))
    for ax, key in zip(axes, ("P@1 %", "train s", "predict rows/s", "peak RSS MB")):
        for system in systems:
            pts = sorted((r["labels"], r[key]) for r in done if r["system"] == system)
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=system,
                    linewidth=2.5 if system.startswith("xmldask") else 1.2)
        ax.set_xscale("log")
        if key != "P@1 %":
            ax.set_yscale("log")
        ax.set_xlabel("labels")
        ax.set_title(key)
        ax.grid(True, which="both", alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.suptitle("bench/extreme.py: xmldask's default and its peers against the number of labels (2 cores)")
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--presets", default=",".join(PRESETS), help="xmldask.xmc presets (default %(default)s)")
    parser.add_argument("--systems", default=",".join(SYSTEMS), help="default %(default)s")
    parser.add_argument("--top-k", type=int, default=5)
    parser.add_argument("--test-rows", type=int, default=5000,
                        help="test rows at most (the preset's test split cut; default %(default)s)")
    parser.add_argument("--seed", type=int, default=0, help="generator seed (default %(default)s)")
    parser.add_argument("--timeout", type=float, default=3600, help="seconds a system may take (default %(default)s)")
    parser.add_argument("--work", default=str(ROOT / "storage" / "bench" / "extreme"),
                        help="generated files and stores (reused; default %(default)s)")
    parser.add_argument("--pecos-venv", default=str(ROOT / "storage" / "bench" / "pecos-venv"))
    parser.add_argument("--knobs", default=None, metavar="NAME=VALUE,...",
                        help="another shape of data: the generator's knobs (xmldask.xmc.DEFAULT_KNOBS, e.g. "
                             "background=0.9,values=counts) or the preset's avg_labels / avg_features")
    parser.add_argument("--stats", action="store_true", help="print the generated data's statistics only")
    parser.add_argument("--plot", default=None, metavar="PNG", help="cost against the number of labels")
    parser.add_argument("--keep", action="store_true", help="keep each system's model and predictions")
    parser.add_argument("--json", default=None, metavar="FILE", help="write the rows as JSON")
    args = parser.parse_args(argv)
    args.knobs = parse_knobs(args.knobs)
    args.systems = [s for s in args.systems.split(",") if s]
    unknown = sorted(set(args.systems) - set(SYSTEMS))
    if unknown:
        parser.error(f"unknown system(s) {', '.join(unknown)}; systems: {', '.join(SYSTEMS)}")
    presets = [p for p in args.presets.split(",") if p]
    if args.stats:
        rows = [stats(p, generate(p, work_dir(args, p), args.seed, args.test_rows, args.knobs), args.knobs)
                for p in presets]
        print(markdown_table(rows, list(rows[0])))
        write_json(args.json, rows)
        return
    pecos = peers.ensure_pecos(Path(args.pecos_venv), 1800) if "pecos-xrlinear" in args.systems else (None, "")
    rows = []
    for preset in presets:
        rows += run_preset(preset, args, pecos)
    print(f"\n### bench/extreme.py ({', '.join(presets)}; top {args.top_k}, at most {args.test_rows:,} test rows)\n")
    print(markdown_table([r for r in rows if "error" not in r], KEYS))
    for r in rows:
        if "error" in r:
            print(f"- {r['preset']} {r['system']}: did not run: {r['error']}")
    print(f"\n{load_line()}")
    write_json(args.json, rows)
    if args.plot:
        plot(rows, args.plot)


def child(spec: dict) -> None:
    peers.child(spec)


if __name__ == "__main__":
    main_or_child(main, child)
