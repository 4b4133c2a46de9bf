"""Progress bars for every command, shown only on a terminal.

A tqdm bar redraws itself with carriage returns and cursor codes: on a terminal that is one changing line, in a
redirected file (a cluster job's `.out`, `2> log`) it is a stream of frames, about 1,200 characters each. `bar`
is every command's one way to make a bar: it draws only when the caller asks for one (`--no-progress`,
`train.progress`, `eval.progress`) and stderr is a terminal; elsewhere the bar is disabled and the commands say what
they do in plain log lines (training every `train.log_every` steps). `TerminalOnly` keeps such a line off a
terminal that is showing a bar (the line still reaches train.log).
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Iterable
from typing import Any

from tqdm import tqdm

_shown = 0  # bars drawing on the terminal now


def on_terminal() -> bool:
    """Whether stderr (where bars and log lines go) is a terminal."""
    return bool(getattr(sys.stderr, "isatty", lambda: False)())


class Bar(tqdm):
    """tqdm, counted while it draws (so that log lines stay off the terminal meanwhile)."""

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self._counted = not self.disable
        if self._counted:
            global _shown
            _shown += 1

    def close(self) -> None:
        if getattr(self, "_counted", False):
            global _shown
            _shown, self._counted = _shown - 1, False
        super().close()


def bar(iterable: Iterable | None = None, *, enabled: bool = True, **kwargs: Any) -> tqdm:
    """A tqdm bar over `iterable` (or a manual one) that draws only when `enabled` and stderr is a terminal."""
    kwargs.setdefault("dynamic_ncols", True)
    return Bar(iterable, disable=not (enabled and on_terminal()), **kwargs)


def showing() -> bool:
    """Whether a bar is drawing on the terminal now."""
    return _shown > 0


class TerminalOnly(logging.Filter):
    """For a console handler: drops records marked `progress_line` while a bar shows (the bar says the same)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not (getattr(record, "progress_line", False) and showing())
