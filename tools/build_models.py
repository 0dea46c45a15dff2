"""Builds the demo models into a model repository, reproducibly and from local data only.

    python -m tools.build_models --out model_repo [--only digits|tinylm] [--force | --verify]

* `digits/1`: a small CNN on scikit-learn's handwritten digits (8x8, 0..16),
  served as 32x32 RGB uint8 images; the model's input is 16x16, so the
  preprocessing kernel really resizes. Prints held-out accuracy.
* `tinylm/1`: a byte-level decoder-only transformer (GQA, RoPE) trained on the
  standard library's `pydoc_data.topics`. Prints held-out bits per byte and a
  greedy sample.

Fixed seeds, a fixed thread count and deterministic algorithms make a rebuild
byte-identical on the same platform: torch and numpy versions, ATen CPU
capability, oneDNN ISA and CPU model, which the manifest's `build` block records
(tools/build_platform.py). A version directory that already holds a model built
from the same recipe is left alone (so a second `make models` is cheap); one built
from a different recipe is an error, since versions are immutable — bump the
version or pass --force.

The two demo models are shipped built, in the repository's model_repo/, so a
fresh clone serves at once (`make demo` trains nothing). The recipe stays the
source of truth: `--verify` (`make models`) rebuilds them from scratch in a
scratch directory and compares (tools/rebuild_check.py): bit for bit where the
platform matches the recorded one, elsewhere golden outputs identical and
quality and weights within docs/models.md's tolerances. A unit test fails when
a recipe changes without the shipped build being rebuilt.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import math
import shutil
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from kernels import preprocess_images
from services.worker.models.classifier import Cnn, CnnConfig
from services.worker.models.generator import Generator
from services.worker.models.transformer import DecoderLM, TransformerConfig
from services.worker.repository.classifier_spec import ClassifierInputs, ClassifierSpec, GoldenImage
from services.worker.repository.envelope import Envelope
from services.worker.repository.errors import InvalidManifest
from services.worker.repository.generator_spec import GeneratorSpec, GoldenGeneration
from services.worker.repository.golden import run_golden_check
from services.worker.repository.loader import load_model
from services.worker.repository.manifest import Manifest, ModelKind
from services.worker.repository.store import load_manifest, sha256_of, write_manifest
from services.worker.repository.tokenizer_spec import TokenizerSpec
from services.worker.repository.weights_spec import WeightsRef
from tools.build_platform import current_platform
from tools.rebuild_check import RebuildCheck, compare

BUILD_REVISION = "1"  # bump when the build code changes what a recipe produces
WEIGHTS_FILE = "weights.pt"
STAGING_DIR = ".staging"  # not a valid model name, so list_models never sees it
EOS_TOKEN_ID = 256
BOS_TOKEN_ID = 257
BYTE_VOCAB_SIZE = 258


@dataclass(frozen=True)
class DigitsRecipe:
    name: str = "digits"
    version: str = "1"
    seed: int = 0
    num_threads: int = 2
    served_size: int = 32  # the 8x8 digits are upscaled to this, RGB
    input_size: int = 16  # the network's input; preprocessing resizes served_size -> input_size
    conv_channels: tuple[int, ...] = (16, 32, 64)
    hidden_size: int = 128
    num_epochs: int = 12
    batch_size: int = 64
    learning_rate: float = 2e-3
    weight_decay: float = 1e-4
    test_fraction: float = 0.2
    num_golden: int = 4
    mean: tuple[float, ...] = (0.5, 0.5, 0.5)
    std: tuple[float, ...] = (0.5, 0.5, 0.5)
    max_image_pixels: int = 4096 * 4096
    max_batch_size: int = 64


@dataclass(frozen=True)
class TinyLMRecipe:
    name: str = "tinylm"
    version: str = "1"
    seed: int = 0
    num_threads: int = 2
    architecture: TransformerConfig = field(default_factory=lambda: TransformerConfig(
        vocab_size=BYTE_VOCAB_SIZE, num_layers=4, d_model=128, num_heads=4, num_kv_heads=2, d_ff=384,
    ))
    # 1024 so the chunked-prefill benchmark can mix in prompts whose prefill is many decode steps
    # long; trained at that length (4 x 1024 tokens per step, as many as 16 x 256 before).
    max_seq_len: int = 1024
    train_seq_len: int = 1024
    batch_size: int = 4
    num_steps: int = 500
    learning_rate: float = 3e-3
    warmup_steps: int = 30
    weight_decay: float = 0.01
    heldout_every: int = 10  # every n-th documentation topic (sorted by name) is held out
    num_eval_windows: int = 64
    golden_prompts: tuple[str, ...] = ("The ", "A list is ")
    num_golden_tokens: int = 24
    max_num_seqs: int = 16
    max_num_batched_tokens: int = 1024  # a whole max_seq_len prompt fits one step (chunking off)
    num_kv_blocks: int = 1024  # 16 sequences of 1024 tokens
    block_size: int = 16


@dataclass(frozen=True)
class BuildResult:
    name: str
    version: str
    path: Path
    built: bool  # False: an up-to-date build was already there
    quality: dict[str, float]
    sample_text: str = ""


def recipe_digest(recipe: DigitsRecipe | TinyLMRecipe) -> str:
    payload = json.dumps({"revision": BUILD_REVISION, "recipe": asdict(recipe)}, sort_keys=True)
    return hashlib.sha256(payload.encode()).hexdigest()


# ---------------------------------------------------------------------------
# digits
# ---------------------------------------------------------------------------


@dataclass(frozen=True)
class DigitsData:
    train_images: np.ndarray  # uint8[N, S, S, 3]
    train_labels: np.ndarray  # int64[N]
    test_images: np.ndarray
    test_labels: np.ndarray


def digits_dataset(recipe: DigitsRecipe = DigitsRecipe()) -> DigitsData:
    """The served form of scikit-learn's digits (upscaled RGB uint8), split train / held-out."""
    from PIL import Image
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    digits = load_digits()
    size = (recipe.served_size, recipe.served_size)

    def served(image8: np.ndarray) -> np.ndarray:
        grey = Image.fromarray(np.round(image8 * 255 / 16).astype(np.uint8), "L")
        return np.asarray(grey.resize(size, Image.Resampling.BILINEAR).convert("RGB"))

    images = np.stack([served(x) for x in digits.images])
    labels = digits.target.astype(np.int64)
    train, test = train_test_split(
        np.arange(len(labels)), test_size=recipe.test_fraction, random_state=recipe.seed, stratify=labels
    )
    return DigitsData(images[train], labels[train], images[test], labels[test])


