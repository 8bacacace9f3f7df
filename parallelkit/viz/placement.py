"""Where state lives and what crosses between devices, as matplotlib figures built without pyplot."""

from __future__ import annotations

import io
import re
from collections.abc import Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from matplotlib.figure import Figure
from matplotlib.patches import Patch, Rectangle

from ..measure.inspect import COLLECTIVES, Collective, summarize
from ..strategies import LeafPlacement
from ..strategies.offdevice.partition import Partition

_CMAP = "Blues"  # 0 (white) = holds nothing, 1 (dark) = holds a full copy
_HOST_MEMORY_KINDS = ("pinned_host", "unpinned_host")  # host RAM beside a device, not the device's own memory
_HOST_HATCH = "////"
_KEY = re.compile(r"\[['\"]?([^'\"\]]*)['\"]?\]|\.([A-Za-z_]\w*)")


def format_bytes(n: float) -> str:
    """Bytes in binary units, short enough for a figure cell.

    >>> format_bytes(40), format_bytes(16384), format_bytes(3 * 2**20)
    ('40 B', '16 KiB', '3 MiB')
    """
    units = ["B", "KiB", "MiB", "GiB"]
    while abs(n) >= 1024 and len(units) > 1:
        n /= 1024
        units.pop(0)
    return f"{n:.0f} {units[0]}" if units[0] == "B" or n == int(n) else f"{n:.1f} {units[0]}"


def leaf_label(path: str) -> str:
    """A key path as ``jax.tree_util.keystr`` writes it, in slash form.

    >>> leaf_label(".opt_state[0].mu['hidden'][0]['kernel']")
    'opt_state/0/mu/hidden/0/kernel'
    """
    parts = [a or b for a, b in _KEY.findall(path)]
    return "/".join(parts) if parts else path


def held_fractions(rows: Sequence[LeafPlacement], devices: Sequence[int]) -> np.ndarray:
    """``[leaf, device]``: the fraction of each leaf that each device holds (1 = a full copy).

    Raises:
      ValueError: a leaf lives on a device missing from ``devices``.
    """
    column = {d: j for j, d in enumerate(devices)}
    fractions = np.zeros((len(rows), len(devices)))
    for i, row in enumerate(rows):
        missing = sorted(set(row.devices) - set(column))
        if missing:
            raise ValueError(
                f"{row.path} lives on device(s) {missing}, which are not among the columns "
                f"{list(devices)}. Pass devices=None to draw every device that holds something."
            )
        logical = int(np.prod(row.shape, dtype=np.int64)) * jnp.dtype(row.dtype).itemsize
        fraction = row.bytes_per_device / logical if logical else 1.0
        for d in row.devices:
            fractions[i, column[d]] = fraction
    return fractions


def memory_kinds(rows: Sequence[LeafPlacement], devices: Sequence[int]) -> np.ndarray:
    """``[leaf, device]``: the memory kind each device holds its part of each leaf in ("" where it holds none).

    >>> rows = [LeafPlacement(".w", (2,), "float32", (1,), "pinned_host", "SingleDeviceSharding", 1, 8)]
    >>> memory_kinds(rows, [0, 1]).tolist()
    [['', 'pinned_host']]
    """
    held = held_fractions(rows, devices) > 0
    kinds = np.array([[row.memory_kind or "device"] * len(devices) for row in rows], dtype=object).reshape(held.shape)
    return np.where(held, kinds, "")


