"""Runs under the official tritonclient (its own virtualenv): no project imports.

usage: python triton_v2_script.py GRPC_ADDRESS HTTP_ADDRESS API_KEY CA_FILE
Uses only what a Triton user would: the model's metadata decides the input tensor, the
configuration and statistics are read back, a generator is streamed with start_stream /
async_stream_infer. Prints one JSON object with what the gRPC and the HTTP client saw.
"""

import json
import queue
import sys

import numpy as np
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException, triton_to_np_dtype

CLASSIFIER = "toy-classifier"
GENERATOR = "toy-generator"


def error_of(call):
    try:
        call()
    except InferenceServerException as exc:
        return {"status": exc.status(), "message": exc.message()}
    return None


def input_from_metadata(module, metadata: dict, batch_size: int):
    """What Triton's tools do: -1 in the batch dimension is the batch size; the rest as described."""
    tensor = metadata["inputs"][0]
    dims = [int(d) for d in tensor["shape"]]
    shape = [batch_size] + [d if d > 0 else 8 for d in dims[1:]]
    pixels = np.full(shape, 250, dtype=triton_to_np_dtype(tensor["datatype"]))
    pixels[1::2] = 5  # odd images dark, even ones bright
    infer_input = module.InferInput(tensor["name"], shape, tensor["datatype"])
    infer_input.set_data_from_numpy(pixels)
    return infer_input


def classify_batches(module, client, headers: dict, metadata: dict) -> dict:
    seen = {}
    for batch_size in (1, 4):
        result = client.infer(CLASSIFIER, [input_from_metadata(module, metadata, batch_size)], headers=headers,
                              outputs=[module.InferRequestedOutput("PROBABILITIES"),
                                       module.InferRequestedOutput("LABELS")])
        probabilities = result.as_numpy("PROBABILITIES")
        seen[f"batch{batch_size}"] = {
            "shape": list(probabilities.shape),
            "argmax": probabilities.argmax(axis=1).tolist(),
            "labels_shape": list(result.as_numpy("LABELS").shape),
        }
    return seen


def grpc_checks(address: str, headers: dict, ca_file: str) -> dict:
    client = grpcclient.InferenceServerClient(url=address, ssl=True, root_certificates=ca_file)
    metadata = client.get_model_metadata(CLASSIFIER, headers=headers, as_json=True)
    seen = {
        "metadata_input": metadata["inputs"][0],
        "config": client.get_model_config(CLASSIFIER, headers=headers, as_json=True)["config"],
        "generator_config": client.get_model_config(GENERATOR, headers=headers, as_json=True)["config"],
        "index": client.get_model_repository_index(headers=headers, as_json=True)["models"],
        **classify_batches(grpcclient, client, headers, metadata),
        "unknown_config": error_of(lambda: client.get_model_config("nope", headers=headers)),
        "too_large": error_of(lambda: client.infer(
            CLASSIFIER, [input_from_metadata(grpcclient, metadata, 64)], headers=headers)),
    }
    seen["statistics"] = client.get_inference_statistics(CLASSIFIER, headers=headers, as_json=True)["model_stats"]
    seen["stream"] = stream_checks(client, headers)
    seen["generator_statistics"] = client.get_inference_statistics(
        GENERATOR, headers=headers, as_json=True)["model_stats"]
    client.close()
    return seen


def stream_checks(client, headers: dict) -> dict:
    responses = queue.Queue()
    client.start_stream(callback=lambda result, error: responses.put((result, error)), headers=headers)

    def text_input(text: str):
        tensor = grpcclient.InferInput("text_input", [1], "BYTES")
        tensor.set_data_from_numpy(np.array([text.encode()], dtype=np.object_))
        return tensor

    def collect(request_id: str) -> dict:
        chunks, finals, parameters = [], 0, {}
        while True:
            result, error = responses.get(timeout=20)
            if error is not None:
                return {"error": str(error.message() if hasattr(error, "message") else error)}
            response = result.get_response()
            assert response.id == request_id, (response.id, request_id)
            final = response.parameters["triton_final_response"].bool_param
            output = result.as_numpy("text_output")
            if output is not None:
                chunks.append(output[0].decode())
            if final:
                finals += 1
                parameters = {k: str(getattr(v, v.WhichOneof("parameter_choice")))
                              for k, v in response.parameters.items()}
                return {"chunks": chunks, "finals": finals, "parameters": parameters}

    client.async_stream_infer(GENERATOR, [text_input("hello")], request_id="gen-1",
                              parameters={"max_tokens": 6, "temperature": 0.0})
    seen = {"first": collect("gen-1")}
    client.async_stream_infer("nope", [text_input("hello")], request_id="gen-bad")
    seen["unknown_model"] = collect("gen-bad")
    client.async_stream_infer(GENERATOR, [text_input("hi")], request_id="gen-bad-param",
                              parameters={"max_tokens": "many"})
    seen["bad_parameter"] = collect("gen-bad-param")
    client.async_stream_infer(GENERATOR, [text_input("hello")], request_id="gen-2",
                              parameters={"max_tokens": 3}, enable_empty_final_response=True)
    seen["after_errors_empty_final"] = collect("gen-2")
    client.stop_stream()
    return seen


def http_checks(address: str, headers: dict, ca_file: str) -> dict:
    client = httpclient.InferenceServerClient(url=address, ssl=True, ssl_options={"ca_certs": ca_file})
    metadata = client.get_model_metadata(CLASSIFIER, headers=headers)
    seen = {
        "live": client.is_server_live(),
        "ready": client.is_server_ready(),
        "model_ready": client.is_model_ready(CLASSIFIER, headers=headers),
        "metadata": metadata,
        "config": client.get_model_config(CLASSIFIER, headers=headers),
        "index": client.get_model_repository_index(headers=headers),
        **classify_batches(httpclient, client, headers, metadata),
        "unknown_model": error_of(lambda: client.get_model_metadata("nope", headers=headers)),
        "wrong_key": error_of(lambda: client.get_model_metadata(CLASSIFIER,
                                                                headers={"authorization": "Bearer wrong"})),
    }
    seen["statistics"] = client.get_inference_statistics(CLASSIFIER, headers=headers)["model_stats"]
    client.close()
    return seen


if __name__ == "__main__":
    grpc_address, http_address, api_key, ca = sys.argv[1:5]
    auth = {"authorization": f"Bearer {api_key}"}
    print(json.dumps({"grpc": grpc_checks(grpc_address, auth, ca), "http": http_checks(http_address, auth, ca)}))
