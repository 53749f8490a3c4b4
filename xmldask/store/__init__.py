"""Zarr stores of row-blocked matrices and datasets; see :mod:`xmldask.store.layout` for the layout."""

from ._fs import exists, remove, storage_root, store_url
from .csr import CSRWriter, open_csr, to_scipy, write_csr
from .dataset import Dataset, DatasetWriter, format_info, open_dataset
from .dense import open_dense, write_dense
from .integrity import StoreBusyError
from .layout import LAYOUT_VERSION, StoreError
from .predictions import Predictions, open_predictions, write_predictions

__all__ = [
    "LAYOUT_VERSION",
    "CSRWriter",
    "Dataset",
    "format_info",
    "Predictions",
    "DatasetWriter",
    "StoreBusyError",
    "StoreError",
    "exists",
    "open_csr",
    "open_dataset",
    "open_dense",
    "open_predictions",
    "remove",
    "storage_root",
    "store_url",
    "to_scipy",
    "write_csr",
    "write_dense",
    "write_predictions",
]
