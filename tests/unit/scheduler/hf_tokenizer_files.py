"""Tokenizers the tests train themselves (no download): a byte-level BPE shaped like Llama 3's and
Qwen2's, and a SentencePiece-style BPE with byte fallback shaped like Llama 2's and Mistral's.

Both learn from TEXT, which mixes scripts and emoji so that characters of 2, 3 and 4 UTF-8 bytes
are split across tokens; UNSEEN holds characters neither saw, which the SentencePiece one can
only spell with `<0xNN>` byte tokens.
"""

from __future__ import annotations

import functools
import json

from tokenizers import (
    AddedToken,
    Tokenizer,
    decoders,
    models,
    normalizers,
    pre_tokenizers,
    processors,
    trainers,
)

TEXT = (
    "The quick brown fox jumps over the lazy dog, and the dog sleeps on. "
    "Grüße aus Köln: naïve café, façade, jalapeño! "
    "Съешь же ещё этих мягких французских булок, да выпей чаю. "
    "東京は日本の首都です。今日はいい天気ですね。 "
    "مرحبا بالعالم، كيف حالك؟ "
    "שלום עולם. नमस्ते दुनिया। "
    "Emoji: 🙂🚀👩‍💻🇫🇷 and 😀 again 🙂 "
)
UNSEEN = "ŋ ʃ 𝄞 🦜 ∮ ⅓ 가나다 ǅ"

BYTE_LEVEL_SPECIALS = ("<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>",
                       "<|eot_id|>", "<|im_start|>", "<|im_end|>")
SPM_SPECIALS = ("<unk>", "<s>", "</s>")


@functools.cache
def byte_level_json(vocab_size: int = 420) -> bytes:
    """Llama 3 style: ByteLevel pre-tokenizer and decoder; `<|begin_of_text|>` prepended on encode."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(BYTE_LEVEL_SPECIALS),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator([TEXT] * 4, trainer)
    bos = BYTE_LEVEL_SPECIALS[0]
    tok.post_processor = processors.TemplateProcessing(single=f"{bos} $A", pair=f"{bos} $A {bos} $B",
                                                       special_tokens=[(bos, tok.token_to_id(bos))])
    # A plain-text added token (not special): the decoder must pass it through as its UTF-8.
    tok.add_tokens([AddedToken("hello there", special=False)])
    return tok.to_str().encode()


@functools.cache
def sentencepiece_json(vocab_size: int = 700) -> bytes:
    """Llama 2 style: `▁` for spaces with one prepended, BPE with byte fallback, `<0x00>`..`<0xFF>`
    at ids 3..258, decoder Replace, ByteFallback, Fuse, Strip; `<s>` prepended on encode."""
    tok = Tokenizer(models.BPE(byte_fallback=True, unk_token="<unk>", fuse_unk=True))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("\u2581"), normalizers.Replace(" ", "\u2581")])
    trainer = trainers.BpeTrainer(vocab_size=vocab_size - 256, special_tokens=list(SPM_SPECIALS), limit_alphabet=120,
                                  show_progress=False)
    tok.train_from_iterator([TEXT] * 4, trainer)
    spec = json.loads(tok.to_str())
    learned = sorted(spec["model"]["vocab"].items(), key=lambda item: item[1])
    vocab = {token: i for i, token in enumerate(SPM_SPECIALS)}
    vocab.update({f"<0x{b:02X}>": len(SPM_SPECIALS) + b for b in range(256)})
    for token, _ in learned:
        vocab.setdefault(token, len(vocab))
    spec["model"]["vocab"] = vocab
    spec["decoder"] = {"type": "Sequence", "decoders": [
        {"type": "Replace", "pattern": {"String": "\u2581"}, "content": " "},
        {"type": "ByteFallback"}, {"type": "Fuse"},
        {"type": "Strip", "content": " ", "start": 1, "stop": 0}]}
    spec["post_processor"] = {
        "type": "TemplateProcessing",
        "single": [{"SpecialToken": {"id": "<s>", "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}],
        "pair": [{"SpecialToken": {"id": "<s>", "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}},
                 {"SpecialToken": {"id": "<s>", "type_id": 1}}, {"Sequence": {"id": "B", "type_id": 1}}],
        "special_tokens": {"<s>": {"id": "<s>", "ids": [1], "tokens": ["<s>"]}},
    }
    return json.dumps(spec).encode()


def with_decoder(tokenizer_json: bytes, decoder: dict | None) -> bytes:
    spec = json.loads(tokenizer_json)
    spec["decoder"] = decoder
    return json.dumps(spec).encode()


@functools.cache
def with_added_tokens(tokenizer_json: bytes, tokens: tuple[str, ...], special: bool = False) -> bytes:
    """`tokenizer_json` with `tokens` added after its ids: plain text (Qwen3's and the R1 distills' think
    tags are), or special ones, which carry no text."""
    tok = Tokenizer.from_str(tokenizer_json.decode())
    tok.add_tokens([AddedToken(token, special=special) for token in tokens])
    return tok.to_str().encode()


def num_ids(tokenizer_json: bytes) -> int:
    return Tokenizer.from_str(tokenizer_json.decode()).get_vocab_size(with_added_tokens=True)
