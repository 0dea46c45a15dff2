"""The OpenAI-compatible HTTP API's contract, with a plain HTTPS client: every status, error body and header.

Real processes (tests/openai/conftest.py); each refusal is checked for its HTTP status and its
exact `{"error": {"message", "type", "param", "code"}}` body.
"""

from __future__ import annotations

import http.client
import json
import signal
import threading

import pytest

from tests.openai.conftest import KEYS, MODEL
from tools.testbed.gateway_fixtures import spawn_gateway
from tools.testbed.processes import free_port, wait_until
from tools.testbed.scheduler_fixtures import toy_continuation

pytestmark = pytest.mark.integration

CHAT_TEMPLATE_ABC = "user: abc\nassistant:"


def _events(raw: bytes) -> list:
    """The SSE `data:` payloads, JSON-decoded except the final [DONE]."""
    events = []
    for block in raw.decode().split("\n\n"):
        if block.startswith("data: "):
            payload = block.removeprefix("data: ")
            events.append(payload if payload == "[DONE]" else json.loads(payload))
    return events


def _error(status_body: tuple[int, dict, bytes]) -> tuple[int, dict]:
    status, _headers, body = status_body
    return status, json.loads(body)["error"]


# --------------------------------------------------------------------------- served


def test_completion_returns_the_models_text_usage_and_timings(http_mesh):
    status, headers, body = http_mesh.post("/completions", {"model": MODEL, "prompt": "abc", "max_tokens": 6,
                                                            "temperature": 0})
    assert status == 200, body
    reply = json.loads(body)
    assert reply["object"] == "text_completion" and reply["model"] == MODEL
    assert reply["id"] == "cmpl-" + headers["x-request-id"]
    (choice,) = reply["choices"]
    assert (choice["text"], choice["finish_reason"], choice["index"]) == (toy_continuation("abc", 6), "length", 0)
    assert reply["usage"] == {"prompt_tokens": 3, "completion_tokens": 6, "total_tokens": 9,
                              "prompt_tokens_details": {"cached_tokens": 0}}
    stages = {(s["service"], s["stage"]) for s in reply["infermesh"]["timings"]["stages"]}
    assert {("gateway", "admission"), ("scheduler", "queue_wait"), ("worker", "compute")} <= stages
    assert "gateway.admission;dur=" in headers["x-infermesh-timings"]
    assert headers["x-infermesh-timings"].endswith(f"total;dur={reply['infermesh']['timings']['total_us'] / 1000:.3f}")


def test_chat_completion_applies_the_byte_models_template(http_mesh):
    status, _, body = http_mesh.post("/chat/completions", {
        "model": MODEL, "messages": [{"role": "user", "content": [{"type": "text", "text": "abc"}]}],
        "max_completion_tokens": 4, "temperature": 0, "stop": ["zzz"], "seed": 7})
    assert status == 200, body
    reply = json.loads(body)
    assert reply["object"] == "chat.completion" and reply["id"].startswith("chatcmpl-")
    (choice,) = reply["choices"]
    assert choice["message"] == {"role": "assistant", "content": toy_continuation(CHAT_TEMPLATE_ABC, 4),
                                 "reasoning_content": None, "reasoning": None}
    assert reply["usage"]["prompt_tokens"] == len(CHAT_TEMPLATE_ABC.encode())


def test_streamed_completion_sends_chunks_then_usage_then_done(http_mesh):
    status, headers, body = http_mesh.post("/completions", {
        "model": MODEL, "prompt": "abc", "max_tokens": 5, "temperature": 0, "stream": True,
        "stream_options": {"include_usage": True}})
    assert status == 200 and headers["Content-Type"] == "text/event-stream"
    events = _events(body)
    assert events[-1] == "[DONE]"
    *chunks, usage, _done = events
    assert "".join(c["choices"][0]["text"] for c in chunks) == toy_continuation("abc", 5)
    assert [c["choices"][0]["finish_reason"] for c in chunks][-1] == "length"
    assert all(c["usage"] is None for c in chunks) and "timings" in chunks[-1]["infermesh"]
    assert usage["choices"] == [] and usage["usage"] == {"prompt_tokens": 3, "completion_tokens": 5,
                                                          "total_tokens": 8, "prompt_tokens_details": {"cached_tokens": 0}}


