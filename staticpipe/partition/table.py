"""Plain-text tables for the profile and placement reports: right-aligned numbers, one header line."""
from __future__ import annotations

from typing import Sequence

from ..memory_model import human_bytes

__all__ = ["format_table", "human_bytes"]


def format_table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    """Columns as wide as their widest cell; the first column left-aligned, the others right-aligned."""
    cells = [[str(c) for c in headers]] + [[str(c) for c in row] for row in rows]
    widths = [max(len(row[k]) for row in cells) for k in range(len(headers))]
    lines = []
    for row in cells:
        lines.append("  ".join(c.ljust(w) if k == 0 else c.rjust(w) for k, (c, w) in enumerate(zip(row, widths))))
    return "\n".join(lines)
