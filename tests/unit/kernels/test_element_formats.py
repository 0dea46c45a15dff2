"""bfloat16 conversions of the CUDA kernels (the simulator's numpy twins of the GPU intrinsics) and packed layouts."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
import torch

from kernels import paged_attention_decode
from kernels.element_formats import _bf16_bits_to_float, _float_to_bf16_bits, as_kernel_array
from kernels.paged_attention_warp import WarpLayout, layout_for


def _torch_bits(values: np.ndarray) -> np.ndarray:
    return torch.from_numpy(values).to(torch.bfloat16).view(torch.int16).numpy()


def test_narrowing_to_bfloat16_rounds_to_nearest_even_as_pytorch_does():
    rng = np.random.default_rng(0)
    ties = np.array([0x3F808000, 0x3F818000, 0x3F80_7FFF, 0x3F80_8001], np.uint32).view(np.float32)  # exact halves
    edges = np.array([0.0, -0.0, 1e-40, -1e-40, 3.4e38, -3.4e38, np.inf, -np.inf], np.float32)
    values = np.concatenate([rng.standard_normal(2000).astype(np.float32) * 10.0 ** rng.integers(-30, 30, 2000),
                             ties, edges]).astype(np.float32)
    ours = np.array([_float_to_bf16_bits(v) for v in values], np.int16)
    assert (ours == _torch_bits(values)).all()


def test_nan_narrows_to_a_quiet_nan_and_widening_is_exact():
    assert np.isnan(_bf16_bits_to_float(_float_to_bf16_bits(np.float32("nan"))))
    bits = np.arange(-32768, 32768, 7, dtype=np.int32).astype(np.int16)
    widened = np.array([_bf16_bits_to_float(b) for b in bits], np.float32)
    want = torch.from_numpy(bits).view(torch.bfloat16).float().numpy()
    finite = np.isfinite(want)
    assert (widened[finite] == want[finite]).all()
    assert (np.isnan(widened) == np.isnan(want)).all()


def test_a_bfloat16_tensor_reaches_a_kernel_as_its_int16_bits_without_a_copy():
    x = torch.randn(3, 4).to(torch.bfloat16)
    view = as_kernel_array(x)
    assert view.dtype == torch.int16 and view.data_ptr() == x.data_ptr()
    assert as_kernel_array(torch.zeros(2)).dtype == torch.float32


@pytest.mark.parametrize(("head_size", "group"), [(32, 2), (128, 4), (64, 8)])
def test_packed_layouts_hold_twice_the_tokens_in_the_same_registers(head_size, group):
    plain, packed = layout_for(head_size, group, 2, packed=False), layout_for(head_size, group, 2, packed=True)
    assert packed.packed and (packed.width, packed.lanes_per_token, packed.heads_per_block) == (
        plain.width, plain.lanes_per_token, plain.heads_per_block)
    dims = head_size // plain.lanes_per_token
    assert packed.tokens_in_flight == min(8, max(1, 64 // dims)) >= plain.tokens_in_flight
    packed.check(head_size, group, 2)


@pytest.mark.parametrize(("head_size", "group"), [(32, 2), (128, 4), (24, 1)])
def test_16_bit_formats_default_to_packed_prefetching_fast_math_and_float32_to_plain(head_size, group):
    plain = layout_for(head_size, group, 2, packed=False)
    assert layout_for(head_size, group, 2) == replace(plain, packed=True, prefetch=True, fastmath=True)
    wide = layout_for(head_size, group, 4)
    assert not (wide.packed or wide.prefetch or wide.fastmath)
    narrow = layout_for(head_size, group, 2, max_width=2)  # 2-byte loads: nothing to pack
    assert not (narrow.packed or narrow.prefetch or narrow.fastmath)


def test_packing_is_for_16_bit_elements_only():
    assert not layout_for(128, 4, 4, packed=True).packed  # float32: ignored
    with pytest.raises(ValueError, match="packed needs 2-byte elements"):
        WarpLayout(16, 8, 4, 2, packed=True).check(128, 4, 4)
    with pytest.raises(ValueError, match="loads of >= 4 bytes"):
        WarpLayout(2, 8, 4, 2, packed=True).check(128, 4, 2)


def test_bfloat16_runs_on_the_warp_kernel_and_the_reference_only():
    query = torch.randn(1, 2, 8).to(torch.bfloat16)
    cache = torch.randn(2, 4, 1, 8).to(torch.bfloat16)
    tables, lens = torch.tensor([[0, 1]], dtype=torch.int32), torch.tensor([5], dtype=torch.int32)
    with pytest.raises(ValueError, match="'tile' takes float32 or float16"):
        paged_attention_decode(query, cache, cache, tables, lens, 4, 0.5, backend="cuda", cuda_kernel="tile")
    with pytest.raises(ValueError, match="backend 'cpu' takes float32"):
        paged_attention_decode(query, cache, cache, tables, lens, 4, 0.5, backend="cpu")
    got = paged_attention_decode(query, cache, cache, tables, lens, 4, 0.5, backend="reference")
    want = paged_attention_decode(query.float(), cache.float(), cache.float(), tables, lens, 4, 0.5, backend="cpu")
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), want, rtol=8e-3, atol=8e-3)


def test_bfloat16_kv_cache_writes_copy_the_bits_on_the_host():
    from kernels import write_kv_cache

    key = torch.randn(3, 2, 8).to(torch.bfloat16)
    value = torch.randn(3, 2, 8).to(torch.bfloat16)
    key_cache = torch.zeros(2, 4, 2, 8, dtype=torch.bfloat16)
    value_cache = torch.zeros(2, 4, 2, 8, dtype=torch.bfloat16)
    slots = torch.tensor([5, 0, 7])
    write_kv_cache(key, value, key_cache, value_cache, slots, backend="cpu")
    flat_key, flat_value = key_cache.view(-1, 2, 8), value_cache.view(-1, 2, 8)
    assert torch.equal(flat_key[slots], key) and torch.equal(flat_value[slots], value)
    assert int((flat_key != 0).any(dim=(1, 2)).sum()) == 3
