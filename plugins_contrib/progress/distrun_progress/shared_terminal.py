"""The launcher's side of a terminal that rank 0's bar draws on (torch-free, rich-free).

Two processes write to that terminal: rank 0 draws the bar directly, and the launcher relays
every worker's lines (the model summary, warnings, rank 1's output) from their pipes. The bar
is a partial line: rich leaves the cursor at its end and, at each refresh, returns to the
line's start and redraws it. A relayed line written while the bar is there lands after the
bar's frame, and the frame stays in the scrollback on that line (``0/60 ... ETA -:--:--  |
Name | Type``). So while a bar may be drawn, the launcher's writes to that terminal start by
clearing the current line; the bar redraws itself below them at its next refresh.
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Iterator
from typing import IO, Any

__all__ = ["CLEAR_LINE", "LineClearing", "clearing_lines"]

#: carriage return, then erase the whole line (what rich itself sends before a redraw)
CLEAR_LINE = "\r\x1b[2K"


class LineClearing:
    """A text stream that clears the terminal's current line before each new line it starts.

    Only where this stream's previous write ended a line (or it wrote nothing yet), so
    ``print("a")``'s two writes (``"a"``, then ``"\\n"``) stay one line. Everything else is
    the wrapped stream's.
    """

    def __init__(self, stream: IO[str]) -> None:
        self._stream = stream
        self._at_line_start = True

    def write(self, text: str) -> int:
        if not text:
            return 0
        out = CLEAR_LINE + text if self._at_line_start else text
        self._at_line_start = text.endswith("\n")
        self._stream.write(out)
        return len(text)

    def writelines(self, lines: Any) -> None:
        for line in lines:
            self.write(line)

    def __getattr__(self, name: str) -> Any:  # flush, fileno, isatty, encoding, ...
        return getattr(self._stream, name)


def _same_terminal(stream: IO[str], tty: str) -> bool:
    try:
        return stream.isatty() and os.path.samefile(os.ttyname(stream.fileno()), tty)
    except (OSError, ValueError, AttributeError):
        return False


@contextlib.contextmanager
def clearing_lines(tty: str) -> Iterator[None]:
    """While it lasts, ``sys.stdout`` and ``sys.stderr`` (those on the terminal ``tty``) are
    :class:`LineClearing` streams; the launchers relay workers' lines into them."""
    saved = sys.stdout, sys.stderr
    if _same_terminal(sys.stdout, tty):
        sys.stdout = LineClearing(sys.stdout)  # type: ignore[assignment]
    if _same_terminal(sys.stderr, tty):
        sys.stderr = LineClearing(sys.stderr)  # type: ignore[assignment]
    try:
        yield
    finally:
        sys.stdout, sys.stderr = saved
