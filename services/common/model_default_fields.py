"""The SamplingParams fields a request may leave to the model's recommended sampling
(GenerateRequest.model_default_fields), by wire value and field name: the OpenAI front lists the ones a
body leaves out, and the scheduler replaces them with the model's values."""

from __future__ import annotations

from infermesh.v1 import common_pb2

MODEL_DEFAULT_FIELDS: dict[common_pb2.SamplingField, str] = {
    common_pb2.SAMPLING_FIELD_TEMPERATURE: "temperature",
    common_pb2.SAMPLING_FIELD_TOP_P: "top_p",
    common_pb2.SAMPLING_FIELD_TOP_K: "top_k",
    common_pb2.SAMPLING_FIELD_MIN_P: "min_p",
    common_pb2.SAMPLING_FIELD_REPETITION_PENALTY: "repetition_penalty",
}
