"""Pipeline: placement, the executed order and timeline, activations stashed, traffic, the optimizer probe, errors.

Equivalence with SingleDevice (2 and 4 stages, 1, 4 and 8 microbatches, both schedules,
MLP and transformer, SGD and Adam, stages x data 2 x 2) is in test_equivalence.py.
"""

from __future__ import annotations

import threading

import jax
import numpy as np
import optax
import pytest
from flax import nnx
from helpers import assert_steps_compile_once, tree_allclose

import parallelkit as pk
from parallelkit.strategies.pipeline.schedules import check_schedule, gpipe_schedule, peak_in_flight, stage_orders

# Pipelines of 2 or 4 stages leave some of the suite's 8 devices idle on purpose here.
pytestmark = pytest.mark.filterwarnings("ignore::parallelkit.DeviceSubsetWarning")


@pytest.fixture(scope="module")
def deep_mlp(digits):
    """The kit's MLP as four layers: 64 -> 64 -> 32 -> 16 -> 10."""
    return pk.models.as_layers(pk.models.MLP(64, (64, 32, 16), digits.num_classes, rngs=nnx.Rngs(0)))


def devices_of(tree) -> set[int]:
    return {d.id for leaf in jax.tree.leaves(tree) for d in leaf.devices()}


@pytest.mark.parametrize(("stages", "data"), [(2, 1), (4, 1), (2, 2)])
def test_each_stage_keeps_its_parameters_and_optimizer_state_on_its_own_devices(stages, data, deep_mlp, batch):
    layers, params = deep_mlp
    pipe = pk.Pipeline(layers, stages, microbatches=4, data=data)
    state = pipe.init(params, optax.adam(1e-3))
    columns = [{d.id for d in pipe.mesh.devices[:, s]} for s in range(stages)]
    assert len(set().union(*columns)) == stages * data  # disjoint groups of `data` devices
    for when in ("after init", "after a step"):
        stage_params = pipe.stage_params(state.params)
        for s in range(stages):
            assert devices_of(stage_params[s]) == columns[s], when
            assert devices_of(state.opt_state[s]) == columns[s], when
        state, _ = pipe.step(pk.models.cross_entropy)(state, batch)


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
@pytest.mark.parametrize(("stages", "microbatches"), [(2, 4), (4, 8), (4, 2)])
def test_the_executed_order_is_the_schedules_and_every_interval_is_well_formed(
    schedule, stages, microbatches, deep_mlp, batch
):
    layers, params = deep_mlp
    pipe = pk.Pipeline(layers, stages, microbatches, schedule)
    step, state = pipe.step(pk.models.cross_entropy), pipe.init(params, optax.sgd(0.1))
    for _ in range(2):  # the second step runs compiled programs
        state, _ = step(state, batch)
        timeline = step.timeline
        assert timeline.orders() == stage_orders(pipe.planned())
        passes = [(s.kind, s.stage, s.microbatch) for s in timeline.slots]
        assert len(passes) == len(set(passes)) == 2 * stages * microbatches  # each pass once
        assert all(0 <= s.start <= s.end for s in timeline.slots)
        check_schedule(timeline.slots)  # measured: no overlap on a stage, every dependency waited for


@pytest.mark.parametrize(("stages", "microbatches"), [(2, 8), (4, 8), (4, 2)])
def test_microbatches_in_flight_and_activation_bytes_stashed_per_stage(stages, microbatches, deep_mlp, batch):
    """GPipe holds every microbatch's input on every stage; 1F1B at most `stages - stage` (so <= stages)."""
    layers, params = deep_mlp
    held = {}
    for schedule in ("gpipe", "1f1b"):
        pipe = pk.Pipeline(layers, stages, microbatches, schedule)
        step = pipe.step(pk.models.cross_entropy)
        step(pipe.init(params, optax.sgd(0.1)), batch)
        peaks, held[schedule] = step.timeline.peak_in_flight(), step.timeline.peak_stashed_bytes()
        if schedule == "gpipe":
            assert peaks == dict.fromkeys(range(stages), microbatches)
        else:
            assert all(peaks[s] <= stages for s in range(stages))
            assert peaks == {s: min(stages - s, microbatches) for s in range(stages)}
        assert peaks == peak_in_flight(pipe.planned())
        # Stage 0 stashes its microbatch of the batch: x (8x8 floats) and y (an int) per example.
        per_microbatch = (batch["x"][0].nbytes + batch["y"][0].nbytes) * len(batch["y"]) // microbatches
        assert held[schedule][0] == peaks[0] * per_microbatch
    if microbatches > stages:
        assert all(held["1f1b"][s] < held["gpipe"][s] for s in range(stages))


