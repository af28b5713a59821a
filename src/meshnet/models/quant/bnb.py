"""What the bitsandbytes schemes (int8, nf4) share. Torch is imported only when called."""

from __future__ import annotations

from typing import Any


def placed(q: Any, bias: Any, dtype: Any, device: str) -> Any:
    """A bitsandbytes linear `q` with `bias` in `dtype`, moved to `device` (bitsandbytes
    quantizes its weight on that move, on the CPU or the GPU)."""
    from torch import nn

    if bias is not None:
        q.bias = nn.Parameter(bias.detach().to(dtype), requires_grad=False)
    return q.to(device)
