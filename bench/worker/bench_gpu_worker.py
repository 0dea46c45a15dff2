"""The worker's demo models on CUDA against the CPU: answers, greedy streams, step time per batch size.

    python -m bench.worker.bench_gpu_worker [--output bench/results/worker_gpu.json]

Needs a CUDA device; without one it says so and exits 0 (so `make bench` passes on a CPU machine). What it checks and measures, each
model loaded through the worker's own repository loader (`load_model(...,
device=...)`), so the CUDA kernels, the KV cache and the weights are the ones
a `--device cuda` worker serves with:

* digits: held-out accuracy on CPU and CUDA (the 360 images `make models`
  holds out), top-1 agreement, largest probability difference; the golden check.
* tinylm: greedy continuations of 24 prompts through the paged path on both
  devices; any divergence is reported with the CPU's top-1/top-2 logit margin
  at that token (a near-tie that float reassociation can flip); the golden check.
* step time: one decode step for batch sizes 1 to 256 at context 256, and a
  512-token prefill chunk, on each device; tokens/s = batch / step time.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import numpy as np
import torch

from bench.harness.results import MODEL_REPO, RESULTS_DIR, write_report
from bench.worker.prompts import PROMPTS
from services.worker.models.paged import PagedSequence
from services.worker.repository.golden import run_golden_check
from services.worker.repository.loader import load_model
from tools.build_models import digits_dataset

RESULTS_PATH = RESULTS_DIR / "worker_gpu.json"


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def digits(devices: list[str]) -> dict:
    data = digits_dataset()
    images = list(data.test_images)
    report: dict = {}
    probs_by_device = {}
    for device in devices:
        model = load_model(MODEL_REPO, "digits", "1", device=device)
        run_golden_check(model)
        probs = np.concatenate([model.classifier.classify(images[i:i + 64]) for i in range(0, len(images), 64)])
        probs_by_device[device] = probs
        accuracy = float((probs.argmax(1) == np.asarray(data.test_labels)).mean())
        report[device] = {"heldout_accuracy": accuracy, "golden_check": "passed"}
    cpu, gpu = probs_by_device["cpu"], probs_by_device[devices[-1]]
    report["top1_agreement"] = float((cpu.argmax(1) == gpu.argmax(1)).mean())
    report["max_abs_prob_diff"] = float(np.abs(cpu - gpu).max())
    report["num_images"] = len(images)
    return report


def tinylm(devices: list[str], num_new_tokens: int) -> dict:
    models = {d: load_model(MODEL_REPO, "tinylm", "1", device=d) for d in devices}
    for model in models.values():
        run_golden_check(model)
    spec = models["cpu"].manifest
    bos = spec.generator.tokenizer.bos_token_id
    block_size = spec.envelope.block_size
    streams = {d: [] for d in devices}
    divergences = []
    for prompt in PROMPTS:
        ids = [bos, *prompt.encode()]
        outs = {d: m.generator.greedy_paged(ids, num_new_tokens, block_size=block_size) for d, m in models.items()}
        for d in devices:
            streams[d].append(outs[d])
        cpu, gpu = outs["cpu"], outs[devices[-1]]
        if cpu != gpu:
            at = next(i for i, (a, b) in enumerate(zip(cpu, gpu, strict=True)) if a != b)
            logits = models["cpu"].generator.dense_logits(ids + cpu[:at])[-1]
            top2 = torch.topk(logits, 2).values
            divergences.append({"prompt": prompt, "first_divergent_token": at,
                                "cpu_top1_minus_top2_logit": float(top2[0] - top2[1])})
    return {"num_prompts": len(PROMPTS), "num_new_tokens": num_new_tokens, "golden_check": "passed",
            "identical_streams": len(PROMPTS) - len(divergences), "divergences": divergences}


def step_times(device: str, batch_sizes: list[int], context: int, repeats: int) -> list[dict]:
    generator = load_model(MODEL_REPO, "tinylm", "1", device=device).generator
    block_size = 16
    blocks_per_seq = -(-(context + 1) // block_size)
    largest = max(batch_sizes)
    cache = generator.new_kv_cache(largest * blocks_per_seq + 32, block_size)

    def decoding(batch: int) -> list[PagedSequence]:  # one new token each, at `context`, own blocks
        return [PagedSequence((65,), context, tuple(range(i * blocks_per_seq, (i + 1) * blocks_per_seq)), True)
                for i in range(batch)]

    rows = [_time_step(generator, decoding(batch), cache, device, repeats, "decode", batch, batch)
            for batch in batch_sizes]
    prefill = [PagedSequence(tuple(range(1, 257)) * 2, 0, tuple(range(512 // block_size)), True)]
    rows.append(_time_step(generator, prefill, cache, device, repeats, "prefill chunk 512", 1, 512))
    if device.startswith("cuda"):  # the same steps with Numba's generic kernel launch, for the launch cost
        from kernels import fast_launch

        fast_launch.set_enabled(False)
        for batch in (1, 64):
            rows.append(_time_step(generator, decoding(batch), cache, device, repeats, "decode, generic", batch, batch))
        fast_launch.set_enabled(True)
    return rows


def _time_step(generator, seqs, cache, device, repeats, kind, batch, tokens) -> dict:
    for _ in range(3):
        generator.step(seqs, cache)
    sync(device)
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        generator.step(seqs, cache)
        sync(device)
        samples.append(time.perf_counter() - start)
    ms = statistics.median(samples) * 1e3
    return {"device": device, "kind": kind, "batch": batch, "step_ms": ms, "tokens_per_s": tokens / (ms / 1e3)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output", type=Path, default=RESULTS_PATH)
    parser.add_argument("--new-tokens", type=int, default=96)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--cpu-threads", type=int, default=0, help="torch threads for the CPU rows (0: default)")
    parser.add_argument("--quick", action="store_true", help="5 timing repeats (make bench QUICK=1)")
    args = parser.parse_args()
    if args.quick:
        args.repeats = min(args.repeats, 5)
    if not torch.cuda.is_available():
        print("bench_worker_gpu: no CUDA device; nothing to measure (run `make bench-gpu` on a GPU machine)")
        return
    if args.cpu_threads:
        torch.set_num_threads(args.cpu_threads)
    devices = ["cpu", "cuda"]
    started = time.perf_counter()
    report = {"device": torch.cuda.get_device_name(), "cpu_threads": torch.get_num_threads()}
    report["digits"] = digits(devices)
    print("digits:", json.dumps(report["digits"]))
    report["tinylm"] = tinylm(devices, args.new_tokens)
    print("tinylm:", json.dumps(report["tinylm"]))
    report["steps"] = []
    for device, sizes in (("cuda", [1, 8, 32, 64, 128, 256]), ("cpu", [1, 8, 32, 64, 128, 256])):
        report["steps"] += step_times(device, sizes, 256, args.repeats)
    print(f"{'device':<6} {'step':<18} {'batch':>5} {'ms':>8} {'tokens/s':>10}")
    for r in report["steps"]:
        print(f"{r['device']:<6} {r['kind']:<18} {r['batch']:>5} {r['step_ms']:>8.2f} {r['tokens_per_s']:>10.0f}")
    report["seconds"] = time.perf_counter() - started
    write_report(args.output, report, note=f" in {report['seconds']:.0f} s")


if __name__ == "__main__":
    main()
