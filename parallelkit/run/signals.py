"""Signal handlers for a block: ``pk.fit`` holds back an interrupt during a step, the launcher stops its workers."""

from __future__ import annotations

import signal
import threading
from collections.abc import Callable, Iterable


class SignalHandlers:
    """Within the block ``handler(signum, frame)`` handles ``signals``; the previous handlers come back after it.

    Signal handlers belong to the main thread; elsewhere nothing changes. A class rather than a
    generator: :func:`~parallelkit.fit` enters one around every step, and a class costs about a microsecond less.
    """

    def __init__(self, signals: Iterable[int], handler: Callable) -> None:
        self.signals, self.handler, self.previous = tuple(signals), handler, {}

    def __enter__(self) -> None:
        main = threading.current_thread() is threading.main_thread()
        self.previous = {sig: signal.signal(sig, self.handler) for sig in self.signals} if main else {}

    def __exit__(self, *exc: object) -> None:
        for sig, old in self.previous.items():
            signal.signal(sig, old)


class InterruptsDeferred(SignalHandlers):
    """Hold back a KeyboardInterrupt (SIGINT) until the block ends, then raise it.

    Around the step call: an interrupt between the step consuming the old state and
    the new state being bound would leave nothing usable. Dispatch is quick, so the
    interrupt is late by milliseconds (by the compile time on the first step).
    """

    def __init__(self) -> None:
        caught = self.caught = []  # the handler holds the list, not self: no reference cycle a step
        super().__init__((signal.SIGINT,), lambda signum, frame: caught.append(signum))

    def __exit__(self, kind: type[BaseException] | None, *exc: object) -> None:
        super().__exit__(kind, *exc)
        if self.caught and kind is None:
            raise KeyboardInterrupt
