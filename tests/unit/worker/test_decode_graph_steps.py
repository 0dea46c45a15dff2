"""Which steps replay a decode graph, on the CPU: the routing as pure logic, the executor with graphs
whose "replay" is their captured body run eagerly (the same packing, rows and padding), a replay
that fails, the buckets captured, and that a CPU worker never captures."""

from __future__ import annotations

import logging
from collections.abc import Sequence

import pytest
import torch

from services.common.config import ConfigError, load_config
from services.worker import model_runtime
from services.worker.config import WorkerConfig
from services.worker.decode_graph_steps import StepPath, build_decode_graphs, capture_buckets, step_path
from services.worker.model_runtime import GeneratorRuntime, load_repository_runtime
from services.worker.models.cuda_graphs import DecodeGraphs, graph_refusal
from services.worker.models.generator import Generator
from services.worker.models.llama_config import ExpertsConfig, LlamaFamilyConfig
from services.worker.models.llama_family import LlamaFamilyLM
from services.worker.models.paged import KVCache, PagedSequence
from services.worker.step_executor import StepExecutor
from services.worker.work import RunStep, SequenceOutput, SequenceStep

BLOCK_SIZE = 8
NUM_KV_BLOCKS = 32
BOS = 257
PROMPTS = ((BOS, *b"The value of "), (BOS, *b"A list"), (BOS, *b"Every function returns "))


class FakeGraphs:
    """The real refusal over buckets (1, 2, 4) and 16 blocks a sequence; `run` records the step and
    stands for a replay."""

    buckets = (1, 2, 4)

    def __init__(self) -> None:
        self.runs: list[int] = []

    def refusal(self, seqs: Sequence[PagedSequence]) -> str | None:
        return graph_refusal(seqs, self.buckets, 16, BLOCK_SIZE)

    def run(self, seqs: Sequence[PagedSequence], *, checked: bool = False) -> torch.Tensor:
        assert checked, "the executor routes by refusal() and says so, so the graphs do not ask again"
        self.runs.append(len(seqs))
        return torch.zeros(len(seqs), 4)


class BodyGraphs(DecodeGraphs):
    """Decode graphs whose replay is the captured body run eagerly on the static inputs (no GPU here)."""

    def __init__(self, executor: StepExecutor) -> None:
        super().__init__(executor.generator.lm, executor.cache, max_blocks_per_seq=16, buckets=(1, 2, 4))
        self.num_runs = 0

    def run(self, seqs: Sequence[PagedSequence], *, checked: bool = False) -> torch.Tensor:
        self.num_runs += 1
        return self.run_uncaptured(seqs, checked=checked)


class BrokenGraphs(BodyGraphs):
    def run(self, seqs: Sequence[PagedSequence], *, checked: bool = False) -> torch.Tensor:
        raise RuntimeError("CUDA error: an illegal memory access was encountered")


def decode(n: int, start: int = 9) -> list[PagedSequence]:
    return [PagedSequence((65,), start, (i,), needs_logits=True) for i in range(n)]


@pytest.mark.parametrize(("seqs", "path"), [
    (decode(1), StepPath.GRAPH),
    (decode(3), StepPath.GRAPH),  # padded to the bucket of 4
    (decode(4), StepPath.GRAPH),
    (decode(5), StepPath.EAGER),  # above the largest bucket
    ([], StepPath.EAGER),
    ([PagedSequence((65, 66, 67), 0, (0,), needs_logits=True)], StepPath.EAGER),  # a prefill chunk
    ([*decode(1), PagedSequence((65, 66), 0, (5,), needs_logits=True)], StepPath.EAGER),  # mixed
    ([PagedSequence((65,), 3, (0,), needs_logits=True, all_logits=True)], StepPath.EAGER),  # prompt logprobs
    ([PagedSequence((65,), 3, (0,), needs_logits=False)], StepPath.EAGER),  # no logits wanted
    ([PagedSequence((65,), 16 * BLOCK_SIZE, tuple(range(17)), needs_logits=True)], StepPath.EAGER),  # too long
])
def test_only_plain_decode_steps_within_the_buckets_take_the_graphs(seqs, path):
    assert step_path(seqs, FakeGraphs()) is path