def test_streamed_chat_sends_the_role_first_and_no_usage_unless_asked(http_mesh):
    status, _, body = http_mesh.post("/chat/completions", {
        "model": MODEL, "messages": [{"role": "user", "content": "abc"}], "max_tokens": 3, "temperature": 0,
        "stream": True})
    assert status == 200
    *chunks, done = _events(body)
    assert done == "[DONE]" and all("usage" not in c for c in chunks)
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    assert chunks[0]["object"] == "chat.completion.chunk"
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks)
    assert text == toy_continuation(CHAT_TEMPLATE_ABC, 3)


def test_models_lists_the_generators_the_tenant_may_use(http_mesh):
    status, _, body = http_mesh.request("GET", "/models", headers={"Authorization": f"Bearer {KEYS['alpha']}"})
    assert status == 200
    (model,) = json.loads(body)["data"]
    assert (model["id"], model["object"], model["versions"]) == (MODEL, "model", ["1"])
    status, _, body = http_mesh.request("GET", "/models", headers={"Authorization": f"Bearer {KEYS['narrow']}"})
    assert (status, json.loads(body)["data"]) == (200, [])


def test_one_model_is_retrieved_as_listed_and_one_not_listed_is_404(http_mesh):
    alpha, narrow = ({"Authorization": f"Bearer {KEYS[k]}"} for k in ("alpha", "narrow"))
    status, _, body = http_mesh.request("GET", "/models", headers=alpha)
    (listed,) = json.loads(body)["data"]
    status, _, body = http_mesh.request("GET", f"/models/{MODEL}", headers=alpha)
    assert (status, json.loads(body)) == (200, listed)
    for name, headers in (("no-such-model", alpha), ("org/no-such-model", alpha), (MODEL, narrow)):
        assert _error(http_mesh.request("GET", f"/models/{name}", headers=headers)) == (404, {
            "message": f"model '{name}' is not served to this key (GET /v1/models lists those that are)",
            "type": "not_found_error", "param": None, "code": "model_not_found"})
    assert _error(http_mesh.request("GET", f"/models/{MODEL}", headers={}))[0] == 401


# --------------------------------------------------------------------------- 400