def build_digits(root: Path, recipe: DigitsRecipe = DigitsRecipe(), force: bool = False,
                 log: Callable[[str], None] = print) -> BuildResult:
    return _build(root, recipe, force, log, _train_digits)


def _train_digits(recipe: DigitsRecipe, directory: Path, log: Callable[[str], None]) -> tuple[Manifest, str]:
    data = digits_dataset(recipe)
    config = CnnConfig(
        num_classes=10, in_channels=3, input_height=recipe.input_size, input_width=recipe.input_size,
        conv_channels=recipe.conv_channels, hidden_size=recipe.hidden_size,
    )

    def prep(images: np.ndarray) -> torch.Tensor:
        return torch.as_tensor(preprocess_images(list(images), recipe.input_size, recipe.input_size,
                                                  recipe.mean, recipe.std))

    x_train, y_train = prep(data.train_images), torch.from_numpy(data.train_labels)
    x_test = prep(data.test_images)
    started = time.perf_counter()
    net = Cnn(config)
    optimizer = torch.optim.AdamW(net.parameters(), lr=recipe.learning_rate, weight_decay=recipe.weight_decay)
    rng = torch.Generator().manual_seed(recipe.seed)
    num_batches = math.ceil(len(y_train) / recipe.batch_size)
    total_steps = recipe.num_epochs * num_batches
    for epoch in range(recipe.num_epochs):
        net.train()
        order = torch.randperm(len(y_train), generator=rng)
        for b in range(num_batches):
            _set_lr(optimizer, recipe.learning_rate * _cosine(epoch * num_batches + b, total_steps, 0))
            idx = order[b * recipe.batch_size:(b + 1) * recipe.batch_size]
            # Light augmentation: shift the whole batch by up to one input pixel.
            dy, dx = torch.randint(-1, 2, (2,), generator=rng).tolist()
            batch = torch.roll(x_train[idx], shifts=(dy, dx), dims=(2, 3))
            loss = F.cross_entropy(net(batch), y_train[idx])
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
    train_s = time.perf_counter() - started
    net.eval()
    with torch.inference_mode():
        predicted = net(x_test).argmax(1).numpy()
    accuracy = float((predicted == data.test_labels).mean())
    log(f"digits: held-out accuracy {accuracy:.4f} ({len(predicted)} images), trained in {train_s:.1f} s")
    if accuracy < 0.95:
        raise RuntimeError(f"digits held-out accuracy {accuracy:.4f} is below 0.95; not publishing")

    golden_idx = [i for i in range(len(predicted)) if predicted[i] == data.test_labels[i]][: recipe.num_golden]
    golden = tuple(
        GoldenImage(recipe.served_size, recipe.served_size, 3, data.test_images[i].tobytes(), int(predicted[i]))
        for i in golden_idx
    )
    weights = _save_weights(net, directory)
    activation_bytes = sum(
        c * (recipe.input_size // 2 ** max(0, i - 1)) ** 2 * 4 for i, c in enumerate(recipe.conv_channels)
    )
    manifest = Manifest(
        name=recipe.name, version=recipe.version, kind=ModelKind.CLASSIFIER, weights=weights,
        envelope=Envelope(
            max_batch_size=recipe.max_batch_size, max_num_seqs=0, max_num_batched_tokens=0, num_kv_blocks=0,
            block_size=0,
            memory_bytes=(directory / WEIGHTS_FILE).stat().st_size + recipe.max_batch_size * activation_bytes,
        ),
        classifier=ClassifierSpec(
            inputs=ClassifierInputs(recipe.input_size, recipe.input_size, 3, recipe.max_image_pixels,
                                    recipe.mean, recipe.std),
            labels=tuple(str(d) for d in range(10)),
            architecture=config,
            golden=golden,
        ),
        quality={"heldout_accuracy": accuracy, "num_heldout": float(len(predicted)), "train_seconds": train_s},
    )
    return manifest, ""


# ---------------------------------------------------------------------------
# tinylm
# ---------------------------------------------------------------------------


def text_corpus(recipe: TinyLMRecipe = TinyLMRecipe()) -> tuple[list[int], list[int]]:
    """Training and held-out token streams: each documentation topic's UTF-8 bytes followed by EOS."""
    from pydoc_data.topics import topics

    train: list[int] = []
    heldout: list[int] = []
    for i, key in enumerate(sorted(topics)):
        target = heldout if i % recipe.heldout_every == recipe.heldout_every - 1 else train
        target.extend(topics[key].encode("utf-8"))
        target.append(EOS_TOKEN_ID)
    return train, heldout


def encode_prompt(text: str) -> list[int]:
    return [BOS_TOKEN_ID, *text.encode("utf-8")]


def decode_ids(ids: Sequence[int]) -> str:
    return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")


def build_tinylm(root: Path, recipe: TinyLMRecipe = TinyLMRecipe(), force: bool = False,
                 log: Callable[[str], None] = print) -> BuildResult:
    return _build(root, recipe, force, log, _train_tinylm)


def _windows(stream: torch.Tensor, offsets: torch.Tensor, length: int) -> torch.Tensor:
    """BOS + `length` tokens from each offset: `int64[len(offsets), length + 1]`."""
    rows = torch.stack([stream[o:o + length] for o in offsets.tolist()])
    return torch.cat([torch.full((len(rows), 1), BOS_TOKEN_ID), rows], dim=1)


def _train_tinylm(recipe: TinyLMRecipe, directory: Path, log: Callable[[str], None]) -> tuple[Manifest, str]:
    train_ids, heldout_ids = text_corpus(recipe)
    train, heldout = torch.tensor(train_ids), torch.tensor(heldout_ids)
    length = recipe.train_seq_len - 1  # BOS takes position 0
    lm = DecoderLM(recipe.architecture)
    optimizer = torch.optim.AdamW(lm.parameters(), lr=recipe.learning_rate, betas=(0.9, 0.95),
                                  weight_decay=recipe.weight_decay)
    rng = torch.Generator().manual_seed(recipe.seed + 1)
    started = time.perf_counter()
    lm.train()
    loss = torch.tensor(float("nan"))
    for step in range(recipe.num_steps):
        _set_lr(optimizer, recipe.learning_rate * _cosine(step, recipe.num_steps, recipe.warmup_steps))
        batch = _windows(train, torch.randint(0, len(train) - length, (recipe.batch_size,), generator=rng), length)
        logits = lm(batch[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1))
        optimizer.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(lm.parameters(), 1.0)
        optimizer.step()
        if step % 100 == 0 or step == recipe.num_steps - 1:
            log(f"tinylm: step {step}/{recipe.num_steps} loss {loss.item():.3f} "
                f"({time.perf_counter() - started:.0f} s)")
    train_s = time.perf_counter() - started
    lm.eval()
    eval_offsets = torch.linspace(0, len(heldout) - length - 1, recipe.num_eval_windows).long()
    with torch.inference_mode():
        batch = _windows(heldout, eval_offsets, length)
        logits = lm(batch[:, :-1])
        heldout_nats = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1)).item()
    bits_per_byte = heldout_nats / math.log(2)
    log(f"tinylm: held-out {bits_per_byte:.3f} bits/byte (train loss {loss.item():.3f} nats), "
        f"trained in {train_s:.1f} s")

    generator = Generator(lm, max_seq_len=recipe.max_seq_len, eos_token_id=EOS_TOKEN_ID, bos_token_id=BOS_TOKEN_ID)
    golden = []
    samples = []
    for prompt in recipe.golden_prompts:
        ids = encode_prompt(prompt)
        expected = generator.greedy_dense(ids, recipe.num_golden_tokens)
        golden.append(GoldenGeneration(tuple(ids), tuple(expected)))
        samples.append(prompt + decode_ids(expected))
    sample = generator.greedy_dense(encode_prompt(recipe.golden_prompts[0]), 160)
    sample_text = recipe.golden_prompts[0] + decode_ids(sample[: sample.index(EOS_TOKEN_ID)] if EOS_TOKEN_ID in sample else sample)
    weights = _save_weights(lm, directory)
    c = recipe.architecture
    kv_bytes = 2 * c.num_layers * recipe.num_kv_blocks * recipe.block_size * c.num_kv_heads * c.head_size * 4
    activation_bytes = recipe.max_num_batched_tokens * (4 * c.d_model + 2 * c.d_ff + c.vocab_size) * 4
    manifest = Manifest(
        name=recipe.name, version=recipe.version, kind=ModelKind.GENERATOR, weights=weights,
        envelope=Envelope(
            max_batch_size=0, max_num_seqs=recipe.max_num_seqs, max_num_batched_tokens=recipe.max_num_batched_tokens,
            num_kv_blocks=recipe.num_kv_blocks, block_size=recipe.block_size,
            memory_bytes=(directory / WEIGHTS_FILE).stat().st_size + kv_bytes + activation_bytes,
        ),
        generator=GeneratorSpec(
            max_seq_len=recipe.max_seq_len,
            tokenizer=TokenizerSpec("bytes", BYTE_VOCAB_SIZE, EOS_TOKEN_ID, BOS_TOKEN_ID),
            architecture=recipe.architecture,
            golden=tuple(golden),
        ),
        quality={"heldout_bits_per_byte": bits_per_byte, "train_loss_nats": float(loss.item()),
                 "train_seconds": train_s, "num_parameters": float(sum(p.numel() for p in lm.parameters()))},
    )
    return manifest, sample_text


