"""A load-test scenario: what to send, how often, as whom, and what counts as good.

The YAML schema is documented in docs/loadtest.md; `parse_scenario` checks it
field by field and names the offending field in every error.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from dataclasses import dataclass
from enum import Enum
from pathlib import Path
from typing import Any

import numpy as np
import yaml

from loadtest.arrivals import ArrivalProcess, RateSchedule, Segment
from loadtest.distributions import IntDist, fixed, parse_int_dist
from loadtest.targets.address import parse_target
from loadtest.trace import TraceEntry, read_trace


class LoadMode(Enum):
    OPEN = "open"  # arrivals follow the schedule whatever the server does
    CLOSED = "closed"  # a fixed number of clients, each sending its next request after a reply


class RequestKind(Enum):
    CLASSIFY = "classify"
    GENERATE = "generate"
    TENSOR = "tensor"  # KServe v2 ModelInfer with the class's own input tensors (kserve+ targets)


class ImageEncoding(Enum):
    PNG = "png"
    RAW = "raw"


class TextApi(Enum):
    """Which OpenAI endpoint an HTTP target gets a generate class's requests on."""

    COMPLETIONS = "completions"  # /v1/completions, the prompt as is
    CHAT = "chat"  # /v1/chat/completions, the prompt as one user message


@dataclass(frozen=True)
class TenantSpec:
    name: str
    api_key: str
    share: float  # normalized weight, sums to 1 over tenants
    priority: str  # label for the report; the gateway derives the real priority from the key


@dataclass(frozen=True)
class Slo:
    """A request is good when it succeeded and met every bound that is set."""

    e2e_ms: float | None = None
    ttft_ms: float | None = None
    tpot_ms: float | None = None

    def as_dict(self) -> dict[str, float]:
        return {k: v for k, v in dataclasses.asdict(self).items() if v is not None}


@dataclass(frozen=True)
class ImageSpec:
    height_px: IntDist
    width_px: IntDist
    channels: int
    encoding: ImageEncoding
    num_variants: int  # distinct images pre-generated per class; requests cycle through them


# KServe v2 datatypes a tensor class can generate, as little-endian numpy type strings.
TENSOR_DTYPES = {"BOOL": "|b1", "UINT8": "|u1", "UINT16": "<u2", "UINT32": "<u4", "UINT64": "<u8", "INT8": "|i1",
                 "INT16": "<i2", "INT32": "<i4", "INT64": "<i8", "FP16": "<f2", "FP32": "<f4", "FP64": "<f8"}
MAX_TENSOR_BYTES = 64 * 1024 * 1024  # the gRPC channel's message limit (loadtest/targets/infermesh_grpc.py)


class ValueDist(Enum):
    UNIFORM = "uniform"  # min..max (integers: inclusive; BOOL: true with probability 1/2)
    NORMAL = "normal"  # mean, std (integers: rounded; clipped to the datatype's range)
    FIXED = "fixed"  # every element `value`


@dataclass(frozen=True)
class TensorValues:
    """How a tensor input's elements are drawn."""

    dist: ValueDist
    a: float  # uniform: min; normal: mean; fixed: the value
    b: float  # uniform: max; normal: std; fixed: unused


@dataclass(frozen=True)
class TensorInputSpec:
    name: str
    datatype: str  # a key of TENSOR_DTYPES
    shape: tuple[IntDist, ...]  # each dim drawn per payload variant (a fixed int is the common case)
    values: TensorValues


@dataclass(frozen=True)
class TensorSpec:
    """A `tensor` class's request: every input, generated (seeded) once per variant."""

    inputs: tuple[TensorInputSpec, ...]
    num_variants: int  # distinct payloads pre-generated per class; requests draw among them


