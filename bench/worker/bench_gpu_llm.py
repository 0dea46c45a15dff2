"""The medium random-weight Llama on a GPU (issue 40, part 3): greedy parity with the CPU, step time by
batch size, and the mesh against one process.

    python3 -m bench.worker.bench_gpu_llm [--output bench/results/gpu_llm.json] [--large] [--quick] [--device cpu]

Needs a CUDA device; without one it says so and exits 0. `--device cpu` runs every part with the CPU
standing in for the GPU (a smoke run of the code; add --quick for a tiny Llama, few tokens and small
batches). The model is bench_hf_llm's (12 layers, hidden 768, 12 heads over 4 KV heads, vocab 32000;
weights drawn there, nothing downloaded), made and imported as `infermesh models import` imports it.
Each part runs on its own: one that fails prints its traceback, is kept under "errors" in the JSON,
and the next part runs. The JSON is rewritten after every part, so a run cut short keeps what it had.

1. repository: the checkpoint made and imported (a kept --workdir reuses it).
2. parity: 16 prompts x 32 greedy tokens through the paged path, every prompt in the same steps with
   8-token prefill chunks (Generator.greedy_paged_batch, the golden check's path), each model loaded by
   the worker's loader: the CPU in float32 against the device in float32 (identical but for near ties,
   i.e. a CPU top-1/top-2 logit margin under the importer's GOLDEN_MIN_MARGIN) and in float16
   (reported, not expected identical). A divergence is given with the CPU's margin there and its logit
   gap to the device's pick.
3. steps: one paged step (Generator.step, the worker's forward) timed per decode batch size at a fixed
   context, and a 512-token prefill chunk: float16 on the device, float32 on the CPU at a few sizes; on
   a CUDA device also a "graphed" decode row, batches 1-32: the worker's decode graphs
   (build_decode_graphs: capture, then a replay checked against the eager step) over the same cache,
   each step as the worker runs it (host packing, two copies, replay, a copy of the logits).
4. mesh: gateway -> scheduler -> a worker with --device and --compute-dtype float16 (float32 where the
   float16 model fails its golden check, said in the JSON), against bench_hf_llm's one-process engine
   (the worker's StepExecutor on one compute thread) on the same device and dtype: output tokens/s with
   64 streams x 64 tokens at once, and TTFT / TPOT p50 and p99 one request at a time; the ratios
   mesh / one process. TTFT: send to the first chunk with tokens (one process: its prefill step); TPOT:
   a stream's (e2e - TTFT) / (tokens - 1), a mean: after its first token, the mesh's tokens come in
   bursts of up to the scheduler's --steps-per-command (4) decode steps.
   The one-at-a-time streams are also compared with one process's tokens.
   Then the worker is replaced by one with --cuda-graphs true (the first ran with false) and the mesh's
   burst and one-at-a-time streams run again with the same prompts (`cuda_graphs` in the JSON): tokens/s,
   TTFT and TPOT off against on, how many greedy streams are identical, and what the worker logged about
   its graphs (on a CPU both workers run eagerly).
5. large (--large): a ~1B Llama (16 layers, hidden 2048, 32 heads over 8 KV heads, intermediate
   5632), random weights drawn on the device, in the step table only.

Prints a table of step times and one of the mesh last; writes bench/results/gpu_llm.json.
"""

from __future__ import annotations

import argparse
import functools
import gc
import json
import os
import statistics
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# Every CPU this process may run on computes the CPU rows (BENCH_THREADS overrides), exported before
# bench_hf_llm exports it and torch loads.
os.environ.setdefault("BENCH_THREADS", str(len(os.sched_getaffinity(0))))

import grpc  # noqa: E402
import torch  # noqa: E402

