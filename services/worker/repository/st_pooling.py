"""What a sentence-transformers checkpoint directory says about its embeddings, for `infermesh models import`.

sentence-transformers saves a model as its modules in order (`modules.json`): the transformer (the
directory's config.json and weights), a Pooling module (`1_Pooling/config.json`: which of
pooling_mode_lasttoken, pooling_mode_mean_tokens, pooling_mode_cls_token is on) and usually a Normalize
module (unit L2 norm). Qwen3-Embedding, gte-Qwen2 and e5-mistral are saved so. The importer records the
pooling and the normalization in the manifest (generator.embedding); the worker pools as it says.
Matryoshka models say so in config.json (`is_matryoshka` or `matryoshka_dimensions`, as vLLM reads them).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from services.worker.pooling import Pooling
from services.worker.repository.errors import ImportRefused

MODULES_FILE = "modules.json"
_POOLING_MODULE = "sentence_transformers.models.Pooling"
_NORMALIZE_MODULE = "sentence_transformers.models.Normalize"
_TRANSFORMER_MODULE = "sentence_transformers.models.Transformer"
# Pooling config.json's modes this mesh pools by; the others (max, weighted mean, ...) are refused.
_MODES = {"pooling_mode_lasttoken": Pooling.LAST, "pooling_mode_mean_tokens": Pooling.MEAN,
          "pooling_mode_cls_token": Pooling.CLS}
_UNSUPPORTED_MODES = ("pooling_mode_max_tokens", "pooling_mode_mean_sqrt_len_tokens", "pooling_mode_weightedmean_tokens")


@dataclass(frozen=True)
class StEmbedding:
    pooling: Pooling
    normalize: bool
    matryoshka: bool


def read_st_embedding(source: Path, config_json: dict[str, Any]) -> StEmbedding | None:
    """The directory's pooling and normalization; None when it holds no modules.json (not a
    sentence-transformers directory). ImportRefused naming the file and field of anything unservable."""
    modules_file = source / MODULES_FILE
    if not modules_file.is_file():
        return None
    modules = _json(modules_file)
    if not isinstance(modules, list) or not all(isinstance(m, dict) for m in modules):
        raise ImportRefused(f"{modules_file}: must be a list of module objects")
    types = [m.get("type") for m in modules]
    pooling_modules = [m for m in modules if m.get("type") == _POOLING_MODULE]
    if len(pooling_modules) != 1:
        raise ImportRefused(f"{modules_file}: needs exactly one {_POOLING_MODULE} module, found {len(pooling_modules)}")
    unknown = [t for t in types if t not in (_TRANSFORMER_MODULE, _POOLING_MODULE, _NORMALIZE_MODULE)]
    if unknown:
        raise ImportRefused(f"{modules_file}: module {unknown[0]!r} is not supported; supported: the Transformer, "
                            "Pooling and Normalize modules (a Dense projection, say, is not)")
    path = pooling_modules[0].get("path", "")
    # Inside the directory: the import reads and records only what the checkpoint holds.
    if not isinstance(path, str) or Path(path).is_absolute() or ".." in Path(path).parts:
        raise ImportRefused(f"{modules_file}: the Pooling module's path must be a folder inside the checkpoint "
                            f"directory, got {path!r}")
    pooling_file = source / path / "config.json"
    if not pooling_file.is_file():
        raise ImportRefused(f"{pooling_file}: missing: the Pooling module's config")
    return StEmbedding(_pooling(pooling_file), _NORMALIZE_MODULE in types, is_matryoshka(config_json))


def is_matryoshka(config_json: dict[str, Any]) -> bool:
    """config.json's say (vLLM reads the same keys): a prefix of the vector is an embedding too.
    ImportRefused for a value of another type ("false" is not false)."""
    flag, dimensions = config_json.get("is_matryoshka"), config_json.get("matryoshka_dimensions")
    if flag is not None and not isinstance(flag, bool):
        raise ImportRefused(f"config.json: is_matryoshka must be true or false, got {flag!r}")
    if dimensions is not None and not (isinstance(dimensions, list) and all(
            isinstance(d, int) and not isinstance(d, bool) and d >= 1 for d in dimensions)):
        raise ImportRefused(f"config.json: matryoshka_dimensions must be a list of positive integers, got "
                            f"{dimensions!r}")
    return bool(flag) or bool(dimensions)


def _pooling(path: Path) -> Pooling:
    config = _json(path)
    if not isinstance(config, dict):
        raise ImportRefused(f"{path}: must be a JSON object")
    # sentence-transformers writes booleans; a string "false" would read as on.
    wrong = next((m for m in (*_MODES, *_UNSUPPORTED_MODES) if not isinstance(config.get(m, False), bool | None)), None)
    if wrong is not None:
        raise ImportRefused(f"{path}: {wrong} must be true or false, got {config[wrong]!r}")
    unsupported = [mode for mode in _UNSUPPORTED_MODES if config.get(mode)]
    if unsupported:
        raise ImportRefused(f"{path}: {unsupported[0]} is not supported; supported: {', '.join(_MODES)}")
    chosen = [pooling for mode, pooling in _MODES.items() if config.get(mode)]
    if len(chosen) != 1:
        raise ImportRefused(f"{path}: exactly one of {', '.join(_MODES)} must be true, found {len(chosen)}")
    return chosen[0]


def _json(path: Path) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    # RecursionError: nesting deeper than json's recursion limit ("[" * 100_000).
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, RecursionError) as exc:
        raise ImportRefused(f"{path}: not readable JSON: {exc}") from None
