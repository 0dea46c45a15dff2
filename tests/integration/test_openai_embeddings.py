"""/v1/embeddings on decoder-family embedding checkpoints through the whole mesh: tiny random Qwen3 models
saved as sentence-transformers directories (modules.json, 1_Pooling, 2_Normalize; one as the base
Qwen3Model without an LM head), imported and served with a 16-token step budget, so a longer input is a
chunked prefill. Each pooling (last token, mean, CLS) matches transformers' AutoModel last_hidden_state
pooled and normalized here, for one input, a batch, token ids and base64; the stock `openai` client's
embeddings.create works; bad inputs and requests of the other task are 400s naming the field. vLLM's
`messages` (through the chat template) and `truncate_prompt_tokens`; KServe v2 ModelInfer (gRPC and REST)
answering the `embedding` output; a client that disconnects mid-request cancels its inputs and frees
their KV blocks. One mesh for the module: a scheduler, a worker per model, a gateway.
"""

from __future__ import annotations

import base64
import http.client
import json
import ssl
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path

import grpc
import numpy as np
import pytest
import transformers

from inference import grpc_predict_v2_pb2 as kserve
from inference import grpc_predict_v2_pb2_grpc as kserve_grpc
from infermesh.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc
from tests.support.hf_checkpoints import save_model_directory
from tests.support.hf_mesh import run_stock_client, serving_checkpoints
from tests.support.https_json import get_json, post_json
from tests.support.st_checkpoints import reference_embeddings, save_embedding_directory
from tools.testbed import session_tls
from tools.testbed.gateway_fixtures import scrape
from tools.testbed.processes import wait_until
from tools.testbed.scheduler_fixtures import pressure_of, scheduler_stub, wait_for_idle_kv

pytestmark = pytest.mark.integration

SIDE_VENV = ("openai", "openai==3.51.0")  # the venv of tests/openai/test_openai_client.py, built once
SCRIPT = "openai_embeddings_script.py"
# name -> (pooling, normalized, saved as the base model, Matryoshka)
MODELS = {
    "embed-last": ("last", True, False, True),
    "embed-mean": ("mean", True, True, False),
    "embed-cls": ("cls", False, False, False),
}
GENERATOR = "embed-neighbour-generator"
CHUNK_TOKENS = 16  # max_num_batched_tokens: a prompt longer than this prefills in several steps
CONTEXT = 256  # max_position_embeddings of the tiny models (hf_checkpoints.BASE)
LONG = "Every position of this longer input must reach the pooling, one chunk after another, in order. " * 2
TEXTS = ["hello world", "an embedding of a short sentence", LONG]
# float32 on both sides (paged chunks here, one dense forward in transformers): they agree to ~1e-6 on this
# machine; 1e-4 is a bound no CPU's kernels should break, and far below any real difference.
TOLERANCE = 1e-4


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("openai-embeddings")
    for seed, (name, (pooling, normalize, base_model, matryoshka)) in enumerate(MODELS.items()):
        save_embedding_directory(tmp / name, pooling=pooling, normalize=normalize, base_model=base_model,
                                 matryoshka=matryoshka, seed=seed)
    save_model_directory(tmp / GENERATOR, "qwen3", seed=9)
    tokenizer = transformers.AutoTokenizer.from_pretrained(tmp / "embed-last")
    options = {name: {"max_num_batched_tokens": CHUNK_TOKENS} for name in MODELS}
    with serving_checkpoints(tmp, [*MODELS, GENERATOR], options=options) as served:
        yield served, tmp, tokenizer


def reference(served, name: str, prompts: list[list[int]]) -> list[np.ndarray]:
    _, tmp, _ = served
    pooling, normalize, _, _ = MODELS[name]
    return reference_embeddings(tmp / name, prompts, pooling=pooling, normalize=normalize)


def embeddings(served, body: dict) -> tuple[int, dict]:
    return post_json(served[0].base, "/embeddings", body)


def assert_close(got, want) -> None:
    assert np.asarray(got).shape == want.shape
    assert float(np.max(np.abs(np.asarray(got, dtype=np.float64) - want))) <= TOLERANCE