# ---------------------------------------------------------------------------
# shared
# ---------------------------------------------------------------------------


def _cosine(step: int, total: int, warmup: int) -> float:
    if step < warmup:
        return (step + 1) / warmup
    return 0.5 * (1 + math.cos(math.pi * (step - warmup) / max(1, total - warmup)))


def _set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    for group in optimizer.param_groups:
        group["lr"] = lr


def _save_weights(module: torch.nn.Module, directory: Path) -> WeightsRef:
    path = directory / WEIGHTS_FILE
    state = {k: v.detach().clone().contiguous() for k, v in module.state_dict().items()}
    torch.save(state, path)
    return WeightsRef(WEIGHTS_FILE, sha256_of(path))


def _existing_digest(root: Path, name: str, version: str) -> str | None:
    """The recipe digest of an intact existing build, None when there is none (or it is damaged)."""
    if not (root / name / version).exists():
        return None
    try:
        manifest = load_manifest(root, name, version)
    except InvalidManifest:
        return None
    weights = root / name / version / manifest.weights.file
    if not weights.is_file() or sha256_of(weights) != manifest.weights.sha256:
        return None
    return manifest.build.get("recipe_sha256", "")


def is_up_to_date(root: Path, recipe: DigitsRecipe | TinyLMRecipe) -> bool:
    """Whether root holds an intact build of exactly this recipe."""
    return _existing_digest(Path(root), recipe.name, recipe.version) == recipe_digest(recipe)


