"""`--device`: parsing, resolving against what PyTorch sees, budgets, and what follows from the
device (compute dtype, nf4 layout, host turns). CUDA itself is tested in tests/gpu."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from meshnet.config import COMPUTE_DTYPE_ENV
from meshnet.errors import ConfigError
from meshnet.models import device as dev
from meshnet.models import quantize
from meshnet.models.loader import load_shard
from meshnet.models.quant import compute, nf4
from meshnet.models.source import resolve
from meshnet.node.compute import host_turns
from meshnet.types import LayerSpan, device_kind, parse_device

GiB, MiB = 1 << 30, 1 << 20


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("auto", "auto"),
        ("cpu", "cpu"),
        ("cuda", "cuda"),
        ("cuda:1", "cuda:1"),
        (" CUDA:0 ", "cuda:0"),
    ],
)
def test_device_settings_parse(text: str, expected: str) -> None:
    assert parse_device(text) == expected


@pytest.mark.parametrize("text", ["gpu", "cpu:0", "auto:1", "cuda:", "cuda:x", "cuda:1234", ""])
def test_bad_device_settings_name_the_choices(text: str) -> None:
    with pytest.raises(ValueError, match="auto, cpu, cuda or cuda:N"):
        parse_device(text)


def test_device_kind() -> None:
    assert [device_kind(d) for d in ("cpu", "cuda:0", "cuda:3")] == ["cpu", "cuda", "cuda"]


def fake_cuda(monkeypatch: pytest.MonkeyPatch, count: int) -> None:
    """PyTorch reports `count` CUDA devices (none is touched by these tests)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: count > 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: count)
    monkeypatch.setattr(dev, "nvidia_driver_present", lambda: count > 0)


@pytest.mark.parametrize(
    ("setting", "count", "expected"),
    [
        ("auto", 0, "cpu"),
        ("cpu", 0, "cpu"),
        ("cpu", 2, "cpu"),
        ("auto", 2, "cuda:0"),
        ("cuda", 2, "cuda:0"),
        ("cuda:1", 2, "cuda:1"),
        ("cuda:0", 2, "cuda:0"),  # resolving is idempotent
    ],
)
def test_resolve_device(
    monkeypatch: pytest.MonkeyPatch, setting: str, count: int, expected: str
) -> None:
    fake_cuda(monkeypatch, count)
    assert dev.resolve_device(setting) == expected


def test_cuda_without_a_device_is_refused_with_the_reason(monkeypatch: pytest.MonkeyPatch) -> None:
    fake_cuda(monkeypatch, 0)
    monkeypatch.setattr(torch.version, "cuda", None)
    with pytest.raises(ConfigError, match=r"--device cuda: this PyTorch .* is a CPU build"):
        dev.resolve_device("cuda")
    monkeypatch.setattr(torch.version, "cuda", "12.8")
    with pytest.raises(ConfigError, match="sees no device"):
        dev.resolve_device("cuda:0")


def test_a_cuda_index_past_the_devices_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    fake_cuda(monkeypatch, 2)
    with pytest.raises(ConfigError, match="--device cuda:2: PyTorch sees CUDA devices 0 to 1"):
        dev.resolve_device("cuda:2")
    with pytest.raises(ConfigError, match="auto, cpu, cuda or cuda:N"):
        dev.resolve_device("tpu")


@pytest.mark.parametrize(
    ("free", "total", "expected"),
    [
        (20 * GiB, 24 * GiB, 20 * GiB - int(24 * GiB * 0.05)),  # 5% of the card: 1.2 GiB
        (6 * GiB, 8 * GiB, 6 * GiB - 512 * MiB),  # small cards keep at least 512 MiB
        (300 * MiB, 8 * GiB, 0),  # a full card offers nothing, never a negative budget
    ],
)
def test_a_cuda_budget_is_free_vram_less_a_margin(free: int, total: int, expected: int) -> None:
    assert dev.cuda_budget_bytes(free, total) == expected


