"""The registry of ggml layer graphs by GGUF architecture, and the parts families share.

A family module (`ggml_llama`, `ggml_gemma3`) registers a `Family`: the numbers it reads from
the file's metadata, the tensor names of a layer, and `layer`, which adds one decoder layer to
a round's graph. `attention` is the per-frame causal (optionally windowed) attention over each
session's F16 cache that every family uses. Imports no torch.
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

from meshnet.errors import ModelError
from meshnet.models.ggml_lib import F16, Builder, Tensor, gg

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
    ) -> Tensor:
        """Layer `index` (the span's `local`-th) applied to `x` [H, N] f32 (the round's
        tokens; `build.positions`, `build.cells` and `build.pool` are set)."""
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


def read_params(
    fields: Mapping[str, Any], arch: str, *, context: int, rope_base: float, rope_mode: int
) -> Params:
    """The shape every family reads alike (`{arch}.block_count`, ...); `context` and
    `rope_base` where the file does not say; `extra` left for the family."""
    read = field_reader(fields, arch)
    hidden, heads = int(read("embedding_length")), int(read("attention.head_count"))
    return Params(
        layers=int(read("block_count")),
        hidden=hidden,
        heads=heads,
        kv_heads=int(read("attention.head_count_kv", heads)),
        head_dim=int(read("attention.key_length", 0)) or hidden // heads,
        context=int(read("context_length", context)),
        eps=float(read("attention.layer_norm_rms_epsilon")),
        rope_base=float(read("rope.freq_base", rope_base)),
        rope_mode=rope_mode,
    )


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
    local: int,
    scale: float,
    window: int | None = None,
) -> Tensor:
    """The round's queries over its sessions' cache cells: q [hd, heads, N], k and v
    [hd, kv_heads, N] (this round's, written to their cells first) -> [hd * heads, N]. One
    attention for every session of the round: the mask lets each query see only its own
    session's cells (ADR-0051); query head h reads key head h // (heads / kv_heads)."""
    ctx, pool = build.ctx, build.pool
    hd, heads, kv_heads, tokens = (
        q.contents.ne[0],
        q.contents.ne[1],
        k.contents.ne[1],
        q.contents.ne[2],
    )
    if build.data is None:
        raise ModelError("attention needs a round's values (its pool cells)")
    width, keys = hd * kv_heads, build.data.keys
    cached = []
    for which, new in ((0, k), (1, v)):
        table = gg.ggml_set_rows(
            ctx,
            pool.tensor(build, local, which),
            gg.ggml_reshape_2d(ctx, new, width, tokens),
            build.cells,
        )
        view = gg.ggml_view_3d(ctx, table, hd, kv_heads, keys, hd * 2, width * 2, 0)
        cached.append(gg.ggml_permute(ctx, view, 0, 2, 1, 3))  # [hd, keys, kv_heads]
    query = gg.ggml_permute(ctx, q, 0, 2, 1, 3)  # [hd, N, heads]
    mask = build.input(f"mask:{window}", F16)
    mixed = gg.ggml_flash_attn_ext(ctx, query, cached[0], cached[1], mask, scale, 0.0, 0.0)
    return gg.ggml_reshape_2d(ctx, mixed, hd * heads, tokens)  # from [hd, heads, N]
