"""Published figures of common accelerators (:data:`PUBLISHED`), every figure with its source (the few no datasheet
prints are assumptions, each said so in its chip's note)."""

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
    link_domain: int | None = None  # the most devices the links join (an NVLink bridge: 2); None: a machine's worth

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
        bf16_flops=2250e12,  # half the printed 4.5 PFLOPS "with sparsity" of an HGX B200's GPU (1,000 W)
        fp32_flops=75e12,
        tf32_flops=1100e12,  # half the printed 2.2 PFLOPS with sparsity
        fp8_flops=4500e12,  # half the printed 9 PFLOPS with sparsity
        hbm_bytes_per_s=7.7e12,
        memory_bytes=180e9,
        link_bytes_per_s=900e9,
        link_axes=1,  # every NVLink goes to the NVSwitches: any collective can use all of them
        network_bytes_per_s=50e9,  # one 400 Gb/s ConnectX-7 per GPU in an 8 x B200 machine
        link_name="NVLink 5",
        sources=(
            "https://www.nvidia.com/en-us/data-center/hgx/",
            "https://github.com/pytorch/ao/pull/4002",
            "https://github.com/mlcommons/inference_results_v6.0/blob/main/closed/Nebius/systems/nebius_b200_n1.json",
        ),
        note="HGX B200 at 1,000 W, NVIDIA's per-GPU column (the GB200's B200 at 1,200 W is faster: 2.5 PFLOPS bf16 "
        "dense); its tensor-core peaks are printed with sparsity: dense is half. Memory 180 GB HBM3e at 7.7 TB/s "
        "(192 GB is the package's HBM; 7.7 TB/s is also what the driver's 7,680-bit bus at 3,996 MHz gives, "
        "pytorch/ao PR 4002, where earlier pages printed 8 TB/s); NVLink 5 printed as 1.8 TB/s a GPU (both "
        "directions), 14.4 TB/s for 8; network: 8 x 400 Gb/s ConnectX-7 NDR InfiniBand per 8-GPU machine (MLPerf "
        "Inference v6.0 system description).",
    ),
    "H800 SXM": Chip(
        name="NVIDIA H800 SXM (80 GB)",
        bf16_flops=989.5e12,  # half the printed 1,979 TFLOPS "with sparsity": the H100 SXM's compute
        fp32_flops=67e12,
        tf32_flops=494.5e12,  # half the printed 989 TFLOPS with sparsity
        fp8_flops=1979e12,  # half the printed 3,958 TFLOPS with sparsity
        hbm_bytes_per_s=3.35e12,
        memory_bytes=80e9,
        link_bytes_per_s=200e9,  # NVLink printed as 400 GB/s (both directions): 4/9 of the H100 SXM's 900
        link_axes=1,  # every NVLink goes to the NVSwitches
        network_bytes_per_s=50e9,  # one 400 Gb/s ConnectX-7 InfiniBand adapter per GPU (DeepSeek's machines)
        link_name="NVLink 4 (400 GB/s)",
        sources=(
            "https://arxiv.org/abs/2505.09343",
            "https://arxiv.org/abs/2412.19437",
            "https://www.nvidia.com/en-us/data-center/h100/",
        ),
        note="The H100 SXM's Hopper chip with its NVLink cut from 900 to 400 GB/s (both directions) and its FP64 "
        "reduced (DeepSeek, arXiv 2505.09343, section 2); its bf16, TF32 and FP8 peaks, memory and HBM bandwidth "
        "are taken as the H100 SXM's page prints them. Network: 8 x 400 Gb/s CX7 InfiniBand per 8-GPU machine "
        "(DeepSeek-V3's cluster, the same paper; arXiv 2412.19437 section 3.2 reports about 160 GB/s of NVLink and "
        "50 GB/s of InfiniBand a GPU reached).",
    ),
    "H100 NVL": Chip(
        name="NVIDIA H100 NVL (94 GB)",
        bf16_flops=835.5e12,  # half the printed 1,671 TFLOPS "with sparsity"
        fp32_flops=60e12,
        tf32_flops=417.5e12,  # half the printed 835 TFLOPS with sparsity
        fp8_flops=1670.5e12,  # half the printed 3,341 TFLOPS with sparsity
        hbm_bytes_per_s=3.9e12,
        memory_bytes=94e9,
        link_bytes_per_s=300e9,  # the NVLink bridge printed as 600 GB/s (both directions)
        link_axes=1,
        network_bytes_per_s=50e9,  # an assumption: one 400 Gb/s adapter per GPU, as in a DGX H100
        link_name="NVLink bridge",
        sources=("https://www.nvidia.com/en-us/data-center/h100/",),
        note="A PCIe card (350-400 W) whose NVLink bridge joins two cards, not a switch: the links join 2 GPUs "
        "(link_domain), and a machine of more pairs reaches its other GPUs over PCIe Gen5 (128 GB/s printed, "
        "both directions) and the network. The network figure is an assumption (the page prints none; servers "
        "hold 1-8 cards): one 400 Gb/s adapter a GPU.",
        link_domain=2,
    ),
    "MI300X": Chip(
        name="AMD Instinct MI300X (192 GB)",
        bf16_flops=1307.4e12,  # printed dense; 2,614.9 TFLOPS with sparsity
        fp32_flops=163.4e12,
        tf32_flops=653.7e12,  # printed dense; 1,307.4 with sparsity
        fp8_flops=2614.9e12,  # printed dense; 5,229.8 with sparsity
        hbm_bytes_per_s=5.3e12,
        memory_bytes=192e9,
        link_bytes_per_s=448e9,  # 7 Infinity Fabric links of 128 GB/s (both directions): 7 x 64 GB/s each way
        link_axes=1,  # an assumption: a collective over the machine's 8 GPUs uses all 7 links (see the note)
        network_bytes_per_s=50e9,  # an assumption: one 400 Gb/s adapter per GPU, as in a DGX H100
        link_name="Infinity Fabric",
        sources=(
            "https://www.amd.com/content/dam/amd/en/documents/instinct-tech-docs/data-sheets/amd-instinct-mi300x-data-sheet.pdf",
            "https://www.amd.com/en/products/accelerators/instinct/mi300/mi300x.html",
            "https://rocm.docs.amd.com/en/latest/conceptual/gpu-arch/mi300.html",
        ),
        note="8 GPUs a machine, each joined to each of the other 7 by one Infinity Fabric link (a full mesh, no "
        "switch): 896 GB/s printed a GPU (both directions). A collective over all 8 can use every link; one over "
        "a smaller group has fewer direct links (2 GPUs share one link), which the planner does not model (it "
        "gives every group the whole 448 GB/s each way). The network figure is an assumption (the datasheet "
        "prints none).",
        link_domain=8,
    ),
}


