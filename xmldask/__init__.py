"""xmldask: extreme multi-label classification out of core, on Dask, from Zarr stores."""

import os as _os
from importlib.metadata import PackageNotFoundError, version

# OpenBLAS's idle threads spin for 2**28 cycles (~0.1 s) before they sleep, and this process runs two OpenBLAS pools
# (NumPy's and SciPy's) beside the Dask threads on few cores: each pool's spinning threads slowed the other's calls
# (bibtex's search, a 1,836 x 1,836 Cholesky: 0.05 s alone, 0.11-0.85 s between NumPy products). They sleep at once
# now (OpenBLAS reads this when it is loaded: before NumPy is imported; a value the user set is kept).
_os.environ.setdefault("OPENBLAS_THREAD_TIMEOUT", "4")
# NumPy asks the kernel for transparent huge pages (madvise) for every array of 4 MiB or more. A pass allocates and
# frees such temporaries in every task, and a huge page is zeroed whole at its first touch (with the kernel's
# defrag=madvise, compacted first if none is free: numpy/numpy#31590); on this project's machine that first touch ran
# at 0.2 GB/s against 2.4-27 GB/s in small pages, half of bibtex's default training (docs/benchmarks.md). Off unless
# the user set it: read by NumPy at its import, so set before it here; where NumPy was imported first, turned off
# in it too. Worker processes started from here inherit the variable.
if "NUMPY_MADVISE_HUGEPAGE" not in _os.environ:
    _os.environ["NUMPY_MADVISE_HUGEPAGE"] = "0"
    import sys as _sys

    if "numpy" in _sys.modules:
        try:
            from numpy._core.multiarray import _set_madvise_hugepage
        except ImportError:  # another NumPy layout: the variable reaches only the processes started from here
            pass
        else:
            _set_madvise_hugepage(False)

import dask.array as _da  # noqa: E402

if "_array_expr" in _da.Array.__module__:
    raise ImportError(
        "xmldask builds its passes from dask's classic array graphs (blockwise, to_delayed, a future as a "
        "chunk), which dask's opt-in array-expression engine does not offer yet; turn it off with "
        "DASK_ARRAY__QUERY_PLANNING=False (or dask.config.set({'array.query-planning': False}) before "
        "dask.array is first imported)")

from .store import Dataset, open_csr, open_dataset, open_dense, storage_root, store_url

try:
    __version__ = version("xmldask")
except PackageNotFoundError:  # running from a source tree that was not installed
    __version__ = "0+unknown"

__all__ = ["Dataset", "load_model", "open_csr", "open_dataset", "open_dense", "storage_root", "store_url",
           "__version__"]


def load_model(url: str):
    """The fitted model saved at ``url``, of whichever class its store records (a classifier of any family, an
    ensemble, a label tree, an embedding): :func:`xmldask.models.load_model`."""
    from .models import load_model as load

    return load(url)
