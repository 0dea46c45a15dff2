"""KServe v2 tensor codec: input image decoding, output encoding, Triton's BYTES layout."""

from __future__ import annotations

import struct

import pytest

from inference import grpc_predict_v2_pb2 as kserve
from infermesh.v1 import common_pb2
from services.common.errors import InvalidArgument
from services.gateway.kserve import codec as kserve_codec
from services.gateway.kserve.codec import ClassScores, RequestedOutput


def _request(datatype: str, shape, raw: bytes) -> kserve.ModelInferRequest:
    tensor = kserve.ModelInferRequest.InferInputTensor(name="IMAGE", datatype=datatype, shape=shape)
    return kserve.ModelInferRequest(model_name="m", inputs=[tensor], raw_input_contents=[raw])


def test_bytes_tensor_round_trips_and_rejects_truncation():
    packed = kserve_codec.pack_bytes_tensor([b"dark", b"", b"bright"])
    assert packed[:8] == struct.pack("<I", 4) + b"dark"
    assert kserve_codec.unpack_bytes_tensor(packed) == [b"dark", b"", b"bright"]
    with pytest.raises(InvalidArgument, match="element of 6 bytes runs past the end"):
        kserve_codec.unpack_bytes_tensor(packed[:-1])
    with pytest.raises(InvalidArgument, match="length prefix is cut short"):
        kserve_codec.unpack_bytes_tensor(b"\x01\x00")


def test_uint8_batch_splits_into_images_and_hwc_stays_unbatched():
    batch = kserve_codec.decode_images(_request("UINT8", [2, 2, 1, 4], bytes(range(16))))
    assert batch.batched and [i.raw.pixels for i in batch.images] == [bytes(range(8)), bytes(range(8, 16))]
    assert {(i.raw.height, i.raw.width, i.raw.channels) for i in batch.images} == {(2, 1, 4)}
    single = kserve_codec.decode_images(_request("UINT8", [2, 1, 4], bytes(8)))
    assert (single.batched, len(single.images)) == (False, 1)
    with pytest.raises(InvalidArgument, match=r"has 8 bytes, expected 16 \(2x2x1x4\)"):
        kserve_codec.decode_images(_request("UINT8", [2, 2, 1, 4], bytes(8)))


def test_encoded_images_come_one_per_bytes_element():
    one = kserve_codec.decode_images(_request("BYTES", [1], kserve_codec.pack_bytes_tensor([b"PNG..."])))
    assert (one.images, one.batched) == ((common_pb2.Image(encoded=b"PNG..."),), False)
    two = kserve_codec.decode_images(_request("BYTES", [2, 1], kserve_codec.pack_bytes_tensor([b"a", b"b"])))
    assert (len(two.images), two.batched) == (2, True)
    with pytest.raises(InvalidArgument, match="hold 2 elements, expected 1"):
        kserve_codec.decode_images(_request("BYTES", [1], kserve_codec.pack_bytes_tensor([b"a", b"b"])))


def test_outputs_in_class_order_and_classification_ranked():
    scores = kserve_codec.scores_from_labels(
        ["cat", "dog", "eel"],
        [common_pb2.Label(label="dog", index=1, score=0.7), common_pb2.Label(label="eel", index=2, score=0.2),
         common_pb2.Label(label="cat", index=0, score=0.1)],
    )
    assert scores == ClassScores(labels=("cat", "dog", "eel"), scores=pytest.approx((0.1, 0.7, 0.2)))
    response = kserve.ModelInferResponse()
    outputs = [RequestedOutput("PROBABILITIES"), RequestedOutput("LABELS", 2)]
    kserve_codec.encode_outputs(response, outputs, [scores], batched=False)
    assert [(o.name, o.datatype, list(o.shape)) for o in response.outputs] == [
        ("PROBABILITIES", "FP32", [3]), ("LABELS", "BYTES", [2]),
    ]
    assert struct.unpack("<3f", response.raw_output_contents[0]) == pytest.approx((0.1, 0.7, 0.2))
    assert kserve_codec.unpack_bytes_tensor(response.raw_output_contents[1]) == [b"0.700000:1:dog", b"0.200000:2:eel"]
    batched = kserve.ModelInferResponse()
    kserve_codec.encode_outputs(batched, outputs, [scores, scores], batched=True)
    assert [list(o.shape) for o in batched.outputs] == [[2, 3], [2, 2]]
    assert len(kserve_codec.unpack_bytes_tensor(batched.raw_output_contents[1])) == 4


def _typed(datatype: str, shape, **contents) -> kserve.ModelInferRequest:
    tensor = kserve.ModelInferRequest.InferInputTensor(name="IMAGE", datatype=datatype, shape=shape,
                                                       contents=kserve.InferTensorContents(**contents))
    return kserve.ModelInferRequest(model_name="m", inputs=[tensor])


def test_typed_contents_must_be_the_datatypes_field_and_not_besides_raw_contents():
    pixels = kserve_codec.decode_images(_typed("UINT8", [1, 1, 3], uint_contents=[1, 2, 3]))
    assert pixels.images[0].raw.pixels == bytes([1, 2, 3])
    with pytest.raises(InvalidArgument, match=r"is UINT8: its values go in contents.uint_contents, got contents.fp32"):
        kserve_codec.decode_images(_typed("UINT8", [1, 1, 3], fp32_contents=[1.0, 2.0, 3.0]))
    both = _typed("UINT8", [1, 1, 3], uint_contents=[1, 2, 3])
    both.raw_input_contents.append(bytes(3))
    with pytest.raises(InvalidArgument, match="has both raw_input_contents and contents.uint_contents; send one"):
        kserve_codec.decode_images(both)


@pytest.mark.parametrize(("parameter", "shown"), [
    (kserve.InferParameter(string_param="3"), "string_param '3'"),
    (kserve.InferParameter(double_param=2.5), "double_param 2.5"),
    (kserve.InferParameter(int64_param=0), "int64_param 0"),
    (kserve.InferParameter(), "nothing"),
])
def test_classification_must_be_an_integer_of_at_least_one_and_the_refusal_says_what_came(parameter, shown):
    request = kserve.ModelInferRequest(model_name="m", outputs=[
        kserve.ModelInferRequest.InferRequestedOutputTensor(name=kserve_codec.OUTPUT_NAMES[0],
                                                            parameters={"classification": parameter})])
    with pytest.raises(InvalidArgument, match=f"classification must be an integer >= 1, got {shown}"):
        kserve_codec.requested_outputs(request)
    request.outputs[0].parameters["classification"].CopyFrom(kserve.InferParameter(uint64_param=2))
    assert kserve_codec.requested_outputs(request)[0].class_count == 2
