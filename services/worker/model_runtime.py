"""Runtimes for repository models: protobuf commands <-> the executors' plain data.

Loading is the readiness gate: checksum (in load_model), warm-up at the full
envelope (so kernel compilation and allocator growth happen before traffic),
then the manifest's golden check; then, for a generator on a GPU, its decode steps'
CUDA graphs (_capture_decode_graphs says why in that order). A classifier's warm-up runs its full batch twice and
declares the second, warm run's time (WorkerCapacity.warm_batch_time_us): the
scheduler's batch time for that size until it measures one.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from infermesh.v1 import common_pb2, scheduler_pb2
from services.common.config import ConfigError
from services.common.protocol import ATTACH_PROTOCOL_VERSION as PROTOCOL_VERSION
from services.common.timings import StageTime, seconds_to_us, to_proto
from services.worker import work
from services.worker.batch_executor import BatchExecutor
from services.worker.config import WorkerConfig, parse_lora_adapters
from services.worker.decode_graph_steps import build_decode_graphs
from services.worker.grammar import GrammarTokenizer
from services.worker.hf_text_files import HFTextFiles, read_hf_text_files
from services.worker.repository.classifier_spec import ClassifierSpec
from services.worker.repository.embedding_spec import EmbeddingSpec
from services.worker.repository.golden import run_golden_check
from services.worker.repository.loader import LoadedModel, load_model
from services.worker.repository.manifest import ModelKind
from services.worker.repository.tokenizer_spec import AnyTokenizerSpec, HFTokenizerSpec
from services.worker.runtime import warm_batch_time_us
from services.worker.sequence_mirror import MAX_STEPS_IN_FLIGHT, MAX_STEPS_PER_COMMAND
from services.worker.step_codec import item_error_to_proto, run_step_from_proto, step_result_to_proto
from services.worker.step_executor import StepExecutor
from services.worker.tensor_runtime import TensorRuntime
from services.worker.thread_settings import set_library_threads

# What StepExecutor honours beyond a plain step (WorkerHello.features): it masks by the grammar (or
# fails the sequence where llguidance cannot read the tokenizer), after the think block where asked
# (grammar.py). The toy and mock generators sample no grammar and declare none.
STEP_FEATURES = (scheduler_pb2.WORKER_FEATURE_STRUCTURED_OUTPUT, scheduler_pb2.WORKER_FEATURE_GRAMMAR_AFTER_REASONING)

log = logging.getLogger(__name__)
SERVICE = "worker"


def _timings(durations: work.StageDurations) -> common_pb2.Timings:
    stages = [
        StageTime("decode", seconds_to_us(durations.decode_s), SERVICE),
        StageTime("preprocess", seconds_to_us(durations.preprocess_s), SERVICE),
        StageTime("compute", seconds_to_us(durations.compute_s), SERVICE),
        StageTime("postprocess", seconds_to_us(durations.postprocess_s), SERVICE),
    ]
    stages = [s for s in stages if s.duration_us or s.stage == "compute"]
    return to_proto(stages, total_us=sum(s.duration_us for s in stages))


def _batch_item(item: scheduler_pb2.BatchItem) -> work.BatchItem:
    kind = item.image.WhichOneof("data")
    image: work.RawImage | bytes
    if kind == "raw":
        raw = item.image.raw
        image = work.RawImage(raw.pixels, raw.height, raw.width, raw.channels)
    else:
        image = item.image.encoded  # empty bytes when neither is set: the executor rejects it
    return work.BatchItem(item.item_id, image, max(1, item.top_k))


class ClassifierRuntime:
    def __init__(self, model: LoadedModel, max_batch_size: int) -> None:
        self._model = model
        self._max_batch_size = max_batch_size
        self._executor = BatchExecutor(model.classifier, max_batch_size=max_batch_size)
        self._warm_batch_time_us = 0  # measured by load()

    @property
    def _spec(self) -> ClassifierSpec:
        spec = self._model.manifest.classifier
        assert spec is not None  # built for a classifier's manifest (load_repository_runtime)
        return spec

    def load(self) -> None:
        spec = self._spec
        warm = [work.BatchItem(i, work.RawImage(g.pixels, g.height, g.width, g.channels))
                for i, g in enumerate(spec.golden * self._max_batch_size)][: self._max_batch_size]
        self._warm_batch_time_us = warm_batch_time_us(lambda: self._executor.execute(warm))
        run_golden_check(self._model)

    def hello(self, worker_id: str) -> scheduler_pb2.WorkerHello:
        manifest = self._model.manifest
        inputs = self._spec.inputs
        return scheduler_pb2.WorkerHello(
            worker_id=worker_id,
            model=common_pb2.ModelRef(name=manifest.name, version=manifest.version),
            kind=common_pb2.MODEL_KIND_CLASSIFIER,
            capacity=scheduler_pb2.WorkerCapacity(
                max_batch_size=self._max_batch_size, memory_bytes=manifest.envelope.memory_bytes,
                device=self._model.device, warm_batch_time_us=self._warm_batch_time_us,
            ),
            labels=list(self._spec.labels),
            input_height=inputs.input_height,
            input_width=inputs.input_width,
            max_image_pixels=inputs.max_image_pixels,
            protocol_version=PROTOCOL_VERSION,
        )

    def execute_batch(self, command: scheduler_pb2.ExecuteBatch) -> scheduler_pb2.BatchResult:
        results, durations = self._executor.execute([_batch_item(item) for item in command.items])
        return scheduler_pb2.BatchResult(
            batch_id=command.batch_id,
            items=[
                scheduler_pb2.ItemResult(
                    item_id=r.item_id,
                    labels=[common_pb2.Label(label=lb.label, index=lb.index, score=lb.score) for lb in r.labels],
                    error=item_error_to_proto(r.error),
                )
                for r in results
            ],
            timings=_timings(durations),
        )


class GeneratorRuntime:
    def __init__(self, model: LoadedModel, num_kv_blocks: int, max_num_seqs: int = 0,
                 cuda_graph_max_batch_size: int = 0) -> None:
        """`cuda_graph_max_batch_size`: capture decode graphs up to this batch at load (0: none; a model
        off the GPU never has any)."""
        self._model = model
        self._cuda_graph_max_batch_size = cuda_graph_max_batch_size
        envelope = model.manifest.envelope
        self._num_kv_blocks = num_kv_blocks
        self._max_num_seqs = max_num_seqs or envelope.max_num_seqs  # 0: the manifest's
        spec = model.manifest.generator
        assert spec is not None  # built for a generator's manifest (load_repository_runtime)
        # A Hugging Face tokenizer's files, read (sha256 first) before the worker is ready.
        self._text = read_hf_text_files(model.path, spec.tokenizer) if isinstance(spec.tokenizer, HFTokenizerSpec) \
            else None
        self._executor = StepExecutor(model.generator, num_kv_blocks, envelope.block_size,
                                      grammar_tokenizer=_grammar_tokenizer(spec.tokenizer, self._text),
                                      pooling=spec.embedding.pooling_spec if spec.embedding is not None else None)

    def load(self) -> None:
        envelope = self._model.manifest.envelope
        prompt = tuple(range(65, 65 + min(envelope.max_num_batched_tokens, envelope.block_size * 2)))
        warm = work.RunStep(step_id=0, seqs=(work.SequenceStep(
            seq_id=0, token_ids=prompt, start_position=0, new_blocks=tuple(range(-(-len(prompt) // envelope.block_size))),
            reset_block_table=True, sample=True),))
        self._executor.run(warm)
        self._executor.forget([0])
        run_golden_check(self._model)
        self._capture_decode_graphs()

    def _capture_decode_graphs(self) -> None:
        """After the golden check: a worker failing it exits, so the capture (seconds, and the graphs'
        memory) is not spent on it; and the check runs in caches of its own, so it could not test the
        graphs anyway; build_decode_graphs checks a replay against the eager step in the executor's
        cache instead. A failure leaves the worker serving eagerly, with a warning."""
        spec = self._model.manifest.generator
        embeds = spec is not None and spec.embedding is not None  # an embedding model never decodes
        if not self._cuda_graph_max_batch_size or self._executor.cache.device.type != "cuda" or embeds:
            return
        self._executor.use_decode_graphs(build_decode_graphs(
            self._model.generator, self._executor.cache, max_batch_size=self._cuda_graph_max_batch_size,
            max_num_seqs=self._max_num_seqs))

    def hello(self, worker_id: str) -> scheduler_pb2.WorkerHello:
        manifest = self._model.manifest
        envelope, spec = manifest.envelope, manifest.generator
        assert spec is not None  # built for a generator's manifest (load_repository_runtime)
        return scheduler_pb2.WorkerHello(
            worker_id=worker_id,
            model=common_pb2.ModelRef(name=manifest.name, version=manifest.version),
            # An embedding model declares its own kind: a scheduler that predates it refuses the worker.
            kind=common_pb2.MODEL_KIND_GENERATOR if spec.embedding is None else common_pb2.MODEL_KIND_EMBEDDING,
            capacity=scheduler_pb2.WorkerCapacity(
                num_kv_blocks=self._num_kv_blocks,
                block_size=envelope.block_size,
                max_seq_len=spec.max_seq_len,
                max_num_seqs=self._max_num_seqs,
                max_num_batched_tokens=envelope.max_num_batched_tokens,
                memory_bytes=envelope.memory_bytes,
                device=self._model.device,
                max_steps_in_flight=MAX_STEPS_IN_FLIGHT, max_steps_per_command=MAX_STEPS_PER_COMMAND,
            ),
            tokenizer=_tokenizer_spec(spec.tokenizer, self._text),
            protocol_version=PROTOCOL_VERSION,
            sampling_defaults=spec.sampling_defaults.to_proto(),
            features=STEP_FEATURES,
            embedding=_embedding_spec(spec.embedding),
            lora_adapters=self._model.generator.lora.names if self._model.generator.lora is not None else (),
        )

    def tokenizer_file(self) -> bytes:
        """tokenizer.json, sent after the hello (TOKENIZER_KIND_HF); b"" for the byte tokenizer."""
        return b"" if self._text is None else self._text.tokenizer_json

    def run_step(self, command: scheduler_pb2.RunStep) -> scheduler_pb2.StepResult:
        outputs, durations = self._executor.run(run_step_from_proto(command))
        return step_result_to_proto(command.step_id, outputs, _timings(durations))

    def abort(self, command: scheduler_pb2.Abort) -> None:
        self._executor.forget(command.seq_ids)

    def forget_all(self) -> None:
        self._executor.forget_all()

    def kv_blocks_used(self) -> int:
        return self._executor.num_kv_blocks_used


def _embedding_spec(spec: EmbeddingSpec | None) -> scheduler_pb2.EmbeddingSpec | None:
    if spec is None:
        return None
    return scheduler_pb2.EmbeddingSpec(dimensions=spec.dimensions, normalize=spec.normalize,
                                       matryoshka=spec.matryoshka, pooling=spec.pooling.value)


def _grammar_tokenizer(spec: AnyTokenizerSpec, text: HFTextFiles | None) -> GrammarTokenizer | None:
    """The tokenizer constrained sampling masks with: the one the scheduler tokenizes with. None when
    llguidance cannot read it: the model is served all the same, its constrained requests fail alone."""
    try:
        if text is None:
            return GrammarTokenizer.from_bytes(spec.vocab_size, spec.eos_token_id, spec.bos_token_id)
        assert isinstance(spec, HFTokenizerSpec)  # the text files are read for an HF tokenizer only
        return GrammarTokenizer.from_tokenizer_json(text.tokenizer_json, spec.vocab_size,
                                                    (spec.eos_token_id, *spec.stop_token_ids))
    except Exception as exc:  # llguidance raises its own errors (ValueError, RuntimeError...) for a tokenizer
        log.warning("structured output is off for this model: llguidance cannot read its tokenizer: %s", exc)
        return None


def _tokenizer_spec(spec: AnyTokenizerSpec, text: HFTextFiles | None) -> scheduler_pb2.TokenizerSpec:
    if text is None:
        return scheduler_pb2.TokenizerSpec(kind=scheduler_pb2.TOKENIZER_KIND_BYTES, vocab_size=spec.vocab_size,
                                           eos_token_id=spec.eos_token_id, bos_token_id=spec.bos_token_id)
    assert isinstance(spec, HFTokenizerSpec)  # the text files are read for an HF tokenizer only
    return scheduler_pb2.TokenizerSpec(
        kind=scheduler_pb2.TOKENIZER_KIND_HF, vocab_size=spec.vocab_size, eos_token_id=spec.eos_token_id,
        bos_token_id=spec.bos_token_id, stop_token_ids=spec.stop_token_ids,
        tokenizer_json_sha256=spec.tokenizer_json.sha256, tokenizer_json_size_bytes=len(text.tokenizer_json),
        add_bos_token=text.add_bos_token, add_eos_token=text.add_eos_token,
        special_tokens=dict(text.special_tokens), chat_template=text.chat_template,
        tool_call_parser=spec.tool_call_parser, reasoning_parser=spec.reasoning_parser,
    )


def load_repository_runtime(config: WorkerConfig,
                            num_threads: int) -> ClassifierRuntime | GeneratorRuntime | TensorRuntime:
    set_library_threads(num_threads)  # before the model's first parallel op (load, warm-up)
    if config.device != "cpu":
        _check_cuda(config.device)
    model = load_model(config.model_repository, config.model_name, config.model_version, device=config.device,
                       num_threads=num_threads, compute_dtype=config.compute_dtype)
    return SERVING_RUNTIMES[model.manifest.kind](model, config)


def _classifier_runtime(model: LoadedModel, config: WorkerConfig) -> ClassifierRuntime:
    if config.max_num_seqs:
        raise ConfigError(f"--max-num-seqs applies to generators; {config.model_name} is a classifier "
                          "(--max-batch-size sets its batch)")
    return ClassifierRuntime(model, config.max_batch_size or model.manifest.envelope.max_batch_size)


def _tensor_runtime(model: LoadedModel, config: WorkerConfig) -> TensorRuntime:
    if config.max_num_seqs:
        raise ConfigError(f"--max-num-seqs applies to generators; {config.model_name} is a tensor model "
                          "(--max-batch-size sets its batch)")
    return TensorRuntime(model, config.max_batch_size or model.manifest.envelope.max_batch_size)


def _generator_runtime(model: LoadedModel, config: WorkerConfig) -> GeneratorRuntime:
    _add_lora_adapters(model, parse_lora_adapters(config.lora_adapters))
    graphs = config.cuda_graphs and config.device != "cpu"
    return GeneratorRuntime(model, config.num_kv_blocks or model.manifest.envelope.num_kv_blocks,
                            config.max_num_seqs, cuda_graph_max_batch_size=config.cuda_graph_max_batch_size if graphs
                            else 0)


def _add_lora_adapters(model: LoadedModel, adapters: tuple[tuple[str, str], ...]) -> None:
    """Loads --lora-adapters over the model before its executor is built (the executor's mirror admits
    the names); ConfigError naming the adapter and what its files say wrong."""
    if not adapters:
        return
    from services.worker.models.llama_config import LlamaFamilyConfig
    from services.worker.models.lora import load_lora_adapter

    generator = model.generator
    config = generator.config
    if not isinstance(config, LlamaFamilyConfig) or model.manifest.generator is None \
            or model.manifest.generator.embedding is not None:
        raise ConfigError(f"--lora-adapters: {model.manifest.name} is not a Llama-family text generator")
    for name, directory in adapters:
        try:
            generator.add_lora(load_lora_adapter(name, directory, config, dtype=next(generator.lm.parameters()).dtype,
                                                 device=generator.device))
        except ValueError as exc:  # CheckpointError names the file and the field or tensor
            raise ConfigError(f"--lora-adapters {name}={directory}: {exc}") from None
        log.info("serving LoRA adapter %s over %s/%s", name, model.manifest.name, model.manifest.version)


# The Attach runtime each kind of repository model is served by, with the worker's overrides applied.
SERVING_RUNTIMES: dict[ModelKind, Callable[[LoadedModel, WorkerConfig],
                                           ClassifierRuntime | GeneratorRuntime | TensorRuntime]] = {
    ModelKind.CLASSIFIER: _classifier_runtime,
    ModelKind.GENERATOR: _generator_runtime,
    ModelKind.TENSOR: _tensor_runtime,
}


def _check_cuda(device: str) -> None:
    """ConfigError-like exit before loading when the worker was asked for a GPU it does not have."""
    import torch

    if not torch.cuda.is_available():
        raise ConfigError(f"--device {device}: torch sees no CUDA device")
    index = int(device.partition(":")[2] or 0)
    if index >= torch.cuda.device_count():
        raise ConfigError(f"--device {device}: only {torch.cuda.device_count()} CUDA device(s)")
    torch.cuda.set_device(index)
    from numba import cuda

    cuda.select_device(index)  # the kernels launch on numba's current device