def test_a_stage_that_fails_stops_the_step_with_its_error_instead_of_hanging(deep_mlp, batch):
    layers, params = deep_mlp
    broken = [*layers[:2], lambda p, x: x @ np.zeros((3, 3)), *layers[3:]]  # shapes do not fit on stage 1
    pipe = pk.Pipeline(broken, 2, microbatches=4)
    step, state = pipe.step(pk.models.cross_entropy), pipe.init(params, optax.sgd(0.1))
    threads, raised = threading.active_count(), []

    def run() -> None:
        try:
            step(state, batch)
        except TypeError as err:
            raised.append(err)

    caller = threading.Thread(target=run, daemon=True)
    caller.start()
    caller.join(timeout=300)  # a hang guard, as for the tests' subprocesses: a hung step fails here
    assert not caller.is_alive(), "the step hung after a stage failed"
    assert len(raised) == 1 and "dot_general" in str(raised[0])
    assert threading.active_count() == threads  # every stage thread ended


def test_the_step_raises_the_failing_stages_error_even_when_another_stage_hands_over_after_it():
    """A stage that finishes a pass after another stage failed stops quietly: the step raises the failure."""
    import time

    from parallelkit.strategies.pipeline.executor import execute

    def task(kind, stage, microbatch, received):
        if stage == 1:
            raise RuntimeError("stage 1 failed")
        if microbatch == 1:
            time.sleep(0.2)  # hands its second forward pass over after stage 1 has failed
        return microbatch

    with pytest.raises(RuntimeError, match="stage 1 failed"):
        execute(stage_orders(gpipe_schedule(2, 2)), task, stashed_bytes=lambda stage: 0)


def test_the_kits_models_as_layers_compute_the_modules_own_loss(digits, batch):
    for module in (
        pk.models.MLP(64, (32, 16), digits.num_classes, rngs=nnx.Rngs(0)),
        pk.models.Transformer(digits.input_shape, digits.num_classes, dropout=0.1, rngs=nnx.Rngs(0)),
    ):
        layers, params = pk.models.as_layers(module)
        apply, whole = pk.models.functional(module)
        expected = pk.models.classifier_loss(apply)(whole, batch)  # no rng: dropout off
        got = pk.pipeline.sequential_loss(layers, pk.models.cross_entropy)(params, batch)
        tree_allclose(got, expected)
    with pytest.raises(TypeError, match="list of functions"):
        pk.models.as_layers(pk.models.CNN(digits.input_shape, digits.num_classes, rngs=nnx.Rngs(0)))


def test_fit_trains_a_pipeline_and_its_steps_compile_once(deep_mlp, digits):
    layers, params = deep_mlp
    pipe = pk.Pipeline(layers, 2, microbatches=4, schedule="1f1b")
    result = pk.fit(pipe, pk.models.cross_entropy, params, optax.adam(1e-2), pk.data.batches(digits, 64, steps=30))
    losses = result.history.losses
    assert losses[-1] < losses[0] * 0.7
    assert_steps_compile_once(pipe, pk.models.cross_entropy, params, digits)


