"""Golden checks for a rollout: known inputs sent to the canary, its answers compared with known outputs.

The worker runs its manifest's golden inputs once, at load (services/worker/model_repository.py).
A rollout runs golden cases again, through the whole serving path (gateway -> scheduler -> the
canary's workers), at the start of every step and then every `interval_s`, and a step fails at
once when an answer differs from the one expected. The cases come from the rollout policy itself,
in the manifest's own format, so a version's golden outputs can be copied (or pointed at) as is:

    checks:
      golden:
        cases:                                        # classify: top-1 label index of a raw image
          - {height: 2, width: 2, channels: 1, pixels_b64: "AQIDBA==", expected_top1: 3}
                                                      # generate: greedy continuation (temperature 0)
          - {prompt: "hello", expected_ids: [104, 105]}   # or prompt_ids: [...] (byte tokenizer ids;
                                                                 # a leading BOS is the scheduler's to add)
        file: /models/digits/2/manifest.json          # and/or: a manifest (its classifier/generator
                                                      # golden list) or a JSON list of cases; absolute
        interval_s: 30                                # a passed check runs again this often

Why the policy and not the worker: the gateway reads no model repository, and a worker's hello has
no room for cases (a protocol change across every worker and scheduler); the routing file is what
the operator already edits to start a rollout, is reloaded without a restart, and a case changed
there is a new rollout (its digest is part of the rollout's identity). The check is on whenever the
policy has cases, off without them, and `golden: false` turns it off.

Plain data and pure comparisons; rollout/probe.py sends the cases.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

Fail = Callable[[str, str], Exception]

DEFAULT_INTERVAL_S = 30.0
MAX_CASES = 64
MAX_IMAGE_BYTES = 1 << 20
MAX_EXPECTED_TOKENS = 256
BYTE_TOKENS = 256  # ids below are bytes in the byte tokenizer; from here on, special ids (EOS, BOS)


@dataclass(frozen=True)
class GoldenImage:
    """Classify: a raw uint8 HWC image and the top-1 label index the canary must answer."""

    height: int
    width: int
    channels: int
    pixels: bytes
    expected_top1: int

    def describe(self) -> str:
        return f"image {self.height}x{self.width}x{self.channels}"


@dataclass(frozen=True)
class GoldenPrompt:
    """Generate: a prompt and the greedy tokens the canary must stream after it."""

    prompt: str
    expected_ids: tuple[int, ...]

    def describe(self) -> str:
        return f"prompt {self.prompt[:16]!r}"


GoldenCase = GoldenImage | GoldenPrompt


@dataclass(frozen=True)
class GoldenCheck:
    # repr=False: the policy's identity (rollout_id) carries the digest, not the cases.
    cases: tuple[GoldenCase, ...] = field(repr=False)
    interval_s: float = DEFAULT_INTERVAL_S
    # sha256 of the cases, 12 hex digits: a changed case is a new rollout.
    digest: str = ""


@dataclass(frozen=True)
class CaseAnswer:
    """What the canary answered for one case: a label index, tokens, or an error code."""

    top1: int | None = None
    token_ids: tuple[int, ...] | None = None
    # A gRPC status code name; "" for an answer.
    code: str = ""
    message: str = ""


# Codes that mean the version answered, wrongly; any other error is "no answer yet" (shed,
# unavailable, out of time) and the run is tried again rather than judged.
WRONG_ANSWER_CODES = frozenset({"INTERNAL", "UNKNOWN", "DATA_LOSS", "INVALID_ARGUMENT"})


@dataclass(frozen=True)
class GoldenOutcome:
    """One run of every case against the canary."""

    num_cases: int
    num_passed: int
    # "case 2 (image 2x2x1): top-1 7, expected 3", one per case answered wrongly.
    mismatches: tuple[str, ...] = ()
    # Cases with no answer (shed, unavailable, deadline): the run is incomplete and tried again.
    num_unanswered: int = 0

    @property
    def complete(self) -> bool:
        return self.num_unanswered == 0 or bool(self.mismatches)


def compare(cases: Sequence[GoldenCase], answers: Sequence[CaseAnswer]) -> GoldenOutcome:
    """Each case's answer against its expected output."""
    mismatches: list[str] = []
    num_passed = num_unanswered = 0
    for index, (case, answer) in enumerate(zip(cases, answers, strict=True)):
        problem = _problem(case, answer)
        if problem is None:
            num_passed += 1
        elif problem == "":
            num_unanswered += 1
        else:
            mismatches.append(f"case {index} ({case.describe()}): {problem}")
    return GoldenOutcome(len(cases), num_passed, tuple(mismatches), num_unanswered)


