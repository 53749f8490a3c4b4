"""What every benchmark script shares: the Markdown table, the load line, the ``--json`` rows, and the
measurement in a fresh child process (imported by name: the scripts run from ``bench/``)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
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


def run_child(script: str, spec: dict, *, timeout: float | None = None, python: str = sys.executable,
              args: tuple[str, ...] = ("--child",)) -> dict:
    """``python script --child SPEC_JSON`` in a fresh process (one measurement: its own memory and caches);
    the last line it prints, parsed as JSON, or ``{"error", "stderr"}`` when it fails or times out."""
    try:
        result = subprocess.run([python, script, *args, json.dumps(spec)], capture_output=True, text=True,
                                timeout=timeout, env={**os.environ, "PYTHONWARNINGS": "ignore"})
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout:.0f} s"}
    if result.returncode != 0:
        return {"error": f"exit {result.returncode}: {result.stderr.strip().splitlines()[-1:]}",
                "stderr": result.stderr[-4000:]}
    return json.loads(result.stdout.strip().splitlines()[-1])


def main_or_child(main, child) -> None:
    """The entry point of a script: ``--child SPEC_JSON`` runs ``child(spec)`` (see :func:`run_child`), else
    ``main()``."""
    if len(sys.argv) == 3 and sys.argv[1] == "--child":
        child(json.loads(sys.argv[2]))
    else:
        main()
