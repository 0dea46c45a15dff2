from __future__ import annotations

import random

import pytest

from services.scheduler.output_stream import OutputStream
from services.scheduler.tokenizer import ByteTokenizer, IncrementalDetokenizer

from .conftest import EOS, TOKENIZER


def stream_all(stream: OutputStream, token_ids, *, final: bool = True) -> list:
    chunks = []
    for token_id in token_ids:
        stopped = stream.append(token_id)
        chunks.append(stream.take(final=stopped))
        if stopped:
            return chunks
    if final:
        chunks.append(stream.take(final=True))
    return chunks


def test_byte_tokenizer_encodes_utf8_bytes_after_bos():
    tokenizer = ByteTokenizer.from_spec(vocab_size=258, eos_token_id=256, bos_token_id=257)
    assert tokenizer.encode("hé") == (257, 104, 195, 169)
    assert tokenizer.decode(tokenizer.encode("hé")) == "hé"
    assert tokenizer.token_bytes(256) == b""
    assert ByteTokenizer.from_spec(vocab_size=257, eos_token_id=256, bos_token_id=-1).bos_token_id is None


def test_byte_tokenizer_rejects_ids_outside_the_vocabulary_and_bad_specs():
    with pytest.raises(ValueError, match=r"token id 300 outside the vocabulary \[0, 257\)"):
        TOKENIZER.token_bytes(300)
    with pytest.raises(ValueError, match="eos_token_id must be a special id"):
        ByteTokenizer(vocab_size=257, eos_token_id=65)
    with pytest.raises(ValueError, match="vocab_size must exceed 256"):
        ByteTokenizer(vocab_size=256, eos_token_id=255)


def test_detokenizer_holds_back_bytes_of_an_incomplete_character():
    detokenizer = IncrementalDetokenizer(TOKENIZER)
    euro = list("€".encode())  # three bytes
    assert detokenizer.push([ord("a"), euro[0]]) == "a"
    assert detokenizer.push([euro[1]]) == ""
    assert detokenizer.push([euro[2], ord("b")]) == "€b"
    assert detokenizer.push([0xE2]) == ""
    assert detokenizer.flush() == "\ufffd"


def test_stream_sends_tokens_at_once_and_text_when_characters_complete():
    stream = OutputStream(TOKENIZER)
    chunks = stream_all(stream, list("é!".encode()))
    assert [(c.token_ids, c.text, c.index) for c in chunks[:3]] == [((195,), "", 0), ((169,), "é", 1), ((33,), "!", 2)]


def test_stop_string_is_never_streamed_and_its_prefix_is_held_back():
    stream = OutputStream(TOKENIZER, stop=("END",))
    chunks = stream_all(stream, list(b"okEN"), final=False)
    assert "".join(c.text for c in chunks) == "ok"  # "EN" might start "END"
    assert stream.append(ord("D"))
    last = stream.take(final=True)
    assert last.text == "" and last.token_ids == ()
    assert stream.num_emitted_tokens == 2


def test_held_back_prefix_is_released_when_the_text_diverges():
    stream = OutputStream(TOKENIZER, stop=("END",))
    chunks = stream_all(stream, list(b"ENx"), final=False)
    assert [c.text for c in chunks] == ["", "", "ENx"]
    assert [c.index for c in chunks] == [0, 0, 0]


def test_text_after_a_stop_string_inside_one_token_run_is_cut_at_the_stop():
    stream = OutputStream(TOKENIZER, stop=("\n\n", "xyz"))
    chunks = stream_all(stream, list(b"line one\n\nline two"))
    assert "".join(c.text for c in chunks) == "line one"
    assert [t for c in chunks for t in c.token_ids] == list(b"line one")


def test_special_tokens_stream_as_ids_without_text():
    stream = OutputStream(TOKENIZER)
    chunks = stream_all(stream, [ord("a"), EOS, ord("b")])
    assert [t for c in chunks for t in c.token_ids] == [97, EOS, 98]
    assert "".join(c.text for c in chunks) == "ab"


def test_chunks_concatenate_to_the_text_before_the_first_stop_for_random_streams():
    rng = random.Random(4)
    alphabet = "ab€é\n"
    for _ in range(200):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 20)))
        stops = tuple({"".join(rng.choice(alphabet) for _ in range(rng.randint(1, 3))) for _ in range(2)})
        stream = OutputStream(TOKENIZER, stop=stops)
        chunks = stream_all(stream, list(text.encode()))
        cut = min((i for i in (text.find(s) for s in stops) if i >= 0), default=len(text))
        assert "".join(c.text for c in chunks) == text[:cut]
        token_ids = [t for c in chunks for t in c.token_ids]
        assert bytes(token_ids) == text[:cut].encode()
        assert [c.index for c in chunks] == [sum(len(c.token_ids) for c in chunks[:i]) for i in range(len(chunks))]


# -- vLLM's min_tokens: no stop string counts in the first min_tokens tokens ------------------------


def _text(chunks) -> str:
    return "".join(c.text for c in chunks)


def test_min_tokens_ignores_a_stop_string_that_ends_in_its_tokens():
    # "ab" ends at token 2 of 3 held off; the next "ab" ends at token 6.
    assert _text(stream_all(OutputStream(TOKENIZER, stop=("ab",), min_tokens=3), list(b"abxxabyy"))) == "abxx"
    assert _text(stream_all(OutputStream(TOKENIZER, stop=("ab",)), list(b"abxxabyy"))) == ""
    # Held off at every token it could end in, it is never found.
    assert _text(stream_all(OutputStream(TOKENIZER, stop=("ab",), min_tokens=8), list(b"abxxabyy"))) == "abxxabyy"


def test_min_tokens_finds_a_stop_string_that_begins_in_its_tokens_and_ends_after_them():
    stream = OutputStream(TOKENIZER, stop=("xyz",), min_tokens=3)
    assert _text(stream_all(stream, list(b"axyzb"))) == "a"  # "xyz" ends at token 4, past the 3 held off
    assert stream.stopped


def test_a_short_stop_string_inside_min_tokens_is_not_found_later_beside_a_longer_one():
    # "b" ends at token 2 (held off); the search at token 4 must not find it in text already passed.
    stream = OutputStream(TOKENIZER, stop=("b", "zzzz"), min_tokens=3)
    assert _text(stream_all(stream, list(b"abcdef"))) == "abcdef" and not stream.stopped


def test_a_continuation_replays_min_tokens_as_the_unbroken_stream_counted_them():
    stream = OutputStream(TOKENIZER, stop=("ab",), min_tokens=3)
    stream.replay(list(b"ab"))  # "ab" ended inside min_tokens: no stop, so a valid prefix
    assert _text(stream_all(stream, list(b"xab"))) == "x"


def test_include_stop_str_in_output_ends_the_text_after_the_stop_string():
    stream = OutputStream(TOKENIZER, stop=("END", "EN!"), include_stop=True)
    chunks = stream_all(stream, list(b"okENDmore"))
    assert _text(chunks) == "okEND" and [t for c in chunks for t in c.token_ids] == list(b"okEND")
    held = OutputStream(TOKENIZER, stop=("xyz",), min_tokens=2, include_stop=True)
    assert _text(stream_all(held, list(b"axyzb"))) == "axyz"
