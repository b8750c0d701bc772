"""The machines a job may run on: VRAM, RAM, disk and peak FLOP/s, each figure with its source."""
from __future__ import annotations

import re
from dataclasses import dataclass

from nblib import t4_speed
from nblib.errors import ConfigError
from nblib.units import GB, GiB


@dataclass(frozen=True)
class Device:
    """A machine the job may run on: its limits and peak arithmetic rates."""

    name: str
    vram_bytes: int           # 0: no GPU, activations live in RAM
    ram_bytes: int            # host RAM a job may use (after the OS and the notebook server)
    disk_bytes: int           # free local disk at the start of a session
    fp32_flops: float         # peak FP32 FLOP/s
    fp16_flops: float         # peak FP16 FLOP/s (tensor cores where present)
    cuda_context_bytes: int = 0  # driver + kernels image, outside torch's allocator
    efficiency: float = 0.25  # share of peak a batch of this encoder reaches (calibrate())
    memory_bandwidth: float = 0.0   # bytes/s of device memory (host DRAM for the CPU)
    tf32_flops: float = 0.0   # peak TF32 tensor FLOP/s (0: no TF32, fp32 runs at fp32_flops)
    compute_capability: int = 0     # CUDA sm_XY as XY (75 for a T4); 0 for the CPU
    sourced_speed: bool = False     # its time is nblib.t4_speed's range (public measurements), not `efficiency`

    @property
    def is_gpu(self) -> bool:
        return self.vram_bytes > 0

    @property
    def compute_flops(self) -> float:
        """The rate inference runs at: fp16 autocast on CUDA, fp32 on CPU."""
        return self.fp16_flops if self.is_gpu else self.fp32_flops


# A Colab T4's memory as torch.cuda.get_device_properties(0).total_memory reports it (cudaDeviceProp.
# totalGlobalMem: 16 GiB of GDDR6 less the ECC reserve and the driver's share): 15,828,320,256 bytes.
# Sources, read 2026-11-27: a Colab deviceQuery printing "Total Global Memory (bytes): 15828320256" for a
# "Tesla T4" with ECC on; and github.com/mryab/efficient-dl-systems week01_intro/seminar.ipynb (commit
# e632aa89, run on Colab 2026-01-19, driver 550.54.15): torch prints "_CudaDeviceProperties(name='Tesla T4',
# ..., total_memory=15095MB" (total_memory // 2**20: 15,828,320,256 // 2**20 = 15095) and nvidia-smi
# "15360MiB". Other drivers report a little less (15079-15109 MiB in public Colab outputs).
T4_TOTAL_MEMORY = 15_828_320_256
T4_TOTAL_MEMORY_SOURCE = ("torch.cuda.get_device_properties(0).total_memory of a Colab Tesla T4 (driver 550.54.15): "
                          "15095 MiB as torch prints it, 15828320256 bytes as cudaGetDeviceProperties gives it; "
                          "public Colab outputs read 2026-11-27")