@dataclass(frozen=True)
class ClassSpec:
    name: str
    kind: RequestKind
    model: str
    version: str
    share: float  # normalized weight, sums to 1 over classes
    deadline_ms: float | None
    slo: Slo
    top_k: int = 1
    image: ImageSpec | None = None
    tensor: TensorSpec | None = None  # tensor classes only
    prompt_len: IntDist | None = None  # bytes (= tokens for the byte-level demo model)
    output_len: IntDist | None = None  # max_tokens
    temperature: float = 0.0
    ignore_eos: bool = True
    # Multi-turn sessions: each arrival starts a session of session_turns turns; each later turn
    # resends every earlier prompt and reply plus a new message, session_think_ms after the reply.
    session_turns: IntDist | None = None
    session_think_ms: IntDist | None = None
    # Synthetic prefix sharing: this fraction of each prompt is one of num_shared_prefixes fixed texts.
    shared_prefix_ratio: float = 0.0
    num_shared_prefixes: int = 1
    api: TextApi = TextApi.COMPLETIONS  # OpenAI targets only
    # HTTP targets: stream the reply (TTFT from the first content chunk) or wait for the whole of it.
    # infermesh's gRPC Generate and KServe's ModelStreamInfer always stream.
    stream: bool = True


@dataclass(frozen=True)
class LoadSpec:
    mode: LoadMode
    arrival: ArrivalProcess
    burstiness: float
    levels: tuple[Segment, ...]  # open: requests/s; closed: concurrent clients
    max_in_flight: int  # open: 0 unlimited; above it requests wait client-side (and that wait counts)
    think_time_ms: float  # closed: pause between a reply and the next request
    num_channels: int


@dataclass(frozen=True)
class SweepSpec:
    start_rps: float
    step_rps: float
    factor: float  # > 1: multiply instead of adding step_rps
    max_rps: float
    step_duration_s: float
    warmup_s: float
    min_goodput_ratio: float  # every class must keep at least this fraction of requests within SLO
    max_error_ratio: float
    refine_steps: int  # bisection steps between the last good and the first bad rate


@dataclass(frozen=True)
class TraceSpec:
    """Replay: arrivals, prompt and output lengths from a trace instead of the load and class draws."""

    path: Path
    speedup: float  # > 1 replays faster: a request at trace time t is sent at t / speedup
    class_name: str  # the generate class whose model, SLO and deadline every request takes
    block_tokens: int  # Mooncake hash-id block size
    entries: tuple[TraceEntry, ...]


@dataclass(frozen=True)
class Scenario:
    name: str
    target: str
    warmup_s: float
    seed: int
    window_s: float | None  # None: chosen from the duration
    lag_warn_ms: float
    load: LoadSpec
    tenants: tuple[TenantSpec, ...]
    classes: tuple[ClassSpec, ...]
    sweep: SweepSpec
    tokenizer: str = "bytes"  # counts output tokens a server does not report (loadtest/targets/token_count.py)
    trace: TraceSpec | None = None

    @property
    def duration_s(self) -> float:
        return sum(s.duration_s for s in self.load.levels)

    def schedule(self) -> RateSchedule:
        """Levels over the whole run: a warm-up at the first level, then the measured stages."""
        first = self.load.levels[0].from_value
        warmup = [Segment(self.warmup_s, first, first)] if self.warmup_s > 0 else []
        return RateSchedule([*warmup, *self.load.levels])

    def with_duration(self, duration_s: float) -> Scenario:
        """Same shape, stretched or shrunk to `duration_s` of measured time."""
        if not duration_s > 0:
            raise ValueError(f"duration_s must be > 0, got {duration_s}")
        scale = duration_s / self.duration_s
        levels = tuple(dataclasses.replace(s, duration_s=s.duration_s * scale) for s in self.load.levels)
        return dataclasses.replace(self, load=dataclasses.replace(self.load, levels=levels))

    def with_constant_level(self, value: float, duration_s: float | None = None) -> Scenario:
        """Replaces the schedule by one constant level (rate or concurrency)."""
        levels = (Segment(duration_s or self.duration_s, value, value),)
        return dataclasses.replace(self, load=dataclasses.replace(self.load, levels=levels))

    def with_trace(self, path: Path, speedup: float = 1.0, class_name: str = "", block_tokens: int = 512) -> Scenario:
        """Replays `path`: one open-loop level as long as the (sped-up) trace after warm-up, at its mean rate."""
        if not speedup > 0:
            raise ValueError(f"speedup must be > 0, got {speedup}")
        generate = [c for c in self.classes if c.kind is RequestKind.GENERATE]
        chosen = [c for c in generate if c.name == class_name] if class_name else generate[:1]
        if not chosen:
            raise ValueError(f"trace: class {class_name!r} is not a generate class of the scenario" if class_name
                             else "trace: the scenario needs a generate class for the trace's requests")
        entries = read_trace(path)
        span_s = entries[-1].t_s / speedup
        measured_s = max(span_s - self.warmup_s, 1e-3)
        if span_s <= self.warmup_s:
            raise ValueError(f"trace: {path} lasts {span_s:g} s at speedup {speedup:g}, no longer than the warm-up")
        rate = len(entries) / max(span_s, 1e-3)
        load = dataclasses.replace(self.load, mode=LoadMode.OPEN, levels=(Segment(measured_s, rate, rate),))
        return dataclasses.replace(self, load=load,
                                   trace=TraceSpec(path, speedup, chosen[0].name, block_tokens, entries))

    def models(self) -> set[str]:
        return {c.model for c in self.classes}


