import numpy as np
import pytest
import torch

from kernels import write_kv_cache

NUM_BLOCKS, BLOCK_SIZE, NUM_KV_HEADS, HEAD_SIZE = 64, 16, 2, 64


def make_step(rng, num_tokens, *, num_padding=0):
    key = rng.standard_normal((num_tokens, NUM_KV_HEADS, HEAD_SIZE), dtype=np.float32)
    value = rng.standard_normal((num_tokens, NUM_KV_HEADS, HEAD_SIZE), dtype=np.float32)
    slots = rng.permutation(NUM_BLOCKS * BLOCK_SIZE)[:num_tokens].astype(np.int64)
    slots[rng.permutation(num_tokens)[:num_padding]] = -1
    return key, value, slots


def make_caches(rng):
    shape = (NUM_BLOCKS, BLOCK_SIZE, NUM_KV_HEADS, HEAD_SIZE)
    return rng.standard_normal(shape, dtype=np.float32), rng.standard_normal(shape, dtype=np.float32)


def run(backend, key, value, key_cache, value_cache, slots):
    key_cache, value_cache = key_cache.copy(), value_cache.copy()
    write_kv_cache(key, value, key_cache, value_cache, slots, backend=backend)
    return key_cache, value_cache


def test_cpu_twin_matches_reference_with_padding_slots(rng, assert_close):
    key, value, slots = make_step(rng, 512, num_padding=37)
    caches = make_caches(rng)
    cpu = run("cpu", key, value, *caches, slots)
    reference = run("reference", key, value, *caches, slots)
    assert_close(cpu[0], reference[0])
    assert_close(cpu[1], reference[1])


def test_float16_caches_are_written_bit_for_bit_by_the_cpu_twin(rng):
    key, value, slots = make_step(rng, 300, num_padding=11)
    caches = tuple(c.astype(np.float16) for c in make_caches(rng))
    cpu = run("cpu", key.astype(np.float16), value.astype(np.float16), *caches, slots)
    reference = run("reference", key.astype(np.float16), value.astype(np.float16), *caches, slots)
    assert cpu[0].dtype == np.float16
    assert cpu[0].tobytes() == reference[0].tobytes() and cpu[1].tobytes() == reference[1].tobytes()


def test_writes_each_token_to_its_block_and_offset_and_skips_padding(rng, assert_close):
    key, value, _ = make_step(rng, 4)
    slots = np.array([0, BLOCK_SIZE - 1, -1, NUM_BLOCKS * BLOCK_SIZE - 1], np.int64)
    key_cache, value_cache = make_caches(rng)
    before = key_cache.copy()
    write_kv_cache(key, value, key_cache, value_cache, slots, backend="cpu")
    assert_close(key_cache[0, 0], key[0])
    assert_close(key_cache[0, BLOCK_SIZE - 1], key[1])
    assert_close(value_cache[NUM_BLOCKS - 1, BLOCK_SIZE - 1], value[3])
    untouched = np.ones((NUM_BLOCKS, BLOCK_SIZE), bool)
    untouched[0, 0] = untouched[0, BLOCK_SIZE - 1] = untouched[NUM_BLOCKS - 1, BLOCK_SIZE - 1] = False
    assert_close(key_cache[untouched], before[untouched], 0.0)


def test_torch_cpu_tensors_are_written_in_place(rng, assert_close):
    key, value, slots = make_step(rng, 9, num_padding=2)
    key_cache, value_cache = make_caches(rng)
    want = run("reference", key, value, key_cache, value_cache, slots)
    key_cache_t, value_cache_t = torch.from_numpy(key_cache.copy()), torch.from_numpy(value_cache.copy())
    write_kv_cache(torch.from_numpy(key), torch.from_numpy(value), key_cache_t, value_cache_t,
                   torch.from_numpy(slots), backend="cpu")
    assert_close(key_cache_t.numpy(), want[0])
    assert_close(value_cache_t.numpy(), want[1])


def test_env_var_selects_the_backend(rng, assert_close, monkeypatch):
    key, value, slots = make_step(rng, 8)
    caches = make_caches(rng)
    monkeypatch.setenv("INFERMESH_KERNEL_BACKEND", "reference")
    via_env = run(None, key, value, *caches, slots)
    monkeypatch.setenv("INFERMESH_KERNEL_BACKEND", "bogus")
    with pytest.raises(ValueError, match="INFERMESH_KERNEL_BACKEND must be one of"):
        run(None, key, value, *caches, slots)
    assert_close(via_env[0], run("cpu", key, value, *caches, slots)[0])


