"""The Conversations API through the real HTTP front (openai_http.py over HttpServer, plaintext on a free
127.0.0.1 port), with the fake generator that answers with the conversation it was given, so a test
reads what a turn in a conversation sent upstream; two tenants; a store small enough to fill. The
store's own bounds are test_response_store.py's; the shapes' are test_openai_conversations.py's.
"""

# ruff: noqa: F811 (the tests take the fixtures imported from openai_http_support by name)
from __future__ import annotations

import asyncio

import aiohttp
import pytest

from tests.unit.gateway.openai_http_support import (
    ALPHA,
    BETA,
    STORE_BYTES,
    base,  # noqa: F401 (a fixture)
    call,
    core,  # noqa: F401 (a fixture)
    create,
    stateless_base,  # noqa: F401 (a fixture)
)


async def _conversation(base: str, key: str = ALPHA, **body) -> dict:
    status, reply = await call("POST", base + "/conversations", body, key)
    assert status == 200, reply
    return reply


async def _items(base: str, conversation_id: str) -> list[dict]:
    status, page = await call("GET", f"{base}/conversations/{conversation_id}/items?order=asc&limit=100")
    assert status == 200, page
    return page["data"]


def _texts(items: list[dict]) -> list[tuple[str, str]]:
    return [(i["role"], i["content"][0]["text"]) for i in items]


def _text(response: dict) -> str:
    return response["output"][0]["content"][0]["text"]


async def test_a_conversation_is_created_retrieved_updated_and_deleted(base):
    made = await _conversation(base, metadata={"topic": "demo"}, items=[{"role": "user", "content": "Hi"}])
    assert made["id"].startswith("conv_") and made["object"] == "conversation"
    assert (made["metadata"], type(made["created_at"])) == ({"topic": "demo"}, int)
    assert await call("GET", f"{base}/conversations/{made['id']}") == (200, made)
    status, changed = await call("POST", f"{base}/conversations/{made['id']}", {"metadata": {"topic": "other"}})
    assert (status, changed) == (200, {**made, "metadata": {"topic": "other"}})
    assert (await call("POST", f"{base}/conversations/{made['id']}", {"metadata": None}))[1]["metadata"] == {}
    assert await call("DELETE", f"{base}/conversations/{made['id']}") == \
        (200, {"id": made["id"], "object": "conversation.deleted", "deleted": True})
    for method, path in (("GET", ""), ("DELETE", ""), ("GET", "/items")):
        status, reply = await call(method, f"{base}/conversations/{made['id']}{path}")
        assert (status, reply["error"]["param"]) == (404, "conversation_id") and made["id"] in reply["error"]["message"]


async def test_items_are_added_listed_paged_retrieved_and_deleted(base):
    made = await _conversation(base, items=[{"role": "user", "content": "one"}])
    status, added = await call("POST", f"{base}/conversations/{made['id']}/items", {"items": [
        {"type": "message", "role": "assistant", "content": "two"},
        {"role": "user", "content": [{"type": "input_text", "text": "three"}]}]})
    assert (status, added["object"], added["has_more"]) == (200, "list", False)
    assert [i["id"] for i in added["data"]] == [added["first_id"], added["last_id"]]
    items = await _items(base, made["id"])
    assert _texts(items) == [("user", "one"), ("assistant", "two"), ("user", "three")]
    assert items[1] == {**added["data"][0], "content": [{"type": "output_text", "text": "two"}]}
    assert all(i["status"] == "completed" and i["type"] == "message" for i in items)
    status, newest = await call("GET", f"{base}/conversations/{made['id']}/items?limit=2")  # desc by default
    assert (status, newest["data"], newest["has_more"]) == (200, items[:0:-1], True)
    status, rest = await call("GET", f"{base}/conversations/{made['id']}/items?limit=2&after={newest['last_id']}")
    assert (rest["data"], rest["has_more"]) == ([items[0]], False)
    assert await call("GET", f"{base}/conversations/{made['id']}/items/{items[1]['id']}") == (200, items[1])
    assert await call("DELETE", f"{base}/conversations/{made['id']}/items/{items[1]['id']}") == (200, made)
    assert _texts(await _items(base, made["id"])) == [("user", "one"), ("user", "three")]
    status, reply = await call("GET", f"{base}/conversations/{made['id']}/items/{items[1]['id']}")
    assert (status, reply["error"]["param"]) == (404, "item_id") and items[1]["id"] in reply["error"]["message"]