def test_without_graphs_every_step_is_eager():
    assert step_path(decode(1), None) is StepPath.EAGER


@pytest.mark.parametrize(("max_batch_size", "max_num_seqs", "buckets"), [
    (32, 256, (1, 2, 4, 8, 16, 32)),
    (32, 16, (1, 2, 4, 8, 16)),  # no step has more than max_num_seqs sequences
    (12, 0, (1, 2, 4, 8, 12)),
    (1, 64, (1,)),
    (64, 64, (1, 2, 4, 8, 16, 32, 64)),
])
def test_buckets_are_powers_of_two_up_to_the_smaller_limit(max_batch_size, max_num_seqs, buckets):
    assert capture_buckets(max_batch_size, max_num_seqs) == buckets


def executor_of(tinylm) -> StepExecutor:
    return StepExecutor(tinylm.generator, NUM_KV_BLOCKS, BLOCK_SIZE, seed_source=lambda: 7)


def generate(executor: StepExecutor, num_steps: int) -> list[list[SequenceOutput]]:
    """Every prompt prefilled in one step, then `num_steps` decode steps of all of them; the outputs."""
    tables = [tuple(range(4 * i, 4 * i + 4)) for i in range(len(PROMPTS))]
    steps = [[SequenceStep(i, p, 0, t, reset_block_table=True, sample=True)
              for i, (p, t) in enumerate(zip(PROMPTS, tables, strict=True))]]
    results = []
    tokens = [list(p) for p in PROMPTS]
    for step_id in range(num_steps + 1):
        outputs, _ = executor.run(RunStep(step_id, tuple(steps[-1])))
        results.append(outputs)
        for seq, out in zip(tokens, outputs, strict=True):
            seq.append(out.token_id)
        steps.append([SequenceStep(i, (seq[-1],), len(seq) - 1, sample=True, num_generated=len(seq) - len(p))
                      for i, (seq, p) in enumerate(zip(tokens, PROMPTS, strict=True))])
    return results


def token_ids(results: list[list[SequenceOutput]]) -> list[list[int | None]]:
    return [[out.token_id for out in step] for step in results]


def logprobs(results: list[list[SequenceOutput]]) -> list[float | None]:
    return [out.logprob for step in results for out in step]


def test_decode_steps_replay_the_graphs_and_answer_as_the_eager_steps(tinylm):
    eager = executor_of(tinylm)
    graphed = executor_of(tinylm)
    graphs = BodyGraphs(graphed)
    graphed.use_decode_graphs(graphs)

    got, want = generate(graphed, 6), generate(eager, 6)
    assert token_ids(got) == token_ids(want)
    assert logprobs(got) == pytest.approx(logprobs(want), abs=1e-5)  # the same logits rows, rounding apart
    assert graphs.num_runs == 6  # the decode steps; the prefill step ran eagerly
    assert graphed.num_steps_by_path == {StepPath.GRAPH: 6, StepPath.EAGER: 1}
    assert eager.num_steps_by_path == {StepPath.GRAPH: 0, StepPath.EAGER: 7}


def test_a_failing_replay_turns_the_graphs_off_and_the_step_runs_eagerly(tinylm, caplog):
    eager = executor_of(tinylm)
    graphed = executor_of(tinylm)
    graphed.use_decode_graphs(BrokenGraphs(graphed))

    with caplog.at_level(logging.WARNING):
        assert generate(graphed, 3) == generate(eager, 3)  # every step eager, so equal to the last bit
    assert graphed.decode_graphs is None
    assert graphed.num_steps_by_path == {StepPath.GRAPH: 0, StepPath.EAGER: 4}
    assert [r.message for r in caplog.records if "CUDA graphs off" in r.message] == [
        "CUDA graphs off from now on, every step runs eagerly: a replay of 3 sequences failed: RuntimeError: "
        "CUDA error: an illegal memory access was encountered"]