def load_scenario(path: str | Path) -> Scenario:
    with open(path, encoding="utf-8") as f:
        raw = yaml.safe_load(f)
    return parse_scenario(raw, default_name=Path(path).stem, base_dir=Path(path).parent)


def parse_scenario(raw: Any, default_name: str = "scenario", base_dir: Path | None = None,
                   environ: Mapping[str, str] | None = None) -> Scenario:
    """`base_dir` resolves relative `api_key_file`s (default: the working directory);
    `environ` is where `api_key_env` names are looked up (default: os.environ)."""
    doc = _mapping(raw, "scenario")
    _no_unknown(doc, "scenario", {"name", "target", "duration_s", "warmup_s", "seed", "window_s",
                                  "lag_warn_ms", "load", "tenants", "classes", "sweep", "tokenizer", "trace"})
    duration_s = _positive(doc.get("duration_s", 30), "duration_s") if "duration_s" in doc else None
    # A replayed trace sets the arrivals itself; `load` then only tunes max_in_flight and channels.
    load = _parse_load(_mapping(doc.get("load", {"rate_rps": 1} if "trace" in doc else None), "load"), duration_s)
    window_s = doc.get("window_s")
    scenario = Scenario(
        name=str(doc.get("name", default_name)),
        target=_target(doc.get("target", "127.0.0.1:50051")),
        warmup_s=_non_negative(doc.get("warmup_s", 0), "warmup_s"),
        seed=int(doc.get("seed", 1)),
        window_s=None if window_s is None else _positive(window_s, "window_s"),
        lag_warn_ms=_positive(doc.get("lag_warn_ms", 10), "lag_warn_ms"),
        load=load,
        tenants=_parse_tenants(doc.get("tenants"), base_dir or Path.cwd(), os.environ if environ is None else environ),
        classes=_parse_classes(doc.get("classes")),
        sweep=_parse_sweep(_mapping(doc.get("sweep", {}), "sweep"), load),
        tokenizer=_tokenizer(doc.get("tokenizer", "bytes")),
    )
    if "trace" not in doc:
        return scenario
    trace = _mapping(doc["trace"], "trace")
    _no_unknown(trace, "trace", {"path", "speedup", "class", "block_tokens"})
    if not isinstance(trace.get("path"), str) or not trace["path"]:
        raise ValueError("trace.path is required: a JSONL file (relative to the scenario's directory)")
    path = Path(trace["path"]) if Path(trace["path"]).is_absolute() else (base_dir or Path.cwd()) / trace["path"]
    return scenario.with_trace(path, _positive(trace.get("speedup", 1), "trace.speedup"), str(trace.get("class", "")),
                               int(_positive(trace.get("block_tokens", 512), "trace.block_tokens")))


def _target(raw: Any) -> str:
    if not isinstance(raw, str):
        raise ValueError(f"target must be a string (HOST:PORT or a URL), got {raw!r}")
    parse_target(raw)  # names what is wrong with it now, not when the run starts
    return raw


def _tokenizer(raw: Any) -> str:
    if not isinstance(raw, str) or not (raw == "bytes" or (raw.startswith("hf:") and len(raw) > 3)):
        raise ValueError(f"tokenizer must be 'bytes' or 'hf:PATH/tokenizer.json', got {raw!r}")
    return raw


