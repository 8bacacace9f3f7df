"""Read the compiled program: which collectives a step runs, how many bytes they move, how many FLOPs it does.

Teaching claims such as "mirrored training all-reduces every gradient once per
step" are shown from the compiler's own output (the optimized HLO), not asserted.
:func:`flops` and :class:`StepCost` are those of :mod:`parallelkit.measure.flops`,
kept here too so that ``pk.inspect`` reads every count of the compiled program (loaded when
first asked for: reading collectives, as every strategy's traffic report does, needs no FLOP count).
"""

from __future__ import annotations

import contextlib
import math
import re
from collections.abc import Iterator
from dataclasses import dataclass, field

import jax
import numpy as np

from ..core.step import check_step_call

COLLECTIVES = ("all-reduce", "all-gather", "reduce-scatter", "collective-permute", "all-to-all")

_DTYPE_BYTES = {
    "pred": 1, "s8": 1, "u8": 1, "f8e4m3fn": 1, "f8e5m2": 1,
    "s16": 2, "u16": 2, "f16": 2, "bf16": 2,
    "s32": 4, "u32": 4, "f32": 4,
    "s64": 8, "u64": 8, "f64": 8, "c64": 8, "c128": 16,
}  # fmt: skip
# A result's shape: an array, or a tuple of them, whose layouts may hold parentheses (TPU tiling: `{1,0:T(8,128)}`).
_SHAPE = r"\((?:[^()]|\([^()]*\))*\)|[a-z0-9]+\[[0-9,]*\](?:\{[^}]*\})?"
# `%name = <shape> op(` ; async pairs are counted once, at their `-done`.
_INSTRUCTION = re.compile(
    r"%(?P<name>[^\s=]+)\s*=\s*(?P<shape>" + _SHAPE + r")\s+"
    r"(?P<op>" + "|".join(COLLECTIVES) + r")(?P<suffix>-start|-done)?\((?P<rest>.*)$"
)
_ANY_INSTRUCTION = re.compile(
    r"^\s*(?:ROOT\s+)?%(?P<name>[^\s=]+)\s*=\s*(?:" + _SHAPE + r")\s+(?P<op>[a-z][a-z0-9-]*)\((?P<rest>.*)$"
)
_COMPUTATION = re.compile(r"^(?:ENTRY\s+)?%(?P<name>[^\s(]+)\s*\(.*\)\s*->\s*(?P<result>.+?)\s*\{\s*$")
_CALLS = re.compile(r"calls=%([^\s,}]+)")
# Instructions that only name, move or wait for data: not work a collective in flight can overlap.
_BOOKKEEPING = {"get-tuple-element", "bitcast", "tuple", "parameter", "constant", "copy-start", "copy-done", "copy"}
_ARRAY = re.compile(r"([a-z][a-z0-9]*)\[([0-9,]*)\]")
_COMMENT = re.compile(r"/\*.*?\*/")
_PAIRS = re.compile(r"source_target_pairs=\{((?:\{\d+,\d+\},?)*)\}")


Groups = tuple[tuple[int, ...], ...]

_LIST = re.compile(r"replica_groups=\{((?:\{[0-9,]*\},?)*)\}")
_IOTA = re.compile(r"replica_groups=\[(\d+),(\d+)\]<=\[([0-9,]+)\](?:T\(([0-9,]+)\))?")
_MESH = re.compile(
    r"replica_groups=mesh\[(?P<dims>[^\]]*)\]"
    r"(?:,\s*device_ids=\(\[(?P<ids>[0-9,]+)\](?:T\((?P<perm>[0-9,]+)\))?\))?"
    r"\s*(?:\{(?P<axes>[^}]*)\})?"
)


def _iota(dims: str, perm: str | None) -> np.ndarray:
    """``arange`` reshaped to ``dims`` and transposed by ``perm``: XLA's iota tile assignment."""
    shape = [int(d) for d in dims.split(",")]
    ids = np.arange(int(np.prod(shape))).reshape(shape)
    return ids.transpose([int(p) for p in perm.split(",")]) if perm else ids


