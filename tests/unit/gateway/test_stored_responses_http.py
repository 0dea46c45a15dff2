"""Stored Responses through the real HTTP front (openai_http.py over HttpServer, plaintext on a free
127.0.0.1 port): a fake generator that answers with the conversation it was given, so a test reads
what a chained turn sent upstream, and holds a conversation saying HOLD until the test releases it
(a background Response still running); two tenants; a store small enough to fill. Expiry and
eviction are the store's own tests (test_response_store.py, on a fake clock); here they are seen
through HTTP.
"""

# ruff: noqa: F811 (the tests take the fixtures imported from openai_http_support by name)
from __future__ import annotations

import asyncio
import json
import time

import aiohttp
import pytest

from services.gateway.fronts.openai_stored_http import StoredResponses
from services.gateway.fronts.response_store import ResponseStore
from tests.unit.gateway.openai_http_support import (
    ALPHA,
    BETA,
    STORE_BYTES,
    TENANTS,
    base,  # noqa: F401 (a fixture)
    call,
    core,  # noqa: F401 (a fixture)
    create,
    serve,
    stateless_base,  # noqa: F401 (a fixture)
)


async def _stream(base: str, **body) -> list[dict]:
    async with aiohttp.ClientSession() as session, session.post(
            base + "/responses", json={"model": "m", "stream": True, **body},
            headers={"Authorization": f"Bearer {ALPHA}"}) as reply:
        raw = (await reply.read()).decode()
    return [json.loads(line.removeprefix("data: ")) for line in raw.split("\n") if line.startswith("data: ")]


def _text(response: dict) -> str:
    return response["output"][0]["content"][0]["text"]


async def test_a_second_turn_sends_the_first_ones_input_and_output_upstream_without_its_instructions(base):
    first = await create(base, input="Hi", instructions="Be terse.")
    assert (first["store"], first["previous_response_id"], _text(first)) == (True, None, "system:Be terse.\nuser:Hi")
    second = await create(base, input="And?", previous_response_id=first["id"])
    assert _text(second) == "user:Hi\nassistant:system:Be terse.\nuser:Hi\nuser:And?"
    assert (second["previous_response_id"], second["store"]) == (first["id"], True)


async def test_a_stored_response_is_retrieved_listed_and_deleted(base):
    first = await create(base, input="Hi")
    second = await create(base, input=[{"role": "user", "content": "And?"}], previous_response_id=first["id"])
    assert await call("GET", f"{base}/responses/{second['id']}") == (200, second)
    status, page = await call("GET", f"{base}/responses/{second['id']}/input_items?order=asc")
    assert status == 200
    assert [(i["type"], i.get("role")) for i in page["data"]] == [("message", "user"), ("message", "assistant"),
                                                                 ("message", "user")]
    assert page["data"][1] == first["output"][0] and page["data"][2]["content"] == [{"type": "input_text",
                                                                                      "text": "And?"}]
    status, newest = await call("GET", f"{base}/responses/{second['id']}/input_items?limit=1")
    assert (status, newest["data"], newest["has_more"]) == (200, [page["data"][2]], True)
    assert await call("DELETE", f"{base}/responses/{first['id']}") == \
        (200, {"id": first["id"], "object": "response.deleted", "deleted": True})
    status, reply = await call("GET", f"{base}/responses/{first['id']}")
    assert status == 404 and first["id"] in reply["error"]["message"]
    assert (await call("DELETE", f"{base}/responses/{first['id']}"))[0] == 404
    third = await create(base, input="More", previous_response_id=second["id"])  # the deleted turn is in the context
    assert _text(third).startswith("user:Hi\nassistant:")


async def test_another_tenant_gets_404s_for_every_use_of_a_response_it_did_not_store(base):
    mine = await create(base, input="secret")
    for method, path in (("GET", ""), ("GET", "/input_items"), ("DELETE", "")):
        status, reply = await call(method, f"{base}/responses/{mine['id']}{path}", key=BETA)
        assert (status, reply["error"]["type"]) == (404, "invalid_request_error"), (method, path, reply)
    status, reply = await call("POST", base + "/responses", {"model": "m", "input": "x",
                                                              "previous_response_id": mine["id"]}, BETA)
    assert (status, reply["error"]["param"]) == (404, "previous_response_id")
    unknown = await call("GET", f"{base}/responses/resp_0123456789abcdef", key=BETA)
    assert unknown[1]["error"]["message"].replace("resp_0123456789abcdef", mine["id"]) == reply["error"]["message"]
    assert (await call("GET", f"{base}/responses/{mine['id']}"))[0] == 200  # still the owner's


