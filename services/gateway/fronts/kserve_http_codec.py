"""KServe v2 REST bodies <-> the KServe messages kserve_core speaks (the gRPC ones, as Triton does inside).

Inference request (POST /v2/models/{name}[/versions/{v}]/infer):
    {"id": "...", "parameters": {...},
     "inputs": [{"name": "IMAGE", "datatype": "UINT8", "shape": [N, H, W, C], "data": [...]}],
     "outputs": [{"name": "PROBABILITIES", "parameters": {"classification": 2, "binary_data": false}}]}
`data` is the tensor's elements, flat or nested row-major (BYTES elements are strings). With the
binary tensor extension the body is that JSON (its length in the `Inference-Header-Content-Length`
header) followed by each input whose `parameters.binary_data_size` is set, in input order, in
Triton's raw layout; outputs asking for `binary_data: true` (or every output, with the request
parameter `binary_data_output: true`) come back the same way. tritonclient's HTTP client sends
and asks for binary tensors by default.

Generate extension (Triton's, for generators; POST .../generate and .../generate_stream):
    {"id": "...", "text_input": "<prompt>", "parameters": {"max_tokens": 16, "logprobs": true, ...}}
or `"input_ids": [ids]` in place of text_input: the prompt as token ids (the input of that name);
the parameters those of ModelStreamInfer (kserve/stream.py; the JSON ones may be JSON values).
Each response is an object of the model, its outputs by name (text_output a string, logprobs and
top_logprobs lists) and, on the last, `parameters` (finish_reason and the token counts);
`generate` answers the stream's responses as one (text and lists joined).
"""

from __future__ import annotations

import json
import math
import struct
from collections.abc import Iterable
from dataclasses import dataclass

from google.protobuf.descriptor import FieldDescriptor
from google.protobuf.message import Message

from inference import grpc_predict_v2_pb2 as kserve
from services.common.errors import InvalidArgument
from services.common.tensor_datatypes import STRUCT_CODES
from services.gateway.fronts import json_body
from services.gateway.kserve.codec import class_count, pack_bytes_tensor, unpack_bytes_tensor
from services.gateway.kserve.models import TEXT_INPUT, TEXT_OUTPUT, TOKEN_INPUT
from services.gateway.kserve.stream import FINAL, JSON_PARAMETERS

HEADER_LENGTH = "Inference-Header-Content-Length"
BINARY_SIZE = "binary_data_size"
_INTEGER_TYPES = {d: code for d, code in STRUCT_CODES.items() if d.startswith(("INT", "UINT"))}
_FLOAT_TYPES = {d: code for d, code in STRUCT_CODES.items() if d.startswith("FP")}


@dataclass(frozen=True)
class HttpInference:
    request: kserve.ModelInferRequest
    # Output names to send as binary tensors; every output when binary_all.
    binary_outputs: frozenset[str]
    binary_all: bool


def parse_infer(body: bytes, header_length: str | None, name: str, version: str) -> HttpInference:
    header, binary = _split(body, header_length)
    document = _document(header)
    request = kserve.ModelInferRequest(model_name=name, model_version=version, id=_string(document, "id"))
    parameters = dict(_object(document, "parameters"))
    binary_all = parameters.pop("binary_data_output", False) is True
    _set_parameters(request.parameters, parameters, "parameters")
    inputs = document.get("inputs")
    if not isinstance(inputs, list) or not inputs:
        raise InvalidArgument("'inputs' must be a non-empty list of tensors")
    offset = 0
    for index, tensor in enumerate(inputs):
        offset = _add_input(request, tensor, index, binary, offset)
    if offset != len(binary):
        raise InvalidArgument(f"the body has {len(binary) - offset} bytes after the binary inputs")
    binary_outputs = set()
    outputs = document.get("outputs", [])
    if not isinstance(outputs, list):
        raise InvalidArgument("'outputs' must be a list")
    for index, wanted in enumerate(outputs):
        if not isinstance(wanted, dict) or not isinstance(wanted.get("name"), str):
            raise InvalidArgument(f"outputs[{index}] must be an object with a string 'name'")
        parameters = dict(_object(wanted, "parameters"))
        if parameters.pop("binary_data", False) is True:
            binary_outputs.add(wanted["name"])
        _check_classification(parameters, f"outputs[{index}].parameters")
        output = request.outputs.add(name=wanted["name"])
        _set_parameters(output.parameters, parameters, f"outputs[{index}].parameters")
    return HttpInference(request, frozenset(binary_outputs), binary_all)


