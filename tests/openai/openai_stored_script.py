"""Runs the official `openai` package, unchanged, on the gateway's stored Responses; prints what it saw as JSON.

Run by tests/openai/test_stored_responses.py with .venv-openai's python (the package is not a project
dependency): argv = base_url, keys (JSON name -> key), CA file. Two turns chained with
previous_response_id, a streamed third, retrieve, input_items (paged one by one: the client follows
`after`), delete, and another tenant's attempts at all of them; item_reference items (the owner's
resolved, another tenant's a 404); a background Response polled until done, and one cancelled while it
runs; a background stream read in part, then resumed with `starting_after`; background requests a
rate-limited tenant sends, refused up front. Then a conversation (client.conversations): created with an
item, two turns in it (one streamed), items added, listed (paged: the client follows `after`), retrieved
and deleted, its metadata updated, another tenant's attempts, `conversation` beside
previous_response_id, and its deletion.
"""

from __future__ import annotations

import json
import ssl
import sys
import time

import openai

MODEL = "toy-generator"


def not_found(call) -> dict:
    try:
        call()
    except openai.NotFoundError as err:
        error = err.body if isinstance(err.body, dict) else {}
        error = error.get("error", error)
        return {"status": err.status_code, "param": error.get("param"), "message": error.get("message")}
    return {"status": 200}


def refused(call) -> dict:
    """The HTTP status and error of a call the gateway refuses (200 when it answered)."""
    try:
        call()
    except openai.APIStatusError as err:
        error = err.body if isinstance(err.body, dict) else {}
        error = error.get("error", error)
        return {"status": err.status_code, "param": error.get("param"), "code": error.get("code"),
                "message": error.get("message")}
    return {"status": 200}


def resumed_stream(client: openai.OpenAI) -> dict:
    """A background stream read up to its first text delta (then the connection dropped), resumed after
    the last event seen, and the Response as it ended."""
    first: list = []
    with client.responses.stream(input="abc", background=True, model=MODEL, max_output_tokens=40,
                                 extra_body={"ignore_eos": True}) as stream:
        for event in stream:
            first.append(event)
            if event.type == "response.output_text.delta":
                break
    response_id = first[0].response.id
    rest = list(client.responses.retrieve(response_id, stream=True, starting_after=first[-1].sequence_number))
    events = first + rest
    return {"numbers": [e.sequence_number for e in events], "types": [e.type for e in events],
            "num_first": len(first), "text": "".join(e.delta for e in events if e.type == "response.output_text.delta"),
            "done": polled(client, response_id).model_dump(mode="json")}


def polled(client: openai.OpenAI, response_id: str, timeout_s: float = 30.0):
    """The Response once it is no longer queued or in progress, as the background guide polls it."""
    deadline = time.monotonic() + timeout_s
    response = client.responses.retrieve(response_id)
    while response.status in ("queued", "in_progress") and time.monotonic() < deadline:
        time.sleep(0.05)
        response = client.responses.retrieve(response_id)
    return response


def conversation_turns(alpha: openai.OpenAI, other: openai.OpenAI, turn: dict) -> dict:
    """A conversation as the Agents SDK keeps one: created, continued by Responses, read, changed, deleted."""
    conversation = alpha.conversations.create(metadata={"topic": "toy"}, items=[
        {"type": "message", "role": "user", "content": "abc"}])
    first = alpha.responses.create(input="xyz", conversation=conversation.id, **turn)
    with alpha.responses.stream(input="uvw", conversation={"id": conversation.id}, **turn) as stream:
        second = stream.get_final_response()
    added = alpha.conversations.items.create(conversation.id, items=[{"type": "message", "role": "user",
                                                                      "content": "rst"}])
    added_id = added.data[0].id
    seen = {
        "created": conversation.model_dump(mode="json"),
        "first": first.model_dump(mode="json"), "second": second.model_dump(mode="json"),
        "added": added.model_dump(mode="json"),
        "items": [item.model_dump(mode="json", exclude_none=True) for item in
                  alpha.conversations.items.list(conversation.id, order="asc", limit=2)],
        "item": alpha.conversations.items.retrieve(added_id, conversation_id=conversation.id).model_dump(mode="json"),
        "updated": alpha.conversations.update(conversation.id, metadata={"topic": "done"}).model_dump(mode="json"),
        "other": {
            "retrieve": not_found(lambda: other.conversations.retrieve(conversation.id)),
            "items": not_found(lambda: other.conversations.items.list(conversation.id)),
            "turn": not_found(lambda: other.responses.create(input="x", conversation=conversation.id, **turn)),
        },
        "both": refused(lambda: alpha.responses.create(input="x", conversation=conversation.id,
                                                       previous_response_id=first.id, **turn)),
        "item_deleted": alpha.conversations.items.delete(added_id, conversation_id=conversation.id).model_dump(
            mode="json"),
    }
    seen["num_items_left"] = len(list(alpha.conversations.items.list(conversation.id)))
    seen["deleted"] = alpha.conversations.delete(conversation.id).model_dump(mode="json")
    seen["gone"] = not_found(lambda: alpha.conversations.retrieve(conversation.id))
    seen["kept"] = alpha.conversations.create().id  # left for the metrics
    return seen