@pytest.mark.parametrize(("body", "param", "message"), [
    ({"prompt": "abc"}, "model", "model is required (a model id from GET /v1/models)"),
    ({"model": MODEL}, "prompt", "prompt is required (a string, a list of strings, a list of token ids, or a list "
                                 "of lists of token ids)"),
    ({"model": MODEL, "prompt": ""}, "prompt", "prompt must not be empty"),
    ({"model": MODEL, "prompt": [1, -2]}, "prompt", "prompt[1] must be a token id (an integer >= 0), got -2"),
    ({"model": MODEL, "prompt": "a", "max_tokens": 0}, "max_tokens",
     "max_tokens must be an integer in [1, 1048576], got 0"),
    ({"model": MODEL, "prompt": "a", "max_tokens": 2.5}, "max_tokens",
     "max_tokens must be an integer in [1, 1048576], got 2.5"),
    ({"model": MODEL, "prompt": "a", "temperature": 3}, "temperature", "temperature must be a number in [0, 2], got 3"),
    ({"model": MODEL, "prompt": "a", "temperature": "hot"}, "temperature",
     "temperature must be a number in [0, 2], got 'hot'"),
    ({"model": MODEL, "prompt": "a", "top_p": 0}, "top_p", "top_p must be a number in (0, 1], got 0"),
    ({"model": MODEL, "prompt": "a", "n": 17}, "n", "n must be an integer in [1, 16], got 17"),
    ({"model": MODEL, "prompt": "a", "n": 2, "best_of": 1}, "best_of", "best_of must be >= n (2), got 1"),
    ({"model": MODEL, "prompt": "a", "stop": ["a", "b", "c", "d", "e"]}, "stop",
     "stop must be a non-empty string or a list of up to 4 non-empty strings, got ['a', 'b', 'c', 'd', 'e']"),
    ({"model": MODEL, "prompt": "a", "stop": ""}, "stop",
     "stop must be a non-empty string or a list of up to 4 non-empty strings, got ''"),
    ({"model": MODEL, "prompt": "a", "seed": -1}, "seed", "seed must be an integer in [0, 2**63), got -1"),
    ({"model": MODEL, "prompt": "a", "stream": "yes"}, "stream", "stream must be a boolean, got 'yes'"),
    ({"model": MODEL, "prompt": "a", "stream_options": {"include_usage": True}}, "stream_options",
     "stream_options is only allowed when stream is true"),
    ({"model": MODEL, "prompt": "a", "logprobs": 21}, "logprobs", "logprobs must be an integer in [0, 20], got 21"),
    ({"model": MODEL, "prompt": "a", "logprobs": True}, "logprobs",
     "logprobs must be an integer in [0, 20], got True"),
    ({"model": MODEL, "prompt": "a", "top_logprobs": 2}, "top_logprobs",
     "top_logprobs is a chat parameter; completions take logprobs: <0..20>"),
    ({"model": MODEL + ":", "prompt": "a"}, "model", f"model must be a model id or <id>:<version>, got '{MODEL}:'"),
    ({"model": ":", "prompt": "a"}, "model", "model must be a model id or <id>:<version>, got ':'"),
    ({"model": MODEL, "prompt": "a", "echo": "yes"}, "echo", "echo must be a boolean, got 'yes'"),
    ({"model": MODEL, "prompt": "a", "echo": True, "max_tokens": -1}, "max_tokens",
     "max_tokens must be an integer in [1, 1048576], got -1"),
    ({"model": MODEL, "prompt": "a", "max_tokens": 0}, "max_tokens",
     "max_tokens must be an integer in [1, 1048576], got 0"),
    ({"model": MODEL, "prompt": "a", "prompt_logprobs": 21}, "prompt_logprobs",
     "prompt_logprobs must be an integer in [0, 20], got 21"),
    ({"model": MODEL, "prompt": "a", "prompt_logprobs": -1}, "prompt_logprobs",  # vLLM's whole vocabulary
     "Requested prompt logprobs of -1 (every token of the model's vocabulary), which is greater than max allowed: "
     "20 (vLLM's default max_logprobs); ask for 0..20"),
    ({"model": MODEL, "prompt": "a", "presence_penalty": 2.5}, "presence_penalty",
     "presence_penalty must be a number in [-2, 2], got 2.5"),
    ({"model": MODEL, "prompt": "a", "frequency_penalty": "x"}, "frequency_penalty",
     "frequency_penalty must be a number in [-2, 2], got 'x'"),
    ({"model": MODEL, "prompt": "a", "repetition_penalty": 0}, "repetition_penalty",
     "repetition_penalty must be a number in (0, 2], got 0"),
    ({"model": MODEL, "prompt": "a", "logit_bias": {"a": 5}}, "logit_bias",
     "logit_bias keys must be token ids (non-negative integers), got 'a'"),
    ({"model": MODEL, "prompt": "a", "logit_bias": {"1": 101}}, "logit_bias",
     "logit_bias[1] must be a number in [-100, 100], got 101"),
    # Only the scheduler knows the model's vocabulary; its refusal still names the parameter.
    ({"model": MODEL, "prompt": "a", "logit_bias": {"300": 1}}, "logit_bias",
     "sampling.logit_bias: token id 300 is not a token of this model (ids 0..256)"),
])
def test_bad_completion_parameters_are_400_naming_the_parameter(http_mesh, body, param, message):
    assert _error(http_mesh.post("/completions", body)) == (
        400, {"message": message, "type": "invalid_request_error", "param": param, "code": None})


