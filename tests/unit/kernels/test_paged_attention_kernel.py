import numpy as np
import pytest
import torch

from kernels import paged_attention_decode

BLOCK_SIZE = 16


def make_batch(rng, context_lens, *, num_heads=8, num_kv_heads=2, head_size=64, spare_blocks=7, query_scale=1.0):
    """Random K/V pool and block tables: each sequence gets distinct, shuffled physical blocks."""
    context_lens = np.asarray(context_lens, np.int32)
    blocks_per_seq = (context_lens + BLOCK_SIZE - 1) // BLOCK_SIZE
    num_blocks = int(blocks_per_seq.sum()) + spare_blocks
    max_blocks = int(blocks_per_seq.max()) + 2  # unused trailing entries, as a real table has
    pool = rng.permutation(num_blocks).astype(np.int32)
    block_tables = np.full((len(context_lens), max_blocks), -1, np.int32)
    start = 0
    for seq, count in enumerate(blocks_per_seq):
        block_tables[seq, :count] = pool[start : start + count]
        start += count
    cache_shape = (num_blocks, BLOCK_SIZE, num_kv_heads, head_size)
    return {
        "query": rng.standard_normal((len(context_lens), num_heads, head_size), dtype=np.float32) * query_scale,
        "key_cache": rng.standard_normal(cache_shape, dtype=np.float32),
        "value_cache": rng.standard_normal(cache_shape, dtype=np.float32),
        "block_tables": block_tables,
        "context_lens": context_lens,
        "block_size": BLOCK_SIZE,
        "scale": head_size**-0.5,
    }


