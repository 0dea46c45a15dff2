"""Opens the Target a URL names, after checking that the scenario's classes can go there."""

from __future__ import annotations

from loadtest.runner import Clock
from loadtest.scenario import RequestKind, Scenario
from loadtest.targets import kserve_http, openai_http
from loadtest.targets.address import TargetKind, parse_target
from loadtest.targets.base import Target
from loadtest.targets.token_count import token_counter


def open_target(url: str, scenario: Scenario, clock: Clock, run_id: str, ca_file: str = "") -> Target:
    """Raises ValueError for a bad URL, a class the kind cannot serve, or an unreadable CA file/tokenizer."""
    address = parse_target(url)
    if address.kind is TargetKind.INFERMESH_GRPC:
        for c in scenario.classes:
            if c.kind is RequestKind.TENSOR:
                raise ValueError(f"class {c.name!r} is tensor: infermesh.v1 ({url}) has Classify and Generate only; "
                                 f"send tensor classes to kserve+grpc:// or kserve+http:// (KServe v2 ModelInfer)")
        from loadtest.targets.infermesh_grpc import GatewayClient

        return GatewayClient(address.host_port, clock, scenario.load.num_channels, run_id, ca_file=ca_file)
    if address.kind is TargetKind.OPENAI_HTTP:
        openai_http.check_classes(scenario.classes, url)
        return openai_http.OpenAITarget(address, token_counter(scenario.tokenizer), clock, run_id, ca_file)
    if address.kind is TargetKind.KSERVE_HTTP:
        kserve_http.check_classes(scenario.classes, url)
        return kserve_http.KServeHttpTarget(address, clock, run_id, ca_file)
    from loadtest.targets.kserve_grpc import KServeGrpcTarget

    return KServeGrpcTarget(address.host_port, token_counter(scenario.tokenizer), clock, run_id, ca_file)