def placement_figure(rows: Sequence[LeafPlacement], devices: Sequence[int] | None = None, title: str = "") -> Figure:
    """A leaf-by-device grid: which device holds how much of each leaf of the state.

    Each cell is shaded by the fraction of the leaf that the device holds (a full
    copy is dark, a shard lighter, nothing white) and labelled with the bytes it
    holds; each column is labelled with its device's total. Cells in host memory
    (``pinned_host``: central storage, parameter-server shards) are hatched and
    labelled ``host``, since they sit in RAM beside the device, not on it.

    Args:
      rows: from ``strategy.describe(state)`` (any pytree of placed arrays).
      devices: device ids, one column each; by default every device holding a leaf.
      title: drawn above the grid.

    Returns:
      The figure; ``fig.axes[0].images[0].get_array()`` is the ``[leaf, device]``
      grid of fractions, and ``fig.axes[0].patches`` holds one hatched rectangle per
      host-memory cell, centred on it (see :func:`memory_kinds`).

    Raises:
      ValueError: a leaf lives on a device that is not in ``devices``.

    Example:
      >>> from parallelkit import LeafPlacement
      >>> rows = [LeafPlacement(".w", (4, 2), "float32", (0, 1), "device", "P()", 2, 32)]
      >>> fig = placement_figure(rows, devices=[0, 1, 2])
      >>> fig.axes[0].images[0].get_array().tolist()
      [[1.0, 1.0, 0.0]]
    """
    if devices is None:
        devices = sorted({d for row in rows for d in row.devices})
    devices = list(devices)
    fractions = held_fractions(rows, devices)
    held = np.where(fractions > 0, np.array([row.bytes_per_device for row in rows], float).reshape(-1, 1), 0.0)

    fig = Figure(
        figsize=(2.6 + 0.75 * max(len(devices), 2), 1.4 + 0.3 * max(len(rows), 1)),
        layout="constrained",
    )
    ax = fig.add_subplot()
    image = ax.imshow(fractions, cmap=_CMAP, vmin=0.0, vmax=1.0, aspect="auto")
    kinds = memory_kinds(rows, devices)
    for i, j in zip(*np.nonzero(fractions), strict=True):
        host = kinds[i, j] in _HOST_MEMORY_KINDS
        if host:
            ax.add_patch(
                Rectangle((j - 0.5, i - 0.5), 1, 1, fill=False, hatch=_HOST_HATCH, edgecolor="tab:orange", lw=0)
            )
        ax.text(
            j,
            i,
            format_bytes(held[i, j]) + ("\nhost" if host else ""),
            ha="center",
            va="center",
            fontsize=7,
            color="white" if fractions[i, j] > 0.55 else "black",
        )
    ax.set_yticks(range(len(rows)), [f"{leaf_label(r.path)} {r.shape}" for r in rows], fontsize=8)
    totals = held.sum(axis=0)
    ax.set_xticks(
        range(len(devices)),
        [f"{d}\n{format_bytes(t)}" for d, t in zip(devices, totals, strict=True)],
        fontsize=8,
    )
    ax.set_xlabel("device id (and the bytes it holds in all)")
    ax.tick_params(length=0)
    # Thin white lines between cells, so equal neighbours still read as separate devices.
    ax.set_xticks(np.arange(len(devices) + 1) - 0.5, minor=True)
    ax.set_yticks(np.arange(len(rows) + 1) - 0.5, minor=True)
    ax.grid(which="minor", color="white", linewidth=1.5)
    ax.tick_params(which="minor", length=0)
    colorbar = fig.colorbar(image, ax=ax, shrink=0.8, ticks=[0, 0.5, 1])
    colorbar.set_label("fraction of the leaf held")
    host_kinds = sorted({k for k in kinds.ravel() if k in _HOST_MEMORY_KINDS})
    if host_kinds:
        swatch = Patch(facecolor="white", edgecolor="tab:orange", hatch=_HOST_HATCH)
        fig.legend([swatch], [f"host memory ({', '.join(host_kinds)})"], loc="outside lower center", fontsize=8)
    if title:
        ax.set_title(title)
    return fig


