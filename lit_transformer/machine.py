"""What this machine has: bf16 matrix units on the CPU, NVIDIA GPUs, and the threads torch
uses. A leaf every layer may import; the recipe layer does not (a recipe is machine-free: the
resolver, training/resolve.py, asks here and applies the recipe's rules to the answers).

Nothing here imports torch at module level: `info` and `--print-config` ask about the machine
without loading it.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

# oneDNN's instruction sets without bf16 dot products: ONEDNN_MAX_CPU_ISA set to one of these
# keeps oneDNN off AVX512-BF16 and AMX even where the CPU has them (oneDNN's "CPU Dispatcher
# Control" documentation), so bf16 matrix products are emulated
_ONEDNN_ISAS_WITHOUT_BF16 = {"SSE41", "AVX", "AVX2", "AVX2_VNNI", "AVX2_VNNI_2", "AVX512_CORE", "AVX512_CORE_VNNI"}


def cpu_has_bf16_matmul() -> bool:
    """Whether the CPU has bf16 matrix instructions (AMX, AVX512-BF16) that oneDNN may use;
    elsewhere bf16 is emulated (several times slower than float32)."""
    if os.environ.get("ONEDNN_MAX_CPU_ISA", "").upper() in _ONEDNN_ISAS_WITHOUT_BF16:
        return False
    return bool(cpu_flags() & {"amx_bf16", "avx512_bf16"})


def cpu_flags() -> set[str]:
    """The CPU's feature flags from /proc/cpuinfo (empty where there is none: not Linux)."""
    try:
        with open("/proc/cpuinfo") as file:
            for line in file:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def has_nvidia_gpu() -> bool:
    """Whether the NVIDIA driver lists a GPU (without importing torch)."""
    gpus = Path("/proc/driver/nvidia/gpus")
    return gpus.is_dir() and any(gpus.iterdir())


@contextlib.contextmanager
def cpu_threads(n: int | None):
    """torch.set_num_threads(n) for the duration (it is process-wide)."""
    import torch

    before = torch.get_num_threads()
    if n is not None:
        torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)
