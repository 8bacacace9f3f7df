"""ParameterServer on simulated devices: shard placement, the partition, async staleness, errors, compilation."""

from __future__ import annotations

import logging

import jax
import numpy as np
import optax
import pytest
from helpers import assert_steps_compile_once, tree_allclose

import parallelkit as pk
from parallelkit.strategies.offdevice.asynchronous import AsyncWorkers
from parallelkit.strategies.offdevice.partition import Partition, RoundRobin, Sharded

STEPS = 6


def _assert_each_shard_once_in_host_memory(state, strategy):
    """Shard j's parameters and optimizer state: one copy, in the pinned_host memory of device j % n."""
    assert len(state.params.shards) == len(state.opt_state) == strategy.num_shards
    for j, (shard, opt) in enumerate(zip(state.params.shards, state.opt_state, strict=True)):
        owner = strategy.devices[j % strategy.num_replicas]
        for leaf in jax.tree.leaves((shard, opt)):
            assert leaf.sharding.memory_kind == "pinned_host", f"shard {j}"
            assert leaf.sharding.device_set == {owner}, f"shard {j}"
            assert len(leaf.addressable_shards) == 1
    assert state.step.sharding.device_set == {strategy.devices[0]}
    assert state.step.sharding.memory_kind == "pinned_host"


def _train(strategy, mlp, digits, steps=STEPS, tx=None):
    loss_fn, params = mlp
    step = strategy.step(loss_fn)
    state = strategy.init(params, tx or optax.sgd(0.5))
    for batch in pk.data.batches(digits, 64, steps=steps):
        state, _ = step(state, batch)
    return strategy.unreplicate(state.params), step


@pytest.mark.parametrize("shards, workers", [(3, 8), (3, 2)])
def test_every_leaf_placed_after_init_and_after_a_step(mlp, batch, shards, workers):
    """3 shards on 8 workers sit beside devices 0, 1, 2; on 2 workers shard 2 wraps to device 0."""
    loss_fn, params = mlp
    strategy = pk.ParameterServer(shards, devices=workers)
    state = strategy.init(params, optax.adam(1e-3))
    _assert_each_shard_once_in_host_memory(state, strategy)
    state, metrics = strategy.step(loss_fn)(state, batch)
    _assert_each_shard_once_in_host_memory(state, strategy)
    assert set(metrics) == {"loss", "accuracy"}
    rows = strategy.describe(state)
    assert len(rows) == len(jax.tree.leaves(state))
    assert all(r.memory_kind == "pinned_host" and r.copies == 1 and len(r.devices) == 1 for r in rows)
    assert {r.devices[0] for r in rows if r.path.startswith(".params")} == {j % workers for j in range(shards)}


@pytest.mark.parametrize("num_shards", [1, 2, 3, 7, 4810])
def test_partition_is_balanced_and_covers_every_element_once(mlp, num_shards):
    _, params = mlp
    total = sum(x.size for x in jax.tree.leaves(params))
    assert total == 4810
    part = Partition.of(params, num_shards)
    sizes = [b - a for a, b in part.bounds]
    assert len(sizes) == num_shards and max(sizes) - min(sizes) <= 1 and sum(sizes) == total
    assert part.bounds[0][0] == 0 and part.bounds[-1][1] == total
    assert all(
        a[1] == b[0] for a, b in zip(part.bounds[:-1], part.bounds[1:], strict=True)
    )  # contiguous, no gap, no overlap
    # every element of every variable is held by exactly one shard
    counts = {p: np.zeros(int(np.prod(s)), int) for p, s in zip(part.paths, part.shapes, strict=True)}
    for j in range(num_shards):
        held = 0
        for piece in part.pieces(j):
            counts[piece.path][piece.start : piece.stop] += 1
            held += piece.stop - piece.start
        assert held == sizes[j]
    assert all((c == 1).all() for c in counts.values())
    # and the shards put back together are the parameters, bit for bit
    if num_shards < 100:  # (4810 one-element slices are slow to cut, and prove nothing more)
        tree_allclose(part.join([np.asarray(s) for s in part.split(params)]), params, rtol=0, atol=0)


def test_partition_table_text(mlp):
    _, params = mlp
    strategy = pk.ParameterServer(3)
    lines = strategy.partition(params).table(strategy.devices).splitlines()
    assert lines[0].split() == ["shard", "device", "elements", "bytes", "pieces"]
    assert lines[2].split()[:4] == ["0", "0", "1603", "6412"]
    assert lines[3].split() == ["1", "1", "1604", "6416", "['hidden'][0]['kernel'][889:2493]"]
    assert lines[4].split() == ["2", "2", "1603", "6412", "['hidden'][0]['kernel'][2493:4096]"]
    assert lines[2].endswith(
        "['head']['bias'], ['head']['kernel'], ['hidden'][0]['bias'], ['hidden'][0]['kernel'][0:889]"
    )
    assert pk.ParameterServer(3).partition(params).table().splitlines()[2].split()[1] == "-"  # no devices given


