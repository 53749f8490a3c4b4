"""Synthesize text data under the storage root, ingest it, summarise it (`xmldask demo`)."""

from __future__ import annotations

import logging
import time

from .store import Dataset, exists, format_info, open_dataset, store_url

logger = logging.getLogger(__name__)


def run_demo(*, root: str | None = None, n_samples: int = 100_000, n_features: int = 50_000,
             n_labels: int = 10_000, seed: int = 0, echo=print) -> dict[str, Dataset]:
    """Generate a synthetic train/test pair as XC text under the storage root, ingest both, print summaries.

    Everything lands in ``<root>/demo/<parameters>/``: ``train.txt.gz``, ``test.txt.gz`` and the
    dataset stores ``train.zarr``, ``test.zarr``. What already exists there is reused.

    Returns
    -------
    dict
        ``{"train": Dataset, "test": Dataset}``.
    """
    from .datasets import write_synthetic_text
    from .io import ingest

    base = store_url(f"demo/synth-n{n_samples}-d{n_features}-l{n_labels}-seed{seed}", root=root)
    out = {}
    for split, n in (("train", n_samples), ("test", max(1, n_samples // 5))):
        text, store = f"{base}/{split}.txt.gz", f"{base}/{split}.zarr"
        start = time.perf_counter()
        if exists(store):
            ds = open_dataset(store)
            echo(f"{split}: reusing {store}")
        else:
            if not exists(text):
                echo(f"{split}: generating {n:,} synthetic rows into {text}")
                write_synthetic_text(text, n_samples=n, n_features=n_features, n_labels=n_labels, seed=seed,
                                     split=split)
            echo(f"{split}: ingesting {text} into {store}")
            ds = ingest(text, store, progress=True)
            echo(f"{split}: done in {time.perf_counter() - start:.1f} s")
        echo(format_info(ds.info()))
        out[split] = ds
    return out
