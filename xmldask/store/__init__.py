"""Zarr stores of row-blocked matrices and datasets; see :mod:`xmldask.store.layout` for the layout."""

from ._fs import check_target, exists, is_local, publish, remove, storage_root, store_url, temporary_sibling, zarr_store
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
    "check_target",
    "exists",
    "is_local",
    "open_csr",
    "open_dataset",
    "open_dense",
    "open_predictions",
    "publish",
    "remove",
    "storage_root",
    "store_url",
    "temporary_sibling",
    "to_scipy",
    "write_csr",
    "write_dense",
    "write_predictions",
    "zarr_store",
]
