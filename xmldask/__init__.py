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

__all__ = ["Dataset", "open_csr", "open_dataset", "open_dense", "storage_root", "store_url", "__version__"]