def _parse_load(raw: dict, duration_s: float | None) -> LoadSpec:
    _no_unknown(raw, "load", {"mode", "arrival", "burstiness", "rate_rps", "concurrency", "stages",
                              "max_in_flight", "think_time_ms", "num_channels", "bursts"})
    mode = _enum(LoadMode, raw.get("mode", "open"), "load.mode")
    unit = "rps" if mode is LoadMode.OPEN else "concurrency"
    level_key = "rate_rps" if mode is LoadMode.OPEN else "concurrency"
    if "stages" in raw:
        levels = tuple(_parse_stage(s, i, mode) for i, s in enumerate(_list(raw["stages"], "load.stages")))
        if duration_s is not None and abs(sum(s.duration_s for s in levels) - duration_s) > 1e-9:
            raise ValueError(f"duration_s ({duration_s}) disagrees with the sum of load.stages durations; drop one")
    else:
        if level_key not in raw:
            raise ValueError(f"load: mode {mode.value} needs {level_key!r} or 'stages'")
        value = _positive(raw[level_key], f"load.{level_key}")
        levels = (Segment(duration_s or 30.0, value, value),)
        if "bursts" in raw:
            if mode is not LoadMode.OPEN:
                raise ValueError("load.bursts applies to open-loop rate_rps")
            levels = _bursts(_mapping(raw["bursts"], "load.bursts"), duration_s or 30.0, value)
    if mode is LoadMode.CLOSED and any(s.from_value < 1 or s.to_value < 1 for s in levels):
        raise ValueError(f"load: closed-loop {unit} must be >= 1 in every stage")
    return LoadSpec(
        mode=mode,
        arrival=_enum(ArrivalProcess, raw.get("arrival", "poisson"), "load.arrival"),
        burstiness=_positive(raw.get("burstiness", 1.0), "load.burstiness"),
        levels=levels,
        max_in_flight=int(_non_negative(raw.get("max_in_flight", 0), "load.max_in_flight")),
        think_time_ms=_non_negative(raw.get("think_time_ms", 0), "load.think_time_ms"),
        num_channels=int(_positive(raw.get("num_channels", 1), "load.num_channels")),
    )


def _bursts(raw: dict, total_s: float, base_rps: float) -> tuple[Segment, ...]:
    """rate_rps, with a burst of `rate_rps` for `duration_s` at the end of every `every_s`."""
    _no_unknown(raw, "load.bursts", {"every_s", "duration_s", "rate_rps"})
    every_s = _positive(raw.get("every_s"), "load.bursts.every_s")
    burst_s = _positive(raw.get("duration_s"), "load.bursts.duration_s")
    burst_rps = _positive(raw.get("rate_rps"), "load.bursts.rate_rps")
    if burst_s >= every_s:
        raise ValueError(f"load.bursts.duration_s ({burst_s}) must be shorter than every_s ({every_s})")
    levels: list[Segment] = []
    start_s = 0.0
    while start_s < total_s - 1e-9:
        quiet_s = min(every_s - burst_s, total_s - start_s)
        levels.append(Segment(quiet_s, base_rps, base_rps))
        loud_s = min(burst_s, total_s - start_s - quiet_s)
        if loud_s > 1e-9:
            levels.append(Segment(loud_s, burst_rps, burst_rps))
        start_s += quiet_s + max(loud_s, 0.0)
    return tuple(levels)


def _parse_stage(raw: Any, index: int, mode: LoadMode) -> Segment:
    field = f"load.stages[{index}]"
    stage = _mapping(raw, field)
    key = "rps" if mode is LoadMode.OPEN else "concurrency"
    step_key = "rate_rps" if mode is LoadMode.OPEN else "concurrency"
    _no_unknown(stage, field, {"duration_s", step_key, f"from_{key}", f"to_{key}"})
    duration_s = _positive(stage.get("duration_s"), f"{field}.duration_s")
    if step_key in stage:
        value = _non_negative(stage[step_key], f"{field}.{step_key}")
        return Segment(duration_s, value, value)
    if f"from_{key}" in stage and f"to_{key}" in stage:
        return Segment(duration_s, _non_negative(stage[f"from_{key}"], f"{field}.from_{key}"),
                       _non_negative(stage[f"to_{key}"], f"{field}.to_{key}"))
    raise ValueError(f"{field}: give {step_key!r} (step) or 'from_{key}' and 'to_{key}' (ramp)")


