"""lm-evaluation-harness against the mesh, compared with transformers: a stock-client check run by hand
(not in `make test`: lm_eval and its dependencies need a virtualenv of their own, ~1 GB).

    python3 -m venv /tmp/lmeval-venv
    /tmp/lmeval-venv/bin/pip install torch==2.13.0 "lm_eval[api]==0.4.13" transformers==5.24.0 \\
        tokenizers==0.23.3 safetensors==0.8.0 accelerate
    .venv/bin/python -m tools.lm_eval_check --lm-eval /tmp/lmeval-venv/bin/lm_eval

It makes a tiny Qwen2 checkpoint (tests/support/hf_checkpoints.py), serves it on a mesh of real
processes on 127.0.0.1, and runs lm_eval's `local-completions` model (token-id prompts; echo with
logprobs for loglikelihoods) on two local tasks: a multiple-choice one (loglikelihood) and a
generate_until one (greedy). Then it recomputes every loglikelihood and generation with transformers
on the token ids lm_eval sent, and prints the largest difference and how many generations agree.
Nothing is downloaded: the tasks read a local JSON file.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import torch
import transformers

from tests.support.hf_checkpoints import save_model_directory
from tests.support.hf_mesh import serving_checkpoints
from tools.testbed import session_tls

QUESTIONS = [
    ("The cat sat on the", ["mat", "moon", "dog"], 0),
    ("In a hole in the ground there lived a", ["hobbit", "dragon", "wizard", "king"], 0),
    ("Far over the misty mountains", ["cold", "warm"], 0),
    ("One ring to rule them", ["all", "none", "some"], 0),
    ("Grüße aus", ["Köln", "Berlin", "Zürich"], 2),
    ("The quick brown fox jumps over the lazy", ["dog", "cat"], 0),
    ("To be or not to", ["be", "go", "see"], 0),
    ("Numbers: 1, 2, 3,", [" 4", " 5", " 10"], 0),
]
TASKS = ("toy_mc", "toy_gen")


def write_tasks(work: Path) -> Path:
    data = work / "data.jsonl"
    data.write_text("".join(json.dumps({"question": q, "choices": c, "answer": a}) + "\n" for q, c, a in QUESTIONS))
    tasks = work / "tasks"
    tasks.mkdir(exist_ok=True)
    common = f"dataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {data}\ntest_split: test\n"
    (tasks / "toy_mc.yaml").write_text(
        "task: toy_mc\n" + common + "output_type: multiple_choice\ndoc_to_text: \"{{question}}\"\n"
        "doc_to_choice: \"{{choices}}\"\ndoc_to_target: \"{{answer}}\"\nmetric_list:\n  - metric: acc\n")
    (tasks / "toy_gen.yaml").write_text(
        "task: toy_gen\n" + common + "output_type: generate_until\ndoc_to_text: \"{{question}}\"\n"
        "doc_to_target: \"{{choices[answer]}}\"\ngeneration_kwargs:\n  until: [\"\\n\"]\n  max_gen_toks: 8\n"
        "  do_sample: false\nmetric_list:\n  - metric: exact_match\n")
    return tasks


def run_lm_eval(lm_eval: str, base: str, checkpoint: Path, tasks: Path, out: Path) -> None:
    ca = session_tls.session_pki().ca_path
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "OPENAI_API_KEY": "none",
           # lm_eval's aiohttp session verifies against the default CA file, not its ca_cert_path argument.
           "SSL_CERT_FILE": str(ca), "REQUESTS_CA_BUNDLE": str(ca)}
    env.pop("PYTHONPATH", None)  # this repository's kernels/ would shadow transformers' optional `kernels`
    shutil.rmtree(out, ignore_errors=True)
    done = subprocess.run(
        [lm_eval, "--model", "local-completions", "--model_args",
         f"model=tiny,base_url={base}/completions,tokenizer_backend=huggingface,tokenizer={checkpoint},"
         f"num_concurrent=4,max_retries=1,ca_cert_path={ca},tokenized_requests=True,max_length=2048",
         "--tasks", ",".join(TASKS), "--include_path", str(tasks), "--log_samples", "--output_path", str(out),
         "--batch_size", "1"], env=env, capture_output=True, text=True, timeout=900)
    print(done.stdout[-1500:])
    if done.returncode:
        sys.exit(f"lm_eval failed (rc {done.returncode}):\n{done.stderr[-4000:]}")


def samples(out: Path, task: str) -> list[dict]:
    path = sorted(glob.glob(str(out / "*" / f"samples_{task}_*.jsonl")))[-1]
    return [json.loads(line) for line in Path(path).read_text().splitlines()]


def compare(checkpoint: Path, out: Path) -> tuple[float, int, int]:
    """(largest |mesh - transformers| loglikelihood, generations equal, generations)."""
    tokenizer = transformers.AutoTokenizer.from_pretrained(checkpoint)
    model = transformers.AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
    worst = 0.0
    for sample in samples(out, "toy_mc"):
        for key, arg in sample["arguments"].items():
            context = tokenizer(arg["arg_0"], add_special_tokens=False)["input_ids"]
            ids = context + tokenizer(arg["arg_1"], add_special_tokens=False)["input_ids"]
            with torch.no_grad():
                logprobs = torch.log_softmax(model(torch.tensor([ids])).logits[0], -1)
            reference = sum(logprobs[i - 1, ids[i]].item() for i in range(len(context), len(ids)))
            served = float(sample["resps"][int(key.rsplit("_", 1)[1])][0][0])
            worst = max(worst, abs(reference - served))
    generations = samples(out, "toy_gen")
    equal = 0
    for sample in generations:
        ids = tokenizer(sample["arguments"]["gen_args_0"]["arg_0"], add_special_tokens=False)["input_ids"]
        output = model.generate(torch.tensor([ids]), do_sample=False, max_new_tokens=8, pad_token_id=0)
        text = tokenizer.decode(output[0][len(ids):], skip_special_tokens=True).split("\n")[0]
        equal += text == sample["resps"][0][0]
    return worst, equal, len(generations)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lm-eval", required=True, help="the lm_eval command of its own virtualenv")
    parser.add_argument("--work", default="/tmp/infermesh-lm-eval-check", help="scratch directory")
    args = parser.parse_args()
    work = Path(args.work)
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    tasks = write_tasks(work)
    save_model_directory(work / "mesh" / "tiny", "qwen2", seed=11, max_position_embeddings=2048)
    checkpoint = work / "mesh" / "tiny"
    with serving_checkpoints(work / "mesh", ["tiny"], kv_cache_bytes=1 << 22) as served:
        run_lm_eval(args.lm_eval, served.base, checkpoint, tasks, work / "out")
    worst, equal, total = compare(checkpoint, work / "out")
    print(f"loglikelihoods: largest |mesh - transformers| = {worst:.2e}; generate_until: {equal}/{total} equal")
    if worst > 1e-3 or equal != total:
        sys.exit(1)


if __name__ == "__main__":
    main()