def _build(root: Path, recipe, force: bool, log: Callable[[str], None], train) -> BuildResult:
    root = Path(root)
    final = root / recipe.name / recipe.version
    digest = recipe_digest(recipe)
    existing = _existing_digest(root, recipe.name, recipe.version)
    if existing == digest and not force:
        manifest = load_manifest(root, recipe.name, recipe.version)
        log(f"{recipe.name}/{recipe.version}: up to date in {final}; quality {manifest.quality}")
        return BuildResult(recipe.name, recipe.version, final, False, manifest.quality)
    if final.exists() and existing is not None and not force:
        raise SystemExit(
            f"{final} holds a build from a different recipe and versions are immutable: bump the version, "
            f"remove the directory, or pass --force"
        )
    torch.manual_seed(recipe.seed)
    np.random.seed(recipe.seed)
    previous = torch.get_num_threads(), torch.are_deterministic_algorithms_enabled()
    torch.set_num_threads(recipe.num_threads)
    torch.use_deterministic_algorithms(True)
    # Build and golden-check under a staging root, then publish with one rename.
    staging_root = root / STAGING_DIR
    staging = staging_root / recipe.name / recipe.version
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    try:
        manifest, sample_text = train(recipe, staging, log)
        # current_platform() records torch.__version__ under "torch", as before.
        manifest = dataclasses.replace(
            manifest, build={"recipe_sha256": digest, "tool": "tools.build_models", **current_platform()}
        )
        write_manifest(manifest, staging)
        run_golden_check(load_model(staging_root, recipe.name, recipe.version))
        final.parent.mkdir(parents=True, exist_ok=True)
        if final.exists():
            shutil.rmtree(final)
        staging.rename(final)
    finally:
        shutil.rmtree(staging_root, ignore_errors=True)
        torch.set_num_threads(previous[0])
        torch.use_deterministic_algorithms(previous[1])
    log(f"{recipe.name}/{recipe.version}: built in {final}, golden check passed")
    return BuildResult(recipe.name, recipe.version, final, True, manifest.quality, sample_text)


