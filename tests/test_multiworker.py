"""MultiWorkerMirrored on a real 2-process x 2-device cluster equals SingleDevice.

One local cluster (pk.distributed.run_local) runs everything once; each process
trains MultiWorkerMirrored (both ways of feeding the batch) and the SingleDevice
reference on one of its own devices, and reports back. Tolerance: float32, rtol 1e-5, atol 1e-6.
"""

from __future__ import annotations

import time

import numpy as np
import pytest
from helpers import tree_allclose
from test_precision import assert_within_bf16, dense_layers

import parallelkit as pk

PROCESSES, DEVICES_PER_PROCESS = 2, 2
STEPS, BATCH = 8, 32


def train_in_cluster() -> dict:
    """Runs in every process of the cluster (already joined by run_local)."""
    import jax
    import jax.numpy as jnp
    import optax
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    dataset = pk.data.digits()
    apply, params = pk.models.build("mlp", dataset.input_shape, dataset.num_classes)
    loss_fn = pk.models.classifier_loss(apply)
    out = {"process": jax.process_index(), "count": jax.process_count(), "devices": jax.device_count()}

    # A global psum: each device contributes its global index + 1, so 1 + 2 + 3 + 4 = 10 everywhere.
    strategy = pk.MultiWorkerMirrored()
    ones = jax.make_array_from_callback(
        (jax.device_count(),), strategy.batch_sharding, lambda i: np.arange(1.0, jax.device_count() + 1)[i]
    )
    total = jax.jit(jnp.sum, out_shardings=NamedSharding(strategy.mesh, P()))(ones)
    out["psum"] = float(total.addressable_data(0))

    def run(strat, feed_local=False):
        result = pk.fit(strat, loss_fn, params, optax.adam(1e-3), _batches(dataset, feed_local))
        return result, result.params

    result, out["global"] = run(strategy)
    out["losses"] = result.history.losses
    out["placement"] = [(p.spec, p.devices, p.copies) for p in strategy.describe(result.state.params)]
    _, out["local"] = run(pk.MultiWorkerMirrored(batch="local"), feed_local=True)
    _, out["explicit"] = run(pk.MultiWorkerMirrored(explicit=True))  # a global mesh of Explicit axes
    _, out["single"] = run(pk.SingleDevice(jax.local_devices()[0]))
    out["init"] = jax.device_get(params)
    return out


@pytest.fixture(scope="module")
def cluster_results():
    start = time.monotonic()
    results = pk.distributed.run_local(
        train_in_cluster, PROCESSES, DEVICES_PER_PROCESS, timeout=120, stream=False
    )  # fmt: skip
    print(f"2x2 cluster training: {time.monotonic() - start:.1f} s")
    return results


@pytest.mark.multihost
@pytest.mark.timeout(180)
def test_cluster_shape_and_global_psum(cluster_results):
    assert [r["process"] for r in cluster_results] == [0, 1]
    for r in cluster_results:
        assert r["count"] == PROCESSES and r["devices"] == PROCESSES * DEVICES_PER_PROCESS
        assert r["psum"] == 10.0


@pytest.mark.multihost
@pytest.mark.timeout(180)
@pytest.mark.parametrize("feed", ["global", "local", "explicit"])
def test_multiworker_mirrored_equals_single_device(cluster_results, feed):
    _assert_trained_as_single_device(cluster_results, feed)


@pytest.mark.multihost
@pytest.mark.timeout(180)
def test_state_is_replicated_over_every_device_of_every_process(cluster_results):
    for spec, devices, copies in cluster_results[0]["placement"]:
        assert spec == "P()" and len(devices) == 4
        assert copies == DEVICES_PER_PROCESS  # the copies this process can see; the other holds 2 more
    assert np.all(np.isfinite(cluster_results[0]["losses"]))


def _leaves(tree):
    import jax

    return jax.tree.leaves(tree)


