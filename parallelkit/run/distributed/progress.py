"""Live progress across processes: :class:`ReportProgress` in each, :class:`ForwardProgress` in the caller."""

from __future__ import annotations

import json
import sys
from collections.abc import Callable, Sequence
from dataclasses import asdict
from typing import TextIO

from ..training import Callback, History, RunInfo, StepRecord

_PREFIX = "pk-progress "


class ReportProgress(Callback):
    """A ``fit`` callback that prints each event as one ``pk-progress {json}`` line (cheap: a print per step)."""

    def __init__(self, stream: TextIO | None = None):
        self.stream = stream

    def _emit(self, event: str, payload: dict) -> None:
        print(_PREFIX + json.dumps({"event": event, **payload}), file=self.stream or sys.stdout, flush=True)

    def on_train_begin(self, info: RunInfo) -> None:
        self._emit("begin", asdict(info))

    def on_step_end(self, record: StepRecord) -> None:
        self._emit("step", asdict(record))

    def on_train_end(self, history: History, interrupted: bool) -> None:
        self._emit("end", {"interrupted": interrupted, "batch_size": history.batch_size})


class ForwardProgress:
    """A launcher ``print_fn``: process ``process``'s progress lines become calls on ``callbacks``.

    Progress lines of the other processes are dropped (each process trains the same
    steps); every other line goes to ``print_fn``. :attr:`history` collects what was
    forwarded, as ``fit`` would have recorded it.

    Args:
      callbacks: ``fit`` callbacks to drive, such as a ``TimingDashboard``.
      process: whose progress to show.
      print_fn: where ordinary output lines go.

    Example:
      >>> import io
      >>> from parallelkit.run.training import Callback, RunInfo, StepRecord
      >>> out = io.StringIO()
      >>> ReportProgress(stream=out).on_step_end(StepRecord(1, {"loss": 2.0}, 0.5, compiled=True))
      >>> class Seen(Callback):
      ...     def on_step_end(self, record):
      ...         print("step", record.step, "loss", record.loss)
      >>> ForwardProgress([Seen()], process=0)("[p0] " + out.getvalue().strip())
      step 1 loss 2.0
    """

    def __init__(self, callbacks: Sequence[Callback], process: int = 0, print_fn: Callable[[str], None] = print):
        self.callbacks, self.process, self.print_fn = list(callbacks), process, print_fn
        self.history = History()

    def __call__(self, line: str) -> None:
        tag, _, text = line.partition("] ")
        if not text.startswith(_PREFIX):
            self.print_fn(line)
            return
        if tag != f"[p{self.process}":
            return
        message = json.loads(text[len(_PREFIX) :])
        event = message.pop("event")
        if event == "begin":
            self.history = History()
            for cb in self.callbacks:
                cb.on_train_begin(RunInfo(**message))
        elif event == "step":
            record = StepRecord(**message)
            self.history.records.append(record)
            for cb in self.callbacks:
                cb.on_step_end(record)
        elif event == "end":
            self.history.batch_size = message["batch_size"]
            for cb in self.callbacks:
                cb.on_train_end(self.history, message["interrupted"])
