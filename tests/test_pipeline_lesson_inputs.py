"""Pipeline and course-checker inputs that failed inside JAX, silently, or for ever: each now says what to do.

``pk.Pipeline`` and its schedules, the one-program ``circular_pipeline``, and the checkers the
course's exercises call (``pk.lesson.check_function``, ``pk.lesson.check_orders``): one case per input.
"""

from __future__ import annotations

import re
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

import parallelkit as pk
from parallelkit.strategies.pipeline import schedules
from parallelkit.strategies.pipeline.circular import circular_pipeline

LAYERS = [lambda p, x: x @ p for _ in range(4)]

# --- pk.Pipeline and its schedules ------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (
            {"layers": LAYERS, "schedule": "interleaved"},
            "Pipeline(schedule='interleaved', virtual=1): an interleaved schedule runs several chunks of layers "
            "per stage. Pass virtual=2 or more, or schedule='1f1b'",
        ),
        (
            {"layers": [{"kernel": np.ones((3, 3))}, {"kernel": np.ones((3, 3))}]},
            "layers[0] is a dict, not a function. layers is the list of layer functions, each apply(params, x) -> y; "
            "their parameters go to Pipeline.init",
        ),
        ({"layers": LAYERS[0]}, "Pipeline(layers=<function>): layers is a list of layer functions"),
        (
            {"layers": LAYERS, "schedule": lambda stages, microbatches: []},
            "its schedule function returned no slots ([]) for 2 stages and 4 microbatches. Return every stage's "
            "passes as Slot rows",
        ),
    ],
    ids=["interleaved without virtual", "a parameter list as layers", "one function as layers", "empty schedule"],
)
def test_a_pipeline_refuses_what_it_cannot_run(kwargs, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        pk.Pipeline(stages=2, microbatches=4, devices=jax.devices()[:2], **kwargs)


def test_a_pipeline_takes_its_layer_functions_from_any_iterable():
    pipe = pk.Pipeline((layer for layer in LAYERS), stages=2, microbatches=4, devices=jax.devices()[:2])
    assert pipe.layers[1:] == tuple(LAYERS[1:]) and pipe.stage_layers == [range(0, 2), range(2, 4)]


@pytest.mark.parametrize("tool", [schedules.check_schedule, schedules.makespan, schedules.stage_orders])
def test_the_schedule_tools_refuse_an_empty_schedule(tool):
    with pytest.raises(ValueError, match=rf"{tool.__name__} got an empty schedule \(\[\]\): a schedule lists"):
        tool([])


# --- circular_pipeline --------------------------------------------------------------------------------


def tanh_block(w, x):
    return jnp.tanh(x @ w)


STACKED = jnp.stack([jnp.eye(3) * (k + 1) for k in range(4)])  # 4 repeats: 2 stages x 2 chunks
ROWS = jnp.ones((4, 3))


def stage_mesh() -> Mesh:
    return Mesh(jax.devices()[:2], ("stage",))


def data_stage_mesh() -> Mesh:
    return Mesh(np.array(jax.devices()[:4]).reshape(2, 2), ("data", "stage"))


def explicit_mesh() -> Mesh:
    return jax.make_mesh((2,), ("stage",), devices=jax.devices()[:2])  # Explicit axes: jax.make_mesh's default


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"axis": "pipe"}, "circular_pipeline(axis='pipe'): the mesh has no axis of that name; its axes are ('stage"),
        ({"data_axis": "data"}, "circular_pipeline(data_axis='data'): it is not one of the mesh's axes ('stage',)"),
        ({"data_axis": "stage"}, "circular_pipeline(data_axis='stage'): it is the stages' axis. Pass the other"),
        ({"mesh": explicit_mesh}, "the mesh's axes are {'stage': 'Explicit'}, and the pipeline's loop runs on Auto"),
        ({"microbatches": 4.0}, "(microbatches=4.0): it needs a whole number of at least 2 microbatches, one per"),
        ({"microbatches": 1}, "(microbatches=1): it needs a whole number of at least 2 microbatches, one per stage "
         "(so that a microbatch back at stage 0 waits for its next chunk instead of colliding with a new one). Pass, "
         "say, microbatches=2."),
        (
            {"block": lambda w, x: x @ w, "stacked": jnp.ones((4, 3, 5))},
            "block returned float32[2, 5] for an input of float32[2, 3] (one device's rows of a microbatch)",
        ),
        (
            {"block": lambda p, x: x * p["a"] + p["b"], "stacked": {"a": jnp.ones(4), "b": jnp.float32(1)}},
            "the parameter at ['b'] is a scalar, without a leading axis of repeats. Stack each repeat's parameters",
        ),
        ({"x": jnp.ones((6, 3)), "microbatches": 4}, "a batch of 6 rows does not split into 4 microbatches"),
        (
            {"x": jnp.ones((6, 3)), "mesh": data_stage_mesh, "data_axis": "data"},
            "each of the 2 microbatches has 3 rows, which do not split over the 2 devices of data_axis='data'",
        ),
        (
            {"x": jnp.ones((4, 3), jnp.int32)},
            "block returned float32[2, 3] for an input of int32[2, 3] (one device's rows of a microbatch). Each "
            "repeat's output is the next one's input, so a block must keep its input's shape and dtype",
        ),
        ({"x": jnp.float32(1)}, "circular_pipeline: x is a scalar. Pass a batch whose leading axis holds its rows"),
    ],
    ids=[
        "unknown stage axis", "unknown data axis", "data axis is the stage axis", "Explicit mesh",
        "float microbatches", "too few microbatches", "a block that changes the width", "scalar parameter",
        "rows over microbatches", "rows over the data axis", "integer input", "scalar input",
    ],
)  # fmt: skip
def test_circular_pipeline_checks_its_inputs_before_jax_does(change, message):
    arguments = {"block": tanh_block, "stacked": STACKED, "x": ROWS, "mesh": stage_mesh, "microbatches": 2} | change
    arguments["mesh"] = arguments["mesh"]()
    with pytest.raises(ValueError, match=re.escape(message)):
        circular_pipeline(arguments.pop("block"), arguments.pop("stacked"), arguments.pop("x"), **arguments)


