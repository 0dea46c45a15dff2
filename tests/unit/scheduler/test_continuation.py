"""Continuations: a stream resumed from the tokens a client already received sends exactly the
unbroken stream's tail (text, ids, indexes, usage), and bad continuations are refused alone."""

from __future__ import annotations

import random

import pytest

from services.common.errors import InvalidArgument
from services.scheduler.output_stream import OutputStream
from services.scheduler.sequence import SamplingParams

from .conftest import (
    EOS,
    TOKENIZER,
    FakePagedWorker,
    Transcript,
    make_prompt,
    make_scheduler,
    run_steps,
    tenant,
)


def unbroken_chunks(token_ids: list[int], stops: tuple[str, ...]) -> list:
    """The chunks an unbroken stream sends for `token_ids` (ending at the first stop, or final at the end)."""
    stream = OutputStream(TOKENIZER, stop=stops)
    chunks = []
    for token_id in token_ids:
        stopped = stream.append(token_id)
        chunks.append(stream.take(final=stopped))
        if stopped:
            return chunks
    chunks.append(stream.take(final=True))
    return chunks


def resumed_chunks(delivered: list[int], token_ids: list[int], stops: tuple[str, ...]) -> list:
    """The chunks a stream resumed after `delivered` sends, fed the same generated tokens after them."""
    stream = OutputStream(TOKENIZER, stop=stops)
    stream.replay(delivered)
    chunks = []
    for token_id in token_ids[len(delivered):]:
        stopped = stream.append(token_id)
        chunks.append(stream.take(final=stopped))
        if stopped:
            return chunks
    chunks.append(stream.take(final=True))
    return chunks


def test_replay_then_stream_equals_the_unbroken_streams_tail_for_every_cut_of_random_streams():
    rng = random.Random(12)
    alphabet = "ab€é\n"
    num_cuts = 0
    for _ in range(300):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(1, 16)))
        stops = tuple({"".join(rng.choice(alphabet) for _ in range(rng.randint(1, 3))) for _ in range(2)})
        token_ids = list(text.encode())
        chunks = unbroken_chunks(token_ids, stops)
        for cut in range(len(chunks)):  # the client got chunks[:cut], then the stream broke
            delivered = [t for c in chunks[:cut] for t in c.token_ids]
            tail = chunks[cut:]
            resumed = resumed_chunks(delivered, token_ids, stops)
            assert "".join(c.text for c in resumed) == "".join(c.text for c in tail), (text, stops, cut)
            assert [t for c in resumed for t in c.token_ids] == [t for c in tail for t in c.token_ids]
            non_empty = [c for c in resumed if c.token_ids]
            if non_empty:
                assert non_empty[0].index == len(delivered)
            num_cuts += 1
    assert num_cuts > 1000


def test_replay_keeps_an_incomplete_characters_bytes_for_the_next_token():
    euro = list("€".encode())
    stream = OutputStream(TOKENIZER)
    stream.replay([ord("a"), euro[0], euro[1]])  # the client has "a" and two ids with no text yet
    stream.append(euro[2])
    chunk = stream.take(final=False)
    assert (chunk.token_ids, chunk.text, chunk.index) == ((euro[2],), "€", 3)


def test_replay_keeps_a_held_back_stop_prefix_matchable():
    # Unbroken: "a", "a" -> "a" sent, second "a" held ("ab" may follow); "b" -> stop at 1, the stream ends.
    stream = OutputStream(TOKENIZER, stop=("ab",))
    stream.replay([ord("a")])
    assert not stream.append(ord("a"))
    assert stream.take(final=False).token_ids == ()
    assert stream.append(ord("b"))
    assert stream.take(final=True).token_ids == ()


def test_replay_refuses_tokens_holding_a_stop_string():
    stream = OutputStream(TOKENIZER, stop=("END",))
    with pytest.raises(ValueError, match="a stop string ends at token 4"):
        stream.replay(list(b"okEND"))


# -- the step scheduler ----------------------------------------------------------------------


def unbroken_run(clock, prompt, max_tokens, **sampling) -> Transcript:
    scheduler = make_scheduler(clock)
    scheduler.add_request(1, prompt, SamplingParams(max_tokens=max_tokens, **sampling), tenant(), deadline_s=None)
    return run_steps(scheduler, FakePagedWorker(4), clock)


def test_resumed_sequence_streams_the_unbroken_tail_with_indexes_and_usage_counting_all(clock):
    prompt = make_prompt(1, 10)
    whole = unbroken_run(clock, prompt, 12)
    all_ids = whole.token_ids(1)
    assert len(all_ids) == 12
    for num_delivered in (1, 5, 11):
        scheduler = make_scheduler(clock)
        scheduler.add_request(2, prompt, SamplingParams(max_tokens=12), tenant(), deadline_s=None,
                              delivered_token_ids=tuple(all_ids[:num_delivered]))
        resumed = run_steps(scheduler, FakePagedWorker(4), clock)
        assert resumed.token_ids(2) == all_ids[num_delivered:]
        assert resumed.text(2) == whole.text(1)[num_delivered:]
        assert resumed.deltas[2][0].index == num_delivered
        last = resumed.last(2)
        assert (last.num_generated, last.num_prompt_tokens, last.finish_reason) == (12, 10, whole.last(1).finish_reason)
        assert scheduler.kv.num_used_blocks == 0


