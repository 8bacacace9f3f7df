"""A strategy race as a figure (:func:`race_figure`), and the live :class:`StrategyRace`."""

from __future__ import annotations

import html
import time
from collections.abc import Callable, Iterable, Mapping
from typing import TextIO

import numpy as np
import optax
from matplotlib.figure import Figure

from ..core.types import Batch, LossFn, PyTree
from ..run.compare import Run, fresh_batches, run_side_by_side
from ..run.training import Callback, FitResult, History, RunInfo, StepRecord
from ..strategies import Strategy
from .dashboard import LiveView
from .live import LiveTimes, RaceStandings, format_race, number_or_dash, race_rows, simulated_note
from .placement import annotate_bar, png

_REFERENCE, _OTHER = "0.55", "tab:blue"


def race_figure(standings: RaceStandings, title: str = "") -> Figure:
    """Three panels over the race's rows, one bar per strategy in race order.

    - ``axes[0]``: median steady-state step time (ms), each bar labelled with its
      ratio to the reference's (``x1.00`` for the reference itself);
    - ``axes[1]``: throughput (samples/s), with a marker at ideal linear scaling,
      ``N x`` the reference's throughput per device;
    - ``axes[2]``: scaling efficiency, ``throughput_N / (N x throughput_1)``, with the
      ideal 1.0 dashed.

    Strategies that have not run yet have no bar (``nan``). On simulated devices the
    title says how they use the cores (:attr:`DeviceSummary.simulation
    <parallelkit.core.devices.DeviceSummary.simulation>`): sharing them, the times show
    overhead, not speed-up; one core each, the devices compute in parallel (whether that
    beats one device depends on how many cores the one device is given).

    Returns:
      The figure; bar ``k`` of ``axes[0].patches`` has height ``rows[k].median_seconds * 1e3``,
      of ``axes[1]`` ``rows[k].samples_per_second``, of ``axes[2]``
      ``rows[k].scaling_efficiency``; ``axes[1].lines[0]`` is the ideal throughput.

    Example:
      >>> from parallelkit.viz.live import RaceRow, RaceStandings
      >>> rows = (RaceRow("one", 1, 9, 9, 0.5, 0.004, 16000.0, 1.0, 1.0, 0.3, True),
      ...         RaceRow("four", 4, 9, 9, 0.9, 0.002, 32000.0, 0.5, 0.5, 0.3, True))
      >>> fig = race_figure(RaceStandings(rows, "one", simulated=False))
      >>> [float(p.get_height()) for p in fig.axes[0].patches], [float(p.get_height()) for p in fig.axes[2].patches]
      ([4.0, 2.0], [1.0, 0.5])
    """
    rows = standings.rows
    x = np.arange(len(rows))
    colors = [_REFERENCE if r.name == standings.reference else _OTHER for r in rows]
    median_ms = np.array([r.median_seconds * 1e3 for r in rows])
    throughput = np.array([r.samples_per_second for r in rows])
    efficiency = np.array([r.scaling_efficiency for r in rows])
    ref = next((r for r in rows if r.name == standings.reference), None)
    per_device = ref.samples_per_second / ref.devices if ref else float("nan")
    ideal = np.array([r.devices * per_device for r in rows])

    fig = Figure(figsize=(11, 3.4), layout="constrained")
    axes = fig.subplots(1, 3)
    bars = axes[0].bar(x, median_ms, color=colors, width=0.6)
    for bar, r in zip(bars, rows, strict=True):
        if r.ratio_to_reference == r.ratio_to_reference:
            annotate_bar(axes[0], bar, f"x{r.ratio_to_reference:.2f}")
    axes[0].set_ylabel("median step time (ms)")
    axes[0].set_title(f"step time (x = ratio to {standings.reference})", fontsize=9)

    axes[1].bar(x, throughput, color=colors, width=0.6)
    axes[1].plot(x, ideal, linestyle="none", marker="_", markersize=22, color="tab:red", label="ideal: N x reference")
    axes[1].set_ylabel("samples / s")
    axes[1].set_title("throughput", fontsize=9)
    axes[1].legend(fontsize=7, loc="upper left")

    axes[2].bar(x, efficiency, color=colors, width=0.6)
    axes[2].axhline(1.0, color="tab:red", linestyle="--", linewidth=1)
    axes[2].set_ylabel("throughput_N / (N x throughput_1)")
    axes[2].set_title("scaling efficiency (1 = linear)", fontsize=9)
    top = np.nanmax(efficiency, initial=0.0)
    axes[2].set_ylim(0, max(1.1, top * 1.1))

    for ax in axes:
        ax.set_xticks(x, [f"{r.name}\n{r.devices} dev" for r in rows], fontsize=7)
        ax.tick_params(axis="y", labelsize=7)
    note = f" · {simulated_note()}" if standings.simulated else ""
    state = " · interrupted" if standings.interrupted else ""
    fig.suptitle(f"{title or 'strategy race'}{note}{state}", fontsize=10)
    return fig


