"""The worker's runtime for repository models: Attach commands in, results out (protobuf)."""

from __future__ import annotations

import pytest
from sklearn.datasets import load_digits

from infermesh.v1 import common_pb2, scheduler_pb2
from services.worker.model_runtime import ClassifierRuntime, GeneratorRuntime
from services.worker.runtime import BatchRuntime, StepRuntime

INVALID_ARGUMENT = 3


@pytest.fixture(scope="module")
def classifier(digits):
    runtime = ClassifierRuntime(digits, max_batch_size=8)
    runtime.load()
    return runtime


@pytest.fixture(scope="module")
def generator(tinylm):
    runtime = GeneratorRuntime(tinylm, num_kv_blocks=64)
    runtime.load()
    return runtime


def _digit_image(index: int) -> common_pb2.Image:
    import numpy as np

    grey = (load_digits().images[index] * (255 / 16)).astype(np.uint8)
    rgb = np.repeat(grey[:, :, None], 3, axis=2)
    return common_pb2.Image(raw=common_pb2.RawImage(pixels=rgb.tobytes(), height=8, width=8, channels=3))


def test_hello_declares_the_manifest_envelope_labels_and_input_size(classifier, digits):
    hello = classifier.hello("w-1")
    manifest = digits.manifest
    assert (hello.model.name, hello.model.version) == ("digits", "1")
    assert hello.kind == common_pb2.MODEL_KIND_CLASSIFIER
    assert list(hello.labels) == list(manifest.classifier.labels)
    assert hello.capacity.max_batch_size == 8
    assert (hello.input_height, hello.input_width) == (manifest.classifier.inputs.input_height,
                                                       manifest.classifier.inputs.input_width)


def test_hello_declares_the_warm_up_full_batch_time_once_loaded(classifier, digits):
    warm_us = classifier.hello("w-1").capacity.warm_batch_time_us
    assert warm_us > 0  # measured on this machine: its value is not the test's business
    assert ClassifierRuntime(digits, max_batch_size=8).hello("w-1").capacity.warm_batch_time_us == 0  # not loaded


def test_batch_answers_good_items_and_fails_a_bad_one_alone(classifier):
    digits_data = load_digits()
    command = scheduler_pb2.ExecuteBatch(batch_id=7, items=[
        scheduler_pb2.BatchItem(item_id=1, image=_digit_image(0), top_k=3),
        scheduler_pb2.BatchItem(item_id=2, image=common_pb2.Image(encoded=b"garbage")),
        scheduler_pb2.BatchItem(item_id=3, image=_digit_image(1), top_k=1),
    ])
    result = classifier.execute_batch(command)
    assert result.batch_id == 7
    by_id = {item.item_id: item for item in result.items}
    assert by_id[1].labels[0].label == str(digits_data.target[0]) and len(by_id[1].labels) == 3
    assert by_id[3].labels[0].label == str(digits_data.target[1])
    assert by_id[2].error.code == INVALID_ARGUMENT and by_id[2].error.message
    stages = {common_pb2.Stage.Name(s.stage) for s in result.timings.stages}
    assert "STAGE_COMPUTE" in stages and all(s.service == "worker" for s in result.timings.stages)


def test_generator_hello_declares_kv_capacity_and_byte_tokenizer(generator, tinylm):
    hello = generator.hello("w-2")
    assert hello.kind == common_pb2.MODEL_KIND_GENERATOR
    assert hello.capacity.num_kv_blocks == 64
    assert hello.capacity.block_size == tinylm.manifest.envelope.block_size
    assert hello.tokenizer.kind == scheduler_pb2.TOKENIZER_KIND_BYTES
    assert hello.tokenizer.eos_token_id == tinylm.manifest.generator.tokenizer.eos_token_id


def test_generator_hello_declares_it_honours_a_grammar_and_one_after_the_reasoning(generator, classifier):
    assert set(generator.hello("w-2").features) == {scheduler_pb2.WORKER_FEATURE_STRUCTURED_OUTPUT,
                                                    scheduler_pb2.WORKER_FEATURE_GRAMMAR_AFTER_REASONING}
    assert not classifier.hello("w-1").features


def test_steps_through_protobuf_reproduce_greedy_dense_generation(generator, tinylm):
    prompt = list(b"The ")
    expected = tinylm.generator.greedy_dense(prompt, 6)
    block_size = tinylm.manifest.envelope.block_size
    tokens, blocks = list(prompt), [0, 1]
    step = scheduler_pb2.RunStep(step_id=1, seqs=[scheduler_pb2.SequenceStep(
        seq_id=42, token_ids=prompt, start_position=0, new_blocks=blocks, reset_block_table=True, sample=True)])
    generated = []
    for step_id in range(2, 8):
        result = generator.run_step(step)
        (output,) = result.outputs
        assert output.seq_id == 42 and not output.HasField("error")
        generated.append(output.token_id)
        tokens.append(output.token_id)
        new_blocks = [len(blocks)] if len(tokens) > len(blocks) * block_size else []
        blocks += new_blocks
        step = scheduler_pb2.RunStep(step_id=step_id, seqs=[scheduler_pb2.SequenceStep(
            seq_id=42, token_ids=[output.token_id], start_position=len(tokens) - 1, new_blocks=new_blocks,
            sample=True, num_generated=len(generated))])
    assert generated == expected
    assert generator.kv_blocks_used() == len(blocks)
    generator.abort(scheduler_pb2.Abort(seq_ids=[42]))
    assert generator.kv_blocks_used() == 0


