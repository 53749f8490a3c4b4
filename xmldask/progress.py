"""Progress of long work: the INFO lines of the library loggers that report a long job step by step,
passed to a callable (a terminal, a Prefect run log) whatever the logging level.

>>> import logging
>>> lines = []
>>> with progress_to(lines.append, names=("xmldask.tree.growth",)):
...     logging.getLogger("xmldask.tree.growth").info("tree level %d: %d nodes", 0, 1)
>>> lines
['tree level 0: 1 nodes']
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator

__all__ = ["PROGRESS_LOGGERS", "progress_to"]

#: the loggers whose INFO lines are a long job's progress: one line per candidate of a held-out search, per
#: level of a growing tree, per pass of the tree classifier, per step of the label-centroid model (and its choice)
PROGRESS_LOGGERS = ("xmldask.model_selection", "xmldask.tree.growth", "xmldask.models.tree_classifier",
                    "xmldask.models.centroid")


class _Emit(logging.Handler):
    def __init__(self, emit: Callable[[str], object]):
        super().__init__(logging.INFO)
        self.emit_line = emit

    def emit(self, record: logging.LogRecord) -> None:
        self.emit_line(record.getMessage())


@contextlib.contextmanager
def progress_to(emit: Callable[[str], object], names: tuple[str, ...] = PROGRESS_LOGGERS) -> Iterator[None]:
    """Within the block, every INFO line of the loggers ``names`` goes to ``emit`` (and only there: it is
    not also propagated to the root logger's handlers); levels and handlers are restored afterwards."""
    handler = _Emit(emit)
    saved = []
    for name in names:
        source = logging.getLogger(name)
        saved.append((source, source.level, source.propagate))
        source.addHandler(handler)
        source.setLevel(logging.INFO)
        source.propagate = False
    try:
        yield
    finally:
        for source, level, propagate in saved:
            source.removeHandler(handler)
            source.setLevel(level)
            source.propagate = propagate
