"""What the gateway's request parsers share: the 400 naming a parameter, how a refused value is
shown in its message, and the sampling options both the OpenAI front and KServe's generator
parameters take under the same names (penalties, logit_bias, logprobs, structured outputs), read
from a JSON object's values into SamplingParams."""

from __future__ import annotations

import json
import math
from typing import Any

from infermesh.v1 import common_pb2, gateway_pb2
from services.common import errors
from services.common.logprobs import MAX_TOP_LOGPROBS
from services.common.sampling_bounds import (
    MAX_ALLOWED_TOKEN_IDS,
    MAX_BAD_WORDS,
    MAX_BIAS,
    MAX_LOGIT_BIAS,
    MAX_PENALTY,
    MAX_STOP_TOKEN_IDS,
    MAX_TOP_K,
)


class BadParameter(errors.InvalidArgument):
    """A request parameter is missing, of the wrong type or out of range; `param` names it."""

    def __init__(self, param: str | None, message: str) -> None:
        super().__init__(message)
        self.param = param


# Token ids travel as uint32 (GenerateRequest.prompt_token_ids, DetokenizeRequest.token_ids); the model's
# vocabulary is checked upstream, where it is known.
MAX_TOKEN_ID = 2**32 - 1


def json_object(body: Any) -> dict:
    """A request body that must be a JSON object."""
    if not isinstance(body, dict):
        raise BadParameter(None, "the request body must be a JSON object")
    return body


def model_ref(model: Any) -> common_pb2.ModelRef:
    """`model`: a model id, or `<id>:<version>` pinning a version."""
    if not isinstance(model, str) or not model:
        raise BadParameter("model", f"model must be a model id from GET /v1/models, got {shown(model)}")
    name, colon, version = model.partition(":")
    if not name or (colon and not version):
        raise BadParameter("model", f"model must be a model id or <id>:<version>, got {shown(model)}")
    return common_pb2.ModelRef(name=name, version=version)


def is_token_id(value: Any) -> bool:
    return is_int(value) and 0 <= value <= MAX_TOKEN_ID


def token_ids(values: list, param: str, where: str) -> tuple[int, ...]:
    """`values` as token ids; a refusal names `param` and the place (`where[i]`) of the first that is not one."""
    for index, value in enumerate(values):
        if not is_token_id(value):
            raise BadParameter(param, f"{where}[{index}] must be a token id (an integer >= 0), got {shown(value)}")
    return tuple(values)


def shown(value: Any) -> str:
    """A value in a message: its repr, cut to 40 characters."""
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def penalties(body: dict, sampling: common_pb2.SamplingParams) -> None:
    """presence_penalty, frequency_penalty (OpenAI's), repetition_penalty (vLLM's) and logit_bias; and
    vLLM's top_k, min_p, min_tokens (at most max_tokens when that is set; else the scheduler checks
    it against the model's default), stop_token_ids, include_stop_str_in_output, allowed_token_ids and
    bad_words (the scheduler checks the ids against the vocabulary and tokenizes the words)."""
    sampling.presence_penalty = number(body, "presence_penalty", 0.0, -MAX_PENALTY, MAX_PENALTY)
    sampling.frequency_penalty = number(body, "frequency_penalty", 0.0, -MAX_PENALTY, MAX_PENALTY)
    sampling.repetition_penalty = _repetition_penalty(body)
    sampling.logit_bias.update(_logit_bias(body))
    sampling.top_k = _top_k(body)
    sampling.min_p = number(body, "min_p", 0.0, 0.0, 1.0)
    sampling.min_tokens = _min_tokens(body, sampling.max_tokens)
    stop_ids = body.get("stop_token_ids")
    if stop_ids is not None:
        if not isinstance(stop_ids, list) or len(stop_ids) > MAX_STOP_TOKEN_IDS:
            raise BadParameter("stop_token_ids", f"stop_token_ids must be a list of at most {MAX_STOP_TOKEN_IDS} "
                                                 f"token ids, got {shown(stop_ids)}")
        sampling.stop_token_ids.extend(token_ids(stop_ids, "stop_token_ids", "stop_token_ids"))
    sampling.include_stop_str_in_output = boolean(body, "include_stop_str_in_output", False)
    sampling.allowed_token_ids.extend(_allowed_token_ids(body))
    sampling.bad_words.extend(_bad_words(body))


# guided_choice's most strings (the scheduler's bound, structured_output.MAX_CHOICES).
MAX_GUIDED_CHOICES = 256
MAX_MIN_TOKENS = 2**32 - 1  # the proto's uint32; max_tokens bounds it further


_GUIDED = ("guided_json", "guided_regex", "guided_choice", "guided_grammar")


