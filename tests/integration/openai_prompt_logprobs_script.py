"""Runs the stock `openai` package against the gateway for tests/integration/test_openai_prompt_logprobs.py
(with .venv-openai's python: the package is not a project dependency); prints what its types parsed, as JSON.

argv: base_url, CA file, model name, prompt.
"""

from __future__ import annotations

import json
import ssl
import sys

import openai


def _logprobs(choice) -> dict:
    logprobs = choice.logprobs
    return {"text": choice.text, "tokens": logprobs.tokens, "token_logprobs": logprobs.token_logprobs,
            "top_logprobs": logprobs.top_logprobs, "text_offset": logprobs.text_offset,
            "finish_reason": choice.finish_reason}


def main() -> None:
    base_url, ca_path, model, prompt = sys.argv[1:5]
    client = openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=60,
                           http_client=openai.DefaultHttpx2Client(verify=ssl.create_default_context(cafile=ca_path)))
    seen: dict = {}
    scored = client.completions.create(model=model, prompt=prompt, max_tokens=0, echo=True, logprobs=2)
    seen["scored"] = _logprobs(scored.choices[0])
    seen["scored_usage"] = scored.usage.model_dump()
    echoed = client.completions.create(model=model, prompt=prompt, max_tokens=4, temperature=0, echo=True,
                                       logprobs=1, extra_body={"ignore_eos": True, "prompt_logprobs": 2})
    seen["echoed"] = _logprobs(echoed.choices[0])
    seen["echoed_usage"] = echoed.usage.model_dump()
    seen["prompt_logprobs"] = echoed.choices[0].model_extra["prompt_logprobs"]
    streamed = client.completions.create(model=model, prompt=prompt, max_tokens=4, temperature=0, echo=True,
                                         logprobs=1, stream=True, extra_body={"ignore_eos": True})
    text, tokens, values = "", [], []
    for chunk in streamed:
        for choice in chunk.choices:
            text += choice.text
            if choice.logprobs:
                tokens += choice.logprobs.tokens
                values += choice.logprobs.token_logprobs
    seen["streamed"] = {"text": text, "tokens": tokens, "token_logprobs": values}
    print(json.dumps(seen))


if __name__ == "__main__":
    main()
