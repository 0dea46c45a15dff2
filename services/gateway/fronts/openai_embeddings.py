"""OpenAI's POST /v1/embeddings (vLLM's, for models served with --task embed) over the Generate path.

Body: `model`, `input` (a string, a list of strings, a list of token ids, or a list of lists of token
ids) or instead `messages` (vLLM's EmbeddingChatRequest: one conversation, rendered through the model's
chat template by the scheduler, with vLLM's chat options add_generation_prompt (default false here, as
vLLM's chat embeddings), continue_final_message and chat_template_kwargs), `encoding_format` ("float",
the default, or "base64": each vector's little-endian float32 bytes), `dimensions` (a Matryoshka model's
shortened vectors; another model refuses it), vLLM's `truncate_prompt_tokens` (each input's last N tokens;
-1: the model's context) and `add_special_tokens` (default: the model's way for input, none for messages,
as vLLM's), `user` (ignored).
Each input becomes a GenerateRequest with `embed` set, admitted, counted against the tenant's quotas
(its prompt tokens) and run as a request of its own, as a batched completion's prompts are; at most
MAX_PARALLEL_PARTS run at once, and an input shed at admission while others of its request run waits for
one of them to end (turns.py: a large batch is not refused by its own inputs). The answer
lists `{"object": "embedding", "index", "embedding"}` per input in order, the model as asked, and usage
(prompt_tokens = total_tokens, summed over the inputs).
The scheduler refuses an embedding request for a generator of text, and a generation request for an
embedding model, each as a 400; its refusals are renamed here to the parameters the client sent.
"""

from __future__ import annotations

import base64
import re
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from aiohttp import web

from infermesh.v1 import gateway_pb2
from services.common import errors
from services.gateway.calls.generate_core import Caller, GenerateCore
from services.gateway.fronts.caller import http_caller
from services.gateway.fronts.openai_batch import Prompt, prompts_of, set_prompt
from services.gateway.fronts.openai_codec import (
    ContextLengthExceeded,
    chat_messages,
    prompt_tokenizing,
    timings_header,
)
from services.gateway.fronts.openai_params import (
    BadParameter,
    chat_options,
    is_int,
    json_object,
    model_ref,
    shown,
)
from services.gateway.fronts.turns import last_chunks

# OpenAI's limit on inputs per request (LangChain's OpenAIEmbeddings sends up to 1000 at once).
MAX_INPUTS = 2048
ENCODING_FORMATS = ("float", "base64")
_TOO_LONG = re.compile(r"prompt (of \d+ tokens is longer than the model's context.*)")


@dataclass(frozen=True)
class EmbeddingsRequest:
    model: str  # as the client named it (the answer's `model`)
    requests: tuple[gateway_pb2.GenerateRequest, ...]  # one per input, in order
    base64: bool
    # What the prompts came as, which the scheduler's refusals of them name: "input" or "messages".
    prompt_param: str = "input"


# The chat rendering options, read only with messages.
_CHAT_OPTIONS = ("add_generation_prompt", "continue_final_message", "chat_template_kwargs")


def parse_embeddings(body: Any) -> EmbeddingsRequest:
    """The body checked; every refusal names its parameter."""
    body = json_object(body)
    model = model_ref(body.get("model"))
    chat = body.get("messages") is not None
    if chat and body.get("input") is not None:
        raise BadParameter("messages", "send input or messages, not both")
    if not chat and (named := next((o for o in _CHAT_OPTIONS if body.get(o) is not None), None)):
        raise BadParameter(named, f"{named} is a chat option: it applies to messages, not input")
    if body.get("chat_template") not in (None, ""):
        raise BadParameter("chat_template", "a request's own chat_template is not supported: the model's is used "
                                            "(vLLM without --trust-request-chat-template refuses it too)")
    inputs: tuple[Prompt | None, ...] = (None,) if chat else input_prompts(body.get("input"))
    encoding = body.get("encoding_format", "float")
    if encoding not in ENCODING_FORMATS:
        raise BadParameter("encoding_format", f"encoding_format must be one of {', '.join(ENCODING_FORMATS)}, "
                                              f"got {shown(encoding)}")
    dimensions = body.get("dimensions")
    # Below 2**32: EmbedOptions.dimensions is a uint32, which a larger value would crash into a 500.
    if dimensions is not None and not (is_int(dimensions) and 1 <= dimensions < 2**32):
        raise BadParameter("dimensions", f"dimensions must be an integer >= 1, got {shown(dimensions)}")
    request_id = uuid.uuid4().hex
    requests = []
    for index, prompt in enumerate(inputs):
        request = gateway_pb2.GenerateRequest(model=model, request_id=f"{request_id}-p{index}" if index else request_id)
        request.embed.SetInParent()
        if dimensions is not None:
            request.embed.dimensions = dimensions
        if prompt is None:
            request.messages.extend(chat_messages(body["messages"]))
            chat_options(body, request, default_generation=False)
        else:
            set_prompt(request, prompt)
        prompt_tokenizing(body, request)
        requests.append(request)
    return EmbeddingsRequest(body["model"], tuple(requests), encoding == "base64", "messages" if chat else "input")


