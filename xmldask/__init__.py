"""xmldask: extreme multi-label classification out of core, on Dask, from Zarr stores."""

from importlib.metadata import PackageNotFoundError, version

import dask.array as _da

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
