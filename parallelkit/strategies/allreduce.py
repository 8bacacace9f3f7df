"""All-reduce by hand: the algorithms behind ``lax.psum``, written with ``lax.ppermute``.

An all-reduce leaves on every device the sum of every device's array. Libraries
pick among several algorithms for it (TensorFlow's ``cross_device_ops``, named below;
its ``NcclAllReduce`` is the library's own, as ``lax.psum`` is here); here
each is a few lines of JAX, called inside ``jax.shard_map`` over named mesh axes,
returning what ``lax.psum`` returns (up to the order of the additions):

- :func:`reduce_to_one_allreduce` (``ReductionToOneDevice``): every device sends its
  array to device 0, which adds them and sends the sum back, one device at a time;
- :func:`ring_allreduce` (``NcclAllReduce(all_reduce_alg='ring')``, ``CollectiveCommunication.RING``):
  a reduce-scatter then an all-gather around a ring, each device sending ``1/n`` of the array per round (NCCL's ring);
- :func:`tree_allreduce` (no TensorFlow counterpart): recursive halving, then recursive doubling,
  between partners ``2^k`` apart (MPI's Rabenseifner algorithm: a butterfly, the tree's cousin);
- :func:`hierarchical_allreduce` (``HierarchicalCopyAllReduce``): a ring inside each group (a
  machine), a ring across groups on one ``1/g`` slice each, and a ring inside the group again.

Each has a cost in the alpha-beta model (:class:`Cost`: a latency ``alpha`` per
message in sequence, ``1/beta`` per byte in sequence), summed from the cost model's
rounds of the same exchanges (:func:`~parallelkit.measure.costmodel.allreduce_rounds`),
and the bytes each device sends, which the tests read back from the compiled program's
``collective-permute`` instructions (:func:`sent_bytes`).

>>> import jax, numpy as np
>>> from jax.sharding import NamedSharding, PartitionSpec as P
>>> mesh = jax.make_mesh((2,), ("x",), devices=jax.devices()[:2])
>>> f = jax.shard_map(lambda v: ring_allreduce(v, "x"), mesh=mesh, in_specs=P("x"), out_specs=P("x"))
>>> x = jax.device_put(np.arange(8.0, dtype=np.float32), NamedSharding(mesh, P("x")))
>>> np.asarray(f(x))  # device 0 holds [0 1 2 3], device 1 [4 5 6 7]
array([ 4.,  6.,  8., 10.,  4.,  6.,  8., 10.], dtype=float32)
>>> cost = ring_cost(8, 1_000_000)  # 2(n-1) messages; 2(n-1)/n x 1 MB sent by every device
>>> cost.rounds, cost.wire_bytes, set(cost.sent)
(14, 1750000.0, {1750000.0})
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import jax
import jax.numpy as jnp
from jax import lax

from ..measure.costmodel.links import ALGORITHMS as ALGORITHMS
from ..measure.costmodel.links import Round, allreduce_rounds
from ..measure.costmodel.links import ring_pairs as ring_pairs
from ..measure.inspect import Collective

_Axis = str | tuple[str, ...]


@dataclass(frozen=True)
class Cost:
    """What one all-reduce costs on one kind of link, in the alpha-beta model.

    Time on a link of latency ``alpha`` (s) and bandwidth ``beta`` (bytes/s) is
    ``rounds x alpha + wire_bytes / beta``: messages that must follow one another
    each pay the latency, and bytes that must follow one another on the busiest
    device's link each pay the bandwidth (links are full duplex: sending and
    receiving at once do not slow each other).
    """

    rounds: int  # messages in sequence
    wire_bytes: float  # bytes in sequence through the busiest device's link
    sent: tuple[float, ...]  # bytes each device sends, by mesh position

    def seconds(self, alpha: float, bandwidth: float) -> float:
        """``rounds x alpha + wire_bytes / bandwidth`` (alpha in s, bandwidth in bytes/s)."""
        return self.rounds * alpha + self.wire_bytes / bandwidth


def _rounds_cost(rounds: list[Round], n: int) -> Cost:
    """The :class:`Cost` of an all-reduce given as the cost model's rounds over ``n`` devices.

    Each round is one latency; its bytes in sequence are the busiest device's, sent or
    received (links are full duplex); ``sent`` adds up each device's messages.

    >>> _rounds_cost(allreduce_rounds("reduce_to_one", 3, 8.0), 3)
    Cost(rounds=4, wire_bytes=32.0, sent=(16.0, 8.0, 8.0))
    """
    sent, wire = [0.0] * n, 0.0
    for messages in rounds:
        out, into = [0.0] * n, [0.0] * n
        for source, target, nbytes in messages:
            out[source] += nbytes
            into[target] += nbytes
        wire += max(max(out), max(into))
        sent = [total + more for total, more in zip(sent, out, strict=True)]
    return Cost(len(rounds), wire, tuple(sent))


def ring_cost(n: int, nbytes: float) -> Cost:
    """Ring: ``2(n-1)`` rounds, in each of which every device sends ``nbytes/n`` to its neighbour.

    >>> ring_cost(4, 400).seconds(alpha=1e-6, bandwidth=1e9)  # 6 x 1 us + 600 B / 1 GB/s
    6.6e-06
    """
    return _rounds_cost(allreduce_rounds("ring", n, nbytes), n)


def tree_cost(n: int, nbytes: float) -> Cost:
    """Halving then doubling: ``2 log2(n)`` rounds, sending ``nbytes/2, nbytes/4, ...`` then back up.

    The bytes equal the ring's, ``2(n-1)/n x nbytes``; the latencies drop from ``2(n-1)`` to ``2 log2 n``.
    """
    _check_power_of_two(n)
    return _rounds_cost(allreduce_rounds("tree", n, nbytes), n)


def reduce_to_one_cost(n: int, nbytes: float) -> Cost:
    """To device 0 and back: ``2(n-1)`` messages of ``nbytes``, all through device 0's link.

    Device 0 sends the sum to the ``n-1`` others; each other device sends its array once.
    """
    return _rounds_cost(allreduce_rounds("reduce_to_one", n, nbytes), n)


def hierarchical_cost(inner: int, outer: int, nbytes: float) -> dict[str, Cost]:
    """A ring inside each group of ``inner`` devices, and one across the ``outer`` groups on ``nbytes/inner``.

    Inside (fast links): a reduce-scatter and an all-gather, ``2(g-1)`` rounds and
    ``2(g-1)/g x nbytes``, as a ring of ``g``. Across (slow links): a ring all-reduce of
    one slice of ``nbytes/g`` over the ``m`` groups, ``2(m-1)`` rounds and
    ``2(m-1)/m x nbytes/g`` per device. The rounds are the cost model's
    (:func:`~parallelkit.measure.costmodel.allreduce_rounds`), each counted on the links it uses.

    In a flat ring over all ``n = g x m`` devices only each group's last device sends to
    another group, all of its ``2(n-1)/n x nbytes``. What the hierarchy saves on the slow
    links depends on who shares them: with a link per device, the busiest carries
    ``(n-1)/(m-1)`` times fewer bytes (``g`` or more); when a group's ``g`` devices share
    one link (as :mod:`parallelkit.measure.costmodel` assumes), it carries ``2(m-1)/m x nbytes``
    against ``2(n-1)/n x nbytes``: ``(n-1)/(g(m-1))`` times fewer, under 2.

    >>> {link: cost.wire_bytes for link, cost in hierarchical_cost(4, 2, 800).items()}
    {'inner': 1200.0, 'outer': 200.0}
    """
    n = inner * outer
    rounds = allreduce_rounds("hierarchical", n, nbytes, group=inner)
    by_link: dict[str, list[Round]] = {"inner": [], "outer": []}
    for r in rounds:  # a round that crosses a group boundary runs on the slow links
        by_link["outer" if any(s // inner != t // inner for s, t, _ in r) else "inner"].append(r)
    return {link: _rounds_cost(found, n) for link, found in by_link.items()}


def _check_power_of_two(n: int) -> None:
    if n < 1 or n & (n - 1):
        raise ValueError(
            f"tree_allreduce pairs devices 1, 2, 4, ... apart, so it needs a power-of-two device count; "
            f"got {n}. Use ring_allreduce for {n} devices."
        )


def _flat(x: jax.Array, multiple: int) -> tuple[jax.Array, Callable[[jax.Array], jax.Array]]:
    """``x`` as one vector padded with zeros to a multiple of ``multiple``, and the way back."""
    flat = x.reshape(-1)
    pad = -flat.size % multiple
    padded = jnp.pad(flat, (0, pad)) if pad else flat
    return padded, lambda y: y[: flat.size].reshape(x.shape)


def _position(axis: _Axis, rings: Sequence[Sequence[int]]) -> jax.Array:
    """This device's place in its own ring (rings are lists of linear mesh positions)."""
    table = [0] * sum(len(r) for r in rings)
    for ring in rings:
        for k, device in enumerate(ring):
            table[device] = k
    return jnp.asarray(table)[lax.axis_index(axis)]