_KEY_SOURCES = ("api_key", "api_key_env", "api_key_file")


def _parse_tenants(raw: Any, base_dir: Path, environ: Mapping[str, str]) -> tuple[TenantSpec, ...]:
    items = _list(raw, "tenants")
    if not items:
        raise ValueError("tenants: at least one tenant is needed")
    parsed = []
    for i, item in enumerate(items):
        field = f"tenants[{i}]"
        t = _mapping(item, field)
        _no_unknown(t, field, {"name", "share", "priority", *_KEY_SOURCES})
        parsed.append((str(t.get("name", f"tenant{i}")), _api_key(t, field, base_dir, environ),
                       _positive(t.get("share", 1), f"{field}.share"), str(t.get("priority", "standard"))))
    _unique([p[0] for p in parsed], "tenants")
    total = sum(p[2] for p in parsed)
    return tuple(TenantSpec(name, key, share / total, prio) for name, key, share, prio in parsed)


def _api_key(tenant: dict, field: str, base_dir: Path, environ: Mapping[str, str]) -> str:
    """The tenant's key: inline, from an environment variable, or from a file (so scenarios can be
    committed without secrets). Exactly one source."""
    given = [k for k in _KEY_SOURCES if k in tenant]
    if len(given) != 1:
        raise ValueError(f"{field}: give exactly one of {', '.join(_KEY_SOURCES)} (got {given or 'none'})")
    source = given[0]
    value = tenant[source]
    if not isinstance(value, str) or not value.strip():
        raise ValueError(f"{field}.{source} must be a non-empty string")
    if source == "api_key":
        return value
    if source == "api_key_env":
        key = environ.get(value, "")
        if not key.strip():
            raise ValueError(f"{field}.api_key_env: environment variable {value} is not set or empty")
        return key.strip()
    path = Path(value) if Path(value).is_absolute() else base_dir / value
    try:
        key = path.read_text(encoding="utf-8").strip()
    except OSError as err:
        raise ValueError(f"{field}.api_key_file: cannot read {path}: {err.strerror or err}") from None
    if not key:
        raise ValueError(f"{field}.api_key_file: {path} is empty")
    return key


_GENERATE_KEYS = ("prompt_len", "output_len", "temperature", "ignore_eos", "api", "stream", "shared_prefix",
                 "session")
_CLASS_KEYS = {"name", "kind", "model", "version", "share", "deadline_ms", "slo", "top_k", "image", "tensor",
               *_GENERATE_KEYS}


def _parse_classes(raw: Any) -> tuple[ClassSpec, ...]:
    items = _list(raw, "classes")
    if not items:
        raise ValueError("classes: at least one request class is needed")
    parsed = [_parse_class(_mapping(item, f"classes[{i}]"), f"classes[{i}]") for i, item in enumerate(items)]
    _unique([c.name for c in parsed], "classes")
    total = sum(c.share for c in parsed)
    return tuple(dataclasses.replace(c, share=c.share / total) for c in parsed)


