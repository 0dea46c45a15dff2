"""Runs the stock `openai` package against the gateway for tests/integration/test_openai_edge_cases_39.py
(with .venv-openai's python: the package is not a project dependency): issue 39's newest options
combined as a client sends them (extra_body for vLLM's), streamed and not; prints what its types
parsed (and the 400s it raised), as JSON.

argv: base_url, CA file, model name, the test's cases as JSON ({"prompt", "eos_id", "empty_grammar", "tools"}).
"""

from __future__ import annotations

import json
import ssl
import sys

import openai
from openai_script_errors import refusal


def main() -> None:
    base_url, ca_path, model, cases = sys.argv[1], sys.argv[2], sys.argv[3], json.loads(sys.argv[4])
    client = openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=60,
                           http_client=openai.DefaultHttpx2Client(verify=ssl.create_default_context(cafile=ca_path)))
    prompt = cases["prompt"]
    seen: dict = {}
    echo = dict(model=model, prompt=prompt, echo=True, logprobs=1, n=2, max_tokens=3, seed=5, temperature=1.0,
                extra_body={"ignore_eos": True})
    whole = client.completions.create(**echo)
    seen["echo"] = {"choices": [_completion_choice(c) for c in sorted(whole.choices, key=lambda c: c.index)],
                    "usage": whole.usage.model_dump()}
    streamed: dict[int, dict] = {}
    for chunk in client.completions.create(**echo, stream=True, stream_options={"include_usage": True}):
        for choice in chunk.choices:
            into = streamed.setdefault(choice.index, {"text": "", "tokens": [], "token_logprobs": [],
                                                      "text_offset": [], "finish_reason": None})
            into["text"] += choice.text
            if choice.logprobs is not None:
                for key in ("tokens", "token_logprobs", "text_offset"):
                    into[key] += getattr(choice.logprobs, key)
            into["finish_reason"] = choice.finish_reason or into["finish_reason"]
        if chunk.usage is not None:
            seen["echo_stream_usage"] = chunk.usage.model_dump()
    seen["echo_stream"] = [streamed[i] for i in sorted(streamed)]

    batch = client.completions.create(model=model, prompt=[prompt, prompt[:10]], n=2, max_tokens=3, seed=3,
                                      extra_body={"ignore_eos": True})
    seen["batch"] = {"choices": [{"index": c.index, "text": c.text, "finish_reason": c.finish_reason}
                                 for c in batch.choices], "usage": batch.usage.model_dump(), "id": batch.id}

    only = client.completions.create(model=model, prompt=prompt, echo=True, max_tokens=0,
                                     logit_bias={str(cases["eos_id"]): 100})
    seen["echo_only"] = {**_completion_choice(only.choices[0]), "usage": only.usage.model_dump()}

    chat = dict(model=model, messages=[{"role": "user", "content": prompt}], max_tokens=2, n=2,
                extra_body={"prompt_logprobs": 1})
    seen["chat_prompt_logprobs"] = client.chat.completions.create(**chat).model_extra["prompt_logprobs"]
    seen["chat_prompt_logprobs_stream"] = [chunk.model_extra.get("prompt_logprobs")
                                           for chunk in client.chat.completions.create(**chat, stream=True)]

    seen["empty_grammar"] = refusal(lambda: client.completions.create(
        model=model, prompt=prompt, max_tokens=4, extra_body={"guided_grammar": cases["empty_grammar"]}))
    reply = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "The time?"}],
                                           tools=cases["tools"], tool_choice="none", parallel_tool_calls=False,
                                           max_tokens=4)
    seen["tools_none"] = {"tool_calls": reply.choices[0].message.tool_calls,
                          "content": reply.choices[0].message.content}
    print(json.dumps(seen))


def _completion_choice(choice) -> dict:
    logprobs = choice.logprobs
    return {"text": choice.text, "finish_reason": choice.finish_reason,
            **({"tokens": logprobs.tokens, "token_logprobs": logprobs.token_logprobs,
                "text_offset": logprobs.text_offset} if logprobs is not None else {})}


if __name__ == "__main__":
    main()
