"""A few Classify and Generate calls against a running gateway, with per-stage timings.

    python -m tools.demo --gateway 127.0.0.1:50051 [--api-key KEY] [--ca-file run/tls/ca.pem]

With --ca-file the call is TLS, verifying the gateway against that CA (`make demo` passes the local
mesh's dev CA); the gateway's public port asks tenants for an API key, not a client certificate.
"""

from __future__ import annotations

import argparse
import sys

import numpy as np

from infermesh.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc
from services.common.client_files import credentials_from_files, open_channel


def _stages(timings: common_pb2.Timings) -> str:
    parts = [f"{common_pb2.Stage.Name(s.stage).removeprefix('STAGE_').lower()}={s.duration_us / 1000:.2f}ms"
             for s in timings.stages]
    return " ".join(parts) + f" | total={timings.total_us / 1000:.2f}ms"


def _handwritten_digit(index: int) -> tuple[common_pb2.Image, str]:
    """One of scikit-learn's 8x8 digits as raw RGB pixels; the worker resizes it to the model's input."""
    from sklearn.datasets import load_digits

    digits = load_digits()
    grey = (digits.images[index] * (255 / 16)).astype(np.uint8)
    rgb = np.repeat(grey[:, :, None], 3, axis=2)
    image = common_pb2.Image(raw=common_pb2.RawImage(pixels=rgb.tobytes(), height=8, width=8, channels=3))
    return image, f"handwritten {digits.target[index]}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tools.demo")
    parser.add_argument("--gateway", default="127.0.0.1:50051")
    parser.add_argument("--api-key", default="")
    parser.add_argument("--ca-file", default="", help="CA bundle to verify the gateway with (empty: plaintext)")
    args = parser.parse_args(argv)
    metadata = (("authorization", f"Bearer {args.api_key}"),) if args.api_key else ()
    with open_channel(args.gateway, credentials_from_files(args.ca_file)) as channel:
        stub = gateway_pb2_grpc.InferenceStub(channel)
        models = stub.ListModels(gateway_pb2.ListModelsRequest(), timeout=5, metadata=metadata).models
        print("models:", ", ".join(f"{m.model.name}:{m.model.version}" for m in models))
        for model in models:
            if model.kind == common_pb2.MODEL_KIND_CLASSIFIER:
                for index in range(3):
                    image, what = _handwritten_digit(index)
                    reply = stub.Classify(gateway_pb2.ClassifyRequest(model=model.model, image=image, top_k=2),
                                          timeout=10, metadata=metadata)
                    labels = ", ".join(f"{label.label} ({label.score:.2f})" for label in reply.labels)
                    print(f"Classify {model.model.name} [{what}] -> {labels}\n    {_stages(reply.timings)}")
            elif model.kind == common_pb2.MODEL_KIND_GENERATOR:
                for prompt in ("The ", "def ", "abc"):
                    request = gateway_pb2.GenerateRequest(
                        model=model.model, prompt=prompt, sampling=common_pb2.SamplingParams(max_tokens=32)
                    )
                    text, last = "", None
                    for chunk in stub.Generate(request, timeout=30, metadata=metadata):
                        text += chunk.text
                        last = chunk
                    reason = common_pb2.FinishReason.Name(last.finish_reason).removeprefix("FINISH_REASON_").lower()
                    print(f"Generate {model.model.name} {prompt!r} -> {text!r} ({reason}, "
                          f"ttft={last.ttft_us / 1000:.1f}ms)\n    {_stages(last.timings)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