def replica_groups(rest: str) -> Groups | None:
    """The device groups of one collective instruction's text (its operands and attributes), or None if it names none.

    XLA prints them as a list (``{{0,1},{2,3}}``), as an iota (``[2,2]<=[2,2]T(1,0)``: ``arange(4)``
    reshaped, transposed and cut into 2 groups of 2), or over a mesh of its own (``mesh['axis_0'=2,
    'axis_1'=2] {'axis_1'}``: the devices, or ``device_ids``, laid out on that mesh, each group varying
    over the axes in braces). An empty list means one group of every device: None, as the program alone
    does not say how many that is.

    >>> replica_groups("replica_groups={{0,2},{1,3}}, to_apply=%add")
    ((0, 2), (1, 3))
    >>> replica_groups("replica_groups=[2,2]<=[2,2]T(1,0), dimensions={0}")
    ((0, 2), (1, 3))
    >>> replica_groups("replica_groups=mesh['axis_0'=2,'axis_1'=2] {'axis_0'}, use_global_device_ids=true")
    ((0, 2), (1, 3))
    >>> replica_groups("replica_groups=mesh['a'=2,'b'=2], device_ids=([2,2]T(1,0)) {'b'}, dimensions={0}")
    ((0, 2), (1, 3))
    """
    if m := _LIST.search(rest):
        found = tuple(tuple(int(i) for i in g.split(",")) for g in re.findall(r"\{([0-9,]+)\}", m.group(1)))
        return found or None
    if m := _IOTA.search(rest):
        ids = _iota(m.group(3), m.group(4)).reshape(int(m.group(1)), int(m.group(2)))
        return tuple(tuple(int(i) for i in row) for row in ids)
    if m := _MESH.search(rest):
        names = re.findall(r"'([^']+)'=(\d+)", m.group("dims"))
        shape = [int(size) for _, size in names]
        ids = _iota(m.group("ids"), m.group("perm")) if m.group("ids") else np.arange(int(np.prod(shape)))
        ids = ids.reshape(shape)
        varying = re.findall(r"'([^']+)'", m.group("axes") or "")
        inside = [i for i, (name, _) in enumerate(names) if name in varying]
        outside = [i for i in range(len(names)) if i not in inside]
        rows = ids.transpose(outside + inside).reshape(-1, int(np.prod([shape[i] for i in inside])))
        return tuple(tuple(int(i) for i in row) for row in rows)
    return None


@dataclass(frozen=True)
class Collective:
    """One collective operation in a compiled program, as seen from one device."""

    op: str  # one of COLLECTIVES
    shapes: tuple[str, ...]  # its result arrays, e.g. ("f32[64,10]",)
    elements: int
    bytes: int  # of its result on one device
    group_size: int | None  # devices taking part in each group, where the HLO says
    pairs: tuple[tuple[int, int], ...] | None = None  # a permute's (source, target) mesh positions
    asynchronous: bool = field(default=False, repr=False)  # started, left running, and waited for later
    overlaps: tuple[str, ...] = field(default=(), repr=False)  # the instructions scheduled while it runs
    groups: Groups | None = field(default=None, repr=False)  # its device groups, as places in the program's devices

    def sent_bytes(self, n: int | None = None) -> float:
        """The bytes one device sends for this collective, one way, in a group of ``n`` (by default its group's size).

        :func:`sent_bytes` of its kind and :attr:`bytes`. A permute's needs no group size.

        Raises:
          ValueError: neither ``n`` nor the HLO gave the group's size, for a kind that needs it.
        """
        n = self.group_size if n is None else n
        if n is None and self.op != "collective-permute":
            raise ValueError(f"The HLO names no replica groups for this {self.op}: pass n, the devices in its group.")
        return sent_bytes(self.op, self.bytes, n or 1)


