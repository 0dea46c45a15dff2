"""Runs the stock `openai` package against the gateway for
tests/integration/test_openai_grammar_best_of_tools.py (with .venv-openai's python: the package is
not a project dependency): best_of, vLLM's guided_grammar (extra_body) and parallel_tool_calls, as
the client sends them; prints what its types parsed (and the 400s it raised), as JSON.

argv: base_url, CA file, model name, the test's cases as JSON ({"prompt", "tools", "grammar",
"bad_grammar", "two_calls"}).
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
    ask = dict(model=model, prompt=cases["prompt"], max_tokens=6, temperature=1.0, seed=7,
               extra_body={"ignore_eos": True})
    seen: dict = {}
    best = client.completions.create(**ask, n=2, best_of=3)
    seen["best_of"] = {"texts": [c.text for c in best.choices], "indexes": [c.index for c in best.choices],
                       "logprobs": [c.logprobs for c in best.choices], "usage": best.usage.model_dump()}
    every = client.completions.create(**ask, n=3, logprobs=0)
    seen["candidates"] = [{"text": c.text, "token_logprobs": c.logprobs.token_logprobs} for c in every.choices]
    seen["best_of_stream"] = refusal(lambda: list(client.completions.create(**ask, best_of=2, stream=True)))

    grammar = dict(model=model, prompt=cases["prompt"], max_tokens=24, temperature=1.0, seed=3, n=3)
    whole = client.completions.create(**grammar, extra_body={"guided_grammar": cases["grammar"]})
    seen["grammar"] = [(c.text, c.finish_reason) for c in whole.choices]
    chunks = client.completions.create(**grammar, stream=True, extra_body={"guided_grammar": cases["grammar"]})
    texts = ["", "", ""]
    for chunk in chunks:
        for choice in chunk.choices:
            texts[choice.index] += choice.text
    seen["grammar_stream"] = texts
    seen["bad_grammar"] = refusal(lambda: client.completions.create(
        **grammar, extra_body={"guided_grammar": cases["bad_grammar"]}))

    messages = [{"role": "user", "content": "The time and the weather?"}]
    tools = dict(model=model, messages=messages, tools=cases["tools"], max_tokens=120, temperature=1.0, seed=5,
                 extra_body={"guided_grammar": cases["two_calls"]})
    for parallel in (False, True):
        reply = client.chat.completions.create(**tools, parallel_tool_calls=parallel)
        seen[f"auto_parallel_{parallel}"] = {
            "finish_reason": reply.choices[0].finish_reason,
            "names": [c.function.name for c in reply.choices[0].message.tool_calls or []]}
    streamed = client.chat.completions.create(**tools, parallel_tool_calls=False, stream=True)
    seen["auto_stream"] = [(c.index, c.function.name) for chunk in streamed if chunk.choices
                           for c in chunk.choices[0].delta.tool_calls or []]
    print(json.dumps(seen))


if __name__ == "__main__":
    main()
