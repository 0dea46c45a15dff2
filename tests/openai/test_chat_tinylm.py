"""Chat on tinylm, the demo generator, after models brought their own templates (issue 33): the
scheduler renders the byte models' template, so /v1/chat/completions answers exactly what it
answered when the gateway rendered `<role>: <content>` lines and sent them as a prompt, which is
/v1/completions of that text. Real processes: a scheduler, a tinylm worker, a gateway with HTTPS.
"""

from __future__ import annotations

import json

import pytest

from tests.openai.conftest import HttpMesh
from tests.openai.test_http_contract import _events
from tools.testbed import session_tls
from tools.testbed.processes import free_port, running_mesh, wait_until

pytestmark = pytest.mark.integration

MODEL = "tinylm"
MAX_TOKENS = 32
CONVERSATIONS = [
    [{"role": "user", "content": "The Python "}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello"},
     {"role": "assistant", "content": "Hi."}, {"role": "developer", "content": "again"},
     {"role": "user", "content": [{"type": "text", "text": "Grüße "}, {"type": "text", "text": "🙂 {{ x }}\n"}]}],
]


def gateway_chat_prompt_before_issue_33(messages) -> str:
    """The gateway's template as it was (openai_codec.chat_prompt at fae67ec), text parts joined."""
    def text(content):
        return content if isinstance(content, str) else "".join(part["text"] for part in content)
    return "".join(f"{m['role']}: {text(m['content'])}\n" for m in messages) + "assistant:"


@pytest.fixture(scope="module")
def tinylm_mesh(tmp_path_factory):
    http_port = free_port()
    with running_mesh(tmp_path_factory.mktemp("chat-tinylm")) as mesh:
        mesh.start_scheduler()
        mesh.start_worker(MODEL)
        mesh.start_gateway("--http-port", str(http_port), "--pressure-poll-interval-ms", "100")
        served = HttpMesh(mesh, f"https://127.0.0.1:{http_port}/v1", str(session_tls.session_pki().ca_path), 0, 0)
        wait_until(lambda: f'"{MODEL}"' in served.request("GET", "/models")[2].decode(), timeout_s=15,
                   message="tinylm listed")
        yield served


def _post(mesh: HttpMesh, path: str, body: dict) -> dict:
    status, _, reply = mesh.post(path, body, key=None)
    assert status == 200, reply
    return json.loads(reply)


@pytest.mark.parametrize("conversation", range(len(CONVERSATIONS)))
def test_tinylm_chat_is_byte_identical_to_the_gateways_old_template_as_a_completion(tinylm_mesh, conversation):
    messages = CONVERSATIONS[conversation]
    old_prompt = gateway_chat_prompt_before_issue_33(messages)
    for sampling in ({"temperature": 0}, {"temperature": 0.9, "top_p": 0.95, "seed": 1234}):
        chat = _post(tinylm_mesh, "/chat/completions", {"model": MODEL, "messages": messages,
                                                         "max_tokens": MAX_TOKENS, **sampling})
        completion = _post(tinylm_mesh, "/completions", {"model": MODEL, "prompt": old_prompt,
                                                          "max_tokens": MAX_TOKENS, **sampling})
        assert chat["choices"][0]["message"]["content"] == completion["choices"][0]["text"], sampling
        assert chat["choices"][0]["finish_reason"] == completion["choices"][0]["finish_reason"]
        # cached_tokens aside: the completion finds the chat's prompt blocks in the prefix cache.
        assert ({k: chat["usage"][k] for k in ("prompt_tokens", "completion_tokens")}
                == {k: completion["usage"][k] for k in ("prompt_tokens", "completion_tokens")})
        assert chat["usage"]["prompt_tokens"] >= len(old_prompt.encode())  # every byte, and the BOS if any


def test_tinylm_streamed_chat_carries_the_same_text(tinylm_mesh):
    messages = CONVERSATIONS[1]
    status, _, body = tinylm_mesh.post("/chat/completions", {
        "model": MODEL, "messages": messages, "max_tokens": MAX_TOKENS, "temperature": 0, "stream": True}, key=None)
    assert status == 200
    *chunks, done = _events(body)
    streamed = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks)
    completion = _post(tinylm_mesh, "/completions", {"model": MODEL, "max_tokens": MAX_TOKENS, "temperature": 0,
                                                      "prompt": gateway_chat_prompt_before_issue_33(messages)})
    assert done == "[DONE]" and streamed == completion["choices"][0]["text"]