def _reduce_scatter(chunks: jax.Array, axis: _Axis, rings: Sequence[Sequence[int]]) -> tuple[jax.Array, jax.Array]:
    """Ring reduce-scatter of ``chunks`` (g rows): the device at place ``p`` ends with row ``(p+1) % g`` summed.

    Round ``s``: send row ``p - s`` to the next device, add the row that arrives into row ``p - s - 1``.
    """
    g = len(rings[0])
    p = _position(axis, rings)
    to_next = ring_pairs(rings)
    for s in range(g - 1):
        arrived = lax.ppermute(chunks[(p - s) % g], axis, to_next)
        chunks = chunks.at[(p - s - 1) % g].add(arrived)
    return chunks[(p + 1) % g], p


def _all_gather(row: jax.Array, p: jax.Array, axis: _Axis, rings: Sequence[Sequence[int]]) -> jax.Array:
    """Ring all-gather: the device at place ``p`` holds row ``(p+1) % g``; every device ends with all ``g`` rows."""
    g = len(rings[0])
    to_next = ring_pairs(rings)
    rows = jnp.zeros((g, *row.shape), row.dtype).at[(p + 1) % g].set(row)
    for s in range(g - 1):
        rows = rows.at[(p - s) % g].set(lax.ppermute(rows[(p + 1 - s) % g], axis, to_next))
    return rows


