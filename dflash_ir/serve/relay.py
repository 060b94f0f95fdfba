"""One HTTP request carried to an ASGI app in another process and its response carried back,
as a stream of picklable pieces: the response head, then body chunks.

`dflash-serve --ray` uses it on both sides: each engine replica runs the plain server's app on
the pieces it is sent (`call_app`), and the front rebuilds the HTTP response from the pieces
it gets back (`relay`). A replica that dies or stalls becomes an OpenAI-shaped error: a JSON
5xx before the head, an SSE error event after it; nothing waits longer than `timeout`.
"""
from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import AsyncIterator, Callable

from starlette.responses import JSONResponse, Response, StreamingResponse

from . import openai_api as api

# what of an ASGI HTTP scope the app reads, and can be pickled
SCOPE_KEYS = ("type", "asgi", "http_version", "method", "scheme", "path", "raw_path", "query_string", "root_path",
              "headers", "client", "server")


@dataclass(frozen=True)
class Head:
    """The response's status line and headers (ASGI's raw byte pairs)."""
    status: int
    headers: list[tuple[bytes, bytes]]

    @property
    def is_event_stream(self) -> bool:
        return any(k.lower() == b"content-type" and v.startswith(b"text/event-stream") for k, v in self.headers)


def portable_scope(scope: dict) -> dict:
    """The request's scope without what belongs to this process (app, state, extensions)."""
    return {k: scope[k] for k in SCOPE_KEYS if k in scope}


_running: set[asyncio.Task] = set()  # app calls, referenced until they end (the loop holds tasks weakly)


async def call_app(app, scope: dict, body: bytes) -> AsyncIterator[Head | bytes]:
    """Run `app` on one request; yield its Head, then its body chunks. A caller that stops
    early is a client that went away: the app receives `http.disconnect` (the plain
    server then cancels the job and frees its slot)."""
    sent: asyncio.Queue = asyncio.Queue()
    gone = asyncio.Event()
    body_given = False

    async def receive() -> dict:
        nonlocal body_given
        if not body_given:
            body_given = True
            return {"type": "http.request", "body": body, "more_body": False}
        await gone.wait()
        return {"type": "http.disconnect"}

    task = asyncio.ensure_future(app(dict(scope), receive, sent.put))
    task.add_done_callback(lambda _: sent.put_nowait(None))
    _running.add(task)
    task.add_done_callback(_running.discard)
    try:
        while (message := await sent.get()) is not None:
            if message["type"] == "http.response.start":
                yield Head(message["status"], [(bytes(k), bytes(v)) for k, v in message.get("headers", [])])
            elif message["type"] == "http.response.body":
                if message.get("body"):
                    yield bytes(message["body"])
                if not message.get("more_body", False):
                    return
        task.result()  # the app ended without a response: its exception, if any
        raise RuntimeError(f"the app sent no complete response to {scope.get('method')} {scope.get('path')}")
    finally:
        gone.set()


def error_response(error: api.RequestError) -> JSONResponse:
    return JSONResponse(error.body(), status_code=error.status, headers=error.headers)


async def relay(pieces: AsyncIterator[Head | bytes], *, timeout: float,
                describe: Callable[[BaseException], api.RequestError], cancel: Callable[[], None]) -> Response:
    """The HTTP response for the pieces of a `call_app` run elsewhere. `describe` turns a
    failure of the remote side into the error to send; `cancel` stops the remote run (called
    when the response ends early: a failure, a timeout, or this client going away)."""
    it = aiter(pieces)
    try:
        head = await _next(it, timeout)
    except BaseException as e:
        cancel()
        if isinstance(e, Exception):
            return error_response(describe(e))
        raise
    if not isinstance(head, Head):
        cancel()
        return error_response(describe(RuntimeError("the replica sent a body before the response head")))

    async def body():
        done = False
        try:
            while True:
                try:
                    chunk = await _next(it, timeout)
                except StopAsyncIteration:
                    done = True
                    return
                except Exception as e:  # the head is sent: say it inside the stream, where a client reads
                    if head.is_event_stream:
                        yield api.sse(describe(e).body()) + api.sse("[DONE]")
                    return
                yield chunk
        finally:
            if not done:
                cancel()

    response = StreamingResponse(body(), status_code=head.status)
    response.raw_headers = list(head.headers)
    return response


async def _next(it, timeout: float):
    try:
        return await asyncio.wait_for(anext(it), timeout)
    except asyncio.TimeoutError:
        raise TimeoutError(f"no answer from the replica for {timeout:g} s") from None

