"""A medium random-weight Llama (12 layers, hidden 768, 12 heads over 4 KV heads, vocab 32000) made
locally, imported as `infermesh models import` imports it, served by the mesh, against our own engine's
paged steps in one process.

    .venv/bin/python -m bench.worker.bench_hf_llm [--quick] [--peer [--peer-levels 1,2,4,8]] [--rounds N] [--workdir DIR]

Measured (issue 33's targets in brackets), every run reported with its median and the load average:
* saturated output tokens/s: N streams at once through gateway -> scheduler -> worker, against the
  same steps in one process [mesh >= 0.9x];
* e2e p50 at a light rate (one request at a time) against one sequence's steps in one process [<= 1.1x];
* the worker's RSS against the weights' bytes + the KV cache budget + 300 MB, with what holds it: resident
  bytes by mapping (anonymous, heap, each large library), and processes that only import (FLOORS);
* load time against a plain read of the files from the page cache [<= 2x]: the worker's whole start
  (infermesh_worker_model_load_seconds: imports, sha256, weights, warm-up, golden check) and its
  parts measured here; `load_model` alone in three fresh processes (as a worker loads; the best of them
  against the plain read) beside its figure in this process;
* with --peer: output tokens/s against transformers' `generate` behind a small HTTP server, one request
  at a time (bench/worker/transformers_server.py), both driven by the same closed loops of 1, 2, 4 and
  8 clients (same prompts, max_tokens, greedy), the peer then the mesh at each level; "at equal p99"
  read both ways (bench/worker/peer_report.py): at the same load where the mesh's p99 is no worse, and
  strictly within the peer's single-client p99 [>= 5x]. p99 of a few requests is their largest
  (nearest rank). Prints a table of the levels after the JSON.

The in-process side is the worker's own compute, not a reimplementation: `StepExecutor.run` (the
worker's step: block-table mirror, paged forward, greedy sampling on the host) on one dedicated
compute thread, as the worker runs it, with the worker's thread count (BENCH_THREADS, default 1)
applied the same way (`export_thread_env` before torch loads, `set_library_threads` after). Steps are what the
scheduler would send: every prompt's prefill in one step (the prompts fit max_num_batched_tokens), then
every sequence decoding together. Both sides compute in float32 (the worker's default --compute-dtype).

Why: on this box, torch's GEMMs with 2 OpenMP threads ran 5-25x slower on the process's main thread
than on a second thread (M=8 rows x 768 x 4096: 25-70 ms vs 2.6-10 ms under load 10-20), and the first
version of this benchmark ran its in-process steps on the main thread: that, not the mesh, is why it
reported the mesh 7-35x faster than one process. transformers' generate showed the opposite (slower
off the main thread), hence one thread per side by default.

Mesh and in-process runs alternate (round after round) so that a change in the box's load hits both.
A mesh client reuses one channel per phase, as a real client would. Nothing is downloaded: the
weights are drawn here (std 0.02), the tokenizer is a byte-level BPE trained on the repository's
docs. Prints the figures and writes bench/results/hf_llm.json.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from services.worker.thread_settings import export_thread_env, set_library_threads

# Every side's compute threads (the worker's --num-threads, the in-process engine's, the transformers
# peer's), exported before torch loads as the worker does (OpenMP sizes its pool at import). One by
# default: on the shared 2-core box, with 2 OpenMP threads the same GEMMs or generate() ran 3-25x slower
# or faster depending on which of a process's threads ran them (ours slower on the main thread,
# transformers' slower off it), which no comparison survives; with one thread they agree. On a machine
# with cores to spare, set BENCH_THREADS.
THREADS = int(os.environ.get("BENCH_THREADS", "1"))
export_thread_env(THREADS)

import grpc  # noqa: E402
import torch  # noqa: E402
from safetensors.torch import save_file  # noqa: E402

from bench.harness.results import RESULTS_DIR, ROOT, write_report  # noqa: E402
from bench.harness.stats import quantile  # noqa: E402
from bench.worker.docs_tokenizer import save_docs_tokenizer  # noqa: E402
from bench.worker.peer_report import LevelRun, peer_section, requests_per_client  # noqa: E402
from bench.worker.peer_report import table as peer_table  # noqa: E402
from infermesh.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc  # noqa: E402
from services.worker.models.llama_config import LlamaFamilyConfig  # noqa: E402
from services.worker.models.llama_weights import expected_tensors  # noqa: E402
from services.worker.repository.hf_import import ImportOptions, import_checkpoint, kv_bytes_per_token  # noqa: E402
from services.worker.repository.loader import load_model  # noqa: E402
from services.worker.repository.store import load_manifest, sha256_of  # noqa: E402
from services.worker.step_executor import StepExecutor  # noqa: E402
from services.worker.work import RunStep, SequenceOutput, SequenceStep  # noqa: E402
from tools.testbed import session_tls  # noqa: E402
from tools.testbed.gateway_fixtures import scrape  # noqa: E402
from tools.testbed.processes import free_port, running_mesh  # noqa: E402

RESULTS_PATH = RESULTS_DIR / "hf_llm.json"
MODEL = "medium-llama"
CONFIG = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 32000, "hidden_size": 768,
    "intermediate_size": 2048, "num_hidden_layers": 12, "num_attention_heads": 12, "num_key_value_heads": 4,
    "max_position_embeddings": 2048, "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "bos_token_id": 0,
    "eos_token_id": 1, "tie_word_embeddings": False, "torch_dtype": "float32",
}
KV_CACHE_GB = 0.25
PEER_LEVELS = "1,2,4,8"  # closed-loop clients, the same on both sides against the peer (--peer-levels)
PROMPTS = ("The scheduler ", "A worker attaches ", "Every request ", "The gateway ", "Tokens are born ",
           "Prefix caching ", "The manifest ", "A stream resumes ")


def make_checkpoint(directory: Path, hf_config: Mapping[str, object] = CONFIG) -> None:
    """A random-weight checkpoint of `hf_config` (config.json's fields; the medium Llama by default) and a
    tokenizer of its vocab_size trained on the repository's docs."""
    directory.mkdir(parents=True)
    (directory / "config.json").write_text(json.dumps(hf_config))
    (directory / "generation_config.json").write_text(json.dumps({"bos_token_id": 0, "eos_token_id": 1}))
    config = LlamaFamilyConfig.from_hf(dict(hf_config))
    generator = torch.Generator().manual_seed(0)
    tensors = {name: (torch.rand(shape, generator=generator) + 0.5 if name.endswith("norm.weight")
                      else torch.randn(shape, generator=generator) * 0.02)
               for name, shape in expected_tensors(config).items()}
    save_file(tensors, directory / "model.safetensors", metadata={"format": "pt"})
    save_docs_tokenizer(directory, config.vocab_size)


def repository(workdir: Path, hf_config: Mapping[str, object] = CONFIG, name: str = MODEL) -> Path:
    """The imported model (the medium one by default) under workdir, built once (a kept --workdir skips
    ~40 s the next time); the checkpoint is made in workdir/checkpoint (workdir/checkpoint-NAME for
    another name)."""
    root = workdir / "model_repo"
    checkpoint = workdir / ("checkpoint" if name == MODEL else f"checkpoint-{name}")
    if not (root / name / "1" / "manifest.json").is_file():
        if not checkpoint.is_dir():
            make_checkpoint(checkpoint, hf_config)
        import_checkpoint(checkpoint, root, ImportOptions(name, "1", kv_cache_bytes=int(KV_CACHE_GB * 2**30),
                                                          max_seq_len=512))
    return root


@dataclass(frozen=True)
class Generated:
    """One in-process run of greedy steps."""

    first_token_s: float  # the prefill step: every prompt's first token sampled
    total_s: float  # prefill and every decode step
    token_ids: tuple[tuple[int, ...], ...]  # each prompt's greedy tokens, in the prompts' order


class InProcess:
    """The worker's step executor over the model, driven like the scheduler drives it, on one compute thread
    (`device` and `compute_dtype` as the worker's --device and --compute-dtype)."""

    def __init__(self, root: Path, compute: ThreadPoolExecutor, *, name: str = MODEL, device: str = "cpu",
                 compute_dtype: str = "float32") -> None:
        self._compute = compute
        began = time.perf_counter()
        self.model = compute.submit(load_model, root, name, "1", device, compute_dtype=compute_dtype).result()
        self.load_s = time.perf_counter() - began  # the weights (sha256, headers, read), not the KV cache
        envelope = self.model.manifest.envelope
        self.block_size, self.budget = envelope.block_size, envelope.max_num_batched_tokens
        self.executor = StepExecutor(self.model.generator, envelope.num_kv_blocks, envelope.block_size)
        self._next_step = 0

    def run(self, prompts: Sequence[tuple[int, ...]], num_tokens: int) -> float:
        """Seconds for every prompt to get num_tokens greedy tokens: prefill all, then decode all together."""
        return self.generate(prompts, num_tokens).total_s

    def generate(self, prompts: Sequence[tuple[int, ...]], num_tokens: int) -> Generated:
        """`run`, with the time to the first tokens and the tokens."""
        return self._compute.submit(self._generate, prompts, num_tokens).result()

    def _generate(self, prompts: Sequence[tuple[int, ...]], num_tokens: int) -> Generated:
        if sum(map(len, prompts)) > self.budget:
            raise ValueError(f"prompts of {sum(map(len, prompts))} tokens exceed one step's {self.budget}")
        blocks_each = -(-(max(map(len, prompts)) + num_tokens) // self.block_size)
        tokens: list[list[int]] = [[] for _ in prompts]
        began = time.perf_counter()
        outputs, _ = self.executor.run(self._step(
            SequenceStep(i, prompt, 0, tuple(range(i * blocks_each, (i + 1) * blocks_each)), reset_block_table=True,
                         sample=True) for i, prompt in enumerate(prompts)))
        _take_tokens(outputs, tokens)
        first_token_s = time.perf_counter() - began
        for n in range(1, num_tokens):
            outputs, _ = self.executor.run(self._step(
                SequenceStep(i, (seq[-1],), len(prompts[i]) + n - 1, sample=True, num_generated=n)
                for i, seq in enumerate(tokens)))
            _take_tokens(outputs, tokens)
        elapsed = time.perf_counter() - began
        self.executor.forget(range(len(prompts)))
        return Generated(first_token_s, elapsed, tuple(map(tuple, tokens)))

    def _step(self, seqs: Iterable[SequenceStep]) -> RunStep:
        self._next_step += 1
        return RunStep(self._next_step, tuple(seqs))


def _take_tokens(outputs: Sequence[SequenceOutput], tokens: list[list[int]]) -> None:
    """Appends each sequence's sampled token (its seq_id is its prompt's index); RuntimeError unless every
    sequence got one."""
    if len(outputs) != len(tokens) or any(o.error is not None or o.token_id is None for o in outputs):
        raise RuntimeError(f"in-process step failed: {outputs}")
    for out in outputs:
        assert out.token_id is not None  # checked above
        tokens[out.seq_id].append(out.token_id)


def mesh_stream(stub: gateway_pb2_grpc.InferenceStub, prompt: str, num_tokens: int) -> tuple[float, int]:
    request = gateway_pb2.GenerateRequest(model=common_pb2.ModelRef(name=MODEL, version="1"), prompt=prompt,
                                          sampling=common_pb2.SamplingParams(max_tokens=num_tokens, ignore_eos=True))
    began, count = time.perf_counter(), 0
    for chunk in stub.Generate(request, timeout=600):
        count += len(chunk.token_ids)
    return time.perf_counter() - began, count


def mesh_saturated(channel: grpc.Channel, prompts: Sequence[str], num_tokens: int) -> float:
    stub = gateway_pb2_grpc.InferenceStub(channel)
    began = time.perf_counter()
    with ThreadPoolExecutor(max_workers=len(prompts)) as pool:
        results = list(pool.map(lambda p: mesh_stream(stub, p, num_tokens), prompts))
    if any(n != num_tokens for _, n in results):
        raise RuntimeError(f"a stream ended early: {[n for _, n in results]}")
    return len(prompts) * num_tokens / (time.perf_counter() - began)


def closed_loop(send: Callable[[str], float], prompts: Sequence[str], num_tokens: int, concurrency: int,
                requests_each: int) -> LevelRun:
    """`concurrency` clients, each sending `requests_each` requests one after another through `send`
    (a prompt -> its e2e seconds, num_tokens tokens or an error)."""
    load = os.getloadavg()[0]

    def client(i: int) -> list[float]:
        return [send(prompts[(i + k) % len(prompts)]) for k in range(requests_each)]

    began = time.perf_counter()
    with ThreadPoolExecutor(max_workers=concurrency) as pool:
        latencies = [t for ts in pool.map(client, range(concurrency)) for t in ts]
    return LevelRun(concurrency, len(latencies) * num_tokens / (time.perf_counter() - began), tuple(latencies), load)


def mesh_request(stub: gateway_pb2_grpc.InferenceStub, num_tokens: int) -> Callable[[str], float]:
    def send(prompt: str) -> float:
        seconds, count = mesh_stream(stub, prompt, num_tokens)
        if count != num_tokens:
            raise RuntimeError(f"a mesh stream ended after {count} of {num_tokens} tokens")
        return seconds

    return send


@contextlib.contextmanager
def transformers_peer(checkpoint: Path) -> Iterator[str]:
    """transformers.generate behind bench/worker/transformers_server.py (one request at a time; more
    callers queue) on a free port: its /generate URL until the block ends."""
    port = free_port()
    server = subprocess.Popen([sys.executable, "-m", "bench.worker.transformers_server", "--checkpoint", str(checkpoint),
                               "--port", str(port), "--threads", str(THREADS)], cwd=ROOT, stdout=subprocess.PIPE, text=True)
    try:
        assert server.stdout is not None
        if server.stdout.readline().strip() != "serving":
            raise RuntimeError("the transformers server did not start")
        yield f"http://127.0.0.1:{port}/generate"
    finally:
        server.terminate()
        server.wait(timeout=30)


def peer_request(url: str, num_tokens: int) -> Callable[[str], float]:
    def send(prompt: str) -> float:
        body = json.dumps({"prompt": prompt, "max_tokens": num_tokens}).encode()
        sent = time.perf_counter()
        with urllib.request.urlopen(urllib.request.Request(url, data=body), timeout=600) as reply:
            got = len(json.loads(reply.read())["token_ids"])
        if got != num_tokens:
            raise RuntimeError(f"the transformers server returned {got} tokens, not {num_tokens}")
        return time.perf_counter() - sent

    return send


def against_peer(checkpoint: Path, stub: gateway_pb2_grpc.InferenceStub, prompts: Sequence[str], num_tokens: int,
                 levels: Sequence[int], requests_at_one: int) -> tuple[dict[int, LevelRun], dict[int, LevelRun]]:
    """Both servers under each closed-loop level, the peer then the mesh level by level (a drift in the
    box's load hits both): the peer's levels and the mesh's."""
    peer: dict[int, LevelRun] = {}
    mesh: dict[int, LevelRun] = {}
    with transformers_peer(checkpoint) as url:
        for concurrency in levels:
            each = requests_per_client(concurrency, requests_at_one)
            peer[concurrency] = closed_loop(peer_request(url, num_tokens), prompts, num_tokens, concurrency, each)
            mesh[concurrency] = closed_loop(mesh_request(stub, num_tokens), prompts, num_tokens, concurrency, each)
    return peer, mesh


def plain_reads(files: Sequence[Path]) -> dict[str, float]:
    """Seconds to read every file from the page cache: into one reused buffer (`cat > /dev/null`), and
    into fresh memory (Path.read_bytes: what materializing the bytes costs). Best of 3 each."""
    buffer = memoryview(bytearray(1 << 24))

    def cat() -> None:
        for path in files:
            with path.open("rb", buffering=0) as f:
                while f.readinto(buffer):
                    pass

    def read_bytes() -> None:
        for path in files:
            path.read_bytes()

    return {"cat_s": best_of(3, cat), "read_bytes_s": best_of(3, read_bytes)}


def fresh_process_load_s(root: Path, n: int = 3) -> list[float]:
    """Seconds `load_model` takes in a fresh interpreter, as a worker loads at its start (its imports
    done first and not counted), once per process, n processes. The in-process figure follows this
    process's own import of the checkpoint, which built, used and freed a model of the same size, and
    a load after that is slower: in one process on one box (2026-12-01), the first of three loads read
    0.34 s, the next two 0.85-1.3 s."""
    script = ("import sys, time; from pathlib import Path; from services.worker.thread_settings import set_library_threads; "
              f"set_library_threads({THREADS}); from services.worker.repository.loader import load_model; "
              "began = time.perf_counter(); load_model(Path(sys.argv[1]), sys.argv[2], '1', 'cpu', compute_dtype='float32'); "
              "print(time.perf_counter() - began)")
    env = {**os.environ, "OMP_NUM_THREADS": str(THREADS)}
    return [float(subprocess.run([sys.executable, "-c", script, str(root), MODEL], cwd=ROOT, env=env, check=True,
                                 capture_output=True, text=True).stdout.split()[-1]) for _ in range(n)]


def best_of(n: int, fn: Callable[[], object]) -> float:
    times = []
    for _ in range(n):
        began = time.perf_counter()
        fn()
        times.append(time.perf_counter() - began)
    return min(times)


def memory_of(pid: int) -> dict[str, int]:
    """VmRSS, RssAnon and RssFile of a process, bytes."""
    wanted = ("VmRSS", "RssAnon", "RssFile")
    return {line.split(":")[0]: int(line.split()[1]) * 1024 for line in Path(f"/proc/{pid}/status").read_text().splitlines()
            if line.startswith(wanted)}


# Processes that hold no model, only what a worker serving this one loads, in steps: torch alone; the
# worker's imports (torch, numba, grpc, the worker's modules); then the kernels' CPU twins called once
# (Numba loads them from its cache, or compiles them: LLVM and Numba's CPU target come up). The steps
# between them are what each costs before any weight or KV page.
_WORKER_IMPORTS = "import services.worker.server, services.worker.model_runtime, kernels"
_CPU_TWINS_CALLED = (
    "; import numpy as np; from kernels import paged_attention_decode_host as attend, write_kv_cache_host as write"
    "; rows, cache = np.zeros((1, 4, 8), np.float32), np.zeros((2, 16, 4, 8), np.float32)"
    "; write(rows, rows, cache, cache, np.zeros(1, np.int64))"
    "; attend(np.zeros((1, 4, 8), np.float32), rows, cache, cache, np.zeros((1, 2), np.int32), np.ones(1, np.int32), 16, 1.0)")
FLOORS = {"torch_only": "import torch", "worker_imports": _WORKER_IMPORTS,
          "worker_imports_and_cpu_twins_called": _WORKER_IMPORTS + _CPU_TWINS_CALLED}


def floor_bytes(code: str) -> dict[str, int]:
    """VmRSS, RssAnon and RssFile of a fresh interpreter once it has run `code`, bytes."""
    script = code + "; from pathlib import Path; print(Path('/proc/self/status').read_text())"
    out = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, check=True,
                         env={**os.environ, "OMP_NUM_THREADS": str(THREADS), "NUMBA_NUM_THREADS": str(THREADS)}).stdout
    return {line.split(":")[0]: int(line.split()[1]) * 1024 for line in out.splitlines()
            if line.startswith(("VmRSS", "RssAnon", "RssFile"))}


def resident_by_mapping(pid: int, min_bytes: int = 4 << 20) -> dict[str, int]:
    """A process's resident bytes by what maps them (/proc/PID/smaps): "[anon]" (anonymous mappings:
    tensors, Python's object arenas, the allocator's thread arenas), "[heap]" (the main thread's brk
    heap), each other mapping of at least `min_bytes` by its name (libtorch_cpu.so, libllvmlite.so,
    ...), the rest together."""
    by_name: dict[str, int] = {}
    name = "[anon]"
    for line in Path(f"/proc/{pid}/smaps").read_text().splitlines():
        fields = line.split()
        if fields and "-" in fields[0] and not fields[0].endswith(":"):  # a mapping's header line
            name = Path(fields[5]).name if len(fields) > 5 and fields[5].startswith("/") else \
                (fields[5] if len(fields) > 5 else "[anon]")
        elif fields and fields[0] == "Rss:":
            by_name[name] = by_name.get(name, 0) + int(fields[1]) * 1024
    named = {k: v for k, v in by_name.items() if k in ("[anon]", "[heap]") or v >= min_bytes}
    named["other"] = sum(v for k, v in by_name.items() if k not in named)
    return dict(sorted(named.items(), key=lambda kv: -kv[1]))


def summary(values: Sequence[float]) -> dict[str, object]:
    return {"runs": [round(v, 4) for v in values], "median": statistics.median(values)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="8 streams x 32 tokens, 3 light requests a round")
    parser.add_argument("--rounds", type=int, default=3, help="alternating mesh / in-process rounds")
    parser.add_argument("--workdir", type=Path, help="keep the checkpoint and repository here between runs")
    parser.add_argument("--peer", action="store_true",
                        help="also the comparison with transformers.generate behind HTTP (needs transformers)")
    parser.add_argument("--peer-levels", default=PEER_LEVELS, type=lambda text: [int(c) for c in text.split(",")],
                        help=f"clients of each closed-loop level against the peer (default {PEER_LEVELS}); the "
                             "strict reading needs 1")
    parser.add_argument("--output", type=Path, default=RESULTS_PATH)
    args = parser.parse_args()
    num_streams, num_tokens, num_light = (8, 32, 3) if args.quick else (16, 64, 5)
    set_library_threads(THREADS)  # as the worker does with --num-threads
    with tempfile.TemporaryDirectory() as tmp_name:
        workdir = args.workdir or Path(tmp_name)
        root = repository(workdir)
        manifest = load_manifest(root, MODEL, "1")
        envelope = manifest.envelope
        version = root / MODEL / "1"
        files = sorted(p for p in version.iterdir() if p.is_file())
        weight_files = [p for p in files if p.suffix == ".safetensors"]
        weights_bytes = sum(p.stat().st_size for p in weight_files)  # the repository is gone after the run
        plain = plain_reads(files)
        sha256_s = best_of(1, lambda: [sha256_of(p) for p in weight_files])
        fresh_load_s = fresh_process_load_s(root)

        from tokenizers import Tokenizer

        tokenizer = Tokenizer.from_file(str(version / "tokenizer.json"))
        prompts = [PROMPTS[i % len(PROMPTS)] + str(i) for i in range(num_streams)]
        prompt_ids = [tuple(tokenizer.encode(p).ids) for p in prompts]
        compute = ThreadPoolExecutor(max_workers=1, thread_name_prefix="compute")
        in_process = InProcess(root, compute)
        weights_load_s = in_process.load_s
        in_process.run(prompt_ids[:2], 2)  # warm-up, as the worker's load does

        metrics_port = free_port()
        saturated: dict[str, list[float]] = {"mesh": [], "in_process": []}
        light: dict[str, list[float]] = {"mesh": [], "in_process": []}
        load_avg: list[float] = []
        with running_mesh(workdir / "mesh") as mesh:
            (workdir / "mesh").mkdir(exist_ok=True)
            mesh.start_scheduler()
            worker = mesh.start_worker(MODEL, "--model-repository", str(root), "--model-version", "1",
                                       "--metrics-port", str(metrics_port), "--num-threads", str(THREADS))
            # Throughput, not objectives: TTFT/TPOT admission (on by default) refuses streams whose class
            # target a loaded shared box's steps cannot meet.
            mesh.start_gateway("--slo-admission", "false")
            worker_load_s = scrape(metrics_port).value("infermesh_worker_model_load_seconds")
            worker_memory_ready = memory_of(worker.proc.pid)
            worker_mappings_ready = resident_by_mapping(worker.proc.pid)
            with session_tls.channel(mesh.gateway.address) as channel:
                stub = gateway_pb2_grpc.InferenceStub(channel)
                mesh_stream(stub, prompts[0], 4)  # the gateway learns of the model; the worker's first step
                for _ in range(args.rounds):
                    load_avg.append(os.getloadavg()[0])
                    saturated["in_process"].append(num_streams * num_tokens / in_process.run(prompt_ids, num_tokens))
                    saturated["mesh"].append(mesh_saturated(channel, prompts, num_tokens))
                    for _ in range(num_light):
                        light["in_process"].append(in_process.run(prompt_ids[:1], num_tokens))
                        light["mesh"].append(mesh_stream(stub, prompts[0], num_tokens)[0])
                load_avg.append(os.getloadavg()[0])
                worker_memory = memory_of(worker.proc.pid)
                worker_mappings = resident_by_mapping(worker.proc.pid)
                if args.peer:
                    peer_levels, mesh_levels = against_peer(workdir / "checkpoint", stub, prompts, num_tokens,
                                                             args.peer_levels, num_light)
                    load_avg.append(os.getloadavg()[0])
        compute.shutdown()
    floors = {name: floor_bytes(code) for name, code in FLOORS.items()}
    kv_bytes = envelope.num_kv_blocks * envelope.block_size * kv_bytes_per_token(LlamaFamilyConfig.from_hf(CONFIG))
    allowed = weights_bytes + kv_bytes + 300 * 2**20
    mesh_sat, proc_sat = statistics.median(saturated["mesh"]), statistics.median(saturated["in_process"])
    mesh_light, proc_light = statistics.median(light["mesh"]), statistics.median(light["in_process"])
    report = {
        "box": "shared 2-core CPU machine (other agents' processes running)", "threads": THREADS,
        "load_average_1m": load_avg, "rounds": args.rounds, "streams": num_streams, "tokens_per_stream": num_tokens,
        "saturated_tokens_per_s": {"mesh": summary(saturated["mesh"]), "in_process": summary(saturated["in_process"]),
                                   "ratio_of_medians": mesh_sat / proc_sat, "target": ">= 0.9"},
        "light_e2e_s": {"mesh": summary(light["mesh"]), "in_process": summary(light["in_process"]),
                        "ratio_of_medians": mesh_light / proc_light, "target": "<= 1.1",
                        "mesh_p90": quantile(light["mesh"], 0.9)},
        "worker_memory_bytes": {"ready": worker_memory_ready, "after_runs": worker_memory,
                                "weights_bytes": weights_bytes, "kv_cache_bytes": kv_bytes,
                                "allowed_weights_plus_kv_plus_300mb": allowed,
                                "within": worker_memory["VmRSS"] <= allowed,
                                "runtime_floor_imports_only": floors["worker_imports"], "floors": floors,
                                "by_mapping": {"ready": worker_mappings_ready, "after_runs": worker_mappings}},
        "load": {"plain_read": plain, "weights_sha256_s": sha256_s,
                 "weights_load_s": weights_load_s, "worker_start_to_ready_s": worker_load_s,
                 "weights_load_over_cat": weights_load_s / plain["cat_s"],
                 "weights_load_over_read_bytes": weights_load_s / plain["read_bytes_s"],
                 "worker_start_over_cat": worker_load_s / plain["cat_s"],
                 "weights_load_fresh_process_s": fresh_load_s,
                 "weights_load_fresh_process_over_read_bytes": min(fresh_load_s) / plain["read_bytes_s"],
                 "target": "<= 2x"},
    }
    if args.peer:
        report["vs_transformers_behind_http"] = peer_section(peer_levels, mesh_levels)
    write_report(args.output, report)
    print(json.dumps(report, indent=2))
    if args.peer:
        print(peer_table(report["vs_transformers_behind_http"]))


if __name__ == "__main__":
    main()
