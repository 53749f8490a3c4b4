"""xmldask: extreme multi-label classification out of core, on Dask, from Zarr stores."""

from importlib.metadata import PackageNotFoundError, version

from .store import Dataset, open_csr, open_dataset, open_dense, storage_root, store_url

try:
    __version__ = version("xmldask")
except PackageNotFoundError:  # running from a source tree that was not installed
    __version__ = "0+unknown"

__all__ = ["Dataset", "open_csr", "open_dataset", "open_dense", "storage_root", "store_url", "__version__"]
