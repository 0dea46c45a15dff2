"""KServe generators get the OpenAI front's sampling options (issue 39) on a Hugging Face checkpoint
through the whole mesh, over gRPC (ModelStreamInfer) and REST (Triton's generate extension):
structured output, logprobs as output tensors, penalties and logit_bias, and refusals naming the
parameter. One mesh for the module: a scheduler, a worker of a tiny Llama checkpoint made here, a
gateway."""

from __future__ import annotations

import json
import re
import struct
from typing import Any

import pytest
import transformers

from inference import grpc_predict_v2_pb2 as kserve
from inference import grpc_predict_v2_pb2_grpc as kserve_grpc
from services.gateway.kserve.codec import unpack_bytes_tensor
from tests.support.hf_checkpoints import save_model_directory
from tests.support.hf_mesh import serving_checkpoints
from tests.support.https_json import post_json, post_stream
from tools.testbed import session_tls

pytestmark = pytest.mark.integration

MODEL = "tiny-kserve"
PROMPT = "Once upon a time"
REGEX = "[0-9]{3}-[a-z]{2}"


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("kserve-sampling")
    save_model_directory(tmp / MODEL, "llama3", seed=5)
    tokenizer = transformers.AutoTokenizer.from_pretrained(tmp / MODEL)
    with serving_checkpoints(tmp, [MODEL]) as served:
        yield served.mesh, served.base.removesuffix("/v1") + f"/v2/models/{MODEL}", tokenizer


def _parameter(value: Any) -> kserve.InferParameter:
    if isinstance(value, bool):
        return kserve.InferParameter(bool_param=value)
    if isinstance(value, int):
        return kserve.InferParameter(int64_param=value)
    if isinstance(value, float):
        return kserve.InferParameter(double_param=value)
    return kserve.InferParameter(string_param=value if isinstance(value, str) else json.dumps(value))


def stream_infer(mesh, **parameters) -> list[kserve.ModelStreamInferResponse]:
    """One request's ModelStreamInfer responses; JSON values go as JSON text, as tritonclient sends them."""
    request = kserve.ModelInferRequest(
        model_name=MODEL, id="k-1", parameters={k: _parameter(v) for k, v in parameters.items()},
        inputs=[kserve.ModelInferRequest.InferInputTensor(
            name="text_input", datatype="BYTES", shape=[1],
            contents=kserve.InferTensorContents(bytes_contents=[PROMPT.encode()]))])
    with session_tls.channel(mesh.gateway.address) as channel:
        stub = kserve_grpc.GRPCInferenceServiceStub(channel)
        return list(stub.ModelStreamInfer(iter([request]), timeout=60))


def _outputs(responses: list[kserve.ModelStreamInferResponse]) -> tuple[dict[str, list], dict]:
    """Every response's outputs joined by name (text joined), and the last one's parameters."""
    joined: dict[str, list] = {}
    for reply in responses:
        assert not reply.error_message, reply.error_message
        response = reply.infer_response
        for tensor, raw in zip(response.outputs, response.raw_output_contents, strict=True):
            if tensor.datatype == "FP32":
                values: list = list(struct.unpack(f"<{len(raw) // 4}f", raw))
            else:
                values = [e.decode() for e in unpack_bytes_tensor(raw)]
            assert list(tensor.shape) == [len(values)]
            joined.setdefault(tensor.name, []).extend(values)
    last = responses[-1].infer_response.parameters
    return joined, {k: getattr(v, v.WhichOneof("parameter_choice")) for k, v in last.items()}


def _text(responses) -> str:
    return "".join(_outputs(responses)[0]["text_output"])


def generate(base: str, **parameters) -> dict:
    status, reply = post_json(base, "/generate", {"text_input": PROMPT, "parameters": parameters})
    assert status == 200, reply
    return reply


