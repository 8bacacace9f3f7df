"""How a parameter server cuts the parameters: pieces, partitions and the policies that place them on shards."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from ...core.types import PyTree


def check_num_shards(num_shards: int) -> None:
    """A clear error unless ``num_shards`` is a whole number >= 1."""
    if isinstance(num_shards, bool) or not isinstance(num_shards, int) or num_shards < 1:
        raise ValueError(f"num_shards={num_shards!r}: use an integer >= 1 (one shard per PS task).")


@dataclass(frozen=True)
class _Piece:
    """One contiguous run of one variable, held by one shard."""

    path: str  # the variable, as ``jax.tree_util.keystr`` writes it
    start: int  # first element, in the variable's flattened (row-major) order
    stop: int  # one past the last


@dataclass(frozen=True)
class Partition:
    """How a parameter tree is cut into shards: flat bounds, plus what it takes to rebuild the tree."""

    bounds: tuple[tuple[int, int], ...]  # [start, stop) of each shard in the flat vector
    treedef: jax.tree_util.PyTreeDef
    paths: tuple[str, ...]
    shapes: tuple[tuple[int, ...], ...]
    dtype: str

    @classmethod
    def of(cls, params: PyTree, num_shards: int) -> Partition:
        """Cut ``params`` into ``num_shards`` slices of near-equal size (they differ by at most one element).

        >>> Partition.of({"w": np.zeros((2, 3)), "b": np.zeros(4)}, 3).bounds
        ((0, 3), (3, 7), (7, 10))
        """
        leaves, treedef = jax.tree_util.tree_flatten_with_path(params)
        dtypes = {str(jnp.result_type(x)) for _, x in leaves}
        if len(dtypes) > 1:
            raise ValueError(
                f"ParameterServer shards one flat vector, so every parameter needs one dtype; got {sorted(dtypes)}. "
                "Cast the parameters to one dtype first."
            )
        total = sum(int(np.size(x)) for _, x in leaves)
        if isinstance(num_shards, bool) or not isinstance(num_shards, int) or not 1 <= num_shards <= total:
            raise ValueError(
                f"num_shards={num_shards!r}: the parameters hold {total} elements, so they can be split over "
                f"1 to {total} shards. Choose an integer in that range."
            )
        edges = np.linspace(0, total, num_shards + 1).round().astype(int)  # sizes differ by at most one
        return cls(
            bounds=tuple((int(a), int(b)) for a, b in zip(edges[:-1], edges[1:], strict=True)),
            treedef=treedef,
            paths=tuple(jax.tree_util.keystr(p) for p, _ in leaves),
            shapes=tuple(tuple(np.shape(x)) for _, x in leaves),
            dtype=dtypes.pop(),
        )

    @property
    def num_shards(self) -> int:
        return len(self.bounds)

    def split(self, params: PyTree) -> tuple[jax.Array, ...]:
        """The flat slice of ``params`` each shard holds (traceable)."""
        flat = jnp.concatenate([jnp.ravel(x) for x in jax.tree.leaves(params)])
        return tuple(flat[a:b] for a, b in self.bounds)

    def join(self, shards: Sequence[jax.Array]) -> PyTree:
        """The parameter tree from the shards' slices (traceable; NumPy in, NumPy out)."""
        xp = np if all(isinstance(s, np.ndarray) for s in shards) else jnp
        flat = xp.concatenate([xp.ravel(s) for s in shards])
        sizes = np.cumsum([int(np.prod(s, dtype=np.int64)) for s in self.shapes])[:-1]
        return self.treedef.unflatten([x.reshape(s) for x, s in zip(xp.split(flat, sizes), self.shapes, strict=True)])

    @property
    def loads(self) -> tuple[int, ...]:
        """Bytes of parameters each shard holds."""
        itemsize = np.dtype(self.dtype).itemsize
        return tuple((b - a) * itemsize for a, b in self.bounds)

    def pieces(self, shard: int) -> list[_Piece]:
        """Which run of which variable ``shard`` holds."""
        lo, hi = self.bounds[shard]
        out, offset = [], 0
        for path, shape in zip(self.paths, self.shapes, strict=True):
            size = int(np.prod(shape, dtype=np.int64))
            start, stop = max(lo, offset), min(hi, offset + size)
            if start < stop:
                out.append(_Piece(path, start - offset, stop - offset))
            offset += size
        return out

    def table(self, devices: Sequence[jax.Device] | None = None) -> str:
        """The assignment as a text table: shard, device, elements, bytes, and the pieces it holds."""
        itemsize = np.dtype(self.dtype).itemsize
        sizes = dict(zip(self.paths, (int(np.prod(s, dtype=np.int64)) for s in self.shapes), strict=True))
        lines = [f"{'shard':<6}{'device':<10}{'elements':>10}{'bytes':>10}  pieces", "-" * 72]
        for j, (a, b) in enumerate(self.bounds):
            where = str(devices[j % len(devices)].id) if devices else "-"
            pieces = ", ".join(
                p.path if (p.start, p.stop) == (0, sizes[p.path]) else f"{p.path}[{p.start}:{p.stop}]"
                for p in self.pieces(j)
            )
            lines.append(f"{j:<6}{where:<10}{b - a:>10}{(b - a) * itemsize:>10}  {pieces}")
        return "\n".join(lines)


@dataclass(frozen=True)
class RoundRobin:
    """TensorFlow 1's ``replica_device_setter`` placement: whole variables dealt to the PS tasks in turn.

    Variable ``i`` goes to task ``i mod k`` (TensorFlow deals them in creation order; here,
    in tree order), whatever its size, so one large variable can leave its task with most
    of the bytes: what the byte-balanced :class:`Partition` avoids. Shown for comparison;
    :class:`ParameterServer` uses the balanced partition.

    >>> RoundRobin.of({"w": np.zeros((4, 4), np.float32), "b": np.zeros(4, np.float32)}, 2).loads
    (16, 64)
    """

    assignment: tuple[tuple[str, int, int], ...]  # (variable path, shard, bytes)
    num_shards: int

    @classmethod
    def of(cls, params: PyTree, num_shards: int) -> RoundRobin:
        check_num_shards(num_shards)
        leaves = jax.tree_util.tree_flatten_with_path(params)[0]
        return cls(
            tuple(
                (jax.tree_util.keystr(p), i % num_shards, int(np.asarray(x).nbytes)) for i, (p, x) in enumerate(leaves)
            ),
            num_shards,
        )

    @property
    def loads(self) -> tuple[int, ...]:
        """Bytes of parameters each shard holds."""
        loads = [0] * self.num_shards
        for _, shard, nbytes in self.assignment:
            loads[shard] += nbytes
        return tuple(loads)


@struct.dataclass
class Sharded:
    """Parameters as the PS shards hold them: one flat slice per shard; ``partition`` rebuilds the tree."""

    shards: tuple[jax.Array, ...]
    partition: Partition = struct.field(pytree_node=False)
