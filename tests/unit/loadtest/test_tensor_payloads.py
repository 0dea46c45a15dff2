"""Tensor classes: the scenario's `tensor:` block, the seeded payloads made from it, and the KServe
requests (gRPC and REST) that carry them."""

from __future__ import annotations

import json

import grpc
import jsonschema
import numpy as np
import pytest

from inference import grpc_predict_v2_pb2 as kserve
from inference import grpc_predict_v2_pb2_grpc as kserve_grpc
from loadtest.payloads import TensorPayload, make_tensor_pool
from loadtest.records import OK
from loadtest.report_json import SCHEMA_PATH, build_report
from loadtest.runner import LoadRunner, MonotonicClock
from loadtest.scenario import RequestKind, parse_scenario
from loadtest.targets.factory import open_target
from loadtest.targets.kserve_grpc import infer_request
from loadtest.targets.kserve_http import HEADER_LENGTH, infer_body
from loadtest.workload import open_loop_plan

CNN_INPUT = {"name": "x", "datatype": "FP32", "shape": [1, 3, 32, 32], "values": {"dist": "normal", "mean": 0, "std": 1}}


def _tensor_class(**over) -> dict:
    c = {"name": "cnn", "kind": "tensor", "model": "bench-cnn", "slo": {"e2e_ms": 100},
         "tensor": {"inputs": [CNN_INPUT], "num_variants": 4}}
    c.update(over)
    return c


def _scenario(*classes: dict, seed: int = 1, **over):
    doc = {"seed": seed, "duration_s": 1, "load": {"rate_rps": 10}, "tenants": [{"api_key": "k"}],
           "classes": list(classes) or [_tensor_class()]}
    doc.update(over)
    return parse_scenario(doc)


def _pool(scenario) -> tuple[TensorPayload, ...]:
    spec = scenario.classes[0].tensor
    return make_tensor_pool(spec, np.random.default_rng(scenario.seed))


def _array(tensor, dtype: str) -> np.ndarray:
    return np.frombuffer(tensor.raw, dtype).reshape(tensor.shape)


def test_a_tensor_class_makes_seeded_payloads_of_its_declared_shape_and_datatype():
    scenario = _scenario()
    c = scenario.classes[0]
    assert c.kind is RequestKind.TENSOR and c.tensor is not None and c.tensor.num_variants == 4
    pool = _pool(scenario)
    assert len(pool) == 4
    for payload in pool:
        (x,) = payload.inputs
        assert (x.name, x.datatype, x.shape, len(x.raw)) == ("x", "FP32", (1, 3, 32, 32), 3 * 32 * 32 * 4)
    assert pool[0].inputs[0].raw != pool[1].inputs[0].raw  # variants differ
    assert _pool(_scenario()) == pool  # same seed, same bytes
    assert _pool(_scenario(seed=2)) != pool
    values = _array(pool[0].inputs[0], "<f4")
    assert abs(values.mean()) < 0.2 and 0.8 < values.std() < 1.2  # drawn from N(0, 1), 3072 elements


def test_every_datatype_and_value_law_fills_its_range():
    inputs = [
        {"name": "ids", "datatype": "INT64", "shape": [1, 64], "values": {"dist": "uniform", "min": 3, "max": 5}},
        {"name": "pix", "datatype": "UINT8", "shape": [1, 8, 8, 3], "values": {"dist": "normal", "mean": 250, "std": 20}},
        {"name": "mask", "datatype": "BOOL", "shape": [1, 64]},
        {"name": "half", "datatype": "FP16", "shape": [2, 4], "values": {"dist": "uniform", "min": -2, "max": 2}},
        {"name": "bias", "datatype": "FP64", "shape": [1], "values": {"dist": "fixed", "value": 0.5}},
        {"name": "small", "datatype": "INT8", "shape": [1, 16]},
    ]
    scenario = _scenario(_tensor_class(tensor={"inputs": inputs, "num_variants": 1}))
    (payload,) = _pool(scenario)
    ids, pix, mask, half, bias, small = payload.inputs
    assert [t.name for t in payload.inputs] == ["ids", "pix", "mask", "half", "bias", "small"]
    assert set(_array(ids, "<i8").ravel()) == {3, 4, 5}  # inclusive bounds, 64 draws
    assert _array(pix, "|u1").max() == 255  # rounded and clipped to the datatype's range
    assert set(mask.raw) == {0, 1} and len(mask.raw) == 64  # one byte an element, both values drawn
    assert np.all(np.abs(_array(half, "<f2")) <= 2) and len(half.raw) == 2 * 4 * 2
    assert _array(bias, "<f8").tolist() == [0.5]
    assert set(_array(small, "|i1").ravel()) <= set(range(0, 101))  # integers default to 0..100