def _parse_class(c: dict, field: str) -> ClassSpec:
    _no_unknown(c, field, _CLASS_KEYS)
    kind = _enum(RequestKind, c.get("kind"), f"{field}.kind")
    if not c.get("model"):
        raise ValueError(f"{field}.model is required")
    deadline = c.get("deadline_ms")
    common = dict(
        name=str(c.get("name", f"{kind.value}{field}")),
        kind=kind,
        model=str(c["model"]),
        version=str(c.get("version", "")),
        share=_positive(c.get("share", 1), f"{field}.share"),
        deadline_ms=None if deadline is None else _positive(deadline, f"{field}.deadline_ms"),
        slo=_parse_slo(_mapping(c.get("slo", {}), f"{field}.slo"), f"{field}.slo", kind),
    )
    for key in _GENERATE_KEYS:
        if key in c and kind is not RequestKind.GENERATE:
            raise ValueError(f"{field}.{key} applies to generate classes only")
    for key in ("image", "top_k"):
        if key in c and kind is not RequestKind.CLASSIFY:
            raise ValueError(f"{field}.{key} applies to classify classes only")
    if "tensor" in c and kind is not RequestKind.TENSOR:
        raise ValueError(f"{field}.tensor applies to tensor classes only")
    if kind is RequestKind.CLASSIFY:
        return ClassSpec(**common, top_k=int(_positive(c.get("top_k", 1), f"{field}.top_k")),
                         image=_parse_image(_mapping(c.get("image", {}), f"{field}.image"), f"{field}.image"))
    if kind is RequestKind.TENSOR:
        if "tensor" not in c:
            raise ValueError(f"{field}.tensor is required for a tensor class: {{inputs: [{{name, datatype, shape, "
                             f"values}}], num_variants}}")
        return ClassSpec(**common, tensor=_parse_tensor(_mapping(c["tensor"], f"{field}.tensor"), f"{field}.tensor"))
    return ClassSpec(
        **common,
        prompt_len=parse_int_dist(c.get("prompt_len", 16), f"{field}.prompt_len"),
        output_len=parse_int_dist(c.get("output_len", 16), f"{field}.output_len"),
        temperature=_non_negative(c.get("temperature", 0.0), f"{field}.temperature"),
        ignore_eos=bool(c.get("ignore_eos", True)),
        **_shared_prefix(_mapping(c.get("shared_prefix", {}), f"{field}.shared_prefix"), f"{field}.shared_prefix"),
        **_session(c.get("session"), f"{field}.session"),
        api=_enum(TextApi, c.get("api", "completions"), f"{field}.api"),
        stream=_bool(c.get("stream", True), f"{field}.stream"),
    )


def _shared_prefix(raw: dict, field: str) -> dict:
    _no_unknown(raw, field, {"ratio", "num_prefixes"})
    ratio = _non_negative(raw.get("ratio", 0.0), f"{field}.ratio")
    if ratio > 1:
        raise ValueError(f"{field}.ratio must be in [0, 1], got {ratio}")
    return {"shared_prefix_ratio": ratio,
            "num_shared_prefixes": int(_positive(raw.get("num_prefixes", 1), f"{field}.num_prefixes"))}


def _session(raw: Any, field: str) -> dict:
    if raw is None:
        return {}
    session = _mapping(raw, field)
    _no_unknown(session, field, {"turns", "think_time_ms"})
    if "turns" not in session:
        raise ValueError(f"{field}.turns is required (an integer or a distribution)")
    return {"session_turns": parse_int_dist(session["turns"], f"{field}.turns"),
            "session_think_ms": parse_int_dist(session.get("think_time_ms", 0), f"{field}.think_time_ms", minimum=0)}


def _bool(raw: Any, field: str) -> bool:
    if not isinstance(raw, bool):
        raise ValueError(f"{field} must be true or false, got {raw!r}")
    return raw


def _parse_slo(raw: dict, field: str, kind: RequestKind) -> Slo:
    _no_unknown(raw, field, {"e2e_ms", "ttft_ms", "tpot_ms"})
    if kind is not RequestKind.GENERATE and ({"ttft_ms", "tpot_ms"} & raw.keys()):
        raise ValueError(f"{field}: ttft_ms/tpot_ms apply to generate classes only")
    return Slo(**{k: _positive(v, f"{field}.{k}") for k, v in raw.items()})


def _parse_image(raw: dict, field: str) -> ImageSpec:
    _no_unknown(raw, field, {"height_px", "width_px", "size_px", "channels", "encoding", "num_variants"})
    size = raw.get("size_px")
    height = parse_int_dist(raw.get("height_px", size if size is not None else 32), f"{field}.height_px")
    width = parse_int_dist(raw.get("width_px", size), f"{field}.width_px") if (
        "width_px" in raw or size is not None) else height
    channels = int(raw.get("channels", 3))
    if channels not in (1, 3, 4):
        raise ValueError(f"{field}.channels must be 1, 3 or 4, got {channels}")
    return ImageSpec(
        height_px=height,
        width_px=width,
        channels=channels,
        encoding=_enum(ImageEncoding, raw.get("encoding", "png"), f"{field}.encoding"),
        num_variants=int(_positive(raw.get("num_variants", 16), f"{field}.num_variants")),
    )


