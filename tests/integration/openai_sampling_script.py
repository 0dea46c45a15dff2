"""Runs the stock `openai` package against the gateway for tests/integration/test_openai_sampling.py
(with .venv-openai's python: the package is not a project dependency); prints what its types parsed, as JSON.

argv: base_url, CA file, model name.
"""

from __future__ import annotations

import json
import ssl
import sys

import openai


def main() -> None:
    base_url, ca_path, model = sys.argv[1:4]
    client = openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=60,
                           http_client=openai.DefaultHttpx2Client(verify=ssl.create_default_context(cafile=ca_path)))
    seen: dict = {}
    completion = client.completions.create(model=model, prompt="The sky", max_tokens=6, temperature=0, logprobs=3,
                                           extra_body={"ignore_eos": True})
    logprobs = completion.choices[0].logprobs
    seen["completion"] = {"text": completion.choices[0].text, "tokens": logprobs.tokens,
                          "token_logprobs": logprobs.token_logprobs, "top_logprobs": logprobs.top_logprobs,
                          "text_offset": logprobs.text_offset}
    streamed = client.completions.create(model=model, prompt="The sky", max_tokens=6, temperature=0, logprobs=3,
                                         stream=True, extra_body={"ignore_eos": True})
    seen["stream_completion"] = [t for c in streamed if c.choices and c.choices[0].logprobs
                                 for t in c.choices[0].logprobs.token_logprobs]
    messages = [{"role": "user", "content": "Hello there"}]
    chat = client.chat.completions.create(model=model, messages=messages, max_tokens=6, temperature=0.7, seed=11,
                                          logprobs=True, top_logprobs=2, extra_body={"ignore_eos": True})
    content = chat.choices[0].logprobs.content
    seen["chat"] = {"text": chat.choices[0].message.content,
                    "entries": [{"token": e.token, "logprob": e.logprob, "bytes": e.bytes,
                                 "top": [(t.token, t.logprob, t.bytes) for t in e.top_logprobs]} for e in content]}
    chunks = client.chat.completions.create(model=model, messages=messages, max_tokens=6, temperature=0.7, seed=11,
                                            logprobs=True, top_logprobs=2, stream=True,
                                            extra_body={"ignore_eos": True})
    seen["stream_chat"] = [e.logprob for c in chunks if c.choices and c.choices[0].logprobs
                           for e in c.choices[0].logprobs.content or []]
    choices = client.chat.completions.create(model=model, messages=messages, max_tokens=5, temperature=1.0, seed=3,
                                             n=3, stream=True, extra_body={"ignore_eos": True})
    texts = ["", "", ""]
    for c in choices:
        for choice in c.choices:
            texts[choice.index] += choice.delta.content or ""
    seen["stream_n"] = texts
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
              "additionalProperties": False}
    structured = client.chat.completions.create(
        model=model, messages=messages, max_tokens=20, temperature=1.0, seed=4, n=2,
        response_format={"type": "json_schema", "json_schema": {"name": "ok", "schema": schema, "strict": True}})
    seen["structured"] = [(c.message.content, c.finish_reason) for c in structured.choices]
    print(json.dumps(seen))


if __name__ == "__main__":
    main()
