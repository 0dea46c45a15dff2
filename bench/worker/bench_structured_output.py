"""Structured output's cost (issue 39): output tokens/s with a JSON schema against without, at
saturation, on the medium model of the own-LLM issue (bench/worker/bench_hf_llm.py's random-weight
Llama: 12 layers, hidden 768, vocab 32000), the grammar's CPU per token, and llguidance against
xgrammar on the same schema, tokenizer and outputs.

    .venv/bin/python -m bench.worker.bench_structured_output [--quick] [--rounds N] [--workdir DIR]
        [--build-xgrammar-venv]

* Saturation: as many streams at once as the worker has running slots (the manifest's max_num_seqs,
  16), through gateway -> scheduler -> worker, every stream exactly N tokens long. Plain and schema
  phases alternate, round after round, so that a change in the shared box's load hits both; the ratio
  is of the medians [target >= 0.8x]; beside it, the ratio the worker's stage metrics imply (one
  forward figure for both phases, each phase's postprocess: what the grammar adds to a step, without
  the box's noise in the forwards, which at load 10+ moved single phases by 1.5x), once with greedy sampling and once with temperature 1 (a seed
  per stream): the sampler's own cost differs with the mask (at temperature 1 it sorts the
  distribution, which a mask of mostly -inf makes cheaper). The schema (SCHEMA) has
  nested objects, enums, bounded integers, bounded arrays and patterned strings, and asks for more
  items than N tokens can hold, so that every constrained stream also runs to N tokens (a stream that
  ends early is an error, not a figure).
* The grammar's CPU per token, on the worker's own code: the constrained outputs of the mesh phases
  replayed as the worker's steps run them, all streams at each position (services/worker/step_masks.py:
  StepMasker.compute consumes each stream's last token and fills its bitmask row, "mask", which the
  worker runs on its mask thread while the forward runs; then mask_logits' -inf fill of all those rows
  at once, "apply", on the step's critical path), RUNS times; each run's median, and their median.
  The worker's own postprocess stage (its metrics: what waiting for the masks after the forward,
  the fill and sampling take) per step of each phase is reported beside it: the schema phase's
  postprocess minus the plain one's is the grammar's share of the step's critical path.
* Engines: the same outputs through llguidance's matcher alone (compute_bitmask, consume_token) and
  through xgrammar's (fill_next_token_bitmask, accept_token) in .venv-xgrammar
  (bench/worker/xgrammar_masks.py; --build-xgrammar-venv makes it: xgrammar with --no-deps, its
  torch/transformers those of .venv reached through a .pth, no triton). Without that venv the
  comparison is skipped and the report says so.

Nothing is downloaded at run time (but by --build-xgrammar-venv): the model and its tokenizer are made
here. The default --workdir (run/bench_structured) keeps the model between runs. Prints a table and
writes bench/results/structured_output.json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from services.worker.thread_settings import export_thread_env, set_library_threads

THREADS = int(os.environ.get("BENCH_THREADS", "1"))  # as bench_hf_llm: one compute thread per side by default
export_thread_env(THREADS)

import numpy as np  # noqa: E402

from bench.harness.results import RESULTS_DIR, ROOT, write_report  # noqa: E402
from bench.worker.structured_report import (  # noqa: E402
    engines_section,
    per_token_runs,
    stage_per_step,
    stage_ratio,
    table,
    throughput_section,
)

RESULTS_PATH = RESULTS_DIR / "structured_output.json"
XGRAMMAR_VENV = ROOT / ".venv-xgrammar"
XGRAMMAR_PIN = "xgrammar==0.2.8"
XGRAMMAR_DEPS = ("apache-tvm-ffi==0.1.15.post2",)  # xgrammar's own; torch, transformers, numpy, pydantic: .venv's
PHASES = ("plain", "json_schema")
SAMPLINGS = {"greedy": 0.0, "temperature_1": 1.0}  # both phases of a round sample alike

# More items than any run's tokens can write (each item is several tokens), so a constrained stream
# never completes its value before max_tokens.
SCHEMA: dict[str, object] = {
    "type": "object",
    "properties": {
        "service": {"enum": ["gateway", "scheduler", "worker"]},
        "replicas": {"type": "integer", "minimum": 1, "maximum": 64},
        "events": {
            "type": "array", "minItems": 64, "maxItems": 256,
            "items": {
                "type": "object",
                "properties": {
                    "name": {"type": "string", "maxLength": 24},
                    "level": {"enum": ["debug", "info", "warn", "error"]},
                    "latency_ms": {"type": "integer", "minimum": 0, "maximum": 100000},
                    "tags": {"type": "array", "maxItems": 3, "items": {"type": "string", "pattern": "^[a-z]{1,8}$"}},
                    "ok": {"type": "boolean"},
                },
                "required": ["name", "level", "latency_ms", "tags", "ok"],
                "additionalProperties": False,
            },
        },
    },
    "required": ["service", "replicas", "events"],
    "additionalProperties": False,
}


# --------------------------------------------------------------------------- measuring


def stream(stub, request) -> list[int]:
    tokens: list[int] = []
    for chunk in stub.Generate(request, timeout=600):
        tokens.extend(chunk.token_ids)
    return tokens


def saturated(stub, requests: Sequence, num_tokens: int) -> tuple[float, list[list[int]]]:
    """Output tokens/s of every request at once, and each one's tokens (each must have num_tokens)."""
    began = time.perf_counter()
    with ThreadPoolExecutor(max_workers=len(requests)) as pool:
        outputs = list(pool.map(lambda r: stream(stub, r), requests))
    elapsed = time.perf_counter() - began
    if any(len(o) != num_tokens for o in outputs):
        raise RuntimeError(f"a stream ended before {num_tokens} tokens: {[len(o) for o in outputs]}")
    return len(requests) * num_tokens / elapsed, outputs


