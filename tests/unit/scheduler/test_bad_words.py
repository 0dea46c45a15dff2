"""vLLM's bad_words and allowed_token_ids at the scheduler: the words tokenized once at admission, each
sampling step's bans from the output so far (never the prompt), across preemption and pipelined steps,
and both fields checked and sent to the worker."""

from __future__ import annotations

import pytest

from infermesh.v1 import common_pb2
from services.common import errors
from services.common.priority import Priority
from services.scheduler import attach_codec
from services.scheduler.bad_words import BadWordRefused, BadWords, tokenize_bad_words
from services.scheduler.call_codec import decode_sampling
from services.scheduler.fair_queue import TenantContext
from services.scheduler.generate_stream import GenerateStream
from services.scheduler.sequence import SamplingParams
from services.scheduler.step_plan import SequenceStep, StepPlan
from services.worker.step_codec import run_step_from_proto

from .conftest import FakePagedWorker, make_scheduler, tenant

# A tokenizer where a space before a word may give another first token (as BPE vocabularies do).
_VOCAB = {"cat": (5,), " cat": (6,), "big dog": (7, 8), " big dog": (9, 8), "ox": (1, 2), " ox": (3,)}


def _encode(text: str) -> tuple[int, ...]:
    return _VOCAB[text]


# -- tokenizing -------------------------------------------------------------------------------------


def test_words_are_tokenized_bare_and_after_a_space_as_vllm_does() -> None:
    words = tokenize_bad_words(["cat", "  big dog", "ox"], _encode, vocab_size=10)
    assert words == BadWords(always=(5, 6), after=(((7,), 8), ((9,), 8), ((1,), 2)))
    # " ox" gives a different number of tokens: vLLM keeps only the bare form then.
    assert tokenize_bad_words([], _encode, vocab_size=10) is None


@pytest.mark.parametrize(("words", "fragment"), [
    (["cat"] * 129, "holds 129 words; at most 128"),
    (["", "cat"], "bad_words[0] must be 1-256 bytes"),
    (["cat", "   "], "bad_words[1] must be 1-256 bytes"),
    (["x" * 257], "bad_words[0] must be 1-256 bytes"),
    (["cat"], "outside the model's vocabulary (vocab_size 5)"),
])
def test_refused_words_name_the_field(words, fragment) -> None:
    with pytest.raises(BadWordRefused) as caught:
        tokenize_bad_words(words, _encode, vocab_size=5 if words == ["cat"] else 10)
    assert fragment in str(caught.value)


def test_a_word_that_tokenizes_to_nothing_is_refused() -> None:
    with pytest.raises(BadWordRefused, match=r"bad_words\[0\] tokenizes to no token"):
        tokenize_bad_words(["cat"], lambda text: (), vocab_size=10)


# -- the bans of one step ---------------------------------------------------------------------------


def test_one_token_words_are_always_banned_longer_ones_only_right_after_their_other_tokens() -> None:
    words = BadWords(always=(5,), after=(((1, 2), 3), ((7,), 8)))
    assert words.banned([]) == (5,)
    assert words.banned([1, 2]) == (5, 3)
    assert words.banned([9, 1, 2]) == (5, 3)
    assert words.banned([1, 2, 4]) == (5,), "the match must be at the output's end"
    assert words.banned([2]) == (5,)
    assert words.banned([4, 7]) == (5, 8)
    assert BadWords(always=(5,)).banned([1, 2]) == (5,) and not BadWords(always=(5,)).reads_output


def _greedy_output(clock, prompt, max_tokens) -> list[int]:
    scheduler, worker = make_scheduler(clock), FakePagedWorker(4)
    scheduler.add_request(1, prompt, SamplingParams(max_tokens=max_tokens), tenant(), deadline_s=None)
    deltas = []
    while scheduler.has_work():
        plan = scheduler.schedule()
        if plan.has_work():
            deltas += scheduler.update_from_output(plan, worker.run(plan))
    return [t for d in deltas for t in d.token_ids]


def test_each_sampling_step_bans_from_the_output_so_far_never_the_prompt(clock) -> None:
    prompt = tuple(range(97, 105))
    output = _greedy_output(clock, prompt, 4)
    # The word's head is the prompt's last token too: only the output counts, so step 0 bans nothing more.
    assert prompt[-1] != output[0]
    words = BadWords(always=(120,), after=(((output[0],), 200), ((prompt[-1],), 201)))
    scheduler, worker = make_scheduler(clock), FakePagedWorker(4)
    seq = scheduler.add_request(1, prompt, SamplingParams(max_tokens=4, bad_words=words), tenant(), deadline_s=None)
    bans = []
    while scheduler.has_work():
        plan = scheduler.schedule()
        bans += [(s.num_generated, s.banned_token_ids) for s in plan.seqs if s.sample]
        if plan.has_work():
            scheduler.update_from_output(plan, worker.run(plan))
    expected = [(n, words.banned(seq.output_token_ids[:n])) for n in range(4)]
    assert bans == expected
    assert expected[1][1] == (120, 200) and 201 not in {t for _, b in expected for t in b}


