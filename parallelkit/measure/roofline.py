"""The roofline: is a computation bound by arithmetic, memory or the network? Pure arithmetic.

References:
  Williams, Waterman and Patterson, "Roofline: An Insightful Visual Performance Model for Multicore
  Architectures", 2009.
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


def flops_utilisation(step_flops: float, step_seconds: float, peak_flops: float) -> float:
    """FLOPs utilisation: a step's FLOPs per second over a peak, between 0 and (about) 1.

    The figure means what its two inputs mean: say which FLOP count (the compiler's,
    the matrix products by hand, ``6 N``) and which peak (measured, published). Pass
    FLOPs and peak for the same scope: one device's program and one device's peak, or
    the whole step and the peak times the devices. :func:`mfu` is this with PaLM's count
    and a published peak.

    >>> flops_utilisation(3e12, 0.05, 100e12)  # 60 TFLOP/s achieved of 100
    0.6
    """
    _positive(peak_flops=peak_flops)
    return achieved_flops(step_flops, step_seconds) / peak_flops


def mfu(model_flops: float, step_seconds: float, published_peak_flops: float) -> float:
    """Model FLOPs utilisation, as Chowdhery et al. define it ("PaLM", 2022, Appendix B).

    The model's FLOPs per second over the hardware's peak: ``model_flops`` is
    ``flops.dense_training_flops`` (``6 N`` per token, plus attention), not the
    compiler's count, so rematerialised work and the optimizer's update do not raise it;
    ``published_peak_flops`` is the datasheet peak (``hardware.PUBLISHED``), not a measured
    one. With any other count or peak the arithmetic is :func:`flops_utilisation`'s, and
    the figure is not PaLM's MFU.

    >>> mfu(3e12, 0.05, 100e12)  # 60 TFLOP/s of model FLOPs, of a 100 TFLOP/s datasheet peak
    0.6
    """
    return flops_utilisation(model_flops, step_seconds, published_peak_flops)


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
    peak_flops: float,
    link_bytes_per_s_each_way: float,
    *,
    bytes_per_value: float = 2.0,
    flops_per_param_token: float = 4.0,
) -> float:
    """The per-device batch (tokens) above which data parallelism's compute hides its all-reduce.

    ``W`` here is a **link** bandwidth: the bytes one device sends per second (each
    way), as ``hardware.PUBLISHED`` stores it. For a fitted all-reduce bandwidth (an
    algorithm bandwidth, ``ceilings``'s ``allreduce_bandwidth``) use
    :func:`data_parallel_min_batch_from_allreduce`: passed here, it would count the
    all-reduce's bytes twice.

    Each device holds the ``P`` parameters and runs ``B`` tokens a step. Its backward
    pass does ``4 P B`` FLOPs (two matmuls per weight, 2 FLOPs per multiply-add), taking
    ``4 P B / C`` seconds at ``C`` FLOP/s. The gradient all-reduce, which can overlap
    that backward pass, is a reduce-scatter plus an all-gather: each device sends about
    ``2 x (bytes of the gradients)`` = ``2 x bytes_per_value x P`` bytes, taking
    ``2 bytes_per_value P / W`` seconds at ``W`` bytes/s each way. Compute hides
    communication when

        4 P B / C  >  2 bytes_per_value P / W   <=>   B > (2 bytes_per_value / 4) x C / W

    (with ``flops_per_param_token`` in place of the 4), which for bfloat16 gradients
    (``bytes_per_value=2``) is ``B > C / W``. ``P`` cancels: the threshold depends on
    the hardware alone. A ring over ``n`` devices sends ``2 (n - 1) / n`` rather than 2
    times the bytes; the condition keeps the large-``n`` limit. ``bytes_per_value=4``
    is for float32 gradients.

    This is the JAX scaling book's condition for data parallelism ("How to Parallelize a
    Transformer for Training", https://jax-ml.github.io/scaling-book/training/). The book's
    ``W_ici`` is the "bidirectional" bandwidth of one link: both directions of one link,
    which is what a chip sends per second along one torus axis (one direction on each of
    its two links on that axis). That is this ``W`` for a collective along one mesh axis
    (``hardware.Chip.axis_link_bytes_per_s``), with no factor of 2 between them. Fully
    sharded data parallelism (ZeRO-3) has the same threshold when each pass's gathers
    overlap that pass's compute, as the book assumes: the forward pass gathers
    ``bytes_per_value x P`` bytes during ``2 P B`` FLOPs, the backward gathers them again and
    reduce-scatters the gradients, ``2 x bytes_per_value x P`` bytes during ``4 P B`` FLOPs:
    the ratio of this all-reduce to the backward pass in both.

    Args:
        peak_flops: ``C``, one device's FLOP/s.
        link_bytes_per_s_each_way: ``W``, the link bandwidth above (``hardware.PUBLISHED[...].link_bytes_per_s``).
        bytes_per_value: bytes per gradient value (2: bfloat16, 4: float32).
        flops_per_param_token: FLOPs per parameter per token that the all-reduce overlaps.

    >>> round(data_parallel_min_batch(989.5e12, 50e9))  # H100s across nodes, 50 GB/s each way per GPU
    19790
    >>> data_parallel_min_batch(1e12, 1e9, bytes_per_value=4, flops_per_param_token=6)
    1333.3333333333333
    """
    _positive(
        peak_flops=peak_flops,
        link_bytes_per_s_each_way=link_bytes_per_s_each_way,
        bytes_per_value=bytes_per_value,
        flops_per_param_token=flops_per_param_token,
    )
    return (2 * bytes_per_value / flops_per_param_token) * peak_flops / link_bytes_per_s_each_way


def data_parallel_min_batch_from_allreduce(
    peak_flops: float,
    allreduce_bandwidth: float,
    *,
    latency: float = 0.0,
    parameters: float | None = None,
    bytes_per_value: float = 2.0,
    flops_per_param_token: float = 4.0,
) -> float:
    """The per-device batch above which compute hides an all-reduce of measured cost.

    ``allreduce_bandwidth`` is an **algorithm** bandwidth: the bytes each device
    contributes to the all-reduce over the seconds it takes, ``1 / beta`` of the fit
    ``t = alpha + beta x bytes`` that ``ceilings.measure_ceilings`` makes
    (``allreduce_bandwidth`` and ``allreduce_latency``). An all-reduce of the ``P x
    bytes_per_value`` bytes of gradients then takes ``alpha + bytes_per_value P / W``
    seconds, and ``flops_per_param_token x P x B / C`` seconds of compute hide it when

        B > (C / flops_per_param_token) x (bytes_per_value / W + alpha / P).

    ``alpha = latency``; left at 0, the threshold is the large-model limit, where ``P`` cancels.
    A ring sends about twice the buffer each way, so a link of ``W_link`` bytes/s each
    way gives about ``W_link / 2`` of algorithm bandwidth: this function at ``W_link / 2``
    is :func:`data_parallel_min_batch` at ``W_link``. The fit is of one all-reduce; a step
    that reduces its gradient arrays one by one pays ``alpha`` for each.

    Args:
        allreduce_bandwidth: ``W``, bytes per device over seconds (``1 / beta``).
        latency: ``alpha``, seconds; needs ``parameters`` when above 0.
        parameters: ``P``, the gradient's values.
        peak_flops, bytes_per_value, flops_per_param_token: as for :func:`data_parallel_min_batch`.

    >>> data_parallel_min_batch_from_allreduce(1e11, 2e9, bytes_per_value=4)  # (C / 4) x 4 / W
    50.0
    >>> data_parallel_min_batch_from_allreduce(1e11, 2e9, latency=20e-6, parameters=1e6, bytes_per_value=4)
    50.5
    """
    _positive(
        peak_flops=peak_flops,
        allreduce_bandwidth=allreduce_bandwidth,
        bytes_per_value=bytes_per_value,
        flops_per_param_token=flops_per_param_token,
    )
    if not latency >= 0:
        raise ValueError(f"latency={latency!r}: the all-reduce's fitted alpha, in seconds, >= 0.")
    per_parameter = bytes_per_value / allreduce_bandwidth
    if latency > 0:
        if parameters is None:
            raise ValueError(f"latency={latency!r} needs parameters=P: the latency is paid once for all P values.")
        _positive(parameters=parameters)
        per_parameter += latency / parameters
    return peak_flops / flops_per_param_token * per_parameter
