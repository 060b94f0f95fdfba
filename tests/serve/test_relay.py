"""The relay between dflash-serve --ray's front and its replicas, without Ray: an app's response
carried as pieces and rebuilt byte for byte, and a replica that fails, stalls or is left
turned into OpenAI-shaped errors, never a hang."""
import asyncio
import json

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, StreamingResponse
from starlette.routing import Route

from dflash_ir.serve import openai_api as api
from dflash_ir.serve.relay import Head, call_app, portable_scope, relay

SSE = [("content-type", "text/event-stream; charset=utf-8")]


def scope(method: str, path: str, headers=()) -> dict:
    return {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": method, "scheme": "http",
            "path": path, "raw_path": path.encode(), "query_string": b"", "root_path": "",
            "headers": [(k.encode(), v.encode()) for k, v in headers], "client": ("127.0.0.1", 1),
            "server": ("127.0.0.1", 2)}


async def asgi_call(app, s: dict, body: bytes = b"") -> tuple[int, list, bytes]:
    """(status, raw headers, body) of `app` on one request, as a server would see it."""
    messages = []
    sent = False

    async def receive():
        nonlocal sent
        if sent:
            await asyncio.Event().wait()
        sent = True
        return {"type": "http.request", "body": body, "more_body": False}

    async def send(m):
        messages.append(m)

    await app(s, receive, send)
    start = messages[0]
    return start["status"], start["headers"], b"".join(m.get("body", b"") for m in messages[1:])


class Echo:
    """A small app: /echo answers the JSON body back, /count streams N events, /slow streams
    one event and then waits (and notes when it is told the client left)."""

    def __init__(self):
        self.left = asyncio.Event()

    def app(self) -> Starlette:
        async def echo(request: Request):
            return JSONResponse({"got": await request.json(), "path": request.url.path}, headers={"X-Test": "1"})

        async def count(request: Request):
            n = int(request.query_params["n"])
            return StreamingResponse((api.sse({"i": i}) for i in range(n)), media_type="text/event-stream")

        async def slow(request: Request):
            async def events():
                try:
                    yield api.sse({"i": 0})
                    await asyncio.sleep(30)
                finally:
                    self.left.set()
            return StreamingResponse(events(), media_type="text/event-stream")

        return Starlette(routes=[Route("/echo", echo, methods=["POST"]), Route("/count", count),
                                 Route("/slow", slow)])


def describe(e: BaseException) -> api.RequestError:
    return api.RequestError(f"replica failed: {e}", status=503, type="server_error", code="replica_failed")


async def asgi_response(response):
    return await asgi_call(response, scope("GET", "/"))


async def through_relay(app, s: dict, body: bytes = b""):
    cancelled = []
    response = await relay(call_app(app, s, body), timeout=5, describe=describe, cancel=lambda: cancelled.append(True))
    return (*await asgi_response(response), cancelled)


def test_a_relayed_response_is_the_apps_own():
    async def go():
        app = Echo().app()
        for s, body in ((scope("POST", "/echo", [("content-type", "application/json")]), b'{"a": [1, 2]}'),
                        ({**scope("GET", "/count"), "query_string": b"n=3"}, b"")):
            direct = await asgi_call(app, s, body)
            status, headers, got, cancelled = await through_relay(app, portable_scope({**s, "app": app}), body)
            assert (status, headers, got) == direct and not cancelled
        assert direct[2] == b"".join(api.sse({"i": i}).encode() for i in range(3))

    asyncio.run(go())


def test_portable_scope_keeps_what_the_app_reads_only():
    s = {**scope("GET", "/x"), "app": object(), "state": {}, "extensions": {}}
    assert portable_scope(s) == scope("GET", "/x")


async def failing(pieces, error):
    for p in pieces:
        yield p
    raise error


def test_a_replica_that_dies_before_answering_is_an_openai_5xx():
    async def go():
        cancelled = []
        response = await relay(failing([], RuntimeError("actor died")), timeout=5, describe=describe,
                               cancel=lambda: cancelled.append(True))
        status, _, body = await asgi_response(response)
        assert status == 503 and cancelled
        assert json.loads(body) == {"error": {"message": "replica failed: actor died", "type": "server_error",
                                              "param": None, "code": "replica_failed"}}

    asyncio.run(go())


def test_a_stream_cut_by_a_dying_replica_ends_with_an_error_event():
    async def go():
        cancelled = []
        head = Head(200, [(k.encode(), v.encode()) for k, v in SSE])
        first = api.sse({"i": 0}).encode()
        response = await relay(failing([head, first], RuntimeError("actor died")), timeout=5, describe=describe,
                               cancel=lambda: cancelled.append(True))
        status, _, body = await asgi_response(response)
        events = [e for e in body.decode().split("\n\n") if e]
        assert status == 200 and cancelled
        assert events == [first.decode().strip(), "data: " + json.dumps(describe(RuntimeError("actor died")).body()),
                          "data: [DONE]"]

    asyncio.run(go())


def test_a_replica_that_stalls_times_out():
    async def go():
        loop = asyncio.get_running_loop()
        start = loop.time()

        async def stalled():
            await asyncio.sleep(30)
            yield b""

        cancelled = []
        response = await relay(stalled(), timeout=0.2, describe=describe, cancel=lambda: cancelled.append(True))
        status, _, body = await asgi_response(response)
        assert status == 503 and cancelled and loop.time() - start < 5
        assert "no answer from the replica for 0.2 s" in json.loads(body)["error"]["message"]

    asyncio.run(go())


def test_a_caller_that_leaves_tells_the_app_its_client_went_away():
    async def go():
        echo = Echo()
        pieces = call_app(echo.app(), scope("GET", "/slow"), b"")
        assert isinstance(await anext(pieces), Head)
        assert await anext(pieces) == api.sse({"i": 0}).encode()
        await pieces.aclose()
        await asyncio.wait_for(echo.left.wait(), 5)

    asyncio.run(go())
