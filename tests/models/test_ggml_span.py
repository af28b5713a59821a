"""The ggml span over the default model's GGUF file: chained spans equal the whole model bit
for bit, batching, rewinds and forks keep each session's results, the torch runner on the same
dequantized weights agrees within tolerance, and a bad file is refused naming the tensor."""

from __future__ import annotations

import mmap
from pathlib import Path

import numpy as np
import pytest
import torch

from meshnet.errors import ModelError
from meshnet.models.ggml_span import GgmlSpan, MappedWeights
from meshnet.models.gguf_file import GgufFile, GgufTensor, read_gguf
from meshnet.models.source import resolve
from meshnet.types import LayerSpan

WIDTH = 576  # the default model's hidden size


@pytest.fixture(scope="module")
def path() -> Path:
    return resolve("default").path


@pytest.fixture(scope="module")
def prompt() -> np.ndarray:
    """Token embeddings of a real prompt (the file's own table, dequantized): [T, H]."""
    from meshnet.models.loader import load_head

    head = load_head(resolve("default"))
    ids = torch.tensor([[504, 3575, 282, 4649, 314]])  # "The capital of France is"
    return head.embed_tokens(ids, 0)[0].float().numpy()


def spans(path: Path, *cuts: int) -> list[GgmlSpan]:
    edges = [0, *cuts, 30]
    return [GgmlSpan(path, LayerSpan(a, b)) for a, b in zip(edges[:-1], edges[1:], strict=True)]


def run_chain(chain: list[GgmlSpan], hidden: np.ndarray, caches: list, position: int) -> np.ndarray:
    for span, cache in zip(chain, caches, strict=True):
        hidden = span.forward(hidden, cache, position)
    return hidden


def test_chained_spans_equal_the_whole_model_bit_for_bit(path: Path, prompt: np.ndarray) -> None:
    whole, parts = spans(path), spans(path, 7, 19)
    whole_caches = [s.new_cache() for s in whole]
    part_caches = [s.new_cache() for s in parts]
    for position, hidden in ((0, prompt), (5, prompt[:1]), (6, prompt[2:4])):
        expected = run_chain(whole, hidden, whole_caches, position)
        got = run_chain(parts, hidden, part_caches, position)
        assert np.array_equal(got, expected)
    assert [c.length for c in part_caches] == [8, 8, 8]


def test_a_batched_round_equals_each_frame_alone(path: Path, prompt: np.ndarray) -> None:
    (span,) = spans(path)
    alone = [span.new_cache() for _ in range(3)]
    together = [span.new_cache() for _ in range(3)]
    for caches in (alone, together):  # three sessions at different lengths
        for i, cache in enumerate(caches):
            span.forward(prompt[: i + 2], cache, 0)
    frames = [prompt[4:5], prompt[0:3], prompt[1:2]]  # a decode step, a chunk, a decode step
    expected = [span.forward(f, c, c.length) for f, c in zip(frames, alone, strict=True)]
    got = span.forward_many(frames, together, [c.length for c in together])
    for a, b in zip(got, expected, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-3 * np.abs(b).max())
    assert [c.length for c in together] == [3, 6, 5]


def test_a_rewound_or_forked_cache_continues_as_the_original(
    path: Path, prompt: np.ndarray
) -> None:
    (span,) = spans(path, 10)[:1]
    cache = span.new_cache()
    span.forward(prompt[:3], cache, 0)
    fork = cache.copy(3)
    first = span.forward(prompt[3:5], cache, 3)
    cache.truncate(3)  # the two drafted tokens rejected (ADR-0038)
    again = span.forward(prompt[3:5], cache, 3)
    forked = span.forward(prompt[3:5], fork, 3)
    assert np.array_equal(first, again) and np.array_equal(first, forked)
    assert cache.length == fork.length == 5


