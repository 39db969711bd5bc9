"""Terminal progress line on stderr: sent / completed / errors / elapsed (rewritten in place).
Only on a terminal: a pipe or a log file gets no progress noise."""

from __future__ import annotations

import time
from typing import TextIO

REFRESH_S = 0.25


class Progress:
    def __init__(self, stream: TextIO, enabled: bool | None = None) -> None:
        self.stream = stream
        self.enabled = bool(getattr(stream, "isatty", lambda: False)()) if enabled is None else enabled
        self.start = time.monotonic()
        self.sent = self.completed = self.errors = 0
        self._shown = 0.0
        self._printed = False

    def on_sent(self) -> None:
        self.sent += 1
        self.show()

    def on_done(self, ok: bool) -> None:
        self.completed += 1
        self.errors += 0 if ok else 1
        self.show()

    def line(self) -> str:
        return (f"observe: sent {self.sent}, completed {self.completed}, errors {self.errors}, "
                f"elapsed {time.monotonic() - self.start:.1f}s")

    def show(self, force: bool = False) -> None:
        now = time.monotonic()
        if not self.enabled or (not force and now - self._shown < REFRESH_S):
            return
        self._shown = now
        self.stream.write(f"\r{self.line()}\x1b[K")
        self.stream.flush()
        self._printed = True

    def close(self) -> None:
        if self.enabled:
            self.show(force=True)
            if self._printed:
                self.stream.write("\n")
                self.stream.flush()
