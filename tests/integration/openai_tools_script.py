"""Runs the stock `openai` package against the gateway for tests/integration/test_openai_tools.py (with
.venv-openai's python: the package is not a project dependency): multi-turn tool-calling
conversations, streamed and not, each turn sent back as the client's own types give it. Prints
what the client parsed, as JSON.

argv: base_url, CA file, model name, the tools as JSON.
"""

from __future__ import annotations

import json
import ssl
import sys

import openai

QUESTION = "What is the weather in Oslo this week?"
RESULT = json.dumps({"temperature_c": 21, "sky": "clear"})


def main() -> None:
    base_url, ca_path, model, tools = sys.argv[1], sys.argv[2], sys.argv[3], json.loads(sys.argv[4])
    client = openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=60,
                           http_client=openai.DefaultHttpx2Client(verify=ssl.create_default_context(cafile=ca_path)))
    named = {"type": "function", "function": {"name": "weather"}}
    seen = {
        "named": converse(client, model, tools, named, stream=False),
        "named_stream": converse(client, model, tools, named, stream=True),
        "required": converse(client, model, tools, "required", stream=False),
        "required_stream": converse(client, model, tools, "required", stream=True),
    }
    auto = client.chat.completions.create(model=model, messages=[{"role": "user", "content": QUESTION}], tools=tools,
                                          max_tokens=12, temperature=1.0, seed=5)
    seen["auto"] = {"content": auto.choices[0].message.content, "finish_reason": auto.choices[0].finish_reason,
                    "tool_calls": [c.model_dump() for c in auto.choices[0].message.tool_calls or []]}
    print(json.dumps(seen))


def converse(client: openai.OpenAI, model: str, tools: list, tool_choice, stream: bool) -> dict:
    """Question -> the model's calls -> a `tool` turn answering each -> the final answer."""
    messages: list = [{"role": "user", "content": QUESTION}]
    ask = dict(model=model, tools=tools, tool_choice=tool_choice, max_tokens=200, temperature=1.0, seed=3,
               parallel_tool_calls=False)
    if stream:
        assistant, finish_reason = streamed_turn(client.chat.completions.create(**ask, messages=messages, stream=True))
    else:
        reply = client.chat.completions.create(**ask, messages=messages)
        assistant, finish_reason = reply.choices[0].message.model_dump(exclude_none=True), reply.choices[0].finish_reason
    messages.append(assistant)
    for call in assistant.get("tool_calls", []):
        messages.append({"role": "tool", "tool_call_id": call["id"], "content": RESULT})
    final = client.chat.completions.create(model=model, messages=messages, tools=tools, tool_choice="none",
                                           max_tokens=8, temperature=1.0, seed=4)
    return {"messages": messages, "finish_reason": finish_reason,
            "final": {"content": final.choices[0].message.content, "finish_reason": final.choices[0].finish_reason,
                      "tool_calls": final.choices[0].message.tool_calls, "prompt_tokens": final.usage.prompt_tokens}}


def streamed_turn(chunks) -> tuple[dict, str | None]:
    """The assistant turn built from the deltas, as a client of the stream builds it."""
    content, calls, finish_reason = "", [], None
    for chunk in chunks:
        for choice in chunk.choices:
            content += choice.delta.content or ""
            for delta in choice.delta.tool_calls or []:
                if delta.index == len(calls):
                    calls.append({"id": delta.id, "type": delta.type,
                                  "function": {"name": delta.function.name, "arguments": ""}})
                calls[delta.index]["function"]["arguments"] += delta.function.arguments or ""
            finish_reason = choice.finish_reason or finish_reason
    turn: dict = {"role": "assistant", "content": content or None}
    if calls:
        turn["tool_calls"] = calls
    return turn, finish_reason


if __name__ == "__main__":
    main()
