"""Published figures of common accelerators (:data:`PUBLISHED`), every figure with its source."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Chip:
    """One accelerator's published peaks, per chip (per GPU), in SI units (1 GB = 1e9 bytes)."""

    name: str
    bf16_flops: float  # dense bfloat16 FLOP/s
    fp32_flops: float | None  # float32 FLOP/s without tensor cores, None where unpublished
    tf32_flops: float | None  # dense TensorFloat-32 tensor-core FLOP/s, None where unpublished
    fp8_flops: float | None  # dense FP8 tensor FLOP/s, None where the chip has none or its page prints none
    hbm_bytes_per_s: float  # memory bandwidth
    memory_bytes: float  # memory capacity (HBM) as printed, 1 GB = 1e9 bytes; a framework can use a little less
    link_bytes_per_s: float  # inside a node / slice (NVLink, ICI), per direction, all links together
    link_axes: int  # mesh axes the links are split over: 1 through a switch, a torus's dimensions
    network_bytes_per_s: float  # between nodes, per chip, per direction
    link_name: str
    sources: tuple[str, ...]
    note: str

    @property
    def axis_link_bytes_per_s(self) -> float:
        """Bytes/s each way that a collective along one mesh axis gets: ``link_bytes_per_s / link_axes``.

        >>> PUBLISHED["TPU v5p"].axis_link_bytes_per_s / 1e9  # 600 GB/s each way over 3 torus axes
        200.0
        """
        return self.link_bytes_per_s / self.link_axes


