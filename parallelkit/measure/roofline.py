"""The roofline: is a computation limited by arithmetic or by memory (or by the network)?

A device does at most ``peak`` FLOPs per second and moves at most ``bandwidth`` bytes
per second between its memory and its arithmetic units. A computation that does ``F``
FLOPs on ``B`` bytes has an arithmetic intensity ``I = F / B`` (FLOPs per byte); it
cannot go faster than ``min(peak, I x bandwidth)``. Below the ridge ``I = peak /
bandwidth`` it is memory-bound (faster memory would help, more FLOP/s would not); above
it, compute-bound. Williams, Waterman and Patterson, "Roofline: An Insightful Visual
Performance Model for Multicore Architectures" (CACM, 2009).

The same reasoning with the network in place of memory tells when data parallelism
keeps its devices busy: :func:`data_parallel_min_batch`.

Every function here is pure arithmetic on numbers you pass: measured ceilings
(``ceilings``), published ones (``hardware``) or the compiler's counts (``flops``).
"""

from __future__ import annotations

from dataclasses import dataclass

COMPUTE_BOUND, MEMORY_BOUND = "compute-bound", "memory-bound"


def _positive(**values: float) -> None:
    for name, value in values.items():
        if not value > 0:
            raise ValueError(f"{name}={value!r}: the roofline needs a positive, finite number here.")


def intensity(flops: float, bytes_moved: float) -> float:
    """Arithmetic intensity: FLOPs per byte moved to or from memory.

    >>> intensity(2 * 1024**3, 3 * 4 * 1024**2)  # a 1024^3 float32 matmul: 2n^3 FLOPs on 3n^2 x 4 bytes
    170.66666666666666
    """
    _positive(bytes_moved=bytes_moved)
    return flops / bytes_moved


def ridge(peak_flops: float, bandwidth: float) -> float:
    """The intensity (FLOPs per byte) where the memory slope meets the compute roof.

    >>> ridge(100e12, 2e12)
    50.0
    """
    _positive(peak_flops=peak_flops, bandwidth=bandwidth)
    return peak_flops / bandwidth


def attainable(point_intensity: float, peak_flops: float, bandwidth: float) -> float:
    """The roofline bound: ``min(peak, intensity x bandwidth)`` FLOP/s.

    >>> attainable(10.0, 100e12, 2e12)  # memory-bound: 10 FLOPs/byte x 2 TB/s
    20000000000000.0
    """
    _positive(peak_flops=peak_flops, bandwidth=bandwidth)
    return min(peak_flops, point_intensity * bandwidth)


def regime(point_intensity: float, peak_flops: float, bandwidth: float) -> str:
    """``"memory-bound"`` below the ridge, ``"compute-bound"`` at or above it."""
    return COMPUTE_BOUND if point_intensity >= ridge(peak_flops, bandwidth) else MEMORY_BOUND


def achieved_flops(step_flops: float, step_seconds: float) -> float:
    """FLOP/s a step reached: its FLOPs (from ``flops.flops``) over its measured time."""
    _positive(step_seconds=step_seconds)
    return step_flops / step_seconds


def mfu(step_flops: float, step_seconds: float, peak_flops: float) -> float:
    """Model FLOPs utilisation: achieved FLOP/s over the peak, between 0 and (about) 1.

    Pass FLOPs and peak for the same scope: one device's program and one device's peak,
    or the whole step and the peak times the devices. PaLM's MFU counts the model's
    FLOPs (``dense_training_flops``), not the compiler's, so rematerialised work does not
    raise it.

    >>> mfu(3e12, 0.05, 100e12)  # 60 TFLOP/s achieved of 100
    0.6
    """
    _positive(peak_flops=peak_flops)
    return achieved_flops(step_flops, step_seconds) / peak_flops


@dataclass(frozen=True)
class RooflinePoint:
    """Where a measured step sits on its device's roofline."""

    intensity: float  # FLOPs per byte
    achieved: float  # FLOP/s measured
    bound: float  # FLOP/s the roofline allows at this intensity
    regime: str  # "compute-bound" or "memory-bound"

    @property
    def fraction_of_bound(self) -> float:
        """achieved / bound: how close the step comes to its roof."""
        return self.achieved / self.bound


def place(
    step_flops: float, step_bytes: float, step_seconds: float, peak_flops: float, bandwidth: float
) -> RooflinePoint:
    """A step's point on the roofline from its FLOPs, bytes, measured time and the ceilings.

    >>> p = place(1e9, 1e8, 1e-3, 100e12, 2e12)  # 10 FLOPs/byte, 1 TFLOP/s achieved
    >>> p.regime, p.bound, p.fraction_of_bound
    ('memory-bound', 20000000000000.0, 0.05)
    """
    point = intensity(step_flops, step_bytes)
    return RooflinePoint(
        intensity=point,
        achieved=achieved_flops(step_flops, step_seconds),
        bound=attainable(point, peak_flops, bandwidth),
        regime=regime(point, peak_flops, bandwidth),
    )


def data_parallel_min_batch(
    peak_flops: float, network_bandwidth: float, *, bytes_per_value: float = 2.0, flops_per_param_token: float = 4.0
) -> float:
    """The per-device batch (tokens) above which data parallelism's compute hides its all-reduce.

    Each device holds the ``P`` parameters and runs ``B`` tokens a step. Its backward
    pass does ``4 P B`` FLOPs (two matmuls per weight, 2 FLOPs per multiply-add), taking
    ``4 P B / C`` seconds at ``C`` FLOP/s. The gradient all-reduce, which can overlap
    that backward pass, is a reduce-scatter plus an all-gather: each device sends about
    ``2 x (bytes of the gradients)`` = ``2 x bytes_per_value x P`` bytes, taking
    ``2 bytes_per_value P / W`` seconds at ``W`` bytes/s each way. Compute hides
    communication when

        4 P B / C  >  2 bytes_per_value P / W   <=>   B > (2 bytes_per_value / 4) x C / W

    (with ``flops_per_param_token`` in place of the 4), which for bfloat16 gradients
    (``bytes_per_value=2``) is ``B > C / W``: the JAX scaling
    book's condition for pure data parallelism ("How to Parallelize a Transformer for
    Training", section "Data Parallelism",
    https://jax-ml.github.io/scaling-book/training/). ``P`` cancels: the threshold
    depends on the hardware alone. Set ``flops_per_param_token=6`` when the all-reduce
    can overlap the whole step, ``bytes_per_value=4`` for float32 gradients. A ring over
    ``n`` devices sends ``2 (n - 1) / n`` rather than 2 times the bytes; the condition
    keeps the large-``n`` limit.

    Args:
        peak_flops: ``C``, one device's FLOP/s.
        network_bandwidth: ``W``, one device's bandwidth for the all-reduce, bytes/s each way.
        bytes_per_value: bytes per gradient value (2: bfloat16, 4: float32).
        flops_per_param_token: FLOPs per parameter per token that the all-reduce overlaps.

    >>> round(data_parallel_min_batch(989.5e12, 50e9))  # H100s across nodes, 50 GB/s each way per GPU
    19790
    >>> data_parallel_min_batch(1e12, 1e9, bytes_per_value=4, flops_per_param_token=6)
    1333.3333333333333
    """
    _positive(
        peak_flops=peak_flops,
        network_bandwidth=network_bandwidth,
        bytes_per_value=bytes_per_value,
        flops_per_param_token=flops_per_param_token,
    )
    return (2 * bytes_per_value / flops_per_param_token) * peak_flops / network_bandwidth
