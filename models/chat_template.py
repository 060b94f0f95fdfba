"""Render a GGUF's ``tokenizer.chat_template`` the way llama.cpp ``--jinja`` and HF do.

Qwen3.5's template relies on HF's Jinja environment (``raise_exception``,
``strftime_now``, a non-escaping ``tojson``, trimmed blocks, loop controls), so
the same environment is rebuilt here, sandboxed because the template comes
from a model file.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any

from jinja2 import TemplateError
from jinja2.ext import loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment


class ChatTemplateError(TemplateError):
    """Raised by a template's own ``raise_exception(...)`` (e.g. no user message)."""


def _raise_exception(message: str):
    raise ChatTemplateError(f"chat template error: {message}")


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None, separators=None, sort_keys: bool = False):
    """HF's ``tojson``: plain ``json.dumps`` (Jinja's own escapes HTML and sorts keys)."""
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


def _object_arguments(messages: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Copy of ``messages`` with OpenAI-style JSON-string tool-call arguments parsed.

    Qwen's template iterates ``arguments|items``; llama.cpp (minja's
    ``requires_object_arguments`` polyfill) parses string arguments for it.
    """
    out = []
    for message in messages:
        message = dict(message)
        if isinstance(message.get("tool_calls"), list):
            calls = []
            for call in message["tool_calls"]:
                call = dict(call)
                fn = call.get("function")
                if isinstance(fn, Mapping) and isinstance(fn.get("arguments"), str):
                    call["function"] = {**fn, "arguments": json.loads(fn["arguments"])}
                calls.append(call)
            message["tool_calls"] = calls
        out.append(message)
    return out


class ChatTemplate:
    """A compiled chat template plus the BOS/EOS texts it may reference."""

    def __init__(self, template_str: str, *, bos_token: str = "", eos_token: str = ""):
        self.source = template_str
        self.bos_token = bos_token
        self.eos_token = eos_token
        self._template = _environment().from_string(template_str)

    @classmethod
    def from_metadata(cls, metadata: Mapping[str, Any]) -> ChatTemplate:
        """From GGUF key/values; BOS/EOS texts come from the token list as llama.cpp passes them."""
        template = metadata.get("tokenizer.chat_template")
        if not template:
            raise ValueError("GGUF metadata has no tokenizer.chat_template")
        tokens = metadata.get("tokenizer.ggml.tokens", [])

        def token_text(key: str) -> str:
            i = metadata.get(key)
            return tokens[i] if i is not None and 0 <= i < len(tokens) else ""

        return cls(
            template,
            bos_token=token_text("tokenizer.ggml.bos_token_id"),
            eos_token=token_text("tokenizer.ggml.eos_token_id"),
        )

    def render(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        add_generation_prompt: bool = True,
        enable_thinking: bool = True,
        tools: Sequence[Mapping[str, Any]] | None = None,
        **extra: Any,
    ) -> str:
        """The prompt text; ``extra`` reaches the template as variables (chat_template_kwargs)."""
        return self._template.render(
            messages=_object_arguments(messages),
            tools=tools,
            add_generation_prompt=add_generation_prompt,
            enable_thinking=enable_thinking,
            bos_token=self.bos_token,
            eos_token=self.eos_token,
            **extra,
        )