def input_prompts(value: Any) -> tuple[Prompt, ...]:
    """`input` as prompts: text or token ids, one per input."""
    return prompts_of(value, "input", MAX_INPUTS)


def embeddings_body(parsed: EmbeddingsRequest, lasts: Sequence[gateway_pb2.GenerateResponse]) -> dict:
    data = [{"object": "embedding", "index": index, "embedding": _encoded(last.embedding, parsed.base64)}
            for index, last in enumerate(lasts)]
    prompt_tokens = sum(last.usage.prompt_tokens for last in lasts)
    return {"object": "list", "data": data, "model": parsed.model,
            "usage": {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens}}


def _encoded(vector: Sequence[float], as_base64: bool) -> list[float] | str:
    if not as_base64:
        return list(vector)
    return base64.b64encode(np.asarray(vector, dtype="<f4").tobytes()).decode("ascii")


# The scheduler's refusals that begin with the parameter they are about (call_codec, chat_template.py).
_NAMED_UPSTREAM = ("truncate_prompt_tokens", "continue_final_message", "chat_template_kwargs")


def upstream_refusal(err: errors.InfermeshError, index: int, num_inputs: int,
                     prompt_param: str = "input") -> errors.InfermeshError:
    """The scheduler's refusal of input `index` in the client's terms: the parameter it set, and which input
    (`prompt_param`: "messages" for a conversation, whose template's refusals name it)."""
    if not isinstance(err, errors.InvalidArgument):
        return err
    where, message = _where(index, num_inputs) if prompt_param == "input" else prompt_param, err.message
    if too_long := _TOO_LONG.match(message):
        return ContextLengthExceeded(prompt_param, f"{where} {too_long[1]}")
    if named := next((p for p in _NAMED_UPSTREAM if message.startswith(p)), None):
        return BadParameter(named, message)
    if message.startswith("prompt_token_ids"):  # a token id past the model's vocabulary
        return BadParameter("input", where + message.removeprefix("prompt_token_ids"))
    if message.startswith("embed.dimensions"):
        return BadParameter("dimensions", message.removeprefix("embed."))
    if message.startswith("embed: "):
        return BadParameter("model", message.removeprefix("embed: "))
    if prompt_param == "messages":  # the chat template's: no template, or one that raised on them
        return BadParameter("messages", message)
    return err


def _where(index: int, num_inputs: int) -> str:
    return "input" if num_inputs == 1 else f"input[{index}]"


class EmbeddingsFront:
    def __init__(self, core: GenerateCore, refusal: Callable[[web.Request, errors.InfermeshError], errors.InfermeshError],
                 error_response: Callable[[errors.InfermeshError], web.Response],
                 read_body: Callable[[web.Request], Any], dumps: Callable[[Any], str]) -> None:
        """`refusal`: what a request whose body is refused is told (Unauthenticated first, if it is)."""
        self._core = core
        self._refusal = refusal
        self._error_response = error_response
        self._read_body = read_body
        self._dumps = dumps

    async def embeddings(self, request: web.Request) -> web.Response:
        try:
            caller = http_caller(request)
            parsed = parse_embeddings(await self._read_body(request))
        except errors.InfermeshError as err:
            return self._error_response(self._refusal(request, err))
        try:
            lasts = await self._run(parsed, caller)
        except errors.InfermeshError as err:
            return self._error_response(err)
        headers = {"x-request-id": parsed.requests[0].request_id, "x-infermesh-timings": timings_header(lasts[0])}
        return web.json_response(embeddings_body(parsed, lasts), headers=headers, dumps=self._dumps)

    async def _run(self, parsed: EmbeddingsRequest, caller: Caller) -> list[gateway_pb2.GenerateResponse]:
        """Every input's last chunk, in order; the first refusal that stands fails them all."""
        num_inputs = len(parsed.requests)
        lasts = await last_chunks(
            lambda request, further, on_admitted: self._core.generate(request, caller, further_choice=further,
                                                                      on_admitted=on_admitted),
            parsed.requests, lambda err, index: upstream_refusal(err, index, num_inputs, parsed.prompt_param))
        if not all(last.embedding for last in lasts):
            raise errors.Internal("the scheduler's answer carried no embedding")
        return lasts