async def test_without_a_key_a_stored_response_is_a_401(base):
    mine = await create(base, input="Hi")
    assert (await call("GET", f"{base}/responses/{mine['id']}", key=None))[0] == 401


async def test_store_false_is_answered_and_not_kept(base):
    response = await create(base, input="Hi", store=False)
    assert response["store"] is False
    assert (await call("GET", f"{base}/responses/{response['id']}"))[0] == 404


async def test_a_response_too_large_for_the_store_is_served_saying_it_was_not_stored(base):
    response = await create(base, input="x" * STORE_BYTES)
    assert response["store"] is False and response["status"] == "completed"
    assert (await call("GET", f"{base}/responses/{response['id']}"))[0] == 404


async def test_a_full_store_pushes_out_the_least_recently_used(base):
    first = await create(base, input="a" * 2000)
    for _ in range(5):
        await create(base, input="b" * 2000)
    assert (await call("GET", f"{base}/responses/{first['id']}"))[0] == 404


async def test_a_finished_stream_is_stored_as_its_last_event_says(base):
    events = await _stream(base, input="Hi")
    final = events[-1]
    assert (final["type"], final["response"]["store"]) == ("response.completed", True)
    status, stored = await call("GET", f"{base}/responses/{final['response']['id']}")
    assert (status, stored) == (200, final["response"])
    chained = await create(base, input="And?", previous_response_id=stored["id"])
    assert _text(chained) == "user:Hi\nassistant:user:Hi\nuser:And?"


async def test_a_stream_that_fails_is_stored_failed_and_cannot_be_continued(base):
    events = await _stream(base, input="FAIL")
    failed = events[-1]["response"]
    assert (events[-1]["type"], failed["status"], failed["store"]) == ("response.failed", "failed", True)
    assert (await call("GET", f"{base}/responses/{failed['id']}"))[1]["status"] == "failed"
    status, reply = await call("POST", base + "/responses", {"model": "m", "input": "x",
                                                              "previous_response_id": failed["id"]})
    assert (status, reply["error"]["param"]) == (400, "previous_response_id")


@pytest.mark.parametrize(("method", "path", "param"), [
    ("GET", "/responses/msg_1", "response_id"),
    ("DELETE", "/responses/resp_a.b", "response_id"),
    ("GET", "/responses/{id}/input_items?limit=0", "limit"),
    ("GET", "/responses/{id}/input_items?limit=x", "limit"),
    ("GET", "/responses/{id}/input_items?order=newest", "order"),
    ("GET", "/responses/{id}/input_items?after=msg_nope", "after"),
    ("GET", "/responses/{id}?stream=true", "stream"),
])
async def test_bad_ids_and_list_parameters_are_400s_naming_them(base, method, path, param):
    mine = await create(base, input="Hi")
    status, reply = await call(method, base + path.format(id=mine["id"]))
    assert (status, reply["error"]["param"]) == (400, param), reply


async def test_an_unknown_previous_response_is_a_404_naming_it(base):
    status, reply = await call("POST", base + "/responses", {"model": "m", "input": "x",
                                                              "previous_response_id": "resp_nothere"})
    assert (status, reply["error"]["param"]) == (404, "previous_response_id")
    assert "'resp_nothere' not found" in reply["error"]["message"]


async def test_without_storing_nothing_is_kept_and_previous_response_id_says_how_to_turn_it_on(stateless_base):
    response = await create(stateless_base, input="Hi")
    assert response["store"] is False
    status, reply = await call("GET", f"{stateless_base}/responses/{response['id']}")
    assert status == 404 and "--responses-store-bytes" in reply["error"]["message"]
    status, reply = await call("POST", stateless_base + "/responses", {"model": "m", "input": "x",
                                                                        "previous_response_id": response["id"]})
    assert (status, reply["error"]["param"]) == (400, "previous_response_id")
    assert "--responses-store-bytes" in reply["error"]["message"]
    assert (await call("DELETE", f"{stateless_base}/responses/{response['id']}"))[0] == 404
    assert (await call("GET", f"{stateless_base}/responses/{response['id']}", key="bad"))[0] == 401


