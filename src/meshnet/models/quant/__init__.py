"""Weight quantizations, one module each (`QuantScheme`); `scheme_of(name)` finds one."""

from __future__ import annotations

from meshnet.models.quant import bf16, fp32, gguf, int8, nf4, q4
from meshnet.models.quant.scheme import QuantScheme
from meshnet.types import Quant, parse_quant

SCHEMES: dict[Quant, QuantScheme] = {
    s.name: s for s in (fp32.SCHEME, bf16.SCHEME, int8.SCHEME, nf4.SCHEME, q4.SCHEME, gguf.SCHEME)
}


def scheme_of(name: str) -> QuantScheme:
    """The scheme called `name` (ValueError naming the choices otherwise)."""
    return SCHEMES[parse_quant(name)]


def check_device(name: str, device: str) -> None:
    """Raise ConfigError when quantization `name` cannot run on `device`."""
    found = scheme_of(name)
    if found.check is not None:
        found.check(device)
