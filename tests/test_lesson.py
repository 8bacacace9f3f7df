"""The notebooks' helpers: settings refused in words, predictions checked, widgets rendered as snapshots."""

from __future__ import annotations

import base64

import jax
import nbformat
import pytest

import parallelkit as pk
from parallelkit.course import build as course


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (
            {"model": "resnet"},
            "MODEL='resnet' is not one this lesson can use: choose one of 'mlp', 'cnn', 'transformer'",
        ),
        ({"model": "cnn", "models": ("mlp",)}, "choose one of 'mlp'"),
        ({"force_cpu": "yes"}, "FORCE_CPU must be True or False"),
        ({"batch": 0}, "BATCH=0 must be a whole number of examples, at least 1"),
        ({"batch": 100}, "BATCH=100 does not split evenly over 8 devices: choose a multiple of 8, such as 96"),
        ({"needs": 16}, "N_DEVICES=8: this lesson needs a whole number of at least 16 devices"),
    ],
)
def test_setup_refuses_what_the_lesson_cannot_use(kwargs, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        pk.lesson.setup(8, **kwargs)


def test_setup_returns_the_devices_and_says_what_they_are(capsys):
    devices = pk.lesson.setup(8, batch=64, model="transformer", force_cpu=True)
    assert devices == jax.devices() and len(devices) == 8
    assert "8 simulated CPU devices" in capsys.readouterr().out


def test_setup_too_late_for_another_count_says_restart():
    with pytest.raises(pk.DeviceCountError, match="Restart the kernel"):
        pk.lesson.setup(4)


@pytest.mark.parametrize(
    "prediction, measured, expected",
    [(None, 3.0, None), (3, 2.95, True), (2, 3.0, False), (0, 0.0, True), (0.01, 0.0, False), ("P()", "P()", True)],
)
def test_check_compares_a_prediction_with_the_measurement(prediction, measured, expected, capsys):
    assert pk.lesson.check(prediction, measured, what="x") is expected
    said = capsys.readouterr().out
    assert ("right" in said) == (expected is True) and ("not quite" in said) == (expected is False)


def _notebook_with_widgets(states: dict, model_id: str) -> nbformat.NotebookNode:
    view = {"application/vnd.jupyter.widget-view+json": {"model_id": model_id, "version_major": 2}}
    cell = nbformat.v4.new_code_cell("w", outputs=[nbformat.v4.new_output("display_data", data=view)])
    nb = nbformat.v4.new_notebook(cells=[cell])
    nb.metadata["widgets"] = {course.WIDGET_STATE: {"state": states}}
    return nb


def test_widget_snapshots_show_the_last_state_as_html():
    png = base64.b64encode(b"\x89PNG fake").decode()
    states = {
        "box": {
            "model_name": "VBoxModel",
            "state": {
                "children": ["IPY_MODEL_html", "IPY_MODEL_bar", "IPY_MODEL_img"],
                "_dom_classes": ["pk-dashboard"],
            },
        },  # fmt: skip
        "html": {"model_name": "HTMLModel", "state": {"value": "<b class='pk-value'>400</b>"}},
        "bar": {"model_name": "FloatProgressModel", "state": {"value": 400, "max": 400, "description": "steps"}},
        "img": {
            "model_name": "ImageModel",
            "state": {"format": "png"},
            "buffers": [{"data": png, "encoding": "base64", "path": ["value"]}],
        },  # fmt: skip
    }
    nb = course.snapshot_widgets(_notebook_with_widgets(states, "box"))
    html = nb.cells[0].outputs[0].data["text/html"]
    assert "class='pk-widget pk-dashboard'" in html
    assert "<b class='pk-value'>400</b>" in html
    assert "<progress value='400' max='400'>" in html
    assert f"src='data:image/png;base64,{png}'" in html
    assert "widgets" not in nb.metadata  # nothing left for a widget manager


def test_a_widget_without_stored_state_says_so():
    nb = course.snapshot_widgets(_notebook_with_widgets({}, "gone"))
    assert "pk-widget-missing" in nb.cells[0].outputs[0].data["text/html"]


def test_an_output_widget_shows_its_outputs():
    states = {"out": {"model_name": "OutputModel", "state": {"outputs": [{"output_type": "stream", "text": "a < b"}]}}}
    nb = course.snapshot_widgets(_notebook_with_widgets(states, "out"))
    assert "<pre>a &lt; b</pre>" in nb.cells[0].outputs[0].data["text/html"]


THREE_STAGE_1F1B = [
    [("forward", 0), ("forward", 1), ("forward", 2), ("backward", 0), ("forward", 3), ("backward", 1),
     ("backward", 2), ("backward", 3)],
    [("forward", 0), ("forward", 1), ("backward", 0), ("forward", 2), ("backward", 1), ("forward", 3),
     ("backward", 2), ("backward", 3)],
    [("forward", 0), ("backward", 0), ("forward", 1), ("backward", 1), ("forward", 2), ("backward", 2),
     ("forward", 3), ("backward", 3)],
]  # fmt: skip


def test_check_orders_accepts_1f1b_and_says_what_is_wrong_with_anything_else(capsys):
    """The 1F1B exercise's checker: the solution passes, the stub and every wrong order are refused in a sentence."""
    from parallelkit.strategies.pipeline.schedules import gpipe_schedule, one_f_one_b_schedule, stage_orders

    assert stage_orders(one_f_one_b_schedule(3, 4)) == THREE_STAGE_1F1B  # the exercise's solution is 1F1B's plan
    assert pk.lesson.check_orders(THREE_STAGE_1F1B, 3, 4) is True
    assert pk.lesson.check_orders(None, 3, 4) is None
    assert "write each stage's order" in capsys.readouterr().out.splitlines()[-1]
    wrong = {
        "holds 4 microbatches at once, where 1F1B holds 3": stage_orders(gpipe_schedule(3, 4)),
        "deadlock": [list(reversed(order)) for order in THREE_STAGE_1F1B],
        "Missing": [order[:-1] for order in THREE_STAGE_1F1B],
        "one order for each of the 3 stages": THREE_STAGE_1F1B[:2],
    }
    for message, orders in wrong.items():
        assert pk.lesson.check_orders(orders, 3, 4) is False
        assert message in capsys.readouterr().out, message


def _ring_all_reduce(x):
    """A sum over the `data` axis from neighbour-to-neighbour sends only: the exercise's solution."""
    n = jax.lax.axis_size("data")
    total = passing = x
    for _ in range(n - 1):
        passing = jax.lax.ppermute(passing, "data", [(i, (i + 1) % n) for i in range(n)])
        total = total + passing
    return total


def _not_written(x):
    raise NotImplementedError


@pytest.mark.parametrize(
    "body, verdict, says",
    [
        (_ring_all_reduce, True, "right: the all-reduce returns what the kit's does, and compiles to collective-perm"),
        (lambda x: jax.lax.psum(x, "data"), False, "not yet: it compiles to an all-reduce; write it without one"),
        (_not_written, False, "not yet: the all-reduce still raises NotImplementedError"),
        (lambda x: x, False, "not yet: its values differ from the kit's by up to"),
        (lambda x: None, False, "not yet: it returns None"),
        (lambda x: x[:1], False, "not yet: it returns shape (4, 3) where the kit's answer has shape (8, 3)"),
    ],
)
def test_check_function_compares_values_and_the_collectives_compiled(body, verdict, says, capsys):
    from jax.sharding import PartitionSpec as P

    mesh = jax.sharding.Mesh(jax.devices()[:4], ("data",))
    by_device = jax.numpy.arange(24.0).reshape(8, 3)

    def on_mesh(f):
        return jax.shard_map(f, mesh=mesh, in_specs=P("data"), out_specs=P("data"))

    reference = on_mesh(lambda x: jax.lax.psum(x, "data"))
    got = pk.lesson.check_function(
        on_mesh(body), reference, by_device, what="the all-reduce", needs=["collective-permute"], never=["all-reduce"]
    )
    assert got is verdict
    assert says in capsys.readouterr().out


@pytest.mark.parametrize("field", ["needs", "never"])
def test_check_function_refuses_a_name_that_is_not_a_collective(field):
    with pytest.raises(ValueError, match=r"\['all-reduc'\], which are not collectives: choose from \['all-reduce'"):
        pk.lesson.check_function(lambda: 1, lambda: 1, what="the sum", **{field: ["all-reduc"]})


def test_check_function_waits_for_a_function(capsys):
    assert pk.lesson.check_function(None, lambda: 1, what="the router") is None
    assert "write the router in the cell above" in capsys.readouterr().out