def test_ggml_agrees_with_the_torch_runner_on_the_same_weights(
    path: Path, prompt: np.ndarray
) -> None:
    """One layer: the file's Q4_1 weights dequantized for torch (fp32) against ggml's own
    kernels (activations quantized to 8 bits for the products, keys and values in f16)."""
    from meshnet.models.cache import new_cache
    from meshnet.models.loader import load_shard

    torch_shard = load_shard(resolve("default"), LayerSpan(3, 4), "fp32", fast=False)
    (span,) = [GgmlSpan(path, LayerSpan(3, 4))]
    cache, torch_cache = span.new_cache(), new_cache()
    for position, hidden in ((0, prompt), (5, prompt[1:2])):
        got = span.forward(hidden, cache, position)
        want = torch_shard.forward(torch.from_numpy(hidden)[None], torch_cache, position)
        want_np = want[0].float().numpy()
        error = np.linalg.norm(got - want_np) / np.linalg.norm(want_np)
        assert error < 0.02, error


def test_the_whole_model_predicts_paris(path: Path, prompt: np.ndarray) -> None:
    from meshnet.models.loader import load_head

    head = load_head(resolve("default"))
    (span,) = spans(path)
    out = span.forward(prompt, span.new_cache(), 0)
    logits = head.logits(torch.from_numpy(out[-1:])[None])
    assert int(logits[0, -1].argmax()) == 7042  # " Paris"


def test_weights_are_the_files_own_pages(path: Path) -> None:
    (span,) = spans(path)
    file = read_gguf(path)
    layer_bytes = sum(t.data.nbytes for t in file.tensors if t.name.startswith("blk."))
    assert span.weight_bytes == layer_bytes  # Q4_1 as stored: nothing widened or copied


def fake_file(tensor_type: int, shape: tuple[int, ...], nbytes: int) -> GgufFile:
    from gguf.constants import GGMLQuantizationType

    mapped = mmap.mmap(-1, 4096)
    data = np.frombuffer(mapped, np.uint8, nbytes)
    tensor = GgufTensor("blk.0.attn_q.weight", GGMLQuantizationType(tensor_type), shape, data)
    return GgufFile({}, [tensor], mapped)


@pytest.mark.parametrize(
    ("tensor_type", "shape", "nbytes", "reason"),
    [
        (2, (64, 2), 36, "holds 36 bytes"),  # Q4_0: 2 rows of 2 blocks need 72
        (16, (256, 1), 66, "cannot compute"),  # IQ2_XXS: not a type meshnet's ggml takes
    ],
)
def test_a_tensor_ggml_cannot_take_is_refused_by_name(
    tensor_type: int, shape: tuple[int, ...], nbytes: int, reason: str
) -> None:
    file = fake_file(tensor_type, shape, nbytes)
    with pytest.raises(ModelError, match=rf"blk\.0\.attn_q\.weight.*{reason}"):
        MappedWeights(file, ["blk.0.attn_q.weight"], Path("bad.gguf"))


def test_layers_past_the_model_are_refused(path: Path) -> None:
    with pytest.raises(ModelError, match="outside the model's 30 layers"):
        GgmlSpan(path, LayerSpan(20, 31))


def test_the_head_gathers_the_files_rows_and_scores_with_its_table(
    path: Path, prompt: np.ndarray
) -> None:
    """Embeddings are the Q8_0 table's rows as torch dequantizes them; logits agree with a
    float32 head on the same table within ggml's 8-bit activations."""
    from meshnet.models.ggml_head import GgmlHead
    from meshnet.models.loader import load_head

    head, reference = GgmlHead(path), load_head(resolve("default"))
    ids = np.array([504, 3575, 282, 4649, 314])
    np.testing.assert_allclose(head.embed(ids), prompt, rtol=1e-6)
    assert head.vocab == 49152 and head.weight_bytes < 49152 * 576 * 2  # Q8_0, not widened
    got = head.logits(prompt)
    want = reference.logits(torch.from_numpy(prompt)[None])[0].numpy()
    assert np.linalg.norm(got - want) / np.linalg.norm(want) < 0.02
    assert (got.argmax(-1) == want.argmax(-1)).all()


