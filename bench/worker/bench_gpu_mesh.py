"""Both demo models served through the whole mesh by workers on CUDA (gateway → scheduler → `--device cuda`).

    PYTHONPATH=gen/python:. python -m bench.worker.bench_gpu_mesh [--output bench/results/gpu_mesh.json]

Needs a CUDA device (exits 2 without one). Starts a scheduler, a gateway and a
digits and a tinylm worker with `--device cuda` (plaintext, 127.0.0.1, free
ports; all stopped at the end), then:

* classifies the 360 held-out digits as PNGs through the gateway: the served
  accuracy must equal the offline accuracy in the manifest;
* generates greedy continuations (EOS ignored) of 24 prompts through the
  gateway, 8 at a time, and compares them with the same model's paged greedy
  on the CPU in this process; reports time to first token and tokens/s.
The workers pass their golden checks before they report ready, so a worker
that reaches SERVING has served the goldens on the GPU.
"""

from __future__ import annotations

import argparse
import io
import json
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import torch
from PIL import Image

from bench.harness.results import MODEL_REPO, RESULTS_DIR, write_report
from bench.worker.prompts import PROMPTS
from infermesh.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc
from services.worker.repository.loader import load_model
from services.worker.repository.store import load_manifest
from tools.build_models import digits_dataset
from tools.testbed.processes import running_mesh

RESULTS_PATH = RESULTS_DIR / "gpu_mesh.json"


def _png(pixels) -> bytes:
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, format="PNG")
    return out.getvalue()


def classify_held_out(stub) -> dict:
    data = digits_dataset()
    requests = [gateway_pb2.ClassifyRequest(model=common_pb2.ModelRef(name="digits", version="1"),
                                            image=common_pb2.Image(encoded=_png(image)))
                for image in data.test_images]
    started = time.perf_counter()
    with ThreadPoolExecutor(max_workers=16) as pool:
        replies = list(pool.map(lambda r: stub.Classify(r, timeout=60), requests))
    seconds = time.perf_counter() - started
    predicted = [int(reply.labels[0].label) for reply in replies]
    correct = sum(int(p == t) for p, t in zip(predicted, data.test_labels, strict=True))
    offline = load_manifest(MODEL_REPO, "digits", "1").quality["heldout_accuracy"]
    return {"served_accuracy": correct / len(predicted), "offline_accuracy": offline,
            "equal": abs(correct / len(predicted) - offline) < 1e-12, "num_images": len(predicted),
            "images_per_s": len(predicted) / seconds}


def generate_streams(stub, num_new_tokens: int) -> dict:
    cpu = load_model(MODEL_REPO, "tinylm", "1", device="cpu")
    bos = cpu.manifest.generator.tokenizer.bos_token_id

    def one(prompt: str) -> tuple[list[int], float, float]:
        request = gateway_pb2.GenerateRequest(
            model=common_pb2.ModelRef(name="tinylm"), prompt=prompt,
            sampling=common_pb2.SamplingParams(max_tokens=num_new_tokens, temperature=0.0, ignore_eos=True))
        started = time.perf_counter()
        first = None
        tokens: list[int] = []
        for chunk in stub.Generate(request, timeout=120):
            if chunk.token_ids and first is None:
                first = time.perf_counter() - started
            tokens.extend(chunk.token_ids)
        return tokens, first or float("nan"), time.perf_counter() - started

    started = time.perf_counter()
    with ThreadPoolExecutor(max_workers=8) as pool:
        served = list(pool.map(one, PROMPTS))
    seconds = time.perf_counter() - started
    mismatches = []
    for prompt, (tokens, _, _) in zip(PROMPTS, served, strict=True):
        want = cpu.generator.greedy_paged([bos, *prompt.encode()], num_new_tokens,
                                          block_size=cpu.manifest.envelope.block_size)
        if tokens != want:
            at = next((i for i, (a, b) in enumerate(zip(tokens, want, strict=False)) if a != b), min(len(tokens),
                                                                                                    len(want)))
            mismatches.append({"prompt": prompt, "first_difference": at, "served_len": len(tokens)})
    ttfts = sorted(s[1] for s in served)
    return {"num_prompts": len(PROMPTS), "num_new_tokens": num_new_tokens,
            "identical_to_cpu": len(PROMPTS) - len(mismatches), "mismatches": mismatches,
            "ttft_p50_ms": ttfts[len(ttfts) // 2] * 1e3, "tokens_per_s": sum(len(s[0]) for s in served) / seconds}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output", type=Path, default=RESULTS_PATH)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--worker-device", default="cuda", help="cpu runs the same check without a GPU")
    args = parser.parse_args()
    if args.worker_device != "cpu" and not torch.cuda.is_available():
        sys.exit(2)
    report: dict = {"device": torch.cuda.get_device_name() if args.worker_device != "cpu" else "cpu"}
    with tempfile.TemporaryDirectory() as tmp, running_mesh(Path(tmp), tls=False) as mesh:
        started = time.perf_counter()
        mesh.start_scheduler("--max-queue-delay-ms", "2")
        for model in ("digits", "tinylm"):
            mesh.start_worker(model, "--model-repository", str(MODEL_REPO), "--device", args.worker_device)
        mesh.start_gateway()
        report["mesh_start_s"] = time.perf_counter() - started
        try:
            with grpc.insecure_channel(mesh.gateway.address) as channel:
                stub = gateway_pb2_grpc.InferenceStub(channel)
                report["digits"] = classify_held_out(stub)
                print("digits through the mesh on CUDA:", json.dumps(report["digits"]))
                report["tinylm"] = generate_streams(stub, args.new_tokens)
                print("tinylm through the mesh on CUDA:", json.dumps(report["tinylm"]))
        except Exception:
            print(mesh.logs())
            raise
    write_report(args.output, report)
    ok = report["digits"]["equal"] and not report["tinylm"]["mismatches"]
    print(f"wrote {args.output}: {'ok' if ok else 'MISMATCH'}")


if __name__ == "__main__":
    main()
