"""The registry of ggml layer graphs by GGUF architecture, and the parts families share.

A family module (`ggml_llama`, `ggml_gemma3`) registers a `Family`: the numbers it reads from
the file's metadata, the tensor names of a layer, and `layer`, which adds one decoder layer to
a round's graph. `attention` is the per-frame causal (optionally windowed) attention over each
session's F16 cache that every family uses. Imports no torch.
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from meshnet.errors import ModelError
from meshnet.models.ggml_lib import F16, Builder, FrameRef, Tensor, gg

_MODULES = ("meshnet.models.ggml_llama", "meshnet.models.ggml_gemma3")
_REGISTRY: dict[str, Family] = {}


@dataclass(frozen=True)
class Params:
    """A model's shape and constants, read from its GGUF metadata."""

    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    context: int
    eps: float
    rope_base: float
    rope_mode: int  # 0: rotate adjacent pairs (llama files), 2: halves (GGML_ROPE_TYPE_NEOX)
    extra: dict[str, Any] = field(default_factory=dict)


class Weights(Protocol):
    def __getitem__(self, name: str) -> Tensor: ...

    def get(self, name: str) -> Tensor | None: ...


class Family(Protocol):
    archs: tuple[str, ...]  # GGUF `general.architecture` values

    def params(self, fields: Mapping[str, Any], arch: str) -> Params: ...

    def tensor_names(self, index: int) -> list[str]:
        """The file's tensors layer `index` may use (absent optional ones are skipped)."""
        ...

    def layer(
        self,
        build: Builder,
        weights: Weights,
        params: Params,
        index: int,
        local: int,
        x: Tensor,
        frames: Sequence[FrameRef],
    ) -> Tensor:
        """Layer `index` (the span's `local`-th) applied to `x` [H, N] f32."""
        ...


def register(family: Family) -> Family:
    for arch in family.archs:
        _REGISTRY[arch] = family
    return family


def _load() -> None:
    if not _REGISTRY:
        for module in _MODULES:
            importlib.import_module(module)


def has(arch: str) -> bool:
    """Whether ggml has a graph for GGUF architecture `arch` (False where ggml-python is not
    installed)."""
    try:
        _load()
    except ModelError:
        return False
    return arch in _REGISTRY


def get(arch: str) -> Family:
    _load()
    try:
        return _REGISTRY[arch]
    except KeyError:
        raise ModelError(
            f"the ggml backend has no graph for GGUF architecture {arch!r} (it has "
            f"{sorted(_REGISTRY)}); use --backend torch"
        ) from None


def field_reader(fields: Mapping[str, Any], arch: str) -> Any:
    """`read(name, default)`: the field `{arch}.{name}`, a `ModelError` if absent without one."""

    def read(name: str, default: Any = None) -> Any:
        value = fields.get(f"{arch}.{name}", default)
        if value is None:
            raise ModelError(f"GGUF {arch} file has no '{arch}.{name}'")
        return value

    return read


def rms_norm(build: Builder, x: Tensor, weight: Tensor, eps: float) -> Tensor:
    return gg.ggml_mul(build.ctx, gg.ggml_rms_norm(build.ctx, x, eps), weight)


def rope(
    build: Builder,
    x: Tensor,
    params: Params,
    base: float,
    factors: Tensor | None,
    scale: float = 1.0,
) -> Tensor:
    """Rotary positions on `x` [head_dim, heads, N] at the round's token positions (`scale`:
    linear position scaling, 1 / factor)."""
    dims = int(params.extra.get("rope_dims") or params.head_dim)
    return gg.ggml_rope_ext(
        build.ctx, x, build.positions, factors, dims, params.rope_mode, 0, base,
        scale, 0.0, 1.0, 0.0, 0.0,
    )  # fmt: skip


def attention(
    build: Builder,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    frames: Sequence[FrameRef],
    local: int,
    scale: float,
    window: int | None = None,
) -> Tensor:
    """Each frame's queries over its session's cache: q [hd, heads, N], k and v
    [hd, kv_heads, N] (this round's) -> [hd * heads, N]. New keys and values are written to
    the cache rows at their positions; query head h reads key head h // (heads / kv_heads)."""
    ctx = build.ctx
    hd, heads, kv_heads = q.contents.ne[0], q.contents.ne[1], k.contents.ne[1]
    width = hd * kv_heads
    k2 = gg.ggml_reshape_2d(ctx, k, width, k.contents.ne[2])
    v2 = gg.ggml_reshape_2d(ctx, v, width, v.contents.ne[2])
    outs = []
    for frame in frames:
        total = frame.keys  # rows [0, position + length), padded: the mask hides the rest
        keys = _cached(build, frame, (local, 0, hd), _columns(ctx, k2, frame), total)
        values = _cached(build, frame, (local, 1, hd), _columns(ctx, v2, frame), total)
        keys = gg.ggml_permute(ctx, keys, 0, 2, 1, 3)  # [hd, total, kv_heads]
        values = gg.ggml_permute(ctx, values, 0, 2, 1, 3)  # [hd, total, kv_heads]
        row = q.contents.nb[2]
        query = gg.ggml_view_3d(
            ctx, q, hd, heads, frame.length, q.contents.nb[1], row, frame.start * row
        )
        query = gg.ggml_permute(ctx, query, 0, 2, 1, 3)  # [hd, T, heads]
        mask = _mask(build, frame, window)
        mixed = gg.ggml_flash_attn_ext(ctx, query, keys, values, mask, scale, 0.0, 0.0)
        outs.append(gg.ggml_reshape_2d(ctx, mixed, hd * heads, frame.length))  # from [hd, heads, T]
    out = outs[0]
    for more in outs[1:]:
        out = gg.ggml_concat(ctx, out, more, 1)
    return out


def _columns(ctx: Any, x: Tensor, frame: FrameRef) -> Tensor:
    """Columns [start, start + length) of `x` [width, N]."""
    stride = x.contents.nb[1]
    return gg.ggml_view_2d(ctx, x, x.contents.ne[0], frame.length, stride, frame.start * stride)


def _cached(
    build: Builder, frame: FrameRef, where: tuple[int, int, int], new: Tensor, total: int
) -> Tensor:
    """The session's keys or values [hd, kv_heads, total] with `new` [hd * kv_heads, T]
    written at its rows; `where` is (layer, 0 for keys or 1 for values, hd)."""
    local, which, hd = where
    cache = gg.ggml_set_rows(build.ctx, frame.cache.tensor(build, local, which), new, frame.rows)
    width = frame.cache.width
    return gg.ggml_view_3d(build.ctx, cache, hd, width // hd, total, hd * 2, width * 2, 0)


def _mask(build: Builder, frame: FrameRef, window: int | None) -> Tensor:
    """Frame's attention mask (`RoundData`): one per frame and window, shared by the round's
    layers."""
    return build.input(f"mask:{frame.index}:{window}", F16)
