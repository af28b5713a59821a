"""Speculative decoding on the default model (ADR-0038): one entry holding all 30 layers,
greedy, with drafts against without: the same tokens, for a quote, a code edit and free
text, at this CPU's compute dtype and at the other one; drafts by prompt lookup, by the
default model itself (all of them stand) and by a tiny random model with its vocabulary."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest
import torch

from meshnet.assemble.entry import load_entry_model, make_generator
from meshnet.assemble.node import node_service
from meshnet.config import AccessConfig, EntryConfig, NodeConfig
from meshnet.entry.routes import StaticRoutes
from meshnet.entry.transport import HttpTransport
from meshnet.errors import ConfigError
from meshnet.text.events import Finished
from meshnet.text.params import GenerationParams, SamplingParams
from meshnet.types import ComputeDtype, LayerSpan
from tests.models.fixtures import _LLAMA_SHAPE

GREEDY = GenerationParams(max_tokens=40, sampling=SamplingParams(temperature=0.0))
QUOTE = (
    "Repeat this sentence exactly: The quick brown fox jumps over the lazy dog while the "
    "farmer watches from the old wooden fence."
)
CODE = (
    "Rename the variable total to amount in this code:\n"
    "def add(items):\n    total = 0\n    for x in items:\n        total += x\n    return total\n"
)
NEAR_TIE = 0.25  # logits: top-2 this close may swap when bf16 sums run in another order
PROMPTS = {"quote": QUOTE, "code edit": CODE, "free text": "Write a short poem about tea."}


def generators(drafts: list[EntryConfig]) -> list[object]:
    # torch: the references here are transformers' own fp32 model on the same dequantized weights
    config = NodeConfig(quant=None, compile=False, port=0, backend="torch")
    model = load_entry_model(config, "default", "default", LayerSpan(0, 30))
    service = node_service(config, "entry", AccessConfig())
    service.shards.add(model.runner)
    routes, transport = StaticRoutes([]), HttpTransport()
    return [make_generator(model, service, routes, transport, entry) for entry in drafts]


def ends(
    generator: object, prompts: list[str], params: GenerationParams = GREEDY
) -> list[Finished]:
    async def run() -> list[Finished]:
        out = []
        for text in prompts:
            ids = generator.codec.chat([{"role": "user", "content": text}])  # type: ignore[attr-defined]
            async for event in generator.stream(ids, params):  # type: ignore[attr-defined]
                if isinstance(event, Finished):
                    out.append(event)
        return out

    return asyncio.run(run())


def assert_same_up_to_a_near_tie(
    reference: Any, prompt: list[int], plain: list[int], drafted: list[int], name: str
) -> None:
    """`drafted` equals `plain`, or they part where the fp32 model's two tokens are within
    NEAR_TIE logits. A verify pass of up to 9 tokens and one-token steps round bf16 sums in
    another order: on an AMX Xeon "free text" parts at token 30, 16.425 against 16.346 in
    fp32 and 16.5 for both in bf16; fp32 computing measures no parting."""
    if drafted == plain:
        return
    at = next((i for i, (p, d) in enumerate(zip(plain, drafted, strict=False)) if p != d), None)
    assert at is not None, f"{name}: one answer is a prefix of the other"
    with torch.inference_mode():
        logits = reference(torch.tensor([prompt + plain[:at]])).logits[0, -1]
    best = float(logits.max())
    margins = [best - float(logits[t]) for t in (plain[at], drafted[at])]
    assert max(margins) <= NEAR_TIE, f"{name}: parts at token {at}, margins {margins}"


@pytest.mark.slow
def test_drafted_greedy_tokens_equal_plain_ones_on_the_default_model(
    compute: ComputeDtype, smollm_reference: Any
) -> None:
    plain, drafting = generators([EntryConfig(seed=0, draft=d) for d in ("none", "lookup")])
    alone, drafted = ends(plain, [*PROMPTS.values()]), ends(drafting, [*PROMPTS.values()])
    for (name, text), a, d in zip(PROMPTS.items(), alone, drafted, strict=True):
        ids = plain.codec.chat([{"role": "user", "content": text}])  # type: ignore[attr-defined]
        assert_same_up_to_a_near_tie(smollm_reference, ids, a.token_ids, d.token_ids, name)
        assert a.drafted_tokens == 0  # one round a token (and one that gave end-of-text)
        assert a.decode_rounds in (a.completion_tokens - 1, a.completion_tokens)
    # this 135M model paraphrases more than it copies; measured 20 of 46 drafts stood (fp32)
    assert sum(d.accepted_tokens for d in drafted) >= 8
    assert all(d.accepted_tokens <= d.drafted_tokens for d in drafted)
    assert all(d.decode_rounds < a.decode_rounds for d, a in zip(drafted, alone, strict=True))


def save_tiny_draft(folder: Path) -> Path:
    """A 2-layer random llama with the default model's 49,152-token vocabulary."""
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    shape = {**_LLAMA_SHAPE, "vocab_size": 49152, "num_hidden_layers": 2}
    AutoModelForCausalLM.from_config(AutoConfig.for_model("llama", **shape)).save_pretrained(folder)
    return folder