def test_resumed_first_step_prefills_prompt_and_delivered_tokens_and_samples_at_their_count(clock):
    scheduler = make_scheduler(clock, max_num_batched_tokens=64)
    delivered = (ord("x"), ord("y"), ord("z"))
    scheduler.add_request(1, (97, 98), SamplingParams(max_tokens=8, temperature=0.7, seed=9), tenant(),
                          deadline_s=None, delivered_token_ids=delivered)
    step = scheduler.schedule().seqs[0]
    # Sampling is a function of (seed, position): the worker must sample generated token #3 next.
    assert (step.token_ids, step.start_position, step.sample, step.num_generated) == ((97, 98, *delivered), 0, True, 3)


def test_resumed_sequence_ends_at_max_tokens_counting_the_delivered_ones(clock):
    scheduler = make_scheduler(clock)
    scheduler.add_request(1, (97,), SamplingParams(max_tokens=4), tenant(), deadline_s=None,
                          delivered_token_ids=(98, 99, 100))
    transcript = run_steps(scheduler, FakePagedWorker(4), clock)
    assert len(transcript.token_ids(1)) == 1
    assert transcript.last(1).index == 3 and transcript.last(1).num_generated == 4


def test_resumed_stop_string_split_across_the_break_ends_the_stream_where_the_unbroken_one_did(clock):
    # The model writes "acac..."; stop "ca": unbroken, the first "c" is held back and the stream ends at "a".
    def alternate(context):
        return ord("c") if context[-1] == ord("a") else ord("a")

    scheduler = make_scheduler(clock)
    scheduler.add_request(1, (ord("c"),), SamplingParams(max_tokens=10, stop=("ca",)), tenant(), deadline_s=None,
                          delivered_token_ids=(ord("a"),))
    transcript = run_steps(scheduler, FakePagedWorker(4, next_token=alternate), clock)
    assert transcript.token_ids(1) == [] and transcript.text(1) == ""
    assert transcript.last(1).finish_reason.value == "stop" and transcript.last(1).num_generated == 3


@pytest.mark.parametrize(
    ("delivered", "sampling", "match"),
    [
        ((97, 300), {}, r"continuation.token_ids\[1\] = 300 is outside the vocabulary \[0, 257\)"),
        ((97, -1), {}, r"token_ids\[1\] = -1 is outside"),
        ((97,) * 8, {}, "continuation has 8 tokens but max_tokens is 8"),
        ((97,), {"temperature": 0.5}, "temperature > 0 needs sampling.seed"),
        ((97, EOS), {}, r"token_ids\[1\] is the end-of-sequence id 256"),
        (tuple(b"xEND"), {"stop": ("END",)}, "cannot be a prefix of this stream: a stop string ends at token 3"),
    ],
)
def test_bad_continuations_are_invalid_arguments_and_touch_no_other_sequence(clock, delivered, sampling, match):
    scheduler = make_scheduler(clock)
    scheduler.add_request(1, make_prompt(1, 4), SamplingParams(max_tokens=8), tenant(), deadline_s=None)
    with pytest.raises(InvalidArgument, match=match):
        scheduler.add_request(2, make_prompt(2, 4), SamplingParams(max_tokens=8, **sampling), tenant(),
                              deadline_s=None, delivered_token_ids=delivered)
    assert scheduler.num_unfinished == 1 and scheduler.get(2) is None
    transcript = run_steps(scheduler, FakePagedWorker(4), clock)
    assert len(transcript.token_ids(1)) == 8


def test_continuation_beyond_max_seq_len_is_refused_with_the_request(clock):
    scheduler = make_scheduler(clock, max_seq_len=16, num_blocks=8)
    with pytest.raises(InvalidArgument, match=r"prompt \(4 tokens\) \+ max_tokens \(13\) = 17 exceeds"):
        scheduler.add_request(1, make_prompt(1, 4), SamplingParams(max_tokens=13), tenant(), deadline_s=None,
                              delivered_token_ids=(97,) * 12)


def test_end_of_sequence_may_be_delivered_when_the_stream_ignores_it(clock):
    scheduler = make_scheduler(clock)
    scheduler.add_request(1, (97,), SamplingParams(max_tokens=3, ignore_eos=True), tenant(), deadline_s=None,
                          delivered_token_ids=(98, EOS))
    transcript = run_steps(scheduler, FakePagedWorker(4), clock)
    assert transcript.deltas[1][0].index == 2 and transcript.last(1).num_generated == 3
