"""OpenAI request and response shapes: parse and check a request body field by field (a bad
one is a 4xx in OpenAI's error shape naming the field), build responses, stream chunks,
`usage` and llama-server's `timings`.

Fields honoured: `model`, `messages` / `prompt`, `max_tokens` (or `max_completion_tokens`),
`temperature`, `top_p`, `top_k`, `min_p`, `seed`, `stop`, `stream`,
`stream_options.include_usage`, `n` (1 only), `chat_template_kwargs`, `ignore_eos`. Fields
that would change the output but are not implemented (logprobs, tools, penalties, ...) are
refused with a 400 rather than ignored; any other field is ignored, as OpenAI clients send
extras.
"""
from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from dflash_ir.runtime.sampling import SamplingParams
from dflash_ir.runtime.stats import GenerationStats


class RequestError(Exception):
    """A request the server refuses: HTTP status plus OpenAI's error fields."""

    def __init__(self, message: str, *, param: str | None = None, status: int = 400, code: str | None = None,
                 type: str = "invalid_request_error", headers: dict[str, str] | None = None):
        super().__init__(message)
        self.message, self.param, self.status, self.code, self.type = message, param, status, code, type
        self.headers = headers or {}

    def body(self) -> dict:
        return error_body(self.message, self.type, param=self.param, code=self.code)


