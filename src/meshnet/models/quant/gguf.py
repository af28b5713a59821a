"""gguf: the file's own types as it stores them, computed by ggml (ADR-0051); a layer holds
the file's bytes (`sizing.file_layer_bytes`), so no formula sizes it. Its products quantize
activations to 8 bits, so spot checks treat it as 4-bit."""

from meshnet.models.quant.scheme import QuantScheme

SCHEME = QuantScheme("gguf", linear_bytes=0.0, compute="bf16", file_types=True, four_bit=True)
