"""Generator requests over Triton's decoupled streaming (ModelStreamInfer): tensors <-> Generate.

Contract (docs/clients.md), shaped like Triton's vLLM backend so its clients need no changes:
  input   text_input   BYTES [1] (or [1, 1]): the UTF-8 prompt; or instead
          input_ids    INT32 or INT64 [n] (or [1, n]): the prompt as token ids of the model's tokenizer
                       (Triton's TensorRT-LLM models name it so), used as they are, as the OpenAI
                       front's token prompts (GenerateRequest.prompt_token_ids)
  params  max_tokens (int), temperature (float), top_p (float), seed (int), ignore_eos (bool),
          stop (string, one stop sequence): the request's `parameters` (tritonclient's
          `parameters={...}`); `stream` is accepted and ignored (a stream is always streamed);
          ttft_ms, tpot_ms (int): latency targets, GenerateRequest.objectives (docs/gateway.md);
          the OpenAI front's sampling options under its names, checked by the same code
          (fronts/openai_params.py): logprobs (bool), top_logprobs (int), presence_penalty,
          frequency_penalty, repetition_penalty, top_k, min_p, min_tokens (numbers), include_stop_str_in_output (bool), and as JSON text (a string
          parameter; REST may send the JSON value itself) logit_bias ({"<token id>": bias}), stop_token_ids
          ([ids]), allowed_token_ids ([ids]), bad_words ([strings]), response_format,
          guided_json (a schema), guided_choice (a list of strings); guided_regex and
          guided_grammar (strings)
  output  text_output  BYTES [1] per response: the chunk's text
          with logprobs: logprobs FP32 [k], the log-probability of each of the chunk's k tokens, and
          with top_logprobs > 0: top_logprobs BYTES [k], per token a JSON list of the most likely
          {"token_id", "token", "logprob"} there, most likely first
One response per chunk, each with the request's id; the last one carries the parameter
`triton_final_response: true` plus `finish_reason`, `prompt_tokens`, `completion_tokens`. A
request with `triton_enable_empty_final_response: true` gets the last text as a normal response
and then an empty one flagged final, as Triton sends it.
"""

from __future__ import annotations

import json
import math
import struct
from dataclasses import dataclass
from typing import Any

from inference import grpc_predict_v2_pb2 as kserve
from infermesh.v1 import common_pb2, gateway_pb2
from services.common.errors import InvalidArgument
from services.common.tensor_datatypes import STRUCT_CODES
from services.gateway.fronts.openai_params import BadParameter, chat_logprobs, penalties, structured
from services.gateway.kserve.codec import pack_bytes_tensor, unpack_bytes_tensor
from services.gateway.kserve.models import TEXT_INPUT, TEXT_OUTPUT, TOKEN_INPUT

FINAL = "triton_final_response"
EMPTY_FINAL = "triton_enable_empty_final_response"
# Parameters tritonclient or Triton's own tools set on every request; not sampling, not refused (by an
# embedding model either).
TRANSPORT_PARAMETERS = {"stream", EMPTY_FINAL, "priority", "timeout", "sequence_id", "sequence_start",
                         "sequence_end"}
_FINISH_REASONS = {common_pb2.FINISH_REASON_LENGTH: "length", common_pb2.FINISH_REASON_EOS: "eos",
                   common_pb2.FINISH_REASON_STOP: "stop"}


@dataclass(frozen=True)
class StreamRequest:
    generate: gateway_pb2.GenerateRequest
    # Triton's id for the request, echoed in every response ("" when the client sent none).
    id: str
    empty_final: bool
    # The parameter that asked for structured output, if any: it names the scheduler's refusal of it.
    structured_param: str | None = None


# The OpenAI front's sampling options, read by its code (openai_params); these hold JSON text.
JSON_PARAMETERS = ("logit_bias", "response_format", "guided_json", "guided_choice", "stop_token_ids",
                   "allowed_token_ids", "bad_words")
