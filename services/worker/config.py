"""Worker configuration (flags / INFERMESH_WORKER_* variables)."""

from __future__ import annotations

import re
from dataclasses import dataclass

from services.common.config import ConfigError, ServerSettings, require, setting
from services.common.scheduler_address import parse_scheduler_address

# The loader's COMPUTE_DTYPES by name (that module imports torch; the config does not).
COMPUTE_DTYPE_NAMES = ("float32", "bfloat16", "float16")


@dataclass(frozen=True)
class WorkerConfig(ServerSettings):
    scheduler_address: str = setting(
        "127.0.0.1:50052", "scheduler(s) the worker dials (Attach): host:port[,host:port...] or dns:///name:port "
        "(every A/AAAA record, re-resolved): a classifier worker attaches to every one; a generator worker to "
        "one at a time, the one with fewest workers of its model")
    model_repository: str = setting("model_repo", "folder holding <name>/<version>/manifest.json")
    model_name: str = setting(
        "toy-classifier", "model to serve: a repository model, toy-classifier / toy-generator, or mock-* (tests)"
    )
    model_version: str = setting("1", "immutable model version to serve")
    worker_id: str = setting("", "unique id; empty derives host:pid:random")
    max_batch_size: int = setting(0, "classifier: override the manifest's max batch (0: manifest)", minimum=0)
    num_kv_blocks: int = setting(0, "generator: override the manifest's KV block count (0: manifest)", minimum=0)
    max_num_seqs: int = setting(
        0, "repository generator: override the manifest's running sequences per step (0: manifest), as vLLM's "
        "--max-num-seqs; more sequences per step cost less per token and more per step", minimum=0)
    reconnect_initial_s: float = setting(0.1, "first re-dial delay after the Attach stream breaks")
    reconnect_max_s: float = setting(
        0.5, "longest re-dial delay of a lost or refusing scheduler (exponential backoff, full jitter); short, "
        "so a restarted scheduler is found within about a second")
    rebalance_interval_s: float = setting(
        5.0, "generator workers with several schedulers: how often (jittered 0.5-1.5x) the worker checks whether "
        "its scheduler has 2+ workers of its model more than another, and if so moves there gracefully (0: never)",
        minimum=0)
    attach_keepalive_ms: int = setting(
        15_000, "HTTP/2 ping on the Attach stream this often; a scheduler frozen or cut off without a reset is "
        "noticed within this plus a third of it, then another is dialled (schedulers accept pings every "
        "--keepalive-min-ping-interval-ms, 10 s by default: keep this at or above theirs)", minimum=1000)
    toy_compute_ms: float = setting(0.0, "toy models only: simulated compute time per batch/step", minimum=0)
    mock_profile: str = setting(
        "", "mock-generator / mock-classifier only (tests, benchmarks): capacity and step time, e.g. "
        "'step_ms=10,per_token_us=20,num_kv_blocks=4096,max_num_seqs=256' (services/worker/mock_models.py)"
    )
    device: str = setting(
        "cpu", "repository models: where weights, KV cache and kernels run: 'cpu' or 'cuda[:N]' "
        "(one GPU per worker process)")
    compute_dtype: str = setting(
        "float32", "repository generators from safetensors: the dtype weights are cast to and matmuls run in: "
        "float32, bfloat16 or float16 (attention and the KV cache stay float32)")
    cuda_graphs: bool = setting(
        True, "repository generators on cuda: replay plain decode steps (one new token per sequence, up to "
        "--cuda-graph-max-batch-size of them) as CUDA graphs captured at start, as vLLM does; other steps, and "
        "every step if a capture fails (logged), run eagerly. 'false' runs every step eagerly; ignored on cpu")
    cuda_graph_max_batch_size: int = setting(
        32, "with --cuda-graphs: the largest decode batch captured (graphs for 1, 2, 4, ... up to it, and no more "
        "than --max-num-seqs); larger decode steps run eagerly", minimum=1)
    lora_adapters: str = setting(
        "", "repository Llama-family generators: LoRA adapters served over the model, name=DIR[,name=DIR...] "
        "(PEFT directories: adapter_config.json and adapter_model.safetensors); each name is a model of its own "
        "on the API (requests for several adapters and the base share each step)")
    num_threads: int = setting(
        0, "torch/OpenMP/Numba threads (0: from the CPU allocation: cgroup quota, else CPU affinity)", minimum=0
    )

    def __post_init__(self) -> None:
        super().__post_init__()  # with the minimums declared above
        # What follows relates fields, or parses them.
        try:
            parse_scheduler_address(self.scheduler_address)
        except ValueError as exc:
            raise ConfigError(str(exc)) from None
        require(bool(self.model_name), "model_name must not be empty")
        require(bool(self.model_version), "model_version must not be empty (there is no 'latest')")
        require(
            0 < self.reconnect_initial_s <= self.reconnect_max_s,
            "need 0 < reconnect_initial_s <= reconnect_max_s, got "
            f"{self.reconnect_initial_s} and {self.reconnect_max_s}",
        )
        try:
            parse_lora_adapters(self.lora_adapters)
        except ValueError as exc:
            raise ConfigError(str(exc)) from None
        require(self.model_name not in dict(parse_lora_adapters(self.lora_adapters)),
                f"a LoRA adapter cannot be named as the model it adapts ({self.model_name!r})")
        require(_is_device(self.device), f"device must be 'cpu', 'cuda' or 'cuda:N', got {self.device!r}")
        require(self.compute_dtype in COMPUTE_DTYPE_NAMES,
                f"compute_dtype must be one of {', '.join(COMPUTE_DTYPE_NAMES)}, got {self.compute_dtype!r}")


_ADAPTER_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:/-]*")


def parse_lora_adapters(value: str) -> tuple[tuple[str, str], ...]:
    """`name=DIR[,name=DIR...]` -> ((name, DIR), ...); ValueError naming the bad entry."""
    adapters: dict[str, str] = {}
    for entry in filter(None, (e.strip() for e in value.split(","))):
        name, sep, directory = entry.partition("=")
        if not sep or not directory or not _ADAPTER_NAME.fullmatch(name):
            raise ValueError(f"lora_adapters: {entry!r} is not name=DIR (a name of letters, digits and ._:/-)")
        if name in adapters:
            raise ValueError(f"lora_adapters: {name!r} is given twice")
        adapters[name] = directory
    return tuple(adapters.items())


def _is_device(name: str) -> bool:
    if name in ("cpu", "cuda"):
        return True
    prefix, _, index = name.partition(":")
    return prefix == "cuda" and index.isdigit()