@pytest.mark.slow
def test_a_draft_model_changes_nothing_and_the_model_itself_drafts_all_right(
    tmp_path: Path,
) -> None:
    tiny = str(save_tiny_draft(tmp_path / "draft"))
    entries = [EntryConfig(seed=0)] + [
        EntryConfig(seed=0, draft="model", draft_model=m, max_draft_tokens=4)
        for m in ("default", tiny)
    ]
    plain, itself, small = generators(entries)
    prompt = [PROMPTS["quote"]]
    want = ends(plain, prompt)[0]
    by_itself, by_small = ends(itself, prompt)[0], ends(small, prompt)[0]
    assert by_itself.token_ids == by_small.token_ids == want.token_ids
    assert by_itself.drafted_tokens > 0 and by_small.drafted_tokens > 0
    # greedy drafts of the same model stand but where a one-token step and a verify pass
    # round a near-tie differently
    assert by_itself.accepted_tokens >= 0.9 * by_itself.drafted_tokens
    assert by_small.accepted_tokens < by_small.drafted_tokens  # random weights guess wrong


def test_a_draft_model_with_another_vocabulary_is_refused(
    tiny_folder: object,
) -> None:
    tiny = str(tiny_folder("llama"))  # type: ignore[operator]
    with pytest.raises(ConfigError, match="share its tokenizer"):
        generators([EntryConfig(draft="model", draft_model=tiny)])


@pytest.mark.slow
def test_drafted_turns_that_reuse_the_conversation_equal_fresh_ones(
    compute: ComputeDtype, smollm_reference: Any
) -> None:
    """ADR-0058 with real weights and lookup drafts: each turn of a chat, reusing the kept
    prefix of the one before, gives the tokens the same turn gives prefilled from nothing."""
    (drafting,) = generators([EntryConfig(seed=0, draft="lookup")])
    codec = drafting.codec  # type: ignore[attr-defined]
    params = GenerationParams(max_tokens=24, sampling=SamplingParams(temperature=0.0))
    messages = [{"role": "system", "content": "You repeat what you are asked to. " * 4}]

    async def answer(ids: list[int], cache: bool) -> Finished:
        asked = GenerationParams(**{**vars(params), "cache_prompt": cache})
        async for event in drafting.stream(ids, asked, "key:test"):  # type: ignore[attr-defined]
            if isinstance(event, Finished):
                return event
        raise AssertionError("no end")

    reused = []
    for text in (QUOTE, "Now repeat it again, word for word.", CODE):
        messages.append({"role": "user", "content": text})
        ids = codec.chat(messages)
        cached, fresh = asyncio.run(answer(ids, True)), asyncio.run(answer(ids, False))
        assert_same_up_to_a_near_tie(smollm_reference, ids, fresh.token_ids, cached.token_ids, text)
        reused.append(cached.cached_tokens)
        assert cached.drafted_tokens > 0
        messages.append({"role": "assistant", "content": codec.decode(cached.token_ids)})
    assert reused[0] == 0 and all(r >= 64 for r in reused[1:]), reused  # whole blocks
