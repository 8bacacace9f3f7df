"""What a step needs (:class:`Workload`), what a pattern is (:class:`Pattern`), and what the model predicts."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from .links import Cluster


@dataclass(frozen=True)
class Workload:
    """What one training step needs, per device.

    Compute comes from FLOPs: ``flops_per_sample`` (one sample's forward and backward on one
    device, e.g. a single-device step's ``pk.inspect.flops(...).flops`` over its batch) at
    ``efficiency x peak_flops`` FLOP/s, with ``peak_flops`` measured (``pk.measure_ceilings()``'s
    ``matmul_f32.value``) or published (``hardware.PUBLISHED[...].bf16_flops``) and
    ``efficiency`` the share of it a step reaches: its FLOPs utilisation
    (``roofline.flops_utilisation``) by the count given as ``flops_per_sample`` and the
    peak given as ``peak_flops``; 1.0, the default, assumes the peak. It is PaLM's MFU
    (``roofline.mfu``) only for the model's FLOPs (``flops.dense_training_flops``) over a
    published peak. A compiled step's count includes its optimizer update, which divided by the
    batch becomes part of each sample's FLOPs. ``seconds_per_sample``, when given,
    overrides the FLOPs: a measured or assumed time.

    >>> Workload(4e6, batch_per_device=32, flops_per_sample=2e9, peak_flops=100e12, efficiency=0.4).compute_s
    0.0016
    >>> Workload(4e6, 1e-3, 32, flops_per_sample=2e9, peak_flops=100e12).compute_s  # the override wins
    0.032
    """

    param_bytes: float  # P: the gradient has as many bytes
    seconds_per_sample: float | None = None  # forward and backward of one sample on one device; overrides FLOPs
    batch_per_device: int = 0  # samples each device takes per step (required: >= 1)
    overlap: float = 0.0  # the fraction of compute during which gradient communication can already run
    name: str = ""
    # bytes per sample of each all-reduce tensor parallelism makes in one step (forward and
    # backward): for the kit's MLP, ``megatron_mlp_allreduces(1, widths)`` x the item size
    activation_allreduces: tuple[float, ...] = ()
    boundary_bytes: float = 0.0  # bytes per sample of the activation a pipeline stage sends the next
    # bytes per sample of each all-to-all expert parallelism makes in one step (forward and backward):
    # the dispatched slots a device holds, pk.experts.dispatch_bytes over the samples of its group
    all_to_alls: tuple[float, ...] = ()
    expert_bytes: float = 0.0  # the part of param_bytes that is expert weights (split over the expert axis)
    flops_per_sample: float | None = None  # one sample's forward and backward, the whole model on one device
    peak_flops: float | None = None  # one device's FLOP/s: measured (ceilings) or published (hardware)
    efficiency: float = 1.0  # FLOPs utilisation: flops_per_sample's FLOP/s reached over peak_flops, in (0, 1]
    # splitting the sequence (parallelkit.measure.costmodel.sequence): one sample's (length, dim) activation in
    # bytes (the size of its keys, or values, in one layer), and the attention layers
    sequence_bytes: float = 0.0
    layers: int = 0

    def __post_init__(self) -> None:
        if not 0.0 <= self.overlap <= 1.0:
            raise ValueError(f"Workload(overlap={self.overlap}): a fraction between 0 and 1.")
        if not self.batch_per_device >= 1:
            raise ValueError(f"Workload(batch_per_device={self.batch_per_device!r}): the samples a device takes, >= 1.")
        if self.param_bytes < 0 or (self.seconds_per_sample is not None and self.seconds_per_sample < 0):
            raise ValueError("Workload: param_bytes and seconds_per_sample >= 0, batch_per_device >= 1.")
        if self.boundary_bytes < 0 or any(b < 0 for b in (*self.activation_allreduces, *self.all_to_alls)):
            raise ValueError("Workload: activation_allreduces, all_to_alls and boundary_bytes are byte counts >= 0.")
        if not 0 <= self.expert_bytes <= self.param_bytes:
            raise ValueError(
                f"Workload(expert_bytes={self.expert_bytes!r}): the expert weights' share of param_bytes="
                f"{self.param_bytes!r}, between 0 and param_bytes."
            )
        if self.sequence_bytes < 0 or not (isinstance(self.layers, int) and self.layers >= 0):
            raise ValueError("Workload: sequence_bytes is a byte count >= 0 and layers a whole number >= 0.")
        if not 0.0 < self.efficiency <= 1.0:
            raise ValueError(f"Workload(efficiency={self.efficiency}): the share of the peak reached, in (0, 1].")
        if self.seconds_per_sample is None and (self.flops_per_sample is None or self.peak_flops is None):
            raise ValueError(
                "Workload needs its compute: give flops_per_sample and peak_flops (e.g. pk.inspect.flops(...) over "
                "the batch, and pk.measure_ceilings().matmul_f32.value), or seconds_per_sample."
            )
        if self.seconds_per_sample is None and (self.flops_per_sample < 0 or not self.peak_flops > 0):
            raise ValueError(
                f"Workload(flops_per_sample={self.flops_per_sample}, peak_flops={self.peak_flops}): "
                "FLOPs >= 0 and a peak > 0 FLOP/s."
            )

    @property
    def sample_seconds(self) -> float:
        """One sample's compute on one device: ``seconds_per_sample``, else FLOPs over the FLOP/s reached."""
        if self.seconds_per_sample is not None:
            return self.seconds_per_sample
        return self.flops_per_sample / (self.efficiency * self.peak_flops)

    @property
    def compute_s(self) -> float:
        """One device's compute for one step: ``sample_seconds x batch_per_device``."""
        return self.sample_seconds * self.batch_per_device


@dataclass(frozen=True)
class Prediction:
    """A predicted step: its parts, its throughput, and its efficiency against one device."""

    strategy: str
    devices: int
    compute_s: float
    communication_s: float  # the part not hidden behind compute
    step_s: float
    samples_per_s: float
    efficiency: float  # samples/s over (devices x one device's samples/s): 1.0 is perfect scaling
    idle_s: float = 0.0  # a pipeline's bubble: devices waiting for their neighbours


@dataclass(frozen=True)
class Options:
    """What a pattern's communication depends on beyond the workload and the cluster."""

    allreduce: str  # the all-reduce algorithm of data parallelism
    shards: int  # parameter servers
    model: int  # devices per model-parallel group (stages for a pipeline); 1 for data parallelism
    microbatches: int


@dataclass(frozen=True)
class Pattern:
    """How one step of a family of strategies communicates.

    ``communication(workload, cluster, options)`` returns (gradient seconds, which overlap can
    hide; activation seconds, which it cannot). ``model`` says what ``model=`` means:
    ``"none"`` (data parallelism: no model groups), ``"all"`` (one group of every device),
    ``"given"`` (groups of ``model``, which must be given), ``"any"`` (groups of ``model``,
    every device by default: the expert axis) or ``"stages"`` (pipeline stages, every device
    by default, with the bubble in the step's time).
    """

    communication: Callable[[Workload, Cluster, Options], tuple[float, float]]
    model: str = "none"


KINDS = ("none", "all", "given", "any", "stages")  # what a pattern's model= means (Pattern.model)
