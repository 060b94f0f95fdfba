"""Render a GGUF's ``tokenizer.chat_template`` the way llama.cpp ``--jinja`` and HF do.

Qwen3.5's template relies on HF's Jinja environment (``raise_exception``,
``strftime_now``, a non-escaping ``tojson``, trimmed blocks, loop controls), so
the same environment is rebuilt here, sandboxed because the template comes
from a model file. For the same reason a render is bounded: it stops with a
ChatTemplateError after RENDER_SECONDS or once its output passes
MAX_OUTPUT_CHARS, and string/list repetition, concatenation, powers and string
methods given a huge size are refused before they allocate. A template that does
not compile is a ChatTemplateError naming the line, when it is read.
"""

from __future__ import annotations

import ctypes
import json
import threading
from collections.abc import Callable, Mapping, Sequence
from datetime import datetime
from typing import Any

from jinja2 import TemplateError, TemplateSyntaxError
from jinja2.ext import loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment

RENDER_SECONDS = 2.0
MAX_OUTPUT_CHARS = 4 << 20   # ~1M tokens: more than any context holds
MAX_POWER_BITS = 4096


class ChatTemplateError(TemplateError, ValueError):
    """A template that does not compile, runs past its limits, or calls its own
    ``raise_exception(...)`` (e.g. no user message)."""


def _raise_exception(message: str):
    raise ChatTemplateError(f"chat template error: {message}")


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None, separators=None, sort_keys: bool = False):
    """HF's ``tojson``: plain ``json.dumps`` (Jinja's own escapes HTML and sorts keys)."""
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


class _RenderTimeout(BaseException):
    """Raised into a render that ran past its time (BaseException: templates cannot catch it)."""


class _BoundedSandbox(ImmutableSandboxedEnvironment):
    """The sandbox, with the operations that allocate in one step bounded by MAX_OUTPUT_CHARS."""

    intercepted_binops = frozenset({"*", "**", "+"})

    def call_binop(self, context, op: str, left: Any, right: Any) -> Any:
        if op == "**" and isinstance(left, int) and isinstance(right, int) and \
                abs(left) > 1 and right * max(abs(left), 2).bit_length() > MAX_POWER_BITS:
            raise ChatTemplateError(f"chat template error: {left} ** {right} is too large")
        sizes = [len(x) for x in (left, right) if isinstance(x, (str, list, tuple))]
        counts = [x for x in (left, right) if isinstance(x, int) and not isinstance(x, bool)]
        if op == "*" and sizes and counts and sizes[0] * max(counts[0], 0) > MAX_OUTPUT_CHARS or \
                op == "+" and len(sizes) == 2 and sum(sizes) > MAX_OUTPUT_CHARS:
            raise ChatTemplateError(f"chat template error: a value longer than {MAX_OUTPUT_CHARS} characters")
        return super().call_binop(context, op, left, right)

    def call(self, __context, __obj, *args, **kwargs):
        if isinstance(getattr(__obj, "__self__", None), str) and \
                any(isinstance(a, int) and a > MAX_OUTPUT_CHARS for a in (*args, *kwargs.values())):
            raise ChatTemplateError(f"chat template error: {getattr(__obj, '__name__', 'a string method')} "
                                    f"asked for more than {MAX_OUTPUT_CHARS} characters")
        return super().call(__context, __obj, *args, **kwargs)


def _environment() -> ImmutableSandboxedEnvironment:
    env = _BoundedSandbox(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
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


def _bounded(render: Callable[[], Any], seconds: float) -> Any:
    """`render()`, interrupted with a ChatTemplateError if it runs past `seconds`: a timer
    raises _RenderTimeout into this thread (between two bytecodes of the template's code)."""
    thread, state = threading.get_ident(), {"running": True, "fired": False}
    lock = threading.Lock()

    def expire() -> None:
        with lock:
            if state["running"]:
                ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(thread), ctypes.py_object(_RenderTimeout))
                state["fired"] = True

    timer = threading.Timer(seconds, expire)
    timer.start()
    try:
        try:
            return render()
        finally:
            with lock:
                state["running"] = False
            timer.cancel()
            if state["fired"]:  # delivered or not yet: never let it escape later
                ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(thread), None)
    except _RenderTimeout:
        raise ChatTemplateError(f"chat template error: rendering took longer than {seconds:g} s") from None


def _joined(pieces) -> str:
    """Join a render's pieces, stopping once they pass MAX_OUTPUT_CHARS."""
    out, size = [], 0
    for piece in pieces:
        size += len(piece)
        if size > MAX_OUTPUT_CHARS:
            raise ChatTemplateError(f"chat template error: the rendered prompt passed {MAX_OUTPUT_CHARS} characters")
        out.append(piece)
    return "".join(out)


class ChatTemplate:
    """A compiled chat template plus the BOS/EOS texts it may reference."""

    def __init__(self, template_str: str, *, bos_token: str = "", eos_token: str = "",
                 source: str = "tokenizer.chat_template"):
        if not isinstance(template_str, str):
            raise ChatTemplateError(f"{source}: the chat template is a {type(template_str).__name__}, not a string")
        self.source = template_str
        self.bos_token = bos_token
        self.eos_token = eos_token
        try:
            self._template = _bounded(lambda: _environment().from_string(template_str), RENDER_SECONDS)
        except TemplateSyntaxError as e:
            raise ChatTemplateError(f"{source}: the chat template does not compile: {e.message} (line {e.lineno})") \
                from None
        except RecursionError:
            raise ChatTemplateError(f"{source}: the chat template is nested too deeply to compile") from None

    @classmethod
    def from_metadata(cls, metadata: Mapping[str, Any], *, source: str = "<metadata>") -> ChatTemplate:
        """From GGUF key/values; BOS/EOS texts come from the token list as llama.cpp passes them."""
        template = metadata.get("tokenizer.chat_template")
        if not template:
            raise ChatTemplateError(f"{source}: GGUF metadata has no tokenizer.chat_template")
        tokens = metadata.get("tokenizer.ggml.tokens", [])

        def token_text(key: str) -> str:
            i = metadata.get(key)
            return tokens[i] if isinstance(i, int) and 0 <= i < len(tokens) else ""

        return cls(
            template,
            bos_token=token_text("tokenizer.ggml.bos_token_id"),
            eos_token=token_text("tokenizer.ggml.eos_token_id"),
            source=f"{source}: tokenizer.chat_template",
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
        """The prompt text; ``extra`` reaches the template as variables (chat_template_kwargs).
        Bounded by RENDER_SECONDS and MAX_OUTPUT_CHARS (a ChatTemplateError past either)."""
        variables = dict(messages=_object_arguments(messages), tools=tools, add_generation_prompt=add_generation_prompt,
                         enable_thinking=enable_thinking, bos_token=self.bos_token, eos_token=self.eos_token, **extra)
        try:
            return _bounded(lambda: _joined(self._template.generate(**variables)), RENDER_SECONDS)
        except (RecursionError, MemoryError) as e:
            raise ChatTemplateError(f"chat template error: {type(e).__name__} while rendering") from None
