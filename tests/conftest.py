"""Shared fixtures: a toy mesh of real processes for contract and integration tests."""

from __future__ import annotations

import os
from collections import Counter

import pytest
from opentelemetry import context as otel_context

from infermesh.v1 import gateway_pb2_grpc
from services.common import log_context
from tests.support import side_venv
from tools.testbed import fork_server, processes, session_tls
from tools.testbed.processes import Mesh, running_mesh

# The gateways the tests start hold the standard class's streams to a 30 s TTFT target (the sheddable class's
# to 60 s), not the product's 2 s (10 s): tests that are not about latency admission (rollouts, grammars,
# failover, drains) were refused "would start a standard stream in 2059-2264 ms at best, past its TTFT target
# 2000 ms" on slow boxes under the suite's load, one newly found per fresh-clone run (issue 36's notes), and
# each had been given the flag by hand. Tests of admission set their own targets (flags and request headers
# win); the critical class keeps its 1 s.
TEST_GATEWAY_ENV = {"INFERMESH_GATEWAY_SLO_TTFT_MS": "1000,30000,60000"}


@pytest.fixture(autouse=True)
def no_request_context_across_tests():
    """Every test starts with no request ids bound and no current span, and leaves none behind. A test that
    drives a handler's parts in its own thread, outside the task a handler runs in (Admission.admit binds the
    tenant; a span entered and not left stays current), would otherwise leave them on the lines of whichever test
    its pytest process runs next: CI's run of stop 46 failed 6 of test_log_context's tests that way, depending on
    which files pytest-xdist handed to the same process before it."""
    bound = log_context._bound.set(None)  # noqa: SLF001 - the tests' reset, not an API
    attached = otel_context.attach(otel_context.Context())
    yield
    otel_context.detach(attached)
    log_context._bound.reset(bound)  # noqa: SLF001


@pytest.fixture(scope="session")
def toy_mesh(tmp_path_factory) -> Mesh:
    """Scheduler + gateway + one toy classifier and one toy generator worker, one for the session: the
    modules that use it (contract tests, test_mesh.py) send it bad input and fake workers but never kill,
    restart or reconfigure a process, and each start and stop costs seconds on a loaded 2-core machine."""
    tmp = tmp_path_factory.mktemp("toy-mesh")
    with running_mesh(tmp) as mesh:
        mesh.start_scheduler()
        mesh.start_worker("toy-classifier")
        # 2 ms of compute a step: "one step alone" then stays above 1 ms on any CPU. With none, the step-time
        # fit for a lone one-token step fell below 1 ms once in a suite run, and a 1 ms TPOT target was served
        # instead of refused (test_latency_objectives: a test on the box's speed).
        mesh.start_worker("toy-generator", "--toy-compute-ms", "2")
        mesh.start_gateway("--max-message-bytes", str(256 * 1024))
        yield mesh


@pytest.fixture
def gateway_stub(toy_mesh: Mesh):
    with session_tls.channel(toy_mesh.gateway.address) as channel:
        yield gateway_pb2_grpc.InferenceStub(channel)


def pytest_configure(config) -> None:
    """OpenMP threads (torch's, and Numba's OpenMP layer) sleep when idle instead of spinning, in the
    test processes and in every service process they start (which inherit the environment). Set before
    any test module loads torch. The suite runs more processes than the 2-core machine has cores, and a
    spinning thread takes CPU from the thread with work: transformers' greedy reference for 6 prompts
    took 2.8-4.0 s of CPU (21-36 s wall, load ~18) with the default policy, 0.28 s (0.5 s) passive.
    Results are the same: the policy changes how threads wait, not how work is split."""
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    processes.GATEWAY_ENV_DEFAULTS.update(TEST_GATEWAY_ENV)
    # Services forked from a warm interpreter (tools/testbed/fork_server.py): ~0.3 s less CPU per start, ~480
    # starts. INFERMESH_TEST_FORK_SERVER=0 starts each cold, with Popen, as before.
    processes.FORK_SERVER = os.environ.get("INFERMESH_TEST_FORK_SERVER", "1") != "0"


def pytest_collection_finish(session) -> None:
    """The side venvs (tests/support/side_venv.py) the collected tests need start building now, in the
    background, instead of when their first test asks. Not for --collect-only (make test's compile-suite):
    nothing runs, and its pip would be stopped half done."""
    if session.config.option.collectonly:
        return
    for venv in _side_venvs_first_needed_first(session):
        side_venv.prebuild(*venv)


def _side_venvs_first_needed_first(session) -> list[tuple]:
    """The SIDE_VENVs of the collected modules, in the order the session first needs them (they build one after
    the other). One process runs the modules in collection order; pytest-xdist's --dist loadfile hands out the
    files with the most tests first. In collection order ray[serve] (test_loadtest_peer.py, 4 tests, run late)
    built first, and on a fresh clone a process reached the openai tests (the files of 13-38 tests, handed out
    early) and waited ~65 s for it."""
    num_tests = Counter(item.module for item in session.items if hasattr(item, "module"))
    first_needed: dict[tuple, int] = {}
    for position, (module, count) in enumerate(num_tests.items()):
        if hasattr(module, "SIDE_VENV"):
            order = -count if _most_tests_first(session.config) else position
            first_needed[module.SIDE_VENV] = min(first_needed.get(module.SIDE_VENV, order), order)
    return sorted(first_needed, key=first_needed.__getitem__)


def _most_tests_first(config) -> bool:
    """A pytest-xdist test process whose controller hands out the files with the most tests first."""
    return getattr(config, "workerinput", {}).get("most_tests_first", False)


@pytest.hookimpl(optionalhook=True)
def pytest_configure_node(node) -> None:
    """pytest-xdist's controller, starting a test process: tell it how the files are handed out (a test
    process reads its controller's options as "no distribution")."""
    config = node.config
    node.workerinput["most_tests_first"] = (config.getoption("dist") in ("loadfile", "loadscope")
                                            and config.getoption("loadscopereorder"))


def pytest_sessionfinish(session, exitstatus) -> None:
    side_venv.stop_building()
    fork_server.stop()
