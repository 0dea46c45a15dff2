"""Decode graphs without a GPU: bucket choice, the packed static inputs, refusals, and the body a graph
captures (run eagerly on the CPU) against paged_forward."""

from __future__ import annotations

import pytest
import torch

from services.worker.models.cuda_graphs import (
    DecodeAttention,
    DecodeGraphs,
    GraphCaptureError,
    StaticDecodeInputs,
    bucket_for,
    graph_refusal,
    pack_decode_batch,
)
from services.worker.models.llama_config import LlamaFamilyConfig
from services.worker.models.llama_family import LlamaFamilyLM
from services.worker.models.paged import KVCache, PagedSequence, paged_forward
from services.worker.models.transformer import DecoderLM, TransformerConfig

BLOCK_SIZE = 4
NUM_BLOCKS = 20
PADDING_SLOT = (NUM_BLOCKS - 1) * BLOCK_SIZE  # the last block is reserved for padding rows
PROMPTS = [[1, 2, 3, 4, 5], [6, 7], [8, 9, 10, 11, 12, 13, 14, 15, 16]]
TABLES = [(3, 0, 5), (7, 1), (2, 9, 11, 4)]  # scattered, never the identity


def make_lm() -> DecoderLM:
    torch.manual_seed(0)
    config = TransformerConfig(vocab_size=40, num_layers=2, d_model=32, num_heads=4, num_kv_heads=2, d_ff=64)
    return DecoderLM(config).eval()


def make_cache() -> KVCache:
    return KVCache(num_layers=2, num_blocks=NUM_BLOCKS, block_size=BLOCK_SIZE, num_kv_heads=2, head_size=8)


def decode(token: int, prompt: list[int], table: tuple[int, ...]) -> PagedSequence:
    return PagedSequence((token,), len(prompt), table, needs_logits=True)


def prefilled_pair(lm: DecoderLM | LlamaFamilyLM) -> tuple[KVCache, KVCache]:
    """Two caches holding the same prefilled prompts: one for paged_forward, one for the graphs' body."""
    eager, graphed = make_cache(), make_cache()
    with torch.inference_mode():
        paged_forward(lm, [PagedSequence(tuple(p), 0, t, True) for p, t in zip(PROMPTS, TABLES, strict=True)], eager)
    for layer in range(2):
        graphed.key[layer].copy_(eager.key[layer])
        graphed.value[layer].copy_(eager.value[layer])
    return eager, graphed


def test_bucket_for_picks_the_smallest_bucket_that_holds_the_batch():
    buckets = (1, 2, 4, 8, 16, 32)
    assert [bucket_for(n, buckets) for n in (1, 2, 3, 4, 5, 17, 32)] == [1, 2, 4, 4, 8, 32, 32]


def test_bucket_for_refuses_a_batch_above_the_largest_bucket_and_an_empty_one():
    with pytest.raises(ValueError, match="33 sequences exceed the largest captured batch size 32"):
        bucket_for(33, (1, 2, 4, 8, 16, 32))
    with pytest.raises(ValueError, match="at least one sequence"):
        bucket_for(0, (1, 2))


def test_pack_fills_real_rows_and_pads_the_rest_harmlessly():
    seqs = [PagedSequence((11,), 5, (3, 0, 5), True), PagedSequence((12,), 1, (7, 1, 8), True)]
    batch = pack_decode_batch(seqs, bucket=4, width=3, block_size=BLOCK_SIZE, padding_slot=PADDING_SLOT,
                              padding_block=NUM_BLOCKS - 1)
    tokens, positions, slots = batch.ints64.reshape(3, 4)
    assert tokens.tolist() == [11, 12, 0, 0]
    assert positions.tolist() == [5, 1, 0, 0]
    # position 5 is offset 1 of logical block 1 (physical 0); position 1 is offset 1 of physical block 7
    assert slots.tolist() == [0 * 4 + 1, 7 * 4 + 1, PADDING_SLOT, PADDING_SLOT]
    tables, lens = batch.ints32[:12].reshape(4, 3), batch.ints32[12:]
    assert tables.tolist() == [[3, 0, 19], [7, 19, 19], [19, 19, 19], [19, 19, 19]]  # only needed blocks copied
    assert lens.tolist() == [6, 2, 1, 1]