# ------------------------------------------------------------------------------------ background


async def _polled(base: str, response_id: str, timeout_s: float = 5.0) -> dict:
    """GET the Response until it is no longer queued or in progress, as a client polls it."""
    deadline = time.monotonic() + timeout_s
    while True:
        status, response = await call("GET", f"{base}/responses/{response_id}")
        assert status == 200, response
        if response["status"] not in ("queued", "in_progress") or time.monotonic() > deadline:
            return response
        await asyncio.sleep(0.01)


async def test_a_background_response_is_answered_queued_and_polled_until_done(base, core):
    queued = await create(base, input="HOLD", background=True)
    assert (queued["status"], queued["background"], queued["output"], queued["store"]) == ("queued", True, [], True)
    await core.holding.wait()
    status, running = await call("GET", f"{base}/responses/{queued['id']}")
    assert (status, running["status"]) == (200, "in_progress")
    status, reply = await call("POST", base + "/responses", {"model": "m", "input": "x",
                                                              "previous_response_id": queued["id"]})
    assert (status, reply["error"]["param"]) == (400, "previous_response_id")
    assert "still running" in reply["error"]["message"]
    core.release.set()
    done = await _polled(base, queued["id"])
    assert (done["status"], _text(done), done["background"]) == ("completed", "user:HOLD", True)
    chained = await create(base, input="And?", previous_response_id=done["id"])
    assert _text(chained) == "user:HOLD\nassistant:user:HOLD\nuser:And?"


async def test_cancelling_a_running_background_response_stops_its_generation(base, core):
    queued = await create(base, input="HOLD", background=True)
    await core.holding.wait()
    status, cancelled = await call("POST", f"{base}/responses/{queued['id']}/cancel")
    assert (status, cancelled["status"], cancelled["output"]) == (200, "cancelled", [])
    assert core.num_abandoned == 1
    assert (await call("GET", f"{base}/responses/{queued['id']}"))[1]["status"] == "cancelled"
    assert await call("POST", f"{base}/responses/{queued['id']}/cancel") == (200, cancelled)  # twice: the same
    status, reply = await call("POST", base + "/responses", {"model": "m", "input": "x",
                                                              "previous_response_id": queued["id"]})
    assert (status, reply["error"]["param"]) == (400, "previous_response_id")


async def test_cancelling_a_finished_background_response_answers_it_as_it_ended(base):
    queued = await create(base, input="Hi", background=True)
    done = await _polled(base, queued["id"])
    assert await call("POST", f"{base}/responses/{queued['id']}/cancel") == (200, done)


async def test_deleting_a_running_background_response_cancels_it(base, core):
    queued = await create(base, input="HOLD", background=True)
    await core.holding.wait()
    assert (await call("DELETE", f"{base}/responses/{queued['id']}"))[1]["deleted"] is True
    assert core.num_abandoned == 1
    assert (await call("GET", f"{base}/responses/{queued['id']}"))[0] == 404


async def test_a_background_response_that_fails_is_kept_failed_with_its_error(base):
    queued = await create(base, input="FAIL", background=True)
    failed = await _polled(base, queued["id"])
    assert (failed["status"], failed["output"]) == ("failed", [])
    assert failed["error"] == {"code": "server_error", "message": "the worker went away"}


async def test_a_background_response_that_meets_a_bug_ends_failed_and_the_bug_is_logged(base, caplog):
    queued = await create(base, input="BUG", background=True)
    failed = await _polled(base, queued["id"])
    assert (failed["status"], failed["error"]["code"]) == ("failed", "server_error")
    assert f"background response {queued['id']} failed" in caplog.text and "RuntimeError: a bug" in caplog.text


