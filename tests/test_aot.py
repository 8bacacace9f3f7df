"""pk.aot: a strategy's step compiled for a TPU topology on this machine, and the TPU program read back.

The parser tests need nothing; the others need the TPU compiler (libtpu, the ``parallelkit[tpu]``
extra that ``.[dev]`` installs) and skip without it.
"""

from __future__ import annotations

import os
import subprocess
import sys

import jax
import numpy as np
import optax
import pytest
from flax import nnx
from helpers import ROOT

import parallelkit as pk
from parallelkit.core.devices import NO_TPU_VM
from parallelkit.measure import aot
from parallelkit.measure.inspect import parse_collectives
from parallelkit.models.classifiers import MLP
from parallelkit.models.functional import functional

needs_libtpu = pytest.mark.skipif(not aot.available(), reason='libtpu is not installed: pip install "parallelkit[tpu]"')

# The shapes of a TPU program's HLO, as libtpu 0.0.42 prints them (lines shortened): a reduce-scatter is an
# all-reduce fused with its slice; an async all-gather is a pair of fusions around other work; a chained
# collective's pieces share a channel and a chain; tuple layouts hold tiling in parentheses.
TPU_HLO = """\
%all-reduce-scatter.3 (input_0: f32[1024,10], input_1: f32[64]) -> (f32[128,10], f32[8]) {
  %input_0 = f32[1024,10]{0,1:T(8,128)} parameter(0)
  %all-reduce.15 = (f32[1024,10]{0,1:T(8,128)}, f32[64]{0:T(128)}) all-reduce(%input_0, %input_1), channel_id=1, \
replica_groups={{0,1,2,3,4,5,6,7}}, to_apply=%add
}

%fused_computation.81 (param_0.214: f32[1,1,128]) -> f32[8,1,128] {
  %all-gather.28 = f32[8,1,128]{2,1,0:T(1,128)} all-gather(%param_0.214), channel_id=13, \
replica_groups=mesh['axis_0'=8] {'axis_0'}, dimensions={0}, frontend_attributes={chain_id="0"}
}

%async_collective_fusion.58 (param_0.219: f32[1,1,128]) -> f32[8,1,128] {
  %all-gather.30 = f32[8,1,128]{2,1,0:T(1,128)S(1)} all-gather(%param_0.219), channel_id=13, \
replica_groups=mesh['axis_0'=8] {'axis_0'}, dimensions={0}, frontend_attributes={chain_id="0"}
}

ENTRY %main.8_spmd (param: f32[1024,10]) -> f32[8] {
  %async-collective-start = (f32[1,1,128]{2,1,0:T(1,128)S(1)}, u32[]{:S(2)}) fusion(%p), kind=kCustom, \
calls=%fused_computation.81
  %get-tuple-element.99 = f32[1,1,128]{2,1,0:T(1,128)S(1)} get-tuple-element(%async-collective-start), index=0
  %fusion.58 = f32[8,1,128]{2,1,0} fusion(%get-tuple-element.99), kind=kCustom, calls=%async_collective_fusion.58
  %fusion.43 = (f32[128,10]{0,1:T(8,128)S(1)}, f32[8]{0}) fusion(%a, %b), kind=kCustom, calls=%all-reduce-scatter.3
  %async-collective-done = f32[8,1,128]{2,1,0:T(1,128)S(1)} fusion(%get-tuple-element.99), kind=kCustom
  %all-gather.38 = f32[1024,10]{0,1:T(8,128)S(1)} all-gather(%x), channel_id=12, \
replica_groups=mesh['axis_0'=8,'axis_1'=1] {'axis_0'}, frontend_attributes={async_collective_name="all-gather-start"}
  ROOT %all-reduce.14 = (f32[10]{0:T(128)S(1)}, f32[]{:T(128)}) all-reduce(%f, %g), channel_id=1, \
replica_groups=mesh['axis_0'=8,'axis_1'=1] {'axis_0'}
}
"""