def test_a_checkpoint_restores_each_stage_onto_its_own_devices(deep_mlp, digits, tmp_path):
    layers, params = deep_mlp
    pipe = pk.Pipeline(layers, 2, microbatches=2, schedule="1f1b")
    batches = pk.data.batches(digits, 32, steps=4)
    tx = optax.adam(1e-3)
    result = pk.fit(pipe, pk.models.cross_entropy, params, tx, batches, checkpoint_dir=tmp_path)
    state = pk.checkpoint.restore(tmp_path, pipe, params, tx)
    tree_allclose(pipe.unreplicate(state), pipe.unreplicate(result.state), rtol=0, atol=0)
    for s, stage_params in enumerate(pipe.stage_params(state.params)):
        assert devices_of((stage_params, state.opt_state[s])) == {pipe.mesh.devices[0, s].id}


def test_a_consumed_state_is_refused_and_the_single_program_tools_say_why(deep_mlp, batch):
    layers, params = deep_mlp
    pipe = pk.Pipeline(layers, 2, microbatches=2)
    step, state = pipe.step(pk.models.cross_entropy), pipe.init(params, optax.sgd(0.1))
    step(state, batch)
    with pytest.raises(ValueError, match="already consumed"):
        step(state, batch)
    with pytest.raises(NotImplementedError, match="timeline"):
        step.lower(state, batch)


@pytest.mark.parametrize(("stages", "microbatches", "data"), [(2, 4, 1), (4, 2, 2)])
def test_traffic_measures_what_the_stages_hand_over_beside_the_formulas(stages, microbatches, data, deep_mlp, batch):
    """Measured: the arrays handed between stages, and the stages' compiled all-reduces; formulas: shapes and sizes."""
    layers, params = deep_mlp
    pipe = pk.Pipeline(layers, stages, microbatches, data=data, devices=jax.devices()[: stages * data])
    state = pipe.init(params, optax.adam(1e-3))
    traffic = pipe.traffic(pk.models.cross_entropy, state, batch)
    assert all(f.measured == f.expected for f in traffic.flows), traffic.table()
    widths = [64, 64, 32, 16]  # each layer's input width: stage s sends a (rows, width) float32 array per microbatch
    rows, handed = len(batch["y"]) // microbatches // data, 0
    for s in range(stages - 1):
        boundary = microbatches * rows * widths[pipe.stage_layers[s + 1][0]] * 4
        assert traffic.flow(f"activations, stage {s} -> {s + 1}").measured == boundary
        assert traffic.flow(f"gradients, stage {s + 1} -> {s}").measured == boundary
        handed += 2 * boundary
    batch_bytes = sum(x.nbytes for x in batch.values()) // data
    assert traffic.flow("batch, to stage 0").measured == batch_bytes
    assert traffic.flow(f"batch, to stage {stages - 1}").measured == batch_bytes
    all_reduces = [f for f in traffic.flows if f.what.startswith("gradients of stage")]
    if data == 1:
        assert traffic.between_devices == handed and not all_reduces and traffic.bus_bytes == 0
    else:  # each stage all-reduces its gradients once a step, not once per microbatch
        assert traffic.between_devices > handed
        assert sum(f.measured for f in all_reduces) == pk.models.param_bytes(params)
        assert not [f for f in traffic.flows if f.what.startswith("other collectives")], traffic.table()
        assert traffic.bus_bytes > 0
    assert "Pipeline" in pk.traffic.compare_table([traffic])
    state, _ = pipe.step(pk.models.cross_entropy)(state, batch)  # the report left the state as it was


@pytest.fixture(scope="module")
def eight_layers(digits):
    """The kit's MLP as eight layers (64 -> 32 x 7 -> 10): enough for 4 stages x 2 chunks."""
    return pk.models.as_layers(pk.models.MLP(64, (32,) * 7, digits.num_classes, rngs=nnx.Rngs(0)))


