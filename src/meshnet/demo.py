"""`meshnet demo`: the README's first command.

Until the tracker and the entry node exist (later issues), the demo runs the smallest real
thing that works: the default model split into three shards in this process, each boundary
crossing the real wire format (encode, bytes, decode), answering one chat question.
"""

from __future__ import annotations

import time

from meshnet.config import WireConfig
from meshnet.models.cache import new_cache
from meshnet.models.loader import load_head, load_shard, load_tokenizer
from meshnet.models.source import resolve
from meshnet.types import LayerSpan, ModelId, SessionId
from meshnet.wire import FrameMeta, decode, encode

QUESTION = "What is the capital of France?"


def run_demo(max_tokens: int = 32) -> int:
    print("meshnet demo (in-process; the multi-process mesh arrives with the tracker issues)")
    source = resolve("default")
    tokenizer = load_tokenizer(source)
    spans = LayerSpan(0, source.spec.num_layers).split(3)
    shards = [load_shard(source, span) for span in spans]
    head = load_head(source, shards[0].compute_dtype)
    print(
        f"model {source.path.name}: {source.spec.num_layers} layers as shards "
        f"{', '.join(str(s) for s in spans)} ({shards[0].quant})"
    )
    ids = tokenizer.apply_chat_template(
        [{"role": "user", "content": QUESTION}],
        add_generation_prompt=True,
        return_tensors="pt",
        return_dict=True,
    )["input_ids"]
    caches, position, answer, sent = [new_cache() for _ in shards], 0, [], 0
    start = time.perf_counter()
    for _ in range(max_tokens):
        hidden = head.embed_tokens(ids, position)
        for shard, cache in zip(shards, caches, strict=True):
            meta = FrameMeta(SessionId("demo"), ModelId("default"), shard.span, position)
            frame = encode(hidden, meta, WireConfig())
            sent += len(frame.body)
            hidden = shard.forward(decode(frame.headers, bytes(frame.body))[1], cache, position)
        position += ids.shape[1]
        ids = head.logits(hidden)[:, -1:].argmax(-1)
        if int(ids) == tokenizer.eos_token_id:
            break
        answer.append(int(ids))
    seconds = time.perf_counter() - start
    print(f"Q: {QUESTION}\nA: {tokenizer.decode(answer)}")
    print(
        f"{len(answer)} tokens in {seconds:.2f} s ({len(answer) / seconds:.1f} tokens/s), "
        f"{sent} activation bytes over {len(spans)} boundaries"
    )
    return 0