@pytest.mark.parametrize(("body", "param", "message"), [
    ({"model": MODEL}, "messages", "messages must be a non-empty list of {role, content} objects"),
    ({"model": MODEL, "messages": []}, "messages", "messages must be a non-empty list of {role, content} objects"),
    ({"model": MODEL, "messages": [{"role": "robot", "content": "x"}]}, "messages[0].role",
     "messages[0].role must be one of system, developer, user, assistant, tool, got 'robot'"),
    ({"model": MODEL, "messages": [{"role": "tool", "content": "x"}]}, "messages[0].tool_call_id",
     "messages[0].tool_call_id is required on a tool turn (the call it answers)"),
    ({"model": MODEL, "messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "messages[0].content",
     "messages[0].content parts must be {type: text, text: ...}; images and audio are not supported"),
    ({"model": MODEL, "messages": [{"role": "user", "content": "a"}], "tools": [{"type": "function"}]}, "tools[0]",
     'tools[0] must be {"type": "function", "function": {"name": ..., "parameters": {...}}}'),
    ({"model": MODEL, "messages": [{"role": "user", "content": "a"}], "tools": {"type": "function"}}, "tools",
     'tools must be a list of up to 128 {"type": "function", "function": {...}} objects'),
    ({"model": MODEL, "messages": [{"role": "user", "content": "a"}], "response_format": {"type": "yaml"}},
     "response_format", 'response_format must be {"type": "text"}, {"type": "json_object"} or {"type": '
                        '"json_schema", "json_schema": {"name": ..., "schema": {...}}}, got {\'type\': \'yaml\'}'),
    ({"model": MODEL, "messages": [{"role": "user", "content": "a"}], "guided_regex": "(a"}, "guided_regex",
     'sampling.structured: invalid regex: at 1(8): invalid regex "(a" (in regex): regex parse error:\n    (a\n    ^\n'
     'error: unclosed group\n   1 | start: /(a/\n              ^'),
    ({"model": MODEL, "messages": [{"role": "user", "content": "a"}], "logprobs": 1}, "logprobs",
     "logprobs must be a boolean, got 1"),
    ({"model": MODEL, "messages": [{"role": "user", "content": "a"}], "logprobs": True, "top_logprobs": 21},
     "top_logprobs", "top_logprobs must be an integer in [0, 20], got 21"),
    ({"model": MODEL, "messages": [{"role": "user", "content": "a"}], "top_logprobs": 2}, "top_logprobs",
     "top_logprobs needs logprobs: true"),
    ({"model": MODEL, "messages": [{"role": "user", "content": "a"}], "logprobs": True, "top_logprobs": -1},
     "top_logprobs", "Requested sample logprobs of -1 (every token of the model's vocabulary), which is greater than "
                     "max allowed: 20 (vLLM's default max_logprobs); ask for 0..20"),
    ({"model": MODEL, "messages": [{"role": "user", "content": "a"}], "echo": True}, "echo",
     "echo is a completions parameter (/v1/completions), not a chat one"),
    ({"model": MODEL, "messages": [{"role": "user", "content": "a"}], "prompt_logprobs": 21}, "prompt_logprobs",
     "prompt_logprobs must be an integer in [0, 20], got 21"),
])
def test_bad_chat_parameters_are_400_naming_the_parameter(http_mesh, body, param, message):
    assert _error(http_mesh.post("/chat/completions", body)) == (
        400, {"message": message, "type": "invalid_request_error", "param": param, "code": None})


@pytest.mark.parametrize(("raw", "message"), [
    (b"{not json", "the request body is not valid JSON: Expecting property name enclosed in double quotes: "
                   "line 1 column 2 (char 1)"),
    (b"[1, 2]", "the request body must be a JSON object"),
    # A lone surrogate escape parses in Python but cannot become UTF-8 (it was a 500 from protobuf).
    (b'{"model": "toy-generator", "prompt": "\\ud800"}',
     "the request body holds an unpaired UTF-16 surrogate escape (\\ud800-\\udfff)"),
    # A RecursionError inside json.loads (it was a 500).
    (b"[" * 1000 + b"]" * 1000, "the request body is nested too deeply (more than 64 levels of arrays and objects)"),
])
def test_a_body_that_is_not_a_json_object_is_400(http_mesh, raw, message):
    assert _error(http_mesh.post("/completions", raw)) == (
        400, {"message": message, "type": "invalid_request_error", "param": None, "code": None})


def test_a_prompt_longer_than_the_model_allows_is_400_from_the_scheduler(http_mesh):
    status, error = _error(http_mesh.post("/completions", {"model": MODEL, "prompt": "a" * 600, "max_tokens": 1}))
    # The prompt alone is past the context: it names `prompt`, with OpenAI's code (9505b00).
    assert (status, error["type"], error["param"], error["code"]) == (
        400, "invalid_request_error", "prompt", "context_length_exceeded")
    assert error["message"] == ("prompt of 600 tokens does not fit the model's context of 512 tokens "
                                "(prompt and output together)")


@pytest.mark.parametrize("path", ["/completions", "/chat/completions"])
def test_a_prompt_past_the_context_is_400_not_429_under_a_token_burst_it_would_exceed(http_mesh, path):
    # Held at most the model's context (512 < the tenant's burst of 5000), the request reaches the
    # scheduler, which names both lengths; held at its 100 002 bytes + 2 it met the burst first (429).
    text = "a" * 100_000
    body = {"model": MODEL, "prompt": text} if path == "/completions" else {
        "model": MODEL, "messages": [{"role": "user", "content": text}]}
    status, error = _error(http_mesh.post(path, body, key=KEYS["modest"]))
    prompt_tokens = 100_000 if path == "/completions" else len(f"user: {text}\nassistant:")
    assert (status, error["message"]) == (400, f"prompt of {prompt_tokens} tokens does not fit the model's "
                                               "context of 512 tokens (prompt and output together)")


def test_a_bad_timeout_or_priority_header_is_400(http_mesh):
    body = {"model": MODEL, "prompt": "a", "max_tokens": 1}
    assert _error(http_mesh.post("/completions", body, headers={"x-infermesh-timeout-ms": "soon"})) == (400, {
        "message": "x-infermesh-timeout-ms must be a number of milliseconds, got 'soon'",
        "type": "invalid_request_error", "param": "x-infermesh-timeout-ms", "code": None})
    # float() would take "1_000" (and "1e3", "inf"): the header is plain decimal milliseconds.
    assert _error(http_mesh.post("/completions", body, headers={"x-infermesh-timeout-ms": "1_000"})) == (400, {
        "message": "x-infermesh-timeout-ms must be a number of milliseconds, got '1_000'",
        "type": "invalid_request_error", "param": "x-infermesh-timeout-ms", "code": None})
    assert _error(http_mesh.post("/completions", body, headers={"x-infermesh-priority": "urgent"})) == (400, {
        "message": "x-infermesh-priority must be one of critical, standard, sheddable, got 'urgent'",
        "type": "invalid_request_error", "param": None, "code": None})


# --------------------------------------------------------------------------- 401 / 403 / 404 / 405


@pytest.mark.parametrize(("key", "message"), [
    (None, "missing API key: send metadata 'authorization: Bearer <key>'"),
    ("not-a-key", "invalid API key"),
    # Sent as the byte 0xff, not UTF-8: aiohttp hands it on as a lone surrogate, tenants hash it like any key.
    ("not-a-key\xff", "invalid API key"),
])
def test_missing_or_wrong_key_is_401_even_with_a_bad_body(http_mesh, key, message):
    expected = (401, {"message": message, "type": "authentication_error", "param": None, "code": "invalid_api_key"})
    assert _error(http_mesh.post("/completions", {"model": MODEL, "prompt": "a"}, key=key)) == expected
    assert _error(http_mesh.post("/completions", {"model": MODEL, "n": 3}, key=key)) == expected
    assert _error(http_mesh.post("/embeddings", {"model": MODEL, "input": "a"}, key=key)) == expected
    assert _error(http_mesh.post("/embeddings", {"model": MODEL}, key=key)) == expected
    assert _error(http_mesh.request("GET", "/models", headers={} if key is None else {
        "Authorization": f"Bearer {key}"})) == expected


def test_a_model_the_tenant_may_not_use_is_403(http_mesh):
    assert _error(http_mesh.post("/completions", {"model": MODEL, "prompt": "a"}, key=KEYS["narrow"])) == (403, {
        "message": f"tenant 'narrow' may not use model '{MODEL}'", "type": "permission_error", "param": None,
        "code": "model_not_allowed"})


def test_embeddings_are_admitted_as_generations_are_and_a_generator_refuses_them(http_mesh):
    assert _error(http_mesh.post("/embeddings", {"model": MODEL, "input": "a"}, key=KEYS["narrow"])) == (403, {
        "message": f"tenant 'narrow' may not use model '{MODEL}'", "type": "permission_error", "param": None,
        "code": "model_not_allowed"})
    status, error = _error(http_mesh.post("/embeddings", {"model": MODEL, "input": ["a", "b"]}))
    assert (status, error["param"], error["type"]) == (400, "model", "invalid_request_error")
    assert error["message"].startswith(f"model {MODEL}:") and "is not an embedding model" in error["message"]


def test_an_unknown_model_is_404(http_mesh):
    assert _error(http_mesh.post("/chat/completions", {
        "model": "no-such-model", "messages": [{"role": "user", "content": "a"}]})) == (404, {
            "message": "model 'no-such-model' is not served here", "type": "not_found_error", "param": None,
            "code": "model_not_found"})


def test_unknown_paths_and_methods_answer_in_the_openai_error_shape(http_mesh):
    assert _error(http_mesh.request("GET", "/audio/speech")) == (404, {
        "message": "GET /v1/audio/speech: Not Found", "type": "not_found_error", "param": None, "code": "404"})
    status, headers, body = http_mesh.request("GET", "/completions")
    assert (status, json.loads(body)["error"]["code"], headers["Allow"]) == (405, "405", "POST")


# --------------------------------------------------------------------------- 429 / 503 / 504


def test_over_the_request_quota_is_429_with_retry_after(http_mesh):
    body = {"model": MODEL, "prompt": "a", "max_tokens": 1}
    first = http_mesh.post("/completions", body, key=KEYS["ratelimited"])
    assert first[0] == 200
    status, headers, raw = http_mesh.post("/completions", body, key=KEYS["ratelimited"])
    error = json.loads(raw)["error"]
    assert (status, error["type"], error["code"]) == (429, "rate_limit_error", "rate_limit_exceeded")
    assert error["message"].startswith("tenant 'ratelimited' is over its request rate quota (0.2 requests/s, burst 1)")
    assert 1 <= int(headers["Retry-After"]) <= 5


class _HeldStream:
    """A streamed completion read up to its first event and kept open: one request in flight."""

    def __init__(self, http_mesh, max_tokens: int = 400) -> None:
        host, port = http_mesh.base_url.removeprefix("https://").split("/")[0].split(":")
        self.connection = http.client.HTTPSConnection(host, int(port), context=http_mesh.ssl_context(), timeout=30)
        self.connection.request("POST", "/v1/completions", body=json.dumps({
            "model": MODEL, "prompt": "abc", "max_tokens": max_tokens, "temperature": 0, "stream": True}),
            headers={"Authorization": f"Bearer {KEYS['alpha']}", "Content-Type": "application/json"})
        self.response = self.connection.getresponse()
        assert self.response.status == 200
        self.first_line = self.response.readline()

    def close(self) -> None:
        self.connection.sock.close()  # the client goes away mid-stream
        self.connection.close()


def test_sheddable_traffic_is_503_under_load_and_the_priority_header_lowers_a_class(http_mesh):
    held = _HeldStream(http_mesh)
    try:
        body = {"model": MODEL, "prompt": "a", "max_tokens": 1}
        status, headers, raw = http_mesh.post("/completions", body, key=KEYS["cheap"])
        error = json.loads(raw)["error"]
        assert (status, error["type"], error["code"]) == (503, "overloaded_error", "overloaded"), raw
        assert error["message"].startswith("overloaded: shedding sheddable traffic for model 'toy-generator'")
        assert int(headers["Retry-After"]) >= 1
        # A standard tenant is served at this load, unless it asks to be sheddable.
        assert http_mesh.post("/completions", body)[0] == 200
        assert _error(http_mesh.post("/completions", body, headers={"x-infermesh-priority": "sheddable"}))[0] == 503
    finally:
        held.close()
    http_mesh.wait_idle()


def test_a_disconnect_mid_stream_cancels_the_generation_and_frees_its_blocks(http_mesh):
    held = _HeldStream(http_mesh, max_tokens=450)
    assert held.first_line.startswith(b"data: ")
    wait_until(lambda: http_mesh.kv_usage() > 0, timeout_s=5, message="the stream holds KV blocks")
    held.close()
    # 450 tokens at 20 ms would run 9 s; cancelled, the scheduler frees the blocks within a step or two.
    http_mesh.wait_idle(timeout_s=2.0)


def test_a_disconnect_while_waiting_for_a_whole_completion_frees_its_blocks_too(http_mesh):
    host, port = http_mesh.base_url.removeprefix("https://").split("/")[0].split(":")
    connection = http.client.HTTPSConnection(host, int(port), context=http_mesh.ssl_context(), timeout=30)
    connection.request("POST", "/v1/completions", body=json.dumps({"model": MODEL, "prompt": "abc", "max_tokens": 450}),
                       headers={"Authorization": f"Bearer {KEYS['alpha']}", "Content-Type": "application/json"})
    wait_until(lambda: http_mesh.kv_usage() > 0, timeout_s=5, message="the request holds KV blocks")
    connection.sock.close()
    connection.close()
    http_mesh.wait_idle(timeout_s=2.0)


def test_a_body_over_the_size_limit_is_413_in_the_error_shape(http_mesh):
    status, error = _error(http_mesh.post("/completions", b'{"prompt": "' + b"a" * (8 * 1024 * 1024) + b'"}'))
    assert (status, error["type"], error["code"]) == (413, "invalid_request_error", "413")


def test_a_deadline_too_short_to_start_is_504(http_mesh):
    status, error = _error(http_mesh.post("/completions", {"model": MODEL, "prompt": "a"},
                                          headers={"x-infermesh-timeout-ms": "1"}))
    assert (status, error["type"], error["code"]) == (504, "timeout_error", "deadline_exceeded")
    assert _error(http_mesh.post("/completions", {"model": MODEL, "prompt": "a"},
                                 headers={"x-infermesh-timeout-ms": "0"}))[0] == 504


def test_a_deadline_passing_mid_generation_is_504_and_frees_the_blocks(http_mesh):
    status, error = _error(http_mesh.post("/completions", {"model": MODEL, "prompt": "a", "max_tokens": 400},
                                          headers={"x-infermesh-timeout-ms": "400"}))
    assert (status, error["type"], error["code"]) == (504, "timeout_error", "deadline_exceeded")
    http_mesh.wait_idle()


def test_a_deadline_passing_mid_stream_ends_it_with_an_error_event(http_mesh):
    status, _, body = http_mesh.post("/completions", {
        "model": MODEL, "prompt": "a", "max_tokens": 400, "stream": True}, headers={"x-infermesh-timeout-ms": "400"})
    assert status == 200
    events = _events(body)
    assert "[DONE]" not in events and len(events) > 3
    assert events[-1]["error"]["type"] == "timeout_error"
    http_mesh.wait_idle()


def test_concurrent_requests_over_the_gateways_cap_are_503(http_mesh):
    holders = [_HeldStream(http_mesh), None]
    try:
        # The second stream is admitted as standard (1 in flight < the standard threshold), the third finds 2/2.
        holders[1] = _HeldStream(http_mesh)
        status, error = _error(http_mesh.post("/completions", {"model": MODEL, "prompt": "a", "max_tokens": 1}))
        assert (status, error["type"]) == (503, "service_unavailable_error")
    finally:
        for holder in holders:
            if holder is not None:
                holder.close()
    http_mesh.wait_idle()


def test_many_streams_in_parallel_each_get_their_own_text(http_mesh):
    results: dict[str, str] = {}

    def run(prompt: str) -> None:
        _, _, body = http_mesh.post("/completions", {"model": MODEL, "prompt": prompt, "max_tokens": 8,
                                                     "temperature": 0, "stream": True})
        results[prompt] = "".join(e["choices"][0]["text"] for e in _events(body)[:-1])

    threads = [threading.Thread(target=run, args=(p,)) for p in ("abc", "klm")]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=30)
    assert results == {p: toy_continuation(p, 8) for p in ("abc", "klm")}