def _problem(case: GoldenCase, answer: CaseAnswer) -> str | None:
    """None: right; "": no answer; else what was wrong."""
    if answer.code:
        return f"{answer.code}: {answer.message}"[:200] if answer.code in WRONG_ANSWER_CODES else ""
    if isinstance(case, GoldenImage):
        return None if answer.top1 == case.expected_top1 else f"top-1 {answer.top1}, expected {case.expected_top1}"
    got = answer.token_ids or ()
    if got == case.expected_ids:
        return None
    diverged = next((i for i, (a, b) in enumerate(zip(got, case.expected_ids, strict=False)) if a != b),
                    min(len(got), len(case.expected_ids)))
    return f"tokens differ from position {diverged} ({len(got)} tokens, expected {len(case.expected_ids)})"


# -- parsing (the policy's checks.golden) ----------------------------------------------------


def parse_golden(value: object, fail: Fail) -> GoldenCheck | None:
    """`checks.golden` of a rollout policy: None when off or absent; the cases otherwise."""
    where = "rollout.checks.golden"
    if value is None or value is False:
        return None
    if not isinstance(value, Mapping):
        raise fail(where, "must be a mapping of cases, file and interval_s, or false (off)")
    unknown = sorted(set(value) - {"cases", "file", "interval_s"})
    if unknown:
        raise fail(f"{where}.{unknown[0]}", "unknown field (expected cases, file, interval_s)")
    raw_cases: list[tuple[str, object]] = []
    inline = value.get("cases", [])
    if not isinstance(inline, list):
        raise fail(f"{where}.cases", "must be a list of cases")
    raw_cases += [(f"{where}.cases[{i}]", c) for i, c in enumerate(inline)]
    if value.get("file") is not None:
        raw_cases += _cases_in_file(value["file"], f"{where}.file", fail)
    if not raw_cases:
        raise fail(where, "has no cases: give cases or file (or set golden: false)")
    if len(raw_cases) > MAX_CASES:
        raise fail(where, f"has {len(raw_cases)} cases, at most {MAX_CASES}")
    cases = tuple(_case(raw, at, fail) for at, raw in raw_cases)
    if len({type(c) for c in cases}) > 1:
        raise fail(where, "mixes image and prompt cases: a model either classifies or generates")
    interval = value.get("interval_s", DEFAULT_INTERVAL_S)
    if isinstance(interval, bool) or not isinstance(interval, int | float) or interval < 1:
        raise fail(f"{where}.interval_s", f"must be a number of seconds >= 1, got {interval!r}")
    return GoldenCheck(cases, float(interval), _digest(cases))


def _cases_in_file(path: object, where: str, fail: Fail) -> list[tuple[str, object]]:
    if not isinstance(path, str) or not Path(path).is_absolute():
        raise fail(where, f"must be an absolute path (a manifest.json or a JSON list of cases), got {path!r}")
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError) as exc:
        raise fail(where, f"cannot read {path}: {exc}") from None
    except json.JSONDecodeError as exc:
        raise fail(where, f"{path} is not JSON ({exc})") from None
    if isinstance(data, Mapping):  # a model manifest: its kind's golden list
        section = data.get("classifier") or data.get("generator")
        data = section.get("golden") if isinstance(section, Mapping) else None
    if not isinstance(data, list):
        raise fail(where, f"{path} is neither a manifest with a golden list nor a JSON list of cases")
    return [(f"{where}[{i}]", c) for i, c in enumerate(data)]