def main() -> None:
    base_url, keys, ca_path = sys.argv[1], json.loads(sys.argv[2]), sys.argv[3]
    tls = ssl.create_default_context(cafile=ca_path)

    def client(key: str) -> openai.OpenAI:
        return openai.OpenAI(base_url=base_url, api_key=key, max_retries=0, timeout=30,
                             http_client=openai.DefaultHttpx2Client(verify=tls))

    alpha, other = client(keys["alpha"]), client(keys["cheap"])
    # Each answer ends at the stop string (status completed: the stream helper wants response.completed).
    turn = dict(model=MODEL, max_output_tokens=8, temperature=0, extra_body={"stop": ["d"]})
    first = alpha.responses.create(input="abc", instructions="Be brief.", **turn)
    second = alpha.responses.create(input="xyz", previous_response_id=first.id, **turn)
    with alpha.responses.stream(input="uvw", previous_response_id=second.id, **turn) as stream:
        third = stream.get_final_response()
    seen: dict = {
        "first": first.model_dump(mode="json"), "second": second.model_dump(mode="json"),
        "third": third.model_dump(mode="json"),
        "retrieved": alpha.responses.retrieve(second.id).model_dump(mode="json"),
        "items": [item.model_dump(mode="json", exclude_none=True) for item in
                  alpha.responses.input_items.list(second.id, order="asc", limit=1)],
        "newest": alpha.responses.input_items.list(second.id, limit=2).model_dump(mode="json"),
        "other": {
            "retrieve": not_found(lambda: other.responses.retrieve(second.id)),
            "input_items": not_found(lambda: other.responses.input_items.list(second.id)),
            "delete": not_found(lambda: other.responses.delete(second.id)),
            "chain": not_found(lambda: other.responses.create(input="x", previous_response_id=second.id, **turn)),
        },
    }
    said = second.output[0].id
    seen["referenced"] = alpha.responses.create(input=[{"type": "item_reference", "id": said},
                                                       {"role": "user", "content": "xyz"}], **turn).model_dump(mode="json")
    seen["other_reference"] = not_found(lambda: other.responses.create(
        input=[{"type": "item_reference", "id": said}], **turn))
    queued = alpha.responses.create(input="abc", background=True, **turn)
    seen["background"] = {"queued": queued.status, "done": polled(alpha, queued.id).model_dump(mode="json")}
    # 20 ms a token: still running when cancelled.
    long = alpha.responses.create(input="abc", background=True, model=MODEL, max_output_tokens=400,
                                  extra_body={"ignore_eos": True})
    seen["cancelled"] = {"answered": alpha.responses.cancel(long.id).status,
                         "retrieved": alpha.responses.retrieve(long.id).status,
                         "other": not_found(lambda: other.responses.cancel(queued.id))}
    seen["resumed"] = resumed_stream(alpha)
    limited = client(keys["ratelimited"])  # 0.2 requests/s, a burst of 1: one of three at most is let in
    seen["limited"] = [refused(lambda: limited.responses.create(input="abc", background=True, **turn))
                       for _ in range(3)]
    alpha.responses.delete(first.id)
    seen["after_delete"] = {
        "retrieve": not_found(lambda: alpha.responses.retrieve(first.id)),
        "chain_from_second": alpha.responses.create(input="rst", previous_response_id=second.id,
                                                    **turn).usage.input_tokens,
    }
    seen["conversation"] = conversation_turns(alpha, other, turn)
    print(json.dumps(seen))


if __name__ == "__main__":
    main()
