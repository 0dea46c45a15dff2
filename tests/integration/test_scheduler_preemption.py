"""KV exhaustion on a real worker: sequences are preempted (blocks freed, recomputed later) and
every stream still gets exactly the model's tokens, once each."""

from __future__ import annotations

import threading
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from infermesh.v1 import common_pb2
from tools.testbed.generator_models import GENERATOR_MODELS
from tools.testbed.processes import free_port, running_mesh
from tools.testbed.scheduler_fixtures import read_stream, scheduler_stub, wait_for_idle_kv, wait_for_workers

pytestmark = pytest.mark.integration


@pytest.mark.parametrize("model_name", sorted(GENERATOR_MODELS))
def test_streams_are_exact_when_kv_blocks_run_out_and_sequences_are_preempted(tmp_path, model_name):
    model = GENERATOR_MODELS[model_name]
    prompts = ["abc", "fgh", "mno", "tuv"]
    num_tokens = 60  # 63 tokens need 4 blocks of 16 each; the worker has 6 blocks for all four
    metrics_port = free_port()
    with running_mesh(tmp_path) as mesh:
        mesh.start_scheduler("--metrics-port", str(metrics_port))
        mesh.start_worker(model.name, *model.worker_args(5, "--num-kv-blocks", "6"))
        with scheduler_stub(mesh.scheduler.address) as stub:
            wait_for_workers(stub, model.ref, 1)
            records: dict[str, object] = {}

            def run(prompt: str) -> None:
                records[prompt] = read_stream(stub.Generate(model.request(prompt, num_tokens), timeout=30))

            threads = [threading.Thread(target=run, args=(prompt,)) for prompt in prompts]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join(timeout=30)
            for prompt in prompts:
                record = records[prompt]
                assert record.text == model.continuation(prompt, num_tokens), prompt
                assert record.indexes == list(range(num_tokens))
                assert record.finish_reason == common_pb2.FINISH_REASON_LENGTH
            wait_for_idle_kv(stub, model.ref)
        text = urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=5).read().decode()
        preemptions = [s.value for f in text_string_to_metric_families(text) for s in f.samples
                       if s.name == "infermesh_scheduler_preemptions_total" and s.labels == {"model": model.name}]
        assert preemptions and preemptions[0] >= 1