def test_a_dim_may_be_a_distribution_so_variants_carry_different_shapes():
    seq = {"name": "tokens", "datatype": "INT32", "shape": [1, {"dist": "uniform", "min": 4, "max": 12}]}
    scenario = _scenario(_tensor_class(tensor={"inputs": [seq], "num_variants": 32}))
    shapes = {p.inputs[0].shape for p in _pool(scenario)}
    assert len(shapes) > 1 and all(s[0] == 1 and 4 <= s[1] <= 12 for s in shapes)
    assert all(len(p.inputs[0].raw) == 4 * p.inputs[0].shape[1] for p in _pool(scenario))


def test_the_plan_draws_tensor_payloads_and_keys_them_for_the_senders_cache():
    scenario = _scenario(_tensor_class(share=1), {"name": "img", "kind": "classify", "model": "digits"},
                         duration_s=20)
    plan = [p for p in open_loop_plan(scenario) if p.request_class.name == "cnn"]
    assert plan and all(isinstance(p.payload, TensorPayload) for p in plan)
    by_key = {p.payload_key: p.payload for p in plan}
    assert len(by_key) == 4 and len(set(by_key.values())) == 4  # one key per variant


@pytest.mark.parametrize("cls,message", [
    (_tensor_class(tensor=None), "classes[0].tensor: expected a mapping"),
    ({k: v for k, v in _tensor_class().items() if k != "tensor"}, "classes[0].tensor is required"),
    (_tensor_class(tensor={"inputs": []}), "classes[0].tensor.inputs: at least one input tensor is needed"),
    (_tensor_class(tensor={"inputs": [CNN_INPUT], "batch": 8}), "classes[0].tensor: unknown key(s) ['batch']"),
    (_tensor_class(tensor={"inputs": [CNN_INPUT, CNN_INPUT]}), "classes[0].tensor.inputs: duplicate name(s) ['x']"),
    (_tensor_class(tensor={"inputs": [CNN_INPUT | {"name": ""}]}), "classes[0].tensor.inputs[0].name is required"),
    (_tensor_class(tensor={"inputs": [CNN_INPUT | {"datatype": "FLOAT"}]}),
     "classes[0].tensor.inputs[0].datatype must be one of BOOL, UINT8"),
    (_tensor_class(tensor={"inputs": [CNN_INPUT | {"datatype": "BYTES"}]}),
     "classes[0].tensor.inputs[0].datatype: BYTES inputs are not generated"),
    (_tensor_class(tensor={"inputs": [CNN_INPUT | {"shape": []}]}),
     "classes[0].tensor.inputs[0].shape: at least one dim is needed"),
    (_tensor_class(tensor={"inputs": [CNN_INPUT | {"shape": [1, 0]}]}),
     "classes[0].tensor.inputs[0].shape[1] must be >= 1, got 0"),
    (_tensor_class(tensor={"inputs": [CNN_INPUT | {"shape": [1, -1]}]}),
     "classes[0].tensor.inputs[0].shape[1] must be >= 1, got -1"),
    (_tensor_class(tensor={"inputs": [CNN_INPUT | {"shape": [1024, 1024, 1024]}]}),
     "classes[0].tensor.inputs[0].shape: up to 4294967296 bytes of FP32, more than a request may carry"),
    (_tensor_class(tensor={"inputs": [CNN_INPUT | {"datatype": "UINT8", "values": {"min": -1, "max": 5}}]}),
     "classes[0].tensor.inputs[0].values: -1 is outside UINT8's range [0, 255]"),
    (_tensor_class(tensor={"inputs": [CNN_INPUT | {"values": {"min": 2, "max": 1}}]}),
     "classes[0].tensor.inputs[0].values: max (1) must be >= min (2)"),
    (_tensor_class(tensor={"inputs": [CNN_INPUT | {"values": {"dist": "normal", "min": 0}}]}),
     "classes[0].tensor.inputs[0].values: unknown key(s) ['min']"),
    (_tensor_class(tensor={"inputs": [CNN_INPUT | {"values": {"dist": "zipf"}}]}),
     "classes[0].tensor.inputs[0].values.dist must be one of uniform, normal, fixed"),
    (_tensor_class(tensor={"inputs": [CNN_INPUT | {"values": {"dist": "fixed"}}]}),
     "classes[0].tensor.inputs[0].values: dist fixed needs 'value'"),
    (_tensor_class(tensor={"inputs": [CNN_INPUT | {"datatype": "BOOL", "values": {"dist": "normal"}}]}),
     "classes[0].tensor.inputs[0].values: BOOL elements are uniform"),
    (_tensor_class(tensor={"inputs": [CNN_INPUT | {"datatype": "BOOL", "values": {"dist": "fixed", "value": 2}}]}),
     "classes[0].tensor.inputs[0].values.value of a BOOL input must be 0 or 1"),
    (_tensor_class(image={"size_px": 28}), "classes[0].image applies to classify classes only"),
    (_tensor_class(prompt_len=8), "classes[0].prompt_len applies to generate classes only"),
    (_tensor_class(slo={"ttft_ms": 5}), "classes[0].slo: ttft_ms/tpot_ms apply to generate classes only"),
    ({"kind": "classify", "model": "digits", "tensor": {"inputs": [CNN_INPUT]}},
     "classes[0].tensor applies to tensor classes only"),
])
def test_a_bad_tensor_class_is_refused_naming_the_field(cls, message):
    with pytest.raises(ValueError) as err:
        _scenario(cls)
    assert message in str(err.value)


