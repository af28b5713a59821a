"""Shared value types: the half-open layer span, typed identifiers, a route's hop."""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Literal, NewType, get_args

NodeId = NewType("NodeId", str)
SessionId = NewType("SessionId", str)
ModelId = NewType("ModelId", str)

# what a model source is: the embedded default, a .gguf file, a checkpoint folder, a hub id
SourceKind = Literal["default", "gguf", "folder", "hub"]
# how a node stores its layers' weights; "gguf": as its GGUF file stores them (ggml computes)
Quant = Literal["fp32", "bf16", "int8", "nf4", "q4", "gguf"]
QUANTS: tuple[Quant, ...] = get_args(Quant)
# what torch converts a model's weights to (sized from its config alone: `sizing.layer_bytes`)
CONVERSIONS: tuple[Quant, ...] = tuple(q for q in QUANTS if q != "gguf")
Backend = Literal["auto", "torch", "ggml"]  # what computes a node's layers (ADR-0051)
BACKENDS: tuple[Backend, ...] = get_args(Backend)
ComputeDtype = Literal["fp32", "bf16"]  # what int8/nf4/q4 layers compute in (ADR-0024)
COMPUTE_DTYPES: tuple[ComputeDtype, ...] = get_args(ComputeDtype)
# where a node's weights, caches and compute live: "auto" (CUDA when PyTorch sees one, else
# the CPU), "cpu", "cuda" (the first CUDA device) or "cuda:N"; resolved once at start-up
_DEVICE_RE = re.compile(r"^(auto|cpu|cuda)(:[0-9]{1,3})?$")


def parse_quant(text: str) -> Quant:
    """`text` as a `Quant`; ValueError naming the choices otherwise."""
    for quant in QUANTS:
        if text == quant:
            return quant
    raise ValueError(f"unknown quantization {text!r}; choose one of {', '.join(QUANTS)}")


def parse_compute(text: str, what: str = "compute dtype") -> ComputeDtype:
    """`text` as a `ComputeDtype`; ValueError naming `what` and the choices otherwise."""
    for dtype in COMPUTE_DTYPES:
        if text == dtype:
            return dtype
    raise ValueError(f"{what} must be one of {', '.join(COMPUTE_DTYPES)}, got {text!r}")


def parse_device(text: str) -> str:
    """`text` as a device setting, normalised ("CUDA:1" -> "cuda:1"); ValueError naming the
    choices otherwise. Only CUDA takes an index."""
    value = text.strip().lower()
    match = _DEVICE_RE.match(value)
    if match is None or (match.group(2) and match.group(1) != "cuda"):
        raise ValueError(f"device must be auto, cpu, cuda or cuda:N, got {text!r}")
    return value


def device_kind(device: str) -> str:
    """ "cpu" or "cuda" for a resolved device ("cpu", "cuda:0")."""
    return device.split(":", 1)[0]


# Session and node ids travel in headers and URLs: keep them to a safe, bounded alphabet.
_ID_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")


def is_valid_id(value: str) -> bool:
    """True when `value` can be used as a session, node or model id."""
    return bool(_ID_RE.match(value))


@dataclass(frozen=True, order=True)
class LayerSpan:
    """Transformer layers `[start, end)`: start included, end excluded, never empty."""

    start: int
    end: int

    def __post_init__(self) -> None:
        if not (0 <= self.start < self.end):
            raise ValueError(f"a layer span needs 0 <= start < end, got [{self.start}, {self.end})")

    def __len__(self) -> int:
        return self.end - self.start

    def __str__(self) -> str:
        return f"{self.start}:{self.end}"

    def __iter__(self) -> Iterator[int]:
        return iter(range(self.start, self.end))

    def split(self, parts: int) -> list[LayerSpan]:
        """Cut into `parts` contiguous spans whose lengths differ by at most one."""
        if not 1 <= parts <= len(self):
            raise ValueError(f"cannot split {self} ({len(self)} layers) into {parts} parts")
        base, extra = divmod(len(self), parts)
        spans, start = [], self.start
        for i in range(parts):
            end = start + base + (1 if i < extra else 0)
            spans.append(LayerSpan(start, end))
            start = end
        return spans

    @classmethod
    def parse(cls, text: str) -> LayerSpan:
        """Parse `"start:end"` (the header and CLI form)."""
        parts = text.strip().split(":")
        if len(parts) != 2 or not all(p.isdigit() for p in parts):
            raise ValueError(f"expected a layer span 'start:end' with integers, got {text!r}")
        return cls(int(parts[0]), int(parts[1]))


@dataclass(frozen=True)
class Hop:
    """One node of a route and the span it runs for us."""

    node_id: NodeId
    address: str  # http://host:port
    span: LayerSpan
    quant: Quant | None = None  # its weights, as it registered them (None: not told)

    def __str__(self) -> str:
        return f"{self.node_id} ({self.address}) layers {self.span}"
