"""The golden check: the manifest's fixed inputs through the serving path, against the recorded outputs.

It runs at load, before the worker attaches, so a version whose weights and recorded
behaviour disagree is never served. Each kind registers its check in GOLDEN_CHECKS.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from services.common.tensor_datatypes import NUMPY_DTYPES
from services.worker.repository.errors import GoldenCheckFailed
from services.worker.repository.loader import LoadedModel
from services.worker.repository.manifest import ModelKind
from services.worker.tensor_work import TensorItem, WireTensor


def run_golden_check(model: LoadedModel) -> None:
    """Runs the manifest's fixed inputs through the serving path; GoldenCheckFailed on any mismatch."""
    GOLDEN_CHECKS[model.manifest.kind](model)


def _classifier(model: LoadedModel) -> None:
    """Through the preprocessing kernel and the CNN: each image's top-1 class."""
    m = model.manifest
    assert m.classifier is not None  # GOLDEN_CHECKS is keyed by the manifest's kind
    images = m.classifier.golden
    probs = model.classifier.classify([g.array() for g in images])
    got = [int(i) for i in probs.argmax(axis=1)]
    want = [g.expected_top1 for g in images]
    if got != want:
        raise GoldenCheckFailed(f"{m.name}/{m.version}: golden images classified as {got}, expected {want}")


def _generator(model: LoadedModel) -> None:
    """Through the paged KV path with chunked prefill: each prompt's greedy continuation, all prompts in
    the same steps (as the worker's steps batch sequences)."""
    m = model.manifest
    assert m.generator is not None
    if m.generator.embedding is not None:
        _embedding(model)
        return
    goldens = m.generator.golden
    continued = model.generator.greedy_paged_batch(
        [g.prompt_ids for g in goldens], [len(g.expected_ids) for g in goldens], block_size=m.envelope.block_size,
        prefill_chunk=max(1, m.envelope.max_num_batched_tokens // 2), adapters=[g.lora_adapter for g in goldens],
    )
    for i, (golden, got) in enumerate(zip(goldens, continued, strict=True)):
        if tuple(got) != golden.expected_ids:
            under = f" (LoRA adapter {golden.lora_adapter!r})" if golden.lora_adapter else ""
            raise GoldenCheckFailed(
                f"{m.name}/{m.version}: golden prompt {i}{under} continued as {got}, expected "
                f"{list(golden.expected_ids)}"
            )


def _embedding(model: LoadedModel) -> None:
    """An embedding model: each golden prompt's vector through the paged path and the pooling, all prompts in
    the same steps, within the spec's tolerance of the recorded one."""
    import torch  # a generator's check: the other kinds' workers need not load it

    m = model.manifest
    assert m.generator is not None and m.generator.embedding is not None
    spec = m.generator.embedding
    vectors = model.generator.embed_paged([g.prompt_ids for g in spec.golden], spec.pooling_spec,
                                          block_size=m.envelope.block_size,
                                          prefill_chunk=max(1, m.envelope.max_num_batched_tokens // 2))
    reduced = next(model.generator.lm.parameters()).dtype != torch.float32  # recorded in float32
    for i, (golden, got) in enumerate(zip(spec.golden, vectors, strict=True)):
        if not golden.matches(got, reduced_precision=reduced):
            raise GoldenCheckFailed(f"{m.name}/{m.version}: golden prompt {i}'s embedding differs from the recorded "
                                    f"one by up to {float(np.max(np.abs(got - np.asarray(golden.expected)))):.3g}")


def _tensor(model: LoadedModel) -> None:
    """Through the tensor executor (checks, image step, the model): each case's outputs, within the
    manifest's tolerance for floating-point outputs (another CPU or thread count rounds differently)
    and exactly for the others."""
    from services.worker.tensor_executor import TensorExecutor  # the executor imports the kernels

    m = model.manifest
    spec = m.tensor
    assert spec is not None
    executor = TensorExecutor(model.tensor, spec, m.envelope.max_batch_size)
    wire_datatype = {io.name: io.wire_datatype for io in spec.inputs}
    items = [TensorItem(i, tuple(WireTensor(t.name, wire_datatype[t.name], t.shape, t.data) for t in case.inputs))
             for i, case in enumerate(spec.golden)]
    results, _ = executor.execute(items)
    for i, (case, result) in enumerate(zip(spec.golden, results, strict=True)):
        if result.error is not None:
            raise GoldenCheckFailed(f"{m.name}/{m.version}: golden case {i} failed: {result.error.message}")
        got = {t.name: t for t in result.outputs}
        for want in case.outputs:
            io = next(o for o in spec.outputs if o.name == want.name)
            dtype = np.dtype(NUMPY_DTYPES[io.datatype])
            actual = np.frombuffer(got[want.name].data, dtype).reshape(got[want.name].shape)
            expected = np.frombuffer(want.data, dtype).reshape(want.shape)
            close = actual.shape == expected.shape and (
                np.allclose(actual, expected, atol=spec.golden_atol, rtol=spec.golden_rtol)
                if dtype.kind == "f" else np.array_equal(actual, expected))
            if not close:
                diff = (float(np.max(np.abs(actual.astype(np.float64) - expected)))
                        if actual.shape == expected.shape else float("nan"))
                raise GoldenCheckFailed(
                    f"{m.name}/{m.version}: golden case {i} output {want.name!r} is {list(actual.shape)} with max "
                    f"abs difference {diff:.3g} from the recorded {list(expected.shape)} "
                    f"(atol {spec.golden_atol}, rtol {spec.golden_rtol})")


GOLDEN_CHECKS: dict[ModelKind, Callable[[LoadedModel], None]] = {
    ModelKind.CLASSIFIER: _classifier,
    ModelKind.GENERATOR: _generator,
    ModelKind.TENSOR: _tensor,
}
