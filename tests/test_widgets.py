"""The live views show exactly what fit recorded, stay cheap, and survive interruptions."""

from __future__ import annotations

import io
import time

import numpy as np
import optax
import pytest
from helpers import run_python

import parallelkit as pk
from parallelkit.widgets import TimingDashboard
from parallelkit.widgets.live import svg_polyline


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
    assert s.devices == result.strategy.num_replicas
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
    dash.on_train_begin(pk.training.RunInfo("X", 1, 200, False))
    for i in range(1, 201):
        dash.on_step_end(pk.StepRecord(i, {"loss": 1.0}, 0.001, compiled=i == 1))
    assert dash.redraws == 3  # begin, step 1 (compile), step 2 (first steady); then the hour never passes
    dash.on_train_end(None, interrupted=False)
    assert dash.redraws == 4 and dash._widgets.progress.value == 200


def test_callback_is_cheap():
    dash = TimingDashboard(batch_size=8, mode="widget", min_interval=0.3)
    dash.on_train_begin(pk.training.RunInfo("X", 1, None, False))
    start = time.perf_counter()
    for i in range(1, 2001):
        dash.on_step_end(pk.StepRecord(i, {"loss": 1.0}, 0.001, compiled=i == 1))
    per_step = (time.perf_counter() - start) / 2000
    assert per_step < 1e-3, f"the dashboard costs {per_step * 1e6:.0f} µs per step"


def test_text_mode_outside_a_notebook():
    result = run_python(
        "import parallelkit as pk, parallelkit.widgets as w\n"
        "d = w.TimingDashboard()\n"
        "assert d.mode == 'text', d.mode\n"
        "import sys; assert 'ipywidgets' not in sys.modules\n"
    )
    assert result.returncode == 0, result.stderr


def test_unknown_mode_is_an_error():
    with pytest.raises(ValueError, match="choose 'auto'"):
        TimingDashboard(mode="gui")


def test_svg_line_carries_its_values():
    svg = svg_polyline([1.0, 2.0, 4.0])
    assert 'data-values="1,2,4"' in svg and svg.count(",") >= 5
    assert "points=" in svg_polyline([])


def test_import_parallelkit_does_not_import_ipywidgets():
    result = run_python("import sys, parallelkit\nassert 'ipywidgets' not in sys.modules\n")
    assert result.returncode == 0, result.stderr
