"""Issue 39's newest options at their edges, as plain functions (no processes): echo with
max_tokens 0 however its one upstream token ended, grammars that match no string, and
parallel_tool_calls' type on either endpoint."""

from __future__ import annotations

import dataclasses

import pytest

from infermesh.v1 import common_pb2, gateway_pb2
from services.gateway.fronts import openai_codec
from services.gateway.fronts.openai_choices import ChoiceResult

ECHO_ONLY = {"model": "m", "prompt": "ab", "echo": True, "max_tokens": 0}


def _last(reason: int) -> gateway_pb2.GenerateResponse:
    return gateway_pb2.GenerateResponse(text="d", finish_reason=reason,
                                        usage=common_pb2.Usage(prompt_tokens=2, completion_tokens=1))


# The one token generated upstream for echo with max_tokens 0 may be the end of sequence, or end a
# stop string: what the client sees is the prompt alone, cut by max_tokens 0, so "length" all the same.
@pytest.mark.parametrize("reason", [common_pb2.FINISH_REASON_EOS, common_pb2.FINISH_REASON_STOP,
                                    common_pb2.FINISH_REASON_LENGTH])
def test_echo_with_max_tokens_0_finishes_by_length_however_the_dropped_token_ended(reason):
    parsed = openai_codec.parse_completion(ECHO_ONLY)
    whole = openai_codec.full_response(parsed, 1, [ChoiceResult(["d"], [], _last(reason))])
    assert (whole["choices"][0]["text"], whole["choices"][0]["finish_reason"]) == ("ab", "length")
    streamed = openai_codec.stream_chunk(dataclasses.replace(parsed, stream=True), 1, _last(reason), True)
    assert (streamed["choices"][0]["text"], streamed["choices"][0]["finish_reason"]) == ("ab", "length")


def test_echo_with_max_tokens_0_leaves_a_streams_earlier_events_unfinished():
    parsed = dataclasses.replace(openai_codec.parse_completion(ECHO_ONLY), stream=True)
    first = openai_codec.stream_chunk(parsed, 1, gateway_pb2.GenerateResponse(text="d"), True)
    assert (first["choices"][0]["text"], first["choices"][0]["finish_reason"]) == ("ab", None)
