"""``TimingDashboard``: a live view of ``fit``'s step times, as a callback.

>>> import io
>>> out = io.StringIO()
>>> dash = TimingDashboard(batch_size=32, mode="text", stream=out)
>>> dash.on_train_begin(RunInfo("SingleDevice(devices=1)", 1, 2, False))
>>> dash.on_step_end(StepRecord(1, {"loss": 2.0}, 0.5, compiled=True))
>>> dash.on_step_end(StepRecord(2, {"loss": 1.0}, 0.01, compiled=False))
>>> dash.on_train_end(None, interrupted=False)
>>> print(out.getvalue().splitlines()[-1])
SingleDevice(devices=1) · 1 device · step 2/2 · compile 0.49 s · median 10.00 ms · 3,200 samples/s · loss 1.0000 · done
"""

from __future__ import annotations

import sys
import time
from typing import TextIO

from ..run.training import Callback, History, RunInfo, StepRecord
from .live import LiveTimes, TimingSummary, format_summary, number_or_dash, simulated_note, svg_polyline


def in_notebook() -> bool:
    """True inside a Jupyter kernel (where widgets can render), False in a script or terminal IPython."""
    ipython = sys.modules.get("IPython")
    shell = ipython.get_ipython() if ipython is not None else None
    return shell is not None and "IPKernelApp" in shell.config


class Explorer:
    """The explorers' ``widget``, built on first use by ``_build``; outside a notebook, display prints ``_text()``."""

    _widgets = None

    @property
    def widget(self):
        """The ipywidgets box (built on first use)."""
        if self._widgets is None:
            self._widgets = self._build()
        return self._widgets

    def _ipython_display_(self) -> None:
        from IPython.display import display

        if in_notebook():
            display(self.widget)
        else:
            print(self._text())


class LiveView:
    """What the live views share: their ``mode`` (as their Args say), widgets built on first use by ``_build``."""

    def __init__(self, mode: str):
        if mode not in ("auto", "widget", "text"):
            raise ValueError(f"{type(self).__name__}(mode={mode!r}): choose 'auto', 'widget' or 'text'.")
        self.mode = ("widget" if in_notebook() else "text") if mode == "auto" else mode
        self._widgets = None
        self._shown = False

    @property
    def widget(self):
        """The ipywidgets box (built on first use)."""
        if self._widgets is None:
            self._widgets = self._build()
        return self._widgets.box

    def show(self) -> None:
        """Display the widgets, in widget mode, unless they are shown already."""
        if self.mode == "widget" and not self._shown:
            self._ipython_display_()

    def _ipython_display_(self) -> None:
        from IPython.display import display

        self._shown = True
        display(self.widget)


