"""Every encoding round-trips bf16 tensors bit for bit."""

from __future__ import annotations

import pytest
import torch

from meshnet.config import WireConfig
from meshnet.types import LayerSpan, ModelId, SessionId
from meshnet.wire import FrameMeta, decode, encode
from meshnet.wire import headers as h

ENCODINGS = ["none", "zstd", "zstd-shuffle", "auto"]
META = FrameMeta(SessionId("s-1"), ModelId("default"), LayerSpan(0, 10), position=7)


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int16)


def special_values() -> torch.Tensor:
    values = [
        float("nan"),
        float("inf"),
        float("-inf"),
        -0.0,
        0.0,
        1e-40,
        -1e-40,
        9.2e-41,
        3.0e38,
        -3.0e38,
        1.0,
        -1.0,
    ]
    return torch.tensor(values, dtype=torch.bfloat16).reshape(1, 2, 6)


@pytest.mark.parametrize("encoding", ENCODINGS)
@pytest.mark.parametrize("shape", [(1, 1, 576), (1, 129, 64), (2, 3, 8), (1, 128, 576)])
def test_bit_exact_round_trip(encoding: str, shape: tuple[int, int, int]) -> None:
    x = torch.randn(shape, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    enc = encode(x, META, WireConfig(encoding=encoding))
    meta, y = decode(enc.headers, bytes(enc.body))
    assert meta == META
    assert y.dtype == torch.bfloat16 and y.shape == x.shape
    assert torch.equal(bits(y), bits(x))


@pytest.mark.parametrize("encoding", ENCODINGS)
def test_nan_inf_and_subnormals_survive(encoding: str) -> None:
    x = special_values()
    enc = encode(x, META, WireConfig(encoding=encoding, auto_min_bytes=1))
    _, y = decode(enc.headers, bytes(enc.body))
    assert torch.equal(bits(y), bits(x))  # NaN payloads and signed zeros included


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.float64])
def test_any_float_dtype_goes_out_as_bf16(dtype: torch.dtype) -> None:
    x = torch.randn(1, 4, 16, dtype=dtype)
    enc = encode(x, META)
    assert enc.headers[h.DTYPE] == "bfloat16"
    _, y = decode(enc.headers, bytes(enc.body))
    assert torch.equal(bits(y), bits(x.to(torch.bfloat16)))


def test_body_is_raw_little_endian_bf16() -> None:
    x = torch.tensor([[[1.0, -2.0]]], dtype=torch.bfloat16)  # 0x3f80, 0xc000
    enc = encode(x, META, WireConfig(encoding="none"))
    assert bytes(enc.body) == bytes([0x80, 0x3F, 0x00, 0xC0])
    assert h.ENCODING not in enc.headers  # absent means uncompressed
    assert enc.headers[h.SHAPE] == "1,1,2"
    assert enc.headers[h.VERSION] == "1"
    assert enc.headers[h.CONTENT_TYPE] == "application/octet-stream"


def test_auto_sends_decode_steps_uncompressed_and_prefill_compressed() -> None:
    step = encode(torch.randn(1, 1, 576), META)
    prefill = encode(torch.randn(1, 128, 576), META)
    assert h.ENCODING not in step.headers
    assert prefill.headers[h.ENCODING] == "zstd-shuffle"


def test_headers_are_case_insensitive() -> None:
    enc = encode(torch.randn(1, 2, 4), META)
    lowered = {k.lower(): v for k, v in enc.headers.items()}
    upper = {k.upper(): v for k, v in enc.headers.items()}
    assert decode(lowered, bytes(enc.body))[0] == decode(upper, bytes(enc.body))[0] == META


def test_uncompressed_encode_does_not_copy_bf16_input() -> None:
    x = torch.randn(1, 8, 16).to(torch.bfloat16)
    enc = encode(x, META, WireConfig(encoding="none"))
    x[0, 0, 0] = 42.0  # the body is a view of the tensor's memory
    assert (
        bytes(enc.body)[:2]
        == torch.tensor([42.0], dtype=torch.bfloat16).view(torch.uint8).numpy().tobytes()
    )


def test_encode_refuses_non_3d_or_integer_tensors() -> None:
    with pytest.raises(ValueError):
        encode(torch.randn(4, 4), META)
    with pytest.raises(ValueError):
        encode(torch.ones(1, 2, 3, dtype=torch.int32), META)
    with pytest.raises(ValueError):
        encode(torch.randn(1, 2, 3), META, WireConfig(encoding="gzip"))