def _batches(dataset, feed_local: bool = False):
    """The run's global batches; with ``feed_local`` this process's rows of each, as a sharded input pipeline
    would give them."""
    import jax

    batches = pk.data.batches(dataset, BATCH, steps=STEPS)
    if not feed_local:
        return batches
    rows = BATCH // jax.process_count()
    lo = jax.process_index() * rows
    return ({k: v[lo : lo + rows] for k, v in b.items()} for b in batches)


def _assert_trained_as_single_device(results: list[dict], feed: str) -> None:
    """Every process's parameters equal its SingleDevice run's, every one moved, and both processes agree."""
    for r in results:
        tree_allclose(r[feed], r["single"])
        moved = [not np.allclose(a, b) for a, b in zip(_leaves(r[feed]), _leaves(r["init"]), strict=True)]
        assert all(moved), "a parameter did not change during training"
    tree_allclose(results[0][feed], results[1][feed], rtol=0, atol=0)  # both processes hold the same replica


ACCUMULATE = 4  # BATCH = 32 splits into 4 microbatches on each of the 4 devices


def train_accumulated_in_cluster() -> dict:
    """Runs in every process: MultiWorkerMirrored with ``accumulate=ACCUMULATE`` (both feeds), and
    SingleDevice with one pass over each whole batch, from the same parameters on the same batches."""
    import jax
    import optax

    dataset = pk.data.digits()
    apply, params = pk.models.build("mlp", dataset.input_shape, dataset.num_classes)
    loss_fn = pk.models.classifier_loss(apply)

    def run(strat, accumulate=1, feed_local=False):
        tx = optax.sgd(0.1, momentum=0.9)
        return pk.fit(strat, loss_fn, params, tx, _batches(dataset, feed_local), accumulate=accumulate).params

    def trace(strat, precision):
        """The parameters after each SGD step under ``precision``, the initial ones first, and the last state's
        parameters and optimizer state (host copies)."""
        state, step = strat.init(params, optax.sgd(0.1)), strat.step(loss_fn, precision=precision)
        out = [strat.unreplicate(state.params)]
        for batch in pk.data.batches(dataset, BATCH, steps=STEPS):
            state, _ = step(state, batch)
            out.append(strat.unreplicate(state.params))
        return out, jax.device_get(strat.unreplicate((state.params, state.opt_state)))

    return {
        "global": run(pk.MultiWorkerMirrored(), ACCUMULATE),
        "local": run(pk.MultiWorkerMirrored(batch="local"), ACCUMULATE, feed_local=True),
        "single": run(pk.SingleDevice(jax.local_devices()[0])),
        "init": jax.device_get(params),
        "bf16": trace(pk.MultiWorkerMirrored(), pk.Precision.bf16()),
        "single_bf16": trace(pk.SingleDevice(jax.local_devices()[0]), pk.Precision.bf16()),
    }


@pytest.fixture(scope="module")
def accumulated_results():
    return pk.distributed.run_local(
        train_accumulated_in_cluster, PROCESSES, DEVICES_PER_PROCESS, timeout=120, stream=False
    )  # fmt: skip


@pytest.mark.multihost
@pytest.mark.slow
@pytest.mark.timeout(180)
@pytest.mark.parametrize("feed", ["global", "local"])
def test_multiworker_accumulation_equals_one_step_on_the_whole_batch(accumulated_results, feed):
    _assert_trained_as_single_device(accumulated_results, feed)


@pytest.mark.multihost
@pytest.mark.slow
@pytest.mark.timeout(180)
def test_multiworker_bf16_equals_single_device_under_the_same_policy(accumulated_results):
    """bfloat16 passes on 2 processes x 2 devices: SingleDevice's bf16 parameters within the bound bfloat16 allows
    (``assert_within_bf16``: each array within ``(2 L + 1) 2^-8`` of the path the reference travelled), and the
    parameters and SGD's state stay float32."""
    for r in accumulated_results:
        trace, (final_params, opt_state) = r["bf16"]
        assert_within_bf16(trace, r["single_bf16"][0], dense_layers(r["init"]))
        floating = [x for x in _leaves((final_params, opt_state)) if np.issubdtype(np.asarray(x).dtype, np.floating)]
        assert floating and all(np.asarray(x).dtype == np.float32 for x in floating)
