"""Graceful stops: SIGTERM or SIGINT ask the training loop to finish its step, checkpoint and exit.

The handler only records the request; the loop checks it between steps, so a stop never lands in
the middle of an update or a checkpoint write. A second signal of the same kind is handled the same
way (the loop is already stopping). Handlers are restored on exit, and installed only from the main
thread (Python allows no other).
"""

from __future__ import annotations

import signal
import threading
from types import FrameType

SIGNALS = (signal.SIGTERM, signal.SIGINT)


class StopRequest:
    def __init__(self) -> None:
        self.signum: int | None = None
        self._previous: dict[int, object] = {}

    @property
    def name(self) -> str | None:
        return None if self.signum is None else signal.Signals(self.signum).name

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        self.signum = signum

    def install(self) -> None:
        if threading.current_thread() is threading.main_thread():
            self._previous = {s: signal.signal(s, self._handle) for s in SIGNALS}

    def restore(self) -> None:
        for s, handler in self._previous.items():
            signal.signal(s, handler)
        self._previous = {}