def _parse_tensor(raw: dict, field: str) -> TensorSpec:
    _no_unknown(raw, field, {"inputs", "num_variants"})
    items = _list(raw.get("inputs"), f"{field}.inputs")
    if not items:
        raise ValueError(f"{field}.inputs: at least one input tensor is needed")
    inputs = tuple(_parse_tensor_input(_mapping(item, f"{field}.inputs[{i}]"), f"{field}.inputs[{i}]")
                   for i, item in enumerate(items))
    _unique([t.name for t in inputs], f"{field}.inputs")
    return TensorSpec(inputs, int(_positive(raw.get("num_variants", 8), f"{field}.num_variants")))


def _parse_tensor_input(raw: dict, field: str) -> TensorInputSpec:
    _no_unknown(raw, field, {"name", "datatype", "shape", "values"})
    name = raw.get("name")
    if not isinstance(name, str) or not name:
        raise ValueError(f"{field}.name is required: the model's input name")
    datatype = raw.get("datatype")
    if datatype == "BYTES":
        raise ValueError(f"{field}.datatype: BYTES inputs are not generated; use an image (classify) or text "
                         f"(generate) class, or a numeric datatype")
    if datatype not in TENSOR_DTYPES:
        raise ValueError(f"{field}.datatype must be one of {', '.join(TENSOR_DTYPES)}, got {datatype!r}")
    dims = _list(raw.get("shape"), f"{field}.shape")
    if not dims:
        raise ValueError(f"{field}.shape: at least one dim is needed (the batch first, e.g. [1, 3, 32, 32])")
    shape = tuple(parse_int_dist(d, f"{field}.shape[{i}]") for i, d in enumerate(dims))
    most_bytes = int(np.dtype(TENSOR_DTYPES[datatype]).itemsize * np.prod([d.high for d in shape], dtype=np.float64))
    if most_bytes > MAX_TENSOR_BYTES:
        raise ValueError(f"{field}.shape: up to {most_bytes} bytes of {datatype}, more than a request may carry "
                         f"({MAX_TENSOR_BYTES})")
    return TensorInputSpec(name, datatype, shape,
                           _parse_values(_mapping(raw.get("values", {}), f"{field}.values"), f"{field}.values",
                                         datatype))


def _parse_values(raw: dict, field: str, datatype: str) -> TensorValues:
    dist = _enum(ValueDist, raw.get("dist", "uniform"), f"{field}.dist")
    keys = {ValueDist.UNIFORM: ("min", "max"), ValueDist.NORMAL: ("mean", "std"), ValueDist.FIXED: ("value",)}[dist]
    _no_unknown(raw, field, {"dist", *keys})
    if datatype == "BOOL":
        if dist is ValueDist.NORMAL or (dist is ValueDist.UNIFORM and ({"min", "max"} & raw.keys())):
            raise ValueError(f"{field}: BOOL elements are uniform (true or false, each half the time) or "
                             f"{{dist: fixed, value: 0|1}}")
        if dist is ValueDist.FIXED:
            value = _number(raw.get("value"), f"{field}.value")
            if value not in (0, 1):
                raise ValueError(f"{field}.value of a BOOL input must be 0 or 1, got {value!r}")
            return TensorValues(dist, value, 0.0)
        return TensorValues(dist, 0.0, 1.0)
    dtype = np.dtype(TENSOR_DTYPES[datatype])
    low, high = ((float(np.iinfo(dtype).min), float(np.iinfo(dtype).max)) if dtype.kind in "iu"
                 else (float(np.finfo(dtype).min), float(np.finfo(dtype).max)))
    if dist is ValueDist.UNIFORM:
        default_high = 1.0 if dtype.kind == "f" else min(high, 100.0)
        a, b = _number(raw.get("min", 0.0), f"{field}.min"), _number(raw.get("max", default_high), f"{field}.max")
        if b < a:
            raise ValueError(f"{field}: max ({b:g}) must be >= min ({a:g})")
        checked: tuple[float, ...] = (a, b)
    elif dist is ValueDist.NORMAL:
        a, b = _number(raw.get("mean", 0.0), f"{field}.mean"), _non_negative(raw.get("std", 1.0), f"{field}.std")
        checked = (a,)
    else:
        if "value" not in raw:
            raise ValueError(f"{field}: dist fixed needs 'value'")
        a, b = _number(raw["value"], f"{field}.value"), 0.0
        checked = (a,)
    for value in checked:
        if not low <= value <= high:
            raise ValueError(f"{field}: {value:g} is outside {datatype}'s range [{low:g}, {high:g}]")
    return TensorValues(dist, a, b)


