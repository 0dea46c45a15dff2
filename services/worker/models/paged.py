"""One continuous-batching step of a `DecoderLM` over a paged KV cache.

Every sequence in a step brings its new tokens (a prompt chunk, recomputed
tokens after preemption, or the one token sampled last step), the position of
the first of them, and its whole block table. There is no prefill or decode
phase: a sequence with one new token attends through the
`paged_attention_decode` kernel; a longer chunk gathers its cached prefix by
block table and runs causal attention over prefix + chunk. Keys and values of
all new tokens are scattered into the cache with `write_kv_cache` first, so a
chunk sees its own keys the same way a later step will.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from kernels import (
    Backend,
    paged_attention_decode,
    paged_attention_decode_host,
    write_kv_cache,
    write_kv_cache_host,
)
from kernels.backend import resolve_backend
from services.worker.models.attention import attention, visible_keys
from services.worker.models.rope import Rotary


class PagedBlock(Protocol):
    """A decoder layer split where the paged step puts its attention between the pieces."""

    window: int  # its sliding window in tokens (a query sees itself and window - 1 keys before it); 0: all

    def qkv(self, x: torch.Tensor, rope: Rotary) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """`x[T, d_model]` → float32 q `[T, num_heads, hs]`, k and v `[T, num_kv_heads, hs]`, RoPE applied."""
        ...

    def attn_out(self, attn: torch.Tensor) -> torch.Tensor: ...

    def mlp(self, x: torch.Tensor) -> torch.Tensor: ...


class AttentionShape(Protocol):
    @property
    def head_size(self) -> int: ...

    @property
    def attention_scale(self) -> float:
        """What q·k is multiplied by before the softmax (1 / sqrt(head_size) unless the model says)."""
        ...

    @property
    def attention_softcap(self) -> float:
        """c > 0: each scaled score becomes c * tanh(score / c) (Gemma 2); 0: none."""
        ...


class PagedLM(Protocol):
    """What `paged_forward` runs: tinylm's DecoderLM and the Llama family's LlamaFamilyLM."""

    @property
    def config(self) -> AttentionShape: ...

    def embed(self, token_ids: torch.Tensor) -> torch.Tensor: ...

    def blocks(self) -> Iterator[PagedBlock]: ...

    def rotary(self, positions: torch.Tensor) -> Rotary: ...

    def logits(self, hidden: torch.Tensor) -> torch.Tensor: ...


@dataclass(frozen=True)
class PagedSequence:
    token_ids: tuple[int, ...]  # new tokens this step, >= 1
    start_position: int  # position of token_ids[0] = tokens already in the cache
    block_table: tuple[int, ...]  # physical block of each logical block; covers start_position + len(token_ids)
    needs_logits: bool  # return the logits after the last new token
    # Return the logits after every new token (prompt logprobs), needs_logits or not.
    all_logits: bool = False
    # The LoRA adapter this sequence runs under (models/lora), by name; "": the base model.
    adapter: str = ""

    @property
    def end_position(self) -> int:
        return self.start_position + len(self.token_ids)


class KVCache:
    """The worker's physical KV pages: per layer `float32[num_blocks, block_size, num_kv_heads, head_size]`."""

    def __init__(
        self,
        *,
        num_layers: int,
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_size: int,
        device: str | torch.device = "cpu",
    ) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"num_blocks and block_size must be >= 1, got {num_blocks}, {block_size}")
        shape = (num_blocks, block_size, num_kv_heads, head_size)
        self.key = [torch.zeros(shape, dtype=torch.float32, device=device) for _ in range(num_layers)]
        self.value = [torch.zeros(shape, dtype=torch.float32, device=device) for _ in range(num_layers)]
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.device = torch.device(device)

    @property
    def size_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (*self.key, *self.value))


