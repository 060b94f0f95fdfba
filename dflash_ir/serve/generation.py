"""One completion request from submit to response: the job's events (delivered from the
scheduler thread) into the event loop, its tokens into text pieces, and those into an SSE
stream or one JSON body. A streaming client that goes away cancels the job (Starlette
cancels the stream); a non-streaming one is watched for the same.
"""
from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import AsyncIterator

from starlette.requests import Request
from starlette.responses import JSONResponse, StreamingResponse

from . import openai_api as api
from .reasoning import ReasoningSplit
from .scheduler import Failed, Finished, Job, QueueFull, Scheduler, Tokens
from .text import TextStream


@dataclass
class Prepared:
    """A checked request, ready to run: its prompt ids and the engine's keyword arguments."""
    kind: str  # "chat" or "completion"
    request: api.GenerationRequest
    prompt_ids: list[int]
    options: dict
    prompt_opens_reasoning: bool = False


class Reply:
    """Token ids in, ("content" | "reasoning", text) pieces out."""

    def __init__(self, text: TextStream, split: ReasoningSplit | None):
        self.text, self.split = text, split

    def feed(self, ids) -> list[tuple[str, str]]:
        return self._pieces(self.text.feed(ids), final=False)

    def finish(self) -> list[tuple[str, str]]:
        return self._pieces(self.text.finish(), final=True)

    def _pieces(self, text: str, final: bool) -> list[tuple[str, str]]:
        if self.split is None:
            return [("content", text)] if text else []
        reasoning, content = self.split.feed(text, final=final)
        return [(kind, t) for kind, t in (("reasoning", reasoning), ("content", content)) if t]


class JobEvents:
    """Submits a job and yields its events in the event loop; leaving early cancels it."""

    def __init__(self, scheduler: Scheduler, prepared: Prepared):
        loop = asyncio.get_running_loop()
        self._queue: asyncio.Queue = asyncio.Queue()
        self._scheduler = scheduler
        self.job = Job(prepared.prompt_ids, prepared.options,
                       deliver=lambda event: loop.call_soon_threadsafe(self._queue.put_nowait, event))
        try:
            scheduler.submit(self.job)
        except QueueFull as e:
            raise api.RequestError(f"{e}; retry later", status=503, type="unavailable_error", code="queue_full",
                                   headers={"Retry-After": "1"}) from None

    async def __aiter__(self) -> AsyncIterator[object]:
        ended = False
        try:
            while not ended:
                event = await self._queue.get()
                ended = isinstance(event, (Finished, Failed))
                yield event
        finally:
            if not ended:
                self._scheduler.cancel(self.job)


class _ChatShape:
    def __init__(self, rid: str, model: str):
        self.rid, self.model = rid, model

    def start(self) -> list[dict]:
        return [api.chat_chunk(self.rid, self.model, {"role": "assistant", "content": ""})]

    def piece(self, kind: str, text: str) -> dict:
        return api.chat_chunk(self.rid, self.model, {"reasoning_content" if kind == "reasoning" else "content": text})

    def last(self, stats) -> dict:
        return api.chat_chunk(self.rid, self.model, {}, api.finish_reason(stats))

    def response(self, content: str, reasoning: str, stats, timing: dict, spec: dict) -> dict:
        return api.chat_response(self.rid, self.model, content, reasoning, stats, timing, spec)


class _CompletionShape(_ChatShape):
    def start(self) -> list[dict]:
        return []

    def piece(self, kind: str, text: str) -> dict:
        return api.completion_chunk(self.rid, self.model, text)

    def last(self, stats) -> dict:
        return api.completion_chunk(self.rid, self.model, "", api.finish_reason(stats))

    def response(self, content: str, reasoning: str, stats, timing: dict, spec: dict) -> dict:
        return api.completion_response(self.rid, self.model, content, stats, timing, spec)


async def respond(scheduler: Scheduler, tokenizer, model: str, prepared: Prepared, http: Request):
    """Run `prepared` and answer it: an SSE stream, or one JSON body once generation ends."""
    req = prepared.request
    hidden = () if req.ignore_eos else tokenizer.eos_ids
    reply = Reply(TextStream(tokenizer, req.stop, hidden),
                  ReasoningSplit(prepared.prompt_opens_reasoning) if prepared.kind == "chat" else None)
    shape = (_ChatShape if prepared.kind == "chat" else _CompletionShape)(
        api.new_id("chatcmpl" if prepared.kind == "chat" else "cmpl"), model)
    events = JobEvents(scheduler, prepared)
    if req.stream:
        return StreamingResponse(_stream(events, reply, shape, req.include_usage), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
    collecting = asyncio.ensure_future(_collect(events, reply, shape))
    gone = asyncio.ensure_future(_disconnected(http))
    await asyncio.wait({collecting, gone}, return_when=asyncio.FIRST_COMPLETED)
    gone.cancel()
    if not collecting.done():  # the client left: stop the job, answer nobody
        collecting.cancel()
        await asyncio.gather(collecting, return_exceptions=True)
        return JSONResponse(api.error_body("client disconnected", "invalid_request_error"), status_code=499)
    return collecting.result()


async def _stream(events: JobEvents, reply: Reply, shape: _ChatShape, include_usage: bool):
    for chunk in shape.start():
        yield api.sse(chunk)
    async for event in events:
        if isinstance(event, Tokens):
            for kind, text in reply.feed(event.ids):
                yield api.sse(shape.piece(kind, text))
        elif isinstance(event, Finished):
            for kind, text in reply.finish():
                yield api.sse(shape.piece(kind, text))
            timing = api.timings(event.stats, event.prompt_seconds, event.predicted_seconds)
            spec = api.speculation(event.stats, event.steps)
            yield api.sse({**shape.last(event.stats), "timings": timing, "dflash": spec})
            if include_usage:
                yield api.sse({**shape.last(event.stats), "choices": [], "usage": api.usage(event.stats)})
        else:
            yield api.sse(api.error_body(event.message, "server_error"))
    yield api.sse("[DONE]")


async def _collect(events: JobEvents, reply: Reply, shape: _ChatShape) -> JSONResponse:
    parts = {"content": [], "reasoning": []}
    async for event in events:
        if isinstance(event, Tokens):
            pieces = reply.feed(event.ids)
        elif isinstance(event, Finished):
            pieces = reply.finish()
        else:
            return JSONResponse(api.error_body(event.message, "server_error"), status_code=500)
        for kind, text in pieces:
            parts[kind].append(text)
    timing = api.timings(event.stats, event.prompt_seconds, event.predicted_seconds)
    return JSONResponse(shape.response("".join(parts["content"]), "".join(parts["reasoning"]), event.stats, timing,
                                       api.speculation(event.stats, event.steps)))


async def _disconnected(http: Request) -> None:
    """Returns when the client closes the connection (the body has been read by then)."""
    while (await http.receive())["type"] != "http.disconnect":
        pass
