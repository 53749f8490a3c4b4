"""What every benchmark script prints and writes: the Markdown table, the load line and the ``--json`` rows
(imported by name: the scripts run from ``bench/``)."""

from __future__ import annotations

import json
import os
from pathlib import Path


def markdown_table(rows: list[dict], keys: list[str]) -> str:
    """One Markdown table of ``rows`` with the columns ``keys`` (floats to 4 significant digits)."""
    def fmt(v):
        if isinstance(v, float):
            return f"{v:.4g}"
        if isinstance(v, int):
            return f"{v:,}"
        return str(v)

    lines = ["| " + " | ".join(keys) + " |", "|" + "---|" * len(keys)]
    lines += ["| " + " | ".join(fmt(r.get(k, "")) for k in keys) + " |" for r in rows]
    return "\n".join(lines)


def load_line() -> str:
    """The machine's load average and cores, printed under a table: a busy machine makes slow figures."""
    one, five, fifteen = os.getloadavg()
    return f"load average (1, 5, 15 min): {one:.1f}, {five:.1f}, {fifteen:.1f}; {os.cpu_count()} cores"


def write_json(path: str | None, rows: list[dict]) -> None:
    """``--json FILE``: the table's rows as a list of JSON objects (nothing without a path)."""
    if path:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(json.dumps(rows, indent=2, default=float))
