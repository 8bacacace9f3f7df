"""A cluster as the planner sees it (:class:`Cluster`): the cost model's links, each device's FLOP/s and memory."""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from dataclasses import dataclass, fields

import jax

from ..core.types import is_count, is_number
from ..measure import costmodel
from ..measure.ceilings import measure_ceilings
from ..measure.costmodel import Link
from ..measure.hardware import PUBLISHED

# NCCL's per-hop latencies for its "Simple" protocol (NVIDIA/nccl src/graph/tuning.cc): NVLink
# 3.4 us, network about 10 us; the same figures as the cost model's link presets.
_INSIDE_LATENCY_US, _NETWORK_LATENCY_US = 3.4, 10.0
# The training precisions the planner times: bf16 and fp32 mixed precision, and FP8 as Transformer Engine runs it
# (its matrix products in FP8, the rest in bf16: :mod:`.steptime`, :data:`.memory.STATE_BYTES`).
PRECISIONS = ("bf16", "fp32", "fp8")


@dataclass(frozen=True)
class Cluster(costmodel.Cluster):
    """Machines of devices, their links, and one device's peak FLOP/s and memory.

    Args (beyond the cost model's ``machines``, ``devices_per_machine``, ``inside``, ``network``):
      bf16_flops, fp32_flops: one device's matrix-product FLOP/s with 16-bit and 32-bit inputs.
      memory_bytes: one device's memory.
      chip: what the devices are, for tables (a key of ``hardware.PUBLISHED`` picks its achievable matmul share,
        :data:`.kernels.ACHIEVABLE`, and marks its links as a datasheet's: :func:`.steptime.achieved`).
      hbm_bytes_per_s: one device's memory bandwidth, for each operation's bytes; None: FLOPs alone.
      fp8_flops: one device's dense FP8 matrix-product FLOP/s; None for a chip without FP8, which refuses
        ``precision="fp8"``.

    Raises:
      ValueError: ``machines`` or ``devices_per_machine`` that is not a whole number >= 1 (NumPy
        integers are; they are kept as ``int``), or a device figure that is not a finite number > 0.
    """

    bf16_flops: float = 0.0
    fp32_flops: float = 0.0
    memory_bytes: float = 0.0
    chip: str = ""
    hbm_bytes_per_s: float | None = None
    fp8_flops: float | None = None

    def __post_init__(self) -> None:
        for field in ("machines", "devices_per_machine"):  # a NumPy integer is a whole number too: kept as an int
            object.__setattr__(self, field, whole(getattr(self, field), "Cluster", field))
        super().__post_init__()
        for field in ("bf16_flops", "fp32_flops", "memory_bytes"):
            value = getattr(self, field)
            if not (is_number(value) and math.isfinite(value) and value > 0):
                raise ValueError(f"Cluster({field}={value!r}) is not a finite number > 0: give each device's "
                                 "bf16_flops, fp32_flops and memory_bytes.")  # fmt: skip
        bandwidth = self.hbm_bytes_per_s
        if bandwidth is not None and not (is_number(bandwidth) and math.isfinite(bandwidth) and bandwidth > 0):
            raise ValueError(f"Cluster(hbm_bytes_per_s={bandwidth!r}) is not a finite number > 0: give each "
                             "device's memory bandwidth in bytes a second, or None to time matrix products by FLOPs "
                             "alone.")  # fmt: skip
        fp8 = self.fp8_flops
        if fp8 is not None and not (is_number(fp8) and math.isfinite(fp8) and fp8 > 0):
            raise ValueError(f"Cluster(fp8_flops={fp8!r}) is not a finite number > 0: give each device's dense FP8 "
                             "FLOP/s, or None for a chip without FP8.")  # fmt: skip
        # the planner's caches key on the cluster thousands of times a plan: its hash, computed once (frozen)
        object.__setattr__(self, "_hash", hash(tuple(getattr(self, f.name) for f in fields(self))))

    def __hash__(self) -> int:
        return self._hash

    def peak_flops(self, precision: str) -> float:
        """One device's matrix-product FLOP/s for ``"bf16"``, ``"fp32"`` or ``"fp8"`` training (:data:`PRECISIONS`).

        >>> Cluster.published("A100 SXM 80GB", per_node=1).peak_flops("fp8")  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        ValueError: precision='fp8' on 1 A100 SXM 80GB: this chip has no FP8 peak (hardware.PUBLISHED says None). ...
        """
        if precision not in PRECISIONS:
            raise ValueError(f"precision={precision!r}: one of {PRECISIONS}.")
        if precision == "fp8" and self.fp8_flops is None:
            with_fp8 = ", ".join(name for name, chip in PUBLISHED.items() if chip.fp8_flops)
            raise ValueError(f"precision='fp8' on {self.name}: this chip has no FP8 peak (hardware.PUBLISHED says "
                             f"None). Train it in 'bf16' or 'fp32', or plan for a chip with FP8 "
                             f"({with_fp8}).")  # fmt: skip
        return {"bf16": self.bf16_flops, "fp32": self.fp32_flops, "fp8": self.fp8_flops}[precision]

    @property
    def name(self) -> str:
        where = f"{self.machines} machines x {self.devices_per_machine}" if self.machines > 1 else f"{self.devices}"
        return f"{where} {self.chip}".strip()

    @classmethod
    def published(cls, chip: str, per_node: int = 8, nodes: int = 1) -> Cluster:
        """``nodes`` machines of ``per_node`` devices with a datasheet's figures (``hardware.PUBLISHED[chip]``).

        Inside a machine each device gets its chip's link bandwidth along one mesh axis
        (NVLink through the switches; on a TPU torus, one axis's share); between machines,
        the machine's network is its chips' per-chip network bandwidth added up (kept with one
        machine too, for the plans that ask what more machines would do). The float32
        rate is TensorFloat-32's where the chip has it (JAX's default for float32 products on
        those GPUs), else plain float32's; the FP8 rate is the chip's dense FP8 peak, None where it
        has none. Latencies: :data:`_INSIDE_LATENCY_US`,
        :data:`_NETWORK_LATENCY_US` (an assumption for every chip). A chip whose links join fewer
        devices than ``per_node`` (``Chip.link_domain``: an H100 NVL's bridge joins 2) is refused.

        >>> two = Cluster.published("H100 SXM", per_node=8, nodes=2)
        >>> two.devices, two.inside.GBps, two.network.GBps, two.memory_bytes / 1e9
        (16, 450.0, 400.0, 80.0)
        """
        if chip not in PUBLISHED:
            raise ValueError(f"Cluster.published({chip!r}): choose one of {sorted(PUBLISHED)}.")
        per_node, nodes = whole(per_node, "Cluster.published", "per_node"), whole(nodes, "Cluster.published", "nodes")
        c = PUBLISHED[chip]
        if c.link_domain is not None and per_node > c.link_domain:
            raise ValueError(f"Cluster.published({chip!r}, per_node={per_node}): its {c.link_name} joins at most "
                             f"{c.link_domain} devices. Give per_node <= {c.link_domain} and count the rest as "
                             "nodes (they talk over the network).")  # fmt: skip
        source = ", ".join(c.sources)
        inside = Link(c.link_name, c.axis_link_bytes_per_s / 1e9, _INSIDE_LATENCY_US, source)
        network = Link(f"{per_node} x network", per_node * c.network_bytes_per_s / 1e9, _NETWORK_LATENCY_US, source)
        fp32 = c.tf32_flops or c.fp32_flops or c.bf16_flops
        return cls(nodes, per_node, inside, network, c.bf16_flops, fp32, c.memory_bytes, chip, c.hbm_bytes_per_s,
                   c.fp8_flops)  # fmt: skip

    @classmethod
    def measured(cls, devices: Sequence[jax.Device] | None = None, *, quick: bool = True) -> Cluster:
        """This machine's devices as one machine, with their measured ceilings (cached: ``measure_ceilings``).

        The link is the ring whose all-reduce matches the measured ``alpha + P / B`` over ``n``
        devices, as :func:`parallelkit.measure.costmodel.fit_link` derives it. Memory is
        the device's allocator limit where it reports one (GPUs), else this host's memory over
        the devices. Simulated CPU devices (``pk.simulate_devices``) share the host's cores and
        memory: one device's matrix product already uses every core, so each of ``n`` busy at
        once gets ``1 / n`` of the measured FLOP/s, and that share is what this cluster says.
        """
        devices = list(jax.devices() if devices is None else devices)
        ceilings = measure_ceilings(devices, quick=quick)
        n = len(devices)
        if n > 1:
            rounds = 2 * (n - 1)
            bandwidth = ceilings.allreduce_bandwidth.value * rounds / n
            latency = ceilings.allreduce_latency.value / rounds
            inside = Link("measured", bandwidth / 1e9, latency * 1e6, ceilings.allreduce_bandwidth.method)
        else:
            inside = Link("none (one device)", 1.0, 0.0, "one device: nothing to send")
        share = n if devices[0].platform == "cpu" else 1
        flops = ceilings.matmul_bf16.value / share, ceilings.matmul_f32.value / share
        return cls(1, n, inside, None, *flops, _device_memory(devices[0], n), devices[0].device_kind)


def whole(count: object, call: str, argument: str) -> int:
    """``count`` as an ``int`` where it is a whole number >= 1 (NumPy integers are; bools are not), else an error
    naming ``call`` and its ``argument``."""
    if not is_count(count):
        raise ValueError(f"{call}({argument}={count!r}) is not a count of devices or machines: give a whole number "
                         ">= 1.")  # fmt: skip
    return int(count)


def _device_memory(device: jax.Device, sharing: int) -> float:
    """``device``'s memory: its allocator's limit, or the host's physical memory over ``sharing`` devices."""
    stats = device.memory_stats() if hasattr(device, "memory_stats") else None
    if stats and stats.get("bytes_limit"):
        return float(stats["bytes_limit"])
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / sharing