_OPENAI_PARAMETERS = ("logprobs", "top_logprobs", "presence_penalty", "frequency_penalty", "repetition_penalty",
                      "top_k", "min_p", "min_tokens", "include_stop_str_in_output", "guided_regex", "guided_grammar",
                      *JSON_PARAMETERS)
TOP_LOGPROBS = "top_logprobs"
LOGPROBS = "logprobs"
_OBJECTIVE_PARAMETERS = ("ttft_ms", "tpot_ms")
_SAMPLING_PARAMETERS = ("max_tokens", "temperature", "top_p", "seed", "ignore_eos", "stop")
# Every parameter a generator's request may set beyond the transport's: what an embedding model refuses by name.
GENERATION_PARAMETERS = frozenset({*_SAMPLING_PARAMETERS, *_OBJECTIVE_PARAMETERS, *_OPENAI_PARAMETERS})


def parse_stream_request(request: kserve.ModelInferRequest) -> StreamRequest:
    parameters = request.parameters
    sampling = common_pb2.SamplingParams()
    objectives = gateway_pb2.LatencyObjectives()
    options: dict[str, Any] = {}
    for key, value in parameters.items():
        if key in _OBJECTIVE_PARAMETERS:
            setattr(objectives, key, _objective_ms(key, value))
        elif key in _OPENAI_PARAMETERS:
            options[key] = _option(key, value)
        else:
            _set_sampling(sampling, key, value)
    structured_param = _set_options(sampling, options)
    generate = gateway_pb2.GenerateRequest(
        model=common_pb2.ModelRef(name=request.model_name, version=request.model_version),
        sampling=sampling, request_id=request.id, objectives=objectives,
    )
    set_prompt(generate, request)
    empty_final = EMPTY_FINAL in parameters and _value(parameters[EMPTY_FINAL]) is True
    return StreamRequest(generate, request.id, empty_final, structured_param)


def _option(key: str, parameter: kserve.InferParameter) -> Any:
    """An OpenAI sampling option's value as the OpenAI front reads it from its JSON body."""
    value = _value(parameter)
    if key not in JSON_PARAMETERS or not isinstance(value, str):
        return value
    try:
        return json.loads(value)
    except ValueError:
        if key == "guided_json":  # the shared check says what a schema must be
            return value
        raise BadParameter(key, f"parameter '{key}' must be JSON text, got {value[:40]!r}") from None


def _set_options(sampling: common_pb2.SamplingParams, options: dict[str, Any]) -> str | None:
    """The options as the OpenAI front sets them (a refusal names the parameter, as its 400 does);
    the parameter that asked for structured output, if any."""
    try:
        chat_logprobs(options, sampling)
        penalties(options, sampling)
        return structured(options, sampling)
    except BadParameter as err:
        raise BadParameter(err.param, f"parameter '{err.param}': {err.message}") from None


def set_prompt(generate: gateway_pb2.GenerateRequest, request: kserve.ModelInferRequest) -> None:
    """The one input: the prompt's text as prompt, or its token ids as prompt_token_ids."""
    names = [tensor.name for tensor in request.inputs]
    if names == [TEXT_INPUT]:
        generate.prompt = _text_prompt(request)
    elif names == [TOKEN_INPUT]:
        generate.prompt_token_ids.extend(_token_prompt(request))
    else:
        raise InvalidArgument(f"expected exactly one input: '{TEXT_INPUT}' (the prompt's text) or '{TOKEN_INPUT}' "
                              f"(its token ids), got {names}")


def _token_prompt(request: kserve.ModelInferRequest) -> list[int]:
    """input_ids' elements, each a token id (< 2^32; the scheduler checks them against the vocabulary)."""
    tensor = request.inputs[0]
    shape = list(tensor.shape)
    if tensor.datatype not in _TOKEN_DATATYPES:
        raise InvalidArgument(f"input '{TOKEN_INPUT}' must be INT32 or INT64 token ids, got "
                              f"{tensor.datatype or '(none)'}")
    if not (len(shape) == 1 or (len(shape) == 2 and shape[0] == 1)) or shape[-1] < 1:
        raise InvalidArgument(f"input '{TOKEN_INPUT}' must have shape [n] or [1, n] with n >= 1, got {shape}")
    ids = _token_elements(request, tensor)
    if len(ids) != shape[-1]:
        raise InvalidArgument(f"input '{TOKEN_INPUT}' holds {len(ids)} elements, its shape {shape} says {shape[-1]}")
    for index, token_id in enumerate(ids):
        if not 0 <= token_id < 2**32:
            raise InvalidArgument(f"input '{TOKEN_INPUT}'[{index}] must be a token id (an integer >= 0), "
                                  f"got {token_id}")
    return ids