def dense_attention_float64(batch, sliding_window=0, softcap=0.0):
    """Independent check of the reference: plain loops over the window's tokens in float64."""
    q = batch["query"].astype(np.float64)
    num_seqs, num_heads, head_size = q.shape
    group = num_heads // batch["key_cache"].shape[2]
    out = np.empty_like(q)
    for seq in range(num_seqs):
        context_len = batch["context_lens"][seq]
        first = max(0, context_len - sliding_window) if sliding_window else 0
        tokens = [(batch["block_tables"][seq, t // BLOCK_SIZE], t % BLOCK_SIZE) for t in range(first, context_len)]
        for head in range(num_heads):
            keys = np.array([batch["key_cache"][b, o, head // group] for b, o in tokens], np.float64)
            values = np.array([batch["value_cache"][b, o, head // group] for b, o in tokens], np.float64)
            scores = keys @ q[seq, head] * batch["scale"]
            if softcap:
                scores = softcap * np.tanh(scores / softcap)
            weights = np.exp(scores - scores.max())
            out[seq, head] = weights @ values / weights.sum()
    return out


def poison_before_window(batch, sliding_window):
    """NaN in the K/V rows before each sequence's window: a kernel that reads one, even at weight 0, returns NaN."""
    for seq, context_len in enumerate(batch["context_lens"]):
        for t in range(max(0, int(context_len) - sliding_window)):
            block = batch["block_tables"][seq, t // BLOCK_SIZE]
            batch["key_cache"][block, t % BLOCK_SIZE] = np.nan
            batch["value_cache"][block, t % BLOCK_SIZE] = np.nan
    return batch


def test_cpu_twin_matches_reference_on_realistic_batch(rng, assert_close):
    batch = make_batch(rng, rng.integers(1, 600, size=24))
    assert_close(paged_attention_decode(**batch, backend="cpu"), paged_attention_decode(**batch, backend="reference"))


@pytest.mark.parametrize(
    "context_lens",
    [[1], [BLOCK_SIZE], [2 * BLOCK_SIZE], [BLOCK_SIZE + 1], [3 * BLOCK_SIZE - 1], [1, BLOCK_SIZE, 5, 100, 33]],
    ids=["one-token", "one-full-block", "block-boundary", "one-past-boundary", "partial-last-block", "mixed"],
)
def test_cpu_twin_and_reference_match_float64_loops_at_edges(rng, assert_close, context_lens):
    batch = make_batch(rng, context_lens)
    want = dense_attention_float64(batch)
    assert_close(paged_attention_decode(**batch, backend="cpu"), want)
    assert_close(paged_attention_decode(**batch, backend="reference"), want)


# (context_lens, sliding_window): where the window starts against the context and the blocks of 16.
WINDOW_CASES = {
    "shorter-than-context-mid-block": ([50], 20),  # first token 30: 14 rows into block 1
    "starts-at-block-boundary": ([50], 18),  # first token 32: block 2's first row
    "equals-context": ([40], 40),
    "longer-than-context": ([40, 5], 1000),
    "one-token": ([1, 17, 64], 1),
    "mixed": ([1, BLOCK_SIZE, 33, 100, 300], 32),
}


@pytest.mark.parametrize("softcap", [0.0, 2.0], ids=["no-cap", "capped"])
@pytest.mark.parametrize(("context_lens", "sliding_window"), WINDOW_CASES.values(), ids=WINDOW_CASES.keys())
def test_window_attends_to_the_last_tokens_only_and_reads_none_before(rng, assert_close, context_lens,
                                                                       sliding_window, softcap):
    batch = poison_before_window(make_batch(rng, context_lens, query_scale=4.0), sliding_window)
    want = dense_attention_float64(batch, sliding_window, softcap)
    for backend in ("cpu", "reference"):
        assert_close(paged_attention_decode(**batch, backend=backend, sliding_window=sliding_window,
                                            softcap=softcap), want)


def test_window_of_one_token_returns_the_last_tokens_value(rng):
    batch = make_batch(rng, [37], num_heads=4, num_kv_heads=4)
    block = batch["block_tables"][0, 36 // BLOCK_SIZE]
    out = paged_attention_decode(**batch, backend="cpu", sliding_window=1)
    np.testing.assert_allclose(out[0], batch["value_cache"][block, 36 % BLOCK_SIZE], rtol=1e-6)


def test_window_covering_the_context_computes_exactly_what_no_window_does(rng):
    batch = make_batch(rng, [40, 5, 129])
    whole = paged_attention_decode(**batch, backend="cpu")
    np.testing.assert_array_equal(paged_attention_decode(**batch, backend="cpu", sliding_window=129), whole)
    np.testing.assert_array_equal(paged_attention_decode(**batch, backend="cpu", softcap=0.0, sliding_window=0), whole)


def test_softcap_bounds_large_scores_like_gemma2(rng, assert_close):
    batch = make_batch(rng, [300, 17], query_scale=60.0)  # logits in the hundreds, capped to (-50, 50)
    want = dense_attention_float64(batch, softcap=50.0)
    assert_close(paged_attention_decode(**batch, backend="cpu", softcap=50.0), want)
    assert_close(paged_attention_decode(**batch, backend="reference", softcap=50.0), want)
    uncapped = dense_attention_float64(batch)
    assert np.linalg.norm(want - uncapped) > 0.1 * np.linalg.norm(uncapped)  # the cap changed the answer


def test_context_of_one_token_returns_its_value(rng, assert_close):
    batch = make_batch(rng, [1], num_heads=4, num_kv_heads=4)
    block = batch["block_tables"][0, 0]
    out = paged_attention_decode(**batch, backend="cpu")
    assert_close(out[0], batch["value_cache"][block, 0])


@pytest.mark.parametrize(("num_heads", "num_kv_heads"), [(4, 4), (8, 1), (12, 3)], ids=["mha", "mqa", "gqa-4"])
def test_head_grouping(rng, assert_close, num_heads, num_kv_heads):
    batch = make_batch(rng, [7, 40, 129], num_heads=num_heads, num_kv_heads=num_kv_heads, head_size=32)
    assert_close(paged_attention_decode(**batch, backend="cpu"), dense_attention_float64(batch))


@pytest.mark.parametrize(("num_heads", "num_kv_heads"), [(4, 4), (8, 1), (12, 3)], ids=["mha", "mqa", "gqa-4"])
def test_window_and_cap_with_head_grouping(rng, assert_close, num_heads, num_kv_heads):
    batch = make_batch(rng, [7, 40, 129], num_heads=num_heads, num_kv_heads=num_kv_heads, head_size=32,
                       query_scale=4.0)
    poison_before_window(batch, 24)
    want = dense_attention_float64(batch, 24, 3.0)
    for backend in ("cpu", "reference"):
        assert_close(paged_attention_decode(**batch, backend=backend, sliding_window=24, softcap=3.0), want)


def test_large_scores_stay_finite_and_accurate(rng, assert_close):
    batch = make_batch(rng, [300, 17], query_scale=60.0)  # logits in the hundreds: naive exp overflows
    assert_close(paged_attention_decode(**batch, backend="cpu"), dense_attention_float64(batch))


def test_writes_into_out_and_accepts_torch_tensors(rng, assert_close):
    batch = make_batch(rng, [50, 3])
    want = paged_attention_decode(**batch, backend="reference")
    tensors = {k: torch.from_numpy(v) if isinstance(v, np.ndarray) else v for k, v in batch.items()}
    out = torch.full(want.shape, float("nan"))
    returned = paged_attention_decode(**tensors, out=out, backend="cpu")
    assert returned is out
    assert_close(out.numpy(), want)
    allocated = paged_attention_decode(**tensors, backend="cpu")
    assert isinstance(allocated, torch.Tensor)
    assert_close(allocated.numpy(), want)


def test_float16_is_refused_by_the_cpu_twin_and_served_by_the_reference(rng, assert_close):
    batch = make_batch(rng, [20, 5], num_heads=4, num_kv_heads=2, head_size=8)
    half = {k: v.astype(np.float16) if isinstance(v, np.ndarray) and v.dtype == np.float32 else v
            for k, v in batch.items()}
    with pytest.raises(ValueError, match="backend 'cpu' takes float32 arrays; got float16"):
        paged_attention_decode(**half, backend="cpu")
    got = paged_attention_decode(**half, backend="reference")
    assert got.dtype == np.float16
    want = paged_attention_decode(**{k: v.astype(np.float32) if isinstance(v, np.ndarray) and v.dtype == np.float16
                                     else v for k, v in half.items()}, backend="reference")
    assert_close(got.astype(np.float32), want, 2e-3)


def invalid(rng, **change):
    batch = make_batch(rng, [20, 5], num_heads=4, num_kv_heads=2, head_size=8)
    batch.update(change)
    return batch


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"query": np.zeros((2, 4, 8), np.float64)}, r"query must be float32\|float16\|bfloat16\[num_seqs, num_heads, head_size\]; got float64"),
        ({"query": np.zeros((2, 4, 8), np.float16)}, r"key_cache must be float16\[num_blocks, block_size, num_kv_heads, head_size\]; got float32"),
        ({"query": np.zeros((2, 3, 8), np.float32)}, r"num_heads \(3\) must be a multiple of num_kv_heads \(2\)"),
        ({"query": np.zeros((2, 4, 16), np.float32)}, "key_cache: head_size is 8 but query says 16"),
        ({"block_size": 8}, "block_size is 8 but key_cache has block_size 16"),
        ({"block_tables": np.zeros((2, 4), np.int64)}, r"block_tables must be int32\[num_seqs, max_blocks_per_seq\]; got int64"),
        ({"block_tables": np.zeros((3, 4), np.int32)}, "block_tables: num_seqs is 3 but query says 2"),
        ({"context_lens": np.array([20, 0], np.int32)}, r"context_lens\[1\] is 0; it must be in \[1, 64\]"),
        ({"context_lens": np.array([65, 1], np.int32)}, r"context_lens\[0\] is 65; it must be in \[1, 64\]"),
        ({"context_lens": np.array([20, 5], np.int64)}, r"context_lens must be int32\[num_seqs\]"),
        ({"block_tables": np.array([[0, 99, 0, 0], [2, -1, -1, -1]], np.int32)}, r"block_tables\[0, 1\] is 99; it must be in \[0, 10\)"),
        ({"scale": float("nan")}, "scale must be finite"),
        ({"out": np.zeros((2, 4, 7), np.float32)}, "out has shape"),
        ({"sliding_window": -1}, r"sliding_window must be an int >= 0 \(0: the whole context\); got -1"),
        ({"sliding_window": 4.0}, "sliding_window must be an int >= 0 .*; got 4.0"),
        ({"sliding_window": True}, "sliding_window must be an int >= 0 .*; got True"),
        ({"softcap": float("nan")}, r"softcap must be a finite float >= 0 \(0: no cap\); got nan"),
        ({"softcap": float("inf")}, "softcap must be a finite float >= 0 .*; got inf"),
        ({"softcap": -30.0}, "softcap must be a finite float >= 0 .*; got -30.0"),
        ({"softcap": "50"}, "softcap must be a finite float >= 0 .*; got '50'"),
    ],
)
def test_rejects_bad_arguments_with_precise_messages(rng, change, message):
    batch = invalid(rng, **change)
    with pytest.raises(ValueError, match=message):
        paged_attention_decode(**batch, backend="cpu")


def test_the_host_entry_runs_the_cpu_twin_on_checked_arrays(rng, assert_close):
    from kernels import paged_attention_decode_host

    batch = make_batch(rng, [3, 70, 16])
    out = np.empty_like(batch["query"])
    paged_attention_decode_host(out, batch["query"], batch["key_cache"], batch["value_cache"], batch["block_tables"],
                                batch["context_lens"], batch["block_size"], batch["scale"])
    assert_close(out, paged_attention_decode(**batch, backend="reference"))
    paged_attention_decode_host(out, batch["query"], batch["key_cache"], batch["value_cache"], batch["block_tables"],
                                batch["context_lens"], batch["block_size"], batch["scale"], sliding_window=20,
                                softcap=5.0)
    assert_close(out, paged_attention_decode(**batch, backend="reference", sliding_window=20, softcap=5.0))