def error_body(message: str, type: str, *, param: str | None = None, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


@dataclass(frozen=True)
class ServerDefaults:
    """What a request does not say: the server's flags."""
    model: str
    n_ctx: int
    max_tokens: int  # -1: until the context is full
    sampling: SamplingParams
    template_kwargs: dict = field(default_factory=dict)


@dataclass
class GenerationRequest:
    max_tokens: int
    sampling: SamplingParams
    stop: list[str]
    stream: bool
    include_usage: bool
    ignore_eos: bool


@dataclass
class ChatRequest(GenerationRequest):
    messages: list[dict]
    template_kwargs: dict


@dataclass
class CompletionRequest(GenerationRequest):
    prompt: str | list[int]


def parse_chat(body: Any, defaults: ServerDefaults) -> ChatRequest:
    f = Fields(body)
    common = _common(f, defaults)
    messages = f.get("messages", list, required=True)
    if not messages:
        raise RequestError("'messages' must hold at least one message", param="messages")
    kwargs = f.get("chat_template_kwargs", dict, default={})
    if "enable_thinking" in kwargs and not isinstance(kwargs["enable_thinking"], bool):
        raise RequestError("'chat_template_kwargs.enable_thinking' must be a boolean",
                           param="chat_template_kwargs.enable_thinking")
    return ChatRequest(**common, messages=[_message(m, i) for i, m in enumerate(messages)],
                       template_kwargs={**defaults.template_kwargs, **kwargs})


def parse_completion(body: Any, defaults: ServerDefaults) -> CompletionRequest:
    f = Fields(body)
    common = _common(f, defaults)
    prompt = f.get("prompt", (str, list), required=True)
    if isinstance(prompt, list):
        if len(prompt) == 1 and isinstance(prompt[0], str):
            prompt = prompt[0]
        elif not all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            raise RequestError("'prompt' must be a string, a list of one string or a list of token ids "
                               "(one prompt per request)", param="prompt")
    if not prompt:
        raise RequestError("'prompt' is empty", param="prompt")
    return CompletionRequest(**common, prompt=prompt)


_SAMPLING_FIELDS = ("temperature", "top_k", "top_p", "min_p")
_ALLOWED_WHEN_SET = {"response_format": ({"type": "text"},), "tool_choice": ("none", "auto")}
_UNSUPPORTED = ("logprobs", "top_logprobs", "tools", "tool_choice", "functions", "function_call", "response_format",
                "frequency_penalty", "presence_penalty", "repeat_penalty", "logit_bias", "echo", "best_of", "suffix")


def _common(f: "Fields", defaults: ServerDefaults) -> dict:
    model = f.get("model", str, default=None)
    if model is not None and model != defaults.model:
        raise RequestError(f"the model '{model}' does not exist: this server serves '{defaults.model}'",
                           param="model", status=404, code="model_not_found")
    for name in _UNSUPPORTED:
        value = f.body.get(name)
        if value not in (None, False, 0, "", [], {}) and value not in _ALLOWED_WHEN_SET.get(name, ()):
            raise RequestError(f"'{name}' is not supported by dflash-serve", param=name)
    n = f.get("n", int, default=1)
    if n != 1:
        raise RequestError(f"'n' must be 1 (one choice per request), got {n}", param="n")
    name = "max_completion_tokens" if "max_completion_tokens" in f.body else "max_tokens"
    max_tokens = f.get(name, int, default=None)
    if max_tokens is not None and max_tokens < 1:
        raise RequestError(f"'{name}' must be at least 1, got {max_tokens}", param=name)
    if max_tokens is None:
        max_tokens = defaults.max_tokens if defaults.max_tokens >= 0 else defaults.n_ctx
    d = defaults.sampling
    temperature = f.get("temperature", float, default=d.temperature)
    try:
        sampling = SamplingParams(temperature, f.get("top_k", int, default=d.top_k),
                                  f.get("top_p", float, default=d.top_p), f.get("min_p", float, default=d.min_p),
                                  f.get("seed", int, default=d.seed))
    except ValueError as e:  # SamplingParams' message names the field
        raise RequestError(str(e), param=next((n for n in _SAMPLING_FIELDS if str(e).startswith(n)), None)) from None
    if sampling.seed is not None and sampling.seed < 0:
        raise RequestError(f"'seed' must be >= 0, got {sampling.seed}", param="seed")
    stop = f.get("stop", (str, list), default=[])
    stop = [stop] if isinstance(stop, str) else stop
    if not all(isinstance(s, str) for s in stop):
        raise RequestError("'stop' must be a string or a list of strings", param="stop")
    stream = f.get("stream", bool, default=False)
    options = f.get("stream_options", dict, default={})
    include_usage = options.get("include_usage", False)
    if not isinstance(include_usage, bool):
        raise RequestError("'stream_options.include_usage' must be a boolean", param="stream_options.include_usage")
    return dict(max_tokens=max_tokens, sampling=sampling, stop=stop, stream=stream, include_usage=include_usage,
                ignore_eos=f.get("ignore_eos", bool, default=False))


_ROLES = ("system", "developer", "user", "assistant", "tool")


def _message(m: Any, i: int) -> dict:
    where = f"messages[{i}]"
    if not isinstance(m, dict):
        raise RequestError(f"'{where}' must be an object with 'role' and 'content'", param=where)
    role = m.get("role")
    if role not in _ROLES:
        raise RequestError(f"'{where}.role' must be one of {', '.join(_ROLES)}, got {role!r}", param=f"{where}.role")
    content = m.get("content")
    if isinstance(content, list):
        if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str) for p in content):
            raise RequestError(f"'{where}.content' parts must be text parts ({{'type': 'text', 'text': ...}}): "
                               f"this model reads text only", param=f"{where}.content")
        content = "".join(p["text"] for p in content)
    elif content is None and role != "assistant":
        raise RequestError(f"'{where}.content' is missing", param=f"{where}.content")
    elif content is not None and not isinstance(content, str):
        raise RequestError(f"'{where}.content' must be a string or a list of text parts", param=f"{where}.content")
    return {**m, "role": "system" if role == "developer" else role, "content": content or ""}


_TYPE_NAMES = {str: "a string", int: "an integer", float: "a number", bool: "a boolean", list: "an array",
               dict: "an object"}