from bench.harness.results import RESULTS_DIR, finite, write_report  # noqa: E402
from bench.harness.stats import ratio  # noqa: E402
from bench.worker.bench_hf_llm import CONFIG, MODEL, PROMPTS, THREADS, InProcess, repository  # noqa: E402
from bench.worker.gpu_llm_report import (  # noqa: E402
    Divergence,
    agreement,
    first_divergence,
    graphs_table,
    latency_summary,
    mesh_table,
    peak_decode,
    steps_table,
    tpot_s,
)
from bench.worker.prompts import PROMPTS as SENTENCES  # noqa: E402
from infermesh.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc  # noqa: E402
from services.worker.decode_graph_steps import build_decode_graphs  # noqa: E402
from services.worker.models.generator import Generator  # noqa: E402
from services.worker.models.llama_config import LlamaFamilyConfig  # noqa: E402
from services.worker.models.llama_family import LlamaFamilyLM  # noqa: E402
from services.worker.models.paged import KVCache, PagedSequence  # noqa: E402
from services.worker.repository.errors import GoldenCheckFailed  # noqa: E402
from services.worker.repository.golden import run_golden_check  # noqa: E402
from services.worker.repository.hf_import import GOLDEN_MIN_MARGIN  # noqa: E402
from services.worker.repository.loader import COMPUTE_DTYPES, load_model  # noqa: E402
from services.worker.thread_settings import set_library_threads  # noqa: E402
from tools.testbed.processes import Mesh, ServiceProcess, running_mesh  # noqa: E402

RESULTS_PATH = RESULTS_DIR / "gpu_llm.json"
FAST_DTYPE = "float16"  # the device's compute dtype for the step table and the mesh
TINY_MODEL = "tiny-llama"  # --quick's model: bench_hf_llm's made smaller, fast to make and to run on 2 cores
TINY_CONFIG = {**CONFIG, "vocab_size": 2048, "hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 2,
               "num_attention_heads": 4, "num_key_value_heads": 2}
LARGE_CONFIG = {**CONFIG, "hidden_size": 2048, "intermediate_size": 5632, "num_hidden_layers": 16,
                "num_attention_heads": 32, "num_key_value_heads": 8}
QUICK_LARGE_CONFIG = {**TINY_CONFIG, "hidden_size": 256, "num_attention_heads": 8}  # --quick --large: the code path
WORKER_START_S = 150.0  # a CUDA worker: imports, weights, the kernels' JIT compile, warm-up, golden check
STREAM_TIMEOUT_S = 120.0  # any one Generate stream
GRAPH_MAX_BATCH = 32  # the worker's default --cuda-graph-max-batch-size
GRAPH_SWITCHES = ("false", "true")  # the mesh's worker without decode graphs, then with them
# The mesh's gateway lets every stream of the saturated burst in: its adaptive limit starts at 64 and standard
# traffic may fill 0.9 of it (the rest are refused at once); latency objectives are not what is measured.
GATEWAY_ARGS = ("--slo-admission", "false", "--limit-initial", "1024", "--limit-min", "256")


@dataclass(frozen=True)
class Sizes:
    """How much each part runs: the full run's, or --quick's."""

    parity_prompts: int
    parity_tokens: int
    parity_prefill_chunk: int
    device_batches: tuple[int, ...]
    cpu_batches: tuple[int, ...]
    context: int  # tokens already cached for every decode row
    prefill_tokens: int
    repeats: int  # timed steps per row on the device (the CPU's fewer: its steps are slower)
    streams: int  # the mesh's saturated burst
    stream_tokens: int
    light_requests: int
    rounds: int  # mesh / one-process rounds, alternating


FULL = Sizes(16, 32, 8, (1, 2, 4, 8, 16, 32, 64, 128), (1, 8, 32), 256, 512, 20, 64, 64, 10, 2)
QUICK = Sizes(4, 8, 8, (1, 2, 4), (1, 2), 64, 64, 3, 4, 8, 2, 1)


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def free_device_memory() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def parity_prompts(tokenize: Callable[[str], tuple[int, ...]], count: int) -> list[tuple[int, ...]]:
    """`count` prompts of 1 to 4 of the tinylm sentences run together (a few to ~20 tokens), so that the
    longer ones prefill over several chunks."""
    return [tokenize("".join(SENTENCES[(i + k) % len(SENTENCES)] for k in range(1 + i % 4))) for i in range(count)]


