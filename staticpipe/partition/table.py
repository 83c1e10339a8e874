"""Plain-text tables for the profile and placement reports: right-aligned numbers, one header line."""
from __future__ import annotations

from typing import Sequence


def human_bytes(n: float) -> str:
    units = ("B", "KiB", "MiB", "GiB", "TiB")
    k = 0
    while abs(n) >= 1024 and k < len(units) - 1:
        n, k = n / 1024, k + 1
    return f"{n:.0f} B" if k == 0 else f"{n:.1f} {units[k]}"


def format_table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    """Columns as wide as their widest cell; the first column left-aligned, the others right-aligned."""
    cells = [[str(c) for c in headers]] + [[str(c) for c in row] for row in rows]
    widths = [max(len(row[k]) for row in cells) for k in range(len(headers))]
    lines = []
    for row in cells:
        lines.append("  ".join(c.ljust(w) if k == 0 else c.rjust(w) for k, (c, w) in enumerate(zip(row, widths))))
    return "\n".join(lines)