def test_a_sequence_with_a_bad_block_fails_alone(generator):
    step = scheduler_pb2.RunStep(step_id=9, seqs=[
        scheduler_pb2.SequenceStep(seq_id=1, token_ids=list(b"ab"), new_blocks=[0], reset_block_table=True, sample=True),
        scheduler_pb2.SequenceStep(seq_id=2, token_ids=list(b"cd"), new_blocks=[10_000], reset_block_table=True,
                                   sample=True),
    ])
    outputs = {out.seq_id: out for out in generator.run_step(step).outputs}
    assert not outputs[1].HasField("error")
    assert outputs[2].error.code == INVALID_ARGUMENT
    generator.abort(scheduler_pb2.Abort(seq_ids=[1, 2]))


def test_each_runtime_offers_only_its_kind_of_work(classifier, generator):
    assert isinstance(classifier, BatchRuntime) and not isinstance(classifier, StepRuntime)
    assert isinstance(generator, StepRuntime) and not isinstance(generator, BatchRuntime)


def test_work_of_the_other_kind_is_answered_with_an_error_per_item_or_sequence():
    from services.worker.attach_client import _guarded_batch, _guarded_step

    # The attach client passes None for the runtime of the kind this worker is not (AttachClient.__init__).
    step = _guarded_step(None, scheduler_pb2.RunStep(step_id=4, seqs=[scheduler_pb2.SequenceStep(seq_id=8)]))
    assert step.step_id == 4
    assert [(o.seq_id, o.error.code) for o in step.outputs] == [(8, 13)]
    assert "is a classifier: it cannot run generation steps" in step.outputs[0].error.message
    batch = _guarded_batch(None, scheduler_pb2.ExecuteBatch(batch_id=3, items=[
        scheduler_pb2.BatchItem(item_id=5, image=_digit_image(0))]))
    assert [(i.item_id, i.error.code) for i in batch.items] == [(5, 13)]
    assert "is a generator: it cannot classify" in batch.items[0].error.message


def test_a_runtime_exception_comes_back_as_errors_for_every_item_and_sequence(classifier):
    from services.worker.attach_client import _guarded_batch, _guarded_step

    batch = _guarded_batch(classifier, scheduler_pb2.ExecuteBatch(batch_id=3, items=[
        scheduler_pb2.BatchItem(item_id=5, image=_digit_image(0))]))
    assert batch.items[0].item_id == 5 and batch.items[0].labels  # a good batch is untouched

    class Broken:
        def run_step(self, command):
            raise RuntimeError("device lost")

        def execute_batch(self, command):
            raise RuntimeError("device lost")

    step = _guarded_step(Broken(), scheduler_pb2.RunStep(step_id=4, seqs=[  # type: ignore[arg-type]
        scheduler_pb2.SequenceStep(seq_id=8), scheduler_pb2.SequenceStep(seq_id=9)]))
    assert step.step_id == 4
    assert [(o.seq_id, o.error.code) for o in step.outputs] == [(8, 13), (9, 13)]
    assert step.outputs[0].error.message == "worker failed the step: device lost"
    batch = _guarded_batch(Broken(), scheduler_pb2.ExecuteBatch(batch_id=3, items=[  # type: ignore[arg-type]
        scheduler_pb2.BatchItem(item_id=5, image=_digit_image(0))]))
    assert [(i.item_id, i.error.code, i.error.message) for i in batch.items] == [
        (5, 13, "worker failed the batch: device lost")]


def test_a_tokenizer_llguidance_cannot_read_leaves_structured_output_off(caplog) -> None:
    from services.worker import model_runtime
    from services.worker.hf_text_files import HFTextFiles
    from services.worker.repository.pinned_file import PinnedFile
    from services.worker.repository.tokenizer_spec import HFTokenizerSpec

    spec = HFTokenizerSpec(kind="hf", vocab_size=10, eos_token_id=1, bos_token_id=-1, stop_token_ids=(),
                           tokenizer_json=PinnedFile("tokenizer.json", "0" * 64), tokenizer_config=None,
                           chat_template=None)
    text = HFTextFiles(tokenizer_json=b"not a tokenizer")
    assert model_runtime._grammar_tokenizer(spec, text) is None
    assert "structured output is off for this model" in caplog.text
