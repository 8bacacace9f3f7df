"""Published figures of common accelerators: what the vendors print, kept apart from what we measure.

One table, :data:`PUBLISHED`, one row per chip, each figure with its source. These are
datasheet peaks: real programs reach a fraction of them (``ceilings`` measures the
machine you are on; ``roofline.mfu`` says what fraction a step reached).

How to read them:

- **Dense, not sparse.** NVIDIA prints tensor-core FLOP/s "with sparsity" (2:4
  structured sparsity, half the weights zero) beside the dense figure, twice as large.
  Training dense models gets the dense figure, the one in this table.
- **fp32** is the plain float32 (non-tensor-core) rate; the TPU pages publish none
  (``None``): the matrix units take bfloat16 inputs.
- **Links per direction.** Vendors print NVLink and ICI bandwidth summed over both
  directions; a collective's bytes flow both ways at once, each way at half that. The
  table stores the per-direction figure, the printed one in the note. It is the chip's
  total over all its links: through an NVLink switch one GPU can use all of it, while
  on a TPU torus a collective along one mesh axis uses only that axis's links.
- **Network per chip.** The inter-node figure is the network bandwidth one chip gets
  when every chip talks at once: a DGX H100 has one 400 Gb/s adapter per GPU, a TPU
  v5e host two 100 Gb/s NICs for its 8 chips.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Chip:
    """One accelerator's published peaks, per chip (per GPU), in SI units (1 GB = 1e9 bytes)."""

    name: str
    bf16_flops: float  # dense bfloat16 FLOP/s
    fp32_flops: float | None  # float32 FLOP/s, None where unpublished
    hbm_bytes_per_s: float  # memory bandwidth
    link_bytes_per_s: float  # inside a node / slice (NVLink, ICI), per direction
    network_bytes_per_s: float  # between nodes, per chip, per direction
    link_name: str
    sources: tuple[str, ...]
    note: str


PUBLISHED: dict[str, Chip] = {
    "H100 SXM": Chip(
        name="NVIDIA H100 SXM (80 GB)",
        bf16_flops=989.5e12,  # half the printed 1,979 TFLOPS "with sparsity"
        fp32_flops=67e12,
        hbm_bytes_per_s=3.35e12,
        link_bytes_per_s=450e9,
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
        hbm_bytes_per_s=2.039e12,
        link_bytes_per_s=300e9,
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
        hbm_bytes_per_s=819e9,
        link_bytes_per_s=200e9,
        network_bytes_per_s=3.125e9,  # 2 x 100 Gb/s per host, 8 chips per host
        link_name="ICI",
        sources=("https://cloud.google.com/tpu/docs/v5e",),
        note="ICI printed as 400 GB/s bidirectional per chip (2D torus); DCN: 2 x 100 Gb/s NICs per 8-chip host.",
    ),
    "TPU v5p": Chip(
        name="Google Cloud TPU v5p",
        bf16_flops=459e12,
        fp32_flops=None,
        hbm_bytes_per_s=2765e9,
        link_bytes_per_s=600e9,
        network_bytes_per_s=6.25e9,  # 50 Gb/s data-center network per chip
        link_name="ICI",
        sources=("https://cloud.google.com/tpu/docs/v5p",),
        note="ICI printed as 1,200 GB/s bidirectional per chip (3D torus); DCN printed as 50 Gb/s per chip.",
    ),
}


def table() -> str:
    """The published figures as aligned text, one chip a line (TFLOP/s and GB/s).

    >>> print(table().splitlines()[0])
    chip                     bf16 TFLOP/s  fp32 TFLOP/s  HBM GB/s  link GB/s (each way)  network GB/s (per chip)
    """
    head = f"{'chip':<24} {'bf16 TFLOP/s':>12}  {'fp32 TFLOP/s':>12}  {'HBM GB/s':>8}  {'link GB/s (each way)':>20}"
    lines = [head + f"  {'network GB/s (per chip)':>23}"]
    for chip in PUBLISHED.values():
        fp32 = "-" if chip.fp32_flops is None else f"{chip.fp32_flops / 1e12:g}"
        lines.append(
            f"{chip.name:<24} {chip.bf16_flops / 1e12:>12g}  {fp32:>12}  {chip.hbm_bytes_per_s / 1e9:>8g}  "
            f"{chip.link_bytes_per_s / 1e9:>20g}  {chip.network_bytes_per_s / 1e9:>23g}"
        )
    return "\n".join(lines)
