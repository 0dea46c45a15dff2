"""/v1/embeddings of a medium decoder embedding model (a random-weight Qwen3Model base, 6 layers, hidden 768,
12 heads over 4 KV heads, vocab 32000, saved as a sentence-transformers directory: last-token pooling,
normalized) made locally, imported with `infermesh models import --task embed` as a user would, served
by the mesh; against our own worker's steps in one process and against sentence-transformers' pooling
over transformers' AutoModel behind a small HTTP server (bench/worker/embeddings_server.py).

    .venv/bin/python -m bench.worker.bench_embeddings [--quick] [--rounds N] [--workdir DIR]

Inputs are a fixed seeded set of texts cut from the repository's docs, 32-256 tokens each (32-128 with
--quick). Before any timing, every text's vector from the mesh and from one process must equal the
peer's within TOLERANCE (a benchmark of wrong answers is worthless; a mismatch stops the run), and the
mesh's usage.prompt_tokens must equal the texts' token counts. Then, every run reported with its
median and the box's load average:
1. saturated throughput (embeddings/s, prompt tokens/s): 16, 4 or 2 clients (BATCHES) each sending
   requests whose `input` lists 1, 8 or 32 texts, through gateway -> scheduler -> worker, against the same inputs in
   one process: the worker's StepExecutor (the paged forward to the final hidden states, then the
   pooling) on one compute thread, in the steps the scheduler's chunked prefill would plan
   (bench/worker/embed_plan.py: the step's token budget and max_num_seqs from the manifest);
2. latency p50/p99 at a light rate, one request of one text at a time, mesh against one process;
3. against the peer (one padded batch per request, one request at a time): both driven by the same
   closed loops of 1, 2, 4 and 8 clients sending the same batches; prompt tokens/s and p99 at each
   level, the peer then the mesh at each level.
Mesh and in-process runs alternate (round after round) so that a change in the box's load hits both.

Clients speak OpenAI's body with encoding_format base64 (what the `openai` Python client sends by
default) over one kept-alive connection each. The load generator is this process: every request
records its own work (the body, reading and decoding the reply: the GIL shared by its client threads
is in it), reported per run with the process's CPU share; a run where that work's p99 passed 5% of the
median request is flagged `fell_behind` (its latencies are the generator's as much as the server's).
Every side gets BENCH_THREADS compute threads (default 1), as bench_hf_llm and for its reason. Nothing
is downloaded. Prints tables and writes bench/results/embeddings.json.
"""

from __future__ import annotations

import argparse
import base64
import contextlib
import http.client
import json
import os
import random
import ssl
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

from services.worker.thread_settings import export_thread_env, set_library_threads

# Every side's compute threads, exported before torch loads (bench_hf_llm's BENCH_THREADS, for its reason).
THREADS = int(os.environ.get("BENCH_THREADS", "1"))
export_thread_env(THREADS)

import numpy as np  # noqa: E402
import torch  # noqa: E402

from bench.harness.cpu import cpu_seconds  # noqa: E402
from bench.harness.results import RESULTS_DIR, ROOT, finite, write_report  # noqa: E402
from bench.harness.stats import quantile  # noqa: E402
from bench.harness.tables import markdown_table  # noqa: E402
from bench.worker.docs_tokenizer import save_docs_tokenizer  # noqa: E402
from bench.worker.embed_plan import Level, Sent, prefill_steps, requests_each  # noqa: E402
from services.worker.repository.loader import load_model  # noqa: E402
from services.worker.step_executor import StepExecutor  # noqa: E402
from services.worker.work import RunStep, SequenceStep  # noqa: E402
from tools.testbed import session_tls  # noqa: E402
from tools.testbed.processes import Mesh, ServiceProcess, free_port, running_mesh, wait_until  # noqa: E402