class StrategyRace(LiveView):
    """Train every strategy on the same model and data, comparing their step times as they go.

    It is :func:`~parallelkit.run.compare.run_side_by_side` (one ``pk.fit`` per strategy, in turn) with a
    callback that redraws the standings between steps::

        runs = pk.run_side_by_side(strategies, loss_fn, params, tx, batches, steps=steps, reference=reference)
        # runs[name].times beside the reference's; runs[name].max_param_diff from its parameters

    Args:
      strategies, loss_fn, params, tx, batches, steps: as for :func:`~parallelkit.run.compare.run_side_by_side`
        (the strategies raced in their order, each on the same batches).
      batch_size: global batch size, for throughput while a run is going (read from the
        data at the end of each run otherwise).
      reference: the name ratios and efficiencies are relative to; by default the first
        strategy on one device (such as :class:`~parallelkit.SingleDevice`), else the first one.
      mode: ``"auto"`` (widgets in a notebook, text elsewhere), ``"widget"`` or ``"text"``.
      min_interval: seconds between table redraws while a run goes.
      chart_interval: seconds between chart redraws while a run goes (the chart is also
        redrawn when each run ends). Redraws run between steps, never inside a timed step.
      stream: where text mode writes (default ``sys.stdout``).

    Raises:
      ValueError: no strategies, an unknown ``reference`` or ``mode``, or ``batches`` is
        a one-shot iterator (every run needs the same batches).
    """

    def __init__(
        self,
        strategies: Mapping[str, Strategy],
        loss_fn: LossFn,
        params: PyTree,
        tx: optax.GradientTransformation,
        batches: Callable[[], Iterable[Batch]] | Iterable[Batch],
        *,
        steps: int | None = None,
        batch_size: int = 0,
        reference: str | None = None,
        mode: str = "auto",
        min_interval: float = 0.3,
        chart_interval: float = 2.0,
        stream: TextIO | None = None,
    ):
        if not strategies:
            raise ValueError("StrategyRace needs at least one strategy, e.g. {'SingleDevice': pk.SingleDevice()}.")
        fresh_batches(batches)  # refuses a one-shot iterator now, not after the first run
        if reference is None:
            reference = next((n for n, s in strategies.items() if len(s.devices) == 1), next(iter(strategies)))
        if reference not in strategies:
            raise ValueError(f"reference={reference!r} is not one of the strategies {list(strategies)}.")
        super().__init__(mode)
        self.strategies = dict(strategies)
        self.loss_fn, self.params, self.tx, self.batches = loss_fn, params, tx, batches
        self.steps, self.batch_size, self.reference = steps, batch_size, reference
        self.min_interval, self.chart_interval, self.stream = min_interval, chart_interval, stream
        self.logs: dict[str, LiveTimes] = {
            name: LiveTimes(repr(s), len(s.devices), batch_size=batch_size) for name, s in self.strategies.items()
        }
        self.runs: dict[str, Run] = {}  # each run compared with the reference's parameters
        self.simulated = False
        self.running: str | None = None
        self.interrupted = False
        self.redraws = 0
        self.chart_redraws = 0

    # -- data ---------------------------------------------------------------------------------
    def standings(self) -> RaceStandings:
        """The race so far, as plain data (what the table and the chart show)."""
        rows = race_rows(self.logs, self.reference)
        return RaceStandings(tuple(rows), self.reference, self.simulated, self.running, self.interrupted)

    def run(self) -> RaceStandings:
        """Race every strategy in turn; returns the final standings (``self.results`` holds each run).

        Interrupting the kernel stops the race after the current run's state is kept,
        and the standings say so.
        """
        self.show()
        self.runs = run_side_by_side(
            self.strategies, self.loss_fn, self.params, self.tx, self.batches, steps=self.steps,
            reference=self.reference, callbacks=lambda name: [_RaceCallback(self, name)],
        )  # fmt: skip
        self.interrupted = any(run.result.interrupted for run in self.runs.values())
        self.running = None
        if self.mode == "widget":  # the chart is up to date: the last run's end drew it
            self.draw()
        return self.standings()

    @property
    def results(self) -> dict[str, FitResult]:
        """Each finished run's :func:`~parallelkit.run.fit` result, by name."""
        return {name: run.result for name, run in self.runs.items()}

    # -- views --------------------------------------------------------------------------------
    def _build(self) -> _RaceWidgets:
        widgets = _RaceWidgets()
        widgets.update(self.standings(), chart=False)  # the chart appears when the first run ends
        return widgets

    def draw(self, chart: bool = False) -> None:
        self.redraws += 1
        standings = self.standings()
        if self.mode == "text":
            if chart:  # text mode prints the table once per finished run, not on every redraw
                print(format_race(standings), file=self.stream)
            return
        self.widget  # noqa: B018  (builds the widgets)
        self.chart_redraws += chart
        self._widgets.update(standings, chart)

    def _ipython_display_(self) -> None:
        if self.mode == "widget":
            super()._ipython_display_()
        else:
            print(format_race(self.standings()))


