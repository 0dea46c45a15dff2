"""Batched prompts on /v1/completions: `prompt` as a list of strings, as OpenAI and vLLM accept it.

LangChain's completions LLM and other stock clients send several prompts in one request. Each
prompt becomes a part: the same request with its own prompt and request id (`<id>-p<k>` past the
first), admitted, routed and generated as a request of its own, its n choices as usual. The parts
run at once; the answer lists every part's choices prompt after prompt (choice `k * n + i` is
prompt k's choice i, as OpenAI and vLLM number them), with one id, and usage summed over the parts
(each prompt counted once). Token-id prompts are refused: the mesh tokenizes at the scheduler.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from infermesh.v1 import gateway_pb2
from services.gateway.fronts.openai_params import BadParameter, shown

if TYPE_CHECKING:
    from services.gateway.fronts.openai_codec import OpenAIRequest

# Sequences one request may ask for: prompts x best_of. Each is admitted and counted against the
# tenant's quotas and the gateway's concurrency like a request (LangChain batches 20 prompts by default).
MAX_BATCH_SEQUENCES = 64


def completion_prompts(value: Any) -> tuple[str, ...]:
    """`prompt` checked: a string, or a list of strings (each a prompt); refusals name the parameter."""
    if value is None:
        raise BadParameter("prompt", "prompt is required (a string, or a list of strings)")
    if isinstance(value, str):
        prompts: tuple[str, ...] = (value,)
    elif isinstance(value, list) and value and all(isinstance(p, str) for p in value):
        prompts = tuple(value)
    elif isinstance(value, list) and value and all(isinstance(p, int | list) for p in value):
        raise BadParameter("prompt", "token-id prompts are not supported: send the prompt as text (the scheduler "
                                     "tokenizes it with the model's tokenizer)")
    elif isinstance(value, list) and not value:
        raise BadParameter("prompt", "prompt must not be an empty list")
    else:
        raise BadParameter("prompt", f"prompt must be a string or a list of strings, got {shown(value)}")
    for index, prompt in enumerate(prompts):
        if not prompt:
            where = "prompt" if len(prompts) == 1 else f"prompt[{index}]"
            raise BadParameter("prompt", f"{where} must not be empty")
    return prompts


def check_batch_size(num_prompts: int, best_of: int) -> None:
    if num_prompts * best_of > MAX_BATCH_SEQUENCES:
        raise BadParameter("prompt", f"{num_prompts} prompts x {best_of} choices each is {num_prompts * best_of} "
                                     f"sequences; a request may ask for at most {MAX_BATCH_SEQUENCES}")


def prompt_parts(request: OpenAIRequest) -> list[OpenAIRequest]:
    """The request for each prompt: itself for one, else a copy per prompt with its prompt and request id."""
    if not request.batch_prompts:
        return [request]
    parts = []
    for index, prompt in enumerate(request.batch_prompts):
        generate = gateway_pb2.GenerateRequest()
        generate.CopyFrom(request.generate)
        generate.prompt = prompt
        if index:
            generate.request_id = f"{request.generate.request_id}-p{index}"
        parts.append(dataclasses.replace(request, generate=generate, batch_prompts=()))
    return parts


def batch_response(bodies: Sequence[dict], n: int) -> dict:
    """The parts' whole responses as one: the first's id and extensions, every part's choices numbered
    prompt after prompt, usage summed."""
    if len(bodies) == 1:
        return bodies[0]
    choices = [{**choice, "index": part * n + choice["index"]}
               for part, body in enumerate(bodies) for choice in body["choices"]]
    return {**bodies[0], "choices": choices, "usage": summed_usage([body["usage"] for body in bodies])}


def summed_usage(usages: Sequence[dict]) -> dict:
    """OpenAI's usage objects of the parts added up (each part counted its prompt once)."""
    prompt = sum(u["prompt_tokens"] for u in usages)
    completion = sum(u["completion_tokens"] for u in usages)
    cached = sum(u["prompt_tokens_details"]["cached_tokens"] for u in usages)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached}}