def requests_for(prompts: Sequence[str], num_tokens: int, schema: bool, seed_base: int, temperature: float) -> list:
    from bench.worker.bench_hf_llm import MODEL
    from infermesh.v1 import common_pb2, gateway_pb2

    out = []
    for i, prompt in enumerate(prompts):
        sampling = common_pb2.SamplingParams(max_tokens=num_tokens, temperature=temperature, seed=seed_base + i,
                                             ignore_eos=not schema)
        if schema:
            sampling.structured.json_schema = json.dumps(SCHEMA)
        out.append(gateway_pb2.GenerateRequest(model=common_pb2.ModelRef(name=MODEL, version="1"), prompt=prompt,
                                               sampling=sampling))
    return out


def worker_stages(metrics_port: int) -> dict[str, tuple[float, float]]:
    from tools.testbed.gateway_fixtures import scrape

    metrics = scrape(metrics_port)
    stages = {}
    for (name, labels), value in metrics.samples.items():
        if name.startswith("infermesh_worker_stage_duration_seconds_") and name.endswith(("_sum", "_count")):
            stage = dict(labels).get("stage", "")
            total, count = stages.get(stage, (0.0, 0.0))
            stages[stage] = (total + value, count) if name.endswith("_sum") else (total, count + value)
    return stages


def replay_worker_path(grammar: str, tokenizer, outputs: Sequence[Sequence[int]], vocab_size: int,
                       runs: int) -> dict[str, object]:
    """The worker's grammar work per token, as its step does it: at each position, every output's
    mask (StepMasker.compute: consume the last token, fill the sequence's bitmask row; on the worker
    this runs on the mask thread, beside the forward), then the vectorised -inf fill of all those rows
    of a float32 logits matrix (mask_logits, on the step's critical path). Each step's time is spread
    over its tokens."""
    from services.worker.step_masks import MaskJob, StepMasker, mask_logits

    logits = np.random.default_rng(0).standard_normal((len(outputs), vocab_size)).astype(np.float32)
    mask_runs, apply_runs = [], []
    for _ in range(runs):
        masker = StepMasker(tokenizer)
        guides = [None] * len(outputs)
        mask_us: list[float] = []
        apply_us: list[float] = []
        for i in range(max(map(len, outputs))):
            live = [k for k, output in enumerate(outputs) if i < len(output)]
            jobs = [MaskJob(grammar, guides[k], outputs[k][i - 1 : i] if guides[k] else outputs[k][:i]) for k in live]
            rows = logits[: len(live)].copy()
            t0 = time.perf_counter()
            masks = masker.compute(jobs)
            t1 = time.perf_counter()
            mask_logits(rows, range(len(live)), masks.bitmask)
            t2 = time.perf_counter()
            mask_us += [(t1 - t0) * 1e6 / len(live)] * len(live)
            apply_us += [(t2 - t1) * 1e6 / len(live)] * len(live)
            for row, k in enumerate(live):
                if masks.errors[row] is not None or not np.isfinite(rows[row, outputs[k][i]]):
                    raise RuntimeError(f"the replay refused token {outputs[k][i]} at {i}: not the worker's grammar")
                guides[k] = masks.guides[row]
        mask_runs.append(mask_us)
        apply_runs.append(apply_us)
    return {"mask": per_token_runs(mask_runs), "apply": per_token_runs(apply_runs),
            "what": "mask: StepMasker.compute over every stream at a position (consume the last token, fill its "
                    "bitmask row; the worker runs it beside the forward); apply: mask_logits' -inf fill of those "
                    "rows of float32[streams, 32000] at once (on the step's critical path); per token"}