async def test_a_response_in_a_conversation_continues_its_items_and_adds_its_own(base):
    made = await _conversation(base, items=[{"role": "user", "content": "Hi"}])
    first = await create(base, input="And?", conversation=made["id"])
    assert (_text(first), first["conversation"]) == ("user:Hi\nuser:And?", {"id": made["id"]})
    items = await _items(base, made["id"])
    assert _texts(items) == [("user", "Hi"), ("user", "And?"), ("assistant", "user:Hi\nuser:And?")]
    assert items[-1] == first["output"][0]
    second = await create(base, input="More", conversation={"id": made["id"]}, instructions="Be terse.")
    assert _text(second) == "system:Be terse.\nuser:Hi\nuser:And?\nassistant:user:Hi\nuser:And?\nuser:More"
    assert len(await _items(base, made["id"])) == 5
    status, listed = await call("GET", f"{base}/responses/{second['id']}/input_items?order=asc")
    assert (status, listed["data"][:3]) == (200, items)  # the conversation's items come first, as OpenAI lists them


async def test_a_response_not_stored_still_adds_its_items_to_its_conversation(base):
    made = await _conversation(base)
    response = await create(base, input="Hi", conversation=made["id"], store=False)
    assert response["store"] is False
    assert (await call("GET", f"{base}/responses/{response['id']}"))[0] == 404
    assert _texts(await _items(base, made["id"])) == [("user", "Hi"), ("assistant", "user:Hi")]


async def test_a_failed_response_adds_nothing_to_its_conversation(base):
    made = await _conversation(base)
    assert b"response.failed" in await _posted_stream(base, input="FAIL", conversation=made["id"])
    assert await _items(base, made["id"]) == []


async def test_a_streamed_response_adds_its_items_once(base):
    made = await _conversation(base)
    assert b"response.completed" in await _posted_stream(base, input="Hi", conversation=made["id"])
    assert _texts(await _items(base, made["id"])) == [("user", "Hi"), ("assistant", "user:Hi")]


async def _posted_stream(base: str, **body) -> bytes:
    async with aiohttp.ClientSession() as session, session.post(
            base + "/responses", json={"model": "m", "stream": True, **body},
            headers={"Authorization": f"Bearer {ALPHA}"}) as reply:
        return await reply.read()


async def test_a_background_stream_adds_its_items_once_it_completes(base, core):
    made = await _conversation(base)
    posted = asyncio.create_task(_posted_stream(base, input="HOLD", conversation=made["id"], background=True))
    await core.holding.wait()
    assert await _items(base, made["id"]) == []  # not before it completes
    core.release.set()
    # Its stream ends once its log is closed, after it was kept again with all its events (a second keep).
    assert b"response.completed" in await posted
    assert _texts(await _items(base, made["id"])) == [("user", "HOLD"), ("assistant", "user:HOLD")]


async def test_conversation_with_previous_response_id_or_unknown_is_refused_naming_it(base):
    made = await _conversation(base)
    first = await create(base, input="Hi")
    status, reply = await call("POST", base + "/responses", {"model": "m", "input": "x", "conversation": made["id"],
                                                             "previous_response_id": first["id"]})
    assert (status, reply["error"]["param"]) == (400, "conversation") and "mutually exclusive" in \
        reply["error"]["message"]
    status, reply = await call("POST", base + "/responses", {"model": "m", "input": "x",
                                                             "conversation": "conv_0123456789abcdef"})
    assert (status, reply["error"]["param"]) == (404, "conversation")
    status, reply = await call("POST", base + "/responses", {"model": "m", "input": "x", "conversation": 5})
    assert (status, reply["error"]["param"]) == (400, "conversation")


async def test_another_tenant_gets_404s_for_every_use_of_a_conversation_it_did_not_create(base):
    mine = await _conversation(base, items=[{"role": "user", "content": "secret"}])
    item_id = (await _items(base, mine["id"]))[0]["id"]
    for method, path, body in (("GET", "", None), ("POST", "", {"metadata": {}}), ("DELETE", "", None),
                               ("GET", "/items", None), ("POST", "/items", {"items": [{"role": "user", "content": "x"}]}),
                               ("GET", f"/items/{item_id}", None), ("DELETE", f"/items/{item_id}", None)):
        status, reply = await call(method, f"{base}/conversations/{mine['id']}{path}", body, BETA)
        assert (status, reply["error"]["param"]) == (404, "conversation_id"), (method, path, reply)
    status, reply = await call("POST", base + "/responses", {"model": "m", "input": "x", "conversation": mine["id"]},
                               BETA)
    assert (status, reply["error"]["param"]) == (404, "conversation")
    assert _texts(await _items(base, mine["id"])) == [("user", "secret")]  # untouched, still the owner's


