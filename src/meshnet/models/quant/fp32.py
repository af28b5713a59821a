"""fp32: full-precision weights; the reference every other scheme is checked against."""

from meshnet.models.quant.scheme import QuantScheme

SCHEME = QuantScheme("fp32", linear_bytes=4.0, compute="fp32")
