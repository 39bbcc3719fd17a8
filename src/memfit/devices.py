"""Device specs: capacity, allocator behaviour, dtype support and peak throughput.

``cpu`` is the machine at hand (capacity read from the OS). GPU presets describe a card as
PyTorch sees it: ``total_bytes`` is ``torch.cuda.get_device_properties().total_memory`` on that
card, the CUDA context and cuBLAS workspace are memory outside (context) or inside (workspace)
PyTorch's allocator count, and allocations go through the CUDA caching allocator model in
``memfit.memory.allocator``. Throughput figures are the vendor's dense peaks, which the
planner's op-level time model (memfit.planner.timing) scales by achieved fractions fitted on an H100;
they are not measurements.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field

from memfit.errors import UserError

GiB = 1024**3
MiB = 1024**2


@dataclass(frozen=True)
class Device:
    name: str
    kind: str
    """'cpu' or 'cuda': the torch device type the step is traced on."""
    total_bytes: int
    """Memory capacity as PyTorch reports it."""
    bf16: bool
    fp16: bool
    allocator: str
    """'cpu' (every tensor is its own malloc) or 'cuda-caching' (PyTorch's CUDA caching allocator)."""
    context_bytes: int = 0
    """CUDA context and kernels: outside PyTorch's allocator, inside the card's memory."""
    workspace_bytes: int = 0
    """cuBLAS workspace, allocated through the caching allocator by the first cuBLAS call of each
    thread (and stream) that runs matmuls (see memfit.memory.cuda.blas)."""
    lt_workspace_bytes: int = 0
    """cuBLASLt workspace, allocated by the first cuBLASLt matmul (addmm with a fused bias) of each
    thread."""
    compute_capability: tuple[int, int] | None = None
    """CUDA compute capability (major, minor): decides the kernels PyTorch picks (flash attention
    needs sm80+, cuDNN attention is preferred on sm90/sm100, ...)."""
    sm_count: int = 0
    """Streaming multiprocessors: sizes the grid of CUDA reductions and their global buffers."""
    cuda_version: tuple[int, int] | None = None
    """CUDA runtime of the PyTorch build assumed for the card (the wheels' default)."""
    cudnn_version: int = 0
    """cuDNN runtime version as torch.backends.cudnn.version() reports it (e.g. 91900 for 9.19)."""
    peak_flops: dict = field(default_factory=dict)
    """Dense peak FLOP/s per dtype name (float32 counts TF32 tensor cores where the card has them)."""
    mem_bandwidth: float = 0.0
    """Device memory bandwidth, bytes/s."""
    host_link_bandwidth: float = 0.0
    """Host <-> device bandwidth, bytes/s (PCIe), for offload."""
    interconnect_bandwidth: float = 0.0
    """Bandwidth to the other GPUs of the node, per GPU and direction, bytes/s: NVLink on the SXM
    cards (the specification sheets' figure: H100/H200 450 GB/s, A100 300, V100 150), otherwise the
    PCIe link (peer traffic through the host). Prices sharding's collectives; no multi-GPU run was
    measured, so it is the nominal figure."""

    @property
    def is_gpu(self) -> bool:
        return self.kind == "cuda"

    @property
    def is_local_gpu(self) -> bool:
        """The GPU of this machine (:func:`local_cuda_device`, named ``cuda (<card>)``), not a preset."""
        return self.name.startswith("cuda")

    def usable_bytes(self) -> int:
        """Capacity left to PyTorch's allocator after the CUDA context."""
        return self.total_bytes - self.context_bytes


def architecture(device: Device) -> tuple:
    """What a fake trace of a step on ``device`` depends on besides the step itself: the kernels CUDA
    picks (compute capability, CUDA and cuDNN versions), the dtypes, the allocator and its library
    workspaces. Not the capacity, the context (added to a trace's figure), nor the speeds: cards
    alike in these share their traces (``memfit fit``). The SM count is left out too: it sizes only
    the staging buffers of some reductions, held within one kernel (memfit.memory.cuda.reduce; an RMSNorm
    weight's gradient at batch 2 x 2048 on Llama-2-7B sizes holds 128 MiB on an H100), and ``memfit fit``
    sizes those for each card (memfit.planner.fit_books.OnCard)."""
    return (device.kind, device.allocator, device.bf16, device.fp16, device.compute_capability, device.cuda_version,
            device.cudnn_version, device.workspace_bytes, device.lt_workspace_bytes)


def cublas_workspace_bytes(capability: tuple[int, int]) -> int:
    """PyTorch's default cuBLAS workspace per handle and stream (CublasHandlePool.cpp, no
    CUBLAS_WORKSPACE_CONFIG): 32 MiB on Hopper and newer, 4096 KiB * 2 + 16 KiB * 8 before."""
    return 32 * MiB if capability[0] >= 9 else 4096 * 1024 * 2 + 16 * 1024 * 8


def _gpu(name, total, ctx_mib, capability, sms, bf16, fp16_tflops, bf16_tflops, fp32_tflops, bw_gbs, link_gbs,
         nvlink_gbs=0, cuda=(13, 0), cudnn=91900):
    flops = {"float16": fp16_tflops * 1e12, "float32": fp32_tflops * 1e12}
    if bf16:
        flops["bfloat16"] = bf16_tflops * 1e12
    return Device(name=name, kind="cuda", total_bytes=total, bf16=bf16, fp16=True, allocator="cuda-caching",
                  context_bytes=ctx_mib * MiB, workspace_bytes=cublas_workspace_bytes(capability),
                  lt_workspace_bytes=1 * MiB, compute_capability=capability, sm_count=sms,
                  cuda_version=cuda, cudnn_version=cudnn, peak_flops=flops,
                  mem_bandwidth=bw_gbs * 1e9, host_link_bandwidth=link_gbs * 1e9,
                  interconnect_bandwidth=(nvlink_gbs or link_gbs) * 1e9)


def typical_total(smi_mib: int) -> int:
    """The ``total_memory`` torch typically reports for a card whose ``nvidia-smi`` total is
    ``smi_mib``: 98.5% of it (the driver and firmware keep the rest; the 24 GB presets' figures,
    read on those cards, are 97.6-98.7%), in whole MiB. A typical value, not a reading."""
    return int(smi_mib * 0.985) * MiB


# total_memory as torch.cuda.get_device_properties reports it; context sizes are typical with
# lazy module loading (CUDA >= 11.7). The H100 and H200 figures (total, 527 MiB context) were read
# on those cards (tests/data/h100.jsonl, h200.jsonl, driver 580). Software: the PyTorch wheels'
# CUDA 13.0 with cuDNN 9.19 (as measured there); CUDA 13 dropped Volta, so the V100 gets the CUDA
# 12.8 wheels' cuDNN 9.10.
#
# The 8 to 48 GB consumer and workstation cards (below the V100) were read on none: their totals are
# ``typical_total`` of the nvidia-smi figure, their CUDA contexts typical values that grow with the SM
# count as the read ones do (300 MiB at 24 SMs to 450 MiB at 170), and the rest is the vendor's
# specification sheet: SMs, boost clock x tensor FLOPs per SM and clock for the dense fp16/bf16 peak
# with fp32 accumulation (GeForce cards run it at half their fp16-accumulate rate, the RTX A6000 and
# L40S at the full rate), TF32 dense for float32, GDDR bandwidth, and the PCIe link at about 78% of
# its nominal rate (x8 Gen4 on the RTX 4060 and 4060 Ti, x16 Gen5 on the RTX 5090, x16 Gen4 on the
# rest). Ada cards are sm89, GA10x sm86, the RTX 5090 sm120.
GPU_PRESETS: dict[str, Device] = {d.name: d for d in (
    _gpu("h100-80gb", 85_017_493_504, 527, (9, 0), 132, True, 989, 989, 494, 3350, 55, 450),
    _gpu("h200-141gb", 150_109_880_320, 527, (9, 0), 132, True, 989, 989, 494, 4800, 55, 450),
    _gpu("a100-80gb", 85_198_045_184, 420, (8, 0), 108, True, 312, 312, 156, 2039, 25, 300),
    _gpu("a100-40gb", 42_505_273_344, 420, (8, 0), 108, True, 312, 312, 156, 1555, 25, 300),
    _gpu("l4", 23_580_639_232, 380, (8, 9), 58, True, 121, 121, 60, 300, 25),
    _gpu("rtx4090", 25_386_352_640, 400, (8, 9), 128, True, 165, 165, 82.6, 1008, 25),
    _gpu("rtx3090", 25_447_170_048, 400, (8, 6), 82, True, 71, 71, 35.6, 936, 25),
    _gpu("t4", 15_835_398_144, 310, (7, 5), 40, False, 65, 0, 8.1, 320, 12),
    _gpu("v100-16gb", 16_945_512_448, 330, (7, 0), 80, False, 125, 0, 15.7, 900, 12, 150, cuda=(12, 8), cudnn=91002),
    _gpu("rtx4060", typical_total(8188), 300, (8, 9), 24, True, 30.2, 30.2, 15.1, 272, 12.5),
    _gpu("rtx3070", typical_total(8192), 320, (8, 6), 46, True, 40.6, 40.6, 20.3, 448, 25),
    _gpu("rtx3060-12gb", typical_total(12288), 300, (8, 6), 28, True, 25.5, 25.5, 12.7, 360, 25),
    _gpu("rtx4070", typical_total(12282), 330, (8, 9), 46, True, 58.3, 58.3, 29.1, 504, 25),
    _gpu("rtx4060ti-16gb", typical_total(16380), 310, (8, 9), 34, True, 44.1, 44.1, 22.1, 288, 12.5),
    _gpu("rtx4080", typical_total(16376), 370, (8, 9), 76, True, 97.5, 97.5, 48.7, 717, 25),
    _gpu("rtx5090", typical_total(32607), 450, (12, 0), 170, True, 209.5, 209.5, 104.8, 1792, 55),
    _gpu("rtxa6000", typical_total(49140), 400, (8, 6), 84, True, 154.8, 154.8, 77.4, 768, 25),
    _gpu("l40s", typical_total(46068), 420, (8, 9), 142, True, 362, 362, 183, 864, 25),
)}

ALIASES = {"h100": "h100-80gb", "h200": "h200-141gb", "a100": "a100-80gb", "4090": "rtx4090", "3090": "rtx3090",
           "v100": "v100-16gb", "4060": "rtx4060", "3070": "rtx3070", "3060": "rtx3060-12gb",
           "rtx3060": "rtx3060-12gb", "4070": "rtx4070", "4060ti": "rtx4060ti-16gb", "rtx4060ti": "rtx4060ti-16gb",
           "4080": "rtx4080", "5090": "rtx5090", "a6000": "rtxa6000", "rtx-a6000": "rtxa6000"}


def cpu_device() -> Device:
    """The machine at hand, as the CPU allocator sees it."""
    return Device(name="cpu", kind="cpu", total_bytes=host_total_bytes(), bf16=True, fp16=True, allocator="cpu")


def host_total_bytes() -> int:
    """This machine's physical memory (16 GiB when unknown)."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 16 * GiB


def available_host_bytes() -> int:
    """Memory this machine can still give (``MemAvailable``; 4 GiB when unknown)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 4 * GiB


# NOTE [ GPU presets without a GPU ]
# PyTorch's autograd engine cannot run backward on fake CUDA tensors without a CUDA driver
# (pytorch#92627), so a GPU preset is traced on fake CPU tensors here: the CUDA kernel model
# (memfit.memory.cuda) makes the trace take CUDA's kernel choices, and the caching-allocator model
# replays it.
def tensor_device(device: Device) -> str:
    """Where a step's tensors live: ``cpu`` for a GPU preset without a GPU here (NOTE [ GPU presets
    without a GPU ])."""
    import torch
    if device.kind == "cuda" and not torch.cuda.is_available():
        return "cpu"
    return device.kind


def preset_for_card(card: str, total_memory: int | None = None) -> str:
    """The preset whose name a CUDA card's name (``torch.cuda.get_device_name``) matches; an A100
    40GB's when none does. ``total_memory`` tells the A100's two sizes apart (80GB when unknown)."""
    a100 = "a100-40gb" if total_memory is not None and total_memory <= 60 * GiB else "a100-80gb"
    hints = {"h100": "h100-80gb", "h200": "h200-141gb", "a100": a100, "l40s": "l40s", "l4": "l4", "4090": "rtx4090",
             "3090": "rtx3090", "t4": "t4", "v100": "v100-16gb", "4060 ti": "rtx4060ti-16gb", "4060": "rtx4060",
             "3070": "rtx3070", "3060": "rtx3060-12gb", "4070": "rtx4070", "4080": "rtx4080", "5090": "rtx5090",
             "a6000": "rtxa6000"}
    return next((v for k, v in hints.items() if k in card.lower()), "a100-40gb")


def local_cuda_device() -> Device:
    """The GPU this process would train on: its real capacity, with the speed figures of the preset
    whose name it matches (an A100 40GB's when none does)."""
    import torch
    if not torch.cuda.is_available():
        raise UserError("device cuda: no CUDA GPU is visible to PyTorch here; use --device cpu, or a GPU preset "
                        "name to plan for a card you do not have")
    props = torch.cuda.get_device_properties(torch.cuda.current_device())
    preset = GPU_PRESETS[preset_for_card(props.name, props.total_memory)]
    capability = (props.major, props.minor)
    cuda = tuple(int(x) for x in (torch.version.cuda or "12.0").split(".")[:2])
    return dataclasses.replace(preset, name=f"cuda ({props.name})", total_bytes=props.total_memory,
                               bf16=torch.cuda.is_bf16_supported(), compute_capability=capability,
                               sm_count=props.multi_processor_count, workspace_bytes=cublas_workspace_bytes(capability),
                               cuda_version=cuda, cudnn_version=torch.backends.cudnn.version() or 0)


def get_device(name: str | Device | None) -> Device:
    """Look a device up by name: 'cpu', 'cuda' (the local GPU) or a GPU preset (see ``memfit devices``)."""
    if isinstance(name, Device):
        return name
    if name is None or name == "cpu":
        return cpu_device()
    if name.lower() in ("cuda", "gpu"):
        return local_cuda_device()
    key = _BY_SQUEEZED_NAME.get(_squeezed(name))
    if key is None:
        raise UserError(f"unknown device {name!r}; choose cpu or one of: {', '.join(GPU_PRESETS)}")
    return GPU_PRESETS[key]


def _squeezed(name: str) -> str:
    """A card's name as people write it, reduced to a key: case, spaces, dashes and underscores, and the
    vendor's words left out ("NVIDIA GeForce RTX 4090", "rtx-4090" and "RTX4090" are ``rtx4090``)."""
    name = name.lower().replace("nvidia", "").replace("geforce", "")
    return "".join(c for c in name if c not in " -_\t")


_BY_SQUEEZED_NAME = {_squeezed(k): v for k, v in (*((p, p) for p in GPU_PRESETS), *ALIASES.items())}
