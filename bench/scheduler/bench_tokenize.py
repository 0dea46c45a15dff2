"""CPU the scheduler spends on text per request with an HF tokenizer (TOKENIZER_KIND_HF).

    .venv/bin/python -m bench.scheduler.bench_tokenize [--vocab 32000] [--repeats 3] [--calls 300]

A byte-level BPE (Llama 3's shape: ByteLevel with its split regex) is trained here on local text,
the Python standard library's sources (no download), and kept in --cache for the next run. Then,
per repeat, process CPU time (time.process_time_ns, so a shared box's waiting is not counted) of:
- encode: HFTokenizer.encode of a prompt of 100 and of 2000 tokens (what the scheduler's Generate
  does once per request), median and p99 over --calls calls, and per token;
- chat: ChatTemplate.render of a 3-message ChatML conversation plus its encode;
- stream: OutputStream.append + take per generated token (the per-token detokenization);
- build: HFTokenizer from the file's bytes (once per model version, at attach).
Prints one JSON object per repeat.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sysconfig
import time
from collections.abc import Callable
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from services.scheduler.chat_template import ChatTemplate
from services.scheduler.hf_tokenizer import HFTokenizer, HFTokenizerSource
from services.scheduler.output_stream import OutputStream

CHATML = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}"
          "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")
SPECIALS = ["<|begin_of_text|>", "<|end_of_text|>", "<|im_start|>", "<|im_end|>"]
CORPUS_BYTES = 12_000_000


def corpus() -> list[str]:
    texts, size = [], 0
    for path in sorted(Path(sysconfig.get_paths()["stdlib"]).rglob("*.py")):
        text = path.read_text(encoding="utf-8", errors="replace")
        texts.append(text)
        size += len(text)
        if size > CORPUS_BYTES:
            break
    return texts


def trained(vocab_size: int, cache: Path, texts: list[str]) -> bytes:
    if cache.exists():
        return cache.read_bytes()
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(texts, trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=SPECIALS, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False))
    data = tok.to_str().encode()
    cache.write_bytes(data)
    return data


def prompt_of(tokenizer: HFTokenizer, text: str, num_tokens: int) -> str:
    ids = tokenizer.encode(text, add_special_tokens=False)[:num_tokens]
    return tokenizer.decode(ids)


def cpu_us(fn: Callable[[], object], calls: int) -> list[float]:
    out = []
    for _ in range(calls):
        began = time.process_time_ns()
        fn()
        out.append((time.process_time_ns() - began) / 1000)
    return out


def summary(samples_us: list[float], num_tokens: int | None = None) -> dict:
    ordered = sorted(samples_us)
    out = {"median_us": round(statistics.median(ordered), 1),
           "p99_us": round(ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))], 1)}
    if num_tokens:
        out["median_us_per_token"] = round(statistics.median(ordered) / num_tokens, 3)
    return out


def stream_us_per_token(tokenizer: HFTokenizer, ids: tuple[int, ...]) -> float:
    stream = OutputStream(tokenizer, ("\n\n\n\n",))
    began = time.process_time_ns()
    for token_id in ids:
        if stream.append(token_id):
            break
        stream.take(final=False)
    stream.take(final=True)
    return (time.process_time_ns() - began) / 1000 / len(ids)


def run_once(source: HFTokenizerSource, texts: list[str], calls: int) -> dict:
    began = time.process_time_ns()
    tokenizer = HFTokenizer(source)
    build_ms = (time.process_time_ns() - began) / 1e6
    body = "\n".join(texts[-40:])  # files the training saw last: realistic, not the merges' own prefix
    result: dict = {"vocab_size": source.vocab_size, "build_ms": round(build_ms, 1)}
    for num_tokens in (100, 2000):
        prompt = prompt_of(tokenizer, body, num_tokens)
        actual = len(tokenizer.encode(prompt))
        result[f"encode_{num_tokens}"] = {"tokens": actual, **summary(cpu_us(lambda p=prompt: tokenizer.encode(p),
                                                                               calls), actual)}
    template = ChatTemplate(CHATML, {"bos_token": SPECIALS[0], "eos_token": SPECIALS[3]})
    messages = [{"role": "system", "content": "You are terse."},
                {"role": "user", "content": prompt_of(tokenizer, body, 80)},
                {"role": "user", "content": "Explain it."}]
    result["chat_render"] = summary(cpu_us(lambda: template.render(messages), calls))
    result["chat_render_and_encode"] = summary(cpu_us(
        lambda: tokenizer.encode(template.render(messages), add_special_tokens=False), calls))
    result["stream_us_per_token"] = round(stream_us_per_token(
        tokenizer, tokenizer.encode(prompt_of(tokenizer, body, 2000), add_special_tokens=False)), 3)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--calls", type=int, default=300)
    parser.add_argument("--cache", type=Path, default=Path(os.environ.get("TMPDIR", "/tmp")) / "infermesh_bpe.json")
    parser.add_argument("--quick", action="store_true", help="one repeat (`make bench QUICK=1`)")
    args = parser.parse_args()
    if args.quick:
        args.repeats = 1
    texts = corpus()
    cache = args.cache.with_name(f"{args.cache.stem}_{args.vocab}{args.cache.suffix}")
    data = trained(args.vocab, cache, texts)
    rust = Tokenizer.from_str(data.decode())
    source = HFTokenizerSource(tokenizer_json=data, vocab_size=rust.get_vocab_size(with_added_tokens=True),
                               eos_token_id=rust.token_to_id(SPECIALS[1]))
    print(json.dumps({"tokenizer_json_bytes": len(data), "corpus_files": len(texts)}))
    for _ in range(args.repeats):
        print(json.dumps(run_once(source, texts, args.calls)))


if __name__ == "__main__":
    main()
