"""Tables that can be read wherever they are read: in a terminal of any width, in a redirected log, in a report.

    show_table(console, title, head, body, justify="lr")   on screen (``megamoe check``, ``megamoe bench``)
    markdown_table(head, body) -> str                      the same rows in a written report (check.md, results.md)

rich shrinks a boxed table that is wider than the terminal by cutting its cells ("deepgemm-sm90…", "7.70e-…"),
and a redirected stream is 80 columns to rich, so a log would keep only the cut cells. ``show_table`` draws the
boxed table only in a terminal wide enough for every cell in full; anywhere else (a pipe, a file, a narrow
terminal) it prints the same rows as a Markdown table, never cut: its lines may pass the width, a pager or an
editor shows them whole. A cell is a plain string (never read as markup: "name [p2]" stays as written) or a
``rich.text.Text`` for colour (``Text("ok", style="green")``), whose plain text goes into the Markdown.
"""

from __future__ import annotations


def _plain(cell) -> str:
    return cell.plain if hasattr(cell, "plain") else str(cell)


def markdown_table(head: list[str], body: list[list[str]]) -> str:
    """``head`` and each row of ``body`` (strings or ``Text``) as a GitHub Markdown table, cells in full (a '|'
    inside a cell is escaped)."""
    def line(cells):
        return "| " + " | ".join(_plain(c).replace("|", "\\|") for c in cells) + " |"

    return "\n".join([line(head), "|" + "---|" * len(head)] + [line(row) for row in body])


def _rich_table(title: str, head: list[str], body: list[list[str]], justify: str):
    from rich.table import Table
    from rich.text import Text

    t = Table(title=Text(title))
    for i, h in enumerate(head):  # headers and cells as Text: "name [p2]" is never read as markup
        t.add_column(Text(h), justify="right" if (justify[i] if i < len(justify) else justify[-1]) == "r" else "left",
                     no_wrap=True)
    for row in body:
        t.add_row(*(c if isinstance(c, Text) else Text(str(c)) for c in row))
    return t


def fits(console, table) -> bool:
    """Whether ``table`` shows every cell in full on ``console``: a terminal at least as wide as its widest line."""
    from rich.measure import Measurement

    if not console.is_terminal:
        return False
    unbounded = console.options.update_width(1 << 16)  # the table's natural width, not one already fitted to the screen
    return Measurement.get(console, unbounded, table).maximum <= console.width


def show_table(console, title: str, head: list[str], body: list[list[str]], justify: str = "l") -> None:
    """Print a table on ``console``: boxed where it fits (``fits``), else titled Markdown. ``justify``: one letter
    per column, 'l' or 'r' (the last one repeats for the columns past it)."""
    table = _rich_table(title, head, body, justify)
    if fits(console, table):
        console.print(table)
        return
    console.print(f"{title}:" if title else "", markup=False, highlight=False, soft_wrap=True)
    console.print(markdown_table(head, body), markup=False, highlight=False, soft_wrap=True)
