"""How a model the schedulers report looks to KServe v2 / Triton clients: metadata, config, index.

Pure: ModelInfo (what the gateway's catalog learned from ListModels) in, KServe messages out.

Classifiers follow Triton's convention for a batching model (max_batch_size > 0): metadata shapes
lead with the batch dimension as -1, config dims leave it out. The input is described at the
model's trained size with 3 channels, so a client filling -1 with its batch size sends a valid
request; any other H x W (and 1 or 4 channels) is accepted too and resized by the worker.

Generators are Triton "decoupled" models (ModelStreamInfer only), shaped like Triton's vLLM
backend: `text_input` BYTES [1] in, `text_output` BYTES [1] out per token chunk; sampling comes
from request parameters (kserve/stream.py). They have no batch dimension (max_batch_size 0): the
scheduler batches sequences step by step, which `parameters` reports.

Embedding models (served by Generate with `embed`) answer ModelInfer, not decoupled: `text_input`
BYTES [1] (or `input_ids`) in, `embedding` FP32 [dimensions] out (kserve/embed.py); no batch
dimension either (max_batch_size 0): concurrent requests share the scheduler's steps.

Tensor models (TorchScript, ONNX) are described as their manifest declares them: metadata shapes
with the batch dim as -1, config dims without it, max_batch_size and the dynamic batching in force.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from inference import grpc_predict_v2_pb2 as kserve
from infermesh.v1 import common_pb2, gateway_pb2
from services.gateway.kserve import codec as kserve_codec
from services.gateway.kserve import tensor_codec
from services.gateway.kserve.stats import StageDurations, VersionStats

CLASSIFIER_PLATFORM = "infermesh_classifier"
GENERATOR_PLATFORM = "infermesh_generator"
EMBEDDING_PLATFORM = "infermesh_embedding"
TENSOR_PLATFORM = "infermesh_tensor"
TEXT_INPUT = "text_input"
# A generator's prompt as token ids, in place of text_input (Triton's TensorRT-LLM models name it so).
TOKEN_INPUT = "input_ids"
TEXT_OUTPUT = "text_output"
# An embedding model's vector.
EMBEDDING_OUTPUT = "embedding"
# The channels metadata describes (RGB); 1 and 4 are accepted as well.
DESCRIBED_CHANNELS = 3
READY = "READY"
UNAVAILABLE = "UNAVAILABLE"

_Tensor = kserve.ModelMetadataResponse.TensorMetadata


def is_generator(info: gateway_pb2.ModelInfo) -> bool:
    return info.kind == common_pb2.MODEL_KIND_GENERATOR


def is_embedding(info: gateway_pb2.ModelInfo) -> bool:
    """An embedding model: the scheduler lists it as a generator with its vectors' length."""
    return is_generator(info) and info.embedding_dimensions > 0


def max_batch_size(info: gateway_pb2.ModelInfo) -> int:
    """Images one classifier request may carry: the scheduler's batch size (1 from a scheduler that
    does not report its batching); 0 for generators, whose inputs have no batch dimension."""
    if is_generator(info):
        return 0
    return info.batching.max_batch_size or 1


def _image_dims(info: gateway_pb2.ModelInfo) -> list[int]:
    """[H, W, C] without the batch dimension; -1 where the worker did not say its trained size."""
    return [info.input_height or -1, info.input_width or -1, DESCRIBED_CHANNELS]


