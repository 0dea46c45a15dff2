"""Batched prompts on /v1/completions: the prompt list checked, parts made, answers joined (no transport)."""

from __future__ import annotations

import pytest

from services.gateway.fronts import openai_batch, openai_codec
from services.gateway.fronts.openai_params import BadParameter


def test_a_string_or_a_list_of_strings_is_a_prompt_list():
    assert openai_batch.completion_prompts("a") == ("a",)
    assert openai_batch.completion_prompts(["a", "b"]) == ("a", "b")


@pytest.mark.parametrize(("value", "message"), [
    ([1, 2], "token-id prompts are not supported"), ([[1], [2]], "token-id prompts are not supported"),
    ([], "must not be an empty list"), ("", "prompt must not be empty"), (["a", ""], "prompt[1] must not be empty"),
    (None, "prompt is required"), ({"a": 1}, "prompt must be a string or a list of strings"), (["a", 1], "a list of strings"),
])
def test_bad_prompts_name_the_parameter(value, message):
    with pytest.raises(BadParameter) as refused:
        openai_batch.completion_prompts(value)
    assert refused.value.param == "prompt" and message in str(refused.value)


def test_a_batch_of_one_is_a_plain_request_and_of_more_one_part_per_prompt():
    one = openai_codec.parse_completion({"model": "m", "prompt": ["only"]})
    assert one.batch_prompts == () and openai_batch.prompt_parts(one) == [one]
    parsed = openai_codec.parse_completion({"model": "m", "prompt": ["x", "y", "z"], "n": 2, "seed": 4})
    parts = openai_batch.prompt_parts(parsed)
    assert [p.generate.prompt for p in parts] == ["x", "y", "z"]
    rid = parsed.generate.request_id
    assert rid and [p.generate.request_id for p in parts] == [rid, f"{rid}-p1", f"{rid}-p2"]
    assert all(p.n == 2 and p.generate.sampling.seed == 4 and not p.batch_prompts for p in parts)


def test_prompts_times_best_of_is_bounded():
    openai_codec.parse_completion({"model": "m", "prompt": ["a"] * 16, "best_of": 4})
    with pytest.raises(BadParameter, match="17 prompts x 4 choices each is 68 sequences"):
        openai_codec.parse_completion({"model": "m", "prompt": ["a"] * 17, "best_of": 4})


def _usage(prompt: int, completion: int, cached: int) -> dict:
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached}}


def test_answers_are_joined_prompt_after_prompt_with_usage_summed():
    bodies = [{"id": "cmpl-r", "choices": [{"index": 0, "text": "a0"}, {"index": 1, "text": "a1"}],
               "usage": _usage(3, 4, 0)},
              {"id": "cmpl-r-p1", "choices": [{"index": 0, "text": "b0"}, {"index": 1, "text": "b1"}],
               "usage": _usage(5, 6, 2)}]
    joined = openai_batch.batch_response(bodies, 2)
    assert joined["id"] == "cmpl-r"
    assert [(c["index"], c["text"]) for c in joined["choices"]] == [(0, "a0"), (1, "a1"), (2, "b0"), (3, "b1")]
    assert joined["usage"] == _usage(8, 10, 2)
    assert openai_batch.batch_response(bodies[:1], 2) is bodies[0]