def test_the_partition_figure_marks_each_cut_in_the_flat_vector(mlp):
    from parallelkit import viz

    _, params = mlp
    partition = pk.ParameterServer(3, devices=3).partition(params)
    flat = viz.partition_figure(partition).axes[1]
    assert [line.get_xdata()[0] for line in flat.lines] == [1603, 3207]  # the cuts, not the variables' edges
    offsets = np.cumsum([0] + [int(np.prod(shape)) for shape in partition.shapes])[:-1]
    assert [p.get_x() for p in flat.patches] == offsets.tolist()  # one segment per variable, in tree order


NOT_ELEMENT_WISE = {  # name: (optimizer, why, whether one shard, holding every parameter as one flat vector, suits it)
    "global-norm clipping": (
        optax.chain(optax.clip_by_global_norm(1.0), optax.sgd(0.1)),
        "clip by the global norm",
        True,  # the flat vector's norm is the global norm
    ),
    "LAMB": (optax.lamb(1e-3), "LAMB and LARS trust ratios", False),  # one norm over the vector, not one per leaf
    "LARS": (optax.lars(1e-3), "LAMB and LARS trust ratios", False),
    "a weight-decay mask by rank": (
        optax.adamw(1e-3, mask=lambda p: jax.tree.map(lambda x: x.ndim > 1, p)),
        "chosen by the parameter's path",
        False,  # the flat vector has rank 1
    ),
    "a weight-decay mask by name": (
        optax.adamw(
            1e-3,
            mask=lambda p: {
                "head": jax.tree.map(lambda _: False, p["head"]),
                "hidden": jax.tree.map(lambda _: True, p["hidden"]),
            },
        ),
        "fails on a piece",
        False,
    ),
}


@pytest.mark.parametrize("mode", ["sync", "async"])
@pytest.mark.parametrize("name", NOT_ELEMENT_WISE)
def test_optimizers_that_need_more_than_one_element_are_refused(mlp, name, mode):
    """Each shard updates its flat slice alone: what needs a norm or a path across slices cannot be run that way."""
    tx, why, one_shard_suits = NOT_ELEMENT_WISE[name]
    with pytest.raises(ValueError, match=rf"each of its 3 shards' .*{why}.*element-wise optimizer.*FullySharded"):
        pk.ParameterServer(3, mode=mode, devices=2).init(mlp[1], tx)
    one_shard = pk.ParameterServer(1, mode=mode, devices=2)
    if one_shard_suits:
        one_shard.init(mlp[1], tx)
    else:
        with pytest.raises(ValueError, match=rf"flattened into one vector.*{why}"):
            one_shard.init(mlp[1], tx)


def test_element_wise_optimizers_pass_the_probe_and_train_like_one_device(mlp, digits):
    for tx in (optax.sgd(0.5), optax.sgd(0.1, momentum=0.9), optax.adam(1e-3, eps=1e-3), optax.adamw(1e-3, eps=1e-3)):
        trained, _ = _train(pk.ParameterServer(3, devices=2), mlp, digits, steps=3, tx=tx)
        reference, _ = _train(pk.SingleDevice(), mlp, digits, steps=3, tx=tx)
        tree_allclose(trained, reference)