def test_a_tpu_programs_collectives_are_read_as_the_tpu_runs_them():
    found = parse_collectives(TPU_HLO)
    assert [(c.op, c.bytes, c.group_size) for c in found] == [
        ("reduce-scatter", (128 * 10 + 8) * 4, 8),  # the shards the fused slice leaves, not the whole gradient
        ("all-gather", 8 * 128 * 4, 8),  # one chain of pieces: listed once
        ("all-gather", 1024 * 10 * 4, 8),  # a tuple-free array with tiling in its layout
        ("all-reduce", (10 + 1) * 4, 8),  # a tuple whose layouts hold parentheses
    ]
    reduce_scatter, chained, synchronous, _ = found
    assert chained.asynchronous and chained.overlaps == ("fusion.58", "fusion.43")  # its chain, and the reduce-scatter
    assert not reduce_scatter.asynchronous and not synchronous.asynchronous  # made synchronous: nothing to overlap


def test_an_async_pair_overlaps_the_work_scheduled_between_its_halves():
    hlo = "\n".join(
        [
            "%s = f32[8]{0} all-gather-start(%x), replica_groups={{0,1}}",
            "%g = f32[4]{0} get-tuple-element(%s), index=0",
            "%c = f32[4,4]{1,0} convolution(%a, %b)",
            "%d = f32[8]{0} all-gather-done(%s)",
            "%r = f32[8]{0} all-reduce(%d), replica_groups={{0,1}}",
        ]
    )
    gather, reduce = parse_collectives(hlo)
    assert (gather.asynchronous, gather.overlaps, gather.group_size) == (True, ("c",), 2)
    assert (reduce.asynchronous, reduce.overlaps) == (False, ())


@pytest.mark.parametrize("topology", ["v5e", "v7:2x2", "v5e:2x2:1", 8, None])
def test_a_name_that_is_no_topology_is_refused_with_the_shapes_to_pass(topology):
    with pytest.raises(ValueError, match=r"pk\.aot\.devices got topology=.*such as 'v5e:4x4'"):
        aot.devices(topology)


def test_without_libtpu_it_says_how_to_install_it(monkeypatch):
    monkeypatch.setattr(aot, "available", lambda: False)
    with pytest.raises(ModuleNotFoundError, match=r'pip install "parallelkit\[tpu\]"'):
        aot.devices("v5e:2x4")


@needs_libtpu
@pytest.mark.parametrize(("topology", "count", "kind"), [("v5e:2x4", 8, "TPU v5 lite"), ("v5p:2x2x1", 4, "TPU v5")])
def test_a_topologys_devices_are_listed(topology, count, kind):
    found = pk.aot.devices(topology)
    assert len(found) == count
    assert {(d.platform, d.device_kind) for d in found} == {("tpu", kind)}


@needs_libtpu
def test_a_shape_its_hosts_do_not_divide_is_refused_with_libtpus_reason():
    with pytest.raises(ValueError, match=r"libtpu does not describe topology='v5e:3x3' \(.*divisible"):
        aot.devices("v5e:3x3")


@needs_libtpu
def test_a_strategy_on_cpu_devices_is_refused(mlp, batch):
    loss_fn, params = mlp
    with pytest.raises(TypeError, match=r"built on \['cpu'\] devices, not a TPU topology's"):
        pk.aot.compile(pk.Mirrored(backend="jit"), loss_fn, params, optax.sgd(0.1), batch)


@needs_libtpu
@pytest.mark.parametrize(
    "make", [lambda d: pk.Mirrored(backend="pmap", devices=d), lambda d: pk.CentralStorage(devices=d)]
)
def test_a_strategy_without_shardings_is_refused(make, mlp, batch):
    loss_fn, params = mlp
    strategy = make(pk.aot.devices("v5e:2x2"))
    with pytest.raises(TypeError, match=r"does not lay its state out with shardings: pass an SPMD strategy"):
        pk.aot.compile(strategy, loss_fn, params, optax.sgd(0.1), batch)