DEVICES: dict[str, Device] = {
    # GitHub-hosted ubuntu-latest runner (docs.github.com "About GitHub-hosted runners": 4 vCPU,
    # 16 GB RAM, 14 GB SSD); 4 cores x ~2.5 GHz x 32 FP32 FLOP/cycle (AVX2, 2 FMA units) = 0.32
    # TFLOP/s; no fp16 speed-up on CPU.
    "cpu": Device("cpu", vram_bytes=0, ram_bytes=int(14 * GB), disk_bytes=int(14 * GB),
                  fp32_flops=0.32e12, fp16_flops=0.32e12, efficiency=0.3, memory_bandwidth=25e9),
    # Colab free T4: VRAM is the total_memory torch reports (T4_TOTAL_MEMORY, sourced below), 12.7 GB RAM
    # of which ~11 GB usable, ~78 GB free of a 108 GB disk. NVIDIA T4 datasheet: 8.1 TFLOP/s
    # FP32, 65 TFLOP/s FP16 tensor, 320 GB/s GDDR6, Turing sm_75 (no TF32, no bf16 tensor
    # cores). CUDA context 300-500 MB on a T4 (nvidia-smi after init).
    # Speed: nblib.t4_speed, a range drawn from public PyTorch measurements on a T4 with their
    # sources (sourced_speed); `efficiency` is that range's mid over the fp16 peak, derived, not typed.
    "t4": Device("t4", vram_bytes=T4_TOTAL_MEMORY, ram_bytes=int(11.0 * GB),
                 disk_bytes=int(78 * GB), fp32_flops=8.1e12, fp16_flops=65e12,
                 cuda_context_bytes=int(0.4 * GB), efficiency=t4_speed.achieved_range("fp16")[0].mid / 65e12,
                 memory_bandwidth=320e9, compute_capability=75, sourced_speed=True),
    # Colab L4: 22.5 GB VRAM shown, 53 GB RAM, ~200 GB free disk. NVIDIA L4 datasheet: 30.3
    # TFLOP/s FP32, 121 TFLOP/s FP16 tensor (dense; 242 with sparsity), 60 TF32 (dense),
    # 300 GB/s, Ada sm_89.
    "l4": Device("l4", vram_bytes=int(22.5 * GB), ram_bytes=int(50 * GB), disk_bytes=int(200 * GB),
                 fp32_flops=30.3e12, fp16_flops=121e12, cuda_context_bytes=int(0.5 * GB),
                 memory_bandwidth=300e9, tf32_flops=60e12, compute_capability=89),
    # Colab A100 40 GB: 40 GB VRAM, 83.5 GB RAM, ~200 GB free disk. NVIDIA A100 datasheet: 19.5
    # TFLOP/s FP32, 312 TFLOP/s FP16 tensor (dense), 156 TF32 (dense), 1,555 GB/s, sm_80.
    "a100-40gb": Device("a100-40gb", vram_bytes=int(40 * GB), ram_bytes=int(80 * GB),
                        disk_bytes=int(200 * GB), fp32_flops=19.5e12, fp16_flops=312e12,
                        cuda_context_bytes=int(0.5 * GB), memory_bandwidth=1555e9,
                        tf32_flops=156e12, compute_capability=80),
    # H100 SXM5 80 GB: 80 GB HBM3 (~79 GB usable), NVIDIA H100 datasheet: 67 TFLOP/s FP32,
    # 989 TFLOP/s FP16 tensor and 495 TF32 (dense), 3.35 TB/s, Hopper sm_90. Host as lent to
    # this project: 128 GiB RAM, 64 GiB disk.
    "h100": Device("h100", vram_bytes=int(79 * GB), ram_bytes=int(128 * GiB),
                   disk_bytes=int(64 * GiB), fp32_flops=67e12, fp16_flops=989e12,
                   cuda_context_bytes=int(0.6 * GB), memory_bandwidth=3.35e12, tf32_flops=495e12,
                   compute_capability=90),
    # H200 SXM: 141 GB HBM3e; NVIDIA H200 datasheet: 67 TFLOP/s FP32, 989 TFLOP/s FP16 tensor
    # and 495 TF32 (dense), 4.8 TB/s, sm_90. Host as lent to this project: 128 GiB RAM, 64 GiB disk.
    "h200": Device("h200", vram_bytes=int(141 * GB), ram_bytes=int(128 * GiB),
                   disk_bytes=int(64 * GiB), fp32_flops=67e12, fp16_flops=989e12,
                   cuda_context_bytes=int(0.6 * GB), memory_bandwidth=4.8e12, tf32_flops=495e12,
                   compute_capability=90),
}


# A GPU's marketing name -> its device preset. Whole words only: "L4" must not match
# "L40S", and an A100 80GB is not the a100-40gb preset. First match wins.
GPU_PRESET_PATTERNS = (
    ("t4", re.compile(r"\bT4\b", re.I)),
    ("l4", re.compile(r"\bL4\b", re.I)),
    ("a100-40gb", re.compile(r"\bA100\b(?!.*\b80\s*GB\b)", re.I)),
    ("h100", re.compile(r"\bH100\b(?!.*\b(PCIe|NVL)\b)", re.I)),
    ("h200", re.compile(r"\bH200\b(?!.*\bNVL\b)", re.I)),
)


def device_preset_name(gpu_name: str | None) -> str | None:
    """The device preset of a GPU named as torch/nvidia-smi name it, or None if none fits.

    "NVIDIA L4" -> "l4", "Tesla T4" -> "t4"; "NVIDIA L40S" and "NVIDIA A100-SXM4-80GB" -> None
    (no preset has their memory or speed).
    """
    if not gpu_name:
        return None
    return next((name for name, pattern in GPU_PRESET_PATTERNS
                 if name in DEVICES and pattern.search(gpu_name)), None)


def gpu_preset(gpu: str | Device) -> Device:
    """The named GPU preset (or the Device given): ConfigError for one without a GPU (nothing to simulate)."""
    dev = device_preset(gpu)
    if not dev.is_gpu:
        raise ConfigError(f"gpu={dev.name!r} has no GPU to simulate; choose a GPU preset "
                          f"({', '.join(name for name, d in DEVICES.items() if d.is_gpu)})")
    return dev


def device_preset(device: str | Device) -> Device:
    """The named device preset (cpu, t4, l4, a100-40gb, h100, h200), or the Device given."""
    if isinstance(device, Device):
        return device
    try:
        return DEVICES[device]
    except (KeyError, TypeError):
        raise ConfigError(
            f"device={device!r} is unknown; choose one of: {', '.join(DEVICES)}") from None
