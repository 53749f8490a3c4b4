"""The report of a pipeline run: metric table, timing and memory per stage, plots (matplotlib, Agg backend)."""

from __future__ import annotations

import contextlib
import json
import shutil
from pathlib import Path

import numpy as np

__all__ = ["TABLE_KS", "plot_label_frequency", "plot_precision_at_k", "plot_tree", "tree_lines", "write_report"]

#: the k shown in the report's metric table (metrics.json holds every k computed)
TABLE_KS = (1, 3, 5)


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


@contextlib.contextmanager
def _figure(path: Path, title: str, n_axes: int = 1, figsize: tuple[float, float] = (6, 4), *,
            integer_x: bool = False):
    """A figure of ``n_axes`` side by side, titled, with a grid (integer ticks on x: ``integer_x``): yields the
    axes, then saves it to ``path`` and closes it (also when plotting fails)."""
    plt = _pyplot()
    from matplotlib.ticker import MaxNLocator

    fig, axes = plt.subplots(1, n_axes, figsize=figsize, dpi=100, squeeze=False)
    try:
        yield axes[0] if n_axes > 1 else axes[0, 0]
        for ax in axes.ravel():
            ax.grid(True, which="both", alpha=0.3)
            if integer_x:
                ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        (fig.suptitle if n_axes > 1 else axes[0, 0].set_title)(title)
        fig.tight_layout()
        fig.savefig(path)
    finally:
        plt.close(fig)


#: points of a per-label curve at most
MAX_POINTS = 2000


def plot_label_frequency(label_counts, path: Path, *, title: str = "Label frequency") -> Path:
    """Rows per label against the label's frequency rank, log-log (the long tail of XMC data); at most
    :data:`MAX_POINTS` ranks, spaced evenly on the log axis, so that a million labels stay one readable curve."""
    counts = np.sort(np.asarray(label_counts))[::-1]
    counts = counts[counts > 0]
    ranks = np.unique(np.geomspace(1, max(len(counts), 1), num=min(len(counts), MAX_POINTS)).astype(np.int64))
    with _figure(path, title) as ax:
        ax.loglog(ranks, counts[ranks - 1], marker=".", linestyle="none", markersize=2)
        ax.set_xlabel("label rank")
        ax.set_ylabel("rows with the label")
    return path


def plot_precision_at_k(metrics: dict, path: Path, *, title: str = "Precision at k") -> Path:
    """``P@k`` (and ``PSP@k``, ``nDCG@k`` where present) for every ``k`` in ``metrics``, dashed: the baseline's."""
    baseline = metrics.get("baseline") or {}
    with _figure(path, title, integer_x=True, figsize=(8, 4)) as ax:
        for family in ("P", "PSP", "nDCG"):
            ks = sorted(int(name.split("@")[1]) for name in metrics
                        if name.startswith(f"{family}@") and name.split("@")[1].isdigit())
            if ks:
                line, = ax.plot(ks, [metrics[f"{family}@{k}"] for k in ks], marker="o", label=f"{family}@k")
                if all(f"{family}@{k}" in baseline for k in ks):
                    ax.plot(ks, [baseline[f"{family}@{k}"] for k in ks], linestyle="--", color=line.get_color(),
                            label=f"{family}@k, most frequent labels")
        ax.set_xlabel("k")
        ax.set_ylabel("value")
        ax.legend(loc="upper left", bbox_to_anchor=(1.02, 1), fontsize="small")  # beside the curves, not on them
    return path


def plot_tree(figures: dict, path: Path, *, title: str = "Label tree (test rows)") -> Path:
    """Rows by leaf depth, rows by the candidate count of their leaf, and the recall by leaf depth
    (``SpectralLabelTree.leaf_figures``, lists or arrays)."""
    with _figure(path, title, 3, figsize=(13, 3.8), integer_x=True) as (a, b, c):
        a.bar(figures["depth"], figures["rows_by_depth"])
        a.set_xlabel("leaf depth")
        a.set_ylabel("rows")
        b.bar(figures["candidates"], figures["rows_by_candidates"])
        b.set_xlabel("candidates of the row's leaf")
        b.set_ylabel("rows")
        c.plot(figures["depth"], figures["recall_by_depth"], marker="o")
        c.set_xlabel("leaf depth")
        c.set_ylabel("recall of the true labels")
        c.set_ylim(0, 1.02)
    return path


def tree_lines(result: dict) -> list[str]:
    """The tree stage's figures as Markdown lines (the report's "Label tree" section)."""
    test, train = result.get("test_figures", {}), result.get("train_figures", {})
    names = ("tree_recall", "top_labels_recall", "root_purity", "root_balance", "mean_depth", "mean_candidates")
    rows = [f"| {name} | {train.get(name, float('nan')):.4f} | {test.get(name, float('nan')):.4f} |" for name in names]
    return ["## Label tree", "", f"{result.get('n_leaves')} leaves, {result.get('n_nodes')} nodes, "
            f"{result.get('n_passes')} passes, {result.get('seconds')} s; `tree_recall` caps the classifier's "
            f"recall, `top_labels_recall` is the same budget of the most frequent labels for every row."
            + (f" {result['n_unseen_labels']} labels have no training example: no leaf offers them."
               if result.get("n_unseen_labels") else ""), "",
            "| figure | train | test |", "|---|---:|---:|", *rows, ""]


def table_metrics(metrics: dict) -> dict:
    """The metrics shown in the report's table: the ranking metrics at ``TABLE_KS`` and every single figure."""
    shown = {}
    for name, value in metrics.items():
        family, sep, k = name.partition("@")
        if sep and k.isdigit() and int(k) not in TABLE_KS:
            continue
        shown[name] = table_metrics(value) if isinstance(value, dict) else value
    return shown


