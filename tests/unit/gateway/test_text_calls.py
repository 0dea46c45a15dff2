"""Tokenize and Detokenize at the gateway: the caller checked, a scheduler serving the model asked,
the next one when it cannot answer, and its answer or refusal passed on."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from infermesh.v1 import common_pb2, gateway_pb2
from services.common import errors
from services.gateway.calls.text_calls import TextCalls
from services.gateway.routing.table import Candidates, Endpoint, VersionRoute
from services.gateway.upstream.clients import AttemptError
from services.gateway.upstream.status import UpstreamCode


class FakeScheduler:
    def __init__(self, failure: AttemptError | None = None) -> None:
        self.failure = failure
        self.asked: list[gateway_pb2.TokenizeRequest] = []

    async def tokenize(self, request, timeout_s):
        self.asked.append(request)
        if self.failure is not None:
            raise self.failure
        return gateway_pb2.TokenizeResponse(model=request.model, token_ids=[1, 2])

    async def tokenizer_info(self, request, timeout_s):
        self.asked.append(request)
        return gateway_pb2.GetTokenizerInfoResponse(model=request.model, tokenizer_class="PreTrainedTokenizerFast")


class FakeTenant:
    def may_use(self, model_name: str) -> bool:
        return model_name != "secret"


class FakeTenants:
    def authenticate(self, authorization):
        if authorization != "key":
            raise errors.Unauthenticated("invalid API key")
        return FakeTenant()

    def check_model_allowed(self, tenant, model_name):
        if model_name == "secret":
            raise errors.PermissionDenied(f"tenant may not use model '{model_name}'")


def _calls(schedulers: dict[str, FakeScheduler], version: str = "2", generators: tuple[str, ...] = ()) -> TextCalls:
    class Routing:
        def candidates(self, model, wanted_version):
            if model == "nope":
                raise errors.NotFound("model 'nope' is not served here")
            endpoints = tuple(Endpoint(address) for address in schedulers)
            return Candidates(model, VersionRoute(version, endpoints), endpoints, discovered=False)

    admission = SimpleNamespace(parts=SimpleNamespace(tenants=FakeTenants(), routing=Routing()))
    clients = SimpleNamespace(get=lambda address: schedulers[address])
    return TextCalls(admission, clients, lambda: generators)  # type: ignore[arg-type]


def _tokenize(calls: TextCalls, model: str = "m", authorization: str = "key", version: str = ""):
    request = gateway_pb2.TokenizeRequest(model=common_pb2.ModelRef(name=model, version=version), prompt="hi")
    return asyncio.run(calls.tokenize(request, authorization, 5.0))  # type: ignore[arg-type]


def _failure(code: UpstreamCode, error: errors.InfermeshError) -> AttemptError:
    return AttemptError(error, code, None)


def test_the_routed_version_is_asked_and_a_scheduler_that_cannot_answer_is_passed_over():
    gone = FakeScheduler(_failure(UpstreamCode.UNAVAILABLE, errors.Unavailable("connection refused")))
    left = FakeScheduler(_failure(UpstreamCode.NOT_FOUND, errors.NotFound("model 'm' is not served here")))
    serving = FakeScheduler()
    reply = _tokenize(_calls({"a": gone, "b": left, "c": serving}))
    assert list(reply.token_ids) == [1, 2] and reply.model.version == "2"
    assert [s.asked[0].model.version for s in (gone, left, serving)] == ["2", "2", "2"]
    assert _tokenize(_calls({"c": serving}), version="7").model.version == "7"  # a pinned version stays


def test_a_refusal_of_the_request_itself_is_the_callers_at_once():
    bad = FakeScheduler(_failure(UpstreamCode.INVALID_ARGUMENT, errors.InvalidArgument("prompt must not be empty")))
    serving = FakeScheduler()
    with pytest.raises(errors.InvalidArgument, match="prompt must not be empty"):
        _tokenize(_calls({"a": bad, "b": serving}))
    assert serving.asked == []


def test_when_no_scheduler_answers_the_last_failure_says_why():
    gone = FakeScheduler(_failure(UpstreamCode.UNAVAILABLE, errors.Unavailable("connection refused")))
    with pytest.raises(errors.Unavailable, match="connection refused"):
        _tokenize(_calls({"a": gone}))
    with pytest.raises(errors.Unavailable, match="no scheduler serving model 'm' can be reached now"):
        _tokenize(_calls({}))


@pytest.mark.parametrize(("model", "authorization", "error"), [
    ("m", "wrong", errors.Unauthenticated), ("secret", "key", errors.PermissionDenied),
    ("nope", "key", errors.NotFound), ("", "key", errors.InvalidArgument),
])
def test_the_caller_and_the_model_are_checked_before_any_scheduler_is_asked(model, authorization, error):
    serving = FakeScheduler()
    with pytest.raises(error):
        _tokenize(_calls({"a": serving}), model=model, authorization=authorization)
    assert serving.asked == []


def test_no_model_named_means_the_callers_only_generator():
    serving = FakeScheduler()
    assert _tokenize(_calls({"a": serving}, generators=("m", "secret")), model="").model.name == "m"
    assert serving.asked[0].model.name == "m"
    with pytest.raises(errors.InvalidArgument, match=r"model.name is required: this gateway serves 2 generators "
                                                     r"\(m, n\) to this caller"):
        _tokenize(_calls({"a": serving}, generators=("n", "m", "secret")), model="")
    with pytest.raises(errors.InvalidArgument, match="serves no generator to this caller"):
        _tokenize(_calls({"a": serving}, generators=("secret",)), model="")


def test_tokenizer_info_asks_the_callers_only_generators_scheduler_as_tokenize_does():
    serving = FakeScheduler()
    calls = _calls({"a": serving}, generators=("m", "secret"))
    reply = asyncio.run(calls.tokenizer_info(gateway_pb2.GetTokenizerInfoRequest(), "key", 5.0))  # type: ignore[arg-type]
    assert (reply.model.name, reply.model.version, reply.tokenizer_class) == ("m", "2", "PreTrainedTokenizerFast")
    with pytest.raises(errors.Unauthenticated):
        asyncio.run(calls.tokenizer_info(gateway_pb2.GetTokenizerInfoRequest(), "wrong", 5.0))  # type: ignore[arg-type]


def test_a_scheduler_older_than_the_gateway_is_passed_over_and_alone_is_named_as_older():
    """Mid-roll a scheduler without the RPC answers UNIMPLEMENTED ("Method not found!"): the next one is asked,
    and with none left the caller is told why, not handed grpc's bare message as an internal error."""
    older = FakeScheduler(_failure(UpstreamCode.UNIMPLEMENTED, errors.Internal("Method not found!")))
    assert list(_tokenize(_calls({"a": older, "b": FakeScheduler()})).token_ids) == [1, 2]
    with pytest.raises(errors.Unavailable, match="scheduler a is older than this gateway .*UNIMPLEMENTED"):
        _tokenize(_calls({"a": older}))
