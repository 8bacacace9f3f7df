"""The catalog of strategies: every tool reads it, and a strategy added to it appears in all of them.

The strategy added here is defined in this file and reaches the tools only through the
protocol (:class:`~parallelkit.core.protocol.StrategyProtocol`) and
:func:`parallelkit.strategies.catalog.register`: data parallelism whose gradients are
averaged by a reduce-scatter then an all-gather (the two halves of a ring all-reduce),
written with ``jax.shard_map``.
"""

from __future__ import annotations

import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from helpers import ROOT
from jax import lax
from jax.flatten_util import ravel_pytree
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import parallelkit as pk
from parallelkit import costmodel
from parallelkit.core.protocol import StrategyProtocol
from parallelkit.course import bench, tour
from parallelkit.strategies import (  # everything a new strategy is written with: one module
    ExpectedCollective,
    Sizes,
    Step,
    Strategy,
    catalog,
    create_state,
    put_batch,
    train_step,
)

NAME = "Mirrored(scatter+gather)"
DEVICES = 8  # every simulated device: the bench's child asks for as many as the process has


class ScatterGatherMirrored(Strategy):
    """Replicated state; the gradients and metrics, flattened into one vector, reduce-scattered then all-gathered."""

    pattern = "mirrored"  # how the cost model and TopologyModel time it: a ring all-reduce is these two halves

    def __init__(self, devices: int):
        super().__init__(DEVICES)
        self.mesh = Mesh(np.array(self.devices), ("data",))

    def init(self, params, tx, opt_state=None, *, model_state=None, rng=None):
        state = create_state(params, tx, opt_state, model_state=model_state, rng=rng)
        return jax.device_put(state, NamedSharding(self.mesh, P()))

    def place_batch(self, batch):
        return put_batch(batch, NamedSharding(self.mesh, P("data")), self.num_replicas)

    def _average(self, tree):
        flat, unflatten = ravel_pytree(tree)
        n = self.num_replicas
        padded = jnp.pad(flat, (0, -flat.size % n))
        shard = lax.psum_scatter(padded, "data", tiled=True)  # each replica: the sum of its 1/n
        return unflatten(lax.all_gather(shard / n, "data", tiled=True)[: flat.size])

    def step(self, loss_fn):
        def local(state, batch):
            return train_step(loss_fn, state, batch, sync=self._average)

        spmd = jax.shard_map(local, mesh=self.mesh, in_specs=(P(), P("data")), out_specs=(P(), P()), check_vma=False)
        return Step(jax.jit(spmd, donate_argnums=0), self.place_batch, self)

    def expected_collectives(self, sizes: Sizes):
        shard = math.ceil((sizes.params + sizes.metrics) / 4 / sizes.replicas) * 4  # float32, padded to n
        return (
            ExpectedCollective("reduce-scatter", "gradients and metrics", shard, "(P + M)/n"),
            ExpectedCollective("all-gather", "averaged gradients and metrics", shard * sizes.replicas, "P + M"),
        )


@pytest.fixture
def registered():
    entry = catalog.register(
        catalog.Entry(NAME, ScatterGatherMirrored, None, "dist.reduce_scatter_tensor", ScatterGatherMirrored.pattern)
    )
    try:
        yield entry
    finally:
        catalog.unregister(NAME)
    assert NAME not in tour.STRATEGIES


def test_a_strategy_of_this_file_keeps_the_protocol(registered):
    assert isinstance(registered.make(DEVICES), StrategyProtocol)
    assert not isinstance(object(), StrategyProtocol)


def test_it_appears_in_the_tour_and_equals_single_device(registered):
    assert NAME in tour.STRATEGIES and NAME not in tour.MEANT_TO_DIFFER
    rows = tour.run_tour(steps=4, batch_size=32, devices=DEVICES, strategies=["SingleDevice", NAME])
    assert [r.strategy for r in rows] == ["SingleDevice", NAME]
    assert rows[1].devices == DEVICES and rows[1].meant_to_equal
    assert rows[1].max_param_diff <= tour.ATOL  # within atol: closer than the rtol 1e-5, atol 1e-6 rule asks
    assert NAME in tour.format_table(rows)