def _mlp_shapes():
    """A 784-1024-1024-10 MLP as shapes (nothing allocated), its loss, and a batch of 256 as shapes."""
    apply, params = functional(nnx.eval_shape(lambda: MLP(784, (1024, 1024), 10, rngs=nnx.Rngs(0))))
    batch = {"x": jax.ShapeDtypeStruct((256, 28, 28, 1), np.float32), "y": jax.ShapeDtypeStruct((256,), np.int32)}
    return pk.models.classifier_loss(apply), params, batch


@pytest.fixture(scope="module")
def compiled():
    """The MLP's step compiled for v5e:2x4 under each strategy, and the CPU devices before and after."""
    before = jax.devices()
    target = pk.aot.devices("v5e:2x4")
    loss_fn, params, batch = _mlp_shapes()
    strategies = {
        "mirrored": pk.Mirrored(backend="jit", devices=target),
        "zero1": pk.FullySharded(1, devices=target),
        "zero2": pk.FullySharded(2, devices=target),
        "zero3": pk.FullySharded(3, devices=target),
        "hybrid": pk.Hybrid(data=4, model=2, devices=target),
    }
    reports = {name: pk.aot.compile(s, loss_fn, params, optax.adam(1e-3), batch) for name, s in strategies.items()}
    return reports, before, jax.devices()


@needs_libtpu
@pytest.mark.slow
def test_zero2_reduce_scatters_on_tpu_where_zero1_all_reduces(compiled):
    reports, _, _ = compiled
    ops = {name: {c.op for c in report.collectives} for name, report in reports.items()}
    assert ops["mirrored"] == {"all-reduce"}
    assert "reduce-scatter" in ops["zero2"] and "reduce-scatter" in ops["zero3"]
    assert "reduce-scatter" not in ops["zero1"]  # ZeRO-1 keeps whole gradients: an all-reduce
    assert "all-reduce" in ops["hybrid"]


@needs_libtpu
@pytest.mark.slow
def test_zero_all_gathers_start_early_and_overlap_work(compiled):
    reports, _, _ = compiled
    for name in ("zero2", "zero3"):
        overlapping = [c for c in reports[name].collectives if c.op == "all-gather" and c.asynchronous]
        assert overlapping and all(c.overlaps for c in overlapping), name


@needs_libtpu
@pytest.mark.slow
def test_memory_per_device_falls_stage_by_stage(compiled):
    reports, _, _ = compiled
    memory = {name: report.memory for name, report in reports.items()}
    assert all(min(m.arguments, m.outputs, m.peak) > 0 and m.temporaries >= 0 for m in memory.values())
    # DeviceMemory's docstring: the peak is the compiler's own figure, above the sum of the others here.
    assert all(m.peak > m.arguments + m.outputs - m.aliased + m.temporaries for m in memory.values())
    # ZeRO-1 and 2 hold the same state (whole parameters, sharded optimizer state); 3 shards the parameters too.
    assert memory["zero3"].arguments < memory["zero2"].arguments == memory["zero1"].arguments
    assert memory["zero1"].arguments < memory["mirrored"].arguments
    # ZeRO-2's gradients are shards: its peak is below ZeRO-1's, which holds them whole.
    assert memory["zero3"].peak < memory["zero2"].peak < memory["zero1"].peak < memory["mirrored"].peak


@needs_libtpu
@pytest.mark.slow
def test_the_report_holds_flops_and_the_program(compiled):
    reports, _, _ = compiled
    for report in reports.values():
        assert report.flops > 2 * 256 * 784 * 1024 / 8  # at least one device's share of the first layer's product
        assert report.hlo.startswith("HloModule") and report.target == "8 TPU v5 lite"
    assert "reduce-scatter" in reports["zero2"].summary()


@needs_libtpu
@pytest.mark.slow
def test_compiling_for_tpu_leaves_the_simulated_cpu_devices_alone(compiled):
    _, before, after = compiled
    assert after == before and jax.default_backend() == "cpu"
    assert float(jax.numpy.ones(3).sum()) == 3.0  # the CPU still computes


