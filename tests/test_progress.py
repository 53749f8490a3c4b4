"""Progress lines of long work reach a terminal or a run log whatever the logging level."""

from __future__ import annotations

import logging

from xmldask.progress import PROGRESS_LOGGERS, progress_to


def test_progress_to_passes_the_info_lines_of_the_progress_loggers_only_within_the_block():
    sources = [logging.getLogger(name) for name in PROGRESS_LOGGERS]
    before = [(s.level, s.propagate, list(s.handlers)) for s in sources]
    lines = []
    with progress_to(lines.append):
        for i, source in enumerate(sources):
            source.info("step %d", i)
            source.debug("not this one")
        logging.getLogger("xmldask.models").info("nor a logger that is not a progress logger")
    sources[0].info("nor after the block")
    assert lines == [f"step {i}" for i in range(len(sources))]
    assert [(s.level, s.propagate, list(s.handlers)) for s in sources] == before