def sent_bytes(op: str, payload: float, n: int) -> float:
    """The bytes one device sends, one way, for one collective of kind ``op`` over ``n`` devices.

    ``payload`` is the collective's size as :func:`parse_collectives` reads it: its result
    on one device. The figures are those of the ring algorithms, the same for every device:

    - ``all-reduce`` of ``S``: ``2 (n-1)/n S`` (a reduce-scatter, then an all-gather);
    - ``all-gather`` whose gathered result is ``S``: ``(n-1)/n S``, the other devices' pieces;
    - ``reduce-scatter`` of an input ``S`` to a shard ``S/n`` (the payload): ``(n-1)/n S``;
    - ``collective-permute``: its operand, whatever ``n``;
    - ``all-to-all`` of ``S``: ``(n-1)/n S``, all but the piece a device keeps.

    The payload counts an all-gather's whole output and a reduce-scatter's shard, so it
    does not compare one kind of collective with another; these bytes do.

    >>> [sent_bytes(op, 1200, 4) for op in COLLECTIVES]
    [1800.0, 900.0, 3600.0, 1200.0, 900.0]
    """
    if op not in COLLECTIVES:
        raise ValueError(f"{op!r} is not a collective: choose one of {list(COLLECTIVES)}.")
    if op == "collective-permute":
        return float(payload)
    if op == "reduce-scatter":  # the input is n shards
        return float((n - 1) * payload)
    return (2 if op == "all-reduce" else 1) * (n - 1) / n * payload


def _arrays(shape: str) -> list[tuple[str, int, int]]:
    out = []
    for dtype, dims in _ARRAY.findall(shape):
        count = math.prod(int(d) for d in filter(None, dims.split(",")))
        out.append((f"{dtype}[{dims}]", count, count * _DTYPE_BYTES.get(dtype, 4)))
    return out


def _pairs(rest: str) -> tuple[tuple[int, int], ...] | None:
    if m := _PAIRS.search(rest):
        return tuple((int(a), int(b)) for a, b in re.findall(r"\{(\d+),(\d+)\}", m.group(1)))
    return None


def parse_collectives(hlo_text: str) -> list[Collective]:
    """Every collective in an HLO module's text, in program order.

    Compiled for a TPU (see :mod:`parallelkit.measure.aot`), a reduce-scatter is an all-reduce
    fused with its slice (a computation named ``all-reduce-scatter``): it is listed as a
    ``reduce-scatter`` of the shards it leaves. A collective the compiler split into pieces
    of one chain (``chain_id``) is listed once. :attr:`Collective.asynchronous` and
    :attr:`Collective.overlaps` say what an async pair (``-start``/``-done``, or a TPU's
    ``async-collective-start``/``-done`` fusions) has scheduled between its two halves.

    >>> hlo = "%ar = f32[64,10]{1,0} all-reduce(f32[64,10]{1,0} %g), replica_groups={{0,1,2,3}}"
    >>> parse_collectives(hlo)
    [Collective(op='all-reduce', shapes=('f32[64,10]',), elements=640, bytes=2560, group_size=4, pairs=None)]
    >>> hlo = "%ar = (f32[10]{0}, /*index=1*/f32[]) all-reduce(%a, %b), replica_groups=mesh['x'=4] {'x'}"
    >>> parse_collectives(hlo)[0].bytes, parse_collectives(hlo)[0].group_size
    (44, 4)
    >>> parse_collectives("%p = f32[2]{0} collective-permute(%x), source_target_pairs={{0,1},{1,0}}")[0].pairs
    ((0, 1), (1, 0))
    >>> start = "%s = f32[8]{0} all-gather-start(%x), replica_groups={{0,1}}"
    >>> hlo = "\\n".join([start, "%m = f32[4]{0} fusion(%y)", "%d = f32[8]{0} all-gather-done(%s)"])
    >>> [(c.op, c.asynchronous, c.overlaps) for c in parse_collectives(hlo)]
    [('all-gather', True, ('m',))]
    """
    program = _Program(hlo_text)
    found, started, chains = [], {}, set()  # started: async `-start` name -> (groups, pairs, its line)
    for comp, index, line in program.lines():
        m = _INSTRUCTION.search(line)
        if not m:
            continue
        groups, pairs = replica_groups(m.group("rest")), _pairs(m.group("rest"))
        if m.group("suffix") == "-start":
            started[m.group("name")] = groups, pairs, index
            continue
        chain = _chain(m.group("rest"))
        if chain in chains:
            continue  # another piece of a collective already listed
        chains |= {chain} - {None}
        op, shape, overlaps = m.group("op"), m.group("shape"), None
        if m.group("suffix") == "-done":
            operand = re.search(r"%([^\s,)]+)", m.group("rest"))
            groups, pairs, start = started.get(operand.group(1), (None, None, index)) if operand else (None,) * 3
            overlaps = program.between(comp, start, index) if start is not None else ()
        else:
            overlaps = program.overlapped(comp)
        if op == "all-reduce" and comp.startswith("all-reduce-scatter"):
            op, shape = "reduce-scatter", program.results[comp]  # the shards the fused slice leaves
        arrays = _arrays(shape)
        found.append(
            Collective(
                op=op,
                shapes=tuple(a[0] for a in arrays),
                elements=sum(a[1] for a in arrays),
                bytes=sum(a[2] for a in arrays),
                group_size=len(groups[0]) if groups else None,
                pairs=pairs,
                asynchronous=overlaps is not None,
                overlaps=overlaps or (),
                groups=groups,
            )
        )
    return found


