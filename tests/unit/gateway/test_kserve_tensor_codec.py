"""KServe tensors <-> Classify rows for tensor models: every datatype in raw or typed contents, the
declared signature enforced with the input named, rows split and outputs stacked back."""

from __future__ import annotations

import numpy as np
import pytest

from inference import grpc_predict_v2_pb2 as kserve
from infermesh.v1 import common_pb2, gateway_pb2
from services.common.errors import InvalidArgument
from services.common.tensor_datatypes import NUMPY_DTYPES
from services.gateway.kserve import models as kserve_models
from services.gateway.kserve import tensor_codec

TYPED = {"BOOL": "bool_contents", "UINT8": "uint_contents", "UINT16": "uint_contents", "UINT32": "uint_contents",
         "UINT64": "uint64_contents", "INT8": "int_contents", "INT16": "int_contents", "INT32": "int_contents",
         "INT64": "int64_contents", "FP32": "fp32_contents", "FP64": "fp64_contents"}


def info(datatype: str = "FP32", dims=(-1, 2, -1), outputs=(("y", "FP32", (-1, 3), ()),)) -> gateway_pb2.ModelInfo:
    return gateway_pb2.ModelInfo(
        model=common_pb2.ModelRef(name="m", version="1"), kind=common_pb2.MODEL_KIND_TENSOR,
        tensor_inputs=[common_pb2.TensorMetadata(name="x", datatype=datatype, dims=list(dims))],
        tensor_outputs=[common_pb2.TensorMetadata(name=n, datatype=d, dims=list(s), labels=list(lb))
                        for n, d, s, lb in outputs],
        batching=gateway_pb2.BatchingInfo(max_batch_size=4))


def array_of(datatype: str, shape) -> np.ndarray:
    values = np.arange(int(np.prod(shape))).reshape(shape) % 2 if datatype == "BOOL" else np.arange(np.prod(shape))
    return np.asarray(values, dtype=NUMPY_DTYPES[datatype]).reshape(shape)


# Every datatype raw; typed contents for each but FP16, which has none (its refusal is tested below).
@pytest.mark.parametrize(("datatype", "typed"), [(d, False) for d in sorted(NUMPY_DTYPES)] + [(d, True) for d in sorted(TYPED)])
def test_every_datatype_goes_upstream_as_raw_rows(datatype, typed):
    array = array_of(datatype, (3, 2, 5))
    request = kserve.ModelInferRequest(model_name="m")
    tensor = request.inputs.add(name="x", datatype=datatype, shape=[3, 2, 5])
    if typed:
        getattr(tensor.contents, TYPED[datatype]).extend(array.ravel().tolist())
    else:
        request.raw_input_contents.append(array.tobytes())
    rows = tensor_codec.decode_rows(request, info(datatype), max_batch_size=4).rows
    assert len(rows) == 3
    for i, (row,) in enumerate(rows):
        assert (row.name, row.datatype, list(row.shape)) == ("x", datatype, [1, 2, 5])
        assert row.data == array[i:i + 1].tobytes()


def test_fp16_in_typed_contents_is_refused_naming_raw():
    request = kserve.ModelInferRequest(model_name="m")
    request.inputs.add(name="x", datatype="FP16", shape=[1, 2, 1]).contents.fp32_contents.extend([1.0, 2.0])
    with pytest.raises(InvalidArgument, match="input 'x' is FP16: send it in raw_input_contents"):
        tensor_codec.decode_rows(request, info("FP16"), max_batch_size=4)


@pytest.mark.parametrize(("shape", "data", "message"), [
    ([1, 3, 1], 12, "input 'x' must have shape [-1, 2, -1] (-1: any size >= 1), got [1, 3, 1]"),
    ([1, 2], 8, "input 'x' must have shape [-1, 2, -1]"),
    ([1, 2, 2], 12, "input 'x' FP32 [1, 2, 2] needs 16 bytes (4 elements), got 12"),
    ([5, 2, 1], 40, "input 'x' has a batch of 5; the model takes at most 4 (its max_batch_size)"),
])
def test_a_tensor_off_the_signature_is_refused_naming_the_input(shape, data, message):
    request = kserve.ModelInferRequest(model_name="m")
    request.inputs.add(name="x", datatype="FP32", shape=shape)
    request.raw_input_contents.append(b"\0" * data)
    with pytest.raises(InvalidArgument) as refused:
        tensor_codec.decode_rows(request, info(), max_batch_size=4)
    assert message in refused.value.message


def test_a_value_out_of_range_for_its_datatype_is_refused():
    request = kserve.ModelInferRequest(model_name="m")
    request.inputs.add(name="x", datatype="UINT8", shape=[1, 2, 1]).contents.uint_contents.extend([1, 300])
    with pytest.raises(InvalidArgument, match="input 'x': a value is out of range for UINT8"):
        tensor_codec.decode_rows(request, info("UINT8"), max_batch_size=4)


def test_outputs_are_stacked_in_row_order_and_ranked_with_labels():
    labels = ("cat", "dog", "eel")
    model = info(outputs=(("y", "FP32", (-1, 3), labels),))
    rows = [np.array([[0.1, 0.7, 0.2]], np.float32), np.array([[0.5, 0.2, 0.3]], np.float32)]
    answers = [gateway_pb2.ClassifyResponse(outputs=[common_pb2.Tensor(name="y", datatype="FP32", shape=[1, 3],
                                                                       data=r.tobytes())]) for r in rows]
    response = kserve.ModelInferResponse()
    tensor_codec.encode_outputs(response, [tensor_codec.RequestedOutput("y")], answers, model)
    assert list(response.outputs[0].shape) == [2, 3]
    assert response.raw_output_contents[0] == np.concatenate(rows).tobytes()
    ranked = kserve.ModelInferResponse()
    tensor_codec.encode_outputs(ranked, [tensor_codec.RequestedOutput("y", class_count=2)], answers, model)
    assert (ranked.outputs[0].datatype, list(ranked.outputs[0].shape)) == ("BYTES", [2, 2])
    assert b"0.700000:1:dog" in ranked.raw_output_contents[0] and b"0.500000:0:cat" in ranked.raw_output_contents[0]


def test_metadata_and_config_describe_the_declared_signature():
    model = info("INT64", (-1, -1))
    metadata = kserve_models.model_metadata(model, ["1"])
    assert (metadata.platform, [(t.name, t.datatype, list(t.shape)) for t in metadata.inputs]) == (
        "infermesh_tensor", [("x", "INT64", [-1, -1])])
    config = kserve_models.model_config(model)
    assert config.max_batch_size == 4
    assert [(i.name, kserve.DataType.Name(i.data_type), list(i.dims)) for i in config.input] == [
        ("x", "TYPE_INT64", [-1])]