class TimingDashboard(LiveView, Callback):
    """Step time, throughput, compile time vs steady state, devices and strategy, live.

    Pass it to :func:`parallelkit.fit` (``callbacks=[dash]``). In a notebook it shows
    ipywidgets (a progress bar, the numbers, a line of steady-state step times) and
    updates them at most ``1 / min_interval`` times a second, so it does not slow the
    steps it measures; elsewhere it prints a line of text now and then. An interrupted
    run (Kernel → Interrupt) keeps what was measured and says so.

    The numbers come from :attr:`log`, a :class:`~parallelkit.viz.live.LiveTimes`:
    at the end of a run ``dash.summary().median_seconds == history.times.median``.

    Args:
      batch_size: global batch size, for samples per second (otherwise steps per second).
      mode: ``"auto"`` (widgets in a notebook, text elsewhere), ``"widget"`` or ``"text"``.
      min_interval: seconds between redraws (the first and the last step always draw).
      stream: where text mode writes (default ``sys.stdout``).
    """

    def __init__(
        self,
        batch_size: int = 0,
        *,
        mode: str = "auto",
        min_interval: float = 0.3,
        stream: TextIO | None = None,
        title: str = "",
    ):
        super().__init__(mode)
        self.batch_size = batch_size
        self.min_interval = min_interval
        self.stream = stream
        self.title = title
        self.log = LiveTimes(batch_size=batch_size)
        self.redraws = 0
        self._last_draw = float("-inf")

    # -- data ---------------------------------------------------------------------------------
    def summary(self) -> TimingSummary:
        return self.log.summary()

    # -- Callback -----------------------------------------------------------------------------
    def on_train_begin(self, info: RunInfo) -> None:
        self.log = LiveTimes(info.strategy, info.devices, info.simulated, info.steps, self.batch_size)
        self._last_draw = float("-inf")
        self.show()
        self.draw()

    def on_step_end(self, record: StepRecord) -> None:
        self.log.add(record.seconds, record.metrics.get("loss", float("nan")))
        if record.step <= 2 or time.monotonic() - self._last_draw >= self.min_interval:
            self.draw()

    def on_train_end(self, history: History | None, interrupted: bool) -> None:
        if history is not None and history.batch_size and not self.log.batch_size:
            self.log.batch_size = history.batch_size
        self.log.interrupted = interrupted
        self.log.finished = True
        self.draw()

    # -- views --------------------------------------------------------------------------------
    def _build(self) -> _DashboardWidgets:
        return _DashboardWidgets(self.title)

    def draw(self) -> None:
        self._last_draw = time.monotonic()
        self.redraws += 1
        summary = self.summary()
        if self.mode == "text":
            print(("" if not self.title else self.title + ": ") + format_summary(summary), file=self.stream)
        else:
            self.widget  # noqa: B018  (builds the widgets)
            self._widgets.update(summary, self.log.seconds[1:])


class _DashboardWidgets:
    """The ipywidgets of one dashboard; every field has a CSS class a browser test can find."""

    def __init__(self, title: str):
        import ipywidgets as w

        self.header = w.HTML().add_class("pk-header")
        self.progress = w.IntProgress(value=0, min=0, max=1, description="steps").add_class("pk-progress")
        self.fields = {
            name: w.HTML(layout=w.Layout(width="150px")).add_class(f"pk-{name}")
            for name in ("steps", "compile", "median", "throughput", "loss")
        }
        self.line = w.HTML().add_class("pk-steptimes")
        caption = w.HTML("<small>steady-state step time (ms), step 2 onward</small>")
        self.box = w.VBox(
            [self.header, self.progress, w.HBox(list(self.fields.values())), caption, self.line],
            layout=w.Layout(border="1px solid #ccc", padding="6px", width="fit-content"),
        ).add_class("pk-dashboard")
        self.title = title

    def update(self, s: TimingSummary, steady: list[float]) -> None:
        simulated = f" ({simulated_note()})" if s.simulated else ""
        state = " · <b style='color:#c00'>interrupted</b>" if s.interrupted else (" · done" if s.finished else "")
        title = f"{self.title} · " if self.title else ""
        self.header.value = f"<b>{title}{s.strategy}</b> · {s.devices} device{'s' * (s.devices != 1)}{simulated}{state}"
        self.progress.max = max(s.steps_total or s.steps_done, 1)
        self.progress.value = min(s.steps_done, self.progress.max)
        total = f"/{s.steps_total}" if s.steps_total else ""
        throughput = (
            number_or_dash(s.samples_per_second, ",.0f", " samples/s")
            if s.samples_per_second == s.samples_per_second
            else number_or_dash(s.steps_per_second, ",.1f", " steps/s")
        )
        values = {
            "steps": f"step <b class='pk-value'>{s.steps_done}</b>{total}",
            "compile": f"compile <b class='pk-value'>{number_or_dash(s.compile_seconds, '.2f', ' s')}</b>",
            "median": f"median <b class='pk-value'>{number_or_dash(s.median_seconds * 1e3, '.2f', ' ms')}</b>",
            "throughput": f"<b class='pk-value'>{throughput}</b>",
            "loss": f"loss <b class='pk-value'>{number_or_dash(s.loss, '.4f')}</b>",
        }
        for name, html in values.items():
            self.fields[name].value = html
        self.line.value = svg_polyline([t * 1e3 for t in steady])