def _chain(rest: str) -> tuple[str, str] | None:
    """(channel, chain) of a piece of a chained collective, None for a whole one."""
    chain, channel = re.search(r'chain_id="([^"]*)"', rest), re.search(r"channel_id=(\d+)", rest)
    return (channel.group(1) if channel else "", chain.group(1)) if chain else None


class _Program:
    """An HLO module's instructions by computation, and which instruction calls each computation."""

    def __init__(self, hlo_text: str):
        self.results: dict[str, str] = {}  # computation -> its result's shape
        self.names: dict[str, list[tuple[str, str]]] = {}  # computation -> its instructions' (name, op), in order
        self.caller: dict[str, tuple[str, int]] = {}  # computation -> (computation, index) of its caller
        self._lines: list[tuple[str, int, str]] = []
        comp = ""
        for raw in hlo_text.splitlines():
            line = _COMMENT.sub("", raw)
            if header := _COMPUTATION.match(line):
                comp = header.group("name")
                self.results[comp] = header.group("result")
                continue
            if not (m := _ANY_INSTRUCTION.match(line)):
                continue
            index = len(self.names.setdefault(comp, []))
            self.names[comp].append((m.group("name"), m.group("op")))
            for callee in _CALLS.findall(m.group("rest")):
                self.caller.setdefault(callee, (comp, index))
            self._lines.append((comp, index, line))

    def lines(self) -> list[tuple[str, int, str]]:
        """(computation, index in it, text) of every instruction."""
        return self._lines

    def between(self, comp: str, start: int, end: int) -> tuple[str, ...]:
        """The instructions of ``comp`` scheduled after ``start`` and before ``end`` that do work."""
        return tuple(name for name, op in self.names[comp][start + 1 : end] if name and op not in _BOOKKEEPING)

    def overlapped(self, comp: str) -> tuple[str, ...] | None:
        """What a collective in ``comp`` overlaps, where ``comp`` is the body of an async start; else None."""
        if comp not in self.caller:
            return None
        outer, start = self.caller[comp]
        name = self.names[outer][start][0]
        if not name.startswith("async-collective-start"):  # the TPU's async pair, as fusions
            return None
        done = name.replace("start", "done")
        names = self.names[outer]
        end = next((i for i in range(start + 1, len(names)) if names[i][0] == done), len(names))
        return self.between(outer, start, end)


def compiled_text(step, *args, who: str = "pk.inspect.compiled_text") -> str:
    """The optimized HLO of ``step`` (a jitted/pmapped function or a :class:`~parallelkit.Step`).

    ``who`` names the caller in the error for a step or state of the wrong kind.
    """
    check_step_call(who, step, args[0] if args else None)
    return step.lower(*args).compile().as_text()


def collectives(step, *args) -> list[Collective]:
    """The collectives in the compiled program of ``step(*args)``, one entry per instruction.

    A collective inside a loop (a ``lax.scan`` over layers compiles to a ``while``) is
    listed once, though it runs once per iteration: multiply by the trip count for the
    bytes a step moves.
    """
    return parse_collectives(compiled_text(step, *args, who="pk.inspect.collectives"))


_LAID_OUT = re.compile(r"([a-z][a-z0-9]*)\[([0-9,]*)\]\{([^}]*)\}")
_HOST_MEMORY_SPACE = "S(5)"  # XLA's memory space of host memory (pinned_host) in a layout