def structured(body: dict, sampling: common_pb2.SamplingParams) -> str | None:
    """response_format (OpenAI's) or vLLM's guided_json / guided_regex / guided_choice / guided_grammar,
    at most one, as sampling.structured; the parameter that set it (it names the scheduler's refusal of a schema)."""
    response_format = body.get("response_format")
    if response_format == {"type": "text"}:
        response_format = None
    given = [name for name in ("response_format", *_GUIDED) if (response_format if name == "response_format"
                                                                else body.get(name)) is not None]
    if len(given) > 1:
        raise BadParameter(given[1], f"set one of response_format, {', '.join(_GUIDED)}; got {', '.join(given)}")
    if not given:
        return None
    param = given[0]
    target = sampling.structured
    if param == "response_format":
        _response_format(response_format, target)
    elif param == "guided_json":
        value = body["guided_json"]
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except ValueError:
                raise BadParameter(param, "guided_json must be a JSON schema (an object, or its JSON text)") from None
        if not isinstance(value, dict):
            raise BadParameter(param, "guided_json must be a JSON schema (an object, or its JSON text)")
        target.json_schema = json.dumps(value)
    elif param == "guided_regex":
        if not isinstance(body[param], str) or not body[param]:
            raise BadParameter(param, f"guided_regex must be a non-empty string, got {shown(body[param])}")
        target.regex = body[param]
    elif param == "guided_grammar":  # whether it parses is the scheduler's to say (it compiles it)
        if not isinstance(body[param], str) or not body[param].strip():
            raise BadParameter(param, "guided_grammar must be a non-empty string (a Lark or GBNF/EBNF grammar), "
                                      f"got {shown(body[param])}")
        target.grammar = body[param]
    else:
        choices = body[param]
        if (not isinstance(choices, list) or not choices or len(choices) > MAX_GUIDED_CHOICES
                or not all(isinstance(c, str) and c for c in choices)):
            raise BadParameter(param, f"guided_choice must be a list of 1 to {MAX_GUIDED_CHOICES} non-empty "
                                      f"strings, got {shown(choices)}")
        target.choice.choices.extend(choices)
    return param


def _response_format(value: Any, structured: common_pb2.StructuredOutput) -> None:
    kind = value.get("type") if isinstance(value, dict) else None
    if kind == "json_object":
        structured.json_object = True
        return
    if kind != "json_schema":
        raise BadParameter("response_format", "response_format must be {\"type\": \"text\"}, {\"type\": "
                                              "\"json_object\"} or {\"type\": \"json_schema\", \"json_schema\": "
                                              f"{{\"name\": ..., \"schema\": {{...}}}}}}, got {shown(value)}")
    spec = value.get("json_schema")
    schema = spec.get("schema") if isinstance(spec, dict) else None
    if not isinstance(schema, dict):
        raise BadParameter("response_format", "response_format.json_schema.schema must be a JSON schema (an object)")
    structured.json_schema = json.dumps(schema)



# vLLM's -1 for top_logprobs and prompt_logprobs: every token of the model's vocabulary. vLLM
# counts it as the vocabulary's size against its max_logprobs, whose default (20) is our cap, and
# refuses it past that: so for every vocabulary served here (the byte models' 257 ids and up).
WHOLE_VOCABULARY = -1


def whole_vocabulary_refused(param: str, kind: str) -> BadParameter:
    """vLLM's refusal of -1 (`kind`: sample or prompt), in its words."""
    return BadParameter(param, f"Requested {kind} logprobs of -1 (every token of the model's vocabulary), which "
                               f"is greater than max allowed: {MAX_TOP_LOGPROBS} (vLLM's default max_logprobs); ask "
                               f"for 0..{MAX_TOP_LOGPROBS}")


def chat_logprobs(body: dict, sampling: common_pb2.SamplingParams) -> None:
    """Chat: `logprobs: true`, and `top_logprobs: <int>` alternatives with it."""
    logprobs = boolean(body, "logprobs", False)
    top = body.get("top_logprobs")
    if top is not None:
        if top == WHOLE_VOCABULARY and is_int(top):
            if not logprobs:
                raise BadParameter("top_logprobs", "top_logprobs needs logprobs: true")
            raise whole_vocabulary_refused("top_logprobs", "sample")
        if not is_int(top) or not 0 <= top <= MAX_TOP_LOGPROBS:
            raise BadParameter("top_logprobs", f"top_logprobs must be an integer in [0, {MAX_TOP_LOGPROBS}], "
                                               f"got {shown(top)}")
        if not logprobs and top:
            raise BadParameter("top_logprobs", "top_logprobs needs logprobs: true")
    sampling.logprobs = logprobs
    sampling.top_logprobs = top or 0



def is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def boolean(body: dict, name: str, default: bool, param: str | None = None) -> bool:
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise BadParameter(param or name, f"{param or name} must be a boolean, got {shown(value)}")
    return value


def number(body: dict, name: str, default: float, low: float, high: float) -> float:
    value = body.get(name)
    if value is None:
        return default
    if not is_number(value) or not low <= value <= high:
        raise BadParameter(name, f"{name} must be a number in [{low:g}, {high:g}], got {shown(value)}")
    return float(value)