def test_default_budget_reads_the_device(monkeypatch: pytest.MonkeyPatch) -> None:
    asked: list[torch.device] = []

    def mem_get_info(device: torch.device) -> tuple[int, int]:
        asked.append(device)
        return 10 * GiB, 16 * GiB

    monkeypatch.setattr(torch.cuda, "mem_get_info", mem_get_info)
    assert dev.budget_bytes("cuda:1") == dev.cuda_budget_bytes(10 * GiB, 16 * GiB)
    assert asked == [torch.device("cuda:1")]
    assert 0 < dev.budget_bytes("cpu") < 1 << 50  # half the available RAM, not the card


def test_cuda_shards_compute_in_bf16_and_keep_bitsandbytes_layout(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv(COMPUTE_DTYPE_ENV, raising=False)
    assert compute.preferred_compute("cuda:0") == "bf16"
    assert compute.default_quant("cuda:0") == "bf16"
    assert quantize.compute_dtype("int8", "cuda:0") == torch.bfloat16
    assert quantize.compute_dtype("fp32", "cuda:0") == torch.float32
    assert not nf4.nf4_packed_for_cpu("cuda:0")  # the AVX512-BF16 repacking is CPU-only
    cpu = "bf16" if compute.hardware_bf16_is_fast("cpu") else "fp32"
    assert compute.preferred_compute("cpu") == cpu  # a CUDA host's CPU node is not bf16 by it
    spec = resolve("default").spec
    assert quantize.local_layer_bytes(spec, "int8", "cuda:0") == quantize.sizing.layer_bytes(
        spec, "int8", "bf16"
    )
    monkeypatch.setenv(COMPUTE_DTYPE_ENV, "fp32")  # the switch still wins (ADR-0024)
    assert quantize.compute_dtype("int8", "cuda:0") == torch.float32


def test_host_turns_only_for_processes_computing_on_the_cpu() -> None:
    assert host_turns(True, "cpu").path is not None
    assert host_turns(True, "cuda:0").path is None
    assert host_turns(False, "cpu").path is None


def test_host_copies_leave_cpu_tensors_alone() -> None:
    x = torch.ones(2, 3, dtype=torch.bfloat16)
    assert dev.to_host(x) is x


def test_measure_throughput_runs_on_the_device() -> None:
    """1024 x 1024 matrix-vector products a second: ~2 MFLOP each, so between 10 a second
    (a 20 MFLOP/s CPU) and 10 million (20 TFLOP/s) on any CPU this suite runs on."""
    assert 10 < dev.measure_throughput("cpu", repeats=3) < 1e7


@pytest.mark.parametrize("quant", ["fp32", "int8"])
def test_a_shard_places_every_tensor_on_its_device(
    tiny_folder: Callable[[str], Path], quant: str
) -> None:
    """Placement on the CPU (tests/gpu checks CUDA): weights, the rotary frequencies, the
    fast path's fused tensors and the caches a forward makes all sit on `shard.device`, and
    outputs come back in host memory."""
    from meshnet.models.cache import new_cache
    from meshnet.models.shard import _tensors

    shard = load_shard(resolve(str(tiny_folder("llama"))), LayerSpan(0, 2), quant, device="cpu")
    assert shard.device == "cpu" and shard.fast is not None
    tensors = list(_tensors([shard.layers, shard.fast.layers], depth=4))
    tensors += list(shard.extras.buffers())
    assert tensors and {t.device.type for t in tensors} == {"cpu"}
    cache = new_cache()
    out = shard.forward(torch.zeros(1, 3, 64), cache, 0)
    assert out.device.type == "cpu" and out.dtype == torch.bfloat16
    assert cache.static is not None and cache.static.keys.device.type == "cpu"


def test_move_rest_keeps_tensors_already_in_place() -> None:
    layer = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.LayerNorm(4))
    layer.register_buffer("scratch", torch.zeros(2), persistent=False)
    before = [id(p) for p in layer.parameters()]
    quantize.move_rest(layer, "cpu")
    assert [id(p) for p in layer.parameters()] == before
    assert "scratch" not in layer.state_dict()  # a non-persistent buffer stays non-persistent