def test_no_tokens_is_a_no_op(rng, assert_close):
    key_cache, value_cache = make_caches(rng)
    before = key_cache.copy()
    empty = np.zeros((0, NUM_KV_HEADS, HEAD_SIZE), np.float32)
    write_kv_cache(empty, empty, key_cache, value_cache, np.zeros(0, np.int64), backend="cpu")
    assert_close(key_cache, before, 0.0)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"key": np.zeros((3, NUM_KV_HEADS, HEAD_SIZE), np.float64)}, r"key must be float32\|float16\|bfloat16\[num_tokens, num_kv_heads, head_size\]; got float64"),
        ({"key": np.zeros((3, NUM_KV_HEADS, HEAD_SIZE), np.float16)}, r"value must be float16\[num_tokens, num_kv_heads, head_size\]; got float32"),
        ({"value": np.zeros((3, NUM_KV_HEADS, HEAD_SIZE + 1), np.float32)}, "value has shape"),
        ({"slot_mapping": np.zeros(3, np.int32)}, r"slot_mapping must be int64\[num_tokens\]; got int32"),
        ({"slot_mapping": np.zeros(4, np.int64)}, "slot_mapping: num_tokens is 4 but key says 3"),
        ({"slot_mapping": np.array([0, 1, NUM_BLOCKS * BLOCK_SIZE], np.int64)}, r"slot_mapping\[2\] is 1024 but the cache holds only 1024 slots"),
        ({"key_cache": np.zeros((NUM_BLOCKS, BLOCK_SIZE, NUM_KV_HEADS), np.float32)}, r"key_cache must be float32\[num_blocks, block_size, num_kv_heads, head_size\]"),
        ({"value_cache": np.zeros((NUM_BLOCKS, BLOCK_SIZE, NUM_KV_HEADS, HEAD_SIZE), np.float32)[:, ::2]}, "value_cache has shape"),
        ({"key_cache": np.zeros((NUM_BLOCKS, BLOCK_SIZE, NUM_KV_HEADS, HEAD_SIZE * 2), np.float32)[..., ::2]}, "key_cache must be C-contiguous"),
        ({"backend": "tpu"}, "backend must be one of"),
    ],
)
def test_rejects_bad_arguments_with_precise_messages(rng, change, message):
    args = {
        "key": np.zeros((3, NUM_KV_HEADS, HEAD_SIZE), np.float32),
        "value": np.zeros((3, NUM_KV_HEADS, HEAD_SIZE), np.float32),
        "key_cache": np.zeros((NUM_BLOCKS, BLOCK_SIZE, NUM_KV_HEADS, HEAD_SIZE), np.float32),
        "value_cache": np.zeros((NUM_BLOCKS, BLOCK_SIZE, NUM_KV_HEADS, HEAD_SIZE), np.float32),
        "slot_mapping": np.arange(3, dtype=np.int64),
        "backend": "cpu",
    }
    args.update(change)
    with pytest.raises(ValueError, match=message):
        write_kv_cache(**args)


@pytest.mark.parametrize(
    ("num_kv_heads", "head_size", "dtype", "offset", "width"),
    [
        (8, 128, np.float32, 0, 16),
        (8, 128, np.float16, 0, 16),
        (1, 2, np.float32, 0, 8),  # 8-byte rows
        (1, 5, np.float32, 0, 4),  # 20-byte rows
        (1, 3, np.float16, 0, 2),  # 6-byte rows
        (8, 128, np.float32, 1, 4),  # a view one element into its buffer
        (8, 128, np.float16, 1, 2),
    ],
)
def test_cuda_path_copies_the_widest_chunks_that_tile_a_row_and_fit_every_tensors_alignment(
    num_kv_heads, head_size, dtype, offset, width
):
    from kernels.kv_cache import _access_width

    def array(shape, offset=0):
        return np.zeros(int(np.prod(shape)) + offset, dtype)[offset:].reshape(shape)

    cache = array((4, 16, num_kv_heads, head_size))
    key = array((3, num_kv_heads, head_size), offset)
    itemsize = np.dtype(dtype).itemsize
    row_bytes = num_kv_heads * head_size * itemsize
    assert _access_width([key, key, cache, cache], row_bytes, itemsize=itemsize) == width
    assert _access_width([torch.from_numpy(key), key, cache, cache], row_bytes, itemsize=itemsize) == width


def test_the_host_entry_writes_what_the_checked_function_writes(rng):
    from kernels import write_kv_cache_host

    key, value, slots = make_step(rng, 50, num_padding=4)
    caches = make_caches(rng)
    checked = run("cpu", key, value, *caches, slots)
    write_kv_cache_host(key, value, *caches, slots)
    assert checked[0].tobytes() == caches[0].tobytes() and checked[1].tobytes() == caches[1].tobytes()
