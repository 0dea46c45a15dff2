"""What a user would write without us for an embedding model: sentence-transformers' pooling over
transformers' `AutoModel`, one request at a time behind a small HTTP server (bench_embeddings' peer).

    python -m bench.worker.embeddings_server --checkpoint DIR --port PORT [--threads 1]

POST /v1/embeddings with {"input": [str, ...], "encoding_format": "float" | "base64"} answers OpenAI's
shape: {"data": [{"index", "embedding"}], "usage": {"prompt_tokens"}}; base64 is each vector's
little-endian float32 bytes, as the mesh writes it. A request's inputs are one batch: tokenized with the
checkpoint's tokenizer.json (as the mesh tokenizes at its scheduler), padded on the right to the longest,
run through the model with the attention mask, then pooled as the directory's 1_Pooling/config.json says
(last token, mean or CLS over the real tokens) and normalized when modules.json lists a Normalize module,
as sentence-transformers' encode does with a batch. Connections stay open (HTTP/1.1); requests
are computed one at a time, in the order they came. Right padding keeps each input's positions as they
are alone (the model is causal: no real token sees a pad). The compute runs on one thread with the
thread count the worker gets (--threads, exported before torch loads), as bench/worker/transformers_server.py
does and for its reason. A development tool: it needs transformers (a test and dev dependency).
"""

from __future__ import annotations

import argparse
import base64
import json
import os
from concurrent.futures import ThreadPoolExecutor
from http.server import ThreadingHTTPServer
from pathlib import Path

from bench.harness.json_handler import JsonHandler

_NORMALIZE = "sentence_transformers.models.Normalize"


class KeepAliveServer(ThreadingHTTPServer):
    """A thread per connection, so that every client keeps its connection open (as with the mesh), while
    the compute thread still takes one request at a time (the others wait for it); a backlog of 64 as
    transformers_server's QueueingServer has, for its reason."""

    daemon_threads = True
    request_queue_size = 64


def read_pooling(checkpoint: Path) -> tuple[str, bool]:
    """("last" | "mean" | "cls", normalize) from the directory's sentence-transformers files."""
    modules = json.loads((checkpoint / "modules.json").read_text())
    pooling_dir = next(m["path"] for m in modules if m["type"].endswith("Pooling"))
    config = json.loads((checkpoint / pooling_dir / "config.json").read_text())
    modes = {"pooling_mode_lasttoken": "last", "pooling_mode_mean_tokens": "mean", "pooling_mode_cls_token": "cls"}
    on = [name for key, name in modes.items() if config.get(key)]
    if len(on) != 1:
        raise ValueError(f"{checkpoint}: one of {', '.join(modes)} must be on, got {on}")
    return on[0], any(m["type"] == _NORMALIZE for m in modules)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--checkpoint", type=Path, required=True)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    for name in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):
        os.environ[name] = str(args.threads)
    import numpy as np
    import torch
    from tokenizers import Tokenizer
    from transformers import AutoModel

    torch.set_num_threads(args.threads)
    pooling, normalize = read_pooling(args.checkpoint)
    compute = ThreadPoolExecutor(max_workers=1, thread_name_prefix="compute")
    model = compute.submit(lambda: AutoModel.from_pretrained(args.checkpoint, dtype=torch.float32).eval()).result()
    tokenizer = Tokenizer.from_file(str(args.checkpoint / "tokenizer.json"))

    def embed(texts: list[str]) -> tuple[np.ndarray, int]:
        ids = [e.ids for e in tokenizer.encode_batch(texts)]
        lengths = torch.tensor([len(i) for i in ids])
        batch = torch.zeros((len(ids), int(lengths.max())), dtype=torch.long)
        for row, seq in enumerate(ids):
            batch[row, :len(seq)] = torch.tensor(seq)
        mask = (torch.arange(batch.shape[1])[None, :] < lengths[:, None]).long()
        with torch.inference_mode():
            hidden = model(input_ids=batch, attention_mask=mask).last_hidden_state
            if pooling == "last":
                pooled = hidden[torch.arange(len(ids)), lengths - 1]
            elif pooling == "mean":
                pooled = (hidden * mask[..., None]).sum(dim=1) / lengths[:, None]
            else:
                pooled = hidden[:, 0]
            if normalize:
                pooled = torch.nn.functional.normalize(pooled, dim=-1)
        return pooled.float().numpy(), int(lengths.sum())

    compute.submit(embed, ["warm up"]).result()

    class Handler(JsonHandler):
        protocol_version = "HTTP/1.1"  # keep-alive: a client reuses its connection, as with the mesh

        def do_POST(self) -> None:  # noqa: N802 (http.server's name)
            body = self.read_json()
            texts = body["input"] if isinstance(body["input"], list) else [body["input"]]
            vectors, num_tokens = compute.submit(embed, texts).result()
            as_base64 = body.get("encoding_format") == "base64"
            data = [{"object": "embedding", "index": i,
                     "embedding": base64.b64encode(v.astype("<f4").tobytes()).decode() if as_base64 else v.tolist()}
                    for i, v in enumerate(vectors)]
            self.send_json({"object": "list", "data": data,
                            "usage": {"prompt_tokens": num_tokens, "total_tokens": num_tokens}})

    server = KeepAliveServer(("127.0.0.1", args.port), Handler)
    print("serving", flush=True)
    server.serve_forever()


if __name__ == "__main__":
    main()
