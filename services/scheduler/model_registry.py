"""Which model versions have workers, and the pool that serves each."""

from __future__ import annotations

import logging
from dataclasses import dataclass, fields

from services.common import errors
from services.scheduler import metrics
from services.scheduler.attach_types import ModelKind, WorkerHello
from services.scheduler.classify_pool import ClassifyPool
from services.scheduler.config import SchedulerConfig
from services.scheduler.generate_pool import GeneratePool
from services.scheduler.model_text import ModelText
from services.scheduler.step_scheduler import StepScheduler, StepSchedulerFactory
from services.scheduler.tokenizer_spec import TokenizerSpec
from services.scheduler.worker_link import ModelKey, WorkerLink

log = logging.getLogger(__name__)


@dataclass
class ModelEntry:
    key: ModelKey
    kind: ModelKind
    hello: WorkerHello  # what the first worker declared (labels, tokenizer, limits)
    pool: ClassifyPool | GeneratePool


@dataclass
class ClassifierEntry(ModelEntry):
    pool: ClassifyPool


@dataclass
class GeneratorEntry(ModelEntry):
    pool: GeneratePool


def _tokenizer_difference(attached: TokenizerSpec, declared: TokenizerSpec) -> str:
    differing = [f.name for f in fields(TokenizerSpec) if getattr(attached, f.name) != getattr(declared, f.name)]
    return "differs in " + ", ".join(differing)