async def test_a_background_response_too_large_to_keep_ends_failed_saying_so(base):
    queued = await create(base, input="y" * (STORE_BYTES // 2), background=True)
    failed = await _polled(base, queued["id"])
    assert failed["status"] == "failed" and "--responses-store-bytes" in failed["error"]["message"]


async def test_closing_the_front_cancels_the_background_responses_still_running(core):
    store = ResponseStore(STORE_BYTES, ttl_s=3600)
    server, url = await serve(core, StoredResponses(store, lambda a: TENANTS.authenticate(a).tenant_id))
    queued = await create(url, input="HOLD", background=True)
    await core.holding.wait()
    await server.close()
    assert core.num_abandoned == 1
    assert store.get("alpha", queued["id"]).response["status"] == "cancelled"


@pytest.mark.parametrize(("body", "message"), [
    ({"background": True, "store": False}, "need store: true"),
    ({"background": "yes"}, "background must be true or false"),
])
async def test_what_cannot_run_in_the_background_is_a_400_naming_background(base, body, message):
    status, reply = await call("POST", base + "/responses", {"model": "m", "input": "x", **body})
    assert (status, reply["error"]["param"]) == (400, "background"), reply
    assert message in reply["error"]["message"]


async def test_only_background_responses_can_be_cancelled(base, stateless_base):
    response = await create(base, input="Hi")
    status, reply = await call("POST", f"{base}/responses/{response['id']}/cancel")
    assert status == 400 and "only background responses can be cancelled" in reply["error"]["message"]
    status, reply = await call("POST", stateless_base + "/responses", {"model": "m", "input": "x",
                                                                        "background": True})
    assert (status, reply["error"]["param"]) == (400, "background")
    assert "--responses-store-bytes" in reply["error"]["message"]


# ------------------------------------------------------------------------------------ item references


async def test_an_item_reference_sends_the_stored_item_upstream_and_is_listed_as_that_item(base):
    first = await create(base, input="Hi")
    (said,) = first["output"]
    second = await create(base, input=[{"type": "item_reference", "id": said["id"]},
                                        {"role": "user", "content": "And?"}])
    assert _text(second) == "assistant:user:Hi\nuser:And?"
    status, page = await call("GET", f"{base}/responses/{second['id']}/input_items?order=asc")
    assert status == 200 and page["data"][0] == said
    input_id = (await call("GET", f"{base}/responses/{first['id']}/input_items"))[1]["data"][0]["id"]
    third = await create(base, input=[{"id": input_id}])  # the type may be left out, as OpenAI's may
    assert _text(third) == "user:Hi"


async def test_another_tenants_item_or_an_unknown_one_is_a_404_naming_it(base, stateless_base):
    mine = await create(base, input="secret")
    item_id = mine["output"][0]["id"]
    for key, wanted in ((BETA, item_id), (ALPHA, "msg_unknown")):
        status, reply = await call("POST", base + "/responses", {
            "model": "m", "input": [{"type": "item_reference", "id": wanted}]}, key)
        assert (status, reply["error"]["param"]) == (404, "input[0].id"), reply
        assert f"item with id '{wanted}' not found" in reply["error"]["message"]
    status, reply = await call("POST", base + "/responses", {"model": "m", "input": [{"type": "item_reference"}]})
    assert (status, reply["error"]["param"]) == (400, "input[0].id")
    status, reply = await call("POST", stateless_base + "/responses", {
        "model": "m", "input": [{"type": "item_reference", "id": item_id}]})
    assert (status, reply["error"]["param"]) == (400, "input[0].type") and "storing is off" in reply["error"]["message"]


# ------------------------------------------------------------------------------------ background streams


def _sse(raw: str) -> list[dict]:
    return [json.loads(line.removeprefix("data: ")) for line in raw.split("\n") if line.startswith("data: ")]


async def _get_stream(base: str, response_id: str, query: str = "") -> tuple[int, list[dict] | dict]:
    async with aiohttp.ClientSession() as session, session.get(
            f"{base}/responses/{response_id}?stream=true{query}", headers={"Authorization": f"Bearer {ALPHA}"}) as reply:
        raw = (await reply.read()).decode()
        return reply.status, (_sse(raw) if reply.status == 200 else json.loads(raw))


async def test_a_background_stream_resumed_after_its_last_seen_event_gets_exactly_the_missing_ones(base, core):
    seen: list[dict] = []
    async with aiohttp.ClientSession() as session, session.post(
            base + "/responses", json={"model": "m", "input": "HOLD", "background": True, "stream": True},
            headers={"Authorization": f"Bearer {ALPHA}"}) as reply:
        assert reply.status == 200 and reply.headers["Content-Type"] == "text/event-stream"
        async for line in reply.content:  # the client reads up to the first delta, then loses its connection
            if line.startswith(b"data: "):
                seen.append(json.loads(line[len(b"data: "):]))
                if seen[-1]["type"] == "response.output_text.delta":
                    break
    response_id = seen[0]["response"]["id"]
    await core.holding.wait()
    assert (await call("GET", f"{base}/responses/{response_id}"))[1]["status"] == "in_progress"
    core.release.set()  # it runs on without its client
    status, rest = await _get_stream(base, response_id, f"&starting_after={seen[-1]['sequence_number']}")
    assert status == 200 and core.num_abandoned == 0
    numbers = [e["sequence_number"] for e in seen + rest]
    assert numbers == list(range(len(numbers)))  # none twice, none lost
    assert rest[-1]["type"] == "response.completed"
    assert _text(rest[-1]["response"]) == "user:HOLD"
    assert (await _get_stream(base, response_id))[1] == seen + rest  # replayed whole once it ended
    assert (await _get_stream(base, response_id, f"&starting_after={numbers[-1]}"))[1] == []
    done = (await call("GET", f"{base}/responses/{response_id}"))[1]
    assert (done["status"], done["background"], done == rest[-1]["response"]) == ("completed", True, True)


async def test_a_background_stream_that_fails_ends_with_response_failed_for_every_reader(base):
    status, events = await _post_stream(base, input="FAIL")
    assert status == 200 and events[-1]["type"] == "response.failed"
    assert events[-1]["response"]["error"]["message"] == "the worker went away"
    assert (await _get_stream(base, events[0]["response"]["id"]))[1] == events


async def test_streaming_what_kept_no_events_or_from_a_bad_point_is_a_400_naming_it(base):
    plain = await create(base, input="Hi")
    status, reply = await _get_stream(base, plain["id"])
    assert (status, reply["error"]["param"]) == (400, "stream") and "no events to stream" in reply["error"]["message"]
    for query, param in (("?stream=maybe", "stream"), ("?starting_after=2", "starting_after"),
                         ("?stream=true&starting_after=-5", "starting_after")):
        status, reply = await call("GET", f"{base}/responses/{plain['id']}{query}")
        assert (status, reply["error"]["param"]) == (400, param), query


async def _post_stream(base: str, **body) -> tuple[int, list[dict] | dict]:
    async with aiohttp.ClientSession() as session, session.post(
            base + "/responses", json={"model": "m", "background": True, "stream": True, **body},
            headers={"Authorization": f"Bearer {ALPHA}"}) as reply:
        raw = (await reply.read()).decode()
        return reply.status, (_sse(raw) if reply.status == 200 else json.loads(raw))


@pytest.mark.parametrize("stream", [False, True])
async def test_a_background_request_refused_at_admission_is_answered_so_and_nothing_is_kept(stream, core):
    store = ResponseStore(STORE_BYTES, ttl_s=3600)
    server, url = await serve(core, StoredResponses(store, lambda a: TENANTS.authenticate(a).tenant_id))
    try:
        async with aiohttp.ClientSession() as session, session.post(
                url + "/responses", json={"model": "m", "input": "REFUSE", "background": True, "stream": stream},
                headers={"Authorization": f"Bearer {ALPHA}"}) as answered:
            status, headers, reply = answered.status, answered.headers, await answered.json()
    finally:
        await server.close()
    assert (status, reply["error"]["code"], headers["Retry-After"]) == (429, "rate_limit_exceeded", "2"), reply
    assert "over its request rate quota" in reply["error"]["message"]
    assert store.num_responses == 0


async def test_a_background_stream_past_the_stores_bound_says_which_events_it_no_longer_keeps(base, core):
    async with aiohttp.ClientSession() as session, session.post(
            base + "/responses", json={"model": "m", "input": "HOLD" + "y" * 6000, "background": True, "stream": True},
            headers={"Authorization": f"Bearer {ALPHA}"}) as reply:
        await core.holding.wait()
        core.release.set()  # its last events (the text four times over) outgrow the bound at once
        events = _sse((await reply.read()).decode())
    assert reply.status == 200 and events[0]["type"] == "response.created"
    assert (events[-1]["type"], events[-1]["code"], events[-1]["param"]) == ("error", "events_dropped", "starting_after")
    assert events[-1]["sequence_number"] == events[-2]["sequence_number"] + 1  # where the hole begins
    response_id = events[0]["response"]["id"]
    done = await _polled(base, response_id)
    assert done["status"] == "completed" and done["store"] is True  # kept, without its events
    status, reply_body = await _get_stream(base, response_id)
    assert (status, reply_body["error"]["param"]) == (400, "stream")
