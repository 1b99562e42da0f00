"""One progress bar for everything that takes more than a few seconds (``megamoe check``, ``megamoe bench``).

It never refreshes from a background thread (``auto_refresh=False``): it is redrawn between steps only, so no
thread runs beside a timed call. It shows the elapsed time and rich's estimate of the time left, which is good
only over steps of like cost: ``phase`` starts a new bar for work of another kind.
"""

from __future__ import annotations


class Progress:
    def __init__(self, enabled: bool, total: float, description: str = ""):
        self.p = None
        if not enabled:
            return
        from rich.progress import (BarColumn, MofNCompleteColumn, Progress as RichProgress, TextColumn,
                                   TimeElapsedColumn, TimeRemainingColumn)

        self.p = RichProgress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                              TextColumn("left"), TimeRemainingColumn(), auto_refresh=False, transient=False)
        self.p.start()
        self.task = self.p.add_task(description, total=total)

    def phase(self, description: str, total: float) -> None:
        """A new bar under the last one, for steps of another cost; ``step`` advances it from now on."""
        if self.p is not None:
            self.task = self.p.add_task(description, total=total)
            self.p.refresh()

    def step(self, description: str, advance: float = 1) -> None:
        if self.p is not None:
            self.p.update(self.task, advance=advance, description=description)
            self.p.refresh()

    def describe(self, description: str) -> None:
        if self.p is not None:
            self.p.update(self.task, description=description)
            self.p.refresh()

    def stop(self) -> None:
        if self.p is not None:
            self.p.stop()
            self.p = None

    def __enter__(self) -> "Progress":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()
