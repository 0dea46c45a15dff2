"""The GPU kernel checks' references: inputs, float64 answers and the error bounds they are held to.

bench_gpu_kernel_check checks every kernel against them; bench_gpu_attention_sweep holds each
attention layout to the same bounds, and gpu_timing times on the same scattered block tables.
"""

from __future__ import annotations

import torch

# bfloat16 keeps 8 bits of mantissa: rounding the output alone is ~1.1e-3 relative (2^-9 / sqrt(3)).
BOUND = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 4e-3}


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    got64, want64 = got.double(), want.double()
    if not torch.isfinite(got64).all():
        return float("inf")
    return float((got64 - want64).norm() / want64.norm().clamp_min(1e-300))


def attention_inputs(gen: torch.Generator, lens: list[int], num_heads: int, num_kv_heads: int, head_size: int,
                     block_size: int, dtype: torch.dtype):
    lens_t = torch.tensor(lens, dtype=torch.int32)
    blocks_per_seq = [-(-n // block_size) for n in lens]
    num_blocks = sum(blocks_per_seq) + 17
    width = max(blocks_per_seq) + 2
    tables = shuffled_block_tables(blocks_per_seq, num_blocks, width, gen, fill=-1)
    shape = (num_blocks, block_size, num_kv_heads, head_size)
    cuda_gen = torch.Generator(device="cuda").manual_seed(int(torch.randint(1 << 30, (1,), generator=gen)))
    key_cache = torch.randn(shape, generator=cuda_gen, device="cuda").to(dtype)
    value_cache = torch.randn(shape, generator=cuda_gen, device="cuda").to(dtype)
    query = (torch.randn((len(lens), num_heads, head_size), generator=cuda_gen, device="cuda") * 2).to(dtype)
    return [query, key_cache, value_cache, tables.cuda(), lens_t.cuda()]


def shuffled_block_tables(blocks_per_seq: list[int], num_blocks: int, width: int, gen: torch.Generator,
                          fill: int) -> torch.Tensor:
    """int32[len(blocks_per_seq), width]: each sequence its own distinct blocks of a shuffled pool, `fill` past them."""
    pool = torch.randperm(num_blocks, generator=gen).to(torch.int32)
    tables = torch.full((len(blocks_per_seq), width), fill, dtype=torch.int32)
    start = 0
    for row, n in enumerate(blocks_per_seq):
        tables[row, :n] = pool[start:start + n]
        start += n
    return tables


def attention_reference64(query, key_cache, value_cache, tables, lens, block_size, scale, sliding_window: int = 0,
                          softcap: float = 0.0) -> torch.Tensor:
    """Decode attention in float64; a window keeps each sequence's last `sliding_window` keys, a softcap
    c makes each score c * tanh(score / c) (kernels.paged_attention's definitions)."""
    num_seqs, num_heads, head_size = query.shape
    num_kv_heads = key_cache.shape[2]
    out = torch.empty((num_seqs, num_heads, head_size), dtype=torch.float64, device=query.device)
    for seq, n in enumerate(lens.tolist()):
        blocks = tables[seq, : -(-n // block_size)].long()
        first = max(0, n - sliding_window) if sliding_window else 0
        keys = key_cache[blocks].reshape(-1, num_kv_heads, head_size)[first:n].double()
        values = value_cache[blocks].reshape(-1, num_kv_heads, head_size)[first:n].double()
        q = query[seq].double().reshape(num_kv_heads, -1, head_size)
        scores = torch.bmm(q, keys.permute(1, 2, 0)) * scale
        if softcap:
            scores = softcap * torch.tanh(scores / softcap)
        probs = torch.softmax(scores, dim=-1)
        out[seq] = torch.bmm(probs, values.permute(1, 0, 2)).reshape(num_heads, head_size)
    return out