def model_metadata(info: gateway_pb2.ModelInfo, versions: Sequence[str]) -> kserve.ModelMetadataResponse:
    name = info.model.name
    if is_embedding(info):
        return kserve.ModelMetadataResponse(
            name=name, versions=list(versions), platform=EMBEDDING_PLATFORM,
            inputs=[_Tensor(name=TEXT_INPUT, datatype="BYTES", shape=[1]),
                    _Tensor(name=TOKEN_INPUT, datatype="INT32", shape=[-1])],
            outputs=[_Tensor(name=EMBEDDING_OUTPUT, datatype="FP32", shape=[info.embedding_dimensions])],
        )
    if is_generator(info):
        return kserve.ModelMetadataResponse(
            name=name, versions=list(versions), platform=GENERATOR_PLATFORM,
            # The prompt as text or as token ids: one of the two (model_config marks both optional).
            inputs=[_Tensor(name=TEXT_INPUT, datatype="BYTES", shape=[1]),
                    _Tensor(name=TOKEN_INPUT, datatype="INT32", shape=[-1])],
            outputs=[_Tensor(name=TEXT_OUTPUT, datatype="BYTES", shape=[1])],
        )
    if tensor_codec.is_tensor(info):
        return kserve.ModelMetadataResponse(
            name=name, versions=list(versions), platform=TENSOR_PLATFORM,
            inputs=[_Tensor(name=t.name, datatype=t.datatype, shape=list(t.dims)) for t in info.tensor_inputs],
            outputs=[_Tensor(name=t.name, datatype=t.datatype, shape=list(t.dims)) for t in info.tensor_outputs],
        )
    num_classes = len(info.labels)
    return kserve.ModelMetadataResponse(
        name=name, versions=list(versions), platform=CLASSIFIER_PLATFORM,
        inputs=[_Tensor(name=kserve_codec.INPUT_NAME, datatype="UINT8", shape=[-1, *_image_dims(info)])],
        outputs=[
            _Tensor(name=kserve_codec.PROBABILITIES, datatype="FP32", shape=[-1, num_classes]),
            _Tensor(name=kserve_codec.LABELS, datatype="BYTES", shape=[-1, num_classes]),
        ],
    )


def model_config(info: gateway_pb2.ModelInfo) -> kserve.ModelConfig:
    batching = info.batching
    if is_generator(info):
        parameters = {"max_seq_len": info.max_seq_len}
        if batching.max_batch_size:
            parameters |= {"max_num_seqs": batching.max_batch_size,
                           "max_num_batched_tokens": batching.max_num_batched_tokens}
        if is_embedding(info):  # one answer per request: ModelInfer, not decoupled
            return kserve.ModelConfig(
                name=info.model.name, platform=EMBEDDING_PLATFORM, backend="infermesh", max_batch_size=0,
                input=[kserve.ModelInput(name=TEXT_INPUT, data_type=kserve.TYPE_STRING, dims=[1], optional=True),
                       kserve.ModelInput(name=TOKEN_INPUT, data_type=kserve.TYPE_INT32, dims=[-1], optional=True)],
                output=[kserve.ModelOutput(name=EMBEDDING_OUTPUT, data_type=kserve.TYPE_FP32,
                                           dims=[info.embedding_dimensions])],
                parameters={k: kserve.ModelParameter(string_value=str(v)) for k, v in parameters.items()},
            )
        return kserve.ModelConfig(
            name=info.model.name, platform=GENERATOR_PLATFORM, backend="infermesh", max_batch_size=0,
            # Triton's reading of "one of the two": both optional, the request sends exactly one.
            input=[kserve.ModelInput(name=TEXT_INPUT, data_type=kserve.TYPE_STRING, dims=[1], optional=True),
                   kserve.ModelInput(name=TOKEN_INPUT, data_type=kserve.TYPE_INT32, dims=[-1], optional=True)],
            output=[kserve.ModelOutput(name=TEXT_OUTPUT, data_type=kserve.TYPE_STRING, dims=[1])],
            model_transaction_policy=kserve.ModelTransactionPolicy(decoupled=True),
            parameters={k: kserve.ModelParameter(string_value=str(v)) for k, v in parameters.items()},
        )
    if tensor_codec.is_tensor(info):
        config = kserve.ModelConfig(
            name=info.model.name, platform=TENSOR_PLATFORM, backend="infermesh", max_batch_size=max_batch_size(info),
            input=[kserve.ModelInput(name=t.name, data_type=_data_type(t.datatype), dims=list(t.dims[1:]))
                   for t in info.tensor_inputs],
            output=[kserve.ModelOutput(name=t.name, data_type=_data_type(t.datatype), dims=list(t.dims[1:]))
                    for t in info.tensor_outputs],
        )
        _set_dynamic_batching(config, batching)
        return config
    num_classes = len(info.labels)
    config = kserve.ModelConfig(
        name=info.model.name, platform=CLASSIFIER_PLATFORM, backend="infermesh", max_batch_size=max_batch_size(info),
        input=[kserve.ModelInput(name=kserve_codec.INPUT_NAME, data_type=kserve.TYPE_UINT8,
                                 format=kserve.ModelInput.FORMAT_NHWC, dims=_image_dims(info))],
        output=[kserve.ModelOutput(name=kserve_codec.PROBABILITIES, data_type=kserve.TYPE_FP32, dims=[num_classes]),
                kserve.ModelOutput(name=kserve_codec.LABELS, data_type=kserve.TYPE_STRING, dims=[num_classes])],
    )
    _set_dynamic_batching(config, batching)
    return config