def _top_k(body: dict) -> int:
    """vLLM's top_k: the k most likely tokens; -1 and 0 (the default) are off."""
    value = body.get("top_k")
    if value is None:
        return 0
    if not is_int(value) or not -1 <= value <= MAX_TOP_K:
        raise BadParameter("top_k", f"top_k must be an integer in [-1, {MAX_TOP_K}] (-1 and 0: off), got {shown(value)}")
    return max(value, 0)


def chat_options(body: dict, request: gateway_pb2.GenerateRequest | gateway_pb2.TokenizeRequest, *,
                 default_generation: bool = True) -> None:
    """vLLM's chat rendering options: add_generation_prompt (default true; vLLM's chat embeddings default it
    to false: `default_generation`), continue_final_message (default false; not with add_generation_prompt
    true) and chat_template_kwargs (an object of template variables)."""
    generation = boolean(body, "add_generation_prompt", default_generation)
    if not generation:
        request.add_generation_prompt = False
    request.continue_final_message = boolean(body, "continue_final_message", False)
    if generation and request.continue_final_message:
        raise BadParameter("continue_final_message", "continue_final_message cannot be combined with "
                                                     "add_generation_prompt true (set add_generation_prompt false)")
    kwargs = body.get("chat_template_kwargs")
    if kwargs is not None:
        if not isinstance(kwargs, dict):
            raise BadParameter("chat_template_kwargs", f"chat_template_kwargs must be an object, got {shown(kwargs)}")
        request.chat_template_kwargs = json.dumps(kwargs, ensure_ascii=False)


def _min_tokens(body: dict, max_tokens: int) -> int:
    """vLLM's min_tokens: 0 (the default) is off; never past max_tokens (0: the model's default)."""
    value = body.get("min_tokens")
    if value is None:
        return 0
    if not is_int(value) or not 0 <= value <= MAX_MIN_TOKENS:
        raise BadParameter("min_tokens", f"min_tokens must be an integer in [0, {MAX_MIN_TOKENS}], got {shown(value)}")
    if max_tokens and value > max_tokens:
        raise BadParameter("min_tokens", f"min_tokens ({value}) must be at most max_tokens ({max_tokens})")
    return value


def _allowed_token_ids(body: dict) -> tuple[int, ...]:
    """vLLM's allowed_token_ids: a non-empty list of token ids (empty is vLLM's 400 too: nothing could be drawn)."""
    value = body.get("allowed_token_ids")
    if value is None:
        return ()
    if not isinstance(value, list) or not 1 <= len(value) <= MAX_ALLOWED_TOKEN_IDS:
        raise BadParameter("allowed_token_ids", f"allowed_token_ids must be a list of 1 to {MAX_ALLOWED_TOKEN_IDS} "
                                                f"token ids, got {shown(value)}")
    return token_ids(value, "allowed_token_ids", "allowed_token_ids")


def _bad_words(body: dict) -> list[str]:
    """vLLM's bad_words: a list of strings, each with a non-space character (an empty list is none)."""
    value = body.get("bad_words")
    if value is None:
        return []
    if not isinstance(value, list) or len(value) > MAX_BAD_WORDS:
        raise BadParameter("bad_words", f"bad_words must be a list of at most {MAX_BAD_WORDS} strings, "
                                        f"got {shown(value)}")
    for index, word in enumerate(value):
        if not isinstance(word, str) or not word.strip():
            raise BadParameter("bad_words", f"bad_words[{index}] must be a string with a non-space character, "
                                            f"got {shown(word)}")
    return value


def _repetition_penalty(body: dict) -> float:
    """vLLM's extra parameter; 1 (the default) is off."""
    value = body.get("repetition_penalty")
    if value is None:
        return 1.0
    if not is_number(value) or not 0 < value <= MAX_PENALTY:
        raise BadParameter("repetition_penalty", f"repetition_penalty must be a number in (0, {MAX_PENALTY:g}], "
                                                 f"got {shown(value)}")
    return float(value)


def _logit_bias(body: dict) -> dict[int, float]:
    """OpenAI's map of token id (a JSON object's key, so a string) to a bias in [-100, 100]. Whether
    each id is a token of the model is the scheduler's to say (the gateway has no tokenizer)."""
    value = body.get("logit_bias")
    if value is None:
        return {}
    if not isinstance(value, dict) or len(value) > MAX_LOGIT_BIAS:
        raise BadParameter("logit_bias", f"logit_bias must be an object of up to {MAX_LOGIT_BIAS} token ids to "
                                         f"biases, got {shown(value)}")
    biases = {}
    for key, bias in value.items():
        if not (isinstance(key, str) and key.isascii() and key.isdigit() and int(key) < 2**31):
            raise BadParameter("logit_bias", f"logit_bias keys must be token ids (non-negative integers), "
                                             f"got {shown(key)}")
        if not is_number(bias) or not -MAX_BIAS <= bias <= MAX_BIAS:
            raise BadParameter("logit_bias", f"logit_bias[{key}] must be a number in [-{MAX_BIAS:g}, {MAX_BIAS:g}], "
                                             f"got {shown(bias)}")
        biases[int(key)] = float(bias)
    return biases