@pytest.mark.parametrize(("stages", "data"), [(2, 1), (2, 2), (4, 1), (4, 2)])
@pytest.mark.parametrize(("schedule", "virtual"), [("interleaved", 2), ("zb-h1", 1)])
def test_interleaved_and_zero_bubble_pipelines_equal_one_device(schedule, virtual, stages, data, eight_layers, digits):
    layers, params = eight_layers
    batches = list(pk.data.batches(digits, 64, steps=2))
    pipe = pk.Pipeline(layers, stages, 4, schedule, virtual=virtual, data=data, devices=jax.devices()[: stages * data])
    state, step = pipe.init(params, optax.adam(1e-3)), pipe.step(pk.models.cross_entropy)
    single = pk.SingleDevice()
    expected = single.init(params, optax.adam(1e-3))
    one = single.step(pk.pipeline.sequential_loss(layers, pk.models.cross_entropy))
    for batch in batches:
        state, _ = step(state, batch)
        expected, _ = one(expected, batch)
    tree_allclose(state.params, expected.params)
    assert step.timeline.orders() == stage_orders(pipe.planned())  # the executed order is the plan's
    runs = {(s.stage, s.chunk) for s in step.timeline.slots}
    assert runs == {(s, c) for s in range(stages) for c in range(virtual)}


def test_zero_bubbles_backward_and_weight_passes_add_up_to_the_fused_backward(deep_mlp, batch):
    """B (the input's gradient) and W (the parameters') of ZB-H1, two jax.vjp calls, equal the one fused pass."""
    from parallelkit.strategies.pipeline import stages as programs

    layers, params = deep_mlp
    statics = dict(layers=tuple(layers[1:3]), head_loss=pk.models.cross_entropy, first=False, last=False)
    x = pk.pipeline.run_layers(layers[:1], params[:1], batch)
    out = programs.forward(params[1:3], x, None, **statics)
    cotangent = jax.random.normal(jax.random.key(0), out.shape)
    zeros = jax.tree.map(np.zeros_like, params[1:3])
    fused_grads, fused_input = programs.backward(params[1:3], x, None, cotangent, zeros, **statics)
    input_grad = programs.backward_input(params[1:3], x, None, cotangent, **statics)
    zeros = jax.tree.map(np.zeros_like, params[1:3])
    weight_grads, none = programs.backward(params[1:3], x, None, cotangent, zeros, wrt="params", **statics)
    assert none is None
    tree_allclose(input_grad, fused_input)
    tree_allclose(weight_grads, fused_grads)


def test_zero_bubble_holds_each_microbatch_until_its_weight_pass(deep_mlp, batch):
    layers, params = deep_mlp
    held = {}
    for schedule in ("1f1b", "zb-h1"):
        pipe = pk.Pipeline(layers, 2, 4, schedule, devices=jax.devices()[:2])
        state, step = pipe.init(params, optax.sgd(0.1)), pipe.step(pk.models.cross_entropy)
        step(state, batch)
        held[schedule] = step.timeline.peak_stashed_bytes()
        assert step.timeline.peak_in_flight() == peak_in_flight(pipe.planned())
    assert held["zb-h1"][1] > held["1f1b"][1]  # the last stage: 1 microbatch under 1F1B, 2 under ZB-H1


def test_interleaving_hands_over_at_every_boundary_between_runs_of_layers(eight_layers, batch):
    """Stages 2, virtual 2: four runs of layers, three boundaries that cross devices, against 1F1B's one."""
    layers, params = eight_layers
    handed = {}
    for schedule, virtual in (("1f1b", 1), ("interleaved", 2)):
        pipe = pk.Pipeline(layers, 2, 4, schedule, virtual=virtual, devices=jax.devices()[:2])
        traffic = pipe.traffic(pk.models.cross_entropy, pipe.init(params, optax.sgd(0.1)), batch)
        assert all(f.measured == f.expected for f in traffic.flows), traffic.table()
        handed[schedule] = [f.measured for f in traffic.flows if f.what.startswith("activations")]
    assert len(handed["1f1b"]) == 1 and len(handed["interleaved"]) == 3  # (stages x virtual - 1) boundaries
    assert sum(handed["interleaved"]) == 3 * sum(handed["1f1b"])  # every layer's output is 32 floats wide


