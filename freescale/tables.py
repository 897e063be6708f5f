"""One plain-text table printer for every command and benchmark that prints rows (no dependency)."""

from __future__ import annotations

from typing import Any


def format_cell(value: Any) -> str:
    """Floats with 4 decimals below 10, one above (thousands separated); anything else as ``str``."""
    if isinstance(value, float):
        return f"{value:,.4f}" if abs(value) < 10 else f"{value:,.1f}"
    return str(value)


def print_table(rows: list[dict[str, Any]], columns: list[str], align: str = "right") -> None:
    """``rows`` (dicts; a missing column prints empty) under a header of ``columns``, each column as
    wide as its widest cell; ``align``: ``right`` (numbers) or ``left`` (text)."""
    cells = [[format_cell(r.get(c, "")) for c in columns] for r in rows]
    widths = [max([len(c), *(len(row[i]) for row in cells)]) for i, c in enumerate(columns)]
    pad = str.rjust if align == "right" else str.ljust
    print("  ".join(pad(c, w) for c, w in zip(columns, widths)))
    for row in cells:
        print("  ".join(pad(v, w) for v, w in zip(row, widths)))
