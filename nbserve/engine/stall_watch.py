"""A watchdog for the engine thread: notices a step (a model forward) that never returns.

A thread stuck inside a forward (a deadlocked custom model, a hung device) cannot be stopped
from Python, but its callers need not wait forever: once a step has run longer than the limit,
`on_stall` fails what is in flight and the engine refuses new work until the step returns.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable


class StallWatch:
    """Calls `on_stall(seconds)` once when a step runs longer than `limit` seconds."""

    def __init__(self, limit: float, on_stall: Callable[[float], None], name: str):
        self.limit = limit
        self.on_stall = on_stall
        self._started: float | None = None
        self._fired = False
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def step_started(self) -> None:
        self._started = time.monotonic()

    def step_ended(self) -> bool:
        """Mark the step done; True if it had been reported as stalled (then re-arm)."""
        self._started = None
        fired, self._fired = self._fired, False
        return fired

    def _run(self) -> None:
        interval = min(1.0, self.limit / 4)
        while not self._stop.wait(interval):
            started = self._started
            if started is None or self._fired:
                continue
            running = time.monotonic() - started
            if running > self.limit:
                self._fired = True
                self.on_stall(running)

    def stop(self) -> None:
        self._stop.set()
        if threading.current_thread() is not self._thread:
            self._thread.join(timeout=10)