def test_it_appears_in_the_bench_checked_against_single_device(registered):
    args = bench._parser().parse_args(["--child", str(DEVICES), "--steps", "3", "--warmup", "0", "--strategies", NAME])
    rows = bench._child(args)
    assert [r["strategy"] for r in rows] == ["SingleDevice", NAME]
    ours = rows[1]
    assert ours["equals_single"], ours  # every parameter within rtol 1e-5, atol 1e-6 of SingleDevice's
    assert ours["bytes_per_step"] > 0 and ours["devices"] == DEVICES


def test_it_appears_in_the_traffic_table_and_the_topology_model(registered):
    apply, params = pk.models.build("mlp", (64,), 10)
    loss = pk.models.classifier_loss(apply)
    batch = next(pk.data.batches(pk.data.digits(), 8 * DEVICES, steps=1))
    traffics = []
    for entry in (catalog.get("Mirrored(jit)"), registered):
        strategy = entry.make(DEVICES)
        traffics.append(strategy.traffic(loss, strategy.init(params, optax.sgd(0.1)), batch))
    ours = traffics[1]
    assert ours.pattern == registered.pattern and ours.strategy == repr(registered.make(DEVICES))
    for what, op in (("gradients", "reduce-scatter"), ("averaged", "all-gather")):  # measured in the compiled HLO
        flow = ours.flow(what)
        assert op in flow.what and flow.measured == flow.expected > 0, flow
    assert "other collectives" in ours.flow("other").what and ours.flow("other").measured == 0
    assert ours.strategy in pk.traffic.compare_table(traffics)
    model = pk.traffic.TopologyModel(device_link_GBps=300, host_link_GBps=25)
    assert model.seconds(ours) == model.seconds(traffics[0]) > 0  # the same parameters, the same ring


def test_it_appears_in_the_cost_model_by_its_catalog_name(registered):
    work = costmodel.Workload(param_bytes=100e6, seconds_per_sample=1e-3, batch_per_device=32)
    cluster = costmodel.Cluster(machines=1, devices_per_machine=8, inside=costmodel.PRESETS["nvlink3"])
    assert costmodel.predict(work, cluster, NAME).step_s == costmodel.predict(work, cluster, "mirrored").step_s
    with pytest.raises(ValueError, match=r"Unknown strategy 'nothing'.*Mirrored\(scatter\+gather\)"):
        costmodel.predict(work, cluster, "nothing")


def test_the_catalog_refuses_a_second_entry_of_one_name_and_names_what_it_holds(registered):
    with pytest.raises(ValueError, match="already holds"):
        catalog.register(registered)
    with pytest.raises(KeyError, match="No strategy named 'nothing'.*SingleDevice"):
        catalog.get("nothing")


def test_every_entry_builds_a_strategy_whose_pattern_it_states():
    layers = pk.models.as_layers(pk.models.MLP(64, (32,), 10, rngs=nnx.Rngs(0)))
    for entry in catalog.entries():
        strategy = entry.make(DEVICES, layers.apply) if entry.layers else entry.make(DEVICES)
        assert isinstance(strategy, StrategyProtocol), entry.name
        assert strategy.pattern == entry.pattern, entry.name
        assert entry.pattern in costmodel.PATTERNS, entry.name


def test_every_entrys_rosetta_names_are_in_the_rosetta():
    rosetta = (ROOT / "docs" / "rosetta.md").read_text()
    named = [(e.name, n) for e in catalog.entries() for n in (e.tensorflow, e.pytorch) if n]
    missing = [(entry, n) for entry, n in named if not re.search(re.escape(n), rosetta)]
    assert named and not missing, f"names the Rosetta (docs/rosetta.md) does not give: {missing}"
