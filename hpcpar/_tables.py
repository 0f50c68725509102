"""Text tables: one formatter (``tabulate``) for every table hpcpar prints or writes.

Markdown pipe tables (reports, the record schema) and aligned plain-text tables (``hpcpar status``,
``hpcpar info``) come out of :func:`text_table`, so their padding, escaping and number handling
agree everywhere. Cells arrive as text already formatted by the caller: number parsing is off, so
``"0.0010"`` or ``"007"`` is printed as given."""

from __future__ import annotations

from collections.abc import Sequence

from tabulate import tabulate

__all__ = ["text_table"]


def text_table(header: Sequence[str], rows: Sequence[Sequence[object]], markdown: bool = True,
               align: Sequence[str] | None = None) -> str:
    """Lay out a table: a header line (and, for Markdown, the rule below it) then one line per row;
    ``str()`` of each cell is shown.

    ``markdown``: a Markdown pipe table (``|`` in cells escaped), else plain columns separated by
    two spaces without trailing blanks. ``align``: ``"left"`` or ``"right"`` per column; all left
    when None."""
    def cell(value: object) -> str:
        text = str(value)
        return text.replace("|", "\\|") if markdown else text

    table = tabulate([[cell(c) for c in row] for row in rows], [cell(h) for h in header],
                     tablefmt="github" if markdown else "plain", disable_numparse=True,
                     colalign=tuple(align) if align else None)
    return "\n".join(line.rstrip() for line in table.splitlines())