def partition_figure(partition: Partition, devices: Sequence[int] | None = None, title: str = "") -> Figure:
    """Where the shards' cuts fall, and what each parameter-server shard holds.

    The parameters are flattened in tree order into one vector and cut into contiguous
    slices of near-equal size (see :meth:`parallelkit.ParameterServer.partition`): the
    cuts fall wherever the element count says, not between variables, so a variable may
    span two shards. The top panel draws that vector, one segment per variable, with a
    dashed line at each cut; below, one bar per shard, one segment per piece of a variable.

    Args:
      partition: from ``strategy.partition(params)``.
      devices: device ids in worker order (``[d.id for d in strategy.devices]``): shard
        ``j`` lives in the host memory beside ``devices[j % len(devices)]``.
      title: drawn above the figure.

    Returns:
      The figure. ``fig.axes[0].patches`` holds one rectangle per piece, shard by shard in
      the order of ``partition.pieces(j)``: at height ``j``, starting at the piece's offset
      inside the shard, as wide as its element count. ``fig.axes[1]`` is the flat vector:
      ``patches`` one segment per variable, in tree order, from its first element's offset;
      ``lines`` one dashed line per cut, at ``partition.bounds[j][0]`` for ``j >= 1``.
    """
    names = list(dict.fromkeys(partition.paths))
    colors = {name: f"C{k % 10}" for k, name in enumerate(names)}
    fig = Figure(figsize=(9, 2.0 + 0.45 * partition.num_shards), layout="constrained")
    grid = fig.add_gridspec(2, 1, height_ratios=(1.0, max(partition.num_shards, 1.5)))
    ax = fig.add_subplot(grid[1])  # the shards first: fig.axes[0]
    flat = fig.add_subplot(grid[0])
    itemsize = np.dtype(partition.dtype).itemsize
    widest = max(b - a for a, b in partition.bounds)
    for j in range(partition.num_shards):
        left = 0
        for piece in partition.pieces(j):
            width = piece.stop - piece.start
            ax.barh(j, width, left=left, height=0.7, color=colors[piece.path], edgecolor="white")
            if width >= 0.15 * widest:  # else too narrow for a label: the legend names its colour
                ax.text(
                    left + width / 2,
                    j,
                    f"{leaf_label(piece.path)}[{piece.start}:{piece.stop}]",
                    ha="center",
                    va="center",
                    fontsize=7,
                    clip_on=True,
                )
            left += width
    labels = []
    for j, (a, b) in enumerate(partition.bounds):
        where = f" · device {devices[j % len(devices)]} (host)" if devices else ""
        labels.append(f"shard {j}{where}\n{b - a:,} elements, {format_bytes((b - a) * itemsize)}")
    ax.set_yticks(range(partition.num_shards), labels, fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel("element within the shard")
    _draw_flat_vector(flat, partition, colors)
    handles = [Patch(color=colors[n]) for n in names]
    fig.legend(handles, [leaf_label(n) for n in names], loc="outside right upper", fontsize=7, frameon=False)
    fig.suptitle(
        title or f"{partition.num_shards} parameter-server shards: which slice of which variable each holds",
        fontsize=10,
    )
    return fig


def _draw_flat_vector(ax, partition: Partition, colors: Mapping[str, str]) -> None:
    """The parameters as one vector, a segment per variable, and a dashed line at each cut between shards."""
    offset = 0
    for path, shape in zip(partition.paths, partition.shapes, strict=True):
        size = int(np.prod(shape, dtype=np.int64))
        ax.barh(0, size, left=offset, height=0.6, color=colors[path], edgecolor="white")
        offset += size
    for j, (a, b) in enumerate(partition.bounds):
        if j:
            ax.axvline(a, color="black", linestyle="--", linewidth=1.2)
        ax.text((a + b) / 2, 0.45, f"shard {j}", ha="center", va="bottom", fontsize=8)
    ax.set(xlim=(0, offset), ylim=(-0.4, 0.9), yticks=[])
    ax.set_xlabel(f"element of the flat vector (all {offset:,} parameters, in tree order); dashed: a cut", fontsize=8)
    ax.tick_params(labelsize=7)


def annotate_bar(ax, bar, text: str) -> None:
    """Write ``text`` just above a bar of a bar chart."""
    ax.annotate(
        text,
        (bar.get_x() + bar.get_width() / 2, bar.get_height()),
        xytext=(0, 2),
        textcoords="offset points",
        ha="center",
        va="bottom",
        fontsize=8,
    )


def png(figure: Figure) -> bytes:
    """The figure as PNG bytes, at the resolution the live widgets show it (an ``ipywidgets.Image``'s value)."""
    buffer = io.BytesIO()
    figure.savefig(buffer, format="png", dpi=80)
    return buffer.getvalue()


def collectives_figure(
    found: Sequence[Collective],
    gradient_bytes: int | None = None,
    title: str = "collectives in the compiled step",
) -> Figure:
    """Bytes per collective kind that one step moves (per device), as bars.

    Args:
      found: from :func:`parallelkit.measure.inspect.collectives`.
      gradient_bytes: draw a dashed line at this height, e.g.
        ``pk.models.param_bytes(params)``: a mirrored step all-reduces that much.
      title: drawn above the bars.

    Returns:
      The figure; bar ``k`` of ``fig.axes[0].patches`` has the byte total of the
      ``k``-th kind, in the order of :data:`parallelkit.measure.inspect.COLLECTIVES`.
    """
    summary = summarize(list(found))
    ops = [op for op in COLLECTIVES if op in summary] + sorted(set(summary) - set(COLLECTIVES))
    heights = [summary[op]["bytes"] for op in ops]
    fig = Figure(figsize=(max(4.5, 1.3 * len(ops) + 2.5), 3.6), layout="constrained")
    ax = fig.add_subplot()
    bars = ax.bar(range(len(ops)), heights, color="tab:blue", width=0.6)
    for bar, op in zip(bars, ops, strict=True):
        size, count = summary[op]["bytes"], summary[op]["count"]
        annotate_bar(ax, bar, f"{format_bytes(size)} = {size:,} B\n{count} op{'s' * (count != 1)}")
    ax.set_xticks(range(len(ops)), ops)
    ax.set_xlim(-0.75, max(len(ops), 1) - 0.25)
    ax.set_ylabel("bytes per device, per step")
    if gradient_bytes is not None:
        ax.axhline(
            gradient_bytes,
            color="tab:red",
            linestyle="--",
            linewidth=1.2,
            label=f"gradient bytes = {gradient_bytes:,} B",
        )
        fig.legend(loc="outside lower center", fontsize=8, frameon=False)
    top = max([*heights, gradient_bytes or 0])
    ax.set_ylim(0, top * 1.25 if top else 1)
    if not ops:
        ax.text(
            0.5,
            0.5,
            "no collectives:\nnothing crosses between devices",
            transform=ax.transAxes,
            ha="center",
            va="center",
            fontsize=9,
            color="0.4",
        )
    if title:
        ax.set_title(title)
    return fig


def slice_label(index: tuple[slice, ...], shape: Sequence[int]) -> str:
    """The part of an array a device holds, as NumPy indexing writes it (``:`` for a whole axis).

    >>> slice_label((slice(None), slice(32, 64)), (64, 128))
    '[:, 32:64]'
    >>> slice_label((slice(0, 64), slice(None)), (64, 10))
    '[:, :]'
    """
    parts = []
    for s, size in zip(index, shape, strict=False):
        start, stop = s.start or 0, size if s.stop is None else s.stop
        parts.append(":" if (start, stop) == (0, size) else f"{start}:{stop}")
    return "[" + ", ".join(parts) + "]"


def mesh_figure(leaves: Mapping[str, jax.Array], title: str = "") -> Figure:
    """Each leaf drawn on its device mesh: one cell per device, labelled with the slice it holds.

    The mesh's last axis runs across, the others (``data``, ``stage``) down; cells that
    hold the same slice share a colour, so replicas read as one colour and shards as
    several. This is the 2-D picture of a ``PartitionSpec``: ``P(None, "model")`` on a
    ``data`` x ``model`` mesh gives each column its own block of columns, repeated down
    the rows.

    Args:
      leaves: label -> an array placed with a ``NamedSharding`` (for example
        ``{"hidden/0/kernel": state.params["hidden"][0]["kernel"]}``).
      title: drawn above the panels.

    Returns:
      The figure; panel ``i``'s ``images[0].get_array()`` holds, per mesh cell, the
      number of the slice that device holds (equal numbers: the same slice).

    Raises:
      ValueError: a leaf that is not laid out on a mesh (use :func:`placement_figure`).
    """
    if not leaves:
        raise ValueError("mesh_figure needs at least one leaf, e.g. {'kernel': state.params['head']['kernel']}.")
    fig = Figure(figsize=(3.4 * min(len(leaves), 3), 2.6 * -(-len(leaves) // 3)), layout="constrained")
    for k, (label, leaf) in enumerate(leaves.items()):
        mesh = getattr(leaf.sharding, "mesh", None)
        if mesh is None or not hasattr(mesh, "devices"):
            raise ValueError(
                f"{label} is placed with {type(leaf.sharding).__name__}, not on a device mesh; "
                "draw it with placement_figure(strategy.describe(state))."
            )
        names, grid = mesh.axis_names, np.asarray(mesh.devices)
        grid = grid.reshape(-1, grid.shape[-1])
        indices = leaf.sharding.devices_indices_map(leaf.shape)
        labels = [[slice_label(indices[d], leaf.shape) for d in row] for row in grid]
        distinct = {lab: i for i, lab in enumerate(dict.fromkeys(lab for row in labels for lab in row))}
        ids = np.array([[distinct[lab] for lab in row] for row in labels], dtype=float)
        ax = fig.add_subplot(-(-len(leaves) // 3), min(len(leaves), 3), k + 1)
        ax.imshow(ids, cmap="tab20", vmin=0, vmax=19, aspect="auto")
        for (i, j), device in np.ndenumerate(grid):
            ax.text(j, i, f"device {device.id}\n{labels[i][j]}", ha="center", va="center", fontsize=7)
        down = " x ".join(f"{n}={mesh.shape[n]}" for n in names[:-1]) or "-"
        ax.set(xticks=[], yticks=[], xlabel=f"{names[-1]}={mesh.shape[names[-1]]}", ylabel=down)
        ax.set_title(f"{label} {tuple(leaf.shape)}\n{leaf.sharding.spec}", fontsize=8)
    if title:
        fig.suptitle(title)
    return fig