def parse_generate(body: bytes, name: str, version: str) -> kserve.ModelInferRequest:
    """A generate extension body as the ModelStreamInfer request it asks for."""
    document = _document(body)
    unknown = sorted(set(document) - {"id", TEXT_INPUT, TOKEN_INPUT, "parameters"})
    if unknown:
        raise InvalidArgument(f"unknown field '{unknown[0]}'; a generate request has id, {TEXT_INPUT} or "
                              f"{TOKEN_INPUT}, parameters")
    request = kserve.ModelInferRequest(model_name=name, model_version=version, id=_string(document, "id"))
    _add_prompt(request, document)
    _set_parameters(request.parameters, _object(document, "parameters"), "parameters")
    return request


def _add_prompt(request: kserve.ModelInferRequest, document: dict) -> None:
    """text_input (the prompt's text) or input_ids (its token ids) as the one input, as Triton's generate
    maps a body's fields onto the inputs of the same name."""
    if TOKEN_INPUT in document:
        if TEXT_INPUT in document:
            raise InvalidArgument(f"send '{TEXT_INPUT}' (the prompt's text) or '{TOKEN_INPUT}' (its token ids), "
                                  "not both")
        ids = document[TOKEN_INPUT]
        if not isinstance(ids, list) or not ids or not all(
                isinstance(i, int) and not isinstance(i, bool) and 0 <= i < 2**32 for i in ids):
            raise InvalidArgument(f"'{TOKEN_INPUT}' must be a non-empty list of token ids (integers >= 0), got "
                                  f"{json.dumps(ids)[:80]}")
        request.inputs.add(name=TOKEN_INPUT, datatype="INT64", shape=[len(ids)])
        request.raw_input_contents.append(struct.pack(f"<{len(ids)}q", *ids))
        return
    prompt = document.get(TEXT_INPUT)
    if not isinstance(prompt, str):
        raise InvalidArgument(f"'{TEXT_INPUT}' must be a string (the prompt), or send '{TOKEN_INPUT}' (its token ids)")
    request.inputs.add(name=TEXT_INPUT, datatype="BYTES", shape=[1])
    request.raw_input_contents.append(pack_bytes_tensor([prompt.encode()]))


def generate_document(response: kserve.ModelInferResponse) -> dict:
    """One stream response as a generate extension object."""
    document: dict = {"model_name": response.model_name, "model_version": response.model_version}
    if response.id:
        document["id"] = response.id
    for tensor, raw in zip(response.outputs, response.raw_output_contents, strict=True):
        values = _values(raw, tensor.datatype)
        document[tensor.name] = "".join(values) if tensor.name == TEXT_OUTPUT else values
    parameters = {key: getattr(value, value.WhichOneof("parameter_choice"))
                  for key, value in response.parameters.items() if key != FINAL}
    if parameters:
        document["parameters"] = parameters
    return document


def joined_documents(documents: list[dict]) -> dict:
    """A stream's generate objects as one: text and lists joined, the last one's parameters."""
    joined: dict = {}
    for document in documents:
        for key, value in document.items():
            if isinstance(value, str | list) and key in joined and key not in ("model_name", "model_version", "id"):
                joined[key] = joined[key] + value
            elif key not in joined or key == "parameters":
                joined[key] = value
    return joined