def slot_mapping_of(seq: PagedSequence, block_size: int) -> list[int]:
    """Cache slot (block * block_size + offset) of each new token."""
    return [
        seq.block_table[pos // block_size] * block_size + pos % block_size
        for pos in range(seq.start_position, seq.end_position)
    ]


def check_sequence(seq: PagedSequence, cache: KVCache) -> None:
    """ValueError when the sequence's block table cannot hold its tokens or names blocks the cache lacks."""
    if not seq.token_ids:
        raise ValueError("a sequence must bring at least one new token")
    if seq.start_position < 0:
        raise ValueError(f"start_position must be >= 0, got {seq.start_position}")
    num_needed = -(-seq.end_position // cache.block_size)
    if len(seq.block_table) < num_needed:
        raise ValueError(
            f"block table has {len(seq.block_table)} blocks but positions up to {seq.end_position - 1} "
            f"need {num_needed} (block_size {cache.block_size})"
        )
    bad = [b for b in seq.block_table[:num_needed] if not 0 <= b < cache.num_blocks]
    if bad:
        raise ValueError(f"block ids {bad} are outside the cache's {cache.num_blocks} blocks")


def paged_forward(lm: PagedLM, seqs: Sequence[PagedSequence], cache: KVCache,
                  head: Callable[[torch.Tensor], torch.Tensor] | None = None) -> torch.Tensor:
    """Runs one step; returns logits `float32[num_rows, vocab]` in the order of `seqs`: a row after
    every new token of an `all_logits` sequence, else one after the last of a `needs_logits` one.
    `head`: what those rows' last hidden states become instead of `lm.logits` (an embedding model's
    final norm, LlamaFamilyLM.final_hidden)."""
    for seq in seqs:
        check_sequence(seq, cache)
    device = cache.device
    bs = cache.block_size
    lengths = [len(s.token_ids) for s in seqs]
    starts = [sum(lengths[:i]) for i in range(len(seqs))]  # row of each sequence's first token
    tokens = torch.tensor([t for s in seqs for t in s.token_ids], dtype=torch.int64, device=device)
    positions = torch.tensor(
        [p for s in seqs for p in range(s.start_position, s.end_position)], dtype=torch.int64, device=device
    )
    slots = torch.tensor([x for s in seqs for x in slot_mapping_of(s, bs)], dtype=torch.int64, device=device)
    decode = [i for i, n in enumerate(lengths) if n == 1]
    chunks = [i for i, n in enumerate(lengths) if n > 1]
    decode_rows = torch.tensor([starts[i] for i in decode], dtype=torch.int64, device=device)
    decode_tables, decode_lens = _decode_tables([seqs[i] for i in decode], bs, device)
    scale, softcap = lm.config.attention_scale, lm.config.attention_softcap

    rope = lm.rotary(positions)

    # check_sequence above has put every slot and table entry inside the cache, so on the host the
    # layers call the kernels' CPU twins directly; elsewhere (a GPU, the reference backend) through
    # the checked functions, whose host checks do not run on a GPU.
    on_host = cache.device.type == "cpu" and resolve_backend(None, prefer_cuda=False) is Backend.CPU

    def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, key_cache: torch.Tensor,
               value_cache: torch.Tensor, window: int) -> torch.Tensor:
        attn = torch.empty_like(q)
        if on_host:
            key_np, value_np = key_cache.numpy(), value_cache.numpy()
            write_kv_cache_host(k.contiguous().numpy(), v.contiguous().numpy(), key_np, value_np, slots.numpy())
            if decode:
                query = q[decode_rows].contiguous()
                out = torch.empty_like(query)
                paged_attention_decode_host(out.numpy(), query.numpy(), key_np, value_np, decode_tables.numpy(),
                                            decode_lens.numpy(), bs, scale, window, softcap)
                attn[decode_rows] = out
        else:
            write_kv_cache(k.contiguous(), v.contiguous(), key_cache, value_cache, slots)
            if decode:
                attn[decode_rows] = paged_attention_decode(
                    q[decode_rows].contiguous(), key_cache, value_cache, decode_tables, decode_lens, bs, scale,
                    sliding_window=window, softcap=softcap,
                )
        for i in chunks:
            rows = slice(starts[i], starts[i] + lengths[i])
            attn[rows] = _chunk_attention(q[rows], seqs[i], key_cache, value_cache, bs, scale, window, softcap)
        return attn

    x = run_layers(lm, lm.embed(tokens), rope, cache, attend)
    return (lm.logits if head is None else head)(x[logit_rows(seqs, starts, lengths)])


# attend(q, k, v, key_cache, value_cache, window): writes the step's K/V into the layer's caches and
# returns the attention output, shaped like q, each query seeing the layer's sliding window (0: all).
Attend = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, int], torch.Tensor]