def _token_elements(request: kserve.ModelInferRequest, tensor) -> list[int]:
    if not request.raw_input_contents:
        return list(tensor.contents.int_contents if tensor.datatype == "INT32" else tensor.contents.int64_contents)
    if len(request.raw_input_contents) != 1:
        raise InvalidArgument(f"raw_input_contents has {len(request.raw_input_contents)} entries for 1 input")
    raw = request.raw_input_contents[0]
    code = _TOKEN_DATATYPES[tensor.datatype]
    if len(raw) % struct.calcsize(code):
        raise InvalidArgument(f"input '{TOKEN_INPUT}' has {len(raw)} bytes, not a whole number of "
                              f"{tensor.datatype} elements")
    return list(struct.unpack(f"<{len(raw) // struct.calcsize(code)}{code}", raw))


# input_ids' datatypes and their struct codes (Triton's raw layout is little-endian).
_TOKEN_DATATYPES = {datatype: STRUCT_CODES[datatype] for datatype in ("INT32", "INT64")}


def _text_prompt(request: kserve.ModelInferRequest) -> str:
    tensor = request.inputs[0]
    if tensor.datatype != "BYTES" or list(tensor.shape) not in ([1], [1, 1]):
        raise InvalidArgument(f"input '{TEXT_INPUT}' must be BYTES of shape [1] or [1, 1], "
                              f"got {tensor.datatype or '(none)'} {list(tensor.shape)}")
    if request.raw_input_contents:
        if len(request.raw_input_contents) != 1:
            raise InvalidArgument(f"raw_input_contents has {len(request.raw_input_contents)} entries for 1 input")
        elements = unpack_bytes_tensor(request.raw_input_contents[0])
    else:
        elements = list(tensor.contents.bytes_contents)
    if len(elements) != 1:
        raise InvalidArgument(f"input '{TEXT_INPUT}' holds {len(elements)} elements, expected 1")
    try:
        return elements[0].decode("utf-8")
    except UnicodeDecodeError:
        raise InvalidArgument(f"input '{TEXT_INPUT}' is not UTF-8 text") from None


def _value(parameter: kserve.InferParameter):
    choice = parameter.WhichOneof("parameter_choice")
    return None if choice is None else getattr(parameter, choice)


def _objective_ms(key: str, parameter: kserve.InferParameter) -> int:
    """A latency target in whole milliseconds; its bounds are the gateway's (checked at admission)."""
    value = _value(parameter)
    if not isinstance(value, int) or isinstance(value, bool) or not 1 <= value < 2**32:
        raise InvalidArgument(f"parameter '{key}' has an unusable value {value!r}; expected an integer number "
                              "of milliseconds >= 1")
    return value


def _set_sampling(sampling: common_pb2.SamplingParams, key: str, parameter: kserve.InferParameter) -> None:
    value = _value(parameter)
    if key in TRANSPORT_PARAMETERS:
        return
    numeric = isinstance(value, int | float) and not isinstance(value, bool)
    if key == "max_tokens" and isinstance(value, int) and not isinstance(value, bool) and 1 <= value < 2**32:
        sampling.max_tokens = value
    elif key == "temperature" and numeric and value >= 0:
        sampling.temperature = value
    elif key == "top_p" and numeric and 0 <= value <= 1:
        sampling.top_p = value
    elif key == "seed" and isinstance(value, int) and not isinstance(value, bool) and 0 <= value < 2**64:
        sampling.seed = value
    elif key == "ignore_eos" and isinstance(value, bool):
        sampling.ignore_eos = value
    elif key == "stop" and isinstance(value, str) and value:
        sampling.stop.append(value)
    elif key in _SAMPLING_PARAMETERS:
        raise InvalidArgument(f"parameter '{key}' has an unusable value {value!r}; " + _EXPECTED[key])
    else:
        raise InvalidArgument(f"unknown parameter '{key}'; this model takes max_tokens, temperature, top_p, seed, "
                              f"ignore_eos, stop, ttft_ms, tpot_ms, {', '.join(_OPENAI_PARAMETERS)}")