def _parse_sweep(raw: dict, load: LoadSpec) -> SweepSpec:
    _no_unknown(raw, "sweep", {"start_rps", "step_rps", "factor", "max_rps", "step_duration_s", "warmup_s",
                               "min_goodput_ratio", "max_error_ratio", "refine_steps"})
    start = _positive(raw.get("start_rps", max(load.levels[0].from_value, 1.0)), "sweep.start_rps")
    ratio = float(raw.get("min_goodput_ratio", 0.99))
    if not 0 < ratio <= 1:
        raise ValueError(f"sweep.min_goodput_ratio must be in (0, 1], got {ratio}")
    factor = float(raw.get("factor", 0))
    if factor and factor <= 1:
        raise ValueError(f"sweep.factor must be > 1 when set, got {factor}")
    return SweepSpec(
        start_rps=start,
        step_rps=_positive(raw.get("step_rps", start), "sweep.step_rps"),
        factor=factor,
        max_rps=_positive(raw.get("max_rps", start * 20), "sweep.max_rps"),
        step_duration_s=_positive(raw.get("step_duration_s", 10), "sweep.step_duration_s"),
        warmup_s=_non_negative(raw.get("warmup_s", 2), "sweep.warmup_s"),
        min_goodput_ratio=ratio,
        max_error_ratio=_non_negative(raw.get("max_error_ratio", 0.01), "sweep.max_error_ratio"),
        refine_steps=int(_non_negative(raw.get("refine_steps", 2), "sweep.refine_steps")),
    )


def _mapping(raw: Any, field: str) -> dict:
    if not isinstance(raw, dict):
        raise ValueError(f"{field}: expected a mapping, got {type(raw).__name__}")
    return raw


def _list(raw: Any, field: str) -> list:
    if not isinstance(raw, list):
        raise ValueError(f"{field}: expected a list, got {type(raw).__name__}")
    return raw


def _no_unknown(raw: dict, field: str, known: set[str]) -> None:
    unknown = sorted(set(raw) - known)
    if unknown:
        raise ValueError(f"{field}: unknown key(s) {unknown}; known: {sorted(known)}")


def _unique(names: list[str], field: str) -> None:
    dupes = sorted({n for n in names if names.count(n) > 1})
    if dupes:
        raise ValueError(f"{field}: duplicate name(s) {dupes}")


def _number(raw: Any, field: str) -> float:
    if isinstance(raw, bool) or not isinstance(raw, int | float):
        raise ValueError(f"{field} must be a number, got {raw!r}")
    return float(raw)


def _positive(raw: Any, field: str) -> float:
    value = _number(raw, field)
    if not value > 0:
        raise ValueError(f"{field} must be > 0, got {raw!r}")
    return value


def _non_negative(raw: Any, field: str) -> float:
    value = _number(raw, field)
    if value < 0:
        raise ValueError(f"{field} must be >= 0, got {raw!r}")
    return value


def _enum(cls: type[Enum], raw: Any, field: str):
    try:
        return cls(raw)
    except ValueError:
        names = ", ".join(str(m.value) for m in cls)
        raise ValueError(f"{field} must be one of {names}, got {raw!r}") from None


__all__ = ["TENSOR_DTYPES", "ClassSpec", "ImageEncoding", "ImageSpec", "IntDist", "LoadMode", "LoadSpec",
           "RequestKind", "Scenario", "Slo", "SweepSpec", "TenantSpec", "TensorInputSpec", "TensorSpec",
           "TensorValues", "TextApi", "TraceSpec", "ValueDist", "fixed", "load_scenario", "parse_scenario"]