class _RaceCallback(Callback):
    """Feeds one run's steps into the race's log of that strategy; redraws, throttled."""

    def __init__(self, race: StrategyRace, name: str):
        self.race, self.name = race, name
        self.last_table = self.last_chart = float("-inf")

    def on_train_begin(self, info: RunInfo) -> None:
        race = self.race
        race.logs[self.name] = LiveTimes(info.strategy, info.devices, info.simulated, info.steps, race.batch_size)
        race.simulated = race.simulated or info.simulated
        race.running = self.name
        self.last_chart = time.monotonic()  # the previous run's end just drew the chart
        race.draw()

    def on_step_end(self, record: StepRecord) -> None:
        self.race.logs[self.name].add(record.seconds, record.metrics.get("loss", float("nan")))
        now = time.monotonic()
        if record.step <= 2 or now - self.last_table >= self.race.min_interval:
            chart = now - self.last_chart >= self.race.chart_interval and record.step > 2
            self.last_table = now
            self.last_chart = now if chart else self.last_chart
            self.race.draw(chart=chart and self.race.mode == "widget")

    def on_train_end(self, history: History, interrupted: bool) -> None:
        log = self.race.logs[self.name]
        if history.batch_size and not log.batch_size:
            log.batch_size = history.batch_size
        log.interrupted, log.finished = interrupted, True
        self.race.draw(chart=True)


class _RaceWidgets:
    """A header, a live table and the chart; the table cells carry CSS classes a browser test can find."""

    def __init__(self):
        import ipywidgets as w

        self.header = w.HTML().add_class("pk-race-header")
        self.table = w.HTML().add_class("pk-race-table")
        self.chart = w.Image(format="png").add_class("pk-race-chart")
        self.box = w.VBox(
            [self.header, self.table, self.chart],
            layout=w.Layout(border="1px solid #ccc", padding="6px", width="fit-content"),
        ).add_class("pk-race")

    def update(self, s: RaceStandings, chart: bool) -> None:
        running = f" · running <b>{s.running}</b>" if s.running else ""
        done = all(r.finished for r in s.rows)
        state = " · <b style='color:#c00'>interrupted</b>" if s.interrupted else (" · done" if done else running)
        simulated = f" · {simulated_note()}" if s.simulated else ""
        self.header.value = f"<b>strategy race</b> (reference: {s.reference}){simulated}{state}"
        head = "".join(
            f"<th style='padding:0 8px'>{h}</th>"
            for h in ("strategy", "devices", "step", "median", "samples/s", "x ref", "efficiency", "loss")
        )
        body = []
        for r in s.rows:
            total = f"/{r.steps_total}" if r.steps_total else ""
            cells = [
                ("name", r.name),
                ("devices", str(r.devices)),
                ("steps", f"{r.steps_done}{total}"),
                ("median", number_or_dash(r.median_seconds * 1e3, ".2f") + " ms"),
                ("throughput", number_or_dash(r.samples_per_second, ",.0f")),
                ("ratio", number_or_dash(r.ratio_to_reference, ".2f")),
                ("efficiency", number_or_dash(r.scaling_efficiency, ".0%")),
                ("loss", number_or_dash(r.final_loss, ".4f")),
            ]
            tds = "".join(
                f"<td class='pk-race-{k}' style='padding:0 8px;text-align:right'>{html.escape(v)}</td>"
                for k, v in cells
            )
            name = html.escape(r.name, quote=True)
            body.append(f"<tr class='pk-race-row' data-name='{name}' data-steps='{r.steps_done}'>{tds}</tr>")
        self.table.value = f"<table><tr>{head}</tr>{''.join(body)}</table>"
        if chart:
            self.chart.value = png(race_figure(s))