@pytest.mark.parametrize("name", list(MODELS))
def test_each_pooling_matches_transformers_for_one_input_and_a_batch(served, name):
    tokenizer = served[2]
    ids = [tokenizer(text)["input_ids"] for text in TEXTS]
    assert len(ids[-1]) > 2 * CHUNK_TOKENS, "the long input must span several chunks"
    want = reference(served, name, ids)
    status, one = embeddings(served, {"model": name, "input": TEXTS[0]})
    assert status == 200, one
    assert one["object"] == "list" and one["model"] == name
    assert [(d["object"], d["index"]) for d in one["data"]] == [("embedding", 0)]
    assert_close(one["data"][0]["embedding"], want[0])
    assert one["usage"] == {"prompt_tokens": len(ids[0]), "total_tokens": len(ids[0])}
    status, batch = embeddings(served, {"model": name, "input": TEXTS})
    assert status == 200, batch
    assert [d["index"] for d in batch["data"]] == [0, 1, 2]
    for got, expected in zip(batch["data"], want, strict=True):
        assert_close(got["embedding"], expected)
    assert batch["usage"]["prompt_tokens"] == sum(len(i) for i in ids)
    if MODELS[name][1]:
        assert np.linalg.norm(batch["data"][2]["embedding"]) == pytest.approx(1.0, abs=1e-5)


def test_token_id_inputs_and_base64(served):
    ids = [[5, 6, 7], list(range(10, 10 + 3 * CHUNK_TOKENS + 5))]
    want = reference(served, "embed-mean", ids)
    status, reply = embeddings(served, {"model": "embed-mean", "input": ids, "encoding_format": "base64"})
    assert status == 200, reply
    for got, expected in zip(reply["data"], want, strict=True):
        assert_close(np.frombuffer(base64.b64decode(got["embedding"]), dtype="<f4"), expected)
    status, one = embeddings(served, {"model": "embed-mean", "input": ids[1]})
    assert status == 200 and reply["usage"]["prompt_tokens"] == len(ids[0]) + len(ids[1])
    assert_close(one["data"][0]["embedding"], want[1])


def test_dimensions_shorten_a_matryoshka_models_vectors_renormalized(served):
    tokenizer = served[2]
    full = reference(served, "embed-last", [tokenizer(TEXTS[1])["input_ids"]])[0]
    status, reply = embeddings(served, {"model": "embed-last", "input": TEXTS[1], "dimensions": 8})
    assert status == 200, reply
    assert_close(reply["data"][0]["embedding"], full[:8] / np.linalg.norm(full[:8]))


def test_an_input_filling_the_context_is_served_and_one_past_it_is_400_with_both_lengths(served):
    status, reply = embeddings(served, {"model": "embed-cls", "input": [list(range(3, 3 + CONTEXT))]})
    assert status == 200, reply
    status, reply = embeddings(served, {"model": "embed-cls", "input": [[3, 4], list(range(3, 3 + CONTEXT + 1))]})
    assert status == 400
    assert reply["error"]["param"] == "input" and reply["error"]["code"] == "context_length_exceeded", reply
    assert reply["error"]["message"] == (f"input[1] of {CONTEXT + 1} tokens is longer than the model's context of "
                                         f"{CONTEXT} tokens")


@pytest.mark.parametrize(("body", "param", "says"), [
    ({"input": ""}, "input", "must not be empty"),
    ({"input": []}, "input", "must not be an empty list"),
    ({"input": ["a", ""]}, "input", "input[1] must not be empty"),
    ({"input": [[]]}, "input", "must not be empty"),
    ({"input": 5}, "input", "input must be"),
    ({"input": ["a", [1, 2]]}, "input", "not a mix"),
    ({"input": [[1, -2]]}, "input", "input[0][1] must be a token id"),
    ({}, "input", "input is required"),
    ({"input": "a", "encoding_format": "hex"}, "encoding_format", "encoding_format must be one of"),
    ({"input": "a", "dimensions": 0}, "dimensions", "dimensions must be an integer >= 1"),
    ({"input": "a", "dimensions": "8"}, "dimensions", "dimensions must be an integer >= 1"),
    ({"input": "a", "model": 3}, "model", "model must be"),
    ({"input": [[100000]]}, "input", "input"),  # past the vocabulary: the scheduler's refusal, renamed
])
def test_bad_inputs_are_400_naming_the_field(served, body, param, says):
    status, reply = embeddings(served, {"model": "embed-mean", **body})
    assert status == 400, reply
    assert reply["error"]["param"] == param
    assert says in reply["error"]["message"]


