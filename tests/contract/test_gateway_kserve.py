"""KServe v2 / Triton GRPCInferenceService on the gateway port: health, metadata, inference, errors."""

from __future__ import annotations

import io
import json
import ssl
import struct
import urllib.error
import urllib.request

import grpc
import pytest
from PIL import Image

from inference import grpc_predict_v2_pb2 as kserve
from inference import grpc_predict_v2_pb2_grpc as kserve_grpc
from tools.testbed import session_tls
from tools.testbed.gateway_fixtures import bearer, spawn_gateway, status_of, tenant, write_tenants
from tools.testbed.processes import free_port, running_mesh, wait_until

pytestmark = pytest.mark.integration

BRIGHT_PIXELS = bytes([250] * 12)  # 2 x 2 x 3
DARK_PIXELS = bytes([5] * 12)


@pytest.fixture(scope="module")
def mesh(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("gateway-kserve")
    tenants = write_tenants(tmp / "tenants.yaml", [
        tenant("vision", "vision-key", allowed_models=["toy-classifier"]),
        tenant("text", "text-key", allowed_models=["toy-generator"]),
        tenant("any", "any-key"),
    ])
    with running_mesh(tmp) as mesh:
        mesh.start_scheduler()
        mesh.start_worker("toy-classifier")
        mesh.start_worker("toy-generator")
        mesh.start_gateway("--pressure-poll-interval-ms", "200")
        mesh.http_port = free_port()
        mesh.secured = spawn_gateway(mesh, "gateway-secured", "--tenants-file", str(tenants),
                                     "--http-port", str(mesh.http_port))
        yield mesh


@pytest.fixture(scope="module")
def stub(mesh):
    with session_tls.channel(mesh.gateway.address) as channel:
        yield kserve_grpc.GRPCInferenceServiceStub(channel)


def _image_input(pixels: bytes = BRIGHT_PIXELS, shape=(2, 2, 3), datatype="UINT8") -> kserve.ModelInferRequest:
    return kserve.ModelInferRequest(
        model_name="toy-classifier", id="req-1",
        inputs=[kserve.ModelInferRequest.InferInputTensor(name="IMAGE", datatype=datatype, shape=list(shape))],
        raw_input_contents=[pixels],
    )


def _floats(raw: bytes) -> list[float]:
    return list(struct.unpack(f"<{len(raw) // 4}f", raw))


def _strings(raw: bytes) -> list[str]:
    out, offset = [], 0
    while offset < len(raw):
        (length,) = struct.unpack_from("<I", raw, offset)
        out.append(raw[offset + 4:offset + 4 + length].decode())
        offset += 4 + length
    return out


def test_server_health_and_metadata(stub):
    assert stub.ServerLive(kserve.ServerLiveRequest(), timeout=5).live
    wait_until(lambda: stub.ServerReady(kserve.ServerReadyRequest(), timeout=5).ready, timeout_s=10,
               message="ready once the scheduler answered a poll")
    meta = stub.ServerMetadata(kserve.ServerMetadataRequest(), timeout=5)
    assert (meta.name, list(meta.extensions)) == (
        "infermesh", ["classification", "model_configuration", "statistics", "model_repository"])


def test_model_ready_for_attached_models(stub):
    assert stub.ModelReady(kserve.ModelReadyRequest(name="toy-classifier"), timeout=5).ready
    assert stub.ModelReady(kserve.ModelReadyRequest(name="toy-classifier", version="1"), timeout=5).ready
    assert not stub.ModelReady(kserve.ModelReadyRequest(name="toy-classifier", version="7"), timeout=5).ready
    assert not stub.ModelReady(kserve.ModelReadyRequest(name="nope"), timeout=5).ready
    assert stub.ModelReady(kserve.ModelReadyRequest(name="toy-generator"), timeout=5).ready, "via ModelStreamInfer"


def test_model_metadata_describes_the_tensor_contract(stub):
    meta = stub.ModelMetadata(kserve.ModelMetadataRequest(name="toy-classifier"), timeout=5)
    assert (meta.name, list(meta.versions), meta.platform) == ("toy-classifier", ["1"], "infermesh_classifier")
    # Triton's convention: batch dimension first as -1, then the trained size and 3 channels (HWC).
    assert [(t.name, t.datatype, list(t.shape)) for t in meta.inputs] == [("IMAGE", "UINT8", [-1, 8, 8, 3])]
    assert [(t.name, t.datatype, list(t.shape)) for t in meta.outputs] == [
        ("PROBABILITIES", "FP32", [-1, 2]), ("LABELS", "BYTES", [-1, 2]),
    ]


def test_generator_metadata_is_text_or_token_ids_in_text_out(stub):
    meta = stub.ModelMetadata(kserve.ModelMetadataRequest(name="toy-generator"), timeout=5)
    assert (meta.platform, [(t.name, t.datatype, list(t.shape)) for t in [*meta.inputs, *meta.outputs]]) == (
        "infermesh_generator",
        [("text_input", "BYTES", [1]), ("input_ids", "INT32", [-1]), ("text_output", "BYTES", [1])])
    config = stub.ModelConfig(kserve.ModelConfigRequest(name="toy-generator"), timeout=5).config
    assert [(i.name, list(i.dims), i.optional) for i in config.input] == [("text_input", [1], True),
                                                                          ("input_ids", [-1], True)]


@pytest.mark.parametrize(
    ("name", "code", "message"),
    [
        ("nope", grpc.StatusCode.NOT_FOUND, "model 'nope' is not served here"),
        ("", grpc.StatusCode.INVALID_ARGUMENT, "model name is required"),
    ],
)
def test_model_metadata_errors(stub, name, code, message):
    got = status_of(lambda: stub.ModelMetadata(kserve.ModelMetadataRequest(name=name), timeout=5))
    assert (got.code, got.message) == (code, message)


def test_infer_raw_uint8_gives_probabilities_and_labels_in_class_order(stub):
    reply = stub.ModelInfer(_image_input(), timeout=10)
    assert (reply.model_name, reply.model_version, reply.id) == ("toy-classifier", "1", "req-1")
    assert [(o.name, o.datatype, list(o.shape)) for o in reply.outputs] == [
        ("PROBABILITIES", "FP32", [2]), ("LABELS", "BYTES", [2]),
    ]
    probabilities = _floats(reply.raw_output_contents[0])
    assert _strings(reply.raw_output_contents[1]) == ["dark", "bright"]
    assert probabilities[1] > probabilities[0] and abs(sum(probabilities) - 1) < 1e-3


def test_infer_with_typed_contents_and_batch_of_one_shape(stub):
    request = kserve.ModelInferRequest(
        model_name="toy-classifier",
        inputs=[kserve.ModelInferRequest.InferInputTensor(
            name="IMAGE", datatype="UINT8", shape=[1, 2, 2, 3],
            contents=kserve.InferTensorContents(uint_contents=list(DARK_PIXELS)),
        )],
        outputs=[kserve.ModelInferRequest.InferRequestedOutputTensor(name="PROBABILITIES")],
    )
    reply = stub.ModelInfer(request, timeout=10)
    assert [o.name for o in reply.outputs] == ["PROBABILITIES"]
    dark, bright = _floats(reply.raw_output_contents[0])
    assert dark > bright


def test_infer_encoded_png_as_bytes_with_the_classification_extension(stub):
    png = io.BytesIO()
    Image.new("RGB", (4, 4), (255, 255, 255)).save(png, format="PNG")
    encoded = png.getvalue()
    request = _image_input(struct.pack("<I", len(encoded)) + encoded, shape=(1,), datatype="BYTES")
    request.outputs.add(name="PROBABILITIES").parameters["classification"].int64_param = 1
    reply = stub.ModelInfer(request, timeout=10)
    assert [(o.name, o.datatype, list(o.shape)) for o in reply.outputs] == [("PROBABILITIES", "BYTES", [1])]
    (entry,) = _strings(reply.raw_output_contents[0])
    score, index, label = entry.split(":")
    assert (index, label) == ("1", "bright") and 0.5 < float(score) <= 1


@pytest.mark.parametrize(
    ("request_", "code", "message"),
    [
        (kserve.ModelInferRequest(model_name="nope", inputs=_image_input().inputs,
                                  raw_input_contents=[BRIGHT_PIXELS]),
         grpc.StatusCode.NOT_FOUND, "model 'nope' is not served here"),
        (kserve.ModelInferRequest(inputs=_image_input().inputs, raw_input_contents=[BRIGHT_PIXELS]),
         grpc.StatusCode.INVALID_ARGUMENT, "model_name is required"),
        (_image_input(datatype="FP32"), grpc.StatusCode.INVALID_ARGUMENT,
         "input 'IMAGE' has datatype FP32; expected UINT8 (HWC pixels) or BYTES (a PNG or JPEG file)"),
        (_image_input(shape=(2, 6)), grpc.StatusCode.INVALID_ARGUMENT,
         "input 'IMAGE' UINT8 shape must be [N, H, W, C] or [H, W, C] with N, H, W >= 1 and C in 1, 3, 4; "
         "got [2, 6]"),
        (_image_input(shape=(2, 3, 3)), grpc.StatusCode.INVALID_ARGUMENT,
         "input 'IMAGE' has 12 bytes, expected 18 (2x3x3)"),
        (kserve.ModelInferRequest(model_name="toy-classifier", raw_input_contents=[BRIGHT_PIXELS],
                                  inputs=[kserve.ModelInferRequest.InferInputTensor(
                                      name="INPUT0", datatype="UINT8", shape=[2, 2, 3])]),
         grpc.StatusCode.INVALID_ARGUMENT, "expected exactly one input named 'IMAGE', got ['INPUT0']"),
        (kserve.ModelInferRequest(model_name="toy-classifier", inputs=_image_input().inputs,
                                  raw_input_contents=[BRIGHT_PIXELS],
                                  outputs=[kserve.ModelInferRequest.InferRequestedOutputTensor(name="SCORES")]),
         grpc.StatusCode.INVALID_ARGUMENT, "unknown output 'SCORES'; this model has PROBABILITIES, LABELS"),
        (kserve.ModelInferRequest(model_name="toy-generator", inputs=_image_input().inputs,
                                  raw_input_contents=[BRIGHT_PIXELS]),
         grpc.StatusCode.INVALID_ARGUMENT,
         "model toy-generator:1 is a generator (decoupled): use ModelStreamInfer for it; "
         "ModelInfer serves classifier models"),
    ],
)
def test_infer_errors_are_statuses_with_precise_messages(stub, request_, code, message):
    got = status_of(lambda: stub.ModelInfer(request_, timeout=10))
    assert (got.code, got.message) == (code, message)


def test_undecodable_image_error_comes_from_the_worker(stub):
    garbage = b"not a png"
    got = status_of(lambda: stub.ModelInfer(
        _image_input(struct.pack("<I", len(garbage)) + garbage, shape=(1,), datatype="BYTES"), timeout=10))
    assert got.code == grpc.StatusCode.INVALID_ARGUMENT
    assert got.message == "image bytes are not a PNG or JPEG file (9 bytes)"


def test_kserve_calls_authenticate_like_the_infermesh_api(mesh):
    with session_tls.channel(mesh.secured.address) as channel:
        secured = kserve_grpc.GRPCInferenceServiceStub(channel)
        missing = status_of(lambda: secured.ModelInfer(_image_input(), timeout=10))
        assert (missing.code, missing.message) == (
            grpc.StatusCode.UNAUTHENTICATED, "missing API key: send metadata 'authorization: Bearer <key>'"
        )
        denied = status_of(lambda: secured.ModelMetadata(kserve.ModelMetadataRequest(name="toy-classifier"),
                                                         timeout=5, metadata=bearer("text-key")))
        assert (denied.code, denied.message) == (
            grpc.StatusCode.PERMISSION_DENIED, "tenant 'text' may not use model 'toy-classifier'"
        )
        reply = secured.ModelInfer(_image_input(), timeout=10, metadata=bearer("vision-key"))
        assert _strings(reply.raw_output_contents[1]) == ["dark", "bright"]
        assert secured.ServerLive(kserve.ServerLiveRequest(), timeout=5).live, "probes need no key"


# -- KServe v2 REST on the secured gateway's HTTP port ----------------------------------------


def _rest(mesh, method: str, path: str, body=None, key: str | None = "vision-key",
          headers: dict | None = None) -> tuple[int, dict, bytes]:
    data = body if isinstance(body, bytes | None) else json.dumps(body).encode()
    sent = {**({"Authorization": f"Bearer {key}"} if key else {}), **(headers or {})}
    request = urllib.request.Request(f"https://127.0.0.1:{mesh.http_port}{path}", data=data, headers=sent,
                                     method=method)
    context = ssl.create_default_context(cafile=str(session_tls.session_pki().ca_path))
    try:
        with urllib.request.urlopen(request, timeout=10, context=context) as reply:
            return reply.status, dict(reply.headers), reply.read()
    except urllib.error.HTTPError as exc:
        return exc.code, dict(exc.headers), exc.read()


def _json_image(shape=(2, 2, 3), value=250, datatype="UINT8") -> dict:
    count = 1
    for d in shape:
        count *= d
    return {"inputs": [{"name": "IMAGE", "datatype": datatype, "shape": list(shape), "data": [value] * count}]}


def test_rest_health_metadata_and_ready(mesh):
    assert _rest(mesh, "GET", "/v2/health/live", key=None)[:1] == (200,)
    wait_until(lambda: _rest(mesh, "GET", "/v2/health/ready", key=None)[0] == 200, timeout_s=10,
               message="ready once the scheduler answered a poll")
    assert _rest(mesh, "GET", "/health", key=None)[::2] == (200, b"")  # as vLLM, TGI and SGLang answer it
    status, _, body = _rest(mesh, "GET", "/v2/models/toy-classifier/versions/1")
    assert status == 200
    assert json.loads(body)["inputs"] == [{"name": "IMAGE", "datatype": "UINT8", "shape": [-1, 8, 8, 3]}]
    assert _rest(mesh, "GET", "/v2/models/toy-classifier/ready")[0] == 200
    assert _rest(mesh, "GET", "/v2/models/toy-classifier/versions/7/ready")[0] == 503


def test_rest_infer_json_tensors_batched_and_unbatched(mesh):
    status, _, body = _rest(mesh, "POST", "/v2/models/toy-classifier/infer",
                            {**_json_image((2, 2, 2, 3)), "id": "r-1",
                             "outputs": [{"name": "LABELS"}, {"name": "PROBABILITIES",
                                                              "parameters": {"classification": 1}}]})
    assert status == 200
    reply = json.loads(body)
    assert (reply["id"], reply["model_name"], reply["model_version"]) == ("r-1", "toy-classifier", "1")
    labels, top = reply["outputs"]
    assert (labels["shape"], labels["data"]) == ([2, 2], ["dark", "bright", "dark", "bright"])
    assert top["shape"] == [2, 1] and all(entry.endswith(":1:bright") for entry in top["data"])
    status, _, body = _rest(mesh, "POST", "/v2/models/toy-classifier/infer", _json_image(value=5))
    probabilities = json.loads(body)["outputs"][0]
    assert (status, probabilities["name"], probabilities["shape"]) == (200, "PROBABILITIES", [2])
    assert probabilities["data"][0] > probabilities["data"][1]


def test_rest_infer_binary_tensor_extension(mesh):
    header = json.dumps({"inputs": [{"name": "IMAGE", "datatype": "UINT8", "shape": [1, 2, 2, 3],
                                     "parameters": {"binary_data_size": 12}}],
                         "outputs": [{"name": "PROBABILITIES", "parameters": {"binary_data": True}}]}).encode()
    status, headers, body = _rest(mesh, "POST", "/v2/models/toy-classifier/infer", header + BRIGHT_PIXELS,
                                  headers={"Inference-Header-Content-Length": str(len(header))})
    assert status == 200
    length = int(headers["Inference-Header-Content-Length"])
    described = json.loads(body[:length])["outputs"][0]
    assert (described["shape"], described["parameters"]) == ([1, 2], {"binary_data_size": 8})
    dark, bright = _floats(body[length:])
    assert bright > dark


@pytest.mark.parametrize(
    ("method", "path", "body", "key", "status", "message"),
    [
        ("GET", "/v2/models/toy-classifier", None, None, 401,
         "missing API key: send metadata 'authorization: Bearer <key>'"),
        ("GET", "/v2/models/toy-classifier", None, "wrong", 401, "invalid API key"),
        ("GET", "/v2/models/toy-classifier/config", None, "text-key", 403,
         "tenant 'text' may not use model 'toy-classifier'"),
        ("GET", "/v2/models/nope", None, "vision-key", 403, "tenant 'vision' may not use model 'nope'"),
        ("POST", "/v2/models/nope/infer", _json_image(), "any-key", 404, "model 'nope' is not served here"),
        ("GET", "/v2/models/nope/versions/1/config", None, "any-key", 404, "model 'nope:1' is not served here"),
        ("GET", "/v2/nowhere", None, "vision-key", 404, "GET /v2/nowhere: Not Found"),
        ("DELETE", "/v2/models/toy-classifier", None, "vision-key", 405,
         "DELETE /v2/models/toy-classifier: Method Not Allowed"),
        ("POST", "/v2/models/toy-classifier/infer", b"{not json", "vision-key", 400,
         "the request body is not valid JSON: Expecting property name enclosed in double quotes: "
         "line 1 column 2 (char 1)"),
        ("POST", "/v2/models/toy-classifier/infer", b"{not json", None, 401,
         "missing API key: send metadata 'authorization: Bearer <key>'"),
        ("POST", "/v2/models/toy-classifier/infer", {"inputs": []}, "vision-key", 400,
         "'inputs' must be a non-empty list of tensors"),
        ("POST", "/v2/models/toy-classifier/infer", _json_image((2, 6)), "vision-key", 400,
         "input 'IMAGE' UINT8 shape must be [N, H, W, C] or [H, W, C] with N, H, W >= 1 and C in 1, 3, 4; "
         "got [2, 6]"),
        ("POST", "/v2/models/toy-classifier/infer", _json_image((9, 1, 1, 3)), "vision-key", 400,
         "input 'IMAGE' holds 9 images; model toy-classifier:1 takes at most 8 per request (its max_batch_size)"),
        ("POST", "/v2/models/toy-classifier/infer", _json_image(value=300), "vision-key", 400,
         "inputs[0] ('IMAGE'): a value is out of range for UINT8"),
        ("POST", "/v2/models/toy-classifier/infer", _json_image(datatype="FP32"), "vision-key", 400,
         "input 'IMAGE' has datatype FP32; expected UINT8 (HWC pixels) or BYTES (a PNG or JPEG file)"),
        ("POST", "/v2/models/toy-generator/infer", _json_image(), "text-key", 400,
         "model toy-generator:1 is a generator (decoupled): use ModelStreamInfer for it; "
         "ModelInfer serves classifier models"),
    ],
)
def test_rest_refusals_are_kserve_error_bodies_with_http_codes(mesh, method, path, body, key, status, message):
    got_status, headers, raw = _rest(mesh, method, path, body, key=key)
    assert (got_status, json.loads(raw)) == (status, {"error": message})
    assert headers["Content-Type"].startswith("application/json")


def test_rest_statistics_and_repository_index(mesh):
    _rest(mesh, "POST", "/v2/models/toy-classifier/infer", _json_image())
    status, _, body = _rest(mesh, "GET", "/v2/models/toy-classifier/stats")
    (stats,) = json.loads(body)["model_stats"]
    assert status == 200 and stats["name"] == "toy-classifier" and stats["execution_count"] >= 1
    status, _, body = _rest(mesh, "POST", "/v2/repository/index", {"ready": True}, key="text-key")
    assert (status, json.loads(body)) == (200, [{"name": "toy-generator", "version": "1", "state": "READY"}])
