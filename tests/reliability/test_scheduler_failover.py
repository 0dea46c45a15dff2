"""A generator worker SIGKILLed mid-stream: its sequences are recomputed elsewhere and every
client's stream continues with exactly the model's tokens, none repeated, none skipped.

The toy generator is deterministic ("abc" continues "defgh..."), and so is the mock generator
(tokens from seed, position and last token, on a timer), so the exact text is known. Both run.
"""

from __future__ import annotations

import signal
import time

import pytest

from infermesh.v1 import common_pb2
from tests.support.stream_reader import StreamReader
from tools.testbed.generator_models import GENERATOR_MODELS, GeneratorModel
from tools.testbed.processes import running_mesh, wait_until
from tools.testbed.scheduler_fixtures import pressure_of, scheduler_stub, wait_for_idle_kv, wait_for_workers

pytestmark = pytest.mark.integration

NUM_TOKENS = 120
# Each stream's deadline, and how long the test waits for it: ample for 120 tokens with a worker serving.
STREAM_TIMEOUT_S = 30.0


@pytest.fixture(params=sorted(GENERATOR_MODELS))
def model(request) -> GeneratorModel:
    return GENERATOR_MODELS[request.param]


def _start_readers(stub, model: GeneratorModel, prompts: list[str], timeout_s: float = STREAM_TIMEOUT_S,
                   ) -> list[StreamReader]:
    readers = [StreamReader(stub.Generate(model.request(prompt, NUM_TOKENS, who=f"t-{prompt}"), timeout=timeout_s),
                            prompt)
               for prompt in prompts]
    for reader in readers:
        reader.start()
    wait_until(lambda: all(r.num_tokens >= 8 for r in readers), timeout_s=10, message="every stream under way")
    return readers


def _settled_tokens(readers: list[StreamReader], quiet_s: float, timeout_s: float) -> list[int]:
    """The readers' token counts once none has moved for `quiet_s`; fails if they keep moving for `timeout_s`."""
    give_up = time.monotonic() + timeout_s
    counts = [r.num_tokens for r in readers]
    while time.monotonic() < give_up:
        time.sleep(quiet_s)
        now = [r.num_tokens for r in readers]
        if now == counts:
            return counts
        counts = now
    raise AssertionError(f"the streams kept moving for {timeout_s} s without a worker: {counts}")


def _assert_exact(readers: list[StreamReader], model: GeneratorModel, prompts: list[str], logs,
                  timeout_s: float = STREAM_TIMEOUT_S) -> None:
    for reader, prompt in zip(readers, prompts, strict=True):
        reader.join(timeout=timeout_s)
        assert reader.error is None, f"{prompt}: {reader.error}\n{logs()}"
        assert "".join(reader.text) == model.continuation(prompt, NUM_TOKENS)
        assert reader.num_tokens == NUM_TOKENS and reader.finish_reason == common_pb2.FINISH_REASON_LENGTH


def test_streams_continue_exactly_on_the_other_worker_when_theirs_is_killed(tmp_path, model):
    prompts = ["abc", "klm", "uvw", "fgh"]
    with running_mesh(tmp_path) as mesh:
        mesh.start_scheduler()
        doomed = mesh.start_worker(model.name, *model.worker_args(20), name="doomed")
        mesh.start_worker(model.name, *model.worker_args(20), name="survivor")
        with scheduler_stub(mesh.scheduler.address) as stub:
            wait_for_workers(stub, model.ref, 2)
            readers = _start_readers(stub, model, prompts)  # least loaded: two on each worker
            doomed.signal(signal.SIGKILL)
            _assert_exact(readers, model, prompts, mesh.logs)
            assert pressure_of(stub, model.ref).num_workers == 1
            wait_for_idle_kv(stub, model.ref)
        assert "recomputing 2 sequences elsewhere" in mesh.scheduler.log_tail(200)


def test_with_no_worker_left_streams_are_held_until_a_new_one_attaches(tmp_path, model):
    """The streams are held until their deadline, which must outlast the replacement worker's start: on
    a loaded box that took 6.8 s (load ~9) and 30 s (load 32, its first worker 12 s), so the deadline
    is derived from how long the first worker took to start and attach here, not fixed."""
    prompts = ["abc", "pqr"]
    with running_mesh(tmp_path) as mesh:
        mesh.start_scheduler()
        began_s = time.monotonic()
        only = mesh.start_worker(model.name, *model.worker_args(20), name="only")
        with scheduler_stub(mesh.scheduler.address) as stub:
            wait_for_workers(stub, model.ref, 1, timeout_s=60)
            timeout_s = STREAM_TIMEOUT_S + 10 * (time.monotonic() - began_s)
            readers = _start_readers(stub, model, prompts, timeout_s)
            only.signal(signal.SIGKILL)
            wait_until(lambda: pressure_of(stub, model.ref).num_workers == 0, timeout_s=5, message="worker gone")
            # Tokens the worker made before its kill may still be on their way to the reader threads (a loaded
            # box read 1 more each after the scheduler counted it gone): once those are in, none may follow.
            held_at = _settled_tokens(readers, quiet_s=0.5, timeout_s=10)
            time.sleep(0.5)
            assert [r.num_tokens for r in readers] == held_at, "nothing streams without a worker"
            assert pressure_of(stub, model.ref).queue_depth == len(prompts), "both held, waiting"
            mesh.start_worker(model.name, *model.worker_args(20), name="replacement", wait=False)
            _assert_exact(readers, model, prompts, mesh.logs, timeout_s)
