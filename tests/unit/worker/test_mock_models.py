"""The mock worker models: deterministic tokens, the real block-table contract, time on a timer."""

from __future__ import annotations

import asyncio

import pytest

from infermesh.v1 import common_pb2, scheduler_pb2
from services.common.timings import from_proto
from services.worker.mock_models import (
    MOCK_LABELS,
    MockClassifierRuntime,
    MockGeneratorRuntime,
    MockProfile,
    make_mock_runtime,
    mock_continuation,
    mock_label_index,
    mock_token,
    parse_mock_profile,
)
from services.worker.runtime import BatchRuntime, StepRuntime

INVALID_ARGUMENT = 3


class RecordedSleep:
    """Stands in for asyncio.sleep: records each delay and returns at once."""

    def __init__(self) -> None:
        self.delays_s: list[float] = []

    async def __call__(self, delay_s: float) -> None:
        self.delays_s.append(delay_s)


def seq_step(seq_id: int, token_ids, start: int, new_blocks=(), reset: bool = False, sample: bool = True,
             temperature: float = 0.0, seed: int | None = None, num_generated: int = 0) -> scheduler_pb2.SequenceStep:
    sampling = common_pb2.SamplingParams(temperature=temperature)
    if seed is not None:
        sampling.seed = seed
    return scheduler_pb2.SequenceStep(seq_id=seq_id, token_ids=list(token_ids), start_position=start,
                                      new_blocks=list(new_blocks), reset_block_table=reset, sample=sample,
                                      sampling=sampling, num_generated=num_generated)


def run(runtime, *seqs, step_id: int = 0, finished=()) -> scheduler_pb2.StepResult:
    command = scheduler_pb2.RunStep(step_id=step_id, seqs=list(seqs), finished_seq_ids=list(finished))
    return asyncio.run(runtime.run_step(command))


@pytest.fixture
def sleep() -> RecordedSleep:
    return RecordedSleep()


@pytest.fixture
def generator(sleep) -> MockGeneratorRuntime:
    runtime = MockGeneratorRuntime("1", MockProfile(step_ms=8, per_token_us=50, num_kv_blocks=8, block_size=4,
                                                    max_seq_len=64), sleep=sleep)
    runtime.load()
    return runtime


def test_mock_tokens_are_fixed_letters_of_seed_position_and_last_token():
    tokens = {mock_token(seed, pos, last) for seed in (0, 7) for pos in range(40) for last in (97, 98, 256)}
    assert tokens <= set(range(ord("a"), ord("z") + 1)) and len(tokens) > 20, "letters, well spread"
    assert mock_token(0, 3, 99) == mock_token(0, 3, 99)
    assert mock_continuation(b"abc", 8) == mock_continuation(b"abc", 8)
    assert mock_continuation(b"abc", 8, seed=1) != mock_continuation(b"abc", 8, seed=2)
    # Pinned, so a change to the function is a visible change to every recorded expectation.
    assert bytes(mock_continuation(b"abc", 12)).decode() == "wzzonooouysf"
    assert bytes(mock_continuation(b"abc", 12, seed=7)).decode() == "xufpxdxhebtk"
    assert mock_token(0, 3, ord("c")) == ord("w")


def test_hello_declares_the_profiles_capacity_and_a_byte_tokenizer(generator):
    hello = generator.hello("w1")
    assert (hello.model.name, hello.model.version, hello.kind) == ("mock-generator", "1", common_pb2.MODEL_KIND_GENERATOR)
    cap = hello.capacity
    assert (cap.num_kv_blocks, cap.block_size, cap.max_seq_len, cap.max_num_seqs, cap.max_num_batched_tokens) == \
        (8, 4, 64, 256, 2048)
    assert (hello.tokenizer.vocab_size, hello.tokenizer.eos_token_id) == (257, 256)


def test_prefill_in_chunks_then_decode_gives_the_greedy_continuation(generator):
    prompt = list(b"hello")
    run(generator, seq_step(1, prompt[:3], 0, (0,), reset=True, sample=False))  # a non-final chunk
    out = run(generator, seq_step(1, prompt[3:], 3, (1,)), step_id=1)
    tokens = [out.outputs[0].token_id]
    for i in range(5):
        position = len(prompt) + len(tokens) - 1
        new_blocks = (2 + i,) if position % 4 == 0 else ()
        out = run(generator, seq_step(1, [tokens[-1]], position, new_blocks, num_generated=len(tokens)), step_id=2 + i)
        tokens.append(out.outputs[0].token_id)
    assert tokens == mock_continuation(prompt, 6)
    assert generator.kv_blocks_used() == 3  # positions 0..10 in blocks of 4


def test_seeded_sampling_uses_the_seed_and_greedy_ignores_it(generator):
    out = run(generator, seq_step(1, b"ab", 0, (0,), reset=True, temperature=0.8, seed=42),
              seq_step(2, b"ab", 0, (1,), reset=True, temperature=0.0, seed=42))
    assert [o.token_id for o in out.outputs] == [mock_continuation(b"ab", 1, seed=42)[0], mock_continuation(b"ab", 1)[0]]


def test_a_step_waits_step_ms_plus_per_token_time_on_the_timer(generator, sleep):
    out = run(generator, seq_step(1, b"abcdefg", 0, (0, 1), reset=True), seq_step(2, b"xyz", 0, (2,), reset=True))
    assert sleep.delays_s == [pytest.approx(0.008 + 10 * 50e-6)]
    assert [(s.stage, s.duration_us) for s in from_proto(out.timings)] == [("compute", 8500)]