RESULTS_PATH = RESULTS_DIR / "embeddings.json"
MODEL = "medium-embed"
CONFIG = {
    "vocab_size": 32000, "hidden_size": 768, "intermediate_size": 2048, "num_hidden_layers": 6,
    "num_attention_heads": 12, "num_key_value_heads": 4, "head_dim": 64, "max_position_embeddings": 2048,
    "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "bos_token_id": 0, "eos_token_id": 1, "pad_token_id": 1,
    "tie_word_embeddings": False,
}
KV_CACHE_GB = "0.25"
MAX_SEQ_LEN = "512"
# Unit vectors of 768 float32 values, ~0.036 each: the paged chunks here and one padded dense forward in
# transformers agree far closer than this on a CPU; a real difference (a wrong position, pooling or
# mask) moves them by orders of magnitude more.
TOLERANCE = 1e-4
# `input` list length -> closed-loop clients of the saturated runs: enough inputs in flight to keep the
# scheduler's 16 running sequences (max_num_seqs) and its 512-token steps full.
BATCHES = {1: 16, 8: 4, 32: 2}
# The gateway's flags. Throughput, not admission: a saturated closed loop is what TTFT admission exists to
# refuse (with the defaults, 16 clients of one input each were answered 429 ttft_objective_missed, "would
# start a standard stream in 2113 ms at best, past its TTFT target 2000 ms", as they should be), and the
# adaptive limit starts at 64; bench_hf_llm runs its mesh the same way. (When this benchmark was written, one
# request of 57+ inputs was also refused by its own inputs; since the turns of services/gateway/fronts/turns.py it
# is not.) A saturated run also queues more than the default deadline (30 s).
GATEWAY_FLAGS = ("--slo-admission", "false", "--limit-initial", "1024", "--default-deadline-ms", "300000")
PEER_LEVELS = (1, 2, 4, 8)  # closed-loop clients against the peer
NUM_TEXTS = 64