_EXPECTED = {
    "max_tokens": "expected an integer >= 1", "temperature": "expected a number >= 0",
    "top_p": "expected a number in [0, 1]", "seed": "expected an integer >= 0",
    "ignore_eos": "expected a bool", "stop": "expected a non-empty string",
}


def chunk_responses(request: StreamRequest, chunk: gateway_pb2.GenerateResponse) -> list[kserve.ModelInferResponse]:
    """The stream responses for one chunk: one, or for the last chunk with empty_final, two."""
    last = chunk.finish_reason != common_pb2.FINISH_REASON_UNSPECIFIED
    response = kserve.ModelInferResponse(model_name=chunk.model.name or request.generate.model.name,
                                         model_version=chunk.model.version, id=request.id)
    response.outputs.add(name=TEXT_OUTPUT, datatype="BYTES", shape=[1])
    response.raw_output_contents.append(pack_bytes_tensor([chunk.text.encode()]))
    if request.generate.sampling.logprobs:
        _add_logprobs(response, chunk.logprobs, request.generate.sampling.top_logprobs > 0)
    response.parameters[FINAL].bool_param = last and not request.empty_final
    if not last:
        return [response]
    response.parameters["finish_reason"].string_param = _FINISH_REASONS.get(chunk.finish_reason, "unknown")
    response.parameters["prompt_tokens"].int64_param = chunk.usage.prompt_tokens
    response.parameters["completion_tokens"].int64_param = chunk.usage.completion_tokens
    response.parameters["cached_prompt_tokens"].int64_param = chunk.usage.cached_prompt_tokens
    if not request.empty_final:
        return [response]
    final = kserve.ModelInferResponse(model_name=response.model_name, model_version=response.model_version,
                                      id=request.id)
    final.parameters[FINAL].bool_param = True
    return [response, final]


def _add_logprobs(response: kserve.ModelInferResponse, positions, with_top: bool) -> None:
    """logprobs FP32 [k] and, asked for, top_logprobs BYTES [k] of JSON: the chunk's k tokens."""
    values = [p.token.logprob for p in positions]
    response.outputs.add(name=LOGPROBS, datatype="FP32", shape=[len(values)])
    response.raw_output_contents.append(struct.pack(f"<{len(values)}f", *values))
    if not with_top:
        return
    response.outputs.add(name=TOP_LOGPROBS, datatype="BYTES", shape=[len(values)])
    response.raw_output_contents.append(pack_bytes_tensor([json.dumps(
        [{"token_id": t.token_id, "token": t.token_bytes.decode("utf-8", "replace"), "logprob": _finite(t.logprob)}
         for t in p.top]).encode() for p in positions]))


def _finite(logprob: float) -> float | None:
    return None if math.isnan(logprob) else logprob  # JSON has no NaN (a position without a logprob)


def named_refusal(request: StreamRequest, err: InvalidArgument) -> InvalidArgument:
    """The scheduler's refusal of a structured output (it compiles the schema, regex or grammar) names the
    parameter that asked for it, as the OpenAI front's 400 does; of a token id past the model's
    vocabulary, the input that held it."""
    if request.structured_param is not None and err.message.startswith("sampling.structured"):
        return BadParameter(request.structured_param, f"parameter '{request.structured_param}': {err.message}")
    if request.generate.prompt_token_ids and err.message.startswith("prompt_token_ids["):
        return InvalidArgument(f"input '{TOKEN_INPUT}'" + err.message.removeprefix("prompt_token_ids"))
    return err
