"""Plain aligned text tables: rendering time linear in the rows, for stores of any size.

(rich's ``Table`` measures and wraps every cell; for the 700 parameters of a 70B-class model
that alone would take seconds, and ``ucformat inspect`` is meant to answer at once.)
"""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["render_table"]

_GAP = "  "


def render_table(
    title: str,
    columns: Sequence[str],
    rows: Sequence[Sequence[str]],
    *,
    right_aligned: frozenset[str] = frozenset(),
) -> str:
    """``title``, then a header, a rule and one line per row, columns padded to their widths."""
    widths = [
        max([len(column), *(len(row[index]) for row in rows)])
        for index, column in enumerate(columns)
    ]

    def line(cells: Sequence[str]) -> str:
        padded = (
            cell.rjust(width) if column in right_aligned else cell.ljust(width)
            for cell, width, column in zip(cells, widths, columns, strict=True)
        )
        return _GAP.join(padded).rstrip()

    rule = _GAP.join("-" * width for width in widths)
    return "\n".join([title, line(columns), rule, *(line(row) for row in rows)])