def test_circular_pipeline_runs_an_integer_batch_through_a_block_that_keeps_integers():
    doubled = circular_pipeline(lambda w, x: x * 2, STACKED, jnp.ones((4, 3), jnp.int32), mesh=stage_mesh(),
                                microbatches=2)  # fmt: skip
    assert doubled.dtype == jnp.int32 and np.array_equal(doubled, np.full((4, 3), 16))  # 4 repeats: x 2^4


# --- pk.lesson.check_orders -------------------------------------------------------------------------------

ONE_F_ONE_B = schedules.stage_orders(schedules.one_f_one_b_schedule(3, 4))


def with_first_pass(first) -> list:
    orders = [list(order) for order in ONE_F_ONE_B]
    orders[0][0] = first
    return orders


@pytest.mark.parametrize(
    ("orders", "message"),
    [
        (with_first_pass(("fwd", 0)), "stage 0 runs ('fwd', 0), and 'fwd' is not a pass: use 'forward' or 'backward'"),
        (with_first_pass(("forward", 0.0)), "stage 0 runs ('forward', 0.0), and a microbatch is a whole number"),
        (with_first_pass(("forward", True)), "stage 0 runs ('forward', True), and a microbatch is a whole number"),
        (with_first_pass("forward"), "stage 0 runs 'forward', and each stage's order is a list of pairs"),
        (with_first_pass(("forward", 0, 0)), "stage 0 runs ('forward', 0, 0), and each stage's order is a list of"),
    ],
    ids=["unknown pass name", "float index", "bool index", "a name without its index", "a triple"],
)
def test_check_orders_names_a_pass_it_cannot_play(orders, message, capsys):
    assert pk.lesson.check_orders(orders, 3, 4) is False
    assert capsys.readouterr().out.startswith(f"not yet: {message}")


def test_check_orders_still_accepts_1f1b(capsys):
    assert pk.lesson.check_orders(ONE_F_ONE_B, 3, 4) is True
    assert capsys.readouterr().out.startswith("right:")


# --- pk.lesson.check_function -------------------------------------------------------------------------------


def uses_numpy(x):
    return jnp.asarray(np.sin(x))  # np on a traced array inside jax.jit


def python_if(x):
    return x if x.sum() > 0 else -x  # a Python if on a traced value inside jax.jit