def test_guided_regex_output_matches_over_grpc_and_rest_streamed_and_not(served):
    mesh, base, _ = served
    parameters = {"guided_regex": REGEX, "temperature": 1.0, "seed": 5, "max_tokens": 40}
    text = _text(stream_infer(mesh, **parameters))
    assert re.fullmatch(REGEX, text), text
    assert generate(base, **parameters)["text_output"] == text
    status, events = post_stream(base, "/generate_stream", {"text_input": PROMPT, "parameters": parameters})
    assert status == 200 and "".join(e.get("text_output", "") for e in events) == text
    choice = generate(base, guided_choice=["red", "green", "blue"], temperature=1.0, seed=3)["text_output"]
    assert choice in ("red", "green", "blue")


def test_logprobs_are_an_output_tensor_per_token_and_top_logprobs_json_per_position(served):
    mesh, base, _ = served
    outputs, parameters = _outputs(stream_infer(mesh, logprobs=True, top_logprobs=2, max_tokens=6, ignore_eos=True))
    assert parameters["completion_tokens"] == 6
    assert len(outputs["logprobs"]) == len(outputs["top_logprobs"]) == 6
    tops = [json.loads(t) for t in outputs["top_logprobs"]]
    assert all(len(top) == 2 and top[0]["logprob"] >= top[1]["logprob"] for top in tops)
    assert all(lp <= 0 and lp <= top[0]["logprob"] + 1e-3 for lp, top in zip(outputs["logprobs"], tops, strict=True))
    reply = generate(base, logprobs=True, max_tokens=6, ignore_eos=True)
    assert len(reply["logprobs"]) == reply["parameters"]["completion_tokens"] == 6 and "top_logprobs" not in reply
    plain = _outputs(stream_infer(mesh, max_tokens=2))[0]
    assert set(plain) == {"text_output"}


def test_logit_bias_and_penalties_change_greedy_output_as_on_the_openai_front(served):
    mesh, base, tokenizer = served
    forced = tokenizer.convert_tokens_to_ids("e")
    greedy = {"temperature": 0.0, "max_tokens": 16, "ignore_eos": True}
    plain = _text(stream_infer(mesh, **greedy))
    biased = _text(stream_infer(mesh, **greedy, logit_bias={str(forced): 100}))
    assert biased == "e" * 16 != plain
    assert generate(base, **greedy, logit_bias={str(forced): 100})["text_output"] == biased
    penalized = _text(stream_infer(mesh, **greedy, presence_penalty=2.0, frequency_penalty=2.0,
                                   repetition_penalty=2.0))
    assert penalized != plain, "the penalties changed what was sampled"
    assert generate(base, **greedy, presence_penalty=2.0, frequency_penalty=2.0,
                    repetition_penalty=2.0)["text_output"] == penalized


@pytest.mark.parametrize(("parameters", "param", "fragment"), [
    ({"presence_penalty": 5.0}, "presence_penalty", "presence_penalty must be a number in [-2, 2]"),
    ({"top_logprobs": 2}, "top_logprobs", "top_logprobs needs logprobs: true"),
    ({"logit_bias": {"x": 1}}, "logit_bias", "logit_bias keys must be token ids"),
    ({"logit_bias": {"1000000": 1}}, "logit_bias", "token id 1000000 is not a token of this model"),
    ({"guided_regex": "[a-"}, "guided_regex", "sampling.structured: invalid regex"),
    ({"guided_choice": []}, "guided_choice", "guided_choice must be a list of 1 to 256 non-empty strings"),
])
def test_bad_parameters_are_refused_naming_them(served, parameters, param, fragment):
    mesh, base, _ = served
    (reply,) = stream_infer(mesh, **parameters)
    assert reply.infer_response.parameters["status"].string_param == "INVALID_ARGUMENT"
    assert param in reply.error_message and fragment in reply.error_message, reply.error_message
    status, body = post_json(base, "/generate", {"text_input": PROMPT, "parameters": parameters})
    assert status == 400 and param in body["error"] and fragment in body["error"], body