def replay_llguidance(grammar: str, tokenizer, outputs: Sequence[Sequence[int]], runs: int,
                      digests: list[str]) -> list[dict[str, list[float]]]:
    """llguidance's matcher alone, timed as xgrammar_masks.py times xgrammar's; the first run's masks'
    digests appended to `digests`."""
    import llguidance

    from bench.worker.xgrammar_masks import mask_digest

    out = []
    for run in range(runs):
        mask_us, advance_us = [], []
        for output in outputs:
            matcher = llguidance.LLMatcher(tokenizer.tokenizer, grammar, log_level=0)
            for token in output:
                t0 = time.perf_counter()
                bitmask = matcher.compute_bitmask()
                t1 = time.perf_counter()
                ok = matcher.consume_token(token)
                t2 = time.perf_counter()
                mask_us.append((t1 - t0) * 1e6)
                advance_us.append((t2 - t1) * 1e6)
                if run == 0:
                    digests.append(mask_digest(np.frombuffer(bitmask, dtype=np.uint8), tokenizer.vocab_size))
                if not ok:
                    raise RuntimeError(f"llguidance refused its own output's token {token}")
        out.append({"mask_us": mask_us, "advance_us": advance_us})
    return out


def run_xgrammar(python: Path, tokenizer_json: Path, vocab_size: int, stop_ids: Sequence[int],
                 outputs: Sequence[Sequence[int]], runs: int, tmp: Path) -> dict[str, object]:
    spec = {"tokenizer_json": str(tokenizer_json), "vocab_size": vocab_size, "stop_token_ids": list(stop_ids),
            "schema": SCHEMA, "sequences": [list(o) for o in outputs], "runs": runs}
    (tmp / "xg_in.json").write_text(json.dumps(spec))
    subprocess.run([str(python), "-m", "bench.worker.xgrammar_masks", str(tmp / "xg_in.json"), str(tmp / "xg_out.json")],
                   cwd=ROOT, check=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    return json.loads((tmp / "xg_out.json").read_text())


def build_xgrammar_venv(venv: Path = XGRAMMAR_VENV, run: Callable[..., object] = subprocess.run) -> Path:
    """`.venv-xgrammar`: xgrammar and its tvm-ffi with --no-deps (so no torch, transformers or triton is
    fetched); .venv's packages (torch 2.13.0 CPU, transformers, numpy, pydantic) and the repository are
    reached through a .pth after the venv's own, as tests/support/side_venv.py links the Ray venv."""
    import sysconfig

    python = venv / "bin" / "python"
    run([sys.executable, "-m", "venv", str(venv)], check=True)
    run([str(python), "-m", "pip", "install", "--quiet", "--disable-pip-version-check", "--no-deps", XGRAMMAR_PIN,
         *XGRAMMAR_DEPS], check=True)
    purelib = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                             capture_output=True, text=True, check=True).stdout.strip()
    ours = sysconfig.get_paths()["purelib"]
    (Path(purelib) / "zz-infermesh-project.pth").write_text(f"{ROOT}\nimport site; site.addsitedir({ours!r})\n")
    return python


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="16 tokens a stream (not 24), 2 rounds, 3 replay runs")
    parser.add_argument("--rounds", type=int, help="alternating plain / schema rounds (default 3; quick 2)")
    parser.add_argument("--runs", type=int, help="grammar replay runs (default 5; quick 3)")
    parser.add_argument("--workdir", type=Path, default=ROOT / "run" / "bench_structured",
                        help="the medium model is built here once and kept")
    parser.add_argument("--build-xgrammar-venv", action="store_true", help=f"make {XGRAMMAR_VENV.name} first (PyPI)")
    parser.add_argument("--output", type=Path, default=RESULTS_PATH)
    args = parser.parse_args()
    num_tokens = 16 if args.quick else 24  # full: 1.5-2 minutes on the shared 2-core box at load 10-20
    rounds = args.rounds or (2 if args.quick else 3)
    runs = args.runs or (3 if args.quick else 5)
    set_library_threads(THREADS)
    if args.build_xgrammar_venv:
        build_xgrammar_venv()

    from bench.worker.bench_hf_llm import CONFIG, MODEL, PROMPTS, repository
    from infermesh.v1 import gateway_pb2_grpc
    from services.scheduler.structured_output import compile_grammar
    from services.worker.grammar import GrammarTokenizer
    from services.worker.repository.store import load_manifest
    from tools.testbed import session_tls
    from tools.testbed.processes import free_port, running_mesh

    root = repository(args.workdir)
    envelope = load_manifest(root, MODEL, "1").envelope
    num_streams = envelope.max_num_seqs
    prompts = [PROMPTS[i % len(PROMPTS)] + str(i) for i in range(num_streams)]
    tps: dict[str, dict[str, list[float]]] = {}
    stages: dict[str, dict[str, float]] = {}
    load_avg: list[float] = []
    outputs: list[list[int]] = []
    metrics_port = free_port()
    with tempfile.TemporaryDirectory() as tmp_name, running_mesh(Path(tmp_name) / "mesh") as mesh:
        (Path(tmp_name) / "mesh").mkdir(exist_ok=True)
        mesh.start_scheduler()
        mesh.start_worker(MODEL, "--model-repository", str(root), "--model-version", "1",
                          "--metrics-port", str(metrics_port), "--num-threads", str(THREADS))
        mesh.start_gateway("--slo-admission", "false")  # throughput, not objectives (as bench_hf_llm)
        with session_tls.channel(mesh.gateway.address) as channel:
            stub = gateway_pb2_grpc.InferenceStub(channel)
            saturated(stub, requests_for(prompts[:2], 4, False, 0, 1.0), 4)  # the gateway learns the model; warm-up
            saturated(stub, requests_for(prompts[:2], 4, True, 0, 1.0), 4)
            per_phase: dict[str, list[dict[str, float]]] = {}
            for r in range(rounds):
                load_avg.append(os.getloadavg()[0])
                for sampling, temperature in SAMPLINGS.items():
                    for phase in PHASES:
                        before = worker_stages(metrics_port)
                        rate, got = saturated(stub, requests_for(prompts, num_tokens, phase == "json_schema", 1000 * r,
                                                                 temperature), num_tokens)
                        per_phase.setdefault(f"{sampling} {phase}", []).append(
                            stage_per_step(before, worker_stages(metrics_port)))
                        tps.setdefault(sampling, {}).setdefault(phase, []).append(rate)
                        if phase == "json_schema" and sampling == "temperature_1" and not outputs:
                            outputs = got  # the replays' tokens: one round's, sampled (greedy's repeat)
            load_avg.append(os.getloadavg()[0])
        for phase, observed in per_phase.items():
            keys = sorted({k for o in observed for k in o})
            stages[phase] = {k: round(statistics.median(o[k] for o in observed if k in o), 3) for k in keys}

    version = root / MODEL / "1"
    grammar = compile_grammar("json_schema", json.dumps(SCHEMA))
    began = time.perf_counter()
    tokenizer = GrammarTokenizer.from_tokenizer_json((version / "tokenizer.json").read_bytes(), CONFIG["vocab_size"],
                                                     [CONFIG["eos_token_id"]])
    tokenizer_s = time.perf_counter() - began
    replay = outputs
    cpu = replay_worker_path(grammar, tokenizer, replay, CONFIG["vocab_size"], runs)
    llg_digests: list[str] = []
    llg = replay_llguidance(grammar, tokenizer, replay, runs, llg_digests)
    xgrammar, skipped = None, ""
    python = XGRAMMAR_VENV / "bin" / "python"
    if python.exists():
        with tempfile.TemporaryDirectory() as tmp_name:
            xgrammar = run_xgrammar(python, version / "tokenizer.json", CONFIG["vocab_size"], [CONFIG["eos_token_id"]],
                                    replay, runs, Path(tmp_name))
    else:
        skipped = f"no {XGRAMMAR_VENV.name} (make it with --build-xgrammar-venv)"
    import llguidance

    report = {
        "box": "shared 2-core CPU machine (other agents' processes running)", "threads": THREADS,
        "model": f"{MODEL} (bench_hf_llm's medium random-weight Llama)", "streams": num_streams,
        "tokens_per_stream": num_tokens, "rounds": rounds, "replay_runs": runs, "load_average_1m": load_avg,
        "sampling": "greedy and temperature 1 (a seed per stream), each with and without the schema; "
                    "plain phases ignore_eos",
        "saturated_tokens_per_s": {s: throughput_section(p["plain"], p["json_schema"]) for s, p in tps.items()},
        "worker_stage_ms_per_step": stages,
        "ratio_from_worker_stages": {sampling: stage_ratio(stages.get(f"{sampling} plain", {}),
                                                           stages.get(f"{sampling} json_schema", {}))
                                     for sampling in SAMPLINGS},
        "grammar_cpu_per_token": {**cpu, "tokens_replayed": sum(map(len, replay)),
                                  "llguidance_version": llguidance.__version__ if hasattr(llguidance, "__version__")
                                  else _version("llguidance"), "tokenizer_build_s": round(tokenizer_s, 4)},
        "engines": engines_section(llg, xgrammar, skipped, llg_digests),
    }
    write_report(args.output, report)
    print(table(report))


def _version(name: str) -> str:
    from importlib.metadata import version

    return version(name)


if __name__ == "__main__":
    main()
