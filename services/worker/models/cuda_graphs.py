"""CUDA graphs for plain decode steps: one graph per batch-size bucket, replayed over static inputs.

An eager decode step of a small model is bound by the host: every layer makes
about twenty PyTorch launches and two Numba launches, each with its Python
around it (tinylm: 5.2 ms a step at batch 1 on an H200, for a few hundred
microseconds of GPU work). A CUDA graph records one step's launches once and
replays them with one call, as vLLM does:

* **Buckets.** A graph has fixed shapes, so one is captured per batch size in
  `buckets` (1, 2, 4, … 32); a step of `n` sequences replays the smallest
  bucket >= n, its extra rows padding. A step with more sequences than the
  largest bucket, or with anything but one new token per sequence, is not for
  a graph (`graph_refusal` says why) and runs eagerly.
* **Static inputs.** Each bucket owns its device tensors (tokens, positions,
  slots, block tables `int32[bucket, max_blocks_per_seq]`, context lengths);
  a replay reads whatever they hold, so `run` packs the step on the host and
  copies it in with two copies, then replays. The block-table width is the
  same for every step, so the attention kernel's partition count (derived from
  it) is fixed at capture, and so is its split-context scratch.
* **Padding rows** write their K/V to `padding_slot` (-1: nowhere; the KV
  kernel skips negative slots) and attend to one token of `padding_block`:
  nothing they do reaches a real sequence's blocks.
* **What is inside.** The captured body (`decode_forward`) is the same layer
  loop as `paged_forward`'s decode rows, with the Numba kernels launched on
  the capture stream (`DecodeAttention.KERNEL`), or, where a Numba launch
  cannot be captured (`kernel_capture_problem`), a pure-PyTorch write and a
  gather + SDPA attention over the whole padded table (`DecodeAttention.TORCH`).

Invariant: the KV cache's tensors are the ones captured; they must never be
reallocated while the graphs live (a replay writes through their addresses).
"""

from __future__ import annotations

import contextlib
import enum
import importlib
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from kernels import paged_attention_decode, write_kv_cache
from services.worker.models.attention import attention
from services.worker.models.paged import KVCache, PagedLM, PagedSequence, run_layers

DEFAULT_BUCKETS = (1, 2, 4, 8, 16, 32)
# Eager runs of each bucket's body before its capture, on the capture stream: they compile the Numba
# kernels, fill fast_launch's cache, and let cuBLAS make its handle and workspace for that stream.
NUM_WARMUP_RUNS = 2


class DecodeAttention(enum.Enum):
    KERNEL = "kernel"  # write_kv_cache + paged_attention_decode (Numba), launched on the capture stream
    TORCH = "torch"  # index_copy_ into the cache + gather by block table + SDPA: no Numba launch at all


class GraphCaptureError(RuntimeError):
    """A bucket's capture failed; the message says which bucket and why."""


def bucket_for(num_seqs: int, buckets: Sequence[int]) -> int:
    """The smallest bucket holding `num_seqs` sequences; ValueError above the largest."""
    if num_seqs < 1:
        raise ValueError(f"a decode step needs at least one sequence, got {num_seqs}")
    fitting = [b for b in buckets if b >= num_seqs]
    if not fitting:
        raise ValueError(f"{num_seqs} sequences exceed the largest captured batch size {max(buckets)}")
    return min(fitting)