class Fields:
    """Typed reads of a JSON object's fields; a wrong one raises RequestError naming it."""

    def __init__(self, body: Any):
        if not isinstance(body, dict):
            raise RequestError("the request body must be a JSON object")
        self.body = body

    def get(self, name: str, types, *, default=None, required: bool = False):
        value = self.body.get(name)
        if value is None:
            if required:
                raise RequestError(f"'{name}' is required", param=name)
            return default
        types = types if isinstance(types, tuple) else (types,)
        ok = any(isinstance(value, t) and not (isinstance(value, bool) and t is not bool) for t in types)
        if float in types and isinstance(value, int) and not isinstance(value, bool):
            ok, value = True, float(value)
        if not ok:
            raise RequestError(f"'{name}' must be {' or '.join(_TYPE_NAMES[t] for t in types)}, "
                               f"got {type(value).__name__} {json.dumps(value)[:40]}", param=name)
        return value


# -- responses ------------------------------------------------------------------------

def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now() -> int:
    return int(time.time())


def finish_reason(stats: GenerationStats) -> str:
    return "stop" if stats.stop_reason in ("eos", "stop string") else "length"


def usage(stats: GenerationStats) -> dict:
    return {"prompt_tokens": stats.prompt_tokens, "completion_tokens": stats.generated_tokens,
            "total_tokens": stats.prompt_tokens + stats.generated_tokens}


def timings(stats: GenerationStats, prompt_seconds: float, predicted_seconds: float) -> dict:
    """llama-server's `timings`: prompt and generation counts, milliseconds and rates; with
    speculation the draft tokens proposed and accepted."""
    out = {}
    for what, n, seconds in (("prompt", stats.prompt_tokens, prompt_seconds),
                             ("predicted", stats.generated_tokens, predicted_seconds)):
        out.update({f"{what}_n": n, f"{what}_ms": seconds * 1e3,
                    f"{what}_per_token_ms": seconds * 1e3 / n if n else 0.0,
                    f"{what}_per_second": n / seconds if seconds else 0.0})
    if stats.mode == "speculative":
        out.update(draft_n=stats.drafted, draft_n_accepted=stats.accepted)
    return out


def speculation(stats: GenerationStats, steps: int) -> dict:
    """dflash's own figures beside `timings`: τ, acceptance, rounds, the histogram, and the
    engine steps (the prefill, then one per round or decode step)."""
    return {"mode": stats.mode, "rounds": stats.rounds, "steps": steps, "tau": stats.tau,
            "acceptance_rate": stats.acceptance_rate,
            "accept_hist": {str(k): v for k, v in sorted(stats.accept_hist.items())}}


def chat_response(rid: str, model: str, content: str, reasoning: str, stats: GenerationStats, timing: dict,
                  spec: dict) -> dict:
    message = {"role": "assistant", "content": content}
    if reasoning:
        message["reasoning_content"] = reasoning
    return {"id": rid, "object": "chat.completion", "created": now(), "model": model,
            "choices": [{"index": 0, "message": message, "finish_reason": finish_reason(stats), "logprobs": None}],
            "usage": usage(stats), "timings": timing, "dflash": spec}


def completion_response(rid: str, model: str, text: str, stats: GenerationStats, timing: dict, spec: dict) -> dict:
    return {"id": rid, "object": "text_completion", "created": now(), "model": model,
            "choices": [{"index": 0, "text": text, "finish_reason": finish_reason(stats), "logprobs": None}],
            "usage": usage(stats), "timings": timing, "dflash": spec}


def chat_chunk(rid: str, model: str, delta: dict, finish: str | None = None) -> dict:
    return {"id": rid, "object": "chat.completion.chunk", "created": now(), "model": model,
            "choices": [{"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}]}


def completion_chunk(rid: str, model: str, text: str, finish: str | None = None) -> dict:
    return {"id": rid, "object": "text_completion", "created": now(), "model": model,
            "choices": [{"index": 0, "text": text, "finish_reason": finish, "logprobs": None}]}


def sse(payload: dict | str) -> str:
    """One server-sent event: `data: <json>` (or `data: [DONE]`)."""
    return f"data: {payload if isinstance(payload, str) else json.dumps(payload, ensure_ascii=False)}\n\n"
