"""Prefetching: place the next batches on their devices while the current step runs (:func:`prefetch`).

>>> import numpy as np, parallelkit as pk
>>> host = [{"x": np.ones((4, 2), np.float32)}] * 3
>>> [type(b).__name__ for b in pk.prefetch(host, pk.SingleDevice())]
['Placed', 'Placed', 'Placed']
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ..core.contract import batch_size
from ..core.step import Placed
from ..core.types import Batch

if TYPE_CHECKING:
    from ..strategies.base import Strategy

__all__ = ["Placed", "prefetch"]


@dataclass(frozen=True)
class _Failed:
    error: BaseException


_END = object()
_POLL_S = 0.1  # how often a waiting producer checks whether the consumer has gone


def prefetch(batches: Iterable[Batch], strategy: Strategy, size: int = 2) -> Iterator[Placed]:
    """Yield ``batches`` placed by ``strategy``, up to ``size`` of them ahead, from a background thread.

    An error from ``batches`` (or from placing one) is raised here, in the consuming
    thread, in order. Closing the iterator (or leaving a ``for`` loop over it, by
    ``break`` or an exception) stops the thread, which then finishes at most the batch
    it is placing.

    Raises:
      ValueError: ``size`` below 1.
    """
    if not (isinstance(size, int) and size >= 1):
        raise ValueError(f"prefetch(size={size!r}): how many batches to keep ready, a whole number >= 1.")
    return _prefetched(batches, strategy, size)


def _prefetched(batches: Iterable[Batch], strategy: Strategy, size: int) -> Iterator[Placed]:
    ready: queue.Queue = queue.Queue(maxsize=size)
    stop = threading.Event()

    def offer(item: object) -> bool:
        """Put ``item`` in the queue, unless the consumer stops first."""
        while not stop.is_set():
            try:
                ready.put(item, timeout=_POLL_S)
                return True
            except queue.Full:
                continue
        return False

    def produce() -> None:
        try:
            for batch in batches:
                if not offer(Placed(strategy.place_batch(batch), batch_size(batch), strategy)):
                    return
            offer(_END)
        except BaseException as err:  # handed to the consumer, raised there
            offer(_Failed(err))

    worker = threading.Thread(target=produce, name="parallelkit-prefetch", daemon=True)
    worker.start()
    try:
        while (item := ready.get()) is not _END:
            if isinstance(item, _Failed):
                raise item.error
            yield item
    finally:
        stop.set()
        worker.join()