def test_async_applies_each_gradient_on_the_version_it_claims(mlp, digits):
    """Replayed in plain JAX from the log: push k's gradient at the parameters of version ``push.version``.

    Each applied gradient is computed on the claimed version's parameters, on slice k of
    its round's batch, and applied alone, one optimizer update per push; the result must
    be the strategy's parameters. A push computed on any other version breaks the equality.
    """
    loss_fn, params = mlp
    tx = optax.sgd(0.3, momentum=0.9)
    strategy = pk.ParameterServer(3, mode="async", devices=4, seed=0, worker_times=(1.0, 1.0, 1.5, 3.0))
    step, state = strategy.step(loss_fn), strategy.init(params, tx)
    batches = list(pk.data.batches(digits, 64, steps=STEPS))
    for batch in batches:
        state, _ = step(state, batch)
    pushes = step.fn.pushes
    assert len(pushes) == 4 * STEPS == int(state.step)
    assert max(p.delay for p in pushes) > 0
    history, opt_state = [params], tx.init(params)
    grad = jax.jit(jax.grad(lambda p, b: loss_fn(p, b)[0]))
    for k, push in enumerate(pushes):
        assert push.applied_to == len(history) - 1  # applied in order, to the newest version
        i = k % 4  # push k computes on slice i of round k // 4
        data = {key: x[i * 16 : (i + 1) * 16] for key, x in batches[k // 4].items()}
        updates, opt_state = tx.update(grad(history[push.version], data), opt_state)
        history.append(optax.apply_updates(history[-1], updates))
    tree_allclose(strategy.unreplicate(state.params), history[-1], rtol=1e-5, atol=1e-6)


def test_async_workers_schedule_follows_their_speeds():
    """Equal workers are stale by about n - 1 updates; a slow worker pushes less often and staler."""
    equal = AsyncWorkers(4, seed=0)
    pushes = equal.schedule(100)
    assert equal.dropped == 0  # no bound: no worker dropped its gradient and pulled again
    assert sorted(p.delay for p in pushes[:4]) == [0, 1, 2, 3]  # all start together on version 0
    # then, on average, each finds the other three workers' pushes applied since its pull
    assert np.mean([p.delay for p in pushes[8:]]) == pytest.approx(3, abs=0.1)
    pushes = AsyncWorkers(4, worker_times=(1, 1, 1, 4), seed=0).schedule(100)
    by_worker = {w: [p.delay for p in pushes if p.worker == w] for w in range(4)}
    assert len(by_worker[3]) < min(len(by_worker[w]) for w in range(3))
    assert np.mean(by_worker[3]) > max(np.mean(by_worker[w]) for w in range(3))


def test_a_staleness_bound_drops_older_gradients_and_the_seed_fixes_the_schedule():
    def run(staleness, seed):
        workers = AsyncWorkers(8, staleness=staleness, seed=seed)
        pushes = workers.schedule(80)
        return [(p.worker, p.version, p.delay) for p in pushes], workers.dropped

    bounded, dropped = run(2, 0)
    assert max(d for _, _, d in bounded) <= 2 and dropped > 0
    assert run(2, 0) == (bounded, dropped)  # the seed fixes the schedule
    assert run(2, 1)[0] != bounded
    free, none_dropped = run(None, 0)
    assert max(d for _, _, d in free) > 2 and none_dropped == 0


def test_staler_gradients_train_worse_on_fixed_seeds(mlp, digits):
    """The lesson of notebook 04: the loss on all the data worsens as the staleness bound grows."""
    loss_fn, params = mlp
    everything = {"x": digits.x, "y": digits.y}
    losses = []
    for staleness in (0, 2, None):
        strategy = pk.ParameterServer(3, mode="async", staleness=staleness, seed=0, devices=4)
        trained, step = _train(strategy, mlp, digits, steps=20, tx=optax.sgd(0.3))
        assert max(step.fn.delays) <= (4 * 20 if staleness is None else staleness)
        losses.append(float(loss_fn(trained, everything)[0]))
    assert losses[0] < losses[1] < losses[2], losses


def test_an_async_step_continues_only_its_own_run(mlp, digits):
    loss_fn, params = mlp
    strategy = pk.ParameterServer(2, mode="async", devices=2)
    step, start = strategy.step(loss_fn), strategy.init(params, optax.sgd(0.1))
    first, second = pk.data.batches(digits, 64, steps=2)
    state, _ = step(start, first)
    state, _ = step(state, second)  # its own state: fine
    with pytest.raises(ValueError, match=r"applied 4 updates since step 0, but was handed a state at step 0.*fresh"):
        step(strategy.init(params, optax.sgd(0.1)), first)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"num_shards": 0}, r"num_shards=0: use an integer >= 1"),
        ({"num_shards": 2.0}, r"num_shards=2.0: use an integer >= 1"),
        ({"num_shards": True}, r"num_shards=True: use an integer >= 1"),
        ({"mode": "async", "staleness": -1}, r"staleness=-1: it counts updates, so use an integer >= 0 \(or None"),
        ({"mode": "async", "staleness": 1.5}, r"staleness=1.5: it counts updates"),
        ({"mode": "async", "staleness": "2"}, r"staleness='2': it counts updates"),
        ({"mode": "hogwild"}, r"mode='hogwild'\): choose one of \('sync', 'async'\)"),
        ({"staleness": 2}, r"staleness needs mode='async'"),
        ({"worker_times": (1, 2)}, r"worker_times needs mode='async'"),
        ({"mode": "async", "devices": 2, "worker_times": (1, 2, 3)}, r"give one time per worker \(2\)"),
        ({"mode": "async", "devices": 2, "worker_times": (1, 0)}, r"each a number > 0"),
    ],
)
def test_bad_arguments_are_clear_errors(kwargs, message):
    with pytest.raises(ValueError, match=message):
        pk.ParameterServer(**kwargs)


