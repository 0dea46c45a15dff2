"""What a generator worker declares of its tokenizer in the Attach hello (TokenizerSpec on the wire), as
plain data: the scheduler builds the model's text side (model_text.py) from it."""

from __future__ import annotations

import enum
from dataclasses import dataclass


class TokenizerKind(enum.Enum):
    BYTES = "bytes"
    HF = "hf"


@dataclass(frozen=True)
class TokenizerSpec:
    """What the worker declared; equal specs mean the same tokenizer (the file by its sha256)."""

    vocab_size: int = 0
    eos_token_id: int = 0
    bos_token_id: int = 0
    # None: a kind this scheduler does not know (check_hello refuses it).
    kind: TokenizerKind | None = TokenizerKind.BYTES
    # HF: tokenizer.json, whose bytes follow the hello (attach_session.py assembles them).
    tokenizer_json_sha256: str = ""
    tokenizer_json_size_bytes: int = 0
    # tokenizer_config.json's add_bos_token / add_eos_token; None: not set there.
    add_bos_token: bool | None = None
    add_eos_token: bool | None = None
    # (name, token) sorted by name: bos_token, eos_token, ... as the chat template sees them.
    special_tokens: tuple[tuple[str, str], ...] = ()
    # jinja2 source; "" when the model has none.
    chat_template: str = ""
    # HF: more ids that end a sequence as eos_token_id does.
    stop_token_ids: tuple[int, ...] = ()
    # The manifest's tool-call format (tool_call_formats.py); "": told from the chat template.
    tool_call_parser: str = ""
    # The manifest's reasoning parser (services/common/reasoning_formats.py); "": none.
    reasoning_parser: str = ""
