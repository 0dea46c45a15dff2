"""OpenAI's Responses API (POST /v1/responses) on the chat path: a request becomes a chat request
(`chat_request`), its answer a Response object (`response_object`) or Responses' streaming events
(`ResponseEvents`, fed the chat stream's event objects). Pure: no I/O.

Stateless unless the gateway stores responses (openai_stored.py, response_store.py): then a turn may
name a stored one in `previous_response_id`, whose items the front looks up and hands to
`chat_request` as `earlier`, a Response says whether it is kept (`store`), and `background` asks
for it to be answered once admitted and run on (openai_background.py), streamed or not. Without
storing, `previous_response_id` and `background` are a 400 saying so and a Response says
`"store": false`, as vLLM serves it by default. With storing, `conversation` names a stored
conversation (openai_conversations.py) whose items the front hands over as `earlier`, as for
`previous_response_id` (the two together are a 400); without, it is a 400 saying storing is off. Inputs are text: messages (string content or input_text / output_text parts), the model's
own function_call items and their function_call_output items; images, files and hosted tools
(web_search, file_search, ...) are a 400 naming the item or tool; `item_reference` items are resolved
to the stored items they name before this reads them (a 400 saying so without storing). What chat
checks (sampling, tools, structured output) is checked by the chat parser, its refusals renamed to
the Responses parameter (`max_output_tokens`, `text.format`, `input`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from services.gateway.fronts.openai_params import BadParameter, json_object, shown
from services.gateway.fronts.openai_stored import (
    STORING_OFF,
    conversation_param,
    is_item_reference,
    previous_response_id,
    wants_store,
)

# Sampling extensions passed to the chat parser as they are (vLLM takes them on /v1/responses too).
_PASSED = ("temperature", "top_p", "parallel_tool_calls", "seed", "top_k", "min_p", "min_tokens",
           "repetition_penalty", "presence_penalty", "frequency_penalty", "stop", "ignore_eos", "logit_bias",
           "chat_template_kwargs")
_MESSAGE_ROLES = ("user", "system", "developer", "assistant")
_TEXT_PARTS = ("input_text", "output_text", "text")
# A chat parameter's name in a Responses request.
_RENAMED = {"max_completion_tokens": "max_output_tokens", "max_tokens": "max_output_tokens",
            "response_format": "text.format", "messages": "input"}
LOGPROBS_INCLUDE = "message.output_text.logprobs"


@dataclass(frozen=True)
class ResponsesRequest:
    chat: dict  # the chat completions body the chat parser reads
    echoed: dict  # the request's settings a Response repeats (instructions, tools, text, store, ...)
    input: Any = None  # `input` as sent and checked: what a stored Response keeps (openai_stored.input_items)

    @property
    def store(self) -> bool:
        """Whether its Response is to be kept: asked for (the default) and the gateway stores."""
        return bool(self.echoed["store"])

    @property
    def background(self) -> bool:
        """Whether it is answered once admitted (status queued, or its stream) and run on in the gateway."""
        return bool(self.echoed["background"])

    @property
    def conversation(self) -> str | None:
        """The stored conversation it continues, and its items are added to once it completes."""
        named = self.echoed.get("conversation")
        return None if named is None else named["id"]

    @property
    def streamed(self) -> bool:
        return self.chat.get("stream") is True


def chat_request(body: Any, *, storing: bool = False, earlier: Sequence[dict] = ()) -> ResponsesRequest:
    """The chat body for a Responses request, checked where chat would name a different field.
    storing: whether the gateway stores responses. earlier: the items of the stored response named in
    previous_response_id (openai_stored.chain_of), looked up by the caller; they come before `input`."""
    body = json_object(body)
    store = wants_store(body)
    conversation = conversation_param(body)  # first: beside previous_response_id it is refused, storing or not
    previous = previous_response_id(body)
    if previous is not None and not storing:
        raise BadParameter("previous_response_id", f"previous_response_id is not supported: {STORING_OFF}; "
                                                   "send the whole conversation in input instead")
    if conversation is not None and not storing:
        raise BadParameter("conversation", f"conversation is not supported: {STORING_OFF}; send the whole "
                                           "conversation in input instead")
    background = _background(body, storing=storing, store=store)
    instructions = body.get("instructions")
    if instructions is not None and not isinstance(instructions, str):
        raise BadParameter("instructions", f"instructions must be a string, got {shown(instructions)}")
    system = [{"role": "system", "content": instructions}] if instructions else []
    messages = system + _messages(body.get("input"), earlier)
    chat: dict[str, Any] = {"model": body.get("model"), "messages": messages}
    chat.update({name: body[name] for name in _PASSED if name in body})
    if body.get("max_output_tokens") is not None:
        chat["max_completion_tokens"] = body["max_output_tokens"]
    if body.get("stream") is not None:
        chat["stream"] = body["stream"]
        if body["stream"] is True:
            chat["stream_options"] = {"include_usage": True}  # the last event's Response carries usage
    tools = _tools(body.get("tools"))
    if tools:
        chat["tools"] = tools
    if body.get("tool_choice") is not None:
        chat["tool_choice"] = _tool_choice(body["tool_choice"])
    text_format = _text_format(body.get("text"))
    if text_format is not None:
        chat["response_format"] = text_format
    top_logprobs = body.get("top_logprobs")
    if top_logprobs or LOGPROBS_INCLUDE in _include(body.get("include")):
        chat["logprobs"] = True
    if top_logprobs is not None:
        chat["top_logprobs"] = top_logprobs  # the chat parser checks it (0..20, and with logprobs when > 0)
    check_metadata(body.get("metadata"))
    echoed = {
        "instructions": instructions,
        "max_output_tokens": body.get("max_output_tokens"),
        "metadata": body.get("metadata") or {},
        "parallel_tool_calls": body.get("parallel_tool_calls", True),
        "temperature": body.get("temperature", 1.0),
        "top_p": body.get("top_p", 1.0),
        "top_logprobs": top_logprobs or 0,
        "text": {"format": body["text"]["format"] if text_format is not None else {"type": "text"}},
        "tool_choice": body.get("tool_choice", "auto"),
        "tools": body.get("tools") or [],
        "truncation": body.get("truncation") or "disabled",
        "user": body.get("user"),
        "store": store and storing,
        "previous_response_id": previous,
        "background": background,
    }
    if conversation is not None:
        echoed["conversation"] = {"id": conversation}
    return ResponsesRequest(chat, echoed, body.get("input"))


def _background(body: dict, *, storing: bool, store: bool) -> bool:
    """`background` as sent: only for a Response that is stored (it is read back by polling, or its stream
    by GET with stream=true)."""
    background = body.get("background")
    if background is None or background is False:
        return False
    if background is not True:
        raise BadParameter("background", f"background must be true or false, got {shown(background)}")
    if not storing:
        raise BadParameter("background", f"background responses are not supported: {STORING_OFF}")
    if not store:
        raise BadParameter("background", "background responses are read back when done, so they need store: true")
    return True


def renamed(err: BadParameter) -> BadParameter:
    """The chat parser's refusal under the Responses parameter's name: `input` for any message (its index
    is not the input item's: instructions and merged calls shift them), the renamed field otherwise."""
    param = err.param or ""
    base = param.partition(".")[0].partition("[")[0]
    if base not in _RENAMED:
        return err
    # The same class: a context-length refusal keeps OpenAI's code.
    return type(err)("input" if base == "messages" else _RENAMED[base] + param[len(base):], err.message)


def check_input(items: Any) -> None:
    """Refuses what `input` may not hold, as a Responses request's own input is refused."""
    _messages(items)


def _messages(items: Any, earlier: Sequence[dict] = ()) -> list[dict]:
    """The chat messages of `earlier` then `items`; a refused item is named by its index in `items`
    (the earlier ones were checked when their own turn was)."""
    if isinstance(items, str):
        items = [{"role": "user", "content": items}]
    if not isinstance(items, list) or not items:
        raise BadParameter("input", "input must be a string or a non-empty list of input items")
    messages: list[dict] = []
    for i, item in enumerate([*earlier, *items], start=-len(earlier)):
        if not isinstance(item, dict):
            raise BadParameter(f"input[{i}]", f"input[{i}] must be an object")
        kind = item.get("type", "message")
        if is_item_reference(item):  # a storing gateway resolved them before (openai_stored.resolved_input)
            raise BadParameter(f"input[{i}].type", f"input[{i}] is an item_reference, which names a stored item: "
                                                   f"{STORING_OFF}; send the item itself")
        if kind == "message":
            messages.append(_message(item, i))
        elif kind == "function_call":
            call = {"id": _text(item, "call_id", i), "type": "function",
                    "function": {"name": _text(item, "name", i), "arguments": _text(item, "arguments", i)}}
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant":  # calls after the turn's text: the same turn
                last.setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            output = item.get("output")
            content = output if isinstance(output, str) else _parts_text(output, f"input[{i}].output")
            messages.append({"role": "tool", "tool_call_id": _text(item, "call_id", i), "content": content})
        elif kind != "reasoning":  # a reply's reasoning sent back: dropped, as the templates drop past turns'
            raise BadParameter(f"input[{i}].type", f"input[{i}].type must be message, reasoning, function_call or "
                                                   f"function_call_output, got {shown(kind)}")
    return messages


def _message(item: dict, i: int) -> dict:
    role = item.get("role")
    if role not in _MESSAGE_ROLES:
        raise BadParameter(f"input[{i}].role", f"input[{i}].role must be one of {', '.join(_MESSAGE_ROLES)}, "
                                               f"got {shown(role)}")
    content = item.get("content")
    text = content if isinstance(content, str) else _parts_text(content, f"input[{i}].content")
    return {"role": role, "content": text}


def _parts_text(parts: Any, where: str) -> str:
    if not isinstance(parts, list):
        raise BadParameter(where, f"{where} must be a string or a list of text parts")
    texts = []
    for j, part in enumerate(parts):
        if not (isinstance(part, dict) and part.get("type") in _TEXT_PARTS and isinstance(part.get("text"), str)):
            kind = part.get("type") if isinstance(part, dict) else part
            raise BadParameter(f"{where}[{j}]", f"{where}[{j}] must be a text part ({', '.join(_TEXT_PARTS)}); "
                                                f"images, files and audio are not supported, got {shown(kind)}")
        texts.append(part["text"])
    return "".join(texts)


def _text(item: dict, name: str, i: int) -> str:
    value = item.get(name)
    if not isinstance(value, str):
        raise BadParameter(f"input[{i}].{name}", f"input[{i}].{name} must be a string, got {shown(value)}")
    return value


def _tools(tools: Any) -> list[dict]:
    if tools is None:
        return []
    if not isinstance(tools, list):
        raise BadParameter("tools", "tools must be a list of function tools")
    converted = []
    for i, tool in enumerate(tools):
        if not isinstance(tool, dict) or tool.get("type") != "function":
            kind = tool.get("type") if isinstance(tool, dict) else tool
            raise BadParameter(f"tools[{i}].type", f"tools[{i}]: only function tools are supported "
                                                   f"(no hosted tools), got {shown(kind)}")
        function = {key: tool[key] for key in ("name", "description", "parameters", "strict")
                    if tool.get(key) is not None}
        converted.append({"type": "function", "function": function})
    return converted


def _tool_choice(choice: Any) -> Any:
    if isinstance(choice, dict) and choice.get("type") == "function" and "function" not in choice:
        return {"type": "function", "function": {"name": choice.get("name")}}
    return choice  # "auto", "none", "required"; anything else the chat parser refuses, naming tool_choice


def _text_format(text: Any) -> dict | None:
    if text is None:
        return None
    if not isinstance(text, dict):
        raise BadParameter("text", f"text must be an object with a format, got {shown(text)}")
    fmt = text.get("format")
    if fmt is None or fmt == {"type": "text"}:
        return None
    if not isinstance(fmt, dict) or fmt.get("type") not in ("json_object", "json_schema"):
        raise BadParameter("text.format", "text.format.type must be text, json_object or json_schema, "
                                          f"got {shown(fmt.get('type') if isinstance(fmt, dict) else fmt)}")
    if fmt["type"] == "json_object":
        return {"type": "json_object"}
    schema = {key: fmt[key] for key in ("name", "schema", "strict", "description") if key in fmt}
    return {"type": "json_schema", "json_schema": schema}


def _include(include: Any) -> list:
    if include is None:
        return []
    if not isinstance(include, list) or not all(isinstance(i, str) for i in include):
        raise BadParameter("include", f"include must be a list of strings, got {shown(include)}")
    return include


def check_metadata(metadata: Any) -> None:
    """OpenAI's bounds: up to 16 string pairs, keys up to 64 characters, values up to 512."""
    if metadata is None:
        return
    if (not isinstance(metadata, dict) or len(metadata) > 16
            or not all(isinstance(k, str) and isinstance(v, str) and len(k) <= 64 and len(v) <= 512
                       for k, v in metadata.items())):
        raise BadParameter("metadata", "metadata must be an object of at most 16 string values (keys up to 64 "
                                       "characters, values up to 512)")


# -- answers ----------------------------------------------------------------------------------


def response_id(request_id: str) -> str:
    return "resp_" + request_id


def response_object(request: ResponsesRequest, request_id: str, created_s: int, model: str, *,
                    output: list[dict], status: str, usage: dict | None = None,
                    error: dict | None = None) -> dict:
    """A Response: `status` in_progress, completed, incomplete (max_output_tokens reached) or failed; a
    background one also queued or cancelled."""
    return {
        "id": response_id(request_id), "object": "response", "created_at": created_s, "status": status,
        "error": error,
        "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
        "model": model, "output": output, "reasoning": {"effort": None, "summary": None}, "usage": usage,
        **request.echoed,
    }


def completed(request: ResponsesRequest, chat_reply: dict, request_id: str) -> dict:
    """The Response for a whole chat completion (the chat front's non-streamed body)."""
    choice = chat_reply["choices"][0]
    message = choice["message"]
    logprobs = (choice.get("logprobs") or {}).get("content") or []
    output = [_reasoning_item(request_id, message["reasoning_content"], "completed")] if message.get(
        "reasoning_content") else []
    if message.get("content") or not message.get("tool_calls"):
        output.append(_message_item(request_id, message.get("content") or "", logprobs, "completed"))
    output += [_call_item(call, call["function"]["arguments"], "completed") for call in message.get("tool_calls") or ()]
    return response_object(request, request_id, chat_reply["created"], chat_reply["model"], output=output,
                           status=_status(choice["finish_reason"]), usage=responses_usage(chat_reply["usage"]))


def responses_usage(usage: dict) -> dict:
    """reasoning_tokens stays 0: the scheduler counts a choice's tokens, not where its text was split."""
    return {"input_tokens": usage["prompt_tokens"],
            "input_tokens_details": {"cached_tokens": usage.get("prompt_tokens_details", {}).get("cached_tokens", 0)},
            "output_tokens": usage["completion_tokens"], "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": usage["total_tokens"]}


def _status(finish_reason: str | None) -> str:
    return "incomplete" if finish_reason == "length" else "completed"


def _message_item(request_id: str, text: str, logprobs: list, status: str) -> dict:
    content = [_text_part(text, logprobs)] if status == "completed" else []
    return {"type": "message", "id": "msg_" + request_id, "status": status, "role": "assistant", "content": content}


def _reasoning_item(request_id: str, text: str, status: str) -> dict:
    """The model's reasoning (a think block), as Responses shows an open model's: its text as a
    reasoning_text part, no summary."""
    content = [_reasoning_part(text)] if status == "completed" else []
    return {"type": "reasoning", "id": "rs_" + request_id, "summary": [], "content": content,
            "encrypted_content": None, "status": status}


def _reasoning_part(text: str) -> dict:
    return {"type": "reasoning_text", "text": text}


def _text_part(text: str, logprobs: list) -> dict:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": logprobs}


def _call_item(call: dict, arguments: str, status: str) -> dict:
    return {"type": "function_call", "id": "fc_" + call["id"], "call_id": call["id"],
            "name": call["function"]["name"], "arguments": arguments, "status": status}


class ResponseEvents:
    """Responses' streaming events for one chat stream: `opened()` first, `chunk()` for each chat event
    object, then `closed()` (or `failed()` for an error after the start). Each event carries its
    sequence number; output items open and close in order (a message, then each function call)."""

    def __init__(self, request: ResponsesRequest, request_id: str, created_s: int, model: str) -> None:
        self._request = request
        self._request_id = request_id
        self._created_s = created_s
        self._model = model
        self._sequence = 0
        self._output: list[dict] = []  # every item as done (or, for the open one, as far as it got)
        self._open: dict | None = None  # the item streaming now: kind, index, text/arguments so far
        self._calls: dict[int, dict] = {}  # chat tool call index -> its call delta's id and name
        self._finish_reason: str | None = None
        self._usage: dict | None = None

    def opened(self) -> list[dict]:
        started = self._response("in_progress")
        return [self._event("response.created", response=started), self._event("response.in_progress", response=started)]

    def chunk(self, event: dict) -> list[dict]:
        if event.get("usage"):
            self._usage = responses_usage(event["usage"])
        out: list[dict] = []
        for choice in event.get("choices", ()):
            delta = choice.get("delta", {})
            if delta.get("reasoning_content"):
                out += self._reasoning(delta["reasoning_content"])
            if delta.get("content"):
                out += self._text(delta["content"], (choice.get("logprobs") or {}).get("content") or [])
            for call in delta.get("tool_calls") or ():
                out += self._call(call)
            if choice.get("finish_reason"):
                self._finish_reason = choice["finish_reason"]
        return out

    def closed(self) -> list[dict]:
        out = self._close()
        if not any(item["type"] != "reasoning" for item in self._output):
            # nothing said and nothing called: an empty message, as a whole answer has
            out += self._text("", []) + self._close()
        status = _status(self._finish_reason)
        final = self._response(status)
        return out + [self._event("response.incomplete" if status == "incomplete" else "response.completed",
                                  response=final)]

    def failed(self, error: dict) -> list[dict]:
        """`error`: OpenAI's error object ({"message", "type", "code", ...}) of a failure after the start."""
        failed = self._response("failed", {"code": "server_error", "message": error.get("message", "")})
        return [self._event("response.failed", response=failed)]

    def _response(self, status: str, error: dict | None = None) -> dict:
        return response_object(self._request, self._request_id, self._created_s, self._model,
                               output=[dict(item) for item in self._output], status=status,
                               usage=self._usage, error=error)

    def _event(self, kind: str, **fields: Any) -> dict:
        event = {"type": kind, "sequence_number": self._sequence, **fields}
        self._sequence += 1
        return event

    def _text(self, text: str, logprobs: list) -> list[dict]:
        out: list[dict] = []
        if self._open is None or self._open["type"] != "message":
            out += self._close()
            index = len(self._output)
            item = _message_item(self._request_id, "", [], "in_progress")
            self._output.append(item)
            self._open = {"type": "message", "index": index, "text": "", "logprobs": []}
            out.append(self._event("response.output_item.added", output_index=index, item=dict(item)))
            out.append(self._event("response.content_part.added", item_id=item["id"], output_index=index,
                                   content_index=0, part=_text_part("", [])))
        self._open["text"] += text
        self._open["logprobs"] += logprobs
        if text:
            out.append(self._event("response.output_text.delta", item_id=self._output[self._open["index"]]["id"],
                                   output_index=self._open["index"], content_index=0, delta=text, logprobs=logprobs))
        return out

    def _reasoning(self, text: str) -> list[dict]:
        out: list[dict] = []
        if self._open is None or self._open["type"] != "reasoning":
            out += self._close()
            index = len(self._output)
            item = _reasoning_item(self._request_id, "", "in_progress")
            self._output.append(item)
            self._open = {"type": "reasoning", "index": index, "text": ""}
            out.append(self._event("response.output_item.added", output_index=index, item=dict(item)))
            out.append(self._event("response.content_part.added", item_id=item["id"], output_index=index,
                                   content_index=0, part=_reasoning_part("")))
        self._open["text"] += text
        out.append(self._event("response.reasoning_text.delta", item_id=self._output[self._open["index"]]["id"],
                               output_index=self._open["index"], content_index=0, delta=text))
        return out

    def _call(self, delta: dict) -> list[dict]:
        out: list[dict] = []
        index = delta.get("index", 0)
        function = delta.get("function") or {}
        if index not in self._calls:
            out += self._close()
            self._calls[index] = call = {"id": delta["id"], "function": {"name": function.get("name", "")}}
            position = len(self._output)
            item = _call_item(call, "", "in_progress")
            self._output.append(item)
            self._open = {"type": "function_call", "index": position, "arguments": ""}
            out.append(self._event("response.output_item.added", output_index=position, item=dict(item)))
        assert self._open is not None and self._open["type"] == "function_call"
        piece = function.get("arguments") or ""
        if piece:
            self._open["arguments"] += piece
            out.append(self._event("response.function_call_arguments.delta",
                                   item_id=self._output[self._open["index"]]["id"],
                                   output_index=self._open["index"], delta=piece))
        return out

    def _close(self) -> list[dict]:
        """The done events of the item streaming now, if any."""
        if self._open is None:
            return []
        index = self._open["index"]
        item = self._output[index]
        out = []
        if self._open["type"] == "message":
            text, logprobs = self._open["text"], self._open["logprobs"]
            out.append(self._event("response.output_text.done", item_id=item["id"], output_index=index,
                                   content_index=0, text=text, logprobs=logprobs))
            out.append(self._event("response.content_part.done", item_id=item["id"], output_index=index,
                                   content_index=0, part=_text_part(text, logprobs)))
            item.update(status="completed", content=[_text_part(text, logprobs)])
        elif self._open["type"] == "reasoning":
            text = self._open["text"]
            out.append(self._event("response.reasoning_text.done", item_id=item["id"], output_index=index,
                                   content_index=0, text=text))
            out.append(self._event("response.content_part.done", item_id=item["id"], output_index=index,
                                   content_index=0, part=_reasoning_part(text)))
            item.update(status="completed", content=[_reasoning_part(text)])
        else:
            out.append(self._event("response.function_call_arguments.done", item_id=item["id"], output_index=index,
                                   arguments=self._open["arguments"]))
            item.update(status="completed", arguments=self._open["arguments"])
        out.append(self._event("response.output_item.done", output_index=index, item=dict(item)))
        self._open = None
        return out
