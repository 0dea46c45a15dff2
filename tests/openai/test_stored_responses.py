"""Stored Responses through the whole mesh of tests/openai/conftest.py (its gateway runs with
--responses-store-bytes), as the official `openai` package uses them: turns chained with
previous_response_id reach the model as one conversation (the toy model's byte-level template makes
every prompt's token count exact), retrieve, input_items, delete, another tenant's 404s, item_reference
items, background Responses polled and cancelled, a background stream resumed after the last event its
client saw, and background requests refused up front; and a conversation (the Conversations API)
created, continued by Responses, read, changed and deleted.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from tests.openai.conftest import KEYS
from tests.openai.test_openai_client import SIDE_VENV
from tests.support.side_venv import side_venv_python
from tools.testbed.gateway_fixtures import scrape
from tools.testbed.scheduler_fixtures import toy_continuation

pytestmark = pytest.mark.integration

SCRIPT = Path(__file__).with_name("openai_stored_script.py")
# Every turn's answer: the toy continues the template's last character (a, b, c, ...) up to the stop string "d".
ANSWER = toy_continuation("assistant:", 3)


@pytest.fixture(scope="module")
def seen(http_mesh) -> dict:
    done = subprocess.run([str(side_venv_python(*SIDE_VENV)), str(SCRIPT), http_mesh.base_url, json.dumps(KEYS),
                           http_mesh.ca_path], capture_output=True, text=True, timeout=90)
    assert done.returncode == 0, done.stderr + http_mesh.mesh.logs()
    return json.loads(done.stdout)


def _prompt_tokens(*lines: str) -> int:
    """The byte-level template's length for these `role: content` lines, then `assistant:`."""
    return len("".join(f"{line}\n" for line in lines).encode()) + len("assistant:")


def test_chained_turns_reach_the_model_as_one_conversation_without_earlier_instructions(seen):
    first, second, third = seen["first"], seen["second"], seen["third"]
    assert first["usage"]["input_tokens"] == _prompt_tokens("system: Be brief.", "user: abc")
    assert second["usage"]["input_tokens"] == _prompt_tokens("user: abc", f"assistant: {ANSWER}", "user: xyz")
    assert third["usage"]["input_tokens"] == _prompt_tokens("user: abc", f"assistant: {ANSWER}", "user: xyz",
                                                            f"assistant: {ANSWER}", "user: uvw")
    assert (second["previous_response_id"], third["previous_response_id"]) == (first["id"], second["id"])
    assert all(r["store"] and r["status"] == "completed" for r in (first, second, third))
    assert third["output"][0]["content"][0]["text"] == ANSWER


def test_a_stored_response_is_retrieved_as_answered_and_lists_its_input_items(seen):
    assert seen["retrieved"] == seen["second"]
    items = seen["items"]  # asc, one page at a time
    assert [(i["type"], i["role"]) for i in items] == [("message", "user"), ("message", "assistant"),
                                                       ("message", "user")]
    assert items[0]["content"] == [{"type": "input_text", "text": "abc"}]
    assert items[1]["id"] == seen["first"]["output"][0]["id"]
    newest = seen["newest"]
    assert [i["content"][0]["text"] for i in newest["data"]] == ["xyz", ANSWER]
    assert newest["has_more"] is True


def test_another_tenant_gets_a_404_for_everything_and_the_owner_keeps_the_chain_after_a_delete(seen):
    for what, refused in seen["other"].items():
        assert refused["status"] == 404, what
        assert seen["second"]["id"] in refused["message"], what
    assert seen["other"]["chain"]["param"] == "previous_response_id"
    assert seen["after_delete"]["retrieve"]["status"] == 404
    # The first turn's deletion leaves the second's context whole.
    assert seen["after_delete"]["chain_from_second"] == _prompt_tokens(
        "user: abc", f"assistant: {ANSWER}", "user: xyz", f"assistant: {ANSWER}", "user: rst")


def test_a_background_response_is_polled_until_done_and_one_still_running_is_cancelled(seen, http_mesh):
    background = seen["background"]
    assert background["queued"] == "queued"
    done = background["done"]
    assert (done["status"], done["background"], done["output"][0]["content"][0]["text"]) == \
        ("completed", True, ANSWER)
    assert seen["cancelled"]["answered"] == seen["cancelled"]["retrieved"] == "cancelled"
    assert seen["cancelled"]["other"]["status"] == 404
    http_mesh.wait_idle()  # the cancelled generation's sequence and blocks are gone upstream