def run_layers(lm: PagedLM, x: torch.Tensor, rope: Rotary, cache: KVCache, attend: Attend) -> torch.Tensor:
    """The decoder's layers over hidden states `x`: each layer's q/k/v, `attend` over its caches, the
    output projection and the MLP, with their residuals. paged_forward's step and a decode graph's body
    (cuda_graphs.decode_forward) differ only in how they attend."""
    for layer_index, layer in enumerate(lm.blocks()):
        q, k, v = layer.qkv(x, rope)
        attn = attend(q, k, v, cache.key[layer_index], cache.value[layer_index], layer.window)
        x = x + layer.attn_out(attn)
        x = x + layer.mlp(x)
    return x


def logit_rows(seqs: Sequence[PagedSequence], starts: Sequence[int], lengths: Sequence[int]) -> list[int]:
    """The rows of the step's tokens whose logits are returned, in order."""
    rows: list[int] = []
    for seq, start, length in zip(seqs, starts, lengths, strict=True):
        if seq.all_logits:
            rows.extend(range(start, start + length))
        elif seq.needs_logits:
            rows.append(start + length - 1)
    return rows


def _decode_tables(
    seqs: Sequence[PagedSequence], block_size: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """`block_tables int32[num_seqs, max_blocks]` (zero-padded; the kernel reads only up to each context) and `context_lens int32[num_seqs]`."""
    num_blocks = [-(-s.end_position // block_size) for s in seqs]
    width = max(num_blocks, default=1)
    # Built on the host and copied once: a row-by-row fill of a GPU tensor is one copy per sequence.
    tables = torch.zeros((len(seqs), width), dtype=torch.int32)
    for row, (seq, n) in enumerate(zip(seqs, num_blocks, strict=True)):
        tables[row, :n] = torch.tensor(seq.block_table[:n], dtype=torch.int32)
    lens = torch.tensor([s.end_position for s in seqs], dtype=torch.int32)
    return tables.to(device, non_blocking=True), lens.to(device, non_blocking=True)


def _chunk_attention(
    q: torch.Tensor,
    seq: PagedSequence,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_size: int,
    scale: float,
    window: int = 0,
    softcap: float = 0.0,
) -> torch.Tensor:
    """Causal attention of a chunk's queries `[n, num_heads, hs]` over its cached prefix and itself; with
    a sliding window, only the blocks that hold keys inside it are gathered."""
    context_len = seq.end_position
    first = max(0, seq.start_position - window + 1) // block_size * block_size if window else 0
    blocks = torch.tensor(seq.block_table[first // block_size: -(-context_len // block_size)], dtype=torch.int64,
                          device=q.device)
    num_kv_heads, head_size = key_cache.shape[2], key_cache.shape[3]
    keys = key_cache[blocks].reshape(-1, num_kv_heads, head_size)[:context_len - first]
    values = value_cache[blocks].reshape(-1, num_kv_heads, head_size)[:context_len - first]
    query_pos = torch.arange(seq.start_position, context_len, device=q.device)
    key_pos = torch.arange(first, context_len, device=q.device)
    out = attention(q.transpose(0, 1)[None], keys.transpose(0, 1)[None], values.transpose(0, 1)[None],
                    visible=visible_keys(query_pos, key_pos, window), scale=scale, softcap=softcap)
    return out[0].transpose(0, 1)
