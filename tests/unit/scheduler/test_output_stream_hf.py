"""OutputStream over HF tokenizers: seeded property loops (hypothesis is not pinned).

Tokens of these tokenizers split characters of 2-4 UTF-8 bytes (byte-level pieces, `<0xNN>`
byte fallback) and are several bytes long, so a stop string can start or end inside a token.
"""

from __future__ import annotations

import random

import pytest
from tokenizers import Tokenizer as RustTokenizer

from services.scheduler.output_stream import OutputStream

from .hf_tokenizer_files import TEXT, UNSEEN, byte_level_json, sentencepiece_json
from .test_hf_tokenizer import byte_level, sentencepiece

SEEDS = range(300)
SOURCES = (TEXT, UNSEEN, "🙂🚀👩‍💻 ŋ ∮ 東京", "aaaa bbbb ab ba")


def random_text(rng: random.Random) -> str:
    pieces = []
    for _ in range(rng.randrange(1, 4)):
        source = rng.choice(SOURCES)
        start = rng.randrange(len(source))
        pieces.append(source[start:start + rng.randrange(1, 40)])
    return "".join(pieces)


def stream_in_random_chunks(stream: OutputStream, ids, rng: random.Random) -> tuple[list, bool]:
    """Appends `ids`, taking a chunk after a random number of them; stops where the stream does."""
    chunks, stopped = [], False
    for token_id in ids:
        stopped = stream.append(token_id)
        if stopped or rng.random() < 0.4:
            chunks.append(stream.take(final=stopped))
        if stopped:
            return chunks, True
    chunks.append(stream.take(final=True))
    return chunks, False


@pytest.fixture(scope="module", params=["byte_level", "sentencepiece"])
def tokenizers(request):
    if request.param == "byte_level":
        return byte_level(), RustTokenizer.from_str(byte_level_json().decode())
    return sentencepiece(), RustTokenizer.from_str(sentencepiece_json().decode())


def test_chunks_never_split_a_character_and_add_up_to_the_whole_decode(tokenizers):
    tokenizer, rust = tokenizers
    for seed in SEEDS:
        rng = random.Random(seed)
        ids = list(rust.encode(random_text(rng), add_special_tokens=False).ids)
        ids.insert(rng.randrange(len(ids) + 1), tokenizer.eos_token_id)  # special: no text, still a token
        chunks, _ = stream_in_random_chunks(OutputStream(tokenizer), ids, rng)
        whole = tokenizer.decode(ids)
        assert "\ufffd" not in whole
        assert all("\ufffd" not in c.text for c in chunks), (seed, chunks)  # no character cut in two
        assert "".join(c.text for c in chunks) == whole
        assert [t for c in chunks for t in c.token_ids] == ids
        if tokenizer.strips_leading_space:  # a continuation: decode(prompt + ids) minus decode(prompt)
            assert "a" + whole == rust.decode(rust.encode("a", add_special_tokens=False).ids + ids)
        else:
            assert whole == rust.decode(ids)


def test_random_ids_with_broken_utf8_stream_what_decoding_them_at_once_gives(tokenizers):
    tokenizer, rust = tokenizers
    for seed in SEEDS:
        rng = random.Random(seed)
        ids = [rng.randrange(tokenizer.vocab_size) for _ in range(rng.randrange(1, 30))]
        chunks, _ = stream_in_random_chunks(OutputStream(tokenizer), ids, rng)
        assert "".join(c.text for c in chunks) == tokenizer.decode(ids), seed
        if not tokenizer.strips_leading_space:  # ByteLevel's lossy decode is Python's (token_byte_table.py)
            assert tokenizer.decode(ids) == rust.decode(ids)


def test_stop_strings_across_token_and_chunk_boundaries_end_the_text_right_before_them(tokenizers):
    tokenizer, rust = tokenizers
    num_inside_a_token = 0
    for seed in SEEDS:
        rng = random.Random(seed)
        ids = list(rust.encode(random_text(rng), add_special_tokens=False).ids)
        whole = tokenizer.decode(ids)
        start = rng.randrange(len(whole))
        stop = whole[start:start + rng.randrange(1, 7)]
        stops = (stop, "never in the text \x00")
        chunks, stopped = stream_in_random_chunks(OutputStream(tokenizer, stops), ids, rng)
        text = "".join(c.text for c in chunks)
        assert stopped and text == whole[: whole.index(stop)], (seed, stop, chunks)
        streamed_ids = [t for c in chunks for t in c.token_ids]
        assert streamed_ids == ids[: len(streamed_ids)]
        # Every token with text before the stop is streamed, the one the stop begins in included.
        ends = [sum(len(tokenizer.token_bytes(t)) for t in ids[: i + 1]) for i in range(len(ids))]
        text_bytes = len(text.encode())
        assert [t for t, end in zip(ids, ends, strict=True) if end - len(tokenizer.token_bytes(t)) < text_bytes] \
            == streamed_ids, (seed, stop, chunks)
        num_inside_a_token += text_bytes not in ends and text_bytes > 0
    assert num_inside_a_token > 20  # the loop did test stops that begin inside a token


def test_text_that_may_begin_a_stop_string_is_held_back_until_it_cannot(tokenizers):
    tokenizer, rust = tokenizers
    num_held = 0
    for seed in SEEDS:
        rng = random.Random(seed)
        ids = list(rust.encode(random_text(rng), add_special_tokens=False).ids)
        whole = tokenizer.decode(ids)
        first = whole[rng.randrange(len(whole))]
        stream = OutputStream(tokenizer, (first + "\x00",))  # begins with a character of the text, never matches
        streamed = ""
        for i, token_id in enumerate(ids):
            assert not stream.append(token_id)
            streamed += stream.take(final=False).text
            so_far = tokenizer.decode(ids[: i + 1])
            assert so_far.startswith(streamed)
            if so_far.endswith(first):  # it may begin the stop string: not streamed yet
                assert len(streamed) < len(so_far), (seed, first, so_far, streamed)
                num_held += 1
        assert streamed + stream.take(final=True).text == whole
    assert num_held > 100


def test_a_resumed_stream_continues_the_text_exactly_where_the_client_left_it(tokenizers):
    """Failover: the client holds the chunks up to some point; a new stream replays their ids and
    sends the rest. Characters split across that point arrive whole, none twice."""
    tokenizer, rust = tokenizers
    for seed in SEEDS:
        rng = random.Random(seed)
        ids = list(rust.encode(random_text(rng), add_special_tokens=False).ids)
        stops = ("\x00never",) if rng.random() < 0.5 else ()
        first = OutputStream(tokenizer, stops)
        received_text, received_ids = "", []
        cut = rng.randrange(len(ids) + 1)
        for token_id in ids[:cut]:
            first.append(token_id)
            chunk = first.take(final=False)
            received_text += chunk.text
            received_ids += chunk.token_ids
        resumed = OutputStream(tokenizer, stops)
        resumed.replay(received_ids)
        rest = ids[len(received_ids):]
        chunks, _ = stream_in_random_chunks(resumed, rest, rng)
        assert received_text + "".join(c.text for c in chunks) == tokenizer.decode(ids), seed
        assert [c.index for c in chunks if c.token_ids][:1] in ([], [len(received_ids)])