@pytest.mark.parametrize("url,complaint", [
    ("grpc://127.0.0.1:1", "infermesh.v1 (grpc://127.0.0.1:1) has Classify and Generate only"),
    ("openai+http://127.0.0.1:1/v1", "tensor classes to a kserve+ target"),
])
def test_a_target_without_modelinfer_refuses_a_tensor_class_before_sending(url, complaint):
    with pytest.raises(ValueError, match="class 'cnn' is tensor") as err:
        open_target(url, _scenario(), MonotonicClock(), "t")
    assert complaint in str(err.value)


def test_the_grpc_request_carries_every_input_raw_in_order():
    inputs = [CNN_INPUT, {"name": "scale", "datatype": "INT32", "shape": [1, 2]}]
    (payload,) = _pool(_scenario(_tensor_class(tensor={"inputs": inputs, "num_variants": 1})))
    message = infer_request("bench-cnn", "2", payload)
    assert (message.model_name, message.model_version) == ("bench-cnn", "2")
    assert [(i.name, i.datatype, list(i.shape)) for i in message.inputs] == [
        ("x", "FP32", [1, 3, 32, 32]), ("scale", "INT32", [1, 2])]
    assert list(message.raw_input_contents) == [t.raw for t in payload.inputs]


def test_the_rest_body_is_what_our_gateways_kserve_codec_reads_back():
    from services.gateway.fronts.kserve_http_codec import parse_infer

    inputs = [CNN_INPUT, {"name": "mask", "datatype": "BOOL", "shape": [1, 5]}]
    (payload,) = _pool(_scenario(_tensor_class(tensor={"inputs": inputs, "num_variants": 1})))
    body, header_length = infer_body(payload)
    header = json.loads(body[:header_length])
    assert header["parameters"] == {"binary_data_output": True}  # scores come back binary, as tritonclient asks
    parsed = parse_infer(body, str(header_length), "bench-cnn", "")
    assert parsed.binary_all
    assert [(i.name, i.datatype, list(i.shape)) for i in parsed.request.inputs] == [
        ("x", "FP32", [1, 3, 32, 32]), ("mask", "BOOL", [1, 5])]
    assert list(parsed.request.raw_input_contents) == [t.raw for t in payload.inputs]
    assert HEADER_LENGTH == "Inference-Header-Content-Length"