def model_lines(result: dict) -> list[str]:
    """The ``## Model`` section of a report from the train stage's result: the family and the parameters fitted
    (what the search chose, not what was asked), the training figures and every candidate of the search."""
    if not result:
        return []
    params = dict(result.get("params") or {})
    family = params.pop("model", None) or ("tree classifier" if result.get("tree") else "embedding")
    lines = ["## Model", "", f"Family: **{family}**; trained in {result.get('seconds', 0):.1f} s, "
             f"{result.get('n_passes', '?')} passes over the rows.", "",
             "| parameter fitted | value |", "|---|---|"]
    lines += [f"| {name} | {value} |" for name, value in sorted(params.items())]
    figures = {**{f"held-out {k}": v for k, v in (result.get("held_out") or {}).items()},
               **{f"training {k}": v for k, v in (result.get("training") or {}).items()},
               **{k: result[k] for k in ("n_clusters", "beam", "n_unseen_labels", "backoffs", "best_epoch")
                  if k in result}}
    figures = {k: v for k, v in figures.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
    if figures:
        lines += ["", "| figure | value |", "|---|---:|"]
        lines += [f"| {name} | {value:.4g} |" if isinstance(value, float) else f"| {name} | {value:,} |"
                  for name, value in figures.items()]
    search = result.get("search") or []
    if search:
        lines += ["", f"Held-out search: {len(search)} fits, in the order made (screened: fitted with the cheap "
                  "settings, to rank; the model kept was fitted as chosen).", "",
                  "| # | parameters | held-out score | screened | seconds |", "|---:|---|---:|---|---:|"]
        lines += [f"| {i} | {', '.join(f'{k}={v}' for k, v in (r.get('params') or {}).items())} | "
                  f"{r.get('score', float('nan')):.4f} | {'yes' if r.get('screened') else ''} | "
                  f"{r.get('seconds', 0):.1f} |" for i, r in enumerate(search, 1)]
    return [*lines, ""]


def _stage_rows(stages: dict[str, dict]) -> list[str]:
    rows = ["| stage | status | seconds | peak memory (MB) | fingerprint | outputs |", "|---|---|---:|---:|---|---|"]
    for name, rec in stages.items():
        status = "reused" if rec.get("reused") else "computed"
        outputs = ", ".join(f"`{url}`" for url in rec.get("outputs", {}).values())
        peak = "" if rec.get("peak_rss_mb") is None else f"{rec['peak_rss_mb']:.0f}"
        rows.append(f"| {name} | {status} | {rec.get('seconds') or 0:.1f} | {peak} "
                    f"| `{rec.get('fingerprint', '')}` | {outputs} |")
    return rows


def write_report(out_dir: Path, *, run_dir: str, metrics: dict, stages: dict[str, dict], title: str,
                 dashboard: str | None, notes: list[str] | None = None, plots: dict[str, Path] | None = None,
                 sections: list[str] | None = None) -> str:
    """Write ``report.md``, ``metrics.json``, ``stages.json`` and the plots into ``out_dir``; returns the Markdown.

    Parameters
    ----------
    out_dir : Path
        A local directory (the flows copy it into the run directory afterwards).
    run_dir : str
        The run directory the report is for (path or fsspec URL), named in the report.
    metrics : dict
        From :func:`xmldask.jobs.evaluate` (all k).
    stages : dict
        Stage name to its record (:func:`flows.stages.run_stage`).
    title : str
    dashboard : str or None
        The Dask dashboard link of the run.
    notes : list of str, optional
        Lines added under the title (for instance the promotion decision of a refresh).
    plots : dict, optional
        Caption to a local PNG: copied into ``out_dir`` and linked from the report.
    sections : list of str, optional
        Markdown lines of further sections, after the stages (for instance the label tree's figures).
    """
    from xmldask import metrics as xm

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "metrics.json").write_text(json.dumps(metrics, indent=2, sort_keys=True, default=str) + "\n")
    (out_dir / "stages.json").write_text(json.dumps(stages, indent=2, default=str) + "\n")
    images = []
    for caption, src in (plots or {}).items():
        src = Path(src)
        if not src.is_file():
            continue
        dst = out_dir / src.name
        if src.resolve() != dst.resolve():
            shutil.copyfile(src, dst)
        images.append(f"![{caption}]({dst.name})")
    lines = [f"# {title}", ""]
    lines += [*(notes or []), ""] if notes else []
    lines += [f"Run directory: `{run_dir}`", f"Dask dashboard: {dashboard or 'none'}", "", "## Metrics", "",
              xm.report(table_metrics(metrics)), "## Stages", "", *_stage_rows(stages), "",
              "Seconds and peak memory (this process and its local Dask workers) are those of the run that computed "
              "the stage; a reused stage (a Prefect cache hit) cost nothing now and its outputs stay in the run "
              "directory that computed them. Each computed stage that runs on Dask (all but the ingests, which "
              "stream text in one process) keeps a Dask performance report (`performance.html`) beside its "
              "outputs.", ""]
    reports = [f"- {name}: `{rec['performance_report']}`" for name, rec in stages.items()
               if rec.get("performance_report")]
    if reports:
        lines += ["Performance reports:", "", *reports, ""]
    lines += model_lines((stages.get("train") or {}).get("result") or {})
    lines += sections or []
    if images:
        lines += ["## Plots", "", *[f"{img}\n" for img in images]]
    text = "\n".join(lines).rstrip() + "\n"
    (out_dir / "report.md").write_text(text)
    return text