def test_zero_bubbles_traffic_reads_the_programs_it_runs_and_syncs_once(deep_mlp, batch):
    """With data = 2, ZB-H1's input-gradient and weight programs move no gradients: one all-reduce a step."""
    layers, params = deep_mlp
    pipe = pk.Pipeline(layers, 2, 4, "zb-h1", data=2, devices=jax.devices()[:4])
    traffic = pipe.traffic(pk.models.cross_entropy, pipe.init(params, optax.sgd(0.1)), batch)
    assert all(f.measured == f.expected for f in traffic.flows), traffic.table()
    all_reduces = [f for f in traffic.flows if f.what.startswith("gradients of stage")]
    assert sum(f.measured for f in all_reduces) == pk.models.param_bytes(params)
    assert not [f for f in traffic.flows if f.what.startswith("other collectives")], traffic.table()
    kinds = {kind for _, kind, _ in pipe.step(pk.models.cross_entropy).stage_collectives(
        pipe.init(params, optax.sgd(0.1)), pipe.place_batch(batch)[0])}  # fmt: skip
    assert kinds <= {"forward", "reduce"}  # the backward and weight passes themselves hold no collective


def test_the_optimizer_probe_refuses_global_norm_clipping_and_accepts_per_parameter_norms(deep_mlp, digits):
    layers, params = deep_mlp
    pipe = pk.Pipeline(layers, 2, microbatches=2, devices=jax.devices()[:2])
    clipped = optax.chain(optax.clip_by_global_norm(1.0), optax.sgd(0.1))
    with pytest.raises(ValueError, match=r"each of its 2 stages separately.*clip by the global norm.*SingleDevice"):
        pipe.init(params, clipped)
    one_stage = pk.Pipeline(layers, 1, microbatches=2, devices=jax.devices()[:1])
    one_stage.init(params, clipped)  # one stage is the whole model: nothing to refuse
    pipe.init(params, optax.lars(1e-2))  # LARS's trust ratio, too, is a norm per parameter
    # LAMB's trust ratio is a norm per parameter, and every stage holds whole parameters: it trains like one device.
    lamb = optax.lamb(1e-2)
    batches = lambda: pk.data.batches(digits, 32, steps=3)  # noqa: E731
    run = pk.fit(pipe, pk.models.cross_entropy, params, lamb, batches())
    single = pk.fit(pk.SingleDevice(), pk.pipeline.sequential_loss(layers, pk.models.cross_entropy), params, lamb,
                    batches())  # fmt: skip
    tree_allclose(run.params, single.params)


def test_the_timeline_keeps_the_devices_own_memory_reading_apart_from_the_stash(deep_mlp, batch, monkeypatch):
    layers, params = deep_mlp
    pipe = pk.Pipeline(layers, 2, microbatches=4, devices=jax.devices()[:2])
    step = pipe.step(pk.models.cross_entropy)
    state, _ = step(pipe.init(params, optax.sgd(0.1)), batch)
    assert jax.devices()[0].memory_stats() is None  # the CPU backend reports no memory statistics
    assert step.timeline.in_use == [] and step.timeline.peak_in_use_bytes() is None
    readings = {d.id: 1000 * (d.id + 1) for d in pipe.devices}  # a backend that reports them (GPUs do)
    monkeypatch.setattr(pk.pipeline.executor, "device_bytes_in_use", lambda device: readings[device.id])
    step(state, batch)
    assert len(step.timeline.in_use) == 2 * 2 * 4  # after every pass
    assert step.timeline.peak_in_use_bytes() == {s: readings[pipe.stage_devices(s)[0].id] for s in range(2)}


