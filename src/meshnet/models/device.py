"""Where a node's tensors live: the `--device` setting resolved, the memory a device offers,
and the one copy a frame makes back to the host (ADR-0039).

A node process runs on one device. Its layers, KV caches, fast path and (at an entry) head
sit there; activations cross the wire as bf16 bytes on the host whatever the device, so a
CUDA shard's output is copied to host memory once per frame.

Torch is imported only where CUDA (or a tensor) is involved: a CPU node whose spans are all
ggml resolves its device, budget and speed without it (ADR-0052).
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from meshnet.errors import ConfigError
from meshnet.types import device_kind, parse_device

if TYPE_CHECKING:
    import torch

MiB = 1 << 20
# VRAM a CUDA node leaves free beyond what it declares: the caching allocator's
# fragmentation, cuBLAS workspaces and kernels' scratch are not in `sizing`'s counts
CUDA_MARGIN_MIN_BYTES = 512 * MiB
CUDA_MARGIN_FRACTION = 0.05  # ...or this share of the card, whichever is larger


def resolve_device(setting: str) -> str:
    """A device setting (`auto`, `cpu`, `cuda`, `cuda:N`) as the device a node runs on:
    "cpu" or "cuda:N". ConfigError when CUDA is asked for and PyTorch cannot use it."""
    try:
        value = parse_device(setting)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    if value == "cpu" or (value == "auto" and not nvidia_driver_present()):
        return "cpu"  # without asking torch: no driver, no CUDA device
    import torch

    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if value == "cpu" or (value == "auto" and count == 0):
        return "cpu"
    if value == "auto":
        return "cuda:0"
    index = int(value.split(":")[1]) if ":" in value else 0
    if count == 0:
        raise ConfigError(f"--device {value}: {no_cuda_reason()}")
    if index >= count:
        raise ConfigError(f"--device {value}: PyTorch sees CUDA devices 0 to {count - 1}")
    return f"cuda:{index}"


def nvidia_driver_present() -> bool:
    """Whether the NVIDIA driver exposes a device here (`/dev/nvidia0`, ...): PyTorch sees
    no CUDA device without one."""
    return any(Path("/dev").glob("nvidia[0-9]*"))


def no_cuda_reason() -> str:
    """Why PyTorch sees no CUDA device here, in words a user can act on."""
    import torch

    if torch.version.cuda is None:
        return (
            f"this PyTorch ({torch.__version__}) is a CPU build; install the CUDA build "
            f"(MESHNET_TORCH=cuda ./run setup, see the README)"
        )
    return "PyTorch is a CUDA build but sees no device (no NVIDIA driver, or CUDA_VISIBLE_DEVICES)"


def cuda_budget_bytes(free_bytes: int, total_bytes: int) -> int:
    """What a CUDA node declares: the free VRAM less a safety margin (never below 0)."""
    margin = max(CUDA_MARGIN_MIN_BYTES, int(total_bytes * CUDA_MARGIN_FRACTION))
    return max(0, free_bytes - margin)


def budget_bytes(device: str) -> int:
    """The default budget on `device`: free VRAM less the margin on CUDA (the tracker keeps
    the KV reserve out of it); half the available RAM on the CPU."""
    if device_kind(device) == "cuda":
        import torch

        free, total = torch.cuda.mem_get_info(torch.device(device))
        return cuda_budget_bytes(int(free), int(total))
    pages = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    return int(pages // 2)


def to_host(tensor: torch.Tensor) -> torch.Tensor:
    """`tensor` in host memory: a CPU tensor as it is; a CUDA one copied once, into pinned
    memory (PyTorch caches pinned blocks, so frames do not pin pages each time)."""
    if tensor.device.type == "cpu":
        return tensor
    import torch

    host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
    host.copy_(tensor)  # synchronous: the frame is sent right after
    return host


def synchronize(device: str) -> None:
    """Wait for `device`'s queued work (CUDA runs asynchronously; timing needs this)."""
    if device_kind(device) == "cuda":
        import torch

        torch.cuda.synchronize(torch.device(device))


def measure_throughput(device: str = "cpu", repeats: int = 30) -> float:
    """Relative speed: 1024x1024 matrix-vector products per second on `device` (a short timed
    pass), what a node reports at registration. On the CPU with numpy (every CPU node alike,
    with or without torch), on CUDA with torch."""
    if device_kind(device) == "cpu":
        return _cpu_throughput(repeats)
    import torch

    layer = torch.nn.Linear(1024, 1024).to(device)
    x = torch.randn(1, 1024, device=device)
    with torch.inference_mode():
        layer(x)
        synchronize(device)
        start = time.perf_counter()
        for _ in range(repeats):
            layer(x)
        synchronize(device)
    return repeats / (time.perf_counter() - start)


def _cpu_throughput(repeats: int) -> float:
    rng = np.random.default_rng(0)
    weight = rng.standard_normal((1024, 1024), dtype=np.float32)
    x = rng.standard_normal(1024, dtype=np.float32)
    weight @ x
    start = time.perf_counter()
    for _ in range(repeats):
        weight @ x
    return repeats / (time.perf_counter() - start)
