"""Every scheduler briefly unavailable: the gateway holds its calls and loses none (issue 35).

With client resends off (no gRPC retries, no stream re-sent by the client), the gateway alone must
keep every call whose deadline allows a wait. The one resend left on is that of an overload refusal
after its retry hint (tools/testbed/mesh_load.py; docs/operations.md, "Overload refusals"): three of
these runs at once on 2 cores filled the classifier's adaptive limit during the third outage (57 in
flight at 30/s, ~1.9 s a call on the starved box) and 1 run in 9 had 80 classify refused
RESOURCE_EXHAUSTED with a 0.06 s hint, which is admission working, not a call lost to the faults.

Two schedulers, two workers of each model, one gateway, open-loop classify and long streams with
generous deadlines, then three outages:

  1. both schedulers frozen (SIGSTOP) for ~2 s: the calls in flight wait on them;
  2. both killed (SIGKILL), then restarted on their ports: every call, and every stream's resume,
     finds no scheduler to take it, and is held until one can;
  3. one killed and restarted while the other is frozen.

Every classify is answered and every stream's text is exact. During the second outage a classify
whose deadline is shorter than the outage fails DEADLINE_EXCEEDED, not UNAVAILABLE. The gateway's
held-call counter shows calls were held. The gateway runs at its defaults: while both schedulers are
frozen the silence watch severs the last one too (the hold is on), so the calls wait in the hold, out
of the model's adaptive limit, rather than upstream, where at 30/s they filled the standard part of
the default limit (57 of 64) within the freeze; and held calls sent again do not retake their slots,
which took the model past its limit and had new calls refused while they drained. No throughput
figure or tight time bound is asserted.

One setting is off the defaults, as for every gateway the suite starts (tests/conftest.py, TEST_GATEWAY_ENV):
the standard class's TTFT target is 30 s, not 2 s. After the restarts the
resumed streams re-prefill together, and on a loaded 2-core box (two of these runs at once, or the suite) the
gateway then predicts a new standard stream's first token past 2 s and refuses it at admission, as it should
(issue 36); this test would count that refusal as a lost call. Holding calls through outages is what it checks,
not admission on predicted latency (tests/unit/gateway for that): 4 of 26 runs two at a time failed so at the
defaults (b15c3c0, before this change, 1 of 6); with 30 s, 8 of 8 passed.
"""

from __future__ import annotations

import signal
import time

import grpc
import pytest

from infermesh.v1 import gateway_pb2, gateway_pb2_grpc
from tests.reliability.chaos import lost_report
from tools.testbed import session_tls
from tools.testbed.mesh_load import BRIGHT, CLASSIFIER, LoadShape, StreamSpec
from tools.testbed.mesh_replicas import MODELS, replicated_mesh

pytestmark = pytest.mark.integration

OUTAGE_S = 2.0
# 300 tokens at 20 ms a step: ~6 s a stream, so streams run through each outage mid-way.
STREAMS = (StreamSpec("abc", 300), StreamSpec("mesh", 300, seed=12345), StreamSpec("hello", 80),
           StreamSpec("xyz", 80, seed=99))
SHAPE = LoadShape(classify_per_s=30, streams_per_s=3, classify_deadline_s=20.0, stream_deadline_s=40.0,
                  streams=STREAMS, client_resumes_streams=False, client_retries=False)
# Shorter than the outage, which lasts until this call has failed (the schedulers restart after it). 1.5 s, not the
# 0.8 s it was: on a slow box under the suite's load the gateway found too little of 0.8 s left to hold the call and
# failed it at once with the cause (UNAVAILABLE "circuit open"), as it should when a hold could not end in time.
SHORT_DEADLINE_S = 1.5


def _short_classify(target: str) -> grpc.RpcError | None:
    """A classify with a deadline shorter than the outage: its error (None if it was answered)."""
    with session_tls.channel(target) as channel:
        grpc.channel_ready_future(channel).result(timeout=30)  # the TLS handshake is not the call's deadline
        stub = gateway_pb2_grpc.InferenceStub(channel)
        request = gateway_pb2.ClassifyRequest(model=CLASSIFIER, image=BRIGHT, request_id="short")
        try:
            stub.Classify(request, timeout=SHORT_DEADLINE_S)
        except grpc.RpcError as exc:
            return exc
    return None


def test_calls_are_held_while_every_scheduler_is_unavailable_and_none_is_lost(tmp_path):
    with replicated_mesh(tmp_path) as mesh:
        mesh.add_schedulers(2)
        mesh.add_workers(MODELS)
        gateway = mesh.add_gateway()
        mesh.wait_spread(MODELS)
        load = mesh.start_load(SHAPE)
        load.wait_completed(20, "before the faults")

        for scheduler in mesh.schedulers:
            scheduler.signal(signal.SIGSTOP)
        try:
            time.sleep(OUTAGE_S)  # the calls in flight wait on the frozen schedulers meanwhile
        finally:
            for scheduler in mesh.schedulers:
                scheduler.signal(signal.SIGCONT)
        load.wait_completed(30, "after both schedulers were frozen")

        for scheduler in mesh.schedulers:
            scheduler.signal(signal.SIGKILL)
        for scheduler in mesh.schedulers:
            scheduler.proc.wait(timeout=10)
        short = _short_classify(gateway.address)  # no scheduler runs until it has failed
        for scheduler in list(mesh.schedulers):
            mesh.restart(scheduler)  # on its port; SERVING before this returns
        mesh.wait_spread(MODELS)
        load.wait_completed(30, "after both schedulers were restarted")

        first, second = mesh.schedulers
        second.signal(signal.SIGSTOP)
        try:
            first.signal(signal.SIGKILL)
            first.proc.wait(timeout=10)
            mesh.restart(first)
        finally:
            second.signal(signal.SIGCONT)
        mesh.wait_spread(MODELS)
        load.wait_completed(30, "after one was restarted while the other was frozen")
        counts = load.stop()

        held = mesh.metric(gateway, "infermesh_gateway_held_calls_total", result="held")
        redispatched = mesh.metric(gateway, "infermesh_gateway_redispatches_total", cause="held")
        print(f"held while no scheduler could take them: {held:g}, re-dispatched from the hold: {redispatched:g}; "
              f"short-deadline call: {None if short is None else (short.code().name, short.details())}")
        print(lost_report(counts, num_examples=3))
        counts.assert_nothing_lost("both schedulers frozen, both killed and restarted, one restarted while the other "
                                   "was frozen", mesh.logs,
                                   min_classify=50)
        assert held > 0 and redispatched > 0, "calls arrived while both schedulers were down: nothing was tested"
        assert short is not None and short.code() == grpc.StatusCode.DEADLINE_EXCEEDED, (
            f"a call whose deadline is shorter than the outage: {short and (short.code(), short.details())}")