def blocks_needed(seq: PagedSequence, block_size: int) -> int:
    return -(-seq.end_position // block_size)


def graph_refusal(seqs: Sequence[PagedSequence], buckets: Sequence[int], max_blocks_per_seq: int,
                  block_size: int) -> str | None:
    """Why this step cannot replay a decode graph (it then runs eagerly); None when it can."""
    if not seqs:
        return "no sequences"
    if len(seqs) > max(buckets):
        return f"{len(seqs)} sequences exceed the largest captured batch size {max(buckets)}"
    for i, seq in enumerate(seqs):
        if len(seq.token_ids) != 1:
            return f"sequence {i} brings {len(seq.token_ids)} new tokens; a decode graph takes one each"
        if seq.all_logits or not seq.needs_logits:
            return f"sequence {i} does not want exactly its last token's logits"
        if blocks_needed(seq, block_size) > max_blocks_per_seq:
            return (f"sequence {i} reaches position {seq.end_position - 1}, past the graphs' "
                    f"{max_blocks_per_seq} blocks of {block_size}")
    return None


@dataclass(frozen=True)
class HostDecodeBatch:
    """One step packed on the host the way `StaticDecodeInputs` holds it on the device.

    `ints64`: tokens, positions and slots, `[3 * bucket]` in that order. `ints32`: block tables
    `[bucket, width]` row-major, then context lengths `[bucket]`. Two arrays, so two copies a step.
    """

    ints64: np.ndarray
    ints32: np.ndarray


def pack_decode_batch(seqs: Sequence[PagedSequence], *, bucket: int, width: int, block_size: int,
                      padding_slot: int, padding_block: int) -> HostDecodeBatch:
    """Rows past `len(seqs)` are padding: token 0 at position 0, slot `padding_slot`, context 1 in
    `padding_block`. Table entries past a sequence's context are `padding_block` (never read)."""
    if len(seqs) > bucket:
        raise ValueError(f"{len(seqs)} sequences do not fit a bucket of {bucket}")
    ints64 = np.zeros((3, bucket), dtype=np.int64)
    ints64[2, :] = padding_slot
    tables = np.full((bucket, width), padding_block, dtype=np.int32)
    lens = np.ones(bucket, dtype=np.int32)
    for row, seq in enumerate(seqs):
        position = seq.start_position
        num_blocks = blocks_needed(seq, block_size)
        if num_blocks > width:
            raise ValueError(f"sequence {row} needs {num_blocks} blocks; the graphs' tables hold {width}")
        ints64[0, row] = seq.token_ids[0]
        ints64[1, row] = position
        ints64[2, row] = seq.block_table[position // block_size] * block_size + position % block_size
        tables[row, :num_blocks] = seq.block_table[:num_blocks]
        lens[row] = seq.end_position
    return HostDecodeBatch(ints64.reshape(-1), np.concatenate((tables.reshape(-1), lens)))


class StaticDecodeInputs:
    """A bucket's device inputs: two flat buffers and contiguous views of them, filled in place."""

    def __init__(self, bucket: int, width: int, device: torch.device) -> None:
        self.bucket, self.width = bucket, width
        self.ints64 = torch.zeros(3 * bucket, dtype=torch.int64, device=device)
        self.ints32 = torch.zeros(bucket * width + bucket, dtype=torch.int32, device=device)
        self.tokens, self.positions, self.slots = self.ints64.view(3, bucket).unbind(0)
        self.block_tables = self.ints32[: bucket * width].view(bucket, width)
        self.context_lens = self.ints32[bucket * width:]

    def fill(self, batch: HostDecodeBatch) -> None:
        # From pageable memory: the copy has read the host array when copy_ returns, so the array
        # may go; non_blocking spares a stream synchronization.
        self.ints64.copy_(torch.from_numpy(batch.ints64), non_blocking=True)
        self.ints32.copy_(torch.from_numpy(batch.ints32), non_blocking=True)


def decode_forward(lm: PagedLM, cache: KVCache, inputs: StaticDecodeInputs,
                   attention: DecodeAttention) -> torch.Tensor:
    """One decode step over a bucket's static inputs: logits `float32[bucket, vocab]`, padding rows
    included. No host reads, host-built tensors or synchronization: this is what a graph captures."""
    scale, softcap = lm.config.attention_scale, lm.config.attention_softcap
    block_size = cache.block_size

    def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, key_cache: torch.Tensor,
               value_cache: torch.Tensor, window: int) -> torch.Tensor:
        q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
        if attention is DecodeAttention.KERNEL:
            write_kv_cache(k, v, key_cache, value_cache, inputs.slots)
            return paged_attention_decode(q, key_cache, value_cache, inputs.block_tables, inputs.context_lens,
                                          block_size, scale, sliding_window=window, softcap=softcap)
        torch_write_kv(k, v, key_cache, value_cache, inputs.slots)
        return torch_decode_attention(q, key_cache, value_cache, inputs.block_tables, inputs.context_lens, scale,
                                      window, softcap)

    return lm.logits(run_layers(lm, lm.embed(inputs.tokens), lm.rotary(inputs.positions), cache, attend))


def torch_write_kv(k: torch.Tensor, v: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                   slots: torch.Tensor) -> None:
    """write_kv_cache in PyTorch; every slot must be in range (padding rows point at a reserved one)."""
    num_kv_heads, head_size = key_cache.shape[2], key_cache.shape[3]
    key_cache.view(-1, num_kv_heads, head_size).index_copy_(0, slots, k)
    value_cache.view(-1, num_kv_heads, head_size).index_copy_(0, slots, v)


def torch_decode_attention(q: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                           block_tables: torch.Tensor, context_lens: torch.Tensor, scale: float, window: int = 0,
                           softcap: float = 0.0) -> torch.Tensor:
    """paged_attention_decode in PyTorch with static shapes: every sequence gathers its whole table
    (`width * block_size` tokens) and masks the tokens past its context (and before its window)."""
    num_seqs, width = block_tables.shape
    _, block_size, num_kv_heads, head_size = key_cache.shape
    max_context = width * block_size
    index = block_tables.long()
    keys = key_cache[index].view(num_seqs, max_context, num_kv_heads, head_size).transpose(1, 2)
    values = value_cache[index].view(num_seqs, max_context, num_kv_heads, head_size).transpose(1, 2)
    key_pos = torch.arange(max_context, device=q.device)[None, :]
    visible = key_pos < context_lens[:, None]  # [seqs, ctx]
    if window:
        visible &= key_pos >= context_lens[:, None] - window
    out = attention(q[:, :, None, :], keys, values, visible=visible[:, None, None, :], scale=scale, softcap=softcap)
    return out[:, :, 0, :]


@dataclass
class _CapturedBucket:
    graph: torch.cuda.CUDAGraph
    logits: torch.Tensor  # [bucket, vocab], written by every replay
    capture_s: float  # warm-up runs and capture


class DecodeGraphs:
    """Decode-step graphs of one model over one KV cache, a graph per bucket.

    `run_uncaptured` runs the same body on the same static inputs without a
    graph (on any device): the reference a replay must equal, and what the
    CPU tests drive.
    """

    def __init__(self, lm: PagedLM, cache: KVCache, *, max_blocks_per_seq: int,
                 buckets: Sequence[int] = DEFAULT_BUCKETS, attention: DecodeAttention = DecodeAttention.KERNEL,
                 padding_slot: int = -1) -> None:
        if not buckets or min(buckets) < 1:
            raise ValueError(f"buckets must be positive batch sizes, got {tuple(buckets)}")
        if max_blocks_per_seq < 1:
            raise ValueError(f"max_blocks_per_seq must be >= 1, got {max_blocks_per_seq}")
        num_slots = cache.num_blocks * cache.block_size
        if padding_slot >= num_slots:
            raise ValueError(f"padding_slot {padding_slot} is outside the cache's {num_slots} slots")
        if attention is DecodeAttention.TORCH and padding_slot < 0:
            raise ValueError("the torch attention writes every row: padding_slot must be a reserved slot, not -1")
        self.lm, self.cache, self.attention = lm, cache, attention
        self.buckets = tuple(sorted(set(buckets)))
        self.max_blocks_per_seq = max_blocks_per_seq
        self.padding_slot = padding_slot
        self.padding_block = padding_slot // cache.block_size if padding_slot >= 0 else 0
        # Made outside inference mode: `run` fills them in place from ordinary code.
        self.inputs = {b: StaticDecodeInputs(b, max_blocks_per_seq, cache.device) for b in self.buckets}
        self._captured: dict[int, _CapturedBucket] = {}

    @property
    def captured(self) -> bool:
        return len(self._captured) == len(self.buckets)

    def capture_seconds(self) -> dict[int, float]:
        return {b: c.capture_s for b, c in self._captured.items()}

    def refusal(self, seqs: Sequence[PagedSequence]) -> str | None:
        return graph_refusal(seqs, self.buckets, self.max_blocks_per_seq, self.cache.block_size)

    def capture(self, capture_error_mode: str = "global") -> None:
        """Captures every bucket, largest first so the smaller ones reuse its memory pool.

        The static inputs hold padding while it runs, so the warm-up runs write no real slot.
        GraphCaptureError names the bucket that failed and the error.
        """
        if self.cache.device.type != "cuda":
            raise GraphCaptureError(f"CUDA graphs need a CUDA cache; this one is on {self.cache.device}")
        pool = torch.cuda.graph_pool_handle()
        stream = torch.cuda.Stream(self.cache.device)
        for bucket in reversed(self.buckets):
            try:
                self._captured[bucket] = self._capture_bucket(bucket, stream, pool, capture_error_mode)
            except Exception as error:
                raise GraphCaptureError(f"bucket {bucket}: {type(error).__name__}: {error}") from error

    def run(self, seqs: Sequence[PagedSequence], *, checked: bool = False) -> torch.Tensor:
        """Replays the step's bucket: logits `float32[len(seqs), vocab]` (a fresh tensor). `checked`: the
        caller has had `refusal(seqs)` say None (the executor's routing), so it is not asked again."""
        bucket = self._fill(seqs, checked)
        captured = self._captured.get(bucket)
        if captured is None:
            raise RuntimeError(f"bucket {bucket} has not been captured (call capture() first)")
        captured.graph.replay()
        return captured.logits[: len(seqs)].clone()

    def replay(self, bucket: int) -> None:
        """Replays a bucket on whatever its inputs hold (for timing the graph alone)."""
        self._captured[bucket].graph.replay()

    def run_uncaptured(self, seqs: Sequence[PagedSequence], *, checked: bool = False) -> torch.Tensor:
        """The captured body run eagerly on the bucket's inputs: logits `float32[len(seqs), vocab]`."""
        bucket = self._fill(seqs, checked)
        with torch.inference_mode():
            return decode_forward(self.lm, self.cache, self.inputs[bucket], self.attention)[: len(seqs)]

    def _fill(self, seqs: Sequence[PagedSequence], checked: bool) -> int:
        refusal = None if checked else self.refusal(seqs)
        if refusal is not None:
            raise ValueError(f"not a decode-graph step: {refusal}")
        bucket = bucket_for(len(seqs), self.buckets)
        self.inputs[bucket].fill(self._pack(seqs, bucket))
        return bucket

    def _pack(self, seqs: Sequence[PagedSequence], bucket: int) -> HostDecodeBatch:
        return pack_decode_batch(seqs, bucket=bucket, width=self.max_blocks_per_seq,
                                 block_size=self.cache.block_size, padding_slot=self.padding_slot,
                                 padding_block=self.padding_block)

    def _capture_bucket(self, bucket: int, stream: torch.cuda.Stream, pool: torch.cuda._POOL_HANDLE,
                        capture_error_mode: str) -> _CapturedBucket:
        started = time.perf_counter()
        inputs = self.inputs[bucket]
        with torch.inference_mode():
            inputs.fill(self._pack([], bucket))
            stream.wait_stream(torch.cuda.current_stream(self.cache.device))
            with torch.cuda.stream(stream), _no_interface_sync():
                for _ in range(NUM_WARMUP_RUNS):
                    decode_forward(self.lm, self.cache, inputs, self.attention)
            torch.cuda.current_stream(self.cache.device).wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with _no_interface_sync(), torch.cuda.graph(graph, pool=pool, stream=stream,
                                                        capture_error_mode=capture_error_mode):
                logits = decode_forward(self.lm, self.cache, inputs, self.attention)
        torch.cuda.synchronize(self.cache.device)
        return _CapturedBucket(graph, logits, time.perf_counter() - started)


@contextlib.contextmanager
def _no_interface_sync() -> Iterator[None]:
    """Numba synchronizes on a `__cuda_array_interface__` producer's stream unless told not to, and a
    synchronization inside a capture invalidates it. kernels.backend already views tensors with
    sync=False; this covers any consumer that does not (NUMBA_CUDA_ARRAY_INTERFACE_SYNC=0, set for
    the duration in numba-cuda's config and in numba's own)."""
    configs = []
    for name in ("numba.cuda.core.config", "numba.config"):
        with contextlib.suppress(ImportError):
            module = importlib.import_module(name)
            if hasattr(module, "CUDA_ARRAY_INTERFACE_SYNC"):
                configs.append((module, module.CUDA_ARRAY_INTERFACE_SYNC))
    for module, _ in configs:
        setattr(module, "CUDA_ARRAY_INTERFACE_SYNC", False)  # noqa: B010 - mypy does not know the attribute
    try:
        yield
    finally:
        for module, previous in configs:
            setattr(module, "CUDA_ARRAY_INTERFACE_SYNC", previous)  # noqa: B010


def kernel_capture_problem(device: torch.device | str = "cuda") -> str | None:
    """Whether a Numba kernel launched through kernels.backend is recorded by a PyTorch capture and
    runs on replay; None when it is, else why not. One write_kv_cache of four tokens: it must not
    write while being captured, and must write when replayed."""
    try:
        key = torch.arange(4 * 2 * 8, dtype=torch.float32, device=device).view(4, 2, 8) + 1
        value = -key
        key_cache = torch.zeros((2, 4, 2, 8), dtype=torch.float32, device=device)
        value_cache = torch.zeros_like(key_cache)
        slots = torch.tensor([5, 0, 7, 2], dtype=torch.int64, device=device)
        stream = torch.cuda.Stream(device)
        stream.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(stream), _no_interface_sync():
            write_kv_cache(key, value, key_cache, value_cache, slots)  # compiles, fills fast_launch's cache
        torch.cuda.synchronize(device)
        key_cache.zero_()
        value_cache.zero_()
        torch.cuda.synchronize(device)
        graph = torch.cuda.CUDAGraph()
        with _no_interface_sync(), torch.cuda.graph(graph, stream=stream):
            write_kv_cache(key, value, key_cache, value_cache, slots)
        torch.cuda.synchronize(device)
        if bool(key_cache.any()):
            return "the kernel ran during capture instead of being recorded (launched off the capture stream)"
        graph.replay()
        torch.cuda.synchronize(device)
        expected = torch.zeros_like(key_cache).view(-1, 2, 8).index_copy_(0, slots, key).view_as(key_cache)
        if not torch.equal(key_cache, expected):
            return "the replayed graph did not write the cache: the kernel launch was not recorded"
        return None
    except Exception as error:
        return f"capture failed: {type(error).__name__}: {error}"