async def test_without_a_key_a_conversation_is_a_401(base):
    mine = await _conversation(base)
    assert (await call("GET", f"{base}/conversations/{mine['id']}", key=None))[0] == 401
    assert (await call("POST", f"{base}/conversations", {}, key=None))[0] == 401


@pytest.mark.parametrize(("method", "path", "body", "param"), [
    ("POST", "", {"items": "Hi"}, "items"),
    ("POST", "", {"items": [{"role": "user", "content": "x"}] * 21}, "items"),
    ("POST", "", {"items": [{"role": "robot", "content": "x"}]}, "items[0].role"),
    ("POST", "", {"items": [{"type": "input_image"}]}, "items[0].type"),
    ("POST", "", {"items": [{"type": "item_reference", "id": "msg_nope"}]}, "items[0].id"),
    ("POST", "", {"metadata": {"k": 5}}, "metadata"),
    ("POST", "", [], None),
    ("GET", "/conv_", None, "conversation_id"),
    ("GET", "/resp_1", None, "conversation_id"),
    ("POST", "/{id}", {}, "metadata"),
    ("POST", "/{id}/items", {"items": []}, "items"),
    ("POST", "/{id}/items", {}, "items"),
    ("GET", "/{id}/items?limit=0", None, "limit"),
    ("GET", "/{id}/items?order=newest", None, "order"),
    ("GET", "/{id}/items?after=msg_nope", None, "after"),
])
async def test_bad_input_is_a_400_naming_the_field(base, method, path, body, param):
    made = await _conversation(base)
    status, reply = await call(method, base + "/conversations" + path.replace("{id}", made["id"]), body)
    expected = 404 if param == "items[0].id" else 400  # an unknown item_reference, as /v1/responses answers it
    assert (status, reply["error"]["param"]) == (expected, param), reply


async def test_items_that_would_not_fit_in_the_store_are_refused_and_leave_it_as_it_was(base):
    made = await _conversation(base, items=[{"role": "user", "content": "Hi"}])
    status, reply = await call("POST", f"{base}/conversations/{made['id']}/items",
                               {"items": [{"role": "user", "content": "x" * STORE_BYTES}]})
    assert (status, reply["error"]["param"]) == (400, "items") and "too large" in reply["error"]["message"]
    assert _texts(await _items(base, made["id"])) == [("user", "Hi")]


async def test_an_item_reference_adds_the_stored_item_it_names(base):
    response = await create(base, input="Hi")
    made = await _conversation(base, items=[{"type": "item_reference", "id": response["output"][0]["id"]}])
    assert await _items(base, made["id"]) == response["output"]


async def test_without_storing_conversations_say_how_to_turn_it_on(stateless_base):
    status, reply = await call("POST", stateless_base + "/conversations", {})
    assert status == 400 and "--responses-store-bytes" in reply["error"]["message"]
    status, reply = await call("GET", stateless_base + "/conversations/conv_0123456789abcdef")
    assert status == 404 and "--responses-store-bytes" in reply["error"]["message"]
    status, reply = await call("POST", stateless_base + "/responses", {"model": "m", "input": "x",
                                                                       "conversation": "conv_1"})
    assert (status, reply["error"]["param"]) == (400, "conversation")
    assert "--responses-store-bytes" in reply["error"]["message"]
    assert (await call("GET", stateless_base + "/conversations/conv_1", key=None))[0] == 401


async def test_a_response_whose_items_would_not_fit_is_answered_and_leaves_the_conversation_as_it_was(base):
    made = await _conversation(base, items=[{"role": "user", "content": "x" * (STORE_BYTES * 6 // 10)}])
    response = await create(base, input="Hi", conversation=made["id"], store=False)  # its output echoes it all
    assert response["status"] == "completed"
    assert [role for role, _ in _texts(await _items(base, made["id"]))] == ["user"]