@needs_libtpu
def test_arrays_and_shapes_compile_to_the_same_program(mlp, batch):
    loss_fn, params = mlp
    strategy = pk.FullySharded(3, devices=pk.aot.devices("v5e:2x4"))
    from_arrays = pk.aot.compile(strategy, loss_fn, params, optax.adam(1e-3), batch)
    shapes = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), (params, batch))
    from_shapes = pk.aot.compile(strategy, loss_fn, *shapes[:1], optax.adam(1e-3), shapes[1])
    assert from_arrays.memory == from_shapes.memory and from_arrays.collectives == from_shapes.collectives


def _fresh(code: str) -> subprocess.CompletedProcess:
    """``code`` in a fresh process that has not been told there is no TPU VM here."""
    env = {k: v for k, v in os.environ.items() if k not in NO_TPU_VM and k != "XLA_FLAGS"}
    return subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT, env=env, check=False
    )


@needs_libtpu
@pytest.mark.slow
def test_a_notebook_that_simulates_devices_compiles_for_tpu_and_prints_nothing():
    code = (
        "import os, parallelkit as pk, jax\n"
        "pk.simulate_devices(8)\n"
        "target = pk.aot.devices('v5e:2x4')\n"
        "print(len(jax.devices()), jax.default_backend(), len(target))\n"
    )
    done = _fresh(code)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["8", "cpu", "8"]
    assert done.stderr == ""  # libtpu's INVALID_ARGUMENT lines, without the variables simulate_devices sets


@needs_libtpu
@pytest.mark.slow
def test_a_process_whose_jax_already_started_asks_libtpu_quietly_and_keeps_its_environment():
    code = (
        "import os, jax\n"
        "jax.config.update('jax_platforms', 'cpu')\n"
        "jax.devices()\n"
        "import parallelkit as pk\n"
        "pk.aot.devices('v5e:2x4')\n"
        "print(jax.default_backend(), 'TPU_ACCELERATOR_TYPE' in os.environ)\n"
    )
    done = _fresh(code)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["cpu", "False"]
    assert done.stderr == ""


@needs_libtpu
def test_the_no_tpu_vm_variables_do_not_outlive_the_start_of_libtpu(monkeypatch):
    # Left in the environment they say "Cloud TPU worker" to the cluster detection of this process and its children.
    from parallelkit.run.distributed import runtime

    monkeypatch.setattr(runtime, "_joined", None)  # this process's join, restored after the test
    pk.aot.devices("v5e:2x2")
    assert not set(NO_TPU_VM) & set(os.environ)
    assert runtime.initialize().is_single_process


def _product_types(hlo: str) -> set[str]:
    """The element types of a TPU program's matrix products (``convolution`` in TPU HLO)."""
    return {line.split("=")[1].split("[")[0].strip() for line in hlo.splitlines() if " convolution(" in line}


@needs_libtpu
@pytest.mark.slow
def test_bf16_compute_multiplies_in_bf16_with_the_same_state_and_a_lower_peak():
    # Notebook 06's lesson, which the CPU cannot show: it computes a bfloat16 product in float32.
    apply, params = functional(nnx.eval_shape(lambda: MLP(64, (256, 256), 10, rngs=nnx.Rngs(0))))
    batch = {"x": jax.ShapeDtypeStruct((8192, 64), np.float32), "y": jax.ShapeDtypeStruct((8192,), np.int32)}
    target = pk.aot.devices("v5e:2x4")
    reports = {
        name: pk.aot.compile(pk.Mirrored(target), pk.models.classifier_loss(apply), params, optax.adam(1e-3), batch,
                             precision=precision)
        for name, precision in (("f32", None), ("bf16", pk.Precision.bf16()))
    }  # fmt: skip
    assert _product_types(reports["f32"].hlo) == {"f32"} and "bf16" in _product_types(reports["bf16"].hlo)
    assert reports["bf16"].memory.arguments == reports["f32"].memory.arguments  # the float32 master copy and Adam
    assert reports["bf16"].memory.peak < reports["f32"].memory.peak  # the activations in bfloat16
