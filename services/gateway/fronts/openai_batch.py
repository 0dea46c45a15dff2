"""Batched prompts on /v1/completions: `prompt` as a list of strings, as OpenAI and vLLM accept it.

LangChain's completions LLM and other stock clients send several prompts in one request. Each
prompt becomes a part: the same request with its own prompt and request id (`<id>-p<k>` past the
first), admitted, routed and generated as a request of its own, its n choices as usual. The parts
take turns with the choices (turns.py: at most 64 sequences at once; one shed at admission while
others of its request run asks again once one ended); the answer lists every part's choices prompt after prompt (choice `k * n + i` is
prompt k's choice i, as OpenAI and vLLM number them), with one id, and usage summed over the parts
(each prompt counted once).

A prompt may also be token ids of the model's tokenizer (a list of integers, or a list of such
lists: vLLM's token prompts, which lm-evaluation-harness sends for its loglikelihood requests):
they go upstream as GenerateRequest.prompt_token_ids, used as they are; the scheduler checks them
against the model's vocabulary. A list mixing text and token prompts is refused, as vLLM does.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from infermesh.v1 import gateway_pb2
from services.gateway.fronts.openai_params import BadParameter, is_int, shown, token_ids

if TYPE_CHECKING:
    from services.gateway.fronts.openai_codec import OpenAIRequest

# Sequences one request may ask for: prompts x best_of, as many as /v1/embeddings' inputs (OpenAI's bound
# there). Each is admitted and counted against the tenant's quotas and the gateway's concurrency like a
# request, and they take turns (turns.py), so a batch past what the gateway admits at once is served.
MAX_BATCH_SEQUENCES = 2048


# A prompt: text, or token ids of the model's tokenizer.
Prompt = str | tuple[int, ...]
PROMPT_SHAPES = "a string, a list of strings, a list of token ids, or a list of lists of token ids"


def completion_prompts(value: Any) -> tuple[Prompt, ...]:
    """`prompt` checked: a string, a list of token ids (one prompt), or a list of strings or of
    token-id lists (a prompt each); refusals name the parameter."""
    return prompts_of(value, "prompt")


def prompts_of(value: Any, field: str, max_prompts: int | None = None) -> tuple[Prompt, ...]:
    """`field`'s value as prompts (completions' `prompt`, embeddings' `input`): a string, a list of token ids
    (one prompt), or a list of strings or of token-id lists (a prompt each), at most `max_prompts`, none
    empty; refusals name `field` (and the prompt, `field[i]`, among several)."""
    if value is None:
        raise BadParameter(field, f"{field} is required ({PROMPT_SHAPES})")
    if isinstance(value, list) and not value:
        raise BadParameter(field, f"{field} must not be an empty list")
    prompts: tuple[Prompt, ...]
    if isinstance(value, str):
        prompts = (value,)
    elif isinstance(value, list) and all(is_int(p) for p in value):
        prompts = (token_ids(value, field, field),)
    elif isinstance(value, list) and all(isinstance(p, str) for p in value):
        prompts = tuple(value)
    elif isinstance(value, list) and all(isinstance(p, list) for p in value):
        prompts = tuple(token_ids(p, field, f"{field}[{index}]") for index, p in enumerate(value))
    else:
        raise BadParameter(field, f"{field} must be {PROMPT_SHAPES} (not a mix), got {shown(value)}")
    if max_prompts is not None and len(prompts) > max_prompts:
        raise BadParameter(field, f"{field} holds {len(prompts)} inputs; a request may hold at most {max_prompts}")
    for index, prompt in enumerate(prompts):
        if not prompt:
            where = field if len(prompts) == 1 else f"{field}[{index}]"
            raise BadParameter(field, f"{where} must not be empty")
    return prompts


def set_prompt(generate: gateway_pb2.GenerateRequest, prompt: Prompt) -> None:
    """The prompt into the request: text as prompt, token ids as prompt_token_ids."""
    generate.ClearField("prompt")
    generate.ClearField("prompt_token_ids")
    if isinstance(prompt, str):
        generate.prompt = prompt
    else:
        generate.prompt_token_ids.extend(prompt)


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
        set_prompt(generate, prompt)
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
