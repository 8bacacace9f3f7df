"""A pipeline in one program: the circular (looping) pipeline, in ``jax.shard_map`` with ``lax.ppermute``
(:func:`circular_pipeline`)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import AxisType, Mesh
from jax.sharding import PartitionSpec as P

from ...core.types import is_count

Block = Callable[[Any, jax.Array], jax.Array]


def sequential(block: Block, stacked: Any, x: jax.Array) -> jax.Array:
    """Every repeat of ``block`` in turn, on one device: what :func:`circular_pipeline` computes."""
    return lax.scan(lambda h, params: (block(params, h), None), x, stacked)[0]


def bubble_fraction(stages: int, microbatches: int, virtual: int = 1) -> float:
    """The share of the loop's iterations a stage idles: ``(stages - 1) / (virtual x microbatches + stages - 1)``."""
    return (stages - 1) / (virtual * microbatches + stages - 1)


def circular_pipeline(
    block: Block,
    stacked: Any,
    x: jax.Array,
    *,
    mesh: Mesh,
    microbatches: int,
    axis: str = "stage",
    data_axis: str | None = None,
) -> jax.Array:
    """``block`` repeated over ``stacked``'s leading axis, as a circular pipeline over ``mesh``'s ``axis``.

    Args:
      block: ``block(params_k, h) -> h``, one repeat; ``h`` keeps its shape.
      stacked: the repeats' parameters, each leaf with a leading axis of ``stages x virtual``
        (repeat ``k`` first applied ``k``-th). ``virtual`` is that length over the axis's size.
      x: the batch, its leading axis cut into ``microbatches``.
      mesh: a mesh with ``axis`` (its size is the number of stages), its axes Auto
        (``jax.sharding.Mesh``, ``pk.mesh.make_mesh``).
      microbatches: how many microbatches; at least the number of stages (so that a microbatch
        back at stage 0 waits for its next chunk instead of colliding with a new one).
      axis: the mesh axis the stages lie along.
      data_axis: a second mesh axis that splits every microbatch's rows (data parallelism beside
        the pipeline); the parameters' gradients are then summed over it by JAX's autodiff.

    Returns:
      The last repeat's output for the whole batch, on every device.

    Raises:
      ValueError: an ``axis`` or ``data_axis`` the mesh lacks, a mesh whose axes are not Auto,
        a parameter without a leading axis of repeats or one that is not a multiple of the
        stages, a ``microbatches`` that is not a whole number of at least the stages, a batch
        whose rows do not split into the microbatches (and those over ``data_axis``), or a
        ``block`` whose output differs from its input in shape or dtype.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> mesh = jax.sharding.Mesh(jax.devices()[:2], ("stage",))
      >>> block = lambda w, x: jnp.tanh(x @ w)
      >>> stacked = jnp.stack([jnp.eye(3) * (k + 1) for k in range(4)])  # 4 repeats: 2 stages x 2 chunks
      >>> x = jnp.ones((4, 3))
      >>> y = circular_pipeline(block, stacked, x, mesh=mesh, microbatches=2)
      >>> bool(jnp.allclose(y, sequential(block, stacked, x), atol=1e-6))
      True
      >>> round(bubble_fraction(stages=2, microbatches=2, virtual=2), 3)  # 1 / (2 x 2 + 1)
      0.2
    """
    _check_mesh(mesh, axis, data_axis)
    stages = mesh.shape[axis]
    virtual = _virtual(stacked, stages)
    _check_batch(x, microbatches, stages, 1 if data_axis is None else mesh.shape[data_axis], data_axis)
    # repeat k = chunk c x stages + stage s: shape (virtual, stages, ...), the stage axis split over the mesh
    chunked = jax.tree.map(lambda p: p.reshape(virtual, stages, *p.shape[1:]), stacked)
    micro = x.reshape(microbatches, x.shape[0] // microbatches, *x.shape[1:])
    ring = [(s, (s + 1) % stages) for s in range(stages)]

    def per_stage(params, micro):
        params = jax.tree.map(lambda p: p[:, 0], params)  # this stage's chunks: (virtual, ...)
        s = lax.axis_index(axis)
        zero = jnp.zeros_like(micro[0])

        def iteration(carry, t):
            held, waiting, outputs = carry  # from the stage before; stage 0's returned microbatches; results
            u = t - s  # the work reaching this stage now: chunk u // m of microbatch u % m
            valid = (u >= 0) & (u < virtual * microbatches)
            chunk, i = jnp.clip(u // microbatches, 0, virtual - 1), jnp.clip(u, 0) % microbatches
            start = jnp.where(chunk == 0, micro[i], waiting[i])  # stage 0: a new microbatch, or one come round
            h = block(jax.tree.map(lambda p: p[chunk], params), jnp.where(s == 0, start, held))
            _check_keeps(h, held)  # at trace time, before any program runs
            done = valid & (s == stages - 1) & (chunk == virtual - 1)
            outputs = outputs.at[i].set(jnp.where(done, h, outputs[i]))
            passed = lax.ppermute(h, axis, ring)  # every stage hands its result one stage on
            back = t - (stages - 1)  # what stage 0 receives: the last stage's work of this iteration
            more = (back >= 0) & (back < (virtual - 1) * microbatches)  # a microbatch with chunks to go
            j = jnp.clip(back, 0) % microbatches
            waiting = waiting.at[j].set(jnp.where((s == 0) & more, passed, waiting[j]))
            return (passed, waiting, outputs), None

        # The carry differs from stage to stage ("varying" over the axis), so its zeros are marked so too.
        start = jax.tree.map(
            lambda a: lax.pcast(a, axis, to="varying"), (zero, jnp.zeros_like(micro), jnp.zeros_like(micro))
        )
        (_, _, outputs), _ = lax.scan(iteration, start, jnp.arange(virtual * microbatches + stages - 1))
        return lax.psum(jnp.where(s == stages - 1, outputs, 0), axis)  # the last stage's results, everywhere

    params_spec, rows = jax.tree.map(lambda _: P(None, axis), chunked), P(None, data_axis)
    out = jax.shard_map(per_stage, mesh=mesh, in_specs=(params_spec, rows), out_specs=rows)(chunked, micro)
    return out.reshape(x.shape[0], *out.shape[2:])


def _check_mesh(mesh: Mesh, axis: str, data_axis: str | None) -> None:
    """A clear error for an ``axis`` or ``data_axis`` ``mesh`` lacks, or a mesh whose axes are not all Auto."""
    names = tuple(mesh.axis_names)
    if axis not in names:
        raise ValueError(
            f"circular_pipeline(axis={axis!r}): the mesh has no axis of that name; its axes are {names}. "
            "Pass axis= the one the stages lie along."
        )
    if data_axis is not None and (data_axis not in names or data_axis == axis):
        why = "is the stages' axis" if data_axis == axis else f"is not one of the mesh's axes {names}"
        raise ValueError(
            f"circular_pipeline(data_axis={data_axis!r}): it {why}. Pass the other mesh axis that splits "
            "each microbatch's rows, or data_axis=None."
        )
    if set(mesh.axis_types) != {AxisType.Auto}:
        kinds = {name: kind.name for name, kind in zip(names, mesh.axis_types, strict=True)}
        raise ValueError(
            f"circular_pipeline(mesh=...): the mesh's axes are {kinds}, and the pipeline's loop runs on Auto axes "
            "(jax.make_mesh gives Explicit ones by default). Build the mesh with jax.sharding.Mesh(devices, "
            "names), pk.mesh.make_mesh(...) (explicit=False, its default), or jax.make_mesh(..., "
            "axis_types=(jax.sharding.AxisType.Auto,) * len(names))."
        )


def _virtual(stacked: Any, stages: int) -> int:
    """The chunks per stage that ``stacked``'s leading axis holds; a clear error for a leaf without one that fits."""
    leaves = jax.tree_util.tree_flatten_with_path(stacked)[0]
    for path, leaf in leaves:
        if not np.ndim(leaf):
            raise ValueError(
                f"circular_pipeline: the parameter at {jax.tree_util.keystr(path) or 'the top'} is a scalar, "
                "without a leading axis of repeats. Stack each repeat's parameters on a leading axis "
                "(jax.tree.map(lambda *a: jnp.stack(a), *repeats)), so that every leaf has shape "
                "(stages x virtual, ...)."
            )
    repeats = {np.shape(leaf)[0] for _, leaf in leaves}
    if len(repeats) != 1 or next(iter(repeats)) % stages:
        raise ValueError(
            f"circular_pipeline: every parameter needs one leading axis of repeats, a multiple of the {stages} "
            f"stages; got leading axes {sorted(repeats)}."
        )
    return next(iter(repeats)) // stages


def _check_batch(x: jax.Array, microbatches: int, stages: int, replicas: int, data_axis: str | None) -> None:
    """A clear error for a ``microbatches`` that is not a count of at least ``stages``, or rows that do not split."""
    if not is_count(microbatches, least=stages):
        raise ValueError(
            f"circular_pipeline(microbatches={microbatches!r}): it needs a whole number of at least {stages} "
            "microbatches, one per stage (so that a microbatch back at stage 0 waits for its next chunk instead of "
            f"colliding with a new one). Pass, say, microbatches={stages}."
        )
    if not np.ndim(x):
        raise ValueError("circular_pipeline: x is a scalar. Pass a batch whose leading axis holds its rows.")
    rows = np.shape(x)[0]
    if rows % microbatches:
        raise ValueError(
            f"circular_pipeline: a batch of {rows} rows does not split into {microbatches} microbatches. Pass a "
            f"batch x whose leading axis is a multiple of {microbatches}, or another microbatch count."
        )
    if (rows // microbatches) % replicas:
        raise ValueError(
            f"circular_pipeline: each of the {microbatches} microbatches has {rows // microbatches} rows, which do "
            f"not split over the {replicas} devices of data_axis={data_axis!r}. Pass a batch whose rows are a "
            f"multiple of microbatches x {replicas} = {microbatches * replicas}."
        )


def _check_keeps(h: Any, before: jax.Array) -> None:
    """A clear error, while the loop is traced, for a block whose output is not shaped and typed like its input."""
    if isinstance(h, jax.Array) and (h.shape, h.dtype) == (before.shape, before.dtype):
        return
    got = f"{h.dtype}{list(h.shape)}" if isinstance(h, jax.Array) else type(h).__name__
    raise ValueError(
        f"circular_pipeline: block returned {got} for an input of {before.dtype}{list(before.shape)} (one device's "
        "rows of a microbatch). Each repeat's output is the next one's input, so a block must keep its input's "
        "shape and dtype: give it the same width in and out, and pass x in the dtype it computes in "
        "(x.astype(jnp.float32) for an integer batch)."
    )
