"""The tokenizer of the worker group's medium random-weight models (bench_hf_llm's Llama, bench_embeddings'
Qwen3 embedder): a byte-level BPE trained on the repository's docs, so that nothing is downloaded and text
cut from the docs tokenizes at a realistic ~4 characters a token."""

from __future__ import annotations

from pathlib import Path

from bench.harness.results import ROOT


def save_docs_tokenizer(directory: Path, vocab_size: int) -> None:
    """directory/tokenizer.json: a byte-level BPE of `vocab_size` ids trained on the repository's docs,
    <s> and </s> its ids 0 and 1."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tokenizer.train_from_iterator([p.read_text() for p in sorted((ROOT / "docs").glob("*.md"))], trainer)
    tokenizer.save(str(directory / "tokenizer.json"))
