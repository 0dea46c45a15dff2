"""The digits classifier served through gateway → scheduler → worker answers the held-out
images with exactly its offline accuracy (the same preprocessing kernel serves and trained it)."""

from __future__ import annotations

import io
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from PIL import Image

from infermesh.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc
from services.worker.repository.store import load_manifest
from tools.build_models import DigitsRecipe, build_digits, digits_dataset, is_up_to_date
from tools.testbed import session_tls
from tools.testbed.processes import running_mesh

pytestmark = [pytest.mark.integration, pytest.mark.slow]
REPO_MODEL_ROOT = Path(__file__).resolve().parents[2] / "model_repo"


@pytest.fixture(scope="module")
def digits_root(tmp_path_factory) -> Path:
    if is_up_to_date(REPO_MODEL_ROOT, DigitsRecipe()):
        return REPO_MODEL_ROOT
    root = tmp_path_factory.mktemp("model_repo")
    build_digits(root, log=lambda _: None)
    return root


def _png(pixels) -> bytes:
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, format="PNG")
    return out.getvalue()


def test_served_accuracy_on_held_out_digits_equals_offline_accuracy(tmp_path, digits_root):
    offline_accuracy = load_manifest(digits_root, "digits", "1").quality["heldout_accuracy"]
    data = digits_dataset()
    requests = [
        gateway_pb2.ClassifyRequest(model=common_pb2.ModelRef(name="digits", version="1"),
                                    image=common_pb2.Image(encoded=_png(image)))
        for image in data.test_images
    ]
    with running_mesh(tmp_path) as mesh:
        mesh.start_scheduler("--max-queue-delay-ms", "2")
        mesh.start_worker("digits", "--model-repository", str(digits_root))
        mesh.start_gateway()
        with session_tls.channel(mesh.gateway.address) as channel:
            stub = gateway_pb2_grpc.InferenceStub(channel)
            with ThreadPoolExecutor(max_workers=16) as pool:
                replies = list(pool.map(lambda r: stub.Classify(r, timeout=30), requests))
    predicted = [int(reply.labels[0].label) for reply in replies]
    num_correct = sum(int(p == t) for p, t in zip(predicted, data.test_labels, strict=True))
    assert len(predicted) == len(data.test_labels) == 360
    assert num_correct / len(predicted) == pytest.approx(offline_accuracy, abs=1e-12)
    assert offline_accuracy >= 0.95