def parity(root: Path, name: str, device: str, prompts: Sequence[tuple[int, ...]], sizes: Sizes) -> dict[str, Any]:
    """The CPU's float32 greedy streams against the device's in float32 and in float16."""
    cpu = load_model(root, name, "1", "cpu")
    block_size = cpu.manifest.envelope.block_size

    def streams(generator: Generator) -> list[list[int]]:
        return generator.greedy_paged_batch(prompts, [sizes.parity_tokens] * len(prompts), block_size=block_size,
                                            prefill_chunk=sizes.parity_prefill_chunk)

    want = streams(cpu.generator)
    report: dict[str, Any] = {"num_prompts": len(prompts), "num_new_tokens": sizes.parity_tokens,
                              "prefill_chunk": sizes.parity_prefill_chunk,
                              "prompt_tokens": [len(p) for p in prompts], "device": device}
    for dtype in ("float32", FAST_DTYPE):
        try:
            model = load_model(root, name, "1", device, compute_dtype=dtype)
            got = streams(model.generator)
            divergences = [divergence(cpu.generator, i, prompts[i], want[i], got[i]) for i in range(len(prompts))
                           if first_divergence(want[i], got[i]) is not None]
            report[dtype] = agreement(want, got, divergences, GOLDEN_MIN_MARGIN)
            print(f"parity {device} {dtype}: {report[dtype]['identical_streams']}/{len(prompts)} identical to the CPU",
                  flush=True)
            del model
        except Exception:
            report[dtype] = {"error": failed(f"parity {dtype}")}
        free_device_memory()
    return report


def divergence(cpu: Generator, index: int, prompt: Sequence[int], want: Sequence[int],
               got: Sequence[int]) -> Divergence:
    at = first_divergence(want, got)
    assert at is not None  # called for diverging streams only
    logits = cpu.dense_logits([*prompt, *want[:at]])[-1]
    top2 = torch.topk(logits, 2).values
    picked = float(logits[got[at]]) if at < len(got) else float("nan")
    return Divergence(index, at, float(top2[0] - top2[1]), float(top2[0]) - picked)


