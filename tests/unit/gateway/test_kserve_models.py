"""KServe metadata/config/statistics built from what the schedulers report, and the stream codec."""

from __future__ import annotations

import pytest

from inference import grpc_predict_v2_pb2 as kserve
from infermesh.v1 import common_pb2, gateway_pb2
from services.common.errors import InvalidArgument
from services.gateway.kserve import models as kserve_models
from services.gateway.kserve import stream as kserve_stream
from services.gateway.kserve.stats import ModelStatistics, StageDurations


def _classifier(**batching) -> gateway_pb2.ModelInfo:
    return gateway_pb2.ModelInfo(model=common_pb2.ModelRef(name="digits", version="1"),
                                 kind=common_pb2.MODEL_KIND_CLASSIFIER, ready=True, labels=list("0123456789"),
                                 input_height=16, input_width=16, batching=gateway_pb2.BatchingInfo(**batching))


def test_classifier_metadata_leads_with_the_batch_dimension():
    meta = kserve_models.model_metadata(_classifier(max_batch_size=8), ["1"])
    assert [(t.name, list(t.shape)) for t in meta.inputs] == [("IMAGE", [-1, 16, 16, 3])]
    assert [list(t.shape) for t in meta.outputs] == [[-1, 10], [-1, 10]]


def test_config_reports_the_schedulers_batching_and_nothing_it_did_not_say():
    config = kserve_models.model_config(_classifier(max_batch_size=8, max_queue_delay_us=5000,
                                                    preferred_batch_sizes=[4, 8]))
    assert (config.max_batch_size, list(config.input[0].dims)) == (8, [16, 16, 3])
    assert (list(config.dynamic_batching.preferred_batch_size), config.dynamic_batching.max_queue_delay_microseconds) \
        == ([4, 8], 5000)
    old_scheduler = kserve_models.model_config(_classifier())
    assert (old_scheduler.max_batch_size, old_scheduler.HasField("dynamic_batching")) == (1, False)


def test_statistics_count_inferences_executions_and_stage_time():
    statistics = ModelStatistics(wall_clock=lambda: 1700000000.5)
    statistics.succeeded("digits", "1", 0.002, StageDurations(queue_s=0.001, compute_infer_s=0.0005), 4)
    statistics.failed("digits", "1", 0.003)
    (stats,) = kserve_models.statistics_response(statistics.snapshot("digits")).model_stats
    assert (stats.inference_count, stats.execution_count, stats.last_inference) == (4, 1, 1700000000500)
    assert (stats.inference_stats.success.ns, stats.inference_stats.queue.ns) == (2_000_000, 1_000_000)
    assert (stats.inference_stats.fail.count, stats.inference_stats.fail.ns) == (1, 3_000_000)
    assert statistics.snapshot("other") == []


def _stream_request(**parameters) -> kserve.ModelInferRequest:
    request = kserve.ModelInferRequest(model_name="tinylm", id="s-1", inputs=[
        kserve.ModelInferRequest.InferInputTensor(name="text_input", datatype="BYTES", shape=[1],
                                                  contents=kserve.InferTensorContents(bytes_contents=[b"Hi"]))])
    for key, value in parameters.items():
        field = {bool: "bool_param", int: "int64_param", float: "double_param", str: "string_param"}[type(value)]
        setattr(request.parameters[key], field, value)
    return request


def test_stream_request_takes_sampling_from_parameters():
    parsed = kserve_stream.parse_stream_request(_stream_request(max_tokens=5, temperature=0.5, seed=7, stream=True))
    sampling = parsed.generate.sampling
    assert (parsed.generate.prompt, sampling.max_tokens, sampling.temperature, sampling.seed) == ("Hi", 5, 0.5, 7)
    with pytest.raises(InvalidArgument, match="unknown parameter 'beam_width'"):
        kserve_stream.parse_stream_request(_stream_request(beam_width=2))
    with pytest.raises(InvalidArgument, match=r"parameter 'top_p' has an unusable value 2.0"):
        kserve_stream.parse_stream_request(_stream_request(top_p=2.0))


def test_last_chunk_is_flagged_final_or_followed_by_an_empty_final():
    chunk = gateway_pb2.GenerateResponse(text="a", finish_reason=common_pb2.FINISH_REASON_LENGTH,
                                         model=common_pb2.ModelRef(name="tinylm", version="1"))
    middle = gateway_pb2.GenerateResponse(text="b")
    parsed = kserve_stream.parse_stream_request(_stream_request())
    assert [r.parameters["triton_final_response"].bool_param
            for r in kserve_stream.chunk_responses(parsed, middle)] == [False]
    (last,) = kserve_stream.chunk_responses(parsed, chunk)
    assert (last.id, last.parameters["triton_final_response"].bool_param) == ("s-1", True)
    empty_final = kserve_stream.parse_stream_request(_stream_request(triton_enable_empty_final_response=True))
    text, final = kserve_stream.chunk_responses(empty_final, chunk)
    assert (text.parameters["triton_final_response"].bool_param, len(final.outputs)) == (False, 0)
    assert final.parameters["triton_final_response"].bool_param
