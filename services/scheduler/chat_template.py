"""A model's chat template (tokenizer_config.json's jinja2), rendered as transformers'
apply_chat_template renders it.

Same environment: jinja2's ImmutableSandboxedEnvironment with trim_blocks and lstrip_blocks,
the loop-controls extension and `{% generation %}` (rendered as its body), `raise_exception`,
`strftime_now`, a `tojson` that leaves HTML alone, and transformers' `dict` and `namespace`.
Same variables: `messages` (plain JSON data; keys whose value is None dropped; reasoning under
its three names; an assistant's tool_calls and a tool turn's tool_call_id as OpenAI sends them),
`add_generation_prompt`, `tools` (OpenAI's [{type: function, function: {...}}], None when none
are offered), `documents` (None), and the named special tokens (bos_token, eos_token, ...). Rendered text already holds the model's special tokens, so
it is encoded with add_special_tokens=False (hf_tokenizer.py).

A template that does not compile is refused when its worker attaches (ChatTemplateInvalid);
one that raises while rendering a conversation is the request's error (ChatTemplateRefused,
INVALID_ARGUMENT): the template's own message, never a traceback.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from datetime import datetime
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.utils
from jinja2.sandbox import ImmutableSandboxedEnvironment

from services.common import errors

# Names a message's reasoning comes under; templates read the first, gpt-oss's the second.
_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")


class ChatTemplateInvalid(ValueError):
    """The template does not compile; the message has jinja2's reason and line."""


class ChatTemplateRefused(errors.InvalidArgument):
    """Rendering raised: the template refused this conversation (or has a bug that it hit)."""


class _Generation(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` marks the assistant's text for training masks;
    when rendering a prompt it is just its body."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller: Callable[[], str]) -> str:
        return caller()


class _TemplateDict:
    """`dict(...)` without the type itself (no attribute access to climb out of the sandbox)."""

    def __call__(self, *args: Any, **kwargs: Any) -> dict[Any, Any]:
        return dict(*args, **kwargs)

    def fromkeys(self, *args: Any, **kwargs: Any) -> dict[Any, Any]:
        return dict.fromkeys(*args, **kwargs)


class _TemplateNamespace(jinja2.utils.Namespace):
    """jinja2's namespace refusing underscore names (no route to CPython internals)."""

    def __init__(*args: Any, **kwargs: Any) -> None:
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name in attrs:
            _TemplateNamespace._check_name(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _TemplateNamespace._check_name(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check_name(name: object) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(f"a namespace attribute may not start with '_', got {name!r}")


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _plain(value: Any) -> Any:
    """JSON-typed copy of what a template may see: nothing with methods beyond str, int, dict..."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, Mapping):
        return {_plain(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    return f"<{type(value).__name__}>"


def _message(message: Mapping[str, Any]) -> dict[str, Any]:
    plain = {k: v for k, v in _plain(message).items() if v is not None}
    reasoning = next((plain[k] for k in _REASONING_FIELDS if plain.get(k) is not None), None)
    return plain if reasoning is None else {"thinking": reasoning, **plain, "reasoning_content": reasoning}


class ChatTemplate:
    """One model's template, compiled once (when its first worker attaches)."""

    def __init__(self, source: str, special_tokens: Mapping[str, str],
                 now: Callable[[], datetime] = datetime.now) -> None:
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                            extensions=[_Generation, jinja2.ext.loopcontrols])
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = _raise_exception
        env.globals["strftime_now"] = lambda format: now().strftime(format)
        env.globals["dict"] = _TemplateDict()
        env.globals["namespace"] = _TemplateNamespace
        try:
            self._template = env.from_string(source)
        except jinja2.TemplateSyntaxError as exc:
            raise ChatTemplateInvalid(f"chat template line {exc.lineno}: {exc.message}") from None
        self._special_tokens = dict(special_tokens)

    def render(self, messages: Sequence[Mapping[str, Any]], *, add_generation_prompt: bool = True,
               tools: Sequence[Mapping[str, Any]] = (), continue_final_message: bool = False,
               variables: Mapping[str, Any] | None = None) -> str:
        """The prompt text for `messages` ({role, content, ...} each) offering `tools`;
        ChatTemplateRefused when the template raises. `variables`: extra ones (vLLM's
        chat_template_kwargs; over the special tokens' names, as transformers lets them).
        `continue_final_message`: the text ends where the final message's content does."""
        conversation = [_message(m) for m in messages]
        try:
            rendered = self._template.render(messages=conversation, tools=_plain(list(tools)) or None, documents=None,
                                             add_generation_prompt=add_generation_prompt,
                                             **{**self._special_tokens, **_plain(dict(variables or {}))})
        except jinja2.TemplateError as exc:  # raise_exception, undefined names, the sandbox's SecurityError
            raise ChatTemplateRefused(f"the model's chat template refused the conversation: {exc}") from None
        except (TypeError, ValueError, KeyError, IndexError, AttributeError, ZeroDivisionError) as exc:
            raise ChatTemplateRefused(f"the model's chat template failed on the conversation: "
                                      f"{type(exc).__name__}: {exc}") from None
        return _open_final_message(rendered, conversation[-1]) if continue_final_message and conversation else rendered


def _open_final_message(rendered: str, final: Mapping[str, Any]) -> str:
    """`rendered` cut where the final message's content ends, as transformers' continue_final_message
    cuts it (its trailing spacing kept only when the template kept it)."""
    content = final.get("content")
    text = content if isinstance(content, str) else ""
    if text.strip() not in rendered:
        raise ChatTemplateRefused("continue_final_message: the final message's content does not appear in the "
                                  "conversation as the model's chat template renders it (it must be text the "
                                  "template writes out, such as an assistant turn's start)")
    at = rendered.rindex(text.strip())
    if rendered[at:at + len(text.lstrip())] == text.lstrip():
        return rendered[:at + len(text.lstrip())]
    return rendered[:at + len(text.strip())]
