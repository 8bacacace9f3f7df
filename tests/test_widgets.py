"""The live views show exactly what fit recorded, stay cheap, and survive interruptions."""

from __future__ import annotations

import io

import jax
import numpy as np
import optax
import pytest
from helpers import run_python
from matplotlib.figure import Figure

import parallelkit as pk
import parallelkit.viz as viz
from parallelkit.viz import RaceRow, RaceStandings, StrategyRace, TimingDashboard
from parallelkit.viz.live import LiveTimes, race_rows, svg_polyline


class _InterruptAfter(pk.Callback):
    """Raises KeyboardInterrupt (as Kernel → Interrupt does) after ``n`` steps."""

    def __init__(self, n: int):
        self.n = n

    def on_step_end(self, record):
        if record.step == self.n:
            raise KeyboardInterrupt


def _fit(mlp, digits, strategy, callbacks, steps=6, batch=64):
    loss_fn, params = mlp
    batches = pk.data.batches(digits, batch, steps=steps)
    return pk.fit(strategy, loss_fn, params, optax.sgd(0.1), batches, steps=steps, callbacks=callbacks)


@pytest.mark.parametrize("mode", ["text", "widget"])
def test_dashboard_numbers_equal_the_history(mlp, digits, mode):
    dash = TimingDashboard(batch_size=64, mode=mode, stream=io.StringIO())
    result = _fit(mlp, digits, pk.Mirrored(backend="jit"), [dash])
    times, s = result.history.times, dash.summary()
    assert s.median_seconds == times.median
    assert s.compile_seconds == times.compile_seconds
    assert s.first_step_seconds == times.first_step_seconds
    assert s.samples_per_second == times.samples_per_second
    assert s.steps_done == s.steps_total == 6
    assert s.devices == len(result.strategy.devices)
    assert s.strategy == repr(result.strategy)
    assert s.loss == result.history.losses[-1]
    assert s.finished and not s.interrupted
    assert dash.log.seconds == [r.seconds for r in result.history.records]


def test_dashboard_widgets_show_the_summary(mlp, digits):
    dash = TimingDashboard(batch_size=64, mode="widget")
    result = _fit(mlp, digits, pk.SingleDevice(), [dash])
    w = dash._widgets
    assert w.progress.value == w.progress.max == 6
    assert f"{result.history.times.median * 1e3:.2f} ms" in w.fields["median"].value
    assert f"{result.history.times.samples_per_second:,.0f} samples/s" in w.fields["throughput"].value
    assert "SingleDevice" in w.header.value and "done" in w.header.value
    # The line plots the steady-state step times (ms): exactly what was recorded after step 1.
    drawn = w.line.value.split('data-values="')[1].split('"')[0].split(",")
    np.testing.assert_allclose([float(x) for x in drawn], [r.seconds * 1e3 for r in result.history.records[1:]], 1e-5)


def test_dashboard_survives_an_interrupted_run(mlp, digits):
    out = io.StringIO()
    dash = TimingDashboard(batch_size=64, mode="text", stream=out)
    result = _fit(mlp, digits, pk.SingleDevice(), [dash, _InterruptAfter(3)])
    assert result.interrupted
    s = dash.summary()
    assert s.interrupted and s.steps_done == 3 == len(result.history.records)
    assert s.median_seconds == result.history.times.median
    assert out.getvalue().splitlines()[-1].endswith("INTERRUPTED")


def test_redraws_are_throttled():
    dash = TimingDashboard(batch_size=8, mode="widget", min_interval=3600)
    dash.on_train_begin(pk.run.training.RunInfo("X", 1, 200, False))
    for i in range(1, 201):
        dash.on_step_end(pk.StepRecord(i, {"loss": 1.0}, 0.001, compiled=i == 1))
    assert dash.redraws == 3  # begin, step 1 (compile), step 2 (first steady); then the hour never passes
    dash.on_train_end(None, interrupted=False)
    assert dash.redraws == 4 and dash._widgets.progress.value == 200


def test_text_mode_outside_a_notebook():
    result = run_python(
        "import parallelkit as pk, parallelkit.viz as w\n"
        "d = w.TimingDashboard()\n"
        "assert d.mode == 'text', d.mode\n"
        "race = w.StrategyRace({'one': pk.SingleDevice()}, None, None, None, [])\n"
        "assert race.mode == 'text', race.mode\n"
        "import sys; assert 'ipywidgets' not in sys.modules\n"
    )
    assert result.returncode == 0, result.stderr


def test_unknown_mode_is_an_error():
    with pytest.raises(ValueError, match="choose 'auto'"):
        TimingDashboard(mode="gui")