class ModelRegistry:
    def __init__(self, config: SchedulerConfig, step_scheduler: StepSchedulerFactory = StepScheduler) -> None:
        self._config = config
        self._step_scheduler = step_scheduler
        self._models: dict[ModelKey, ModelEntry] = {}
        # LoRA adapters (WorkerHello.lora_adapters), each a model name of its own -> the version it adapts.
        self._adapters: dict[str, ModelKey] = {}

    def attach(self, link: WorkerLink) -> ModelEntry:
        hello = link.hello
        entry = self._models.get(link.model)
        try:
            if entry is None:
                entry = self._new_entry(hello)
                self._models[link.model] = entry
            else:
                self.check_compatible(hello)
            self._add_adapters(hello)
            entry.pool.add_worker(link)
        except ValueError as exc:  # a capacity or tokenizer the scheduler cannot work with
            raise errors.InvalidArgument(f"worker {link.worker_id}: {exc}") from None
        self._count_workers(entry)
        log.info("worker %s attached for %s (%d workers)", link.worker_id, link.model, len(entry.pool.workers))
        return entry

    def check_compatible(self, hello: WorkerHello) -> None:
        """InvalidArgument when the version is attached with another kind or tokenizer."""
        entry = self._models.get(hello.model)
        if entry is None:
            return
        if entry.kind != hello.kind:
            declared = hello.kind.wire_name if hello.kind is not None else "none"
            raise errors.InvalidArgument(
                f"worker {hello.worker_id} declares {hello.model} as kind {declared}, "
                f"but attached workers serve it as kind {entry.kind.wire_name}"
            )
        if entry.kind is ModelKind.GENERATOR and entry.hello.embedding != hello.embedding:
            raise errors.InvalidArgument(
                f"worker {hello.worker_id} declares {hello.model}'s embeddings as {hello.embedding}, but attached "
                f"workers serve them as {entry.hello.embedding}; a version's task and pooling are part of it"
            )
        if entry.kind is ModelKind.GENERATOR and entry.hello.tokenizer != hello.tokenizer:
            raise errors.InvalidArgument(
                f"worker {hello.worker_id} declares another tokenizer for {hello.model} than attached workers "
                f"({_tokenizer_difference(entry.hello.tokenizer, hello.tokenizer)}); a version's tokenizer "
                "and chat template are part of it"
            )

    def _add_adapters(self, hello: WorkerHello) -> None:
        """ValueError when an adapter's name is a model's, or another version's adapter's."""
        for name in hello.lora_adapters:
            base = self._adapters.get(name, hello.model)
            if base != hello.model or any(key.name == name for key in self._models):
                taken = f"LoRA adapter of {base}" if base != hello.model else "model"
                raise ValueError(f"LoRA adapter {name!r} of {hello.model} is named as a {taken} already served here")
        for name in hello.lora_adapters:
            self._adapters[name] = hello.model

    def adapters(self) -> dict[str, ModelKey]:
        """Each LoRA adapter's name -> the model version it adapts."""
        return dict(self._adapters)

    def model_text(self, model: ModelKey, spec: TokenizerSpec) -> ModelText | None:
        """The attached version's tokenizer and chat template when `spec` is the one it was built
        from (a further worker of the version: nothing to build again)."""
        entry = self._models.get(model)
        if isinstance(entry, GeneratorEntry) and entry.hello.tokenizer == spec:
            return entry.pool.text
        return None

    def _new_entry(self, hello: WorkerHello) -> ModelEntry:
        if hello.kind is ModelKind.CLASSIFIER:
            return ClassifierEntry(hello.model, hello.kind, hello, ClassifyPool(hello.model, hello, self._config))
        if hello.kind is ModelKind.GENERATOR:
            pool = GeneratePool(hello.model, hello, self._config, step_scheduler=self._step_scheduler)
            return GeneratorEntry(hello.model, hello.kind, hello, pool)
        raise errors.InvalidArgument(f"worker {hello.worker_id} declares no model kind")

    def draining(self, link: WorkerLink) -> None:
        """The worker takes no new work from now on (it finishes what it has)."""
        link.draining = True
        entry = self._models.get(link.model)
        if entry is not None:
            entry.pool.drain_worker(link)
            self._count_workers(entry)

    def detach(self, link: WorkerLink) -> None:
        entry = self._models.get(link.model)
        if entry is not None:
            entry.pool.remove_worker(link)
            self._count_workers(entry)
            log.info("worker %s detached from %s (%d left)", link.worker_id, link.model, len(entry.pool.workers))

    def _count_workers(self, entry: ModelEntry) -> None:
        metrics.WORKERS.labels(entry.key.name, entry.key.version).set(sum(w.usable for w in entry.pool.workers))

    def resolve_classifier(self, name: str, version: str) -> ClassifierEntry:
        entry = self._resolve(name, version, ModelKind.CLASSIFIER)
        assert isinstance(entry, ClassifierEntry)  # _resolve checked the kind
        return entry

    def resolve_generator(self, name: str, version: str) -> GeneratorEntry:
        """The generator `name` (a model, or a LoRA adapter: its base model) names."""
        return self.resolve_generator_adapter(name, version)[0]

    def resolve_generator_adapter(self, name: str, version: str) -> tuple[GeneratorEntry, str]:
        """The generator a request's model reference names, and the LoRA adapter it runs under ("": none).
        An adapter's name takes its base's version or none."""
        base = self._adapters.get(name)
        if base is not None:
            if version and version != base.version:
                raise errors.NotFound(f"model {name}:{version!r} is not served here: LoRA adapter {name!r} adapts "
                                      f"{base}")
            name, version, adapter = base.name, base.version, name
        else:
            adapter = ""
        entry = self._resolve(name, version, ModelKind.GENERATOR)
        assert isinstance(entry, GeneratorEntry)  # _resolve checked the kind
        return entry, adapter

    def _resolve(self, name: str, version: str, kind: ModelKind) -> ModelEntry:
        """The entry a request's model reference (name, version or "") names."""
        if not name:
            raise errors.InvalidArgument("model.name is required")
        entry: ModelEntry | None
        if version:
            entry = self._models.get(ModelKey(name, version))
        else:
            versions = [e for key, e in self._models.items() if key.name == name]
            if len(versions) > 1:
                # A version no worker serves any more (a retired canary, a worker that declared a
                # version by mistake) leaves its entry behind; it must not make the name ambiguous.
                versions = [e for e in versions if e.pool.workers] or versions
            if len(versions) > 1:
                names = ", ".join(sorted(e.key.version for e in versions))
                raise errors.InvalidArgument(f"model {name!r} has versions {names}; name one in model.version")
            entry = versions[0] if versions else None
        if entry is None:
            shown = f"{name}:{version}" if version else name
            raise errors.NotFound(f"model {shown!r} is not served here")
        if entry.kind != kind:
            wanted = "Classify" if kind is ModelKind.CLASSIFIER else "Generate"
            raise errors.InvalidArgument(f"model {entry.key} is a {entry.kind.wire_name} and cannot serve {wanted}")
        return entry

    def knows(self, name: str) -> bool:
        """Whether any worker ever attached a version of `name` here (metric labels use only these)."""
        return name in self._adapters or any(key.name == name for key in self._models)

    def get(self, key: ModelKey) -> ModelEntry | None:
        return self._models.get(key)

    def entries(self) -> list[ModelEntry]:
        return list(self._models.values())
