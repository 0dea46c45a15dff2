"""Runs the stock `openai` package's Responses API against the gateway for
tests/integration/test_openai_responses.py (with .venv-openai's python: the package is not a project
dependency): text, instructions and input items, the stream helper (which checks every event's order
and identity as it builds the response), function calls and their outputs sent back, a structured
output, the token limit, and what is refused. Prints what its types parsed, as JSON.

argv: base_url, CA file, model name, the test's cases as JSON ({"prompt", "tools", "schema", "ends_after_6"}).
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
    prompt, tools = cases["prompt"], cases["tools"]
    seen: dict = {}
    # Ends after 6 tokens (the end id forced, min_tokens holding it off): the stream helper builds a final
    # response only from response.completed, and random weights seldom end on their own.
    greedy = dict(model=model, max_output_tokens=12, temperature=0, extra_body=cases["ends_after_6"])
    calling = dict(model=model, max_output_tokens=96, temperature=0, parallel_tool_calls=False)
    whole = client.responses.create(input=prompt, **greedy)
    seen["text"] = {"output_text": whole.output_text, "response": whole.model_dump(mode="json")}

    with client.responses.stream(input=prompt, **greedy) as stream:
        types = [event.type for event in stream]
        final = stream.get_final_response()
    seen["stream"] = {"types": types, "output_text": final.output_text, "response": final.model_dump(mode="json")}

    items = [{"role": "user", "content": [{"type": "input_text", "text": prompt}]}]
    with_instructions = client.responses.create(input=items, instructions="Answer briefly.", **greedy)
    seen["instructions"] = with_instructions.output_text

    called = client.responses.create(input="The time?", tools=tools, tool_choice="required", **calling)
    seen["called"] = called.model_dump(mode="json")
    calls = [item for item in called.output if item.type == "function_call"]
    follow = [{"role": "user", "content": "The time?"}, *[c.model_dump(exclude_none=True) for c in calls],
              *[{"type": "function_call_output", "call_id": c.call_id, "output": "12:00"} for c in calls]]
    seen["answered"] = client.responses.create(input=follow, tools=tools, **greedy).model_dump(mode="json")
    named = {"type": "function", "name": "clock"}
    with client.responses.stream(input="The time?", tools=tools, tool_choice=named, **calling) as stream:
        types = [event.type for event in stream]
        final = stream.get_final_response()
    seen["called_stream"] = {"types": types, "response": final.model_dump(mode="json")}

    structured = client.responses.create(
        input=prompt, model=model, max_output_tokens=64, temperature=0,
        text={"format": {"type": "json_schema", "name": "pick", "schema": cases["schema"], "strict": True}})
    seen["structured"] = {"output_text": structured.output_text, "status": structured.status}

    short = client.responses.create(input=prompt, model=model, max_output_tokens=2, temperature=0,
                                    extra_body={"ignore_eos": True})
    seen["short"] = {"status": short.status, "incomplete_details": short.incomplete_details.model_dump(),
                     "usage": short.usage.model_dump()}

    seen["previous"] = refusal(lambda: client.responses.create(input=prompt, previous_response_id=whole.id, **greedy))
    seen["image"] = refusal(lambda: client.responses.create(
        input=[{"role": "user", "content": [{"type": "input_image", "image_url": "https://example.invalid/a.png"}]}],
        **greedy))
    try:
        client.responses.retrieve(whole.id)
        seen["retrieve"] = 200
    except openai.NotFoundError as err:
        seen["retrieve"] = err.status_code
    print(json.dumps(seen))


if __name__ == "__main__":
    main()