def test_pack_refuses_a_sequence_wider_than_the_tables():
    seq = PagedSequence((1,), 12, (0, 1, 2, 3), True)  # context 13 needs 4 blocks of 4
    with pytest.raises(ValueError, match="needs 4 blocks; the graphs' tables hold 3"):
        pack_decode_batch([seq], bucket=1, width=3, block_size=BLOCK_SIZE, padding_slot=-1, padding_block=0)


@pytest.mark.parametrize(("seqs", "reason"), [
    ([PagedSequence((1, 2), 0, (0,), True)], "brings 2 new tokens"),
    ([PagedSequence((1,), 3, (0,), True, all_logits=True)], "exactly its last token's logits"),
    ([PagedSequence((1,), 3, (0,), False)], "exactly its last token's logits"),
    ([PagedSequence((1,), 8, (0, 1, 2), True)], "past the graphs' 2 blocks"),
    ([PagedSequence((1,), 0, (0,), True)] * 5, "5 sequences exceed the largest captured batch size 4"),
    ([], "no sequences"),
])
def test_graph_refusal_names_what_keeps_a_step_eager(seqs, reason):
    assert reason in graph_refusal(seqs, (1, 2, 4), max_blocks_per_seq=2, block_size=BLOCK_SIZE)


def test_graph_refusal_accepts_plain_decode_steps():
    seqs = [PagedSequence((1,), 7, (0, 1), True), PagedSequence((2,), 0, (3,), True)]
    assert graph_refusal(seqs, (1, 2, 4), max_blocks_per_seq=2, block_size=BLOCK_SIZE) is None


def test_static_inputs_fill_in_place_and_their_views_read_the_packed_step():
    inputs = StaticDecodeInputs(bucket=2, width=3, device=torch.device("cpu"))
    pointers = (inputs.ints64.data_ptr(), inputs.ints32.data_ptr())
    seqs = [PagedSequence((9,), 4, (2, 6), True)]
    inputs.fill(pack_decode_batch(seqs, bucket=2, width=3, block_size=BLOCK_SIZE, padding_slot=-1,
                                  padding_block=0))
    assert (inputs.ints64.data_ptr(), inputs.ints32.data_ptr()) == pointers  # a graph keeps reading these
    assert inputs.tokens.tolist() == [9, 0]
    assert inputs.positions.tolist() == [4, 0]
    assert inputs.slots.tolist() == [6 * 4 + 0, -1]
    assert inputs.block_tables.tolist() == [[2, 6, 0], [0, 0, 0]]
    assert inputs.context_lens.tolist() == [5, 1]
    assert all(t.is_contiguous() for t in (inputs.tokens, inputs.slots, inputs.block_tables, inputs.context_lens))


@pytest.mark.parametrize(("attention", "padding_slot"), [(DecodeAttention.KERNEL, -1),
                                                          (DecodeAttention.TORCH, PADDING_SLOT)])
def test_graph_body_matches_paged_forward_and_padding_rows_touch_no_real_block(attention, padding_slot):
    lm = make_lm()
    eager, graphed = prefilled_pair(lm)
    graphs = DecodeGraphs(lm, graphed, max_blocks_per_seq=4, buckets=(1, 2, 4), attention=attention,
                          padding_slot=padding_slot)
    seqs = [decode(20 + i, p, t) for i, (p, t) in enumerate(zip(PROMPTS, TABLES, strict=True))]  # bucket 4
    with torch.inference_mode():
        expected = paged_forward(lm, seqs, eager)
    got = graphs.run_uncaptured(seqs)
    assert got.shape == expected.shape == (3, 40)
    # The bucket's matmuls have one row more than the eager step's, so the float sums may round apart.
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    real_blocks = slice(0, NUM_BLOCKS - 1)
    for layer in range(2):
        torch.testing.assert_close(graphed.key[layer][real_blocks], eager.key[layer][real_blocks], rtol=1e-5,
                                   atol=1e-5)
        torch.testing.assert_close(graphed.value[layer][real_blocks], eager.value[layer][real_blocks], rtol=1e-5,
                                   atol=1e-5)


