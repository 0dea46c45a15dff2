"""vLLM's POST /tokenize and /detokenize bodies <-> Inference.Tokenize and Detokenize (pure).

/tokenize takes a completion's `prompt` (text; `add_special_tokens`, default true: the model's BOS
as a prompt gets it) or a chat's `messages` (and `tools`; `add_generation_prompt`, default true),
and answers `{"count", "max_model_len", "tokens", "token_strs"}` as vLLM does (`token_strs`, each
token's text, when `return_token_strs` is true; else null). /detokenize takes `tokens` and answers
`{"prompt": text}`. Clients count a prompt's tokens with them, and lm-evaluation-harness's
local-completions uses them in place of a local tokenizer when the server has them.

GET /tokenizer_info (behind --enable-tokenizer-info-endpoint, as in vLLM) answers what vLLM's does: the
tokenizer's configuration as tokenizer_config.json holds it (add_bos_token, add_eos_token, bos_token,
eos_token, ..., model_max_length, chat_template) and `tokenizer_class`, for clients that rebuild the
tokenizer. vLLM serves one model; here `?model=` names one, and without it the caller's only generator.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from infermesh.v1 import common_pb2, gateway_pb2
from services.gateway.fronts.openai_codec import chat_messages
from services.gateway.fronts.openai_params import (
    BadParameter,
    boolean,
    chat_options,
    json_object,
    model_ref,
    shown,
    token_ids,
)
from services.gateway.fronts.openai_tools import parse_tools


def parse_tokenize(body: Any) -> tuple[gateway_pb2.TokenizeRequest, bool]:
    """The request, and whether the caller wants each token's text (return_token_strs)."""
    body = json_object(body)
    request = gateway_pb2.TokenizeRequest(model=_model(body))
    token_strs = boolean(body, "return_token_strs", False)
    prompt, messages = body.get("prompt"), body.get("messages")
    if (prompt is None) == (messages is None):
        raise BadParameter("prompt", "send prompt (a string) or messages (a conversation), exactly one")
    if prompt is not None:
        if not isinstance(prompt, str) or not prompt:
            raise BadParameter("prompt", f"prompt must be a non-empty string, got {shown(prompt)}")
        request.prompt = prompt
        request.add_special_tokens = boolean(body, "add_special_tokens", True)
        return request, token_strs
    request.messages.extend(chat_messages(messages))
    generate = gateway_pb2.GenerateRequest()
    parse_tools({"tools": body.get("tools")}, generate)
    request.tools.extend(generate.tools)
    chat_options(body, request)
    return request, token_strs


def parse_detokenize(body: Any) -> gateway_pb2.DetokenizeRequest:
    body = json_object(body)
    tokens = body.get("tokens")
    if not isinstance(tokens, list):
        raise BadParameter("tokens", f"tokens must be a list of token ids, got {shown(tokens)}")
    return gateway_pb2.DetokenizeRequest(model=_model(body), token_ids=token_ids(tokens, "tokens", "tokens"))


def tokenize_body(reply: gateway_pb2.TokenizeResponse, token_strs: bool) -> dict:
    strs = [b.decode("utf-8", errors="replace") for b in reply.token_bytes] if token_strs else None
    return {"count": len(reply.token_ids), "max_model_len": reply.max_seq_len, "tokens": list(reply.token_ids),
            "token_strs": strs}


def detokenize_body(reply: gateway_pb2.DetokenizeResponse) -> dict:
    return {"prompt": reply.text}


def parse_tokenizer_info(query: Mapping[str, str]) -> gateway_pb2.GetTokenizerInfoRequest:
    """The query string's `model`, if any (vLLM's endpoint takes none: it serves one model)."""
    unknown = sorted(set(query) - {"model"})
    if unknown:
        raise BadParameter(unknown[0], f"unknown query parameter '{unknown[0]}'; /tokenizer_info takes model")
    return gateway_pb2.GetTokenizerInfoRequest(model=_model(dict(query)))


def tokenizer_info_body(reply: gateway_pb2.GetTokenizerInfoResponse) -> dict:
    """tokenizer_config.json's fields as vLLM answers them; chat_template only when the model has one."""
    body: dict[str, Any] = dict(sorted(reply.special_tokens.items()))
    for name in ("add_bos_token", "add_eos_token"):
        if reply.HasField(name):
            body[name] = getattr(reply, name)
    body["model_max_length"] = reply.max_seq_len
    if reply.chat_template:
        body["chat_template"] = reply.chat_template
    body["tokenizer_class"] = reply.tokenizer_class
    return body


def _model(body: dict) -> common_pb2.ModelRef:
    """The model named, or none: the caller's only generator (vLLM serves one; lm-eval names none)."""
    model = body.get("model")
    return common_pb2.ModelRef() if model is None else model_ref(model)
