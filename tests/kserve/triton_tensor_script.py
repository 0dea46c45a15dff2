"""Runs under the official tritonclient (its own virtualenv, older protobuf): no project imports.

usage: python triton_tensor_script.py GRPC_HOST:PORT HTTP_HOST:PORT CA_FILE OUT_DIR MODEL [MODEL ...]
For each model, builds its inputs from ModelMetadata alone (batch 3, every other -1 dim 4, random
values of each declared datatype), infers over gRPC and over HTTP (binary tensors), and saves the
inputs and both protocols' outputs to OUT_DIR/<model>.npz. Prints one JSON object with the
metadata seen and the outputs' datatypes and shapes.
"""

import json
import sys

import numpy as np
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.utils import triton_to_np_dtype

BATCH = 3
DYNAMIC = 4


def example(tensor, rng):
    shape = [BATCH if i == 0 else (DYNAMIC if d == -1 else d) for i, d in enumerate(int(d) for d in tensor["shape"])]
    dtype = triton_to_np_dtype(tensor["datatype"])
    if np.issubdtype(dtype, np.floating):
        return rng.standard_normal(shape).astype(dtype)
    if dtype == np.bool_:
        return rng.integers(0, 2, shape).astype(bool)
    return rng.integers(0, 2, shape).astype(dtype)  # valid as indices of any embedding


def main(grpc_url, http_url, ca_file, out_dir, *models):
    import ssl

    grpc_client = grpcclient.InferenceServerClient(url=grpc_url, ssl=True, root_certificates=ca_file)
    http_client = httpclient.InferenceServerClient(
        url=http_url, ssl=True, ssl_context_factory=lambda: ssl.create_default_context(cafile=ca_file))
    rng = np.random.default_rng(0)
    seen = {}
    for model in models:
        metadata = grpc_client.get_model_metadata(model, as_json=True)
        arrays = {t["name"]: example(t, rng) for t in metadata["inputs"]}
        grpc_inputs, http_inputs = [], []
        for name, array in arrays.items():
            datatype = next(t["datatype"] for t in metadata["inputs"] if t["name"] == name)
            g = grpcclient.InferInput(name, list(array.shape), datatype)
            g.set_data_from_numpy(array)
            h = httpclient.InferInput(name, list(array.shape), datatype)
            h.set_data_from_numpy(array, binary_data=True)
            grpc_inputs.append(g)
            http_inputs.append(h)
        by_grpc = grpc_client.infer(model, grpc_inputs)
        by_http = http_client.infer(model, http_inputs)
        saved = {f"in.{k}": v for k, v in arrays.items()}
        for t in metadata["outputs"]:
            saved[f"grpc.{t['name']}"] = by_grpc.as_numpy(t["name"])
            saved[f"http.{t['name']}"] = by_http.as_numpy(t["name"])
        np.savez(f"{out_dir}/{model}.npz", **saved)
        seen[model] = {"metadata": metadata,
                       "outputs": {k: [str(v.dtype), list(v.shape)] for k, v in saved.items() if not k.startswith("in.")}}
    return seen


if __name__ == "__main__":
    print(json.dumps(main(*sys.argv[1:])))
