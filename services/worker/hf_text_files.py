"""What a worker serving a Hugging Face checkpoint tells its scheduler about the model's text side.

The scheduler tokenizes (docs/ARCHITECTURE.md, "Tokenization"), so the worker only reads the pinned
files and passes them on: tokenizer.json's bytes (sent after the hello, in pieces), and from
tokenizer_config.json add_bos_token / add_eos_token, the named special tokens and the chat template
(or chat_template.jinja, where transformers 5 keeps it). Every file is checked against its sha256
before it is read.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from services.worker.repository.errors import InvalidManifest
from services.worker.repository.store import verified_file
from services.worker.repository.tokenizer_spec import HFTokenizerSpec

# tokenizer_config.json's names for the special tokens a chat template may use.
SPECIAL_TOKEN_NAMES = ("bos_token", "eos_token", "unk_token", "pad_token", "sep_token", "cls_token", "mask_token")


@dataclass(frozen=True)
class HFTextFiles:
    tokenizer_json: bytes
    add_bos_token: bool | None = None  # None: tokenizer_config.json does not say
    add_eos_token: bool | None = None
    special_tokens: Mapping[str, str] = field(default_factory=dict)  # bos_token -> "<|begin_of_text|>", ...
    chat_template: str = ""  # "": the model has none


def read_hf_text_files(directory: Path, spec: HFTokenizerSpec) -> HFTextFiles:
    tokenizer_json = verified_file(directory, spec.tokenizer_json.file, spec.tokenizer_json.sha256,
                                   "tokenizer").read_bytes()
    config: dict[str, Any] = {}
    config_path = None
    if spec.tokenizer_config is not None:
        config_path = verified_file(directory, spec.tokenizer_config.file, spec.tokenizer_config.sha256,
                                    "tokenizer config")
        config = _json_object(config_path)
    template = ""
    if spec.chat_template is not None:
        template_path = verified_file(directory, spec.chat_template.file, spec.chat_template.sha256, "chat template")
        template = template_path.read_text(encoding="utf-8")
    elif config_path is not None:
        template = chat_template_of(config, str(config_path))
    return HFTextFiles(
        tokenizer_json=tokenizer_json,
        add_bos_token=_optional_bool(config, "add_bos_token", config_path),
        add_eos_token=_optional_bool(config, "add_eos_token", config_path),
        special_tokens=special_tokens_of(config, str(config_path)),
        chat_template=template,
    )


def chat_template_of(config: Mapping[str, Any], source: str) -> str:
    """tokenizer_config.json's chat_template: a string, or a list of {name, template} (the "default" one)."""
    value = config.get("chat_template")
    if value is None:
        return ""
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        named = {t.get("name"): t.get("template") for t in value if isinstance(t, dict)}
        if isinstance(named.get("default"), str):
            return str(named["default"])
    raise InvalidManifest(f"{source}: field 'chat_template' must be a string or a list holding a 'default' "
                          f"template, got {value!r:.80}")


def special_tokens_of(config: Mapping[str, Any], source: str) -> dict[str, str]:
    """The named special tokens, as strings (transformers also writes them as AddedToken objects)."""
    tokens = {}
    for name in SPECIAL_TOKEN_NAMES:
        value = config.get(name)
        if isinstance(value, dict):
            value = value.get("content")
        if value is None:
            continue
        if not isinstance(value, str) or not value:
            raise InvalidManifest(f"{source}: field '{name}' must be a non-empty string or "
                                  f"{{\"content\": ...}}, got {value!r:.80}")
        tokens[name] = value
    return tokens


def _optional_bool(config: Mapping[str, Any], key: str, source: Path | None) -> bool | None:
    value = config.get(key)
    if value is not None and not isinstance(value, bool):
        raise InvalidManifest(f"{source}: field '{key}' must be true, false or absent, got {value!r}")
    return value


def _json_object(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as exc:  # Recursion: too deep
        raise InvalidManifest(f"{path}: not valid JSON: {exc}") from None
    if not isinstance(data, dict):
        raise InvalidManifest(f"{path}: must be a JSON object, got {type(data).__name__}")
    return data