def test_bans_after_a_preemption_come_from_the_output_kept_across_it(clock) -> None:
    prompt = tuple(range(97, 105))
    output = _greedy_output(clock, prompt, 12)
    words = BadWords(always=(), after=(((output[2],), 200),))
    scheduler, worker = make_scheduler(clock, num_blocks=5, block_size=4, max_seq_len=20), FakePagedWorker(4)
    low = TenantContext("low", Priority.SHEDDABLE, 1)
    seq = scheduler.add_request(1, prompt, SamplingParams(max_tokens=12, bad_words=words), low, deadline_s=None)
    for _ in range(3):  # the prompt, then two decodes: three tokens out
        plan = scheduler.schedule()
        scheduler.update_from_output(plan, worker.run(plan))
    assert seq.output_token_ids == output[:3]
    # A critical request that needs every block preempts it.
    scheduler.add_request(2, tuple(range(97, 109)), SamplingParams(max_tokens=2),
                          TenantContext("vip", Priority.CRITICAL, 1), deadline_s=None)
    resumed = None
    for _ in range(20):
        plan = scheduler.schedule()
        resumed = resumed or next((s for s in plan.seqs if s.seq_id == 1 and s.reset_block_table), None)
        if plan.has_work():
            scheduler.update_from_output(plan, worker.run(plan))
        if resumed is not None:
            break
    assert seq.num_preemptions == 1 and resumed is not None
    assert resumed.sample and resumed.num_generated == 3 and resumed.banned_token_ids == (200,)


def test_no_step_planned_ahead_decodes_a_sequence_whose_bans_need_the_sample_in_flight(clock) -> None:
    scheduler, worker = make_scheduler(clock), FakePagedWorker(4)
    long_word = BadWords(always=(120,), after=(((1,), 2),))
    one_token = BadWords(always=(121,))
    seq = scheduler.add_request(1, tuple(range(97, 105)), SamplingParams(max_tokens=8, bad_words=long_word),
                                tenant(), deadline_s=None)
    scheduler.add_request(2, tuple(range(98, 106)), SamplingParams(max_tokens=8, bad_words=one_token), tenant(),
                          deadline_s=None)
    first = scheduler.schedule()
    assert {s.seq_id for s in first.seqs if s.sample} == {1, 2}
    ahead = scheduler.schedule_ahead()
    assert ahead is not None
    assert [(s.seq_id, s.input_from_last_sample, s.banned_token_ids) for s in ahead.seqs] == [(2, True, (121,))]
    scheduler.update_from_output(first, worker.run(first))
    after = scheduler.schedule_ahead()  # sequence 1's sample is back: it decodes from its own output
    assert after is not None
    one = next(s for s in after.seqs if s.seq_id == 1)
    assert not one.input_from_last_sample and one.banned_token_ids == long_word.banned(seq.output_token_ids)


# -- checked and sent -------------------------------------------------------------------------------


def test_allowed_token_ids_are_checked_sorted_and_sent_with_each_sampling_step() -> None:
    sampling = decode_sampling(common_pb2.SamplingParams(allowed_token_ids=[9, 3, 9]), 4, vocab_size=10)
    assert sampling.allowed_token_ids == (3, 9)
    with pytest.raises(errors.InvalidArgument, match=r"sampling.allowed_token_ids\[1\] is 10, but the model's"):
        decode_sampling(common_pb2.SamplingParams(allowed_token_ids=[3, 10]), 4, vocab_size=10)
    with pytest.raises(errors.InvalidArgument, match=r"sampling.allowed_token_ids holds 4097 ids; at most 4096"):
        decode_sampling(common_pb2.SamplingParams(allowed_token_ids=range(4097)), 4, vocab_size=5000)
    streams = {1: GenerateStream(seq_id=1, tenant=TenantContext("t"), seed=5, trace_context={}, arrival_s=0.0,
                                 deadline_s=None)}
    step = SequenceStep(seq_id=1, token_ids=(97,), start_position=4, new_blocks=(), reset_block_table=False,
                        sample=True, sampling=sampling, num_generated=0, banned_token_ids=(4, 5))
    sent = attach_codec.encode_run_step(StepPlan(1, (step,), ()), streams)
    assert (list(sent.seqs[0].sampling.allowed_token_ids), list(sent.seqs[0].banned_token_ids)) == ([3, 9], [4, 5])
    worker_side = run_step_from_proto(sent).seqs[0]
    assert (worker_side.sampling.allowed_token_ids, worker_side.banned_token_ids) == ((3, 9), (4, 5))
    plain = attach_codec.encode_run_step(StepPlan(1, (SequenceStep(
        seq_id=1, token_ids=(97,), start_position=4, new_blocks=(), reset_block_table=False, sample=True,
        sampling=SamplingParams(max_tokens=4), num_generated=0),), ()), streams).seqs[0]
    assert not plain.sampling.allowed_token_ids and not plain.banned_token_ids


def test_bad_words_are_tokenized_at_decode_and_refusals_name_the_field() -> None:
    sampling = decode_sampling(common_pb2.SamplingParams(bad_words=["cat", "big dog"]), 4, vocab_size=10,
                               encode=_encode)
    assert sampling.bad_words == BadWords(always=(5, 6), after=(((7,), 8), ((9,), 8)))
    assert decode_sampling(common_pb2.SamplingParams(), 4, vocab_size=10, encode=_encode).bad_words is None
    with pytest.raises(errors.InvalidArgument, match=r"^sampling.bad_words\[1\] must be 1-256 bytes"):
        decode_sampling(common_pb2.SamplingParams(bad_words=["cat", " "]), 4, vocab_size=10, encode=_encode)
    with pytest.raises(errors.InvalidArgument, match=r"^sampling.bad_words needs the model's tokenizer"):
        decode_sampling(common_pb2.SamplingParams(bad_words=["cat"]), 4, vocab_size=10)