@pytest.mark.parametrize(
    ("learner", "reference", "says"),
    [
        (lambda x: jnp.ones(3, jnp.int32), jnp.ones_like, "it returns int32 values where the kit's answer has "
         "float32 ones"),
        (lambda x: jnp.ones(3, jnp.bfloat16), jnp.ones_like, "it returns bfloat16 values where the kit's answer "
         "has float32 ones"),
        (lambda x: {"a": 1.0, "c": 2.0}, lambda x: {"a": 1.0, "b": 2.0}, "its result has ['c'] where the kit's "
         "answer has ['b']"),
        (lambda x: {"a": {"b": 1.0}}, lambda x: {"a": {"b": 1.0, "c": 2.0}}, "its result at ['a'] lacks ['c'], "
         "which the kit's answer has"),
        (lambda x: [1.0, 2.0], lambda x: (1.0, 2.0), "it returns a list of 2 where the kit's answer has a tuple of 2"),
        (jnp.ones_like, lambda x: {"w": x}, "it returns an array of shape (3,) where the kit's answer has a dict "
         "with keys ['w']"),
        (lambda x: jnp.array([1.0, jnp.nan, jnp.nan]), jnp.ones_like, "it returns NaN, element [1] (2 of 3) where "
         "the kit's answer has 1"),
        (lambda x: {"w": jnp.array([2.0, -jnp.inf, 1.0])}, lambda x: {"w": x}, "it returns an infinity at ['w'], "
         "element [1] (1 of 3) where the kit's answer has 1"),
        (jax.jit(uses_numpy), jnp.sin, "it hands a traced array to NumPy (TracerArrayConversionError): inside a "
         "function JAX traces, NumPy cannot read the values; use jax.numpy"),
        (jax.jit(python_if), lambda x: x, "it asks a Python if, while or bool() about a traced value "
         "(TracerBoolConversionError): use jnp.where or jax.lax.cond"),
    ],
    ids=["int32", "bfloat16", "another key", "a missing key", "list for tuple", "array for dict", "NaN", "infinity",
         "numpy in jit", "python if in jit"],
)  # fmt: skip
def test_check_function_says_how_an_answer_differs(learner, reference, says, capsys):
    assert pk.lesson.check_function(learner, reference, jnp.ones(3), what="the answer") is False
    assert capsys.readouterr().out.startswith(f"not yet: {says}")


def test_check_function_takes_nan_where_the_kit_has_nan_as_equal(capsys):
    both = jnp.array([1.0, jnp.nan])
    assert pk.lesson.check_function(lambda: both, lambda: both, what="the answer") is True
    assert capsys.readouterr().out.startswith("right:")


def on_four(f):
    mesh = jax.sharding.Mesh(jax.devices()[:4], ("data",))
    return jax.shard_map(f, mesh=mesh, in_specs=P("data"), out_specs=P("data"))


def shift(x):
    return jax.lax.ppermute(x, "data", [(i, (i + 1) % 4) for i in range(4)])


def test_check_function_takes_one_collective_name_as_a_string(capsys):
    x = jnp.arange(8.0)
    assert pk.lesson.check_function(on_four(shift), on_four(shift), x, what="the shift", needs="collective-permute",
                                    never="all-reduce") is True  # fmt: skip
    assert "compiles to collective-permute" in capsys.readouterr().out


def test_check_function_turns_numpy_met_while_compiling_for_the_collectives_into_advice(capsys):
    """The learner runs eagerly, where NumPy works; compiling it to read its collectives then traces it."""
    learner = lambda x: jnp.asarray(np.asarray(x))  # noqa: E731
    assert pk.lesson.check_function(learner, lambda x: x, jnp.ones(3), what="the sum", needs="all-reduce") is False
    assert "it hands a traced array to NumPy (TracerArrayConversionError)" in capsys.readouterr().out


@pytest.fixture
def stop():
    """An event that ends the test's endless loop once the test is over, so that no thread keeps running."""
    event = threading.Event()
    yield event
    event.set()


@pytest.mark.timeout(60)  # without the deadline the call never returns: a failure, not a hang
def test_check_function_gives_up_on_a_function_that_does_not_return(stop):
    def endless():
        while not stop.is_set():
            time.sleep(0.01)

    with pytest.raises(TimeoutError, match=r"the loop did not return within 0\.2 s: look for a loop that never ends.*"
                       r"may still be running in the background.*restart the kernel"):  # fmt: skip
        pk.lesson.check_function(endless, lambda: 1.0, what="the loop", timeout=0.2)


@pytest.mark.parametrize("timeout", [0, -1, "30", None])
def test_check_function_refuses_a_timeout_that_is_not_seconds(timeout):
    with pytest.raises(ValueError, match=rf"check_function\(timeout={re.escape(repr(timeout))}\): the seconds"):
        pk.lesson.check_function(lambda: 1.0, lambda: 1.0, what="x", timeout=timeout)


def test_check_function_runs_the_learner_under_the_callers_mesh(capsys):
    mesh = jax.make_mesh((8,), ("data",))
    with jax.set_mesh(mesh):
        assert pk.lesson.check_function(
            lambda: dict(jax.sharding.get_abstract_mesh().shape), lambda: {"data": 8}, what="the mesh"
        )
    assert capsys.readouterr().out.startswith("right:")