def test_sigterm_lets_a_stream_in_flight_finish_then_the_gateway_exits(http_mesh):
    http_port = free_port()
    gateway = spawn_gateway(http_mesh.mesh, "gateway-drained", "--tenants-file",
                            str(http_mesh.mesh.tmp / "tenants.yaml"), "--http-port", str(http_port))
    connection = http.client.HTTPSConnection("127.0.0.1", http_port, context=http_mesh.ssl_context(), timeout=30)
    wait_until(lambda: _models_listed(connection), timeout_s=10, message="the new gateway knows the model")
    connection.request("POST", "/v1/completions", body=json.dumps({
        "model": MODEL, "prompt": "abc", "max_tokens": 40, "temperature": 0, "stream": True}),
        headers={"Authorization": f"Bearer {KEYS['alpha']}", "Content-Type": "application/json"})
    response = response_of(connection)
    first = response.readline()
    gateway.signal(signal.SIGTERM)
    rest = response.read()
    events = _events(first + rest)
    assert events[-1] == "[DONE]"
    assert "".join(e["choices"][0]["text"] for e in events[:-1]) == toy_continuation("abc", 40)
    assert gateway.proc.wait(timeout=10) == 0


def _models_listed(connection: http.client.HTTPSConnection) -> bool:
    connection.request("GET", "/v1/models", headers={"Authorization": f"Bearer {KEYS['alpha']}"})
    return MODEL in response_of(connection).read().decode()


def response_of(connection: http.client.HTTPSConnection) -> http.client.HTTPResponse:
    response = connection.getresponse()
    assert response.status == 200
    return response