def test_more_shards_than_elements_is_a_clear_error(mlp):
    _, params = mlp
    with pytest.warns(pk.DeviceSubsetWarning, match="4811 shards on 8 devices"):  # more shards than devices
        strategy = pk.ParameterServer(4811)  # the check needs the parameters, so it comes at init
    with pytest.raises(ValueError, match=r"num_shards=4811: the parameters hold 4810 elements.*1 to 4810 shards"):
        strategy.init(params, optax.sgd(0.1))


def test_mixed_dtypes_are_a_clear_error():
    with pytest.raises(ValueError, match=r"every parameter needs one dtype.*Cast the parameters"):
        Partition.of({"a": np.zeros(3, np.float32), "b": np.zeros(3, np.float16)}, 2)


def test_unreplicate_gives_back_the_original_tree(mlp):
    _, params = mlp
    strategy = pk.ParameterServer(3, devices=4)
    state = strategy.init(params, optax.sgd(0.1))
    assert isinstance(state.params, Sharded)
    host = strategy.unreplicate(state.params)
    assert jax.tree.structure(host) == jax.tree.structure(params)
    assert all(isinstance(x, np.ndarray) for x in jax.tree.leaves(host))
    tree_allclose(host, params, rtol=0, atol=0)
    # inside a larger tree too: the Sharded node is replaced, the rest kept
    both = strategy.unreplicate({"params": state.params, "step": state.step})
    assert jax.tree.structure(both["params"]) == jax.tree.structure(params) and int(both["step"]) == 0


def test_second_step_does_not_recompile(mlp, digits):
    loss_fn, params = mlp
    assert_steps_compile_once(pk.ParameterServer(3, mode="async", staleness=2), loss_fn, params, digits)


def test_repr():
    assert repr(pk.ParameterServer(2, devices=4)) == "ParameterServer(num_shards=2, mode='sync', workers=4)"
    assert (
        repr(pk.ParameterServer(3, "async", 4)) == "ParameterServer(num_shards=3, mode='async', staleness=4, workers=8)"
    )


def test_round_robin_placement_of_whole_variables_is_unbalanced(mlp):
    """TF1's replica_device_setter deals whole variables in turn; the balanced partition cuts bytes evenly."""
    _, params = mlp
    order = ["['head']['bias']", "['head']['kernel']", "['hidden'][0]['bias']", "['hidden'][0]['kernel']"]
    placed = RoundRobin.of(params, 2)
    assert [(path, shard) for path, shard, _ in placed.assignment] == list(zip(order, [0, 1, 0, 1], strict=True))
    assert placed.loads == ((10 + 64) * 4, (640 + 4096) * 4)  # one task holds 98% of the bytes
    assert RoundRobin.of(params, 3).loads == ((10 + 4096) * 4, 640 * 4, 64 * 4)
    assert Partition.of(params, 2).loads == (2405 * 4, 2405 * 4)
    assert sum(Partition.of(params, 3).loads) == sum(RoundRobin.of(params, 3).loads) == 4810 * 4
    with pytest.raises(ValueError, match="num_shards=0: use an integer >= 1"):
        RoundRobin.of(params, 0)


def test_a_second_async_run_on_the_same_loss_compiles_no_worker_program_again(mlp, digits, caplog):
    """Two strategies over one loss share its programs (a notebook's sweep of staleness bounds compiles once);
    a callable that cannot be hashed still trains, with programs of its own, to the same parameters."""
    loss_fn, params = mlp
    tx = optax.sgd(0.5)  # one optimizer: it is a static argument of the shards' update

    def run(loss):
        strategy = pk.ParameterServer(2, devices=4, mode="async", staleness=1)
        return _train(strategy, (loss, params), digits, steps=2, tx=tx)[0]

    def workers_compiled(loss) -> tuple[object, list[str]]:
        caplog.clear()
        with jax.log_compiles():
            trained = run(loss)
        messages = [r.getMessage() for r in caplog.records if "Finished XLA compilation" in r.getMessage()]
        return trained, [m for m in messages if "gradient_rows" in m or "_shard_update" in m]

    caplog.set_level(logging.WARNING)
    first, compiled = workers_compiled(loss_fn)
    assert len(compiled) >= 4 + 2, compiled  # each worker's gradient program, each shard's update
    again, compiled = workers_compiled(loss_fn)
    assert compiled == []
    tree_allclose(again, first)

    class Unhashable:
        __hash__ = None

        def __call__(self, params, batch, **extras):
            return loss_fn(params, batch, **extras)

    tree_allclose(run(Unhashable()), first)
