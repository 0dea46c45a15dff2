"""The official `openai` package, unchanged, against the gateway's OpenAI-compatible HTTP port.

The package is not a project dependency (its pins are its own), so it runs in its own virtualenv
(`.venv-openai/` at the repository root, built once from PyPI and reused, like
.venv-tritonclient) as a separate process executing `openai_client_script.py` against the mesh
of tests/openai/conftest.py.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from tests.openai.conftest import KEYS, MODEL
from tests.support.side_venv import side_venv_python
from tools.testbed.scheduler_fixtures import toy_continuation

pytestmark = pytest.mark.integration

OPENAI_PIN = "3.51.0"
SIDE_VENV = ("openai", f"openai=={OPENAI_PIN}")  # built in the background from collection on (tests/conftest.py)
SCRIPT = Path(__file__).with_name("openai_client_script.py")
CHAT_ABC = "user: abc\nassistant:"


@pytest.fixture(scope="session")
def openai_python() -> Path:
    return side_venv_python(*SIDE_VENV)


@pytest.fixture(scope="module")
def seen(http_mesh, openai_python) -> dict:
    http_mesh.wait_idle()
    metrics_url = f"http://127.0.0.1:{http_mesh.scheduler_metrics_port}/metrics"
    done = subprocess.run([str(openai_python), str(SCRIPT), http_mesh.base_url, json.dumps(KEYS), http_mesh.ca_path,
                           metrics_url], capture_output=True, text=True, timeout=90)
    assert done.returncode == 0, done.stderr + http_mesh.mesh.logs()
    return json.loads(done.stdout)


def test_lists_the_model_and_retrieves_it(seen):
    assert seen["models"] == [MODEL]
    assert seen["retrieved"] == {"id": MODEL, "object": "model", "owned_by": "infermesh"}
    assert seen["retrieve_missing"] == {"status": 404, "code": "model_not_found"}


def test_completion_and_chat_completion_with_usage(seen):
    assert seen["completion"] == {"text": toy_continuation("abc", 6), "finish_reason": "length",
                                  "usage": {"prompt_tokens": 3, "completion_tokens": 6, "total_tokens": 9,
                                            "completion_tokens_details": None,
                                            "prompt_tokens_details": {"audio_tokens": None, "cache_write_tokens": None,
                                                                      "cached_tokens": 0, "image_tokens": None,
                                                                      "text_tokens": None}},
                                  "object": "text_completion", "has_timings": True}
    chat = seen["chat"]
    assert (chat["content"], chat["role"], chat["finish_reason"]) == (toy_continuation(CHAT_ABC, 4), "assistant",
                                                                      "length")
    assert (chat["usage"]["prompt_tokens"], chat["usage"]["completion_tokens"]) == (len(CHAT_ABC), 4)


def test_streams_with_include_usage(seen):
    stream = seen["stream_completion"]
    assert stream["text"] == toy_continuation("abc", 5)
    assert (stream["usage"]["completion_tokens"], stream["usage"]["total_tokens"]) == (5, 8)
    chat = seen["stream_chat"]
    assert (chat["content"], chat["role"], chat["finish_reason"]) == (toy_continuation(CHAT_ABC, 4), "assistant",
                                                                      "length")
    assert chat["usage"]["completion_tokens"] == 4


@pytest.mark.parametrize(("case", "status", "exception", "kind", "code"), [
    ("400", 400, "BadRequestError", "invalid_request_error", None),
    ("400_chat", 400, "BadRequestError", "invalid_request_error", None),
    ("401", 401, "AuthenticationError", "authentication_error", "invalid_api_key"),
    ("403", 403, "PermissionDeniedError", "permission_error", "model_not_allowed"),
    ("404", 404, "NotFoundError", "not_found_error", "model_not_found"),
    ("429", 429, "RateLimitError", "rate_limit_error", "rate_limit_exceeded"),
    ("503", 503, "InternalServerError", "overloaded_error", "overloaded"),
    ("504", 504, "InternalServerError", "timeout_error", "deadline_exceeded"),
])
def test_each_error_reaches_the_client_as_its_exception(seen, case, status, exception, kind, code):
    error = seen["errors"][case]
    assert (error["status"], error["class"], error["type"], error["code"]) == (status, exception, kind, code)


def test_retry_hints_and_named_parameters(seen):
    errors = seen["errors"]
    assert int(errors["429"]["retry_after"]) >= 1 and int(errors["503"]["retry_after"]) >= 1
    assert (errors["400"]["param"], errors["400_chat"]["param"]) == ("n", "messages")


def test_closing_a_stream_mid_way_frees_its_blocks(seen):
    disconnect = seen["disconnect"]
    assert disconnect["kv_before"] > 0 and disconnect["running_before"] == 1
    # 450 tokens at 20 ms a step would hold the blocks for 9 s; cancelled, they go within a few steps.
    assert disconnect["idle_after_s"] is not None and disconnect["idle_after_s"] < 2.0
