"""Structured output's cost per token on the entry: llguidance's mask and step for a JSON
schema, next to sampling one token without it (ADR-0043).

    python benchmarks/grammar.py          # the default model's 49,152-token vocabulary
    python benchmarks/grammar.py --tiny   # the fake 128-id vocabulary (what the tests run)

A valid JSON document is tokenized and fed through the constraint token by token, as a
generation would: each step masks the logits (llguidance's bitmask, unpacked and applied)
and advances the matcher by the token. "sample" is `text.sampling.sample` on the same
logits (temperature 0.8, top-k 40, top-p 0.95). Medians over the document's tokens.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any

import torch

from meshnet.entry.generation import seeded_rng
from meshnet.entry.grammar import Grammar
from meshnet.text.codec import CharCodec, HfCodec
from meshnet.text.json_limits import COMPACT
from meshnet.text.params import SamplingParams
from meshnet.text.sampling import sample

SCHEMAS: dict[str, tuple[dict[str, Any], Any]] = {
    "flat object": (
        {
            "type": "object",
            "properties": {"city": {"type": "string"}, "population": {"type": "integer"}},
            "required": ["city", "population"],
            "additionalProperties": False,
        },
        {"city": "Paris", "population": 2102650},
    ),
    "nested, arrays, enum": (
        {
            "type": "object",
            "properties": {
                "name": {"type": "string"},
                "tags": {"type": "array", "items": {"type": "string"}},
                "owner": {
                    "type": "object",
                    "properties": {
                        "id": {"type": "integer"},
                        "role": {"enum": ["admin", "user", "guest"]},
                    },
                    "required": ["id", "role"],
                },
            },
            "required": ["name", "tags", "owner"],
        },
        {"name": "mesh", "tags": ["a", "bb", "ccc"], "owner": {"id": 7, "role": "admin"}},
    ),
    "any object (json_object)": ({"type": "object"}, {"answer": [1, 2, {"x": None}]}),
}


def per_token(codec: Any, schema: dict[str, Any], document: Any) -> tuple[float, float, int]:
    """(median µs of mask + advance, median µs of sampling, tokens) over `document`."""
    grammar = Grammar(codec.grammar_tokenizer(), {**schema, **COMPACT}, "response_format")
    ids = codec.encode(json.dumps(document, separators=(",", ":")))
    vocab = max(int(codec.grammar_tokenizer().vocab_size), max(ids) + 1)
    logits = torch.randn(vocab, generator=torch.Generator().manual_seed(0))
    params, rng = SamplingParams(temperature=0.8, top_k=40, top_p=0.95), seeded_rng(0, 0)
    constrained, plain = [], []
    for token in ids:
        start = time.perf_counter()
        masked = grammar.mask(logits)
        if masked[token] == float("-inf"):
            raise RuntimeError(f"the schema refused token {token} of a valid document")
        grammar.advance(token)
        middle = time.perf_counter()
        sample(logits, params, rng)
        constrained.append(middle - start)
        plain.append(time.perf_counter() - middle)
    return statistics.median(constrained) * 1e6, statistics.median(plain) * 1e6, len(ids)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--tiny", action="store_true", help="the fake vocabulary, seconds")
    args = parser.parse_args()
    if args.tiny:
        codec: Any = CharCodec()
    else:
        from meshnet.models.loader import load_tokenizer
        from meshnet.models.source import resolve

        codec = HfCodec(load_tokenizer(resolve("default")))
    vocab = int(codec.grammar_tokenizer().vocab_size)
    print(f"| schema | tokens | mask + step µs/token | sample µs/token | ratio |  ({vocab} ids)")
    print("|---|---:|---:|---:|---:|")
    for name, (schema, document) in SCHEMAS.items():
        masked, plain, tokens = per_token(codec, schema, document)
        print(f"| {name} | {tokens} | {masked:.0f} | {plain:.0f} | {masked / plain:.2f} |")


if __name__ == "__main__":
    main()