def table() -> str:
    """The published figures as aligned text, one chip a line (TFLOP/s and GB/s).

    >>> print(table().splitlines()[0])  # doctest: +NORMALIZE_WHITESPACE
    chip fp8 TFLOP/s  bf16 TFLOP/s  tf32 TFLOP/s  fp32 TFLOP/s  HBM GB/s  link GB/s (each way)
    network GB/s (per chip)
    """
    flops = "  ".join(f"{name + ' TFLOP/s':>12}" for name in ("fp8", "bf16", "tf32", "fp32"))
    wide = max(len(chip.name) for chip in PUBLISHED.values())
    head = f"{'chip':<{wide}} {flops}  {'HBM GB/s':>8}  {'link GB/s (each way)':>20}"
    lines = [head + f"  {'network GB/s (per chip)':>23}"]
    for chip in PUBLISHED.values():
        fp8, tf32, fp32 = ("-" if x is None else f"{x / 1e12:g}" for x in (chip.fp8_flops, chip.tf32_flops,
                                                                           chip.fp32_flops))  # fmt: skip
        lines.append(
            f"{chip.name:<{wide}} {fp8:>12}  {chip.bf16_flops / 1e12:>12g}  {tf32:>12}  {fp32:>12}  "
            f"{chip.hbm_bytes_per_s / 1e9:>8g}  "
            f"{chip.link_bytes_per_s / 1e9:>20g}  {chip.network_bytes_per_s / 1e9:>23g}"
        )
    return "\n".join(lines)
