"""An entry's head from a GGUF file, computed by ggml at the file's types (ADR-0051).

Token embeddings are rows gathered from the file's own (often quantized) table; the final
norm and LM head (the embedding table again when tied) multiply as ggml does. Nothing is
widened or copied: a Q8_0 table of 49,152 x 576 stays 30 MB where bf16 took 57. No torch.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from meshnet.models import ggml_graphs
from meshnet.models.ggml_graphs import rms_norm
from meshnet.models.ggml_lib import F32, I32, Graph, gg
from meshnet.models.ggml_span import MappedWeights
from meshnet.models.gguf_file import HEAD_TENSORS, read_gguf

EMBED, NORM, OUTPUT = HEAD_TENSORS


class GgmlHead:
    def __init__(self, path: Path, threads: int | None = None) -> None:
        file = read_gguf(path)
        arch = str(file.fields.get("general.architecture"))
        self.family = ggml_graphs.get(arch)
        self.params = self.family.params(file.fields, arch)
        self.weights = MappedWeights(file, [EMBED, NORM, OUTPUT], path)
        self.graph = Graph(threads)  # logits
        self.embeds = Graph(threads)  # each keeps its last graph
        self.vocab = int(self.weights[EMBED].contents.ne[1])
        self.hidden = self.params.hidden

    @property
    def weight_bytes(self) -> int:
        return self.weights.bytes

    def embed(self, ids: np.ndarray) -> np.ndarray:
        """Token ids [T] -> float32 hidden states [T, H] (scaled as the family's inputs are)."""
        ids = np.asarray(ids)
        build = self.embeds.kept(ids.shape)
        if build is None:
            build = self.embeds.keep(ids.shape, 0)
            rows = build.input("ids", I32, ids.shape)
            x = gg.ggml_get_rows(build.ctx, self.weights[EMBED], rows)
            scale = float(self.params.extra.get("embed_scale", 1.0))
            build.finish(x if scale == 1.0 else gg.ggml_scale(build.ctx, x, scale))
        return build.compute(lambda name: ids)

    def logits(self, hidden: np.ndarray) -> np.ndarray:
        """Hidden states float32 [N, H] -> logits float32 [N, V]."""
        build = self.graph.kept(hidden.shape)
        if build is None:  # a decode step's graph is kept for the next one
            build = self.graph.keep(hidden.shape, 0)
            x = build.input("x", F32, hidden.shape)
            x = rms_norm(build, x, self.weights[NORM], self.params.eps)
            table = self.weights.get(OUTPUT) or self.weights[EMBED]  # tied: the embeddings
            build.finish(gg.ggml_mul_mat(build.ctx, table, x))
        return build.compute(lambda name: hidden)

    def close(self) -> None:
        self.graph.close()
        self.embeds.close()
        self.weights.close()
