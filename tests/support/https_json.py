"""POST a JSON body to a mesh's HTTPS front (the session CA trusted) and read the JSON reply, error or
not, or a stream's server-sent events."""

from __future__ import annotations

import json
import ssl
import urllib.error
import urllib.request

from tools.testbed import session_tls


def post_json(base: str, path: str, body: dict) -> tuple[int, dict]:
    """(status, reply) of POST `base + path`; a 4xx/5xx is returned, not raised."""
    return _json_reply(urllib.request.Request(base + path, data=json.dumps(body).encode(),
                                              headers={"Content-Type": "application/json"}, method="POST"))


def get_json(base: str, path: str) -> tuple[int, dict]:
    """(status, reply) of GET `base + path`; a 4xx/5xx is returned, not raised."""
    return _json_reply(urllib.request.Request(base + path, method="GET"))


def _json_reply(request: urllib.request.Request) -> tuple[int, dict]:
    context = ssl.create_default_context(cafile=str(session_tls.session_pki().ca_path))
    try:
        with urllib.request.urlopen(request, timeout=60, context=context) as reply:
            return reply.status, json.loads(reply.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def post_stream(base: str, path: str, body: dict) -> tuple[int, list]:
    """(status, events) of a streamed POST: each event's `data:` JSON (a named event's too: Responses'),
    and "[DONE]" as it is."""
    request = urllib.request.Request(base + path, data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"}, method="POST")
    context = ssl.create_default_context(cafile=str(session_tls.session_pki().ca_path))
    with urllib.request.urlopen(request, timeout=60, context=context) as reply:
        raw = reply.read().decode()
    events = [line.removeprefix("data: ") for block in raw.split("\n\n") for line in block.split("\n")
              if line.startswith("data: ")]
    return reply.status, [e if e == "[DONE]" else json.loads(e) for e in events]
