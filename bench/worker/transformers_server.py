"""What a user would write without us: transformers' `generate` behind a small HTTP server, one request
at a time (bench_hf_llm's peer for issue 33's ">= 5x the output tokens/s at equal p99").

    python -m bench.worker.transformers_server --checkpoint DIR --port PORT [--threads 2]

POST /generate with {"prompt": str, "max_tokens": int} answers {"token_ids": [...]} after greedy
decoding exactly max_tokens tokens (no early stop, as the mesh's ignore_eos). The prompt is tokenized
here with the checkpoint's tokenizer.json, as the mesh tokenizes at its scheduler. Requests are served
one at a time (a single-threaded server; concurrent callers queue), each on one compute thread with the thread count the
worker gets (--threads, exported before torch loads): on this box torch's multi-threaded GEMMs ran far
slower on a process's main thread, and the peer must not lose for that. A development tool: it needs
transformers (a test and dev dependency).
"""

from __future__ import annotations

import argparse
import os
from concurrent.futures import ThreadPoolExecutor
from http.server import HTTPServer
from pathlib import Path

from bench.harness.json_handler import JsonHandler


class QueueingServer(HTTPServer):
    """One request at a time; callers beyond it wait in the listen backlog. http.server's backlog of 5
    would drop the connections of an 8-client level, and the kernel's SYN retry (1 s, then 3 s) would
    charge the peer for a queue it never saw."""

    request_queue_size = 64


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--checkpoint", type=Path, required=True)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    for name in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):
        os.environ[name] = str(args.threads)
    import torch
    from tokenizers import Tokenizer
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(args.threads)
    compute = ThreadPoolExecutor(max_workers=1, thread_name_prefix="compute")
    model = compute.submit(lambda: AutoModelForCausalLM.from_pretrained(args.checkpoint, dtype=torch.float32).eval()
                           ).result()
    tokenizer = Tokenizer.from_file(str(args.checkpoint / "tokenizer.json"))

    def generate(prompt: str, max_tokens: int) -> list[int]:
        ids = torch.tensor([tokenizer.encode(prompt).ids])
        with torch.inference_mode():
            out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=max_tokens,
                                 min_new_tokens=max_tokens, pad_token_id=0)
        return out[0, ids.shape[1]:].tolist()

    compute.submit(generate, "warm up", 2).result()

    class Handler(JsonHandler):
        def do_POST(self) -> None:  # noqa: N802 (http.server's name)
            body = self.read_json()
            tokens = compute.submit(generate, body["prompt"], int(body["max_tokens"])).result()
            self.send_json({"token_ids": tokens})

    server = QueueingServer(("127.0.0.1", args.port), Handler)
    print("serving", flush=True)
    server.serve_forever()


if __name__ == "__main__":
    main()