class _RecordingKServe(kserve_grpc.GRPCInferenceServiceServicer):
    def __init__(self) -> None:
        self.requests: list[kserve.ModelInferRequest] = []

    async def ModelInfer(self, request, context):
        self.requests.append(request)
        reply = kserve.ModelInferResponse(model_name=request.model_name, id=request.id)
        reply.outputs.add(name="probs", datatype="FP32", shape=[1, 10])
        reply.raw_output_contents.append(bytes(40))
        return reply


async def test_a_run_against_kserve_grpc_sends_the_pools_tensors():
    servicer = _RecordingKServe()
    server = grpc.aio.server()
    kserve_grpc.add_GRPCInferenceServiceServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        scenario = _scenario(load={"arrival": "constant", "rate_rps": 20}, target=f"kserve+grpc://127.0.0.1:{port}")
        target = open_target(scenario.target, scenario, MonotonicClock(), "t")
        try:
            result = await LoadRunner(scenario, target).run()
        finally:
            await target.close()
    finally:
        await server.stop(grace=None)
    assert result.records and all(r.status == OK for r in result.records)
    assert len(servicer.requests) == len(result.records)
    pool = {p.payload.inputs[0].raw for p in open_loop_plan(scenario)}  # the runner's own plan
    for request in servicer.requests:
        assert request.model_name == "bench-cnn" and list(request.inputs[0].shape) == [1, 3, 32, 32]
        assert request.raw_input_contents[0] in pool
    assert len({r.id for r in servicer.requests}) == len(servicer.requests)
    report = json.loads(json.dumps(build_report(scenario, result, target=scenario.target,
                                                started_at="2026-11-29T00:00:00+00:00")))
    assert report["meta"]["classes"][0]["kind"] == "tensor" and report["classes"]["cnn"]["stream"] is None
    validator = jsonschema.Draft202012Validator(json.loads(SCHEMA_PATH.read_text()))
    assert not [e.message for e in validator.iter_errors(report)][:3]  # a v1 report like any other


async def test_a_run_against_kserve_http_posts_the_pools_tensors_as_binary():
    from aiohttp import web

    from services.gateway.fronts.kserve_http_codec import parse_infer

    received: list[tuple[str, kserve.ModelInferRequest]] = []

    async def infer(request: web.Request) -> web.Response:
        parsed = parse_infer(await request.read(), request.headers.get(HEADER_LENGTH), "bench-cnn", "")
        received.append((request.path, parsed.request))
        return web.json_response({"model_name": "bench-cnn", "outputs": []})

    app = web.Application()
    app.router.add_post("/v2/models/{name}/infer", infer)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    try:
        scenario = _scenario(load={"arrival": "constant", "rate_rps": 20}, target=f"kserve+http://127.0.0.1:{port}")
        target = open_target(scenario.target, scenario, MonotonicClock(), "t")
        try:
            result = await LoadRunner(scenario, target).run()
        finally:
            await target.close()
    finally:
        await runner.cleanup()
    assert result.records and all(r.status == OK for r in result.records)
    assert len(received) == len(result.records)
    pool = {p.payload.inputs[0].raw for p in open_loop_plan(scenario)}
    for path, request in received:
        assert path == "/v2/models/bench-cnn/infer" and list(request.inputs[0].shape) == [1, 3, 32, 32]
        assert request.raw_input_contents[0] in pool


def test_the_shipped_tensor_scenario_loads_the_tutorials_iris_input():
    from loadtest.scenario import load_scenario

    s = load_scenario("loadtest/scenarios/tensor-iris.yaml")
    assert s.models() == {"iris"} and s.target.startswith("kserve+grpc://")
    shapes = {c.name: [d.low for d in c.tensor.inputs[0].shape] for c in s.classes if c.tensor is not None}
    assert shapes == {"iris-one-row": [1, 4], "iris-eight-rows": [8, 4]}