def test_the_explorer_redraws_from_a_real_run_for_every_choice(deep_mlp, batch, capsys):
    from parallelkit.viz import PipelineExplorer

    explorer = PipelineExplorer(*deep_mlp, pk.models.cross_entropy, batch)
    assert explorer.microbatch_choices == [1, 2, 4, 8]
    (sliders, schedule, label, image) = explorer.widget.children
    stages, micro = sliders.children
    first = image.value
    assert "Pipeline(stages=2, microbatches=8, schedule='gpipe')" in label.value and first
    stages.value, micro.value, schedule.value = 4, 2, "1f1b"
    assert "Pipeline(stages=4, microbatches=2, schedule='1f1b')" in label.value
    assert "held per stage [2, 2, 2, 1]" in label.value and image.value != first
    explorer._ipython_display_()  # outside a notebook: the summary as text
    assert "measured bubble" in capsys.readouterr().out


class TestBadInput:
    def test_more_stages_than_layers(self, deep_mlp):
        with pytest.raises(ValueError, match="5 stages needs at least 5 layers, but the model has 4"):
            pk.Pipeline(deep_mlp[0], stages=5)

    def test_microbatches_that_do_not_divide_the_batch(self, deep_mlp, batch):
        pipe = pk.Pipeline(deep_mlp[0], 2, microbatches=3)
        with pytest.raises(ValueError, match="64 examples does not split into 3 equal microbatches"):
            pipe.step(pk.models.cross_entropy)(pipe.init(deep_mlp[1], optax.sgd(0.1)), batch)

    def test_a_microbatch_that_does_not_split_over_a_stages_devices(self, deep_mlp, batch):
        pipe = pk.Pipeline(deep_mlp[0], 2, microbatches=32, data=4)
        with pytest.raises(ValueError, match="microbatch of 2 examples does not split over the 4 devices"):
            pipe.step(pk.models.cross_entropy)(pipe.init(deep_mlp[1], optax.sgd(0.1)), batch)

    def test_stages_times_data_not_the_device_count(self, deep_mlp):
        with pytest.raises(pk.DeviceCountError, match="stages x data = 4 devices, but 3 were given"):
            pk.Pipeline(deep_mlp[0], 2, data=2, devices=jax.devices()[:3])
        with pytest.raises(pk.DeviceCountError, match="Asked for 16 devices"):
            pk.Pipeline(deep_mlp[0], 4, data=4)

    @pytest.mark.parametrize("field", ["stages", "microbatches", "data"])
    def test_counts_below_one(self, deep_mlp, field):
        sizes = {"stages": 2, "microbatches": 2, "data": 1} | {field: 0}
        with pytest.raises(ValueError, match=f"{field}=0"):
            pk.Pipeline(deep_mlp[0], **sizes)

    def test_virtual_chunks_need_an_interleaved_schedule_and_whole_groups(self, deep_mlp):
        with pytest.raises(ValueError, match="only an interleaved schedule runs several chunks"):
            pk.Pipeline(deep_mlp[0], 2, 4, "1f1b", virtual=2)
        with pytest.raises(ValueError, match="multiple of 2 microbatches"):
            pk.Pipeline(deep_mlp[0], 2, 3, "interleaved", virtual=2)
        with pytest.raises(ValueError, match="needs at least 8 layers"):
            pk.Pipeline(deep_mlp[0], 4, 4, "interleaved", virtual=2)

    def test_an_unknown_schedule_and_a_bad_split(self, deep_mlp):
        with pytest.raises(ValueError, match="Unknown schedule 'zigzag'"):
            pk.Pipeline(deep_mlp[0], 2, schedule="zigzag")
        with pytest.raises(ValueError, match="add up to the model's 4 layers"):
            pk.Pipeline(deep_mlp[0], 2, layers_per_stage=[1, 2])

    def test_params_that_are_not_one_entry_per_layer_and_dropout_keys(self, deep_mlp, mlp):
        pipe = pk.Pipeline(deep_mlp[0], 2)
        with pytest.raises(ValueError, match="one for each of the 4 layers, got dict"):
            pipe.init(mlp[1], optax.sgd(0.1))
        for extra in ({"rng": 0}, {"model_state": {"mean": np.zeros(3)}}):
            with pytest.raises(ValueError, match="no model_state or rng.*another strategy"):
                pipe.init(deep_mlp[1], optax.sgd(0.1), **extra)