def test_svg_line_carries_its_values():
    svg = svg_polyline([1.0, 2.0, 4.0])
    assert 'data-values="1,2,4"' in svg and svg.count(",") >= 5
    assert ">max 4.00 ms<" in svg  # the values' own unit, not rescaled
    assert "points=" in svg_polyline([])


def test_import_parallelkit_does_not_import_ipywidgets():
    result = run_python("import sys, parallelkit\nassert 'ipywidgets' not in sys.modules\n")
    assert result.returncode == 0, result.stderr


# -- StrategyRace ----------------------------------------------------------------------------


def _race(mlp, digits, mode="text", steps=6, batches=None, **kwargs):
    loss_fn, params = mlp
    strategies = {"SingleDevice": pk.SingleDevice(), "Mirrored(jit)": pk.Mirrored(4, backend="jit")}
    batches = batches or (lambda: pk.data.batches(digits, 64, steps=steps))
    return StrategyRace(
        strategies, loss_fn, params, optax.sgd(0.1), batches, steps=steps, batch_size=64, mode=mode, **kwargs
    )


def test_race_rows_are_each_runs_own_numbers(mlp, digits):
    out = io.StringIO()
    race = _race(mlp, digits, stream=out)
    standings = race.run()
    ref = race.results["SingleDevice"].history.times
    assert [r.name for r in standings.rows] == ["SingleDevice", "Mirrored(jit)"]
    assert standings.reference == "SingleDevice" and standings.simulated and not standings.interrupted
    for row in standings.rows:
        history = race.results[row.name].history
        assert row.median_seconds == history.times.median
        assert row.samples_per_second == history.times.samples_per_second
        assert row.compile_seconds == history.times.compile_seconds
        assert row.steps_done == row.steps_total == len(history.records) == 6
        assert row.final_loss == history.losses[-1]
        assert row.devices == race.strategies[row.name].num_replicas
        assert row.ratio_to_reference == history.times.median / ref.median
        assert row.scaling_efficiency == history.times.samples_per_second / (row.devices * ref.samples_per_second)
        assert row.finished
    single = standings.row("SingleDevice")
    assert single.ratio_to_reference == 1.0 and single.scaling_efficiency == 1.0
    # Same data, same start: the runs trained the same model.
    losses = [race.results[name].history.losses for name in race.strategies]
    np.testing.assert_allclose(losses[1], losses[0], rtol=1e-5)
    # Text mode: one table per finished run, the last one complete and saying the devices are simulated.
    text = out.getvalue()
    assert text.count("strategy ") == 2 and "simulated CPU devices" in text.splitlines()[-1]
    assert text.splitlines()[-2].split()[:3] == ["Mirrored(jit)", "4", "6/6"]


def test_race_and_dashboard_take_any_strategy(mlp, digits):
    """Model-splitting and sharded strategies: the views count the devices each uses."""
    loss_fn, params = mlp
    strategies = {
        "SingleDevice": pk.SingleDevice(),
        "TensorParallel": pk.TensorParallel(2, devices=jax.devices()[:2]),  # one replica on two devices
        "FullySharded": pk.FullySharded(3, 4),
        "Hybrid": pk.Hybrid(2, 2, shard_data=True, devices=jax.devices()[:4]),
    }
    race = StrategyRace(strategies, loss_fn, params, optax.sgd(0.1), lambda: pk.data.batches(digits, 64, steps=3),
                        steps=3, batch_size=64, mode="text", stream=io.StringIO())  # fmt: skip
    standings = race.run()
    rows = [(r.name, r.devices, r.steps_done) for r in standings.rows]
    assert rows == [("SingleDevice", 1, 3), ("TensorParallel", 2, 3), ("FullySharded", 4, 3), ("Hybrid", 4, 3)]
    for name in list(strategies)[1:]:
        assert pk.tour.max_abs_diff(race.results[name].params, race.results["SingleDevice"].params) < 1e-6, name
    dash = TimingDashboard(batch_size=64, mode="text", stream=io.StringIO())
    _fit(mlp, digits, pk.TensorParallel(2, devices=jax.devices()[:2]), [dash])
    assert dash.summary().devices == 2 and dash.summary().strategy == "TensorParallel(model=2)"


def test_race_ratio_and_efficiency_formula():
    runs = {name: LiveTimes(devices=n, batch_size=64) for name, n in (("one", 1), ("four", 4), ("pending", 8))}
    for s in (1.0, 0.010, 0.012, 0.011):
        runs["one"].add(s)
    for s in (2.0, 0.004, 0.005, 0.006):
        runs["four"].add(s)
    rows = {r.name: r for r in race_rows(runs, "one")}
    assert rows["one"].ratio_to_reference == 1.0 and rows["one"].scaling_efficiency == 1.0
    assert rows["four"].ratio_to_reference == pytest.approx(0.005 / 0.011)
    # throughput_N / (N x throughput_1) = (64 / 0.005) / (4 x 64 / 0.011) = 0.011 / (4 x 0.005)
    assert rows["four"].scaling_efficiency == pytest.approx(0.011 / (4 * 0.005))
    assert np.isnan(rows["pending"].median_seconds) and np.isnan(rows["pending"].scaling_efficiency)
    # A reference on 2 devices: throughput_1 is its throughput per device.
    runs["one"].devices = 2
    assert race_rows(runs, "one")[1].scaling_efficiency == pytest.approx(0.011 / (2 * 0.005))
    # No reference run yet: nothing to compare with.
    assert all(np.isnan(r.ratio_to_reference) for r in race_rows(runs, "absent"))