def _case(raw: object, where: str, fail: Fail) -> GoldenCase:
    if not isinstance(raw, Mapping):
        raise fail(where, "must be a mapping: {height, width, channels, pixels_b64, expected_top1} "
                          "or {prompt | prompt_ids, expected_ids}")
    if "expected_top1" in raw:
        return _image(raw, where, fail)
    if "expected_ids" in raw:
        return _prompt(raw, where, fail)
    raise fail(where, "needs expected_top1 (an image case) or expected_ids (a prompt case)")


def _image(raw: Mapping, where: str, fail: Fail) -> GoldenImage:
    _only(raw, {"height", "width", "channels", "pixels_b64", "expected_top1"}, where, fail)
    height, width, channels, top1 = (_int(raw, k, where, fail, low=lo)
                                     for k, lo in (("height", 1), ("width", 1), ("channels", 1), ("expected_top1", 0)))
    if channels not in (1, 3):
        raise fail(f"{where}.channels", f"must be 1 or 3, got {channels}")
    try:
        pixels = base64.b64decode(str(raw.get("pixels_b64", "")), validate=True)
    except (binascii.Error, ValueError):
        raise fail(f"{where}.pixels_b64", "is not base64") from None
    if len(pixels) != height * width * channels or len(pixels) > MAX_IMAGE_BYTES:
        raise fail(f"{where}.pixels_b64", f"holds {len(pixels)} bytes; height x width x channels is "
                                          f"{height * width * channels} (at most {MAX_IMAGE_BYTES})")
    return GoldenImage(height, width, channels, pixels, top1)


def _prompt(raw: Mapping, where: str, fail: Fail) -> GoldenPrompt:
    _only(raw, {"prompt", "prompt_ids", "expected_ids"}, where, fail)
    if ("prompt" in raw) == ("prompt_ids" in raw):
        raise fail(where, "needs one of prompt (text) or prompt_ids (byte tokenizer ids)")
    if "prompt" in raw:
        prompt = raw["prompt"]
        if not isinstance(prompt, str) or not prompt:
            raise fail(f"{where}.prompt", "must be non-empty text")
    else:
        ids = _ids(raw, "prompt_ids", where, fail)
        if ids[0] >= BYTE_TOKENS:  # the model's BOS, as a manifest records it: the scheduler prepends it
            ids = ids[1:]
        try:  # the byte tokenizer: ids are the prompt's UTF-8 bytes
            prompt = bytes(ids).decode("utf-8")
        except (ValueError, UnicodeDecodeError):
            raise fail(f"{where}.prompt_ids", "must be the UTF-8 bytes of a text (0..255), after at most a "
                                              "leading BOS: the gateway sends text; use prompt for other "
                                              "tokenizers") from None
        if not prompt:
            raise fail(f"{where}.prompt_ids", "holds no text after the BOS")
    expected = _ids(raw, "expected_ids", where, fail)
    if len(expected) > MAX_EXPECTED_TOKENS:
        raise fail(f"{where}.expected_ids", f"has {len(expected)} tokens, at most {MAX_EXPECTED_TOKENS}")
    return GoldenPrompt(prompt, expected)


def _only(raw: Mapping, allowed: set[str], where: str, fail: Fail) -> None:
    extra = sorted(set(raw) - allowed)
    if extra:
        raise fail(f"{where}.{extra[0]}", f"unknown field (expected {', '.join(sorted(allowed))})")


def _int(raw: Mapping, key: str, where: str, fail: Fail, *, low: int) -> int:
    value = raw.get(key)
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise fail(f"{where}.{key}", f"must be an integer >= {low}, got {value!r}")
    return value


def _ids(raw: Mapping, key: str, where: str, fail: Fail) -> tuple[int, ...]:
    value = raw.get(key)
    if (not isinstance(value, list) or not value
            or any(isinstance(v, bool) or not isinstance(v, int) or v < 0 for v in value)):
        raise fail(f"{where}.{key}", f"must be a non-empty list of token ids >= 0, got {value!r}")
    return tuple(value)


def _digest(cases: tuple[GoldenCase, ...]) -> str:
    text = repr([(c.height, c.width, c.channels, c.pixels.hex(), c.expected_top1) if isinstance(c, GoldenImage)
                 else (c.prompt, c.expected_ids) for c in cases])
    return hashlib.sha256(text.encode()).hexdigest()[:12]
