"""xmldask: extreme multi-label classification out of core, on Dask, from Zarr stores."""

import os as _os
from importlib.metadata import PackageNotFoundError, version

# OpenBLAS's idle threads spin for 2**28 cycles (~0.1 s) before they sleep, and this process runs two OpenBLAS pools
# (NumPy's and SciPy's) beside the Dask threads on few cores: each pool's spinning threads slowed the other's calls
# (bibtex's search, a 1,836 x 1,836 Cholesky: 0.05 s alone, 0.11-0.85 s between NumPy products). They sleep at once
# now (OpenBLAS reads this when it is loaded: before NumPy is imported; a value the user set is kept).
_os.environ.setdefault("OPENBLAS_THREAD_TIMEOUT", "4")

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