def compare_builds(shipped_root: Path, rebuilt_root: Path, recipe: DigitsRecipe | TinyLMRecipe,
                   mode: str | None = None) -> RebuildCheck:
    """How the build in `shipped_root` compares with a fresh one in `rebuilt_root` (see tools/rebuild_check.py).

    A shipped build that is missing, damaged or from another recipe is a problem whatever the platform.
    """
    if not is_up_to_date(shipped_root, recipe):
        return RebuildCheck(
            recipe.name, recipe.version, "none", "the shipped build is not this recipe's", (),
            (f"{shipped_root / recipe.name / recipe.version} is missing, damaged or built from another recipe "
             f"(recipe sha256 {recipe_digest(recipe)})",))
    return compare(Path(shipped_root), Path(rebuilt_root), recipe.name, recipe.version, mode=mode)


def verify_rebuild(root: Path, recipe: DigitsRecipe | TinyLMRecipe, build,
                   log: Callable[[str], None] = print) -> RebuildCheck:
    """Rebuild `recipe` from scratch in a scratch root and compare with the build in `root`.

    The shipped weights are a cache; the recipe is the source of truth.
    """
    with tempfile.TemporaryDirectory(prefix="infermesh-rebuild-") as scratch:
        build(Path(scratch), recipe, force=True, log=log)
        return compare_builds(root, Path(scratch), recipe)


def report(check: RebuildCheck) -> list[str]:
    """The lines `--verify` prints for one model: which comparison, why, what it found."""
    lines = [f"{check.name}/{check.version}: {check.mode} comparison: {check.reason}"]
    lines += [f"  {finding}" for finding in check.findings]
    lines += [f"  NOT MATCHING: {problem}" for problem in check.problems]
    lines.append(f"{check.name}/{check.version}: {'matches the shipped build' if check.ok else 'FAILED'}")
    return lines


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tools.build_models", description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("model_repo"), help="repository root (default model_repo)")
    parser.add_argument("--only", choices=("digits", "tinylm"), action="append",
                        help="build only this model (repeatable)")
    parser.add_argument("--force", action="store_true", help="rebuild even when an up-to-date build exists")
    parser.add_argument("--verify", action="store_true",
                        help="rebuild from scratch in a scratch directory and compare with the build in --out "
                             "(the shipped demo models): bit for bit on the recorded platform, elsewhere "
                             "within docs/models.md's tolerances")
    args = parser.parse_args(argv)
    wanted = args.only or ["digits", "tinylm"]
    if args.verify:
        builders: dict[str, tuple[DigitsRecipe | TinyLMRecipe, Callable[..., BuildResult]]] = {
            "digits": (DigitsRecipe(), build_digits), "tinylm": (TinyLMRecipe(), build_tinylm)}
        checks = [verify_rebuild(args.out, *builders[name]) for name in wanted]
        for check in checks:
            print("\n".join(report(check)), file=sys.stdout if check.ok else sys.stderr)
        return 0 if all(check.ok for check in checks) else 1
    args.out.mkdir(parents=True, exist_ok=True)
    if "digits" in wanted:
        build_digits(args.out, force=args.force)
    if "tinylm" in wanted:
        result = build_tinylm(args.out, force=args.force)
        if result.sample_text:
            print(f"tinylm sample (greedy): {result.sample_text!r}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