def _ring(x: jax.Array, axis: _Axis, rings: Sequence[Sequence[int]]) -> jax.Array:
    g = len(rings[0])
    flat, back = _flat(x, g)
    row, p = _reduce_scatter(flat.reshape(g, -1), axis, rings)
    return back(_all_gather(row, p, axis, rings).reshape(-1))


def ring_allreduce(x: jax.Array, axis: _Axis) -> jax.Array:
    """``lax.psum(x, axis)`` as a ring: a reduce-scatter, then an all-gather (cost: :func:`ring_cost`).

    The array is cut into ``n`` chunks (padded with zeros to a multiple of ``n``
    elements). In each of ``n-1`` rounds every device passes one running chunk sum to
    its right-hand neighbour, which adds its own; after them every device holds one
    complete chunk, and ``n-1`` more rounds pass the complete chunks around.
    """
    n = lax.axis_size(axis)
    return _ring(x, axis, [list(range(n))])


def tree_allreduce(x: jax.Array, axis: _Axis) -> jax.Array:
    """``lax.psum(x, axis)`` by recursive halving and doubling (cost: :func:`tree_cost`).

    Halving: partners ``n/2`` apart swap halves, each keeping (and summing) the half
    the other sends; then partners ``n/4`` apart swap halves of that half, and so on,
    until each device holds ``1/n`` of the sum. Doubling runs the same exchanges
    backwards, each round doubling what every device holds. Needs ``n`` a power of two.
    """
    n = lax.axis_size(axis)
    _check_power_of_two(n)
    me = lax.axis_index(axis)
    part, back = _flat(x, n)
    distances = [n >> k for k in range(1, int(math.log2(n)) + 1)]  # n/2, n/4, ..., 1
    for d in distances:  # halving: keep the half of my bit, send the other
        low, high = jnp.split(part, 2)
        upper = (me & d) != 0
        arrived = lax.ppermute(jnp.where(upper, low, high), axis, [(i, i ^ d) for i in range(n)])
        part = jnp.where(upper, high, low) + arrived
    for d in reversed(distances):  # doubling: put my part and my partner's side by side
        arrived = lax.ppermute(part, axis, [(i, i ^ d) for i in range(n)])
        part = jnp.where((me & d) != 0, jnp.concatenate([arrived, part]), jnp.concatenate([part, arrived]))
    return back(part)


def reduce_to_one_allreduce(x: jax.Array, axis: _Axis) -> jax.Array:
    """``lax.psum(x, axis)`` through device 0 (cost: :func:`reduce_to_one_cost`).

    Devices ``1 .. n-1`` send their arrays to device 0 one at a time; device 0 adds
    them, then sends the sum to each of them in turn. Device 0's link carries
    everything: simple, and the slowest as ``n`` grows.
    """
    n = lax.axis_size(axis)
    me = lax.axis_index(axis)
    total = x
    for j in range(1, n):  # a device that receives nothing gets zeros
        total = total + lax.ppermute(x, axis, [(j, 0)])
    received = jnp.zeros_like(x)
    for j in range(1, n):
        received = received + lax.ppermute(total, axis, [(0, j)])
    return jnp.where(me == 0, total, received)


