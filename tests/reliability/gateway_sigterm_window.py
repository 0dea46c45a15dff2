"""The grpc/grpc#41785 window, measured: calls a gateway's SIGTERM fails, per step of the fix.

`python -m tests.reliability.gateway_sigterm_window`: one scheduler, one toy classifier worker,
two gateways; 16 tight-loop Classify callers on one channel over both gateways (round_robin and
the retry policy of docs/operations.md, with and without client-side health checking); each
gateway SIGTERMed and restarted in turn, 4 times, with and without the drain notice. Prints the
failed calls by code, per SIGTERM. Not a test (timing, load): figures in docs/operations.md.
"""

from __future__ import annotations

import asyncio
import signal
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path

import grpc

from infermesh.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc
from tools.testbed import session_tls
from tools.testbed.mesh_load import BRIGHT, channel_options
from tools.testbed.mesh_replicas import ReplicatedMesh, replicated_mesh
from tools.testbed.processes import wait_until

NUM_CALLERS = 16
NUM_SIGTERMS = 4


async def _callers(target: str, health_check: bool, codes: Counter, stop: threading.Event) -> None:
    async with session_tls.aio_channel(target, options=channel_options(5, health_check)) as channel:
        stub = gateway_pb2_grpc.InferenceStub(channel)
        request = gateway_pb2.ClassifyRequest(model=common_pb2.ModelRef(name="toy-classifier"), image=BRIGHT)

        async def loop() -> None:
            while not stop.is_set():
                try:
                    await stub.Classify(request, timeout=5)
                    codes["OK"] += 1
                except grpc.aio.AioRpcError as exc:
                    codes[exc.code().name] += 1

        await asyncio.gather(*(loop() for _ in range(NUM_CALLERS)))


def _roll_one(mesh: ReplicatedMesh, index: int) -> None:
    gateway = mesh.gateways[index % 2]
    gateway.signal(signal.SIGTERM)
    gateway.proc.wait(timeout=30)
    new = mesh.restart(gateway)
    wait_until(lambda: mesh.metric(new, "infermesh_gateway_requests_total") >= 50, timeout_s=30,
               message="the restarted gateway serving")


def probe(notice_ms: float, health_check: bool) -> tuple[Counter, list[dict[str, int]]]:
    with tempfile.TemporaryDirectory() as tmp, replicated_mesh(Path(tmp)) as mesh:
        mesh.add_schedulers(1)
        mesh.add_worker("toy-classifier", "--toy-compute-ms", "0")
        for _ in range(2):
            mesh.add_gateway("--drain-notice-ms", f"{notice_ms:g}")
        codes: Counter = Counter()
        stop = threading.Event()
        thread = threading.Thread(target=lambda: asyncio.run(_callers(mesh.gateway_target, health_check, codes, stop)))
        thread.start()
        per_sigterm = []
        try:
            time.sleep(2)  # the callers reach both gateways
            for index in range(NUM_SIGTERMS):
                before = Counter(codes)
                _roll_one(mesh, index)
                per_sigterm.append({code: num - before[code] for code, num in codes.items()
                                    if code != "OK" and num > before[code]})
        finally:
            stop.set()
            thread.join()
        return codes, per_sigterm


def main() -> None:
    for notice_ms, health_check in [(0, False), (1000, False), (0, True), (1000, True)]:
        codes, per_sigterm = probe(notice_ms, health_check)
        failed = {code: num for code, num in codes.items() if code != "OK"}
        print(f"drain notice {notice_ms} ms, client health checking {health_check}: {sum(codes.values())} calls, "
              f"failed {failed}, per SIGTERM {per_sigterm}", flush=True)


if __name__ == "__main__":
    main()
