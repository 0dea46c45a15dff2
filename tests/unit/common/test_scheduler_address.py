"""--scheduler-address, one parser for the gateway and the worker (services/common/scheduler_address.py)."""

from __future__ import annotations

import pytest

from services.common.scheduler_address import SchedulerAddress, SchedulerAddressError, parse_scheduler_address


def test_parses_a_fixed_list_of_endpoints():
    target = parse_scheduler_address("10.0.0.5:50052, sched-b:50053")
    assert target == SchedulerAddress(endpoints=("10.0.0.5:50052", "sched-b:50053"))
    assert not target.is_dns and not target.is_single


def test_one_fixed_endpoint_is_single():
    assert parse_scheduler_address("127.0.0.1:50052") == SchedulerAddress(endpoints=("127.0.0.1:50052",))
    assert parse_scheduler_address("127.0.0.1:50052").is_single


def test_parses_a_dns_target():
    target = parse_scheduler_address("dns:///infermesh-scheduler-discovery:50052")
    assert (target.dns_name, target.port, target.endpoints, target.is_dns, target.is_single) == (
        "infermesh-scheduler-discovery", 50052, (), True, False)


def test_brackets_ipv6_literals_as_grpc_dials_them():
    assert parse_scheduler_address("[::1]:50052").endpoints == ("[::1]:50052",)


# The gateway's and the worker's parsers differed on three inputs until issue 32: an empty entry
# ("'' is not host:port" at the gateway), a doubled endpoint (silently dropped by the worker) and
# an unknown scheme (two wordings). One parser now: the empty entry is named as such, a doubled
# endpoint is refused on both (a typo either way), and the scheme message carries both wordings.
@pytest.mark.parametrize(("text", "problem"), [
    ("sched", "'sched' is not host:port"),
    ("a:1,a:1", "lists an endpoint twice"),
    ("a:1, b:2,a:1", "lists an endpoint twice"),
    ("a:0", "'a:0' is not host:port with a port in 1..65535"),
    ("a:x", "'a:x' is not host:port"),
    ("a:1,", "has an empty entry"),
    ("a:1,,b:2", "has an empty entry"),
    ("dns:///name", "'name' is not host:port"),
    ("http://a:1", "unknown scheme, only the dns:/// scheme is supported"),
])
def test_refuses_unusable_addresses_naming_the_part(text, problem):
    with pytest.raises(SchedulerAddressError, match=problem):
        parse_scheduler_address(text)