def test_an_inconsistent_sequence_fails_alone_and_is_forgotten(generator):
    out = run(generator, seq_step(1, b"abc", 0, (0,), reset=True),
              seq_step(2, b"q", 5, (1,), reset=True),  # a gap: nothing of sequence 2 is cached
              seq_step(3, b"abcdef", 0, (2,), reset=True))  # 6 positions in one block of 4
    codes = [(o.seq_id, o.error.code, o.error.message) for o in out.outputs if o.HasField("error")]
    assert codes == [
        (2, INVALID_ARGUMENT, "sequence 2: start_position 5 but only 0 positions are cached on this worker"
                                   " (unknown sequence: send reset_block_table)"),
        (3, INVALID_ARGUMENT, "sequence 3: block table of 1 blocks holds 4 positions; this step needs 6"),
    ]
    assert out.outputs[0].token_id == mock_continuation(b"abc", 1)[0]
    assert generator.kv_blocks_used() == 1


def test_abort_and_finished_ids_free_the_mirrored_blocks(generator):
    run(generator, seq_step(1, b"abcdef", 0, (0, 1), reset=True), seq_step(2, b"ab", 0, (2,), reset=True))
    assert generator.kv_blocks_used() == 3
    generator.abort(scheduler_pb2.Abort(seq_ids=[1]))
    assert generator.kv_blocks_used() == 1
    run(generator, finished=(2,), step_id=1)
    assert generator.kv_blocks_used() == 0


def test_forget_all_drops_every_sequence_of_the_session_that_ended(generator):
    run(generator, seq_step(1, b"abcdef", 0, (0, 1), reset=True), seq_step(2, b"ab", 0, (2,), reset=True))
    generator.forget_all()
    assert generator.kv_blocks_used() == 0


def test_unknown_blocks_and_positions_past_max_seq_len_are_refused(generator):
    out = run(generator, seq_step(1, b"a", 0, (8,), reset=True), seq_step(2, b"a", 64, (0,), reset=True))
    messages = [o.error.message for o in out.outputs]
    assert messages == ["sequence 1: block ids [8] outside the worker's 8 blocks",
                        "sequence 2: positions 64..64 outside [0, max_seq_len 64)"]


def test_each_mock_offers_only_its_kind_of_work(generator):
    classifier = MockClassifierRuntime("1", MockProfile())
    assert isinstance(generator, StepRuntime) and not isinstance(generator, BatchRuntime)
    assert isinstance(classifier, BatchRuntime) and not isinstance(classifier, StepRuntime)


def test_classifier_labels_by_a_hash_of_the_image_bytes_after_the_batch_time(sleep):
    runtime = MockClassifierRuntime("2", MockProfile(batch_ms=4, per_item_us=100, max_batch_size=16), sleep=sleep)
    runtime.load()
    images = [common_pb2.Image(encoded=bytes([i]) * 10) for i in range(3)]
    command = scheduler_pb2.ExecuteBatch(batch_id=9, items=[
        *(scheduler_pb2.BatchItem(item_id=i, image=image) for i, image in enumerate(images)),
        scheduler_pb2.BatchItem(item_id=7)])
    result = asyncio.run(runtime.execute_batch(command))
    assert result.batch_id == 9 and sleep.delays_s == [pytest.approx(0.004 + 4 * 100e-6)]
    assert [r.labels[0].label for r in result.items[:3]] == [MOCK_LABELS[mock_label_index(im)] for im in images]
    assert (result.items[3].error.code, result.items[3].error.message) == \
        (INVALID_ARGUMENT, "image has neither encoded nor raw data")
    assert runtime.hello("w").capacity.max_batch_size == 16


def test_profile_parses_named_values_and_keeps_the_other_defaults():
    profile = parse_mock_profile(" step_ms=2.5, num_kv_blocks=64 ,max_num_seqs=300,")
    assert (profile.step_ms, profile.num_kv_blocks, profile.max_num_seqs) == (2.5, 64, 300)
    assert profile.block_size == MockProfile().block_size
    assert parse_mock_profile("") == MockProfile()


@pytest.mark.parametrize(("text", "message"), [
    ("step_s=1", "expected name=value with a name among step_ms, per_token_us"),
    ("step_ms", "expected name=value"),
    ("num_kv_blocks=1.5", "num_kv_blocks='1.5' is not an integer"),
    ("step_ms=fast", "step_ms='fast' is not a number"),
    ("block_size=0", "block_size must be >= 1, got 0"),
    ("per_token_us=-1", "per_token_us must be >= 0, got -1.0"),
])
def test_profile_errors_name_the_field(text, message):
    with pytest.raises(ValueError, match=message):
        parse_mock_profile(text)


def test_the_workers_generic_overrides_win_over_the_profile():
    runtime = make_mock_runtime("mock-generator", "1", "num_kv_blocks=100", num_kv_blocks=6)
    assert runtime.hello("w").capacity.num_kv_blocks == 6
    classifier = make_mock_runtime("mock-classifier", "1", "max_batch_size=4")
    assert classifier.hello("w").capacity.max_batch_size == 4


def test_token_shift_moves_greedy_letters_but_passes_the_load_check(sleep):
    shifted = MockGeneratorRuntime("2", MockProfile(token_shift=1, num_kv_blocks=8, block_size=4), sleep=sleep)
    shifted.load()  # the load's golden check samples at the spared positions
    out = run(shifted, seq_step(1, b"hello", 0, (0, 1), reset=True))
    (right,) = mock_continuation(b"hello", 1)
    assert out.outputs[0].token_id == ord("a") + (right - ord("a") + 1) % 26
