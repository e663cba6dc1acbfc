"""A prompt's prefill shown as it goes (`run --prompt`, `run --chat`): tokens done of N and the time left, on a
terminal's stderr, once the prefill has taken longer than SHOW_AFTER_S; rewritten in place and cleared at its end."""

from __future__ import annotations

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