def test_race_widget_updates_while_it_runs(mlp, digits):
    race = _race(mlp, digits, mode="widget", steps=8, min_interval=0)
    seen = []
    race.widget.children[1].observe(lambda change: seen.append(change["new"]), "value")
    standings = race.run()
    w = race._widgets
    # The table showed the first run's step counter moving, before the second run began.
    steps = {int(v.split("data-name='SingleDevice' data-steps='")[1].split("'")[0]) for v in seen}
    assert {1, 2, 5, 8} <= steps
    for row in standings.rows:
        assert f"data-name='{row.name}' data-steps='8'" in w.table.value
        assert f"{row.median_seconds * 1e3:.2f} ms" in w.table.value
    assert "simulated CPU devices" in w.header.value and "done" in w.header.value
    assert bytes(w.chart.value).startswith(b"\x89PNG") and race.chart_redraws >= 2  # after each run


def test_race_stops_when_interrupted(mlp, digits):
    def batches():
        for i, batch in enumerate(pk.data.batches(digits, 64, steps=6)):
            if i == 3 and calls[0] == 2:  # Kernel → Interrupt during the second run
                raise KeyboardInterrupt
            yield batch

    def fresh():
        calls[0] += 1
        return batches()

    calls = [0]
    loss_fn, params = mlp
    strategies = {"SingleDevice": pk.SingleDevice(), "Mirrored(jit)": pk.Mirrored(2), "Mirrored(pmap)": pk.Mirrored(2)}
    race = StrategyRace(strategies, loss_fn, params, optax.sgd(0.1), fresh, mode="text", stream=io.StringIO())
    standings = race.run()
    assert standings.interrupted and list(race.results) == ["SingleDevice", "Mirrored(jit)"]
    assert [r.steps_done for r in standings.rows] == [6, 3, 0]
    assert standings.row("Mirrored(jit)").median_seconds == race.results["Mirrored(jit)"].history.times.median


def test_race_errors_teach(mlp, digits):
    loss_fn, params = mlp
    one = {"SingleDevice": pk.SingleDevice()}
    with pytest.raises(ValueError, match="one-shot iterator"):
        StrategyRace(one, loss_fn, params, optax.sgd(0.1), pk.data.batches(digits, 64, steps=2))
    with pytest.raises(ValueError, match="is not one of the strategies"):
        StrategyRace(one, loss_fn, params, optax.sgd(0.1), [], reference="Mirrored")
    with pytest.raises(ValueError, match="at least one strategy"):
        StrategyRace({}, loss_fn, params, optax.sgd(0.1), [])


def test_race_figure_plots_the_standings():
    nan = float("nan")
    rows = (
        RaceRow("SingleDevice", 1, 9, 9, 0.5, 0.004, 16000.0, 1.0, 1.0, 0.3, True),
        RaceRow("Mirrored(jit)", 4, 9, 9, 0.9, 0.010, 6400.0, 2.5, 0.1, 0.3, True),
        RaceRow("Mirrored(pmap)", 8, 0, 9, nan, nan, nan, nan, nan, nan, False),
    )
    standings = RaceStandings(rows, "SingleDevice", simulated=True, running="Mirrored(pmap)")
    fig = viz.race_figure(standings)
    assert isinstance(fig, Figure)
    heights = [[p.get_height() for p in ax.patches] for ax in fig.axes[:3]]
    np.testing.assert_array_equal(heights[0], [r.median_seconds * 1e3 for r in rows])
    np.testing.assert_array_equal(heights[1], [r.samples_per_second for r in rows])
    np.testing.assert_array_equal(heights[2], [r.scaling_efficiency for r in rows])
    np.testing.assert_array_equal(fig.axes[1].lines[0].get_ydata(), [16000.0 * r.devices for r in rows])
    assert [t.get_text() for t in fig.axes[0].texts] == ["x1.00", "x2.50"]  # no ratio for a run not yet run
    assert [t.get_text().split("\n")[0] for t in fig.axes[0].get_xticklabels()] == [r.name for r in rows]
    assert "simulated CPU devices" in fig._suptitle.get_text()