def make_windowed_lm() -> LlamaFamilyLM:
    """A Gemma 2 shaped model (layer 0 slides over 3 tokens, scores and logits softcapped), random weights."""
    config = LlamaFamilyConfig(
        architecture="Gemma2ForCausalLM", vocab_size=40, num_layers=2, d_model=32, num_heads=4, num_kv_heads=2,
        head_size=8, d_ff=64, max_position_embeddings=64, max_seq_len=64, post_norms=True, norm_plus_one=True,
        activation="gelu_pytorch_tanh", embedding_normalizer=True, layer_windows=(3, 0), attention_softcap=2.0,
        final_logit_softcap=5.0, tie_word_embeddings=True)
    lm = LlamaFamilyLM(config)
    torch.manual_seed(0)
    with torch.no_grad():
        for param in lm.parameters():
            param.normal_(0.0, 0.3)
    return lm.eval()


@pytest.mark.parametrize(("attention", "padding_slot"), [(DecodeAttention.KERNEL, -1),
                                                          (DecodeAttention.TORCH, PADDING_SLOT)])
def test_graph_body_keeps_sliding_windows_and_softcaps(attention, padding_slot):
    lm = make_windowed_lm()
    eager, graphed = prefilled_pair(lm)
    graphs = DecodeGraphs(lm, graphed, max_blocks_per_seq=4, buckets=(4,), attention=attention,
                          padding_slot=padding_slot)
    seqs = [decode(20 + i, p, t) for i, (p, t) in enumerate(zip(PROMPTS, TABLES, strict=True))]
    with torch.inference_mode():
        expected = paged_forward(lm, seqs, eager)
    torch.testing.assert_close(graphs.run_uncaptured(seqs), expected, rtol=1e-5, atol=1e-5)


def test_greedy_decode_through_the_graph_body_follows_paged_forward():
    lm = make_lm()
    eager, graphed = prefilled_pair(lm)
    graphs = DecodeGraphs(lm, graphed, max_blocks_per_seq=4, buckets=(1, 2, 4))
    ids_eager = [list(p) for p in PROMPTS]
    ids_graph = [list(p) for p in PROMPTS]
    tokens = [17, 18, 19]
    for _ in range(3):  # positions stay within each table
        for ids, token in zip(ids_eager, tokens, strict=True):
            ids.append(token)
        for ids, token in zip(ids_graph, tokens, strict=True):
            ids.append(token)
        step = [PagedSequence((ids[-1],), len(ids) - 1, t, True) for ids, t in zip(ids_eager, TABLES, strict=True)]
        with torch.inference_mode():
            expected = paged_forward(lm, step, eager).argmax(-1).tolist()
        got = graphs.run_uncaptured(step).argmax(-1).tolist()
        assert got == expected
        tokens = got


def test_run_refuses_a_step_that_is_not_plain_decode():
    graphs = DecodeGraphs(make_lm(), make_cache(), max_blocks_per_seq=4, buckets=(1, 2))
    with pytest.raises(ValueError, match="not a decode-graph step: 3 sequences exceed"):
        graphs.run_uncaptured([PagedSequence((1,), 0, (0,), True)] * 3)


def test_capture_needs_a_cuda_cache():
    graphs = DecodeGraphs(make_lm(), make_cache(), max_blocks_per_seq=4, buckets=(1,))
    with pytest.raises(GraphCaptureError, match="need a CUDA cache"):
        graphs.capture()
    assert not graphs.captured


def test_torch_attention_needs_a_reserved_padding_slot():
    with pytest.raises(ValueError, match="padding_slot must be a reserved slot"):
        DecodeGraphs(make_lm(), make_cache(), max_blocks_per_seq=4, attention=DecodeAttention.TORCH)
    with pytest.raises(ValueError, match="outside the cache's 80 slots"):
        DecodeGraphs(make_lm(), make_cache(), max_blocks_per_seq=4, padding_slot=80)
