"""Runs the official `openai` package, unchanged, against the gateway's HTTP port; prints what it saw as JSON.

Run by tests/openai/test_openai_client.py with .venv-openai's python (the package is not a project
dependency): argv = base_url, keys (JSON name -> key), CA file, scheduler metrics URL.
"""

from __future__ import annotations

import json
import ssl
import sys
import time
import urllib.request

import openai

MODEL = "toy-generator"


def main() -> None:
    base_url, keys, ca_path, metrics_url = sys.argv[1], json.loads(sys.argv[2]), sys.argv[3], sys.argv[4]
    tls = ssl.create_default_context(cafile=ca_path)

    def client(key: str) -> openai.OpenAI:
        return openai.OpenAI(base_url=base_url, api_key=key, max_retries=0, timeout=30,
                             http_client=openai.DefaultHttpx2Client(verify=tls))

    alpha = client(keys["alpha"])
    seen: dict = {"models": [m.id for m in alpha.models.list()]}
    retrieved = alpha.models.retrieve(MODEL)
    seen["retrieved"] = {"id": retrieved.id, "object": retrieved.object, "owned_by": retrieved.owned_by}
    try:
        alpha.models.retrieve("no-such-model")
    except openai.NotFoundError as exc:
        seen["retrieve_missing"] = {"status": exc.status_code, "code": exc.code}

    completion = alpha.completions.create(model=MODEL, prompt="abc", max_tokens=6, temperature=0)
    seen["completion"] = {"text": completion.choices[0].text, "finish_reason": completion.choices[0].finish_reason,
                          "usage": completion.usage.model_dump(), "object": completion.object,
                          "has_timings": "timings" in (completion.model_extra or {}).get("infermesh", {})}

    chat = alpha.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "abc"}], max_tokens=4,
                                         temperature=0)
    seen["chat"] = {"content": chat.choices[0].message.content, "role": chat.choices[0].message.role,
                    "finish_reason": chat.choices[0].finish_reason, "usage": chat.usage.model_dump()}

    chunks = list(alpha.completions.create(model=MODEL, prompt="abc", max_tokens=5, temperature=0, stream=True,
                                           stream_options={"include_usage": True}))
    seen["stream_completion"] = {"text": "".join(c.choices[0].text for c in chunks if c.choices),
                                 "usage": chunks[-1].usage.model_dump(), "num_chunks": len(chunks)}

    chat_chunks = list(alpha.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "abc"}], max_tokens=4, temperature=0, stream=True,
        stream_options={"include_usage": True}))
    seen["stream_chat"] = {
        "content": "".join(c.choices[0].delta.content or "" for c in chat_chunks if c.choices),
        "role": chat_chunks[0].choices[0].delta.role, "usage": chat_chunks[-1].usage.model_dump(),
        "finish_reason": [c.choices[0].finish_reason for c in chat_chunks if c.choices][-1]}

    seen["errors"] = errors_seen(client, alpha, keys)
    seen["disconnect"] = disconnect(alpha, metrics_url)
    print(json.dumps(seen))


def status_of(call) -> dict:
    try:
        call()
    except openai.APIStatusError as exc:
        error = exc.body if isinstance(exc.body, dict) else {}
        return {"class": type(exc).__name__, "status": exc.status_code, "type": error.get("type"),
                "code": error.get("code"), "param": error.get("param"),
                "retry_after": exc.response.headers.get("retry-after")}
    return {"status": 200}


def errors_seen(client, alpha: openai.OpenAI, keys: dict) -> dict:
    def complete(c: openai.OpenAI, **over):
        return lambda: c.completions.create(**{"model": MODEL, "prompt": "a", "max_tokens": 1, **over})

    ratelimited = client(keys["ratelimited"])
    status_of(complete(ratelimited))
    seen = {
        "400": status_of(complete(alpha, n=17)),
        "400_chat": status_of(lambda: alpha.chat.completions.create(model=MODEL, messages=[], max_tokens=1)),
        "401": status_of(complete(client("wrong-key"))),
        "403": status_of(complete(client(keys["narrow"]))),
        "404": status_of(complete(alpha, model="no-such-model")),
        "429": status_of(complete(ratelimited)),
        "504": status_of(complete(alpha, extra_headers={"x-infermesh-timeout-ms": "1"})),
    }
    held = alpha.completions.create(model=MODEL, prompt="abc", max_tokens=400, stream=True)
    next(iter(held))  # one request in flight: sheddable traffic is shed now
    try:
        seen["503"] = status_of(complete(client(keys["cheap"])))
    finally:
        held.close()
    return seen


def metric(metrics_url: str, name: str) -> float:
    text = urllib.request.urlopen(metrics_url, timeout=5).read().decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(name + "{") and f'model="{MODEL}"' in line)


def disconnect(alpha: openai.OpenAI, metrics_url: str) -> dict:
    """Read a few chunks of a long stream, close it, and time how long the scheduler takes to be idle."""
    stream = alpha.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "abc"}],
                                           max_tokens=450, temperature=0, stream=True)
    chunks = iter(stream)
    for _ in range(3):
        next(chunks)
    kv_before = metric(metrics_url, "infermesh_scheduler_kv_cache_usage_ratio")
    running_before = metric(metrics_url, "infermesh_scheduler_running_sequences")
    stream.close()
    began = time.monotonic()
    while time.monotonic() - began < 5:
        if (metric(metrics_url, "infermesh_scheduler_running_sequences") == 0
                and metric(metrics_url, "infermesh_scheduler_kv_cache_usage_ratio") == 0):
            return {"kv_before": kv_before, "running_before": running_before, "idle_after_s": time.monotonic() - began}
        time.sleep(0.02)
    return {"kv_before": kv_before, "running_before": running_before, "idle_after_s": None}


if __name__ == "__main__":
    main()