def _hierarchical(x: jax.Array, axis: _Axis, inner: int, outer: int) -> jax.Array:
    """Groups are blocks of ``inner`` consecutive positions along ``axis`` (``outer`` blocks)."""
    groups = [[o * inner + i for i in range(inner)] for o in range(outer)]
    across = [[o * inner + i for o in range(outer)] for i in range(inner)]
    flat, back = _flat(x, inner * outer)
    row, p = _reduce_scatter(flat.reshape(inner, -1), axis, groups)  # inside each group
    row = _ring(row, axis, across) if outer > 1 else row  # across groups, one slice each
    return back(_all_gather(row, p, axis, groups).reshape(-1))  # inside each group again


def hierarchical_allreduce(x: jax.Array, inner_axis: str, outer_axis: str) -> jax.Array:
    """``lax.psum(x, (outer_axis, inner_axis))`` in three rings (cost: :func:`hierarchical_cost`).

    1. inside each group along ``inner_axis`` (one machine: fast links), a ring
       reduce-scatter leaves each device ``1/g`` of its group's sum;
    2. across groups along ``outer_axis`` (the network), a ring all-reduce of that slice:
       each device sends ``2(m-1)/m`` of ``1/g`` of the array;
    3. inside each group again, a ring all-gather.
    """
    inner, outer = lax.axis_size(inner_axis), lax.axis_size(outer_axis)
    return _hierarchical(x, (outer_axis, inner_axis), inner, outer)