def host_memory_bytes(hlo_text: str) -> tuple[int, int]:
    """(bytes the program reads from host memory, bytes it writes there), from its entry layout.

    An argument or result that lives in host memory (``memory_kind="pinned_host"``)
    carries the memory space ``S(5)`` in the compiled program's entry layout; the
    program copies such an argument into device memory before it computes on it, and
    its result back out.

    >>> hlo = "HloModule m, entry_computation_layout={(f32[2,3]{1,0:S(5)}, f32[4]{0})->(f32[2,3]{1,0:S(5)})}"
    >>> host_memory_bytes(hlo)
    (24, 24)
    """
    start = hlo_text.find("entry_computation_layout={")
    if start < 0:
        raise ValueError("No entry_computation_layout in this HLO text: pass a compiled program's as_text().")
    depth, end = 0, start
    for end in range(start + len("entry_computation_layout="), len(hlo_text)):  # to the brace closing it
        depth += {"{": 1, "}": -1}.get(hlo_text[end], 0)
        if depth == 0:
            break
    args, results = hlo_text[start:end].split(")->", 1)

    def host(part: str) -> int:
        arrays = [(dtype, dims) for dtype, dims, layout in _LAID_OUT.findall(part) if _HOST_MEMORY_SPACE in layout]
        return sum(_arrays(f"{dtype}[{dims}]")[0][2] for dtype, dims in arrays)

    return host(args), host(results)


@dataclass(frozen=True)
class _MemoryUse:
    """Bytes one device needs for one call of a compiled program: XLA's estimate, made at compile time."""

    argument: int  # inputs: parameters, optimizer state, the batch slice
    output: int  # results: the new state, the metrics
    temp: int  # scratch: activations kept for the backward pass, gathered weights, ...
    alias: int  # outputs written into donated inputs (counted once, not twice)

    @property
    def total(self) -> int:
        """argument + output + temp - alias: the peak this device must hold."""
        return self.argument + self.output + self.temp - self.alias


def memory_per_device(step, *args) -> _MemoryUse:
    """What one device will hold while ``step(*args)`` runs, as the compiler estimates it.

    Read from ``compiled.memory_analysis()``: the sizes of the buffers XLA planned for the
    compiled program, per device for a sharded one, before anything runs. It is an
    estimate, not a measurement: the allocator's own counters are
    ``jax.Device.memory_stats()`` (``bytes_in_use``, ``peak_bytes_in_use``), which GPU and
    TPU backends report and the CPU backend does not (it returns ``None``). On the CPU
    backend XLA's ``peak_memory_in_bytes`` is argument + output - alias and leaves out the
    temporaries, so :attr:`_MemoryUse.total` adds them back.
    """
    check_step_call("pk.inspect.memory_per_device", step, args[0] if args else None)
    stats = step.lower(*args).compile().memory_analysis()
    return _MemoryUse(
        argument=int(stats.argument_size_in_bytes),
        output=int(stats.output_size_in_bytes),
        temp=int(stats.temp_size_in_bytes),
        alias=int(stats.alias_size_in_bytes),
    )


def summarize(found: list[Collective]) -> dict[str, dict[str, int]]:
    """Per operation kind: how many, and how many bytes (per device) they carry in all."""
    summary: dict[str, dict[str, int]] = {}
    for c in found:
        row = summary.setdefault(c.op, {"count": 0, "bytes": 0})
        row["count"] += 1
        row["bytes"] += c.bytes
    return summary


@contextlib.contextmanager
def count_compilations() -> Iterator[list[float]]:
    """Record the XLA compilations inside the block: a list with one duration (s) per compile.

    >>> import jax.numpy as jnp
    >>> f, x = jax.jit(lambda x: x * 2), jnp.ones(3)
    >>> with count_compilations() as first:
    ...     _ = f(x)
    >>> with count_compilations() as second:
    ...     _ = f(x)
    >>> len(first), len(second)
    (1, 0)
    """
    durations: list[float] = []

    def listener(event: str, seconds: float, **_) -> None:
        if event == _BACKEND_COMPILE_EVENT:
            durations.append(seconds)

    jax.monitoring.register_event_duration_secs_listener(listener)
    try:
        yield durations
    finally:
        jax.monitoring.unregister_event_duration_listener(listener)


_BACKEND_COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"


def __getattr__(name: str) -> object:
    """:func:`flops` and :class:`StepCost`, from :mod:`parallelkit.measure.flops` when first asked for."""
    if name in ("flops", "StepCost"):
        from . import flops

        return getattr(flops, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