def test_decode_steps_reuse_one_graph_and_answer_as_fresh_ones(
    path: Path, prompt: np.ndarray
) -> None:
    """A decode step's graph is kept for the next steps (same shapes: a round attends over
    the pool's cells padded to 256, masked); free cells never leak in, even when a failed
    round left NaN there."""
    kept, fresh = spans(path, 12)[0], spans(path, 12)[0]
    caches = [kept.new_cache(), fresh.new_cache()]
    for span, cache in zip((kept, fresh), caches, strict=True):
        span.forward(prompt, cache, 0)
    graphs = set()
    for step in range(4):
        got = kept.forward(prompt[step : step + 1], caches[0], 5 + step)
        graphs.add(id(kept.graph.kept_builder()))
        fresh.graph.drop_kept()
        fresh.pool.data[:, :, fresh.pool.owner < 0] = np.nan  # what a failed round may leave
        want = fresh.forward(prompt[step : step + 1], caches[1], 5 + step)
        assert np.array_equal(got, want) and np.isfinite(got).all()
    assert len(graphs) == 1


def test_the_pool_grows_and_frees_the_cells_of_cut_and_dropped_sessions(
    path: Path, prompt: np.ndarray
) -> None:
    (span,) = spans(path, 4)[:1]
    long = np.tile(prompt, (70, 1))  # 350 tokens: past the pool's first 256 cells
    grown, whole = span.new_cache(), span.new_cache()
    span.forward(long[:200], grown, 0)
    first = span.forward(long[200:], grown, 200)
    second = span.forward(long, whole, 0)[200:]
    # another chunking, and cells elsewhere in the pool: ggml's flash attention adds in f16
    # tile by tile, so where a session's cells fall moves its sums (0.65% over 4 layers)
    assert np.linalg.norm(first - second) / np.linalg.norm(second) < 0.02
    assert span.pool.capacity >= 700 and (span.pool.owner >= 0).sum() == 700
    grown.truncate(100)  # a rewind
    del whole  # a dropped session
    assert (span.pool.owner >= 0).sum() == 100


def test_free_cells_past_the_last_taken_go_back_to_the_system_and_read_as_zeros(
    path: Path, prompt: np.ndarray
) -> None:
    """Review K1: the pool keeps its size (the rounds' graphs depend on it) but gives the
    pages of the cells its closed sessions held back; a session taking them again computes
    as in a fresh pool."""
    span = GgmlSpan(path, LayerSpan(0, 10))
    long = np.tile(prompt, (240, 1))  # 1,200 tokens: 8.8 MiB of keys and values
    first = span.new_cache()
    span.forward(long, first, 0)
    capacity, before = span.pool.capacity, _anon_kib()
    del first
    given = span.pool.give_back()
    assert given > 8 * 2**20 and before - _anon_kib() > 6 * 1024  # the kernel has them
    assert span.pool.capacity == capacity and span.pool.give_back() == 0  # nothing twice
    again = span.new_cache()
    fresh = GgmlSpan(path, LayerSpan(0, 10))
    reference = fresh.forward(long[:300], fresh.new_cache(), 0)
    np.testing.assert_array_equal(span.forward(long[:300], again, 0), reference)


def _anon_kib() -> int:
    """This process's resident anonymous memory (KiB)."""
    line = next(x for x in Path("/proc/self/status").read_text().splitlines() if "RssAnon" in x)
    return int(line.split()[1])


def test_a_truncated_file_is_refused_naming_the_first_tensor_past_its_end(
    path: Path, tmp_path: Path
) -> None:
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(path.read_bytes()[:-5_000_000])
    with pytest.raises(
        ModelError, match=r"cut\.gguf is truncated: tensor 'blk\.\d+\.[a-z_.]+' ends"
    ):
        GgmlSpan(cut, LayerSpan(0, 2))


def test_the_tracker_sizes_gguf_layers_as_the_file_holds_them(path: Path) -> None:
    from meshnet.models.sizing import file_layer_bytes
    from meshnet.tracker.offers import offer

    (span,) = spans(path)
    assert file_layer_bytes(path) * 30 == span.weight_bytes  # Q4_1 throughout: every layer alike
    model = offer("default")
    assert model.layer_bytes["gguf"] == file_layer_bytes(path)
    assert model.layer_bytes["gguf"] < model.layer_bytes["int8"] < model.layer_bytes["bf16"]
