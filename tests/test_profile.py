"""Profiler traces: a file is written; collectives appear for Mirrored and not for one device; interval sums."""

from __future__ import annotations

import gzip
import json

import optax
import pytest
from matplotlib.colors import to_rgba
from matplotlib.figure import Figure

import parallelkit as pk
import parallelkit.viz as viz
from parallelkit.measure import profile
from parallelkit.measure.profile import Event


def _profiled(strategy, mlp, batch, tmp_path):
    loss_fn, params = mlp
    return pk.profile(strategy.step(loss_fn), strategy.init(params, optax.sgd(0.1)), batch, logdir=tmp_path)


def test_mirrored_on_two_devices_shows_all_reduces(mlp, batch, tmp_path):
    state, summary = _profiled(pk.Mirrored(2), mlp, batch, tmp_path)
    assert int(state.step) == 4  # one warm-up step, then the 3 traced
    assert summary.trace_path.is_relative_to(tmp_path) and summary.trace_path.stat().st_size > 0
    with gzip.open(summary.trace_path) as f:
        assert json.load(f)["traceEvents"]
    assert summary.collective_ops == {"all-reduce"}
    devices = {d.device: d for d in summary.devices if d.device is not None}
    assert set(devices) == {0, 1}
    for d in devices.values():
        assert d.compute_s > 0 and d.collective_s > 0
    assert summary.seconds("collective") == pytest.approx(sum(d.collective_s for d in devices.values()))
    assert "collective ms" in str(summary)


def test_single_device_has_no_collectives(mlp, batch, tmp_path):
    _, summary = _profiled(pk.SingleDevice(), mlp, batch, tmp_path)
    assert summary.collective_ops == set()
    assert summary.seconds("collective") == 0.0 and summary.seconds("compute") > 0
    assert {d.device for d in summary.devices} - {None} == {0}


def test_device_times_hand_worked():
    events = [
        Event(0, "dot", "compute", 0.0, 2.0),
        Event(0, "fusion", "compute", 0.5, 0.5),  # inside the dot's interval: counted once
        Event(0, "dot.1", "compute", 3.0, 1.0),
        Event(0, "all-reduce", "collective", 1.0, 2.5),  # 1.0 to 3.5
        Event(None, "DevicePutWithSharding", "transfer", 0.0, 0.25),
    ]
    host, device = profile.device_times(events)
    assert host == profile.DeviceTime(None, 0.0, 0.0, 0.25, 0.0)
    # compute [0, 2] and [3, 4]: 3 s; collective [1, 3.5]: 2.5 s; both at once in [1, 2] and [3, 3.5]
    assert device == profile.DeviceTime(0, 3.0, 2.5, 0.0, 1.5)


@pytest.mark.parametrize(
    ("name", "kind"),
    [
        ("all-reduce.6", "collective"),
        ("all-gather-start", "collective"),
        ("reduce-scatter.1", "collective"),
        ("collective-permute-done.3", "collective"),
        ("all-to-all", "collective"),
        ("copy-start.2", "transfer"),
        ("dot.4", "compute"),
        ("all_reduce_fusion", "compute"),
    ],
)
def test_kind_of_operation_names(name, kind):
    assert profile.kind_of(name) == kind


def test_trace_figure_one_row_per_device(mlp, batch, tmp_path):
    _, summary = _profiled(pk.Mirrored(2), mlp, batch, tmp_path)
    fig = viz.trace_figure(summary)
    assert isinstance(fig, Figure)
    labels = [t.get_text() for t in fig.axes[0].get_yticklabels()]
    assert labels == ["host", "device 0", "device 1"]
    assert len(fig.axes[0].collections) == sum(
        any(e.device == d and e.kind == k for e in summary.events) for d in (None, 0, 1) for k in profile.KINDS
    )
    colors = {tuple(c.get_facecolor()[0]) for c in fig.axes[0].collections}
    assert colors == {to_rgba(viz.trace.COLORS[k]) for k in profile.KINDS if summary.seconds(k) > 0}


def test_trace_figure_draws_on_a_given_axes(mlp, batch, tmp_path):
    _, summary = _profiled(pk.SingleDevice(), mlp, batch, tmp_path)
    ax = Figure().subplots()
    assert viz.trace_figure(summary, ax=ax) is ax.figure and ax.get_title() == "Where the time goes: 3 traced steps"


def test_steps_must_be_a_positive_int(mlp, batch):
    with pytest.raises(ValueError, match=r"profile\(steps=0\)"):
        profile.profile(None, None, batch, steps=0)