def test_each_task_refuses_the_other_with_a_400(served):
    status, reply = embeddings(served, {"model": "embed-mean", "input": "a", "dimensions": 8})
    assert (status, reply["error"]["param"]) == (400, "dimensions"), reply
    assert "not a Matryoshka model" in reply["error"]["message"]
    status, reply = embeddings(served, {"model": GENERATOR, "input": "a"})
    assert (status, reply["error"]["param"]) == (400, "model"), reply
    assert "is not an embedding model" in reply["error"]["message"]
    for path, body in (("/completions", {"prompt": "a"}),
                       ("/chat/completions", {"messages": [{"role": "user", "content": "a"}]})):
        status, reply = post_json(served[0].base, path, {"model": "embed-last", **body})
        assert status == 400, reply
        assert "is an embedding model" in reply["error"]["message"]


def test_an_embedding_past_its_deadline_is_refused_as_a_generation_would_be(served):
    tokenizer = served[2]
    body = json.dumps({"model": "embed-mean", "input": [LONG] * 8}).encode()
    context = ssl.create_default_context(cafile=str(session_tls.session_pki().ca_path))
    request = urllib.request.Request(served[0].base + "/embeddings", data=body, method="POST", headers={
        "Content-Type": "application/json", "x-infermesh-timeout-ms": "1"})
    with pytest.raises(urllib.error.HTTPError) as caught:
        urllib.request.urlopen(request, context=context, timeout=30)
    assert caught.value.code == 504
    assert json.loads(caught.value.read())["error"]["code"] == "deadline_exceeded"
    # The mesh is none the worse for it: the next request is served, and no KV block stays held.
    status, reply = embeddings(served, {"model": "embed-mean", "input": TEXTS[0]})
    assert status == 200, reply
    assert_close(reply["data"][0]["embedding"], reference(served, "embed-mean",
                                                          [tokenizer(TEXTS[0])["input_ids"]])[0])
    with scheduler_stub(served[0].mesh.scheduler.address) as stub:
        wait_for_idle_kv(stub, common_pb2.ModelRef(name="embed-mean", version="1"))


def test_a_batch_past_what_the_gateway_admits_at_once_is_served_in_turns(served):
    """300 sheddable inputs: each is admitted on its own, and sheddable traffic may hold 60% of the model's
    adaptive limit (38 of the default 64), fewer than the 64 inputs a request runs at once. The inputs shed
    while their siblings run wait for one of them to end; only the first is judged on its TTFT target. Before,
    the request's own inputs refused it: a 503 for any batch past the limit's share (58 standard inputs)."""
    tokenizer = served[2]
    texts = [TEXTS[0], TEXTS[1], "a third, different input"]
    body = json.dumps({"model": "embed-mean", "input": [texts[i % 3] for i in range(300)]}).encode()
    context = ssl.create_default_context(cafile=str(session_tls.session_pki().ca_path))
    request = urllib.request.Request(served[0].base + "/embeddings", data=body, method="POST", headers={
        "Content-Type": "application/json", "x-infermesh-priority": "sheddable"})
    with urllib.request.urlopen(request, context=context, timeout=120) as answer:
        assert answer.status == 200
        reply = json.loads(answer.read())
    assert [d["index"] for d in reply["data"]] == list(range(300))
    want = reference(served, "embed-mean", [tokenizer(text)["input_ids"] for text in texts])
    for index in (0, 1, 2, 151, 299):
        assert_close(reply["data"][index]["embedding"], want[index % 3])
    with scheduler_stub(served[0].mesh.scheduler.address) as stub:
        wait_for_idle_kv(stub, common_pb2.ModelRef(name="embed-mean", version="1"))