def make_checkpoint(directory: Path) -> None:
    """A random-weight Qwen3Model (std 0.02; norms drawn in [0.5, 1.5) so that they are read) saved as
    sentence-transformers saves Qwen3-Embedding: modules.json, 1_Pooling (last token), 2_Normalize."""
    import transformers

    torch.manual_seed(0)
    model = transformers.Qwen3Model(transformers.Qwen3Config(**CONFIG)).eval()  # type: ignore[arg-type]
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.copy_(torch.rand_like(param) + 0.5 if name.endswith("norm.weight") else torch.randn_like(param) * 0.02)
    model.save_pretrained(directory)
    (directory / "generation_config.json").write_text(json.dumps({"bos_token_id": 0, "eos_token_id": 1}))
    save_docs_tokenizer(directory, CONFIG["vocab_size"])  # type: ignore[arg-type]
    modules = [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
               {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
               {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"}]
    (directory / "modules.json").write_text(json.dumps(modules))
    (directory / "1_Pooling").mkdir()
    (directory / "2_Normalize").mkdir()
    modes = ("pooling_mode_cls_token", "pooling_mode_mean_tokens", "pooling_mode_max_tokens",
             "pooling_mode_mean_sqrt_len_tokens", "pooling_mode_weightedmean_tokens")
    (directory / "1_Pooling" / "config.json").write_text(json.dumps({
        "word_embedding_dimension": CONFIG["hidden_size"], "pooling_mode_lasttoken": True,
        "include_prompt": True, **dict.fromkeys(modes, False)}))


def repository(workdir: Path) -> tuple[Path, Path]:
    """(the checkpoint, the model repository) under workdir, each made once (a kept --workdir reuses them);
    the import is the `infermesh` command's, as a user runs it."""
    checkpoint, root = workdir / "checkpoint-embed", workdir / "model_repo"
    if not (checkpoint / "modules.json").is_file():
        make_checkpoint(checkpoint)
    if not (root / MODEL / "1" / "manifest.json").is_file():
        subprocess.run([sys.executable, "-m", "services.cli", "models", "import", str(checkpoint), "--name", MODEL,
                        "--version", "1", "--repository", str(root), "--task", "embed", "--kv-cache-gb", KV_CACHE_GB,
                        "--max-seq-len", MAX_SEQ_LEN], cwd=ROOT, check=True, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    return checkpoint, root


def docs_texts(tokenizer, count: int, shortest: int, longest: int, seed: int = 0) -> list[str]:
    """`count` texts cut from the repository's docs at seeded places, each `shortest`-`longest` tokens long
    (drawn uniformly), starting at a line's start and ending at a token's end."""
    rng = random.Random(seed)
    lines = [line for p in sorted((ROOT / "docs").glob("*.md")) for line in p.read_text().splitlines() if line.strip()]
    texts: list[str] = []
    while len(texts) < count:
        start, want = rng.randrange(len(lines)), rng.randint(shortest, longest)
        window = " ".join(lines[start:start + 64])
        encoding = tokenizer.encode(window)
        if len(encoding.ids) < want:
            continue
        texts.append(window[:encoding.offsets[want - 1][1]])
    return texts


class InProcess:
    """The worker's step executor over the model, pooling as the manifest says, on one compute thread;
    driven in the steps the scheduler's chunked prefill would plan."""

    def __init__(self, root: Path, compute: ThreadPoolExecutor) -> None:
        self._compute = compute
        model = compute.submit(load_model, root, MODEL, "1", "cpu", compute_dtype="float32").result()
        envelope, spec = model.manifest.envelope, model.manifest.generator
        assert spec is not None and spec.embedding is not None  # imported with --task embed
        self.block_size, self.budget, self.max_seqs = envelope.block_size, envelope.max_num_batched_tokens, envelope.max_num_seqs
        self.pooling = spec.embedding.pooling_spec  # as the manifest records it
        self.executor = StepExecutor(model.generator, envelope.num_kv_blocks, envelope.block_size,
                                     pooling=self.pooling)
        self._num_blocks = envelope.num_kv_blocks
        self._next_step = 0

    def embed(self, prompts: Sequence[tuple[int, ...]]) -> list[np.ndarray]:
        return self._compute.submit(self._embed, prompts).result()

    def _embed(self, prompts: Sequence[tuple[int, ...]]) -> list[np.ndarray]:
        vectors: list[np.ndarray | None] = [None] * len(prompts)
        free, held = list(range(self._num_blocks)), {}
        for chunks in prefill_steps([len(p) for p in prompts], self.budget, self.max_seqs):
            seqs = []
            for c in chunks:
                if c.start == 0:  # a prompt's first chunk: its whole block table at once
                    held[c.index] = [free.pop() for _ in range(-(-len(prompts[c.index]) // self.block_size))]
                seqs.append(SequenceStep(c.index, prompts[c.index][c.start:c.end], c.start,
                                         tuple(held[c.index]) if c.start == 0 else (), reset_block_table=c.start == 0,
                                         sample=c.end == len(prompts[c.index])))
            self._next_step += 1
            outputs, _ = self.executor.run(RunStep(self._next_step, tuple(seqs)))
            ended = []
            for out, seq in zip(outputs, seqs, strict=True):
                if out.error is not None:
                    raise RuntimeError(f"in-process step failed: {out.error}")
                if seq.sample:
                    vectors[out.seq_id] = np.asarray(out.embedding, dtype=np.float32)
                    free.extend(held.pop(out.seq_id))
                    ended.append(out.seq_id)
            self.executor.forget(ended)
        assert all(v is not None for v in vectors)
        return vectors  # type: ignore[return-value]


class Client:
    """One client's kept-alive connection to an OpenAI-shaped /v1/embeddings (the mesh's, over TLS with the
    session CA, or the peer's)."""

    def __init__(self, url: str, context: ssl.SSLContext | None) -> None:
        parts = urlsplit(url)
        self._path, host = parts.path, parts.hostname or "127.0.0.1"
        self._conn = (http.client.HTTPSConnection(host, parts.port, context=context, timeout=600) if context
                      else http.client.HTTPConnection(host, parts.port, timeout=600))
        self._conn.connect()  # the handshake before any timing; a phase opens its own (servers close idle ones)

    def embed(self, texts: Sequence[str]) -> tuple[list[np.ndarray], int, Sent]:
        """The vectors, usage.prompt_tokens, and the request's timing."""
        began = time.perf_counter()
        body = json.dumps({"model": MODEL, "input": list(texts), "encoding_format": "base64"}).encode()
        built = time.perf_counter()
        self._conn.request("POST", self._path, body, {"Content-Type": "application/json"})
        reply = self._conn.getresponse()
        raw = reply.read()
        got = time.perf_counter()
        if reply.status != 200:
            raise RuntimeError(f"{self._path}: HTTP {reply.status}: {raw[:300]!r}")
        answer = json.loads(raw)
        vectors = [np.frombuffer(base64.b64decode(d["embedding"]), dtype="<f4")
                   for d in sorted(answer["data"], key=lambda d: d["index"])]
        tokens = int(answer["usage"]["prompt_tokens"])
        done = time.perf_counter()
        return vectors, tokens, Sent(done - began, (built - began) + (done - got), len(texts), tokens)

    def close(self) -> None:
        self._conn.close()


def closed_loop(url: str, context: ssl.SSLContext | None, batches: Sequence[Sequence[str]], clients: int,
                each: int, servers: Mapping[str, int]) -> Level:
    """`clients` clients, each on its own connection sending `each` requests in turn: client i's k-th
    request is batches[(i * each + k) % len(batches)]. `servers`: the processes (name -> pid) whose CPU
    the run reports."""
    load, cpu_before = os.getloadavg()[0], cpu_seconds(os.getpid())
    servers_before = {name: cpu_seconds(pid) for name, pid in servers.items()}
    start = threading.Barrier(clients + 1)

    def client(i: int) -> list[Sent]:
        conn = Client(url, context)
        try:
            start.wait()
            return [conn.embed(batches[(i * each + k) % len(batches)])[2] for k in range(each)]
        finally:
            conn.close()

    with ThreadPoolExecutor(max_workers=clients) as pool:
        futures = [pool.submit(client, i) for i in range(clients)]
        start.wait()
        began = time.perf_counter()
        sent = [s for f in futures for s in f.result()]
        wall = time.perf_counter() - began
    return Level(clients, len(batches[0]), wall, tuple(sent), load, cpu_seconds(os.getpid()) - cpu_before,
                 tuple((name, cpu_seconds(pid) - servers_before[name]) for name, pid in servers.items()))


def in_process_level(in_process: InProcess, batches: Sequence[Sequence[tuple[int, ...]]], clients: int,
                     each: int) -> Level:
    """Every input of the matching closed loop computed together in one process: one Sent for all."""
    prompts = [p for i in range(clients) for k in range(each) for p in batches[(i * each + k) % len(batches)]]
    load, began, cpu_before = os.getloadavg()[0], time.perf_counter(), cpu_seconds(os.getpid())
    in_process.embed(prompts)
    wall = time.perf_counter() - began
    return Level(clients, len(batches[0]), wall, (Sent(wall, 0.0, len(prompts), sum(map(len, prompts))),), load, 0.0,
                 (("one_process", cpu_seconds(os.getpid()) - cpu_before),))


@contextlib.contextmanager
def embeddings_peer(checkpoint: Path) -> Iterator[tuple[str, int]]:
    """bench/worker/embeddings_server.py on a free port: its /v1/embeddings URL and pid until the block ends."""
    port = free_port()
    server = subprocess.Popen([sys.executable, "-m", "bench.worker.embeddings_server", "--checkpoint", str(checkpoint),
                               "--port", str(port), "--threads", str(THREADS)], cwd=ROOT, stdout=subprocess.PIPE,
                              text=True, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    try:
        assert server.stdout is not None
        if server.stdout.readline().strip() != "serving":
            raise RuntimeError("the embeddings peer did not start")
        yield f"http://127.0.0.1:{port}/v1/embeddings", server.pid
    finally:
        server.terminate()
        server.wait(timeout=30)


def embed_all(send: Callable[[Sequence[str]], tuple[list[np.ndarray], int]], texts: Sequence[str],
              batch: int = 16) -> tuple[list[np.ndarray], int]:
    vectors, tokens = [], 0
    for at in range(0, len(texts), batch):
        got, n = send(texts[at:at + batch])
        vectors += got
        tokens += n
    return vectors, tokens


def agreement(name: str, got: Sequence[np.ndarray], reference: Sequence[np.ndarray]) -> dict[str, float]:
    """The largest difference of any value; RuntimeError past TOLERANCE, naming the side and the text."""
    diffs = [float(np.abs(g.astype(np.float64) - r).max()) for g, r in zip(got, reference, strict=True)]
    worst = int(np.argmax(diffs))
    if diffs[worst] > TOLERANCE:
        raise RuntimeError(f"{name}'s vector of text {worst} differs from the peer's by {diffs[worst]:.3g} "
                           f"(tolerance {TOLERANCE:g}): the benchmark would time wrong answers")
    return {"max_abs_diff": max(diffs), "tolerance": TOLERANCE}


def summary(values: Sequence[float]) -> dict[str, object]:
    return {"runs": [round(v, 3) for v in values], "median": statistics.median(values)}


@dataclass(frozen=True)
class Sides:
    """What every phase drives: the texts, the one process, the mesh's front and the peer's."""

    texts: Sequence[str]
    ids: Mapping[str, tuple[int, ...]]  # each text's token ids
    in_process: InProcess
    mesh_url: str
    context: ssl.SSLContext  # the session CA, for the mesh's TLS
    mesh_pids: Mapping[str, int]  # gateway, scheduler, worker
    peer_url: str
    peer_pid: int


def check_vectors(sides: Sides) -> dict[str, object]:
    """Every text through each side against the peer's vectors, and the prompt tokens each side counted;
    RuntimeError for any difference."""
    mesh, peer = Client(sides.mesh_url, sides.context), Client(sides.peer_url, None)
    try:
        reference, peer_tokens = embed_all(lambda b: peer.embed(b)[:2], sides.texts)
        mesh_vectors, mesh_tokens = embed_all(lambda b: mesh.embed(b)[:2], sides.texts)
    finally:
        mesh.close()
        peer.close()
    counted = sum(len(sides.ids[t]) for t in sides.texts)
    if mesh_tokens != counted or peer_tokens != counted:
        raise RuntimeError(f"prompt tokens: mesh {mesh_tokens}, peer {peer_tokens}, the texts {counted}")
    in_process = sides.in_process.embed([sides.ids[t] for t in sides.texts])
    return {"texts": len(sides.texts), "prompt_tokens": counted, "mesh": agreement("the mesh", mesh_vectors, reference),
            "in_process": agreement("one process", in_process, reference)}


def saturated_round(sides: Sides, inputs_in_all: int, saturated: dict[int, dict[str, list[Level]]]) -> None:
    """One round of every input-list length, one process then the mesh at each."""
    for batch, clients in BATCHES.items():
        progress(f"{clients} clients x input lists of {batch}")
        each = requests_each(clients, batch, inputs_in_all)
        text_batches = _batches(sides.texts, batch)
        saturated[batch]["in_process"].append(in_process_level(
            sides.in_process, [tuple(sides.ids[t] for t in b) for b in text_batches], clients, each))
        saturated[batch]["mesh"].append(closed_loop(sides.mesh_url, sides.context, text_batches, clients, each,
                                                    sides.mesh_pids))


def light_round(sides: Sides, num_light: int, light: dict[str, list[float]]) -> None:
    """`num_light` texts one at a time, each through one process then the mesh: e2e seconds."""
    client = Client(sides.mesh_url, sides.context)
    try:
        for k in range(num_light):
            text = sides.texts[k % len(sides.texts)]
            began = time.perf_counter()
            sides.in_process.embed([sides.ids[text]])
            light["in_process"].append(time.perf_counter() - began)
            light["mesh"].append(client.embed([text])[2].e2e_s)
    finally:
        client.close()


def against_peer(sides: Sides, batch: int, requests_at_one: int) -> dict[int, dict[str, Level]]:
    """Both servers under each closed-loop level of PEER_LEVELS, the peer then the mesh at each."""
    batches = _batches(sides.texts, batch)
    versus: dict[int, dict[str, Level]] = {}
    for level in PEER_LEVELS:
        progress(f"against the peer: {level} clients")
        each = requests_each(level, 1, requests_at_one)
        versus[level] = {
            "peer": closed_loop(sides.peer_url, None, batches, level, each, {"peer": sides.peer_pid}),
            "mesh": closed_loop(sides.mesh_url, sides.context, batches, level, each, sides.mesh_pids)}
    return versus


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="texts of 32-128 tokens, fewer requests, one round")
    parser.add_argument("--rounds", type=int, help="alternating mesh / in-process rounds (default 2, --quick 1)")
    parser.add_argument("--workdir", type=Path, help="keep the checkpoint and repository here between runs")
    parser.add_argument("--output", type=Path, default=RESULTS_PATH)
    args = parser.parse_args()
    rounds = args.rounds or (1 if args.quick else 2)
    longest, inputs_in_all, num_light, peer_batch, peer_requests = \
        (128, 32, 4, 4, 4) if args.quick else (256, 128, 8, 8, 8)
    set_library_threads(THREADS)  # as the worker does with --num-threads
    from tokenizers import Tokenizer

    saturated: dict[int, dict[str, list[Level]]] = {b: {"mesh": [], "in_process": []} for b in BATCHES}
    light: dict[str, list[float]] = {"mesh": [], "in_process": []}
    load_avg: list[float] = []
    with tempfile.TemporaryDirectory() as tmp_name:
        workdir = args.workdir or Path(tmp_name)
        progress("the checkpoint and its import")
        checkpoint, root = repository(workdir)
        tokenizer = Tokenizer.from_file(str(root / MODEL / "1" / "tokenizer.json"))
        texts = docs_texts(tokenizer, NUM_TEXTS, 32, longest)
        compute = ThreadPoolExecutor(max_workers=1, thread_name_prefix="compute")
        in_process = InProcess(root, compute)
        progress("starting the mesh and the peer")
        with running_mesh(workdir / "mesh", env={"HF_HUB_OFFLINE": "1"}) as mesh, \
                embeddings_peer(checkpoint) as (peer_url, peer_pid):
            mesh_url, mesh_pids = serve(mesh, workdir / "mesh", root)
            sides = Sides(texts, {t: tuple(tokenizer.encode(t).ids) for t in texts}, in_process, mesh_url,
                          ssl.create_default_context(cafile=str(session_tls.session_pki().ca_path)), mesh_pids,
                          peer_url, peer_pid)
            in_process.embed([sides.ids[texts[0]]])  # warm-up, as the worker's load does
            wait_until(lambda: _answers(mesh_url, sides.context), timeout_s=60, message="the mesh serves embeddings")
            progress("checking every text's vector on each side")
            check = check_vectors(sides)
            for _ in range(rounds):
                load_avg.append(os.getloadavg()[0])
                saturated_round(sides, inputs_in_all, saturated)
                light_round(sides, num_light, light)
            load_avg.append(os.getloadavg()[0])
            versus = against_peer(sides, peer_batch, peer_requests)
            load_avg.append(os.getloadavg()[0])
        compute.shutdown()
    report = {
        "box": "shared 2-core CPU machine (other agents' processes running)", "threads": THREADS,
        "model": {"name": MODEL, "config": CONFIG, "pooling": in_process.pooling.pooling.value,
                  "normalize": in_process.pooling.normalize, "gateway_flags": GATEWAY_FLAGS,
                  "max_num_batched_tokens": in_process.budget, "max_num_seqs": in_process.max_seqs},
        "load_average_1m": load_avg, "rounds": rounds, "quick": args.quick,
        "texts": {"count": len(texts), "tokens_shortest": min(map(len, sides.ids.values())),
                  "tokens_longest": max(map(len, sides.ids.values())),
                  "tokens_mean": statistics.mean(map(len, sides.ids.values()))},
        "correctness": check,
        "saturated": {str(b): saturated_section(runs) for b, runs in saturated.items()},
        "light_e2e_s": {side: {**summary(v), "p99": quantile(v, 0.99)} for side, v in light.items()},
        "vs_sentence_transformers_style_behind_http": {
            "batch": peer_batch,
            "levels": {str(c): {side: lv.summary() for side, lv in sides_.items()} | {
                "tokens_per_s_ratio": sides_["mesh"].tokens_per_s / sides_["peer"].tokens_per_s}
                for c, sides_ in versus.items()}},
    }
    write_report(args.output, finite(report))
    print(tables(report))


def serve(mesh: Mesh, logs: Path, root: Path) -> tuple[str, dict[str, int]]:
    """A scheduler, the model's worker and a gateway with its HTTP front: the front's /v1/embeddings URL
    and the three processes' pids."""
    logs.mkdir(exist_ok=True)
    http_port = free_port()
    scheduler = mesh.start_scheduler()
    worker = mesh.start_worker(MODEL, "--model-repository", str(root), "--model-version", "1", "--num-threads",
                               str(THREADS))
    gateway = mesh.start_gateway("--http-port", str(http_port), *GATEWAY_FLAGS)
    pids = {name: _pid(p) for name, p in (("gateway", gateway), ("scheduler", scheduler), ("worker", worker))}
    return f"https://127.0.0.1:{http_port}/v1/embeddings", pids


def saturated_section(runs: Mapping[str, Sequence[Level]]) -> dict[str, object]:
    """Both sides' runs at one input-list length, their medians and the ratios of the medians."""
    def median(side: str, figure: Callable[[Level], float]) -> float:
        return statistics.median(figure(lv) for lv in runs[side])

    section: dict[str, object] = {
        side: {"runs": [lv.summary() for lv in levels],
               "median_embeddings_per_s": median(side, lambda lv: lv.embeddings_per_s),
               "median_prompt_tokens_per_s": median(side, lambda lv: lv.tokens_per_s)}
        for side, levels in runs.items()}
    section["ratio_of_median_tokens_per_s"] = median("mesh", lambda lv: lv.tokens_per_s) / \
        median("in_process", lambda lv: lv.tokens_per_s)
    section["ratio_of_median_tokens_per_server_cpu_s"] = median("mesh", lambda lv: lv.tokens_per_server_cpu_s) / \
        median("in_process", lambda lv: lv.tokens_per_server_cpu_s)
    return section


def _pid(process: ServiceProcess) -> int:
    assert process.proc is not None  # started
    return process.proc.pid


_BEGAN = time.perf_counter()


def progress(what: str) -> None:
    print(f"[{time.perf_counter() - _BEGAN:6.1f} s, load {os.getloadavg()[0]:.1f}] {what}", file=sys.stderr, flush=True)


def _answers(url: str, context: ssl.SSLContext) -> bool:
    try:
        client = Client(url, context)
    except OSError:
        return False
    try:
        client.embed(["hello"])
        return True
    except (RuntimeError, OSError, http.client.HTTPException):
        return False
    finally:
        client.close()


def _batches(texts: Sequence[str], size: int) -> list[list[str]]:
    """`texts` in consecutive runs of `size` (the last one wrapping around to the first texts)."""
    return [[texts[(start + i) % len(texts)] for i in range(size)] for start in range(0, len(texts), size)]


def tables(report: dict) -> str:
    sat = report["saturated"]
    rows = []
    for b, sides in sat.items():
        mesh, proc = sides["mesh"], sides["in_process"]
        behind = any(r["generator"]["fell_behind"] for r in mesh["runs"])
        cores = {name: statistics.mean(r["server_cpu_cores"][name] for r in mesh["runs"])
                 for name in mesh["runs"][0]["server_cpu_cores"]}
        rows.append((b, mesh["runs"][0]["clients"], mesh["median_embeddings_per_s"], proc["median_embeddings_per_s"],
                     mesh["median_prompt_tokens_per_s"], proc["median_prompt_tokens_per_s"],
                     sides["ratio_of_median_tokens_per_s"], sides["ratio_of_median_tokens_per_server_cpu_s"],
                     " / ".join(f"{c:.2f}" for c in cores.values()),
                     max(r["generator"]["own_work_p99_s"] for r in mesh["runs"]) * 1000, "yes" if behind else "no"))
    out = [markdown_table(("input list", "clients", "mesh emb/s", "1-proc emb/s", "mesh tok/s", "1-proc tok/s",
                           "mesh / 1-proc tok/s", "mesh / 1-proc tok per CPU s",
                           "mesh CPU cores (gateway / scheduler / worker)",
                           "generator own p99 ms", "fell behind"), rows)]
    light = report["light_e2e_s"]
    out.append(markdown_table(("light, 1 text a request", "p50 s", "p99 s"),
                              [(side, v["median"], v["p99"]) for side, v in light.items()]))
    versus = report["vs_sentence_transformers_style_behind_http"]
    out.append(markdown_table(
        ("clients", "peer tok/s", "peer p99 s", "mesh tok/s", "mesh p99 s", "mesh / peer tok/s",
         "tok per CPU s (peer, mesh)", "generator own p99 ms (peer, mesh)", "fell behind", "load (peer, mesh)"),
        [(c, v["peer"]["prompt_tokens_per_s"], v["peer"]["e2e_p99_s"], v["mesh"]["prompt_tokens_per_s"],
          v["mesh"]["e2e_p99_s"], v["tokens_per_s_ratio"],
          f"{v['peer']['prompt_tokens_per_server_cpu_s']:.0f}, {v['mesh']['prompt_tokens_per_server_cpu_s']:.0f}",
          f"{v['peer']['generator']['own_work_p99_s'] * 1000:.1f}, {v['mesh']['generator']['own_work_p99_s'] * 1000:.1f}",
          "yes" if v["peer"]["generator"]["fell_behind"] or v["mesh"]["generator"]["fell_behind"] else "no",
          f"{v['peer']['load_average_1m']:.1f}, {v['mesh']['load_average_1m']:.1f}")
         for c, v in versus["levels"].items()]))
    out.append(f"load average (1 min) through the run: {', '.join(f'{x:.1f}' for x in report['load_average_1m'])}; "
               f"vectors within {report['correctness']['mesh']['tolerance']:g} of the peer's "
               f"(mesh {report['correctness']['mesh']['max_abs_diff']:.2g}, "
               f"one process {report['correctness']['in_process']['max_abs_diff']:.2g})")
    return "\n\n".join(out)


if __name__ == "__main__":
    main()
