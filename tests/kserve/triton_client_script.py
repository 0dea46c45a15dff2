"""Runs under the official tritonclient (its own virtualenv, older protobuf): no project imports.

usage: python triton_client_script.py HOST:PORT API_KEY [CA_FILE]
With CA_FILE the client talks TLS and verifies the gateway against it (the mesh's dev CA).
Prints one JSON object with what the client saw.
"""

import json
import sys

import numpy as np
import tritonclient.grpc as grpcclient
from tritonclient.utils import InferenceServerException


def error_of(call):
    try:
        call()
    except InferenceServerException as exc:
        return {"status": exc.status(), "message": exc.message()}
    return None


def main(url: str, api_key: str, ca_file: str = "") -> dict:
    headers = {"authorization": f"Bearer {api_key}"}
    client = grpcclient.InferenceServerClient(url=url, ssl=bool(ca_file), root_certificates=ca_file or None)
    seen = {
        "live": client.is_server_live(),
        "ready": client.is_server_ready(),
        "model_ready": client.is_model_ready("toy-classifier", headers=headers),
        "metadata": client.get_model_metadata("toy-classifier", headers=headers, as_json=True),
    }
    image = np.full((2, 2, 3), 250, dtype=np.uint8)
    tensor = grpcclient.InferInput("IMAGE", list(image.shape), "UINT8")
    tensor.set_data_from_numpy(image)
    result = client.infer(
        "toy-classifier", [tensor], request_id="triton-1", headers=headers,
        outputs=[grpcclient.InferRequestedOutput("PROBABILITIES"), grpcclient.InferRequestedOutput("LABELS")],
    )
    seen["response_id"] = result.get_response().id
    seen["probabilities"] = result.as_numpy("PROBABILITIES").tolist()
    seen["labels"] = [label.decode() for label in result.as_numpy("LABELS").tolist()]
    top = client.infer("toy-classifier", [tensor], headers=headers,
                       outputs=[grpcclient.InferRequestedOutput("PROBABILITIES", class_count=1)])
    seen["top1"] = [entry.decode() for entry in top.as_numpy("PROBABILITIES").tolist()]
    seen["unknown_model"] = error_of(lambda: client.infer("nope", [tensor], headers=headers))
    seen["wrong_key"] = error_of(
        lambda: client.infer("toy-classifier", [tensor], headers={"authorization": "Bearer wrong"})
    )
    return seen


if __name__ == "__main__":
    print(json.dumps(main(*sys.argv[1:4])))