def test_grpc_embed_reads_no_prefix_cache_and_a_generation_request_is_invalid_argument(served):
    mesh = served[0].mesh
    tokenizer = served[2]
    request = gateway_pb2.GenerateRequest(model=common_pb2.ModelRef(name="embed-mean"), prompt=LONG,
                                          embed=gateway_pb2.EmbedOptions())
    want = reference(served, "embed-mean", [tokenizer(LONG)["input_ids"]])[0]
    with session_tls.channel(mesh.gateway.address) as channel:
        stub = gateway_pb2_grpc.InferenceStub(channel)
        for _ in range(2):  # the second finds the first's blocks in the cache, and must compute every position
            (chunk,) = list(stub.Generate(request, timeout=60))
            assert chunk.finish_reason == common_pb2.FINISH_REASON_STOP
            assert chunk.usage.cached_prompt_tokens == 0 and chunk.usage.completion_tokens == 0
            assert_close(list(chunk.embedding), want)
        with pytest.raises(grpc.RpcError) as caught:
            list(stub.Generate(gateway_pb2.GenerateRequest(model=common_pb2.ModelRef(name="embed-mean"), prompt="a"),
                               timeout=60))
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "is an embedding model" in caught.value.details()
    with session_tls.channel(mesh.gateway.address) as channel:
        listed = gateway_pb2_grpc.InferenceStub(channel).ListModels(gateway_pb2.ListModelsRequest(), timeout=10)
    dimensions = {m.model.name: (m.kind, m.embedding_dimensions) for m in listed.models}
    assert dimensions["embed-mean"] == (common_pb2.MODEL_KIND_GENERATOR, 64)
    assert dimensions[GENERATOR] == (common_pb2.MODEL_KIND_GENERATOR, 0)


def test_the_stock_client_creates_embeddings(served):
    tokenizer = served[2]
    seen = run_stock_client(served[0], SIDE_VENV, Path(__file__).with_name(SCRIPT),
                            "embed-last", {"single": TEXTS[0], "batch": TEXTS, "dimensions": 4})
    ids = [tokenizer(text)["input_ids"] for text in TEXTS]
    want = reference(served, "embed-last", ids)
    assert seen["single"]["indexes"] == [0] and seen["single"]["objects"] == ["embedding"]
    assert seen["single"]["model"] == "embed-last"
    assert seen["single"]["usage"]["prompt_tokens"] == len(ids[0])
    assert_close(seen["single"]["vectors"][0], want[0])
    assert seen["batch"]["indexes"] == [0, 1, 2]
    for got, expected in zip(seen["batch"]["vectors"], want, strict=True):
        assert_close(got, expected)
    assert_close(seen["short"], want[0][:4] / np.linalg.norm(want[0][:4]))
    assert seen["empty"] == {"status": 400, "param": "input"}


def kserve_text(name: str, text: str, **parameters: kserve.InferParameter) -> kserve.ModelInferRequest:
    return kserve.ModelInferRequest(model_name=name, id="k-1", parameters=parameters, inputs=[
        kserve.ModelInferRequest.InferInputTensor(name="text_input", datatype="BYTES", shape=[1],
                                                  contents=kserve.InferTensorContents(bytes_contents=[text.encode()]))])


