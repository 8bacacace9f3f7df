"""Which mesh axes each compiled collective runs over, and whether a composed step's match the book.

:mod:`parallelkit.measure.groups` reads a collective's device groups back onto the mesh. It is checked
against programs whose axes are known (a ``psum`` over each set of axes of a 2 x 2 x 2 mesh), then used to
set each composed :class:`parallelkit.Parallel` layout's compiled collectives, per axis, beside the
collectives the layout needs by the book (:meth:`Parallel.axis_collectives`, the axes whose bytes the
planner charges). The comparison uses the TPU compiler's program (``pk.aot``, a v5e 2x4 topology): XLA:CPU
has no reduce-scatter pass, so on the simulated CPUs every reduce-scatter is an all-reduce. Where the
kit's program differs from the book, the difference is listed here by name (:data:`GAPS`), so that a new
one fails and a closed one fails too, until this list says so.
"""

from __future__ import annotations

import itertools
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import parallelkit as pk
from parallelkit.measure.groups import by_axis, groups_axes, mesh_axes
from parallelkit.measure.inspect import collectives, parse_collectives, replica_groups

AXES = ("data", "seq", "model")


@pytest.fixture(scope="module")
def mesh() -> Mesh:
    return Mesh(np.array(jax.devices()[:8]).reshape(2, 2, 2), AXES)


@pytest.mark.parametrize("axes", [c for r in (1, 2, 3) for c in itertools.combinations(AXES, r)], ids="x".join)
def test_a_psum_over_axes_is_read_back_as_those_axes(mesh, axes):
    @jax.jit
    @partial(jax.shard_map, mesh=mesh, in_specs=P(AXES), out_specs=P(AXES))
    def total(x):
        return jax.lax.psum(x, axes)

    x = jax.device_put(jnp.arange(8.0 * 64).reshape(8, 64), NamedSharding(mesh, P(AXES)))
    found = collectives(total, x)
    assert [c.op for c in found] == ["all-reduce"], found
    assert mesh_axes(found[0], mesh) == axes


def test_each_spelling_of_groups_names_the_same_devices():
    spellings = [
        "replica_groups={{0,1},{2,3},{4,5},{6,7}}",
        "replica_groups=[4,2]<=[8]",
        "replica_groups=mesh['a'=4,'b'=2] {'b'}",
        "replica_groups=mesh['a'=2,'b'=4], device_ids=([4,2]T(1,0)) {'a'}",
    ]
    assert {replica_groups(s) for s in spellings} == {((0, 1), (2, 3), (4, 5), (6, 7))}
    assert replica_groups("replica_groups=[2,4]<=[4,2]T(1,0)") == ((0, 2, 4, 6), (1, 3, 5, 7))
    assert replica_groups("replica_groups={}") is None is replica_groups("to_apply=%add")


def test_a_permute_is_read_by_its_pairs_and_a_group_outside_the_mesh_is_refused(mesh):
    hlo = "%p = f32[2]{0} collective-permute(%x), source_target_pairs={{0,2},{2,0},{1,3},{3,1}}"
    assert mesh_axes(parse_collectives(hlo)[0], mesh) == ("seq",)
    with pytest.raises(ValueError, match="pass the mesh the step was compiled on"):
        groups_axes(((0, 8),), mesh)


LENGTH = 16

# Where the kit's compiled program (TPU compiler) differs from the book, by layout: the (axes, kind) the book has
# that the program does not, and what the program does instead. (At width 32 the TPU compiler all-reduces
# every gradient, ZeRO's too, and slices: the book's reduce-scatters appear from widths near 128.)
GAPS = {
    "data=2,tensor=2,sequence_parallel=True,context=2,context_method=allgather": {
        (("model",), "reduce-scatter"): "beside a context axis, the TPU compiler all-reduces the row-split "
        "layers' partial sums whole and slices each device's rows out in the next fusion (by a table of offsets "
        "per device), where without one (the data=4 layout here) it reduce-scatters them",
    },
}
SLOW = pytest.mark.slow
LAYOUTS = [
    dict(data=2, tensor=2, context=2),
    dict(data=2, zero=3, tensor=2, context=2, context_method="ulysses"),
    pytest.param(dict(data=2, tensor=2, sequence_parallel=True, context=2, context_method="allgather"), marks=SLOW),
    pytest.param(dict(data=4, zero=2, tensor=2, sequence_parallel=True), marks=SLOW),
    dict(data=2, tensor=2, expert=2),
    pytest.param(dict(data=2, zero=3, context=2, expert=2), marks=SLOW),
    dict(data=8, zero=1),
]


def _name(layout: dict) -> str:
    return ",".join(f"{key}={value}" for key, value in layout.items())


def _gpt_loss(experts: int, width: int = 32):
    config = dict(max_length=LENGTH, dim=width, heads=4, depth=2, mlp_dim=4 * width)
    if experts:
        config |= dict(experts=experts, groups=8, capacity_factor=1.0)
    apply, params = pk.models.functional(pk.models.GPT(256, **config, rngs=nnx.Rngs(0)))
    return pk.models.lm_loss(apply), params


@pytest.mark.parametrize("layout", LAYOUTS, ids=_name)
def test_each_axis_carries_the_collectives_the_book_gives_it_on_a_tpu(layout):
    pytest.importorskip("libtpu")
    loss_fn, params = _gpt_loss(8 if layout.get("expert") else 0, width=128)
    strategy = pk.Parallel(**layout, devices=pk.aot.devices("v5e:2x4"))
    batch = dict.fromkeys(("x", "y"), jax.ShapeDtypeStruct((8, LENGTH), jnp.int32))
    compiled = by_axis(pk.aot.compile(strategy, loss_fn, params, optax.adam(1e-3), batch).collectives, strategy.mesh)
    book = strategy.axis_collectives()
    missing = {(axes, op) for axes, kinds in book.items() for op in kinds if op not in compiled.get(axes, {})}
    assert missing == set(GAPS.get(_name(layout), {})), sorted(missing)


def test_the_traffic_report_sets_each_axis_collectives_beside_its_role():
    loss_fn, params = _gpt_loss(0)
    strategy = pk.Parallel(data=2, tensor=2, context=2)
    state = strategy.init(params, optax.adam(1e-3))
    batch = next(iter(pk.data.batches(pk.data.text(length=LENGTH, max_bytes=20_000), 8, steps=1)))
    report = strategy.traffic(loss_fn, state, batch)
    compiled = by_axis(collectives(strategy.step(loss_fn), state, batch), strategy.mesh)
    rows = {f.what: (f.measured, f.formula) for f in report.flows if f.link == "device<->device"}
    assert rows == {
        f"{op} over {' x '.join(axes)}": (
            row["bytes"],
            strategy.axis_collectives().get(axes, {}).get(op, "not in the model"),
        )
        for axes, kinds in compiled.items()
        for op, row in kinds.items()
    }
    assert rows["all-reduce over model"][1] == "tensor: activations"
    assert rows["collective-permute over seq"][1] == "context: keys round the ring"
    preset = pk.TensorParallel(model=2, devices=jax.devices()[:2])  # a one-axis spelling reports its own formulas
    flows = preset.traffic(loss_fn, preset.init(params, optax.adam(1e-3)), batch).flows
    assert preset.pattern == "tensor" and "not in the model" not in {f.formula for f in flows}
