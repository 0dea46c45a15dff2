"""HFTokenizer: encode as transformers does, exact bytes per id, refusals that name what is wrong."""

from __future__ import annotations

import json
import random

import pytest
from tokenizers import Tokenizer as RustTokenizer

from services.scheduler.hf_tokenizer import HFTokenizer, HFTokenizerSource, TokenizerRefused

from .hf_tokenizer_files import TEXT, UNSEEN, byte_level_json, num_ids, sentencepiece_json, with_decoder

PADDING = 8  # the model's vocab_size past the tokenizer's ids, as real checkpoints pad their embeddings


def byte_level(**over) -> HFTokenizer:
    js = byte_level_json()
    rust = RustTokenizer.from_str(js.decode())
    fields = dict(tokenizer_json=js, vocab_size=num_ids(js) + PADDING, eos_token_id=rust.token_to_id("<|eot_id|>"),
                  special_tokens={"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>"})
    return HFTokenizer(HFTokenizerSource(**(fields | over)))


def sentencepiece(**over) -> HFTokenizer:
    js = sentencepiece_json()
    fields = dict(tokenizer_json=js, vocab_size=num_ids(js) + PADDING, eos_token_id=2,
                  special_tokens={"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"})
    return HFTokenizer(HFTokenizerSource(**(fields | over)))


def rust_of(js: bytes) -> RustTokenizer:
    return RustTokenizer.from_str(js.decode())


@pytest.mark.parametrize("make, js", [(byte_level, byte_level_json), (sentencepiece, sentencepiece_json)])
def test_encode_is_the_rust_tokenizers_with_its_post_processor(make, js):
    tokenizer, rust = make(), rust_of(js())
    for text in (TEXT, UNSEEN, "a", " leading space", "x<|eot_id|>y"):
        assert tokenizer.encode(text) == tuple(rust.encode(text).ids)
        assert tokenizer.encode(text, add_special_tokens=False) == tuple(rust.encode(text, add_special_tokens=False).ids)
    assert tokenizer.encode("hi")[0] == rust.token_to_id("<|begin_of_text|>" if make is byte_level else "<s>")


def test_byte_level_bytes_of_every_id_decode_as_tokenizers_decodes_them():
    """ByteLevel decodes the whole byte string lossily (Rust's from_utf8_lossy), as Python's
    errors='replace' does: any id sequence, valid UTF-8 or not, gives the same text."""
    tokenizer, rust = byte_level(), rust_of(byte_level_json())
    rng = random.Random(1)
    for _ in range(400):
        ids = [rng.randrange(tokenizer.vocab_size) for _ in range(rng.randrange(1, 24))]
        assert tokenizer.decode(ids) == rust.decode(ids, skip_special_tokens=True), ids


def test_byte_level_added_plain_text_token_is_its_own_utf8_and_specials_carry_none():
    tokenizer, rust = byte_level(), rust_of(byte_level_json())
    assert tokenizer.token_bytes(rust.token_to_id("hello there")) == b"hello there"
    assert tokenizer.token_bytes(rust.token_to_id("<|begin_of_text|>")) == b""
    assert tokenizer.token_bytes(tokenizer.vocab_size - 1) == b""  # padding past the tokenizer
    with pytest.raises(ValueError, match="outside the vocabulary"):
        tokenizer.token_bytes(tokenizer.vocab_size)


def test_sentencepiece_byte_tokens_are_bytes_and_the_underline_a_space():
    tokenizer, rust = sentencepiece(), rust_of(sentencepiece_json())
    assert tokenizer.decoder_name == "SentencePiece (byte fallback)"
    assert tokenizer.token_bytes(rust.token_to_id("<0xF0>")) == b"\xf0"
    assert tokenizer.token_bytes(rust.token_to_id("\u2581")) == b" "
    assert tokenizer.token_bytes(1) == b""  # <s>


def test_sentencepiece_stream_text_is_the_continuation_of_its_prompt():
    """tokenizers strips the decoded text's first space (the one the encoder prepended); a stream
    continues a prompt, so it keeps it: text == decode(prompt + ids) minus decode(prompt)."""
    tokenizer, rust = sentencepiece(), rust_of(sentencepiece_json())
    assert tokenizer.strips_leading_space
    rng = random.Random(2)
    prompt = list(rust.encode("Köln", add_special_tokens=False).ids)
    prompt_text = rust.decode(prompt)
    texts = [TEXT, UNSEEN, "🙂🚀 ŋ"]
    for _ in range(300):
        text = "".join(rng.choice(texts)[rng.randrange(20):][: rng.randrange(1, 30)] for _ in range(3)) or "x"
        ids = list(rust.encode(text, add_special_tokens=False).ids)
        ids.insert(rng.randrange(len(ids) + 1), rng.choice([1, 2]))  # a special token anywhere: no text
        assert prompt_text + tokenizer.decode(ids) == rust.decode(prompt + ids, skip_special_tokens=True)
        assert tokenizer.decode(ids) == " " + text  # the space the encoder prepended, kept
    first = rust.token_to_id("\u2581Grüße") or rust.encode(" Grüße", add_special_tokens=False).ids[0]
    assert tokenizer.decode([first]).startswith(" ") and not rust.decode([first]).startswith(" ")