def test_kserve_model_infer_answers_the_embedding_over_grpc_and_rest(served):
    tokenizer = served[2]
    ids = tokenizer(TEXTS[2])["input_ids"]
    want = reference(served, "embed-mean", [ids])[0]
    with session_tls.channel(served[0].mesh.gateway.address) as channel:
        stub = kserve_grpc.GRPCInferenceServiceStub(channel)
        answer = stub.ModelInfer(kserve_text("embed-mean", TEXTS[2]), timeout=60)
        meta = stub.ModelMetadata(kserve.ModelMetadataRequest(name="embed-mean"), timeout=10)
        config = stub.ModelConfig(kserve.ModelConfigRequest(name="embed-mean"), timeout=10).config
        short = stub.ModelInfer(kserve_text("embed-last", TEXTS[1], dimensions=kserve.InferParameter(int64_param=8)),
                                timeout=60)
    (output,) = answer.outputs
    assert (output.name, output.datatype, list(output.shape), answer.id) == ("embedding", "FP32", [64], "k-1")
    assert_close(np.frombuffer(answer.raw_output_contents[0], dtype="<f4"), want)
    assert answer.parameters["prompt_tokens"].int64_param == len(ids)
    assert [(t.name, t.datatype, list(t.shape)) for t in meta.outputs] == [("embedding", "FP32", [64])]
    assert [(o.name, list(o.dims)) for o in config.output] == [("embedding", [64])]
    assert not config.model_transaction_policy.decoupled
    full = reference(served, "embed-last", [tokenizer(TEXTS[1])["input_ids"]])[0]
    assert_close(np.frombuffer(short.raw_output_contents[0], dtype="<f4"), full[:8] / np.linalg.norm(full[:8]))
    root = served[0].base.removesuffix("/v1")
    status, reply = post_json(root, "/v2/models/embed-mean/infer", {"inputs": [
        {"name": "text_input", "datatype": "BYTES", "shape": [1], "data": [TEXTS[2]]}]})
    assert status == 200, reply
    (output,) = reply["outputs"]
    assert (output["name"], output["datatype"], output["shape"]) == ("embedding", "FP32", [64])
    assert_close(output["data"], want)
    assert reply["parameters"]["prompt_tokens"] == len(ids)
    status, meta = get_json(root, "/v2/models/embed-mean")
    assert status == 200 and meta["outputs"] == [{"name": "embedding", "datatype": "FP32", "shape": [64]}]


@pytest.mark.parametrize(("name", "parameters", "says"), [
    ("embed-mean", {"max_tokens": kserve.InferParameter(int64_param=4)},
     "parameter 'max_tokens' is a generation parameter; model embed-mean:1 is an embedding model"),
    ("embed-mean", {"dimensions": kserve.InferParameter(int64_param=8)}, "parameter 'dimensions': model"),
    ("embed-last", {"dimensions": kserve.InferParameter(int64_param=65)}, "parameter 'dimensions' must be in [1, 64]"),
])
def test_kserve_refusals_name_the_parameter(served, name, parameters, says):
    with session_tls.channel(served[0].mesh.gateway.address) as channel:
        with pytest.raises(grpc.RpcError) as caught:
            kserve_grpc.GRPCInferenceServiceStub(channel).ModelInfer(kserve_text(name, "a", **parameters), timeout=60)
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert says in caught.value.details()


def test_kserve_streaming_refuses_an_embedding_model_and_rest_says_400(served):
    with session_tls.channel(served[0].mesh.gateway.address) as channel:
        responses = list(kserve_grpc.GRPCInferenceServiceStub(channel).ModelStreamInfer(
            iter([kserve_text("embed-mean", "a")]), timeout=60))
    assert [r.error_message for r in responses] == [
        "model embed-mean:1 is an embedding model: send its requests with ModelInfer (REST: /infer), which "
        "answers its 'embedding'"]
    root = served[0].base.removesuffix("/v1")
    status, reply = post_json(root, "/v2/models/embed-mean/infer", {"parameters": {"temperature": 0.5}, "inputs": [
        {"name": "text_input", "datatype": "BYTES", "shape": [1], "data": ["a"]}]})
    assert status == 400 and "parameter 'temperature' is a generation parameter" in reply["error"], reply


CHAT = [{"role": "system", "content": "Represent the query for retrieval"}, {"role": "user", "content": "tiny models"}]


def test_messages_are_rendered_through_the_chat_template_as_vllm_does(served):
    tokenizer = served[2]
    for options, generation in (({}, False), ({"add_generation_prompt": True}, True)):
        text = tokenizer.apply_chat_template(CHAT, add_generation_prompt=generation, tokenize=False)
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]  # the template writes its own, as vLLM's
        status, reply = embeddings(served, {"model": "embed-mean", "messages": CHAT, **options})
        assert status == 200, reply
        assert reply["usage"]["prompt_tokens"] == len(ids)
        assert_close(reply["data"][0]["embedding"], reference(served, "embed-mean", [ids])[0])