def time_steps(generator: Generator, model: str, device: str, dtype: str, batches: Sequence[int], sizes: Sizes,
               repeats: int) -> list[dict[str, Any]]:
    """Median step time of one decode step per batch size (each sequence one new token after `context`
    cached, own blocks) and of one prefill chunk, in a KV cache of their own."""
    block_size = 16
    blocks_each = -(-(sizes.context + 1) // block_size)
    prefill_blocks = -(-sizes.prefill_tokens // block_size)
    cache = generator.new_kv_cache(max(max(batches) * blocks_each, prefill_blocks), block_size)

    def timed(work: list[PagedSequence] | Callable[[], object], kind: str, batch: int, tokens: int,
              context: int) -> dict[str, Any]:
        run = work if callable(work) else lambda: generator.step(work, cache)
        for _ in range(min(3, repeats)):
            run()
        sync(device)
        samples = []
        for _ in range(repeats):
            began = time.perf_counter()
            run()
            sync(device)
            samples.append(time.perf_counter() - began)
        ms = statistics.median(samples) * 1e3
        return {"model": model, "device": device, "dtype": dtype, "kind": kind, "batch": batch, "tokens": tokens,
                "context": context, "step_ms": ms, "step_ms_min": min(samples) * 1e3, "repeats": repeats,
                "tokens_per_s": tokens / (ms / 1e3)}

    def decoding(batch: int) -> list[PagedSequence]:
        return [PagedSequence((65,), sizes.context, tuple(range(i * blocks_each, (i + 1) * blocks_each)), True)
                for i in range(batch)]

    rows = [timed(decoding(batch), "decode", batch, batch, sizes.context) for batch in batches]
    prefill = [PagedSequence(tuple(65 + i % 200 for i in range(sizes.prefill_tokens)), 0,
                             tuple(range(prefill_blocks)), True)]
    rows.append(timed(prefill, "prefill", 1, sizes.prefill_tokens, 0))
    if device.startswith("cuda"):
        rows += graphed_rows(generator, cache, model, [b for b in batches if b <= GRAPH_MAX_BATCH], decoding,
                             lambda run, batch: timed(run, "decode", batch, batch, sizes.context))
    return rows


def graphed_rows(generator: Generator, cache: KVCache, model: str, batches: Sequence[int],
                 decoding: Callable[[int], list[PagedSequence]],
                 timed: Callable[[Callable[[], object], int], dict[str, Any]]) -> list[dict[str, Any]]:
    """The decode rows again through the worker's decode graphs over `cache` (path "graph"); one row with
    an error when they cannot be built (the worker's warning says why, in this log)."""
    began = time.perf_counter()
    graphs = build_decode_graphs(generator, cache, max_batch_size=GRAPH_MAX_BATCH, max_num_seqs=0)
    if graphs is None:
        return [{"model": model, "path": "graph", "error": "build_decode_graphs gave none (its warning says why)"}]
    capture_s = time.perf_counter() - began
    rows = []
    for batch in batches:
        seqs = decoding(batch)
        row = timed(functools.partial(graphs.run, seqs), batch)
        rows.append({**row, "path": "graph", "graph_build_s": capture_s})
    print(f"steps graphed: buckets {graphs.buckets} built in {capture_s:.1f} s", flush=True)
    return rows


def steps(root: Path, name: str, device: str, sizes: Sizes, compute: ThreadPoolExecutor) -> list[dict[str, Any]]:
    """The step table of the imported model: FAST_DTYPE on the device, float32 on the CPU (on the compute
    thread, as the worker runs its steps)."""
    rows: list[dict[str, Any]] = []
    for on, dtype, batches, repeats in ((device, FAST_DTYPE, sizes.device_batches, sizes.repeats),
                                        ("cpu", "float32", sizes.cpu_batches, max(2, sizes.repeats // 4))):
        try:
            model = load_model(root, name, "1", on, compute_dtype=dtype)
            rows += compute.submit(time_steps, model.generator, name, on, dtype, batches, sizes, repeats).result()
            print(f"steps {on} {dtype}: done", flush=True)
            del model
        except Exception:
            rows.append({"model": name, "device": on, "dtype": dtype, "error": failed(f"steps {on} {dtype}")})
        free_device_memory()
    return rows


def random_generator(hf_config: Mapping[str, object], device: str, dtype: str) -> Generator:
    """The Llama family's module of `hf_config` with random weights drawn on `device` (std 0.02, norms
    0.5-1.5 as bench_hf_llm draws them): for step times, no checkpoint to write or read."""
    config = LlamaFamilyConfig.from_hf(dict(hf_config))
    lm = LlamaFamilyLM(config, dtype=COMPUTE_DTYPES[dtype], device=device)
    draw = torch.Generator(device=device).manual_seed(0)
    with torch.no_grad():
        for param_name, param in lm.named_parameters():
            if param_name.endswith("norm"):
                param.uniform_(0.5, 1.5, generator=draw)
            else:
                param.normal_(0.0, 0.02, generator=draw)
    return Generator(lm, max_seq_len=config.max_position_embeddings, eos_token_id=1, bos_token_id=0)


def large_steps(hf_config: Mapping[str, object], device: str, sizes: Sizes,
                compute: ThreadPoolExecutor) -> list[dict[str, Any]]:
    generator = random_generator(hf_config, device, FAST_DTYPE)
    params = sum(p.numel() for p in generator.lm.parameters())
    print(f"large: {params / 1e9:.2f}B parameters", flush=True)
    rows = compute.submit(time_steps, generator, f"llama-{params / 1e9:.2f}b", device, FAST_DTYPE,
                          sizes.device_batches, sizes, sizes.repeats).result()
    del generator
    free_device_memory()
    return rows


@dataclass(frozen=True)
class Stream:
    """One Generate stream through the mesh."""

    ttft_s: float  # send to the first chunk with tokens
    e2e_s: float  # send to the stream's end
    token_ids: tuple[int, ...]
    prompt_tokens: int  # as the mesh counted them (usage)


def mesh_stream(stub: gateway_pb2_grpc.InferenceStub, name: str, prompt: str, num_tokens: int) -> Stream:
    request = gateway_pb2.GenerateRequest(
        model=common_pb2.ModelRef(name=name, version="1"), prompt=prompt,
        sampling=common_pb2.SamplingParams(max_tokens=num_tokens, temperature=0.0, ignore_eos=True))
    began = time.perf_counter()
    first = None
    tokens: list[int] = []
    prompt_tokens = 0
    for chunk in stub.Generate(request, timeout=STREAM_TIMEOUT_S):
        if chunk.token_ids and first is None:
            first = time.perf_counter() - began
        tokens.extend(chunk.token_ids)
        prompt_tokens = max(prompt_tokens, chunk.usage.prompt_tokens)
    if len(tokens) != num_tokens:
        raise RuntimeError(f"a mesh stream ended after {len(tokens)} of {num_tokens} tokens")
    assert first is not None  # num_tokens >= 1 came
    return Stream(first, time.perf_counter() - began, tuple(tokens), prompt_tokens)


def mesh_burst(stub: gateway_pb2_grpc.InferenceStub, name: str, prompts: Sequence[str],
               num_tokens: int) -> tuple[float, list[Stream]]:
    """Every prompt's stream at once: output tokens/s over the burst's wall time, and the streams."""
    began = time.perf_counter()
    with ThreadPoolExecutor(max_workers=len(prompts)) as pool:
        streams = list(pool.map(lambda p: mesh_stream(stub, name, p, num_tokens), prompts))
    return len(prompts) * num_tokens / (time.perf_counter() - began), streams


def warm_up(stub: gateway_pb2_grpc.InferenceStub, name: str, prompt: str, within_s: float = 60.0) -> int:
    """One short stream, retried while the gateway or the scheduler does not know the model yet; the tries."""
    give_up = time.monotonic() + within_s
    for attempt in range(1, 1000):
        try:
            mesh_stream(stub, name, prompt, 4)
            return attempt
        except grpc.RpcError as exc:
            if exc.code() not in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.NOT_FOUND) or time.monotonic() > give_up:
                raise
            time.sleep(0.5)
    raise RuntimeError("unreachable")


def one_process(root: Path, name: str, device: str, compute: ThreadPoolExecutor) -> tuple[InProcess, str, dict]:
    """bench_hf_llm's engine on `device` in FAST_DTYPE, float32 if that fails the golden check (which the
    worker would refuse to start with); the dtype, and what the golden check said."""
    engine = InProcess(root, compute, name=name, device=device, compute_dtype=FAST_DTYPE)
    try:
        compute.submit(run_golden_check, engine.model).result()
        return engine, FAST_DTYPE, {FAST_DTYPE: "passed"}
    except GoldenCheckFailed as exc:
        print(f"mesh: {FAST_DTYPE} fails the golden check on {device}; the mesh part runs in float32: {exc}",
              flush=True)
        del engine
        free_device_memory()
        return InProcess(root, compute, name=name, device=device), "float32", {FAST_DTYPE: str(exc)}


@dataclass
class MeshPass:
    """One worker's turn in the mesh: the saturated bursts and the one-at-a-time streams, and one
    process's runs interleaved with them (the first pass only)."""

    saturated: dict[str, list[float]]  # "mesh" / "one_process": tokens/s of each round
    burst_streams: list[Stream]  # every round's mesh streams, in prompt order
    light: dict[str, list[Stream]]  # "mesh" / "one_process"
    light_tokens_equal: int  # one-at-a-time mesh streams identical to one process's
    worker_start_s: float
    warm_up_tries: int


def mesh_pass(stub: gateway_pb2_grpc.InferenceStub, name: str, texts: Sequence[str], ids: Sequence[tuple[int, ...]],
              sizes: Sizes, engine: InProcess | None, worker_start_s: float, load: list[float]) -> MeshPass:
    """The mesh's measurements through `stub`, alternating with `engine`'s when given."""
    done = MeshPass({"mesh": [], "one_process": []}, [], {"mesh": [], "one_process": []}, 0, worker_start_s,
                    warm_up(stub, name, texts[0]))
    mesh_burst(stub, name, texts[:sizes.streams], 2)  # every stream's first time through the mesh
    for _ in range(sizes.rounds):
        if engine is not None:
            run = engine.generate(ids[:sizes.streams], sizes.stream_tokens)
            done.saturated["one_process"].append(sizes.streams * sizes.stream_tokens / run.total_s)
        tokens_per_s, streams = mesh_burst(stub, name, texts[:sizes.streams], sizes.stream_tokens)
        done.saturated["mesh"].append(tokens_per_s)
        done.burst_streams += streams
        load.append(os.getloadavg()[0])
    for k in range(sizes.light_requests):
        prompt = k % len(texts)
        if engine is not None:
            own = engine.generate([ids[prompt]], sizes.stream_tokens)
            done.light["one_process"].append(Stream(own.first_token_s, own.total_s, own.token_ids[0], len(ids[prompt])))
        done.light["mesh"].append(mesh_stream(stub, name, texts[prompt], sizes.stream_tokens))
        if engine is not None:
            done.light_tokens_equal += done.light["mesh"][-1].token_ids == done.light["one_process"][-1].token_ids
    return done


def mesh_vs_one_process(root: Path, name: str, device: str, texts: Sequence[str], ids: Sequence[tuple[int, ...]],
                        sizes: Sizes, workdir: Path, compute: ThreadPoolExecutor) -> dict[str, Any]:
    engine, dtype, golden = one_process(root, name, device, compute)
    engine.run(ids[:2], 2)  # warm-up, as the worker's load does
    report: dict[str, Any] = {"compute_dtype": dtype, "golden_check_in_process": golden, "device": device,
                              "load_average_1m": [os.getloadavg()[0]]}
    passes: dict[str, MeshPass] = {}
    graph_logs: dict[str, list[str]] = {}
    (workdir / "mesh").mkdir(parents=True, exist_ok=True)
    with running_mesh(workdir / "mesh", tls=False) as mesh:
        began = time.perf_counter()
        mesh.start_scheduler()
        gateway: ServiceProcess | None = None
        for graphs in GRAPH_SWITCHES:
            worker_began = time.perf_counter()
            try:
                worker = start_worker(mesh, name, root, device, dtype, sizes, graphs)
            except RuntimeError as exc:  # the worker exited: its log tail is in the message
                if dtype == "float32" or "golden" not in str(exc).lower() or passes:
                    raise
                print(f"mesh: the {dtype} worker failed its golden check; both sides run in float32", flush=True)
                report["golden_check_worker"] = {dtype: str(exc)[-2000:]}
                del engine
                free_device_memory()
                engine, dtype = InProcess(root, compute, name=name, device=device), "float32"
                report["compute_dtype"] = dtype
                worker = start_worker(mesh, name, root, device, dtype, sizes, graphs)
            worker_start_s = time.perf_counter() - worker_began
            if gateway is None:
                gateway = mesh.start_gateway(*GATEWAY_ARGS)
                report["mesh_start_s"] = time.perf_counter() - began
            print(f"mesh: worker with --cuda-graphs {graphs} serving in {worker_start_s:.1f} s", flush=True)
            try:
                with grpc.insecure_channel(gateway.address) as channel:
                    stub = gateway_pb2_grpc.InferenceStub(channel)
                    passes[graphs] = mesh_pass(stub, name, texts, ids, sizes, engine if not passes else None,
                                               worker_start_s, report["load_average_1m"])
            except Exception:
                print(mesh.logs(), file=sys.stderr)
                raise
            graph_logs[graphs] = [line for line in worker.log_tail(400).splitlines() if "CUDA graph" in line]
            report["worker_log_tail"] = worker.log_tail(8)
            worker.stop()
    report["load_average_1m"].append(os.getloadavg()[0])
    first = passes[GRAPH_SWITCHES[0]]
    report["warm_up_tries"] = first.warm_up_tries
    report.update(versus_one_process(first, sizes))
    report["cuda_graphs"] = graphs_report(passes, graph_logs, sizes)
    del engine
    free_device_memory()
    return report


def versus_one_process(done: MeshPass, sizes: Sizes) -> dict[str, Any]:
    """The first pass's mesh (no decode graphs) against one process."""
    saturated, light = done.saturated, done.light
    mesh_rate, own_rate = statistics.median(saturated["mesh"]), statistics.median(saturated["one_process"])
    sides = {side: {"ttft": latency_summary([s.ttft_s for s in runs]),
                    "tpot": latency_summary([tpot_s(s.ttft_s, s.e2e_s, len(s.token_ids)) for s in runs]),
                    "e2e": latency_summary([s.e2e_s for s in runs])} for side, runs in light.items()}
    return {
        "saturated": {
            "streams": sizes.streams, "tokens_per_stream": sizes.stream_tokens, "rounds": sizes.rounds,
            "mesh_tokens_per_s": mesh_rate, "one_process_tokens_per_s": own_rate,
            "ratio_mesh_over_one_process": ratio(mesh_rate, own_rate),
            "mesh_runs": saturated["mesh"], "one_process_runs": saturated["one_process"],
            "mesh_stream_ttft": latency_summary([s.ttft_s for s in done.burst_streams]),
            "mesh_stream_tpot": latency_summary([tpot_s(s.ttft_s, s.e2e_s, len(s.token_ids))
                                                 for s in done.burst_streams]),
        },
        "light": {
            "requests": sizes.light_requests, "tokens_per_request": sizes.stream_tokens, **sides,
            "ratios_mesh_over_one_process": {
                f"{m}_{q}": ratio(sides["mesh"][m][f"{q}_ms"], sides["one_process"][m][f"{q}_ms"])
                for m in ("ttft", "tpot", "e2e") for q in ("p50", "p99")},
            "streams_identical_to_one_process": done.light_tokens_equal,
            "prompt_tokens_mesh_vs_one_process": [(m.prompt_tokens, o.prompt_tokens)
                                                  for m, o in zip(light["mesh"], light["one_process"], strict=True)],
        },
    }


def graphs_report(passes: Mapping[str, MeshPass], graph_logs: Mapping[str, list[str]], sizes: Sizes) -> dict[str, Any]:
    """The mesh with the worker's decode graphs off against on: the same prompts, greedy."""
    off, on = passes["false"], passes["true"]

    def side(done: MeshPass) -> dict[str, Any]:
        return {"tokens_per_s": statistics.median(done.saturated["mesh"]), "tokens_per_s_runs": done.saturated["mesh"],
                "burst_ttft": latency_summary([s.ttft_s for s in done.burst_streams]),
                "burst_tpot": latency_summary([tpot_s(s.ttft_s, s.e2e_s, len(s.token_ids)) for s in done.burst_streams]),
                "ttft": latency_summary([s.ttft_s for s in done.light["mesh"]]),
                "tpot": latency_summary([tpot_s(s.ttft_s, s.e2e_s, len(s.token_ids)) for s in done.light["mesh"]]),
                "worker_start_s": done.worker_start_s}

    def identical(a: Sequence[Stream], b: Sequence[Stream]) -> dict[str, Any]:
        at = [first_divergence(x.token_ids, y.token_ids) for x, y in zip(a, b, strict=True)]
        return {"identical": sum(d is None for d in at), "streams": len(at),
                "first_divergences": [d for d in at if d is not None][:10]}

    return {"off": side(off), "on": side(on), "streams": sizes.streams, "tokens_per_stream": sizes.stream_tokens,
            "ratio_on_over_off_tokens_per_s": ratio(side(on)["tokens_per_s"], side(off)["tokens_per_s"]),
            "burst_streams_identical": identical(off.burst_streams, on.burst_streams),
            "light_streams_identical": identical(off.light["mesh"], on.light["mesh"]),
            "worker_log": {"off": graph_logs.get("false", []), "on": graph_logs.get("true", [])}}


def start_worker(mesh: Mesh, name: str, root: Path, device: str, dtype: str, sizes: Sizes,
                 cuda_graphs: str) -> ServiceProcess:
    worker = mesh.start_worker(name, "--model-repository", str(root), "--model-version", "1", "--device", device,
                               "--compute-dtype", dtype, "--max-num-seqs", str(max(sizes.streams, 16)),
                               "--num-threads", str(THREADS), "--cuda-graphs", cuda_graphs, wait=False)
    worker.wait_serving(timeout_s=WORKER_START_S)
    return worker


def failed(part: str) -> str:
    """The current exception's traceback, printed (the run goes on) and returned for the JSON."""
    trace = traceback.format_exc()
    print(f"{part} FAILED:\n{trace}", file=sys.stderr, flush=True)
    return trace


def run_part(report: dict[str, Any], part: str, output: Path, fn: Callable[[], Any]) -> Any:
    """fn's result under report[part] (None and report['errors'][part] if it raised); the report is written."""
    print(f"== {part}", flush=True)
    began = time.perf_counter()
    result = None
    try:
        result = fn()
        report[part] = result
    except Exception:
        report.setdefault("errors", {})[part] = failed(part)
    report.setdefault("part_seconds", {})[part] = round(time.perf_counter() - began, 1)
    write_report(output, finite(report), note=f" (after {part})")
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output", type=Path, default=RESULTS_PATH)
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"),
                        help="the device under test (cuda: the default GPU); cpu for a smoke run")
    parser.add_argument("--quick", action="store_true", help="a tiny Llama, few tokens, small batches")
    parser.add_argument("--large", action="store_true", help="also a ~1B Llama's step times on the device")
    parser.add_argument("--skip-mesh", action="store_true", help="parts 1-3 (and --large) only")
    parser.add_argument("--workdir", type=Path, help="keep the checkpoint and repository here between runs")
    args = parser.parse_args()
    device: str = args.device
    if device != "cpu" and not torch.cuda.is_available():
        print("bench_gpu_llm: no CUDA device; nothing to measure (--device cpu runs it on the CPU)")
        return
    set_library_threads(THREADS)
    sizes, name, hf_config = (QUICK, TINY_MODEL, TINY_CONFIG) if args.quick else (FULL, MODEL, CONFIG)
    started = time.perf_counter()
    report: dict[str, Any] = {
        "device": torch.cuda.get_device_name() if device != "cpu" else "cpu (smoke run)",
        "torch": torch.__version__, "cpu_threads": THREADS, "model": name, "hf_config": hf_config,
        "quick": args.quick, "sizes": sizes.__dict__}
    compute = ThreadPoolExecutor(max_workers=1, thread_name_prefix="compute")
    with tempfile.TemporaryDirectory(prefix="gpu_llm_") as tmp_name:
        workdir = args.workdir or Path(tmp_name)
        root = run_part(report, "repository", args.output, lambda: str(repository(workdir, hf_config, name)))
        if root is not None:
            root = Path(root)
            from tokenizers import Tokenizer

            tokenizer = Tokenizer.from_file(str(root / name / "1" / "tokenizer.json"))

            def tokenize(text: str) -> tuple[int, ...]:
                return tuple(tokenizer.encode(text).ids)

            run_part(report, "parity", args.output, lambda: compute.submit(
                parity, root, name, device, parity_prompts(tokenize, sizes.parity_prompts), sizes).result())
            run_part(report, "steps", args.output, lambda: steps(root, name, device, sizes, compute))
            if not args.skip_mesh:
                texts = [PROMPTS[i % len(PROMPTS)] + str(i) for i in range(max(sizes.streams, sizes.light_requests))]
                run_part(report, "mesh", args.output, lambda: mesh_vs_one_process(
                    root, name, device, texts, [tokenize(t) for t in texts], sizes, workdir, compute))
        if args.large:
            large = QUICK_LARGE_CONFIG if args.quick else LARGE_CONFIG
            run_part(report, "large", args.output, lambda: large_steps(large, device, sizes, compute))
    compute.shutdown()
    report["seconds"] = time.perf_counter() - started
    write_report(args.output, finite(report), note=f" in {report['seconds']:.0f} s")
    print_summary(report)


def print_summary(report: Mapping[str, Any]) -> None:
    """The short tables, last."""
    print(f"\ngpu_llm on {report['device']}: {report['model']}, {report['seconds']:.0f} s ("
          + ", ".join(f"{part} {s:.0f} s" for part, s in report.get("part_seconds", {}).items()) + ")")
    for part, trace in report.get("errors", {}).items():
        print(f"  {part}: FAILED ({trace.strip().splitlines()[-1]})")
    parity_report = report.get("parity") or {}
    for dtype in ("float32", FAST_DTYPE):
        result = parity_report.get(dtype)
        if result and "error" not in result:
            print(f"  greedy {parity_report['device']} {dtype} vs cpu float32: {result['identical_streams']}/"
                  f"{result['num_streams']} streams identical, {result['tokens_before_first_divergence_fraction']:.3f} "
                  f"of tokens before a divergence, {len(result['not_near_ties'])} divergences not near ties")
        elif result:
            print(f"  greedy {dtype}: FAILED")
    rows = [r for r in (report.get("steps") or []) + (report.get("large") or []) if "error" not in r]
    if rows:
        print(steps_table(rows))
        print("  peak decode tokens/s: " + ", ".join(f"{k} {v:.0f}" for k, v in peak_decode(rows).items()))
    if report.get("mesh"):
        print(mesh_table(report["mesh"]))
        light = report["mesh"]["light"]
        print(f"  one-at-a-time streams identical to one process: {light['streams_identical_to_one_process']}/"
              f"{light['requests']}")
        if report["mesh"].get("cuda_graphs"):
            print(graphs_table(report["mesh"]["cuda_graphs"]))
    print(json.dumps({"errors": sorted(report.get("errors", {}))}))


if __name__ == "__main__":
    main()
