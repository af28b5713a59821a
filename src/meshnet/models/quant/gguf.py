"""gguf: the file's own types as it stores them, computed by ggml (ADR-0051); a layer holds
the file's bytes (`sizing.file_layer_bytes`), so no formula sizes it. Its products quantize
activations to 8 bits; its weights are the file's, so spot checks hold it to the tight
tolerance against the other copies that keep them (ADR-0060)."""

from meshnet.models.quant.scheme import QuantScheme

SCHEME = QuantScheme("gguf", linear_bytes=0.0, compute="bf16", file_types=True)