def test_truncate_prompt_tokens_keeps_each_inputs_last_tokens(served):
    tokenizer = served[2]
    ids = tokenizer(TEXTS[2])["input_ids"]
    status, reply = embeddings(served, {"model": "embed-cls", "input": [TEXTS[2], TEXTS[0]],
                                        "truncate_prompt_tokens": 10})
    assert status == 200, reply
    want = reference(served, "embed-cls", [ids[-10:], tokenizer(TEXTS[0])["input_ids"][-10:]])
    for got, expected in zip(reply["data"], want, strict=True):
        assert_close(got["embedding"], expected)
    assert reply["usage"]["prompt_tokens"] == 10 + min(10, len(tokenizer(TEXTS[0])["input_ids"]))
    over = list(range(3, 3 + CONTEXT + 7))
    status, reply = embeddings(served, {"model": "embed-cls", "input": [over], "truncate_prompt_tokens": -1})
    assert status == 200 and reply["usage"]["prompt_tokens"] == CONTEXT, reply
    assert_close(reply["data"][0]["embedding"], reference(served, "embed-cls", [over[-CONTEXT:]])[0])
    status, reply = embeddings(served, {"model": "embed-cls", "input": "a", "truncate_prompt_tokens": CONTEXT + 1})
    assert (status, reply["error"]["param"]) == (400, "truncate_prompt_tokens"), reply
    assert f"in [1, {CONTEXT}]" in reply["error"]["message"]


def test_a_conversation_past_the_context_is_400_naming_messages(served):
    status, reply = embeddings(served, {"model": "embed-mean", "messages": [{"role": "user", "content": LONG * 4}]})
    assert status == 400 and reply["error"]["param"] == "messages", reply
    assert reply["error"]["code"] == "context_length_exceeded"


def test_a_client_that_disconnects_cancels_its_embeddings_and_their_kv_blocks_are_freed(served):
    """The client closes its connection while its inputs are running: the gateway's handler is cancelled
    (handler_cancellation), which cancels every input's Generate; the scheduler aborts their sequences,
    counts them CANCELLED and frees their KV blocks; the mesh then serves the next request as before."""
    model = common_pb2.ModelRef(name="embed-mean", version="1")

    def counted(code: str) -> float:
        return scrape(served[0].metrics_port).value("infermesh_scheduler_requests_total", model="embed-mean",
                                                    code=code)

    before = {code: counted(code) for code in ("OK", "CANCELLED")}
    num_inputs = 48  # each fills the context: 16 chunks of 16 tokens, far more steps than the cancel takes
    body = json.dumps({"model": "embed-mean", "input": [list(range(3, 3 + CONTEXT))] * num_inputs})
    url = urllib.parse.urlsplit(served[0].base)
    connection = http.client.HTTPSConnection(url.hostname, url.port, timeout=60, context=ssl.create_default_context(
        cafile=str(session_tls.session_pki().ca_path)))
    with scheduler_stub(served[0].mesh.scheduler.address) as stub:
        try:
            connection.request("POST", "/v1/embeddings", body=body, headers={"Content-Type": "application/json"})
            wait_until(lambda: (pressure_of(stub, model) or common_pb2.ModelPressure()).kv_usage > 0, timeout_s=30,
                       interval_s=0.01, message="the inputs running")
        finally:
            connection.close()  # the client goes away before any answer
        wait_for_idle_kv(stub, model, timeout_s=30)
    wait_until(lambda: counted("CANCELLED") > before["CANCELLED"], timeout_s=10, message="inputs counted cancelled")
    cancelled, served_ok = counted("CANCELLED") - before["CANCELLED"], counted("OK") - before["OK"]
    assert cancelled >= 1 and cancelled + served_ok <= num_inputs, (cancelled, served_ok)
    tokenizer = served[2]
    status, reply = embeddings(served, {"model": "embed-mean", "input": TEXTS[1]})
    assert status == 200, reply
    assert_close(reply["data"][0]["embedding"], reference(served, "embed-mean", [tokenizer(TEXTS[1])["input_ids"]])[0])
    with scheduler_stub(served[0].mesh.scheduler.address) as stub:
        wait_for_idle_kv(stub, model)
