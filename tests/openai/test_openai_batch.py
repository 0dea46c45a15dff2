"""Batched prompts on /v1/completions: the prompt list checked, parts made, answers joined (no transport)."""

from __future__ import annotations

import pytest

from infermesh.v1 import common_pb2
from services.gateway.fronts import openai_batch, openai_codec
from services.gateway.fronts.openai_params import BadParameter


def test_a_string_or_a_list_of_strings_is_a_prompt_list():
    assert openai_batch.completion_prompts("a") == ("a",)
    assert openai_batch.completion_prompts(["a", "b"]) == ("a", "b")


def test_token_ids_are_one_prompt_and_lists_of_them_a_prompt_each():
    assert openai_batch.completion_prompts([5, 0, 7]) == ((5, 0, 7),)
    assert openai_batch.completion_prompts([[1, 2], [3]]) == ((1, 2), (3,))
    assert openai_batch.completion_prompts([2**32 - 1]) == ((2**32 - 1,),)


@pytest.mark.parametrize(("value", "message"), [
    ([], "must not be an empty list"), ("", "prompt must not be empty"), (["a", ""], "prompt[1] must not be empty"),
    ([[1], []], "prompt[1] must not be empty"), ([[]], "prompt must not be empty"),
    (None, "prompt is required"), ({"a": 1}, "prompt must be a string, a list of strings, a list of token ids"),
    (["a", 1], "(not a mix)"), (["a", [1]], "(not a mix)"), ([1, [2]], "(not a mix)"),
    ([1, -2], "prompt[1] must be a token id (an integer >= 0), got -2"),
    ([1, 2**32], "prompt[1] must be a token id"), ([1, True], "(not a mix)"), ([1.0], "(not a mix)"),
    ([[1], [2, "x"]], "prompt[1][1] must be a token id (an integer >= 0), got 'x'"),
    ([[1], [False]], "prompt[1][0] must be a token id"),
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


def test_token_prompts_go_upstream_as_prompt_token_ids():
    one = openai_codec.parse_completion({"model": "m", "prompt": [9, 8, 7]})
    assert (one.generate.prompt, list(one.generate.prompt_token_ids), one.batch_prompts) == ("", [9, 8, 7], ())
    assert not one.generate.sampling.HasField("prompt_logprobs")
    parts = openai_batch.prompt_parts(openai_codec.parse_completion({"model": "m", "prompt": [[1, 2], [3]]}))
    assert [(p.generate.prompt, list(p.generate.prompt_token_ids)) for p in parts] == [("", [1, 2]), ("", [3])]


def test_a_token_prompts_echo_asks_for_its_tokens_and_spells_them():
    """The gateway has no tokenizer: the echoed text is the prompt's tokens' bytes, which the prompt's
    logprobs carry (the first chunk's), so echo asks for them even without logprobs."""
    parsed = openai_codec.parse_completion({"model": "m", "prompt": [72, 105], "echo": True, "max_tokens": 0})
    assert parsed.generate.sampling.prompt_logprobs == 0
    assert openai_codec.parse_completion({"model": "m", "prompt": "Hi", "echo": True}).generate.sampling.HasField(
        "prompt_logprobs") is False
    positions = [common_pb2.PositionLogprobs(token=common_pb2.TokenLogprob(token_id=t, token_bytes=b, logprob=lp))
                 for t, b, lp in ((72, "H\u00e9".encode()[:2], float("nan")), (105, "\u00e9".encode()[1:] + b"!", -1.5))]
    choice = openai_codec.completion_choice(parsed, 0, "", (), "length", positions,
                                            openai_codec.LogprobsWriter(parsed))
    assert (choice["text"], choice["logprobs"]) == ("H\u00e9!", None)  # bytes split across tokens, decoded together
    with_logprobs = openai_codec.parse_completion({"model": "m", "prompt": [72, 105], "echo": True, "max_tokens": 1,
                                                   "logprobs": 1})
    assert with_logprobs.generate.sampling.prompt_logprobs == 1
    choice = openai_codec.completion_choice(with_logprobs, 0, "?", (), "length", positions,
                                            openai_codec.LogprobsWriter(with_logprobs))
    assert choice["text"] == "H\u00e9!?" and choice["logprobs"]["token_logprobs"] == [None, -1.5]


def test_prompts_times_best_of_is_bounded():
    openai_codec.parse_completion({"model": "m", "prompt": ["a"] * 512, "best_of": 4})
    with pytest.raises(BadParameter, match="513 prompts x 4 choices each is 2052 sequences; .* at most 2048"):
        openai_codec.parse_completion({"model": "m", "prompt": ["a"] * 513, "best_of": 4})


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