def test_an_item_reference_sends_the_stored_item_and_another_tenant_cannot_name_it(seen):
    referenced = seen["referenced"]
    assert referenced["usage"]["input_tokens"] == _prompt_tokens(f"assistant: {ANSWER}", "user: xyz")
    assert referenced["status"] == "completed"
    refused = seen["other_reference"]
    assert (refused["status"], refused["param"]) == (404, "input[0].id")
    assert seen["second"]["output"][0]["id"] in refused["message"]


def test_a_background_stream_resumed_after_its_last_seen_event_misses_nothing_and_repeats_nothing(seen):
    resumed = seen["resumed"]
    assert resumed["numbers"] == list(range(len(resumed["numbers"])))
    assert 0 < resumed["num_first"] < len(resumed["numbers"])
    assert resumed["types"][0] == "response.created" and resumed["types"][-1] == "response.incomplete"
    done = resumed["done"]
    assert (done["status"], done["background"], done["usage"]["output_tokens"]) == ("incomplete", True, 40)
    assert done["output"][0]["content"][0]["text"] == resumed["text"]


def test_a_background_request_over_its_tenants_quota_is_refused_up_front(seen):
    limited = seen["limited"]
    refusals = [r for r in limited if r["status"] != 200]
    assert len(refusals) >= 2, limited
    assert all((r["status"], r["code"]) == (429, "rate_limit_exceeded") for r in refusals), limited


def test_the_gateway_reports_what_it_keeps(seen, http_mesh):
    metrics = scrape(http_mesh.gateway_metrics_port)
    # The script's: second, third, the background one, the cancelled one and the last turn (first: deleted).
    assert metrics.value("infermesh_gateway_responses_stored") >= 5
    assert 0 < metrics.value("infermesh_gateway_responses_stored_bytes") <= 1_000_000


def test_turns_in_a_conversation_reach_the_model_after_its_items_and_add_their_own(seen):
    conversation = seen["conversation"]
    conversation_id = conversation["created"]["id"]
    assert conversation["created"]["object"] == "conversation" and conversation_id.startswith("conv_")
    assert conversation["created"]["metadata"] == {"topic": "toy"}
    first, second = conversation["first"], conversation["second"]
    assert first["usage"]["input_tokens"] == _prompt_tokens("user: abc", "user: xyz")
    assert second["usage"]["input_tokens"] == _prompt_tokens("user: abc", "user: xyz", f"assistant: {ANSWER}",
                                                             "user: uvw")
    assert first["conversation"] == second["conversation"] == {"id": conversation_id}
    items = conversation["items"]  # asc, two a page
    assert [(i["role"], i["content"][0]["text"]) for i in items] == [
        ("user", "abc"), ("user", "xyz"), ("assistant", ANSWER), ("user", "uvw"), ("assistant", ANSWER),
        ("user", "rst")]
    assert items[2]["id"] == first["output"][0]["id"]
    assert conversation["item"] == conversation["added"]["data"][0] and conversation["item"]["id"] == items[5]["id"]


def test_a_conversation_is_updated_its_items_deleted_and_it_is_deleted(seen):
    conversation = seen["conversation"]
    conversation_id = conversation["created"]["id"]
    assert conversation["updated"] == {**conversation["created"], "metadata": {"topic": "done"}}
    assert conversation["item_deleted"]["id"] == conversation_id and conversation["num_items_left"] == 5
    assert conversation["deleted"] == {"id": conversation_id, "object": "conversation.deleted", "deleted": True}
    assert conversation["gone"]["status"] == 404 and conversation_id in conversation["gone"]["message"]


def test_another_tenant_cannot_use_a_conversation_and_previous_response_id_beside_it_is_a_400(seen):
    conversation = seen["conversation"]
    for what, refused in conversation["other"].items():
        assert refused["status"] == 404 and conversation["created"]["id"] in refused["message"], what
    assert conversation["other"]["turn"]["param"] == "conversation"
    assert (conversation["both"]["status"], conversation["both"]["param"]) == (400, "conversation")


def test_the_gateway_reports_the_conversations_it_keeps(seen, http_mesh):
    metrics = scrape(http_mesh.gateway_metrics_port)
    assert metrics.value("infermesh_gateway_conversations_stored") == 1  # the one left; the other was deleted
