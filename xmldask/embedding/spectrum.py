"""Spectrum of ``Y^T Y`` (empirical label covariance) or ``X^T X`` by randomized PCA, as a table and a plot.

This is the analysis of Figure 1b of the Rembrandt paper: Algorithm 1 (two passes for ``q = 1``)
estimates the top of the spectrum, whose decay suggests the embedding dimension. Used by
``xmldask spectrum``.

References
----------
P. Mineiro and N. Karampatziakis, "Fast Label Embeddings via Randomized Linear Algebra", ECML PKDD
2015, Section 4.3.2 and Figure 1b; Algorithm 1.
"""

from __future__ import annotations

import csv
import logging
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..linalg.randomized import randomized_pca
from ..scheduling import task_memory_limit

__all__ = ["Spectrum", "compute_spectrum", "write_spectrum"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Spectrum:
    """Top eigenvalues of ``A^T A`` (``A = Y`` or ``X``, optionally centred).

    Attributes
    ----------
    eigenvalues : ndarray, shape (k,)
        Decreasing.
    trace : float
        Sum of all eigenvalues of ``A^T A``.
    matrix : str
        ``"Y"`` or ``"X"``.
    url : str
    n_samples, n_columns, n_passes : int
    seconds : float
    center : bool
    """

    eigenvalues: np.ndarray
    trace: float
    matrix: str
    url: str
    n_samples: int
    n_columns: int
    n_passes: int
    seconds: float
    center: bool

    def rows(self) -> list[dict]:
        """One row per eigenvalue: rank, eigenvalue, share of the trace, cumulative share."""
        share = self.eigenvalues / self.trace if self.trace > 0 else np.zeros_like(self.eigenvalues)
        cumulative = np.cumsum(share)
        return [{"rank": i + 1, "eigenvalue": float(v), "share": float(s), "cumulative_share": float(c)}
                for i, (v, s, c) in enumerate(zip(self.eigenvalues, share, cumulative))]


#: share of a worker's memory limit per thread that the spectrum's column-sized dense operands of a task may take
MEMORY_SHARE = 0.25

#: eigenvalues of the spectrum on every path (``xmldask spectrum``, the pipeline's and the refresh's stage)
SPECTRUM_COMPONENTS = 100


def compute_spectrum(url: str, *, matrix: str = "Y", n_components: int = SPECTRUM_COMPONENTS, oversample: int = 20,
                     n_iter: int = 1, center: bool = False, random_state=0) -> Spectrum:
    """Estimate the top of the spectrum of ``Y^T Y`` or ``X^T X`` of a dataset store (Algorithm 1).

    Parameters
    ----------
    url : str
        Dataset store.
    matrix : {"Y", "X"}, default "Y"
    n_components : int, default 100
        Eigenvalues to estimate (at most the number of columns).
    oversample, n_iter : int
        ``p`` and ``q`` of Algorithm 1 (``q + 1`` passes).
    center : bool, default False
        Centre the columns first (covariance instead of second-moment matrix).
    random_state : None, int or numpy.random.Generator, default 0

    Returns
    -------
    Spectrum
    """
    from ..store import open_dataset

    if matrix not in ("Y", "X"):
        raise ValueError(f"matrix must be 'Y' or 'X', but is {matrix!r}")
    ds = open_dataset(url)
    A = ds.Y if matrix == "Y" else ds.X
    k = min(int(n_components), A.shape[1])
    k, oversample, split_every = _fitting_columns(A, k, oversample, task_memory_limit(), url)
    start = time.perf_counter()
    res = randomized_pca(A, k, oversample=oversample, n_iter=n_iter, center=center, random_state=random_state,
                         split_every=split_every)
    return Spectrum(eigenvalues=res.eigenvalues, trace=res.trace, matrix=matrix, url=str(url),
                    n_samples=int(A.shape[0]), n_columns=int(A.shape[1]), n_passes=res.n_passes,
                    seconds=time.perf_counter() - start, center=bool(center))


def _fitting_columns(A, k: int, oversample: int, worker_limit: int | None, url: str) -> tuple[int, int, int]:
    """``(k, oversample, split_every)`` whose column-sized dense operands (``n_columns x (k + oversample)``: the
    sketch, a row block's product, the ``split_every`` inputs and the output of a combine) take at most
    :data:`MEMORY_SHARE` of a worker's memory limit: fewer eigenvalues, and pairwise sums, where the columns are
    many (a million labels) and the workers small; a clear error where not even two columns fit."""
    if not worker_limit:
        return k, oversample, 8
    from ..linalg import working_dtype

    column = A.shape[1] * np.dtype(working_dtype(A.dtype)).itemsize
    for split_every in (8, 2):
        fit = int(MEMORY_SHARE * worker_limit // ((split_every + 3) * column))
        if fit >= k + oversample:
            return k, oversample, split_every
    if fit < 2:
        raise MemoryError(f"the spectrum of {url} ({A.shape[1]:,} columns) needs workers of at least "
                          f"{5 * 2 * column / MEMORY_SHARE / 2**20:,.0f} MiB (two dense columns of that length), "
                          f"not {worker_limit / 2**20:,.0f} MiB: give the workers more memory")
    oversample = min(oversample, fit // 2)
    logger.warning(f"spectrum of {A.shape[1]:,} columns: {fit - oversample} eigenvalues instead of {k} (the workers' "
                   f"memory limit of {worker_limit / 2**20:,.0f} MiB holds {fit} dense columns of that length)")
    return min(k, fit - oversample), oversample, 2


def write_spectrum(spectrum: Spectrum, out_dir, *, plot: bool = True, overwrite: bool = False) -> dict[str, Path]:
    """Write ``spectrum.csv``, ``spectrum.md`` and (with ``plot``) ``spectrum.png`` into ``out_dir``.

    Existing files of those names are replaced only with ``overwrite`` (``FileExistsError`` before anything is
    written otherwise).

    Returns
    -------
    dict
        ``{"csv": path, "md": path, "png": path}`` of the files written.
    """
    out = Path(out_dir)
    rows = spectrum.rows()
    paths = {"csv": out / "spectrum.csv", "md": out / "spectrum.md"}
    present = [str(p) for p in [*paths.values(), *([out / "spectrum.png"] if plot else [])] if p.exists()]
    if present and not overwrite:
        raise FileExistsError(f"{', '.join(present)} already exist{'s' if len(present) == 1 else ''}; pass "
                              "overwrite=True (--overwrite) to replace, or another --out directory")
    out.mkdir(parents=True, exist_ok=True)
    with open(paths["csv"], "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    what = "label covariance Y^T Y" if spectrum.matrix == "Y" else "feature second moments X^T X"
    lines = [f"# Spectrum of the {'centred ' if spectrum.center else ''}{what}", "",
             f"{spectrum.url}: {spectrum.n_samples:,} rows, {spectrum.n_columns:,} columns; randomized PCA "
             f"(Algorithm 1), {spectrum.n_passes} passes, {spectrum.seconds:.1f} s; trace {spectrum.trace:.6g}.", "",
             "| rank | eigenvalue | share of trace | cumulative share |", "|---:|---:|---:|---:|"]
    lines += [f"| {r['rank']} | {r['eigenvalue']:.6g} | {r['share']:.4%} | {r['cumulative_share']:.4%} |"
              for r in rows]
    paths["md"].write_text("\n".join(lines) + "\n")
    if plot:
        paths["png"] = out / "spectrum.png"
        _plot(spectrum, paths["png"])
    return paths


def _plot(spectrum: Spectrum, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    values = spectrum.eigenvalues
    ranks = np.arange(1, len(values) + 1)
    fig, ax = plt.subplots(figsize=(6, 4), dpi=100)
    try:
        positive = values > 0
        ax.plot(ranks[positive], values[positive], marker=".", linewidth=1)
        ax.set_yscale("log")
        ax.set_xlabel("rank")
        ax.set_ylabel("eigenvalue")
        name = "Y^T Y" if spectrum.matrix == "Y" else "X^T X"
        ax.set_title(f"Spectrum of {'centred ' if spectrum.center else ''}{name} ({_data_name(spectrum.url)})")
        ax.grid(True, which="both", alpha=0.3)
        fig.tight_layout()
        fig.savefig(path)
    finally:
        plt.close(fig)


def _data_name(url: str) -> str:
    """A dataset's name for a title: the files it was ingested from (a pipeline's stage store is always named
    ``data.zarr``), else the store's own name."""
    try:
        from ..store import open_dataset

        paths = [str(src.get("path", "")) for src in open_dataset(url).meta.get("sources") or []]
    except Exception:  # noqa: BLE001 - not a dataset store (a plain array): its name will do
        paths = []
    names = [Path(p.rstrip("/")).name for p in paths if p]
    if not names:
        return Path(str(url).rstrip("/")).name
    return ", ".join(names[:2]) + (f" and {len(names) - 2} more" if len(names) > 2 else "")