def _document(body: bytes) -> dict:
    try:
        document = json_body.loads(body)
    except ValueError as exc:
        raise InvalidArgument(str(exc)) from None
    if not isinstance(document, dict):
        raise InvalidArgument("the request body must be a JSON object")
    return document


def _split(body: bytes, header_length: str | None) -> tuple[bytes, bytes]:
    if header_length is None:
        return body, b""
    if not header_length.isdigit() or int(header_length) > len(body):
        raise InvalidArgument(f"{HEADER_LENGTH} must be a byte count within the body ({len(body)} bytes), "
                              f"got {header_length[:40]!r}")
    return body[:int(header_length)], body[int(header_length):]


def _add_input(request: kserve.ModelInferRequest, tensor: object, index: int, binary: bytes, offset: int) -> int:
    where = f"inputs[{index}]"
    if not isinstance(tensor, dict):
        raise InvalidArgument(f"{where} must be an object")
    name, datatype, shape = tensor.get("name"), tensor.get("datatype"), tensor.get("shape")
    if not isinstance(name, str) or not isinstance(datatype, str):
        raise InvalidArgument(f"{where} needs a string 'name' and 'datatype'")
    if (not isinstance(shape, list)
            or not all(isinstance(d, int) and not isinstance(d, bool) and 0 <= d < 2**31 for d in shape)):
        raise InvalidArgument(f"{where} ('{name}') needs 'shape': a list of dimensions >= 0")
    request.inputs.add(name=name, datatype=datatype, shape=shape)
    parameters = dict(_object(tensor, "parameters"))
    size = parameters.pop(BINARY_SIZE, None)
    if size is not None:
        if not isinstance(size, int) or isinstance(size, bool) or size < 0 or offset + size > len(binary):
            raise InvalidArgument(f"{where} ('{name}'): {BINARY_SIZE} {size!r} runs past the body's binary part "
                                  f"({len(binary) - offset} bytes left)")
        request.raw_input_contents.append(binary[offset:offset + size])
        return offset + size
    if "data" not in tensor:
        raise InvalidArgument(f"{where} ('{name}') has neither 'data' nor parameters.{BINARY_SIZE}")
    request.raw_input_contents.append(_raw(list(_flat(tensor["data"])), datatype, f"{where} ('{name}')"))
    return offset


def _raw(values: list, datatype: str, where: str) -> bytes:
    if datatype == "BYTES":
        if not all(isinstance(v, str) for v in values):
            raise InvalidArgument(f"{where}: BYTES data must be strings")
        return pack_bytes_tensor([v.encode() for v in values])
    if datatype == "BOOL":
        if not all(isinstance(v, bool) for v in values):
            raise InvalidArgument(f"{where}: BOOL data must be true or false")
        return bytes(values)
    code = _INTEGER_TYPES.get(datatype)
    if code is not None:
        if not all(isinstance(v, int) and not isinstance(v, bool) for v in values):
            raise InvalidArgument(f"{where}: {datatype} data must be integers")
        try:
            return struct.pack(f"<{len(values)}{code}", *values)
        except struct.error:
            raise InvalidArgument(f"{where}: a value is out of range for {datatype}") from None
    code = _FLOAT_TYPES.get(datatype)
    if code is not None:
        if not all(isinstance(v, int | float) and not isinstance(v, bool) for v in values):
            raise InvalidArgument(f"{where}: {datatype} data must be numbers")
        return struct.pack(f"<{len(values)}{code}", *values)
    raise InvalidArgument(f"{where}: unknown datatype {datatype!r}")


def _flat(data) -> Iterable:
    if isinstance(data, list):
        for item in data:
            yield from _flat(item)
    else:
        yield data


def _object(document: dict, key: str) -> dict:
    value = document.get(key, {})
    if not isinstance(value, dict):
        raise InvalidArgument(f"'{key}' must be an object")
    return value