def _set_dynamic_batching(config: kserve.ModelConfig, batching: gateway_pb2.BatchingInfo) -> None:
    if batching.max_batch_size:  # a scheduler that reports its batching; older ones say nothing
        config.dynamic_batching.preferred_batch_size[:] = list(batching.preferred_batch_sizes)
        config.dynamic_batching.max_queue_delay_microseconds = batching.max_queue_delay_us


def _data_type(datatype: str) -> str:
    """KServe's datatype string as ModelConfig's enum names it (TYPE_FP32 for "FP32")."""
    return f"TYPE_{datatype}"


def repository_index(models: Iterable[gateway_pb2.ModelInfo], ready_only: bool) -> kserve.RepositoryIndexResponse:
    index = kserve.RepositoryIndexResponse()
    for info in models:
        if ready_only and not info.ready:
            continue
        index.models.add(
            name=info.model.name, version=info.model.version, state=READY if info.ready else UNAVAILABLE,
            reason="" if info.ready else "no worker serves it now",
        )
    return index


_QUEUE_STAGES = (common_pb2.STAGE_QUEUE_WAIT, common_pb2.STAGE_BATCH_WAIT)
_INPUT_STAGES = (common_pb2.STAGE_DECODE, common_pb2.STAGE_PREPROCESS)
_INFER_STAGES = (common_pb2.STAGE_COMPUTE, common_pb2.STAGE_PREFILL)


def stage_durations(timings: common_pb2.Timings) -> StageDurations:
    """The scheduler's and worker's stages of one response, in Triton's statistics buckets."""
    def total_s(stages: tuple[int, ...]) -> float:
        return sum(t.duration_us for t in timings.stages if t.stage in stages) / 1e6

    return StageDurations(queue_s=total_s(_QUEUE_STAGES), compute_input_s=total_s(_INPUT_STAGES),
                          compute_infer_s=total_s(_INFER_STAGES),
                          compute_output_s=total_s((common_pb2.STAGE_POSTPROCESS,)))


def statistics_response(snapshot: Iterable[VersionStats]) -> kserve.ModelStatisticsResponse:
    def duration(d) -> kserve.StatisticDuration:
        return kserve.StatisticDuration(count=d.count, ns=d.ns)

    response = kserve.ModelStatisticsResponse()
    for stats in snapshot:
        response.model_stats.add(
            name=stats.name, version=stats.version, last_inference=stats.last_inference_ms,
            inference_count=stats.num_inferences, execution_count=stats.num_executions,
            inference_stats=kserve.InferStatistics(
                success=duration(stats.success), fail=duration(stats.fail), queue=duration(stats.queue),
                compute_input=duration(stats.compute_input), compute_infer=duration(stats.compute_infer),
                compute_output=duration(stats.compute_output),
            ),
        )
    return response
