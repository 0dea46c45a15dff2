"""The manifest's `generator` block (kind "generator"): max_seq_len, tokenizer, transformer, golden prompts."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass, fields
from typing import Any, ClassVar

from services.worker.models.transformer import TransformerConfig
from services.worker.repository.embedding_spec import EmbeddingSpec
from services.worker.repository.envelope import Envelope
from services.worker.repository.errors import InvalidManifest
from services.worker.repository.hf_architecture import HF_CONFIG, HFArchitecture
from services.worker.repository.json_fields import JsonFields, one_of
from services.worker.repository.lora_pins import LoraPin
from services.worker.repository.sampling_defaults import SamplingDefaults
from services.worker.repository.tokenizer_spec import AnyTokenizerSpec, parse_tokenizer

TINYLM = "tinylm"  # our own DecoderLM (models/transformer.py); its block predates `format` and is written without


@dataclass(frozen=True)
class GoldenGeneration:
    prompt_ids: tuple[int, ...]
    expected_ids: tuple[int, ...]  # greedy continuation
    lora_adapter: str = ""  # under this LoRA adapter of the version (lora_adapters); "": the base model

    @classmethod
    def from_json(cls, x: JsonFields, vocab_size: int, max_seq_len: int) -> GoldenGeneration:
        x.allow_only("prompt_ids", "expected_ids", "lora_adapter")
        prompt, expected = x.ints("prompt_ids", 0, vocab_size), x.ints("expected_ids", 0, vocab_size)
        if len(prompt) + len(expected) > max_seq_len:
            raise x.fail("expected_ids", f"with the prompt exceeds max_seq_len {max_seq_len}")
        return cls(prompt, expected, x.text("lora_adapter") if "lora_adapter" in x.data else "")

    def to_json(self) -> dict[str, Any]:
        return {"prompt_ids": list(self.prompt_ids), "expected_ids": list(self.expected_ids),
                **({"lora_adapter": self.lora_adapter} if self.lora_adapter else {})}


@dataclass(frozen=True)
class GeneratorSpec:
    max_seq_len: int  # prompt + generated tokens
    tokenizer: AnyTokenizerSpec
    architecture: TransformerConfig | HFArchitecture
    golden: tuple[GoldenGeneration, ...]
    # The model's recommended sampling (generation_config.json's, recorded at import); empty: none.
    sampling_defaults: SamplingDefaults = SamplingDefaults()
    # Set: an embedding model (embedding_spec.py), whose golden cases are its own (`golden` is then empty).
    embedding: EmbeddingSpec | None = None
    # LoRA adapters pinned beside the model (lora_pins.py), each served as a model name of its own.
    lora_adapters: tuple[LoraPin, ...] = ()

    ENVELOPE_NEEDS: ClassVar[frozenset[str]] = frozenset(
        {"max_num_seqs", "max_num_batched_tokens", "num_kv_blocks", "block_size"})

    @classmethod
    def from_json(cls, g: JsonFields, envelope: Envelope) -> GeneratorSpec:
        g.allow_only("inputs", "tokenizer", "architecture", "golden", "sampling_defaults", "embedding", "lora_adapters")
        i = g.obj("inputs")
        i.allow_only("max_seq_len")
        max_seq_len = i.integer("max_seq_len", 1)
        tokenizer = parse_tokenizer(g.obj("tokenizer"))
        a = g.obj("architecture")
        architecture = _architecture(a)
        if architecture.vocab_size != tokenizer.vocab_size:
            raise a.fail("vocab_size",
                         f"is {architecture.vocab_size} but tokenizer.vocab_size is {tokenizer.vocab_size}")
        if envelope.num_kv_blocks * envelope.block_size < max_seq_len:
            raise InvalidManifest(
                f"{g.source}: envelope holds {envelope.num_kv_blocks}*{envelope.block_size} KV slots, "
                f"fewer than one sequence of max_seq_len {max_seq_len}"
            )
        embedding = (EmbeddingSpec.from_json(g.obj("embedding"), tokenizer.vocab_size, max_seq_len)
                     if "embedding" in g.data else None)
        # An embedding model's golden cases are its vectors (embedding.golden); a generator needs one greedy case.
        golden = tuple(GoldenGeneration.from_json(x, tokenizer.vocab_size, max_seq_len)
                       for x in g.items("golden", 0 if embedding is not None else 1))
        defaults = SamplingDefaults.from_json(g.obj("sampling_defaults")) if "sampling_defaults" in g.data \
            else SamplingDefaults()
        adapters = tuple(LoraPin.from_json(x) for x in g.items("lora_adapters", 0)) if "lora_adapters" in g.data \
            else ()
        names = [a.name for a in adapters]
        if len(set(names)) != len(names):
            raise g.fail("lora_adapters", f"names an adapter twice: {sorted(names)}")
        if adapters and (embedding is not None or not isinstance(architecture, HFArchitecture)):
            raise g.fail("lora_adapters", "are served only over a Hugging Face text generator (architecture format 'hf')")
        unknown = sorted({x.lora_adapter for x in golden if x.lora_adapter} - set(names))
        if unknown:
            raise g.fail("golden", f"names LoRA adapter {unknown[0]!r}, which lora_adapters does not pin")
        return cls(max_seq_len, tokenizer, architecture, golden, defaults, embedding, adapters)

    def to_json(self) -> dict[str, Any]:
        return {
            "inputs": {"max_seq_len": self.max_seq_len},
            "tokenizer": self.tokenizer.to_json(),
            "architecture": (self.architecture.to_json() if isinstance(self.architecture, HFArchitecture)
                             else asdict(self.architecture)),
            "golden": [x.to_json() for x in self.golden],
            **({} if self.sampling_defaults.empty else {"sampling_defaults": self.sampling_defaults.to_json()}),
            **({} if self.embedding is None else {"embedding": self.embedding.to_json()}),
            **({"lora_adapters": [a.to_json() for a in self.lora_adapters]} if self.lora_adapters else {}),
        }


def _architecture(a: JsonFields) -> TransformerConfig | HFArchitecture:
    """The block's schema is picked by its `format` (absent: tinylm)."""
    fmt = a.data.get("format", TINYLM)
    if fmt not in ARCHITECTURES:
        raise a.fail("format", f"must be {one_of(ARCHITECTURES)}, got {fmt!r}")
    return ARCHITECTURES[fmt](a)


def _transformer_config(a: JsonFields) -> TransformerConfig:
    a.allow_only(*(f.name for f in fields(TransformerConfig)))
    return TransformerConfig(
        vocab_size=a.integer("vocab_size", 1), num_layers=a.integer("num_layers", 1), d_model=a.integer("d_model", 1),
        num_heads=a.integer("num_heads", 1), num_kv_heads=a.integer("num_kv_heads", 1), d_ff=a.integer("d_ff", 1),
        rope_theta=a.number("rope_theta"), norm_eps=a.number("norm_eps"),
    )


# The generator's architecture block, keyed by its `format`.
ARCHITECTURES: dict[str, Callable[[JsonFields], TransformerConfig | HFArchitecture]] = {
    TINYLM: _transformer_config,
    HF_CONFIG: HFArchitecture.from_json,
}