def _string(document: dict, key: str) -> str:
    value = document.get(key, "")
    if not isinstance(value, str):
        raise InvalidArgument(f"'{key}' must be a string")
    return value


def _check_classification(parameters: dict, where: str) -> None:
    """Checked on the JSON value, so the refusal shows what was sent ("3", 2.5, true) rather than
    the parameter kind it would become (kserve/codec.py holds the rule)."""
    count = parameters.get("classification")
    if count is not None:
        class_count(count, f"{where}.classification", json.dumps(count)[:40])


def _set_parameters(target, parameters: dict, where: str) -> None:
    for key, value in parameters.items():
        if key in JSON_PARAMETERS and isinstance(value, dict | list):  # carried as JSON text, as over gRPC
            target[key].string_param = json.dumps(value)
        elif isinstance(value, bool):
            target[key].bool_param = value
        elif isinstance(value, int) and -2**63 <= value < 2**63:
            target[key].int64_param = value
        elif isinstance(value, float) and math.isfinite(value):
            target[key].double_param = value
        elif isinstance(value, str):
            target[key].string_param = value
        else:
            raise InvalidArgument(f"{where}.{key} must be a bool, an integer, a finite number or a string")


# -- responses -----------------------------------------------------------------------------


def infer_response(response: kserve.ModelInferResponse, inference: HttpInference) -> tuple[bytes, int | None]:
    """The response body, and the JSON header's length when binary outputs follow it (else None)."""
    document: dict = {"model_name": response.model_name, "model_version": response.model_version}
    if response.id:
        document["id"] = response.id
    if response.parameters:  # an embedding's prompt_tokens
        document["parameters"] = {key: getattr(value, value.WhichOneof("parameter_choice"))
                                  for key, value in response.parameters.items()}
    outputs, binary = [], []
    for tensor, raw in zip(response.outputs, response.raw_output_contents, strict=True):
        entry: dict = {"name": tensor.name, "datatype": tensor.datatype, "shape": list(tensor.shape)}
        if inference.binary_all or tensor.name in inference.binary_outputs:
            entry["parameters"] = {BINARY_SIZE: len(raw)}
            binary.append(raw)
        else:
            entry["data"] = _values(raw, tensor.datatype)
        outputs.append(entry)
    document["outputs"] = outputs
    header = json.dumps(document, separators=(",", ":")).encode()
    if not binary:
        return header, None
    return header + b"".join(binary), len(header)


def _values(raw: bytes, datatype: str) -> list:
    if datatype == "BYTES":
        return [e.decode("utf-8", "replace") for e in unpack_bytes_tensor(raw)]
    if datatype == "BOOL":
        return [b != 0 for b in raw]
    code = _FLOAT_TYPES.get(datatype) or _INTEGER_TYPES[datatype]
    return list(struct.unpack(f"<{len(raw) // struct.calcsize(code)}{code}", raw))


def plain(message: Message) -> dict:
    """A message as Triton's JSON writes it: field names as in the proto, 64-bit integers as numbers
    (json_format would quote them), enums by name, fields left at their defaults left out."""
    out: dict = {}
    for field, value in message.ListFields():
        out[field.name] = _plain_value(field, value)
    return out


def _plain_value(field: FieldDescriptor, value):
    if field.message_type is not None and field.message_type.GetOptions().map_entry:
        value_field = field.message_type.fields_by_name["value"]
        return {k: _plain_scalar(value_field, v) for k, v in value.items()}
    if field.is_repeated:
        return [_plain_scalar(field, v) for v in value]
    return _plain_scalar(field, value)


def _plain_scalar(field: FieldDescriptor, value):
    if field.type == FieldDescriptor.TYPE_MESSAGE:
        return plain(value)
    if field.type == FieldDescriptor.TYPE_ENUM:
        return field.enum_type.values_by_number[value].name
    return value
