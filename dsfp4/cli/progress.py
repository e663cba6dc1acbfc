"""What long steps show on a terminal's stderr: a prompt's prefill as it goes (`run --prompt`, `run --chat`), tokens
done of N and the time left, once the prefill has taken longer than SHOW_AFTER_S, rewritten in place and cleared at
its end; and the stages of an engine's start, the doctor's measurements and `bench --project`, a line each, which the
library logs at INFO on the "dsfp4" logger (a library user sees them by configuring logging)."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import TextIO

# a prefill shorter than this shows nothing
SHOW_AFTER_S = 1.0


class PrefillProgress:
    """The decoder's progress callback (Decoder.progress): (tokens done, of how many), from (0, n) at each prefill."""

    def __init__(
        self, out: TextIO, clock: Callable[[], float] = time.monotonic, show_after_s: float = SHOW_AFTER_S
    ) -> None:
        self.out, self.clock, self.show_after_s = out, clock, show_after_s
        self.start, self.width = 0.0, 0

    def __call__(self, done: int, total: int) -> None:
        now = self.clock()
        if done == 0:
            self.start, self.width = now, 0
            return
        elapsed = now - self.start
        if done < total and elapsed > self.show_after_s:
            left = elapsed * (total - done) / done
            self._write(f"prefill {done:,}/{total:,} tokens, {left:.0f} s left")
        elif done >= total and self.width:
            self._write("")

    def _write(self, line: str) -> None:
        """The line in place of the last one (padded over it), without a newline."""
        self.out.write("\r" + line.ljust(self.width) + ("\r" if not line else ""))
        self.out.flush()
        self.width = len(line) if line else 0


def show_stages(out: TextIO) -> logging.Handler | None:
    """The library's stage lines on `out`, "... stage" a line, where it is a terminal (a pipe or a test's capture
    gets none) -> the handler installed, or None."""
    if not out.isatty():
        return None
    handler = logging.StreamHandler(out)
    handler.setFormatter(logging.Formatter("... %(message)s"))
    log = logging.getLogger("dsfp4")
    log.addHandler(handler)
    log.setLevel(logging.INFO)
    return handler
