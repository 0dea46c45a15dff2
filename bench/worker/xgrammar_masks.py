"""xgrammar's token masks over given outputs, timed per token: the other half of the grammar engines'
comparison in bench/worker/bench_structured_output.py (issue 39). Runs in its own venv, never in the
project's (xgrammar needs torch, transformers and triton; the project's runtime stays on llguidance):

    .venv-xgrammar/bin/python -m bench.worker.xgrammar_masks IN.json OUT.json

IN.json: {"tokenizer_json": path, "vocab_size", "stop_token_ids", "schema": {...}, "sequences": [[id, ...], ...],
"runs"}. For each run, every sequence gets a fresh matcher; before each of its tokens the matcher fills
the next-token bitmask (timed: "mask") and then accepts the token (timed: "advance"), as the worker
masks then consumes. JSON is compiled as the scheduler compiles it for llguidance: json.dumps's
separators, no other whitespace. OUT.json: the compile and tokenizer seconds and, per run, every
token's microseconds ("mask_us", "advance_us") and the tokens xgrammar refused (it and llguidance may
disagree on a rare token; the sequence is cut there), and the first run's masks as digests
(mask_digest), for the caller to check that both engines allow the same ids.
"""

from __future__ import annotations

import hashlib
import json
import sys
import time
from pathlib import Path

import numpy as np


def main(in_path: Path, out_path: Path) -> None:
    import torch
    import xgrammar
    from transformers import PreTrainedTokenizerFast

    torch.set_num_threads(1)
    spec = json.loads(in_path.read_text())
    began = time.perf_counter()
    tokenizer = PreTrainedTokenizerFast(tokenizer_file=spec["tokenizer_json"])
    info = xgrammar.TokenizerInfo.from_huggingface(tokenizer, vocab_size=spec["vocab_size"],
                                                   stop_token_ids=spec["stop_token_ids"])
    tokenizer_s = time.perf_counter() - began
    began = time.perf_counter()
    compiler = xgrammar.GrammarCompiler(info, max_threads=1, cache_enabled=False)
    compiled = compiler.compile_json_schema(json.dumps(spec["schema"]), any_whitespace=False,
                                            separators=(", ", ": "))
    compile_s = time.perf_counter() - began
    bitmask = xgrammar.allocate_token_bitmask(1, spec["vocab_size"])
    runs = []
    digests: list[str] = []
    for run in range(spec["runs"]):
        mask_us: list[float] = []
        advance_us: list[float] = []
        refused = 0
        for sequence in spec["sequences"]:
            matcher = xgrammar.GrammarMatcher(compiled)
            for token in sequence:
                t0 = time.perf_counter()
                matcher.fill_next_token_bitmask(bitmask)
                t1 = time.perf_counter()
                accepted = matcher.accept_token(token)
                t2 = time.perf_counter()
                mask_us.append((t1 - t0) * 1e6)
                advance_us.append((t2 - t1) * 1e6)
                if run == 0:  # outside the timings: the mask's digest, to compare with llguidance's
                    digests.append(mask_digest(bitmask[0].numpy().view(np.uint8), spec["vocab_size"]))
                if not accepted:
                    refused += 1
                    break
        runs.append({"mask_us": mask_us, "advance_us": advance_us, "refused_sequences": refused})
    out_path.write_text(json.dumps({"engine": "xgrammar", "version": _version("xgrammar"), "tokenizer_s": tokenizer_s,
                                    "compile_s": compile_s, "runs": runs, "mask_digests": digests}))


def mask_digest(packed: np.ndarray, vocab_size: int) -> str:
    """sha256 of a little-endian bitmask's first vocab_size bits, as the allowed ids (llguidance's
    and xgrammar's bitmasks both put id i at bit i % 32 of 32-bit word i // 32), and how many."""
    allowed = np.flatnonzero(np.unpackbits(packed, bitorder="little")[:vocab_size])
    return f"{len(allowed)}:{hashlib.sha256(allowed.astype('<i4').tobytes()).hexdigest()[:16]}"


def _version(name: str) -> str:
    from importlib.metadata import version

    return version(name)


if __name__ == "__main__":
    main(Path(sys.argv[1]), Path(sys.argv[2]))