PUBLISHED: dict[str, Chip] = {
    "H100 SXM": Chip(
        name="NVIDIA H100 SXM (80 GB)",
        bf16_flops=989.5e12,  # half the printed 1,979 TFLOPS "with sparsity"
        fp32_flops=67e12,
        tf32_flops=494.5e12,  # half the printed 989 TFLOPS "with sparsity"
        fp8_flops=1979e12,  # half the printed 3,958 TFLOPS "with sparsity"
        hbm_bytes_per_s=3.35e12,
        memory_bytes=80e9,
        link_bytes_per_s=450e9,
        link_axes=1,  # every NVLink goes to the NVSwitches: any collective can use all of them
        network_bytes_per_s=50e9,  # one 400 Gb/s ConnectX-7 per GPU in a DGX H100
        link_name="NVLink 4",
        sources=(
            "https://www.nvidia.com/en-us/data-center/h100/",
            "https://docs.nvidia.com/dgx-basepod/reference-architecture-infrastructure-foundation-enterprise-ai/latest/core-components.html",
        ),
        note="NVLink printed as 900 GB/s (both directions); network: 8 x 400 Gb/s InfiniBand per 8-GPU DGX H100.",
    ),
    "A100 SXM 80GB": Chip(
        name="NVIDIA A100 SXM (80 GB)",
        bf16_flops=312e12,  # half the printed 624 TFLOPS "with sparsity"
        fp32_flops=19.5e12,
        tf32_flops=156e12,  # half the printed 312 TFLOPS "with sparsity"
        fp8_flops=None,  # Ampere's tensor cores have no FP8; the datasheet prints none
        hbm_bytes_per_s=2.039e12,
        memory_bytes=80e9,
        link_bytes_per_s=300e9,
        link_axes=1,  # every NVLink goes to the NVSwitches
        network_bytes_per_s=25e9,  # one 200 Gb/s HDR InfiniBand adapter per GPU in a DGX A100
        link_name="NVLink 3",
        sources=(
            "https://www.nvidia.com/content/dam/en-zz/Solutions/Data-Center/a100/pdf/nvidia-a100-datasheet-us-nvidia-1758950-r4-web.pdf",
            "https://developer.nvidia.com/blog/defining-ai-innovation-with-dgx-a100",
        ),
        note="NVLink printed as 600 GB/s (both directions); network: 8 x 200 Gb/s HDR InfiniBand per DGX A100.",
    ),
    "TPU v5e": Chip(
        name="Google Cloud TPU v5e",
        bf16_flops=197e12,
        fp32_flops=None,
        tf32_flops=None,
        fp8_flops=None,  # the page prints bf16 and Int8 (393 TOPs) peaks, no FP8
        hbm_bytes_per_s=819e9,
        memory_bytes=16e9,
        link_bytes_per_s=200e9,
        link_axes=2,  # 2D torus, 4 ICI ports: 2 per axis
        network_bytes_per_s=3.125e9,  # 2 x 100 Gb/s per host, 8 chips per host
        link_name="ICI",
        sources=("https://cloud.google.com/tpu/docs/v5e",),
        note="ICI printed as 400 GB/s bidirectional per chip (2D torus); DCN: 2 x 100 Gb/s NICs per 8-chip host.",
    ),
    "TPU v5p": Chip(
        name="Google Cloud TPU v5p",
        bf16_flops=459e12,
        fp32_flops=None,
        tf32_flops=None,
        fp8_flops=459e12,  # printed as 459 TFLOPs "(FP8)", the bf16 figure: no faster than bf16
        hbm_bytes_per_s=2765e9,
        memory_bytes=95e9,
        link_bytes_per_s=600e9,
        link_axes=3,  # 3D torus: 6 neighbours, 2 per axis
        network_bytes_per_s=6.25e9,  # 50 Gb/s data-center network per chip
        link_name="ICI",
        sources=("https://cloud.google.com/tpu/docs/v5p", "https://cloud.google.com/tpu/docs/v5p-training"),
        note="ICI printed as 1,200 GB/s bidirectional per chip (3D torus); DCN printed as 50 Gb/s per chip; the FP8 "
        "peak from the v5p-training page's table.",
    ),
    "TPU v6e": Chip(
        name="Google Cloud TPU v6e",
        bf16_flops=918e12,
        fp32_flops=None,
        tf32_flops=None,
        fp8_flops=None,  # the page prints bf16 and Int8 (1,836 TOPs) peaks, no FP8
        hbm_bytes_per_s=1638e9,
        memory_bytes=32e9,
        link_bytes_per_s=400e9,
        link_axes=2,  # 2D torus, 4 ICI ports: 2 per axis
        network_bytes_per_s=12.5e9,  # 4 x 200 Gb/s per host, 8 chips per host
        link_name="ICI",
        sources=("https://docs.cloud.google.com/tpu/docs/v6e.md.txt", "https://cloud.google.com/tpu/docs/v6e"),
        note="Trillium. ICI printed as 800 GB/s bidirectional per chip on a 2D torus (versions of the page print "
        "3,200 and 3,584 Gbps); HBM bandwidth printed as 1,638 GBps (versions print 1,600 and 1,640); DCN: 4 x 200 "
        "Gbps NICs per 8-chip host.",
    ),
    "B200": Chip(
        name="NVIDIA B200 (180 GB)",
        bf16_flops=2250e12,  # half the 4,500 TFLOPS "sparse" of the HGX B200 (1,000 W)
        fp32_flops=80e12,
        tf32_flops=1100e12,  # half the 2,200 TFLOPS "sparse"
        fp8_flops=4500e12,  # half the 9,000 TFLOPS "sparse"
        hbm_bytes_per_s=8e12,
        memory_bytes=180e9,
        link_bytes_per_s=900e9,
        link_axes=1,  # every NVLink goes to the NVSwitches: any collective can use all of them
        network_bytes_per_s=50e9,  # one 400 Gb/s ConnectX-7 per GPU in an 8 x B200 machine
        link_name="NVLink 5",
        sources=(
            "https://glennklockwood.com/garden/processors/B200",
            "https://github.com/mlcommons/inference_results_v6.0/blob/main/closed/Nebius/systems/nebius_b200_n1.json",
        ),
        note="HGX B200 at 1,000 W: NVIDIA's dense and sparse figures as G. Klockwood reprints them (the GB200's "
        "B200 at 1,200 W is faster: 2,500 TFLOPS bf16 dense). Memory 180 GB (B200-SXM-180GB; 192 GB is the "
        "package's HBM) at 8 TB/s; NVLink 5 printed as 14.4 TB/s for 8 GPUs (1.8 TB/s a GPU, both directions); "
        "network: 8 x 400 Gb/s ConnectX-7 NDR InfiniBand per 8-GPU machine (MLPerf Inference v6.0 system "
        "description).",
    ),
}


def table() -> str:
    """The published figures as aligned text, one chip a line (TFLOP/s and GB/s).

    >>> print(table().splitlines()[0])  # doctest: +NORMALIZE_WHITESPACE
    chip fp8 TFLOP/s  bf16 TFLOP/s  tf32 TFLOP/s  fp32 TFLOP/s  HBM GB/s  link GB/s (each way)
    network GB/s (per chip)
    """
    flops = "  ".join(f"{name + ' TFLOP/s':>12}" for name in ("fp8", "bf16", "tf32", "fp32"))
    head = f"{'chip':<24} {flops}  {'HBM GB/s':>8}  {'link GB/s (each way)':>20}"
    lines = [head + f"  {'network GB/s (per chip)':>23}"]
    for chip in PUBLISHED.values():
        fp8, tf32, fp32 = ("-" if x is None else f"{x / 1e12:g}" for x in (chip.fp8_flops, chip.tf32_flops,
                                                                           chip.fp32_flops))  # fmt: skip
        lines.append(
            f"{chip.name:<24} {fp8:>12}  {chip.bf16_flops / 1e12:>12g}  {tf32:>12}  {fp32:>12}  "
            f"{chip.hbm_bytes_per_s / 1e9:>8g}  "
            f"{chip.link_bytes_per_s / 1e9:>20g}  {chip.network_bytes_per_s / 1e9:>23g}"
        )
    return "\n".join(lines)
