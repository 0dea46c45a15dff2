"""Token generator: a decoder LM (tinylm's `DecoderLM` or a `LlamaFamilyLM`) served through the paged
step, with a dense twin.

`step` is what the worker runs each continuous-batching iteration. `greedy_dense`
and `greedy_paged` generate one sequence end to end (dense reference, and the
paged path with chunked prefill in a private cache); the golden check and the
tests hold them to the same tokens.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np
import torch

from services.worker.models.llama_config import LlamaFamilyConfig
from services.worker.models.llama_family import LlamaFamilyLM
from services.worker.models.paged import KVCache, PagedSequence, paged_forward
from services.worker.models.transformer import DecoderLM, TransformerConfig
from services.worker.pooling import PooledSequence, PoolingSpec

if TYPE_CHECKING:
    from services.worker.models.lora import LoraAdapter, LoraSet


class Generator:
    def __init__(self, lm: DecoderLM | LlamaFamilyLM, *, max_seq_len: int, eos_token_id: int, bos_token_id: int | None) -> None:
        if max_seq_len < 1:
            raise ValueError(f"max_seq_len must be >= 1, got {max_seq_len}")
        self.lm = lm.eval()
        self.max_seq_len = max_seq_len
        self.eos_token_id = eos_token_id
        self.bos_token_id = bos_token_id
        # The LoRA adapters served over this model (models/lora); None: none, and a step is the base
        # model's whatever its sequences' `adapter` says (the worker refuses those at admission).
        self.lora: LoraSet | None = None

    def add_lora(self, adapter: LoraAdapter) -> None:
        """Serves `adapter` over this model from the next step on (sequences name it in `adapter`)."""
        from services.worker.models.lora import LoraSet  # here: lora imports this module's neighbours

        if not isinstance(self.lm, LlamaFamilyLM):
            raise ValueError("only a Llama-family model serves LoRA adapters")
        if self.lora is None:
            self.lora = LoraSet(self.lm)
        self.lora.add(adapter)

    @property
    def config(self) -> TransformerConfig | LlamaFamilyConfig:
        return self.lm.config

    @property
    def vocab_size(self) -> int:
        return self.config.vocab_size

    @property
    def device(self) -> torch.device:
        return next(self.lm.parameters()).device

    def new_kv_cache(self, num_blocks: int, block_size: int) -> KVCache:
        c = self.config
        return KVCache(
            num_layers=c.num_layers, num_blocks=num_blocks, block_size=block_size,
            num_kv_heads=c.num_kv_heads, head_size=c.head_size, device=self.device,
        )

    def step(self, seqs: Sequence[PagedSequence], cache: KVCache) -> torch.Tensor:
        """One paged step; logits `float32[num_needing_logits, vocab]` in the order of `seqs`."""
        with torch.inference_mode():
            if self.lora is None:
                return paged_forward(self.lm, seqs, cache)
            with self.lora.bound(seqs):
                return paged_forward(self.lm, seqs, cache)

    def hidden_step(self, seqs: Sequence[PagedSequence], cache: KVCache) -> torch.Tensor:
        """`step` for an embedding model: the rows' final hidden states `float32[rows, d_model]` (after the
        final norm) instead of their logits."""
        if not isinstance(self.lm, LlamaFamilyLM):
            raise ValueError("only a Llama-family model serves embeddings")
        with torch.inference_mode():
            return paged_forward(self.lm, seqs, cache, head=self.lm.final_hidden)

    def embed_paged(self, prompts: Sequence[Sequence[int]], spec: PoolingSpec, *, block_size: int = 16,
                    prefill_chunk: int = 64) -> list[np.ndarray]:
        """Each prompt's embedding through the paged path, chunked prefill and pooling as the worker's
        steps run them (every prompt in the same steps, one shared cache)."""
        num_blocks = [-(-len(p) // block_size) for p in prompts]
        cache = self.new_kv_cache(max(1, sum(num_blocks)), block_size)
        first = [sum(num_blocks[:i]) for i in range(len(prompts))]
        tables = [tuple(reversed(range(f, f + n))) for f, n in zip(first, num_blocks, strict=True)]
        pooled = [PooledSequence(spec.pooling) for _ in prompts]
        computed = [0] * len(prompts)
        while running := [i for i, p in enumerate(prompts) if computed[i] < len(p)]:
            seqs = [PagedSequence(tuple(prompts[i][computed[i]:computed[i] + prefill_chunk]), computed[i], tables[i],
                                  needs_logits=True, all_logits=True) for i in running]
            hidden = self.hidden_step(seqs, cache)
            row = 0
            for i, seq in zip(running, seqs, strict=True):
                pooled[i].add(hidden[row:row + len(seq.token_ids)], seq.start_position)
                row += len(seq.token_ids)
                computed[i] = seq.end_position
        return [p.vector(spec.normalize) for p in pooled]

    def dense_logits(self, token_ids: Sequence[int]) -> torch.Tensor:
        """Dense reference over a whole sequence: logits `float32[len(token_ids), vocab]`."""
        with torch.inference_mode():
            ids = torch.tensor([list(token_ids)], dtype=torch.int64, device=self.device)
            return self.lm(ids)[0]

    def greedy_dense(self, prompt_ids: Sequence[int], num_new_tokens: int) -> list[int]:
        """Greedy continuation by re-running the dense forward over the whole sequence each token."""
        ids = list(prompt_ids)
        self._check_length(len(ids), num_new_tokens)
        for _ in range(num_new_tokens):
            ids.append(int(self.dense_logits(ids)[-1].argmax()))
        return ids[len(prompt_ids):]

    def greedy_paged(
        self, prompt_ids: Sequence[int], num_new_tokens: int, *, block_size: int = 16, prefill_chunk: int = 64
    ) -> list[int]:
        """Greedy continuation through the paged path: chunked prefill, then one-token decode steps."""
        self._check_length(len(prompt_ids), num_new_tokens)
        total = len(prompt_ids) + num_new_tokens
        num_blocks = -(-total // block_size)
        cache = self.new_kv_cache(num_blocks, block_size)
        table = tuple(reversed(range(num_blocks)))  # deliberately not the identity mapping
        ids = list(prompt_ids)
        pos = 0
        while pos < len(ids):
            chunk = tuple(ids[pos:pos + prefill_chunk])
            last = pos + len(chunk) == len(ids)
            logits = self.step([PagedSequence(chunk, pos, table, needs_logits=last)], cache)
            pos += len(chunk)
        for i in range(num_new_tokens):
            ids.append(int(logits[0].argmax()))
            if i + 1 < num_new_tokens:
                logits = self.step([PagedSequence((ids[-1],), len(ids) - 1, table, needs_logits=True)], cache)
        return ids[len(prompt_ids):]

    def paged_logits(self, token_ids: Sequence[int], adapter: str = "", *, block_size: int = 16) -> torch.Tensor:
        """Logits after every token of one sequence, `float32[len(token_ids), vocab]`, through one paged step
        under `adapter` (LoRA; "": the base model): what the paged path computes where the dense
        reference does not apply the adapter."""
        num_blocks = -(-len(token_ids) // block_size)
        cache = self.new_kv_cache(num_blocks, block_size)
        return self.step([PagedSequence(tuple(token_ids), 0, tuple(range(num_blocks)), True, all_logits=True,
                                        adapter=adapter)], cache)

    def greedy_paged_batch(
        self, prompts: Sequence[Sequence[int]], num_new_tokens: Sequence[int], *, block_size: int = 16,
        prefill_chunk: int = 64, adapters: Sequence[str] | None = None,
    ) -> list[list[int]]:
        """`greedy_paged` for several prompts at once, as the worker's steps run them: each step carries
        every sequence not yet done (a prompt chunk each, then one token each), in one shared cache. The
        golden check's path: a few wide steps instead of one narrow step per token of each prompt.
        `adapters`: each prompt's LoRA adapter ("": the base model); None: all the base model."""
        for prompt, num_new in zip(prompts, num_new_tokens, strict=True):
            self._check_length(len(prompt), num_new)
        num_blocks = [-(-(len(p) + n) // block_size) for p, n in zip(prompts, num_new_tokens, strict=True)]
        cache = self.new_kv_cache(max(1, sum(num_blocks)), block_size)
        first = [sum(num_blocks[:i]) for i in range(len(prompts))]
        tables = [tuple(reversed(range(f, f + n))) for f, n in zip(first, num_blocks, strict=True)]
        ids = [list(p) for p in prompts]
        computed = [0] * len(prompts)  # tokens of each sequence whose KV is in the cache
        while True:
            running = [i for i, p in enumerate(prompts) if len(ids[i]) - len(p) < num_new_tokens[i]]
            if not running:
                return [seq[len(p):] for seq, p in zip(ids, prompts, strict=True)]
            seqs = []
            for i in running:
                new = tuple(ids[i][computed[i]:computed[i] + prefill_chunk])
                seqs.append(PagedSequence(new, computed[i], tables[i],
                                          needs_logits=computed[i] + len(new) == len(ids[i]),
                                          adapter=adapters[i] if adapters is not None else ""))
                computed[i] += len(new)
            logits = iter(self.step(seqs, cache))
            for i, seq in zip(running, seqs, strict=True):
                if seq.needs_logits:
                    ids[i].append(int(next(logits).argmax()))

    def _check_length(self, num_prompt: int, num_new_tokens: int) -> None:
        if num_prompt < 1 or num_new_tokens < 1:
            raise ValueError(f"need a prompt and >= 1 new token, got {num_prompt} and {num_new_tokens}")
        if num_prompt + num_new_tokens > self.max_seq_len:
            raise ValueError(
                f"prompt {num_prompt} + {num_new_tokens} new tokens exceeds max_seq_len {self.max_seq_len}"
            )