def test_build_gives_no_graphs_for_a_cpu_cache(tinylm):
    cache = tinylm.generator.new_kv_cache(4, BLOCK_SIZE)
    assert build_decode_graphs(tinylm.generator, cache, max_batch_size=32, max_num_seqs=8) is None


def test_a_capture_that_raises_leaves_no_graphs_and_a_warning(tinylm, caplog):
    cache = KVCache(num_layers=1, num_blocks=2, block_size=BLOCK_SIZE, num_kv_heads=1, head_size=8)
    cache.device = torch.device("cuda")  # no GPU here: entering its device raises, as a failed capture would
    with caplog.at_level(logging.WARNING):
        assert build_decode_graphs(tinylm.generator, cache, max_batch_size=32, max_num_seqs=8) is None
    assert any(r.message.startswith("CUDA graphs off, every step runs eagerly: ") for r in caplog.records)


def test_a_mixture_of_experts_is_never_captured_and_the_log_says_why(caplog):
    config = LlamaFamilyConfig(architecture="MixtralForCausalLM", vocab_size=64, num_layers=1, d_model=16,
                               num_heads=2, num_kv_heads=1, head_size=8, d_ff=32, max_position_embeddings=64,
                               max_seq_len=64, experts=ExpertsConfig(num_experts=4, top_k=2, d_ff=32, layers=(0,),
                                                                     renormalize=True))
    generator = Generator(LlamaFamilyLM(config), max_seq_len=64, eos_token_id=0, bos_token_id=None)
    cache = generator.new_kv_cache(4, BLOCK_SIZE)
    cache.device = torch.device("cuda")  # no GPU here: the refusal comes before anything touches the device
    with caplog.at_level(logging.INFO):
        assert build_decode_graphs(generator, cache, max_batch_size=32, max_num_seqs=8) is None
    assert [r.message for r in caplog.records] == [
        "CUDA graphs off, every step runs eagerly: MixtralForCausalLM is a mixture of experts, whose rows per "
        "expert follow each step's routing (read on the host every layer), and a graph records fixed sizes "
        "and no host read"]


def test_a_cpu_worker_never_captures_graphs(model_root, monkeypatch):
    def capture(*args, **kwargs):
        raise AssertionError("a CPU worker must not capture decode graphs")

    monkeypatch.setattr(model_runtime, "build_decode_graphs", capture)
    config = WorkerConfig(model_repository=str(model_root), model_name="tinylm", num_kv_blocks=64)
    assert config.cuda_graphs  # on by default, and ignored on the CPU
    runtime = load_repository_runtime(config, num_threads=1)
    assert isinstance(runtime, GeneratorRuntime)
    runtime.load()


def test_a_runtime_given_a_graph_batch_on_the_cpu_still_captures_none(tinylm, monkeypatch):
    monkeypatch.setattr(model_runtime, "build_decode_graphs", lambda *a, **k: pytest.fail("captured on the CPU"))
    GeneratorRuntime(tinylm, num_kv_blocks=64, cuda_graph_max_batch_size=32).load()


@pytest.mark.parametrize(("argv", "env", "graphs"), [
    ([], {}, True),
    (["--cuda-graphs"], {}, True),
    (["--cuda-graphs", "off"], {}, False),
    (["--cuda-graphs", "false"], {"INFERMESH_WORKER_CUDA_GRAPHS": "true"}, False),
    ([], {"INFERMESH_WORKER_CUDA_GRAPHS": "0"}, False),
])
def test_cuda_graphs_is_a_boolean_setting_on_by_default(argv, env, graphs):
    assert load_config(WorkerConfig, "worker", argv, env).cuda_graphs is graphs


def test_the_largest_graph_batch_is_a_positive_setting():
    config = load_config(WorkerConfig, "worker", ["--cuda-graph-max-batch-size", "8"], {})
    assert config.cuda_graph_max_batch_size == 8
    assert WorkerConfig().cuda_graph_max_batch_size == 32
    with pytest.raises(ConfigError, match="cuda_graph_max_batch_size must be >= 1, got 0"):
        load_config(WorkerConfig, "worker", [], {"INFERMESH_WORKER_CUDA_GRAPH_MAX_BATCH_SIZE": "0"})
