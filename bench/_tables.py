"""The Markdown table the benchmark scripts print (imported by name: the scripts run from ``bench/``)."""

from __future__ import annotations


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