@dataclass(frozen=True)
class AllReduce:
    """Which all-reduce a strategy uses for its gradients (TensorFlow's ``cross_device_ops``).

    ``AllReduce("ring")`` and the other names in :data:`ALGORITHMS`; ``"psum"`` is
    ``lax.psum``, the compiler's own. ``"hierarchical"`` needs ``group``: how many
    consecutive devices along the axis share fast links (a machine's GPUs).

    >>> AllReduce("hierarchical", group=4).cost(8, 800)["outer"].wire_bytes  # 2(m-1)/m x 800/4, m = 2
    200.0
    """

    algorithm: str = "psum"
    group: int | None = None

    def __post_init__(self) -> None:
        if self.algorithm not in ALGORITHMS:
            raise ValueError(f"AllReduce({self.algorithm!r}): choose one of {ALGORITHMS}.")
        if (self.algorithm == "hierarchical") != (self.group is not None):
            raise ValueError(
                'AllReduce("hierarchical", group=g) needs g, the devices per group (machine), and only '
                f"the hierarchical algorithm takes one; got {self!r}."
            )
        if self.group is not None and not (isinstance(self.group, int) and self.group >= 1):
            raise ValueError(f"AllReduce(group={self.group!r}): a group is a whole number of devices >= 1.")

    def __call__(self, x: jax.Array, axis: _Axis) -> jax.Array:
        """The sum of ``x`` over ``axis``, by this algorithm (inside ``shard_map`` or ``pmap``)."""
        if self.algorithm == "psum":
            return lax.psum(x, axis)
        if self.algorithm == "hierarchical":
            n = lax.axis_size(axis)
            if n % self.group:
                raise ValueError(f"AllReduce(hierarchical, group={self.group}) needs a multiple of it; got {n}.")
            return _hierarchical(x, axis, self.group, n // self.group)
        flat = {"ring": ring_allreduce, "tree": tree_allreduce, "reduce_to_one": reduce_to_one_allreduce}
        return flat[self.algorithm](x, axis)

    def cost(self, n: int, nbytes: float) -> dict[str, Cost]:
        """The alpha-beta cost over ``n`` devices, per kind of link (``"inner"``, ``"outer"``).

        Flat algorithms send everything over one kind of link, reported as ``"inner"``
        when ``n`` devices share a machine. ``"psum"`` is costed as a ring (what NCCL
        and XLA pick for large arrays).
        """
        if self.algorithm == "hierarchical":
            return hierarchical_cost(self.group, n // self.group, nbytes)
        formula = {"psum": ring_cost, "ring": ring_cost, "tree": tree_cost, "reduce_to_one": reduce_to_one_cost}
        return {"inner": formula[self.algorithm](n, nbytes)}


def bucket_plan(nbytes: Sequence[int], bucket_bytes: int | None, order: Sequence[int]) -> list[list[int]]:
    """Which leaves travel together: lists of indices into ``nbytes`` (each leaf's bytes, in tree order).

    As in PyTorch's DDP, the leaves are taken in ``order``, the order the backward pass
    produces their gradients (:func:`~parallelkit.core.backward.gradient_order`: the last
    layer's first), and a bucket closes when the next leaf would take it past ``bucket_bytes``;
    a leaf larger than that travels alone. ``None``: one bucket, every leaf.

    >>> bucket_plan([400, 400, 400, 1000], 800, order=[3, 2, 1, 0])
    [[3], [2, 1], [0]]
    >>> bucket_plan([400, 400, 400, 1000], 800, order=[1, 0, 3, 2])
    [[1, 0], [3], [2]]
    >>> bucket_plan([400, 400], None, order=[1, 0])
    [[1, 0]]

    Raises:
      ValueError: an ``order`` that does not name each leaf once.
    """
    given = None if order is None else list(order)
    if given is None or sorted(given) != list(range(len(nbytes))):
        raise ValueError(
            f"bucket_plan(order={given!r}) must name each of the {len(nbytes)} leaves once: pass a permutation "
            "of their indices (parallelkit.core.backward.gradient_order gives the backward pass's)."
        )
    buckets: list[list[int]] = []
    filled = 0
    for i in given:
        if not buckets or (bucket_bytes is not None and filled + nbytes[i] > bucket_bytes):
            buckets.append([])
            filled = 0
        buckets[-1].append(i)
        filled += nbytes[i]
    return buckets


def mean_tree(tree, axis: _Axis, allreduce: AllReduce | None = None, buckets: Sequence[Sequence[int]] | None = None):
    """The mean over ``axis`` of every leaf of ``tree``, one float32 all-reduce per bucket.

    ``buckets`` lists which leaves (indices in ``jax.tree.leaves(tree)``) travel together, in
    the order they are reduced (:func:`bucket_plan`); ``None``: all of them as one, so that
    one all-reduce carries the parameter bytes plus the metrics. Each bucket's leaves travel
    as one flat vector, as in a DDP bucket or XLA's all-reduce combiner. ``allreduce`` is the
    algorithm (None: ``lax.psum``).

    XLA merges independent all-reduces into one, whatever their size on a CPU (on a GPU up to
    ``--xla_gpu_all_reduce_combine_threshold_bytes``: XLA's own bucket size), which would undo
    the buckets. So each bucket after the first carries one value of the result of the bucket
    just before it (4 bytes more), on every backend: bucket ``k`` waits for its own leaves and
    for bucket ``k - 1``'s all-reduce, nothing else. That is the order DDP's buckets keep on
    its one communication stream anyway, so the chain costs 4 bytes and no waiting: bucket 0
    (the last layer's gradients, and the metrics of the forward pass) can start while the
    backward pass is still producing the others, and no bucket waits for a gradient of a
    bucket after it (the embeddings' come last). Chaining only on a CPU would let a GPU's
    combiner merge the small buckets; chaining every bucket on the last gradient would
    hold them all until the backward pass ends, the overlap buckets exist for.
    """
    leaves, treedef = jax.tree.flatten(tree)
    if not leaves:
        return tree
    allreduce = allreduce or AllReduce("psum")
    out: list = [None] * len(leaves)
    previous = None
    for bucket in buckets if buckets is not None else [range(len(leaves))]:
        bucket = sorted(bucket)  # within a bucket, tree order (one bucket: every leaf in tree order)
        parts = [jnp.ravel(leaves[i]).astype(jnp.float32) for i in bucket]
        # One float of the bucket just before: the combiner cannot merge the two, and this bucket waits
        # for that one and its own leaves only, never for a gradient the backward pass produces later.
        flat = jnp.concatenate(parts if previous is None else [*parts, previous[:1]])
        summed = allreduce(flat, axis) / lax.axis_size(axis)
        start = 0
        for i in bucket:
            out[i] = summed[start : start + leaves[i].size].reshape(leaves[i].shape).astype(leaves[i].dtype)
            start += leaves[i].size
        previous = summed
    return jax.tree.unflatten(treedef, out)


def sent_bytes(found: Sequence[Collective], devices: int, group: int | None = None) -> dict[str, list[int]]:
    """The bytes each device sends, read from a compiled program's ``collective-permute`` instructions.

    A permute's ``source_target_pairs`` say who sends its array to whom. Returns, per
    mesh position, the bytes it sends: under ``"all"``, and, with ``group``, split into
    ``"inner"`` (to a device in the same block of ``group`` positions) and ``"outer"``.
    """
    out = {"all": [0] * devices}
    if group:
        out |= {"inner": [0] * devices, "outer": [0] * devices}
    for c in found:
        if c.op != "collective-permute":
            continue
        for source, target in c.pairs or ():
            out["all"][source] += c.bytes
            if group:
                out["inner" if source // group == target // group else "outer"][source] += c.bytes
    return out
