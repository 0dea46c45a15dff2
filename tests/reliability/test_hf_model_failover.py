"""A Hugging Face checkpoint's seeded stream survives the SIGKILL of its scheduler with the same tokens.

Two schedulers, one gateway and one worker serving a tiny qwen2 checkpoint (imported as
`infermesh models import` does), everything given both scheduler addresses. A seeded sampling
stream is read once unbroken, then again with the scheduler serving it killed after 16 tokens:
the worker re-attaches to the other scheduler (sending its tokenizer again), the gateway resumes
the stream there as a continuation of the tokens the client holds, and the client reads one
stream whose tokens equal the unbroken one's.

The resumed scheduler recomputes the delivered tokens' keys and values by prefill where the unbroken
stream wrote them one decode at a time; the two differ in their last bits, so a sampled token whose
draw falls that close to a boundary between two tokens can differ. At 900 tokens the stream met such a
token at position 672 (2026-12-01, with the old and the new code alike, whatever the resume point):
the test is held to 400 tokens, well under way when the kill lands, and fewer chances of that tie.
"""

from __future__ import annotations

import signal
import threading

import pytest

from infermesh.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc
from services.worker.repository.hf_import import ImportOptions, import_checkpoint
from tests.support.hf_checkpoints import save_model_directory
from tools.testbed import session_tls
from tools.testbed.mesh_replicas import replicated_mesh
from tools.testbed.processes import wait_until

pytestmark = pytest.mark.integration

MODEL = "tiny-qwen2"
PROMPT = "Grüße aus Köln, and the dog sleeps on."
NUM_TOKENS = 400  # long enough to be under way when its scheduler dies (see the docstring on why not longer)


class Reader(threading.Thread):
    def __init__(self, gateway: str, seed: int) -> None:
        super().__init__()
        self.request = gateway_pb2.GenerateRequest(
            model=common_pb2.ModelRef(name=MODEL, version="1"), prompt=PROMPT,
            sampling=common_pb2.SamplingParams(max_tokens=NUM_TOKENS, temperature=0.9, seed=seed, ignore_eos=True))
        self.gateway = gateway
        self.token_ids: list[int] = []
        self.finish_reason = common_pb2.FINISH_REASON_UNSPECIFIED
        self.error: Exception | None = None

    def run(self) -> None:
        try:
            with session_tls.channel(self.gateway) as channel:
                for chunk in gateway_pb2_grpc.InferenceStub(channel).Generate(self.request, timeout=120):
                    assert not chunk.token_ids or chunk.index == len(self.token_ids), (chunk.index, len(self.token_ids))
                    self.token_ids += chunk.token_ids
                    self.finish_reason = chunk.finish_reason or self.finish_reason
        except Exception as exc:  # noqa: BLE001 - reported by the test
            self.error = exc


def test_a_seeded_stream_continues_with_the_same_tokens_after_its_scheduler_is_killed(tmp_path):
    checkpoint, root = tmp_path / "checkpoint", tmp_path / "model_repo"
    save_model_directory(checkpoint, "qwen2", seed=3, std=0.5, max_position_embeddings=1024)
    import_checkpoint(checkpoint, root, ImportOptions(MODEL, "1", kv_cache_bytes=1 << 20))
    with replicated_mesh(tmp_path, env={"HF_HUB_OFFLINE": "1"}) as mesh:
        mesh.add_schedulers(2)
        mesh.add_worker(MODEL, "--model-repository", str(root), "--model-version", "1")
        mesh.add_gateway()
        mesh.wait_attached([MODEL], 1)
        gateway = mesh.gateways[0].address

        unbroken = Reader(gateway, seed=11)
        unbroken.run()
        assert unbroken.error is None and len(unbroken.token_ids) == NUM_TOKENS

        broken = Reader(gateway, seed=11)
        broken.start()
        wait_until(lambda: len(broken.token_ids) >= 16 or not broken.is_alive(), timeout_s=30,
                   message="the stream under way")
        (victim,) = [s for s in mesh.schedulers if mesh.num_workers(s, MODEL) == 1]
        victim.signal(signal.SIGKILL)
        victim.proc.wait(timeout=10)
        broken.join(timeout=120)
        assert broken.error is None, f"{broken.error}\n{mesh.logs()}"
        assert len(broken.token_ids) == NUM_TOKENS and broken.finish_reason == common_pb2.FINISH_REASON_LENGTH
        assert broken.token_ids == unbroken.token_ids
        resumed, _ = mesh.gateway_failovers()
        assert resumed >= 1, "the stream was under way on the killed scheduler: it must have been resumed"