def test_sentencepiece_invalid_byte_runs_differ_only_in_replacement_characters():
    """The stated exception: ByteFallback replaces every byte of a run that is not valid UTF-8;
    a stream replaces each maximal invalid subsequence, keeping the valid bytes before it."""
    tokenizer, rust = sentencepiece(), rust_of(sentencepiece_json())
    ids = [rust.token_to_id("<0x41>"), rust.token_to_id("<0xE2>")]
    assert tokenizer.decode(ids) == "A\ufffd"
    assert rust.decode(ids) == "\ufffd\ufffd"


@pytest.mark.parametrize("decoder, found", [
    (None, "has no decoder"),
    ({"type": "WordPiece", "prefix": "##", "cleanup": True}, "decoder WordPiece has no exact per-token byte map"),
    ({"type": "Sequence", "decoders": [{"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True, "use_regex": True},
                                       {"type": "Strip", "content": " ", "start": 1,
                                                                "stop": 0}]}, "ByteLevel, Strip"),
    ({"type": "Sequence", "decoders": [{"type": "Replace", "pattern": {"Regex": "▁+"}, "content": " "},
                                       {"type": "Fuse"}]}, "plain-string Replace"),
    ({"type": "Sequence", "decoders": [{"type": "Replace", "pattern": {"String": "▁"}, "content": " "},
                                       {"type": "Strip", "content": " ", "start": 1, "stop": 0}]}, "after Fuse"),
])
def test_refuses_a_decoder_it_cannot_map_exactly_naming_it(decoder, found):
    js = with_decoder(sentencepiece_json(), decoder)
    with pytest.raises(TokenizerRefused, match="tokenizer.json: .*" + found.replace("(", r"\(")):
        HFTokenizer(HFTokenizerSource(js, num_ids(js), 2))


def test_metaspace_decoder_maps_like_the_sequence():
    js = with_decoder(sentencepiece_json(), {"type": "Sequence", "decoders": [
        {"type": "ByteFallback"}, {"type": "Metaspace", "replacement": "▁", "prepend_scheme": "first", "split": False}]})
    with pytest.raises(TokenizerRefused, match="Metaspace after ByteFallback"):
        HFTokenizer(HFTokenizerSource(js, num_ids(js), 2))
    js = with_decoder(sentencepiece_json(), {"type": "Sequence", "decoders": [
        {"type": "Metaspace", "replacement": "▁", "prepend_scheme": "first", "split": False},
        {"type": "ByteFallback"}, {"type": "Fuse"}]})
    tokenizer, rust = HFTokenizer(HFTokenizerSource(js, num_ids(js), 2)), rust_of(js)
    assert tokenizer.strips_leading_space
    ids = list(rust.encode("a " + UNSEEN, add_special_tokens=False).ids)
    assert " " + rust.decode(ids) == tokenizer.decode(ids)


def test_refuses_a_vocab_larger_than_the_models_naming_both_files():
    js = byte_level_json()
    with pytest.raises(TokenizerRefused, match=rf"tokenizer.json has ids up to {num_ids(js) - 1} .* but "
                                               rf"config.json vocab_size is 300"):
        byte_level(vocab_size=300)


def test_refuses_named_special_tokens_the_tokenizer_lacks_and_a_foreign_eos():
    with pytest.raises(TokenizerRefused, match=r"tokenizer_config.json bos_token '<bos>' is not a token of"):
        sentencepiece(special_tokens={"bos_token": "<bos>"})
    with pytest.raises(TokenizerRefused, match=r"eos_token_id 700 is not a token of tokenizer.json"):
        sentencepiece(eos_token_id=700, vocab_size=800)
    with pytest.raises(TokenizerRefused, match="tokenizer.json does not load"):
        HFTokenizer(HFTokenizerSource(b"{not json", 10, 1))


def test_add_bos_and_eos_token_from_tokenizer_config_rebuild_the_post_processor():
    plain = sentencepiece().encode("hi")
    assert plain[0] == 1
    assert sentencepiece(add_bos_token=False).encode("hi") == plain[1:]
    assert sentencepiece(add_bos_token=True, add_eos_token=True).encode("hi") == plain + (2,)


def test_truncation_and_padding_in_tokenizer_json_are_ignored():
    spec = json.loads(byte_level_json())
    spec["truncation"] = {"direction": "Right", "max_length": 3, "strategy": "LongestFirst", "stride": 0}
    spec["padding"] = {"strategy": {"Fixed": 64}, "direction": "Right", "pad_to_multiple_of": None, "pad_id": 1,
                       "pad_type_id": 0, "pad_token": "<|end_of_text|>"}
    tokenizer = byte_level(tokenizer_json=json.dumps(spec).encode())
    assert tokenizer.encode(TEXT) == byte_level().encode(TEXT)
